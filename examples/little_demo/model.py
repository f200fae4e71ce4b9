"""Step 4 of the flow: the little demo's model, a small DLRM on raw int64 ids.

The sparse part is a ``HashEmbeddingBagCollection`` (pooled tables keyed by raw ids, each with
its own dimension, pooling, admission and eviction) and, on the synthetic data, a
``HashEmbeddingCollection`` (unpooled: one embedding per id) whose item table serves both the
candidate item and the user's recent items. A target attention (as in DIN) pools the recent
items by how they relate to the candidate. The dense part is a bottom MLP over the dense
features; the over arch is an MLP over the bottom MLP's output, every pooled embedding, the
candidate's embedding and the attention's output. ``forward`` takes the Batch and returns
``(loss, output)``, as the pipeline needs.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from dataset import MAX_HISTORY, Feature
from torch import nn
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor

from recsdk.data import Batch
from recsdk.embedding import (
    CountAdmission,
    HashEmbeddingBagCollection,
    HashEmbeddingBagConfig,
    HashEmbeddingCollection,
    HashEmbeddingConfig,
    LRUEviction,
    ProbabilisticAdmission,
    ScoreAdmission,
    ScoreEviction,
    ShowClickScore,
    TTLEviction,
)

FILE_TABLE_CAPACITY = 1 << 16  # rows per table (all ranks together) for Criteo and Parquet features
FILE_TABLE_DIM = 16
ITEM_DIM = 16
# The item table starts from N(0, 0.1^2) rather than TorchRec's uniform(+-1/sqrt(rows)) (+-0.006
# here): distinct items then have clearly distinct embeddings from the first step, so the
# attention can tell the candidate's own id in the history from other items at once.
ITEM_INIT_STD = 0.1


# How the tables with more ids than rows (``user``; every file feature) admit and evict ids
# (``--id-policy``). ``showclick`` and ``probabilistic`` admit about as early as ``countmin_lru``
# (a second sighting): a click counts as two sightings, or each sighting is a coin flip.
_SHOW_CLICK = ShowClickScore(alpha=1.0, beta=1.0, decay=0.99)
ID_POLICIES: dict[str, dict[str, Any]] = {
    "countmin_lru": {"admission": CountAdmission(threshold=2), "eviction": LRUEviction()},
    "showclick": {
        "admission": ScoreAdmission(threshold=1.9, score=_SHOW_CLICK),
        "eviction": ScoreEviction(evict_fraction=0.01, score=_SHOW_CLICK),
    },
    "probabilistic": {"admission": ProbabilisticAdmission(probability=0.5), "eviction": LRUEviction()},
}
"""``--id-policy`` -> the admission and eviction of the tables with more ids than rows."""


def needs_clicks(id_policy: str) -> bool:
    """Whether the policy's tables score clicks (training batches then carry them: ``Batch.with_clicks``)."""
    score = getattr(ID_POLICIES[id_policy]["admission"], "score", None)
    return score is not None and score.needs_clicks


def random_tables(id_policy: str = "countmin_lru") -> list[HashEmbeddingBagConfig]:
    """The synthetic task's pooled tables (``user`` and ``dataset.CONTEXT_ID_RANGES``).

    ``num_embeddings`` is a table's capacity: how many distinct ids it holds at once.

    Args:
        id_policy (str): a key of :data:`ID_POLICIES`, for the ``user`` table.
    """
    return [
        # 100k user ids, a long tail: by default admit an id on its second sighting, and keep
        # the 8k most recently used ones (LRU eviction when full).
        HashEmbeddingBagConfig(
            name="user",
            feature_names=["user"],
            embedding_dim=16,
            num_embeddings=8_192,
            pooling=PoolingType.SUM,
            **ID_POLICIES[id_policy],
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


def _item_init(weight: torch.Tensor) -> torch.Tensor:
    return nn.init.normal_(weight, std=ITEM_INIT_STD)


def random_sequence_tables(history: bool = True) -> list[HashEmbeddingConfig]:
    """The synthetic task's unpooled table: ``item``, for the candidate and (``history``) the recent items.

    One table for both features: an item has one embedding, whether it is the candidate or in
    a history, so what the model learns of an item from one feature serves the other. 20k item
    ids in 24,576 rows: every item fits, on any number of ranks (row-wise, ids are spread over
    the ranks' shards by hash).
    """
    return [
        HashEmbeddingConfig(
            name="item",
            feature_names=["history", "item"] if history else ["item"],
            embedding_dim=ITEM_DIM,
            num_embeddings=24_576,
            init_fn=_item_init,
        )
    ]


def file_tables(features: list[Feature], id_policy: str = "countmin_lru") -> list[HashEmbeddingBagConfig]:
    """One table per feature of a Criteo or Parquet file, for any vocabulary.

    Multi-hot features are averaged (MEAN), single ids summed (SUM). A full table evicts ids
    (by default its least recently used ones), so vocabularies larger than the capacity fit.

    Args:
        features (list[Feature]): the file's sparse features.
        id_policy (str): a key of :data:`ID_POLICIES`.
    """
    return [
        HashEmbeddingBagConfig(
            name=f"t_{f.name}",
            feature_names=[f.name],
            embedding_dim=FILE_TABLE_DIM,
            num_embeddings=FILE_TABLE_CAPACITY,
            pooling=PoolingType.MEAN if f.multi_hot else PoolingType.SUM,
            **ID_POLICIES[id_policy],
        )
        for f in features
    ]


def mlp(sizes: list[int]) -> nn.Sequential:
    """Linear layers of the given sizes with ReLU between them (none after the last)."""
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(sizes):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class TargetAttention(nn.Module):
    """DIN-style attention: pool a jagged history by its relation to a target embedding.

    A small MLP scores each history embedding ``h`` against the target ``c`` from
    ``[h, c, h * c]``; a softmax over each sample's own history (the padding masked out) turns
    the scores into weights, and the output is the weighted sum of the history. An empty
    history pools to zero.

    Args:
        dim (int): embedding dimension ``d`` of the history and the target.
        max_len (int): the longest history ``T``.
        hidden (int): hidden units of the scoring MLP.

    Shapes: ``history`` a ``JaggedTensor`` of ``B`` samples with values ``[N, d]``, ``target``
    ``[B, d]``; the output is ``[B, d]``.
    """

    def __init__(self, dim: int, max_len: int, hidden: int = 32) -> None:
        super().__init__()
        self.max_len = max_len
        self.score = mlp([3 * dim, hidden, 1])

    def forward(self, history: JaggedTensor, target: torch.Tensor) -> torch.Tensor:
        h = history.to_padded_dense(desired_length=self.max_len)  # [B, T, d], zeros past each length
        c = target.unsqueeze(1).expand_as(h)
        scores = self.score(torch.cat([h, c, h * c], dim=-1)).squeeze(-1)  # [B, T]
        mask = torch.arange(self.max_len, device=h.device).unsqueeze(0) < history.lengths().unsqueeze(1)
        # Padding gets -1e9, so no weight; the mask then zeroes the weights of empty histories.
        weights = torch.softmax(scores.masked_fill(~mask, -1e9), dim=1) * mask
        return (weights.unsqueeze(-1) * h).sum(dim=1)


class DLRM(nn.Module):
    """Bottom MLP + ``HashEmbeddingBagCollection`` (+ ``HashEmbeddingCollection``) + over arch; BCE.

    With ``sequence_tables`` (the synthetic data), the batch is a ``dataset.HistoryBatch``: its
    ``sparse_features`` go to the bag collection ``ebc``, its ``sequence_features`` to the
    unpooled collection ``ec``, each collection getting exactly its own features. The candidate's
    embedding (feature ``item``) goes to the over arch; where the tables have a ``history``
    feature, the target attention pools the history against the candidate, and the over arch
    also gets that interest vector and its elementwise product with the candidate.

    Args:
        tables (list[HashEmbeddingBagConfig]): the pooled tables.
        num_dense (int): dense features per sample ``D``.
        device (torch.device): where the embedding tables live; ``meta`` lets
            ``DistributedModelParallel`` allocate only each rank's shards.
        sequence_tables (list[HashEmbeddingConfig] | None): the unpooled tables (an ``item``
            feature, and optionally ``history`` on the same table), or ``None`` for none.
        dense_sizes (list[int]): hidden and output sizes of the bottom MLP.
        over_sizes (list[int]): hidden sizes of the over arch (a logit comes last).

    Example::

        model = DLRM(random_tables(), num_dense=13, device=torch.device("meta"),
                     sequence_tables=random_sequence_tables())
        loss, (loss_detached, probs, labels) = model(batch)  # probs, labels: [B]
    """

    def __init__(
        self,
        tables: list[HashEmbeddingBagConfig],
        num_dense: int,
        device: torch.device,
        sequence_tables: list[HashEmbeddingConfig] | None = None,
        dense_sizes: tuple[int, ...] = (64, 16),
        over_sizes: tuple[int, ...] = (64, 32),
    ) -> None:
        super().__init__()
        self.dense_arch = nn.Sequential(mlp([num_dense, *dense_sizes]), nn.ReLU())
        self.ebc = HashEmbeddingBagCollection(tables=tables, device=device)
        self.features = [(f, t.embedding_dim) for t in tables for f in t.feature_names]
        over_in = dense_sizes[-1] + sum(dim for _, dim in self.features)
        self.ec: HashEmbeddingCollection | None = None
        self.attention: TargetAttention | None = None
        if sequence_tables:
            self.ec = HashEmbeddingCollection(tables=sequence_tables, device=device)
            seq_features = {f for t in sequence_tables for f in t.feature_names}
            if "item" not in seq_features:
                raise ValueError(f"sequence_tables need an 'item' feature (the candidate), got {sorted(seq_features)}")
            dim = sequence_tables[0].embedding_dim
            over_in += dim
            if "history" in seq_features:
                self.attention = TargetAttention(dim, MAX_HISTORY)
                over_in += 2 * dim
        self.over_arch = mlp([over_in, *over_sizes, 1])

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Loss and ``(loss, click probabilities [B], labels [B])``, all detached but the loss."""
        # Pooled embeddings by feature name: a sharded collection may order its keys differently.
        pooled = self.ebc(batch.sparse_features).to_dict()
        dense = self.dense_arch(batch.dense_features)
        parts = [dense, *(pooled[name] for name, _ in self.features)]
        if self.ec is not None:
            # Each collection reads its own field of the batch, so the pipeline host-stages both.
            sequences = self.ec(batch.sequence_features)  # type: ignore[attr-defined]
            candidate = sequences["item"].values()  # [B, d]: one candidate per sample
            parts.append(candidate)
            if self.attention is not None:
                interest = self.attention(sequences["history"], candidate)
                parts += [interest, interest * candidate]
        logits = self.over_arch(torch.cat(parts, dim=1)).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), torch.sigmoid(logits.detach()), batch.labels)
