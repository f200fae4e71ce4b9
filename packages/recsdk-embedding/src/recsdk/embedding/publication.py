"""The publication format: versions of a model's hash tables and dense part, for serving.

A publisher (:class:`recsdk.sharding.Publisher`) writes one directory per version under a root;
a consumer (a serving process) reads them with :func:`read_version` and rebuilds any version with
:func:`replay`. Data only: safetensors files and JSON, nothing a reader has to execute.

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
directory, or that is reached through a symbolic link; :func:`read_version` refuses a data file
reached through one; :func:`check_parent` checks a delta against the version it is applied on.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from recsdk.embedding.file_checksum import checksum

__all__ = [
    "PUBLICATION_FORMAT",
    "PUBLICATION_MANIFEST",
    "PublicationError",
    "PublishedTable",
    "PublishedVersion",
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
    "read_version",
    "replay",
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
        _verify(directory, files)
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


def _verify(directory: str, files: dict[str, dict[str, int]]) -> None:
    problems = []
    for name in sorted(files):
        path = os.path.join(directory, name)
        try:
            link = _symlink_on(directory, name)
            if link is not None:
                problems.append(f"{link!r} is a symbolic link (refused: a publication's files are real files)")
                continue
            size = os.stat(path).st_size
        except OSError as e:
            problems.append(f"{path!r} cannot be read: {e.strerror or e}")
            continue
        if size != int(files[name]["size"]):
            problems.append(f"{path!r} has {size} bytes, the manifest recorded {files[name]['size']}")
        elif checksum(path) != int(files[name]["crc32"]):
            problems.append(f"{path!r} has another CRC-32 than the manifest recorded (damaged)")
    if problems:
        raise PublicationError(f"version {directory!r} is damaged: " + "; ".join(problems))


def _symlink_on(directory: str, name: str) -> str | None:
    """The first symbolic link on the way from ``directory`` to its file ``name``, or None."""
    path = directory
    for part in name.split("/"):
        path = os.path.join(path, part)
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return path
    return None
