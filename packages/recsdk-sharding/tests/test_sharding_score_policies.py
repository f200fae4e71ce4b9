"""Show/click scores of sharded tables: clicks are required in training, score-evicted ids are
published as deletions, and checkpoints keep the scores (2 -> 2 bit for bit, 2 -> 1 resharded by id)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from publish_helpers import compare, true_state
from sharding_models import SparseNN, shard, sharded_hash_ebc, tables
from torchrec.distributed.planner import ParameterConstraints
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsdk.data import Batch, RandomRecDataset
from recsdk.data.testing import DistributedTestError, run_distributed
from recsdk.embedding import ScoreAdmission, ScoreEviction, ShowClickScore, read_version
from recsdk.sharding import Publisher, load_checkpoint, save_checkpoint

SCORE = ShowClickScore(alpha=1.0, beta=4.0, decay=0.8)
POLICIES = {
    "admission": ScoreAdmission(threshold=1.5, score=SCORE, counter_slots=1 << 12),
    "eviction": ScoreEviction(evict_fraction=0.2, score=SCORE),
}
CONSTRAINTS = {
    "t0": ParameterConstraints(sharding_types=["row_wise"]),
    "t1": ParameterConstraints(sharding_types=["table_wise"]),
}


def _model():
    torch.manual_seed(0)
    model = SparseNN(tables(capacity=64, dims=(8, 8), **POLICIES), num_dense=4, device="meta")
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05, "eps": 0.1})
    return shard(model, batch_size=16, constraints=CONSTRAINTS)


def _batches(rank: int, world_size: int, n: int, seed: int) -> list[Batch]:
    data = RandomRecDataset(
        16,
        n,
        ["f0", "f1"],
        300,
        num_dense_features=4,
        pooling_factors=2,
        seed=seed,
        rank=rank,
        world_size=world_size,
    )
    return [b.with_clicks() for b in data]


def _train(model, batches: list[Batch]) -> None:
    for batch in batches:
        loss, _ = model(batch)
        loss.backward()


def _scores(model) -> dict[str, dict[int, tuple[int, float]]]:
    """Per table this rank holds: id -> (stored fixed-point score, score now)."""
    out = {}
    for name, table in sharded_hash_ebc(model).id_tables.items():
        state = table.state_dict()
        now = table.scores(state["ids"])
        out[name] = {
            i: (s, f) for i, s, f in zip(state["ids"].tolist(), state["scores"].tolist(), now.tolist(), strict=True)
        }
    return out


def _publish_and_save(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    model = _model()
    module = sharded_hash_ebc(model)
    publisher = Publisher(model, os.path.join(root, "pub"), full_every=100)
    _train(model, _batches(rank, world_size, 6, seed=1))
    publisher.publish(step=6)
    before = {name: set(t.ids_and_rows()[0].tolist()) for name, t in module.id_tables.items()}
    evictions = {name: t.stats()["evictions"] for name, t in module.id_tables.items()}
    _train(model, _batches(rank, world_size, 6, seed=2))
    version = publisher.publish(step=12)
    after = {name: set(t.ids_and_rows()[0].tolist()) for name, t in module.id_tables.items()}
    truth = true_state(model, os.path.join(root, "export"))
    delta = read_version(os.path.join(root, "pub"), version)
    evicted = {name: sorted(before[name] - after[name]) for name in before}
    deleted = {name: sorted(set(delta.tables[name].deleted.tolist()) & before[name]) for name in before}
    save_checkpoint(model, None, os.path.join(root, "ckpt"))
    return {
        "kind": delta.kind,
        "evicted": evicted,
        "deleted": deleted,
        "new_evictions": {n: t.stats()["evictions"] - evictions[n] for n, t in module.id_tables.items()},
        "problems": compare(os.path.join(root, "pub"), version, truth) if rank == 0 else [],
        "scores": _scores(model),
        "counters": {n: t.state_dict()["score_counters"] for n, t in module.id_tables.items()},
        "steps": {n: t.step for n, t in module.id_tables.items()},
    }


def _load(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    model = _model()
    load_checkpoint(model, None, os.path.join(root, "ckpt"))
    module = sharded_hash_ebc(model)
    return {
        "scores": _scores(model),
        "counters": {n: t.state_dict()["score_counters"] for n, t in module.id_tables.items()},
        "steps": {n: t.step for n, t in module.id_tables.items()},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("scores")
    return root, run_distributed(_publish_and_save, 2, str(root), timeout_s=120)


def test_score_evicted_ids_are_deletions_of_the_next_delta(saved) -> None:
    _, results = saved
    assert results[0]["problems"] == []
    assert results[0]["kind"] == "delta"
    for r in results:
        assert r["deleted"] == r["evicted"]
    assert sum(n for r in results for n in r["new_evictions"].values()) > 0
    assert sum(len(ids) for r in results for ids in r["evicted"].values()) > 0


def test_checkpoint_keeps_scores_bit_for_bit(saved) -> None:
    root, results = saved
    loaded = run_distributed(_load, 2, str(root), timeout_s=120)
    for before, after in zip(results, loaded, strict=True):
        assert after["scores"] == before["scores"]
        assert after["steps"] == before["steps"]
        for name, counters in before["counters"].items():
            assert torch.equal(after["counters"][name], counters)


def test_two_shards_of_scores_load_on_one_rank(saved) -> None:
    root, results = saved
    (one,) = run_distributed(_load, 1, str(root), timeout_s=120)
    for name in ("t0", "t1"):
        merged = {i: v for r in results for i, v in r["scores"].get(name, {}).items()}
        assert one["scores"][name] == merged  # every id with its score (the shards agreed on the step)
        sketches = [r["counters"][name] for r in results if name in r["counters"]]
        assert torch.equal(one["counters"][name], torch.stack(sketches).amax(0))


def _no_clicks(rank: int, world_size: int) -> None:
    model = _model()
    batch = _batches(rank, world_size, 1, seed=3)[0]
    plain = Batch(batch.dense_features, batch.sparse_features, batch.labels)
    if rank == 1:  # one rank forgets the clicks
        kjt = plain.sparse_features
        plain = Batch(plain.dense_features, type(kjt)(kjt.keys(), kjt.values(), lengths=kjt.lengths()), plain.labels)
    _train(model, [plain])


def test_a_training_batch_without_clicks_fails_every_rank() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_no_clicks, 2, timeout_s=60)
    text = str(info.value)
    assert "2 of 2 ranks failed" in text
    assert "score clicks" in text and "with_clicks()" in text


def _unpooled(rank: int, world_size: int, sharding_type: str) -> dict:
    """The unpooled collection: a history and a candidate feature over one score-policy table."""
    from test_sharding_hash_ec import GLOBAL_BATCH, STEPS, _batch, _sharded_model

    from recsdk.data.testing import rank_slice
    from recsdk.embedding import IdTable
    from recsdk.sharding import owner

    torch.set_num_threads(1)
    model, sec = _sharded_model(sharding_type, capacity=128, **POLICIES)
    reference = None
    if "item" in sec.id_tables:
        reference = IdTable(sec.id_tables["item"].capacity, **POLICIES)
    for step in range(STEPS):
        whole = _batch(GLOBAL_BATCH, seed=step).with_clicks()
        loss, _ = model(rank_slice(whole, rank, world_size).with_clicks())
        loss.backward()
        if reference is not None:
            kjt = whole.sparse_features  # every rank's samples, rank by rank: what the owners receive
            parts = [kjt["history"], kjt["candidate"]]
            ids, clicks = torch.cat([p.values() for p in parts]), torch.cat([p.weights() for p in parts])
            if sharding_type == "row_wise":
                mine = owner(ids, world_size) == rank
                ids, clicks = ids[mine], clicks[mine]
            reference.find_or_insert(ids, clicks)
    if reference is None:
        return {}
    got, expected = sec.id_tables["item"].state_dict(), reference.state_dict()
    return {
        name: {
            "ids": sd["ids"].sort().values.tolist(),
            "scores": sd["scores"][sd["ids"].argsort()].tolist(),
            "evictions": table.stats()["evictions"],
        }
        for name, sd, table in (("got", got, sec.id_tables["item"]), ("expected", expected, reference))
    }


@pytest.mark.parametrize("sharding_type", ["row_wise", "table_wise"])
def test_the_unpooled_collection_scores_clicks_as_unsharded(sharding_type: str) -> None:
    results = [r for r in run_distributed(_unpooled, 2, sharding_type, timeout_s=120) if r]
    assert results
    for r in results:
        assert r["got"] == r["expected"]
        assert r["got"]["evictions"] > 0
