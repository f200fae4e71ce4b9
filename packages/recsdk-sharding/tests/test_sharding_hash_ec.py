"""The sharded HashEmbeddingCollection: unpooled raw-id tables, row-wise and table-wise on gloo."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from sharding_models import const_init, shard
from torch import nn
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import CacheParams
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch
from recsdk.data.testing import rank_slice, run_distributed
from recsdk.embedding import HashEmbeddingCollection, HashEmbeddingConfig, LRUEviction
from recsdk.sharding import ShardedHashEmbeddingCollection, sharded_hash_modules

DIM = 8
STEPS, GLOBAL_BATCH = 12, 32


class SeqNN(nn.Module):
    """A history feature and a candidate feature over one item table; a dot-product logit.

    Returns (loss, probabilities); the loss is the mean BCE over the batch.
    """

    def __init__(self, device: str, capacity: int = 1024, init_fn=const_init, **policies) -> None:
        super().__init__()
        # The dense layer first: its initial values then do not depend on the EC's device.
        self.scale = nn.Linear(1, 1)
        self.ec = HashEmbeddingCollection(
            tables=[
                HashEmbeddingConfig(
                    name="item",
                    embedding_dim=DIM,
                    num_embeddings=capacity,
                    feature_names=["history", "candidate"],
                    init_fn=init_fn,
                    **policies,
                ),
                HashEmbeddingConfig(
                    name="user", embedding_dim=DIM, num_embeddings=capacity, feature_names=["user"], init_fn=init_fn
                ),
            ],
            device=torch.device(device),
        )

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.ec(batch.sparse_features)
        hist = out["history"]
        b = batch.labels.numel()
        # Mean of each sample's history embeddings (0 for an empty history).
        seg = torch.repeat_interleave(torch.arange(b), hist.lengths(), output_size=hist.values().shape[0])
        pooled = torch.zeros(b, DIM).index_add(0, seg, hist.values())
        pooled = pooled / hist.lengths().clamp(min=1).unsqueeze(1).to(pooled.dtype)
        logit = (pooled * out["candidate"].values()).sum(1) + (out["user"].values() ** 2).sum(1)
        logit = self.scale(logit.unsqueeze(1)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logit, batch.labels)
        return loss, torch.sigmoid(logit.detach())


def _batch(n: int, seed: int) -> Batch:
    """n samples: 0-5 history ids, 1 candidate id, 1 user id, raw 63-bit ids from small pools."""
    g = torch.Generator().manual_seed(seed)
    hist_len = torch.randint(0, 6, (n,), generator=g)
    items = torch.randint(0, 200, (int(hist_len.sum()) + n,), generator=g) * 0x9E3779B97F4A7C15 % (2**62)
    users = torch.randint(0, 50, (n,), generator=g) * -104729 - 2**40
    kjt = KeyedJaggedTensor(
        keys=["history", "candidate", "user"],
        values=torch.cat([items, users]),
        lengths=torch.cat([hist_len, torch.ones(n, dtype=torch.int64), torch.ones(n, dtype=torch.int64)]),
    )
    return Batch(torch.zeros(n, 1), kjt, torch.randint(0, 2, (n,), generator=g).float())


def _sharded_model(sharding_type: str | None, **kwargs) -> tuple[nn.Module, ShardedHashEmbeddingCollection]:
    torch.manual_seed(1)
    model = SeqNN("meta", **kwargs)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ec.parameters(), {"lr": 0.05, "eps": 0.01})
    constraints = (
        {t: ParameterConstraints(sharding_types=[sharding_type]) for t in ("item", "user")} if sharding_type else None
    )
    ddp_model = shard(model, batch_size=GLOBAL_BATCH // 2, constraints=constraints)
    (sec,) = sharded_hash_modules(ddp_model).values()
    assert isinstance(sec, ShardedHashEmbeddingCollection)
    return ddp_model, sec


def _per_id(ids: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> dict[int, torch.Tensor]:
    return dict(zip(ids.tolist(), weight[rows].detach().clone(), strict=True))


def _train_sharded(rank: int, world_size: int, sharding_type: str) -> dict:
    ddp_model, sec = _sharded_model(sharding_type)
    for step in range(STEPS):
        loss, _ = ddp_model(rank_slice(_batch(GLOBAL_BATCH, seed=step), rank, world_size))
        loss.backward()
    views = sec.table_views()
    tables = {name: _per_id(*t.ids_and_rows(), views[name].weight) for name, t in sec.id_tables.items()}
    ddp_model.eval()
    with torch.no_grad():
        eval_batch = rank_slice(_batch(GLOBAL_BATCH, seed=999), rank, world_size)
        out = {k: (jt.lengths(), jt.values()) for k, jt in sec(eval_batch.sparse_features).wait().items()}
    return {"tables": tables, "plan": {n: ps.sharding_type for n, ps in sec.module_sharding_plan.items()}, "out": out}


def _train_unsharded() -> tuple[dict, SeqNN]:
    torch.manual_seed(1)
    model = SeqNN("cpu")
    optimizer = torch.optim.Adagrad(model.ec.parameters(), lr=0.05, eps=0.01)
    for step in range(STEPS):
        # Each rank's loss is the mean over its half, and TorchRec divides embedding gradients
        # by the world size: the sharded run follows the mean loss over the global batch.
        loss, _ = model(_batch(GLOBAL_BATCH, seed=step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tables = {
        name: _per_id(*t.ids_and_rows(), model.ec.embeddings[name].weight) for name, t in model.ec.id_tables.items()
    }
    return tables, model


@pytest.mark.parametrize("sharding_type", ["row_wise", "table_wise"])
def test_sharded_ec_trains_equal_to_unsharded_per_id(sharding_type: str) -> None:
    per_rank = run_distributed(_train_sharded, 2, sharding_type, timeout_s=120)
    reference, model = _train_unsharded()
    for r in per_rank:
        assert set(r["plan"].values()) == {sharding_type}
    for name, ref in reference.items():
        merged: dict[int, torch.Tensor] = {}
        for r in per_rank:
            shard_ids = r["tables"].get(name, {})
            assert not set(shard_ids) & set(merged), "an id is stored on two ranks"
            merged.update(shard_ids)
        assert set(merged) == set(ref), f"table {name}: sharded and unsharded store different ids"
        worst = max(float((merged[i] - ref[i]).abs().max()) for i in ref)
        assert worst <= 1e-5, f"table {name}: max abs difference {worst}"
        start = const_init(torch.empty(1, DIM))[0]
        assert max(float((ref[i] - start).abs().max()) for i in ref) > 1e-3, "embeddings did not train"
    # Eval on each rank's slice: one embedding per id, in input order, as the unsharded module.
    model.eval()
    for rank, r in enumerate(per_rank):
        expected = model.ec(rank_slice(_batch(GLOBAL_BATCH, seed=999), rank, 2).sparse_features)
        got = r["out"]
        assert set(got) == set(expected)
        for key, jt in expected.items():
            lengths, values = got[key]
            assert torch.equal(lengths, jt.lengths()), key
            assert torch.allclose(values, jt.values(), atol=1e-5), key


def _unknown_ids_in_eval(rank: int, world_size: int) -> dict:
    ddp_model, sec = _sharded_model("row_wise")
    batch = _batch(8, seed=rank)
    loss, _ = ddp_model(batch)
    loss.backward()
    stored = {n: len(t) for n, t in sec.id_tables.items()}
    ddp_model.eval()
    fresh = KeyedJaggedTensor(
        keys=["history", "candidate", "user"],
        values=torch.tensor([-(2**63), 2**63 - 1, 123456789, 42, -7], dtype=torch.int64),
        lengths=torch.tensor([2, 0, 1, 1, 0, 1], dtype=torch.int64),
    )
    with torch.no_grad():
        out = sec(fresh).wait()
    return {
        "stored": stored,
        "after": {n: len(t) for n, t in sec.id_tables.items()},
        "out": {k: (jt.lengths(), jt.values()) for k, jt in out.items()},
    }


def test_eval_gives_zeros_for_unknown_ids_and_inserts_nothing() -> None:
    for r in run_distributed(_unknown_ids_in_eval, 2, timeout_s=120):
        assert r["stored"] == r["after"]
        lengths, values = r["out"]["history"]
        assert lengths.tolist() == [2, 0] and values.shape == (2, DIM)
        assert torch.equal(values, torch.zeros(2, DIM))
        assert torch.equal(r["out"]["user"][1], torch.zeros(1, DIM))


def _planner_choice(rank: int, world_size: int) -> dict:
    ddp_model, sec = _sharded_model(None, capacity=4096, eviction=LRUEviction())
    losses = []
    for step in range(4):
        loss, _ = ddp_model(rank_slice(_batch(GLOBAL_BATCH, seed=step), rank, world_size))
        loss.backward()
        losses.append(float(loss))
    return {"plan": {n: ps.sharding_type for n, ps in sec.module_sharding_plan.items()}, "losses": losses}


def test_the_unconstrained_planner_gives_a_working_plan() -> None:
    for r in run_distributed(_planner_choice, 2, timeout_s=120):
        assert set(r["plan"]) == {"item", "user"}
        assert set(r["plan"].values()) <= {"row_wise", "table_wise"}
        assert all(loss == loss for loss in r["losses"])


def _faults(rank: int, world_size: int, sharding_type: str, fault: str) -> dict:
    ddp_model, sec = _sharded_model(sharding_type, capacity=64 if fault == "full" else 1024)
    loss, _ = ddp_model(_batch(8, seed=rank))  # a good first batch builds the input dists
    loss.backward()
    batch = _batch(0 if fault == "empty" and rank == 0 else 8, seed=10 + rank)
    kjt = batch.sparse_features
    if rank == 0 and fault == "unknown":
        kjt = KeyedJaggedTensor(
            keys=[*kjt.keys(), "zzz"],
            values=torch.cat([kjt.values(), torch.tensor([5])]),
            lengths=torch.cat([kjt.lengths(), torch.ones(8, dtype=torch.int64)]),
        )
    elif rank == 0 and fault == "float":  # a Batch refuses float ids itself: call the module
        kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().double(), lengths=kjt.lengths())
    start = time.monotonic()
    try:
        if fault == "full":
            for step in range(12):
                loss, _ = ddp_model(_batch(8, seed=100 * rank + step))
                loss.backward()
        else:  # the sharded module itself, as the model would call it
            out = sec(kjt).wait()
            sum(jt.values().sum() for jt in out.values()).backward()
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    lengths = {k: jt.lengths().tolist() for k, jt in out.items()}
    return {"error": None, "stored": sum(len(t) for t in sec.id_tables.values()), "lengths": lengths}


@pytest.mark.parametrize("sharding_type", ["row_wise", "table_wise"])
@pytest.mark.parametrize(
    ("fault", "error", "expected"),
    [("unknown", "ValueError", "unknown ['zzz']"), ("float", "TypeError", "must be int64 or int32")],
)
def test_a_bad_batch_on_one_rank_raises_on_every_rank(
    sharding_type: str, fault: str, error: str, expected: str
) -> None:
    own, peer = run_distributed(_faults, 2, sharding_type, fault, timeout_s=90)
    assert own["error"] == error and expected in own["message"] and "HashEmbeddingCollection" in own["message"], own
    assert peer["error"] == "PeerFailureError" and "failed on rank(s) [0]" in peer["message"], peer
    assert own["seconds"] < 10 and peer["seconds"] < 10, (own, peer)


@pytest.mark.parametrize("sharding_type", ["row_wise", "table_wise"])
def test_a_rank_with_an_empty_batch_looks_up(sharding_type: str) -> None:
    empty, full = run_distributed(_faults, 2, sharding_type, "empty", timeout_s=90)
    assert empty["error"] is None and full["error"] is None, (empty, full)
    assert empty["lengths"] == {"history": [], "candidate": [], "user": []}, empty["lengths"]
    assert [len(v) for v in full["lengths"].values()] == [8, 8, 8]
    assert empty["stored"] + full["stored"] > 0


def test_a_full_table_names_the_table() -> None:
    results = run_distributed(_faults, 2, "row_wise", "full", timeout_s=90)
    assert all(r["error"] in ("TableFullError", "PeerFailureError") for r in results), results
    own = next(r for r in results if r["error"] == "TableFullError")
    assert "table 'item' is full" in own["message"] or "table 'user' is full" in own["message"], own


def _cached_vs_resident(rank: int, world_size: int) -> dict:
    runs = {}
    for kernel in ("fused", "fused_uvm_caching"):
        torch.manual_seed(1)
        model = SeqNN("meta", init_fn=None)  # TorchRec's default init: the store must start as the kernel does
        apply_optimizer_in_backward(torch.optim.Adagrad, model.ec.parameters(), {"lr": 0.05, "eps": 0.01})
        cache = CacheParams(load_factor=0.15) if kernel != "fused" else None
        constraints = {
            t: ParameterConstraints(sharding_types=["row_wise"], compute_kernels=[kernel], cache_params=cache)
            for t in ("item", "user")
        }
        ddp_model = shard(model, batch_size=GLOBAL_BATCH // 2, constraints=constraints)
        (sec,) = sharded_hash_modules(ddp_model).values()
        losses = []
        for step in range(STEPS):
            loss, _ = ddp_model(rank_slice(_batch(GLOBAL_BATCH, seed=step), rank, world_size))
            loss.backward()
            losses.append(loss.item())
        views = sec.table_views()
        tables = {name: _per_id(*t.ids_and_rows(), views[name].weight) for name, t in sec.id_tables.items()}
        runs[kernel] = (losses, tables, sec.stats())
    (la, ta, _), (lb, tb, stats) = runs["fused"], runs["fused_uvm_caching"]
    same = ta.keys() == tb.keys() and all(
        ta[n].keys() == tb[n].keys() and all(torch.equal(ta[n][i], tb[n][i]) for i in ta[n]) for n in ta
    )
    item = stats["item"]
    return {"losses": la == lb, "rows": same, "swap_ins": item["swap_ins"], "slots": item["cache_slots"]}


def test_cached_unpooled_tables_train_like_resident_ones() -> None:
    for r in run_distributed(_cached_vs_resident, 2, timeout_s=180):
        assert r["losses"] and r["rows"]
        assert r["swap_ins"] > r["slots"]  # the item cache was too small: rows left it and came back
