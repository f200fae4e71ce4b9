"""Admission and eviction policies of an id table.

Policies are small frozen dataclasses that only describe *what* to do; :class:`~recsdk.embedding.IdTable`
does the work. They are given per table, through
:class:`~recsdk.embedding.HashEmbeddingBagConfig` or directly to ``IdTable``.

* :class:`CountAdmission`: an id gets a row only once it has been seen ``threshold`` times.
* :class:`LRUEviction`, :class:`LFUEviction`, :class:`TTLEviction`: which rows to free when the
  table is full (TTL also frees rows that have been idle too long).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CountAdmission",
    "EvictionPolicy",
    "LFUEviction",
    "LRUEviction",
    "TTLEviction",
]


def _check_int(owner: str, field: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{field} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{owner}.{field} must be {allowed}, got {value}")


@dataclass(frozen=True)
class CountAdmission:
    """Admit an id (give it a row) only once it has been seen ``threshold`` times.

    Until then the id looks up as zeros and its embedding receives no update. An id is counted
    at most once per ``find_or_insert`` call (one call is one training step), so the result does
    not depend on whether the caller deduplicated the batch first.

    Counting uses a count-min sketch with conservative update: ``num_hashes`` rows of
    ``counter_slots // num_hashes`` int32 counters, each id hashed to one counter per row; the
    estimate is the minimum over its counters. Memory is bounded by ``4 * counter_slots`` bytes
    whatever the number of distinct ids. The estimate never undercounts, so an id seen
    ``threshold`` times is always admitted; when many ids share counters an id can be admitted
    earlier than its true count (the more ids per counter, the likelier). Counters saturate at
    ``threshold``. An admitted id that is later evicted keeps its count, so it is re-admitted at
    once when it comes back.

    Args:
        threshold (int): number of sightings before an id is admitted; ``1`` admits at once.
        counter_slots (int): total number of counters (memory is ``4 * counter_slots`` bytes).
        num_hashes (int): number of sketch rows (hash functions), 1 to 8.

    Example::

        CountAdmission(threshold=3, counter_slots=1 << 22)
    """

    threshold: int
    counter_slots: int = 1 << 20
    num_hashes: int = 2

    def __post_init__(self) -> None:
        _check_int("CountAdmission", "threshold", self.threshold, 1, 2**31 - 1)
        _check_int("CountAdmission", "num_hashes", self.num_hashes, 1, 8)
        _check_int("CountAdmission", "counter_slots", self.counter_slots, self.num_hashes, 2**40)

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the counters (0 when ``threshold == 1``: nothing is counted)."""
        return 0 if self.threshold == 1 else 4 * (self.counter_slots // self.num_hashes) * self.num_hashes


@dataclass(frozen=True)
class LRUEviction:
    """When the table is full, free the least recently used rows (ties: lowest row first)."""


@dataclass(frozen=True)
class LFUEviction:
    """When the table is full, free the least frequently used rows.

    Frequency is the number of ``find_or_insert`` calls (steps) in which the row's id appeared.
    Ties go to the least recently used row, then to the lowest row.
    """


@dataclass(frozen=True)
class TTLEviction:
    """Free rows idle for more than ``max_idle_steps`` steps; when full, free the least recently used.

    A row used at step ``s`` is freed by the first ``find_or_insert`` call at a step greater than
    ``s + max_idle_steps`` (or by an explicit ``IdTable.evict_idle()``), unless it is pinned.

    Args:
        max_idle_steps (int): steps a row may stay unused before it is freed, >= 1.
    """

    max_idle_steps: int

    def __post_init__(self) -> None:
        _check_int("TTLEviction", "max_idle_steps", self.max_idle_steps, 1, 2**31 - 1)


EvictionPolicy = LRUEviction | LFUEviction | TTLEviction
EVICTION_POLICY_TYPES = (LRUEviction, LFUEviction, TTLEviction)


def check_policies(where: str, admission: object, eviction: object) -> None:
    """Raise ``TypeError`` naming ``where`` unless the policies are of known types (or None).

    Shared by :class:`~recsdk.embedding.HashEmbeddingBagConfig` and :class:`~recsdk.embedding.IdTable`.
    """
    if admission is not None and not isinstance(admission, CountAdmission):
        raise TypeError(f"{where}: admission must be a CountAdmission or None, got {type(admission).__name__}")
    if eviction is not None and not isinstance(eviction, EVICTION_POLICY_TYPES):
        raise TypeError(
            f"{where}: eviction must be LRUEviction, LFUEviction, TTLEviction or None, got {type(eviction).__name__}"
        )
