"""The planner's view of a cached hash table (``fused_uvm_caching``, ``key_value``): its cache as the
sharded module will read it from the plan (:func:`planned_cache`, :func:`option_cache`), the
``fused`` kernel TorchRec builds over the cache's rows (:func:`as_fused`), the bytes of its rows
with their optimizer state (:func:`fused_row_bytes`) and the share of rows that miss the cache
(:func:`expected_miss_rate`). Used by the cost model
(:class:`~recsdk.sharding.planning.cost_model.HybridPerfEstimator`) and the planner's enumerator
and storage estimate (:mod:`~recsdk.sharding.planning.planner`).

Missed rows per step: the distinct rows a shard looks up times the miss rate. With
``CacheParams.stats`` (TorchRec's ``CacheStatistics``) both come from the statistics
(``expected_lookups`` per global batch, the shard's share of it, and
``expected_miss_rate(load_factor)``). Without them every id counts as a distinct row (an upper
bound) and the miss rate is ``1 - load_factor`` (what a cache holding that share of uniformly
used rows misses), clipped to ``[MISS_RATE_FLOOR, 1]``: skewed ids miss less, but new ids and the
tail never hit. So a cached kernel always costs more than ``fused``, and needs less device
memory: the planner picks it only where ``fused`` does not fit.

Example::

    cache = option_cache(option)  # None for fused
    misses = distinct_rows * expected_miss_rate(cache.load_factor, option.cache_params)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.types import ShardingOption
from torchrec.distributed.types import CacheParams, KeyValueParams, ParameterSharding, ShardingType

from recsdk.sharding._torchrec_compat import EnumerableShardingSpec, ShardMetadata, base_shard_storages
from recsdk.sharding.planning.cache_plan import CACHED_KERNELS, DEFAULT_LOAD_FACTOR, TableCacheSpec, cache_specs
from recsdk.sharding.planning.hybrid_costs import ID_BYTES, OUTPUT_BYTES, is_hash_option

__all__ = [
    "MISS_RATE_FLOOR",
    "as_fused",
    "expected_miss_rate",
    "fused_row_bytes",
    "option_cache",
    "planned_cache",
]

MISS_RATE_FLOOR = 0.05
"""The lowest miss rate assumed without cache statistics (new ids and the tail of the id distribution)."""


def planned_cache(
    table: str,
    compute_kernel: str,
    cache_params: CacheParams | None,
    key_value_params: KeyValueParams | None,
    shard_rows: Sequence[int] = (1,),
) -> TableCacheSpec | None:
    """How ``table`` is cached with these settings, read and checked as the sharded module reads its
    plan (:func:`~recsdk.sharding.planning.cache_plan.cache_specs`); ``None`` for ``fused``.

    Args:
        table (str): the table.
        compute_kernel (str): ``fused``, ``fused_uvm_caching`` or ``key_value``.
        cache_params (CacheParams | None): the table's cache parameters (load factor, algorithm).
        key_value_params (KeyValueParams | None): the file store's directory (``key_value``).
        shard_rows (Sequence[int]): rows per shard (shards not placed yet: all on rank 0).

    Raises:
        ValueError: as ``cache_specs``: names the table, the value and what is allowed.

    Example::

        spec = planned_cache("item", "fused_uvm_caching", CacheParams(load_factor=0.1), None, [500, 500])
        spec.slots(500)  # 50 cache rows per shard
    """
    shards, offset = [], 0
    for rows in shard_rows:
        shards.append(ShardMetadata(shard_offsets=[offset, 0], shard_sizes=[rows, 1], placement="rank:0/cpu"))
        offset += rows
    sharding = ParameterSharding(
        sharding_type=ShardingType.ROW_WISE.value,  # not read: the kernel, the params and the shards are
        compute_kernel=compute_kernel,
        sharding_spec=EnumerableShardingSpec(shards),
        cache_params=cache_params,
        key_value_params=key_value_params,
    )
    return cache_specs({table: sharding}).get(table)


def option_cache(option: ShardingOption) -> TableCacheSpec | None:
    """The device cache of a hash table's sharding option (:func:`planned_cache`); ``None`` for
    ``fused`` and other modules' tables."""
    if not is_hash_option(option) or option.compute_kernel not in CACHED_KERNELS:
        return None
    rows = [int(shard.size[0]) for shard in option.shards]
    return planned_cache(option.name, option.compute_kernel, option.cache_params, option.key_value_params, rows)


def as_fused(option: ShardingOption, cache: TableCacheSpec) -> ShardingOption:
    """A copy of a cached hash table's ``option`` as the kernel TorchRec builds for it: ``fused``,
    with the cache's rows per shard (:func:`~recsdk.sharding.planning.cache_plan.device_plan`), for
    TorchRec's estimators.

    The copy has its own shards, so estimates written to them leave ``option`` as it is.

    Args:
        option (ShardingOption): a cached hash table's option.
        cache (TableCacheSpec): its cache (:func:`option_cache`).
    """
    out = copy.copy(option)
    out.compute_kernel = EmbeddingComputeKernel.FUSED.value
    out.cache_params = None
    out.key_value_params = None
    out.shards = [copy.copy(shard) for shard in option.shards]
    for shard in out.shards:
        shard.size = [cache.slots(int(shard.size[0])), *shard.size[1:]]
    return out


def fused_row_bytes(option: ShardingOption, shard_rows: Sequence[int], *, is_inference: bool = False) -> list[int]:
    """Bytes of ``shard_rows[i]`` rows of shard ``i`` of ``option``'s table with their optimizer
    state, as TorchRec counts a ``fused`` table's (``calculate_shard_storages``: the rows' share of
    the weight, times one plus the state of the table's in-backward optimizer), without the
    batch's inputs and outputs. What a cache of that many rows holds, and a store of every row.

    Args:
        option (ShardingOption): the table's option (its tensor and optimizer, its shards' columns).
        shard_rows (Sequence[int]): rows of each shard.
        is_inference (bool): no optimizer state.
    """
    storages = base_shard_storages(  # TorchRec's calculate_shard_storages, base storage rule
        sharding_type=option.sharding_type,
        tensor=option.tensor,
        compute_device="cuda",  # where TorchRec puts a fused table's rows: all in hbm
        compute_kernel=EmbeddingComputeKernel.FUSED.value,
        shard_sizes=[[int(rows), *shard.size[1:]] for rows, shard in zip(shard_rows, option.shards, strict=True)],
        batch_sizes=[0] * option.num_inputs,  # no inputs or outputs: the world sizes below are not read
        world_size=1,
        local_world_size=1,
        input_lengths=option.input_lengths,
        num_poolings=[1.0] * option.num_inputs,
        caching_ratio=DEFAULT_LOAD_FACTOR,  # not read for fused
        is_pooled=option.is_pooled,
        input_data_type_size=ID_BYTES,
        output_data_type_size=OUTPUT_BYTES,
        is_inference=is_inference,
    )
    return [int(storage.hbm) for storage in storages]


def expected_miss_rate(load_factor: float, cache_params: CacheParams | None = None) -> float:
    """The share of a shard's distinct rows per step that miss a cache holding ``load_factor`` of its rows.

    ``cache_params.stats.expected_miss_rate(load_factor)`` with statistics; without, ``1 -
    load_factor`` clipped to ``[MISS_RATE_FLOOR, 1]`` (see the module docstring).

    Args:
        load_factor (float): the cache's share of the shard's rows, in ``(0, 1]``.
        cache_params (CacheParams | None): the table's cache parameters (``stats`` is read).
    """
    stats = cache_params.stats if cache_params is not None else None
    if stats is not None:
        return float(stats.expected_miss_rate(load_factor))
    return min(1.0, max(MISS_RATE_FLOOR, 1.0 - load_factor))
