"""Models, batches and snapshots shared by the recsdk-pipeline tests and benchmark."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints

from recsdk.data import Batch
from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingBagConfig
from recsdk.pipeline import (
    CombinedOptimizer,
    KeyedOptimizerWrapper,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)
from recsdk.sharding import ShardedHashEmbeddingBagCollection
from recsdk.sharding.testing import shard_on_cpu

HASH_FEATURES = ["f0", "f1"]  # raw int64 ids, through the HashEBC
PLAIN_FEATURE = "f2"  # ids in [0, PLAIN_ROWS), through a plain TorchRec EBC
PLAIN_ROWS = 64
NUM_DENSE = 4


@dataclass
class HybridBatch(Batch):
    """A :class:`~recsdk.data.Batch` whose ``sparse_features`` feed the HashEBC (``f0``, ``f1``)
    and ``plain_features`` the plain EBC (``f2``): a hash module takes exactly its own features."""

    plain_features: KeyedJaggedTensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> HybridBatch:
        moved = super().to(device, non_blocking)
        return HybridBatch(
            moved.dense_features,
            moved.sparse_features,
            moved.labels,
            self.plain_features.to(device=torch.device(device), non_blocking=non_blocking),
        )

    def pin_memory(self) -> HybridBatch:
        pinned = super().pin_memory()
        if pinned is self:
            return self
        return HybridBatch(
            pinned.dense_features, pinned.sparse_features, pinned.labels, self.plain_features.pin_memory()
        )

    def record_stream(self, stream: Any) -> None:
        super().record_stream(stream)
        if stream is not None and self.dense_features.device.type != "cpu":
            self.plain_features.record_stream(stream)


class HybridModel(nn.Module):
    """HashEBC (t0 row-wise, t1 table-wise) + a plain EBC (t2) + dense layers; returns (loss, probs)."""

    def __init__(self, capacity: int = 1024, eviction: Any = None, admission: Any = None) -> None:
        super().__init__()
        self.dense = nn.Linear(NUM_DENSE, 8)
        self.over = nn.Linear(8 + 8 + 4 + 4, 1)
        self.ebc = HashEmbeddingBagCollection(
            tables=[
                HashEmbeddingBagConfig(
                    name=f"t{i}",
                    embedding_dim=dim,
                    num_embeddings=capacity,
                    feature_names=[f],
                    eviction=eviction,
                    admission=admission,
                )
                for i, (f, dim) in enumerate(zip(HASH_FEATURES, (8, 4), strict=True))
            ],
            device=torch.device("meta"),
        )
        self.plain = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=PLAIN_ROWS, feature_names=[PLAIN_FEATURE])
            ],
            device=torch.device("meta"),
        )

    def forward(self, batch: HybridBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hashed = self.ebc(batch.sparse_features)
        plain = self.plain(batch.plain_features)
        x = torch.cat([F.relu(self.dense(batch.dense_features)), hashed.values(), plain.values()], dim=1)
        logits = self.over(x).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, torch.sigmoid(logits.detach())


def build(
    capacity: int = 1024, host_timeout_s: float = 30.0, eviction: Any = None, admission: Any = None
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """The seed flow's steps 4-7 on CPU: model, fused Adagrad, hybrid sharders + planner + DMP, optimizer."""
    torch.manual_seed(0)
    model = HybridModel(capacity, eviction, admission)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.1, "eps": 0.1})
    apply_optimizer_in_backward(torch.optim.Adagrad, model.plain.parameters(), {"lr": 0.1, "eps": 0.1})
    constraints = {
        "t0": ParameterConstraints(sharding_types=["row_wise"]),
        "t1": ParameterConstraints(sharding_types=["table_wise"]),
        "t2": ParameterConstraints(sharding_types=["table_wise"]),
    }
    return shard(model, constraints, lambda params: torch.optim.Adagrad(params, lr=0.1), host_timeout_s)


def shard(
    model: nn.Module,
    constraints: dict[str, ParameterConstraints],
    dense_optimizer: Any,
    host_timeout_s: float = 30.0,
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """Steps 6-7 on CPU: hybrid sharders (host group with ``host_timeout_s``), the planner with
    recsdk's enumerator and ``constraints``, DMP, and the fused + ``dense_optimizer(params)`` optimizer."""
    host_pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=host_timeout_s))
    dmp = shard_on_cpu(model, batch_size=8, constraints=constraints, host_pg=host_pg)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())), dense_optimizer)
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def hash_ebc(model: nn.Module) -> ShardedHashEmbeddingBagCollection:
    found = [m for m in model.modules() if isinstance(m, ShardedHashEmbeddingBagCollection)]
    assert len(found) == 1, [type(m).__name__ for m in model.modules()]
    return found[0]


def default_id_pool() -> torch.Tensor:
    """200 raw ids spread over the int64 range, negatives included."""
    return torch.randint(-(2**62), 2**62, (200,), generator=torch.Generator().manual_seed(1234))


def make_batches(
    num_batches: int, rank: int, seed: int, batch_size: int = 8, id_pools: list[torch.Tensor] | None = None
) -> list[HybridBatch]:
    """Deterministic batches per (seed, rank); the ids of hash feature ``i`` are drawn from
    ``id_pools[i]`` (default: :func:`default_id_pool` for both)."""
    pools = id_pools if id_pools is not None else [default_id_pool()] * len(HASH_FEATURES)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    batches = []
    for _ in range(num_batches):
        lengths = torch.randint(0, 4, (3 * batch_size,), generator=g, dtype=torch.int32)
        values = []
        for i, pool in enumerate(pools):
            n = int(lengths[i * batch_size : (i + 1) * batch_size].sum())
            values.append(pool[torch.randint(0, pool.numel(), (n,), generator=g)])
        values.append(torch.randint(0, PLAIN_ROWS, (int(lengths[2 * batch_size :].sum()),), generator=g))
        kjt = KeyedJaggedTensor(keys=[*HASH_FEATURES, PLAIN_FEATURE], values=torch.cat(values), lengths=lengths)
        dense = torch.rand(batch_size, NUM_DENSE, generator=g)
        labels = torch.randint(0, 2, (batch_size,), generator=g).float()
        hashed, plain = kjt.split([len(HASH_FEATURES), 1])
        batches.append(HybridBatch(dense, hashed, labels, plain))
    return batches


def _local(value: Any) -> Any:
    if hasattr(value, "local_shards"):
        return [s.tensor.detach().clone() for s in value.local_shards()]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return None


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's weights (local shards), optimizer state (fused and dense) and id tables, copied."""
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if _local(value) is not None:
            out[key] = _local(value)
    for param, states in optimizer.state_dict()["state"].items():
        for name, value in states.items():
            if _local(value) is not None:
                out[f"optimizer.{param}.{name}"] = _local(value)
    for name, table in hash_ebc(model).id_tables.items():
        ids, rows = table.ids_and_rows()
        order = torch.argsort(ids)
        out[f"id_table.{name}"] = (ids[order].clone(), rows[order].clone())
    return out


def equal_snapshots(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ (bitwise), or that only one side has."""

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, list | tuple) and isinstance(y, list | tuple):
            return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y, strict=True))
        return False

    keys = set(a) | set(b)
    return sorted(k for k in keys if k not in a or k not in b or not same(a[k], b[k]))


def plain_loop(model: nn.Module, optimizer: torch.optim.Optimizer, steps: list[tuple[str, HybridBatch]]) -> list[Any]:
    """The reference: each step trains (``"train"``) or evaluates (``"eval"``) one batch."""
    results = []
    for mode, batch in steps:
        if mode == "train":
            model.train()
            loss, out = model(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            model.eval()
            with torch.no_grad():
                loss, out = model(batch)
        results.append((loss.detach().clone(), out.detach().clone()))
    return results
