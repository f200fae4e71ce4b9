import dataclasses

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from recsdk.data import Batch


def _kjt(weights: bool = False) -> KeyedJaggedTensor:
    # user: [-7], [] ; item: [2**62, 5], [-(2**63)]
    values = torch.tensor([-7, 2**62, 5, -(2**63)], dtype=torch.int64)
    return KeyedJaggedTensor(
        keys=["user", "item"],
        values=values,
        lengths=torch.tensor([1, 0, 2, 1], dtype=torch.int32),
        weights=torch.linspace(0.5, 2.0, values.numel()) if weights else None,
    )


def _batch(**overrides: object) -> Batch:
    fields: dict[str, object] = {
        "dense_features": torch.randn(2, 3),
        "sparse_features": _kjt(),
        "labels": torch.tensor([0.0, 1.0]),
    }
    fields.update(overrides)
    return Batch(**fields)  # type: ignore[arg-type]


def test_batch_is_a_pipelineable_dataclass_with_plain_fields() -> None:
    batch = _batch()
    assert isinstance(batch, Pipelineable)
    assert [f.name for f in dataclasses.fields(Batch)] == ["dense_features", "sparse_features", "labels"]
    assert batch.batch_size == 2
    # TorchRec's pipeline reads the KJT by plain attribute access.
    assert isinstance(batch.sparse_features, KeyedJaggedTensor)
    assert batch.sparse_features.values().tolist() == [-7, 2**62, 5, -(2**63)]


def test_to_moves_every_tensor_and_keeps_weights() -> None:
    batch = _batch(sparse_features=_kjt(weights=True))
    moved = batch.to(torch.device("meta"), non_blocking=True)
    assert isinstance(moved, Batch)
    assert moved.dense_features.device.type == "meta"
    assert moved.labels.device.type == "meta"
    assert moved.sparse_features.values().device.type == "meta"
    assert moved.sparse_features.weights().device.type == "meta"
    assert moved.sparse_features.keys() == ["user", "item"]
    back = batch.to("cpu")
    assert torch.equal(back.dense_features, batch.dense_features)
    assert torch.equal(back.sparse_features.weights(), batch.sparse_features.weights())
    assert back is batch  # already there: no new Batch
    assert batch.to(torch.device("cpu"), non_blocking=True) is batch


def test_pin_memory_and_record_stream_on_cpu() -> None:
    batch = _batch()
    pinned = batch.pin_memory()
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        assert pinned.dense_features.is_pinned() and pinned.sparse_features.values().is_pinned()
    else:
        assert pinned is batch  # a CPU-only build cannot pin; Tensor.pin_memory would raise
    # On CPU the stream is never touched: an object without record_stream support is fine.
    batch.record_stream(object())
    batch.record_stream(None)


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        ({"labels": torch.zeros(3)}, ValueError, r"labels has 3 rows but Batch.dense_features has 2"),
        (
            {"dense_features": torch.zeros(3, 4), "labels": torch.zeros(3)},
            ValueError,
            r"stride 2 but Batch.dense_features has 3 rows",
        ),
        ({"dense_features": torch.zeros(2, 3, dtype=torch.float64)}, ValueError, r"dense_features must be float32"),
        ({"dense_features": torch.zeros(2)}, ValueError, r"dense_features must have shape \[B, D\], got shape \[2\]"),
        ({"labels": torch.zeros(2, 1)}, ValueError, r"labels must have shape \[B\], got shape \[2, 1\]"),
        ({"labels": torch.zeros(2, dtype=torch.int64)}, ValueError, r"labels must be float32, got torch.int64"),
        ({"sparse_features": {"user": [1]}}, TypeError, r"sparse_features must be a KeyedJaggedTensor, got dict"),
        ({"dense_features": [[0.0]]}, TypeError, r"dense_features must be a torch.Tensor, got list"),
        (
            {
                "sparse_features": KeyedJaggedTensor(
                    keys=["user"], values=torch.tensor([1, 2], dtype=torch.int32), lengths=torch.tensor([1, 1])
                )
            },
            ValueError,
            r"values must be int64 raw ids, got torch.int32",
        ),
        (
            {
                "sparse_features": KeyedJaggedTensor(
                    keys=["user"],
                    values=torch.tensor([1, 2]),
                    lengths=torch.tensor([1, 1]),
                    weights=torch.tensor([1, 2]),
                )
            },
            ValueError,
            r"weights must be floating point",
        ),
        (
            {
                "sparse_features": KeyedJaggedTensor(
                    keys=["user"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1, 0]), stride=2
                )
            },
            ValueError,
            r"3 lengths, expected 1 keys x 2 rows = 2",
        ),
    ],
)
def test_construction_rejects_mismatches(overrides: dict[str, object], error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        _batch(**overrides)


def test_weighted_batch_validates_and_roundtrips() -> None:
    batch = _batch(sparse_features=_kjt(weights=True))
    assert batch.sparse_features.weights().dtype == torch.float32
    per_key = batch.sparse_features.to_dict()
    assert per_key["item"].values().tolist() == [2**62, 5, -(2**63)]
    assert per_key["item"].lengths().tolist() == [2, 1]
