"""Pooled output dists for gloo: row-wise as one all-to-all; both carry the host stage's flag.

**Row-wise** (:class:`AllToAllPooledEmbeddingDist`): one all-to-all and a local sum instead of a
reduce-scatter.

Row-wise sharding returns each rank's partial pooled sums for every rank's samples; the
owner of the samples adds them up. TorchRec does this with a reduce-scatter, which gloo runs
as a slow generic collective (on 2 CPU ranks, a ``[2048, 128]`` float reduce-scatter takes
about 5x an all-to-all of the same tensor, and its backward all-gather about 2.5x). An
all-to-all moves exactly the bytes a reduce-scatter must move, and the sum over ``world_size``
partials is cheap on the host, so on gloo this dist is a plain ``all_to_all_single`` forward
and backward. It also takes unequal batch sizes per rank. Gradients are divided by the world
size when TorchRec's ``get_gradient_division()`` is on, exactly as its own collectives do.

**Table-wise** (:class:`FlagCarryingTwPooledEmbeddingDist`): TorchRec's all-to-all, with the flag.

**The flag**: a sharded hash module's inline host stage must fail every rank if it fails on
one (:class:`~recsdk.sharding.FailureAgreement`). Rather than an all-reduce of its own each
step (on a busy 2-core host, ~0.5-1 ms of a 15 ms step: the wake-ups of one more collective),
the flag travels in the output dist's all-to-all, which every rank runs anyway: each rank sends
every rank (itself included) one header row ahead of its rows, filled with its flag
(:class:`~recsdk.sharding.distribution.agreement.CarriedFlag`). A dist carries it only where every rank
sends a row to every rank (row-wise always; table-wise where every rank holds a table), on gloo,
without quantized comms; ``FlagCarrier.carries_flag`` says so, the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable

from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.distribution.agreement import CarriedFlag

__all__ = [
    "AllToAllPooledEmbeddingDist",
    "FlagCarrier",
    "FlagCarryingTwPooledEmbeddingDist",
    "is_gloo",
    "with_header_rows",
]


def with_header_rows(local_embs: torch.Tensor, rows_per_rank: list[int], value: float) -> torch.Tensor:
    """``local_embs`` (rows grouped by destination rank) with one row of ``value`` ahead of each group.

    Args:
        local_embs (torch.Tensor): ``[sum(rows_per_rank), D]``.
        rows_per_rank (list[int]): the rows going to each rank, in rank order.
        value (float): what the header rows hold (the carried flag).

    Returns:
        torch.Tensor: ``[sum(rows_per_rank) + len(rows_per_rank), D]`` (autograd flows to ``local_embs``).
    """
    header = local_embs.new_full((1, local_embs.shape[1]), value)
    pieces: list[torch.Tensor] = []
    for chunk in local_embs.split(rows_per_rank):
        pieces += [header, chunk]
    return torch.cat(pieces)


class FlagCarrier:
    """An output dist that can carry a :class:`~recsdk.sharding.distribution.agreement.CarriedFlag`.

    Duties: :meth:`carries_flag` answers the same on every rank (it reads the plan, the backend
    and the comms settings, never the batch); once :meth:`carry` was called, every forward sends
    the flag and records what arrived, or exchanges it by ``CarriedFlag.all_reduce``.
    """

    _flag: CarriedFlag | None = None

    def carries_flag(self) -> bool:
        """Whether :meth:`carry` can hand it a flag."""
        raise NotImplementedError

    def carry(self, flag: CarriedFlag) -> None:
        """Carry ``flag`` in every call from now on (requires :meth:`carries_flag`)."""
        self._flag = flag


def _batch_size_per_rank(
    local_embs: torch.Tensor, sharding_ctx: EmbeddingShardingContext | None, world_size: int
) -> list[int]:
    """The samples of each rank in ``local_embs`` (equal shares when the context does not say)."""
    if sharding_ctx is not None and sharding_ctx.batch_size_per_rank:
        return list(sharding_ctx.batch_size_per_rank)
    return [local_embs.shape[0] // world_size] * world_size


class _SumReceivedPartials(torch.autograd.Function):
    """Forward: sum the received partials. Backward: send each rank the gradient of its samples."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local_embs: torch.Tensor, partials: torch.Tensor, splits: list[int], pg: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits = splits
        ctx.pg = pg
        return partials.sum(0)  # [world_size, B, D] -> [B, D]

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
    """The all-to-all runs on gloo's thread from construction; ``wait`` sums and wires autograd.

    With a ``flag``, every rank's rows for each rank come after a header row holding its flag.
    """

    def __init__(
        self, local_embs: torch.Tensor, splits: list[int], pg: dist.ProcessGroup, flag: CarriedFlag | None
    ) -> None:
        super().__init__()
        world_size = pg.size()
        header = 0 if flag is None else 1
        mine = splits[pg.rank()] + header
        self._local_embs = local_embs
        self._splits = splits
        self._pg = pg
        self._flag = flag
        send = local_embs.detach()
        send = send.contiguous() if flag is None else with_header_rows(send, splits, flag.outgoing())
        self._received = local_embs.new_empty((world_size * mine, local_embs.shape[1]))
        self._mine = mine
        self._work = dist.all_to_all_single(
            self._received,
            send,
            output_split_sizes=[mine] * world_size,
            input_split_sizes=[n + header for n in splits],
            group=pg,
            async_op=True,
        )
        self._flag_read = False
        if flag is not None:
            flag.expect(self._read_flag)

    def _partials(self) -> torch.Tensor:
        # Explicit width: a rank with no samples has 0 rows, and view(..., 0, -1) is ambiguous.
        return self._received.view(self._pg.size(), self._mine, self._received.shape[1])

    def _read_flag(self) -> None:
        """Wait for the all-to-all and record the flags it brought (once)."""
        if self._flag is None or self._flag_read:
            return
        self._work.wait()
        self._flag.record(self._partials()[:, 0, :1])
        self._flag_read = True

    def _wait_impl(self) -> torch.Tensor:
        self._work.wait()
        partials = self._partials()
        if self._flag is not None:
            self._read_flag()
            partials = partials[:, 1:]
        return _SumReceivedPartials.apply(self._local_embs, partials, self._splits, self._pg)


class AllToAllPooledEmbeddingDist(FlagCarrier, RwPooledEmbeddingDist):
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

    def carries_flag(self) -> bool:
        """Whether :meth:`carry` can hand it a flag (no quantized comms)."""
        return not compat.quantized_comms(self)

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: EmbeddingShardingContext | None = None
    ) -> Awaitable[torch.Tensor]:
        pg = compat.sharding_group(self)
        if compat.quantized_comms(self) or (sharding_ctx is not None and sharding_ctx.variable_batch_per_feature):
            if self._flag is not None:
                self._flag.all_reduce(pg)
            return super().forward(local_embs, sharding_ctx)
        splits = _batch_size_per_rank(local_embs, sharding_ctx, pg.size())
        return _AllToAllPooledAwaitable(local_embs, splits, pg, self._flag)


class _HeaderRowStripped(Awaitable[torch.Tensor]):
    """TorchRec's pooled all-to-all awaitable whose output starts with a header row: records the
    flags in it (one per source rank, at the start of its columns) and returns the rows after it."""

    def __init__(self, inner: Awaitable[torch.Tensor], flag: CarriedFlag, first_columns: list[int]) -> None:
        super().__init__()
        self._inner = inner
        self._flag = flag
        self._first_columns = torch.tensor(first_columns)
        self._out: torch.Tensor | None = None
        flag.expect(self._read_flag)

    def _read_flag(self) -> None:
        """Wait for the all-to-all, record the flags it brought and keep the rows (once)."""
        if self._out is None:
            out = self._inner.wait()
            self._flag.record(out[0].index_select(0, self._first_columns))
            self._out = out[1:]

    def _wait_impl(self) -> torch.Tensor:
        self._read_flag()
        assert self._out is not None
        return self._out


class FlagCarryingTwPooledEmbeddingDist(FlagCarrier, TwPooledEmbeddingDist):
    """TorchRec's table-wise pooled output dist that can carry the host stage's flag.

    Same input and output as TorchRec's ``TwPooledEmbeddingDist`` (``local_embs`` of shape
    ``[sum(batch_size_per_rank), dim_sum_per_rank[rank]]`` -> ``[batch_size_per_rank[rank],
    sum(dim_sum_per_rank)]``); with a flag, TorchRec's all-to-all moves one header row more to
    each rank, and the header is split off the output. It carries one where every rank holds a
    table (each sends every rank some columns), on gloo, without quantized comms or callbacks;
    a variable-batch call exchanges the flag by an all-reduce instead.

    Args:
        as TorchRec's ``TwPooledEmbeddingDist``.
    """

    def carries_flag(self) -> bool:
        """Whether :meth:`carry` can hand it a flag (the same on every rank: from the plan)."""
        return (
            is_gloo(compat.sharding_group(self))
            and all(d > 0 for d in compat.tw_dim_sum_per_rank(self))
            and not compat.quantized_comms(self)
            and not compat.has_output_callbacks(self)
        )

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: EmbeddingShardingContext | None = None
    ) -> Awaitable[torch.Tensor]:
        flag = self._flag
        if flag is None:
            return super().forward(local_embs, sharding_ctx)
        pg = compat.sharding_group(self)
        if sharding_ctx is not None and sharding_ctx.variable_batch_per_feature:
            flag.all_reduce(pg)
            return super().forward(local_embs, sharding_ctx)
        world_size = pg.size()
        batch_size_per_rank = _batch_size_per_rank(local_embs, sharding_ctx, world_size)
        all_to_all = compat.tw_all_to_all(self, sharding_ctx)
        padded = with_header_rows(local_embs, batch_size_per_rank, flag.outgoing())
        inner = all_to_all(padded, batch_size_per_rank=[b + 1 for b in batch_size_per_rank])
        dims = compat.tw_dim_sum_per_rank(self)
        first_columns = [sum(dims[:r]) for r in range(world_size)]
        return _HeaderRowStripped(inner, flag, first_columns)


def is_gloo(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` is a gloo group torch.distributed knows (else TorchRec's dists stay)."""
    try:
        return dist.get_backend(pg) == dist.Backend.GLOO
    except (ValueError, RuntimeError):  # a group torch.distributed does not know: keep TorchRec's dist
        return False
