"""Checkpoints of the little demo, and resuming from the latest one (``--checkpoint-dir``).

Every ``--checkpoint-every`` steps the demo drains its pipeline (``pipeline.drain()`` trains the
batches it has read ahead), then saves in the background (``AsyncCheckpointer``: a snapshot on
the training thread, the write on a thread of its own), on every rank, the model, the optimizer
and what the training loop needs to go on exactly: the step, the losses and evaluations so far, this rank's
data position (``StatefulDataLoader.state_dict()``, after the last batch trained) and its
torch RNG state (re-initialised rows draw from it). A run started with a checkpoint directory
that holds one resumes from its latest: under ``torchrun --max-restarts`` a group restarted
after a rank died carries on from there and ends with the result of a run never killed.

A resume is exact only under the flags the checkpoints were made with: the first run of a
checkpoint directory records its flags there (``little_demo_flags.json``), and a run that would
resume under other flags stops before any rank starts, naming each difference on one line
(:func:`flag_differences`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchrec.optim.keyed import KeyedOptimizer

from recsdk.pipeline import HybridTrainPipelineSparseDist
from recsdk.sharding import AsyncCheckpointer, latest_checkpoint, load_checkpoint

FLAGS_FILE = "little_demo_flags.json"
RESUME_FLAGS = (
    "steps",
    "data",
    "data_path",
    "no_history",
    "batch_size",
    "pipe_n_batch",
    "eval_every",
    "eval_batches",
    "cache_load_factor",
    "id_policy",
    "num_workers",
    "seed",
)
"""The flags a resume must keep (the data and its position, the model, the schedule; ``--steps``
too: the synthetic data's length is part of its position). ``--world-size`` may change (an
elastic resume), as may ``--device``, the timeout and the output folders."""


def flag_differences(args: argparse.Namespace) -> list[str]:
    """How ``args`` differ from the flags of the run whose checkpoints ``--checkpoint-dir`` holds,
    one ``--flag old -> new`` each; ``[]`` when nothing would be resumed or nothing differs.
    With no checkpoint there yet (a run killed before its first one, or a new folder), the
    flags of this run are recorded instead (by one process: rank 0, or the launching one)."""
    directory = args.checkpoint_dir
    path = os.path.join(directory, FLAGS_FILE)
    flags = {name: getattr(args, name) for name in RESUME_FLAGS}
    if latest_checkpoint(directory) is None:
        if os.environ.get("RANK", "0") == "0":
            with open(path + ".writing", "w", encoding="utf-8") as f:
                json.dump(flags, f, indent=1)
            os.replace(path + ".writing", path)
        return []
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
    except FileNotFoundError:  # checkpoints of a demo that did not record its flags
        return []
    return [
        f"--{name.replace('_', '-')} {recorded.get(name)!r} -> {value!r}"
        for name, value in flags.items()
        if recorded.get(name) != value
    ]


@dataclass
class TrainingState:
    """Where the training loop stands: what a checkpoint carries besides the model.

    Attributes:
        step (int): training steps (batches) done.
        losses (list[float]): this rank's loss of each step.
        evals (list[tuple[int, float]]): (step, eval AUC) so far.
        train_s (float): seconds spent in training steps so far (all runs of the job).
        resumed_from (str | None): the checkpoint this run started from.
    """

    step: int = 0
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    train_s: float = 0.0
    resumed_from: str | None = None


def resume(
    model: nn.Module, optimizer: KeyedOptimizer, train_data: Any, directory: str | None
) -> tuple[TrainingState, torch.Tensor | None]:
    """Load the latest checkpoint of ``directory`` (if any) into the model, the optimizer and
    ``train_data``'s position. Collective.

    Returns:
        tuple[TrainingState, torch.Tensor | None]: where training stands, and the RNG state to
        restore once the data iterator exists (creating one draws a seed from torch's RNG).
    """
    latest = latest_checkpoint(directory) if directory is not None and os.path.isdir(directory) else None
    if latest is None:
        return TrainingState(), None
    extra = load_checkpoint(model, optimizer, latest)
    train_data.load_state_dict(extra["data"])
    state = TrainingState(
        step=extra["step"],
        losses=list(extra["losses"]),
        evals=[tuple(e) for e in extra["evals"]],
        train_s=extra["train_s"],
        resumed_from=latest,
    )
    return state, extra["rng"]


def save(
    checkpointer: AsyncCheckpointer,
    pipeline: HybridTrainPipelineSparseDist,
    train_data: Any,
    directory: str,
    state: TrainingState,
) -> None:
    """Start the checkpoint of a drained pipeline's training into ``directory/step_<step>`` (written
    in the background; the previous one is waited for first). Collective."""
    os.makedirs(directory, exist_ok=True)
    extra = {
        "step": state.step,
        "losses": state.losses,
        "evals": state.evals,
        "train_s": state.train_s,
        "data": train_data.state_dict(),
        "rng": torch.get_rng_state(),
    }
    checkpointer.save(os.path.join(directory, f"step_{state.step:08d}"), pipeline=pipeline, extra=extra)
