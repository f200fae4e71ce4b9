"""Steps 1 and 2 of the flow: the Batch and the datasets of the little demo.

Step 1 (the Batch) is ``recsdk.data.Batch``: a dataclass of dense features ``[B, D]``, a
``KeyedJaggedTensor`` of raw int64 ids and labels ``[B]``, implementing TorchRec's
``Pipelineable`` (``to()``, ``pin_memory()``, ``record_stream()``), which is what the
pipeline moves between host and device.

Step 2 (the dataset) is one of recsdk.data's readers, each an ``IterableDataset[Batch]``:

* ``random``: ``RandomRecDataset``, synthetic clicks over four features (a held-out set
  drawn with another sample seed, from the same hidden teacher).
* ``criteo``: ``CriteoDataset`` over Criteo TSV files (plain or ``.gz``): 13 dense features,
  26 categorical features ``cat_0`` .. ``cat_25``.
* ``parquet``: ``ParquetRecDataset``: a ``label`` column, float columns as dense features,
  integer, string and list columns as sparse features (a list column is multi-hot).

For the file formats, the first ``eval_batches`` batches of each rank's stream are held out
for evaluation and training cycles over the rest, epoch after epoch, in file order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset

from recsdk.data import (
    CRITEO_DENSE_COLUMNS,
    CRITEO_SPARSE_FEATURES,
    Batch,
    CriteoDataset,
    ParquetRecDataset,
    RandomRecDataset,
)

DATA_KINDS = ("random", "criteo", "parquet")

# The synthetic task: distinct ids per feature and mean ids per sample.
RANDOM_ID_RANGES = {"user": 100_000, "item": 20_000, "category": 500, "tags": 2_000}
RANDOM_POOLING = {"user": 1.0, "item": 1.0, "category": 1.0, "tags": 3.0}
RANDOM_NUM_DENSE = 13
PARQUET_LABEL = "label"
_CRITEO_SUFFIXES = (".tsv", ".txt", ".gz", ".csv")


@dataclass(frozen=True)
class Feature:
    """A sparse feature: its KJT key, and whether a sample may hold several ids."""

    name: str
    multi_hot: bool


@dataclass
class DemoData:
    """What the demo trains on: the features, the dense width, the batches.

    ``teacher`` gives the true click probabilities of a batch where they are known (the
    synthetic data), for the best AUC any model could reach on the held-out batches.
    """

    features: list[Feature]
    num_dense: int
    train: Iterable[Batch]
    held_out: list[Batch]
    teacher: Callable[[Batch], torch.Tensor] | None = None


def data_files(kind: str, path: str | None) -> list[Path]:
    """The files of ``--data-path`` (a file, or a folder of them), checked before training starts.

    Raises:
        ValueError: a message of one line naming the flag, the value and what is allowed.
    """
    if kind not in DATA_KINDS:
        raise ValueError(f"--data must be one of {', '.join(DATA_KINDS)}, got {kind!r}")
    if kind == "random":
        if path is not None:
            raise ValueError("--data-path is only read with --data criteo or parquet")
        return []
    if path is None:
        raise ValueError(f"--data {kind} needs --data-path (a file or a folder of files)")
    root = Path(path)
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


def _hold_out(
    dataset: IterableDataset[Batch], num_workers: int, eval_batches: int
) -> tuple[Iterator[Batch], list[Batch]]:
    """Hold out the first ``eval_batches`` batches of a file stream; train on the rest, epoch after epoch."""
    held_out = list(itertools.islice(DataLoader(dataset, batch_size=None), eval_batches))
    if len(held_out) < eval_batches:
        raise ValueError(
            f"the data has only {len(held_out)} batches per rank, fewer than --eval-batches {eval_batches}"
        )

    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0)

    def epochs() -> Iterator[Batch]:
        while True:
            empty = True
            for batch in itertools.islice(loader, eval_batches, None):
                empty = False
                yield batch
            if empty:
                raise ValueError(f"the data has no batch per rank left for training after {eval_batches} held out")

    return epochs(), held_out


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
) -> DemoData:
    """Step 2: this rank's training batches (at least ``steps``) and held-out batches.

    Every rank gets the same number of held-out batches of ``batch_size`` samples (row-wise
    sharding on gloo needs equal batch sizes on all ranks, hence ``drop_last`` for files).
    """
    if kind == "random":
        names, ranges, pooling = list(RANDOM_ID_RANGES), list(RANDOM_ID_RANGES.values()), list(RANDOM_POOLING.values())

        def dataset(num_batches: int, sample_seed: int) -> RandomRecDataset:
            return RandomRecDataset(
                batch_size,
                num_batches,
                names,
                ranges,
                num_dense_features=RANDOM_NUM_DENSE,
                pooling_factors=pooling,
                seed=seed,
                sample_seed=sample_seed,
                rank=rank,
                world_size=world_size,
            )

        held_out = dataset(eval_batches, sample_seed=seed + 1_000_003)
        return DemoData(
            features=[Feature(n, multi_hot=p > 1) for n, p in RANDOM_POOLING.items()],
            num_dense=RANDOM_NUM_DENSE,
            train=DataLoader(dataset(steps, sample_seed=seed), batch_size=None, num_workers=num_workers),
            held_out=list(held_out),
            teacher=held_out.probabilities,
        )
    if kind == "criteo":
        criteo = CriteoDataset(files, batch_size, rank=rank, world_size=world_size, drop_last=True)
        train, held_out = _hold_out(criteo, num_workers, eval_batches)
        features = [Feature(name, multi_hot=False) for name in CRITEO_SPARSE_FEATURES]
        return DemoData(features, len(CRITEO_DENSE_COLUMNS), train, held_out)
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
