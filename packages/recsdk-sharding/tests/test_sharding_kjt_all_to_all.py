"""FusedKJTAllToAll: the host input dists' id all-to-all.

It must hand every rank the KJT TorchRec's ``KJTAllToAll`` hands it (keys, lengths, values,
weights, dtypes, strides) and the exchange's splits, recat and batch sizes that TorchRec's
shardings read, in one all-to-all once its capacity has followed the batches (two the first
time, and for a batch larger than the capacity), where TorchRec's takes three (four with weights).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll, KJTAllToAllTensorsAwaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data.testing import run_distributed
from recsdk.sharding import FusedKJTAllToAll
from recsdk.sharding.distribution.kjt_all_to_all import batch_flag

WORLD = 3
BATCH = [4, 6, 3]  # unequal batch sizes per rank


def _kjt(rank: int, keys: list[str], *, weighted: bool, empty: bool, most: int = 4) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(10 + rank + most)
    lengths = torch.randint(0, most, (len(keys) * BATCH[rank],), generator=gen, dtype=torch.int32)
    if empty:
        lengths.zero_()
    n = int(lengths.sum())
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.randint(-(2**62), 2**62, (n,), generator=gen),
        weights=torch.rand(n, generator=gen) if weighted else None,
        lengths=lengths,
        stride=BATCH[rank],
    )


def _exchange(a2a: KJTAllToAll, kjt: KeyedJaggedTensor) -> tuple[dict[str, Any], int]:
    calls = 0
    real = dist.all_to_all_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    with mock.patch.object(dist, "all_to_all_single", counted):
        tensors = a2a(kjt).wait()
        out = _summary(tensors.wait())
    # What TorchRec's shardings read off a tensors awaitable (unpooled output dists, batch sizes).
    assert isinstance(tensors, KJTAllToAllTensorsAwaitable)
    recat = tensors._recat
    out["context"] = {
        "input_splits": tensors._input_splits["values"],
        "output_splits": tensors._output_splits["values"],
        "stride_per_rank": tensors._stride_per_rank,
        "recat": None if recat is None else recat.tolist(),
    }
    return out, calls


def _summary(kjt: KeyedJaggedTensor) -> dict[str, Any]:
    weights = kjt.weights_or_none()
    return {
        "keys": kjt.keys(),
        "stride": kjt.stride(),
        "lengths": kjt.lengths().tolist(),
        "lengths_dtype": str(kjt.lengths().dtype),
        "values": kjt.values().tolist(),
        "weights": None if weights is None else weights.tolist(),
    }


def _both(rank: int, world_size: int) -> list[dict[str, Any]]:
    cases = [
        # table-wise: rank 1 holds no feature; weighted; rank 2's batch has no ids
        (["a", "b", "c"], [2, 0, 1], True),
        # row-wise: every rank gets every feature (bucketed layout), unweighted
        (["a", "b"] * world_size, [2] * world_size, False),
    ]
    results = []
    for keys, splits, weighted in cases:
        fused_a2a = FusedKJTAllToAll(dist.group.WORLD, splits)
        their_a2a = KJTAllToAll(dist.group.WORLD, splits)
        # The first batch, the same again, one with more ids than the capacity, then a smaller one.
        for most in (4, 4, 12, 2):
            kjt = _kjt(rank, keys, weighted=weighted, empty=rank == 2, most=most)
            fused, fused_calls = _exchange(fused_a2a, kjt)
            theirs, their_calls = _exchange(their_a2a, kjt)
            results.append({"fused": fused, "theirs": theirs, "calls": (fused_calls, their_calls)})
    # The batch flag: rank 2's batch failed, then none did, then a call outside batch_flag.
    kjt = _kjt(rank, ["a", "b", "c"], weighted=False, empty=False)
    a2a = FusedKJTAllToAll(dist.group.WORLD, splits=[1, 1, 1])
    heard: list[bool] = []
    for failed in (rank == 2, False):
        with batch_flag(failed, heard.append):
            pending = a2a(kjt)
        pending.wait().wait()  # waited outside: the flag belongs to the call, not to the block
    with batch_flag(True, heard.append):
        pass
    a2a(kjt).wait().wait()
    results.append({"heard": heard})
    return results


def test_fused_all_to_all_gives_torchrec_kjt_in_one_collective() -> None:
    results = run_distributed(_both, WORLD, timeout_s=60)
    for rank, (*cases, flags) in enumerate(results):
        assert flags["heard"] == [True, False], rank  # every rank hears rank 2's flag, once per call
        tw, rw = cases[0], cases[4]
        for case in cases:
            assert case["fused"] == case["theirs"], rank
        # First a header-only block (the splits) and the tensors; then one collective, but for
        # the batch larger than the capacity (its overflow); TorchRec's: splits + each tensor.
        assert [c["calls"] for c in cases[:4]] == [(2, 4), (1, 4), (2, 4), (1, 4)], rank
        assert [c["calls"] for c in cases[4:]] == [(2, 3), (1, 3), (2, 3), (1, 3)], rank
        assert tw["fused"]["stride"] == sum(BATCH)
        assert tw["fused"]["weights"] is not None and rw["fused"]["weights"] is None
        assert tw["fused"]["lengths_dtype"] == "torch.int32"
    assert [r[0]["fused"]["keys"] for r in results] == [["a", "b"], [], ["c"]]
