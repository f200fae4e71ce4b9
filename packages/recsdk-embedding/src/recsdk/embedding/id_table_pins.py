"""``IdTablePins``: rows an :class:`~recsdk.embedding.IdTable` must not evict, reference-counted.

A batch mapped ahead of its compute holds its rows until it has computed (a pipeline's
``RowLedger`` pins and unpins them); eviction and TTL sweeps pass over pinned rows. Each
occurrence of a row is one reference (int32 counts per row, resident only where written); ``-1``
entries (ids not admitted) go to a spare entry at index ``capacity`` and are dropped. A mixin of
``IdTable``: it reads the table's own arrays; nothing outside the table does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

__all__ = ["IdTablePins"]


class IdTablePins:
    """Reference-counted pins of an :class:`~recsdk.embedding.IdTable`'s rows (a mixin of it)."""

    if TYPE_CHECKING:  # the table's arrays and helpers this mixin reads (defined by IdTable)
        _name: str
        _capacity: int
        _high_water: int
        _pin_end: int
        _pins: torch.Tensor
        _pins_buf: torch.Tensor

        def _as_rows(self, rows: torch.Tensor, op: str, *, allow_missing: bool) -> torch.Tensor: ...

    def pin(self, rows: torch.Tensor) -> None:
        """Protect rows from eviction and reassignment (reference-counted, int32 counts).

        Each occurrence of a row adds one reference; ``-1`` entries (ids not admitted) are ignored,
        so the output of :meth:`find_or_insert` can be passed as is.

        Args:
            rows (torch.Tensor): integer rows in ``[-1, capacity)``, any shape.
        """
        flat = self._as_rows(rows, "pin", allow_missing=True)
        if flat.numel():
            self._pin_end = max(self._pin_end, int(flat.max()) + 1)
        self._add_pins(flat, 1)

    def unpin(self, rows: torch.Tensor) -> None:
        """Drop references taken by :meth:`pin` (same rows, same multiplicity).

        Raises:
            ValueError: a row would drop below zero references (the table is left unchanged).
        """
        flat = self._as_rows(rows, "unpin", allow_missing=True)
        idx = self._add_pins(flat, -1)
        counts = self._pins_buf.index_select(0, idx)
        if idx.numel() and int(counts.min()) < 0:
            row = int(flat[(counts < 0).nonzero()[0, 0]])
            self._add_pins(flat, 1)
            raise ValueError(
                f"IdTable '{self._name}': unpin of row {row} more times than it was pinned "
                f"(pinned {int(self._pins[row])} times)"
            )

    def num_pinned(self) -> int:
        """Number of rows with at least one pin."""
        return int((self._pins[: max(self._high_water, self._pin_end)] > 0).sum())

    def _add_pins(self, rows: torch.Tensor, delta: int) -> torch.Tensor:
        """Add ``delta`` to the pin count of each occurrence of ``rows`` (``-1`` entries go to the spare entry)."""
        idx = rows.masked_fill(rows < 0, self._capacity)
        self._pins_buf.index_add_(0, idx, torch.full_like(idx, delta, dtype=torch.int32))
        self._pins_buf[self._capacity] = 0
        return idx
