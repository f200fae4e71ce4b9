"""ServingModel: served scores equal the trained model's eval scores, version after version."""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest
import torch
from serving_models import EVAL, TOLERANCE, Recommender, copy_versions, train_and_publish
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsdk.data.testing import run_distributed
from recsdk.embedding import PublicationError, list_versions
from recsdk.embedding.publication import manifest_checksum
from recsdk.serving import ServingEmbeddingBagCollection, ServingEmbeddingCollection, ServingModel


def _served(root: Path, copy: Path, records: list, dtype: str) -> list[str]:
    """Serve the versions one at a time (copied into ``copy`` as if published now) and compare."""
    problems = []
    serving = None
    for version, want in records:
        shutil.copytree(root / f"{version:08d}", copy / f"{version:08d}")
        if serving is None:
            serving = ServingModel(Recommender("cpu"), copy)
        else:
            assert serving.refresh() == 1
        assert serving.version == version
        for batch, scores in zip(EVAL, want, strict=True):
            got = serving(batch)[1]
            diff = float((got - scores).abs().max())
            if diff > TOLERANCE[dtype]:
                problems.append(f"v{version}: scores differ by {diff}")
    return problems


@pytest.mark.parametrize(
    ("sharding", "dtype", "cached"),
    [
        ("row_wise", "float32", False),
        ("table_wise", "float32", False),
        ("row_wise", "float32", True),
        ("row_wise", "float16", False),
        ("table_wise", "uint8", False),
    ],
)
def test_served_scores_equal_the_trained_models_eval_after_every_version(
    tmp_path: Path, sharding: str, dtype: str, cached: bool
) -> None:
    """Bag (SUM, MEAN) and unpooled tables with LRU and TTL eviction (evicted ids serve zeros,
    as in the trained model's eval), versions applied one by one as they would be published."""
    root = tmp_path / "pub"
    records = run_distributed(train_and_publish, 2, str(root), sharding, dtype, cached)[0]
    assert [v for v, _ in records] == [0, 1, 2, 3, 4]
    problems = _served(root, tmp_path / "served", records, dtype)
    assert problems == [], problems


# ---- faults -------------------------------------------------------------------------------------


def test_a_gap_raises_naming_the_missing_version_and_the_model_keeps_serving(
    tmp_path: Path, published: tuple[Path, list]
) -> None:
    root = copy_versions(published, tmp_path / "pub", [0, 1])
    serving = ServingModel(Recommender("cpu"), root)
    before = serving(EVAL[0])[1]
    copy_versions(published, root, [3])  # 2 is missing
    with pytest.raises(PublicationError, match="on top of version 2, which is missing"):
        serving.refresh()
    assert serving.version == 1
    assert torch.equal(serving(EVAL[0])[1], before)
    copy_versions(published, root, [2])
    assert serving.refresh() == 2 and serving.version == 3
    assert serving.refresh() == 0  # nothing newer: applied versions are not applied again


def test_a_newer_full_version_is_applied_without_the_deltas_before_it(
    tmp_path: Path, published: tuple[Path, list]
) -> None:
    root = copy_versions(published, tmp_path / "pub", [0])
    serving = ServingModel(Recommender("cpu"), root)
    copy_versions(published, root, [3, 4])  # 4 is full (full_every=4): 1-3 are not needed
    assert serving.refresh() == 1 and serving.version == 4
    want = published[1][4][1][0]
    assert float((serving(EVAL[0])[1] - want).abs().max()) <= TOLERANCE["float32"]


def test_a_damaged_or_foreign_file_is_refused_and_nothing_runs(tmp_path: Path, published: tuple[Path, list]) -> None:
    root = copy_versions(published, tmp_path / "pub", [0])
    serving = ServingModel(Recommender("cpu"), root)
    copy_versions(published, root, [1])
    target = root / "00000001" / "dense.safetensors"
    target.write_bytes(b"\0" + target.read_bytes()[1:])
    with pytest.raises(PublicationError, match=r"dense\.safetensors"):
        serving.refresh()
    assert serving.version == 0
    # A pickle where a data file belongs, with the manifest made to match: refused unread.
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    from recsdk.embedding.file_checksum import checksum

    target.write_bytes(pickle.dumps(Payload()))
    manifest_path = root / "00000001" / "manifest.json"
    import json

    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["dense.safetensors"] = {"size": target.stat().st_size, "crc32": checksum(str(target))}
    manifest["manifest_crc32"] = manifest_checksum(manifest)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(PublicationError, match="not a safetensors data file"):
        serving.refresh()
    assert not marker.exists() and serving.version == 0


def test_no_full_version_and_another_model_are_refused(tmp_path: Path, published: tuple[Path, list]) -> None:
    root = copy_versions(published, tmp_path / "pub", [1])  # a delta alone
    with pytest.raises(PublicationError, match="no complete full version"):
        ServingModel(Recommender("cpu"), root)
    root = copy_versions(published, tmp_path / "pub2", [0])
    other = Recommender("cpu")
    other.over = torch.nn.Linear(4 * 8, 2)
    with pytest.raises(ValueError, match=r"dense tensor 'over.weight': shape \[1, 32\] in version 0, \[2, 32\]"):
        ServingModel(other, root)


def test_forwards_during_a_refresh_see_one_version_wholly(tmp_path: Path, published: tuple[Path, list]) -> None:
    _, records = published
    root = copy_versions(published, tmp_path / "pub", [0])
    serving = ServingModel(Recommender("cpu"), root)
    expected = {v: scores[0] for v, scores in records}
    seen: list[str] = []
    stop = threading.Event()

    def predict() -> None:
        while not stop.is_set():
            got = serving(EVAL[0])[1]
            if not any(float((got - want).abs().max()) <= TOLERANCE["float32"] for want in expected.values()):
                seen.append("a forward saw scores of no single version")

    threads = [threading.Thread(target=predict) for _ in range(3)]
    for t in threads:
        t.start()
    for v in (1, 2, 3):
        copy_versions(published, root, [v])
        serving.refresh()
    stop.set()
    for t in threads:
        t.join()
    assert seen == []
    assert serving.version == 3


def test_follow_applies_new_versions_in_the_background(tmp_path: Path, published: tuple[Path, list]) -> None:
    root = copy_versions(published, tmp_path / "pub", [0])
    serving = ServingModel(Recommender("cpu"), root)
    serving.follow(interval_s=0.05)
    try:
        copy_versions(published, root, [1, 2])
        deadline = threading.Event()
        for _ in range(200):
            if serving.version == 2:
                break
            deadline.wait(0.05)
        assert serving.version == 2 and serving.last_error is None
        copy_versions(published, root, [4])  # 3 is missing, 4 is full: applied
        (root / "00000004" / "dense.safetensors").write_bytes(b"damaged")
        for _ in range(200):
            if serving.last_error is not None:
                break
            deadline.wait(0.05)
        assert isinstance(serving.last_error, PublicationError)
        assert serving.version == 2
    finally:
        serving.stop()


def test_the_serving_collections_work_under_torchscript(tmp_path: Path, published: tuple[Path, list]) -> None:
    root = copy_versions(published, tmp_path / "pub", [0, 1, 2])
    model = Recommender("cpu")
    serving = ServingModel(model, root)
    batch = EVAL[0]
    bags, seq = batch.sparse_features.split([2, 2])
    assert isinstance(model.ebc, ServingEmbeddingBagCollection) and isinstance(model.ec, ServingEmbeddingCollection)
    scripted_ebc, scripted_ec = torch.jit.script(model.ebc), torch.jit.script(model.ec)
    with torch.no_grad():
        assert torch.equal(scripted_ebc(bags).values(), model.ebc(bags).values())
        eager, scripted = model.ec(seq), scripted_ec(seq)
        for feature in ("history", "candidate"):
            assert torch.equal(scripted[feature].values(), eager[feature].values())
    assert serving.version == 2
    assert list_versions(root) == [0, 1, 2]


def test_bad_arguments_are_refused(tmp_path: Path, published: tuple[Path, list]) -> None:
    with pytest.raises(TypeError, match=r"model must be an nn\.Module, got str"):
        ServingModel("model", tmp_path)
    with pytest.raises(ValueError, match="holds no HashEmbeddingBagCollection"):
        ServingModel(torch.nn.Linear(2, 2), tmp_path)
    serving = ServingModel(Recommender("cpu"), copy_versions(published, tmp_path / "pub", [0]))
    with pytest.raises(ValueError, match="interval_s must be a number > 0, got 0"):
        serving.follow(interval_s=0)


def test_a_bad_batch_is_refused_naming_the_feature_and_the_model_keeps_serving(
    tmp_path: Path, published: tuple[Path, list]
) -> None:
    serving = ServingModel(Recommender("cpu"), copy_versions(published, tmp_path / "pub", [0]))
    good = EVAL[0]
    before = serving(good)[1]
    kjt = good.sparse_features
    lengths = kjt.lengths().clone()
    first_tag = kjt.stride()  # the keys are user, tag, history, candidate
    lengths[first_tag + 3] = -lengths[first_tag + 3] - 1
    bad = copy.copy(good)
    bad.sparse_features = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=lengths)
    msg = r"^ServingEmbeddingBagCollection: negative lengths in features tag \(sample 3:"
    with pytest.raises(ValueError, match=msg):
        serving(bad)
    assert torch.equal(serving(good)[1], before)
