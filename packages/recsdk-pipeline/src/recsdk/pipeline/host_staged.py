"""``HostStagedModule``: what a sharded module implements to have its host stage pipelined.

:class:`~recsdk.pipeline.HybridTrainPipelineSparseDist` runs a module's input dist and
``post_input_dist`` on its host thread, ahead of the batch's compute, only for modules that
implement this protocol and whose input dists talk over groups free of device traffic. Every
other pipelined module (e.g. TorchRec's own ``ShardedEmbeddingBagCollection``) keeps
TorchRec's schedule on the calling thread. :func:`plan_modules` applies that rule to a
rewritten model (a :class:`ModulePlan`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import torch.distributed as dist
from torchrec.distributed.model_parallel import ShardedModule

from recsdk.sharding import HostShardedModule

__all__ = ["HostStagedModule", "ModulePlan", "is_host_staged", "plan_modules"]

logger = logging.getLogger("recsdk.pipeline.train_pipeline")  # its warnings read as the pipeline's


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


@dataclass(frozen=True)
class ModulePlan:
    """Which of a rewritten model's pipelined modules are host-staged, and what follows from it.

    Made by :func:`plan_modules` once the model is rewritten (and again after each ``attach``);
    the host stages take its ``host`` half, the inline schedule its ``inline`` half. The empty
    plan (the default) is a model not rewritten yet.

    Attributes:
        host (tuple[ShardedModule, ...]): the modules whose host stage runs on the host thread.
        inline (tuple[ShardedModule, ...]): the others, on TorchRec's schedule on the calling
            thread.
        names (Mapping[int, str]): each pipelined module's name (its pipelined forward's), by
            ``id(module)``.
        host_groups (tuple[dist.ProcessGroup, ...]): the distinct groups the ``host`` modules'
            input dists use, in module order.
        reads_carried (bool): a recsdk hash module is pipelined, so a failed read travels with
            the batch's ids (its input dists refuse a stand-in) instead of a read agreement.

    Example::

        plan = plan_modules(pipelined_modules, device_groups(model), host_thread=True)
        [plan.name_of(m) for m in plan.host]  # ["ebc"]
    """

    host: tuple[ShardedModule, ...] = ()
    inline: tuple[ShardedModule, ...] = ()
    names: Mapping[int, str] = field(default_factory=dict)
    host_groups: tuple[dist.ProcessGroup, ...] = ()
    reads_carried: bool = False

    def name_of(self, module: ShardedModule) -> str:
        """The module's name in the batch's contexts (its type's name if it is not planned)."""
        return self.names.get(id(module), type(module).__name__)


def plan_modules(pipelined: Sequence[ShardedModule], device_groups: Sequence[object], host_thread: bool) -> ModulePlan:
    """Host-stage a module iff the host thread is on and :func:`is_host_staged` says so.

    A :class:`HostStagedModule` kept inline although the host thread is on (its input dist
    uses a device group) is logged as a warning.

    Args:
        pipelined (Sequence[ShardedModule]): the pipelined modules, after the model rewrite
            and their first input dist (so their input dists exist).
        device_groups (Sequence[object]): the groups that carry device traffic.
        host_thread (bool): whether the pipeline runs host stages on its host thread; without
            it every module is inline.

    Returns:
        ModulePlan: the split, the modules' names, the host groups and whether reads are
        carried.

    Example::

        plan = plan_modules(pipelined_modules, [dist.group.WORLD], host_thread=False)
        assert not plan.host
    """
    names = {id(m): str(getattr(m.forward, "name", type(m).__name__)) for m in pipelined}
    host: list[ShardedModule] = []
    inline: list[ShardedModule] = []
    host_groups: list[dist.ProcessGroup] = []
    for module in pipelined:
        if host_thread and is_host_staged(module, device_groups):
            host.append(module)
            for pg in cast(HostStagedModule, module).host_input_groups():
                if all(pg is not p for p in host_groups):
                    host_groups.append(pg)
        else:
            inline.append(module)
            if host_thread and isinstance(module, HostStagedModule):
                logger.warning(
                    "%s: its input dist uses a device process group, so its host stage runs inline "
                    "on the calling thread; give its sharder a separate gloo group (host_env) to overlap it",
                    names[id(module)],
                )
    # A recsdk hash module's input dist can refuse a batch whose read failed, and the failure
    # agreement of its host stage (the module's inline, the pipeline's on the host thread)
    # raises on every rank: no read agreement per batch then.
    reads_carried = any(isinstance(m, HostShardedModule) for m in pipelined)
    return ModulePlan(tuple(host), tuple(inline), names, tuple(host_groups), reads_carried)
