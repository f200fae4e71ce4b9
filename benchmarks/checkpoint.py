"""Checkpoint throughput: ``save_checkpoint``/``load_checkpoint`` vs plain ``torch.save``/``torch.load``.

Two ranks on gloo (``--world-size``; ``--device cuda``: one rank on one GPU over nccl, the host
group on gloo) hold a model with hash tables sharded row-wise (fused Adagrad, so every row
also has optimizer state), their id tables filled to ``--fill`` of capacity. In the same run,
each round measures, slowest rank counted:

- ``save``: ``save_checkpoint`` (DCP, one file per rank, fsync, manifest, atomic rename) against
  every rank ``torch.save``-ing the same tensors (weights, optimizer state, id-table state
  dicts, dense state) to its own file, then ``fsync`` (``baseline``), and without the fsync
  (``baseline_nosync``);
- ``load``: ``load_checkpoint`` into the live model (same world size, ``verify=True``: every
  file's CRC-32 checked too) against ``torch.load`` of those files followed by
  putting everything back (copying weights, optimizer and dense state in,
  ``IdTable.load_state_dict``), i.e. the same restore done by hand (``baseline``), and against
  the bare ``torch.load`` (``baseline_read_only``); ``no_verify_*`` is ``verify=False`` and
  ``verify_cost`` the time verifying adds, as a fraction;
- ``checksum_seconds`` (on the save line): the part of a save spent computing the CRC-32 of
  the files (each rank its share), measured alone;
- ``load_reshard`` (one rank, after the two-rank runs): ``load_checkpoint`` of the two-rank
  checkpoint on one rank, rebuilding the tables by id, against the bare ``torch.load`` of
  both files (which reshards nothing). Only from two ranks or more: not on CUDA (one rank).

MB/s counts the bytes of the checkpointed tensors. One JSON line per measurement with the
ratio to the baseline (target >= 0.5); medians over ``--rounds``.

Then, checkpoints during training (``--train-steps`` steps through ``HybridTrainPipelineSparseDist``,
a checkpoint every ``--checkpoint-every`` steps, ``pipeline.drain()`` before each), the three
modes in a rotating order each round, slowest rank counted:

- ``train_with_checkpoints``: samples/s with no checkpoint (the baseline), with
  ``save_checkpoint`` (``sync``) and with ``AsyncCheckpointer`` (``async``, its last write
  waited for after the timed steps), and their ratios to the baseline;
  ``blocked_fraction``: the time an async save keeps the training thread (its snapshot, and
  waiting for the previous write) over the time of a synchronous save (target <= 0.25);
- ``resume``: seconds from the start of a resumed job's work (process and imports done) to the
  end of its first step: build, ``load_checkpoint``, the first ``progress``; against a fresh job
  (the same without the load). On CUDA the jobs run in this process one after another (``launch``
  runs the one rank here): the imports and the CUDA context are warm for every one.

    python benchmarks/checkpoint.py [--rows 262144] [--dim 64] [--tables 2] [--fill 0.8] [--rounds 3]
        [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import device_of, launch, parse_device_args, slowest_rank_seconds
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsdk.data import Batch, RandomRecDataset
from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingBagConfig
from recsdk.pipeline import HybridTrainPipelineSparseDist
from recsdk.sharding import (
    CHECKPOINT_MANIFEST,
    AsyncCheckpointer,
    ShardedHashEmbeddingBagCollection,
    get_default_hybrid_sharders,
    load_checkpoint,
    owner,
    save_checkpoint,
)
from recsdk.sharding.writing import files


class Model(nn.Module):
    def __init__(self, tables: int, rows: int, dim: int) -> None:
        super().__init__()
        self.dense = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256))
        self.ebc = HashEmbeddingBagCollection(
            tables=[
                HashEmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
                for i in range(tables)
            ],
            device=torch.device("meta"),
        )
        self.head = nn.Linear(256 + tables * dim, 1)
        self.features = [f"f{i}" for i in range(tables)]

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse_features).to_dict()
        x = torch.cat([self.dense(batch.dense_features), *(pooled[f] for f in self.features)], dim=1)
        logits = self.head(x).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def _build(
    args: argparse.Namespace, rows: int
) -> tuple[DistributedModelParallel, CombinedOptimizer, dist.ProcessGroup]:
    """The sharded model on ``--device``, its optimizer, and the host (gloo) group: the CPU
    tensors' collectives go there (the default group is nccl on CUDA)."""
    torch.manual_seed(0)
    model = Model(args.tables, rows, args.dim)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05})
    world_size = dist.get_world_size()
    host_pg = dist.new_group(backend="gloo")
    sharders = get_default_hybrid_sharders(host_env=ShardingEnv(world_size, dist.get_rank(), host_pg))
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["row_wise"]) for i in range(args.tables)}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=args.device), constraints=constraints
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    ddp_model = DistributedModelParallel(model, device=device_of(args.device), plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(ddp_model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05),
    )
    return ddp_model, CombinedOptimizer([ddp_model.fused_optimizer, dense]), host_pg


def _sebc(model: nn.Module) -> ShardedHashEmbeddingBagCollection:
    return next(m for m in model.modules() if isinstance(m, ShardedHashEmbeddingBagCollection))


def _fill(model: nn.Module, fill: float, rank: int, world_size: int) -> None:
    """Store ``fill * capacity`` ids this rank owns in each table; random optimizer state."""
    sebc = _sebc(model)
    gen = torch.Generator().manual_seed(1234 + rank)
    for name, table in sebc.id_tables.items():
        want = int(fill * table.capacity)
        ids = torch.randint(-(2**62), 2**62, (3 * want * world_size,), generator=gen)
        ids = ids[owner(ids, world_size) == rank].unique()[:want]
        table.state.insert_at(ids, torch.arange(ids.numel()))
        _, states = sebc.table_views()[name]
        for s in states:
            s.copy_(torch.rand(s.shape, generator=gen))


def _plain_state(model: nn.Module, optimizer: CombinedOptimizer) -> dict[str, Any]:
    """The same tensors the checkpoint holds, as one dict per rank for torch.save."""
    sebc = _sebc(model)
    views = sebc.table_views()
    out: dict[str, Any] = {}
    for name, table in sebc.id_tables.items():
        weight, states = views[name]
        out[f"{name}.weight"] = weight
        out[f"{name}.states"] = list(states)
        out[f"{name}.id_table"] = table.state_dict()
    out["dense"] = {k: v for k, v in model.state_dict().items() if not k.startswith("ebc.")}
    out["optim"] = {k: v for k, v in optimizer.state_dict()["state"].items() if not k.startswith("ebc.")}
    return out


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _torch_save(obj: Any, path: str, sync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def _restore(model: nn.Module, optimizer: CombinedOptimizer, path: str) -> None:
    """What a hand-written torch.save checkpoint does on load: torch.load, then put everything back."""
    plain = torch.load(path, weights_only=False)
    sebc = _sebc(model)
    views = sebc.table_views()
    with torch.no_grad():
        for name, table in sebc.id_tables.items():
            weight, states = views[name]
            weight.copy_(plain[f"{name}.weight"])
            for s, saved in zip(states, plain[f"{name}.states"], strict=True):
                s.copy_(saved)
            table.load_state_dict(plain[f"{name}.id_table"])
        dense = model.state_dict()
        for k, v in plain["dense"].items():
            dense[k].copy_(v)
        current = optimizer.state_dict()["state"]
        for k, v in plain["optim"].items():
            for sk, sv in v.items():
                if isinstance(sv, torch.Tensor):
                    current[k][sk].copy_(sv)


def _threads(args: argparse.Namespace) -> None:
    # One process per rank on a shared machine: a thread each unless told otherwise.
    torch.set_num_threads(args.threads)


def _two_ranks(rank: int, world_size: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    _threads(args)
    model, optimizer, host = _build(args, args.rows)
    _fill(model, args.fill, rank, world_size)
    plain = _plain_state(model, optimizer)
    local_bytes = torch.tensor([_nbytes(plain)], dtype=torch.int64)
    dist.all_reduce(local_bytes, group=host)
    _timed = partial(slowest_rank_seconds, group=host)  # CPU times: the max over the gloo group

    keys = (
        "save",
        "save_base",
        "save_base_nosync",
        "checksum",
        "load",
        "load_no_verify",
        "load_base",
        "load_base_read_only",
    )
    times: dict[str, list[float]] = {k: [] for k in keys}
    for i in range(args.rounds):
        ckpt = os.path.join(root, f"ckpt{i}")
        plain_file = os.path.join(root, f"plain{i}.rank{rank}.pt")
        times["save"].append(_timed(lambda ckpt=ckpt, i=i: save_checkpoint(model, optimizer, ckpt, extra={"round": i})))
        times["save_base"].append(_timed(lambda f=plain_file: _torch_save(plain, f, sync=True)))
        times["save_base_nosync"].append(_timed(lambda f=plain_file + ".nosync": _torch_save(plain, f, sync=False)))
        times["checksum"].append(_timed(lambda ckpt=ckpt: _checksum_share(ckpt, rank, world_size)))
        times["load"].append(_timed(lambda ckpt=ckpt: load_checkpoint(model, optimizer, ckpt, verify=True)))
        times["load_no_verify"].append(_timed(lambda ckpt=ckpt: load_checkpoint(model, optimizer, ckpt, verify=False)))
        times["load_base"].append(_timed(lambda f=plain_file: _restore(model, optimizer, f)))
        times["load_base_read_only"].append(_timed(lambda f=plain_file: torch.load(f, weights_only=False)))
        if i < args.rounds - 1 and rank == 0:
            shutil.rmtree(ckpt)
        dist.barrier()
    return {"times": times, "bytes": int(local_bytes), "last": os.path.join(root, f"ckpt{args.rounds - 1}")}


def _checksum_share(ckpt: str, rank: int, world_size: int) -> None:
    """What a save spends on checksums: this rank's share of the files (read back from the page cache)."""
    names = files.data_files(ckpt, CHECKPOINT_MANIFEST)
    files.describe(ckpt, files.my_share(names, rank, world_size))


def _one_rank(rank: int, world_size: int, args: argparse.Namespace, ckpt: str, plain_files: list[str]) -> dict:
    _threads(args)
    model, optimizer, host = _build(args, args.rows)  # one rank holds every table whole: room for all ids
    _timed = partial(slowest_rank_seconds, group=host)  # CPU times: the max over the gloo group

    times: dict[str, list[float]] = {"load_reshard": [], "load_reshard_base": []}
    for _ in range(args.rounds):
        times["load_reshard"].append(_timed(lambda: load_checkpoint(model, optimizer, ckpt)))
        times["load_reshard_base"].append(_timed(lambda: [torch.load(f, weights_only=False) for f in plain_files]))
    stored = sum(len(t) for t in _sebc(model).id_tables.values())
    return {"times": times, "stored": stored}


def _batches(args: argparse.Namespace, rank: int, world_size: int, seed: int) -> Any:
    data = RandomRecDataset(
        args.train_batch_size,
        1 << 30,
        [f"f{i}" for i in range(args.tables)],
        4 * args.rows,
        num_dense_features=16,
        seed=seed,
        rank=rank,
        world_size=world_size,
    )
    return iter(data)


def _train_modes(rank: int, world_size: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Per round, ``--train-steps`` steps with no checkpoint, synchronous ones and asynchronous ones."""
    _threads(args)
    model, optimizer, host = _build(args, args.rows)
    batches = _batches(args, rank, world_size, seed=5)
    _timed = partial(slowest_rank_seconds, group=host)  # CPU times: the max over the gloo group

    checkpointer = AsyncCheckpointer(model, optimizer)
    seconds: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    saves: dict[str, list[float]] = {"sync": [], "async": []}
    device = device_of(args.device)
    with HybridTrainPipelineSparseDist(model, optimizer, device, pipe_n_batch=2) as pipeline:
        for r in range(args.rounds):
            modes = ["none", "sync", "async"]
            for mode in modes[r % 3 :] + modes[: r % 3]:

                def run(mode: str = mode, r: int = r) -> None:
                    for step in range(1, args.train_steps + 1):
                        checkpointer.check()
                        pipeline.progress(batches)
                        if mode != "none" and step % args.checkpoint_every == 0:
                            pipeline.drain()  # counted as steps of the next ones: the same work
                            path = os.path.join(root, f"train_{mode}_{r}_{step}")
                            if mode == "sync":
                                saves["sync"].append(_timed(lambda p=path: save_checkpoint(model, optimizer, p)))
                            else:
                                saves["async"].append(_timed(lambda p=path: checkpointer.save(p)))
                    pipeline.drain()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # the last step's device work in the time

                seconds[mode].append(_timed(run))
                checkpointer.wait()  # the last write ends before the next mode's timing
                dist.barrier()
                if rank == 0:
                    for name in os.listdir(root):
                        if name.startswith("train_"):
                            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                dist.barrier()
        checkpointer.close()
        last = os.path.join(root, "resume_from")
        save_checkpoint(model, optimizer, last)
    return {"seconds": seconds, "saves": saves, "last": last}


def _first_step(rank: int, world_size: int, args: argparse.Namespace, ckpt: str | None) -> float:
    """Seconds from here (process started, imports done) to the end of the first step; resumed from ``ckpt``."""
    start = time.perf_counter()
    _threads(args)
    model, optimizer, host = _build(args, args.rows)
    if ckpt is not None:
        load_checkpoint(model, optimizer, ckpt)
    device = device_of(args.device)
    with HybridTrainPipelineSparseDist(model, optimizer, device, pipe_n_batch=2) as pipeline:
        pipeline.progress(_batches(args, rank, world_size, seed=9))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's end: its device work done
        elapsed = time.perf_counter() - start
    slowest = torch.tensor([elapsed])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=host)
    return float(slowest)


def _report_training(args: argparse.Namespace, root: str, setup: dict[str, Any]) -> None:
    trained = launch(_train_modes, args.world_size, args.device, args, root, timeout_s=1800)[0]
    samples = args.train_steps * args.train_batch_size * args.world_size
    none = statistics.median(trained["seconds"]["none"])
    line: dict[str, Any] = {
        "op": "train_with_checkpoints",
        "steps": args.train_steps,
        "checkpoint_every": args.checkpoint_every,
        "batch_size_per_rank": args.train_batch_size,
        "baseline": "no checkpoint",
        "baseline_samples_per_s": round(samples / none),
    }
    for mode in ("sync", "async"):
        t = statistics.median(trained["seconds"][mode])
        line[f"{mode}_samples_per_s"] = round(samples / t)
        line[f"{mode}_ratio"] = round(none / t, 3)
    sync_save = statistics.median(trained["saves"]["sync"])
    async_blocked = statistics.median(trained["saves"]["async"])
    line.update(
        sync_save_seconds=round(sync_save, 3),
        async_blocked_seconds=round(async_blocked, 3),
        blocked_fraction=round(async_blocked / sync_save, 3),
        target_blocked_fraction=0.25,
    )
    print(json.dumps({**line, **setup}), flush=True)
    fresh, resumed = [], []
    for _ in range(args.rounds):
        fresh.append(launch(_first_step, args.world_size, args.device, args, None, timeout_s=600)[0])
        resumed.append(launch(_first_step, args.world_size, args.device, args, trained["last"], timeout_s=600)[0])
    line = {
        "op": "resume",
        "first_step_seconds": round(statistics.median(resumed), 3),
        "baseline": "a fresh job's first step",
        "baseline_first_step_seconds": round(statistics.median(fresh), 3),
        "load_seconds": round(statistics.median(resumed) - statistics.median(fresh), 3),
    }
    print(json.dumps({**line, **setup}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=262144, help="capacity of each table (all ranks together)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tables", type=int, default=2)
    parser.add_argument("--fill", type=float, default=0.8, help="fraction of each table's rows holding an id")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--no-reshard", action="store_true", help="skip the one-rank load of the two-rank checkpoint")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--train-steps", type=int, default=60, help="steps per training mode (0: skip)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints in training")
    parser.add_argument("--train-batch-size", type=int, default=1024, help="samples per rank and step in training")
    args = parse_device_args(parser)
    root = tempfile.mkdtemp(prefix="recsdk-ckpt-bench-", dir=args.dir)
    try:
        results = launch(_two_ranks, args.world_size, args.device, args, root, timeout_s=600)
        total = results[0]["bytes"]
        mb = total / 1e6
        setup = {"world_size": args.world_size, "tables": args.tables, "rows": args.rows, "dim": args.dim}
        setup |= {"fill": args.fill, "device": args.device}
        times = results[0]["times"]
        for op, base in (("save", "save_base"), ("load", "load_base")):
            t, b = statistics.median(times[op]), statistics.median(times[base])
            line = {
                "op": op,
                "mb_per_s": round(mb / t, 1),
                "baseline": "torch.save+fsync" if op == "save" else "torch.load+restore",
                "baseline_mb_per_s": round(mb / b, 1),
                "ratio": round(b / t, 3),
            }
            if op == "save":
                nosync = statistics.median(times["save_base_nosync"])
                line["baseline_nosync_mb_per_s"] = round(mb / nosync, 1)
                line["ratio_nosync"] = round(nosync / t, 3)
                line["checksum_seconds"] = round(statistics.median(times["checksum"]), 3)
            else:
                read_only = statistics.median(times["load_base_read_only"])
                line["baseline_read_only_mb_per_s"] = round(mb / read_only, 1)
                line["ratio_read_only"] = round(read_only / t, 3)
                no_verify = statistics.median(times["load_no_verify"])
                line["no_verify_mb_per_s"] = round(mb / no_verify, 1)
                line["no_verify_seconds"] = round(no_verify, 3)
                line["verify_cost"] = round(t / no_verify - 1, 3)
            print(json.dumps({**line, "mb": round(mb, 1), "seconds": round(t, 3), **setup}), flush=True)
        if not args.no_reshard and args.world_size > 1:  # one rank to one: nothing to reshard
            plain_files = [os.path.join(root, f"plain{args.rounds - 1}.rank{r}.pt") for r in range(args.world_size)]
            one = launch(_one_rank, 1, args.device, args, results[0]["last"], plain_files, timeout_s=600)[0]
            t = statistics.median(one["times"]["load_reshard"])
            b = statistics.median(one["times"]["load_reshard_base"])
            line = {
                "op": "load_reshard",
                "mb_per_s": round(mb / t, 1),
                "baseline": "torch.load (read only: no resharding)",
                "baseline_mb_per_s": round(mb / b, 1),
                "ratio": round(b / t, 3),
                "from_world_size": args.world_size,
                "ids_loaded": one["stored"],
            }
            print(json.dumps({**line, "mb": round(mb, 1), "seconds": round(t, 3), **{**setup, "world_size": 1}}))
        if args.train_steps:
            _report_training(args, root, setup)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
