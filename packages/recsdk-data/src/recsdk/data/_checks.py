"""Argument checks shared by the datasets (private)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int within ``[minimum, maximum]``, or TypeError / ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else TypeError naming ``name`` (0 / 1 / strings are not bools)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_number(name: str, value: Any, *, minimum: float | None = None, strict: bool = False) -> float:
    """``value`` as a finite float ``>= minimum`` (``> minimum`` when ``strict``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}, got {value}")
    return float(value)


def check_choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return str(value)


def check_names(name: str, value: Any, *, allow_empty: bool = False) -> list[str]:
    """A list of distinct non-empty strings (a bare string is rejected)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of strings, got {type(value).__name__} {value!r}")
    names = list(value)
    if not names and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    for n in names:
        if not isinstance(n, str) or not n:
            raise ValueError(f"{name} must hold non-empty strings, got {n!r}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{name} must be distinct, got duplicates {dup}")
    return names


def check_paths(value: Any) -> list[Path]:
    """One path or a sequence of paths, each an existing file (FileNotFoundError naming it otherwise)."""
    if isinstance(value, (str, os.PathLike)):
        items: list[Any] = [value]
    elif isinstance(value, Sequence) and not isinstance(value, bytes):
        items = list(value)
    else:
        raise TypeError(f"paths must be a path or a sequence of paths, got {type(value).__name__}")
    if not items:
        raise ValueError("paths must name at least one file, got an empty sequence")
    paths = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"paths must hold str or os.PathLike, got {type(item).__name__} {item!r}")
        p = Path(item)
        if not p.is_file():
            raise FileNotFoundError(f"data file not found: {str(p)!r}")
        paths.append(p)
    return paths
