"""IdTable behaviour at scale and at its boundaries (the random-sequence model test is separate)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from recsdk.embedding import (
    CountAdmission,
    IdTable,
    LFUEviction,
    LRUEviction,
    TableFullError,
    TTLEviction,
    fmix64,
    slot_index,
)
from recsdk.embedding.hashing import fmix64_reference

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

pytestmark = pytest.mark.usefixtures("index_kind")


def _random_ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g, dtype=torch.int64)


def test_fmix64_matches_python_reference_on_extremes() -> None:
    values = [0, 1, -1, INT64_MIN, INT64_MAX, 12345678901234567, -987654321]
    got = fmix64(torch.tensor(values)).tolist()
    assert got == [fmix64_reference(v) for v in values]
    assert fmix64(torch.tensor(values), salt=7).tolist() == [fmix64_reference(v, 7) for v in values]


def test_many_ids_against_dict_collision_free() -> None:
    table = IdTable(50_000, name="big")
    model: dict[int, int] = {}
    for step in range(6):
        ids = torch.cat([_random_ids(6_000, step), _random_ids(2_000, 0)])  # new ids plus repeats of step 0
        rows = table.find_or_insert(ids)
        for x, r in zip(ids.tolist(), rows.tolist(), strict=True):
            assert model.setdefault(x, r) == r
    assert len(table) == len(model) == len(set(model.values()))
    assert all(0 <= r < 50_000 for r in model.values())
    ids = torch.tensor(list(model))
    assert table.find(ids).tolist() == list(model.values())


def test_lru_churn_with_rehash_keeps_exact_mapping() -> None:
    """Every step brings 97 new ids into 291 rows: the 3 newest batches stay (the indexes that leave
    tombstones rehash many times)."""
    table = IdTable(291, eviction=LRUEviction(), name="churn")
    live: dict[int, int] = {}
    batches: list[list[int]] = []
    tombstones_made = 0
    for step in range(60):
        ids = _random_ids(97, 1000 + step)
        rows = table.find_or_insert(ids).tolist()
        batches.append(ids.tolist())
        for x, r in zip(ids.tolist(), rows, strict=True):
            live[x] = r
        keep = {x for b in batches[-3:] for x in b}
        live = {x: r for x, r in live.items() if x in keep}
        tombstones_made += 97 if step >= 3 else 0
        assert len(set(live.values())) == len(live)
    assert len(table) == len(live) == 291
    ids, rows = table.ids_and_rows()
    assert dict(zip(ids.tolist(), rows.tolist(), strict=True)) == live
    assert table.find(torch.tensor(list(live))).tolist() == list(live.values())
    assert table.stats()["evictions"] == 60 * 97 - 291
    assert tombstones_made > 10 * table.num_slots  # the slot array was rebuilt many times


def test_int32_ids_are_sign_extended() -> None:
    table = IdTable(8)
    rows32 = table.find_or_insert(torch.tensor([-5, 7, 2**31 - 1, -(2**31)], dtype=torch.int32))
    rows64 = table.find(torch.tensor([-5, 7, 2**31 - 1, -(2**31)], dtype=torch.int64))
    assert torch.equal(rows32, rows64)
    assert table.find(torch.tensor([2**32 - 5])).item() == -1  # not the unsigned reading of -5


def test_extreme_ids_are_ordinary_ids() -> None:
    table = IdTable(4)
    ids = torch.tensor([INT64_MIN, INT64_MAX, 0, -1])
    rows = table.find_or_insert(ids)
    assert sorted(rows.tolist()) == [0, 1, 2, 3]
    assert torch.equal(table.find(ids), rows)
    assert table.find(torch.tensor([1, INT64_MIN + 1, INT64_MAX - 1])).tolist() == [-1, -1, -1]


def test_shape_is_preserved_and_duplicates_share_rows() -> None:
    table = IdTable(10)
    ids = torch.tensor([[3, 4, 3], [4, 4, 9]])
    rows = table.find_or_insert(ids)
    assert rows.shape == (2, 3)
    assert rows[0, 0] == rows[0, 2] and rows[0, 1] == rows[1, 0] == rows[1, 1]
    assert len(table) == 3


def test_table_full_error_names_table_capacity_and_fixes_and_changes_nothing() -> None:
    table = IdTable(3, name="user_table")
    table.find_or_insert(torch.tensor([1, 2]))
    before = table.state_dict()
    with pytest.raises(TableFullError) as info:
        table.find_or_insert(torch.tensor([2, 3, 4]))
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "user_table" in msg and "capacity 3" in msg and "num_embeddings" in msg and "eviction" in msg
    after = table.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert table.find(torch.tensor([3, 4])).tolist() == [-1, -1]
    assert table.find_or_insert(torch.tensor([3])).item() == 2  # exactly one row was left


def test_full_of_pinned_rows_raises_and_unpinning_lets_eviction_work() -> None:
    table = IdTable(2, eviction=LRUEviction(), name="pinned")
    rows = table.find_or_insert(torch.tensor([10, 11]))
    table.pin(rows)
    with pytest.raises(TableFullError, match="pinned"):
        table.find_or_insert(torch.tensor([12]))
    table.unpin(rows[:1])
    assert table.find_or_insert(torch.tensor([12])).item() == rows[0].item()
    assert table.find(torch.tensor([10, 11])).tolist() == [-1, rows[1].item()]


def test_rows_of_the_current_batch_are_not_evicted() -> None:
    table = IdTable(2, eviction=LRUEviction())
    table.find_or_insert(torch.tensor([1, 2]))
    with pytest.raises(TableFullError):
        table.find_or_insert(torch.tensor([1, 2, 3]))
    rows = table.find_or_insert(torch.tensor([2, 3]))  # 1 is the only candidate
    assert table.find(torch.tensor([1])).item() == -1 and rows.tolist() == [1, 0]


def test_lfu_evicts_least_frequent_then_least_recent() -> None:
    table = IdTable(3, eviction=LFUEviction())
    table.find_or_insert(torch.tensor([1, 2, 3]))
    table.find_or_insert(torch.tensor([1, 1, 1, 2]))  # freq: 1 -> 2, 2 -> 2, 3 -> 1 (repeats count once)
    table.find_or_insert(torch.tensor([2]))  # freq 2 -> 3
    table.find_or_insert(torch.tensor([4]))  # evicts 3 (freq 1)
    assert table.find(torch.tensor([3])).item() == -1
    table.find_or_insert(torch.tensor([5]))  # 4 has freq 1: evicted before 1 (freq 2)
    assert table.find(torch.tensor([1, 2, 4, 5])).ge(0).tolist() == [True, True, False, True]


def test_ttl_frees_idle_rows_each_call_and_reports_reassignment() -> None:
    table = IdTable(4, eviction=TTLEviction(max_idle_steps=2))
    first = table.find_or_insert(torch.tensor([1, 2]))
    table.find_or_insert(torch.tensor([1]))
    table.find_or_insert(torch.tensor([1]))
    assert len(table) == 2  # 2 is idle for 2 steps: still there
    table.find_or_insert(torch.tensor([1]))
    assert len(table) == 1 and table.find(torch.tensor([2])).item() == -1
    assert table.stats()["evictions"] == 1
    assert table.take_reassigned_rows().numel() == 0  # freed, not yet given to another id
    row = table.find_or_insert(torch.tensor([99])).item()
    assert row == first[1].item()
    assert table.take_reassigned_rows().tolist() == [row]
    assert table.take_reassigned_rows().numel() == 0


def test_evict_idle_explicit_sweep_skips_pinned_rows() -> None:
    table = IdTable(4, eviction=LRUEviction())
    rows = table.find_or_insert(torch.tensor([1, 2, 3]))
    table.pin(rows[1:2])
    table.find_or_insert(torch.tensor([3]))
    step_before = table.step
    freed = table.evict_idle(0)
    assert freed.tolist() == [rows[0].item()] and table.step == step_before
    with pytest.raises(ValueError, match="TTLEviction"):
        table.evict_idle()
    with pytest.raises(ValueError, match="eviction policy"):
        IdTable(2).evict_idle(1)


def test_admission_counts_once_per_call_and_admits_at_threshold() -> None:
    table = IdTable(8, admission=CountAdmission(threshold=3, counter_slots=1 << 12))
    assert table.find_or_insert(torch.tensor([5, 5, 5, 5])).tolist() == [-1] * 4
    assert table.find_or_insert(torch.tensor([5])).tolist() == [-1]
    assert len(table) == 0 and table.stats()["admission_rejects"] == 2
    row = table.find_or_insert(torch.tensor([5, 6])).tolist()
    assert row[0] >= 0 and row[1] == -1
    assert table.find(torch.tensor([5])).tolist() == [row[0]]


def test_admission_memory_is_bounded_by_counter_slots() -> None:
    policy = {"admission": CountAdmission(2, counter_slots=64, num_hashes=2), "eviction": LRUEviction()}
    small = IdTable(16, **policy)  # type: ignore[arg-type]
    for seed in range(200):
        small.find_or_insert(_random_ids(10, seed))
    assert small.stats()["lookups"] == 2000
    assert small.memory_bytes == IdTable(16, **policy).memory_bytes  # type: ignore[arg-type]
    # Overcounting can only admit early: an id seen twice is always admitted.
    table = IdTable(5000, admission=CountAdmission(2, counter_slots=64))
    ids = _random_ids(2000, 42)
    table.find_or_insert(ids)
    assert bool((table.find_or_insert(ids) >= 0).all())


def test_pin_unpin_reference_counts_and_validation() -> None:
    table = IdTable(4, eviction=LRUEviction())
    rows = table.find_or_insert(torch.tensor([1, 2]))
    table.pin(torch.tensor([rows[0].item(), rows[0].item(), -1]))
    table.unpin(rows[:1])
    assert table.num_pinned() == 1
    with pytest.raises(ValueError, match="unpin"):
        table.unpin(torch.tensor([rows[0].item(), rows[0].item()]))
    assert table.num_pinned() == 1  # unchanged by the failed call
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        table.pin(torch.tensor([4]))
    with pytest.raises(TypeError):
        table.pin(torch.tensor([0.0]))


def test_state_dict_round_trip_preserves_future_behaviour() -> None:
    def run(table: IdTable, batches: list[torch.Tensor]) -> list[list[int]]:
        return [table.find_or_insert(b).tolist() for b in batches]

    policy = {"admission": CountAdmission(2, counter_slots=1 << 12), "eviction": LRUEviction()}
    warm = [_random_ids(5, s) % 11 for s in range(8)]
    later = [_random_ids(5, 100 + s) % 13 for s in range(8)]
    a = IdTable(6, **policy)  # type: ignore[arg-type]
    run(a, warm)
    b = IdTable(6, **policy)  # type: ignore[arg-type]
    b.load_state_dict(a.state_dict())
    assert run(a, later) == run(b, later)
    assert a.stats() == b.stats()
    assert torch.equal(a.take_reassigned_rows(), b.take_reassigned_rows())


def test_load_state_dict_rejects_bad_states_and_keeps_the_table() -> None:
    a = IdTable(4)
    a.find_or_insert(torch.tensor([1, 2]))
    sd = a.state_dict()
    with pytest.raises(ValueError, match="capacity"):
        IdTable(5).load_state_dict(sd)
    with pytest.raises(ValueError, match="lacks keys"):
        IdTable(4).load_state_dict({k: v for k, v in sd.items() if k != "ids"})
    broken = dict(sd, free_rows=sd["free_rows"][:1])
    b = IdTable(4)
    b.find_or_insert(torch.tensor([7]))
    with pytest.raises(ValueError, match="exactly once"):
        b.load_state_dict(broken)
    repeated = dict(sd, free_rows=sd["free_rows"][:1].repeat(2))  # the right count, one row twice
    with pytest.raises(ValueError, match="exactly once"):
        b.load_state_dict(repeated)
    assert b.find(torch.tensor([7])).item() == 0
    with pytest.raises(ValueError, match="admission counters"):
        IdTable(4, admission=CountAdmission(3, counter_slots=16)).load_state_dict(sd)
    b.pin(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="pinned"):
        b.load_state_dict(sd)


def test_rebuild_from_ids_and_rows_with_remove_and_insert_at() -> None:
    src = IdTable(10, eviction=LRUEviction(), name="src")
    src.find_or_insert(torch.tensor([100, 200, 300, 400]))
    ids, rows = src.ids_and_rows()
    moving = ids % 200 == 0
    removed = src.remove(ids[moving])
    assert torch.equal(removed, rows[moving])
    assert src.find(ids).ge(0).tolist() == (~moving).tolist()
    dst = IdTable(10, eviction=LRUEviction(), name="dst")
    dst.state.insert_at(ids[moving], rows[moving])
    assert torch.equal(dst.find(ids[moving]), rows[moving])
    assert dst.take_reassigned_rows().numel() == 0
    new = dst.find_or_insert(torch.tensor([500, 600]))
    assert not bool(torch.isin(new, rows[moving]).any())  # rows given by insert_at are taken
    with pytest.raises(ValueError, match="already in the table"):
        dst.state.insert_at(torch.tensor([200]), torch.tensor([9]))
    with pytest.raises(ValueError, match="already holds"):
        dst.state.insert_at(torch.tensor([7]), new[:1])
    with pytest.raises(ValueError, match="distinct"):
        dst.state.insert_at(torch.tensor([7, 7]), torch.tensor([8, 9]))
    assert len(dst) == 4


def test_rebuild_places_ids_in_order_and_reinitialises_the_other_rows() -> None:
    admission = CountAdmission(2, counter_slots=16)
    table = IdTable(6, admission=admission, eviction=LRUEviction(), name="t")
    table.find_or_insert(torch.tensor([1, 2, 3]))
    table.find_or_insert(torch.tensor([1, 2, 3]))  # admitted: stats and reassigned state to reset
    counters = torch.arange(16, dtype=torch.int32)
    ids = torch.tensor([INT64_MAX, -5, 40])
    table.state.rebuild(
        ids, last_step=torch.tensor([7, 2, 9]), freq=torch.tensor([3, 1, 4]), step=9, admission_counters=counters
    )
    assert table.find(ids).tolist() == [0, 1, 2] and table.find(torch.tensor([1, 2, 3])).tolist() == [-1] * 3
    sd = table.state_dict()
    assert sd["ids"].tolist() == ids.tolist() and sd["rows"].tolist() == [0, 1, 2]
    assert sd["last_step"].tolist() == [7, 2, 9] and sd["freq"].tolist() == [3, 1, 4]
    assert table.step == 9 and torch.equal(sd["admission_counters"], counters)
    assert sd["stats"].tolist() == [0] * 5 and sd["reassigned_rows"].numel() == 0
    assert sd["retired_rows"].tolist() == [3, 4, 5]
    # The free rows go out in ascending order, each reported for re-initialisation.
    table.state.rebuild(ids, last_step=torch.tensor([7, 2, 9]), freq=torch.ones(3, dtype=torch.int64), step=9)
    assert int(table.state_dict()["admission_counters"].sum()) == 0  # None: a fresh sketch
    new = table.find_or_insert(torch.tensor([11, 11, 12, 12]))  # seen once: not admitted yet
    assert new.tolist() == [-1] * 4
    new = table.find_or_insert(torch.tensor([11, 12]))
    assert new.tolist() == [3, 4] and table.take_reassigned_rows().tolist() == [3, 4]


def test_rebuild_rejects_bad_input_and_keeps_the_table() -> None:
    table = IdTable(3, name="t")
    table.find_or_insert(torch.tensor([5, 6]))
    before = table.state_dict()
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="4 ids do not fit the table's capacity 3"):
        table.state.rebuild(torch.arange(4), last_step=torch.zeros(4), freq=torch.ones(4), step=0)
    with pytest.raises(ValueError, match="distinct"):
        table.state.rebuild(torch.tensor([1, 1]), last_step=one.repeat(2), freq=one.repeat(2), step=1)
    with pytest.raises(ValueError, match="last_step must be 2 integers"):
        table.state.rebuild(torch.tensor([1, 2]), last_step=one, freq=one.repeat(2), step=1)
    with pytest.raises(ValueError, match=r"freq must be in \[0, "):
        table.state.rebuild(torch.tensor([1]), last_step=one, freq=-one, step=1)
    with pytest.raises(ValueError, match="step must be"):
        table.state.rebuild(torch.tensor([1]), last_step=one, freq=one, step=-1)
    with pytest.raises(ValueError, match="2 admission counters given"):
        table.state.rebuild(torch.tensor([1]), last_step=one, freq=one, step=1, admission_counters=torch.zeros(2))
    table.pin(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="pinned"):
        table.state.rebuild(torch.tensor([1]), last_step=one, freq=one, step=1)
    after = table.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_check_state_dict_validates_like_load_and_changes_nothing() -> None:
    a = IdTable(4)
    a.find_or_insert(torch.tensor([1, 2]))
    sd = a.state_dict()
    b = IdTable(4)
    b.find_or_insert(torch.tensor([7]))
    b.check_state_dict(sd)
    assert b.find(torch.tensor([7, 1])).tolist() == [0, -1]
    with pytest.raises(ValueError, match="exactly once"):
        b.check_state_dict(dict(sd, free_rows=sd["free_rows"][:1]))
    with pytest.raises(ValueError, match="capacity"):
        IdTable(5).check_state_dict(sd)


def test_validation_errors_name_the_table() -> None:
    with pytest.raises(ValueError, match="capacity"):
        IdTable(0, name="t")
    with pytest.raises(TypeError, match="capacity"):
        IdTable(True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="admission"):
        IdTable(4, admission=LRUEviction())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="eviction"):
        IdTable(4, eviction=CountAdmission(2))  # type: ignore[arg-type]
    table = IdTable(4, name="emb_t")
    with pytest.raises(TypeError, match=r"emb_t.*float32"):
        table.find_or_insert(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="Tensor"):
        table.find([1, 2])  # type: ignore[arg-type]


def test_meta_table_allocates_nothing_and_refuses_lookups() -> None:
    table = IdTable(1 << 30, device="meta", name="huge")
    assert table.capacity == 1 << 30 and len(table) == 0
    with pytest.raises(RuntimeError, match="meta"):
        table.find(torch.tensor([1]))


def test_bytes_per_row_stay_under_48_at_8m_capacity(index_kind: str) -> None:
    capacity = 8 << 20
    if index_kind in ("native", "fbgemm"):  # CPU: at most 1.4 slots of 16 bytes per row, whatever the capacity
        table = IdTable(capacity, eviction=LFUEviction())
        full_index = slot_index.index_bytes(capacity, torch.device("cpu"))  # the index grown to full size
        assert full_index == -(-capacity * 14 // 10) * 16
        assert (table.memory_bytes - table._map.index.memory_bytes + full_index) / capacity <= 48
        return
    table = IdTable(capacity, device="meta", eviction=LFUEviction())
    assert table.memory_bytes / capacity <= 48
    worst = IdTable((1 << 22) // 3 * 2 + 1, device="meta")  # 1.5x capacity just above 2**22: 12 slot bytes per row
    assert worst.num_slots == 1 << 23
    assert worst.memory_bytes / worst.capacity <= 48


def test_hash_index_grows_with_the_stored_ids() -> None:
    capacity = 1_000_000
    table = IdTable(capacity, eviction=LRUEviction(), name="grows")
    full = type(table._map.index).slots_for(capacity)
    first = _random_ids(1000, 0)
    model = dict(zip(first.tolist(), table.find_or_insert(first).tolist(), strict=True))  # id -> row
    assert table.num_slots * 10 < full  # sized for the ids stored, not for the capacity
    sizes = {table.num_slots}
    for step, batch in enumerate(_random_ids(250_000, 1).split(5_000)):
        model.update(zip(batch.tolist(), table.find_or_insert(batch).tolist(), strict=True))
        if step % 4 == 3:  # tombstones through growth
            gone = batch[:2_000]
            table.remove(gone)
            for x in gone.tolist():
                del model[x]
        if table.num_slots not in sizes:  # just grown: every id still maps to its row
            sizes.add(table.num_slots)
            assert table.find(torch.tensor(list(model))).tolist() == list(model.values())
    assert len(sizes) >= 3 and max(sizes) <= full
    assert table.find(torch.tensor(list(model))).tolist() == list(model.values())
    assert len(table) == len(model) == len(set(model.values()))
    # Never past the full size: filling this table grows its index once, to exactly slots_for(capacity).
    filled = IdTable(120_000, name="filled")
    ids = _random_ids(120_000, 2)
    rows = filled.find_or_insert(ids)
    assert filled.num_slots == type(filled._map.index).slots_for(120_000)
    assert torch.equal(filled.find(ids), rows)


def test_rows_go_out_in_order_freed_rows_first() -> None:
    """0, 1, 2, ... for rows never used; a freed row goes out before them, the last freed first."""
    table = IdTable(8, eviction=LRUEviction())
    assert table.find_or_insert(torch.tensor([10, 11, 12])).tolist() == [0, 1, 2]
    table.remove(torch.tensor([12, 10]))  # frees rows 0 then 2
    assert table.state_dict()["free_rows"].tolist() == [7, 6, 5, 4, 3, 0, 2]
    assert table.find_or_insert(torch.tensor([20, 21, 22])).tolist() == [2, 0, 3]
    # A loaded stack goes out from its top, whatever its order; retired rows are reported.
    sd = dict(
        table.state_dict(),
        ids=torch.tensor([1, 2, 3]),
        rows=torch.tensor([0, 1, 2]),
        last_step=torch.zeros(3, dtype=torch.int64),
        freq=torch.ones(3, dtype=torch.int64),
        free_rows=torch.tensor([7, 6, 4, 3, 5]),
        retired_rows=torch.tensor([5, 6]),
        reassigned_rows=torch.zeros(0, dtype=torch.int64),
    )
    loaded = IdTable(8, eviction=LRUEviction())
    loaded.load_state_dict(sd)
    after = loaded.state_dict()
    assert after["free_rows"].tolist() == [7, 6, 4, 3, 5] and after["retired_rows"].tolist() == [5, 6]
    assert loaded.find_or_insert(torch.tensor([40, 41, 42, 43, 44])).tolist() == [5, 3, 4, 6, 7]
    assert loaded.take_reassigned_rows().tolist() == [5, 6]
    # insert_at takes its rows out of the order, the others keep theirs.
    placed = IdTable(8)
    placed.state.insert_at(torch.tensor([50, 51]), torch.tensor([5, 2]))
    assert placed.state_dict()["free_rows"].tolist() == [7, 6, 4, 3, 1, 0]
    assert placed.find_or_insert(torch.tensor([60, 61, 62, 63, 64, 65])).tolist() == [0, 1, 3, 4, 6, 7]
    # After rebuild every other row is reported when it goes out, rows above an insert_at too.
    rebuilt = IdTable(8)
    one = torch.ones(2, dtype=torch.int64)
    rebuilt.state.rebuild(torch.tensor([70, 71]), last_step=0 * one, freq=one, step=0)
    rebuilt.state.insert_at(torch.tensor([72]), torch.tensor([5]))
    assert rebuilt.state_dict()["retired_rows"].tolist() == [2, 3, 4, 6, 7]
    assert rebuilt.find_or_insert(torch.tensor([80, 81, 82, 83, 84])).tolist() == [2, 3, 4, 6, 7]
    assert rebuilt.take_reassigned_rows().tolist() == [2, 3, 4, 6, 7]


@pytest.mark.parametrize("report_first_use", [False, True])
def test_report_first_use_adds_rows_handed_out_for_the_first_time(report_first_use: bool) -> None:
    table = IdTable(4, eviction=LRUEviction(), report_first_use=report_first_use)
    assert table.find_or_insert(torch.tensor([1, 2, 3])).tolist() == [0, 1, 2]
    assert table.take_reassigned_rows().tolist() == ([0, 1, 2] if report_first_use else [])
    assert table.find_or_insert(torch.tensor([4, 5])).tolist() == [0, 3]  # id 1's row 0 evicted, row 3 new
    assert table.take_reassigned_rows().tolist() == ([0, 3] if report_first_use else [0])
    table.remove(torch.tensor([5]))
    assert table.find_or_insert(torch.tensor([6])).tolist() == [3]
    assert table.take_reassigned_rows().tolist() == [3]  # reassigned: reported either way


def _rss_anon() -> int:
    """This process's anonymous resident memory (bytes), from /proc/self/status."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc/self/status (Linux)")
def test_resident_memory_follows_the_rows_in_use_not_the_capacity() -> None:
    capacity = 50_000_000
    full = slot_index.index_bytes(capacity, torch.device("cpu")) + 25 * capacity  # index and per-row arrays
    gc.collect()
    before = _rss_anon()
    table = IdTable(capacity, eviction=LRUEviction(), name="large")
    built = _rss_anon() - before
    table.find_or_insert(_random_ids(10_000, 0))
    used = _rss_anon() - before
    assert built < full / 100 and used < full / 100, (built, used, full)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_table_matches_cpu_table() -> None:
    ids = torch.cat([_random_ids(20_000, 1), _random_ids(5_000, 1)])
    cpu = IdTable(30_000, eviction=LRUEviction())
    gpu = IdTable(30_000, eviction=LRUEviction(), device="cuda")
    for shift in range(3):
        batch = ids.roll(shift * 777)
        assert torch.equal(cpu.find_or_insert(batch), gpu.find_or_insert(batch.cuda()).cpu())
    small_cpu = IdTable(1000, eviction=LRUEviction())
    small_gpu = IdTable(1000, eviction=LRUEviction(), device="cuda")
    for seed in range(5):
        batch = _random_ids(600, seed)
        assert torch.equal(small_cpu.find_or_insert(batch), small_gpu.find_or_insert(batch.cuda()).cpu())
        assert torch.equal(small_cpu.take_reassigned_rows(), small_gpu.take_reassigned_rows().cpu())
