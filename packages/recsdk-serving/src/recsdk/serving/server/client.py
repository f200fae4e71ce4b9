"""The Python client of the server: ``score(url, sparse, dense)`` and ``ServingClient``.

Only the standard library's ``http.client`` and the codec: no Ray on the client's side.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.serving.server.codec import decode_scores, encode_request

__all__ = ["Scores", "ServerError", "ServingClient", "score"]


class Scores(NamedTuple):
    """A server's answer: one score per sample (float32 ``[B]``) and the version that produced them."""

    scores: torch.Tensor
    version: int


class ServerError(RuntimeError):
    """The server refused a request (4xx) or failed it (5xx); ``status`` and its ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class ServingClient:
    """A connection to a server, kept open across requests.

    Args:
        url (str): the server, ``http://host:port``.
        binary (bool): send the binary form (default) or JSON.
        timeout_s (float): seconds to wait for an answer.

    Example::

        with ServingClient("http://127.0.0.1:8000") as client:
            scores, version = client.score(batch.sparse_features, batch.dense_features)
            client.health()["versions"]
    """

    def __init__(self, url: str, binary: bool = True, timeout_s: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"url must be 'http://host:port', got {url!r}")
        self.url = url
        self.binary = binary
        self._conn = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=timeout_s)

    def score(
        self,
        sparse: KeyedJaggedTensor | Mapping[str, Mapping[str, Any]],
        dense: torch.Tensor | Sequence[Sequence[float]],
    ) -> Scores:
        """Score a batch: raw int64 ids per feature (a KJT, with weights if any, or
        ``{feature: {"lengths", "values", "weights"}}``) and dense floats ``[B, D]``.

        Raises:
            ServerError: a 4xx (the message names the field) or 5xx answer.
        """
        body, content_type = encode_request(sparse, dense, self.binary)
        status, headers, answer = self.request("POST", "/score", body, content_type)
        if status != 200:
            raise ServerError(status, answer.decode(errors="replace"))
        return Scores(*decode_scores(answer, headers.get("content-type", "")))

    def health(self) -> dict[str, Any]:
        """``GET /health``: every replica's version, age, last error, requests, latency."""
        status, _, body = self.request("GET", "/health")
        if status != 200:
            raise ServerError(status, body.decode(errors="replace"))
        return json.loads(body)  # type: ignore[no-any-return]

    def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """One HTTP request on the kept connection: ``(status, headers (lower-case names), body)``."""
        headers = {} if content_type is None else {"Content-Type": content_type}
        for attempt in (0, 1):
            try:
                self._conn.request(method, path, body, headers)
                response = self._conn.getresponse()
                data = response.read()
                return response.status, {k.lower(): v for k, v in response.getheaders()}, data
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._conn.close()  # the server closed a kept connection: once more on a new one
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> ServingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def score(
    url: str,
    sparse: KeyedJaggedTensor | Mapping[str, Mapping[str, Any]],
    dense: torch.Tensor | Sequence[Sequence[float]],
    binary: bool = True,
    timeout_s: float = 30.0,
) -> Scores:
    """Score one batch on the server at ``url``: ``(scores [B], version)``.

    Args:
        url (str): ``http://host:port`` of ``python -m recsdk.serving serve``.
        sparse (KeyedJaggedTensor | Mapping): raw int64 ids per feature and sample (a KJT, with
            weights if any, or ``{feature: {"lengths": [...], "values": [...], "weights": [...]}}``).
        dense (torch.Tensor | Sequence): dense floats ``[B, D]``.
        binary (bool): the binary request form (default) or JSON.
        timeout_s (float): seconds to wait.

    Raises:
        ServerError: the server refused the request (4xx, the message names the field) or failed.

    Example::

        scores, version = score("http://127.0.0.1:8000", batch.sparse_features, batch.dense_features)
    """
    with ServingClient(url, binary, timeout_s) as client:
        return client.score(sparse, dense)
