"""recsdk-data: the Batch type, datasets and readers, stable id hashing, and device helpers.

The public names load on first use (PEP 562), so that a process importing one module of the
package (the columnar converter's workers) does not import torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recsdk.data._synthetic import power_law_indices
    from recsdk.data.batch import Batch, attach_clicks
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
    from recsdk.data.read_position import ReadPosition

# Each public name's module; a literal import per module, so the dependency test can read them.
_MODULES = {
    "Batch": "batch",
    "CRITEO_DENSE_COLUMNS": "criteo_fields",
    "CRITEO_SPARSE_FEATURES": "criteo_fields",
    "ColumnarDataset": "columnar",
    "CriteoDataset": "criteo",
    "DEVICE_TYPES": "device",
    "ParquetRecDataset": "parquet",
    "RandomRecDataset": "random_dataset",
    "ReadPosition": "read_position",
    "attach_clicks": "batch",
    "backend_for": "device",
    "convert_criteo": "criteo_convert",
    "current_shard": "partition",
    "current_stream": "device",
    "get_device": "device",
    "hash_string": "hashing",
    "hash_strings": "hashing",
    "mix64": "hashing",
    "new_stream": "device",
    "npu_available": "device",
    "power_law_indices": "_synthetic",
    "resolve_rank_and_world_size": "partition",
    "stream_context": "device",
    "unmix64": "hashing",
    "write_synthetic_criteo": "criteo_synthetic",
}
_LOADERS: dict[str, Callable[[], ModuleType]] = {
    "_synthetic": lambda: importlib.import_module("recsdk.data._synthetic"),
    "batch": lambda: importlib.import_module("recsdk.data.batch"),
    "columnar": lambda: importlib.import_module("recsdk.data.columnar"),
    "criteo": lambda: importlib.import_module("recsdk.data.criteo"),
    "criteo_convert": lambda: importlib.import_module("recsdk.data.criteo_convert"),
    "criteo_fields": lambda: importlib.import_module("recsdk.data.criteo_fields"),
    "criteo_synthetic": lambda: importlib.import_module("recsdk.data.criteo_synthetic"),
    "device": lambda: importlib.import_module("recsdk.data.device"),
    "hashing": lambda: importlib.import_module("recsdk.data.hashing"),
    "parquet": lambda: importlib.import_module("recsdk.data.parquet"),
    "read_position": lambda: importlib.import_module("recsdk.data.read_position"),
    "partition": lambda: importlib.import_module("recsdk.data.partition"),
    "random_dataset": lambda: importlib.import_module("recsdk.data.random_dataset"),
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
    "ReadPosition",
    "attach_clicks",
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
    "power_law_indices",
    "resolve_rank_and_world_size",
    "stream_context",
    "unmix64",
    "write_synthetic_criteo",
]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'recsdk.data' has no attribute {name!r}")
    value = getattr(_LOADERS[module](), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
