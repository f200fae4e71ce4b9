"""The checks every hash module makes of its input KJT, with one wording everywhere.

The unsharded and the sharded hash modules run the same checks, so a batch the one rejects the
other rejects with the same message, naming the module, the features and what is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["check_features"]


def check_features(
    features: object, feature_names: Sequence[str], *, module: str, is_weighted: bool
) -> KeyedJaggedTensor:
    """Check a hash module's input; return it typed as a KJT.

    Args:
        features (object): what ``forward`` (or ``input_dist``) received.
        feature_names (Sequence[str]): the configured features; the KJT's keys must be exactly
            these, once each, in any order.
        module (str): the module's name for the messages, e.g. ``"HashEmbeddingBagCollection"``.
        is_weighted (bool): whether per-value weights are required (an unweighted module
            ignores weights, so they are checked only when required).

    Returns:
        KeyedJaggedTensor: ``features``.

    Raises:
        TypeError: not a KJT, ids that are not int64/int32, or weights that are not floating point.
        ValueError: unknown, missing or repeated keys, ids that are not 1-D or hold no data
            (the meta device), missing weights or weights not one per id, lengths that are not
            one per feature and sample, negative lengths, or lengths whose sum differs from the
            number of ids.

    Example::

        kjt = check_features(kjt, ["user", "item"], module="HashEmbeddingBagCollection", is_weighted=False)
    """
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"{module}.forward expects a KeyedJaggedTensor, got {type(features).__name__}")
    keys = features.keys()
    unknown = [k for k in keys if k not in feature_names]
    missing = [k for k in feature_names if k not in keys]
    if unknown or missing:
        raise ValueError(
            f"{module}: KJT keys {keys} differ from the configured features "
            f"{list(feature_names)}: unknown {unknown}, missing {missing}"
        )
    if len(keys) != len(set(keys)):
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"{module}: KJT keys {keys} repeat {repeated}; each feature must appear once")
    values = features.values()
    if values.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{module}: ids of features {keys} must be int64 or int32, got {values.dtype}")
    if values.dim() != 1:
        raise ValueError(f"{module}: ids of features {keys} must be 1-D, got shape {list(values.shape)}")
    if values.device.type == "meta":
        raise ValueError(f"{module}: ids of features {keys} are on the meta device (no data); pass real tensors")
    if is_weighted:
        _check_weights(features.weights_or_none(), values.numel(), keys, module)
    lengths = features.lengths()
    if not features.variable_stride_per_key() and lengths.numel() != len(keys) * features.stride():
        raise ValueError(
            f"{module}: the KJT of features {keys} has {lengths.numel()} lengths for {len(keys)} features x "
            f"stride {features.stride()}; it needs one length per feature and sample "
            f"({len(keys) * features.stride()})"
        )
    if lengths.numel() > 0:
        shortest = int(lengths.min())  # one reduction (a comparison mask and any() cost 4x more)
        if shortest < 0:
            raise ValueError(
                f"{module}: negative lengths in features {_negative(features)} of the KJT of features {keys}; "
                "lengths must be >= 0"
            )
        total = int(lengths.sum())
        if total != values.numel():
            per_key = ", ".join(f"{k}: {n}" for k, n in zip(keys, features.length_per_key(), strict=True))
            raise ValueError(
                f"{module}: the lengths of features {keys} sum to {total} but the KJT has {values.numel()} ids "
                f"(lengths per feature {per_key})"
            )
    elif values.numel() != 0:
        raise ValueError(f"{module}: the KJT of features {keys} has {values.numel()} ids and no lengths")
    return features


def _negative(features: KeyedJaggedTensor) -> str:
    """Each feature with a negative length, its first such sample and that length (an error's words)."""
    parts = []
    for key, lengths in zip(features.keys(), features.lengths().split(features.stride_per_key()), strict=True):
        negative = (lengths < 0).nonzero().view(-1)
        if negative.numel():
            sample = int(negative[0])
            parts.append(f"{key} (sample {sample}: {int(lengths[sample])})")
    return ", ".join(parts)


def _check_weights(weights: torch.Tensor | None, num_ids: int, keys: list[str], module: str) -> None:
    if weights is None:
        raise ValueError(f"{module} is weighted but the KJT of features {keys} has no weights")
    if not weights.dtype.is_floating_point:
        raise TypeError(f"{module}: weights of features {keys} must be floating point, got {weights.dtype}")
    if weights.dim() != 1 or weights.numel() != num_ids:
        raise ValueError(
            f"{module}: the KJT of features {keys} has weights of shape {list(weights.shape)}; "
            f"it needs one weight per id ({num_ids})"
        )
