"""The serving collections on hand-made versions: edge ids, MEAN, weights, key order, deletions."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.embedding import (
    HashEmbeddingBagCollection,
    HashEmbeddingBagConfig,
    HashEmbeddingCollection,
    HashEmbeddingConfig,
    PublishedTable,
    PublishedVersion,
)
from recsdk.embedding.publication import encode_rows
from recsdk.serving import ServingEmbeddingBagCollection, ServingEmbeddingCollection
from recsdk.serving import serving_collections as collections_module
from recsdk.serving.batch_checks import check_batch
from recsdk.serving.grouped_lookup import feature_bounds

EDGE_IDS = [-1, 0, 2**63 - 1, -(2**63)]


def _version(
    kind: str,
    tables: dict[str, tuple[list[int], list[float], list[int]]],
    dtype: str,
    dims: dict[str, int] | None = None,
) -> PublishedVersion:
    """A version whose ids' rows are all ``value`` (one per id), 4 wide (or ``dims[table]``)."""
    published = {
        name: PublishedTable(
            torch.tensor(ids, dtype=torch.int64),
            encode_rows(
                torch.tensor(values).unsqueeze(1).expand(len(values), (dims or {}).get(name, 4)).contiguous(), dtype
            ),
            torch.tensor(deleted, dtype=torch.int64),
        )
        for name, (ids, values, deleted) in tables.items()
    }
    return PublishedVersion(0, None, kind, 0, dtype, published, {}, {})


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8"])
def test_bags_sum_mean_and_edge_ids_as_the_hash_collection(dtype: str) -> None:
    ebc = HashEmbeddingBagCollection(
        tables=[
            HashEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=16, feature_names=["f", "g"]),
            HashEmbeddingBagConfig(
                name="b", embedding_dim=4, num_embeddings=16, feature_names=["h"], pooling=PoolingType.MEAN
            ),
        ],
        device="meta",
    )
    serving = ServingEmbeddingBagCollection(ebc, dtype)
    serving.apply_version(_version("full", {"a": (EDGE_IDS, [1.0, 2.0, 3.0, 4.0], []), "b": ([5], [8.0], [])}, dtype))
    # keys in another order than configured; 2 samples
    kjt = KeyedJaggedTensor(
        keys=["h", "g", "f"],
        values=torch.tensor([5, 77, 5, -1, 2**63 - 1, -(2**63), 0, 12345]),
        lengths=torch.tensor([2, 1, 1, 1, 2, 1]),
    )
    out = serving(kjt).to_dict()
    assert out["f"][:, 0].tolist() == [6.0, 0.0]  # INT64_MIN + 0; an unknown id (zero)
    assert out["g"][:, 0].tolist() == [1.0, 3.0]  # -1; INT64_MAX
    assert out["h"][:, 0].tolist() == [4.0, 8.0]  # MEAN of 5 and an unknown id: 8 / 2; then 5 alone
    assert list(serving(kjt).keys()) == ["f", "g", "h"]
    # A delta deletes -1 (kept aside of the slots) and INT64_MAX (its slot emptied, or a tombstone with
    # FBGEMM's kernels alone) and changes 0.
    serving.apply_version(_version("delta", {"a": ([0], [7.0], [-1, 2**63 - 1]), "b": ([], [], [])}, dtype))
    out = serving(kjt).to_dict()
    assert out["g"][:, 0].tolist() == [0.0, 0.0]
    assert out["f"][:, 0].tolist() == [11.0, 0.0]
    assert serving.table_sizes() == {"a": 2, "b": 1}


def test_weighted_bags_and_unpooled_tables() -> None:
    ebc = HashEmbeddingBagCollection(
        tables=[HashEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=8, feature_names=["f"])],
        is_weighted=True,
        device="meta",
    )
    serving = ServingEmbeddingBagCollection(ebc, "float32")
    serving.apply_version(_version("full", {"a": ([3, 4], [1.0, 10.0], [])}, "float32"))
    kjt = KeyedJaggedTensor(
        keys=["f"], values=torch.tensor([3, 4, 9]), lengths=torch.tensor([2, 1]), weights=torch.tensor([2.0, 0.5, 3.0])
    )
    assert serving(kjt).values()[:, 0].tolist() == [7.0, 0.0]
    ec = HashEmbeddingCollection(
        tables=[HashEmbeddingConfig(name="item", embedding_dim=4, num_embeddings=8, feature_names=["hist", "cand"])],
        device="meta",
    )
    unpooled = ServingEmbeddingCollection(ec, "float32")
    unpooled.apply_version(_version("full", {"item": ([-1, 6], [1.0, 6.0], [])}, "float32"))
    kjt = KeyedJaggedTensor(
        keys=["hist", "cand"], values=torch.tensor([6, -1, 8, 6]), lengths=torch.tensor([2, 1, 0, 1])
    )
    out = unpooled(kjt)
    assert out["hist"].values()[:, 0].tolist() == [6.0, 1.0, 0.0] and out["hist"].lengths().tolist() == [2, 1]
    assert out["cand"].values()[:, 0].tolist() == [6.0] and out["cand"].lengths().tolist() == [0, 1]


def test_a_staged_version_is_served_only_once_committed() -> None:
    ebc = HashEmbeddingBagCollection(
        tables=[HashEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=8, feature_names=["f"])],
        device="meta",
    )
    serving = ServingEmbeddingBagCollection(ebc, "float32")
    serving.apply_version(_version("full", {"a": ([3, 4], [1.0, 2.0], [])}, "float32"))
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([3, 4, 5]), lengths=torch.tensor([1, 1, 1]))
    # A delta that deletes 4 (its row goes to the new id 5) and changes 3.
    staged = serving.stage_version(_version("delta", {"a": ([3, 5], [7.0, 9.0], [4])}, "float32"))
    assert serving(kjt).values()[:, 0].tolist() == [1.0, 2.0, 0.0]  # the applied version, wholly
    serving.commit_version(staged)
    assert serving(kjt).values()[:, 0].tolist() == [7.0, 0.0, 9.0]
    # A full version in another dtype: a new kernel, served once committed.
    staged = serving.stage_version(_version("full", {"a": ([4], [5.0], [])}, "float16"))
    assert serving(kjt).values()[:, 0].tolist() == [7.0, 0.0, 9.0] and serving.dtype == "float32"
    serving.commit_version(staged)
    assert serving(kjt).values()[:, 0].tolist() == [0.0, 5.0, 0.0] and serving.dtype == "float16"
    with pytest.raises(ValueError, match="delta of float32 rows on top of float16 rows"):
        serving.stage_version(_version("delta", {"a": ([4], [1.0], [])}, "float32"))
    assert serving(kjt).values()[:, 0].tolist() == [0.0, 5.0, 0.0]


def _kjt(
    keys: list[str], values: list[int] | torch.Tensor, lengths: list[int], **kwargs: torch.Tensor | int
) -> KeyedJaggedTensor:
    ids = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    return KeyedJaggedTensor(keys=keys, values=ids, lengths=torch.tensor(lengths, dtype=torch.int64), **kwargs)


BAD_BATCHES = [
    (_kjt(["f", "x"], [1, 2], [1, 1]), ValueError, r"unknown \['?x'?\], missing \['?g'?\]"),
    (_kjt(["f", "g", "f"], [1, 2, 3], [1, 1, 1]), ValueError, r"repeat \['?f'?\]"),
    (_kjt(["f", "g"], torch.tensor([1.0, 2.0]), [1, 1]), TypeError, "ids of features .* must be int64 or int32"),
    (_kjt(["f", "g"], [], []), ValueError, "has a batch of 0 samples; it must be > 0"),
    (_kjt(["f", "g"], [1, 2, 3], [2, -1, 1, 1]), ValueError, r"negative lengths in features f \(sample 1: -1\)"),
    (_kjt(["f", "g"], [1, 2, 3], [2, 1, 1, 1]), ValueError, r"add up to 5 \(f: 3, g: 2\) but the KJT has 3 ids"),
    (_kjt(["f", "g"], torch.tensor([[1], [2]]), [1, 1]), ValueError, "ids of features .* must be 1-D, got 2-D"),
    (
        KeyedJaggedTensor(
            keys=["f", "g"],
            values=torch.tensor([1, 2, 3]),
            lengths=torch.tensor([1, 1, 1]),
            stride_per_key_per_rank=[[1], [2]],
        ),
        ValueError,
        "has a variable batch per feature",
    ),
    (  # as many lengths as features x its stride (the largest batch)
        KeyedJaggedTensor(
            keys=["f", "g"],
            values=torch.tensor([1, 2, 3, 4]),
            lengths=torch.tensor([1, 1, 1, 1]),
            stride_per_key_per_rank=[[2], [2]],
        ),
        ValueError,
        "has a variable batch per feature",
    ),
    (
        KeyedJaggedTensor(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.ones(2, dtype=torch.int16)),
        TypeError,
        "lengths of features .* must be int64 or int32, got (torch.int16|2)",
    ),
    (
        _kjt(["f", "g"], [1, 2, 3], [1, 1, 1], stride=2),
        ValueError,
        r"has 3 lengths for 2 features x batch 2; it needs one length per feature and sample \(4\)",
    ),
    (
        KeyedJaggedTensor(
            keys=["f", "g"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.ones(2, 2, dtype=torch.int64), stride=2
        ),
        ValueError,
        "has 4 lengths for 2 features x batch 2",
    ),
]


@pytest.mark.parametrize("scripted", [False, True])
@pytest.mark.parametrize(("kjt", "error", "match"), BAD_BATCHES)
def test_a_bad_batch_is_refused_naming_the_features_before_any_kernel(
    kjt: KeyedJaggedTensor, error: type[Exception], match: str, scripted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ebc = HashEmbeddingBagCollection(
        tables=[HashEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=8, feature_names=["f", "g"])],
        device="meta",
    )
    serving = ServingEmbeddingBagCollection(ebc, "float32")
    serving.apply_version(_version("full", {"a": ([1, 2, 3], [1.0, 2.0, 3.0], [])}, "float32"))
    if scripted:
        with pytest.raises(torch.jit.Error, match=f"ServingEmbeddingBagCollection: .*{match}"):
            torch.jit.script(serving)(kjt)
        return
    # Every FBGEMM kernel of a forward runs inside lookup_in_groups.
    monkeypatch.setattr(collections_module, "lookup_in_groups", _no_kernel)
    with pytest.raises(error, match=f"^ServingEmbeddingBagCollection: .*{match}"):
        serving(kjt)


def _no_kernel(*args: object) -> None:
    raise AssertionError("a bad batch reached an FBGEMM kernel")


@pytest.mark.parametrize("scripted", [False, True])
def test_int32_ids_and_lengths_are_served_as_int64(scripted: bool) -> None:
    ebc = HashEmbeddingBagCollection(
        tables=[HashEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=8, feature_names=["f", "g"])],
        device="meta",
    )
    serving = ServingEmbeddingBagCollection(ebc, "float32")
    serving.apply_version(_version("full", {"a": ([1, 2, 3], [1.0, 2.0, 3.0], [])}, "float32"))
    forward = torch.jit.script(serving) if scripted else serving
    wide = _kjt(["g", "f"], [1, 2, 3, 3], [2, 0, 1, 1])
    narrow = KeyedJaggedTensor(keys=["g", "f"], values=wide.values().int(), lengths=wide.lengths().int(), stride=2)
    expected = forward(wide).values()
    assert expected[:, 0].tolist() == [3.0, 3.0] and expected[:, 4].tolist() == [3.0, 0.0]  # f, then g
    assert torch.equal(forward(narrow).values(), expected)
    offsets, num_ids = check_batch(narrow, ["g", "f"], "test", False)
    assert offsets.dtype == torch.int64 and offsets.tolist() == [0, 2, 2, 3, 4] and num_ids == 4


def test_weights_and_an_unpooled_batch_are_checked() -> None:
    ebc = HashEmbeddingBagCollection(
        tables=[HashEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=8, feature_names=["f"])],
        is_weighted=True,
        device="meta",
    )
    weighted = ServingEmbeddingBagCollection(ebc, "float32")
    weighted.apply_version(_version("full", {"a": ([3], [1.0], [])}, "float32"))
    with pytest.raises(ValueError, match="is weighted but the KJT of features"):
        weighted(_kjt(["f"], [3], [1]))
    with pytest.raises(ValueError, match=r"has 2 weights \(1-D\); it needs one per id \(1, 1-D\)"):
        weighted(_kjt(["f"], [3], [1], weights=torch.tensor([1.0, 2.0])))
    with pytest.raises(TypeError, match=r"weights of features .* must be floating point, got torch.int64"):
        weighted(_kjt(["f"], [3], [1], weights=torch.tensor([1])))
    # float64 weights are served as float32
    assert weighted(_kjt(["f"], [3], [1], weights=torch.tensor([2.0], dtype=torch.float64))).values()[0, 0] == 2.0
    ec = HashEmbeddingCollection(
        tables=[HashEmbeddingConfig(name="item", embedding_dim=4, num_embeddings=8, feature_names=["hist"])],
        device="meta",
    )
    unpooled = ServingEmbeddingCollection(ec, "float32")
    unpooled.apply_version(_version("full", {"item": ([6], [6.0], [])}, "float32"))
    with pytest.raises(ValueError, match=r"^ServingEmbeddingCollection: negative lengths in features hist \(sample 0"):
        unpooled(_kjt(["hist"], [6], [-1, 2]))


def _random_kjt(keys: list[str], batch: int, ids: list[int], gen: torch.Generator, weighted: bool) -> KeyedJaggedTensor:
    """Up to 5 ids per bag, drawn from ``ids`` and from ids no table holds; empty bags too."""
    lengths = torch.randint(0, 6, (len(keys) * batch,), generator=gen)
    pool = torch.tensor([*ids, 10**12, -5], dtype=torch.int64)
    values = pool[torch.randint(0, pool.numel(), (int(lengths.sum()),), generator=gen)]
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


@pytest.mark.parametrize("dtype", ["float32", "uint8"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_lookup_split_over_threads_equals_one_lookup_bit_for_bit(dtype: str, weighted: bool) -> None:
    ebc = HashEmbeddingBagCollection(
        tables=[
            HashEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=64, feature_names=["f", "g"]),
            HashEmbeddingBagConfig(
                name="b", embedding_dim=8, num_embeddings=64, feature_names=["h"], pooling=PoolingType.MEAN
            ),
            HashEmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=64, feature_names=["k"]),
        ],
        is_weighted=weighted,
        device="meta",
    )
    serving = ServingEmbeddingBagCollection(ebc, dtype)
    gen = torch.Generator().manual_seed(0)
    ids = [*EDGE_IDS, *range(1, 40)]  # -1 too: the tables holding it are fixed up per group
    tables = {name: (ids, torch.rand(len(ids), generator=gen).tolist(), []) for name in ("a", "b", "c")}
    serving.apply_version(_version("full", tables, dtype, {"b": 8}))
    serving.lookup_threads = 3
    scripted = torch.jit.script(serving)
    for _ in range(5):
        kjt = _random_kjt(["h", "f", "k", "g"], 16, ids, gen, weighted)  # permuted keys
        serving.min_ids_per_group = 10**9
        one = serving(kjt).values()
        serving.min_ids_per_group = 1
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(kjt.permute([1, 3, 0, 2]).lengths())
        assert len(feature_bounds(offsets, 16, 4, 3, 1)) == 4  # three groups
        assert torch.equal(serving(kjt).values(), one)
        scripted.min_ids_per_group = 1
        assert torch.equal(scripted(kjt).values(), one)


def test_an_unpooled_lookup_split_over_threads_equals_one_lookup() -> None:
    ec = HashEmbeddingCollection(
        tables=[
            HashEmbeddingConfig(name="item", embedding_dim=4, num_embeddings=64, feature_names=["hist", "cand"]),
            HashEmbeddingConfig(name="user", embedding_dim=4, num_embeddings=64, feature_names=["user"]),
        ],
        device="meta",
    )
    serving = ServingEmbeddingCollection(ec, "float16")
    serving.lookup_threads = 3
    gen = torch.Generator().manual_seed(1)
    ids = [*EDGE_IDS, *range(1, 40)]
    values = torch.rand(len(ids), generator=gen).tolist()
    serving.apply_version(_version("full", {"item": (ids, values, []), "user": (ids, values, [])}, "float16"))
    for _ in range(5):
        kjt = _random_kjt(["hist", "cand", "user"], 16, ids, gen, False)
        serving.min_ids_per_group = 10**9
        one = serving(kjt)
        serving.min_ids_per_group = 1
        split = serving(kjt)
        for feature, jt in one.items():
            assert torch.equal(split[feature].values(), jt.values())
            assert torch.equal(split[feature].lengths(), jt.lengths())


def test_feature_bounds_cut_the_ids_into_even_groups() -> None:
    def bounds(ids_per_feature: list[int], threads: int, min_ids: int) -> list[int]:
        offsets = torch.tensor([0, *torch.tensor(ids_per_feature).cumsum(0).tolist()])  # batch of 1
        return feature_bounds(offsets, 1, len(ids_per_feature), threads, min_ids)

    assert bounds([100, 100, 100, 100], 2, 1) == [0, 2, 4]
    assert bounds([300, 50, 50, 0], 2, 1) == [0, 1, 4]
    assert bounds([300, 50, 50, 0], 3, 1) == [0, 1, 2, 4]
    assert bounds([10, 10, 10, 370], 2, 1) == [0, 3, 4]
    assert bounds([100, 100, 100, 100], 8, 1) == [0, 1, 2, 3, 4]  # at most a group per feature
    assert bounds([100, 100, 100, 100], 2, 300) == [0, 4]  # too few ids for two groups
    assert bounds([100, 100, 100, 100], 1, 1) == [0, 4]
    assert bounds([400], 4, 1) == [0, 1]
