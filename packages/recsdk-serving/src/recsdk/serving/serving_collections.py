"""Read-only serving collections with the forward of recsdk's hash collections.

:class:`ServingEmbeddingBagCollection` stands in for a
:class:`~recsdk.embedding.HashEmbeddingBagCollection` (a KJT of raw ids to a ``KeyedTensor``,
the same keys, order and dims), :class:`ServingEmbeddingCollection` for a
:class:`~recsdk.embedding.HashEmbeddingCollection` (to ``dict[str, JaggedTensor]``).

A forward maps every feature's raw ids to rows in one call of recsdk's ``pruned_slots_lookup`` op
(FBGEMM's ``pruned_hashmap_lookup`` with prefetching, :mod:`recsdk.embedding.slot_lookup`; FBGEMM's
own for small batches or where recsdk's kernel is not built) over the slots of each table's
:class:`~recsdk.serving.served_table.ServedTable` index, laid end to end once per applied version,
then looks them up in one call of FBGEMM's inference kernel,
``IntNBitTableBatchedEmbeddingBagsCodegen`` (what TorchRec's quantized inference modules run),
whose rows are in the dtype published: fp32, fp16, or int8 with a float16 scale and bias per row,
copied in as published. Ids a table does not hold map to ``-1``, which the kernel skips: zeros,
as the trained model's eval gives; MEAN bags divide by the bag's length with those ids counted,
as :class:`~recsdk.embedding.HashEmbeddingBagCollection` does. Both work under
``torch.jit.script`` (a script is a snapshot: it keeps the index it was made with; script again
after applying versions). A forward checks its batch first
(:func:`~recsdk.serving.batch_checks.check_batch`): the kernels trust their offsets.
"""

from dataclasses import dataclass
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingCollection, IdTable, PublishedVersion
from recsdk.embedding.slot_lookup import native_lookup_available
from recsdk.serving.batch_checks import check_batch
from recsdk.serving.grouped_lookup import (
    MIN_IDS_PER_GROUP,
    NATIVE_MIN_IDS,
    KernelView,
    feature_bounds,
    kernel_view,
    lookup_in_groups,
)
from recsdk.serving.served_table import ServedTable

__all__ = ["SPARSE_TYPES", "ServingEmbeddingBagCollection", "ServingEmbeddingCollection", "StagedVersion"]

SPARSE_TYPES = {"float32": SparseType.FP32, "float16": SparseType.FP16, "uint8": SparseType.INT8}
"""FBGEMM's row type for each dtype a publication's rows come in."""


class _ServingCollection(nn.Module):
    """What both collections share: the tables' ids, the kernel of their rows, applying versions.

    Attributes:
        lookup_threads (int): the most threads a forward splits its lookup over (1, the default:
            none; measured on the 2-core dev machine, a split was slower than one call, see the
            README). Scripting copies it.
        min_ids_per_group (int): the fewest ids a thread looks up (a smaller batch is looked up
            on the calling thread alone).
        native_min_ids (int): from how many ids (per group) a forward maps them with
            ``torch.ops.recsdk.pruned_slots_lookup`` rather than FBGEMM's ``pruned_hashmap_lookup``
            (same rows); :data:`~recsdk.serving.grouped_lookup.NATIVE_MIN_IDS`, or -1 (never)
            where recsdk's kernel is not built. Scripting copies it.
    """

    # What a forward reads of ``tbe``. TorchScript types the attribute from this annotation, which
    # is why this module is not under ``from __future__ import annotations`` (a string would not do).
    kernel: KernelView

    def __init__(self, configs: list[Any], dtype: str, pooled: bool) -> None:
        super().__init__()
        if dtype not in SPARSE_TYPES:
            raise ValueError(f"rows of dtype {dtype!r}; served are {sorted(SPARSE_TYPES)}")
        self.configs = list(configs)
        self.pooled = pooled
        self.tables: list[ServedTable] = []
        first = 0
        for cfg in self.configs:
            self.tables.append(ServedTable(cfg, first))
            first += len(cfg.feature_names)
        self.features = [f for cfg in self.configs for f in cfg.feature_names]
        self.dims = [int(cfg.embedding_dim) for cfg in self.configs for _ in cfg.feature_names]
        self.dtype = dtype
        self._name = type(self).__name__
        self._is_weighted = False
        self.tbe = self._kernel(dtype)
        self.kernel = kernel_view(self.tbe)
        self.lookup_threads = 1
        self.min_ids_per_group = MIN_IDS_PER_GROUP
        self.native_min_ids = NATIVE_MIN_IDS if native_lookup_available() else -1
        # Every feature's slots of its table's index, end to end (a table read by several
        # features appears once per feature), and the tables that hold the id -1.
        self.index_slots: torch.Tensor
        self.index_offsets: torch.Tensor
        self.register_buffer("index_slots", torch.zeros(0, 2, dtype=torch.int64), persistent=False)
        self.register_buffer("index_offsets", torch.zeros(len(self.features) + 1, dtype=torch.int64), persistent=False)
        self.minus_one: torch.Tensor  # rows (first feature, end feature, row) of the tables holding -1
        self.register_buffer("minus_one", torch.zeros(0, 3, dtype=torch.int64), persistent=False)
        self.index_slots, self.index_offsets, self.minus_one = self._index([t.ids for t in self.tables])

    def _kernel(self, dtype: str) -> IntNBitTableBatchedEmbeddingBagsCodegen:
        """One FBGEMM inference kernel over every table; a feature per lookup (``feature_table_map``)."""
        kernel = IntNBitTableBatchedEmbeddingBagsCodegen(
            [
                (cfg.name, int(cfg.num_embeddings), int(cfg.embedding_dim), SPARSE_TYPES[dtype], EmbeddingLocation.HOST)
                for cfg in self.configs
            ],
            feature_table_map=[t for t, cfg in enumerate(self.configs) for _ in cfg.feature_names],
            device="cpu",
            pooling_mode=PoolingMode.SUM if self.pooled else PoolingMode.NONE,
            output_dtype=SparseType.FP32,
            # Rows come from the collection's own index: in range, or -1 (skipped by the kernel).
            bounds_check_mode=BoundsCheckMode.NONE,
        )
        kernel.initialize_weights()
        return kernel

    def _lookup(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, torch.Tensor]:
        """The input (checked: :func:`~recsdk.serving.batch_checks.check_batch`) in the collection's
        feature order, and the kernel's output for it (its ids mapped to rows, ``-1`` where a table
        does not hold the id: the kernel skips it), split by features over up to
        :attr:`lookup_threads` threads:
        :func:`~recsdk.serving.grouped_lookup.lookup_in_groups`."""
        offsets, num_ids = check_batch(features, self.features, self._name, self._is_weighted)
        if features.keys() != self.features:
            features = features.permute([features.keys().index(f) for f in self.features])
            offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(features.lengths().long())
        weights: torch.Tensor | None = None
        if self._is_weighted:
            given = features.weights_or_none()
            if given is not None:
                weights = given.float()
        batch = features.stride()
        bounds = feature_bounds(
            offsets, batch, len(self.features), self.lookup_threads, self.min_ids_per_group, num_ids
        )
        out = lookup_in_groups(
            features.values().long(),
            offsets,
            weights,
            batch,
            bounds,
            self.index_slots,
            self.index_offsets,
            self.minus_one,
            self.kernel,
            self.pooled,
            self.native_min_ids,
        )
        return features, out

    @torch.jit.unused
    def _index(self, ids: list[IdTable]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The index a forward reads, from the tables' id indexes ``ids`` (a new copy: a forward on the
        one in use is not disturbed): every feature's slots end to end, their offsets, and the rows
        (first feature, end feature, row) of the tables holding the id -1."""
        slots, offsets, minus_one = [], [0], []
        for table, table_ids in zip(self.tables, ids, strict=True):
            table_slots, _, row = table_ids.index_state()
            for _ in table.features:
                slots.append(table_slots)
                offsets.append(offsets[-1] + table_slots.shape[0])
            if row >= 0:
                minus_one.append((table.first_feature, table.first_feature + len(table.features), row))
        index_slots = torch.cat(slots)
        # With FBGEMM's kernels alone (recsdk's leave no tombstone), a removed id keeps its key (probes
        # go on past it) with row -2 in the tables' indexes; here it reads -1, which the kernel skips,
        # so a forward needs no pass over its rows.
        index_slots[:, 1].clamp_(min=-1)
        return (
            index_slots,
            torch.tensor(offsets, dtype=torch.int64),
            torch.tensor(minus_one, dtype=torch.int64).view(-1, 3),
        )

    @torch.jit.unused
    def stage_version(self, version: PublishedVersion) -> "StagedVersion":
        """Prepare a version's part for these tables without changing what a forward reads: the
        first half of :meth:`apply_version`, which may run while forwards do.

        A full version gets new id tables and a new kernel with its rows (the old ones are served
        until :meth:`commit_version`: for a while, the rows are held twice; a collection serving no
        id yet writes into its kernel). A delta drops its deleted
        ids from the id tables and gives its new ids rows there; its rows are written by
        :meth:`commit_version` (some are rows a forward still reads).

        Raises:
            TableFullError: a version holds more ids than a table's ``num_embeddings``.
            ValueError: a delta's rows are of another dtype than those served.
        """
        full = version.kind == "full"
        if not full and version.dtype != self.dtype:
            raise ValueError(
                f"version {version.version} is a delta of {version.dtype} rows on top of {self.dtype} rows; "
                "a publisher's dtype changes only with a full version"
            )
        ids = [table.empty_ids() if full else table.ids for table in self.tables]
        writes: list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]] = []
        for t, (table, table_ids) in enumerate(zip(self.tables, ids, strict=True)):
            published = version.tables[table.name]
            if not full and published.deleted.numel():
                table_ids.remove(published.deleted)
            if published.ids.numel():
                rows = table_ids.find_or_insert(published.ids)
                table_ids.take_reassigned_rows()  # their values are written here
                writes.append((t, rows, published.rows))
        if not full:
            return StagedVersion(version.dtype, None, None, writes, self._index(ids))
        # No forward reads a new kernel's rows yet, nor the rows of one serving no id (a new collection's).
        serving_none = all(len(table) == 0 for table in self.tables)
        kernel = self.tbe if serving_none and version.dtype == self.dtype else self._kernel(version.dtype)
        self._write(kernel, writes)
        return StagedVersion(version.dtype, kernel, ids, [], self._index(ids))

    @torch.jit.unused
    def commit_version(self, staged: "StagedVersion") -> None:
        """Serve a staged version (while no forward runs): swap in its kernel, id tables and index,
        and write a delta's rows."""
        if staged.kernel is not None and staged.ids is not None:
            self.tbe, self.dtype = staged.kernel, staged.dtype
            self.kernel = kernel_view(staged.kernel)
            for table, ids in zip(self.tables, staged.ids, strict=True):
                table.ids = ids
        self._write(self.tbe, staged.writes)
        self.index_slots, self.index_offsets, self.minus_one = staged.index

    @torch.jit.unused
    def apply_version(self, version: PublishedVersion) -> None:
        """Apply a version's part for these tables (:meth:`stage_version`, then
        :meth:`commit_version`): a full one replaces every id and row; a delta drops its deleted
        ids, then writes its ids' rows (new ids get rows).

        Raises:
            TableFullError: a version holds more ids than a table's ``num_embeddings``.
            ValueError: a delta's rows are of another dtype than those served.
        """
        self.commit_version(self.stage_version(version))

    @torch.jit.unused
    def _write(
        self, kernel: IntNBitTableBatchedEmbeddingBagsCodegen, writes: list[tuple[int, torch.Tensor, Any]]
    ) -> None:
        """Copy published rows into ``kernel``'s rows, bytes as published: (table, rows, tensors) each."""
        if not writes:
            return
        split = kernel.split_embedding_weights(split_scale_shifts=True)
        for t, rows, tensors in writes:
            weight, scale_bias = split[t]
            dim = self.tables[t].dim
            values = tensors["rows"]
            if values.dtype == torch.uint8:
                weight[rows, :dim] = values
                halves = scale_bias.view(torch.float16)
                halves[rows, 0] = tensors["scale"]
                halves[rows, 1] = tensors["bias"]
            else:
                weight.view(values.dtype)[rows, :dim] = values

    @torch.jit.unused
    def table_sizes(self) -> dict[str, int]:
        """Ids served per table."""
        return {table.name: len(table) for table in self.tables}


@dataclass
class StagedVersion:
    """A version prepared by :meth:`ServingEmbeddingBagCollection.stage_version` (or the
    unpooled collection's), served once committed.

    Attributes:
        dtype (str): the rows' dtype.
        kernel (IntNBitTableBatchedEmbeddingBagsCodegen | None): a full version's new kernel, its rows written.
        ids (list[IdTable] | None): a full version's new id table per table.
        writes (list): a delta's rows to write: (table, rows ``[n]``, the published tensors).
        index (tuple): the index a forward reads (slots, their offsets, the tables holding -1).
    """

    dtype: str
    kernel: IntNBitTableBatchedEmbeddingBagsCodegen | None
    ids: list[IdTable] | None
    writes: list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]]
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ServingEmbeddingBagCollection(_ServingCollection):
    """The serving stand-in of a :class:`~recsdk.embedding.HashEmbeddingBagCollection`.

    Args:
        module (HashEmbeddingBagCollection): the trained model's module (its configs are used,
            not its rows).
        dtype (str): the rows' dtype as published (``"float32"``, ``"float16"``, ``"uint8"``).

    Example::

        sebc = ServingEmbeddingBagCollection(model.ebc, "float32")
        sebc.apply_version(read_version("publish/", 0))
        pooled = sebc(kjt)  # KeyedTensor, as model.ebc(kjt) in eval
    """

    def __init__(self, module: HashEmbeddingBagCollection, dtype: str) -> None:
        super().__init__(module.embedding_bag_configs(), dtype, pooled=True)
        self._is_weighted = module.is_weighted()
        starts = [0]
        for dim in self.dims:
            starts.append(starts[-1] + dim)
        # (feature, first column, last column) of the MEAN-pooled features
        mean_columns = [
            (f, starts[f], starts[f + 1])
            for table in self.tables
            if table.mean
            for f in range(table.first_feature, table.first_feature + len(table.features))
        ]
        self.mean_columns: torch.Tensor  # a tensor, not a list: TorchScript cannot type an empty list
        columns = torch.tensor(mean_columns, dtype=torch.int64).view(-1, 3)
        self.register_buffer("mean_columns", columns, persistent=False)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool each feature's embeddings.

        Args:
            features (KeyedJaggedTensor): the configured features' raw int64 ids (any key order;
                per-value weights when the module is weighted).

        Returns:
            KeyedTensor: ``[B, sum(dims)]``, keys and order as the hash collection's.
        """
        features, pooled = self._lookup(features)
        if self.mean_columns.shape[0] > 0:
            lengths = features.lengths().view(len(self.features), -1).clamp(min=1).unsqueeze(2).to(pooled.dtype)
            for i in range(self.mean_columns.shape[0]):
                column = self.mean_columns[i]
                f, first, last = int(column[0]), int(column[1]), int(column[2])
                pooled[:, first:last] /= lengths[f]
        return KeyedTensor(keys=self.features, length_per_key=self.dims, values=pooled)


class ServingEmbeddingCollection(_ServingCollection):
    """The serving stand-in of a :class:`~recsdk.embedding.HashEmbeddingCollection`.

    Args:
        module (HashEmbeddingCollection): the trained model's module (its configs are used).
        dtype (str): the rows' dtype as published.
    """

    def __init__(self, module: HashEmbeddingCollection, dtype: str) -> None:
        super().__init__(module.embedding_configs(), dtype, pooled=False)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """One embedding per id.

        Args:
            features (KeyedJaggedTensor): the configured features' raw int64 ids (any key order).

        Returns:
            dict[str, JaggedTensor]: feature -> values ``[num_ids, dim]``, its lengths and offsets.
        """
        features, embeddings = self._lookup(features)
        offset_per_key = features.offset_per_key()
        per_feature = features.to_dict()
        out: dict[str, JaggedTensor] = {}
        for f, feature in enumerate(self.features):
            jt = per_feature[feature]
            values = embeddings[offset_per_key[f] : offset_per_key[f + 1]]
            out[feature] = JaggedTensor(values=values, lengths=jt.lengths(), offsets=jt.offsets())
        return out
