/*
 * Swapping: on omnid's request (request_seq in the control block) a background thread
 * moves every live unified allocation to the host or back, and the KV pool out or in.
 */
#include "shim.h"

#include <stdio.h>
#include <stdlib.h>

CUcontext g_ctx;
static int g_swapper_started;

static uint64_t now_mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

typedef CUresult (*cuStreamCreate_t)(CUstream *, unsigned int);
typedef CUresult (*cuMemPrefetchAsync_v2_t)(CUdeviceptr, size_t, CUmemLocation, unsigned int,
                                            CUstream);

/* Copies of one move are spread over this many streams, in chunks of SWAP_CHUNK
 * bytes (OMNI_SWAP_STREAMS overrides). A 2.3 GiB torch process on the H100 (one
 * 1.3 GiB tensor and 27 of 40 MiB), median of six moves each way: to the host
 * 307 / 264 / 244 / 181 ms with 1 / 4 / 8 / 16 streams, back 103 / 85 / 77 / 77 ms. */
#define SWAP_STREAMS 16
#define MAX_SWAP_STREAMS 16
#define SWAP_CHUNK (64ull << 20)

static int swap_streams(void) {
    const char *env = getenv("OMNI_SWAP_STREAMS");
    int n = env ? atoi(env) : SWAP_STREAMS;
    return n < 1 ? 1 : n > MAX_SWAP_STREAMS ? MAX_SWAP_STREAMS : n;
}

/* Move every live unified allocation to `target` (GPU or host) and wait for it.
 *
 * What the process declared read-only (its weights) keeps a host copy: marked
 * read-mostly before each move, a move in makes a GPU copy beside the host's, and a move
 * out finds the host copy there (nothing to copy) and unmarks the range, which drops the
 * GPU copy. On the H100, 1 GiB left the GPU in 16 ms this way against 100 ms copied.
 * (Everything read-mostly was tried too: each write to such a page faults, and the
 * engine's cache and activations made serving many times slower.) */
static CUresult move_all(uint32_t target, uint64_t *moved) {
    cuCtxSetCurrent_t set_ctx = (cuCtxSetCurrent_t)driver("cuCtxSetCurrent");
    cuCtxGetDevice_t get_dev = (cuCtxGetDevice_t)driver("cuCtxGetDevice");
    cuStreamCreate_t mk_stream = (cuStreamCreate_t)driver("cuStreamCreate");
    cuStreamSynchronize_t sync = (cuStreamSynchronize_t)driver("cuStreamSynchronize");
    cuMemPrefetchAsync_v2_t prefetch = (cuMemPrefetchAsync_v2_t)driver("cuMemPrefetchAsync_v2");
    cuMemAdvise_v2_t advise = (cuMemAdvise_v2_t)driver("cuMemAdvise_v2");
    CUcontext ctx = __atomic_load_n(&g_ctx, __ATOMIC_ACQUIRE);
    if (!set_ctx || !get_dev || !mk_stream || !sync || !prefetch || !ctx)
        return CUDA_ERROR_NOT_SUPPORTED;
    static __thread CUstream streams[MAX_SWAP_STREAMS];
    int n_streams = swap_streams();
    CUresult rc = set_ctx(ctx);
    CUdevice dev = 0;
    if (rc == CUDA_SUCCESS) rc = get_dev(&dev);
    for (int s = 0; s < n_streams && rc == CUDA_SUCCESS; s++)
        if (!streams[s]) rc = mk_stream(&streams[s], CU_STREAM_NON_BLOCKING);
    if (rc != CUDA_SUCCESS) return rc;
    CUmemLocation loc = target == OMNI_RES_HOST ? (CUmemLocation){CU_MEM_LOCATION_TYPE_HOST, 0}
                                                : (CUmemLocation){CU_MEM_LOCATION_TYPE_DEVICE, dev};
    *moved = 0;
    rc = target == OMNI_RES_HOST ? pool_out() : pool_in(); /* the pool is not moved */
    if (rc != CUDA_SUCCESS) return rc;
    uint64_t chunks = 0;
    pthread_mutex_lock(&g_lock); /* allocations wait while we enqueue; cheap */
    for (int r = 0; advise && r < g_n_read_only; r++) /* before the prefetches below */
        advise(g_read_only[r].start, g_read_only[r].size, CU_MEM_ADVISE_SET_READ_MOSTLY, loc);
    for (uint64_t i = 0; g_table && i < TABLE_SIZE && rc == CUDA_SUCCESS; i++) {
        if (!g_table[i].key || !(g_table[i].size & FLAG_MANAGED)) continue;
        size_t size = g_table[i].size & ~FLAG_MANAGED;
        if (advise) advise(g_table[i].key, size, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, loc);
        for (size_t off = 0; off < size && rc == CUDA_SUCCESS; off += SWAP_CHUNK) {
            size_t n = size - off < SWAP_CHUNK ? size - off : SWAP_CHUNK;
            rc = prefetch(g_table[i].key + off, n, loc, 0, streams[chunks++ % n_streams]);
        }
        *moved += size;
    }
    pthread_mutex_unlock(&g_lock);
    CUresult sync_rc = CUDA_SUCCESS;
    for (int s = 0; s < n_streams; s++) {
        CUresult r = sync(streams[s]);
        if (sync_rc == CUDA_SUCCESS) sync_rc = r;
    }
    if (rc == CUDA_SUCCESS && sync_rc == CUDA_SUCCESS && target == OMNI_RES_HOST && advise) {
        /* the read-only ranges have their host copy now: keep that one (preferred) */
        pthread_mutex_lock(&g_lock);
        for (int r = 0; r < g_n_read_only; r++)
            advise(g_read_only[r].start, g_read_only[r].size, CU_MEM_ADVISE_UNSET_READ_MOSTLY,
                   loc);
        pthread_mutex_unlock(&g_lock);
    }
    return rc != CUDA_SUCCESS ? rc : sync_rc;
}

static void *swapper(void *arg) {
    (void)arg;
    uint64_t seen = __atomic_load_n(&g_ctl->ack_seq, __ATOMIC_ACQUIRE);
    const struct timespec tick = {0, 2 * 1000 * 1000}; /* 2 ms */
    for (;;) {
        uint64_t seq = __atomic_load_n(&g_ctl->request_seq, __ATOMIC_ACQUIRE);
        if (seq == seen) {
            nanosleep(&tick, NULL);
            continue;
        }
        uint32_t target = __atomic_load_n(&g_ctl->desired_residency, __ATOMIC_ACQUIRE);
        __atomic_store_n(&g_ctl->residency, OMNI_RES_MOVING, __ATOMIC_RELEASE);
        uint64_t t0 = now_mono_ns(), moved = 0;
        CUresult rc = move_all(target, &moved);
        g_ctl->last_swap_ns = now_mono_ns() - t0;
        g_ctl->swapped_bytes = moved;
        g_ctl->last_swap_error = rc;
        if (rc == CUDA_SUCCESS && target == OMNI_RES_GPU) /* a new window: what it holds now */
            __atomic_store_n(&g_ctl->window_peak_bytes,
                             __atomic_load_n(&g_ctl->used_bytes, __ATOMIC_RELAXED),
                             __ATOMIC_RELAXED);
        __atomic_store_n(&g_ctl->residency, rc == CUDA_SUCCESS ? target : OMNI_RES_GPU,
                         __ATOMIC_RELEASE);
        __atomic_store_n(&g_ctl->ack_seq, seq, __ATOMIC_RELEASE);
        seen = seq;
    }
    return NULL;
}

void start_swapper(void) {
    if (g_ctl == &g_local || __atomic_load_n(&g_swapper_started, __ATOMIC_ACQUIRE)) return;
    if (__atomic_exchange_n(&g_swapper_started, 1, __ATOMIC_ACQ_REL)) return;
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&thread, &attr, swapper, NULL) != 0) {
        fprintf(stderr, "omnicuda: cannot start the swap thread\n");
        __atomic_store_n(&g_swapper_started, 0, __ATOMIC_RELEASE);
    }
    pthread_attr_destroy(&attr);
}

/* In a forked child (setup.c): the swap thread was the parent's. */
void swap_after_fork(void) { g_swapper_started = 0; }
