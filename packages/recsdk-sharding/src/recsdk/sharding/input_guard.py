"""``guard_input``: check a sharded hash module's input before its id all-to-alls.

A rank whose batch is bad must still join the id all-to-alls, or its peers wait there until the
process-group timeout. So the input dist checks the batch as the unsharded module does
(:func:`~recsdk.embedding.check_features`), and for a bad one sends an empty batch of the same
width and dtypes in its place; the error is raised at the host stage's failure agreement, on
every rank. A good batch is put in the module's feature order, so any key order works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.embedding import check_features

__all__ = ["guard_input"]


def guard_input(
    features: Any, feature_names: Sequence[str], *, module: str, is_weighted: bool
) -> tuple[KeyedJaggedTensor, Exception | None]:
    """The batch to send (in ``feature_names`` order), and what was wrong with it, if anything.

    Args:
        features (Any): what the module's input dist received.
        feature_names (Sequence[str]): the module's features, in the order to send them.
        module (str): the module's name for the messages.
        is_weighted (bool): whether per-value weights are required.

    Returns:
        tuple[KeyedJaggedTensor, Exception | None]: the checked batch and ``None``, or an empty
        stand-in and the ``TypeError``/``ValueError`` to raise at the agreement.

    Example::

        kjt, ctx.input_error = guard_input(kjt, ["f0", "f1"], module="HashEmbeddingBagCollection",
                                           is_weighted=False)
    """
    try:
        kjt = check_features(features, feature_names, module=module, is_weighted=is_weighted)
    except (TypeError, ValueError) as e:
        return _stand_in(feature_names, features, is_weighted), e
    if kjt.keys() != list(feature_names):
        kjt = kjt.permute([kjt.keys().index(f) for f in feature_names])
    return kjt, None


def _stand_in(features: Sequence[str], received: Any, weighted: bool) -> KeyedJaggedTensor:
    """A batch with no ids, as wide as ``received`` and with its dtypes where it is a KJT (the
    peers' all-to-alls expect the sizes and dtypes they send), int64 otherwise."""
    kjt = received if isinstance(received, KeyedJaggedTensor) else None
    stride = kjt.stride() if kjt is not None else 0
    values_dtype = kjt.values().dtype if kjt is not None and not kjt.values().is_floating_point() else torch.int64
    weights = kjt.weights_or_none() if kjt is not None else None
    return KeyedJaggedTensor(
        keys=list(features),
        values=torch.empty(0, dtype=values_dtype),
        weights=torch.empty(0, dtype=weights.dtype if weights is not None else torch.float32) if weighted else None,
        lengths=torch.zeros(len(features) * stride, dtype=kjt.lengths().dtype if kjt is not None else torch.int64),
        stride=stride,
    )
