"""``RowChangeTracker``: which rows of an :class:`~recsdk.embedding.IdTable` changed since the last
published version, and which published ids have left the table.

A publisher (:class:`recsdk.sharding.Publisher`) writes versions: a full one holds every id with
its row, a delta the ids whose rows changed since the previous version and the ids deleted since
it. The tracker is the bookkeeping that makes a delta exact; its duties:

* **changes are stamped, not flagged.** Every change to a row (an id placed in it, its id freed,
  its values trained or reset) writes the current *epoch* into ``stamp[row]``. A snapshot for a
  version takes the rows stamped at or after the epoch of the last published snapshot, and opens
  a new epoch; changes made while the version is written (a pipeline's host thread maps batches
  meanwhile) carry the new epoch, so a successful publish never clears them, and a failed one
  changes nothing (its rows are taken again by the next snapshot).
* **published rows know their id.** ``published[row]`` is set when the row's id went out in a
  committed version. When that id leaves the row (eviction, expiry, removal), the tracker keeps
  it in ``left``; a snapshot turns ``left`` into the version's deleted ids, minus those present
  again (their new row is stamped, so they go out as upserts).
* **rows owed a reset are not published** (a pipeline mapped a batch ahead and gave one of its
  new ids a row of an evicted id; the row still holds the old id's values until the batch
  computes). Such a row stays stamped, and its previous id is deleted.
* **continuity**: ``token`` is the token of the last version this tracker's table went out in.
  State replaced wholesale (a checkpoint load, a rebuild, rows re-initialised) resets the tracker:
  no token, so the next version is full.

The tracker is written by its :class:`~recsdk.embedding.IdTable` (placements and frees, under the
table's caller's lock) and by the training step (:meth:`changed`: the rows a batch trained); a
publisher reads it through the table, which knows the ids of the rows
(:meth:`IdTablePublishing.snapshot`), and commits through it once the version is published
(:meth:`IdTablePublishing.commit`). The tracker knows rows and ids only as it is told them: it
never reads the table. Memory: 5 bytes per row (int32 stamps, bool flags), in lazily zeroed
pages on CPU.

Example::

    table.publishing.track()
    snap = table.publishing.snapshot(full=False, exclude=owed_rows)
    ...  # write snap.ids with their rows, and snap.deleted
    table.publishing.commit(snap, token="9f3a...")
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsdk.embedding.lazy_memory import lazy_zeros

__all__ = ["ChangeSnapshot", "RowChangeTracker"]

_EMPTY = torch.zeros(0, dtype=torch.int64)


@dataclass
class ChangeSnapshot:
    """What one table shard contributes to a version.

    Attributes:
        full (bool): every id of the table (a full version), else the changes since the last one.
        ids (torch.Tensor): int64 ``[n]`` ids to write with their rows (upserts).
        rows (torch.Tensor): int64 ``[n]`` their rows in the table.
        deleted (torch.Tensor): int64 ``[m]`` ids deleted since the last version (empty for a full one).
        epoch (int): the epoch the snapshot closed.
        left_taken (int): entries of the tracker's ``left`` list the snapshot consumed.
        excluded (torch.Tensor): int64 rows left out because they are owed a reset.
    """

    full: bool
    ids: torch.Tensor
    rows: torch.Tensor
    deleted: torch.Tensor
    epoch: int
    left_taken: int
    excluded: torch.Tensor


class RowChangeTracker:
    """Change stamps, published flags and departed ids of one id table's rows.

    Args:
        capacity (int): the table's rows.
        device (torch.device): the table's device.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self._capacity = capacity
        self._device = device
        self.reset()

    def reset(self) -> None:
        """Forget everything (the table's state was replaced): the next version must be full."""
        self._stamp = lazy_zeros(self._capacity, torch.int32, self._device)
        self._published = lazy_zeros(self._capacity, torch.bool, self._device)
        self._epoch = 1  # stamps of the changes being made now
        self._base = 1  # rows stamped at or after it changed since the last published snapshot
        self._left: list[torch.Tensor] = []
        self.token: str | None = None
        """The token of the last version this table went out in; None: the next version is full."""

    # ------------------------------------------------------------------ written by the table and training

    def changed(self, rows: torch.Tensor) -> None:
        """Rows whose values changed (trained, reset); ``-1`` entries are ignored."""
        if rows.numel():
            rows = rows.to(self._device)
            self._stamp.index_fill_(0, rows[rows >= 0] if bool((rows < 0).any()) else rows, self._epoch)

    def placed(self, rows: torch.Tensor) -> None:
        """Rows just given to new ids."""
        self._stamp.index_fill_(0, rows, self._epoch)

    def freed(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Distinct rows whose ids (``ids``, same order) just left the table."""
        gone = self._published.index_select(0, rows)
        if bool(gone.any()):
            self._left.append(ids[gone].clone())
            self._published.index_fill_(0, rows, False)
        self._stamp.index_fill_(0, rows, self._epoch)

    # ------------------------------------------------------------------ read and committed through the table

    def changed_rows(self) -> torch.Tensor:
        """int64 rows stamped since the last published snapshot, ascending (reads only)."""
        return (self._stamp >= self._base).nonzero().squeeze(1)

    @property
    def num_departed(self) -> int:
        """Entries of the list of published ids that left their rows."""
        return len(self._left)

    def departed(self, count: int) -> torch.Tensor:
        """The distinct ids of the list's first ``count`` entries (int64, ascending; reads only)."""
        if not count:
            return _EMPTY.to(self._device)
        return torch.cat(self._left[:count]).unique()

    def close_epoch(self) -> int:
        """Open a new epoch for the changes made from now on; returns the closed one (a snapshot's)."""
        epoch = self._epoch
        self._epoch += 1
        return epoch

    def published(self, snap: ChangeSnapshot, still: torch.Tensor, token: str) -> None:
        """The version holding ``snap`` is published as ``token``: its ids count as published from
        now on, except those that no longer hold their rows (bool ``still [n]`` is False), which
        count as departed (the next version deletes them). Rows it left out stay changed."""
        if snap.full:
            self._published.zero_()
        self._published[snap.rows[still]] = True
        if not bool(still.all()):
            self._left.append(snap.ids[~still].clone())
        del self._left[: snap.left_taken]
        self._base = snap.epoch + 1
        if snap.excluded.numel():  # still to be published, once reset
            self._stamp.index_fill_(0, snap.excluded, self._epoch)
        self.token = token
