"""``python -m recsdk.serving``: ``inspect ROOT`` and ``serve ROOT --model package.module:factory``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from recsdk.serving.inspect_root import inspect_root

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; the exit status (``inspect``: 1 when the chain is not servable;
    ``serve``: 2 for a bad flag, 0 after SIGINT/SIGTERM)."""
    parser = argparse.ArgumentParser(prog="python -m recsdk.serving", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="list a publisher's versions and check the chain a server applies")
    inspect.add_argument("root", help="the publisher's root")
    serve = commands.add_parser(
        "serve",
        help="serve the model over HTTP on Ray Serve (needs recsdk-serving[server])",
        description="Serve factory()'s model from the versions under ROOT: POST /score, GET /live, /ready, "
        "/health; metrics in Prometheus' format at --metrics-port.",
    )
    serve.add_argument("root", help="the publisher's root")
    serve.add_argument("--model", required=True, help="package.module:factory, a function returning a ModelSpec")
    serve.add_argument("--replicas", type=int, default=1, help="replicas (processes), each following ROOT")
    serve.add_argument("--port", type=int, default=8000, help="the HTTP port")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--poll-s", type=float, default=1.0, help="seconds between a replica's looks for versions")
    serve.add_argument("--metrics-port", type=int, default=None, help="Ray's Prometheus metrics port (default: none)")
    serve.add_argument(
        "--threads", type=int, default=None, help="torch threads per replica (default: (cores - 1) / replicas, >= 1)"
    )
    serve.add_argument("--ingress", choices=("haproxy", "proxy"), default="haproxy", help="Ray Serve's ingress")
    serve.add_argument(
        "--batching", action="store_true", help="score requests that arrive together in one forward (@serve.batch)"
    )
    args = parser.parse_args(argv)
    if args.command == "inspect":
        try:
            lines, ok = inspect_root(args.root)
        except Exception as e:  # reported as a BROKEN line, never a traceback
            lines, ok = [f"{args.root}: BROKEN: {type(e).__name__}: {e}"], False
        print("\n".join(lines))
        return 0 if ok else 1
    try:
        from recsdk.serving.server.launch import run_until_stopped
        from recsdk.serving.server.launch import serve as start
    except ImportError as e:
        print(f"serve needs the server extra: pip install 'recsdk-serving[server]' ({e})", file=sys.stderr)
        return 2
    try:
        server = start(
            args.root,
            args.model,
            replicas=args.replicas,
            port=args.port,
            host=args.host,
            poll_s=args.poll_s,
            metrics_port=args.metrics_port,
            threads=args.threads,
            ingress=args.ingress,
            batching=args.batching,
        )
    except ValueError as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2
    lines = [f"serving {args.model} from {args.root} on {server.url} ({args.replicas} replica(s))"]
    if server.metrics_url:
        lines.append(f"metrics on {server.metrics_url}")
    run_until_stopped(server, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
