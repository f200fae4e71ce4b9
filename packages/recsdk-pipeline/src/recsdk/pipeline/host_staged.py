"""``HostStagedModule``: what a sharded module implements to have its host stage pipelined.

:class:`~recsdk.pipeline.HybridTrainPipelineSparseDist` runs a module's input dist and
``post_input_dist`` on its host thread, ahead of the batch's compute, only for modules that
implement this protocol and whose input dists talk over groups free of device traffic. Every
other pipelined module (e.g. TorchRec's own ``ShardedEmbeddingBagCollection``) keeps
TorchRec's schedule on the calling thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

__all__ = ["HostStagedModule", "is_host_staged"]


@runtime_checkable
class HostStagedModule(Protocol):
    """A sharded module whose per-batch id work can run on a host thread, ahead of compute.

    The pipeline calls, per batch: the module's ``input_dist`` (TorchRec's), then
    :meth:`post_input_dist` on the host thread; later, on the calling thread, the module's
    ``compute_and_output_dist`` with what :meth:`post_input_dist` returned.
    ``isinstance(module, HostStagedModule)`` checks that the four methods exist.

    Example::

        class MyShardedModule(ShardedEmbeddingBagCollection):
            def host_input_groups(self) -> list[dist.ProcessGroup]:
                return [self._host_pg]

            def post_input_dist(self, ctx, dist_input):
                return map_ids_to_rows(ctx, dist_input)

            def release_context(self, ctx) -> None:
                unpin(ctx)

            def release_finished_pins(self) -> None:
                unpin_last_computed()
    """

    def host_input_groups(self) -> list[dist.ProcessGroup]:
        """The process groups its input dists' id all-to-alls use (known once they exist).

        Returns:
            list[dist.ProcessGroup]: every group its input dists issue collectives on.
        """
        ...

    def post_input_dist(self, ctx: Any, dist_input: Any) -> Any:
        """Map the received raw ids to rows; may run on the host thread, ahead of compute.

        Args:
            ctx: the batch's module context (from ``create_context``).
            dist_input: what the input dist delivered (e.g. a ``KJTList`` of raw ids).

        Returns:
            the input of ``compute_and_output_dist`` for this batch.
        """
        ...

    def release_context(self, ctx: Any) -> None:
        """A batch mapped ahead will never compute: give back what it holds (e.g. unpin rows).

        Args:
            ctx: the dropped batch's module context.
        """
        ...

    def release_finished_pins(self) -> None:
        """The last computed batch's backward is done: its rows may be evicted again."""
        ...


def is_host_staged(module: object, device_groups: Sequence[object]) -> bool:
    """Whether the pipeline may run ``module``'s host stage on its host thread.

    It may iff ``module`` implements :class:`HostStagedModule` and all of its
    :meth:`~HostStagedModule.host_input_groups` (at least one) differ from every group that
    carries device traffic (the default group, the sharding envs' groups): collectives of
    those must stay in one order on the calling thread of every rank.

    Args:
        module (object): a pipelined sharded module, after its input dists exist.
        device_groups (Sequence[object]): the groups that carry device traffic.

    Returns:
        bool: ``True`` to host-stage it, ``False`` to keep it inline.

    Example::

        is_host_staged(sharded_hash_ebc, [dist.group.WORLD])  # True with a separate host group
    """
    if not isinstance(module, HostStagedModule):
        return False
    groups = module.host_input_groups()
    return bool(groups) and all(g is not d for g in groups for d in device_groups)
