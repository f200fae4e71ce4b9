"""Fixtures shared by the recsdk-embedding tests."""

from __future__ import annotations

import pytest

from recsdk.embedding import slot_index


@pytest.fixture(params=["fbgemm", "torch"])
def index_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with each hash index on CPU: FBGEMM's kernels (the CPU default) and torch ops
    (what CUDA and NPU tables use)."""
    if request.param == "torch":
        monkeypatch.setattr(slot_index, "_use_fbgemm", lambda: False)
    elif not slot_index.fbgemm_index_available():
        pytest.skip("FBGEMM's pruned-hashmap kernels are not loaded")
    return str(request.param)
