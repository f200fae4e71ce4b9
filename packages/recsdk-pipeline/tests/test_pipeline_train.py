"""HybridTrainPipelineSparseDist against the plain loop: 2 ranks, gloo, bit-for-bit on CPU."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from pipeline_models import build, equal_snapshots, hash_ebc, make_batches, plain_loop, snapshot

from recsdk.data.testing import run_distributed
from recsdk.embedding import TTLEviction
from recsdk.pipeline import HybridTrainPipelineSparseDist

CPU = torch.device("cpu")
HOST_THREAD = "recsdk-host-stage"
HASH_TABLE_OF = {"f0": "t0", "f1": "t1"}


class Probe:
    """Counts, on a sharded HashEBC, the batches mapped (and by which thread) and computed."""

    def __init__(self, module: Any) -> None:
        self.mapped_threads: list[str] = []
        self.mapped: list[Any] = []
        self.computed_contexts: list[Any] = []
        self.released: list[Any] = []
        post_input_dist: Callable[..., Any] = module.post_input_dist
        compute: Callable[..., Any] = module.compute_and_output_dist

        def counting_post_input_dist(ctx: Any, kjts: Any) -> Any:
            if not ctx.ids_mapped:
                self.mapped_threads.append(threading.current_thread().name)
                self.mapped.append(ctx)
            return post_input_dist(ctx, kjts)

        def counting_compute(ctx: Any, kjts: Any) -> Any:
            self.computed_contexts.append(ctx)
            return compute(ctx, kjts)

        module.post_input_dist = counting_post_input_dist
        module.compute_and_output_dist = counting_compute
        module.release_context = self.released.append

    @property
    def computed(self) -> int:
        return len(self.computed_contexts)


class InFlightCheck:
    """Records each batch's id -> row mapping when it is mapped; when the batch computes,
    checks that the id tables still map those ids to those rows (nothing evicted or
    reassigned under a batch in flight)."""

    def __init__(self, module: Any) -> None:
        self.checked = 0
        self.violations: list[str] = []
        post_input_dist: Callable[..., Any] = module.post_input_dist
        compute: Callable[..., Any] = module.compute_and_output_dist
        tables = module.id_tables
        mappings: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}

        def recording_post_input_dist(ctx: Any, kjts: Any) -> Any:
            if ctx.ids_mapped:
                return post_input_dist(ctx, kjts)
            mapped = post_input_dist(ctx, kjts)
            entries = []
            for raw, rows in zip(kjts, mapped, strict=True):
                raw_d, rows_d = raw.to_dict(), rows.to_dict()
                for key in raw_d:
                    table = HASH_TABLE_OF[key]
                    entries.append((table, raw_d[key].values(), rows_d[key].values()))
            mappings[id(ctx)] = entries
            return mapped

        def checking_compute(ctx: Any, kjts: Any) -> Any:
            for table, ids, rows in mappings.pop(id(ctx)):
                stored_ids, stored_rows = tables[table].ids_and_rows()
                order = torch.argsort(stored_ids)
                stored_ids, stored_rows = stored_ids[order], stored_rows[order]
                at = torch.searchsorted(stored_ids, ids).clamp(max=max(stored_ids.numel() - 1, 0))
                if ids.numel() and not (
                    torch.equal(stored_ids[at], ids) and torch.equal(stored_rows[at], rows.to(stored_rows.dtype))
                ):
                    self.violations.append(f"batch {self.checked}, table {table}")
            self.checked += 1
            return compute(ctx, kjts)

        module.post_input_dist = recording_post_input_dist
        module.compute_and_output_dist = checking_compute


def _drain(
    pipeline: HybridTrainPipelineSparseDist, batches: list, probe: Probe | None = None, detach_at: int = -1
) -> tuple[list, list]:
    """Run ``progress`` until StopIteration; return (loss, output) per batch and the lookahead after each.

    With ``detach_at``, the model is detached after that many batches (TorchRec's ``detach``);
    the next ``progress`` attaches it again and carries on with the batches in flight.
    """
    it = iter(batches)
    results, ahead = [], []
    while True:
        if len(results) == detach_at:
            pipeline.detach()
        try:
            out, loss = pipeline.progress(it)
        except StopIteration:
            break
        results.append((loss.detach().clone(), out.detach().clone()))
        if probe is not None:
            ahead.append(len(probe.mapped_threads) - probe.computed)
    # Drained: another call stops again, it does not hang or compute anything.
    try:
        pipeline.progress(it)
        raise AssertionError("progress after the end returned instead of raising StopIteration")
    except StopIteration:
        pass
    return results, ahead


def _same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(
        torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, want, strict=True)
    )


def _train_equivalence(rank: int, world_size: int) -> dict[str, Any]:
    num_batches = 8
    batches = make_batches(num_batches, rank, seed=1)
    model, optimizer = build()
    reference = plain_loop(model, optimizer, [("train", b) for b in batches])
    want = snapshot(model, optimizer)
    assert len(hash_ebc(model).id_tables) > 0

    for k in (1, 2, 6):
        model, optimizer = build()
        probe = Probe(hash_ebc(model))
        with HybridTrainPipelineSparseDist(
            model, optimizer, CPU, host_thread=True, return_loss=True, pipe_n_batch=k
        ) as pipeline:
            got, ahead = _drain(pipeline, batches, probe, detach_at=4 if k == 2 else -1)
            assert pipeline.host_staged_modules == ["ebc"], pipeline.host_staged_modules
            assert pipeline.inline_modules == ["plain"], pipeline.inline_modules
        assert _same(got, reference), f"pipe_n_batch={k}: losses/outputs differ from the plain loop"
        diff = equal_snapshots(snapshot(model, optimizer), want)
        assert diff == [], f"pipe_n_batch={k}: final state differs from the plain loop in {diff}"
        # k batches are mapped ahead of the one computing, never more.
        assert ahead == [min(k, num_batches - i - 1) for i in range(num_batches)], (k, ahead)
        # The first batch bootstraps on the calling thread; every later one is mapped on the host thread.
        assert probe.mapped_threads[0] == threading.main_thread().name, probe.mapped_threads
        assert set(probe.mapped_threads[1:]) == {HOST_THREAD}, probe.mapped_threads

    # The CPU default, no host thread (TorchRec's schedule): the same results, detached mid-run too.
    model, optimizer = build()
    with HybridTrainPipelineSparseDist(model, optimizer, CPU, return_loss=True, pipe_n_batch=2) as pipeline:
        got, _ = _drain(pipeline, batches, detach_at=4)
        assert not pipeline.host_thread and pipeline.host_staged_modules == [], pipeline.host_staged_modules
        assert sorted(pipeline.inline_modules) == ["ebc", "plain"], pipeline.inline_modules
    assert _same(got, reference), "no host thread: losses/outputs differ from the plain loop"
    assert equal_snapshots(snapshot(model, optimizer), want) == [], "no host thread: final state differs"

    # close() with batches in flight hands their contexts to the module's release_context.
    model, optimizer = build()
    probe = Probe(hash_ebc(model))
    pipeline = HybridTrainPipelineSparseDist(model, optimizer, CPU, host_thread=True, pipe_n_batch=2)
    it = iter(batches)
    for _ in range(3):
        pipeline.progress(it)
    pipeline.close()
    assert [id(c) for c in probe.released] == [id(c) for c in probe.mapped[3:5]], "release the 2 batches read ahead"
    assert not {id(c) for c in probe.released} & {id(c) for c in probe.computed_contexts}
    # ... and gives the model back: it runs a forward of its own again.
    model.eval()
    with torch.no_grad():
        loss, _ = model(batches[0])
    assert torch.isfinite(loss)

    # Eviction while batches are in flight: rows idle for 2 table steps are freed, and the
    # pipeline maps 4 batches ahead, so without pinning the rows of the batch computing would be
    # freed and handed to new ids before it looks them up. Every batch must still find its rows.
    pool = torch.randint(-(2**62), 2**62, (400,), generator=torch.Generator().manual_seed(99))
    model, optimizer = build(capacity=120, eviction=TTLEviction(max_idle_steps=2))
    check = InFlightCheck(hash_ebc(model))
    with HybridTrainPipelineSparseDist(
        model, optimizer, CPU, host_thread=True, return_loss=True, pipe_n_batch=4
    ) as pipeline:
        small = make_batches(16, rank, seed=6, batch_size=4, id_pools=[pool, pool])
        assert len(_drain(pipeline, small)[0]) == 16
    assert check.checked == 16 and check.violations == [], check.violations
    evictions = sum(t.stats()["evictions"] for t in hash_ebc(model).id_tables.values())
    assert evictions > 0, "no row was ever freed: the check above proved nothing"

    # End of data: 0 batches, 1 batch, fewer batches than pipe_n_batch.
    model, optimizer = build()
    with HybridTrainPipelineSparseDist(
        model, optimizer, CPU, host_thread=True, return_loss=True, pipe_n_batch=2
    ) as pipeline:
        assert _drain(pipeline, [])[0] == []
    with HybridTrainPipelineSparseDist(
        model, optimizer, CPU, host_thread=True, return_loss=True, pipe_n_batch=2
    ) as pipeline:
        assert _same(_drain(pipeline, batches[:1])[0], reference[:1])
    model, optimizer = build()
    with HybridTrainPipelineSparseDist(
        model, optimizer, CPU, host_thread=True, return_loss=True, pipe_n_batch=6
    ) as pipeline:
        assert _same(_drain(pipeline, batches[:3])[0], reference[:3])
    # execute_all_batches=False stops as soon as the iterator runs dry (TorchRec's semantics):
    # the pipe_n_batch batches read ahead are not run.
    model, optimizer = build()
    pipeline = HybridTrainPipelineSparseDist(
        model, optimizer, CPU, execute_all_batches=False, return_loss=True, pipe_n_batch=2, host_thread=True
    )
    assert _same(_drain(pipeline, batches[:5])[0], reference[:3])
    pipeline.close()
    return {"rank": rank}


def test_pipelined_training_matches_the_plain_loop_bit_for_bit() -> None:
    assert run_distributed(_train_equivalence, 2, timeout_s=120) == [{"rank": 0}, {"rank": 1}]
