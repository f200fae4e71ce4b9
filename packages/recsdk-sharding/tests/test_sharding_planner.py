"""Planner integration: storage counts the id table, impossible constraints fail early, sharder checks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from sharding_models import SparseNN, host_env, tables
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data.testing import run_distributed
from recsdk.embedding import HashEmbeddingCollection, HashEmbeddingConfig, IdTable
from recsdk.sharding import (
    HybridEmbeddingEnumerator,
    get_default_hybrid_sharders,
    id_table_bytes,
)


def _storage_and_constraints(rank: int, world_size: int) -> dict:
    out: dict = {}
    model = SparseNN(tables(capacity=100_000, dims=(16, 8)), num_dense=4, device="meta")
    sharders = get_default_hybrid_sharders(host_env=host_env())
    topology = Topology(world_size=world_size, compute_device="cpu")
    constraints = {"t0": ParameterConstraints(sharding_types=["row_wise"])}

    hybrid = HybridEmbeddingEnumerator(topology=topology, batch_size=64, constraints=constraints)
    stock = EmbeddingEnumerator(topology=topology, batch_size=64, constraints=constraints)

    def ddr(enumerator: EmbeddingEnumerator) -> dict:
        options = enumerator.enumerate(model, sharders)
        return {(o.name, o.sharding_type): [s.storage.ddr for s in o.shards] for o in options}

    with_table, without = ddr(hybrid), ddr(stock)
    out["extra"] = {k: [a - b for a, b in zip(with_table[k], without[k], strict=True)] for k in with_table}
    out["rw_rows"] = [s.size[0] for o in hybrid.enumerate(model, sharders) if o.name == "t0" for s in o.shards]

    # A DDR cap between the two totals: plain estimate fits, with the id table it does not.
    total_without = sum(max(v) for k, v in without.items() if k[1] == "row_wise")
    total_with = sum(max(v) for k, v in with_table.items() if k[1] == "row_wise")
    cap = (total_without + total_with) // 2
    row_wise = {t: ParameterConstraints(sharding_types=["row_wise"]) for t in ("t0", "t1")}
    tight = Topology(world_size=world_size, compute_device="cpu", ddr_cap=cap)
    EmbeddingShardingPlanner(topology=tight, constraints=row_wise).plan(model, sharders)  # fits without the table
    try:
        EmbeddingShardingPlanner(
            topology=tight,
            constraints=row_wise,
            enumerator=HybridEmbeddingEnumerator(topology=tight, batch_size=64, constraints=row_wise),
        ).plan(model, sharders)
        out["tight"] = "planned"
    except Exception as e:  # torchrec's PlannerError
        out["tight"] = f"{type(e).__name__}: {e}"

    bad = {"t1": ParameterConstraints(sharding_types=["column_wise"])}
    try:
        EmbeddingShardingPlanner(
            topology=topology,
            constraints=bad,
            enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=64, constraints=bad),
        ).plan(model, sharders)
        out["bad"] = "planned"
    except ValueError as e:
        out["bad"] = str(e)
    return out


def test_storage_counts_id_table_and_bad_constraints_fail_at_planning() -> None:
    r = run_distributed(_storage_and_constraints, 2, timeout_s=120)[0]
    assert r["rw_rows"] == [50_000, 50_000]
    for (name, sharding_type), extra in r["extra"].items():
        rows = 50_000 if sharding_type == "row_wise" else 100_000
        config = next(c for c in tables(capacity=100_000, dims=(16, 8)) if c.name == name)
        expected = [id_table_bytes(rows, config)] * len(extra)
        assert 20 * rows < expected[0] < 48 * rows  # slots and per-row metadata, at most 48 B/row
        # Exact: what the shard's host table really holds (on CPU, with the index it gets there).
        host_table = IdTable(rows, admission=config.admission, eviction=config.eviction, name=name)
        assert expected[0] == host_table.memory_bytes
        assert extra == expected, (name, sharding_type, extra)
    assert "INSUFFICIENT_STORAGE" in r["tight"] or "storage" in r["tight"].lower(), r["tight"]
    assert "'t1'" in r["bad"] and "column_wise" in r["bad"], r["bad"]
    assert "row_wise" in r["bad"] and "table_wise" in r["bad"], r["bad"]


def _plain_ebc_row_wise_on_cpu(rank: int, world_size: int) -> dict:
    num_rows, dim = 10, 4
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=num_rows, feature_names=["f"])],
        device=torch.device("meta"),
    )
    sharders = get_default_hybrid_sharders(host_env=host_env())
    constraints = {"t": ParameterConstraints(sharding_types=["row_wise"])}
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"), constraints=constraints
    ).collective_plan(ebc, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=sharders)
    # Row r holds the value r in every column, so a pooled bag equals the sum of its ids.
    weight = model.state_dict()["embedding_bags.t.weight"]
    for shard in weight.local_shards():
        first = shard.metadata.shard_offsets[0]
        rows = torch.arange(first, first + shard.tensor.shape[0], dtype=torch.float32)
        shard.tensor.copy_(rows[:, None].expand_as(shard.tensor))
    ids = [[1, 9], [rank], [4, 5, 6]]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([i for bag in ids for i in bag]), lengths=torch.tensor([len(b) for b in ids])
    )
    pooled = model(kjt)
    return {
        "sharding_type": plan.plan[""]["t"].sharding_type,
        "pooled": pooled["f"].tolist(),
        "expected": [[float(sum(b))] * dim for b in ids],
    }


def test_plain_ebc_shards_row_wise_on_cpu() -> None:
    for r in run_distributed(_plain_ebc_row_wise_on_cpu, 2, timeout_s=60):
        assert r["sharding_type"] == "row_wise"
        assert r["pooled"] == r["expected"]


def _host_env_checks(rank: int, world_size: int) -> dict:
    out = {}
    try:
        get_default_hybrid_sharders(host_env="gloo")  # type: ignore[arg-type]
    except TypeError as e:
        out["type"] = str(e)
    try:
        get_default_hybrid_sharders(host_env=ShardingEnv(world_size=world_size, rank=rank, pg=None))
    except ValueError as e:
        out["none"] = str(e)
    return out


def test_host_env_must_be_a_gloo_sharding_env() -> None:
    r = run_distributed(_host_env_checks, 1, timeout_s=30)[0]
    assert "ShardingEnv" in r["type"] and "str" in r["type"]
    assert "gloo" in r["none"]


pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _ec_storage(rank: int, world_size: int) -> dict:
    ec = HashEmbeddingCollection(
        tables=[
            HashEmbeddingConfig(
                name="item", embedding_dim=8, num_embeddings=60_000, feature_names=["history", "candidate"]
            )
        ],
        device=torch.device("meta"),
    )
    model = torch.nn.ModuleDict({"ec": ec})
    sharders = get_default_hybrid_sharders(host_env=host_env())
    topology = Topology(world_size=world_size, compute_device="cpu")
    hybrid = HybridEmbeddingEnumerator(topology=topology, batch_size=64)
    stock = EmbeddingEnumerator(topology=topology, batch_size=64)

    def ddr(enumerator: EmbeddingEnumerator) -> dict:
        return {o.sharding_type: [s.storage.ddr for s in o.shards] for o in enumerator.enumerate(model, sharders)}

    with_table, without = ddr(hybrid), ddr(stock)
    return {k: [a - b for a, b in zip(with_table[k], without[k], strict=True)] for k in with_table}


def test_storage_counts_the_id_tables_of_a_hash_embedding_collection() -> None:
    extra = run_distributed(_ec_storage, 2, timeout_s=120)[0]
    config = HashEmbeddingConfig(name="item", embedding_dim=8, num_embeddings=60_000, feature_names=["history"])
    assert set(extra) == {"row_wise", "table_wise"}, extra
    assert extra["row_wise"] == [id_table_bytes(30_000, config)] * 2
    assert extra["table_wise"] == [id_table_bytes(60_000, config)]
