"""Elastic resume: a pipelined job on converted Criteo data (``ColumnarDataset``), checkpointed
after ``drain()`` and resumed on another number of ranks (2 -> 1, 1 -> 2): the tables reshard by
id, the readers split the batches not trained yet, and every batch is trained exactly once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from pipeline_models import shard
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints

from recsdk.data import CRITEO_SPARSE_FEATURES, Batch, ColumnarDataset, convert_criteo, write_synthetic_criteo
from recsdk.data.testing import run_distributed
from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingBagConfig, LRUEviction
from recsdk.pipeline import (
    CombinedOptimizer,
    HybridTrainPipelineSparseDist,
    apply_optimizer_in_backward,
)
from recsdk.sharding import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    sharded_hash_modules,
)

BATCH = 64  # rows per global batch: 1,600 rows make 25 batches
HALVES = (list(CRITEO_SPARSE_FEATURES[:13]), list(CRITEO_SPARSE_FEATURES[13:]))


class CriteoNN(nn.Module):
    """Two hash tables over the 26 categorical features, a dense layer, a logit."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(13, 8)
        self.ebc = HashEmbeddingBagCollection(
            tables=[
                HashEmbeddingBagConfig(
                    name=f"t{i}", embedding_dim=8, num_embeddings=4096, feature_names=names, eviction=LRUEviction()
                )
                for i, names in enumerate(HALVES)
            ],
            device=torch.device("meta"),
        )
        self.over = nn.Linear(8 + 26 * 8, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse_features).to_dict()
        x = torch.cat([self.dense(batch.dense_features), *(pooled[f] for f in CRITEO_SPARSE_FEATURES)], dim=1)
        logits = self.over(x).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


class CountedColumnar(ColumnarDataset):
    """A ColumnarDataset that notes the global batches it yields (in this process)."""

    served: ClassVar[list[int]] = []

    def batch(self, k: int) -> Batch:
        CountedColumnar.served.append(k)
        return super().batch(k)


def _build() -> tuple[DistributedModelParallel, CombinedOptimizer]:
    torch.manual_seed(0)
    model = CriteoNN()
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05})
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["row_wise"]) for i in range(2)}
    return shard(model, constraints, lambda params: torch.optim.Adagrad(params, lr=0.05), host_timeout_s=60)


def _phase(rank: int, world_size: int, data: str, root: str, steps: int | None) -> dict[str, Any]:
    """Resume from ``root``'s latest checkpoint if any; train ``steps`` steps, drain and save
    (``None``: to the end of the epoch). The global batches this rank trained."""
    torch.set_num_threads(1)
    CountedColumnar.served = []
    model, optimizer = _build()
    dataset = CountedColumnar(data, BATCH, rank=rank, world_size=world_size, shuffle=True, seed=3, drop_last=True)
    loader = StatefulDataLoader(dataset, batch_size=None)
    latest = latest_checkpoint(root)
    if latest is not None:
        extra = load_checkpoint(model, optimizer, latest)  # another world size: rank 0's extra
        loader.load_state_dict(extra["data"])
    batches = iter(loader)
    trained = 0
    with HybridTrainPipelineSparseDist(model, optimizer, torch.device("cpu"), pipe_n_batch=2) as pipeline:
        while steps is None or trained < steps:
            try:
                pipeline.progress(batches)
            except StopIteration:
                break
            trained += 1
        if steps is not None:
            trained += len(pipeline.drain())
            extra = {"data": loader.state_dict()}
            save_checkpoint(model, optimizer, os.path.join(root, f"ckpt_{world_size}"), pipeline=pipeline, extra=extra)
    ids = sum(len(t) for m in sharded_hash_modules(model).values() for t in m.id_tables.values())
    return {"served": list(CountedColumnar.served), "trained": trained, "ids": ids}


@pytest.fixture(scope="module")
def columnar(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("elastic")
    day = write_synthetic_criteo(folder / "day.tsv", 25 * BATCH, seed=5)
    convert_criteo(day, folder / "data", workers=1, progress=False)
    return str(folder / "data")


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_elastic_resume_trains_every_batch_once(columnar: str, tmp_path: Path, before: int, after: int) -> None:
    # 3 steps and the 2 batches read ahead: 5 batches a rank, so the rest splits evenly over
    # the new ranks (ranks with unequal batch counts could not train in lockstep).
    first = run_distributed(_phase, before, columnar, str(tmp_path), 3, timeout_s=180)
    second = run_distributed(_phase, after, columnar, str(tmp_path), None, timeout_s=180)
    served = [k for r in first + second for k in r["served"]]
    assert sorted(served) == list(range(25)), served  # each of the epoch's 25 batches once
    assert sum(r["trained"] for r in first + second) == 25
    assert all(r["trained"] == 5 for r in first)
    assert sum(r["ids"] for r in second) > 0
