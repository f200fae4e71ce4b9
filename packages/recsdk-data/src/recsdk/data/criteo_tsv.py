"""Parsing Criteo Kaggle / Terabyte TSV: blocks of lines to arrays of rows, with bad-line handling.

Shared by :class:`~recsdk.data.CriteoDataset` (which batches the rows) and the columnar
converter (:mod:`recsdk.data.convert`, which writes them to Arrow files): both parse a line
the same way and name a bad line by its file and line number.

The source is cut into blocks at line ends where pyarrow's streaming reader cuts them
(:mod:`recsdk.data.criteo_blocks`). A block is first parsed typed: label and integers as int64,
ids as 8 bytes (or strings, for a file whose ids are not all 8 digits), then a few whole-block
numpy passes; that is kept only where it read every field exactly as the per-value rules do
(:mod:`recsdk.data.criteo_typed`). Any other block (a bad field, a wrong field count, a leading
zero) is parsed again with every column as strings and each value checked alone
(:func:`recsdk.data.criteo_fields.parse_table`), which also names the bad lines. This module
walks the blocks: line numbers, shards, and what becomes of bad lines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from recsdk.data.criteo_blocks import blocks as source_blocks
from recsdk.data.criteo_fields import CriteoRows, describe_bad_row, parse_table
from recsdk.data.criteo_typed import BlockParser

__all__ = ["BadLines", "read_criteo_tsv"]

_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark, which pyarrow drops at the start of its input


class BadLines:
    """What to do with bad lines: raise for the first (``"error"``) or count them (``"skip"``).

    Args:
        on_bad_line (str): ``"error"`` or ``"skip"``.
        line_base (Callable[[], int] | None): the file's line number of the source's first line,
            asked only when an error names a line (a converter reading a byte range of a file
            counts the lines before it then); ``None``: the source starts the file.
    """

    def __init__(self, on_bad_line: str, line_base: Callable[[], int] | None = None) -> None:
        self.on_bad_line = on_bad_line
        self.count = 0
        self._line_base = line_base

    def handle(
        self, path: Path, bad: list[tuple[int, str]], table: pa.RecordBatch | None, lines: npt.NDArray[np.int64]
    ) -> None:
        """Raise for the first of ``bad`` (``(line, reason)`` in file order) or count them all."""
        if self.on_bad_line == "skip":
            self.count += len(bad)
            return
        line, why = bad[0]
        if not why and table is not None:  # a field value: find which one
            why = describe_bad_row(table, int(np.flatnonzero(lines == line)[0]))
        if self._line_base is not None:
            line += self._line_base() - 1
        raise ValueError(f"{path}:{line}: bad Criteo line ({why}); pass on_bad_line='skip' to skip such lines")


def read_criteo_tsv(
    source: Path | pa.NativeFile,
    path: Path,
    bad_lines: BadLines,
    *,
    block_size: int,
    shard: int = 0,
    num_shards: int = 1,
    line_offset: int = 0,
    first_line: int = 0,
    progress: dict[str, int] | None = None,
) -> Iterator[CriteoRows]:
    """One shard's valid rows of a TSV source, block by block.

    Line ``L`` of the source (1-based) is line ``g = L + line_offset - 1`` of the data (0-based);
    the lines before ``first_line`` belong to no shard, and line ``g >= first_line`` to shard
    ``(g - first_line) % num_shards``. Every line is parsed into fields, only the shard's own
    are checked.

    Args:
        source (Path | pa.NativeFile): a file path (plain or compressed, e.g. ``.gz``) or an open stream.
        path (Path): the file named in errors.
        bad_lines (BadLines): raises for or counts the shard's bad lines.
        block_size (int): bytes parsed at a time (a line may not be longer).
        shard (int): this reader's shard.
        num_shards (int): shards the lines are dealt to.
        line_offset (int): lines before this source (of earlier files).
        first_line (int): lines of the data already read (an elastic resume): nobody's.
        progress (dict[str, int] | None): when given, ``progress["lines"]`` is set to the
            source's line count once it is read to the end.

    Yields:
        CriteoRows: the valid rows of each block that belong to the shard, in line order.
    """
    parser = BlockParser()
    next_line = 1  # first line of the next block
    with contextlib.closing(source_blocks(source, path, block_size)) as blocks:
        while True:
            try:
                block = next(blocks, None)
            except OSError as e:  # e.g. pyarrow's bare "Truncated compressed stream", or a missing file
                raise _read_error(path, next_line - 1, e) from e
            if block is None:
                break
            data, start, end = block
            # A byte-order mark is dropped at the start of the source only: on a later block's first line
            # it is part of the label (a bad line), though pyarrow would drop it there too.
            marked = next_line > 1 and bytes(data[start : start + 3]) == _BOM
            rows = None if marked else parser.typed(block)
            if rows is not None:  # every line good
                lines = np.arange(next_line, next_line + len(rows), dtype=np.int64)
                next_line += len(rows)
                if num_shards > 1 or first_line:
                    rows = rows.take(np.flatnonzero(_mine(lines, line_offset, first_line, shard, num_shards)))
                yield rows
                continue
            table = parser.strings(block)
            n = table.num_rows
            skips = sorted((next_line + line - 1, why) for line, why in parser.invalid)
            before = np.array([s for s, _ in skips], dtype=np.int64) - next_line - np.arange(len(skips))
            r = np.arange(n, dtype=np.int64)
            lines = next_line + r + np.searchsorted(before, r, side="right")  # each row's line
            forced = {}  # line -> why, for a first line read without its mark
            if marked and (not skips or skips[0][0] != next_line):
                label = table.column("label")[0].as_py() or ""
                alone = start + 3 == end or data[start + 3] in b"\r\n"  # the mark is the whole line
                forced[next_line] = (
                    "1 fields, expected 40" if alone else f"label {_BOM.decode() + label!r} is not 0 or 1"
                )
            next_line += n + len(skips)
            if num_shards > 1 or first_line:
                mine = _mine(lines, line_offset, first_line, shard, num_shards)
                table = table.take(pa.array(np.flatnonzero(mine)))
                lines = lines[mine]
                skipped = np.array([s for s, _ in skips], dtype=np.int64)
                keep = _mine(skipped, line_offset, first_line, shard, num_shards)
                skips = [skip for skip, k in zip(skips, keep.tolist(), strict=True) if k]
            rows, bad = parse_table(table)
            bad |= np.isin(lines, list(forced))
            bad_here = sorted([(int(line), forced.get(int(line), "")) for line in lines[bad]] + skips)  # this shard's
            if bad_here:
                bad_lines.handle(path, bad_here, table, lines)
            yield rows.take(np.flatnonzero(~bad)) if bad.any() else rows
    if progress is not None:
        progress["lines"] = next_line - 1


def _mine(
    lines: npt.NDArray[np.int64], line_offset: int, first_line: int, shard: int, num_shards: int
) -> npt.NDArray[np.bool_]:
    """Which of the source's 1-based ``lines`` belong to ``shard`` (see :func:`read_criteo_tsv`)."""
    data_lines = lines + (line_offset - 1 - first_line)
    return (data_lines >= 0) & (data_lines % num_shards == shard)


def _read_error(path: Path, lines_read: int, error: OSError) -> OSError:
    """``error`` (pyarrow's, which names no file) with the file and how far reading got.

    Keeps the ``OSError`` subclass where the error has an errno (``OSError(errno, message)``
    picks it, e.g. ``FileNotFoundError``).
    """
    message = f"{path}: {error} after {lines_read:,} rows (lines) of it were read; the file is cut short or corrupt"
    return OSError(error.errno, message) if error.errno is not None else OSError(message)
