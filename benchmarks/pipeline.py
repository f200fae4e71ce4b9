"""Pipeline throughput: HybridTrainPipelineSparseDist against a plain loop and TorchRec's pipeline.

Two ranks on gloo (``--device cuda``: one rank on one GPU over nccl, the host groups on gloo),
the same DLRM-style model and the same batches, in one run:

- ``hybrid_pipeline_vs_plain_loop``: ``HybridTrainPipelineSparseDist`` against the plain loop
  ``loss, out = model(batch); loss.backward(); optimizer.step(); optimizer.zero_grad()`` on the
  same sharded ``HashEmbeddingBagCollection`` model (raw int64 ids, hybrid row-wise). The line
  also gives the host stage's share of a plain-loop step (bucketing, the id all-to-alls over the
  host group, ``post_input_dist``), timed inside that loop. Target: >= 1.3x.
- ``hybrid_pipeline_vs_torchrec_pipeline``: the same hybrid pipeline and model against TorchRec's
  ``TrainPipelineSparseDist`` on TorchRec's ``EmbeddingBagCollection`` (row-wise, TorchRec's own
  sharding) fed the same ids remapped offline to ``0..N-1``. Target: >= 1.0x.
- ``hybrid_pipeline_host_thread_vs_plain_loop``: the same pipeline with ``host_thread=True``
  (the host stages on its background thread; on a CPU device the default keeps TorchRec's
  schedule on the calling thread; on a GPU it is on by default there too) against the plain
  loop. No target: it shows what the thread gains or costs on this machine.

Variants alternate (``--rounds``); each line gives the median samples/s of each side (all ranks
together) and the median over rounds of their ratio within a round. The plain-loop line also
gives the share of the machine's cores the plain loop and the pipeline keep busy (CPU seconds of
all threads of all ranks over wall seconds and cores): overlap can only fill idle cores, so with
the same CPU work the pipeline gains at most ``overlap_ceiling`` = 1 / the plain loop's share.
Each rank runs ``--threads`` intra-op threads (default 1, what torchrun gives several ranks per
host). ``--world-size 1 --threads 1`` leaves the host thread a core of its own on a 2-core machine.

On CUDA the plain loop is given its batches already on the GPU (the pipelines copy theirs).

    python benchmarks/pipeline.py [--batch-size 1024] [--steps 20] [--rounds 7] [--pipe-n-batch 2]
        [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    DLRM,
    device_of,
    embedding_collection,
    feature_names,
    host_env,
    launch,
    parse_device_args,
    random_batches,
    remap_ids,
    set_threads,
    shard,
    table_configs,
)
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from recsdk.data import Batch
from recsdk.pipeline import CombinedOptimizer, HybridTrainPipelineSparseDist
from recsdk.sharding import ShardedHashEmbeddingBagCollection, get_default_hybrid_sharders


def _batches(args: argparse.Namespace, rank: int, world_size: int) -> list[Batch]:
    return random_batches(
        batch_size=args.batch_size,
        num_batches=args.distinct_batches,
        features=feature_names(args.features),
        id_range=args.id_range,
        pooling=args.pooling,
        rank=rank,
        world_size=world_size,
    )


def _remapped(args: argparse.Namespace, world_size: int, rank: int) -> list[Batch]:
    """This rank's batches with every feature's ids remapped offline to 0..N-1 (over all ranks)."""
    per_rank = [_batches(args, r, world_size) for r in range(world_size)]
    return remap_ids(per_rank, feature_names(args.features))[rank]


def _build(hashed: bool, args: argparse.Namespace) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    torch.manual_seed(0)
    features = feature_names(args.features)
    configs = table_configs("hash" if hashed else "torchrec", features, args.dim, rows=2 * args.id_range)
    model = DLRM(embedding_collection(configs), features, args.dim, args.hidden)
    sharders = get_default_hybrid_sharders(host_env=host_env())  # a host group of its own per model
    constraints = {c.name: ParameterConstraints(sharding_types=["row_wise"]) for c in configs}
    return shard(model, sharders, constraints, args.batch_size, device=device_of(args.device))


class HostStageTimer:
    """Times the host stage of a sharded HashEBC inside a plain loop.

    Replaces the module's ``forward`` with ``ShardedModule.forward``'s own steps, timed:
    ``input_dist`` and its two waits (bucketing, the id all-to-alls), then the id mapping a
    plain loop runs at the start of ``compute_and_output_dist`` (release the last batch's rows,
    map inline without holding them ahead), then ``compute_and_output_dist`` (not counted; it
    finds the batch mapped).
    """

    def __init__(self, module: ShardedHashEmbeddingBagCollection) -> None:
        self.seconds = 0.0

        def forward(*inputs: Any) -> Any:
            start = time.perf_counter()
            ctx = module.create_context()
            received = module.input_dist(ctx, *inputs).wait().wait()
            # What compute_and_output_dist begins with in a plain loop (post_input_dist would map
            # ahead, holding the rows until compute): release the last batch's rows, map inline.
            module.release_finished_pins()
            mapped = module._shards.map(ctx, received, ahead=False, training=module.training)
            self.seconds += time.perf_counter() - start
            return module.compute_and_output_dist(ctx, mapped)

        module.forward = forward  # type: ignore[method-assign]


def _plain_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Iterator[Batch]], None]:
    def step(it: Iterator[Batch]) -> None:
        loss, _ = model(next(it))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _cpu_seconds() -> float:
    """CPU time of this process, all its threads (gloo's and the host thread included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(step: Callable[[Iterator[Batch]], Any], it: Iterator[Batch], steps: int) -> tuple[float, float]:
    """Wall seconds of ``steps`` steps, and the CPU seconds this rank used meanwhile."""
    dist.barrier()
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    for _ in range(steps):
        step(it)
    dist.barrier()
    return time.perf_counter() - start, _cpu_seconds() - cpu_start


def _bench(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    device = device_of(args.device)
    raw = _batches(args, rank, world_size)
    remapped = _remapped(args, world_size, rank)
    plain_batches = [b.to(device) for b in raw]  # the pipelines copy theirs (on CPU: the same batches)

    plain_model, plain_opt = _build(True, args)
    timer = HostStageTimer(next(m for m in plain_model.modules() if isinstance(m, ShardedHashEmbeddingBagCollection)))
    hybrid_model, hybrid_opt = _build(True, args)
    hybrid = HybridTrainPipelineSparseDist(hybrid_model, hybrid_opt, device, pipe_n_batch=args.pipe_n_batch)
    threaded_model, threaded_opt = _build(True, args)
    threaded = HybridTrainPipelineSparseDist(
        threaded_model, threaded_opt, device, pipe_n_batch=args.pipe_n_batch, host_thread=True
    )
    torchrec_model, torchrec_opt = _build(False, args)
    torchrec = TrainPipelineSparseDist(torchrec_model, torchrec_opt, device)

    variants: dict[str, tuple[Callable[[Iterator[Batch]], Any], Iterator[Batch]]] = {
        "plain_loop": (_plain_step(plain_model, plain_opt), itertools.cycle(plain_batches)),
        "hybrid_pipeline": (hybrid.progress, itertools.cycle(raw)),
        "hybrid_pipeline_host_thread": (threaded.progress, itertools.cycle(raw)),
        "torchrec_pipeline": (torchrec.progress, itertools.cycle(remapped)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in variants}
    host_fraction: list[float] = []
    for step, it in variants.values():  # warm-up: first inserts, model rewrite, allocator
        _timed(step, it, args.warmup)
    for _ in range(args.rounds):
        for name, (step, it) in variants.items():
            timer.seconds = 0.0
            elapsed, cpu = _timed(step, it, args.steps)
            seconds[name].append(elapsed)
            cpu_seconds[name].append(cpu)
            if name == "plain_loop":
                host_fraction.append(timer.seconds / elapsed)
    hybrid.close()
    threaded.close()
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "host_fraction": host_fraction}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per rank and step")
    parser.add_argument("--features", type=int, default=8, help="sparse features, one table each")
    parser.add_argument("--pooling", type=float, default=8.0, help="mean ids per bag")
    parser.add_argument("--id-range", type=int, default=100_000, help="distinct ids per feature")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--pipe-n-batch", type=int, default=2)
    parser.add_argument("--distinct-batches", type=int, default=16, help="batches generated per rank, cycled")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (1 as under torchrun; 0: torch's default)"
    )
    args = parse_device_args(parser)

    per_rank = launch(_bench, args.world_size, args.device, args, timeout_s=600)
    samples = args.batch_size * args.world_size * args.steps

    def round_seconds(name: str) -> list[float]:
        # A round of one variant lasts as long as its slowest rank.
        return [max(r["seconds"][name][i] for r in per_rank) for i in range(args.rounds)]

    def rate(name: str) -> float:
        return samples / statistics.median(round_seconds(name))

    def ratio(name: str, baseline: str) -> float:
        # Compare the variants within each round (seconds apart), then take the median over
        # rounds: the load of a shared machine drifts between rounds.
        return statistics.median(b / a for a, b in zip(round_seconds(name), round_seconds(baseline), strict=True))

    host_fraction = statistics.median(f for r in per_rank for f in r["host_fraction"])
    cores = os.cpu_count() or 1

    def cpu_busy(name: str) -> float:
        # Share of the machine's cores busy during a round (all ranks' processes together).
        return statistics.median(
            sum(r["cpu_seconds"][name][i] for r in per_rank) / (s * cores) for i, s in enumerate(round_seconds(name))
        )

    plain_busy = cpu_busy("plain_loop")
    common = {
        "benchmark": "pipeline",
        "world_size": args.world_size,
        "device": args.device,
        "batch_size": args.batch_size,
        "features": args.features,
        "pooling": args.pooling,
        "pipe_n_batch": args.pipe_n_batch,
        "steps": args.steps,
        "rounds": args.rounds,
    }
    # Each line: a pipeline variant against a baseline (the case is "<variant>_vs_<baseline>").
    for variant, baseline, target, extra in (
        (
            "hybrid_pipeline",
            "plain_loop",
            1.3,
            {
                "host_stage_fraction": round(host_fraction, 3),
                # Overlap only fills idle cores: with the same CPU work, the pipeline can gain
                # at most 1 / (busy share of the plain loop).
                "cpu_cores": cores,
                "plain_loop_cpu_busy": round(plain_busy, 3),
                "hybrid_pipeline_cpu_busy": round(cpu_busy("hybrid_pipeline"), 3),
                "overlap_ceiling": round(1 / plain_busy, 3),
            },
        ),
        ("hybrid_pipeline", "torchrec_pipeline", 1.0, {}),
        (
            "hybrid_pipeline_host_thread",
            "plain_loop",
            None,
            {"hybrid_pipeline_host_thread_cpu_busy": round(cpu_busy("hybrid_pipeline_host_thread"), 3)},
        ),
    ):
        base = rate(baseline)
        line = {
            **common,
            "case": f"{variant}_vs_{baseline}",
            "samples_per_s": round(rate(variant), 1),
            "baseline": baseline,
            "baseline_samples_per_s": round(base, 1),
            "ratio": round(ratio(variant, baseline), 3),
            **({"target": target} if target is not None else {}),
            **extra,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
