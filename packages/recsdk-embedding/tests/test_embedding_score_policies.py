"""Show/click score admission and eviction, and probabilistic admission, on hand-made id and click sequences."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.embedding import (
    HashEmbeddingBagCollection,
    HashEmbeddingBagConfig,
    HashEmbeddingCollection,
    HashEmbeddingConfig,
    IdTable,
    LRUEviction,
    ProbabilisticAdmission,
    ScoreAdmission,
    ScoreEviction,
    ShowClickScore,
)


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _clicks(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _stored(table: IdTable) -> set[int]:
    return set(table.ids_and_rows()[0].tolist())


# ---------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "error", "text"),
    [
        (lambda: ShowClickScore(alpha=-1.0), ValueError, "ShowClickScore.alpha must be a finite number in [0.0"),
        (lambda: ShowClickScore(beta=float("nan")), ValueError, "ShowClickScore.beta"),
        (lambda: ShowClickScore(decay=0.0), ValueError, "ShowClickScore.decay must be a finite number in (0.0, 1.0]"),
        (lambda: ShowClickScore(decay=1.5), ValueError, "got 1.5"),
        (lambda: ShowClickScore(alpha=0.0, beta=0.0), ValueError, "alpha and beta are both 0"),
        (lambda: ShowClickScore(alpha="1"), TypeError, "ShowClickScore.alpha must be a float, got str"),
        (lambda: ScoreAdmission(threshold=0.0), ValueError, "ScoreAdmission.threshold"),
        (lambda: ScoreAdmission(threshold=1.0, score=LRUEviction()), TypeError, "ScoreAdmission.score"),
        (lambda: ScoreAdmission(threshold=1.0, num_hashes=9), ValueError, "ScoreAdmission.num_hashes"),
        (lambda: ScoreEviction(evict_fraction=0.0), ValueError, "ScoreEviction.evict_fraction"),
        (lambda: ScoreEviction(every_steps=0), ValueError, "ScoreEviction.every_steps must be in [1"),
        (lambda: ProbabilisticAdmission(probability=1.5), ValueError, "ProbabilisticAdmission.probability"),
        (lambda: ProbabilisticAdmission(probability=0.5, seed=-1), ValueError, "ProbabilisticAdmission.seed"),
    ],
)
def test_bad_policy_fields_are_named(make, error, text) -> None:
    with pytest.raises(error) as info:
        make()
    assert text in str(info.value)


def test_a_config_scoring_two_ways_names_the_table() -> None:
    with pytest.raises(ValueError, match="HashEmbeddingBagConfig 'user': admission and eviction must score ids the"):
        HashEmbeddingBagConfig(
            name="user",
            embedding_dim=8,
            num_embeddings=16,
            feature_names=["u"],
            admission=ScoreAdmission(threshold=2.0, score=ShowClickScore(beta=1.0)),
            eviction=ScoreEviction(score=ShowClickScore(beta=2.0)),
        )


def test_bad_clicks_leave_the_table_unchanged() -> None:
    table = IdTable(8, eviction=ScoreEviction(), name="t")
    table.find_or_insert(_ids(1, 2), _clicks(0.0, 1.0))
    before = table.state_dict()
    for clicks, error, text in [
        (_clicks(1.0), ValueError, "1 clicks for 2 ids"),
        (_clicks(-1.0, 0.0), ValueError, "finite and >= 0, got -1.0"),
        (_clicks(float("inf"), 0.0), ValueError, "finite and >= 0, got inf"),
        (torch.tensor([1, 0]), TypeError, "clicks must be floating point"),
    ]:
        with pytest.raises(error, match=r"IdTable 't'\.find_or_insert") as info:
            table.find_or_insert(_ids(3, 4), clicks)
        assert text in str(info.value)
    after = table.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------------------------- score admission


def test_score_admission_admits_when_the_decayed_score_reaches_the_threshold() -> None:
    score = ShowClickScore(alpha=1.0, beta=3.0, decay=0.5)
    table = IdTable(16, admission=ScoreAdmission(threshold=2.0, score=score), name="t")
    rows = table.find_or_insert(_ids(1, 2), _clicks(0.0, 1.0))  # 1: 1 show; 2: 1 show + 1 click = 4
    assert rows[0] == -1 and rows[1] >= 0
    assert table.scores(_ids(1)).tolist() == [1.0]
    assert table.find_or_insert(_ids(1))[0] == -1  # 0.5 + 1 = 1.5
    assert table.scores(_ids(1)).tolist() == [1.5]
    assert bool((table.find_or_insert(_ids(1, 1)) >= 0).all())  # 0.75 + 2 = 2.75: admitted
    assert _stored(table) == {1, 2}
    assert table.stats()["admission_rejects"] == 2


def test_a_click_counts_beta_and_an_unclicked_show_alpha() -> None:
    score = ShowClickScore(alpha=0.5, beta=10.0)
    table = IdTable(16, admission=ScoreAdmission(threshold=10.0, score=score), name="t")
    table.find_or_insert(_ids(7, 8, 8, 8), _clicks(1.0, 0.0, 0.0, 0.0))  # 7: 10.5; 8: 1.5
    assert _stored(table) == {7}
    assert table.scores(_ids(7, 8)).tolist() == [0.0, 1.5]  # 7 has a row but no per-row score kept


# ---------------------------------------------------------------------------------------- score eviction


def test_a_clicked_id_outlives_a_stream_of_unclicked_one_offs_that_lru_would_keep() -> None:
    score = ShowClickScore(alpha=1.0, beta=20.0, decay=0.99)
    by_score = IdTable(4, eviction=ScoreEviction(evict_fraction=0.25, score=score), name="score")
    by_recency = IdTable(4, eviction=LRUEviction(), name="lru")
    for table in (by_score, by_recency):
        table.find_or_insert(_ids(42), _clicks(1.0))  # one clicked impression
        for step in range(20):  # then one-off impressions nobody clicks
            table.find_or_insert(_ids(1000 + step), _clicks(0.0))
    assert 42 in _stored(by_score)
    assert 42 not in _stored(by_recency)


def test_score_eviction_frees_the_lowest_fraction_never_the_batch_at_hand() -> None:
    table = IdTable(4, eviction=ScoreEviction(evict_fraction=0.5), name="t")  # alpha = beta = 1, no decay
    table.find_or_insert(_ids(1, 2, 2, 3, 3, 3, 4, 4, 4, 4))  # scores 1, 2, 3, 4: the table is full
    # One new id needs one row; the round frees half the table: the two lowest among those not in
    # this batch. Id 1 (lowest) is in the batch, so 2 and 3 go.
    table.find_or_insert(_ids(1, 5))
    assert _stored(table) == {1, 4, 5}
    assert table.stats()["evictions"] == 2
    assert table.scores(_ids(1, 4, 5)).tolist() == [2.0, 4.0, 1.0]
    stats = table.stats()
    assert stats["score_sum"] == 7.0 and stats["score_min"] == 1.0


def test_score_eviction_every_n_steps() -> None:
    table = IdTable(16, eviction=ScoreEviction(evict_fraction=0.5, every_steps=3), name="t")
    table.find_or_insert(_ids(1, 2, 2, 3, 3, 3, 4, 4, 4, 4))
    table.find_or_insert(_ids(4))
    assert len(table) == 4
    table.find_or_insert(_ids(4))  # step 3: half of the 4 ids, the lowest not in the batch
    assert _stored(table) == {3, 4}


def test_scores_do_not_depend_on_the_order_ids_arrive_in() -> None:
    score = ShowClickScore(alpha=0.3, beta=1.7, decay=0.9)
    a = IdTable(64, admission=ScoreAdmission(threshold=1.5, score=score), eviction=ScoreEviction(score=score))
    b = IdTable(64, admission=ScoreAdmission(threshold=1.5, score=score), eviction=ScoreEviction(score=score))
    g = torch.Generator().manual_seed(0)
    for _ in range(300):  # past several rescales of the stored units (every ~132 steps at 0.9)
        ids = torch.randint(0, 40, (50,), generator=g)
        clicks = torch.randint(0, 2, (50,), generator=g).float()
        a.find_or_insert(ids, clicks)
        order = torch.randperm(50, generator=g)
        b.find_or_insert(ids[order], clicks[order])
    sa, sb = a.state_dict(), b.state_dict()
    ids_a, ids_b = sa["ids"].argsort(), sb["ids"].argsort()
    assert torch.equal(sa["ids"][ids_a], sb["ids"][ids_b])
    assert torch.equal(sa["scores"][ids_a], sb["scores"][ids_b])
    assert torch.equal(sa["score_counters"], sb["score_counters"])


def test_a_decayed_score_matches_its_definition_over_many_rescales() -> None:
    score = ShowClickScore(alpha=1.0, beta=2.0, decay=0.8)
    table = IdTable(4, eviction=ScoreEviction(score=score), name="t")
    expected = 0.0
    for step in range(400):  # the stored units are rescaled every ~62 steps
        clicked = float(step % 3 == 0)
        table.find_or_insert(_ids(5), _clicks(clicked))
        expected = expected * 0.8 + 1.0 + 2.0 * clicked
    assert table.scores(_ids(5)).item() == pytest.approx(expected, abs=1e-3)


# ---------------------------------------------------------------------------------------- probabilistic admission


def test_probabilistic_admission_rate_and_repeats() -> None:
    table = IdTable(1 << 16, admission=ProbabilisticAdmission(probability=0.25, seed=3), name="t")
    once = table.find_or_insert(torch.arange(20_000))
    assert 0.23 < float((once >= 0).float().mean()) < 0.27
    four_times = table.find_or_insert((torch.arange(10_000) + 100_000).repeat(4))
    assert 0.66 < float((four_times >= 0).float().mean()) < 0.71  # 1 - 0.75 ** 4 = 0.684


def test_probabilistic_admission_is_a_function_of_id_step_and_seed() -> None:
    ids = torch.arange(5000) * 7919
    tables = [IdTable(8192, admission=ProbabilisticAdmission(0.5, seed=1)) for _ in range(2)]
    tables[0].find_or_insert(ids)
    half = ids.flip(0)[:2500]  # another table, another order, a subset: the same draw per id
    tables[1].find_or_insert(half)
    assert _stored(tables[1]) == _stored(tables[0]) & set(half.tolist())
    other_seed = IdTable(8192, admission=ProbabilisticAdmission(0.5, seed=2))
    other_seed.find_or_insert(ids)
    assert _stored(other_seed) != _stored(tables[0])
    resumed = IdTable(8192, admission=ProbabilisticAdmission(0.5, seed=1))
    resumed.load_state_dict(tables[0].state_dict())
    again = tables[0].find_or_insert(ids)
    assert torch.equal(resumed.find_or_insert(ids), again)


# ---------------------------------------------------------------------------------------- state


def test_state_round_trip_and_rebuild_keep_scores_and_decisions() -> None:
    score = ShowClickScore(alpha=1.0, beta=5.0, decay=0.7)

    def make() -> IdTable:
        admission = ScoreAdmission(threshold=2.0, score=score, counter_slots=4096)
        return IdTable(32, admission=admission, eviction=ScoreEviction(evict_fraction=0.2, score=score))

    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 60, (24,), generator=g), torch.randint(0, 2, (24,), generator=g).float()) for _ in range(80)
    ]
    a = make()
    for ids, clicks in batches[:50]:
        a.find_or_insert(ids, clicks)
    saved = a.state_dict()
    b = make()
    b.load_state_dict(saved)
    ids, _ = a.ids_and_rows()
    c = make()
    c.state.rebuild(
        ids,
        last_step=saved["last_step"],
        freq=saved["freq"],
        step=a.step,
        admission_counters=None,
        scores=saved["scores"],
        score_counters=saved["score_counters"],
        score_ref=int(saved["score_ref"]),
    )
    assert torch.equal(b.scores(ids), a.scores(ids)) and torch.equal(c.scores(ids), a.scores(ids))  # bit for bit
    for ids, clicks in batches[50:]:
        a.find_or_insert(ids, clicks)
        b.find_or_insert(ids, clicks)
        c.find_or_insert(ids, clicks)
    assert _stored(a) == _stored(b) == _stored(c)
    every = torch.arange(60)
    assert torch.equal(a.scores(every), b.scores(every)) and torch.equal(a.scores(every), c.scores(every))


def test_scores_of_another_policy_are_refused() -> None:
    scored = IdTable(8, eviction=ScoreEviction(), name="t")
    scored.find_or_insert(_ids(1, 2))
    plain = IdTable(8, eviction=LRUEviction(), name="plain")
    with pytest.raises(ValueError, match="IdTable 'plain': state dict holds show/click scores"):
        plain.load_state_dict(scored.state_dict())
    legacy = plain.state_dict()
    del legacy["scores"], legacy["score_counters"]  # a state saved before scores existed
    IdTable(8, eviction=LRUEviction()).load_state_dict(legacy)
    with pytest.raises(ValueError, match="IdTable 'plain' keeps no show/click scores"):
        plain.scores(_ids(1))


# ---------------------------------------------------------------------------------------- the collection


def _kjt(ids: list[int], weights: list[float] | None = None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["u"],
        values=torch.tensor(ids),
        weights=None if weights is None else torch.tensor(weights),
        lengths=torch.ones(len(ids), dtype=torch.int32),
    )


def _ebc(**kwargs) -> HashEmbeddingBagCollection:
    cfg = HashEmbeddingBagConfig(
        name="user",
        embedding_dim=4,
        num_embeddings=16,
        feature_names=["u"],
        admission=ScoreAdmission(threshold=3.0, score=ShowClickScore(alpha=1.0, beta=2.0)),
    )
    return HashEmbeddingBagCollection(tables=[cfg], **kwargs)


def test_the_collection_reads_clicks_from_the_weights_in_training() -> None:
    ebc = _ebc()
    ebc(_kjt([1, 2, 2], [1.0, 0.0, 0.0]))  # 1: 3.0 (admitted), 2: 2.0
    assert _stored(ebc.id_tables["user"]) == {1}
    with pytest.raises(ValueError, match=r"table\(s\) \['user'\] score clicks .*Batch\.with_clicks\(\)"):
        ebc(_kjt([3]))
    ebc.eval()
    ebc(_kjt([3]))  # evaluation reads no clicks
    with pytest.raises(ValueError, match="a weighted collection pools with its weights"):
        _ebc(is_weighted=True)


def test_the_unpooled_collection_reads_clicks_of_every_feature_of_a_table() -> None:
    cfg = HashEmbeddingConfig(
        name="item",
        embedding_dim=4,
        num_embeddings=16,
        feature_names=["history", "candidate"],
        eviction=ScoreEviction(score=ShowClickScore(alpha=1.0, beta=2.0)),
    )
    ec = HashEmbeddingCollection(tables=[cfg])
    kjt = KeyedJaggedTensor(
        keys=["history", "candidate"],
        values=torch.tensor([5, 6, 5]),
        weights=torch.tensor([1.0, 0.0, 0.0]),
        lengths=torch.tensor([2, 0, 1, 0]),
    )
    ec(kjt)
    assert ec.id_tables["item"].scores(_ids(5, 6)).tolist() == [4.0, 1.0]  # 5: two shows, one clicked
    with pytest.raises(ValueError, match="HashEmbeddingCollection: table"):
        ec(KeyedJaggedTensor(keys=["history", "candidate"], values=torch.tensor([5]), lengths=torch.tensor([1, 0])))
