"""A pipelined job checkpointed every few steps (``drain()``, then ``save_checkpoint``), killed at
any step (batches read ahead or not) and resumed from its latest checkpoint in new processes, ends
exactly as the uninterrupted job: every loss, weight, optimizer state and id-table state."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from pipeline_models import build, equal_snapshots, hash_ebc, make_batches, snapshot
from torchdata.stateful_dataloader import StatefulDataLoader

from recsdk.data.testing import run_distributed
from recsdk.embedding import LRUEviction
from recsdk.pipeline import HybridTrainPipelineSparseDist
from recsdk.sharding import latest_checkpoint, load_checkpoint, save_checkpoint

CPU = torch.device("cpu")
STEPS, EVERY, AHEAD = 14, 4, 2  # saves after steps 6, 10 and 14 (4, then the 2 read ahead)


class _Batches(torch.utils.data.Dataset):
    """This rank's batches, by index (a StatefulDataLoader keeps the position)."""

    def __init__(self, rank: int) -> None:
        self.items = make_batches(STEPS + AHEAD + 2, rank, seed=21)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def _job(rank: int, world_size: int, root: str, stop_at: int | None, resume: bool) -> dict | None:
    torch.set_num_threads(1)
    model, optimizer = build(capacity=96, eviction=LRUEviction())  # ids evicted: rows re-initialised
    torch.manual_seed(100 + rank)  # what the re-initialised rows draw from
    loader = StatefulDataLoader(_Batches(rank), batch_size=None)
    step, losses, rng = 0, {}, None
    latest = latest_checkpoint(root) if resume else None
    if latest is not None:
        extra = load_checkpoint(model, optimizer, latest)
        step, losses, rng = extra["step"], dict(extra["losses"]), extra["rng"]
        loader.load_state_dict(extra["data"])
    batches = iter(loader)  # draws the loader's base seed from torch's RNG: restore the RNG after it
    if rng is not None:
        torch.set_rng_state(rng)
    with HybridTrainPipelineSparseDist(
        model, optimizer, CPU, host_thread=True, pipe_n_batch=AHEAD, return_loss=True
    ) as pipeline:
        while step < STEPS:
            if step == stop_at:
                return None  # killed: what it leaves is its checkpoints
            _, loss = pipeline.progress(batches)
            step += 1
            losses[step] = float(loss)
            if step % EVERY == 0:
                assert pipeline.batches_read_ahead == AHEAD
                with pytest.raises(ValueError, match=r"2 batches read ahead .* call pipeline\.drain\(\) first"):
                    save_checkpoint(model, optimizer, os.path.join(root, "refused"), pipeline=pipeline)
                for _, loss in pipeline.drain():
                    step += 1
                    losses[step] = float(loss)
                extra = {"step": step, "losses": losses, "data": loader.state_dict(), "rng": torch.get_rng_state()}
                save_checkpoint(
                    model, optimizer, os.path.join(root, f"step_{step:05d}"), pipeline=pipeline, extra=extra
                )
    tables = {name: table.state_dict() for name, table in hash_ebc(model).id_tables.items()}
    return {"losses": losses, "snapshot": snapshot(model, optimizer), "tables": tables}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_job, 2, str(tmp_path_factory.mktemp("whole")), None, False, timeout_s=120)


@pytest.mark.parametrize("killed_at", [3, 7, 11])
def test_a_killed_job_resumes_exactly(uninterrupted: list[dict], tmp_path: Path, killed_at: int) -> None:
    root = str(tmp_path)
    run_distributed(_job, 2, root, killed_at, False, timeout_s=120)
    resumed = run_distributed(_job, 2, root, None, True, timeout_s=120)
    for whole, again in zip(uninterrupted, resumed, strict=True):
        assert again["losses"] == whole["losses"]
        assert sorted(whole["losses"]) == list(range(1, STEPS + 1))
        assert equal_snapshots(whole["snapshot"], again["snapshot"]) == []
        for name, state in whole["tables"].items():
            for key, value in state.items():
                assert torch.equal(again["tables"][name][key], value), (name, key)
