"""``IdTableSteps``: the steps of an :class:`~recsdk.embedding.IdTable` (one
:meth:`~recsdk.embedding.IdTable.find_or_insert` call each), its step clock and its statistics.

A step has two halves. The first reads only (:class:`StepPlan`): it looks the ids up, and for
those without a row works out which are admitted (deduplicated, with their occurrences or
show/click amounts as the admission policy needs) and whether they fit, raising
:class:`~recsdk.embedding.TableFullError` when even eviction cannot make room; so a refused step
leaves the table as it was. The second commits: it advances the clock, counts, touches the
eviction metadata and scores of the rows used, runs the policy's sweeps, frees the victims
eviction chooses and places the admitted ids.

Example::

    steps = IdTableSteps(rows, row_map, admission, eviction, scores, policy=LRUEviction(), ...)
    rows_of_ids = steps.run(flat_ids, clicks=None)  # int64, -1 for ids not admitted
    steps.step, steps.counts()["inserts"]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsdk.embedding.id_table_admission import IdTableAdmission
from recsdk.embedding.id_table_eviction import IdTableEviction
from recsdk.embedding.id_table_scores import IdTableScores, StepUnits
from recsdk.embedding.policies import EvictionPolicy, ScoreEviction, TTLEviction
from recsdk.embedding.row_allocator import RowAllocator
from recsdk.embedding.row_map import RowMap

__all__ = ["STAT_NAMES", "IdTableSteps", "StepPlan"]

STAT_NAMES = ("inserts", "evictions", "admission_rejects", "lookups", "hits")
"""The statistics a table counts (and its state holds, in this order)."""


@dataclass(slots=True)
class StepPlan:
    """What one step does, worked out before it changes anything.

    Attributes:
        rows (torch.Tensor): int64 ``[n]`` the ids' rows, ``-1`` for ids without one yet.
        used (torch.Tensor | None): the rows with misses on the spare entry ``capacity`` (None
            without an eviction policy).
        num_miss (int): ids without a row.
        miss_idx (torch.Tensor | None): their positions (None: none).
        amounts (torch.Tensor | None): int64 ``[n]`` score amounts per occurrence (show/click scores).
        uniq (torch.Tensor | None): the distinct ids without a row (None: none).
        inverse (torch.Tensor | None): each miss's index in ``uniq``.
        uniq_amounts (torch.Tensor | None): the amounts of each of ``uniq``.
        admitted (torch.Tensor | None): bool, which of ``uniq`` are admitted (None: all).
        positions (torch.Tensor | None): their admission sketch positions.
        estimate (torch.Tensor | None): their admission sketch estimates.
        num_new (int): admitted ids.
        in_use (torch.Tensor | None): bool ``[high_water]`` the rows the batch holds, when
            eviction must make room (None: the free rows suffice).
    """

    rows: torch.Tensor
    used: torch.Tensor | None
    num_miss: int
    miss_idx: torch.Tensor | None = None
    amounts: torch.Tensor | None = None
    uniq: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    uniq_amounts: torch.Tensor | None = None
    admitted: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    estimate: torch.Tensor | None = None
    num_new: int = 0
    in_use: torch.Tensor | None = None


class IdTableSteps:
    """The step clock, statistics and steps of one id table.

    Args:
        rows (RowAllocator): the table's rows (free rows, taken for new ids).
        row_map (RowMap): looks ids up, places new ids, frees victims.
        admission (IdTableAdmission): decides and counts the ids without a row.
        eviction (IdTableEviction): touches the rows used, chooses victims.
        scores (IdTableScores | None): the show/click scores.
        policy (EvictionPolicy | None): the table's eviction policy.
        capacity (int): the table's rows.
        device (torch.device): the table's device.
    """

    def __init__(
        self,
        rows: RowAllocator,
        row_map: RowMap,
        admission: IdTableAdmission,
        eviction: IdTableEviction,
        scores: IdTableScores | None,
        *,
        policy: EvictionPolicy | None,
        capacity: int,
        device: torch.device,
    ) -> None:
        self._rows = rows
        self._map = row_map
        self._admission = admission
        self._eviction = eviction
        self._scores = scores
        self._policy = policy
        self._capacity = capacity
        self._device = device
        self.reset()

    @property
    def step(self) -> int:
        """Steps made so far."""
        return self._step

    def counts(self) -> dict[str, int]:
        """The statistics (:data:`STAT_NAMES`), a copy."""
        return dict(self._stats)

    def reset(self) -> None:
        """Clock and statistics at zero."""
        self._step = 0
        self._stats = dict.fromkeys(STAT_NAMES, 0)

    def restore(self, step: int, stats: dict[str, int]) -> None:
        """Set the clock and statistics (a state load)."""
        self._step, self._stats = step, dict(stats)

    def count_inserts(self, n: int) -> None:
        """``n`` ids were given rows outside a step (:meth:`IdTableState.insert_at`)."""
        self._stats["inserts"] += n

    def free_evicted(self, rows: torch.Tensor) -> None:
        """Free the victims eviction chose (none: nothing), counted as evictions."""
        if rows.numel():
            self._map.free(rows)
            self._stats["evictions"] += rows.numel()

    def run(self, flat: torch.Tensor, clicks: torch.Tensor | None) -> torch.Tensor:
        """One step for int64 ids ``flat [n]`` (checked ``clicks [n]`` or None).

        Returns:
            torch.Tensor: int64 ``[n]`` rows, ``-1`` for ids not admitted.

        Raises:
            TableFullError: the admitted ids do not fit (nothing changed).
        """
        plan = self._plan(flat, clicks, self._map.lookup(flat), self._step + 1)  # reads only
        self._step += 1
        step, n, used = self._step, flat.numel(), plan.used
        self._stats["lookups"] += n
        self._stats["hits"] += n - plan.num_miss
        if used is not None and plan.num_miss < n:
            self._eviction.touch(used, step)
        if self._scores is not None and used is not None and plan.amounts is not None:
            self._scores.add_hits(used, plan.amounts)
        policy = self._policy
        if isinstance(policy, TTLEviction):
            self.free_evicted(self._eviction.idle_rows(policy.max_idle_steps, step))
        elif isinstance(policy, ScoreEviction) and policy.every_steps is not None:
            if step % policy.every_steps == 0 and used is not None:
                self.free_evicted(self._eviction.choose(0, self._eviction.in_use(used), step))
        if plan.uniq is not None and plan.inverse is not None and plan.miss_idx is not None:
            scores = self._admission.count(plan.positions, plan.estimate, plan.uniq_amounts)
            self._stats["admission_rejects"] += plan.uniq.numel() - plan.num_new
            if plan.num_new:
                uniq_rows = self._insert(plan.uniq, plan.admitted, scores, plan.num_new, plan.in_use)
                plan.rows.index_copy_(0, plan.miss_idx, uniq_rows.index_select(0, plan.inverse))
        if self._scores is not None:
            self._scores.end_step(step, self._rows.high_water)
        return plan.rows

    def _plan(self, flat: torch.Tensor, clicks: torch.Tensor | None, rows: torch.Tensor, step: int) -> StepPlan:
        """The plan of step ``step`` for ids ``flat`` whose rows are ``rows`` (``-1`` where absent)."""
        evicting = self._policy is not None
        if flat.numel() and int(rows.min()) >= 0:  # every id has its row (the steady state): no misses
            plan = StepPlan(rows, rows if evicting else None, 0)
        else:
            miss = rows < 0
            miss_idx = miss.nonzero().squeeze(1)
            plan = StepPlan(
                rows, rows.masked_fill(miss, self._capacity) if evicting else None, miss_idx.numel(), miss_idx
            )
        units: StepUnits | None = None
        if self._scores is not None:
            units = self._scores.step_units(step)
            plan.amounts = units.amounts(flat.numel(), clicks, self._device)
        if plan.num_miss:
            assert plan.miss_idx is not None
            counted = self._admission.needs_counts
            found = torch.unique(flat.index_select(0, plan.miss_idx), return_inverse=True, return_counts=counted)
            plan.uniq, plan.inverse = found[0], found[1]
            if plan.amounts is not None:
                plan.uniq_amounts = torch.zeros(plan.uniq.numel(), dtype=torch.int64, device=self._device)
                plan.uniq_amounts.index_add_(0, plan.inverse, plan.amounts.index_select(0, plan.miss_idx))
            plan.admitted, plan.positions, plan.estimate = self._admission.decide(
                plan.uniq, found[2] if counted else None, plan.uniq_amounts, units, step
            )
            plan.num_new = plan.uniq.numel() if plan.admitted is None else int(plan.admitted.sum())
        if plan.num_new > self._rows.num_free:
            plan.in_use = self._eviction.check_room(plan.num_new, plan.used)
        return plan

    def _insert(
        self,
        uniq: torch.Tensor,
        admitted: torch.Tensor | None,
        scores: torch.Tensor | None,
        num_new: int,
        in_use: torch.Tensor | None,
    ) -> torch.Tensor:
        """Make room for and place the ``num_new`` admitted ids of ``uniq`` (distinct ids without a
        row); returns the rows of ``uniq`` (-1 where not admitted)."""
        new_ids = uniq if admitted is None else uniq[admitted]
        shortfall = num_new - self._rows.num_free
        if shortfall > 0:
            assert in_use is not None  # shortfall > 0 implies num_new > free rows before the call
            self.free_evicted(self._eviction.choose(shortfall, in_use, self._step))
        new_rows = self._rows.pop(num_new)
        self._map.place(new_ids, new_rows, step=self._step)
        if self._scores is not None and scores is not None:
            self._scores.place(new_rows, scores if admitted is None else scores[admitted])
        self._stats["inserts"] += num_new
        if admitted is None:
            return new_rows
        uniq_rows = torch.full((uniq.numel(),), -1, dtype=torch.int64, device=self._device)
        uniq_rows[admitted] = new_rows
        return uniq_rows
