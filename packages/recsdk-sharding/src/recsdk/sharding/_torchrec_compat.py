"""Every use of TorchRec/FBGEMM/torch internals in recsdk-sharding, each with why.

recsdk pins TorchRec exactly (``requirements/constraints.txt``); these are the places that read
or write what TorchRec does not publish. A TorchRec upgrade touches this file, and
``kjt_all_to_all.py``, whose awaitables subclass TorchRec's KJT all-to-all awaitables and use
their fields (the splits, recat and strides TorchRec's shardings read off them; the recat is
computed here, :func:`output_recat`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torchrec.distributed.dist_data import _get_recat
from torchrec.distributed.embedding import EmbeddingCollectionContext
from torchrec.distributed.embedding_types import ShardedEmbeddingTable
from torchrec.distributed.planner.shard_estimators import calculate_shard_storages
from torchrec.distributed.planner.types import SharderData, Storage
from torchrec.distributed.types import StorageUsageType, compute_storage_usage
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

__all__ = [
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
