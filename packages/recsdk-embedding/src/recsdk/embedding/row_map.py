"""``RowMap``: an :class:`~recsdk.embedding.IdTable`'s ids at their rows and the hash index that
finds them, kept in agreement.

It owns the hash index (:mod:`~recsdk.embedding.slot_index`: FBGEMM's kernels on CPU, torch ops
elsewhere; rebuilt, and grown first if needed, when stored ids plus tombstones pass its load
limit) and composes the table's :class:`~recsdk.embedding.row_allocator.RowAllocator`. A
placement stores ids in both and tells the parts that follow placements (the eviction metadata,
the show/click scores, the change tracker); a free takes ids out of both and tells the tracker.
Which rows to free is the caller's choice (eviction's, or a removal's).

Example::

    row_map = RowMap(rows, eviction, scores, publishing, capacity=8, device=torch.device("cpu"))
    row_map.place(torch.tensor([42, 7]), rows.pop(2), step=1)
    row_map.lookup(torch.tensor([7, 9]))  # tensor([1, -1])
"""

from __future__ import annotations

import torch

from recsdk.embedding.id_table_eviction import IdTableEviction
from recsdk.embedding.id_table_publishing import IdTablePublishing
from recsdk.embedding.id_table_scores import IdTableScores
from recsdk.embedding.row_allocator import RowAllocator
from recsdk.embedding.slot_index import FbgemmSlotIndex, TorchSlotIndex, make_slot_index

__all__ = ["RowMap"]


class RowMap:
    """The id -> row index and the rows' ids of one id table.

    Args:
        rows (RowAllocator): the table's rows.
        eviction (IdTableEviction): told of placements (metadata).
        scores (IdTableScores | None): told of placements (a new row's score starts at 0).
        publishing (IdTablePublishing): told of placements and frees.
        capacity (int): the table's rows.
        device (torch.device): the table's device.
    """

    def __init__(
        self,
        rows: RowAllocator,
        eviction: IdTableEviction,
        scores: IdTableScores | None,
        publishing: IdTablePublishing,
        *,
        capacity: int,
        device: torch.device,
    ) -> None:
        self._rows = rows
        self._eviction = eviction
        self._scores = scores
        self._publishing = publishing
        self._capacity = capacity
        self._device = device
        self._index: TorchSlotIndex | FbgemmSlotIndex = make_slot_index(capacity, device, rows.row_id)

    def reset(self) -> None:
        """No id stored: fresh rows and a fresh index."""
        self._rows.reset()
        self._index = make_slot_index(self._capacity, self._device, self._rows.row_id)

    @property
    def index(self) -> TorchSlotIndex | FbgemmSlotIndex:
        """The hash index, to read (its kind, size, and the FBGEMM kernel's state for serving)."""
        return self._index

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of int64 ``ids [n]``, ``-1`` where absent. Reads only."""
        n = ids.numel()
        if n == 0 or self._rows.size == 0:
            return torch.full((n,), -1, dtype=torch.int64, device=self._device)
        return self._index.lookup(ids)

    def place(self, ids: torch.Tensor, rows: torch.Tensor, *, step: int) -> None:
        """Store distinct new ``ids`` at free ``rows`` already taken (:meth:`RowAllocator.pop` or
        :meth:`RowAllocator.claim`), placed at ``step``."""
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

    def free(self, rows: torch.Tensor) -> None:
        """Remove the ids of distinct occupied ``rows``; the rows go back to the free stack."""
        ids = self._rows.release(rows)
        self._index.remove(ids, rows)
        self._publishing.freed(rows, ids)
