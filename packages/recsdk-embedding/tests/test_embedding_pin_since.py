"""IdTable.pin_since: a step watermark pins every row last used at or after a step.

A pipeline pins the rows of its batches in flight this way (they are the table's latest steps),
so eviction, TTL sweeps and removal must pass over those rows exactly as over rows pinned by
reference, and num_pinned must count them.
"""

from __future__ import annotations

import pytest
import torch

from recsdk.embedding import IdTable, LFUEviction, LRUEviction, TableFullError, TTLEviction


def _one_id_per_step(table: IdTable, ids: list[int]) -> list[int]:
    return [int(table.find_or_insert(torch.tensor([i]))) for i in ids]


def test_lru_evicts_around_the_watermark_and_refuses_when_only_pinned_rows_are_left() -> None:
    table = IdTable(4, eviction=LRUEviction(), name="lru")
    rows = _one_id_per_step(table, [1, 2, 3, 4])  # steps 1..4
    table.pin_since(2)  # ids 2, 3, 4 (last used at steps 2, 3, 4) are pinned
    assert table.num_pinned() == 3
    assert int(table.find_or_insert(torch.tensor([5]))) == rows[0]  # the one unpinned row goes
    assert table.find(torch.tensor([1, 2, 3, 4])).tolist() == [-1, *rows[1:]]
    with pytest.raises(TableFullError, match="pinned"):  # id 5, placed at step 5, is pinned too
        table.find_or_insert(torch.tensor([6]))
    table.pin_since(None)
    assert table.num_pinned() == 0
    assert int(table.find_or_insert(torch.tensor([6]))) == rows[1]  # now the least recently used


def test_lfu_and_ttl_pass_over_rows_above_the_watermark() -> None:
    lfu = IdTable(3, eviction=LFUEviction(), name="lfu")
    rows = _one_id_per_step(lfu, [1, 2, 3])
    lfu.find_or_insert(torch.tensor([1, 1]))  # id 1: freq 2, used at step 4
    lfu.pin_since(3)  # ids 3 and 1 pinned: the least frequent unpinned is id 2
    assert int(lfu.find_or_insert(torch.tensor([4]))) == rows[1]

    ttl = IdTable(4, eviction=TTLEviction(max_idle_steps=10), name="ttl")
    _one_id_per_step(ttl, [1, 2, 3])
    ttl.pin_since(2)
    assert ttl.evict_idle(0).tolist() == [0]  # id 1 only: ids 2 and 3 are pinned
    assert len(ttl) == 2


def test_remove_refuses_rows_above_the_watermark() -> None:
    table = IdTable(4, eviction=LRUEviction(), name="rm")
    _one_id_per_step(table, [1, 2])
    table.pin_since(2)
    with pytest.raises(ValueError, match="pinned"):
        table.remove(torch.tensor([2]))
    assert table.remove(torch.tensor([1])).tolist() == [0]


def test_watermark_and_references_together_and_load_drops_the_watermark() -> None:
    table = IdTable(4, eviction=LRUEviction(), name="both")
    rows = _one_id_per_step(table, [1, 2, 3])
    table.pin(torch.tensor([rows[0]]))
    table.pin_since(3)
    assert table.num_pinned() == 2  # id 1 by reference, id 3 by step
    with pytest.raises(RuntimeError, match="pinned"):
        table.load_state_dict(table.state_dict())
    table.unpin(torch.tensor([rows[0]]))
    with pytest.raises(RuntimeError, match="pinned"):  # the watermark pins too
        table.load_state_dict(table.state_dict())
    table.pin_since(None)
    table.load_state_dict(table.state_dict())
    assert table.num_pinned() == 0


def test_a_table_without_eviction_is_pinned_by_references_only() -> None:
    table = IdTable(4, name="plain")
    _one_id_per_step(table, [1, 2])
    table.pin_since(0)
    assert table.num_pinned() == 0


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_bad_step_names_table_and_value(step: object) -> None:
    table = IdTable(4, eviction=LRUEviction(), name="user")
    with pytest.raises(ValueError, match=r"IdTable 'user'\.pin_since.*int >= 0"):
        table.pin_since(step)  # type: ignore[arg-type]
