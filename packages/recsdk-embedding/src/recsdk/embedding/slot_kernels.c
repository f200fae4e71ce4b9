/*
 * recsdk's kernels over FBGEMM's pruned-hashmap layout (see slot_kernels.py).
 *
 * The slots are ``num_slots`` (key, row) int64 pairs, exactly as FBGEMM's
 * ``pruned_hashmap_lookup`` / ``pruned_hashmap_insert`` read and write them: key -1 marks an empty
 * slot, an id's home slot is MurmurHash3's 64-bit finaliser of the id modulo ``num_slots``, and a
 * probe steps one slot on (wrapping). So FBGEMM's lookup reads what these kernels write, and the
 * other way round. What FBGEMM lacks is ``slots_remove``: it deletes by shifting the entries of
 * the probe run back (no tombstone is left, so probes stay as short as the live load makes them).
 * Each kernel pipelines its probes (an id's home slot is prefetched AHEAD ids before it is read)
 * and finds home slots without a division.
 *
 * Plain C, no Python or torch headers: the loader compiles it with the system's C compiler and
 * calls it through ctypes, which releases the GIL for the call. The caller checks every argument
 * (contiguous int64 arrays of the given lengths); nothing here allocates.
 */
#include <stdint.h>
#include <stdlib.h>

static inline uint64_t slot_hash(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

/* An id's home slot, hash(id) % m. Where the compiler has 128-bit integers, without a division
 * (Lemire, Kaser and Kurz, "Faster remainder by direct computation", 2019): with
 * M = floor((2^128 - 1) / m) + 1, h % m is the high 64 bits of the 192-bit product
 * (M * h mod 2^128) * m, exact for every 64-bit h and m >= 1. A remove rehashes every entry of the
 * probe run after the freed slot, so the division was most of its cost. */
#if defined(__SIZEOF_INT128__)
typedef struct {
    unsigned __int128 magic;
    uint64_t m;
} slot_mod;

static inline slot_mod mod_of(uint64_t m) {
    slot_mod d;
    d.magic = ((unsigned __int128)-1) / m + 1;
    d.m = m;
    return d;
}

static inline uint64_t mod_by(uint64_t h, const slot_mod *d) {
    const unsigned __int128 low = d->magic * h;
    const unsigned __int128 lo = (unsigned __int128)(uint64_t)low * d->m;
    const unsigned __int128 hi = (unsigned __int128)(uint64_t)(low >> 64) * d->m;
    return (uint64_t)((hi + (lo >> 64)) >> 64);
}
#else
typedef struct {
    uint64_t m;
} slot_mod;

static inline slot_mod mod_of(uint64_t m) {
    slot_mod d;
    d.m = m;
    return d;
}

static inline uint64_t mod_by(uint64_t h, const slot_mod *d) { return h % d->m; }
#endif

static inline uint64_t home_of(uint64_t id, const slot_mod *d) { return mod_by(slot_hash(id), d); }

/* Each kernel computes the home slot of the id AHEAD places on and prefetches it while it probes
 * the current one, so about AHEAD cache misses are in flight (a power of two: a ring of homes). */
#define AHEAD 16

/* rows[i]: the row of ids[i], -1 where absent (and where a slot holds a removed id's row < 0,
 * as FBGEMM's kernels leave them). A probe stops at an empty slot, or after every slot (a table
 * with no empty slot). Returns how many ids were absent. */
int64_t slots_lookup(const int64_t *ids, int64_t n, const int64_t *slots, int64_t num_slots, int64_t *rows) {
    int64_t missing = 0;
    uint64_t home[AHEAD];
    const uint64_t m = (uint64_t)num_slots;
    const slot_mod d = mod_of(m);
    for (int64_t i = 0; i < n && i < AHEAD; i++) {
        home[i] = home_of((uint64_t)ids[i], &d);
        __builtin_prefetch(&slots[2 * home[i]]);
    }
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = home[i & (AHEAD - 1)];
        if (i + AHEAD < n) {
            const uint64_t ahead = home_of((uint64_t)ids[i + AHEAD], &d);
            home[i & (AHEAD - 1)] = ahead;
            __builtin_prefetch(&slots[2 * ahead]);
        }
        const int64_t id = ids[i];
        int64_t row = -1;
        for (uint64_t probes = 0; probes < m; probes++) {
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
    return missing;
}

/* Store ids[i] at rows[i] (an id already stored gets the new row), as FBGEMM's insert does.
 * Returns how many ids found no slot (a full table: the probe gave up after every slot). */
int64_t slots_insert(const int64_t *ids, const int64_t *rows, int64_t n, int64_t *slots, int64_t num_slots) {
    int64_t unplaced = 0;
    uint64_t home[AHEAD];
    const slot_mod d = mod_of((uint64_t)num_slots);
    const uint64_t m = (uint64_t)num_slots;
    for (int64_t i = 0; i < n && i < AHEAD; i++) {
        home[i] = home_of((uint64_t)ids[i], &d);
        __builtin_prefetch(&slots[2 * home[i]], 1);
    }
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = home[i & (AHEAD - 1)];
        if (i + AHEAD < n) {
            const uint64_t ahead = home_of((uint64_t)ids[i + AHEAD], &d);
            home[i & (AHEAD - 1)] = ahead;
            __builtin_prefetch(&slots[2 * ahead], 1);
        }
        const int64_t id = ids[i];
        if (id == -1) continue; /* the empty marker cannot be stored (the caller keeps it aside) */
        uint64_t probes = 0;
        while (slots[2 * s] != -1 && slots[2 * s] != id && probes < m) {
            if (++s == m) s = 0;
            probes++;
        }
        if (probes == m) {
            unplaced++;
            continue;
        }
        slots[2 * s] = id;
        slots[2 * s + 1] = rows[i];
    }
    return unplaced;
}

/* Remove ids (absent ones are skipped) by backward-shift deletion: the entries after the freed
 * slot in its probe run move back when their home slot does not lie cyclically in (freed, here].
 * Returns how many ids were removed. */
int64_t slots_remove(const int64_t *ids, int64_t n, int64_t *slots, int64_t num_slots) {
    uint64_t home[AHEAD];
    const slot_mod d = mod_of((uint64_t)num_slots);
    const uint64_t m = (uint64_t)num_slots;
    int64_t removed = 0;
    for (int64_t i = 0; i < n && i < AHEAD; i++) {
        home[i] = home_of((uint64_t)ids[i], &d);
        __builtin_prefetch(&slots[2 * home[i]], 1);
    }
    for (int64_t i = 0; i < n; i++) {
        uint64_t hole = home[i & (AHEAD - 1)];
        if (i + AHEAD < n) {
            const uint64_t ahead = home_of((uint64_t)ids[i + AHEAD], &d);
            home[i & (AHEAD - 1)] = ahead;
            __builtin_prefetch(&slots[2 * ahead], 1);
        }
        const int64_t id = ids[i];
        if (id == -1) continue;
        while (slots[2 * hole] != id) {
            if (slots[2 * hole] == -1) break;
            if (++hole == m) hole = 0;
        }
        if (slots[2 * hole] != id) continue;
        removed++;
        slots[2 * hole] = -1; /* emptied first: the scan below ends there at the latest (a full table) */
        slots[2 * hole + 1] = -1;
        uint64_t j = hole;
        for (;;) {
            if (++j == m) j = 0;
            const int64_t key = slots[2 * j];
            if (key == -1) break;
            const uint64_t k = home_of((uint64_t)key, &d);
            const int stays = hole <= j ? (hole < k && k <= j) : (hole < k || k <= j);
            if (stays) continue;
            slots[2 * hole] = key;
            slots[2 * hole + 1] = slots[2 * j + 1];
            slots[2 * j] = -1;
            slots[2 * j + 1] = -1;
            hole = j;
        }
    }
    return removed;
}

/* The count-min sketch of admission (count_sketch.py): k rows of `width` counters end to end.
 * An id's counter in row j is j * width + (fmix64(id ^ salts[j]) & INT64_MAX) % width, as
 * CountMinSketch.positions computes it in torch ops. sketch_read_T writes positions [k, n] (row
 * major) and each id's estimate, the least of its k counters; sketch_raise_T raises each id's
 * counters to at least new_counts[i] (the conservative update), or returns -1, changing nothing,
 * when a position lies outside the num_counters counters. */
#define SKETCH_KERNELS(T, SUFFIX)                                                                  \
    void sketch_read_##SUFFIX(const int64_t *ids, int64_t n, const int64_t *salts, int64_t k,     \
                              int64_t width, const T *counters, int64_t *positions, T *estimate) { \
        const slot_mod d = mod_of((uint64_t)width);                                                \
        for (int64_t j = 0; j < k; j++) {                                                          \
            const uint64_t salt = (uint64_t)salts[j];                                              \
            int64_t *row = positions + j * n;                                                      \
            for (int64_t i = 0; i < n; i++) {                                                      \
                const uint64_t h = slot_hash((uint64_t)ids[i] ^ salt) & (uint64_t)INT64_MAX;       \
                row[i] = j * width + (int64_t)mod_by(h, &d);                                       \
                __builtin_prefetch(&counters[row[i]]);                                             \
            }                                                                                      \
        }                                                                                          \
        for (int64_t i = 0; i < n; i++) {                                                          \
            T least = counters[positions[i]];                                                      \
            for (int64_t j = 1; j < k; j++) {                                                      \
                const T c = counters[positions[j * n + i]];                                        \
                if (c < least) least = c;                                                          \
            }                                                                                      \
            estimate[i] = least;                                                                   \
        }                                                                                          \
    }                                                                                              \
    int64_t sketch_raise_##SUFFIX(const int64_t *positions, int64_t n, int64_t k, const T *new_counts, \
                                  T *counters, int64_t num_counters) {                             \
        for (int64_t i = 0; i < k * n; i++) {                                                      \
            if (positions[i] < 0 || positions[i] >= num_counters) return -1;                      \
        }                                                                                          \
        for (int64_t j = 0; j < k; j++) {                                                          \
            const int64_t *row = positions + j * n;                                                \
            for (int64_t i = 0; i < n; i++) {                                                      \
                if (counters[row[i]] < new_counts[i]) counters[row[i]] = new_counts[i];            \
            }                                                                                      \
        }                                                                                          \
        return 0;                                                                                  \
    }

SKETCH_KERNELS(int32_t, int32)
SKETCH_KERNELS(int64_t, int64)

/* The queue of an id table's oldest rows (oldest_rows.py): rows[0:q], in (last step, row) order
 * at its scan. A queued row r stays queued while last_step[r] < threshold and row_state[r] is
 * `occupied`; it may go now when it also is not in the batch (batch[r] == 0), has no pin
 * (pins == NULL or pins[r] == 0) and, with has_since, was last used before `since`. Every row must
 * lie below `limit` (the length of each per-row array), else QUEUE_BAD_ROW is returned and nothing
 * changes.
 *
 * queue_free_rows: how many queued rows may go now (reads only).
 * queue_take: when at least `count` may go, writes the first `count` of them to out (those below
 * the last one's last step in ascending row order, then its ties in ascending row order: the
 * order of the table's full selection), drops them and the rows that left the queue from rows
 * (keeping the order), and returns the new length; else drops only the rows that left and
 * returns -1 - the new length. */
#define QUEUE_BAD_ROW INT64_MIN

static inline int queued_row_stays(int64_t r, const int32_t *last_step, const int8_t *row_state, int8_t occupied,
                                   int64_t threshold) {
    return last_step[r] < threshold && row_state[r] == occupied;
}

static inline int queued_row_goes(int64_t r, const int32_t *last_step, const uint8_t *batch, const int32_t *pins,
                                  int has_since, int64_t since) {
    return !batch[r] && (pins == 0 || pins[r] == 0) && (!has_since || last_step[r] < since);
}

int64_t queue_free_rows(const int64_t *rows, int64_t q, int64_t limit, const int32_t *last_step,
                        const int8_t *row_state, int8_t occupied, int64_t threshold, const uint8_t *batch,
                        const int32_t *pins, int has_since, int64_t since) {
    int64_t free = 0;
    for (int64_t i = 0; i < q; i++) {
        if (rows[i] < 0 || rows[i] >= limit) return QUEUE_BAD_ROW;
    }
    for (int64_t i = 0; i < q; i++) {
        const int64_t r = rows[i];
        free += queued_row_stays(r, last_step, row_state, occupied, threshold) &&
                queued_row_goes(r, last_step, batch, pins, has_since, since);
    }
    return free;
}

static int by_row(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int64_t queue_take(int64_t *rows, int64_t q, int64_t limit, const int32_t *last_step, const int8_t *row_state,
                   int8_t occupied, int64_t threshold, const uint8_t *batch, const int32_t *pins, int has_since,
                   int64_t since, int64_t count, int64_t *out) {
    const int64_t free = queue_free_rows(rows, q, limit, last_step, row_state, occupied, threshold, batch, pins,
                                         has_since, since);
    if (free == QUEUE_BAD_ROW) return QUEUE_BAD_ROW;
    const int take = free >= count;
    int64_t kept = 0, taken = 0;
    for (int64_t i = 0; i < q; i++) {
        const int64_t r = rows[i];
        if (!queued_row_stays(r, last_step, row_state, occupied, threshold)) continue;
        if (take && taken < count && queued_row_goes(r, last_step, batch, pins, has_since, since)) {
            out[taken++] = r;
            continue;
        }
        rows[kept++] = r;
    }
    if (!take) return -1 - kept;
    int64_t below = 0; /* out is in (last step, row) order: the ties of the last one's step end it */
    while (below < count && last_step[out[below]] < last_step[out[count - 1]]) below++;
    qsort(out, (size_t)below, sizeof(int64_t), by_row);
    return kept;
}
