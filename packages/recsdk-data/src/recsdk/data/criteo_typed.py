"""The fast path of the Criteo parse: a block read typed by pyarrow, kept only where exact.

pyarrow reads the label and the integers as int64 and the ids as 8 bytes (or strings, for a file
whose ids are not all 8 digits); a few whole-block numpy passes convert them. pyarrow's int64
parsing accepts more than a dense value may be (padding, ``0x`` literals, leading zeros past 19
digits), so a typed block is kept only where it provably read every field as the per-value rules
do: its byte count is what its values take written canonically (:func:`_rows_typed`). Any other
block goes to the string path (:meth:`BlockParser.strings`, then
:func:`recsdk.data.criteo_fields.parse_table`), which also names the bad lines.
"""

from __future__ import annotations

import binascii

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.csv as pa_csv

from recsdk.data.criteo_blocks import Block
from recsdk.data.criteo_fields import (
    COLUMNS,
    CRITEO_DENSE_COLUMNS,
    CRITEO_SPARSE_FEATURES,
    CriteoRows,
    parse_hex_ids,
    valid,
)

__all__ = ["BlockParser"]

_U = np.uint64
_POW10 = np.array([10**k for k in range(1, 20)], dtype=np.uint64)
_HEX_ZERO = np.frombuffer(b"00000000", dtype=np.uint64)[0]  # eight '0' characters as one lane

# The fast path looks a dense value v up at index v + _HALF (clipped to the table): log1p(max(v, 0)) and
# the characters of v written canonically. The two end entries (length 0) stand for values outside.
_HALF = 1 << 16


def _decimal_lengths(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Characters of each value written canonically: '-' if negative, digits without leading zeros."""
    negative = values < 0
    magnitude = np.where(negative, (-(values + 1)).astype(np.uint64) + _U(1), values.astype(np.uint64))
    return np.searchsorted(_POW10, magnitude, side="right") + 1 + negative


def _log1p_dense(values: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
    """The dense feature of integer values: ``log(1 + max(x, 0))`` as float32."""
    return np.log1p(np.maximum(values, 0).astype(np.float64)).astype(np.float32)


_LOOKUP_VALUES = np.arange(-_HALF, _HALF + 1, dtype=np.int64)
_LOG1P_LOOKUP = _log1p_dense(_LOOKUP_VALUES)
_LENGTH_LOOKUP = _decimal_lengths(_LOOKUP_VALUES).astype(np.uint8)
_LENGTH_LOOKUP[[0, -1]] = 0
_HEX_LITERAL_MIN = 10**6  # below it, pyarrow's "0x..." takes more characters than the value written canonically


def _int64_values(column: pa.Array) -> npt.NDArray[np.int64]:
    """The int64 value slots of ``column`` (a null's slot holds anything)."""
    return np.frombuffer(column.buffers()[1], dtype=np.int64, count=column.offset + len(column))[column.offset :]


def _dense_typed(batch: pa.RecordBatch) -> tuple[npt.NDArray[np.float32], int, bool]:
    """Dense features ``[13, n]`` of int64 columns 1-13, the characters their values take written
    canonically, and whether a value is as large as ``_HEX_LITERAL_MIN``.
    """
    n = batch.num_rows
    index = np.empty((len(CRITEO_DENSE_COLUMNS), n), dtype=np.int64)
    chars = 0
    for j in range(len(CRITEO_DENSE_COLUMNS)):
        column = batch.column(1 + j)
        if column.null_count:  # a null is the value 0 written in no characters
            np.multiply(_int64_values(column), valid(column), out=index[j])
            index[j] += _HALF
            chars -= column.null_count
        else:  # values near the int64 limits wrap around: outside the table, looked at below
            np.add(_int64_values(column), _HALF, out=index[j])
    dense = np.take(_LOG1P_LOOKUP, index, mode="clip")
    lengths = np.take(_LENGTH_LOOKUP, index, mode="clip")
    chars += int(lengths.sum(dtype=np.int64))
    large = False
    if lengths.min() == 0:  # values outside the table, computed one by one
        for j in range(len(CRITEO_DENSE_COLUMNS)):
            rows = np.flatnonzero(lengths[j] == 0)
            if rows.size:
                values = _int64_values(batch.column(1 + j))[rows]
                dense[j, rows] = _log1p_dense(values)
                chars += int(_decimal_lengths(values).sum())
                large |= bool((values >= _HEX_LITERAL_MIN).any() or (values <= -_HEX_LITERAL_MIN).any())
    return dense, chars, large


def _ids_typed(batch: pa.RecordBatch) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_], int] | None:
    """Ids and presence ``[26, n]`` of id columns 14-39 and their characters; ``None`` if one is not hex.

    Columns of 8-byte values (any 8-digit id) are decoded by ``binascii``; string columns by
    :func:`parse_hex_ids`.
    """
    n = batch.num_rows
    ids = np.empty((len(CRITEO_SPARSE_FEATURES), n), dtype=np.int64)
    present = np.empty((len(CRITEO_SPARSE_FEATURES), n), dtype=np.bool_)
    chars = 0
    for j in range(len(CRITEO_SPARSE_FEATURES)):
        column = batch.column(14 + j)
        if pa.types.is_fixed_size_binary(column.type):
            lanes = np.frombuffer(column.buffers()[1], dtype=np.uint64, count=column.offset + n)[column.offset :]
            if column.null_count:  # a missing id reads as "00000000": id 0, like parse_hex_ids
                present[j] = valid(column)
                lanes = np.where(present[j], lanes, _HEX_ZERO)
            else:
                present[j] = True
            try:
                ids[j] = np.frombuffer(binascii.a2b_hex(lanes.data), dtype=">u4")
            except binascii.Error:
                return None
            chars += 8 * (n - column.null_count)
        else:
            ids[j], present[j], bad = parse_hex_ids(column)
            if bad.any():
                return None
            offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=column.offset + n + 1)
            chars += int(offsets[-1] - offsets[column.offset])
    return ids, present, chars


def _rows_typed(batch: pa.RecordBatch, block: Block) -> CriteoRows | None:
    """The rows of a block parsed with int64 columns, or ``None`` unless that read every field as
    :func:`~recsdk.data.criteo_fields.parse_table` would.

    pyarrow's int64 parsing also takes padding, leading zeros (past 19 digits too) and ``0x``
    literals. Each of those makes the field longer than its value written canonically, except a
    ``0x`` literal of a value of ``_HEX_LITERAL_MIN`` or more (looked for only then): the block's
    byte count tells.
    """
    data, start, end = block
    n = batch.num_rows
    label = batch.column(0)
    if n == 0 or label.null_count:
        return None
    labels = _int64_values(label)
    if int(labels.view(np.uint64).max()) > 1:
        return None
    typed_ids = _ids_typed(batch)
    if typed_ids is None:
        return None
    ids, present, id_chars = typed_ids
    dense, dense_chars, large = _dense_typed(batch)
    if large and (data.find(b"x", start, end) >= 0 or data.find(b"X", start, end) >= 0):
        return None
    # Each field as long as its value written canonically (a label one character), 39 tabs, line ends.
    line_ends = n if data[end - 1] == ord("\n") else n - 1
    if end - start != n + dense_chars + id_chars + 39 * n + line_ends:
        return None
    return CriteoRows(labels.astype(np.float32), dense.T, ids.T, present.T)


class BlockParser:
    """Parses blocks: typed first, as strings where the typed parse is not exact."""

    def __init__(self) -> None:
        self.invalid: list[tuple[int, str]] = []  # (line in block, reason) of the last parse's bad field counts
        self.ids_type = pa.binary(8)
        self._parse_options = pa_csv.ParseOptions(
            delimiter="\t",
            quote_char=False,
            double_quote=False,
            escape_char=False,
            newlines_in_values=False,
            ignore_empty_lines=False,
            invalid_row_handler=self._on_invalid,
        )
        self._typed = {t: self._convert_options(pa.int64(), t) for t in (pa.binary(8), pa.binary())}
        self._strings = self._convert_options(pa.string(), pa.string())
        self._skip = 0  # blocks to parse as strings straight away
        self._failures = 0  # typed parses that failed in a row

    @staticmethod
    def _convert_options(ints: pa.DataType, ids: pa.DataType) -> pa_csv.ConvertOptions:
        types = dict.fromkeys(COLUMNS[:14], ints) | dict.fromkeys(COLUMNS[14:], ids)
        return pa_csv.ConvertOptions(
            column_types=types,
            null_values=[""],
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
            check_utf8=ints == pa.string(),
        )

    def _on_invalid(self, row: pa_csv.InvalidRow) -> str:
        if row.number is None:  # only with a threaded reader, which is not used here
            raise RuntimeError("pyarrow did not report the line number of a bad line")
        self.invalid.append((row.number, f"{row.actual_columns} fields, expected {row.expected_columns}"))
        return "skip"

    def _read(self, block: Block, options: pa_csv.ConvertOptions) -> pa.RecordBatch:
        """The block parsed by pyarrow in one piece; lines of bad field counts go to :attr:`invalid`."""
        data, start, end = block
        self.invalid = []
        reader = pa_csv.open_csv(
            pa.BufferReader(pa.py_buffer(memoryview(data)[start:end])),
            read_options=pa_csv.ReadOptions(column_names=COLUMNS, block_size=end - start + 1, use_threads=False),
            parse_options=self._parse_options,
            convert_options=options,
        )
        batches = list(reader) or [pa.RecordBatch.from_pylist([], schema=reader.schema)]  # none: no good line
        return batches[0] if len(batches) == 1 else pa.concat_batches(batches)

    def typed(self, block: Block) -> CriteoRows | None:
        """The block's rows parsed typed, or ``None`` where that is not exact (then :meth:`strings`).

        After a block that fails, the next 1, 3, 7, ... up to 63 go to :meth:`strings` straight away:
        a file with bad lines everywhere is not parsed twice per block.
        """
        if self._skip > 0:
            self._skip -= 1
            return None
        rows, other_ids = self._typed_as(block, self.ids_type)
        if other_ids:  # ids not all of 8 digits: read as strings, here and on if the block is good
            rows, _ = self._typed_as(block, pa.binary())
            if rows is not None:
                self.ids_type = pa.binary()
        self._failures = 0 if rows is not None else min(self._failures + 1, 6)
        self._skip = (1 << self._failures) - 1
        return rows

    def _typed_as(self, block: Block, ids_type: pa.DataType) -> tuple[CriteoRows | None, bool]:
        """The typed rows with ids read as ``ids_type``, and whether pyarrow met an id not 8 bytes long."""
        try:
            batch = self._read(block, self._typed[ids_type])
        except pa.ArrowInvalid as e:
            return None, "fixed_size_binary" in str(e)
        return (None if self.invalid else _rows_typed(batch, block)), False

    def strings(self, block: Block) -> pa.RecordBatch:
        """The block with every column as strings; :attr:`invalid` names its lines of bad field
        counts, and its lines that are not UTF-8 (parsed as a line of one field: bad lines like any other)."""
        try:
            return self._read(block, self._strings)
        except pa.ArrowInvalid as e:
            if "UTF8" not in str(e):
                raise
        data, start, end = block
        lines = bytes(memoryview(data)[start:end]).split(b"\n")
        not_utf8 = {}
        for i, line in enumerate(lines):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as u:
                not_utf8[i + 1] = f"not UTF-8: byte {u.start + 1} of the line is 0x{line[u.start]:02x}"
                lines[i] = b"-"  # one field: pyarrow reports it as a bad field count, here renamed
        cleaned = b"\n".join(lines)
        table = self._read((cleaned, 0, len(cleaned)), self._strings)
        self.invalid = [(line, not_utf8.get(line, why)) for line, why in self.invalid]
        return table
