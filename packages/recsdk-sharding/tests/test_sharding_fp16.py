"""fp16 tables: ``data_type=DataType.FP16`` stores rows in fp16 in the fused kernel.

On the synthetic task an fp16 model reaches the fp32 model's AUC (within 0.005) with half the
table memory; the planner counts half the bytes; checkpoints (resharded too) and exports keep
the dtype.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
from sharding_models import SparseNN, auc, host_env, shard, sharded_hash_ebc, synthetic_data
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.modules.embedding_configs import DataType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recsdk.data.testing import DistributedTestError, run_distributed
from recsdk.embedding import HashEmbeddingBagConfig
from recsdk.sharding import (
    HybridEmbeddingEnumerator,
    export_embeddings,
    get_default_hybrid_sharders,
    load_checkpoint,
    save_checkpoint,
)

FEATURES = ["f0", "f1"]


def _tables(data_type: DataType) -> list[HashEmbeddingBagConfig]:
    return [
        HashEmbeddingBagConfig(
            name=f"t{i}", embedding_dim=16, num_embeddings=4096, feature_names=[f], data_type=data_type
        )
        for i, f in enumerate(FEATURES)
    ]


def _train(rank: int, world_size: int, data_type: DataType) -> dict:
    torch.manual_seed(0)
    model = SparseNN(_tables(data_type), num_dense=4, device="meta")
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.1, "eps": 0.01})
    constraints = {"t0": ParameterConstraints(sharding_types=["row_wise"])}
    ddp_model = shard(model, batch_size=128, constraints=constraints)
    dense = torch.optim.Adagrad([p for n, p in ddp_model.named_parameters() if "ebc" not in n], lr=0.1)
    for batch in synthetic_data(rank, world_size, 80, 128, sample_seed=0):
        loss, _ = ddp_model(batch)
        loss.backward()
        dense.step()
        dense.zero_grad()
    ddp_model.eval()
    scores, labels = [], []
    with torch.no_grad():
        for b in synthetic_data(rank, world_size, 8, 128, sample_seed=1000):
            scores.append(ddp_model(b)[1])
            labels.append(b.labels)
    s, y = torch.cat(scores), torch.cat(labels)
    all_s, all_y = [torch.zeros_like(s) for _ in range(world_size)], [torch.zeros_like(y) for _ in range(world_size)]
    dist.all_gather(all_s, s)
    dist.all_gather(all_y, y)
    views = sharded_hash_ebc(ddp_model).table_views()
    return {
        "auc": auc(torch.cat(all_s), torch.cat(all_y)),
        "dtypes": {n: str(v.weight.dtype) for n, v in views.items()},
        "table_bytes": sum(v.weight.numel() * v.weight.element_size() for v in views.values()),
    }


def test_fp16_tables_reach_the_fp32_auc_at_half_the_memory() -> None:
    fp32 = run_distributed(_train, 2, DataType.FP32, timeout_s=180)
    fp16 = run_distributed(_train, 2, DataType.FP16, timeout_s=180)
    assert fp32[0]["auc"] > 0.7, fp32  # it learned something
    assert abs(fp16[0]["auc"] - fp32[0]["auc"]) < 0.005, (fp16[0]["auc"], fp32[0]["auc"])
    for a, b in zip(fp16, fp32, strict=True):
        assert set(a["dtypes"].values()) == {"torch.float16"} and set(b["dtypes"].values()) == {"torch.float32"}
        assert a["table_bytes"] * 2 == b["table_bytes"]


def _adam_fp16(rank: int, world_size: int) -> None:
    model = SparseNN(_tables(DataType.FP16), num_dense=4, device="meta")
    apply_optimizer_in_backward(torch.optim.Adam, model.ebc.parameters(), {"lr": 0.01})
    shard(model, batch_size=128)


def test_fp16_with_the_cpu_adam_is_refused_naming_the_table() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_adam_fp16, 2, timeout_s=120)
    text = str(info.value)
    assert "ValueError" in text and "'t0'" in text and "FP16" in text and "Adam" in text, text


def _planned_storage(rank: int, world_size: int) -> dict:
    out = {}
    sharders = get_default_hybrid_sharders(host_env=host_env())
    topology = Topology(world_size=world_size, compute_device="cpu")
    for data_type in (DataType.FP32, DataType.FP16):
        model = SparseNN(_tables(data_type), num_dense=4, device="meta")
        for kind, enumerator in (
            ("hybrid", HybridEmbeddingEnumerator(topology=topology, batch_size=128)),
            ("torchrec", EmbeddingEnumerator(topology=topology, batch_size=128)),
        ):
            options = enumerator.enumerate(model, sharders)
            out[(data_type.name, kind)] = {
                o.sharding_type: sum(s.storage.ddr for s in o.shards) for o in options if o.name == "t0"
            }
    return out


def test_the_planner_counts_fp16_rows_at_half_the_bytes() -> None:
    r = run_distributed(_planned_storage, 2, timeout_s=120)[0]
    for layout, fp32 in r[("FP32", "hybrid")].items():
        fp16 = r[("FP16", "hybrid")][layout]
        # The rows shrink by 2 bytes per element (TorchRec's estimate of what depends on them too) ...
        assert fp32 - fp16 >= 4096 * 16 * 2, (layout, fp32, fp16)
        # ... the id table (int64 ids and metadata) does not.
        id_table_fp32 = fp32 - r[("FP32", "torchrec")][layout]
        assert id_table_fp32 > 0 and id_table_fp32 == fp16 - r[("FP16", "torchrec")][layout], layout


def _fp16_checkpoint(rank: int, world_size: int, root: str, save: bool) -> dict:
    torch.manual_seed(0)
    model = SparseNN(_tables(DataType.FP16), num_dense=4, device="meta")
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.1, "eps": 0.01})
    constraints = {"t0": ParameterConstraints(sharding_types=["row_wise"])} if world_size > 1 else None
    ddp_model = shard(model, batch_size=128, constraints=constraints)
    sebc = sharded_hash_ebc(ddp_model)
    path = os.path.join(root, "fp16")

    def per_id() -> dict:
        views = sebc.table_views()
        out = {}
        for name, table in sebc.id_tables.items():
            ids, rows = table.ids_and_rows()
            for i, r in zip(ids.tolist(), rows.tolist(), strict=True):
                out[(name, i)] = views[name].weight[r].clone()
        return out

    if not save:
        load_checkpoint(ddp_model, None, path)
        return {"loaded": per_id(), "dtypes": {n: str(v.weight.dtype) for n, v in sebc.table_views().items()}}
    for batch in synthetic_data(rank, world_size, 3, 128, sample_seed=0):
        loss, _ = ddp_model(batch)
        loss.backward()
    save_checkpoint(ddp_model, None, path)
    export_embeddings(ddp_model, os.path.join(root, "fp16_export"))
    return {"saved": per_id()}


def test_fp16_checkpoints_and_exports_keep_the_dtype(tmp_path: Path) -> None:
    ranks = run_distributed(_fp16_checkpoint, 2, str(tmp_path), True, timeout_s=120)
    saved = {k: v for r in ranks for k, v in r["saved"].items()}
    assert saved and all(v.dtype == torch.float16 for v in saved.values())
    (one,) = run_distributed(_fp16_checkpoint, 1, str(tmp_path), False, timeout_s=120)  # resharded 2 -> 1
    assert set(one["dtypes"].values()) == {"torch.float16"}
    assert set(one["loaded"]) == set(saved)
    assert all(torch.equal(one["loaded"][k], saved[k]) for k in saved)
    table = pq.read_table(tmp_path / "fp16_export" / "t0")
    assert table.schema.field("embedding").type.value_type == pa.float16()
    by_id = dict(zip(table.column("id").to_pylist(), table.column("embedding").to_pylist(), strict=True))
    for (name, i), row in saved.items():
        if name == "t0":
            assert torch.equal(torch.tensor(by_id[i], dtype=torch.float16), row)
