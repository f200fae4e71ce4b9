/*
 * recsdk's kernels over FBGEMM's pruned-hashmap layout (see slot_kernels.py).
 *
 * The slots are ``num_slots`` (key, row) int64 pairs, exactly as FBGEMM's
 * ``pruned_hashmap_lookup`` / ``pruned_hashmap_insert`` read and write them: key -1 marks an empty
 * slot, an id's home slot is MurmurHash3's 64-bit finaliser of the id modulo ``num_slots``, and a
 * probe steps one slot on (wrapping). So FBGEMM's lookup reads what these kernels write, and the
 * other way round. What FBGEMM lacks is ``slots_remove``: it deletes by shifting the entries of
 * the probe run back (no tombstone is left, so probes stay as short as the live load makes them).
 *
 * Plain C, no Python or torch headers: the loader compiles it with the system's C compiler and
 * calls it through ctypes, which releases the GIL for the call. The caller checks every argument
 * (contiguous int64 arrays of the given lengths); nothing here allocates.
 */
#include <stdint.h>

static inline uint64_t slot_hash(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

#define BLOCK 16 /* ids whose home slots are prefetched together */

/* rows[i]: the row of ids[i], -1 where absent (and where a slot holds a removed id's row < 0).
 * Returns how many ids were absent. */
int64_t slots_lookup(const int64_t *ids, int64_t n, const int64_t *slots, int64_t num_slots, int64_t *rows) {
    int64_t missing = 0;
    uint64_t home[BLOCK];
    const uint64_t m = (uint64_t)num_slots;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t end = start + BLOCK < n ? start + BLOCK : n;
        for (int64_t i = start; i < end; i++) {
            home[i - start] = slot_hash((uint64_t)ids[i]) % m;
            __builtin_prefetch(&slots[2 * home[i - start]]);
        }
        for (int64_t i = start; i < end; i++) {
            const int64_t id = ids[i];
            uint64_t s = home[i - start];
            int64_t row = -1;
            for (;;) {
                const int64_t key = slots[2 * s];
                if (key == -1) break;
                if (key == id) {
                    row = slots[2 * s + 1];
                    if (row < 0) row = -1;
                    break;
                }
                if (++s == m) s = 0;
            }
            rows[i] = row;
            missing += row < 0;
        }
    }
    return missing;
}

/* Store ids[i] at rows[i] (an id already stored gets the new row), as FBGEMM's insert does. */
void slots_insert(const int64_t *ids, const int64_t *rows, int64_t n, int64_t *slots, int64_t num_slots) {
    const uint64_t m = (uint64_t)num_slots;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if (id == -1) continue; /* the empty marker cannot be stored (the caller keeps it aside) */
        uint64_t s = slot_hash((uint64_t)id) % m;
        while (slots[2 * s] != -1 && slots[2 * s] != id) {
            if (++s == m) s = 0;
        }
        slots[2 * s] = id;
        slots[2 * s + 1] = rows[i];
    }
}

/* Remove ids (absent ones are skipped) by backward-shift deletion: the entries after the freed
 * slot in its probe run move back when their home slot does not lie cyclically in (freed, here].
 * Returns how many ids were removed. */
int64_t slots_remove(const int64_t *ids, int64_t n, int64_t *slots, int64_t num_slots) {
    const uint64_t m = (uint64_t)num_slots;
    int64_t removed = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if (id == -1) continue;
        uint64_t hole = slot_hash((uint64_t)id) % m;
        while (slots[2 * hole] != id) {
            if (slots[2 * hole] == -1) break;
            if (++hole == m) hole = 0;
        }
        if (slots[2 * hole] != id) continue;
        removed++;
        uint64_t j = hole;
        for (;;) {
            if (++j == m) j = 0;
            const int64_t key = slots[2 * j];
            if (key == -1) break;
            const uint64_t k = slot_hash((uint64_t)key) % m;
            const int stays = hole <= j ? (hole < k && k <= j) : (hole < k || k <= j);
            if (stays) continue;
            slots[2 * hole] = key;
            slots[2 * hole + 1] = slots[2 * j + 1];
            hole = j;
        }
        slots[2 * hole] = -1;
        slots[2 * hole + 1] = -1;
    }
    return removed;
}
