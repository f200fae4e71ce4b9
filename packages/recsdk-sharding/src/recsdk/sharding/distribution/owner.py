"""Id ownership: which rank's shard holds a raw int64 id.

``owner`` is defined here once and used by the input dist, checkpoint resharding and
statistics alike. It mixes the id (recsdk-embedding's 64-bit ``fmix64``, salted with
:data:`OWNER_SALT`) before taking the modulo, so structured ids (multiples of the world size,
time-ordered ids) spread evenly over the ranks. The salt differs from the id table's slot
salt, so ids owned by one rank still use every slot of that rank's table.
"""

from __future__ import annotations

import torch

from recsdk.embedding.hashing import fmix64

__all__ = ["OWNER_SALT", "owner"]

OWNER_SALT = 0x2545F4914F6CDD1D
_LOW63 = (1 << 63) - 1


def owner(ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank that owns each id: ``fmix64(id ^ OWNER_SALT) mod world_size``.

    Every id has exactly one owner in ``[0, world_size)``; the result depends only on the
    id and ``world_size``, the same in every process and on every device.

    Args:
        ids (torch.Tensor): integer ids, any shape (int32 is widened to int64).
        world_size (int): number of shards (>= 1).

    Returns:
        torch.Tensor: int64 owner ranks, same shape as ``ids``.

    Example::

        owner(torch.tensor([0, 2, 4, -7]), world_size=2)  # each entry 0 or 1
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dtype.is_complex:
        raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
    if world_size == 1:
        return torch.zeros_like(ids, dtype=torch.int64)
    h = fmix64(ids.to(torch.int64), salt=OWNER_SALT)
    if world_size & (world_size - 1) == 0:
        # A power of two: the low bits are the non-negative remainder (int64 remainder is slow on CPU).
        return h.bitwise_and_(world_size - 1)
    return torch.remainder(h.bitwise_and_(_LOW63), world_size)
