"""``HybridEmbeddingShardingPlanner``: TorchRec's planner with recsdk's enumerator and cost model,
whose ``collective_plan`` fails on every rank.

TorchRec's ``EmbeddingShardingPlanner.collective_plan`` plans on rank 0 and broadcasts the plan:
when planning raises there (a constraint no sharder meets, too little memory for the tables),
rank 0 raises and every other rank waits in the broadcast until the process group's timeout
(30 minutes by default). This planner broadcasts the outcome instead, the plan or the error, so
that every rank returns the same plan or raises within seconds.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from recsdk.sharding.planning.cost_model import HybridPerfModel
from recsdk.sharding.planning.planner import HybridEmbeddingEnumerator

__all__ = ["HybridEmbeddingShardingPlanner"]

# The error types a peer re-raises as they are (each takes one message); any other becomes a PlannerError.
_PEER_ERROR_TYPES: tuple[type[Exception], ...] = (PlannerError, ValueError, TypeError, KeyError, MemoryError)


class HybridEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's ``EmbeddingShardingPlanner`` set up for recsdk's hash tables.

    The enumerator is a :class:`~recsdk.sharding.HybridEmbeddingEnumerator` (the id tables and
    device caches in the storage estimates, recsdk's cost model for the hybrid shardings, the
    constraints checked against the sharders) and the performance model a
    :class:`~recsdk.sharding.HybridPerfModel`, unless given. :meth:`collective_plan` plans on
    rank 0 and broadcasts the plan, as TorchRec's does, or the error planning raised there:
    rank 0 raises it and every other rank an error of its kind (a ``PlannerError``,
    ``ValueError``, ``TypeError``, ``KeyError`` or ``MemoryError`` for one of these or a
    subclass, otherwise a ``PlannerError``) with rank 0's message, instead of waiting for the
    group's timeout.

    Args:
        topology (Topology): the ranks and their devices (required: the enumerator is built
            for it).
        batch_size (int): samples per rank and step, for the estimates.
        constraints (dict[str, ParameterConstraints] | None): table name -> constraints.
        host_overlap (float): the share of the host id work the hybrid pipeline hides behind
            compute, for the cost model (see :class:`~recsdk.sharding.HybridEmbeddingEnumerator`).
        **planner_kwargs: TorchRec's other ``EmbeddingShardingPlanner`` arguments
            (``enumerator`` and ``performance_model`` replace recsdk's).

    Example::

        planner = HybridEmbeddingShardingPlanner(
            topology=Topology(world_size=world_size, compute_device="cpu"),
            batch_size=1024,
            constraints={"user": ParameterConstraints(sharding_types=["row_wise"])},
        )
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)  # every rank
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        constraints: dict[str, ParameterConstraints] | None = None,
        *,
        host_overlap: float = 0.0,
        **planner_kwargs: Any,
    ) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a torchrec Topology, got {type(topology).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        planner_kwargs.setdefault(
            "enumerator",
            HybridEmbeddingEnumerator(
                topology=topology, batch_size=batch_size, constraints=constraints, host_overlap=host_overlap
            ),
        )
        planner_kwargs.setdefault("performance_model", HybridPerfModel(topology))
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints, **planner_kwargs)

    def collective_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> ShardingPlan:
        """Plan on rank 0 of ``pg`` and broadcast the plan, or the error, to every rank.

        Args:
            module (nn.Module): the model to shard (every rank passes the same one).
            sharders (list[ModuleSharder] | None): e.g. ``get_default_hybrid_sharders(host_env)``;
                ``None``: TorchRec's default sharders.
            pg (dist.ProcessGroup | None): the group to plan over; ``None``: the default group.

        Returns:
            ShardingPlan: the same plan on every rank.

        Raises:
            Exception: on every rank, what planning raised on rank 0 (see the class).
        """
        if pg is None:
            if not dist.is_initialized():
                raise RuntimeError("collective_plan needs torch.distributed initialised; use plan() on one process")
            pg = dist.GroupMember.WORLD
            assert pg is not None
        if sharders is None:
            sharders = get_default_sharders()
        # ("plan", plan) or ("error", index into _PEER_ERROR_TYPES or -1, message): the error's
        # class is not sent (one defined where the peers cannot import it would not unpickle).
        outcome: list[Any] = [None]
        error: Exception | None = None
        if pg.rank() == 0:
            try:
                outcome = [("plan", self.plan(module, sharders))]
            except Exception as e:
                error = e
                kind = next((i for i, t in enumerate(_PEER_ERROR_TYPES) if isinstance(e, t)), -1)
                outcome = [("error", kind, f"{type(e).__name__}: {e}")]
        if pg.size() > 1:
            dist.broadcast_object_list(outcome, 0, group=pg)
        if error is not None:
            raise error
        if outcome[0][0] == "plan":
            return outcome[0][1]  # type: ignore[no-any-return]
        _, kind, message = outcome[0]
        raise (_PEER_ERROR_TYPES[kind] if kind >= 0 else PlannerError)(f"planning failed on rank 0: {message}")
