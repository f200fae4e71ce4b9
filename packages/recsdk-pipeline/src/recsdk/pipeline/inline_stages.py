"""``InlineStages``: the pipelined modules that keep TorchRec's schedule on the calling thread.

Every pipelined module that is not host-staged (all of them without the host thread): a
batch's input dists are started on the calling thread before the previous batch's forward
(their all-to-alls run on gloo's threads during it) and waited for after it; a recsdk hash
module among them maps the ids in its own ``compute_and_output_dist``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchrec.distributed.types import ShardedModule

from recsdk.pipeline._torchrec_compat import InputDists
from recsdk.pipeline.host_staged import ModulePlan
from recsdk.pipeline.in_flight import Step
from recsdk.sharding import HostShardedModule, refuse_inputs

__all__ = ["InlineStages"]


class InlineStages:
    """The input dists of a pipeline's inline modules, per batch, on the calling thread.

    Args:
        input_dists (InputDists): the pipeline's per-batch input dist operations.

    Example::

        inline = InlineStages(InputDists(pipeline))
        inline.adopt(plan)
        inline.start(step)  # after the step's read is settled (HostStages.settle_read)
        inline.wait(step)
        assert not inline.refused(step)
    """

    def __init__(self, input_dists: InputDists) -> None:
        self._input_dists = input_dists
        self._plan = ModulePlan()

    @property
    def module_names(self) -> list[str]:
        """Names of the inline modules (empty until :meth:`adopt`)."""
        return [self._plan.name_of(m) for m in self._plan.inline]

    def adopt(self, plan: ModulePlan) -> None:
        """Run ``plan.inline``'s input dists from now on (after the model rewrite and each ``attach``)."""
        self._plan = plan

    def run_first(self, modules: Sequence[ShardedModule], step: Step) -> None:
        """The first batch, once the model is rewritten: every pipelined module's input dist
        (``modules``: the host-staged ones too; the plan is made from what they build), started
        and waited for here. The host stages then map their share
        (:meth:`~recsdk.pipeline.host_stages.HostStages.map_first`)."""
        with self._input_dists.scope():
            self._input_dists.start(modules, step.batch, step.context)
            self._input_dists.wait(step.context)

    def start(self, step: Step) -> None:
        """Start the step's inline input dists, once (nothing for a batch some rank could not
        read: it never computes, on any rank). A failed read's stand-in is refused
        (:func:`~recsdk.sharding.refuse_inputs`)."""
        if step.inline_started:
            return
        if step.read_agreed is not None and step.read_agreed.exception() is not None:
            return  # a rank could not read this batch: it never computes, on any rank
        step.inline_started = True
        if not self._plan.inline:
            return
        dists = self._input_dists
        with dists.scope(), refuse_inputs(step.read_error):
            dists.start(self._plan.inline, step.batch, step.context)

    def wait(self, step: Step) -> None:
        """Wait for the splits of the step's input dists still in flight (its tensors requests
        are then in its context)."""
        if step.context.fused_splits_awaitables:
            with self._input_dists.scope():
                self._input_dists.wait(step.context)

    def refused(self, step: Step) -> bool:
        """Whether some rank refused the step's batch in a hash module's input dist (its input
        check, or a failed read's stand-in): the same answer on every rank once the batch's
        splits are waited for; its forward then raises on every rank."""
        for module in self._plan.inline:
            if isinstance(module, HostShardedModule):
                module_context = step.context.module_contexts.get(self._plan.name_of(module))
                if module_context is not None and module.input_refused(module_context):
                    return True
        return False
