"""The Ray Serve deployment: one :class:`Replica` per Ray Serve replica, and the health board.

Routes (any replica answers; with HAProxy in front, requests spread over the replicas):

- ``POST /score``: a request (JSON or binary, :mod:`recsdk.serving.server.codec`); the scores
  and the version that produced them (``X-Recsdk-Version``, ``X-Recsdk-Replica`` headers), or a
  4xx naming the field. With ``batching``, requests that arrive while the model is busy are
  scored together in one forward (Ray Serve's ``@serve.batch``, up to ``ModelSpec.max_batch``
  samples, no waiting: a lone request is scored at once), each answered with its own scores;
- ``GET /live``: 200 while the replica runs;
- ``GET /ready``: 200 once every replica serves a version, 503 before;
- ``GET /health``: JSON, every replica's state (version, step, age, last error, requests,
  latency quantiles) as the replicas last reported it to the health board (a Ray actor), and
  ``versions``: the versions served.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from typing import Any

from recsdk.serving.server.codec import DecodedRequest
from recsdk.serving.server.metrics import ReplicaMetrics
from recsdk.serving.server.model_spec import build_spec
from recsdk.serving.server.replica import Answer, Replica

__all__ = ["BOARD_NAME", "BOARD_NAMESPACE", "HealthBoard", "ServingDeployment"]

# Ray Serve (and starlette, its HTTP layer) are the server extra's: imported by name, so that
# only the server's modules need them.
ray = importlib.import_module("ray")
serve = importlib.import_module("ray.serve")
Response = importlib.import_module("starlette.responses").Response

BOARD_NAME = "recsdk-serving-health"
BOARD_NAMESPACE = "recsdk-serving"


@ray.remote(num_cpus=0)
class HealthBoard:
    """Every replica's latest state, as it reported it after its latest poll."""

    def __init__(self, replicas: int) -> None:
        self._replicas = replicas
        self._states: dict[str, dict[str, Any]] = {}

    def report(self, replica: str, state: dict[str, Any]) -> None:
        self._states[replica] = state | {"reported_at": time.time()}

    def snapshot(self) -> dict[str, Any]:
        states = dict(self._states)
        ready = len(states) >= self._replicas and all(s["ready"] for s in states.values())
        versions = sorted({s["version"] for s in states.values() if s["version"] is not None})
        return {"ready": ready, "replicas_expected": self._replicas, "versions": versions, "replicas": states}


def _samples(pending: list[tuple[DecodedRequest, float]]) -> int:
    """The samples of queued requests: what ``@serve.batch`` bounds by ``ModelSpec.max_batch``."""
    return sum(request.batch_size for request, _ in pending)


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=64,
    graceful_shutdown_wait_loop_s=0.2,
    graceful_shutdown_timeout_s=5.0,
)
class ServingDeployment:
    """A Ray Serve replica serving ``factory()``'s model from ``root``.

    Args:
        model (str): ``package.module:factory`` returning a :class:`ModelSpec`.
        root (str): the publisher's root.
        poll_s (float): seconds between looks for new versions.
        batching (bool): score concurrent requests in one forward (``@serve.batch``); off by default.

    Its torch intra-op threads are set where Ray starts the replica's process
    (:func:`~recsdk.serving.server.launch.serve`: ``OMP_NUM_THREADS`` in its runtime environment).
    """

    def __init__(self, model: str, root: str, poll_s: float, batching: bool = False) -> None:
        self._id = serve.get_replica_context().replica_id.unique_id
        self._board = ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
        self._metrics = ReplicaMetrics(self._id)
        self.replica = Replica(build_spec(model), root, poll_s, on_poll=self._polled)
        self._batching = batching
        self._scored.set_max_batch_size(self.replica.spec.max_batch)  # samples, by _samples

    def _polled(self, replica: Replica) -> None:
        self._metrics.update(replica)
        self._board.report.remote(self._id, replica.health() | {"pid": os.getpid()})

    async def __call__(self, request: Any) -> Any:
        path = request.url.path.rstrip("/")
        if request.method == "POST" and path == "/score":
            body = await request.body()
            start = time.perf_counter()
            decoded = self.replica.decode(body, request.headers.get("content-type", ""))
            if isinstance(decoded, Answer):
                answer = decoded
            elif self._batching:
                answer = await self._scored((decoded, start))
            else:
                answer = self.replica.score([decoded], [start])[0]
            self._metrics.record(answer)
            return self._response(answer)
        if request.method == "GET" and path == "/live":
            return Response(b"live\n", media_type="text/plain")
        if request.method == "GET" and path in ("/ready", "/health"):
            board = await self._board.snapshot.remote()
            if path == "/health":
                return Response(json.dumps(board).encode(), media_type="application/json")
            status = 200 if board["ready"] else 503
            return Response(b"ready\n" if board["ready"] else b"not ready\n", status, media_type="text/plain")
        return Response(
            f"no route {request.method} {path or '/'}; POST /score, GET /live, /ready, /health\n".encode(),
            404,
            media_type="text/plain",
        )

    @serve.batch(max_batch_size=4096, batch_wait_timeout_s=0.0, batch_size_fn=_samples)
    async def _scored(self, pending: list[tuple[DecodedRequest, float]]) -> list[Answer]:
        """The requests that queued while the model was busy, scored in one forward."""
        return self.replica.score([r for r, _ in pending], [t for _, t in pending])

    def _response(self, answer: Answer) -> Any:
        headers = {"X-Recsdk-Replica": self._id}
        if answer.version is not None:
            headers["X-Recsdk-Version"] = str(answer.version)
        return Response(answer.body, answer.status, headers=headers, media_type=answer.content_type)

    def check_health(self) -> None:
        """Ray Serve's liveness probe: the poll thread runs."""
        if not self.replica.polling:
            raise RuntimeError("the replica's poll thread died")
