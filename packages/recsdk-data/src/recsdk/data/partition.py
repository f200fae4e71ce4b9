"""Which part of a data stream the current process reads: its rank and DataLoader worker.

Every dataset in ``recsdk.data`` splits its input the same way. With ``W`` DataLoader
workers per rank, worker ``w`` of rank ``r`` is shard ``r + world_size * w`` of
``world_size * W``. Items (lines, rows, row groups) dealt round-robin to the shards
(item ``i`` to shard ``i % num_shards``) then go to rank ``i % world_size`` whatever ``W``
is: the workers only split a rank's items among themselves, so a rank reads the same
items with or without workers, and the ranks never overlap.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.utils.data

from recsdk.data._checks import check_int

__all__ = ["check_rank_and_world_size", "current_shard", "current_worker", "resolve_rank_and_world_size"]


def check_rank_and_world_size(rank: int | None, world_size: int | None) -> None:
    """Validate an explicit ``rank`` / ``world_size`` pair (both ``None`` is allowed).

    Raises:
        ValueError: only one of the two is given, ``world_size < 1`` or ``rank`` is
            outside ``[0, world_size)``.
        TypeError: either is not an int.
    """
    if (rank is None) != (world_size is None):
        raise ValueError(f"give both rank and world_size or neither; got rank={rank!r}, world_size={world_size!r}")
    if rank is None or world_size is None:
        return
    check_int("rank", rank)
    check_int("world_size", world_size, minimum=1)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def resolve_rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values if given, else ``torch.distributed``'s when initialised, else ``(0, 1)``.

    Args:
        rank (int | None): this process's rank, or ``None`` to ask ``torch.distributed``.
        world_size (int | None): number of ranks, or ``None`` (together with ``rank``).

    Returns:
        tuple[int, int]: ``(rank, world_size)``.
    """
    check_rank_and_world_size(rank, world_size)
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def current_worker() -> tuple[int, int]:
    """``(worker_id, num_workers)`` of the DataLoader worker running this code, ``(0, 1)`` outside one."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return 0, 1
    return int(info.id), int(info.num_workers)


def current_shard(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """This process's part of the input: ``(rank + world_size * worker_id, world_size * num_workers)``.

    Args:
        rank (int | None): see :func:`resolve_rank_and_world_size`.
        world_size (int | None): see :func:`resolve_rank_and_world_size`.

    Returns:
        tuple[int, int]: ``(shard, num_shards)`` with ``0 <= shard < num_shards``.

    Example::

        shard, num_shards = current_shard()
        rows = range(shard, total_rows, num_shards)  # this worker's rows
    """
    r, ws = resolve_rank_and_world_size(rank, world_size)
    worker, num_workers = current_worker()
    return r + ws * worker, ws * num_workers
