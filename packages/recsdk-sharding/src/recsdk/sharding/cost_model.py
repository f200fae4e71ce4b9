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
pipeline measured 1.10x the plain loop, against a 1.20x ceiling). With the hybrid pipeline on
an accelerator, pass ``host_overlap=1.0``.

Other compute devices: the lookup and the output dist are TorchRec's kernels and collectives on
the device, so they keep TorchRec's estimate; the host id work and the gloo id all-to-alls
are added as above (the host constants hold for the host).

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

from dataclasses import dataclass

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

from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingCollection

__all__ = [
    "DEFAULT_COSTS",
    "HybridCosts",
    "HybridPerfEstimator",
    "HybridPerfModel",
    "ShardCost",
    "is_hash_option",
]

ID_BYTES = 8  # raw int64 ids
LENGTH_BYTES = 4  # int32 bag lengths
OUTPUT_BYTES = 4  # fp32 embeddings out of the fused kernel (a sharding option's output_dtype overrides)
MS = 1000.0  # TorchRec's Perf is in milliseconds


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

    Per sharding group (module and sharding type) and rank, used by :class:`HybridPerfModel`:

    Attributes:
        host_map_s_per_call: the host stage's fixed cost per call.
        lookup_fwd_s_per_call, lookup_bwd_s_per_call: the fused kernel's fixed cost per call.
        comm_s_per_call: a gloo all-to-all's latency, back to back as a step issues them.
        collectives_per_group: all-to-alls per group and step in training: the input dist's
            splits, lengths and ids, the output dist forward and backward (counted in a profile
            of a training step; 4 in inference, without the backward).
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
    collectives_per_group: int = 5

    def group_s(self, *, on_cpu: bool = True, training: bool = True) -> float:
        """Fixed seconds per step of one sharding group of hash tables, on every rank."""
        collectives = self.collectives_per_group if training else self.collectives_per_group - 1
        seconds = self.host_map_s_per_call
        if on_cpu:  # elsewhere the kernels and the output dist are the device's (TorchRec's estimate)
            seconds += self.lookup_fwd_s_per_call + (self.lookup_bwd_s_per_call if training else 0.0)
            return seconds + collectives * self.comm_s_per_call
        return seconds + 3 * self.comm_s_per_call  # the input dist's all-to-alls stay on gloo


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
x dim fitted as 0 here (it is bound by the ids and the bags, not the dim, up to dim 128)."""


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

    def perf(self, host_overlap: float = 0.0, training: bool = True) -> Perf:
        """The shard's :class:`Perf` in milliseconds, with ``host_overlap`` of the host work hidden."""
        visible = 1.0 - host_overlap
        return Perf(
            fwd_compute=MS * (self.lookup_fwd_s + visible * self.host_s),
            fwd_comms=MS * (self.output_comm_s + visible * self.id_comm_s),
            bwd_compute=MS * self.lookup_bwd_s if training else 0.0,
            bwd_comms=MS * self.output_comm_s if training else 0.0,
            input_dist_comms=MS * host_overlap * self.id_comm_s,
        )


def is_hash_option(option: ShardingOption) -> bool:
    """Whether ``option`` shards a table of a recsdk hash module (the hybrid path)."""
    return isinstance(option.module[1], (HashEmbeddingBagCollection, HashEmbeddingCollection))


class HybridPerfEstimator(ShardEstimator):
    """Perf estimates of recsdk's hybrid shardings for hash tables; TorchRec's for other tables.

    For every sharding option of a :class:`~recsdk.embedding.HashEmbeddingBagCollection` or
    :class:`~recsdk.embedding.HashEmbeddingCollection` table, each shard gets the perf of its
    :class:`ShardCost` (see the module docstring). Options of other modules get TorchRec's
    ``EmbeddingPerfEstimator`` estimate, as do the device parts (lookup, output dist) of hash
    tables on a compute device other than CPU.

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
        torchrec_options = others if on_cpu else sharding_options
        if torchrec_options:
            self._torchrec.estimate(torchrec_options, sharder_data_map)  # type: ignore[arg-type]
        training = not self._is_inference
        for option in hashed:
            for shard, cost in zip(option.shards, self.shard_costs(option), strict=True):
                ours = cost.perf(self._host_overlap, training)
                if on_cpu:
                    shard.perf = ours
                else:
                    device = shard.perf if shard.perf is not None else Perf(0.0, 0.0, 0.0, 0.0)
                    visible = 1.0 - self._host_overlap
                    shard.perf = Perf(
                        fwd_compute=device.fwd_compute + MS * visible * cost.host_s,
                        fwd_comms=device.fwd_comms + MS * visible * cost.id_comm_s,
                        bwd_compute=device.bwd_compute,
                        bwd_comms=device.bwd_comms,
                        input_dist_comms=ours.input_dist_comms,
                        prefetch_compute=device.prefetch_compute,
                    )

    def shard_costs(self, option: ShardingOption) -> list[ShardCost]:
        """The :class:`ShardCost` of each shard of ``option`` (a hash table's row- or table-wise option).

        Raises:
            ValueError: another sharding type (hash tables are row- or table-wise).
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
                )
            )
        return costs

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
