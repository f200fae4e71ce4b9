"""Every use of TorchRec/FBGEMM/torch internals in recsdk-sharding, each with why.

recsdk pins TorchRec exactly (``requirements/constraints.txt``); these are the places that read
or write what TorchRec does not publish. A TorchRec upgrade touches this file only: the rest of
the package uses the names this module defines and TorchRec's public API (plus the hooks
TorchRec's classes are subclassed by: an awaitable's ``_wait_impl``, a module's ``forward``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

# A sharding plan's shard layout (torch keeps these classes in the private ``_shard`` package;
# TorchRec's ParameterSharding.sharding_spec takes them): for cache_plan and cache_costs.
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.dist_data import KJTAllToAll, _get_recat
from torchrec.distributed.embedding import EmbeddingCollectionContext
from torchrec.distributed.embedding_types import ShardedEmbeddingTable
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import calculate_shard_storages
from torchrec.distributed.planner.types import SharderData, Storage
from torchrec.distributed.types import StorageUsageType, compute_storage_usage
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "EnumerableShardingSpec",
    "ShardMetadata",
    "disable_mean_pooling_callback",
    "fused_lookups",
    "input_dist_ready",
    "local_shards",
    "num_features",
    "optimizers_of",
    "output_recat",
    "quantized_comms",
    "queue_backward_callback",
    "replace_fused_optimizer",
    "sharding_device",
    "sharding_group",
    "without_range_warnings",
]

# ---- sharded modules

# TorchRec validates a module's first batch against [0, num_embeddings) and logs each id out of
# that range; raw ids never are in it. The filter is keyed on the message text because the
# validator logs through a module logger with no finer switch.
_VALIDATOR_LOGGER = logging.getLogger("torchrec.sparse.jagged_tensor_validator")


def _drop_range_warnings(record: logging.LogRecord) -> bool:
    return "which is out of range" not in record.getMessage()


@contextmanager
def without_range_warnings() -> Iterator[None]:
    """Silence the first-batch validator's id-range warnings (its other checks still log)."""
    _VALIDATOR_LOGGER.addFilter(_drop_range_warnings)
    try:
        yield
    finally:
        _VALIDATOR_LOGGER.removeFilter(_drop_range_warnings)


def input_dist_ready(module: Any) -> bool:
    """Whether a sharded EBC or EC has built its input dists (after its first batch).

    TorchRec keeps this in ``_has_uninitialized_input_dist``.
    """
    return not bool(module._has_uninitialized_input_dist)


def disable_mean_pooling_callback(module: Any) -> None:
    """Turn off a sharded EBC's own mean (row-wise MEAN tables: a divisor built in its input dist,
    applied as a callback), which TorchRec keeps in ``_has_mean_pooling_callback``."""
    module._has_mean_pooling_callback = False


def local_shards(module: Any) -> Iterator[ShardedEmbeddingTable]:
    """This rank's table shards of a sharded embedding module, over all its shardings.

    TorchRec keeps them in each sharding's ``_grouped_embedding_configs`` (no public accessor);
    the shardings themselves in ``_embedding_shardings`` (EBC) or ``_sharding_type_to_sharding``
    (EC).
    """
    shardings = getattr(module, "_sharding_type_to_sharding", None)
    for sharding in module._embedding_shardings if shardings is None else shardings.values():
        for grouped in sharding._grouped_embedding_configs:
            yield from grouped.embedding_tables


def fused_lookups(module: Any) -> list[torch.nn.Module]:
    """The sharded module's lookups (``_lookups``), which hold the fused kernels."""
    return list(module._lookups)


def optimizers_of(combined: CombinedOptimizer) -> list[tuple[str, KeyedOptimizer]]:
    """The ``(key, optimizer)`` pairs of a CombinedOptimizer, keys as given (``_optims``).

    The public ``optimizers`` property prefixes keys; rebuilding one needs the originals.
    """
    return list(combined._optims)


def replace_fused_optimizer(module: Any, optimizer: CombinedOptimizer) -> None:
    """Make ``optimizer`` the sharded module's ``fused_optimizer`` (TorchRec stores it in ``_optim``)."""
    module._optim = optimizer


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass in progress has finished (fused kernels' updates included).

    torch exposes this only through the autograd engine's ``queue_callback``; call it from a
    tensor hook during backward.
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def output_recat(
    local_split: int, num_splits: int, stagger: int, device: torch.device, batch_size_per_rank: list[int] | None
) -> torch.Tensor | None:
    """The permutation TorchRec's KJT all-to-all applies to a received KJT (rank-major to feature-major).

    TorchRec computes it in the private ``torchrec.distributed.dist_data._get_recat`` and keeps it
    on its tensors awaitable (``_recat``), where its shardings read it; ``FusedKJTAllToAll``
    builds that awaitable itself, so it needs the same permutation, computed the same way.
    """
    return _get_recat(
        local_split=local_split,
        num_splits=num_splits,
        stagger=stagger,
        device=device,
        batch_size_per_rank=batch_size_per_rank,
    )


# ---- KJT all-to-all (kjt_all_to_all.py)
#
# FusedKJTAllToAll subclasses TorchRec's KJTAllToAll and returns awaitables subclassing TorchRec's
# KJT all-to-all awaitables, built without their constructors (which issue TorchRec's own
# all-to-alls). TorchRec's shardings and pipelines read the splits, recat and strides off the
# awaitables' private fields; these set them, and read the all-to-all's own.

__all__ += ["KJTAllToAllLayout", "init_kjt_splits_awaitable", "init_kjt_tensors_awaitable", "kjt_all_to_all_layout"]


class KJTAllToAllLayout(NamedTuple):
    """What a ``KJTAllToAll`` was built with: its group, features sent to each rank, their
    running sums (``splits_cumsum[r]``: the first feature of rank ``r``), its stagger."""

    pg: dist.ProcessGroup
    splits: list[int]
    splits_cumsum: list[int]
    stagger: int


def kjt_all_to_all_layout(a2a: KJTAllToAll) -> KJTAllToAllLayout:
    """A ``KJTAllToAll``'s layout (``_pg``, ``_splits``, ``_splits_cumsum``, ``_stagger``; no accessors)."""
    return KJTAllToAllLayout(a2a._pg, a2a._splits, a2a._splits_cumsum, a2a._stagger)


def init_kjt_splits_awaitable(awaitable: Any, *, pg: dist.ProcessGroup, input: KeyedJaggedTensor) -> None:
    """Give a ``KJTAllToAllSplitsAwaitable`` built without its constructor the fields TorchRec's
    pipelines read off one (``_pg``, ``_workers``, ``_input``: their fused splits look at the
    input's keys and variable strides)."""
    awaitable._pg = pg
    awaitable._workers = pg.size()
    awaitable._input = input


def init_kjt_tensors_awaitable(
    awaitable: Any,
    *,
    pg: dist.ProcessGroup,
    input: KeyedJaggedTensor,
    keys: list[str],
    recat: torch.Tensor | None,
    stagger: int,
    stride_per_rank: list[int],
    input_splits: dict[str, list[int]],
    output_splits: dict[str, list[int]],
) -> None:
    """Give a ``KJTAllToAllTensorsAwaitable`` built without its constructor the fields TorchRec's
    constructor sets, which its shardings read off one (``_input_splits``, ``_output_splits``
    by tensor label, ``_recat``, ``_stride_per_rank``: the unpooled output dists and unequal
    batch sizes need them) as do its pipelines (``_pg``, ``_workers``, ``_world_size``,
    ``_input``, ``_keys``, ``_stagger``)."""
    awaitable._workers = awaitable._world_size = pg.size()
    awaitable._pg = pg
    awaitable._input = input
    awaitable._keys = keys
    awaitable._recat = recat
    awaitable._stagger = stagger
    awaitable._stride_per_rank = stride_per_rank
    awaitable._input_splits = input_splits
    awaitable._output_splits = output_splits


__all__ += ["features_all_to_all", "set_features_all_to_all"]


def set_features_all_to_all(features_dist: torch.nn.Module, a2a: KJTAllToAll) -> None:
    """Make ``a2a`` the ``KJTAllToAll`` of a sparse features dist (input_dist.py): TorchRec's
    pipelines find it in the dist's ``_dist`` (to swap in their fused-splits forward)."""
    features_dist._dist = a2a


def features_all_to_all(features_dist: torch.nn.Module) -> KJTAllToAll:
    """The ``KJTAllToAll`` of a sparse features dist (``_dist``)."""
    return features_dist._dist  # type: ignore[return-value]


# ---- planner (planner.py)

__all__ += ["KernelHookEnumerator"]


class KernelHookEnumerator(EmbeddingEnumerator):
    """TorchRec's ``EmbeddingEnumerator`` with a hook on the compute kernels it enumerates.

    TorchRec filters the kernels a table's sharder offers (by the table's constraint, the guarded
    kernels, SSD capacity) in the private ``_filter_compute_kernels``; this enumerator first
    passes them through :meth:`_kernels_of`, which a subclass overrides.
    """

    def _kernels_of(self, name: str, offered: list[str]) -> list[str]:
        """The kernels to offer TorchRec's filter for table ``name``, given its sharder's ``offered``."""
        return offered

    def _filter_compute_kernels(self, name: str, allowed_compute_kernels: list[str], sharding_type: str) -> list[str]:
        kernels = self._kernels_of(name, allowed_compute_kernels)
        return super()._filter_compute_kernels(name, kernels, sharding_type)  # type: ignore[no-any-return]


# ---- sharders (sharders.py)

__all__ += ["sharded_module_order_overwrite"]


def sharded_module_order_overwrite(sharder: Any) -> list[str] | None:
    """What an ``EmbeddingBagCollectionSharder`` passes its sharded modules as
    ``sharded_module_order_overwrite`` (its constructor's argument, lowercased; ``_sharded_module_order_overwrite``)."""
    return sharder._sharded_module_order_overwrite  # type: ignore[no-any-return]


# ---- checkpoint and export

__all__ += ["copy_sharded_", "empty_sharded_like", "is_sharded_tensor", "wrapped_optimizer"]


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a ShardedTensor (TorchRec's sharded weights and their optimizer state).

    torch keeps the class in the private ``torch.distributed._shard.sharded_tensor``.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def empty_sharded_like(value: Any) -> Any:
    """A ShardedTensor with ``value``'s layout and uninitialised local shards (a staging buffer).

    Built from ``value``'s own metadata and ``_process_group`` without a collective, through
    torch's private ``_init_from_local_shards_and_global_metadata`` (the public constructor
    all-gathers the shards' metadata).
    """
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    shards = [Shard(torch.empty_like(s.tensor), s.metadata) for s in value.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, value.metadata(), process_group=value._process_group
    )


def copy_sharded_(dest: Any, source: Any) -> None:
    """Copy the local shards of the ShardedTensor ``source`` into those of ``dest`` (same layout)."""
    for d, s in zip(dest.local_shards(), source.local_shards(), strict=True):
        d.tensor.detach().copy_(s.tensor)


def wrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer a TorchRec ``OptimizerWrapper`` wraps (kept in ``_optimizer``, no accessor)."""
    return optimizer._optimizer


def sharding_group(sharding: Any) -> Any:
    """The device process group of a TorchRec embedding sharding or output dist (``_pg``; no accessor)."""
    return sharding._pg


def sharding_device(sharding: Any) -> Any:
    """The device a TorchRec embedding sharding was built for (``_device``; no accessor)."""
    return sharding._device


def num_features(sharding: Any) -> int:
    """Features a TorchRec row-wise sharding's input dist receives (``_get_num_features``)."""
    return int(sharding._get_num_features())


def quantized_comms(output_dist: Any) -> bool:
    """Whether a TorchRec pooled output dist was given quantized-comm codecs (``_codecs``)."""
    return output_dist._codecs is not None


__all__ += ["has_output_callbacks", "output_dists", "tw_all_to_all", "tw_dim_sum_per_rank", "tw_output_dist_kwargs"]


def output_dists(module: Any) -> list[Any]:
    """A TorchRec sharded embedding module's output dists, one per sharding group (``_output_dists``)."""
    return list(module._output_dists)


def tw_output_dist_kwargs(sharding: Any, device: Any) -> dict[str, Any]:
    """What TorchRec's ``TwPooledEmbeddingSharding.create_output_dist`` builds its
    ``TwPooledEmbeddingDist`` with (``_pg``, ``_dim_sum_per_rank()``,
    ``_emb_dim_per_rank_per_feature()``, ``_device``)."""
    return {
        "pg": sharding._pg,
        "dim_sum_per_rank": sharding._dim_sum_per_rank(),
        "emb_dim_per_rank_per_feature": sharding._emb_dim_per_rank_per_feature(),
        "device": device if device is not None else sharding._device,
        "qcomm_codecs_registry": sharding.qcomm_codecs_registry,
    }


def tw_dim_sum_per_rank(output_dist: Any) -> list[int]:
    """The embedding columns each rank sends in a ``TwPooledEmbeddingDist`` (``_dim_sum_per_rank``)."""
    return list(output_dist._dim_sum_per_rank)


def has_output_callbacks(output_dist: Any) -> bool:
    """Whether a ``TwPooledEmbeddingDist`` applies callbacks to its output (``_callbacks``)."""
    return bool(output_dist._callbacks)


def tw_all_to_all(output_dist: Any, sharding_ctx: Any) -> Any:
    """The ``PooledEmbeddingsAllToAll`` of a ``TwPooledEmbeddingDist`` (``_dist``, which TorchRec
    builds on the first call with ``_create_output_dist_module``)."""
    if output_dist._dist is None:
        output_dist._create_output_dist_module(sharding_ctx)
    return output_dist._dist


def user_sharding_plan(module: Any, plan: Mapping[str, Any]) -> Any:
    """``module_sharding_plan`` set back to the user's plan for the module's tables.

    TorchRec's constructor sets it from the plan it was given; a module with cached tables gave
    it the kernels' plan (``cache_plan.device_plan``), and keeps the user's, which says where the
    stores' rows are.
    """
    return {name: plan[name] for name in module.module_sharding_plan}


# ---- TorchRec 1.6
#
# recsdk pins TorchRec 1.8; the lent GPU machine runs TorchRec 1.6.1 (the release built for its
# torch). Each shim below is keyed on the feature it stands in for and does exactly what it did
# before on 1.8.

__all__ += ["base_shard_storages", "init_ec_context"]

# TorchRec 1.8's calculate_shard_storages takes ``sharder_data`` (a picklable SharderData); 1.6
# takes the ``sharder`` itself and reads only its ``storage_usage``.
_STORAGES_TAKE_SHARDER_DATA = "sharder_data" in inspect.signature(calculate_shard_storages).parameters


class _BaseStorageSharder:
    """The part of a sharder TorchRec 1.6's ``calculate_shard_storages`` reads, with the rule 1.8
    applies for ``StorageUsageType.BASE``."""

    def storage_usage(self, tensor: torch.Tensor, compute_device_type: str, compute_kernel: str) -> dict[str, int]:
        return compute_storage_usage(tensor, compute_device_type, compute_kernel, StorageUsageType.BASE)


def base_shard_storages(**kwargs: Any) -> list[Storage]:
    """``calculate_shard_storages(**kwargs)`` with the base storage rule (no fused params, no
    quantized comms): ``sharder_data=SharderData(..., StorageUsageType.BASE)`` on TorchRec 1.8, a
    sharder with that rule on 1.6."""
    if _STORAGES_TAKE_SHARDER_DATA:
        kwargs["sharder_data"] = SharderData(
            fused_params={}, qcomm_dtype_sizes={}, storage_usage_type=StorageUsageType.BASE
        )
    else:  # TorchRec 1.6
        kwargs["sharder"] = _BaseStorageSharder()
    return calculate_shard_storages(**kwargs)


# TorchRec 1.8's EmbeddingCollectionContext is a dataclass: a dataclass subclass's __init__ fills
# its fields (sharding_contexts, input_features, ...). 1.6's is a plain class whose own __init__,
# which that generated __init__ never calls, makes them.
_EC_CONTEXT_IS_DATACLASS = dataclasses.is_dataclass(EmbeddingCollectionContext)


def init_ec_context(ctx: EmbeddingCollectionContext) -> None:
    """Give ``ctx``, of a dataclass subclass of TorchRec's ``EmbeddingCollectionContext``, the
    attributes TorchRec's constructor makes; call from its ``__post_init__``. Nothing on 1.8."""
    if _EC_CONTEXT_IS_DATACLASS:
        return
    for name, value in vars(EmbeddingCollectionContext()).items():  # TorchRec 1.6: its defaults
        ctx.__dict__.setdefault(name, value)
