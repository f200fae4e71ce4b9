"""The planner's cost model for the hybrid shardings of hash tables (row- and table-wise).

TorchRec's ``EmbeddingPerfEstimator`` is calibrated for GPUs and TorchRec's own shardings; on a CPU
host it made row-wise look cheaper than table-wise for recsdk's hash tables, although table-wise
trained faster. :class:`HybridPerfEstimator` estimates where a step's time goes on recsdk's
hybrid path instead, per shard and per step (TorchRec's :class:`Perf`, in milliseconds):

============================  ======================================  =================================
what                          table-wise shard (one per table)         row-wise shard (one per rank)
============================  ======================================  =================================
ids mapped and looked up      every id of the table in the global      ``1/W`` of them (ids are spread
                              batch (``B*W*pooling``)                  over ranks by ``owner``)
host id work                  ``host_map_s_per_table`` +               the same for its ids, plus the
                              ids * ``host_map_s_per_id``              owner bucketing of this rank's
                                                                       ``B*pooling`` ids
                                                                       (``bucket_s_per_id``)
id all-to-alls (gloo)         8 B per id + 4 B per bag, the share      the same for its ids, and the
                              ``(W-1)/W`` that leaves the rank         lengths of every bag
lookup, forward / backward    per id, per id x dim, per output value   the same (its ids; its output)
(backward: optimizer fused)
output dist (gloo), fwd/bwd   the pooled output of every sample:       partial sums of every sample:
                              ``B*W*dim*4`` bytes                      ``B*W*dim*4`` bytes *per shard*,
                                                                       so ``W`` x table-wise per table
unpooled output               one embedding per id                     one embedding per id: the same
                                                                       total over the shards
============================  ======================================  =================================

(``B``: the planner's per-rank batch size; ``W``: world size; ``pooling``: the tables' pooling
factors from ``ParameterConstraints.pooling_factors``, TorchRec's default 1.0 otherwise.)

The planner rates a plan by its busiest rank: the sum of the perf of the shards on each rank
(``NoopPerfModel``). With these estimates, equal per-id work on every layout, table-wise wins
where the tables spread evenly (no duplicated output, no bucketing, fewer shards), and row-wise
where one rank would get too much of the work (one table dominating) or a table does not fit
one rank's memory (``IdTableStorageEstimator``: on CPU the tables and id tables live in DDR).

What does not depend on the shards but on the sharding *groups* of a plan (per module and
sharding type: the collectives, the kernel calls, the host stage's call) cannot be a shard's
perf; :class:`HybridPerfModel` adds it to the planner's rating so that a plan mixing row- and
table-wise on one module pays for its second group (measured: 0.7x on 3 tables here).

Host id work and the pipeline: the bucketing, the id all-to-alls and the id-table lookups run on
the host before the lookup. ``HybridTrainPipelineSparseDist`` runs them on a worker thread for the
next batches while the current batch computes; the plain training loop runs them inline.
``host_overlap`` (0 to 1) is the share of that work the training loop hides: the visible part
``(1 - host_overlap)`` counts in ``fwd_compute`` (host work) and ``fwd_comms`` (id all-to-alls);
the hidden part of the id all-to-alls goes to ``input_dist_comms``, the field TorchRec keeps for
its own pipelined input dist and leaves out of ``Perf.total``. The default 0 counts it all: the
plain loop, and a CPU-only host, whose cores the lookups already keep busy (there the hybrid
pipeline measured 1.01-1.04x the plain loop, against a 1.17-1.19x ceiling). With the hybrid pipeline on
an accelerator, pass ``host_overlap=1.0``.

Other compute devices: the lookup and the output dist are TorchRec's kernels and collectives on
the device, so they keep TorchRec's estimate; the host id work and the gloo id all-to-alls
are added as above (the host constants hold for the host).

Cached kernels (``fused_uvm_caching``, ``key_value``, see :mod:`~recsdk.sharding.planning.cache_plan`): the
lookup is the ``fused`` kernel's, over the cache's rows (TorchRec's estimate of a ``fused`` table
off CPU). On top, the device cache's work runs on the training thread when a batch starts
computing (``TableCache.to_slots``, not hidden by ``host_overlap``) and counts in ``fwd_compute``:

==============================  ======================================================================
cache lookup                    ``cache_s_per_table`` + ids * ``cache_s_per_id`` (the batch's rows
                                made unique and found in the cache's own id table)
swap-in, per missed row         ``swap_in_s_per_row`` + row bytes * ``swap_s_per_byte``: the row and
                                its optimizer state (TorchRec's count, :func:`fused_row_bytes`)
                                copied from the store into the kernel
swap-out, per missed row        ``swap_out_s_per_row`` + row bytes * ``swap_s_per_byte`` (training
(training only)                 only: the slot it takes was changed by a batch and is written back)
across PCIe (CUDA, MTIA)        row bytes / ``Topology.hbm_to_ddr_mem_bw`` per direction
file store (``key_value``)      ``max(row bytes, FILE_PAGE_BYTES) / Topology.ssd_mem_bw`` per
                                direction: a missed row's page is assumed not in the page cache
                                (``key_value`` is for stores larger than host memory)
==============================  ======================================================================

Missed rows per step: the distinct rows a shard looks up times the miss rate. With
``CacheParams.stats`` (TorchRec's ``CacheStatistics``) both come from the statistics
(``expected_lookups`` per global batch, the shard's share of it, and
``expected_miss_rate(load_factor)``). Without them every id counts as a distinct row (an upper
bound) and the miss rate is ``1 - load_factor`` (what a cache holding that share of uniformly
used rows misses), clipped to ``[MISS_RATE_FLOOR, 1]``: skewed ids miss less, but new ids and the
tail never hit. So a cached kernel always costs more than ``fused``, and needs less device
memory: the planner picks it only where ``fused`` does not fit.

Constants (:data:`DEFAULT_COSTS`) were measured on this project's CPU machine (2 gloo ranks on a
shared 2-core host, one intra-op thread each, the benchmarks' Zipf ids from ``RandomRecDataset``,
200,000-row tables, exact Adagrad fused into the backward) by::

    python benchmarks/calibrate_cost_model.py

which prints one JSON line per constant (the lower quartile over interleaved repeats, fitted
with non-negative least squares, the median over ranks); paste the values here, or pass your own
:class:`HybridCosts` to :class:`HybridPerfEstimator` / :class:`HybridPerfModel`. Only ratios
between the constants decide a plan; their absolute values scale with the machine's load.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.perf_models import NoopPerfModel
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, get_num_poolings
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Perf,
    PerfModel,
    ShardEstimator,
    ShardingOption,
    Topology,
)
from torchrec.distributed.types import (
    CacheParams,
    KeyValueParams,
    ParameterSharding,
    ShardingType,
)
from torchrec.modules.embedding_configs import DATA_TYPE_NUM_BITS

from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingCollection
from recsdk.sharding._torchrec_compat import EnumerableShardingSpec, ShardMetadata, base_shard_storages
from recsdk.sharding.planning.cache_plan import CACHED_KERNELS, DEFAULT_LOAD_FACTOR, TableCacheSpec, cache_specs

__all__ = [
    "DEFAULT_COSTS",
    "FILE_PAGE_BYTES",
    "MISS_RATE_FLOOR",
    "HybridCosts",
    "HybridPerfEstimator",
    "HybridPerfModel",
    "ShardCost",
    "as_fused",
    "expected_miss_rate",
    "fused_row_bytes",
    "is_hash_option",
    "option_cache",
    "planned_cache",
]

ID_BYTES = 8  # raw int64 ids
LENGTH_BYTES = 4  # int32 bag lengths
OUTPUT_BYTES = 4  # fp32 embeddings out of the fused kernel (a sharding option's output_dtype overrides)
MS = 1000.0  # TorchRec's Perf is in milliseconds
FILE_PAGE_BYTES = 4096
"""A file store's unit of transfer: a missed row reads (and a written-back row writes) at least a page."""
MISS_RATE_FLOOR = 0.05
"""The lowest miss rate assumed without cache statistics (new ids and the tail of the id distribution)."""


@dataclass(frozen=True)
class HybridCosts:
    """Per-step costs of recsdk's hybrid path on one rank, in seconds (see the module docstring).

    Per shard:

    Attributes:
        host_map_s_per_table: the host stage's fixed cost per table shard (``find_or_insert``
            call, reassigned rows, the rows' KJT).
        host_map_s_per_id: ``find_or_insert`` per id, steady state (most ids already stored).
        bucket_s_per_id: the row-wise owner bucketing per id (``bucketize_by_owner``).
        lookup_fwd_s_per_id, lookup_fwd_s_per_value, lookup_fwd_s_per_output: the fused
            kernel's forward per id, per id x dim and per output value (bag x dim pooled, id x
            dim unpooled).
        lookup_bwd_s_per_id, lookup_bwd_s_per_value, lookup_bwd_s_per_output: the same for the
            backward with the optimizer fused (measured with exact Adagrad).
        comm_s_per_byte: a gloo all-to-all, per byte a rank sends to the other ranks.

    Per shard of a cached table (``fused_uvm_caching``, ``key_value``):

    Attributes:
        cache_s_per_table: the device cache's fixed cost per shard and step (``to_slots``).
        cache_s_per_id: the cache's lookup per id of the shard (unique, find in its id table).
        swap_in_s_per_row: a missed row's swap-in, apart from its bytes (bookkeeping, the gathers).
        swap_out_s_per_row: writing a changed row back, apart from its bytes.
        swap_s_per_byte: a swap's host copy per byte of the row and its optimizer state, each way.

    Per sharding group (module and sharding type) and rank, used by :class:`HybridPerfModel`:

    Attributes:
        host_map_s_per_call: the host stage's fixed cost per call.
        lookup_fwd_s_per_call, lookup_bwd_s_per_call: the fused kernel's fixed cost per call.
        comm_s_per_call: a gloo all-to-all's latency, back to back as a step issues them.
        collectives_per_group: all-to-alls per group and step in training: the input dist's
            one (splits, lengths, ids and weights in one block per rank, in the steady state:
            ``FusedKJTAllToAll``), the output dist forward and backward (2 in inference,
            without the backward).
    """

    host_map_s_per_table: float
    host_map_s_per_id: float
    bucket_s_per_id: float
    lookup_fwd_s_per_id: float
    lookup_fwd_s_per_value: float
    lookup_fwd_s_per_output: float
    lookup_bwd_s_per_id: float
    lookup_bwd_s_per_value: float
    lookup_bwd_s_per_output: float
    comm_s_per_byte: float
    host_map_s_per_call: float
    lookup_fwd_s_per_call: float
    lookup_bwd_s_per_call: float
    comm_s_per_call: float
    collectives_per_group: int = 3
    cache_s_per_table: float = 2.4e-4
    cache_s_per_id: float = 1.5e-7
    swap_in_s_per_row: float = 7.8e-7
    swap_out_s_per_row: float = 5e-8
    swap_s_per_byte: float = 5.6e-10

    def group_s(self, *, on_cpu: bool = True, training: bool = True) -> float:
        """Fixed seconds per step of one sharding group of hash tables, on every rank."""
        collectives = self.collectives_per_group if training else self.collectives_per_group - 1
        seconds = self.host_map_s_per_call
        if on_cpu:  # elsewhere the kernels and the output dist are the device's (TorchRec's estimate)
            seconds += self.lookup_fwd_s_per_call + (self.lookup_bwd_s_per_call if training else 0.0)
            return seconds + collectives * self.comm_s_per_call
        return seconds + 2 * self.comm_s_per_call  # the input dist's all-to-alls stay on gloo


DEFAULT_COSTS = HybridCosts(
    host_map_s_per_table=2.7e-4,
    host_map_s_per_id=5.1e-8,
    bucket_s_per_id=1.96e-8,
    lookup_fwd_s_per_id=1.45e-8,
    lookup_fwd_s_per_value=0.0,
    lookup_fwd_s_per_output=8.85e-10,
    lookup_bwd_s_per_id=2.75e-8,
    lookup_bwd_s_per_value=1.49e-9,
    lookup_bwd_s_per_output=1.35e-9,
    comm_s_per_byte=6.37e-10,
    host_map_s_per_call=6.4e-5,
    lookup_fwd_s_per_call=2.94e-4,
    lookup_bwd_s_per_call=2.93e-4,
    comm_s_per_call=1.25e-4,
)
"""Measured by ``benchmarks/calibrate_cost_model.py`` on the project's 2-core CPU machine, the
median of three runs (at a load average under 1). Per step at the benchmarks' defaults (1024
samples per rank, 2 ranks, ~4 ids per bag, dim 32) a table-wise shard comes to ~1.76 ms (host id
work 0.69, lookup 0.88, output dist 0.17, id all-to-all 0.02) and a row-wise shard to ~1.25 ms
(0.56, 0.51, 0.17, 0.01); a sharding group's fixed cost to ~1.28 ms. The forward's cost per id
x dim fitted as 0 here (it is bound by the ids and the bags, not the dim, up to dim 128).

The cache's constants (``cache_s_per_table`` to ``swap_s_per_byte``, the dataclass defaults) are
rougher: timed on the same machine under load (load average ~2 on its 2 cores, so up to ~1.5x
high, with a spread of about that much between runs), one thread, ``TableCache.to_slots`` over a
``HostRowStore`` of 200,000 rows (the lower quartile of 25 calls): the lookup with every row in
the cache, 1,024 to 8,192 ids per call, fitted per call and per id; the swaps with a cache of
40,000 slots and 4,096 distinct uniform rows per call (~3,300 misses), rows of dim 16, 64 and 256
with one per-row state of the same shape, in training and in inference (swap-ins alone), fitted
per row and per byte. ``benchmarks/calibrate_cost_model.py`` does not measure them yet. The PCIe and SSD terms
are TorchRec's topology bandwidths, not measured here. A cached kernel costs more than ``fused``
whatever their exact values; they decide how the planner weighs a cached table against a
``fused`` row-wise one, or caching one table against another."""


@dataclass(frozen=True)
class ShardCost:
    """What one shard of a hash table costs per step (seconds and bytes, before any overlap).

    Attributes:
        ids: ids the shard maps and looks up.
        outputs: output rows (bags pooled, ids unpooled) the shard computes and sends.
        host_s: host id work: the id-table mapping, and for row-wise the owner bucketing.
        id_bytes: id all-to-all bytes the shard receives from other ranks (ids and lengths).
        id_comm_s: their time on gloo.
        lookup_fwd_s, lookup_bwd_s: the fused kernel, forward and backward (0 in inference).
        output_bytes: the shard's output tensor (``outputs * dim * 4``): what its output dist
            moves forward, and its gradient backward (the ``(W-1)/W`` leaving the rank is timed).
        output_comm_s: the output dist's time per direction.
        misses (float): rows a cached shard swaps in per step (0 for ``fused``).
        cache_s (float): a cached shard's device cache work: its lookup and the swaps (0 for ``fused``).
    """

    ids: float
    outputs: float
    host_s: float
    id_bytes: float
    id_comm_s: float
    lookup_fwd_s: float
    lookup_bwd_s: float
    output_bytes: float
    output_comm_s: float
    misses: float = 0.0
    cache_s: float = 0.0

    def perf(self, host_overlap: float = 0.0, training: bool = True) -> Perf:
        """The shard's :class:`Perf` in milliseconds, with ``host_overlap`` of the host work hidden
        (the device cache's work runs on the training thread: never hidden)."""
        visible = 1.0 - host_overlap
        return Perf(
            fwd_compute=MS * (self.lookup_fwd_s + visible * self.host_s + self.cache_s),
            fwd_comms=MS * (self.output_comm_s + visible * self.id_comm_s),
            bwd_compute=MS * self.lookup_bwd_s if training else 0.0,
            bwd_comms=MS * self.output_comm_s if training else 0.0,
            input_dist_comms=MS * host_overlap * self.id_comm_s,
        )


def is_hash_option(option: ShardingOption) -> bool:
    """Whether ``option`` shards a table of a recsdk hash module (the hybrid path)."""
    return isinstance(option.module[1], (HashEmbeddingBagCollection, HashEmbeddingCollection))


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


class HybridPerfEstimator(ShardEstimator):
    """Perf estimates of recsdk's hybrid shardings for hash tables; TorchRec's for other tables.

    For every sharding option of a :class:`~recsdk.embedding.HashEmbeddingBagCollection` or
    :class:`~recsdk.embedding.HashEmbeddingCollection` table, each shard gets the perf of its
    :class:`ShardCost` (see the module docstring). Options of other modules get TorchRec's
    ``EmbeddingPerfEstimator`` estimate, as do the device parts (lookup, output dist) of hash
    tables on a compute device other than CPU (a cached table's as the ``fused`` kernel TorchRec
    builds for it, :func:`as_fused`; its device cache's work is added).

    Args:
        topology (Topology): the planner's topology.
        constraints (dict[str, ParameterConstraints] | None): the planner's constraints
            (``pooling_factors``, ``num_poolings`` and ``batch_sizes`` are read).
        is_inference (bool): no backward.
        costs (HybridCosts): the constants; :data:`DEFAULT_COSTS` by default.
        host_overlap (float): share of the host id work and id all-to-alls the training loop
            hides (0: the plain loop; 1: all of it, e.g. the hybrid pipeline on an accelerator).

    Example::

        estimator = HybridPerfEstimator(topology)
        costs = estimator.shard_costs(option)  # per shard: ids, bytes, seconds
    """

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, ParameterConstraints] | None = None,
        is_inference: bool = False,
        *,
        costs: HybridCosts = DEFAULT_COSTS,
        host_overlap: float = 0.0,
    ) -> None:
        if not 0.0 <= host_overlap <= 1.0:
            raise ValueError(f"HybridPerfEstimator: host_overlap must be in [0, 1], got {host_overlap}")
        self._topology = topology
        self._constraints = constraints
        self._is_inference = is_inference
        self._costs = costs
        self._host_overlap = host_overlap
        self._torchrec = EmbeddingPerfEstimator(topology=topology, constraints=constraints, is_inference=is_inference)

    @property
    def costs(self) -> HybridCosts:
        return self._costs

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: dict | None = None) -> None:  # type: ignore[override]
        on_cpu = self._topology.compute_device == "cpu"
        hashed = [o for o in sharding_options if is_hash_option(o)]
        others = [o for o in sharding_options if not is_hash_option(o)]
        # Off CPU TorchRec estimates the device parts; of a cached hash table, those of the fused
        # kernel it builds over the cache's rows.
        kernels = {}
        for option in hashed:
            cache = option_cache(option)
            kernels[id(option)] = option if cache is None else as_fused(option, cache)
        torchrec_options = others if on_cpu else others + list(kernels.values())
        if torchrec_options:
            self._torchrec.estimate(torchrec_options, sharder_data_map)  # type: ignore[arg-type]
        training = not self._is_inference
        for option in hashed:
            kernel = kernels[id(option)]
            for shard, estimated, cost in zip(option.shards, kernel.shards, self.shard_costs(option), strict=True):
                ours = cost.perf(self._host_overlap, training)
                if on_cpu:
                    shard.perf = ours
                else:
                    device = estimated.perf if estimated.perf is not None else Perf(0.0, 0.0, 0.0, 0.0)
                    visible = 1.0 - self._host_overlap
                    shard.perf = Perf(
                        fwd_compute=device.fwd_compute + MS * (visible * cost.host_s + cost.cache_s),
                        fwd_comms=device.fwd_comms + MS * visible * cost.id_comm_s,
                        bwd_compute=device.bwd_compute,
                        bwd_comms=device.bwd_comms,
                        input_dist_comms=ours.input_dist_comms,
                        prefetch_compute=device.prefetch_compute,
                    )

    def shard_costs(self, option: ShardingOption) -> list[ShardCost]:
        """The :class:`ShardCost` of each shard of ``option`` (a hash table's row- or table-wise option).

        Raises:
            ValueError: another sharding type (hash tables are row- or table-wise); a cached
                kernel's settings that the sharded module would reject (:func:`planned_cache`).
        """
        c = self._costs
        world = self._topology.world_size
        sharding = option.sharding_type
        if sharding not in (ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value):
            raise ValueError(f"table {option.name!r}: no hybrid cost model for sharding type {sharding!r}")
        row_wise = sharding == ShardingType.ROW_WISE.value
        leaves = (world - 1) / world  # the share of an all-to-all's bytes that goes to other ranks
        local_ids, local_bags = self._ids_and_bags(option)  # one rank's batch
        ids_global, bags_global = local_ids * world, local_bags * world
        share = 1.0 / world if row_wise else 1.0  # row-wise: owner(id) spreads the ids evenly
        out_bytes = DATA_TYPE_NUM_BITS[option.output_dtype] / 8 if option.output_dtype else OUTPUT_BYTES
        training = not self._is_inference
        cache = option_cache(option)
        swap_s = self._swap_s_per_row(option, cache, training) if cache is not None else 0.0
        costs = []
        for shard in option.shards:
            dim = int(shard.size[1])
            ids = ids_global * share
            # Pooled: a shard computes every sample's bag (row-wise: partial sums). Unpooled: one
            # embedding per id it looks up.
            outputs = bags_global if option.is_pooled else ids
            host_s = c.host_map_s_per_table + ids * c.host_map_s_per_id
            if row_wise:
                host_s += local_ids * c.bucket_s_per_id  # this rank buckets its own ids of the table
            id_bytes = leaves * (ids * ID_BYTES + bags_global * LENGTH_BYTES)
            output_bytes = outputs * dim * out_bytes
            lookup_fwd = ids * c.lookup_fwd_s_per_id + ids * dim * c.lookup_fwd_s_per_value
            lookup_fwd += outputs * dim * c.lookup_fwd_s_per_output
            lookup_bwd = ids * c.lookup_bwd_s_per_id + ids * dim * c.lookup_bwd_s_per_value
            lookup_bwd += outputs * dim * c.lookup_bwd_s_per_output
            misses = cache_s = 0.0
            if cache is not None:
                stats = option.cache_params.stats if option.cache_params is not None else None
                # Distinct rows: the statistics' per global batch, this shard's share; else every id.
                distinct = min(ids, stats.expected_lookups * share) if stats is not None else ids
                misses = distinct * expected_miss_rate(cache.load_factor, option.cache_params)
                cache_s = c.cache_s_per_table + ids * c.cache_s_per_id + misses * swap_s
            costs.append(
                ShardCost(
                    ids=ids,
                    outputs=outputs,
                    host_s=host_s,
                    id_bytes=id_bytes,
                    id_comm_s=id_bytes * c.comm_s_per_byte,
                    lookup_fwd_s=lookup_fwd,
                    lookup_bwd_s=lookup_bwd if training else 0.0,
                    output_bytes=output_bytes,
                    output_comm_s=leaves * output_bytes * c.comm_s_per_byte,
                    misses=misses,
                    cache_s=cache_s,
                )
            )
        return costs

    def _swap_s_per_row(self, option: ShardingOption, cache: TableCacheSpec, training: bool) -> float:
        """Seconds per missed row of a cached table: its swap-in and, in training, its swap-out."""
        c = self._costs
        row = fused_row_bytes(option, [1] * option.num_shards, is_inference=self._is_inference)[0]
        per_copy = row * c.swap_s_per_byte
        if self._topology.compute_device != "cpu":  # the row crosses between host and device memory
            per_copy += row / (MS * self._topology.hbm_to_ddr_mem_bw)  # bandwidths are in bytes/ms
        if cache.store == "file":  # a page of the store's files, read (and written back) on the SSD
            per_copy += max(row, FILE_PAGE_BYTES) / (MS * self._topology.ssd_mem_bw)
        seconds = c.swap_in_s_per_row + per_copy
        if training:
            seconds += c.swap_out_s_per_row + per_copy
        return seconds

    def _ids_and_bags(self, option: ShardingOption) -> tuple[float, float]:
        """Ids and bags of the table's features in one rank's batch."""
        num_poolings = get_num_poolings(self._constraints, option)
        constraint = (self._constraints or {}).get(option.name)
        batch_sizes = (
            list(constraint.batch_sizes)
            if constraint is not None and constraint.batch_sizes
            else [option.batch_size] * option.num_inputs
        )
        ids = sum(b * p * n for b, p, n in zip(batch_sizes, option.input_lengths, num_poolings, strict=True))
        bags = sum(b * n for b, n in zip(batch_sizes, num_poolings, strict=True))
        return float(ids), float(bags)


class HybridPerfModel(PerfModel):
    """The planner's plan rating with the fixed costs of hash tables' sharding groups.

    TorchRec's ``NoopPerfModel`` (the busiest rank's sum of shard perf) plus, for each sharding
    group of hash tables in the plan (one per module and sharding type: its collectives, kernel
    calls and host stage call, paid on every rank), :meth:`HybridCosts.group_s`. A plan that
    mixes row- and table-wise tables in one module pays for two groups.

    Args:
        topology (Topology): the planner's topology.
        costs (HybridCosts): the constants; :data:`DEFAULT_COSTS` by default.
        is_inference (bool): no backward.

    Example::

        planner = EmbeddingShardingPlanner(
            topology=topology,
            enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=B),
            performance_model=HybridPerfModel(topology),
        )
    """

    def __init__(self, topology: Topology, costs: HybridCosts = DEFAULT_COSTS, is_inference: bool = False) -> None:
        self._topology = topology
        self._costs = costs
        self._is_inference = is_inference
        self._noop = NoopPerfModel(topology)

    def rate(self, plan: list[ShardingOption]) -> float:
        groups = {(o.path, o.sharding_type) for o in plan if is_hash_option(o)}
        on_cpu = self._topology.compute_device == "cpu"
        group_ms = MS * self._costs.group_s(on_cpu=on_cpu, training=not self._is_inference)
        return float(self._noop.rate(plan)) + len(groups) * group_ms
