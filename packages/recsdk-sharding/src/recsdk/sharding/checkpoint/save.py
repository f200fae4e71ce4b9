"""``save_checkpoint``: every rank writes its shards in parallel; rank 0 publishes the directory."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torchrec.optim.keyed import KeyedOptimizer

from recsdk.embedding import ScoreEviction
from recsdk.sharding.checkpoint import optimizer_state, storage
from recsdk.sharding.checkpoint.layout import fused_counters, layouts
from recsdk.sharding.checkpoint.manifest import CHECKPOINT_MANIFEST, build_manifest, hash_prefix
from recsdk.sharding.writing import files
from recsdk.sharding.writing.atomic_directory import write_directory
from recsdk.sharding.writing.comm import Comm
from recsdk.sharding.writing.hash_modules import HashModule, hash_modules, hash_weight_keys, host_group

__all__ = ["save_checkpoint"]


class ReadAhead(Protocol):
    """What :func:`save_checkpoint` asks of a pipeline (``recsdk.pipeline.HybridTrainPipelineSparseDist``)."""

    @property
    def batches_read_ahead(self) -> int: ...


def save_checkpoint(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    path: str | os.PathLike[str],
    *,
    extra: dict[str, Any] | None = None,
    pipeline: ReadAhead | None = None,
) -> str:
    """Save a sharded model, its optimizer and ``extra`` to the new directory ``path``, atomically.

    Collective: every rank calls it with the same ``path`` (on a file system all ranks share),
    between training steps. Each rank writes its own shards in parallel (DCP); once all ranks
    have finished, the ranks checksum the files (CRC-32, each rank a share), and rank 0 writes
    the manifest, with every file's size and checksum, and publishes the directory with one
    rename. A failure on any rank (a full disk, say) raises on every rank and removes the
    partial directory; a process that dies before the rename leaves ``path`` absent and a
    ``.<name>.partial-<token>`` directory without manifest beside it (loading it raises an
    error saying so; the next successful save beside it removes it).

    Saved: every hash table shard by row (weights, fused optimizer state, the id table with
    eviction and admission metadata), the rest of ``model.state_dict()``, the optimizer's
    state and parameter-group hyperparameters, and each rank's ``extra``. Row pins of batches
    in flight are runtime state and are not saved: save from a plain loop between steps, or
    from a pipeline after ``pipeline.drain()`` (it trains the batches read ahead, so nothing
    is in flight and the data position is that of the last batch trained); pass the pipeline
    as ``pipeline`` and a save with batches still read ahead is refused.

    Args:
        model (nn.Module): the ``DistributedModelParallel`` (or a module holding
            ``HashModule`` modules).
        optimizer (KeyedOptimizer | None): usually ``CombinedOptimizer([model.fused_optimizer,
            dense_optimizer])``; None saves no dense optimizer state (the fused state of the
            hash tables is part of the tables and always saved).
        path (str | os.PathLike): directory to create; must not exist yet.
        extra (dict | None): picklable per-rank user state (step, data position, RNG state);
            :func:`load_checkpoint` returns it.
        pipeline (HybridTrainPipelineSparseDist | None): the pipeline training ``model``; it
            must hold no batch read ahead (``pipeline.drain()`` first).

    Returns:
        str: the absolute path of the published checkpoint.

    Raises:
        FileExistsError: ``path`` exists.
        ValueError: ``pipeline`` holds batches read ahead (on every rank alike, before anything
            is written).
        FileNotFoundError: the parent directory of ``path`` does not exist.
        ValueError: the ranks passed different paths (raised on every rank, before any write).
        TypeError: an argument has the wrong type, or the model holds an unsharded
            ``HashEmbeddingBagCollection``.
        OSError: writing failed on some rank (every rank raises it; ``errno.ENOSPC`` when the
            disk is full); its first line names the directory being written.
        CheckpointError: another rank failed (its error is in the message).

    Example::

        save_checkpoint(ddp_model, optimizer, f"ckpt/step_{step}", extra={"step": step})
    """
    check_save_arguments(model, optimizer, extra, pipeline)
    modules = hash_modules(model)
    final = os.path.abspath(os.fspath(path))
    comm = Comm(host_group(modules), what=f"saving checkpoint {final!r}")

    def fill(tmp: str) -> dict[str, Any]:
        state, local = collect(model, optimizer, modules, extra, comm)
        return write(state, local, modules, tmp, final, comm)

    write_directory(final, comm, "checkpoint", CHECKPOINT_MANIFEST, fill)
    return final


def check_save_arguments(
    model: nn.Module, optimizer: KeyedOptimizer | None, extra: dict[str, Any] | None, pipeline: ReadAhead | None
) -> None:
    """The argument checks of a save (local, before any collective; the same outcome on every rank).

    Raises:
        TypeError: a bad model, optimizer or ``extra``.
        ValueError: ``pipeline`` holds batches read ahead.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    optimizer_state.check_optimizer(optimizer)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    if pipeline is not None and pipeline.batches_read_ahead:
        raise ValueError(
            f"save_checkpoint: the pipeline holds {pipeline.batches_read_ahead} batches read ahead and mapped but "
            "not trained; call pipeline.drain() first (it trains them), so that the checkpoint and the data position "
            "stand after the last batch read"
        )


def collect(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    modules: Mapping[str, HashModule],
    extra: dict[str, Any] | None,
    comm: Comm,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: this rank's DCP state dict (views of the live tensors) and what the manifest
    needs of it; rank 0's holds every rank's parameter groups."""
    state, local = comm.run(_collect, model, optimizer, modules, extra, comm.rank)
    groups = comm.gather(local.pop("param_groups"))
    if comm.rank == 0 and optimizer is not None:
        merged: dict[str, dict[str, Any]] = {}
        for g in groups:
            merged.update(g)
        state[optimizer_state.PARAM_GROUPS_KEY] = pickle.dumps(merged)
    local["with_optimizer"] = optimizer is not None
    return state, local


def write(
    state: dict[str, Any], local: dict[str, Any], modules: Mapping[str, HashModule], tmp: str, final: str, comm: Comm
) -> dict[str, Any]:
    """Collective: write ``state`` into ``tmp`` (DCP) and checksum the files; the manifest to
    publish ``tmp`` with. Raises on every rank if any failed."""
    with_optimizer = bool(local.pop("with_optimizer"))
    comm.run(storage.write, state, tmp, final, comm)
    everyone = comm.gather(local)  # every rank has finished writing
    names = comm.broadcast(comm.run(_list_files, tmp, comm.rank))
    described = comm.run(files.describe, tmp, files.my_share(names, comm.rank, comm.world))
    records = {name: record for part in comm.gather(described) for name, record in part.items()}
    return build_manifest(everyone, modules, comm.world, with_optimizer, records)


def _list_files(tmp: str, rank: int) -> list[str]:
    return files.data_files(tmp, CHECKPOINT_MANIFEST) if rank == 0 else []


def _collect(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    modules: Mapping[str, HashModule],
    extra: dict[str, Any] | None,
    rank: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's DCP state dict and what the manifest needs to know about it."""
    state: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    for fqn, module in modules.items():
        table_layouts = layouts(module)
        owed = module.ledger.owed_resets()
        views = module.table_views()
        counters = fused_counters(module)
        for name, table in module.id_tables.items():
            prefix = hash_prefix(fqn, name, rank)
            weight, states = views[name]
            state[prefix + "weight"] = weight.detach()
            for i, s in enumerate(states):
                state[prefix + f"state{i}"] = s.detach()
            for skey, value in counters[name].items():
                state[prefix + "fused/" + skey] = value.detach()
            sd = table.state_dict()
            if name in owed:  # rows reassigned by a batch not yet computed: still to re-initialise
                sd["reassigned_rows"] = torch.cat([sd["reassigned_rows"], owed[name].to(torch.int64)]).unique()
            for key, value in sd.items():
                state[prefix + "table/" + key] = value
            offset = next(o for r, o, _ in table_layouts[name].shards if r == rank)
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
                "score_counters": int(sd["score_counters"].numel()),
                "scores_per_row": isinstance(table.eviction, ScoreEviction),
                "score_ref": int(sd["score_ref"]),
            }
    hash_keys = hash_weight_keys(modules)
    for key, value in model.state_dict().items():
        if key not in hash_keys:
            state["model/" + key] = value
    kinds: dict[str, dict[str, str]] = {}
    groups: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        kinds, groups = optimizer_state.collect(optimizer, modules, state)
    state[f"extra/{rank}"] = pickle.dumps({} if extra is None else extra)
    return state, {"tables": tables, "optimizer": kinds, "param_groups": groups}
