"""Atomic directories: written by every rank under a partial name, published by one rename.

Shared by checkpoints, exports and publications. :func:`begin_directory` has rank 0 create
``.<name>.partial-<token>`` beside the final path; every rank writes into it; then
:func:`publish_directory` has rank 0 write the manifest (the completeness marker), fsync and
rename the directory to its final name. A failed write is cleaned up with
:func:`discard_directory`; partial directories that killed processes left behind are removed
by the next successful publish beside them (:func:`remove_stale_partials`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from typing import Any

from recsdk.sharding.writing.comm import Comm
from recsdk.sharding.writing.errors import os_reason

__all__ = [
    "PARTIAL",
    "begin_directory",
    "discard_directory",
    "fsync_dir",
    "publish_directory",
    "remove_stale_partials",
    "write_json",
]

PARTIAL = ".partial-"
"""Marks a directory still being written: ``.<name>.partial-<token>``."""

_PARTIAL_NAME = re.compile(r"^\..+\.partial-[0-9a-f]+$")


def begin_directory(final: str, comm: Comm, what: str) -> str:
    """Rank 0 creates ``.<name>.partial-<token>`` beside ``final``; every rank gets its path.

    Args:
        final (str): the absolute path the directory will be published at.
        comm (Comm): the ranks writing it.
        what (str): ``"checkpoint"``, ``"export"`` or ``"publication"``, for the errors.

    Returns:
        str: the partial directory's path.

    Raises:
        ValueError: the ranks passed different paths (on every rank, naming them).
        FileNotFoundError: ``final``'s parent does not exist (on every rank).
        FileExistsError: ``final`` exists (on every rank).
        OSError: the partial directory cannot be created (on every rank).
    """
    paths = comm.gather(final)
    if len(set(paths)) > 1:
        named = ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(paths))
        raise ValueError(f"{what} path: every rank must pass the same path (on a file system all share), got {named}")
    outcome: tuple[str, str, int] = ("", "", 0)
    if comm.rank == 0:
        parent, name = os.path.split(final)
        if not os.path.isdir(parent):
            outcome = ("FileNotFoundError", f"{what} path {final!r}: the parent directory {parent!r} does not exist", 0)
        elif os.path.lexists(final):
            outcome = (
                "FileExistsError",
                f"{what} path {final!r} already exists; save each {what} to a new path (e.g. one per step)",
                0,
            )
        else:
            tmp = os.path.join(parent, f".{name}{PARTIAL}{secrets.token_hex(4)}")
            try:
                os.makedirs(tmp)
                outcome = ("", tmp, 0)
            except OSError as e:
                outcome = ("OSError", f"{what} path {final!r}: cannot create {tmp!r}: {e.strerror or e}", e.errno or 0)
    kind, value, code = comm.broadcast(outcome)
    if kind == "FileNotFoundError":
        raise FileNotFoundError(value)
    if kind == "FileExistsError":
        raise FileExistsError(value)
    if kind:
        raise OSError(code, value)
    os.makedirs(value, exist_ok=True)
    return str(value)


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a staging file, fsynced, then renamed."""
    staging = path + ".writing"
    with open(staging, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, path)


def fsync_dir(path: str) -> None:
    """Make a directory's entries durable (after creating or renaming files in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_directory(
    tmp: str,
    final: str,
    manifest_name: str,
    manifest: dict[str, Any],
    comm: Comm,
    *,
    started: float | None = None,
) -> None:
    """After every rank finished writing into ``tmp``: rank 0 writes the manifest and renames ``tmp``.

    If the manifest cannot be written, ``tmp`` is removed; if ``final`` appeared meanwhile, the
    complete copy is left at ``tmp``. Either way every rank raises. Once published, rank 0
    removes the stale partial directories beside ``final`` (see :func:`remove_stale_partials`;
    ``started``: when this write began, None to keep them), before any rank returns.

    Raises:
        FileExistsError: ``final`` appeared while writing (rank 0; the others raise CheckpointError).
        OSError: writing the manifest or the rename failed (rank 0; the others raise CheckpointError).
    """

    def publish() -> None:
        if comm.rank != 0:
            return
        manifest_path = os.path.join(tmp, manifest_name)
        try:
            write_json(manifest_path, manifest)
            fsync_dir(tmp)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(
                e.errno,
                f"{os_reason(e)} writing {manifest_path!r}; {final!r} was not published and its partial "
                "directory was removed",
            ) from e
        if os.path.lexists(final):
            raise FileExistsError(f"{final!r} appeared while saving; the complete copy is left at {tmp!r}")
        os.rename(tmp, final)
        fsync_dir(os.path.dirname(final))
        if started is not None:
            remove_stale_partials(final, older_than=started)

    comm.run(publish)


def write_directory(
    final: str,
    comm: Comm,
    what: str,
    manifest_name: str,
    fill: Callable[[str], dict[str, Any]],
    *,
    remove_stale: bool = True,
) -> dict[str, Any]:
    """Collective: create ``final``'s partial directory, ``fill(tmp)`` it (returning the manifest)
    and publish it. A failure that every rank raised removes the partial directory (a dead peer's
    stays, for the next successful write beside it to remove); stale partials are removed once
    published (unless ``remove_stale`` is False).

    Args:
        final (str): the directory to publish; must not exist.
        comm (Comm): the ranks writing it.
        what (str): what is written, for messages (``"checkpoint"``).
        manifest_name (str): the manifest's file name.
        fill (Callable[[str], dict]): writes the data into the partial directory (collective);
            returns the manifest.
        remove_stale (bool): remove the partial directories beside ``final`` older than this write.

    Returns:
        dict: the manifest published.
    """
    started = time.time()
    tmp = begin_directory(final, comm, what)
    try:
        manifest = fill(tmp)
    except BaseException:
        if comm.failed_together:  # every rank stopped writing; a dead peer's partial directory stays
            discard_directory(tmp, comm)
        raise
    publish_directory(tmp, final, manifest_name, manifest, comm, started=started if remove_stale else None)
    return manifest


def discard_directory(tmp: str, comm: Comm) -> None:
    """Rank 0 removes a partial directory whose writing failed (after every rank stopped writing)."""
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_partials(final: str, older_than: float) -> list[str]:
    """Remove the partial directories beside ``final`` that killed writers left behind.

    A partial directory is stale when it was last modified before ``older_than`` (the start of
    the write that just published ``final``, so a write still running beside it is spared) and
    holds no ``*.json`` manifest (a complete copy left there because its final name was taken
    is kept). Call on one rank, after publishing. Errors are ignored: the cleanup is a courtesy.

    Args:
        final (str): the path just published.
        older_than (float): a ``time.time()`` value.

    Returns:
        list[str]: the directories removed.
    """
    parent = os.path.dirname(final)
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        try:
            if not _PARTIAL_NAME.match(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_mtime >= older_than:
                continue
            if any(name.endswith(".json") for name in os.listdir(entry.path)):
                continue
            shutil.rmtree(entry.path)
            removed.append(entry.path)
        except OSError:
            continue
    return removed
