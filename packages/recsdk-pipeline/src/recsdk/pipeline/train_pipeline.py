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

The pipeline owns the schedule (its :class:`~recsdk.pipeline.in_flight.Lanes` of batches in
flight, the model rewrite, forward/backward/step) and its failure; it calls two parts that own
their own state: :class:`~recsdk.pipeline.host_stages.HostStages` (the host thread, the
agreements, the host stages pending, failed reads) and
:class:`~recsdk.pipeline.inline_stages.InlineStages` (the inline modules' input dists).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
from torch.profiler import record_function

from recsdk.pipeline._torchrec_compat import In, InputDists, Out, SparseDistPipelineBase, device_groups
from recsdk.pipeline.host_staged import plan_modules
from recsdk.pipeline.host_stages import HostStages
from recsdk.pipeline.in_flight import Lane, Lanes, Step
from recsdk.pipeline.inline_stages import InlineStages

__all__ = ["MAX_PIPE_N_BATCH", "HybridTrainPipelineSparseDist"]

MAX_PIPE_N_BATCH = 12

T = TypeVar("T")


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


def _check_bool(name: str, value: object, *, optional: bool = False) -> None:
    """Raise ``TypeError`` unless ``value`` is a bool (or, if ``optional``, None)."""
    if not isinstance(value, bool) and not (optional and value is None):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def _checked_device(model: object, optimizer: object, device: object) -> torch.device:
    """``device`` as a ``torch.device``, once the model, optimizer and device are checked."""
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
    return device


def _check_pipe_n_batch(pipe_n_batch: object) -> None:
    if isinstance(pipe_n_batch, bool) or not isinstance(pipe_n_batch, int):
        raise TypeError(f"pipe_n_batch must be an int, got {pipe_n_batch!r} ({type(pipe_n_batch).__name__})")
    if not 1 <= pipe_n_batch <= MAX_PIPE_N_BATCH:
        raise ValueError(f"pipe_n_batch must be in [1, {MAX_PIPE_N_BATCH}], got {pipe_n_batch}")


def _checked_output(result: object) -> tuple[torch.Tensor, Any]:
    """The model's ``(loss, output)``, or ``TypeError`` saying what the forward returned instead."""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
        got = type(result).__name__
        if isinstance(result, tuple):
            got = f"a tuple of {len(result)}: ({', '.join(type(r).__name__ for r in result)})"
        raise TypeError(f"the model's forward must return (loss, output) with a tensor loss, got {got}")
    return cast(tuple[torch.Tensor, Any], result)


class HybridTrainPipelineSparseDist(SparseDistPipelineBase[In, Out]):
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
        device = _checked_device(model, optimizer, device)
        _check_bool("execute_all_batches", execute_all_batches)
        _check_bool("apply_jit", apply_jit)
        _check_bool("return_loss", return_loss)
        _check_bool("host_thread", host_thread, optional=True)
        _check_pipe_n_batch(pipe_n_batch)
        super().__init__(model, optimizer, device, execute_all_batches=execute_all_batches, apply_jit=apply_jit)
        self._return_loss = return_loss
        self._pipe_n_batch = pipe_n_batch
        self._lanes = Lanes()
        self._train_steps = 0
        self._output_checked = False
        # The first failure of a batch (read, host stage or compute): nothing runs after it.
        self._failure: BaseException | None = None
        self._input_dists = InputDists(self)
        host = device.type != "cpu" if host_thread is None else host_thread  # see the Args
        self._host = HostStages(self._input_dists, device, host)
        self._inline = InlineStages(self._input_dists)

    # ---- public -------------------------------------------------------------------------

    @property
    def pipe_n_batch(self) -> int:
        """Batches prepared ahead of the one computing."""
        return self._pipe_n_batch

    @property
    def host_thread(self) -> bool:
        """Whether host stages run on the background thread (else on TorchRec's schedule, on the calling thread)."""
        return self._host.host_thread

    @property
    def host_staged_modules(self) -> list[str]:
        """Names of the sharded modules whose input dist runs on the host thread (known once the
        first batch has been through :meth:`progress`: the pipeline finds them on that batch)."""
        return self._host.module_names

    @property
    def inline_modules(self) -> list[str]:
        """Names of the pipelined modules that keep TorchRec's schedule on the calling thread."""
        return self._inline.module_names

    def progress(self, dataloader_iter: Iterator[In]) -> Any:
        """Run one batch: forward, and in train mode backward and the optimizer step.

        Args:
            dataloader_iter (Iterator): yields the batches (``Pipelineable``).

        Returns:
            the model's output for the batch, or ``(output, loss)`` with ``return_loss``.

        Raises:
            StopIteration: no batch is left (see ``execute_all_batches``).
            TypeError: the model's forward does not return ``(loss, output)``.
            PeerFailureError: another rank's host stage or read of this batch failed (this
                rank's own exception is raised as is; see the class docstring's failures).
            RuntimeError: the pipeline is closed, or a batch failed earlier (its host stage,
                read or compute; chained to that failure).
        """
        self._check_usable()
        return self._advance(bool(self._tr_model.training), dataloader_iter)

    @property
    def batches_trained(self) -> int:
        """Training batches this pipeline has computed (backward and optimizer step done)."""
        return self._train_steps

    @property
    def batches_read_ahead(self) -> int:
        """Training batches read from the iterator but not trained yet (0 after :meth:`drain`)."""
        return len(self._lanes.train.steps)

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
        lane = self._lanes.train
        if not lane.steps:
            return []
        self._check_usable()
        if not self._tr_model.training:
            raise ValueError(
                f"drain() trains the {len(lane.steps)} batches read ahead for training, but the model is in eval "
                "mode; call model.train() first"
            )
        return [self._advance(True, None) for _ in range(len(lane.steps))]

    def _check_usable(self) -> None:
        if self._host.closed:
            raise RuntimeError("HybridTrainPipelineSparseDist is closed")
        if self._failure is not None:
            raise RuntimeError(
                "HybridTrainPipelineSparseDist cannot continue: a batch failed earlier (its host stage, its read "
                "from the data iterator or its compute)"
            ) from self._failure
        if not self._tr_attached:
            self.attach(self._tr_model)

    def _advance(self, training: bool, dataloader_iter: Iterator[In] | None) -> Any:
        """Compute the next batch of ``training``'s lane (entered here), reading ahead from
        ``dataloader_iter`` first (None: no read)."""
        lane = self._lanes.enter(training, self._train_steps, self._host.remap)
        # The previous batch's backward is done: release its rows now, on this thread and before
        # any host stage is submitted, so which rows a host stage may evict never depends on
        # thread timing.
        self._host.release_finished_pins()
        try:
            if dataloader_iter is not None:
                self._fill(lane, dataloader_iter)
            if not lane.steps:
                raise StopIteration
            step = lane.steps[0]
            self._failing(self._host.collect, step)
            self._start_inline(step)
            self._inline.wait(step)
            self._tr_set_module_context(step.context)
            if training:
                self._tr_optimizer.zero_grad()
            self._tr_wait_for_data_dist(step.batch)
            # A refused batch raises on every rank: no rank starts one after it.
            upcoming = lane.steps[1] if len(lane.steps) > 1 and not self._inline.refused(step) else None
            if upcoming is not None:
                self._start_inline(upcoming)
            with contextlib.nullcontext() if training else torch.no_grad():
                loss, output = self._forward(step.batch)
            if upcoming is not None:
                self._inline.wait(upcoming)
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
            self._host.quiesce()
        return (output, loss) if self._return_loss else output

    def close(self) -> None:
        """Stop the host thread and give the model back; the pipeline cannot be used afterwards.

        Batches read but not computed are released (see :meth:`reset`), and the model is
        detached (its sharded modules get their own forwards back), so it can be called
        directly or handed to another pipeline.
        """
        if not self._host.closed:
            self._release_all()
            if self._tr_attached and self._tr_pipelined_modules:
                self.detach()
        self._host.close()

    def __enter__(self) -> HybridTrainPipelineSparseDist[In, Out]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        """Drop the batches in flight (TorchRec's ``reset``); the model stays pipelined.

        Each host-staged module's ``release_context(ctx)`` is called for each dropped
        batch's context, so that it can unpin the rows mapped for that batch.
        """
        self._release_all()
        super().reset()

    def detach(self) -> torch.nn.Module:
        """Give the sharded modules their own forwards back (TorchRec's ``detach``).

        The batches in flight are kept; the next :meth:`progress` attaches the model again.
        """
        self._host.quiesce()
        return super().detach()

    def attach(self, model: torch.nn.Module | None = None, sparse_dist: bool = True) -> None:
        """Pipeline the model again after :meth:`detach` (``sparse_dist`` is accepted for TorchRec parity)."""
        if model is not None:
            self._tr_model = model
        self._tr_mark_attached()
        if self._tr_pipelined_modules:
            step = next(self._lanes.steps(), None)
            self._tr_rewrite(step.batch if step else None, step.context if step else self._tr_new_context())
            self._adopt_modules()

    # ---- the calling thread -------------------------------------------------------------

    def _release_all(self) -> None:
        """With the host thread idle, give back what every batch in flight holds and forget them."""
        self._host.quiesce()
        self._host.drop(self._lanes.steps())
        self._lanes.clear()

    def _fill(self, lane: Lane, dataloader_iter: Iterator[In]) -> None:
        """Read batches until ``pipe_n_batch`` are ahead of the one to compute; start their host stages.

        A batch the iterator raises on is a failed host stage of that batch
        (:meth:`HostStages.read_failed`); nothing more is read after a failure.
        """
        lane.read_from(dataloader_iter)
        self._host.open()  # every rank's first progress(): collective
        while lane.wants(self._pipe_n_batch):
            if self._host.stopped:
                return  # no batch after a failed one would ever compute
            try:
                batch = next(dataloader_iter, None)
                if batch is not None:
                    batch = self._tr_copy_to_device(batch)
            except Exception as e:  # the user's iterator (or the copy) failed
                rewritten = bool(self._tr_pipelined_modules)
                lane.steps.append(self._failing(self._host.read_failed, e, self._tr_new_context(), rewritten=rewritten))
                return
            if batch is None:
                lane.exhausted = True
                break
            step = Step(batch=batch, context=self._tr_new_context())
            lane.steps.append(step)
            if not self._tr_pipelined_modules:
                self._failing(self._host.read, step, rewritten=False)
                self._bootstrap(step)
            else:
                self._host.read(step, rewritten=True)
        if lane.exhausted and not self._tr_execute_all_batches and len(lane.steps) < 1 + self._pipe_n_batch:
            raise StopIteration

    def _bootstrap(self, step: Step) -> None:
        """First batch: rewrite the model and run its whole input dist here, inline; then the
        host stages map their modules' share of it."""
        self._tr_rewrite(step.batch, step.context)
        self._inline.run_first(self._tr_pipelined_modules, step)
        self._adopt_modules()
        self._host.map_first(step)
        step.inline_started = True

    def _adopt_modules(self) -> None:
        """Once the input dists exist (after a rewrite): swap in TorchRec's fused-splits forwards,
        and split the pipelined modules between the host stages and the inline schedule."""
        self._tr_override_input_dist_forwards()
        plan = plan_modules(self._tr_pipelined_modules, device_groups(self._tr_model), self._host.host_thread)
        self._host.adopt(plan)
        self._inline.adopt(plan)

    def _start_inline(self, step: Step) -> None:
        self._host.settle_read(step)  # before the batch's first collective
        self._inline.start(step)

    def _failing(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)``; what it raises (a failed read or host stage) stops the pipeline."""
        try:
            return call(*args, **kwargs)
        except BaseException as e:
            self._failure = e
            raise

    def _forward(self, batch: Any) -> tuple[torch.Tensor, Any]:
        result = self._tr_model(batch)
        if not self._output_checked:
            _checked_output(result)
            self._output_checked = True
        return cast(tuple[torch.Tensor, Any], result)
