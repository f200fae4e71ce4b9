"""``IdTableAdmission``: which of a batch's ids without a row an :class:`~recsdk.embedding.IdTable` admits.

Count admission (a count-min sketch of sightings per step), score admission (a sketch of
show/click scores, kept by :mod:`~recsdk.embedding.id_table_scores`) and probabilistic admission
(a hash draw per id and step, :func:`~recsdk.embedding.hashing.uniform_draws`): the read-only
decision made before a step changes anything (:meth:`IdTableAdmission.decide`), and the counting
done when it commits (:meth:`IdTableAdmission.count`). A part of ``IdTable``: it owns the count
sketch and calls the scores part.
"""

from __future__ import annotations

import torch

from recsdk.embedding.count_sketch import CountMinSketch
from recsdk.embedding.hashing import uniform_draws
from recsdk.embedding.id_table_scores import IdTableScores, StepUnits
from recsdk.embedding.policies import AdmissionPolicy, CountAdmission, ProbabilisticAdmission, ScoreAdmission

__all__ = ["IdTableAdmission"]


class IdTableAdmission:
    """Admission decisions and counts of one id table.

    Args:
        policy (AdmissionPolicy | None): the table's admission policy (None: admit at once).
        scores (IdTableScores | None): the table's show/click scores (score admission).
        device (torch.device): where the count sketch lives.

    Example::

        admitted, positions, estimate = admission.decide(uniq, counts, amounts, units, step + 1)
        ...  # nothing changed yet; once the step commits:
        start_scores = admission.count(positions, estimate, amounts)
    """

    def __init__(self, policy: AdmissionPolicy | None, scores: IdTableScores | None, device: torch.device) -> None:
        self._policy = policy
        self._scores = scores
        self._device = device
        self._sketch: CountMinSketch | None = None
        if isinstance(policy, CountAdmission) and policy.threshold > 1:
            width = policy.counter_slots // policy.num_hashes
            self._sketch = CountMinSketch(width, policy.num_hashes, policy.threshold, device)

    @property
    def needs_counts(self) -> bool:
        """Whether :meth:`decide` needs each id's occurrences (probabilistic admission)."""
        return isinstance(self._policy, ProbabilisticAdmission)

    @property
    def num_counters(self) -> int:
        """Counters of the count sketch (0 without one)."""
        return self._sketch.counters.numel() if self._sketch is not None else 0

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (for memory accounting; the score sketch is the scores part's)."""
        return [self._sketch.counters] if self._sketch is not None else []

    def reset(self) -> None:
        """Forget every count (a fresh table)."""
        if self._sketch is not None:
            self._sketch.counters.zero_()

    def counters(self) -> torch.Tensor:
        """The count sketch's counters (int32, a copy; empty without a sketch)."""
        if self._sketch is None:
            return torch.zeros(0, dtype=torch.int32, device=self._device)
        return self._sketch.counters.clone()

    def restore(self, counters: torch.Tensor) -> None:
        """Load :meth:`counters` values (``num_counters`` of them, checked)."""
        if self._sketch is not None:
            self._sketch.counters.copy_(counters.to(torch.int32))

    def decide(
        self,
        uniq: torch.Tensor,
        counts: torch.Tensor | None,
        amounts: torch.Tensor | None,
        units: StepUnits | None,
        step: int,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Which distinct ids without a row step ``step`` admits (reads only).

        Args:
            uniq (torch.Tensor): int64 ``[u]`` distinct ids without a row.
            counts (torch.Tensor | None): their occurrences this step (probabilistic admission).
            amounts (torch.Tensor | None): their score amounts this step (score admission).
            units (StepUnits | None): this step's score units (score admission).
            step (int): the step being made.

        Returns:
            tuple: bool ``admitted [u]`` (None: all), and the sketch positions and estimates
            :meth:`count` needs (None without a sketch).
        """
        if self._sketch is not None:
            positions, estimate = self._sketch.read(uniq)
            return estimate + 1 >= self._sketch.cap, positions, estimate
        if isinstance(self._policy, ScoreAdmission):
            assert self._scores is not None and units is not None and amounts is not None
            return self._scores.admit(uniq, amounts, units)
        if isinstance(self._policy, ProbabilisticAdmission):
            assert counts is not None
            return self._draw(uniq, counts, step), None, None
        return None, None, None

    def count(
        self, positions: torch.Tensor | None, estimate: torch.Tensor | None, amounts: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Count this step's distinct ids without a row in the admission sketch (commit part).

        Returns:
            torch.Tensor | None: the stored score each new row starts at (score eviction): the
            sketch's new estimate under score admission, else this step's amounts.
        """
        if self._sketch is not None:
            assert positions is not None and estimate is not None
            self._sketch.add_one(positions, estimate)
        elif isinstance(self._policy, ScoreAdmission):
            assert self._scores is not None and positions is not None and estimate is not None
            assert amounts is not None
            return self._scores.count(positions, estimate, amounts)
        return amounts

    def _draw(self, uniq: torch.Tensor, counts: torch.Tensor, step: int) -> torch.Tensor:
        """Probabilistic admission of distinct ids seen ``counts`` times at ``step``: a hash draw
        below ``1 - (1 - p) ** count`` (p per occurrence)."""
        assert isinstance(self._policy, ProbabilisticAdmission)
        p = self._policy.probability
        chance = 1.0 - torch.pow(torch.full_like(counts, 1.0 - p, dtype=torch.float64), counts.double())
        return uniform_draws(uniq, step, self._policy.seed) < chance
