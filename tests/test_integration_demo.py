"""The little demo (examples/little_demo/main.py) run as a user runs it: a subprocess on 2 ranks.

Runs that do not depend on each other start together (their own folders), so that one's start-up
(imports, spawning ranks, planning) overlaps another's on this 2-core machine.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from recsdk.data import CRITEO_SPARSE_FEATURES, write_synthetic_criteo
from recsdk.embedding import replay

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "little_demo" / "main.py"
SERVE = ROOT / "examples" / "little_demo" / "serve.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TABLE_KEYS = {"module", "size", "capacity", "inserts", "evictions", "admission_rejects", "lookups", "hits", "hit_rate"}
CACHE_KEYS = {"cache_slots", "cache_lookups", "cache_hits", "cache_hit_rate", "swap_ins", "swap_outs"} | {
    "store_rows_used"
}
# The random-data runs: long enough for the target attention to find the history's signal.
RANDOM_STEPS = 60
# name -> (a started demo, its logs' name: ``start_demo``'s ``log``, also its --out folder if it has one)
Runs = dict[str, tuple[subprocess.Popen[str], Path]]
# Eval AUC with the history minus without it, after RANDOM_STEPS steps: about 0.10 to 0.13 over
# seeds 0, 1, 2 (0.7769 vs 0.6480 for seed 0); after the default 600 steps about 0.10.
HISTORY_AUC_MARGIN = 0.05


def run_demo(*flags: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """Run the demo with ``flags``; a hung run fails the test instead of blocking it."""
    return subprocess.run(
        [sys.executable, str(DEMO), *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def start_demo(*flags: str, log: Path) -> subprocess.Popen[str]:
    """Start the demo with ``flags``, its stdout and stderr going to ``log``.stdout and ``log``.stderr
    (files, not pipes: a test waits on one run while others write)."""
    with open(f"{log}.stdout", "w") as stdout, open(f"{log}.stderr", "w") as stderr:
        return subprocess.Popen([sys.executable, str(DEMO), *flags], cwd=ROOT, stdout=stdout, stderr=stderr, text=True)


def finish_demo(proc: subprocess.Popen[str], log: Path, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """Wait for a run of :func:`start_demo`; a hung run is killed and fails the test."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    stdout, stderr = Path(f"{log}.stdout").read_text(), Path(f"{log}.stderr").read_text()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    """Kill the runs still going (a test failed before waiting for them)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def check_summary(out: Path, steps: int) -> dict:
    """summary.json's keys and values, and a real PNG beside it."""
    summary = json.loads((out / "summary.json").read_text())
    for key in ("world_size", "steps", "samples_per_s", "final_train_loss", "eval_auc", "eval_history", "tables"):
        assert key in summary, sorted(summary)
    assert summary["world_size"] == 2
    assert summary["steps"] == steps
    assert isinstance(summary["eval_auc"], float) and 0.0 <= summary["eval_auc"] <= 1.0
    assert summary["eval_history"][-1] == {"step": steps, "auc": summary["eval_auc"]}
    assert math.isfinite(summary["final_train_loss"]) and summary["final_train_loss"] > 0
    assert summary["samples_per_s"] > 0
    for name, stats in summary["tables"].items():
        assert set(stats) in (TABLE_KEYS, TABLE_KEYS | CACHE_KEYS), name
        assert 0 < stats["size"] <= stats["capacity"], (name, stats)
        assert stats["inserts"] >= stats["size"], (name, stats)
        assert 0.0 <= stats["hit_rate"] <= 1.0
    assert (out / "training.png").read_bytes()[:8] == PNG_MAGIC
    return summary


@pytest.fixture(scope="module")
def random_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """The three runs on random data, started together: name -> (process, its --out folder).

    ``history``: the default; ``no_history``: the same without the history, no evals but the
    last; ``cache``: a device cache on the row-wise tables, publishing a version every 20 steps
    to ``cache_publish`` beside its folder.
    """
    root = tmp_path_factory.mktemp("random")
    base = ["--world-size", "2", "--steps", str(RANDOM_STEPS)]
    publish = ["--publish-dir", str(root / "cache_publish"), "--publish-every", "20"]
    flags = {
        "history": [*base, "--eval-every", "20"],
        "no_history": [*base, "--eval-every", "0", "--no-history"],
        "cache": [*base, "--eval-every", "20", "--cache-load-factor", "0.25", *publish],
    }
    runs = {
        name: (start_demo(*f, "--out", str(root / name), log=root / name), root / name) for name, f in flags.items()
    }
    yield runs
    stop_all([proc for proc, _ in runs.values()])


@pytest.fixture(scope="module")
def random_run(
    random_runs: Runs,
) -> tuple[subprocess.CompletedProcess[str], dict]:
    """The demo on random data, with the history (the default): its output and summary."""
    started, out = random_runs["history"]
    proc = finish_demo(started, out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, check_summary(out, steps=RANDOM_STEPS)


def test_demo_on_random_data_writes_summary_and_plot(random_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    proc, summary = random_run
    assert [e["step"] for e in summary["eval_history"]] == [20, 40, 60]
    assert summary["history"] is True
    assert set(summary["tables"]) == {"user", "item", "category", "tags"}
    # The candidate and the history share the item table of the unpooled collection.
    assert {name: s["module"] for name, s in summary["tables"].items()} == {
        "user": "ebc",
        "category": "ebc",
        "tags": "ebc",
        "item": "ec",
    }
    # Both collections read their own field of the batch, so the pipeline runs both input dists
    # ahead; on a CPU device on TorchRec's schedule, without the host thread.
    assert summary["host_thread"] is False
    assert summary["host_staged_modules"] == []
    assert summary["inline_modules"] == ["ebc", "ec"]
    # The user table admits an id on its second sighting: the long tail is refused at first.
    assert summary["tables"]["user"]["admission_rejects"] > 0
    assert 0.5 < summary["best_possible_auc"] <= 1.0
    # The summary table is printed too, one row per table.
    assert "eval AUC" in proc.stdout
    assert all(any(line.startswith(name) for line in proc.stdout.splitlines()) for name in summary["tables"])


def test_the_history_raises_the_eval_auc(
    random_runs: Runs,
    random_run: tuple[subprocess.CompletedProcess[str], dict],
) -> None:
    # The same samples and labels (the teacher reads the history either way), the same steps; the
    # model just does not see the history.
    started, out = random_runs["no_history"]
    proc = finish_demo(started, out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    without = check_summary(out, steps=RANDOM_STEPS)
    assert without["history"] is False
    assert without["inline_modules"] == ["ebc", "ec"]
    assert without["best_possible_auc"] == random_run[1]["best_possible_auc"]
    with_history = random_run[1]["eval_auc"]
    assert with_history > without["eval_auc"] + HISTORY_AUC_MARGIN, (with_history, without["eval_auc"])


def test_a_device_cache_trains_the_same_model(
    random_runs: Runs,
    random_run: tuple[subprocess.CompletedProcess[str], dict],
) -> None:
    # The row-wise tables (user, item) keep every row in host memory and a quarter in the fused
    # kernel: a lossless cache, so the run is the all-resident run, bit for bit. The run also
    # publishes versions for serving (every 20 steps), which changes nothing in the training.
    started, out = random_runs["cache"]
    published = out.parent / "cache_publish"
    proc = finish_demo(started, out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cached = check_summary(out, steps=RANDOM_STEPS)
    resident = random_run[1]
    assert cached["eval_history"] == resident["eval_history"]
    assert cached["final_train_loss"] == resident["final_train_loss"]
    for name in ("user", "item"):
        stats = cached["tables"][name]
        assert CACHE_KEYS <= set(stats), name
        assert stats["swap_ins"] > stats["cache_slots"] and 0.0 < stats["cache_hit_rate"] < 1.0, (name, stats)
        assert stats["store_rows_used"] == stats["size"]
    assert "cache hit rate" in proc.stdout
    # A version every 20 steps: full, then deltas; the last one rebuilt holds every id trained.
    assert [(r["version"], r["kind"], r["step"]) for r in cached["published"]] == [
        (0, "full", 20),
        (1, "delta", 40),
        (2, "delta", 60),
    ]
    state = replay(published)
    assert {name: t.ids.numel() for name, t in state.tables.items()} == {
        name: s["size"] for name, s in cached["tables"].items()
    }
    assert "published 3 versions" in proc.stdout
    # The demo's server, started on what the trainer published (it catches up to the last
    # version at once), and at the end the trainer's final eval scores, served.
    flags = ["--world-size", "2", "--steps", str(RANDOM_STEPS), "--publish-dir", str(published)]
    flags += ["--trainer-out", str(out), "--interval-s", "0.05", "--timeout-s", "30"]
    serve = subprocess.run(
        [sys.executable, str(SERVE), *flags], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert serve.returncode == 0, serve.stdout[-2000:] + serve.stderr[-4000:]
    served = [line.split()[:4] for line in serve.stdout.splitlines() if line.startswith("version")]
    assert served[-1] == ["version", "2", "(delta,", "step"], serve.stdout
    diff = float(serve.stdout.split("max |served - trainer's final eval| = ")[1].split()[0])
    assert diff <= 1e-6, serve.stdout


def test_demo_on_a_criteo_file_with_show_click_tables(tmp_path: Path) -> None:
    # 3000 lines: 1500 per rank, 23 batches of 64, 8 held out, so 20 steps run into a second epoch.
    # The file tables admit and evict by show/click score: the batches carry their clicks.
    data = write_synthetic_criteo(tmp_path / "day_0.tsv", num_lines=3000, seed=3)
    out = tmp_path / "out"
    flags = ["--world-size", "2", "--data", "criteo", "--data-path", str(data), "--steps", "20", "--batch-size", "64"]
    proc = run_demo(*flags, "--eval-every", "0", "--id-policy", "showclick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = check_summary(out, steps=20)
    assert summary["data"] == "criteo" and summary["id_policy"] == "showclick"
    assert set(summary["tables"]) == {f"t_{name}" for name in CRITEO_SPARSE_FEATURES}
    assert summary["best_possible_auc"] is None
    tables = summary["tables"].values()
    assert sum(t["admission_rejects"] for t in tables) > 0 and sum(t["inserts"] for t in tables) > 0


def test_converted_criteo_trains_exactly_as_the_tsv(tmp_path: Path) -> None:
    # The README's convert-then-train, as a user runs it; on one rank both readers yield the
    # same batches, so the two runs are the same training, loss for loss.
    data = write_synthetic_criteo(tmp_path / "day_0.tsv", num_lines=2000, seed=4)
    convert = [sys.executable, "-m", "recsdk.data.convert", "criteo", str(data), str(tmp_path / "day_0_columnar")]
    converted = subprocess.run(convert, capture_output=True, text=True, timeout=300, check=False)
    assert converted.returncode == 0, converted.stderr[-4000:]
    assert "2,000 rows from 1 file(s)" in converted.stdout
    summaries = {}
    for kind, path in (("criteo", data), ("columnar", tmp_path / "day_0_columnar")):
        out = tmp_path / f"out_{kind}"
        flags = ["--world-size", "1", "--data", kind, "--data-path", str(path), "--steps", "30", "--batch-size", "64"]
        proc = run_demo(*flags, "--eval-every", "10", "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-4000:]
        summaries[kind] = json.loads((out / "summary.json").read_text())
        assert summaries[kind]["data"] == kind
    criteo, columnar = summaries["criteo"], summaries["columnar"]
    assert columnar["eval_history"] == criteo["eval_history"]
    assert columnar["final_train_loss"] == criteo["final_train_loss"]
    assert columnar["tables"] == criteo["tables"]


@pytest.fixture(scope="module")
def refused_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Two runs refused before any rank starts, started together: ``steps_0`` (``--steps 0``) and
    ``publish_file`` (``--publish-dir`` names ``file``, a file beside their logs)."""
    root = tmp_path_factory.mktemp("refused")
    (root / "file").write_text("not a folder")
    flags = {
        "steps_0": ["--world-size", "2", "--steps", "0"],
        "publish_file": ["--world-size", "2", "--publish-dir", str(root / "file")],
    }
    runs = {name: (start_demo(*f, log=root / name), root / name) for name, f in flags.items()}
    yield runs
    stop_all([proc for proc, _ in runs.values()])


def test_a_bad_flag_exits_with_one_line(refused_runs: Runs) -> None:
    # The whole process as a user runs it: no import-time warning before the one line.
    proc = finish_demo(*refused_runs["steps_0"], timeout_s=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--steps" in lines[0]
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def demo_main() -> Any:
    """examples/little_demo/main.py as a module (its own imports, dataset and model, beside it)."""
    sys.path.insert(0, str(DEMO.parent))
    try:
        spec = importlib.util.spec_from_file_location("little_demo_main", DEMO)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(DEMO.parent))


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--data", "criteo", "--data-path", "does/not/exist.tsv"], "does/not/exist.tsv"),
        (["--data", "criteo", "--data-path", "does/not/exist.tsv", "--no-history"], "--no-history"),
        (["--data", "columnar", "--data-path", "does/not/exist"], "does/not/exist"),
        (["--cache-load-factor", "1.5"], "--cache-load-factor"),
    ],
)
def test_bad_flags_are_refused_naming_them(
    demo_main: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    # What the process above prints and exits with comes from parse_args, here without the imports.
    with pytest.raises(SystemExit) as exit_info:
        demo_main.parse_args(["--world-size", "2", "--out", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], err
    assert out == ""


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_demo_data_resumes_under_a_stateful_dataloader(demo_main: Any, num_workers: int) -> None:
    """The demo's synthetic data has a data position: a StatefulDataLoader's state resumes it."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = sys.modules["dataset"]  # imported by the demo's main

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(dataset.HistoryRecDataset(8, 10, seed=1), batch_size=None, num_workers=num_workers)

    everything = list(loader())
    first = loader()
    it = iter(first)
    taken = [next(it) for _ in range(4)]
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    rest = list(resumed)
    assert len(taken) + len(rest) == len(everything) == 10
    for got, want in zip(taken + rest, everything, strict=True):
        assert torch.equal(got.labels, want.labels)
        assert torch.equal(got.sparse_features.values(), want.sparse_features.values())
        assert torch.equal(got.sequence_features.values(), want.sequence_features.values())


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--out", "{file}"], "--out {file}: exists and is not a folder"),
        (["--checkpoint-dir", "{file}"], "--checkpoint-dir {file}: exists and is not a folder"),
        (["--publish-dir", "{file}/pub"], "--publish-dir {file}/pub: cannot be created (Not a directory)"),
        (["--publish-dir", "{tmp}/same", "--checkpoint-dir", "{tmp}/same/"], "are the same folder"),
    ],
)
def test_output_folders_are_checked_before_ranks_spawn(
    demo_main: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    (tmp_path / "file").write_text("not a folder")
    subst = {"file": str(tmp_path / "file"), "tmp": str(tmp_path)}
    with pytest.raises(SystemExit) as exit_info:
        demo_main.parse_args(["--world-size", "2", "--out", str(tmp_path / "out"), *(f.format(**subst) for f in flags)])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and named.format(**subst) in lines[0], err
    assert out == ""


def test_an_unusable_output_folder_exits_with_one_line_before_any_rank(refused_runs: Runs) -> None:
    started, log = refused_runs["publish_file"]
    proc = finish_demo(started, log, timeout_s=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"little_demo: error: --publish-dir {log.parent / 'file'}: exists and is not a folder"
    ]


def test_a_resume_under_other_flags_names_the_differences_in_one_line(
    demo_main: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    resume = sys.modules["resume"]  # imported by the demo's main
    ckpt = tmp_path / "ckpt"
    base = ["--world-size", "2", "--out", str(tmp_path / "out"), "--checkpoint-dir", str(ckpt)]
    monkeypatch.setattr(resume, "latest_checkpoint", lambda directory: None)
    demo_main.parse_args([*base, "--batch-size", "64"])  # a first run: its flags are recorded
    assert json.loads((ckpt / resume.FLAGS_FILE).read_text())["batch_size"] == 64
    monkeypatch.setattr(resume, "latest_checkpoint", lambda directory: str(ckpt / "step_00000100"))
    demo_main.parse_args([*base, "--batch-size", "64", "--world-size", "1", "--timeout-s", "60"])  # may change
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        demo_main.parse_args([*base, "--batch-size", "128", "--seed", "3", "--steps", "900"])  # 600 recorded
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        f"little_demo: error: --checkpoint-dir {ckpt} holds checkpoints of a run with other flags: "
        "--steps 600 -> 900, --batch-size 64 -> 128, --seed 0 -> 3; resume with its flags, or give another "
        "--checkpoint-dir"
    ]
