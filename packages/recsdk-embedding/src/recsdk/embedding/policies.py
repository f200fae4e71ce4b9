"""Admission and eviction policies of an id table.

Policies are small frozen dataclasses that only describe *what* to do; :class:`~recsdk.embedding.IdTable`
does the work. They are given per table, through
:class:`~recsdk.embedding.HashEmbeddingBagConfig` or directly to ``IdTable``.

* :class:`CountAdmission`: an id gets a row only once it has been seen ``threshold`` times.
* :class:`ScoreAdmission`: an id gets a row once its show/click score reaches a threshold.
* :class:`ProbabilisticAdmission`: an unseen id gets a row with probability ``p`` at each occurrence.
* :class:`LRUEviction`, :class:`LFUEviction`, :class:`TTLEviction`: which rows to free when the
  table is full (TTL also frees rows that have been idle too long).
* :class:`ScoreEviction`: free the lowest-scored fraction of the ids when the table is full (and,
  if set, every N steps).

The show/click score (:class:`ShowClickScore`) needs the clicks of each id: they come as the
sparse features' per-id weights (``recsdk.data.Batch.with_clicks()``), see
:class:`ShowClickScore`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "AdmissionPolicy",
    "CountAdmission",
    "EvictionPolicy",
    "LFUEviction",
    "LRUEviction",
    "ProbabilisticAdmission",
    "ScoreAdmission",
    "ScoreEviction",
    "ShowClickScore",
    "TTLEviction",
]


def _check_int(owner: str, field: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{field} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{owner}.{field} must be {allowed}, got {value}")


def _check_float(owner: str, field: str, value: object, low: float, high: float, *, open_low: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{owner}.{field} must be a float, got {type(value).__name__} {value!r}")
    ok = math.isfinite(value) and (value > low if open_low else value >= low) and value <= high
    if not ok:
        bracket = "(" if open_low else "["
        raise ValueError(f"{owner}.{field} must be a finite number in {bracket}{low}, {high}], got {value}")


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


@dataclass(frozen=True)
class ShowClickScore:
    """How an id's score is made of its shows and clicks: ``score = alpha * show + beta * click``.

    ``show`` is the number of occurrences of the id in training batches, ``click`` the sum of the
    clicks that came with them: the id's per-occurrence weight in the sparse features, which
    ``recsdk.data.Batch.with_clicks()`` sets to the sample's label (so an occurrence in a sample
    with a positive label counts one click). Both decay by ``decay`` **per step** (one
    ``find_or_insert`` call of the table, one training batch): after ``k`` steps without the id an
    occurrence weighs ``decay ** k``.

    Scores are kept exactly enough to be reproducible: each occurrence adds
    ``alpha * u`` and ``beta * u * click``, each rounded to an integer, with
    ``u = 2**16 * decay ** -(step - ref)``, to an int64 (integer sums do not depend on the order
    ids arrive in, so every rank and every sharding makes the same decisions), with ``ref`` moved
    forward (all scores rescaled, rounded) whenever ``u`` passes ``2**36``
    (:mod:`~recsdk.embedding.id_table_scores`). Checkpoints keep the stored values and their reference step, so a
    resumed table continues bit for bit.

    Args:
        alpha (float): weight of a show, >= 0.
        beta (float): weight of a click, >= 0 (0: the score counts shows only and needs no clicks).
        decay (float): factor per step, in (0, 1]; 1 never decays.

    Example::

        ShowClickScore(alpha=1.0, beta=20.0, decay=0.999)
    """

    alpha: float = 1.0
    beta: float = 1.0
    decay: float = 1.0

    def __post_init__(self) -> None:
        _check_float("ShowClickScore", "alpha", self.alpha, 0.0, 1e6, open_low=False)
        _check_float("ShowClickScore", "beta", self.beta, 0.0, 1e6, open_low=False)
        _check_float("ShowClickScore", "decay", self.decay, 0.0, 1.0, open_low=True)
        if self.alpha == 0 and self.beta == 0:
            raise ValueError("ShowClickScore: alpha and beta are both 0, so every score would be 0; set one > 0")

    @property
    def needs_clicks(self) -> bool:
        """Whether the score reads clicks (``beta > 0``)."""
        return self.beta > 0


@dataclass(frozen=True)
class ScoreAdmission:
    """Admit an id (give it a row) once its show/click score reaches ``threshold``.

    Until then the id looks up as zeros and receives no update. The scores of ids without a row
    are kept in a count-min sketch with conservative update (``num_hashes`` rows of
    ``counter_slots // num_hashes`` int64 counters, so ``8 * counter_slots`` bytes); its estimate
    never undercounts, so an id whose score reached the threshold is always admitted (one that
    shares counters with others may be admitted earlier). An admitted id's row starts with that
    estimate; an evicted id keeps its sketch score, decaying, so it comes back sooner.

    Args:
        threshold (float): the score an id needs, > 0.
        score (ShowClickScore): how shows and clicks make the score (the table's
            :class:`ScoreEviction`, if any, must use the same).
        counter_slots (int): total number of sketch counters.
        num_hashes (int): sketch rows (hash functions), 1 to 8.

    Example::

        ScoreAdmission(threshold=3.0, score=ShowClickScore(alpha=1.0, beta=10.0, decay=0.99))
    """

    threshold: float
    score: ShowClickScore = field(default_factory=ShowClickScore)
    counter_slots: int = 1 << 20
    num_hashes: int = 2

    def __post_init__(self) -> None:
        _check_float("ScoreAdmission", "threshold", self.threshold, 0.0, 1e15, open_low=True)
        if not isinstance(self.score, ShowClickScore):
            raise TypeError(f"ScoreAdmission.score must be a ShowClickScore, got {type(self.score).__name__}")
        _check_int("ScoreAdmission", "num_hashes", self.num_hashes, 1, 8)
        _check_int("ScoreAdmission", "counter_slots", self.counter_slots, self.num_hashes, 2**40)

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the sketch's counters."""
        return 8 * (self.counter_slots // self.num_hashes) * self.num_hashes


@dataclass(frozen=True)
class ProbabilisticAdmission:
    """Admit an id without a row with probability ``probability`` at each of its occurrences.

    The draw is a hash of (id, the table's step, ``seed``), not a random generator: an id that
    occurs ``k`` times in a step is admitted when ``u < 1 - (1 - probability) ** k`` for its
    ``u`` in [0, 1), the same on every rank, after a resume (the step is checkpointed) and under
    any sharding. Keeps no per-id state: an evicted id is unseen again.

    Args:
        probability (float): per occurrence, in (0, 1].
        seed (int): varies the draws, in [0, 2**63).

    Example::

        ProbabilisticAdmission(probability=0.25, seed=7)
    """

    probability: float
    seed: int = 0

    def __post_init__(self) -> None:
        _check_float("ProbabilisticAdmission", "probability", self.probability, 0.0, 1.0, open_low=True)
        _check_int("ProbabilisticAdmission", "seed", self.seed, 0, 2**63 - 1)


@dataclass(frozen=True)
class ScoreEviction:
    """Free the lowest-scored ids: ``evict_fraction`` of the stored ids when the table is full (at
    least as many as the new ids need) and, with ``every_steps``, every that many steps.

    Rows pinned or used by the batch at hand are never freed; ties go to the lowest row. The
    score is the table's :class:`ShowClickScore` (decayed per step), kept per row.

    Args:
        evict_fraction (float): share of the stored ids freed per eviction round, in (0, 1].
        every_steps (int | None): also evict every this many steps (None: only when full).
        score (ShowClickScore): how shows and clicks make the score (the same as the table's
            :class:`ScoreAdmission`, if any).

    Example::

        ScoreEviction(evict_fraction=0.05, score=ShowClickScore(beta=10.0, decay=0.99))
    """

    evict_fraction: float = 0.1
    every_steps: int | None = None
    score: ShowClickScore = field(default_factory=ShowClickScore)

    def __post_init__(self) -> None:
        _check_float("ScoreEviction", "evict_fraction", self.evict_fraction, 0.0, 1.0, open_low=True)
        if self.every_steps is not None:
            _check_int("ScoreEviction", "every_steps", self.every_steps, 1, 2**31 - 1)
        if not isinstance(self.score, ShowClickScore):
            raise TypeError(f"ScoreEviction.score must be a ShowClickScore, got {type(self.score).__name__}")


AdmissionPolicy = CountAdmission | ScoreAdmission | ProbabilisticAdmission
ADMISSION_POLICY_TYPES = (CountAdmission, ScoreAdmission, ProbabilisticAdmission)
EvictionPolicy = LRUEviction | LFUEviction | TTLEviction | ScoreEviction
EVICTION_POLICY_TYPES = (LRUEviction, LFUEviction, TTLEviction, ScoreEviction)


def score_of(admission: object, eviction: object) -> ShowClickScore | None:
    """The table's show/click score: its :class:`ScoreAdmission`'s or :class:`ScoreEviction`'s (None: neither)."""
    for policy in (admission, eviction):
        if isinstance(policy, ScoreAdmission | ScoreEviction):
            return policy.score
    return None


def check_policies(where: str, admission: object, eviction: object) -> None:
    """Raise ``TypeError`` naming ``where`` unless the policies are of known types (or None).

    Shared by :class:`~recsdk.embedding.HashEmbeddingBagConfig` and :class:`~recsdk.embedding.IdTable`.

    Raises:
        TypeError: an unknown policy type.
        ValueError: a :class:`ScoreAdmission` and a :class:`ScoreEviction` with different scores.
    """
    if admission is not None and not isinstance(admission, ADMISSION_POLICY_TYPES):
        raise TypeError(
            f"{where}: admission must be CountAdmission, ScoreAdmission, ProbabilisticAdmission or None, "
            f"got {type(admission).__name__}"
        )
    if eviction is not None and not isinstance(eviction, EVICTION_POLICY_TYPES):
        raise TypeError(
            f"{where}: eviction must be LRUEviction, LFUEviction, TTLEviction, ScoreEviction or None, "
            f"got {type(eviction).__name__}"
        )
    if isinstance(admission, ScoreAdmission) and isinstance(eviction, ScoreEviction):
        if admission.score != eviction.score:
            raise ValueError(
                f"{where}: admission and eviction must score ids the same way, got admission.score="
                f"{admission.score} and eviction.score={eviction.score}"
            )
