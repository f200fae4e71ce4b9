"""Row-wise pooled output dist for gloo: one all-to-all and a local sum instead of a reduce-scatter.

Row-wise sharding returns each rank's partial pooled sums for every rank's samples; the
owner of the samples adds them up. TorchRec does this with a reduce-scatter, which gloo runs
as a slow generic collective (on 2 CPU ranks, a ``[2048, 128]`` float reduce-scatter takes
about 5x an all-to-all of the same tensor, and its backward all-gather about 2.5x). An
all-to-all moves exactly the bytes a reduce-scatter must move, and the sum over ``world_size``
partials is cheap on the host, so on gloo this dist is a plain ``all_to_all_single`` forward
and backward. It also takes unequal batch sizes per rank. Gradients are divided by the world
size when TorchRec's ``get_gradient_division()`` is on, exactly as its own collectives do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable

from recsdk.sharding import _torchrec_compat as compat

__all__ = ["AllToAllPooledEmbeddingDist", "is_gloo"]


class _SumReceivedPartials(torch.autograd.Function):
    """Forward: sum the received partials. Backward: send each rank the gradient of its samples."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local_embs: torch.Tensor, received: torch.Tensor, splits: list[int], pg: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits = splits
        ctx.pg = pg
        world_size = len(splits)
        # Explicit width: a rank with no samples has 0 rows, and view(..., 0, -1) is ambiguous.
        return received.view(world_size, splits[pg.rank()], received.shape[1]).sum(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        splits: list[int] = ctx.splits
        pg: dist.ProcessGroup = ctx.pg
        world_size = len(splits)
        if get_gradient_division():  # as TorchRec's collectives: the same gradients as on one rank
            grad = grad / world_size
        # Every rank's partials for my samples got the same gradient: mine.
        send = grad.contiguous().repeat(world_size, 1)
        recv = grad.new_empty((sum(splits), grad.shape[1]))
        dist.all_to_all_single(
            recv, send, output_split_sizes=splits, input_split_sizes=[grad.shape[0]] * world_size, group=pg
        )
        return recv, None, None, None


class _AllToAllPooledAwaitable(Awaitable[torch.Tensor]):
    """The all-to-all runs on gloo's thread from construction; ``wait`` sums and wires autograd."""

    def __init__(self, local_embs: torch.Tensor, splits: list[int], pg: dist.ProcessGroup) -> None:
        super().__init__()
        world_size = pg.size()
        mine = splits[pg.rank()]
        self._local_embs = local_embs
        self._splits = splits
        self._pg = pg
        self._received = local_embs.new_empty((world_size * mine, local_embs.shape[1]))
        self._work = dist.all_to_all_single(
            self._received,
            local_embs.detach().contiguous(),
            output_split_sizes=[mine] * world_size,
            input_split_sizes=splits,
            group=pg,
            async_op=True,
        )

    def _wait_impl(self) -> torch.Tensor:
        assert self._work is not None
        self._work.wait()
        return _SumReceivedPartials.apply(self._local_embs, self._received, self._splits, self._pg)


class AllToAllPooledEmbeddingDist(RwPooledEmbeddingDist):
    """Row-wise pooled output dist as ``all_to_all_single`` + local sum (for gloo groups).

    Same input and output as TorchRec's ``RwPooledEmbeddingDist``: ``local_embs`` of shape
    ``[sum(batch_size_per_rank), D]`` (this rank's partial pooled sums for every rank's samples)
    becomes ``[batch_size_per_rank[rank], D]``, the full sums for this rank's samples. Variable
    batch per feature falls back to TorchRec's reduce-scatter.

    Args:
        pg (dist.ProcessGroup): the (gloo) group of the row-wise shards.
        embedding_dims (list[int]): as TorchRec's ``RwPooledEmbeddingDist``.
        qcomm_codecs_registry: as TorchRec's; quantized comms are not applied by the
            all-to-all path, so a registry with a reduce-scatter codec keeps TorchRec's dist.

    Example::

        dist_ = AllToAllPooledEmbeddingDist(pg, embedding_dims=[16, 16])
        pooled = dist_(local_embs, sharding_ctx).wait()  # [B_local, 32]
    """

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: EmbeddingShardingContext | None = None
    ) -> Awaitable[torch.Tensor]:
        if compat.quantized_comms(self) or (sharding_ctx is not None and sharding_ctx.variable_batch_per_feature):
            return super().forward(local_embs, sharding_ctx)
        pg = compat.sharding_group(self)
        world_size = pg.size()
        if sharding_ctx is not None and sharding_ctx.batch_size_per_rank:
            splits = list(sharding_ctx.batch_size_per_rank)
        else:
            splits = [local_embs.shape[0] // world_size] * world_size
        return _AllToAllPooledAwaitable(local_embs, splits, pg)


def is_gloo(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` is a gloo group torch.distributed knows (else TorchRec's dists stay)."""
    try:
        return dist.get_backend(pg) == dist.Backend.GLOO
    except (ValueError, RuntimeError):  # a group torch.distributed does not know: keep TorchRec's dist
        return False
