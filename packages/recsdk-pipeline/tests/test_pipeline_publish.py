"""Publishing between a pipeline's steps, with batches mapped ahead on the host thread."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pipeline_models import build, hash_ebc, make_batches
from test_pipeline_train import Probe

from recsdk.data.testing import run_distributed
from recsdk.embedding import LRUEviction, replay
from recsdk.pipeline import HybridTrainPipelineSparseDist
from recsdk.sharding import Publisher

CPU = torch.device("cpu")


def _state(model) -> dict[str, dict[int, torch.Tensor]]:
    """Per table, id -> row of every id the model holds, minus those whose rows are owed a reset
    (mapped ahead, not computed yet), all ranks' shards on rank 0. Read straight off the module."""
    module = hash_ebc(model)
    owed = module.ledger.owed_resets()
    views = module.table_views()
    local: dict[str, dict[int, torch.Tensor]] = {}
    for name, table in module.id_tables.items():
        ids, rows = table.ids_and_rows()
        keep = ~torch.isin(rows, owed[name]) if name in owed else torch.ones_like(rows, dtype=torch.bool)
        weight = views[name].weight
        local[name] = dict(zip(ids[keep].tolist(), weight[rows[keep]].detach().clone(), strict=True))
    everyone: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, local)
    names = {name for part in everyone for name in part}
    return {name: {i: r for part in everyone for i, r in part.get(name, {}).items()} for name in names}


def _settle(probe: Probe) -> None:
    """Wait until the host thread has mapped no further batch for 0.3 s."""
    seen, since = len(probe.mapped), time.monotonic()
    while time.monotonic() - since < 0.3:
        time.sleep(0.02)
        if len(probe.mapped) != seen:
            seen, since = len(probe.mapped), time.monotonic()


def _pipelined(rank: int, world_size: int, root: str, ahead: int) -> dict:
    torch.set_num_threads(1)
    model, optimizer = build(capacity=160, eviction=LRUEviction())  # fewer rows than ids: rows change hands
    probe = Probe(hash_ebc(model))
    publisher = Publisher(model, root, full_every=3)
    batches = make_batches(14, rank, seed=3)
    problems: list[str] = []
    owed_seen = most_ahead = 0
    with HybridTrainPipelineSparseDist(model, optimizer, CPU, host_thread=True, pipe_n_batch=ahead) as pipeline:
        it = iter(batches)
        for i in range(12):
            pipeline.progress(it)
            _settle(probe)  # the host thread has mapped what it will map ahead (the truth reads tables)
            most_ahead = max(most_ahead, len(probe.mapped) - len(probe.computed_contexts))
            if i % 2 == 0:
                continue
            owed_seen += sum(r.numel() for r in hash_ebc(model).ledger.owed_resets().values())
            version = publisher.publish(step=i)
            truth = _state(model)
            if rank == 0:
                state = replay(root, version)
                for name, rows in truth.items():
                    got = state.tables[name]
                    if sorted(rows) != got.ids.tolist():
                        problems.append(f"v{version} {name}: ids differ")
                    elif not all(
                        torch.equal(rows[i], r) for i, r in zip(got.ids.tolist(), got.embeddings(), strict=True)
                    ):
                        problems.append(f"v{version} {name}: rows differ")
    kinds = [r.kind for r in publisher.records]
    return {"problems": problems, "owed_seen": owed_seen, "most_ahead": most_ahead, "kinds": kinds}


@pytest.mark.parametrize("ahead", [1, 3])
def test_publishing_between_pipelined_steps_gives_the_trained_state(tmp_path: Path, ahead: int) -> None:
    results = run_distributed(_pipelined, 2, str(tmp_path / "pub"), ahead)
    r = results[0]
    assert r["problems"] == [], r["problems"]
    assert r["kinds"] == ["full", "delta", "delta", "full", "delta", "delta"]
    # Batches mapped ahead held rows taken from evicted ids, unreset, while versions were written.
    assert sum(x["owed_seen"] for x in results) > 0
    assert r["most_ahead"] >= min(ahead, 2), r["most_ahead"]
    assert os.listdir(tmp_path / "pub")
