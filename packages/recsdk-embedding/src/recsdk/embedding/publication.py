"""The publication format: versions of a model's hash tables and dense part, for serving.

A publisher (:class:`recsdk.sharding.Publisher`) writes one directory per version under a root;
a consumer (a serving process) reads them with :func:`~recsdk.embedding.publication_reader.read_version`
and rebuilds any version with :func:`~recsdk.embedding.publication_reader.replay`. Data only:
safetensors files and JSON, nothing a reader has to execute. This module is the format: the
layout, the manifest (:func:`build_manifest` writes it, :func:`read_manifest` reads and checks
it), the row encodings, and what a model is compared on.

Layout of a version::

    <root>/00000005/manifest.json                       # written last: the version is complete
    <root>/00000005/dense.safetensors                   # every parameter and buffer outside the hash tables
    <root>/00000005/tables/<table>/rank-00001.safetensors   # one file per table and rank holding a shard

A table file holds ``ids`` (int64 ``[n]``, ascending) with ``rows`` (``[n, dim]``, float32 or
float16; or uint8 with ``scale`` and ``bias`` float16 ``[n]``: FBGEMM's row-wise 8-bit
quantization as TorchRec's quantized tables hold it, ``row = rows * scale + bias``, at most half
a step ``scale / 2`` from the value trained), and ``deleted`` (int64 ``[m]``, ascending). A
**full** version holds every id of every table (``deleted`` empty); a **delta** the ids whose
rows changed since its parent version (``parent = version - 1``) and the ids deleted since it.
Apply a delta by dropping its deleted ids, then writing its ids' rows. The manifest records the
version, its parent, its kind, the training step, the rows' dtype, per table its config and
counts, the dense tensors, and every file's size and CRC-32.

A chain of trust: the manifest records the CRC-32 of its own content (``manifest_crc32``, see
:func:`manifest_checksum`) and a delta the one of its parent's manifest
(``parent_manifest_crc32``), so every file a server applies is covered by a checksum reached
from the full version it started from. :func:`read_manifest` refuses a manifest whose checksum,
version (its directory's name), kind and parent disagree, whose files' paths leave the version
directory, or that is reached through a symbolic link; the reader checks every data file's size and
CRC-32 and refuses one reached through a link
(:func:`~recsdk.embedding.file_checksum.verify_files`); :func:`check_parent` checks a delta
against the version it is applied on.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "PUBLICATION_FORMAT",
    "PUBLICATION_MANIFEST",
    "PublicationError",
    "build_manifest",
    "check_parent",
    "decode_rows",
    "describe_table",
    "differences",
    "encode_rows",
    "full_versions",
    "latest_version",
    "list_versions",
    "manifest_checksum",
    "read_manifest",
    "table_file",
    "version_path",
]

PUBLICATION_FORMAT = "recsdk.publication"
PUBLICATION_MANIFEST = "manifest.json"
DENSE_FILE = "dense.safetensors"
FORMAT_VERSION = 2
"""2: the manifest records its own CRC-32 and a delta its parent's (1 had neither: refused)."""
ROW_DTYPES = {"float32": torch.float32, "float16": torch.float16, "uint8": torch.uint8}
"""The dtypes rows are published in, by the name the manifest records."""

_VERSION_NAME = re.compile(r"^\d{8}$")


class PublicationError(RuntimeError):
    """A version is missing, incomplete or damaged (the message names the file or version)."""


def version_path(root: str | os.PathLike[str], version: int) -> str:
    """The directory of ``version`` under ``root``: its number zero-padded to 8 digits."""
    return os.path.join(os.fspath(root), f"{version:08d}")


def table_file(table: str, rank: int) -> str:
    """A table file's path relative to its version directory."""
    return f"tables/{table}/rank-{rank:05d}.safetensors"


def list_versions(root: str | os.PathLike[str]) -> list[int]:
    """The versions under ``root`` with a manifest, ascending; ``[]`` if none (or no root).

    A version whose manifest cannot even be looked at (an I/O or permission error), or that is
    reached through a symbolic link, is listed too: :func:`read_manifest` then names what is wrong
    with it, rather than the version going unseen.

    Raises:
        PublicationError: ``root`` exists but cannot be listed (naming it and why).
    """
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise PublicationError(f"publication root {os.fspath(root)!r} cannot be listed: {e.strerror or e}") from e
    out = []
    for name in names:
        if not _VERSION_NAME.match(name):
            continue
        try:
            os.lstat(os.path.join(root, name, PUBLICATION_MANIFEST))
        except (FileNotFoundError, NotADirectoryError):
            continue  # not complete (or not a directory)
        except OSError:
            pass  # unreadable: listed, read_manifest names it
        out.append(int(name))
    return sorted(out)


def full_versions(root: str | os.PathLike[str], versions: list[int] | None = None) -> list[int]:
    """The full versions among ``versions`` (default: every complete version under ``root``), ascending.

    Raises:
        PublicationError: a manifest cannot be read as a publication's.
    """
    candidates = list_versions(root) if versions is None else versions
    return [v for v in candidates if read_manifest(root, v)["kind"] == "full"]


def latest_version(root: str | os.PathLike[str]) -> int | None:
    """The newest complete version under ``root``, or None."""
    versions = list_versions(root)
    return versions[-1] if versions else None


def build_manifest(
    *,
    version: int,
    step: int,
    token: str,
    dtype: str,
    world_size: int,
    tables: Mapping[str, Mapping[str, Any]],
    written: Mapping[str, Mapping[str, Any]],
    dense: Mapping[str, torch.Tensor],
    files: Mapping[str, Mapping[str, int]],
    parent_manifest_crc32: int | None,
) -> dict[str, Any]:
    """A version's manifest, as :func:`read_manifest` reads it back: with its own CRC-32.

    Args:
        version (int): the version's number (its directory's name).
        step (int): the training step it was published at.
        token (str): the publisher's token for this version (what a delta's tables went out in).
        dtype (str): the rows' dtype, a key of :data:`ROW_DTYPES`.
        world_size (int): the ranks that wrote it.
        tables (Mapping): per table name, what :func:`describe_table` gives.
        written (Mapping): per table name, what the ranks wrote of it: ``files`` (every rank's
            files, each a :func:`table_file` path), ``upserted`` and ``deleted`` (id counts).
        dense (Mapping[str, torch.Tensor]): the dense part, by state_dict name (its shapes and
            dtypes are recorded; the tensors are in :data:`DENSE_FILE`).
        files (Mapping): ``{path: {"size": bytes, "crc32": checksum}}`` of every file of the version.
        parent_manifest_crc32 (int | None): a delta's parent's manifest's CRC-32 (``parent`` is
            ``version - 1``); None for a full version.

    Returns:
        dict: the manifest, ``manifest_crc32`` included.

    Raises:
        ValueError: a table without its ``written`` part, a ``dtype`` the format does not
            have, or a delta of version 0.

    Example::

        manifest = build_manifest(version=3, step=900, token=token, dtype="float16", world_size=2,
                                  tables=descriptions, written=written, dense=dense, files=records,
                                  parent_manifest_crc32=read_manifest(root, 2)["manifest_crc32"])
    """
    if dtype not in ROW_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(ROW_DTYPES)}, got {dtype!r}")
    missing = sorted(set(tables) - set(written))
    if missing:
        raise ValueError(f"written has no part for the tables {missing}; every table of tables needs one")
    full = parent_manifest_crc32 is None
    if not full and version < 1:
        raise ValueError(f"version {version} cannot be a delta (parent_manifest_crc32 given): it has no parent")
    manifest: dict[str, Any] = {
        "format": PUBLICATION_FORMAT,
        "format_version": FORMAT_VERSION,
        "version": version,
        "parent": None if full else version - 1,
        "parent_manifest_crc32": parent_manifest_crc32,
        "kind": "full" if full else "delta",
        "step": step,
        "token": token,
        "created_unix": time.time(),
        "world_size": world_size,
        "dtype": dtype,
        "tables": {
            name: {
                **description,
                "upserted": int(written[name]["upserted"]),
                "deleted": int(written[name]["deleted"]),
                "files": sorted(written[name]["files"]),
            }
            for name, description in tables.items()
        },
        "dense": {
            "file": DENSE_FILE,
            "tensors": {
                k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in dense.items()
            },
        },
        "files": dict(sorted(files.items())),
    }
    manifest["manifest_crc32"] = manifest_checksum(manifest)
    return manifest


def read_manifest(root: str | os.PathLike[str], version: int) -> dict[str, Any]:
    """A version's manifest, checked to be a publication's, and whole (see the module).

    Raises:
        PublicationError: the version is not complete; it is unreadable (an I/O or permission
            error, named); it or its manifest is a symbolic link; its manifest is not a
            publication's, or its CRC-32, version, kind, parent or file paths disagree (named).
    """
    directory = version_path(root, version)
    path = os.path.join(directory, PUBLICATION_MANIFEST)
    where = f"version {version} under {os.fspath(root)!r}"
    try:
        if stat.S_ISLNK(os.lstat(directory).st_mode):
            raise PublicationError(f"{where} is a symbolic link ({directory!r}); refused: a version is a directory")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise PublicationError(
            f"{where} is not published (no {path!r}); complete versions: {list_versions(root)}"
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PublicationError(f"{where}: {path!r} is a symbolic link; refused") from None
        raise PublicationError(f"{where} is unreadable: {path!r}: {e.strerror or e}") from e
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise PublicationError(f"{path!r} cannot be read as JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != PUBLICATION_FORMAT:
        raise PublicationError(f"{path!r} is not a recsdk publication manifest (format {PUBLICATION_FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise PublicationError(
            f"{path!r} has format_version {manifest.get('format_version')!r}; this recsdk reads {FORMAT_VERSION}"
        )
    problems = _manifest_problems(manifest, version)
    if problems:
        raise PublicationError(f"{path!r} is damaged: " + "; ".join(problems))
    return manifest


def manifest_checksum(manifest: Mapping[str, Any]) -> int:
    """The CRC-32 a manifest records of itself: of its content without ``manifest_crc32``, as
    compact JSON with sorted keys (UTF-8)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")) & 0xFFFFFFFF


def check_parent(manifest: Mapping[str, Any], parent: Mapping[str, Any] | None) -> str | None:
    """What is wrong with applying the version of ``manifest`` on top of the one of ``parent``
    (None: no version served or read before it); None when nothing is.

    A full version applies on anything; a delta on its parent, the very version it was
    published on top of (its manifest's CRC-32 as the delta records it).
    """
    if manifest["kind"] == "full":
        return None
    v, p = manifest["version"], manifest["parent"]
    if parent is None or parent["version"] != p:
        have = "no version" if parent is None else f"version {parent['version']}"
        return f"version {v} is a delta on top of version {p}, which is missing ({have} before it)"
    if manifest["parent_manifest_crc32"] != parent["manifest_crc32"]:
        return (
            f"version {v} was published on top of a version {p} whose manifest CRC-32 was "
            f"{manifest['parent_manifest_crc32']:08x}; version {p} here has {parent['manifest_crc32']:08x} "
            "(replaced since): the chain is broken"
        )
    return None


def _manifest_problems(manifest: dict[str, Any], version: int) -> list[str]:
    """How a manifest read from ``version``'s directory disagrees with itself and its place."""
    recorded = manifest.get("manifest_crc32")
    if not isinstance(recorded, int) or recorded != manifest_checksum(manifest):
        return [f"its content has another CRC-32 than the {recorded!r} it records (edited or damaged)"]
    problems = []
    if manifest.get("version") != version:
        problems.append(f"it records version {manifest.get('version')!r} in the directory of version {version}")
    kind, parent, parent_crc = manifest.get("kind"), manifest.get("parent"), manifest.get("parent_manifest_crc32")
    if kind == "full" and (parent is not None or parent_crc is not None):
        problems.append(f"a full version with parent {parent!r} (parent CRC-32 {parent_crc!r}); a full one has none")
    elif kind == "delta" and (parent != version - 1 or not isinstance(parent_crc, int)):
        problems.append(
            f"a delta with parent {parent!r} (parent CRC-32 {parent_crc!r}); a delta's parent is "
            f"{version - 1}, with its manifest's CRC-32"
        )
    elif kind not in ("full", "delta"):
        problems.append(f"kind {kind!r}; a version is 'full' or 'delta'")
    files = manifest.get("files")
    if not isinstance(files, dict):
        return [*problems, "no files record"]
    for name, record in files.items():
        if not _inside(name):
            problems.append(f"file {name!r} is not a plain relative path inside the version directory")
        elif not (isinstance(record, dict) and all(isinstance(record.get(k), int) for k in ("size", "crc32"))):
            problems.append(f"file {name!r} has no size and CRC-32")
    named = [f for info in manifest.get("tables", {}).values() for f in info.get("files", [])]
    named.append(manifest.get("dense", {}).get("file"))
    for name in named:
        if name not in files:
            problems.append(f"file {name!r} is read but has no size and CRC-32 recorded")
    return problems


def _inside(name: object) -> bool:
    """Whether ``name`` is a relative path that stays inside its directory (no ``..``, not absolute)."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name or "\x00" in name:
        return False
    return os.path.normpath(name) == name and not any(part in ("..", ".") for part in name.split("/"))


def describe_table(module: str, config: Any) -> dict[str, Any]:
    """What a manifest records of a hash table's config (and a consumer checks against its model).

    Args:
        module (str): the hash module's name in the model (``"ebc"``).
        config: its ``HashEmbeddingBagConfig`` (kind ``"bag"``) or ``HashEmbeddingConfig`` (``"unpooled"``).
    """
    from recsdk.embedding.config import HashEmbeddingBagConfig

    bag = isinstance(config, HashEmbeddingBagConfig)
    return {
        "module": module,
        "kind": "bag" if bag else "unpooled",
        "embedding_dim": int(config.embedding_dim),
        "num_embeddings": int(config.num_embeddings),
        "feature_names": list(config.feature_names),
        "pooling": config.pooling.name if bag else None,
        "data_type": config.data_type.name,
    }


def differences(
    manifest: Mapping[str, Any], tables: Mapping[str, Mapping[str, Any]], dense: Mapping[str, Sequence[int]]
) -> list[str]:
    """How a model differs from the one a version's manifest describes (``[]``: the same model).

    Compared: the table names, each table's kind, dim, features and pooling (``tables``: per
    name, what :func:`describe_table` gives), and the dense tensors' names and shapes (``dense``:
    name -> shape); a table's capacity may differ.
    """
    where = f"version {manifest.get('version')}"
    problems: list[str] = []
    theirs: Mapping[str, Mapping[str, Any]] = manifest.get("tables", {})
    for name in sorted(set(theirs) - set(tables)):
        problems.append(f"table {name!r} is in {where}, not in this model")
    for name in sorted(set(tables) - set(theirs)):
        problems.append(f"table {name!r} is in this model, not in {where}")
    for name in sorted(set(tables) & set(theirs)):
        for key in ("kind", "embedding_dim", "feature_names", "pooling"):
            if theirs[name].get(key) != tables[name][key]:
                theirs_value, ours = theirs[name].get(key), tables[name][key]
                problems.append(f"table {name!r}: {key} is {theirs_value!r} in {where}, {ours!r} in this model")
    published = manifest.get("dense", {}).get("tensors", {})
    for key in sorted(set(published) - set(dense)):
        problems.append(f"dense tensor {key!r} is in {where}, not in this model")
    for key in sorted(set(dense) - set(published)):
        problems.append(f"dense tensor {key!r} is in this model, not in {where}")
    for key in sorted(set(dense) & set(published)):
        if list(published[key]["shape"]) != list(dense[key]):
            problems.append(
                f"dense tensor {key!r}: shape {list(published[key]['shape'])} in {where}, "
                f"{list(dense[key])} in this model"
            )
    return problems


def encode_rows(weights: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """Rows as published in ``dtype``: ``{"rows"}``, or ``{"rows", "scale", "bias"}`` for uint8.

    Args:
        weights (torch.Tensor): float ``[n, dim]`` rows.
        dtype (str): ``"float32"``, ``"float16"`` or ``"uint8"``: FBGEMM's row-wise 8-bit
            quantization with a float16 scale and bias per row (``FloatToFusedNBitRowwiseQuantizedSBHalf``,
            the rows of TorchRec's quantized tables and FBGEMM's inference kernels):
            ``row = rows * scale + bias``, at most half a step (``scale / 2``) from ``weights``.
    """
    weights = weights.detach().to("cpu")
    if dtype != "uint8":
        return {"rows": weights.to(ROW_DTYPES[dtype]).contiguous()}
    n, dim = weights.shape
    if n == 0:
        empty = torch.zeros(0, dtype=torch.float16)
        return {"rows": torch.zeros(0, dim, dtype=torch.uint8), "scale": empty, "bias": empty.clone()}
    fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(weights.float().contiguous(), 8)
    scale_bias = fused[:, dim:].contiguous().view(torch.float16)
    return {"rows": fused[:, :dim].contiguous(), "scale": scale_bias[:, 0].clone(), "bias": scale_bias[:, 1].clone()}


def decode_rows(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float32 ``[n, dim]`` rows from what :func:`encode_rows` made."""
    rows = tensors["rows"]
    if rows.dtype != torch.uint8:
        return rows.float()
    return rows.float() * tensors["scale"].float().unsqueeze(1) + tensors["bias"].float().unsqueeze(1)
