"""Planner integration: storage counts the id table, impossible constraints fail early, sharder checks,
the cost model's choices and estimates."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from sharding_models import SparseNN, host_env, tables
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data.testing import run_distributed
from recsdk.embedding import HashEmbeddingCollection, HashEmbeddingConfig, IdTable
from recsdk.sharding import (
    HybridEmbeddingEnumerator,
    HybridEmbeddingShardingPlanner,
    HybridPerfEstimator,
    HybridPerfModel,
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
    # TorchRec's storage estimate alone: what the id tables are added to.
    stock = EmbeddingEnumerator(
        topology=topology,
        batch_size=64,
        constraints=constraints,
        estimator=[EmbeddingStorageEstimator(topology=topology, constraints=constraints)],
    )

    def ddr(enumerator: EmbeddingEnumerator) -> dict:
        options = enumerator.enumerate(model, sharders)
        return {
            (o.name, o.sharding_type): [s.storage.ddr for s in o.shards] for o in options if o.compute_kernel == "fused"
        }

    with_table, without = ddr(hybrid), ddr(stock)
    out["extra"] = {k: [a - b for a, b in zip(with_table[k], without[k], strict=True)] for k in with_table}
    t0 = next(o for o in hybrid.enumerate(model, sharders) if (o.name, o.compute_kernel) == ("t0", "fused"))
    out["rw_rows"] = [s.size[0] for s in t0.shards]

    # A DDR cap between the two totals: plain estimate fits, with the id table it does not.
    total_without = sum(max(v) for k, v in without.items() if k[1] == "row_wise")
    total_with = sum(max(v) for k, v in with_table.items() if k[1] == "row_wise")
    cap = (total_without + total_with) // 2
    row_wise = {t: ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"]) for t in ("t0", "t1")}
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
        # Exact: what the shard's host table really holds when full (on CPU, with the index it
        # has grown to there).
        host_table = IdTable(rows, admission=config.admission, eviction=config.eviction, name=name)
        host_table.find_or_insert(torch.randperm(10 * rows)[:rows])
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
    stock = EmbeddingEnumerator(topology=topology, batch_size=64, estimator=[EmbeddingStorageEstimator(topology)])

    def ddr(enumerator: EmbeddingEnumerator) -> dict:
        options = enumerator.enumerate(model, sharders)
        return {o.sharding_type: [s.storage.ddr for s in o.shards] for o in options if o.compute_kernel == "fused"}

    with_table, without = ddr(hybrid), ddr(stock)
    return {k: [a - b for a, b in zip(with_table[k], without[k], strict=True)] for k in with_table}


def test_storage_counts_the_id_tables_of_a_hash_embedding_collection() -> None:
    extra = run_distributed(_ec_storage, 2, timeout_s=120)[0]
    config = HashEmbeddingConfig(name="item", embedding_dim=8, num_embeddings=60_000, feature_names=["history"])
    assert set(extra) == {"row_wise", "table_wise"}, extra
    assert extra["row_wise"] == [id_table_bytes(30_000, config)] * 2
    assert extra["table_wise"] == [id_table_bytes(60_000, config)]


# --- The cost model: the unconstrained planner's choices, and how the estimates scale ---------


def _layout(plan) -> dict[str, tuple[str, list[int]]]:
    return {name: (ps.sharding_type, list(ps.ranks)) for mp in plan.plan.values() for name, ps in mp.items()}


def _plan(model, topology: Topology, *, perf_model: bool = False, batch_size: int = 1024) -> dict:
    sharders = get_default_hybrid_sharders(host_env=host_env())
    extra = {"performance_model": HybridPerfModel(topology)} if perf_model else {}
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=batch_size),
        **extra,
    )
    return _layout(planner.plan(model, sharders))


def _unconstrained_picks(rank: int, world_size: int) -> dict:
    out: dict = {}
    two = Topology(world_size=2, compute_device="cpu")
    small = SparseNN(tables(capacity=20_000, dims=(16,) * 4), num_dense=4, device="meta")
    out["small_2"] = _plan(small, two)
    out["small_2_model"] = _plan(small, two, perf_model=True)
    out["pair_2"] = _plan(SparseNN(tables(capacity=20_000, dims=(16, 16)), num_dense=4, device="meta"), two)
    eight = SparseNN(tables(capacity=20_000, dims=(16,) * 8), num_dense=4, device="meta")
    out["eight_4"] = _plan(eight, Topology(world_size=4, compute_device="cpu"))
    odd = SparseNN(tables(capacity=20_000, dims=(16,) * 3), num_dense=4, device="meta")
    out["odd_2_model"] = _plan(odd, two, perf_model=True)
    out["one_2"] = _plan(SparseNN(tables(capacity=20_000, dims=(16,)), num_dense=4, device="meta"), two)

    # One table far larger than the others; a DDR cap its table-wise shard does not fit under,
    # while its row-wise shards (half of it on each rank) and the small tables do.
    configs = tables(capacity=2_000_000, dims=(16,)) + tables(capacity=20_000, dims=(16,) * 4)[1:]
    big = SparseNN(configs, num_dense=4, device="meta")
    enumerator = HybridEmbeddingEnumerator(topology=two, batch_size=1024)
    sharders = get_default_hybrid_sharders(host_env=host_env())
    ddr = {(o.name, o.sharding_type): max(s.storage.ddr for s in o.shards) for o in enumerator.enumerate(big, sharders)}
    out["big_ddr"] = {f"{k[0]}/{k[1]}": v for k, v in ddr.items()}
    cap = int(0.75 * ddr[("t0", "table_wise")])
    out["big_uncapped"] = _plan(big, two)
    out["big_capped"] = _plan(big, Topology(world_size=2, compute_device="cpu", ddr_cap=cap))
    out["big_capped_model"] = _plan(big, Topology(world_size=2, compute_device="cpu", ddr_cap=cap), perf_model=True)
    return out


def test_unconstrained_planner_picks_table_wise_for_small_tables_row_wise_where_needed() -> None:
    r = run_distributed(_unconstrained_picks, 1, timeout_s=120)[0]
    # Small tables on 2 ranks: table-wise, spread evenly (2 per rank), with or without the perf model.
    for key in ("small_2", "small_2_model"):
        assert {t for t, _ in r[key].values()} == {"table_wise"}, (key, r[key])
        assert sorted(ranks[0] for _, ranks in r[key].values()) == [0, 0, 1, 1], (key, r[key])
    assert sorted(ranks[0] for t, ranks in r["pair_2"].values() if t == "table_wise") == [0, 1], r["pair_2"]
    # 8 tables on 4 ranks: table-wise, 2 per rank.
    assert {t for t, _ in r["eight_4"].values()} == {"table_wise"}, r["eight_4"]
    assert sorted(ranks[0] for _, ranks in r["eight_4"].values()) == [0, 0, 1, 1, 2, 2, 3, 3], r["eight_4"]
    # 3 tables: with HybridPerfModel one table-wise group (no second, row-wise group for one table).
    assert {t for t, _ in r["odd_2_model"].values()} == {"table_wise"}, r["odd_2_model"]
    assert sorted(ranks[0] for _, ranks in r["odd_2_model"].values()) == [0, 0, 1], r["odd_2_model"]
    # One table alone: row-wise shares its work between the ranks (balance).
    assert r["one_2"] == {"t0": ("row_wise", [0, 1])}, r["one_2"]
    # A table too large for one rank's DDR: row-wise; uncapped the same model is table-wise.
    assert r["big_ddr"]["t0/row_wise"] < 0.55 * r["big_ddr"]["t0/table_wise"], r["big_ddr"]
    assert {t for t, _ in r["big_uncapped"].values()} == {"table_wise"}, r["big_uncapped"]
    for key in ("big_capped", "big_capped_model"):
        assert r[key]["t0"] == ("row_wise", [0, 1]), (key, r[key])


def _estimates(rank: int, world_size: int) -> dict:
    out: dict = {}
    sharders = get_default_hybrid_sharders(host_env=host_env())
    pooled = SparseNN(tables(capacity=40_000, dims=(16,)), num_dense=4, device="meta")
    unpooled = torch.nn.ModuleDict(
        {
            "ec": HashEmbeddingCollection(
                tables=[HashEmbeddingConfig(name="t0", embedding_dim=16, num_embeddings=40_000, feature_names=["f0"])],
                device=torch.device("meta"),
            )
        }
    )
    plain = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="p0", embedding_dim=16, num_embeddings=40_000, feature_names=["g0"])],
        device=torch.device("meta"),
    )
    for world in (2, 4):
        topology = Topology(world_size=world, compute_device="cpu")
        constraints = {"t0": ParameterConstraints(pooling_factors=[4.0])}
        estimator = HybridPerfEstimator(topology=topology, constraints=constraints)
        enumerator = HybridEmbeddingEnumerator(topology=topology, batch_size=512, constraints=constraints)
        for kind, model in (("pooled", pooled), ("unpooled", unpooled)):
            for option in (o for o in enumerator.enumerate(model, sharders) if o.compute_kernel == "fused"):
                costs = estimator.shard_costs(option)
                key = f"{kind}/{world}/{option.sharding_type}"
                out[key] = {
                    "ids": sum(c.ids for c in costs),
                    "output_bytes": sum(c.output_bytes for c in costs),
                    "output_comm_s": sum(c.output_comm_s for c in costs),
                    "host_s": [c.host_s for c in costs],
                    "shards": len(costs),
                    # The shards' perf is the costs' perf (ms).
                    "perf_matches": all(s.perf == c.perf() for s, c in zip(option.shards, costs, strict=True)),
                    "total_ms": [s.perf.total for s in option.shards],
                }
        # host_overlap: the hidden host work leaves Perf.total; the hidden id all-to-all goes
        # to input_dist_comms (which TorchRec leaves out of the total).
        options = enumerator.enumerate(pooled, sharders)
        option = next(o for o in options if (o.sharding_type, o.compute_kernel) == ("row_wise", "fused"))
        cost = estimator.shard_costs(option)[0]
        hidden = HybridPerfEstimator(topology=topology, constraints=constraints, host_overlap=1.0)
        hidden.estimate([option], None)
        out[f"overlap/{world}"] = {
            "total": option.shards[0].perf.total,
            "expected": cost.perf().total - 1000 * (cost.host_s + cost.id_comm_s),
            "input_dist_comms": option.shards[0].perf.input_dist_comms,
            "id_comm_ms": 1000 * cost.id_comm_s,
        }
        # Other modules keep TorchRec's estimate.
        stock = EmbeddingPerfEstimator(topology=topology)
        options = EmbeddingEnumerator(topology=topology, batch_size=512, estimator=[stock]).enumerate(plain, sharders)
        ours = EmbeddingEnumerator(
            topology=topology, batch_size=512, estimator=[HybridPerfEstimator(topology=topology)]
        ).enumerate(plain, sharders)
        out[f"plain/{world}"] = [
            ([s.perf for s in a.shards], [s.perf for s in b.shards]) for a, b in zip(options, ours, strict=True)
        ]
    # On an accelerator the lookup and output dist keep TorchRec's estimate; the host work is added
    # (fused here; cached kernels: test_sharding_cache_planner).
    cuda = Topology(world_size=2, compute_device="cuda")
    stock_cuda = EmbeddingEnumerator(topology=cuda, batch_size=512, estimator=[EmbeddingPerfEstimator(topology=cuda)])
    hybrid_cuda = HybridPerfEstimator(topology=cuda)
    ours_cuda = EmbeddingEnumerator(topology=cuda, batch_size=512, estimator=[hybrid_cuda])
    out["cuda"] = [
        (
            [(p.fwd_compute, p.fwd_comms, p.bwd_compute, p.bwd_comms) for p in (s.perf for s in a.shards)],
            [(p.fwd_compute, p.fwd_comms, p.bwd_compute, p.bwd_comms) for p in (s.perf for s in b.shards)],
            [(1000 * c.host_s, 1000 * c.id_comm_s) for c in hybrid_cuda.shard_costs(b)],
        )
        for a, b in zip(stock_cuda.enumerate(pooled, sharders), ours_cuda.enumerate(pooled, sharders), strict=True)
        if b.compute_kernel == "fused"
    ]
    try:
        HybridPerfEstimator(topology=Topology(world_size=2, compute_device="cpu"), host_overlap=1.5)
    except ValueError as e:
        out["bad_overlap"] = str(e)
    return out


def test_estimates_scale_as_the_cost_model_says() -> None:
    r = run_distributed(_estimates, 1, timeout_s=120)[0]
    for world in (2, 4):
        tw, rw = r[f"pooled/{world}/table_wise"], r[f"pooled/{world}/row_wise"]
        assert tw["shards"] == 1 and rw["shards"] == world
        # Every id is mapped and looked up once, on either layout.
        assert rw["ids"] == pytest.approx(tw["ids"])
        # Pooled: each row-wise shard sends partial sums of every sample: world_size x the bytes.
        assert rw["output_bytes"] == pytest.approx(world * tw["output_bytes"])
        assert rw["output_comm_s"] == pytest.approx(world * tw["output_comm_s"])
        # A row-wise shard maps 1/W of the ids, and buckets this rank's ids: less than the table.
        assert all(h < tw["host_s"][0] for h in rw["host_s"])
        assert all(t < tw["total_ms"][0] for t in rw["total_ms"])
        # Unpooled: one embedding per id either way: the same bytes in all.
        utw, urw = r[f"unpooled/{world}/table_wise"], r[f"unpooled/{world}/row_wise"]
        assert urw["output_bytes"] == pytest.approx(utw["output_bytes"])
        assert urw["ids"] == pytest.approx(utw["ids"])
        for key in ("pooled", "unpooled"):
            for sharding in ("table_wise", "row_wise"):
                assert r[f"{key}/{world}/{sharding}"]["perf_matches"]
        overlap = r[f"overlap/{world}"]
        assert overlap["total"] == pytest.approx(overlap["expected"])
        assert overlap["input_dist_comms"] == pytest.approx(overlap["id_comm_ms"]) and overlap["id_comm_ms"] > 0
        for stock, ours in r[f"plain/{world}"]:
            assert stock == ours
    # The table-wise shard's output: every bag of the global batch (512 per rank x 2) x dim 16 x 4 B.
    assert r["pooled/2/table_wise"]["output_bytes"] == pytest.approx(512 * 2 * 16 * 4)
    assert "host_overlap" in r["bad_overlap"]
    assert r["cuda"]
    for stock, ours, host in r["cuda"]:
        for (sf, sc, sb, sbc), (of, oc, ob, obc), (host_ms, id_ms) in zip(stock, ours, host, strict=True):
            assert of == pytest.approx(sf + host_ms) and oc == pytest.approx(sc + id_ms)
            assert (ob, obc) == (sb, sbc)


def _collective_planning(rank: int, world_size: int) -> dict:
    out: dict = {}
    model = SparseNN(tables(capacity=100_000, dims=(16, 8)), num_dense=4, device="meta")
    sharders = get_default_hybrid_sharders(host_env=host_env())
    topology = Topology(world_size=world_size, compute_device="cpu")
    world = dist.GroupMember.WORLD
    # The same plan as TorchRec's planner wired by hand with recsdk's enumerator and perf model.
    out["plan"] = _layout(
        HybridEmbeddingShardingPlanner(topology, batch_size=64).collective_plan(model, sharders, world)
    )
    wired = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=64,
        enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=64),
        performance_model=HybridPerfModel(topology),
    )
    out["wired"] = _layout(wired.collective_plan(model, sharders, world))
    # Planning fails on rank 0 only (TorchRec plans there): a constraint no sharder meets, and
    # too little memory for the tables. TorchRec's collective_plan leaves the others waiting.
    failing = {
        "constraint": (topology, {"t1": ParameterConstraints(sharding_types=["column_wise"])}),
        "memory": (Topology(world_size=world_size, compute_device="cpu", ddr_cap=10_000), None),
    }
    for case, (topo, constraints) in failing.items():
        planner = HybridEmbeddingShardingPlanner(topo, batch_size=64, constraints=constraints)
        started = time.monotonic()
        try:
            planner.collective_plan(model, sharders, world)
            out[case] = ("planned", "", 0.0)
        except Exception as e:
            out[case] = (type(e).__name__, str(e), time.monotonic() - started)
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the default group is still in step
    out["after"] = float(ones)
    return out


def test_the_hybrid_planner_plans_as_wired_by_hand_and_fails_on_every_rank() -> None:
    rank0, rank1 = run_distributed(_collective_planning, 2, timeout_s=60)
    assert rank0["plan"] == rank1["plan"] == rank0["wired"], (rank0, rank1)
    for case, error_type, named in (("constraint", "ValueError", "column_wise"), ("memory", "PlannerError", "")):
        mine, peer = rank0[case], rank1[case]
        assert mine[0] == peer[0] == error_type, (case, mine, peer)
        assert named in mine[1] and named in peer[1], (case, mine, peer)
        assert peer[1].startswith("planning failed on rank 0: "), peer
        assert mine[2] < 10 and peer[2] < 10, (case, mine, peer)  # told, not timed out
    assert rank0["after"] == rank1["after"] == 2.0


def test_the_hybrid_planner_checks_its_arguments() -> None:
    topology = Topology(world_size=2, compute_device="cpu")
    with pytest.raises(TypeError, match="topology must be a torchrec Topology"):
        HybridEmbeddingShardingPlanner("cpu", batch_size=64)  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
            HybridEmbeddingShardingPlanner(topology, batch_size=bad)  # type: ignore[arg-type]
    model = SparseNN(tables(capacity=1000, dims=(16, 8)), num_dense=4, device="meta")
    with pytest.raises(RuntimeError, match="use plan"):  # no process group: plan() is the one-process call
        HybridEmbeddingShardingPlanner(topology, batch_size=64).collective_plan(model, [])
