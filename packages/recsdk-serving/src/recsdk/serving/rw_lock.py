"""``ReadWriteLock``: many forwards at once, or one version being applied."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["ReadWriteLock"]


class ReadWriteLock:
    """Readers share the lock; a writer holds it alone. A waiting writer goes before readers that
    come after it, so a steady stream of forwards never starves a version's application.

    Example::

        lock = ReadWriteLock()
        with lock.reading():  # a forward
            ...
        with lock.writing():  # applying a version
            ...
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the lock shared (several readers at once)."""
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the lock alone (no reader, no other writer)."""
        with self._cond:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
