"""Planner glue: count the host id table in storage estimates, fail early on impossible constraints.

Use TorchRec's ``EmbeddingShardingPlanner`` as usual and give it a
:class:`HybridEmbeddingEnumerator`::

    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=constraints,
        enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=B, constraints=constraints),
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
"""

from __future__ import annotations

from torch import nn
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption, Topology
from torchrec.distributed.types import ModuleSharder

from recsdk.embedding import HashEmbeddingBagCollection

__all__ = ["ID_TABLE_BYTES_PER_ROW", "HybridEmbeddingEnumerator", "IdTableStorageEstimator"]

ID_TABLE_BYTES_PER_ROW = 48
"""Host bytes the id table holds per embedding row (its hash slots and per-row metadata)."""


class IdTableStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimator plus the host id table of each HashEBC shard.

    The id table lives in host memory (DDR) on every device type, so each shard of a
    :class:`~recsdk.embedding.HashEmbeddingBagCollection` table gets
    ``rows * bytes_per_row`` more DDR.

    Args:
        topology (Topology): the planner's topology.
        constraints (dict[str, ParameterConstraints] | None): the planner's constraints.
        bytes_per_row (int): id-table bytes per row (default :data:`ID_TABLE_BYTES_PER_ROW`).
    """

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, ParameterConstraints] | None = None,
        bytes_per_row: int = ID_TABLE_BYTES_PER_ROW,
    ) -> None:
        super().__init__(topology=topology, constraints=constraints)
        if bytes_per_row < 0:
            raise ValueError(f"bytes_per_row must be >= 0, got {bytes_per_row}")
        self._bytes_per_row = bytes_per_row

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: dict | None = None) -> None:  # type: ignore[override]
        super().estimate(sharding_options, sharder_data_map)  # type: ignore[arg-type]
        for option in sharding_options:
            if not isinstance(option.module[1], HashEmbeddingBagCollection):
                continue
            for shard in option.shards:
                if shard.storage is not None:
                    shard.storage.ddr += int(shard.size[0]) * self._bytes_per_row


class HybridEmbeddingEnumerator(EmbeddingEnumerator):
    """TorchRec's ``EmbeddingEnumerator`` for hybrid sharding.

    - Estimates with ``EmbeddingPerfEstimator`` and :class:`IdTableStorageEstimator` (unless
      ``estimator`` is given).
    - Checks ``ParameterConstraints`` against what each table's sharder supports on the
      topology's device before enumerating, and raises a ``ValueError`` naming the table,
      the constraint and the supported choices.

    Args:
        topology (Topology): device topology.
        batch_size (int): per-rank batch size.
        constraints (dict[str, ParameterConstraints] | None): per-table constraints.
        estimator: optional estimator(s), as TorchRec's enumerator takes.
        bytes_per_row (int): id-table bytes per row for the storage estimate.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        constraints: dict[str, ParameterConstraints] | None = None,
        estimator: object | None = None,
        bytes_per_row: int = ID_TABLE_BYTES_PER_ROW,
    ) -> None:
        if estimator is None:
            estimator = [
                EmbeddingPerfEstimator(topology=topology, constraints=constraints),
                IdTableStorageEstimator(topology=topology, constraints=constraints, bytes_per_row=bytes_per_row),
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
