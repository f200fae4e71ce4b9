"""The files of a written directory: their sizes and CRC-32 checksums, recorded at a write, checked at a load.

A checkpoint's or a publication's manifest lists every file of the directory (a checkpoint's:
DCP's ``.metadata`` and data files) with its size in bytes and its CRC-32 (``zlib.crc32``, as an
unsigned int): :func:`describe`. A checkpoint's sizes are checked on every load and by
:func:`~recsdk.sharding.latest_checkpoint` (a ``stat`` per file); checksums read every byte, so
the ranks share the work: file ``i`` of the sorted list goes to rank ``i % world_size``, at save
and at load alike. The check itself is :func:`~recsdk.embedding.file_checksum.verify_files`,
the one publications' readers use.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from recsdk.embedding.file_checksum import checksum, verify_files
from recsdk.sharding.writing.errors import CheckpointError

__all__ = [
    "BackgroundChecksums",
    "data_files",
    "describe",
    "my_share",
    "verify",
]


def data_files(directory: str, manifest_name: str) -> list[str]:
    """Names of the regular files directly in ``directory``, sorted, the manifest left out."""
    return sorted(
        e.name
        for e in os.scandir(directory)
        if e.is_file(follow_symlinks=False) and e.name != manifest_name and not e.name.endswith(".writing")
    )


def my_share(names: list[str], rank: int, world: int) -> list[str]:
    """The files of ``names`` (sorted) whose checksum ``rank`` computes."""
    return sorted(names)[rank::world]


def describe(directory: str, names: list[str]) -> dict[str, dict[str, int]]:
    """``{name: {"size": bytes, "crc32": checksum}}`` for files of ``directory``."""
    out = {}
    for name in names:
        path = os.path.join(directory, name)
        out[name] = {"size": os.path.getsize(path), "crc32": checksum(path)}
    return out


def verify(
    directory: str, files: Mapping[str, Mapping[str, Any]], names: list[str] | None = None, *, checksums: bool
) -> None:
    """Check a checkpoint's files against its manifest (:func:`~recsdk.embedding.file_checksum.verify_files`,
    the check publications use too).

    Args:
        directory (str): the checkpoint.
        files (Mapping): the manifest's ``files``.
        names (list[str] | None): the files to check; None: every file the manifest lists.
        checksums (bool): also compare CRC-32s (every byte read); False: links, presence and sizes.

    Raises:
        CheckpointError: naming each missing file, each of another size, each reached through a
            symbolic link and (with ``checksums``) each whose bytes differ from those saved.
    """
    problems = verify_files(directory, files, names, checksums=checksums)
    if problems:
        raise CheckpointError(_damaged(directory, problems))


class BackgroundChecksums:
    """:func:`verify` with checksums on a thread, so that a load checks the files while it reads them.

    ``zlib.crc32`` and file reads release the GIL: on a host with a spare core the check costs
    little time. :meth:`result` waits for it and raises what it found.

    Args:
        directory (str): the checkpoint.
        files (Mapping): the manifest's ``files``.
        names (list[str]): the files to check.
    """

    def __init__(self, directory: str, files: Mapping[str, Mapping[str, Any]], names: list[str]) -> None:
        self._error: Exception | None = None
        self._thread = threading.Thread(
            target=self._run, args=(directory, files, names), name="recsdk-checkpoint-verify", daemon=True
        )
        self._thread.start()

    def _run(self, directory: str, files: Mapping[str, Mapping[str, Any]], names: list[str]) -> None:
        try:
            verify(directory, files, names, checksums=True)
        except Exception as e:
            self._error = e

    def result(self) -> None:
        """Wait for the check.

        Raises:
            CheckpointError: naming each file whose bytes differ from those saved.
        """
        self._thread.join()
        if self._error is not None:
            raise self._error


def _damaged(directory: str, problems: list[str]) -> str:
    return (
        f"checkpoint {directory!r} is damaged, nothing was loaded: "
        + "; ".join(problems)
        + ". Load another checkpoint (latest_checkpoint skips checkpoints with missing or truncated files)"
    )
