import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.embedding.hashing import fmix64_reference
from recsdk.sharding import OWNER_SALT, bucketize_by_owner, owner

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_every_id_has_exactly_one_owner_in_range(world_size: int) -> None:
    ids = torch.cat([torch.randint(INT64_MIN, INT64_MAX, (10_000,)), torch.tensor([INT64_MIN, INT64_MAX, 0, -1])])
    owners = owner(ids, world_size)
    assert owners.dtype == torch.int64 and owners.shape == ids.shape
    assert int(owners.min()) >= 0 and int(owners.max()) < world_size
    # A function of the id alone: the same id always lands on the same rank.
    assert torch.equal(owner(ids.flip(0), world_size).flip(0), owners)
    assert torch.equal(owner(ids.to(torch.int32), world_size), owner(ids.to(torch.int32).to(torch.int64), world_size))


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
def test_owner_is_the_documented_function(world_size: int) -> None:
    # Checkpoints reshard by owner: its values may never change (the power-of-two fast path included).
    ids = [INT64_MIN, INT64_MAX, 0, -1, 1, 12345, -(10**15), 2**40 + 7]
    expected = [(fmix64_reference(i, OWNER_SALT) & (2**63 - 1)) % world_size for i in ids]
    assert owner(torch.tensor(ids), world_size).tolist() == expected


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["sequential", "multiples", "time_ordered"])
def test_structured_ids_balance_within_5_percent(world_size: int, kind: str) -> None:
    n = 200_000
    base = torch.arange(n, dtype=torch.int64)
    ids = {
        "sequential": base,
        "multiples": base * world_size,
        "time_ordered": 1_700_000_000_000 + base * 1000,
    }[kind]
    counts = torch.bincount(owner(ids, world_size), minlength=world_size).double()
    mean = n / world_size
    assert float((counts - mean).abs().max() / mean) < 0.05, counts.tolist()


def test_owner_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        owner(torch.tensor([1]), 0)
    with pytest.raises(TypeError, match="float"):
        owner(torch.tensor([1.0]), 2)


def test_bucketize_keeps_torchrec_row_wise_layout() -> None:
    # 2 features, batch of 3; bag order [f0: s0 s1 s2][f1: s0 s1 s2].
    lengths = torch.tensor([2, 0, 3, 1, 2, 1])
    values = torch.tensor([11, -5, 7, 2**40, 13, 99, 4, 8, -(2**62)])
    weights = torch.arange(9, dtype=torch.float32)
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths, weights=weights)
    world_size = 3
    out = bucketize_by_owner(kjt, world_size)
    assert out.keys() == ["f0", "f1"] * world_size
    assert out.lengths().numel() == world_size * 6

    # Reference: walk bags in order, append each id to its owner's bucket.
    owners = owner(values, world_size).tolist()
    expected_lengths = [[0] * 6 for _ in range(world_size)]
    expected_values: list[list[int]] = [[] for _ in range(world_size)]
    expected_weights: list[list[float]] = [[] for _ in range(world_size)]
    pos = 0
    for bag, n in enumerate(lengths.tolist()):
        for _ in range(n):
            r = owners[pos]
            expected_lengths[r][bag] += 1
            expected_values[r].append(int(values[pos]))
            expected_weights[r].append(float(weights[pos]))
            pos += 1
    assert out.lengths().tolist() == [x for bucket in expected_lengths for x in bucket]
    assert out.values().tolist() == [x for bucket in expected_values for x in bucket]
    assert out.weights().tolist() == [x for bucket in expected_weights for x in bucket]
