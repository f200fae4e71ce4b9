"""Show/click and probabilistic admission and eviction: a sharded model, trained in a plain loop or
pipelined (host thread, batches mapped ahead), makes each shard's decisions exactly as an
unsharded id table given the ids (and clicks) that shard owns, step by step."""

from __future__ import annotations

import pytest
import torch
from pipeline_models import HASH_FEATURES, build, hash_ebc, make_batches, plain_loop

from recsdk.data.testing import run_distributed
from recsdk.embedding import (
    IdTable,
    LRUEviction,
    ProbabilisticAdmission,
    ScoreAdmission,
    ScoreEviction,
    ShowClickScore,
)
from recsdk.pipeline import HybridTrainPipelineSparseDist
from recsdk.sharding import owner

CPU = torch.device("cpu")
SCORE = ShowClickScore(alpha=1.0, beta=3.0, decay=0.7)
POLICIES = {
    "score": {
        "admission": ScoreAdmission(threshold=1.5, score=SCORE, counter_slots=1 << 14),
        "eviction": ScoreEviction(evict_fraction=0.1, score=SCORE),
    },
    "probabilistic": {"admission": ProbabilisticAdmission(probability=0.4, seed=5), "eviction": LRUEviction()},
}
STEPS = 24


def _decisions(table: IdTable) -> dict:
    state = table.state_dict()
    order = torch.argsort(state["ids"])
    return {
        "ids": state["ids"][order].tolist(),
        "scores": state["scores"][order].tolist() if state["scores"].numel() else [],
        "score_counters": state["score_counters"].tolist(),
        "score_ref": int(state["score_ref"]),
        "step": table.step,
        "stats": {k: v for k, v in table.stats().items() if k in ("inserts", "evictions", "admission_rejects")},
    }


def _reference(rank: int, world_size: int, policy: str, capacities: dict[str, int]) -> dict[str, dict]:
    """Per table this rank holds, an unsharded IdTable of its shard's capacity fed, step by step,
    every rank's ids that this rank owns (row-wise t0) or all of them (table-wise t1)."""
    everyone = [[b.with_clicks() for b in make_batches(STEPS, r, seed=11)] for r in range(world_size)]
    out = {}
    for table_name, capacity in capacities.items():
        feature = HASH_FEATURES[int(table_name[1])]
        table = IdTable(capacity, name=table_name, **POLICIES[policy])
        for step in range(STEPS):
            parts = [everyone[r][step].sparse_features[feature] for r in range(world_size)]
            ids = torch.cat([p.values() for p in parts])
            clicks = torch.cat([p.weights() for p in parts])
            if table_name == "t0":
                mine = owner(ids, world_size) == rank
                ids, clicks = ids[mine], clicks[mine]
            table.find_or_insert(ids, clicks)
        out[table_name] = _decisions(table)
    return out


def _train(rank: int, world_size: int, policy: str, ahead: int) -> dict:
    torch.set_num_threads(1)
    model, optimizer = build(capacity=96, **POLICIES[policy])  # t0: 48 rows per rank for ~100 ids each
    batches = [b.with_clicks() for b in make_batches(STEPS, rank, seed=11)]
    if ahead == 0:
        plain_loop(model, optimizer, [("train", b) for b in batches])
    else:
        with HybridTrainPipelineSparseDist(
            model, optimizer, CPU, host_thread=True, pipe_n_batch=ahead, execute_all_batches=True
        ) as pipeline:
            it = iter(batches)
            for _ in range(STEPS):
                pipeline.progress(it)
    tables = hash_ebc(model).id_tables
    got = {name: _decisions(table) for name, table in tables.items()}
    expected = _reference(rank, world_size, policy, {name: table.capacity for name, table in tables.items()})
    return {"got": got, "expected": expected}


@pytest.mark.parametrize(("policy", "ahead"), [("score", 0), ("score", 2), ("probabilistic", 1)])
def test_sharded_decisions_equal_the_unsharded_tables(policy: str, ahead: int) -> None:
    results = run_distributed(_train, 2, policy, ahead, timeout_s=120)
    held = set()
    for r in results:
        assert r["got"] == r["expected"]
        held |= set(r["got"])
        for decisions in r["got"].values():
            assert decisions["stats"]["admission_rejects"] > 0  # admission refused some ids
            assert decisions["stats"]["evictions"] > 0 or decisions["step"] == STEPS
    assert held == {"t0", "t1"}
    t0 = [r["got"]["t0"] for r in results]
    assert any(d["stats"]["evictions"] > 0 for d in t0)  # the row-wise shards were full and evicted
