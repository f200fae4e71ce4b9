"""A streaming reader for Criteo Kaggle / Terabyte TSV files, and a synthetic file writer."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import torch
from torch.utils.data import IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data._checks import check_bool, check_choice, check_int, check_paths
from recsdk.data._synthetic import hash_gaussian, power_law_indices, scrambled_ids, seed_words
from recsdk.data.batch import Batch
from recsdk.data.partition import check_rank_and_world_size, current_shard

__all__ = [
    "CRITEO_DENSE_COLUMNS",
    "CRITEO_SPARSE_FEATURES",
    "CriteoDataset",
    "write_synthetic_criteo",
]

CRITEO_DENSE_COLUMNS = [f"int_{i}" for i in range(13)]
CRITEO_SPARSE_FEATURES = [f"cat_{i}" for i in range(26)]
_COLUMNS = ["label", *CRITEO_DENSE_COLUMNS, *CRITEO_SPARSE_FEATURES]
ON_BAD_LINE = ("error", "skip")
# A dense value is an optional '-' and 1 to 19 decimal digits that fit int64 (checked by _fits_int64).
_INT_RE = r"^-?[0-9]{1,19}$"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_U = np.uint64


@dataclass
class _Rows:
    """Parsed Criteo rows: labels ``[n]``, dense ``[n, 13]``, ids and presence ``[n, 26]``."""

    labels: npt.NDArray[np.float32]
    dense: npt.NDArray[np.float32]
    ids: npt.NDArray[np.int64]
    present: npt.NDArray[np.bool_]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def arrays(self) -> tuple[npt.NDArray[Any], ...]:
        """The four arrays, in field order."""
        return (self.labels, self.dense, self.ids, self.present)

    def take(self, index: npt.NDArray[np.int64] | slice) -> _Rows:
        return _Rows(self.labels[index], self.dense[index], self.ids[index], self.present[index])

    def empty(self, n: int) -> _Rows:
        """``n`` uninitialised rows with these rows' dtypes and widths."""
        return _Rows(*(np.empty((n, *a.shape[1:]), dtype=a.dtype) for a in self.arrays()))

    def to_batch(self) -> Batch:
        present_t = self.present.T
        kjt = KeyedJaggedTensor(
            keys=list(CRITEO_SPARSE_FEATURES),
            values=torch.from_numpy(np.ascontiguousarray(self.ids.T[present_t])),
            lengths=torch.from_numpy(present_t.reshape(-1).astype(np.int32)),
            stride=len(self),
        )
        return Batch(
            dense_features=torch.from_numpy(np.ascontiguousarray(self.dense)),
            sparse_features=kjt,
            labels=torch.from_numpy(np.ascontiguousarray(self.labels)),
        )


def _hex_lanes_to_uint32(lanes: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Values of 8 valid hex characters per little-endian uint64 lane (first character most significant)."""
    # Nibble of each byte: '0'-'9' -> c & 0xF; 'a'-'f' / 'A'-'F' (bit 6 set) -> (c & 0xF) + 9.
    x = (lanes & _U(0x0F0F0F0F0F0F0F0F)) + ((lanes >> _U(6)) & _U(0x0101010101010101)) * _U(9)
    # Gather the 8 nibbles into one 32-bit number, most significant first.
    x = ((x & _U(0x000F000F000F000F)) << _U(4)) | ((x >> _U(8)) & _U(0x000F000F000F000F))
    x = ((x & _U(0x000000FF000000FF)) << _U(8)) | ((x >> _U(16)) & _U(0x000000FF000000FF))
    return ((x & _U(0xFFFF)) << _U(16)) | ((x >> _U(32)) & _U(0xFFFF))


def parse_hex_ids(column: pa.Array) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Parse a string column of hex ids, vectorised.

    Each value of 1 to 16 hex digits (either case) is read as an unsigned 64-bit number
    and reinterpreted as a signed int64 (``"ffffffffffffffff"`` is -1).

    Args:
        column (pa.Array): strings; nulls and empty strings are missing values.

    Returns:
        tuple: ``(ids, present, bad)``, each of shape ``[n]``: the int64 ids (0 where
        missing or bad), whether a valid value is present, whether the value is not
        valid hex.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not pa.types.is_string(column.type):
        raise TypeError(f"parse_hex_ids expects a string column, got Arrow type {column.type}")
    n = len(column)
    ids = np.zeros(n, dtype=np.uint64)
    if n == 0:
        return ids.view(np.int64), np.zeros(0, dtype=np.bool_), np.zeros(0, dtype=np.bool_)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=column.offset + n + 1)[column.offset :]
    data_buf = column.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    raw_lengths = np.diff(offsets)
    lengths = (
        raw_lengths
        if column.null_count == 0
        else np.where(column.is_valid().to_numpy(zero_copy_only=False), raw_lengths, 0)
    )
    present = lengths > 0
    bad = lengths > 16
    rows = np.flatnonzero(present & ~bad)
    m = rows.size
    if m == 0:
        return ids.view(np.int64), present & ~bad, bad
    width = 8 if int(lengths[rows].max()) <= 8 else 16
    if width == 8 and int(raw_lengths.sum()) == 8 * m and bool((lengths[rows] == 8).all()):
        # Every value has 8 digits and nothing else is stored (Criteo Kaggle): a plain reshape.
        chars = data[offsets[0] : offsets[-1]].reshape(m, 8)
    else:
        # The `width` bytes ending at each value's end; bytes before its start become '0'.
        ends = offsets[1:][rows].astype(np.int64)
        window = ends[:, None] + np.arange(-width, 0, dtype=np.int64)
        chars = data[np.maximum(window, 0)]
        chars[window < (ends - lengths[rows])[:, None]] = ord("0")
    ok = ((chars - np.uint8(48)) < 10) | (((chars | np.uint8(32)) - np.uint8(97)) < 6)
    if not ok.all():
        row_bad = ~ok.all(axis=1)
        bad[rows[row_bad]] = True
        chars = np.where(row_bad[:, None], np.uint8(48), chars)
    lanes = np.ascontiguousarray(chars).view("<u8")
    halves = _hex_lanes_to_uint32(lanes)
    ids[rows] = halves[:, 0] if width == 8 else (halves[:, 0] << _U(32)) | halves[:, 1]
    return ids.view(np.int64), present & ~bad, bad


def _fits_int64(text: str) -> bool:
    return _INT64_MIN <= int(text) <= _INT64_MAX


def _only_short_decimals(column: pa.Array) -> bool:
    """True when every stored byte is a digit or '-' and no value is longer than 19 bytes.

    For such a column, a successful int64 cast means every value matches ``_INT_RE`` and fits int64.
    """
    n = len(column)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=column.offset + n + 1)[column.offset :]
    if n and int(np.diff(offsets).max()) > 19:
        return False
    data_buf = column.buffers()[2]
    if data_buf is None:
        return True
    data = np.frombuffer(data_buf, dtype=np.uint8)[offsets[0] : offsets[-1]]
    return bool((((data - np.uint8(48)) < 10) | (data == ord("-"))).all())


def _parse_ints(column: pa.Array) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Decimal integers of a string column: ``(values with nulls as 0, bad)``.

    A value is valid when it matches ``_INT_RE`` and fits int64, whatever else is in the column:
    the fast path (one cast) is taken only where it decides exactly as the per-value check.
    """
    if _only_short_decimals(column):
        try:
            values = pc.cast(column, pa.int64())
            bad = np.zeros(len(column), dtype=np.bool_)
            return pc.fill_null(values, 0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False), bad
        except pa.ArrowInvalid:
            pass
    ok = np.array(pc.fill_null(pc.match_substring_regex(column, _INT_RE), True).to_numpy(zero_copy_only=False))
    lengths = pc.fill_null(pc.binary_length(column), 0).to_numpy(zero_copy_only=False)
    for i in np.flatnonzero(ok & (lengths >= 19)):  # only these can overflow int64
        ok[i] = _fits_int64(column[int(i)].as_py())
    values = pc.cast(pc.if_else(pa.array(ok), column, pa.scalar(None, pa.string())), pa.int64())
    return pc.fill_null(values, 0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False), ~ok


def _parse_table(table: pa.RecordBatch) -> tuple[_Rows, npt.NDArray[np.bool_]]:
    """Convert string columns to rows; ``bad`` marks rows with a bad field (those rows hold zeros)."""
    n = table.num_rows
    label = table.column("label")
    ones = pc.fill_null(pc.equal(label, "1"), False).to_numpy(zero_copy_only=False)
    zeros = pc.fill_null(pc.equal(label, "0"), False).to_numpy(zero_copy_only=False)
    bad = ~(ones | zeros)
    raw = np.empty((n, len(CRITEO_DENSE_COLUMNS)), dtype=np.int64)
    for j, name in enumerate(CRITEO_DENSE_COLUMNS):
        raw[:, j], col_bad = _parse_ints(table.column(name))
        bad |= col_bad
    dense = np.log1p(np.maximum(raw, 0).astype(np.float64)).astype(np.float32)
    ids = np.empty((n, len(CRITEO_SPARSE_FEATURES)), dtype=np.int64)
    present = np.empty((n, len(CRITEO_SPARSE_FEATURES)), dtype=np.bool_)
    for j, name in enumerate(CRITEO_SPARSE_FEATURES):
        ids[:, j], present[:, j], col_bad = parse_hex_ids(table.column(name))
        bad |= col_bad
    return _Rows(ones.astype(np.float32), dense, ids, present), bad


class _RowPool:
    """Rows waiting to be batched: in order, or drawn at random from a buffer of ``shuffle_buffer`` rows or more.

    Held rows sit at ``[start, start + size)`` of preallocated arrays, so adding a block writes
    only its own rows; when the arrays run out of room, the held rows move to new arrays of at
    least twice the rows needed. In order, :meth:`pop` returns views and moves ``start`` on (popped
    rows are never written again). Shuffled, ``start`` stays 0 and :meth:`pop` returns copies.
    """

    def __init__(self, shuffle_buffer: int, rng: np.random.Generator | None) -> None:
        self._shuffle_buffer = shuffle_buffer
        self._rng = rng
        self._buffer: _Rows | None = None
        self._start = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, rows: _Rows) -> None:
        """Append ``rows`` after the held rows."""
        n = len(rows)
        if n == 0:
            return
        if self._buffer is None or self._start + self._size + n > len(self._buffer):
            self._reallocate(rows, n)
        assert self._buffer is not None
        end = self._start + self._size
        for dst, src in zip(self._buffer.arrays(), rows.arrays(), strict=True):
            dst[end : end + n] = src
        self._size += n

    def _reallocate(self, like: _Rows, n: int) -> None:
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

    def pop(self, k: int) -> _Rows:
        """Take ``k`` rows: the first ``k`` in order, or ``k`` drawn at random."""
        assert self._buffer is not None and 0 < k <= self._size
        if self._rng is None:
            out = self._buffer.take(slice(self._start, self._start + k))
            self._start += k
            self._size -= k
            return out
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

    def drain(self) -> _Rows | None:
        """All held rows (in a random order when shuffling), emptying the pool; ``None`` if empty."""
        if self._buffer is None or self._size == 0:
            return None
        rows = self._buffer.take(slice(self._start, self._start + self._size))
        if self._rng is not None:
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

    def set_epoch(self, epoch: int) -> None:
        """Use a different shuffle order for ``epoch`` (no effect without a shuffle buffer)."""
        self.epoch = check_int("epoch", epoch, minimum=0)

    def __iter__(self) -> Iterator[Batch]:
        shard, num_shards = current_shard(self.rank, self.world_size)
        self.bad_lines = 0
        rng = None
        if self.shuffle_buffer > 0:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.epoch, shard])))
        pool = _RowPool(self.shuffle_buffer, rng)
        line_offset = 0
        for path in self.paths:
            progress = {"lines": 0}
            for rows in self._read_file(path, line_offset, shard, num_shards, progress):
                pool.add(rows)
                while pool.ready(self.batch_size):
                    yield pool.pop(self.batch_size).to_batch()
            line_offset += progress["lines"]
        rest = pool.drain()
        if rest is not None:
            for start in range(0, len(rest), self.batch_size):
                part = rest.take(slice(start, start + self.batch_size))
                if len(part) == self.batch_size or not self.drop_last:
                    yield part.to_batch()

    def _bad_lines(
        self, path: Path, bad: list[tuple[int, str]], table: pa.RecordBatch | None, lines: npt.NDArray[np.int64]
    ) -> None:
        """Raise for the first bad line (``on_bad_line="error"``) or count them all."""
        if self.on_bad_line == "skip":
            self.bad_lines += len(bad)
            return
        line, why = bad[0]
        if not why and table is not None:  # a field value: find which one
            why = _describe_bad_row(table, int(np.flatnonzero(lines == line)[0]))
        raise ValueError(f"{path}:{line}: bad Criteo line ({why}); pass on_bad_line='skip' to skip such lines")

    def _read_file(
        self, path: Path, line_offset: int, shard: int, num_shards: int, progress: dict[str, int]
    ) -> Iterator[_Rows]:
        """This shard's valid rows of one file, block by block; ``progress["lines"]`` gets its line count."""
        skipped: list[tuple[int, str]] = []  # (line, reason) of lines with a wrong field count

        def on_invalid(row: pa_csv.InvalidRow) -> str:
            if row.number is None:  # only with a threaded reader, which is not used here
                raise RuntimeError(f"{path}: pyarrow did not report the line number of a bad line")
            skipped.append((row.number, f"{row.actual_columns} fields, expected {row.expected_columns}"))
            return "skip"

        try:
            reader = pa_csv.open_csv(
                path,
                read_options=pa_csv.ReadOptions(column_names=_COLUMNS, block_size=self.block_size, use_threads=False),
                parse_options=pa_csv.ParseOptions(
                    delimiter="\t",
                    quote_char=False,
                    double_quote=False,
                    escape_char=False,
                    newlines_in_values=False,
                    ignore_empty_lines=False,
                    invalid_row_handler=on_invalid,
                ),
                convert_options=pa_csv.ConvertOptions(
                    column_types=dict.fromkeys(_COLUMNS, pa.string()),
                    null_values=[""],
                    strings_can_be_null=True,
                    quoted_strings_can_be_null=False,
                ),
            )
        except pa.ArrowInvalid as e:
            if "Empty CSV file" not in str(e):
                raise
            return  # an empty file has no lines
        except OSError as e:  # opening reads the first block: a truncated .gz can fail here
            raise _read_error(path, 0, e) from e

        next_line = 1  # first line of the next block
        done = 0  # entries of `skipped` already handled
        with reader:
            while True:
                try:
                    record_batch = reader.read_next_batch()
                except StopIteration:
                    break
                except OSError as e:  # e.g. pyarrow's bare "Truncated compressed stream"
                    raise _read_error(path, next_line - 1, e) from e
                n = record_batch.num_rows
                pending = sorted(skipped[done:])
                skip_lines = np.array([s for s, _ in pending], dtype=np.int64)
                r = np.arange(n, dtype=np.int64)
                # Good rows before each skipped line, then each row's line number.
                before = skip_lines - next_line - np.arange(skip_lines.size)
                lines = next_line + r + np.searchsorted(before, r, side="right")
                last_line = int(lines[-1]) if n else next_line - 1
                block_skips = [(s, why) for s, why in pending if n == 0 or s <= last_line]
                done += len(block_skips)
                if block_skips:
                    last_line = max(last_line, block_skips[-1][0])
                mine = ((lines + line_offset - 1) % num_shards) == shard
                table = record_batch
                if num_shards > 1:
                    table = table.take(pa.array(np.flatnonzero(mine)))
                    lines = lines[mine]
                rows, bad = _parse_table(table)
                # Bad lines of this shard, in file order.
                bad_here = [(int(line), "") for line in lines[bad]]
                bad_here += [(s, why) for s, why in block_skips if (s + line_offset - 1) % num_shards == shard]
                if bad_here:
                    self._bad_lines(path, sorted(bad_here), table, lines)
                next_line = last_line + 1
                yield rows.take(np.flatnonzero(~bad)) if bad.any() else rows
        tail = sorted(skipped[done:])  # bad lines after the last good row
        mine_tail = [(s, why) for s, why in tail if (s + line_offset - 1) % num_shards == shard]
        if mine_tail:
            self._bad_lines(path, mine_tail, table=None, lines=np.zeros(0, dtype=np.int64))
        if tail:
            next_line = max(next_line, tail[-1][0] + 1)
        progress["lines"] = next_line - 1


def _read_error(path: Path, lines_read: int, error: OSError) -> OSError:
    """``error`` (pyarrow's, which names no file) with the file and how far reading got.

    Keeps the ``OSError`` subclass where the error has an errno (``OSError(errno, message)``
    picks it, e.g. ``FileNotFoundError``).
    """
    message = f"{path}: {error} after {lines_read:,} rows (lines) of it were read; the file is cut short or corrupt"
    return OSError(error.errno, message) if error.errno is not None else OSError(message)


def _describe_bad_row(table: pa.RecordBatch, i: int) -> str:
    """Which field of row ``i`` is bad, for the error message."""
    row = {name: table.column(name)[i].as_py() for name in _COLUMNS}
    if row["label"] not in ("0", "1"):
        return f"label {row['label']!r} is not 0 or 1"
    for name in CRITEO_DENSE_COLUMNS:
        v = row[name]
        if v is not None and (re.fullmatch(_INT_RE, v) is None or not _fits_int64(v)):
            return f"{name} {v!r} is not a decimal integer"
    for name in CRITEO_SPARSE_FEATURES:
        v = row[name]
        if v is not None and re.fullmatch(r"[0-9a-fA-F]{1,16}", v) is None:
            return f"{name} {v!r} is not a hex id of 1 to 16 digits"
    return "bad field value"


# Vocabulary sizes of the synthetic categorical columns (a spread like Criteo Kaggle's).
_SYNTH_VOCAB = (
    1460, 583, 100_000, 50_000, 305, 24, 12_517, 633, 3, 93_145, 5_683, 80_000, 3_194,
    27, 14_992, 60_000, 10, 5_652, 2_173, 4, 70_000, 18, 15, 28_000, 105, 14_000,
)  # fmt: skip
_SYNTH_MISSING = (0.0, 0.0, 0.2, 0.2, 0.03, 0.2, 0.04, 0.0, 0.04, 0.45, 0.04, 0.75, 0.2)
_SYNTH_CAT_MISSING = 0.05
_TAG_SYNTH_IDS, _TAG_SYNTH_WEIGHTS, _TAG_SYNTH_ROWS = 0xC1, 0xC2, 0xC3
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _hex8_column(values: npt.NDArray[np.uint32], valid: npt.NDArray[np.bool_]) -> pa.StringArray:
    n = values.shape[0]
    shifts = np.arange(28, -1, -4, dtype=np.uint32)
    chars = _HEX_DIGITS[(values[:, None] >> shifts) & np.uint32(0xF)]
    offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
    return pa.StringArray.from_buffers(
        n,
        pa.py_buffer(offsets),
        pa.py_buffer(np.ascontiguousarray(chars).tobytes()),
        pa.py_buffer(np.packbits(valid, bitorder="little")),
        null_count=int(n - valid.sum()),
    )


def _synthetic_rows(
    rng: np.random.Generator, n: int, id_salts: npt.NDArray[np.uint64], w_salts: npt.NDArray[np.int64]
) -> pa.Table:
    ints = []
    for j, miss in enumerate(_SYNTH_MISSING):
        x = np.floor(rng.lognormal(mean=1.0 + 0.3 * (j % 5), sigma=1.2, size=n)).astype(np.int64)
        if j == 1:
            x -= 3  # like Criteo's I2, which holds small negatives
        ints.append((x, rng.random(n) >= miss))
    cats = []
    logit = np.full(n, -1.0)
    for j, vocab in enumerate(_SYNTH_VOCAB):
        idx = power_law_indices(rng, n, vocab, 1.1)
        raw = scrambled_ids(idx, id_salts[j]).view(np.uint64)
        ids = (raw & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        valid = rng.random(n) >= _SYNTH_CAT_MISSING
        if j < 6:  # the teacher reads six categorical columns ...
            w = 1.2 * hash_gaussian(ids.astype(np.int64), w_salts[j])
            logit += np.where(valid, w, 0.0)
        cats.append((ids, valid))
    for j in range(3):  # ... and three integer columns
        x, valid = ints[j]
        logit += np.where(valid, (0.5, -0.4, 0.3)[j] * (np.log1p(np.maximum(x, 0)) - 1.5), 0.0)
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    columns: dict[str, pa.Array] = {"label": pa.array(labels)}
    for name, (x, valid) in zip(CRITEO_DENSE_COLUMNS, ints, strict=True):
        columns[name] = pa.array(x, mask=~valid)
    for name, (ids, valid) in zip(CRITEO_SPARSE_FEATURES, cats, strict=True):
        columns[name] = _hex8_column(ids, valid)
    return pa.table(columns)


def write_synthetic_criteo(
    path: str | os.PathLike[str], num_lines: int, seed: int = 0, *, chunk_lines: int = 100_000
) -> Path:
    """Write a Criteo-format TSV file with learnable labels (gzip-compressed if ``path`` ends in ``.gz``).

    Integer columns are log-normal counts (column ``int_1`` also holds small negatives),
    each with its own missing rate; categorical columns are 8-digit lowercase hex ids,
    Zipf-distributed over a per-column vocabulary (3 to 100k values), 5% missing. The
    label is a Bernoulli draw from a hidden teacher over six categorical and three
    integer columns, so a model can learn it. The file is written ``chunk_lines`` at a
    time, vectorised; the same ``seed`` gives the same bytes.

    Args:
        path (str | os.PathLike): the file to write (parent folder must exist).
        num_lines (int): lines to write (>= 0).
        seed (int): seed of the content (>= 0).
        chunk_lines (int): lines generated per chunk (>= 1).

    Returns:
        Path: ``path``.

    Example::

        write_synthetic_criteo(tmp_path / "day_0.tsv", num_lines=10_000, seed=1)
    """
    check_int("num_lines", num_lines, minimum=0)
    check_int("seed", seed, minimum=0)
    check_int("chunk_lines", chunk_lines, minimum=1)
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"folder of {str(path)!r} does not exist")
    id_salts = seed_words(seed, _TAG_SYNTH_IDS, len(_SYNTH_VOCAB))
    w_salts = seed_words(seed, _TAG_SYNTH_WEIGHTS, len(_SYNTH_VOCAB)).view(np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _TAG_SYNTH_ROWS])))
    options = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    compression = "gzip" if path.suffix == ".gz" else None
    with pa.output_stream(path, compression=compression) as out:
        written = 0
        writer = None
        while written < num_lines:
            n = min(chunk_lines, num_lines - written)
            table = _synthetic_rows(rng, n, id_salts, w_salts)
            if writer is None:
                writer = pa_csv.CSVWriter(out, table.schema, write_options=options)
            writer.write_table(table)
            written += n
        if writer is not None:
            writer.close()
    return path
