"""Hash tables behind a device cache: rows in host memory (fused_uvm_caching) or in files (key_value).

What a user relies on: training through the cache is the all-resident training, bit for bit
(losses, embeddings and optimizer state per id), whatever the load factor; checkpoints carry
the whole table between cached and resident models; bad settings fail at construction, naming
the table.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from sharding_models import SparseNN, host_env, shard, sharded_hash_ebc, synthetic_data, tables
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import CacheAlgorithm, CacheParams, KeyValueParams
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recsdk.data.testing import run_distributed
from recsdk.embedding import LFUEviction, LRUEviction
from recsdk.sharding import export_embeddings, get_default_hybrid_sharders, load_checkpoint, save_checkpoint

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "eps": 0.01}),
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.1, "eps": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}),
}
BATCH, STEPS = 16, 24
CAPACITY = 400  # < the ids the task draws: the id tables evict (LRU), rows are reused


def _constraints(kernel: str, load_factor: float | None, directory: Path | None, sharding: str) -> dict:
    cache = CacheParams(load_factor=load_factor, algorithm=CacheAlgorithm.LRU) if load_factor else None
    kv = KeyValueParams(ssd_storage_directory=str(directory)) if directory is not None else None
    return {
        t: ParameterConstraints(
            sharding_types=[sharding], compute_kernels=[kernel], cache_params=cache, key_value_params=kv
        )
        for t in ("t0", "t1")
    }


def _build(optimizer: str, constraints: dict, eviction=None):
    torch.manual_seed(11)
    model = SparseNN(tables(capacity=CAPACITY, eviction=eviction or LRUEviction()), num_dense=4, device="meta")
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(cls, model.ebc.parameters(), dict(kwargs))
    dmp = shard(model, BATCH, constraints)
    return dmp, torch.optim.SGD(dmp.module.dense.parameters(), lr=0.05)


def _train(dmp, dense_opt, rank: int, world_size: int, steps: int = STEPS, sample_seed: int = 1) -> list[float]:
    losses = []
    for batch in synthetic_data(rank, world_size, steps, BATCH, sample_seed):
        loss, _ = dmp(batch)
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()
        losses.append(loss.item())
    return losses


def _per_id(dmp) -> dict[str, dict[int, list[torch.Tensor]]]:
    """Per table, id -> [embedding, *per-row optimizer state] (from wherever the rows live)."""
    sebc = sharded_hash_ebc(dmp)
    views = sebc.table_views()
    out = {}
    for name, table in sebc.id_tables.items():
        ids, rows = table.ids_and_rows()
        tensors = [views[name].weight, *views[name].states]
        out[name] = {i: [t[r].clone() for t in tensors] for i, r in zip(ids.tolist(), rows.tolist(), strict=True)}
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys()
        and all(torch.equal(x, y) for i in a[n] for x, y in zip(a[n][i], b[n][i], strict=True))
        for n in a
    )


def _lossless_run(rank: int, world_size: int, optimizer: str, tmp: str) -> dict:
    runs = {
        "resident": _constraints("fused", None, None, "row_wise"),
        "host 0.25": _constraints("fused_uvm_caching", 0.25, None, "row_wise"),
        "file 1.0": _constraints("key_value", 1.0, Path(tmp), "table_wise"),
        "file 0.25": _constraints("key_value", 0.25, Path(tmp) / "second", "table_wise"),
    }
    (Path(tmp) / "second").mkdir(exist_ok=True)
    out = {}
    for name, constraints in runs.items():
        dmp, dense_opt = _build(optimizer, constraints)
        losses = _train(dmp, dense_opt, rank, world_size)
        out[name] = {"losses": losses, "rows": _per_id(dmp), "stats": sharded_hash_ebc(dmp).stats()}
    return {
        "host_losses": out["host 0.25"]["losses"] == out["resident"]["losses"],
        "host_rows": _same(out["host 0.25"]["rows"], out["resident"]["rows"]),
        "file_losses": out["file 0.25"]["losses"] == out["file 1.0"]["losses"],
        "file_rows": _same(out["file 0.25"]["rows"], out["file 1.0"]["rows"]),
        "stats": out["host 0.25"]["stats"],
        "file_stats": out["file 0.25"]["stats"],
        "evictions": sum(s["evictions"] for s in out["resident"]["stats"].values()),
    }


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_training_through_the_cache_is_the_all_resident_training(optimizer: str, tmp_path: Path) -> None:
    per_rank = run_distributed(_lossless_run, 2, optimizer, str(tmp_path), timeout_s=240)
    for r in per_rank:
        assert r["evictions"] > 0  # ids were evicted and their rows reused (reset through the store)
        assert r["host_losses"] and r["host_rows"], "host-memory store at load factor 0.25 differs from resident"
        assert r["file_losses"] and r["file_rows"], "file store at load factor 0.25 differs from 1.0"
        for name, stats in r["stats"].items():
            assert stats["swap_ins"] > stats["cache_slots"]  # the cache was too small: rows moved
            assert 0.0 < stats["cache_hit_rate"] < 1.0
            assert stats["store_rows"] == CAPACITY // 2 and stats["store_rows_used"] == stats["size"], name
    tables_on = [set(r["file_stats"]) for r in per_rank]
    assert set().union(*tables_on) == {"t0", "t1"}  # table-wise: each table on one rank, with its file store


def _lfu_run(rank: int, world_size: int) -> bool:
    results = []
    for kernel, lf in (("fused", None), ("fused_uvm_caching", 0.2)):
        cons = {
            t: ParameterConstraints(
                sharding_types=["row_wise"],
                compute_kernels=[kernel],
                cache_params=CacheParams(load_factor=lf, algorithm=CacheAlgorithm.LFU) if lf else None,
            )
            for t in ("t0", "t1")
        }
        dmp, dense_opt = _build("rowwise_adagrad", cons, eviction=LFUEviction())
        model = dmp.module
        losses = _train(dmp, dense_opt, rank, world_size, steps=8)
        model.eval()  # eval looks up through the cache too, and changes nothing
        with torch.no_grad():
            scores = [model(b)[1] for b in synthetic_data(rank, world_size, 4, BATCH, sample_seed=9)]
        results.append((losses, torch.cat(scores), _per_id(dmp)))
    (la, sa, ra), (lb, sb, rb) = results
    return la == lb and torch.equal(sa, sb) and _same(ra, rb)


def test_lfu_cache_and_eval_match_the_resident_model() -> None:
    assert run_distributed(_lfu_run, 2, timeout_s=180) == [True, True]


def _checkpoint_run(rank: int, world_size: int, path: str, save: bool, kernel: str, store_dir: str) -> dict:
    directory = Path(store_dir) if kernel == "key_value" else None
    dmp, dense_opt = _build("adagrad", _constraints(kernel, 0.25 if kernel != "fused" else None, directory, "row_wise"))
    if save:
        _train(dmp, dense_opt, rank, world_size, steps=12)
        save_checkpoint(dmp, dmp.fused_optimizer, path)
        export_embeddings(dmp, path + "_export")  # reads the rows from wherever they live
    else:
        load_checkpoint(dmp, dmp.fused_optimizer, path)
        if directory is not None:  # a file store stages the load in files beside it, gone once mapped
            names = {f.name for f in (directory / f"rank{rank}").iterdir()}
            assert names == {f"ebc.{t}.{kind}" for t in ("t0", "t1") for kind in ("weight", "state0")}, names
    return {"rows": _per_id(dmp)}


def _merge(per_rank: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for r in per_rank:
        for name, per_id in r["rows"].items():
            out.setdefault(name, {}).update(per_id)
    return out


@pytest.mark.parametrize(("saver", "loader"), [("fused_uvm_caching", "fused"), ("fused", "key_value")])
def test_checkpoints_carry_the_whole_table_between_cached_and_resident(saver: str, loader: str, tmp_path: Path) -> None:
    path, stores = str(tmp_path / "ckpt"), tmp_path / "stores"
    stores.mkdir()
    saved = run_distributed(_checkpoint_run, 2, path, True, saver, str(stores), timeout_s=180)
    loaded = run_distributed(_checkpoint_run, 2, path, False, loader, str(stores), timeout_s=180)
    assert _same(_merge(saved), _merge(loaded))  # every id, its row and optimizer state
    resharded = run_distributed(_checkpoint_run, 1, path, False, loader, str(stores), timeout_s=180)
    assert _same(_merge(saved), _merge(resharded))  # 2 ranks -> 1, by id
    for name, per_id in _merge(saved).items():
        table = pq.read_table(tmp_path / "ckpt_export" / name)
        ids = table.column("id").to_pylist()
        emb = torch.from_numpy(table.column("embedding").combine_chunks().flatten().to_numpy().copy())
        emb = emb.view(len(ids), -1)
        assert sorted(ids) == sorted(per_id)
        assert all(torch.equal(emb[k], per_id[i][0]) for k, i in enumerate(ids)), f"table {name}: exported rows"


def _bad_run(rank: int, world_size: int, kind: str, tmp: str) -> str:
    if kind == "load_factor":  # rejected by the enumerator, which every rank builds
        cons = _constraints("fused_uvm_caching", 1.5, None, "row_wise")
    elif kind == "no_dir":
        cons = {"t0": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["key_value"])}
    elif kind == "missing_dir":  # the directory is checked where the store is made
        cons = _constraints("key_value", 0.5, Path(tmp) / "absent", "row_wise")
    else:  # one rank's directory is a file: that rank fails, the other hears of it
        if rank == 1:
            (Path(tmp) / "rank1").write_text("not a directory")
        cons = _constraints("key_value", 0.5, Path(tmp), "row_wise")
    try:
        _build("sgd", cons)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("kind", ["load_factor", "no_dir", "missing_dir", "one_rank"])
def test_bad_cache_settings_fail_on_every_rank_naming_the_table(kind: str, tmp_path: Path) -> None:
    per_rank = run_distributed(_bad_run, 2, kind, str(tmp_path), timeout_s=90)
    expected = {
        "load_factor": "load_factor must be a number in (0, 1]",
        "missing_dir": "does not exist",
        "no_dir": "ssd_storage_directory",
        "one_rank": "is not a directory",
    }[kind]
    if kind == "one_rank":
        assert expected in per_rank[1] and "table 't0'" in per_rank[1]
        assert "PeerFailureError" in per_rank[0] and "creating the row stores" in per_rank[0], per_rank[0]
        return
    for message in per_rank:
        assert message.startswith("ValueError") and "table 't0'" in message and expected in message, message


def _hand_written_plan(rank: int, world_size: int) -> str:
    """A plan that did not come from recsdk's planner: the module checks it at construction."""
    model = SparseNN(tables(capacity=CAPACITY), num_dense=4, device="meta")
    dmp = shard(model, BATCH, _constraints("fused_uvm_caching", 0.5, None, "row_wise"))
    plan = dmp.plan
    for sharding in plan.plan["ebc"].values():
        sharding.cache_params = CacheParams(load_factor=0.0)
    try:
        DistributedModelParallel(
            SparseNN(tables(capacity=CAPACITY), num_dense=4, device="meta"),
            device=torch.device("cpu"),
            plan=plan,
            sharders=get_default_hybrid_sharders(host_env=host_env()),
        )
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_hand_written_plan_with_a_bad_load_factor_fails_at_construction() -> None:
    for message in run_distributed(_hand_written_plan, 2, timeout_s=90):
        assert "table 't0'" in message and "load_factor must be a number in (0, 1]" in message and "0.0" in message


def _too_small_run(rank: int, world_size: int) -> str:
    dmp, dense_opt = _build("sgd", _constraints("fused_uvm_caching", 0.02, None, "row_wise"))
    try:
        _train(dmp, dense_opt, rank, world_size, steps=2)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_batch_larger_than_the_cache_fails_every_rank_naming_the_table() -> None:
    per_rank = run_distributed(_too_small_run, 2, timeout_s=90)
    assert any("device cache has 4 slots" in m and "raise cache_params.load_factor" in m for m in per_rank), per_rank
    assert all(m != "no error" for m in per_rank)


def _disk_full_run(rank: int, world_size: int, tmp: str) -> str:
    import recsdk.sharding.rows.row_store as row_store

    dmp, dense_opt = _build("sgd", _constraints("key_value", 0.5, Path(tmp), "row_wise"))
    if rank == 1:  # the disk under rank 1's store fills up (another process wrote there)
        row_store.free_bytes = lambda directory: 4096
    try:
        _train(dmp, dense_opt, rank, world_size, steps=2)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_store_whose_disk_fills_up_fails_every_rank_naming_the_table(tmp_path: Path) -> None:
    own, peer = run_distributed(_disk_full_run, 2, str(tmp_path), timeout_s=90)[::-1]
    assert own.startswith("OSError") and "table 't" in own and "4096 bytes free" in own and str(tmp_path) in own, own
    assert peer.startswith("PeerFailureError") and "rank(s) [1]" in peer, peer


def _sparse_run(rank: int, world_size: int, tmp: str) -> dict:
    _dmp, _ = _build("rowwise_adagrad", _constraints("key_value", 0.1, Path(tmp), "row_wise"))
    files = sorted((Path(tmp) / f"rank{rank}").iterdir())
    return {f.name: (f.stat().st_size, f.stat().st_blocks * 512) for f in files}


def test_the_file_store_starts_sparse(tmp_path: Path) -> None:
    per_rank = run_distributed(_sparse_run, 2, str(tmp_path), timeout_s=90)
    for files in per_rank:
        assert {"ebc.t0.weight", "ebc.t0.state0", "ebc.t1.weight", "ebc.t1.state0"} <= set(files)  # <module>.<table>
        assert files["ebc.t1.weight"][0] == (CAPACITY // 2) * 16 * 4  # every row of the shard, fp32, dim 16
        assert all(used == 0 for _, used in files.values())  # nothing written yet
