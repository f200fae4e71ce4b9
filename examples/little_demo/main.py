"""The little demo: train a small DLRM on raw int64 ids with recsdk, on N ranks.

It follows the nine steps of the flow, in order, each marked ``# <n>.`` below (steps 1 and 2
live in ``dataset.py``, the model of step 4 in ``model.py``)::

    python examples/little_demo/main.py --world-size 2               # spawns 2 local ranks
    torchrun --nproc_per_node=2 examples/little_demo/main.py         # the same under torchrun
    python examples/little_demo/main.py --world-size 2 --data criteo --data-path day_0.tsv.gz
    python -m recsdk.data.convert criteo day_0.tsv.gz day_0_columnar    # once; then:
    python examples/little_demo/main.py --world-size 2 --data columnar --data-path day_0_columnar
    python examples/little_demo/main.py --world-size 2 --no-history  # the same model without the history
    torchrun --nproc_per_node=2 --max-restarts=3 examples/little_demo/main.py \
        --checkpoint-dir ckpt --checkpoint-every 100               # a killed rank: the group resumes

Rank 0 shows a progress bar, evaluates the AUC on held-out batches every ``--eval-every``
steps, and at the end prints a summary and writes ``summary.json`` and ``training.png`` into
``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dataset import DATA_KINDS, DemoData, data_files, make_data, parquet_features
from model import DLRM, ID_POLICIES, file_tables, needs_clicks, random_sequence_tables, random_tables
from report import print_header, report
from resume import TrainingState, flag_differences, resume, save
from safetensors.torch import save_file
from torchmetrics.classification import BinaryAUROC
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.types import CacheAlgorithm, CacheParams, ShardingEnv
from tqdm import tqdm

from recsdk.data import DEVICE_TYPES, Batch, backend_for, get_device
from recsdk.data.testing import free_port
from recsdk.pipeline import (
    MAX_PIPE_N_BATCH,
    CombinedOptimizer,
    HybridTrainPipelineSparseDist,
    KeyedOptimizerWrapper,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)
from recsdk.sharding import (
    AsyncCheckpointer,
    HostShardedModule,
    HybridEmbeddingShardingPlanner,
    Publisher,
    get_default_hybrid_sharders,
)

EMBEDDING_OPTIMIZER = {"lr": 0.05, "eps": 0.1}  # fused Adagrad of the sparse tables (step 5)
DENSE_LR = 0.05  # Adagrad of the dense layers (step 7)
ROW_WISE_FROM = 4_096  # tables of this many rows or more are split over the ranks, smaller ones kept whole (step 6)
STAT_KEYS = ("size", "capacity", "inserts", "evictions", "admission_rejects", "lookups", "hits")
CACHE_STAT_KEYS = ("cache_slots", "cache_lookups", "cache_hits", "swap_ins", "swap_outs", "store_rows_used")


# ---- the command line -----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """One line on stderr, exit status 2 (argparse's usual status, without the usage block)."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(minimum: int, maximum: int | None = None) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < 1:  # TorchRec's planner takes a cache load factor strictly between 0 and 1
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; any problem exits with one line before a process starts: the
    output folders (created; each must be a writable folder), and, for a checkpoint directory
    to resume from, that the flags are the ones its checkpoints were made with."""
    parser = _Parser(prog="little_demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=_int_at_least(1), default=None, help="ranks to spawn (default 1)")
    parser.add_argument("--device", choices=DEVICE_TYPES, default="auto", help="auto: npu, then cuda, then cpu")
    parser.add_argument("--steps", type=_int_at_least(1), default=600, help="training steps")
    parser.add_argument("--batch-size", type=_int_at_least(1), default=256, help="samples per rank and step")
    parser.add_argument(
        "--pipe-n-batch", type=_int_at_least(1, MAX_PIPE_N_BATCH), default=2, help="batches prepared ahead"
    )
    parser.add_argument("--eval-every", type=_int_at_least(0), default=100, help="steps between evals (0: at the end)")
    parser.add_argument("--eval-batches", type=_int_at_least(1), default=8, help="held-out batches per rank")
    parser.add_argument("--data", choices=DATA_KINDS, default="random", help="the dataset")
    parser.add_argument("--data-path", default=None, help="a file or folder; columnar: the converted folder")
    parser.add_argument(
        "--no-history", action="store_true", help="random data: leave out the history feature and its attention"
    )
    parser.add_argument(
        "--cache-load-factor",
        type=_fraction,
        default=None,
        help="keep the row-wise tables' rows in host memory, this share of them in the device cache (0 < F < 1)",
    )
    parser.add_argument(
        "--id-policy",
        choices=sorted(ID_POLICIES),
        default="countmin_lru",
        help="admission and eviction of the tables with more ids than rows (user; every file feature)",
    )
    parser.add_argument("--num-workers", type=_int_at_least(0), default=0, help="DataLoader workers per rank")
    parser.add_argument("--seed", type=_int_at_least(0), default=0, help="seed of the data and the model")
    parser.add_argument("--timeout-s", type=_int_at_least(10), default=120, help="process group timeout")
    parser.add_argument("--out", default="out/little_demo", help="folder for summary.json and training.png")
    parser.add_argument("--publish-dir", default=None, help="publish versions for serving into this folder")
    parser.add_argument(
        "--publish-every", type=_int_at_least(1), default=None, help="steps between published versions (default 100)"
    )
    parser.add_argument(
        "--checkpoint-dir", default=None, help="save checkpoints here, and resume from the latest one it holds"
    )
    parser.add_argument(
        "--checkpoint-every", type=_int_at_least(1), default=None, help="steps between checkpoints (default 100)"
    )
    args = parser.parse_args(argv)
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        parser.error("--checkpoint-every needs --checkpoint-dir (the folder the checkpoints go to)")
    args.checkpoint_every = args.checkpoint_every or 100
    if args.publish_every is not None and args.publish_dir is None:
        parser.error("--publish-every needs --publish-dir (the folder the versions go to)")
    args.publish_every = args.publish_every or 100

    torchrun_world = os.environ.get("WORLD_SIZE") if "RANK" in os.environ else None
    if torchrun_world is not None and args.world_size not in (None, int(torchrun_world)):
        parser.error(f"--world-size {args.world_size} differs from torchrun's WORLD_SIZE {torchrun_world}")
    args.world_size = int(torchrun_world) if torchrun_world is not None else (args.world_size or 1)
    if args.no_history and args.data != "random":
        parser.error(f"--no-history is only for --data random (the {args.data} data has no history feature)")
    try:
        args.files = data_files(args.data, args.data_path)
        if args.data == "parquet":
            parquet_features(args.files)
        try:
            device = get_device(args.device)
        except ValueError as e:
            raise ValueError(f"--device {args.device}: {e}") from None
        if device.type != "cpu" and torchrun_world is None:
            available = torch.get_device_module(device.type).device_count()
            if args.world_size > available:
                raise ValueError(f"--world-size {args.world_size} needs {args.world_size} {device.type} devices")
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    for flag in ("--out", "--checkpoint-dir", "--publish-dir"):
        problem = _output_folder_problem(getattr(args, flag[2:].replace("-", "_")))
        if problem:
            parser.error(f"{flag} {problem}")
    if args.publish_dir is not None and args.checkpoint_dir is not None:
        if Path(args.publish_dir).resolve() == Path(args.checkpoint_dir).resolve():
            parser.error(f"--publish-dir and --checkpoint-dir are the same folder {args.publish_dir}; give two")
    if args.checkpoint_dir is not None:
        try:
            differences = flag_differences(args)
        except (OSError, ValueError) as e:
            parser.error(f"--checkpoint-dir {args.checkpoint_dir}: {e}")
        if differences:
            parser.error(
                f"--checkpoint-dir {args.checkpoint_dir} holds checkpoints of a run with other flags: "
                f"{', '.join(differences)}; resume with its flags, or give another --checkpoint-dir"
            )
    if importlib.util.find_spec("matplotlib") is None:  # the plot comes after training: ask first
        parser.error("matplotlib is needed for training.png: pip install matplotlib (or run `nox -s demo`)")
    return args


def quiet_library_warnings() -> None:
    """Silence warnings that TorchRec 1.8 and torch give about their own internals.

    Deprecations inside TorchRec's collectives and DDP wrapper, and planner hints. (TorchRec's
    first-batch range check on raw ids is already filtered by recsdk-sharding.)
    """
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("torch.fx._symbolic_trace", "torchrec.distributed.planner"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ---- one rank ---------------------------------------------------------------------------------


def run_rank(rank: int, world_size: int, args: argparse.Namespace, init_method: str) -> None:
    """Everything one rank does: the nine steps, the evals and the report."""
    quiet_library_warnings()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    torch.manual_seed(args.seed)

    # 1. The Batch: recsdk.data.Batch (dense features, a KJT of raw int64 ids, labels).
    # 2. The datasets: this rank's training batches and held-out batches (dataset.py).
    data = make_data(
        args.data,
        args.files,
        batch_size=args.batch_size,
        steps=args.steps,
        eval_batches=args.eval_batches,
        rank=rank,
        world_size=world_size,
        num_workers=args.num_workers,
        seed=args.seed,
        history=not args.no_history,
    )

    # 3. Process groups: the device group (gloo / nccl / hccl) and the host group for the id work (gloo).
    device = get_device(args.device, local_rank)
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    store = restart_store(rank, world_size, timeout) if init_method == "env://" else None
    dist.init_process_group(
        backend=backend_for(device),
        init_method=None if store is not None else init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    try:
        host_gp = dist.new_group(backend="gloo", timeout=timeout)
        host_env = ShardingEnv(world_size=world_size, rank=rank, pg=host_gp)

        # 4. The model: a HashEmbeddingBagCollection for the ids, on random data also a
        #    HashEmbeddingCollection for the candidate and history items, MLPs and a target
        #    attention for the rest (model.py). On "meta", DistributedModelParallel allocates
        #    only this rank's shards of the tables.
        if args.data == "random":
            tables = random_tables(args.id_policy)
            sequence_tables = random_sequence_tables(history=not args.no_history)
        else:
            tables, sequence_tables = file_tables(data.features, args.id_policy), []
        model = DLRM(tables, data.num_dense, torch.device("meta"), sequence_tables=sequence_tables)

        # 5. The sparse optimizer: fused into the backward pass of the embedding tables.
        sparse_modules = [m for m in (model.ebc, model.ec) if m is not None]
        for module in sparse_modules:
            apply_optimizer_in_backward(torch.optim.Adagrad, module.parameters(), optimizer_kwargs=EMBEDDING_OPTIMIZER)

        # 6. Sharding: hybrid sharders, a plan from TorchRec's planner (with recsdk's enumerator and
        # cost model), DistributedModelParallel.
        sharders = get_default_hybrid_sharders(host_env=host_env)
        constraints = {
            t.name: table_constraints(t.num_embeddings, args.cache_load_factor) for t in [*tables, *sequence_tables]
        }
        topology = Topology(world_size=world_size, compute_device="cpu" if device.type == "cpu" else "cuda")
        planner = HybridEmbeddingShardingPlanner(topology, batch_size=args.batch_size, constraints=constraints)
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
        ddp_model = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)

        # 7. The optimizer: the fused sparse one and Adagrad for the dense parameters, combined.
        dense_optimizer = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(ddp_model.named_parameters())),
            lambda params: torch.optim.Adagrad(params, lr=DENSE_LR),
        )
        optimizer = CombinedOptimizer([ddp_model.fused_optimizer, dense_optimizer])

        # Resuming: the latest checkpoint of --checkpoint-dir, if it holds one (resume.py).
        state, rng = resume(ddp_model, optimizer, data.train, args.checkpoint_dir)
        checkpointer = AsyncCheckpointer(ddp_model, optimizer) if args.checkpoint_dir else None
        if rank == 0 and state.resumed_from is not None:
            print(f"resumed from {state.resumed_from} (step {state.step})", flush=True)

        # Publishing for serving (optional): numbered versions, full or deltas, between steps.
        publisher = Publisher(ddp_model, args.publish_dir) if args.publish_dir else None

        # 8. The pipeline: host id work for the next batches overlaps this batch's compute.
        pipeline = HybridTrainPipelineSparseDist(
            ddp_model, optimizer, device, execute_all_batches=True, pipe_n_batch=args.pipe_n_batch
        )
        try:
            if rank == 0:
                print_header(args, world_size, device, ddp_model)
            # 9. Training with the pipeline (and evaluating with it, in eval mode).
            history = train(
                pipeline, ddp_model, data, args, rank, world_size, host_gp, state, rng, publisher, checkpointer
            )
            history["host_staged"], history["inline"] = pipeline.host_staged_modules, pipeline.inline_modules
            history["host_thread"] = pipeline.host_thread
        finally:
            pipeline.close()
        # ddp_model.module is our DLRM: its ebc is now a ShardedHashEmbeddingBagCollection, its ec
        # (random data) a ShardedHashEmbeddingCollection.
        sharded = {name: getattr(ddp_model.module, name) for name in ("ebc", "ec") if getattr(model, name) is not None}
        stats = gather_table_stats(sharded, host_gp)
        losses = gather_losses(history["losses"], host_gp)
        if rank == 0:
            report(args, world_size, device, history, losses, stats, time.time() - args.started)
        if "GROUP_RANK" in os.environ:  # under torchrun: one line per rank, in the log of its node
            where = f"node {os.environ['GROUP_RANK']}, local rank {local_rank}"
            print(f"rank {rank} of {world_size}: {where}, trained {len(history['losses'])} steps", flush=True)
        dist.barrier(group=host_gp)  # finish together: no rank tears down while another still runs
    finally:
        dist.destroy_process_group()


def train(
    pipeline: HybridTrainPipelineSparseDist,
    ddp_model: torch.nn.Module,
    data: DemoData,
    args: argparse.Namespace,
    rank: int,
    world_size: int,
    host_gp: dist.ProcessGroup,
    state: TrainingState,
    rng: torch.Tensor | None,
    publisher: Publisher | None = None,
    checkpointer: AsyncCheckpointer | None = None,
) -> dict[str, Any]:
    """Step 9: ``pipeline.progress`` until ``args.steps`` steps are done (from ``state.step`` on),
    with an eval every ``args.eval_every`` steps and, with a ``publisher``, a version every
    ``args.publish_every`` steps and at the end; with a checkpoint directory, a checkpoint every
    ``args.checkpoint_every`` steps (the pipeline drained first: its steps count)."""
    batches: Iterator[Any] = iter(data.train)
    if rng is not None:  # after the iterator: creating it draws from torch's RNG
        torch.set_rng_state(rng)
    if needs_clicks(args.id_policy):  # the tables score clicks: each id carries its sample's label
        batches = map(Batch.with_clicks, batches)
    auroc = BinaryAUROC(process_group=host_gp)  # compute() gathers the predictions of every rank
    best_auc = best_possible_auc(data, auroc)
    if best_auc is not None and rank == 0:
        print(f"held-out AUC of the true click probabilities (the best possible): {best_auc:.4f}", flush=True)
    samples_per_step = args.batch_size * world_size
    started_at = state.step

    def after_step(loss: torch.Tensor, seconds: float) -> None:
        state.step += 1
        state.losses.append(float(loss))
        state.train_s += seconds
        step = state.step
        bar.update()
        if step % 10 == 0 or step == args.steps:
            rate = (step - started_at) * samples_per_step / max(state.train_s - train_s_before, 1e-9)
            bar.set_postfix_str(f"loss={float(loss):.4f} samples/s={rate:,.0f}")
        if publisher is not None and (step % args.publish_every == 0 or step == args.steps):
            publisher.publish(step=step)  # between steps: batches mapped ahead are left out until they compute
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            scores: list[torch.Tensor] = []
            state.evals.append((step, evaluate(pipeline, ddp_model, data.held_out, auroc, scores)))
            if rank == 0:
                bar.write(f"step {step:>5}: eval AUC {state.evals[-1][1]:.4f}")
            if publisher is not None and step == args.steps:
                _save_eval_scores(scores, Path(args.out), host_gp, rank)

    train_s_before = state.train_s
    with tqdm(total=args.steps, initial=state.step, desc="train", disable=rank != 0, dynamic_ncols=True) as bar:
        while state.step < args.steps:
            start = time.perf_counter()
            if checkpointer is not None:
                checkpointer.check()  # a failed background write raises here, on every rank
            loss, _, _ = pipeline.progress(batches)
            after_step(loss, time.perf_counter() - start)
            due = checkpointer is not None and state.step % args.checkpoint_every == 0
            if due and state.step + pipeline.batches_read_ahead <= args.steps:
                start = time.perf_counter()
                for loss, _, _ in pipeline.drain():  # train what was read ahead: nothing in flight
                    after_step(loss, time.perf_counter() - start)
                    start = time.perf_counter()
                assert checkpointer is not None
                save(checkpointer, pipeline, data.train, args.checkpoint_dir, state)
        if checkpointer is not None:
            checkpointer.close()  # the last write finishes before the run ends
    return {
        "losses": state.losses,
        "evals": state.evals,
        "best_auc": best_auc,
        "train_s": state.train_s,
        "samples_per_s": (args.steps - started_at) * samples_per_step / max(state.train_s - train_s_before, 1e-9),
        "published": [dataclasses.asdict(r) for r in publisher.records] if publisher is not None else [],
        "resumed_from": state.resumed_from,
    }


def evaluate(
    pipeline: HybridTrainPipelineSparseDist,
    ddp_model: torch.nn.Module,
    held_out: list[Any],
    auroc: BinaryAUROC,
    scores: list[torch.Tensor] | None = None,
) -> float:
    """AUC over every rank's held-out batches, through the same pipeline in eval mode (this
    rank's scores appended to ``scores``, batch by batch)."""
    ddp_model.eval()  # forward only; the id tables are only read
    batches: Iterator[Any] = iter(held_out)
    while True:
        try:
            _, probs, labels = pipeline.progress(batches)
        except StopIteration:
            break
        auroc.update(probs.cpu(), labels.cpu().long())
        if scores is not None:
            scores.append(probs.detach().cpu())
    ddp_model.train()
    value = float(auroc.compute())
    auroc.reset()
    return value


def _save_eval_scores(scores: list[torch.Tensor], out: Path, host_gp: dist.ProcessGroup, rank: int) -> None:
    """The final eval's scores of every rank's held-out batches, in rank order, into
    ``out/eval_scores.safetensors`` (what serve.py compares its served scores with)."""
    everyone: list[Any] = [None] * dist.get_world_size(host_gp)
    dist.all_gather_object(everyone, torch.cat(scores), group=host_gp)
    if rank == 0:
        save_file({"scores": torch.cat(everyone).contiguous()}, str(out / "eval_scores.safetensors"))


def best_possible_auc(data: DemoData, auroc: BinaryAUROC) -> float | None:
    """The held-out AUC of the true click probabilities, where the data knows them (synthetic data)."""
    if data.held_out_probabilities is None:
        return None
    for batch, probabilities in zip(data.held_out, data.held_out_probabilities, strict=True):
        auroc.update(probabilities.float(), batch.labels.long())
    value = float(auroc.compute())
    auroc.reset()
    return value


def table_constraints(num_embeddings: int, cache_load_factor: float | None) -> ParameterConstraints:
    """Large tables row-wise (with ``cache_load_factor``: every row in host memory, that share of
    them in the device cache), small ones table-wise."""
    if num_embeddings < ROW_WISE_FROM:
        return ParameterConstraints(sharding_types=["table_wise"])
    if cache_load_factor is None:
        return ParameterConstraints(sharding_types=["row_wise"])
    return ParameterConstraints(
        sharding_types=["row_wise"],
        compute_kernels=["fused_uvm_caching"],
        cache_params=CacheParams(load_factor=cache_load_factor, algorithm=CacheAlgorithm.LRU),
    )


def gather_table_stats(modules: dict[str, HostShardedModule], group: dist.ProcessGroup) -> dict[str, dict[str, Any]]:
    """Each table's id-table statistics, summed over the ranks' shards, with its module's name.

    ``modules``: the sharded collections by name (table names are distinct over all of them).
    """
    per_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, {name: m.stats() for name, m in modules.items()}, group=group)
    totals: dict[str, dict[str, Any]] = {}
    for name, module in modules.items():
        for table in module.module_sharding_plan:
            totals[table] = {"module": name, **dict.fromkeys(STAT_KEYS, 0)}
    for stats in per_rank:
        for module_stats in stats.values():
            for table, s in module_stats.items():
                for key in STAT_KEYS:
                    totals[table][key] += int(s[key])
                for key in CACHE_STAT_KEYS:  # a cached table's device cache
                    if key in s:
                        totals[table][key] = totals[table].get(key, 0) + int(s[key])
    for total in totals.values():
        total["hit_rate"] = total["hits"] / total["lookups"] if total["lookups"] else 0.0
        if "cache_lookups" in total:
            lookups = total["cache_lookups"]
            total["cache_hit_rate"] = total["cache_hits"] / lookups if lookups else 0.0
    return totals


def gather_losses(losses: list[float], group: dist.ProcessGroup) -> list[float]:
    """Each step's training loss, averaged over the ranks."""
    per_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, losses, group=group)
    return [sum(values) / len(values) for values in zip(*per_rank, strict=True)]


# ---- entry point --------------------------------------------------------------------------------


def restart_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun after a restart (``--max-restarts``): the rendezvous store's keys of this
    attempt only.

    TorchElastic restarts the workers against the same store, where the gloo groups of the
    attempt before left their peers' addresses: a restarted group would connect to those
    (dead) addresses. A prefix per attempt keeps the attempts apart. None: not a restart.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        return None
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_hosts and rank == 0,
        timeout=timeout,
    )
    return dist.PrefixStore(f"little_demo/attempt_{attempt}", store)


def _output_folder_problem(folder: str | None) -> str | None:
    """What stops the demo writing into ``folder`` (created if missing), or None."""
    if folder is None:
        return None
    path = Path(folder)
    if path.exists() and not path.is_dir():
        return f"{folder}: exists and is not a folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{folder}: cannot be created ({e.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{folder}: is not writable by this user"
    return None


def _spawned_rank(rank: int, world_size: int, args: argparse.Namespace, init_method: str) -> None:
    # A spawned process would also spawn its DataLoader workers; use the platform's default
    # start method, as a rank started by torchrun does.
    mp.set_start_method(None, force=True)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    run_rank(rank, world_size, args, init_method)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.time()
    args = parse_args(argv)
    args.started = started  # for the wall time in the summary
    if "RANK" in os.environ:  # under torchrun: one rank per process, rendezvous from the environment
        run_rank(int(os.environ["RANK"]), args.world_size, args, "env://")
        return 0
    init_method = f"tcp://127.0.0.1:{free_port()}"
    if args.world_size == 1:
        run_rank(0, 1, args, init_method)
        return 0
    try:
        mp.start_processes(
            _spawned_rank, args=(args.world_size, args, init_method), nprocs=args.world_size, start_method="spawn"
        )
    except mp.ProcessRaisedException as e:
        print(f"little_demo: a rank failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"little_demo: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
