"""``IdTableEviction``: how an :class:`~recsdk.embedding.IdTable` chooses the rows it frees.

When new ids do not fit, the table's eviction policy picks victims among the rows that are
occupied, unpinned and not used by the batch at hand: the least recently used (LRU, by
``last_step``), the least frequently used, then least recently (LFU, by ``freq`` then
``last_step``), or the lowest show/click scores (score eviction, by the
:class:`~recsdk.embedding.id_table_scores.IdTableScores` per row; it frees at least its
``evict_fraction`` of the stored ids, and does so every ``every_steps`` steps if set), in one
``kthvalue`` over the rows below the high-water mark. By last use, that scan is shared by the
evictions of several steps (:class:`~recsdk.embedding.oldest_rows.OldestRows`: the same victims,
in the same order). A TTL policy also frees, at each step, every such row idle for more than its
``max_idle_steps`` (and :meth:`IdTable.evict_idle` does it on demand).

A part of ``IdTable``: it owns the eviction metadata per row (``last_step`` and ``freq``, int32,
with a spare entry at index ``capacity`` that absorbs the writes of ids without a row), the idle
floor and the queue of the oldest rows. It *chooses* victims, reading the row states of the
table's :class:`~recsdk.embedding.row_allocator.RowAllocator` and the counts of its
:class:`~recsdk.embedding.id_table_pins.IdTablePins`; the table frees them.
"""

from __future__ import annotations

import math

import torch

from recsdk.embedding.id_table_pins import IdTablePins
from recsdk.embedding.id_table_scores import IdTableScores
from recsdk.embedding.lazy_memory import lazy_zeros
from recsdk.embedding.oldest_rows import OldestRows, RowsInUse
from recsdk.embedding.policies import EvictionPolicy, LFUEviction, ScoreEviction, TTLEviction
from recsdk.embedding.row_allocator import RowAllocator
from recsdk.embedding.row_states import INT32_MAX, OCCUPIED
from recsdk.embedding.slot_kernels import native_slot_kernels

_INT64_MAX = 2**63 - 1
_QUEUE_STEPS = 16  # a scan for the oldest rows finds this many steps' victims (at the step's count)
_QUEUE_MIN_ROWS = 4096

__all__ = ["IdTableEviction", "TableFullError"]


class TableFullError(RuntimeError):
    """Raised when an id table has no row for a new id and cannot free one.

    The table is left exactly as it was before the failing call.
    """


class IdTableEviction:
    """Eviction metadata and victim choice of one id table.

    Args:
        name (str): the table's name, for errors.
        policy (EvictionPolicy | None): the table's eviction policy (None: a full table raises).
        rows (RowAllocator): the table's rows (read: states, free rows, the mark).
        pins (IdTablePins): the table's pins (read).
        scores (IdTableScores | None): the table's show/click scores (read, score eviction).

    Example::

        in_use = eviction.check_room(num_new, used, step)  # raises TableFullError, changes nothing
        victims = eviction.choose(num_new - rows.num_free, in_use)
        ...  # the table frees the victims
    """

    def __init__(
        self,
        name: str,
        policy: EvictionPolicy | None,
        rows: RowAllocator,
        pins: IdTablePins,
        scores: IdTableScores | None,
        *,
        capacity: int,
        device: torch.device,
    ) -> None:
        self._name = name
        self._policy = policy
        self._rows = rows
        self._pins = pins
        self._scores = scores
        self._capacity = capacity
        self._device = device
        kernels = native_slot_kernels() if torch.device(device).type == "cpu" else None
        self._oldest = OldestRows(OCCUPIED, kernels)  # the least recently used rows, for several evictions
        self.reset()

    def reset(self) -> None:
        """Fresh metadata (zeros), no idle floor, no queue."""
        cap, dev = self._capacity, self._device
        # One spare entry at index ``capacity`` absorbs writes for ids without a row.
        self._last_step_buf = lazy_zeros(cap + 1, torch.int32, dev)
        self._freq_buf = lazy_zeros(cap + 1, torch.int32, dev)
        self._last_step = self._last_step_buf[:cap]
        self._freq = self._freq_buf[:cap]
        self._idle_floor = 0  # no occupied row has last_step below this
        self._oldest.clear()

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (for memory accounting)."""
        return [self._last_step_buf, self._freq_buf]

    # ------------------------------------------------------------------ metadata

    def touch(self, used: torch.Tensor, step: int) -> None:
        """Eviction metadata of the rows a step uses (``used``: rows, misses on the spare entry)."""
        if self._policy is None:
            return
        self._last_step_buf.index_fill_(0, used, step)
        if isinstance(self._policy, LFUEviction):
            freq = self._freq_buf.index_select(0, used).clamp_(max=INT32_MAX - 1).add_(1)
            self._freq_buf.index_put_((used,), freq)  # repeats write equal values: +1 per step

    def placed(self, rows: torch.Tensor, step: int) -> None:
        """Rows just given to new ids at ``step``."""
        self._last_step.index_fill_(0, rows, step)
        self._freq.index_fill_(0, rows, 1)

    def metadata(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 ``last_step`` and ``freq`` of ``rows`` (copies)."""
        return self._last_step[rows], self._freq[rows]

    def restore(self, rows: torch.Tensor, last_step: torch.Tensor, freq: torch.Tensor) -> None:
        """Write the metadata of ``rows`` just placed in a fresh table (a load or a rebuild)."""
        self._last_step[rows] = last_step.to(torch.int32)
        self._freq[rows] = freq.to(torch.int32)

    def given(self, rows: torch.Tensor, last_step: torch.Tensor | None, freq: torch.Tensor | None) -> None:
        """Rows just placed with given int32 metadata (:meth:`IdTableState.insert_at`; None: as placed)."""
        self._idle_floor = 0
        if last_step is not None:
            self._last_step[rows] = last_step
            self._oldest.clear()  # last steps written out of order
        if freq is not None:
            self._freq[rows] = freq

    # ------------------------------------------------------------------ victims

    def check_room(self, num_new: int, used: torch.Tensor | None) -> torch.Tensor:
        """Raise :class:`TableFullError` (changing nothing) unless eviction can make room for
        ``num_new`` ids beside the free rows.

        Args:
            num_new (int): ids to place.
            used (torch.Tensor | None): the batch's rows, ``capacity`` for misses (None without a policy).

        Returns:
            torch.Tensor: bool ``[high_water]``, the rows the batch uses (for :meth:`choose`).
        """
        free = self._rows.num_free
        base = (
            f"IdTable '{self._name}' (capacity {self._capacity}) is full: {num_new} new ids arrived with "
            f"{free} free rows"
        )
        if self._policy is None or used is None:
            raise TableFullError(
                f"{base} and no eviction policy. Raise the capacity (num_embeddings of table '{self._name}') "
                "or set an eviction policy (LRUEviction, LFUEviction, TTLEviction or ScoreEviction)."
            )
        in_use = self.in_use(used)
        if self._by_last_use() and self._oldest.can_free(num_new - free, self._rows_in_use(in_use)):
            return in_use  # enough of the oldest rows may go: no scan of the whole table
        evictable = int((self._evictable() & ~in_use).sum())
        if free + evictable < num_new:
            raise TableFullError(
                f"{base}, and eviction can free only {evictable} rows (the others are pinned or used by this batch). "
                f"Raise the capacity (num_embeddings of table '{self._name}'), use smaller batches, or pin fewer "
                "batches."
            )
        return in_use

    def in_use(self, used: torch.Tensor) -> torch.Tensor:
        """Mask (bool ``[high_water]``) of the rows in ``used`` (a batch's rows, ``capacity`` for misses)."""
        hw = self._rows.high_water
        in_use = torch.zeros(hw + 1, dtype=torch.bool, device=self._device)
        in_use.index_fill_(0, used.clamp(max=hw), True)  # misses (row ``capacity``) land on entry ``hw``
        return in_use[:hw]

    def choose(self, count: int, in_use: torch.Tensor, step: int) -> torch.Tensor:
        """The ``count`` rows the policy frees among evictable rows not in ``in_use`` (score eviction:
        at least its ``evict_fraction`` of the stored ids, as far as there are); the caller frees them.

        Returns:
            torch.Tensor: int64 distinct rows (by key, then ascending row among ties).
        """
        hw = self._rows.high_water
        blocked = ~self._evictable()
        blocked |= in_use
        if isinstance(self._policy, ScoreEviction):
            assert self._scores is not None
            key = self._scores.eviction_key(hw).masked_fill_(blocked, _INT64_MAX)
            round_size = min(int((~blocked).sum()), math.ceil(self._policy.evict_fraction * self._rows.size))
            count = max(count, round_size)
            if count == 0:
                return torch.zeros(0, dtype=torch.int64, device=self._device)
        elif isinstance(self._policy, LFUEviction):
            key = (self._freq[:hw].long() << 31).bitwise_or_(self._last_step[:hw])
            key.masked_fill_(blocked, torch.iinfo(torch.int64).max)
        else:
            victims = self._oldest_victims(count, in_use, step)
            if victims is not None:
                return victims
            key = self._last_step[:hw].masked_fill(blocked, INT32_MAX)
        kth = torch.kthvalue(key, count).values
        below = (key < kth).nonzero().squeeze(1)
        ties = (key == kth).nonzero().squeeze(1)[: count - below.numel()]
        return torch.cat([below, ties])

    def idle_limit(self, max_idle_steps: int | None) -> int:
        """``max_idle_steps`` checked for :meth:`IdTable.evict_idle` (None: the TTL policy's)."""
        if self._policy is None:
            raise ValueError(
                f"IdTable '{self._name}': evict_idle needs an eviction policy (none is set, so the table "
                "keeps no idle metadata)"
            )
        if max_idle_steps is None:
            if not isinstance(self._policy, TTLEviction):
                raise ValueError(
                    f"IdTable '{self._name}': evict_idle() without max_idle_steps needs a TTLEviction policy, "
                    f"the table has {self._policy}"
                )
            max_idle_steps = self._policy.max_idle_steps
        if isinstance(max_idle_steps, bool) or not isinstance(max_idle_steps, int) or max_idle_steps < 0:
            raise ValueError(f"IdTable '{self._name}': max_idle_steps must be an int >= 0, got {max_idle_steps!r}")
        return max_idle_steps

    def idle_rows(self, max_idle_steps: int, step: int, *, force: bool = False) -> torch.Tensor:
        """The unpinned rows idle for more than ``max_idle_steps`` at ``step`` (int64, ascending), for
        the caller to free; moves the idle floor past them. Without ``force``, none while the floor
        says no row can be idle that long."""
        if not force and step - self._idle_floor <= max_idle_steps:
            return torch.zeros(0, dtype=torch.int64, device=self._device)
        hw = self._rows.high_water
        last_step = self._last_step[:hw]
        occupied = self._rows.occupied_mask()
        expired = occupied & self._pins.unpinned_mask(hw, self._last_step) & (last_step < step - max_idle_steps)
        rows = expired.nonzero().squeeze(1)
        if rows.numel():
            occupied[rows] = False
        # Rows stored later in this call get last_step == step, so the floor never exceeds it.
        floor = int(torch.where(occupied, last_step, INT32_MAX).min()) if hw else step
        self._idle_floor = min(floor, step)
        return rows

    def num_pinned(self) -> int:
        """Rows with a pin: a reference, or last used at or after the pins' watermark."""
        hw = self._rows.high_water
        return self._pins.num_pinned(hw, self._last_step, self._rows.occupied_mask())

    def refuse_pinned(self, rows: torch.Tensor, what: str) -> None:
        """Raise ``ValueError`` naming ``what`` if one of the occupied ``rows`` has a pin (as
        :meth:`num_pinned` counts them)."""
        self._pins.refuse_pinned(rows, what, self._last_step)

    def _evictable(self) -> torch.Tensor:
        """Mask of the rows below the high-water mark eviction may free: occupied and unpinned."""
        return self._rows.occupied_mask() & self._pins.unpinned_mask(self._rows.high_water, self._last_step)

    def _by_last_use(self) -> bool:
        """Whether victims are the least recently used rows (LRU; TTL when the table is full)."""
        return self._policy is not None and not isinstance(self._policy, (LFUEviction, ScoreEviction))

    def _oldest_victims(self, count: int, in_use: torch.Tensor, step: int) -> torch.Tensor | None:
        """The ``count`` least recently used rows that may go, from the queue of the oldest rows
        (scanned again when it runs short); None where even a fresh scan holds too few."""
        if count < 1:
            return None
        rows_in_use = self._rows_in_use(in_use)
        victims = self._oldest.take(count, rows_in_use)
        if victims is None:
            depth = max(_QUEUE_STEPS * count, _QUEUE_MIN_ROWS)
            hw = self._rows.high_water
            self._oldest.refill(self._last_step[:hw], self._rows.occupied_mask(), depth, step)
            victims = self._oldest.take(count, rows_in_use)
        return victims

    def _rows_in_use(self, batch: torch.Tensor) -> RowsInUse:
        """What keeps rows from going now: the pins (references and watermark) and ``batch`` (the
        step's rows, bool per row)."""
        pins, since = self._pins.referenced(), self._pins.since
        return RowsInUse(self._last_step, self._rows.row_state, pins=pins, since=since, batch=batch)
