"""Which hash tables a plan caches, and the plan TorchRec builds their kernels from.

A table planned with ``compute_kernel="fused_uvm_caching"`` (rows in host memory) or
``"key_value"`` (rows in files under ``KeyValueParams.ssd_storage_directory``) keeps
``ceil(load_factor x rows)`` rows of each shard in the fused kernel (``CacheParams.load_factor``;
:data:`DEFAULT_LOAD_FACTOR` when the plan gives none, as TorchRec's planner assumes) and every row
in its store (:mod:`~recsdk.sharding.rows.row_store`).

TorchRec builds the fused kernels: :func:`device_plan` and :func:`device_module` give it the
table as the kernel holds it (``"fused"``, with the cache's rows per shard), while the module
keeps the user's plan (``module_sharding_plan``: what checkpoints lay the store out by).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import CacheAlgorithm, ParameterSharding

from recsdk.sharding._torchrec_compat import EnumerableShardingSpec, ShardMetadata

__all__ = [
    "CACHED_KERNELS",
    "DEFAULT_LOAD_FACTOR",
    "TableCacheSpec",
    "cache_specs",
    "device_module",
    "device_plan",
    "kernel_inputs",
]

CACHED_KERNELS = (EmbeddingComputeKernel.FUSED_UVM_CACHING.value, EmbeddingComputeKernel.KEY_VALUE.value)
"""The compute kernels that put a hash table's rows in a store behind a device cache."""

DEFAULT_LOAD_FACTOR = 0.2
"""The cache's share of a shard's rows when the plan's ``cache_params`` give no ``load_factor``."""


@dataclass(frozen=True)
class TableCacheSpec:
    """How one table is cached.

    Attributes:
        table (str): the table.
        store (str): ``"host"`` (``fused_uvm_caching``) or ``"file"`` (``key_value``).
        load_factor (float): the cache's share of each shard's rows, in ``(0, 1]``.
        algorithm (str): ``"lru"`` or ``"lfu"``.
        directory (str | None): the file store's directory as configured (``"file"`` only).
        shards (tuple[tuple[int, int], ...]): per shard in the plan's order, ``(rank, rows)``.
    """

    table: str
    store: str
    load_factor: float
    algorithm: str
    directory: str | None
    shards: tuple[tuple[int, int], ...]

    def slots(self, rows: int) -> int:
        """Cache rows of a shard of ``rows`` rows: ``ceil(load_factor x rows)``, at least 1."""
        return max(1, min(rows, math.ceil(self.load_factor * rows)))


def cache_specs(plan: Mapping[str, ParameterSharding]) -> dict[str, TableCacheSpec]:
    """The cached tables of a module's plan, checked.

    Args:
        plan (Mapping[str, ParameterSharding]): table -> its sharding (from the planner).

    Returns:
        dict[str, TableCacheSpec]: the tables with a cached compute kernel.

    Raises:
        ValueError: names the table: an unsupported compute kernel, a load factor outside
            ``(0, 1]``, an unknown cache algorithm, ``key_value`` without a storage directory.
    """
    out = {}
    for name, ps in plan.items():
        kernel = ps.compute_kernel
        if kernel not in (EmbeddingComputeKernel.FUSED.value, *CACHED_KERNELS):
            raise ValueError(
                f"table {name!r}: compute kernel {kernel!r} is not supported for hash tables; supported: "
                f"{[EmbeddingComputeKernel.FUSED.value, *CACHED_KERNELS]}"
            )
        if kernel not in CACHED_KERNELS:
            continue
        params = ps.cache_params
        load_factor = DEFAULT_LOAD_FACTOR if params is None or params.load_factor is None else params.load_factor
        if isinstance(load_factor, bool) or not isinstance(load_factor, int | float) or not 0 < load_factor <= 1:
            raise ValueError(
                f"table {name!r}: cache_params.load_factor must be a number in (0, 1] (the share of each shard's "
                f"rows kept in the device cache), got {load_factor!r}"
            )
        algorithm = CacheAlgorithm.LRU if params is None or params.algorithm is None else params.algorithm
        if algorithm not in (CacheAlgorithm.LRU, CacheAlgorithm.LFU):
            raise ValueError(
                f"table {name!r}: cache_params.algorithm must be CacheAlgorithm.LRU or LFU, got {algorithm!r}"
            )
        directory = None
        if kernel == EmbeddingComputeKernel.KEY_VALUE.value:
            kv = ps.key_value_params
            directory = kv.ssd_storage_directory if kv is not None else None
            if not directory:
                raise ValueError(
                    f"table {name!r}: compute kernel 'key_value' keeps the rows in files: set "
                    "key_value_params=KeyValueParams(ssd_storage_directory=...) in its ParameterConstraints"
                )
        shards = tuple(
            (int(s.placement.rank()), int(s.shard_sizes[0]))  # type: ignore[union-attr]
            for s in ps.sharding_spec.shards  # type: ignore[union-attr]
        )
        out[name] = TableCacheSpec(
            table=name,
            store="file" if directory is not None else "host",
            load_factor=float(load_factor),
            algorithm="lfu" if algorithm == CacheAlgorithm.LFU else "lru",
            directory=directory,
            shards=shards,
        )
    return out


def device_plan(
    plan: Mapping[str, ParameterSharding], specs: Mapping[str, TableCacheSpec]
) -> dict[str, ParameterSharding]:
    """The plan TorchRec builds the kernels from: cached tables as ``"fused"`` with the cache's rows.

    Hash tables are row-wise or table-wise, so each shard spans every column: a cached shard
    keeps its rank, with ``slots(rows)`` rows, row offsets running on from shard to shard.
    Other tables are as planned.
    """
    out = dict(plan)
    for name, spec in specs.items():
        ps = plan[name]
        shards, offset = [], 0
        for s in ps.sharding_spec.shards:  # type: ignore[union-attr]
            rows = spec.slots(int(s.shard_sizes[0]))
            shards.append(
                ShardMetadata(
                    shard_offsets=[offset, *s.shard_offsets[1:]],
                    shard_sizes=[rows, *s.shard_sizes[1:]],
                    placement=s.placement,
                )
            )
            offset += rows
        out[name] = replace(
            ps,
            compute_kernel=EmbeddingComputeKernel.FUSED.value,
            sharding_spec=EnumerableShardingSpec(shards),
            cache_params=None,
            key_value_params=None,
        )
    return out


def device_module(module: Any, specs: Mapping[str, TableCacheSpec], configs: list[Any], make: Any) -> Any:
    """The unsharded module as the kernels see it: cached tables with the cache's rows in all.

    Built on the meta device (nothing is allocated); the tables' parameters carry the user's
    in-backward optimizer settings, as the user's module's do.

    Args:
        module: the unsharded hash module (its parameters' optimizer settings are copied).
        specs (Mapping[str, TableCacheSpec]): the cached tables.
        configs (list): the module's table configs.
        make: builds the module from configs on a device (``lambda configs: HashEBC(configs, device=...)``).
    """
    if not specs:
        return module
    resized = []
    for cfg in configs:
        spec = specs.get(cfg.name)
        if spec is None:
            resized.append(cfg)
            continue
        clone = copy.copy(cfg)  # keeps init_fn and the admission/eviction of the user's config
        clone.num_embeddings = sum(spec.slots(rows) for _, rows in spec.shards)
        resized.append(clone)
    out = make(resized)
    originals = dict(module.named_parameters())
    for name, param in out.named_parameters():
        for attr in ("_optimizer_classes", "_optimizer_kwargs", "_in_backward_optimizers"):
            if hasattr(originals.get(name), attr):
                setattr(param, attr, getattr(originals[name], attr))
    return out


def kernel_inputs(
    module: Any, plan: Mapping[str, ParameterSharding], configs: list[Any], make: Any
) -> tuple[Any, dict[str, ParameterSharding], dict[str, TableCacheSpec]]:
    """What a sharded hash module's TorchRec constructor gets: the module and plan as the kernels
    hold them (:func:`device_module`, :func:`device_plan`), and the cached tables.

    Args:
        module: the unsharded hash module.
        plan (Mapping[str, ParameterSharding]): its plan.
        configs (list): its table configs.
        make: builds the module from configs on the meta device.

    Raises:
        ValueError: as :func:`cache_specs`.
    """
    specs = cache_specs(plan)
    if not specs:
        return module, dict(plan), specs
    return device_module(module, specs, configs, make), device_plan(plan, specs), specs
