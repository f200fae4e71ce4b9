"""``HostStages``: the host side of :class:`~recsdk.pipeline.HybridTrainPipelineSparseDist`.

Per batch, what runs on (or for) the pipeline's host thread: the batch's read agreement and its
host stage (the host-staged modules' input dists, then their ``post_input_dist`` id mapping),
queued in batch order; the failure agreements that make a failed read or host stage raise on
every rank; and giving back what the modules hold for a batch that will not compute. One
object owns all of it (the worker, the agreements, the stages still pending, whether failed
reads are carried, the read error); the pipeline calls it and keeps its own failure.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, cast

import torch
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.types import NoWait

from recsdk.pipeline._torchrec_compat import InputDists
from recsdk.pipeline.batch_agreements import BatchAgreements
from recsdk.pipeline.host_staged import HostStagedModule, ModulePlan
from recsdk.pipeline.host_worker import HostWorker
from recsdk.pipeline.in_flight import HostResult, Step
from recsdk.sharding import refuse_inputs

__all__ = ["HOST_THREAD_NAME", "HostStages"]

HOST_THREAD_NAME = "recsdk-host-stage"


def _select_device(device: torch.device) -> None:
    """Make ``device`` current on the calling thread (the host thread's setup)."""
    if device.type not in ("cpu", "meta"):
        module = torch.get_device_module(device)
        if hasattr(module, "set_device") and device.index is not None:
            module.set_device(device)


class HostStages:
    """The read agreements and host stages of one pipeline's batches, and what they hold.

    The pipeline calls, in this order:

    * :meth:`open` at every ``progress()`` before it reads (the first creates the agreements'
      gloo groups: a collective, every rank at its first call);
    * per batch read, :meth:`read` (before the model is rewritten, the first batch's read is
      agreed here; afterwards its read agreement and host stage are queued), or
      :meth:`read_failed` where the iterator raised; :attr:`stopped` says when to read no more;
    * at the first batch, once the model is rewritten: :meth:`adopt` (the host-staged modules)
      and :meth:`map_first` (their share of that batch's input dist, mapped here);
    * per batch computed, :meth:`settle_read` before its first collective, then :meth:`collect`
      (its host stage's result into its context; raises what failed), and afterwards
      :meth:`release_finished_pins`;
    * :meth:`remap` for an eval batch mapped before training changed the tables, :meth:`drop`
      for batches that will not compute, :meth:`quiesce` before every ``progress()`` returns,
      :meth:`close` at the end.

    It raises what failed; recording the pipeline's failure is the pipeline's.

    Args:
        input_dists (InputDists): the pipeline's per-batch input dist operations.
        device (torch.device): made current on the host thread.
        host_thread (bool): run the host stages on the host thread; if ``False`` every module
            is inline (:meth:`adopt` gets a plan without host modules) and a read agreement
            runs asynchronously on the calling thread.

    Example::

        host = HostStages(InputDists(pipeline), device, host_thread=True)
        host.open()
        host.read(step, rewritten=True)  # queued on the host thread
        host.settle_read(step)
        host.collect(step)  # step.context now holds the host-staged modules' inputs
        host.quiesce()
        host.close()
    """

    def __init__(self, input_dists: InputDists, device: torch.device, host_thread: bool) -> None:
        self._input_dists = input_dists
        self._host_thread = host_thread
        # The setup references the device only: the thread must not keep the pipeline alive.
        self._worker = HostWorker(HOST_THREAD_NAME, setup=functools.partial(_select_device, device))
        # The per-batch failure agreements (their gloo groups are created by open()).
        self._agreements: BatchAgreements | None = None
        self._plan = ModulePlan()
        self._pending: list[Future[Any]] = []
        # A failed read travels with the batch's ids (no read agreement): set with the modules.
        self._reads_carried = False
        self._read_error: Exception | None = None  # the data iterator raised (this rank)
        self._last_batch: Any = None  # the last batch read (a failed read's stand-in)

    # ---- state the pipeline reads -------------------------------------------------------

    @property
    def host_thread(self) -> bool:
        """Whether host stages run on the host thread."""
        return self._host_thread

    @property
    def module_names(self) -> list[str]:
        """Names of the host-staged modules (empty until :meth:`adopt`)."""
        return [self._plan.name_of(m) for m in self._plan.host]

    @property
    def closed(self) -> bool:
        return self._worker.closed

    @property
    def stopped(self) -> bool:
        """A read or a host stage failed here: no batch read after it would ever compute."""
        return self._read_error is not None or self._worker.failure is not None

    # ---- lifecycle ----------------------------------------------------------------------

    def open(self) -> None:
        """Create the agreements if not yet (collective the first time: every rank's first read)."""
        if self._agreements is None:
            self._agreements = BatchAgreements()

    def adopt(self, plan: ModulePlan) -> None:
        """Host-stage ``plan.host`` from now on (after the model rewrite; again after ``attach``).

        The first call creates the host-stage agreements' groups (collective: every rank
        bootstraps at its first ``progress()``). Call after :meth:`open`.
        """
        agreements = self._opened()
        self._plan = plan
        if not agreements.has_host_groups:
            agreements.add_host_groups(plan.host_groups)
        self._reads_carried = plan.reads_carried

    def quiesce(self) -> None:
        """Wait until the host thread is idle (every ``progress()`` ends with it)."""
        pending, self._pending = self._pending, []
        if pending:
            wait_futures(pending)

    def close(self) -> None:
        """Stop the host thread (after :meth:`drop` of the batches in flight)."""
        self._worker.close()

    # ---- reads --------------------------------------------------------------------------

    def read(self, step: Step, rewritten: bool) -> None:
        """A batch was read: keep it as a later failed read's stand-in, and agree on its read.

        Args:
            step (Step): the batch's new step.
            rewritten (bool): whether the model is rewritten. If not (its first batch), the read
                is agreed here, on every rank (raises if any rank's failed) and the pipeline
                bootstraps next; else the read agreement (where reads are not carried) and the
                host stage are queued.
        """
        self._last_batch = step.batch
        if not rewritten:
            self._agree_on_read_here(step.context.index, None)
        else:
            self._submit(step, agree_on_read=True)

    def read_failed(self, error: Exception, context: TrainPipelineContext, rewritten: bool) -> Step:
        """The iterator raised instead of yielding the next batch: the step that fails it on every rank.

        The batches read before it compute as usual, and the ``progress()`` that would
        compute it raises ``error`` here and a :class:`~recsdk.sharding.PeerFailureError` on the
        other ranks. Once the model holds recsdk's sharded hash modules, the failure travels
        with the batch: its step's input dists send a stand-in they refuse with ``error`` (the
        last batch read, under :func:`~recsdk.sharding.refuse_inputs`), and its host stage's
        failure agreement raises on every rank (the modules' own in the forward without the
        host thread; the pipeline's on the host thread, :class:`HostStageError` elsewhere).
        Otherwise its place is kept by a batch-less step whose read agreement raises ``error``
        (:class:`HostStageError` on the other ranks). Nothing is read after it (:attr:`stopped`).

        Args:
            error (Exception): what the iterator (or the copy to the device) raised.
            context (TrainPipelineContext): the failed batch's new context.
            rewritten (bool): whether the model is rewritten; if not, the read is agreed here
                and this raises on every rank.

        Returns:
            Step: the failed batch's step, to queue in its lane.
        """
        self._read_error = error
        if self._reads_carried and self._last_batch is not None:
            step = Step(batch=self._last_batch, context=context, read_error=error)
            self._submit(step, agree_on_read=False)
            return step
        if not rewritten:
            # Not rewritten yet (the first batch, or no sharded module): no host thread to agree
            # on; agree here, which raises on every rank in this call.
            self._agree_on_read_here(context.index, error)
        step = Step(batch=None, context=context, inline_started=True)
        agreements = self._opened()
        if agreements.reads_need_agreeing:
            step.read_agreed = self._start_read_agreement(context.index, error)
        else:
            step.read_agreed = Future()
            step.read_agreed.set_exception(error)
        return step

    def settle_read(self, step: Step) -> None:
        """Settle the step's asynchronous read agreement (no host thread) if still pending.

        Before the batch's first collective, also for a batch this rank could not read (it
        issues none): its peers may be in that agreement's message exchange.
        """
        if step.read_agreed is not None and not step.read_agreed.done() and not self._host_thread:
            self._opened().settle_reads()

    # ---- host stages --------------------------------------------------------------------

    def map_first(self, step: Step) -> None:
        """The first batch: map the host-staged modules' share of its input dist here.

        The pipeline has run every pipelined module's input dist of the batch on the calling
        thread (the model rewrite needs it) and :meth:`adopt` ed the plan; the host-staged
        modules' contexts and requests move from the batch's context into its host result,
        agreed on as any host stage.
        """
        context = step.context
        host_names = self.module_names
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
            self._agree_on_host_stage(context.index, error, result)
            done.set_result(result)
        except BaseException as e:
            done.set_exception(e)
        step.host_future = done if host_names else None

    def remap(self, step: Step) -> None:
        """Map an eval batch again (training changed the id tables since): give back what its
        host stage holds and queue it anew, without a read agreement."""
        if step.host_future is not None:
            self._release(step.host_future)
            self._submit(step, agree_on_read=False)

    def collect(self, step: Step) -> None:
        """Wait for the step's read agreement, then its host stage; put the result in its context.

        Raises:
            BaseException: the read's or the host stage's failure (this rank's own exception,
                or :class:`HostStageError` for another rank's).
        """
        self.settle_read(step)
        agreed, step.read_agreed = step.read_agreed, None
        future, step.host_future = step.host_future, None
        if agreed is not None:
            agreed.result()  # first: a failed read skips the host stage after it
        if future is None:
            return
        for name, (module_context, kjts) in future.result().items():
            step.context.module_contexts[name] = module_context
            step.context.input_dist_tensors_requests[name] = NoWait(kjts)

    def release_finished_pins(self) -> None:
        """The previous batch's backward is done: each host-staged module may evict its rows."""
        for module in self._plan.host:
            cast(HostStagedModule, module).release_finished_pins()

    def drop(self, steps: Iterable[Step]) -> None:
        """``steps`` will not compute: settle the read agreements, give back what their host
        stages hold (call after :meth:`quiesce`)."""
        if self._agreements is not None:
            self._agreements.settle_reads()
        for step in steps:
            self._release(step.host_future)

    # ---- on the host thread (or for it) -------------------------------------------------

    def _opened(self) -> BatchAgreements:
        if self._agreements is None:
            raise RuntimeError("HostStages.open() must run before the first read")
        return self._agreements

    def _agree_on_read_here(self, index: int | None, error: Exception | None) -> None:
        """The read agreement on the calling thread (before the model is rewritten). Afterwards,
        for a model without hash modules, it runs ahead of each batch's host stage, so that no
        rank issues a collective for a batch another rank does not have."""
        self._opened().read(index, error)

    def _submit(self, step: Step, agree_on_read: bool) -> None:
        """Queue the batch's read agreement (``agree_on_read``, with several ranks) and host stage."""
        index = step.context.index
        if agree_on_read and self._opened().reads_need_agreeing and not self._reads_carried:
            step.read_agreed = self._start_read_agreement(index, None)
        step.host_future = None
        if self._plan.host:
            step.host_future = self._worker.submit(self._host_stage, step.batch, index, step.read_error)
            self._pending.append(step.host_future)

    def _start_read_agreement(self, index: int | None, error: Exception | None) -> Future[None]:
        """The batch's read agreement: queued on the host thread ahead of its host stage, or
        (no host thread) started here and settled before the batch's first collective."""
        agreements = self._opened()
        if not self._host_thread:
            return agreements.start_read(index, error)
        agreed = self._worker.submit(agreements.read, index, error)
        self._pending.append(agreed)
        return agreed

    def _host_stage(self, batch: Any, index: int | None, refused: Exception | None = None) -> HostResult:
        """Input dist of the host-staged modules, then ``post_input_dist``, then the agreement
        (``refused``: the batch is a failed read's stand-in, refused with that error)."""
        result: HostResult = {}
        error: BaseException | None = None
        try:
            dists = self._input_dists
            context = dists.context(index)
            with dists.scope(), refuse_inputs(refused):
                dists.start(self._plan.host, batch, context)
                dists.wait(context)
                result = self._map_ids(context.module_contexts, context.input_dist_tensors_requests)
        except BaseException as e:
            error = e
        self._agree_on_host_stage(index, error, result)
        return result

    def _agree_on_host_stage(self, index: int | None, error: BaseException | None, result: HostResult) -> None:
        """The host stage's agreement; a batch that fails anywhere gives back the rows it holds."""
        try:
            self._opened().host_stage(index, error)
        except BaseException:
            self._release_result(result)
            raise

    def _map_ids(self, module_contexts: dict[str, Any], requests: dict[str, Any]) -> HostResult:
        """Receive each host-staged module's ids and run its ``post_input_dist``."""
        result: HostResult = {}
        try:
            for module in self._plan.host:
                name = self._plan.name_of(module)
                module_context, kjts = module_contexts[name], requests[name].wait()
                result[name] = (module_context, cast(HostStagedModule, module).post_input_dist(module_context, kjts))
        except BaseException:
            self._release_result(result)  # the modules mapped before the one that failed
            raise
        return result

    def _release(self, future: Future[HostResult] | None) -> None:
        """Let each module drop what it holds for a batch that will not be computed."""
        if future is None or not future.done() or future.exception() is not None:
            return
        self._release_result(future.result())

    def _release_result(self, result: HostResult) -> None:
        """``release_context`` for every module a host stage mapped (its batch will not compute)."""
        for module in self._plan.host:
            entry = result.get(self._plan.name_of(module))
            if entry is not None:
                cast(HostStagedModule, module).release_context(entry[0])
