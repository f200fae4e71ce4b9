"""``ServedTable``: one published hash table as served: raw id -> row -> FBGEMM's inference lookup.

Two parts, each reused rather than written:

* **the id index** is an :class:`~recsdk.embedding.IdTable` (no admission, no eviction), the same
  kind the training id tables are: FBGEMM's pruned-hashmap kernels on CPU, collision-free. It hands
  a new id a row and takes the rows of deleted ids back. Its slots are also registered as buffers
  (``index_slots``, ``index_offsets``, ``minus_one_row``), so that :meth:`ServedTable.forward`
  calls ``torch.ops.fbgemm.pruned_hashmap_lookup`` itself and works under ``torch.jit.script``;
* **the rows** live in FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen`` (the kernel TorchRec's
  quantized inference modules run), in the dtype they were published in (fp32, fp16, or int8
  with a float16 scale and bias per row: the publication's bytes, copied in as they are). Ids
  without a row look up as ``-1``, which the kernel skips: zeros, as the trained model's eval gives.

Pooled tables sum in the kernel; MEAN divides by the bag's length as given (ids without a row
counted), as :class:`~recsdk.embedding.HashEmbeddingBagCollection` does.
"""

from __future__ import annotations

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, PoolingType

from recsdk.embedding import IdTable, PublishedTable

__all__ = ["SPARSE_TYPES", "ServedTable"]

SPARSE_TYPES = {"float32": SparseType.FP32, "float16": SparseType.FP16, "uint8": SparseType.INT8}
"""FBGEMM's row type for each dtype a publication's rows come in."""


class ServedTable(nn.Module):
    """One table's served ids and rows (see the module docstring).

    Args:
        config (BaseEmbeddingConfig): the table's config as for training (its name, dim,
            ``num_embeddings``: the rows the served table holds, features, pooling).
        dtype (str): the rows' dtype as published: ``"float32"``, ``"float16"`` or ``"uint8"``.
        pooled (bool): a bag table (one pooled row per bag) or an unpooled one (a row per id).
    """

    def __init__(self, config: BaseEmbeddingConfig, dtype: str, pooled: bool) -> None:
        super().__init__()
        if dtype not in SPARSE_TYPES:
            raise ValueError(f"table {config.name!r}: rows of dtype {dtype!r}; served are {sorted(SPARSE_TYPES)}")
        self.name = config.name
        self.dim = int(config.embedding_dim)
        self.capacity = int(config.num_embeddings)
        self.dtype = dtype
        self.features = list(config.feature_names)
        self.mean = pooled and isinstance(config, EmbeddingBagConfig) and config.pooling == PoolingType.MEAN
        self.tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            [(self.name, self.capacity, self.dim, SPARSE_TYPES[dtype], EmbeddingLocation.HOST)],
            device="cpu",
            pooling_mode=PoolingMode.SUM if pooled else PoolingMode.NONE,
            output_dtype=SparseType.FP32,
        )
        self.tbe.initialize_weights()
        self.ids = IdTable(self.capacity, name=f"{self.name}@serving")
        self.index_slots: torch.Tensor
        self.index_offsets: torch.Tensor
        self.minus_one_row: torch.Tensor
        self.register_buffer("index_slots", torch.zeros(0, 2, dtype=torch.int64), persistent=False)
        self.register_buffer("index_offsets", torch.zeros(2, dtype=torch.int64), persistent=False)
        self.register_buffer("minus_one_row", torch.full((1,), -1, dtype=torch.int64), persistent=False)
        self._sync_index()

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """Embeddings of one feature's ids: pooled ``[B, dim]`` (``offsets`` ``[B + 1]`` delimit the
        bags), or one row per id ``[n, dim]``; ids without a row give zeros."""
        ids = ids.long()
        bounds = torch.tensor([0, ids.numel()], dtype=torch.int64)
        rows = torch.ops.fbgemm.pruned_hashmap_lookup(ids, bounds, self.index_slots, self.index_offsets)
        rows = rows.clamp(min=-1)  # a removed id's slot reads -2
        rows = torch.where(ids == -1, self.minus_one_row.expand_as(rows), rows)
        out = self.tbe(rows, offsets.long(), weights)
        if self.mean:
            out = out / lengths.clamp(min=1).unsqueeze(1).to(out.dtype)
        return out

    @torch.jit.unused
    def apply_version(self, table: PublishedTable, full: bool) -> None:
        """Apply a version's part for this table: a full one replaces every id; a delta drops its
        deleted ids, then writes its ids' rows (new ids get rows).

        Raises:
            TableFullError: the version holds more ids than ``num_embeddings`` rows.
        """
        if full:
            self.ids = IdTable(self.capacity, name=f"{self.name}@serving")
        elif table.deleted.numel():
            self.ids.remove(table.deleted)
        if table.ids.numel():
            rows = self.ids.find_or_insert(table.ids)
            self._write_rows(rows, table.rows)
            self.ids.take_reassigned_rows()  # the rows are written here, not re-initialised
        self._sync_index()

    @torch.jit.unused
    def __len__(self) -> int:
        return len(self.ids)

    def _write_rows(self, rows: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        weight, scale_bias = self.tbe.split_embedding_weights(split_scale_shifts=True)[0]
        values = tensors["rows"]
        if self.dtype == "uint8":
            weight[rows, : self.dim] = values
            halves = scale_bias.view(torch.float16)
            halves[rows, 0] = tensors["scale"]
            halves[rows, 1] = tensors["bias"]
        else:
            weight.view(values.dtype)[rows, : self.dim] = values

    def _sync_index(self) -> None:
        slots, offsets, minus_one = self.ids.index_state()
        self.index_slots = slots
        self.index_offsets = offsets
        self.minus_one_row.fill_(minus_one)
