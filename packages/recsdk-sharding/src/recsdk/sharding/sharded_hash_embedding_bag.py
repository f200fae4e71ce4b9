"""``ShardedHashEmbeddingBagCollection``: a HashEBC sharded row-wise or table-wise.

A thin adapter between TorchRec's ``ShardedEmbeddingBagCollection`` and recsdk's host-side
parts, composed by :class:`~recsdk.sharding.host.host_shards.HostShards`: the shardings
(:mod:`~recsdk.sharding.distribution.shardings`) bucket and exchange raw ids over the host group; the host
stage maps them to rows; the row ledger keeps the rows of batches in flight and the resets they
owe; the failure agreement makes a host-stage failure fail every rank; the CPU Adam. The device
looks the rows up with TorchRec's fused kernel and returns pooled results through TorchRec's
output dists.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from torchrec.distributed.types import LazyAwaitable, ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recsdk.embedding import HashEmbeddingBagCollection
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.adapter_construction import HashModuleKind, compose_host_shards, plan_kernels
from recsdk.sharding.context import HashEmbeddingBagCollectionContext
from recsdk.sharding.distribution.mean_pooling import MeanPooling
from recsdk.sharding.distribution.shardings import create_host_sharding
from recsdk.sharding.host_sharded_module import HostShardedModule

__all__ = ["ShardedHashEmbeddingBagCollection"]

_PREFIX = "embedding_bags."
_KIND = HashModuleKind("HashEmbeddingBagCollection", _PREFIX, pooled=True)


class ShardedHashEmbeddingBagCollection(HostShardedModule, ShardedEmbeddingBagCollection):
    """A :class:`~recsdk.embedding.HashEmbeddingBagCollection` sharded for hybrid training.

    Built by :class:`~recsdk.sharding.HashEmbeddingBagCollectionSharder`; users get it from
    ``DistributedModelParallel``. Each rank holds one :class:`~recsdk.embedding.IdTable` per
    table shard it owns, with capacity equal to the shard's rows (row-wise: the capacity is
    split across ranks) and the table's admission and eviction policies.

    In ``train()`` mode the owner inserts new ids (subject to admission) and evicts per the
    table's policy; reused rows get a freshly initialised embedding and zeroed optimizer state
    before the batch that reuses them is looked up. Rows of batches in flight are pinned and
    never evicted. In ``eval()`` mode ids are only looked up: unknown ids pool as zeros and no
    table changes. The input is checked as the unsharded module checks it (keys in any order);
    a bad batch on one rank raises on every rank.

    Args:
        module (HashEmbeddingBagCollection): the unsharded module (usually on ``meta``).
        table_name_to_parameter_sharding (dict[str, ParameterSharding]): the plan for it.
        env (ShardingEnv): the device sharding env (default group).
        host_env (ShardingEnv): the host env; its group must be gloo.
        fused_params, device, qcomm_codecs_registry, module_fqn: as TorchRec's
            ``ShardedEmbeddingBagCollection``.
        host_threads (int | None): how many tables of a batch the host stage maps at once (see
            :class:`~recsdk.sharding.host.host_shards.HostShards`).
    """

    def __init__(
        self,
        module: HashEmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, Any],
        env: ShardingEnv,
        host_env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
        module_fqn: str | None = None,
        host_threads: int | None = None,
    ) -> None:
        plan, configs = table_name_to_parameter_sharding, module.embedding_bag_configs()
        kernels = plan_kernels(
            _KIND,
            module,
            plan,
            configs,
            meta_copy=lambda c: HashEmbeddingBagCollection(tables=c, device="meta", is_weighted=module.is_weighted()),
            grouped_infos=lambda m, p: ShardedEmbeddingBagCollection.create_grouped_sharding_infos(
                m, p, _PREFIX, fused_params
            ),
            device=device,
        )
        # Inputs of the base constructor's hooks (create_embedding_bag_sharding and
        # create_grouped_sharding_infos), which only read them.
        self._host_pg = host_env.process_group
        self._host_adam = kernels.host_adam
        self._mean = MeanPooling(configs)  # MEAN tables: SUM kernels, divided here
        self._init_kernels(
            super().__init__,
            plan=plan,
            kernels=kernels,
            env=env,
            fused_params=fused_params,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        compat.disable_mean_pooling_callback(self)  # TorchRec's row-wise mean: MeanPooling's instead
        self._shards = compose_host_shards(
            self,
            _KIND,
            kernels,
            configs=configs,
            is_weighted=module.is_weighted(),
            plan=plan,
            env=env,
            host_pg=self._host_pg,
            device=device,
            module_fqn=module_fqn,
            host_threads=host_threads,
        )

    # ---- TorchRec's hooks

    def create_grouped_sharding_infos(  # type: ignore[override]
        self,
        module: Any,
        table_name_to_parameter_sharding: dict[str, Any],
        prefix: str,
        fused_params: dict[str, Any] | None,
        suffix: str | None = "weight",
    ) -> dict[str, list[EmbeddingShardingInfo]]:
        infos = super().create_grouped_sharding_infos(
            module, table_name_to_parameter_sharding, prefix, fused_params, suffix
        )
        self._host_adam.rewrite(infos)
        self._mean.pool_by_sum(infos)
        return infos

    def create_embedding_bag_sharding(  # type: ignore[override]
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> EmbeddingSharding:
        return create_host_sharding(sharding_infos, env, device, qcomm_codecs_registry, self._host_pg, pooled=True)

    def create_context(self) -> HashEmbeddingBagCollectionContext:
        return HashEmbeddingBagCollectionContext()

    @property
    def unsharded_module_type(self) -> type[HashEmbeddingBagCollection]:  # type: ignore[override]
        return HashEmbeddingBagCollection

    def input_dist(self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor) -> Any:  # type: ignore[override]
        """TorchRec's input dist, after the unsharded module's checks, with keys in a fixed order.

        A batch that fails the checks is replaced by an empty one (every rank must join the id
        all-to-alls) and its error raised at the host stage's agreement, on every rank; its flag
        travels with the ids, so no rank maps that batch.
        """
        assert isinstance(ctx, HashEmbeddingBagCollectionContext)
        features = self._shards.guard(ctx, features, self.training)
        if ctx.input_error is None:
            ctx.bag_lengths = self._mean.bag_lengths(features)
        with self._shards.batch_flag(ctx):
            if compat.input_dist_ready(self):
                return super().input_dist(ctx, features)
            with compat.without_range_warnings():  # raw ids are never in TorchRec's [0, num_embeddings)
                return super().input_dist(ctx, features)

    def compute_and_output_dist(  # type: ignore[override]
        self, ctx: EmbeddingBagCollectionContext, input: KJTList
    ) -> LazyAwaitable[KeyedTensor]:
        assert isinstance(ctx, HashEmbeddingBagCollectionContext)
        kjts = self._shards.begin_compute(ctx, input, self.training)
        awaitable = super().compute_and_output_dist(ctx, kjts)
        if ctx.bag_lengths:
            lengths = ctx.bag_lengths
            awaitable.callbacks.append(lambda pooled: self._mean.apply(pooled, lengths))
        self._shards.end_compute(ctx, awaitable, self.training)
        return awaitable
