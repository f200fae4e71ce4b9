"""recsdk-data: the Batch type, datasets and readers, stable id hashing, and device helpers."""

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
