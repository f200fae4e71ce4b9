"""Multi-process helpers for tests and examples: spawn ranks on CPU with gloo.

Every distributed test in recsdk goes through :func:`run_distributed`, so that ports,
process-group timeouts and failure propagation are handled in one place: a failure on one
rank is raised in the caller with that rank's traceback, and the other ranks are stopped,
never left hanging.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from recsdk.data.batch import Batch

__all__ = ["DistributedTestError", "build_wheel_files", "free_port", "rank_slice", "run_distributed"]


class DistributedTestError(RuntimeError):
    """Raised by :func:`run_distributed` when a rank fails or the ranks time out."""


_PRELOAD = ["torch", "torch.distributed", "torchrec", "fbgemm_gpu"]
# After one rank fails, how long the others get to report their own errors (a loaded 2-core
# machine can take seconds) before they are killed.
_FAILURE_GRACE_S = 30.0


def free_port() -> int:
    """A free TCP port on localhost (bound once, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # Every rank's connections are up before any rank can finish and tear its own down.
        dist.barrier()
        try:
            out = fn(rank, world_size, *args)
            try:
                # Finish together, so no rank closes its connections under a peer's last
                # collective. If a peer failed, this fails fast (its connections are closed);
                # this rank's own result stands.
                dist.barrier()
            except RuntimeError:
                pass
        finally:
            dist.destroy_process_group()
        # Plain pickle: tensors travel by value (the queue's own pickler would share them
        # through file descriptors that die with this process).
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes over gloo.

    Each process joins a gloo process group on a free localhost port (timeout
    ``timeout_s``) with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set, so code under test can
    create further groups with ``dist.new_group``. Thread settings are ``fn``'s to make
    (torchrun would give each of several ranks per host one intra-op thread), or the
    environment's: the ranks fork from a forkserver started with the caller's environment, so a
    test suite's ``conftest.py`` that sets ``OMP_NUM_THREADS=1`` before torch is imported (as
    recsdk-sharding's and recsdk-pipeline's do) gives every rank one thread, and 2 to 4 ranks on
    a small machine do not each run an OpenMP pool that spins against the others' (a rank's step
    took 3 to 4 times as long on 2 cores).

    Args:
        fn (Callable): a picklable function ``fn(rank, world_size, *args)``; its return
            value must be picklable.
        world_size (int): number of ranks (>= 1).
        *args: extra arguments passed to every rank.
        timeout_s (float): process-group timeout and overall deadline, in seconds.
        start_method (str): ``"forkserver"`` (default: ranks fork from a clean server that
            has torch and torchrec imported, so they start fast and never inherit the
            caller's thread pools), ``"spawn"``, or ``"fork"`` (only safe while the caller
            has not run torch ops: forking after OpenMP work can hang the child).

    Returns:
        list: the return values of ``fn``, indexed by rank.

    Raises:
        DistributedTestError: a rank raised (its traceback is included), exited without
            a result, or the ranks did not finish within the deadline.

    Example::

        def _check(rank, world_size):
            t = torch.tensor([rank])
            dist.all_reduce(t)
            return int(t)

        assert run_distributed(_check, 2) == [1, 1]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, timeout_s, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s + 30.0
    grace_deadline: float | None = None
    try:
        while len(outputs) + len(failures) < world_size:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            try:
                rank, ok, payload = results.get(timeout=min(0.5, limit - now))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and r not in outputs and r not in failures and p.exitcode not in (0, None)
                ]
                for r in dead:
                    failures[r] = f"rank {r} exited with code {procs[r].exitcode} before reporting a result"
                if failures and grace_deadline is None:
                    grace_deadline = time.monotonic() + _FAILURE_GRACE_S
                continue
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                if grace_deadline is None:
                    grace_deadline = time.monotonic() + _FAILURE_GRACE_S
    finally:
        for p in procs:
            p.join(timeout=5.0 if not failures else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise DistributedTestError(f"{len(failures)} of {world_size} ranks failed:\n{text}")
    if len(outputs) < world_size:
        missing = sorted(set(range(world_size)) - set(outputs))
        raise DistributedTestError(f"ranks {missing} did not finish within {timeout_s:.0f}s (+30s grace)")
    return [outputs[r] for r in range(world_size)]


def build_wheel_files(package_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> list[str]:
    """Build the wheel of one recsdk package and list the files it holds.

    Used by each package's packaging test, so that a broken ``recsdk`` namespace (a stray
    ``recsdk/__init__.py``, a file outside ``recsdk/<name>/``) can never ship.

    Args:
        package_dir: the package's folder, e.g. ``packages/recsdk-data``.
        out_dir: where the wheel is written.

    Returns:
        list[str]: the archive names in the wheel, ``*.dist-info`` entries included.
    """
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    out = Path(out_dir)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*pip, "-w", str(out), str(package_dir)], check=True)
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {out}, found {[w.name for w in wheels]}")
    with zipfile.ZipFile(wheels[0]) as zf:
        return zf.namelist()


def rank_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank ``rank``'s contiguous share of a global batch: its ``B / world_size`` samples, the
    ids of every feature with them (how the tests give each rank its part of one global batch).

    Args:
        batch (Batch): the global batch.
        rank (int): the rank.
        world_size (int): the ranks sharing it (``B`` a multiple of it).

    Returns:
        Batch: samples ``[rank * B / world_size, (rank + 1) * B / world_size)``.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    b = batch.labels.numel() // world_size
    lo, hi = rank * b, (rank + 1) * b
    per_key = batch.sparse_features.to_dict()
    lengths, values = [], []
    for key in batch.sparse_features.keys():
        jt = per_key[key]
        lengths.append(jt.lengths()[lo:hi])
        values.append(jt.values()[jt.offsets()[lo] : jt.offsets()[hi]])
    kjt = KeyedJaggedTensor(keys=batch.sparse_features.keys(), values=torch.cat(values), lengths=torch.cat(lengths))
    return Batch(batch.dense_features[lo:hi], kjt, batch.labels[lo:hi])
