/* The KV pool.
 *
 * One range of plain device memory whose contents the process can lose at a swap-out:
 * an engine's KV cache, most of an instance's quota, which an idle instance needs for
 * nothing but the prefixes it cached. Its addresses are reserved once and the whole of
 * it is committed against the quota, but physical memory is mapped under it only where
 * the process asks (omni_pool_map: the blocks its requests take), in runs of the
 * driver's granularity. So the pool holds what its use needs, and used_bytes says so.
 * A swap-out unmaps and releases every run, nothing copied; after a swap-in the pool
 * is empty until the process maps again: pointers and captured CUDA graphs stay valid.
 * (Probes, printed only: 1.4 GiB unmapped and released, or mapped and zeroed, in ~1 ms
 * each way on an H200; 1 GiB of unified memory took 60-230 ms to the host and 22 ms
 * back on an H100. Discarding unified memory, cuMemDiscardBatchAsync, was tried there:
 * driver 580 kept the contents and the prefetch to the host after it took as long as a
 * copy.)
 *
 * The process must not touch the pool while it is away, nor where it has not mapped:
 * it calls omni_pool_enter before work that may (blocking while the pool is away) and
 * omni_pool_leave once it is idle; a swap-out waits for it to leave, then for the
 * context's queued work, and only then unmaps. omni_pool_epoch counts the swap-outs
 * that lost the contents (and the mappings). */
#include "shim.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define POOL_WAIT_MS 10000 /* a swap-out waits this long for the process to leave */

typedef CUresult (*cuCtxSynchronize_t)(void);
typedef CUresult (*cuMemAddressReserve_t)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
                                          unsigned long long);
typedef CUresult (*cuMemAddressFree_t)(CUdeviceptr, size_t);
typedef CUresult (*cuMemMap_t)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                               unsigned long long);
typedef CUresult (*cuMemUnmap_t)(CUdeviceptr, size_t);
typedef CUresult (*cuMemSetAccess_t)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*cuMemGetAllocationGranularity_t)(size_t *, const CUmemAllocationProp *, int);
typedef CUresult (*cuMemsetD8_t)(CUdeviceptr, unsigned char, size_t);

struct pool_run { /* granules [first, first + count) under one physical allocation */
    size_t first, count;
    CUmemGenericAllocationHandle handle;
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    CUdeviceptr va; /* 0: no pool */
    size_t size, gran;
    CUdevice dev;
    unsigned char *mapped; /* a flag a granule */
    struct pool_run *runs; /* at most one a granule */
    size_t n_runs;
    int inside;  /* enters not yet left */
    int away;    /* its memory is released (swapped out) */
    int closing; /* a swap-out waits for the process to leave */
    uint64_t epoch;
} g_pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

/* Zeroed physical memory under granules [first, first + count). Under g_pool.lock. */
static CUresult pool_map_run(size_t first, size_t count) {
    cuMemCreate_t create = REAL(H_cuMemCreate, cuMemCreate_t);
    cuMemMap_t map = (cuMemMap_t)driver("cuMemMap");
    cuMemUnmap_t unmap = (cuMemUnmap_t)driver("cuMemUnmap");
    cuMemSetAccess_t access = (cuMemSetAccess_t)driver("cuMemSetAccess");
    cuMemsetD8_t memset8 = (cuMemsetD8_t)driver("cuMemsetD8_v2");
    cuMemRelease_t release = REAL(H_cuMemRelease, cuMemRelease_t);
    if (!create || !map || !unmap || !access || !memset8 || !release)
        return CUDA_ERROR_NOT_SUPPORTED;
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE,
                                .location = {CU_MEM_LOCATION_TYPE_DEVICE, g_pool.dev}};
    CUmemAccessDesc rw = {{CU_MEM_LOCATION_TYPE_DEVICE, g_pool.dev},
                          CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUdeviceptr at = g_pool.va + first * g_pool.gran;
    size_t bytes = count * g_pool.gran;
    CUmemGenericAllocationHandle handle = 0;
    CUresult rc = create(&handle, bytes, &prop, 0); /* the real ones: counted here */
    if (rc != CUDA_SUCCESS) return rc;
    rc = map(at, bytes, 0, handle, 0);
    if (rc == CUDA_SUCCESS) {
        rc = access(at, bytes, &rw, 1);
        if (rc == CUDA_SUCCESS) rc = memset8(at, 0, bytes);
        if (rc != CUDA_SUCCESS) unmap(at, bytes);
    }
    if (rc != CUDA_SUCCESS) {
        release(handle);
        return rc;
    }
    g_pool.runs[g_pool.n_runs++] = (struct pool_run){first, count, handle};
    memset(g_pool.mapped + first, 1, count);
    __atomic_fetch_add(&g_ctl->pool_mapped_bytes, bytes, __ATOMIC_RELAXED);
    count_peak(__atomic_add_fetch(&g_ctl->used_bytes, bytes, __ATOMIC_RELAXED));
    return CUDA_SUCCESS;
}

/* Release every run's physical memory, keeping the addresses. Under g_pool.lock. */
static CUresult pool_unmap_all(void) {
    cuMemUnmap_t unmap = (cuMemUnmap_t)driver("cuMemUnmap");
    cuMemRelease_t release = REAL(H_cuMemRelease, cuMemRelease_t);
    if (!unmap || !release) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = CUDA_SUCCESS;
    while (g_pool.n_runs && rc == CUDA_SUCCESS) {
        struct pool_run *run = &g_pool.runs[g_pool.n_runs - 1];
        size_t bytes = run->count * g_pool.gran;
        rc = unmap(g_pool.va + run->first * g_pool.gran, bytes);
        if (rc == CUDA_SUCCESS) rc = release(run->handle);
        if (rc != CUDA_SUCCESS) break;
        memset(g_pool.mapped + run->first, 0, run->count);
        __atomic_fetch_sub(&g_ctl->pool_mapped_bytes, bytes, __ATOMIC_RELAXED);
        unreserve(bytes);
        g_pool.n_runs--;
    }
    return rc;
}

/* Commit `size` bytes of pool against the quota (held by nothing yet): 0 if over it. */
static int commit_pool(uint64_t size) {
    __atomic_store_n(&g_ctl->pool_bytes, size, __ATOMIC_RELAXED); /* others see less room */
    uint64_t quota = __atomic_load_n(&g_ctl->quota_bytes, __ATOMIC_RELAXED);
    uint64_t used = __atomic_load_n(&g_ctl->used_bytes, __ATOMIC_RELAXED);
    if (quota && (used + size > quota || used + size < used)) {
        __atomic_store_n(&g_ctl->pool_bytes, 0, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g_ctl->alloc_failures, 1, __ATOMIC_RELAXED);
        return 0;
    }
    return 1;
}

/* The pool, `size` bytes (rounded up to the driver's granularity) committed against
 * the quota, none of it mapped yet; its device address, or 0: not in managed mode, a
 * pool made already, over the quota, or the driver refused (the caller then allocates
 * its cache the usual way). */
EXPORT uint64_t omni_pool_alloc(uint64_t size) {
    cuCtxGetCurrent_t get_ctx = (cuCtxGetCurrent_t)driver("cuCtxGetCurrent");
    cuCtxGetDevice_t get_dev = (cuCtxGetDevice_t)driver("cuCtxGetDevice");
    cuMemGetAllocationGranularity_t granularity =
        (cuMemGetAllocationGranularity_t)driver("cuMemGetAllocationGranularity");
    cuMemAddressReserve_t reserve_va = (cuMemAddressReserve_t)driver("cuMemAddressReserve");
    if (!managed() || !size || !get_ctx || !get_dev || !granularity || !reserve_va) return 0;
    pthread_mutex_lock(&g_pool.lock);
    CUdeviceptr va = 0;
    CUcontext ctx = NULL;
    size_t gran = 0;
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
    if (g_pool.va || get_ctx(&ctx) != CUDA_SUCCESS || !ctx ||
        get_dev(&prop.location.id) != CUDA_SUCCESS ||
        granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || !gran)
        goto fail;
    size = (size + gran - 1) / gran * gran;
    size_t granules = size / gran;
    unsigned char *mapped = calloc(granules, 1); /* not a hook: called once, from Python */
    struct pool_run *runs = calloc(granules, sizeof *runs);
    if (!mapped || !runs || !commit_pool(size)) {
        free(mapped), free(runs);
        goto fail;
    }
    if (reserve_va(&va, size, gran, 0, 0) != CUDA_SUCCESS) {
        free(mapped), free(runs);
        __atomic_store_n(&g_ctl->pool_bytes, 0, __ATOMIC_RELAXED);
        goto fail;
    }
    g_pool.va = va, g_pool.size = size, g_pool.gran = gran, g_pool.dev = prop.location.id;
    g_pool.mapped = mapped, g_pool.runs = runs, g_pool.n_runs = 0;
    if (!__atomic_load_n(&g_ctx, __ATOMIC_ACQUIRE)) __atomic_store_n(&g_ctx, ctx, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_pool.lock);
    __atomic_fetch_add(&g_ctl->live_allocs, 1, __ATOMIC_RELAXED);
    touch();
    start_swapper();
    return va;
fail:
    pthread_mutex_unlock(&g_pool.lock);
    return 0;
}

/* Back bytes [offset, offset + length) of the pool with zeroed memory (rounded out to
 * whole granules; those mapped already stay as they are). The caller is inside the
 * pool (omni_pool_enter). 0, or the CUresult that stopped it: the pool is away or has
 * no such range, or the driver has no memory. */
EXPORT int omni_pool_map(uint64_t offset, uint64_t length) {
    cuCtxSynchronize_t sync = (cuCtxSynchronize_t)driver("cuCtxSynchronize");
    cuCtxGetCurrent_t get_ctx = (cuCtxGetCurrent_t)driver("cuCtxGetCurrent");
    cuCtxSetCurrent_t set_ctx = (cuCtxSetCurrent_t)driver("cuCtxSetCurrent");
    pthread_mutex_lock(&g_pool.lock);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    CUcontext ctx = NULL;
    if (!g_pool.va || g_pool.away || !sync || !get_ctx || !set_ctx || offset > g_pool.size ||
        length > g_pool.size - offset)
        goto done;
    /* the caller's thread may have no context current (a thread that has launched only
     * through the driver, or none yet): the pool's, as the swap thread does */
    rc = get_ctx(&ctx);
    if (rc == CUDA_SUCCESS && !ctx) rc = set_ctx(__atomic_load_n(&g_ctx, __ATOMIC_ACQUIRE));
    if (rc != CUDA_SUCCESS) goto done;
    size_t end = (offset + length + g_pool.gran - 1) / g_pool.gran;
    int grew = 0;
    rc = CUDA_SUCCESS;
    for (size_t g = offset / g_pool.gran; g < end && rc == CUDA_SUCCESS;) {
        if (g_pool.mapped[g]) {
            g++;
            continue;
        }
        size_t stop = g;
        while (stop < end && !g_pool.mapped[stop]) stop++;
        rc = pool_map_run(g, stop - g);
        grew = 1, g = stop;
    }
    if (grew && rc == CUDA_SUCCESS) rc = sync(); /* zeroed before the process writes */
    if (grew) touch();
done:
    pthread_mutex_unlock(&g_pool.lock);
    return (int)rc;
}

/* The calling thread is about to do work that may touch the pool: wait while it is away. */
EXPORT void omni_pool_enter(void) {
    pthread_mutex_lock(&g_pool.lock);
    while (g_pool.away || g_pool.closing) pthread_cond_wait(&g_pool.cond, &g_pool.lock);
    g_pool.inside++;
    pthread_mutex_unlock(&g_pool.lock);
}

/* ... and is idle now: what it queued may still run, the swap-out waits for that. */
EXPORT void omni_pool_leave(void) {
    pthread_mutex_lock(&g_pool.lock);
    if (g_pool.inside > 0) g_pool.inside--;
    pthread_cond_broadcast(&g_pool.cond);
    pthread_mutex_unlock(&g_pool.lock);
}

/* How many swap-outs have lost the pool's contents. */
EXPORT uint64_t omni_pool_epoch(void) { return __atomic_load_n(&g_pool.epoch, __ATOMIC_ACQUIRE); }

/* Swap-out: once the process has left and its queued work is done, release the pool.
 * CUDA_ERROR_NOT_READY if it did not leave in POOL_WAIT_MS (OMNI_POOL_WAIT_MS). */
CUresult pool_out(void) {
    cuCtxSynchronize_t sync = (cuCtxSynchronize_t)driver("cuCtxSynchronize");
    const char *env = getenv("OMNI_POOL_WAIT_MS");
    long wait_ms = env ? atol(env) : POOL_WAIT_MS;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += wait_ms / 1000;
    deadline.tv_nsec += (wait_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&g_pool.lock);
    CUresult rc = CUDA_SUCCESS;
    if (!g_pool.va || g_pool.away) goto done;
    if (!sync) {
        rc = CUDA_ERROR_NOT_SUPPORTED;
        goto done;
    }
    g_pool.closing = 1; /* no new enter from here on */
    while (g_pool.inside && rc == CUDA_SUCCESS)
        if (pthread_cond_timedwait(&g_pool.cond, &g_pool.lock, &deadline) == ETIMEDOUT)
            rc = CUDA_ERROR_NOT_READY;
    if (rc == CUDA_SUCCESS) rc = sync(); /* what the process queued before it left */
    if (rc == CUDA_SUCCESS) rc = pool_unmap_all();
    if (rc == CUDA_SUCCESS) {
        g_pool.away = 1;
        __atomic_fetch_add(&g_pool.epoch, 1, __ATOMIC_RELEASE);
    }
    g_pool.closing = 0;
    pthread_cond_broadcast(&g_pool.cond);
done:
    pthread_mutex_unlock(&g_pool.lock);
    return rc;
}

/* Swap-in: the process may enter again, and maps what it uses. */
CUresult pool_in(void) {
    pthread_mutex_lock(&g_pool.lock);
    g_pool.away = 0;
    pthread_cond_broadcast(&g_pool.cond);
    pthread_mutex_unlock(&g_pool.lock);
    return CUDA_SUCCESS;
}

/* In a forked child (setup.c): no pool, the parent's is not its own. */
void pool_after_fork(void) {
    pthread_mutex_init(&g_pool.lock, NULL);
    pthread_cond_init(&g_pool.cond, NULL);
    g_pool.va = 0, g_pool.size = 0, g_pool.inside = g_pool.away = g_pool.closing = 0;
    g_pool.mapped = NULL, g_pool.runs = NULL, g_pool.n_runs = 0;
}
