"""``BatchAgreements``: the pipeline's per-batch failure agreements, over its own gloo groups.

Two points per batch where one rank may fail alone and its peers would otherwise block in the
next collective they issue for that batch:

* the **read**: the data iterator raised instead of yielding the batch. Agreed over a gloo
  group of all ranks (every rank computes every batch), before any rank issues a collective
  for the batch. (With recsdk's hash modules the pipeline agrees only on the first read this
  way; afterwards a failed read travels with the batch's ids, see
  ``HybridTrainPipelineSparseDist``.)
* the **host stage**: the input dist or ``post_input_dist`` raised. Agreed over one gloo group
  per distinct host group, once the batch's ids are mapped.

Each is a :class:`~recsdk.sharding.FailureAgreement` (one flag all-reduce; messages are
exchanged only on failure) with :class:`~recsdk.pipeline.HostStageError` as the healthy ranks'
error. Only these agreements issue collectives on their groups, each from one thread at a time
in batch order, so they cannot fall out of step with the other ranks. A read agreement may run
asynchronously (:meth:`BatchAgreements.start_read`, the pipeline without its host thread): its
all-reduce goes on while the calling thread computes, and is settled before the batch's first
collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch.distributed as dist

from recsdk.pipeline.host_worker import HostStageError
from recsdk.sharding import FailureAgreement

__all__ = ["BatchAgreements"]


def _gloo_world_group() -> dist.ProcessGroup | None:
    """A new gloo group of every rank (collective: all ranks call it); ``None`` with one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


class BatchAgreements:
    """The read and host-stage agreements of one pipeline.

    Create it on every rank at the same point (it creates a gloo group of all ranks), then
    call :meth:`add_host_groups` once, on every rank, when the host groups are known.

    Example::

        agreements = BatchAgreements()
        agreements.read(index, error)  # every rank, for every batch it reads (or fails to)
        agreed = agreements.start_read(index, error)  # or without waiting; settle_reads() ends it
        agreements.add_host_groups([host_pg])
        agreements.host_stage(index, error)  # every rank, after each batch's host stage
    """

    def __init__(self) -> None:
        self._read = FailureAgreement(_gloo_world_group(), what="the data iterator", peer_error=HostStageError)
        self._host: list[FailureAgreement] | None = None
        self._unsettled_read: tuple[Future[None], Exception | None] | None = None
        self._read_failure: BaseException | None = None

    @property
    def reads_need_agreeing(self) -> bool:
        """Whether :meth:`read` talks to other ranks (``False`` with one rank)."""
        return self._read.world_size > 1

    @property
    def has_host_groups(self) -> bool:
        """Whether :meth:`add_host_groups` has run."""
        return self._host is not None

    def add_host_groups(self, host_groups: Sequence[dist.ProcessGroup]) -> None:
        """Create one control group (gloo, same ranks) per host group of more than one rank.

        Collective: every rank calls it once, with groups of the same ranks in the same order.
        """
        ranks = [dist.get_process_group_ranks(pg) for pg in host_groups]
        self._host = [
            FailureAgreement(dist.new_group(ranks=r, backend="gloo"), peer_error=HostStageError)
            for r in ranks
            if len(r) > 1
        ]

    def read(self, index: int | None, error: Exception | None) -> None:
        """Agree whether reading batch ``index`` failed on any rank; raise on every rank if so.

        Args:
            index (int | None): the batch's index, for the message.
            error (Exception | None): what the iterator raised here, or ``None``.

        Raises:
            Exception: ``error`` on the rank that passed it (also if the agreement's own
                collective fails); :class:`HostStageError` naming the failed ranks elsewhere.
        """
        try:
            self._read.check(error, what=f"the data iterator (batch {index})")
        except BaseException as e:
            failure: BaseException = e
        else:
            return
        raise error if error is not None else failure

    def start_read(self, index: int | None, error: Exception | None) -> Future[None]:
        """:meth:`read` without waiting: the flag's all-reduce runs while the caller goes on.

        Settles the read started before (:meth:`settle_reads`) first: one is pending at a
        time, and none starts after one failed (its future fails at once). Every rank must
        settle a batch's read before it issues any other collective for that batch, also a
        rank whose read failed (it issues none for it, but computes the batches read before
        it, as its peers do, so it must not wait here).

        Args:
            index (int | None): the batch's index, for the message.
            error (Exception | None): what the iterator raised here, or ``None``.

        Returns:
            Future[None]: done once settled; its exception is what :meth:`read` would raise.
        """
        self.settle_reads()
        agreed: Future[None] = Future()
        if self._read_failure is not None:
            # No agreement after a failed one: the ranks whose read failed read no further.
            agreed.set_exception(HostStageError(f"batch {index} was not agreed: an earlier read failed"))
            return agreed
        try:
            self._read.start(error, defer=True, what=f"the data iterator (batch {index})")
        except BaseException as e:  # the collective itself failed
            agreed.set_exception(error if error is not None else e)
            return agreed
        self._unsettled_read = (agreed, error)
        return agreed

    def settle_reads(self) -> None:
        """Finish the read :meth:`start_read` left pending, if any (its future gets the outcome)."""
        pending, self._unsettled_read = self._unsettled_read, None
        if pending is None:
            return
        agreed, error = pending
        try:
            self._read.settle()
        except BaseException as e:
            self._read_failure = error if error is not None else e
            agreed.set_exception(self._read_failure)
        else:
            agreed.set_result(None)

    def host_stage(self, index: int | None, error: BaseException | None) -> None:
        """Agree whether batch ``index``'s host stage failed on any rank; raise on every rank if so.

        Joins every control group's agreement even after one raised, so that no group is
        left one agreement behind.

        Args:
            index (int | None): the batch's index, for the message.
            error (BaseException | None): what this rank's host stage raised, or ``None``.

        Raises:
            BaseException: ``error`` on the rank that passed it; :class:`HostStageError`
                naming the failed ranks elsewhere (or the collective's own error).
        """
        raised: BaseException | None = None
        for agreement in self._host or []:
            try:
                agreement.check(error, what=f"the host stage of batch {index}")
            except BaseException as e:  # still join the other groups' agreements
                if raised is None:
                    raised = e
        if error is not None:
            raise error
        if raised is not None:
            raise raised
