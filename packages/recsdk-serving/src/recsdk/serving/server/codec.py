"""The server's requests and answers: JSON and one binary form, encoded and checked.

A request is a batch of samples: for each sparse feature of the served model, raw int64 ids per
sample as jagged ``lengths`` (one per sample) and ``values`` (the ids, sample after sample),
optional per-id ``weights``; and ``dense`` floats, one row of the model's dense width per sample.

**JSON** (``Content-Type: application/json``)::

    {"dense": [[0.1, 0.2], [0.3, 0.4]],
     "sparse": {"user": {"lengths": [1, 1], "values": [123, 456]},
                "tags": {"lengths": [2, 0], "values": [7, 9], "weights": [1.0, 0.5]}}}

**Binary** (``Content-Type: application/x-recsdk-batch``): a little-endian ``uint32`` header
length, the header (JSON: ``{"batch": B, "dense_width": D, "features": [{"name": ..., "ids":
N, "weighted": bool}, ...]}``), then per feature in the header's order ``int32`` lengths ``[B]``,
``int64`` ids ``[N]`` and, when weighted, ``float32`` weights ``[N]``; then ``float32`` dense
``[B, D]``. The arrays are read in place (``torch.frombuffer``), no per-id parsing.

The answer is JSON ``{"version": V, "scores": [...]}``, or for a binary request
``application/x-recsdk-scores``: ``int64`` version, then ``float32`` scores ``[B]``; its
``X-Recsdk-Version`` header names the version either way.

A malformed request raises :class:`RequestError` naming the field (``sparse.tags.values[3]``,
``dense``, ``body``...) before anything reaches the model. Lengths are checked against the ids
by :func:`recsdk.serving.batch_checks.check_batch`, the serving collections' own check.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.serving.batch_checks import check_batch

__all__ = [
    "BINARY_REQUEST",
    "BINARY_SCORES",
    "JSON",
    "DecodedRequest",
    "RequestError",
    "decode_request",
    "decode_scores",
    "encode_request",
    "encode_scores",
]

JSON = "application/json"
BINARY_REQUEST = "application/x-recsdk-batch"
BINARY_SCORES = "application/x-recsdk-scores"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_U32 = struct.Struct("<I")
_VERSION = struct.Struct("<q")


class RequestError(ValueError):
    """A request the server refuses (answered with ``status``, a 4xx, and the message).

    Args:
        field (str): what is wrong, as a path into the request (``sparse.user.lengths``).
        message (str): why, with the value and what is allowed.
        status (int): the HTTP status: 400 malformed, 413 too large, 415 unknown content type.
    """

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status


@dataclass(frozen=True)
class DecodedRequest:
    """A checked request, as the model takes it.

    Attributes:
        sparse (KeyedJaggedTensor): the ids, keys in the served model's feature order; int64
            values and lengths, float32 weights when the request had any.
        dense (torch.Tensor): float32 ``[B, dense_width]``.
        binary (bool): whether the request was binary (the answer is then binary too).
    """

    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    binary: bool

    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])


def decode_request(
    body: bytes, content_type: str, features: Sequence[str], dense_width: int, max_batch: int
) -> DecodedRequest:
    """Parse and check a request body.

    Args:
        body (bytes): the HTTP body.
        content_type (str): its ``Content-Type`` (parameters such as ``; charset=utf-8`` ignored).
        features (Sequence[str]): the served model's sparse features, in its KJT key order; a
            request names each exactly once, in any order.
        dense_width (int): the dense floats per sample.
        max_batch (int): the most samples a request may carry.

    Returns:
        DecodedRequest: the batch, checked.

    Raises:
        RequestError: the field named: an unknown content type (415), a body that is not what
            its type claims, an unknown or missing feature, a non-integer or out-of-range id,
            lengths not one per sample, negative or not adding up to the ids, weights not one
            per id, a wrong dense width, an empty batch, or a batch over ``max_batch`` (413).

    Example::

        req = decode_request(b'{"dense": [[0.5]], "sparse": {"user": {"lengths": [1], "values": [42]}}}',
                             "application/json", ["user"], 1, 1024)
        req.sparse.values()  # tensor([42])
    """
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind == JSON:
        parts, dense, batch = _parse_json(body, dense_width)
    elif kind == BINARY_REQUEST:
        parts, dense, batch = _parse_binary(body, dense_width)
    else:
        raise RequestError(
            "Content-Type", f"{content_type!r} is not served; send {JSON!r} or {BINARY_REQUEST!r}", status=415
        )
    if batch <= 0:
        raise RequestError("dense", "the batch has 0 samples; send at least one")
    if batch > max_batch:
        raise RequestError("dense", f"a batch of {batch} samples is over the limit of {max_batch}", status=413)
    unknown = sorted(set(parts) - set(features))
    if unknown:
        raise RequestError(f"sparse.{unknown[0]}", f"unknown feature; the model's features are {list(features)}")
    missing = [f for f in features if f not in parts]
    if missing:
        raise RequestError(f"sparse.{missing[0]}", "missing; give every feature (lengths of 0 for no ids)")
    for name in features:
        lengths = parts[name][0]
        if lengths.numel() != batch:
            raise RequestError(
                f"sparse.{name}.lengths", f"{lengths.numel()} lengths for a batch of {batch}; give one per sample"
            )
    weighted = [name for name in features if parts[name][2] is not None]
    if weighted and len(weighted) != len(features):
        # One KJT holds the ids: weights for some features mean weights of 1 for the others.
        for name in features:
            if parts[name][2] is None:
                lengths, values, _ = parts[name]
                parts[name] = (lengths, values, torch.ones(values.numel(), dtype=torch.float32))
    ordered = [parts[f] for f in features]
    lengths = torch.cat([p[0] for p in ordered])
    if lengths.dtype != torch.int64:
        lengths = lengths.long()
    if not _lengths_agree(lengths, ordered, batch):
        _name_the_bad_feature(parts, features)
    sparse = KeyedJaggedTensor(
        keys=list(features),
        values=torch.cat([p[1] for p in ordered]),
        lengths=lengths,
        weights=torch.cat([p[2] for p in ordered]) if weighted else None,  # type: ignore[misc]
        stride=batch,
    )
    return DecodedRequest(sparse, dense, kind == BINARY_REQUEST)


def _lengths_agree(lengths: torch.Tensor, parts: list[_Part], batch: int) -> bool:
    """Whether every feature's lengths are ``>= 0`` and add up to its ids (and weights): the
    common path, two reductions over all the lengths at once."""
    if lengths.numel() == 0:
        return True
    ids = torch.tensor([p[1].numel() for p in parts])
    if any(p[2] is not None and p[2].numel() != p[1].numel() for p in parts):
        return False
    return bool(lengths.min() >= 0) and torch.equal(lengths.view(len(parts), batch).sum(1), ids)


def _name_the_bad_feature(parts: dict[str, _Part], features: Sequence[str]) -> None:
    """Raise the :class:`RequestError` of the first feature ``check_batch`` refuses (one feature
    at a time, so that the message names it)."""
    for name in features:
        lengths, values, weights = parts[name]
        one = KeyedJaggedTensor(keys=[name], values=values, lengths=lengths, weights=weights)
        try:
            check_batch(one, [name], "request", weights is not None)
        except (ValueError, TypeError) as e:
            raise RequestError(f"sparse.{name}", str(e).removeprefix("request: ")) from None
    raise RequestError("sparse", "the lengths do not add up to the ids")


def encode_request(
    sparse: KeyedJaggedTensor | Mapping[str, Mapping[str, Any]],
    dense: torch.Tensor | Sequence[Sequence[float]],
    binary: bool = True,
) -> tuple[bytes, str]:
    """Encode a batch as a request body; returns ``(body, content_type)``.

    Args:
        sparse (KeyedJaggedTensor | Mapping): the ids: a KJT (with weights when weighted), or
            ``{feature: {"lengths": [...], "values": [...], "weights": [...]}}``.
        dense (torch.Tensor | Sequence): the dense floats ``[B, D]``.
        binary (bool): the binary form (True) or JSON.

    Example::

        body, content_type = encode_request(batch.sparse_features, batch.dense_features)
    """
    parts = _sparse_parts(sparse)
    dense_t = torch.as_tensor(dense, dtype=torch.float32)
    if dense_t.dim() != 2:
        raise ValueError(f"dense must be 2-D [batch, width], got shape {list(dense_t.shape)}")
    if not binary:
        doc = {
            "dense": dense_t.tolist(),
            "sparse": {
                name: {"lengths": lengths.tolist(), "values": values.tolist()}
                | ({} if weights is None else {"weights": weights.tolist()})
                for name, (lengths, values, weights) in parts.items()
            },
        }
        return json.dumps(doc).encode(), JSON
    header = {
        "batch": int(dense_t.shape[0]),
        "dense_width": int(dense_t.shape[1]),
        "features": [
            {"name": name, "ids": int(values.numel()), "weighted": weights is not None}
            for name, (_, values, weights) in parts.items()
        ],
    }
    head = json.dumps(header).encode()
    chunks = [_U32.pack(len(head)), head]
    for lengths, values, weights in parts.values():
        chunks.append(lengths.to(torch.int32).numpy().tobytes())
        chunks.append(values.to(torch.int64).numpy().tobytes())
        if weights is not None:
            chunks.append(weights.to(torch.float32).numpy().tobytes())
    chunks.append(dense_t.contiguous().numpy().tobytes())
    return b"".join(chunks), BINARY_REQUEST


def encode_scores(scores: torch.Tensor, version: int, binary: bool) -> tuple[bytes, str]:
    """The answer's body and content type: the scores ``[B]`` (float32) and the version."""
    flat = scores.detach().reshape(-1).to(torch.float32)
    if binary:
        return _VERSION.pack(version) + flat.numpy().tobytes(), BINARY_SCORES
    return json.dumps({"version": version, "scores": flat.tolist()}).encode(), JSON


def decode_scores(body: bytes, content_type: str) -> tuple[torch.Tensor, int]:
    """``(scores, version)`` from an answer of :func:`encode_scores`."""
    if content_type.split(";", 1)[0].strip().lower() == BINARY_SCORES:
        if len(body) < _VERSION.size or (len(body) - _VERSION.size) % 4:
            raise ValueError(f"a scores answer of {len(body)} bytes: not an int64 version and float32 scores")
        (version,) = _VERSION.unpack_from(body)
        buf = bytearray(body)
        n = (len(buf) - _VERSION.size) // 4
        return torch.frombuffer(buf, dtype=torch.float32, count=n, offset=_VERSION.size), int(version)
    doc = json.loads(body)
    return torch.tensor(doc["scores"], dtype=torch.float32), int(doc["version"])


# ---------------------------------------------------------------------------- parsing

_Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # lengths, values, weights


def _parse_json(body: bytes, dense_width: int) -> tuple[dict[str, _Part], torch.Tensor, int]:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError("body", f"not JSON, as its Content-Type claims: {e}") from None
    if not isinstance(doc, dict):
        raise RequestError("body", f"a JSON {type(doc).__name__}; send an object with 'dense' and 'sparse'")
    extra = sorted(set(doc) - {"dense", "sparse"})
    if extra:
        raise RequestError(extra[0], "unknown field; a request holds 'dense' and 'sparse'")
    rows = doc.get("dense")
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise RequestError("dense", "must be a list of rows of floats, one row per sample")
    for i, row in enumerate(rows):
        if len(row) != dense_width:
            raise RequestError(f"dense[{i}]", f"{len(row)} floats; the model takes {dense_width} per sample")
        for j, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, int | float):
                raise RequestError(f"dense[{i}][{j}]", f"{x!r} is not a number")
    dense = torch.tensor(rows, dtype=torch.float32).reshape(len(rows), dense_width)
    sparse = doc.get("sparse")
    if not isinstance(sparse, dict):
        raise RequestError("sparse", "must be an object: {feature: {'lengths': [...], 'values': [...]}}")
    parts: dict[str, _Part] = {}
    for name, feature in sparse.items():
        where = f"sparse.{name}"
        if not isinstance(feature, dict):
            raise RequestError(where, "must be an object with 'lengths', 'values' and optional 'weights'")
        extra = sorted(set(feature) - {"lengths", "values", "weights"})
        if extra:
            raise RequestError(f"{where}.{extra[0]}", "unknown field; a feature holds lengths, values, weights")
        lengths = torch.tensor(_integers(feature.get("lengths"), f"{where}.lengths", 0, 2**31 - 1))
        values = torch.tensor(_integers(feature.get("values"), f"{where}.values", _INT64_MIN, _INT64_MAX))
        weights = None
        if "weights" in feature:
            w = feature["weights"]
            if not isinstance(w, list):
                raise RequestError(f"{where}.weights", "must be a list of floats, one per id")
            for i, x in enumerate(w):
                if isinstance(x, bool) or not isinstance(x, int | float):
                    raise RequestError(f"{where}.weights[{i}]", f"{x!r} is not a number")
            weights = torch.tensor(w, dtype=torch.float32)
        parts[name] = (lengths.to(torch.int64), values.to(torch.int64), weights)
    return parts, dense, len(rows)


def _integers(xs: Any, where: str, low: int, high: int) -> list[int]:
    if not isinstance(xs, list):
        raise RequestError(where, f"must be a list of integers, got {type(xs).__name__}")
    for i, x in enumerate(xs):
        if isinstance(x, bool) or not isinstance(x, int):
            raise RequestError(f"{where}[{i}]", f"{x!r} is not an integer")
        if not low <= x <= high:
            raise RequestError(f"{where}[{i}]", f"{x} is out of range [{low}, {high}]")
    return xs


def _parse_binary(body: bytes, dense_width: int) -> tuple[dict[str, _Part], torch.Tensor, int]:
    if len(body) < _U32.size:
        raise RequestError("body", f"{len(body)} bytes: not a binary batch (no header length)")
    (head_len,) = _U32.unpack_from(body)
    if head_len > len(body) - _U32.size:
        raise RequestError("body", f"a header of {head_len} bytes announced in a body of {len(body)}")
    try:
        header = json.loads(body[_U32.size : _U32.size + head_len])
        batch, width = int(header["batch"]), int(header["dense_width"])
        specs = [(str(f["name"]), int(f["ids"]), bool(f.get("weighted", False))) for f in header["features"]]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise RequestError("body", f"not a binary batch, as its Content-Type claims: header {e!r}") from None
    if width != dense_width:
        raise RequestError("dense", f"{width} floats per sample; the model takes {dense_width}")
    if batch < 0 or any(n < 0 for _, n, _ in specs):
        raise RequestError("body", "a negative batch or id count in the header")
    names = [name for name, _, _ in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise RequestError(f"sparse.{repeated[0]}", "given twice; give each feature once")
    expected = _U32.size + head_len + sum(4 * batch + 8 * n + (4 * n if w else 0) for _, n, w in specs)
    expected += 4 * batch * width
    if len(body) != expected:
        raise RequestError("body", f"{len(body)} bytes, but its header announces {expected}")
    buf = bytearray(body)  # writable and owned: the tensors below view it, no copy per array
    offset = _U32.size + head_len
    parts: dict[str, _Part] = {}
    for name, n, weighted in specs:
        lengths = _view(buf, torch.int32, batch, offset)
        offset += 4 * batch
        values = _view(buf, torch.int64, n, offset)
        offset += 8 * n
        weights = None
        if weighted:
            weights = _view(buf, torch.float32, n, offset)
            offset += 4 * n
        parts[name] = (lengths, values, weights)
    dense = _view(buf, torch.float32, batch * width, offset)
    return parts, dense.reshape(batch, width), batch


def _view(buf: bytearray, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    """``count`` little-endian items of ``dtype`` at ``offset`` of ``buf``, viewed in place."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def _sparse_parts(sparse: KeyedJaggedTensor | Mapping[str, Mapping[str, Any]]) -> dict[str, _Part]:
    if isinstance(sparse, KeyedJaggedTensor):
        out: dict[str, _Part] = {}
        for name, jt in sparse.to_dict().items():
            w = jt.weights_or_none()
            out[name] = (jt.lengths().long(), jt.values().long(), None if w is None else w.float())
        return out
    if not isinstance(sparse, Mapping):
        raise TypeError(f"sparse must be a KeyedJaggedTensor or a mapping of features, got {type(sparse).__name__}")
    return {
        name: (
            torch.as_tensor(f["lengths"], dtype=torch.int64),
            torch.as_tensor(f["values"], dtype=torch.int64),
            None if f.get("weights") is None else torch.as_tensor(f["weights"], dtype=torch.float32),
        )
        for name, f in sparse.items()
    }
