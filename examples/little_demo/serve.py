"""Serve the little demo's model from the versions its trainer publishes, while it trains.

Run beside a training run that publishes (``main.py --publish-dir DIR --publish-every N``)::

    python examples/little_demo/main.py --world-size 2 --publish-dir publish --publish-every 50
    python examples/little_demo/serve.py --world-size 2 --publish-dir publish   # in a second terminal

It builds the demo's model (one process, on CPU, no process group), waits for the first full
version in ``DIR``, then follows the directory: for every version it applies, it scores the next
window of the held-out batches (the trainer's held-out set, rebuilt from the same flags) and
prints the served AUC. Once it serves the version of the trainer's last step, it scores the whole
held-out set and compares with the trainer's final eval scores (``--trainer-out``'s
``eval_scores.safetensors``): with fp32 rows they are equal to 1e-6.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from dataset import HistoryBatch, make_data
from model import DLRM, random_sequence_tables, random_tables
from safetensors.torch import load_file
from torchmetrics.classification import BinaryAUROC
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch
from recsdk.embedding import latest_version
from recsdk.serving import ModelSpec, ServingClient, ServingModel


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--publish-dir", required=True, help="the trainer's --publish-dir")
    parser.add_argument("--world-size", type=int, default=1, help="the trainer's ranks (its held-out set spans them)")
    parser.add_argument("--steps", type=int, default=600, help="the trainer's --steps: stop once serving its last step")
    parser.add_argument("--batch-size", type=int, default=256, help="the trainer's --batch-size")
    parser.add_argument("--eval-batches", type=int, default=8, help="the trainer's --eval-batches")
    parser.add_argument("--seed", type=int, default=0, help="the trainer's --seed")
    parser.add_argument("--no-history", action="store_true", help="the trainer's --no-history")
    parser.add_argument("--trainer-out", default="out/little_demo", help="the trainer's --out (its final eval scores)")
    parser.add_argument(
        "--server",
        action="store_true",
        help="also start the server (python -m recsdk.serving serve, 1 replica) and score the held-out set through it",
    )
    parser.add_argument("--interval-s", type=float, default=0.5, help="seconds between looks for new versions")
    parser.add_argument(
        "--timeout-s", type=float, default=900.0, help="give up when no new version comes for this long"
    )
    return parser.parse_args(argv)


def held_out_set(args: argparse.Namespace) -> list[Any]:
    """The trainer's held-out batches, every rank's in rank order (as its final eval gathered them)."""
    batches = []
    for rank in range(args.world_size):
        data = make_data(
            "random",
            [],
            batch_size=args.batch_size,
            steps=1,
            eval_batches=args.eval_batches,
            rank=rank,
            world_size=args.world_size,
            seed=args.seed,
            history=not args.no_history,
        )
        batches += data.held_out
    return batches


def scores_of(serving: ServingModel, batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The served click probabilities of ``batches`` and their labels."""
    probs = [serving(batch)[1][1] for batch in batches]
    return torch.cat(probs), torch.cat([batch.labels for batch in batches])


_SPEC_ENV = "LITTLE_DEMO_SERVE"  # the server's replicas build the model from these flags


def _model(dense_width: int, history: bool) -> DLRM:
    return DLRM(
        random_tables(),
        dense_width,
        torch.device("cpu"),
        sequence_tables=random_sequence_tables(history=history),
    )


def demo_spec() -> ModelSpec:
    """The server's factory (``--model serve:demo_spec``): the demo's DLRM; a request's KJT holds the
    bag features, then the sequence features (split back into a ``HistoryBatch``)."""
    bags, sequence, dense_width, history = os.environ[_SPEC_ENV].split(";")
    n_bags = len(bags.split(","))

    def predict(model: Any, sparse: KeyedJaggedTensor, dense: torch.Tensor) -> torch.Tensor:
        labels = torch.zeros(dense.shape[0])
        if not sequence:
            return model(Batch(dense, sparse, labels))[1][1]
        bag, seq = sparse.split([n_bags, len(sparse.keys()) - n_bags])
        return model(HistoryBatch(dense, bag, labels, seq))[1][1]

    features = bags.split(",") + (sequence.split(",") if sequence else [])
    return ModelSpec(_model(int(dense_width), history == "1"), features, int(dense_width), predict=predict)


def through_server(args: argparse.Namespace, batches: list[Any]) -> tuple[torch.Tensor, int]:
    """Start the server on the publish dir, score ``batches`` through its client; (scores, version)."""
    from recsdk.data.testing import free_port
    from recsdk.serving.server.launch import serve

    first = batches[0]
    sequence = getattr(first, "sequence_features", None)
    os.environ[_SPEC_ENV] = ";".join(
        [
            ",".join(first.sparse_features.keys()),
            "" if sequence is None else ",".join(sequence.keys()),
            str(first.dense_features.shape[1]),
            "0" if args.no_history else "1",
        ]
    )
    server = serve(args.publish_dir, "serve:demo_spec", replicas=1, port=free_port())
    try:
        scores, versions = [], set()
        with ServingClient(server.url) as client:
            for b in batches:
                kjt = b.sparse_features
                if sequence is not None:
                    kjt = KeyedJaggedTensor.concat([kjt, b.sequence_features])
                got, version = client.score(kjt, b.dense_features)
                scores.append(got)
                versions.add(version)
    finally:
        server.shutdown()
    if len(versions) != 1:
        raise RuntimeError(f"the server answered from versions {sorted(versions)}, not one")
    return torch.cat(scores), versions.pop()


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    metric = BinaryAUROC()
    metric.update(scores, labels.long())
    return float(metric.compute())


def wait(condition: Any, args: argparse.Namespace, what: str) -> None:
    deadline = time.monotonic() + args.timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {args.timeout_s:.0f} s")
        time.sleep(args.interval_s)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    held_out = held_out_set(args)
    window = max(1, len(held_out) // 4)
    model = _model(len(held_out[0].dense_features[0]), not args.no_history)
    print(f"serve: waiting for a version in {args.publish_dir}", flush=True)
    wait(lambda: latest_version(args.publish_dir) is not None, args, "version")
    serving = ServingModel(model, args.publish_dir)
    applied = 0
    while True:
        batches = [held_out[(applied * window + i) % len(held_out)] for i in range(window)]
        served = auc(*scores_of(serving, batches))
        print(
            f"version {serving.version:>4} ({serving.kind}, step {serving.step:>5}): served AUC {served:.4f} "
            f"on held-out window {applied}",
            flush=True,
        )
        applied += 1
        if serving.step >= args.steps:
            break
        last = serving.version
        wait(lambda last=last: serving.refresh(max_versions=1) > 0 or serving.version != last, args, "new version")
    scores, labels = scores_of(serving, held_out)
    final = Path(args.trainer_out) / "eval_scores.safetensors"
    wait(final.exists, args, f"trainer's final eval scores ({final})")
    trained = load_file(str(final))["scores"]
    diff = float((scores - trained).abs().max())
    print(f"served {len(scores)} held-out samples at step {serving.step}: AUC {auc(scores, labels):.4f}")
    print(f"max |served - trainer's final eval| = {diff:.2e} (fp32 rows: at most 1e-6)")
    ok = diff <= 1e-6
    if args.server:
        remote, version = through_server(args, held_out)
        same = version == serving.version and torch.equal(remote, scores)
        print(
            f"server (version {version}): {len(remote)} held-out samples, "
            f"{'equal to' if same else 'DIFFERENT from'} the in-process scores "
            f"(max |server - in-process| = {float((remote - scores).abs().max()):.2e})"
        )
        ok = ok and same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
