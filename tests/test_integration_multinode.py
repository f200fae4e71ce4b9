"""The little demo launched as on two machines: ``torchrun --nnodes=2``, one process per node.

Two torchrun agents (the "nodes") rendezvous on localhost through c10d on a free port, each
starting one rank. That runs the multi-node path of the demo: torchrun's node rank
(``GROUP_RANK``), local rank and global rank, the env:// rendezvous of the device group and the
gloo host group over both nodes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from recsdk.data.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "little_demo" / "main.py"
STEPS = 10
RANK_LINE = re.compile(r"^rank (\d+) of (\d+): node (\d+), local rank (\d+), trained (\d+) steps$", re.M)


def _node(port: int, is_host: bool, out: Path) -> subprocess.Popen[str]:
    """One node's torchrun agent with one rank; node 0 hosts the rendezvous store."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id=little_demo_{port}",
        f"--rdzv_conf=join_timeout=60,is_host={int(is_host)}",
        str(DEMO),
        *("--steps", str(STEPS), "--batch-size", "64", "--eval-every", "0", "--eval-batches", "2"),
        *("--timeout-s", "60", "--out", str(out)),
    ]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_demo_trains_on_two_nodes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    port = free_port()
    nodes = [_node(port, is_host=True, out=out), _node(port, is_host=False, out=out)]
    deadline = time.monotonic() + 150
    outputs: list[tuple[int, str, str]] = []
    try:
        for proc in nodes:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((proc.returncode, stdout, stderr))
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for i, (code, stdout, stderr) in enumerate(outputs):
        assert code == 0, f"node process {i} exited with {code}:\n{stdout[-2000:]}\n{stderr[-4000:]}"

    # Each node's log holds the line of its own rank: global rank = node rank (one rank per node).
    ranks = []
    for _, stdout, _ in outputs:
        lines = RANK_LINE.findall(stdout)
        assert len(lines) == 1, stdout
        rank, world, node, local, steps = map(int, lines[0])
        assert (world, local, steps) == (2, 0, STEPS), lines
        assert rank == node, lines
        ranks.append(rank)
    assert sorted(ranks) == [0, 1]

    # Rank 0 (on whichever node the rendezvous made node 0) reports 2 ranks and writes the summary.
    rank0_stdout = next(stdout for (_, stdout, _), r in zip(outputs, ranks, strict=True) if r == 0)
    assert "little demo: 2 rank(s) on cpu (gloo)" in rank0_stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == STEPS
