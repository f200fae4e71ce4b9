"""recsdk's native kernels of the id table: over FBGEMM's pruned-hashmap slots, lookup, insert and
a remove that leaves no tombstone; and the admission count-min sketch's read and update.

FBGEMM's CPU kernels (``pruned_hashmap_lookup`` / ``pruned_hashmap_insert``) have no remove, so
an id table that evicts marks its removed ids' slots dead, and under churn the dead slots pile up
until a rehash: in a table that evicts every step, lookups ran 5x slower than in a fresh one.
``slot_kernels.c`` works on the same layout (so FBGEMM's lookup, which serving's TorchScript
modules call, reads what it writes) and deletes by shifting the probe run back, so the probes stay
as short as the live load makes them. Each kernel prefetches the home slot of the id 16 places
ahead while it probes the current one, and finds home slots without a division. The sketch's
kernels (:meth:`SlotKernels.sketch_read`, :meth:`SlotKernels.sketch_raise`) compute in one call
what :class:`~recsdk.embedding.count_sketch.CountMinSketch` does in about 15 torch ops.

The source is plain C, compiled on first use with the system's C compiler (``$CC``, else ``cc``)
into a per-user cache (``$RECSDK_CACHE_DIR``, else ``~/.cache/recsdk``, keyed by the source and
the machine), loaded with ctypes (which releases the GIL for each call) and checked on a small
table before use. Where no compiler is found, the build fails or ``RECSDK_NATIVE_KERNELS=0`` is
set, :func:`native_slot_kernels` returns None and the index keeps to FBGEMM's kernels
(:func:`native_unavailable_reason` says why).

Example::

    kernels = native_slot_kernels()
    if kernels is not None:
        slots = torch.full((11, 2), -1, dtype=torch.int64)
        kernels.insert(slots, torch.tensor([7, 42]), torch.tensor([0, 1]))
        kernels.lookup(slots, torch.tensor([42, 5]))  # (tensor([1, -1]), 1)
        kernels.remove(slots, torch.tensor([7]))  # 1
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from recsdk.embedding.hashing import fmix64
from recsdk.embedding.oldest_rows import RowsInUse

__all__ = ["SlotKernels", "native_slot_kernels", "native_unavailable_reason"]

_SOURCE = Path(__file__).with_name("slot_kernels.c")
_ENV_SWITCH = "RECSDK_NATIVE_KERNELS"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_QUEUE_BAD_ROW = -(2**63)  # the queue kernels' answer for a row outside the per-row arrays


class SlotKernels:
    """The compiled kernels, over FBGEMM's slots: a contiguous int64 ``[num_slots, 2]`` CPU tensor.

    Every method takes contiguous int64 CPU tensors (the index's own, and ids it has checked) and
    holds no reference to them after it returns.

    Args:
        lib (ctypes.CDLL): the loaded library.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lookup = lib.slots_lookup
        self._lookup.argtypes = [_PTR, _I64, _PTR, _I64, _PTR]
        self._lookup.restype = _I64
        self._insert = lib.slots_insert
        self._insert.argtypes = [_PTR, _PTR, _I64, _PTR, _I64]
        self._insert.restype = _I64
        self._remove = lib.slots_remove
        self._remove.argtypes = [_PTR, _I64, _PTR, _I64]
        self._remove.restype = _I64
        self._sketch_read = {torch.int32: lib.sketch_read_int32, torch.int64: lib.sketch_read_int64}
        self._sketch_raise = {torch.int32: lib.sketch_raise_int32, torch.int64: lib.sketch_raise_int64}
        for fn in self._sketch_read.values():
            fn.argtypes, fn.restype = [_PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR], None
        for fn in self._sketch_raise.values():
            fn.argtypes, fn.restype = [_PTR, _I64, _I64, _PTR, _PTR, _I64], _I64
        queue: list[type[ctypes._SimpleCData[Any]]] = [_PTR, _I64, _I64, _PTR, _PTR, ctypes.c_int8, _I64, _PTR, _PTR]
        queue += [ctypes.c_int, _I64]
        self._queue_free_rows = lib.queue_free_rows
        self._queue_free_rows.argtypes, self._queue_free_rows.restype = queue, _I64
        self._queue_take = lib.queue_take
        self._queue_take.argtypes, self._queue_take.restype = [*queue, _I64, _PTR], _I64

    def lookup(self, slots: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Rows of ``ids [n]`` (``-1`` where absent), and how many are absent. Reads only."""
        _check(slots, ids)
        rows = torch.empty_like(ids)
        missing = self._lookup(ids.data_ptr(), ids.numel(), slots.data_ptr(), slots.shape[0], rows.data_ptr())
        return rows, int(missing)

    def insert(self, slots: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``ids [n]`` at ``rows [n]`` (an id already stored gets its new row)."""
        _check(slots, ids, rows)
        if rows.numel() != ids.numel():
            raise ValueError(f"slot kernels: {ids.numel()} ids but {rows.numel()} rows")
        unplaced = self._insert(ids.data_ptr(), rows.data_ptr(), ids.numel(), slots.data_ptr(), slots.shape[0])
        if unplaced:
            raise ValueError(f"slot kernels: {unplaced} ids found no empty slot among {slots.shape[0]} (a full table)")

    def remove(self, slots: torch.Tensor, ids: torch.Tensor) -> int:
        """Remove ``ids [n]`` without leaving tombstones; returns how many were stored."""
        _check(slots, ids)
        return int(self._remove(ids.data_ptr(), ids.numel(), slots.data_ptr(), slots.shape[0]))

    def sketch_read(
        self, ids: torch.Tensor, salts: torch.Tensor, width: int, counters: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A count-min sketch's counter positions and estimates of ``ids`` (what
        :meth:`~recsdk.embedding.count_sketch.CountMinSketch.positions` and ``estimate`` compute in
        torch ops). Reads only.

        Args:
            ids (torch.Tensor): int64 ``[n]``.
            salts (torch.Tensor): int64 ``[k]``, one per sketch row.
            width (int): counters per row (>= 1).
            counters (torch.Tensor): int32 or int64 ``[k * width]``.

        Returns:
            tuple: int64 positions ``[k, n]`` and the estimates ``[n]`` (the counters' dtype).
        """
        k = _sketch_args(salts, width, counters, ids)
        positions = torch.empty((k, ids.numel()), dtype=torch.int64)
        estimate = torch.empty(ids.numel(), dtype=counters.dtype)
        self._sketch_read[counters.dtype](
            ids.data_ptr(),
            ids.numel(),
            salts.data_ptr(),
            k,
            width,
            counters.data_ptr(),
            positions.data_ptr(),
            estimate.data_ptr(),
        )
        return positions, estimate

    def sketch_raise(self, positions: torch.Tensor, new_counts: torch.Tensor, counters: torch.Tensor) -> None:
        """Raise each id's counters (``positions [k, n]``) to at least ``new_counts [n]`` (the
        counters' dtype): the sketch's conservative update. Positions outside the counters raise
        ``ValueError`` before any counter changes."""
        _check_arrays(positions)
        if counters.dtype not in self._sketch_raise or new_counts.dtype != counters.dtype:
            raise TypeError(f"sketch_raise: counts {new_counts.dtype} for {counters.dtype} counters (int32 or int64)")
        _check_arrays(new_counts, counters, dtype=counters.dtype)
        if positions.dim() != 2 or positions.shape[1] != new_counts.numel():
            raise ValueError(f"sketch_raise: positions {list(positions.shape)} for {new_counts.numel()} counts")
        k, n = positions.shape
        code = self._sketch_raise[counters.dtype](
            positions.data_ptr(), n, k, new_counts.data_ptr(), counters.data_ptr(), counters.numel()
        )
        if code:
            raise ValueError(f"sketch_raise: a position lies outside the {counters.numel()} counters")

    def queue_free_rows(self, rows: torch.Tensor, in_use: RowsInUse, threshold: int, occupied: int) -> int:
        """How many of the queued ``rows`` (int64 ``[q]``) may go now (reads only), as
        :class:`~recsdk.embedding.oldest_rows.OldestRows` decides: queued rows stay while their last
        step is below ``threshold`` and their state is ``occupied``."""
        return self._queue_call(self._queue_free_rows, rows, in_use, threshold, occupied)

    def queue_take(
        self, rows: torch.Tensor, in_use: RowsInUse, threshold: int, occupied: int, count: int
    ) -> tuple[torch.Tensor | None, int]:
        """Take ``count`` rows that may go from the queue ``rows`` (int64 ``[q]``, compacted in place).

        Returns:
            tuple: the victims (int64 ``[count]``: those below the last one's last step in
            ascending row order, then its ties in ascending row order), or None when fewer may
            go; and how many rows stay queued (the first ones of ``rows``).
        """
        out = torch.empty(count, dtype=torch.int64)
        kept = self._queue_call(self._queue_take, rows, in_use, threshold, occupied, count, out.data_ptr())
        return (out, kept) if kept >= 0 else (None, -1 - kept)

    @staticmethod
    def _queue_call(fn: Any, rows: torch.Tensor, q: RowsInUse, threshold: int, occupied: int, *extra: int) -> int:
        _check_arrays(rows)
        per_row = [(q.last_step, torch.int32), (q.row_state, torch.int8), (q.batch, torch.bool)]
        if q.pins is not None:
            per_row.append((q.pins, torch.int32))
        for t, dtype in per_row:
            _check_arrays(t, dtype=dtype)
        limit = min(t.numel() for t, _ in per_row)
        pins = 0 if q.pins is None else q.pins.data_ptr()
        since = 0 if q.since is None else q.since
        code = fn(
            rows.data_ptr(),
            rows.numel(),
            limit,
            q.last_step.data_ptr(),
            q.row_state.data_ptr(),
            occupied,
            threshold,
            q.batch.data_ptr(),
            pins,
            q.since is not None,
            since,
            *extra,
        )
        if code == _QUEUE_BAD_ROW:
            raise ValueError(f"queue of oldest rows: a queued row lies outside the {limit} rows of its per-row arrays")
        return int(code)


def _sketch_args(salts: torch.Tensor, width: int, counters: torch.Tensor, ids: torch.Tensor) -> int:
    """Check :meth:`SlotKernels.sketch_read`'s arguments; returns the sketch's rows."""
    _check_arrays(ids, salts)
    if counters.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"sketch_read: counters must be int32 or int64, got {counters.dtype}")
    _check_arrays(counters, dtype=counters.dtype)
    k = salts.numel()
    if isinstance(width, bool) or not isinstance(width, int) or width < 1 or k < 1 or counters.numel() != k * width:
        raise ValueError(f"sketch_read: {counters.numel()} counters for {k} rows of width {width!r}")
    return k


def _check_arrays(*arrays: torch.Tensor, dtype: torch.dtype = torch.int64) -> None:
    """Refuse anything but contiguous CPU tensors of ``dtype`` (the kernels read raw memory)."""
    for t in arrays:
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(
                f"slot kernels: need contiguous {dtype} CPU tensors, got {t.dtype} on {t.device}"
                f"{'' if t.is_contiguous() else ' (not contiguous)'}"
            )


def _check(slots: torch.Tensor, *arrays: torch.Tensor) -> None:
    """The kernels read raw memory: refuse anything but contiguous int64 CPU tensors (slots ``[m, 2]``)."""
    if slots.dim() != 2 or slots.shape[1] != 2 or slots.shape[0] < 1:
        raise ValueError(f"slot kernels: slots must be [num_slots >= 1, 2], got {list(slots.shape)}")
    _check_arrays(slots, *arrays)


def native_slot_kernels() -> SlotKernels | None:
    """The kernels, compiled and checked once per process; None where unavailable."""
    kernels, _ = _load()
    return kernels


def native_unavailable_reason() -> str | None:
    """Why :func:`native_slot_kernels` is None (None: the kernels are in use)."""
    _, why = _load()
    return why


@functools.lru_cache(maxsize=1)
def _load() -> tuple[SlotKernels | None, str | None]:
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        return None, f"{_ENV_SWITCH}=0"
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler found ($CC, cc, gcc)"
    try:
        kernels = SlotKernels(ctypes.CDLL(str(_built(compiler))))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building {_SOURCE.name} with {compiler} failed: {e}"
    why = _self_check(kernels)
    return (kernels, None) if why is None else (None, why)


def _built(compiler: str, source_path: Path = _SOURCE) -> Path:
    """The compiled library of ``source_path`` (plain C) in the cache, built first if it is not
    there (atomically: ranks that start together may build at once; each renames a finished file
    into place)."""
    source = source_path.read_bytes()
    key = hashlib.sha256(source + platform.machine().encode() + compiler.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("RECSDK_CACHE_DIR") or Path.home() / ".cache" / "recsdk")
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.access(cache, os.W_OK):
            raise PermissionError(f"{cache} is not writable")
    except OSError:
        cache = Path(tempfile.mkdtemp(prefix="recsdk-"))
    target = cache / f"{source_path.stem}-{key}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        cmd = [compiler, "-O3", "-std=c99", "-shared", "-fPIC", "-o", tmp, str(source_path)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _self_check(kernels: SlotKernels) -> str | None:
    """Insert, look up and remove on a small table, against the expected rows (a compiler that
    builds something else is not trusted)."""
    slots = torch.full((7, 2), -1, dtype=torch.int64)
    ids = torch.tensor([3, -5, 2**63 - 1, 10, 17, -(2**63)], dtype=torch.int64)
    kernels.insert(slots, ids, torch.arange(6, dtype=torch.int64))
    removed = kernels.remove(slots, ids[1::2].contiguous())
    rows, missing = kernels.lookup(slots, ids)
    expected = torch.tensor([0, -1, 2, -1, 4, -1])
    if removed != 3 or missing != 3 or not torch.equal(rows, expected):
        return f"{_SOURCE.name} failed its self-check (rows {rows.tolist()}, expected {expected.tolist()})"
    salts = torch.tensor([0x6A09E667F3BCC908, -0x61C8864680B583EB], dtype=torch.int64)
    counters = torch.arange(10, dtype=torch.int32)
    positions, estimate = kernels.sketch_read(ids, salts, 5, counters)
    hashed = fmix64(ids, salts.unsqueeze(1)).bitwise_and_(2**63 - 1).remainder_(5)
    if not torch.equal(positions, hashed + torch.tensor([[0], [5]])) or not torch.equal(estimate, hashed[0].int()):
        return f"{_SOURCE.name} failed its self-check (sketch positions {positions.tolist()})"
    return None
