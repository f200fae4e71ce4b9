"""ServingModel: served scores equal the trained model's eval scores, version after version."""

from __future__ import annotations

import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from serving_models import Recommender, make_batch, rank_slice, shard

from recsdk.data.testing import run_distributed
from recsdk.embedding import PublicationError, list_versions
from recsdk.serving import ServingEmbeddingBagCollection, ServingEmbeddingCollection, ServingModel
from recsdk.sharding import Publisher

GLOBAL_BATCH = 32
EVAL = [make_batch(64, seed=1000 + i) for i in range(2)]  # held out, the same on every rank
TOLERANCE = {"float32": 1e-6, "float16": 2e-3, "uint8": 3e-2}  # on probabilities


def _train_and_publish(rank: int, world_size: int, root: str, sharding: str, dtype: str) -> list:
    """Train, publish a version every few steps, and score the held-out batches with the trained
    model in eval mode after each: ``[(version, scores)]`` on rank 0."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dmp = shard(Recommender("meta"), sharding, GLOBAL_BATCH // world_size)
    dense_opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "dense" in n or "over" in n], lr=0.1)
    publisher = Publisher(dmp, root, full_every=4, dtype=getattr(torch, dtype), keep=100)
    records = []
    step = 0
    for steps in (3, 2, 4, 1, 3):
        for _ in range(steps):
            loss, _ = dmp(rank_slice(make_batch(GLOBAL_BATCH, seed=step), rank, world_size))
            loss.backward()
            dense_opt.step()
            dense_opt.zero_grad()
            step += 1
        version = publisher.publish(step=step)
        dmp.eval()
        with torch.no_grad():
            local = [dmp(rank_slice(b, rank, world_size))[1] for b in EVAL]
        dmp.train()
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, local)
        records.append((version, [torch.cat([part[i] for part in everyone]) for i in range(len(EVAL))]))
    return records


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
    ("sharding", "dtype"), [("row_wise", "float32"), ("table_wise", "float32"), ("row_wise", "uint8")]
)
def test_served_scores_equal_the_trained_models_eval_after_every_version(
    tmp_path: Path, sharding: str, dtype: str
) -> None:
    root = tmp_path / "pub"
    records = run_distributed(_train_and_publish, 2, str(root), sharding, dtype)[0]
    assert [v for v, _ in records] == [0, 1, 2, 3, 4]
    problems = _served(root, tmp_path / "served", records, dtype)
    assert problems == [], problems


# ---- faults -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("published") / "pub"
    records = run_distributed(_train_and_publish, 2, str(root), "row_wise", "float32")[0]
    return root, records


def _copy(published: tuple[Path, list], to: Path, versions: list[int]) -> Path:
    root, _ = published
    for v in versions:
        shutil.copytree(root / f"{v:08d}", to / f"{v:08d}")
    return to


def test_a_gap_raises_naming_the_missing_version_and_the_model_keeps_serving(
    tmp_path: Path, published: tuple[Path, list]
) -> None:
    root = _copy(published, tmp_path / "pub", [0, 1])
    serving = ServingModel(Recommender("cpu"), root)
    before = serving(EVAL[0])[1]
    _copy(published, root, [3])  # 2 is missing
    with pytest.raises(PublicationError, match="on top of version 2, which is missing"):
        serving.refresh()
    assert serving.version == 1
    assert torch.equal(serving(EVAL[0])[1], before)
    _copy(published, root, [2])
    assert serving.refresh() == 2 and serving.version == 3
    assert serving.refresh() == 0  # nothing newer: applied versions are not applied again


def test_a_newer_full_version_is_applied_without_the_deltas_before_it(
    tmp_path: Path, published: tuple[Path, list]
) -> None:
    root = _copy(published, tmp_path / "pub", [0])
    serving = ServingModel(Recommender("cpu"), root)
    _copy(published, root, [3, 4])  # 4 is full (full_every=4): 1-3 are not needed
    assert serving.refresh() == 1 and serving.version == 4
    want = published[1][4][1][0]
    assert float((serving(EVAL[0])[1] - want).abs().max()) <= TOLERANCE["float32"]


def test_a_damaged_or_foreign_file_is_refused_and_nothing_runs(tmp_path: Path, published: tuple[Path, list]) -> None:
    root = _copy(published, tmp_path / "pub", [0])
    serving = ServingModel(Recommender("cpu"), root)
    _copy(published, root, [1])
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
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(PublicationError, match="not a safetensors data file"):
        serving.refresh()
    assert not marker.exists() and serving.version == 0


def test_no_full_version_and_another_model_are_refused(tmp_path: Path, published: tuple[Path, list]) -> None:
    root = _copy(published, tmp_path / "pub", [1])  # a delta alone
    with pytest.raises(PublicationError, match="no complete full version"):
        ServingModel(Recommender("cpu"), root)
    root = _copy(published, tmp_path / "pub2", [0])
    other = Recommender("cpu")
    other.over = torch.nn.Linear(4 * 8, 2)
    with pytest.raises(ValueError, match=r"dense tensor 'over.weight': shape \[1, 32\] in version 0, \[2, 32\]"):
        ServingModel(other, root)


def test_forwards_during_a_refresh_see_one_version_wholly(tmp_path: Path, published: tuple[Path, list]) -> None:
    _, records = published
    root = _copy(published, tmp_path / "pub", [0])
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
        _copy(published, root, [v])
        serving.refresh()
    stop.set()
    for t in threads:
        t.join()
    assert seen == []
    assert serving.version == 3


def test_follow_applies_new_versions_in_the_background(tmp_path: Path, published: tuple[Path, list]) -> None:
    root = _copy(published, tmp_path / "pub", [0])
    serving = ServingModel(Recommender("cpu"), root)
    serving.follow(interval_s=0.05)
    try:
        _copy(published, root, [1, 2])
        deadline = threading.Event()
        for _ in range(200):
            if serving.version == 2:
                break
            deadline.wait(0.05)
        assert serving.version == 2 and serving.last_error is None
        _copy(published, root, [4])  # 3 is missing, 4 is full: applied
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
    root = _copy(published, tmp_path / "pub", [0, 1, 2])
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
