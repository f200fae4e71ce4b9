"""``checksum``: the CRC-32 that checkpoints and publications record for each of their files."""

from __future__ import annotations

import mmap
import os
import zlib

__all__ = ["checksum"]

_CHUNK = 1 << 30


def checksum(path: str) -> int:
    """CRC-32 of a file's bytes (memory-mapped: no copy; ``zlib.crc32`` releases the GIL).

    Args:
        path (str): the file.

    Returns:
        int: ``zlib.crc32`` of its bytes, as an unsigned int.
    """
    crc = 0
    with open(path, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            for start in range(0, len(view), _CHUNK):
                crc = zlib.crc32(view[start : start + _CHUNK], crc)
    return crc & 0xFFFFFFFF
