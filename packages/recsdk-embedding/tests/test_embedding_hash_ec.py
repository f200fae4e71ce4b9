"""HashEmbeddingCollection: equivalence with TorchRec's EC, shared tables, raw ids, eval, meta, bad input."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig, JaggedTensor, KeyedJaggedTensor

from recsdk.embedding import (
    CountAdmission,
    HashEmbeddingBagConfig,
    HashEmbeddingCollection,
    HashEmbeddingConfig,
    IdTable,
    LRUEviction,
    TableFullError,
)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
KEYS = ["hist", "cand", "c"]
DIM = 8


def _configs(**policy: Any) -> list[HashEmbeddingConfig]:
    return [
        HashEmbeddingConfig(
            name="item", embedding_dim=DIM, num_embeddings=64, feature_names=["hist", "cand"], **policy
        ),
        HashEmbeddingConfig(name="t1", embedding_dim=DIM, num_embeddings=32, feature_names=["c"], **policy),
    ]


def _plain(configs: list[HashEmbeddingConfig]) -> list[EmbeddingConfig]:
    """TorchRec configs with the same fields, less admission and eviction."""
    return [
        EmbeddingConfig(**{f.name: getattr(c, f.name) for f in dataclasses.fields(EmbeddingConfig)}) for c in configs
    ]


def _batch(g: torch.Generator, batch_size: int = 6) -> KeyedJaggedTensor:
    pool = torch.tensor([INT64_MIN, INT64_MAX, 0, -1, 7, 2**40 + 3, -(2**50), 123456789012345, 99, -99, 5, 6])
    lengths = torch.randint(0, 4, (len(KEYS) * batch_size,), generator=g)
    values = pool[torch.randint(0, len(pool), (int(lengths.sum()),), generator=g)]
    return KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=values, lengths=lengths)


def _kjt(ids: list[int], lengths: list[int], keys: list[str] | None = None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys or KEYS, values=torch.tensor(ids, dtype=torch.int64), lengths=torch.tensor(lengths)
    )


def _remap(model: HashEmbeddingCollection, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The same KJT with each id replaced by its row in the model's id table (every id must have one)."""
    table_of = {f: cfg.name for cfg in model.embedding_configs() for f in cfg.feature_names}
    values = [model.id_tables[table_of[key]].find(kjt[key].values()) for key in kjt.keys()]
    assert all(bool((v >= 0).all()) for v in values)
    return KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=torch.cat(values), lengths=kjt.lengths())


def _snapshot(model: HashEmbeddingCollection) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    ids = {t: {k: v.clone() for k, v in sd.items()} for t, sd in model.id_table_state_dict().items()}
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ids, weights, model.stats()


def _same_snapshot(a: tuple[dict[str, Any], ...], b: tuple[dict[str, Any], ...]) -> bool:
    ids_a, w_a, stats_a = a
    ids_b, w_b, stats_b = b
    same_ids = ids_a.keys() == ids_b.keys() and all(
        ids_a[t].keys() == ids_b[t].keys() and all(torch.equal(ids_a[t][k], ids_b[t][k]) for k in ids_a[t])
        for t in ids_a
    )
    return same_ids and all(torch.equal(w_a[k], w_b[k]) for k in w_a) and stats_a == stats_b


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": partial(torch.optim.SGD, lr=0.1),
    "adagrad": partial(torch.optim.Adagrad, lr=0.1),
}


# ---------------------------------------------------------------------------------------------- config


def test_config_is_a_torchrec_embedding_config_with_the_bag_configs_checks() -> None:
    cfg = HashEmbeddingConfig(
        name="item", embedding_dim=8, num_embeddings=100, feature_names=["f"], eviction=LRUEviction()
    )
    assert isinstance(cfg, EmbeddingConfig) and not isinstance(cfg, HashEmbeddingBagConfig)
    assert cfg.init_fn is not None and cfg.eviction == LRUEviction() and cfg.admission is None
    copy = dataclasses.replace(cfg, num_embeddings=200)
    assert isinstance(copy, HashEmbeddingConfig) and copy.eviction == LRUEviction()
    base: dict[str, Any] = {"name": "item", "embedding_dim": 8, "num_embeddings": 100, "feature_names": ["f"]}
    for kw, error, match in (
        ({"embedding_dim": 6}, ValueError, "multiple of 4"),
        ({"num_embeddings": 0}, ValueError, "num_embeddings must be > 0"),
        ({"num_embeddings": 2.5}, TypeError, "num_embeddings must be an int"),
        ({"feature_names": ["a", "a"]}, ValueError, r"repeated: \['a'\]"),
        ({"feature_names": []}, ValueError, "non-empty list"),
        ({"admission": LRUEviction()}, TypeError, "admission must be CountAdmission"),
        ({"eviction": CountAdmission(2)}, TypeError, "eviction must be"),
    ):
        with pytest.raises(error, match=match) as info:
            HashEmbeddingConfig(**{**base, **kw})
        assert str(info.value).startswith("HashEmbeddingConfig 'item': ")
        # The bag config says the same, under its own name.
        with pytest.raises(error) as bag_info:
            HashEmbeddingBagConfig(**{**base, **kw})
        assert str(bag_info.value) == str(info.value).replace("HashEmbeddingConfig", "HashEmbeddingBagConfig")
    with pytest.raises(ValueError, match="HashEmbeddingConfig: name must be a non-empty str"):
        HashEmbeddingConfig(**{**base, "name": ""})


# ---------------------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_equals_torchrec_ec_on_remapped_ids(optimizer: str) -> None:
    configs = _configs()
    model = HashEmbeddingCollection(tables=configs)
    reference = EmbeddingCollection(tables=_plain(configs))
    reference.load_state_dict(model.state_dict())
    assert set(model.state_dict()) == {"embeddings.item.weight", "embeddings.t1.weight"}
    assert model.embeddings["item"].weight.shape == (64, DIM)
    opt_m = OPTIMIZERS[optimizer](model.parameters())
    opt_r = OPTIMIZERS[optimizer](reference.parameters())
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        kjt = _batch(g)
        out_m = model(kjt)
        out_r = reference(_remap(model, kjt))
        assert list(out_m) == list(out_r) == ["hist", "cand", "c"]
        for key in KEYS:
            assert torch.equal(out_m[key].values(), out_r[key].values())
            assert torch.equal(out_m[key].lengths(), kjt[key].lengths())
            assert torch.equal(out_m[key].offsets(), out_r[key].offsets())
            assert out_m[key].weights_or_none() is None
        targets = {key: torch.randn(out_m[key].values().shape, generator=g) for key in KEYS}
        for opt, out in ((opt_m, out_m), (opt_r, out_r)):
            opt.zero_grad()
            sum(((out[k].values() - targets[k]) ** 2).sum() for k in KEYS).backward()  # type: ignore[union-attr]
        for name in ("item", "t1"):  # the same gradient on each id's row
            assert torch.equal(model.embeddings[name].weight.grad, reference.embeddings[name].weight.grad)
        opt_m.step()
        opt_r.step()
    for name in ("item", "t1"):
        assert torch.equal(model.embeddings[name].weight, reference.embeddings[name].weight)
    model.eval()
    kjt = _batch(g)
    out_m, out_r = model(kjt), reference(_remap(model, kjt))
    assert all(torch.equal(out_m[k].values(), out_r[k].values()) for k in KEYS)


def test_a_table_shared_by_two_features_has_one_id_table() -> None:
    model = HashEmbeddingCollection(tables=_configs())
    assert set(model.id_tables) == {"item", "t1"}
    # The candidate 42 also stands in the history; 43 is new in this very batch.
    kjt = _kjt([10, 42, 11, 42, 43, 5], [2, 1, 1, 1, 1, 0])
    out = model(kjt)
    table = model.id_tables["item"]
    assert table.stats()["lookups"] == 5 and len(table) == 4  # one find_or_insert for both features
    hist_rows = table.find(torch.tensor([10, 42, 11]))
    cand_rows = table.find(torch.tensor([42, 43]))
    weight = model.embeddings["item"].weight
    assert torch.equal(out["hist"].values(), weight[hist_rows])
    assert torch.equal(out["cand"].values(), weight[cand_rows])
    assert torch.equal(out["hist"].values()[1], out["cand"].values()[0])
    (out["hist"].values().sum() + 2 * out["cand"].values().sum()).backward()
    grad = model.embeddings["item"].weight.grad
    assert grad is not None
    row42 = int(hist_rows[1])
    assert torch.equal(grad[row42], torch.full((DIM,), 3.0))  # 1 from the history, 2 from the candidate
    assert torch.equal(grad[int(cand_rows[1])], torch.full((DIM,), 2.0))


def test_raw_id_edge_cases() -> None:
    model = HashEmbeddingCollection(tables=_configs())
    ids = [INT64_MIN, INT64_MAX, 0, -1, -5, INT64_MIN, 0, 0]
    out = model(_kjt(ids, [3, 5, 0, 0, 0, 0]))["hist"]
    rows = model.id_tables["item"].find(torch.tensor(ids)).tolist()
    assert len(set(rows)) == 5 and min(rows) >= 0  # distinct ids, distinct rows; repeats share one
    assert rows[0] == rows[5] and rows[2] == rows[6] == rows[7]
    assert torch.equal(out.values(), model.embeddings["item"].weight[rows])
    assert torch.equal(out.values()[0], out.values()[5]) and torch.equal(out.lengths(), torch.tensor([3, 5]))
    # int32 ids are sign-extended: -5 and 0 as int32 are the same ids.
    model.eval()
    kjt32 = KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=torch.tensor([-5, 0], dtype=torch.int32), lengths=torch.tensor([2, 0, 0, 0, 0, 0])
    )
    assert torch.equal(model(kjt32)["hist"].values(), model.embeddings["item"].weight[[rows[4], rows[2]]])


# ---------------------------------------------------------------------------------------------- eval, admission


def test_eval_inserts_nothing_and_unknown_ids_are_zero_without_gradient() -> None:
    model = HashEmbeddingCollection(tables=_configs(eviction=LRUEviction()))
    model(_kjt([1, 2, 3], [2, 0, 1, 0, 0, 0]))
    model.eval()
    before = _snapshot(model)
    out = model(_kjt([1, 404, 3, 405, 2], [3, 0, 1, 1, 0, 0]))
    assert _same_snapshot(before, _snapshot(model))
    weight = model.embeddings["item"].weight
    r1, r2, r3 = model.id_tables["item"].find(torch.tensor([1, 2, 3])).tolist()
    assert torch.equal(out["hist"].values(), torch.stack([weight[r1], torch.zeros(DIM), weight[r3]]))
    assert torch.equal(out["cand"].values(), torch.stack([torch.zeros(DIM), weight[r2]]))
    assert torch.equal(out["c"].values(), torch.zeros(0, DIM))
    sum(jt.values().sum() for jt in out.values()).backward()  # type: ignore[union-attr]
    grad = weight.grad
    assert grad is not None
    expected = torch.zeros_like(weight)
    expected[[r1, r2, r3]] = 1.0
    assert torch.equal(grad, expected)  # the unknown ids touched no row


def test_ids_not_admitted_yet_are_zero_then_admitted() -> None:
    model = HashEmbeddingCollection(tables=_configs(admission=CountAdmission(threshold=2, counter_slots=1 << 12)))
    first = model(_kjt([7, 8], [1, 0, 1, 0, 0, 0]))
    assert torch.equal(first["hist"].values(), torch.zeros(1, DIM)) and len(model.id_tables["item"]) == 0
    first["hist"].values().sum().backward()
    assert model.embeddings["item"].weight.grad is not None
    assert torch.equal(model.embeddings["item"].weight.grad, torch.zeros(64, DIM))
    second = model(_kjt([7, 9], [1, 0, 1, 0, 0, 0]))
    row7 = int(model.id_tables["item"].find(torch.tensor([7])))
    assert row7 >= 0 and torch.equal(second["hist"].values(), model.embeddings["item"].weight[[row7]])
    assert torch.equal(second["cand"].values(), torch.zeros(1, DIM))  # 9 seen once


def test_need_indices_returns_the_raw_ids_as_weights() -> None:
    model = HashEmbeddingCollection(tables=_configs(), need_indices=True)
    assert model.need_indices() and not HashEmbeddingCollection(tables=_configs()).need_indices()
    ids = [INT64_MAX, -3, INT64_MIN, 5]
    out = model(_kjt(ids, [2, 0, 1, 0, 0, 1]))
    assert torch.equal(out["hist"].weights(), torch.tensor(ids[:2]))
    assert torch.equal(out["cand"].weights(), torch.tensor(ids[2:3]))
    assert torch.equal(out["c"].weights(), torch.tensor(ids[3:]))
    reference = EmbeddingCollection(tables=_plain(_configs()), need_indices=True)
    reference.load_state_dict(model.state_dict())
    kjt = _kjt(ids, [2, 0, 1, 0, 0, 1])
    remapped = _remap(model, kjt)
    assert torch.equal(reference(remapped)["hist"].weights(), remapped["hist"].values())  # TorchRec: its input ids


def test_empty_bags_and_an_empty_batch() -> None:
    model = HashEmbeddingCollection(tables=_configs())
    out = model(_kjt([3], [0, 1, 0, 0, 0, 0]))
    assert torch.equal(out["hist"].lengths(), torch.tensor([0, 1])) and out["hist"].values().shape == (1, DIM)
    assert out["cand"].values().shape == (0, DIM) and torch.equal(out["cand"].offsets(), torch.tensor([0, 0, 0]))
    empty = KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=torch.empty(0, dtype=torch.int64), lengths=torch.empty(0, dtype=torch.int64)
    )
    before = len(model.id_tables["item"])
    for training in (True, False):
        model.train(training)
        out = model(empty)
        assert list(out) == KEYS
        for jt in out.values():
            assert jt.values().shape == (0, DIM) and jt.lengths().numel() == 0
            assert torch.equal(jt.offsets(), torch.tensor([0]))
    assert len(model.id_tables["item"]) == before


def test_key_order_of_the_input_does_not_matter() -> None:
    model = HashEmbeddingCollection(tables=_configs())
    kjt = _batch(torch.Generator().manual_seed(4))
    out = model(kjt)
    model.eval()
    permuted = model(kjt.permute([2, 0, 1]))
    assert all(torch.equal(out[k].values(), permuted[k].values()) for k in KEYS)


# ---------------------------------------------------------------------------------------------- eviction, state


def test_reused_rows_are_reinitialised_and_their_optimizer_state_reset() -> None:
    cfg = HashEmbeddingConfig(
        name="t",
        embedding_dim=4,
        num_embeddings=2,
        feature_names=["f"],
        eviction=LRUEviction(),
        init_fn=partial(torch.nn.init.constant_, val=0.25),
    )
    model = HashEmbeddingCollection(tables=[cfg])
    weight = model.embeddings["t"].weight
    opt = torch.optim.Adagrad(model.parameters(), lr=0.5)
    handle = model.attach_optimizer(opt)
    grad = torch.arange(1.0, 5.0)  # the gradient of every looked-up row, each step

    def step(ids: list[int]) -> torch.Tensor:
        out = model(_kjt(ids, [1] * len(ids), keys=["f"]))["f"].values()
        opt.zero_grad()
        (out * grad).sum().backward()
        opt.step()
        return out.detach()

    step([1, 2])  # 1 -> row 0, 2 -> row 1
    step([1])
    assert torch.equal(step([3]), torch.full((1, 4), 0.25))  # evicts 2; row 1 re-initialised before the lookup
    assert model.id_tables["t"].find(torch.tensor([1, 2, 3])).tolist() == [0, -1, 1]
    adagrad_sum = opt.state[weight]["sum"]
    assert torch.equal(adagrad_sum[1], grad**2)  # reset before the step: one step's worth, as for a fresh row
    assert torch.equal(adagrad_sum[0], 2 * grad**2)
    handle.remove()
    step([4])  # evicts 1 (row 0): detached, so its Adagrad sum carries over
    assert torch.equal(adagrad_sum[0], 3 * grad**2)


def test_meta_construction_materialisation_and_id_table_round_trip() -> None:
    configs = _configs(eviction=LRUEviction())
    model = HashEmbeddingCollection(tables=configs, device=torch.device("meta"))
    assert model.device.type == "meta"
    assert model.embeddings["item"].weight.is_meta and model.embeddings["item"].weight.shape == (64, DIM)
    assert all(t.device.type == "meta" for t in model.id_tables.values())
    assert model.embedding_configs() == configs and all(
        a is b for a, b in zip(model.embedding_configs(), configs, strict=True)
    )
    assert model.embedding_dim() == DIM
    with pytest.raises(RuntimeError, match="HashEmbeddingCollection table 'item' is on the meta device"):
        model(_kjt([1], [1, 0, 0, 0, 0, 0]))
    model.to_empty(device="cpu")
    model.load_state_dict(EmbeddingCollection(tables=_plain(configs)).state_dict())
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        out = model(_batch(g))
    assert out["hist"].values().shape[1] == DIM and not out["hist"].values().is_meta
    assert model.id_tables["item"].device.type == "cpu" and len(model.id_tables["item"]) > 0

    # Restore weights and id tables into modules built on meta, as a checkpoint load does.
    for id_table_device in (None, "cpu"):
        clone = HashEmbeddingCollection(
            tables=_configs(eviction=LRUEviction()), device="meta", id_table_device=id_table_device
        )
        clone.to_empty(device="cpu")
        clone.load_state_dict(model.state_dict())
        clone.load_id_table_state_dict(model.id_table_state_dict())
        assert all(t.device.type == "cpu" for t in clone.id_tables.values())
        assert clone.stats() == model.stats()
        model.eval()
        clone.eval()
        kjt = _batch(g)
        assert all(torch.equal(model(kjt)[k].values(), clone(kjt)[k].values()) for k in KEYS)
    with pytest.raises(ValueError, match=r"HashEmbeddingCollection.load_id_table_state_dict: tables missing \['t1'\]"):
        clone.load_id_table_state_dict({"item": model.id_table_state_dict()["item"]})


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_are_named_and_change_nothing() -> None:
    model = HashEmbeddingCollection(tables=_configs())
    model(_kjt([1, 2, 3], [1, 1, 1, 0, 0, 0]))
    before = _snapshot(model)
    ok = _batch(torch.Generator().manual_seed(8))
    bad: list[tuple[Callable[[], object], type[Exception], str]] = [
        (lambda: _kjt([1], [1, 0, 0, 0, 0, 0, 0, 0], keys=[*KEYS, "zz"]), ValueError, r"unknown \['zz'\]"),
        (lambda: _kjt([1], [1, 0, 0, 0], keys=["hist", "cand"]), ValueError, r"missing \['c'\]"),
        (
            lambda: KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=ok.values().float(), lengths=ok.lengths()),
            TypeError,
            "float32",
        ),
        (
            lambda: KeyedJaggedTensor(
                keys=KEYS, values=torch.tensor([5, 6, 7]), lengths=torch.tensor([2, 2, 0, 0, 0, 0])
            ),
            ValueError,
            "sum to 4 but the KJT has 3 ids",
        ),
        (
            lambda: KeyedJaggedTensor(
                keys=KEYS, values=torch.tensor([5, 6]), lengths=torch.tensor([3, -1, 0, 0, 0, 0])
            ),
            ValueError,
            "negative lengths",
        ),
        (lambda: {"hist": torch.tensor([1])}, TypeError, "KeyedJaggedTensor"),
    ]
    for make, error, match in bad:
        with pytest.raises(error, match=match) as info:
            model(make())  # type: ignore[arg-type]
        assert "HashEmbeddingCollection" in str(info.value)
        assert _same_snapshot(before, _snapshot(model))


def test_a_full_table_without_eviction_raises_and_changes_nothing() -> None:
    cfg = HashEmbeddingConfig(name="item", embedding_dim=4, num_embeddings=4, feature_names=["hist", "cand"])
    model = HashEmbeddingCollection(tables=[cfg])
    model(_kjt([1, 2, 3], [2, 1], keys=["hist", "cand"]))
    before = _snapshot(model)
    with pytest.raises(TableFullError, match="'item'"):
        model(_kjt([4, 5, 1], [1, 2], keys=["hist", "cand"]))  # 4 and 5 together do not fit
    assert _same_snapshot(before, _snapshot(model))


def test_bad_constructor_arguments_are_named() -> None:
    with pytest.raises(
        TypeError, match=r"HashEmbeddingCollection: tables\[0\] \(name 'item'\) must be a HashEmbeddingConfig"
    ):
        HashEmbeddingCollection(tables=_plain(_configs()))  # type: ignore[arg-type]
    bag = HashEmbeddingBagConfig(name="b", embedding_dim=DIM, num_embeddings=4, feature_names=["f"])
    with pytest.raises(TypeError, match="got HashEmbeddingBagConfig"):
        HashEmbeddingCollection(tables=[bag])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="HashEmbeddingCollection: tables must be a non-empty list"):
        HashEmbeddingCollection(tables=[])
    with pytest.raises(TypeError, match="need_indices must be a bool"):
        HashEmbeddingCollection(tables=_configs(), need_indices=1)  # type: ignore[arg-type]
    wide = HashEmbeddingConfig(name="w", embedding_dim=16, num_embeddings=4, feature_names=["w"])
    with pytest.raises(ValueError, match="same embedding dimension"):  # TorchRec's own rule
        HashEmbeddingCollection(tables=[*_configs(), wide])


def test_id_table_capacity_and_names_follow_the_configs() -> None:
    model = HashEmbeddingCollection(tables=_configs(eviction=LRUEviction()))
    assert {n: (t.capacity, t.name) for n, t in model.id_tables.items()} == {"item": (64, "item"), "t1": (32, "t1")}
    assert all(isinstance(t, IdTable) for t in model.id_tables.values())
    assert isinstance(model(_kjt([1], [1, 0, 0, 0, 0, 0]))["hist"], JaggedTensor)
