"""The planner and device caches: each tier's memory where it lives, caching picked only where a
table does not fit, cached kernels asked for by constraints, bad cache settings fail at planning.

Planning is offline arithmetic: CUDA topologies are planned here, on CPU, on one process (the
sharders need a host group)."""

from __future__ import annotations

import math

import pytest
import torch
from sharding_models import SparseNN, host_env, tables
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.types import CacheAlgorithm, CacheParams, CacheStatistics, KeyValueParams
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsdk.data.testing import run_distributed
from recsdk.sharding import HybridEmbeddingEnumerator, HybridPerfEstimator, HybridPerfModel, get_default_hybrid_sharders
from recsdk.sharding.planning.cache_costs import MISS_RATE_FLOOR
from recsdk.sharding.planning.cache_plan import cache_specs
from recsdk.sharding.planning.planner import cache_index_bytes, id_table_bytes

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

ROWS, DIM = 100_000, 16
ROW_BYTES = DIM * 4 * 2  # fp32 weight and exact Adagrad's per-row state (TorchRec's count: 1x the weight)
ALL_KERNELS = ["fused", "fused_uvm_caching", "key_value"]


def _model(rows: int = ROWS, dims: tuple[int, ...] = (DIM,)) -> SparseNN:
    model = SparseNN(tables(capacity=rows, dims=dims), num_dense=4, device="meta")
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.1})
    return model


def _kv(directory: str = "/tmp/recsdk-kv") -> KeyValueParams:
    return KeyValueParams(ssd_storage_directory=directory)


def _storages(rank: int, world_size: int) -> dict:
    sharders = get_default_hybrid_sharders(host_env=host_env())
    model = _model()
    out: dict = {}
    for device in ("cuda", "cpu"):
        topology = Topology(world_size=2, compute_device=device)
        for load_factor in (None, 0.25):
            cache_params = CacheParams(load_factor=load_factor) if load_factor is not None else None
            constraints = {
                "t0": ParameterConstraints(
                    compute_kernels=ALL_KERNELS, cache_params=cache_params, key_value_params=_kv()
                )
            }
            ours = HybridEmbeddingEnumerator(topology=topology, batch_size=512, constraints=constraints)
            stock = EmbeddingEnumerator(
                topology=topology,
                batch_size=512,
                constraints=constraints,
                estimator=[EmbeddingStorageEstimator(topology=topology, constraints=constraints)],
            )
            stock_fused = {
                o.sharding_type: [(s.storage.hbm, s.storage.ddr) for s in o.shards]
                for o in stock.enumerate(model, sharders)
                if o.compute_kernel == "fused"
            }
            for o in ours.enumerate(model, sharders):
                out[(device, load_factor, o.sharding_type, o.compute_kernel)] = {
                    "rows": [int(s.size[0]) for s in o.shards],
                    "storage": [(s.storage.hbm, s.storage.ddr, s.storage.ssd) for s in o.shards],
                    "stock_fused": stock_fused[o.sharding_type],
                }
    return out


def test_storage_counts_each_tier_where_it_lives() -> None:
    r = run_distributed(_storages, 1, timeout_s=180)[0]
    assert {k[3] for k in r} == set(ALL_KERNELS)
    for (device, load_factor, sharding_type, kernel), got in r.items():
        lf = 0.2 if load_factor is None else load_factor  # recsdk's DEFAULT_LOAD_FACTOR
        config = tables(capacity=ROWS, dims=(DIM,))[0]
        for rows, (hbm, ddr, ssd), (stock_hbm, stock_ddr) in zip(
            got["rows"], got["storage"], got["stock_fused"], strict=True
        ):
            assert rows == (ROWS // 2 if sharding_type == "row_wise" else ROWS)
            ids = id_table_bytes(rows, config)
            # TorchRec's fused estimate: the rows and their optimizer state, plus the batch's inputs
            # and outputs (on the device: hbm on CUDA, ddr on CPU).
            on_device = stock_hbm if device == "cuda" else stock_ddr
            io = on_device - rows * ROW_BYTES
            assert 0 <= io < 10 * 2**20, (device, sharding_type, io)
            if kernel == "fused":
                device_bytes, host_bytes, ssd_bytes = on_device, ids, 0
            else:
                slots = math.ceil(lf * rows)
                device_bytes = io + slots * ROW_BYTES  # the cache: ceil(load_factor x rows) rows
                host_bytes = ids + cache_index_bytes(slots, rows)
                store = rows * ROW_BYTES  # every row with its optimizer state
                if kernel == "fused_uvm_caching":
                    host_bytes += store  # in host memory
                    ssd_bytes = 0
                else:
                    ssd_bytes = store  # in files: nothing in DDR
            if device == "cuda":
                expected = (device_bytes, host_bytes, ssd_bytes)
            else:  # the device is the host
                expected = (0, device_bytes + host_bytes, ssd_bytes)
            assert (hbm, ddr, ssd) == expected, (device, load_factor, sharding_type, kernel)


def _layout(plan) -> dict:
    return {
        name: (ps.sharding_type, ps.compute_kernel, list(ps.ranks or []), ps.cache_params, ps.key_value_params)
        for mp in plan.plan.values()
        for name, ps in mp.items()
    }


def _plan(model, topology: Topology, constraints: dict | None = None) -> dict:
    sharders = get_default_hybrid_sharders(host_env=host_env())
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=512,
        constraints=constraints,
        enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=512, constraints=constraints),
        performance_model=HybridPerfModel(topology),
    )
    plan = planner.plan(model, sharders)
    specs = {n: s for mp in plan.plan.values() for n, s in cache_specs(mp).items()}  # as the module reads it
    return {"layout": _layout(plan), "specs": specs}


def _picks(rank: int, world_size: int) -> dict:
    out: dict = {}
    big = 2_000_000  # 2M rows x dim 16 x 8 B (weight + Adagrad) = 256 MB; a row-wise shard 128 MB
    mixed = SparseNN(tables(capacity=big, dims=(DIM,)) + tables(capacity=ROWS, dims=(DIM,) * 3)[1:], 4, "meta")
    apply_optimizer_in_backward(torch.optim.Adagrad, mixed.ebc.parameters(), {"lr": 0.1})
    mb = 2**20
    out["cuda_roomy"] = _plan(mixed, Topology(world_size=2, compute_device="cuda"))
    out["cpu"] = _plan(mixed, Topology(world_size=2, compute_device="cpu"))
    # HBM for the small table and a cache of the big one, not for the big one's rows.
    small_hbm = Topology(world_size=2, compute_device="cuda", hbm_cap=96 * mb, ddr_cap=64 * 2**30)
    out["cuda_small_hbm"] = _plan(mixed, small_hbm)
    # A constraint allowing every kernel: key_value only where the store does not fit DDR either.
    allow = {"t0": ParameterConstraints(compute_kernels=ALL_KERNELS, key_value_params=_kv())}
    out["allow_roomy"] = _plan(mixed, Topology(world_size=2, compute_device="cuda"), allow)
    out["allow_small_hbm"] = _plan(mixed, small_hbm, allow)
    small_ddr = Topology(world_size=2, compute_device="cuda", hbm_cap=96 * mb, ddr_cap=100 * mb, ssd_cap=2**30)
    out["allow_small_ddr"] = _plan(mixed, small_ddr, allow)
    # Constraints asking for one cached kernel get it, with their cache settings in the plan.
    lfu = CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.5)
    asked = {
        "t1": ParameterConstraints(compute_kernels=["fused_uvm_caching"], cache_params=lfu),
        "t2": ParameterConstraints(compute_kernels=["key_value"], key_value_params=_kv("/data/kv@local_rank")),
    }
    out["asked"] = _plan(mixed, Topology(world_size=2, compute_device="cuda"), asked)
    out["asked_cpu"] = _plan(mixed, Topology(world_size=2, compute_device="cpu"), asked)
    return out


def test_planner_caches_only_tables_that_do_not_fit() -> None:
    r = run_distributed(_picks, 1, timeout_s=300)[0]
    # Unconstrained, everything fits: fused everywhere (and never key_value, which TorchRec guards).
    for key in ("cuda_roomy", "cpu", "allow_roomy"):
        assert {k for _, k, *_ in r[key]["layout"].values()} == {"fused"}, (key, r[key]["layout"])
        assert r[key]["specs"] == {}
    # The big table's rows do not fit HBM (not even row-wise): cached in host memory, with the
    # default load factor; the small tables stay fused.
    for key in ("cuda_small_hbm", "allow_small_hbm"):
        layout = r[key]["layout"]
        assert layout["t0"][1] == "fused_uvm_caching", (key, layout)
        assert {layout[t][1] for t in ("t1", "t2")} == {"fused"}, (key, layout)
        spec = r[key]["specs"]["t0"]
        assert (spec.store, spec.load_factor, spec.algorithm) == ("host", 0.2, "lru")
    # Its store does not fit DDR either, and there is SSD: key_value, the files under the directory.
    layout = r["allow_small_ddr"]["layout"]
    assert layout["t0"][1] == "key_value", layout
    spec = r["allow_small_ddr"]["specs"]["t0"]
    assert (spec.store, spec.directory) == ("file", "/tmp/recsdk-kv")
    # Asked for: the kernels and their parameters, as the sharded module reads them.
    for key in ("asked", "asked_cpu"):
        layout, specs = r[key]["layout"], r[key]["specs"]
        assert layout["t0"][1] == "fused" and layout["t1"][1] == "fused_uvm_caching", (key, layout)
        assert layout["t1"][3] == CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.5)
        assert (specs["t1"].store, specs["t1"].load_factor, specs["t1"].algorithm) == ("host", 0.5, "lfu")
        assert layout["t2"][1] == "key_value" and layout["t2"][4].ssd_storage_directory == "/data/kv@local_rank"
        assert (specs["t2"].store, specs["t2"].directory) == ("file", "/data/kv@local_rank")


class _Stats(CacheStatistics):
    """Cache statistics of a table: ``lookups`` distinct rows per global batch, a fixed miss rate."""

    def __init__(self, lookups: int, miss_rate: float) -> None:
        self._lookups, self._miss_rate = lookups, miss_rate

    @property
    def expected_lookups(self) -> int:
        return self._lookups

    def expected_miss_rate(self, clf: float) -> float:
        return self._miss_rate

    @property
    def cacheability(self) -> float:
        return 1.0


def _costs(rank: int, world_size: int) -> dict:
    sharders = get_default_hybrid_sharders(host_env=host_env())
    model = _model()
    out: dict = {}
    for device in ("cpu", "cuda"):
        topology = Topology(world_size=2, compute_device=device)
        for name, cache_params in (
            ("default", None),
            ("lf_0.99", CacheParams(load_factor=0.99)),
            ("stats", CacheParams(load_factor=0.5, stats=_Stats(lookups=300, miss_rate=0.1))),
        ):
            constraints = {
                "t0": ParameterConstraints(
                    compute_kernels=ALL_KERNELS,
                    cache_params=cache_params,
                    key_value_params=_kv(),
                    pooling_factors=[4.0],
                )
            }
            estimator = HybridPerfEstimator(topology=topology, constraints=constraints)
            enumerator = HybridEmbeddingEnumerator(topology=topology, batch_size=512, constraints=constraints)
            for o in enumerator.enumerate(model, sharders):
                costs = estimator.shard_costs(o)
                out[(device, name, o.sharding_type, o.compute_kernel)] = {
                    "ids": [c.ids for c in costs],
                    "misses": [c.misses for c in costs],
                    "cache_s": [c.cache_s for c in costs],
                    "fwd": [s.perf.fwd_compute for s in o.shards],
                    "rest": [(s.perf.fwd_comms, s.perf.bwd_compute, s.perf.bwd_comms) for s in o.shards],
                    "total": [s.perf.total for s in o.shards],
                }
        # Off CPU the device part of a cached table is TorchRec's estimate of the fused kernel.
        if device == "cuda":
            stock = EmbeddingEnumerator(topology=topology, batch_size=512, estimator=[EmbeddingPerfEstimator(topology)])
            for o in stock.enumerate(model, sharders):
                if o.compute_kernel == "fused":
                    out[("stock", o.sharding_type)] = [s.perf.fwd_compute for s in o.shards]
    return out


def test_cached_kernels_cost_more_than_fused() -> None:
    r = run_distributed(_costs, 1, timeout_s=180)[0]
    for device in ("cpu", "cuda"):
        for sharding_type in ("row_wise", "table_wise"):
            for name in ("default", "lf_0.99", "stats"):
                fused, host, files = (r[(device, name, sharding_type, k)] for k in ALL_KERNELS)
                assert fused["cache_s"] == [0.0] * len(fused["ids"]) and fused["misses"] == fused["cache_s"]
                for a, b, c in zip(fused["total"], host["total"], files["total"], strict=True):
                    assert a < b < c, (device, name, sharding_type, a, b, c)
                # The cache's work is on the forward's critical path; the rest is fused's.
                for f, h in zip(fused["fwd"], host["fwd"], strict=True):
                    assert h > f
                assert host["rest"] == fused["rest"] and files["rest"] == fused["rest"]
                share = 0.5 if sharding_type == "row_wise" else 1.0
                for ids, misses in zip(host["ids"], host["misses"], strict=True):
                    assert ids == pytest.approx(512 * 2 * 4.0 * share)  # B x W x pooling, the shard's share
                    if name == "default":  # every id a distinct row, 1 - load_factor of them missed
                        assert misses == pytest.approx(ids * 0.8)
                    elif name == "lf_0.99":  # 1 - 0.99, clipped to the floor
                        assert misses == pytest.approx(ids * MISS_RATE_FLOOR)
                    else:  # the statistics: distinct rows per global batch (the shard's share), their miss rate
                        assert misses == pytest.approx(300 * share * 0.1)
                assert files["misses"] == host["misses"]
    for sharding_type in ("row_wise", "table_wise"):
        stock = r[("stock", sharding_type)]
        fused, host = (
            r[("cuda", "default", sharding_type, "fused")],
            r[("cuda", "default", sharding_type, "fused_uvm_caching")],
        )
        for s, f, h, cache_s in zip(stock, fused["fwd"], host["fwd"], host["cache_s"], strict=True):
            assert h - f == pytest.approx(1000 * cache_s)  # the same device estimate, plus the cache's work (ms)
            assert f > s  # and the host id work, as for fused


def _bad_constraints(rank: int, world_size: int) -> dict:
    sharders = get_default_hybrid_sharders(host_env=host_env())
    model = _model()
    out: dict = {}
    cases = {
        "zero": ({"compute_kernels": ["fused_uvm_caching"], "cache_params": CacheParams(load_factor=0.0)}, None),
        "above_one": ({"compute_kernels": ALL_KERNELS, "cache_params": CacheParams(load_factor=1.5)}, None),
        "text": ({"compute_kernels": ["fused_uvm_caching"], "cache_params": CacheParams(load_factor="0.5")}, None),  # type: ignore[arg-type]
        # No compute_kernels: the planner may pick fused_uvm_caching, so its load factor is checked.
        "unconstrained": ({"cache_params": CacheParams(load_factor=-1.0)}, None),
        "no_directory": ({"compute_kernels": ["key_value"], "key_value_params": KeyValueParams()}, None),
        "no_kv_params": ({"compute_kernels": ["fused", "key_value"]}, None),
        "no_ssd": ({"compute_kernels": ["key_value"], "key_value_params": _kv()}, 0),
        # Only fused allowed: the cache settings are not used, nothing to reject.
        "fused_only": ({"compute_kernels": ["fused"], "cache_params": CacheParams(load_factor=7.0)}, None),
    }
    for name, (fields, ssd_cap) in cases.items():
        topology = Topology(world_size=2, compute_device="cuda", ssd_cap=ssd_cap)
        constraints = {"t0": ParameterConstraints(**fields)}  # type: ignore[arg-type]
        try:  # the enumerator checks the constraints when it is built (on every rank)
            planner = EmbeddingShardingPlanner(
                topology=topology,
                constraints=constraints,
                enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=512, constraints=constraints),
            )
            plan = planner.plan(model, sharders)
            out[name] = {n: ps.compute_kernel for mp in plan.plan.values() for n, ps in mp.items()}
        except ValueError as e:
            out[name] = str(e)
    return out


def test_bad_cache_constraints_fail_when_the_enumerator_is_built() -> None:
    r = run_distributed(_bad_constraints, 1, timeout_s=120)[0]
    for name, value in (("zero", "0.0"), ("above_one", "1.5"), ("text", "'0.5'"), ("unconstrained", "-1.0")):
        message = r[name]
        assert isinstance(message, str), (name, message)
        assert "'t0'" in message and "load_factor" in message and "(0, 1]" in message, message
        assert f"got {value}" in message and "fused_uvm_caching" in message, message
    for name in ("no_directory", "no_kv_params"):
        assert isinstance(r[name], str), (name, r[name])
        assert "'t0'" in r[name] and "ssd_storage_directory" in r[name] and "key_value" in r[name], r[name]
    assert isinstance(r["no_ssd"], str), r["no_ssd"]
    assert "'t0'" in r["no_ssd"] and "ssd_cap" in r["no_ssd"] and "key_value" in r["no_ssd"], r["no_ssd"]
    assert r["fused_only"] == {"t0": "fused"}
