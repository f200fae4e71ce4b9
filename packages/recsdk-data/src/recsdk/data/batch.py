"""The training batch: dense features, raw-id sparse features and labels."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

__all__ = ["Batch", "attach_clicks"]


@functools.lru_cache(maxsize=1)
def _can_pin_memory() -> bool:
    # Pinned (page-locked) memory needs an accelerator runtime; a CPU-only build raises.
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return True
    return bool(torch.cuda.is_available())


def attach_clicks(features: KeyedJaggedTensor, labels: torch.Tensor) -> KeyedJaggedTensor:
    """``features`` with each id's clicks as its weight: the label of the id's sample.

    How a batch's clicks reach tables whose admission or eviction scores shows and clicks
    (``recsdk.embedding.ShowClickScore``): the weights travel with the ids through the id
    all-to-all and the host stage, and the tables read them there. The collections that read
    them must be unweighted (they ignore weights otherwise).

    Args:
        features (KeyedJaggedTensor): raw ids, one stride ``B`` for every key, no weights.
        labels (torch.Tensor): ``[B]`` labels (clicks per sample, >= 0).

    Returns:
        KeyedJaggedTensor: the same ids and lengths, float32 weights ``labels[sample of each id]``.

    Raises:
        ValueError: ``features`` already has weights, or its stride is not the number of labels.

    Example::

        kjt = attach_clicks(batch.sparse_features, batch.labels)
    """
    if features.weights_or_none() is not None:
        raise ValueError(
            f"attach_clicks: the KJT of features {features.keys()} already has weights (weighted features); "
            "clicks travel as the weights, so they need a KJT without"
        )
    stride = features.stride()
    if labels.dim() != 1 or labels.shape[0] != stride:
        raise ValueError(
            f"attach_clicks: {list(labels.shape)} labels for a KJT of stride {stride}; give one per sample"
        )
    values, lengths = features.values(), features.lengths()
    sample = torch.arange(stride, device=lengths.device).repeat(len(features.keys()))
    of_id = torch.repeat_interleave(sample, lengths.long(), output_size=values.numel())
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=values,
        weights=labels.to(torch.float32).index_select(0, of_id.to(labels.device)),
        lengths=lengths,
        stride=stride,
    )


@dataclass
class Batch(Pipelineable):
    """One training batch, as TorchRec's train pipelines move it.

    ``sparse_features`` holds **raw** int64 feature ids (any value in the int64 range),
    never remapped rows; the sparse modules map them to rows.

    Args:
        dense_features (torch.Tensor): float32, shape ``[B, D]`` (``D`` may be 0).
        sparse_features (KeyedJaggedTensor): int64 raw ids, stride ``B``; optional
            floating-point per-id weights.
        labels (torch.Tensor): float32, shape ``[B]``.

    Raises:
        TypeError: a field is not a tensor / KJT.
        ValueError: a shape, dtype or batch size disagrees; the message names the field
            and both sizes.

    Example::

        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["user", "item"],
            values=torch.tensor([-7, 123456789012, 42]),
            lengths=torch.tensor([1, 0, 1, 1], dtype=torch.int32),
        )
        batch = Batch(torch.zeros(2, 13), kjt, torch.tensor([0.0, 1.0]))
        batch = batch.to(device, non_blocking=True)
    """

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        dense, sparse, labels = self.dense_features, self.sparse_features, self.labels
        if not isinstance(dense, torch.Tensor):
            raise TypeError(f"Batch.dense_features must be a torch.Tensor, got {type(dense).__name__}")
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"Batch.labels must be a torch.Tensor, got {type(labels).__name__}")
        if not isinstance(sparse, KeyedJaggedTensor):
            raise TypeError(f"Batch.sparse_features must be a KeyedJaggedTensor, got {type(sparse).__name__}")
        if dense.dim() != 2:
            raise ValueError(f"Batch.dense_features must have shape [B, D], got shape {list(dense.shape)}")
        if dense.dtype != torch.float32:
            raise ValueError(f"Batch.dense_features must be float32, got {dense.dtype}")
        if labels.dim() != 1:
            raise ValueError(f"Batch.labels must have shape [B], got shape {list(labels.shape)}")
        if labels.dtype != torch.float32:
            raise ValueError(f"Batch.labels must be float32, got {labels.dtype}")
        batch_size = dense.shape[0]
        if labels.shape[0] != batch_size:
            raise ValueError(
                f"Batch.labels has {labels.shape[0]} rows but Batch.dense_features has {batch_size} (batch size)"
            )
        values = sparse.values()
        if values.dtype != torch.int64:
            raise ValueError(f"Batch.sparse_features values must be int64 raw ids, got {values.dtype}")
        weights = sparse.weights_or_none()
        if weights is not None and not weights.is_floating_point():
            raise ValueError(f"Batch.sparse_features weights must be floating point, got {weights.dtype}")
        if sparse.variable_stride_per_key():
            raise ValueError("Batch.sparse_features must have one stride for all keys, got a variable-stride KJT")
        stride = sparse.stride()
        if stride != batch_size:
            raise ValueError(
                f"Batch.sparse_features has stride {stride} but Batch.dense_features has {batch_size} rows (batch size)"
            )
        num_keys = len(sparse.keys())
        num_lengths = sparse.lengths().numel()
        if num_lengths != num_keys * batch_size:
            raise ValueError(
                f"Batch.sparse_features has {num_lengths} lengths, expected {num_keys} keys x {batch_size} rows "
                f"= {num_keys * batch_size}"
            )

    def with_clicks(self) -> Batch:
        """This batch with each sparse id's clicks (its sample's label) as its weight (:func:`attach_clicks`).

        For models whose tables score shows and clicks: the one change to the training flow is
        building batches with this (the model's ``forward(batch)`` is unchanged). A subclass's
        other fields are kept.

        Returns:
            Batch: a batch of the same type, ``sparse_features`` with click weights.
        """
        return dataclasses.replace(self, sparse_features=attach_clicks(self.sparse_features, self.labels))

    @property
    def batch_size(self) -> int:
        """Number of samples ``B``."""
        return int(self.dense_features.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy on ``device``, or ``self`` if all tensors are already there.

        "There" is an exact match: a batch on ``cuda:0`` asked for ``"cuda"`` is copied (to the same tensors).

        Args:
            device (torch.device | str): the target device.
            non_blocking (bool): asynchronous copy where the source is pinned (irrelevant when nothing moves).

        Returns:
            Batch: the batch on ``device``.
        """
        device = torch.device(device)
        if (
            self.dense_features.device == device
            and self.labels.device == device
            and self.sparse_features.device() == device
        ):
            return self
        return Batch(
            dense_features=self.dense_features.to(device=device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """A copy in pinned host memory, or ``self`` where no accelerator is available.

        A CPU-only torch build cannot pin memory (``Tensor.pin_memory`` raises), and
        pinning would not help there, so this is a no-op on such machines.
        """
        if not _can_pin_memory() or self.dense_features.device.type != "cpu":
            return self
        return Batch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
        )

    def record_stream(self, stream: Any) -> None:
        """Mark every tensor as used by ``stream`` (a no-op for CPU tensors or ``stream=None``)."""
        if stream is None or self.dense_features.device.type == "cpu":
            return
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)
