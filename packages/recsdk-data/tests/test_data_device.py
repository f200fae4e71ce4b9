import sys

import pytest
import torch
import torch.distributed as dist

from recsdk.data import backend_for, current_stream, get_device, new_stream, npu_available, stream_context
from recsdk.data.testing import DistributedTestError, run_distributed


def test_cpu_device_and_backend() -> None:
    assert get_device("cpu") == torch.device("cpu")
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for("npu") == "hccl"


def test_auto_picks_cpu_without_accelerators() -> None:
    if torch.cuda.is_available() or npu_available():
        pytest.skip("an accelerator is present")
    assert get_device("auto") == torch.device("cpu")


def test_bad_kind_names_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"'auto', 'cpu', 'cuda', 'npu'.*'tpu'"):
        get_device("tpu")


def test_cuda_local_rank_beyond_device_count_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert get_device("cuda", local_rank=1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"local_rank must be in \[0, 2\) for the 2 visible cuda device\(s\), got 2"):
        get_device("cuda", local_rank=2)
    assert get_device("cpu", local_rank=5) == torch.device("cpu")  # the CPU ignores local_rank


def test_npu_without_torch_npu_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ImportError
    assert not npu_available()
    with pytest.raises(ValueError, match=r"pip install 'recsdk-data\[npu\]'"):
        get_device("npu")


def test_streams_are_noops_on_cpu() -> None:
    assert new_stream("cpu") is None
    assert current_stream("cpu") is None
    x = torch.ones(3)
    with stream_context(None):
        x = x + 1
    assert torch.equal(x, torch.full((3,), 2.0))


def _all_reduce_rank(rank: int, world_size: int) -> int:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("injected failure")
    dist.barrier()  # rank 0 would wait here forever without the helper's cleanup


def test_run_distributed_returns_per_rank_results() -> None:
    assert run_distributed(_all_reduce_rank, 2) == [3, 3]


def test_run_distributed_surfaces_failure_without_hanging() -> None:
    with pytest.raises(DistributedTestError, match="injected failure") as info:
        run_distributed(_fail_on_rank_one, 2, timeout_s=30)
    assert "rank 1" in str(info.value)
