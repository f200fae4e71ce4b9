"""``Publisher``: a sharded model published to serving as numbered versions, full or deltas.

Every :meth:`Publisher.publish` writes the next version under the root (the format:
:mod:`recsdk.embedding.publication`). Its steps, on every rank:

1. rank 0 reads the root's latest version; the model is checked against it (another model's
   publications are refused, naming every difference, before anything is written); the kind
   is agreed: full for version 0, every ``full_every``-th version, a new dtype, and whenever
   some table's change tracker cannot prove it went out in the latest version (a new job, a
   checkpoint load, a failed publish of a full version);
2. each rank snapshots its id tables' changes under its host stage's lock
   (:meth:`~recsdk.sharding.HostShardedModule.change_snapshots`), so a pipeline's host thread
   keeps mapping meanwhile; training is between steps, so the rows do not change;
3. each rank writes its table files into the version's partial directory (rank 0 also the dense
   part), checksums them, and rank 0 writes the manifest last (built by the format's
   :func:`~recsdk.embedding.publication.build_manifest`: with the CRC-32 of its own content and,
   for a delta, its parent's manifest's) and renames the directory
   (:func:`~recsdk.sharding.writing.atomic_directory.write_directory`, as checkpoints and exports);
4. only then do the trackers commit (what the version held counts as published). A failure on
   any rank raises on every rank, removes the partial directory and commits nothing: the next
   version carries those changes.

The publisher's collectives run on a gloo group of its own, so that a pipeline's host thread,
running the id all-to-alls on the host group, never interleaves with them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsdk.embedding.change_tracker import ChangeSnapshot
from recsdk.embedding.publication import (
    PUBLICATION_MANIFEST,
    PublicationError,
    build_manifest,
    differences,
    full_versions,
    list_versions,
    read_manifest,
    version_path,
)
from recsdk.sharding.publishing.publication_files import dense_state, table_descriptions, write_dense, write_table
from recsdk.sharding.writing import files
from recsdk.sharding.writing.atomic_directory import write_directory
from recsdk.sharding.writing.comm import Comm
from recsdk.sharding.writing.hash_modules import HashModule, hash_modules

__all__ = ["PublishRecord", "Publisher"]

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.uint8: "uint8"}


@dataclass(frozen=True)
class PublishRecord:
    """One version a :class:`Publisher` wrote (all ranks together).

    Attributes:
        version (int): its number.
        kind (str): ``"full"`` or ``"delta"``.
        step (int): the training step given to :meth:`Publisher.publish`.
        ids (int): ids written with their rows.
        deleted (int): ids deleted (a delta).
        bytes (int): bytes of its files.
        seconds (float): wall time of the publish on this rank.
    """

    version: int
    kind: str
    step: int
    ids: int
    deleted: int
    bytes: int
    seconds: float


class Publisher:
    """Publishes a sharded model's hash tables and dense part as versions under ``root``.

    Collective like the checkpoint functions: every rank constructs it at the same point, and
    calls :meth:`publish` between training steps (a plain loop, or between a
    ``HybridTrainPipelineSparseDist``'s ``progress`` calls: batches mapped ahead are fine).
    Construction starts change tracking on every id table (a few bytes per row, a stamp per
    trained row per step).

    Args:
        model (nn.Module): the ``DistributedModelParallel`` with recsdk's sharded hash modules.
        root (str | os.PathLike): the directory of the versions (created if missing; its parent
            must exist); the same path on every rank, on a file system all share.
        full_every (int): every ``full_every``-th version (0, ``full_every``, ...) is full.
        dtype (torch.dtype): the rows' dtype: ``torch.float32``, ``torch.float16``, or
            ``torch.uint8`` (FBGEMM's row-wise 8-bit quantization with a float16 scale and bias
            per row, as TorchRec's quantized tables).
        keep (int | None): versions to keep; None keeps those since the latest full one. Never
            removes one needed to rebuild the latest from its full version.

    Raises:
        TypeError: an argument of the wrong type, an unsharded hash module, or a sharded tensor
            outside the hash tables.
        ValueError: a bad ``full_every``/``keep``/``dtype``; tables of the same name in two
            modules; ``root`` holding another model's versions (every difference named).

    Example::

        publisher = Publisher(ddp_model, "publish/", full_every=24, dtype=torch.float16)
        for step, batch in enumerate(loader):
            train_step(batch)
            if step % 1000 == 999:
                version = publisher.publish(step=step)
    """

    def __init__(
        self,
        model: nn.Module,
        root: str | os.PathLike[str],
        *,
        full_every: int = 24,
        dtype: torch.dtype = torch.float32,
        keep: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(root, str | os.PathLike):
            raise TypeError(f"root must be a path, got {type(root).__name__}")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be an int >= 1, got {full_every!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.uint8, got {dtype!r}")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
        self._model = model
        self._modules: dict[str, HashModule] = hash_modules(model, what="publications")
        self._tables = table_descriptions(self._modules)
        self.root = os.path.abspath(os.fspath(root))
        self.full_every = full_every
        self.dtype = _DTYPES[dtype]
        self.keep = keep
        self.records: list[PublishRecord] = []
        """Every version this publisher wrote, oldest first."""
        distributed = dist.is_available() and dist.is_initialized()
        self._group = dist.new_group(backend="gloo") if distributed else None
        comm = self._comm()
        dense = dense_state(model, self._modules, comm.rank)
        problems = comm.broadcast(comm.run(self._on_rank0, comm, self._check_root, dense))
        if problems:
            raise ValueError(
                f"publish root {self.root!r} holds another model's versions: " + "; ".join(problems) + ". "
                "Publish this model to another root"
            )
        for module in self._modules.values():
            module.track_changes()

    def publish(self, *, step: int) -> int:
        """Write the next version (collective: every rank, between steps).

        Args:
            step (int): the training step, recorded in the manifest.

        Returns:
            int: the version written.

        Raises:
            ValueError: ``step`` is not an int >= 0, or the root now holds another model's
                versions (nothing written).
            OSError: writing failed on this rank (e.g. ``errno.ENOSPC``), naming the file;
                ``CheckpointError`` on the other ranks. Nothing is published, the partial
                directory is removed and the changes go into the next version.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        started = time.time()
        comm = self._comm()
        dense = dense_state(self._model, self._modules, comm.rank)
        latest_token = self._tokens()
        plan = comm.broadcast(comm.run(self._on_rank0, comm, self._plan, dense))
        if plan["problems"]:
            raise ValueError(
                f"publish root {self.root!r} holds another model's versions: " + "; ".join(plan["problems"])
            )
        # A rank holding no table (table-wise) has nothing to prove.
        continuous = (
            plan["token"] is not None
            and plan["dtype"] == self.dtype
            and all(token == plan["token"] for tokens in comm.gather(latest_token) for token in tokens)
        )
        version = plan["version"]
        full = version % self.full_every == 0 or not continuous
        snapshots = comm.run(self._snapshots, full)

        def fill(tmp: str) -> dict[str, Any]:
            written = comm.run(self._write, tmp, snapshots, dense, comm.rank)
            everyone = comm.gather(written)
            records = {
                name: r
                for part in comm.gather(comm.run(files.describe, tmp, written["files"]))
                for name, r in part.items()
            }
            return build_manifest(
                version=version,
                step=step,
                token=plan["new_token"],
                dtype=self.dtype,
                world_size=comm.world,
                tables=self._tables,
                written=_tables_written(everyone, self._tables),
                dense=dense,
                files=records,
                parent_manifest_crc32=None if full else plan["manifest_crc32"],
            )

        manifest = write_directory(version_path(self.root, version), comm, "publication", PUBLICATION_MANIFEST, fill)
        for fqn, module in self._modules.items():
            module.commit_changes(snapshots[fqn], plan["new_token"])
        if comm.rank == 0:
            self._retire()
        record = PublishRecord(
            version=version,
            kind="full" if full else "delta",
            step=step,
            ids=sum(t["upserted"] for t in manifest["tables"].values()),
            deleted=sum(t["deleted"] for t in manifest["tables"].values()),
            bytes=sum(int(r["size"]) for r in manifest["files"].values()),
            seconds=time.time() - started,
        )
        self.records.append(record)
        return version

    # ------------------------------------------------------------------ steps

    def _comm(self) -> Comm:
        return Comm(self._group, what=f"publishing to {self.root!r}")

    @staticmethod
    def _on_rank0(comm: Comm, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on rank 0 (run through ``comm.run`` by every rank: its failure is agreed)."""
        return fn(*args) if comm.rank == 0 else None

    def _tokens(self) -> set[str | None]:
        """The tokens of the versions this rank's tables last went out in."""
        return {
            t.changes.token if t.changes is not None else None
            for m in self._modules.values()
            for t in m.id_tables.values()
        }

    def _check_root(self, dense: dict[str, torch.Tensor]) -> list[str]:
        """Rank 0: create the root; how this model differs from the latest version's."""
        return self._plan(dense)["problems"]

    def _plan(self, dense: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Rank 0: create the root; how this model differs from the latest version's, the next
        version's number, the latest's token and dtype, a new token."""
        os.makedirs(self.root, exist_ok=True)
        versions = list_versions(self.root)
        latest = read_manifest(self.root, versions[-1]) if versions else {}
        shapes = {key: list(value.shape) for key, value in dense.items()}
        return {
            "problems": differences(latest, self._tables, shapes) if versions else [],
            "version": versions[-1] + 1 if versions else 0,
            "token": latest.get("token"),
            "dtype": latest.get("dtype"),
            "manifest_crc32": latest.get("manifest_crc32"),  # a delta's parent's
            "new_token": secrets.token_hex(8),
        }

    def _snapshots(self, full: bool) -> dict[str, dict[str, ChangeSnapshot]]:
        """Per hash module, what this rank's tables put in the version (see ``change_snapshots``)."""
        return {fqn: module.change_snapshots(full=full) for fqn, module in self._modules.items()}

    def _write(
        self, tmp: str, snapshots: dict[str, dict[str, ChangeSnapshot]], dense: dict[str, torch.Tensor], rank: int
    ) -> dict[str, Any]:
        """This rank's files of the version: every file's name, and per table its file and counts."""
        names: list[str] = []
        tables: dict[str, dict[str, Any]] = {}
        for fqn, module in self._modules.items():
            for table, snap in snapshots[fqn].items():
                weights = module.read_rows(table, snap.rows)
                name = write_table(tmp, table, rank, snap, weights, self.dtype)
                names.append(name)
                tables[table] = {
                    "files": [name],
                    "upserted": int(snap.ids.numel()),
                    "deleted": int(snap.deleted.numel()),
                }
        if rank == 0:
            names.append(write_dense(tmp, dense))
        return {"files": names, "tables": tables}

    def _retire(self) -> None:
        """Rank 0, after publishing: remove the versions retention no longer keeps (best effort,
        nothing raised: the version is published; the manifest goes first, so a half-removed
        version is never taken for a complete one)."""
        try:
            versions = list_versions(self.root)
            fulls = full_versions(self.root, versions)
        except (OSError, PublicationError):
            return
        floor = max(fulls) if fulls else versions[0]  # the latest full version, and every delta after it
        if self.keep is not None:
            floor = min(floor, versions[max(0, len(versions) - self.keep)])
        for v in versions:
            if v >= floor:
                break
            path = version_path(self.root, v)
            try:
                os.remove(os.path.join(path, PUBLICATION_MANIFEST))
            except OSError:
                continue
            shutil.rmtree(path, ignore_errors=True)


def _tables_written(everyone: list[dict[str, Any]], tables: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per table, what every rank wrote of it (``_write``'s parts together): its files, and the
    ids upserted and deleted summed (a rank holding no shard of the table wrote nothing)."""
    out: dict[str, dict[str, Any]] = {name: {"files": [], "upserted": 0, "deleted": 0} for name in tables}
    for part in everyone:
        for name, w in part["tables"].items():
            out[name]["files"] += w["files"]
            out[name]["upserted"] += w["upserted"]
            out[name]["deleted"] += w["deleted"]
    return out
