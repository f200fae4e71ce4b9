"""``HostShardedModule``: the public face of a sharded hash module, and ``sharded_hash_modules``.

Both adapters (``ShardedHashEmbeddingBagCollection``, ``ShardedHashEmbeddingCollection``)
inherit it and set ``self._shards`` (their :class:`~recsdk.sharding.host.host_shards.HostShards`). It
is what code outside a module uses of it: the accessors of checkpoints, export, publishing and
statistics, and the pipeline's ``HostStagedModule`` protocol; each delegates to the parts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ParameterSharding
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsdk.embedding import IdTable
from recsdk.embedding.change_tracker import ChangeSnapshot
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.adapter_construction import KernelPlan
from recsdk.sharding.host.host_shards import HostShards
from recsdk.sharding.host.row_ledger import RowLedger
from recsdk.sharding.rows.tbe_views import TableViews

__all__ = ["HostShardedModule", "sharded_hash_modules"]


class HostShardedModule:
    """The public face of a sharded hash module; the adapter sets ``self._shards``.

    The accessors are what checkpoints, export and statistics use; ``host_input_groups``,
    ``post_input_dist``, ``release_context`` and ``release_finished_pins`` are the pipeline's
    ``HostStagedModule`` protocol.
    """

    _shards: HostShards
    training: bool
    module_sharding_plan: Any

    def _init_kernels(
        self,
        torchrec_init: Callable[..., None],
        *,
        plan: dict[str, ParameterSharding],
        kernels: KernelPlan,
        device: torch.device | None,
        **kwargs: Any,
    ) -> None:
        """TorchRec's constructor (``torchrec_init``: the base class's ``__init__``) on the module
        and plan as the kernels hold them (``kernels``: :func:`~recsdk.sharding.adapter_construction.plan_kernels`);
        afterwards the module keeps the user's ``plan`` as its ``module_sharding_plan`` (where the
        stores' rows are).

        The kernels' own initialisation draws random numbers by their size, so it runs under a
        forked generator: :class:`HostShards` initialises every row from the generator as it was
        before, and a cached table starts with the all-resident table's rows.
        """
        with torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else []):
            torchrec_init(module=kernels.module, table_name_to_parameter_sharding=kernels.plan, device=device, **kwargs)
        if kernels.cached:
            self.module_sharding_plan = compat.user_sharding_plan(self, plan)

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
        """Per local table, all its rows' weight and per-row optimizer state views: the fused
        kernel's, or a cached table's store (after every changed cache row is written back and the
        cache emptied: write these, e.g. a checkpoint load, and the cache fills from them)."""
        return self._shards.views

    def read_rows(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        """The current weights of a local table's ``rows`` (its id table's rows), ``[n, dim]`` on the
        lookup device; a cached table's read through its cache, which stays as it is."""
        return self._shards.read_rows(table, rows)

    def track_changes(self) -> None:
        """Start tracking every local table's changed rows and departed ids (for publishing)."""
        with self._shards.stage.lock:
            for table in self.id_tables.values():
                table.publishing.track()

    def change_snapshots(self, *, full: bool) -> dict[str, ChangeSnapshot]:
        """Per local table, what the next published version holds (see
        :class:`~recsdk.embedding.change_tracker.RowChangeTracker`): taken under the host stage's
        lock, so a pipeline's host thread may go on mapping; rows owed a reset by batches not yet
        computed are left out."""
        with self._shards.stage.lock:
            owed = self._shards.ledger.owed_resets()
            return {
                name: table.publishing.snapshot(full=full, exclude=owed.get(name))
                for name, table in self.id_tables.items()
            }

    def commit_changes(self, snapshots: dict[str, ChangeSnapshot], token: str) -> None:
        """The version holding ``snapshots`` (from :meth:`change_snapshots`) is published as ``token``."""
        with self._shards.stage.lock:
            for name, snap in snapshots.items():
                table = self.id_tables[name]
                table.publishing.commit(snap, token)

    def staging_views(self, table: str) -> TableViews:
        """New tensors shaped as ``table_views()[table]``, for a checkpoint load to read into
        before it commits: in host memory, or for a file store in files beside it."""
        cache = self._shards.caches.get(table)
        if cache is not None:
            return cache.store.staging()
        weight, states = self._shards.kernel[table]
        return TableViews(torch.empty_like(weight), [torch.empty_like(s) for s in states])

    def parameter_key(self, table: str) -> str:
        """The table's key in ``fused_optimizer.params`` and the state dict."""
        return f"{self._shards.prefix}{table}.weight"

    def kernel_rows(self, table: str) -> int:
        """Rows the fused kernel holds of the table on this rank (a cached table's: its cache slots)."""
        return int(self._shards.kernel[table].weight.shape[0])

    def stats(self) -> dict[str, dict[str, float]]:
        """Per table statistics of this rank's shards: ``IdTable.stats``, and for a cached table
        its cache's (``cache_hit_rate``, ``swap_ins``, ``swap_outs``, ``store_rows``, ... see
        ``TableCache.stats``; ``store_rows_used`` is the id table's ``size``)."""
        out = {name: table.stats() for name, table in self.id_tables.items()}
        for name, cache in self._shards.caches.items():
            out[name].update(cache.stats())
            out[name]["store_rows_used"] = len(self.id_tables[name])
        return out

    def reset_parameters(self) -> None:
        """Every row fresh, as its config's ``init_fn`` makes it (recsdk initialises the rows, in the
        kernel or a cached table's store; the id tables keep their ids). TorchRec's constructor
        calls this before the host parts exist: it does nothing then."""
        shards = getattr(self, "_shards", None)
        if shards is not None and shards.has_rows:
            shards.init_rows()

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

    def input_refused(self, ctx: Any) -> bool:
        """Whether some rank refused this batch in its input dist (its input check, or
        :func:`~recsdk.sharding.refuse_inputs`): known on every rank alike once the input dist's
        splits are waited for (the flags come with the ids). Its compute raises on every rank (the
        host-stage agreement), so a pipeline starts no later batch's input dist before it.

        Args:
            ctx: this batch's context (from ``create_context``).
        """
        return bool(ctx.batch_failed)

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
