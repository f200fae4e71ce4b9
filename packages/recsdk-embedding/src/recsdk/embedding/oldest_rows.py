"""``OldestRows``: an id table's least recently used rows, found by one scan and handed out to
several evictions.

An eviction by last use (:class:`~recsdk.embedding.LRUEviction`, and
:class:`~recsdk.embedding.TTLEviction` when the table is full) frees the ``count`` occupied rows
with the smallest ``(last_step, row)`` that are neither pinned nor used by the step's batch. A
scan of the whole table finds them, at a cost in the table's capacity on every step that
evicts. This queue scans once for the rows below a threshold ``T`` (the ``depth``-th smallest
last step, and at most the step of the scan), sorted by ``(last_step, row)``. Every other row
then has a last step at or above ``T``, and a row's last step only grows while the table runs: a
use or a placement writes the current step, which is past ``T``. So while enough rows of the
queue are still below ``T``, occupied, unpinned and not in the batch, the ``count`` first of
them are exactly the rows the scan would pick, in the scan's order (below the ``count``-th
smallest last step by row, then its ties by row). Pinned rows stay in the queue (they may be
unpinned later); rows used or freed since the scan leave it.

Duties of the table: :meth:`OldestRows.clear` whenever last steps are written otherwise than by
a use or a placement at the current step (a state load, a rebuild, rows placed with given
steps); and when :meth:`OldestRows.take` returns None, a scan (:meth:`OldestRows.refill`) or the
table's own full selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from recsdk.embedding.slot_kernels import SlotKernels

__all__ = ["OldestRows", "RowsInUse"]

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class RowsInUse:
    """What keeps a row of the queue from going now, as the table reads it at a step.

    Attributes:
        last_step (torch.Tensor): int32 last step per row (at least the scanned rows).
        row_state (torch.Tensor): int8 state per row (at least the scanned rows).
        pins (torch.Tensor | None): int32 pin references per row (at least the scanned rows);
            None: no row holds one.
        since (int | None): rows last used at this step or later are pinned too (None: none).
        batch (torch.Tensor): bool per row, the step's batch's rows (at least the scanned rows).
    """

    last_step: torch.Tensor
    row_state: torch.Tensor
    pins: torch.Tensor | None
    since: int | None
    batch: torch.Tensor


class OldestRows:
    """The rows of one id table with the oldest last steps, in ``(last_step, row)`` order.

    Args:
        occupied_state (int): the per-row state of a row holding an id.
        kernels (SlotKernels | None): recsdk's native kernels, which run :meth:`can_free` and
            :meth:`take` in one call each (CPU tables; None: torch ops). Both give the same victims
            and leave the same queue.

    Example::

        oldest = OldestRows(occupied_state=1)
        in_use = RowsInUse(last_step, row_state, pins=None, since=None, batch=batch_rows)
        victims = oldest.take(count, in_use)
        if victims is None:
            oldest.refill(last_step[:hw], row_state[:hw] == 1, depth=16 * count, step=table_step)
            victims = oldest.take(count, in_use)
    """

    def __init__(self, occupied_state: int, kernels: SlotKernels | None = None) -> None:
        self._occupied_state = occupied_state  # the per-row state of a row holding an id
        self._kernels = kernels  # recsdk's native kernels (CPU tables), else torch ops
        self._rows: torch.Tensor | None = None  # int64, sorted by (last_step, row)
        self._threshold = 0  # every row outside the queue had a last step >= this at the scan

    def clear(self) -> None:
        """Forget the queue (last steps were written out of order)."""
        self._rows = None

    def refill(self, last_step: torch.Tensor, occupied: torch.Tensor, depth: int, step: int) -> None:
        """Scan for the occupied rows below the ``depth``-th smallest last step (and below ``step``).

        Args:
            last_step (torch.Tensor): int32 ``[high_water]`` last step of every row.
            occupied (torch.Tensor): bool ``[high_water]``.
            depth (int): how many rows the scan looks for (>= 1).
            step (int): the table's current step (a row placed later gets a later one).
        """
        n = last_step.numel()
        if n == 0:
            self._rows = None
            return
        key = last_step.masked_fill(~occupied, _INT32_MAX)
        kth = int(torch.kthvalue(key, min(depth, n)).values)
        self._threshold = min(kth, step)
        rows = (key < self._threshold).nonzero().squeeze(1)  # in row order
        order = torch.sort(key.index_select(0, rows), stable=True).indices  # by last step, then row
        self._rows = rows.index_select(0, order)

    def can_free(self, count: int, in_use: RowsInUse) -> bool:
        """Whether :meth:`take` would find ``count`` rows now (reads only)."""
        rows = self._rows
        if rows is None or rows.numel() < count:
            return False
        if self._kernels is not None:
            return self._kernels.queue_free_rows(rows, in_use, self._threshold, self._occupied_state) >= count
        _, _, free = self._free(rows, in_use)
        return int(free.sum()) >= count

    def take(self, count: int, in_use: RowsInUse) -> torch.Tensor | None:
        """The ``count`` rows to evict, in the full selection's order, taken out of the queue; or
        None (the queue is empty, or too few of its rows may go: scan again).

        Args:
            count (int): rows to free (>= 1).
            in_use (RowsInUse): what keeps rows from going now.
        """
        rows = self._rows
        if rows is None or rows.numel() < count:
            return None
        if self._kernels is not None:  # the same victims and queue, in one call
            victims, kept_rows = self._kernels.queue_take(rows, in_use, self._threshold, self._occupied_state, count)
            self._rows = rows[:kept_rows]
            return victims
        keys, kept, free = self._free(rows, in_use)
        positions = free.nonzero().squeeze(1)[:count]
        if positions.numel() < count:
            self._rows = rows[kept]
            return None
        kept.index_fill_(0, positions, False)
        self._rows = rows[kept]
        chosen, chosen_keys = rows.index_select(0, positions), keys.index_select(0, positions)
        kth = chosen_keys[-1]
        below = chosen[chosen_keys < kth].sort().values
        ties = chosen[chosen_keys == kth].sort().values
        return torch.cat([below, ties])

    def _free(self, rows: torch.Tensor, in_use: RowsInUse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queue's rows' last steps; which stay in it (still below the threshold and
        occupied: pinned ones too); and which may go now (unpinned, not in the batch)."""
        keys = in_use.last_step.index_select(0, rows)
        kept = (keys < self._threshold) & (in_use.row_state.index_select(0, rows) == self._occupied_state)
        free = kept & ~in_use.batch.index_select(0, rows)
        if in_use.pins is not None:
            free &= in_use.pins.index_select(0, rows) == 0
        since = in_use.since
        if since is not None and since <= self._threshold:  # else every row of the queue is below it
            free &= keys < since
        return keys, kept, free
