"""The hash index of an :class:`~recsdk.embedding.IdTable`: id -> row, by open addressing.

Two implementations with one interface, chosen by the table's device:

* :class:`FbgemmSlotIndex` (CPU): FBGEMM's pruned-hashmap layout, a native linear-probing table
  of ``(key, row)`` int64 pairs, run by recsdk's kernels (:mod:`~recsdk.embedding.slot_kernels`:
  lookup, insert, and a remove that shifts the probe run back instead of leaving a tombstone)
  where they are built, else by FBGEMM's (``pruned_hashmap_lookup`` / ``pruned_hashmap_insert``).
  One kernel call maps a whole batch, so small batches cost microseconds instead of the dozens of
  tensor ops a probing round takes in Python.
* :class:`TorchSlotIndex` (any device): double hashing in torch tensor ops, in rounds over the
  whole batch; a slot holds only a row (4 bytes) and the key is read from the table's ``row_id``.

Both start small and grow with the stored ids: a new index has the slots of a table of
``min(capacity, 65536)`` rows, and while it is smaller than its full size (:meth:`slots_for` of
the capacity) it keeps the stored ids to at most half of its slots, doubling them at a rehash, so
probes stay as short as in a full-size index. The table owns the per-row arrays and decides when
to rehash (:meth:`fits`, then :meth:`clear` and :meth:`insert` of every stored id); the index
only maps ids to rows.
"""

from __future__ import annotations

import math

import torch

from recsdk.embedding.hashing import fmix64
from recsdk.embedding.slot_kernels import SlotKernels, native_slot_kernels

__all__ = ["FbgemmSlotIndex", "TorchSlotIndex", "fbgemm_index_available", "index_bytes", "make_slot_index"]

_EMPTY = -1
_TOMBSTONE = -2
# FBGEMM's kernels: key -1 marks an empty slot; a row of -1 in an insert means "skip", so a
# removed id keeps its key with this row (a lookup reads it as absent, a re-insert overwrites it).
_DEAD_ROW = -2
_FBGEMM_SLOTS_PER_ROW = 1.4  # 16-byte slots: 22.4 bytes per row
_TORCH_SLOTS_PER_ROW = 1.5  # 4-byte slots, rounded up to a power of two: 6 to 12 bytes per row
_INITIAL_ROWS = 1 << 16  # a new index has the slots of a table of this many rows (or of its capacity)
_GROW_LOAD = 0.5  # an index below its full size holds stored ids in at most this share of its slots


def fbgemm_index_available() -> bool:
    """Whether FBGEMM's CPU pruned-hashmap kernels are loaded (``fbgemm_gpu`` or ``fbgemm_gpu_cpu``)."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    except ImportError:
        return False
    ops = torch.ops.fbgemm
    return hasattr(ops, "pruned_hashmap_lookup") and hasattr(ops, "pruned_hashmap_insert")


def _next_pow2(n: int) -> int:
    return 1 << max(1, math.ceil(math.log2(max(n, 2))))


class _GrowingSlots:
    """What both indexes share: when a rehash is due, and how far it grows the slots."""

    max_load: float  # a rehash is due before stored ids plus tombstones pass this share of the slots
    num_slots: int  # slots now
    max_slots: int  # slots at full size
    tombstones: int

    def fits(self, stored: int) -> bool:
        """Whether ``stored`` ids fit without a rehash: with the tombstones, in ``max_load`` of the
        slots, and below full size in half of them."""
        if stored + self.tombstones > self.max_load * self.num_slots:
            return False
        return self.num_slots == self.max_slots or stored <= _GROW_LOAD * self.num_slots

    def _grown(self, stored: int) -> int:
        """Slots for ``stored`` ids: the current ones, doubled (at most to full size) while the ids
        would fill more than half of them."""
        num_slots = self.num_slots
        while num_slots < self.max_slots and stored > _GROW_LOAD * num_slots:
            num_slots = min(2 * num_slots, self.max_slots)
        return num_slots


class TorchSlotIndex(_GrowingSlots):
    """Double hashing in torch ops: ``num_slots`` int32 slots holding rows.

    A slot holds a row, ``-1`` (empty) or ``-2`` (tombstone); its key is ``row_id[row]``. An id's
    probe sequence is ``home + k * stride (mod num_slots)`` (``home`` from the low bits of
    ``fmix64(id)``, an odd ``stride`` from its high bits). Lookups run in rounds over the whole
    batch: each round reads the current slot of every unresolved id, and only the ids that
    neither matched nor reached an empty slot go on. New ids claim free slots round by round:
    every candidate writes its row into the slot it reached, reads it back, and the losers probe
    on. Removal leaves a tombstone, which insertions reuse.

    The slots start at those of a table of ``min(capacity, 65536)`` rows and :meth:`clear` grows
    them (powers of two) up to ``slots_for(capacity)``; on the meta device they are that full size
    from the start (nothing is allocated there, and the planner reads its size).

    Args:
        capacity (int): rows of the table.
        device (torch.device): where the slots live.
        row_id (torch.Tensor): the table's int64 ``[capacity]`` id per row (read, never written).
    """

    max_load = 0.8  # the table rehashes before stored ids plus tombstones pass this share of the slots

    @staticmethod
    def slots_for(capacity: int) -> int:
        """Slots of the full-size index of a table of ``capacity`` rows."""
        return _next_pow2(math.ceil(capacity * _TORCH_SLOTS_PER_ROW))

    def __init__(self, capacity: int, device: torch.device, row_id: torch.Tensor) -> None:
        self.max_slots = self.slots_for(capacity)
        self.num_slots = self.max_slots if device.type == "meta" else self.slots_for(min(capacity, _INITIAL_ROWS))
        self.tombstones = 0
        self._mask = self.num_slots - 1
        self._device = device
        self._row_id = row_id
        self._slots = torch.full((self.num_slots,), _EMPTY, dtype=torch.int32, device=device)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the slots at their current size."""
        return self._slots.numel() * self._slots.element_size()

    def clear(self, stored: int) -> None:
        """Empty the index before ``stored`` ids are inserted, growing it first if they need it."""
        num_slots = self._grown(stored)
        if num_slots == self.num_slots:
            self._slots.fill_(_EMPTY)
        else:
            del self._slots  # the old slots go before the new ones are allocated
            self.num_slots, self._mask = num_slots, num_slots - 1
            self._slots = torch.full((num_slots,), _EMPTY, dtype=torch.int32, device=self._device)
        self.tombstones = 0

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (int64 ``[n]``), ``-1`` where absent. Reads only."""
        # Round one covers the whole batch; index_select and int32 arithmetic keep it cheap.
        h = fmix64(ids)
        pos = h.bitwise_and(self._mask)
        slot = self._slots.index_select(0, pos)
        match = self._row_id.index_select(0, slot.clamp(min=0)) == ids
        match &= slot >= 0
        rows = (slot + 1).mul_(match).sub_(1)  # int32: the row where matched, else -1
        idx = ((slot != _EMPTY) & ~match).nonzero().squeeze(1)  # batch positions still probing
        pos = pos.index_select(0, idx)
        stride = self._stride(h.index_select(0, idx))
        while idx.numel():
            pos.add_(stride).bitwise_and_(self._mask)
            slot = self._slots.index_select(0, pos)
            match = self._row_id.index_select(0, slot.clamp(min=0)) == ids.index_select(0, idx)
            match &= slot >= 0
            found = match.nonzero().squeeze(1)
            rows.index_copy_(0, idx.index_select(0, found), slot.index_select(0, found))
            keep = ((slot != _EMPTY) & ~match).nonzero().squeeze(1)
            idx = idx.index_select(0, keep)
            pos = pos.index_select(0, keep)
            stride = stride.index_select(0, keep)
        return rows.long()

    def insert(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` into free slots along the probe paths of ``ids`` (distinct ids, none stored)."""
        pos, stride = self._probe_start(ids)
        cand = rows.to(torch.int32)
        while pos.numel():
            before = self._slots.index_select(0, pos)
            free = (before < 0).nonzero().squeeze(1)
            # Concurrent writers to one slot: one value lands, the others see it and probe on.
            self._slots.index_copy_(0, pos.index_select(0, free), cand.index_select(0, free))
            won = self._slots.index_select(0, pos) == cand
            self.tombstones -= int((won & (before == _TOMBSTONE)).sum())
            keep = (~won).nonzero().squeeze(1)
            cand, stride = cand.index_select(0, keep), stride.index_select(0, keep)
            pos = pos.index_select(0, keep).add_(stride).bitwise_and_(self._mask)

    def remove(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Remove stored ``ids`` (held at ``rows``), leaving tombstones."""
        out = torch.empty_like(rows)
        target = rows.to(torch.int32)
        pos, stride = self._probe_start(ids)
        idx = torch.arange(rows.numel(), device=self._device)
        while idx.numel():
            found = self._slots.index_select(0, pos) == target
            out[idx[found]] = pos[found]
            keep = (~found).nonzero().squeeze(1)
            idx, target, stride = idx.index_select(0, keep), target.index_select(0, keep), stride.index_select(0, keep)
            pos = pos.index_select(0, keep).add_(stride).bitwise_and_(self._mask)
        self._slots[out] = _TOMBSTONE
        self.tombstones += rows.numel()

    def _stride(self, hashes: torch.Tensor) -> torch.Tensor:
        """Probe stride from the high 32 bits of the hash: odd, so a probe visits every slot."""
        return torch.bitwise_right_shift(hashes, 32).bitwise_and_(0xFFFFFFFF).bitwise_or_(1).bitwise_and_(self._mask)

    def _probe_start(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """First slot and stride of each id's probe sequence ``home + k * stride (mod num_slots)``."""
        h = fmix64(ids)
        return h.bitwise_and(self._mask), self._stride(h)


class FbgemmSlotIndex(_GrowingSlots):
    """FBGEMM's CPU pruned hashmap: ``num_slots`` ``(key, row)`` int64 pairs, linear probing.

    The layout reserves key ``-1`` for empty slots, so the id ``-1`` is kept aside in a Python
    attribute. With recsdk's kernels (``kernels``), a removed id's slot is emptied by shifting the
    rest of its probe run back, so no tombstone is left. With FBGEMM's alone, which cannot remove,
    a removed id keeps its key with row ``-2`` (read as absent); such dead slots are counted as
    tombstones until the table rehashes, and re-inserting the same id reuses its slot. Either way
    FBGEMM's ``pruned_hashmap_lookup`` reads the slots (:meth:`kernel_state`).

    The slots start at those of a table of ``min(capacity, 65536)`` rows and :meth:`clear` grows
    them (doubling) up to ``slots_for(capacity)``.

    Args:
        capacity (int): rows of the table.
        kernels (SlotKernels | None): recsdk's kernels (:func:`~recsdk.embedding.slot_kernels.native_slot_kernels`),
            or None for FBGEMM's.
    """

    # Dead slots are reused only by their own id, so under churn they pile up until a rehash: a
    # higher load than the torch index's leaves more room between rehashes (linear probing in
    # native code stays cheap at 90%: a miss scans a few cache lines).
    max_load = 0.9

    @staticmethod
    def slots_for(capacity: int) -> int:
        """Slots of the full-size index of a table of ``capacity`` rows (at least one stays empty)."""
        return max(2, math.ceil(capacity * _FBGEMM_SLOTS_PER_ROW))

    def __init__(self, capacity: int, kernels: SlotKernels | None = None) -> None:
        self.max_slots = self.slots_for(capacity)
        self.tombstones = 0
        self._kernels = kernels
        self._allocate(self.slots_for(min(capacity, _INITIAL_ROWS)))
        self._minus_one_row = -1  # row of the id -1, which the kernels cannot store

    @property
    def memory_bytes(self) -> int:
        """Bytes of the slots at their current size."""
        return self._table.numel() * self._table.element_size()

    def clear(self, stored: int) -> None:
        """Empty the index before ``stored`` ids are inserted, growing it first if they need it."""
        num_slots = self._grown(stored)
        if num_slots == self.num_slots:
            self._table.fill_(_EMPTY)
        else:
            del self._table  # the old slots go before the new ones are allocated
            self._allocate(num_slots)
        self.tombstones = 0
        self._minus_one_row = -1

    def _allocate(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._table = torch.full((num_slots, 2), _EMPTY, dtype=torch.int64)
        self._table_offsets = torch.tensor([0, num_slots], dtype=torch.int64)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (int64 ``[n]``), ``-1`` where absent. Reads only."""
        if self._kernels is not None:
            rows = self._kernels.lookup(self._table, ids.contiguous())[0]
        else:
            offsets = _one_bag(ids.numel())
            rows = torch.ops.fbgemm.pruned_hashmap_lookup(ids, offsets, self._table, self._table_offsets)
            rows.clamp_(min=-1)  # dead slots read -2
        if self._minus_one_row >= 0:  # an absent -1 already reads -1
            rows.masked_fill_(ids == -1, self._minus_one_row)
        return rows

    def insert(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store distinct ``ids`` (none stored) at ``rows``."""
        ids, rows = self._set_aside(ids, rows, rows)
        self._write(ids, rows)

    def remove(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Remove stored ``ids`` (held at ``rows``): shifting their probe runs back with recsdk's
        kernels, else leaving their slots dead until a rehash."""
        gone = torch.full_like(rows, -1)
        if self._kernels is not None:  # no dead rows to write
            self._kernels.remove(self._table, self._set_aside(ids, gone, gone)[0].contiguous())
            return
        ids, dead = self._set_aside(ids, torch.full_like(rows, _DEAD_ROW), gone)
        self._write(ids, dead)
        self.tombstones += ids.numel()

    def kernel_state(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What a lookup outside this object needs (a TorchScript module calling
        ``torch.ops.fbgemm.pruned_hashmap_lookup`` itself): the slots ``[num_slots, 2]``, their
        offsets ``[2]``, and the row of the id ``-1`` (``-1``: absent), which the slots cannot hold.
        The slots are replaced when the index grows: read them again after inserts."""
        return self._table, self._table_offsets, self._minus_one_row

    def _set_aside(
        self, ids: torch.Tensor, rows: torch.Tensor, minus_one_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Handle the id -1 here (``minus_one_rows`` gives its new row); return the other ids."""
        minus_one = ids == -1
        if not bool(minus_one.any()):
            return ids, rows
        self._minus_one_row = int(minus_one_rows[minus_one][0])
        keep = ~minus_one
        return ids[keep], rows[keep]

    def _write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        if self._kernels is not None:
            self._kernels.insert(self._table, ids.contiguous(), rows.contiguous())
            return
        offsets = _one_bag(ids.numel())
        torch.ops.fbgemm.pruned_hashmap_insert(ids, rows, offsets, self._table, self._table_offsets)


def _one_bag(n: int) -> torch.Tensor:
    """The kernels' offsets ``[0, n]`` for ``n`` ids in one bag of one table (``arange``: half of
    ``torch.tensor``'s cost, which parses a list)."""
    return torch.arange(0, n + 1, n, dtype=torch.int64) if n else torch.zeros(2, dtype=torch.int64)


def make_slot_index(capacity: int, device: torch.device, row_id: torch.Tensor) -> TorchSlotIndex | FbgemmSlotIndex:
    """The index for a table on ``device``: FBGEMM's layout on CPU when FBGEMM is loaded (with
    recsdk's kernels where they are built), torch ops otherwise.

    Args:
        capacity (int): rows of the table.
        device (torch.device): the table's device.
        row_id (torch.Tensor): the table's id per row (the torch index reads keys from it).

    Returns:
        TorchSlotIndex | FbgemmSlotIndex: an empty index.
    """
    if device.type == "cpu" and _use_fbgemm():
        return FbgemmSlotIndex(capacity, native_slot_kernels())
    return TorchSlotIndex(capacity, device, row_id)


def index_bytes(capacity: int, device: torch.device) -> int:
    """Bytes of the full-size index of a table of ``capacity`` rows on ``device``.

    The worst case: what the index of :func:`make_slot_index` holds once grown to
    ``slots_for(capacity)`` slots (a new index starts with the slots of ``min(capacity, 65536)``
    rows and grows with the stored ids; on the meta device it has the full size from the start).
    Allocates nothing (the planner sizes host id tables with it).

    Args:
        capacity (int): rows of the table.
        device (torch.device): the table's device.

    Returns:
        int: 16 bytes per slot of FBGEMM's index on CPU, 4 bytes per slot of the torch index elsewhere.
    """
    if device.type == "cpu" and _use_fbgemm():
        return FbgemmSlotIndex.slots_for(capacity) * 16  # (key, row) int64 pairs
    return TorchSlotIndex.slots_for(capacity) * 4  # int32 rows


def _use_fbgemm() -> bool:
    # A function, so tests can run the torch index on CPU too.
    return fbgemm_index_available()
