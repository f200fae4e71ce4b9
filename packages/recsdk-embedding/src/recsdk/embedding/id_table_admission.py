"""``IdTableAdmission``: which of a batch's ids without a row an :class:`~recsdk.embedding.IdTable` admits.

Count admission (a count-min sketch of sightings per step), score admission (a sketch of
show/click scores, :mod:`~recsdk.embedding.id_table_scores`) and probabilistic admission (a hash
draw per id and step, :func:`~recsdk.embedding.hashing.uniform_draws`): the read-only decision
made before a step changes anything, and the counting done when it commits. Also the per-id
clicks a step takes, checked, and :meth:`IdTableAdmission.scores`. A mixin of ``IdTable``: it
reads the table's own state; nothing outside the table does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from recsdk.embedding.hashing import uniform_draws
from recsdk.embedding.policies import ProbabilisticAdmission, ScoreAdmission

if TYPE_CHECKING:
    from recsdk.embedding.count_sketch import CountMinSketch
    from recsdk.embedding.id_table_scores import IdTableScores, StepUnits
    from recsdk.embedding.policies import AdmissionPolicy, EvictionPolicy

__all__ = ["IdTableAdmission"]


class IdTableAdmission:
    """Admission decisions and show/click inputs of an :class:`~recsdk.embedding.IdTable` (a mixin of it)."""

    if TYPE_CHECKING:  # the table's state and helpers this mixin reads (defined by IdTable)
        _name: str
        _device: torch.device
        _step: int
        _admission: AdmissionPolicy | None
        _eviction: EvictionPolicy | None
        _sketch: CountMinSketch | None
        _scores: IdTableScores | None

        def _as_ids(self, ids: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Size]: ...
        def _lookup(self, ids: torch.Tensor) -> torch.Tensor: ...

    def _admission_decision(
        self,
        uniq: torch.Tensor,
        counts: torch.Tensor | None,
        amounts: torch.Tensor | None,
        units: StepUnits | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Which distinct ids without a row this step admits (reads only).

        Args:
            uniq (torch.Tensor): int64 ``[u]`` distinct ids without a row.
            counts (torch.Tensor | None): their occurrences this step (probabilistic admission).
            amounts (torch.Tensor | None): their score amounts this step (score admission).
            units (StepUnits | None): this step's score units (score admission).

        Returns:
            tuple: bool ``admitted [u]`` (None: all), and the sketch positions and estimates the
            commit needs (None without a sketch).
        """
        if self._sketch is not None:
            positions = self._sketch.positions(uniq)
            estimate = self._sketch.estimate(positions)
            return estimate + 1 >= self._sketch.cap, positions, estimate
        if isinstance(self._admission, ScoreAdmission):
            assert self._scores is not None and units is not None and amounts is not None
            return self._scores.admit(uniq, amounts, units)
        if isinstance(self._admission, ProbabilisticAdmission):
            assert counts is not None
            return self._draw_admitted(uniq, counts, self._step + 1), None, None
        return None, None, None

    def _count_missing(
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
        elif isinstance(self._admission, ScoreAdmission):
            assert self._scores is not None and positions is not None and estimate is not None
            assert amounts is not None
            return self._scores.count(positions, estimate, amounts)
        return amounts

    def _draw_admitted(self, uniq: torch.Tensor, counts: torch.Tensor, step: int) -> torch.Tensor:
        """Probabilistic admission of distinct ids seen ``counts`` times at ``step``: a hash draw
        below ``1 - (1 - p) ** count`` (p per occurrence)."""
        assert isinstance(self._admission, ProbabilisticAdmission)
        p = self._admission.probability
        chance = 1.0 - torch.pow(torch.full_like(counts, 1.0 - p, dtype=torch.float64), counts.double())
        return uniform_draws(uniq, step, self._admission.seed) < chance

    def _as_clicks(self, clicks: torch.Tensor, n: int) -> torch.Tensor:
        where = f"IdTable '{self._name}'.find_or_insert"
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

    def scores(self, ids: torch.Tensor) -> torch.Tensor:
        """The show/click scores of ``ids`` at the current step (reads only).

        An id with a row has its row's score (with :class:`ScoreEviction`); an id without one, its
        admission sketch estimate (with :class:`ScoreAdmission`; an upper bound), else 0.

        Args:
            ids (torch.Tensor): int64 or int32 ids, any shape.

        Returns:
            torch.Tensor: float64 scores, same shape as ``ids``.

        Raises:
            ValueError: the table keeps no scores (neither policy is by score).
        """
        flat, shape = self._as_ids(ids, "scores")
        if self._scores is None:
            raise ValueError(
                f"IdTable '{self._name}' keeps no show/click scores: its admission ({self._admission}) and eviction "
                f"({self._eviction}) are not ScoreAdmission / ScoreEviction"
            )
        stored = torch.zeros(flat.numel(), dtype=torch.int64, device=self._device)
        rows = self._lookup(flat)
        has_row = rows >= 0
        if self._scores.rows is not None:
            stored[has_row] = self._scores.rows[rows[has_row]]
        sketch = self._scores.sketch
        if sketch is not None and bool((~has_row).any()):
            stored[~has_row] = sketch.estimate(sketch.positions(flat[~has_row]))
        return self._scores.true_scores(stored, self._step).view(shape)
