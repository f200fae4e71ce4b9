"""Fused optimizers through apply_optimizer_in_backward: SGD, Adagrad, RowWiseAdagrad and Adam."""

from __future__ import annotations

import pytest
import torch
from sharding_models import SparseNN, const_init, shard, sharded_hash_ebc, tables
from torchrec.distributed.planner import ParameterConstraints
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch
from recsdk.data.testing import rank_slice, run_distributed

VOCAB, STEPS = 64, 8
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "eps": 0.01}),
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.1, "eps": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}),
}


def _global_batch(step: int) -> Batch:
    """Every id of the vocabulary exactly once per feature, in a step-dependent order."""
    g = torch.Generator().manual_seed(step)
    ids = (torch.arange(VOCAB, dtype=torch.int64) * 0x9E3779B97F4A7C15 - 2**62)[torch.randperm(VOCAB, generator=g)]
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1"], values=torch.cat([ids, ids.flip(0)]), lengths=torch.ones(2 * VOCAB, dtype=torch.int64)
    )
    return Batch(torch.randn(VOCAB, 4, generator=g), kjt, torch.randint(0, 2, (VOCAB,), generator=g).float())


def _model(device: str) -> SparseNN:
    torch.manual_seed(3)
    return SparseNN(tables(capacity=256, dims=(8, 4), init_fn=const_init), num_dense=4, device=device)


def _sharded_run(rank: int, world_size: int, name: str) -> dict:
    cls, kwargs = OPTIMIZERS[name]
    model = _model("meta")
    apply_optimizer_in_backward(cls, model.ebc.parameters(), dict(kwargs))
    ddp_model = shard(
        model,
        batch_size=VOCAB // world_size,
        constraints={t: ParameterConstraints(sharding_types=["row_wise"]) for t in ("t0", "t1")},
    )
    for step in range(STEPS):
        loss, _ = ddp_model(rank_slice(_global_batch(step), rank, world_size))
        loss.backward()  # the embeddings' optimizer runs inside backward; dense layers stay fixed
    sebc = sharded_hash_ebc(ddp_model)
    weights = {}
    for table_name, table in sebc.id_tables.items():
        ids, rows = table.ids_and_rows()
        weights[table_name] = dict(zip(ids.tolist(), sebc.table_views()[table_name][0][rows].clone(), strict=True))
    state = ddp_model.fused_optimizer.state_dict()
    return {
        "weights": weights,
        "state_keys": sorted(k for v in state["state"].values() for k in v),
        "lrs": [g["lr"] for g in ddp_model.fused_optimizer.param_groups],
    }


def _unsharded_reference(name: str) -> dict:
    cls, kwargs = OPTIMIZERS[name]
    if cls is RowWiseAdagrad:
        return {}
    model = _model("cpu")
    optimizer = cls(model.ebc.parameters(), **kwargs)
    for step in range(STEPS):
        loss, _ = model(_global_batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {}
    for table_name, table in model.ebc.id_tables.items():
        ids, rows = table.ids_and_rows()
        weight = model.ebc.embedding_bags[table_name].weight.detach()
        out[table_name] = dict(zip(ids.tolist(), weight[rows].clone(), strict=True))
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_optimizer_trains_and_exposes_state(name: str) -> None:
    per_rank = run_distributed(_sharded_run, 2, name, timeout_s=60)
    expected_state = {
        "sgd": [],
        "adagrad": ["momentum1"],
        "rowwise_adagrad": ["momentum1"],
        "adam": ["exp_avg", "exp_avg_sq"],
    }
    for r in per_rank:
        assert r["lrs"] and all(lr == pytest.approx(OPTIMIZERS[name][1]["lr"]) for lr in r["lrs"])
        for state_name in expected_state[name]:
            assert any(k.endswith(state_name) for k in r["state_keys"]), r["state_keys"]
    reference = _unsharded_reference(name)
    init = const_init(torch.empty(1, 8))[0]
    for table_name, ref in reference.items():
        merged = {}
        for r in per_rank:
            merged.update(r["weights"].get(table_name, {}))
        assert set(merged) == set(ref)
        worst = max(float((merged[i] - ref[i]).abs().max()) for i in ref)
        assert worst <= 1e-5, f"{name} table {table_name}: max abs difference {worst}"
        moved = max(float((ref[i] - init[: ref[i].numel()]).abs().max()) for i in ref)
        assert moved > 1e-4, "embeddings did not train"
