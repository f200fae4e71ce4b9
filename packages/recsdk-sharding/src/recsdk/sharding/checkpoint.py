"""Checkpoints of hybrid-sharded models: atomic, collective, and loadable on another world size.

A checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP): one data file per
rank, DCP's ``.metadata``, and ``recsdk_checkpoint.json``, the manifest, written last. It holds

* per :class:`~recsdk.sharding.ShardedHashEmbeddingBagCollection` table shard (keys
  ``hash/<module>/<table>/<rank>/...``): the fused kernel's weight rows and optimizer state rows,
  and the shard's whole :class:`~recsdk.embedding.IdTable` state: ids and their rows, per-id
  eviction metadata (``last_step``, ``freq``), the free-row stack, admission counters, step
  clock and statistics, plus the shard's fused optimizer counters that are not per row (an Adam
  step count). Together these give every stored id its embedding, optimizer state and
  metadata, so a table can be rebuilt **by id** on any world size;
* the rest of the model's ``state_dict()`` (``model/<key>``: dense parameters and buffers,
  TorchRec-sharded tensors of other modules, which DCP reshards itself);
* the optimizer's state for everything but the hash tables (``optim/...``) and the
  hyperparameters of every parameter group (learning rates set by a scheduler included);
* each rank's ``extra`` object (``extra/<rank>``).

Saving writes into ``.<name>.partial-<token>`` beside ``path``; once every rank has finished,
rank 0 writes the manifest and publishes the directory with one ``rename``. A save killed on the
way leaves the ``.partial-`` directory without a manifest: :func:`load_checkpoint` refuses it
with an error saying so, and :func:`latest_checkpoint` skips it.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, OptimizerWrapper

from recsdk.embedding import HashEmbeddingBagCollection
from recsdk.sharding.owner import owner
from recsdk.sharding.sharded_hash_embedding_bag import ShardedHashEmbeddingBagCollection, sharded_hash_modules

__all__ = ["CHECKPOINT_MANIFEST", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_MANIFEST = "recsdk_checkpoint.json"
"""File name of the manifest; a checkpoint directory is complete exactly when it holds this file."""

_FORMAT = "recsdk.sharding.checkpoint"
_VERSION = 1
_PARTIAL = ".partial-"
_INT32_MAX = 2**31 - 1
_TABLE_KEYS = ("ids", "rows", "last_step", "freq", "free_rows", "retired_rows", "reassigned_rows", "step", "stats")


# ---------------------------------------------------------------------------------------------
# process group helpers


class _Comm:
    """Collectives over one group, or their single-process equivalents when dist is not initialised."""

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pg = pg
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if self.distributed and pg is not None and dist.get_world_size(pg) != self.world:
            raise ValueError(
                f"the host process group has {dist.get_world_size(pg)} ranks, the default group {self.world}; "
                "checkpoints need a host group over every rank"
            )

    def gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank failed: the failing rank re-raises its own error."""
        messages = self.gather(None if error is None else str(error))
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if failed:
            raise RuntimeError("; ".join(f"rank {r}: {m}" for r, m in failed))

    def agree_on_problems(self, problems: list[str], headline: str) -> None:
        """Raise the same ValueError on every rank listing every rank's problems."""
        everyone = self.gather(problems)
        merged: list[str] = []
        for rank_problems in everyone:
            for p in rank_problems:
                if p not in merged:
                    merged.append(p)
        if merged:
            raise ValueError(headline + "\n" + "\n".join(f"  - {p}" for p in merged))


# ---------------------------------------------------------------------------------------------
# model inspection


def _root(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedModelParallel) else model


def _hash_modules(model: nn.Module) -> dict[str, ShardedHashEmbeddingBagCollection]:
    """Sharded HashEBCs by FQN (as in ``model.state_dict()`` keys); rejects unsharded HashEBCs."""
    for fqn, module in _root(model).named_modules():
        if isinstance(module, HashEmbeddingBagCollection) and not isinstance(module, ShardedHashEmbeddingBagCollection):
            raise TypeError(
                f"module {fqn or '<root>'!r} is an unsharded HashEmbeddingBagCollection: checkpoints cover hash "
                "tables sharded by DistributedModelParallel with recsdk's sharders "
                "(get_default_hybrid_sharders); shard the model first"
            )
    return sharded_hash_modules(model)


def _host_group(modules: Mapping[str, ShardedHashEmbeddingBagCollection]) -> dist.ProcessGroup | None:
    for module in modules.values():
        return module._host_pg
    return None


def _weight_key(fqn: str, table: str) -> str:
    return f"{fqn}.embedding_bags.{table}.weight" if fqn else f"embedding_bags.{table}.weight"


def _hash_prefix(fqn: str, table: str, rank: int) -> str:
    return f"hash/{fqn}/{table}/{rank}/"


@dataclass
class _Layout:
    """How one table is split: ``shards`` is ``[(rank, row_offset, rows)]`` sorted by rank."""

    sharding_type: str
    num_embeddings: int
    embedding_dim: int
    shards: list[tuple[int, int, int]]

    def rows_on(self, rank: int) -> int:
        return sum(rows for r, _, rows in self.shards if r == rank)


def _layouts(module: ShardedHashEmbeddingBagCollection) -> dict[str, _Layout]:
    out = {}
    for name, ps in module.module_sharding_plan.items():
        cfg = module._table_name_to_config[name]
        spec = ps.sharding_spec
        shards = sorted(
            (int(s.placement.rank()), int(s.shard_offsets[0]), int(s.shard_sizes[0]))
            for s in spec.shards  # type: ignore[union-attr]
        )
        out[name] = _Layout(str(ps.sharding_type), int(cfg.num_embeddings), int(cfg.embedding_dim), shards)
    return out


def _admission_counters(module: ShardedHashEmbeddingBagCollection, table: str) -> int:
    cfg = module._hash_configs.get(table)
    admission = cfg.admission if cfg is not None else None
    if admission is None or admission.threshold <= 1:
        return 0
    return (admission.counter_slots // admission.num_hashes) * admission.num_hashes


def _fused_counters(module: ShardedHashEmbeddingBagCollection) -> dict[str, dict[str, torch.Tensor]]:
    """Per local table, fused optimizer state that is not per row (e.g. an Adam step count).

    Per-row state (ShardedTensors, and tensors with one entry per local row) is saved with the
    table's rows; what remains are small counters, saved per shard.
    """
    optimizer = module.fused_optimizer
    state = optimizer.state
    slices = module._table_slices()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in module.id_tables:
        param = optimizer.params.get(f"embedding_bags.{name}.weight")
        rows = slices[name][0].shape[0]
        found = {}
        for skey, value in (state.get(param, {}) if param is not None else {}).items():
            if isinstance(value, ShardedTensor) or not isinstance(value, torch.Tensor):
                continue
            if value.dim() >= 1 and value.shape[0] == rows:
                continue
            found[skey] = value
        out[name] = found
    return out


# ---------------------------------------------------------------------------------------------
# optimizer inspection


def _check_optimizer(optimizer: Any) -> None:
    if optimizer is not None and not isinstance(optimizer, KeyedOptimizer):
        raise TypeError(
            "optimizer must be a torchrec KeyedOptimizer (e.g. CombinedOptimizer([model.fused_optimizer, "
            f"KeyedOptimizerWrapper(...)])) or None, got {type(optimizer).__name__}"
        )


def _hash_param_ids(modules: Mapping[str, ShardedHashEmbeddingBagCollection]) -> set[int]:
    return {id(p) for m in modules.values() for p in m.fused_optimizer.params.values()}


def _leaf_optimizers(optimizer: KeyedOptimizer) -> Iterator[KeyedOptimizer]:
    if isinstance(optimizer, CombinedOptimizer):
        for _, sub in optimizer.optimizers:
            yield from _leaf_optimizers(sub)
    elif isinstance(optimizer, OptimizerWrapper):
        yield from _leaf_optimizers(optimizer._optimizer)
    else:
        yield optimizer


def _param_group_hyperparameters(optimizer: KeyedOptimizer) -> dict[str, dict[str, Any]]:
    """Per parameter key, the hyperparameters of its group (everything but ``params``)."""
    key_of = {id(p): k for k, p in optimizer.params.items()}
    out: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        hps = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            key = key_of.get(id(p))
            if key is not None:
                out[key] = hps
    return out


# ---------------------------------------------------------------------------------------------
# atomic directories (shared with export.py)


def _begin_directory(final: str, comm: _Comm, what: str) -> str:
    """Rank 0 creates ``.<name>.partial-<token>`` beside ``final``; every rank gets its path."""
    outcome: tuple[str, str] = ("", "")
    if comm.rank == 0:
        parent, name = os.path.split(final)
        if not os.path.isdir(parent):
            outcome = ("FileNotFoundError", f"{what} path {final!r}: the parent directory {parent!r} does not exist")
        elif os.path.lexists(final):
            outcome = (
                "FileExistsError",
                f"{what} path {final!r} already exists; save each {what} to a new path (e.g. one per step)",
            )
        else:
            tmp = os.path.join(parent, f".{name}{_PARTIAL}{secrets.token_hex(4)}")
            try:
                os.makedirs(tmp)
                outcome = ("", tmp)
            except OSError as e:
                outcome = ("OSError", f"{what} path {final!r}: cannot create {tmp!r}: {e}")
    kind, value = comm.broadcast(outcome)
    if kind:
        raise {"FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError}.get(kind, OSError)(value)
    os.makedirs(value, exist_ok=True)
    return value


def _write_json(path: str, obj: Any) -> None:
    staging = path + ".writing"
    with open(staging, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_directory(tmp: str, final: str, manifest_name: str, manifest: dict[str, Any], comm: _Comm) -> None:
    """After every rank finished writing into ``tmp``: rank 0 writes the manifest and renames ``tmp``."""
    error: BaseException | None = None
    if comm.rank == 0:
        try:
            _write_json(os.path.join(tmp, manifest_name), manifest)
            _fsync_dir(tmp)
            if os.path.lexists(final):
                raise FileExistsError(f"{final!r} appeared while saving; the complete copy is left at {tmp!r}")
            os.rename(tmp, final)
            _fsync_dir(os.path.dirname(final))
        except Exception as e:
            error = e
    comm.agree(error)


# ---------------------------------------------------------------------------------------------
# save


def save_checkpoint(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    path: str | os.PathLike[str],
    *,
    extra: dict[str, Any] | None = None,
) -> str:
    """Save a sharded model, its optimizer and ``extra`` to the new directory ``path``, atomically.

    Collective: every rank calls it with the same ``path`` (on a file system all ranks share),
    between training steps. Each rank writes its own shards in parallel (DCP); once all ranks
    have finished, rank 0 writes the manifest and publishes the directory with one rename. If
    any process dies before that, ``path`` does not exist and a ``.<name>.partial-<token>``
    directory without manifest is left beside it (loading it raises an error saying so).

    Saved: every hash table shard by row (weights, fused optimizer state, the id table with
    eviction and admission metadata), the rest of ``model.state_dict()``, the optimizer's
    state and parameter-group hyperparameters, and each rank's ``extra``. Row pins of batches
    in flight are runtime state and are not saved: save from a plain loop between steps, or
    after a pipeline has finished its batches.

    Args:
        model (nn.Module): the ``DistributedModelParallel`` (or a module holding
            ``ShardedHashEmbeddingBagCollection`` modules).
        optimizer (KeyedOptimizer | None): usually ``CombinedOptimizer([model.fused_optimizer,
            dense_optimizer])``; None saves no dense optimizer state (the fused state of the
            hash tables is part of the tables and always saved).
        path (str | os.PathLike): directory to create; must not exist yet.
        extra (dict | None): picklable per-rank user state (step, data position, RNG state);
            :func:`load_checkpoint` returns it.

    Returns:
        str: the absolute path of the published checkpoint.

    Raises:
        FileExistsError: ``path`` exists.
        TypeError: an argument has the wrong type, or the model holds an unsharded
            ``HashEmbeddingBagCollection``.

    Example::

        save_checkpoint(ddp_model, optimizer, f"ckpt/step_{step}", extra={"step": step})
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_optimizer(optimizer)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    modules = _hash_modules(model)
    comm = _Comm(_host_group(modules))
    final = os.path.abspath(os.fspath(path))
    tmp = _begin_directory(final, comm, "checkpoint")

    error: BaseException | None = None
    state: dict[str, Any] = {}
    local: dict[str, Any] = {}
    try:
        state, local = _collect(model, optimizer, modules, extra, comm)
    except Exception as e:
        error = e
    try:
        comm.agree(error)
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    groups = comm.gather(local.pop("param_groups"))
    if comm.rank == 0 and optimizer is not None:
        merged: dict[str, dict[str, Any]] = {}
        for g in groups:
            merged.update(g)
        state["optim_param_groups"] = pickle.dumps(merged)
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
        process_group=comm.pg,
        no_dist=not comm.distributed,
    )
    everyone = comm.gather(local)  # also the barrier: every rank has finished writing
    manifest = _manifest(everyone, modules, comm.world, optimizer is not None)
    _publish_directory(tmp, final, CHECKPOINT_MANIFEST, manifest, comm)
    return final


def _collect(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    modules: Mapping[str, ShardedHashEmbeddingBagCollection],
    extra: dict[str, Any] | None,
    comm: _Comm,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's DCP state dict and what the manifest needs to know about it."""
    rank = comm.rank
    state: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    hash_keys: set[str] = set()
    for fqn, module in modules.items():
        layouts = _layouts(module)
        hash_keys.update(_weight_key(fqn, name) for name in layouts)
        pending = module.owed_reinit_rows()
        slices = module._table_slices()
        counters = _fused_counters(module)
        for name, table in module.id_tables.items():
            prefix = _hash_prefix(fqn, name, rank)
            weight, states = slices[name]
            state[prefix + "weight"] = weight.detach()
            for i, s in enumerate(states):
                state[prefix + f"state{i}"] = s.detach()
            for skey, value in counters[name].items():
                state[prefix + "fused/" + skey] = value.detach()
            sd = table.state_dict()
            if name in pending:  # rows reassigned by a batch not yet computed: still to re-initialise
                sd["reassigned_rows"] = torch.cat([sd["reassigned_rows"], pending[name].to(torch.int64)]).unique()
            for key, value in sd.items():
                state[prefix + "table/" + key] = value
            offset = next(o for r, o, _ in layouts[name].shards if r == rank)
            tables[f"{fqn}\0{name}"] = {
                "rank": rank,
                "row_offset": offset,
                "rows": int(weight.shape[0]),
                "num_ids": len(table),
                "step": table.step,
                "weight_dtype": str(weight.dtype),
                "optimizer_states": [{"shape": list(s.shape[1:]), "dtype": str(s.dtype)} for s in states],
                "optimizer_counters": sorted(counters[name]),
                "admission_counters": int(sd["admission_counters"].numel()),
            }
    for key, value in model.state_dict().items():
        if key not in hash_keys:
            state["model/" + key] = value
    optim_state: dict[str, dict[str, str]] = {}
    groups: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        hash_ids = _hash_param_ids(modules)
        params = optimizer.params
        for pkey, pstate in optimizer.state_dict()["state"].items():
            if id(params[pkey]) in hash_ids:
                continue
            kinds = optim_state.setdefault(pkey, {})
            for skey, value in pstate.items():
                key = _optim_key(pkey, skey)
                if isinstance(value, ShardedTensor):
                    state[key], kinds[skey] = value, "sharded"
                elif isinstance(value, torch.Tensor):
                    state[key], kinds[skey] = value.detach(), "tensor"
                else:
                    state[key], kinds[skey] = pickle.dumps(value), "object"
        groups = _param_group_hyperparameters(optimizer)
    state[f"extra/{rank}"] = pickle.dumps({} if extra is None else extra)
    local = {"tables": tables, "optimizer": optim_state, "param_groups": groups}
    return state, local


def _optim_key(pkey: str, skey: str) -> str:
    return f"optim/{pkey}/{skey}"


def _manifest(
    everyone: list[dict[str, Any]],
    modules: Mapping[str, ShardedHashEmbeddingBagCollection],
    world: int,
    with_optimizer: bool,
) -> dict[str, Any]:
    hash_info: dict[str, dict[str, Any]] = {}
    for fqn, module in modules.items():
        entry: dict[str, Any] = {}
        for name, layout in _layouts(module).items():
            shards = sorted(
                (local["tables"][f"{fqn}\0{name}"] for local in everyone if f"{fqn}\0{name}" in local["tables"]),
                key=lambda s: s["rank"],
            )
            first = shards[0] if shards else {}
            entry[name] = {
                "embedding_dim": layout.embedding_dim,
                "num_embeddings": layout.num_embeddings,
                "sharding_type": layout.sharding_type,
                "weight_dtype": first.get("weight_dtype"),
                "optimizer_states": first.get("optimizer_states", []),
                "optimizer_counters": first.get("optimizer_counters", []),
                "admission_counters": first.get("admission_counters", 0),
                "shards": [{k: s[k] for k in ("rank", "row_offset", "rows", "num_ids", "step")} for s in shards],
            }
        hash_info[fqn] = entry
    optimizer: dict[str, dict[str, str]] | None = None
    if with_optimizer:
        optimizer = {}
        for local in everyone:
            for pkey, kinds in local["optimizer"].items():
                optimizer.setdefault(pkey, {}).update(kinds)
    return {
        "format": _FORMAT,
        "version": _VERSION,
        "complete": True,
        "world_size": world,
        "created_unix_ns": time.time_ns(),
        "hash_modules": hash_info,
        "optimizer_state": optimizer,
    }


# ---------------------------------------------------------------------------------------------
# reading checkpoints


def _read_manifest(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a checkpoint: a checkpoint is a directory written by save_checkpoint")
    manifest_path = os.path.join(path, CHECKPOINT_MANIFEST)
    if not os.path.isfile(manifest_path):
        if _PARTIAL in os.path.basename(path) or os.path.isfile(os.path.join(path, ".metadata")):
            raise ValueError(
                f"{path!r} is an incomplete checkpoint: its save was interrupted before every rank finished "
                f"(no {CHECKPOINT_MANIFEST}); load the previous checkpoint (see latest_checkpoint)"
            )
        raise ValueError(f"{path!r} is not a checkpoint: it holds no {CHECKPOINT_MANIFEST}")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path!r}: cannot read {CHECKPOINT_MANIFEST}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise ValueError(f"{path!r}: {CHECKPOINT_MANIFEST} is not a recsdk checkpoint manifest")
    if manifest.get("version") != _VERSION or not manifest.get("complete"):
        raise ValueError(
            f"{path!r}: checkpoint format version {manifest.get('version')!r} (complete={manifest.get('complete')!r}); "
            f"this recsdk reads version {_VERSION}"
        )
    return manifest


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The most recently saved complete checkpoint directly under ``root``, or None.

    Incomplete (``.partial-``) directories and anything that is not a checkpoint are skipped.

    Args:
        root (str | os.PathLike): the directory holding one checkpoint per save.

    Returns:
        str | None: absolute path of the newest complete checkpoint.

    Example::

        path = latest_checkpoint("ckpt")
        extra = load_checkpoint(ddp_model, optimizer, path) if path else {}
    """
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        return None
    best: tuple[int, str] | None = None
    for name in os.listdir(root):
        candidate = os.path.join(root, name)
        try:
            manifest = _read_manifest(candidate)
        except (OSError, ValueError):
            continue
        key = (int(manifest.get("created_unix_ns", 0)), name)
        if best is None or key > best:
            best = key
    return None if best is None else os.path.join(root, best[1])


# ---------------------------------------------------------------------------------------------
# load


@dataclass
class _TableLoad:
    fqn: str
    name: str
    module: ShardedHashEmbeddingBagCollection
    layout: _Layout
    saved: dict[str, Any]
    exact: bool
    # reshard: records this rank received, sorted by id
    ids: torch.Tensor | None = None
    meta: torch.Tensor | None = None  # int64 [n, 2]: last_step, freq
    weight_rows: torch.Tensor | None = None
    state_rows: list[torch.Tensor] = field(default_factory=list)
    counters: torch.Tensor | None = None
    step: int = 0
    fused: dict[str, torch.Tensor] = field(default_factory=dict)  # optimizer counters: max over saved shards


def load_checkpoint(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    path: str | os.PathLike[str],
) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint`, on the same or another world size.

    Collective: every rank calls it with the same ``path``. The checkpoint is checked against
    the model first (hash modules and tables, embedding dims, weight and optimizer state
    layouts, dense keys and shapes, the optimizer's parameters): on any difference it raises a
    ``ValueError`` listing all of them, on every rank, before anything is modified.

    * Same world size and sharding plan: every rank reads its own shards back, row for row, so
      training resumes bit for bit (the id tables' free rows, step clocks and statistics too).
    * Otherwise the hash tables are rebuilt **by id**: the saved shards are read in parallel,
      each stored id goes to ``owner(id, world_size)`` (row-wise) or to the table's rank
      (table-wise) with its embedding, optimizer state rows, ``last_step`` (shifted so that its
      age is kept relative to the newest saved step clock) and ``freq``. Each shard's ids fill
      rows ``0..n-1`` in ascending id order; the other rows are marked free-after-use, so they
      are re-initialised (and their optimizer state zeroed) when handed to a new id. Admission
      counters are merged by element-wise max over the saved shards: a count-min sketch never
      undercounts, and the max of per-shard sketches keeps that true for every id (ids may be
      admitted a little earlier than before). Per-table optimizer counters that are not per row
      (an Adam step count) take the max over the saved shards. Statistics restart from zero. If the ids of a
      new shard exceed its capacity, a ``ValueError`` says which table, rank and by how much,
      before anything is modified.

    The rest of the model is loaded with DCP (which also reshards TorchRec-sharded tensors), the
    optimizer state replaces the current one (lazily created state included) and the
    parameter-group hyperparameters are restored; gradients are cleared.

    Args:
        model (nn.Module): the ``DistributedModelParallel`` built as for training.
        optimizer (KeyedOptimizer | None): the optimizer built as for training; None loads the
            model only (hash tables keep their fused optimizer state, which is part of them).
        path (str | os.PathLike): a checkpoint directory.

    Returns:
        dict: the ``extra`` this rank saved (rank 0's when the world size changed).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a complete checkpoint, does not match the model, or its ids
            do not fit the new shards.

    Example::

        extra = load_checkpoint(ddp_model, optimizer, latest_checkpoint("ckpt"))
        start_step = extra["step"]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_optimizer(optimizer)
    modules = _hash_modules(model)
    comm = _Comm(_host_group(modules))
    path = os.path.abspath(os.fspath(path))

    error: BaseException | None = None
    manifest: dict[str, Any] = {}
    metadata: Metadata | None = None
    try:
        manifest = _read_manifest(path)
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        error = e
    comm.agree(error)
    assert metadata is not None
    reader_md = metadata.state_dict_metadata

    for module in modules.values():
        module.release_finished_pins()
    problems, loads = _plan_load(model, optimizer, modules, manifest, reader_md, comm)
    comm.agree_on_problems(problems, f"checkpoint {path!r} does not match the model:")

    # Phase 1, nothing modified yet: read the shards of tables that change layout, route their
    # ids to the new owners and check that they fit.
    reshard = [t for t in loads if not t.exact]
    if reshard:
        _reshard_read(reshard, path, reader_md, comm)

    # Phase 2: load dense state and same-layout shards (in place), then commit everything.
    targets: dict[str, Any] = {}
    exact_tables: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    model_sd = model.state_dict()
    hash_keys = {_weight_key(t.fqn, t.name) for t in loads}
    for key, value in model_sd.items():
        if key not in hash_keys:
            targets["model/" + key] = value
    for t in loads:
        if t.exact and t.name in t.module.id_tables:
            prefix = _hash_prefix(t.fqn, t.name, comm.rank)
            weight, states = t.module._table_slices()[t.name]
            targets[prefix + "weight"] = weight.detach()
            for i, s in enumerate(states):
                targets[prefix + f"state{i}"] = s.detach()
            for skey, value in _fused_counters(t.module)[t.name].items():
                targets[prefix + "fused/" + skey] = value.detach()
            buffers = {k: _empty_like_saved(reader_md[prefix + "table/" + k]) for k in _TABLE_KEYS}
            buffers["admission_counters"] = _empty_like_saved(reader_md[prefix + "table/admission_counters"])
            buffers["capacity"] = torch.tensor(weight.shape[0], dtype=torch.int64)
            for k, v in buffers.items():
                if k != "capacity":
                    targets[prefix + "table/" + k] = v
            exact_tables[(t.fqn, t.name)] = buffers
    optim_targets = _optimizer_targets(optimizer, modules, manifest, reader_md) if optimizer is not None else {}
    targets.update(optim_targets)
    if optimizer is not None and "optim_param_groups" in reader_md:
        targets["optim_param_groups"] = b""
    source = comm.rank if int(manifest["world_size"]) == comm.world else 0
    targets[f"extra/{source}"] = b""
    dcp.load(targets, storage_reader=dcp.FileSystemReader(path), process_group=comm.pg, no_dist=not comm.distributed)

    for t in loads:
        if t.name not in t.module.id_tables:
            continue
        if t.exact:
            t.module.id_tables[t.name].load_state_dict(exact_tables[(t.fqn, t.name)])
        else:
            _commit_resharded(t)
    for module in modules.values():
        with module._lock:
            module._pending_reinit = {}
    if optimizer is not None:
        _apply_optimizer(optimizer, modules, manifest, targets)
    extra = pickle.loads(targets[f"extra/{source}"])
    comm.agree(None)
    return extra


def _empty_like_saved(md: Any) -> torch.Tensor:
    assert isinstance(md, TensorStorageMetadata)
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


def _plan_load(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    modules: Mapping[str, ShardedHashEmbeddingBagCollection],
    manifest: dict[str, Any],
    reader_md: Mapping[str, Any],
    comm: _Comm,
) -> tuple[list[str], list[_TableLoad]]:
    """Compare the checkpoint with the model; list every difference this rank can see."""
    problems: list[str] = []
    loads: list[_TableLoad] = []
    saved_modules: dict[str, Any] = manifest["hash_modules"]
    for fqn in sorted(set(saved_modules) - set(modules)):
        problems.append(f"hash module {fqn!r} is in the checkpoint but not in the model")
    for fqn in sorted(set(modules) - set(saved_modules)):
        problems.append(f"hash module {fqn!r} is in the model but not in the checkpoint")
    same_world = int(manifest["world_size"]) == comm.world
    for fqn in sorted(set(modules) & set(saved_modules)):
        module, saved_tables = modules[fqn], saved_modules[fqn]
        layouts = _layouts(module)
        where = f"hash module {fqn!r}"
        for name in sorted(set(saved_tables) - set(layouts)):
            problems.append(f"{where}: table {name!r} is in the checkpoint but not in the model")
        for name in sorted(set(layouts) - set(saved_tables)):
            problems.append(f"{where}: table {name!r} is in the model but not in the checkpoint")
        for name in sorted(set(layouts) & set(saved_tables)):
            layout, saved = layouts[name], saved_tables[name]
            table_where = f"{where}, table {name!r}"
            if saved["embedding_dim"] != layout.embedding_dim:
                problems.append(
                    f"{table_where}: embedding_dim {saved['embedding_dim']} in the checkpoint, "
                    f"{layout.embedding_dim} in the model"
                )
                continue
            counters = _admission_counters(module, name)
            if saved["admission_counters"] != counters:
                problems.append(
                    f"{table_where}: {saved['admission_counters']} admission counters in the checkpoint, "
                    f"{counters} in the model (CountAdmission counter_slots/num_hashes/threshold differ)"
                )
            if name in module.id_tables:
                weight, states = module._table_slices()[name]
                if saved["weight_dtype"] != str(weight.dtype):
                    problems.append(
                        f"{table_where}: weights are {saved['weight_dtype']} in the checkpoint, {weight.dtype} "
                        "in the model"
                    )
                mine = [{"shape": list(s.shape[1:]), "dtype": str(s.dtype)} for s in states]
                if saved["optimizer_states"] != mine:
                    problems.append(
                        f"{table_where}: fused optimizer state per row {_describe_states(saved['optimizer_states'])} "
                        f"in the checkpoint, {_describe_states(mine)} in the model (another sparse optimizer?)"
                    )
                mine_counters = sorted(_fused_counters(module)[name])
                if saved.get("optimizer_counters", []) != mine_counters:
                    problems.append(
                        f"{table_where}: fused optimizer counters {saved.get('optimizer_counters', [])} in the "
                        f"checkpoint, {mine_counters} in the model (another sparse optimizer?)"
                    )
                if module.id_tables[name].num_pinned():
                    problems.append(
                        f"{table_where}: {module.id_tables[name].num_pinned()} rows on rank {comm.rank} are pinned "
                        "by batches in flight; finish the pipeline's batches before loading"
                    )
            saved_shards = [(s["rank"], s["row_offset"], s["rows"]) for s in saved["shards"]]
            exact = (
                same_world
                and saved["num_embeddings"] == layout.num_embeddings
                and saved["sharding_type"] == layout.sharding_type
                and saved_shards == layout.shards
            )
            if layout.sharding_type == "row_wise" and [r for r, _, _ in layout.shards] != list(range(comm.world)):
                problems.append(f"{table_where}: row-wise shards must be on ranks 0..{comm.world - 1} in order")
            loads.append(_TableLoad(fqn, name, module, layout, saved, exact))
    problems.extend(_dense_problems(model, modules, reader_md))
    if optimizer is not None:
        problems.extend(_optimizer_problems(optimizer, modules, manifest, reader_md))
    return problems, loads


def _describe_states(states: list[dict[str, Any]]) -> str:
    if not states:
        return "none (SGD)"
    return ", ".join(f"{s['dtype']}{s['shape']}" for s in states)


def _dense_problems(
    model: nn.Module, modules: Mapping[str, ShardedHashEmbeddingBagCollection], reader_md: Mapping[str, Any]
) -> list[str]:
    hash_keys = {_weight_key(fqn, name) for fqn, m in modules.items() for name in m.module_sharding_plan}
    problems = []
    mine = {k: v for k, v in model.state_dict().items() if k not in hash_keys}
    saved = {k[len("model/") :]: v for k, v in reader_md.items() if k.startswith("model/")}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    if missing:
        problems.append(f"model keys missing from the checkpoint: {missing}")
    if unexpected:
        problems.append(f"checkpoint keys the model does not have: {unexpected}")
    for key in sorted(set(mine) & set(saved)):
        value, md = mine[key], saved[key]
        if isinstance(value, (torch.Tensor, ShardedTensor)):
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"model key {key!r}: a tensor in the model, not in the checkpoint")
            elif tuple(md.size) != tuple(value.size()):
                problems.append(
                    f"model key {key!r}: shape {list(md.size)} in the checkpoint, {list(value.size())} in the model"
                )
    return problems


def _optimizer_problems(
    optimizer: KeyedOptimizer,
    modules: Mapping[str, ShardedHashEmbeddingBagCollection],
    manifest: dict[str, Any],
    reader_md: Mapping[str, Any],
) -> list[str]:
    saved: dict[str, dict[str, str]] | None = manifest.get("optimizer_state")
    if saved is None:
        return ["the checkpoint holds no optimizer state (saved with optimizer=None); pass optimizer=None"]
    problems = []
    hash_ids = _hash_param_ids(modules)
    keys = {k for k, p in optimizer.params.items() if id(p) not in hash_ids}
    current = optimizer.state_dict()["state"]
    missing = sorted(keys - set(saved))
    if missing:
        problems.append(f"optimizer parameters missing from the checkpoint: {missing}")
    for pkey in sorted(keys & set(saved)):
        for skey, kind in saved[pkey].items():
            value = current.get(pkey, {}).get(skey)
            md = reader_md.get(_optim_key(pkey, skey))
            if kind == "sharded" and not isinstance(value, ShardedTensor):
                problems.append(f"optimizer state {pkey!r}/{skey!r}: sharded in the checkpoint, not in the optimizer")
            elif (
                kind == "tensor"
                and isinstance(value, torch.Tensor)
                and isinstance(md, TensorStorageMetadata)
                and tuple(md.size) != tuple(value.shape)
            ):
                problems.append(
                    f"optimizer state {pkey!r}/{skey!r}: shape {list(md.size)} in the checkpoint, "
                    f"{list(value.shape)} in the optimizer"
                )
    return problems


def _optimizer_targets(
    optimizer: KeyedOptimizer,
    modules: Mapping[str, ShardedHashEmbeddingBagCollection],
    manifest: dict[str, Any],
    reader_md: Mapping[str, Any],
) -> dict[str, Any]:
    saved: dict[str, dict[str, str]] = manifest["optimizer_state"]
    hash_ids = _hash_param_ids(modules)
    current = optimizer.state_dict()["state"]
    targets: dict[str, Any] = {}
    for pkey, param in optimizer.params.items():
        if id(param) in hash_ids:
            continue
        for skey, kind in saved.get(pkey, {}).items():
            key = _optim_key(pkey, skey)
            if kind == "sharded":
                targets[key] = current[pkey][skey]
            elif kind == "tensor":
                targets[key] = _empty_like_saved(reader_md[key])
            else:
                targets[key] = b""
    return targets


def _apply_optimizer(
    optimizer: KeyedOptimizer,
    modules: Mapping[str, ShardedHashEmbeddingBagCollection],
    manifest: dict[str, Any],
    loaded: Mapping[str, Any],
) -> None:
    saved: dict[str, dict[str, str]] = manifest["optimizer_state"]
    hash_ids = _hash_param_ids(modules)
    leaf_of: dict[int, KeyedOptimizer] = {}
    for leaf in _leaf_optimizers(optimizer):
        for p in leaf.params.values():
            leaf_of[id(p)] = leaf
    for pkey, param in optimizer.params.items():
        if id(param) in hash_ids or id(param) not in leaf_of:
            continue
        leaf = leaf_of[id(param)]
        kinds = saved.get(pkey, {})
        if not kinds:
            leaf.state.pop(param, None)
            continue
        if param not in leaf.state:
            leaf.state[param] = {}
        pstate = leaf.state[param]
        for skey in [k for k in pstate if k not in kinds]:
            del pstate[skey]
        for skey, kind in kinds.items():
            value = loaded[_optim_key(pkey, skey)]
            if kind == "sharded":
                continue  # loaded in place
            if kind == "object":
                pstate[skey] = pickle.loads(value)
                continue
            old = pstate.get(skey)
            if isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype:
                old.detach().copy_(value)
            else:
                pstate[skey] = value.to(param.device) if isinstance(param, torch.Tensor) else value
    if "optim_param_groups" in loaded:
        hps: dict[str, dict[str, Any]] = pickle.loads(loaded["optim_param_groups"])
        key_of = {id(p): k for k, p in optimizer.params.items()}
        for group in optimizer.param_groups:
            source = next((hps[key_of[id(p)]] for p in group["params"] if key_of.get(id(p)) in hps), None)
            if source is None:
                continue
            for k in group:
                if k != "params" and k in source:
                    group[k] = pickle.loads(pickle.dumps(source[k]))
    # Pushes restored learning rates into the fused kernels (they read them on zero_grad/step).
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------
# resharding by id


def _reshard_read(tables: list[_TableLoad], path: str, reader_md: Mapping[str, Any], comm: _Comm) -> None:
    """Read saved shards (spread over the ranks), route every stored id to its new shard, check capacity.

    Fills ``ids``/``meta``/``weight_rows``/``state_rows``/``counters``/``step`` of the tables this
    rank holds in the new layout. Modifies nothing in the model.
    """
    jobs = [(t, shard) for t in tables for shard in t.saved["shards"]]
    mine = [job for i, job in enumerate(jobs) if i % comm.world == comm.rank]
    targets: dict[str, torch.Tensor] = {}
    for t, shard in mine:
        prefix = _hash_prefix(t.fqn, t.name, shard["rank"])
        keys = ["table/ids", "table/rows", "table/last_step", "table/freq", "table/admission_counters", "weight"]
        keys += [f"state{i}" for i in range(len(t.saved["optimizer_states"]))]
        keys += [f"fused/{k}" for k in t.saved.get("optimizer_counters", [])]
        for k in keys:
            targets[prefix + k] = _empty_like_saved(reader_md[prefix + k])
    dcp.load(targets, storage_reader=dcp.FileSystemReader(path), process_group=comm.pg, no_dist=not comm.distributed)

    outgoing: list[dict[str, Any]] = []
    counts = torch.zeros(len(tables), comm.world, dtype=torch.int64)
    for ti, t in enumerate(tables):
        new_step = max((int(s["step"]) for s in t.saved["shards"]), default=0)
        t.step = new_step
        parts: dict[str, list[torch.Tensor]] = {"ids": [], "meta": [], "weight": [], "counters": []}
        state_parts: list[list[torch.Tensor]] = [[] for _ in t.saved["optimizer_states"]]
        for job_table, shard in mine:
            if job_table is not t:
                continue
            prefix = _hash_prefix(t.fqn, t.name, shard["rank"])
            rows = targets[prefix + "table/rows"]
            shift = new_step - int(shard["step"])
            last = (targets[prefix + "table/last_step"].to(torch.int64) + shift).clamp_(0, _INT32_MAX)
            parts["ids"].append(targets[prefix + "table/ids"])
            parts["meta"].append(torch.stack([last, targets[prefix + "table/freq"].to(torch.int64)], dim=1))
            parts["weight"].append(targets[prefix + "weight"].index_select(0, rows))
            parts["counters"].append(targets[prefix + "table/admission_counters"])
            for i in range(len(state_parts)):
                state_parts[i].append(targets[prefix + f"state{i}"].index_select(0, rows))
        dim = t.layout.embedding_dim
        ids = torch.cat(parts["ids"]) if parts["ids"] else torch.zeros(0, dtype=torch.int64)
        meta = torch.cat(parts["meta"]) if parts["meta"] else torch.zeros(0, 2, dtype=torch.int64)
        weight_dtype = _dtype(t.saved["weight_dtype"])
        weight = torch.cat(parts["weight"]) if parts["weight"] else torch.zeros(0, dim, dtype=weight_dtype)
        states = [
            torch.cat(p) if p else torch.zeros(0, *s["shape"], dtype=_dtype(s["dtype"]))
            for p, s in zip(state_parts, t.saved["optimizer_states"], strict=True)
        ]
        if t.layout.sharding_type == "row_wise":
            dest = owner(ids, comm.world)
        else:
            dest = torch.full_like(ids, t.layout.shards[0][0])
        # By destination, then by id: a rank receiving from one source needs no re-sorting.
        by_id = torch.argsort(ids)
        order = by_id.index_select(0, torch.argsort(dest.index_select(0, by_id), stable=True))
        counts[ti] = torch.bincount(dest, minlength=comm.world)
        sketch = None
        if t.saved["admission_counters"]:
            sketch = torch.zeros(int(t.saved["admission_counters"]), dtype=torch.int32)
            for c in parts["counters"]:
                sketch = torch.maximum(sketch, c.to(torch.int32))
        outgoing.append(
            {
                "ids": ids[order],
                "meta": meta[order],
                "weight": weight[order],
                "states": [s[order] for s in states],
                "sketch": sketch,
            }
        )

    fused_local: dict[int, dict[str, torch.Tensor]] = {}
    for ti, t in enumerate(tables):
        for job_table, shard in mine:
            if job_table is t:
                prefix = _hash_prefix(t.fqn, t.name, shard["rank"])
                for k in t.saved.get("optimizer_counters", []):
                    mine_max = fused_local.setdefault(ti, {})
                    value = targets[prefix + f"fused/{k}"]
                    mine_max[k] = value if k not in mine_max else torch.maximum(mine_max[k], value)
    gathered = comm.gather((counts, fused_local))
    all_counts = torch.stack([c for c, _ in gathered])  # [source, table, dest]
    for _, theirs in gathered:
        for ti, values in theirs.items():
            merged = tables[ti].fused
            for k, v in values.items():
                merged[k] = v.clone() if k not in merged else torch.maximum(merged[k], v)
    totals = all_counts.sum(0)
    problems = []
    for ti, t in enumerate(tables):
        for r in range(comm.world):
            need, cap = int(totals[ti, r]), t.layout.rows_on(r)
            if need > cap:
                problems.append(
                    f"hash module {t.fqn!r}, table {t.name!r}: rank {r} would hold {need} ids but its shard has "
                    f"capacity {cap} ({t.layout.sharding_type}, num_embeddings {t.layout.num_embeddings}, "
                    f"world size {comm.world}); raise num_embeddings or load on more ranks"
                )
    comm.agree_on_problems(problems, "the checkpoint's ids do not fit the model's shards (nothing was loaded):")

    for ti, t in enumerate(tables):
        out = outgoing[ti]
        send = counts[ti].tolist()
        recv = all_counts[:, ti, comm.rank].tolist()
        ids = _all_to_all(out["ids"], send, recv, comm)
        meta = _all_to_all(out["meta"], send, recv, comm)
        weight = _all_to_all(out["weight"], send, recv, comm)
        states = [_all_to_all(s, send, recv, comm) for s in out["states"]]
        sketch = out["sketch"]
        if sketch is not None and comm.distributed:
            dist.all_reduce(sketch, op=dist.ReduceOp.MAX, group=comm.pg)
        if t.name in t.module.id_tables:
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                order = torch.argsort(ids)
                ids, meta, weight = ids[order], meta[order], weight[order]
                states = [s[order] for s in states]
            t.ids, t.meta, t.weight_rows, t.state_rows = ids, meta, weight, states
            t.counters = sketch


def _dtype(name: str | None) -> torch.dtype:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the checkpoint manifest")
    return value


def _all_to_all(tensor: torch.Tensor, send: list[int], recv: list[int], comm: _Comm) -> torch.Tensor:
    if not comm.distributed or comm.world == 1:
        return tensor
    out = torch.empty((sum(recv), *tensor.shape[1:]), dtype=tensor.dtype)
    dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=comm.pg)
    return out


def _commit_resharded(t: _TableLoad) -> None:
    """Rebuild this rank's shard of ``t`` from the ids routed to it: rows ``0..n-1`` in id order."""
    assert t.ids is not None and t.meta is not None and t.weight_rows is not None
    table = t.module.id_tables[t.name]
    cap = table.capacity
    n = t.ids.numel()
    counters = t.counters if t.counters is not None else torch.zeros(0, dtype=torch.int32)
    table.load_state_dict(
        {
            "capacity": torch.tensor(cap, dtype=torch.int64),
            "ids": t.ids,
            "rows": torch.arange(n, dtype=torch.int64),
            "last_step": t.meta[:, 0],
            "freq": t.meta[:, 1],
            "free_rows": torch.arange(cap - 1, n - 1, -1, dtype=torch.int64),
            # Rows above n may hold another model's values: re-initialise them when they are handed out.
            "retired_rows": torch.arange(n, cap, dtype=torch.int64),
            "reassigned_rows": torch.zeros(0, dtype=torch.int64),
            "admission_counters": counters,
            "step": torch.tensor(t.step, dtype=torch.int64),
            "stats": torch.zeros(5, dtype=torch.int64),
        }
    )
    weight, states = t.module._table_slices()[t.name]
    with torch.no_grad():
        weight[:n].copy_(t.weight_rows)
        for s, rows in zip(states, t.state_rows, strict=True):
            s[:n].copy_(rows)
        for skey, value in _fused_counters(t.module)[t.name].items():
            value.copy_(t.fused[skey])
