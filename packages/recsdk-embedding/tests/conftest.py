"""Fixtures shared by the recsdk-embedding tests."""

from __future__ import annotations

import pytest

from recsdk.embedding import count_sketch, id_table_eviction, slot_index
from recsdk.embedding.slot_kernels import native_slot_kernels


@pytest.fixture(params=["native", "fbgemm", "torch"])
def index_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with each hash index on CPU: FBGEMM's layout run by recsdk's kernels (the CPU
    default; the admission sketch and the eviction queue run recsdk's too), by FBGEMM's kernels
    alone (where recsdk's are not built: the sketch and the queue in torch ops), and torch ops
    for all (what CUDA and NPU tables use)."""
    if request.param == "torch":
        monkeypatch.setattr(slot_index, "_use_fbgemm", lambda: False)
        monkeypatch.setattr(count_sketch, "native_slot_kernels", lambda: None)
        monkeypatch.setattr(id_table_eviction, "native_slot_kernels", lambda: None)
        return "torch"
    if not slot_index.fbgemm_index_available():
        pytest.skip("FBGEMM's pruned-hashmap kernels are not loaded")
    if request.param == "fbgemm":
        monkeypatch.setattr(slot_index, "native_slot_kernels", lambda: None)
        monkeypatch.setattr(count_sketch, "native_slot_kernels", lambda: None)
        monkeypatch.setattr(id_table_eviction, "native_slot_kernels", lambda: None)
    elif native_slot_kernels() is None:
        pytest.skip("recsdk's slot kernels are not built here")
    return str(request.param)
