"""The server (``python -m recsdk.serving serve``, Ray Serve) against the in-process ``ServingModel``.

A DLRM with ``--tables`` hash tables of ``--ids`` ids (dim ``--dim``, ``--pooling`` ids per bag,
Zipf) is published by a real ``Publisher`` (one rank: a full version, then ``--deltas`` deltas of
``--delta-rows`` changed rows), and served two ways on the same requests:

- in process: ``ServingModel(model, root)`` called on the request's batch (the baseline), with
  as many torch threads as each replica has (``--threads``; default: the server's own default,
  ``(cores - 1) // replicas``, at least 1);
- through the server on loopback: ``recsdk.serving.server.launch.serve`` with 1 and 2 replicas
  (HAProxy ingress), a real client (``ServingClient``, binary bodies encoded before timing; the
  encoding's own cost is reported as ``encode_ms``).

One JSON line per measurement, per replica count and request size (1, 16, 256 samples):

- ``latency``: one client, one request at a time: p50/p99 of the round trip (ms) against the
  in-process call's p50/p99 (target p99 <= 5 ms at 1 sample); ``replica_p50_ms``: the time in
  the replica (decode, forward, encode, as the replica reports it); ``cpu_us``: CPU time per
  request by process (the replica, HAProxy, the client, Ray's other processes; from
  ``/proc``, 10 ms ticks over the round), where the round trip's time goes;
- ``throughput``: ``--clients`` client threads, each a request at a time: samples/s against the
  in-process samples/s on one thread (ratio; target >= 0.7 at 256 samples with one replica);
- ``versions_applying``: at 1 sample per request, the round trips' p99 while the deltas are
  published into the served root one every ``--delta-every-s`` seconds (every replica applying
  them), against the p99 of the same client with no version applying.

Each figure is the median of ``--rounds`` rounds, the server's and the in-process rounds
interleaved.

    python benchmarks/serving_server.py [--ids 50000] [--tables 4] [--requests 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

import torch
from _common import DLRM, embedding_collection, feature_names, fill_hash_tables, host_env, shard, table_configs
from torchrec import KeyedJaggedTensor

from recsdk.data import Batch
from recsdk.data.testing import free_port, run_distributed
from recsdk.serving import ModelSpec, ServingClient, ServingModel
from recsdk.serving.server.codec import encode_request
from recsdk.sharding import Publisher, get_default_hybrid_sharders, sharded_hash_modules

NUM_DENSE = 13
SIZES = (1, 16, 256)
_ENV = "RECSDK_SERVING_SERVER_BENCH"  # the model's shape, for the replicas' factory


def _model(tables: int, ids: int, dim: int, device: str) -> DLRM:
    features = feature_names(tables)
    configs = table_configs("hash", features, dim, int(ids / 0.8))
    ebc = (
        embedding_collection(configs)
        if device == "meta"
        else type(embedding_collection(configs))(tables=configs, device=torch.device(device))
    )
    return DLRM(ebc, features, dim)


def _predict(model: Any, sparse: KeyedJaggedTensor, dense: torch.Tensor) -> torch.Tensor:
    return model(Batch(dense, sparse, torch.zeros(dense.shape[0])))[1]


def spec() -> ModelSpec:
    """The factory the replicas build (``--model serving_server:spec``): the shape from the environment."""
    tables, ids, dim = (int(x) for x in os.environ[_ENV].split(","))
    return ModelSpec(_model(tables, ids, dim, "cpu"), feature_names(tables), NUM_DENSE, predict=_predict)


def _publish(rank: int, world_size: int, args: argparse.Namespace, root: str) -> dict[str, torch.Tensor]:
    """A full version, then ``--deltas`` deltas of ``--delta-rows`` rows; returns the ids per table."""
    torch.manual_seed(0)
    dmp, _ = shard(
        _model(args.tables, args.ids, args.dim, "meta"), get_default_hybrid_sharders(host_env=host_env()), None, 512
    )
    ids = fill_hash_tables(dmp, args.ids, rank, world_size)
    (module,) = sharded_hash_modules(dmp).values()
    publisher = Publisher(dmp, root, keep=1000)
    publisher.publish(step=0)
    gen = torch.Generator().manual_seed(7)
    for step in range(1, args.deltas + 1):
        views = module.table_views()
        for name, table in module.id_tables.items():
            _, rows = table.ids_and_rows()
            pick = rows[torch.randperm(rows.numel(), generator=gen)[: args.delta_rows // args.tables]]
            with torch.no_grad():
                views[name].weight[pick] += 0.01
            table.changes.changed(pick)
        publisher.publish(step=step)
    return ids


def _requests(args: argparse.Namespace, ids: dict[str, torch.Tensor], n: int, count: int) -> list[Batch]:
    """``count`` batches of ``n`` samples: ``--pooling`` Zipf ids per table and sample, random dense."""
    gen = torch.Generator().manual_seed(n)
    out = []
    for _ in range(count):
        values = []
        for i in range(args.tables):
            table = ids[f"t{i}"]
            u = torch.rand(n * args.pooling, generator=gen)
            values.append(table[((table.numel() ** u) - 1).long().clamp_(max=table.numel() - 1)])
        lengths = torch.full((args.tables * n,), args.pooling, dtype=torch.int64)
        kjt = KeyedJaggedTensor(keys=feature_names(args.tables), values=torch.cat(values), lengths=lengths)
        out.append(Batch(torch.rand(n, NUM_DENSE, generator=gen), kjt, torch.zeros(n)))
    return out


def _cpu_s() -> dict[str, float]:
    """CPU seconds so far of the server's processes and this one, by role (Linux ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(pid) == os.getpid():
            role = "client"
        elif "ServeReplica" in cmd:
            role = "replica"
        elif "haproxy" in cmd:
            role = "haproxy"
        elif "ray" in cmd:
            role = "ray_other"
        else:
            continue
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _in_process(serving: ServingModel, batches: list[Batch]) -> list[float]:
    out = []
    for b in batches:
        start = time.perf_counter()
        _predict_in_process(serving, b)
        out.append(time.perf_counter() - start)
    return out


def _predict_in_process(serving: ServingModel, b: Batch) -> torch.Tensor:
    return serving.on_one_version(_predict, b.sparse_features, b.dense_features)[1]


def _round_trips(
    client: ServingClient, bodies: list[bytes], content_type: str, versions: set[int] | None = None
) -> list[float]:
    """Seconds of each request's round trip; the versions that answered are added to ``versions``."""
    out = []
    for body in bodies:
        start = time.perf_counter()
        status, headers, answer = client.request("POST", "/score", body, content_type)
        out.append(time.perf_counter() - start)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {answer[:300]!r}")
        if versions is not None:
            versions.add(int(headers.get("x-recsdk-version", -1)))
    return out


def _throughput(url: str, bodies: list[bytes], content_type: str, clients: int) -> float:
    """Requests per second of ``clients`` threads, each sending its share of ``bodies`` in turn."""
    shares = [bodies[i::clients] for i in range(clients)]
    conns = [ServingClient(url) for _ in range(clients)]
    errors: list[BaseException] = []

    def run(conn: ServingClient, share: list[bytes]) -> None:
        try:
            _round_trips(conn, share, content_type)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c, s)) for c, s in zip(conns, shares, strict=True)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for c in conns:
        c.close()
    if errors:
        raise errors[0]
    return len(bodies) / elapsed


def _emit(**fields: Any) -> None:
    print(json.dumps({"bench": "serving_server", **fields}), flush=True)


def _measure(args: argparse.Namespace, url: str, replicas: int, serving: ServingModel, requests: dict) -> None:
    for n in SIZES:
        batches = requests[n]
        encoded = [encode_request(b.sparse_features, b.dense_features) for b in batches]
        bodies, content_type = [body for body, _ in encoded], encoded[0][1]
        start = time.perf_counter()
        for b in batches[:50]:
            encode_request(b.sparse_features, b.dense_features)
        encode_ms = (time.perf_counter() - start) / 50 * 1e3
        rounds: dict[str, list[float]] = {k: [] for k in ("p50", "p99", "ip50", "ip99", "tput", "itput")}
        cpu: dict[str, list[float]] = {}
        with ServingClient(url) as client:
            _round_trips(client, bodies[:20], content_type)  # warm
            for _ in range(args.rounds):
                before = _cpu_s()
                server = _round_trips(client, bodies, content_type)
                after = _cpu_s()
                for role, seconds in after.items():
                    cpu.setdefault(role, []).append((seconds - before.get(role, 0.0)) / len(bodies) * 1e6)
                local = _in_process(serving, batches)
                rounds["p50"].append(_p(server, 0.5) * 1e3)
                rounds["p99"].append(_p(server, 0.99) * 1e3)
                rounds["ip50"].append(_p(local, 0.5) * 1e3)
                rounds["ip99"].append(_p(local, 0.99) * 1e3)
                rounds["tput"].append(_throughput(url, bodies, content_type, args.clients) * n)
                rounds["itput"].append(len(batches) * n / sum(_in_process(serving, batches)))
            replica_ms = [s["latency_ms"].get("p50") for s in client.health()["replicas"].values()]
        med = {k: statistics.median(v) for k, v in rounds.items()}
        _emit(
            measurement="latency",
            replicas=replicas,
            samples_per_request=n,
            p50_ms=round(med["p50"], 3),
            p99_ms=round(med["p99"], 3),
            in_process_p50_ms=round(med["ip50"], 3),
            in_process_p99_ms=round(med["ip99"], 3),
            overhead_p50_ms=round(med["p50"] - med["ip50"], 3),
            replica_p50_ms=replica_ms,
            cpu_us={role: round(statistics.median(v)) for role, v in sorted(cpu.items())},
            encode_ms=round(encode_ms, 3),
            target_p99_ms=5.0 if n == 1 else None,
            requests=len(bodies),
            rounds=args.rounds,
        )
        _emit(
            measurement="throughput",
            replicas=replicas,
            samples_per_request=n,
            clients=args.clients,
            samples_per_s=round(med["tput"], 1),
            in_process_samples_per_s=round(med["itput"], 1),
            ratio=round(med["tput"] / med["itput"], 3),
            round_ratios=[round(a / b, 3) for a, b in zip(rounds["tput"], rounds["itput"], strict=True)],
            target=0.7 if n == 256 and replicas == 1 else None,
            rounds=args.rounds,
        )


def _while_versions_apply(
    args: argparse.Namespace, url: str, replicas: int, source: str, served: str, batches: list[Batch]
) -> None:
    encoded = [encode_request(b.sparse_features, b.dense_features) for b in batches]
    bodies, content_type = [body for body, _ in encoded], encoded[0][1]
    with ServingClient(url) as client:
        quiet = [_p(_round_trips(client, bodies, content_type), 0.99) * 1e3 for _ in range(args.rounds)]
        stop = threading.Event()

        def publish() -> None:
            for v in range(1, args.deltas + 1):
                if stop.wait(args.delta_every_s):
                    return
                shutil.copytree(os.path.join(source, f"{v:08d}"), os.path.join(served, f".partial-{v}"))
                os.rename(os.path.join(served, f".partial-{v}"), os.path.join(served, f"{v:08d}"))

        publisher = threading.Thread(target=publish)
        publisher.start()
        busy: list[float] = []
        versions: set[int] = set()
        deadline = time.monotonic() + args.deltas * args.delta_every_s + 2.0
        while time.monotonic() < deadline:
            busy += _round_trips(client, bodies, content_type, versions)
        stop.set()
        publisher.join()
    _emit(
        measurement="versions_applying",
        replicas=replicas,
        samples_per_request=1,
        deltas=args.deltas,
        delta_rows=args.delta_rows,
        versions_seen=sorted(versions),
        p99_ms=round(_p(busy, 0.99) * 1e3, 3),
        baseline_p99_ms=round(statistics.median(quiet), 3),
        ratio=round(_p(busy, 0.99) * 1e3 / statistics.median(quiet), 3),
        requests=len(busy),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--ids", type=int, default=50_000, help="ids per table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--pooling", type=int, default=4, help="ids per bag")
    parser.add_argument("--deltas", type=int, default=6)
    parser.add_argument("--delta-rows", type=int, default=4_000)
    parser.add_argument("--delta-every-s", type=float, default=0.5)
    parser.add_argument("--requests", type=int, default=300, help="requests per round and size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4, help="client threads for throughput")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=None, help="torch threads per replica and in process")
    parser.add_argument("--batching", action="store_true", help="serve with @serve.batch (--batching)")
    args = parser.parse_args()
    from recsdk.serving.server.launch import serve

    os.environ[_ENV] = f"{args.tables},{args.ids},{args.dim}"
    with tempfile.TemporaryDirectory(prefix="serving_server_") as tmp:
        source = os.path.join(tmp, "published")
        ids = run_distributed(_publish, 1, args, source)[0]
        requests = {n: _requests(args, ids, n, args.requests) for n in SIZES}
        for replicas in args.replicas:
            served = os.path.join(tmp, f"served_{replicas}")
            os.makedirs(served)
            shutil.copytree(os.path.join(source, "00000000"), os.path.join(served, "00000000"))
            serving = ServingModel(_model(args.tables, args.ids, args.dim, "cpu"), served)
            threads = args.threads or max(1, ((os.cpu_count() or 1) - 1) // replicas)  # the server's default
            torch.set_num_threads(threads)  # the in-process baseline: as many threads as a replica
            server = serve(
                served,
                "serving_server:spec",
                replicas=replicas,
                port=free_port(),
                poll_s=0.2,
                threads=threads,
                batching=args.batching,
            )
            _emit(measurement="setup", replicas=replicas, threads=threads, batching=args.batching, cores=os.cpu_count())
            try:
                _measure(args, server.url, replicas, serving, requests)
                _while_versions_apply(args, server.url, replicas, source, served, requests[1][:100])
            finally:
                server.shutdown()


if __name__ == "__main__":
    main()
