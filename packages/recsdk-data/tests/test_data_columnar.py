import errno
import json
import mmap
import pickle
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from test_data_convert import assert_same_batches
from torch.utils.data import DataLoader

from recsdk.data import ColumnarDataset, columnar_format, convert_criteo, write_synthetic_criteo


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2,500 rows in record batches of 300 rows, over two parts."""
    folder = tmp_path_factory.mktemp("columnar")
    day = write_synthetic_criteo(folder / "day.tsv", 2_500, seed=3)
    convert_criteo(day, folder / "out", workers=1, chunk_bytes=200_000, rows_per_batch=300, progress=False)
    return folder / "out"


def _first_ids(batches: list) -> list[int]:
    """cat_0's first id of each batch's first row with one: identifies the batch."""
    return [int(b.sparse_features["cat_0"].values()[0]) for b in batches]


def test_ranks_take_global_batches_round_robin(dataset: Path) -> None:
    whole = list(ColumnarDataset(dataset, 100))
    assert len(whole) == 25 and [b.batch_size for b in whole] == [100] * 25
    for rank in range(3):
        mine = list(ColumnarDataset(dataset, 100, rank=rank, world_size=3))
        assert len(mine) == len(ColumnarDataset(dataset, 100, rank=rank, world_size=3))
        assert_same_batches(mine, whole[rank::3])


def test_last_partial_batch_and_drop_last(dataset: Path) -> None:
    assert [b.batch_size for b in ColumnarDataset(dataset, 1_000)] == [1_000, 1_000, 500]
    assert [b.batch_size for b in ColumnarDataset(dataset, 1_000, drop_last=True)] == [1_000, 1_000]


def test_shuffle_permutes_batches_the_same_on_every_rank(dataset: Path) -> None:
    ordered = _first_ids(list(ColumnarDataset(dataset, 100)))
    ranks = [ColumnarDataset(dataset, 100, rank=r, world_size=2, shuffle=True, seed=7) for r in range(2)]
    epoch0 = [_first_ids(list(ds)) for ds in ranks]
    assert sorted(epoch0[0] + epoch0[1]) == sorted(ordered)  # every batch once over the ranks
    assert epoch0[0] + epoch0[1] != ordered[0::2] + ordered[1::2]
    assert _first_ids(list(ranks[0])) == epoch0[0]  # same epoch, same order
    for ds in ranks:
        ds.set_epoch(1)
    epoch1 = [_first_ids(list(ds)) for ds in ranks]
    assert sorted(epoch1[0] + epoch1[1]) == sorted(ordered) and epoch1 != epoch0
    again = ColumnarDataset(dataset, 100, rank=0, world_size=2, shuffle=True, seed=7)
    assert _first_ids(list(again)) == epoch0[0]


def test_dataloader_workers_yield_the_rank_batches_in_order(dataset: Path) -> None:
    ds = ColumnarDataset(dataset, 128, rank=1, world_size=2)
    alone = list(ds)
    with_workers = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert_same_batches(with_workers, alone)


def test_state_dict_resumes_after_the_batches_read(dataset: Path) -> None:
    reader = ColumnarDataset(dataset, 100, rank=0, world_size=2, shuffle=True, seed=1)
    reader.set_epoch(2)
    uninterrupted = list(reader)
    it = iter(reader)
    head = [next(it) for _ in range(4)]
    state = reader.state_dict()
    assert state["epoch"] == 2 and state["batches_read"] == 4
    resumed = ColumnarDataset(dataset, 100, rank=0, world_size=2, shuffle=True, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # plain data: survives JSON
    resumed.set_epoch(2)  # the loop's call for the same epoch keeps the position
    assert_same_batches(head + list(resumed), uninterrupted)
    assert len(list(resumed)) == len(uninterrupted)  # the next iteration starts over


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"batch_size": 50}, r"batch_size 100 \(this reader: 50\)"),
        ({"rank": 1, "world_size": 2}, r"shard 0 \(this reader: 1\)"),
        ({"seed": 2}, r"seed 1 \(this reader: 2\)"),
    ],
)
def test_state_of_another_reader_is_refused(dataset: Path, kwargs: dict[str, int], pattern: str) -> None:
    state = ColumnarDataset(dataset, 100, rank=0, world_size=2, shuffle=True, seed=1).state_dict()
    args = {"batch_size": 100, "rank": 0, "world_size": 2, "shuffle": True, "seed": 1, **kwargs}
    batch_size = args.pop("batch_size")
    other = ColumnarDataset(dataset, batch_size, **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=pattern):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing \['batches_read'"):
        other.load_state_dict({"epoch": 0})


@pytest.mark.parametrize(("sizes", "shuffle"), [((2, 1), False), ((1, 2), True), ((2, 3, 1), True)])
def test_elastic_resume_reads_every_batch_once_across_restarts(dataset: Path, sizes: tuple, shuffle: bool) -> None:
    """Shards that read in lockstep, saved and resumed on another number of shards (and again):
    the new shards split the batches not read yet, and every batch of the epoch is read once."""
    epoch = _first_ids(list(ColumnarDataset(dataset, 100, shuffle=shuffle, seed=4)))  # 25 batches, in order
    read: list[int] = []
    state = None
    for hop, world_size in enumerate(sizes):
        readers = [
            ColumnarDataset(dataset, 100, rank=r, world_size=world_size, shuffle=shuffle, seed=4)
            for r in range(world_size)
        ]
        for reader in readers:
            if state is not None:
                reader.load_state_dict(state)
        iterators = [iter(reader) for reader in readers]
        last = hop == len(sizes) - 1  # the last hop reads to the end of the epoch, the others 3 batches each
        per_rank = [list(it) if last else [next(it) for _ in range(3)] for it in iterators]
        consumed = len(read)
        for r, batches in enumerate(per_rank):  # round-robin over what the shards before left
            assert _first_ids(batches) == epoch[consumed:][r::world_size][: len(batches)]
        read += [i for batches in per_rank for i in _first_ids(batches)]
        state = readers[0].state_dict()  # load_checkpoint gives every new rank rank 0's
    assert sorted(read) == sorted(epoch)


def test_writing_into_a_batch_never_changes_the_files_or_its_ids(dataset: Path) -> None:
    reader = ColumnarDataset(dataset, 10)
    first = next(iter(reader))
    ids = first.sparse_features.values().clone()
    first.dense_features.add_(1.0)  # dense features and labels are copy-on-write views of the files
    first.labels.fill_(5.0)
    first.sparse_features.values().zero_()  # ids and lengths are the batch's own
    first.sparse_features.lengths().zero_()
    again = next(iter(ColumnarDataset(dataset, 10)))
    assert torch.equal(again.dense_features + 1.0, first.dense_features)
    assert not torch.equal(again.labels, first.labels)
    assert torch.equal(again.sparse_features.values(), ids)
    same_reader = reader.batch(0)
    assert torch.equal(same_reader.sparse_features.values(), ids)
    assert torch.equal(same_reader.sparse_features.lengths(), again.sparse_features.lengths())


def test_damaged_or_unfinished_datasets_are_refused(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="columnar dataset folder not found"):
        ColumnarDataset(tmp_path / "nothing", 10)
    (tmp_path / "unfinished" / ".convert").mkdir(parents=True)
    with pytest.raises(ValueError, match="has not finished: run it again to resume"):
        ColumnarDataset(tmp_path / "unfinished", 10)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in dataset.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    part = sorted(copy.glob("part-*.arrow"))[-1]
    size = part.stat().st_size
    part.write_bytes(b"\x80\x04" * (size // 2) + b"." * (size % 2))  # a pickle-like file of the right size
    with pytest.raises(ValueError, match=rf"{part.name}: not an Arrow IPC file"):
        ColumnarDataset(copy, 10)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    with pytest.raises(ValueError, match="format version 1, this reader reads version 2: convert the source files"):
        ColumnarDataset(copy, 10)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    part.write_bytes(part.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{part.name}: .* bytes, manifest.json says .*damaged"):
        ColumnarDataset(copy, 10)
    part.unlink()
    with pytest.raises(ValueError, match=rf"{part.name}: part file listed in manifest.json is missing"):
        ColumnarDataset(copy, 10)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"batch_size": 10, "shuffle": "yes"}, TypeError, "shuffle must be a bool"),
        ({"batch_size": 10, "rank": 0}, ValueError, "give both rank and world_size"),
        ({"batch_size": 10, "seed": -1}, ValueError, "seed must be >= 0"),
    ],
)
def test_bad_arguments_are_named(dataset: Path, kwargs: dict[str, object], error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        ColumnarDataset(dataset, **kwargs)  # type: ignore[arg-type]


def test_pickled_reader_reopens_its_files_and_keeps_its_position(dataset: Path) -> None:
    reader = ColumnarDataset(dataset, 100, rank=1, world_size=2, shuffle=True, seed=5)
    reader.set_epoch(3)
    whole = list(reader)
    it = iter(reader)
    next(it)
    copy = pickle.loads(pickle.dumps(reader))
    assert copy.state_dict() == reader.state_dict()
    assert_same_batches(list(copy), whole[1:])
    # A DataLoader whose workers start by spawn pickles the reader too.
    spawned = DataLoader(ColumnarDataset(dataset, 500), batch_size=None, num_workers=1, multiprocessing_context="spawn")
    assert_same_batches(list(spawned), list(ColumnarDataset(dataset, 500)))


def test_a_compressed_part_is_refused_naming_the_column(dataset: Path, tmp_path: Path) -> None:
    copy = tmp_path / "compressed"
    copy.mkdir()
    for f in dataset.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((copy / "manifest.json").read_text())
    part = manifest["parts"][0]
    with pa.ipc.open_file(pa.memory_map(str(dataset / part["file"]))) as reader:
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        options = pa.ipc.IpcWriteOptions(compression="zstd")
        with pa.ipc.new_file(str(copy / part["file"]), reader.schema, options=options) as writer:
            for batch in batches:
                writer.write_batch(batch)
    part["bytes"] = (copy / part["file"]).stat().st_size
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="column 'cat_0' is not stored in place"):
        ColumnarDataset(copy, 10)


def test_without_private_mappings_batches_are_copies(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strict overcommit accounting refuses a copy-on-write mapping of a large file (ENOMEM)."""
    mapped = []

    def strict(fileno: int, length: int, *, access: int) -> mmap.mmap:
        if access == mmap.ACCESS_COPY:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        mapped.append(access)
        return real(fileno, length, access=access)

    real = mmap.mmap
    expected = list(ColumnarDataset(dataset, 100))
    monkeypatch.setattr(columnar_format.mmap, "mmap", strict)
    reader = ColumnarDataset(dataset, 100)
    assert mapped and set(mapped) == {mmap.ACCESS_READ}
    assert_same_batches(reader, expected)
    first = reader.batch(0)
    first.dense_features.add_(1.0)  # a copy: neither the file nor the next read changes
    assert torch.equal(reader.batch(0).dense_features, expected[0].dense_features)
