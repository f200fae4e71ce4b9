"""``HostShards``: one sharded hash module's host-side parts, composed.

Both sharded hash modules (the bag collection and the unpooled collection) are TorchRec sharded
modules whose id work runs on the host. What they share is here, once: :class:`HostShards`
composes the parts for one module: the input guard, the
:class:`~recsdk.sharding.host.host_stage.IdMappingStage` (this rank's id tables), the
:class:`~recsdk.sharding.host.row_ledger.RowLedger`, the :class:`~recsdk.sharding.FailureAgreement`
of the inline host stage, the fused kernel's views and the CPU Adam. Their public face, which
both adapters inherit, is :class:`~recsdk.sharding.host_sharded_module.HostShardedModule`.

The adapters keep only TorchRec's hooks (construction, ``input_dist``,
``compute_and_output_dist``) and delegate to their ``HostShards``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import LazyAwaitable, ParameterSharding
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.embedding import IdTable, init_rows_
from recsdk.sharding import _torchrec_compat as compat
from recsdk.sharding.context import CachedRows, HostStageState
from recsdk.sharding.distribution.agreement import CarriedFlag, FailureAgreement
from recsdk.sharding.distribution.input_guard import guard_input
from recsdk.sharding.distribution.kjt_all_to_all import batch_flag
from recsdk.sharding.distribution.output_dist import FlagCarrier
from recsdk.sharding.host.host_stage import IdMappingStage
from recsdk.sharding.host.row_ledger import RowLedger
from recsdk.sharding.host.table_workers import TableWorkers, default_host_threads
from recsdk.sharding.planning.cache_plan import TableCacheSpec
from recsdk.sharding.rows.host_adam import HostAdam
from recsdk.sharding.rows.row_cache import TableCache
from recsdk.sharding.rows.row_store import create_store
from recsdk.sharding.rows.tbe_views import TableViews, fused_table_views, init_all_rows_, reset_rows_

__all__ = ["HostShards"]


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
        configs (dict[str, BaseEmbeddingConfig]): every table's config, as the user gave it (a
            cached table's kernel was built from a copy with the cache's rows).
        cached (dict[str, TableCacheSpec]): the tables with a device cache over a row store.
        module_fqn (str | None): the module's name in the model (the file stores' names).
        host_threads (int | None): how many tables of a batch the host stage maps at once
            (``None``: :func:`~recsdk.sharding.host.table_workers.default_host_threads` of ``device``).
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
        configs: dict[str, BaseEmbeddingConfig],
        cached: dict[str, TableCacheSpec],
        module_fqn: str | None = None,
        host_threads: int | None = None,
    ) -> None:
        self.host_pg = host_pg
        self.configs = dict(configs)
        self.prefix = prefix
        self._features = list(features)
        self._name = name
        self._is_weighted = is_weighted
        self._pooled = pooled
        self._device = device
        self._host_adam = host_adam
        lazy = [n for n, spec in cached.items() if spec.store == "file"]
        threads = host_threads if host_threads is not None else default_host_threads(device)
        self.stage = IdMappingStage.for_shards(
            compat.local_shards(module), self.configs, plan, rank, first_use=lazy, workers=TableWorkers(threads)
        )
        self.ledger = RowLedger(self.stage.id_tables, self.stage.lock)
        self._agreement = FailureAgreement(host_pg, what="the host id stage")
        # The inline agreement's flag rides in the pooled output dists' all-to-alls where they can
        # carry it (gloo), instead of an all-reduce per batch; the same on every rank (the plan).
        carriers = [d for d in compat.output_dists(module) if isinstance(d, FlagCarrier) and d.carries_flag()]
        self._flag: CarriedFlag | None = None
        if carriers:
            self._flag = CarriedFlag()
            for output_dist in carriers:
                output_dist.carry(self._flag)
        self._missing: list[torch.Tensor | None] = []  # the computing batch's ids without a row
        self._kernel_rows: dict[str, torch.Tensor] = {}  # the computing batch's rows in the kernel, per Adam table
        lookups = compat.fused_lookups(module)
        for i, lookup in enumerate(lookups):
            lookup.register_forward_hook(lambda _m, _in, out, i=i: self._after_lookup(i, out))
        self._kernel: dict[str, TableViews] | None = None
        self.caches: dict[str, TableCache] = {}
        if device is None or device.type != "meta":
            views = fused_table_views(lookups)
            compat.replace_fused_optimizer(module, host_adam.install(module.fused_optimizer, views))  # type: ignore[arg-type]
            self._kernel = host_adam.views(views)
            pin = device is not None and device.type == "cuda"  # the stores of a CUDA cache: page-locked
            self.caches = self._create_caches(cached, rank, module_fqn, pin=pin)
            self.init_rows()

    def _create_caches(
        self, cached: dict[str, TableCacheSpec], rank: int, module_fqn: str | None, *, pin: bool
    ) -> dict[str, TableCache]:
        """A row store and its device cache per cached table shard on this rank (agreed: a rank
        whose store cannot be created fails every rank). Every rank has the same plan, so
        without cached tables none agrees."""
        if not cached:
            return {}
        kernel = self.kernel
        caches: dict[str, TableCache] = {}
        error: Exception | None = None
        try:
            for name, table in self.stage.id_tables.items():
                spec = cached.get(name)
                if spec is None:
                    continue
                store = create_store(
                    spec.store,
                    table.capacity,
                    kernel[name],
                    table=name,
                    directory=spec.directory,
                    rank=rank,
                    name=f"{module_fqn}.{name}" if module_fqn else name,
                    pin=pin,
                )
                caches[name] = TableCache(name, store, kernel[name], algorithm=spec.algorithm, rank=rank)
        except Exception as e:  # shared with the other ranks, then re-raised
            error = e
        FailureAgreement(self.host_pg, what="creating the row stores").check(error)
        return caches

    def init_rows(self) -> None:
        """Every row's embedding as its config's ``init_fn`` makes it: the kernel's rows of resident
        tables, the store of a host-memory cached table (its cache fills from it); in a file store,
        the rows ids hold (the others are initialised at first use)."""
        kernel = self.kernel
        every_row: dict[str, TableViews] = {}
        for name, table in self.stage.id_tables.items():
            if table.changes is not None:  # every row changes: the next published version is full
                table.changes.reset()
            cache = self.caches.get(name)
            if cache is None:
                every_row[name] = kernel[name]
                continue
            cache.flush()
            if cache.store.lazy_init:
                init_rows_(cache.store.views.weight, table.ids_and_rows()[1], self.configs[name])
            else:
                every_row[name] = cache.store.views
        init_all_rows_(every_row, self.configs)

    @property
    def has_rows(self) -> bool:
        """Whether the module has rows (it is not on the meta device)."""
        return self._kernel is not None

    @property
    def kernel(self) -> dict[str, TableViews]:
        """Per local table, the fused kernel's rows (a cached table's: its cache slots)."""
        if self._kernel is None:
            raise RuntimeError(f"the sharded {self._name} is on the meta device: it has no rows")
        return self._kernel

    @property
    def views(self) -> dict[str, TableViews]:
        """Per local table, all its rows: the kernel's, or a cached table's store after a flush
        (every changed cache row written back; the cache starts empty again)."""
        views = dict(self.kernel)
        for name, cache in self.caches.items():
            cache.flush()
            views[name] = cache.store.views
        return views

    def guard(self, ctx: HostStageState, features: Any, training: bool) -> KeyedJaggedTensor:
        """The batch to send through the input dist (see :mod:`~recsdk.sharding.distribution.input_guard`)."""
        checked, ctx.input_error = guard_input(
            features,
            self._features,
            module=self._name,
            is_weighted=self._is_weighted,
            click_tables=self.stage.click_tables,
            training=training,
        )
        return checked

    def batch_flag(self, ctx: HostStageState) -> contextlib.AbstractContextManager[None]:
        """Around the module's input dist: its id all-to-alls carry whether this rank's batch is
        bad to every rank, and set ``ctx.batch_failed`` where any rank's is."""

        def received(failed: bool) -> None:
            ctx.batch_failed = failed

        return batch_flag(ctx.input_error is not None, received)

    def map(self, ctx: HostStageState, dist_input: KJTList, *, ahead: bool, training: bool) -> KJTList:
        """The host stage's mapping of one batch (idempotent per context).

        ``ahead`` (a pipeline's host thread): the batch's rows are held until it computes, and a
        failure raises here (the pipeline agrees on it). Inline: the failure agreement starts
        here and settles once the batch's output dist is done (:meth:`end_compute`); a rank whose
        stage failed looks up a stand-in (:meth:`_stand_in`) meanwhile, so it joins every
        collective its peers run. The flag travels in the pooled output dists' all-to-alls on
        gloo (``output_dist.FlagCarrier``), elsewhere in an all-reduce that overlaps the
        lookup and the output dist. A batch that some rank's input check refused
        (``ctx.batch_failed``, told by the id all-to-all) is mapped by no rank: the healthy ones
        look up the stand-in too, and its agreement raises on every rank.
        """
        if ctx.ids_mapped:
            return dist_input
        error: Exception | None = ctx.input_error
        mapped: list[KeyedJaggedTensor] = []
        # A peer's batch failed (its flag came with the ids): map nothing, so that the failed step
        # changes no id table; the failed rank's agreement raises on every rank.
        peer_failed = error is None and ctx.batch_failed
        if error is None and not peer_failed:
            try:
                batch = self.stage.map(
                    dist_input, ctx.token, self.ledger, training, pooled=self._pooled, keep_weights=self._is_weighted
                )
                mapped, ctx.batch_rows, ctx.missing = batch.kjts, batch.rows, batch.missing
                ctx.cache_rows = [self._cached_rows(kjt, training) for kjt in mapped]
                if ahead and training:  # eval finds only: it neither steps nor evicts
                    self.ledger.hold(ctx.token)
            except Exception as e:  # shared with the other ranks, then re-raised
                error = e
        if error is not None:
            self.ledger.release(ctx.token)
        if ahead:
            if error is not None:
                raise error
        else:
            self._agreement.start(error, defer=True, carrier=self._flag)
        if error is not None or peer_failed:
            mapped, ctx.missing = self._stand_in(dist_input)
            ctx.batch_rows, ctx.cache_rows = {}, [{} for _ in mapped]
        ctx.ids_mapped = True
        if self._device is not None and self._device.type != "cpu":
            mapped = [kjt.to(self._device, non_blocking=True) for kjt in mapped]
        return KJTList(mapped)

    def begin_compute(self, ctx: HostStageState, dist_input: KJTList, training: bool) -> KJTList:
        """Everything before the lookup of a computing batch; returns its rows' KJTs."""
        # The previous batch's backward has run: its rows may be evicted by this batch's mapping.
        self.ledger.release_finished()
        if ctx.ids_mapped and self._flag is not None:
            # Mapped ahead (its failures were agreed then): the output dists carry the flags all
            # the same, and every rank reads them, so the header rows never pile up unread.
            self._agreement.start(None, carrier=self._flag)
        kjts = self.map(ctx, dist_input, ahead=False, training=training)
        kernel = self.kernel
        if training:
            self._stamp_changes(ctx)
        for name, rows in self.ledger.start_compute(ctx.token).items():
            cache = self.caches.get(name)
            if cache is None:
                reset_rows_(kernel[name], rows, self.configs[name])
            else:  # reset where the row lives; the cache takes it from there when it is used
                cache.forget(rows)
                reset_rows_(cache.store.views, rows, self.configs[name])
        if self.caches:
            cached = ctx.cache_rows
            kjts = KJTList([self._to_slots(kjt, rows, training) for kjt, rows in zip(kjts, cached, strict=True)])
        # What the CPU Adam's watch reads: its tables' rows of this batch in the kernel (slots if cached).
        self._kernel_rows = {
            name: self.caches[name].slots_of(ctx.batch_rows[name]) if name in self.caches else ctx.batch_rows[name]
            for name in self._host_adam.tables
            if name in ctx.batch_rows
        }
        self._missing = ctx.missing
        return kjts

    def _stamp_changes(self, ctx: HostStageState) -> None:
        """Tell the change trackers (publishing) the rows this training batch changes: its rows, and
        row 0 of every table when unpooled ids without a row look it up (the optimizer sees it)."""
        missing = any(m is not None for m in ctx.missing)

        def stamp(item: tuple[str, IdTable]) -> None:
            name, table = item
            assert table.changes is not None
            rows = ctx.batch_rows.get(name)
            if rows is not None:
                table.changes.changed(rows)
            if missing:
                table.changes.changed(torch.zeros(1, dtype=torch.int64))

        tracked = [(name, t) for name, t in self.stage.id_tables.items() if t.changes is not None]
        self.stage.workers.run_all(stamp, tracked)  # the tables at once

    def read_rows(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        """The current weights of ``rows`` (the id table's rows) of a local table, ``[n, dim]``;
        a cached table's read through its cache (nothing written back, nothing evicted)."""
        cache = self.caches.get(table)
        if cache is not None:
            return cache.read_weights(rows)
        weight = self.kernel[table].weight
        return weight.index_select(0, rows.to(weight.device))

    def end_compute(self, ctx: HostStageState, awaitable: LazyAwaitable[Any], training: bool) -> None:
        """After the lookups were issued: the inline failure agreement settles when the output is
        waited for (after the output dist: every rank raises there if one's host stage failed);
        the CPU Adam's watch of a training batch (its rows in the kernel: a cached Adam table's
        slots)."""
        awaitable.callbacks.append(self._settled)
        if training and torch.is_grad_enabled():
            self._host_adam.watch(awaitable, self._kernel_rows)

    def _to_slots(self, kjt: KeyedJaggedTensor, cached_rows: CachedRows, training: bool) -> KeyedJaggedTensor:
        """A KJT of store rows with the rows of cached tables replaced by their cache slots
        (``cached_rows``: what :meth:`_cached_rows` found in it)."""
        if not cached_rows:
            return kjt
        values = kjt.values()
        rows = values.to("cpu", copy=True)
        for table, (segs, table_rows) in cached_rows.items():
            slots = self.caches[table].to_slots(table_rows, training=training)
            offset = 0
            for a, b in segs:
                rows[a:b] = slots[offset : offset + b - a]
                offset += b - a
        return KeyedJaggedTensor(
            keys=kjt.keys(),
            values=rows.to(values.device),
            weights=kjt.weights_or_none(),
            lengths=kjt.lengths(),
            stride=kjt.stride(),
        )

    def _cached_segments(self, kjt: KeyedJaggedTensor) -> dict[str, list[tuple[int, int]]]:
        """Per cached table, the ``[start, end)`` ranges of its features' values in ``kjt``."""
        segments: dict[str, list[tuple[int, int]]] = {}
        if not self.caches or kjt.values().numel() == 0:
            return segments
        start = 0
        for key, n in zip(kjt.keys(), kjt.length_per_key(), strict=True):
            table = self.stage.table_of(key)
            if n > 0 and table in self.caches:
                segments.setdefault(table, []).append((start, start + n))
            start += n
        return segments

    def _cached_rows(self, kjt: KeyedJaggedTensor, training: bool) -> CachedRows:
        """Per cached table, where its features' values are in ``kjt`` and the store rows they hold;
        they must fit its device cache (``TableFullError`` naming the table otherwise) and, in
        training, its store must have room for what they may write (``OSError`` ``ENOSPC``)."""
        values = kjt.values()
        out = {}
        for table, segs in self._cached_segments(kjt).items():
            rows = values[segs[0][0] : segs[0][1]] if len(segs) == 1 else torch.cat([values[a:b] for a, b in segs])
            self.caches[table].check_fits(rows)
            if training:
                self.caches[table].store.check_room(rows.numel())  # repeats counted: an upper bound
            out[table] = (segs, rows)
        return out

    def _settled(self, output: Any) -> Any:
        self._agreement.settle()
        return output

    def _stand_in(self, dist_input: KJTList) -> tuple[list[KeyedJaggedTensor], list[torch.Tensor | None]]:
        """What a rank whose host stage failed looks up in place of the received ids, so that its
        lookups and output dist match its peers': pooled, empty bags (zeros); unpooled, every id
        on row 0 and marked missing (zeroed after the lookup)."""
        kjts: list[KeyedJaggedTensor] = []
        missing: list[torch.Tensor | None] = []
        for kjt in dist_input:
            values, lengths = kjt.values(), kjt.lengths()
            if self._pooled:
                weights = kjt.weights_or_none() if self._is_weighted else None
                kjts.append(
                    KeyedJaggedTensor(
                        keys=kjt.keys(),
                        values=values.new_zeros(0, dtype=torch.int64),
                        weights=weights.new_zeros(0) if weights is not None else None,
                        lengths=torch.zeros_like(lengths),
                        stride=kjt.stride(),
                    )
                )
                missing.append(None)
            else:
                rows = torch.zeros(values.numel(), dtype=torch.int64)
                kjts.append(KeyedJaggedTensor(keys=kjt.keys(), values=rows, lengths=lengths, stride=kjt.stride()))
                missing.append(torch.ones(values.numel(), dtype=torch.bool) if values.numel() else None)
        return kjts, missing

    def _after_lookup(self, i: int, output: torch.Tensor) -> torch.Tensor | None:
        missing = self._missing[i] if i < len(self._missing) else None
        if missing is None:
            return None
        # An unpooled lookup's output is one row per id, possibly flattened: [n * dim].
        rows = output.view(missing.numel(), -1)
        return rows.masked_fill(missing.to(output.device).unsqueeze(1), 0).view_as(output)
