"""The pipeline's parts on their own, in one process: the module plan and the lanes."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from recsdk.pipeline.host_staged import plan_modules
from recsdk.pipeline.in_flight import Lanes, Step

DEVICE_GROUP, HOST_GROUP = object(), object()


class _Forward:
    """A pipelined forward: TorchRec's carry the module's name."""

    def __init__(self, name: str) -> None:
        self.name = name


class _Staged:
    """Implements HostStagedModule over ``groups``."""

    def __init__(self, name: str, groups: list[object]) -> None:
        self.forward = _Forward(name)
        self._groups = groups

    def host_input_groups(self) -> list[object]:
        return self._groups

    def post_input_dist(self, ctx: Any, dist_input: Any) -> Any:
        return dist_input

    def release_context(self, ctx: Any) -> None:
        pass

    def release_finished_pins(self) -> None:
        pass


class _Plain:
    """A pipelined module without a host stage (TorchRec's own)."""

    def __init__(self, name: str) -> None:
        self.forward = _Forward(name)


def test_plan_modules_host_stages_only_modules_off_device_groups(caplog: pytest.LogCaptureFixture) -> None:
    a, b = _Staged("a", [HOST_GROUP]), _Staged("b", [HOST_GROUP])
    on_device, plain = _Staged("on_device", [DEVICE_GROUP]), _Plain("plain")
    modules: list[Any] = [a, on_device, plain, b]
    with caplog.at_level(logging.WARNING, logger="recsdk.pipeline.train_pipeline"):
        plan = plan_modules(modules, [DEVICE_GROUP], host_thread=True)
    assert plan.host == (a, b) and plan.inline == (on_device, plain)
    assert plan.host_groups == (HOST_GROUP,)  # once, though two modules use it
    assert [plan.name_of(m) for m in modules] == ["a", "on_device", "plain", "b"]
    assert not plan.reads_carried  # no recsdk hash module
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["on_device"]


def test_plan_modules_without_the_host_thread_keeps_every_module_inline(caplog: pytest.LogCaptureFixture) -> None:
    modules: list[Any] = [_Staged("a", [HOST_GROUP]), _Staged("on_device", [DEVICE_GROUP])]
    with caplog.at_level(logging.WARNING, logger="recsdk.pipeline.train_pipeline"):
        plan = plan_modules(modules, [DEVICE_GROUP], host_thread=False)
    assert plan.host == () and plan.inline == tuple(modules) and plan.host_groups == ()
    assert not caplog.records  # nothing was asked of the host thread


def test_lanes_map_eval_batches_again_only_after_training_ran() -> None:
    lanes = Lanes()
    remapped: list[Step] = []
    train = lanes.enter(True, train_steps=0, remap=remapped.append)
    train.steps.append(Step(batch="t0", context=None))  # type: ignore[arg-type]
    evaluation = lanes.enter(False, train_steps=0, remap=remapped.append)
    eval_step = Step(batch="e0", context=None)  # type: ignore[arg-type]
    evaluation.steps.append(eval_step)
    assert lanes.enter(True, train_steps=0, remap=remapped.append) is train
    assert lanes.enter(False, train_steps=0, remap=remapped.append) is evaluation
    assert remapped == []  # no training step in between: the tables are as they were mapped against
    lanes.enter(True, train_steps=0, remap=remapped.append)
    lanes.enter(False, train_steps=1, remap=remapped.append)
    assert remapped == [eval_step]
    lanes.enter(False, train_steps=1, remap=remapped.append)
    assert remapped == [eval_step]  # staying in eval maps nothing again
    assert [s.batch for s in lanes.steps()] == ["t0", "e0"] and lanes.train is train
    lanes.clear()
    assert list(lanes.steps()) == [] and lanes.train is not train
