"""Publishing versions for serving: full versions, deltas, and what publishing costs training.

Two ranks on gloo (``--world-size``; ``--device cuda``: one rank on one GPU over nccl, the host
group on gloo) hold the benchmarks' DLRM with ``--tables`` hash tables sharded row-wise, their
id tables filled to ``--ids`` ids in all (fused Adagrad). In the same run, one JSON line each:

- ``full``: ``Publisher.publish`` of a full version (every id with its row, fp32) against
  ``export_embeddings`` of the same tables (Parquet), MB/s of the rows' bytes, slowest rank
  counted; ratio = publish MB/s / export MB/s;
- ``delta_1pct``, ``delta_10pct``: a delta after that share of the ids changed (rows stamped by
  what training stamps, half of them given new values; ids removed for a tenth of the share, so
  the delta carries deletions), its time and bytes as fractions of the full publish (targets at
  1%: <= 0.1x the time, <= 0.05x the bytes); ``extra_ids``: ids the delta holds beyond those
  changed (0: exact);
- ``training``: samples/s of training on Zipf batches with a delta published every
  ``--publish-every-s`` seconds of training, against the same training without a publisher
  (ratio, target >= 0.9), in interleaved rounds on two models;
- ``tracking``: the change tracking's cost per step (tracked model, no publishing, against the
  untracked one), in microseconds and as a fraction of the step.

Training rounds last about ``--round-s`` seconds each (a step count calibrated first, the same
for all three variants), so a round with deltas publishes ``round-s / publish-every-s`` of them.

Medians over ``--rounds`` interleaved rounds.

Training runs the plain loop, its batches already on the device.

    python benchmarks/publish.py [--ids 1000000] [--dim 64] [--rounds 5] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    DLRM,
    device_of,
    embedding_collection,
    feature_names,
    fill_hash_tables,
    host_env,
    launch,
    parse_device_args,
    random_batches,
    set_threads,
    shard,
    slowest_rank_seconds,
    table_configs,
)

from recsdk.sharding import Publisher, export_embeddings, get_default_hybrid_sharders, sharded_hash_modules

BATCH = 1024


def _build(args: argparse.Namespace) -> tuple[Any, Any, dist.ProcessGroup]:
    """The sharded model on ``--device``, its optimizer, and its host (gloo) group: the CPU
    tensors' collectives go there (the default group is nccl on CUDA)."""
    torch.manual_seed(0)
    features = feature_names(args.tables)
    rows = int(args.ids / args.tables / 0.8)  # id tables 80% full
    model = DLRM(embedding_collection(table_configs("hash", features, args.dim, rows)), features, args.dim)
    from torchrec.distributed.planner import ParameterConstraints

    constraints = {f"t{i}": ParameterConstraints(sharding_types=["row_wise"]) for i in range(args.tables)}
    host = host_env()
    sharders = get_default_hybrid_sharders(host_env=host)
    dmp, optimizer = shard(model, sharders, constraints, BATCH, device=device_of(args.device))
    return dmp, optimizer, host.process_group


def _change(dmp: Any, share: float, rank: int, round_: int) -> int:
    """Change ``share`` of each local table's ids as training would: rows stamped (half of them
    with new values), a tenth of the share removed. Returns the ids changed on this rank."""
    (module,) = sharded_hash_modules(dmp).values()
    gen = torch.Generator().manual_seed(99 + rank + 10 * round_)
    views = module.table_views()
    changed = 0
    for name, table in module.id_tables.items():
        ids, rows = table.ids_and_rows()
        pick = torch.randperm(ids.numel(), generator=gen)[: int(share * ids.numel())]
        removed = pick[: pick.numel() // 10]
        trained = pick[pick.numel() // 10 :]
        with torch.no_grad():
            half = rows[trained[: trained.numel() // 2]].to(views[name].weight.device)
            views[name].weight[half] += 0.01
        table.changes.changed(rows[trained])
        table.remove(ids[removed])
        changed += pick.numel()
    return changed


def _rows_bytes(dmp: Any, host: dist.ProcessGroup) -> int:
    (module,) = sharded_hash_modules(dmp).values()
    total = torch.tensor([sum(len(t) * module.table_configs[n].embedding_dim * 4 for n, t in module.id_tables.items())])
    dist.all_reduce(total, group=host)
    return int(total)


def _publish_and_export(rank: int, world_size: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    set_threads(args.threads)
    dmp, _, host = _build(args)
    fill_hash_tables(dmp, args.ids // args.tables, rank, world_size)
    nbytes = _rows_bytes(dmp, host)
    full_s, export_s, full_bytes = [], [], []
    fulls = Publisher(dmp, os.path.join(root, "full"), full_every=1, keep=1)
    for r in range(args.rounds):
        full_s.append(slowest_rank_seconds(lambda r=r: fulls.publish(step=r), host))
        full_bytes.append(fulls.records[-1].bytes)
        path = os.path.join(root, f"export{r}")
        export_s.append(slowest_rank_seconds(lambda path=path: export_embeddings(dmp, path), host))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
    out: dict[str, Any] = {
        "full": {
            "publish_mb_per_s": nbytes / 1e6 / statistics.median(full_s),
            "export_mb_per_s": nbytes / 1e6 / statistics.median(export_s),
            "seconds": statistics.median(full_s),
            "bytes": statistics.median(full_bytes),
            "ids": fulls.records[-1].ids,
        }
    }
    deltas = Publisher(dmp, os.path.join(root, "delta"), full_every=10**9)
    deltas.publish(step=0)  # the first version of a new publisher is full
    for share in (0.01, 0.10):
        seconds, sizes, extra = [], [], []
        for r in range(args.rounds):
            changed = torch.tensor([_change(dmp, share, rank, r)])
            dist.all_reduce(changed, group=host)
            seconds.append(slowest_rank_seconds(lambda r=r: deltas.publish(step=r), host))
            record = deltas.records[-1]
            sizes.append(record.bytes)
            extra.append(record.ids + record.deleted - int(changed))
        out[f"delta_{round(share * 100)}pct"] = {
            "seconds": statistics.median(seconds),
            "bytes": statistics.median(sizes),
            "extra_ids": max(extra),
        }
    return out


def _training(rank: int, world_size: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    set_threads(args.threads)
    device = device_of(args.device)
    plain, plain_opt, host = _build(args)
    tracked, tracked_opt, _ = _build(args)
    for dmp in (plain, tracked):
        fill_hash_tables(dmp, args.ids // args.tables, rank, world_size)
    id_range = int(args.ids / args.tables * 1.2)
    batches = random_batches(
        batch_size=BATCH,
        num_batches=64,
        features=feature_names(args.tables),
        id_range=id_range,
        pooling=4,
        rank=rank,
        world_size=world_size,
    )
    batches = [b.to(device) for b in batches]  # the plain loop's, on the device (on CPU: the same)
    publisher = Publisher(tracked, os.path.join(root, "train"), full_every=10**9, keep=1)
    publisher.publish(step=0)
    for module in sharded_hash_modules(plain).values():  # the baseline: no tracking at all
        assert all(t.changes is None for t in module.id_tables.values())

    def train(dmp: Any, opt: Any, steps: int, publish_every: int | None) -> tuple[float, int]:
        """Seconds (slowest rank) for ``steps`` steps, publishing a delta every ``publish_every`` steps."""
        published = 0
        dist.barrier()
        start = time.perf_counter()
        for i in range(1, steps + 1):
            loss, _ = dmp(batches[i % len(batches)])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if publish_every is not None and i % publish_every == 0:
                publisher.publish(step=i)
                published += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the last step's device work in the time
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=host)
        return float(elapsed), published

    train(plain, plain_opt, 5, None)
    train(tracked, tracked_opt, 5, None)
    # Steps are counted, not timed, so that every rank publishes at the same step: a round lasts
    # about --round-s seconds and a delta comes every --publish-every-s seconds of training.
    per_step = train(plain, plain_opt, 20, None)[0] / 20
    steps = max(1, int(args.round_s / per_step))
    publish_every = max(1, int(args.publish_every_s / per_step))
    base, with_deltas, tracked_only, publishes = [], [], [], []
    for _ in range(args.rounds):
        base.append(train(plain, plain_opt, steps, None)[0])
        seconds, n = train(tracked, tracked_opt, steps, publish_every)
        with_deltas.append(seconds)
        publishes.append(n)
        tracked_only.append(train(tracked, tracked_opt, steps, None)[0])
    samples = steps * BATCH * world_size
    step_base = statistics.median(base) / steps
    step_tracked = statistics.median(tracked_only) / steps
    return {
        "training": {
            "samples_per_s": samples / statistics.median(with_deltas),
            "baseline_samples_per_s": samples / statistics.median(base),
            "steps_per_round": steps,
            "deltas_per_round": statistics.median(publishes),
            "delta_seconds": statistics.median(r.seconds for r in publisher.records[1:]),
            "delta_ids": statistics.median(r.ids for r in publisher.records[1:]),
        },
        "tracking": {
            "us_per_step": (step_tracked - step_base) * 1e6,
            "fraction_of_step": (step_tracked - step_base) / step_base,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, default=1_000_000, help="ids in all tables together")
    parser.add_argument("--tables", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=12.0, help="seconds of training per round and variant")
    parser.add_argument("--publish-every-s", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parse_device_args(parser)
    root = tempfile.mkdtemp(prefix="recsdk-publish-bench-")
    try:
        config = {"ids": args.ids, "tables": args.tables, "dim": args.dim, "ranks": args.world_size}
        config["device"] = args.device
        out = launch(_publish_and_export, args.world_size, args.device, args, root, timeout_s=1800)[0]
        full = out["full"]
        print(
            json.dumps(
                {
                    "benchmark": "publish",
                    "measurement": "full",
                    **config,
                    **full,
                    "ratio": full["publish_mb_per_s"] / full["export_mb_per_s"],
                }
            )
        )
        for key in ("delta_1pct", "delta_10pct"):
            d = out[key]
            line = {
                "benchmark": "publish",
                "measurement": key,
                **config,
                **d,
                "time_fraction": d["seconds"] / full["seconds"],
                "bytes_fraction": d["bytes"] / full["bytes"],
            }
            print(json.dumps(line))
        shutil.rmtree(root, ignore_errors=True)
        root = tempfile.mkdtemp(prefix="recsdk-publish-bench-")
        out = launch(_training, args.world_size, args.device, args, root, timeout_s=3600)[0]
        training = out["training"]
        ratio = training["samples_per_s"] / training["baseline_samples_per_s"]
        line = {"benchmark": "publish", "measurement": "training", **config, **training, "ratio": ratio}
        print(json.dumps(line))
        print(json.dumps({"benchmark": "publish", "measurement": "tracking", **config, **out["tracking"]}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
