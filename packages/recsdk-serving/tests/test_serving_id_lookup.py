"""Which id lookup a forward runs: recsdk's ``pruned_slots_lookup`` op from ``native_min_ids`` ids
(eager and scripted), FBGEMM's below that or without recsdk's kernel, with the same scores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
from recsdk.embedding.slot_lookup import native_lookup_available, native_lookup_unavailable_reason
from recsdk.serving import ServingEmbeddingBagCollection, ServingEmbeddingCollection
from recsdk.serving.grouped_lookup import NATIVE_MIN_IDS

OURS, FBGEMMS = "recsdk::pruned_slots_lookup", "fbgemm::pruned_hashmap_lookup"
IDS = [-1, 0, 2**63 - 1, -(2**63), *range(1, 60)]


def _version(kind: str, tables: dict[str, tuple[list[int], list[int]]], dtype: str, dim: int) -> PublishedVersion:
    """Each id's row is ``dim`` times its value; ``(ids, deleted)`` per table."""
    published = {}
    for name, (ids, deleted) in tables.items():
        values = torch.arange(1, len(ids) + 1, dtype=torch.float32).unsqueeze(1).expand(len(ids), dim).contiguous()
        published[name] = PublishedTable(
            torch.tensor(ids, dtype=torch.int64), encode_rows(values, dtype), torch.tensor(deleted, dtype=torch.int64)
        )
    return PublishedVersion(0, None, kind, 0, dtype, published, {}, {})


def _kjt(keys: list[str], batch: int, gen: torch.Generator, weighted: bool = False) -> KeyedJaggedTensor:
    """0-5 ids a bag: held ones (-1 too), ids no table holds, empty bags."""
    lengths = torch.randint(0, 6, (len(keys) * batch,), generator=gen)
    pool = torch.tensor([*IDS, 10**12, -5], dtype=torch.int64)
    values = pool[torch.randint(0, pool.numel(), (int(lengths.sum()),), generator=gen)]
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def _lookups(fn: object, *args: object) -> set[str]:
    """The id lookups ``fn(*args)`` ran."""
    with torch.autograd.profiler.profile() as prof:
        fn(*args)  # type: ignore[operator]
    return {e.name for e in prof.function_events} & {OURS, FBGEMMS}


@pytest.mark.skipif(not native_lookup_available(), reason=f"not built: {native_lookup_unavailable_reason()}")
@pytest.mark.parametrize("dtype", ["float32", "uint8"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_forwards_on_recsdks_lookup_equal_those_on_fbgemms(dtype: str, weighted: bool) -> None:
    ebc = HashEmbeddingBagCollection(
        tables=[
            HashEmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=80, feature_names=["f", "g"]),
            HashEmbeddingBagConfig(
                name="b", embedding_dim=8, num_embeddings=80, feature_names=["h"], pooling=PoolingType.MEAN
            ),
        ],
        is_weighted=weighted,
        device="meta",
    )
    serving = ServingEmbeddingBagCollection(ebc, dtype)
    assert serving.native_min_ids == NATIVE_MIN_IDS
    serving.apply_version(_version("full", {"a": (IDS, []), "b": (IDS[:30], [])}, dtype, 8))
    # A delta removes ids (the -1 kept aside, and one from the slots) and adds one.
    serving.apply_version(_version("delta", {"a": ([10**9], [-1, 5]), "b": ([], [])}, dtype, 8))
    gen = torch.Generator().manual_seed(0)
    for threads in (1, 2):
        serving.lookup_threads = threads
        serving.min_ids_per_group = 1
        scripted = torch.jit.script(serving)
        for _ in range(3):
            kjt = _kjt(["h", "f", "g"], 64, gen, weighted)
            serving.native_min_ids = -1
            expected = serving(kjt).values()
            assert _lookups(serving, kjt) == {FBGEMMS}
            for module in (serving, scripted):
                module.native_min_ids = 0
                assert torch.equal(module(kjt).values(), expected)
                assert _lookups(module, kjt) == {OURS}
                module.native_min_ids = 10**9  # fewer ids than that: FBGEMM's
                assert torch.equal(module(kjt).values(), expected)
                assert _lookups(module, kjt) == {FBGEMMS}


@pytest.mark.skipif(not native_lookup_available(), reason=f"not built: {native_lookup_unavailable_reason()}")
def test_unpooled_forwards_on_recsdks_lookup_equal_those_on_fbgemms() -> None:
    ec = HashEmbeddingCollection(
        tables=[
            HashEmbeddingConfig(name="item", embedding_dim=4, num_embeddings=80, feature_names=["hist", "cand"]),
            HashEmbeddingConfig(name="user", embedding_dim=4, num_embeddings=80, feature_names=["user"]),
        ],
        device="meta",
    )
    serving = ServingEmbeddingCollection(ec, "float16")
    serving.apply_version(_version("full", {"item": (IDS, []), "user": (IDS[::2], [])}, "float16", 4))
    scripted = torch.jit.script(serving)
    kjt = _kjt(["hist", "cand", "user"], 200, torch.Generator().manual_seed(1))
    assert kjt.values().numel() >= NATIVE_MIN_IDS
    serving.native_min_ids = -1
    expected = serving(kjt)
    for module in (serving, scripted):
        module.native_min_ids = NATIVE_MIN_IDS
        assert _lookups(module, kjt) == {OURS}
        out = module(kjt)
        for feature, jt in expected.items():
            assert torch.equal(out[feature].values(), jt.values())


def test_without_recsdks_kernel_forwards_run_fbgemms_lookup(tmp_path: Path) -> None:
    """``RECSDK_NATIVE_KERNELS=0``: the collection never calls the op, eager or scripted."""
    code = (
        "import torch\n"
        "from torchrec.sparse.jagged_tensor import KeyedJaggedTensor\n"
        "from recsdk.embedding import HashEmbeddingBagCollection, HashEmbeddingBagConfig\n"
        "from recsdk.serving import ServingEmbeddingBagCollection\n"
        "from test_serving_id_lookup import FBGEMMS, _lookups, _version\n"
        "ebc = HashEmbeddingBagCollection(tables=[HashEmbeddingBagConfig(name='a', embedding_dim=4,"
        " num_embeddings=16, feature_names=['f'])], device='meta')\n"
        "serving = ServingEmbeddingBagCollection(ebc, 'float32')\n"
        "assert serving.native_min_ids == -1, serving.native_min_ids\n"
        "serving.apply_version(_version('full', {'a': ([3, 4], [])}, 'float32', 4))\n"
        "kjt = KeyedJaggedTensor(keys=['f'], values=torch.tensor([3, 4, 5] * 400), lengths=torch.full((400,), 3))\n"
        "scripted = torch.jit.script(serving)\n"
        "for module in (serving, scripted):\n"
        "    assert module(kjt).values()[:, 0].tolist() == [3.0] * 400\n"
        "    assert _lookups(module, kjt) == {FBGEMMS}\n"
    )
    env = {
        **os.environ,
        "RECSDK_CACHE_DIR": str(tmp_path),
        "RECSDK_NATIVE_KERNELS": "0",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
