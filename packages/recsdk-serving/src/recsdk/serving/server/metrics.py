"""A replica's metrics in Ray Serve's own metrics system (``ray.serve.metrics``).

Ray exports them in Prometheus' text format at the metrics port (``--metrics-port``), each
tagged with its deployment and replica, prefixed ``ray_``:

- ``recsdk_serving_requests`` (counter, by ``status``: 200, 400, 413, 415, 500, 503);
- ``recsdk_serving_batch_size`` (histogram: samples per scored request);
- ``recsdk_serving_latency_ms`` (histogram: time in the replica per scored request; Prometheus'
  ``histogram_quantile`` gives any quantile over any window) and the gauges
  ``recsdk_serving_latency_p50_ms`` / ``_p90_ms`` / ``_p99_ms`` (the replica's latest 2048
  requests, set at every poll);
- ``recsdk_serving_ready`` (1 once a version is loaded), ``recsdk_serving_version`` (the version
  served), ``recsdk_serving_version_age_s`` (since it was published), and
  ``recsdk_serving_version_error`` (1 while the latest version cannot be applied: damaged,
  missing, of another model; the replica serves the last good one).
"""

from __future__ import annotations

import importlib

from recsdk.serving.server.replica import Answer, Replica

# Ray is the server extra's: imported by name, so that only the server's modules need it.
_ray_metrics = importlib.import_module("ray.serve.metrics")
Counter, Gauge, Histogram = _ray_metrics.Counter, _ray_metrics.Gauge, _ray_metrics.Histogram

__all__ = ["ReplicaMetrics"]

_BATCH_BOUNDARIES = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0]
_LATENCY_BOUNDARIES_MS = [0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0, 1000.0]


class ReplicaMetrics:
    """The metrics one replica reports (see the module's docstring).

    Example::

        metrics = ReplicaMetrics(replica_id)
        metrics.record(answer)  # per request
        metrics.update(replica)  # per poll
    """

    def __init__(self, replica: str) -> None:
        tags = ("recsdk_replica",)
        self.requests = Counter(
            "recsdk_serving_requests",
            description="Requests answered, by HTTP status.",
            tag_keys=("recsdk_replica", "status"),
        )
        self.batch_size = Histogram(
            "recsdk_serving_batch_size",
            description="Samples per scored request.",
            boundaries=_BATCH_BOUNDARIES,
            tag_keys=tags,
        )
        self.latency_ms = Histogram(
            "recsdk_serving_latency_ms",
            description="Milliseconds in the replica per scored request (decode, forward, encode).",
            boundaries=_LATENCY_BOUNDARIES_MS,
            tag_keys=tags,
        )
        self.quantiles = {
            q: Gauge(
                f"recsdk_serving_latency_{q}_ms",
                description=f"{q} of the replica's latest 2048 requests, ms.",
                tag_keys=tags,
            )
            for q in ("p50", "p90", "p99")
        }
        self.ready = Gauge("recsdk_serving_ready", description="1 once the replica serves a version.", tag_keys=tags)
        self.version = Gauge("recsdk_serving_version", description="The version served.", tag_keys=tags)
        self.version_age_s = Gauge(
            "recsdk_serving_version_age_s",
            description="Seconds since the version served was published.",
            tag_keys=tags,
        )
        self.version_error = Gauge(
            "recsdk_serving_version_error",
            description="1 while the latest version cannot be applied (the last good one is served).",
            tag_keys=tags,
        )
        for metric in (self.requests, self.batch_size, self.latency_ms, *self.quantiles.values()):
            metric.set_default_tags({"recsdk_replica": replica})
        for metric in (self.ready, self.version, self.version_age_s, self.version_error):
            metric.set_default_tags({"recsdk_replica": replica})

    def record(self, answer: Answer) -> None:
        """Count a request; a scored one adds its batch size and latency."""
        self.requests.inc(tags={"status": str(answer.status)})
        if answer.status == 200:
            self.batch_size.observe(answer.batch_size)
            self.latency_ms.observe(answer.latency_ms)

    def update(self, replica: Replica) -> None:
        """The replica's state after a poll."""
        self.ready.set(1.0 if replica.ready else 0.0)
        if replica.serving is not None:
            self.version.set(float(replica.serving.version))
            self.version_age_s.set(replica.version_age_s())
        self.version_error.set(0.0 if replica.last_error is None else 1.0)
        for q, value in replica.latency_quantiles().items():
            self.quantiles[q].set(value)
