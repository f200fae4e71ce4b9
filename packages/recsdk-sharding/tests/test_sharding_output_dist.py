"""AllToAllPooledEmbeddingDist: the row-wise output dist recsdk uses on gloo.

It must give what TorchRec's reduce-scatter dist gives (same sums forward, same gradients,
including TorchRec's division by the world size), and also take unequal batch sizes. Carrying
the host stage's failure flag (it and the table-wise dist) must change neither output nor
gradients, and every rank must read every rank's flag.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from sharding_models import SparseNN, shard, sharded_hash_ebc, tables
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsdk.data.testing import run_distributed
from recsdk.sharding import (
    AllToAllPooledEmbeddingDist,
    CarriedFlag,
    FlagCarryingTwPooledEmbeddingDist,
    sharded_hash_modules,
)

DIM = 8


def _partials(rank: int, splits: list[int]) -> torch.Tensor:
    """This rank's partial pooled sums for every rank's samples, ``[sum(splits), DIM]``."""
    return torch.randn(sum(splits), DIM, generator=torch.Generator().manual_seed(100 + rank))


def _out_grad(rank: int, batch: int) -> torch.Tensor:
    return torch.randn(batch, DIM, generator=torch.Generator().manual_seed(200 + rank))


def _run(dist_cls: type, rank: int, splits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    x = _partials(rank, splits).requires_grad_()
    ctx = EmbeddingShardingContext(batch_size_per_rank=splits)
    out = dist_cls(dist.group.WORLD, embedding_dims=[DIM])(x, ctx).wait()
    (out * _out_grad(rank, splits[rank])).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


def _against_torchrec(rank: int, world_size: int) -> dict[str, float]:
    splits = [5] * world_size
    ours, our_grad = _run(AllToAllPooledEmbeddingDist, rank, splits)
    theirs, their_grad = _run(RwPooledEmbeddingDist, rank, splits)
    return {
        "out": float((ours - theirs).abs().max()),
        "grad": float((our_grad - their_grad).abs().max()),
        "shape": list(ours.shape),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_dist_matches_torchrec_reduce_scatter(world_size: int) -> None:
    for rank, r in enumerate(run_distributed(_against_torchrec, world_size, timeout_s=60)):
        assert r["shape"] == [5, DIM], rank
        assert r["out"] <= 1e-6, (rank, r)  # sums of the same partials, in another order
        assert r["grad"] == 0.0, (rank, r)  # same gradients, divided by the world size as TorchRec does


def _unequal(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(AllToAllPooledEmbeddingDist, rank, [3, 6, 1][:world_size])


def test_all_to_all_dist_takes_unequal_batches() -> None:
    splits = [3, 6, 1]
    results = run_distributed(_unequal, 3, timeout_s=60)
    partials = [_partials(r, splits) for r in range(3)]
    starts = [0, 3, 9]
    for rank, (out, grad) in enumerate(results):
        a, b = starts[rank], starts[rank] + splits[rank]
        torch.testing.assert_close(out, sum(p[a:b] for p in partials))
        # My partials for rank j's samples get rank j's output gradient, divided by the world size.
        expected = torch.cat([_out_grad(j, splits[j]) for j in range(3)]) / 3
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def _output_dists_of_row_wise_modules(rank: int, world_size: int) -> dict[str, list[str]]:
    row_wise = {t: ParameterConstraints(sharding_types=["row_wise"]) for t in ("t0", "t1")}
    hashed = shard(SparseNN(tables(capacity=256), num_dense=4, device="meta"), batch_size=8, constraints=row_wise)
    assert sharded_hash_modules(hashed)
    plain = shard(
        EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=64, feature_names=["f0"])],
            device=torch.device("meta"),
        ),
        batch_size=8,
        constraints={"t0": ParameterConstraints(sharding_types=["row_wise"])},
    )
    return {
        "hashed": [type(d).__name__ for d in sharded_hash_ebc(hashed)._output_dists],
        "plain": [type(d).__name__ for d in plain.module._output_dists],
    }


def test_row_wise_shardings_on_gloo_use_the_all_to_all_dist() -> None:
    for r in run_distributed(_output_dists_of_row_wise_modules, 2, timeout_s=60):
        assert r == {"hashed": ["AllToAllPooledEmbeddingDist"], "plain": ["AllToAllPooledEmbeddingDist"]}, r


def _with_and_without_flag(rank: int, world_size: int, kind: str) -> dict:
    """The same dist call with a carried flag (rank 1's set) and without one: outputs, gradients,
    and what each rank read of the flags."""
    splits = [3, 0, 5][:world_size]  # unequal, and a rank without samples: it still gets the header
    ctx = EmbeddingShardingContext(batch_size_per_rank=splits)

    def make() -> torch.nn.Module:
        if kind == "row_wise":
            return AllToAllPooledEmbeddingDist(dist.group.WORLD, embedding_dims=[DIM])
        return FlagCarryingTwPooledEmbeddingDist(
            pg=dist.group.WORLD, dim_sum_per_rank=[DIM] * world_size, emb_dim_per_rank_per_feature=[[DIM]] * world_size
        )

    results = []
    flag = CarriedFlag()
    for carried in (False, True):
        output_dist = make()
        if carried:
            assert output_dist.carries_flag()
            output_dist.carry(flag)
            flag.arm(rank == 1)
        x = _partials(rank, splits).requires_grad_()
        out = output_dist(x, ctx).wait()
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(300 + rank))).sum().backward()
        assert x.grad is not None
        results.append((out.detach(), x.grad))
    (plain_out, plain_grad), (flag_out, flag_grad) = results
    return {
        "same": torch.equal(plain_out, flag_out) and torch.equal(plain_grad, flag_grad),
        "shape": list(flag_out.shape),
        "failed": flag.take(),
        "after_take": flag.take(),  # take() clears what it read
    }


@pytest.mark.parametrize("kind", ["row_wise", "table_wise"])
def test_the_flag_travels_in_the_output_dist_without_changing_it(kind: str) -> None:
    for rank, r in enumerate(run_distributed(_with_and_without_flag, 3, kind, timeout_s=60)):
        assert r["same"], (rank, r)
        assert r["shape"] == [[3, 0, 5][rank], DIM if kind == "row_wise" else 3 * DIM], (rank, r)
        assert r["failed"] is True and r["after_take"] is False, (rank, r)  # every rank saw rank 1's flag
