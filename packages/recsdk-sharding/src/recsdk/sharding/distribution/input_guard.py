"""``guard_input``: check a sharded hash module's input before its id all-to-alls.

A rank whose batch is bad must still join the id all-to-alls, or its peers wait there until the
process-group timeout. So the input dist checks the batch as the unsharded module does
(:func:`~recsdk.embedding.check_features`), and for a bad one sends an empty batch in its place;
the error is raised at the host stage's failure agreement, on every rank. A variable batch per
feature (VBE) is refused the same way (the host input dists bucket and map one batch size).

A good batch is put in the module's feature order, so any key order works, and in the dtypes
every rank sends (the id all-to-all packs each rank's tensors by their dtype): int64 ids,
float32 weights, and no weights for an unweighted module (which ignores them, as unsharded),
unless one of its tables scores clicks: those travel as the weights (zeros where an evaluation
batch has none), and a training batch without them is refused, as unsharded.

A caller may also refuse a batch itself (:func:`refuse_inputs`): a pipeline whose data iterator
raised sends a stand-in through the input dists that way, so the failure travels with the
batch's ids and is raised at the same agreement, on every rank.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.embedding import check_features
from recsdk.embedding.hash_tables import check_click_input

__all__ = ["guard_input", "refuse_inputs"]

_REFUSAL = threading.local()  # .error: the error refuse_inputs() gives the calls in this thread


@contextlib.contextmanager
def refuse_inputs(error: Exception | None) -> Iterator[None]:
    """Within (this thread): every sharded hash module's input check refuses its batch with ``error``
    (``None``: changes nothing).

    The module sends an empty stand-in in its place, flagged bad in its id all-to-all (no rank
    maps that batch), and its host-stage agreement raises ``error`` on this rank and
    :class:`~recsdk.sharding.PeerFailureError` naming this rank on the others, once the batch's
    output dist is waited for. Every rank still makes the batch's calls, so none waits for a
    collective this rank skipped.

    Args:
        error (Exception | None): what to raise (on this rank, as it is); ``None``: no new refusal.

    Example::

        with refuse_inputs(read_error):  # the iterator raised: send a stand-in for the batch
            pipeline_start_input_dist(previous_batch)
    """
    if error is None:
        yield
        return
    previous = getattr(_REFUSAL, "error", None)
    _REFUSAL.error = error
    try:
        yield
    finally:
        _REFUSAL.error = previous


def guard_input(
    features: Any,
    feature_names: Sequence[str],
    *,
    module: str,
    is_weighted: bool,
    click_tables: Sequence[str] = (),
    training: bool = False,
) -> tuple[KeyedJaggedTensor, Exception | None]:
    """The batch to send (in ``feature_names`` order), and what was wrong with it, if anything.

    Args:
        features (Any): what the module's input dist received.
        feature_names (Sequence[str]): the module's features, in the order to send them.
        module (str): the module's name for the messages.
        is_weighted (bool): whether per-value weights are required.
        click_tables (Sequence[str]): the module's tables that score clicks (they come as the
            weights; see :func:`~recsdk.embedding.hash_tables.click_tables`).
        training (bool): a training batch (it must bring the clicks).

    Returns:
        tuple[KeyedJaggedTensor, Exception | None]: the checked batch and ``None``, or an empty
        stand-in and the ``TypeError``/``ValueError`` to raise at the agreement (within
        :func:`refuse_inputs`: the stand-in and its error, whatever the batch).

    Example::

        kjt, ctx.input_error = guard_input(kjt, ["f0", "f1"], module="HashEmbeddingBagCollection",
                                           is_weighted=False)
    """
    carried = is_weighted or bool(click_tables)  # whether weights travel with the ids
    refused: Exception | None = getattr(_REFUSAL, "error", None)
    if refused is not None:
        return _stand_in(feature_names, features, carried), refused
    try:
        kjt = check_features(features, feature_names, module=module, is_weighted=is_weighted)
        if training and click_tables:
            check_click_input(kjt, click_tables, module=module)
        if kjt.variable_stride_per_key():
            raise ValueError(
                f"sharded {module}: the KJT of features {kjt.keys()} has a variable batch per feature "
                "(stride_per_key_per_rank), which its host input dists do not take; give every feature "
                "the batch's samples (empty bags where a feature has none)"
            )
    except (TypeError, ValueError) as e:
        return _stand_in(feature_names, features, carried), e
    if kjt.keys() != list(feature_names):
        kjt = kjt.permute([kjt.keys().index(f) for f in feature_names])
    return _in_sent_dtypes(kjt, carried), None


def _in_sent_dtypes(kjt: KeyedJaggedTensor, weighted: bool) -> KeyedJaggedTensor:
    """``kjt`` with int64 ids, float32 weights where weighted (zeros where it has none) and none
    otherwise (no copy when it already is)."""
    values, weights = kjt.values(), kjt.weights_or_none()
    if weighted and weights is None:
        weights = torch.zeros(values.numel(), dtype=torch.float32)
    elif values.dtype == torch.int64 and (weights is None or (weighted and weights.dtype == torch.float32)):
        return kjt
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=values.to(torch.int64),
        weights=weights.to(torch.float32) if weighted and weights is not None else None,
        lengths=kjt.lengths(),
        stride=kjt.stride(),
    )


def _stand_in(features: Sequence[str], received: Any, weighted: bool) -> KeyedJaggedTensor:
    """A batch with no ids, in the dtypes every rank sends, as many samples as ``received`` has
    where that can be told (none otherwise)."""
    stride = 0
    if isinstance(received, KeyedJaggedTensor) and not received.variable_stride_per_key():
        try:
            stride = received.stride()
        except Exception:  # a malformed KJT: send no samples
            stride = 0
    return KeyedJaggedTensor(
        keys=list(features),
        values=torch.empty(0, dtype=torch.int64),
        weights=torch.empty(0, dtype=torch.float32) if weighted else None,
        lengths=torch.zeros(len(features) * stride, dtype=torch.int32),
        stride=stride,
    )
