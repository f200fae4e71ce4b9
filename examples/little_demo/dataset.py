"""Steps 1 and 2 of the flow: the Batch and the datasets of the little demo.

Step 1 (the Batch) is ``recsdk.data.Batch``: a dataclass of dense features ``[B, D]``, a
``KeyedJaggedTensor`` of raw int64 ids and labels ``[B]``, implementing TorchRec's
``Pipelineable`` (``to()``, ``pin_memory()``, ``record_stream()``), which is what the
pipeline moves between host and device. The synthetic data adds a second KJT:
``HistoryBatch.sequence_features`` (the candidate item and the user's recent items, for the
unpooled collection), so that each sharded collection reads its own field of the batch.

Step 2 (the dataset) is an ``IterableDataset`` of batches:

* ``random``: ``HistoryRecDataset`` (below), synthetic clicks on a candidate item, given the
  user, the user's recent items (the history), two context features and dense features; built
  around ``RandomRecDataset`` (which draws the context). A held-out set is drawn with another
  sample seed, from the same hidden teacher.
* ``criteo``: ``CriteoDataset`` over Criteo TSV files (plain or ``.gz``): 13 dense features,
  26 categorical features ``cat_0`` .. ``cat_25``.
* ``columnar``: ``ColumnarDataset`` over a folder converted by ``python -m recsdk.data.convert
  criteo IN... OUT`` (memory-mapped Arrow files; the same batches as ``criteo`` over the inputs).
* ``parquet``: ``ParquetRecDataset``: a ``label`` column, float columns as dense features,
  integer, string and list columns as sparse features (a list column is multi-hot).

For the file formats, the first ``eval_batches`` batches of each rank's stream are held out
for evaluation and training cycles over the rest, epoch after epoch, in file order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import (
    CRITEO_DENSE_COLUMNS,
    CRITEO_SPARSE_FEATURES,
    Batch,
    ColumnarDataset,
    CriteoDataset,
    ParquetRecDataset,
    RandomRecDataset,
    ReadPosition,
    mix64,
    power_law_indices,  # RandomRecDataset's Zipf-like draw
)

DATA_KINDS = ("random", "criteo", "columnar", "parquet")

# The synthetic task (--data random). Pooled features, one table each: the user (one id per
# sample) and two context features drawn by RandomRecDataset (mean ids per sample).
NUM_USERS = 100_000
CONTEXT_ID_RANGES = {"category": 500, "tags": 2_000}
CONTEXT_POOLING = {"category": 1.0, "tags": 3.0}
RANDOM_NUM_DENSE = 13
# Sequence features, one shared item table: the candidate item (one id per sample) and the
# user's recent items (0 to MAX_HISTORY ids). Items fall into NUM_CLUSTERS latent clusters.
NUM_ITEMS = 20_000
NUM_CLUSTERS = 20
MAX_HISTORY = 20
PARQUET_LABEL = "label"
_CRITEO_SUFFIXES = (".tsv", ".txt", ".gz", ".csv")


# The hidden teacher of the synthetic task: the click logit is the sum of
#   CONTEXT_LOGIT_SCALE x RandomRecDataset's logit (dense features, category and tags ids),
#   a weight per user and a weight per candidate item (normal, these standard deviations),
#   REVISIT_LOGIT_WEIGHT if the candidate is one of the user's recent items,
#   CLUSTER_LOGIT_WEIGHT x the share of the user's recent items in the candidate's cluster (0
#   for an empty history), and LOGIT_OFFSET.
CONTEXT_LOGIT_SCALE = 0.7
USER_LOGIT_STD = 0.5
ITEM_LOGIT_STD = 0.5
REVISIT_LOGIT_WEIGHT = 2.5
CLUSTER_LOGIT_WEIGHT = 2.0
LOGIT_OFFSET = -0.8
# Where an item comes from: the user's first cluster, the user's second cluster, any cluster.
HISTORY_SOURCES = (0.6, 0.25, 0.15)
CANDIDATE_SOURCES = (0.25, 0.15, 0.6)
REVISIT_RATE = 0.3  # a candidate that is one of the user's recent items instead
ZIPF_ALPHA = 1.05
# SeedSequence tags: the teacher and the samples of HistoryRecDataset, apart from RandomRecDataset's.
_TAG_TEACHER, _TAG_SAMPLES = 0x7EAC, 0x5EC5


@dataclass(frozen=True)
class Feature:
    """A sparse feature: its KJT key, and whether a sample may hold several ids."""

    name: str
    multi_hot: bool


@dataclass
class HistoryBatch(Batch):
    """A ``recsdk.data.Batch`` with a second KJT, for the unpooled (sequence) embeddings.

    ``sparse_features`` goes to the ``HashEmbeddingBagCollection`` and ``sequence_features`` to
    the ``HashEmbeddingCollection``: each sharded collection takes exactly its own features, and
    each reads a field of the batch, which is what lets TorchRec's pipeline run the input dist of
    both ahead (a KJT computed inside the model's forward would not be pipelined).

    Args:
        sequence_features (KeyedJaggedTensor): int64 raw ids, stride ``B``: ``item`` (one id per
            sample, the candidate) and, with the history, ``history`` (0 to 20 ids per sample).
        (other fields): as ``recsdk.data.Batch``.
    """

    sequence_features: KeyedJaggedTensor

    def __post_init__(self) -> None:
        super().__post_init__()
        seq = self.sequence_features
        if not isinstance(seq, KeyedJaggedTensor):
            raise TypeError(f"HistoryBatch.sequence_features must be a KeyedJaggedTensor, got {type(seq).__name__}")
        if seq.values().dtype != torch.int64:
            raise ValueError(f"HistoryBatch.sequence_features values must be int64 raw ids, got {seq.values().dtype}")
        if seq.stride() != self.batch_size:
            raise ValueError(f"HistoryBatch.sequence_features has stride {seq.stride()}, batch size {self.batch_size}")

    def _map(self, fn: Any) -> HistoryBatch:
        return HistoryBatch(
            fn(self.dense_features), fn(self.sparse_features), fn(self.labels), fn(self.sequence_features)
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> HistoryBatch:
        """A copy on ``device`` (both KJTs too)."""
        return self._map(lambda t: t.to(device=device, non_blocking=non_blocking))

    def pin_memory(self) -> HistoryBatch:
        """A copy in pinned memory, or ``self`` where nothing can be pinned (see ``Batch.pin_memory``)."""
        if super().pin_memory() is self:
            return self
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: Any) -> None:
        """Mark every tensor, both KJTs included, as used by ``stream``."""
        super().record_stream(stream)
        if stream is not None and self.dense_features.device.type != "cpu":
            self.sequence_features.record_stream(stream)


class HistoryRecDataset(IterableDataset[HistoryBatch]):
    """Synthetic clicks on a candidate item given the user's recent items, over raw int64 ids.

    **Samples.** Each sample has a user (one of ``NUM_USERS``, Zipf), a candidate item and a
    history of 0 to ``MAX_HISTORY`` recent items (uniform length), beside the context of a
    ``RandomRecDataset`` sample: 13 dense features and the ``category`` and ``tags`` bags. Items
    fall into ``NUM_CLUSTERS`` latent clusters (item ``i`` is in cluster ``i % NUM_CLUSTERS``,
    Zipf within its cluster); every user has two favourite clusters. A history item comes from
    the user's first cluster, second cluster or any cluster with the probabilities
    ``HISTORY_SOURCES``, the candidate with ``CANDIDATE_SOURCES``, except that a share
    ``REVISIT_RATE`` of the candidates is one of the user's recent items. All ids are raw:
    ``mix64`` of the index plus a salt, spread over the whole int64 range.

    **Labels.** A hidden teacher, fixed by ``seed`` (see the constants above): the click logit
    is the context's logit (scaled), plus a weight per user and per candidate, plus
    ``REVISIT_LOGIT_WEIGHT`` if the candidate is in the history, plus ``CLUSTER_LOGIT_WEIGHT``
    times the share of the history in the candidate's cluster. Neither the clusters nor the
    revisits are shown: a model finds them by comparing the candidate's embedding with the
    history's, which share the item table.

    **Splitting.** Batch ``b`` of rank ``r`` is a pure function of ``(seed, sample_seed, r, b)``,
    different on every rank; DataLoader workers of a rank take its batches round-robin.

    Args:
        batch_size (int): samples per batch ``B``.
        num_batches (int): batches per rank.
        history (bool): put the ``history`` feature into ``sequence_features``; without it the
            samples and labels are the same, the model just does not see the history.
        seed (int): seed of the ids and the teacher.
        sample_seed (int | None): seed of the samples (``None``: ``seed``); another one gives a
            held-out set from the same teacher.
        rank (int): this rank.
        world_size (int): the number of ranks.

    Example::

        ds = HistoryRecDataset(256, 100, rank=0, world_size=1)
        batch, probabilities = ds.make_batch(0, rank=0)  # probabilities: the teacher's, [256]
    """

    def __init__(
        self,
        batch_size: int,
        num_batches: int,
        *,
        history: bool = True,
        seed: int = 0,
        sample_seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__()
        self.context = RandomRecDataset(
            batch_size,
            num_batches,
            list(CONTEXT_ID_RANGES),
            list(CONTEXT_ID_RANGES.values()),
            num_dense_features=RANDOM_NUM_DENSE,
            pooling_factors=list(CONTEXT_POOLING.values()),
            seed=seed,
            sample_seed=sample_seed,
            rank=rank,
            world_size=world_size,
        )
        self.batch_size, self.num_batches, self.history, self.rank = batch_size, num_batches, history, rank
        self.world_size = world_size
        self.sample_seed = seed if sample_seed is None else sample_seed
        teacher = np.random.default_rng([seed, _TAG_TEACHER])
        self._user_salt, self._item_salt = teacher.integers(0, 2**64, size=2, dtype=np.uint64)
        self._user_weights = teacher.normal(0.0, USER_LOGIT_STD, NUM_USERS)
        self._item_weights = teacher.normal(0.0, ITEM_LOGIT_STD, NUM_ITEMS)
        first = teacher.integers(0, NUM_CLUSTERS, NUM_USERS)
        second = (first + teacher.integers(1, NUM_CLUSTERS, NUM_USERS)) % NUM_CLUSTERS
        self._user_clusters = np.stack([first, second, first], axis=1)  # column 2: "any", drawn per item
        self._position = ReadPosition("HistoryRecDataset", self._position_identity)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[HistoryBatch]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        skip = self._position.start()  # batches a loaded state already yielded: not generated again
        for b in range(worker + skip * num_workers, self.num_batches, num_workers):
            batch = self.make_batch(b, rank=self.rank)[0]
            self._position.advance()
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The data position (torchdata's ``StatefulDataLoader`` convention): batches yielded."""
        return self._position.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the batches ``state`` had yielded (a state of another dataset, or of
        another rank or worker of the same world size, raises ``ValueError`` naming each
        difference). A state of another world size continues every new rank at the same batch
        index, as ``RandomRecDataset`` does (an elastic resume)."""
        elastic = isinstance(state, dict) and state.get("world_size", self.world_size) != self.world_size
        self._position.load_state_dict(state, ignore=("rank", "world_size") if elastic else ())

    def _position_identity(self) -> dict[str, Any]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        return {
            "num_batches": self.num_batches,
            "batch_size": self.batch_size,
            "history": self.history,
            "seed": self.context.seed,
            "sample_seed": self.sample_seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "worker": worker,
            "num_workers": num_workers,
        }

    def _items(self, rng: np.random.Generator, users: npt.NDArray[np.int64], sources: tuple[float, ...]) -> Any:
        """One item index per entry of ``users``, from the user's clusters or any, per ``sources``."""
        n = users.size
        source = rng.choice(len(sources), size=n, p=sources)
        cluster = np.where(source == 2, rng.integers(0, NUM_CLUSTERS, n), self._user_clusters[users, source])
        return power_law_indices(rng, n, NUM_ITEMS // NUM_CLUSTERS, ZIPF_ALPHA) * NUM_CLUSTERS + cluster

    def make_batch(self, batch_index: int, rank: int) -> tuple[HistoryBatch, torch.Tensor]:
        """Batch ``batch_index`` of ``rank`` and the teacher's click probabilities ``[B]`` (float64)."""
        context = self.context.make_batch(batch_index, rank=rank)
        p = self.context.probabilities(context).numpy()
        rng = np.random.default_rng([self.sample_seed, _TAG_SAMPLES, rank, batch_index])
        b = self.batch_size
        users = power_law_indices(rng, b, NUM_USERS, ZIPF_ALPHA)
        lengths = rng.integers(0, MAX_HISTORY + 1, b)
        history = self._items(rng, np.repeat(users, lengths), HISTORY_SOURCES)
        candidates = self._items(rng, users, CANDIDATE_SOURCES)
        # A revisit: the candidate is one of the user's recent items (never for an empty history).
        revisit = (rng.random(b) < REVISIT_RATE) & (lengths > 0)
        if revisit.any():
            starts = np.cumsum(lengths) - lengths
            picked = starts[revisit] + (rng.random(int(revisit.sum())) * lengths[revisit]).astype(np.int64)
            candidates[revisit] = history[picked]
        # What the teacher reads of the history: is the candidate in it, and which share of it is
        # in the candidate's cluster (0 for an empty history).
        sample = np.repeat(np.arange(b), lengths)
        same_item = history == candidates[sample]
        same_cluster = history % NUM_CLUSTERS == candidates[sample] % NUM_CLUSTERS
        seen = np.bincount(sample, weights=same_item, minlength=b) > 0
        share = np.bincount(sample, weights=same_cluster, minlength=b) / np.maximum(lengths, 1)
        logits = (
            CONTEXT_LOGIT_SCALE * (np.log(p) - np.log1p(-p))
            + self._user_weights[users]
            + self._item_weights[candidates]
            + CLUSTER_LOGIT_WEIGHT * share
            + REVISIT_LOGIT_WEIGHT * seen
            + LOGIT_OFFSET
        )
        probs = 1.0 / (1.0 + np.exp(-logits))
        labels = (rng.random(b) < probs).astype(np.float32)

        def ids(indices: npt.NDArray[np.int64], salt: np.uint64) -> torch.Tensor:
            with np.errstate(over="ignore"):
                return torch.from_numpy(mix64(indices.view(np.uint64) + salt))

        one = torch.ones(b, dtype=torch.int32)
        ctx = context.sparse_features
        sparse = KeyedJaggedTensor(
            keys=["user", *ctx.keys()],
            values=torch.cat([ids(users, self._user_salt), ctx.values()]),
            lengths=torch.cat([one, ctx.lengths()]),
            stride=b,
        )
        history_ids, candidate_ids = ids(history, self._item_salt), ids(candidates, self._item_salt)
        if self.history:
            sequence = KeyedJaggedTensor(
                keys=["history", "item"],
                values=torch.cat([history_ids, candidate_ids]),
                lengths=torch.cat([torch.from_numpy(lengths.astype(np.int32)), one]),
                stride=b,
            )
        else:
            sequence = KeyedJaggedTensor(keys=["item"], values=candidate_ids, lengths=one, stride=b)
        batch = HistoryBatch(context.dense_features, sparse, torch.from_numpy(labels), sequence)
        return batch, torch.from_numpy(probs)


@dataclass
class DemoData:
    """What the demo trains on: the features, the dense width, the batches.

    ``held_out_probabilities`` are the true click probabilities of the held-out batches where
    they are known (the synthetic data), for the best AUC any model could reach on them.
    """

    features: list[Feature]
    num_dense: int
    train: StatefulDataLoader | TrainBatches
    held_out: list[Batch]
    held_out_probabilities: list[torch.Tensor] | None = None


def data_files(kind: str, path: str | None) -> list[Path]:
    """The files of ``--data-path`` (a file, or a folder of them), checked before training starts.

    Raises:
        ValueError: a message of one line naming the flag, the value and what is allowed.
    """
    if kind not in DATA_KINDS:
        raise ValueError(f"--data must be one of {', '.join(DATA_KINDS)}, got {kind!r}")
    if kind == "random":
        if path is not None:
            raise ValueError("--data-path is only read with --data criteo, columnar or parquet")
        return []
    if path is None:
        what = "a converted dataset folder" if kind == "columnar" else "a file or a folder of files"
        raise ValueError(f"--data {kind} needs --data-path ({what})")
    root = Path(path)
    if kind == "columnar":
        try:
            ColumnarDataset(root, 1)  # checks the manifest and every part file
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"--data-path {path}: {e}") from None
        return [root]
    if root.is_dir():
        suffixes = _CRITEO_SUFFIXES if kind == "criteo" else (".parquet",)
        files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in suffixes)
        if not files:
            raise ValueError(f"--data-path {path}: no {kind} files ({', '.join(suffixes)}) in this folder")
        return files
    if not root.is_file():
        raise ValueError(f"--data-path {path}: no such file or folder")
    return [root]


def parquet_features(files: list[Path]) -> tuple[list[Feature], list[str]]:
    """Sparse features and dense columns of Parquet files, from the first file's schema.

    Raises:
        ValueError: not a Parquet file, no ``label`` column, or no sparse column.
    """
    try:
        schema = pq.read_schema(files[0])
    except pa.ArrowException as e:
        raise ValueError(f"--data-path {files[0]}: not a Parquet file ({e})") from None
    if PARQUET_LABEL not in schema.names:
        raise ValueError(f"--data-path {files[0]}: no {PARQUET_LABEL!r} column (columns: {', '.join(schema.names)})")
    features, dense = [], []
    for field in schema:
        if field.name == PARQUET_LABEL:
            continue
        if pa.types.is_floating(field.type):
            dense.append(field.name)
        elif pa.types.is_integer(field.type) or pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
            features.append(Feature(field.name, multi_hot=False))
        elif pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
            features.append(Feature(field.name, multi_hot=True))
    if not features:
        raise ValueError(f"--data-path {files[0]}: no integer, string or list column to use as a sparse feature")
    return features, dense


class TrainBatches:
    """A file stream's training batches: each epoch's batches after the first ``skip`` (held out),
    epoch after epoch, through a ``StatefulDataLoader``; with a data position.

    ``state_dict()`` is the epoch and the loader's position in it (after the last batch yielded);
    ``load_state_dict(state)`` makes the next iteration continue from there.
    """

    def __init__(self, dataset: IterableDataset[Batch], num_workers: int, skip: int) -> None:
        self._loader = StatefulDataLoader(
            dataset, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0
        )
        self._skip = skip
        self._epoch = 0
        self._mid_epoch = False  # a loaded position: continue this epoch, skip nothing

    def __iter__(self) -> Iterator[Batch]:
        while True:
            batches = iter(self._loader)
            if not self._mid_epoch:
                for _ in itertools.islice(batches, self._skip):
                    pass
            yielded = self._mid_epoch  # a loaded position may stand at the end of its epoch
            self._mid_epoch = False
            for batch in batches:
                yielded = True
                yield batch
            if not yielded:
                raise ValueError(f"the data has no batch per rank left for training after {self._skip} held out")
            self._epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "loader": self._loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = int(state["epoch"])
        self._loader.load_state_dict(state["loader"])
        self._mid_epoch = True


def _hold_out(dataset: IterableDataset[Batch], num_workers: int, eval_batches: int) -> tuple[TrainBatches, list[Batch]]:
    """Hold out the first ``eval_batches`` batches of a file stream; train on the rest, epoch after epoch."""
    held_out = list(itertools.islice(DataLoader(dataset, batch_size=None), eval_batches))
    if len(held_out) < eval_batches:
        raise ValueError(
            f"the data has only {len(held_out)} batches per rank, fewer than --eval-batches {eval_batches}"
        )
    return TrainBatches(dataset, num_workers, eval_batches), held_out


def make_data(
    kind: str,
    files: list[Path],
    *,
    batch_size: int,
    steps: int,
    eval_batches: int,
    rank: int,
    world_size: int,
    num_workers: int = 0,
    seed: int = 0,
    history: bool = True,
) -> DemoData:
    """Step 2: this rank's training batches (at least ``steps``) and held-out batches.

    ``history`` (random data only): give the model the ``history`` feature.

    Every rank gets the same number of held-out batches of ``batch_size`` samples (row-wise
    sharding on gloo needs equal batch sizes on all ranks, hence ``drop_last`` for files).
    """
    if kind == "random":

        def dataset(num_batches: int, sample_seed: int) -> HistoryRecDataset:
            return HistoryRecDataset(
                batch_size,
                num_batches,
                history=history,
                seed=seed,
                sample_seed=sample_seed,
                rank=rank,
                world_size=world_size,
            )

        held_out_set = dataset(eval_batches, sample_seed=seed + 1_000_003)
        held_out = [held_out_set.make_batch(b, rank) for b in range(eval_batches)]
        features = [Feature("user", multi_hot=False)]
        features += [Feature(name, multi_hot=p > 1) for name, p in CONTEXT_POOLING.items()]
        return DemoData(
            features=features,
            num_dense=RANDOM_NUM_DENSE,
            train=StatefulDataLoader(dataset(steps, sample_seed=seed), batch_size=None, num_workers=num_workers),
            held_out=[batch for batch, _ in held_out],
            held_out_probabilities=[probs for _, probs in held_out],
        )
    if kind == "criteo":
        criteo = CriteoDataset(files, batch_size, rank=rank, world_size=world_size, drop_last=True)
        train, held_out = _hold_out(criteo, num_workers, eval_batches)
        features = [Feature(name, multi_hot=False) for name in CRITEO_SPARSE_FEATURES]
        return DemoData(features, len(CRITEO_DENSE_COLUMNS), train, held_out)
    if kind == "columnar":
        columnar = ColumnarDataset(files[0], batch_size, rank=rank, world_size=world_size, drop_last=True)
        train, held_out = _hold_out(columnar, num_workers, eval_batches)
        features = [Feature(name, multi_hot=False) for name in columnar.features]
        return DemoData(features, len(columnar.dense_columns), train, held_out)
    features, dense = parquet_features(files)
    parquet = ParquetRecDataset(
        files,
        batch_size,
        label_column=PARQUET_LABEL,
        dense_columns=dense,
        sparse_columns=[f.name for f in features],
        rank=rank,
        world_size=world_size,
        drop_last=True,
        shard_by="row",
    )
    train, held_out = _hold_out(parquet, num_workers, eval_batches)
    return DemoData(features, len(dense), train, held_out)
