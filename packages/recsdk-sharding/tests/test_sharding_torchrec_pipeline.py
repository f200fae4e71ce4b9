"""A sharded HashEBC under TorchRec's own ``TrainPipelineSparseDist``.

TorchRec's pipeline swaps every ``KJTAllToAll``'s forward for its fused-splits one (one
all-to-all per tensor, no batch flag). The hash module's ``FusedKJTAllToAll`` keeps its own
exchange: the pipeline trains as the plain loop does, a batch's ids cross the host group in one
all-to-all, and a bad batch on one rank is mapped by no rank.
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from sharding_models import SparseNN, shard, sharded_hash_ebc, tables
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch
from recsdk.data.testing import run_distributed
from recsdk.sharding import FusedKJTAllToAll

TABLE_WISE = {n: ParameterConstraints(sharding_types=["table_wise"]) for n in ("t0", "t1")}
BATCHES = 6
BAD_AT = 3  # rank 0's batch with a negative length
FAST_S = 10.0  # far below the process-group timeout a hang would hit


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SparseNN(tables(capacity=512, dims=(8, 8)), num_dense=4, device="meta")
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05, "eps": 0.1})
    dmp = shard(model, batch_size=8, constraints=TABLE_WISE)
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.SGD(dense, lr=0.1)


def _batches(rank: int) -> list[Batch]:
    out = []
    for i in range(BATCHES):
        g = torch.Generator().manual_seed(100 * rank + i)
        lengths = torch.randint(0, 3, (16,), generator=g)
        ids = torch.randint(-(2**62), 2**62, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=ids, lengths=lengths)
        out.append(Batch(torch.randn(8, 4, generator=g), kjt, torch.randint(0, 2, (8,), generator=g).float()))
    return out


def _with_negative_length(batch: Batch) -> Batch:
    kjt = batch.sparse_features
    lengths = kjt.lengths().clone()
    lengths[0], lengths[1] = -1, lengths[1] + lengths[0] + 1  # the same number of ids
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=lengths)
    return Batch(batch.dense_features, bad, batch.labels)


def _run(rank: int, world_size: int) -> dict[str, Any]:
    every = [_batches(r) for r in range(world_size)]
    batches = every[rank]
    # The plain loop: each batch's output (probabilities), before its step.
    model, optimizer = _model()
    plain = []
    for batch in batches:
        optimizer.zero_grad()
        loss, probs = model(batch)
        loss.backward()
        optimizer.step()
        plain.append(probs)
    # TorchRec's pipeline over the same batches, counting the host group's all-to-alls.
    model, optimizer = _model()
    module = sharded_hash_ebc(model)
    host = module.host_group
    calls = 0
    real = dist.all_to_all_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += kwargs.get("group") is host
        return real(*args, **kwargs)

    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    it = iter(batches)
    with mock.patch.object(dist, "all_to_all_single", counted):
        piped = [pipeline.progress(it) for _ in batches]  # the model's output: the probabilities
    swapped = [d for d in module._input_dists if "forward" in vars(d._dist)]
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, piped, strict=True))
    # A bad batch on rank 0 under the pipeline: both ranks raise there; no rank maps it.
    model, optimizer = _model()
    module = sharded_hash_ebc(model)
    if rank == 0:
        batches[BAD_AT] = _with_negative_length(batches[BAD_AT])
    earlier = torch.cat([b.sparse_features.values() for r in every for b in r[:BAD_AT]])
    new_ids = torch.cat([r[BAD_AT].sparse_features.values() for r in every])
    new_ids = new_ids[~torch.isin(new_ids, earlier)]
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    it = iter(batches)
    outcome: tuple[Any, ...] = ()
    for i in range(BATCHES):
        started = time.monotonic()
        try:
            pipeline.progress(it)
        except Exception as e:
            outcome = (i, type(e).__name__, str(e), time.monotonic() - started)
            break
    stored = torch.cat([table.ids_and_rows()[0] for table in module.id_tables.values()])
    return {
        "same": same,
        "calls": calls,
        "swapped": len(swapped),
        "fused": all(isinstance(d._dist, FusedKJTAllToAll) for d in module._input_dists),
        "bad": outcome,
        "new_ids": new_ids.numel(),
        "stored_new": int(torch.isin(new_ids, stored).sum()),
    }


def test_torchrec_pipeline_keeps_the_fused_exchange() -> None:
    for rank, out in enumerate(run_distributed(_run, 2, timeout_s=120)):
        assert out["same"], rank  # the plain loop's outputs, batch for batch
        assert out["fused"] and out["swapped"] == 0, (rank, out)  # the swap left no instance forward
        # The first exchange is header-only (its splits, then its tensors), then one all-to-all a
        # batch, where TorchRec's forward would send three (splits, lengths, ids).
        assert out["calls"] == 2 + (BATCHES - 1), (rank, out["calls"])
        bad_at, error, message, seconds = out["bad"]
        assert bad_at == BAD_AT and seconds < FAST_S, (rank, out["bad"])
        if rank == 0:
            assert error == "ValueError" and "negative" in message, out["bad"]
        else:
            assert error == "PeerFailureError" and "rank(s) [0]" in message, out["bad"]
        assert out["new_ids"] > 0 and out["stored_new"] == 0, (rank, out)
