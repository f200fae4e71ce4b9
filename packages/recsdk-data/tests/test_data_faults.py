"""Faults in the data files: the errors name the file and how far reading got."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recsdk.data import CriteoDataset, write_synthetic_criteo


def _truncated_gz(tmp_path: Path, num_lines: int, keep: float) -> Path:
    path = write_synthetic_criteo(tmp_path / "day_0.tsv.gz", num_lines=num_lines, seed=1)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


@pytest.mark.parametrize(
    ("num_lines", "keep", "block_size"),
    [
        (20_000, 0.6, 1 << 16),  # cut after many blocks
        (100, 0.6, 1 << 16),  # cut inside the first block, which opening the reader reads
    ],
)
def test_truncated_gz_names_the_file_and_the_rows_read(
    tmp_path: Path, num_lines: int, keep: float, block_size: int
) -> None:
    path = _truncated_gz(tmp_path, num_lines, keep)
    # Batches of one row, no shuffle buffer, one shard: every row read is yielded before the next block.
    dataset = CriteoDataset(path, batch_size=1, block_size=block_size)
    yielded = 0
    with pytest.raises(OSError) as caught:
        for _ in dataset:
            yielded += 1
    message = str(caught.value)
    assert str(path) in message, message
    assert "Truncated compressed stream" in message, message
    match = re.search(r"after ([\d,]+) rows", message)
    assert match, message
    assert int(match.group(1).replace(",", "")) == yielded
    assert yielded < num_lines
    assert isinstance(caught.value.__cause__, OSError)  # pyarrow's own error, kept as the cause


def test_truncated_gz_in_a_list_names_the_bad_file(tmp_path: Path) -> None:
    good = write_synthetic_criteo(tmp_path / "day_0.tsv.gz", num_lines=300, seed=0)
    (tmp_path / "bad").mkdir()
    bad = _truncated_gz(tmp_path / "bad", 20_000, 0.5)
    yielded = 0
    with pytest.raises(OSError, match=re.escape(str(bad))) as caught:
        for batch in CriteoDataset([good, bad], batch_size=1):
            yielded += batch.batch_size
    assert str(good) not in str(caught.value)
    rows_of_bad = int(re.search(r"after ([\d,]+) rows", str(caught.value)).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert yielded == 300 + rows_of_bad  # the count is of the bad file's rows, not the whole list's
