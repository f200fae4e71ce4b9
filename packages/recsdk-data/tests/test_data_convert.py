import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from recsdk.data import Batch, ColumnarDataset, CriteoDataset, convert_criteo, write_synthetic_criteo
from recsdk.data.convert import main


def _line(label: str = "1", ints: tuple[str, ...] = ("1",) * 13, cats: tuple[str, ...] = ("0000000a",) * 26) -> str:
    return "\t".join([label, *ints, *cats])


def assert_same_batches(ours: Iterable[Batch], theirs: Iterable[Batch]) -> int:
    """Batch for batch: labels, dense values, keys, ids, lengths; returns how many."""
    n = 0
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.labels, b.labels)
        assert torch.equal(a.dense_features, b.dense_features)
        assert a.sparse_features.keys() == b.sparse_features.keys()
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
        assert torch.equal(a.sparse_features.offsets(), b.sparse_features.offsets())
        assert a.sparse_features.length_per_key() == b.sparse_features.length_per_key()
        n += 1
    return n


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A plain day with bad lines and 16-digit ids, then a gzip day: the converter's two kinds of unit."""
    folder = tmp_path_factory.mktemp("days")
    plain = write_synthetic_criteo(folder / "day_0.tsv", 6_000, seed=1)
    lines = plain.read_text().splitlines()
    lines[10] = "x\t" + lines[10].split("\t", 1)[1]  # a bad label
    lines[4_000] = _line(cats=("ffffffffffffffff",) + ("",) * 25)  # 16 hex digits, 25 empty fields
    lines.insert(5_000, "1\t2")  # too few fields
    plain.write_text("".join(line + "\n" for line in lines))
    return [plain, write_synthetic_criteo(folder / "day_1.tsv.gz", 3_000, seed=2)]


@pytest.mark.parametrize("batch_size", [1, 256, 1000])
def test_converted_batches_equal_criteo_dataset(days: list[Path], tmp_path: Path, batch_size: int) -> None:
    # Small units and record batches: batches cross units, parts and record batches.
    manifest = convert_criteo(
        days, tmp_path / "out", workers=1, on_bad_line="skip", chunk_bytes=150_000, rows_per_batch=700, progress=False
    )
    criteo = CriteoDataset(days, batch_size, on_bad_line="skip")
    n = assert_same_batches(ColumnarDataset(tmp_path / "out", batch_size), criteo)
    assert n == -(-manifest["rows"] // batch_size)
    assert manifest["rows"] == 6_001 + 3_000 - 2 and manifest["bad_lines"] == criteo.bad_lines == 2
    assert [s["rows"] for s in manifest["sources"]] == [5_999, 3_000]
    assert len(manifest["parts"]) > 2 and manifest["parts"][-1]["byte_range"] is None  # the .gz is one unit
    assert manifest["sparse"] == [f"cat_{i}" for i in range(26)]
    # The unit holding the 16-digit id (-1) stores int64 ids; every other unit uint32.
    assert sorted(p["ids"] for p in manifest["parts"]) == ["int64"] + ["uint32"] * (len(manifest["parts"]) - 1)


def test_parallel_conversion_writes_the_same_dataset(days: list[Path], tmp_path: Path) -> None:
    one = convert_criteo(days, tmp_path / "one", workers=1, on_bad_line="skip", chunk_bytes=300_000, progress=False)
    two = convert_criteo(days, tmp_path / "two", workers=2, on_bad_line="skip", chunk_bytes=300_000, progress=False)
    assert [p["rows"] for p in one["parts"]] == [p["rows"] for p in two["parts"]]
    for part in one["parts"]:
        assert (tmp_path / "one" / part["file"]).read_bytes() == (tmp_path / "two" / part["file"]).read_bytes()


def test_bad_line_is_named_by_file_and_line_in_any_unit(tmp_path: Path) -> None:
    path = tmp_path / "day.tsv"
    lines = [_line(ints=(str(i),) * 13) for i in range(1, 3_001)]
    lines[2_499] = _line(ints=("1.5",) + ("1",) * 12)  # line 2500, in a later unit
    path.write_text("".join(line + "\n" for line in lines))
    for workers in (1, 2):
        with pytest.raises(ValueError, match=r"day\.tsv:2500: bad Criteo line \(int_0 '1\.5' is not a decimal"):
            convert_criteo(path, tmp_path / f"out{workers}", workers=workers, chunk_bytes=20_000, progress=False)
        assert not (tmp_path / f"out{workers}" / "manifest.json").exists()


def test_killed_conversion_resumes_keeping_finished_units(days: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "recsdk.data.convert", "criteo", *map(str, days), str(out)]
    cmd += ["--workers", "1", "--on-bad-line", "skip", "--chunk-bytes", "4000", "--rows-per-batch", "50", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(out.glob(".convert/unit-*.json"))) < 5:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "the conversion did not start"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    done = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.arrow") if (out / ".convert").is_dir()}
    markers = sorted(out.glob(".convert/unit-*.json"))
    kept = {m.name.replace("unit-", "part-").replace(".json", ".arrow") for m in markers}
    assert kept <= set(done)
    units = len(json.loads((out / ".convert" / "plan.json").read_text())["units"])
    assert len(kept) < units  # it was stopped part-way

    manifest = convert_criteo(
        days, out, workers=1, on_bad_line="skip", chunk_bytes=4000, rows_per_batch=50, progress=False
    )
    assert all((out / name).stat().st_mtime_ns == done[name] for name in kept)  # not converted again
    assert not list(out.glob("*.tmp"))
    fresh = convert_criteo(
        days, tmp_path / "fresh", workers=1, on_bad_line="skip", chunk_bytes=4000, rows_per_batch=50, progress=False
    )
    assert manifest["rows"] == fresh["rows"]
    assert_same_batches(ColumnarDataset(out, 500), ColumnarDataset(tmp_path / "fresh", 500))


def test_finished_conversion_is_not_redone_and_other_inputs_are_refused(days: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert_criteo(days[1], out, workers=1, progress=False)
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert convert_criteo(days[1], out, workers=1, progress=False)["rows"] == 3_000
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match=r"other inputs or options: inputs .*day_1\.tsv\.gz.*day_0\.tsv"):
        convert_criteo(days[0], out, workers=1, on_bad_line="skip", progress=False)
    with pytest.raises(ValueError, match=r"on_bad_line 'error' -> 'skip'"):
        convert_criteo(days[1], out, workers=1, on_bad_line="skip", progress=False)
    assert ColumnarDataset(out, 100).num_rows == 3_000  # untouched
    manifest = convert_criteo(days[1], out, workers=1, on_bad_line="skip", overwrite=True, progress=False)
    assert manifest["on_bad_line"] == "skip"


def test_output_folder_with_other_files_is_refused(days: list[Path], tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files"):
        convert_criteo(days[1], tmp_path / "out", workers=1, overwrite=True, progress=False)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"workers": 0}, ValueError, "workers must be >= 1"),
        ({"on_bad_line": "warn"}, ValueError, "on_bad_line must be one of"),
        ({"rows_per_batch": 0}, ValueError, "rows_per_batch must be >= 1"),
        ({"chunk_bytes": "1MB"}, TypeError, "chunk_bytes must be an int"),
        ({"overwrite": 1}, TypeError, "overwrite must be a bool"),
    ],
)
def test_bad_arguments_are_named(
    days: list[Path], tmp_path: Path, kwargs: dict[str, object], error: type, pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        convert_criteo(days[1], tmp_path / "out", progress=False, **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_command_line(days: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["criteo", str(days[1]), str(tmp_path / "out"), "--workers", "1", "--quiet"]) == 0
    assert "3,000 rows from 1 file(s), 0 bad lines skipped, 1 parts" in capsys.readouterr().out
    assert main(["criteo", str(tmp_path / "missing.tsv"), str(tmp_path / "o2"), "--quiet"]) == 2
    assert "data file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["criteo", str(tmp_path / "out")])  # no input
    assert os.listdir(tmp_path) == ["out"]


_HOLD_LOCK = """
import sys, time
from pathlib import Path
from recsdk.data.criteo_convert import _locked
with _locked(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_conversion_into_the_same_folder_fails_at_once_naming_the_first(
    days: list[Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    first = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline() == "held\n"
        started = time.monotonic()
        with pytest.raises(BlockingIOError, match=rf"being converted into by another conversion \(pid {first.pid} on "):
            convert_criteo(days[1], out, workers=1, progress=False)
        assert time.monotonic() - started < 5  # at once, not after waiting
        assert sorted(p.name for p in out.iterdir()) == [".convert.lock"]  # nothing touched
    finally:
        first.kill()
        first.wait()
    assert convert_criteo(days[1], out, workers=1, progress=False)["rows"] == 3_000  # the lock went with it


def test_non_utf8_lines_are_bad_lines_named_by_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "day.tsv"
    lines = [_line(ints=(str(i),) * 13).encode() for i in range(1, 3_001)]
    lines[2_499] = _line(cats=("0000000a",) * 25 + ("",)).encode() + b"\xff\xfe"  # line 2500, in a later unit
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    for workers in (1, 2):
        with pytest.raises(
            ValueError, match=r"day\.tsv:2500: bad Criteo line \(not UTF-8: byte \d+ of the line is 0xff"
        ):
            convert_criteo(path, tmp_path / f"out{workers}", workers=workers, chunk_bytes=20_000, progress=False)
    manifest = convert_criteo(
        path, tmp_path / "skip", on_bad_line="skip", workers=1, chunk_bytes=20_000, progress=False
    )
    assert manifest["rows"] == 2_999 and manifest["bad_lines"] == 1
    reader = CriteoDataset(path, 1000, on_bad_line="skip")
    assert sum(b.labels.numel() for b in reader) == 2_999 and reader.bad_lines == 1


def test_a_corrupt_gz_gives_one_line_naming_the_file(
    days: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = days[1].read_bytes()
    corrupt = tmp_path / "day.tsv.gz"
    corrupt.write_bytes(data[: len(data) // 2] + bytes(64) + data[len(data) // 2 + 64 :])
    assert main(["criteo", str(corrupt), str(tmp_path / "out"), "--workers", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {corrupt}: ") and "corrupt" in err, err
