"""IdTable against a Python dict doing the same id -> row mapping.

Batches of Zipf-distributed ranks (exponent ``--zipf`` over ``--vocab`` ranks) are scrambled over
the whole int64 range (``recsdk.data.mix64``, a bijection) to look like raw feature ids. After
``--warmup`` batches have been mapped by both (steady state: most ids of a new batch are already
stored), the next ``--batches`` batches are timed with

* ``IdTable.find_or_insert`` against ``[d.setdefault(x, len(d)) for x in ids.tolist()]`` turned
  into a rows tensor, and
* ``IdTable.find`` against ``[d.get(x, -1) for x in ids.tolist()]`` turned into a rows tensor,

both in this process, interleaved batch by batch; on an accelerator the timed region ends with a
device sync, so it covers the table's kernels. Prints one JSON line per measurement with ids/s
and the ratio to the dict (``new_ids_per_batch`` counts the table's inserts, which with an
eviction policy include ids re-inserted after being evicted), then one line with the table's
bytes per id (all metadata included, beyond the embedding rows). ``--threads`` defaults to 1,
the dict's share of the machine. ``--index torch`` runs the torch-ops hash index (what CUDA and
NPU tables use) on CPU instead of FBGEMM's kernels, to compare the two.

    python benchmarks/id_table.py                           # 1M ids per batch, capacity 8M
    python benchmarks/id_table.py --capacity 1000000 --batch-size 100000
    python benchmarks/id_table.py --batch-size 4096 --capacity 200000 --vocab 200000 --index torch

``--policies`` compares admission and eviction policies instead: ``find_or_insert`` ids/s of
show/click score admission + score eviction, count-min admission + score eviction (the
eviction's own cost), and probabilistic admission + LRU, each against count-min admission + LRU
(the baseline), on a table 32 times smaller than its vocabulary (ids are admitted, evicted and
come back), every batch with clicks (a label per id, 1 in 8 clicked). Each round maps the same batch with every
policy's table, in a rotating order; one JSON line per policy with the median over rounds of
its ids/s and of its ratio to the baseline's:

    python benchmarks/id_table.py --policies                 # 128k rows, 4M-id vocabulary, 128k ids per batch
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from recsdk.data.hashing import mix64
from recsdk.embedding import (
    CountAdmission,
    IdTable,
    LFUEviction,
    LRUEviction,
    ProbabilisticAdmission,
    ScoreAdmission,
    ScoreEviction,
    ShowClickScore,
    TTLEviction,
    slot_index,
)

T = TypeVar("T")
EVICTIONS = {"none": None, "lru": LRUEviction(), "lfu": LFUEviction(), "ttl": TTLEviction(max_idle_steps=4)}


class ZipfIds:
    """Batches of raw int64 ids: Zipf-distributed ranks in ``[0, vocab)``, scrambled by ``mix64``."""

    def __init__(self, vocab: int, exponent: float, seed: int) -> None:
        weights = np.arange(1, vocab + 1, dtype=np.float64) ** -exponent
        self.cdf = np.cumsum(weights)
        self.cdf /= self.cdf[-1]
        self.rng = np.random.default_rng(seed)

    def batch(self, size: int) -> torch.Tensor:
        ranks = np.searchsorted(self.cdf, self.rng.random(size), side="right")
        return torch.from_numpy(mix64(ranks))


def dict_find_or_insert(d: dict[int, int], ids: torch.Tensor) -> torch.Tensor:
    setdefault = d.setdefault
    return torch.tensor([setdefault(x, len(d)) for x in ids.tolist()], dtype=torch.int64)


def dict_find(d: dict[int, int], ids: torch.Tensor) -> torch.Tensor:
    get = d.get
    return torch.tensor([get(x, -1) for x in ids.tolist()], dtype=torch.int64)


def timed(fn: Callable[..., T], *args: Any, sync: Callable[[], None] = lambda: None) -> tuple[T, float]:
    """``fn(*args)`` and its seconds, ``sync()`` included (the device's queued work finishes inside)."""
    start = time.perf_counter()
    out = fn(*args)
    sync()
    return out, time.perf_counter() - start


def policy_tables(capacity: int) -> dict[str, IdTable]:
    """The tables ``--policies`` compares, the baseline first."""
    score = ShowClickScore(alpha=1.0, beta=10.0, decay=0.95)
    policies: dict[str, dict[str, Any]] = {
        "countmin_lru": {
            "admission": CountAdmission(threshold=2, counter_slots=4 * capacity),
            "eviction": LRUEviction(),
        },
        "showclick": {
            "admission": ScoreAdmission(threshold=2.0, score=score, counter_slots=4 * capacity),
            "eviction": ScoreEviction(evict_fraction=0.01, score=score),
        },
        "countmin_score_eviction": {
            "admission": CountAdmission(threshold=2, counter_slots=4 * capacity),
            "eviction": ScoreEviction(evict_fraction=0.01, score=score),
        },
        "probabilistic_lru": {"admission": ProbabilisticAdmission(probability=0.5), "eviction": LRUEviction()},
    }
    return {name: IdTable(capacity, name=name, **p) for name, p in policies.items()}


def compare_policies(args: argparse.Namespace) -> None:
    """``--policies``: each policy's find_or_insert against count-min + LRU, interleaved, medians."""
    capacity = args.capacity
    vocab = args.vocab or 32 * capacity
    ids = ZipfIds(vocab, args.zipf, args.seed)
    clicks_rng = torch.Generator().manual_seed(args.seed)
    tables = policy_tables(capacity)
    names = list(tables)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        b = ids.batch(args.batch_size)
        return b, (torch.rand(b.numel(), generator=clicks_rng) < 0.125).float()

    for _ in range(args.warmup):
        b, c = batch()
        for table in tables.values():
            table.find_or_insert(b, c)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.batches):
        b, c = batch()
        for name in names[r % len(names) :] + names[: r % len(names)]:
            _, t = timed(tables[name].find_or_insert, b, c)
            times[name].append(t)
    base = times[names[0]]
    for name in names[1:]:
        ratios = [b_t / t for b_t, t in zip(base, times[name], strict=True)]
        stats = tables[name].stats()
        print(
            json.dumps(
                {
                    "bench": "id_table_policies",
                    "policy": name,
                    "ids_per_s": round(args.batch_size / float(np.median(times[name]))),
                    "baseline": "countmin_lru",
                    "baseline_ids_per_s": round(args.batch_size / float(np.median(base))),
                    "ratio": round(float(np.median(ratios)), 3),
                    "rounds": args.batches,
                    "batch_size": args.batch_size,
                    "capacity": capacity,
                    "vocab": vocab,
                    "hit_rate": round(stats["hit_rate"], 3),
                    "baseline_hit_rate": round(tables[names[0]].stats()["hit_rate"], 3),
                    "evictions": stats["evictions"],
                    "threads": torch.get_num_threads(),
                }
            ),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=None, help="table rows (default 8M; --policies 1M)")
    parser.add_argument("--batch-size", type=int, default=None, help="ids per batch (default 1M; --policies 256k)")
    parser.add_argument("--vocab", type=int, default=None, help="Zipf ranks (default: capacity)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    parser.add_argument("--warmup", type=int, default=None, help="batches mapped before timing (4; --policies 8)")
    parser.add_argument("--batches", type=int, default=None, help="timed batches per operation (5; --policies 9)")
    parser.add_argument("--eviction", choices=sorted(EVICTIONS), default="none", help="table eviction policy")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0 keeps torch's default")
    parser.add_argument("--device", default="cpu", help="device of the id table (default cpu)")
    parser.add_argument(
        "--index",
        choices=["auto", "torch"],
        default="auto",
        help="hash index: auto (FBGEMM's kernels on CPU), or torch ops (what CUDA/NPU tables use) for comparison",
    )
    parser.add_argument("--policies", action="store_true", help="compare admission/eviction policies (see above)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    defaults = (1 << 17, 1 << 17, 9, 8) if args.policies else (8 << 20, 1 << 20, 5, 4)
    for field, default in zip(("capacity", "batch_size", "batches", "warmup"), defaults, strict=True):
        if getattr(args, field) is None:
            setattr(args, field, default)
    if args.policies:
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        compare_policies(args)
        return
    if args.index == "torch":
        slot_index._use_fbgemm = lambda: False  # this benchmark's process only
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    vocab = args.vocab or args.capacity
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    ids = ZipfIds(vocab, args.zipf, args.seed)
    table = IdTable(args.capacity, device=device, eviction=EVICTIONS[args.eviction], name="bench")
    d: dict[int, int] = {}
    for _ in range(args.warmup):
        b = ids.batch(args.batch_size)
        table.find_or_insert(b.to(device))
        dict_find_or_insert(d, b)
    sync()

    common = {
        "bench": "id_table",
        "batch_size": args.batch_size,
        "capacity": args.capacity,
        "vocab": vocab,
        "zipf": args.zipf,
        "eviction": args.eviction,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "index": table.index_kind,
    }
    for op in ("find_or_insert", "find"):
        t_table = t_dict = 0.0
        inserts_before, dict_before = table.stats()["inserts"], len(d)
        for _ in range(args.batches):
            b = ids.batch(args.batch_size)
            b_dev = b.to(device)
            sync()  # the copy is not timed
            if op == "find_or_insert":
                _, t = timed(table.find_or_insert, b_dev, sync=sync)
                _, u = timed(dict_find_or_insert, d, b)
            else:
                rows, t = timed(table.find, b_dev, sync=sync)
                expected, u = timed(dict_find, d, b)
                found, stored = rows.cpu() >= 0, expected >= 0
                # The dict never evicts: with an eviction policy the table holds a subset of its ids.
                if not torch.equal(found, stored) if args.eviction == "none" else bool((found & ~stored).any()):
                    raise AssertionError("IdTable.find and the dict disagree on which ids are stored")
            t_table += t
            t_dict += u
        n = args.batches * args.batch_size
        line = dict(
            common,
            op=op,
            ids_per_s=round(n / t_table),
            baseline="python_dict",
            baseline_ids_per_s=round(n / t_dict),
            ratio=round(t_dict / t_table, 2),
            table_size=len(table),
        )
        if op == "find_or_insert":
            inserts = table.stats()["inserts"] - inserts_before
            line["new_ids_per_batch"] = round(inserts / args.batches)
            if args.eviction == "none" and (len(table) != len(d) or inserts != len(d) - dict_before):
                raise AssertionError(
                    f"IdTable holds {len(table)} ids after {inserts} inserts, the dict {len(d)} after "
                    f"{len(d) - dict_before}"
                )
        print(json.dumps(line), flush=True)

    print(
        json.dumps(
            dict(
                common,
                op="memory",
                bytes_per_id_at_capacity=round(table.memory_bytes / table.capacity, 2),
                bytes_per_stored_id=round(table.memory_bytes / max(len(table), 1), 2),
                table_size=len(table),
                target_bytes_per_id=48,
            )
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
