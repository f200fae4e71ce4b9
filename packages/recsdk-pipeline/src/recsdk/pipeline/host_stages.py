"""``HostStages``: the host-thread side of :class:`~recsdk.pipeline.HybridTrainPipelineSparseDist`.

Per batch, what runs on (or for) the pipeline's :class:`~recsdk.pipeline.HostWorker`: the
batch's read agreement and its host stage (the host-staged modules' input dists, then their
``post_input_dist`` id mapping), queued in batch order; the failure agreements that make a
failed read or host stage raise on every rank; and giving back what the modules hold for a
batch that will not compute; and at the first batch, rewriting the model and choosing which
modules are host-staged (the rest keep TorchRec's schedule on the calling thread). A mixin of
the pipeline: it reads the pipeline's own state;
nothing outside the pipeline does. Also the in-flight records both share (``Step``, ``Lane``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext

from recsdk.pipeline._torchrec_compat import device_groups
from recsdk.pipeline.host_staged import HostStagedModule, is_host_staged
from recsdk.sharding import HostShardedModule, refuse_inputs

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from recsdk.pipeline.batch_agreements import BatchAgreements
    from recsdk.pipeline.host_worker import HostWorker

__all__ = ["HostResult", "HostStages", "Lane", "Step"]

logger = logging.getLogger("recsdk.pipeline.train_pipeline")  # its warnings read as the pipeline's

# name -> (module context, input of compute_and_output_dist) for the host-staged modules
HostResult = dict[str, tuple[Any, Any]]


@dataclass
class Step:
    """One batch in flight: read from the iterator, its host stage queued or done.

    For a batch the iterator raised on (here), either ``batch`` is ``None`` and ``read_agreed``
    fails with that exception (the batch is never computed), or, where the failure travels with
    the batch's ids, ``read_error`` is that exception and ``batch`` the last batch read: a
    stand-in whose input dists refuse it (:func:`~recsdk.sharding.refuse_inputs`).
    """

    batch: Any
    context: TrainPipelineContext
    # Done once every rank knows whether its read of this batch succeeded (None: nothing to agree).
    read_agreed: Future[None] | None = None
    host_future: Future[HostResult] | None = None
    inline_started: bool = False
    read_error: Exception | None = None


@dataclass
class Lane:
    """The batches of one mode (train or eval), in order, and the iterator they come from."""

    steps: deque[Step] = field(default_factory=deque)
    iterator: Iterator[Any] | None = None
    exhausted: bool = False
    train_steps_seen: int = 0


class HostStages:
    """Read agreements and host stages of a pipeline's batches (a mixin of the pipeline)."""

    if TYPE_CHECKING:  # the pipeline's state and TorchRec hooks this mixin reads
        _agreements: BatchAgreements | None
        _worker: HostWorker
        _host_thread: bool
        _host_modules: list[ShardedModule]
        _pending: list[Future[Any]]
        _reads_carried: bool
        _read_error: Exception | None
        _last_batch: Any
        _failure: BaseException | None
        _names: dict[int, str]
        _inline_modules: list[ShardedModule]
        _tr_model: torch.nn.Module

        @property
        def _tr_pipelined_modules(self) -> list[ShardedModule]: ...
        def _tr_new_context(self) -> TrainPipelineContext: ...
        def _tr_host_context(self, index: int | None) -> TrainPipelineContext: ...
        def _tr_data_dist_scope(self) -> AbstractContextManager[Any]: ...
        def _tr_start_data_dist(
            self, modules: list[ShardedModule], batch: Any, context: TrainPipelineContext
        ) -> None: ...
        def wait_sparse_data_dist(self, context: TrainPipelineContext) -> None: ...
        def _tr_rewrite(self, batch: Any, context: TrainPipelineContext) -> None: ...
        def _tr_override_input_dist_forwards(self) -> None: ...

    def _read_failed(self, lane: Lane, error: Exception) -> None:
        """The iterator raised instead of yielding the next batch: fail that batch on every rank.

        The batches read before it compute as usual, and the :meth:`progress` that would
        compute it raises ``error`` here and a :class:`~recsdk.sharding.PeerFailureError` on the
        other ranks. Once the model holds recsdk's sharded hash modules, the failure travels
        with the batch: its step's input dists send a stand-in they refuse with ``error`` (the
        last batch read, under :func:`~recsdk.sharding.refuse_inputs`), and its host stage's
        failure agreement raises on every rank (the modules' own in the forward without the
        host thread; the pipeline's on the host thread, :class:`HostStageError` elsewhere).
        Otherwise its place is kept by a batch-less step whose read agreement raises ``error``
        (:class:`HostStageError` on the other ranks).
        """
        self._read_error = error
        context = self._tr_new_context()
        if self._reads_carried and self._last_batch is not None:
            step = Step(batch=self._last_batch, context=context, read_error=error)
            lane.steps.append(step)
            self._submit_host_stage(step, agree_on_read=False)
            return
        if not self._tr_pipelined_modules:
            # Not rewritten yet (the first batch, or no sharded module): no host thread to agree
            # on; agree here, which raises on every rank in this call.
            self._agree_on_read_here(context.index, error)
        step = Step(batch=None, context=context, inline_started=True)
        lane.steps.append(step)
        assert self._agreements is not None
        if self._agreements.reads_need_agreeing:
            step.read_agreed = self._start_read_agreement(context.index, error)
        else:
            step.read_agreed = Future()
            step.read_agreed.set_exception(error)

    def _agree_on_read_here(self, index: int | None, error: Exception | None) -> None:
        """The read agreement on the calling thread (before the model is rewritten); a failure
        stops the pipeline. Afterwards, for a model without hash modules, it runs ahead of each
        batch's host stage, so that no rank issues a collective for a batch another rank does
        not have."""
        assert self._agreements is not None
        try:
            self._agreements.read(index, error)
        except BaseException as e:
            self._failure = e
            raise

    def _settle_read(self, step: Step) -> None:
        """Settle the step's asynchronous read agreement (no host thread) if still pending."""
        if step.read_agreed is not None and not step.read_agreed.done() and not self._host_thread:
            assert self._agreements is not None
            self._agreements.settle_reads()

    def _settle_all_reads(self) -> None:
        """No read agreement left running (before batches are dropped, or at close)."""
        if self._agreements is not None:
            self._agreements.settle_reads()

    def _submit_host_stage(self, step: Step, agree_on_read: bool) -> None:
        """Queue the batch's read agreement (``agree_on_read``, with several ranks) and host stage."""
        index = step.context.index
        assert self._agreements is not None
        if agree_on_read and self._agreements.reads_need_agreeing and not self._reads_carried:
            step.read_agreed = self._start_read_agreement(index, None)
        step.host_future = None
        if self._host_modules:
            step.host_future = self._worker.submit(self._host_stage, step.batch, index, step.read_error)
            self._pending.append(step.host_future)

    def _start_read_agreement(self, index: int | None, error: Exception | None) -> Future[None]:
        """The batch's read agreement: queued on the host thread ahead of its host stage, or
        (no host thread) started here and settled before the batch's first collective."""
        assert self._agreements is not None
        if not self._host_thread:
            return self._agreements.start_read(index, error)
        agreed = self._worker.submit(self._agreements.read, index, error)
        self._pending.append(agreed)
        return agreed

    def _host_stage(self, batch: Any, index: int | None, refused: Exception | None = None) -> HostResult:
        """Input dist of the host-staged modules, then ``post_input_dist``, then the agreement
        (``refused``: the batch is a failed read's stand-in, refused with that error)."""
        result: HostResult = {}
        error: BaseException | None = None
        try:
            context = self._tr_host_context(index)
            with self._tr_data_dist_scope(), refuse_inputs(refused):
                self._tr_start_data_dist(self._host_modules, batch, context)
                self.wait_sparse_data_dist(context)
                result = self._map_ids(context.module_contexts, context.input_dist_tensors_requests)
        except BaseException as e:
            error = e
        self._agree_on_host_stage(index, error, result)
        return result

    def _agree_on_host_stage(self, index: int | None, error: BaseException | None, result: HostResult) -> None:
        """The host stage's agreement; a batch that fails anywhere gives back the rows it holds."""
        assert self._agreements is not None
        try:
            self._agreements.host_stage(index, error)
        except BaseException:
            self._release_result(result)
            raise

    def _map_ids(self, module_contexts: dict[str, Any], requests: dict[str, Any]) -> HostResult:
        """Receive each host-staged module's ids and run its ``post_input_dist``."""
        result: HostResult = {}
        try:
            for module in self._host_modules:
                name = self._name_of(module)
                module_context, kjts = module_contexts[name], requests[name].wait()
                result[name] = (module_context, cast(HostStagedModule, module).post_input_dist(module_context, kjts))
        except BaseException:
            self._release_result(result)  # the modules mapped before the one that failed
            raise
        return result

    def _release_result(self, result: HostResult) -> None:
        """``release_context`` for every module a host stage mapped (its batch will not compute)."""
        for module in self._host_modules:
            entry = result.get(self._name_of(module))
            if entry is not None:
                cast(HostStagedModule, module).release_context(entry[0])

    def _name_of(self, module: ShardedModule) -> str:
        return self._names.get(id(module), type(module).__name__)

    def _bootstrap(self, step: Step) -> None:
        """First batch: rewrite the model and run its whole input dist here, inline."""
        context = step.context
        self._tr_rewrite(step.batch, context)
        with self._tr_data_dist_scope():
            self._tr_start_data_dist(self._tr_pipelined_modules, step.batch, context)
            self.wait_sparse_data_dist(context)
        # The input dists exist now: swap in TorchRec's fused-splits forwards.
        self._tr_override_input_dist_forwards()
        self._classify_modules()
        host_names = [self._name_of(m) for m in self._host_modules]
        module_contexts = {n: context.module_contexts.pop(n) for n in host_names}
        requests = {n: context.input_dist_tensors_requests.pop(n) for n in host_names}
        done: Future[HostResult] = Future()
        try:
            result: HostResult = {}
            error: BaseException | None = None
            try:
                result = self._map_ids(module_contexts, requests)
            except BaseException as e:
                error = e
            assert self._agreements is not None
            self._agree_on_host_stage(context.index, error, result)
            done.set_result(result)
        except BaseException as e:
            done.set_exception(e)
        step.host_future = done if host_names else None
        step.inline_started = True

    def _classify_modules(self) -> None:
        """Host-stage a module iff it is a :class:`HostStagedModule` whose groups carry no device traffic."""
        device_pgs = device_groups(self._tr_model)
        self._host_modules, self._inline_modules = [], []
        host_pgs: list[dist.ProcessGroup] = []
        self._names = {id(m): str(getattr(m.forward, "name", type(m).__name__)) for m in self._tr_pipelined_modules}
        for module in self._tr_pipelined_modules:
            if self._host_thread and is_host_staged(module, device_pgs):
                self._host_modules.append(module)
                for pg in cast(HostStagedModule, module).host_input_groups():
                    if all(pg is not p for p in host_pgs):
                        host_pgs.append(pg)
            else:
                self._inline_modules.append(module)
                if self._host_thread and isinstance(module, HostStagedModule):
                    logger.warning(
                        "%s: its input dist uses a device process group, so its host stage runs inline "
                        "on the calling thread; give its sharder a separate gloo group (host_env) to overlap it",
                        self._name_of(module),
                    )
        assert self._agreements is not None
        if not self._agreements.has_host_groups:
            # Every rank bootstraps at its first progress(), so all create these groups together.
            self._agreements.add_host_groups(host_pgs)
        # A recsdk hash module's input dist can refuse a batch whose read failed, and the failure
        # agreement of its host stage (the module's inline, the pipeline's on the host thread)
        # raise on every rank: no read agreement per batch then.
        self._reads_carried = any(isinstance(m, HostShardedModule) for m in self._tr_pipelined_modules)
