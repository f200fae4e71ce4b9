"""Table-full, eviction and admission behave per shard as in the unsharded module."""

from __future__ import annotations

import pytest
import torch
from sharding_models import SparseNN, shard, sharded_hash_ebc, tables
from torchrec.distributed.planner import ParameterConstraints
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch
from recsdk.data.testing import DistributedTestError, run_distributed
from recsdk.embedding import CountAdmission, LRUEviction
from recsdk.sharding import ShardedHashEmbeddingBagCollection, owner

ROW_WISE = {"t0": ParameterConstraints(sharding_types=["row_wise"])}


def _batch(ids: torch.Tensor, seed: int) -> Batch:
    """One id per sample for feature f0, feature f1 empty."""
    g = torch.Generator().manual_seed(seed)
    n = ids.numel()
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1"],
        values=ids,
        lengths=torch.cat([torch.ones(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)]),
    )
    return Batch(torch.randn(n, 4, generator=g), kjt, torch.randint(0, 2, (n,), generator=g).float())


def _ids_owned_by(rank: int, world_size: int, count: int, start: int) -> torch.Tensor:
    candidates = torch.arange(start, start + 50 * count, dtype=torch.int64) * 7919
    return candidates[owner(candidates, world_size) == rank][:count]


def _sharded(rank: int, capacity: int, **policies) -> tuple[torch.nn.Module, ShardedHashEmbeddingBagCollection]:
    torch.manual_seed(0)
    model = SparseNN(tables(capacity=capacity, dims=(8, 8), **policies), num_dense=4, device="meta")
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.01, "eps": 0.1})
    ddp_model = shard(model, batch_size=16, constraints=ROW_WISE)
    sebc = sharded_hash_ebc(ddp_model)
    return ddp_model, sebc


def _step(model: torch.nn.Module, batch: Batch) -> float:
    loss, _ = model(batch)
    loss.backward()
    return float(loss)


def _lru_eviction(rank: int, world_size: int) -> dict:
    capacity = 64  # 32 rows per rank
    model, sebc = _sharded(rank, capacity, eviction=LRUEviction())
    table = sebc.id_tables["t0"]
    g = torch.Generator().manual_seed(rank)
    for step in range(6):  # 16 fresh-ish ids per rank per step from a range much larger than the table
        _step(model, _batch(torch.randint(0, 2000, (16,), generator=g) * 1_000_003, seed=step))
    evictions_before = table.stats()["evictions"]

    # Poison every local row and its optimizer state, then send exactly `local capacity` new ids
    # to each owner: every row must be reassigned, re-initialised and get fresh optimizer state.
    weight, states = sebc.table_views()["t0"]
    with torch.no_grad():
        weight.fill_(123.0)
        for s in states:
            s.fill_(1e6)
    new_ids = _ids_owned_by(rank, world_size, table.capacity, start=10_000_000)
    loss = _step(model, _batch(new_ids, seed=99))
    ids, _ = table.ids_and_rows()
    return {
        "local_capacity": table.capacity,
        "stored": len(table),
        "evictions_before": evictions_before,
        "all_new": set(ids.tolist()) == set(new_ids.tolist()),
        "max_weight": float(weight.abs().max()),
        "max_state": max(float(s.max()) for s in states),
        "loss": loss,
    }


def test_lru_eviction_per_shard_reinitialises_rows_and_optimizer_state() -> None:
    for r in run_distributed(_lru_eviction, 2, timeout_s=60):
        assert r["local_capacity"] == 32
        assert r["evictions_before"] > 0
        assert r["stored"] == 32 and r["all_new"]
        assert r["max_weight"] < 1.0, "a reused row kept its old embedding"
        assert r["max_state"] < 1e3, "a reused row kept its old optimizer state"
        assert r["loss"] < 10.0


def _table_full(rank: int, world_size: int) -> None:
    model, _ = _sharded(rank, capacity=16)  # 8 rows per rank, no eviction policy
    for step in range(5):
        # Every id is owned by rank 0: only rank 0's shard fills up.
        ids = _ids_owned_by(0, world_size, 4, start=1000 * (2 * step + rank))
        _step(model, _batch(ids, seed=step))


def test_table_full_fails_every_rank_with_a_clear_error() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_table_full, 2, timeout_s=30)
    text = str(info.value)
    assert "2 of 2 ranks failed" in text
    assert "TableFullError" in text and "t0" in text
    assert "capacity" in text and "eviction" in text.lower()
    # Rank 0 raises its own TableFullError; rank 1 is told which rank failed and why.
    assert text.count("TableFullError") >= 2
    assert "the host id stage failed on rank(s) [0]" in text


def _admission(rank: int, world_size: int) -> dict:
    model, sebc = _sharded(rank, capacity=256, admission=CountAdmission(threshold=2))
    table = sebc.id_tables["t0"]
    ids = torch.arange(16, dtype=torch.int64) * 1_000_003 + rank * 100
    _step(model, _batch(ids, seed=0))
    after_first = len(table)
    _step(model, _batch(ids, seed=1))
    all_ids = torch.cat([torch.arange(16, dtype=torch.int64) * 1_000_003 + r * 100 for r in range(world_size)])
    mine = int((owner(all_ids, world_size) == rank).sum())
    return {"after_first": after_first, "after_second": len(table), "owned": mine, "stats": table.stats()}


def test_count_admission_per_shard() -> None:
    for r in run_distributed(_admission, 2, timeout_s=60):
        assert r["after_first"] == 0
        assert r["after_second"] == r["owned"] > 0
        assert r["stats"]["admission_rejects"] >= r["owned"]


def _mapped_ahead_then_released(rank: int, world_size: int, evicting: bool) -> dict:
    _, sebc = _sharded(rank, capacity=256, eviction=LRUEviction() if evicting else None)
    table = sebc.id_tables["t0"]
    batch = _batch(torch.arange(16, dtype=torch.int64) * 7919 + rank * 1000, seed=0)
    # What a pipeline's host stage does for a batch ahead of the one computing.
    ctx = sebc.create_context()
    received = sebc.input_dist(ctx, batch.sparse_features).wait().wait()
    sebc.post_input_dist(ctx, received)
    pinned_while_in_flight = table.num_pinned()
    sebc.release_context(ctx)  # the pipeline dropped the batch (close/reset)
    return {"pinned": pinned_while_in_flight, "after_release": table.num_pinned(), "stored": len(table)}


def test_rows_of_a_batch_in_flight_are_pinned_until_released() -> None:
    for r in run_distributed(_mapped_ahead_then_released, 2, True, timeout_s=60):
        assert r["pinned"] == r["stored"] > 0
        assert r["after_release"] == 0


def test_a_table_without_eviction_pins_nothing() -> None:
    # It never frees a row by itself, so a batch in flight needs no protection (and pays nothing).
    for r in run_distributed(_mapped_ahead_then_released, 2, False, timeout_s=60):
        assert r["stored"] > 0
        assert r["pinned"] == r["after_release"] == 0


def _owed_reinit_of_batches_in_flight(rank: int, world_size: int) -> dict:
    model, sebc = _sharded(rank, capacity=32, eviction=LRUEviction())  # 16 rows per rank
    table = sebc.id_tables["t0"]
    _step(model, _batch(_ids_owned_by(rank, world_size, 16, start=0), seed=0))  # fills this rank's rows
    # A batch of 16 new ids, mapped ahead as a pipeline does: every row goes to a new id, and its
    # re-initialisation is owed until the batch computes (a checkpoint saves exactly this).
    ctx = sebc.create_context()
    new_ids = _ids_owned_by(rank, world_size, 16, start=5_000_000)
    received = sebc.input_dist(ctx, _batch(new_ids, seed=1).sparse_features).wait().wait()
    sebc.post_input_dist(ctx, received)
    owed_in_flight = sebc.ledger.owed_resets().get("t0", torch.empty(0)).tolist()
    sebc.release_context(ctx)  # dropped: still owed, now at the next compute
    owed_after_release = sebc.ledger.owed_resets().get("t0", torch.empty(0)).tolist()
    _step(model, _batch(new_ids, seed=2))  # computing a batch pays what is owed
    return {
        "capacity": table.capacity,
        "owed_in_flight": sorted(owed_in_flight),
        "owed_after_release": sorted(owed_after_release),
        "owed_after_compute": sebc.ledger.owed_resets(),
    }


def test_reinit_owed_by_batches_in_flight_is_visible_until_paid() -> None:
    for r in run_distributed(_owed_reinit_of_batches_in_flight, 2, timeout_s=60):
        assert r["owed_in_flight"] == list(range(r["capacity"]))
        assert r["owed_after_release"] == r["owed_in_flight"]
        assert r["owed_after_compute"] == {}
