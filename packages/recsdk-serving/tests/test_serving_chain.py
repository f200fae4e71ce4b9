"""The chain of trust: ServingModel and ``inspect`` refuse the same tampered or unreadable versions."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from serving_models import Recommender, copy_versions

from recsdk.embedding import PublicationError
from recsdk.embedding.testing import edit_manifest
from recsdk.serving import ServingModel
from recsdk.serving.inspect_root import inspect_root


def _edited_step(root: Path) -> None:
    edit_manifest(root, 2, lambda m: m.update(step=999), fix_crc=False)


def _wrong_directory(root: Path) -> None:
    shutil.rmtree(root / "00000002")
    shutil.copytree(root / "00000001", root / "00000002")


def _replaced_parent(root: Path) -> None:  # 1 republished (another CRC-32) after 2 was published on top of it
    edit_manifest(root, 1, lambda m: m.update(step=998), fix_crc=True)


def _escaping_path(root: Path) -> None:
    def change(m: dict) -> None:
        m["files"]["../../outside.safetensors"] = m["files"].pop("dense.safetensors")
        m["dense"]["file"] = "../../outside.safetensors"

    edit_manifest(root, 2, change, fix_crc=True)


def _full_with_parent(root: Path) -> None:
    edit_manifest(root, 2, lambda m: m.update(kind="full"), fix_crc=True)


def _symlinked_version(root: Path) -> None:
    os.rename(root / "00000002", root.parent / "elsewhere")
    os.symlink(root.parent / "elsewhere", root / "00000002")


def _symlinked_file(root: Path) -> None:
    dense = root / "00000002" / "dense.safetensors"
    os.rename(dense, root.parent / "dense.safetensors")
    os.symlink(root.parent / "dense.safetensors", dense)


def _not_json(root: Path) -> None:
    (root / "00000002" / "manifest.json").write_bytes(b"\xff\xfe not json")


TAMPERED = [
    (_edited_step, r"manifest\.json' is damaged: its content has another CRC-32"),
    (_wrong_directory, "records version 1 in the directory of version 2"),
    (_replaced_parent, r"version 2 was published on top of a version 1 whose manifest CRC-32 was [0-9a-f]{8}.*since"),
    (_escaping_path, r"file '\.\./\.\./outside\.safetensors' is not a plain relative path"),
    (_full_with_parent, "a full version with parent 1"),
    (_symlinked_version, "version 2 under .* is a symbolic link"),
    (_symlinked_file, r"dense\.safetensors' is a symbolic link"),
    (_not_json, r"manifest\.json' cannot be read as JSON"),
]


@pytest.mark.parametrize(("tamper", "match"), TAMPERED, ids=[t.__name__.strip("_") for t, _ in TAMPERED])
def test_serving_and_inspect_refuse_a_tampered_version_alike(
    tmp_path: Path, published: tuple[Path, list], tamper: Callable[[Path], None], match: str
) -> None:
    root = copy_versions(published, tmp_path / "pub", [0])
    serving = ServingModel(Recommender("cpu"), root)
    copy_versions(published, root, [1, 2])
    tamper(root)
    with pytest.raises(PublicationError, match=match):
        serving.refresh()
    assert serving.version == 1  # 1 applied (whole), then 2 refused; the model keeps serving 1
    lines, ok = inspect_root(root)
    assert not ok and lines[-1].startswith("chain 0 -> 2: BROKEN: ") and re.search(match, lines[-1]), lines


def test_an_unreadable_version_is_named_by_inspect_and_serving(
    tmp_path: Path, published: tuple[Path, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_versions(published, tmp_path / "pub", [0, 1])
    serving = ServingModel(Recommender("cpu"), root)
    copy_versions(published, root, [2])
    unreadable = str(root / "00000002" / "manifest.json")
    real_open = os.open

    def fake_open(path: str, *args: object, **kwargs: object) -> int:
        if os.fspath(path) == unreadable:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    with pytest.raises(PublicationError, match=r"version 2 under .* is unreadable: .*Permission denied"):
        serving.refresh()
    assert serving.version == 1
    lines, ok = inspect_root(root)
    assert not ok
    assert any(line.split()[:2] == ["2", "UNREADABLE:"] and "Permission denied" in line for line in lines), lines
    assert "BROKEN" in lines[-1] and "version 2 under" in lines[-1]


def test_inspect_never_prints_a_traceback(tmp_path: Path) -> None:
    not_a_root = tmp_path / "file"
    not_a_root.write_text("x")
    command = [sys.executable, "-m", "recsdk.serving", "inspect", str(not_a_root)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{not_a_root}: BROKEN: PublicationError: publication root {str(not_a_root)!r} "
        "cannot be listed: Not a directory"
    ]
