"""Publishing versions: replaying full + deltas gives exactly the model's state at every version."""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from publish_helpers import compare, true_state
from sharding_models import SparseNN, shard, synthetic_data
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import CacheAlgorithm, CacheParams
from torchrec.modules.embedding_configs import DataType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsdk.data import Batch
from recsdk.data.testing import rank_slice, run_distributed
from recsdk.embedding import (
    CountAdmission,
    HashEmbeddingBagConfig,
    LFUEviction,
    LRUEviction,
    PublicationError,
    TTLEviction,
    read_version,
)
from recsdk.sharding import Publisher, load_checkpoint, save_checkpoint, sharded_hash_modules

BATCH = 32


def _tables(dims: tuple[int, int] = (8, 16), fp16: bool = False) -> list[HashEmbeddingBagConfig]:
    """t0: an LRU table smaller than its ids (evicts, ids come back); t1: a TTL table (ids expire),
    admitting an id at its second sighting, its rows in fp16 with ``fp16``."""
    return [
        HashEmbeddingBagConfig(
            name="t0", embedding_dim=dims[0], num_embeddings=300, feature_names=["f0"], eviction=LRUEviction()
        ),
        HashEmbeddingBagConfig(
            name="t1",
            embedding_dim=dims[1],
            num_embeddings=600,
            feature_names=["f1"],
            eviction=TTLEviction(max_idle_steps=3),
            admission=CountAdmission(threshold=2),
            data_type=DataType.FP16 if fp16 else DataType.FP32,
        ),
    ]


def build(sharding: str, cached: bool = False, dims: tuple[int, int] = (8, 16), fp16: bool = False):
    torch.manual_seed(3)
    model = SparseNN(_tables(dims, fp16), num_dense=4, device="meta")
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05, "eps": 0.01})
    cache = CacheParams(load_factor=0.5, algorithm=CacheAlgorithm.LRU) if cached else None
    constraints = {
        "t0": ParameterConstraints(
            sharding_types=[sharding],
            compute_kernels=["fused_uvm_caching" if cached else "fused"],
            cache_params=cache,
        ),
        "t1": ParameterConstraints(sharding_types=[sharding]),
    }
    dmp = shard(model, BATCH // dist.get_world_size(), constraints)
    return dmp, torch.optim.SGD(dmp.module.dense.parameters(), lr=0.05)


def train(dmp, dense_opt, batches) -> None:
    for batch in batches:
        loss, _ = dmp(batch)
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()


def _schedule(rank: int, world_size: int, root: str, sharding: str, cached: bool, dtype: str, fp16: bool) -> dict:
    torch.set_num_threads(1)
    dmp, opt = build(sharding, cached, fp16=fp16)
    publisher = Publisher(dmp, os.path.join(root, "pub"), full_every=4, dtype=getattr(torch, dtype))
    data = iter(synthetic_data(rank, world_size, 60, BATCH // world_size, sample_seed=5))
    schedule = random.Random(17)  # the same on every rank
    atol = {"float32": 0.0, "float16": 2e-4, "uint8": 5e-3}[dtype]
    problems, kinds = [], []
    for i in range(9):
        train(dmp, opt, [next(data) for _ in range(schedule.randint(1, 5))])
        version = publisher.publish(step=i)
        truth = true_state(dmp, os.path.join(root, f"export{i}"))
        if rank == 0:
            problems += compare(os.path.join(root, "pub"), version, truth, atol)
            kinds.append(read_version(os.path.join(root, "pub"), version).kind)
    stats = sharded_stats(dmp)
    return {"problems": problems, "kinds": kinds, "records": publisher.records, "stats": stats}


def sharded_stats(dmp) -> dict:
    (module,) = sharded_hash_modules(dmp).values()
    return module.stats()


@pytest.mark.parametrize(
    ("sharding", "cached", "dtype", "fp16"),
    [
        ("row_wise", False, "float32", False),
        ("table_wise", False, "float32", False),
        ("row_wise", True, "float32", False),
        ("row_wise", False, "float32", True),
        ("row_wise", False, "float16", False),
        ("table_wise", False, "uint8", False),
    ],
)
def test_replaying_full_and_deltas_gives_the_model_at_every_version(
    tmp_path: Path, sharding: str, cached: bool, dtype: str, fp16: bool
) -> None:
    """A random schedule of training and publishing on small LRU and TTL tables (ids evicted,
    expired, not yet admitted, and back): replaying the versions gives the model's state at
    each (bit for bit in fp32; fp16 within its rounding; int8 within half a quantization step)."""
    results = run_distributed(_schedule, 2, str(tmp_path), sharding, cached, dtype, fp16)
    r = results[0]
    assert r["problems"] == [], r["problems"]
    assert r["kinds"] == ["full", "delta", "delta", "delta", "full", "delta", "delta", "delta", "full"]
    evictions = sum(x["stats"][name]["evictions"] for x in results for name in x["stats"])
    assert evictions > 0, [x["stats"] for x in results]  # ids were evicted (and published as deletions)
    assert sum(rec.deleted for rec in r["records"]) > 0, r["records"]
    deltas = [rec for rec in r["records"] if rec.kind == "delta"]
    fulls = [rec for rec in r["records"] if rec.kind == "full"]
    assert max(d.ids for d in deltas) < max(f.ids for f in fulls), r["records"]


# ---- a failed publish, then a good one --------------------------------------------------------


def _failed_then_good(rank: int, world_size: int, root: str) -> dict:
    import errno

    import recsdk.sharding.publishing.publisher as publisher_module

    torch.set_num_threads(1)
    dmp, opt = build("row_wise")
    pub_root = os.path.join(root, "pub")
    publisher = Publisher(dmp, pub_root, full_every=100)
    data = iter(synthetic_data(rank, world_size, 40, BATCH // world_size, sample_seed=2))
    train(dmp, opt, [next(data) for _ in range(3)])
    publisher.publish(step=3)
    train(dmp, opt, [next(data) for _ in range(4)])
    write_table = publisher_module.write_table
    if rank == 1:

        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, "no space left on device")

        publisher_module.write_table = full_disk
    error = None
    try:
        publisher.publish(step=7)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    publisher_module.write_table = write_table
    dist.barrier()
    leftovers = sorted(n for n in os.listdir(pub_root) if n.startswith("."))
    train(dmp, opt, [next(data) for _ in range(4)])
    version = publisher.publish(step=11)
    truth = true_state(dmp, os.path.join(root, "export"))
    problems = compare(pub_root, version, truth) if rank == 0 else []
    return {"error": error, "leftovers": leftovers, "version": version, "problems": problems}


def test_a_failed_publish_raises_everywhere_and_its_changes_go_into_the_next(tmp_path: Path) -> None:
    results = run_distributed(_failed_then_good, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not raise"
        assert r["leftovers"] == [], r["leftovers"]
        assert r["version"] == 1, r  # the failed one was not published
    assert "no space left on device" in results[1]["error"], results[1]["error"]
    assert results[0]["error"].startswith("CheckpointError"), results[0]["error"]
    assert results[0]["problems"] == [], results[0]["problems"]
    assert read_version(tmp_path / "pub", 1).kind == "delta"


# ---- after a checkpoint load: a full version, on the same or another world size ---------------


def _save(rank: int, world_size: int, root: str) -> None:
    torch.set_num_threads(1)
    dmp, opt = build("row_wise")
    publisher = Publisher(dmp, os.path.join(root, "pub"))
    train(dmp, opt, synthetic_data(rank, world_size, 6, BATCH // world_size, sample_seed=4))
    publisher.publish(step=6)
    save_checkpoint(dmp, None, os.path.join(root, "ckpt"))


def _resume(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    dmp, opt = build("row_wise")
    publisher = Publisher(dmp, os.path.join(root, "pub"))
    load_checkpoint(dmp, None, os.path.join(root, "ckpt"))
    first = publisher.publish(step=6)
    truth = true_state(dmp, os.path.join(root, f"export-{world_size}-a"))
    problems = compare(os.path.join(root, "pub"), first, truth) if rank == 0 else []
    train(dmp, opt, synthetic_data(rank, world_size, 5, BATCH // world_size, sample_seed=9))
    second = publisher.publish(step=11)
    truth = true_state(dmp, os.path.join(root, f"export-{world_size}-b"))
    if rank == 0:
        problems += compare(os.path.join(root, "pub"), second, truth)
    return {"versions": (first, second), "problems": problems}


@pytest.mark.parametrize("world_size", [2, 1])
def test_a_publish_after_a_checkpoint_load_is_full_then_deltas_follow(tmp_path: Path, world_size: int) -> None:
    run_distributed(_save, 2, str(tmp_path))
    r = run_distributed(_resume, world_size, str(tmp_path))[0]
    assert r["problems"] == [], r["problems"]
    assert r["versions"] == (1, 2)
    assert read_version(tmp_path / "pub", 1).kind == "full"  # a new job cannot prove continuity
    assert read_version(tmp_path / "pub", 2).kind == "delta"


# ---- another model's root; a damaged version ---------------------------------------------------


def _other_model(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    dmp, _ = build("row_wise")
    Publisher(dmp, root).publish(step=0)
    other, _ = build("row_wise", dims=(8, 12))
    try:
        Publisher(other, root)
    except ValueError as e:
        return {"error": str(e), "versions": sorted(os.listdir(root))}
    return {"error": None}


def test_a_root_of_another_model_is_refused_naming_every_difference(tmp_path: Path) -> None:
    for r in run_distributed(_other_model, 2, str(tmp_path / "pub")):
        assert r["error"] is not None
        assert "table 't1': embedding_dim is 16 in version 0, 12 in this model" in r["error"], r["error"]
        assert "dense tensor 'over.weight': shape [1, 32] in version 0, [1, 28] in this model" in r["error"], r["error"]
        assert r["versions"] == ["00000000"]


def _one_version(rank: int, world_size: int, root: str) -> None:
    torch.set_num_threads(1)
    dmp, opt = build("row_wise")
    train(dmp, opt, synthetic_data(rank, world_size, 2, BATCH // world_size, sample_seed=4))
    Publisher(dmp, root).publish(step=2)


def _one_version_under_umask(rank: int, world_size: int, root: str, umask: int) -> None:
    os.umask(umask)
    _one_version(rank, world_size, root)


def test_a_damaged_version_is_refused_naming_the_file_and_files_follow_the_umask(tmp_path: Path) -> None:
    root = tmp_path / "pub"
    run_distributed(_one_version_under_umask, 2, str(root), 0o027)
    modes = {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}
    assert len(modes) == 6 and set(modes.values()) == {0o640}, modes  # 0o666 less the umask, not 0o600
    read_version(root, 0)  # intact
    damaged = root / "00000000" / "tables" / "t0" / "rank-00001.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(PublicationError, match=r"rank-00001\.safetensors"):
        read_version(root, 0)


# ---- kill -9 mid-publish; retention ------------------------------------------------------------


def _killed_mid_publish(rank: int, world_size: int, root: str) -> None:
    import signal

    import recsdk.sharding.publishing.publisher as publisher_module

    torch.set_num_threads(1)
    dmp, opt = build("row_wise")
    publisher = Publisher(dmp, root)
    train(dmp, opt, synthetic_data(rank, world_size, 2, BATCH, sample_seed=4))
    publisher.publish(step=2)
    train(dmp, opt, synthetic_data(rank, world_size, 2, BATCH, sample_seed=5))
    write_table = publisher_module.write_table

    def write_then_die(*args, **kwargs):
        write_table(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    publisher_module.write_table = write_then_die
    publisher.publish(step=4)


def _new_job(rank: int, world_size: int, root: str, export: str) -> dict:
    torch.set_num_threads(1)
    dmp, opt = build("row_wise")
    train(dmp, opt, synthetic_data(rank, world_size, 3, BATCH, sample_seed=6))
    publisher = Publisher(dmp, root)
    version = publisher.publish(step=3)
    return {"version": version, "problems": compare(root, version, true_state(dmp, export))}


def test_a_publish_killed_mid_write_leaves_the_previous_version_latest(tmp_path: Path) -> None:
    from recsdk.data.testing import DistributedTestError
    from recsdk.embedding import latest_version

    root = tmp_path / "pub"
    with pytest.raises(DistributedTestError):
        run_distributed(_killed_mid_publish, 1, str(root))
    assert latest_version(root) == 0
    assert [n for n in os.listdir(root) if n.startswith(".00000001.partial-")], os.listdir(root)
    r = run_distributed(_new_job, 1, str(root), str(tmp_path / "export"))[0]
    assert r["version"] == 1 and r["problems"] == [], r
    assert read_version(root, 1).kind == "full"  # a new job continues with a full version
    assert sorted(os.listdir(root)) == ["00000001"]  # the killed write's leftovers are gone, 0 retired


def _retention(rank: int, world_size: int, root: str, keep: int | None) -> list[int]:
    from recsdk.embedding import list_versions

    torch.set_num_threads(1)
    dmp, opt = build("row_wise")
    publisher = Publisher(dmp, root, full_every=3, keep=keep)
    data = iter(synthetic_data(rank, world_size, 6, BATCH, sample_seed=4))
    for step in range(6):
        train(dmp, opt, [next(data)])
        publisher.publish(step=step)
    return list_versions(root)


@pytest.mark.parametrize(("keep", "kept"), [(None, [3, 4, 5]), (5, [1, 2, 3, 4, 5]), (1, [3, 4, 5])])
def test_retention_keeps_what_rebuilds_the_latest(tmp_path: Path, keep: int | None, kept: list[int]) -> None:
    assert run_distributed(_retention, 1, str(tmp_path / "pub"), keep)[0] == kept


# ---- unpooled tables ---------------------------------------------------------------------------


def _unpooled(rank: int, world_size: int, root: str, sharding: str) -> dict:
    from test_sharding_hash_ec import _batch, _sharded_model

    torch.set_num_threads(1)
    dmp, _ = _sharded_model(sharding, capacity=160, admission=CountAdmission(threshold=2), eviction=LFUEviction())
    publisher = Publisher(dmp, os.path.join(root, "pub"), full_every=3)
    problems = []
    for step in range(10):
        loss, _ = dmp(rank_slice(_batch(32, seed=step), rank, world_size))
        loss.backward()
        if step % 2:
            version = publisher.publish(step=step)
            truth = true_state(dmp, os.path.join(root, f"export{step}"))
            if rank == 0:
                problems += compare(os.path.join(root, "pub"), version, truth)
    return {"problems": problems, "records": publisher.records}


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_unpooled_tables_publish_exactly(tmp_path: Path, sharding: str) -> None:
    """HashEmbeddingCollection tables with count-min admission and LFU eviction."""
    r = run_distributed(_unpooled, 2, str(tmp_path), sharding)[0]
    assert r["problems"] == [], r["problems"]
    assert [rec.kind for rec in r["records"]] == ["full", "delta", "delta", "full", "delta"]
    assert sum(rec.deleted for rec in r["records"]) > 0, r["records"]


def _one_table(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(3)
    model = SparseNN(_tables()[:1], num_dense=4, device="meta")
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05, "eps": 0.01})
    dmp = shard(model, BATCH // world_size, {"t0": ParameterConstraints(sharding_types=["table_wise"])})
    opt = torch.optim.SGD(dmp.module.dense.parameters(), lr=0.05)
    publisher = Publisher(dmp, root, full_every=10)
    data = iter(synthetic_data(rank, world_size, 6, BATCH // world_size, sample_seed=4))
    for step in range(3):
        batch = next(data)  # its f0 only
        train(dmp, opt, [Batch(batch.dense_features, batch.sparse_features.split([1, 1])[0], batch.labels)])
        publisher.publish(step=step)
    holds = len(sharded_hash_modules(dmp)["ebc"].id_tables)
    return {"kinds": [r.kind for r in publisher.records], "tables_here": holds}


def test_a_rank_holding_no_table_does_not_force_full_versions(tmp_path: Path) -> None:
    results = run_distributed(_one_table, 2, str(tmp_path / "pub"))
    assert sorted(r["tables_here"] for r in results) == [0, 1]
    assert results[0]["kinds"] == ["full", "delta", "delta"]


# ---- bad arguments -----------------------------------------------------------------------------


def _bad_arguments(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    dmp, _ = build("row_wise")
    errors = {}
    cases = {
        "full_every": lambda: Publisher(dmp, root, full_every=0),
        "dtype": lambda: Publisher(dmp, root, dtype=torch.bfloat16),
        "keep": lambda: Publisher(dmp, root, keep=0),
        "model": lambda: Publisher("model", root),
        "unsharded": lambda: Publisher(SparseNN(_tables(), num_dense=4, device="cpu"), root),
    }
    for name, make in cases.items():
        try:
            make()
            errors[name] = None
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    publisher = Publisher(dmp, root)
    try:
        publisher.publish(step=-1)
    except ValueError as e:
        errors["step"] = f"ValueError: {e}"
    errors["written"] = sorted(os.listdir(root))
    return errors


def test_bad_arguments_are_refused_naming_them_before_anything_is_written(tmp_path: Path) -> None:
    errors = run_distributed(_bad_arguments, 2, str(tmp_path / "pub"))[0]
    assert errors["full_every"] == "ValueError: full_every must be an int >= 1, got 0"
    assert errors["dtype"].startswith("ValueError: dtype must be torch.float32, torch.float16 or torch.uint8")
    assert errors["keep"] == "ValueError: keep must be an int >= 1 or None, got 0"
    assert errors["model"] == "TypeError: model must be an nn.Module, got str"
    assert errors["unsharded"].startswith("TypeError: module 'ebc' is an unsharded HashEmbeddingBagCollection"), errors
    assert "publications cover hash tables sharded" in errors["unsharded"]
    assert errors["step"] == "ValueError: step must be an int >= 0, got -1"
    assert errors["written"] == []
