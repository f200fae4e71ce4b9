"""What a published version holds of a sharded model, and the files it is written as.

The format itself (layout, manifest, row encodings, the reader) is
:mod:`recsdk.embedding.publication`; this module reads the model: its hash tables' configs,
its dense part, and the rows of a :class:`~recsdk.embedding.change_tracker.ChangeSnapshot`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from recsdk.embedding.change_tracker import ChangeSnapshot
from recsdk.embedding.publication import DENSE_FILE, describe_table, encode_rows, table_file
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.writing.errors import os_reason
from recsdk.sharding.writing.hash_modules import HashModule, hash_weight_keys

__all__ = ["dense_state", "table_descriptions", "write_dense", "write_table"]


def table_descriptions(modules: Mapping[str, HashModule]) -> dict[str, dict[str, Any]]:
    """Per table name, what a manifest records of its config (and a consumer needs to look it up).

    Raises:
        ValueError: two hash modules have a table of the same name, or there is no hash table.
    """
    out: dict[str, dict[str, Any]] = {}
    for fqn, module in modules.items():
        for name, cfg in module.table_configs.items():
            if name in out:
                raise ValueError(
                    f"table {name!r} is in hash modules {out[name]['module']!r} and {fqn!r}; "
                    "publishing needs distinct table names"
                )
            out[name] = describe_table(fqn, cfg)
    if not out:
        raise ValueError("the model holds no sharded hash table (HashEmbeddingBagCollection, HashEmbeddingCollection)")
    return out


def dense_state(model: nn.Module, modules: Mapping[str, HashModule], rank: int) -> dict[str, torch.Tensor]:
    """Every parameter and buffer outside the hash tables, whole, by the unsharded model's
    state_dict names (``DistributedModelParallel`` gives them so), as CPU copies on rank 0
    (``{}`` on the other ranks). Collective: a plain TorchRec table sharded over the ranks is
    gathered to rank 0 (its ``ShardedTensor.gather``, over the tensor's own group).

    Raises:
        TypeError: a tensor outside the hash tables is neither a tensor nor a ``ShardedTensor``.
    """
    hash_keys = hash_weight_keys(modules)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key in hash_keys:
            continue
        if compat.is_sharded_tensor(value):
            whole = torch.empty(value.size(), dtype=value.dtype) if rank == 0 else None
            value.gather(dst=0, out=whole)
            if whole is not None:
                out[key] = whole
            continue
        if type(value) is not torch.Tensor:  # a DTensor or another subclass, or no tensor
            raise TypeError(
                f"state_dict entry {key!r} is a {type(value).__name__}: a publication holds recsdk's hash tables "
                "by id and every other tensor whole (plain tensors, or ShardedTensors gathered)"
            )
        if rank == 0:
            out[key] = value.detach().to("cpu", copy=True).contiguous()
    return out


def write_table(directory: str, table: str, rank: int, snap: ChangeSnapshot, weights: torch.Tensor, dtype: str) -> str:
    """Write one table shard's file of a version: the snapshot's ids (ascending) with ``weights``
    (``[n, dim]``, in the snapshot's order) encoded as ``dtype``, and its deleted ids.

    Returns:
        str: the file's path relative to ``directory``.

    Raises:
        OSError: the write failed; names the file.
    """
    ids = snap.ids.to("cpu")
    order = torch.argsort(ids)
    tensors = encode_rows(weights.to("cpu")[order], dtype)
    tensors["ids"] = ids[order].contiguous()
    tensors["deleted"] = snap.deleted.to("cpu").sort().values.contiguous()
    name = table_file(table, rank)
    _save(os.path.join(directory, name), tensors, {"table": table, "rank": str(rank)})
    return name


def write_dense(directory: str, dense: Mapping[str, torch.Tensor]) -> str:
    """Write the dense part; returns the file's path relative to ``directory``."""
    _save(os.path.join(directory, DENSE_FILE), dict(dense), {})
    return DENSE_FILE


def _save(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file, flushed to disk, with the mode a new file gets (``0o666`` less the
    umask: safetensors writes ``0o600``, which a serving host running as another user cannot read)."""
    from safetensors.torch import save_file

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(tensors, path, metadata=metadata)
        with open(path, "rb+") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
    except OSError as e:
        raise OSError(e.errno, f"{os_reason(e)} writing {path!r}; the version was not published") from e


def _umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; where there is
    none, set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
