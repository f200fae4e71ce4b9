"""recsdk-data: the Batch type, datasets and readers, stable id hashing, and device helpers.

The public names load on first use (PEP 562), so that a process importing one module of the
package (the columnar converter's workers) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recsdk.data.batch import Batch
    from recsdk.data.columnar import ColumnarDataset
    from recsdk.data.criteo import CriteoDataset
    from recsdk.data.criteo_convert import convert_criteo
    from recsdk.data.criteo_fields import CRITEO_DENSE_COLUMNS, CRITEO_SPARSE_FEATURES
    from recsdk.data.criteo_synthetic import write_synthetic_criteo
    from recsdk.data.device import (
        DEVICE_TYPES,
        backend_for,
        current_stream,
        get_device,
        new_stream,
        npu_available,
        stream_context,
    )
    from recsdk.data.hashing import hash_string, hash_strings, mix64, unmix64
    from recsdk.data.parquet import ParquetRecDataset
    from recsdk.data.partition import current_shard, resolve_rank_and_world_size
    from recsdk.data.random_dataset import RandomRecDataset

_MODULES = {
    "Batch": "recsdk.data.batch",
    "CRITEO_DENSE_COLUMNS": "recsdk.data.criteo_fields",
    "CRITEO_SPARSE_FEATURES": "recsdk.data.criteo_fields",
    "ColumnarDataset": "recsdk.data.columnar",
    "CriteoDataset": "recsdk.data.criteo",
    "DEVICE_TYPES": "recsdk.data.device",
    "ParquetRecDataset": "recsdk.data.parquet",
    "RandomRecDataset": "recsdk.data.random_dataset",
    "backend_for": "recsdk.data.device",
    "convert_criteo": "recsdk.data.criteo_convert",
    "current_shard": "recsdk.data.partition",
    "current_stream": "recsdk.data.device",
    "get_device": "recsdk.data.device",
    "hash_string": "recsdk.data.hashing",
    "hash_strings": "recsdk.data.hashing",
    "mix64": "recsdk.data.hashing",
    "new_stream": "recsdk.data.device",
    "npu_available": "recsdk.data.device",
    "resolve_rank_and_world_size": "recsdk.data.partition",
    "stream_context": "recsdk.data.device",
    "unmix64": "recsdk.data.hashing",
    "write_synthetic_criteo": "recsdk.data.criteo_synthetic",
}

__all__ = [
    "CRITEO_DENSE_COLUMNS",
    "CRITEO_SPARSE_FEATURES",
    "DEVICE_TYPES",
    "Batch",
    "ColumnarDataset",
    "CriteoDataset",
    "ParquetRecDataset",
    "RandomRecDataset",
    "backend_for",
    "convert_criteo",
    "current_shard",
    "current_stream",
    "get_device",
    "hash_string",
    "hash_strings",
    "mix64",
    "new_stream",
    "npu_available",
    "resolve_rank_and_world_size",
    "stream_context",
    "unmix64",
    "write_synthetic_criteo",
]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'recsdk.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
