"""The host thread of the hybrid pipeline: one worker that runs host stages in order."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["HostStageError", "HostWorker"]

T = TypeVar("T")


class HostStageError(RuntimeError):
    """The host stage of a batch failed on another rank, or an earlier stage failed here.

    The rank where a host stage raised re-raises that exception itself; the other ranks
    raise this error for the same batch, so every rank stops at the same step.
    """


class HostWorker:
    """A single background thread that runs submitted callables one at a time, in order.

    Host-group (gloo) collectives are matched by the order in which they are issued, so
    every rank must issue them from one thread, batch after batch. After the first
    failure the worker runs nothing more: later callables would issue their collectives
    out of step with the other ranks. Their futures fail with :class:`HostStageError`
    chained to the first error.

    Args:
        name (str): the thread's name.
        setup (Callable[[], None] | None): run once on the thread before the first task
            (e.g. selecting the accelerator, whose current device is per thread).

    Example::

        worker = HostWorker("host")
        future = worker.submit(sum, [1, 2])
        assert future.result() == 3
        worker.close()
    """

    def __init__(self, name: str, setup: Callable[[], None] | None = None) -> None:
        self._name = name
        self._setup = setup
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._failure: BaseException | None = None

    @property
    def failure(self) -> BaseException | None:
        """The first exception a task raised on this worker, if any."""
        return self._failure

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; the thread starts on the first call.

        Raises:
            RuntimeError: the worker is closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: the host worker is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            future: Future[T] = Future()
            self._tasks.put((future, fn, args))
            return future

    def close(self, timeout: float | None = 10.0) -> bool:
        """Stop the thread once the queued tasks have run (or been skipped).

        Args:
            timeout (float | None): seconds to wait for the thread; ``None`` waits forever.

        Returns:
            bool: whether the thread has ended (a task blocked in a collective may outlive
            ``timeout``; the thread is a daemon, so it never holds the process open).
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._tasks.put(None)
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return thread is None
        thread.join(timeout)
        return not thread.is_alive()

    def _run(self) -> None:
        setup_error: BaseException | None = None
        if self._setup is not None:
            try:
                self._setup()
            except BaseException as e:
                setup_error = e
        while True:
            item = self._tasks.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            if setup_error is not None and self._failure is None:
                self._failure = setup_error
            if self._failure is not None:
                skipped = HostStageError(f"{self._name}: not run, an earlier host stage failed: {self._failure!r}")
                skipped.__cause__ = self._failure
                future.set_exception(skipped)
                continue
            try:
                result = fn(*args)
            except BaseException as e:
                self._failure = e
                future.set_exception(e)
            else:
                future.set_result(result)
