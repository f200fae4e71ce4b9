"""Sharded training throughput: HashEBC (raw ids, hybrid row-wise) vs TorchRec EBC (pre-remapped ids).

Two ranks on gloo, the same DLRM-style model and the same batches in the same run:

- ``hash_rw``: ``HashEmbeddingBagCollection`` on raw int64 ids, hybrid row-wise sharding (ids
  bucketed by owner and exchanged over the host group, mapped by each shard's id table).
- ``torchrec_tw``: TorchRec's ``EmbeddingBagCollection`` on the same ids remapped offline to
  ``0..N-1``, table-wise sharding (TorchRec's CPU default).
- ``torchrec_rw``: the same, row-wise (recsdk's sharder allows it on CPU, with the same
  all-to-all output dist on gloo as ``hash_rw``): the row-wise layout without any id work.
  ``ratio_torchrec_rw_vs_torchrec_tw`` is therefore the ceiling of any row-wise variant
  against table-wise on this machine (each rank pools partial sums for every rank's samples).
- ``torchrec_mch``: TorchRec's ``ManagedCollisionEmbeddingBagCollection`` (MCH) on the raw ids,
  where it runs on CPU; otherwise a line saying why not.

Measurements alternate between the variants (``--rounds``); samples/s are medians over rounds and
ratios are medians of the per-round ratios. One JSON line per measurement; the ratio line compares
``hash_rw`` to ``torchrec_tw`` (target >= 0.9).

    python benchmarks/sharded_training.py [--batch-size 1024] [--steps 40] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch, RandomRecDataset
from recsdk.data.testing import run_distributed
from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingBagConfig
from recsdk.sharding import get_default_hybrid_sharders


class DLRM(nn.Module):
    """Bottom MLP on dense features, pooled embeddings by key, top MLP; returns (loss, probs)."""

    def __init__(self, ebc: nn.Module, features: list[str], num_dense: int, dim: int) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(num_dense, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        self.ebc = ebc
        self.features = features
        self.top = nn.Sequential(nn.Linear(dim * (len(features) + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse_features)
        if isinstance(pooled, tuple):  # ManagedCollisionEmbeddingBagCollection: (pooled, remapped ids)
            pooled = pooled[0]
        pooled = pooled.to_dict()
        x = torch.cat([self.bottom(batch.dense_features), *(pooled[f] for f in self.features)], dim=1)
        logits = self.top(x).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), torch.sigmoid(logits.detach())


def _datasets(args: argparse.Namespace, world_size: int) -> list[list[Batch]]:
    features = [f"f{i}" for i in range(args.tables)]
    return [
        list(
            RandomRecDataset(
                batch_size=args.batch_size,
                num_batches=args.steps + args.warmup,
                feature_names=features,
                id_ranges=args.id_range,
                num_dense_features=13,
                pooling_factors=args.pooling,
                seed=0,
                rank=r,
                world_size=world_size,
            )
        )
        for r in range(world_size)
    ]


def _remap(per_rank: list[list[Batch]], features: list[str]) -> list[list[Batch]]:
    """Offline id remapping to 0..N-1 per feature over every rank's batches (the baseline's input)."""
    uniques = {}
    for f in features:
        ids = torch.cat([b.sparse_features[f].values() for batches in per_rank for b in batches])
        uniques[f] = torch.unique(ids)
    out = []
    for batches in per_rank:
        mapped = []
        for b in batches:
            kjt = b.sparse_features
            values = torch.cat([torch.searchsorted(uniques[f], kjt[f].values()) for f in kjt.keys()])
            remapped = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())
            mapped.append(Batch(b.dense_features, remapped, b.labels))
        out.append(mapped)
    return out


def _shard(model: nn.Module, sharders: list, constraints: dict, batch_size: int) -> DistributedModelParallel:
    topology = Topology(world_size=dist.get_world_size(), compute_device="cpu")
    plan = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints).collective_plan(
        model, sharders, dist.GroupMember.WORLD
    )
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


def _build(variant: str, args: argparse.Namespace, host_env: ShardingEnv) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    features = [f"f{i}" for i in range(args.tables)]
    sharders = get_default_hybrid_sharders(host_env=host_env)
    if variant == "hash_rw":
        configs = [
            HashEmbeddingBagConfig(
                name=f"t{i}", embedding_dim=args.dim, num_embeddings=2 * args.id_range, feature_names=[f]
            )
            for i, f in enumerate(features)
        ]
        ebc: nn.Module = HashEmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        sharding = "row_wise"
    elif variant in ("torchrec_tw", "torchrec_rw"):
        configs = [
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.id_range, feature_names=[f])
            for i, f in enumerate(features)
        ]
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        sharding = "table_wise" if variant == "torchrec_tw" else "row_wise"
    else:
        raise ValueError(variant)
    model = DLRM(ebc, features, num_dense=13, dim=args.dim)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05, "eps": 0.1})
    constraints = {f"t{i}": ParameterConstraints(sharding_types=[sharding]) for i in range(args.tables)}
    ddp_model = _shard(model, sharders, constraints, args.batch_size)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(ddp_model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05),
    )
    return ddp_model, CombinedOptimizer([ddp_model.fused_optimizer, dense])


def _build_mch(args: argparse.Namespace, host_env: ShardingEnv) -> tuple[nn.Module, Any]:
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    from recsdk.sharding import HybridEmbeddingBagCollectionSharder

    torch.manual_seed(0)
    features = [f"f{i}" for i in range(args.tables)]
    zch_size = 2 * args.id_range
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=zch_size, feature_names=[f])
        for i, f in enumerate(features)
    ]
    mcc = ManagedCollisionCollection(
        managed_collision_modules={
            f"t{i}": MCHManagedCollisionModule(
                zch_size=zch_size,
                device=torch.device("meta"),
                eviction_policy=DistanceLFU_EvictionPolicy(),
                eviction_interval=1,
                buckets=dist.get_world_size(),
            )
            for i in range(args.tables)
        },
        embedding_configs=configs,
    )
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM(
        ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=False), features, 13, args.dim
    )
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05, "eps": 0.1})
    sharders = [
        ManagedCollisionEmbeddingBagCollectionSharder(
            ebc_sharder=HybridEmbeddingBagCollectionSharder(), mc_sharder=ManagedCollisionCollectionSharder()
        )
    ]
    row_wise = ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"])
    constraints = {f"t{i}": row_wise for i in range(args.tables)}
    ddp_model = _shard(model, sharders, constraints, args.batch_size)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(ddp_model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05),
    )
    return ddp_model, CombinedOptimizer([ddp_model.fused_optimizer, dense])


def _time(model: nn.Module, optimizer: Any, batches: list[Batch], warmup: int) -> float:
    for i, batch in enumerate(batches):
        if i == warmup:
            dist.barrier()
            start = time.perf_counter()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    elapsed = time.perf_counter() - start
    return (len(batches) - warmup) * batches[0].batch_size * dist.get_world_size() / elapsed


def _threads(args: argparse.Namespace) -> None:
    if args.threads:  # this benchmark's own rank process; the library never does this
        torch.set_num_threads(args.threads)


def _run(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    _threads(args)
    host_env = ShardingEnv(world_size=world_size, rank=rank, pg=dist.new_group(backend="gloo"))
    features = [f"f{i}" for i in range(args.tables)]
    raw = _datasets(args, world_size)
    remapped = _remap(raw, features)
    runs: dict[str, tuple[nn.Module, Any, list[Batch]]] = {
        "hash_rw": (*_build("hash_rw", args, host_env), raw[rank]),
        "torchrec_tw": (*_build("torchrec_tw", args, host_env), remapped[rank]),
        "torchrec_rw": (*_build("torchrec_rw", args, host_env), remapped[rank]),
    }
    if args.with_mch:
        runs["torchrec_mch"] = (*_build_mch(args, host_env), raw[rank])
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, optimizer, batches) in runs.items():
            results[name].append(_time(model, optimizer, batches, args.warmup))
    return {"results": results}


def _probe_mch(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Build and train MCH for a few steps: does TorchRec's managed collision train on CPU?"""
    _threads(args)
    host_env = ShardingEnv(world_size=world_size, rank=rank, pg=dist.new_group(backend="gloo"))
    model, optimizer = _build_mch(args, host_env)
    _time(model, optimizer, _datasets(args, world_size)[rank][:3], warmup=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024, help="per rank")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--id-range", type=int, default=200_000)
    parser.add_argument("--pooling", type=float, default=4.0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (1 as under torchrun; 0: torch's default)"
    )
    args = parser.parse_args(argv)
    mch_error = None
    try:  # in its own process group with a short timeout: a failure there must not hang the benchmark
        run_distributed(_probe_mch, args.world_size, args, timeout_s=120)
    except Exception as e:
        # The root cause, not the peer's "connection closed" that follows it on the other rank.
        lines = [ln for ln in str(e).splitlines() if re.match(r"^[\w.]+(Error|Exception): ", ln)]
        root = [ln for ln in lines if "gloo" not in ln and "Connection closed" not in ln] or lines
        mch_error = root[0][:300] if root else str(e).splitlines()[0][:300]
    args.with_mch = mch_error is None
    out = run_distributed(_run, args.world_size, args, timeout_s=1200)[0]
    common = {
        "benchmark": "sharded_training",
        "world_size": args.world_size,
        "batch_size_per_rank": args.batch_size,
        "tables": args.tables,
        "dim": args.dim,
    }
    results = out["results"]
    medians = {name: statistics.median(v) for name, v in results.items()}

    def ratio(a: str, b: str) -> float:
        # Median of the per-round ratios: the variants of one round ran back to back, so a
        # slow patch of this shared machine moves both sides of a ratio together.
        return statistics.median(x / y for x, y in zip(results[a], results[b], strict=True))

    for name, value in medians.items():
        print(json.dumps({**common, "variant": name, "samples_per_s": round(value, 1)}))
    print(
        json.dumps(
            {
                **common,
                "metric": "ratio_hash_rw_vs_torchrec_tw",
                "value": round(ratio("hash_rw", "torchrec_tw"), 3),
                "target": 0.9,
            }
        )
    )
    # What row-wise costs by itself (same sharding, no id work): separates the id work from
    # the row-wise layout (reduce-scatter of every rank's whole batch vs table-wise all-to-all).
    ratio_rw = ratio("hash_rw", "torchrec_rw")
    print(json.dumps({**common, "metric": "ratio_hash_rw_vs_torchrec_rw", "value": round(ratio_rw, 3)}))
    layout = ratio("torchrec_rw", "torchrec_tw")
    print(json.dumps({**common, "metric": "ratio_torchrec_rw_vs_torchrec_tw", "value": round(layout, 3)}))
    if "torchrec_mch" in medians:
        ratio_mch = ratio("hash_rw", "torchrec_mch")
        print(json.dumps({**common, "metric": "ratio_hash_rw_vs_torchrec_mch", "value": round(ratio_mch, 3)}))
    else:
        print(json.dumps({**common, "variant": "torchrec_mch", "status": "does not run on CPU", "error": mch_error}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
