"""``TableCache``: the fused kernel's rows as a cache over a table shard's row store.

A cached table shard has two row spaces: the **store rows** the id table hands to ids (every row
of the shard, in a :class:`~recsdk.sharding.rows.row_store.RowStore`) and the **slots** of the fused
kernel (``ceil(load_factor x rows)`` of them). Store rows are dense (``[0, rows)``), so the cache
maps them to slots with a plain array (``slot + 1`` per store row, 0 for "not cached"; its pages
are zero-filled by the OS when first touched, so it costs memory for the rows in use only), and
keeps per slot the store row it holds, whether a training batch changed it, and its last use and
number of lookups (which slots the algorithm frees first: LRU or LFU).

When a batch needs more free slots than there are, the cache frees a whole chunk (a sixteenth of
the slots, or what the batch needs if more) of the least recently (LRU) or least often (LFU)
used slots the batch does not use, in one ``topk``: the scan over the slots is shared by the
many batches that chunk serves.

Duties, all on the training thread when a batch starts computing (the previous batch's
backward has run, so no slot is in use by a batch in flight, and batches mapped ahead hold only
store rows):

* :meth:`TableCache.to_slots` gives a batch's store rows a slot each: rows not in the cache are
  swapped in (their weight and every per-row optimizer state copied from the store), and the
  slots they take are swapped out first (written back, when a training batch changed them);
* :meth:`TableCache.forget` drops rows from the cache without writing them back (they are being
  reset in the store: a row reused after eviction starts fresh);
* :meth:`TableCache.flush` writes every changed slot back and empties the cache, so that the
  store holds the whole table (checkpoints, export, and a load writing the store).

Copies are exact, so training through the cache is bit for bit the all-resident training.
"""

from __future__ import annotations

import numpy as np
import torch

from recsdk.embedding import TableFullError
from recsdk.sharding.rows.row_store import RowStore
from recsdk.sharding.rows.tbe_views import TableViews

__all__ = ["TableCache"]

_CHUNK_SHARE = 16  # an eviction frees at least slots / 16 slots
SLOT_BYTES = 33  # per slot: its store row, last use, use count, free-stack entry (int64 each), dirty flag
ROW_BYTES = 4  # per store row: its slot + 1 (int32; resident only where rows are used)


class TableCache:
    """The fused kernel's rows of one table shard, caching its row store.

    Args:
        table (str): the user's table name (errors, statistics).
        store (RowStore): every row of the shard.
        kernel (TableViews): the shard's rows in the fused kernel (the slots), with the same
            per-row states as the store.
        algorithm (str): ``"lru"`` or ``"lfu"``: which slots are freed first.
        rank (int): this rank, for errors.

    Example::

        cache = TableCache("item", store, kernel_views["item"], algorithm="lru", rank=0)
        cache.check_fits(store_rows)  # where the host stage maps the batch
        slots = cache.to_slots(store_rows, training=True)  # kernel rows for the lookup
    """

    def __init__(self, table: str, store: RowStore, kernel: TableViews, *, algorithm: str, rank: int) -> None:
        self.table = table
        self.store = store
        self.kernel = kernel
        self.slots = int(kernel.weight.shape[0])
        self._rank = rank
        self._lfu = algorithm == "lfu"
        # slot + 1 per store row, 0: not cached. Zero pages from the OS, written only where used.
        self._slot_of_row = torch.from_numpy(np.zeros(store.rows, dtype=np.int32))
        self._row_of_slot = torch.full((self.slots,), -1, dtype=torch.int64)
        self._dirty = torch.zeros(self.slots, dtype=torch.bool)
        self._last_use = torch.zeros(self.slots, dtype=torch.int64)
        self._uses = torch.zeros(self.slots, dtype=torch.int64)
        self._free = torch.arange(self.slots - 1, -1, -1, dtype=torch.int64)  # a stack: pops 0, 1, 2, ...
        self._free_top = self.slots
        self._step = 0
        self._stats = {"cache_lookups": 0, "cache_hits": 0, "swap_ins": 0, "swap_outs": 0}

    @staticmethod
    def host_bytes(slots: int, rows: int) -> int:
        """Host bytes of the cache's bookkeeping for ``slots`` slots over ``rows`` store rows (at
        most: the per-row array's pages are resident only where rows are used)."""
        return SLOT_BYTES * slots + ROW_BYTES * rows

    def check_fits(self, rows: torch.Tensor) -> None:
        """Raise unless a batch looking up store ``rows`` (repeats allowed) fits the cache: the host
        stage checks this when it maps the batch, where a failure is agreed across ranks. Counts
        the distinct rows only when there are more ids than slots.

        Raises:
            TableFullError: names the table, the rows the batch uses, the slots and what to raise.
        """
        if rows.numel() <= self.slots:
            return
        num_rows = torch.unique(rows).numel()
        if num_rows > self.slots:
            raise TableFullError(
                f"table {self.table!r}: a batch uses {num_rows} distinct rows of its shard on rank {self._rank}, "
                f"but the shard's device cache has {self.slots} slots; raise cache_params.load_factor of table "
                f"{self.table!r} or use smaller batches"
            )

    def to_slots(self, rows: torch.Tensor, *, training: bool) -> torch.Tensor:
        """The slot of each of a batch's store rows, swapping in the rows not cached.

        Only the missed rows are deduplicated (a hit is one gather), so a batch costs little
        more than its misses.

        Args:
            rows (torch.Tensor): int64 store rows ``[n]`` of one batch (repeats allowed), that
                passed :meth:`check_fits`.
            training (bool): the batch updates its rows (their slots are written back when they
                leave the cache).

        Returns:
            torch.Tensor: int64 ``[n]`` slots of the fused kernel.
        """
        if rows.numel() == 0:
            return rows
        self._step += 1
        slots = self._held_slots(rows)
        miss = slots < 0
        num_missed_ids = int(miss.sum())
        self._stats["cache_lookups"] += rows.numel()
        self._stats["cache_hits"] += rows.numel() - num_missed_ids
        if num_missed_ids:
            new_rows = torch.unique(rows[miss])
            num_miss = new_rows.numel()
            if num_miss > self._free_top:
                self._evict(num_miss - self._free_top, in_use=slots[~miss])
            new_slots = self._free[self._free_top - num_miss : self._free_top].flip(0)
            self._free_top -= num_miss
            with torch.no_grad():
                self._copy(self.store.views, new_rows, self.kernel, new_slots)
            self._stats["swap_ins"] += num_miss
            self._row_of_slot.index_copy_(0, new_slots, new_rows)
            self._slot_of_row.index_copy_(0, new_rows, (new_slots + 1).to(torch.int32))
            self._dirty.index_fill_(0, new_slots, False)
            if self._lfu:
                self._uses.index_fill_(0, new_slots, 0)
            slots = self._held_slots(rows)
        self._last_use.index_fill_(0, slots, self._step)
        if self._lfu:
            self._uses.index_add_(0, slots, torch.ones_like(slots))
        if training:
            self._dirty.index_fill_(0, slots, True)
        return slots

    def slots_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The slots of store ``rows`` the cache holds (after :meth:`to_slots` of their batch)."""
        slots = self._held_slots(rows)
        if bool((slots < 0).any()):
            raise RuntimeError(f"table {self.table!r}: rows asked for are not in the device cache")
        return slots

    def forget(self, rows: torch.Tensor) -> None:
        """Drop store ``rows`` from the cache without writing them back (they are being reset)."""
        if rows.numel() == 0:
            return
        slots = self._held_slots(rows)
        held = slots >= 0
        if bool(held.any()):
            self._release(slots[held], rows[held])

    def read_weights(self, rows: torch.Tensor) -> torch.Tensor:
        """The current weights of store ``rows`` (``[n, dim]`` on the store's device): a cached row's
        from its slot, the others from the store. Changes nothing."""
        rows = rows.to(torch.int64)
        out = self.store.views.weight.index_select(0, rows)
        slots = self._held_slots(rows)
        held = (slots >= 0).nonzero().squeeze(1)
        if held.numel():
            weight = self.kernel.weight
            out[held] = weight.index_select(0, slots[held].to(weight.device)).to(out.device)
        return out

    def flush(self) -> None:
        """Write every changed slot back to the store and empty the cache."""
        self._write_back(self._dirty.nonzero().squeeze(1))
        held = (self._row_of_slot >= 0).nonzero().squeeze(1)
        if held.numel():
            self._release(held, self._row_of_slot.index_select(0, held))

    def stats(self) -> dict[str, float]:
        """``cache_slots``, ``cache_rows_held``, ``cache_lookups`` (ids looked up), ``cache_hits``
        (of those, ids whose row was in the cache), ``cache_hit_rate``, ``swap_ins``, ``swap_outs``
        (rows), ``store_rows``."""
        out: dict[str, float] = dict(self._stats)
        out["cache_slots"] = self.slots
        out["cache_rows_held"] = self.slots - self._free_top
        lookups = self._stats["cache_lookups"]
        out["cache_hit_rate"] = self._stats["cache_hits"] / lookups if lookups else 0.0
        out["store_rows"] = self.store.rows
        return out

    def _evict(self, shortfall: int, in_use: torch.Tensor) -> None:
        """Free at least ``shortfall`` slots (a chunk, usually) among those ``in_use`` does not hold."""
        if self._lfu:  # fewest lookups first, then the least recent
            key = (self._uses << 32) | self._last_use
        else:
            key = self._last_use.clone()
        blocked = self._row_of_slot < 0
        blocked[in_use] = True
        key.masked_fill_(blocked, torch.iinfo(torch.int64).max)
        evictable = self.slots - int(blocked.sum())
        count = min(evictable, max(shortfall, self.slots // _CHUNK_SHARE))
        victims = torch.topk(key, count, largest=False, sorted=False).indices
        self._write_back(victims[self._dirty.index_select(0, victims)])
        self._release(victims, self._row_of_slot.index_select(0, victims))

    def _write_back(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        with torch.no_grad():
            self._copy(self.kernel, slots, self.store.views, self._row_of_slot.index_select(0, slots))
        self._stats["swap_outs"] += slots.numel()
        self._dirty.index_fill_(0, slots, False)

    def _release(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Slots (holding store ``rows``) become free, without a write-back."""
        self._slot_of_row.index_fill_(0, rows, 0)
        self._row_of_slot.index_fill_(0, slots, -1)
        self._dirty.index_fill_(0, slots, False)
        n = slots.numel()
        self._free[self._free_top : self._free_top + n] = slots
        self._free_top += n

    def _held_slots(self, rows: torch.Tensor) -> torch.Tensor:
        """The slot of each store row, ``-1`` where the cache does not hold it."""
        return self._slot_of_row.index_select(0, rows).long().sub_(1)

    @staticmethod
    def _copy(src: TableViews, src_rows: torch.Tensor, dst: TableViews, dst_rows: torch.Tensor) -> None:
        for s, d in zip((src.weight, *src.states), (dst.weight, *dst.states), strict=True):
            d.index_copy_(0, dst_rows.to(d.device), s.index_select(0, src_rows.to(s.device)).to(d.device))
