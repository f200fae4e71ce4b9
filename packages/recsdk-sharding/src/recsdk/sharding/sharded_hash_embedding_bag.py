"""``ShardedHashEmbeddingBagCollection``: a HashEBC sharded row-wise or table-wise.

The host does the id work: raw ids are bucketed by :func:`~recsdk.sharding.owner` (row-wise)
or sent to the table's rank (table-wise), exchanged over the host (gloo) group, and mapped to
local rows by the owning shard's :class:`~recsdk.embedding.IdTable` in
:meth:`ShardedHashEmbeddingBagCollection.post_input_dist`. The device then looks the rows up
with TorchRec's fused kernel and returns pooled results through TorchRec's output dists.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionContext,
    ShardedEmbeddingBagCollection,
    replace_placement_with_meta_device,
)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import LazyAwaitable, ShardingEnv, ShardingType
from torchrec.optim.keyed import CombinedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingBagConfig, IdTable, init_rows_
from recsdk.sharding.host_adam import HostAdamOptimizer, HostAdamTable, adam_params_from_fused, as_sgd_lr1, is_adam
from recsdk.sharding.input_dist import HostTwSparseFeaturesDist, OwnerSparseFeaturesDist
from recsdk.sharding.output_dist import GlooRwPooledEmbeddingSharding

__all__ = [
    "HashEmbeddingBagCollectionContext",
    "HostRwPooledEmbeddingSharding",
    "HostTwPooledEmbeddingSharding",
    "ShardedHashEmbeddingBagCollection",
    "sharded_hash_modules",
]

SUPPORTED_SHARDING_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value)
_VALIDATOR_LOGGER = logging.getLogger("torchrec.sparse.jagged_tensor_validator")


def _drop_range_warnings(record: logging.LogRecord) -> bool:
    return "which is out of range" not in record.getMessage()


@dataclass
class HashEmbeddingBagCollectionContext(EmbeddingBagCollectionContext):
    """EBC context plus what the host stage did for this batch.

    Attributes:
        ids_mapped (bool): ``post_input_dist`` already turned raw ids into rows.
        batch_rows (dict[str, torch.Tensor]): per table, the rows this batch looks up.
        pinned_rows (dict[str, torch.Tensor]): per table with an eviction policy, rows pinned for
            this batch, only when it was mapped ahead of its compute (e.g. by a pipeline). A
            table without an eviction policy never frees rows by itself, so it pins nothing.
        reinit_rows (dict[str, torch.Tensor]): per table, rows this batch's mapping took from
            evicted ids; re-initialised when this batch computes.
    """

    ids_mapped: bool = False
    batch_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    pinned_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    reinit_rows: dict[str, torch.Tensor] = field(default_factory=dict)


class _HostGroupSharding:
    """Adds ``host_pg``, the host (gloo) group for the id all-to-alls, to a TorchRec sharding."""

    def __init__(
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, Any] | None = None,
        *,
        host_pg: dist.ProcessGroup,
    ) -> None:
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)  # type: ignore[call-arg]
        self._host_pg = host_pg


class HostRwPooledEmbeddingSharding(_HostGroupSharding, GlooRwPooledEmbeddingSharding):
    """Row-wise sharding whose input dist buckets raw ids by owner over the host group.

    The pooled output dist is :class:`~recsdk.sharding.GlooRwPooledEmbeddingSharding`'s: an
    all-to-all on gloo, TorchRec's reduce-scatter otherwise.

    Args:
        sharding_infos, env, device, qcomm_codecs_registry: as TorchRec's
            ``RwPooledEmbeddingSharding``.
        host_pg (dist.ProcessGroup): the host (gloo) group for the id all-to-alls.
    """

    def create_input_dist(self, device: torch.device | None = None) -> OwnerSparseFeaturesDist:
        return OwnerSparseFeaturesDist(self._host_pg, self._get_num_features())


class HostTwPooledEmbeddingSharding(_HostGroupSharding, TwPooledEmbeddingSharding):
    """Table-wise sharding whose id all-to-all runs over the host group.

    Args:
        sharding_infos, env, device, qcomm_codecs_registry: as TorchRec's
            ``TwPooledEmbeddingSharding``.
        host_pg (dist.ProcessGroup): the host (gloo) group for the id all-to-alls.
    """

    def create_input_dist(self, device: torch.device | None = None) -> HostTwSparseFeaturesDist:
        return HostTwSparseFeaturesDist(self._host_pg, self.features_per_rank())


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
    table changes.

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
        for name, ps in table_name_to_parameter_sharding.items():
            if ps.sharding_type not in SUPPORTED_SHARDING_TYPES:
                raise ValueError(
                    f"table {name!r}: sharding type {ps.sharding_type!r} is not supported for "
                    f"HashEmbeddingBagCollection; supported: {list(SUPPORTED_SHARDING_TYPES)}"
                )
        # Set before super().__init__: the base constructor calls create_embedding_bag_sharding
        # and create_grouped_sharding_infos.
        self._host_pg = host_env.process_group
        self._emulate_adam = device is None or device.type == "cpu"  # fbgemm's CPU kernel has no Adam
        self._adam_hyper: dict[str, dict[str, Any]] = {}
        super().__init__(
            module=module,
            table_name_to_parameter_sharding=table_name_to_parameter_sharding,
            env=env,
            fused_params=fused_params,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
        self._host_env = host_env
        self._lock = threading.Lock()
        self._pending_reinit: dict[str, list[torch.Tensor]] = {}
        # Reused rows of batches mapped ahead and not computed yet, by id(ctx): still owed a re-init.
        self._inflight_reinit: dict[int, dict[str, torch.Tensor]] = {}
        self._computing_pins: dict[str, torch.Tensor] = {}
        self._hash_configs: dict[str, HashEmbeddingBagConfig] = {
            c.name: c for c in self._embedding_bag_configs if isinstance(c, HashEmbeddingBagConfig)
        }
        self._feature_to_table: dict[str, str] = {
            f: c.name for c in self._embedding_bag_configs for f in c.feature_names
        }
        self._id_tables: dict[str, IdTable] = {}
        for sharding in self._embedding_shardings:
            for grouped in sharding._grouped_embedding_configs:  # this rank's shards
                for table in grouped.embedding_tables:
                    cfg = self._table_name_to_config[table.name]
                    hash_cfg = self._hash_configs.get(table.name)
                    self._id_tables[table.name] = IdTable(
                        table.local_rows,
                        device="cpu",
                        admission=hash_cfg.admission if hash_cfg else None,
                        eviction=hash_cfg.eviction if hash_cfg else None,
                        name=f"{cfg.name}@rank{env.rank}",
                    )
        self._tbe_slices: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] | None = None
        # The failure flag of the batch being computed (see _agree_on_failure), read after its lookup.
        self._pending_agreement: tuple[Any, torch.Tensor] | None = None
        for lookup in self._lookups:
            lookup.register_forward_hook(self._settle_agreement)
        self._adam_tables: dict[str, HostAdamTable] = {}
        self._adam_optimizers: dict[str, HostAdamOptimizer] = {}
        if self._device is None or self._device.type != "meta":
            self._init_local_rows()
            if self._adam_hyper:
                self._install_host_adam()

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
        if self._emulate_adam:
            for group in infos.values():
                for info in group:
                    if info.fused_params and is_adam(info.fused_params):
                        self._adam_hyper[info.embedding_config.name] = adam_params_from_fused(info.fused_params)
                        info.fused_params = as_sgd_lr1(info.fused_params)
        return infos

    def _install_host_adam(self) -> None:
        """Swap the SGD-at-lr-1 kernels' optimizers for :class:`HostAdamOptimizer` (see host_adam)."""
        slices = self._table_slices()
        kept: list[tuple[str, Any]] = []
        combined: CombinedOptimizer = self._optim  # type: ignore[has-type]  # set by the base constructor
        for key, opt in combined._optims:
            names = {k.split(".")[1] for k in opt.params}
            adam_names = names & set(self._adam_hyper)
            if not adam_names:
                kept.append((key, opt))
                continue
            tables = {}
            for name in adam_names:
                weight, _ = slices[name]
                tables[name] = HostAdamTable(weight)
                self._tbe_slices[name] = (weight, [tables[name].exp_avg, tables[name].exp_avg_sq])  # type: ignore[index]
            adam = HostAdamOptimizer(dict(opt.params), tables, self._adam_hyper[next(iter(adam_names))])
            self._adam_tables.update(tables)
            for name in adam_names:
                self._adam_optimizers[name] = adam
            kept.append((key, adam))
        self._optim = CombinedOptimizer(kept)

    def _init_local_rows(self) -> None:
        """Initialise every local row with the table's ``init_fn``, as the unsharded module does.

        TorchRec's fused kernel initialises uniformly from ``weight_init_min/max`` and ignores
        ``init_fn``; a hash table assigns rows to ids as they arrive, so every row must start
        as ``init_fn`` makes it.
        """
        slices = self._table_slices()
        with torch.no_grad():
            for name in self._id_tables:
                weight, _ = slices[name]
                rows = torch.arange(weight.shape[0], device=weight.device)
                init_rows_(weight, rows, self._table_name_to_config[name])

    # ---- construction hooks -------------------------------------------------------------

    def create_embedding_bag_sharding(  # type: ignore[override]
        self,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: dict[str, Any] | None = None,
    ) -> EmbeddingSharding:
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        if device is not None and device.type == "meta":
            replace_placement_with_meta_device(sharding_infos)
        if sharding_type == ShardingType.ROW_WISE.value:
            return HostRwPooledEmbeddingSharding(
                sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry, host_pg=self._host_pg
            )
        if sharding_type == ShardingType.TABLE_WISE.value:
            return HostTwPooledEmbeddingSharding(
                sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry, host_pg=self._host_pg
            )
        raise ValueError(
            f"sharding type {sharding_type!r} is not supported for HashEmbeddingBagCollection; "
            f"supported: {list(SUPPORTED_SHARDING_TYPES)}"
        )

    def create_context(self) -> HashEmbeddingBagCollectionContext:
        return HashEmbeddingBagCollectionContext()

    @property
    def unsharded_module_type(self) -> type[HashEmbeddingBagCollection]:  # type: ignore[override]
        return HashEmbeddingBagCollection

    def input_dist(self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor) -> Any:  # type: ignore[override]
        if not self._has_uninitialized_input_dist:
            return super().input_dist(ctx, features)
        # TorchRec validates the first batch against [0, num_embeddings): raw ids are never in
        # that range, so drop those range warnings (its other checks still log).
        _VALIDATOR_LOGGER.addFilter(_drop_range_warnings)
        try:
            return super().input_dist(ctx, features)
        finally:
            _VALIDATOR_LOGGER.removeFilter(_drop_range_warnings)

    # ---- public API ---------------------------------------------------------------------

    @property
    def id_tables(self) -> dict[str, IdTable]:
        """This rank's id table per table shard it holds (table name -> IdTable)."""
        return self._id_tables

    def stats(self) -> dict[str, dict[str, float]]:
        """Per table statistics of this rank's shards (see ``IdTable.stats``)."""
        return {name: table.stats() for name, table in self._id_tables.items()}

    # ---- the host stage -----------------------------------------------------------------

    def post_input_dist(self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList) -> KJTList:
        """Map the received raw ids to local rows (find-or-insert in train, find in eval).

        Idempotent per context: the pipeline may run it ahead of time on a host thread, and
        ``compute_and_output_dist`` then skips it. Run this way (ahead of the batch's compute),
        it pins the batch's rows in tables with an eviction policy, so that batches mapped later
        cannot evict them (a table without one never frees rows by itself); they are
        unpinned once the next batch computes (or by :meth:`release_context`). When
        ``compute_and_output_dist`` maps the batch itself, nothing is in flight in between and
        nothing is pinned. Ids that are not (yet) admitted, or unknown
        in eval, are dropped from their bags, so they pool as zeros (MEAN pooling still
        divides by the original bag length).

        Args:
            ctx (EmbeddingBagCollectionContext): this batch's context.
            dist_input (KJTList): one KJT of raw ids per sharding type, as received.

        Returns:
            KJTList: the same layout with row indices, on the lookup device.
        """
        return self._post_input_dist(ctx, dist_input, pin=True)

    def _post_input_dist(self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList, pin: bool) -> KJTList:
        """``post_input_dist``; ``pin=False`` when the batch computes right away (nothing is in
        flight between its mapping and its lookup, so its rows need no protection)."""
        if isinstance(ctx, HashEmbeddingBagCollectionContext) and ctx.ids_mapped:
            return dist_input
        training = self.training
        mapped: list[KeyedJaggedTensor] = []
        used: dict[str, list[torch.Tensor]] = {}
        reused: dict[str, list[torch.Tensor]] = {}
        pinned: dict[str, torch.Tensor] = {}
        error: BaseException | None = None
        try:
            for kjt in dist_input:
                mapped.append(self._map_kjt(kjt, training, used, reused))
            if pin:
                # A table without an eviction policy never frees a row by itself: nothing to protect.
                pinned = {n: torch.cat(r) for n, r in used.items() if self._id_tables[n].eviction is not None}
                with self._lock:
                    for name, rows in pinned.items():
                        self._id_tables[name].pin(rows)
        except Exception as e:  # shared with the other ranks below, then re-raised
            error = e
            used, pinned = {}, {}
        reinit = {name: torch.cat(rows) for name, rows in reused.items()}
        if error is not None or not isinstance(ctx, HashEmbeddingBagCollectionContext):
            self._defer_reinit(reinit)
        elif pin and reinit:
            with self._lock:
                self._inflight_reinit[id(ctx)] = reinit
        if pin:
            # Mapped ahead by a pipeline, which agrees on host-stage failures across ranks itself.
            if error is not None:
                raise error
        else:
            self._agree_on_failure(error)
        if isinstance(ctx, HashEmbeddingBagCollectionContext):
            ctx.ids_mapped = True
            ctx.batch_rows = {name: torch.cat(rows) for name, rows in used.items()}
            ctx.pinned_rows = pinned
            ctx.reinit_rows = reinit
        if self._device is not None and self._device.type != "cpu":
            mapped = [kjt.to(self._device, non_blocking=True) for kjt in mapped]
        return KJTList(mapped)

    def _agree_on_failure(self, error: BaseException | None) -> None:
        """Make a host-stage failure on any rank fail every rank, instead of hanging the others.

        One tiny all-reduce of a failure flag over the host group per batch. A failing rank
        waits for it, exchanges messages and re-raises its own exception. A healthy rank does not
        wait here: the flag travels while this batch's rows are looked up, and
        :meth:`_settle_agreement` (a forward hook on the lookups) reads it before the output dist,
        the first collective a failing rank would not join.
        """
        self._settle_agreement()  # a batch that raised before its lookup left one pending
        pg = self._host_pg
        if pg is None or dist.get_world_size(pg) == 1:
            if error is not None:
                raise error
            return
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg, async_op=True)
        if error is None:
            self._pending_agreement = (work, flag)
            return
        work.wait()
        self._exchange_failures(error)

    def _settle_agreement(self, *_: Any) -> None:
        """Wait for this batch's failure flag; raise if a rank's host stage failed."""
        pending, self._pending_agreement = self._pending_agreement, None
        if pending is None:
            return
        work, flag = pending
        work.wait()
        if int(flag) != 0:
            self._exchange_failures(None)

    def _exchange_failures(self, error: BaseException | None) -> None:
        """Every rank, once all know a host stage failed: share the messages and raise."""
        pg = self._host_pg
        messages: list[str | None] = [None] * dist.get_world_size(pg)
        mine = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(messages, mine, group=pg)
        if error is not None:
            raise error
        failed = {r: m for r, m in enumerate(messages) if m is not None}
        raise RuntimeError(
            f"the host id stage failed on rank(s) {sorted(failed)}: "
            + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
        )

    def _map_kjt(
        self,
        kjt: KeyedJaggedTensor,
        training: bool,
        used: dict[str, list[torch.Tensor]],
        reused: dict[str, list[torch.Tensor]],
    ) -> KeyedJaggedTensor:
        keys = kjt.keys()
        values = kjt.values()
        if values.numel() == 0:
            return kjt
        if values.dtype.is_floating_point:
            raise TypeError(f"feature ids must be integers, got dtype {values.dtype} for features {keys}")
        length_per_key = kjt.length_per_key()
        starts = [0]
        for n in length_per_key:
            starts.append(starts[-1] + n)
        segments: dict[str, list[tuple[int, int]]] = {}
        for i, key in enumerate(keys):
            if length_per_key[i] > 0:
                segments.setdefault(self._feature_to_table[key], []).append((starts[i], starts[i + 1]))
        rows = torch.empty(values.numel(), dtype=torch.int64)
        with self._lock:
            for name, segs in segments.items():
                table = self._id_tables[name]
                ids = values[segs[0][0] : segs[0][1]] if len(segs) == 1 else torch.cat([values[a:b] for a, b in segs])
                if training:
                    table_rows = table.find_or_insert(ids)
                    reassigned = table.take_reassigned_rows()
                    if reassigned.numel() > 0:
                        reused.setdefault(name, []).append(reassigned)
                    admitted = table_rows[table_rows >= 0]
                    if admitted.numel() > 0:
                        used.setdefault(name, []).append(admitted)
                else:
                    table_rows = table.find(ids)
                offset = 0
                for a, b in segs:
                    rows[a:b] = table_rows[offset : offset + (b - a)]
                    offset += b - a
        lengths = kjt.lengths()
        weights = kjt.weights_or_none()
        keep = rows >= 0
        if not bool(keep.all()):
            bags = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.to(torch.int64))
            lengths = torch.bincount(bags[keep], minlength=lengths.numel()).to(lengths.dtype)
            rows = rows[keep]
            weights = weights[keep] if weights is not None else None
        return KeyedJaggedTensor(keys=keys, values=rows, weights=weights, lengths=lengths, stride=kjt.stride())

    def release_context(self, ctx: EmbeddingBagCollectionContext) -> None:
        """Unpin the rows of a batch that was mapped but will never be computed.

        A pipeline calls this for batches it drops (``close()``, ``reset()``, a mode switch that
        re-maps them); otherwise their rows would stay pinned and never be evicted.
        """
        if not isinstance(ctx, HashEmbeddingBagCollectionContext):
            return
        with self._lock:
            for name, rows in ctx.pinned_rows.items():
                self._id_tables[name].unpin(rows)
            ctx.pinned_rows = {}
            self._inflight_reinit.pop(id(ctx), None)
        # Its reused rows now belong to new ids all the same: re-initialise them at the next compute.
        self._defer_reinit(ctx.reinit_rows)
        ctx.reinit_rows = {}

    def release_finished_pins(self) -> None:
        """Unpin the rows of the last computed batch (its backward has run).

        Called at the start of the next ``compute_and_output_dist``; a pipeline calls it itself
        before it maps further batches, so that which rows are evictable does not depend on
        thread timing. A checkpoint calls it before reading the tables.
        """
        with self._lock:
            for name, rows in self._computing_pins.items():
                self._id_tables[name].unpin(rows)
            self._computing_pins = {}

    def owed_reinit_rows(self) -> dict[str, torch.Tensor]:
        """Per table, rows reassigned to new ids whose re-initialisation has not run yet.

        They belong to batches mapped ahead (in flight in a pipeline) or dropped by it; a
        checkpoint saves them so that a restored model re-initialises them too.
        """
        with self._lock:
            chunks = {name: list(rows) for name, rows in self._pending_reinit.items()}
            for reinit in self._inflight_reinit.values():
                for name, rows in reinit.items():
                    chunks.setdefault(name, []).append(rows)
        return {name: torch.unique(torch.cat(rows)) for name, rows in chunks.items() if rows}

    def _defer_reinit(self, rows: dict[str, torch.Tensor]) -> None:
        with self._lock:
            for name, chunk in rows.items():
                self._pending_reinit.setdefault(name, []).append(chunk)

    # ---- the device stage ---------------------------------------------------------------

    def compute_and_output_dist(  # type: ignore[override]
        self, ctx: EmbeddingBagCollectionContext, input: KJTList
    ) -> LazyAwaitable[KeyedTensor]:
        # The previous batch's backward has run by now: its rows may be evicted again. Release
        # them before mapping this batch (a plain loop maps here; a pipeline mapped earlier,
        # while the previous batch was still in flight and its rows pinned, and releases them
        # itself at a fixed point of its schedule).
        self.release_finished_pins()
        kjts = self._post_input_dist(ctx, input, pin=False)
        # Rows this batch took from evicted ids get fresh embeddings and optimizer state before
        # its lookup; no batch in flight uses them (they were not pinned when reassigned).
        with self._lock:
            pending, self._pending_reinit = self._pending_reinit, {}
        if isinstance(ctx, HashEmbeddingBagCollectionContext):
            for name, chunk in ctx.reinit_rows.items():
                pending.setdefault(name, []).append(chunk)
            ctx.reinit_rows = {}
            with self._lock:
                self._inflight_reinit.pop(id(ctx), None)
                self._computing_pins = ctx.pinned_rows
        self._reinit_rows(pending)
        snapshots = self._adam_snapshots(ctx)
        awaitable = super().compute_and_output_dist(ctx, kjts)
        if snapshots:
            awaitable.callbacks.append(partial(self._hook_adam, snapshots=snapshots))
        return awaitable

    def _adam_snapshots(self, ctx: EmbeddingBagCollectionContext) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per Adam table: this batch's rows and their values before the kernel's SGD step."""
        if not self._adam_tables or not self.training or not torch.is_grad_enabled():
            return {}
        if not isinstance(ctx, HashEmbeddingBagCollectionContext):
            return {}
        out = {}
        for name, rows in ctx.batch_rows.items():
            if name in self._adam_tables and rows.numel() > 0:
                rows = torch.unique(rows)
                out[name] = (rows, self._adam_tables[name].weight[rows].clone())
        return out

    def _hook_adam(self, kt: KeyedTensor, snapshots: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> KeyedTensor:
        values = kt.values()
        if values.requires_grad:

            def on_grad(grad: torch.Tensor) -> None:
                # Runs when the pooled output's gradient is ready, before the kernel's backward;
                # the queued callback runs once the whole backward (and the kernel's update) is done.
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._apply_adam(snapshots))

            values.register_hook(on_grad)
        return kt

    def _apply_adam(self, snapshots: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        by_optimizer: dict[int, tuple[HostAdamOptimizer, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}
        for name, snap in snapshots.items():
            opt = self._adam_optimizers[name]
            by_optimizer.setdefault(id(opt), (opt, {}))[1][name] = snap
        for opt, snaps in by_optimizer.values():
            opt.apply(snaps)

    def _reinit_rows(self, pending: dict[str, list[torch.Tensor]]) -> None:
        """Fresh ``init_fn`` embeddings and zeroed optimizer state for reused rows."""
        if not pending:
            return
        slices = self._table_slices()
        with torch.no_grad():
            for name, chunks in pending.items():
                rows = torch.unique(torch.cat(chunks))
                weight, states = slices[name]
                init_rows_(weight, rows.to(weight.device), self._table_name_to_config[name])
                for state in states:
                    state[rows.to(state.device)] = 0

    def _table_slices(self) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
        """Per table: the fused kernel's weight view and optimizer state views of this shard."""
        if self._tbe_slices is None:
            slices: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
            for lookup in self._lookups:
                for module in lookup.modules():
                    if not isinstance(module, BatchedFusedEmbeddingBag):
                        continue
                    tbe = module.emb_module
                    names = [t.name for t in module.config.embedding_tables]
                    weights = tbe.split_embedding_weights()
                    states = tbe.split_optimizer_states()
                    for i, name in enumerate(names):
                        table_states = list(states[i]) if i < len(states) else []
                        slices[name] = (weights[i], table_states)
            self._tbe_slices = slices
        return self._tbe_slices


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
