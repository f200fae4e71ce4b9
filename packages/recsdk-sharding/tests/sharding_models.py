"""Models and helpers shared by the recsdk-sharding tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import PoolingType

from recsdk.data import Batch, RandomRecDataset
from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingBagConfig
from recsdk.sharding import (
    ShardedHashEmbeddingBagCollection,
    sharded_hash_modules,
)
from recsdk.sharding.testing import shard_on_cpu


def tables(
    capacity: int = 4096,
    dims: tuple[int, ...] = (8, 16),
    pooling: PoolingType = PoolingType.SUM,
    init_fn=None,
    **policies,
) -> list[HashEmbeddingBagConfig]:
    return [
        HashEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=dim,
            num_embeddings=capacity,
            feature_names=[f"f{i}"],
            pooling=pooling,
            init_fn=init_fn,
            **policies,
        )
        for i, dim in enumerate(dims)
    ]


class SparseNN(nn.Module):
    """HashEBC -> concat with a dense projection -> logit; returns (loss, probabilities)."""

    def __init__(
        self,
        table_configs: list[HashEmbeddingBagConfig],
        num_dense: int,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        emb_dim = sum(c.embedding_dim for c in table_configs)
        # Dense layers first: their initial values then do not depend on the EBC's device.
        self.dense = nn.Linear(num_dense, 8)
        self.over = nn.Linear(8 + emb_dim, 1)
        self.ebc = HashEmbeddingBagCollection(tables=table_configs, device=torch.device(device))
        self.features = [f for c in table_configs for f in c.feature_names]

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        # By key, not by position: a sharded module may order its output keys differently.
        pooled = self.ebc(batch.sparse_features).to_dict()
        x = torch.cat([F.relu(self.dense(batch.dense_features)), *(pooled[f] for f in self.features)], dim=1)
        logits = self.over(x).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") / batch.labels.numel()
        return loss, torch.sigmoid(logits.detach())


def host_env() -> ShardingEnv:
    pg = dist.new_group(backend="gloo")
    return ShardingEnv(world_size=dist.get_world_size(), rank=dist.get_rank(), pg=pg)


def shard(
    model: nn.Module,
    batch_size: int,
    constraints: dict[str, ParameterConstraints] | None = None,
) -> DistributedModelParallel:
    """Steps 6 of the seed flow: hybrid sharders, planner, DMP (CPU, gloo)."""
    return shard_on_cpu(model, batch_size, constraints)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Rank-based AUC (Mann-Whitney U), ties averaged."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def sharded_hash_ebc(model: nn.Module) -> ShardedHashEmbeddingBagCollection:
    """The one sharded HashEBC of a test model."""
    found = list(sharded_hash_modules(model).values())
    assert len(found) == 1, [type(m).__name__ for m in model.modules()]
    return found[0]


def const_init(weight: torch.Tensor) -> torch.Tensor:
    """The same initial embedding for every row: sharded and unsharded runs (which give ids
    different rows) then start from identical embeddings per id."""
    with torch.no_grad():
        return weight.copy_(torch.linspace(-0.1, 0.1, weight.shape[-1]).expand_as(weight))


def synthetic_data(rank: int, world_size: int, num_batches: int, batch_size: int, sample_seed: int) -> RandomRecDataset:
    """This rank's part of the learnable synthetic task of features f0 (2 ids a bag) and f1 (1)."""
    return RandomRecDataset(
        batch_size=batch_size,
        num_batches=num_batches,
        feature_names=["f0", "f1"],
        id_ranges=[2000, 500],
        num_dense_features=4,
        pooling_factors=[2, 1],
        seed=7,
        sample_seed=sample_seed,
        rank=rank,
        world_size=world_size,
    )
