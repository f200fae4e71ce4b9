"""Test helper: shard a model with recsdk's hybrid sharders on CPU, in one call.

The set-up the tests of recsdk-sharding, recsdk-pipeline and recsdk-serving share (and the
seed flow's sharding step): a gloo host group, :func:`~recsdk.sharding.get_default_hybrid_sharders`,
TorchRec's planner with :class:`~recsdk.sharding.HybridEmbeddingEnumerator` on a CPU topology,
and ``DistributedModelParallel`` on CPU. Imported from nowhere in the library (``recsdk.sharding``
does not export it); import ``recsdk.sharding.testing`` itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv

from recsdk.sharding.planning.planner import HybridEmbeddingEnumerator
from recsdk.sharding.sharders import get_default_hybrid_sharders

__all__ = ["shard_on_cpu"]


def shard_on_cpu(
    model: nn.Module,
    batch_size: int,
    constraints: dict[str, ParameterConstraints] | None = None,
    host_pg: dist.ProcessGroup | None = None,
) -> DistributedModelParallel:
    """``model`` sharded by recsdk's hybrid sharders and TorchRec's planner, as a DMP on CPU.

    Call on every rank of an initialised default group (e.g. under
    :func:`recsdk.data.testing.run_distributed`): it makes a collective plan.

    Args:
        model (nn.Module): the unsharded model (fused optimizers already applied, if any).
        batch_size (int): the per-rank batch size the planner assumes.
        constraints (dict[str, ParameterConstraints] | None): per-table constraints.
        host_pg (dist.ProcessGroup | None): the sharders' host group; a new gloo group of all
            ranks (default timeout) if ``None``.

    Returns:
        DistributedModelParallel: the sharded model on CPU.

    Example::

        dmp = shard_on_cpu(model, batch_size=8, constraints={"t0": ParameterConstraints(sharding_types=["row_wise"])})
    """
    if host_pg is None:
        host_pg = dist.new_group(backend="gloo")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    sharders = get_default_hybrid_sharders(host_env=ShardingEnv(world_size=world_size, rank=rank, pg=host_pg))
    topology = Topology(world_size=world_size, compute_device="cpu")
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=constraints,
        enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=batch_size, constraints=constraints),
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
