"""Planner glue: recsdk's cost model, the host id tables and device caches in the estimates,
early constraint checks.

:class:`~recsdk.sharding.HybridEmbeddingShardingPlanner` is TorchRec's planner set up with both
parts below. Or use TorchRec's ``EmbeddingShardingPlanner`` as usual and give it a
:class:`HybridEmbeddingEnumerator` (and, for the fixed costs of a plan's sharding groups,
:class:`~recsdk.sharding.planning.cost_model.HybridPerfModel`)::

    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=constraints,
        enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=B, constraints=constraints),
        performance_model=HybridPerfModel(topology),
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)

Where a hash table shard's memory is counted, per compute kernel (device: HBM on a CUDA
topology, DDR on CPU; every kernel adds the shard's id table to DDR):

=====================  ==========================  ===============================  =================
kernel                 device                      DDR                              SSD
=====================  ==========================  ===============================  =================
``fused``              every row, its optimizer    the id table                     --
                       state
``fused_uvm_caching``  the cache:                  the store (every row, its        --
                       ceil(load_factor x rows)    optimizer state); the cache's
                       rows, their optimizer       index; the id table
                       state
``key_value``          the cache, as above         the cache's index; the id table  the store's files
                                                   (the files' pages are the OS
                                                   page cache's)
=====================  ==========================  ===============================  =================

(Plus TorchRec's inputs and outputs of the kernel, as for a ``fused`` table.) The unconstrained
planner enumerates ``fused`` and ``fused_uvm_caching``; the cost model makes caching dearer, so it
is chosen only where ``fused`` does not fit. ``key_value`` needs a table's
``ParameterConstraints`` (``compute_kernels`` naming it, and ``key_value_params`` with the
store's ``ssd_storage_directory``), as in TorchRec, and a topology with SSD capacity (``ssd_cap``,
TorchRec's 2 TB per rank by default); among the kernels a constraint allows, the planner takes
``key_value`` only where the store does not fit DDR either::

    constraints = {
        "item": ParameterConstraints(
            compute_kernels=["fused", "fused_uvm_caching", "key_value"],
            cache_params=CacheParams(load_factor=0.1),
            key_value_params=KeyValueParams(ssd_storage_directory="/ssd/recsdk"),
        )
    }
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.enumerators import GUARDED_COMPUTE_KERNELS
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption, Storage, Topology
from torchrec.distributed.types import ModuleSharder, PipelineType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsdk.embedding import (
    HashEmbeddingBagCollection,
    HashEmbeddingCollection,
    IdTable,
    slot_index,
)
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.planning.cache_costs import as_fused, fused_row_bytes, option_cache, planned_cache
from recsdk.sharding.planning.cache_plan import CACHED_KERNELS
from recsdk.sharding.planning.cost_model import HybridPerfEstimator
from recsdk.sharding.rows.row_cache import TableCache

__all__ = ["HybridEmbeddingEnumerator", "IdTableStorageEstimator", "cache_index_bytes", "id_table_bytes"]

"""Per cache slot, beside its id table: the store row it holds (int64) and whether it changed (bool)."""


def _host_table_bytes(rows: int, **table: object) -> int:
    """Bytes of an ``IdTable(rows, **table)`` on the host: built on ``meta`` (nothing is allocated),
    with the hash index a CPU table gets in place of the meta table's."""
    meta = IdTable(rows, device="meta", **table)  # type: ignore[arg-type]
    meta_index = slot_index.index_bytes(rows, torch.device("meta"))
    return int(meta.memory_bytes) - meta_index + slot_index.index_bytes(rows, torch.device("cpu"))


def id_table_bytes(rows: int, config: BaseEmbeddingConfig) -> int:
    """Exact host bytes of the id table of a shard of ``rows`` rows of table ``config``.

    Builds the table on the ``meta`` device (nothing is allocated) and reads its
    ``memory_bytes`` (per-row arrays and, with ``CountAdmission``, the counters), with the
    hash index a host (CPU) table gets in place of the meta table's.
    """
    if rows < 1:  # no id table (such a plan fails at sharding, naming the table, on every rank)
        return 0
    admission = getattr(config, "admission", None)
    eviction = getattr(config, "eviction", None)
    return _host_table_bytes(rows, admission=admission, eviction=eviction, name=config.name)


def cache_index_bytes(slots: int, rows: int) -> int:
    """Host bytes of a device cache's bookkeeping (``TableCache.host_bytes``): per slot its store
    row, last use, use count and free-stack entry; per store row its slot (at most).

    Args:
        slots (int): the cache's rows.
        rows (int): the shard's store rows.
    """
    return TableCache.host_bytes(slots, rows)


class IdTableStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimator with each hash table shard's memory where it lives.

    For each shard of a :class:`~recsdk.embedding.HashEmbeddingBagCollection` or
    :class:`~recsdk.embedding.HashEmbeddingCollection` table (see the module docstring):

    - ``fused``: TorchRec's estimate (the rows on the device);
    - ``fused_uvm_caching`` / ``key_value``: TorchRec's estimate of the ``fused`` kernel over the
      cache's rows (``ceil(load_factor x rows)``), the store's rows and optimizer state
      (:func:`~recsdk.sharding.planning.cache_costs.fused_row_bytes`) in DDR or SSD, and the cache's index
      (:func:`cache_index_bytes`) in DDR;
    - and the exact size of its id table (:func:`id_table_bytes`) in DDR.

    Other tables get TorchRec's estimate.

    Args:
        topology (Topology): the planner's topology.
        constraints (dict[str, ParameterConstraints] | None): the planner's constraints.
        pipeline_type (PipelineType): as TorchRec's estimator takes.
        run_embedding_at_peak_memory (bool): as TorchRec's estimator takes.
        is_inference (bool): no optimizer state.

    Example::

        topology = Topology(world_size=2, compute_device="cuda", hbm_cap=16 * 2**30)
        storage = IdTableStorageEstimator(topology, is_inference=True)
        perf = HybridPerfEstimator(topology, is_inference=True)
        enumerator = HybridEmbeddingEnumerator(topology=topology, batch_size=B, estimator=[perf, storage])
    """

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, ParameterConstraints] | None = None,
        pipeline_type: PipelineType = PipelineType.NONE,
        run_embedding_at_peak_memory: bool = False,
        is_inference: bool = False,
    ) -> None:
        super().__init__(topology, constraints, pipeline_type, run_embedding_at_peak_memory, is_inference)
        self._inference = is_inference

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: dict | None = None) -> None:  # type: ignore[override]
        caches = [option_cache(option) for option in sharding_options]
        # A cached table's device part: the fused kernel TorchRec builds over the cache's rows.
        kernels = [o if c is None else as_fused(o, c) for o, c in zip(sharding_options, caches, strict=True)]
        super().estimate(kernels, sharder_data_map)  # type: ignore[arg-type]
        for option, kernel, cache in zip(sharding_options, kernels, caches, strict=True):
            config = _hash_table_config(option)
            if config is None:
                continue
            rows = [int(shard.size[0]) for shard in option.shards]
            store = fused_row_bytes(option, rows, is_inference=self._inference) if cache is not None else []
            for i, (shard, estimated) in enumerate(zip(option.shards, kernel.shards, strict=True)):
                storage = estimated.storage
                if storage is None:
                    continue
                if cache is not None:  # the cache on the device, the store in DDR or on SSD
                    storage = Storage(
                        hbm=storage.hbm,
                        ddr=storage.ddr + cache_index_bytes(cache.slots(rows[i]), rows[i]),
                        ssd=storage.ssd,
                    )
                    if cache.store == "host":
                        storage.ddr += store[i]
                    else:
                        storage.ssd += store[i]
                storage.ddr += id_table_bytes(rows[i], config)
                shard.storage = storage


def _table_names(module: HashEmbeddingBagCollection | HashEmbeddingCollection) -> list[str]:
    if isinstance(module, HashEmbeddingBagCollection):
        return [c.name for c in module.embedding_bag_configs()]
    return [c.name for c in module.embedding_configs()]


def _hash_table_config(option: ShardingOption) -> BaseEmbeddingConfig | None:
    """The config of a hash module's table that ``option`` shards; ``None`` for other modules."""
    module = option.module[1]
    if isinstance(module, HashEmbeddingBagCollection):
        configs: list[BaseEmbeddingConfig] = list(module.embedding_bag_configs())
    elif isinstance(module, HashEmbeddingCollection):
        configs = list(module.embedding_configs())
    else:
        return None
    return next(c for c in configs if c.name == option.name)


class HybridEmbeddingEnumerator(compat.KernelHookEnumerator):
    """TorchRec's ``EmbeddingEnumerator`` for hybrid sharding.

    - Estimates with :class:`~recsdk.sharding.planning.cost_model.HybridPerfEstimator` (recsdk's cost
      model for hash tables, TorchRec's ``EmbeddingPerfEstimator`` for other tables) and
      :class:`IdTableStorageEstimator` (unless ``estimator`` is given).
    - Checks ``ParameterConstraints`` against what each table's sharder supports on the
      topology's device before enumerating, and raises a ``ValueError`` naming the table,
      the constraint and the supported choices; for a hash table that may be cached, also its
      ``cache_params`` and ``key_value_params`` as the sharded module will read them (a load
      factor in ``(0, 1]``, ``key_value`` with a storage directory and SSD capacity).

    Args:
        topology (Topology): device topology.
        batch_size (int): per-rank batch size.
        constraints (dict[str, ParameterConstraints] | None): per-table constraints.
        estimator: optional estimator(s), as TorchRec's enumerator takes.
        host_overlap (float): for the default perf estimator: the share of the host id work the
            training loop hides (see :class:`~recsdk.sharding.planning.cost_model.HybridPerfEstimator`).
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
        self._table_constraints = constraints  # what TorchRec's filter reads too
        self._device_type = topology.compute_device
        self._ssd_caps = [device.storage.ssd for device in topology.devices]
        self._hash_tables: set[str] = set()  # of the module being enumerated
        # Here, not in enumerate: every rank builds the enumerator, while TorchRec's collective_plan
        # plans on rank 0 only (an error there would leave the others waiting in its broadcast).
        for name, constraint in (constraints or {}).items():
            self._check_cache(name, f"table {name!r}", constraint, self._cached_kernels_allowed(constraint))

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> list[ShardingOption]:
        self._hash_tables = {
            name
            for child in module.modules()
            if isinstance(child, HashEmbeddingBagCollection | HashEmbeddingCollection)
            for name in _table_names(child)
        }
        self._check_constraints(module, sharders)
        return super().enumerate(module, sharders)

    def _kernels_of(self, name: str, offered: list[str]) -> list[str]:
        """The kernels a table's sharder offers (the compat hook; TorchRec's filter then applies),
        plus on a CPU topology, for a hash table, the cached kernels its constraint names:
        recsdk's sharders offer them off CPU only (there the cache and its store would both be
        host memory, never a better fit than ``fused``), as TorchRec's do, so that TorchRec's own
        estimators never meet them on CPU."""
        constraint = self._table_constraints.get(name) if self._table_constraints else None
        if self._device_type != "cpu" or constraint is None or name not in self._hash_tables:
            return offered
        named = [k for k in constraint.compute_kernels or () if k in CACHED_KERNELS and k not in offered]
        return [*offered, *named]

    def _check_constraints(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> None:
        if not self._table_constraints:
            return
        by_type = {s.module_type: s for s in sharders}
        for path, child in module.named_modules():
            sharder = by_type.get(type(child))
            if sharder is None:
                continue
            for name in sharder.shardable_parameters(child):
                constraint = self._table_constraints.get(name)
                if constraint is None:
                    continue
                where = path or "the model"
                what = f"table {name!r} in {where} ({type(child).__name__}, sharder {type(sharder).__name__})"
                supported = sharder.sharding_types(self._device_type)
                if constraint.sharding_types:
                    usable = [t for t in constraint.sharding_types if t in supported]
                    if not usable:
                        raise ValueError(
                            f"{what}: constraint sharding_types={constraint.sharding_types} cannot be met on "
                            f"compute device {self._device_type!r}; supported: {supported}"
                        )
                else:
                    usable = supported
                offered = [sharder.compute_kernels(t, self._device_type) for t in usable]
                kernels = {k for per_type in offered for k in self._kernels_of(name, per_type)}
                if constraint.compute_kernels and not kernels.intersection(constraint.compute_kernels):
                    raise ValueError(
                        f"{what}: constraint compute_kernels={constraint.compute_kernels} cannot be met on "
                        f"compute device {self._device_type!r}; supported: {sorted(kernels)}"
                    )

    def _cached_kernels_allowed(self, constraint: ParameterConstraints) -> set[str]:
        """The cached kernels the planner may pick under ``constraint``: those it names, else
        ``fused_uvm_caching`` off CPU (TorchRec enumerates its guarded ``key_value`` only when
        named; on CPU recsdk offers no cached kernel unless named)."""
        if constraint.compute_kernels:
            return set(constraint.compute_kernels).intersection(CACHED_KERNELS)
        if self._device_type == "cpu":
            return set()
        return set(CACHED_KERNELS).difference(k.value for k in GUARDED_COMPUTE_KERNELS)

    def _check_cache(self, name: str, what: str, constraint: ParameterConstraints, kernels: set[str]) -> None:
        """Raise unless every cached kernel the planner may pick for hash table ``name`` can be built."""
        for kernel in sorted(kernels.intersection(CACHED_KERNELS)):
            if kernel == EmbeddingComputeKernel.KEY_VALUE.value and not any(cap > 0 for cap in self._ssd_caps):
                raise ValueError(
                    f"{what}: constraint compute_kernels={constraint.compute_kernels} asks for 'key_value', whose "
                    f"row store's files count against the topology's SSD capacity, but no rank has any "
                    f"(ssd_cap per rank: {self._ssd_caps}); give Topology(ssd_cap=...) or another kernel"
                )
            try:
                planned_cache(name, kernel, constraint.cache_params, constraint.key_value_params)
            except ValueError as e:
                reason = str(e).removeprefix(f"table {name!r}: ")
                if repr(kernel) not in reason:
                    reason += f" (for compute kernel {kernel!r})"
                raise ValueError(f"{what}: {reason}") from None
