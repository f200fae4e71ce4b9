"""The files of a checkpoint: their sizes and CRC-32 checksums, recorded at save, checked at load.

The manifest lists every file of the directory (DCP's ``.metadata`` and data files) with its
size in bytes and its CRC-32 (``zlib.crc32``, as an unsigned int). Sizes are checked on every
load and by :func:`~recsdk.sharding.latest_checkpoint` (a ``stat`` per file); checksums read
every byte, so the ranks share the work: file ``i`` of the sorted list goes to rank
``i % world_size``, at save and at load alike.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from recsdk.embedding.file_checksum import checksum
from recsdk.sharding.writing.errors import CheckpointError

__all__ = [
    "BackgroundChecksums",
    "checksum",
    "data_files",
    "describe",
    "my_share",
    "verify_checksums",
    "verify_sizes",
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


def verify_sizes(directory: str, files: Mapping[str, Mapping[str, Any]]) -> None:
    """Check that every file the manifest lists exists with its recorded size.

    Raises:
        CheckpointError: naming each missing file and each file of another size.
    """
    problems = []
    for name in sorted(files):
        path = os.path.join(directory, name)
        want = int(files[name]["size"])
        try:
            have = os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"{path!r} is missing")
            continue
        except OSError as e:
            problems.append(f"{path!r} cannot be read: {e.strerror or e}")
            continue
        if have != want:
            problems.append(f"{path!r} has {have} bytes, the manifest recorded {want} (truncated or overwritten?)")
    if problems:
        raise CheckpointError(_damaged(directory, problems))


def verify_checksums(directory: str, files: Mapping[str, Mapping[str, Any]], names: list[str]) -> None:
    """Check the CRC-32 of the files ``names`` against the manifest's.

    Raises:
        CheckpointError: naming each file whose bytes differ from those saved.
    """
    problems = []
    for name in names:
        path = os.path.join(directory, name)
        want = int(files[name]["crc32"])
        try:
            have = checksum(path)
        except OSError as e:
            problems.append(f"{path!r} cannot be read: {e.strerror or e}")
            continue
        if have != want:
            problems.append(f"{path!r} has CRC-32 {have:#010x}, the manifest recorded {want:#010x} (damaged)")
    if problems:
        raise CheckpointError(_damaged(directory, problems))


class BackgroundChecksums:
    """:func:`verify_checksums` on a thread, so that a load checks the files while it reads them.

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
            verify_checksums(directory, files, names)
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
