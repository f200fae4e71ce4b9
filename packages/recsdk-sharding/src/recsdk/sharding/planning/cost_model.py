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
                                its optimizer state (TorchRec's count, ``cache_costs.fused_row_bytes``)
                                copied from the store into the kernel
swap-out, per missed row        ``swap_out_s_per_row`` + row bytes * ``swap_s_per_byte`` (training
(training only)                 only: the slot it takes was changed by a batch and is written back)
across PCIe (CUDA, MTIA)        row bytes / ``Topology.hbm_to_ddr_mem_bw`` per direction
file store (``key_value``)      ``max(row bytes, FILE_PAGE_BYTES) / Topology.ssd_mem_bw`` per
                                direction: a missed row's page is assumed not in the page cache
                                (``key_value`` is for stores larger than host memory)
==============================  ======================================================================

Missed rows per step: the distinct rows a shard looks up times the miss rate
(:func:`~recsdk.sharding.planning.cache_costs.expected_miss_rate`, which says how both are
counted with and without ``CacheParams.stats``). A cached kernel always costs more than ``fused``,
and needs less device memory: the planner picks it only where ``fused`` does not fit.

The constants: :mod:`~recsdk.sharding.planning.hybrid_costs` (:data:`DEFAULT_COSTS`, measured by
``benchmarks/calibrate_cost_model.py``; pass your own :class:`HybridCosts` to
:class:`HybridPerfEstimator` / :class:`HybridPerfModel`).
"""

from __future__ import annotations

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
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import DATA_TYPE_NUM_BITS

from recsdk.sharding.planning.cache_costs import as_fused, expected_miss_rate, fused_row_bytes, option_cache
from recsdk.sharding.planning.cache_plan import TableCacheSpec
from recsdk.sharding.planning.hybrid_costs import (
    DEFAULT_COSTS,
    FILE_PAGE_BYTES,
    ID_BYTES,
    LENGTH_BYTES,
    MS,
    OUTPUT_BYTES,
    HybridCosts,
    ShardCost,
    is_hash_option,
)

__all__ = ["HybridPerfEstimator", "HybridPerfModel"]


class HybridPerfEstimator(ShardEstimator):
    """Perf estimates of recsdk's hybrid shardings for hash tables; TorchRec's for other tables.

    For every sharding option of a :class:`~recsdk.embedding.HashEmbeddingBagCollection` or
    :class:`~recsdk.embedding.HashEmbeddingCollection` table, each shard gets the perf of its
    :class:`ShardCost` (see the module docstring). Options of other modules get TorchRec's
    ``EmbeddingPerfEstimator`` estimate, as do the device parts (lookup, output dist) of hash
    tables on a compute device other than CPU (a cached table's as the ``fused`` kernel TorchRec
    builds for it, :func:`~recsdk.sharding.planning.cache_costs.as_fused`; its device cache's work is added).

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
