"""Sequence training throughput: HashEmbeddingCollection (raw ids) vs TorchRec EC (pre-remapped ids).

Two ranks on gloo (``--device cuda``: one rank on one GPU over nccl, the host groups on gloo),
the same sequence model and the same batches in the same run. Each sample
has a history of 0 to ``--max-history`` items, one candidate item and one user; history and
candidate share one item table, the user has a table of its own; ids are Zipf-distributed raw
62-bit ints. The model looks up one embedding per id (an unpooled embedding collection),
pools the history with a target attention on the candidate (a leaf module of its own, as
TorchRec's pipeline fx-traces forwards) and feeds the pooled history, the candidate, the user
and the dense features to an MLP.

- ``hash_<layout>``: recsdk's ``HashEmbeddingCollection`` on the raw ids (capacity twice the
  id range), both tables sharded ``<layout>`` by recsdk's ``HybridEmbeddingShardingPlanner``.
- ``torchrec_<layout>``: TorchRec's ``EmbeddingCollection`` on the same ids remapped offline to
  ``0..N-1`` (one map per table: the history's and the candidate's ids share it), both tables
  ``<layout>``, by TorchRec's default planner.
- ``hash_planner`` / ``torchrec_planner``: the same two models, each planner's own choice
  (no sharding constraint).

Both planners are told what a user knows of the data, TorchRec's way: each feature's mean ids
per sample (``ParameterConstraints.pooling_factors``: the history's ``max_history / 2``, one
for the candidate and the user).

Layouts are ``row_wise`` and ``table_wise``. Measurements alternate between the variants
(``--rounds``, the order reversed every other round); samples/s are medians over rounds (all
ranks together) and ratios are medians of the per-round ratios. One JSON line per variant (its
samples/s, each round's, and the plan its planner chose) and one per ratio hash / torchrec: per
layout, and for the planners' choices (target >= 0.9); and recsdk's choice against the faster
hash layout (the one ahead in the per-round ratios; target 1.0 within noise).

Every variant trains in the plain loop, its batches already on the device.

    python benchmarks/sequence.py [--batch-size 1024] [--steps 20] [--rounds 7] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _common import (
    NUM_DENSE,
    device_of,
    host_env,
    launch,
    parse_device_args,
    remap_ids,
    set_threads,
    shard,
    train_samples_per_s,
)
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch
from recsdk.data.hashing import mix64
from recsdk.embedding import HashEmbeddingCollection, HashEmbeddingConfig
from recsdk.sharding import get_default_hybrid_sharders

LAYOUTS = ("row_wise", "table_wise")
TABLES = {"item": ["history", "candidate"], "user": ["user"]}  # table -> its features
FEATURES = ["history", "candidate", "user"]  # the KJT's keys, in this order
ID_MASK = (1 << 62) - 1  # raw ids are 62-bit
TARGET = 0.9  # hash / torchrec on the planners' choices


class TargetAttention(nn.Module):
    """Each history item weighted by the softmax of its affinity to the (projected) candidate.

    A module of its own: TorchRec's pipeline traces the model's forward with torch.fx, and a
    module without sharded children stays an opaque leaf of that trace. An empty history
    pools to zeros.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query = nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, history: torch.Tensor, lengths: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        b, dim = candidate.shape
        device = candidate.device
        segments = torch.repeat_interleave(torch.arange(b, device=device), lengths.long(), output_size=history.shape[0])
        scores = (history * self.query(candidate)[segments]).sum(1) * self.scale
        # Softmax within each sample's history (the per-sample max keeps exp() finite).
        peak = torch.full((b,), -torch.inf, device=device).scatter_reduce(0, segments, scores.detach(), "amax")
        weights = (scores - peak[segments]).exp()
        norm = torch.zeros(b, device=device).index_add(0, segments, weights)
        weights = weights / norm[segments]
        return torch.zeros(b, dim, device=device).index_add(0, segments, history * weights.unsqueeze(1))


class SequenceModel(nn.Module):
    """Unpooled lookups, target attention over the history, an MLP on [history, candidate, user, dense].

    ``forward(batch)`` returns ``(loss, probabilities)``: binary cross-entropy on the logits and
    their sigmoid (detached).
    """

    def __init__(self, ec: nn.Module, dim: int, hidden: int) -> None:
        super().__init__()
        self.ec = ec
        self.attention = TargetAttention(dim)
        self.mlp = nn.Sequential(
            nn.Linear(3 * dim + NUM_DENSE, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.ec(batch.sparse_features)
        history = seq["history"]
        candidate = seq["candidate"].values()  # one id per sample
        pooled = self.attention(history.values(), history.lengths(), candidate)
        x = torch.cat([pooled, candidate, seq["user"].values(), batch.dense_features], dim=1)
        logits = self.mlp(x).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), torch.sigmoid(logits.detach())


def _zipf(rng: np.random.Generator, n: int, id_range: int, alpha: float) -> np.ndarray:
    """``n`` indices in ``[0, id_range)``, a bounded power law ``x ** -alpha`` (index 0 the most popular)."""
    top = float(id_range) + 1.0
    x = (1.0 + rng.random(n) * (top ** (1.0 - alpha) - 1.0)) ** (1.0 / (1.0 - alpha))
    return np.clip(np.floor(x) - 1.0, 0, id_range - 1).astype(np.int64)


def _raw_ids(indices: np.ndarray, salt: int) -> np.ndarray:
    """Raw 62-bit ids: ``mix64`` of the salted index, masked to 62 bits."""
    return mix64(indices.view(np.uint64) + np.uint64(salt)) & ID_MASK


def sequence_batches(args: argparse.Namespace, rank: int) -> list[Batch]:
    """Rank ``rank``'s batches: histories of 0..max_history items, a candidate item, a user."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([args.seed, rank])))
    b = args.batch_size
    out = []
    for _ in range(args.warmup + args.steps):
        hist_len = rng.integers(0, args.max_history + 1, b)
        items = _raw_ids(_zipf(rng, int(hist_len.sum()) + b, args.items, args.zipf), salt=0x1D5)
        users = _raw_ids(_zipf(rng, b, args.users, args.zipf), salt=0x3E1)
        kjt = KeyedJaggedTensor(
            keys=FEATURES,
            values=torch.from_numpy(np.concatenate([items, users])),
            lengths=torch.from_numpy(np.concatenate([hist_len, np.ones(2 * b, dtype=np.int64)]).astype(np.int32)),
            stride=b,
        )
        dense = torch.from_numpy(rng.standard_normal((b, NUM_DENSE), dtype=np.float32))
        labels = torch.from_numpy((rng.random(b) < 0.5).astype(np.float32))
        out.append(Batch(dense, kjt, labels))
    return out


def _collection(hashed: bool, args: argparse.Namespace) -> nn.Module:
    """Item and user tables on the meta device: raw-id hash tables, or TorchRec's on remapped rows."""
    rows = {"item": args.items, "user": args.users}
    meta = torch.device("meta")
    if hashed:  # capacity twice the id range, as sharded_training.py
        hash_configs = [
            HashEmbeddingConfig(name=t, embedding_dim=args.dim, num_embeddings=2 * rows[t], feature_names=f)
            for t, f in TABLES.items()
        ]
        return HashEmbeddingCollection(tables=hash_configs, device=meta)
    configs = [
        EmbeddingConfig(name=t, embedding_dim=args.dim, num_embeddings=rows[t], feature_names=f)
        for t, f in TABLES.items()
    ]
    return EmbeddingCollection(tables=configs, device=meta)


def _build(
    hashed: bool, layout: str | None, args: argparse.Namespace, host: ShardingEnv
) -> tuple[DistributedModelParallel, Any]:
    """The sharded model and its optimizer; ``layout=None``: the planner's own choice."""
    torch.manual_seed(0)
    ec = _collection(hashed, args)
    model = SequenceModel(ec, args.dim, args.hidden)
    pooling = {"history": args.max_history / 2, "candidate": 1.0, "user": 1.0}  # mean ids per sample
    sharding = {} if layout is None else {"sharding_types": [layout]}
    constraints = {
        t: ParameterConstraints(pooling_factors=[pooling[f] for f in features], **sharding)
        for t, features in TABLES.items()
    }
    sharders = get_default_hybrid_sharders(host_env=host)  # TorchRec's own EmbeddingCollectionSharder for the EC
    return shard(
        model,
        sharders,
        constraints,
        args.batch_size,
        embeddings=ec,
        enumerator="hybrid" if hashed else "torchrec",
        device=device_of(args.device),
    )


def _plan(model: DistributedModelParallel) -> dict[str, str]:
    """Table -> ``sharding_type/compute_kernel@ranks`` of the model's plan."""
    out = {}
    for module_plan in model.plan.plan.values():
        for table, ps in module_plan.items():
            out[table] = f"{ps.sharding_type}/{ps.compute_kernel}@{','.join(map(str, ps.ranks or []))}"
    return out


def _variants() -> list[tuple[str, bool, str | None]]:
    out = []
    for layout in (*LAYOUTS, None):
        for hashed in (True, False):
            out.append((f"{'hash' if hashed else 'torchrec'}_{layout or 'planner'}", hashed, layout))
    return out


def _run(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    host = host_env()
    device = device_of(args.device)
    raw = [sequence_batches(args, r) for r in range(world_size)]
    remapped = remap_ids(raw, TABLES)[rank]
    # The plain loop takes its batches on the device (on CPU: the same batches).
    data = {True: [b.to(device) for b in raw[rank]], False: [b.to(device) for b in remapped]}
    runs = {}
    for name, hashed, layout in _variants():
        if args.profile in (None, name):
            model, optimizer = _build(hashed, layout, args, host)
            runs[name] = (model, optimizer, data[hashed])
    if args.profile:
        return {"profile": _profile(runs[args.profile], args, rank)}
    results: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for _ in range(args.rounds):
        for name in order:
            model, optimizer, batches = runs[name]
            results[name].append(train_samples_per_s(model, optimizer, batches, args.warmup))
        order.reverse()  # A B .. B A ..: no variant always runs right after the same one
    ids = {
        "history_ids_per_sample": float(np.mean([b.sparse_features["history"].values().numel() for b in raw[rank]]))
        / args.batch_size,
    }
    return {"results": results, "plans": {name: _plan(model) for name, (model, _, _) in runs.items()}, **ids}


def _profile(run: tuple[nn.Module, Any, list[Batch]], args: argparse.Namespace, rank: int) -> str | None:
    """torch.profiler table of one variant's timed steps on this rank (rank 0 returns it)."""
    from torch.profiler import ProfilerActivity, profile

    model, optimizer, batches = run
    train_samples_per_s(model, optimizer, batches, args.warmup)  # first inserts, allocator
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        train_samples_per_s(model, optimizer, batches, args.warmup)
    if rank != 0:
        return None
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1024, help="per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-history", type=int, default=20, help="history items per sample: 0..this")
    parser.add_argument("--items", type=int, default=500_000, help="distinct item ids (history and candidate)")
    parser.add_argument("--users", type=int, default=200_000, help="distinct user ids")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of both id draws")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (1 as under torchrun; 0: torch's default)"
    )
    parser.add_argument(
        "--profile",
        choices=[name for name, _, _ in _variants()],
        help="print rank 0's torch.profiler table of one variant's steps instead of timing",
    )
    args = parse_device_args(parser, argv)
    out = launch(_run, args.world_size, args.device, args, timeout_s=1200)[0]
    if args.profile:
        print(out["profile"])
        return 0
    common = {
        "benchmark": "sequence",
        "world_size": args.world_size,
        "device": args.device,
        "batch_size_per_rank": args.batch_size,
        "history_ids_per_sample": round(out["history_ids_per_sample"], 2),
        "dim": args.dim,
        "steps": args.steps,
        "rounds": args.rounds,
    }
    results = out["results"]

    def ratio(a: str, b: str) -> float:
        # Median of the per-round ratios: the variants of one round ran back to back, so a
        # slow patch of this shared machine moves both sides of a ratio together.
        return statistics.median(x / y for x, y in zip(results[a], results[b], strict=True))

    for name, samples in results.items():
        line = {**common, "variant": name, "samples_per_s": round(statistics.median(samples), 1)}
        line["per_round"] = [round(x) for x in samples]  # how much this shared machine moved
        print(json.dumps({**line, "plan": out["plans"][name]}))
    for layout in (*LAYOUTS, "planner"):
        hashed, baseline = f"hash_{layout}", f"torchrec_{layout}"
        line = {**common, "metric": f"ratio_{hashed}_vs_{baseline}"}
        line["value"] = round(ratio(hashed, baseline), 3)
        if layout == "planner":
            line["target"] = TARGET
        print(json.dumps(line))
    # recsdk's choice against the faster hash layout (ahead in the per-round ratios).
    ahead = ratio("hash_row_wise", "hash_table_wise")
    best = "hash_row_wise" if ahead >= 1.0 else "hash_table_wise"
    line = {**common, "metric": "ratio_hash_planner_vs_best_hash_layout", "best": best}
    print(json.dumps({**line, "value": round(ratio("hash_planner", best), 3), "target": 1.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
