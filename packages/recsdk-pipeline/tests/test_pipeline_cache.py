"""Cached hash tables under HybridTrainPipelineSparseDist: bit for bit the plain loop.

The pipeline maps batches ahead (store rows, pinned in the id tables); each batch swaps its rows
into the device cache when it starts computing, after the previous batch's backward. Training
that way gives the losses, outputs, embeddings and optimizer state per id of the all-resident
model (host-memory stores) or of the same file store with a table-sized cache, trained by the
plain loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pipeline_models import HybridModel, hash_ebc, make_batches, plain_loop, shard
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import CacheAlgorithm, CacheParams, KeyValueParams
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsdk.data.testing import run_distributed
from recsdk.embedding import LRUEviction
from recsdk.pipeline import HybridTrainPipelineSparseDist

CPU = torch.device("cpu")


def _build(kernels: tuple[str, str], store_dir: str | None = None, load_factor: float = 0.4) -> tuple[Any, Any]:
    """The pipeline tests' model (t0 row-wise, t1 table-wise, Adagrad) with ``kernels`` for t0 and
    t1 (``"fused"``, ``"fused_uvm_caching"``, ``"key_value"`` in ``store_dir``) at ``load_factor``."""
    torch.manual_seed(0)
    model = HybridModel(capacity=160, eviction=LRUEviction())
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.1, "eps": 0.1})
    apply_optimizer_in_backward(torch.optim.Adagrad, model.plain.parameters(), {"lr": 0.1, "eps": 0.1})
    cache = CacheParams(load_factor=load_factor, algorithm=CacheAlgorithm.LRU)
    constraints = {
        table: ParameterConstraints(
            sharding_types=[sharding],
            compute_kernels=[kernel],
            cache_params=None if kernel == "fused" else cache,
            key_value_params=KeyValueParams(ssd_storage_directory=store_dir) if kernel == "key_value" else None,
        )
        for table, sharding, kernel in zip(("t0", "t1"), ("row_wise", "table_wise"), kernels, strict=True)
    }
    constraints["t2"] = ParameterConstraints(sharding_types=["table_wise"])
    return shard(model, constraints, lambda params: torch.optim.Adagrad(params, lr=0.1))


def _per_id(model: Any) -> dict[str, dict[int, list[torch.Tensor]]]:
    module = hash_ebc(model)
    views = module.table_views()
    out = {}
    for name, table in module.id_tables.items():
        ids, rows = table.ids_and_rows()
        tensors = [views[name].weight, *views[name].states]
        out[name] = {i: [t[r].clone() for t in tensors] for i, r in zip(ids.tolist(), rows.tolist(), strict=True)}
    return out


def _dense(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(("dense", "over"))}


def _same_rows(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys()
        and all(torch.equal(x, y) for i in a[n] for x, y in zip(a[n][i], b[n][i], strict=True))
        for n in a
    )


def _pipelined(model: Any, optimizer: Any, batches: list, k: int) -> list:
    got = []
    with HybridTrainPipelineSparseDist(
        model, optimizer, CPU, host_thread=True, return_loss=True, pipe_n_batch=k
    ) as pipeline:
        it = iter(batches)
        while True:
            try:
                o, loss = pipeline.progress(it)
            except StopIteration:
                break
            got.append((loss.detach().clone(), o.detach().clone()))
    return got


def _store(tmp: str, name: str) -> str:
    path = Path(tmp) / name
    path.mkdir(exist_ok=True)
    return str(path)


def _run(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    batches = make_batches(12, rank, seed=3)
    out: dict[str, Any] = {}
    # Host-memory stores start as the resident rows; a file store initialises rows at first use,
    # so its reference is the same store with a cache as large as the table.
    for kind, t1_kernel, reference in (
        ("host", "fused_uvm_caching", lambda: _build(("fused", "fused"))),
        ("file", "key_value", lambda: _build(("fused", "key_value"), _store(tmp, "reference"), 1.0)),
    ):
        model, optimizer = reference()
        want = plain_loop(model, optimizer, [("train", b) for b in batches])
        want_rows, want_dense = _per_id(model), _dense(model)
        out[(kind, "evictions")] = sum(s["evictions"] for s in hash_ebc(model).stats().values())
        for k in (1, 3):
            model, optimizer = _build(("fused_uvm_caching", t1_kernel), _store(tmp, f"{kind}{k}"))
            got = _pipelined(model, optimizer, batches, k)
            stats = hash_ebc(model).stats()
            out[(kind, k)] = {
                "outputs": len(got) == len(want)
                and all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, want, strict=True)),
                "rows": _same_rows(_per_id(model), want_rows),
                "dense": all(torch.equal(v, want_dense[name]) for name, v in _dense(model).items()),
                "swapped": sum(s.get("swap_ins", 0) for s in stats.values()),
                "slots": sum(s.get("cache_slots", 0) for s in stats.values()),
            }
    return out


def test_cached_tables_pipeline_bit_for_bit_like_the_plain_loop(tmp_path: Path) -> None:
    per_rank = run_distributed(_run, 2, str(tmp_path), timeout_s=300)
    for kind in ("host", "file"):
        assert sum(r[(kind, "evictions")] for r in per_rank) > 0  # rows were reused: reset through the stores
    for r in per_rank:
        for kind in ("host", "file"):
            for k in (1, 3):
                got = r[(kind, k)]
                assert got["outputs"], f"{kind} store, pipe_n_batch={k}: losses or outputs differ"
                assert got["rows"], f"{kind} store, pipe_n_batch={k}: embeddings or optimizer state differ"
                assert got["dense"], f"{kind} store, pipe_n_batch={k}: dense weights differ"
                assert got["swapped"] > got["slots"]  # the caches were too small for the ids: rows moved
