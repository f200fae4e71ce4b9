"""Reading and writing a checkpoint's state dict with ``torch.distributed.checkpoint`` (DCP).

DCP already agrees on failures across ranks, but raises ``CheckpointException``, a
``BaseException`` that most handlers miss, with the original errors inside; these wrappers
turn it into an ordinary error that names the checkpoint and what failed. Reads go into the
tensors given (the loader's staging buffers), never into the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from recsdk.sharding.writing.comm import Comm
from recsdk.sharding.writing.errors import CheckpointError, os_reason

__all__ = ["empty_like_saved", "read", "read_metadata", "write"]


def read_metadata(path: str) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint ``path``.

    Raises:
        CheckpointError: it cannot be read or unpickled.
    """
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path!r}: cannot read its DCP metadata file {path + '/.metadata'!r}: "
            f"{type(e).__name__}: {e}; nothing was loaded"
        ) from e


def empty_like_saved(md: Any) -> torch.Tensor:
    """An uninitialised CPU tensor of a saved tensor's size and dtype."""
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"expected a saved tensor, the checkpoint's metadata holds {type(md).__name__}")
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


def read(targets: dict[str, Any], path: str, comm: Comm) -> None:
    """Collective: fill ``targets`` (tensors, in place; ``bytes`` entries are replaced) from ``path``.

    Raises:
        CheckpointError: on every rank if any rank's read failed, with each rank's error.
    """
    try:
        dcp.load(
            targets, storage_reader=dcp.FileSystemReader(path), process_group=comm.group, no_dist=not comm.distributed
        )
    except dcp.CheckpointException as e:
        raise CheckpointError(
            f"checkpoint {path!r}: reading its files failed ({_failures(e)}); the files may be damaged "
            "(load_checkpoint(..., verify=True) checks their checksums first); nothing was loaded"
        ) from None


def write(state: dict[str, Any], tmp: str, final: str, comm: Comm) -> None:
    """Collective: write ``state`` into the partial directory ``tmp`` (one file per rank, fsynced).

    Raises:
        OSError: on every rank if any rank's write failed with an ``OSError``: its errno, and a
            first line naming the directory that could not be written (``ENOSPC``: no space).
        CheckpointError: on every rank if any rank's write failed otherwise.
    """
    try:
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
            process_group=comm.group,
            no_dist=not comm.distributed,
        )
    except dcp.CheckpointException as e:
        failures = sorted(e.failures.items())
        for rank, (cause, _) in failures:
            if isinstance(cause, OSError):
                where = f" ({cause.filename!r})" if cause.filename else ""
                raise OSError(
                    cause.errno,
                    f"{os_reason(cause)}: writing checkpoint {final!r} into {tmp!r}{where} failed on rank {rank}; "
                    "nothing was published",
                ) from None
        raise CheckpointError(f"writing checkpoint {final!r} into {tmp!r} failed ({_failures(e)})") from None


def _failures(e: dcp.CheckpointException) -> str:
    return "; ".join(
        f"rank {rank}: {type(cause).__name__}: {cause}".replace("\n", " ")
        for rank, (cause, _) in sorted(e.failures.items())
    )
