"""Planner glue: recsdk's cost model and the host id tables in the estimates, early constraint checks.

Use TorchRec's ``EmbeddingShardingPlanner`` as usual and give it a
:class:`HybridEmbeddingEnumerator` (and, for the fixed costs of a plan's sharding groups,
:class:`~recsdk.sharding.cost_model.HybridPerfModel`)::

    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=constraints,
        enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=B, constraints=constraints),
        performance_model=HybridPerfModel(topology),
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption, Topology
from torchrec.distributed.types import ModuleSharder
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingCollection, IdTable, slot_index
from recsdk.sharding.cost_model import HybridPerfEstimator

__all__ = ["HybridEmbeddingEnumerator", "IdTableStorageEstimator", "id_table_bytes"]


def id_table_bytes(rows: int, config: BaseEmbeddingConfig) -> int:
    """Exact host bytes of the id table of a shard of ``rows`` rows of table ``config``.

    Builds the table on the ``meta`` device (nothing is allocated) and reads its
    ``memory_bytes`` (per-row arrays and, with ``CountAdmission``, the counters), with the
    hash index a host (CPU) table gets in place of the meta table's.
    """
    admission = getattr(config, "admission", None)
    eviction = getattr(config, "eviction", None)
    table = IdTable(rows, device="meta", admission=admission, eviction=eviction, name=config.name)
    meta_index = slot_index.index_bytes(rows, torch.device("meta"))
    return int(table.memory_bytes) - meta_index + slot_index.index_bytes(rows, torch.device("cpu"))


class IdTableStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimator plus the host id table of each HashEBC shard.

    The id table lives in host memory (DDR) on every device type, so each shard of a
    :class:`~recsdk.embedding.HashEmbeddingBagCollection` or
    :class:`~recsdk.embedding.HashEmbeddingCollection` table gets the exact size of its id
    table (:func:`id_table_bytes`) added to its DDR.

    Args:
        topology (Topology): the planner's topology.
        constraints (dict[str, ParameterConstraints] | None): the planner's constraints.
    """

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: dict | None = None) -> None:  # type: ignore[override]
        super().estimate(sharding_options, sharder_data_map)  # type: ignore[arg-type]
        for option in sharding_options:
            module = option.module[1]
            if isinstance(module, HashEmbeddingBagCollection):
                configs: list[BaseEmbeddingConfig] = list(module.embedding_bag_configs())
            elif isinstance(module, HashEmbeddingCollection):
                configs = list(module.embedding_configs())
            else:
                continue
            config = next(c for c in configs if c.name == option.name)
            for shard in option.shards:
                if shard.storage is not None:
                    shard.storage.ddr += id_table_bytes(int(shard.size[0]), config)


class HybridEmbeddingEnumerator(EmbeddingEnumerator):
    """TorchRec's ``EmbeddingEnumerator`` for hybrid sharding.

    - Estimates with :class:`~recsdk.sharding.cost_model.HybridPerfEstimator` (recsdk's cost
      model for hash tables, TorchRec's ``EmbeddingPerfEstimator`` for other tables) and
      :class:`IdTableStorageEstimator` (unless ``estimator`` is given).
    - Checks ``ParameterConstraints`` against what each table's sharder supports on the
      topology's device before enumerating, and raises a ``ValueError`` naming the table,
      the constraint and the supported choices.

    Args:
        topology (Topology): device topology.
        batch_size (int): per-rank batch size.
        constraints (dict[str, ParameterConstraints] | None): per-table constraints.
        estimator: optional estimator(s), as TorchRec's enumerator takes.
        host_overlap (float): for the default perf estimator: the share of the host id work the
            training loop hides (see :class:`~recsdk.sharding.cost_model.HybridPerfEstimator`).
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        constraints: dict[str, ParameterConstraints] | None = None,
        estimator: object | None = None,
        *,
        host_overlap: float = 0.0,
    ) -> None:
        if estimator is None:
            estimator = [
                HybridPerfEstimator(topology=topology, constraints=constraints, host_overlap=host_overlap),
                IdTableStorageEstimator(topology=topology, constraints=constraints),
            ]
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints, estimator=estimator)  # type: ignore[arg-type]

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> list[ShardingOption]:
        self._check_constraints(module, sharders)
        return super().enumerate(module, sharders)

    def _check_constraints(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> None:
        if not self._constraints:
            return
        by_type = {s.module_type: s for s in sharders}
        for path, child in module.named_modules():
            sharder = by_type.get(type(child))
            if sharder is None:
                continue
            for name in sharder.shardable_parameters(child):
                constraint = self._constraints.get(name)
                if constraint is None:
                    continue
                where = path or "the model"
                what = f"table {name!r} in {where} ({type(child).__name__}, sharder {type(sharder).__name__})"
                supported = sharder.sharding_types(self._compute_device)
                if constraint.sharding_types:
                    usable = [t for t in constraint.sharding_types if t in supported]
                    if not usable:
                        raise ValueError(
                            f"{what}: constraint sharding_types={constraint.sharding_types} cannot be met on "
                            f"compute device {self._compute_device!r}; supported: {supported}"
                        )
                else:
                    usable = supported
                if constraint.compute_kernels:
                    kernels = {k for t in usable for k in sharder.compute_kernels(t, self._compute_device)}
                    if not kernels.intersection(constraint.compute_kernels):
                        raise ValueError(
                            f"{what}: constraint compute_kernels={constraint.compute_kernels} cannot be met on "
                            f"compute device {self._compute_device!r}; supported: {sorted(kernels)}"
                        )
