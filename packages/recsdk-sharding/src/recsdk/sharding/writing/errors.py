"""``CheckpointError``: a checkpoint that cannot be read or written, raised on every rank."""

from __future__ import annotations

import errno

__all__ = ["CheckpointError", "os_reason"]


class CheckpointError(ValueError):
    """A checkpoint's files are missing, truncated or damaged, cannot be read, or another rank failed.

    :func:`~recsdk.sharding.load_checkpoint` raises it on every rank, with the model, its id
    tables and the optimizer unchanged; the message names the checkpoint and the file. On the
    ranks whose own part was fine it names the ranks that failed and their errors (it is the
    ``peer_error`` of the checkpoint's :class:`~recsdk.sharding.FailureAgreement`), also for a
    save. A ``ValueError``, like every other error about a checkpoint's contents.
    """


def os_reason(error: OSError) -> str:
    """What an ``OSError`` says, in words (``ENOSPC``: "no space left on device")."""
    if error.errno == errno.ENOSPC:
        return "no space left on device"
    return error.strerror or str(error)
