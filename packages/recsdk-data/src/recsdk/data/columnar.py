"""A reader of converted columnar datasets: memory-mapped Arrow files to training batches."""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data._checks import check_bool, check_int
from recsdk.data.batch import Batch
from recsdk.data.columnar_format import MANIFEST, check_part, columnar_schema, lengths_column, read_manifest
from recsdk.data.partition import check_rank_and_world_size, current_shard

__all__ = ["ColumnarDataset"]

_STATE_KEYS = ("epoch", "batches_read", "rows", "batch_size", "drop_last", "shuffle", "seed", "shard", "num_shards")


@dataclass
class _Segment:
    """One record batch's columns as views of the mapped part file; rows ``[start, start + n)`` of the dataset."""

    start: int
    n: int
    labels: npt.NDArray[np.float32]  # [n], views of the copy-on-write mapping (writable)
    dense: npt.NDArray[np.float32]  # [n, D]
    words: npt.NDArray[np.int32]  # the whole part file as int32 words: the lists' offsets are read from it
    offsets_at: npt.NDArray[np.int64]  # [F]: the word holding feature j's offset of the segment's row 0
    ids: list[npt.NDArray[Any]]  # per feature, the ids of all n rows (uint32 or int64)
    lengths: npt.NDArray[np.uint8]  # [F, n], one strided view of the F lengths columns


def _address(array: npt.NDArray[Any]) -> int:
    return int(array.__array_interface__["data"][0])


def _place(base: npt.NDArray[np.uint8], array: npt.NDArray[Any], what: str) -> int:
    """The byte offset of ``array`` (a view of the mapping) in ``base`` (the mapping)."""
    first = _address(array) - _address(base)
    if not 0 <= first <= base.shape[0] - array.nbytes:
        raise ValueError(f"{what} is not stored in place (a compressed file?): not an Arrow IPC file of the format")
    return first


def _view_of(base: npt.NDArray[np.uint8], array: npt.NDArray[Any], what: str) -> npt.NDArray[Any]:
    """``array`` (a contiguous, read-only view of the mapping) as a view of ``base`` (writable when it is)."""
    first = _place(base, array, what)
    return base[first : first + array.nbytes].view(array.dtype).reshape(array.shape)


def _stacked(columns: list[npt.NDArray[np.uint8]], n: int) -> npt.NDArray[np.uint8]:
    """``F`` byte columns of ``n`` rows as one ``[F, n]`` view: the IPC writer lays consecutive
    columns of one length at equal strides."""
    if not columns:
        return np.zeros((0, n), dtype=np.uint8)
    stride = _address(columns[-1]) - _address(columns[0])
    stride = stride // (len(columns) - 1) if len(columns) > 1 else n
    if stride < n or any(_address(c) - _address(columns[0]) != j * stride for j, c in enumerate(columns)):
        raise ValueError("the lengths columns do not lie at equal strides: not an Arrow IPC file of the format")
    return np.lib.stride_tricks.as_strided(columns[0], (len(columns), n), (stride, 1), writeable=False)


def _segment(batch: pa.RecordBatch, start: int, mapping: mmap.mmap, num_dense: int, features: list[str]) -> _Segment:
    """Views of ``batch``'s buffers (no copy: the arrays point into the mapped file)."""
    n = batch.num_rows
    base = np.frombuffer(mapping, dtype=np.uint8)
    words = base[: base.shape[0] // 4 * 4].view(np.int32)
    offsets_at, ids = [], []
    for name in features:
        column = batch.column(name)
        first = _place(base, column.offsets.to_numpy(zero_copy_only=True), f"column {name!r}")
        if first % 4:
            raise ValueError(f"column {name!r}: offsets not aligned to 4 bytes: not an Arrow IPC file of the format")
        offsets_at.append(first // 4)
        ids.append(column.values.to_numpy(zero_copy_only=True))
    dense = batch.column("dense").flatten().to_numpy(zero_copy_only=True).reshape(n, num_dense)
    return _Segment(
        start,
        n,
        _view_of(base, batch.column("label").to_numpy(zero_copy_only=True), "column 'label'"),
        _view_of(base, dense, "column 'dense'") if dense.size else dense.copy(),
        words,
        np.array(offsets_at, dtype=np.int64),
        ids,
        _stacked([batch.column(lengths_column(name)).to_numpy(zero_copy_only=True) for name in features], n),
    )


class ColumnarDataset(IterableDataset[Batch]):
    """Batches from a columnar dataset converted by ``python -m recsdk.data.convert``.

    Yields the same :class:`~recsdk.data.Batch` as :class:`~recsdk.data.CriteoDataset` over the
    source files: dense float32 ``[B, D]``, a KJT of raw int64 ids (int32 lengths, with its
    offsets and per-key lengths filled in), float32 labels ``[B]``. With one rank and no
    shuffle, batch ``i`` holds exactly the rows ``CriteoDataset(sources, batch_size)`` puts in
    its batch ``i`` (skipped bad lines left out the same way).

    The part files are memory-mapped copy-on-write and every column is read in place (no
    decoding). A batch's dense features and labels are views of the mapping (zero-copy; copied
    only for a batch that spans two record batches); its ids (widened to int64 from a part's
    uint32) and lengths are copied, feature by feature, as a KJT lays them out. Writing into a
    batch never changes the files or another reader, but this reader reads its own writes to
    dense features or labels again in a later epoch: ``clone()`` them before changing them in
    place (as with TorchRec's in-memory reader, whose batches are views of its arrays). A system
    that refuses private mappings (strict overcommit) gets read-only mappings and copied batches.

    **Sharding.** The dataset's rows, in order, form global batches of ``batch_size``
    contiguous rows (the last one partial unless ``drop_last``). Global batch ``k`` of the
    epoch's order belongs to rank ``k % world_size``; DataLoader workers split their rank's
    batches round-robin (see :func:`recsdk.data.current_shard`), so a rank yields the same
    batches in the same order with or without workers. Ranks may get one batch more or
    fewer than each other.

    **Shuffling.** ``shuffle=True`` permutes the global batches' order each epoch, seeded by
    ``(seed, epoch)`` and the same on every rank (so ranks still split them without
    overlap); a batch's rows stay together, as in TorchRec's ``shuffle_batches``. Call
    :meth:`set_epoch` for a new order each epoch.

    **Position.** :meth:`state_dict` gives the epoch and the number of batches this reader
    has yielded in it; :meth:`load_state_dict` makes the next iteration continue after them
    (the protocol of torchdata's ``StatefulDataLoader``). A state loads only into a reader
    over the same dataset with the same batch size, shuffle and seed.

    **Elastic resume.** A state saved by one of ``N`` shards loads into a reader of ``M`` shards
    (another world size): the ``N`` shards read their global batches in lockstep (as ranks
    training together do; one DataLoader worker per rank), so together they read the first
    ``base + N * batches_read`` global batches of the epoch's order, and the ``M`` new shards
    split the rest round-robin. Across the restart every batch of the epoch is read exactly
    once. (Any rank's state will do: ``load_checkpoint`` returns rank 0's on another world size.)

    Args:
        path (str | os.PathLike): the dataset folder (the converter's ``OUT``).
        batch_size (int): rows per batch (>= 1).
        rank (int | None): this rank; ``None`` asks ``torch.distributed`` at iteration
            (0 when it is not initialised). Give both or neither.
        world_size (int | None): number of ranks, like ``rank``.
        shuffle (bool): permute the batches' order each epoch.
        seed (int): seed of the shuffle (>= 0).
        drop_last (bool): leave out the last, partial global batch.

    Raises:
        FileNotFoundError: ``path`` is not a folder.
        ValueError: ``path`` is not a complete converted dataset, or a part file is missing,
            of another size than the manifest says, or not an Arrow file of the dataset's
            schema (the message names the file).

    Example::

        # python -m recsdk.data.convert criteo day_0.gz day_1.gz criteo_columnar/
        ds = ColumnarDataset("criteo_columnar", batch_size=4096, shuffle=True)
        for batch in DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True):
            ...  # dense [4096, 13], KJT cat_0..cat_25 of raw int64 ids, labels [4096]
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        check_rank_and_world_size(rank, world_size)
        self.rank, self.world_size = rank, world_size
        self.shuffle = check_bool("shuffle", shuffle)
        self.seed = check_int("seed", seed, minimum=0)
        self.drop_last = check_bool("drop_last", drop_last)
        self.path = Path(path)
        manifest = read_manifest(self.path)
        self.features: list[str] = list(manifest["sparse"])
        self.dense_columns: list[str] = list(manifest["dense"]["names"])
        self.num_rows: int = int(manifest["rows"])
        self._segments: list[_Segment] = []
        self._readers: list[pa.RecordBatchFileReader] = []  # keep the mappings alive with the views
        start = 0
        for part in manifest["parts"]:
            schema = columnar_schema(len(self.dense_columns), self.features, part["ids"])
            reader, mapping = check_part(self.path, part, schema)
            self._readers.append(reader)
            for i in range(reader.num_record_batches):
                segment = _segment(reader.get_batch(i), start, mapping, len(self.dense_columns), self.features)
                self._segments.append(segment)
                start += segment.n
        if start != self.num_rows:
            raise ValueError(f"{self.path / MANIFEST}: {self.num_rows:,} rows, its parts hold {start:,}")
        self._starts = np.array([s.start for s in self._segments], dtype=np.int64)
        self.epoch = 0
        self._resume_at = 0  # batches of this shard's order to skip on the next iteration
        self._read = 0  # batches yielded (or skipped on resume) in the current epoch
        self._base = 0  # global batches of the epoch's order read before this split (elastic resume)

    def __getstate__(self) -> dict[str, Any]:
        """A pickle (a DataLoader worker started by spawn) holds the arguments and the position, not the mappings.

        The copy opens the files again and continues where :meth:`state_dict` says this reader is.
        """
        args = {"path": self.path, "batch_size": self.batch_size, "rank": self.rank, "world_size": self.world_size}
        args |= {"shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last}
        return {"args": args, "epoch": self.epoch, "batches_read": self._read, "base": self._base}

    def __setstate__(self, state: dict[str, Any]) -> None:
        args = dict(state["args"])
        self.__init__(args.pop("path"), args.pop("batch_size"), **args)  # type: ignore[misc]
        self.epoch, self._resume_at, self._base = state["epoch"], state["batches_read"], state["base"]
        self._read = self._resume_at

    def set_epoch(self, epoch: int) -> None:
        """Use a different batch order for ``epoch`` (no effect without ``shuffle``).

        Another epoch than the current one starts at its first batch; the current one keeps a
        position loaded by :meth:`load_state_dict`.
        """
        if check_int("epoch", epoch, minimum=0) != self.epoch:
            self.epoch = epoch
            self._resume_at = self._read = self._base = 0

    @property
    def num_batches(self) -> int:
        """Global batches per epoch, over all ranks."""
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _order(self, shard: int, num_shards: int) -> npt.NDArray[np.int64]:
        """The global batches this shard yields this epoch, in order (after those read before an elastic resume)."""
        order = np.arange(self.num_batches, dtype=np.int64)
        if self.shuffle:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.epoch])))
            order = rng.permutation(order)
        return order[self._base :][shard::num_shards]

    def __len__(self) -> int:
        """Batches this rank yields per epoch (all its DataLoader workers together)."""
        shard, num_shards = current_shard(self.rank, self.world_size)
        return len(range(shard, self.num_batches - self._base, num_shards))

    def __iter__(self) -> Iterator[Batch]:
        shard, num_shards = current_shard(self.rank, self.world_size)
        order = self._order(shard, num_shards)
        start, self._resume_at = self._resume_at, 0
        self._read = start
        for k in order[start:].tolist():
            batch = self.batch(k)
            self._read += 1
            yield batch

    def batch(self, k: int) -> Batch:
        """Global batch ``k``: rows ``[k * batch_size, (k + 1) * batch_size)`` (fewer for the last)."""
        first = k * self.batch_size
        last = min(first + self.batch_size, self.num_rows)
        if not 0 <= first < last:
            raise IndexError(f"batch {k} is out of range: the dataset has {self.num_batches} batches")
        pieces = []  # (segment, first row, end row) in the segment's numbering
        i = int(np.searchsorted(self._starts, first, side="right")) - 1
        while first < last:
            seg = self._segments[i]
            end = min(last, seg.start + seg.n)
            pieces.append((seg, first - seg.start, end - seg.start))
            first, i = end, i + 1
        return self._make_batch(pieces)

    def _make_batch(self, pieces: list[tuple[_Segment, int, int]]) -> Batch:
        """The ids (widened to int64, feature-major across the pieces) and lengths ``[F, B]`` copied;
        dense features and labels views of the mapping (copied when the batch spans pieces or
        the mapping is read-only).

        Each piece's lists' offsets at its first and end rows (one gather of ``F`` words each)
        give every feature's ids as one slice. The KJT's offsets are left to it (computed when asked).
        """
        num_features = len(self.features)
        lengths = np.empty((num_features, sum(b - a for _, a, b in pieces)), dtype=np.int32)
        counts = np.zeros(num_features, dtype=np.int64)
        spans, column = [], 0
        for s, a, b in pieces:
            first_end = s.words[s.offsets_at + np.array([[a], [b]])]  # [2, F]: each list's offsets at rows a, b
            counts += first_end[1] - first_end[0]
            spans.append((s.ids, *first_end.tolist()))
            np.copyto(lengths[:, column : column + b - a], s.lengths[:, a:b])
            column += b - a
        chunks = [ids[j][first[j] : end[j]] for j in range(num_features) for ids, first, end in spans]
        length_per_key = counts.tolist()
        offset_per_key = [0, *itertools.accumulate(length_per_key)]
        values = np.empty(offset_per_key[-1], dtype=np.int64)
        if chunks:
            np.concatenate(chunks, out=values)  # uint32 ids widen here
        if len(pieces) == 1:
            s, a, b = pieces[0]
            dense, labels = s.dense[a:b], s.labels[a:b]
            if not dense.flags.writeable:  # a read-only mapping (see check_part): the batch gets copies
                dense, labels = dense.copy(), labels.copy()
        else:
            dense = np.concatenate([s.dense[a:b] for s, a, b in pieces])
            labels = np.concatenate([s.labels[a:b] for s, a, b in pieces])
        kjt = KeyedJaggedTensor(
            keys=self.features,
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(lengths.reshape(-1)),
            stride=lengths.shape[1],
            length_per_key=length_per_key,
            offset_per_key=offset_per_key,
        )
        return Batch(torch.from_numpy(dense), kjt, torch.from_numpy(labels))

    def state_dict(self) -> dict[str, Any]:
        """This reader's position: the epoch and the batches of it already yielded, with what they depend on."""
        shard, num_shards = current_shard(self.rank, self.world_size)
        return {
            "epoch": self.epoch,
            "batches_read": self._read,
            "rows": self.num_rows,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "shard": shard,
            "num_shards": num_shards,
            "base": self._base,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the next iteration after the batches ``state`` (from :meth:`state_dict`) had read.

        A state of another shard count continues elastically (see the class): this reader
        yields its share of the global batches the saving shards had not read.

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: a key is missing, or ``state`` is of a reader over another dataset,
                batch size, shuffle or seed, or of another shard of as many shards (every
                difference named).
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from ColumnarDataset.state_dict(), got {type(state).__name__}")
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"state is missing {missing}; expected a dict from ColumnarDataset.state_dict()")
        mine = self.state_dict()
        elastic = state["num_shards"] != mine["num_shards"]
        skipped = ("epoch", "batches_read", "shard", "num_shards") if elastic else ("epoch", "batches_read")
        differ = [
            f"{key} {state[key]!r} (this reader: {mine[key]!r})"
            for key in _STATE_KEYS
            if key not in skipped and state[key] != mine[key]
        ]
        if differ:
            raise ValueError(f"state is of another reader: {', '.join(differ)}")
        epoch = check_int("state['epoch']", state["epoch"], minimum=0)
        base = check_int("state['base']", state.get("base", 0), minimum=0, maximum=self.num_batches)
        num_shards = check_int("state['num_shards']", state["num_shards"], minimum=1)
        if elastic:
            # The saving shards read in lockstep: together, the first base + N * batches_read batches.
            read = check_int("state['batches_read']", state["batches_read"], minimum=0)
            self.epoch, self._resume_at, self._read = epoch, 0, 0
            self._base = min(base + read * num_shards, self.num_batches)
            return
        self.epoch, self._base = epoch, base
        batches = len(self._order(mine["shard"], mine["num_shards"]))
        self._resume_at = check_int("state['batches_read']", state["batches_read"], minimum=0, maximum=batches)
        self._read = self._resume_at
