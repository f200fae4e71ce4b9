"""The fields of Criteo TSV lines: the rows type, hex ids, and each value checked alone.

The string path of the parse (:func:`parse_table`, every field a string, each value judged by the
per-value rules) and what every path shares: :class:`CriteoRows`, :func:`parse_hex_ids`, the
column names. A dense value is ``-?`` and 1 to 19 decimal digits within int64; an id is 1 to 16
hex digits (either case), read as unsigned 64 bits and reinterpreted as int64; empty is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from recsdk.data.batch import Batch

__all__ = [
    "COLUMNS",
    "CRITEO_DENSE_COLUMNS",
    "CRITEO_SPARSE_FEATURES",
    "ON_BAD_LINE",
    "CriteoRows",
    "describe_bad_row",
    "parse_hex_ids",
    "parse_table",
    "valid",
]

CRITEO_DENSE_COLUMNS = [f"int_{i}" for i in range(13)]
CRITEO_SPARSE_FEATURES = [f"cat_{i}" for i in range(26)]
COLUMNS = ["label", *CRITEO_DENSE_COLUMNS, *CRITEO_SPARSE_FEATURES]
ON_BAD_LINE = ("error", "skip")
# A dense value is an optional '-' and 1 to 19 decimal digits that fit int64 (checked by _fits_int64).
_INT_RE = r"^-?[0-9]{1,19}$"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_U = np.uint64


@dataclass
class CriteoRows:
    """Parsed Criteo rows: labels ``[n]``, dense ``[n, 13]``, ids and presence ``[n, 26]``.

    The 2-D arrays may be column-major (the parser's own blocks are); values are what count.
    """

    labels: npt.NDArray[np.float32]
    dense: npt.NDArray[np.float32]
    ids: npt.NDArray[np.int64]
    present: npt.NDArray[np.bool_]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def arrays(self) -> tuple[npt.NDArray[Any], ...]:
        """The four arrays, in field order."""
        return (self.labels, self.dense, self.ids, self.present)

    def take(self, index: npt.NDArray[np.int64] | slice) -> CriteoRows:
        return CriteoRows(self.labels[index], self.dense[index], self.ids[index], self.present[index])

    @staticmethod
    def concat(parts: list[CriteoRows]) -> CriteoRows:
        """``parts`` one after another (the one part itself when there is one)."""
        if len(parts) == 1:
            return parts[0]
        return CriteoRows(*(np.concatenate(arrays) for arrays in zip(*(p.arrays() for p in parts), strict=True)))

    def empty(self, n: int) -> CriteoRows:
        """``n`` uninitialised rows with these rows' dtypes, widths and memory order."""
        return CriteoRows(*(np.empty_like(a, shape=(n, *a.shape[1:])) for a in self.arrays()))

    def to_batch(self) -> Batch:
        """The rows as a :class:`Batch` (the KJT's values feature by feature, then row by row)."""
        # Imported here: the converter's worker processes import this module without torch.
        import torch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        from recsdk.data.batch import Batch

        present_t = self.present.T
        kjt = KeyedJaggedTensor(
            keys=list(CRITEO_SPARSE_FEATURES),
            values=torch.from_numpy(self.ids.T[present_t]),
            lengths=torch.from_numpy(present_t.astype(np.int32).reshape(-1)),
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
    if not (pa.types.is_string(column.type) or pa.types.is_binary(column.type)):
        raise TypeError(f"parse_hex_ids expects a string column, got Arrow type {column.type}")
    n = len(column)
    ids = np.zeros(n, dtype=np.uint64)
    if n == 0:
        return ids.view(np.int64), np.zeros(0, dtype=np.bool_), np.zeros(0, dtype=np.bool_)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=column.offset + n + 1)[column.offset :]
    data_buf = column.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    raw_lengths = np.diff(offsets)
    lengths = raw_lengths if column.null_count == 0 else np.where(valid(column), raw_lengths, 0)
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


def valid(column: pa.Array) -> npt.NDArray[np.bool_]:
    """Which values of ``column`` are not null."""
    if column.null_count == 0:
        return np.ones(len(column), dtype=np.bool_)
    if column.offset % 8:
        return np.asarray(column.isvalid().to_numpy(zero_copy_only=False), dtype=np.bool_)
    bits = np.frombuffer(column.buffers()[0], dtype=np.uint8)[column.offset // 8 :]
    return np.unpackbits(bits, count=len(column), bitorder="little").view(np.bool_)


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


def parse_table(table: pa.RecordBatch) -> tuple[CriteoRows, npt.NDArray[np.bool_]]:
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
    return CriteoRows(ones.astype(np.float32), dense, ids, present), bad


def describe_bad_row(table: pa.RecordBatch, i: int) -> str:
    """Which field of row ``i`` is bad, for the error message."""
    row = {name: table.column(name)[i].as_py() for name in COLUMNS}
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
