"""Step 4 of the flow: the little demo's model, a small DLRM on raw int64 ids.

The sparse part is a ``HashEmbeddingBagCollection`` (tables keyed by raw ids, each with its
own dimension, pooling, admission and eviction); the dense part is a bottom MLP over the
dense features; the over arch is an MLP over the bottom MLP's output and every pooled
embedding. ``forward`` takes the Batch and returns ``(loss, output)``, as the pipeline needs.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from dataset import Feature
from torch import nn
from torchrec.modules.embedding_configs import PoolingType

from recsdk.data import Batch
from recsdk.embedding import (
    CountAdmission,
    HashEmbeddingBagCollection,
    HashEmbeddingBagConfig,
    LRUEviction,
    TTLEviction,
)

FILE_TABLE_CAPACITY = 1 << 16  # rows per table (all ranks together) for Criteo and Parquet features
FILE_TABLE_DIM = 16


def random_tables() -> list[HashEmbeddingBagConfig]:
    """The synthetic task's tables (features of ``dataset.RANDOM_ID_RANGES``).

    ``num_embeddings`` is a table's capacity: how many distinct ids it holds at once.
    """
    return [
        # 100k user ids, a long tail: admit an id on its second sighting, and keep the
        # 8k most recently used ones (LRU eviction when full).
        HashEmbeddingBagConfig(
            name="user",
            feature_names=["user"],
            embedding_dim=16,
            num_embeddings=8_192,
            pooling=PoolingType.SUM,
            admission=CountAdmission(threshold=2),
            eviction=LRUEviction(),
        ),
        HashEmbeddingBagConfig(
            name="item", feature_names=["item"], embedding_dim=12, num_embeddings=20_000, pooling=PoolingType.SUM
        ),
        HashEmbeddingBagConfig(
            name="category", feature_names=["category"], embedding_dim=4, num_embeddings=512, pooling=PoolingType.SUM
        ),
        # Several tags per sample, averaged; a tag unused for 50 steps gives its row back.
        HashEmbeddingBagConfig(
            name="tags",
            feature_names=["tags"],
            embedding_dim=8,
            num_embeddings=2_048,
            pooling=PoolingType.MEAN,
            eviction=TTLEviction(max_idle_steps=50),
        ),
    ]


def file_tables(features: list[Feature]) -> list[HashEmbeddingBagConfig]:
    """One table per feature of a Criteo or Parquet file, for any vocabulary.

    Multi-hot features are averaged (MEAN), single ids summed (SUM). A full table evicts its
    least recently used ids, so vocabularies larger than the capacity fit.
    """
    return [
        HashEmbeddingBagConfig(
            name=f"t_{f.name}",
            feature_names=[f.name],
            embedding_dim=FILE_TABLE_DIM,
            num_embeddings=FILE_TABLE_CAPACITY,
            pooling=PoolingType.MEAN if f.multi_hot else PoolingType.SUM,
            admission=CountAdmission(threshold=2),
            eviction=LRUEviction(),
        )
        for f in features
    ]


def mlp(sizes: list[int]) -> nn.Sequential:
    """Linear layers of the given sizes with ReLU between them (none after the last)."""
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(sizes):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Module):
    """Bottom MLP + ``HashEmbeddingBagCollection`` + over arch; binary cross-entropy.

    Args:
        tables (list[HashEmbeddingBagConfig]): the sparse tables.
        num_dense (int): dense features per sample ``D``.
        device (torch.device): where the embedding tables live; ``meta`` lets
            ``DistributedModelParallel`` allocate only each rank's shards.
        dense_sizes (list[int]): hidden and output sizes of the bottom MLP.
        over_sizes (list[int]): hidden sizes of the over arch (a logit comes last).

    Example::

        model = DLRM(random_tables(), num_dense=13, device=torch.device("meta"))
        loss, (loss_detached, probs, labels) = model(batch)  # probs, labels: [B]
    """

    def __init__(
        self,
        tables: list[HashEmbeddingBagConfig],
        num_dense: int,
        device: torch.device,
        dense_sizes: tuple[int, ...] = (64, 16),
        over_sizes: tuple[int, ...] = (64, 32),
    ) -> None:
        super().__init__()
        self.dense_arch = nn.Sequential(mlp([num_dense, *dense_sizes]), nn.ReLU())
        self.ebc = HashEmbeddingBagCollection(tables=tables, device=device)
        self.features = [(f, t.embedding_dim) for t in tables for f in t.feature_names]
        over_in = dense_sizes[-1] + sum(dim for _, dim in self.features)
        self.over_arch = mlp([over_in, *over_sizes, 1])

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Loss and ``(loss, click probabilities [B], labels [B])``, all detached but the loss."""
        # Pooled embeddings by feature name: a sharded collection may order its keys differently.
        pooled = self.ebc(batch.sparse_features).to_dict()
        dense = self.dense_arch(batch.dense_features)
        x = torch.cat([dense, *(pooled[name] for name, _ in self.features)], dim=1)
        logits = self.over_arch(x).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), torch.sigmoid(logits.detach()), batch.labels)
