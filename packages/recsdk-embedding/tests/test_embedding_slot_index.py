"""The two hash indexes behind IdTable: FBGEMM's kernels (CPU) and torch ops (CUDA, NPU)."""

from __future__ import annotations

import pytest
import torch

from recsdk.embedding import IdTable, LRUEviction, slot_index

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def _random_ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g, dtype=torch.int64)


def test_cpu_tables_use_fbgemm_kernels_when_loaded() -> None:
    assert IdTable(10).index_kind == ("fbgemm" if slot_index.fbgemm_index_available() else "torch")
    assert IdTable(10, device="meta").index_kind == "torch"


@pytest.mark.skipif(not slot_index.fbgemm_index_available(), reason="FBGEMM's kernels are not loaded")
def test_both_indexes_give_the_same_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The index only maps ids to rows: rows come from the free stack, so both agree exactly."""
    fast = IdTable(700, eviction=LRUEviction(), name="fast")
    monkeypatch.setattr(slot_index, "_use_fbgemm", lambda: False)
    plain = IdTable(700, eviction=LRUEviction(), name="plain")
    specials = torch.tensor([-1, INT64_MIN, INT64_MAX, 0, -2])
    structured = torch.arange(100, dtype=torch.int64) << 32  # equal low 32 bits
    for seed in range(12):  # 12 x 300 ids through 700 rows: eviction, tombstones and rehashes
        batch = torch.cat([_random_ids(300, seed), specials]) if seed % 3 == 0 else _random_ids(300, seed)
        if seed % 4 == 1:
            batch = torch.cat([batch, structured + seed])
        assert torch.equal(fast.find_or_insert(batch), plain.find_or_insert(batch))
        assert torch.equal(fast.take_reassigned_rows(), plain.take_reassigned_rows())
    probe = torch.cat([_random_ids(300, 11), _random_ids(300, 1), specials])
    assert torch.equal(fast.find(probe), plain.find(probe))


@pytest.mark.parametrize("capacity", [1, 7, 1000, 4097])
def test_index_bytes_is_what_the_index_holds(capacity: int) -> None:
    # The planner sizes host tables with it, without allocating them.
    for device in ("cpu", "meta"):
        table = IdTable(capacity, device=device)
        assert slot_index.index_bytes(capacity, torch.device(device)) == table._map.index.memory_bytes
