"""Reading published versions: :func:`read_version` (one version's files) and :func:`replay`
(a version rebuilt as a consumer applies the chain).

The format, the manifest and its checks are :mod:`recsdk.embedding.publication`; this module
reads the data files a checked manifest names (safetensors only: nothing in them runs), after
checking their sizes and CRC-32s (:func:`~recsdk.embedding.file_checksum.verify_files`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from recsdk.embedding.file_checksum import verify_files
from recsdk.embedding.publication import (
    PublicationError,
    check_parent,
    decode_rows,
    encode_rows,
    full_versions,
    latest_version,
    list_versions,
    read_manifest,
    version_path,
)

__all__ = ["PublishedTable", "PublishedVersion", "apply_delta", "read_version", "replay"]


@dataclass
class PublishedTable:
    """One table of a version (every rank's file together).

    Attributes:
        ids (torch.Tensor): int64 ``[n]`` ids written, ascending.
        rows (dict[str, torch.Tensor]): their rows as stored (``rows``; for uint8 also ``scale``, ``bias``).
        deleted (torch.Tensor): int64 ``[m]`` ids deleted (a delta), ascending.
    """

    ids: torch.Tensor
    rows: dict[str, torch.Tensor]
    deleted: torch.Tensor

    def embeddings(self) -> torch.Tensor:
        """Float32 ``[n, dim]`` rows (dequantized for uint8)."""
        return decode_rows(self.rows)


@dataclass
class PublishedVersion:
    """A version as :func:`read_version` read it.

    Attributes:
        version (int): its number.
        parent (int | None): the version a delta applies on top of (None for a full version).
        kind (str): ``"full"`` or ``"delta"``.
        step (int): the training step it was published at.
        dtype (str): the rows' dtype (``"float32"``, ``"float16"``, ``"uint8"``).
        tables (dict[str, PublishedTable]): per table name.
        dense (dict[str, torch.Tensor]): the dense part, by the unsharded model's state_dict names.
        manifest (dict): the manifest as written.
    """

    version: int
    parent: int | None
    kind: str
    step: int
    dtype: str
    tables: dict[str, PublishedTable]
    dense: dict[str, torch.Tensor]
    manifest: dict[str, Any] = field(repr=False)


def read_version(root: str | os.PathLike[str], version: int | None = None, *, verify: bool = True) -> PublishedVersion:
    """Read one version: its tables (every rank's file merged) and dense part.

    Args:
        root (str | os.PathLike): the publisher's root.
        version (int | None): the version; None: the latest complete one.
        verify (bool): check every file's size and CRC-32 against the manifest first.

    Returns:
        PublishedVersion: the version.

    Raises:
        PublicationError: the version is not complete, or a file is missing, of another size,
            or damaged (naming the file).

    Example::

        v = read_version("publish/")
        v.tables["user"].ids, v.tables["user"].embeddings(), v.tables["user"].deleted
    """
    if version is None:
        version = latest_version(root)
        if version is None:
            raise PublicationError(f"no complete version under {os.fspath(root)!r}")
    manifest = read_manifest(root, version)
    directory = version_path(root, version)
    files = manifest["files"]
    if verify:
        problems = verify_files(directory, files)
        if problems:
            raise PublicationError(f"version {directory!r} is damaged: " + "; ".join(problems))
    tables: dict[str, PublishedTable] = {}
    for name, info in manifest["tables"].items():
        parts = [_load(os.path.join(directory, f)) for f in info["files"]]
        tables[name] = _merge(parts, int(info["embedding_dim"]), manifest["dtype"])
    dense = _load(os.path.join(directory, manifest["dense"]["file"]))
    return PublishedVersion(
        version=int(manifest["version"]),
        parent=manifest["parent"],
        kind=manifest["kind"],
        step=int(manifest["step"]),
        dtype=manifest["dtype"],
        tables=tables,
        dense=dense,
        manifest=manifest,
    )


def replay(root: str | os.PathLike[str], version: int | None = None) -> PublishedVersion:
    """The state at ``version`` rebuilt as a consumer does: the latest full version at or before it,
    then each delta after it in order. A delta applies only on top of its parent.

    Args:
        root (str | os.PathLike): the publisher's root.
        version (int | None): the version to rebuild; None: the latest.

    Returns:
        PublishedVersion: a full version's content (kind ``"full"``, ``deleted`` empty) with the
        dense part and step of ``version``.

    Raises:
        PublicationError: no full version at or before ``version``, a missing version in the
            chain (named), or a damaged file.
    """
    versions = list_versions(root)
    if version is None:
        if not versions:
            raise PublicationError(f"no complete version under {os.fspath(root)!r}")
        version = versions[-1]
    fulls = full_versions(root, [v for v in versions if v <= version])
    if not fulls:
        raise PublicationError(f"no full version at or before {version} under {os.fspath(root)!r}")
    state = read_version(root, fulls[-1])
    for v in range(fulls[-1] + 1, version + 1):
        if v not in versions:
            raise PublicationError(f"version {v} is missing under {os.fspath(root)!r}: cannot rebuild {version}")
        delta = read_version(root, v)
        problem = check_parent(delta.manifest, state.manifest)
        if problem:
            raise PublicationError(problem)
        state = PublishedVersion(
            version=v,
            parent=None,
            kind="full",
            step=delta.step,
            dtype=delta.dtype,
            tables={name: apply_delta(state.tables[name], t) for name, t in delta.tables.items()},
            dense=delta.dense,
            manifest=delta.manifest,
        )
    return state


def apply_delta(base: PublishedTable, delta: PublishedTable) -> PublishedTable:
    """``base`` with ``delta``'s deleted ids dropped and its ids' rows written (ids ascending)."""
    drop = torch.cat([delta.deleted, delta.ids])
    keep = ~torch.isin(base.ids, drop)
    ids = torch.cat([base.ids[keep], delta.ids])
    order = torch.argsort(ids)
    rows = {k: torch.cat([v[keep], delta.rows[k]])[order] for k, v in base.rows.items()}
    return PublishedTable(ids[order], rows, torch.zeros(0, dtype=torch.int64))


def _load(path: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors: data only, nothing in it runs (a pickle is refused)."""
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as e:  # SafetensorError and the like: not the format's data file
        raise PublicationError(f"{path!r} is not a safetensors data file ({e}); nothing was loaded") from e


def _merge(parts: list[dict[str, torch.Tensor]], dim: int, dtype: str) -> PublishedTable:
    empty = encode_rows(torch.zeros(0, dim), dtype)
    if not parts:
        return PublishedTable(torch.zeros(0, dtype=torch.int64), empty, torch.zeros(0, dtype=torch.int64))
    ids = torch.cat([p["ids"] for p in parts])
    order = torch.argsort(ids)
    rows = {k: torch.cat([p[k] for p in parts])[order] for k in empty}
    deleted = torch.cat([p["deleted"] for p in parts]).sort().values
    return PublishedTable(ids[order], rows, deleted)
