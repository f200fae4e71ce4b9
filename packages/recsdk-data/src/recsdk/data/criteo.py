"""A streaming reader for Criteo Kaggle / Terabyte TSV files."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from recsdk.data._checks import check_bool, check_choice, check_int, check_paths
from recsdk.data.batch import Batch
from recsdk.data.criteo_fields import ON_BAD_LINE, CriteoRows
from recsdk.data.criteo_tsv import BadLines, read_criteo_tsv
from recsdk.data.partition import check_rank_and_world_size, current_shard
from recsdk.data.read_position import ReadPosition

__all__ = ["CriteoDataset"]


class _RowPool:
    """Rows waiting to be batched: in order, or drawn at random from a buffer of ``shuffle_buffer`` rows or more.

    In order, the added blocks are held as they are (from row ``start`` of the first) and
    :meth:`pop` returns views of them; only rows that span two blocks are copied. Shuffled, held
    rows sit at ``[0, size)`` of preallocated arrays, so adding a block writes only its own rows;
    when the arrays run out of room, the held rows move to new arrays of at least twice the rows
    needed, and :meth:`pop` returns copies.
    """

    def __init__(self, shuffle_buffer: int, rng: np.random.Generator | None) -> None:
        self._shuffle_buffer = shuffle_buffer
        self._rng = rng
        self._buffer: CriteoRows | None = None
        self._blocks: deque[CriteoRows] = deque()  # in order
        self._start = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, rows: CriteoRows) -> None:
        """Append ``rows`` after the held rows."""
        n = len(rows)
        if n == 0:
            return
        if self._rng is None:
            self._blocks.append(rows)
            self._size += n
            return
        if self._buffer is None or self._start + self._size + n > len(self._buffer):
            self._reallocate(rows, n)
        assert self._buffer is not None
        end = self._start + self._size
        for dst, src in zip(self._buffer.arrays(), rows.arrays(), strict=True):
            dst[end : end + n] = src
        self._size += n

    def _reallocate(self, like: CriteoRows, n: int) -> None:
        """Move the held rows to the front of new arrays of at least ``2 * (size + n)`` rows shaped like ``like``.

        Always new arrays, never a move in place: batches popped in order are views of the old ones.
        """
        capacity = 2 * (self._size + n)
        if self._buffer is None:
            self._buffer = like.empty(capacity)
        else:
            held = self._buffer.take(slice(self._start, self._start + self._size))
            self._buffer = held.empty(max(capacity, len(self._buffer)))
            for dst, src in zip(self._buffer.arrays(), held.arrays(), strict=True):
                dst[: self._size] = src
        self._start = 0

    def ready(self, batch_size: int) -> bool:
        return self._size >= self._shuffle_buffer + batch_size if self._rng is not None else self._size >= batch_size

    def pop(self, k: int) -> CriteoRows:
        """Take ``k`` rows: the first ``k`` in order, or ``k`` drawn at random."""
        assert 0 < k <= self._size
        if self._rng is None:
            return self._pop_in_order(k)
        assert self._buffer is not None
        size = self._size
        chosen = self._rng.choice(size, size=k, replace=False)
        out = self._buffer.take(chosen)
        # Fill the holes below size - k with the unchosen rows from the tail.
        tail = np.ones(k, dtype=np.bool_)
        tail[chosen[chosen >= size - k] - (size - k)] = False
        holes = np.sort(chosen[chosen < size - k])
        fillers = np.flatnonzero(tail) + (size - k)
        for arr in self._buffer.arrays():
            arr[holes] = arr[fillers]
        self._size -= k
        return out

    def _pop_in_order(self, k: int) -> CriteoRows:
        """The first ``k`` held rows: a view of the first block, or a copy where they span blocks."""
        pieces = []
        self._size -= k
        while k:
            block = self._blocks[0]
            m = min(k, len(block) - self._start)
            pieces.append(block.take(slice(self._start, self._start + m)))
            self._start += m
            k -= m
            if self._start == len(block):
                self._blocks.popleft()
                self._start = 0
        return CriteoRows.concat(pieces)

    def drain(self) -> CriteoRows | None:
        """All held rows (in a random order when shuffling), emptying the pool; ``None`` if empty."""
        if self._size == 0:
            return None
        if self._rng is None:
            return self._pop_in_order(self._size)
        assert self._buffer is not None
        rows = self._buffer.take(slice(self._start, self._start + self._size))
        rows = rows.take(self._rng.permutation(self._size))
        self._buffer, self._start, self._size = None, 0, 0
        return rows


class CriteoDataset(IterableDataset[Batch]):
    """Batches from Criteo Kaggle / Terabyte TSV files, streamed with constant memory.

    Each line is ``label \\t I1..I13 \\t C1..C26``: a 0/1 label, 13 decimal integers and
    26 hex categorical values; any integer or categorical field may be empty. Files may
    be plain or gzip-compressed (``.gz``). Parsing is vectorised (pyarrow's streaming CSV
    reader, block by block, and whole-column conversions), so memory stays bounded by the
    block size and the shuffle buffer, however large the files.

    * Dense features: ``log(1 + max(x, 0))`` of each integer column, 0 when empty;
      float32 ``[B, 13]``.
    * Sparse features ``cat_0`` ... ``cat_25``: each hex value (up to 16 digits, either
      case) is the raw id, read as an unsigned 64-bit number and reinterpreted as signed
      int64, without remapping. An empty field gives that feature an empty bag.
    * Labels: float32 ``[B]``.

    **Sharding.** Line ``L`` (1-based, counted across ``paths`` in order) belongs to
    rank ``(L - 1) % world_size``; DataLoader workers split their rank's lines
    round-robin (see :func:`recsdk.data.current_shard`). Every reader parses all lines
    but converts and yields only its own, so ranks and workers never overlap, and a rank
    reads the same lines with or without workers. Ranks may get one batch more or fewer
    than each other.

    **Bad lines** (wrong number of fields, a label other than 0/1, an integer field that
    is not a decimal integer, an invalid or over-long hex value; an empty line has no
    label and is bad too): with ``on_bad_line="error"`` the reader raises a
    ``ValueError`` naming the file and line; with ``"skip"`` it drops them and counts them
    in :attr:`bad_lines`. Each reader checks only its own shard's lines, so the counts of
    all shards add up to the file's bad lines. :attr:`bad_lines` restarts at 0 with each
    iteration and counts in the process that iterates (a DataLoader worker's count stays
    in that worker).

    **Shuffling.** ``shuffle_buffer > 0`` keeps that many rows in a buffer and fills each
    batch with rows drawn at random from it, seeded by ``(seed, epoch, shard)``; call
    :meth:`set_epoch` for a new order each epoch. ``0`` keeps the file order.

    Args:
        paths (str | os.PathLike | Sequence): one file or a list, read in order. Missing
            files raise ``FileNotFoundError`` here, before any batch.
        batch_size (int): rows per batch (>= 1).
        rank (int | None): this rank; ``None`` asks ``torch.distributed`` at iteration
            (0 when it is not initialised). Give both or neither.
        world_size (int | None): number of ranks, like ``rank``.
        shuffle_buffer (int): rows in the shuffle buffer (>= 0).
        seed (int): seed of the shuffle (>= 0).
        drop_last (bool): drop the last, partial batch of each reader.
        on_bad_line (str): ``"error"`` or ``"skip"``.
        block_size (int): bytes the CSV reader parses at a time (>= 1024).

    Example::

        write_synthetic_criteo("train.tsv.gz", num_lines=100_000)
        ds = CriteoDataset("train.tsv.gz", batch_size=1024, shuffle_buffer=10_000)
        for batch in DataLoader(ds, batch_size=None, num_workers=2):
            ...  # dense [1024, 13], KJT cat_0..cat_25 of raw int64 ids, labels [1024]
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_buffer: int = 0,
        seed: int = 0,
        drop_last: bool = False,
        on_bad_line: str = "error",
        block_size: int = 1 << 22,
    ) -> None:
        super().__init__()
        self.paths = check_paths(paths)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        check_rank_and_world_size(rank, world_size)
        self.rank, self.world_size = rank, world_size
        self.shuffle_buffer = check_int("shuffle_buffer", shuffle_buffer, minimum=0)
        self.seed = check_int("seed", seed, minimum=0)
        self.drop_last = check_bool("drop_last", drop_last)
        self.on_bad_line = check_choice("on_bad_line", on_bad_line, ON_BAD_LINE)
        self.block_size = check_int("block_size", block_size, minimum=1024)
        self.epoch = 0
        self.bad_lines = 0
        self._first_line = 0  # data lines read before this split (an elastic resume): nobody's
        self._position = ReadPosition("CriteoDataset", self._position_identity)

    def set_epoch(self, epoch: int) -> None:
        """Use a different shuffle order for ``epoch`` (no effect without a shuffle buffer)."""
        epoch = check_int("epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self._first_line = 0  # an elastic resume's split holds for its own epoch
        self.epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        return self._position.replay(self._batches())

    def state_dict(self) -> dict[str, Any]:
        """This reader's position: the epoch and the batches of it yielded, with what they depend
        on (files, batch size, shuffle, this rank's and DataLoader worker's shard). torchdata's
        ``StatefulDataLoader`` convention."""
        return {"epoch": self.epoch, "first_line": self._first_line, **self._position.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the next iteration after the batches ``state`` (from :meth:`state_dict`) had
        yielded: the epoch's lines are parsed again up to there (the shuffle replays exactly), and
        the batches after them are yielded.

        **Elastic resume.** A state of another shard count (another world size) continues with the
        lines the saving shards had not read, dealt to the new shards: the saving shards read in
        lockstep (ranks training together), ``batch_size`` lines a batch each, so together the
        first ``first_line + num_shards * batches_read * batch_size`` lines of the data. Every
        line is then read once across the restart. It needs the file order (``shuffle_buffer=0``)
        and no bad line skipped before the save (a skipped line makes its shard read further).

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: ``state`` is of a reader over other files, batch size, shuffle or shard
                (every difference named); an elastic resume with a shuffle buffer.
        """
        if not (isinstance(state, dict) and "epoch" in state):
            self._position.load_state_dict(state)  # raises, naming what is wrong
            return
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        first_line = check_int("state['first_line']", state.get("first_line", 0), minimum=0)
        position = {k: v for k, v in state.items() if k not in ("epoch", "first_line")}
        if self._position.is_resharded(position):
            problems = []
            if self.shuffle_buffer:
                problems.append(f"shuffle_buffer {self.shuffle_buffer}: an elastic resume needs the file order (0)")
            batches = self._position.load_resharded(position, problems)
            self.epoch, self._first_line = epoch, first_line + batches * self.batch_size
            return
        self._position.load_state_dict(position)
        self.epoch, self._first_line = epoch, first_line

    def _position_identity(self) -> dict[str, Any]:
        shard, num_shards = current_shard(self.rank, self.world_size)
        return {
            "paths": [str(p) for p in self.paths],
            "batch_size": self.batch_size,
            "shuffle_buffer": self.shuffle_buffer,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "shard": shard,
            "num_shards": num_shards,
        }

    def _batches(self) -> Iterator[Batch]:
        shard, num_shards = current_shard(self.rank, self.world_size)
        self.bad_lines = 0
        rng = None
        if self.shuffle_buffer > 0:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.epoch, shard])))
        pool = _RowPool(self.shuffle_buffer, rng)
        bad_lines = BadLines(self.on_bad_line)
        line_offset = 0
        for path in self.paths:
            progress = {"lines": 0}
            blocks = read_criteo_tsv(
                path,
                path,
                bad_lines,
                block_size=self.block_size,
                shard=shard,
                num_shards=num_shards,
                line_offset=line_offset,
                first_line=self._first_line,
                progress=progress,
            )
            for rows in blocks:
                self.bad_lines = bad_lines.count
                pool.add(rows)
                while pool.ready(self.batch_size):
                    yield pool.pop(self.batch_size).to_batch()
            self.bad_lines = bad_lines.count
            line_offset += progress["lines"]
        rest = pool.drain()
        if rest is not None:
            for start in range(0, len(rest), self.batch_size):
                part = rest.take(slice(start, start + self.batch_size))
                if len(part) == self.batch_size or not self.drop_last:
                    yield part.to_batch()
        self._first_line = 0  # the epoch is read: the next one starts at its first line
