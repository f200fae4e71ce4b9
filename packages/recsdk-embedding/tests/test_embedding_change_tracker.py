"""RowChangeTracker on hand-made id sequences, and the publication format's reader."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from recsdk.embedding import IdTable, LRUEviction, PublicationError, TTLEviction, read_version, replay
from recsdk.embedding.file_checksum import checksum
from recsdk.embedding.publication import (
    FORMAT_VERSION,
    PUBLICATION_FORMAT,
    PUBLICATION_MANIFEST,
    decode_rows,
    encode_rows,
    manifest_checksum,
    table_file,
    version_path,
)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def publish(table: IdTable, *, full: bool = False, exclude: torch.Tensor | None = None, token: str = "t"):
    """Snapshot and commit at once (a publish that succeeded); returns (ids, deleted) as lists."""
    snap = table.publishing.snapshot(full=full, exclude=exclude)
    table.publishing.commit(snap, token)
    return sorted(snap.ids.tolist()), sorted(snap.deleted.tolist())


def test_a_delta_holds_the_rows_changed_and_the_ids_evicted_since_the_last_version() -> None:
    table = IdTable(3, eviction=LRUEviction())
    changes = table.publishing.track()
    table.find_or_insert(ids(10, 11, 12))
    assert publish(table, full=True) == ([10, 11, 12], [])
    assert publish(table) == ([], [])  # nothing changed
    rows = table.find_or_insert(ids(11))
    changes.changed(rows)  # trained
    assert publish(table) == ([11], [])
    table.find_or_insert(ids(13))  # evicts 10 (least recently used), 13 takes its row
    assert publish(table) == ([13], [10])


def test_an_id_evicted_and_back_before_the_next_version_is_an_upsert_not_a_deletion() -> None:
    table = IdTable(2, eviction=LRUEviction())
    table.publishing.track()
    table.find_or_insert(ids(1, 2))
    publish(table, full=True)
    table.find_or_insert(ids(3))  # evicts 1
    table.find_or_insert(ids(1))  # evicts 2, 1 is back in another row
    assert publish(table) == ([1, 3], [2])


def test_an_id_inserted_and_evicted_between_versions_is_never_published() -> None:
    table = IdTable(2, eviction=TTLEviction(max_idle_steps=1))
    table.publishing.track()
    table.find_or_insert(ids(1))
    publish(table, full=True)
    table.find_or_insert(ids(2))
    table.find_or_insert(ids(1))
    table.find_or_insert(ids(1))  # 2 idle for 2 steps: expired
    assert publish(table) == ([], [])  # 1 untrained, 2 came and went


def test_rows_owed_a_reset_are_left_out_and_published_once_reset() -> None:
    table = IdTable(2, eviction=LRUEviction())
    changes = table.publishing.track()
    table.find_or_insert(ids(1, 2))
    publish(table, full=True)
    table.find_or_insert(ids(3))  # evicts 1; 3's row still holds 1's values until reset
    owed = table.take_reassigned_rows()
    assert publish(table, exclude=owed) == ([], [1])
    changes.changed(owed)  # the batch computes: reset, trained
    assert publish(table) == ([3], [])


def test_a_failed_publish_loses_nothing_and_changes_made_while_writing_are_kept() -> None:
    table = IdTable(4, eviction=LRUEviction())
    table.publishing.track()
    table.find_or_insert(ids(1, 2))
    publish(table, full=True)
    table.find_or_insert(ids(3))
    table.publishing.snapshot(full=False)  # the write failed: no commit
    snap = table.publishing.snapshot(full=False)
    assert sorted(snap.ids.tolist()) == [3]
    table.find_or_insert(ids(4))  # while the version is written (a pipeline's host thread)
    table.publishing.commit(snap, "v")
    assert publish(table) == ([4], [])


def test_a_published_id_that_changes_hands_while_its_version_is_written_is_deleted_next() -> None:
    table = IdTable(1, eviction=LRUEviction())
    table.publishing.track()
    table.find_or_insert(ids(1))
    snap = table.publishing.snapshot(full=True)
    table.find_or_insert(ids(2))  # evicts 1 before the version holding it is committed
    table.publishing.commit(snap, "v")
    assert publish(table) == ([2], [1])


def test_a_state_load_resets_the_tracker_so_the_next_version_is_full() -> None:
    table = IdTable(4)
    changes = table.publishing.track()
    table.find_or_insert(ids(1, 2))
    publish(table, full=True, token="a")
    assert changes.token == "a"
    table.load_state_dict(table.state_dict())
    assert changes.token is None


# ---- the format -------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 0.0), ("float16", 1e-3), ("uint8", None)])
def test_rows_round_trip_within_the_stated_rounding(dtype: str, atol: float | None) -> None:
    weights = torch.randn(50, 8)
    back = decode_rows(encode_rows(weights, dtype))
    if atol is None:  # half a quantization step per row
        step = (weights.max(1).values - weights.min(1).values) / 255
        assert bool(((back - weights).abs() <= step.unsqueeze(1) * 0.5001 + 1e-6).all())
    else:
        assert torch.allclose(back, weights, rtol=0, atol=atol)


def _write_version(root: Path, version: int, kind: str, table_ids: list[int], deleted: list[int], value: float) -> None:
    directory = Path(version_path(root, version))
    (directory / "tables" / "t").mkdir(parents=True)
    tensors = encode_rows(torch.full((len(table_ids), 4), value), "float32")
    tensors["ids"] = torch.tensor(table_ids, dtype=torch.int64)
    tensors["deleted"] = torch.tensor(deleted, dtype=torch.int64)
    save_file(tensors, str(directory / table_file("t", 0)))
    save_file({"w": torch.ones(2)}, str(directory / "dense.safetensors"))
    files = {
        name: {"size": os.path.getsize(directory / name), "crc32": checksum(str(directory / name))}
        for name in (table_file("t", 0), "dense.safetensors")
    }
    manifest = {
        "format": PUBLICATION_FORMAT,
        "format_version": FORMAT_VERSION,
        "version": version,
        "parent": None if kind == "full" else version - 1,
        "kind": kind,
        "step": version,
        "dtype": "float32",
        "tables": {"t": {"embedding_dim": 4, "files": [table_file("t", 0)]}},
        "dense": {"file": "dense.safetensors", "tensors": {"w": {"shape": [2], "dtype": "float32"}}},
        "files": files,
    }
    parent = Path(version_path(root, version - 1)) / PUBLICATION_MANIFEST
    parent_crc = json.loads(parent.read_text())["manifest_crc32"] if parent.exists() else 0  # 0: a missing parent
    manifest["parent_manifest_crc32"] = None if kind == "full" else parent_crc
    manifest["manifest_crc32"] = manifest_checksum(manifest)
    (directory / PUBLICATION_MANIFEST).write_text(json.dumps(manifest))


def test_replay_applies_deletions_then_upserts_and_names_a_missing_version(tmp_path: Path) -> None:
    _write_version(tmp_path, 0, "full", [1, 2, 3], [], 0.0)
    _write_version(tmp_path, 1, "delta", [2, 4], [3], 1.0)
    state = replay(tmp_path, 1)
    assert state.tables["t"].ids.tolist() == [1, 2, 4]
    assert state.tables["t"].embeddings()[:, 0].tolist() == [0.0, 1.0, 1.0]
    _write_version(tmp_path, 3, "delta", [5], [], 3.0)
    with pytest.raises(PublicationError, match="version 2 is missing"):
        replay(tmp_path, 3)


def test_a_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    _write_version(tmp_path, 0, "full", [1, 2], [], 0.0)
    path = Path(version_path(tmp_path, 0)) / table_file("t", 0)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(PublicationError, match=r"rank-00000.safetensors' has \d+ bytes"):
        read_version(tmp_path, 0)
    with pytest.raises(PublicationError, match="not published"):
        read_version(tmp_path, 7)
