"""What recsdk's hybrid path costs per step, as the planner's cost model counts it: the measured
constants (:class:`HybridCosts`, :data:`DEFAULT_COSTS`), the costs of one hash-table shard
(:class:`ShardCost`), the byte sizes they count in, and which sharding options take them
(:func:`is_hash_option`). How the constants make a shard's and a plan's estimate:
:mod:`~recsdk.sharding.planning.cost_model`.

The constants (:data:`DEFAULT_COSTS`) were measured on this project's CPU machine (2 gloo ranks on a
shared 2-core host, one intra-op thread each, the benchmarks' Zipf ids from ``RandomRecDataset``,
200,000-row tables, exact Adagrad fused into the backward) by::

    python benchmarks/calibrate_cost_model.py

which prints one JSON line per constant (the lower quartile over interleaved repeats, fitted
with non-negative least squares, the median over ranks); paste the values here, or pass your own
:class:`HybridCosts` to :class:`~recsdk.sharding.planning.cost_model.HybridPerfEstimator` /
:class:`~recsdk.sharding.planning.cost_model.HybridPerfModel`. Only ratios
between the constants decide a plan; their absolute values scale with the machine's load.

Example::

    costs = dataclasses.replace(DEFAULT_COSTS, comm_s_per_byte=2e-9)  # a slower network
    HybridPerfEstimator(topology, costs=costs)
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrec.distributed.planner.types import Perf, ShardingOption

from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingCollection

__all__ = [
    "DEFAULT_COSTS",
    "FILE_PAGE_BYTES",
    "ID_BYTES",
    "LENGTH_BYTES",
    "MS",
    "OUTPUT_BYTES",
    "HybridCosts",
    "ShardCost",
    "is_hash_option",
]

ID_BYTES = 8  # raw int64 ids
LENGTH_BYTES = 4  # int32 bag lengths
OUTPUT_BYTES = 4  # fp32 embeddings out of the fused kernel (a sharding option's output_dtype overrides)
MS = 1000.0  # TorchRec's Perf is in milliseconds
FILE_PAGE_BYTES = 4096
"""A file store's unit of transfer: a missed row reads (and a written-back row writes) at least a page."""


@dataclass(frozen=True)
class HybridCosts:
    """Per-step costs of recsdk's hybrid path on one rank, in seconds (see :mod:`~recsdk.sharding.planning.cost_model`).

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

    Per sharding group (module and sharding type) and rank, used by
    :class:`~recsdk.sharding.planning.cost_model.HybridPerfModel`:

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
