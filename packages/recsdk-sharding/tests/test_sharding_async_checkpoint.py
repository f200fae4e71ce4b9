"""AsyncCheckpointer: the state is the one at ``save()`` while training goes on; a failed background
write raises on every rank; a process killed mid-write leaves the previous checkpoint the latest."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_sharding_checkpoint import _assert_same, _batches, _build, _snapshot, _train

from recsdk.data.testing import DistributedTestError, run_distributed
from recsdk.sharding import AsyncCheckpointer, CheckpointError, latest_checkpoint, load_checkpoint


def _save_while_training(rank: int, world_size: int, root: str) -> dict[str, Any]:
    ddp_model, optimizer = _build()
    _train(ddp_model, optimizer, _batches(rank, world_size, 0, 3))
    with AsyncCheckpointer(ddp_model, optimizer) as checkpointer:
        at_save = _snapshot(ddp_model, optimizer)
        checkpointer.save(os.path.join(root, "a"), extra={"step": 3, "rank": rank})
        _train(ddp_model, optimizer, _batches(rank, world_size, 3, 5))  # while the write runs
        checkpointer.check()
        moved_on = _snapshot(ddp_model, optimizer)
        checkpointer.save(os.path.join(root, "b"), extra={"step": 5})  # waits for "a" first
        written = checkpointer.wait()
    return {"at_save": at_save, "moved_on": moved_on, "written": written}


def _load(rank: int, world_size: int, path: str) -> dict[str, Any]:
    ddp_model, optimizer = _build()
    extra = load_checkpoint(ddp_model, optimizer, path)
    return {"extra": extra, "loaded": _snapshot(ddp_model, optimizer)}


def test_an_async_checkpoint_holds_the_state_at_save_while_training_goes_on(tmp_path: Path) -> None:
    saved = run_distributed(_save_while_training, 2, str(tmp_path), timeout_s=120)
    assert saved[0]["written"] == str(tmp_path / "b")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "b")
    first = run_distributed(_load, 2, str(tmp_path / "a"), timeout_s=120)
    second = run_distributed(_load, 2, str(tmp_path / "b"), timeout_s=120)
    for rank in range(2):
        assert first[rank]["extra"] == {"step": 3, "rank": rank}
        _assert_same(first[rank]["loaded"], saved[rank]["at_save"], f"rank {rank}, checkpoint a")
        _assert_same(second[rank]["loaded"], saved[rank]["moved_on"], f"rank {rank}, checkpoint b")


def _failing_write(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import errno

    import torch.distributed.checkpoint as dcp

    ddp_model, optimizer = _build()
    _train(ddp_model, optimizer, _batches(rank, world_size, 0, 2))
    checkpointer = AsyncCheckpointer(ddp_model, optimizer)
    checkpointer.save(os.path.join(root, "a"))
    checkpointer.wait()
    write_data = dcp.FileSystemWriter.write_data
    if rank == 1:  # rank 1's disk fills up once its shard is written

        def write_then_fail(self: Any, plan: Any, planner: Any) -> Any:
            write_data(self, plan, planner).wait()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        dcp.FileSystemWriter.write_data = write_then_fail  # type: ignore[method-assign]
    checkpointer.save(os.path.join(root, "b"))
    _train(ddp_model, optimizer, _batches(rank, world_size, 2, 3))
    try:
        checkpointer.save(os.path.join(root, "c"))  # the next save raises the failed write's error
    except (OSError, CheckpointError) as e:
        error = f"{type(e).__name__}: {e}"
    else:
        error = ""
    dcp.FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    checkpointer.save(os.path.join(root, "c"))  # and the checkpointer goes on
    checkpointer.close()
    return {"error": error}


def test_a_failed_background_write_raises_on_every_rank_at_the_next_save(tmp_path: Path) -> None:
    results = run_distributed(_failing_write, 2, str(tmp_path), timeout_s=120)
    for r in results:  # DCP shares a failed write itself: every rank raises the OSError
        assert r["error"].startswith("OSError") and "no space left on device" in r["error"].lower(), r["error"]
    assert not (tmp_path / "b").exists()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "c")


def _killed_mid_write(rank: int, world_size: int, root: str) -> None:
    from recsdk.sharding.writing import files

    ddp_model, optimizer = _build()
    _train(ddp_model, optimizer, _batches(rank, world_size, 0, 2))
    checkpointer = AsyncCheckpointer(ddp_model, optimizer)
    checkpointer.save(os.path.join(root, "a"), extra={"step": 2})
    checkpointer.wait()
    torch.save(_snapshot(ddp_model, optimizer), os.path.join(root, f"snapshot{rank}.pt"))
    _train(ddp_model, optimizer, _batches(rank, world_size, 2, 3))
    describe = files.describe

    def describe_then_die(*args: Any) -> Any:  # the data files are written, the manifest is not
        out = describe(*args)
        os._exit(17)
        return out

    files.describe = describe_then_die  # type: ignore[assignment]
    checkpointer.save(os.path.join(root, "b"), extra={"step": 3})
    _train(ddp_model, optimizer, _batches(rank, world_size, 3, 4))
    checkpointer.wait()


def test_a_process_killed_during_a_background_write_leaves_the_previous_checkpoint_latest(tmp_path: Path) -> None:
    with pytest.raises(DistributedTestError, match="exited with code 17"):
        run_distributed(_killed_mid_write, 2, str(tmp_path), timeout_s=60)
    assert not (tmp_path / "b").exists()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "a")
    loaded = run_distributed(_load, 2, str(tmp_path / "a"), timeout_s=120)
    for rank, r in enumerate(loaded):
        assert r["extra"] == {"step": 2}
        _assert_same(r["loaded"], torch.load(tmp_path / f"snapshot{rank}.pt", weights_only=False), f"rank {rank}")
