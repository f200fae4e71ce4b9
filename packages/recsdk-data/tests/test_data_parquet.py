from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from recsdk.data import Batch, ParquetRecDataset, hash_string
from recsdk.data.testing import run_distributed


def _write(path: Path, table: pa.Table, row_group_size: int) -> Path:
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _numbered(path: Path, first: int, n: int, row_group_size: int) -> Path:
    """Rows whose label is 1 and whose `row` id is first, first + 1, ..."""
    rows = list(range(first, first + n))
    table = pa.table(
        {
            "click": pa.array([1] * n, pa.int8()),
            "x": pa.array([float(r) for r in rows]),
            "row": pa.array(rows, pa.int64()),
        }
    )
    return _write(path, table, row_group_size)


def _rows(batches: list[Batch]) -> list[int]:
    return [int(v) for b in batches for v in b.sparse_features["row"].values()]


def _numbered_ds(paths: list[Path], batch_size: int, **kwargs: object) -> ParquetRecDataset:
    return ParquetRecDataset(
        paths, batch_size, label_column="click", dense_columns=["x"], sparse_columns=["row"], **kwargs
    )  # type: ignore[arg-type]


def test_every_column_kind_converts(tmp_path: Path) -> None:
    table = pa.table(
        {
            "y": pa.array([True, False, True]),
            "age": pa.array([1.5, None, 3.0], pa.float32()),
            "n": pa.array([7, 8, 9], pa.int32()),
            "uid": pa.array([5, None, -(2**63)], pa.int64()),
            "big": pa.array([2**64 - 1, 1, 2**63], pa.uint64()),
            "items": pa.array([[1, 2, 3], None, [4, None]], pa.list_(pa.int64())),
            "city": pa.array(["paris", None, "東京"]),
            "tags": pa.array([["a", "b"], [], ["a"]], pa.list_(pa.string())),
            "shop": pa.array(["s1", "s2", "s1"]).dictionary_encode(),
        }
    )
    path = _write(tmp_path / "all.parquet", table, row_group_size=2)
    sparse = ["uid", "big", "items", "city", "tags", "shop"]
    ds = ParquetRecDataset(path, 3, label_column="y", dense_columns=["age", "n"], sparse_columns=sparse)
    (batch,) = list(ds)
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]
    assert batch.dense_features.tolist() == [[1.5, 7.0], [0.0, 8.0], [3.0, 9.0]]
    kjt = batch.sparse_features
    assert kjt.keys() == sparse and kjt.weights_or_none() is None
    got = {k: (jt.lengths().tolist(), jt.values().tolist()) for k, jt in kjt.to_dict().items()}
    h = hash_string
    assert got == {
        "uid": ([1, 0, 1], [5, -(2**63)]),
        "big": ([1, 1, 1], [-1, 1, -(2**63)]),  # uint64 wraps to int64
        "items": ([3, 0, 1], [1, 2, 3, 4]),  # null list: empty bag; null element dropped
        "city": ([1, 0, 1], [h("paris"), h("東京")]),
        "tags": ([2, 0, 1], [h("a"), h("b"), h("a")]),
        "shop": ([1, 1, 1], [h("s1"), h("s2"), h("s1")]),
    }


def test_weights_follow_their_ids(tmp_path: Path) -> None:
    table = pa.table(
        {
            "y": [0, 1],
            "items": pa.array([[10, None, 30], [40]], pa.list_(pa.int64())),
            "w": pa.array([[0.5, 9.0, 2.0], [4.0]], pa.list_(pa.float64())),
            "uid": pa.array([1, 2], pa.int64()),
        }
    )
    path = _write(tmp_path / "w.parquet", table, row_group_size=10)
    ds = ParquetRecDataset(
        path, 2, label_column="y", dense_columns=[], sparse_columns=["uid", "items"], weight_columns={"items": "w"}
    )
    (batch,) = list(ds)
    assert batch.dense_features.shape == (2, 0)
    kjt = batch.sparse_features
    assert kjt.values().tolist() == [1, 2, 10, 30, 40]
    assert kjt.weights().tolist() == [1.0, 1.0, 0.5, 2.0, 4.0]  # unweighted feature: 1.0


@pytest.mark.parametrize(
    ("ids", "weights", "pattern"),
    [
        # Null lists on opposite sides used to pass the length check and shift weight 0.5 onto id 3.
        (
            [[1, 2], None, [3]],
            [[0.1, 0.2], [0.5, 0.6], None],
            r"weight column of 'ids' .* null weights for present ids",
        ),
        ([[1, 2], None, [3]], [[0.1, 0.2], [0.5, 0.6], [0.7]], r"'ids' and its weight column .* differ in lengths"),
        ([[1, 2], [3], [4]], [[0.1, 0.2], None, [0.4]], r"weight column of 'ids' .* null weights for present ids"),
    ],
)
def test_null_list_on_one_side_of_weights_is_rejected(
    tmp_path: Path, ids: list[object], weights: list[object], pattern: str
) -> None:
    table = pa.table(
        {
            "y": [0, 1, 0],
            "ids": pa.array(ids, pa.list_(pa.int64())),
            "w": pa.array(weights, pa.list_(pa.float64())),
        }
    )
    path = _write(tmp_path / "n.parquet", table, row_group_size=10)
    ds = ParquetRecDataset(
        path, 3, label_column="y", dense_columns=[], sparse_columns=["ids"], weight_columns={"ids": "w"}
    )
    with pytest.raises(ValueError, match=pattern):
        list(ds)


def test_null_lists_on_both_sides_or_empty_weights_are_fine(tmp_path: Path) -> None:
    table = pa.table(
        {
            "y": [0, 1, 0, 1],
            "ids": pa.array([[1, 2], None, [], [3]], pa.list_(pa.int64())),
            "w": pa.array([[0.1, 0.2], None, None, [0.5]], pa.list_(pa.float64())),
        }
    )
    path = _write(tmp_path / "ok.parquet", table, row_group_size=10)
    ds = ParquetRecDataset(
        path, 4, label_column="y", dense_columns=[], sparse_columns=["ids"], weight_columns={"ids": "w"}
    )
    (batch,) = list(ds)
    kjt = batch.sparse_features
    assert kjt.lengths().tolist() == [2, 0, 0, 1]
    assert kjt.values().tolist() == [1, 2, 3]
    assert kjt.weights().tolist() == pytest.approx([0.1, 0.2, 0.5])


def test_rows_handed_to_torch_are_writable(tmp_path: Path) -> None:
    # torch.from_numpy on a read-only view of Arrow memory warns and gives a tensor that must not be written.
    path = _numbered(tmp_path / "a.parquet", 0, 6, row_group_size=3)
    ds = _numbered_ds([path], 4)
    parts = list(ds._rows(0, 1))
    assert len(parts) == 2
    for rows in parts:
        assert rows.labels.flags.writeable and rows.labels.dtype == np.float32
        assert rows.dense.flags.writeable
        batch = rows.to_batch(ds.sparse_columns)
        batch.labels.mul_(2)  # in place, on memory the batch owns
        assert batch.labels.tolist() == [2.0] * len(rows)


def test_batches_cross_row_groups_and_files(tmp_path: Path) -> None:
    a = _numbered(tmp_path / "a.parquet", 0, 25, row_group_size=4)
    b = _numbered(tmp_path / "b.parquet", 25, 10, row_group_size=3)
    batches = list(_numbered_ds([a, b], 8))
    assert [x.batch_size for x in batches] == [8, 8, 8, 8, 3]
    assert _rows(batches) == list(range(35))
    assert torch.equal(torch.cat([x.dense_features[:, 0] for x in batches]), torch.arange(35, dtype=torch.float32))
    assert [x.batch_size for x in _numbered_ds([a, b], 8, drop_last=True)] == [8, 8, 8, 8]


@pytest.mark.parametrize("shard_by", ["row_group", "row"])
def test_ranks_read_disjoint_parts_that_cover_the_files(tmp_path: Path, shard_by: str) -> None:
    a = _numbered(tmp_path / "a.parquet", 0, 25, row_group_size=4)
    b = _numbered(tmp_path / "b.parquet", 25, 10, row_group_size=3)
    parts = [_rows(list(_numbered_ds([a, b], 5, rank=r, world_size=3, shard_by=shard_by))) for r in range(3)]
    assert sorted(row for part in parts for row in part) == list(range(35))
    if shard_by == "row":
        assert parts[1] == list(range(1, 35, 3))
    else:  # row groups 0..10 dealt round-robin: rank 1 gets groups 1, 4 (a) and 7, 10 (b)
        assert parts[1] == [4, 5, 6, 7, 16, 17, 18, 19, 25, 26, 27, 34]
    # DataLoader workers split a rank's part between them.
    ds = _numbered_ds([a, b], 5, rank=1, world_size=3, shard_by=shard_by)
    assert sorted(_rows(list(DataLoader(ds, batch_size=None, num_workers=2)))) == sorted(parts[1])


def _rank_rows(rank: int, world_size: int, path: str) -> list[int]:
    return _rows(list(_numbered_ds([Path(path)], 4)))


def test_rank_defaults_to_torch_distributed(tmp_path: Path) -> None:
    path = _numbered(tmp_path / "a.parquet", 0, 12, row_group_size=3)
    assert run_distributed(_rank_rows, 2, str(path)) == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]


def test_too_few_row_groups_for_the_readers(tmp_path: Path) -> None:
    path = _numbered(tmp_path / "a.parquet", 0, 10, row_group_size=100)
    ds = _numbered_ds([path], 4, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"1 row groups in 1 files cannot be shared by 2 readers.*shard_by='row'"):
        list(ds)
    assert _rows(list(_numbered_ds([path], 4, rank=1, world_size=2, shard_by="row"))) == [1, 3, 5, 7, 9]


def test_unknown_column_lists_the_file_columns(tmp_path: Path) -> None:
    path = _numbered(tmp_path / "a.parquet", 0, 3, row_group_size=3)
    with pytest.raises(
        ValueError, match=r"column 'user' is not in .*a\.parquet'; its columns are \['click', 'x', 'row'\]"
    ):
        ParquetRecDataset(path, 2, label_column="click", dense_columns=["x"], sparse_columns=["user"])


def test_bad_column_types_and_values(tmp_path: Path) -> None:
    table = pa.table(
        {
            "y": pa.array([1.0, None]),
            "name": ["a", "b"],
            "f": pa.array([0.5, 1.5]),
            "ids": pa.array([[1, 2], [3]], pa.list_(pa.int64())),
            "w": pa.array([[1.0], [2.0]], pa.list_(pa.float64())),
            "uid": pa.array([1, 2]),
        }
    )
    path = _write(tmp_path / "t.parquet", table, row_group_size=10)

    def make(**kwargs: object) -> ParquetRecDataset:
        args: dict[str, object] = {"label_column": "y", "dense_columns": [], "sparse_columns": ["uid"]}
        args.update(kwargs)
        return ParquetRecDataset(path, 2, **args)  # type: ignore[arg-type]

    with pytest.raises(TypeError, match=r"dense column 'name' .* must be a number or bool, got string"):
        make(dense_columns=["name"])
    with pytest.raises(
        TypeError, match=r"sparse column 'f' .* must hold integers, strings or lists of them, got double"
    ):
        make(sparse_columns=["f"])
    with pytest.raises(TypeError, match=r"label column 'name' .* must be a number or bool"):
        make(label_column="name")
    with pytest.raises(TypeError, match=r"weight column 'f' .* must match sparse column 'ids'"):
        make(sparse_columns=["ids"], weight_columns={"ids": "f"})
    with pytest.raises(ValueError, match=r"weight_columns keys must be sparse columns \['uid'\], got \['ids'\]"):
        make(weight_columns={"ids": "w"})
    with pytest.raises(ValueError, match=r"sparse column 'ids' and its weight column .* differ in lengths"):
        list(make(label_column="f", sparse_columns=["ids"], weight_columns={"ids": "w"}))
    with pytest.raises(ValueError, match=r"label column 'y' in .* has 1 null values"):
        list(make())


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"batch_size": 0}, ValueError, r"batch_size must be >= 1, got 0"),
        ({"shard_by": "file"}, ValueError, r"shard_by must be one of \('row_group', 'row'\), got 'file'"),
        ({"sparse_columns": []}, ValueError, r"sparse_columns must not be empty"),
        ({"dense_columns": ["x", "x"]}, ValueError, r"dense_columns must be distinct"),
        ({"label_column": ""}, TypeError, r"label_column must be a non-empty str"),
        ({"drop_last": "yes"}, TypeError, r"drop_last must be a bool, got str 'yes'"),
        ({"drop_last": 0}, TypeError, r"drop_last must be a bool, got int 0"),
        ({"rank": 2, "world_size": 2}, ValueError, r"rank must be in \[0, world_size=2\), got 2"),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, kwargs: dict[str, object], error: type, pattern: str) -> None:
    args: dict[str, object] = {
        "paths": _numbered(tmp_path / "a.parquet", 0, 3, row_group_size=3),
        "batch_size": 2,
        "label_column": "click",
        "dense_columns": ["x"],
        "sparse_columns": ["row"],
    }
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        ParquetRecDataset(**args)  # type: ignore[arg-type]


def test_missing_file_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.parquet"):
        _numbered_ds([tmp_path / "missing.parquet"], 2)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 3)])
def test_elastic_resume_by_row_reads_every_row_once(tmp_path: Path, before: int, after: int) -> None:
    files = [_numbered(tmp_path / f"{i}.parquet", 500 * i, 500, row_group_size=70) for i in range(2)]
    readers = [_numbered_ds(files, 25, rank=r, world_size=before, shard_by="row") for r in range(before)]
    iterators = [iter(reader) for reader in readers]
    read = [batch for it in iterators for batch in [next(it) for _ in range(6)]]  # 6 batches each, in lockstep
    state = readers[0].state_dict()
    resumed = [_numbered_ds(files, 25, rank=r, world_size=after, shard_by="row") for r in range(after)]
    for reader in resumed:
        reader.load_state_dict(state)
    rest = [batch for reader in resumed for batch in reader]
    assert sorted(_rows(read + rest)) == list(range(1000))
    assert sorted(_rows([b for reader in resumed for b in reader])) == list(range(1000))  # next epoch: all


def test_elastic_resume_needs_rows_dealt_one_by_one(tmp_path: Path) -> None:
    path = _numbered(tmp_path / "a.parquet", 0, 200, row_group_size=20)
    state = _numbered_ds([path], 10, rank=0, world_size=2).state_dict()
    with pytest.raises(
        ValueError, match=r"state of 2 shards for a reader of 1: an elastic resume needs shard_by='row'"
    ):
        _numbered_ds([path], 10, rank=0, world_size=1).load_state_dict(state)
