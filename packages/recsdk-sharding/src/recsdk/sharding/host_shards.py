"""``HostShards``: one sharded hash module's host-side parts, composed; ``HostShardedModule``: its face.

Both sharded hash modules (the bag collection and the unpooled collection) are TorchRec sharded
modules whose id work runs on the host. What they share is here, once:

* :class:`HostShards` composes the parts for one module: the input guard, the
  :class:`~recsdk.sharding.host_stage.IdMappingStage` (this rank's id tables), the
  :class:`~recsdk.sharding.row_ledger.RowLedger`, the :class:`~recsdk.sharding.FailureAgreement`
  of the inline host stage, the fused kernel's views and the CPU Adam;
* :class:`HostShardedModule` is the public face both adapters inherit: the accessors the
  checkpoint, export and statistics use, and the pipeline's ``HostStagedModule`` protocol.

The adapters keep only TorchRec's hooks (construction, ``input_dist``,
``compute_and_output_dist``) and delegate to their ``HostShards``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import LazyAwaitable, ParameterSharding
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.embedding import IdTable
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.agreement import FailureAgreement
from recsdk.sharding.context import HostStageState
from recsdk.sharding.host_adam import HostAdam
from recsdk.sharding.host_stage import IdMappingStage
from recsdk.sharding.input_guard import guard_input
from recsdk.sharding.row_ledger import RowLedger
from recsdk.sharding.tbe_views import TableViews, fused_table_views, init_all_rows_, reset_rows_

__all__ = ["HostShardedModule", "HostShards", "sharded_hash_modules"]


class HostShards:
    """The host-side parts of one sharded hash module on this rank.

    Build it at the end of the adapter's constructor (once TorchRec built the shardings,
    lookups and fused optimizer).

    Args:
        module (nn.Module): the sharded module (TorchRec's sharded EBC or EC subclass).
        plan (dict[str, ParameterSharding]): the module's sharding plan.
        rank (int): this rank.
        host_pg (dist.ProcessGroup): the host (gloo) group.
        features (Sequence[str]): the module's features, in the order its input dist sends them.
        name (str): the unsharded module's name, for error messages.
        is_weighted (bool): whether the input carries per-id weights.
        host_adam (HostAdam): the CPU Adam planned before the kernels were built.
        prefix (str): the parameter prefix (``"embedding_bags."`` or ``"embeddings."``).
        pooled (bool): bag tables, or unpooled tables (one embedding per id).
        device (torch.device | None): the lookup device (``meta``: no rows yet).
    """

    def __init__(
        self,
        module: Any,
        *,
        plan: dict[str, ParameterSharding],
        rank: int,
        host_pg: dist.ProcessGroup,
        features: Sequence[str],
        name: str,
        is_weighted: bool,
        host_adam: HostAdam,
        prefix: str,
        pooled: bool,
        device: torch.device | None,
    ) -> None:
        self.host_pg = host_pg
        self.configs: dict[str, BaseEmbeddingConfig] = compat.table_configs(module)
        self.prefix = prefix
        self._features = list(features)
        self._name = name
        self._is_weighted = is_weighted
        self._pooled = pooled
        self._device = device
        self._host_adam = host_adam
        self.stage = IdMappingStage.for_shards(compat.local_shards(module), self.configs, plan, rank)
        self.ledger = RowLedger(self.stage.id_tables, self.stage.lock)
        self._agreement = FailureAgreement(host_pg, what="the host id stage")
        self._missing: list[torch.Tensor | None] = []  # the computing batch's ids without a row
        lookups = compat.fused_lookups(module)
        for i, lookup in enumerate(lookups):
            lookup.register_forward_hook(lambda _m, _in, out, i=i: self._after_lookup(i, out))
        self._views: dict[str, TableViews] | None = None
        if device is None or device.type != "meta":
            views = fused_table_views(lookups)
            init_all_rows_({n: views[n] for n in self.stage.id_tables}, self.configs)
            compat.replace_fused_optimizer(module, host_adam.install(module.fused_optimizer, views))  # type: ignore[arg-type]
            self._views = host_adam.views(views)

    @property
    def views(self) -> dict[str, TableViews]:
        if self._views is None:
            raise RuntimeError(f"the sharded {self._name} is on the meta device: it has no rows")
        return self._views

    def guard(self, ctx: HostStageState, features: Any) -> KeyedJaggedTensor:
        """The batch to send through the input dist (see :mod:`~recsdk.sharding.input_guard`)."""
        checked, ctx.input_error = guard_input(
            features, self._features, module=self._name, is_weighted=self._is_weighted
        )
        return checked

    def map(self, ctx: HostStageState, dist_input: KJTList, *, ahead: bool, training: bool) -> KJTList:
        """The host stage's mapping of one batch (idempotent per context).

        ``ahead`` (a pipeline's host thread): the batch's rows are held until it computes, and a
        failure raises here (the pipeline agrees on it). Inline: the failure agreement starts
        here and is settled before the output dist.
        """
        if ctx.ids_mapped:
            return dist_input
        error: Exception | None = ctx.input_error
        mapped: list[KeyedJaggedTensor] = []
        if error is None:
            try:
                batch = self.stage.map(dist_input, ctx.token, self.ledger, training, pooled=self._pooled)
                mapped, ctx.batch_rows, ctx.missing = batch.kjts, batch.rows, batch.missing
                if ahead:
                    self.ledger.hold(ctx.token, ctx.batch_rows)
            except Exception as e:  # shared with the other ranks, then re-raised
                error = e
        if error is not None:
            self.ledger.release(ctx.token)
        if ahead:
            if error is not None:
                raise error
        else:
            self._agreement.start(error)
        ctx.ids_mapped = True
        if self._device is not None and self._device.type != "cpu":
            mapped = [kjt.to(self._device, non_blocking=True) for kjt in mapped]
        return KJTList(mapped)

    def begin_compute(self, ctx: HostStageState, dist_input: KJTList, training: bool) -> KJTList:
        """Everything before the lookup of a computing batch; returns its rows' KJTs."""
        # The previous batch's backward has run: its rows may be evicted by this batch's mapping.
        self.ledger.release_finished()
        kjts = self.map(ctx, dist_input, ahead=False, training=training)
        views = self.views
        for name, rows in self.ledger.start_compute(ctx.token).items():
            reset_rows_(views[name], rows, self.configs[name])
        self._missing = ctx.missing
        return kjts

    def end_compute(self, ctx: HostStageState, awaitable: LazyAwaitable[Any], training: bool) -> None:
        """After the lookups were issued: the CPU Adam's watch of a training batch."""
        if training and torch.is_grad_enabled():
            self._host_adam.watch(awaitable, ctx.batch_rows)

    def _after_lookup(self, i: int, output: torch.Tensor) -> torch.Tensor | None:
        # The first collective a rank whose host stage failed would not join is the output dist.
        self._agreement.settle()
        missing = self._missing[i] if i < len(self._missing) else None
        if missing is None:
            return None
        # An unpooled lookup's output is one row per id, possibly flattened: [n * dim].
        rows = output.view(missing.numel(), -1)
        return rows.masked_fill(missing.to(output.device).unsqueeze(1), 0).view_as(output)


class HostShardedModule:
    """The public face of a sharded hash module; the adapter sets ``self._shards``.

    The accessors are what checkpoints, export and statistics use; ``host_input_groups``,
    ``post_input_dist``, ``release_context`` and ``release_finished_pins`` are the pipeline's
    ``HostStagedModule`` protocol.
    """

    _shards: HostShards
    training: bool

    @property
    def host_group(self) -> dist.ProcessGroup:
        """The host (gloo) group of the id all-to-alls and the failure agreement."""
        return self._shards.host_pg

    @property
    def id_tables(self) -> dict[str, IdTable]:
        """This rank's id table per table shard it holds (table name -> IdTable)."""
        return self._shards.stage.id_tables

    @property
    def table_configs(self) -> dict[str, BaseEmbeddingConfig]:
        """Every table's config by name (``HashEmbeddingBagConfig``/``HashEmbeddingConfig``)."""
        return dict(self._shards.configs)

    @property
    def ledger(self) -> RowLedger:
        """Rows held by batches in flight and resets owed (a checkpoint reads what is owed)."""
        return self._shards.ledger

    def table_views(self) -> dict[str, TableViews]:
        """Per local table: the fused kernel's weight view and per-row optimizer state views."""
        return self._shards.views

    def parameter_key(self, table: str) -> str:
        """The table's key in ``fused_optimizer.params`` and the state dict."""
        return f"{self._shards.prefix}{table}.weight"

    def stats(self) -> dict[str, dict[str, float]]:
        """Per table statistics of this rank's shards (see ``IdTable.stats``)."""
        return {name: table.stats() for name, table in self.id_tables.items()}

    def host_input_groups(self) -> list[dist.ProcessGroup]:
        """The groups of its input dists' id all-to-alls (the pipeline's host-staged protocol)."""
        return [self._shards.host_pg]

    def post_input_dist(self, ctx: Any, dist_input: KJTList) -> KJTList:
        """Map the received raw ids to local rows (find-or-insert in train, find in eval).

        Idempotent per context: a pipeline runs it ahead of time on its host thread, and
        ``compute_and_output_dist`` then skips it. Run ahead, it holds the batch's rows in the
        row ledger (pinned in tables with an eviction policy) until the next batch computes (or
        :meth:`release_context`); a failure raises here and the pipeline agrees on it across
        ranks. Ids that are not (yet) admitted, or unknown in eval, look up as zeros: pooled
        tables drop them from their bags (MEAN still divides by the original bag length),
        unpooled tables give them a zero embedding.

        Args:
            ctx: this batch's context (from ``create_context``).
            dist_input (KJTList): one KJT of raw ids per sharding type, as received.

        Returns:
            KJTList: the same layout with row indices, on the lookup device.
        """
        return self._shards.map(ctx, dist_input, ahead=True, training=self.training)

    def release_context(self, ctx: Any) -> None:
        """A batch mapped ahead will never compute (a pipeline's ``close()``, ``reset()``, a mode
        switch): unpin its rows; its resets are paid at the next compute."""
        self._shards.ledger.release(ctx.token)

    def release_finished_pins(self) -> None:
        """Unpin the rows of the last computed batch (its backward has run).

        Called at the start of the next ``compute_and_output_dist``; a pipeline calls it itself
        before it maps further batches, so that which rows are evictable does not depend on
        thread timing. A checkpoint calls it before reading the tables.
        """
        self._shards.ledger.release_finished()


def sharded_hash_modules(model: torch.nn.Module) -> dict[str, HostShardedModule]:
    """The sharded hash modules of a model (bag and unpooled collections), by fully qualified name.

    Looks inside ``DistributedModelParallel`` (names as in ``model.module.state_dict()``).

    Args:
        model (nn.Module): a ``DistributedModelParallel`` or any module.

    Returns:
        dict[str, HostShardedModule]: FQN -> module (a ``ShardedHashEmbeddingBagCollection`` or
        ``ShardedHashEmbeddingCollection``), in module order.

    Example::

        for fqn, sebc in sharded_hash_modules(ddp_model).items():
            print(fqn, sebc.stats())
    """
    root = model.module if isinstance(model, DistributedModelParallel) else model
    return {fqn: m for fqn, m in root.named_modules() if isinstance(m, HostShardedModule)}
