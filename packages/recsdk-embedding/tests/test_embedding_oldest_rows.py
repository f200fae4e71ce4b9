"""Eviction by last use from the queue of the oldest rows frees what a scan of the whole table frees."""

from __future__ import annotations

import pytest
import torch

from recsdk.embedding import CountAdmission, IdTable, LRUEviction, TableFullError, TTLEviction, id_table_eviction
from recsdk.embedding.oldest_rows import OldestRows
from recsdk.embedding.slot_kernels import native_slot_kernels, native_unavailable_reason


def _run(policy, seed: int, pin: bool, admission: bool) -> tuple[list[torch.Tensor], list, dict]:
    """A table through 200 steps of skewed ids; every step's rows and reassigned rows."""
    g = torch.Generator().manual_seed(seed)
    table = IdTable(500, eviction=policy, admission=CountAdmission(threshold=2) if admission else None, name="t")
    seen: list[torch.Tensor] = []
    held: list[torch.Tensor] = []
    for step in range(200):
        ids = (torch.randint(0, 3000, (120,), generator=g) ** 2) % 5003
        rows = table.find_or_insert(ids)
        seen += [rows, table.take_reassigned_rows()]
        if pin:  # a pipeline holds the last batch's rows
            table.pin(rows)
            held.append(rows)
            if len(held) > 1:
                table.unpin(held.pop(0))
        if step == 100:  # rows placed with old last steps: the oldest now, whatever was scanned
            for rows_held in held:
                table.unpin(rows_held)
            held.clear()
            stored_ids, stored_rows = table.ids_and_rows()
            table.remove(stored_ids[:30])
            table.state.insert_at(
                torch.arange(10**9, 10**9 + 30), stored_rows[:30], last_step=torch.zeros(30, dtype=torch.int64)
            )
    ids, rows = table.ids_and_rows()
    return seen, [ids, rows], table.stats()


@pytest.mark.parametrize("policy", [LRUEviction(), TTLEviction(max_idle_steps=50)], ids=["lru", "ttl"])
@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("admission", [False, True])
@pytest.mark.parametrize("queue", ["native", "torch"])
def test_the_queue_frees_the_rows_a_full_scan_frees_in_its_order(
    monkeypatch, policy, pin: bool, admission: bool, queue: str
) -> None:
    """The queue, run by recsdk's kernels or by torch ops, frees exactly the victims of a full scan."""
    if queue == "torch":
        monkeypatch.setattr(id_table_eviction, "native_slot_kernels", lambda: None)
    elif native_slot_kernels() is None:
        pytest.skip(f"recsdk's kernels are not built: {native_unavailable_reason()}")
    with monkeypatch.context() as m:  # the reference: every eviction scans the whole table
        m.setattr(OldestRows, "take", lambda *args, **kwargs: None)
        m.setattr(OldestRows, "can_free", lambda *args, **kwargs: False)
        expected = _run(policy, 7, pin, admission)
    taken = []
    original = OldestRows.take

    def counting_take(self, *args, **kwargs):
        victims = original(self, *args, **kwargs)
        taken.append(victims is not None)
        return victims

    monkeypatch.setattr(OldestRows, "take", counting_take)
    got = _run(policy, 7, pin, admission)
    assert len(got[0]) == len(expected[0])
    for a, b in zip(got[0], expected[0], strict=True):  # every step's rows and reassigned rows, in order
        assert torch.equal(a, b)
    assert torch.equal(got[1][0], expected[1][0]) and torch.equal(got[1][1], expected[1][1])
    assert got[2] == expected[2] and got[2]["evictions"] > 1000
    assert sum(taken) > len(taken) // 2  # most evictions came from the queue, without a scan


def test_rows_placed_with_old_last_steps_go_first() -> None:
    """``insert_at`` writes last steps out of order: the queue is scanned again, so those rows,
    the oldest, are the next victims."""
    table = IdTable(64, eviction=LRUEviction(), name="t")
    for step in range(6):
        table.find_or_insert(torch.arange(step * 40, step * 40 + 40))  # evicts from step 2 on
    old_ids = torch.tensor([-5, -6])
    _, rows = table.ids_and_rows()
    table.remove(table.ids_and_rows()[0][:2])
    table.state.insert_at(old_ids, rows[:2], last_step=torch.zeros(2, dtype=torch.int64))
    table.find_or_insert(torch.tensor([10**6]))  # one new id: one victim
    assert bool((table.find(old_ids) == -1).any())


def test_a_queue_of_pinned_rows_frees_nothing_and_a_full_table_raises() -> None:
    """The oldest row is pinned, and so is every other: the queue holds only the pinned one, so
    no row may go, and the new id raises instead of taking a pinned row (found by the model test)."""
    table = IdTable(3, eviction=LRUEviction(), name="t")
    table.find_or_insert(torch.tensor([0, 1, 2]))
    table.pin(torch.tensor([2]))
    table.find_or_insert(torch.tensor([0, -1]))  # evicts id 1 (row 1); the queue keeps pinned row 2
    table.pin(torch.tensor([0, 1]))
    with pytest.raises(TableFullError, match="eviction can free only 0 rows"):
        table.find_or_insert(torch.tensor([1]))
    assert table.find(torch.tensor([0, -1, 2])).tolist() == [0, 1, 2]
