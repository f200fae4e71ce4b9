"""Sharded training throughput: HashEBC (raw ids, hybrid shardings) vs TorchRec EBC (pre-remapped ids).

Two ranks on gloo, the same DLRM-style model and the same batches in the same run:

- ``hash_rw``: ``HashEmbeddingBagCollection`` on raw int64 ids, hybrid row-wise sharding (ids
  bucketed by owner and exchanged over the host group, mapped by each shard's id table).
- ``hash_tw``: the same, table-wise (every id of a table goes to the table's rank).
- ``hash_pick``: the same model as the planner shards it with no constraint at all, with
  recsdk's ``HybridEmbeddingEnumerator`` (its cost model) and ``HybridPerfModel``. Where the
  plan is one of the layouts above (same sharding type and ranks per table) that measurement is
  the pick's, and the line says so (``measured_as``).
- ``torchrec_pick``: TorchRec's planner (its own enumerator, estimator and perf model) with no
  constraint on the remapped model, likewise.
- ``torchrec_tw``: TorchRec's ``EmbeddingBagCollection`` on the same ids remapped offline to
  ``0..N-1``, table-wise sharding (TorchRec's CPU default).
- ``torchrec_rw``: the same, row-wise (recsdk's sharder allows it on CPU, with the same
  all-to-all output dist on gloo as ``hash_rw``): the row-wise layout without any id work.
  ``ratio_torchrec_rw_vs_torchrec_tw`` is therefore the ceiling of any row-wise variant
  against table-wise on this machine (each rank pools partial sums for every rank's samples).
- ``torchrec_mch``: TorchRec's ``ManagedCollisionEmbeddingBagCollection`` (MCH) on the raw ids,
  where it runs on CPU; otherwise a line saying why not.
- ``hash_tw_fp32``, ``hash_tw_fp16``: ``hash_tw`` with TorchRec's ``RowWiseAdagrad`` fused (what
  FBGEMM's CPU kernel trains fp16 rows with), rows in fp32 and in fp16
  (``data_type=DataType.FP16``); the lines give each one's bytes of rows (all ranks), and
  ``ratio_fp16_vs_fp32`` their samples/s and bytes.

Each ``--workload TABLESxIDSxDIM`` (repeatable) is one run of all of the above: TABLES tables of
dim DIM, one feature each, raw ids drawn from IDS ids per feature (TorchRec's tables get IDS
rows, recsdk's id tables 2 x IDS). The defaults are this benchmark's own workload (4 tables of
200,000 ids x 32) and the one the planner issue measured (3 tables of 40,000 x 16, where
TorchRec's planner mixes a row-wise table into its plan). Every line names its ``workload``.

Every variant trains the seed's way (``--loop pipeline``, the default): the hash models through
recsdk's ``HybridTrainPipelineSparseDist`` (on this CPU device without its host thread:
TorchRec's schedule, the next batch's id all-to-alls during this batch's forward), TorchRec's
through TorchRec's ``TrainPipelineSparseDist``; ``--loop plain`` trains every one in the plain
loop ``model(batch)``, ``backward()``, ``step()`` instead, its batches already on the device.
Every line names its ``loop``.

Measurements alternate between the variants (``--rounds``); samples/s are medians over rounds and
ratios are medians of the per-round ratios. One JSON line per measurement; the ratio line compares
``hash_rw`` to ``torchrec_tw`` (target >= 0.9). The planner lines give each pick's plan, the hash
pick's ratio to the best measured hash layout (the one ahead in the per-round ratios; target 1.0
within noise) and to ``torchrec_pick`` (target >= 1.0).

    python benchmarks/sharded_training.py [--workload 4x200000x32 ...] [--loop pipeline|plain] [--batch-size 1024]
        [--steps 40] [--rounds 7] [--device cpu|cuda --world-size 1]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    DENSE_LR,
    DLRM,
    SPARSE_OPTIMIZER,
    Pipelined,
    device_of,
    embedding_collection,
    feature_names,
    host_env,
    launch,
    random_batches,
    remap_ids,
    set_threads,
    shard,
    table_configs,
    train_samples_per_s,
)
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recsdk.data import Batch
from recsdk.pipeline import HybridTrainPipelineSparseDist
from recsdk.sharding import (
    HybridEmbeddingEnumerator,
    HybridEmbeddingShardingPlanner,
    get_default_hybrid_sharders,
    sharded_hash_modules,
)

LAYOUTS = {"hash_rw": ("hash", "row_wise"), "hash_tw": ("hash", "table_wise")}
LAYOUTS |= {"torchrec_tw": ("torchrec", "table_wise"), "torchrec_rw": ("torchrec", "row_wise")}
DTYPES = {"hash_tw_fp32": DataType.FP32, "hash_tw_fp16": DataType.FP16}  # table-wise, RowWiseAdagrad
PICKS = {"hash_pick": "hash", "torchrec_pick": "torchrec"}
ALL_VARIANTS = [*LAYOUTS, *DTYPES, *PICKS, "torchrec_mch"]


def _datasets(args: argparse.Namespace, world_size: int) -> list[list[Batch]]:
    return [
        random_batches(
            batch_size=args.batch_size,
            num_batches=args.steps + args.warmup,
            features=feature_names(args.tables),
            id_range=args.id_range,
            pooling=args.pooling,
            rank=r,
            world_size=world_size,
        )
        for r in range(world_size)
    ]


def _model(
    kind: str, args: argparse.Namespace, data_type: DataType = DataType.FP32
) -> tuple[DLRM, list[EmbeddingBagConfig]]:
    torch.manual_seed(0)
    features = feature_names(args.tables)
    rows = 2 * args.id_range if kind == "hash" else args.id_range
    configs = table_configs(kind, features, args.dim, rows=rows, data_type=data_type)  # type: ignore[arg-type]
    return DLRM(embedding_collection(configs), features, args.dim), configs


def _sharders(args: argparse.Namespace, host: ShardingEnv) -> list[Any]:
    return get_default_hybrid_sharders(host_env=host, host_threads=args.host_threads)


def _build(variant: str, args: argparse.Namespace, host: ShardingEnv) -> tuple[nn.Module, Any]:
    device = device_of(args.device)
    if variant in DTYPES:
        model, configs = _model("hash", args, DTYPES[variant])
        constraints = {c.name: ParameterConstraints(sharding_types=["table_wise"]) for c in configs}
        return shard(
            model, _sharders(args, host), constraints, args.batch_size, sparse_optimizer=RowWiseAdagrad, device=device
        )
    if variant not in LAYOUTS:
        raise ValueError(variant)
    kind, sharding = LAYOUTS[variant]
    model, configs = _model(kind, args)
    constraints = {c.name: ParameterConstraints(sharding_types=[sharding]) for c in configs}
    return shard(model, _sharders(args, host), constraints, args.batch_size, device=device)


def _row_bytes(model: nn.Module, host: ShardingEnv) -> int:
    """Bytes of the embedding rows the fused kernels hold on all ranks (weights, no optimizer state)."""
    mine = sum(
        views.weight.numel() * views.weight.element_size()
        for module in sharded_hash_modules(model).values()
        for views in module.table_views().values()
    )
    total = torch.tensor([mine], dtype=torch.int64)
    dist.all_reduce(total, group=host.process_group)  # a CPU tensor: the host (gloo) group
    return int(total)


def _plan_unconstrained(kind: str, args: argparse.Namespace, host: ShardingEnv, planner: str) -> ShardingPlan:
    """The planner's plan with no constraint (the planners' default pooling factor, 1.0).

    ``planner``: ``"recsdk"`` (``HybridEmbeddingShardingPlanner``: ``HybridEmbeddingEnumerator``,
    its cost model, and ``HybridPerfModel``), ``"recsdk_enumerator"`` (the enumerator alone, with
    TorchRec's perf model) or ``"torchrec"`` (TorchRec's enumerator, estimator and perf model).
    """
    model, _ = _model(kind, args)
    topology = Topology(world_size=dist.get_world_size(), compute_device=device_of(args.device).type)
    sharding_planner: EmbeddingShardingPlanner
    if planner == "recsdk":
        sharding_planner = HybridEmbeddingShardingPlanner(topology=topology, batch_size=args.batch_size)
    elif planner == "recsdk_enumerator":
        enumerator = HybridEmbeddingEnumerator(topology=topology, batch_size=args.batch_size)
        sharding_planner = EmbeddingShardingPlanner(
            topology=topology, batch_size=args.batch_size, enumerator=enumerator
        )
    else:
        sharding_planner = EmbeddingShardingPlanner(topology=topology, batch_size=args.batch_size)
    return sharding_planner.collective_plan(model, _sharders(args, host), dist.GroupMember.WORLD)


def _shard_with_plan(
    kind: str, args: argparse.Namespace, host: ShardingEnv, plan: ShardingPlan
) -> tuple[nn.Module, Any]:
    """As ``_common.shard``, with a given plan."""
    model, _ = _model(kind, args)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), dict(SPARSE_OPTIMIZER))
    dmp = DistributedModelParallel(model, device=device_of(args.device), plan=plan, sharders=_sharders(args, host))
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=DENSE_LR),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def _layout(plan: ShardingPlan) -> dict[str, str]:
    """Table -> ``"<sharding_type>@<ranks>"`` of the embedding module's plan."""
    return {
        name: f"{ps.sharding_type}@{','.join(map(str, ps.ranks or []))}"
        for module_plan in plan.plan.values()
        for name, ps in module_plan.items()  # type: ignore[attr-defined]
    }


def _build_mch(args: argparse.Namespace, host: ShardingEnv) -> tuple[nn.Module, Any]:
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
    features = feature_names(args.tables)
    zch_size = 2 * args.id_range
    configs: list[EmbeddingBagConfig] = table_configs("torchrec", features, args.dim, rows=zch_size)
    mcc = ManagedCollisionCollection(
        managed_collision_modules={
            c.name: MCHManagedCollisionModule(
                zch_size=zch_size,
                device=torch.device("meta"),
                eviction_policy=DistanceLFU_EvictionPolicy(),
                eviction_interval=1,
                buckets=dist.get_world_size(),
            )
            for c in configs
        },
        embedding_configs=configs,
    )
    ebc = embedding_collection(configs)
    model = DLRM(ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=False), features, args.dim)
    sharders = [
        ManagedCollisionEmbeddingBagCollectionSharder(
            ebc_sharder=HybridEmbeddingBagCollectionSharder(), mc_sharder=ManagedCollisionCollectionSharder()
        )
    ]
    row_wise = ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"])
    return shard(model, sharders, {c.name: row_wise for c in configs}, args.batch_size)


def _pipelined(model: nn.Module, optimizer: Any, batches: list[Batch], device: torch.device) -> Pipelined:
    """The seed's flow: recsdk's pipeline for the hash models, TorchRec's for TorchRec's."""
    if sharded_hash_modules(model):
        return Pipelined(HybridTrainPipelineSparseDist(model, optimizer, device), batches)
    return Pipelined(TrainPipelineSparseDist(model, optimizer, device), batches)


def _run(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    set_threads(args.threads)
    host = host_env()
    raw = _datasets(args, world_size)
    remapped = remap_ids(raw, feature_names(args.tables))
    data = {"hash": raw[rank], "torchrec": remapped[rank]}
    if args.loop == "plain":  # the pipelines copy their batches to the device; the plain loop takes them there
        data = {kind: [b.to(device_of(args.device)) for b in batches] for kind, batches in data.items()}
    runs: dict[str, tuple[nn.Module, Any, list[Batch]]] = {}
    layouts: dict[str, dict[str, str]] = {}
    for name in [n for n in LAYOUTS if n in args.variants]:
        model, optimizer = _build(name, args, host)
        runs[name] = (model, optimizer, data[LAYOUTS[name][0]])
        layouts[name] = _layout(model.plan)
    row_bytes: dict[str, int] = {}
    for name in [n for n in DTYPES if n in args.variants]:
        model, optimizer = _build(name, args, host)
        runs[name] = (model, optimizer, data["hash"])
        row_bytes[name] = _row_bytes(model, host)
    picks: dict[str, dict[str, Any]] = {}
    for name, kind in [(n, k) for n, k in PICKS.items() if n in args.variants]:
        plan = _plan_unconstrained(kind, args, host, "recsdk" if kind == "hash" else "torchrec")
        layout = _layout(plan)
        same = next((n for n, v in layouts.items() if LAYOUTS[n][0] == kind and v == layout), None)
        picks[name] = {"plan": layout, "same_as": same}
        if kind == "hash":  # what recsdk's enumerator alone picks (TorchRec's NoopPerfModel)
            alone = _layout(_plan_unconstrained(kind, args, host, "recsdk_enumerator"))
            picks[name]["enumerator_only_plan_same"] = alone == layout
        if same is None:
            runs[name] = (*_shard_with_plan(kind, args, host, plan), data[kind])
    if args.with_mch:
        runs["torchrec_mch"] = (*_build_mch(args, host), raw[rank])
    device = device_of(args.device)
    pipelines = {name: _pipelined(*run, device) for name, run in runs.items()} if args.loop == "pipeline" else {}
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, optimizer, batches) in runs.items():
            results[name].append(train_samples_per_s(model, optimizer, batches, args.warmup, pipelines.get(name)))
    for pipelined in pipelines.values():
        if isinstance(pipelined.pipeline, HybridTrainPipelineSparseDist):
            pipelined.pipeline.close()
    for name, pick in picks.items():
        if pick["same_as"] is not None:
            results[name] = results[pick["same_as"]]
    return {"results": results, "picks": picks, "row_bytes": row_bytes}


def _probe_mch(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Build and train MCH for a few steps: does TorchRec's managed collision train on CPU?"""
    set_threads(args.threads)
    model, optimizer = _build_mch(args, host_env())
    train_samples_per_s(model, optimizer, _datasets(args, world_size)[rank][:3], warmup=1)


def _workload(text: str) -> tuple[int, int, int]:
    """``"TABLESxIDSxDIM"`` -> ``(tables, ids, dim)``."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a workload is TABLESxIDSxDIM, e.g. 4x200000x32, not {text!r}")
    tables, ids, dim = (int(p) for p in parts)
    return tables, ids, dim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        type=_workload,
        action="append",
        help="TABLESxIDSxDIM, repeatable (default: 4x200000x32 and 3x40000x16)",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024, help="per rank")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pooling", type=float, default=4.0)
    parser.add_argument(
        "--loop",
        choices=["pipeline", "plain"],
        default="pipeline",
        help="pipeline: the seed's flow (recsdk's HybridTrainPipelineSparseDist for the hash models, TorchRec's "
        "TrainPipelineSparseDist for TorchRec's); plain: model(batch), backward(), step() on the calling thread",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (1 as under torchrun; 0: torch's default)"
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one rank on one GPU over nccl (--world-size 1)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=ALL_VARIANTS,
        default=ALL_VARIANTS,
        help="what to measure (default: all); a ratio line is printed where both of its sides were measured",
    )
    parser.add_argument(
        "--host-threads", type=int, default=None, help="tables the hash modules map at once (default: by device)"
    )
    args = parser.parse_args(argv)
    for tables, id_range, dim in args.workload or [(4, 200_000, 32), (3, 40_000, 16)]:
        args.tables, args.id_range, args.dim = tables, id_range, dim
        _measure(args)
    return 0


def _measure(args: argparse.Namespace) -> None:
    """Every variant of one workload, as JSON lines."""
    mch_error = None
    if "torchrec_mch" in args.variants and args.device == "cpu":
        try:  # in its own process group with a short timeout: a failure there must not hang the benchmark
            launch(_probe_mch, args.world_size, args.device, args, timeout_s=120)
        except Exception as e:
            # The root cause, not the peer's "connection closed" that follows it on the other rank.
            lines = [ln for ln in str(e).splitlines() if re.match(r"^[\w.]+(Error|Exception): ", ln)]
            root = [ln for ln in lines if "gloo" not in ln and "Connection closed" not in ln] or lines
            mch_error = root[0][:300] if root else str(e).splitlines()[0][:300]
    elif "torchrec_mch" in args.variants:
        mch_error = f"not measured on {args.device}"
    args.with_mch = "torchrec_mch" in args.variants and mch_error is None
    out = launch(_run, args.world_size, args.device, args, timeout_s=1200)[0]
    common = {
        "benchmark": "sharded_training",
        "workload": f"{args.tables}x{args.id_range}x{args.dim}",
        "world_size": args.world_size,
        "batch_size_per_rank": args.batch_size,
        "device": args.device,
        "tables": args.tables,
        "dim": args.dim,
        "loop": args.loop,
    }
    results = out["results"]
    picks = out["picks"]
    medians = {name: statistics.median(v) for name, v in results.items() if name not in picks}

    def ratio(a: str, b: str) -> float:
        # Median of the per-round ratios: the variants of one round ran back to back, so a
        # slow patch of this shared machine moves both sides of a ratio together.
        return statistics.median(x / y for x, y in zip(results[a], results[b], strict=True))

    for name, value in medians.items():
        line = {**common, "variant": name, "samples_per_s": round(value, 1)}
        if name in DTYPES:
            line |= {"optimizer": "RowWiseAdagrad", "row_bytes_all_ranks": out["row_bytes"][name]}
        print(json.dumps(line))

    def ratio_line(metric: str, a: str, b: str, **extra: Any) -> None:
        if a in results and b in results:
            print(json.dumps({**common, "metric": metric, "value": round(ratio(a, b), 3), **extra}))

    ratio_line("ratio_hash_rw_vs_torchrec_tw", "hash_rw", "torchrec_tw", target=0.9)
    ratio_line("ratio_hash_tw_vs_torchrec_tw", "hash_tw", "torchrec_tw")
    # What row-wise costs by itself (same sharding, no id work): separates the id work from
    # the row-wise layout (reduce-scatter of every rank's whole batch vs table-wise all-to-all).
    ratio_line("ratio_hash_rw_vs_torchrec_rw", "hash_rw", "torchrec_rw", target=0.95)
    ratio_line("ratio_torchrec_rw_vs_torchrec_tw", "torchrec_rw", "torchrec_tw")
    if "torchrec_mch" in medians:
        ratio_line("ratio_hash_rw_vs_torchrec_mch", "hash_rw", "torchrec_mch")
    elif "torchrec_mch" in args.variants:
        print(json.dumps({**common, "variant": "torchrec_mch", "status": "does not run on CPU", "error": mch_error}))
    planners = {
        "hash_pick": "recsdk: HybridEmbeddingEnumerator + HybridPerfModel",
        "torchrec_pick": "TorchRec: EmbeddingEnumerator + EmbeddingPerfEstimator",
    }
    for name, pick in picks.items():
        line = {**common, "variant": name, "planner": planners[name], "plan": pick["plan"]}
        if pick["same_as"] is not None:
            line["measured_as"] = pick["same_as"]
        if "enumerator_only_plan_same" in pick:
            line["enumerator_only_plan_same"] = pick["enumerator_only_plan_same"]
        print(json.dumps({**line, "samples_per_s": round(statistics.median(results[name]), 1)}))
    if "hash_pick" in picks and "hash_rw" in results and "hash_tw" in results:
        measured = ["hash_rw", "hash_tw"] + (["hash_pick"] if picks["hash_pick"]["same_as"] is None else [])
        # The best by the per-round ratios, as the ratio itself (medians of samples/s can disagree).
        best = max(measured, key=lambda n: ratio(n, measured[0]))
        ratio_line("ratio_hash_pick_vs_best_hash_layout", "hash_pick", best, best=best, target=1.0)
    ratio_line("ratio_hash_pick_vs_torchrec_pick", "hash_pick", "torchrec_pick", target=1.0)
    if "hash_tw_fp16" in out["row_bytes"] and "hash_tw_fp32" in out["row_bytes"]:
        fp16_bytes = out["row_bytes"]["hash_tw_fp16"] / out["row_bytes"]["hash_tw_fp32"]
        print(
            json.dumps(
                {
                    **common,
                    "metric": "ratio_fp16_vs_fp32",
                    "samples_per_s": round(ratio("hash_tw_fp16", "hash_tw_fp32"), 3),
                    "row_bytes": round(fp16_bytes, 3),
                }
            )
        )


if __name__ == "__main__":
    sys.exit(main())
