"""``IdTableEviction``: how an :class:`~recsdk.embedding.IdTable` chooses the rows it frees.

When new ids do not fit, the table's eviction policy picks victims among the rows that are
occupied, unpinned and not used by the batch at hand: the least recently used (LRU, by
``last_step``), the least frequently used, then least recently (LFU, by ``freq`` then
``last_step``), or the lowest show/click scores (score eviction, by the
:class:`~recsdk.embedding.id_table_scores.IdTableScores` per row; it frees at least its
``evict_fraction`` of the stored ids, and does so every ``every_steps`` steps if set), in one
``kthvalue`` over the rows below the high-water mark. By last use, that scan is shared by the
evictions of several steps (:class:`~recsdk.embedding.oldest_rows.OldestRows`: the same victims,
in the same order). A TTL policy also
frees, at each step, every such row idle for more than its ``max_idle_steps`` (and
:meth:`IdTableEviction.evict_idle` does it on demand). A mixin of ``IdTable``: it reads the
table's own arrays; nothing outside the table does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from recsdk.embedding.id_table_state import _INT32_MAX, _OCCUPIED
from recsdk.embedding.oldest_rows import OldestRows
from recsdk.embedding.policies import LFUEviction, ScoreEviction, TTLEviction

if TYPE_CHECKING:
    from recsdk.embedding.id_table_scores import IdTableScores
    from recsdk.embedding.policies import EvictionPolicy

_INT64_MAX = 2**63 - 1
_QUEUE_STEPS = 16  # a scan for the oldest rows finds this many steps' victims (at the step's count)
_QUEUE_MIN_ROWS = 4096

__all__ = ["IdTableEviction", "TableFullError"]


class TableFullError(RuntimeError):
    """Raised when an id table has no row for a new id and cannot free one.

    The table is left exactly as it was before the failing call.
    """


class IdTableEviction:
    """Victim choice and TTL sweeps of an :class:`~recsdk.embedding.IdTable` (a mixin of it)."""

    if TYPE_CHECKING:  # the table's arrays and helpers this mixin reads (defined by IdTable)
        _name: str
        _capacity: int
        _device: torch.device
        _eviction: EvictionPolicy | None
        _high_water: int
        _row_state: torch.Tensor
        _pins: torch.Tensor
        _last_step: torch.Tensor
        _freq: torch.Tensor
        _step: int
        _idle_floor: int
        _stats: dict[str, int]
        _size: int
        _scores: IdTableScores | None
        _oldest: OldestRows

        @property
        def _num_free(self) -> int: ...
        def _check_usable(self) -> None: ...
        def _free_rows(self, rows: torch.Tensor) -> None: ...

    def evict_idle(self, max_idle_steps: int | None = None) -> torch.Tensor:
        """Free every unpinned row idle for more than ``max_idle_steps`` steps (an explicit TTL sweep).

        Does not advance the step clock. Rows used at the latest step are never idle.

        Args:
            max_idle_steps (int | None): defaults to the table's :class:`TTLEviction` setting.

        Returns:
            torch.Tensor: the freed rows (int64, ascending).
        """
        if self._eviction is None:
            raise ValueError(
                f"IdTable '{self._name}': evict_idle needs an eviction policy (none is set, so the table "
                "keeps no idle metadata)"
            )
        if max_idle_steps is None:
            if not isinstance(self._eviction, TTLEviction):
                raise ValueError(
                    f"IdTable '{self._name}': evict_idle() without max_idle_steps needs a TTLEviction policy, "
                    f"the table has {self._eviction}"
                )
            max_idle_steps = self._eviction.max_idle_steps
        if isinstance(max_idle_steps, bool) or not isinstance(max_idle_steps, int) or max_idle_steps < 0:
            raise ValueError(f"IdTable '{self._name}': max_idle_steps must be an int >= 0, got {max_idle_steps!r}")
        self._check_usable()
        return self._sweep_idle(max_idle_steps, force=True)

    def _evictable(self) -> torch.Tensor:
        """Mask of the rows below the high-water mark eviction may free: occupied and unpinned."""
        hw = self._high_water
        return (self._row_state[:hw] == _OCCUPIED) & (self._pins[:hw] == 0)

    def _check_room(self, num_new: int, used: torch.Tensor | None) -> torch.Tensor:
        """Raise TableFullError (before any change) unless eviction can make room for ``num_new`` ids.

        Returns the mask (bool ``[high_water]``) of rows used by the batch, for :meth:`_evict`.
        """
        free = self._num_free
        base = (
            f"IdTable '{self._name}' (capacity {self._capacity}) is full: {num_new} new ids arrived with "
            f"{free} free rows"
        )
        if self._eviction is None or used is None:
            raise TableFullError(
                f"{base} and no eviction policy. Raise the capacity (num_embeddings of table '{self._name}') "
                "or set an eviction policy (LRUEviction, LFUEviction, TTLEviction or ScoreEviction)."
            )
        in_use = self._in_use(used)
        if self._by_last_use() and self._oldest.can_free(
            num_new - free, self._last_step, self._row_state, self._pins, in_use
        ):
            return in_use  # enough of the oldest rows may go: no scan of the whole table
        evictable = int((self._evictable() & ~in_use).sum())
        if free + evictable < num_new:
            raise TableFullError(
                f"{base}, and eviction can free only {evictable} rows (the others are pinned or used by this batch). "
                f"Raise the capacity (num_embeddings of table '{self._name}'), use smaller batches, or pin fewer "
                "batches."
            )
        return in_use

    def _in_use(self, used: torch.Tensor) -> torch.Tensor:
        """Mask (bool ``[high_water]``) of the rows in ``used`` (a batch's rows, ``capacity`` for misses)."""
        hw = self._high_water
        in_use = torch.zeros(hw + 1, dtype=torch.bool, device=self._device)
        in_use.index_fill_(0, used.clamp(max=hw), True)  # misses (row ``capacity``) land on entry ``hw``
        return in_use[:hw]

    def _evict_round(self, used: torch.Tensor) -> None:
        """A periodic score eviction round: the lowest-scored ``evict_fraction`` of the stored ids
        among the rows neither pinned nor in ``used``."""
        self._evict(0, self._in_use(used))

    def _evict(self, count: int, in_use: torch.Tensor) -> torch.Tensor:
        """Free ``count`` rows chosen by the eviction policy among evictable rows not in ``in_use``
        (score eviction: at least its ``evict_fraction`` of the stored ids, as far as there are)."""
        hw = self._high_water
        blocked = ~self._evictable()
        blocked |= in_use
        if isinstance(self._eviction, ScoreEviction):
            assert self._scores is not None
            key = self._scores.eviction_key(hw).masked_fill_(blocked, _INT64_MAX)
            round_size = min(int((~blocked).sum()), math.ceil(self._eviction.evict_fraction * self._size))
            count = max(count, round_size)
            if count == 0:
                return torch.zeros(0, dtype=torch.int64, device=self._device)
        elif isinstance(self._eviction, LFUEviction):
            key = (self._freq[:hw].long() << 31).bitwise_or_(self._last_step[:hw])
            key.masked_fill_(blocked, torch.iinfo(torch.int64).max)
        else:
            victims = self._oldest_victims(count, in_use)
            if victims is not None:
                self._free_rows(victims)
                self._stats["evictions"] += count
                return victims
            key = self._last_step[:hw].masked_fill(blocked, _INT32_MAX)
        kth = torch.kthvalue(key, count).values
        below = (key < kth).nonzero().squeeze(1)
        ties = (key == kth).nonzero().squeeze(1)[: count - below.numel()]
        victims = torch.cat([below, ties])
        self._free_rows(victims)
        self._stats["evictions"] += count
        return victims

    def _by_last_use(self) -> bool:
        """Whether victims are the least recently used rows (LRU; TTL when the table is full)."""
        return self._eviction is not None and not isinstance(self._eviction, (LFUEviction, ScoreEviction))

    def _oldest_victims(self, count: int, in_use: torch.Tensor) -> torch.Tensor | None:
        """The ``count`` least recently used rows that may go, from the queue of the oldest rows
        (scanned again when it runs short); None where even a fresh scan holds too few."""
        if count < 1:
            return None
        hw = self._high_water
        args = (self._last_step, self._row_state, self._pins, in_use)
        victims = self._oldest.take(count, *args)
        if victims is None:
            depth = max(_QUEUE_STEPS * count, _QUEUE_MIN_ROWS)
            self._oldest.refill(self._last_step[:hw], self._row_state[:hw] == _OCCUPIED, depth, self._step)
            victims = self._oldest.take(count, *args)
        return victims

    def _sweep_idle(self, max_idle_steps: int, force: bool = False) -> torch.Tensor:
        step = self._step
        if not force and step - self._idle_floor <= max_idle_steps:
            return torch.zeros(0, dtype=torch.int64, device=self._device)
        hw = self._high_water
        last_step = self._last_step[:hw]
        occupied = self._row_state[:hw] == _OCCUPIED
        expired = occupied & (self._pins[:hw] == 0) & (last_step < step - max_idle_steps)
        rows = expired.nonzero().squeeze(1)
        if rows.numel():
            self._free_rows(rows)
            self._stats["evictions"] += rows.numel()
            occupied[rows] = False
        # Rows stored later in this call get last_step == step, so the floor never exceeds it.
        floor = int(torch.where(occupied, last_step, _INT32_MAX).min()) if hw else step
        self._idle_floor = min(floor, step)
        return rows
