"""A failure in a background host stage surfaces in progress() on every rank, never a hang."""

from __future__ import annotations

import traceback
from typing import Any

import torch
from pipeline_models import build, hash_ebc, make_batches

from recsdk.data.testing import run_distributed
from recsdk.pipeline import HostStageError, HybridTrainPipelineSparseDist

CPU = torch.device("cpu")
HOST_TIMEOUT_S = 3.0  # the host group's timeout: how long a rank may wait for a failed one


class InjectedError(ValueError):
    pass


def _inject(module: Any, method: str, fail_at_batch: int) -> None:
    """Make ``module.<method>`` raise for the batch with that index.

    ``input_dist`` fails before its id all-to-all (this rank's host collectives stop short);
    ``post_input_dist`` fails after mapping the ids (every collective was issued).
    """
    original = getattr(module, method)
    calls = {"n": 0}

    def failing(ctx: Any, *args: Any) -> Any:
        if method == "post_input_dist" and ctx.ids_mapped:
            return original(ctx, *args)
        calls["n"] += 1
        if calls["n"] != fail_at_batch + 1:
            return original(ctx, *args)
        if method == "post_input_dist":
            original(ctx, *args)
        raise InjectedError(f"injected failure in {method}")

    setattr(module, method, failing)


def _run_until_failure(pipeline: HybridTrainPipelineSparseDist, batches: list) -> dict[str, Any]:
    it = iter(batches)
    for i in range(len(batches)):
        try:
            pipeline.progress(it)
        except StopIteration:
            break
        except Exception as e:
            frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
            try:
                pipeline.progress(it)
                after = "returned"
            except Exception as again:
                after = type(again).__name__
            pipeline.close()
            return {"batch": i, "error": type(e).__name__, "message": str(e), "frames": frames, "after": after}
    pipeline.close()
    return {"batch": None}


def _failures(rank: int, world_size: int) -> list[dict[str, Any]]:
    batches = make_batches(8, rank, seed=5)
    results = []
    # 1. post_input_dist raises on rank 0 (on the host thread): the failure flag stops rank 1 too.
    # 2. input_dist raises on rank 0 before its id all-to-all: rank 1's host collective times out.
    for method in ("post_input_dist", "input_dist"):
        model, optimizer = build(host_timeout_s=HOST_TIMEOUT_S)
        if rank == 0:
            _inject(hash_ebc(model), method, fail_at_batch=4)
        pipeline = HybridTrainPipelineSparseDist(model, optimizer, CPU, host_thread=True, pipe_n_batch=2)
        results.append(_run_until_failure(pipeline, batches))
    return results


def test_host_stage_failure_surfaces_in_progress_on_every_rank() -> None:
    # A hang would exceed the default group's timeout and fail run_distributed.
    rank0, rank1 = run_distributed(_failures, 2, timeout_s=60)
    post0, dist0 = rank0
    post1, dist1 = rank1
    # The failing rank raises its own exception, with the host thread's frames in the traceback.
    for result in (post0, dist0):
        assert result["batch"] == 4, result
        assert result["error"] == "InjectedError", result
        assert "failing" in result["frames"], result["frames"]
        assert "_host_stage" in result["frames"] or "_post_input_dist" in result["frames"], result["frames"]
        assert result["after"] == "RuntimeError", result  # the pipeline refuses to go on
    # The other rank stops at the same batch: told by the failure flag ...
    assert post1["batch"] == 4, post1
    assert post1["error"] == HostStageError.__name__, post1
    assert "failed on rank(s) [0]" in post1["message"], post1
    assert post1["after"] == "RuntimeError", post1
    # ... or by its host group's timeout, when the failed rank never sent its ids.
    assert dist1["batch"] == 4, dist1
    assert dist1["error"] in ("RuntimeError", "DistBackendError"), dist1
    # (gloo words it by where the wait ended: "Timed out", "Application timeout ...", "Connection ...")
    assert any(w in dist1["message"].lower() for w in ("timed out", "timeout", "connection")), dist1
    assert dist1["after"] == "RuntimeError", dist1
