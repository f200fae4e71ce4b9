"""What the constructors of the two sharded hash adapters share, composed by each.

``ShardedHashEmbeddingBagCollection`` and ``ShardedHashEmbeddingCollection`` differ in their
TorchRec base class, their tables' configs and their pooling. Each describes its unsharded module
as a :class:`HashModuleKind`, calls :func:`plan_kernels` before TorchRec's constructor (the
kernels TorchRec builds, cached tables included, and the CPU Adam planned for them) and
:func:`compose_host_shards` after it (the module's
:class:`~recsdk.sharding.host.host_shards.HostShards`).

Example::

    kernels = plan_kernels(_KIND, module, plan, configs, meta_copy=..., grouped_infos=..., device=device)
    self._init_kernels(super().__init__, plan=plan, kernels=kernels, env=env, device=device, ...)
    self._shards = compose_host_shards(self, _KIND, kernels, configs=configs, ...)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsdk.sharding.distribution.shardings import check_host_sharding_types
from recsdk.sharding.host.host_shards import HostShards
from recsdk.sharding.planning.cache_plan import TableCacheSpec, kernel_inputs
from recsdk.sharding.rows.host_adam import HostAdam

__all__ = ["HashModuleKind", "KernelPlan", "compose_host_shards", "plan_kernels"]


@dataclass(frozen=True)
class HashModuleKind:
    """What an adapter's unsharded hash module is.

    Attributes:
        name (str): its class name, for errors (``"HashEmbeddingBagCollection"``).
        prefix (str): the parameter prefix (``"embedding_bags."`` or ``"embeddings."``).
        pooled (bool): bag tables, or unpooled tables (one embedding per id).
    """

    name: str
    prefix: str
    pooled: bool


@dataclass(frozen=True)
class KernelPlan:
    """The kernels TorchRec builds for a hash module, and the CPU Adam planned for them.

    Attributes:
        module (Any): the module as the kernels hold it (a cached table with the cache's rows).
        plan (dict[str, ParameterSharding]): the plan as the kernels hold it.
        cached (dict[str, TableCacheSpec]): the tables with a device cache over a row store.
        host_adam (HostAdam): the tables that need Adam on the CPU kernel.
    """

    module: Any
    plan: dict[str, ParameterSharding]
    cached: dict[str, TableCacheSpec]
    host_adam: HostAdam


def plan_kernels(
    kind: HashModuleKind,
    module: Any,
    plan: dict[str, ParameterSharding],
    configs: Sequence[BaseEmbeddingConfig],
    *,
    meta_copy: Callable[[list[BaseEmbeddingConfig]], Any],
    grouped_infos: Callable[[Any, dict[str, ParameterSharding]], dict[str, list[EmbeddingShardingInfo]]],
    device: torch.device | None,
) -> KernelPlan:
    """Check ``plan``'s sharding types, then work out the module and plan TorchRec builds the
    kernels from (:func:`~recsdk.sharding.planning.cache_plan.kernel_inputs`) and the CPU Adam.

    Args:
        kind (HashModuleKind): the unsharded module's kind.
        module (Any): the unsharded module.
        plan (dict[str, ParameterSharding]): the user's plan for it.
        configs (Sequence[BaseEmbeddingConfig]): its tables' configs.
        meta_copy (Callable): a copy of the module on ``meta`` with the given configs.
        grouped_infos (Callable): TorchRec's ``create_grouped_sharding_infos`` of the adapter's
            base class, on a module and plan.
        device (torch.device | None): the lookup device (the CPU has no Adam kernel).

    Returns:
        KernelPlan: what TorchRec's constructor and the host shards are built from.

    Raises:
        ValueError: a sharding type the host shardings do not have.
    """
    check_host_sharding_types(plan, kind.name)
    # Cached tables: TorchRec builds their kernels with the cache's rows (cache_plan.py).
    kernel_module, kernel_plan, cached = kernel_inputs(module, plan, list(configs), meta_copy)
    infos = grouped_infos(kernel_module, kernel_plan)
    host_adam = HostAdam.plan(infos, emulate=device is None or device.type == "cpu")  # no CPU Adam kernel
    return KernelPlan(kernel_module, kernel_plan, cached, host_adam)


def compose_host_shards(
    adapter: Any,
    kind: HashModuleKind,
    kernels: KernelPlan,
    *,
    configs: Sequence[BaseEmbeddingConfig],
    is_weighted: bool,
    plan: dict[str, ParameterSharding],
    env: ShardingEnv,
    host_pg: dist.ProcessGroup,
    device: torch.device | None,
    module_fqn: str | None,
    host_threads: int | None,
) -> HostShards:
    """The adapter's :class:`~recsdk.sharding.host.host_shards.HostShards`, once TorchRec's
    constructor has built the kernels (arguments as there; ``configs``: every table's config as
    the user gave it, ``env``: the device sharding env)."""
    return HostShards(
        adapter,
        plan=plan,
        rank=env.rank,
        host_pg=host_pg,
        features=list(dict.fromkeys(f for c in configs for f in c.feature_names)),
        name=kind.name,
        is_weighted=is_weighted,
        host_adam=kernels.host_adam,
        prefix=kind.prefix,
        pooled=kind.pooled,
        device=device,
        configs={c.name: c for c in configs},
        cached=kernels.cached,
        module_fqn=module_fqn,
        host_threads=host_threads,
    )
