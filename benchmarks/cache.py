"""Device cache throughput and memory: hash tables behind a cache vs all in the fused kernel.

Two ranks on gloo (``--device cuda``: one rank on one GPU over nccl, the host groups on gloo;
where the cached kernels are meant to run, the fused kernel's rows in GPU memory) train the DLRM
of ``_common.py`` (one row-wise hash table per feature, Adagrad fused into the backward) on
Zipf-distributed raw ids. Variants of the same tables, trained in
the same run on the same batches:

- ``resident``: every row in the fused kernel (``compute_kernels=["fused"]``), the baseline;
- ``cache_<F>``: ``fused_uvm_caching`` at load factor ``F`` (``--load-factors``, 0.1 and 0.25 by
  default, LRU): ``ceil(F x rows)`` rows of each shard in the fused kernel, every row and its
  optimizer state in a host-memory store;
- ``file_<F>``: ``key_value`` at load factor ``--file-load-factor``: every row in memory-mapped
  files under a temporary directory (``--tmp-dir``, removed at the end).

Speed: after one untimed round (it fills the id tables and the caches), ``--rounds`` rounds each
train every variant for ``--warmup`` + ``--steps`` steps on that round's own batches (the same
batches for every variant; each round's are new, so the caches keep missing), the order
reversed every other round (A B .., .. B A). One JSON line per variant: samples/s (all ranks,
the median over rounds) and, for a cached table, its cache hit rate over the timed steps
(distinct rows per batch found in the cache, from ``stats()``, all tables and ranks) and swap-ins
per step, and the cache slots, store rows and store rows used of each rank (summed over its
tables); one line per ratio cached / resident (the median of the per-round ratios; target
>= 0.8 at load factor 0.25). The default sizes (4 tables of 400k rows, dim 32, 400k Zipf ids per
feature, batch 1024 per rank, pooling 4) use about 44% of each shard's rows by the end, so at
load factor 0.25 the cache holds about half of the rows in use: it misses on new ids and on
evicted ones, while a batch's ~2k distinct rows per shard fit even load factor 0.1's 20k slots.

Memory (``--memory``, on by default; ``--no-memory`` skips it): one table of ``--memory-dim``
columns whose rows take ``--memory-gb`` GB (weights only; the Adagrad state doubles it) and 4x
that, each trained ``--memory-steps`` steps in a fresh pair of processes, as ``file`` (a fixed
cache of ``--memory-slots`` slots per shard: load factor = slots / shard rows) and as
``resident``. Per size a line with each rank's anonymous resident memory (``RssAnon`` of
``/proc/self/status`` after the steps) for both, and the ratio; then the growth 4x / 1x of each
(target: the file store's <= 1.1).

A table larger than memory (``--large-gb G``, instead of the above; not for CI): one ``file`` run
whose weights take ``G`` GB (plus the Adagrad state, as much again), with the memory part's
cache; one line with the machine's available memory before, the store's file size and the bytes
it wrote, samples/s, each rank's RssAnon and RssFile, the cache hit rate.

Every variant trains in the plain loop, its batches already on the device. On CUDA each memory
and large run is one rank in a process of its own (so its RSS starts fresh), and its lines also
give the GPU memory the rank peaked at (``cuda_max_allocated_mb_per_rank``): the resident rows
live there, not in RssAnon.

    python benchmarks/cache.py [--batch-size 1024] [--steps 20] [--rounds 7] [--no-memory] [--device cpu|cuda]
    python benchmarks/cache.py --memory-gb 0.5   # the smaller pair 0.5 -> 2 GB
    python benchmarks/cache.py --large-gb 20 --tmp-dir /var/tmp   # a 40 GB store
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    DLRM,
    device_of,
    embedding_collection,
    feature_names,
    host_env,
    launch,
    parse_device_args,
    random_batches,
    set_threads,
    shard,
    table_configs,
    train_samples_per_s,
)
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import CacheAlgorithm, CacheParams, KeyValueParams

from recsdk.data import Batch
from recsdk.sharding import get_default_hybrid_sharders, sharded_hash_modules

TARGET_SPEED = 0.8  # cache / resident samples/s at load factor 0.25
TARGET_LOAD_FACTOR = 0.25
TARGET_MEMORY_GROWTH = 1.1  # the file store's RssAnon, 4x the rows / 1x
GB = 1 << 30


def _constraints(kernel: str, load_factor: float | None, directory: str | None) -> ParameterConstraints:
    """Row-wise, one compute kernel; a cache's load factor (LRU) and a file store's directory."""
    cache = None if load_factor is None else CacheParams(load_factor=load_factor, algorithm=CacheAlgorithm.LRU)
    kv = None if directory is None else KeyValueParams(ssd_storage_directory=directory)
    return ParameterConstraints(
        sharding_types=["row_wise"], compute_kernels=[kernel], cache_params=cache, key_value_params=kv
    )


def _variants(args: argparse.Namespace) -> dict[str, tuple[str, float | None]]:
    """Speed variants: name -> (compute kernel, load factor)."""
    out: dict[str, tuple[str, float | None]] = {"resident": ("fused", None)}
    for lf in args.load_factors:
        out[f"cache_{lf:g}"] = ("fused_uvm_caching", lf)
    out[f"file_{args.file_load_factor:g}"] = ("key_value", args.file_load_factor)
    return out


def _build(
    kernel: str,
    load_factor: float | None,
    *,
    tables: int,
    dim: int,
    rows: int,
    batch_size: int,
    directory: str | None,
    device: torch.device,
) -> tuple[Any, Any]:
    """The DLRM with ``tables`` hash tables of ``rows`` rows, sharded with ``kernel``, and its optimizer."""
    torch.manual_seed(0)
    features = feature_names(tables)
    configs = table_configs("hash", features, dim, rows=rows)
    model = DLRM(embedding_collection(configs), features, dim)
    store_dir = directory if kernel == "key_value" else None
    constraints = {c.name: _constraints(kernel, load_factor, store_dir) for c in configs}
    sharders = get_default_hybrid_sharders(host_env=host_env())
    return shard(model, sharders, constraints, batch_size, enumerator="hybrid", device=device)


def _cache_counts(model: Any) -> dict[str, float]:
    """This rank's cache counters summed over the cached tables (empty for a resident model)."""
    out: dict[str, float] = {}
    for module in sharded_hash_modules(model).values():
        for stats in module.stats().values():
            if "cache_lookups" not in stats:
                continue
            for key in ("cache_lookups", "cache_hits", "swap_ins", "swap_outs"):
                out[key] = out.get(key, 0.0) + stats[key]
            out["cache_slots"] = out.get("cache_slots", 0.0) + stats["cache_slots"]
            out["store_rows"] = out.get("store_rows", 0.0) + stats["store_rows"]
            out["store_rows_used"] = out.get("store_rows_used", 0.0) + stats["store_rows_used"]
    return out


def _timed(model: Any, optimizer: Any, batches: list[Batch], warmup: int) -> tuple[float, dict[str, float]]:
    """Samples/s on ``batches[warmup:]`` (after training on the first ``warmup``), and the cache
    counters' change over those timed steps."""
    if warmup:
        train_samples_per_s(model, optimizer, batches[:warmup], 0)
    before = _cache_counts(model)
    speed = train_samples_per_s(model, optimizer, batches[warmup:], 0)
    after = _cache_counts(model)
    delta = {k: after[k] - before[k] for k in ("cache_lookups", "cache_hits", "swap_ins", "swap_outs") if k in after}
    return speed, delta


def _speed(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    device = device_of(args.device)
    per_round = args.warmup + args.steps
    batches = random_batches(
        batch_size=args.batch_size,
        num_batches=(args.rounds + 1) * per_round,
        features=feature_names(args.tables),
        id_range=args.id_range,
        pooling=args.pooling,
        rank=rank,
        world_size=world_size,
    )
    batches = [b.to(device) for b in batches]  # the plain loop's, on the device (on CPU: the same)
    runs = {}
    for name, (kernel, lf) in _variants(args).items():
        runs[name] = _build(
            kernel,
            lf,
            tables=args.tables,
            dim=args.dim,
            rows=args.rows,
            batch_size=args.batch_size,
            directory=args.store_dir,
            device=device,
        )
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    counts: dict[str, dict[str, float]] = {name: {} for name in runs}
    order = list(runs)
    for r in range(args.rounds + 1):  # round 0: untimed, fills the id tables and caches
        round_batches = batches[r * per_round : (r + 1) * per_round]
        for name in order:
            model, optimizer = runs[name]
            speed, delta = _timed(model, optimizer, round_batches, args.warmup)
            if r == 0:
                continue
            speeds[name].append(speed)
            for k, v in delta.items():
                counts[name][k] = counts[name].get(k, 0.0) + v
        order.reverse()
    static = {name: _cache_counts(model) for name, (model, _) in runs.items()}
    return {"speeds": speeds, "counts": counts, "static": static}


def _rss() -> dict[str, int]:
    """This process's RssAnon, RssFile and VmRSS in bytes (``/proc/self/status``)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _memory(rank: int, world_size: int, args: argparse.Namespace, kernel: str, rows: int) -> dict[str, Any]:
    set_threads(args.threads)
    device = device_of(args.device)
    before = _rss()
    start = time.perf_counter()
    shard_rows = rows // world_size
    load_factor = args.memory_slots / shard_rows if kernel == "key_value" else None
    model, optimizer = _build(
        kernel,
        load_factor,
        tables=1,
        dim=args.memory_dim,
        rows=rows,
        batch_size=args.batch_size,
        directory=args.store_dir,
        device=device,
    )
    built = time.perf_counter() - start
    batches = random_batches(
        batch_size=args.batch_size,
        num_batches=args.memory_steps,
        features=feature_names(1),
        id_range=args.memory_id_range,
        pooling=args.pooling,
        rank=rank,
        world_size=world_size,
    )
    speed = train_samples_per_s(model, optimizer, [b.to(device) for b in batches], 0)
    after = _rss()
    store_bytes = sum(f.stat().st_size for f in Path(args.store_dir).rglob("*") if f.is_file())
    written = sum(f.stat().st_blocks * 512 for f in Path(args.store_dir).rglob("*") if f.is_file())
    cuda = {"cuda_max_allocated": torch.cuda.max_memory_allocated(device)} if device.type == "cuda" else {}
    return {
        **cuda,
        "before": before,
        "after": after,
        "build_s": built,
        "counts": _cache_counts(model),
        "samples_per_s": speed,
        "store_file_bytes": store_bytes,
        "store_disk_bytes": written,
    }


def _memory_rows(args: argparse.Namespace, scale: int) -> int:
    """Rows of the memory table whose weights take ``scale x --memory-gb`` GB (even, for 2 shards)."""
    rows = int(args.memory_gb * scale * GB) // (4 * args.memory_dim)
    return rows - rows % args.world_size


def _launch_fresh(fn: Any, args: argparse.Namespace, *rest: Any, timeout_s: float) -> list[Any]:
    """``launch`` in new processes: on CPU its spawned ranks; on CUDA the one rank in a spawned
    process of its own (``launch`` runs it in this one), so RSS and GPU memory start fresh."""
    if args.device == "cpu":
        return launch(fn, args.world_size, args.device, args, *rest, timeout_s=timeout_s)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        job = pool.submit(launch, fn, args.world_size, args.device, args, *rest, timeout_s=timeout_s)
        return job.result(timeout=timeout_s)


def _cuda_mb(outs: list[dict[str, Any]]) -> dict[str, list[int]]:
    """``cuda_max_allocated_mb_per_rank`` where the runs were on a GPU; nothing on CPU."""
    if "cuda_max_allocated" not in outs[0]:
        return {}
    return {"cuda_max_allocated_mb_per_rank": [round(o["cuda_max_allocated"] / 2**20) for o in outs]}


def _fresh_dir(base: str, name: str) -> str:
    path = Path(base) / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1024, help="per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--id-range", type=int, default=400_000, help="distinct raw ids per feature")
    parser.add_argument("--rows", type=int, default=400_000, help="rows (capacity) of every hash table")
    parser.add_argument("--pooling", type=float, default=4.0)
    parser.add_argument("--load-factors", type=float, nargs="+", default=[0.1, TARGET_LOAD_FACTOR])
    parser.add_argument("--file-load-factor", type=float, default=TARGET_LOAD_FACTOR)
    parser.add_argument("--tmp-dir", default=None, help="where the file stores go (default: the system's tmp)")
    parser.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--memory-gb", type=float, default=1.0, help="the smaller table's weights, GB")
    parser.add_argument("--memory-dim", type=int, default=128)
    parser.add_argument("--memory-slots", type=int, default=65_536, help="cache slots per shard (both sizes)")
    parser.add_argument("--memory-steps", type=int, default=20)
    parser.add_argument("--memory-id-range", type=int, default=500_000)
    parser.add_argument(
        "--large-gb",
        type=float,
        default=None,
        help="instead: one file-store run whose table's weights take this many GB (e.g. more than the free memory)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (1 as under torchrun; 0: torch's default)"
    )
    args = parse_device_args(parser, argv)
    base = tempfile.mkdtemp(prefix="recsdk_cache_bench_", dir=args.tmp_dir)
    try:
        if args.large_gb is not None:
            _report_large(args, base)
            return 0
        if args.speed:
            _report_speed(args, base)
        if args.memory:
            _report_memory(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _report_speed(args: argparse.Namespace, base: str) -> None:
    args.store_dir = _fresh_dir(base, "speed")
    start = time.perf_counter()
    outs = launch(_speed, args.world_size, args.device, args, timeout_s=1800)
    elapsed = time.perf_counter() - start
    shutil.rmtree(args.store_dir, ignore_errors=True)
    speeds = outs[0]["speeds"]
    common = {
        "benchmark": "cache",
        "world_size": args.world_size,
        "device": args.device,
        "batch_size_per_rank": args.batch_size,
        "tables": args.tables,
        "dim": args.dim,
        "rows_per_table": args.rows,
        "id_range": args.id_range,
        "pooling": args.pooling,
        "steps": args.steps,
        "rounds": args.rounds,
    }

    def ratio(a: str, b: str) -> float:
        # Median of the per-round ratios: the variants of one round ran back to back, so a
        # slow patch of this shared machine moves both sides of a ratio together.
        return statistics.median(x / y for x, y in zip(speeds[a], speeds[b], strict=True))

    variants = _variants(args)
    for name, (kernel, lf) in variants.items():
        line: dict[str, Any] = {**common, "variant": name, "compute_kernel": kernel}
        line["samples_per_s"] = round(statistics.median(speeds[name]), 1)
        line["per_round"] = [round(x) for x in speeds[name]]
        if lf is not None:
            counts = [out["counts"][name] for out in outs]
            lookups = sum(c["cache_lookups"] for c in counts)
            line["load_factor"] = lf
            line["cache_hit_rate"] = round(sum(c["cache_hits"] for c in counts) / lookups, 4) if lookups else None
            line["swap_ins_per_step_per_rank"] = round(
                sum(c["swap_ins"] for c in counts) / (len(counts) * args.rounds * args.steps), 1
            )
            static = [out["static"][name] for out in outs]
            line["cache_slots_per_rank"] = [int(s["cache_slots"]) for s in static]
            line["store_rows_per_rank"] = [int(s["store_rows"]) for s in static]
            line["store_rows_used_per_rank"] = [int(s["store_rows_used"]) for s in static]
        print(json.dumps(line), flush=True)
    for name, (_, lf) in variants.items():
        if lf is None:
            continue
        line = {**common, "metric": f"ratio_{name}_vs_resident", "value": round(ratio(name, "resident"), 3)}
        if lf == TARGET_LOAD_FACTOR and name.startswith("cache_"):
            line["target"] = TARGET_SPEED
        print(json.dumps(line), flush=True)
    print(json.dumps({**common, "metric": "speed_part_wall_s", "value": round(elapsed, 1)}), flush=True)


def _report_memory(args: argparse.Namespace, base: str) -> None:
    common = {
        "benchmark": "cache",
        "part": "memory",
        "world_size": args.world_size,
        "device": args.device,
        "batch_size_per_rank": args.batch_size,
        "dim": args.memory_dim,
        "steps": args.memory_steps,
        "id_range": args.memory_id_range,
    }
    rss: dict[tuple[str, int], list[int]] = {}
    for scale in (1, 4):
        rows = _memory_rows(args, scale)
        for store, kernel in (("file", "key_value"), ("resident", "fused")):
            args.store_dir = _fresh_dir(base, f"memory_{scale}")
            start = time.perf_counter()
            outs = _launch_fresh(_memory, args, kernel, rows, timeout_s=1800)
            elapsed = time.perf_counter() - start
            shutil.rmtree(args.store_dir, ignore_errors=True)
            rss[(store, scale)] = [out["after"]["RssAnon"] for out in outs]
            line: dict[str, Any] = {**common, "store": store, "compute_kernel": kernel}
            line.update(rows=rows, weights_gb=round(rows * args.memory_dim * 4 / GB, 3))
            line["rss_anon_mb_per_rank"] = [round(out["after"]["RssAnon"] / 2**20) for out in outs]
            line["rss_file_mb_per_rank"] = [round(out["after"]["RssFile"] / 2**20) for out in outs]
            line["rss_anon_before_build_mb_per_rank"] = [round(out["before"]["RssAnon"] / 2**20) for out in outs]
            if store == "file":
                line["cache_slots_per_rank"] = [int(out["counts"]["cache_slots"]) for out in outs]
                line["store_rows_used_per_rank"] = [int(out["counts"]["store_rows_used"]) for out in outs]
            line.update(_cuda_mb(outs))
            line["build_s"] = round(max(out["build_s"] for out in outs), 1)
            line["wall_s"] = round(elapsed, 1)
            print(json.dumps(line), flush=True)
        file_mb = [round(x / 2**20) for x in rss[("file", scale)]]
        resident_mb = [round(x / 2**20) for x in rss[("resident", scale)]]
        ratio = max(f / r for f, r in zip(rss[("file", scale)], rss[("resident", scale)], strict=True))
        print(
            json.dumps(
                {
                    **common,
                    "metric": "rss_anon_file_vs_resident",
                    "weights_gb": round(rows * args.memory_dim * 4 / GB, 3),
                    "file_mb_per_rank": file_mb,
                    "resident_mb_per_rank": resident_mb,
                    "value": round(ratio, 3),
                }
            ),
            flush=True,
        )
    for store in ("file", "resident"):
        growth = max(b / a for a, b in zip(rss[(store, 1)], rss[(store, 4)], strict=True))
        line = {**common, "metric": f"rss_anon_growth_4x_rows_{store}", "value": round(growth, 3)}
        line["gb"] = [args.memory_gb, 4 * args.memory_gb]
        if store == "file":
            line["target"] = TARGET_MEMORY_GROWTH
        print(json.dumps(line), flush=True)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def _report_large(args: argparse.Namespace, base: str) -> None:
    """One file-store run of a table of ``--large-gb`` GB of weights (plus its optimizer state)."""
    rows = int(args.large_gb * GB) // (4 * args.memory_dim)
    rows -= rows % args.world_size
    args.store_dir = _fresh_dir(base, "large")
    available = _mem_available()
    start = time.perf_counter()
    outs = _launch_fresh(_memory, args, "key_value", rows, timeout_s=3600)
    line = {
        "benchmark": "cache",
        "part": "large_file_store",
        "world_size": args.world_size,
        "device": args.device,
        "batch_size_per_rank": args.batch_size,
        "dim": args.memory_dim,
        "steps": args.memory_steps,
        "rows": rows,
        "weights_gb": round(rows * args.memory_dim * 4 / GB, 2),
        "store_file_gb": round(outs[0]["store_file_bytes"] / GB, 2),  # every rank's files, weights and state
        "store_disk_gb_written": round(outs[0]["store_disk_bytes"] / GB, 3),
        "mem_available_gb_before": round(available / GB, 2),
        "samples_per_s": round(outs[0]["samples_per_s"], 1),
        "rss_anon_mb_per_rank": [round(o["after"]["RssAnon"] / 2**20) for o in outs],
        "rss_file_mb_per_rank": [round(o["after"]["RssFile"] / 2**20) for o in outs],
        **_cuda_mb(outs),
        "cache_slots_per_rank": [int(o["counts"]["cache_slots"]) for o in outs],
        "store_rows_used_per_rank": [int(o["counts"]["store_rows_used"]) for o in outs],
        "cache_hit_rate": round(
            sum(o["counts"]["cache_hits"] for o in outs) / max(1.0, sum(o["counts"]["cache_lookups"] for o in outs)), 4
        ),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    shutil.rmtree(args.store_dir, ignore_errors=True)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
