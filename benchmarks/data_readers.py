"""Criteo data paths: the TSV reader, the columnar converter and reader, each against its baseline.

Writes a synthetic Criteo-format file (``--lines`` lines) and prints one JSON line per
measurement, every rate in rows/s, each ratio against a baseline timed in the same run:

- ``criteo_tsv_read``: ``CriteoDataset`` (batches of ``--batch-size``) against a bare
  ``pyarrow.csv`` parse of the same file (the same reader options, label and ints typed as
  int64, hex ids kept as strings: the parse alone) and against a plain Python ``csv`` loop
  building the same tensors (checked equal on a prefix). Interleaved rounds, medians.
- ``criteo_convert``: ``python -m recsdk.data.convert`` on 1 process and on all cores (the file
  cut in units of ``--chunk-mb``, process start included) against TorchRec's
  ``BinaryCriteoUtils.tsv_to_npys`` of the same file.
- ``columnar_format``: why Arrow IPC: the bytes, and the rows/s of reading every column of the
  converted rows into memory, memory-mapped IPC (every buffer touched) against Parquet with the
  same record batches as row groups (decoded).
- ``columnar_read``: ``ColumnarDataset`` on one thread, at each ``--read-batch-sizes``, against
  TorchRec's ``InMemoryBinaryCriteoIterDataPipe`` over the same rows converted by TorchRec's
  ``BinaryCriteoUtils`` (target: at least 2M rows/s). Interleaved rounds, medians.
- ``demo_training``: for scale, the samples/s the little demo's training consumes from the
  converted data (2 ranks, ``--demo-steps`` steps); ``--no-demo`` leaves it out.

No ``--device``: the readers and converters are host code; the demo's 2 ranks train on the CPU (``--device cpu``).

    python benchmarks/data_readers.py                      # 1M lines
    python benchmarks/data_readers.py --lines 200000 --rounds 3 --no-demo
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils, InMemoryBinaryCriteoIterDataPipe
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import (
    CRITEO_DENSE_COLUMNS,
    CRITEO_SPARSE_FEATURES,
    Batch,
    ColumnarDataset,
    CriteoDataset,
    write_synthetic_criteo,
)

DEMO = Path(__file__).resolve().parents[1] / "examples" / "little_demo" / "main.py"
COLUMNS = ["label", *CRITEO_DENSE_COLUMNS, *CRITEO_SPARSE_FEATURES]


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


def pyarrow_parse(path: Path, block_size: int = 1 << 22) -> Iterator[pa.RecordBatch]:
    """The bare parse: pyarrow's streaming CSV reader with CriteoDataset's options, hex kept as strings."""
    types = {name: pa.int64() for name in ["label", *CRITEO_DENSE_COLUMNS]}
    types |= {name: pa.string() for name in CRITEO_SPARSE_FEATURES}
    reader = pa_csv.open_csv(
        path,
        read_options=pa_csv.ReadOptions(column_names=COLUMNS, block_size=block_size, use_threads=False),
        parse_options=pa_csv.ParseOptions(
            delimiter="\t", quote_char=False, double_quote=False, escape_char=False, ignore_empty_lines=False
        ),
        convert_options=pa_csv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=True),
    )
    yield from reader


def _same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.labels, b.labels)
        and torch.equal(a.dense_features, b.dense_features)
        and a.sparse_features.keys() == b.sparse_features.keys()
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


def _rate(make: Callable[[], Iterator[object]], rows_of: Callable[[object], int]) -> float:
    start = time.perf_counter()
    rows = sum(rows_of(item) for item in make())
    return rows / (time.perf_counter() - start)


def _batch_rows(batch: object) -> int:
    return int(batch.labels.shape[0])  # type: ignore[attr-defined]


def interleaved(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Medians over ``rounds`` of the cases timed A B A B ...: rows/s of each."""
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            rates[name].append(run())
    return {name: statistics.median(values) for name, values in rates.items()}


def bench_tsv(path: Path, args: argparse.Namespace) -> dict[str, object]:
    check_batches = max(1, min(args.check_lines, args.lines) // args.batch_size)
    ours = list(islice(CriteoDataset(path, args.batch_size), check_batches))
    theirs = list(islice(python_csv_batches(path, args.batch_size), check_batches))
    if len(ours) != len(theirs) or not all(_same(a, b) for a, b in zip(ours, theirs, strict=True)):
        raise SystemExit("CriteoDataset and the Python loop disagree on the first lines")
    rates = interleaved(
        {
            "recsdk": lambda: _rate(lambda: iter(CriteoDataset(path, args.batch_size)), _batch_rows),
            "pyarrow_parse": lambda: _rate(lambda: pyarrow_parse(path), lambda rb: rb.num_rows),  # type: ignore[attr-defined]
        },
        args.rounds,
    )
    baseline_lines = args.baseline_lines or args.lines
    python = _rate(lambda: python_csv_batches(path, args.batch_size, max_lines=baseline_lines), _batch_rows)
    return {
        "bench": "criteo_tsv_read",
        "lines": args.lines,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "recsdk_rows_per_s": round(rates["recsdk"]),
        "pyarrow_parse_rows_per_s": round(rates["pyarrow_parse"]),
        "ratio_vs_pyarrow_parse": round(rates["recsdk"] / rates["pyarrow_parse"], 3),
        "target_vs_pyarrow_parse": 0.8,
        "python_csv_rows_per_s": round(python),
        "ratio_vs_python_csv": round(rates["recsdk"] / python, 2),
        "equal_on_prefix_lines": sum(b.batch_size for b in ours),
    }


def bench_convert(path: Path, tmp: Path, args: argparse.Namespace) -> tuple[dict[str, object], Path, Path]:
    """Both converters; returns the line, recsdk's dataset folder and TorchRec's npy folder.

    recsdk's converter runs as users run it, ``python -m recsdk.data.convert`` (process start
    included), on 1 process and on every core.
    """
    cores = os.cpu_count() or 1
    times = {}
    for workers in (1, cores):
        out = tmp / f"columnar_{workers}"
        cmd = [sys.executable, "-m", "recsdk.data.convert", "criteo", str(path), str(out), "--quiet"]
        cmd += ["--workers", str(workers), "--chunk-bytes", str(args.chunk_mb << 20)]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times[workers] = time.perf_counter() - start
    manifest = json.loads((tmp / f"columnar_{cores}" / "manifest.json").read_text())
    npy = tmp / "npy"
    npy.mkdir()
    start = time.perf_counter()
    BinaryCriteoUtils.tsv_to_npys(str(path), str(npy / "dense.npy"), str(npy / "sparse.npy"), str(npy / "labels.npy"))
    torchrec_s = time.perf_counter() - start
    rows = manifest["rows"]
    line = {
        "bench": "criteo_convert",
        "rows": rows,
        "units": len(manifest["parts"]),
        "recsdk_rows_per_s_1_process": round(rows / times[1]),
        f"recsdk_rows_per_s_{cores}_processes": round(rows / times[cores]),
        "torchrec_tsv_to_npys_rows_per_s": round(rows / torchrec_s),
        "ratio_1_process_vs_torchrec": round(torchrec_s / times[1], 2),
        f"ratio_{cores}_processes_vs_torchrec": round(torchrec_s / times[cores], 2),
        "bytes_per_row": round(sum(p["bytes"] for p in manifest["parts"]) / rows, 1),
    }
    return line, tmp / f"columnar_{cores}", npy


def bench_format(columnar: Path, tmp: Path, rounds: int) -> dict[str, object]:
    """Every column into memory: memory-mapped Arrow IPC (each buffer touched) vs Parquet (decoded)."""
    parts = sorted(columnar.glob("part-*.arrow"))
    parquet = tmp / "same_rows.parquet"
    with pa.ipc.open_file(pa.memory_map(str(parts[0]))) as first:
        schema = first.schema
    with pq.ParquetWriter(parquet, schema) as writer:
        for part in parts:
            with pa.ipc.open_file(pa.memory_map(str(part))) as reader:
                for i in range(reader.num_record_batches):
                    writer.write_batch(reader.get_batch(i), row_group_size=reader.get_batch(i).num_rows)

    def ipc() -> float:
        start, rows = time.perf_counter(), 0
        for part in parts:
            with pa.ipc.open_file(pa.memory_map(str(part))) as reader:
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    for column in batch.columns:  # touch every byte once, as a reader would
                        for buf in column.buffers():
                            if buf is not None:
                                np.frombuffer(buf, dtype=np.uint8).max(initial=0)
                    rows += batch.num_rows
        return rows / (time.perf_counter() - start)

    def parquet_read() -> float:
        start = time.perf_counter()
        table = pq.read_table(parquet, use_threads=False)
        return table.num_rows / (time.perf_counter() - start)

    rates = interleaved({"ipc": ipc, "parquet": parquet_read}, rounds)
    return {
        "bench": "columnar_format",
        "arrow_ipc_mmap_rows_per_s": round(rates["ipc"]),
        "parquet_decode_rows_per_s": round(rates["parquet"]),
        "ratio_ipc_vs_parquet": round(rates["ipc"] / rates["parquet"], 2),
        "arrow_ipc_bytes": sum(p.stat().st_size for p in parts),
        "parquet_snappy_bytes": parquet.stat().st_size,
    }


def bench_read(columnar: Path, npy: Path, batch_size: int, rounds: int) -> dict[str, object]:
    ours = ColumnarDataset(columnar, batch_size)
    theirs = InMemoryBinaryCriteoIterDataPipe(
        "train", [str(npy / "dense.npy")], [str(npy / "sparse.npy")], [str(npy / "labels.npy")], batch_size, 0, 1
    )
    rates = interleaved(
        {
            "recsdk": lambda: _rate(lambda: iter(ours), _batch_rows),
            "torchrec": lambda: _rate(lambda: iter(theirs), _batch_rows),
        },
        rounds,
    )
    return {
        "bench": "columnar_read",
        "rows": ours.num_rows,
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "recsdk_rows_per_s": round(rates["recsdk"]),
        "target_rows_per_s": 2_000_000,
        "torchrec_in_memory_rows_per_s": round(rates["torchrec"]),
        "ratio_vs_torchrec": round(rates["recsdk"] / rates["torchrec"], 3),
        "target_vs_torchrec": 1.0,
    }


def bench_demo(columnar: Path, tmp: Path, steps: int) -> dict[str, object]:
    out = tmp / "demo"
    flags = ["--world-size", "2", "--device", "cpu", "--data", "columnar", "--data-path", str(columnar)]
    flags += ["--steps", str(steps)]
    flags += ["--eval-every", "0", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(DEMO), *flags], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the demo failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "bench": "demo_training",
        "data": "columnar",
        "world_size": 2,
        "steps": steps,
        "samples_per_s_all_ranks": round(summary["samples_per_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines in the generated file")
    parser.add_argument("--baseline-lines", type=int, default=None, help="lines the Python loop reads (default: all)")
    parser.add_argument("--batch-size", type=int, default=4096, help="CriteoDataset's batch size")
    parser.add_argument("--read-batch-sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--check-lines", type=int, default=20_000, help="prefix on which CriteoDataset and csv agree")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per comparison")
    parser.add_argument("--chunk-mb", type=int, default=32, help="MiB of the file per conversion unit")
    parser.add_argument("--demo-steps", type=int, default=200)
    parser.add_argument("--no-demo", action="store_true", help="leave out the demo's training rate")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one thread: the readers' own speed
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        path = write_synthetic_criteo(tmp / "criteo.tsv", args.lines, seed=0)
        print(json.dumps(bench_tsv(path, args)), flush=True)
        line, columnar, npy = bench_convert(path, tmp, args)
        print(json.dumps(line), flush=True)
        print(json.dumps(bench_format(columnar, tmp, args.rounds)), flush=True)
        for batch_size in args.read_batch_sizes:
            print(json.dumps(bench_read(columnar, npy, batch_size, args.rounds)), flush=True)
        if not args.no_demo:
            print(json.dumps(bench_demo(columnar, tmp, args.demo_steps)), flush=True)


if __name__ == "__main__":
    main()
