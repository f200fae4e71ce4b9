"""Hybrid sharders: what ``DistributedModelParallel`` and the planner use for recsdk modules."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
    replace_placement_with_meta_device,
)
from torchrec.distributed.types import BoundsCheckMode, ModuleSharder, ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingCollection
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.distribution.shardings import HOST_SHARDING_TYPES, GlooRwPooledEmbeddingSharding
from recsdk.sharding.host.table_workers import TableWorkers
from recsdk.sharding.planning.cache_plan import CACHED_KERNELS
from recsdk.sharding.sharded_hash_embedding_bag import ShardedHashEmbeddingBagCollection
from recsdk.sharding.sharded_hash_embedding_collection import ShardedHashEmbeddingCollection

__all__ = [
    "HashEmbeddingBagCollectionSharder",
    "HashEmbeddingCollectionSharder",
    "HybridEmbeddingBagCollectionSharder",
    "HybridShardedEmbeddingBagCollection",
    "get_default_hybrid_sharders",
    "validate_host_env",
]


def validate_host_env(host_env: ShardingEnv) -> None:
    """Check that ``host_env`` is a :class:`ShardingEnv` over a gloo process group.

    Raises:
        TypeError: ``host_env`` is not a ``ShardingEnv``.
        ValueError: its group is missing or its backend is not gloo.
    """
    if not isinstance(host_env, ShardingEnv):
        raise TypeError(f"host_env must be a torchrec ShardingEnv, got {type(host_env).__name__}")
    pg = host_env.process_group
    if pg is None:
        raise ValueError(
            "host_env has no process group: build it with "
            "ShardingEnv(world_size, rank, pg=dist.new_group(backend='gloo'))"
        )
    backend = str(dist.get_backend(pg))
    if backend != "gloo":
        raise ValueError(
            f"host_env.pg must be a gloo process group (the host id work runs on CPU tensors), "
            f"got backend {backend!r}: use dist.new_group(backend='gloo')"
        )


class _HostSharder:
    """What both hash sharders share: the host env, and row-/table-wise with the fused kernel.

    The id work runs on the host over ``host_env``'s gloo group; lookups use TorchRec's fused
    kernel (``compute_kernel="fused"``) on every device type, CPU included. The kernel's rows
    come from the id tables (or a cache's slots), never from the user, so FBGEMM's per-batch
    bounds check of them is off (``bounds_check_mode=BoundsCheckMode.NONE``) unless
    ``fused_params`` sets one. ``host_threads`` tables of a batch are mapped at once (default:
    :func:`~recsdk.sharding.host.table_workers.default_host_threads` of the module's device).
    """

    fused_params: dict[str, Any] | None
    qcomm_codecs_registry: dict[str, Any] | None
    sharded_module_type: Any

    def __init__(
        self,
        host_env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
        host_threads: int | None = None,
    ) -> None:
        validate_host_env(host_env)
        if host_threads is not None:
            TableWorkers(host_threads)  # checked here, before anything is sharded
        self._host_threads = host_threads
        fused_params = {"bounds_check_mode": BoundsCheckMode.NONE, **(fused_params or {})}
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)  # type: ignore[call-arg]
        self._host_env = host_env

    @property
    def host_env(self) -> ShardingEnv:
        return self._host_env

    def shard(
        self,
        module: Any,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> Any:
        return self.sharded_module_type(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            host_env=self._host_env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            host_threads=self._host_threads,
        )

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(HOST_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        # fused: every row in the kernel; the cached kernels: a device cache over a row store in
        # host memory (fused_uvm_caching) or in files (key_value), see cache_plan.py. Offered off
        # CPU, as TorchRec's sharders do; on CPU, HybridEmbeddingEnumerator adds the ones a
        # constraint names (TorchRec's estimators cannot price them on CPU).
        if compute_device_type == "cpu":
            return [EmbeddingComputeKernel.FUSED.value]
        return [EmbeddingComputeKernel.FUSED.value, *CACHED_KERNELS]


class HashEmbeddingBagCollectionSharder(_HostSharder, EmbeddingBagCollectionSharder):
    """Shards :class:`~recsdk.embedding.HashEmbeddingBagCollection` row-wise or table-wise.

    The id work runs on the host over ``host_env``'s gloo group; lookups use TorchRec's fused
    kernel (``compute_kernel="fused"``) on every device type, CPU included.

    Args:
        host_env (ShardingEnv): the host env (gloo group).
        fused_params (dict | None): fused kernel parameters, as TorchRec's sharders take.
        qcomm_codecs_registry (dict | None): as TorchRec's sharders take.
    """

    @property
    def module_type(self) -> type[HashEmbeddingBagCollection]:  # type: ignore[override]
        return HashEmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type[ShardedHashEmbeddingBagCollection]:  # type: ignore[override]
        return ShardedHashEmbeddingBagCollection


class HashEmbeddingCollectionSharder(_HostSharder, EmbeddingCollectionSharder):
    """Shards :class:`~recsdk.embedding.HashEmbeddingCollection` row-wise or table-wise.

    As :class:`HashEmbeddingBagCollectionSharder`, for unpooled tables.

    Args:
        host_env (ShardingEnv): the host env (gloo group).
        fused_params (dict | None): fused kernel parameters, as TorchRec's sharders take.
        qcomm_codecs_registry (dict | None): as TorchRec's sharders take.
    """

    @property
    def module_type(self) -> type[HashEmbeddingCollection]:  # type: ignore[override]
        return HashEmbeddingCollection

    @property
    def sharded_module_type(self) -> type[ShardedHashEmbeddingCollection]:  # type: ignore[override]
        return ShardedHashEmbeddingCollection


class HybridShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """TorchRec's ``ShardedEmbeddingBagCollection`` whose row-wise output dist suits gloo.

    Row-wise tables use :class:`~recsdk.sharding.GlooRwPooledEmbeddingSharding` (an all-to-all
    instead of gloo's slow reduce-scatter; TorchRec's reduce-scatter on other backends); every
    other sharding type is TorchRec's. Built by :class:`HybridEmbeddingBagCollectionSharder`.
    """

    @classmethod
    def create_embedding_bag_sharding(  # type: ignore[override]
        cls,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> EmbeddingSharding:
        if sharding_infos[0].param_sharding.sharding_type != ShardingType.ROW_WISE.value:
            return super().create_embedding_bag_sharding(
                sharding_infos, env, device, permute_embeddings, qcomm_codecs_registry
            )
        if device is not None and device.type == "meta":
            replace_placement_with_meta_device(sharding_infos)
        return GlooRwPooledEmbeddingSharding(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)


class HybridEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """TorchRec's ``EmbeddingBagCollectionSharder`` that also offers row-wise on CPU and NPU.

    TorchRec offers row-wise sharding only for CUDA; its row-wise sharding itself runs on any
    device, so this sharder lists it everywhere. It builds
    :class:`HybridShardedEmbeddingBagCollection` (row-wise output dist as an all-to-all on gloo).

    Args:
        fused_params (dict | None): fused kernel parameters.
        qcomm_codecs_registry (dict | None): as TorchRec's sharders take.
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        if ShardingType.ROW_WISE.value not in types:
            types.append(ShardingType.ROW_WISE.value)
        return types

    def shard(  # type: ignore[override]
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> HybridShardedEmbeddingBagCollection:
        return HybridShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=compat.sharded_module_order_overwrite(self),
        )

    @property
    def sharded_module_type(self) -> type[HybridShardedEmbeddingBagCollection]:  # type: ignore[override]
        return HybridShardedEmbeddingBagCollection


def get_default_hybrid_sharders(
    host_env: ShardingEnv, fused_params: dict[str, Any] | None = None, host_threads: int | None = None
) -> list[ModuleSharder[torch.nn.Module]]:
    """The sharders to pass to the planner and to ``DistributedModelParallel``.

    One each for :class:`~recsdk.embedding.HashEmbeddingBagCollection` and
    :class:`~recsdk.embedding.HashEmbeddingCollection` (hybrid row-wise and table-wise), one for
    TorchRec's plain ``EmbeddingBagCollection`` (its own shardings, plus row-wise on CPU) and
    TorchRec's own for its ``EmbeddingCollection``. Pass the same list to both: a plan made with
    these sharders cannot be executed with TorchRec's defaults.

    Args:
        host_env (ShardingEnv): env over a gloo group for the host id work, e.g.
            ``ShardingEnv(world_size, rank, pg=dist.new_group(backend="gloo"))``.
        fused_params (dict | None): fused kernel parameters for every sharder.
        host_threads (int | None): how many tables of a batch the hash modules map at once
            (``None``: one on a CPU device, else this process's share of the host's cores, at
            most 8; see :func:`~recsdk.sharding.host.table_workers.default_host_threads`).

    Returns:
        list[ModuleSharder]: the sharders.

    Example::

        host_env = ShardingEnv(world_size=world_size, rank=rank, pg=dist.new_group(backend="gloo"))
        sharders = get_default_hybrid_sharders(host_env=host_env)
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
        model = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    """
    validate_host_env(host_env)
    return [
        HashEmbeddingBagCollectionSharder(host_env, fused_params=fused_params, host_threads=host_threads),  # type: ignore[list-item]
        HashEmbeddingCollectionSharder(host_env, fused_params=fused_params, host_threads=host_threads),  # type: ignore[list-item]
        HybridEmbeddingBagCollectionSharder(fused_params=fused_params),  # type: ignore[list-item]
        EmbeddingCollectionSharder(fused_params=fused_params),  # type: ignore[list-item]
    ]
