"""The files that checkpoints and publications record: ``checksum`` and ``verify_files``.

A checkpoint's and a publication's manifest record each of their files' size and CRC-32
(``{name: {"size": bytes, "crc32": checksum}}``); :func:`verify_files` is the one check of a
directory's files against such a record, for both.
"""

from __future__ import annotations

import mmap
import os
import stat
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["checksum", "verify_files"]

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


def verify_files(
    directory: str,
    files: Mapping[str, Mapping[str, Any]],
    names: Iterable[str] | None = None,
    *,
    checksums: bool = True,
) -> list[str]:
    """What is wrong with files of ``directory`` against the sizes and CRC-32s a manifest recorded.

    Each file is checked in turn: reached without a symbolic link below ``directory`` (a link is
    refused: the files are read as the real files written), present, of the recorded size, and
    (with ``checksums``) of the recorded CRC-32, which reads every byte.

    Args:
        directory (str): the directory the names are relative to.
        files (Mapping): ``{name: {"size": int, "crc32": int}}``, as a manifest records them.
        names (Iterable[str] | None): the files to check, each a key of ``files``; None: all of
            them, sorted.
        checksums (bool): also compare the CRC-32s; False checks only links, presence and sizes
            (a ``stat`` per file).

    Returns:
        list[str]: one line per damaged file, naming its path and what differs; ``[]`` when
        every file agrees with the record.

    Raises:
        KeyError: a name of ``names`` is not in ``files``.

    Example::

        problems = verify_files(path, manifest["files"])
        if problems:
            raise ValueError(f"{path!r} is damaged: " + "; ".join(problems))
    """
    problems = []
    for name in sorted(files) if names is None else names:
        record = files[name]
        path = os.path.join(directory, name)
        try:
            link = _symlink_on(directory, name)
            if link is not None:
                problems.append(f"{link!r} is a symbolic link (refused: the files are read as real files)")
                continue
            size = os.stat(path).st_size
            if size != int(record["size"]):
                problems.append(
                    f"{path!r} has {size} bytes, the manifest recorded {record['size']} (truncated or overwritten?)"
                )
                continue
            if checksums:
                crc = checksum(path)
                if crc != int(record["crc32"]):
                    problems.append(
                        f"{path!r} has CRC-32 {crc:#010x}, the manifest recorded {int(record['crc32']):#010x} (damaged)"
                    )
        except FileNotFoundError:
            problems.append(f"{path!r} is missing")
        except OSError as e:
            problems.append(f"{path!r} cannot be read: {e.strerror or e}")
    return problems


def _symlink_on(directory: str, name: str) -> str | None:
    """The first symbolic link on the way from ``directory`` to its file ``name``, or None."""
    path = directory
    for part in name.split("/"):
        path = os.path.join(path, part)
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return path
    return None
