"""``check_batch``: what a serving collection checks of a batch before any FBGEMM kernel sees it.

FBGEMM's hash lookup and its inference kernel trust their offsets (the kernel runs without its
bounds check), so a batch whose lengths are negative or do not add up to its ids would read
out of bounds. Every forward of a serving collection therefore checks, in the input's key order:
the keys (the configured features, once each), the dtypes (int64/int32 ids and lengths,
floating-point weights one per id where weighted), one length per feature and sample, a batch
of at least one sample, lengths ``>= 0`` and adding up to the ids; and returns the offsets the
kernels read, computed from those checked lengths (never the KJT's own, which a caller may have
given inconsistent with them), and their total. An error names the features and the numbers.

The common path first tests the metadata (keys, dtypes, sizes: Python-level, no tensor op), then
runs what a forward needs anyway (the lengths' running sum, the offsets, and the read of their
total, which the forward hands on to :func:`~recsdk.serving.grouped_lookup.feature_bounds`)
and one reduction of its own: the lengths' minimum. Its cost is measured by
``benchmarks/serving.py``'s ``batch_check`` (figures in the serving README). The function runs
under ``torch.jit.script``.
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["check_batch"]


def check_batch(
    features: KeyedJaggedTensor, feature_names: list[str], module: str, is_weighted: bool
) -> tuple[torch.Tensor, int]:
    """Check a serving collection's input; return the offsets of its lengths (in its key order)
    and their total, the number of ids.

    The common path reads two numbers from the lengths: their minimum and their total (the last
    offset), which a forward hands on to :func:`~recsdk.serving.grouped_lookup.feature_bounds`
    instead of reading it again. Everything else is Python-level metadata (keys, dtypes, sizes),
    checked first.

    Args:
        features (KeyedJaggedTensor): the forward's input.
        feature_names (list[str]): the configured features; the keys must be exactly these, once
            each, in any order.
        module (str): the collection's name for the messages.
        is_weighted (bool): whether per-value weights are required.

    Returns:
        tuple[torch.Tensor, int]: int64 offsets ``[len(keys) * batch + 1]``, ``0`` first and the
        number of ids last; and that number of ids.

    Raises:
        TypeError: ids or lengths that are not int64/int32, weights that are not floating point.
        ValueError: unknown, missing or repeated keys; ids not 1-D; a variable batch per feature;
            an empty batch; lengths not one per feature and sample, negative, or not adding up
            to the number of ids; missing weights or weights not one per id.

    Example::

        offsets, num_ids = check_batch(kjt, ["user", "item"], "ServingEmbeddingBagCollection", False)
    """
    keys = features.keys()
    if keys != feature_names:
        _check_keys(keys, feature_names, module)
    values = features.values()
    lengths = features.lengths()
    variable_stride = features.variable_stride_per_key()
    batch = 0 if variable_stride else features.stride()
    num_ids = values.numel()
    # The metadata, in one test on the common path; _check_metadata says which check failed.
    if (
        values.dtype != torch.int64
        or lengths.dtype != torch.int64
        or values.dim() != 1
        or lengths.dim() != 1
        or batch <= 0
        or lengths.numel() != len(keys) * batch
    ):
        _check_metadata(values, lengths, batch, keys, module, variable_stride)
        lengths = lengths.long()
    if lengths.min().item() < 0:
        _raise_negative(lengths.view(len(keys), batch), keys, module)
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    total = int(offsets[-1].item())
    if total != num_ids:
        per_key = lengths.view(len(keys), batch).sum(1)
        parts: list[str] = []
        for i in range(len(keys)):
            parts.append(f"{keys[i]}: {int(per_key[i])}")
        raise ValueError(
            f"{module}: the lengths of features {keys} add up to {total} ({', '.join(parts)}) "
            f"but the KJT has {num_ids} ids"
        )
    if is_weighted:
        weights = features.weights_or_none()
        if weights is None:
            raise ValueError(f"{module} is weighted but the KJT of features {keys} has no weights")
        if not weights.is_floating_point():
            raise TypeError(f"{module}: weights of features {keys} must be floating point, got {weights.dtype}")
        if weights.dim() != 1 or weights.numel() != total:
            raise ValueError(
                f"{module}: the KJT of features {keys} has {weights.numel()} weights ({weights.dim()}-D); "
                f"it needs one per id ({total}, 1-D)"
            )
    return offsets, total


def _check_metadata(
    values: torch.Tensor, lengths: torch.Tensor, batch: int, keys: list[str], module: str, variable_stride: bool
) -> None:
    """Raise for the first metadata check the batch fails, in this order: the ids' dtype and
    dimensions, a variable batch per feature, the batch size, the lengths' dtype and count. Int32
    ids or lengths pass (the caller casts the lengths)."""
    if values.dtype != torch.int64 and values.dtype != torch.int32:
        raise TypeError(f"{module}: ids of features {keys} must be int64 or int32, got {values.dtype}")
    if values.dim() != 1:
        raise ValueError(f"{module}: ids of features {keys} must be 1-D, got {values.dim()}-D")
    if variable_stride:
        raise ValueError(
            f"{module}: the KJT of features {keys} has a variable batch per feature; "
            "give every feature the batch's samples (empty bags where a feature has none)"
        )
    if batch <= 0:
        raise ValueError(f"{module}: the KJT of features {keys} has a batch of {batch} samples; it must be > 0")
    if lengths.dtype != torch.int64 and lengths.dtype != torch.int32:
        raise TypeError(f"{module}: lengths of features {keys} must be int64 or int32, got {lengths.dtype}")
    if lengths.dim() != 1 or lengths.numel() != len(keys) * batch:
        raise ValueError(
            f"{module}: the KJT of features {keys} has {lengths.numel()} lengths for {len(keys)} features x "
            f"batch {batch}; it needs one length per feature and sample ({len(keys) * batch})"
        )


def _check_keys(keys: list[str], feature_names: list[str], module: str) -> None:
    unknown: list[str] = []
    for k in keys:
        if k not in feature_names:
            unknown.append(k)
    missing: list[str] = []
    for f in feature_names:
        if f not in keys:
            missing.append(f)
    if len(unknown) > 0 or len(missing) > 0:
        raise ValueError(
            f"{module}: KJT keys {keys} differ from the configured features {feature_names}: "
            f"unknown {unknown}, missing {missing}"
        )
    if len(keys) != len(feature_names):
        repeated: list[str] = []
        for i in range(len(keys)):
            if keys[i] in keys[:i] and keys[i] not in repeated:
                repeated.append(keys[i])
        raise ValueError(f"{module}: KJT keys {keys} repeat {repeated}; each feature must appear once")


def _raise_negative(lengths: torch.Tensor, keys: list[str], module: str) -> None:
    """Name every feature with a negative length: its first such sample and length."""
    parts: list[str] = []
    for i in range(len(keys)):
        negative = (lengths[i] < 0).nonzero().view(-1)
        if negative.numel() > 0:
            sample = int(negative[0])
            parts.append(f"{keys[i]} (sample {sample}: {int(lengths[i, sample])})")
    raise ValueError(f"{module}: negative lengths in features {', '.join(parts)}; lengths must be >= 0")
