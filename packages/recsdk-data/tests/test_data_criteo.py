import csv
import gzip
import math
from collections.abc import Sequence
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch.utils.data import DataLoader

from recsdk.data import CRITEO_SPARSE_FEATURES, Batch, CriteoDataset, write_synthetic_criteo
from recsdk.data.criteo_fields import parse_hex_ids
from recsdk.data.testing import run_distributed


def _line(label: str = "1", ints: Sequence[str] = ("1",) * 13, cats: Sequence[str] = ("0000000a",) * 26) -> str:
    return "\t".join([label, *ints, *cats])


def _write(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _numbered(path: Path, n: int, bad: dict[int, str] | None = None) -> Path:
    """n lines whose int_0 is the line number (1-based); `bad` replaces some lines."""
    lines = [_line(str(i % 2), [str(i)] + ["0"] * 12, [f"{i:08x}"] * 26) for i in range(1, n + 1)]
    for line_no, text in (bad or {}).items():
        lines[line_no - 1] = text
    return _write(path, lines)


def _line_numbers(batches: Sequence[Batch]) -> list[int]:
    """Recover int_0 (the line number) from log1p."""
    return [round(math.expm1(float(x))) for b in batches for x in b.dense_features[:, 0].double()]


def _reference(path: Path, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor, list[int], list[int]]]:
    """An independent per-line parser: labels, dense, values, lengths (feature-major) per batch."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        labels = torch.tensor([float(r[0]) for r in chunk])
        dense = torch.tensor([[math.log1p(max(int(x), 0)) if x else 0.0 for x in r[1:14]] for r in chunk])
        values, lengths = [], []
        for j in range(26):
            for r in chunk:
                lengths.append(1 if r[14 + j] else 0)
                if r[14 + j]:
                    v = int(r[14 + j], 16)
                    values.append(v - (1 << 64) if v >= 1 << 63 else v)
        out.append((labels, dense, values, lengths))
    return out


def _assert_matches_reference(batches: list[Batch], path: Path, batch_size: int) -> None:
    expected = _reference(path, batch_size)
    assert len(batches) == len(expected)
    for b, (labels, dense, values, lengths) in zip(batches, expected, strict=True):
        assert torch.equal(b.labels, labels)
        assert torch.equal(b.dense_features, dense.float())
        assert b.sparse_features.keys() == CRITEO_SPARSE_FEATURES
        assert b.sparse_features.values().tolist() == values
        assert b.sparse_features.lengths().tolist() == lengths


def test_fields_are_parsed_as_documented(tmp_path: Path) -> None:
    cats = ["ffffffffffffffff", "8000000000000000", "a", "ABCDEF12", "", "7fffffffffffffff"] + ["0"] * 20
    ints = ["", "-3", "0", "1", "1000000000000"] + ["2"] * 8
    path = _write(tmp_path / "one.tsv", [_line("0", ints, cats), _line("1")])
    (batch,) = CriteoDataset(path, batch_size=4)
    assert batch.batch_size == 2
    assert batch.labels.tolist() == [0.0, 1.0]
    expected = [0.0, 0.0, 0.0, math.log(2.0), math.log1p(1e12)] + [math.log(3.0)] * 8
    assert torch.equal(batch.dense_features[0], torch.tensor(expected, dtype=torch.float32))
    per_key = batch.sparse_features.to_dict()
    assert per_key["cat_0"].values().tolist() == [-1, 10]
    assert per_key["cat_1"].values().tolist() == [-(2**63), 10]
    assert per_key["cat_2"].values().tolist() == [10, 10]
    assert per_key["cat_3"].values().tolist() == [0xABCDEF12, 10]
    assert per_key["cat_4"].lengths().tolist() == [0, 1]  # empty field: empty bag
    assert per_key["cat_5"].values().tolist() == [2**63 - 1, 10]


@pytest.mark.parametrize("name", ["synthetic.tsv", "synthetic.tsv.gz"])
def test_synthetic_file_matches_a_per_line_parser(tmp_path: Path, name: str) -> None:
    path = write_synthetic_criteo(tmp_path / name, 2500, seed=3, chunk_lines=1000)
    if name.endswith(".gz"):
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    batches = list(CriteoDataset(path, batch_size=300, block_size=20_000))  # many parser blocks
    assert [b.batch_size for b in batches] == [300] * 8 + [100]  # the partial batch is kept
    _assert_matches_reference(batches, path, 300)
    assert len(list(CriteoDataset(path, batch_size=300, drop_last=True))) == 8


def test_synthetic_writer_is_deterministic_and_labels_are_learnable(tmp_path: Path) -> None:
    a = write_synthetic_criteo(tmp_path / "a.tsv", 20_000, seed=5)
    b = write_synthetic_criteo(tmp_path / "b.tsv", 20_000, seed=5)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != write_synthetic_criteo(tmp_path / "c.tsv", 20_000, seed=6).read_bytes()
    (batch,) = CriteoDataset(a, batch_size=20_000)
    # The click rate of each cat_0 value, learned on one half, ranks the other half's rows.
    ids = batch.sparse_features["cat_0"].to_padded_dense(desired_length=1, padding_value=-1)[:, 0]
    y = batch.labels
    train, test = slice(0, 10_000), slice(10_000, 20_000)
    rates: dict[int, tuple[float, int]] = {}
    for i, label in zip(ids[train].tolist(), y[train].tolist(), strict=True):
        s, n = rates.get(i, (0.0, 0))
        rates[i] = (s + label, n + 1)
    prior = float(y[train].mean())
    score = torch.tensor(
        [(rates.get(i, (0, 0))[0] + prior) / (rates.get(i, (0, 0))[1] + 1) for i in ids[test].tolist()]
    )
    pos, neg = score[y[test] == 1], score[y[test] == 0]
    auc = ((pos[:, None] > neg[None, :]).double().mean() + 0.5 * (pos[:, None] == neg[None, :]).double().mean()).item()
    assert auc > 0.6
    assert 0.2 < float(y.mean()) < 0.6
    assert (batch.sparse_features.lengths() == 0).any()  # missing categorical values
    assert (batch.dense_features == 0).any()


def test_hex_parser_handles_mixed_lengths_and_slices() -> None:
    values = ["1", None, "", "deadbeef", "0123456789abcdef", "Ff", "g1", "12345678901234567", "00000000cafebabe"]
    ids, present, bad = parse_hex_ids(pa.array(values))
    assert present.tolist() == [True, False, False, True, True, True, False, False, True]
    assert bad.tolist() == [False, False, False, False, False, False, True, True, False]
    assert ids[present].tolist() == [1, 0xDEADBEEF, 0x0123456789ABCDEF, 255, 0xCAFEBABE]
    sliced = pa.array(["ab", "cd", "ef"]).slice(1, 2)
    assert parse_hex_ids(sliced)[0].tolist() == [0xCD, 0xEF]


def test_rows_are_split_across_ranks_and_workers_without_overlap(tmp_path: Path) -> None:
    first = _numbered(tmp_path / "a.tsv", 101)
    second = _numbered(tmp_path / "b.tsv", 50)
    every = _line_numbers(list(CriteoDataset([first, second], batch_size=16)))
    assert every == list(range(1, 102)) + list(range(1, 51))
    seen: list[tuple[int, int]] = []  # (file, line)
    for rank in range(3):
        ds = CriteoDataset([first, second], batch_size=16, rank=rank, world_size=3)
        lines = _line_numbers(list(ds))
        global_lines = [ln if k < len(range(rank, 101, 3)) else 101 + ln for k, ln in enumerate(lines)]
        assert all((g - 1) % 3 == rank for g in global_lines)
        seen += [(0, g) if g <= 101 else (1, g - 101) for g in global_lines]
    assert sorted(seen) == sorted([(0, i) for i in range(1, 102)] + [(1, i) for i in range(1, 51)])
    # Two DataLoader workers of rank 1 of 2 split its lines 2, 4, 6, ... between them.
    ds = CriteoDataset(first, batch_size=8, rank=1, world_size=2)
    via_workers = _line_numbers(list(DataLoader(ds, batch_size=None, num_workers=2)))
    assert sorted(via_workers) == list(range(2, 102, 2))


def _rank_lines(rank: int, world_size: int, path: str) -> list[int]:
    return _line_numbers(list(CriteoDataset(path, batch_size=7)))


def test_rank_defaults_to_torch_distributed(tmp_path: Path) -> None:
    path = _numbered(tmp_path / "a.tsv", 30)
    r0, r1 = run_distributed(_rank_lines, 2, str(path))
    assert r0 == list(range(1, 31, 2)) and r1 == list(range(2, 31, 2))


def test_shuffle_buffer_permutes_rows_deterministically(tmp_path: Path) -> None:
    path = _numbered(tmp_path / "a.tsv", 500)

    def order(seed: int, epoch: int = 0) -> list[int]:
        ds = CriteoDataset(path, batch_size=32, shuffle_buffer=100, seed=seed, block_size=4096)
        ds.set_epoch(epoch)
        return _line_numbers(list(ds))

    shuffled = order(seed=1)
    assert shuffled != list(range(1, 501)) and sorted(shuffled) == list(range(1, 501))
    assert order(seed=1) == shuffled
    assert order(seed=2) != shuffled
    assert order(seed=1, epoch=1) != shuffled
    # Batch k draws from at most the 100 buffered rows, its own 32 and one parser block (~16 lines) more.
    assert all(line <= 100 + 32 * (i // 32 + 1) + 20 for i, line in enumerate(shuffled))
    assert max(shuffled[:32]) > 32  # ... but from the whole buffer, not just the next 32 rows
    batches = list(CriteoDataset(path, batch_size=32, shuffle_buffer=100, drop_last=True))
    assert len(batches) == 15 and all(b.batch_size == 32 for b in batches)


@pytest.mark.parametrize("shuffle_buffer", [0, 600, 3000])  # in order, ~40 parser blocks, more than the file
def test_buffer_spanning_many_blocks_yields_each_row_once(tmp_path: Path, shuffle_buffer: int) -> None:
    path = _numbered(tmp_path / "a.tsv", 1000)

    def read(seed: int = 4, drop_last: bool = False) -> list[Batch]:
        ds = CriteoDataset(
            path, batch_size=64, shuffle_buffer=shuffle_buffer, seed=seed, drop_last=drop_last, block_size=4096
        )
        return list(ds)  # every batch is kept until the end: later blocks must not overwrite them

    batches = read()
    assert [b.batch_size for b in batches] == [64] * 15 + [40]  # the end-of-file remainder is kept
    lines = _line_numbers(batches)
    assert sorted(lines) == list(range(1, 1001))
    assert (lines == list(range(1, 1001))) == (shuffle_buffer == 0)
    # Each row keeps its own label and ids (every cat_j of line i is i).
    assert [int(x) for b in batches for x in b.labels.tolist()] == [i % 2 for i in lines]
    ids = torch.cat([b.sparse_features.values().view(26, b.batch_size) for b in batches], dim=1)
    assert torch.equal(ids, torch.tensor(lines).expand(26, -1))
    again = read()
    assert len(again) == len(batches)
    for a, b in zip(batches, again, strict=True):
        assert torch.equal(a.labels, b.labels) and torch.equal(a.dense_features, b.dense_features)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    if shuffle_buffer:
        assert _line_numbers(read(seed=5)) != lines
    assert [b.batch_size for b in read(drop_last=True)] == [64] * 15


BAD_LINES = {
    3: ("1\t2\t3", "3 fields, expected 40"),
    5: (_line("1", ["x"] + ["1"] * 12), "int_0 'x' is not a decimal integer"),
    7: (_line("1", cats=["0000000a"] * 25 + ["zz"]), "cat_25 'zz' is not a hex id"),
    9: (_line("2"), "label '2' is not 0 or 1"),
    11: ("", "label None is not 0 or 1"),
    13: (_line("1", cats=["1" * 17] + ["a"] * 25), "cat_0 '11111111111111111' is not a hex id"),
}


@pytest.mark.parametrize("line_no", sorted(BAD_LINES))
def test_bad_line_raises_with_file_and_line(tmp_path: Path, line_no: int) -> None:
    text, reason = BAD_LINES[line_no]
    path = _numbered(tmp_path / "bad.tsv", 20, {line_no: text})
    with pytest.raises(ValueError, match=rf"bad\.tsv:{line_no}: bad Criteo line \({reason}"):
        list(CriteoDataset(path, batch_size=4))


def test_bad_lines_can_be_skipped_and_counted(tmp_path: Path) -> None:
    bad = {line_no: text for line_no, (text, _) in BAD_LINES.items()}
    bad[1000] = "1\t2"  # far away, in a later parser block
    bad[1001] = ""  # the last line, after the last good row
    path = _numbered(tmp_path / "bad.tsv", 1001, bad)
    ds = CriteoDataset(path, batch_size=64, on_bad_line="skip", block_size=4096)
    lines = _line_numbers(list(ds))
    assert lines == [i for i in range(1, 1002) if i not in bad]
    assert ds.bad_lines == len(bad) == 8
    with pytest.raises(ValueError, match=r"far\.tsv:1000: bad Criteo line \(2 fields, expected 40\)"):
        list(CriteoDataset(_numbered(tmp_path / "far.tsv", 1001, {1000: "1\t2"}), batch_size=64, block_size=4096))
    # Each rank counts its own lines' problems; together they count every bad line.
    counts = []
    for rank in range(2):
        ds = CriteoDataset(path, batch_size=64, on_bad_line="skip", rank=rank, world_size=2, block_size=4096)
        assert all((line - 1) % 2 == rank for line in _line_numbers(list(ds)))
        counts.append(ds.bad_lines)
    assert counts == [sum(1 for k in bad if (k - 1) % 2 == r) for r in range(2)]


@pytest.mark.parametrize("neighbour", [None, "x", "0x10"])
def test_int64_edges_are_judged_alone_not_by_their_block(tmp_path: Path, neighbour: str | None) -> None:
    # int_1 holds the value under test; a bad neighbour in the same block used to change the verdict.
    values = {
        2: ("9223372036854775807", True),  # 19 digits, int64 max
        3: ("-9223372036854775808", True),  # int64 min
        4: ("0000000000000000042", True),  # 19 digits with leading zeros
        5: ("9223372036854775808", False),  # one past int64 max
        6: ("99999999999999999999", False),  # 20 digits
    }
    bad = {i: _line(str(i % 2), [str(i), v] + ["0"] * 11, [f"{i:08x}"] * 26) for i, (v, _) in values.items()}
    if neighbour is not None:
        bad[8] = _line("0", ["8", neighbour] + ["0"] * 11, ["00000008"] * 26)
    path = _numbered(tmp_path / "edges.tsv", 10, bad)
    ds = CriteoDataset(path, batch_size=16, on_bad_line="skip")
    (batch,) = list(ds)
    kept = [i for i in range(1, 11) if values.get(i, ("", True))[1] and not (i == 8 and neighbour is not None)]
    assert _line_numbers([batch]) == kept
    assert ds.bad_lines == 10 - len(kept)
    int_1 = batch.dense_features[:, 1].double()
    assert int_1[kept.index(2)].item() == pytest.approx(math.log1p(2**63 - 1))
    assert int_1[kept.index(3)].item() == 0.0  # negative values clamp to 0 before log1p
    assert int_1[kept.index(4)].item() == pytest.approx(math.log1p(42))
    with pytest.raises(
        ValueError, match=r"edges\.tsv:5: bad Criteo line \(int_1 '9223372036854775808' is not a decimal"
    ):
        list(CriteoDataset(path, batch_size=16))


def test_whole_parser_blocks_of_bad_lines(tmp_path: Path) -> None:
    # Bad lines first (the parser's first block), then a run longer than a block between good rows.
    bad = {i: "x" for i in range(1, 201)} | {i: "1\t2" for i in range(260, 560)}
    path = _numbered(tmp_path / "runs.tsv", 600, bad)
    ds = CriteoDataset(path, batch_size=16, on_bad_line="skip", block_size=1024)
    assert _line_numbers(list(ds)) == list(range(201, 260)) + list(range(560, 601))
    assert ds.bad_lines == 500
    for rank in range(2):
        ds = CriteoDataset(path, batch_size=16, on_bad_line="skip", block_size=1024, rank=rank, world_size=2)
        assert _line_numbers(list(ds)) == [i for i in range(1, 601) if i not in bad and (i - 1) % 2 == rank]
        assert ds.bad_lines == 250
    with pytest.raises(ValueError, match=r"runs\.tsv:1: bad Criteo line \(1 fields, expected 40\)"):
        list(CriteoDataset(path, batch_size=16, block_size=1024))


def test_reading_streams_before_reaching_the_end(tmp_path: Path) -> None:
    path = _numbered(tmp_path / "late.tsv", 3000, {3000: "1\tbroken"})
    batches = iter(CriteoDataset(path, batch_size=100, block_size=8192))
    first = list(islice(batches, 5))  # produced before the reader gets anywhere near line 3000
    assert _line_numbers(first) == list(range(1, 501))
    with pytest.raises(ValueError, match=r"late\.tsv:3000"):
        list(batches)


def test_missing_file_fails_at_construction(tmp_path: Path) -> None:
    good = _numbered(tmp_path / "a.tsv", 3)
    with pytest.raises(FileNotFoundError, match=r"nope\.tsv"):
        CriteoDataset([good, tmp_path / "nope.tsv"], batch_size=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"batch_size": 0}, ValueError, r"batch_size must be >= 1, got 0"),
        ({"shuffle_buffer": -1}, ValueError, r"shuffle_buffer must be >= 0, got -1"),
        ({"seed": -1}, ValueError, r"seed must be >= 0"),
        ({"on_bad_line": "ignore"}, ValueError, r"on_bad_line must be one of \('error', 'skip'\), got 'ignore'"),
        ({"block_size": 10}, ValueError, r"block_size must be >= 1024, got 10"),
        ({"drop_last": 1}, TypeError, r"drop_last must be a bool, got int"),
        ({"rank": 0}, ValueError, r"give both rank and world_size"),
        ({"paths": []}, ValueError, r"paths must name at least one file"),
        ({"paths": 5}, TypeError, r"paths must be a path or a sequence of paths, got int"),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, kwargs: dict[str, object], error: type, pattern: str) -> None:
    args: dict[str, object] = {"paths": _numbered(tmp_path / "a.tsv", 3), "batch_size": 4}
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        CriteoDataset(**args)  # type: ignore[arg-type]


def test_writer_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"num_lines must be >= 0, got -1"):
        write_synthetic_criteo(tmp_path / "x.tsv", -1)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        write_synthetic_criteo(tmp_path / "no" / "x.tsv", 10)
    empty = write_synthetic_criteo(tmp_path / "empty.tsv", 0)
    assert list(CriteoDataset(empty, batch_size=4)) == []
    assert np.frombuffer(write_synthetic_criteo(tmp_path / "y.tsv", 1).read_bytes(), np.uint8)[-1] == ord("\n")


def _row_keys(batches: list[Batch]) -> list[tuple[float, ...]]:
    """Each row's dense values: identifies the row (synthetic lines are all different)."""
    return sorted(tuple(row) for batch in batches for row in batch.dense_features.tolist())


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (3, 2)])
def test_elastic_resume_reads_every_line_once(tmp_path: Path, before: int, after: int) -> None:
    """Shards that read in lockstep, saved and resumed on another number of shards (over two
    files): the new shards take the lines not read yet, and every line is read once."""
    files = [write_synthetic_criteo(tmp_path / f"day_{i}.tsv", 700, seed=i) for i in range(2)]
    everything = _row_keys(list(CriteoDataset(files, 50)))
    readers = [CriteoDataset(files, 50, rank=r, world_size=before) for r in range(before)]
    iterators = [iter(reader) for reader in readers]
    read = [batch for it in iterators for batch in islice(it, 4)]  # 4 batches each, in lockstep
    state = readers[0].state_dict()
    resumed = [CriteoDataset(files, 50, rank=r, world_size=after) for r in range(after)]
    for reader in resumed:
        reader.load_state_dict(state)
    rest = [batch for reader in resumed for batch in reader]
    assert _row_keys(read + rest) == everything
    assert all(len(list(reader)) > 0 for reader in resumed)  # the next epoch starts over
    assert _row_keys([b for reader in resumed for b in reader]) == everything


def test_elastic_resume_needs_the_file_order(tmp_path: Path) -> None:
    path = write_synthetic_criteo(tmp_path / "day.tsv", 300, seed=1)
    state = CriteoDataset(path, 50, rank=0, world_size=2, shuffle_buffer=100).state_dict()
    with pytest.raises(ValueError, match=r"shuffle_buffer 100: an elastic resume needs the file order"):
        CriteoDataset(path, 50, rank=0, world_size=1, shuffle_buffer=100).load_state_dict(state)
