"""The checks an :class:`~recsdk.embedding.IdTable` makes of what its callers give it, at its public
boundary and before any state changes: its own arguments, ids, rows, clicks, and a table that holds
data at all (not one on the meta device). Each error names the table and the operation.

Example::

    flat, shape = checked_ids(ids, "IdTable 'user'.find", device)
    rows = checked_rows(rows, "IdTable 'user'.pin", capacity, device, allow_missing=True)
"""

from __future__ import annotations

import torch

from recsdk.embedding.row_states import MAX_CAPACITY

__all__ = ["check_table", "check_usable", "checked_clicks", "checked_ids", "checked_rows"]


def check_table(name: object, capacity: object) -> None:
    """Raise unless ``name`` is a non-empty str and ``capacity`` an int in ``[1, MAX_CAPACITY]``.

    Raises:
        TypeError: ``capacity`` is not an int.
        ValueError: an empty or non-str name, or a capacity out of range.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"IdTable name must be a non-empty str, got {name!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"IdTable '{name}': capacity must be an int, got {type(capacity).__name__}")
    if not 1 <= capacity <= MAX_CAPACITY:
        raise ValueError(f"IdTable '{name}': capacity must be in [1, {MAX_CAPACITY}], got {capacity}")


def check_usable(name: str, device: torch.device) -> None:
    """Raise ``RuntimeError`` for a table on the meta device (it holds no data)."""
    if device.type == "meta":
        raise RuntimeError(
            f"IdTable '{name}' lives on the meta device and holds no data; create it on a real device to look ids up"
        )


def checked_ids(ids: object, where: str, device: torch.device) -> tuple[torch.Tensor, torch.Size]:
    """Ids as int64 ``[n]`` on ``device``, and their shape.

    Args:
        ids (object): int64 or int32 ids (int32 are sign-extended), any shape.
        where (str): the operation, for errors (``"IdTable 'user'.find"``).
        device (torch.device): the table's device.

    Raises:
        TypeError: not a tensor, or another dtype.
    """
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{where}: ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{where}: ids must be int64 or int32, got {ids.dtype}")
    return ids.reshape(-1).to(device=device, dtype=torch.int64), ids.shape


def checked_rows(rows: object, where: str, capacity: int, device: torch.device, *, allow_missing: bool) -> torch.Tensor:
    """Rows as int64 ``[n]`` on ``device``, each in ``[0, capacity)`` (``[-1, capacity)`` with
    ``allow_missing``).

    Raises:
        TypeError: not an integer tensor.
        ValueError: a row out of range (the first one is named).
    """
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{where}: rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
        raise TypeError(f"{where}: rows must be an integer tensor, got {rows.dtype}")
    flat = rows.reshape(-1).to(device=device, dtype=torch.int64)
    low = -1 if allow_missing else 0
    lo, hi = torch.aminmax(flat) if flat.numel() else (low, low)  # one pass; the bad value sought if any
    if int(lo) < low or int(hi) >= capacity:
        bad = (flat < low) | (flat >= capacity)
        raise ValueError(f"{where}: rows must be in [{low}, {capacity}), got {int(flat[bad][0])}")
    return flat


def checked_clicks(clicks: object, n: int, where: str) -> torch.Tensor:
    """The clicks of a step's ``n`` ids, flattened, checked (floating point, finite, >= 0).

    Args:
        clicks (object): what the caller gave (a tensor of ``n`` elements).
        n (int): the step's ids.
        where (str): the operation, for errors (``"IdTable 'user'.find_or_insert"``).

    Raises:
        TypeError, ValueError: naming ``where``.
    """
    if not isinstance(clicks, torch.Tensor):
        raise TypeError(f"{where}: clicks must be a torch.Tensor or None, got {type(clicks).__name__}")
    if not clicks.is_floating_point():
        raise TypeError(f"{where}: clicks must be floating point (one per id), got {clicks.dtype}")
    flat = clicks.reshape(-1)
    if flat.numel() != n:
        raise ValueError(f"{where}: {flat.numel()} clicks for {n} ids; give one per id")
    if n and not bool(torch.isfinite(flat).all() & (flat >= 0).all()):
        bad = flat[~(torch.isfinite(flat) & (flat >= 0))][0]
        raise ValueError(f"{where}: clicks must be finite and >= 0, got {float(bad)}")
    return flat
