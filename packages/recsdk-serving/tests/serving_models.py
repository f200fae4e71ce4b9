"""The model the serving tests train on 2 ranks, publish, and serve in one process."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import CacheAlgorithm, CacheParams
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch
from recsdk.data.testing import rank_slice
from recsdk.embedding import (
    HashEmbeddingBagCollection,
    HashEmbeddingBagConfig,
    HashEmbeddingCollection,
    HashEmbeddingConfig,
    LRUEviction,
    TTLEviction,
)
from recsdk.serving import ModelSpec
from recsdk.sharding import Publisher
from recsdk.sharding.testing import shard_on_cpu

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


FEATURES = ["user", "tag", "history", "candidate"]


def recommender_spec() -> ModelSpec:
    """The factory the server tests serve (``--model serving_models:recommender_spec``)."""
    return ModelSpec(Recommender("cpu"), FEATURES, NUM_DENSE, predict=predict)


def predict(model: nn.Module, sparse: KeyedJaggedTensor, dense: torch.Tensor) -> torch.Tensor:
    """The Recommender's click probabilities for a request (its labels unused in eval)."""
    return model(Batch(dense, sparse, torch.zeros(dense.shape[0])))[1]


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


def shard(model: nn.Module, sharding: str, batch_size: int, cached: bool = False) -> DistributedModelParallel:
    """Adagrad fused into the tables, every table sharded ``sharding``, DMP on CPU over gloo;
    with ``cached``, the user table's rows in host memory behind a device cache of half of them."""
    for module in (model.ebc, model.ec):
        apply_optimizer_in_backward(torch.optim.Adagrad, module.parameters(), {"lr": 0.1, "eps": 0.01})
    constraints = {t: ParameterConstraints(sharding_types=[sharding]) for t in ("user", "tag", "item")}
    if cached:
        constraints["user"] = ParameterConstraints(
            sharding_types=[sharding],
            compute_kernels=["fused_uvm_caching"],
            cache_params=CacheParams(load_factor=0.5, algorithm=CacheAlgorithm.LRU),
        )
    return shard_on_cpu(model, batch_size, constraints)


GLOBAL_BATCH = 32
EVAL = [make_batch(64, seed=1000 + i) for i in range(2)]  # held out, the same on every rank
TOLERANCE = {"float32": 1e-6, "float16": 2e-3, "uint8": 3e-2}  # on probabilities


def train_and_publish(rank: int, world_size: int, root: str, sharding: str, dtype: str, cached: bool = False) -> list:
    """Train, publish a version every few steps, and score the held-out batches with the trained
    model in eval mode after each: ``[(version, scores)]`` on rank 0."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dmp = shard(Recommender("meta"), sharding, GLOBAL_BATCH // world_size, cached)
    dense_opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "dense" in n or "over" in n], lr=0.1)
    publisher = Publisher(dmp, root, full_every=4, dtype=getattr(torch, dtype), keep=100)
    records = []
    step = 0
    for steps in (3, 2, 4, 1, 3):
        for _ in range(steps):
            loss, _ = dmp(rank_slice(make_batch(GLOBAL_BATCH, seed=step), rank, world_size))
            loss.backward()
            dense_opt.step()
            dense_opt.zero_grad()
            step += 1
        version = publisher.publish(step=step)
        dmp.eval()
        with torch.no_grad():
            local = [dmp(rank_slice(b, rank, world_size))[1] for b in EVAL]
        dmp.train()
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, local)
        records.append((version, [torch.cat([part[i] for part in everyone]) for i in range(len(EVAL))]))
    return records


def copy_versions(published: tuple[Path, list], to: Path, versions: list[int]) -> Path:
    """Copy ``versions`` of a published root into ``to``, as if they were published there now."""
    root, _ = published
    for v in versions:
        shutil.copytree(root / f"{v:08d}", to / f"{v:08d}")
    return to
