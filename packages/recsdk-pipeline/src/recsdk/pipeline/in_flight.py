"""The hybrid pipeline's batches in flight: ``Step`` (one batch), ``Lane`` (one mode's), ``Lanes``.

:class:`~recsdk.pipeline.HybridTrainPipelineSparseDist` keeps its :class:`Lanes` (one
:class:`Lane` per mode) and appends a :class:`Step` per batch it reads; its host stages
(``host_stages.py``) fill a step's agreement and host-stage futures, its inline modules
(``inline_stages.py``) its context.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext

__all__ = ["HostResult", "Lane", "Lanes", "Step"]

# name -> (module context, input of compute_and_output_dist) for the host-staged modules
HostResult = dict[str, tuple[Any, Any]]


@dataclass
class Step:
    """One batch in flight: read from the iterator, its host stage queued or done.

    For a batch the iterator raised on (here), either ``batch`` is ``None`` and ``read_agreed``
    fails with that exception (the batch is never computed), or, where the failure travels with
    the batch's ids, ``read_error`` is that exception and ``batch`` the last batch read: a
    stand-in whose input dists refuse it (:func:`~recsdk.sharding.refuse_inputs`).

    Example::

        step = Step(batch=batch, context=context)  # then HostStages.read(step, rewritten=True)
    """

    batch: Any
    context: TrainPipelineContext
    # Done once every rank knows whether its read of this batch succeeded (None: nothing to agree).
    read_agreed: Future[None] | None = None
    host_future: Future[HostResult] | None = None
    inline_started: bool = False
    read_error: Exception | None = None


@dataclass
class Lane:
    """The batches of one mode (train or eval), in order, and the iterator they come from.

    Example::

        lanes = {True: Lane(), False: Lane()}  # by model.training
        lane.read_from(iterator)
        while lane.wants(ahead=2):
            lane.steps.append(Step(batch=next(iterator), context=context))
    """

    steps: deque[Step] = field(default_factory=deque)
    iterator: Iterator[Any] | None = None
    exhausted: bool = False
    train_steps_seen: int = 0

    def read_from(self, iterator: Iterator[Any]) -> None:
        """Read from ``iterator`` from now on (another iterator than the last: not exhausted)."""
        if iterator is not self.iterator:
            self.iterator = iterator
            self.exhausted = False

    def wants(self, ahead: int) -> bool:
        """Whether to read another batch: fewer than ``ahead`` batches wait behind the first, and
        the iterator has not run dry."""
        return len(self.steps) < 1 + ahead and not self.exhausted


class Lanes:
    """A pipeline's two lanes (train and eval) and which mode ran last.

    Each mode keeps its own queue: batches read ahead in the other mode wait, untouched, until
    that mode comes back; eval batches mapped before training ran again are mapped anew.

    Example::

        lanes = Lanes()
        lane = lanes.enter(training=True, train_steps=0, remap=host.remap)
        lane.steps.append(step)
    """

    def __init__(self) -> None:
        self._lanes: dict[bool, Lane] = {True: Lane(), False: Lane()}
        self._active: bool | None = None

    @property
    def train(self) -> Lane:
        """The training lane."""
        return self._lanes[True]

    def enter(self, training: bool, train_steps: int, remap: Callable[[Step], None]) -> Lane:
        """Switch to ``training``'s lane (``model.training``) and return it.

        Args:
            training (bool): the mode of the coming batch.
            train_steps (int): batches trained so far.
            remap (Callable[[Step], None]): called for each eval batch in flight when eval comes
                back after training changed the id tables (``train_steps`` moved since).
        """
        lane = self._lanes[training]
        if self._active is not None and self._active != training and not training:
            if lane.train_steps_seen != train_steps:
                # Training changed the id tables since these eval batches were mapped.
                for step in lane.steps:
                    remap(step)
        if not training:
            lane.train_steps_seen = train_steps
        self._active = training
        return lane

    def steps(self) -> Iterator[Step]:
        """Every step in flight, both lanes."""
        for lane in self._lanes.values():
            yield from lane.steps

    def clear(self) -> None:
        """Forget every step in flight and the last mode (the caller released them first)."""
        self._lanes = {True: Lane(), False: Lane()}
        self._active = None
