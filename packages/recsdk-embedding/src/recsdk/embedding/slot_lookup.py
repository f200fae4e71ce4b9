"""``recsdk::pruned_slots_lookup``: FBGEMM's ``pruned_hashmap_lookup``, prefetching, as a torch op.

Serving looks the raw ids of every table up in one call over the tables' slots laid end to end
(FBGEMM's layout, :mod:`~recsdk.embedding.slot_kernels`). FBGEMM's CPU lookup probes id after id,
one dependent cache miss each (18-23 ns an id in 22 MB of slots); ``slot_lookup.c`` computes each
id's home slot and prefetches it 32 ids before probing it, and returns the same rows, about twice
as fast. It is plain C, built and cached as the slot kernels are (``$CC``, ``RECSDK_CACHE_DIR``;
off with ``RECSDK_NATIVE_KERNELS=0``), called through ctypes (the GIL is released for the lookup)
and checked on a small table before use.

Importing this module defines the torch op ``torch.ops.recsdk.pruned_slots_lookup`` (the schema
and result of ``torch.ops.fbgemm.pruned_hashmap_lookup``, int64 only), so TorchScript can call
it; where the kernel is unavailable (:func:`native_lookup_unavailable_reason` says why) the op
calls FBGEMM's lookup. Import it before ``torch.jit.load`` of a script that calls the op.

Example::

    from recsdk.embedding.slot_lookup import native_lookup_available

    slots = torch.full((8, 2), -1, dtype=torch.int64)
    slots[3] = torch.tensor([42, 7])  # only where 42's home slot is 3
    rows = torch.ops.recsdk.pruned_slots_lookup(ids, offsets, slots, torch.tensor([0, 8]))
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from recsdk.embedding.slot_kernels import _ENV_SWITCH, _built

__all__ = [
    "OP_NAME",
    "lookup_tables",
    "native_lookup_available",
    "native_lookup_unavailable_reason",
    "pruned_slots_lookup",
]

OP_NAME = "recsdk::pruned_slots_lookup"
"""The op's qualified name (``torch.ops.recsdk.pruned_slots_lookup``)."""

_SOURCE = Path(__file__).with_name("slot_lookup.c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGS = ("ids", "offsets", "slots", "slot_offsets")
_Kernel = Callable[..., int]  # the ctypes function slots_lookup_tables


def lookup_tables(
    ids: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor, slot_offsets: torch.Tensor
) -> torch.Tensor:
    """FBGEMM's ``pruned_hashmap_lookup(ids, offsets, slots, slot_offsets)`` on recsdk's kernel.

    With ``T = slot_offsets.numel() - 1`` tables and ``B = (offsets.numel() - 1) // T`` bags per
    table, bag ``b`` (ids ``offsets[b]:offsets[b + 1]``) is looked up in table ``b // B``, whose
    slots are ``slots[slot_offsets[t]:slot_offsets[t + 1]]``. Reads only.

    Args:
        ids (torch.Tensor): int64 ``[n]`` raw ids.
        offsets (torch.Tensor): int64 ``[T * B + 1]``, rising within ``[0, n]`` (entries past
            ``T * B`` are not read).
        slots (torch.Tensor): int64 ``[S, 2]``, every table's (key, row) slots end to end.
        slot_offsets (torch.Tensor): int64 ``[T + 1]``, rising within ``[0, S]``.

    Returns:
        torch.Tensor: int64 ``[n]``: the row stored with each id, as stored; ``-1`` where its
        table does not hold it (the id ``-1`` included); the id itself where its table has no
        slots. Ids outside ``offsets[0]:offsets[T * B]`` are left unwritten (as FBGEMM's).

    Raises:
        RuntimeError: the kernel is unavailable (:func:`native_lookup_unavailable_reason`).
        TypeError: an argument is not a contiguous int64 CPU tensor.
        ValueError: a shape is wrong, or ``offsets`` / ``slot_offsets`` are out of range
            (checked before any id is read).

    Example::

        rows = lookup_tables(values, offsets, slots, slot_offsets)  # == FBGEMM's rows
    """
    kernel, why = _load()
    if kernel is None:
        raise RuntimeError(f"recsdk's table lookup is unavailable: {why}")
    return _lookup(kernel, ids, offsets, slots, slot_offsets)


def pruned_slots_lookup(
    indices: torch.Tensor, offsets: torch.Tensor, hash_table: torch.Tensor, hash_table_offsets: torch.Tensor
) -> torch.Tensor:
    """The op's CPU kernel: :func:`lookup_tables` (inputs made contiguous), or FBGEMM's
    ``pruned_hashmap_lookup`` where recsdk's kernel is unavailable.

    Args:
        indices, offsets, hash_table, hash_table_offsets (torch.Tensor): as ``ids``, ``offsets``,
            ``slots``, ``slot_offsets`` of :func:`lookup_tables`.

    Returns:
        torch.Tensor: int64 ``[n]`` rows, as FBGEMM's lookup returns them.

    Example::

        rows = torch.ops.recsdk.pruned_slots_lookup(values, offsets, slots, slot_offsets)
    """
    kernel, _ = _load()
    if kernel is None:
        return torch.ops.fbgemm.pruned_hashmap_lookup(indices, offsets, hash_table, hash_table_offsets)
    return _lookup(
        kernel, indices.contiguous(), offsets.contiguous(), hash_table.contiguous(), hash_table_offsets.contiguous()
    )


def native_lookup_available() -> bool:
    """Whether recsdk's kernel is built and checked (else the op runs FBGEMM's lookup)."""
    return _load()[0] is not None


def native_lookup_unavailable_reason() -> str | None:
    """Why recsdk's kernel is unavailable (None: it is in use)."""
    return _load()[1]


def _lookup(
    kernel: _Kernel, ids: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor, slot_offsets: torch.Tensor
) -> torch.Tensor:
    for name, t in zip(_ARGS, (ids, offsets, slots, slot_offsets), strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lookup_tables: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(
                f"lookup_tables: {name} must be a contiguous int64 CPU tensor, got {t.dtype} on {t.device}"
                f"{'' if t.is_contiguous() else ' (not contiguous)'}"
            )
    for name, t in zip(_ARGS, (ids, offsets, slots, slot_offsets), strict=True):
        if t.dim() != (2 if name == "slots" else 1) or (name == "slots" and t.shape[1] != 2):
            want = "[num_slots, 2]" if name == "slots" else "1-d"
            raise ValueError(f"lookup_tables: {name} must be {want}, got shape {list(t.shape)}")
    num_tables = slot_offsets.numel() - 1
    if num_tables < 1:
        raise ValueError("lookup_tables: slot_offsets must hold at least 2 entries (one table)")
    batch = (offsets.numel() - 1) // num_tables
    if batch < 1:
        raise ValueError(f"lookup_tables: offsets of {offsets.numel()} entries hold no bag for {num_tables} tables")
    rows = torch.empty_like(ids)
    code = kernel(
        ids.data_ptr(),
        ids.numel(),
        offsets.data_ptr(),
        num_tables,
        batch,
        slots.data_ptr(),
        slots.shape[0],
        slot_offsets.data_ptr(),
        rows.data_ptr(),
    )
    if code == -1:
        raise ValueError(f"lookup_tables: offsets must rise within [0, {ids.numel()}] (the ids)")
    if code == -2:
        raise ValueError(f"lookup_tables: slot_offsets must rise within [0, {slots.shape[0]}] (the slots)")
    return rows


@functools.lru_cache(maxsize=1)
def _load() -> tuple[_Kernel | None, str | None]:
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        return None, f"{_ENV_SWITCH}=0"
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler found ($CC, cc, gcc)"
    try:
        kernel = ctypes.CDLL(str(_built(compiler, _SOURCE))).slots_lookup_tables
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        return None, f"building {_SOURCE.name} with {compiler} failed: {e}"
    kernel.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR]
    kernel.restype = _I64
    why = _self_check(kernel)
    return (kernel, None) if why is None else (None, why)


def _self_check(kernel: _Kernel) -> str | None:
    """Two tables of 3 bags: one of 4 slots (stored: 5 -> 0 at its home, 9 -> 1 a slot after its
    home; a row stored below 0 comes back as stored), one without slots (ids pass through)."""
    slots = torch.full((4, 2), -1, dtype=torch.int64)
    for key, row in ((5, 0), (9, 1), (12, -2)):
        s = _home(key, 4)
        while int(slots[s, 0]) != -1:
            s = (s + 1) % 4
        slots[s] = torch.tensor([key, row])
    ids = torch.tensor([5, 9, 7, -1, 12, 5, 9, -1], dtype=torch.int64)
    offsets = torch.tensor([0, 2, 2, 5, 6, 6, 8], dtype=torch.int64)
    rows = _lookup(kernel, ids, offsets, slots, torch.tensor([0, 4, 4], dtype=torch.int64))
    expected = [0, 1, -1, -1, -2, 5, 9, -1]
    if rows.tolist() != expected:
        return f"{_SOURCE.name} failed its self-check (rows {rows.tolist()}, expected {expected})"
    return None


def _home(key: int, num_slots: int) -> int:
    """MurmurHash3's 64-bit finaliser of ``key`` modulo ``num_slots``, as the kernels compute it."""
    mask = (1 << 64) - 1
    h = key & mask
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & mask
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & mask
    h ^= h >> 33
    return h % num_slots


def _meta(
    indices: torch.Tensor, offsets: torch.Tensor, hash_table: torch.Tensor, hash_table_offsets: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(indices)


def _register() -> torch.library.Library:
    lib = torch.library.Library("recsdk", "FRAGMENT")
    lib.define(
        "pruned_slots_lookup(Tensor indices, Tensor offsets, Tensor hash_table, Tensor hash_table_offsets) -> Tensor"
    )
    lib.impl("pruned_slots_lookup", pruned_slots_lookup, "CPU")
    lib.impl("pruned_slots_lookup", _meta, "Meta")
    return lib


# The op lasts as long as this reference. Defined once per process: a reload of this module runs
# in the same globals and keeps the first registration.
if not hasattr(torch.ops.recsdk, "pruned_slots_lookup"):
    _LIBRARY = _register()
