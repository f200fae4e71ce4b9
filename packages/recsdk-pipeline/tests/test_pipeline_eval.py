"""Eval on a HybridTrainPipelineSparseDist: forward only, id tables untouched, train/eval switching."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pipeline_models import HASH_FEATURES, build, equal_snapshots, make_batches, plain_loop, snapshot

from recsdk.data.testing import run_distributed
from recsdk.pipeline import HybridTrainPipelineSparseDist

CPU = torch.device("cpu")
EVAL_CHANGED = "eval changed weights, optimizer state or id tables"
UNKNOWN_IDS = torch.tensor([2**62 + 1, 2**62 + 2, 2**62 + 3])  # outside make_batches' default pool


def _hash_ids(batches: list) -> list[torch.Tensor]:
    """Per hash feature, the distinct ids of the batches."""
    return [torch.unique(torch.cat([b.sparse_features[f].values() for b in batches])) for f in HASH_FEATURES]


def _pools(known: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat([ids, UNKNOWN_IDS]) for ids in known]


def _eval_switching(rank: int, world_size: int, pipe_n_batch: int, host_thread: bool | None) -> dict[str, Any]:
    train = make_batches(10, rank, seed=2)
    all_ranks = [make_batches(10, r, seed=2) for r in range(world_size)]
    seen_after_3 = _hash_ids([b for batches in all_ranks for b in batches[:3]])
    seen_after_6 = _hash_ids([b for batches in all_ranks for b in batches[:6]])
    # Eval ids: known ids, and ids no rank ever trains (they pool as zeros). The first eval batch
    # only uses ids trained in the first 3 steps: the ids of batches read ahead for training are
    # already in the tables, as in any prefetching pipeline.
    evals = make_batches(1, rank, seed=3, id_pools=_pools(seen_after_3))
    evals += make_batches(2, rank, seed=4, id_pools=_pools(seen_after_6))
    # The last two eval batches use ids first trained in steps 3-5: they must be mapped again
    # after that training, not reuse a mapping made before it.
    first_seen_late = [late[~torch.isin(late, early)] for late, early in zip(seen_after_6, seen_after_3, strict=True)]
    assert any(
        bool(torch.isin(ids, late).any()) for ids, late in zip(_hash_ids(evals[1:]), first_seen_late, strict=True)
    )

    schedule = [("train", b) for b in train[:3]]
    schedule += [("eval", evals[0])]
    schedule += [("train", b) for b in train[3:6]]
    schedule += [("eval", b) for b in evals[1:]]
    schedule += [("train", b) for b in train[6:]]
    model, optimizer = build()
    reference = plain_loop(model, optimizer, schedule)
    want = snapshot(model, optimizer)

    model, optimizer = build()
    pipeline = HybridTrainPipelineSparseDist(
        model, optimizer, CPU, return_loss=True, pipe_n_batch=pipe_n_batch, host_thread=host_thread
    )
    train_it, eval_it = iter(train), iter(evals)
    got = []

    def step(it: Any) -> None:
        out, loss = pipeline.progress(it)
        got.append((loss.detach().clone(), out.detach().clone()))

    model.train()
    for _ in range(3):
        step(train_it)
    # On a CPU device the pipeline keeps to the calling thread unless told otherwise.
    assert pipeline.host_thread is (host_thread is True), pipeline.host_thread
    want_host_staged = ["ebc"] if host_thread else []
    assert pipeline.host_staged_modules == want_host_staged, pipeline.host_staged_modules
    model.eval()
    before_eval = snapshot(model, optimizer)
    step(eval_it)  # eval batches 1 and 2 are now read ahead and mapped
    assert equal_snapshots(snapshot(model, optimizer), before_eval) == [], EVAL_CHANGED
    model.train()
    for _ in range(3):
        step(train_it)
    model.eval()
    before_eval = snapshot(model, optimizer)
    while True:
        try:
            step(eval_it)
        except StopIteration:
            break
    assert equal_snapshots(snapshot(model, optimizer), before_eval) == [], EVAL_CHANGED
    model.train()
    while True:
        try:
            step(train_it)
        except StopIteration:
            break
    pipeline.close()

    assert len(got) == len(reference), (len(got), len(reference))
    for i, ((loss, out), (want_loss, want_out)) in enumerate(zip(got, reference, strict=True)):
        assert torch.equal(loss, want_loss) and torch.equal(out, want_out), f"step {i} ({schedule[i][0]}) differs"
    diff = equal_snapshots(snapshot(model, optimizer), want)
    assert diff == [], f"final state differs from the plain loop in {diff}"
    return {"steps": len(got)}


@pytest.mark.parametrize("host_thread", [True, None], ids=["host_thread", "default"])
def test_train_eval_train_on_one_pipeline_matches_the_plain_loop(host_thread: bool | None) -> None:
    assert run_distributed(_eval_switching, 2, 2, host_thread, timeout_s=120) == [{"steps": 13}] * 2
