"""The host thread of the hybrid pipeline: one worker that runs host stages in order."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from recsdk.sharding import PeerFailureError

__all__ = ["HostStageError", "HostWorker"]

T = TypeVar("T")


class HostStageError(PeerFailureError):
    """A host stage or the data iterator failed on another rank, or an earlier stage failed here.

    The rank where a host stage (or its data iterator) raised re-raises that exception
    itself; the other ranks raise this error at the same ``progress()`` call, so every rank
    stops at the same step. The message names the failed ranks and their errors. A
    :class:`~recsdk.sharding.PeerFailureError` (a ``RuntimeError``), as the sharded modules'
    own agreements raise: ``except PeerFailureError`` catches either.
    """


class _Failure:
    """The first exception a task raised; held by the worker, reached weakly by its thread.

    The exception's traceback holds the failed task's frames (and so its owner): the thread
    must not keep those alive.
    """

    __slots__ = ("__weakref__", "error")

    def __init__(self) -> None:
        self.error: BaseException | None = None


class _Queue:
    """What the worker's thread holds: the task queue, the setup to run, a way to the failure.

    Never the worker itself (nor its owner), so that dropping the worker ends the thread.
    """

    def __init__(self, setup: Callable[[], None] | None, failure: _Failure) -> None:
        self.tasks: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self.setup = setup
        self.failure = weakref.ref(failure)
        self.failed: str | None = None  # repr of the first failure, once there is one


class HostWorker:
    """A single background thread that runs submitted callables one at a time, in order.

    Host-group (gloo) collectives are matched by the order in which they are issued, so
    every rank must issue them from one thread, batch after batch. After the first
    failure the worker runs nothing more: later callables would issue their collectives
    out of step with the other ranks. Their futures fail with :class:`HostStageError`
    chained to the first error.

    The thread holds only the task queue and the task it runs, never the worker: once the
    worker is garbage-collected (or the interpreter exits) the thread ends after the task
    it is running, even without :meth:`close`. A queued callable keeps what it references
    (e.g. a bound method keeps its object) alive until it has run, and ``setup`` until it
    has run once.

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
        self._failure = _Failure()
        self._queue = _Queue(setup, self._failure)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        # Collected without close(): tell the thread to stop (never blocks, whichever thread runs it).
        self._finalizer = weakref.finalize(self, self._queue.tasks.put, None)

    @property
    def failure(self) -> BaseException | None:
        """The first exception a task raised on this worker, if any."""
        return self._failure.error

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def thread(self) -> threading.Thread | None:
        """The worker's thread, once the first task was submitted."""
        return self._thread

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; the thread starts on the first call.

        Raises:
            RuntimeError: the worker is closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: the host worker is closed")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_serve, args=(self._name, self._queue), name=self._name, daemon=True
                )
                self._thread.start()
            future: Future[T] = Future()
            self._queue.tasks.put((future, fn, args))
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
                self._finalizer()  # queues the stop, once
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return thread is None
        thread.join(timeout)
        return not thread.is_alive()


def _serve(name: str, state: _Queue) -> None:
    """The worker thread: run ``state``'s tasks in order until the stop (``None``) arrives."""
    setup, state.setup = state.setup, None
    if setup is not None:
        try:
            setup()
        except BaseException as e:
            _record_failure(state, e)
        del setup
    while True:
        item = state.tasks.get()
        if item is None:
            return
        future, fn, args = item
        # Hold no task while waiting for the next one: its callable may keep its owner alive.
        del item
        try:
            if not future.set_running_or_notify_cancel():
                continue
            if state.failed is not None:
                skipped = HostStageError(f"{name}: not run, an earlier host stage failed: {state.failed}")
                box = state.failure()
                skipped.__cause__ = None if box is None else box.error
                future.set_exception(skipped)
                del skipped, box
                continue
            try:
                result = fn(*args)
            except BaseException as e:
                _record_failure(state, e)
                future.set_exception(e)
            else:
                future.set_result(result)
                del result
        finally:
            del future, fn, args


def _record_failure(state: _Queue, error: BaseException) -> None:
    if state.failed is None:
        state.failed = repr(error)
        box = state.failure()
        if box is not None:
            box.error = error
