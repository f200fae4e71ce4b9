"""A synthetic Criteo-format TSV writer: learnable labels over Zipf-distributed hex ids."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.csv as pa_csv

from recsdk.data._checks import check_int
from recsdk.data._synthetic import hash_gaussian, power_law_indices, scrambled_ids, seed_words
from recsdk.data.criteo_fields import CRITEO_DENSE_COLUMNS, CRITEO_SPARSE_FEATURES

__all__ = ["write_synthetic_criteo"]

# Vocabulary sizes of the synthetic categorical columns (a spread like Criteo Kaggle's).
_SYNTH_VOCAB = (
    1460, 583, 100_000, 50_000, 305, 24, 12_517, 633, 3, 93_145, 5_683, 80_000, 3_194,
    27, 14_992, 60_000, 10, 5_652, 2_173, 4, 70_000, 18, 15, 28_000, 105, 14_000,
)  # fmt: skip
_SYNTH_MISSING = (0.0, 0.0, 0.2, 0.2, 0.03, 0.2, 0.04, 0.0, 0.04, 0.45, 0.04, 0.75, 0.2)
_SYNTH_CAT_MISSING = 0.05
_TAG_SYNTH_IDS, _TAG_SYNTH_WEIGHTS, _TAG_SYNTH_ROWS = 0xC1, 0xC2, 0xC3
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _hex8_column(values: npt.NDArray[np.uint32], valid: npt.NDArray[np.bool_]) -> pa.StringArray:
    n = values.shape[0]
    shifts = np.arange(28, -1, -4, dtype=np.uint32)
    chars = _HEX_DIGITS[(values[:, None] >> shifts) & np.uint32(0xF)]
    offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
    return pa.StringArray.from_buffers(
        n,
        pa.py_buffer(offsets),
        pa.py_buffer(np.ascontiguousarray(chars).tobytes()),
        pa.py_buffer(np.packbits(valid, bitorder="little")),
        null_count=int(n - valid.sum()),
    )


def _synthetic_rows(
    rng: np.random.Generator, n: int, id_salts: npt.NDArray[np.uint64], w_salts: npt.NDArray[np.int64]
) -> pa.Table:
    ints = []
    for j, miss in enumerate(_SYNTH_MISSING):
        x = np.floor(rng.lognormal(mean=1.0 + 0.3 * (j % 5), sigma=1.2, size=n)).astype(np.int64)
        if j == 1:
            x -= 3  # like Criteo's I2, which holds small negatives
        ints.append((x, rng.random(n) >= miss))
    cats = []
    logit = np.full(n, -1.0)
    for j, vocab in enumerate(_SYNTH_VOCAB):
        idx = power_law_indices(rng, n, vocab, 1.1)
        raw = scrambled_ids(idx, id_salts[j]).view(np.uint64)
        ids = (raw & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        valid = rng.random(n) >= _SYNTH_CAT_MISSING
        if j < 6:  # the teacher reads six categorical columns ...
            w = 1.2 * hash_gaussian(ids.astype(np.int64), w_salts[j])
            logit += np.where(valid, w, 0.0)
        cats.append((ids, valid))
    for j in range(3):  # ... and three integer columns
        x, valid = ints[j]
        logit += np.where(valid, (0.5, -0.4, 0.3)[j] * (np.log1p(np.maximum(x, 0)) - 1.5), 0.0)
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    columns: dict[str, pa.Array] = {"label": pa.array(labels)}
    for name, (x, valid) in zip(CRITEO_DENSE_COLUMNS, ints, strict=True):
        columns[name] = pa.array(x, mask=~valid)
    for name, (ids, valid) in zip(CRITEO_SPARSE_FEATURES, cats, strict=True):
        columns[name] = _hex8_column(ids, valid)
    return pa.table(columns)


def write_synthetic_criteo(
    path: str | os.PathLike[str], num_lines: int, seed: int = 0, *, chunk_lines: int = 100_000
) -> Path:
    """Write a Criteo-format TSV file with learnable labels (gzip-compressed if ``path`` ends in ``.gz``).

    Integer columns are log-normal counts (column ``int_1`` also holds small negatives),
    each with its own missing rate; categorical columns are 8-digit lowercase hex ids,
    Zipf-distributed over a per-column vocabulary (3 to 100k values), 5% missing. The
    label is a Bernoulli draw from a hidden teacher over six categorical and three
    integer columns, so a model can learn it. The file is written ``chunk_lines`` at a
    time, vectorised; the same ``seed`` gives the same bytes.

    Args:
        path (str | os.PathLike): the file to write (parent folder must exist).
        num_lines (int): lines to write (>= 0).
        seed (int): seed of the content (>= 0).
        chunk_lines (int): lines generated per chunk (>= 1).

    Returns:
        Path: ``path``.

    Example::

        write_synthetic_criteo(tmp_path / "day_0.tsv", num_lines=10_000, seed=1)
    """
    check_int("num_lines", num_lines, minimum=0)
    check_int("seed", seed, minimum=0)
    check_int("chunk_lines", chunk_lines, minimum=1)
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"folder of {str(path)!r} does not exist")
    id_salts = seed_words(seed, _TAG_SYNTH_IDS, len(_SYNTH_VOCAB))
    w_salts = seed_words(seed, _TAG_SYNTH_WEIGHTS, len(_SYNTH_VOCAB)).view(np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _TAG_SYNTH_ROWS])))
    options = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    compression = "gzip" if path.suffix == ".gz" else None
    with pa.output_stream(path, compression=compression) as out:
        written = 0
        writer = None
        while written < num_lines:
            n = min(chunk_lines, num_lines - written)
            table = _synthetic_rows(rng, n, id_salts, w_salts)
            if writer is None:
                writer = pa_csv.CSVWriter(out, table.schema, write_options=options)
            writer.write_table(table)
            written += n
        if writer is not None:
            writer.close()
    return path
