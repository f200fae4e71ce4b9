"""What the training benchmarks share: the DLRM, its tables, sharding it, the baselines' inputs.

``sharded_training.py`` and ``pipeline.py`` train the same kind of model: a bottom MLP on the
dense features, one embedding table per sparse feature, a top MLP on both. This module builds it
once (``sequence.py`` trains a sequence model of its own and shares the rest):

- :class:`DLRM` and :func:`table_configs` / :func:`embedding_collection` (recsdk's
  ``HashEmbeddingBagCollection`` on raw ids, or TorchRec's ``EmbeddingBagCollection``);
- :func:`shard` (any model, ``sequence.py``'s too): Adagrad fused into the tables' backward,
  TorchRec's planner (or recsdk's ``HybridEmbeddingShardingPlanner``) over the world,
  ``DistributedModelParallel`` on the CPU or a GPU, dense Adagrad, both in one ``CombinedOptimizer``;
- :func:`parse_device_args`, :func:`launch` and :func:`device_of`: every training benchmark's
  ``--device cpu|cuda`` and ``--world-size`` (CPU: spawned ranks over gloo; CUDA: one rank in
  this process over nccl, the CPU tensors' collectives on a gloo group);
- :func:`random_batches` and :func:`remap_ids`: the synthetic batches of raw ids, and the same
  ids remapped offline to ``0..N-1`` per feature (or per table shared by several features),
  what TorchRec's baselines are fed.

Not a benchmark itself (``nox -s bench`` runs only the scripts not starting with ``_``).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ModuleSharder, ShardingEnv
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch, RandomRecDataset
from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingBagConfig
from recsdk.sharding import HybridEmbeddingShardingPlanner

__all__ = [
    "DLRM",
    "NUM_DENSE",
    "Pipelined",
    "device_of",
    "embedding_collection",
    "feature_names",
    "fill_hash_tables",
    "host_env",
    "launch",
    "parse_device_args",
    "random_batches",
    "remap_ids",
    "set_threads",
    "shard",
    "slowest_rank_seconds",
    "table_configs",
    "train_samples_per_s",
]

NUM_DENSE = 13  # dense features per sample, as Criteo
SPARSE_OPTIMIZER = {"lr": 0.05, "eps": 0.1}  # Adagrad fused into the tables' backward
DENSE_LR = 0.05  # Adagrad on the MLPs


class DLRM(nn.Module):
    """Bottom MLP on the dense features, pooled embeddings by feature name, top MLP.

    ``forward(batch)`` returns ``(loss, probabilities)``: binary cross-entropy on the logits and
    their sigmoid (detached), as the pipelines expect.

    Args:
        ebc (nn.Module): the embedding collection (any module returning a ``KeyedTensor``, or a
            tuple whose first item is one, as ``ManagedCollisionEmbeddingBagCollection`` does).
        features (list[str]): the sparse features, in the order the top MLP reads them.
        dim (int): the embedding dim of every table, and the bottom MLP's output width.
        hidden (int): the hidden width of both MLPs.
        num_dense (int): dense features per sample.

    Example::

        model = DLRM(embedding_collection(table_configs("hash", ["f0"], dim=16, rows=1000)), ["f0"], dim=16)
    """

    def __init__(self, ebc: nn.Module, features: list[str], dim: int, hidden: int = 64, num_dense: int = NUM_DENSE):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(num_dense, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.ReLU())
        self.ebc = ebc
        self.features = list(features)
        self.top = nn.Sequential(nn.Linear(dim * (len(features) + 1), hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse_features)
        if isinstance(pooled, tuple):  # ManagedCollisionEmbeddingBagCollection: (pooled, remapped ids)
            pooled = pooled[0]
        # By name: a sharded collection may order its outputs differently from the configs.
        # (No branch on the keys: TorchRec's pipeline traces this forward with torch.fx.)
        by_name = pooled.to_dict()
        x = torch.cat([self.bottom(batch.dense_features), *(by_name[f] for f in self.features)], dim=1)
        logits = self.top(x).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), torch.sigmoid(logits.detach())


def feature_names(n: int) -> list[str]:
    """``["f0", ..., f"f{n - 1}"]``: the sparse features, one table ``t<i>`` each."""
    return [f"f{i}" for i in range(n)]


def table_configs(
    kind: Literal["hash", "torchrec"],
    features: list[str],
    dim: int,
    rows: int,
    data_type: DataType = DataType.FP32,
) -> list[EmbeddingBagConfig]:
    """One table ``t<i>`` of ``rows`` rows and dim ``dim`` per feature.

    Args:
        kind (str): ``"hash"`` for ``HashEmbeddingBagConfig`` (raw ids), ``"torchrec"`` for
            TorchRec's ``EmbeddingBagConfig`` (row indices).
        features (list[str]): one table per feature, in this order.
        dim (int): embedding dim.
        rows (int): ``num_embeddings`` of every table.
        data_type (DataType): the rows' dtype in the fused kernel (``FP32`` or ``FP16``).

    Returns:
        list[EmbeddingBagConfig]: the configs.
    """
    if kind not in ("hash", "torchrec"):
        raise ValueError(f"table_configs: kind must be 'hash' or 'torchrec', got {kind!r}")
    config = HashEmbeddingBagConfig if kind == "hash" else EmbeddingBagConfig
    return [
        config(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f], data_type=data_type)
        for i, f in enumerate(features)
    ]


def embedding_collection(configs: list[EmbeddingBagConfig]) -> nn.Module:
    """The collection of ``configs`` on the meta device (DistributedModelParallel allocates the shards).

    ``HashEmbeddingBagCollection`` when the configs are ``HashEmbeddingBagConfig``, TorchRec's
    ``EmbeddingBagCollection`` otherwise.
    """
    meta = torch.device("meta")
    hashed = [c for c in configs if isinstance(c, HashEmbeddingBagConfig)]
    if len(hashed) == len(configs):
        return HashEmbeddingBagCollection(tables=hashed, device=meta)
    if hashed:
        raise ValueError("embedding_collection: mixes HashEmbeddingBagConfig and EmbeddingBagConfig tables")
    return EmbeddingBagCollection(tables=configs, device=meta)


def host_env() -> ShardingEnv:
    """A new gloo group over the whole world, for the hybrid sharders' host id work."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    return ShardingEnv(world_size=world_size, rank=rank, pg=dist.new_group(backend="gloo"))


def shard(
    model: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    constraints: dict[str, ParameterConstraints] | None,
    batch_size: int,
    *,
    embeddings: nn.Module | None = None,
    enumerator: Literal["torchrec", "hybrid"] = "torchrec",
    sparse_optimizer: type[torch.optim.Optimizer] = torch.optim.Adagrad,
    device: torch.device | None = None,
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """Shard ``model`` over the world on ``device`` (CPU by default) and build its optimizer.

    Adagrad (lr 0.05, eps 0.1; or ``sparse_optimizer``, e.g. TorchRec's ``RowWiseAdagrad``) is
    fused into the backward of the embedding tables; the planner
    makes one plan for all ranks under ``constraints``; the dense parameters get Adagrad (lr
    0.05); both optimizers are combined. ``dmp.plan`` is the plan it chose.

    Args:
        model (nn.Module): built on the meta device; its embedding tables are sharded.
        sharders (list[ModuleSharder]): e.g. ``get_default_hybrid_sharders(host_env())``.
        constraints (dict[str, ParameterConstraints] | None): table name -> the planner's
            constraints; ``None``: the planner's own choice.
        batch_size (int): samples per rank and step, for the planner's estimates.
        embeddings (nn.Module | None): the module holding the tables (its parameters get the
            fused Adagrad); ``None``: ``model.ebc``, as in :class:`DLRM`.
        enumerator (str): ``"torchrec"``: TorchRec's default ``EmbeddingShardingPlanner``;
            ``"hybrid"``: recsdk's ``HybridEmbeddingShardingPlanner`` (TorchRec's planner with
            recsdk's enumerator and perf model: the hybrid cost model, id table storage counted,
            constraints checked against the sharders).
        sparse_optimizer (type[torch.optim.Optimizer]): the optimizer fused into the tables'
            backward, with the same lr and eps.
        device (torch.device | None): where the tables and the dense part live (the world's
            default group runs that device's backend: nccl for CUDA); ``None``: the CPU.

    Returns:
        tuple[DistributedModelParallel, CombinedOptimizer]: the sharded model and its optimizer.
    """
    tables = model.ebc if embeddings is None else embeddings
    if not isinstance(tables, nn.Module):
        raise TypeError(f"shard: the embeddings must be a module, got {type(tables).__name__}")
    apply_optimizer_in_backward(sparse_optimizer, tables.parameters(), dict(SPARSE_OPTIMIZER))
    device = device or torch.device("cpu")
    topology = Topology(world_size=dist.get_world_size(), compute_device=device.type)
    planner: EmbeddingShardingPlanner
    if enumerator == "hybrid":
        planner = HybridEmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    elif enumerator == "torchrec":
        planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    else:
        raise ValueError(f"shard: enumerator must be 'torchrec' or 'hybrid', got {enumerator!r}")
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=DENSE_LR),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def random_batches(
    *,
    batch_size: int,
    num_batches: int,
    features: list[str],
    id_range: int,
    pooling: float,
    rank: int,
    world_size: int,
) -> list[Batch]:
    """Rank ``rank``'s share of the synthetic batches (seed 0): ``id_range`` raw ids per feature."""
    dataset = RandomRecDataset(
        batch_size=batch_size,
        num_batches=num_batches,
        feature_names=features,
        id_ranges=id_range,
        num_dense_features=NUM_DENSE,
        pooling_factors=pooling,
        seed=0,
        rank=rank,
        world_size=world_size,
    )
    return list(dataset)


def remap_ids(per_rank: list[list[Batch]], features: Sequence[str] | Mapping[str, Sequence[str]]) -> list[list[Batch]]:
    """Every rank's batches with each table's ids remapped offline to ``0..N-1``.

    The map of a table is over all ranks' batches (the sorted distinct ids of its features), as
    an offline remapping job would make it: TorchRec's ``EmbeddingBagCollection`` and
    ``EmbeddingCollection`` baselines train on these.

    Args:
        per_rank (list[list[Batch]]): rank -> its batches of raw ids.
        features (Sequence[str] | Mapping[str, Sequence[str]]): the sparse features to remap
            (all of the KJTs' keys), each with a map of its own; or table name -> its features,
            one map per table that all its features share (e.g. a history and a candidate
            feature over one item table: the same id gets the same row in both).

    Returns:
        list[list[Batch]]: the same batches, with the same dense features, lengths and labels.
    """
    groups = list(features.values()) if isinstance(features, Mapping) else [[f] for f in features]
    uniques: dict[str, torch.Tensor] = {}
    for group in groups:
        ids = [b.sparse_features[f].values() for batches in per_rank for b in batches for f in group]
        unique = torch.unique(torch.cat(ids))
        uniques.update(dict.fromkeys(group, unique))
    out = []
    for batches in per_rank:
        mapped = []
        for b in batches:
            kjt = b.sparse_features
            values = torch.cat([torch.searchsorted(uniques[f], kjt[f].values()) for f in kjt.keys()])
            remapped = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths(), stride=kjt.stride())
            mapped.append(Batch(b.dense_features, remapped, b.labels))
        out.append(mapped)
    return out


def fill_hash_tables(dmp: nn.Module, ids_per_table: int, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Store this rank's share of ``ids_per_table`` random raw ids in each hash table of a sharded
    model (``IdTableState.insert_at``), with random rows; returns this rank's ids per table."""
    from recsdk.sharding import owner, sharded_hash_modules

    (module,) = sharded_hash_modules(dmp).values()
    gen = torch.Generator().manual_seed(1234 + rank)
    views = module.table_views()
    stored = {}
    for name, table in module.id_tables.items():
        ids = torch.randint(-(2**62), 2**62, (3 * ids_per_table,), generator=gen).unique()
        ids = ids[owner(ids, world_size) == rank][: ids_per_table // world_size]
        table.state.insert_at(ids, torch.arange(ids.numel()))
        with torch.no_grad():
            views[name].weight[: ids.numel()].copy_(torch.rand(ids.numel(), views[name].weight.shape[1], generator=gen))
        stored[name] = ids
    return stored


def launch(fn: Any, world_size: int, device: str, *args: Any, timeout_s: float = 1200.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank and return each rank's result.

    ``device="cpu"``: ``world_size`` processes over gloo (``run_distributed``). ``"cuda"``: one
    rank, in this process, over nccl (one GPU; two ranks on one GPU fail in nccl), with the
    host groups the hybrid sharders need created by ``fn`` over gloo as on CPU.
    """
    if device == "cpu":
        from recsdk.data.testing import run_distributed

        return run_distributed(fn, world_size, *args, timeout_s=timeout_s)
    if device != "cuda" or world_size != 1:
        raise ValueError(f"launch: device must be 'cpu', or 'cuda' with world_size 1, got {device!r} x {world_size}")
    import os
    from datetime import timedelta

    from recsdk.data.testing import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))
    try:
        return [fn(0, 1, *args)]
    finally:
        dist.destroy_process_group()


def parse_device_args(
    parser: argparse.ArgumentParser, argv: list[str] | None = None, world_size: int = 2
) -> argparse.Namespace:
    """``parser``'s arguments plus ``--device {cpu,cuda}`` (default cpu) and ``--world-size``.

    ``--world-size`` defaults to ``world_size`` on CPU and to 1 on CUDA, the one value
    :func:`launch` takes there (one rank on one GPU); any other with ``--device cuda`` is refused
    by ``parser.error``, naming what runs instead.
    """
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cpu: ranks over gloo; cuda: one rank on one GPU"
    )
    parser.add_argument(
        "--world-size", type=int, default=None, help=f"ranks (default: {world_size} on cpu, 1 on cuda, its only value)"
    )
    args = parser.parse_args(argv)
    if args.world_size is None:
        args.world_size = 1 if args.device == "cuda" else world_size
    if args.device == "cuda" and args.world_size != 1:
        parser.error(
            f"--device cuda runs one rank on one GPU (nccl cannot run two ranks on one): use --world-size 1, "
            f"or --device cpu for {args.world_size} ranks over gloo"
        )
    return args


def device_of(name: str) -> torch.device:
    """The lookup device of a benchmark's ``--device``: ``cpu``, or the process's current GPU."""
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def slowest_rank_seconds(fn: Any, group: dist.ProcessGroup | None = None) -> float:
    """Seconds ``fn()`` takes on the slowest rank (collective: a barrier before, a max after).

    ``group``: where the max of the (CPU) times is taken; pass a gloo group (e.g. the host
    env's) when the default group is nccl (a CUDA run); ``None``: the default group.
    """
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def set_threads(threads: int) -> None:
    """``torch.set_num_threads(threads)`` in this benchmark's rank process; 0 keeps torch's default.

    The library never sets it (global state is the caller's); the benchmarks default to 1, as
    torchrun gives several ranks on one host.
    """
    if threads:
        torch.set_num_threads(threads)


class Pipelined:
    """A train pipeline and the endless iterator over one rank's batches it reads.

    A pipeline holds the batches it has read ahead between ``progress()`` calls, so its data
    must not end with a round (it would drain, and the next round start cold): the iterator
    cycles over ``batches``, and one round's ``progress()`` calls continue where the last ended.

    Args:
        pipeline (Any): recsdk's ``HybridTrainPipelineSparseDist`` or TorchRec's
            ``TrainPipelineSparseDist`` over the model.
        batches (list[Batch]): this rank's batches, cycled.
    """

    def __init__(self, pipeline: Any, batches: list[Batch]) -> None:
        self.pipeline = pipeline
        self.batches = itertools.cycle(batches)

    def step(self) -> None:
        """One training step: forward, backward and the optimizer step of the next batch."""
        self.pipeline.progress(self.batches)


def train_samples_per_s(
    model: nn.Module, optimizer: Any, batches: list[Batch], warmup: int, pipelined: Pipelined | None = None
) -> float:
    """Samples/s of all ranks together, training on ``batches`` after the first ``warmup``.

    Every rank calls it; barriers bound the timed region on all ranks alike.

    Args:
        model (nn.Module): the sharded model; its forward returns ``(loss, output)``.
        optimizer (Any): the model's optimizer.
        batches (list[Batch]): this rank's batches of one round, warm-up ones first.
        warmup (int): steps trained before the timed region.
        pipelined (Pipelined | None): ``None``: the plain loop ``model(batch)``, ``backward()``,
            ``step()``, ``zero_grad()`` over ``batches``; otherwise as many steps of this
            pipeline over ``model`` (it reads its own iterator of the same batches).
    """
    for i, batch in enumerate(batches):
        if i == warmup:
            dist.barrier()
            start = time.perf_counter()
        if pipelined is not None:
            pipelined.step()
            continue
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    elapsed = time.perf_counter() - start
    return (len(batches) - warmup) * batches[0].batch_size * dist.get_world_size() / elapsed
