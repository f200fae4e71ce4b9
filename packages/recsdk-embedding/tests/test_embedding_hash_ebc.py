"""HashEmbeddingBagCollection: equivalence with TorchRec's EBC, admission, eviction, eval, meta, bad input."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from recsdk.embedding import (
    CountAdmission,
    HashEmbeddingBagCollection,
    HashEmbeddingBagConfig,
    LRUEviction,
    init_rows_,
    reset_optimizer_rows_,
)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
KEYS = ["a", "b", "c"]


def _configs(pooling: PoolingType = PoolingType.SUM, **policy: object) -> list[HashEmbeddingBagConfig]:
    return [
        HashEmbeddingBagConfig(
            name="t0", embedding_dim=8, num_embeddings=64, feature_names=["a", "b"], pooling=pooling, **policy
        ),  # type: ignore[arg-type]
        HashEmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=32, feature_names=["c"], pooling=pooling, **policy
        ),  # type: ignore[arg-type]
    ]


def _plain(configs: list[HashEmbeddingBagConfig]) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=c.name,
            embedding_dim=c.embedding_dim,
            num_embeddings=c.num_embeddings,
            feature_names=list(c.feature_names),
            pooling=c.pooling,
        )
        for c in configs
    ]


def _batch(g: torch.Generator, batch_size: int = 6, weighted: bool = False) -> KeyedJaggedTensor:
    pool = torch.tensor([INT64_MIN, INT64_MAX, 0, -1, 7, 2**40 + 3, -(2**50), 123456789012345, 99, -99, 5, 6])
    lengths = torch.randint(0, 4, (len(KEYS) * batch_size,), generator=g)
    values = pool[torch.randint(0, len(pool), (int(lengths.sum()),), generator=g)]
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=values, lengths=lengths, weights=weights)


def _remap(model: HashEmbeddingBagCollection, kjt: KeyedJaggedTensor, drop_missing: bool = False) -> KeyedJaggedTensor:
    """The same KJT with each id replaced by its row in the model's id table (optionally dropping ids without one)."""
    table_of = {f: cfg.name for cfg in model.embedding_bag_configs() for f in cfg.feature_names}
    values, lengths, weights = [], [], []
    for key in kjt.keys():
        jt = kjt[key]
        rows = model.id_tables[table_of[key]].find(jt.values())
        keep = rows >= 0 if drop_missing else torch.ones_like(rows, dtype=torch.bool)
        bag = torch.repeat_interleave(torch.arange(jt.lengths().numel()), jt.lengths())
        values.append(rows[keep])
        lengths.append(torch.bincount(bag[keep], minlength=jt.lengths().numel()))
        if kjt.weights_or_none() is not None:
            weights.append(jt.weights()[keep])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(),
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weights else None,
    )


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": partial(torch.optim.SGD, lr=0.1),
    "adagrad": partial(torch.optim.Adagrad, lr=0.1),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_bit_identical_to_torchrec_ebc_on_remapped_ids(optimizer: str, pooling: PoolingType) -> None:
    configs = _configs(pooling)
    model = HashEmbeddingBagCollection(tables=configs)
    reference = EmbeddingBagCollection(tables=_plain(configs))
    reference.load_state_dict(model.state_dict())
    opt_m = OPTIMIZERS[optimizer](model.parameters())
    opt_r = OPTIMIZERS[optimizer](reference.parameters())
    g = torch.Generator().manual_seed(0)
    target = torch.randn(6, 20, generator=g)
    for _ in range(8):
        kjt = _batch(g)
        out_m = model(kjt)
        out_r = reference(_remap(model, kjt))
        assert out_m.keys() == out_r.keys() and out_m.length_per_key() == out_r.length_per_key()
        loss_m = ((out_m.values() - target) ** 2).sum()
        loss_r = ((out_r.values() - target) ** 2).sum()
        assert torch.equal(loss_m, loss_r)
        for opt, loss in ((opt_m, loss_m), (opt_r, loss_r)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    for name in ("t0", "t1"):
        assert torch.equal(model.embedding_bags[name].weight, reference.embedding_bags[name].weight)
    # Same embedding per id, looked up through each module's own indexing.
    model.eval()
    kjt = _batch(g)
    assert torch.equal(model(kjt).values(), reference(_remap(model, kjt)).values())


def test_weighted_sum_is_bit_identical_to_torchrec_ebc() -> None:
    configs = _configs()
    model = HashEmbeddingBagCollection(tables=configs, is_weighted=True)
    reference = EmbeddingBagCollection(tables=_plain(configs), is_weighted=True)
    reference.load_state_dict(model.state_dict())
    assert model.is_weighted()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        kjt = _batch(g, weighted=True)
        assert torch.equal(model(kjt).values(), reference(_remap(model, kjt)).values())


def test_admission_rejected_ids_are_zero_untrained_then_admitted() -> None:
    configs = _configs(admission=CountAdmission(threshold=2, counter_slots=1 << 12))
    model = HashEmbeddingBagCollection(tables=configs)
    reference = EmbeddingBagCollection(tables=_plain(configs))
    reference.load_state_dict(model.state_dict())
    opt_m = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_r = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(2)

    first = _batch(g)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = model(first)
    assert torch.equal(out.values(), torch.zeros_like(out.values()))  # nothing admitted yet
    out.values().sum().backward()
    opt_m.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.stats()["t0"]["size"] == 0 and model.stats()["t0"]["admission_rejects"] > 0

    # From now on: SUM over admitted ids == TorchRec EBC fed only the admitted ids' rows.
    for kjt in [first] + [_batch(g) for _ in range(4)]:
        out_m = model(kjt)
        out_r = reference(_remap(model, kjt, drop_missing=True))
        assert torch.equal(out_m.values(), out_r.values())
        for opt, o in ((opt_m, out_m), (opt_r, out_r)):
            opt.zero_grad()
            (o.values() ** 2).sum().backward()
            opt.step()
    assert torch.equal(model.embedding_bags["t0"].weight, reference.embedding_bags["t0"].weight)
    assert model.stats()["t0"]["size"] > 0


def test_mean_divides_by_the_original_bag_length() -> None:
    [cfg] = _configs(PoolingType.MEAN, admission=CountAdmission(threshold=2, counter_slots=1 << 12))[1:]
    model = HashEmbeddingBagCollection(tables=[cfg])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["c"], values=torch.tensor([10, 10, 11]), lengths=torch.tensor([3]))
    model(kjt)  # 10 and 11 seen once
    out = model(
        KeyedJaggedTensor.from_lengths_sync(keys=["c"], values=torch.tensor([10, 12]), lengths=torch.tensor([2]))
    )
    row = model.id_tables["t1"].find(torch.tensor([10])).item()
    assert model.id_tables["t1"].find(torch.tensor([12])).item() == -1
    assert torch.equal(out.values(), model.embedding_bags["t1"].weight[row].unsqueeze(0) / 2)


def test_reused_rows_are_reinitialised_before_lookup() -> None:
    cfg = HashEmbeddingBagConfig(
        name="t",
        embedding_dim=4,
        num_embeddings=2,
        feature_names=["f"],
        eviction=LRUEviction(),
        init_fn=partial(torch.nn.init.constant_, val=0.25),
    )
    model = HashEmbeddingBagCollection(tables=[cfg])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def step(ids: list[int]) -> torch.Tensor:
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.int64)
        )
        out = model(kjt).values()
        opt.zero_grad()
        out.sum().backward()
        opt.step()
        return out

    step([1, 2])
    step([1])
    weight = model.embedding_bags["t"].weight
    assert torch.equal(weight, torch.tensor([[-1.75] * 4, [-0.75] * 4]))  # both trained away from 0.25
    out = step([3])  # evicts 2 (least recent), row 1 goes to id 3
    assert torch.equal(out, torch.full((1, 4), 0.25))
    assert model.id_tables["t"].find(torch.tensor([2, 3])).tolist() == [-1, 1]
    assert model.stats()["t"]["evictions"] == 1


def test_attach_optimizer_resets_adagrad_state_of_reused_rows() -> None:
    def make() -> tuple[HashEmbeddingBagCollection, torch.optim.Optimizer]:
        cfg = HashEmbeddingBagConfig(
            name="t",
            embedding_dim=4,
            num_embeddings=2,
            feature_names=["f"],
            eviction=LRUEviction(),
            init_fn=partial(torch.nn.init.constant_, val=0.25),
        )
        model = HashEmbeddingBagCollection(tables=[cfg])
        return model, torch.optim.Adagrad(model.parameters(), lr=0.5)

    def step(model: HashEmbeddingBagCollection, opt: torch.optim.Optimizer, ids: list[int]) -> None:
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.int64)
        )
        opt.zero_grad()
        (model(kjt).values() * torch.arange(1.0, 5.0)).sum().backward()
        opt.step()

    fresh, fresh_opt = make()
    step(fresh, fresh_opt, [3])
    expected = fresh.embedding_bags["t"].weight[0]

    results = {}
    for attach in (True, False):
        model, opt = make()
        handle = model.attach_optimizer(opt) if attach else None
        for ids in ([1, 2], [1], [3]):
            step(model, opt, ids)
        row = model.id_tables["t"].find(torch.tensor([3])).item()
        results[attach] = model.embedding_bags["t"].weight[row].detach().clone()
        if handle is not None:
            handle.remove()
    assert torch.equal(results[True], expected)
    assert not torch.equal(results[False], expected)  # the stale Adagrad sum slows the reused row


def test_features_of_one_table_pool_by_their_own_presence() -> None:
    # "a" has rows for all its ids, "b" (same table) misses one: each feature takes its own pooling path.
    model = HashEmbeddingBagCollection(tables=_configs(PoolingType.MEAN))
    seen = [1, 2, 3]
    model(KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=torch.tensor(seen), lengths=torch.tensor([3, 0, 0])))
    model.eval()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=torch.tensor([1, 2, 3, 404, 3]), lengths=torch.tensor([2, 1, 2, 0, 0, 0])
    )
    out = model(kjt).values()
    weight = model.embedding_bags["t0"].weight
    r1, r2, r3 = model.id_tables["t0"].find(torch.tensor(seen)).tolist()
    expected_a = torch.nn.functional.embedding_bag(
        torch.tensor([r1, r2, r3]), weight, torch.tensor([0, 2, 3]), mode="mean", include_last_offset=True
    )
    assert torch.equal(out[:2, :8], expected_a)
    assert torch.equal(out[0, 8:16], weight[r3] / 2)  # 404 was never seen: no row, but it counts in the mean
    assert torch.equal(out[1, 8:16], torch.zeros(8))  # an empty bag


def test_eval_finds_only_and_changes_no_table_state() -> None:
    model = HashEmbeddingBagCollection(tables=_configs(eviction=LRUEviction()))
    g = torch.Generator().manual_seed(3)
    model(_batch(g))
    model.eval()
    before = model.id_table_state_dict()
    stats = model.stats()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=torch.tensor([424242, 7, 424243]), lengths=torch.tensor([1, 0, 1, 0, 1, 0])
    )
    out = model(kjt).values()
    assert torch.equal(out[0, :8], torch.zeros(8)) and torch.equal(out[0, 16:], torch.zeros(4))
    after = model.id_table_state_dict()
    assert all(torch.equal(before[t][k], after[t][k]) for t in before for k in before[t])
    assert model.stats() == stats


def test_key_order_of_the_input_does_not_matter() -> None:
    model = HashEmbeddingBagCollection(tables=_configs())
    g = torch.Generator().manual_seed(4)
    kjt = _batch(g)
    out = model(kjt).values()
    model.eval()
    permuted = kjt.permute([2, 0, 1])
    assert permuted.keys() == ["c", "a", "b"]
    assert torch.equal(model(permuted).values(), out)


def test_id_table_state_round_trip_restores_lookups() -> None:
    model = HashEmbeddingBagCollection(tables=_configs(eviction=LRUEviction()))
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        model(_batch(g))
    clone = HashEmbeddingBagCollection(tables=_configs(eviction=LRUEviction()))
    clone.load_state_dict(model.state_dict())
    clone.load_id_table_state_dict(model.id_table_state_dict())
    assert set(model.state_dict()) == {"embedding_bags.t0.weight", "embedding_bags.t1.weight"}
    model.eval()
    clone.eval()
    kjt = _batch(g)
    assert torch.equal(model(kjt).values(), clone(kjt).values())
    assert clone.stats() == model.stats()
    with pytest.raises(ValueError, match="missing"):
        clone.load_id_table_state_dict({"t0": model.id_table_state_dict()["t0"]})


def test_meta_construction_then_materialisation() -> None:
    model = HashEmbeddingBagCollection(tables=_configs(), device="meta")
    assert model.device.type == "meta"
    assert model.embedding_bags["t0"].weight.shape == (64, 8) and model.embedding_bags["t0"].weight.is_meta
    assert all(t.device.type == "meta" for t in model.id_tables.values())
    assert [c.name for c in model.embedding_bag_configs()] == ["t0", "t1"]
    model.to_empty(device="cpu")
    model.reset_parameters()
    out = model(_batch(torch.Generator().manual_seed(6)))
    assert out.values().shape == (6, 20)
    assert model.id_tables["t0"].device.type == "cpu" and len(model.id_tables["t0"]) > 0


def test_trains_with_a_plain_optimizer() -> None:
    model = HashEmbeddingBagCollection(tables=_configs())
    opt = torch.optim.Adagrad(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(7)
    kjt = _batch(g)
    losses = []
    for _ in range(20):
        loss = ((model(kjt).values() - 1.0) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # empty bags stay at 0, the rest move to 1


def test_bad_inputs_are_named() -> None:
    model = HashEmbeddingBagCollection(tables=_configs())
    ok = _batch(torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match=r"unknown \['zz'\]"):
        model(
            KeyedJaggedTensor.from_lengths_sync(
                keys=[*KEYS, "zz"], values=torch.tensor([1]), lengths=torch.tensor([1, 0, 0, 0])
            )
        )
    with pytest.raises(ValueError, match=r"missing \['c'\]"):
        model(
            KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.tensor([1]), lengths=torch.tensor([1, 0]))
        )
    with pytest.raises(TypeError, match="float32"):
        model(KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=ok.values().float(), lengths=ok.lengths()))
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        model({"a": torch.tensor([1])})  # type: ignore[arg-type]
    weighted = HashEmbeddingBagCollection(tables=_configs(), is_weighted=True)
    with pytest.raises(ValueError, match="weights"):
        weighted(ok)
    n = ok.values().numel()
    short = KeyedJaggedTensor(keys=KEYS, values=ok.values(), lengths=ok.lengths(), weights=torch.ones(n - 1))
    with pytest.raises(ValueError, match=rf"weights of shape \[{n - 1}\]; it needs one weight per id \({n}\)"):
        weighted(short)
    integer = KeyedJaggedTensor(
        keys=KEYS, values=ok.values(), lengths=ok.lengths(), weights=torch.ones(n, dtype=torch.int64)
    )
    with pytest.raises(TypeError, match=r"weights of features .* must be floating point, got torch.int64"):
        weighted(integer)
    with pytest.raises(TypeError, match="HashEmbeddingBagConfig"):
        HashEmbeddingBagCollection(tables=_plain(_configs()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        HashEmbeddingBagCollection(tables=[])


def test_init_rows_touches_only_given_rows_within_default_bounds() -> None:
    [cfg] = _configs()[:1]
    weight = torch.full((64, 8), 9.0)
    init_rows_(weight, torch.tensor([3, 5, 3]), cfg)
    bound = (1 / 64) ** 0.5
    assert bool((weight[[3, 5]].abs() <= bound).all())
    others = torch.ones(64, dtype=torch.bool)
    others[[3, 5]] = False
    assert bool((weight[others] == 9.0).all())
    with pytest.raises(ValueError, match="t0"):
        init_rows_(weight, torch.tensor([64]), cfg)


def test_reset_optimizer_rows_uses_initial_accumulator_value() -> None:
    param = torch.nn.Parameter(torch.ones(4, 2))
    opt = torch.optim.Adagrad([param], lr=0.1, initial_accumulator_value=0.3)
    param.grad = torch.ones(4, 2)
    opt.step()
    reset_optimizer_rows_(opt, param, torch.tensor([1]))
    state = opt.state[param]["sum"]
    assert torch.equal(state[1], torch.full((2,), 0.3)) and torch.equal(state[0], torch.full((2,), 1.3))
