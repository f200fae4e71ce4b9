"""``AsyncCheckpointer``: checkpoints written in the background while training goes on.

A save copies this rank's checkpoint state into host memory on the calling thread (the part
that must see one consistent model: DCP's ``BlockingAsyncStager``), then writes it on a
background thread exactly as :func:`~recsdk.sharding.save_checkpoint` writes (DCP, checksums,
the manifest, one atomic rename), over a gloo group of its own, so that its collectives never
interleave with the training's. Only one write is in flight: the next save (or :meth:`wait`)
waits for it first. A write that fails on any rank fails on every rank (the checkpoint's failure
agreement), and each rank raises it at its next :meth:`save`, :meth:`check` or :meth:`wait`. A
process killed during a write leaves ``path`` absent: the previous checkpoint stays the latest.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torchrec.optim.keyed import KeyedOptimizer

from recsdk.sharding.checkpoint.manifest import CHECKPOINT_MANIFEST
from recsdk.sharding.checkpoint.save import ReadAhead, check_save_arguments, collect, write
from recsdk.sharding.writing.atomic_directory import write_directory
from recsdk.sharding.writing.comm import Comm
from recsdk.sharding.writing.hash_modules import hash_modules

__all__ = ["AsyncCheckpointer"]


class AsyncCheckpointer:
    """Saves checkpoints of ``model`` and ``optimizer`` in the background, one at a time.

    Construct it on every rank at the same point (it creates its gloo group: collective), then
    call :meth:`save` where :func:`~recsdk.sharding.save_checkpoint` would be called. Loading is
    :func:`~recsdk.sharding.load_checkpoint`, as for any checkpoint.

    Args:
        model (nn.Module): the ``DistributedModelParallel`` model.
        optimizer (KeyedOptimizer | None): as for :func:`~recsdk.sharding.save_checkpoint`.
        timeout (datetime.timedelta | None): of the checkpoint's gloo group (default: 30 minutes).

    Example::

        checkpointer = AsyncCheckpointer(model, optimizer)
        for step in ...:
            checkpointer.check()  # a failed background write raises here, on every rank
            pipeline.progress(batches)
            if step % 100 == 0:
                pipeline.drain()
                checkpointer.save(f"ckpt/step_{step}", pipeline=pipeline, extra={...})
        checkpointer.close()  # waits for the last write
    """

    def __init__(
        self, model: nn.Module, optimizer: KeyedOptimizer | None, *, timeout: datetime.timedelta | None = None
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self._model = model
        self._optimizer = optimizer
        self._modules = hash_modules(model)
        distributed = dist.is_available() and dist.is_initialized()
        self._group = (
            dist.new_group(backend="gloo", timeout=timeout or datetime.timedelta(minutes=30)) if distributed else None
        )
        self._stager = BlockingAsyncStager()
        self._pending: Future[str] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.blocked_s = 0.0
        """Seconds the last :meth:`save` kept its caller (waiting for the previous write included)."""

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        extra: dict[str, Any] | None = None,
        pipeline: ReadAhead | None = None,
    ) -> None:
        """Snapshot the checkpoint state now and write it to the new directory ``path`` in the background.

        Collective (every rank, same ``path``). Waits for the previous write first, raising its
        failure. Between training steps, as :func:`~recsdk.sharding.save_checkpoint` (a pipeline
        drained first); the model may train on as soon as it returns.

        Args:
            path (str | os.PathLike): directory to create; must not exist when the write starts.
            extra (dict | None): picklable per-rank state, as for ``save_checkpoint``.
            pipeline (HybridTrainPipelineSparseDist | None): as for ``save_checkpoint``.

        Raises:
            RuntimeError: the checkpointer is closed.
            TypeError, ValueError: as :func:`~recsdk.sharding.save_checkpoint`'s argument checks.
            Exception: the previous write's failure (on every rank).
        """
        started = time.perf_counter()
        if self._closed:
            raise RuntimeError("AsyncCheckpointer is closed")
        check_save_arguments(self._model, self._optimizer, extra, pipeline)
        self.wait()
        final = os.path.abspath(os.fspath(path))
        comm = Comm(self._group, what=f"saving checkpoint {final!r}")
        state, local = collect(self._model, self._optimizer, self._modules, extra, comm)
        staged = comm.run(self._stager.stage, state)  # the snapshot: host copies of every tensor
        future: Future[str] = Future()
        self._thread = threading.Thread(
            target=self._write, args=(staged, local, final, comm, future), name="recsdk-checkpoint", daemon=True
        )
        self._pending = future
        self._thread.start()
        self.blocked_s = time.perf_counter() - started

    def check(self) -> None:
        """Raise the in-flight write's failure if it has failed (returns at once otherwise)."""
        future = self._pending
        if future is not None and future.done():
            error = future.exception()
            if error is not None:
                self._pending = self._thread = None
                raise error

    def wait(self) -> str | None:
        """Wait for the write in flight; its checkpoint's path (None if there was none).

        Raises:
            Exception: the write's failure (on every rank).
        """
        future, thread = self._pending, self._thread
        if future is None:
            return None
        if thread is not None:
            thread.join()
        self._pending = self._thread = None
        return future.result()

    def close(self) -> None:
        """Wait for the write in flight (raising its failure); no save afterwards."""
        if self._closed:
            return
        self._closed = True
        self.wait()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, state: dict[str, Any], local: dict[str, Any], final: str, comm: Comm, future: Future[str]) -> None:
        try:
            write_directory(
                final,
                comm,
                "checkpoint",
                CHECKPOINT_MANIFEST,
                lambda tmp: write(state, local, self._modules, tmp, final, comm),
            )
        except BaseException as e:  # carried to the training thread
            future.set_exception(e)
            return
        future.set_result(final)
