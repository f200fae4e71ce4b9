"""Bad or unusual input on one rank of a sharded HashEBC: a named error on every rank, fast.

A bad batch on one rank must not leave its peers in the id all-to-all until the process-group
timeout: every rank raises within seconds. Empty batches and any key order train normally.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from sharding_models import SparseNN, shard, sharded_hash_ebc, tables
from torchrec.distributed.planner import ParameterConstraints
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data import Batch
from recsdk.data.testing import run_distributed
from recsdk.embedding import HashEmbeddingBagConfig

ROW_WISE = {n: ParameterConstraints(sharding_types=["row_wise"]) for n in ("t0", "t1")}
TABLE_WISE = {n: ParameterConstraints(sharding_types=["table_wise"]) for n in ("t0", "t1")}
MIXED = {
    "t0": ParameterConstraints(sharding_types=["row_wise"]),
    "t1": ParameterConstraints(sharding_types=["table_wise"]),
}
PLANS = {"row_wise": ROW_WISE, "table_wise": TABLE_WISE, "mixed": MIXED}
# Far below the process-group timeout of run_distributed (its default), which a hang would hit.
FAST_S = 10.0


def _model(plan: str, capacity: int = 256, **policies) -> torch.nn.Module:
    torch.manual_seed(0)
    model = SparseNN(tables(capacity=capacity, dims=(8, 8), **policies), num_dense=4, device="meta")
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.01, "eps": 0.1})
    return shard(model, batch_size=8, constraints=PLANS[plan])


def _batch(n: int, seed: int, keys: tuple[str, ...] = ("f0", "f1")) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(keys) * n,), generator=g)
    ids = torch.randint(-(2**62), 2**62, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor(keys=list(keys), values=ids, lengths=lengths)
    return Batch(torch.randn(n, 4, generator=g), kjt, torch.randint(0, 2, (n,), generator=g).float())


def _train(model: torch.nn.Module, batch: Batch | SimpleNamespace) -> float:
    loss, _ = model(batch)
    loss.backward()
    return float(loss)


def _bad_kjt(kjt: KeyedJaggedTensor, fault: str) -> KeyedJaggedTensor:
    """``kjt`` (keys f0, f1; 8 samples) made bad in one way."""
    values, lengths = kjt.values(), kjt.lengths()
    one = torch.ones(8, dtype=lengths.dtype)
    if fault == "unknown_last":
        return KeyedJaggedTensor(
            ["f0", "f1", "zzz"], torch.cat([values, torch.tensor([5])]), lengths=torch.cat([lengths, one])
        )
    if fault == "unknown_first":
        return KeyedJaggedTensor(
            ["zzz", "f0", "f1"], torch.cat([torch.tensor([5]), values]), lengths=torch.cat([one, lengths])
        )
    if fault == "missing":
        f0 = kjt["f0"]
        return KeyedJaggedTensor(keys=["f0"], values=f0.values(), lengths=f0.lengths())
    if fault == "repeated":
        return KeyedJaggedTensor(
            ["f0", "f1", "f1"], torch.cat([values, torch.tensor([5])]), lengths=torch.cat([lengths, one])
        )
    if fault == "short_lengths":  # lengths sum to fewer than the ids
        return KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat([values, torch.tensor([1, 2, 3])]), lengths=lengths)
    if fault == "lengths_count":  # 15 lengths for 2 features x 8 samples
        return KeyedJaggedTensor(
            keys=kjt.keys(), values=values[: int(lengths[:15].sum())], lengths=lengths[:15], stride=8
        )
    if fault == "ids_2d":
        return KeyedJaggedTensor(keys=kjt.keys(), values=values.view(-1, 1), lengths=lengths)
    if fault == "vbe":  # a variable batch per feature: 8 samples of f0, 4 of f1
        f0, f1 = kjt["f0"], kjt["f1"]
        return KeyedJaggedTensor(
            keys=kjt.keys(),
            values=torch.cat([f0.values(), f1.values()[: int(f1.lengths()[:4].sum())]]),
            lengths=torch.cat([f0.lengths(), f1.lengths()[:4]]),
            stride_per_key_per_rank=[[8], [4]],
            inverse_indices=(kjt.keys(), torch.stack([torch.arange(8), torch.arange(8) % 4])),
        )
    raise AssertionError(fault)  # fmt: skip


BAD = {
    "unknown_last": ("ValueError", "unknown ['zzz']"),
    "unknown_first": ("ValueError", "unknown ['zzz']"),
    "missing": ("ValueError", "missing ['f1']"),
    "repeated": ("ValueError", "repeat ['f1']"),
    "short_lengths": ("ValueError", "sum to"),
    "lengths_count": ("ValueError", "15 lengths for 2 features x stride 8"),
    "ids_2d": ("ValueError", "must be 1-D, got shape"),
    "vbe": ("ValueError", "variable batch per feature"),
}


def _id_tables(model: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """Per table shard: ids stored, inserts, lookups."""
    stats = {name: table.stats() for name, table in sharded_hash_ebc(model).id_tables.items()}
    return {name: (s["size"], s["inserts"], s["lookups"]) for name, s in stats.items()}


def _bad_batches_on_rank0(rank: int, world_size: int, plan: str) -> dict:
    """Each bad batch on rank 0 beside a good one on rank 1, then a good step on both."""
    model = _model(plan)
    _train(model, _batch(8, seed=rank))  # a good first batch builds the input dists
    out = {}
    for i, fault in enumerate(BAD):
        batch = _batch(8, seed=10 + 2 * i + rank)
        if rank == 0:  # past Batch's own checks, as a user's batch type might be
            batch = SimpleNamespace(
                dense_features=batch.dense_features,
                sparse_features=_bad_kjt(batch.sparse_features, fault),
                labels=batch.labels,
            )
        before = _id_tables(model)
        start = time.monotonic()
        try:
            _train(model, batch)
            out[fault] = {"error": None}
        except Exception as e:
            out[fault] = {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
        out[fault]["id_tables_unchanged"] = _id_tables(model) == before  # on the healthy rank too
        _train(model, _batch(8, seed=100 + i + rank))  # and the next good batch trains
    # A bad batch whose output nobody waits for (a warm-up call, a dropped result): the flag is
    # still read, so the next call raises on every rank rather than hanging.
    batch = _batch(8, seed=200 + rank)
    sharded_hash_ebc(model)(_bad_kjt(batch.sparse_features, "missing") if rank == 0 else batch.sparse_features)
    start = time.monotonic()
    try:
        _train(model, _batch(8, seed=300 + rank))
        out["unread"] = {"error": None}
    except Exception as e:
        out["unread"] = {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    _train(model, _batch(8, seed=400 + rank))
    return out


def test_bad_batches_on_one_rank_raise_named_errors_on_every_rank_and_training_goes_on() -> None:
    own, peer = run_distributed(_bad_batches_on_rank0, 2, "mixed", timeout_s=120)
    for fault, (error, expected) in BAD.items():
        mine, theirs = own[fault], peer[fault]
        assert mine["error"] == error and expected in mine["message"], (fault, mine)
        assert "HashEmbeddingBagCollection" in mine["message"], (fault, mine)
        assert theirs["error"] == "PeerFailureError", (fault, theirs)
        assert "failed on rank(s) [0]" in theirs["message"] and expected in theirs["message"], (fault, theirs)
        assert mine["seconds"] < FAST_S and theirs["seconds"] < FAST_S, (fault, mine, theirs)
        # The failed step changed no id table on either rank: the healthy one mapped nothing.
        assert mine["id_tables_unchanged"] and theirs["id_tables_unchanged"], (fault, mine, theirs)
    assert own["unread"]["error"] == "ValueError" and "missing ['f1']" in own["unread"]["message"], own
    assert peer["unread"]["error"] == "PeerFailureError" and "missing ['f1']" in peer["unread"]["message"], peer
    assert own["unread"]["seconds"] < FAST_S and peer["unread"]["seconds"] < FAST_S, (own, peer)


def _dtypes_differ_across_ranks(rank: int, world_size: int, plan: str) -> dict:
    """Rank 0 sends int32 ids, float64 weights on an unweighted module (ignored, as unsharded);
    rank 1 int64 ids above 2**32: every id must be stored whole, and the weights change nothing."""
    model = _model(plan)
    ids = torch.arange(1, 9, dtype=torch.int32) if rank == 0 else torch.arange(8) + 2**40
    lengths = torch.ones(8, dtype=torch.int64)
    plain = KeyedJaggedTensor(keys=["f0", "f1"], values=ids, lengths=lengths)
    weighted = KeyedJaggedTensor(
        keys=["f0", "f1"], values=ids, lengths=lengths, weights=torch.full((8,), 3.0, dtype=torch.float64)
    )
    dense = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    labels = torch.zeros(4)
    _train(model, SimpleNamespace(dense_features=dense, sparse_features=weighted, labels=labels))
    model.eval()
    with torch.no_grad():
        a = model(SimpleNamespace(dense_features=dense, sparse_features=plain, labels=labels))[1]
        b = model(SimpleNamespace(dense_features=dense, sparse_features=weighted, labels=labels))[1]
    sebc = sharded_hash_ebc(model)
    stored = sorted(int(i) for t in sebc.id_tables.values() for i in t.ids_and_rows()[0])
    return {"stored": stored, "same_output": bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))}  # fmt: skip


@pytest.mark.parametrize("plan", ["row_wise", "table_wise"])
def test_ranks_may_send_other_id_and_weight_dtypes(plan: str) -> None:
    results = run_distributed(_dtypes_differ_across_ranks, 2, plan, timeout_s=90)
    sent = set(range(1, 9)) | {2**40 + i for i in range(8)}
    assert sorted(i for r in results for i in r["stored"]) == sorted(sent), results
    assert all(r["same_output"] for r in results), results


def _shuffled_keys(rank: int, world_size: int, plan: str) -> list[float]:
    """Train with the keys in one order, then the other: the same model as always one order."""
    losses = []
    for order in (("f0", "f1"), ("f1", "f0"), ("f0", "f1")):
        model = _model(plan)
        step_losses = []
        for step in range(3):
            batch = _batch(8, seed=100 * rank + step)
            if step == 1:  # the second batch comes with its keys in `order`
                kjt = batch.sparse_features
                kjt = kjt.permute([kjt.keys().index(k) for k in order])
                batch = Batch(batch.dense_features, kjt, batch.labels)
            step_losses.append(_train(model, batch))
        losses.append(step_losses)
    return losses


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_any_key_order_works_on_every_plan(plan: str) -> None:
    for same, swapped, again in run_distributed(_shuffled_keys, 2, plan, timeout_s=120):
        assert swapped == same == again


def _empty_batch_on_rank0(rank: int, world_size: int, plan: str) -> dict:
    model = _model(plan)
    losses = []
    for step in range(3):
        batch = _batch(0 if rank == 0 else 8, seed=100 * rank + step)
        losses.append(_train(model, batch))
    stored = {name: len(t) for name, t in sharded_hash_ebc(model).id_tables.items()}
    return {"losses": losses, "stored": stored}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_a_rank_with_an_empty_batch_trains(plan: str) -> None:
    empty, full = run_distributed(_empty_batch_on_rank0, 2, plan, timeout_s=90)
    assert all(loss == loss for loss in full["losses"])  # finite, not NaN
    # Rank 1's ids were stored (on whichever rank owns them); the empty rank contributed none.
    assert sum(empty["stored"].values()) + sum(full["stored"].values()) > 0


def _table_full(rank: int, world_size: int) -> str:
    model = _model("row_wise", capacity=16)  # 8 rows per rank, no eviction
    try:
        for step in range(20):
            _train(model, _batch(8, seed=100 * rank + step))
    except Exception as e:
        return str(e)
    return ""


def test_a_full_sharded_table_names_the_users_table_and_its_share() -> None:
    messages = run_distributed(_table_full, 2, timeout_s=90)
    own = next(m for m in messages if m.startswith("table 't"))
    assert "num_embeddings of table 't" in own and "@rank" not in own.split(". Raise", 1)[-1], own
    assert "of the table's 16 rows" in own, own


def _without_f1(batch: Batch) -> Batch:
    """The batch without feature ``f1`` (a bad batch: the module's features are f0 and f1)."""
    f0 = batch.sparse_features["f0"]
    kjt = KeyedJaggedTensor(keys=["f0"], values=f0.values(), lengths=f0.lengths())
    return Batch(batch.dense_features, kjt, batch.labels)


def _flag_steps(rank: int, world_size: int, plan: str, empty_peer: bool) -> dict:
    """A good step, counting the all-reduces it issues (the host stage's agreement would be one),
    then a bad batch on rank 0 (beside an empty batch on rank 1 with ``empty_peer``: that rank
    receives no embedding rows in the output dist, only the header rows with the flags)."""
    model = _model(plan)
    _train(model, _batch(8, seed=rank))  # builds the input dists
    calls = []
    all_reduce = torch.distributed.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        _train(model, _batch(8, seed=10 + rank))
    finally:
        torch.distributed.all_reduce = all_reduce
    batch = _batch(0 if empty_peer and rank == 1 else 8, seed=20 + rank)
    if rank == 0:
        batch = _without_f1(batch)
    try:
        _train(model, batch)
    except Exception as e:
        return {"all_reduces": len(calls), "error": type(e).__name__, "message": str(e)}
    return {"all_reduces": len(calls), "error": None, "message": ""}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_the_output_dists_carry_the_host_stages_flag(plan: str) -> None:
    """On gloo the inline host stage's failure flag rides in the pooled output dist's all-to-all:
    a good step issues no all-reduce for it, and a bad batch on one rank still fails both, also
    where the other rank's batch is empty."""
    own, peer = run_distributed(_flag_steps, 2, plan, True, timeout_s=90)
    assert own["all_reduces"] == peer["all_reduces"] == 0, (own, peer)
    assert own["error"] == "ValueError" and "missing ['f1']" in own["message"], own
    assert peer["error"] == "PeerFailureError" and "failed on rank(s) [0]" in peer["message"], peer


def test_a_table_wise_rank_without_tables_agrees_by_all_reduce() -> None:
    """Three ranks, two table-wise tables: one rank sends no columns, so the table-wise dist
    cannot carry the flag; the agreement's all-reduce does, and a failure still fails all."""
    ranks = run_distributed(_flag_steps, 3, "table_wise", False, timeout_s=120)
    assert [r["all_reduces"] for r in ranks] == [1, 1, 1], ranks
    assert [r["error"] for r in ranks] == ["ValueError", "PeerFailureError", "PeerFailureError"], ranks


def _unmappable_layouts(rank: int, world_size: int) -> dict[str, str]:
    """Layouts the host stage cannot map: every rank refuses them at sharding, by name."""
    shared = [
        HashEmbeddingBagConfig(name=name, embedding_dim=8, num_embeddings=64, feature_names=["f"])
        for name in ("a", "b")
    ]
    out = {}
    for case, configs, plan in [
        ("shared_feature", shared, ROW_WISE),
        ("shard_without_rows", tables(capacity=1, dims=(8, 8)), ROW_WISE),
    ]:
        model = SparseNN(configs, num_dense=4, device="meta")
        try:
            shard(model, batch_size=8, constraints=plan)
            out[case] = "built"
        except ValueError as e:
            out[case] = str(e)
    return out


def test_layouts_the_host_stage_cannot_map_are_refused_on_every_rank() -> None:
    for r in run_distributed(_unmappable_layouts, 2, timeout_s=90):
        assert "feature 'f' is read by tables ['a', 'b']" in r["shared_feature"], r
        assert "table 't0'" in r["shard_without_rows"] and "num_embeddings=1" in r["shard_without_rows"], r
