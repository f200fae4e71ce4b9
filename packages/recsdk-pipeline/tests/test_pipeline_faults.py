"""Faults outside the host stage: a pipeline dropped without close(), a data iterator that raises."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch
from pipeline_models import HybridBatch, build, hash_ebc, make_batches
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data.testing import run_distributed
from recsdk.embedding import LRUEviction
from recsdk.pipeline import HostStageError, HostWorker, HybridTrainPipelineSparseDist
from recsdk.sharding import PeerFailureError

CPU = torch.device("cpu")
HOST_THREAD = "recsdk-host-stage"
OWNED_THREAD = "test-owned-worker"
JOIN_TIMEOUT_S = 10.0
# Generous for a loaded 2-core machine, far below the groups' timeouts (TIMEOUT_S): a healthy
# rank that waited for a timeout instead of being told would take at least TIMEOUT_S.
RAISE_BOUND_S = 5.0
TIMEOUT_S = 60.0


class InjectedError(ValueError):
    pass


class _Owner:
    """Owns a worker the way the pipeline does; its setup and tasks are its bound methods."""

    def __init__(self) -> None:
        self.worker = HostWorker(OWNED_THREAD, setup=self.setup)

    def setup(self) -> None:
        pass

    def work(self) -> int:
        return 1

    def fail(self) -> None:
        raise InjectedError("task failed")


def _drop(owner: _Owner, fail: bool) -> tuple[threading.Thread, weakref.ref[_Owner]]:
    future = owner.worker.submit(owner.fail if fail else owner.work)
    assert future.exception() is not None if fail else future.result() == 1
    (thread,) = [t for t in threading.enumerate() if t.name == OWNED_THREAD]
    return thread, weakref.ref(owner)


def test_dropped_worker_owner_is_collected_and_its_thread_ends() -> None:
    for fail in (False, True):  # a failed task's traceback (its frames hold the owner) too
        thread, ref = _drop(_Owner(), fail)
        gc.collect()
        thread.join(JOIN_TIMEOUT_S)
        assert ref() is None, f"fail={fail}: the worker's thread keeps its owner alive"
        assert not thread.is_alive(), f"fail={fail}: the thread outlived its worker"


def _dropped_pipeline(rank: int, world_size: int) -> dict[str, Any]:
    model, optimizer = build()
    pipeline = HybridTrainPipelineSparseDist(model, optimizer, CPU, host_thread=True, pipe_n_batch=2)
    it = iter(make_batches(6, rank, seed=7))
    pipeline.progress(it)
    pipeline.progress(it)
    host_staged = pipeline.host_staged_modules
    threads = [t for t in threading.enumerate() if t.name == HOST_THREAD]
    ref = weakref.ref(pipeline)
    del pipeline  # without close()
    gc.collect()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    return {
        "host_staged": host_staged,
        "threads": len(threads),
        "alive": sum(t.is_alive() for t in threads),
        "collected": ref() is None,
    }


def test_unclosed_pipeline_is_collected_and_its_host_thread_ends() -> None:
    for result in run_distributed(_dropped_pipeline, 2, timeout_s=TIMEOUT_S):
        assert result["host_staged"] == ["ebc"], result  # the host thread did run
        assert result["threads"] == 1, result
        assert result["collected"], f"the host thread keeps the dropped pipeline alive: {result}"
        assert result["alive"] == 0, f"the host thread outlived the dropped pipeline: {result}"


class _FailingIterator:
    """Yields ``batches``; raises :class:`InjectedError` instead of the batch at ``fail_at``, then goes on."""

    def __init__(self, batches: list[Any], fail_at: int | None) -> None:
        self._batches = batches
        self._fail_at = fail_at
        self._next = 0

    def __iter__(self) -> _FailingIterator:
        return self

    def __next__(self) -> Any:
        i, self._next = self._next, self._next + 1
        if i == self._fail_at:
            raise InjectedError(f"injected failure reading batch {i}")
        if i >= len(self._batches):
            raise StopIteration
        return self._batches[i]


# (batch the iterator raises on, pipe_n_batch): mid-run, the pipeline's very first batch (before
# the model is rewritten), and mid-run with the batch read in the call that computes the one before.
ITERATOR_FAILURES = [(5, 2), (0, 2), (3, 1)]


def _new_ids_of(batch_index: int, every: list[list[HybridBatch]]) -> torch.Tensor:
    """The ids of every rank's batch ``batch_index`` that no rank's earlier batch holds."""
    ids = [[b.sparse_features.values() for b in batches] for batches in every]
    earlier = torch.cat([i for per_rank in ids for i in per_rank[:batch_index]] or [torch.empty(0, dtype=torch.int64)])
    new = torch.cat([per_rank[batch_index] for per_rank in ids])
    return new[~torch.isin(new, earlier)]


def _iterator_failures(rank: int, world_size: int, host_thread: bool) -> list[dict[str, Any]]:
    every = [make_batches(10, r, seed=8) for r in range(world_size)]
    batches = every[rank]
    results = []
    for fail_at, pipe_n_batch in ITERATOR_FAILURES:
        model, optimizer = build(host_timeout_s=TIMEOUT_S)
        pipeline = HybridTrainPipelineSparseDist(
            model, optimizer, CPU, host_thread=host_thread, pipe_n_batch=pipe_n_batch
        )
        it = _FailingIterator(batches, fail_at if rank == 0 else None)
        calls, result = 0, {}
        while True:
            started = time.monotonic()
            try:
                pipeline.progress(it)
            except StopIteration:
                result = {"call": None}
                break
            except Exception as e:
                result = {
                    "call": calls,
                    "seconds": time.monotonic() - started,
                    "error": type(e).__name__,
                    "message": str(e),
                }
                break
            calls += 1
        # A rank that catches the error and carries on is refused, with the original cause.
        try:
            pipeline.progress(it)
            result["after"] = "returned"
        except Exception as again:
            result["after"] = type(again).__name__
            result["after_cause"] = type(again.__cause__).__name__
        pipeline.close()
        # The failed batch (rank 1 read its own) is mapped by no rank, nor any batch after it.
        stored = torch.cat([table.ids_and_rows()[0] for table in hash_ebc(model).id_tables.values()])
        later = torch.cat([_new_ids_of(i, every) for i in range(fail_at, len(batches))])
        result["new_ids"], result["stored_new"] = later.numel(), int(torch.isin(later, stored).sum())
        results.append(result)
    return results


@pytest.mark.parametrize("host_thread", [True, False], ids=["host_thread", "calling_thread"])
def test_data_iterator_failure_stops_every_rank_within_seconds(host_thread: bool) -> None:
    # Once the model is pipelined the failed read travels with the batch (a refused stand-in)
    # and the host stage's agreement raises; before that (the first batch) the read agreement does.
    rank0, rank1 = run_distributed(_iterator_failures, 2, host_thread, timeout_s=TIMEOUT_S)
    for (fail_at, _), mine, peer in zip(ITERATOR_FAILURES, rank0, rank1, strict=True):
        # As in the plain loop, the batches before the failing one are computed; both ranks then
        # stop at the same progress() call: the one that would compute the failing batch.
        assert mine["call"] == fail_at and peer["call"] == fail_at, (fail_at, mine, peer)
        assert mine["error"] == "InjectedError", mine  # the raising rank: its own exception
        # Once pipelined the failed read travels as a refused stand-in: the module's agreement
        # raises (its PeerFailureError) without the host thread, the host stage's with it.
        peer_error = (PeerFailureError if not host_thread and fail_at > 0 else HostStageError).__name__
        assert peer["error"] == peer_error, peer
        assert "failed on rank(s) [0]" in peer["message"] and "InjectedError" in peer["message"], peer
        # Told, not timed out: well within the groups' timeouts.
        assert peer["seconds"] < RAISE_BOUND_S and mine["seconds"] < RAISE_BOUND_S, (fail_at, mine, peer)
        assert mine["after"] == peer["after"] == "RuntimeError", (mine, peer)
        assert mine["after_cause"] == "InjectedError" and peer["after_cause"] == peer_error
        assert mine["new_ids"] > 0 and mine["stored_new"] == peer["stored_new"] == 0, (fail_at, mine, peer)


def _with_negative_length(batch: HybridBatch) -> HybridBatch:
    kjt = batch.sparse_features
    lengths = kjt.lengths().clone()
    lengths[0], lengths[1] = -1, lengths[1] + lengths[0] + 1  # the same number of ids
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=lengths)
    return HybridBatch(batch.dense_features, bad, batch.labels, batch.plain_features)


def _bad_batch(rank: int, world_size: int, host_thread: bool) -> dict[str, Any]:
    """Rank 0's batch 3 has a negative length; every progress() call's outcome, and which ids
    first seen in batch 3 (either rank's) this rank's id tables hold afterwards."""
    every = [make_batches(6, r, seed=9) for r in range(world_size)]
    ids = [[b.sparse_features.values() for b in batches] for batches in every]
    earlier = torch.cat([i for per_rank in ids for i in per_rank[:3]])
    new_in_3 = torch.cat([per_rank[3] for per_rank in ids])
    new_in_3 = new_in_3[~torch.isin(new_in_3, earlier)]
    batches = every[rank]
    if rank == 0:
        batches[3] = _with_negative_length(batches[3])
    model, optimizer = build(host_timeout_s=TIMEOUT_S)
    pipeline = HybridTrainPipelineSparseDist(model, optimizer, CPU, host_thread=host_thread, pipe_n_batch=2)
    it, calls = iter(batches), []
    for _ in range(5):
        started = time.monotonic()
        try:
            pipeline.progress(it)
            calls.append(("ok",))
        except Exception as e:
            calls.append((type(e).__name__, str(e), time.monotonic() - started, type(e.__cause__).__name__))
    pipeline.close()
    stored = torch.cat([table.ids_and_rows()[0] for table in hash_ebc(model).id_tables.values()])
    return {"calls": calls, "new_ids": new_in_3.numel(), "stored_new": int(torch.isin(new_in_3, stored).sum())}


@pytest.mark.parametrize("host_thread", [True, False], ids=["host_thread", "calling_thread"])
def test_a_bad_batch_on_one_rank_stops_every_rank_at_that_batch(host_thread: bool) -> None:
    out0, out1 = run_distributed(_bad_batch, 2, host_thread, timeout_s=TIMEOUT_S)
    # No rank mapped batch 3: its new ids (rank 1's are good) are in no id table.
    assert out0["new_ids"] > 0 and out0["stored_new"] == out1["stored_new"] == 0, (out0, out1)
    rank0, rank1 = out0["calls"], out1["calls"]
    assert rank0[:3] == rank1[:3] == [("ok",)] * 3, (rank0, rank1)
    # Batch 3: the rank that sent it names what is wrong; its peer is told, within seconds.
    assert rank0[3][0] == "ValueError" and "negative lengths" in rank0[3][1], rank0[3]
    peer_error = HostStageError if host_thread else PeerFailureError  # the host stage's or the module's agreement
    assert rank1[3][0] == peer_error.__name__ and "rank(s) [0]" in rank1[3][1], rank1[3]
    assert rank0[3][2] < RAISE_BOUND_S and rank1[3][2] < RAISE_BOUND_S, (rank0[3], rank1[3])
    # Batch 4 is refused on both, chained to the failure (its input dist may already be spent).
    for calls in (rank0, rank1):
        assert calls[4][0] == "RuntimeError" and "cannot continue" in calls[4][1], calls[4]
        assert calls[4][3] == calls[3][0], calls[4]


def _pins_after_a_failed_host_stage(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0's host stage fails at batch 3 (before mapping, as a module's own failure does);
    rank 1 mapped that batch (and pinned its rows) before the agreement told it."""
    model, optimizer = build(eviction=LRUEviction())
    module = hash_ebc(model)
    if rank == 0:
        original = module.post_input_dist
        calls = {"n": 0}

        def failing(ctx: Any, dist_input: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 4:
                raise ValueError("injected host-stage failure")
            return original(ctx, dist_input)

        module.post_input_dist = failing  # type: ignore[method-assign]
    pipeline = HybridTrainPipelineSparseDist(model, optimizer, CPU, host_thread=True, pipe_n_batch=2)
    it = iter(make_batches(8, rank, seed=3))
    error = None
    try:
        for _ in range(8):
            pipeline.progress(it)
    except Exception as e:
        error = type(e).__name__
    pipeline.close()
    module.release_finished_pins()  # the last computed batch's rows
    return {"error": error, "pinned": sum(t.num_pinned() for t in module.id_tables.values())}


def test_a_failed_host_stage_leaves_no_rows_pinned_on_any_rank() -> None:
    # Pinned rows are never evicted again: a leak would fill the table and block checkpoint loads.
    failed, peer = run_distributed(_pins_after_a_failed_host_stage, 2, timeout_s=60)
    assert failed["error"] == "ValueError" and peer["error"] == "HostStageError", (failed, peer)
    assert failed["pinned"] == 0 and peer["pinned"] == 0, (failed, peer)
