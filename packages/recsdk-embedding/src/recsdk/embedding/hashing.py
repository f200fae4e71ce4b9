"""A 64-bit integer mixer on torch tensors, used to place ids in the id table and the sketch.

The mixer is MurmurHash3's ``fmix64`` finaliser applied to ``id ^ salt``, computed with int64
wraparound arithmetic (logical right shifts are emulated with a mask), so it runs on any device
torch supports and gives the same values everywhere.

The salts are what keep different uses of the mixer unrelated: ``recsdk.sharding.owner`` picks an
id's rank with this same ``fmix64`` salted with ``OWNER_SALT`` (reduced modulo the world size), and
the id table hashes slots with :data:`TABLE_SALT`, and probabilistic admission draws with
:func:`uniform_draws`. Were the salts equal, the ids owned by one rank
would share the low bits of their slot hash and crowd that rank's table. (``recsdk.data``'s
SplitMix64 ``mix64`` only generates synthetic ids; it plays no part in placement.)
"""

from __future__ import annotations

import torch

__all__ = ["TABLE_SALT", "fmix64", "fmix64_reference", "uniform_draws"]

_C1 = 0xFF51AFD7ED558CCD - (1 << 64)
_C2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_LOW31 = (1 << 31) - 1  # (x >> 33) & _LOW31 is the logical shift of an int64 by 33
TABLE_SALT = 0x5BD1E9955BD1E995
_DRAW_SALT = 0x2F8A3C61D4B7E905
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_MANTISSA = (1 << 53) - 1


def _signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def fmix64(ids: torch.Tensor, salt: int | torch.Tensor = TABLE_SALT) -> torch.Tensor:
    """Mix int64 values: ``fmix64(ids ^ salt)`` with 64-bit wraparound.

    Args:
        ids (torch.Tensor): int64 tensor, any shape.
        salt (int | torch.Tensor): a signed 64-bit constant xored in first (different salts give
            unrelated hashes); or an int64 tensor of salts that broadcasts with ``ids`` (several
            hashes of the ids in one pass: salts ``[k, 1]`` and ids ``[n]`` give ``[k, n]``).

    Returns:
        torch.Tensor: int64 tensor of the broadcast shape; a bijection of the 64-bit integers for
        a given salt.

    Example::

        slots = fmix64(ids) & (num_slots - 1)
    """
    h = torch.bitwise_xor(ids, salt)
    for mult in (_C1, _C2):
        h.bitwise_xor_(torch.bitwise_right_shift(h, 33).bitwise_and_(_LOW31))
        h.mul_(mult)
    h.bitwise_xor_(torch.bitwise_right_shift(h, 33).bitwise_and_(_LOW31))
    return h


def fmix64_reference(value: int, salt: int = TABLE_SALT) -> int:
    """Pure-Python :func:`fmix64` of one signed 64-bit value (for tests and documentation)."""
    mask = (1 << 64) - 1
    h = (value ^ salt) & mask
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & mask
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & mask
    h ^= h >> 33
    return h - (1 << 64) if h >= 1 << 63 else h


def uniform_draws(ids: torch.Tensor, step: int, seed: int) -> torch.Tensor:
    """One draw in ``[0, 1)`` per id, a function of (id, step, seed) only: the same on every rank,
    device and run (probabilistic admission decides with it).

    Args:
        ids (torch.Tensor): int64 ``[n]``.
        step (int): the table's step (>= 0).
        seed (int): the policy's seed.

    Returns:
        torch.Tensor: float64 ``[n]``, 53 random bits each.
    """
    key = torch.bitwise_xor(ids, _signed64(step * _GOLDEN))
    h = fmix64(key, _signed64(seed ^ _DRAW_SALT))
    return torch.bitwise_right_shift(h, 11).bitwise_and_(_MANTISSA).double().mul_(2.0**-53)
