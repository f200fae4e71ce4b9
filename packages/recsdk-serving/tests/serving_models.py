"""The model the serving tests train on 2 ranks, publish, and serve in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch
from recsdk.embedding import (
    HashEmbeddingBagCollection,
    HashEmbeddingBagConfig,
    HashEmbeddingCollection,
    HashEmbeddingConfig,
    LRUEviction,
    TTLEviction,
)
from recsdk.sharding import HybridEmbeddingEnumerator, get_default_hybrid_sharders

NUM_DENSE = 4
DIM = 8


class Recommender(nn.Module):
    """A bag table of users (LRU, smaller than its ids), a MEAN bag table of tags (TTL) and an
    unpooled item table (a history pooled here, and a candidate); a dense tower; returns
    (loss, probabilities)."""

    def __init__(self, device: str | torch.device) -> None:
        super().__init__()
        self.dense = nn.Linear(NUM_DENSE, DIM)
        self.over = nn.Linear(4 * DIM, 1)
        device = torch.device(device)
        self.ebc = HashEmbeddingBagCollection(
            tables=[
                HashEmbeddingBagConfig(
                    name="user", embedding_dim=DIM, num_embeddings=96, feature_names=["user"], eviction=LRUEviction()
                ),
                HashEmbeddingBagConfig(
                    name="tag",
                    embedding_dim=DIM,
                    num_embeddings=256,
                    feature_names=["tag"],
                    pooling=PoolingType.MEAN,
                    eviction=TTLEviction(max_idle_steps=4),
                ),
            ],
            device=device,
        )
        self.ec = HashEmbeddingCollection(
            tables=[
                HashEmbeddingConfig(
                    name="item",
                    embedding_dim=DIM,
                    num_embeddings=160,
                    feature_names=["history", "candidate"],
                    eviction=LRUEviction(),
                )
            ],
            device=device,
        )

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        kjt = batch.sparse_features
        bags, seq = kjt.split([2, 2])
        pooled = self.ebc(bags).to_dict()
        items = self.ec(seq)
        hist = items["history"]
        b = batch.labels.numel()
        segment = torch.repeat_interleave(torch.arange(b), hist.lengths(), output_size=hist.values().shape[0])
        history = torch.zeros(b, DIM).index_add(0, segment, hist.values())
        x = torch.cat(
            [
                F.relu(self.dense(batch.dense_features)),
                pooled["user"],
                pooled["tag"],
                history * items["candidate"].values(),
            ],
            dim=1,
        )
        logits = self.over(x).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, torch.sigmoid(logits.detach())


def make_batch(n: int, seed: int) -> Batch:
    """n samples of raw 63-bit ids from small pools (so that the tables evict and ids come back)."""
    g = torch.Generator().manual_seed(seed)
    users = torch.randint(0, 300, (n,), generator=g) * 0x9E3779B97F4A7C15 % (2**62)
    tag_len = torch.randint(0, 4, (n,), generator=g)
    tags = torch.randint(0, 400, (int(tag_len.sum()),), generator=g) - 2**40
    hist_len = torch.randint(0, 5, (n,), generator=g)
    items = torch.randint(0, 250, (int(hist_len.sum()) + n,), generator=g) * 7919 + 11
    kjt = KeyedJaggedTensor(
        keys=["user", "tag", "history", "candidate"],
        values=torch.cat([users, tags, items]),
        lengths=torch.cat([torch.ones(n, dtype=torch.int64), tag_len, hist_len, torch.ones(n, dtype=torch.int64)]),
    )
    labels = (torch.rand(n, generator=g) < 0.3).float()
    return Batch(torch.rand(n, NUM_DENSE, generator=g), kjt, labels)


def rank_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank ``rank``'s contiguous share of a global batch."""
    b = batch.labels.numel() // world_size
    lo, hi = rank * b, (rank + 1) * b
    per_key = batch.sparse_features.to_dict()
    lengths, values = [], []
    for key in batch.sparse_features.keys():
        jt = per_key[key]
        lengths.append(jt.lengths()[lo:hi])
        values.append(jt.values()[jt.offsets()[lo] : jt.offsets()[hi]])
    kjt = KeyedJaggedTensor(keys=batch.sparse_features.keys(), values=torch.cat(values), lengths=torch.cat(lengths))
    return Batch(batch.dense_features[lo:hi], kjt, batch.labels[lo:hi])


def shard(model: nn.Module, sharding: str, batch_size: int) -> DistributedModelParallel:
    """Adagrad fused into the tables, every table sharded ``sharding``, DMP on CPU over gloo."""
    for module in (model.ebc, model.ec):
        apply_optimizer_in_backward(torch.optim.Adagrad, module.parameters(), {"lr": 0.1, "eps": 0.01})
    world_size, rank = dist.get_world_size(), dist.get_rank()
    sharders = get_default_hybrid_sharders(
        host_env=ShardingEnv(world_size=world_size, rank=rank, pg=dist.new_group(backend="gloo"))
    )
    constraints = {t: ParameterConstraints(sharding_types=[sharding]) for t in ("user", "tag", "item")}
    topology = Topology(world_size=world_size, compute_device="cpu")
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=constraints,
        enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=batch_size, constraints=constraints),
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
