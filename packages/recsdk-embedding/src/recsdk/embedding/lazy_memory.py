"""``lazy_zeros``: per-row arrays that cost memory only where rows are used."""

from __future__ import annotations

import mmap

import torch

__all__ = ["lazy_zeros"]


def lazy_zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(n, dtype=dtype, device=device)``; on CPU, no page of it is resident until written.

    On CPU the tensor lies in an anonymous memory map, whose pages the OS provides, zeroed, when
    first touched (``torch.zeros`` would write, and so hold, every page at once).

    Args:
        n (int): number of elements.
        dtype (torch.dtype): element type.
        device (torch.device): where the tensor lives.

    Returns:
        torch.Tensor: ``[n]`` zeros.
    """
    if device.type != "cpu":
        return torch.zeros(n, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, max(n, 1) * dtype.itemsize), dtype=dtype)[:n]
