"""A killed rank under ``torchrun --max-restarts``: the group restarts, resumes from the latest
checkpoint of ``--checkpoint-dir`` and ends with the result of a run never killed.

Two runs of the little demo under ``torchrun --nproc_per_node=2`` with the same flags, a
checkpoint every 10 steps: one left alone, and one whose rank 1 is killed with SIGKILL once a
checkpoint exists (batches read ahead, between checkpoints). TorchElastic stops the other rank
and starts both again; the demo loads the latest checkpoint (model, optimizer, id tables, each
rank's data position and RNG) and trains the remaining steps. The two runs start together (their
own ports and folders): each one's start-up (imports, rendezvous, planning) overlaps the other's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from recsdk.data.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "little_demo" / "main.py"
FLAGS = ["--steps", "50", "--batch-size", "64", "--eval-every", "25", "--eval-batches", "2", "--timeout-s", "60"]


def _torchrun(checkpoints: Path, out: Path) -> subprocess.Popen[str]:
    """The demo under torchrun, its stdout and stderr going to ``out``.stdout and ``out``.stderr
    (files, not pipes: the test waits on one run while the other one writes)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--max-restarts=3",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(DEMO),
        *FLAGS,
        *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "10", "--out", str(out)),
    ]
    with open(f"{out}.stdout", "w") as stdout, open(f"{out}.stderr", "w") as stderr:
        return subprocess.Popen(command, cwd=ROOT, stdout=stdout, stderr=stderr, text=True)


def _workers(agent: int) -> list[int]:
    """The demo's rank processes: the torchrun agent's children running main.py."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == agent and b"main.py" in cmdline:
            found.append(int(entry))
    return sorted(found)


def _finish(proc: subprocess.Popen[str], out: Path, timeout_s: float) -> tuple[int, str, str]:
    """The exit code (killed after ``timeout_s``), stdout and stderr of the run writing to ``out``."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode, Path(f"{out}.stdout").read_text(), Path(f"{out}.stderr").read_text()


def test_torchrun_restarts_a_killed_rank_and_the_job_ends_as_never_killed(tmp_path: Path) -> None:
    whole_run = _torchrun(tmp_path / "whole_ckpt", tmp_path / "whole")
    checkpoints = tmp_path / "killed_ckpt"
    proc = _torchrun(checkpoints, tmp_path / "killed")
    try:
        _kill_rank_1_after_a_checkpoint(proc, checkpoints)
    except BaseException:
        for run in (whole_run, proc):  # torchrun stops its ranks on SIGTERM
            run.terminate()
        raise
    code, stdout, stderr = _finish(whole_run, tmp_path / "whole", 300)
    assert code == 0, stdout[-2000:] + stderr[-4000:]
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())

    code, stdout, stderr = _finish(proc, tmp_path / "killed", 300)
    assert code == 0, stdout[-2000:] + stderr[-4000:]
    killed = json.loads((tmp_path / "killed" / "summary.json").read_text())

    assert killed["resumed_from"] is not None and "step_000000" in killed["resumed_from"]
    assert "resumed from" in stdout
    for key in ("final_train_loss", "eval_auc", "eval_history", "tables", "steps"):
        assert killed[key] == whole[key], key


def _kill_rank_1_after_a_checkpoint(proc: subprocess.Popen[str], checkpoints: Path) -> None:
    """SIGKILL to rank 1 once the run's second checkpoint is written (batches read ahead)."""
    deadline = time.monotonic() + 240
    while not (checkpoints / "step_00000022").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = _workers(proc.pid)
    assert len(workers) == 2 and proc.poll() is None, (workers, proc.poll())
    os.kill(workers[-1], signal.SIGKILL)
