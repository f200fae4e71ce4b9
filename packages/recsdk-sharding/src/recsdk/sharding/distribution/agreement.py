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
it only re-raises the local error. The flag may instead travel in a collective every rank runs
anyway (``start(..., carrier=...)`` with a :class:`CarriedFlag`: the pooled output dists on
gloo carry the host stage's); :meth:`FailureAgreement.settle` then reads what arrived.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CarriedFlag", "FailureAgreement", "PeerFailureError"]


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
        # (work, flag, error, what) of the agreement start() began
        self._pending: tuple[Any, torch.Tensor | CarriedFlag | None, BaseException | None, str | None] | None = None

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

    def start(
        self,
        error: BaseException | None,
        *,
        defer: bool = False,
        carrier: CarriedFlag | None = None,
        what: str | None = None,
    ) -> None:
        """Asynchronous agreement: a healthy rank returns at once, :meth:`settle` finishes it.

        A failing rank waits for the flag, exchanges messages and raises here; a healthy rank
        keeps working (e.g. looks its rows up) and calls :meth:`settle` before the first
        collective a failed rank would not join. With ``defer``, a failing rank returns too: it
        must then join every collective its peers run until :meth:`settle` (e.g. with a stand-in
        batch), and :meth:`settle` raises on every rank.

        With a ``carrier`` (implies ``defer``; every rank passes one, or none does), no
        all-reduce runs: the flag is armed in it, collectives of the caller's carry it to every
        rank, and :meth:`settle` reads it there. ``what`` overrides the constructor's ``what``
        for this agreement.
        """
        self.settle()  # one that a raise left pending
        if carrier is not None:
            carrier.arm(error is not None)
            self._pending = (None, carrier, error, what)
            return
        if self.world_size == 1:
            if error is not None and not defer:
                raise error
            self._pending = (None, None, error, what) if error is not None else None
            return
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if error is None or defer:
            self._pending = (work, flag, error, what)
            return
        work.wait()
        self._exchange(error, what)

    def settle(self) -> None:
        """Finish the agreement :meth:`start` left pending (if any); raise if a rank failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        work, flag, error, what = pending
        if work is not None:
            work.wait()
        if isinstance(flag, CarriedFlag):
            any_failed = flag.take()
            if error is None and not any_failed:
                return
        elif error is None and (flag is None or int(flag) == 0):
            return
        if self.world_size == 1:
            assert error is not None
            raise error
        self._exchange(error, what)

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


class CarriedFlag:
    """A failure flag that travels in a collective every rank runs anyway, instead of an all-reduce.

    The pooled output dists on gloo (``recsdk.sharding.distribution.output_dist``) carry one: each rank's
    flag goes to every rank (itself included) in a header row of the all-to-all it sends, so
    once that all-to-all is waited for, every rank knows whether any rank failed. Where a dist
    cannot carry it in a call, it exchanges the flag with an all-reduce of its own
    (:meth:`all_reduce`).

    Duties: :meth:`arm` before the carrying collectives run (``FailureAgreement.start`` with
    ``carrier=``); every carrying collective of that step calls :meth:`outgoing` when it sends,
    :meth:`expect` with how to receive it, and :meth:`record` once received (or :meth:`all_reduce`),
    every rank alike; then :meth:`take` (``FailureAgreement.settle``) says whether any rank's flag
    was set, and clears it. A collective whose output nobody waited for (a forward whose result
    was dropped) is received by :meth:`take` itself, so every rank still reads every flag.

    Example::

        agreement.start(error, carrier=flag)  # before the lookups and their output dists
        ...                                    # the output dists send flag.outgoing(), record()
        agreement.settle()                     # raises on every rank if one failed
    """

    def __init__(self) -> None:
        self._outgoing = 0.0
        self._received: list[bool] = []
        self._reductions: list[tuple[Any, torch.Tensor]] = []
        self._arrivals: list[Callable[[], None]] = []

    def arm(self, failed: bool) -> None:
        """This rank's flag for the collectives to come (``failed``: its host stage failed)."""
        self._outgoing = 1.0 if failed else 0.0

    def outgoing(self) -> float:
        """The value to send: ``1.0`` if this rank failed, else ``0.0``."""
        return self._outgoing

    def record(self, flags: torch.Tensor) -> None:
        """The flags one collective received (any shape; nonzero: that rank failed). Read at once:
        nothing keeps the collective's buffer alive."""
        self._received.append(bool(flags.ne(0).any()))

    def expect(self, arrival: Callable[[], None]) -> None:
        """A carrying collective is in flight: ``arrival()`` waits for it and records what it
        received, once however often it is called (:meth:`take` calls it)."""
        self._arrivals.append(arrival)

    def all_reduce(self, group: dist.ProcessGroup) -> None:
        """Exchange the flag by an asynchronous all-reduce over ``group`` (a call that cannot carry it)."""
        flag = torch.tensor([self._outgoing], dtype=torch.float32)
        self._reductions.append((dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True), flag))

    def take(self) -> bool:
        """Whether any rank's flag was set in what was recorded since the last call; clears it all."""
        for arrival in self._arrivals:
            arrival()
        for work, _ in self._reductions:
            work.wait()
        failed = any(self._received) or any(bool(flag.ne(0).any()) for _, flag in self._reductions)
        self._received, self._reductions, self._arrivals, self._outgoing = [], [], [], 0.0
        return failed
