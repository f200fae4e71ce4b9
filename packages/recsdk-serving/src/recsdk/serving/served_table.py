"""``ServedTable``: the ids one published hash table serves, and where their rows are.

The id index is an :class:`~recsdk.embedding.IdTable` (no admission, no eviction), the same kind
the training id tables are: FBGEMM's pruned-hashmap kernels on CPU, collision-free. It hands a
new id a row of the collection's kernel and takes the rows of deleted ids back. The collection
(:mod:`~recsdk.serving.serving_collections`) looks the ids of all its tables up in one call of
``torch.ops.fbgemm.pruned_hashmap_lookup`` over their slots, laid end to end.
"""

from __future__ import annotations

from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, PoolingType

from recsdk.embedding import IdTable

__all__ = ["ServedTable"]


class ServedTable:
    """One table's served ids.

    Args:
        config (BaseEmbeddingConfig): the table's config as for training (its name, dim,
            ``num_embeddings``: the ids it can serve, features, pooling).
        first_feature (int): the position of the table's first feature among the collection's
            features (a table's features are consecutive).

    Attributes:
        ids (IdTable): raw id -> row of the table in the collection's kernel.
    """

    def __init__(self, config: BaseEmbeddingConfig, first_feature: int) -> None:
        self.name = config.name
        self.dim = int(config.embedding_dim)
        self.capacity = int(config.num_embeddings)
        self.features = list(config.feature_names)
        self.first_feature = first_feature
        self.mean = isinstance(config, EmbeddingBagConfig) and config.pooling == PoolingType.MEAN
        self.ids = self.empty_ids()

    def empty_ids(self) -> IdTable:
        """A new id index holding no id, for a full version (:attr:`ids` until it is served)."""
        return IdTable(self.capacity, name=f"{self.name}@serving")

    def __len__(self) -> int:
        return len(self.ids)
