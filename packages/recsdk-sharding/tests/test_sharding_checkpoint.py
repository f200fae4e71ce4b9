"""Checkpoints: bit-exact resume, loading on other world sizes, atomic saves, export, bad input."""

from __future__ import annotations

import glob
import itertools
import json
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from sharding_models import SparseNN, shard, sharded_hash_ebc
from torchrec.distributed.planner import ParameterConstraints
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recsdk.data import RandomRecDataset
from recsdk.data.testing import DistributedTestError, rank_slice, run_distributed
from recsdk.embedding import CountAdmission, HashEmbeddingBagConfig, LRUEviction, TTLEviction
from recsdk.sharding import (
    ShardedHashEmbeddingBagCollection,
    export_embeddings,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from recsdk.sharding.checkpoint.layout import fused_counters

SAVE_AT, MORE, BATCH = 6, 4, 32
CAPACITY = 256  # small enough that both tables evict within SAVE_AT steps


def _configs(capacity: int = CAPACITY, dims: tuple[int, int] = (8, 16), extra_table: bool = False):
    configs = [
        HashEmbeddingBagConfig(
            name="t0", embedding_dim=dims[0], num_embeddings=capacity, feature_names=["f0"], eviction=LRUEviction()
        ),
        HashEmbeddingBagConfig(
            name="t1",
            embedding_dim=dims[1],
            num_embeddings=capacity // 4,
            feature_names=["f1"],
            admission=CountAdmission(threshold=2, counter_slots=1024),
            eviction=TTLEviction(max_idle_steps=2),
        ),
        HashEmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=capacity, feature_names=["f2"]),
    ]
    if extra_table:
        configs.append(HashEmbeddingBagConfig(name="t9", embedding_dim=4, num_embeddings=64, feature_names=["f9"]))
    return configs


def _build(capacity: int = CAPACITY, dims: tuple[int, int] = (8, 16), extra_table: bool = False, tw: bool = True):
    """DMP model and its combined optimizer.

    t0: row-wise, LRU eviction, Adagrad; t1: table-wise, admission and TTL eviction,
    RowWiseAdagrad; t2: row-wise, Adam (per-row moments and a per-shard step count).
    """
    torch.manual_seed(0)
    model = SparseNN(_configs(capacity, dims, extra_table), num_dense=4, device="meta")
    bags = model.ebc.embedding_bags
    apply_optimizer_in_backward(torch.optim.Adagrad, [bags["t0"].weight], {"lr": 0.1, "eps": 0.1})
    apply_optimizer_in_backward(RowWiseAdagrad, [bags["t1"].weight], {"lr": 0.1, "eps": 0.1})
    others = [p for n, p in bags.named_parameters() if n.split(".")[0] not in ("t0", "t1")]
    apply_optimizer_in_backward(torch.optim.Adam, others, {"lr": 0.01})
    constraints = {
        "t0": ParameterConstraints(sharding_types=["row_wise"]),
        "t2": ParameterConstraints(sharding_types=["row_wise"]),
    }
    if tw:
        constraints["t1"] = ParameterConstraints(sharding_types=["table_wise"])
    ddp_model = shard(model, batch_size=BATCH, constraints=constraints)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(ddp_model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),  # lazily created state
    )
    return ddp_model, CombinedOptimizer([ddp_model.fused_optimizer, dense])


def _batches(rank: int, world_size: int, start: int, stop: int, features=("f0", "f1", "f2")):
    data = RandomRecDataset(
        batch_size=BATCH,
        num_batches=SAVE_AT + MORE,
        feature_names=list(features),
        id_ranges=[2000, 1500, 100][: len(features)],
        num_dense_features=4,
        pooling_factors=[2, 1, 1][: len(features)],
        seed=7,
        sample_seed=0,
        rank=rank,
        world_size=world_size,
    )
    return itertools.islice(iter(data), start, stop)


def _train(ddp_model, optimizer, batches) -> list[float]:
    losses = []
    for batch in batches:
        loss, _ = ddp_model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _sebc(ddp_model) -> ShardedHashEmbeddingBagCollection:
    return sharded_hash_ebc(ddp_model)


def _snapshot(ddp_model, optimizer) -> dict[str, Any]:
    """Everything a rank holds: per table shard (ids, rows, weights, optimizer state, id-table state), dense state."""
    sebc = _sebc(ddp_model)
    views = sebc.table_views()
    tables = {}
    counters = fused_counters(sebc)
    for name, table in sebc.id_tables.items():
        sd = table.state_dict()
        weight, states = views[name]
        rows = sd["rows"]
        tables[name] = {
            "state_dict": sd,
            "weight": weight[rows].clone(),
            "states": [s[rows].clone() for s in states],
            "full_weight": weight.clone(),
            "counters": {k: v.clone() for k, v in counters[name].items()},
        }
    dense = {k: v.clone() for k, v in ddp_model.state_dict().items() if not k.startswith("ebc.")}
    opt_state = {
        k: {sk: sv.clone() for sk, sv in v.items() if isinstance(sv, torch.Tensor)}
        for k, v in optimizer.state_dict()["state"].items()
        if not k.startswith("ebc.")
    }
    lrs = [g["lr"] for g in optimizer.param_groups]
    return {"tables": tables, "dense": dense, "opt": opt_state, "lrs": lrs}


def _per_id(snapshots: list[dict[str, Any]], name: str) -> dict[str, torch.Tensor]:
    """One table's per-id values over all ranks, sorted by id."""
    parts = [s["tables"][name] for s in snapshots if name in s["tables"]]
    ids = torch.cat([p["state_dict"]["ids"] for p in parts])
    order = torch.argsort(ids)
    out = {
        "ids": ids[order],
        "weight": torch.cat([p["weight"] for p in parts])[order],
        "freq": torch.cat([p["state_dict"]["freq"] for p in parts])[order],
        "age": torch.cat([p["state_dict"]["step"] - p["state_dict"]["last_step"] for p in parts])[order],
    }
    for i in range(len(parts[0]["states"])):
        out[f"state{i}"] = torch.cat([p["states"][i] for p in parts])[order]
    return out


# ---- the reference run: train, save, export, train on -------------------------------------------


def _train_save_continue(rank: int, world_size: int, root: str) -> dict[str, Any]:
    ddp_model, optimizer = _build()
    losses = _train(ddp_model, optimizer, _batches(rank, world_size, 0, 2))
    for group in optimizer.param_groups:  # what a learning-rate scheduler does
        group["lr"] = group["lr"] * 0.5
    losses += _train(ddp_model, optimizer, _batches(rank, world_size, 2, SAVE_AT))
    extra = {"step": SAVE_AT, "rng": torch.get_rng_state(), "rank": rank}
    saved = save_checkpoint(ddp_model, optimizer, os.path.join(root, "ckpt"), extra=extra)
    at_save = _snapshot(ddp_model, optimizer)
    counts = export_embeddings(ddp_model, os.path.join(root, "export"))
    losses += _train(ddp_model, optimizer, _batches(rank, world_size, SAVE_AT, SAVE_AT + MORE))
    end = _snapshot(ddp_model, optimizer)
    return {"saved": saved, "losses": losses, "at_save": at_save, "end": end, "counts": counts}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, run_distributed(_train_save_continue, 2, str(root), timeout_s=120)


def test_save_publishes_one_complete_directory(reference) -> None:
    root, results = reference
    assert results[0]["saved"] == str(root / "ckpt")
    assert (root / "ckpt" / "recsdk_checkpoint.json").is_file()
    assert not glob.glob(str(root / ".*partial*")), "temporary directories left behind"
    assert latest_checkpoint(root) == str(root / "ckpt")
    # The state the test relies on: both tables evicted, t1 admitted only part of its ids.
    for r in results:
        for name in ("t0", "t1"):
            if name not in r["at_save"]["tables"]:
                continue
            stats = r["at_save"]["tables"][name]["state_dict"]["stats"]
            assert int(stats[1]) > 0, f"table {name}: no eviction happened, the test would not cover it"
    t1 = next(r["at_save"]["tables"]["t1"] for r in results if "t1" in r["at_save"]["tables"])
    assert int(t1["state_dict"]["stats"][2]) > 0, "t1: no admission reject"


# ---- bit-exact resume -----------------------------------------------------------------------------


def _resume(rank: int, world_size: int, path: str) -> dict[str, Any]:
    ddp_model, optimizer = _build()
    extra = load_checkpoint(ddp_model, optimizer, path)
    torch.set_rng_state(extra["rng"])  # re-initialisation of reused rows draws from it
    loaded = _snapshot(ddp_model, optimizer)
    losses = _train(ddp_model, optimizer, _batches(rank, world_size, extra["step"], SAVE_AT + MORE))
    return {"extra": extra, "loaded": loaded, "losses": losses, "end": _snapshot(ddp_model, optimizer)}


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def test_resume_in_new_processes_is_bit_exact(reference) -> None:
    root, ref = reference
    resumed = run_distributed(_resume, 2, str(root / "ckpt"), timeout_s=120)
    for rank in range(2):
        r, f = resumed[rank], ref[rank]
        assert r["extra"]["step"] == SAVE_AT and r["extra"]["rank"] == rank
        # Loading restores every rank's state exactly: id tables (rows, free stack, metadata,
        # admission counters, statistics), every weight row, optimizer state, dense state, lrs.
        _assert_same(r["loaded"], f["at_save"], f"rank {rank} after load")
        # Training on gives the uninterrupted run's losses and final state, bit for bit.
        assert r["losses"] == f["losses"][SAVE_AT:], f"rank {rank}: losses differ"
        _assert_same(r["end"], f["end"], f"rank {rank} at the end")


# ---- other world sizes ----------------------------------------------------------------------------


def _load_elsewhere(rank: int, world_size: int, path: str, capacity: int) -> dict[str, Any]:
    ddp_model, optimizer = _build(capacity=capacity, tw=world_size > 1)
    extra = load_checkpoint(ddp_model, optimizer, path)
    loaded = _snapshot(ddp_model, optimizer)
    sebc = _sebc(ddp_model)
    capacities = {name: t.capacity for name, t in sebc.id_tables.items()}
    torch.set_rng_state(extra["rng"])
    losses = _train(ddp_model, optimizer, _batches(rank, world_size, SAVE_AT, SAVE_AT + 2))
    return {"extra": extra, "loaded": loaded, "capacities": capacities, "losses": losses}


def _bad_inputs_then_load(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """On one rank: every bad load raises and leaves the model as it was; then a good load."""
    path = os.path.join(root, "ckpt")
    errors: dict[str, tuple[str, str]] = {}

    def attempt(case: str, fn) -> None:
        try:
            fn()
        except Exception as e:
            errors[case] = (type(e).__name__, str(e))

    ddp_model, optimizer = _build(capacity=CAPACITY // 2, tw=False)  # 128 rows: too few for t0's 256 ids
    _train(ddp_model, optimizer, _batches(rank, world_size, 0, 1))
    before = _snapshot(ddp_model, optimizer)
    empty = os.path.join(root, "empty")
    os.makedirs(empty, exist_ok=True)
    a_file = os.path.join(root, "a_file")
    Path(a_file).write_text("not a checkpoint")
    attempt("missing", lambda: load_checkpoint(ddp_model, optimizer, os.path.join(root, "nope")))
    attempt("file", lambda: load_checkpoint(ddp_model, optimizer, a_file))
    attempt("empty", lambda: load_checkpoint(ddp_model, optimizer, empty))
    attempt("export", lambda: load_checkpoint(ddp_model, optimizer, os.path.join(root, "export")))
    attempt("capacity", lambda: load_checkpoint(ddp_model, optimizer, path))
    attempt("exists", lambda: save_checkpoint(ddp_model, optimizer, path))
    unchanged_after_capacity = _same(_snapshot(ddp_model, optimizer), before)

    other, other_optimizer = _build(dims=(8, 12), extra_table=True, tw=False)
    other_before = _snapshot(other, other_optimizer)
    attempt("tables", lambda: load_checkpoint(other, other_optimizer, path))
    unchanged_after_tables = _same(_snapshot(other, other_optimizer), other_before)

    good = _load_elsewhere(rank, world_size, path, CAPACITY)
    return {
        "errors": errors,
        "unchanged_after_capacity": unchanged_after_capacity,
        "unchanged_after_tables": unchanged_after_tables,
        "good": good,
    }


def _same(a: Any, b: Any) -> bool:
    try:
        _assert_same(a, b, "")
    except AssertionError:
        return False
    return True


@pytest.fixture(scope="module")
def on_one_rank(reference) -> dict[str, Any]:
    root, _ = reference
    return run_distributed(_bad_inputs_then_load, 1, str(root), timeout_s=120)[0]


def test_bad_input_raises_clear_errors_and_changes_nothing(on_one_rank) -> None:
    errors = on_one_rank["errors"]
    assert set(errors) == {"missing", "file", "empty", "export", "capacity", "exists", "tables"}, errors
    assert errors["missing"][0] == "FileNotFoundError" and "does not exist" in errors["missing"][1]
    for case in ("file", "empty", "export"):
        assert errors[case][0] == "ValueError" and "is not a checkpoint" in errors[case][1], errors[case]
    kind, message = errors["capacity"]
    assert kind == "ValueError" and "do not fit" in message, message
    assert "table 't0'" in message and "rank 0 would hold 256 ids" in message and "capacity 128" in message, message
    assert on_one_rank["unchanged_after_capacity"]
    kind, message = errors["tables"]
    assert kind == "ValueError" and "does not match the model" in message, message
    assert "table 't1': embedding_dim 16 in the checkpoint, 12 in the model" in message, message
    assert "table 't9' is in the model but not in the checkpoint" in message, message
    assert on_one_rank["unchanged_after_tables"]
    assert errors["exists"][0] == "FileExistsError"


@pytest.mark.parametrize(("world_size", "capacity"), [(1, CAPACITY), (3, 4 * CAPACITY)])
def test_load_on_another_world_size_keeps_every_id(reference, on_one_rank, world_size: int, capacity: int) -> None:
    root, ref = reference
    if world_size == 1:
        results = [on_one_rank["good"]]
    else:
        results = run_distributed(_load_elsewhere, world_size, str(root / "ckpt"), capacity, timeout_s=120)
    saved = [r["at_save"] for r in ref]
    loaded = [r["loaded"] for r in results]
    for name in ("t0", "t1", "t2"):
        before, after = _per_id(saved, name), _per_id(loaded, name)
        assert torch.equal(before["ids"], after["ids"]), f"table {name}: stored ids differ"
        for key in before:
            assert torch.equal(before[key], after[key]), f"table {name}: {key} per id differs"
    # Adam's step count per shard: the max over the saved shards, on every new shard.
    saved_steps = [s["tables"]["t2"]["counters"]["t2.step"] for s in saved]
    assert all(int(s["tables"]["t2"]["counters"]["t2.step"]) == int(max(saved_steps)) > 0 for s in loaded)
    t0_ranks = [r for r, s in enumerate(loaded) if "t0" in s["tables"]]
    assert t0_ranks == list(range(world_size))
    from recsdk.sharding import owner

    for r in t0_ranks:  # rows re-bucketed by owner over the new world size
        ids = loaded[r]["tables"]["t0"]["state_dict"]["ids"]
        assert bool((owner(ids, world_size) == r).all())
    # The shard capacities follow the new world size.
    assert sum(res["capacities"]["t0"] for res in results) == capacity
    # Dense state, optimizer state and learning rates come back as saved; training goes on.
    for res in results:
        _assert_same(res["loaded"]["dense"], saved[0]["dense"], "dense")
        _assert_same(res["loaded"]["opt"], saved[0]["opt"], "dense optimizer state")
        assert sorted(set(res["loaded"]["lrs"])) == sorted(set(saved[0]["lrs"]))
        assert res["extra"]["rank"] == 0  # another world size: rank 0's extra
        assert all(torch.isfinite(torch.tensor(res["losses"])))


# ---- export -----------------------------------------------------------------------------------------


def test_export_writes_each_id_once_with_its_embedding(reference) -> None:
    root, ref = reference
    manifest = json.loads((root / "export" / "recsdk_embeddings.json").read_text())
    saved = [r["at_save"] for r in ref]
    for name, files in (("t0", 2), ("t1", 1)):  # one part per rank holding a shard
        entry = manifest["tables"][name]
        assert len(entry["files"]) == files and entry["embedding_dim"] == {"t0": 8, "t1": 16}[name]
        table = pq.read_table(root / "export" / name)
        ids = torch.from_numpy(table.column("id").to_numpy())
        emb = torch.from_numpy(table.column("embedding").combine_chunks().flatten().to_numpy().copy())
        emb = emb.view(len(ids), -1)
        order = torch.argsort(ids)
        expected = _per_id(saved, name)
        assert torch.equal(ids[order], expected["ids"]), f"table {name}: exported ids differ"
        assert torch.equal(emb[order], expected["weight"]), f"table {name}: exported embeddings differ"
        assert entry["num_ids"] == len(ids) == ref[0]["counts"][name]


# ---- a save killed on the way -------------------------------------------------------------------


def _killed_mid_save(rank: int, world_size: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    ddp_model, optimizer = _build()
    _train(ddp_model, optimizer, _batches(rank, world_size, 0, 2))
    save_checkpoint(ddp_model, optimizer, os.path.join(root, "a"), extra={"step": 2})
    torch.save(_snapshot(ddp_model, optimizer), os.path.join(root, f"snapshot{rank}.pt"))
    _train(ddp_model, optimizer, _batches(rank, world_size, 2, 3))
    if rank == 1:  # dies once its data is written, before the checkpoint is published
        write_data = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()
            os._exit(17)

        dcp.FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    save_checkpoint(ddp_model, optimizer, os.path.join(root, "b"), extra={"step": 3})


def _load_after_kill(rank: int, world_size: int, root: str, partial: str) -> dict[str, Any]:
    ddp_model, optimizer = _build()
    try:
        load_checkpoint(ddp_model, optimizer, partial)
        partial_error = ""
    except ValueError as e:
        partial_error = str(e)
    extra = load_checkpoint(ddp_model, optimizer, latest_checkpoint(root))
    expected = torch.load(os.path.join(root, f"snapshot{rank}.pt"), weights_only=False)
    return {"partial_error": partial_error, "extra": extra, "same": _same(_snapshot(ddp_model, optimizer), expected)}


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    with pytest.raises(DistributedTestError, match="exited with code 17"):
        run_distributed(_killed_mid_save, 2, str(tmp_path), timeout_s=30)
    assert (tmp_path / "a" / "recsdk_checkpoint.json").is_file()
    assert not (tmp_path / "b").exists(), "an unfinished checkpoint was published"
    partials = glob.glob(str(tmp_path / ".b.partial-*"))
    assert len(partials) == 1 and not os.path.exists(os.path.join(partials[0], "recsdk_checkpoint.json"))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "a")
    results = run_distributed(_load_after_kill, 2, str(tmp_path), partials[0], timeout_s=120)
    for r in results:
        assert "incomplete checkpoint" in r["partial_error"], r["partial_error"]
        assert r["extra"] == {"step": 2}
        assert r["same"], "the previous checkpoint did not load back exactly"


# ---- the unpooled collection ----------------------------------------------------------------------


def _per_id_rows(sec) -> dict[int, list[torch.Tensor]]:
    """Per stored id of every table this rank holds: its weight row and optimizer state rows."""
    views = sec.table_views()
    out = {}
    for name, table in sec.id_tables.items():
        ids, rows = table.ids_and_rows()
        weight, states = views[name]
        for i, r in zip(ids.tolist(), rows.tolist(), strict=True):
            out[(name, i)] = [weight[r].clone(), *(s[r].clone() for s in states)]
    return out


def _ec_round_trip(rank: int, world_size: int, root: str, save: bool) -> dict[str, Any]:
    from test_sharding_hash_ec import GLOBAL_BATCH, _batch, _sharded_model

    ddp_model, sec = _sharded_model("row_wise" if world_size > 1 else None)

    def train(start: int, stop: int) -> None:
        for step in range(start, stop):
            loss, _ = ddp_model(rank_slice(_batch(GLOBAL_BATCH, seed=step), rank, world_size))
            loss.backward()

    path = os.path.join(root, "ec")
    if not save:  # another world size: the tables are rebuilt by id
        load_checkpoint(ddp_model, None, path)
        return {"loaded": _per_id_rows(sec)}
    train(0, 3)
    save_checkpoint(ddp_model, None, path)
    saved = _per_id_rows(sec)
    counts = export_embeddings(ddp_model, os.path.join(root, "ec_export"))
    train(3, 5)
    load_checkpoint(ddp_model, None, path)
    return {"saved": saved, "loaded": _per_id_rows(sec), "counts": counts}


def test_an_unpooled_hash_collection_round_trips_reshards_and_exports(tmp_path: Path) -> None:
    ranks = run_distributed(_ec_round_trip, 2, str(tmp_path), True, timeout_s=120)
    saved = {k: v for r in ranks for k, v in r["saved"].items()}
    for r in ranks:
        _assert_same(r["loaded"], r["saved"], "same world size")
    (one,) = run_distributed(_ec_round_trip, 1, str(tmp_path), False, timeout_s=120)
    _assert_same(one["loaded"], saved, "one rank")
    for name in ("item", "user"):
        table = pq.read_table(tmp_path / "ec_export" / name)
        assert sorted(table.column("id").to_pylist()) == sorted(i for t, i in saved if t == name)
        assert ranks[0]["counts"][name] == table.num_rows


# ---- TorchRec-sharded tables beside the hash tables -----------------------------------------------


class _WithPlainEBC(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        self.ebc = SparseNN(_configs()[:1], num_dense=4, device="meta").ebc
        self.plain = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="p0", embedding_dim=4, num_embeddings=64, feature_names=["g0"])],
            device=torch.device("meta"),
        )


def _sharded_state(ddp_model, optimizer) -> list[torch.Tensor]:
    weight = ddp_model.state_dict()["plain.embedding_bags.p0.weight"]
    state = optimizer.state_dict()["state"].get("plain.embedding_bags.p0.weight", {})
    tensors = [s.tensor for s in weight.local_shards()]
    tensors += [s.tensor for value in state.values() for s in value.local_shards()]
    return tensors


def _plain_round_trip(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _WithPlainEBC()
    apply_optimizer_in_backward(torch.optim.Adagrad, model.parameters(), {"lr": 0.1, "eps": 0.1})
    constraints = {"p0": ParameterConstraints(sharding_types=["table_wise"])}
    ddp_model = shard(model, batch_size=BATCH, constraints=constraints)
    optimizer = CombinedOptimizer([ddp_model.fused_optimizer])
    with torch.no_grad():
        for t in _sharded_state(ddp_model, optimizer):
            t.copy_(torch.rand(t.shape))
    saved = [t.clone() for t in _sharded_state(ddp_model, optimizer)]
    path = save_checkpoint(ddp_model, optimizer, os.path.join(root, "ckpt"))
    with torch.no_grad():
        for t in _sharded_state(ddp_model, optimizer):
            t.fill_(7.0)
    load_checkpoint(ddp_model, optimizer, path)
    return {"saved": saved, "loaded": [t.clone() for t in _sharded_state(ddp_model, optimizer)]}


def test_torchrec_sharded_tensors_load_back_through_staging(tmp_path: Path) -> None:
    ranks = run_distributed(_plain_round_trip, 2, str(tmp_path), timeout_s=120)
    assert sum(len(r["saved"]) for r in ranks) == 2, "the table-wise weight and its Adagrad state, on one rank"
    for r in ranks:
        _assert_same(r["loaded"], r["saved"], "plain EBC weight and optimizer state")
