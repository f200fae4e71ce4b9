"""``python -m recsdk.serving inspect ROOT`` on a root that serves, a broken one and an empty one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from serving_models import copy_versions

from recsdk.serving.inspect_root import inspect_root


def test_inspect_lists_the_versions_and_checks_the_chain(tmp_path: Path, published) -> None:
    root = copy_versions(published, tmp_path / "pub", [0, 1, 2])
    proc = subprocess.run(
        [sys.executable, "-m", "recsdk.serving", "inspect", str(root)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{root}: 3 complete versions, 0 to 2"
    assert [line.split()[:3] for line in lines[2:5]] == [["0", "full", "-"], ["1", "delta", "0"], ["2", "delta", "1"]]
    assert lines[-1].startswith("chain 0 -> 2: complete and intact")


def test_inspect_names_a_missing_version_and_a_damaged_file(tmp_path: Path, published) -> None:
    root = copy_versions(published, tmp_path / "pub", [0, 1, 3])
    damaged = root / "00000001" / "dense.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x01")
    lines, ok = inspect_root(root)
    assert not ok
    assert "version 2 is missing" in lines[-1] and "dense.safetensors" in lines[-1], lines[-1]
    assert inspect_root(tmp_path / "nothing") == ([f"{tmp_path / 'nothing'}: no complete version"], False)
