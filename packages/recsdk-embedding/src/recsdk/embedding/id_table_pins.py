"""``IdTablePins``: rows an :class:`~recsdk.embedding.IdTable` must not evict.

Two kinds of pin, both read by eviction and TTL sweeps, which pass over pinned rows:

* references: each occurrence of a row given to :meth:`IdTablePins.add` is one reference (int32
  counts per row, resident only where written; ``-1`` entries, ids not admitted, go to a spare
  entry at index ``capacity`` and are dropped), until :meth:`IdTablePins.drop`;
* a step watermark (:meth:`IdTablePins.pin_since`): every row last used at or after a step. A
  pipeline's batches in flight are consecutive steps of the table, and a step writes its rows'
  last use, so pinning from the oldest batch in flight pins exactly the rows of the batches in
  flight (a ``RowLedger``'s pins): one integer per batch instead of two passes over its rows.
  The last use is eviction's array (``last_step``); the table hands it in to read.

A part of ``IdTable``: it owns the counts and the watermark; the table checks the rows it is
given and calls it.
"""

from __future__ import annotations

import torch

from recsdk.embedding.lazy_memory import lazy_zeros

__all__ = ["IdTablePins"]


class IdTablePins:
    """Reference-counted pins of one id table's rows.

    Args:
        name (str): the table's name, for errors.
        capacity (int): the table's rows.
        device (torch.device): where the counts live.

    Example::

        pins = IdTablePins("user", 8, torch.device("cpu"))
        pins.add(torch.tensor([3, 3, -1]))  # row 3 pinned twice, -1 ignored
        pins.pin_since(5)  # and every row last used at step 5 or later
        pins.num_pinned(high_water=4, last_step=last_step, occupied=occupied)
    """

    def __init__(self, name: str, capacity: int, device: torch.device) -> None:
        self._name = name
        self._capacity = capacity
        self._device = device
        self.reset()

    def reset(self) -> None:
        """No row pinned (fresh counts)."""
        self._pins_buf = lazy_zeros(self._capacity + 1, torch.int32, self._device)
        self._pins = self._pins_buf[: self._capacity]
        self._pin_end = 0  # no row at or above max(this, the table's high-water mark) was ever pinned
        self._references = 0  # occurrences added and not dropped (-1 entries too; 0: every count is zero)
        self._since: int | None = None  # rows last used at this step or later are pinned

    @property
    def since(self) -> int | None:
        """The step watermark: rows last used at this step or later are pinned (None: none)."""
        return self._since

    def pin_since(self, step: int | None) -> None:
        """Pin every row last used at ``step`` or later (replacing the previous watermark; None: none)."""
        self._since = step

    def referenced(self) -> torch.Tensor | None:
        """The reference counts (int32 ``[capacity]``), or None while no row holds a reference."""
        return self._pins if self._references else None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (for memory accounting)."""
        return [self._pins_buf]

    def add(self, rows: torch.Tensor) -> None:
        """One reference per occurrence of int64 ``rows`` in ``[-1, capacity)`` (``-1`` ignored)."""
        if rows.numel():
            self._pin_end = max(self._pin_end, int(rows.max()) + 1)
        self._add(rows, 1)
        self._references += rows.numel()

    def drop(self, rows: torch.Tensor) -> None:
        """Drop the references :meth:`add` took (same rows, same multiplicity).

        Raises:
            ValueError: a row would drop below zero references (the counts are left unchanged).
        """
        idx = self._add(rows, -1)
        counts = self._pins_buf.index_select(0, idx)
        if idx.numel() and int(counts.min()) < 0:
            row = int(rows[(counts < 0).nonzero()[0, 0]])
            self._add(rows, 1)
            raise ValueError(
                f"IdTable '{self._name}': unpin of row {row} more times than it was pinned "
                f"(pinned {int(self._pins[row])} times)"
            )
        self._references -= rows.numel()

    def num_pinned(self, high_water: int, last_step: torch.Tensor, occupied: torch.Tensor) -> int:
        """Number of rows with a pin: a reference (the table's rows below ``high_water`` and any
        referenced above it), or occupied and last used at or after the watermark.

        Args:
            high_water (int): the table's high-water mark.
            last_step (torch.Tensor): int32 ``[capacity]`` each row's last use.
            occupied (torch.Tensor): bool ``[high_water]`` the rows holding an id.
        """
        end = max(high_water, self._pin_end)
        pinned = self._pins[:end] > 0
        if self._since is not None:
            pinned[:high_water] |= occupied & (last_step[:high_water] >= self._since)
        return int(pinned.sum())

    def unpinned_mask(self, high_water: int, last_step: torch.Tensor) -> torch.Tensor:
        """bool ``[high_water]``: which rows below the mark have no pin (``last_step``: as in
        :meth:`num_pinned`)."""
        if self._references:
            unpinned = self._pins[:high_water] == 0
        else:
            unpinned = torch.ones(high_water, dtype=torch.bool, device=self._device)
        if self._since is not None:
            unpinned &= last_step[:high_water] < self._since
        return unpinned

    def any_pinned(self, rows: torch.Tensor, last_step: torch.Tensor) -> bool:
        """Whether one of int64 ``rows`` (occupied, in ``[0, capacity)``) is pinned."""
        pinned = self._pins[rows] > 0
        if self._since is not None:
            pinned |= last_step[rows] >= self._since
        return bool(pinned.any())

    def refuse_pinned(self, rows: torch.Tensor, what: str, last_step: torch.Tensor) -> None:
        """Raise ``ValueError`` (``what`` names the operation) if one of the occupied int64 ``rows``
        is pinned (``last_step``: as in :meth:`num_pinned`)."""
        if self.any_pinned(rows, last_step):
            raise ValueError(f"IdTable '{self._name}': {what} of ids whose rows are pinned; unpin them first")

    def _add(self, rows: torch.Tensor, delta: int) -> torch.Tensor:
        """Add ``delta`` to the count of each occurrence of ``rows`` (``-1`` entries go to the spare entry)."""
        idx = rows.masked_fill(rows < 0, self._capacity)
        self._pins_buf.index_add_(0, idx, torch.full_like(idx, delta, dtype=torch.int32))
        self._pins_buf[self._capacity] = 0
        return idx
