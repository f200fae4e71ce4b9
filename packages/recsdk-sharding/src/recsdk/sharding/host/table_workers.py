"""``TableWorkers``: the threads that map one batch's tables at once.

The host stage maps each table's ids in that table's own :class:`~recsdk.embedding.IdTable`, and
tables share no state, so the tables of a batch can be mapped at the same time. FBGEMM's and
torch's CPU kernels release the GIL, so on a host with spare cores the tables' kernels run in
parallel while the Python between them takes turns on the GIL. A table's work is the same
whichever thread runs it, so the results do not depend on the number of threads.

Duties of the caller: it holds the lock that guards the tables around :meth:`TableWorkers.run`
(the workers act on its behalf; nothing else touches the tables meanwhile), and gives each table
to one task. Every task runs to its end, also when another fails: :meth:`TableWorkers.run`
returns each task's result or exception, in the tasks' order, so the caller can keep what the
tables did before it raises.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["MAX_DEFAULT_HOST_THREADS", "TableWorkers", "default_host_threads"]

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741

MAX_DEFAULT_HOST_THREADS = 8  # past this, a step's 26 tables gain little: the GIL-held part remains


def default_host_threads(device: torch.device | None) -> int:
    """The threads a sharded module maps its tables with, unless its sharder says otherwise.

    On a CPU device, one: the lookups and the host stage share the cores already. On an
    accelerator, the cores this process may use divided among the host's ranks
    (``LOCAL_WORLD_SIZE``, as torchrun sets it), at most :data:`MAX_DEFAULT_HOST_THREADS`.

    Args:
        device (torch.device | None): the module's lookup device (``None``: the CPU).

    Returns:
        int: at least 1.
    """
    if device is None or device.type in ("cpu", "meta"):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(MAX_DEFAULT_HOST_THREADS, cores // local_ranks))


class TableWorkers:
    """Runs one task per table, on up to ``threads`` threads (the calling thread is one of them).

    With one thread (or one task) the tasks run in the calling thread, in order; otherwise a pool
    of ``threads - 1`` threads, started at the first use, runs all but the first task.

    Args:
        threads (int): how many tables are mapped at once (>= 1).
        name (str): the pool threads' name prefix (thread dumps, profilers).

    Example::

        workers = TableWorkers(4)
        with stage.lock:
            outcomes = workers.run(map_table, list(segments.items()))  # results or exceptions
    """

    def __init__(self, threads: int, name: str = "recsdk-tables") -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"host_threads must be an int >= 1, got {threads!r}")
        self._threads = threads
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def threads(self) -> int:
        """How many tables are mapped at once."""
        return self._threads

    def run(self, task: Callable[[I], T], items: Sequence[I]) -> list[T | Exception]:
        """``task(item)`` for every item; each result, or the exception it raised, in ``items``' order.

        Args:
            task (Callable): the work of one table.
            items (Sequence): one item per table.

        Returns:
            list: per item, what ``task`` returned or the ``Exception`` it raised.
        """
        if self._threads == 1 or len(items) < 2:
            return [_outcome(task, item) for item in items]
        pool = self._ensure_pool()
        futures = [pool.submit(_outcome, task, item) for item in items[1:]]
        first = _outcome(task, items[0])
        return [first, *(f.result() for f in futures)]

    def run_all(self, task: Callable[[I], T], items: Sequence[I]) -> list[T]:
        """As :meth:`run`, raising the first task's exception (in ``items``' order) once all are done.

        Returns:
            list: per item, what ``task`` returned.
        """
        outcomes = self.run(task, items)
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
        return outcomes  # type: ignore[return-value]  # no exception among them

    def close(self) -> None:
        """Stop the pool's threads (a later :meth:`run` starts them again)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _ensure_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._threads - 1, thread_name_prefix=self._name)
            return self._pool

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


def _outcome(task: Callable[[I], T], item: I) -> T | Exception:
    try:
        return task(item)
    except Exception as e:  # handed to the caller, which raises it once every table is done
        return e
