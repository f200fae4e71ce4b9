"""Several decoded requests as one batch, and the one batch's scores back to each request.

Ray Serve's ``@serve.batch`` hands the deployment the requests that arrived while the model was
busy; :func:`merge_requests` lays them end to end (per feature, request after request, as a KJT
keyed in the model's feature order wants them) so that one forward scores them all, and
:func:`split_scores` cuts that forward's scores back into one tensor per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.serving.server.codec import DecodedRequest

__all__ = ["merge_requests", "split_scores"]


def merge_requests(requests: Sequence[DecodedRequest]) -> DecodedRequest:
    """One request holding ``requests``' samples in order (the first request's samples first).

    Args:
        requests (Sequence[DecodedRequest]): decoded requests of one model (the same keys, in
            the same order); weights of 1 stand in for a request without weights when another
            has them.

    Returns:
        DecodedRequest: the samples of all, ``binary`` of the first.

    Example::

        merged = merge_requests([a, b])
        a_scores, b_scores = split_scores(predict(merged), [a, b])
    """
    if len(requests) == 1:
        return requests[0]
    keys = requests[0].sparse.keys()
    per_request = [r.sparse.length_per_key() for r in requests]
    values = [r.sparse.values().split(n) for r, n in zip(requests, per_request, strict=True)]
    lengths = [r.sparse.lengths().view(len(keys), -1) for r in requests]
    weighted = any(r.sparse.weights_or_none() is not None for r in requests)
    weights = None
    if weighted:
        per_weights = [_weights(r).split(n) for r, n in zip(requests, per_request, strict=True)]
        weights = torch.cat([w[f] for f in range(len(keys)) for w in per_weights])
    sparse = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([v[f] for f in range(len(keys)) for v in values]),
        lengths=torch.cat(lengths, dim=1).reshape(-1),
        weights=weights,
        stride=sum(r.batch_size for r in requests),
    )
    return DecodedRequest(sparse, torch.cat([r.dense for r in requests]), requests[0].binary)


def split_scores(scores: torch.Tensor, requests: Sequence[DecodedRequest]) -> list[torch.Tensor]:
    """``scores`` of :func:`merge_requests`' batch, cut into each request's ``[B_i]``."""
    return list(scores.reshape(-1).split([r.batch_size for r in requests]))


def _weights(request: DecodedRequest) -> torch.Tensor:
    weights = request.sparse.weights_or_none()
    return torch.ones(request.sparse.values().numel()) if weights is None else weights
