"""``FusedKJTAllToAll``: TorchRec's KJT all-to-all, with a batch's splits and tensors in one collective.

TorchRec's ``KJTAllToAll`` exchanges a batch in ``1 + T`` all-to-alls: the splits (how many
lengths, values and weights each rank sends each rank, and the batch sizes), then one per
tensor (lengths, values, and weights if any). Over a gloo host group every collective is a round
of messages and thread wake-ups on every rank, on every step. This one sends each rank one block
of int64 words whose size every rank knows beforehand (:class:`_PayloadCapacity`): a header
with what the splits round would carry, then the lengths, values and weights one after the
other, padded. So in the steady state a batch's ids cross in one collective; a batch larger
than the capacity sends the rest in a second one. The received KJT is the one TorchRec's would
build (same keys, recat, strides and dtypes).

Each header also carries the sender's **batch flag**: whether its own batch was bad (the sender
replaced it by a stand-in). Within :func:`batch_flag`, a call sends the given flag and, once the
headers arrive (the splits awaitable's wait), reports whether any rank sent one set; outside, it
sends none set. The flag is the
batch's own (it travels in that batch's exchange), so a rank knows before it maps a batch's ids
whether a peer's batch failed, also under a pipeline that runs one batch's exchange before the
previous batch's compute.

Duty of the callers: every rank makes the same calls of a ``FusedKJTAllToAll`` in the same
order (as for any collective). A call reads the previous call's headers before it sends (each
exchange's capacity comes from the ones before it), so the ranks agree on every block's size
whatever order the awaitables are waited in.

A variable batch per feature (VBE) and a group of one keep TorchRec's path (no flag).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import (
    KJTAllToAll,
    KJTAllToAllSplitsAwaitable,
    KJTAllToAllTensorsAwaitable,
)
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.sharding import _torchrec_compat as compat

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
    when its splits are waited for (the headers), calls ``received(any_rank_failed)``.

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


class _OwnForward:
    """``FusedKJTAllToAll.forward``, kept in place: assigning or deleting an instance's ``forward``
    does nothing.

    TorchRec's pipelines do that to every ``KJTAllToAll`` of a pipelined module
    (``_override_input_dist_forwards`` swaps in their fused-splits forward, which would send one
    all-to-all per tensor and no batch flag; ``detach`` puts the original back). As a data
    descriptor on the class, this forward wins over an instance attribute, so under TorchRec's
    pipelines too a batch's ids cross in one collective with their batch flag; the pipelines'
    fused splits wait its splits awaitable in place, as any request that is not theirs.
    """

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., Any]:
        return self._function if obj is None else types.MethodType(self._function, obj)

    def __set__(self, obj: object, value: object) -> None:
        pass

    def __delete__(self, obj: object) -> None:
        pass


class FusedKJTAllToAll(KJTAllToAll):
    """``KJTAllToAll`` whose splits, lengths, values and weights travel in one all-to-all.

    Same arguments, input and output as TorchRec's; TorchRec's pipelines find it where they
    look for a ``KJTAllToAll``, and keep its exchange (its ``forward`` cannot be swapped out per
    instance, see ``_OwnForward``). Each rank sends every rank one block of int64 words of a size
    all ranks know beforehand: a header (the sizes of its share of each tensor, its batch size,
    its batch flag, and the largest share it sends any rank), then its share of the lengths,
    values and weights, padded to the block's payload capacity. The capacity follows the
    exchanges (see :class:`_PayloadCapacity`), so in the steady state a batch's ids cross in
    one collective; a batch whose largest share exceeds it sends the rest in a second one
    (every rank reads from the headers that it is due), and the first exchange, with no
    capacity yet, is header-only: a splits round, then the tensors, as TorchRec's.

    Every rank must send the same dtypes (each rank decodes the words by its own; TorchRec's
    per-tensor all-to-alls fail on a mismatch too): recsdk's input guard sends int64 ids and
    float32 weights.

    Args:
        pg (dist.ProcessGroup): the group of the all-to-alls.
        splits (list[int]): features sent to each rank (the input KJT is ordered by rank).
        stagger (int): as TorchRec's ``KJTAllToAll``.

    Example::

        a2a = FusedKJTAllToAll(host_pg, splits=[2, 1])
        kjt = a2a(bucketed).wait().wait()  # this rank's features, every rank's samples
    """

    def __init__(self, pg: dist.ProcessGroup, splits: list[int], stagger: int = 1) -> None:
        super().__init__(pg, splits, stagger)
        self._layout = compat.kjt_all_to_all_layout(self)
        self._capacity = _PayloadCapacity()
        self._last: _Exchange | None = None

    def _exchange(self, input: KeyedJaggedTensor) -> Awaitable[KJTAllToAllTensorsAwaitable]:
        layout = self._layout
        if input.variable_stride_per_key() or layout.pg.size() == 1:
            return KJTAllToAll.forward(self, input)
        with torch.no_grad():
            if self._last is not None:
                # The previous exchange's headers set this one's capacity, on every rank alike
                # (its overflow round, if due, goes first).
                self._last.read_header()
            rank = dist.get_rank(layout.pg)
            exchange = _Exchange(
                layout.pg,
                input_tensors=input.dist_tensors(),
                input_splits=input.dist_splits(layout.splits),
                stride=input.stride(),
                batch_flag=getattr(_CURRENT, "flag", None),
                capacity=self._capacity,
            )
            self._last = exchange
            receiver = _Receiver(
                input=input,
                labels=input.dist_labels(),
                keys=input.keys()[layout.splits_cumsum[rank] : layout.splits_cumsum[rank + 1]],
                splits=layout.splits,
                stagger=layout.stagger,
            )
            return _FusedSplitsAwaitable(exchange, receiver)

    forward = _OwnForward(_exchange)


class _PayloadCapacity:
    """Payload words per block of a :class:`FusedKJTAllToAll`'s exchanges, the same on every rank.

    Each exchange reports the largest share any rank sent any rank (every rank reads the same
    number off the headers it received); the next exchange's capacity is the largest report of
    the last ``window`` exchanges plus an eighth, rounded up to 64 words. Before the first
    report it is 0 (header-only blocks).
    """

    def __init__(self, window: int = 16) -> None:
        self.words = 0
        self._reports: deque[int] = deque(maxlen=window)

    def report(self, largest_share: int) -> None:
        self._reports.append(largest_share)
        words = max(self._reports)
        self.words = -(-(words + words // 8) // 64) * 64


_HEADER_TAIL = 3  # header words after the per-tensor sizes: batch size, batch flag, largest share


class _Exchange:
    """One batch's padded all-to-all (issued at construction), its headers, and its overflow round.

    Args:
        input_tensors (list[torch.Tensor]): the KJT's ``dist_tensors()`` (lengths, values, weights).
        input_splits (list[list[int]]): per tensor, its elements for each rank.
        stride (int): this rank's batch size.
        batch_flag (_BatchFlag | None): the flag to send (none set if ``None``) and whom to tell.
        capacity (_PayloadCapacity): the owner's capacity: read now, told the largest share
            once the headers are read.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        *,
        input_tensors: list[torch.Tensor],
        input_splits: list[list[int]],
        stride: int,
        batch_flag: _BatchFlag | None,
        capacity: _PayloadCapacity,
    ) -> None:
        world = pg.size()
        self._pg = pg
        self._capacity = capacity
        self.words = capacity.words
        self.input_tensors = input_tensors
        self.input_splits = input_splits
        self.dtypes = [t.dtype for t in input_tensors]
        self.batch_flag = batch_flag
        self._lock = threading.Lock()
        self._header_read = False
        self._overflow: tuple[Any, torch.Tensor, list[int]] | None = None
        num = len(input_tensors)
        self._head = num + _HEADER_TAIL
        self._shares = [sum(sizes[r] for sizes in input_splits) for r in range(world)]
        # Per tensor, its part for each rank (views).
        self._chunks = [_to_words(t).split(sizes) for t, sizes in zip(input_tensors, input_splits, strict=True)]
        failed = int(batch_flag is not None and batch_flag.failed)
        largest = max(self._shares)
        header = torch.tensor(
            [[*(sizes[r] for sizes in input_splits), stride, failed, largest] for r in range(world)],
            dtype=torch.int64,
        )
        # One copy into the send buffer: per rank its header, the first `words` of its share
        # (each tensor's part in tensor order), zeros up to the block's size.
        zeros = torch.zeros(self.words, dtype=torch.int64)
        pieces: list[torch.Tensor] = []
        for r in range(world):
            pieces.append(header[r])
            room = self.words
            for chunk in self._chunks:
                part = chunk[r]
                if room == 0 or part.numel() == 0:
                    continue
                taken = part if part.numel() <= room else part[:room]
                pieces.append(taken)
                room -= taken.numel()
            pieces.append(zeros[:room])
        self._send = torch.cat(pieces)
        self._received = torch.empty(world, self._head + self.words, dtype=torch.int64)
        self._work = dist.all_to_all_single(self._received, self._send, group=pg, async_op=True)

    def read_header(self) -> None:
        """Wait for the blocks and read their headers (once): the splits, batch sizes and flags;
        report the largest share to the capacity and issue the overflow round if it is due."""
        with self._lock:
            if self._header_read:
                return
            self._work.wait()
            world, num = self._pg.size(), len(self.dtypes)
            header = self._received[:, : self._head].tolist()
            self.output_splits = [[header[s][t] for s in range(world)] for t in range(num)]
            self.stride_per_rank = [header[s][num] for s in range(world)]
            self.any_failed = any(header[s][num + 1] for s in range(world))
            largest = max(header[s][num + 2] for s in range(world))
            self.received_shares = [sum(sizes[s] for sizes in self.output_splits) for s in range(world)]
            self._capacity.report(largest)
            if largest > self.words:  # some rank sent some rank more than a block holds: every rank joins
                words = self.words
                sent = [max(0, share - words) for share in self._shares]
                got = [max(0, share - words) for share in self.received_shares]
                # Each rank's share past the block's words, rank after rank.
                send = torch.cat([torch.cat([c[r] for c in self._chunks])[words:] for r in range(world)])
                received = torch.empty(sum(got), dtype=torch.int64)
                work = dist.all_to_all_single(
                    received, send, output_split_sizes=got, input_split_sizes=sent, group=self._pg, async_op=True
                )
                self._overflow = (work, received, got)
            self._header_read = True

    def tensors(self) -> list[torch.Tensor]:
        """The received lengths, values and weights (every rank's part, in rank order)."""
        self.read_header()
        world, num = self._pg.size(), len(self.dtypes)
        rest: list[torch.Tensor] | None = None
        if self._overflow is not None:
            work, received, got = self._overflow
            work.wait()
            rest = list(received.split(got))
        parts: list[list[torch.Tensor]] = [[] for _ in range(num)]
        for s in range(world):
            share = self.received_shares[s]
            block = self._received[s, self._head : self._head + min(share, self.words)]
            if rest is not None and share > self.words:
                block = torch.cat([block, rest[s]])
            for t, part in enumerate(block.split([self.output_splits[t][s] for t in range(num)])):
                parts[t].append(part)
        return [_from_words(torch.cat(p), dtype) for p, dtype in zip(parts, self.dtypes, strict=True)]

    def clear_inputs(self) -> int:
        """Free the sent tensors once the all-to-alls are done; their bytes."""
        self.read_header()
        if self._overflow is not None:
            self._overflow[0].wait()
        size = 0
        for tensor in [*self.input_tensors, self._send]:
            size += tensor.element_size() * tensor.numel()
            tensor.untyped_storage().resize_(0)
        self.input_tensors = []
        return size


@dataclass(frozen=True)
class _Receiver:
    """What a rank needs to build the received KJT of an exchange, besides the exchange.

    Attributes:
        input: the KJT this rank sent (its type and device).
        labels: its tensors' names (``dist_labels()``: lengths, values, weights).
        keys: the features this rank receives.
        splits, stagger: as the ``FusedKJTAllToAll``'s.
    """

    input: KeyedJaggedTensor
    labels: list[str]
    keys: list[str]
    splits: list[int]
    stagger: int


class _FusedSplitsAwaitable(KJTAllToAllSplitsAwaitable):
    """Waits for an exchange's headers (TorchRec's splits); gives the awaitable of its tensors."""

    def __init__(self, exchange: _Exchange, receiver: _Receiver) -> None:
        Awaitable.__init__(self)
        self._exchange = exchange
        self._receiver = receiver
        compat.init_kjt_splits_awaitable(self, pg=exchange._pg, input=receiver.input)

    def _wait_impl(self) -> KJTAllToAllTensorsAwaitable:
        exchange, receiver = self._exchange, self._receiver
        exchange.read_header()
        if exchange.batch_flag is not None:
            exchange.batch_flag.received(exchange.any_failed)
        recat = compat.output_recat(
            local_split=receiver.splits[exchange._pg.rank()],
            num_splits=len(receiver.splits),
            stagger=receiver.stagger,
            device=receiver.input.device(),
            batch_size_per_rank=exchange.stride_per_rank,
        )
        return _FusedTensorsAwaitable(exchange, receiver, recat)


class _FusedTensorsAwaitable(KJTAllToAllTensorsAwaitable):
    """The received KJT of an exchange whose headers are read.

    A ``KJTAllToAllTensorsAwaitable`` to TorchRec: its shardings read the splits, recat and
    batch sizes of the exchange off it (given by ``compat.init_kjt_tensors_awaitable``), and its
    pipelines may call :meth:`clear_inputs`. TorchRec's constructor, which issues one all-to-all
    per tensor, is not run.
    """

    def __init__(self, exchange: _Exchange, receiver: _Receiver, recat: torch.Tensor | None) -> None:
        Awaitable.__init__(self)
        self._exchange = exchange
        self._receiver = receiver
        self._output_recat = recat
        compat.init_kjt_tensors_awaitable(
            self,
            pg=exchange._pg,
            input=receiver.input,
            keys=receiver.keys,
            recat=recat,
            stagger=receiver.stagger,
            stride_per_rank=exchange.stride_per_rank,
            input_splits=dict(zip(receiver.labels, exchange.input_splits, strict=True)),
            output_splits=dict(zip(receiver.labels, exchange.output_splits, strict=True)),
        )

    def clear_inputs(self) -> int:
        """Free the sent tensors once the all-to-all is done (TorchRec's pipelines); their bytes."""
        return self._exchange.clear_inputs()

    def _wait_impl(self) -> KeyedJaggedTensor:
        exchange, receiver = self._exchange, self._receiver
        tensors = exchange.tensors()
        return type(receiver.input).dist_init(
            keys=receiver.keys,
            tensors=tensors,
            variable_stride_per_key=False,
            num_workers=exchange._pg.size(),
            recat=self._output_recat,
            stride_per_rank=exchange.stride_per_rank,
            stagger=receiver.stagger,
        )
