"""Every use of TorchRec internals in recsdk-pipeline, in one place.

recsdk-pipeline builds on TorchRec's ``TrainPipelineSparseDist``, whose schedule lives in
private helpers and private state. Each use of them is here, with a one-line comment saying
why; the rest of the package uses only the names this module defines (and TorchRec's public
API), so a TorchRec upgrade touches this file only.

* :class:`SparseDistPipelineBase`: ``TrainPipelineSparseDist`` with the private state and
  helpers the hybrid pipeline needs given ``_tr_`` names.
* :class:`InputDists`: one such pipeline's per-batch input dist operations (a batch's context,
  the data-dist stream, start, wait) for given modules, for the parts that run them (the host
  stages and the inline modules).
* :func:`device_groups`: the process groups TorchRec's sharded modules use for device traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist

# Private helpers of TorchRec's pipelines; no public equivalent exists.
from torchrec.distributed.train_pipeline.utils import (
    _override_input_dist_forwards,  # swap in the fused-splits input dist forwards
    _rewrite_model,  # replace the sharded modules' forwards with pipelined ones
    _start_data_dist,  # run the pipelined modules' input_dist for one batch
    _to_device,  # copy a Pipelineable batch to the device
    _wait_for_batch,  # make the current stream wait for a side stream (and record the batch on it)
)

__all__ = ["In", "InputDists", "Out", "SparseDistPipelineBase", "device_groups"]

In = TypeVar("In")  # the batch type (TorchRec's is bound to Pipelineable)
Out = TypeVar("Out")  # the model's output type


def device_groups(model: torch.nn.Module) -> list[Any]:
    """The default group and every TorchRec sharded module's sharding-env group, once each.

    Args:
        model (torch.nn.Module): the sharded model.

    Returns:
        list: the process groups that carry device traffic.

    Example::

        host_staged = all(pg is not g for g in device_groups(dmp_model))
    """
    groups: list[Any] = [dist.group.WORLD]
    for module in model.modules():
        # ShardedModule keeps its ShardingEnv in _env (no public accessor).
        pg = getattr(getattr(module, "_env", None), "process_group", None)
        if isinstance(module, ShardedModule) and pg is not None and all(pg is not g for g in groups):
            groups.append(pg)
    return groups


class SparseDistPipelineBase(TrainPipelineSparseDist[In, Out], Generic[In, Out]):
    """TorchRec's ``TrainPipelineSparseDist``, its private state and helpers named ``_tr_*``.

    Subclasses run their own schedule from these: the model rewrite, the copies and stream
    waits, contexts (a batch's input dists of given modules go through :class:`InputDists`).
    Arguments are TorchRec's.

    Example::

        class MyPipeline(SparseDistPipelineBase[Batch, Any]):
            def progress(self, it):
                batch = self._tr_copy_to_device(next(it))
                context = self._tr_new_context()
                ...
    """

    # ---- state --------------------------------------------------------------------------

    @property
    def _tr_model(self) -> torch.nn.Module:
        return self._model  # the (rewritten) model

    @_tr_model.setter
    def _tr_model(self, model: torch.nn.Module) -> None:
        self._model = model

    @property
    def _tr_optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def _tr_device(self) -> torch.device:
        return self._device

    @property
    def _tr_execute_all_batches(self) -> bool:
        return self._execute_all_batches

    @property
    def _tr_attached(self) -> bool:
        return self._model_attached  # TorchRec's detach() clears it, attach() sets it

    def _tr_mark_attached(self) -> None:
        self._model_attached = True

    @property
    def _tr_pipelined_modules(self) -> list[ShardedModule]:
        return self._pipelined_modules  # filled by the model rewrite

    # ---- contexts -----------------------------------------------------------------------

    def _tr_new_context(self) -> TrainPipelineContext:
        return self._create_context()  # numbers the batch (context.index)

    def _tr_set_module_context(self, context: TrainPipelineContext) -> None:
        self._set_module_context(context)  # the pipelined forwards read the batch's context

    # ---- schedule -----------------------------------------------------------------------

    def _tr_copy_to_device(self, batch: Any) -> Any:
        """The batch on the device, copied on the memcpy stream; counts it (TorchRec's counter)."""
        stream = self._memcpy_stream
        with nullcontext() if stream is None else self._stream_context(stream):
            batch = _to_device(batch, self._device, non_blocking=True)
        self._batch_count += 1
        return batch

    def _tr_wait_for_data_dist(self, batch: Any) -> None:
        _wait_for_batch(batch, self._data_dist_stream)

    def _tr_rewrite(self, batch: Any, context: TrainPipelineContext) -> None:
        """Swap the sharded modules' forwards for pipelined ones (TorchRec's model rewrite)."""
        (
            self._pipelined_modules,
            self._model,
            self._original_forwards,
            self._pipelined_postprocs,
            _,
        ) = _rewrite_model(
            model=self._model,
            context=context,
            dist_stream=self._data_dist_stream,
            default_stream=torch.get_device_module(self._device).current_stream(),
            batch=batch,
            apply_jit=self._apply_jit,
            pipelined_forward=self._pipelined_forward_type,
            pipeline_postproc=False,
        )

    def _tr_override_input_dist_forwards(self) -> None:
        """Swap in TorchRec's fused-splits input dist forwards (the input dists must exist).
        recsdk's ``FusedKJTAllToAll`` keeps its own (it ignores the swap): its splits awaitable
        joins TorchRec's fused splits as any non-meta request does (waited in place)."""
        self._original_kjt_dist_forwards = _override_input_dist_forwards(self._pipelined_modules)

    def _tr_sync_embeddings(self, context: TrainPipelineContext) -> None:
        """TorchRec's embedding sync across replicas (a no-op unless the model is a DMPCollection)."""
        self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, context)


class InputDists:
    """A TorchRec sparse-dist pipeline's per-batch input dist operations, for given modules.

    The hybrid pipeline runs the input dists of its host-staged modules (on the host thread)
    and of its inline modules (on the calling thread) apart; both do it through this object:
    a fresh context for a batch, the data-dist stream, starting the modules' input dists of a
    batch (after its copy) and waiting for their splits. It reads the pipeline's streams and
    context type (fixed once TorchRec's ``__init__`` has run) and calls its
    ``wait_sparse_data_dist``; it holds nothing else.

    Args:
        pipeline (TrainPipelineSparseDist): the pipeline whose streams and context type to use.

    Example::

        dists = InputDists(pipeline)
        context = dists.context(index=4)
        with dists.scope():
            dists.start(modules, batch, context)
            dists.wait(context)  # context.input_dist_tensors_requests now holds each module's
    """

    def __init__(self, pipeline: TrainPipelineSparseDist[Any, Any]) -> None:
        self._pipeline = pipeline

    def context(self, index: int | None) -> TrainPipelineContext:
        """A fresh context for batch ``index`` (version 1: input dist results by batch)."""
        return self._pipeline._context_type(index=index, version=1)

    def scope(self) -> AbstractContextManager[Any]:
        """Run on the data-dist stream (a no-op on CPU)."""
        stream = self._pipeline._data_dist_stream
        return nullcontext() if stream is None else self._pipeline._stream_context(stream)

    def start(self, modules: Sequence[ShardedModule], batch: Any, context: TrainPipelineContext) -> None:
        """Start ``modules``' input dists of ``batch`` (after its copy); call within :meth:`scope`.

        Args:
            modules (Sequence[ShardedModule]): pipelined modules (after the model rewrite).
            batch: the batch, on the device.
            context (TrainPipelineContext): the batch's context; gets each module's context and
                splits requests, by the module's name.
        """
        _wait_for_batch(batch, self._pipeline._memcpy_stream)
        _start_data_dist(list(modules), batch, context)

    def wait(self, context: TrainPipelineContext) -> None:
        """Wait for the splits of the input dists started in ``context`` (TorchRec's
        ``wait_sparse_data_dist``): their tensors requests are in the context afterwards."""
        self._pipeline.wait_sparse_data_dist(context)
