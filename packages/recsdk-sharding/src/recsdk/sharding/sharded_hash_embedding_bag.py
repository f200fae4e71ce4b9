"""``ShardedHashEmbeddingBagCollection``: a HashEBC sharded row-wise or table-wise.

A thin adapter between TorchRec's ``ShardedEmbeddingBagCollection`` and recsdk's host-side
parts: the shardings (:mod:`~recsdk.sharding.shardings`) bucket and exchange raw ids over the
host group; :class:`~recsdk.sharding.host_stage.IdMappingStage` maps them to rows;
:class:`~recsdk.sharding.row_ledger.RowLedger` keeps the rows of batches in flight and the
resets they owe; :class:`~recsdk.sharding.FailureAgreement` makes a host-stage failure fail
every rank; :class:`~recsdk.sharding.host_adam.HostAdam` runs Adam on the CPU kernel. The
device looks the rows up with TorchRec's fused kernel and returns pooled results through
TorchRec's output dists.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext, ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import LazyAwaitable, ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recsdk.embedding import HashEmbeddingBagCollection, IdTable
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.agreement import FailureAgreement
from recsdk.sharding.context import HashEmbeddingBagCollectionContext
from recsdk.sharding.host_adam import HostAdam
from recsdk.sharding.host_stage import IdMappingStage
from recsdk.sharding.input_guard import guard_input
from recsdk.sharding.row_ledger import RowLedger
from recsdk.sharding.shardings import check_host_sharding_types, create_host_pooled_sharding
from recsdk.sharding.tbe_views import TableViews, fused_table_views, init_all_rows_, reset_rows_

__all__ = ["ShardedHashEmbeddingBagCollection", "sharded_hash_modules"]

_PREFIX = "embedding_bags."


class ShardedHashEmbeddingBagCollection(ShardedEmbeddingBagCollection):
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
    ) -> None:
        check_host_sharding_types(table_name_to_parameter_sharding, "HashEmbeddingBagCollection")
        # Inputs of the base constructor's hooks (create_embedding_bag_sharding and
        # create_grouped_sharding_infos), which only read them.
        self._host_pg = host_env.process_group
        infos = ShardedEmbeddingBagCollection.create_grouped_sharding_infos(
            module, table_name_to_parameter_sharding, _PREFIX, fused_params
        )
        self._host_adam = HostAdam.plan(infos, emulate=device is None or device.type == "cpu")  # no CPU Adam kernel
        super().__init__(
            module=module,
            table_name_to_parameter_sharding=table_name_to_parameter_sharding,
            env=env,
            fused_params=fused_params,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        self._table_configs: dict[str, EmbeddingBagConfig] = compat.table_configs(self)
        self._features = list(dict.fromkeys(f for c in module.embedding_bag_configs() for f in c.feature_names))
        plan = table_name_to_parameter_sharding
        self._stage = IdMappingStage.for_shards(compat.local_shards(self), self._table_configs, plan, env.rank)
        self._ledger = RowLedger(self._stage.id_tables, self._stage.lock)
        self._agreement = FailureAgreement(self._host_pg, what="the host id stage")
        for lookup in compat.fused_lookups(self):
            # The first collective a rank whose host stage failed would not join is the output dist.
            lookup.register_forward_hook(self._agreement.settle)
        self._views: dict[str, TableViews] | None = None
        if device is None or device.type != "meta":
            views = fused_table_views(compat.fused_lookups(self))
            init_all_rows_({name: views[name] for name in self.id_tables}, self._table_configs)
            compat.replace_fused_optimizer(self, self._host_adam.install(self.fused_optimizer, views))  # type: ignore[arg-type]
            self._views = self._host_adam.views(views)

    # ---- TorchRec's construction hooks

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
        return infos

    def create_embedding_bag_sharding(  # type: ignore[override]
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> EmbeddingSharding:
        return create_host_pooled_sharding(sharding_infos, env, device, qcomm_codecs_registry, self._host_pg)

    def create_context(self) -> HashEmbeddingBagCollectionContext:
        return HashEmbeddingBagCollectionContext()

    @property
    def unsharded_module_type(self) -> type[HashEmbeddingBagCollection]:  # type: ignore[override]
        return HashEmbeddingBagCollection

    # ---- public API

    @property
    def host_group(self) -> dist.ProcessGroup:
        """The host (gloo) group of the id all-to-alls and the failure agreement."""
        return self._host_pg

    @property
    def id_tables(self) -> dict[str, IdTable]:
        """This rank's id table per table shard it holds (table name -> IdTable)."""
        return self._stage.id_tables

    @property
    def table_configs(self) -> dict[str, EmbeddingBagConfig]:
        """Every table's config by name (``HashEmbeddingBagConfig`` for hash tables)."""
        return dict(self._table_configs)

    @property
    def ledger(self) -> RowLedger:
        """Rows held by batches in flight and resets owed (a checkpoint reads what is owed)."""
        return self._ledger

    def table_views(self) -> dict[str, TableViews]:
        """Per local table: the fused kernel's weight view and per-row optimizer state views."""
        if self._views is None:
            raise RuntimeError("ShardedHashEmbeddingBagCollection on the meta device has no rows")
        return self._views

    def parameter_key(self, table: str) -> str:
        """The table's key in ``fused_optimizer.params`` and the state dict."""
        return f"{_PREFIX}{table}.weight"

    def stats(self) -> dict[str, dict[str, float]]:
        """Per table statistics of this rank's shards (see ``IdTable.stats``)."""
        return {name: table.stats() for name, table in self.id_tables.items()}

    def host_input_groups(self) -> list[dist.ProcessGroup]:
        """The groups of its input dists' id all-to-alls (the pipeline's host-staged protocol)."""
        return [self._host_pg]

    # ---- the host stage

    def input_dist(self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor) -> Any:  # type: ignore[override]
        """TorchRec's input dist, after the unsharded module's checks, with keys in a fixed order.

        A batch that fails the checks is replaced by an empty one (every rank must join the id
        all-to-alls) and its error raised at the host stage's agreement, on every rank.
        """
        assert isinstance(ctx, HashEmbeddingBagCollectionContext)
        features, ctx.input_error = guard_input(
            features, self._features, module="HashEmbeddingBagCollection", is_weighted=self._is_weighted
        )
        if compat.input_dist_ready(self):
            return super().input_dist(ctx, features)
        with compat.without_range_warnings():  # raw ids are never in TorchRec's [0, num_embeddings)
            return super().input_dist(ctx, features)

    def post_input_dist(self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList) -> KJTList:
        """Map the received raw ids to local rows (find-or-insert in train, find in eval).

        Idempotent per context: a pipeline runs it ahead of time on its host thread, and
        ``compute_and_output_dist`` then skips it. Run ahead, it holds the batch's rows in the
        row ledger (pinned in tables with an eviction policy) until the next batch computes (or
        :meth:`release_context`); a failure raises here and the pipeline agrees on it across
        ranks. Ids that are not (yet) admitted, or unknown in eval, are dropped from their bags,
        so they pool as zeros (MEAN pooling still divides by the original bag length).

        Args:
            ctx (EmbeddingBagCollectionContext): this batch's context.
            dist_input (KJTList): one KJT of raw ids per sharding type, as received.

        Returns:
            KJTList: the same layout with row indices, on the lookup device.
        """
        return self._map(ctx, dist_input, ahead=True)

    def _map(self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList, ahead: bool) -> KJTList:
        assert isinstance(ctx, HashEmbeddingBagCollectionContext)
        if ctx.ids_mapped:
            return dist_input
        error: Exception | None = ctx.input_error
        mapped: list[KeyedJaggedTensor] = []
        if error is None:
            try:
                mapped, ctx.batch_rows = self._stage.map(dist_input, ctx.token, self._ledger, self.training)
                if ahead:
                    self._ledger.hold(ctx.token, ctx.batch_rows)
            except Exception as e:  # shared with the other ranks, then re-raised
                error = e
        if error is not None:
            self._ledger.release(ctx.token)
        if ahead:
            if error is not None:
                raise error
        else:
            self._agreement.start(error)
        ctx.ids_mapped = True
        if self._device is not None and self._device.type != "cpu":
            mapped = [kjt.to(self._device, non_blocking=True) for kjt in mapped]
        return KJTList(mapped)

    def release_context(self, ctx: EmbeddingBagCollectionContext) -> None:
        """A batch mapped ahead will never compute (a pipeline's ``close()``, ``reset()``, a mode
        switch): unpin its rows; its resets are paid at the next compute."""
        assert isinstance(ctx, HashEmbeddingBagCollectionContext)
        self._ledger.release(ctx.token)

    def release_finished_pins(self) -> None:
        """Unpin the rows of the last computed batch (its backward has run).

        Called at the start of the next ``compute_and_output_dist``; a pipeline calls it itself
        before it maps further batches, so that which rows are evictable does not depend on
        thread timing. A checkpoint calls it before reading the tables.
        """
        self._ledger.release_finished()

    # ---- the device stage

    def compute_and_output_dist(  # type: ignore[override]
        self, ctx: EmbeddingBagCollectionContext, input: KJTList
    ) -> LazyAwaitable[KeyedTensor]:
        assert isinstance(ctx, HashEmbeddingBagCollectionContext)
        # The previous batch's backward has run: its rows may be evicted by this batch's mapping.
        self._ledger.release_finished()
        kjts = self._map(ctx, input, ahead=False)
        views = self.table_views()
        for name, rows in self._ledger.start_compute(ctx.token).items():
            reset_rows_(views[name], rows, self._table_configs[name])
        awaitable = super().compute_and_output_dist(ctx, kjts)
        if self.training and torch.is_grad_enabled():
            self._host_adam.watch(awaitable, ctx.batch_rows)
        return awaitable


def sharded_hash_modules(model: torch.nn.Module) -> dict[str, ShardedHashEmbeddingBagCollection]:
    """The sharded HashEBCs of a model, by fully qualified name.

    Looks inside ``DistributedModelParallel`` (names as in ``model.module.state_dict()``).

    Args:
        model (nn.Module): a ``DistributedModelParallel`` or any module.

    Returns:
        dict[str, ShardedHashEmbeddingBagCollection]: FQN -> module, in module order.

    Example::

        for fqn, sebc in sharded_hash_modules(ddp_model).items():
            print(fqn, sebc.stats())
    """
    root = model.module if isinstance(model, DistributedModelParallel) else model
    return {fqn: m for fqn, m in root.named_modules() if isinstance(m, ShardedHashEmbeddingBagCollection)}
