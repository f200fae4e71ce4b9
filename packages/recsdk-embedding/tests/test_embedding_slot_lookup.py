"""recsdk's ``pruned_slots_lookup`` op: FBGEMM's ``pruned_hashmap_lookup`` row for row, its
checks, TorchScript, and the fallback to FBGEMM's lookup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsdk.embedding import slot_index
from recsdk.embedding.slot_lookup import (
    lookup_tables,
    native_lookup_available,
    native_lookup_unavailable_reason,
    pruned_slots_lookup,
)

pytestmark = [
    pytest.mark.skipif(not slot_index.fbgemm_index_available(), reason="FBGEMM's kernels are not loaded"),
    pytest.mark.skipif(not native_lookup_available(), reason=f"not built: {native_lookup_unavailable_reason()}"),
]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _tables(capacities: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Slots of tables of ``capacities`` slots end to end, filled by FBGEMM's own insert (ids at
    most a slot short of full, rows random, some below 0 as a removed id's), and each table's ids."""
    slot_offsets = torch.tensor([0, *torch.tensor(capacities).cumsum(0).tolist()], dtype=torch.int64)
    slots = torch.full((int(slot_offsets[-1]), 2), -1, dtype=torch.int64)
    stored = []
    for t, capacity in enumerate(capacities):
        n = max(capacity - 1 - int(torch.randint(0, 3, (1,), generator=gen)), 0)
        ids = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=gen).unique()
        ids = torch.cat([ids[ids != -1], torch.tensor([0, INT64_MIN, INT64_MAX])])[: max(capacity - 1, 0)]
        stored.append(ids)
        if ids.numel():
            rows = torch.randint(0, 10**6, (ids.numel(),), generator=gen)
            rows[::7] = -2  # a removed id's row, as FBGEMM's kernels alone leave it
            table = slots[int(slot_offsets[t]) : int(slot_offsets[t + 1])]
            bag = torch.tensor([0, ids.numel()], dtype=torch.int64)
            torch.ops.fbgemm.pruned_hashmap_insert(ids, rows, bag, table, torch.tensor([0, capacity]))
    return slots, slot_offsets, stored


def _batch(stored: list[torch.Tensor], batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` bags per table of 0-5 ids: stored ones, absent ones, -1 and the int64 extremes."""
    values, lengths = [], torch.randint(0, 6, (len(stored) * batch,), generator=gen)
    for t, ids in enumerate(stored):
        pool = torch.cat([ids, torch.randint(INT64_MIN, INT64_MAX, (8,), generator=gen), torch.tensor([-1, -1])])
        count = int(lengths[t * batch : (t + 1) * batch].sum())
        values.append(pool[torch.randint(0, pool.numel(), (count,), generator=gen)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.cat(values), offsets


@torch.jit.script
def _scripted(
    ids: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor, slot_offsets: torch.Tensor
) -> torch.Tensor:
    return torch.ops.recsdk.pruned_slots_lookup(ids, offsets, slots, slot_offsets)


@pytest.mark.parametrize("seed", range(6))
def test_rows_equal_fbgemms_lookup_on_random_tables(seed: int) -> None:
    """Tables of 1 to 3000 slots (runs wrap around the end) and tables without slots (their ids pass
    through), missing ids, the id -1, rows below 0 returned as stored: FBGEMM's rows, bit for bit,
    eager, through the op and from TorchScript."""
    gen = torch.Generator().manual_seed(seed)
    capacities = [int(c) for c in torch.randint(1, 3000, (5,), generator=gen)]
    capacities[seed % 5] = 0
    capacities[(seed + 2) % 5] = int(torch.randint(1, 4, (1,), generator=gen))
    slots, slot_offsets, stored = _tables(capacities, gen)
    for batch in (1, 7, 300):
        ids, offsets = _batch(stored, batch, gen)
        expected = torch.ops.fbgemm.pruned_hashmap_lookup(ids, offsets, slots, slot_offsets)
        assert torch.equal(lookup_tables(ids, offsets, slots, slot_offsets), expected)
        assert torch.equal(torch.ops.recsdk.pruned_slots_lookup(ids, offsets, slots, slot_offsets), expected)
        assert torch.equal(_scripted(ids, offsets, slots, slot_offsets), expected)
        t = seed % 5  # the table without slots
        first, end = int(offsets[t * batch]), int(offsets[(t + 1) * batch])
        assert torch.equal(expected[first:end], ids[first:end])
        assert (expected[ids == -1] == -1).all()
    # the last batch had every case: found, absent, a row below 0
    assert (expected >= 0).any() and ((expected == -1) & (ids != -1)).any() and (expected == -2).any()


def test_offsets_past_the_last_bag_are_not_read_and_a_full_table_ends_its_probe() -> None:
    gen = torch.Generator().manual_seed(7)
    slots, slot_offsets, stored = _tables([50, 20], gen)
    ids, offsets = _batch(stored, 3, gen)
    longer = torch.cat([offsets, torch.tensor([10**9])])  # (8 - 1) // 2 = 3 bags a table, as FBGEMM reads it
    expected = torch.ops.fbgemm.pruned_hashmap_lookup(ids, longer, slots, slot_offsets)
    assert torch.equal(lookup_tables(ids, longer, slots, slot_offsets), expected)
    # Every slot taken: an absent id is -1 after a probe of every slot (FBGEMM's loop would not end).
    full = torch.full((4, 2), -1, dtype=torch.int64)
    keys = torch.tensor([11, 12, 13, 14])
    torch.ops.fbgemm.pruned_hashmap_insert(keys, torch.arange(4), torch.tensor([0, 4]), full, torch.tensor([0, 4]))
    rows = lookup_tables(torch.tensor([12, 99, -1]), torch.tensor([0, 3]), full, torch.tensor([0, 4]))
    assert rows.tolist() == [1, -1, -1]


def test_bad_arguments_are_refused_before_any_id_is_read() -> None:
    slots = torch.full((8, 2), -1, dtype=torch.int64)
    ids, offsets, slot_offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]), torch.tensor([0, 8])
    with pytest.raises(TypeError, match="ids must be a contiguous int64"):
        lookup_tables(ids.int(), offsets, slots, slot_offsets)
    with pytest.raises(TypeError, match=r"offsets .*\(not contiguous\)"):
        lookup_tables(ids, torch.tensor([0, 9, 1, 9, 3])[::2], slots, slot_offsets)
    with pytest.raises(TypeError, match="slot_offsets must be a tensor"):
        lookup_tables(ids, offsets, slots, [0, 8])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"slots must be \[num_slots, 2\]"):
        lookup_tables(ids, offsets, slots.view(-1), slot_offsets)
    with pytest.raises(ValueError, match="ids must be 1-d"):
        lookup_tables(ids.view(3, 1), offsets, slots, slot_offsets)
    with pytest.raises(ValueError, match="slot_offsets must hold at least 2"):
        lookup_tables(ids, offsets, slots, torch.tensor([0]))
    with pytest.raises(ValueError, match="hold no bag for 2 tables"):
        lookup_tables(ids, torch.tensor([0, 3]), slots, torch.tensor([0, 4, 8]))
    for bad in ([0, 2, 1], [-1, 1, 3], [0, 1, 4]):  # falling; below 0; past the ids
        with pytest.raises(ValueError, match=r"offsets must rise within \[0, 3\]"):
            lookup_tables(ids, torch.tensor(bad), slots, slot_offsets)
    for bad in ([0, 9], [-1, 8], [4, 2, 8]):  # past the slots; below 0; falling (two tables)
        bags = offsets if len(bad) == 3 else torch.tensor([0, 1, 2, 3])
        with pytest.raises(ValueError, match=r"slot_offsets must rise within \[0, 8\]"):
            lookup_tables(ids, bags, slots, torch.tensor(bad))
    # The op makes its inputs contiguous; it checks their type.
    rows = pruned_slots_lookup(ids, torch.tensor([0, 9, 1, 9, 3])[::2], slots, slot_offsets)
    assert rows.tolist() == [-1, -1, -1]
    with pytest.raises(RuntimeError, match="ids must be a contiguous int64"):
        _scripted(ids.int(), offsets, slots, slot_offsets)


@pytest.mark.parametrize(
    ("env", "reason"),
    [({"RECSDK_NATIVE_KERNELS": "0"}, "RECSDK_NATIVE_KERNELS=0"), ({"CC": "false"}, "failed")],
)
def test_without_the_kernel_the_op_runs_fbgemms_lookup(env: dict[str, str], reason: str, tmp_path: Path) -> None:
    code = (
        "import torch, fbgemm_gpu\n"
        "from recsdk.embedding.slot_lookup import native_lookup_available, native_lookup_unavailable_reason\n"
        "assert not native_lookup_available()\n"
        "print(native_lookup_unavailable_reason())\n"
        "slots = torch.full((8, 2), -1, dtype=torch.int64)\n"
        "ids, bags = torch.tensor([5, 6, -1]), torch.tensor([0, 2, 3])\n"
        "torch.ops.fbgemm.pruned_hashmap_insert(ids[:1], torch.tensor([4]), torch.tensor([0, 1]), slots,"
        " torch.tensor([0, 8]))\n"
        "with torch.autograd.profiler.profile() as prof:\n"
        "    rows = torch.ops.recsdk.pruned_slots_lookup(ids, bags, slots, torch.tensor([0, 8]))\n"
        "assert rows.tolist() == [4, -1, -1], rows\n"
        "assert 'fbgemm::pruned_hashmap_lookup' in {e.name for e in prof.function_events}\n"
    )
    run_env = {**os.environ, "RECSDK_CACHE_DIR": str(tmp_path), **env}
    out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert reason in out.stdout
