"""Stable 64-bit id functions: a bijective integer mixer and a string hash.

Both are pure functions of their input (no process or run dependence), so the same raw
value gives the same int64 id in every process, on every machine, in every run.

* :func:`mix64` is the SplitMix64 finaliser, a bijection of the 64-bit integers. It turns
  small structured integers (``0, 1, 2, ...``) into ids spread over the whole int64 range.
  :func:`unmix64` is its inverse.
* :func:`hash_strings` maps strings to int64 ids: the 8-byte BLAKE2b digest
  (``hashlib.blake2b(s.encode("utf-8"), digest_size=8)``) read as a signed little-endian
  int64.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["hash_string", "hash_strings", "mix64", "unmix64"]

_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_M1_INV = pow(_M1, -1, 1 << 64)
_M2_INV = pow(_M2, -1, 1 << 64)
_MASK = (1 << 64) - 1


def _as_uint64(x: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    arr = np.asarray(x)
    if arr.dtype == np.uint64:
        return arr.copy()
    if arr.dtype.kind not in "iu":
        raise TypeError(f"expected an integer array, got dtype {arr.dtype}")
    return arr.astype(np.int64).view(np.uint64)


def _xorshift_right_inverse(y: npt.NDArray[np.uint64], shift: int) -> npt.NDArray[np.uint64]:
    # y = x ^ (x >> s)  =>  x = y ^ (y >> s) ^ (y >> 2s) ^ ...
    x = y.copy()
    s = shift
    while s < 64:
        x ^= y >> np.uint64(s)
        s += shift
    return x


def mix64(x: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Bijectively scramble 64-bit integers (the SplitMix64 finaliser).

    Args:
        x (array-like of int): values, read as 64-bit two's complement.

    Returns:
        np.ndarray: int64 array of the same shape; distinct inputs give distinct outputs.

    Example::

        mix64(np.arange(3))  # three ids spread over the int64 range
    """
    z = _as_uint64(x)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(_M1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_M2)
        z ^= z >> np.uint64(31)
    return z.view(np.int64)


def unmix64(y: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The inverse of :func:`mix64`: ``unmix64(mix64(x)) == x``.

    Args:
        y (array-like of int): mixed values, read as 64-bit two's complement.

    Returns:
        np.ndarray: int64 array of the same shape.
    """
    z = _as_uint64(y)
    with np.errstate(over="ignore"):
        z = _xorshift_right_inverse(z, 31)
        z *= np.uint64(_M2_INV)
        z = _xorshift_right_inverse(z, 27)
        z *= np.uint64(_M1_INV)
        z = _xorshift_right_inverse(z, 30)
    return z.view(np.int64)


def hash_string(value: str) -> int:
    """The int64 id of one string: 8-byte BLAKE2b of its UTF-8 bytes, signed little-endian.

    Args:
        value (str): the raw feature value.

    Returns:
        int: a Python int in ``[-2**63, 2**63)``.

    Example::

        hash_string("user:42")  # the same int64 in every process and every run
    """
    if not isinstance(value, str):
        raise TypeError(f"hash_string expects a str, got {type(value).__name__}")
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def hash_strings(values: Iterable[str] | pa.Array | pa.ChunkedArray) -> npt.NDArray[np.int64]:
    """Hash many strings to int64 ids with :func:`hash_string`.

    Each distinct string is hashed once (an Arrow dictionary encoding finds them), so a
    column with repeated values costs one digest per distinct value.

    Args:
        values: strings (a Python iterable or an Arrow string array without nulls).

    Returns:
        np.ndarray: int64 ids, shape ``[len(values)]``.
    """
    arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(list(values), type=pa.string())
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        raise TypeError(f"hash_strings expects strings, got Arrow type {arr.type}")
    if arr.null_count:
        raise ValueError(f"hash_strings got {arr.null_count} null values; drop them first")
    if len(arr) == 0:
        return np.zeros(0, dtype=np.int64)
    encoded = pc.dictionary_encode(arr)
    uniques = encoded.dictionary.to_pylist()
    table = np.fromiter((hash_string(s) for s in uniques), dtype=np.int64, count=len(uniques))
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    return table[codes]
