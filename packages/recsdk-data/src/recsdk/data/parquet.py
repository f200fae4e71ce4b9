"""A streaming reader of Parquet files into Batches, by row group."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data._checks import check_bool, check_choice, check_int, check_names, check_paths
from recsdk.data.batch import Batch
from recsdk.data.hashing import hash_strings
from recsdk.data.partition import check_rank_and_world_size, current_shard
from recsdk.data.read_position import ReadPosition

__all__ = ["ParquetRecDataset"]

SHARD_BY = ("row_group", "row")


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _value_type(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_id(t: pa.DataType) -> bool:
    t = _value_type(t)
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def _decoded(arr: pa.Array) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.dictionary_decode() if pa.types.is_dictionary(arr.type) else arr


@dataclass
class _Rows:
    """Converted rows: labels ``[n]``, dense ``[n, D]``; per feature lengths ``[n]``, values, weights."""

    labels: npt.NDArray[np.float32]
    dense: npt.NDArray[np.float32]
    lengths: list[npt.NDArray[np.int32]]
    values: list[npt.NDArray[np.int64]]
    weights: list[npt.NDArray[np.float32]] | None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> _Rows:
        values, weights = [], []
        for f, lens in enumerate(self.lengths):
            a = int(lens[:start].sum())
            b = a + int(lens[start:stop].sum())
            values.append(self.values[f][a:b])
            if self.weights is not None:
                weights.append(self.weights[f][a:b])
        return _Rows(
            self.labels[start:stop],
            self.dense[start:stop],
            [lens[start:stop] for lens in self.lengths],
            values,
            weights if self.weights is not None else None,
        )

    @staticmethod
    def concat(parts: Sequence[_Rows]) -> _Rows:
        if len(parts) == 1:
            return parts[0]
        num_features = len(parts[0].lengths)
        weighted = parts[0].weights is not None
        return _Rows(
            np.concatenate([p.labels for p in parts]),
            np.concatenate([p.dense for p in parts]),
            [np.concatenate([p.lengths[f] for p in parts]) for f in range(num_features)],
            [np.concatenate([p.values[f] for p in parts]) for f in range(num_features)],
            [np.concatenate([p.weights[f] for p in parts]) for f in range(num_features)]  # type: ignore[index]
            if weighted
            else None,
        )

    def to_batch(self, keys: list[str]) -> Batch:
        kjt = KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(np.concatenate(self.values)),
            lengths=torch.from_numpy(np.concatenate(self.lengths)),
            weights=torch.from_numpy(np.concatenate(self.weights)) if self.weights is not None else None,
            stride=len(self),
        )
        return Batch(
            dense_features=torch.from_numpy(np.ascontiguousarray(self.dense)),
            sparse_features=kjt,
            labels=torch.from_numpy(np.ascontiguousarray(self.labels)),
        )


class ParquetRecDataset(IterableDataset[Batch]):
    """Batches from Parquet files, streamed row group by row group.

    * ``label_column``: a number or bool column, float32 ``[B]``; nulls are an error.
    * ``dense_columns``: number or bool columns, float32 ``[B, D]`` in the given order;
      nulls become 0. No transform is applied.
    * ``sparse_columns``: one KJT key per column, in the given order. A column holds an
      integer id, a string, or a list of either (multi-hot). Integers are raw ids, cast
      to int64 (``uint64`` values above ``2**63 - 1`` wrap to negatives). Strings are
      hashed to int64 with :func:`recsdk.data.hash_string` (8-byte BLAKE2b of the UTF-8
      bytes, signed little-endian): the same id in every process and every run. A null
      value or null list gives an empty bag; null elements inside a list are dropped.
      Dictionary-encoded columns are decoded first.
    * ``weight_columns``: optional per-id weights, ``{sparse column: weight column}``; a
      weight column has the same shape as its sparse column (a number, or a list of
      numbers of the same length per row). When any feature has weights, the others
      get weight 1.0.

    **Sharding.** With ``shard_by="row_group"`` (default) the row groups of all files,
    in order, are dealt round-robin to the shards (one shard = one DataLoader worker of
    one rank, see :func:`recsdk.data.current_shard`); each reader opens only its own
    row groups. There must be at least as many row groups as shards. With
    ``shard_by="row"`` row ``i`` (counted across files) goes to shard ``i % num_shards``;
    every reader then reads every row group, but the shards stay balanced.

    Args:
        paths (str | os.PathLike | Sequence): one file or a list, read in order.
        batch_size (int): rows per batch (>= 1).
        label_column (str): the label column.
        dense_columns (Sequence[str]): dense feature columns (may be empty).
        sparse_columns (Sequence[str]): sparse feature columns (at least one).
        weight_columns (Mapping[str, str] | None): per-id weight column of some sparse
            columns.
        rank (int | None): this rank; ``None`` asks ``torch.distributed`` at iteration
            (0 when it is not initialised). Give both or neither.
        world_size (int | None): number of ranks, like ``rank``.
        drop_last (bool): drop the last, partial batch of each reader.
        shard_by (str): ``"row_group"`` or ``"row"``.

    Raises:
        FileNotFoundError: a file does not exist.
        ValueError: a column is not in a file (the message lists the file's columns).
        TypeError: a column has a type this reader cannot use.

    Example::

        ds = ParquetRecDataset(
            "events.parquet", batch_size=512, label_column="click",
            dense_columns=["age"], sparse_columns=["user_id", "item_tags"],
        )
        for batch in DataLoader(ds, batch_size=None, num_workers=2):
            ...
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        batch_size: int,
        *,
        label_column: str,
        dense_columns: Sequence[str],
        sparse_columns: Sequence[str],
        weight_columns: Mapping[str, str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        shard_by: str = "row_group",
    ) -> None:
        super().__init__()
        self.paths = check_paths(paths)
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        if not isinstance(label_column, str) or not label_column:
            raise TypeError(f"label_column must be a non-empty str, got {label_column!r}")
        self.label_column = label_column
        self.dense_columns = check_names("dense_columns", dense_columns, allow_empty=True)
        self.sparse_columns = check_names("sparse_columns", sparse_columns)
        weights = dict(weight_columns or {})
        unknown = sorted(set(weights) - set(self.sparse_columns))
        if unknown:
            raise ValueError(f"weight_columns keys must be sparse columns {self.sparse_columns}, got {unknown}")
        self.weight_columns = weights
        check_rank_and_world_size(rank, world_size)
        self.rank, self.world_size = rank, world_size
        self.drop_last = check_bool("drop_last", drop_last)
        self.shard_by = check_choice("shard_by", shard_by, SHARD_BY)
        self._first_row = 0  # rows read before this split (an elastic resume): nobody's
        self._position = ReadPosition("ParquetRecDataset", self._position_identity)
        self._columns = list(
            dict.fromkeys([label_column, *self.dense_columns, *self.sparse_columns, *self.weight_columns.values()])
        )
        # (file index, row group, rows) of every row group, in order.
        self.row_groups: list[tuple[int, int, int]] = []
        for i, path in enumerate(self.paths):
            meta = pq.ParquetFile(path)
            self._check_schema(path, meta.schema_arrow)
            self.row_groups += [(i, g, meta.metadata.row_group(g).num_rows) for g in range(meta.num_row_groups)]

    def _check_schema(self, path: Path, schema: pa.Schema) -> None:
        names = schema.names
        for col in self._columns:
            if col not in names:
                raise ValueError(f"column {col!r} is not in {str(path)!r}; its columns are {names}")
        t = schema.field(self.label_column).type
        if not _is_number(t):
            raise TypeError(f"label column {self.label_column!r} in {str(path)!r} must be a number or bool, got {t}")
        for col in self.dense_columns:
            t = schema.field(col).type
            if not _is_number(t):
                raise TypeError(f"dense column {col!r} in {str(path)!r} must be a number or bool, got {t}")
        for col in self.sparse_columns:
            t = schema.field(col).type
            if not (_is_id(t) or (_is_list(t) and _is_id(t.value_type))):
                raise TypeError(
                    f"sparse column {col!r} in {str(path)!r} must hold integers, strings or lists of them, got {t}"
                )
            wcol = self.weight_columns.get(col)
            if wcol is not None:
                wt = schema.field(wcol).type
                ok = _is_list(wt) and _is_number(wt.value_type) if _is_list(t) else _is_number(wt) and not _is_list(wt)
                if not ok:
                    raise TypeError(
                        f"weight column {wcol!r} in {str(path)!r} must match sparse column {col!r} ({t}): "
                        f"{'a list of numbers' if _is_list(t) else 'a number'}, got {wt}"
                    )

    def __iter__(self) -> Iterator[Batch]:
        return self._position.replay(self._batches())

    def state_dict(self) -> dict[str, Any]:
        """This reader's position: the batches yielded, with what they depend on (files, columns,
        batch size, this rank's and DataLoader worker's shard). torchdata's ``StatefulDataLoader``
        convention."""
        return {"first_row": self._first_row, **self._position.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the next iteration after the batches ``state`` (from :meth:`state_dict`) had
        yielded (the rows before them are read again and dropped).

        **Elastic resume** (``shard_by="row"``): a state of another shard count (another world
        size) continues with the rows the saving shards had not read, dealt to the new shards.
        The saving shards read in lockstep, ``batch_size`` rows a batch each, so together the
        first ``first_row + num_shards * batches_read * batch_size`` rows; every row is then read
        once across the restart. Row groups dealt whole (``shard_by="row_group"``) leave no such
        prefix, so a state of another shard count is refused there.

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: ``state`` is of a reader over other files, batch size or shard (every
                difference named); an elastic resume with ``shard_by="row_group"``.
        """
        if not isinstance(state, dict) or "num_shards" not in state:
            self._position.load_state_dict(state)  # raises, naming what is wrong
            return
        first_row = check_int("state['first_row']", state.get("first_row", 0), minimum=0)
        position = {k: v for k, v in state.items() if k != "first_row"}
        other_split = self._position.is_resharded(position)
        if other_split and self.shard_by == "row_group":
            raise ValueError(
                f"state of {position['num_shards']} shards for a reader of {self._position_identity()['num_shards']}: "
                "an elastic resume needs shard_by='row' (row groups dealt whole leave no prefix of rows read)"
            )
        if other_split:
            self._first_row = first_row + self._position.load_resharded(position) * self.batch_size
            return
        self._position.load_state_dict(position)
        self._first_row = first_row

    def _position_identity(self) -> dict[str, Any]:
        shard, num_shards = current_shard(self.rank, self.world_size)
        return {
            "paths": [str(p) for p in self.paths],
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "shard_by": self.shard_by,
            "sparse_columns": list(self.sparse_columns),
            "shard": shard,
            "num_shards": num_shards,
        }

    def _batches(self) -> Iterator[Batch]:
        shard, num_shards = current_shard(self.rank, self.world_size)
        pending: list[_Rows] = []
        pending_rows = 0
        for rows in self._rows(shard, num_shards):
            pending.append(rows)
            pending_rows += len(rows)
            if pending_rows < self.batch_size:
                continue
            merged = _Rows.concat(pending)
            full = len(merged) - len(merged) % self.batch_size
            for start in range(0, full, self.batch_size):
                yield merged.slice(start, start + self.batch_size).to_batch(self.sparse_columns)
            rest = merged.slice(full, len(merged))
            pending, pending_rows = ([rest], len(rest)) if len(rest) else ([], 0)
        if pending_rows and not self.drop_last:
            yield _Rows.concat(pending).to_batch(self.sparse_columns)
        self._first_row = 0  # the epoch is read: the next one starts at its first row

    def _rows(self, shard: int, num_shards: int) -> Iterator[_Rows]:
        if self.shard_by == "row_group":
            if len(self.row_groups) < num_shards:
                raise ValueError(
                    f"{len(self.row_groups)} row groups in {len(self.paths)} files cannot be shared by {num_shards} "
                    f"readers (ranks x DataLoader workers); write smaller row groups or pass shard_by='row'"
                )
            mine = self.row_groups[shard::num_shards]
            for file_index in sorted({f for f, _, _ in mine}):
                groups = [g for f, g, _ in mine if f == file_index]
                yield from self._read(self.paths[file_index], groups, None)
            return
        first_row = 0
        for file_index, path in enumerate(self.paths):
            groups = [g for f, g, _ in self.row_groups if f == file_index]
            yield from self._read(path, groups, (first_row, shard, num_shards))
            first_row += sum(n for f, _, n in self.row_groups if f == file_index)

    def _read(self, path: Path, groups: list[int], row_shard: tuple[int, int, int] | None) -> Iterator[_Rows]:
        if not groups:
            return
        row = row_shard[0] if row_shard is not None else 0
        with pq.ParquetFile(path) as pf:
            for record_batch in pf.iter_batches(batch_size=self.batch_size, row_groups=groups, columns=self._columns):
                n = record_batch.num_rows
                if row_shard is not None:
                    _, shard, num_shards = row_shard
                    data_rows = np.arange(row - self._first_row, row - self._first_row + n)
                    keep = np.flatnonzero((data_rows >= 0) & (data_rows % num_shards == shard))
                    row += n
                    record_batch = record_batch.take(pa.array(keep))
                if record_batch.num_rows:
                    yield self._convert(path, record_batch)

    def _convert(self, path: Path, rb: pa.RecordBatch) -> _Rows:
        n = rb.num_rows
        label = rb.column(self.label_column)
        if label.null_count:
            raise ValueError(f"label column {self.label_column!r} in {str(path)!r} has {label.null_count} null values")
        # A copy: the zero-copy view of Arrow memory is read-only, and torch.from_numpy warns on it.
        labels = np.array(pc.cast(label, pa.float32()).to_numpy(zero_copy_only=False), dtype=np.float32)
        dense = np.zeros((n, len(self.dense_columns)), dtype=np.float32)
        for j, col in enumerate(self.dense_columns):
            dense[:, j] = pc.fill_null(pc.cast(rb.column(col), pa.float32()), 0.0).to_numpy(zero_copy_only=False)
        weighted = bool(self.weight_columns)
        lengths, values, weights = [], [], []
        for col in self.sparse_columns:
            wcol = self.weight_columns.get(col)
            lens, vals, w = self._sparse(path, col, rb.column(col), rb.column(wcol) if wcol else None, n)
            lengths.append(lens)
            values.append(vals)
            if weighted:
                weights.append(w if w is not None else np.ones(vals.shape[0], dtype=np.float32))
        return _Rows(labels, dense, lengths, values, weights if weighted else None)

    @staticmethod
    def _sparse(
        path: Path, col: str, arr: pa.Array, warr: pa.Array | None, n: int
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.float32] | None]:
        arr = _decoded(arr)
        if _is_list(arr.type):
            parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
            flat = _decoded(pc.list_flatten(arr))
            wflat = None
            if warr is not None:
                # A null list counts as length 0 on both sides: otherwise a null id list next to a non-null
                # weight list (or the reverse) would pass and list_flatten would shift weights across rows.
                id_lens = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
                w_lens = pc.fill_null(pc.list_value_length(warr), 0).to_numpy(zero_copy_only=False)
                if (warr.is_null().to_numpy(zero_copy_only=False) & (id_lens > 0)).any():
                    raise ValueError(f"weight column of {col!r} in {str(path)!r} has null weights for present ids")
                if not np.array_equal(id_lens, w_lens):
                    raise ValueError(f"sparse column {col!r} and its weight column in {str(path)!r} differ in lengths")
                wflat = pc.list_flatten(warr)
        else:
            parents = np.arange(n)
            flat, wflat = arr, warr
        valid = flat.is_valid().to_numpy(zero_copy_only=False)
        if not valid.all():
            parents = parents[valid]
            flat = flat.filter(pa.array(valid))
            wflat = wflat.filter(pa.array(valid)) if wflat is not None else None
        if pa.types.is_integer(flat.type):
            ids = pc.cast(flat, pa.int64(), safe=False).to_numpy(zero_copy_only=False)
        else:
            ids = hash_strings(flat)
        weights = None
        if wflat is not None:
            if wflat.null_count:
                raise ValueError(f"weight column of {col!r} in {str(path)!r} has null weights for present ids")
            weights = pc.cast(wflat, pa.float32()).to_numpy(zero_copy_only=False)
        lengths = np.bincount(parents, minlength=n).astype(np.int32)
        return lengths, ids.astype(np.int64, copy=False), weights
