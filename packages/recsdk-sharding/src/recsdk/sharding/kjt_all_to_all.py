"""``FusedKJTAllToAll``: TorchRec's KJT all-to-all, with a batch's tensors in one collective.

TorchRec's ``KJTAllToAll`` exchanges a batch in ``1 + T`` all-to-alls: the splits (how many
lengths, values and weights each rank sends each rank, and the batch sizes), then one per
tensor (lengths, values, and weights if any). Over a gloo host group every collective is a round
of messages and thread wake-ups on every rank, on every step; this one sends the ``T`` tensors
in a single all-to-all of int64 words (each rank's lengths, values and weights one after the
other), so a batch's ids cross in two collectives instead of three or four. The received KJT is
the one TorchRec's would build (same keys, recat, strides and dtypes).

Each rank also sends every rank one word more: its **batch flag**, whether its own batch was
bad (the sender replaced it by a stand-in). Within :func:`batch_flag`, a call sends the given
flag and, once the ids arrive, reports whether any rank sent one set; outside, it sends none set.
The flag is the batch's own (it travels in that batch's exchange), so a rank knows before it
maps a batch's ids whether a peer's batch failed, also under a pipeline that runs one batch's
exchange before the previous batch's compute.

A variable batch per feature (VBE) and a group of one keep TorchRec's path (no flag).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import (
    KJTAllToAll,
    KJTAllToAllSplitsAwaitable,
    KJTAllToAllTensorsAwaitable,
    _get_recat,
)
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["FusedKJTAllToAll", "batch_flag"]

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


class _BatchFlag:
    """The flag a call sends and where it reports what arrived."""

    __slots__ = ("failed", "received")

    def __init__(self, failed: bool, received: Callable[[bool], None]) -> None:
        self.failed = failed
        self.received = received


_CURRENT = threading.local()  # .flag: the _BatchFlag of the calls made in this thread now


@contextlib.contextmanager
def batch_flag(failed: bool, received: Callable[[bool], None]) -> Iterator[None]:
    """Within: each :class:`FusedKJTAllToAll` call sends ``failed`` to every rank with its ids and,
    when its ids are waited for, calls ``received(any_rank_failed)``.

    Per thread (a pipeline's host thread exchanges ids too). Every rank makes the same calls,
    inside or outside alike; a call outside sends ``False`` and reports nothing.

    Args:
        failed (bool): this rank's batch is a stand-in for a bad one.
        received (Callable[[bool], None]): told whether any rank's batch (this one's too) failed.

    Example::

        with batch_flag(ctx.input_error is not None, lambda failed: setattr(ctx, "peer_failed", failed)):
            awaitable = a2a(kjt)
    """
    previous = getattr(_CURRENT, "flag", None)
    _CURRENT.flag = _BatchFlag(failed, received)
    try:
        yield
    finally:
        _CURRENT.flag = previous


def _to_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as int64 words: integers by value, floats by their bits (no copy for int64)."""
    if tensor.dtype.is_floating_point:
        tensor = tensor.view(_BITS[tensor.dtype.itemsize])
    return tensor.to(torch.int64)


def _from_words(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_to_words`."""
    if dtype.is_floating_point:
        return words.to(_BITS[dtype.itemsize]).view(dtype)
    return words.to(dtype)


class FusedKJTAllToAll(KJTAllToAll):
    """``KJTAllToAll`` whose lengths, values and weights travel in one all-to-all.

    Same arguments, input and output as TorchRec's (the splits all-to-all first, then the
    tensors); TorchRec's pipelines find it where they look for a ``KJTAllToAll``. Every rank must
    send the same dtypes (each rank decodes the words by its own; TorchRec's per-tensor
    all-to-alls fail on a mismatch too): recsdk's input guard sends int64 ids and float32 weights.

    Args:
        pg (dist.ProcessGroup): the group of the all-to-alls.
        splits (list[int]): features sent to each rank (the input KJT is ordered by rank).
        stagger (int): as TorchRec's ``KJTAllToAll``.

    Example::

        a2a = FusedKJTAllToAll(host_pg, splits=[2, 1])
        kjt = a2a(bucketed).wait().wait()  # this rank's features, every rank's samples
    """

    def forward(self, input: KeyedJaggedTensor) -> Awaitable[KJTAllToAllTensorsAwaitable]:
        if input.variable_stride_per_key() or self._pg.size() == 1:
            return super().forward(input)
        with torch.no_grad():
            rank = dist.get_rank(self._pg)
            splits = _FusedSplitsAwaitable(
                pg=self._pg,
                input=input,
                splits=self._splits,
                labels=input.dist_labels(),
                tensor_splits=input.dist_splits(self._splits),
                input_tensors=input.dist_tensors(),
                keys=input.keys()[self._splits_cumsum[rank] : self._splits_cumsum[rank + 1]],
                device=input.device(),
                stagger=self._stagger,
            )
            splits.batch_flag = getattr(_CURRENT, "flag", None)
            return splits


class _FusedSplitsAwaitable(KJTAllToAllSplitsAwaitable):
    """TorchRec's splits all-to-all (its constructor issues it); waiting issues the fused one.

    ``batch_flag``: the :func:`batch_flag` of the call that made it (``None``: outside one).
    """

    batch_flag: _BatchFlag | None = None

    def _wait_impl(self) -> KJTAllToAllTensorsAwaitable:
        received = self._splits_awaitable.wait()  # per tensor the sizes from each rank, then the strides
        return _FusedTensorsAwaitable(
            self._pg,
            self._input,
            batch_flag=self.batch_flag,
            labels=self._labels,
            input_tensors=self._input_tensors,
            input_splits=self._input_splits,
            output_splits=received[:-1],
            stride_per_rank=received[-1],
            keys=self._keys,
            recat=_get_recat(
                local_split=self._splits[self._pg.rank()],
                num_splits=len(self._splits),
                stagger=self._stagger,
                device=self._device,
                batch_size_per_rank=received[-1],
            ),
            stagger=self._stagger,
        )


class _FusedTensorsAwaitable(KJTAllToAllTensorsAwaitable):
    """One all-to-all of every tensor's words; the wait splits them back per tensor and rank.

    A ``KJTAllToAllTensorsAwaitable`` to TorchRec: its shardings read the splits, recat and
    batch sizes of the exchange from these attributes (``_input_splits``, ``_output_splits``,
    ``_recat``, ``_stride_per_rank``; the unpooled output dists and unequal batch sizes need
    them), and its pipelines may call :meth:`clear_inputs`. TorchRec's constructor, which issues
    one all-to-all per tensor, is not run.

    Args:
        batch_flag (_BatchFlag | None): the flag to send (none set if ``None``) and whom to tell.
        input_splits, output_splits (list[list[int]]): per tensor (``labels``), the sizes sent to
            / received from each rank.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        input: KeyedJaggedTensor,
        *,
        batch_flag: _BatchFlag | None,
        labels: list[str],
        input_tensors: list[torch.Tensor],
        input_splits: list[list[int]],
        output_splits: list[list[int]],
        stride_per_rank: list[int],
        keys: list[str],
        recat: torch.Tensor | None,
        stagger: int,
    ) -> None:
        Awaitable.__init__(self)
        world = pg.size()
        self._workers = self._world_size = world
        self._pg = pg
        self._input = input
        self._keys = keys
        self._recat = recat
        self._stagger = stagger
        self._stride_per_rank = stride_per_rank
        self._input_splits = dict(zip(labels, input_splits, strict=True))
        self._output_splits = dict(zip(labels, output_splits, strict=True))
        self._input_tensors = input_tensors
        self._dtypes = [t.dtype for t in input_tensors]
        self._batch_flag = batch_flag
        chunks = [_to_words(t).split(sizes) for t, sizes in zip(input_tensors, input_splits, strict=True)]
        device = input_tensors[0].device
        flag = torch.tensor([int(batch_flag is not None and batch_flag.failed)], dtype=torch.int64, device=device)
        # Per rank: its share of each tensor, then this rank's batch flag (one word).
        self._send = torch.cat([part for r in range(world) for part in (*(c[r] for c in chunks), flag)])
        self._received_sizes = [n for s in range(world) for n in (*(sizes[s] for sizes in output_splits), 1)]
        self._received = torch.empty(sum(self._received_sizes), dtype=torch.int64, device=self._send.device)
        self._work = dist.all_to_all_single(
            self._received,
            self._send,
            output_split_sizes=[sum(sizes[s] for sizes in output_splits) + 1 for s in range(world)],
            input_split_sizes=[sum(sizes[r] for sizes in input_splits) + 1 for r in range(world)],
            group=pg,
            async_op=True,
        )

    def clear_inputs(self) -> int:
        """Free the sent tensors once the all-to-all is done (TorchRec's pipelines); their bytes."""
        self._work.wait()
        size = 0
        for tensor in [*self._input_tensors, self._send]:
            size += tensor.element_size() * tensor.numel()
            tensor.untyped_storage().resize_(0)
        self._input_tensors = []
        return size

    def _wait_impl(self) -> KeyedJaggedTensor:
        self._work.wait()
        parts = self._received.split(self._received_sizes)  # [rank][tensor, then the flag]
        num = len(self._dtypes) + 1
        tensors = [
            _from_words(torch.cat([parts[s * num + t] for s in range(self._workers)]), dtype)
            for t, dtype in enumerate(self._dtypes)
        ]
        if self._batch_flag is not None:
            flags = torch.cat([parts[s * num + num - 1] for s in range(self._workers)])
            self._batch_flag.received(bool(flags.any()))
        return type(self._input).dist_init(
            keys=self._keys,
            tensors=tensors,
            variable_stride_per_key=False,
            num_workers=self._workers,
            recat=self._recat,
            stride_per_rank=self._stride_per_rank,
            stagger=self._stagger,
        )
