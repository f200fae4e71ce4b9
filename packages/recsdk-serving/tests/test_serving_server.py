"""The server (``python -m recsdk.serving serve``): one real server on loopback, 2 replicas, started
once through the CLI (with ``--batching``: concurrent requests merged into one forward) and shared
by these tests; real requests through the client and raw HTTP."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from serving_models import EVAL, FEATURES, NUM_DENSE, TOLERANCE, Recommender, copy_versions, predict
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

pytest.importorskip("ray.serve", reason="the server needs recsdk-serving[server]")

from recsdk.serving import ServerError, ServingClient, ServingModel, score
from recsdk.serving.cli import main
from recsdk.serving.server.codec import BINARY_REQUEST, JSON, decode_request, encode_request
from recsdk.serving.server.merge import merge_requests, split_scores

TESTS = Path(__file__).resolve().parent
REPLICAS = 2
POLL_S = 0.5
BOUND_S = POLL_S + 4.5  # documented: poll_s plus the time to read and apply a version (ms here), with slack


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, published: tuple[Path, list]) -> Iterator[dict[str, Any]]:
    """The CLI's server over a root holding version 0; versions are added by the tests."""
    root = copy_versions(published, tmp_path_factory.mktemp("served") / "root", [0])
    port, metrics_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "recsdk.serving", "serve", str(root), "--model", "serving_models:recommender_spec"]
    cmd += ["--replicas", str(REPLICAS), "--port", str(port), "--metrics-port", str(metrics_port)]
    cmd += ["--poll-s", str(POLL_S), "--batching"]
    log = tmp_path_factory.mktemp("server_log") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=TESTS, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while _get(url + "/ready")[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become ready:\n{log.read_text()[-4000:]}")
            time.sleep(0.25)
        yield {"url": url, "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "root": root, "log": log}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def _post(url: str, body: bytes, content_type: str) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/score", body, {"Content-Type": content_type})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def _want(published: tuple[Path, list], version: int) -> torch.Tensor:
    return dict(published[1])[version][0]  # the trained model's eval scores of EVAL[0] at that version


def _json_request(n: int = 2) -> dict[str, Any]:
    """A request written by hand: n samples, every feature, ids the tables may or may not hold."""
    return {
        "dense": [[0.25] * NUM_DENSE for _ in range(n)],
        "sparse": {
            "user": {"lengths": [1] * n, "values": [7 + i for i in range(n)]},
            "tag": {"lengths": [2] + [0] * (n - 1), "values": [3, 4]},
            "history": {"lengths": [0] * n, "values": []},
            "candidate": {"lengths": [1] * n, "values": [11] * n},
        },
    }


# ---- requests ------------------------------------------------------------------------------------


def test_scores_in_both_encodings_equal_the_trained_models(server: dict, published: tuple[Path, list]) -> None:
    batch = EVAL[0]
    for binary in (True, False):
        scores, version = score(server["url"], batch.sparse_features, batch.dense_features, binary=binary)
        assert version == 0
        assert float((scores - _want(published, 0)).abs().max()) <= TOLERANCE["float32"]
    # A JSON body written by hand, over raw HTTP: the answer names the version.
    status, text = _post(server["url"], json.dumps(_json_request()).encode(), "application/json; charset=utf-8")
    assert status == 200, text
    answer = json.loads(text)
    assert answer["version"] == 0 and len(answer["scores"]) == 2


def test_unknown_ids_serve_the_default_row_as_in_process(server: dict, published: tuple[Path, list]) -> None:
    one_each = ("user", "candidate")  # the model takes exactly one id per sample of these
    never = {  # ids no table holds
        name: {"lengths": [1, 1], "values": [2**62 + 17, 2**62 + 18]}
        if name in one_each
        else {"lengths": [1, 2], "values": [2**62 + 17 + i for i in range(3)]}
        for name in FEATURES
    }
    dense = [[0.5] * NUM_DENSE, [-0.5] * NUM_DENSE]
    with ServingClient(server["url"], binary=False) as client:
        got, version = client.score(never, dense)
    local = ServingModel(Recommender("cpu"), copy_versions(published, server["root"].parent / "local", [0]))
    body, kind = encode_request(never, dense)
    request = decode_request(body, kind, FEATURES, NUM_DENSE, 16)
    assert version == local.version == 0
    assert torch.equal(got, local.on_one_version(predict, request.sparse, request.dense)[1])


def _bad_requests() -> list[tuple[str, bytes, str, int, str]]:
    """(what, body, content type, status, the field its message must name)."""
    cases = []

    def case(what: str, doc: dict, field: str, status: int = 400) -> None:
        cases.append((what, json.dumps(doc).encode(), JSON, status, field))

    doc = _json_request()
    doc["sparse"]["color"] = {"lengths": [0, 0], "values": []}
    case("unknown feature", doc, "sparse.color")
    doc = _json_request()
    doc["sparse"]["user"]["values"][1] = 8.5
    case("non-integer id", doc, "sparse.user.values[1]")
    doc = _json_request()
    doc["sparse"]["user"]["values"][0] = "7"
    case("string id", doc, "sparse.user.values[0]")
    doc = _json_request()
    doc["sparse"]["tag"]["lengths"] = [3, 0]
    case("lengths not adding up", doc, "sparse.tag")
    doc = _json_request()
    doc["sparse"]["history"]["lengths"] = [0]
    case("a length missing", doc, "sparse.history.lengths")
    doc = _json_request()
    doc["dense"][1] = [0.0] * (NUM_DENSE + 1)
    case("wrong dense width", doc, "dense[1]")
    doc = _json_request()
    del doc["sparse"]["candidate"]
    case("missing feature", doc, "sparse.candidate")
    doc = _json_request()
    doc["sparse"]["tag"]["weights"] = [1.0]
    case("weights not one per id", doc, "sparse.tag")
    case("batch over the limit", _json_request(4097), "dense", 413)
    cases.append(("JSON that is not", b'{"dense": [[0.1, 0.2', JSON, 400, "body"))
    good, _ = encode_request(EVAL[0].sparse_features, EVAL[0].dense_features)
    cases.append(("binary cut short", good[:-5], BINARY_REQUEST, 400, "body"))
    cases.append(("JSON sent as binary", json.dumps(_json_request()).encode(), BINARY_REQUEST, 400, "body"))
    cases.append(("unknown content type", good, "text/csv", 415, "Content-Type"))
    return cases


def test_every_bad_request_gets_a_4xx_naming_the_field_and_the_server_keeps_serving(
    server: dict, published: tuple[Path, list]
) -> None:
    problems = []
    for what, body, content_type, status, field in _bad_requests():
        got, message = _post(server["url"], body, content_type)
        if got != status or not message.startswith(field + ":"):
            problems.append(f"{what}: {got} {message!r}, wanted {status} naming {field!r}")
        scores, _ = score(server["url"], EVAL[0].sparse_features, EVAL[0].dense_features)
        if float((scores - _want(published, 0)).abs().max()) > TOLERANCE["float32"]:
            problems.append(f"after {what}: the scores changed")
    assert problems == []


def test_the_client_raises_server_error_with_the_message(server: dict) -> None:
    doc = _json_request()
    doc["sparse"]["color"] = {"lengths": [1, 0], "values": [5]}
    with pytest.raises(ServerError, match=r"HTTP 400: sparse\.color: unknown feature") as e:
        score(server["url"], doc["sparse"], doc["dense"], binary=False)
    assert e.value.status == 400
    with pytest.raises(ValueError, match="url must be 'http://host:port'"):
        ServingClient("localhost:1")


# ---- health and metrics --------------------------------------------------------------------------


def test_live_ready_health_and_metrics(server: dict) -> None:
    assert _get(server["url"] + "/live")[0] == 200
    assert _get(server["url"] + "/ready") == (200, b"ready\n")
    health = ServingClient(server["url"]).health()
    assert health["ready"] and health["versions"] == [0] and len(health["replicas"]) == REPLICAS
    for state in health["replicas"].values():
        assert state["version"] == 0 and state["last_error"] is None and state["version_age_s"] >= 0
    assert _get(server["url"] + "/nothing")[0] == 404
    wanted = [
        "ray_recsdk_serving_requests",
        "ray_recsdk_serving_batch_size_bucket",
        "ray_recsdk_serving_latency_ms_bucket",
        "ray_recsdk_serving_latency_p99_ms",
        "ray_recsdk_serving_version{",
        "ray_recsdk_serving_version_age_s",
        "ray_recsdk_serving_ready",
        "ray_recsdk_serving_version_error",
        'status="200"',
        'status="400"',  # the bad requests of the test before
    ]
    deadline = time.monotonic() + 20  # Ray reports metrics every second
    missing = wanted
    while missing and time.monotonic() < deadline:
        text = _get(server["metrics"])[1].decode()
        missing = [m for m in wanted if m not in text]
        time.sleep(0.5)
    assert missing == []


# ---- versions --------------------------------------------------------------------------------------


def _replica_versions(url: str) -> dict[str, tuple[int | None, str | None]]:
    health = ServingClient(url).health()
    return {name: (s["version"], s["last_error"]) for name, s in health["replicas"].items()}


def _until(condition: Any, timeout_s: float) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - start


def test_new_versions_reach_every_replica_within_the_bound_never_half_applied(
    server: dict, published: tuple[Path, list]
) -> None:
    """Each answer's scores are those of the version it names (never a mix), while versions 1-2
    apply; every replica serves version 2 within BOUND_S of its publication."""
    url, root = server["url"], server["root"]
    seen: list[str] = []
    versions_seen: set[int] = set()
    stop = threading.Event()

    def traffic() -> None:
        with ServingClient(url) as client:
            while not stop.is_set():
                scores, version = client.score(EVAL[0].sparse_features, EVAL[0].dense_features)
                versions_seen.add(version)
                if float((scores - _want(published, version)).abs().max()) > TOLERANCE["float32"]:
                    seen.append(f"scores of no single version, answered as version {version}")

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        for v in (1, 2):  # a version appears whole: copied aside, then renamed in (as Publisher does)
            shutil.copytree(published[0] / f"{v:08d}", root / f".partial-{v}")
            os.rename(root / f".partial-{v}", root / f"{v:08d}")
        elapsed = _until(lambda: {v for v, _ in _replica_versions(url).values()} == {2}, BOUND_S)
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
    assert seen == [] and 2 in versions_seen
    assert elapsed <= BOUND_S


def test_a_damaged_version_is_reported_while_the_last_good_one_is_served(
    server: dict, published: tuple[Path, list]
) -> None:
    url, root = server["url"], server["root"]
    _until(lambda: {v for v, _ in _replica_versions(url).values()} == {2}, BOUND_S)
    shutil.copytree(published[0] / "00000003", root / ".partial-3")
    target = root / ".partial-3" / "dense.safetensors"
    target.write_bytes(b"\0" + target.read_bytes()[1:])
    os.rename(root / ".partial-3", root / "00000003")
    _until(lambda: all(e and "dense.safetensors" in e for _, e in _replica_versions(url).values()), BOUND_S)
    assert {v for v, _ in _replica_versions(url).values()} == {2}
    assert _get(url + "/ready")[0] == 200
    for binary in (True, False):
        scores, version = score(url, EVAL[0].sparse_features, EVAL[0].dense_features, binary=binary)
        assert version == 2 and float((scores - _want(published, 2)).abs().max()) <= TOLERANCE["float32"]
    deadline = time.monotonic() + 20
    while "ray_recsdk_serving_version_error" not in (text := _get(server["metrics"])[1].decode()) or not any(
        line.startswith("ray_recsdk_serving_version_error") and line.endswith(" 1.0") for line in text.splitlines()
    ):
        assert time.monotonic() < deadline, "version_error never reported 1 in the metrics"
        time.sleep(0.5)
    copy_versions(published, root, [4])  # a newer full version: served by all, the error cleared
    _until(lambda: set(_replica_versions(url).values()) == {(4, None)}, BOUND_S)


# ---- the command line ----------------------------------------------------------------------------


def test_serve_refuses_bad_flags_with_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    done = subprocess.run(  # the command itself, once; the other flags through its main() here
        [sys.executable, "-m", "recsdk.serving", "serve", str(tmp_path), "--model", "m:f", "--replicas", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "replicas must be an int >= 1, got 0" in done.stderr, done.stderr[-2000:]
    for flags, message in (
        (["--model", "no_such_module:factory"], "module 'no_such_module' does not import"),
        (["--model", "serving_models"], "--model must be 'package.module:factory'"),
        (["--model", "serving_models:recommender_spec", "--poll-s", "0"], "poll_s must be a number > 0, got 0.0"),
        (["--model", "serving_models:recommender_spec", "--port", "70000"], "port must be <= 65535, got 70000"),
    ):
        assert main(["serve", str(tmp_path), *flags]) == 2
        assert message in capsys.readouterr().err, flags
    assert main(["serve", str(tmp_path / "nothing"), "--model", "serving_models:recommender_spec"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_the_codec_round_trips_a_weighted_kjt() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2**62, 3]),
        lengths=torch.tensor([1, 0, 0, 2]),
        weights=torch.tensor([0.5, 1.0, 2.0]),
    )
    dense = torch.rand(2, 3)
    for binary in (True, False):
        request = decode_request(*encode_request(kjt, dense, binary), ["b", "a"], 3, 8)
        assert request.sparse.keys() == ["b", "a"] and request.binary == binary
        assert request.sparse.values().tolist() == [2**62, 3, 1]
        assert request.sparse.lengths().tolist() == [0, 2, 1, 0]
        assert request.sparse.weights().tolist() == [1.0, 2.0, 0.5]
        assert torch.equal(request.dense, dense)


def test_concurrent_requests_merged_into_one_forward_each_get_their_own_scores(
    server: dict, published: tuple[Path, list]
) -> None:
    """Requests arriving together are scored in one forward (``@serve.batch``); every answer
    holds its own samples' scores, in its own encoding."""
    want = dict(published[1])
    problems: list[str] = []

    def client(i: int) -> None:
        with ServingClient(server["url"], binary=i % 2 == 0) as c:
            for k in range(12):
                j = (i + k) % len(EVAL)
                scores, version = c.score(EVAL[j].sparse_features, EVAL[j].dense_features)
                if float((scores - want[version][j]).abs().max()) > TOLERANCE["float32"]:
                    problems.append(f"client {i}, request {k}: not EVAL[{j}]'s scores of version {version}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []


def test_merged_requests_lay_each_feature_request_after_request() -> None:
    def kjt(values: list[int], lengths: list[int], weights: list[float] | None = None) -> KeyedJaggedTensor:
        w = None if weights is None else torch.tensor(weights)
        return KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor(values), lengths=torch.tensor(lengths), weights=w)

    first = decode_request(*encode_request(kjt([1, 2, 3], [1, 2]), torch.zeros(1, 2)), ["a", "b"], 2, 8)
    second = decode_request(
        *encode_request(kjt([4, 5, 6], [2, 0, 1, 0], [0.5, 0.25, 2.0]), torch.ones(2, 2)), ["a", "b"], 2, 8
    )
    merged = merge_requests([first, second])
    assert merged.sparse.keys() == ["a", "b"] and merged.batch_size == 3
    assert merged.sparse.lengths().tolist() == [1, 2, 0, 2, 1, 0]
    assert merged.sparse.values().tolist() == [1, 4, 5, 2, 3, 6]
    assert merged.sparse.weights().tolist() == [1.0, 0.5, 0.25, 1.0, 1.0, 2.0]
    assert torch.equal(merged.dense, torch.cat([torch.zeros(1, 2), torch.ones(2, 2)]))
    a, b = split_scores(torch.arange(3.0), [first, second])
    assert a.tolist() == [0.0] and b.tolist() == [1.0, 2.0]
    assert merge_requests([first]) is first
