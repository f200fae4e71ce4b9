"""Criteo TSV reading: recsdk's vectorised CriteoDataset against a plain Python csv loop.

Writes a synthetic Criteo-format file (``--lines`` lines), reads it into batches with
``recsdk.data.CriteoDataset`` and with a plain ``csv.reader`` loop that builds the same
tensors, checks that both give equal tensors on a prefix, and prints one JSON line with
both rates (rows/s) and their ratio. Both run in this process, one after the other.
``--shuffle-buffer N`` times CriteoDataset with a shuffle buffer of N rows (the check and
the Python loop stay in file order).

    python benchmarks/data_readers.py               # 1M lines
    python benchmarks/data_readers.py --lines 100000
    python benchmarks/data_readers.py --shuffle-buffer 1000000
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import tempfile
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import CRITEO_SPARSE_FEATURES, Batch, CriteoDataset, write_synthetic_criteo


def python_csv_batches(path: Path, batch_size: int, max_lines: int | None = None) -> Iterator[Batch]:
    """The baseline: one Python loop over ``csv.reader`` rows, building the same Batch."""
    num_sparse = len(CRITEO_SPARSE_FEATURES)

    def make(labels: list[float], dense: list[list[float]], values: list[list[int]], lengths: list[list[int]]) -> Batch:
        kjt = KeyedJaggedTensor(
            keys=list(CRITEO_SPARSE_FEATURES),
            values=torch.tensor([v for per_feature in values for v in per_feature], dtype=torch.int64),
            lengths=torch.tensor([n for per_feature in lengths for n in per_feature], dtype=torch.int32),
            stride=len(labels),
        )
        return Batch(torch.tensor(dense, dtype=torch.float32), kjt, torch.tensor(labels, dtype=torch.float32))

    def empty() -> tuple[list[float], list[list[float]], list[list[int]], list[list[int]]]:
        return [], [], [[] for _ in range(num_sparse)], [[] for _ in range(num_sparse)]

    labels, dense, values, lengths = empty()
    with open(path, newline="") as f:
        for row in islice(csv.reader(f, delimiter="\t"), max_lines):
            labels.append(float(int(row[0])))
            dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in row[1:14]])
            for j, x in enumerate(row[14:]):
                if x:
                    v = int(x, 16)
                    values[j].append(v - (1 << 64) if v >= 1 << 63 else v)
                    lengths[j].append(1)
                else:
                    lengths[j].append(0)
            if len(labels) == batch_size:
                yield make(labels, dense, values, lengths)
                labels, dense, values, lengths = empty()
    if labels:
        yield make(labels, dense, values, lengths)


def _same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.labels, b.labels)
        and torch.equal(a.dense_features, b.dense_features)
        and a.sparse_features.keys() == b.sparse_features.keys()
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


def _rows_per_s(batches: Iterator[Batch]) -> tuple[float, int]:
    start = time.perf_counter()
    rows = sum(b.batch_size for b in batches)
    return rows / (time.perf_counter() - start), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines in the generated file")
    parser.add_argument("--baseline-lines", type=int, default=None, help="lines the Python loop reads (default: all)")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--check-lines", type=int, default=20_000, help="prefix on which both must agree")
    parser.add_argument("--shuffle-buffer", type=int, default=0, help="shuffle buffer of the timed CriteoDataset run")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = write_synthetic_criteo(Path(tmp) / "criteo.tsv", args.lines, seed=0)
        check_batches = max(1, min(args.check_lines, args.lines) // args.batch_size)
        ours = list(islice(CriteoDataset(path, args.batch_size), check_batches))
        theirs = list(islice(python_csv_batches(path, args.batch_size), check_batches))
        check_lines = sum(b.batch_size for b in ours)
        equal = len(ours) == len(theirs) and all(_same(a, b) for a, b in zip(ours, theirs, strict=True))
        if not equal:
            raise SystemExit(f"CriteoDataset and the Python loop disagree on the first {check_lines} lines")

        timed = CriteoDataset(path, args.batch_size, shuffle_buffer=args.shuffle_buffer)
        recsdk_rate, recsdk_rows = _rows_per_s(iter(timed))
        python_rate, python_rows = _rows_per_s(python_csv_batches(path, args.batch_size, max_lines=args.baseline_lines))
    print(
        json.dumps(
            {
                "bench": "criteo_tsv_read",
                "lines": args.lines,
                "batch_size": args.batch_size,
                "shuffle_buffer": args.shuffle_buffer,
                "recsdk_rows": recsdk_rows,
                "recsdk_rows_per_s": round(recsdk_rate),
                "python_csv_rows": python_rows,
                "python_csv_rows_per_s": round(python_rate),
                "ratio": round(recsdk_rate / python_rate, 2),
                "equal_on_prefix_lines": check_lines,
            }
        )
    )


if __name__ == "__main__":
    main()
