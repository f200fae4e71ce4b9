"""Serving: lookups on raw ids against TorchRec's on remapped ids; applying deltas while serving.

A model with ``--tables`` hash tables of ``--ids`` ids each (dim ``--dim``) is published by a
real ``Publisher`` (one rank: a full version, then deltas of ``--delta-rows`` changed rows each),
in fp32 and int8, and served in this process. One JSON line per measurement:

- ``lookup``: per thread count (``torch.set_num_threads``: 1, and all cores) and batch size (512
  and 1 samples, ``--pooling`` ids per bag, Zipf), the serving collection's ids/s and latency
  p50/p99 on raw ids, against TorchRec's ``EmbeddingBagCollection`` (fp32) and
  ``QuantEmbeddingBagCollection`` (int8) on the same ids remapped offline to ``0..n-1``; ratio =
  ours / theirs in ids/s (target >= 0.8); the collections' ``lookup_threads`` is set to the
  thread count, and ``lookup_groups`` is the threads a forward split its lookup over
  (``recsdk.serving.grouped_lookup``); where recsdk's id lookup kernel is built, each round also
  runs the same forwards on FBGEMM's ``pruned_hashmap_lookup`` alone (``native_min_ids = -1``):
  ``fbgemm_lookup_ids_per_s`` and ``fbgemm_lookup_ratio`` (ours on FBGEMM's id lookup / theirs),
  interleaved with the others, and ``native_lookup`` says whether the forwards used recsdk's op;
- ``batch_check``: per thread count and dtype at batch 512, what ``check_batch`` costs: forwards
  with it against the same forwards with it replaced by the bare ``asynchronous_complete_cumsum``
  of the lengths and the read of its total (what a forward needs without the check),
  ``--check-rounds`` rounds, each two passes over the batches alternating forward by forward
  (so load that comes and goes hits both alike); ``cost_pct`` = (with / without - 1) * 100 from
  the medians of the per-forward times (target < 3), ``cost_of_means_pct`` the same from the
  medians of the rounds' mean forward times (a preempted forward weighs in); the check alone
  against the bare cumsum alone, in µs per call, and ``check_net_pct``, their difference over
  the forward without the check;
- ``apply_delta``: ``ServingModel.refresh()`` of a delta of ``--delta-rows`` rows, its seconds,
  and the p99 latency of forwards (batch 512, another thread) while deltas apply against the
  p99 while none does (target <= 2x);
- ``memory``: bytes per served id (the id index, the id table's per-row arrays, the kernel's row)
  at fp32 and int8, against the row's own bytes.

Latencies are medians over ``--rounds`` interleaved rounds of ``--forwards`` forwards each.
The dev machine has 2 cores, so a lookup splits over at most 2 threads there.

No ``--device``: recsdk's serving collections run FBGEMM's CPU inference kernel (rows in host memory).

    python benchmarks/serving.py [--ids 200000] [--tables 4] [--dim 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

import torch
from _common import DLRM, embedding_collection, feature_names, fill_hash_tables, host_env, shard, table_configs
from torch.ao.quantization import PlaceholderObserver, QConfig
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

from recsdk.data import Batch
from recsdk.data.testing import run_distributed
from recsdk.serving import ServingModel
from recsdk.serving import serving_collections as collections_module
from recsdk.serving.grouped_lookup import feature_bounds
from recsdk.sharding import Publisher, get_default_hybrid_sharders, sharded_hash_modules

NUM_DENSE = 13


def _model(args: argparse.Namespace, device: str) -> DLRM:
    features = feature_names(args.tables)
    configs = table_configs("hash", features, args.dim, int(args.ids / 0.8))
    ebc = (
        embedding_collection(configs)
        if device == "meta"
        else type(embedding_collection(configs))(tables=configs, device=torch.device(device))
    )
    return DLRM(ebc, features, args.dim)


def _publish(rank: int, world_size: int, args: argparse.Namespace, roots: dict[str, str]) -> dict[str, torch.Tensor]:
    """One rank: per dtype, fill the tables and publish a full version and ``--deltas`` deltas.

    Each dtype's chain comes from its own model and ``Publisher``: a model's change trackers feed
    one chain (a second publisher on the same model would publish full versions every time)."""
    ids: dict[str, torch.Tensor] = {}
    for dtype, root in roots.items():
        torch.manual_seed(0)
        dmp, _ = shard(_model(args, "meta"), get_default_hybrid_sharders(host_env=host_env()), None, 512)
        ids = fill_hash_tables(dmp, args.ids, rank, world_size)  # the same ids for every dtype
        (module,) = sharded_hash_modules(dmp).values()
        publisher = Publisher(dmp, root, dtype=getattr(torch, dtype), keep=1000)
        publisher.publish(step=0)
        gen = torch.Generator().manual_seed(7)
        for step in range(1, args.deltas + 1):
            per_table = args.delta_rows // args.tables
            views = module.table_views()
            for name, table in module.id_tables.items():
                _, rows = table.ids_and_rows()
                pick = rows[torch.randperm(rows.numel(), generator=gen)[:per_table]]
                with torch.no_grad():
                    views[name].weight[pick] += 0.01
                table.changes.changed(pick)
            publisher.publish(step=step)
        del dmp, module, publisher
    return ids


def _batches(args: argparse.Namespace, ids: dict[str, torch.Tensor], batch_size: int, n: int) -> list[tuple[Any, Any]]:
    """``n`` pairs (KJT of raw ids, the same KJT remapped to 0..k-1 per table), Zipf over the ids."""
    gen = torch.Generator().manual_seed(batch_size)
    features = feature_names(args.tables)
    out = []
    for _ in range(n):
        lengths = torch.full((args.tables * batch_size,), args.pooling, dtype=torch.int64)
        raw, remapped = [], []
        for i in range(args.tables):
            table = ids[f"t{i}"]
            u = torch.rand(batch_size * args.pooling, generator=gen)
            idx = ((table.numel() ** u) - 1).long().clamp_(max=table.numel() - 1)  # ~Zipf(1)
            raw.append(table[idx])
            remapped.append(idx)
        out.append(
            (
                KeyedJaggedTensor(keys=features, values=torch.cat(raw), lengths=lengths),
                KeyedJaggedTensor(keys=features, values=torch.cat(remapped), lengths=lengths),
            )
        )
    return out


def _thread_counts(args: argparse.Namespace) -> list[int]:
    return sorted(set(args.threads)) if args.threads else sorted({1, os.cpu_count() or 1})


def _latencies(fn: Any, inputs: list[Any]) -> list[float]:
    out = []
    with torch.no_grad():
        for x in inputs:
            start = time.perf_counter()
            fn(x)
            out.append(time.perf_counter() - start)
    return out


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _lookups(args: argparse.Namespace, served: dict[str, ServingModel], ids: dict[str, torch.Tensor]) -> None:
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=ids[f"t{i}"].numel(), feature_names=[f])
        for i, f in enumerate(feature_names(args.tables))
    ]
    torchrec_ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    torchrec_ebc.qconfig = QConfig(
        activation=PlaceholderObserver.with_args(dtype=torch.float),
        weight=PlaceholderObserver.with_args(dtype=torch.qint8),
    )
    quant_ebc = QuantEmbeddingBagCollection.from_float(torchrec_ebc)
    pairs = {
        "float32": (served["float32"].model.ebc, torchrec_ebc, "EmbeddingBagCollection (fp32)"),
        "uint8": (served["uint8"].model.ebc, quant_ebc, "QuantEmbeddingBagCollection (int8)"),
    }
    for threads in _thread_counts(args):
        torch.set_num_threads(threads)
        for batch_size in (512, 1):
            batches = _batches(args, ids, batch_size, args.forwards)
            ids_per_forward = args.tables * batch_size * args.pooling
            first = batches[0][0]
            groups = len(feature_bounds(first.offsets(), batch_size, args.tables, threads)) - 1
            for dtype, (ours, theirs, name) in pairs.items():
                ours.lookup_threads = threads
                native = ours.native_min_ids
                mine: list[list[float]] = []
                base: list[list[float]] = []
                on_fbgemm: list[list[float]] = []  # ours with FBGEMM's id lookup alone
                for _ in range(args.rounds):  # interleaved: ours, theirs, ours on FBGEMM's lookup, ...
                    mine.append(_latencies(ours, [raw for raw, _ in batches]))
                    base.append(_latencies(theirs, [remapped for _, remapped in batches]))
                    if native >= 0:
                        ours.native_min_ids = -1
                        try:
                            on_fbgemm.append(_latencies(ours, [raw for raw, _ in batches]))
                        finally:
                            ours.native_min_ids = native
                ours_s = statistics.median(statistics.mean(r) for r in mine)
                theirs_s = statistics.median(statistics.mean(r) for r in base)
                flat_mine, flat_base = [x for r in mine for x in r], [x for r in base for x in r]
                line = {
                    "benchmark": "serving",
                    "measurement": "lookup",
                    "rows": dtype,
                    "threads": threads,
                    "batch_size": batch_size,
                    "ids_per_forward": ids_per_forward,
                    "lookup_groups": groups,
                    "ids_per_s": ids_per_forward / ours_s,
                    "p50_ms": _p(flat_mine, 0.5) * 1e3,
                    "p99_ms": _p(flat_mine, 0.99) * 1e3,
                    "baseline": name,
                    "baseline_ids_per_s": ids_per_forward / theirs_s,
                    "baseline_p50_ms": _p(flat_base, 0.5) * 1e3,
                    "baseline_p99_ms": _p(flat_base, 0.99) * 1e3,
                    "ratio": theirs_s / ours_s,
                    "native_lookup": 0 <= native <= ids_per_forward,
                }
                if on_fbgemm:
                    fbgemm_s = statistics.median(statistics.mean(r) for r in on_fbgemm)
                    line["fbgemm_lookup_ids_per_s"] = ids_per_forward / fbgemm_s
                    line["fbgemm_lookup_ratio"] = theirs_s / fbgemm_s
                print(json.dumps(line), flush=True)
    torch.set_num_threads(os.cpu_count() or 1)


def _offsets_only(features: KeyedJaggedTensor, feature_names: list[str], module: str, is_weighted: bool) -> Any:
    """What a forward computes of its batch without ``check_batch``: the offsets and their total
    (which ``feature_bounds`` reads), nothing checked."""
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(features.lengths())
    return offsets, int(offsets[-1])


def _mean_seconds(fn: Any, inputs: list[Any]) -> float:
    with torch.no_grad():
        start = time.perf_counter()
        for x in inputs:
            fn(x)
        return (time.perf_counter() - start) / len(inputs)


def _interleaved_forwards(
    collection: Any, raw: list[KeyedJaggedTensor], checked: Any, round_index: int
) -> tuple[list[float], list[float]]:
    """Two passes over ``raw``, alternating forward by forward between ``checked`` and
    :func:`_offsets_only` as the collections' ``check_batch`` (which batches get the check swaps
    between the passes and every round, so each batch runs both ways): per-forward seconds with
    the check and without."""
    with_check: list[float] = []
    without: list[float] = []
    with torch.no_grad():
        for half in (0, 1):
            for i, kjt in enumerate(raw):
                check = (i + half + round_index) % 2 == 0
                collections_module.check_batch = checked if check else _offsets_only
                start = time.perf_counter()
                collection(kjt)
                (with_check if check else without).append(time.perf_counter() - start)
    return with_check, without


def _batch_check(args: argparse.Namespace, served: dict[str, ServingModel], ids: dict[str, torch.Tensor]) -> None:
    """Forwards at batch 512 with ``check_batch`` and with it bypassed, interleaved forward by forward."""
    checked = collections_module.check_batch
    raw = [r for r, _ in _batches(args, ids, 512, args.forwards)]
    features = feature_names(args.tables)
    for threads in _thread_counts(args):
        torch.set_num_threads(threads)
        for dtype, serving in served.items():
            collection = serving.model.ebc
            collection.lookup_threads = threads
            with_check: list[float] = []  # per forward, every round
            without: list[float] = []
            round_means: list[tuple[float, float]] = []
            check_alone: list[float] = []
            cumsum_alone: list[float] = []
            try:
                for r in range(args.check_rounds):
                    ours_r, theirs_r = _interleaved_forwards(collection, raw, checked, r)
                    with_check += ours_r
                    without += theirs_r
                    round_means.append((statistics.mean(ours_r), statistics.mean(theirs_r)))
                    check_alone.append(_mean_seconds(lambda k: checked(k, features, "bench", False), raw))
                    cumsum_alone.append(_mean_seconds(lambda k: _offsets_only(k, features, "bench", False), raw))
            finally:
                collections_module.check_batch = checked
            ours, theirs = statistics.median(with_check), statistics.median(without)
            ours_mean = statistics.median(m for m, _ in round_means)
            theirs_mean = statistics.median(m for _, m in round_means)
            check_us, cumsum_us = statistics.median(check_alone) * 1e6, statistics.median(cumsum_alone) * 1e6
            line = {
                "benchmark": "serving",
                "measurement": "batch_check",
                "rows": dtype,
                "threads": threads,
                "batch_size": 512,
                "rounds": args.check_rounds,
                "forwards": len(with_check) + len(without),
                "forward_ms": ours * 1e3,
                "baseline": "the same forward without check_batch (the lengths' cumsum and its total only)",
                "baseline_forward_ms": theirs * 1e3,
                "cost_pct": (ours / theirs - 1) * 100,
                "cost_of_means_pct": (ours_mean / theirs_mean - 1) * 100,
                "check_us": check_us,
                "cumsum_us": cumsum_us,
                "check_net_pct": (check_us - cumsum_us) * 1e-3 / (theirs * 1e3) * 100,
                "ratio": theirs / ours,
            }
            print(json.dumps(line), flush=True)
    torch.set_num_threads(os.cpu_count() or 1)


def _apply_while_serving(args: argparse.Namespace, source: str, ids: dict[str, torch.Tensor]) -> None:
    """Deltas applied one by one while another thread runs forwards; p99 during applies vs not."""
    root = tempfile.mkdtemp(prefix="recsdk-serving-apply-")
    try:
        shutil.copytree(os.path.join(source, "00000000"), os.path.join(root, "00000000"))
        serving = ServingModel(_model(args, "cpu"), root)
        raw = [r for r, _ in _batches(args, ids, 512, 64)]
        batches = [Batch(torch.rand(512, NUM_DENSE), kjt, torch.zeros(512)) for kjt in raw]
        timeline: list[tuple[float, float]] = []  # (start, seconds)
        stop = threading.Event()

        def forwards() -> None:
            i = 0
            while not stop.is_set():
                start = time.perf_counter()
                serving(batches[i % len(batches)])
                timeline.append((start, time.perf_counter() - start))
                i += 1

        thread = threading.Thread(target=forwards)
        thread.start()
        windows: list[tuple[float, float]] = []
        apply_s = []
        time.sleep(1.0)
        for v in range(1, args.deltas + 1):
            shutil.copytree(os.path.join(source, f"{v:08d}"), os.path.join(root, f"{v:08d}"))
            start = time.perf_counter()
            serving.refresh()
            end = time.perf_counter()
            if serving.kind != "delta":
                raise RuntimeError(f"version {serving.version} applied as {serving.kind!r}: this measures deltas")
            windows.append((start, end))
            apply_s.append(end - start)
            time.sleep(0.5)
        stop.set()
        thread.join()
        during = [s for t, s in timeline if any(a - s <= t <= b for a, b in windows)]
        outside = [s for t, s in timeline if not any(a - 1.0 <= t <= b + 0.2 for a, b in windows)]
        line = {
            "benchmark": "serving",
            "measurement": "apply_delta",
            "delta_rows": args.delta_rows,
            "apply_seconds": statistics.median(apply_s),
            "forwards_during": len(during),
            "p99_during_ms": _p(during, 0.99) * 1e3 if during else None,
            "p99_without_ms": _p(outside, 0.99) * 1e3,
            "ratio": _p(during, 0.99) / _p(outside, 0.99) if during else None,
        }
        print(json.dumps(line), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _memory(args: argparse.Namespace, served: dict[str, ServingModel]) -> None:
    for dtype, serving in served.items():
        collection = serving.model.ebc
        tables = collection.tables
        num_ids = sum(len(t) for t in tables)
        index = sum(t.ids.memory_bytes for t in tables)  # the hash slots and the per-row arrays
        kernel = sum(
            sum(w.numel() * w.element_size() for w in pair if w is not None)
            for pair in collection.tbe.split_embedding_weights(split_scale_shifts=True)
        )
        own = args.dim * 4 if dtype == "float32" else args.dim + 4
        line = {
            "benchmark": "serving",
            "measurement": "memory",
            "rows": dtype,
            "ids": num_ids,
            "bytes_per_id": (index + kernel) / num_ids,
            "index_bytes_per_id": index / num_ids,
            "kernel_bytes_per_id": kernel / num_ids,
            "row_bytes": own,
            "ratio": (index + kernel) / num_ids / own,
        }
        print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, default=200_000, help="ids per table")
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--pooling", type=int, default=4, help="ids per bag")
    parser.add_argument("--deltas", type=int, default=5)
    parser.add_argument("--delta-rows", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forwards", type=int, default=200, help="forwards per round and case")
    parser.add_argument("--check-rounds", type=int, default=15, help="interleaved rounds of the batch check's cost")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["lookup", "batch_check", "memory", "apply_delta"],
        default=["lookup", "batch_check", "memory", "apply_delta"],
        help="the measurements to run (default: all)",
    )
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="thread counts (default: 1 and all cores)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="recsdk-serving-bench-")
    try:
        roots = {dtype: os.path.join(work, dtype) for dtype in ("float32", "uint8")}
        ids = run_distributed(_publish, 1, args, roots, timeout_s=1800)[0]
        served = {dtype: ServingModel(_model(args, "cpu"), root) for dtype, root in roots.items()}
        if "lookup" in args.only:
            _lookups(args, served, ids)
        if "batch_check" in args.only:
            _batch_check(args, served, ids)
        if "memory" in args.only:
            _memory(args, served)
        del served
        if "apply_delta" in args.only:
            _apply_while_serving(args, roots["float32"], ids)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
