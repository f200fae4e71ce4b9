# mypy: disable-error-code="union-attr"
# (self.tables is a ModuleList; mypy reads it through Module.__getattr__. TorchScript parses
# "# type:" comments in forward, so the exception is made for the file.)
"""Read-only serving collections with the forward of recsdk's hash collections.

:class:`ServingEmbeddingBagCollection` stands in for a
:class:`~recsdk.embedding.HashEmbeddingBagCollection` (a KJT of raw ids to a ``KeyedTensor``,
the same keys, order and dims), :class:`ServingEmbeddingCollection` for a
:class:`~recsdk.embedding.HashEmbeddingCollection` (to ``dict[str, JaggedTensor]``). Each holds a
:class:`~recsdk.serving.served_table.ServedTable` per table; an id a table does not hold looks up
zeros, as the trained model's eval does. Both work under ``torch.jit.script`` (a script is a
snapshot: it keeps the index and rows it was made with; script again after applying versions).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingCollection, PublishedVersion
from recsdk.serving.served_table import ServedTable

__all__ = ["ServingEmbeddingBagCollection", "ServingEmbeddingCollection"]


class _ServingCollection(nn.Module):
    """What both collections share: their tables, and applying a version to them."""

    def __init__(self, configs: list[Any], dtype: str, pooled: bool) -> None:
        super().__init__()
        self.configs = list(configs)
        self.pooled = pooled
        self.dtype = dtype
        self.tables: nn.ModuleList = nn.ModuleList([ServedTable(cfg, dtype, pooled) for cfg in configs])

    @torch.jit.unused
    def apply_version(self, version: PublishedVersion) -> None:
        """Apply a version's part for these tables (a full version in another dtype rebuilds them)."""
        full = version.kind == "full"
        if full and version.dtype != self.dtype:
            self.dtype = version.dtype
            self.tables = nn.ModuleList([ServedTable(cfg, self.dtype, self.pooled) for cfg in self.configs])
        for table in self.tables:
            assert isinstance(table, ServedTable)
            table.apply_version(version.tables[table.name], full)

    @torch.jit.unused
    def table_sizes(self) -> dict[str, int]:
        """Ids served per table."""
        return {table.name: len(table) for table in self.tables if isinstance(table, ServedTable)}


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
        self._embedding_names = [f for cfg in self.configs for f in cfg.feature_names]
        self._lengths_per_embedding = [int(cfg.embedding_dim) for cfg in self.configs for _ in cfg.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool each feature's embeddings.

        Args:
            features (KeyedJaggedTensor): the configured features' raw int64 ids (per-value
                weights when the module is weighted).

        Returns:
            KeyedTensor: ``[B, sum(dims)]``, keys and order as the hash collection's.
        """
        per_feature = features.to_dict()
        pooled: list[torch.Tensor] = []
        for table in self.tables:
            for feature in table.features:
                jt = per_feature[feature]
                weights = jt.weights_or_none() if self._is_weighted else None
                pooled.append(table(jt.values(), jt.offsets(), jt.lengths(), weights))
        return KeyedTensor(
            keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=torch.cat(pooled, dim=1)
        )


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
            features (KeyedJaggedTensor): the configured features' raw int64 ids.

        Returns:
            dict[str, JaggedTensor]: feature -> values ``[num_ids, dim]``, its lengths and offsets.
        """
        per_feature = features.to_dict()
        out: dict[str, JaggedTensor] = {}
        for table in self.tables:
            for feature in table.features:
                jt = per_feature[feature]
                values = table(jt.values(), jt.offsets(), jt.lengths(), None)
                out[feature] = JaggedTensor(values=values, lengths=jt.lengths(), offsets=jt.offsets())
        return out
