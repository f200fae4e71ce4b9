"""A count-min sketch with conservative update, for bounded-memory admission counting (counts or scores)."""

from __future__ import annotations

import torch

from recsdk.embedding.hashing import fmix64
from recsdk.embedding.slot_kernels import native_slot_kernels

__all__ = ["CountMinSketch"]

# One salt per sketch row; none equals the id table's slot salt or recsdk.sharding's owner salt
# (0x2545F4914F6CDD1D), so sketch counters, slots and owners are unrelated functions of the id.
_SALTS = (
    0x6A09E667F3BCC908,
    0x1B873593CC9E2D51,
    0x3C6EF372FE94F82B,
    0x27D4EB2F165667C5,
    0x165667B19E3779F9,
    0x61C8864680B583EB,
    0x7FEB352D846CA68B,
    0x5851F42D4C957F2D,
)
_INT64_MAX = (1 << 63) - 1


class CountMinSketch:
    """Approximate per-id counts (or non-negative integer amounts) in ``num_hashes * width`` counters.

    ``estimate`` never undercounts. ``add_one`` and ``add`` use conservative update (each counter
    of an id is raised to at most the id's new estimate), which keeps overcounting low. Counts
    saturate at ``cap``. On CPU, :meth:`read` and :meth:`add` run recsdk's native kernels
    (:func:`~recsdk.embedding.slot_kernels.native_slot_kernels`: one call instead of about 15 torch
    ops, the same counters) where they are built.

    Args:
        width (int): counters per row.
        num_hashes (int): rows (1 to 8).
        cap (int): counts saturate at this value.
        device (torch.device): where the counters live.
        dtype (torch.dtype): the counters' integer type (int32 for counts, int64 for scores).
    """

    def __init__(
        self, width: int, num_hashes: int, cap: int, device: torch.device, dtype: torch.dtype = torch.int32
    ) -> None:
        if not 1 <= num_hashes <= len(_SALTS):
            raise ValueError(f"num_hashes must be in [1, {len(_SALTS)}], got {num_hashes}")
        self.width = width
        self.num_hashes = num_hashes
        self.cap = cap
        self.counters = torch.zeros(width * num_hashes, dtype=dtype, device=device)
        self._salts = torch.tensor(_SALTS[:num_hashes], dtype=torch.int64, device=device).unsqueeze(1)  # [k, 1]
        self._row_starts = torch.arange(0, width * num_hashes, width, dtype=torch.int64, device=device).unsqueeze(1)
        self._kernels = native_slot_kernels() if self.counters.device.type == "cpu" else None

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Counter index of each id in each row.

        Args:
            ids (torch.Tensor): int64 ``[n]``.

        Returns:
            torch.Tensor: int64 ``[num_hashes, n]`` indices into ``counters``.
        """
        # Every row's hash in one pass over [num_hashes, n] (salts [num_hashes, 1] broadcast).
        return fmix64(ids, self._salts).bitwise_and_(_INT64_MAX).remainder_(self.width).add_(self._row_starts)

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`positions` of ``ids`` (int64 ``[n]``) and their :meth:`estimate`, in one pass."""
        if self._kernels is not None:
            return self._kernels.sketch_read(ids.contiguous(), self._salts.view(-1), self.width, self.counters)
        positions = self.positions(ids)
        return positions, self.estimate(positions)

    def estimate(self, positions: torch.Tensor) -> torch.Tensor:
        """Estimated counts (``[n]``, the counters' dtype) for ``positions`` from :meth:`positions`."""
        values = self.counters.index_select(0, positions.reshape(-1)).view(positions.shape)
        if values.dtype == torch.int32:  # one reduction: 3x faster than row by row here
            return values.amin(0)
        out = values[0]
        for j in range(1, self.num_hashes):  # int64 (scores): amin over dim 0 is 40x slower than rows
            out = torch.minimum(out, values[j])
        return out

    def add_one(self, positions: torch.Tensor, estimate: torch.Tensor) -> None:
        """Count one more sighting of each id (ids must be distinct), given their current estimates."""
        self.add(positions, estimate, 1)

    def add(self, positions: torch.Tensor, estimate: torch.Tensor, amounts: torch.Tensor | int) -> torch.Tensor:
        """Add ``amounts`` (>= 0) to each id's count (ids must be distinct), given their current estimates.

        Args:
            positions (torch.Tensor): from :meth:`positions`, ``[num_hashes, n]``.
            estimate (torch.Tensor): from :meth:`estimate`, ``[n]``.
            amounts (torch.Tensor | int): ``[n]`` (or one for all) non-negative amounts.

        Returns:
            torch.Tensor: the new estimates ``[n]`` (the counters' dtype).
        """
        new = (estimate + amounts).clamp_(max=self.cap)
        if self._kernels is not None:
            self._kernels.sketch_raise(positions.contiguous(), new.contiguous(), self.counters)
        elif positions.numel():
            self.counters.scatter_reduce_(
                0, positions.reshape(-1), new.expand(self.num_hashes, -1).reshape(-1), reduce="amax"
            )
        return new
