"""``IdTablePublishing``: what publishing and serving read of an :class:`~recsdk.embedding.IdTable`.

Its :class:`~recsdk.embedding.RowChangeTracker` (which rows changed and which ids left since the
last published version), the ids held at given rows, and its FBGEMM hash index as the serving
module's TorchScript lookup reads it. A mixin of ``IdTable``: it reads the table's own arrays;
nothing outside the table does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from recsdk.embedding.change_tracker import RowChangeTracker
from recsdk.embedding.id_table_state import _OCCUPIED
from recsdk.embedding.slot_index import FbgemmSlotIndex

if TYPE_CHECKING:
    from recsdk.embedding.slot_index import TorchSlotIndex

__all__ = ["IdTablePublishing"]


class IdTablePublishing:
    """Change tracking and read access for publishing and serving (a mixin of :class:`~recsdk.embedding.IdTable`)."""

    if TYPE_CHECKING:  # the table's arrays and helpers this mixin reads (defined by IdTable)
        _name: str
        _capacity: int
        _device: torch.device
        _changes: RowChangeTracker | None
        _row_id: torch.Tensor
        _row_state: torch.Tensor
        _index: TorchSlotIndex | FbgemmSlotIndex

        @property
        def index_kind(self) -> str: ...
        def _check_usable(self) -> None: ...

    @property
    def changes(self) -> RowChangeTracker | None:
        """The tracker of changed rows and departed ids (None until :meth:`track_changes`)."""
        return self._changes

    def track_changes(self) -> RowChangeTracker:
        """Track which rows change and which ids leave from now on, for versions published to
        serving (:class:`~recsdk.embedding.change_tracker.RowChangeTracker`); idempotent.

        The table stamps the rows it places ids in and frees; whoever trains the rows stamps those
        (``table.changes.changed(rows)``). Replacing the table's state (:meth:`load_state_dict`,
        :meth:`rebuild`) resets the tracker.

        Returns:
            RowChangeTracker: the table's tracker.
        """
        self._check_usable()
        if self._changes is None:
            self._changes = RowChangeTracker(self._capacity, self._device)
        return self._changes

    def occupants(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids stored at ``rows`` and which of the rows hold one.

        Args:
            rows (torch.Tensor): int64 ``[n]`` rows in ``[0, capacity)``.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: int64 ``ids [n]`` (meaningless where not occupied)
            and bool ``occupied [n]``.
        """
        self._check_usable()
        return self._row_id.index_select(0, rows), self._row_state.index_select(0, rows) == _OCCUPIED

    def index_state(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The hash index as FBGEMM's ``pruned_hashmap_lookup`` reads it, for a lookup outside Python
        (a serving module under TorchScript): see :meth:`FbgemmSlotIndex.kernel_state`.

        Raises:
            RuntimeError: the table's index is not FBGEMM's (not on CPU, or FBGEMM not loaded).
        """
        if not isinstance(self._index, FbgemmSlotIndex):
            raise RuntimeError(f"IdTable '{self._name}': its index is {self.index_kind!r}, not FBGEMM's (CPU)")
        return self._index.kernel_state()
