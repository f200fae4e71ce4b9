"""Measure the constants of recsdk's planner cost model (``recsdk.sharding.planning.cost_model``).

Runs ``--world-size`` ranks on gloo (default 2, as the training benchmarks: the ranks compete for
the cores and memory as they do in training), one intra-op thread each, and times on every rank,
interleaving the sizes and taking the median over ``--repeats``:

- the host id work: ``IdMappingStage.map`` (``IdTable.find_or_insert`` and the KJT of rows) of one
  table's ids in steady state (the ids of ``RandomRecDataset``, as the benchmarks), at several
  ids per call, fitted as ``host_map_s_per_call + ids * host_map_s_per_id``; and the row-wise
  bucketing (``bucketize_by_owner``), fitted as ``intercept + ids * bucket_s_per_id``;
- the lookup: FBGEMM's CPU TBE (what TorchRec's fused kernel runs on CPU) with exact Adagrad fused
  into the backward, pooled SUM, on a ``--rows``-row table, at several bags, pooling factors and
  dims, fitted as ``intercept + ids*dim * lookup_*_s_per_value + outputs*dim * lookup_*_s_per_output``
  for the forward and for the backward (with the optimizer update);
- the gloo all-to-all (``all_to_all_single`` of float32 over all ranks, as the output dists and,
  with int64, the id all-to-alls), fitted as ``comm_s_per_call + bytes_crossing * comm_s_per_byte``
  where ``bytes_crossing`` is what a rank sends to the other ranks.

No ``--device``: it trains no model; the constants it measures are the host's (CPU kernels, gloo).

Prints one JSON line per constant (``constant``, ``value``, ``unit``, and the fit's points), the
median over ranks; paste the values into ``DEFAULT_COSTS`` in ``planning/hybrid_costs.py`` to re-calibrate.

    python benchmarks/calibrate_cost_model.py [--repeats 15] [--rows 200000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import random_batches
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data.testing import run_distributed
from recsdk.embedding import IdTable
from recsdk.sharding import RowLedger, bucketize_by_owner
from recsdk.sharding.host.host_stage import IdMappingStage, ShardInfo

POOLING = 4.0  # ids per bag of the host measurements (the benchmarks' default)


def _fit(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares ``y = c0 + sum_i c_i x_i`` with every ``c >= 0``: ``[c0, c1, ...]``.

    Noise can make an unconstrained fit's small terms negative, which no cost is: this tries
    every subset of the terms and keeps the best fit whose coefficients are all non-negative.
    """
    a = torch.tensor([[1.0, *x] for x in xs], dtype=torch.float64)
    b = torch.tensor(ys, dtype=torch.float64)[:, None]
    best: tuple[float, list[float]] | None = None
    for keep in itertools.product([True, False], repeat=a.shape[1]):
        cols = [i for i, k in enumerate(keep) if k]
        if not cols:
            continue
        solution = torch.linalg.lstsq(a[:, cols], b).solution[:, 0]
        if bool((solution < 0).any()):
            continue
        residual = float(((a[:, cols] @ solution[:, None] - b) ** 2).sum())
        coefficients = [0.0] * a.shape[1]
        for i, value in zip(cols, solution.tolist(), strict=True):
            coefficients[i] = value
        if best is None or residual < best[0]:
            best = (residual, coefficients)
    assert best is not None
    return best[1]


def _typical(times: list[float]) -> float:
    """The lower quartile: on a shared machine other load only ever adds time, in bursts."""
    return statistics.quantiles(times, n=4)[0]


def _interleaved(cases: list[Any], run: Callable[[Any], float], repeats: int) -> list[float]:
    """Typical seconds per case (:func:`_typical`), the cases alternating within each repeat."""
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(repeats):
        for i, case in enumerate(cases):
            times[i].append(run(case))
    return [_typical(t) for t in times]


def _host(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    # (tables in the KJT, bags per feature): separates the per-call, per-table and per-id costs.
    cases = [(1, 256), (1, 1024), (1, 4096), (4, 256), (4, 1024)]
    id_range = args.rows // 2
    stages, batches = {}, {}
    for case in cases:
        k, bags = case
        features = [f"f{i}" for i in range(k)]
        data = random_batches(
            batch_size=bags,
            num_batches=args.repeats + 8,
            features=features,
            id_range=id_range,
            pooling=POOLING,
            rank=rank,
            world_size=world_size,
        )
        tables = {f"t{i}": IdTable(args.rows, name=f"t{i}") for i in range(k)}
        infos = {name: ShardInfo(name, args.rows, "table_wise", rank) for name in tables}
        stage = IdMappingStage(tables, infos, {f"f{i}": f"t{i}" for i in range(k)})
        ledger = RowLedger(stage.id_tables, stage.lock)
        for token, b in enumerate(data[:8]):  # steady state: most ids are in the table
            stage.map([b.sparse_features], token, ledger, training=True)
            ledger.release(token)
        stages[case] = (stage, ledger)
        batches[case] = iter(data[8:])
    ids_per_call = {case: 0 for case in cases}
    token = [100]

    def map_once(case: tuple[int, int]) -> float:
        stage, ledger = stages[case]
        kjt = next(batches[case]).sparse_features
        ids_per_call[case] = kjt.values().numel()
        token[0] += 1
        start = time.perf_counter()
        stage.map([kjt], token[0], ledger, training=True)
        elapsed = time.perf_counter() - start
        ledger.release(token[0])
        return elapsed

    map_s = _interleaved(cases, map_once, args.repeats)
    map_x = [[float(k), float(ids_per_call[(k, b)])] for k, b in cases]
    sizes = [1024, 4096, 16384]
    kjts = {n: _kjt(n, id_range, rank, world_size) for n in sizes}

    def bucket_once(n: int) -> float:
        start = time.perf_counter()
        bucketize_by_owner(kjts[n], world_size)
        return time.perf_counter() - start

    bucket_s = _interleaved(sizes, bucket_once, args.repeats)
    bucket_x = [[float(kjts[n].values().numel())] for n in sizes]
    return {"map": (map_x, map_s, _fit(map_x, map_s)), "bucket": (bucket_x, bucket_s, _fit(bucket_x, bucket_s))}


def _kjt(n: int, id_range: int, rank: int, world_size: int) -> KeyedJaggedTensor:
    b = random_batches(
        batch_size=int(n / POOLING),
        num_batches=1,
        features=["f0"],
        id_range=id_range,
        pooling=POOLING,
        rank=rank,
        world_size=world_size,
    )[0]
    return b.sparse_features


def _rows(
    bags: int, pooling: float, rows: int, rank: int, world_size: int, warmup: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's row indices and offsets as the host stage makes them: the benchmarks' ids, mapped."""
    data = random_batches(
        batch_size=bags,
        num_batches=warmup + 1,
        features=["f0"],
        id_range=rows // 2,
        pooling=pooling,
        rank=rank,
        world_size=world_size,
    )
    table = IdTable(rows)
    for b in data[:warmup]:  # steady state: the rows of earlier batches are spread over the table
        table.find_or_insert(b.sparse_features.values())
    kjt = data[warmup].sparse_features
    return table.find_or_insert(kjt.values()), kjt.offsets()


def _lookup(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    # (bags, pooling, dim): the per-id, per-value and per-output terms vary independently.
    cases = [
        (2048, 1, 32),
        (2048, 4, 32),
        (2048, 16, 32),
        (8192, 1, 32),
        (512, 16, 32),
        (2048, 4, 64),
        (2048, 4, 16),
        (8192, 4, 8),
        (512, 4, 128),
    ]
    tbes, inputs = {}, {}
    for case in cases:
        bags, pooling, dim = case
        if dim not in tbes:
            tbes[dim] = SplitTableBatchedEmbeddingBagsCodegen(
                [(args.rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                optimizer=EmbOptimType.EXACT_ADAGRAD,
                learning_rate=0.05,
                eps=0.1,
                pooling_mode=PoolingMode.SUM,
            )
        inputs[case] = _rows(bags, float(pooling), args.rows, rank, world_size)
    fwd: dict[tuple[int, int, int], list[float]] = {c: [] for c in cases}
    bwd: dict[tuple[int, int, int], list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats + 2):
        for case in cases:
            indices, offsets = inputs[case]
            tbe = tbes[case[2]]
            start = time.perf_counter()
            out = tbe(indices, offsets)
            mid = time.perf_counter()
            out.backward(torch.ones_like(out))
            end = time.perf_counter()
            fwd[case].append(mid - start)
            bwd[case].append(end - mid)
    xs = [[float(inputs[c][0].numel()), float(inputs[c][0].numel() * c[2]), float(c[0] * c[2])] for c in cases]
    fwd_s = [_typical(fwd[c][2:]) for c in cases]
    bwd_s = [_typical(bwd[c][2:]) for c in cases]
    return {"fwd": (xs, fwd_s, _fit(xs, fwd_s)), "bwd": (xs, bwd_s, _fit(xs, bwd_s))}


def _comm(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    # float32 elements a rank sends in all. Back to back, without a barrier between them, as a
    # training step issues its collectives: the time includes waking the peer (on a loaded
    # machine, a scheduler delay), which a barrier before each call would hide.
    sizes = [256, 4096, 65536, 262144, 1048576]
    tensors = {n: torch.randn(n) for n in sizes}
    outs = {n: torch.empty(n) for n in sizes}
    burst = 5

    def once(n: int) -> float:
        start = time.perf_counter()
        for _ in range(burst):
            dist.all_to_all_single(outs[n], tensors[n])
        return (time.perf_counter() - start) / burst

    for n in sizes:
        once(n)
    dist.barrier()
    secs = _interleaved(sizes, once, args.repeats)
    crossing = [[4.0 * n * (world_size - 1) / world_size] for n in sizes]
    return {"a2a": (crossing, secs, _fit(crossing, secs))}


def _run(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {"comm": _comm(rank, world_size, args)}
    out["host"] = _host(rank, world_size, args)
    dist.barrier()
    out["lookup"] = _lookup(rank, world_size, args)
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the measured tables")
    args = parser.parse_args(argv)
    per_rank = run_distributed(_run, args.world_size, args, timeout_s=1800)

    def median_over_ranks(path: tuple[str, str], index: int) -> float:
        return statistics.median(r[path[0]][path[1]][2][index] for r in per_rank)

    def line(name: str, path: tuple[str, str], index: int, unit: str, with_points: bool = False) -> None:
        out = {
            "benchmark": "calibrate_cost_model",
            "constant": name,
            "value": float(f"{median_over_ranks(path, index):.4g}"),
        }
        out["unit"] = unit
        if with_points:  # rank 0's measurements: [x..., microseconds]
            xs, ys, _ = per_rank[0][path[0]][path[1]]
            out["points_us"] = [[*x, round(y * 1e6, 1)] for x, y in zip(xs, ys, strict=True)]
        print(json.dumps(out))

    line("host_map_s_per_table", ("host", "map"), 1, "s per table shard mapped (x: tables, ids)", with_points=True)
    line("host_map_s_per_id", ("host", "map"), 2, "s per id mapped (find_or_insert, steady state)")
    line("host_map_s_per_call", ("host", "map"), 0, "s per map call (one per sharding group and rank; not per shard)")
    line("bucket_s_per_id", ("host", "bucket"), 1, "s per id bucketed by owner (row-wise; x: ids)", with_points=True)
    for direction in ("fwd", "bwd"):
        what = "forward" if direction == "fwd" else "backward, exact Adagrad fused"
        line(
            f"lookup_{direction}_s_per_id",
            ("lookup", direction),
            1,
            f"s per id ({what}; x: ids, ids*dim, bags*dim)",
            with_points=True,
        )
        line(f"lookup_{direction}_s_per_value", ("lookup", direction), 2, f"s per id x dim ({what})")
        line(f"lookup_{direction}_s_per_output", ("lookup", direction), 3, f"s per output value, bag x dim ({what})")
        line(f"lookup_{direction}_s_per_call", ("lookup", direction), 0, f"s per kernel call ({what}; not per shard)")
    line(
        "comm_s_per_byte",
        ("comm", "a2a"),
        1,
        "s per byte sent to other ranks (gloo all-to-all; x: bytes)",
        with_points=True,
    )
    line("comm_s_per_call", ("comm", "a2a"), 0, "s per gloo all-to-all (not per shard)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
