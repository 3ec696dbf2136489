/*
 * The table of live allocations and the quota's accounting: what every allocation
 * hook reserves, tracks and gives back, and what the memory queries report.
 */
#include "shim.h"

#include <stdio.h>
#include <sys/mman.h>

pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

/* ------------------------------------------------ table of live allocations */

struct slot *g_table;
static uint64_t g_table_used;

static uint64_t slot_of(uint64_t key) {
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    return key & (TABLE_SIZE - 1);
}

static int table_ready(void) { /* under g_lock */
    if (g_table) return 1;
    void *p = mmap(NULL, TABLE_SIZE * sizeof(struct slot), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return 0;
    g_table = p;
    return 1;
}

static int table_put(uint64_t key, uint64_t size) { /* under g_lock */
    if (!table_ready() || g_table_used >= TABLE_SIZE / 2) return 0;
    uint64_t i = slot_of(key);
    while (g_table[i].key && g_table[i].key != key) i = (i + 1) & (TABLE_SIZE - 1);
    if (!g_table[i].key) g_table_used++;
    g_table[i].key = key;
    g_table[i].size = size;
    return 1;
}

static int table_take(uint64_t key, uint64_t *size) { /* under g_lock; backward-shift delete */
    if (!g_table || !key) return 0;
    uint64_t i = slot_of(key);
    while (g_table[i].key != key) {
        if (!g_table[i].key) return 0;
        i = (i + 1) & (TABLE_SIZE - 1);
    }
    *size = g_table[i].size;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & (TABLE_SIZE - 1);
        if (!g_table[j].key) break;
        uint64_t home = slot_of(g_table[j].key);
        /* move j back to i unless its home lies cyclically in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            g_table[i] = g_table[j];
            i = j;
        }
    }
    g_table[i].key = 0;
    g_table_used--;
    return 1;
}

/* ------------------------------------------------------------ accounting */

/* A new high-water mark of what the process holds, for its life and since its swap-in. */
void count_peak(uint64_t used) {
    uint64_t *marks[2] = {&g_ctl->peak_bytes, &g_ctl->window_peak_bytes};
    for (int i = 0; i < 2; i++) {
        uint64_t peak = __atomic_load_n(marks[i], __ATOMIC_RELAXED);
        while (used > peak && !__atomic_compare_exchange_n(marks[i], &peak, used, 1,
                                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        }
    }
}

/* The KV pool's bytes committed against the quota but not backed by memory yet. */
static uint64_t pool_unbacked(void) {
    uint64_t size = __atomic_load_n(&g_ctl->pool_bytes, __ATOMIC_RELAXED);
    uint64_t mapped = __atomic_load_n(&g_ctl->pool_mapped_bytes, __ATOMIC_RELAXED);
    return size > mapped ? size - mapped : 0;
}

int reserve(uint64_t n) {
    uint64_t quota = __atomic_load_n(&g_ctl->quota_bytes, __ATOMIC_RELAXED);
    uint64_t cur = __atomic_load_n(&g_ctl->used_bytes, __ATOMIC_RELAXED);
    uint64_t committed = pool_unbacked();
    do {
        if (quota && (cur + n + committed > quota || cur + n < cur)) {
            __atomic_fetch_add(&g_ctl->alloc_failures, 1, __ATOMIC_RELAXED);
            return 0;
        }
    } while (!__atomic_compare_exchange_n(&g_ctl->used_bytes, &cur, cur + n, 1,
                                          __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    count_peak(cur + n);
    return 1;
}

void unreserve(uint64_t n) { __atomic_fetch_sub(&g_ctl->used_bytes, n, __ATOMIC_RELAXED); }

/* The read-only ranges (struct range in shim.h says what they are for). */
struct range g_read_only[MAX_READ_ONLY];
int g_n_read_only;

static void forget_read_only(uint64_t key, uint64_t size) { /* under g_lock: freed */
    for (int i = 0; i < g_n_read_only;)
        if (g_read_only[i].start >= key && g_read_only[i].start < key + size)
            g_read_only[i] = g_read_only[--g_n_read_only];
        else
            i++;
}

/* The process says [ptr, ptr + size) will not be written again while it is allocated;
 * 0 if recorded, -1 if the table is full (the range is then moved as any other). */
EXPORT int omni_read_only(uint64_t ptr, uint64_t size) {
    pthread_mutex_lock(&g_lock);
    int ok = g_n_read_only < MAX_READ_ONLY;
    if (ok) g_read_only[g_n_read_only++] = (struct range){ptr, size};
    pthread_mutex_unlock(&g_lock);
    return ok ? 0 : -1;
}

void track(uint64_t key, uint64_t size, int is_managed) {
    pthread_mutex_lock(&g_lock);
    int ok = table_put(key, size | (is_managed ? FLAG_MANAGED : 0));
    pthread_mutex_unlock(&g_lock);
    if (!ok) { /* table full: count it anyway, it is merely not swappable */
        fprintf(stderr, "omnicuda: allocation table full, %llu bytes untracked\n",
                (unsigned long long)size);
    }
    __atomic_fetch_add(&g_ctl->live_allocs, 1, __ATOMIC_RELAXED);
    touch();
    if (is_managed) start_swapper();
}

/* Forget `key`; returns its size word, FLAG_MANAGED included (0: not ours, e.g.
 * allocated before we were loaded). */
uint64_t untrack(uint64_t key) {
    uint64_t size = 0;
    pthread_mutex_lock(&g_lock);
    int found = table_take(key, &size);
    if (found) forget_read_only(key, size & ~FLAG_MANAGED);
    pthread_mutex_unlock(&g_lock);
    if (!found) return 0;
    unreserve(size & ~FLAG_MANAGED);
    __atomic_fetch_sub(&g_ctl->live_allocs, 1, __ATOMIC_RELAXED);
    touch();
    return size;
}

void report_mem(size_t *free_bytes, size_t *total_bytes) {
    uint64_t quota = __atomic_load_n(&g_ctl->quota_bytes, __ATOMIC_RELAXED);
    if (!quota) return;
    uint64_t used = __atomic_load_n(&g_ctl->used_bytes, __ATOMIC_RELAXED) + pool_unbacked();
    if (total_bytes) *total_bytes = quota;
    if (free_bytes) *free_bytes = used >= quota ? 0 : quota - used;
}
