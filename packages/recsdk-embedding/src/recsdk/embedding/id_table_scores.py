"""``IdTableScores``: the show/click scores an :class:`~recsdk.embedding.IdTable` keeps for its ids.

What :class:`~recsdk.embedding.ScoreAdmission` and :class:`~recsdk.embedding.ScoreEviction` need
per id, in one place (as :mod:`~recsdk.embedding.count_sketch` is for count admission):

* **Units.** A score is ``alpha * show + beta * click``, decayed by ``decay`` per step. Decaying
  every score at every step would cost a pass over the table per step, so scores are stored in
  the units of a reference step ``ref``: an occurrence at step ``t`` adds
  ``(alpha + beta * click) * decay ** -(t - ref)``, and the score at step ``t`` is the stored
  value times ``decay ** (t - ref)``. Stored values are int64 multiples of ``2**-16``: each
  occurrence's amount is rounded once, then integers are summed, so a score does not depend on
  the order in which its ids arrive (a sharded table and an unsharded one, any rank order, agree
  bit for bit). An amount is ``round(alpha * unit) + round(beta * unit * click)``, the product
  in float32: rounded the same way on every rank, whatever the order. When
  ``decay ** -(t - ref)`` passes ``2**20`` every stored value is rescaled to ``ref = t``
  (rounded; rare: every ``14 / -ln(decay)`` steps) at the end of a step.
* **Ids with a row** (only with :class:`ScoreEviction`): one int64 per row (``rows``), lazily
  resident like the table's other per-row arrays, plus a spare entry at index ``capacity`` that
  absorbs the amounts of ids without a row.
* **Ids without a row** (only with :class:`ScoreAdmission`): a count-min sketch of int64
  counters with conservative update; an admitted id's row starts with its estimate.
* **Checkpoints** hold the stored values as they are and their reference step (``score_ref``),
  so a resumed table continues bit for bit; a resharded load brings every shard's values to the
  newest reference step of the shards (identical when they agree, as they do when every rank
  maps every batch), then decays nothing else.

The table calls :meth:`step_units` in the read-only part of a step (it changes nothing),
:meth:`add_hits` / :meth:`admit` / :meth:`place` in the commit part, and :meth:`end_step` last.
"""

from __future__ import annotations

import torch

from recsdk.embedding.count_sketch import CountMinSketch
from recsdk.embedding.lazy_memory import lazy_zeros
from recsdk.embedding.policies import (
    AdmissionPolicy,
    EvictionPolicy,
    ScoreAdmission,
    ScoreEviction,
    ShowClickScore,
    score_of,
)

__all__ = ["SCORE_ONE", "IdTableScores", "StepUnits", "rebased"]

SCORE_ONE = float(1 << 16)
"""A score of 1.0 in stored units at the reference step (fixed point, 16 fraction bits)."""
_RESCALE_AT = 2.0**20
_SKETCH_CAP = 2**62  # far from int64 overflow whatever is added on top in one step


class StepUnits:
    """The units of one step: ``scale = decay ** -(step - ref)`` and the per-occurrence amounts.

    Attributes:
        scale (float): stored units per score unit at this step, divided by :data:`SCORE_ONE`.
        show (float): what one show adds, in stored units (before rounding).
        click (float): what one click adds, in stored units (before rounding).
    """

    def __init__(self, score: ShowClickScore, scale: float) -> None:
        self.scale = scale
        self.show = score.alpha * SCORE_ONE * scale
        self.click = score.beta * SCORE_ONE * scale

    def amounts(self, n: int, clicks: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """What each of ``n`` occurrences adds, int64 ``[n]``: ``round(show) + round(click * clicks[i])``,
        the product in float32 (elementwise: independent of the order of the ids)."""
        show = round(self.show)
        if clicks is None or self.click == 0:
            return torch.full((n,), show, dtype=torch.int64, device=device)
        return clicks.to(device=device, dtype=torch.float32).mul(self.click).round_().long().add_(show)


class IdTableScores:
    """Per-id show/click scores of one id table (see the module docstring).

    Args:
        score (ShowClickScore): how shows and clicks make the score.
        capacity (int): the table's rows.
        device (torch.device): where the scores live.
        admission (ScoreAdmission | None): keep the scores of ids without a row (a sketch).
        per_row (bool): keep the scores of ids with a row (score eviction).
    """

    def __init__(
        self,
        score: ShowClickScore,
        capacity: int,
        device: torch.device,
        *,
        admission: ScoreAdmission | None,
        per_row: bool,
    ) -> None:
        self.score = score
        self._capacity = capacity
        self._device = device
        self.rows: torch.Tensor | None = lazy_zeros(capacity + 1, torch.int64, device) if per_row else None
        self.sketch: CountMinSketch | None = None
        self.threshold: float | None = None
        if admission is not None:
            width = admission.counter_slots // admission.num_hashes
            self.sketch = CountMinSketch(width, admission.num_hashes, _SKETCH_CAP, device, dtype=torch.int64)
            self.threshold = admission.threshold
        self._ref = 0

    @classmethod
    def for_policies(
        cls,
        admission: AdmissionPolicy | None,
        eviction: EvictionPolicy | None,
        capacity: int,
        device: torch.device,
    ) -> IdTableScores | None:
        """The scores a table with these policies keeps: None unless one of them is by score (or on
        the meta device); the sketch with :class:`ScoreAdmission`, per-row scores with
        :class:`ScoreEviction`."""
        score = score_of(admission, eviction)
        if score is None or device.type == "meta":
            return None
        score_admission = admission if isinstance(admission, ScoreAdmission) else None
        return cls(score, capacity, device, admission=score_admission, per_row=isinstance(eviction, ScoreEviction))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (for memory accounting)."""
        return [t for t in (self.rows, None if self.sketch is None else self.sketch.counters) if t is not None]

    @property
    def num_counters(self) -> int:
        """Counters of the admission sketch (0 without one)."""
        return 0 if self.sketch is None else self.sketch.counters.numel()

    def step_units(self, step: int) -> StepUnits:
        """The units of step ``step`` (reads only)."""
        decay = self.score.decay
        return StepUnits(self.score, 1.0 if decay == 1.0 else decay ** -(step - self._ref))

    def add_hits(self, used: torch.Tensor, amounts: torch.Tensor) -> None:
        """Add each occurrence's amount to its row (``used``: rows, ``capacity`` for ids without one)."""
        if self.rows is not None:
            self.rows.index_add_(0, used, amounts)

    def admit(
        self, uniq: torch.Tensor, amounts: torch.Tensor, units: StepUnits
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which distinct ids without a row reach the threshold this step (reads only).

        Args:
            uniq (torch.Tensor): int64 ``[u]`` distinct ids without a row.
            amounts (torch.Tensor): int64 ``[u]`` what this step adds to each.
            units (StepUnits): this step's units.

        Returns:
            tuple[torch.Tensor, torch.Tensor, torch.Tensor]: bool ``admitted [u]``, and the sketch
            positions and estimates (for :meth:`count`).
        """
        assert self.sketch is not None and self.threshold is not None
        positions, estimate = self.sketch.read(uniq)
        admitted = (estimate + amounts).double() >= self.threshold * SCORE_ONE * units.scale
        return admitted, positions, estimate

    def count(self, positions: torch.Tensor, estimate: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
        """Add this step's amounts of distinct ids (their sketch ``estimate`` before) to the sketch;
        returns their new estimates."""
        assert self.sketch is not None
        return self.sketch.add(positions, estimate, amounts)

    def place(self, rows: torch.Tensor, scores: torch.Tensor) -> None:
        """Rows just handed to ids start with ``scores`` (stored units)."""
        if self.rows is not None:
            self.rows[rows] = scores

    def end_step(self, step: int, high_water: int) -> None:
        """Move the reference step to ``step`` once the scale passed ``2**20`` (rescales every score)."""
        decay = self.score.decay
        if decay == 1.0 or decay ** -(step - self._ref) <= _RESCALE_AT:
            return
        self._rescale(decay ** (step - self._ref), high_water)
        self._ref = step

    def eviction_key(self, high_water: int) -> torch.Tensor:
        """The stored scores of rows ``[0, high_water)`` (a copy, for ranking victims)."""
        assert self.rows is not None
        return self.rows[:high_water].clone()

    def true_scores(self, stored: torch.Tensor, step: int) -> torch.Tensor:
        """Stored values as scores at ``step`` (float64)."""
        return stored.double() / (SCORE_ONE * self.step_units(step).scale)

    @property
    def per_row(self) -> bool:
        """Whether the scores of ids with a row are kept (score eviction)."""
        return self.rows is not None

    def of(self, ids: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        """The scores at ``step`` (float64 ``[n]``) of int64 ``ids [n]`` whose rows are ``rows [n]``
        (``-1``: none): a row's score (with score eviction), else the sketch's estimate (with score
        admission; an upper bound), else 0. Reads only."""
        stored = torch.zeros(ids.numel(), dtype=torch.int64, device=self._device)
        has_row = rows >= 0
        if self.rows is not None:
            stored[has_row] = self.rows[rows[has_row]]
        if self.sketch is not None and bool((~has_row).any()):
            stored[~has_row] = self.sketch.read(ids[~has_row])[1]
        return self.true_scores(stored, step)

    def of_rows(self, rows: torch.Tensor, step: int) -> torch.Tensor:
        """The scores at ``step`` (float64) of the ids at ``rows`` (score eviction). Reads only."""
        assert self.rows is not None
        return self.true_scores(self.rows[rows], step)

    def totals(self, rows: torch.Tensor, step: int) -> dict[str, float]:
        """``score_sum`` and ``score_min`` at ``step`` of the ids at ``rows`` (score eviction; 0.0
        when ``rows`` is empty). Reads only."""
        scores = self.of_rows(rows, step)
        empty = not rows.numel()
        return {"score_sum": 0.0 if empty else float(scores.sum()), "score_min": 0.0 if empty else float(scores.min())}

    def reset(self) -> None:
        """Forget every score (a fresh table)."""
        if self.sketch is not None:
            self.sketch.counters.zero_()
        self._ref = 0

    # ------------------------------------------------------------------ state

    def state(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``scores`` (of ``rows``), ``score_counters`` (stored units) and their ``score_ref`` step."""
        empty = torch.zeros(0, dtype=torch.int64, device=self._device)
        scores = empty if self.rows is None else self.rows[rows].clone()
        counters = empty if self.sketch is None else self.sketch.counters.clone()
        return {"scores": scores, "score_counters": counters, "score_ref": torch.tensor(self._ref, dtype=torch.int64)}

    def check_state(
        self, where: str, num_ids: int, scores: torch.Tensor, counters: torch.Tensor, ref: int, step: int
    ) -> None:
        """Raise ``ValueError`` naming ``where`` unless the values fit this table (changes nothing)."""
        if not 0 <= ref <= step:
            raise ValueError(f"{where}: score_ref {ref} must be in [0, step {step}]")
        have = num_ids if self.rows is not None else 0
        if scores.numel() != have:
            raise ValueError(f"{where}: {scores.numel()} scores given, this table's score eviction needs {have}")
        if counters.numel() != self.num_counters:
            raise ValueError(
                f"{where}: {counters.numel()} score counters given, this table's ScoreAdmission has {self.num_counters}"
            )
        for key, value in (("scores", scores), ("score_counters", counters)):
            if value.numel() and (value.is_floating_point() or bool((value < 0).any())):
                raise ValueError(f"{where}: {key} must be non-negative integers (fixed point)")

    def restore(self, rows: torch.Tensor, scores: torch.Tensor, counters: torch.Tensor, ref: int) -> None:
        """Load :meth:`state` values in the units of step ``ref`` (after :meth:`check_state`)."""
        self._ref = ref
        if self.rows is not None and rows.numel():
            self.rows[rows] = scores.to(device=self._device, dtype=torch.int64)
        if self.sketch is not None:
            self.sketch.counters.copy_(counters.to(torch.int64))

    def _rescale(self, factor: float, high_water: int) -> None:
        if self.rows is not None:
            self.rows[:high_water] = _scaled(self.rows[:high_water], factor)
        if self.sketch is not None:
            self.sketch.counters.copy_(_scaled(self.sketch.counters, factor))


def _scaled(stored: torch.Tensor, factor: float) -> torch.Tensor:
    """``round(stored * factor)`` as int64 (exact when ``factor`` is 1)."""
    if factor == 1.0:
        return stored.clone()
    return stored.double().mul_(factor).round_().long()


def rebased(stored: torch.Tensor, decay: float, steps: int) -> torch.Tensor:
    """Stored values moved ``steps`` reference steps forward (a resharded load): ``round(stored * decay**steps)``."""
    return _scaled(stored, decay**steps)
