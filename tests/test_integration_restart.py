"""A killed rank under ``torchrun --max-restarts``: the group restarts, resumes from the latest
checkpoint of ``--checkpoint-dir`` and ends with the result of a run never killed.

Two runs of the little demo under ``torchrun --nproc_per_node=2`` with the same flags, a
checkpoint every 10 steps: one left alone, and one whose rank 1 is killed with SIGKILL once a
checkpoint exists (batches read ahead, between checkpoints). TorchElastic stops the other rank
and starts both again; the demo loads the latest checkpoint (model, optimizer, id tables, each
rank's data position and RNG) and trains the remaining steps.
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
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    return proc.returncode, stdout, stderr


def test_torchrun_restarts_a_killed_rank_and_the_job_ends_as_never_killed(tmp_path: Path) -> None:
    code, stdout, stderr = _finish(_torchrun(tmp_path / "whole_ckpt", tmp_path / "whole"), 300)
    assert code == 0, stdout[-2000:] + stderr[-4000:]
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())

    checkpoints = tmp_path / "killed_ckpt"
    proc = _torchrun(checkpoints, tmp_path / "killed")
    deadline = time.monotonic() + 240
    while not (checkpoints / "step_00000022").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = _workers(proc.pid)
    assert len(workers) == 2 and proc.poll() is None, (workers, proc.poll())
    os.kill(workers[-1], signal.SIGKILL)
    code, stdout, stderr = _finish(proc, 300)
    assert code == 0, stdout[-2000:] + stderr[-4000:]
    killed = json.loads((tmp_path / "killed" / "summary.json").read_text())

    assert killed["resumed_from"] is not None and "step_000000" in killed["resumed_from"]
    assert "resumed from" in stdout
    for key in ("final_train_loss", "eval_auc", "eval_history", "tables", "steps"):
        assert killed[key] == whole[key], key
