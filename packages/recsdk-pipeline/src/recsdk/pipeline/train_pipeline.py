"""``HybridTrainPipelineSparseDist``: TorchRec's sparse-dist pipeline with a host thread.

Per batch, a sharded module that implements :class:`~recsdk.pipeline.HostStagedModule`
(recsdk's sharded :class:`~recsdk.embedding.HashEmbeddingBagCollection`) has a host
stage (bucket the raw ids by owner, the id all-to-alls over the host gloo group, the
id-table mapping in ``post_input_dist``, the copy of the row indices to the device) and a
device stage (lookup, output dist, the dense model, backward, optimizer step). This
pipeline runs the host stages of the next ``pipe_n_batch`` batches on one background
thread while the calling thread runs the device stage of the current batch (by default on
an accelerator; on a CPU device it keeps TorchRec's schedule on the calling thread, see
``host_thread``).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, cast

import torch
from torch.profiler import record_function
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.types import NoWait

from recsdk.pipeline._torchrec_compat import In, Out, SparseDistPipelineBase
from recsdk.pipeline.batch_agreements import BatchAgreements
from recsdk.pipeline.host_staged import HostStagedModule
from recsdk.pipeline.host_stages import HostResult, HostStages, Lane, Step
from recsdk.pipeline.host_worker import HostWorker
from recsdk.sharding import HostShardedModule, refuse_inputs

__all__ = ["MAX_PIPE_N_BATCH", "HybridTrainPipelineSparseDist"]

logger = logging.getLogger(__name__)

MAX_PIPE_N_BATCH = 12
HOST_THREAD_NAME = "recsdk-host-stage"


def _model_device(model: torch.nn.Module) -> torch.device | None:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return None


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def _select_device(device: torch.device) -> None:
    """Make ``device`` current on the calling thread (the host thread's setup)."""
    if device.type not in ("cpu", "meta"):
        module = torch.get_device_module(device)
        if hasattr(module, "set_device") and device.index is not None:
            module.set_device(device)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


class HybridTrainPipelineSparseDist(HostStages, SparseDistPipelineBase[In, Out]):
    """Train (and eval) pipeline that overlaps the host id work with device compute.

    A drop-in for TorchRec's ``TrainPipelineSparseDist``. Each :meth:`progress` call runs
    forward, backward and the optimizer step of one batch on the calling thread, while one
    background thread runs the host stages of the next ``pipe_n_batch`` batches: the
    sharded modules' ``input_dist`` (bucketing, the id all-to-all over the host
    group) and ``post_input_dist`` (id-table mapping, copy to the device). The
    embeddings are read at forward time, so a pipelined run gives the same losses and
    weights as the plain loop ``loss, out = model(batch); loss.backward();
    optimizer.step(); optimizer.zero_grad()`` over the same batches. Rows referenced by
    batches in flight are pinned by the sharded module (in tables with an eviction policy;
    the others never free rows by themselves), and the pipeline never maps more
    than ``pipe_n_batch`` batches ahead of the one computing.

    Without the host thread (``host_thread``; the default on a CPU device) every module
    keeps TorchRec's schedule on the calling thread. Either way a failed read travels with
    the batch's ids instead of a read agreement per batch (below).

    A module is host-staged iff it implements :class:`~recsdk.pipeline.HostStagedModule`
    and all of its ``host_input_groups()`` are free of device traffic (neither the default
    group nor a sharding env's group). The others, such as a plain TorchRec
    ``EmbeddingBagCollection``, keep TorchRec's schedule on the calling thread: the
    default group's collectives must stay in one order on every rank.

    Every host-group collective is issued from the one host thread, in batch order. The
    host thread is idle whenever :meth:`progress` is not running, so ``model.train()`` /
    ``model.eval()``, checkpoints and statistics between calls never race with it. The
    thread does not keep the pipeline alive: a pipeline dropped without :meth:`close` is
    collected as usual and its thread ends.

    After ``model.eval()``, :meth:`progress` runs forward only, under ``torch.no_grad()``
    (no backward, no optimizer step), and the id tables are only read. Each mode keeps its
    own queue: batches read ahead in the other mode wait, untouched, until that mode comes
    back. Batches read ahead for eval are mapped again if training ran in between.

    Failures stop every rank at the same :meth:`progress` call. If a host stage raises,
    that exception (with its traceback from the host thread) is raised from the
    :meth:`progress` that needs the batch, and the other ranks raise
    :class:`~recsdk.pipeline.HostStageError` there (or a collective error once the host
    group's timeout expires, if the failed rank never sent its ids). If the data iterator
    raises (anything but the end of data), that is a failed host stage of the batch it
    was reading: the batches read before it compute as in the plain loop, then the
    :meth:`progress` that would compute it raises the iterator's exception on this rank and
    a :class:`~recsdk.sharding.PeerFailureError` on the others: once the model is pipelined
    (with recsdk's hash modules) the batch's input dists refuse a stand-in
    (:func:`~recsdk.sharding.refuse_inputs`) and its host stage's agreement raises (the
    modules' own without the host thread; :class:`~recsdk.pipeline.HostStageError` on the host
    thread); for the first batch, and models without hash modules, a read agreement per batch
    raises :class:`~recsdk.pipeline.HostStageError`. A batch any rank's hash module refused is
    the last whose input dist any rank starts. The pipeline refuses to continue afterwards.

    Construct and drive it on every rank alike: the first :meth:`progress` creates small
    gloo groups (collectively) for these agreements.

    Args:
        model (torch.nn.Module): the ``DistributedModelParallel`` model; its forward takes
            the batch and returns ``(loss, output)``.
        optimizer (torch.optim.Optimizer): e.g. a ``CombinedOptimizer`` of the fused
            sparse optimizer and the dense one.
        device (torch.device): the model's device.
        execute_all_batches (bool): when the iterator runs dry, finish the batches in
            flight before raising ``StopIteration``; if ``False``, raise at once.
        apply_jit (bool): ``torch.jit.script`` the non-sharded modules (as TorchRec).
        return_loss (bool): :meth:`progress` returns ``(output, loss)`` instead of
            ``output``.
        pipe_n_batch (int): batches prepared ahead of the one computing, in
            ``[1, 12]``; each holds its rows in evicting tables pinned until it has computed.
        host_thread (bool | None): run the host stages on the background thread. ``None``
            (default): yes on an accelerator, no on a CPU device, where the host stage and
            the lookups share the CPU cores: a thread only takes turns with the calling one,
            and TorchRec's schedule on the calling thread is faster (the next batch's id
            all-to-alls run during this batch's forward; its ids are mapped at its compute).
            Pass ``True`` on a CPU device whose ranks leave cores idle.

    Raises:
        TypeError: a non-module ``model``, non-optimizer ``optimizer``, non-device
            ``device``, non-bool flag (``host_thread``: bool or ``None``) or non-int
            ``pipe_n_batch``.
        ValueError: ``pipe_n_batch`` outside ``[1, 12]``, or ``device`` differs from the
            model's.

    Example::

        pipeline = HybridTrainPipelineSparseDist(model, optimizer, device, pipe_n_batch=2)
        it = iter(dataloader)
        while True:
            try:
                output = pipeline.progress(it)
            except StopIteration:
                break
        pipeline.close()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        return_loss: bool = False,
        pipe_n_batch: int = 2,
        host_thread: bool | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(device, str):
            device = torch.device(device)
        if not isinstance(device, torch.device):
            raise TypeError(f"device must be a torch.device, got {device!r} ({type(device).__name__})")
        model_device = _model_device(model)
        if model_device is not None and not _same_device(model_device, device):
            raise ValueError(f"device {device} differs from the model's device {model_device}; pass the model's device")
        _check_bool("execute_all_batches", execute_all_batches)
        _check_bool("apply_jit", apply_jit)
        _check_bool("return_loss", return_loss)
        if host_thread is not None:
            _check_bool("host_thread", host_thread)
        if isinstance(pipe_n_batch, bool) or not isinstance(pipe_n_batch, int):
            raise TypeError(f"pipe_n_batch must be an int, got {pipe_n_batch!r} ({type(pipe_n_batch).__name__})")
        if not 1 <= pipe_n_batch <= MAX_PIPE_N_BATCH:
            raise ValueError(f"pipe_n_batch must be in [1, {MAX_PIPE_N_BATCH}], got {pipe_n_batch}")
        super().__init__(model, optimizer, device, execute_all_batches=execute_all_batches, apply_jit=apply_jit)
        self._return_loss = return_loss
        self._pipe_n_batch = pipe_n_batch
        # The host stage and the lookups share the CPU when the device is the CPU: a thread
        # only takes turns with the calling one, and TorchRec's schedule is faster there.
        self._host_thread = device.type != "cpu" if host_thread is None else host_thread
        self._lanes: dict[bool, Lane] = {True: Lane(), False: Lane()}
        self._active_mode: bool | None = None
        self._train_steps = 0
        self._host_modules: list[ShardedModule] = []
        self._inline_modules: list[ShardedModule] = []
        # The per-batch failure agreements (their gloo groups are created at the first progress).
        self._agreements: BatchAgreements | None = None
        self._names: dict[int, str] = {}
        self._pending: list[Future[Any]] = []
        self._output_checked = False
        self._failure: BaseException | None = None
        self._read_error: Exception | None = None  # the data iterator raised (this rank)
        self._last_batch: Any = None  # the last batch read (a failed read's stand-in)
        # A failed read travels with the batch's ids (no read agreement): set with the modules.
        self._reads_carried = False
        # The setup references the device only: the thread must not keep the pipeline alive.
        self._worker = HostWorker(HOST_THREAD_NAME, setup=functools.partial(_select_device, device))

    # ---- public -------------------------------------------------------------------------

    @property
    def pipe_n_batch(self) -> int:
        """Batches prepared ahead of the one computing."""
        return self._pipe_n_batch

    @property
    def host_thread(self) -> bool:
        """Whether host stages run on the background thread (else on the calling thread, on
        TorchRec's schedule: the next batch's input dist runs during this batch's forward)."""
        return self._host_thread

    @property
    def host_staged_modules(self) -> list[str]:
        """Names of the sharded modules whose input dist runs on the host thread (known once the
        first batch has been through :meth:`progress`: the pipeline finds them on that batch)."""
        return [self._name_of(m) for m in self._host_modules]

    @property
    def inline_modules(self) -> list[str]:
        """Names of the pipelined modules that keep TorchRec's schedule on the calling thread."""
        return [self._name_of(m) for m in self._inline_modules]

    def progress(self, dataloader_iter: Iterator[In]) -> Any:
        """Run one batch: forward, and in train mode backward and the optimizer step.

        Args:
            dataloader_iter (Iterator): yields the batches (``Pipelineable``).

        Returns:
            the model's output for the batch, or ``(output, loss)`` with ``return_loss``.

        Raises:
            StopIteration: no batch is left (see ``execute_all_batches``).
            TypeError: the model's forward does not return ``(loss, output)``.
            PeerFailureError: another rank's host stage failed for this batch, or its data
                iterator raised instead of yielding it (this rank's own exception, from a
                host stage or from ``dataloader_iter``, is raised as is): the sharded modules'
                agreement's, or a :class:`~recsdk.pipeline.HostStageError` (the pipeline's).
            RuntimeError: the pipeline is closed, or a batch failed earlier: its host stage,
                its read from the data iterator or its forward, backward or optimizer step
                (chained to that failure).
        """
        self._check_usable()
        training = bool(self._tr_model.training)
        return self._advance(self._enter_mode(training), training, dataloader_iter)

    @property
    def batches_trained(self) -> int:
        """Training batches this pipeline has computed (backward and optimizer step done)."""
        return self._train_steps

    @property
    def batches_read_ahead(self) -> int:
        """Training batches read from the iterator but not trained yet (0 after :meth:`drain`)."""
        return len(self._lanes[True].steps)

    def drain(self) -> list[Any]:
        """Train the batches read ahead now, in order, without reading another; their outputs.

        The way to checkpoint while pipelining: afterwards every batch read from the data
        iterator has been trained and none is mapped ahead, so the model, its id tables and the
        iterator's position (``StatefulDataLoader.state_dict()``) all stand after the last batch
        read; save them, then keep calling :meth:`progress`, which reads on from there. A job
        resumed from that checkpoint trains exactly the batches this one trains next, in the
        same pipeline state (nothing in flight), so it gives the same results.

        Returns:
            list: what :meth:`progress` would have returned for each of those batches (the
            caller counts them as steps).

        Raises:
            ValueError: batches are read ahead for training but the model is in eval mode.
            RuntimeError: as :meth:`progress`.

        Example::

            for output in pipeline.drain():
                step += 1
            save_checkpoint(model, optimizer, f"ckpt/step_{step}", pipeline=pipeline,
                            extra={"step": step, "data": loader.state_dict()})
        """
        lane = self._lanes[True]
        if not lane.steps:
            return []
        self._check_usable()
        if not self._tr_model.training:
            raise ValueError(
                f"drain() trains the {len(lane.steps)} batches read ahead for training, but the model is in eval "
                "mode; call model.train() first"
            )
        lane = self._enter_mode(True)
        return [self._advance(lane, True, None) for _ in range(len(lane.steps))]

    def _check_usable(self) -> None:
        if self._worker.closed:
            raise RuntimeError("HybridTrainPipelineSparseDist is closed")
        if self._failure is not None:
            raise RuntimeError(
                "HybridTrainPipelineSparseDist cannot continue: a batch failed earlier (its host stage, its read "
                "from the data iterator or its compute)"
            ) from self._failure
        if not self._tr_attached:
            self.attach(self._tr_model)

    def _advance(self, lane: Lane, training: bool, dataloader_iter: Iterator[In] | None) -> Any:
        """Compute the lane's next batch, reading ahead from ``dataloader_iter`` first (None: no read)."""
        # The previous batch's backward is done: release its rows now, on this thread and before
        # any host stage is submitted, so which rows a host stage may evict never depends on
        # thread timing.
        for module in self._host_modules:
            cast(HostStagedModule, module).release_finished_pins()
        try:
            if dataloader_iter is not None:
                self._fill(lane, dataloader_iter)
            if not lane.steps:
                raise StopIteration
            step = lane.steps[0]
            self._finish_host_stage(step)
            self._start_inline(step)
            self._wait_inline(step)
            self._tr_set_module_context(step.context)
            if training:
                self._tr_optimizer.zero_grad()
            self._tr_wait_for_data_dist(step.batch)
            upcoming = lane.steps[1] if len(lane.steps) > 1 else None
            if upcoming is not None and self._refused(step):
                upcoming = None  # the batch raises on every rank: no rank starts one after it
            if upcoming is not None:
                self._start_inline(upcoming)
            if training:
                loss, output = self._forward(step.batch)
            else:
                with torch.no_grad():
                    loss, output = self._forward(step.batch)
            if upcoming is not None:
                self._wait_inline(upcoming)
            if step.read_error is not None:
                # A refused stand-in: its modules' agreement raises in the forward, on every
                # rank; whatever happened, it is never trained on.
                raise step.read_error
            if training:
                with record_function(f"## backward {step.context.index} ##"):
                    torch.sum(loss, dim=0).backward()
                self._tr_sync_embeddings(step.context)
                with record_function(f"## optimizer {step.context.index} ##"):
                    self._tr_optimizer.step()
                self._train_steps += 1
            lane.steps.popleft()
        except StopIteration:
            raise
        except BaseException as e:
            # A batch that failed in its forward, backward or step (e.g. a bad batch the sharded
            # module refused, on every rank) has used up its input dist: nothing can follow it.
            if self._failure is None:
                self._failure = e
            raise
        finally:
            # Whatever happened (end of data, an error in forward or in the iterator), the host
            # thread is idle when progress() returns or raises.
            self._quiesce()
        return (output, loss) if self._return_loss else output

    def close(self) -> None:
        """Stop the host thread and give the model back; the pipeline cannot be used afterwards.

        Batches read but not computed are released (see :meth:`reset`), and the model is
        detached (its sharded modules get their own forwards back), so it can be called
        directly or handed to another pipeline.
        """
        if not self._worker.closed:
            self._quiesce()
            self._release_all()
            if self._tr_attached and self._tr_pipelined_modules:
                self.detach()
        self._worker.close()

    def __enter__(self) -> HybridTrainPipelineSparseDist[In, Out]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        """Drop the batches in flight (TorchRec's ``reset``); the model stays pipelined.

        Each host-staged module's ``release_context(ctx)`` is called for each dropped
        batch's context, so that it can unpin the rows mapped for that batch.
        """
        self._quiesce()
        self._release_all()
        super().reset()
        self._active_mode = None

    def detach(self) -> torch.nn.Module:
        """Give the sharded modules their own forwards back (TorchRec's ``detach``).

        The batches in flight are kept; the next :meth:`progress` attaches the model again.
        """
        self._quiesce()
        return super().detach()

    def attach(self, model: torch.nn.Module | None = None, sparse_dist: bool = True) -> None:
        """Pipeline the model again after :meth:`detach` (``sparse_dist`` is accepted for TorchRec parity)."""
        if model is not None:
            self._tr_model = model
        self._tr_mark_attached()
        if self._tr_pipelined_modules:
            step = next((s for lane in self._lanes.values() for s in lane.steps), None)
            self._tr_rewrite(step.batch if step else None, step.context if step else self._tr_new_context())
            self._tr_override_input_dist_forwards()
            self._classify_modules()

    # ---- the calling thread -------------------------------------------------------------

    def _release_all(self) -> None:
        self._settle_all_reads()
        for lane in self._lanes.values():
            for step in lane.steps:
                self._release(step.host_future)
        self._lanes = {True: Lane(), False: Lane()}

    def _release(self, future: Future[HostResult] | None) -> None:
        """Let each module drop what it holds for a batch that will not be computed."""
        if future is None or not future.done() or future.exception() is not None:
            return
        self._release_result(future.result())

    def _enter_mode(self, training: bool) -> Lane:
        lane = self._lanes[training]
        if self._active_mode is not None and self._active_mode != training and not training:
            if lane.train_steps_seen != self._train_steps:
                # Training changed the id tables since these eval batches were mapped.
                for step in lane.steps:
                    if step.host_future is not None:
                        self._release(step.host_future)
                        self._submit_host_stage(step, agree_on_read=False)
        if not training:
            lane.train_steps_seen = self._train_steps
        self._active_mode = training
        return lane

    def _fill(self, lane: Lane, dataloader_iter: Iterator[In]) -> None:
        """Read batches until ``pipe_n_batch`` are ahead of the one to compute; start their host stages.

        A batch the iterator raises on is a failed host stage of that batch (see
        :meth:`_read_failed`); nothing more is read after a failure.
        """
        if dataloader_iter is not lane.iterator:
            lane.iterator = dataloader_iter
            lane.exhausted = False
        if self._agreements is None:
            self._agreements = BatchAgreements()  # every rank's first progress(): collective
        while len(lane.steps) < 1 + self._pipe_n_batch and not lane.exhausted:
            if self._read_error is not None or self._worker.failure is not None:
                return  # no batch after a failed one would ever compute
            try:
                batch = next(dataloader_iter, None)
                if batch is not None:
                    batch = self._tr_copy_to_device(batch)
            except Exception as e:  # the user's iterator (or the copy) failed
                self._read_failed(lane, e)
                return
            if batch is None:
                lane.exhausted = True
                break
            self._last_batch = batch
            step = Step(batch=batch, context=self._tr_new_context())
            lane.steps.append(step)
            if not self._tr_pipelined_modules:
                self._agree_on_read_here(step.context.index, None)
                self._bootstrap(step)
            else:
                self._submit_host_stage(step, agree_on_read=True)
        if lane.exhausted and not self._tr_execute_all_batches and len(lane.steps) < 1 + self._pipe_n_batch:
            raise StopIteration

    def _start_inline(self, step: Step) -> None:
        # Settled before the batch's first collective, also for a batch this rank could not
        # read (it issues none): its peers may be in that agreement's message exchange.
        self._settle_read(step)
        if step.inline_started:
            return
        if step.read_agreed is not None and step.read_agreed.exception() is not None:
            return  # a rank could not read this batch: it never computes, on any rank
        step.inline_started = True
        if not self._inline_modules:
            return
        with self._tr_data_dist_scope(), refuse_inputs(step.read_error):
            self._tr_start_data_dist(self._inline_modules, step.batch, step.context)

    def _refused(self, step: Step) -> bool:
        """Whether some rank refused the step's batch in a hash module's input dist (its input
        check, or a failed read's stand-in): the same answer on every rank once the batch's
        splits are waited for; its forward then raises on every rank."""
        for module in self._inline_modules:
            if isinstance(module, HostShardedModule):
                module_context = step.context.module_contexts.get(self._name_of(module))
                if module_context is not None and module.input_refused(module_context):
                    return True
        return False

    def _wait_inline(self, step: Step) -> None:
        if step.context.fused_splits_awaitables:
            with self._tr_data_dist_scope():
                self.wait_sparse_data_dist(step.context)

    def _finish_host_stage(self, step: Step) -> None:
        self._settle_read(step)
        agreed, step.read_agreed = step.read_agreed, None
        future, step.host_future = step.host_future, None
        try:
            if agreed is not None:
                agreed.result()  # first: a failed read skips the host stage after it
            if future is None:
                return
            result = future.result()
        except BaseException as e:
            self._failure = e
            raise
        for name, (module_context, kjts) in result.items():
            step.context.module_contexts[name] = module_context
            step.context.input_dist_tensors_requests[name] = NoWait(kjts)

    def _forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        result = self._tr_model(batch)
        if not self._output_checked:
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
                got = type(result).__name__
                if isinstance(result, tuple):
                    got = f"a tuple of {len(result)}: ({', '.join(type(r).__name__ for r in result)})"
                raise TypeError(f"the model's forward must return (loss, output) with a tensor loss, got {got}")
            self._output_checked = True
        return cast(tuple[torch.Tensor, Any], result)

    def _quiesce(self) -> None:
        """Wait until the host thread is idle (every progress ends with it)."""
        pending, self._pending = self._pending, []
        if pending:
            wait_futures(pending)
