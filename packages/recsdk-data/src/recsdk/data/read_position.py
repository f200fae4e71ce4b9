"""``ReadPosition``: the ``state_dict()`` / ``load_state_dict()`` of a reader that replays exactly.

A reader whose batches follow from its arguments alone (``RandomRecDataset`` from its seeds,
``CriteoDataset`` and ``ParquetRecDataset`` from their files, the shuffle from its seed) resumes
by counting: its state is how many batches it has yielded this epoch, with what that count
depends on (the data, the batch size, this reader's shard of ranks and DataLoader workers), and
a reader that loads it yields the batches after those. A file reader produces the skipped
batches again and drops them (the price of an exact resume without an index into its files);
``RandomRecDataset`` skips without generating them. The convention is torchdata's
``StatefulDataLoader``: with workers, each worker's copy keeps and restores its own state.

Duties of a reader using it: call :meth:`ReadPosition.start` when an epoch's iteration begins
(it returns the batches to skip) and :meth:`ReadPosition.advance` just before each batch it
yields (a state taken while the consumer holds a batch counts it), or wrap its batches in
:meth:`ReadPosition.replay`; give, in ``identity``, everything the count depends on (a bound
method: a reader pickled into a DataLoader worker carries its position).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from recsdk.data._checks import check_int

__all__ = ["ReadPosition"]

T = TypeVar("T")


class ReadPosition:
    """How far a reader has yielded in its current epoch, and its saved and restored form.

    Args:
        reader (str): the reader's class name, for errors.
        identity (Callable[[], dict]): what the position depends on (compared at load).

    Example::

        self._position = ReadPosition("CriteoDataset", lambda: {"paths": ..., "batch_size": ...})
        def __iter__(self):
            yield from self._position.replay(self._batches())
        def state_dict(self):
            return self._position.state_dict()
    """

    def __init__(self, reader: str, identity: Callable[[], dict[str, Any]]) -> None:
        self._reader = reader
        self._identity = identity
        self.batches_read = 0
        self._resume_at = 0

    def reset(self) -> None:
        """No batch yielded yet, nothing to skip (a reader that re-split its data, e.g. an elastic resume)."""
        self.batches_read = self._resume_at = 0

    def start(self) -> int:
        """An epoch's iteration begins: the batches to skip (a loaded position, else 0)."""
        skip, self._resume_at = self._resume_at, 0
        self.batches_read = skip
        return skip

    def advance(self) -> None:
        """One more batch yielded."""
        self.batches_read += 1

    def replay(self, batches: Iterator[T]) -> Iterator[T]:
        """``batches`` (the epoch from its start) without those a loaded position already yielded."""
        skip = self.start()
        for i, batch in enumerate(batches):
            if i < skip:
                continue
            self.advance()  # before the yield: a state taken once the batch is out counts it
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """``{"batches_read": n, **identity}``: the position after the batches yielded so far."""
        return {"batches_read": self.batches_read, **self._identity()}

    def differences(self, state: dict[str, Any], ignore: tuple[str, ...] = ()) -> list[str]:
        """What in ``state`` differs from this reader's identity (but ``ignore``), described."""
        mine = self.state_dict()
        return [
            f"{key} {state[key]!r} (this reader: {mine[key]!r})"
            for key in mine
            if key != "batches_read" and key not in ignore and state[key] != mine[key]
        ]

    def is_resharded(self, state: object) -> bool:
        """Whether ``state`` was saved by a reader of another number of shards (another world size)."""
        return (
            isinstance(state, dict) and "num_shards" in state and state["num_shards"] != self.state_dict()["num_shards"]
        )

    def load_resharded(self, state: dict[str, Any], problems: list[str] | None = None) -> int:
        """Load a state of another number of shards (an elastic resume): nothing to skip in this
        shard's new order; the batches every saving shard together had yielded, which read in
        lockstep (``num_shards * batches_read``), for the reader to start after.

        Args:
            state (dict): from :meth:`state_dict` of one of the saving readers.
            problems (list[str] | None): the reader's own reasons to refuse it, if any.

        Raises:
            ValueError: ``state`` is of other data (every difference named, but the shard), or
                ``problems``.
        """
        differ = self.differences(state, ignore=("shard", "num_shards")) + list(problems or [])
        if differ:
            raise ValueError(f"state is of another {self._reader}: {', '.join(differ)}")
        read = check_int("state['batches_read']", state["batches_read"], minimum=0)
        num_shards = check_int("state['num_shards']", state["num_shards"], minimum=1)
        self.reset()
        return num_shards * read

    def load_state_dict(self, state: dict[str, Any], ignore: tuple[str, ...] = ()) -> None:
        """Continue the next iteration after the batches ``state`` had yielded (``ignore``: keys
        of the identity that may differ).

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: a key is missing, or ``state`` is of a reader over other data, batch
                size or shard (every difference named).
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from {self._reader}.state_dict(), got {type(state).__name__}")
        mine = self.state_dict()
        missing = [key for key in mine if key not in state]
        if missing:
            raise ValueError(f"state is missing {missing}; expected a dict from {self._reader}.state_dict()")
        differ = self.differences(state, ignore)
        if differ:
            raise ValueError(f"state is of another {self._reader}: {', '.join(differ)}")
        self._resume_at = check_int("state['batches_read']", state["batches_read"], minimum=0)
        self.batches_read = self._resume_at
