"""``IdTablePublishing``: what an :class:`~recsdk.embedding.IdTable` tells the versions published
to serving.

It owns the table's :class:`~recsdk.embedding.RowChangeTracker` (which rows changed and which
ids left since the last published version; None until tracking starts), passes it the table's
placements and frees, and makes a version's snapshot and commit from the tracker's rows and the
ids the table's :class:`~recsdk.embedding.row_allocator.RowAllocator` holds at them. A public part
of ``IdTable`` (:attr:`IdTable.publishing`): a publisher calls :meth:`IdTablePublishing.track`,
:meth:`IdTablePublishing.snapshot` and :meth:`IdTablePublishing.commit` under the lock that
serialises the table's other callers (a snapshot and its commit are made under it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recsdk.embedding.change_tracker import ChangeSnapshot, RowChangeTracker
from recsdk.embedding.id_table_inputs import check_usable
from recsdk.embedding.row_allocator import RowAllocator

__all__ = ["IdTablePublishing"]

_EMPTY = torch.zeros(0, dtype=torch.int64)


class IdTablePublishing:
    """Change tracking, snapshots and commits of one id table's published versions.

    Args:
        name (str): the table's name, for errors.
        rows (RowAllocator): the table's rows (read: their ids).
        find (Callable[[torch.Tensor], torch.Tensor]): the table's lookup of ids (rows, ``-1``
            where absent; reads only), to tell which departed ids came back.
        capacity (int): the table's rows.
        device (torch.device): the table's device.

    Example::

        table.publishing.track()
        snap = table.publishing.snapshot(full=False, exclude=owed_rows)
        table.publishing.commit(snap, token="9f3a...")
    """

    def __init__(
        self,
        name: str,
        rows: RowAllocator,
        find: Callable[[torch.Tensor], torch.Tensor],
        capacity: int,
        device: torch.device,
    ) -> None:
        self._name = name
        self._rows = rows
        self._find = find
        self._capacity = capacity
        self._device = device
        self._tracker: RowChangeTracker | None = None

    @property
    def tracker(self) -> RowChangeTracker | None:
        """The tracker (None until :meth:`track`)."""
        return self._tracker

    def track(self) -> RowChangeTracker:
        """Start tracking which rows change and which ids leave (idempotent); returns the tracker.

        The table stamps the rows it places ids in and frees; whoever trains the rows stamps those
        (``table.changes.changed(rows)``). Replacing the table's state (:meth:`IdTable.load_state_dict`,
        :meth:`IdTableState.rebuild`) resets the tracker (:meth:`reset`).

        Returns:
            RowChangeTracker: the table's tracker.
        """
        check_usable(self._name, self._device)
        if self._tracker is None:
            self._tracker = RowChangeTracker(self._capacity, self._device)
        return self._tracker

    # ------------------------------------------------------------------ told by the table

    def placed(self, rows: torch.Tensor) -> None:
        """Rows just given to new ids."""
        if self._tracker is not None:
            self._tracker.placed(rows)

    def freed(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Distinct rows whose ids (same order) just left the table."""
        if self._tracker is not None:
            self._tracker.freed(rows, ids)

    def reset(self) -> None:
        """The rows' ids were replaced wholesale: the next version is full."""
        if self._tracker is not None:
            self._tracker.reset()

    # ------------------------------------------------------------------ versions

    def snapshot(self, *, full: bool, exclude: torch.Tensor | None = None) -> ChangeSnapshot:
        """What the table's next version holds; changes nothing but the tracker's epoch (tracking
        starts first if it had not, as :meth:`track`). Call under the lock that serialises the
        table's other callers.

        Args:
            full (bool): every id (a full version), or only the changes since the last commit.
            exclude (torch.Tensor | None): rows owed a reset: their ids are left out (and stay
                changed for the next version).

        Returns:
            ChangeSnapshot: ids and rows ascending by row, the deleted ids ascending.
        """
        tracker = self.track()
        excluded = _EMPTY.to(self._device) if exclude is None else exclude.to(self._device, torch.int64).unique()
        if full:
            ids, rows = self._rows.ids_and_rows()
        else:
            rows = tracker.changed_rows()
            ids, occupied = self._rows.occupants(rows)
            ids, rows = ids[occupied], rows[occupied]
        if excluded.numel():
            keep = ~torch.isin(rows, excluded)
            ids, rows = ids[keep], rows[keep]
        left_taken = tracker.num_departed
        deleted = _EMPTY.to(self._device)
        if not full and left_taken:
            gone = tracker.departed(left_taken)
            now = self._find(gone)
            back = now >= 0
            if excluded.numel():
                back &= ~torch.isin(now, excluded)
            deleted = gone[~back]
        return ChangeSnapshot(full, ids, rows, deleted, tracker.close_epoch(), left_taken, excluded)

    def commit(self, snap: ChangeSnapshot, token: str) -> None:
        """The version holding ``snap`` (from :meth:`snapshot`) is published as ``token``: its ids
        count as published from now on. Ids of ``snap`` whose rows changed hands since the snapshot
        count as departed (the next version deletes them). Call under the same lock as
        :meth:`snapshot`.

        Args:
            snap (ChangeSnapshot): the version's snapshot.
            token (str): the published version's token.
        """
        check_usable(self._name, self._device)
        ids_now, occupied = self._rows.occupants(snap.rows)
        self.track().published(snap, occupied & (ids_now == snap.ids), token)
