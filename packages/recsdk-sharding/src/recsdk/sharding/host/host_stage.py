"""``IdMappingStage``: the host stage's id work: KJTs of raw ids -> KJTs of local rows.

Holds this rank's :class:`~recsdk.embedding.IdTable` per table shard and the lock that guards
them (the host thread maps batches ahead while the training thread pins, unpins and resets).
It is independent of the module's pooling: a bag collection and an unpooled collection map ids
the same way, and both hand the rows their mapping takes from evicted ids to the
:class:`~recsdk.sharding.host.row_ledger.RowLedger`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torchrec.distributed.embedding_types import ShardedEmbeddingTable
from torchrec.distributed.types import ParameterSharding
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.embedding import IdTable, TableFullError
from recsdk.embedding.hash_tables import click_tables
from recsdk.sharding.host.row_ledger import RowLedger
from recsdk.sharding.host.table_workers import TableWorkers

__all__ = ["IdMappingStage", "MappedBatch", "ShardInfo"]


@dataclass(frozen=True)
class ShardInfo:
    """What error messages say about one table shard on this rank.

    Attributes:
        table (str): the user's table name.
        num_embeddings (int): the table's rows over all ranks.
        sharding_type (str): e.g. ``"row_wise"``.
        rank (int): this rank.
    """

    table: str
    num_embeddings: int
    sharding_type: str
    rank: int


class _TableRows:
    """One table's share of a batch, mapped: its rows (``-1``: no row), whether every id has one,
    and in training the rows its admitted ids hold and the rows the mapping took from evicted ids."""

    __slots__ = ("admitted", "found", "reassigned", "rows")

    def __init__(self, rows: torch.Tensor, reassigned: torch.Tensor | None = None) -> None:
        self.rows = rows
        self.found = rows.numel() == 0 or int(rows.min()) >= 0
        self.reassigned = reassigned
        self.admitted: torch.Tensor | None = None
        if reassigned is not None:
            self.admitted = rows if self.found else torch.masked_select(rows, rows >= 0)


@dataclass
class MappedBatch:
    """What the host stage made of one batch's received ids.

    Attributes:
        kjts (list[KeyedJaggedTensor]): per sharding type, the KJT of local rows.
        rows (dict[str, torch.Tensor]): per table, the rows the batch uses (admitted ids only).
        missing (list[torch.Tensor | None]): per sharding type, for unpooled tables, a bool mask
            of the ids that have no row (placed on row 0; their embeddings must be zeroed, so
            row 0 gets a zero gradient from them, which leaves it unchanged under the fused
            SGD, Adagrad, RowWiseAdagrad and recsdk's CPU Adam, which only updates the batch's
            own rows); ``None`` where every id has a row, and always for pooled tables.
    """

    kjts: list[KeyedJaggedTensor]
    rows: dict[str, torch.Tensor]
    missing: list[torch.Tensor | None]


class IdMappingStage:
    """Maps received raw ids to this rank's local rows, per table shard.

    Train mode finds or inserts (admission and eviction as each table is configured; a table that
    scores clicks reads them from the KJT's weights), and advances the step clock of every table
    once per batch, also of tables that received no ids (as the unsharded module does, so that
    step-based policies decide alike); eval mode only finds. Ids without a row (not admitted yet,
    or unknown in eval) are dropped from their bags, so they look up as zeros (MEAN pooling still
    divides by the original bag length).

    Args:
        id_tables (dict[str, IdTable]): this rank's id table per table shard.
        shards (Mapping[str, ShardInfo]): per table, what errors say of its shard.
        feature_to_table (Mapping[str, str]): feature name -> table name.
        ledger_lock (threading.RLock | None): the lock to guard the tables with (a new one if None).
        clicks (Iterable[str]): the tables that score clicks (read from the KJTs' weights).
        workers (TableWorkers | None): the threads that map a batch's tables at once (None: one,
            the calling thread).

    Example::

        stage = IdMappingStage(id_tables, shards, feature_to_table)
        ledger = RowLedger(stage.id_tables, stage.lock)
        mapped = stage.map(kjts, ctx.token, ledger, training=True)  # mapped.kjts: rows
    """

    def __init__(
        self,
        id_tables: dict[str, IdTable],
        shards: Mapping[str, ShardInfo],
        feature_to_table: Mapping[str, str],
        ledger_lock: threading.RLock | None = None,
        clicks: Iterable[str] = (),
        workers: TableWorkers | None = None,
    ) -> None:
        self._tables = id_tables
        self._workers = workers if workers is not None else TableWorkers(1)
        self._click_tables = list(clicks)
        self._clicks = frozenset(self._click_tables)
        self._shards = dict(shards)
        self._feature_to_table = dict(feature_to_table)
        self._lock = ledger_lock if ledger_lock is not None else threading.RLock()

    @classmethod
    def for_shards(
        cls,
        shards: Iterable[ShardedEmbeddingTable],
        configs: Mapping[str, BaseEmbeddingConfig],
        plan: Mapping[str, ParameterSharding],
        rank: int,
        first_use: Iterable[str] = (),
        workers: TableWorkers | None = None,
    ) -> IdMappingStage:
        """A stage with one id table per local shard, sized to the shard's rows in ``plan``, with
        the table's admission and eviction (hash configs) or none (plain configs).

        Args:
            shards (Iterable[ShardedEmbeddingTable]): this rank's table shards.
            configs (Mapping[str, BaseEmbeddingConfig]): every table's config by name.
            plan (Mapping[str, ParameterSharding]): the module's sharding plan (a cached table's
                shard has the rows of its store, not of the fused kernel).
            rank (int): this rank.
            first_use (Iterable[str]): tables whose rows are initialised at first use (their id
                tables report first-use rows as reassigned: ``IdTable(report_first_use=True)``).
            workers (TableWorkers | None): the threads that map a batch's tables at once.
        """
        _check_layout(configs, plan)
        lazy = set(first_use)
        id_tables, infos = {}, {}
        for table in shards:
            cfg = configs[table.name]
            infos[table.name] = ShardInfo(cfg.name, cfg.num_embeddings, str(plan[table.name].sharding_type), rank)
            spec = plan[table.name].sharding_spec
            id_tables[table.name] = IdTable(
                sum(int(s.shard_sizes[0]) for s in spec.shards if s.placement.rank() == rank),  # type: ignore[union-attr]
                device="cpu",
                admission=getattr(cfg, "admission", None),
                eviction=getattr(cfg, "eviction", None),
                name=f"{cfg.name}@rank{rank}",
                report_first_use=table.name in lazy,
            )
        feature_to_table = {f: c.name for c in configs.values() for f in c.feature_names}
        return cls(id_tables, infos, feature_to_table, clicks=click_tables(list(configs.values())), workers=workers)

    @property
    def id_tables(self) -> dict[str, IdTable]:
        """This rank's id table per table shard (table name -> IdTable)."""
        return self._tables

    @property
    def click_tables(self) -> list[str]:
        """The tables that score clicks (read from the KJTs' weights), in the order given."""
        return self._click_tables

    def table_of(self, feature: str) -> str:
        """The table a feature looks up."""
        return self._feature_to_table[feature]

    @property
    def workers(self) -> TableWorkers:
        """The threads that map a batch's tables at once."""
        return self._workers

    @property
    def lock(self) -> threading.RLock:
        """Guards the id tables (mapping, pins, state reads)."""
        return self._lock

    def map(
        self,
        kjts: Iterable[KeyedJaggedTensor],
        token: int,
        ledger: RowLedger,
        training: bool,
        pooled: bool = True,
        keep_weights: bool = True,
    ) -> MappedBatch:
        """Map each KJT's raw ids to local rows.

        Rows the mapping takes from evicted ids are owed a reset by batch ``token`` in
        ``ledger``, also when the mapping fails part way (the tables keep what they did).

        Args:
            kjts (Iterable[KeyedJaggedTensor]): raw int64 ids, one KJT per sharding type.
            token (int): the batch's token.
            ledger (RowLedger): where the owed resets go.
            training (bool): insert (train) or only find (eval).
            pooled (bool): ids without a row are dropped from their bags (pooled tables); else
                they keep their place, on row 0, and are marked in ``MappedBatch.missing`` (an
                unpooled table's output has one embedding per id: those are zeroed).
            keep_weights (bool): the mapped KJTs keep the weights (a weighted module); else the
                weights only brought clicks and are dropped.

        Returns:
            MappedBatch: the KJTs with row indices (same keys and stride), the rows per table.

        Raises:
            TypeError: floating-point ids.
            TableFullError: a table shard has no room and cannot evict (names the table and rank).
        """
        used: dict[str, list[torch.Tensor]] = {}
        reused: dict[str, list[torch.Tensor]] = {}
        mapped: list[KeyedJaggedTensor] = []
        missing: list[torch.Tensor | None] = []
        called: set[str] = set()
        try:
            for kjt in kjts:
                rows_kjt, absent = self._map_kjt(kjt, training, used, reused, pooled, called)
                if not keep_weights and rows_kjt.weights_or_none() is not None:
                    rows_kjt = KeyedJaggedTensor(
                        keys=rows_kjt.keys(),
                        values=rows_kjt.values(),
                        lengths=rows_kjt.lengths(),
                        stride=rows_kjt.stride(),
                    )
                mapped.append(rows_kjt)
                missing.append(absent)
            if training:  # one step for every table, also those without ids in this batch
                with self._lock:
                    for name in self._tables.keys() - called:
                        self._find_or_insert(name, torch.zeros(0, dtype=torch.int64), None)
        finally:
            if reused:
                ledger.owe(token, {name: _joined(rows) for name, rows in reused.items()})
        return MappedBatch(mapped, {name: _joined(rows) for name, rows in used.items()}, missing)

    def _map_kjt(
        self,
        kjt: KeyedJaggedTensor,
        training: bool,
        used: dict[str, list[torch.Tensor]],
        reused: dict[str, list[torch.Tensor]],
        pooled: bool,
        called: set[str],
    ) -> tuple[KeyedJaggedTensor, torch.Tensor | None]:
        keys = kjt.keys()
        values = kjt.values()
        if values.numel() == 0:
            return kjt, None
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
        weights = kjt.weights_or_none()

        def map_table(item: tuple[str, list[tuple[int, int]]]) -> _TableRows:
            name, segs = item
            ids = _gathered(values, segs)
            if not training:
                return _TableRows(self._tables[name].find(ids))
            clicks = _gathered(weights, segs) if weights is not None and name in self._clicks else None
            table_rows = self._find_or_insert(name, ids, clicks)
            return _TableRows(table_rows, self._tables[name].take_reassigned_rows())

        with self._lock:
            outcomes = self._workers.run(map_table, list(segments.items()))
        found_all = True  # every id has a row (the steady state: no mask, no compaction)
        rows_of: dict[str, torch.Tensor] = {}
        error: Exception | None = None
        for name, outcome in zip(segments, outcomes, strict=True):
            if isinstance(outcome, Exception):
                error = error or outcome  # raised once every table's reassigned rows are owed
                continue
            table_rows = outcome.rows
            found_all = found_all and outcome.found
            if outcome.reassigned is not None and outcome.admitted is not None:  # training
                called.add(name)
                if outcome.reassigned.numel() > 0:
                    reused.setdefault(name, []).append(outcome.reassigned)
                if outcome.admitted.numel() > 0:
                    used.setdefault(name, []).append(outcome.admitted)
            rows_of[name] = table_rows
        if error is not None:
            raise error
        rows = _in_value_order(rows_of, segments)
        lengths = kjt.lengths()
        weights = kjt.weights_or_none()
        if found_all:
            absent = None
        else:
            keep = rows >= 0
            if pooled:
                absent = None
                lengths = _kept_lengths(kjt.offsets(), keep, lengths.dtype)
                rows = torch.masked_select(rows, keep)  # a third of indexing by the mask's time
                weights = torch.masked_select(weights, keep) if weights is not None else None
            else:
                absent = ~keep
                rows = rows.masked_fill(absent, 0)
        kjt = KeyedJaggedTensor(keys=keys, values=rows, weights=weights, lengths=lengths, stride=kjt.stride())
        return kjt, absent

    def _find_or_insert(self, name: str, ids: torch.Tensor, clicks: torch.Tensor | None) -> torch.Tensor:
        table = self._tables[name]
        try:
            return table.find_or_insert(ids, clicks)
        except TableFullError as e:
            shard = self._shards[name]
            cause = str(e).split(". Raise", 1)[0]
            advice = (
                "use smaller batches or map fewer batches ahead (a pipeline's pipe_n_batch)"
                if table.eviction is not None
                else "or set an eviction policy (LRUEviction, LFUEviction, TTLEviction or ScoreEviction) in its config"
            )
            raise TableFullError(
                f"table {shard.table!r} is full on rank {shard.rank}: its {shard.sharding_type} shard there holds "
                f"{table.capacity} of the table's {shard.num_embeddings} rows. {cause}. Raise num_embeddings of "
                f"table {shard.table!r} (each rank's shard grows with it), {advice}."
            ) from e


def _check_layout(configs: Mapping[str, BaseEmbeddingConfig], plan: Mapping[str, ParameterSharding]) -> None:
    """Raise, the same on every rank (from the configs and the plan), where the host stage could
    not map a table's ids: a feature read by two tables (its ids go to one id table per feature)
    or a shard without rows (its rank owns ids it could not place).

    Raises:
        ValueError: names the feature and its tables, or the table, its rows and the shard.
    """
    tables_of: dict[str, list[str]] = {}
    for cfg in configs.values():
        for feature in cfg.feature_names:
            tables_of.setdefault(feature, []).append(cfg.name)
    for feature, tables in tables_of.items():
        if len(tables) > 1:
            raise ValueError(
                f"feature {feature!r} is read by tables {tables}: a sharded hash module maps each feature's "
                "ids in one table; give each table its own feature names"
            )
    for name, sharding in plan.items():
        spec = sharding.sharding_spec
        for shard in getattr(spec, "shards", ()):
            rows = int(shard.shard_sizes[0])
            if rows < 1:
                raise ValueError(
                    f"table {name!r}: its {sharding.sharding_type} plan gives rank {shard.placement.rank()} a "
                    f"shard of {rows} rows (num_embeddings={configs[name].num_embeddings} over "
                    f"{len(spec.shards)} shards); every shard "
                    f"of a hash table needs rows for the ids its rank owns: raise num_embeddings to at least "
                    f"{len(spec.shards)}, or shard the table table-wise"
                )


def _in_value_order(rows_of: dict[str, torch.Tensor], segments: dict[str, list[tuple[int, int]]]) -> torch.Tensor:
    """Each table's rows put back where its ids were: ``segments[name]`` are the ``[start, end)``
    ranges of the values that ``rows_of[name]`` maps, in order; together they cover the values.
    One copy (none when one table's ids are all of them)."""
    pieces: list[tuple[int, torch.Tensor]] = []
    for name, segs in segments.items():
        table_rows, offset = rows_of[name], 0
        for a, b in segs:
            pieces.append((a, table_rows[offset : offset + (b - a)]))
            offset += b - a
    if len(pieces) == 1:
        return pieces[0][1]
    pieces.sort(key=lambda piece: piece[0])
    return torch.cat([piece for _, piece in pieces])


def _kept_lengths(offsets: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bag lengths once the values where ``keep`` is False are dropped: each bag loses the
    dropped values between its offsets (a running count of dropped values, read at the offsets).

    Args:
        offsets (torch.Tensor): the bags' offsets ``[bags + 1]`` into the values.
        keep (torch.Tensor): bool ``[values]``.
        dtype (torch.dtype): the lengths' dtype.
    """
    dropped = torch.ops.fbgemm.asynchronous_complete_cumsum((~keep).to(offsets.dtype))  # [values + 1]
    return (offsets - dropped.index_select(0, offsets)).diff().to(dtype)


def _gathered(values: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """The ``[start, end)`` segments of ``values``, joined (a view when there is one)."""
    if len(segments) == 1:
        return values[segments[0][0] : segments[0][1]]
    return torch.cat([values[a:b] for a, b in segments])


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    """The chunks as one tensor (the chunk itself when there is one: no copy)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
