"""``Replica``: one server replica's model, following the versions under ROOT, and its state.

The replica is the engine-independent part of a server replica: a
:class:`~recsdk.serving.ServingModel` built from the :class:`ModelSpec`, a thread polling ROOT
every ``poll_s`` seconds, the answer to a request body, and what health and metrics report.
It never serves a half-applied version (a forward holds the ServingModel's read lock; a version
is committed under its write lock), and a version that cannot be applied (damaged, missing, of
another model) is recorded in :attr:`Replica.last_error` while the last good one is served.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from recsdk.serving.server.codec import DecodedRequest, RequestError, decode_request, encode_scores
from recsdk.serving.server.merge import merge_requests, split_scores
from recsdk.serving.server.model_spec import ModelSpec
from recsdk.serving.serving_model import ServingModel

__all__ = ["Answer", "Replica"]

_LATENCY_WINDOW = 2048  # the latency quantiles are over this many latest requests


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status, body, content type, the version that scored it (None when
    refused), the samples scored and the time in the replica (ms)."""

    status: int
    body: bytes
    content_type: str
    version: int | None
    batch_size: int = 0
    latency_ms: float = 0.0


class Replica:
    """One replica: the spec's model served from ``root``, polled for new versions.

    Args:
        spec (ModelSpec): the model and how requests reach it.
        root (str | os.PathLike): the publisher's root.
        poll_s (float): seconds between looks for new versions (a complete version is served
            within ``poll_s`` plus the time to read and apply it).
        on_poll (Callable | None): called with the replica after every poll (metrics).

    Example::

        replica = Replica(factory(), "publish/", poll_s=1.0)
        answer = replica.answer(body, "application/json")  # or decode, then score several at once
        replica.health()["version"]
    """

    def __init__(
        self,
        spec: ModelSpec,
        root: str | os.PathLike[str],
        poll_s: float = 1.0,
        on_poll: Callable[[Replica], None] | None = None,
    ) -> None:
        if isinstance(poll_s, bool) or not isinstance(poll_s, int | float) or poll_s <= 0:
            raise ValueError(f"poll_s must be a number > 0, got {poll_s!r}")
        self.spec = spec
        self.root = os.fspath(root)
        self.poll_s = float(poll_s)
        self._on_poll = on_poll
        self.serving: ServingModel | None = None
        self.last_error: str | None = None
        """Why the latest poll failed (a damaged, missing or foreign version), None after a good one."""
        self.requests = 0
        self.refused = 0
        self.errors = 0
        self.applied_at = 0.0
        self._latencies_ms: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self._stop = threading.Event()
        self._poll()
        self._thread = threading.Thread(target=self._loop, name="recsdk-serving-poll", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """Whether a version is loaded."""
        return self.serving is not None

    def answer(self, body: bytes, content_type: str) -> Answer:
        """Score a request body; a bad request gets its 4xx and message, and changes nothing."""
        start = time.perf_counter()
        request = self.decode(body, content_type)
        if isinstance(request, Answer):
            return request
        return self.score([request], [start])[0]

    def decode(self, body: bytes, content_type: str) -> DecodedRequest | Answer:
        """A request body checked and decoded, or the refusal's :class:`Answer` (4xx, 503)."""
        self.requests += 1
        if self.serving is None:
            return _text(503, f"no version loaded from {self.root!r} yet: {self.last_error}")
        try:
            return decode_request(body, content_type, self.spec.features, self.spec.dense_width, self.spec.max_batch)
        except RequestError as e:
            self.refused += 1
            return _text(e.status, str(e))

    def score(self, requests: Sequence[DecodedRequest], starts: Sequence[float]) -> list[Answer]:
        """Score decoded requests in one forward, on one version; one :class:`Answer` each.

        Args:
            requests (Sequence[DecodedRequest]): requests of :meth:`decode`.
            starts (Sequence[float]): when each arrived (``time.perf_counter()``), for its latency.

        A forward that fails for several requests is run again for each alone, so that each
        gets its own answer (a refused request cannot fail the others).
        """
        serving = self.serving
        assert serving is not None  # decode answered 503 before
        merged = merge_requests(requests)
        try:
            version, scores = self._score(serving, merged.sparse, merged.dense)
        except Exception as e:
            if len(requests) > 1:
                return [self.score([r], [t])[0] for r, t in zip(requests, starts, strict=True)]
            if isinstance(e, ValueError | TypeError):  # the serving collections' checks: the request's fault
                self.refused += 1
                return [_text(400, f"sparse: {e}")]
            self.errors += 1
            return [_text(500, f"{type(e).__name__}: {e}")]
        if scores.numel() != merged.batch_size:
            self.errors += len(requests)
            message = f"the model's predict gave {scores.numel()} scores for {merged.batch_size} samples"
            return [_text(500, message) for _ in requests]
        answers = []
        for request, start, part in zip(requests, starts, split_scores(scores, requests), strict=True):
            body, kind = encode_scores(part, version, request.binary)
            latency_ms = (time.perf_counter() - start) * 1e3
            self._latencies_ms.append(latency_ms)
            answers.append(Answer(200, body, kind, version, request.batch_size, latency_ms))
        return answers

    def health(self) -> dict[str, Any]:
        """This replica's state: ready, the version served, its step and age, the last error."""
        serving = self.serving
        version = None if serving is None else serving.version
        return {
            "ready": serving is not None,
            "version": version,
            "step": None if serving is None else serving.step,
            "version_age_s": None if version is None else round(self.version_age_s(), 3),
            "last_error": self.last_error,
            "requests": self.requests,
            "refused": self.refused,
            "errors": self.errors,
            "latency_ms": self.latency_quantiles(),
        }

    def version_age_s(self) -> float:
        """Seconds since the version served was published (its manifest's modification time)."""
        if self.serving is None:
            return 0.0
        manifest = os.path.join(self.root, f"{self.serving.version:08d}", "manifest.json")
        try:
            return max(0.0, time.time() - os.stat(manifest).st_mtime)
        except OSError:  # removed since (the publisher keeps a few): time since it was applied
            return max(0.0, time.time() - self.applied_at)

    def latency_quantiles(self) -> dict[str, float]:
        """p50, p90 and p99 of the latest requests' time in the replica, in ms."""
        window = sorted(self._latencies_ms)
        if not window:
            return {}
        return {f"p{q}": round(window[min(len(window) - 1, len(window) * q // 100)], 3) for q in (50, 90, 99)}

    @property
    def polling(self) -> bool:
        """Whether the poll thread runs."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()
        self._thread.join()

    # ------------------------------------------------------------------ internals

    def _score(self, serving: ServingModel, sparse: Any, dense: torch.Tensor) -> tuple[int, torch.Tensor]:
        # One version through the forward: the version named is the one that scored.
        return serving.on_one_version(self.spec.predict, sparse, dense)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()

    def _poll(self) -> None:
        try:
            if self.serving is None:
                self.serving = ServingModel(self.spec.model, self.root)
                self.applied_at = time.time()
            elif self.serving.refresh() > 0:
                self.applied_at = time.time()
            self.last_error = None
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
        if self._on_poll is not None:
            self._on_poll(self)


def _text(status: int, message: str) -> Answer:
    return Answer(status, message.encode(), "text/plain; charset=utf-8", None)
