"""``ShardedHashEmbeddingCollection``: a HashEmbeddingCollection sharded row-wise or table-wise.

The unpooled sibling of :class:`~recsdk.sharding.ShardedHashEmbeddingBagCollection`: a thin
adapter between TorchRec's ``ShardedEmbeddingCollection`` and the same host-side parts
(:class:`~recsdk.sharding.host.host_shards.HostShards`), with the sequence shardings of
:mod:`~recsdk.sharding.distribution.shardings`. Every id keeps its place: the owner looks its row up, and
TorchRec's sequence output dist returns one embedding per id, in input order.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.embedding import EmbeddingCollectionContext, ShardedEmbeddingCollection
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import LazyAwaitable, ShardingEnv
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recsdk.embedding import HashEmbeddingCollection
from recsdk.sharding.adapter_construction import HashModuleKind, compose_host_shards, plan_kernels
from recsdk.sharding.context import HashEmbeddingCollectionContext
from recsdk.sharding.distribution.shardings import create_host_sharding
from recsdk.sharding.host_sharded_module import HostShardedModule

__all__ = ["ShardedHashEmbeddingCollection"]

_PREFIX = "embeddings."
_KIND = HashModuleKind("HashEmbeddingCollection", _PREFIX, pooled=False)


class ShardedHashEmbeddingCollection(HostShardedModule, ShardedEmbeddingCollection):
    """A :class:`~recsdk.embedding.HashEmbeddingCollection` sharded for hybrid training.

    Built by :class:`~recsdk.sharding.HashEmbeddingCollectionSharder`; users get it from
    ``DistributedModelParallel``. As the sharded bag collection: one
    :class:`~recsdk.embedding.IdTable` per local table shard (row-wise: capacity split across
    ranks), the id work on the host over the host group, fused optimizers (the CPU Adam
    included), rows of batches in flight pinned, reused rows re-initialised with zeroed
    optimizer state before their batch's lookup, the input checked as the unsharded module
    checks it. ``forward`` returns ``dict[str, JaggedTensor]`` with one embedding per id; an id
    without a row (not admitted, or unknown in eval) gets a zero embedding and no gradient.

    Args:
        module (HashEmbeddingCollection): the unsharded module (usually on ``meta``).
        table_name_to_parameter_sharding (dict[str, ParameterSharding]): the plan for it.
        env (ShardingEnv): the device sharding env (default group).
        host_env (ShardingEnv): the host env; its group must be gloo.
        fused_params, device, qcomm_codecs_registry, module_fqn: as TorchRec's
            ``ShardedEmbeddingCollection``.
        host_threads (int | None): how many tables of a batch the host stage maps at once (see
            :class:`~recsdk.sharding.host.host_shards.HostShards`).
    """

    def __init__(
        self,
        module: HashEmbeddingCollection,
        table_name_to_parameter_sharding: dict[str, Any],
        env: ShardingEnv,
        host_env: ShardingEnv,
        fused_params: dict[str, Any] | None = None,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
        module_fqn: str | None = None,
        host_threads: int | None = None,
    ) -> None:
        plan, configs = table_name_to_parameter_sharding, module.embedding_configs()
        kernels = plan_kernels(
            _KIND,
            module,
            plan,
            configs,
            meta_copy=lambda c: HashEmbeddingCollection(tables=c, device="meta", need_indices=module.need_indices()),
            grouped_infos=lambda m, p: ShardedEmbeddingCollection.create_grouped_sharding_infos(m, p, fused_params),
            device=device,
        )
        # Inputs of the base constructor's hooks (create_embedding_sharding and
        # create_grouped_sharding_infos), which only read them.
        self._host_pg = host_env.process_group
        self._host_adam = kernels.host_adam
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
        self._shards = compose_host_shards(
            self,
            _KIND,
            kernels,
            configs=configs,
            is_weighted=False,
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
        fused_params: dict[str, Any] | None,
    ) -> dict[str, list[EmbeddingShardingInfo]]:
        infos = super().create_grouped_sharding_infos(module, table_name_to_parameter_sharding, fused_params)
        self._host_adam.rewrite(infos)
        return infos

    def create_embedding_sharding(  # type: ignore[override]
        self,
        sharding_type: str,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> EmbeddingSharding:
        return create_host_sharding(sharding_infos, env, device, qcomm_codecs_registry, self._host_pg, pooled=False)

    def create_context(self) -> HashEmbeddingCollectionContext:
        return HashEmbeddingCollectionContext()

    @property
    def unsharded_module_type(self) -> type[HashEmbeddingCollection]:  # type: ignore[override]
        return HashEmbeddingCollection

    def input_dist(self, ctx: EmbeddingCollectionContext, features: KeyedJaggedTensor) -> Any:  # type: ignore[override]
        """TorchRec's input dist, after the unsharded module's checks, with keys in a fixed order.

        A batch that fails the checks is replaced by an empty one (every rank must join the id
        all-to-alls) and its error raised at the host stage's agreement, on every rank; its flag
        travels with the ids, so no rank maps that batch.
        """
        assert isinstance(ctx, HashEmbeddingCollectionContext)
        features = self._shards.guard(ctx, features, self.training)
        if features.stride() == 0:  # TorchRec's sequence path cannot take a batch of size 0
            ctx.padded = True
            features = KeyedJaggedTensor(
                keys=features.keys(),
                values=features.values(),
                lengths=torch.zeros(len(features.keys()), dtype=features.lengths().dtype),
                stride=1,
            )
        with self._shards.batch_flag(ctx):
            return super().input_dist(ctx, features)

    def compute_and_output_dist(  # type: ignore[override]
        self, ctx: EmbeddingCollectionContext, input: KJTList
    ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        assert isinstance(ctx, HashEmbeddingCollectionContext)
        kjts = self._shards.begin_compute(ctx, input, self.training)
        awaitable = super().compute_and_output_dist(ctx, kjts)
        self._shards.end_compute(ctx, awaitable, self.training)
        if ctx.padded:
            awaitable.callbacks.append(_drop_padding)
        return awaitable


def _drop_padding(out: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
    """The output of a batch of size 0 that went through as one sample without ids."""
    return {
        key: JaggedTensor(values=jt.values(), lengths=jt.lengths()[:0], weights=jt.weights_or_none())
        for key, jt in out.items()
    }
