"""Device selection, collective backends and stream helpers.

recsdk runs the same code on CPU (gloo), CUDA (nccl) and Ascend NPU (hccl through
``torch_npu``). These helpers pick the accelerator, the matching backend and give
stream utilities that do nothing where a device has no streams (CPU).

``torch_npu`` is imported lazily, only when an NPU is asked for or probed.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "DEVICE_TYPES",
    "backend_for",
    "current_stream",
    "get_device",
    "new_stream",
    "npu_available",
    "stream_context",
]

DEVICE_TYPES = ("auto", "cpu", "cuda", "npu")
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def _import_torch_npu() -> Any:
    return importlib.import_module("torch_npu")


def npu_available() -> bool:
    """True when ``torch_npu`` imports and reports at least one NPU device."""
    try:
        _import_torch_npu()
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available() and npu.device_count() > 0)


def get_device(kind: str = "auto", local_rank: int = 0) -> torch.device:
    """Pick the device to train on.

    ``"auto"`` prefers an NPU (when ``torch_npu`` imports and reports a device), then
    CUDA, then the CPU.

    Args:
        kind (str): one of ``"auto"``, ``"cpu"``, ``"cuda"``, ``"npu"``.
        local_rank (int): index of the accelerator for this process (ignored on CPU). Must be
            below the number of visible accelerators: two processes never share one silently.

    Returns:
        torch.device: the chosen device, with its index set for accelerators.

    Raises:
        ValueError: for an unknown ``kind``, an accelerator that is not available, or a
            ``local_rank`` that is not below the accelerator count.

    Example::

        device = get_device("auto", local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend_for(device))
    """
    if kind not in DEVICE_TYPES:
        raise ValueError(f"device kind must be one of {DEVICE_TYPES}, got {kind!r}")
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    if kind == "auto":
        if npu_available():
            kind = "npu"
        elif torch.cuda.is_available():
            kind = "cuda"
        else:
            kind = "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch.cuda.is_available() is False")
        return torch.device("cuda", _checked_index("cuda", local_rank, torch.cuda.device_count()))
    try:
        _import_torch_npu()
    except ImportError as e:
        raise ValueError(
            "device 'npu' needs the Ascend PyTorch adapter: "
            "pip install 'recsdk-data[npu]' (torch-npu matching your torch version)"
        ) from e
    if not npu_available():
        raise ValueError("device 'npu' was asked for but torch_npu reports no NPU device")
    return torch.device("npu", _checked_index("npu", local_rank, torch.npu.device_count()))  # type: ignore[attr-defined]


def _checked_index(kind: str, local_rank: int, count: int) -> int:
    if local_rank >= count:
        raise ValueError(
            f"local_rank must be in [0, {count}) for the {count} visible {kind} device(s), got {local_rank}; "
            "run at most one process per device"
        )
    return local_rank


def backend_for(device: torch.device | str) -> str:
    """The collective backend matching a device: gloo (cpu), nccl (cuda) or hccl (npu).

    Args:
        device (torch.device | str): the training device.

    Returns:
        str: the ``torch.distributed`` backend name.
    """
    # "npu" is not a torch device type until torch_npu is imported, so parse strings here.
    dev_type = device.split(":")[0] if isinstance(device, str) else device.type
    if dev_type not in _BACKENDS:
        raise ValueError(f"no collective backend known for device type {dev_type!r}; supported: cpu, cuda, npu")
    return _BACKENDS[dev_type]


def _device_module(device: torch.device) -> Any | None:
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        return getattr(torch, "npu", None)
    return None


def new_stream(device: torch.device | str) -> Any | None:
    """A new side stream on ``device``, or ``None`` where the device has no streams (CPU)."""
    device = torch.device(device)
    mod = _device_module(device)
    return None if mod is None else mod.Stream(device=device)


def current_stream(device: torch.device | str) -> Any | None:
    """The current stream of ``device``, or ``None`` on CPU."""
    device = torch.device(device)
    mod = _device_module(device)
    return None if mod is None else mod.current_stream(device)


@contextlib.contextmanager
def stream_context(stream: Any | None) -> Iterator[None]:
    """Run the body on ``stream``; a no-op for ``None`` (CPU)."""
    if stream is None:
        yield
        return
    mod = torch.cuda if "cuda" in type(stream).__module__ else getattr(torch, "npu", None)
    if mod is None:
        raise ValueError(f"cannot enter a stream of type {type(stream).__name__}")
    with mod.stream(stream):
        yield
