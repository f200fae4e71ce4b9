"""Argument checks, the (loss, output) contract and the host worker, in one process."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from pipeline_models import NUM_DENSE, make_batches
from torch import nn

import recsdk.pipeline as pipeline_pkg
from recsdk.pipeline import HostStageError, HostWorker, HybridTrainPipelineSparseDist

CPU = torch.device("cpu")


class DenseModel(nn.Module):
    """No sharded module: the pipeline then runs the plain loop."""

    def __init__(self, returns: str = "loss_output") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(NUM_DENSE, 1)
        self.returns = returns

    def forward(self, batch):  # type: ignore[no-untyped-def]
        logits = self.linear(batch.dense_features).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        if self.returns == "output":
            return logits
        if self.returns == "triple":
            return loss, logits, logits
        return loss, logits


def _pipeline(model: nn.Module, **kwargs) -> HybridTrainPipelineSparseDist:  # type: ignore[no-untyped-def]
    return HybridTrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), CPU, **kwargs)


@pytest.mark.parametrize("value", [0, 13, -1])
def test_pipe_n_batch_out_of_range_is_a_value_error(value: int) -> None:
    with pytest.raises(ValueError, match=rf"pipe_n_batch must be in \[1, 12\], got {value}"):
        _pipeline(DenseModel(), pipe_n_batch=value)


@pytest.mark.parametrize("value", [2.0, "2", True, None])
def test_pipe_n_batch_must_be_an_int(value: object) -> None:
    with pytest.raises(TypeError, match="pipe_n_batch must be an int"):
        _pipeline(DenseModel(), pipe_n_batch=value)


@pytest.mark.parametrize("name", ["execute_all_batches", "apply_jit", "return_loss", "host_thread"])
def test_flags_must_be_bools(name: str) -> None:
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        _pipeline(DenseModel(), **{name: 1})


def test_model_optimizer_and_device_are_checked() -> None:
    model = DenseModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        HybridTrainPipelineSparseDist(lambda b: b, optimizer, CPU)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        HybridTrainPipelineSparseDist(model, object(), CPU)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"device must be a torch\.device"):
        HybridTrainPipelineSparseDist(model, optimizer, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"device meta differs from the model's device cpu"):
        HybridTrainPipelineSparseDist(model, optimizer, torch.device("meta"))


@pytest.mark.parametrize(("returns", "got"), [("output", "Tensor"), ("triple", "a tuple of 3")])
def test_forward_must_return_loss_and_output(returns: str, got: str) -> None:
    pipeline = _pipeline(DenseModel(returns))
    with pytest.raises(TypeError, match=rf"must return \(loss, output\).*got {got}"):
        pipeline.progress(iter(make_batches(3, 0, seed=1)))
    pipeline.close()


def test_dense_only_model_trains_like_the_plain_loop_and_eval_does_not_step() -> None:
    batches = make_batches(5, 0, seed=1)
    reference = DenseModel()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for batch in batches:
        loss, _ = reference(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.detach())
    model = DenseModel()
    with _pipeline(model, return_loss=True, pipe_n_batch=3) as pipeline:
        it = iter(batches)
        got = [pipeline.progress(it)[1].detach() for _ in range(len(batches))]
        with pytest.raises(StopIteration):
            pipeline.progress(it)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        model.eval()
        before = model.linear.weight.detach().clone()
        output, loss = pipeline.progress(iter(batches[:1]))
        assert not loss.requires_grad and not output.requires_grad  # forward ran under no_grad
        assert torch.equal(model.linear.weight, before)
    with pytest.raises(RuntimeError, match="closed"):
        pipeline.progress(iter(batches))


def test_reexports_are_torchrecs_own_objects() -> None:
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    assert pipeline_pkg.apply_optimizer_in_backward is apply_optimizer_in_backward
    assert pipeline_pkg.in_backward_optimizer_filter is in_backward_optimizer_filter
    assert pipeline_pkg.KeyedOptimizerWrapper is KeyedOptimizerWrapper
    assert pipeline_pkg.CombinedOptimizer is CombinedOptimizer


def test_host_worker_runs_in_order_on_one_thread_and_stops_after_a_failure() -> None:
    worker = HostWorker("test-host")
    seen: list[tuple[int, str]] = []

    def record(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i

    def fail() -> None:
        raise KeyError("boom")

    futures = [worker.submit(record, i) for i in range(3)]
    failing = worker.submit(fail)
    after = worker.submit(record, 99)
    assert [f.result() for f in futures] == [0, 1, 2]
    with pytest.raises(KeyError, match="boom"):
        failing.result()
    with pytest.raises(HostStageError, match="earlier host stage failed") as info:
        after.result()
    assert isinstance(info.value.__cause__, KeyError)
    assert seen == [(0, "test-host"), (1, "test-host"), (2, "test-host")]  # 99 never ran
    assert worker.close(timeout=5.0)
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(record, 1)
