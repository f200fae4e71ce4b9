"""Random building blocks shared by the synthetic datasets (private)."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from recsdk.data.hashing import mix64


def seed_words(seed: int, tag: int, count: int) -> npt.NDArray[np.uint64]:
    """``count`` 64-bit words derived from ``(seed, tag)`` only."""
    state = np.random.SeedSequence([seed, tag]).generate_state(2 * count, dtype=np.uint32).astype(np.uint64)
    return (state[0::2] << np.uint64(32)) | state[1::2]


def gaussian_from_hash(h: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """Box-Muller on the two 32-bit halves of each 64-bit hash: one N(0, 1) value per hash."""
    u = h.view(np.uint64)
    hi = (u >> np.uint64(32)).astype(np.float64)
    lo = (u & np.uint64(0xFFFFFFFF)).astype(np.float64)
    u1 = (hi + 0.5) / 2.0**32  # in (0, 1)
    u2 = lo / 2.0**32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def scrambled_ids(indices: npt.NDArray[np.int64], salt: np.uint64) -> npt.NDArray[np.int64]:
    """Raw ids ``mix64(indices + salt)`` (the sum wraps modulo ``2**64``): distinct indices give distinct ids."""
    with np.errstate(over="ignore"):
        return mix64(indices.view(np.uint64) + salt)


def hash_gaussian(x: npt.NDArray[np.int64], salt: np.int64) -> npt.NDArray[np.float64]:
    """One N(0, 1) value per element, fixed by ``(x, salt)``: :func:`gaussian_from_hash` of ``mix64(x ^ salt)``."""
    return gaussian_from_hash(mix64(x ^ salt))


def power_law_indices(rng: np.random.Generator, n: int, id_range: int, alpha: float) -> npt.NDArray[np.int64]:
    """``n`` indices in ``[0, id_range)``: the floor of a density ``x ** -alpha`` on ``[1, id_range + 1)``, minus 1.

    A bounded, continuous approximation of Zipf(alpha) drawn by inverting its CDF; index 0
    is the most likely. :class:`~recsdk.data.RandomRecDataset` draws its ``"zipf"`` ids with it.

    Args:
        rng (np.random.Generator): the generator to draw from.
        n (int): how many indices.
        id_range (int): indices are in ``[0, id_range)``.
        alpha (float): the exponent (> 0; 1.0 is the classic Zipf).

    Returns:
        np.ndarray: int64 ``[n]``.

    Example::

        power_law_indices(np.random.default_rng(0), 4, 1000, 1.05)  # mostly small indices
    """
    u = rng.random(n)
    top = float(id_range) + 1.0
    if alpha == 1.0:
        x = np.exp(u * math.log(top))
    else:
        x = (1.0 + u * (top ** (1.0 - alpha) - 1.0)) ** (1.0 / (1.0 - alpha))
    return np.clip(np.floor(x) - 1.0, 0, id_range - 1).astype(np.int64)
