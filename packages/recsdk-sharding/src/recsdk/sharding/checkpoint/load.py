"""``load_checkpoint``: validate, read into staging buffers, agree, then commit to the model.

Every step that may fail on some ranks runs through the checkpoint's failure agreement
(:meth:`~recsdk.sharding.writing.comm.Comm.run`), so a failure anywhere raises on every
rank at once; the model, its id tables and the optimizer change only in the last step, after
every rank has read and validated its part.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torchrec.optim.keyed import KeyedOptimizer

from recsdk.embedding import IdTable
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.checkpoint import optimizer_state, storage
from recsdk.sharding.checkpoint.layout import fused_counters
from recsdk.sharding.checkpoint.manifest import hash_prefix, read_manifest
from recsdk.sharding.checkpoint.reshard import check_resharded, commit_resharded, read_resharded
from recsdk.sharding.checkpoint.validate import TableLoad, plan_load
from recsdk.sharding.writing import files
from recsdk.sharding.writing.comm import Comm
from recsdk.sharding.writing.errors import CheckpointError
from recsdk.sharding.writing.hash_modules import HashModule, hash_modules, hash_weight_keys, host_group

__all__ = ["load_checkpoint"]

_DCP_METADATA = ".metadata"

# A shard's id-table state as saved (the capacity is the model's own, not read back).
_TABLE_KEYS = tuple(k for k in IdTable.STATE_KEYS if k != "capacity")


def load_checkpoint(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    path: str | os.PathLike[str],
    *,
    verify: bool = False,
) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint`, on the same or another world size.

    Collective: every rank calls it with the same ``path``. Nothing in the model, its id tables
    or the optimizer changes unless the whole load succeeds on every rank:

    1. The checkpoint is checked before anything is read: every file the manifest lists must
       exist with its recorded size (and DCP's ``.metadata`` match its CRC-32 with ``verify``);
       then the checkpoint is compared with the model (hash modules and tables, embedding dims,
       weight and optimizer state layouts, dense keys and shapes, the optimizer's parameters),
       listing every difference.
    2. Every rank reads its part into staging buffers (not into the model); with ``verify``, the
       ranks check the data files' CRC-32 meanwhile (each rank a share, on a thread). Then every
       rank validates what it read (id-table states, routed ids, pickled objects).
    3. Only when every rank has done so without error, every rank commits its part.

    A failure on any rank at any step raises on every rank, at that step.

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
      (an Adam step count) take the max over the saved shards. Statistics restart from zero.

    The rest of the model is loaded with DCP (which also reshards TorchRec-sharded tensors), the
    optimizer state replaces the current one (lazily created state included) and the
    parameter-group hyperparameters are restored; gradients are cleared.

    Args:
        model (nn.Module): the ``DistributedModelParallel`` built as for training.
        optimizer (KeyedOptimizer | None): the optimizer built as for training; None loads the
            model only (hash tables keep their fused optimizer state, which is part of them).
        path (str | os.PathLike): a checkpoint directory.
        verify (bool): also check every file's CRC-32 before committing (reads each byte once
            more: +28% to +61% of a load from the page cache on the 2-core development machine,
            so off by default; the sizes, the model match and what was read are always checked,
            and nothing is committed before every rank validated its part). Checkpoints written
            before recsdk recorded their files (manifest version 1) are loaded without either check.

    Returns:
        dict: the ``extra`` this rank saved (rank 0's when the world size changed).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TypeError: an argument has the wrong type, or the model holds an unsharded
            ``HashEmbeddingBagCollection``.
        CheckpointError: a file is missing, truncated or damaged (checksum), cannot be read, or
            what was read is inconsistent; the message names the file where known. Also raised
            by the ranks whose part was fine when another rank failed, naming it and its error.
        ValueError: ``path`` is not a complete checkpoint, does not match the model, or its ids
            do not fit the new shards (``CheckpointError`` is a ``ValueError`` too).

    Example::

        extra = load_checkpoint(ddp_model, optimizer, latest_checkpoint("ckpt"))
        start_step = extra["step"]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    optimizer_state.check_optimizer(optimizer)
    modules = hash_modules(model)
    path = os.path.abspath(os.fspath(path))
    comm = Comm(host_group(modules), what=f"loading checkpoint {path!r}")
    for module in modules.values():
        module.release_finished_pins()

    manifest, reader_md, loads = comm.run(_check, model, optimizer, modules, path, verify, comm.rank, comm.world)
    checks = None
    if verify:  # the data files' checksums, while they are read into the staging buffers
        recorded: dict[str, dict[str, int]] = manifest.get("files", {})
        data = [name for name in recorded if name != _DCP_METADATA]
        checks = files.BackgroundChecksums(path, recorded, files.my_share(data, comm.rank, comm.world))

    def read(targets: dict[str, Any]) -> None:
        """Collective: DCP's read into ``targets``; a damaged file found meanwhile is the error to raise."""
        error: BaseException | None = None
        try:
            storage.read(targets, path, comm)
        except (Exception, dcp.CheckpointException) as e:
            error = e
        if error is not None and checks is not None:
            comm.run(checks.result)  # every rank names the damaged file, if one is
        comm.run(_raise, error)

    reshard = [t for t in loads if not t.exact]
    if reshard:
        read_resharded(reshard, reader_md, comm, read)
    staged = comm.run(_stage, model, optimizer, modules, manifest, reader_md, loads, comm)
    read(staged.targets)
    if checks is not None:
        comm.run(checks.result)
    decoded = comm.run(_validate_read, staged, loads, manifest, optimizer, path)
    comm.run(_commit, staged, loads, modules, manifest, optimizer, decoded)
    return decoded.extra


def _check(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    modules: Mapping[str, HashModule],
    path: str,
    verify: bool,
    rank: int,
    world: int,
) -> tuple[dict[str, Any], Mapping[str, Any], list[TableLoad]]:
    """Step 1: the files, then the checkpoint against the model. Reads only the manifest and metadata."""
    manifest = read_manifest(path)
    recorded: dict[str, dict[str, int]] = manifest.get("files", {})
    files.verify(path, recorded, checksums=False)
    if verify and _DCP_METADATA in recorded:  # small, and unpickled right away
        files.verify(path, recorded, [_DCP_METADATA], checksums=True)
    reader_md = storage.read_metadata(path).state_dict_metadata
    problems, loads = plan_load(model, optimizer, modules, manifest, reader_md, rank, world)
    if problems:
        raise ValueError(f"checkpoint {path!r} does not match the model:\n" + "\n".join(f"  - {p}" for p in problems))
    return manifest, reader_md, loads


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


@dataclass
class _ExactTable:
    """Staging buffers of a table read back row for row."""

    weight: torch.Tensor
    states: list[torch.Tensor]
    fused: dict[str, torch.Tensor]
    table_state: dict[str, torch.Tensor]


@dataclass
class _Staged:
    targets: dict[str, Any]  # what DCP reads into (staging buffers only)
    dense: list[tuple[Any, Any]] = field(default_factory=list)  # (model tensor, its staging buffer)
    exact: dict[tuple[str, str], _ExactTable] = field(default_factory=dict)
    extra_key: str = ""


@dataclass
class _Decoded:
    optimizer: optimizer_state.DecodedOptimizer | None
    extra: dict[str, Any]


def _stage(
    model: nn.Module,
    optimizer: KeyedOptimizer | None,
    modules: Mapping[str, HashModule],
    manifest: dict[str, Any],
    reader_md: Mapping[str, Any],
    loads: list[TableLoad],
    comm: Comm,
) -> _Staged:
    """Step 2a: a staging buffer for everything read row for row (dense state, same-layout shards, optimizer)."""
    staged = _Staged(targets={})
    hash_keys = hash_weight_keys(modules)
    for key, value in model.state_dict().items():
        if key in hash_keys:
            continue
        if compat.is_sharded_tensor(value):
            buffer: Any = compat.empty_sharded_like(value)
        elif isinstance(value, torch.Tensor):
            buffer = torch.empty_like(value)
        else:
            staged.targets["model/" + key] = value  # not a tensor: read, not restored (as DCP's own load)
            continue
        staged.targets["model/" + key] = buffer
        staged.dense.append((value, buffer))
    for t in loads:
        if not t.exact or t.name not in t.module.id_tables:
            continue
        prefix = hash_prefix(t.fqn, t.name, comm.rank)
        weight, states = t.module.staging_views(t.name)  # a file store's are files: it may exceed memory
        exact = _ExactTable(
            weight=weight,
            states=states,
            fused={k: torch.empty_like(v) for k, v in fused_counters(t.module)[t.name].items()},
            table_state={  # a checkpoint from before show/click scores has no score keys
                k: storage.empty_like_saved(reader_md[prefix + "table/" + k])
                for k in _TABLE_KEYS
                if prefix + "table/" + k in reader_md
            },
        )
        staged.targets[prefix + "weight"] = exact.weight
        for i, s in enumerate(exact.states):
            staged.targets[prefix + f"state{i}"] = s
        for skey, value in exact.fused.items():
            staged.targets[prefix + "fused/" + skey] = value
        for k, v in exact.table_state.items():
            staged.targets[prefix + "table/" + k] = v
        exact.table_state["capacity"] = torch.tensor(weight.shape[0], dtype=torch.int64)
        staged.exact[(t.fqn, t.name)] = exact
    if optimizer is not None:
        staged.targets.update(optimizer_state.targets(optimizer, modules, manifest, reader_md))
    source = comm.rank if int(manifest["world_size"]) == comm.world else 0
    staged.extra_key = f"extra/{source}"
    staged.targets[staged.extra_key] = b""
    return staged


def _validate_read(
    staged: _Staged,
    loads: list[TableLoad],
    manifest: dict[str, Any],
    optimizer: KeyedOptimizer | None,
    path: str,
) -> _Decoded:
    """Step 2b: check what was read can be committed: id-table states, resharded records, pickles."""
    try:
        for t in loads:
            if t.name not in t.module.id_tables:
                continue
            if t.exact:
                t.module.id_tables[t.name].check_state_dict(staged.exact[(t.fqn, t.name)].table_state)
            else:
                check_resharded(t)
        decoded = optimizer_state.decode(manifest, staged.targets) if optimizer is not None else None
        extra = pickle.loads(staged.targets[staged.extra_key])
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path!r}: what was read is inconsistent ({type(e).__name__}: {e}); its files may be "
            "damaged (load_checkpoint(..., verify=True) checks their checksums first); nothing was loaded"
        ) from e
    return _Decoded(decoded, extra)


def _commit(
    staged: _Staged,
    loads: list[TableLoad],
    modules: Mapping[str, HashModule],
    manifest: dict[str, Any],
    optimizer: KeyedOptimizer | None,
    decoded: _Decoded,
) -> None:
    """Step 3: every rank has read and validated its part; write it into the model and the optimizer."""
    with torch.no_grad():
        for t in loads:
            if t.name not in t.module.id_tables:
                continue
            if not t.exact:
                commit_resharded(t)
                continue
            exact = staged.exact[(t.fqn, t.name)]
            t.module.id_tables[t.name].load_state_dict(exact.table_state)
            weight, states = t.module.table_views()[t.name]
            weight.copy_(exact.weight)
            for s, value in zip(states, exact.states, strict=True):
                s.copy_(value)
            for skey, value in fused_counters(t.module)[t.name].items():
                value.copy_(exact.fused[skey])
        for module in modules.values():
            module.ledger.forgive_resets()
        for dest, buffer in staged.dense:
            if compat.is_sharded_tensor(dest):
                compat.copy_sharded_(dest, buffer)
            else:
                dest.copy_(buffer)
    if optimizer is not None:
        assert decoded.optimizer is not None
        optimizer_state.apply(optimizer, modules, manifest, decoded.optimizer)
