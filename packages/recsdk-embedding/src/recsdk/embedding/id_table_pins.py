"""``IdTablePins``: rows an :class:`~recsdk.embedding.IdTable` must not evict, reference-counted.

A batch mapped ahead of its compute holds its rows until it has computed (a pipeline's
``RowLedger`` pins and unpins them); eviction and TTL sweeps pass over pinned rows. Each
occurrence of a row is one reference (int32 counts per row, resident only where written); ``-1``
entries (ids not admitted) go to a spare entry at index ``capacity`` and are dropped. A part of
``IdTable``: it owns the counts; the table checks the rows it is given and calls it.
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
        pins.num_pinned(high_water=4)  # 1
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

    @property
    def counts(self) -> torch.Tensor:
        """int32 ``[capacity]``: the pins of each row, to read."""
        return self._pins

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (for memory accounting)."""
        return [self._pins_buf]

    def add(self, rows: torch.Tensor) -> None:
        """One reference per occurrence of int64 ``rows`` in ``[-1, capacity)`` (``-1`` ignored)."""
        if rows.numel():
            self._pin_end = max(self._pin_end, int(rows.max()) + 1)
        self._add(rows, 1)

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

    def num_pinned(self, high_water: int) -> int:
        """Number of rows with at least one pin (the table's rows below ``high_water`` and any
        pinned above it)."""
        return int((self._pins[: max(high_water, self._pin_end)] > 0).sum())

    def unpinned_mask(self, high_water: int) -> torch.Tensor:
        """bool ``[high_water]``: which rows below the mark have no pin."""
        return self._pins[:high_water] == 0

    def any_pinned(self, rows: torch.Tensor) -> bool:
        """Whether one of int64 ``rows`` (in ``[0, capacity)``) is pinned."""
        return bool((self._pins[rows] > 0).any())

    def refuse_pinned(self, rows: torch.Tensor, what: str) -> None:
        """Raise ``ValueError`` (``what`` names the operation) if one of int64 ``rows`` is pinned."""
        if self.any_pinned(rows):
            raise ValueError(f"IdTable '{self._name}': {what} of ids whose rows are pinned; unpin them first")

    def _add(self, rows: torch.Tensor, delta: int) -> torch.Tensor:
        """Add ``delta`` to the count of each occurrence of ``rows`` (``-1`` entries go to the spare entry)."""
        idx = rows.masked_fill(rows < 0, self._capacity)
        self._pins_buf.index_add_(0, idx, torch.full_like(idx, delta, dtype=torch.int32))
        self._pins_buf[self._capacity] = 0
        return idx
