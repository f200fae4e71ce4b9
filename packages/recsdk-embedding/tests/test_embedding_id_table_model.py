"""Property tests: IdTable against a plain-dict model, through random operation sequences.

The model predicts everything the contract fixes: which ids hit, which are refused by admission,
when the table is full, which ids eviction frees (policy order, ties to the lowest row), which
rows are reported as reassigned, and the statistics. It learns only the row numbers given to new
ids from the table, and checks that they were free.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from recsdk.embedding import (
    CountAdmission,
    IdTable,
    LFUEviction,
    LRUEviction,
    TableFullError,
    TTLEviction,
    slot_index,
)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
SPECIAL_IDS = [0, 1, -1, INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1, 2**31 - 1, -(2**31), 2**32, -(2**40)]
ids_strategy = st.lists(
    st.one_of(st.sampled_from(SPECIAL_IDS), st.integers(-20, 20), st.integers(INT64_MIN, INT64_MAX)),
    min_size=0,
    max_size=12,
)


class Model:
    """What the table must do, written with dicts and sorted lists."""

    def __init__(self, capacity: int, admission: CountAdmission | None, eviction: object) -> None:
        self.capacity = capacity
        self.threshold = admission.threshold if admission is not None else 1
        self.eviction = eviction
        self.id2row: dict[int, int] = {}
        self.row2id: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.freq: dict[int, int] = {}
        self.pins: Counter[int] = Counter()
        self.since: int | None = None  # IdTable.pin_since's watermark
        self.counts: dict[int, int] = {}
        self.retired: set[int] = set()
        self.pending: set[int] = set()
        self.step = 0
        self.stats = dict.fromkeys(["inserts", "evictions", "admission_rejects", "lookups", "hits"], 0)

    def pinned(self, row: int) -> bool:
        """A reference, or (with an eviction policy) a last use at or after the watermark."""
        by_step = self.since is not None and self.eviction is not None and self.last[row] >= self.since
        return self.pins[row] > 0 or by_step

    def num_pinned(self) -> int:
        return len({r for r, n in self.pins.items() if n > 0} | {r for r in self.row2id if self.pinned(r)})

    def free_rows(self) -> set[int]:
        return set(range(self.capacity)) - set(self.row2id)

    def _drop(self, row: int) -> None:
        del self.id2row[self.row2id.pop(row)]
        self.retired.add(row)

    def _key(self, row: int) -> tuple[int, ...]:
        if isinstance(self.eviction, LFUEviction):
            return (self.freq[row], self.last[row], row)
        return (self.last[row], row)

    def sweep(self, max_idle: int) -> list[int]:
        rows = sorted(r for r in self.row2id if not self.pinned(r) and self.last[r] < self.step - max_idle)
        for r in rows:
            self._drop(r)
        self.stats["evictions"] += len(rows)
        return rows

    def find_or_insert(self, ids: list[int], table: IdTable) -> None:
        hits = [x for x in ids if x in self.id2row]
        hit_rows = {self.id2row[x] for x in hits}
        uniq = sorted({x for x in ids if x not in self.id2row})
        admitted = [x for x in uniq if self.counts.get(x, 0) + 1 >= self.threshold]
        free = self.capacity - len(self.row2id)
        evictable = [r for r in self.row2id if not self.pinned(r) and r not in hit_rows]
        fits = len(admitted) <= free or (self.eviction is not None and len(admitted) <= free + len(evictable))
        if not fits:
            before = table.state_dict()
            before_stats = table.stats()
            with pytest.raises(TableFullError, match=table.name) as info:
                table.find_or_insert(torch.tensor(ids, dtype=torch.int64))
            assert str(table.capacity) in str(info.value)
            assert "capacity" in str(info.value) and "evict" in str(info.value)
            after = table.state_dict()
            assert before.keys() == after.keys()
            for k in before:
                assert torch.equal(before[k], after[k]), k
            assert table.stats() == before_stats
            return

        out = table.find_or_insert(torch.tensor(ids, dtype=torch.int64)).tolist()
        self.step += 1
        self.stats["lookups"] += len(ids)
        self.stats["hits"] += len(hits)
        if self.eviction is not None:
            for r in hit_rows:
                self.last[r] = self.step
                self.freq[r] += isinstance(self.eviction, LFUEviction)
        if isinstance(self.eviction, TTLEviction):
            self.sweep(self.eviction.max_idle_steps)
        for x in uniq:
            self.counts[x] = min(self.counts.get(x, 0) + 1, self.threshold)
        self.stats["admission_rejects"] += len(uniq) - len(admitted)
        shortfall = len(admitted) - (self.capacity - len(self.row2id))
        if shortfall > 0:
            candidates = sorted((r for r in self.row2id if not self.pinned(r) and r not in hit_rows), key=self._key)
            for r in candidates[:shortfall]:
                self._drop(r)
            self.stats["evictions"] += shortfall
        free_now = self.free_rows()
        new_rows = {}
        for x, r in zip(ids, out, strict=True):
            if x in self.id2row:
                assert r == self.id2row[x], f"id {x} moved from row {self.id2row[x]} to {r}"
            elif x in admitted:
                assert new_rows.setdefault(x, r) == r, f"duplicate id {x} got two rows"
            else:
                assert r == -1, f"id {x} not admitted yet got row {r}"
        assert len(set(new_rows.values())) == len(new_rows), "two new ids share a row"
        assert set(new_rows.values()) <= free_now, "a new id got a row that was not free"
        for x, r in new_rows.items():
            self.id2row[x] = r
            self.row2id[r] = x
            self.last[r] = self.step
            self.freq[r] = 1
            if r in self.retired:
                self.retired.discard(r)
                self.pending.add(r)
        self.stats["inserts"] += len(new_rows)


class IdTableMachine(RuleBasedStateMachine):
    @initialize(
        capacity=st.integers(1, 10),
        threshold=st.sampled_from([None, 1, 2, 3]),
        eviction=st.sampled_from([None, LRUEviction(), LFUEviction(), TTLEviction(1), TTLEviction(3)]),
    )
    def setup(self, capacity: int, threshold: int | None, eviction: object) -> None:
        # Many more counters than distinct ids: the sketch counts exactly, like the model.
        admission = None if threshold is None else CountAdmission(threshold, counter_slots=1 << 18)
        self.table = IdTable(capacity, admission=admission, eviction=eviction, name="prop_table")  # type: ignore[arg-type]
        self.model = Model(capacity, admission, eviction)
        self.admission = admission
        self.pinned: list[list[int]] = []

    @rule(ids=ids_strategy)
    def find_or_insert(self, ids: list[int]) -> None:
        self.model.find_or_insert(ids, self.table)

    @rule(ids=ids_strategy)
    def find(self, ids: list[int]) -> None:
        stats = self.table.stats()
        step = self.table.step
        got = self.table.find(torch.tensor(ids, dtype=torch.int64)).tolist()
        assert got == [self.model.id2row.get(x, -1) for x in ids]
        assert self.table.stats() == stats and self.table.step == step

    @rule(ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8))
    def find_int32(self, ids: list[int]) -> None:
        got = self.table.find(torch.tensor(ids, dtype=torch.int32)).tolist()
        assert got == [self.model.id2row.get(x, -1) for x in ids]

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.integers(-1, self.model.capacity - 1), max_size=6))
        self.table.pin(torch.tensor(rows, dtype=torch.int64))
        self.model.pins.update(r for r in rows if r >= 0)
        self.pinned.append(rows)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        rows = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        self.table.unpin(torch.tensor(rows, dtype=torch.int32))
        self.model.pins.subtract(r for r in rows if r >= 0)

    @rule(data=st.data())
    def pin_since(self, data: st.DataObject) -> None:
        step = data.draw(st.one_of(st.none(), st.integers(0, self.model.step + 1)))
        self.table.pin_since(step)
        self.model.since = step

    @rule()
    def take_reassigned(self) -> None:
        assert self.table.take_reassigned_rows().tolist() == sorted(self.model.pending)
        self.model.pending.clear()

    @precondition(lambda self: self.model.eviction is not None)
    @rule(max_idle=st.integers(0, 3))
    def evict_idle(self, max_idle: int) -> None:
        freed = self.table.evict_idle(max_idle)
        assert freed.tolist() == self.model.sweep(max_idle)

    @precondition(lambda self: not self.pinned)
    @rule()
    def state_round_trip(self) -> None:
        t = self.table
        fresh = IdTable(t.capacity, admission=t.admission, eviction=t.eviction, name=t.name)
        fresh.load_state_dict(t.state_dict())
        self.model.since = None  # the watermark is runtime state, not in the state dict
        assert fresh.stats() == t.stats() and fresh.step == t.step
        for a, b in zip(fresh.ids_and_rows(), t.ids_and_rows(), strict=True):
            assert torch.equal(a, b)
        self.table = fresh

    @invariant()
    def agrees_with_model(self) -> None:
        m = self.model
        ids, rows = self.table.ids_and_rows()
        assert dict(zip(rows.tolist(), ids.tolist(), strict=True)) == m.row2id
        assert len(self.table) == len(m.row2id)
        expected = dict(m.stats, size=len(m.row2id), capacity=m.capacity)
        expected["hit_rate"] = m.stats["hits"] / m.stats["lookups"] if m.stats["lookups"] else 0.0
        assert self.table.stats() == expected
        assert self.table.step == m.step
        assert self.table.num_pinned() == m.num_pinned()


IdTableMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIdTableAgainstModel = IdTableMachine.TestCase  # on CPU: FBGEMM's hash index


class TestIdTableAgainstModelTorchIndex(IdTableMachine.TestCase):  # type: ignore[misc,valid-type]
    """The same sequences with the torch-ops index (the one CUDA and NPU tables use)."""

    def setUp(self) -> None:
        self._patch = pytest.MonkeyPatch()
        self._patch.setattr(slot_index, "_use_fbgemm", lambda: False)

    def tearDown(self) -> None:
        self._patch.undo()
