"""The readers' data position: ``state_dict()`` / ``load_state_dict()``, alone and under torchdata's
``StatefulDataLoader`` with 0 and 2 workers: a resumed reader yields exactly the batches after
those the saved one had yielded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from recsdk.data import Batch, CriteoDataset, ParquetRecDataset, RandomRecDataset, write_synthetic_criteo

NUM_BATCHES = 12


def _random() -> RandomRecDataset:
    return RandomRecDataset(16, NUM_BATCHES, ["a", "b"], id_ranges=1000, pooling_factors=[1, 3], seed=3)


def _criteo(path: Path) -> Callable[[], CriteoDataset]:
    write_synthetic_criteo(path, 16 * NUM_BATCHES + 5)
    return lambda: CriteoDataset(path, 16, shuffle_buffer=40, seed=2)


def _parquet(path: Path) -> Callable[[], ParquetRecDataset]:
    n = 16 * NUM_BATCHES
    table = pa.table({"y": pa.array([1] * n, pa.int8()), "x": pa.array([float(r) for r in range(n)])})
    pq.write_table(table.append_column("row", pa.array(list(range(n)), pa.int64())), path, row_group_size=20)
    return lambda: ParquetRecDataset(path, 16, label_column="y", dense_columns=["x"], sparse_columns=["row"])


def _readers(tmp_path: Path) -> dict[str, Callable[[], object]]:
    return {"random": _random, "criteo": _criteo(tmp_path / "day.tsv"), "parquet": _parquet(tmp_path / "p.parquet")}


def _same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


@pytest.mark.parametrize("reader", ["random", "criteo", "parquet"])
def test_a_reader_resumes_after_the_batches_it_had_yielded(tmp_path: Path, reader: str) -> None:
    make = _readers(tmp_path)[reader]
    everything = list(make())
    first = make()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    assert state["batches_read"] == 5
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(everything) - 5
    assert all(_same(a, b) for a, b in zip(rest, everything[5:], strict=True))
    assert len(list(resumed)) == len(everything)  # the next epoch starts at its beginning


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("reader", ["random", "criteo", "parquet"])
def test_the_readers_resume_under_a_stateful_dataloader(tmp_path: Path, reader: str, num_workers: int) -> None:
    make = _readers(tmp_path)[reader]

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(make(), batch_size=None, num_workers=num_workers)

    everything = list(loader())
    first = loader()
    it = iter(first)
    taken = [next(it) for _ in range(5)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(taken) + len(rest) == len(everything)
    assert all(_same(a, b) for a, b in zip(taken + rest, everything, strict=True))


def test_a_state_of_another_reader_is_refused_naming_the_difference(tmp_path: Path) -> None:
    state = _random().state_dict()
    other = RandomRecDataset(32, NUM_BATCHES, ["a", "b"], id_ranges=1000, seed=3)
    with pytest.raises(ValueError, match=r"batch_size 16 \(this reader: 32\)"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state is missing \['batches_read'"):
        other.load_state_dict({})
    with pytest.raises(TypeError, match="state must be a dict"):
        other.load_state_dict([1])
