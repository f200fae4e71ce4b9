"""A batch's tables mapped on several threads (``host_threads``): the same training, the same errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from sharding_models import SparseNN, host_env, sharded_hash_ebc, synthetic_data
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsdk.data.testing import DistributedTestError, run_distributed
from recsdk.embedding import CountAdmission, HashEmbeddingBagConfig, LRUEviction
from recsdk.sharding import HybridEmbeddingEnumerator, get_default_hybrid_sharders
from recsdk.sharding.host.table_workers import TableWorkers, default_host_threads


def test_workers_return_each_result_or_exception_in_order_on_several_threads() -> None:
    workers = TableWorkers(3)
    seen: set[int] = set()
    barrier = threading.Barrier(3, timeout=10)

    def task(i: int) -> int:
        seen.add(threading.get_ident())
        if i < 3:
            barrier.wait()  # the first three run at once, or this times out
        if i == 4:
            raise ValueError("table 4 failed")
        time.sleep(0.001 * (5 - i))  # later items finish first
        return 10 * i

    outcomes = workers.run(task, list(range(6)))
    assert outcomes[:4] == [0, 10, 20, 30] and outcomes[5] == 50
    assert isinstance(outcomes[4], ValueError) and "table 4" in str(outcomes[4])
    assert len(seen) == 3
    workers.close()


def test_one_worker_runs_in_the_calling_thread() -> None:
    caller = threading.get_ident()
    assert TableWorkers(1).run(lambda _: threading.get_ident(), [0, 1, 2]) == [caller] * 3


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts_are_refused(threads: object) -> None:
    with pytest.raises(ValueError, match=r"host_threads must be an int >= 1, got"):
        TableWorkers(threads)  # type: ignore[arg-type]


def test_default_threads_one_on_cpu_and_a_share_of_the_cores_on_an_accelerator(monkeypatch) -> None:
    assert default_host_threads(torch.device("cpu")) == 1
    assert default_host_threads(None) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "10000")
    assert default_host_threads(torch.device("cuda")) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert 1 <= default_host_threads(torch.device("cuda")) <= 8


def _configs(capacity: int, **policies) -> list[HashEmbeddingBagConfig]:
    return [
        HashEmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=capacity, feature_names=[f], **policies)
        for i, f in enumerate(["f0", "f1"])
    ]


def _model(threads: int, capacity: int, layout: str, **policies) -> DistributedModelParallel:
    torch.manual_seed(0)
    model = SparseNN(_configs(capacity, **policies), num_dense=4, device="meta")
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05, "eps": 0.1})
    constraints = {t: ParameterConstraints(sharding_types=[layout]) for t in ("t0", "t1")}
    sharders = get_default_hybrid_sharders(host_env(), host_threads=threads)
    world = torch.distributed.get_world_size()
    topology = Topology(world_size=world, compute_device="cpu")
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=constraints,
        enumerator=HybridEmbeddingEnumerator(topology=topology, batch_size=32, constraints=constraints),
    )
    plan = planner.collective_plan(model, sharders, torch.distributed.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


def _train_alike(rank: int, world_size: int, layout: str) -> dict:
    """The same batches through a model mapping on one thread and one mapping on three."""
    policies = {"admission": CountAdmission(threshold=2), "eviction": LRUEviction()}
    batches = list(synthetic_data(rank, world_size, num_batches=24, batch_size=16, sample_seed=3))
    models, losses = {}, {}
    for n in (1, 3):  # one after the other: a reassigned row's new embedding draws from torch's RNG
        models[n] = _model(n, capacity=96, layout=layout, **policies)
        losses[n] = []
        for batch in batches:
            loss, _ = models[n](batch)
            loss.backward()
            losses[n].append(float(loss))
    one, three = (sharded_hash_ebc(models[n]) for n in (1, 3))
    same_tables = all(
        torch.equal(one.id_tables[t].ids_and_rows()[0], three.id_tables[t].ids_and_rows()[0])
        and torch.equal(one.id_tables[t].ids_and_rows()[1], three.id_tables[t].ids_and_rows()[1])
        and one.id_tables[t].stats() == three.id_tables[t].stats()
        for t in one.id_tables
    )
    same_rows = all(torch.equal(one.table_views()[t].weight, three.table_views()[t].weight) for t in one.table_views())
    evictions = sum(t.stats()["evictions"] for t in one.id_tables.values())
    return {"losses": losses, "same_tables": same_tables, "same_rows": same_rows, "evictions": evictions}


@pytest.mark.parametrize("layout", ["row_wise", "table_wise"])
def test_tables_mapped_on_three_threads_train_bit_for_bit_as_on_one(layout: str) -> None:
    results = run_distributed(_train_alike, 2, layout)
    for r in results:
        assert r["losses"][1] == r["losses"][3]
        assert r["same_tables"] and r["same_rows"]
    assert sum(r["evictions"] for r in results) > 0  # eviction and admission were exercised


def _overflow(rank: int, world_size: int) -> None:
    model = _model(3, capacity=8, layout="table_wise")  # no eviction: a full table raises
    for batch in synthetic_data(rank, world_size, num_batches=4, batch_size=32, sample_seed=1):
        loss, _ = model(batch)
        loss.backward()


def test_a_full_table_on_a_worker_thread_raises_on_every_rank_naming_it() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_overflow, 2, timeout_s=60)
    text = str(info.value)
    assert "TableFullError" in text and "is full on rank" in text
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text


def test_a_context_records_its_device_tensors_and_never_its_host_ones(monkeypatch) -> None:
    """TorchRec's pipelines call ``ctx.record_stream`` on a GPU; the received ids stay on the host,
    where ``record_stream`` raises, so only the device tensors are recorded."""
    from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsdk.sharding.context import HashEmbeddingBagCollectionContext, HashEmbeddingCollectionContext

    recorded: list[torch.Tensor] = []

    def record(tensor: torch.Tensor, stream: object) -> None:
        if tensor.device.type == "cpu":
            raise NotImplementedError("Could not run 'aten::record_stream' with arguments from the 'CPU' backend")
        recorded.append(tensor)

    monkeypatch.setattr(torch.Tensor, "record_stream", record)
    host_ids = KeyedJaggedTensor(keys=["f"], values=torch.arange(4), lengths=torch.tensor([4]))
    device_rows = KeyedJaggedTensor(
        keys=["f"], values=torch.arange(4, device="meta"), lengths=torch.tensor([4], device="meta")
    )
    permute = torch.arange(4, device="meta")
    sharding = SequenceShardingContext(
        features_before_input_dist=host_ids, sparse_features_recat=torch.arange(2), unbucketize_permute_tensor=permute
    )
    ec = HashEmbeddingCollectionContext(sharding_contexts=[sharding], input_features=[device_rows])
    ec.batch_rows = {"t0": torch.arange(3)}  # host rows
    ec.record_stream(object())  # type: ignore[arg-type]
    assert any(t is permute for t in recorded) and any(t is device_rows.values() for t in recorded)
    assert all(t.device.type == "meta" for t in recorded)
    recorded.clear()
    ebc = HashEmbeddingBagCollectionContext(sharding_contexts=[sharding])
    ebc.bag_lengths = {"f": torch.ones(2, device="meta")}
    ebc.record_stream(object())  # type: ignore[arg-type]
    assert any(t is permute for t in recorded) and len(recorded) == 2
