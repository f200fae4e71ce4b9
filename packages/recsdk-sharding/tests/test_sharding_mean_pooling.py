"""MEAN pooling of a sharded HashEBC: as the unsharded module pools, on every plan.

A bag's mean divides by its length as the rank received it: an id without a row (unknown in
eval) still counts, on the row-wise and the table-wise plan alike; and a rank's batch may be
empty.
"""

from __future__ import annotations

import torch
from sharding_models import SparseNN, shard, tables
from torchrec.distributed.planner import ParameterConstraints
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recsdk.data import Batch
from recsdk.data.testing import run_distributed
from recsdk.sharding import sharded_hash_modules

KNOWN, UNKNOWN = 12345, 67890
# t0 row-wise, t1 table-wise: both plans in one process group.
MIXED = {
    "t0": ParameterConstraints(sharding_types=["row_wise"]),
    "t1": ParameterConstraints(sharding_types=["table_wise"]),
}


def _batch(bags: list[list[int]]) -> Batch:
    """The same bags for f0 and f1."""
    ids = [i for bag in bags for i in bag] * 2
    lengths = [len(bag) for bag in bags] * 2
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1"],
        values=torch.tensor(ids, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )
    return Batch(torch.zeros(len(bags), 4), kjt, torch.zeros(len(bags)))


def _pooled(model: torch.nn.Module, batch: Batch) -> KeyedTensor:
    (module,) = sharded_hash_modules(model).values()
    return module(batch.sparse_features).wait()  # type: ignore[operator]


def _means(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = SparseNN(tables(capacity=64, dims=(8, 8), pooling=PoolingType.MEAN), num_dense=4, device="meta")
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.1})
    model = shard(model, batch_size=4, constraints=MIXED)
    loss, _ = model(_batch([[KNOWN], [KNOWN, KNOWN]]))  # inserts KNOWN
    loss.backward()
    # A training step where rank 0 has no samples (the sharded module alone: no dense loss).
    _pooled(model, _batch([]) if rank == 0 else _batch([[KNOWN, 5], [6]])).values().sum().backward()
    model.eval()
    with torch.no_grad():
        out = {
            k: v.detach()
            for k, v in _pooled(model, _batch([[KNOWN], [KNOWN, UNKNOWN], [UNKNOWN, UNKNOWN]])).to_dict().items()
        }
        empty = _pooled(model, _batch([]) if rank == 0 else _batch([[KNOWN]])).to_dict()
    return {
        "half": {f: float((v[1] - v[0] / 2).abs().max()) for f, v in out.items()},
        "unknown_only": {f: float(v[2].abs().max()) for f, v in out.items()},
        "known": {f: float(v[0].abs().max()) for f, v in out.items()},
        "empty_shapes": {f: list(v.shape) for f, v in empty.items()},
    }


def test_mean_divides_by_the_bag_length_on_every_plan_and_takes_empty_batches() -> None:
    results = run_distributed(_means, 2, timeout_s=90)
    for rank, r in enumerate(results):
        for feature in ("f0", "f1"):  # f0: row-wise, f1: table-wise
            assert r["known"][feature] > 0, (rank, r)
            assert r["half"][feature] <= 1e-6, (rank, feature, r)  # [KNOWN, UNKNOWN] = KNOWN / 2
            assert r["unknown_only"][feature] == 0.0, (rank, r)
    assert results[0]["empty_shapes"] == {"f0": [0, 8], "f1": [0, 8]}, results[0]
    assert results[1]["empty_shapes"] == {"f0": [1, 8], "f1": [1, 8]}, results[1]
