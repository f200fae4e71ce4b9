"""recsdk's columnar dataset format: Arrow IPC part files and the manifest that makes them a dataset.

A converted dataset is a folder::

    manifest.json           written last: the folder is a complete dataset once it exists
    part-00000.arrow        Arrow IPC files (uncompressed), in row order, each holding record
    part-00001.arrow ...    batches of up to ``rows_per_batch`` rows

Each record batch has the columns

* ``label``: float32, one per row;
* ``dense``: ``fixed_size_list<float32>[D]``: the row's dense features as the reader yields
  them (for Criteo ``log(1 + max(x, 0))``, 0 when empty), row-major, so ``[n, D]`` is one view;
* one ``list<uint32>`` or ``list<int64>`` column per sparse feature: the row's raw ids (an empty
  list: no id). A part stores its ids as ``uint32`` when every one of them is in
  ``[0, 2**32)`` (Criteo's ids are 8 hex digits), else as ``int64``; the manifest names each
  part's type and the reader yields int64 either way, so the narrow type only halves the bytes;
* one ``uint8`` column ``<feature>.lengths`` per sparse feature, after the lists and in their
  order: each row's number of ids (the differences of the list's offsets, stored so a reader
  gets a batch's ``[F, B]`` lengths with one copy of a byte per value; the IPC writer lays the
  ``F`` columns at equal strides, so they read as one ``[F, n]`` view).

Why Arrow IPC and not Parquet: an uncompressed IPC file is the in-memory layout on disk, so a
reader memory-maps it and takes every column as a view, with no decoding; Parquet decodes
(and usually decompresses) every page, so reading it costs a copy and a decode per value
(``benchmarks/data_readers.py`` measures both). The price is size: about 9 bytes per id
(offset, length and a uint32 id).

The manifest (JSON, no pickle) holds the format and version, the row count, the column
names, the dense transform, the source files with their sizes, and every part with its
rows, bytes and id type.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ID_TYPES",
    "MANIFEST",
    "IdsTooWide",
    "check_part",
    "columnar_schema",
    "lengths_column",
    "read_manifest",
    "record_batch",
    "write_json_atomically",
]

FORMAT = "recsdk-columnar"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
ID_TYPES = {"uint32": pa.uint32(), "int64": pa.int64()}
"""The types a part stores its ids in, narrowest first."""
_UINT32_END = 1 << 32


class IdsTooWide(ValueError):
    """An id outside ``[0, 2**32)`` was given to a record batch of ``uint32`` ids."""


def lengths_column(feature: str) -> str:
    """The name of the column holding ``feature``'s number of ids per row."""
    return f"{feature}.lengths"


def columnar_schema(num_dense: int, sparse_features: Sequence[str], id_type: str = "uint32") -> pa.Schema:
    """The Arrow schema of a part with ``num_dense`` dense features, these sparse features and ids of ``id_type``."""
    fields = [
        pa.field("label", pa.float32(), nullable=False),
        pa.field("dense", pa.list_(pa.float32(), num_dense), nullable=False),
    ]
    fields += [pa.field(name, pa.list_(ID_TYPES[id_type]), nullable=False) for name in sparse_features]
    fields += [pa.field(lengths_column(name), pa.uint8(), nullable=False) for name in sparse_features]
    return pa.schema(fields)


def record_batch(
    schema: pa.Schema,
    labels: npt.NDArray[np.float32],
    dense: npt.NDArray[np.float32],
    ids: npt.NDArray[np.int64],
    present: npt.NDArray[np.bool_],
) -> pa.RecordBatch:
    """Rows with at most one id per feature as a record batch of ``schema``.

    Args:
        schema (pa.Schema): from :func:`columnar_schema`.
        labels (np.ndarray): float32 ``[n]``.
        dense (np.ndarray): float32 ``[n, D]``.
        ids (np.ndarray): int64 ``[n, F]``, the id of each row and feature (ignored where absent).
        present (np.ndarray): bool ``[n, F]``, whether the row has an id for the feature.

    Raises:
        IdsTooWide: ``schema`` stores ids as ``uint32`` and a present id is outside ``[0, 2**32)``.
    """
    n, num_features = ids.shape
    id_type = schema.field(2).type.value_type if num_features else pa.int64()
    columns: list[pa.Array] = [
        pa.array(labels, type=pa.float32()),
        pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(dense).reshape(-1)), dense.shape[1]),
    ]
    for j in range(num_features):
        mask = present[:, j]
        kept = ids[mask, j]
        if id_type == pa.uint32() and kept.size and (int(kept.min()) < 0 or int(kept.max()) >= _UINT32_END):
            raise IdsTooWide(f"feature {schema.field(2 + j).name!r} has an id outside [0, 2**32)")
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(mask, out=offsets[1:])
        values = kept.astype(np.uint32) if id_type == pa.uint32() else kept
        columns.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=id_type)))
    columns += [pa.array(present[:, j].astype(np.uint8), type=pa.uint8()) for j in range(num_features)]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def write_json_atomically(path: Path, content: Any) -> None:
    """Write ``content`` as JSON to ``path`` through a temporary file, flushed, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(content, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of the dataset folder ``root``, checked to be this format's.

    Raises:
        FileNotFoundError: ``root`` is not a folder.
        ValueError: ``root`` holds no manifest (not a converted dataset, or a conversion not
            finished), or one of another format or version.
    """
    if not root.is_dir():
        raise FileNotFoundError(f"columnar dataset folder not found: {str(root)!r}")
    path = root / MANIFEST
    if not path.is_file():
        hint = " (a conversion was started there but has not finished: run it again to resume)"
        raise ValueError(
            f"{str(root)!r} is not a converted dataset: it has no {MANIFEST}"
            + (hint if (root / ".convert").is_dir() else "")
            + "; convert with `python -m recsdk.data.convert criteo IN... OUT`"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format version {manifest.get('format_version')!r}, this reader reads version {FORMAT_VERSION}: "
            "convert the source files again with `python -m recsdk.data.convert`"
        )
    return manifest


def check_part(root: Path, part: dict[str, Any], schema: pa.Schema) -> tuple[pa.RecordBatchFileReader, mmap.mmap]:
    """Open one part file memory-mapped copy-on-write, checked against the manifest's size and the schema.

    The mapping is private: arrays viewing it are writable, and a write changes this process's
    pages only, never the file. Where the system refuses a private mapping of the file's size
    (strict overcommit accounting counts it as memory that writes could claim), the file is
    mapped read-only instead, and views of it are read-only.

    Returns:
        tuple: the IPC reader over the mapping, and the mapping (the base of every view).

    Raises:
        ValueError: the file is missing, has another size than the manifest says, is not an
            Arrow IPC file, or has another schema; the message names the file.
    """
    path = root / part["file"]
    if not path.is_file():
        raise ValueError(f"{path}: part file listed in {MANIFEST} is missing")
    size = path.stat().st_size
    if size != part["bytes"]:
        raise ValueError(f"{path}: {size:,} bytes, {MANIFEST} says {part['bytes']:,}: the file is damaged")
    try:
        with open(path, "rb") as f:
            try:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except OSError as e:
                if e.errno != errno.ENOMEM:
                    raise
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        reader = pa.ipc.open_file(pa.py_buffer(mapping))
    except (pa.ArrowInvalid, ValueError) as e:
        raise ValueError(f"{path}: not an Arrow IPC file ({e})") from e
    if not reader.schema.equals(schema):
        raise ValueError(f"{path}: schema {reader.schema} differs from the dataset's {schema}")
    return reader, mapping
