"""The publication reader's chain of trust: manifest CRC-32, version = directory, kind/parent,
paths inside the version, no symbolic links; replay checks each delta's parent manifest."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from test_embedding_change_tracker import _write_version

from recsdk.embedding import PublicationError, list_versions, read_version, replay
from recsdk.embedding.publication import FORMAT_VERSION, read_manifest
from recsdk.embedding.publication_chain import plan_chain
from recsdk.embedding.testing import edit_manifest


def _edit(root: Path, version: int, change: Callable[[dict], None], fix_crc: bool = True) -> None:
    edit_manifest(root, version, change, fix_crc=fix_crc)


def _two(root: Path) -> None:
    _write_version(root, 0, "full", [1, 2, 3], [], 0.0)
    _write_version(root, 1, "delta", [2], [3], 1.0)


@pytest.mark.parametrize(
    ("change", "fix_crc", "match"),
    [
        (lambda m: m.update(step=5), False, "its content has another CRC-32"),
        (lambda m: m.update(version=0), True, "records version 0 in the directory of version 1"),
        (lambda m: m.update(parent=None), True, "a delta with parent None"),
        (lambda m: m.update(kind="partial"), True, "kind 'partial'"),
        (lambda m: m.update(format_version=1), True, f"has format_version 1; this recsdk reads {FORMAT_VERSION}"),
        (lambda m: m["files"].update({"/etc/passwd": {"size": 1, "crc32": 1}}), True, "not a plain relative path"),
        (lambda m: m["dense"].update(file="tables/../dense.safetensors"), True, "not a plain relative path|no size"),
    ],
)
def test_publication_manifest_disagreeing_with_itself_is_refused(
    tmp_path: Path, change: Callable[[dict], None], fix_crc: bool, match: str
) -> None:
    _two(tmp_path)
    _edit(tmp_path, 1, change, fix_crc)
    with pytest.raises(PublicationError, match=match):
        read_version(tmp_path, 1)
    read_version(tmp_path, 0)  # the other version is untouched


def test_publication_replay_refuses_a_delta_on_a_replaced_parent(tmp_path: Path) -> None:
    _two(tmp_path)
    assert replay(tmp_path, 1).tables["t"].ids.tolist() == [1, 2]
    _edit(tmp_path, 0, lambda m: m.update(step=7))  # republished: whole, but not what 1 was published on
    with pytest.raises(PublicationError, match=r"version 1 was published on top of a version 0 .*\(replaced since\)"):
        replay(tmp_path, 1)
    assert "replaced since" in plan_chain(tmp_path).problems[0]


def test_publication_symlinks_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "pub"
    _two(root)
    table = root / "00000001" / "tables" / "t"
    os.rename(table, tmp_path / "t")
    os.symlink(tmp_path / "t", table)  # a directory on the way to a data file
    with pytest.raises(PublicationError, match=r"tables/t' is a symbolic link"):
        read_version(root, 1)
    os.rename(root / "00000000", tmp_path / "v0")
    os.symlink(tmp_path / "v0", root / "00000000")
    assert list_versions(root) == [0, 1]  # listed, so that the refusal names it
    with pytest.raises(PublicationError, match=r"version 0 under .* is a symbolic link"):
        read_manifest(root, 0)
