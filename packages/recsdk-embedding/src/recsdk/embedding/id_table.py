"""A collision-free map from raw int64 ids to embedding rows, with admission and eviction.

Layout (all torch tensors on the table's device, so every operation is whole-batch):

* a hash index from id to row (:mod:`recsdk.embedding.slot_index`): on CPU, FBGEMM's native
  pruned-hashmap kernels (linear probing over ``(key, row)`` pairs, 1.4 slots per row); on other
  devices, double hashing in torch ops over int32 slots (a power of two, at least 1.5 slots per
  row, once grown to full size). Occupancy lives in the per-row state, never in the key alone, so
  every int64 value is a valid id. Removal leaves a tombstone, and the table rehashes when stored
  ids plus tombstones pass 80% (torch index) or 90% (FBGEMM index) of the slots; the index starts
  small, and a rehash doubles it when stored ids would fill more than half of it.
* per row: ``row_id`` (int64), ``row_state`` (int8: never used / occupied / freed after use),
  ``last_step`` and ``freq`` (int32 eviction metadata), ``pins`` (int32 reference counts); on CPU
  anonymous memory maps, so a page becomes resident when a row on it is first written.
* the free rows: a high-water mark below which every row handed out so far lies (the rows at and
  above it were never handed out and go out in ascending order), and a stack (int32) of the other
  free rows, all below the mark, handed out first. Scans of the per-row arrays cover only the rows
  below the mark.
"""

from __future__ import annotations

from typing import Any

import torch

from recsdk.embedding.change_tracker import RowChangeTracker
from recsdk.embedding.count_sketch import CountMinSketch
from recsdk.embedding.id_table_admission import IdTableAdmission
from recsdk.embedding.id_table_eviction import IdTableEviction, TableFullError
from recsdk.embedding.id_table_pins import IdTablePins
from recsdk.embedding.id_table_publishing import IdTablePublishing
from recsdk.embedding.id_table_scores import IdTableScores, StepUnits
from recsdk.embedding.id_table_state import (
    _INT32_MAX,
    _MAX_CAPACITY,
    _NEVER_USED,
    _OCCUPIED,
    _RETIRED,
    _STAT_NAMES,
    IdTableState,
)
from recsdk.embedding.lazy_memory import lazy_zeros
from recsdk.embedding.oldest_rows import OldestRows
from recsdk.embedding.policies import (
    AdmissionPolicy,
    CountAdmission,
    EvictionPolicy,
    LFUEviction,
    ProbabilisticAdmission,
    ScoreAdmission,
    ScoreEviction,
    TTLEviction,
    check_policies,
    score_of,
)
from recsdk.embedding.slot_index import FbgemmSlotIndex, TorchSlotIndex, make_slot_index

__all__ = ["IdTable", "TableFullError"]


class IdTable(IdTableState, IdTableAdmission, IdTableEviction, IdTablePins, IdTablePublishing):
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
        if not 1 <= capacity <= _MAX_CAPACITY:
            raise ValueError(f"IdTable '{name}': capacity must be in [1, {_MAX_CAPACITY}], got {capacity}")
        check_policies(f"IdTable '{name}'", admission, eviction)
        self._name = name
        self._capacity = capacity
        self._device = torch.device(device)
        self._admission = admission
        self._eviction = eviction
        self._report_first_use = bool(report_first_use)
        self._sketch: CountMinSketch | None = None
        if isinstance(admission, CountAdmission) and admission.threshold > 1:
            width = admission.counter_slots // admission.num_hashes
            self._sketch = CountMinSketch(width, admission.num_hashes, admission.threshold, self._device)
        self._scores: IdTableScores | None = None  # show/click scores (ScoreAdmission, ScoreEviction)
        score = score_of(admission, eviction)
        if score is not None and self._device.type != "meta":
            self._scores = IdTableScores(
                score,
                capacity,
                self._device,
                admission=admission if isinstance(admission, ScoreAdmission) else None,
                per_row=isinstance(eviction, ScoreEviction),
            )
        self._free_top: int
        self._high_water: int  # rows at and above it were never handed out (see _pop_free)
        self._tail_retired: bool  # rows above the mark count as retired (after rebuild or a load)
        self._pin_end: int  # no row at or above max(this, _high_water) was ever pinned
        self._size: int
        self._index: TorchSlotIndex | FbgemmSlotIndex
        self._step: int
        self._idle_floor: int  # no occupied row has last_step below this
        self._reassigned: list[torch.Tensor]  # rows reassigned since the last take (may repeat)
        self._reassigned_count: int
        self._stats: dict[str, int]
        self._changes: RowChangeTracker | None = None  # see track_changes
        self._oldest = OldestRows(_OCCUPIED)  # the least recently used rows, for several evictions
        self._allocate()

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
        return self._admission

    @property
    def eviction(self) -> EvictionPolicy | None:
        """The eviction policy (None: a full table raises :class:`TableFullError`)."""
        return self._eviction

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
        tensors = [
            self._row_id,
            self._row_state,
            self._last_step_buf,
            self._freq_buf,
            self._pins_buf,
            self._free,
        ]
        if self._sketch is not None:
            tensors.append(self._sketch.counters)
        if self._scores is not None:
            tensors += self._scores.tensors()
        return self._index.memory_bytes + sum(t.numel() * t.element_size() for t in tensors)

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return (
            f"IdTable(name={self._name!r}, capacity={self._capacity}, size={self._size}, "
            f"device={self._device}, admission={self._admission}, eviction={self._eviction})"
        )

    # ------------------------------------------------------------------ public operations

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
        click_values = self._as_clicks(clicks, flat.numel()) if clicks is not None else None
        rows = self._lookup(flat)
        # Rows this batch holds, with misses sent to the spare metadata entry at index ``capacity``.
        used: torch.Tensor | None
        miss_idx: torch.Tensor | None
        if flat.numel() and int(rows.min()) >= 0:  # every id has its row (the steady state): no misses
            miss_idx, num_miss = None, 0
            used = rows if self._eviction is not None else None
        else:
            miss = rows < 0
            miss_idx = miss.nonzero().squeeze(1)
            num_miss = miss_idx.numel()
            used = rows.masked_fill(miss, self._capacity) if self._eviction is not None else None

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
            counted = isinstance(self._admission, ProbabilisticAdmission)
            found = torch.unique(flat.index_select(0, miss_idx), return_inverse=True, return_counts=counted)
            uniq, inverse = found[0], found[1]
            if amounts is not None:
                uniq_amounts = torch.zeros(uniq.numel(), dtype=torch.int64, device=self._device)
                uniq_amounts.index_add_(0, inverse, amounts.index_select(0, miss_idx))
            admitted, positions, estimate = self._admission_decision(
                uniq, found[2] if counted else None, uniq_amounts, units
            )
            num_new = uniq.numel() if admitted is None else int(admitted.sum())
        in_use = None  # bool [high_water]: rows this batch holds (eviction never frees them in this call)
        if num_new > self._num_free:
            in_use = self._check_room(num_new, used)

        # Commit phase.
        self._step += 1
        step = self._step
        self._stats["lookups"] += flat.numel()
        self._stats["hits"] += flat.numel() - num_miss
        if used is not None and num_miss < flat.numel():
            self._touch(used, step)
        if self._scores is not None and used is not None and amounts is not None:
            self._scores.add_hits(used, amounts)
        if isinstance(self._eviction, TTLEviction):
            self._sweep_idle(self._eviction.max_idle_steps)
        elif isinstance(self._eviction, ScoreEviction) and self._eviction.every_steps is not None:
            if step % self._eviction.every_steps == 0 and used is not None:
                self._evict_round(used)
        if uniq is not None and inverse is not None:
            assert miss_idx is not None
            self._insert_missing(
                rows, miss_idx, uniq, inverse, admitted, positions, estimate, uniq_amounts, num_new, in_use
            )
        if self._scores is not None:
            self._scores.end_step(step, self._high_water)
        return rows.view(shape)

    def _insert_missing(
        self,
        rows: torch.Tensor,
        miss_idx: torch.Tensor,
        uniq: torch.Tensor,
        inverse: torch.Tensor,
        admitted: torch.Tensor | None,
        positions: torch.Tensor | None,
        estimate: torch.Tensor | None,
        uniq_amounts: torch.Tensor | None,
        num_new: int,
        in_use: torch.Tensor | None,
    ) -> None:
        """The commit part of :meth:`find_or_insert` for the batch's ids without a row: count them
        for admission, make room, place the admitted ones and write their rows into ``rows``."""
        scores = self._count_missing(positions, estimate, uniq_amounts)
        self._stats["admission_rejects"] += uniq.numel() - num_new
        if not num_new:
            return
        new_ids = uniq if admitted is None else uniq[admitted]
        shortfall = num_new - self._num_free
        if shortfall > 0:
            assert in_use is not None  # shortfall > 0 implies num_new > free rows before the call
            self._evict(shortfall, in_use)
        new_rows = self._pop_free(num_new)
        self._place(new_ids, new_rows, step=self._step)
        if self._scores is not None and scores is not None:
            self._scores.place(new_rows, scores if admitted is None else scores[admitted])
        self._stats["inserts"] += num_new
        if admitted is None:
            uniq_rows = new_rows
        else:
            uniq_rows = torch.full((uniq.numel(),), -1, dtype=torch.int64, device=self._device)
            uniq_rows[admitted] = new_rows
        rows.index_copy_(0, miss_idx, uniq_rows.index_select(0, inverse))

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

    def take_reassigned_rows(self) -> torch.Tensor:
        """Rows handed to a new id after having held another one, since the last call; clears the list.

        With ``report_first_use``, every row handed to a new id is reported, its first use too.

        The caller re-initialises these embedding rows and resets their optimizer state before
        they are looked up.

        Returns:
            torch.Tensor: sorted distinct int64 rows on the table's device.
        """
        out = self._pending_rows()
        self._reassigned = []
        self._reassigned_count = 0
        return out

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
            if bool((self._pins[present] > 0).any()):
                raise ValueError(f"IdTable '{self._name}': remove of ids whose rows are pinned; unpin them first")
            self._free_rows(present)
        return rows.view(shape)

    def ids_and_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored ids and their rows, in ascending row order.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: int64 ``ids [n]`` and int64 ``rows [n]``.
        """
        self._check_usable()
        rows = (self._row_state[: self._high_water] == _OCCUPIED).nonzero().squeeze(1)
        return self._row_id[rows].clone(), rows

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
        out: dict[str, Any] = {"size": self._size, "capacity": self._capacity}
        out.update(self._stats)
        out["hit_rate"] = self._stats["hits"] / self._stats["lookups"] if self._stats["lookups"] else 0.0
        if self._scores is not None and self._scores.rows is not None:
            _, rows = self.ids_and_rows()
            scores = self._scores.true_scores(self._scores.rows[rows], self._step)
            out["score_sum"] = float(scores.sum()) if rows.numel() else 0.0
            out["score_min"] = float(scores.min()) if rows.numel() else 0.0
        return out

    # ------------------------------------------------------------------ internals

    @property
    def _num_free(self) -> int:
        """Free rows: those on the stack and those never handed out."""
        return self._free_top + self._capacity - self._high_water

    def _allocate(self) -> None:
        dev = self._device
        cap = self._capacity
        self._row_id = lazy_zeros(cap, torch.int64, dev)
        self._index = make_slot_index(cap, dev, self._row_id)
        self._row_state = lazy_zeros(cap, torch.int8, dev)
        # One spare entry at index ``capacity`` absorbs writes for ids without a row.
        self._last_step_buf = lazy_zeros(cap + 1, torch.int32, dev)
        self._freq_buf = lazy_zeros(cap + 1, torch.int32, dev)
        self._last_step = self._last_step_buf[:cap]
        self._freq = self._freq_buf[:cap]
        self._pins_buf = lazy_zeros(cap + 1, torch.int32, dev)
        self._pins = self._pins_buf[:cap]
        self._free = lazy_zeros(cap, torch.int32, dev)  # the stack of free rows below the mark, bottom to top
        self._free_top = 0
        self._high_water = 0  # with an empty stack: hands out 0, 1, 2, ...
        self._tail_retired = False
        self._pin_end = 0
        self._size = 0
        self._step = 0
        self._idle_floor = 0
        self._reassigned = []
        self._reassigned_count = 0
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._oldest.clear()
        if self._sketch is not None:
            self._sketch.counters.zero_()
        if self._scores is not None:
            self._scores.reset()
        if self._changes is not None:  # the rows' ids are replaced wholesale: the next version is full
            self._changes.reset()

    def _check_usable(self) -> None:
        if self._device.type == "meta":
            raise RuntimeError(
                f"IdTable '{self._name}' lives on the meta device and holds no data; "
                "create it on a real device to look ids up"
            )

    def _as_ids(self, ids: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Size]:
        self._check_usable()
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"IdTable '{self._name}'.{op}: ids must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"IdTable '{self._name}'.{op}: ids must be int64 or int32, got {ids.dtype}")
        flat = ids.reshape(-1).to(device=self._device, dtype=torch.int64)
        return flat, ids.shape

    def _as_rows(self, rows: torch.Tensor, op: str, *, allow_missing: bool) -> torch.Tensor:
        self._check_usable()
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"IdTable '{self._name}'.{op}: rows must be a torch.Tensor, got {type(rows).__name__}")
        if rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
            raise TypeError(f"IdTable '{self._name}'.{op}: rows must be an integer tensor, got {rows.dtype}")
        flat = rows.reshape(-1).to(device=self._device, dtype=torch.int64)
        low = -1 if allow_missing else 0
        lo, hi = torch.aminmax(flat) if flat.numel() else (low, low)  # one pass; the bad value sought if any
        if int(lo) < low or int(hi) >= self._capacity:
            bad = (flat < low) | (flat >= self._capacity)
            raise ValueError(
                f"IdTable '{self._name}'.{op}: rows must be in [{low}, {self._capacity}), got {int(flat[bad][0])}"
            )
        return flat

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (int64 ``[n]``), ``-1`` where absent. Reads only."""
        n = ids.numel()
        if n == 0 or self._size == 0:
            return torch.full((n,), -1, dtype=torch.int64, device=self._device)
        return self._index.lookup(ids)

    def _touch(self, used: torch.Tensor, step: int) -> None:
        """Eviction metadata of the rows a step uses (``used``: rows, misses on the spare entry)."""
        if self._eviction is None:
            return
        self._last_step_buf.index_fill_(0, used, step)
        if isinstance(self._eviction, LFUEviction):
            freq = self._freq_buf.index_select(0, used).clamp_(max=_INT32_MAX - 1).add_(1)
            self._freq_buf.index_put_((used,), freq)  # repeats write equal values: +1 per step

    def _ensure_slot_room(self, incoming: int) -> None:
        if not self._index.fits(self._size + incoming):
            self._rehash(self._size + incoming)

    def _rehash(self, stored: int) -> None:
        """Rebuild the index from the occupied rows, grown first if ``stored`` ids need it."""
        self._index.clear(stored)
        rows = (self._row_state[: self._high_water] == _OCCUPIED).nonzero().squeeze(1)
        if rows.numel():
            self._index.insert(self._row_id[rows], rows)

    def _place(self, ids: torch.Tensor, rows: torch.Tensor, *, step: int) -> None:
        """Store distinct new ids at free rows below the high-water mark, already taken off the stack."""
        self._ensure_slot_room(ids.numel())
        self._index.insert(ids, rows)
        self._row_id[rows] = ids
        self._row_state[rows] = _OCCUPIED
        self._last_step[rows] = step
        self._freq[rows] = 1
        if self._scores is not None:
            self._scores.place(rows, torch.zeros(rows.numel(), dtype=torch.int64, device=self._device))
        self._size += ids.numel()
        if self._changes is not None:
            self._changes.placed(rows)

    def _pop_free(self, k: int) -> torch.Tensor:
        """Take ``k`` free rows: the stack's from the top, then never-used ones upward from the mark.

        Records the rows to report by :meth:`take_reassigned_rows`: those that held an id before
        (all of them with ``report_first_use``).
        """
        top, hw = self._free_top, self._high_water
        m = min(k, top)
        stacked = self._free[top - m : top].flip(0).long()
        fresh = torch.arange(hw, hw + k - m, device=self._device)
        self._free_top, self._high_water = top - m, hw + k - m
        rows = torch.cat([stacked, fresh])
        if self._report_first_use:
            reused = rows
        else:
            reused = stacked[self._row_state[stacked] == _RETIRED]
            if self._tail_retired:
                reused = torch.cat([reused, fresh])
        if reused.numel():
            self._reassigned.append(reused)
            self._reassigned_count += reused.numel()
            if self._reassigned_count > 2 * self._capacity:
                merged = self._pending_rows()
                self._reassigned = [merged]
                self._reassigned_count = merged.numel()
        return rows

    def _free_rows(self, rows: torch.Tensor) -> None:
        """Remove the ids of distinct occupied ``rows`` and push the rows on the free stack."""
        if self._changes is not None:
            self._changes.freed(rows, self._row_id.index_select(0, rows))
        self._index.remove(self._row_id[rows], rows)
        self._row_state[rows] = _RETIRED
        n = rows.numel()
        self._free[self._free_top : self._free_top + n] = rows.to(torch.int32)
        self._free_top += n
        self._size -= n

    def _pending_rows(self) -> torch.Tensor:
        if not self._reassigned:
            return torch.zeros(0, dtype=torch.int64, device=self._device)
        return torch.cat(self._reassigned).unique()

    def _drop_pending(self, rows: torch.Tensor) -> None:
        if self._reassigned:
            pending = self._pending_rows()
            pending = pending[~torch.isin(pending, rows)]
            self._reassigned = [pending] if pending.numel() else []
            self._reassigned_count = pending.numel()
        self._row_state[rows] = _NEVER_USED
