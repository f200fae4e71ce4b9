"""``serve``: start Ray Serve on this machine with the model's replicas following ROOT.

A local Ray instance, the health board, and ``replicas`` replicas of
:class:`~recsdk.serving.server.deployment.ServingDeployment` behind one HTTP port. By default
Ray Serve's HAProxy ingress forwards requests straight to the replicas' own HTTP servers
(``RAY_SERVE_ENABLE_HA_PROXY`` and ``RAY_SERVE_ENABLE_DIRECT_INGRESS``: ~1 ms per round trip
here instead of ~7 ms through Ray's Python proxy); ``ingress="proxy"`` keeps Ray's proxy.
Ray Serve runs in its throughput-optimized mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED``: the user
code on the replica's own event loop, request logs buffered, no logs to stderr), and each
replica's torch threads leave one core to the HTTP path (see :func:`serve`'s ``threads``).
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RunningServer", "serve"]

INGRESS = ("haproxy", "proxy")


@dataclass
class RunningServer:
    """A server :func:`serve` started: its URL and metrics URL; :meth:`shutdown` stops it."""

    url: str
    metrics_url: str | None
    board: Any = None  # the health board's handle, held while the server runs

    def shutdown(self) -> None:
        """Stop the local Ray instance, and with it the replicas and the ingress.

        Not ``serve.shutdown()`` first: its controller drains the deployments one by one and
        took over 30 s here; the Ray instance is this server's own, and its end ends them all.
        """
        importlib.import_module("ray").shutdown()


def serve(
    root: str | os.PathLike[str],
    model: str,
    replicas: int = 1,
    port: int = 8000,
    host: str = "127.0.0.1",
    poll_s: float = 1.0,
    metrics_port: int | None = None,
    threads: int | None = None,
    ingress: str = "haproxy",
    batching: bool = False,
) -> RunningServer:
    """Start the server; returns once every replica is up (serving a version, or waiting for one).

    Args:
        root (str | os.PathLike): the publisher's root (it may hold no version yet: the server
            is then live but not ready).
        model (str): ``package.module:factory``, importable here and in the replicas (the
            replicas get this process's ``sys.path``); ``factory()`` returns a ``ModelSpec``.
        replicas (int): Ray Serve replicas (processes), each with its own copy of the model.
        port (int): the HTTP port.
        host (str): the address to listen on.
        poll_s (float): seconds between a replica's looks for new versions; a complete version
            is served by every replica within ``poll_s`` plus its time to read and apply it.
        metrics_port (int | None): where Ray exports the metrics (Prometheus); None: none.
        threads (int | None): torch threads per replica; None: the cores but one (left to the
            HTTP path: HAProxy, the replicas' event loops, the clients) shared among them, at
            least 1. On the 2-core dev machine 2 threads per replica spun in OpenMP against the
            HTTP path: 256-sample requests took 16.8 ms at p50 under 4 clients, 2.0 ms at 1 thread.
        ingress (str): ``"haproxy"`` (default) or ``"proxy"`` (Ray Serve's Python proxy).
        batching (bool): score the requests that arrive while a replica's model is busy together,
            in one forward (Ray Serve's ``@serve.batch``; a lone request is never held back).
            Off by default: on the 2-core dev machine its queue cost more per request than the
            forwards it saved (see the serving README).

    Raises:
        ValueError: a bad argument (named), or a ``model`` that does not import.

    Example::

        server = serve("publish/", "my_models:ranker", replicas=2, port=8000)
        scores, version = score(server.url, batch.sparse_features, batch.dense_features)
        server.shutdown()
    """
    from recsdk.serving.server.model_spec import load_factory

    root = os.fspath(root)
    for name, value, low in (("replicas", replicas, 1), ("port", port, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if port > 65535:
        raise ValueError(f"port must be <= 65535, got {port}")
    if isinstance(poll_s, bool) or not isinstance(poll_s, int | float) or poll_s <= 0:
        raise ValueError(f"poll_s must be a number > 0, got {poll_s!r}")
    if ingress not in INGRESS:
        raise ValueError(f"ingress must be one of {INGRESS}, got {ingress!r}")
    if not os.path.isdir(root):
        raise ValueError(f"root {root!r} is not a directory")
    load_factory(model)  # fails here, with the reason, rather than in every replica
    if threads is None:
        threads = max(1, ((os.cpu_count() or 1) - 1) // replicas)
    flag = "1" if ingress == "haproxy" else "0"
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = flag
    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = flag
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    # HAProxy's own metrics and stats listeners default to fixed ports (9101, 8404): a second
    # server on the machine failed to start on them. Free ports instead.
    os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(_free_port())
    os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] = str(_free_port())
    # The replicas import the model's factory as this process does.
    paths = [p or os.getcwd() for p in sys.path] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))

    ray = importlib.import_module("ray")
    ray_serve = importlib.import_module("ray.serve")

    from recsdk.serving.server.deployment import BOARD_NAME, BOARD_NAMESPACE, HealthBoard, ServingDeployment

    ray.init(
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        log_to_driver=False,
        namespace=BOARD_NAMESPACE,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        board = HealthBoard.options(name=BOARD_NAME, namespace=BOARD_NAMESPACE).remote(replicas)  # type: ignore[attr-defined]
        ray_serve.start(http_options={"host": host, "port": port})
        # Each replica's torch threads: its process reads OMP_NUM_THREADS when torch first runs.
        actor = {"num_cpus": 0, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}}
        app = ServingDeployment.options(num_replicas=replicas, ray_actor_options=actor).bind(  # type: ignore[attr-defined]
            model, os.path.abspath(root), poll_s, batching
        )
        ray_serve.run(app, route_prefix="/", name="recsdk-serving")
        url = f"http://{host}:{port}"
        _wait_until_answering(url + "/live", timeout_s=60.0)
    except BaseException:
        ray_serve.shutdown()
        ray.shutdown()
        raise
    return RunningServer(url, None if metrics_port is None else f"http://{host}:{metrics_port}/metrics", board)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_answering(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not answer {url} within {timeout_s:.0f} s")
        time.sleep(0.1)


def run_until_stopped(server: RunningServer, out: Sequence[str] = ()) -> None:
    """Block until SIGINT or SIGTERM, then shut the server down."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    for line in out:
        print(line, flush=True)
    stop.wait()
    server.shutdown()
