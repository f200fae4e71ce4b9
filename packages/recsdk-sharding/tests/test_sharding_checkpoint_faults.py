"""Checkpoint faults on one rank: damaged files never half-load, a full disk leaves nothing behind,
and every rank raises within seconds (far below the process-group timeout) with the model unchanged."""

from __future__ import annotations

import errno
import glob
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sharding_models import sharded_hash_ebc
from test_sharding_checkpoint import _batches, _build, _same, _snapshot, _train

from recsdk.data.testing import run_distributed
from recsdk.embedding import IdTable
from recsdk.sharding import latest_checkpoint, load_checkpoint, save_checkpoint

PG_TIMEOUT_S = 90  # a rank left waiting in a collective raises after this long
RAISE_WITHIN_S = 20.0  # the bound on how long every rank takes to raise


def _shard_file(path: str, rank: int) -> str:
    """The data file rank ``rank`` wrote (DCP, one file per rank)."""
    found = os.path.join(path, f"__{rank}_0.distcp")
    assert os.path.isfile(found), sorted(os.listdir(path))
    return found


def _flip_inside(path: str, key: str, needle: torch.Tensor) -> None:
    """Invert 16 bytes in the middle of the saved bytes of ``needle`` (DCP key ``key``)."""
    info = next(v for k, v in dcp.FileSystemReader(path).read_metadata().storage_data.items() if k.fqn == key)
    raw = needle.contiguous().numpy().tobytes()
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
        start = blob.find(raw)
        assert start >= 0, f"the bytes of {key} are not in its record"
        at = info.offset + start + len(raw) // 2
        f.seek(at)
        old = f.read(16)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in old))


def _timed_call(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
        error = None
    except Exception as e:
        error = {"type": type(e).__name__, "message": str(e), "errno": getattr(e, "errno", None)}
    return {"error": error, "seconds": time.monotonic() - start}


# ---- loading damaged checkpoints ------------------------------------------------------------------


def _damaged_loads(rank: int, world_size: int, root: str) -> dict[str, Any]:
    ddp_model, optimizer = _build()
    sebc = sharded_hash_ebc(ddp_model)
    _train(ddp_model, optimizer, _batches(rank, world_size, 0, 2))
    paths = {}
    needles = {}
    for case in ("flipped_weights", "flipped_rows", "commit_fault", "truncated", "missing"):
        paths[case] = save_checkpoint(ddp_model, optimizer, os.path.join(root, case))
    if rank == 0:
        needles["weight"] = sebc.table_views()["t0"].weight.detach().clone()
        needles["rows"] = sebc.id_tables["t0"].state_dict()["rows"]
        # Rank 0's own shard: t0's weights (loads silently without checksums), t0's id-table rows.
        _flip_inside(paths["flipped_weights"], "hash/ebc/t0/0/weight", needles["weight"])
        _flip_inside(paths["flipped_rows"], "hash/ebc/t0/0/table/rows", needles["rows"])
        # Rank 1's shard: cut in half, or gone.
        shard = _shard_file(paths["truncated"], 1)
        os.truncate(shard, os.path.getsize(shard) // 2)
        os.remove(_shard_file(paths["missing"], 1))
    dist.barrier()
    _train(ddp_model, optimizer, _batches(rank, world_size, 2, 3))  # moved on: a load would change it
    before = _snapshot(ddp_model, optimizer)

    out: dict[str, Any] = {"latest": latest_checkpoint(root), "paths": paths}
    # Each rank its own path (a per-rank path in a launcher script): refused on every rank.
    out["per_rank_paths"] = _timed_call(lambda: save_checkpoint(ddp_model, optimizer, os.path.join(root, f"r{rank}")))
    out["per_rank_paths"]["written"] = sorted(p for p in os.listdir(root) if p.startswith(("r0", "r1", ".r")))
    for case, verify in (("flipped_weights", True), ("flipped_rows", False), ("truncated", False), ("missing", False)):
        result = _timed_call(lambda p=paths[case], v=verify: load_checkpoint(ddp_model, optimizer, p, verify=v))
        result["unchanged"] = _same(_snapshot(ddp_model, optimizer), before)
        out[case] = result

    # A failure while committing (injected on rank 0 only) is shared as well.
    if rank == 0:
        original = IdTable.load_state_dict

        def fail(self: IdTable, state_dict: dict[str, torch.Tensor]) -> None:
            raise RuntimeError("injected commit failure")

        IdTable.load_state_dict = fail  # type: ignore[method-assign]
    out["commit_fault"] = _timed_call(lambda: load_checkpoint(ddp_model, optimizer, paths["commit_fault"]))
    if rank == 0:
        IdTable.load_state_dict = original  # type: ignore[method-assign]
    return out


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("damaged")
    return run_distributed(_damaged_loads, 2, str(root), timeout_s=PG_TIMEOUT_S)


def test_a_save_to_a_different_path_on_each_rank_is_refused_on_every_rank(damaged) -> None:
    for rank, r in enumerate(damaged):
        error = r["per_rank_paths"]["error"]
        assert error is not None and error["type"] == "ValueError", (rank, r["per_rank_paths"])
        assert "every rank must pass the same path" in error["message"] and "rank 1: " in error["message"], error
        assert r["per_rank_paths"]["written"] == [], r["per_rank_paths"]  # nothing created


def _assert_every_rank_raised(results: list[dict[str, Any]], case: str) -> None:
    for rank, r in enumerate(results):
        error = r[case]["error"]
        assert error is not None, f"rank {rank}: loading the {case} checkpoint did not raise"
        assert r[case]["seconds"] < RAISE_WITHIN_S, f"rank {rank} took {r[case]['seconds']:.1f}s to raise"


@pytest.mark.parametrize("case", ["truncated", "missing"])
def test_a_truncated_or_missing_shard_file_never_half_loads(damaged, case: str) -> None:
    _assert_every_rank_raised(damaged, case)
    shard = os.path.join(damaged[0]["paths"][case], "__1_0.distcp")
    for rank, r in enumerate(damaged):
        error = r[case]["error"]
        assert error["type"] == "CheckpointError", error  # an Exception, not DCP's BaseException
        assert shard in error["message"], error["message"]
        assert ("is missing" if case == "missing" else "bytes, the manifest recorded") in error["message"]
        assert r[case]["unchanged"], f"rank {rank}: the model changed (weights, id tables or optimizer)"


def test_latest_checkpoint_skips_checkpoints_with_missing_or_truncated_files(damaged) -> None:
    paths = damaged[0]["paths"]
    latest = damaged[0]["latest"]  # the two damaged ones are the newest
    assert latest is not None and latest not in (paths["truncated"], paths["missing"]), latest


def test_flipped_bytes_in_one_rank_shard_fail_every_rank_at_once(damaged) -> None:
    # Checksums are verified by default: each rank checks a share of the files, and the rank
    # that finds the damage shares it with the other through the agreement.
    _assert_every_rank_raised(damaged, "flipped_weights")
    shard = os.path.join(damaged[0]["paths"]["flipped_weights"], "__0_0.distcp")
    for rank, r in enumerate(damaged):
        error = r["flipped_weights"]["error"]
        assert error["type"] == "CheckpointError" and shard in error["message"], error
        assert "CRC-32" in error["message"], error["message"]
        assert r["flipped_weights"]["unchanged"], f"rank {rank}: the model changed"


def test_a_read_that_fails_validation_on_one_rank_fails_every_rank_before_the_commit(damaged) -> None:
    # verify=False: rank 0 reads id-table rows that are not a permutation; the check of what was
    # read runs before the commit and is agreed, so no rank changes anything.
    _assert_every_rank_raised(damaged, "flipped_rows")
    for rank, r in enumerate(damaged):
        error = r["flipped_rows"]["error"]
        assert error["type"] == "CheckpointError", error
        assert damaged[0]["paths"]["flipped_rows"] in error["message"], error["message"]
        assert r["flipped_rows"]["unchanged"], f"rank {rank}: the model changed"
    assert "exactly once" in damaged[0]["flipped_rows"]["error"]["message"]
    assert "rank(s) [0]" in damaged[1]["flipped_rows"]["error"]["message"]


def test_a_failure_while_committing_on_one_rank_is_shared(damaged) -> None:
    _assert_every_rank_raised(damaged, "commit_fault")
    assert damaged[0]["commit_fault"]["error"]["type"] == "RuntimeError"
    peer = damaged[1]["commit_fault"]["error"]
    assert peer["type"] == "CheckpointError" and "injected commit failure" in peer["message"], peer


# ---- a full disk while saving ---------------------------------------------------------------------


def _full_disk(rank: int, world_size: int, root: str, where: str) -> dict[str, Any]:
    import recsdk.sharding.writing.atomic_directory as atomic_directory

    ddp_model, optimizer = _build()
    _train(ddp_model, optimizer, _batches(rank, world_size, 0, 1))
    stale = os.path.join(root, ".killed.partial-0badc0de")  # what a save killed an hour ago left
    if rank == 0:
        os.makedirs(stale)
        Path(stale, ".metadata").write_bytes(b"x")
        Path(stale, "__0_0.distcp").write_bytes(b"x" * 100)
        an_hour_ago = time.time() - 3600
        os.utime(stale, (an_hour_ago, an_hour_ago))
    dist.barrier()

    no_space = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write(2) raises it: no file name
    write_data, write_json = dcp.FileSystemWriter.write_data, atomic_directory.write_json
    if where == "data" and rank == 1:  # rank 1's disk fills up once its shard is written

        def write_then_fail(self: Any, plan: Any, planner: Any) -> Any:
            write_data(self, plan, planner).wait()
            raise no_space

        dcp.FileSystemWriter.write_data = write_then_fail  # type: ignore[method-assign]
    if where == "manifest" and rank == 0:  # no room left for the manifest

        def fail(path: str, obj: Any) -> None:
            raise no_space

        atomic_directory.write_json = fail
    result = _timed_call(lambda: save_checkpoint(ddp_model, optimizer, os.path.join(root, "full")))
    dcp.FileSystemWriter.write_data, atomic_directory.write_json = write_data, write_json  # type: ignore[method-assign]
    dist.barrier()
    result["partials_after_failure"] = sorted(glob.glob(os.path.join(root, ".full.partial-*")))
    result["stale_after_failure"] = os.path.isdir(stale)
    dist.barrier()
    save_checkpoint(ddp_model, optimizer, os.path.join(root, "next"))
    result["partials_after_success"] = sorted(glob.glob(os.path.join(root, ".*partial*")))
    result["published"] = sorted(os.listdir(root))
    return result


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_a_full_disk_fails_every_rank_and_leaves_no_partial_directory(tmp_path: Path, where: str) -> None:
    results = run_distributed(_full_disk, 2, str(tmp_path), where, timeout_s=PG_TIMEOUT_S)
    failing = 1 if where == "data" else 0
    for rank, r in enumerate(results):
        error = r["error"]
        assert error is not None, f"rank {rank}: the save did not raise"
        assert r["seconds"] < RAISE_WITHIN_S, f"rank {rank} took {r['seconds']:.1f}s to raise"
        first_line = error["message"].splitlines()[0]
        assert "no space left on device" in first_line, first_line
        assert str(tmp_path / ".full.partial-") in first_line, first_line  # the directory being written
        if rank == failing or where == "data":  # DCP shares a failed write itself: every rank has it
            assert error["type"] == "OSError" and error["errno"] == errno.ENOSPC, error
        else:
            assert error["type"] == "CheckpointError", error
        assert r["partials_after_failure"] == [], r["partials_after_failure"]
        assert r["stale_after_failure"], "a failed save removed another save's partial directory"
        # The next successful save beside them removed the partial directory of the killed save.
        assert r["partials_after_success"] == [], r["partials_after_success"]
        assert r["published"] == ["next"], r["published"]
