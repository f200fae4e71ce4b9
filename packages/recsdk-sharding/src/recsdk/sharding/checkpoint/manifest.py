"""The checkpoint format: the keys of its DCP state dict, and its manifest ``recsdk_checkpoint.json``.

DCP keys:

* ``hash/<module fqn>/<table>/<rank>/``: one hash table shard, ``weight``, ``state<i>`` (per-row
  fused optimizer state), ``fused/<key>`` (fused optimizer counters not per row) and
  ``table/<key>`` (the id table's :meth:`~recsdk.embedding.IdTable.state_dict`);
* ``model/<key>``: the rest of ``model.state_dict()``;
* ``optim/<param key>/<state key>`` and ``optim_param_groups``: the optimizer;
* ``extra/<rank>``: each rank's ``extra``, pickled.

The manifest, written last, makes the directory a checkpoint: the format and version, the
world size, per hash table its layout and shards, the optimizer state's kinds, and (from
version 2) every file's size and CRC-32.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from recsdk.sharding.checkpoint.layout import layouts
from recsdk.sharding.writing.atomic_directory import PARTIAL
from recsdk.sharding.writing.files import verify
from recsdk.sharding.writing.hash_modules import HashModule

__all__ = [
    "CHECKPOINT_MANIFEST",
    "build_manifest",
    "hash_prefix",
    "latest_checkpoint",
    "optim_key",
    "read_manifest",
]

CHECKPOINT_MANIFEST = "recsdk_checkpoint.json"
"""File name of the manifest; a checkpoint directory is complete exactly when it holds this file."""

FORMAT = "recsdk.sharding.checkpoint"
VERSION = 2
"""Version written. 2 adds ``files`` (size and CRC-32 of every file); version 1 is still read."""
READABLE_VERSIONS = (1, 2)


def hash_prefix(fqn: str, table: str, rank: int) -> str:
    """DCP key prefix of one hash table shard."""
    return f"hash/{fqn}/{table}/{rank}/"


def optim_key(pkey: str, skey: str) -> str:
    """DCP key of one optimizer state entry."""
    return f"optim/{pkey}/{skey}"


def build_manifest(
    everyone: list[dict[str, Any]],
    modules: Mapping[str, HashModule],
    world: int,
    with_optimizer: bool,
    files: dict[str, dict[str, int]],
) -> dict[str, Any]:
    """The manifest from every rank's description of what it saved (see ``save.collect``)."""
    hash_info: dict[str, dict[str, Any]] = {}
    for fqn, module in modules.items():
        entry: dict[str, Any] = {}
        for name, layout in layouts(module).items():
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
                "score_counters": first.get("score_counters", 0),
                "scores_per_row": first.get("scores_per_row", False),
                "shards": [
                    {k: s.get(k, 0) for k in ("rank", "row_offset", "rows", "num_ids", "step", "score_ref")}
                    for s in shards
                ],
            }
        hash_info[fqn] = entry
    optimizer: dict[str, dict[str, str]] | None = None
    if with_optimizer:
        optimizer = {}
        for local in everyone:
            for pkey, kinds in local["optimizer"].items():
                optimizer.setdefault(pkey, {}).update(kinds)
    return {
        "format": FORMAT,
        "version": VERSION,
        "complete": True,
        "world_size": world,
        "created_unix_ns": time.time_ns(),
        "hash_modules": hash_info,
        "optimizer_state": optimizer,
        "files": files,
    }


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a complete checkpoint of a version this recsdk reads.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a checkpoint: a checkpoint is a directory written by save_checkpoint")
    manifest_path = os.path.join(path, CHECKPOINT_MANIFEST)
    if not os.path.isfile(manifest_path):
        if PARTIAL in os.path.basename(path) or os.path.isfile(os.path.join(path, ".metadata")):
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
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path!r}: {CHECKPOINT_MANIFEST} is not a recsdk checkpoint manifest")
    if manifest.get("version") not in READABLE_VERSIONS or not manifest.get("complete"):
        raise ValueError(
            f"{path!r}: checkpoint format version {manifest.get('version')!r} (complete={manifest.get('complete')!r}); "
            f"this recsdk reads versions {list(READABLE_VERSIONS)}"
        )
    files = manifest.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("crc32"), int)
        for v in files.values()
    ):
        raise ValueError(f"{path!r}: {CHECKPOINT_MANIFEST} has a malformed 'files' entry")
    return manifest


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The most recently saved complete checkpoint directly under ``root``, or None.

    Skipped: incomplete (``.partial-``) directories, anything that is not a checkpoint, and
    checkpoints whose manifest lists a file that is missing or has another size (a truncated
    copy). Checksums are not read here; :func:`load_checkpoint` checks them.

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
            manifest = read_manifest(candidate)
            verify(candidate, manifest.get("files", {}), checksums=False)
        except (OSError, ValueError):
            continue
        key = (int(manifest.get("created_unix_ns", 0)), name)
        if best is None or key > best:
            best = key
    return None if best is None else os.path.join(root, best[1])
