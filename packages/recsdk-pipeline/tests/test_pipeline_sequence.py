"""A model with both hash collections: pooled (HashEBC) and unpooled (HashEmbeddingCollection).

Both are host-staged; pipelined training equals the plain loop bit for bit, with Adagrad and
with recsdk's CPU Adam, for several lookaheads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pipeline_models import equal_snapshots, plain_loop, shard
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints

from recsdk.data import Batch
from recsdk.data.testing import run_distributed
from recsdk.embedding import (
    HashEmbeddingBagCollection,
    HashEmbeddingBagConfig,
    HashEmbeddingCollection,
    HashEmbeddingConfig,
    LRUEviction,
)
from recsdk.pipeline import (
    CombinedOptimizer,
    HybridTrainPipelineSparseDist,
    apply_optimizer_in_backward,
)
from recsdk.sharding import sharded_hash_modules

CPU = torch.device("cpu")
DIM = 8


@dataclass
class SequenceBatch(Batch):
    """``sparse_features`` (the user) feed the HashEBC, ``sequence_features`` (history and
    candidate item) the HashEmbeddingCollection."""

    sequence_features: KeyedJaggedTensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SequenceBatch:
        moved = super().to(device, non_blocking)
        seq = self.sequence_features.to(device=torch.device(device), non_blocking=non_blocking)
        return SequenceBatch(moved.dense_features, moved.sparse_features, moved.labels, seq)

    def record_stream(self, stream: Any) -> None:
        super().record_stream(stream)
        if stream is not None and self.dense_features.device.type != "cpu":
            self.sequence_features.record_stream(stream)


class TargetAttention(nn.Module):
    """Each history item weighted by its affinity to the candidate; empty histories pool to 0.

    A module of its own: TorchRec's pipeline traces the model's forward with torch.fx, and
    modules without sharded children stay opaque leaves of that trace.
    """

    def forward(self, history: torch.Tensor, lengths: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        b = candidate.shape[0]
        segments = torch.repeat_interleave(torch.arange(b), lengths, output_size=history.shape[0])
        scores = (history * candidate[segments]).sum(1).exp()
        norm = torch.zeros(b).index_add(0, segments, scores).clamp(min=1e-6)
        return torch.zeros(b, history.shape[1]).index_add(0, segments, history * (scores / norm[segments]).unsqueeze(1))


class SequenceModel(nn.Module):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.over = nn.Linear(3 * DIM, 1)
        self.attention = TargetAttention()
        self.ec = HashEmbeddingCollection(
            tables=[
                HashEmbeddingConfig(
                    name="item",
                    embedding_dim=DIM,
                    num_embeddings=capacity,
                    feature_names=["history", "candidate"],
                    eviction=LRUEviction(),
                )
            ],
            device=torch.device("meta"),
        )
        self.ebc = HashEmbeddingBagCollection(
            tables=[
                HashEmbeddingBagConfig(name="user", embedding_dim=DIM, num_embeddings=capacity, feature_names=["u"])
            ],
            device=torch.device("meta"),
        )

    def forward(self, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.ec(batch.sequence_features)
        user = self.ebc(batch.sparse_features).values()
        cand = seq["candidate"].values()
        pooled = self.attention(seq["history"].values(), seq["history"].lengths(), cand)
        logits = self.over(torch.cat([pooled, cand, user], dim=1)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, torch.sigmoid(logits.detach())


def _build(optimizer: str, capacity: int = 480) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    torch.manual_seed(0)
    model = SequenceModel(capacity)
    opt_class, kwargs = {
        "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "eps": 0.1}),
        "adam": (torch.optim.Adam, {"lr": 0.01}),
    }[optimizer]
    apply_optimizer_in_backward(opt_class, [*model.ec.parameters(), *model.ebc.parameters()], kwargs)
    constraints = {
        "item": ParameterConstraints(sharding_types=["row_wise"]),
        "user": ParameterConstraints(sharding_types=["table_wise"]),
    }
    return shard(model, constraints, lambda params: torch.optim.SGD(params, lr=0.1))


def _batches(num: int, rank: int, batch_size: int = 4) -> list[SequenceBatch]:
    """Histories of 0 to 20 items from a pool larger than the item table (eviction happens)."""
    g = torch.Generator().manual_seed(100 + rank)
    pool = torch.randint(-(2**62), 2**62, (1000,), generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(num):
        hist_len = torch.randint(0, 21, (batch_size,), generator=g)
        items = pool[torch.randint(0, pool.numel(), (int(hist_len.sum()) + batch_size,), generator=g)]
        seq = KeyedJaggedTensor(
            keys=["history", "candidate"],
            values=items,
            lengths=torch.cat([hist_len, torch.ones(batch_size, dtype=torch.int64)]),
        )
        users = KeyedJaggedTensor(
            keys=["u"],
            values=torch.randint(0, 2**40, (batch_size,), generator=g),
            lengths=torch.ones(batch_size, dtype=torch.int64),
        )
        labels = torch.randint(0, 2, (batch_size,), generator=g).float()
        out.append(SequenceBatch(torch.zeros(batch_size, 1), users, labels, seq))
    return out


def _snapshot(model: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fqn, module in sharded_hash_modules(model).items():
        views = module.table_views()
        for name, table in module.id_tables.items():
            ids, rows = table.ids_and_rows()
            order = torch.argsort(ids)
            ids, rows = ids[order], rows[order]
            out[f"{fqn}.{name}.ids"] = ids.clone()
            out[f"{fqn}.{name}.weight"] = views[name].weight[rows].clone()
            for i, state in enumerate(views[name].states):
                out[f"{fqn}.{name}.state{i}"] = state[rows].clone()
    return out


def _equivalence(rank: int, world_size: int, optimizer: str) -> dict[str, Any]:
    batches = _batches(16, rank)
    model, opt = _build(optimizer)
    reference = plain_loop(model, opt, [("train", b) for b in batches])
    want = _snapshot(model)
    evictions = sum(t.stats()["evictions"] for t in sharded_hash_modules(model)["ec"].id_tables.values())
    results = {}
    # On the host thread, and on the calling thread (the CPU default: TorchRec's schedule).
    for k, host_thread in ((1, True), (3, True), (2, None)):
        model, opt = _build(optimizer)
        with HybridTrainPipelineSparseDist(
            model, opt, CPU, host_thread=host_thread, return_loss=True, pipe_n_batch=k
        ) as pipeline:
            it = iter(batches)
            got = []
            for _ in batches:
                out, loss = pipeline.progress(it)
                got.append((loss.detach().clone(), out.detach().clone()))
            staged = sorted(pipeline.host_staged_modules)
        same = all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, reference, strict=True))
        results[(k, host_thread)] = {"same_outputs": same, "diff": equal_snapshots(_snapshot(model), want)}
        results[(k, host_thread)]["staged"] = staged
    return {"results": results, "evictions": evictions}


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_a_model_with_both_collections_pipelines_bit_for_bit(optimizer: str) -> None:
    for r in run_distributed(_equivalence, 2, optimizer, timeout_s=180):
        assert r["evictions"] > 0, "the item table never evicted: pins were not exercised"
        for (k, host_thread), res in r["results"].items():
            assert res["staged"] == (["ebc", "ec"] if host_thread else []), (k, res["staged"])
            assert res["same_outputs"], f"pipe_n_batch={k}: losses/outputs differ from the plain loop"
            assert res["diff"] == [], f"pipe_n_batch={k}: state differs in {res['diff']}"
