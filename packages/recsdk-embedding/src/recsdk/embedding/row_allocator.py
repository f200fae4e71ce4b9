"""``RowAllocator``: which rows of an :class:`~recsdk.embedding.IdTable` hold which ids, and which
rows are free.

It owns the per-row ``row_id`` (int64) and ``row_state`` (int8, :mod:`~recsdk.embedding.row_states`)
arrays, the free rows and the rows to report by :meth:`IdTable.take_reassigned_rows`:

* **free rows**: a high-water mark below which every row handed out so far lies (the rows at and
  above it were never handed out and go out in ascending order), and a stack (int32) of the other
  free rows, all below the mark, handed out first. Scans cover only the rows below the mark.
  After a rebuild or some loads the rows above the mark count as retired (``tail_retired``).
* **reassigned rows**: rows handed to a new id after holding another one (every row handed out,
  with ``report_first_use``), kept until taken; merged once they pass twice the capacity.

On CPU the arrays are anonymous memory maps (:func:`~recsdk.embedding.lazy_memory.lazy_zeros`):
a page becomes resident when a row on it is first written. The allocator knows nothing of the
hash index, eviction or pins: the table places ids (:meth:`RowAllocator.occupy`) in rows it took
(:meth:`RowAllocator.pop`) and frees rows (:meth:`RowAllocator.release`) it chose.

Example::

    rows = RowAllocator(8, torch.device("cpu"), report_first_use=False)
    taken = rows.pop(2)  # tensor([0, 1])
    rows.occupy(torch.tensor([42, 7]), taken)
    rows.release(taken[:1])  # tensor([42]): the id that left
    rows.pop(1)  # tensor([0]), reported by take_pending() (it held 42)
"""

from __future__ import annotations

import torch

from recsdk.embedding.lazy_memory import lazy_zeros
from recsdk.embedding.row_states import NEVER_USED, OCCUPIED, RETIRED

__all__ = ["RowAllocator"]


class RowAllocator:
    """Ids per row, row states, free rows and reassigned rows of one id table.

    Args:
        capacity (int): the table's rows.
        device (torch.device): where the arrays live.
        report_first_use (bool): report every row handed out, not only rows that held an id.
    """

    def __init__(self, capacity: int, device: torch.device, *, report_first_use: bool) -> None:
        self._capacity = capacity
        self._device = device
        self._report_first_use = report_first_use
        self.reset()

    def reset(self) -> None:
        """Every row free and never used (fresh arrays), nothing to report."""
        cap, dev = self._capacity, self._device
        self._row_id = lazy_zeros(cap, torch.int64, dev)
        self._row_state = lazy_zeros(cap, torch.int8, dev)
        self._free = lazy_zeros(cap, torch.int32, dev)  # the stack of free rows below the mark, bottom to top
        self._free_top = 0
        self._high_water = 0  # with an empty stack: hands out 0, 1, 2, ...
        self._tail_retired = False  # rows above the mark count as retired (after a rebuild or a load)
        self._size = 0
        self._reassigned: list[torch.Tensor] = []  # rows reassigned since the last take (may repeat)
        self._reassigned_count = 0

    # ------------------------------------------------------------------ reads

    @property
    def size(self) -> int:
        """Rows holding an id."""
        return self._size

    @property
    def high_water(self) -> int:
        """Every row handed out so far lies below it."""
        return self._high_water

    @property
    def num_free(self) -> int:
        """Free rows: those on the stack and those never handed out."""
        return self._free_top + self._capacity - self._high_water

    @property
    def row_id(self) -> torch.Tensor:
        """int64 ``[capacity]``: the id of each occupied row (the torch slot index reads it as its
        keys; nobody else writes it)."""
        return self._row_id

    @property
    def row_state(self) -> torch.Tensor:
        """int8 ``[capacity]``: each row's state (:mod:`~recsdk.embedding.row_states`), to read."""
        return self._row_state

    def occupied_mask(self) -> torch.Tensor:
        """bool ``[high_water]``: which rows below the mark hold an id (a new tensor)."""
        return self._row_state[: self._high_water] == OCCUPIED

    def occupied_rows(self) -> torch.Tensor:
        """int64: the rows holding an id, ascending."""
        return self.occupied_mask().nonzero().squeeze(1)

    def ids_and_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored ids and their rows (int64 ``[n]`` each), in ascending row order."""
        rows = self.occupied_rows()
        return self._row_id[rows], rows

    def occupants(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids at int64 ``rows [n]`` (meaningless where not occupied) and bool ``occupied [n]``."""
        return self._row_id.index_select(0, rows), self._row_state.index_select(0, rows) == OCCUPIED

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (for memory accounting)."""
        return [self._row_id, self._row_state, self._free]

    # ------------------------------------------------------------------ rows handed out and back

    def pop(self, k: int) -> torch.Tensor:
        """Take ``k <= num_free`` free rows: the stack's from the top, then never-used ones upward
        from the mark. Records those to report: rows that held an id before (every row with
        ``report_first_use``).

        Returns:
            torch.Tensor: int64 ``[k]`` rows.
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
            reused = stacked[self._row_state.index_select(0, stacked) == RETIRED]
            if self._tail_retired:
                reused = torch.cat([reused, fresh])
        if reused.numel():
            self._reassigned.append(reused)
            self._reassigned_count += reused.numel()
            if self._reassigned_count > 2 * self._capacity:
                merged = self.pending()
                self._reassigned = [merged]
                self._reassigned_count = merged.numel()
        return rows

    def occupy(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store distinct ``ids`` at free ``rows`` already taken (by :meth:`pop` or :meth:`claim`)."""
        self._row_id.index_copy_(0, rows, ids)  # index_copy_/index_fill_: a few times faster than
        self._row_state.index_fill_(0, rows, OCCUPIED)  # advanced-index writes on CPU
        self._size += ids.numel()

    def release(self, rows: torch.Tensor) -> torch.Tensor:
        """Free distinct occupied ``rows`` (retired: their embeddings hold the ids' values), pushed
        on the stack.

        Returns:
            torch.Tensor: int64 the ids they held, in the order of ``rows``.
        """
        ids = self._row_id.index_select(0, rows)
        self._row_state.index_fill_(0, rows, RETIRED)
        n = rows.numel()
        self._free[self._free_top : self._free_top + n] = rows.to(torch.int32)
        self._free_top += n
        self._size -= n
        return ids

    def claim(self, rows: torch.Tensor) -> None:
        """Take given distinct free ``rows`` (any, above the mark too) out of the free rows, for ids
        whose values the caller provides: they are not reported, and no longer pending.

        Rows at or above the mark that stay free join the bottom of the stack in the order they
        would have gone out (ascending).
        """
        hw, top = self._high_water, max(self._high_water, int(rows.max()) + 1)
        stack = torch.cat([torch.arange(top - 1, hw - 1, -1, device=self._device), self._free[: self._free_top].long()])
        if self._tail_retired:
            self._row_state[hw:top] = RETIRED
        self._high_water = top
        keep = torch.ones(top, dtype=torch.bool, device=self._device)
        keep[rows] = False
        stack = stack[keep[stack]]
        self._free_top = stack.numel()
        self._free[: self._free_top] = stack.to(torch.int32)
        if self._reassigned:
            pending = self.pending()
            pending = pending[~torch.isin(pending, rows)]
            self._reassigned = [pending] if pending.numel() else []
            self._reassigned_count = pending.numel()
        self._row_state[rows] = NEVER_USED

    # ------------------------------------------------------------------ reassigned rows

    def pending(self) -> torch.Tensor:
        """Sorted distinct int64 rows to report, not yet taken."""
        if not self._reassigned:
            return torch.zeros(0, dtype=torch.int64, device=self._device)
        return torch.cat(self._reassigned).unique()

    def take_pending(self) -> torch.Tensor:
        """:meth:`pending`, and forget them."""
        out = self.pending()
        self._reassigned = []
        self._reassigned_count = 0
        return out

    # ------------------------------------------------------------------ state

    def free_state(self) -> dict[str, torch.Tensor]:
        """The free rows as the state format holds them: ``free_rows`` (the stack, bottom to top,
        under the rows never handed out, ``capacity - 1`` down to the mark), ``retired_rows`` and
        ``reassigned_rows`` (:meth:`pending`)."""
        hw, dev, cap = self._high_water, self._device, self._capacity
        retired = (self._row_state[:hw] == RETIRED).nonzero().squeeze(1)
        if self._tail_retired:
            retired = torch.cat([retired, torch.arange(hw, cap, device=dev)])
        return {
            "free_rows": torch.cat(
                [torch.arange(cap - 1, hw - 1, -1, device=dev), self._free[: self._free_top].long()]
            ),
            "retired_rows": retired,
            "reassigned_rows": self.pending(),
        }

    def restore(self, free_rows: torch.Tensor, retired_rows: torch.Tensor, reassigned_rows: torch.Tensor) -> None:
        """Set the free rows of a fresh allocator from :meth:`free_state` values (checked), before
        the stored ids are placed at the other rows."""
        free, retired, cap = free_rows, retired_rows, self._capacity
        # The rows above the mark: the bottom of the stack while it reads capacity - 1, capacity - 2,
        # ... (the order they go out in from the mark) and its rows are all retired or all not (one
        # flag says which); the rest of the stack is kept as it is.
        descending = torch.arange(cap - 1, cap - 1 - free.numel(), -1, device=self._device)
        breaks = (free != descending).nonzero()
        run = int(breaks[0]) if breaks.numel() else free.numel()
        is_retired = torch.zeros(cap, dtype=torch.bool, device=self._device)
        is_retired[retired] = True
        tail_retired = run > 0 and bool(is_retired[cap - 1])
        odd = (is_retired[cap - run :] != tail_retired).nonzero()
        hw = cap - run + (int(odd[-1]) + 1 if odd.numel() else 0)
        self._high_water, self._tail_retired = hw, tail_retired
        stacked = free[cap - hw :]  # the rest of the stack, all below the mark
        self._free_top = stacked.numel()
        self._free[: self._free_top] = stacked.to(torch.int32)
        self._row_state[retired[retired < hw]] = RETIRED
        self._restore_pending(reassigned_rows)

    def restore_prefix(self, n: int) -> None:
        """Set a fresh allocator for ids about to be placed at rows ``0..n-1``: the rows from ``n`` up
        are free, go out in ascending order, and each is reported (retired) when handed out."""
        self._high_water, self._tail_retired = n, True

    def _restore_pending(self, reassigned: torch.Tensor) -> None:
        if reassigned.numel():
            self._reassigned = [reassigned]
            self._reassigned_count = reassigned.numel()
