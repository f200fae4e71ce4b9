"""The publication reader's chain of trust: manifest CRC-32, version = directory, kind/parent,
paths inside the version, no symbolic links; replay checks each delta's parent manifest. The
manifest as build_manifest writes it, and verify_files, the file check of publications and
checkpoints."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_embedding_change_tracker import _write_version

from recsdk.embedding import PublicationError, list_versions, read_version, replay
from recsdk.embedding.file_checksum import checksum, verify_files
from recsdk.embedding.publication import (
    DENSE_FILE,
    FORMAT_VERSION,
    PUBLICATION_MANIFEST,
    build_manifest,
    check_parent,
    encode_rows,
    read_manifest,
    table_file,
    version_path,
)
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


def _build(root: Path, version: int, ids: list[int], parent_crc: int | None) -> dict:
    """Write one version's files, then its manifest as build_manifest makes it."""
    directory = Path(version_path(root, version))
    (directory / "tables" / "t").mkdir(parents=True)
    tensors = encode_rows(torch.ones(len(ids), 4), "float16")
    tensors.update(ids=torch.tensor(ids, dtype=torch.int64), deleted=torch.zeros(0, dtype=torch.int64))
    save_file(tensors, str(directory / table_file("t", 0)))
    dense = {"w": torch.ones(2)}
    save_file(dense, str(directory / DENSE_FILE))
    names = [table_file("t", 0), DENSE_FILE]
    records = {n: {"size": os.path.getsize(directory / n), "crc32": checksum(str(directory / n))} for n in names}
    manifest = build_manifest(
        version=version,
        step=10 * version,
        token=f"token{version}",
        dtype="float16",
        world_size=1,
        tables={"t": {"module": "ebc", "kind": "bag", "embedding_dim": 4}},
        written={"t": {"files": [table_file("t", 0)], "upserted": len(ids), "deleted": 0}},
        dense=dense,
        files=records,
        parent_manifest_crc32=parent_crc,
    )
    (directory / PUBLICATION_MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_a_manifest_built_by_build_manifest_is_read_back_as_written(tmp_path: Path) -> None:
    full = _build(tmp_path, 0, [5, 1], None)
    delta = _build(tmp_path, 1, [7], full["manifest_crc32"])
    assert read_manifest(tmp_path, 0) == full and read_manifest(tmp_path, 1) == delta
    assert (full["kind"], full["parent"], delta["kind"], delta["parent"]) == ("full", None, "delta", 0)
    assert full["tables"]["t"]["upserted"] == 2 and full["dense"]["tensors"]["w"] == {"shape": [2], "dtype": "float32"}
    assert check_parent(delta, full) is None
    assert replay(tmp_path, 1).tables["t"].ids.tolist() == [1, 5, 7]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dtype": "int4"}, r"dtype must be one of \['float16', 'float32', 'uint8'\], got 'int4'"),
        ({"written": {}}, r"written has no part for the tables \['t'\]"),
        ({"version": 0, "parent_manifest_crc32": 1}, "version 0 cannot be a delta"),
    ],
)
def test_build_manifest_refuses_what_the_format_cannot_hold(change: dict, match: str) -> None:
    arguments = {
        "version": 3,
        "step": 1,
        "token": "t",
        "dtype": "float32",
        "world_size": 1,
        "tables": {"t": {}},
        "written": {"t": {"files": [], "upserted": 0, "deleted": 0}},
        "dense": {},
        "files": {},
        "parent_manifest_crc32": None,
    }
    with pytest.raises(ValueError, match=match):
        build_manifest(**{**arguments, **change})


def test_verify_files_names_each_file_missing_truncated_damaged_or_linked(tmp_path: Path) -> None:
    names = ["a", "b", "c", "d", "e"]
    for name in names:
        (tmp_path / name).write_bytes(b"0123456789")
    files = {n: {"size": 10, "crc32": checksum(str(tmp_path / n))} for n in names}
    assert verify_files(str(tmp_path), files) == []
    (tmp_path / "a").unlink()
    (tmp_path / "b").write_bytes(b"012345")
    (tmp_path / "c").write_bytes(b"0123456780")
    (tmp_path / "d").unlink()
    (tmp_path / "d").symlink_to(tmp_path / "e")
    problems = verify_files(str(tmp_path), files)
    assert [p.split("'")[1].rsplit("/", 1)[1] for p in problems] == ["a", "b", "c", "d"], problems
    assert "is missing" in problems[0] and "has 6 bytes, the manifest recorded 10" in problems[1]
    assert "has CRC-32" in problems[2] and "(damaged)" in problems[2] and "symbolic link" in problems[3]
    assert [p.split("'")[1].rsplit("/", 1)[1] for p in verify_files(str(tmp_path), files, checksums=False)] == [
        "a",
        "b",
        "d",
    ]
    assert verify_files(str(tmp_path), files, ["e", "c"], checksums=False) == []
