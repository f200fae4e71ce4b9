"""Batch through TorchRec's own TrainPipelineSparseDist (stock EBC, 2 CPU ranks)."""

import torch
from torch.utils.data import DataLoader
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch, RandomRecDataset
from recsdk.data.testing import run_distributed

ROWS = 64


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name=f"t_{key}", embedding_dim=8, num_embeddings=ROWS, feature_names=[key])
            for key in "ab"
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.head = torch.nn.Linear(16 + 4, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.head(torch.cat([pooled, batch.dense_features], dim=1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits


def _small_ids(batch: Batch) -> Batch:
    # The stock EBC needs rows in [0, ROWS); recsdk's tables take the raw ids instead.
    kjt = batch.sparse_features
    rows = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().remainder(ROWS), lengths=kjt.lengths())
    return Batch(batch.dense_features, rows, batch.labels)


def _train(rank: int, world_size: int) -> tuple[int, int]:
    ds = RandomRecDataset(16, 6, ["a", "b"], 1000, num_dense_features=4, seed=0)
    loader = DataLoader(ds, batch_size=None, collate_fn=_small_ids)
    model = DistributedModelParallel(_Model(), device=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"), execute_all_batches=True)
    it = iter(loader)
    steps = 0
    try:
        while True:
            pipeline.progress(it)
            steps += 1
    except StopIteration:
        pass
    return steps, len(pipeline._pipelined_modules)


def test_batch_runs_through_torchrec_train_pipeline() -> None:
    # Every batch is trained, and the EBC input dist is pipelined: TorchRec traced
    # `batch.sparse_features` by attribute access and moved the Batch with `.to()`.
    # forkserver: ranks must not be forked from a pytest process that already ran OpenMP work.
    assert run_distributed(_train, 2, timeout_s=120, start_method="forkserver") == [(6, 1), (6, 1)]
