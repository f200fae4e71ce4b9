import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from recsdk.data import hash_string, hash_strings, mix64, unmix64

MASK = (1 << 64) - 1


def _splitmix64_finaliser(x: int) -> int:
    """An independent, pure-Python SplitMix64 finaliser on Python ints."""
    z = x & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


def test_mix64_matches_reference_and_inverts() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 1000, dtype=np.int64),
            np.array([0, 1, -1, np.iinfo(np.int64).min, np.iinfo(np.int64).max], dtype=np.int64),
        ]
    )
    mixed = mix64(x)
    assert mixed.dtype == np.int64
    assert mixed.tolist() == [_splitmix64_finaliser(int(v)) for v in x]
    assert np.array_equal(unmix64(mixed), x)
    assert np.array_equal(mix64(unmix64(x)), x)


def test_mix64_spreads_small_indices_over_int64() -> None:
    ids = mix64(np.arange(1, 10_001))
    assert np.unique(ids).size == 10_000
    assert (ids < 0).mean() == pytest.approx(0.5, abs=0.03)
    assert np.abs(ids).min() > 2**40  # none stays small


def test_mix64_accepts_uint64_and_rejects_floats() -> None:
    assert mix64(np.array([2**64 - 1], dtype=np.uint64)).tolist() == mix64(np.array([-1])).tolist()
    with pytest.raises(TypeError, match="integer array, got dtype float64"):
        mix64(np.array([1.5]))


def test_hash_string_is_pinned() -> None:
    # These values must never change: they are the ids stored in trained tables.
    assert hash_string("a") == 3405396810240292928
    assert hash_string("") == int.from_bytes(bytes.fromhex("e4a6a0577479b2b4"), "little", signed=True)
    assert hash_string("用户:42") == hash_strings(["用户:42"])[0]
    with pytest.raises(TypeError, match="expects a str, got int"):
        hash_string(5)  # type: ignore[arg-type]


def test_hash_strings_matches_hash_string_with_repeats() -> None:
    values = ["x", "y", "x", "", "é", "y", "x"]
    got = hash_strings(values)
    assert got.dtype == np.int64
    assert got.tolist() == [hash_string(v) for v in values]
    assert hash_strings(pa.chunked_array([["x"], ["y", "x"]])).tolist() == [hash_string(v) for v in "xyx"]
    assert hash_strings([]).shape == (0,)


def test_hash_strings_rejects_nulls_and_non_strings() -> None:
    with pytest.raises(ValueError, match="1 null values"):
        hash_strings(pa.array(["a", None]))
    with pytest.raises(TypeError, match="expects strings, got Arrow type int64"):
        hash_strings(pa.array([1, 2]))


def test_hash_is_the_same_in_another_process() -> None:
    code = "from recsdk.data import hash_string; print(hash_string('user:42'))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) == hash_string("user:42")
