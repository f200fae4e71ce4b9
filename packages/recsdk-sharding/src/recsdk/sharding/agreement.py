"""``FailureAgreement``: a failure on one rank raises on every rank, at one known collective.

In collective code a rank that raises leaves its peers blocked in the next collective it does
not join, until the process-group timeout. recsdk avoids that at every point where one rank may
fail alone (the host id stage of a batch, a checkpoint save or load, an export): all ranks call
the agreement there, with their error or ``None``; if any rank failed, every rank raises.

Duties of a caller:

* every rank of the group calls it at the same points, in the same order (it is a collective);
* a rank that failed passes its exception and gets it re-raised (unchanged, so its traceback
  and type stay the user's); the others raise ``peer_error`` naming the failed ranks and their
  messages;
* nothing else issues collectives on the group between :meth:`start` and :meth:`settle`.

One agreement is one all-reduce of a flag; only when it is set, the ranks exchange their
messages (``all_gather_object``). Without ``torch.distributed``, or on a group of one rank,
it only re-raises the local error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FailureAgreement", "PeerFailureError"]


class PeerFailureError(RuntimeError):
    """Another rank failed at a point where every rank agrees on failures."""


class FailureAgreement:
    """Agree across the ranks of ``group`` whether any of them failed; raise on all if so.

    Args:
        group (dist.ProcessGroup | None): the group to agree over; ``None`` is the default group
            (or no group at all when ``torch.distributed`` is not initialised). Use a gloo group:
            the flag is a CPU tensor.
        what (str): what failed, for the peers' message, e.g. ``"the host id stage"``.
        peer_error (type[Exception]): the exception the healthy ranks raise.

    Example::

        agreement = FailureAgreement(host_pg, what="the checkpoint save")
        error = None
        try:
            write_my_shard()
        except Exception as e:
            error = e
        agreement.check(error)  # raises on every rank if any rank's write failed
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        what: str = "a collective step",
        peer_error: type[Exception] = PeerFailureError,
    ) -> None:
        self._group = group
        self._what = what
        self._peer_error = peer_error
        self._pending: tuple[Any, torch.Tensor | None, BaseException | None] | None = None

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    @property
    def world_size(self) -> int:
        """Ranks taking part (1 without ``torch.distributed``)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self._group)

    def check(self, error: BaseException | None, what: str | None = None) -> None:
        """Blocking agreement: raise on every rank if ``error`` is set on any rank.

        Args:
            error (BaseException | None): this rank's failure, or ``None``.
            what (str | None): overrides the constructor's ``what`` for this agreement.

        Raises:
            BaseException: ``error`` itself on the rank that passed it.
            Exception: ``peer_error`` on the other ranks, naming the failed ranks.
        """
        self.settle()
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if int(flag) != 0:
            self._exchange(error, what)

    def start(self, error: BaseException | None, *, defer: bool = False) -> None:
        """Asynchronous agreement: a healthy rank returns at once, :meth:`settle` finishes it.

        A failing rank waits for the flag, exchanges messages and raises here; a healthy rank
        keeps working (e.g. looks its rows up) and calls :meth:`settle` before the first
        collective a failed rank would not join. With ``defer``, a failing rank returns too: it
        must then join every collective its peers run until :meth:`settle` (e.g. with a stand-in
        batch), and :meth:`settle` raises on every rank.
        """
        self.settle()  # one that a raise left pending
        if self.world_size == 1:
            if error is not None and not defer:
                raise error
            self._pending = (None, None, error) if error is not None else None
            return
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if error is None or defer:
            self._pending = (work, flag, error)
            return
        work.wait()
        self._exchange(error, None)

    def settle(self) -> None:
        """Finish the agreement :meth:`start` left pending (if any); raise if a rank failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        work, flag, error = pending
        if work is not None:
            work.wait()
        if error is None and (flag is None or int(flag) == 0):
            return
        if self.world_size == 1:
            assert error is not None
            raise error
        self._exchange(error, None)

    def _exchange(self, error: BaseException | None, what: str | None) -> None:
        """Every rank, once all know that a rank failed: share the messages and raise."""
        messages: list[str | None] = [None] * self.world_size
        mine = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(messages, mine, group=self._group)
        if error is not None:
            raise error
        failed = {r: m for r, m in enumerate(messages) if m is not None}
        raise self._peer_error(
            f"{what or self._what} failed on rank(s) {sorted(failed)}: "
            + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
        )
