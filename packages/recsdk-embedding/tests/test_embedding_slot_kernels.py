"""recsdk's native slot kernels: FBGEMM's layout, a remove without tombstones, and the fallback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsdk.embedding import IdTable, LRUEviction, count_sketch, slot_index
from recsdk.embedding.count_sketch import CountMinSketch
from recsdk.embedding.oldest_rows import RowsInUse
from recsdk.embedding.slot_index import FbgemmSlotIndex
from recsdk.embedding.slot_kernels import native_slot_kernels, native_unavailable_reason

pytestmark = [
    pytest.mark.skipif(not slot_index.fbgemm_index_available(), reason="FBGEMM's kernels are not loaded"),
    pytest.mark.skipif(native_slot_kernels() is None, reason=f"not built: {native_unavailable_reason()}"),
]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _fbgemm_lookup(index: FbgemmSlotIndex, ids: torch.Tensor) -> torch.Tensor:
    """What serving's TorchScript modules read from the slots: FBGEMM's own lookup."""
    slots, offsets, _ = index.kernel_state()
    bag = torch.tensor([0, ids.numel()], dtype=torch.int64)
    return torch.ops.fbgemm.pruned_hashmap_lookup(ids, bag, slots, offsets).clamp(min=-1)


@pytest.mark.parametrize("capacity", [5, 40, 3000])
def test_inserts_and_removes_agree_with_a_dict_and_with_fbgemm(capacity: int) -> None:
    """Random churn at full load: every lookup agrees with a dict, FBGEMM's lookup reads the same
    slots, and no tombstone is ever left (small tables wrap their probe runs around the end)."""
    index = FbgemmSlotIndex(capacity, native_slot_kernels())
    g = torch.Generator().manual_seed(capacity)
    model: dict[int, int] = {}
    free = list(range(capacity))
    universe = torch.cat([torch.randint(INT64_MIN, INT64_MAX, (3 * capacity,), generator=g), torch.tensor([-1, 0])])
    for _ in range(30):
        gone = [i for i in model if torch.rand(1, generator=g).item() < 0.4]
        if gone:
            index.remove(torch.tensor(gone), torch.tensor([model[i] for i in gone]))
            free += [model.pop(i) for i in gone]
        fresh = [int(i) for i in universe[torch.randperm(universe.numel(), generator=g)] if int(i) not in model]
        fresh = fresh[: len(free)]
        rows = [free.pop() for _ in fresh]
        index.insert(torch.tensor(fresh, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64))
        model.update(zip(fresh, rows, strict=True))
        expected = torch.tensor([model.get(int(i), -1) for i in universe])
        assert torch.equal(index.lookup(universe), expected)
        stored = universe != -1  # -1 is kept aside of the slots, which FBGEMM's lookup reads alone
        assert torch.equal(_fbgemm_lookup(index, universe[stored]), expected[stored])
        assert index.tombstones == 0


def test_removing_from_a_run_that_wraps_around_the_end() -> None:
    """Ids whose home is the last slot spill over to slot 0: removing the first moves the others back."""
    kernels = native_slot_kernels()
    assert kernels is not None
    slots = torch.full((7, 2), -1, dtype=torch.int64)
    homes = {i: _home(i, 7) for i in range(400)}
    ids = torch.tensor([i for i, h in homes.items() if h == 6][:3] + [i for i, h in homes.items() if h == 0][:1])
    kernels.insert(slots, ids, torch.arange(4, dtype=torch.int64))
    assert slots[:, 0].tolist()[:3] == [int(ids[1]), int(ids[2]), int(ids[3])]  # the run wrapped
    assert kernels.remove(slots, ids[:1].contiguous()) == 1
    rows, missing = kernels.lookup(slots, ids)
    assert rows.tolist() == [-1, 1, 2, 3] and missing == 1
    assert int((slots[:, 0] != -1).sum()) == 3  # no tombstone
    assert kernels.remove(slots, torch.tensor([12345678], dtype=torch.int64)) == 0  # absent: nothing


def _home(i: int, num_slots: int) -> int:
    m = (1 << 64) - 1
    h = i & m
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & m
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & m
    h ^= h >> 33
    return h % num_slots


@pytest.mark.parametrize("num_slots", [1, 2, 3, 7, 97, 1000, 65537, 91751])
def test_each_id_lands_on_fbgemms_home_slot(num_slots: int) -> None:
    """The kernels find home slots without a division: each id, stored alone, sits exactly at
    FBGEMM's ``hash % num_slots`` (ids from the whole int64 range, the extremes included)."""
    kernels = native_slot_kernels()
    assert kernels is not None
    slots = torch.full((num_slots, 2), -1, dtype=torch.int64)
    g = torch.Generator().manual_seed(num_slots)
    ids = torch.cat([torch.randint(INT64_MIN, INT64_MAX, (300,), generator=g), torch.tensor([0, INT64_MIN, INT64_MAX])])
    for i in ids.tolist():
        one = torch.tensor([i], dtype=torch.int64)
        kernels.insert(slots, one, torch.tensor([7], dtype=torch.int64))
        assert slots[_home(i, num_slots)].tolist() == [i, 7]
        assert kernels.remove(slots, one) == 1 and int((slots[:, 0] != -1).sum()) == 0


def test_a_full_table_refuses_another_id_and_still_removes() -> None:
    """Every slot taken: an insert of a new id raises instead of probing forever, a lookup of an
    absent id ends, and removes empty the slots one by one."""
    kernels = native_slot_kernels()
    assert kernels is not None
    slots = torch.full((3, 2), -1, dtype=torch.int64)
    ids = torch.tensor([11, 22, 33], dtype=torch.int64)
    kernels.insert(slots, ids, torch.arange(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="no empty slot among 3"):
        kernels.insert(slots, torch.tensor([44], dtype=torch.int64), torch.tensor([3], dtype=torch.int64))
    assert kernels.lookup(slots, torch.tensor([44, 22], dtype=torch.int64))[0].tolist() == [-1, 1]
    for k in range(3):
        assert kernels.remove(slots, ids[k : k + 1].contiguous()) == 1
        assert kernels.lookup(slots, ids)[0].tolist() == [-1] * (k + 1) + list(range(k + 1, 3))


def test_an_evicting_table_keeps_no_tombstones_and_never_rehashes_for_them() -> None:
    table = IdTable(300, eviction=LRUEviction(), name="churn")
    slots_before = table.num_slots
    for step in range(40):
        table.find_or_insert(torch.arange(step * 100, step * 100 + 200))
    assert table.stats()["evictions"] > 3000
    assert table._map.index.tombstones == 0 and table.num_slots == slots_before


def test_the_kernels_refuse_what_they_cannot_read() -> None:
    kernels = native_slot_kernels()
    assert kernels is not None
    slots = torch.full((8, 2), -1, dtype=torch.int64)
    with pytest.raises(TypeError, match="int64"):
        kernels.lookup(slots, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="not contiguous"):
        kernels.remove(slots, torch.arange(10)[::2])
    with pytest.raises(ValueError, match="slots must be"):
        kernels.insert(torch.full((8,), -1, dtype=torch.int64), torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="1 ids but 2 rows"):
        kernels.insert(slots, torch.tensor([1]), torch.tensor([0, 1]))


@pytest.mark.parametrize(
    ("env", "reason"),
    [({"RECSDK_NATIVE_KERNELS": "0"}, "RECSDK_NATIVE_KERNELS=0"), ({"CC": "false"}, "failed")],
)
def test_without_the_kernels_tables_fall_back_to_fbgemms(env: dict[str, str], reason: str, tmp_path: Path) -> None:
    """Switched off, or a compiler that fails: the kernels are None with the reason, and an evicting
    table still maps exactly, on FBGEMM's kernels with tombstones."""
    code = (
        "import torch\n"
        "from recsdk.embedding import IdTable, LRUEviction\n"
        "from recsdk.embedding.slot_kernels import native_slot_kernels, native_unavailable_reason\n"
        "assert native_slot_kernels() is None\n"
        "print(native_unavailable_reason())\n"
        "t = IdTable(1000, eviction=LRUEviction())\n"
        "t.find_or_insert(torch.arange(1000))\n"
        "rows = t.find_or_insert(torch.arange(2000, 2100))\n"
        "assert t.find(torch.arange(2000, 2100)).tolist() == rows.tolist() and (rows >= 0).all()\n"
        "assert t.stats()['evictions'] == 100 and t._map.index.tombstones == 100\n"
    )
    run_env = {**os.environ, "RECSDK_CACHE_DIR": str(tmp_path), **env}
    out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert reason in out.stdout


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_native_sketch_counts_what_the_torch_sketch_counts(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission's count-min sketch gives the same positions, estimates and counters with
    recsdk's kernels as in torch ops, over rounds of distinct ids whose counters collide."""
    native = CountMinSketch(37, 4, cap=50, device=torch.device("cpu"), dtype=dtype)
    monkeypatch.setattr(count_sketch, "native_slot_kernels", lambda: None)
    plain = CountMinSketch(37, 4, cap=50, device=torch.device("cpu"), dtype=dtype)
    assert native._kernels is not None and plain._kernels is None
    g = torch.Generator().manual_seed(3)
    universe = torch.cat([torch.randint(INT64_MIN, INT64_MAX, (200,), generator=g), torch.tensor([0, -1, INT64_MIN])])
    for _ in range(12):
        ids = universe[torch.randperm(universe.numel(), generator=g)[:80]]
        (pos_n, est_n), (pos_p, est_p) = native.read(ids), plain.read(ids)
        assert torch.equal(pos_n, pos_p) and torch.equal(est_n, est_p) and est_n.dtype == dtype
        amounts = torch.randint(0, 9, (80,), generator=g, dtype=dtype)
        assert torch.equal(native.add(pos_n, est_n, amounts), plain.add(pos_p, est_p, amounts))
        assert torch.equal(native.counters, plain.counters)
    assert int(native.counters.max()) == 50  # saturated at the cap


def test_the_sketch_kernels_refuse_what_they_cannot_read() -> None:
    kernels = native_slot_kernels()
    assert kernels is not None
    counters = torch.zeros(10, dtype=torch.int32)
    salts = torch.tensor([1, 2], dtype=torch.int64)
    with pytest.raises(ValueError, match="10 counters for 2 rows of width 4"):
        kernels.sketch_read(torch.tensor([1]), salts, 4, counters)
    with pytest.raises(TypeError, match="int32 or int64"):
        kernels.sketch_read(torch.tensor([1]), salts, 5, counters.float())
    with pytest.raises(TypeError, match="contiguous"):
        kernels.sketch_read(torch.arange(4)[::2], salts, 5, counters)
    positions = torch.tensor([[0], [10]], dtype=torch.int64)  # 10 lies past the counters
    with pytest.raises(ValueError, match="outside the 10 counters"):
        kernels.sketch_raise(positions, torch.tensor([3], dtype=torch.int32), counters)
    assert int(counters.sum()) == 0  # nothing written
    with pytest.raises(TypeError, match=r"counts torch\.int64 for torch\.int32 counters"):
        kernels.sketch_raise(positions, torch.tensor([3]), counters)


def test_the_queue_kernels_refuse_a_row_outside_the_tables_arrays() -> None:
    kernels = native_slot_kernels()
    assert kernels is not None
    last_step = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    in_use = RowsInUse(last_step, torch.ones(4, dtype=torch.int8), None, None, torch.zeros(4, dtype=torch.bool))
    queue = torch.tensor([0, 1, 4], dtype=torch.int64)  # row 4: past the 4 rows
    with pytest.raises(ValueError, match="outside the 4 rows"):
        kernels.queue_take(queue, in_use, 10, 1, 1)
    assert queue.tolist() == [0, 1, 4]  # the queue as it was
    queue = torch.tensor([0, 1, 2], dtype=torch.int64)  # by (last step, row) at a scan; row 0 reused since
    last_step[0] = 20
    victims, kept = kernels.queue_take(queue, in_use, 10, 1, 5)  # 5 rows wanted, 2 may go
    assert victims is None and queue[:kept].tolist() == [1, 2]
    victims, kept = kernels.queue_take(queue[:kept], in_use, 10, 1, 2)
    assert victims is not None and victims.tolist() == [1, 2] and kept == 0
