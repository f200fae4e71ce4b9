"""``lookup_in_groups``: a serving collection's id lookup and embedding lookup, split by features
over threads.

A forward maps raw ids to rows with recsdk's ``pruned_slots_lookup`` op
(:mod:`recsdk.embedding.slot_lookup`: FBGEMM's ``pruned_hashmap_lookup``, its probes prefetched,
about twice as fast) from :data:`NATIVE_MIN_IDS` ids, with FBGEMM's own below that (the op's
dispatch through Python costs more than it saves there) or where recsdk's kernel is not built,
and looks the rows up with FBGEMM's inference op
(``int_nbit_split_embedding_codegen_lookup_function``, what
``IntNBitTableBatchedEmbeddingBagsCodegen`` runs). Both kernels run on the calling thread only,
and both release the GIL. So the features are cut into contiguous groups of about as many ids
each (:func:`feature_bounds`), and every group but the first is looked up by a task of
``torch.jit.fork`` on torch's inter-op thread pool while the calling thread looks up the first.
Each group runs both kernels on its own slice of the batch (its ids and their offsets, less the
first), the same slots and rows, only fewer features, so the scores equal those of one call for
all features bit for bit. The
lookups are TorchScript functions, so their forks run in parallel when called from eager Python
too (a Python function's ``torch.jit.fork`` runs at once, on the calling thread).

A group costs a fork and its wait (tens of microseconds), so a batch is split only from
:data:`MIN_IDS_PER_GROUP` ids per group; one group calls the kernels on the calling thread, as
one call for every feature would.
"""

from typing import NamedTuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

from recsdk.embedding import slot_lookup  # noqa: F401  (defines torch.ops.recsdk.pruned_slots_lookup)

__all__ = [
    "MIN_IDS_PER_GROUP",
    "NATIVE_MIN_IDS",
    "KernelView",
    "feature_bounds",
    "kernel_view",
    "lookup_features",
    "lookup_in_groups",
]

MIN_IDS_PER_GROUP = 1024
"""A batch is split into at most ``ids // MIN_IDS_PER_GROUP`` groups (a fork costs more than
looking up fewer ids)."""

NATIVE_MIN_IDS = 512
"""A group of at least this many ids maps them with ``torch.ops.recsdk.pruned_slots_lookup``
(fewer: with FBGEMM's ``pruned_hashmap_lookup``, whose dispatch costs a few microseconds less)."""


class KernelView(NamedTuple):
    """What FBGEMM's inference op reads of an ``IntNBitTableBatchedEmbeddingBagsCodegen``, one
    entry per feature (a table read by several features appears once per feature).

    Attributes:
        weights (torch.Tensor): the rows of every table, bytes (``weights_host``).
        uvm_weights (torch.Tensor): unused on CPU (empty).
        placements (torch.Tensor): int32 ``[F]``: where each feature's table lives.
        offsets (torch.Tensor): int64 ``[F]``: byte offset of each feature's table in ``weights``.
        types (torch.Tensor): uint8 ``[F]``: FBGEMM's row type of each feature's table.
        dim_offsets (torch.Tensor): int32 ``[F + 1]``: each feature's first output column.
        cache_weights (torch.Tensor): the (empty) cache of a CPU kernel.
        cache_locations (torch.Tensor): int32 ``[0]``: no cache.
        ints (list[int]): pooling mode, output dtype, row alignment, the sum of the dims, the
            largest int2, int4, int8, fp16, fp32 and fp8 dims, fp8 exponent bits and bias.
    """

    weights: torch.Tensor
    uvm_weights: torch.Tensor
    placements: torch.Tensor
    offsets: torch.Tensor
    types: torch.Tensor
    dim_offsets: torch.Tensor
    cache_weights: torch.Tensor
    cache_locations: torch.Tensor
    ints: list[int]


def kernel_view(kernel: IntNBitTableBatchedEmbeddingBagsCodegen) -> KernelView:
    """The :class:`KernelView` of a CPU ``kernel`` whose weights are initialized (its tensors,
    not copies: rows written into the kernel later are read).

    Example::

        view = kernel_view(collection.tbe)
    """
    return KernelView(
        kernel.weights_host,
        kernel.weights_uvm,
        kernel.weights_placements,
        kernel.weights_offsets,
        kernel.weights_tys,
        kernel.D_offsets,
        kernel.lxu_cache_weights,
        torch.empty(0, dtype=torch.int32),
        [
            int(kernel.pooling_mode),
            kernel.output_dtype,
            kernel.row_alignment,
            kernel.total_D,
            kernel.max_int2_D,
            kernel.max_int4_D,
            kernel.max_int8_D,
            kernel.max_float16_D,
            kernel.max_float32_D,
            kernel.max_float8_D,
            kernel.fp8_exponent_bits,
            kernel.fp8_exponent_bias,
        ],
    )


def feature_bounds(
    offsets: torch.Tensor,
    batch: int,
    num_features: int,
    threads: int,
    min_ids: int = MIN_IDS_PER_GROUP,
    num_ids: int | None = None,
) -> list[int]:
    """Cut ``num_features`` features into at most ``threads`` contiguous groups of about as many ids.

    Args:
        offsets (torch.Tensor): int64 ``[num_features * batch + 1]``, the batch's offsets.
        batch (int): samples per feature.
        num_features (int): features in the batch.
        threads (int): the most groups.
        min_ids (int): the fewest ids per group.
        num_ids (int | None): ``offsets[-1]`` when the caller has read it already
            (:func:`~recsdk.serving.batch_checks.check_batch` returns it); read here if ``None``.

    Returns:
        list[int]: ``[0, ..., num_features]``, group ``g`` being features
        ``bounds[g]:bounds[g + 1]``; ``[0, num_features]`` when the batch is not split (one
        thread, one feature, or fewer than ``2 * min_ids`` ids).

    Example::

        feature_bounds(offsets, 512, 4, 2)  # [0, 2, 4] for 4 features of as many ids
    """
    total = int(offsets[-1]) if num_ids is None else num_ids
    groups = min(threads, num_features, total // min_ids)
    if groups <= 1:
        return [0, num_features]
    starts: list[int] = offsets[::batch].tolist()  # feature f's first id; starts[-1] == total
    bounds = [0]
    for g in range(1, groups):
        target = total * g / groups
        f = bounds[-1] + 1
        last = num_features - (groups - g)  # leave a feature for each group after this one
        while f < last and abs(starts[f + 1] - target) <= abs(starts[f] - target):
            f += 1
        bounds.append(f)
    bounds.append(num_features)
    return bounds


@torch.jit.script
def lookup_features(
    values: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    batch: int,
    first: int,
    end: int,
    slots: torch.Tensor,
    slot_offsets: torch.Tensor,
    minus_one: torch.Tensor,
    kernel: KernelView,
    native_min_ids: int = -1,
) -> torch.Tensor:
    """Look features ``first:end`` of a batch up: their ids' rows, then the kernel's output.

    Args:
        values (torch.Tensor): int64 ``[n]``, the batch's raw ids (every feature's).
        offsets (torch.Tensor): int64 ``[F * batch + 1]``, the batch's offsets (checked).
        weights (torch.Tensor | None): float32 ``[n]`` per-id weights, or ``None``.
        batch (int): samples per feature.
        first (int): the group's first feature.
        end (int): one past its last feature.
        slots (torch.Tensor): int64 ``[S, 2]``, every feature's slots of FBGEMM's hash index.
        slot_offsets (torch.Tensor): int64 ``[F + 1]``, each feature's first slot.
        minus_one (torch.Tensor): int64 ``[m, 3]``: (first feature, end feature, row) of the
            tables holding the id ``-1``, which the slots cannot hold.
        kernel (KernelView): the rows.
        native_min_ids (int): from how many ids of the group the rows come from
            ``torch.ops.recsdk.pruned_slots_lookup`` (:data:`NATIVE_MIN_IDS`) instead of FBGEMM's
            ``pruned_hashmap_lookup`` (the same rows); negative: never (recsdk's kernel not built).

    Returns:
        torch.Tensor: pooled: float32 ``[batch, D]`` (``D`` the group's dims); unpooled: one row
        per id of the group, ``[offsets[end * batch] - offsets[first * batch], dim]``.

    Example::

        pooled = lookup_features(values, offsets, None, batch, 0, 2, slots, slot_offsets, minus_one, view, 512)
    """
    placements, table_offsets, types, dims = kernel.placements, kernel.offsets, kernel.types, kernel.dim_offsets
    total_dim, begin, group_offsets = kernel.ints[3], 0, offsets
    if first > 0 or end < types.numel():  # a group: its features' ids (views) and kernel entries
        group_offsets = offsets[first * batch : end * batch + 1]
        begin, stop = int(group_offsets[0]), int(group_offsets[-1])
        values = values[begin:stop]  # so that an unpooled output has only their rows
        if weights is not None:
            weights = weights[begin:stop]
        if begin > 0:
            group_offsets = group_offsets - begin
        placements, table_offsets, types = placements[first:end], table_offsets[first:end], types[first:end]
        dims = dims[first : end + 1]
        total_dim = int(dims[-1] - dims[0])
        dims = dims - dims[0]
    if 0 <= native_min_ids <= values.numel():
        rows = torch.ops.recsdk.pruned_slots_lookup(values, group_offsets, slots, slot_offsets[first : end + 1])
    else:
        rows = torch.ops.fbgemm.pruned_hashmap_lookup(values, group_offsets, slots, slot_offsets[first : end + 1])
    for i in range(minus_one.shape[0]):
        lo, hi = max(int(minus_one[i, 0]), first), min(int(minus_one[i, 1]), end)
        if lo < hi:
            first_id, end_id = int(offsets[lo * batch]) - begin, int(offsets[hi * batch]) - begin
            held = rows[first_id:end_id].masked_fill(values[first_id:end_id] == -1, int(minus_one[i, 2]))
            rows[first_id:end_id] = held
    ints = kernel.ints
    return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
        dev_weights=kernel.weights,
        uvm_weights=kernel.uvm_weights,
        weights_placements=placements,
        weights_offsets=table_offsets,
        weights_tys=types,
        D_offsets=dims,
        total_D=total_dim,
        max_int2_D=ints[4],
        max_int4_D=ints[5],
        max_int8_D=ints[6],
        max_float16_D=ints[7],
        max_float32_D=ints[8],
        indices=rows,
        offsets=group_offsets,
        pooling_mode=ints[0],
        indice_weights=weights,
        output_dtype=ints[1],
        lxu_cache_weights=kernel.cache_weights,
        lxu_cache_locations=kernel.cache_locations,
        row_alignment=ints[2],
        max_float8_D=ints[9],
        fp8_exponent_bits=ints[10],
        fp8_exponent_bias=ints[11],
    )


@torch.jit.script
def lookup_in_groups(
    values: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    batch: int,
    bounds: list[int],
    slots: torch.Tensor,
    slot_offsets: torch.Tensor,
    minus_one: torch.Tensor,
    kernel: KernelView,
    pooled: bool,
    native_min_ids: int = -1,
) -> torch.Tensor:
    """:func:`lookup_features` of every group of ``bounds``, the first on the calling thread, the
    others forked; their outputs joined in feature order.

    Args:
        values, offsets, weights, batch, slots, slot_offsets, minus_one, kernel, native_min_ids:
            as for :func:`lookup_features` (``native_min_ids`` applies to each group).
        bounds (list[int]): the groups, from :func:`feature_bounds`.
        pooled (bool): whether the kernel pools (outputs side by side) or not (one below the other).

    Returns:
        torch.Tensor: pooled: float32 ``[batch, sum(dims)]``; unpooled: ``[n, dim]``.

    Example::

        bounds = feature_bounds(offsets, batch, len(features), 2)
        pooled = lookup_in_groups(kjt.values(), offsets, None, batch, bounds, slots, slot_offsets,
                                  minus_one, kernel_view(tbe), True, NATIVE_MIN_IDS)
    """
    futures: list[torch.jit.Future[torch.Tensor]] = []
    for g in range(1, len(bounds) - 1):
        futures.append(
            torch.jit.fork(
                lookup_features,
                values,
                offsets,
                weights,
                batch,
                bounds[g],
                bounds[g + 1],
                slots,
                slot_offsets,
                minus_one,
                kernel,
                native_min_ids,
            )
        )
    out = lookup_features(
        values, offsets, weights, batch, bounds[0], bounds[1], slots, slot_offsets, minus_one, kernel, native_min_ids
    )
    if len(futures) == 0:
        return out
    outputs = [out]
    for future in futures:
        outputs.append(torch.jit.wait(future))
    return torch.cat(outputs, 1 if pooled else 0)
