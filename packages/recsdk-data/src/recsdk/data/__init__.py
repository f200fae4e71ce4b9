"""recsdk-data: the Batch type, datasets and readers, and device helpers."""

from recsdk.data.device import (
    DEVICE_TYPES,
    backend_for,
    current_stream,
    get_device,
    new_stream,
    npu_available,
    stream_context,
)

__all__ = [
    "DEVICE_TYPES",
    "backend_for",
    "current_stream",
    "get_device",
    "new_stream",
    "npu_available",
    "stream_context",
]
