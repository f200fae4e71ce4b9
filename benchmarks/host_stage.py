"""The host side of a training step: its core time, its parts, and how much of it holds the GIL.

One rank, 26 Criteo-like features (each its own table; ids Zipf-distributed over universes spread
log-evenly from 1,000 to 10,000,000 ids; every table admits an id at its second sighting and
evicts the least recently used), batch 16,384, one id per feature and sample: 426k ids a step.
The model is recsdk's ``HashEmbeddingBagCollection`` sharded by recsdk's hybrid sharders
(``--layout row_wise`` / ``table_wise``), publishing tracked (a ``Publisher`` would read the
change trackers). The tables are warmed up to their steady state (the big ones full and
evicting) before anything is measured.

A step is what the pipeline does with a batch: its host stage (``input_dist`` with its waits
and ``post_input_dist``: what the pipeline's host thread runs) and then
``compute_and_output_dist`` (on the training thread: the host parts before the lookup, then the
lookup and output dist). Per layout one JSON line:

- ``host_ms_per_step``: core time of the host work (thread time, one intra-op thread), every
  part below; not the lookup, output dist and row resets (``device_ms_per_step``: device work,
  run here on CPU tensors);
- ``gil_ms_per_step``: how long the host stage holds the GIL. On a GPU the training thread is in
  Python most of a step, so this is the host work that cannot overlap it. Measured by sampling
  (``gil_measured_by``: ``"sampler"``): ``py-spy record --gil`` samples this process from
  outside at 1 kHz, only the threads holding the GIL, and the samples whose stack passes through
  the host stage are its GIL time (``_gil_sampler.py``); ``gil_sampler_reads`` is what it reads,
  as a share of the core time, on a Python loop that holds the GIL throughout (1.0 when exact)
  and on one large sort that releases it (0.0). Where py-spy is missing or may not attach
  (``gil_sampler`` says why), the probe's figure stands in (``gil_measured_by``: ``"probe"``);
- ``gil_ms_by_part``: the sampled GIL time split by part, each sample to the innermost part it is
  in (exclusive, unlike ``parts_ms``; ``other``: in no part);
- ``gil_probe_ms_per_step``: the same, read by a probe thread that spins in Python meanwhile:
  ``wall * (1 - probe rate during / probe rate alone)`` (at a 50 us switch interval, so that the
  probe delays the host stage little; ``gil_probe_reads`` is its reading of the known work; it
  competes with what it measures for the GIL and the cores, and reads high on a busy machine);
- ``parts_ms``: per part (``a/b`` is part of ``a``): ``input_checks``, ``bucketing``,
  ``id_exchange``, ``mapping`` (``find_or_insert`` with the index ``lookup``, ``admission``,
  ``eviction`` (``choose``: the victims, ``free``: freeing them) and ``place``: new ids into their
  rows; ``change_tracking``, ``row_indices``: building the KJTs of rows, ``ledger``: pinning the
  batch's rows), ``compute_host`` (before the lookup: ``ledger``, ``change_tracking``,
  ``copies`` to the device);
- ``torch_calls_per_step``: the torch calls Python makes in the host work of a step (functions,
  tensor methods and operators, ``torch.ops`` kernels; counted on the calling thread, so only with
  ``--host-threads 1``), and ``torch_calls`` by part (a part's own calls, ``other``: outside the
  parts). Each holds the GIL for a few microseconds of Python overhead, so on a GPU, where the
  training thread needs the GIL to launch kernels, the count bounds how far the host work can
  overlap it; unlike the times, it does not depend on the machine or its load;
- ``bucketing_ms_at``: bucketing the step's ids for ``--bucket-ranks`` owners, in isolation (a
  rank of a bigger job does that much; with one rank nothing is bucketed);
- the TorchRec baseline, measured in the same run: TorchRec's ``EmbeddingBagCollection`` on the
  same ids remapped offline, its host work per step (its input dist), and ``ratio``:
  TorchRec's host ms over recsdk's (1.0: as little host work as TorchRec).

Medians over ``--rounds`` rounds that alternate recsdk and TorchRec. Targets (issue #35): host
ms <= 10, GIL ms <= 4 on this machine's one core.

    python benchmarks/host_stage.py [--layout row_wise table_wise] [--batch-size 16384]
        [--features 26] [--steps 8] [--warmup 30] [--rounds 5] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _common import DLRM, device_of, feature_names, remap_ids, shard
from _gil_sampler import GilSampler, sampler_or_why
from torch import nn
from torch.overrides import TorchFunctionMode
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch, RandomRecDataset
from recsdk.data.device import backend_for
from recsdk.data.testing import free_port
from recsdk.embedding import CountAdmission, HashEmbeddingBagCollection, HashEmbeddingBagConfig, IdTable, LRUEviction
from recsdk.embedding.change_tracker import RowChangeTracker
from recsdk.embedding.id_table_admission import IdTableAdmission
from recsdk.embedding.id_table_eviction import IdTableEviction
from recsdk.embedding.id_table_step import IdTableSteps
from recsdk.embedding.row_map import RowMap
from recsdk.sharding import get_default_hybrid_sharders, sharded_hash_modules
from recsdk.sharding.distribution import input_dist as input_dist_module
from recsdk.sharding.host import host_shards as host_shards_module
from recsdk.sharding.host.host_shards import HostShards
from recsdk.sharding.host.host_stage import IdMappingStage
from recsdk.sharding.host.row_ledger import RowLedger

NUM_DENSE = 13
WARMUP_SCALE = 4  # the warm-up's batches are this many times larger
PROBE_SWITCH_INTERVAL_S = 5e-5  # while the GIL probe spins (Python's default: 5 ms)
# The host stage's frames, for the sampler: the stage on the calling thread, and a table's mapping
# on a worker thread (with --host-threads above 1; on the calling thread it is inside the first).
HOST_STAGE_FRAMES = ("_host_stage", "map_table")


class Parts:
    """Thread time per named part, inclusive of the parts called inside it, and which parts the
    main thread is inside now (``stack``, kept while ``on`` or ``tracking``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False
        self.tracking = False
        self.stack: list[str] = []
        self.functions: dict[str, str] = {}  # the function's name as a sampled stack shows it -> part

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time every call of ``owner.attr`` (a class's method or a module's function) as ``name``."""
        original = getattr(owner, attr)
        self.functions[f"{owner.__name__}.{attr}" if isinstance(owner, type) else attr] = name

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not (self.on or self.tracking) or threading.current_thread() is not threading.main_thread():
                return original(*args, **kwargs)
            start = time.thread_time()
            self.stack.append(name)
            try:
                return original(*args, **kwargs)
            finally:
                self.stack.pop()
                if self.on:
                    self.seconds[name] += time.thread_time() - start

        setattr(owner, attr, timed)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = time.thread_time()
        try:
            yield
        finally:
            if self.on:
                self.seconds[name] += time.thread_time() - start


PARTS = Parts()


def _instrument() -> None:
    """Time the host stage's parts (the names ``parts_ms`` reports)."""
    w = PARTS.wrap
    w(HostShards, "guard", "input_checks")
    w(input_dist_module, "bucketize_by_owner_with_permute", "bucketing")
    w(IdMappingStage, "map", "mapping")
    w(IdTable, "find_or_insert", "mapping/find_or_insert")
    w(RowMap, "lookup", "mapping/find_or_insert/lookup")
    w(IdTableAdmission, "decide", "mapping/find_or_insert/admission")
    w(IdTableAdmission, "count", "mapping/find_or_insert/admission.count")
    w(IdTableEviction, "check_room", "mapping/find_or_insert/eviction")
    w(IdTableEviction, "choose", "mapping/find_or_insert/eviction.choose")
    w(IdTableSteps, "free_evicted", "mapping/find_or_insert/eviction.free")
    w(RowMap, "place", "mapping/find_or_insert/place")
    w(RowChangeTracker, "placed", "change_tracking")
    w(RowChangeTracker, "freed", "change_tracking")
    w(RowChangeTracker, "changed", "change_tracking")
    w(RowLedger, "hold", "ledger.hold")
    w(RowLedger, "release_finished", "ledger.release")
    w(RowLedger, "start_compute", "ledger.start_compute")
    w(HostShards, "begin_compute", "compute_host")
    w(host_shards_module, "reset_rows_", "device.resets")


def _universes(features: int) -> list[int]:
    return [round(float(u)) for u in np.geomspace(1_000, 10_000_000, features)]


def _rows(universe: int) -> int:
    return min(2 * universe, 65_536)


def _batches(args: argparse.Namespace, num: int, scale: int = 1, sample_seed: int = 0) -> list[Batch]:
    """``num`` batches of ``scale`` times the batch size (the warm-up's are larger: the tables fill)."""
    dataset = RandomRecDataset(
        batch_size=scale * args.batch_size,
        num_batches=num,
        feature_names=feature_names(args.features),
        id_ranges=_universes(args.features),
        num_dense_features=NUM_DENSE,
        pooling_factors=1.0,
        id_distribution="zipf",
        zipf_alpha=1.05,
        seed=0,
        sample_seed=sample_seed,
        rank=0,
        world_size=1,
    )
    return list(dataset)


def _hash_model(args: argparse.Namespace, layout: str, host: ShardingEnv, device: torch.device) -> nn.Module:
    features = feature_names(args.features)
    configs = [
        HashEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=args.dim,
            num_embeddings=_rows(u),
            feature_names=[f],
            admission=CountAdmission(threshold=2),
            eviction=LRUEviction(),
        )
        for i, (f, u) in enumerate(zip(features, _universes(args.features), strict=True))
    ]
    model = DLRM(HashEmbeddingBagCollection(tables=configs, device=torch.device("meta")), features, args.dim)
    constraints = {c.name: ParameterConstraints(sharding_types=[layout]) for c in configs}
    sharders = get_default_hybrid_sharders(host_env=host, host_threads=args.host_threads)
    dmp, _ = shard(model, sharders, constraints, args.batch_size, device=device)
    return dmp


def _torchrec_model(
    args: argparse.Namespace, layout: str, host: ShardingEnv, device: torch.device, rows: list[int]
) -> nn.Module:
    """TorchRec's model for the remapped ids: ``rows[i]`` rows in table ``i`` (its distinct ids)."""
    features = feature_names(args.features)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=n, feature_names=[f])
        for i, (f, n) in enumerate(zip(features, rows, strict=True))
    ]
    model = DLRM(EmbeddingBagCollection(tables=configs, device=torch.device("meta")), features, args.dim)
    constraints = {c.name: ParameterConstraints(sharding_types=[layout]) for c in configs}
    dmp, _ = shard(model, get_default_hybrid_sharders(host_env=host), constraints, args.batch_size, device=device)
    return dmp


def _sharded_ebc(dmp: nn.Module) -> Any:
    for module in dmp.modules():
        if hasattr(module, "input_dist") and hasattr(module, "compute_and_output_dist"):
            return module
    raise RuntimeError("no sharded embedding module in the model")


def _host_stage(module: Any, kjt: KeyedJaggedTensor) -> tuple[Any, Any]:
    """What the pipeline's host thread does with a batch: its input dist and mapping."""
    ctx = module.create_context()
    received = module.input_dist(ctx, kjt).wait().wait()
    return ctx, module.post_input_dist(ctx, received)


def _compute(module: Any, ctx: Any, mapped: Any, device: torch.device) -> None:
    out = module.compute_and_output_dist(ctx, mapped).wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    del out


class TorchCalls(TorchFunctionMode):
    """Counts the torch calls made from Python on the main thread (functions, tensor methods and
    operators, ``torch.ops`` kernels; not attribute reads such as ``.shape``), by the innermost
    part running (:class:`Parts`), while ``host_stage`` is set or a ``compute_host`` part runs,
    outside ``device.resets``. Each such call holds the GIL for its Python overhead (microseconds),
    whatever the kernel does after."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = defaultdict(int)
        self.host_stage = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        stack = PARTS.stack
        if getattr(func, "__name__", "") != "__get__" and "device.resets" not in stack:
            if self.host_stage or "compute_host" in stack:
                self.counts[stack[-1] if stack else "other"] += 1
        return func(*args, **(kwargs or {}))


def _count_torch_calls(module: Any, batches: list[Batch], device: torch.device) -> dict[str, Any]:
    """Torch calls per step of the host stage and the compute's host part, in total and by part
    (each part's own calls, not those of the parts inside it; ``other``: outside every part)."""
    PARTS.tracking = True
    try:
        with TorchCalls() as calls:
            for batch in batches:
                calls.host_stage = True
                ctx, mapped = _host_stage(module, batch.sparse_features)
                calls.host_stage = False
                _compute(module, ctx, mapped, device)
    finally:
        PARTS.tracking = False
    steps = len(batches)
    return {
        "torch_calls_per_step": round(sum(calls.counts.values()) / steps),
        "torch_calls": {k: round(v / steps) for k, v in sorted(calls.counts.items())},
    }


class Probe:
    """A thread that spins in Python and counts: how far it falls behind its rate alone is the
    time other threads held the GIL."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _spin(self) -> None:
        stop = self._stop
        while not stop.is_set():
            for _ in range(200):
                self.count += 1

    def __enter__(self) -> Probe:
        self._stop.clear()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def rate_alone(self, seconds: float = 0.2) -> float:
        with self:
            time.sleep(0.02)
            c0, t0 = self.count, time.perf_counter()
            time.sleep(seconds)
            return (self.count - c0) / (time.perf_counter() - t0)


@contextlib.contextmanager
def _spinning_probe() -> Iterator[tuple[Probe, float]]:
    """A probe spinning at :data:`PROBE_SWITCH_INTERVAL_S`, and its rate alone (counts per second)
    at that interval; Python's switch interval is restored after."""
    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(PROBE_SWITCH_INTERVAL_S)
    try:
        rate = Probe().rate_alone()
        with Probe() as probe:
            time.sleep(0.01)
            yield probe, rate
    finally:
        sys.setswitchinterval(previous_interval)


def _measure_hash(
    module: Any,
    batches: list[Batch],
    probed: list[Batch],
    device: torch.device,
    clock: Any,
    sampler: GilSampler | None,
    sampled: list[Batch],
) -> dict[str, Any]:
    """One round: host and device ms per step and the parts over ``batches``, the GIL held over
    ``probed`` by the probe and over ``sampled`` by the sampler (as many other batches each:
    batches seen again would find their ids admitted).

    ``clock``: the core time to count (this thread's; the process's when tables map on several
    threads)."""
    steps = len(batches)
    PARTS.seconds.clear()
    PARTS.on = True
    host = device_s = 0.0
    for batch in batches:
        t0 = clock()
        ctx, mapped = _host_stage(module, batch.sparse_features)
        t1 = clock()
        lookups_before = PARTS.seconds["compute_host"] + PARTS.seconds["device.resets"]
        _compute(module, ctx, mapped, device)
        t2 = clock()
        in_compute_host = PARTS.seconds["compute_host"] + PARTS.seconds["device.resets"] - lookups_before
        host += (t1 - t0) + in_compute_host
        device_s += (t2 - t1) - in_compute_host
    PARTS.on = False
    parts = dict(PARTS.seconds)
    resets = parts.pop("device.resets", 0.0)
    host -= resets  # resets run inside compute_host: device work
    device_s += resets
    # The GIL: the host stage again (the tables keep stepping), with the probe spinning. Every
    # time the host stage takes the GIL back from the probe it waits for a switch; at a short
    # switch interval that wait is short, and the probe counts it as its own time anyway.
    wall = 0.0
    with _spinning_probe() as (probe, probe_rate):
        c0 = probe.count
        for batch in probed:
            t0 = time.perf_counter()
            ctx, mapped = _host_stage(module, batch.sparse_features)
            wall += time.perf_counter() - t0
            probe_pause = probe.count
            _compute(module, ctx, mapped, device)
            c0 += probe.count - probe_pause  # the compute's share of the probe does not count
        counted = probe.count - c0
    gil = max(0.0, wall - counted / probe_rate)
    gil_sampled, gil_parts = None, {}
    if sampler is not None:  # the host stage's stacks while they hold the GIL, from outside
        with sampler.sampling() as samples:
            for batch in sampled:
                ctx, mapped = _host_stage(module, batch.sparse_features)
                _compute(module, ctx, mapped, device)
        gil_sampled = 1e3 * samples.held_s(*HOST_STAGE_FRAMES) / len(sampled)
        by_part = samples.held_s_by(PARTS.functions, HOST_STAGE_FRAMES)
        gil_parts = {part: 1e3 * s / len(sampled) for part, s in by_part.items()}
    out = {
        "host_ms_per_step": 1e3 * host / steps,
        "gil_ms_per_step": gil_sampled if gil_sampled is not None else 1e3 * gil / steps,
        "gil_probe_ms_per_step": 1e3 * gil / steps,
        "gil_parts_ms": gil_parts,
        "host_stage_wall_ms_per_step": 1e3 * wall / steps,
        "device_ms_per_step": 1e3 * device_s / steps,
        "parts_ms": {k: round(1e3 * v / steps, 2) for k, v in sorted(parts.items())},
    }
    # The exchange is what input_dist does besides checking and bucketing.
    return out


def _probed_gil_ms(work: Any) -> tuple[float, float]:
    """``work()``'s core ms, and the ms the probe counts as GIL held during it."""
    start = time.thread_time()
    work()
    core = time.thread_time() - start
    with _spinning_probe() as (probe, rate):
        c0, w0 = probe.count, time.perf_counter()
        work()
        wall, counted = time.perf_counter() - w0, probe.count - c0
    return 1e3 * core, 1e3 * max(0.0, wall - counted / rate)


def _known_work() -> dict[str, Any]:
    """Work known to hold the GIL throughout (a Python loop) and work that releases it (one large
    torch sort), by name; each function is named as its key (the sampler finds it by name)."""

    def python_loop() -> None:
        total = 0
        for i in range(2_000_000):
            total += i

    values = torch.randn(2_000_000)

    def native_op() -> None:
        torch.sort(values)

    return {"python_loop": python_loop, "native_op": native_op}


def _probe_calibration() -> dict[str, float]:
    """The probe's reading, as a share of the core time, on the known work (exact: 1.0 for the
    Python loop, 0.0 for the sort)."""
    out = {}
    for name, work in _known_work().items():
        core, gil = _probed_gil_ms(work)
        out[name] = round(gil / core, 2)
    return out


def _sampler_calibration(sampler: GilSampler | None) -> dict[str, float] | None:
    """The sampler's reading, as a share of the core time, on the known work (None: no sampler)."""
    if sampler is None:
        return None
    out = {}
    for name, work in _known_work().items():
        start = time.thread_time()
        with sampler.sampling() as samples:
            work()
        core = time.thread_time() - start
        out[name] = round(samples.held_s(name) / core, 2)
    return out


def _measure_input_dist(module: Any, kjts: list[KeyedJaggedTensor], device: torch.device) -> float:
    """TorchRec's host work per step: its input dist (bucketing and the id all-to-all; on a GPU
    the launches of its device work), ms of core time."""
    start = time.thread_time()
    for kjt in kjts:
        ctx = module.create_context()
        module.input_dist(ctx, kjt).wait().wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.thread_time() - start) / len(kjts)


def _bucketing_at(kjts: list[KeyedJaggedTensor], ranks: int) -> float:
    start = time.thread_time()
    for kjt in kjts:
        input_dist_module.bucketize_by_owner_with_permute(kjt, ranks)
    return 1e3 * (time.thread_time() - start) / len(kjts)


def _run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    device = device_of(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group(backend=backend_for(device), rank=0, world_size=1)
    host = ShardingEnv(world_size=1, rank=0, pg=dist.new_group(backend="gloo"))
    _instrument()
    # Every pass maps batches of its own: per round one chunk timed, one probed and one sampled,
    # then one counted.
    num = args.warmup + args.steps * (3 * args.rounds + 1)
    batches = _batches(args, num)
    warmup = _batches(args, args.warmup, scale=WARMUP_SCALE, sample_seed=1)
    remapped = remap_ids([batches], feature_names(args.features))[0]
    distinct = [
        max(int(b.sparse_features[f].values().max()) + 1 for b in remapped) for f in feature_names(args.features)
    ]
    calibration = _probe_calibration()
    sampler, sampler_why = sampler_or_why()
    sampler_calibration = _sampler_calibration(sampler)
    for layout in args.layout:
        hash_dmp = _hash_model(args, layout, host, device)
        (hash_module,) = sharded_hash_modules(hash_dmp).values()
        hash_module.track_changes()  # as under a Publisher
        hash_module.train()
        torchrec_module = _sharded_ebc(_torchrec_model(args, layout, host, device, distinct))
        for batch in warmup:  # until the big tables are full and evict
            ctx, mapped = _host_stage(hash_module, batch.sparse_features)
            _compute(hash_module, ctx, mapped, device)
        stats_before = {n: t.stats() for n, t in hash_module.id_tables.items()}
        rounds: list[dict[str, Any]] = []
        baseline: list[float] = []
        for r in range(args.rounds):
            lo = args.warmup + 3 * r * args.steps
            chunk, probed, sampled = (batches[lo + i * args.steps : lo + (i + 1) * args.steps] for i in range(3))
            clock = time.thread_time if args.host_threads == 1 else time.process_time
            rounds.append(_measure_hash(hash_module, chunk, probed, device, clock, sampler, sampled))
            # TorchRec's input dist takes the batch on the device, where its pipeline copies it.
            kjts = [b.sparse_features.to(device) for b in remapped[lo : lo + args.steps]]
            baseline.append(_measure_input_dist(torchrec_module, kjts, device))
        stats = {n: t.stats() for n, t in hash_module.id_tables.items()}
        calls: dict[str, Any] = {"torch_calls_per_step": None, "torch_calls": None}  # workers' calls: unseen
        if args.host_threads == 1:
            calls = _count_torch_calls(hash_module, batches[-args.steps :], device)
        chunks = 3 if sampler is not None else 2  # each round maps its chunks: timed, probed, sampled
        measured_steps = chunks * args.rounds * args.steps
        inserts = sum(stats[n]["inserts"] - stats_before[n]["inserts"] for n in stats) / measured_steps
        evictions = sum(stats[n]["evictions"] - stats_before[n]["evictions"] for n in stats) / measured_steps
        host_ms = statistics.median(r["host_ms_per_step"] for r in rounds)
        parts = {
            k: round(statistics.median(r["parts_ms"].get(k, 0.0) for r in rounds), 2) for k in rounds[0]["parts_ms"]
        }
        line = {
            "benchmark": "host_stage",
            "layout": layout,
            "device": str(device),
            "host_threads": args.host_threads,
            "features": args.features,
            "batch_size": args.batch_size,
            "ids_per_step": int(batches[0].sparse_features.values().numel()),
            "inserts_per_step": round(inserts),
            "evictions_per_step": round(evictions),
            "host_ms_per_step": round(host_ms, 2),
            "gil_ms_per_step": round(statistics.median(r["gil_ms_per_step"] for r in rounds), 2),
            "gil_measured_by": "sampler" if sampler is not None else "probe",
            "gil_sampler": sampler_why,
            "gil_sampler_reads": sampler_calibration,
            "gil_probe_ms_per_step": round(statistics.median(r["gil_probe_ms_per_step"] for r in rounds), 2),
            "gil_ms_by_part": {
                k: round(statistics.median(r["gil_parts_ms"].get(k, 0.0) for r in rounds), 2)
                for k in sorted({k for r in rounds for k in r["gil_parts_ms"]})
            },
            "host_stage_wall_ms_per_step": round(
                statistics.median(r["host_stage_wall_ms_per_step"] for r in rounds), 2
            ),
            "device_ms_per_step": round(statistics.median(r["device_ms_per_step"] for r in rounds), 2),
            "parts_ms": parts,
            **calls,
            "bucketing_ms_at": {
                str(args.bucket_ranks): round(
                    _bucketing_at([b.sparse_features for b in batches[:3]], args.bucket_ranks), 2
                )
            },
            "baseline": "torchrec_input_dist",
            "baseline_host_ms_per_step": round(statistics.median(baseline), 2),
            "ratio": round(statistics.median(baseline) / host_ms, 3),
            "target_host_ms_per_step": 10,
            "target_gil_ms_per_step": 4,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "gil_probe_reads": calibration,
        }
        print(json.dumps(line), flush=True)
        del hash_dmp, hash_module, torchrec_module
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", nargs="+", default=["row_wise", "table_wise"], choices=["row_wise", "table_wise"])
    parser.add_argument("--features", type=int, default=26)
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps (of batches 4x larger)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-ranks", type=int, default=8, help="owners for the bucketing_ms_at line")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--host-threads", type=int, default=1, help="tables mapped at once (the sharders' host_threads)"
    )
    _run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
