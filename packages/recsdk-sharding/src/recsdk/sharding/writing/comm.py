"""Collectives of a checkpoint save or load, an export or a publish over the host group, and its one
failure agreement.

Every rank runs the same steps in the same order. A step that may fail on some ranks only runs
through :meth:`Comm.run`: its error, or ``None``, goes through the writer's
:class:`~recsdk.sharding.FailureAgreement`, so that every rank raises at that point instead of
leaving the healthy ones blocked in the next collective until the process-group timeout. A
step run that way issues no collective itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from recsdk.sharding.distribution.agreement import FailureAgreement
from recsdk.sharding.writing.errors import CheckpointError

__all__ = ["Comm"]

T = TypeVar("T")


class Comm:
    """Collectives over ``group``, or their one-process equivalents without ``torch.distributed``.

    Args:
        group (dist.ProcessGroup | None): the host (gloo) group over every rank; None: the
            default group if it is gloo, else a new gloo group (collective: every rank builds
            its ``Comm`` at the same point).
        what (str): what the ranks do, for the message of the healthy ranks when one fails,
            e.g. ``"loading checkpoint '/ckpt/step_10'"``.

    Raises:
        ValueError: ``group`` does not hold every rank.
    """

    def __init__(self, group: dist.ProcessGroup | None, what: str) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed and group is None and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")  # the agreement's flag and the objects travel on CPU
        self.group = group
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if self.distributed and group is not None and dist.get_world_size(group) != self.world:
            raise ValueError(
                f"the host process group has {dist.get_world_size(group)} ranks, the default group {self.world}; "
                "checkpoints need a host group over every rank"
            )
        self.agreement = FailureAgreement(group if self.distributed else None, what=what, peer_error=CheckpointError)
        self.failed_together = False
        """Set when :meth:`run` raised on every rank (not when a collective broke, e.g. a peer died)."""

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on this rank, then the agreement: if it failed on any rank, raise on all.

        ``fn`` must issue no collective (a rank that failed before it would not join). A
        ``torch.distributed.checkpoint`` failure (a ``BaseException``) counts as a failure too.

        Raises:
            Exception: this rank's own error, unchanged; :class:`CheckpointError` on the other
                ranks, naming the ranks that failed and their errors.
        """
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn(*args)
        except (Exception, dcp.CheckpointException) as e:
            error = e
        try:
            self.agreement.check(error)
        except BaseException as raised:
            self.failed_together = raised is error or isinstance(raised, CheckpointError)
            raise
        return result

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows ``tensor`` split by ``send`` counts per destination; returns those received, by source."""
        if not self.distributed or self.world == 1:
            return tensor
        out = torch.empty((sum(recv), *tensor.shape[1:]), dtype=tensor.dtype)
        dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=self.group)
        return out

    def max_(self, tensor: torch.Tensor) -> None:
        """Element-wise max over the ranks, in place."""
        if self.distributed and self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
