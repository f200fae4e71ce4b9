from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from recsdk.embedding import (
    CountAdmission,
    HashEmbeddingBagConfig,
    IdTable,
    LFUEviction,
    LRUEviction,
    TTLEviction,
)


def _config(**kw: Any) -> HashEmbeddingBagConfig:
    args: dict[str, Any] = {"name": "clicks", "embedding_dim": 8, "num_embeddings": 100, "feature_names": ["f"]}
    args.update(kw)
    return HashEmbeddingBagConfig(**args)


def test_is_a_torchrec_config_with_default_init_and_policies() -> None:
    cfg = _config(admission=CountAdmission(2), eviction=TTLEviction(5))
    assert isinstance(cfg, EmbeddingBagConfig)
    assert cfg.init_fn is not None and cfg.get_weight_init_max() == pytest.approx(0.1)
    assert cfg.admission == CountAdmission(2) and cfg.eviction == TTLEviction(5)
    copy = dataclasses.replace(cfg, num_embeddings=200)
    assert isinstance(copy, HashEmbeddingBagConfig) and copy.eviction == TTLEviction(5)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"embedding_dim": 6}, ValueError, "multiple of 4"),
        ({"data_type": "fp32"}, TypeError, "data_type must be a torchrec DataType"),
        ({"init_fn": 3}, TypeError, "init_fn must be callable"),
        ({"weight_init_min": 1.0, "weight_init_max": -1.0}, ValueError, "weight_init_min must be <= weight_init_max"),
        ({"embedding_dim": 0}, ValueError, "embedding_dim must be > 0"),
        ({"num_embeddings": 0}, ValueError, "num_embeddings must be > 0"),
        ({"num_embeddings": 2.5}, TypeError, "num_embeddings must be an int"),
        ({"feature_names": []}, ValueError, "non-empty list"),
        ({"feature_names": ["a", "b", "a"]}, ValueError, r"repeated: \['a'\]"),
        ({"feature_names": ["a", ""]}, ValueError, "non-empty str"),
        ({"pooling": PoolingType.NONE}, ValueError, "SUM or PoolingType.MEAN"),
        ({"admission": LRUEviction()}, TypeError, "admission must be CountAdmission"),
        ({"eviction": CountAdmission(2)}, TypeError, "eviction must be"),
    ],
)
def test_invalid_configs_name_the_table(kw: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        _config(**kw)
    assert "'clicks'" in str(info.value)


def test_config_and_id_table_agree_on_capacity_and_policies() -> None:
    # A config that validates must build its id table, and both reject the same things in the same words.
    limit = 2**31 - 2
    assert _config(num_embeddings=limit).num_embeddings == IdTable(limit, device="meta").capacity
    with pytest.raises(ValueError, match=rf"'clicks': num_embeddings must be <= {limit}, got {limit + 1}"):
        _config(num_embeddings=limit + 1)
    with pytest.raises(ValueError, match=rf"IdTable 'clicks': capacity must be in \[1, {limit}\], got {limit + 1}"):
        IdTable(limit + 1, device="meta", name="clicks")
    for kw, tail in (
        (
            {"admission": LRUEviction()},
            "admission must be CountAdmission, ScoreAdmission, ProbabilisticAdmission or None, got LRUEviction",
        ),
        (
            {"eviction": CountAdmission(2)},
            "eviction must be LRUEviction, LFUEviction, TTLEviction, ScoreEviction or None, got CountAdmission",
        ),
    ):
        with pytest.raises(TypeError) as from_config:
            _config(**kw)
        with pytest.raises(TypeError) as from_table:
            IdTable(4, name="clicks", **kw)
        assert str(from_config.value) == f"HashEmbeddingBagConfig 'clicks': {tail}"
        assert str(from_table.value) == f"IdTable 'clicks': {tail}"


def test_empty_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="name"):
        _config(name="")


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: CountAdmission(0), ValueError, "threshold"),
        (lambda: CountAdmission(True), TypeError, "threshold"),
        (lambda: CountAdmission(2, counter_slots=1, num_hashes=2), ValueError, "counter_slots"),
        (lambda: CountAdmission(2, num_hashes=9), ValueError, "num_hashes"),
        (lambda: TTLEviction(0), ValueError, "max_idle_steps"),
        (lambda: TTLEviction(1.5), TypeError, "max_idle_steps"),
    ],
)
def test_invalid_policies(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_policies_are_frozen_values() -> None:
    assert LFUEviction() == LFUEviction() and LRUEviction() != LFUEviction()
    with pytest.raises(dataclasses.FrozenInstanceError):
        TTLEviction(3).max_idle_steps = 4  # type: ignore[misc]
    assert CountAdmission(1).memory_bytes == 0
    assert CountAdmission(2, counter_slots=1000, num_hashes=3).memory_bytes == 4 * 999
