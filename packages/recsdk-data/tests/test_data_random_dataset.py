import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchmetrics.functional import auroc

from recsdk.data import Batch, RandomRecDataset
from recsdk.data.testing import run_distributed

FEATURES = ["user", "item", "shop", "tag"]


def _same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and a.sparse_features.keys() == b.sparse_features.keys()
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


def _ids(batches: list[Batch], key: str) -> torch.Tensor:
    return torch.cat([b.sparse_features[key].values() for b in batches])


def test_batches_have_the_documented_layout() -> None:
    ds = RandomRecDataset(64, 3, FEATURES, [10, 100, 1000, 10_000], num_dense_features=5, seed=1)
    batches = list(ds)
    assert len(batches) == len(ds) == 3
    for b in batches:
        assert b.batch_size == 64
        assert b.dense_features.shape == (64, 5) and b.dense_features.dtype == torch.float32
        assert b.labels.shape == (64,) and set(b.labels.unique().tolist()) <= {0.0, 1.0}
        kjt = b.sparse_features
        assert kjt.keys() == FEATURES and kjt.stride() == 64
        assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int32


def test_ids_are_raw_int64_and_bounded_per_feature() -> None:
    ds = RandomRecDataset(512, 8, ["small", "big"], [37, 1_000_000], id_distribution="uniform")
    batches = list(ds)
    small, big = _ids(batches, "small"), _ids(batches, "big")
    assert small.unique().numel() == 37  # 4096 uniform draws hit all 37 ids
    assert (big < 0).any() and (big > 0).any()
    assert big.abs().min() > 2**32 and big.abs().max() > 2**60  # spread over the int64 range, not 0..N
    assert not torch.isin(small, torch.arange(1_000_000)).any()


def test_zipf_concentrates_on_popular_ids() -> None:
    def top_share(distribution: str) -> float:
        ids = _ids(list(RandomRecDataset(1000, 4, ["f"], 10_000, id_distribution=distribution)), "f")
        _, counts = ids.unique(return_counts=True)
        return float(counts.max()) / ids.numel()

    assert top_share("zipf") > 0.05  # the most popular id of a Zipf(1.05) feature
    assert top_share("uniform") < 0.01


def test_pooling_factors_set_the_mean_bag_length_and_bags_can_be_empty() -> None:
    ds = RandomRecDataset(2000, 2, ["one", "three"], 1000, pooling_factors=[1, 3.0])
    batches = list(ds)
    for key, mean in (("one", 1.0), ("three", 3.0)):
        lengths = torch.cat([b.sparse_features[key].lengths() for b in batches]).double()
        assert lengths.mean().item() == pytest.approx(mean, rel=0.05)
        assert (lengths == 0).any() and (lengths > mean).any()
    empty = RandomRecDataset(8, 1, ["f"], 10, pooling_factors=0).make_batch(0)
    assert empty.sparse_features.values().numel() == 0


def test_same_seed_same_batches_other_seeds_differ() -> None:
    first = list(RandomRecDataset(32, 3, FEATURES, 1000, seed=7))
    again = list(RandomRecDataset(32, 3, FEATURES, 1000, seed=7))
    assert all(_same(a, b) for a, b in zip(first, again, strict=True))
    other = list(RandomRecDataset(32, 3, FEATURES, 1000, seed=8))
    assert not _same(first[0], other[0])
    # Another sample_seed: fresh samples over the same ids and the same teacher.
    held_out_ds = RandomRecDataset(256, 2, FEATURES, 20, seed=7, sample_seed=99)
    held_out = list(held_out_ds)
    assert not _same(first[0], held_out[0])
    train_ds = RandomRecDataset(256, 2, FEATURES, 20, seed=7)
    assert set(_ids(held_out, "user").tolist()) == set(_ids(list(train_ds), "user").tolist())
    assert torch.equal(train_ds.probabilities(held_out[0]), held_out_ds.probabilities(held_out[0]))


def test_ranks_get_different_samples_from_the_same_teacher() -> None:
    r0 = RandomRecDataset(64, 2, FEATURES, 100, rank=0, world_size=2)
    r1 = RandomRecDataset(64, 2, FEATURES, 100, rank=1, world_size=2)
    b0, b1 = next(iter(r0)), next(iter(r1))
    assert not _same(b0, b1)
    assert torch.equal(r0.probabilities(b1), r1.probabilities(b1))


def test_labels_follow_the_teacher_and_bayes_auc_matches_the_docstring() -> None:
    ds = RandomRecDataset(2000, 50, FEATURES, 100_000, seed=0)
    probs, labels = [], []
    for b in ds:
        probs.append(ds.probabilities(b))
        labels.append(b.labels)
    p, y = torch.cat(probs), torch.cat(labels)
    assert y.mean().item() == pytest.approx(p.mean().item(), abs=0.01)  # labels ~ Bernoulli(p)
    bayes = auroc(p.float(), y.long(), task="binary").item()
    assert bayes == pytest.approx(0.88, abs=0.015)


def test_probabilities_reject_ids_from_elsewhere() -> None:
    ds = RandomRecDataset(16, 1, FEATURES, 100, seed=0)
    other = RandomRecDataset(16, 1, FEATURES, 100, seed=1).make_batch(0)
    with pytest.raises(ValueError, match=r"feature 'user': id -?\d+ was not produced by this dataset"):
        ds.probabilities(other)
    with pytest.raises(ValueError, match=r"batch has sparse features \['a'\]"):
        ds.probabilities(RandomRecDataset(16, 1, ["a"], 100).make_batch(0))


def test_dataloader_workers_split_batches_without_changing_them() -> None:
    ds = RandomRecDataset(16, 5, FEATURES, 1000, seed=3)
    direct = list(ds)
    via_workers = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(via_workers) == 5
    assert all(_same(a, b) for a, b in zip(direct, via_workers, strict=True))


def _rank_batches(rank: int, world_size: int) -> list[list[int]]:
    ds = RandomRecDataset(8, 2, ["f"], 10**6, seed=0)  # rank and world size from torch.distributed
    batches = list(ds)
    assert all(_same(b, ds.make_batch(i, rank=rank)) for i, b in enumerate(batches))
    return [b.sparse_features.values().tolist() for b in batches]


def test_rank_defaults_to_torch_distributed() -> None:
    r0, r1 = run_distributed(_rank_batches, 2)
    assert r0 != r1


def _auc_of_small_model(ds: RandomRecDataset, held_out: RandomRecDataset) -> float:
    gen = torch.Generator().manual_seed(0)
    vocab: list[dict[int, int]] = [{} for _ in ds.feature_names]
    tables = torch.nn.ModuleList(torch.nn.EmbeddingBag(n, 8, mode="mean") for n in ds.id_ranges)  # rows: ids seen
    for t in tables:
        torch.nn.init.normal_(t.weight, std=0.01, generator=gen)
    head = torch.nn.Linear(8 * len(ds.feature_names) + ds.num_dense_features, 1)
    opt = torch.optim.Adagrad([*tables.parameters(), *head.parameters()], lr=0.05)

    def forward(batch: Batch) -> torch.Tensor:
        pooled = []
        for f, key in enumerate(ds.feature_names):
            jt = batch.sparse_features[key]
            rows = torch.tensor([vocab[f].setdefault(i, len(vocab[f])) for i in jt.values().tolist()])
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), jt.lengths().long().cumsum(0)[:-1]])
            pooled.append(tables[f](rows, offsets))
        return head(torch.cat([*pooled, batch.dense_features], dim=1)).squeeze(1)

    for batch in ds:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(forward(batch), batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        scores, labels = zip(*((torch.sigmoid(forward(b)), b.labels) for b in held_out), strict=True)
    return auroc(torch.cat(scores), torch.cat(labels).long(), task="binary").item()


def test_a_small_model_learns_the_task() -> None:
    train = RandomRecDataset(256, 200, FEATURES, 10_000, seed=0)
    held_out = RandomRecDataset(256, 20, FEATURES, 10_000, seed=0, sample_seed=1)
    auc = _auc_of_small_model(train, held_out)
    print(f"held-out AUC {auc:.3f}")
    assert auc > 0.75


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"batch_size": 0}, ValueError, r"batch_size must be >= 1, got 0"),
        ({"batch_size": 2.0}, TypeError, r"batch_size must be an int, got float"),
        ({"num_batches": -1}, ValueError, r"num_batches must be >= 0, got -1"),
        ({"feature_names": []}, ValueError, r"feature_names must not be empty"),
        ({"feature_names": "user"}, TypeError, r"feature_names must be a sequence of strings"),
        ({"feature_names": ["a", "a"]}, ValueError, r"duplicates \['a'\]"),
        ({"feature_names": ["a", ""]}, ValueError, r"non-empty strings, got ''"),
        ({"id_ranges": 0}, ValueError, r"id_ranges for feature 'user' must be >= 1, got 0"),
        ({"id_ranges": [10, 10]}, ValueError, r"id_ranges has 2 entries but there are 4 features"),
        ({"id_ranges": 2**63}, ValueError, r"must be <= 9223372036854775807"),
        ({"num_dense_features": -1}, ValueError, r"num_dense_features must be >= 0"),
        ({"pooling_factors": -0.5}, ValueError, r"pooling_factors for feature 'user' must be >= 0.0, got -0.5"),
        ({"pooling_factors": float("nan")}, ValueError, r"pooling_factors for feature 'user' must be finite"),
        ({"id_distribution": "normal"}, ValueError, r"id_distribution must be one of \('zipf', 'uniform'\)"),
        ({"zipf_alpha": 0}, ValueError, r"zipf_alpha must be > 0.0, got 0"),
        ({"seed": -1}, ValueError, r"seed must be >= 0, got -1"),
        ({"sample_seed": -2}, ValueError, r"sample_seed must be >= 0, got -2"),
        ({"rank": 1}, ValueError, r"give both rank and world_size"),
        ({"rank": 3, "world_size": 2}, ValueError, r"rank must be in \[0, world_size=2\), got 3"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], error: type, pattern: str) -> None:
    args: dict[str, object] = {"batch_size": 8, "num_batches": 1, "feature_names": FEATURES}
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        RandomRecDataset(**args)  # type: ignore[arg-type]


def test_alpha_one_and_huge_id_ranges_work() -> None:
    ds = RandomRecDataset(256, 1, ["f"], 2**62, zipf_alpha=1.0)
    batch = ds.make_batch(0)
    assert ds.probabilities(batch).shape == (256,)
    assert np.unique(batch.sparse_features.values().numpy()).size > 10


def test_elastic_resume_continues_every_new_rank_at_the_same_batch() -> None:
    def reader(rank: int, world_size: int) -> RandomRecDataset:
        return RandomRecDataset(8, 10, ["a", "b"], 1000, seed=1, rank=rank, world_size=world_size)

    old = reader(0, 2)
    it = iter(old)
    for _ in range(4):
        next(it)
    state = old.state_dict()
    for rank in range(3):  # 2 ranks -> 3: each new rank starts at batch 4 of its own stream
        new = reader(rank, 3)
        new.load_state_dict(state)
        got = list(new)
        expected = list(reader(rank, 3))[4:]
        assert len(got) == len(expected) == 6
        assert all(torch.equal(a.dense_features, b.dense_features) for a, b in zip(got, expected, strict=True))
    with pytest.raises(ValueError, match=r"rank 0 \(this reader: 1\)"):  # same world size: its own rank's
        reader(1, 2).load_state_dict(state)
