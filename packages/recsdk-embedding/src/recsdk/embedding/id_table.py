"""A collision-free map from raw int64 ids to embedding rows, with admission and eviction.

``IdTable`` is composed of parts that each own their arrays (all torch tensors on the table's
device, so every operation is whole-batch), and orchestrates them:

* the hash index from id to row (:mod:`~recsdk.embedding.slot_index`): on CPU, FBGEMM's native
  pruned-hashmap kernels (linear probing over ``(key, row)`` pairs, 1.4 slots per row); on other
  devices, double hashing in torch ops over int32 slots (a power of two, at least 1.5 slots per
  row, once grown to full size). Removal leaves a tombstone, and the table rehashes when stored
  ids plus tombstones pass 80% (torch index) or 90% (FBGEMM index) of the slots; the index starts
  small, and a rehash doubles it when stored ids would fill more than half of it.
* the rows (:class:`~recsdk.embedding.row_allocator.RowAllocator`): ``row_id`` (int64) and the
  row state (int8, :mod:`~recsdk.embedding.row_states`; occupancy lives there, never in the key,
  so every int64 value is a valid id), the free rows (a high-water mark and a stack below it;
  scans cover only the rows below the mark) and the rows to report as reassigned;
* eviction (:class:`~recsdk.embedding.id_table_eviction.IdTableEviction`): ``last_step`` and
  ``freq`` per row, the idle floor and the queue of the oldest rows; it chooses victims, the
  table frees them;
* pins (:class:`~recsdk.embedding.id_table_pins.IdTablePins`): int32 reference counts per row;
* admission (:class:`~recsdk.embedding.id_table_admission.IdTableAdmission`): the count sketch;
* show/click scores (:class:`~recsdk.embedding.id_table_scores.IdTableScores`);
* publishing (:class:`~recsdk.embedding.id_table_publishing.IdTablePublishing`): the change
  tracker, and a version's snapshot and commit;
* the state format (:class:`~recsdk.embedding.id_table_state.IdTableState`).

The table owns the step clock and the statistics. On CPU the per-row arrays are anonymous memory
maps, so a page becomes resident when a row on it is first written.
"""

from __future__ import annotations

from typing import Any

import torch

from recsdk.embedding.change_tracker import ChangeSnapshot, RowChangeTracker
from recsdk.embedding.id_table_admission import IdTableAdmission
from recsdk.embedding.id_table_eviction import IdTableEviction, TableFullError
from recsdk.embedding.id_table_inputs import check_usable, checked_clicks, checked_ids, checked_rows
from recsdk.embedding.id_table_pins import IdTablePins
from recsdk.embedding.id_table_publishing import IdTablePublishing
from recsdk.embedding.id_table_scores import IdTableScores, StepUnits
from recsdk.embedding.id_table_state import STAT_NAMES, STATE_KEYS, IdTableState
from recsdk.embedding.policies import (
    AdmissionPolicy,
    EvictionPolicy,
    ScoreAdmission,
    ScoreEviction,
    TTLEviction,
    check_policies,
    score_of,
)
from recsdk.embedding.row_allocator import RowAllocator
from recsdk.embedding.row_states import MAX_CAPACITY
from recsdk.embedding.slot_index import FbgemmSlotIndex, make_slot_index

__all__ = ["IdTable", "TableFullError"]


class IdTable:
    """Collision-free map from raw int64 ids to rows in ``[0, capacity)``.

    Two different ids never share a row, and an id keeps its row until it is evicted. Every
    operation works on a whole batch with torch tensor operations (no per-id Python loop), so
    the table runs on CPU, CUDA or NPU tensors alike. Any int64 value is a valid id, including
    ``0``, negative values, ``INT64_MIN`` and ``INT64_MAX``; int32 ids are sign-extended.

    One :meth:`find_or_insert` call is one step: it advances the step clock used by LRU and TTL,
    and counts each distinct id once for admission and LFU frequency. Steps are stored per row as
    int32, so a table serves up to ``2**31 - 1`` steps. The table is not thread-safe: callers that
    share one across threads serialise the calls.

    Args:
        capacity (int): number of rows (the embedding table's ``num_embeddings``).
        device (torch.device | str): where the table lives. ``"meta"`` allocates nothing and
            cannot be used for lookups (a placeholder for a module built on the meta device).
        admission (CountAdmission | ScoreAdmission | ProbabilisticAdmission | None): admit ids only
            after enough sightings, once their show/click score reaches a threshold, or by chance;
            None admits at once.
        eviction (LRUEviction | LFUEviction | TTLEviction | ScoreEviction | None): what frees rows
            when the table is full; None raises :class:`TableFullError` instead.
        name (str): table name, used in errors and statistics.
        report_first_use (bool): :meth:`take_reassigned_rows` also reports rows handed to an id
            for the first time, not only rows taken from evicted ids (for row stores that
            initialise a row when it is first used, such as a file-backed store).

    Memory: resident memory follows the rows the table uses, not its capacity. The hash index
    starts with the slots of a table of ``min(capacity, 65536)`` rows and doubles whenever the
    stored ids would fill more than half of them, up to its full size: on CPU 16 bytes per slot,
    ``ceil(1.4 * capacity)`` slots, so 22.4 bytes per row; elsewhere 4 bytes per slot, the power
    of two at or above ``1.5 * capacity`` slots, so 6 to 12 bytes per row. The per-row arrays (25
    bytes per row, with the free-row stack) are allocated for the whole capacity but, on CPU, as
    anonymous memory maps: the OS provides a page when it is first written, so only the pages of
    the rows handed out so far (and of the stack's depth) are resident. On other devices they are
    allocated and zeroed in full. Plus the admission counters (``4 * counter_slots`` bytes, fixed;
    ``8 *`` for :class:`ScoreAdmission`) and, with :class:`ScoreEviction`, 8 bytes per row of
    scores (lazily resident too; see :mod:`~recsdk.embedding.id_table_scores`).
    :attr:`memory_bytes` gives the allocated figure (the index at its current size),
    :func:`~recsdk.embedding.slot_index.index_bytes` the index's full size.

    Example::

        table = IdTable(1 << 20, eviction=LRUEviction(), name="user")
        rows = table.find_or_insert(torch.tensor([7, -3, 7, 2**63 - 1]))  # tensor([1, 0, 1, 2])
        table.find(torch.tensor([7, 8]))  # tensor([1, -1])
    """

    STATE_KEYS: tuple[str, ...] = STATE_KEYS
    """The keys of :meth:`state_dict`."""

    def __init__(
        self,
        capacity: int,
        *,
        device: torch.device | str = "cpu",
        admission: AdmissionPolicy | None = None,
        eviction: EvictionPolicy | None = None,
        name: str = "id_table",
        report_first_use: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"IdTable name must be a non-empty str, got {name!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"IdTable '{name}': capacity must be an int, got {type(capacity).__name__}")
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"IdTable '{name}': capacity must be in [1, {MAX_CAPACITY}], got {capacity}")
        check_policies(f"IdTable '{name}'", admission, eviction)
        dev = torch.device(device)
        self._name, self._capacity, self._device = name, capacity, dev
        self._admission_policy, self._eviction_policy = admission, eviction
        self._scores: IdTableScores | None = None  # show/click scores (ScoreAdmission, ScoreEviction)
        score = score_of(admission, eviction)
        if score is not None and dev.type != "meta":
            score_admission = admission if isinstance(admission, ScoreAdmission) else None
            per_row = isinstance(eviction, ScoreEviction)
            self._scores = IdTableScores(score, capacity, dev, admission=score_admission, per_row=per_row)
        self._rows = RowAllocator(capacity, dev, report_first_use=bool(report_first_use))
        self._index = make_slot_index(capacity, dev, self._rows.row_id)
        self._pins = IdTablePins(name, capacity, dev)
        self._eviction = IdTableEviction(
            name, eviction, self._rows, self._pins, self._scores, capacity=capacity, device=dev
        )
        self._admission = IdTableAdmission(admission, self._scores, dev)
        self._publishing = IdTablePublishing(self._rows, capacity, dev)
        parts = (self._rows, self._eviction, self._admission, self._scores)
        self._state = IdTableState(name, capacity, dev, (admission, eviction), *parts)
        self._step = 0
        self._stats = dict.fromkeys(STAT_NAMES, 0)

    # ------------------------------------------------------------------ properties

    @property
    def capacity(self) -> int:
        """Number of rows."""
        return self._capacity

    @property
    def name(self) -> str:
        """The table's name."""
        return self._name

    @property
    def device(self) -> torch.device:
        """Where the table's tensors live."""
        return self._device

    @property
    def admission(self) -> AdmissionPolicy | None:
        """The admission policy (None: admit at once)."""
        return self._admission_policy

    @property
    def eviction(self) -> EvictionPolicy | None:
        """The eviction policy (None: a full table raises :class:`TableFullError`)."""
        return self._eviction_policy

    @property
    def step(self) -> int:
        """Number of :meth:`find_or_insert` calls so far (restored by :meth:`load_state_dict`)."""
        return self._step

    @property
    def index_kind(self) -> str:
        """Which hash index maps ids to rows: ``"fbgemm"`` (FBGEMM's kernels, CPU) or ``"torch"``."""
        return "fbgemm" if isinstance(self._index, FbgemmSlotIndex) else "torch"

    @property
    def num_slots(self) -> int:
        """Number of slots of the hash index (see :mod:`recsdk.embedding.slot_index`)."""
        return self._index.num_slots

    @property
    def memory_bytes(self) -> int:
        """Bytes the table's tensors hold: the index's slots (current size), the per-row arrays
        (allocated for the whole capacity; on CPU resident only where written) and the admission
        counters."""
        tensors = self._rows.tensors() + self._eviction.tensors() + self._pins.tensors() + self._admission.tensors()
        if self._scores is not None:
            tensors += self._scores.tensors()
        return self._index.memory_bytes + sum(t.numel() * t.element_size() for t in tensors)

    @property
    def changes(self) -> RowChangeTracker | None:
        """The tracker of changed rows and departed ids (None until :meth:`track_changes`)."""
        return self._publishing.tracker

    def __len__(self) -> int:
        return self._rows.size

    def __repr__(self) -> str:
        return (
            f"IdTable(name={self._name!r}, capacity={self._capacity}, size={self._rows.size}, "
            f"device={self._device}, admission={self._admission_policy}, eviction={self._eviction_policy})"
        )

    # ------------------------------------------------------------------ mapping

    def find_or_insert(self, ids: torch.Tensor, clicks: torch.Tensor | None = None) -> torch.Tensor:
        """Map ids to rows, giving new admitted ids a row (one training step).

        Duplicates within the batch map to one row. Ids not (yet) admitted map to ``-1`` and get
        no row. When there are not enough free rows, the eviction policy frees rows that are
        neither pinned nor used by this batch; the freed rows handed to new ids are reported by
        :meth:`take_reassigned_rows`.

        Args:
            ids (torch.Tensor): int64 or int32 ids, any shape, on any device (moved to the table's).
            clicks (torch.Tensor | None): the clicks of each occurrence (same number of elements as
                ``ids``, floating point, finite, >= 0), for a show/click score
                (:class:`ShowClickScore`); None counts no clicks. Ignored by other policies.

        Returns:
            torch.Tensor: int64 rows, same shape as ``ids``, on the table's device; ``-1`` for ids
            not admitted.

        Raises:
            TableFullError: the new ids do not fit and no eviction policy is set, or eviction cannot
                free enough rows (all pinned or in use). The table is left unchanged.
            TypeError, ValueError: bad ``ids`` or ``clicks`` (the table is left unchanged).
        """
        flat, shape = self._as_ids(ids, "find_or_insert")
        where = f"IdTable '{self._name}'.find_or_insert"
        click_values = checked_clicks(clicks, flat.numel(), where) if clicks is not None else None
        rows = self._lookup(flat)
        evicting = self._eviction_policy is not None
        # Rows this batch holds, with misses sent to the spare metadata entry at index ``capacity``.
        used: torch.Tensor | None
        miss_idx: torch.Tensor | None
        if flat.numel() and int(rows.min()) >= 0:  # every id has its row (the steady state): no misses
            miss_idx, num_miss = None, 0
            used = rows if evicting else None
        else:
            miss = rows < 0
            miss_idx = miss.nonzero().squeeze(1)
            num_miss = miss_idx.numel()
            used = rows.masked_fill(miss, self._capacity) if evicting else None

        # Read-only phase: work out what to insert and whether it fits, before touching any state.
        units: StepUnits | None = None
        amounts = uniq_amounts = None  # score amounts per occurrence, and per distinct new id
        if self._scores is not None:
            units = self._scores.step_units(self._step + 1)
            amounts = units.amounts(flat.numel(), click_values, self._device)
        uniq = inverse = positions = estimate = admitted = None
        num_new = 0
        if num_miss:
            assert miss_idx is not None
            counted = self._admission.needs_counts
            found = torch.unique(flat.index_select(0, miss_idx), return_inverse=True, return_counts=counted)
            uniq, inverse = found[0], found[1]
            if amounts is not None:
                uniq_amounts = torch.zeros(uniq.numel(), dtype=torch.int64, device=self._device)
                uniq_amounts.index_add_(0, inverse, amounts.index_select(0, miss_idx))
            admitted, positions, estimate = self._admission.decide(
                uniq, found[2] if counted else None, uniq_amounts, units, self._step + 1
            )
            num_new = uniq.numel() if admitted is None else int(admitted.sum())
        in_use = None  # bool [high_water]: rows this batch holds (eviction never frees them in this call)
        if num_new > self._rows.num_free:
            in_use = self._eviction.check_room(num_new, used)

        # Commit phase.
        self._step += 1
        step = self._step
        self._stats["lookups"] += flat.numel()
        self._stats["hits"] += flat.numel() - num_miss
        if used is not None and num_miss < flat.numel():
            self._eviction.touch(used, step)
        if self._scores is not None and used is not None and amounts is not None:
            self._scores.add_hits(used, amounts)
        policy = self._eviction_policy
        if isinstance(policy, TTLEviction):
            self._free_evicted(self._eviction.idle_rows(policy.max_idle_steps, step))
        elif isinstance(policy, ScoreEviction) and policy.every_steps is not None:
            if step % policy.every_steps == 0 and used is not None:
                self._free_evicted(self._eviction.choose(0, self._eviction.in_use(used), step))
        if uniq is not None and inverse is not None:
            assert miss_idx is not None
            scores = self._admission.count(positions, estimate, uniq_amounts)
            self._stats["admission_rejects"] += uniq.numel() - num_new
            if num_new:
                uniq_rows = self._insert_admitted(uniq, admitted, scores, num_new, in_use)
                rows.index_copy_(0, miss_idx, uniq_rows.index_select(0, inverse))
        if self._scores is not None:
            self._scores.end_step(step, self._rows.high_water)
        return rows.view(shape)

    def _insert_admitted(
        self,
        uniq: torch.Tensor,
        admitted: torch.Tensor | None,
        scores: torch.Tensor | None,
        num_new: int,
        in_use: torch.Tensor | None,
    ) -> torch.Tensor:
        """The commit part of :meth:`find_or_insert` for the ``num_new`` admitted ids of ``uniq``
        (distinct ids without a row): make room, place them; returns the rows of ``uniq`` (-1 where
        not admitted)."""
        new_ids = uniq if admitted is None else uniq[admitted]
        shortfall = num_new - self._rows.num_free
        if shortfall > 0:
            assert in_use is not None  # shortfall > 0 implies num_new > free rows before the call
            self._free_evicted(self._eviction.choose(shortfall, in_use, self._step))
        new_rows = self._rows.pop(num_new)
        self._place(new_ids, new_rows, step=self._step)
        if self._scores is not None and scores is not None:
            self._scores.place(new_rows, scores if admitted is None else scores[admitted])
        self._stats["inserts"] += num_new
        if admitted is None:
            return new_rows
        uniq_rows = torch.full((uniq.numel(),), -1, dtype=torch.int64, device=self._device)
        uniq_rows[admitted] = new_rows
        return uniq_rows

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Map ids to rows without inserting anything (evaluation).

        Changes no state at all: not the step clock, eviction metadata, admission counts nor the
        statistics (lookups made through ``find`` are not counted in :meth:`stats`).

        Args:
            ids (torch.Tensor): int64 or int32 ids, any shape.

        Returns:
            torch.Tensor: int64 rows, same shape as ``ids``; ``-1`` for ids not in the table.
        """
        flat, shape = self._as_ids(ids, "find")
        return self._lookup(flat).view(shape)

    def scores(self, ids: torch.Tensor) -> torch.Tensor:
        """The show/click scores of ``ids`` at the current step (reads only).

        An id with a row has its row's score (with :class:`ScoreEviction`); an id without one, its
        admission sketch estimate (with :class:`ScoreAdmission`; an upper bound), else 0.

        Args:
            ids (torch.Tensor): int64 or int32 ids, any shape.

        Returns:
            torch.Tensor: float64 scores, same shape as ``ids``.

        Raises:
            ValueError: the table keeps no scores (neither policy is by score).
        """
        flat, shape = self._as_ids(ids, "scores")
        if self._scores is None:
            raise ValueError(
                f"IdTable '{self._name}' keeps no show/click scores: its admission ({self._admission_policy}) and "
                f"eviction ({self._eviction_policy}) are not ScoreAdmission / ScoreEviction"
            )
        return self._scores.of(flat, self._lookup(flat), self._step).view(shape)

    def take_reassigned_rows(self) -> torch.Tensor:
        """Rows handed to a new id after having held another one, since the last call; clears the list.

        With ``report_first_use``, every row handed to a new id is reported, its first use too.
        The caller re-initialises these embedding rows and resets their optimizer state before
        they are looked up.

        Returns:
            torch.Tensor: sorted distinct int64 rows on the table's device.
        """
        return self._rows.take_pending()

    def remove(self, ids: torch.Tensor) -> torch.Tensor:
        """Remove ids from the table and free their rows (e.g. to move them to another table).

        Args:
            ids (torch.Tensor): int64 or int32 ids, any shape; ids not in the table are ignored.

        Returns:
            torch.Tensor: int64 rows the ids held, same shape as ``ids``; ``-1`` for absent ids.

        Raises:
            ValueError: one of the rows is pinned (the table is left unchanged).
        """
        flat, shape = self._as_ids(ids, "remove")
        rows = self._lookup(flat)
        present = rows[rows >= 0].unique()
        if present.numel():
            if self._pins.any_pinned(present):
                raise ValueError(f"IdTable '{self._name}': remove of ids whose rows are pinned; unpin them first")
            self._free(present)
        return rows.view(shape)

    def ids_and_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored ids and their rows, in ascending row order.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: int64 ``ids [n]`` and int64 ``rows [n]``.
        """
        self._check_usable()
        return self._rows.ids_and_rows()

    def occupants(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids stored at ``rows`` and which of the rows hold one.

        Args:
            rows (torch.Tensor): int64 ``[n]`` rows in ``[0, capacity)``.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: int64 ``ids [n]`` (meaningless where not occupied)
            and bool ``occupied [n]``.
        """
        self._check_usable()
        return self._rows.occupants(rows)

    def stats(self) -> dict[str, Any]:
        """Table statistics.

        ``lookups``/``hits`` count ids (with repeats) passed to :meth:`find_or_insert` and found
        already stored; ``inserts`` counts ids given a row; ``evictions`` counts rows freed by the
        eviction policy (when full, or idle under TTL, or by score); ``admission_rejects`` counts,
        per call, the distinct ids refused a row by admission.

        Returns:
            dict: ``size``, ``capacity``, ``inserts``, ``evictions``, ``admission_rejects``,
            ``lookups``, ``hits`` (ints) and ``hit_rate`` (float, 0.0 before any lookup); with
            :class:`ScoreEviction` also ``score_sum`` and ``score_min`` (floats: the stored ids'
            show/click scores at the current step; 0.0 when empty).
        """
        out: dict[str, Any] = {"size": self._rows.size, "capacity": self._capacity}
        out.update(self._stats)
        out["hit_rate"] = self._stats["hits"] / self._stats["lookups"] if self._stats["lookups"] else 0.0
        if self._scores is not None and self._scores.per_row:
            rows = self._rows.occupied_rows()
            scores = self._scores.of_rows(rows, self._step)
            out["score_sum"] = float(scores.sum()) if rows.numel() else 0.0
            out["score_min"] = float(scores.min()) if rows.numel() else 0.0
        return out

    # ------------------------------------------------------------------ pins and eviction

    def pin(self, rows: torch.Tensor) -> None:
        """Protect rows from eviction and reassignment (reference-counted, int32 counts).

        Each occurrence of a row adds one reference; ``-1`` entries (ids not admitted) are ignored,
        so the output of :meth:`find_or_insert` can be passed as is.

        Args:
            rows (torch.Tensor): integer rows in ``[-1, capacity)``, any shape.
        """
        self._pins.add(self._as_rows(rows, "pin", allow_missing=True))

    def unpin(self, rows: torch.Tensor) -> None:
        """Drop references taken by :meth:`pin` (same rows, same multiplicity).

        Raises:
            ValueError: a row would drop below zero references (the table is left unchanged).
        """
        self._pins.drop(self._as_rows(rows, "unpin", allow_missing=True))

    def num_pinned(self) -> int:
        """Number of rows with at least one pin."""
        return self._pins.num_pinned(self._rows.high_water)

    def evict_idle(self, max_idle_steps: int | None = None) -> torch.Tensor:
        """Free every unpinned row idle for more than ``max_idle_steps`` steps (an explicit TTL sweep).

        Does not advance the step clock. Rows used at the latest step are never idle.

        Args:
            max_idle_steps (int | None): defaults to the table's :class:`TTLEviction` setting.

        Returns:
            torch.Tensor: the freed rows (int64, ascending).
        """
        limit = self._eviction.idle_limit(max_idle_steps)
        self._check_usable()
        rows = self._eviction.idle_rows(limit, self._step, force=True)
        self._free_evicted(rows)
        return rows

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The table's full state as tensors (pins are runtime state and are not included).

        Keys (:attr:`STATE_KEYS`): ``capacity``, ``step`` (scalars); ``ids``, ``rows``,
        ``last_step``, ``freq`` (one entry per stored id, ascending rows); ``free_rows`` (the
        free-row stack, bottom to top, under the rows never handed out, ``capacity - 1`` down to
        the high-water mark); ``retired_rows`` (free rows whose embedding holds a former id);
        ``reassigned_rows`` (not yet taken by :meth:`take_reassigned_rows`);
        ``admission_counters`` (empty without a sketch); ``stats`` (int64 ``[5]``: inserts,
        evictions, admission_rejects, lookups, hits); ``scores`` (int64, one per stored id with
        :class:`ScoreEviction`, else empty) and ``score_counters`` (the :class:`ScoreAdmission`
        sketch, else empty): show/click scores in fixed point in the units of step ``score_ref``
        (a scalar; see :mod:`~recsdk.embedding.id_table_scores`).
        """
        self._check_usable()
        return self._state.state_dict(step=self._step, stats=self._stats)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore a state from :meth:`state_dict` of a table with the same capacity.

        The slot layout is rebuilt from the ids. The state is validated first (as by
        :meth:`check_state_dict`); on error the table is left unchanged.

        Raises:
            ValueError: missing keys, another capacity, inconsistent ids/rows, or counters of another size.
            RuntimeError: some rows of this table are pinned.
        """
        self._check_usable()
        sd = self._state.checked(state_dict)
        self._check_unpinned()
        self._reset()
        self._rows.restore(sd["free_rows"], sd["retired_rows"], sd["reassigned_rows"])
        self._restore(sd)

    def check_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state_dict``; changes nothing.

        Lets a caller that restores several tables (and their embeddings) validate every state
        before it modifies any of them.

        Args:
            state_dict (dict[str, torch.Tensor]): a state from :meth:`state_dict`.

        Raises:
            ValueError: as :meth:`load_state_dict` (pins are not checked here).
        """
        self._check_usable()
        self._state.checked(state_dict)

    def rebuild(
        self,
        ids: torch.Tensor,
        *,
        last_step: torch.Tensor,
        freq: torch.Tensor,
        step: int,
        admission_counters: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        score_counters: torch.Tensor | None = None,
        score_ref: int | None = None,
    ) -> None:
        """Replace the table's contents by ``ids`` at rows ``0..n-1``, in the given order.

        For rebuilding a table from ids and their metadata gathered elsewhere (e.g. a checkpoint
        loaded on another world size): id ``ids[i]`` gets row ``i`` with its ``last_step`` and
        ``freq``. The other rows are free, handed out in ascending order, and each is reported by
        :meth:`take_reassigned_rows` when handed to an id (its embedding row may hold another
        model's values, so the caller re-initialises it). The step clock is set to ``step``, the
        admission counters to ``admission_counters``, and the statistics start from zero. On
        error the table is left unchanged.

        Args:
            ids (torch.Tensor): int64/int32 ``[n]`` distinct ids, ``n <= capacity``.
            last_step (torch.Tensor): integer ``[n]`` step each id was last used, in ``[0, 2**31 - 1]``.
            freq (torch.Tensor): integer ``[n]`` LFU frequencies, in ``[0, 2**31 - 1]``.
            step (int): the step clock, ``>= 0``.
            admission_counters (torch.Tensor | None): the count-min sketch's counters (as in
                :meth:`state_dict`); None or empty for a table without a sketch, and None resets
                a sketch to zero.
            scores (torch.Tensor | None): int64 ``[n]`` stored show/click scores of the ids (as in
                :meth:`state_dict`), for :class:`ScoreEviction`; None: zeros.
            score_counters (torch.Tensor | None): the :class:`ScoreAdmission` sketch; None: zeros.
            score_ref (int | None): the reference step of ``scores`` and ``score_counters`` (None: ``step``).

        Raises:
            ValueError: more ids than rows, repeated ids, metadata or counters of the wrong size
                or out of range.
            RuntimeError: some rows of this table are pinned.

        Example::

            table = IdTable(8, eviction=LRUEviction())
            table.rebuild(torch.tensor([42, 7]), last_step=torch.tensor([3, 5]), freq=torch.ones(2), step=5)
            table.find(torch.tensor([7, 42]))  # tensor([1, 0])
        """
        flat, _ = self._as_ids(ids, "rebuild")
        sd = self._state.checked_rebuild(
            flat,
            last_step=last_step,
            freq=freq,
            step=step,
            admission_counters=admission_counters,
            scores=scores,
            score_counters=score_counters,
            score_ref=score_ref,
        )
        self._check_unpinned()
        self._reset()
        self._rows.restore_prefix(flat.numel())
        self._restore(sd)

    def insert_at(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        *,
        last_step: torch.Tensor | None = None,
        freq: torch.Tensor | None = None,
    ) -> None:
        """Store given ``(id, row)`` pairs, e.g. to rebuild a table from another one's ids.

        Bypasses admission. The rows are not reported by :meth:`take_reassigned_rows`: the caller
        provides their embedding values.

        Args:
            ids (torch.Tensor): int64/int32 ``[n]`` distinct ids, none already in the table.
            rows (torch.Tensor): integer ``[n]`` distinct free rows in ``[0, capacity)``.
            last_step (torch.Tensor | None): int ``[n]`` step each id was last used; defaults to the current step.
            freq (torch.Tensor | None): int ``[n]`` LFU frequencies; defaults to 1.

        Raises:
            ValueError: on any of the conditions above (the table is left unchanged).
        """
        flat, _ = self._as_ids(ids, "insert_at")
        flat_rows = self._as_rows(rows, "insert_at", allow_missing=False)
        meta = self._state.checked_insert_at(flat, flat_rows, last_step=last_step, freq=freq, find=self._lookup)
        if flat.numel() == 0:
            return
        self._rows.claim(flat_rows)
        self._place(flat, flat_rows, step=self._step)
        self._eviction.given(flat_rows, meta.get("last_step"), meta.get("freq"))
        self._stats["inserts"] += flat.numel()

    # ------------------------------------------------------------------ publishing and serving

    def track_changes(self) -> RowChangeTracker:
        """Track which rows change and which ids leave from now on, for versions published to
        serving (:class:`~recsdk.embedding.change_tracker.RowChangeTracker`); idempotent.

        The table stamps the rows it places ids in and frees; whoever trains the rows stamps those
        (``table.changes.changed(rows)``). Replacing the table's state (:meth:`load_state_dict`,
        :meth:`rebuild`) resets the tracker.

        Returns:
            RowChangeTracker: the table's tracker.
        """
        self._check_usable()
        return self._publishing.track()

    def snapshot_changes(self, *, full: bool, exclude: torch.Tensor | None = None) -> ChangeSnapshot:
        """What the table's next published version holds; changes nothing but the tracker's epoch
        (starts tracking first, as :meth:`track_changes`). Call under the lock that serialises
        the table's other callers.

        Args:
            full (bool): every id (a full version), or only the changes since the last commit.
            exclude (torch.Tensor | None): rows owed a reset: their ids are left out (and stay
                changed for the next version).

        Returns:
            ChangeSnapshot: ids and rows ascending by row, the deleted ids ascending.

        Example::

            snap = table.snapshot_changes(full=False, exclude=owed_rows)
            ...  # write snap.ids with their rows, and snap.deleted
            table.commit_changes(snap, token="9f3a...")
        """
        self._check_usable()
        return self._publishing.snapshot(full=full, exclude=exclude, find=self._lookup)

    def commit_changes(self, snap: ChangeSnapshot, token: str) -> None:
        """The version holding ``snap`` (from :meth:`snapshot_changes`) is published as ``token``:
        its ids count as published from now on. Ids of ``snap`` whose rows changed hands since the
        snapshot count as departed (the next version deletes them). Call under the same lock as
        :meth:`snapshot_changes`."""
        self._check_usable()
        self._publishing.commit(snap, token)

    def index_state(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The hash index as FBGEMM's ``pruned_hashmap_lookup`` reads it, for a lookup outside Python
        (a serving module under TorchScript): see :meth:`FbgemmSlotIndex.kernel_state`.

        Raises:
            RuntimeError: the table's index is not FBGEMM's (not on CPU, or FBGEMM not loaded).
        """
        if not isinstance(self._index, FbgemmSlotIndex):
            raise RuntimeError(f"IdTable '{self._name}': its index is {self.index_kind!r}, not FBGEMM's (CPU)")
        return self._index.kernel_state()

    # ------------------------------------------------------------------ internals

    def _reset(self) -> None:
        """Every part fresh: no ids, a new index, clock and statistics at zero (the tracker too:
        the rows' ids are replaced wholesale, so the next version is full)."""
        self._rows.reset()
        self._index = make_slot_index(self._capacity, self._device, self._rows.row_id)
        self._pins.reset()
        self._eviction.reset()
        self._admission.reset()
        if self._scores is not None:
            self._scores.reset()
        self._publishing.reset()
        self._step = 0
        self._stats = dict.fromkeys(STAT_NAMES, 0)

    def _restore(self, sd: dict[str, torch.Tensor]) -> None:
        """Place a checked state's ids at its rows in a freshly reset table whose free rows are set,
        then its metadata, counters, scores, clock and statistics."""
        self._place(sd["ids"], sd["rows"], step=0)
        self._step, self._stats = self._state.restore(sd)

    def _check_unpinned(self) -> None:
        """Raise while some rows are pinned (a batch in flight holds them): nothing may replace them."""
        pinned = self.num_pinned()
        if pinned:
            raise RuntimeError(f"IdTable '{self._name}': load_state_dict while {pinned} rows are pinned")

    def _check_usable(self) -> None:
        check_usable(self._name, self._device)

    def _as_ids(self, ids: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Size]:
        check_usable(self._name, self._device)
        return checked_ids(ids, f"IdTable '{self._name}'.{op}", self._device)

    def _as_rows(self, rows: torch.Tensor, op: str, *, allow_missing: bool) -> torch.Tensor:
        check_usable(self._name, self._device)
        where = f"IdTable '{self._name}'.{op}"
        return checked_rows(rows, where, self._capacity, self._device, allow_missing=allow_missing)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (int64 ``[n]``), ``-1`` where absent. Reads only."""
        n = ids.numel()
        if n == 0 or self._rows.size == 0:
            return torch.full((n,), -1, dtype=torch.int64, device=self._device)
        return self._index.lookup(ids)

    def _place(self, ids: torch.Tensor, rows: torch.Tensor, *, step: int) -> None:
        """Store distinct new ids at free rows already taken (:meth:`RowAllocator.pop` or ``claim``)."""
        stored = self._rows.size + ids.numel()
        if not self._index.fits(stored):  # rebuild the index from the stored ids, grown first if needed
            self._index.clear(stored)
            held, at = self._rows.ids_and_rows()
            if at.numel():
                self._index.insert(held, at)
        self._index.insert(ids, rows)
        self._rows.occupy(ids, rows)
        self._eviction.placed(rows, step)
        if self._scores is not None:
            self._scores.place(rows, torch.zeros(rows.numel(), dtype=torch.int64, device=self._device))
        self._publishing.placed(rows)

    def _free(self, rows: torch.Tensor) -> None:
        """Remove the ids of distinct occupied ``rows``; the rows go back to the free stack."""
        ids = self._rows.release(rows)
        self._index.remove(ids, rows)
        self._publishing.freed(rows, ids)

    def _free_evicted(self, rows: torch.Tensor) -> None:
        """Free the victims eviction chose (none: nothing), counted as evictions."""
        if rows.numel():
            self._free(rows)
            self._stats["evictions"] += rows.numel()
