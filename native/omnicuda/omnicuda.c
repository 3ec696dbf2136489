/*
 * libomnicuda.so: LD_PRELOAD shim that puts an instance's CUDA memory under omnid.
 *
 * - Every allocation (runtime, driver, reached directly, through dlsym or through
 *   cuGetProcAddress) is counted against the instance's quota; past it the caller
 *   gets the out-of-memory error code, and cu/cudaMemGetInfo and NVML report
 *   total = quota, free = quota - used.
 * - In managed mode allocations become unified memory, preferred on the GPU, so
 *   omnid can ask (through the control block) to move all of it to host memory
 *   and back: a background thread prefetches every live allocation and acks.
 *
 * One table lists every intercepted symbol (HAMi-core style). A thread-local
 * depth guard keeps a runtime hook's call into cudart from being counted again
 * by the driver hook below it. Hooks never call malloc: live allocations sit in
 * an mmap'd open-addressing table under one mutex.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "omnicuda.h"

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------ state */

static struct omni_control g_local = {.magic = OMNI_CTL_MAGIC, .version = OMNI_CTL_VERSION};
static struct omni_control *g_ctl = &g_local; /* the shared block, or a private one */
static __thread int t_depth;                  /* >0 while a hook calls into CUDA */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext g_ctx;  /* context of the first managed allocation: used to swap */
static int g_swapper_started;
static int g_warned_vmm;

static uint64_t now_realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t now_mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void touch(void) {
    __atomic_store_n(&g_ctl->last_activity_ns, now_realtime_ns(), __ATOMIC_RELAXED);
}

static int managed(void) { return g_ctl->mode == OMNI_MODE_MANAGED; }

/* ------------------------------------------------ table of live allocations */

#define TABLE_BITS 20
#define TABLE_SIZE (1ull << TABLE_BITS)
#define FLAG_MANAGED (1ull << 63) /* in the size word: prefetchable unified memory */

struct slot {
    uint64_t key; /* device pointer (or VMM handle); 0 = empty */
    uint64_t size;
};
static struct slot *g_table;
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
static void count_peak(uint64_t used) {
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

static int reserve(uint64_t n) {
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

static void unreserve(uint64_t n) { __atomic_fetch_sub(&g_ctl->used_bytes, n, __ATOMIC_RELAXED); }

static void start_swapper(void);

/* Ranges the process declared it will not write again (a model's weights, through
 * omni_read_only): moved so that the host keeps its copy (see move_all). */
#define MAX_READ_ONLY 16384
struct range {
    uint64_t start, size;
};
static struct range g_read_only[MAX_READ_ONLY];
static int g_n_read_only;

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

static void track(uint64_t key, uint64_t size, int is_managed) {
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
static uint64_t untrack(uint64_t key) {
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

static void report_mem(size_t *free_bytes, size_t *total_bytes) {
    uint64_t quota = __atomic_load_n(&g_ctl->quota_bytes, __ATOMIC_RELAXED);
    if (!quota) return;
    uint64_t used = __atomic_load_n(&g_ctl->used_bytes, __ATOMIC_RELAXED) + pool_unbacked();
    if (total_bytes) *total_bytes = quota;
    if (free_bytes) *free_bytes = used >= quota ? 0 : quota - used;
}

/* ------------------------------------------------------- the hook table */

enum lib { LIB_RT, LIB_DRV, LIB_NVML };
enum hook_id {
    H_cudaMalloc, H_cudaMallocManaged, H_cudaMallocAsync, H_cudaMallocPitch, H_cudaFree,
    H_cudaFreeAsync, H_cudaMemGetInfo,
    H_cuMemAlloc, H_cuMemAllocManaged, H_cuMemAllocPitch, H_cuMemAllocAsync, H_cuMemFree,
    H_cuMemFreeAsync, H_cuMemGetInfo, H_cuMemCreate, H_cuMemRelease, H_cuLaunchKernel,
    H_cuLaunchKernelEx, H_cuGraphLaunch, H_cuGetProcAddress, H_cuGetProcAddress_v2,
    H_nvmlDeviceGetMemoryInfo, H_nvmlDeviceGetMemoryInfo_v2,
    H_COUNT
};

struct hook {
    const char *symbol;    /* exported name, as dlsym is asked for it */
    const char *proc_name; /* name cuGetProcAddress is asked for (driver only) */
    int min_version;       /* cuGetProcAddress cudaVersion from which it is this variant */
    enum lib lib;
    void *hook;
    void *real;
};

static struct hook g_hooks[H_COUNT];
static void *(*real_dlsym)(void *, const char *);

static const char *const LIB_NAMES[] = {"libcudart.so", "libcuda.so", "libnvidia-ml.so"};

/* Whether `fn` is one of our own functions: a library that does not bind its own
 * symbols (no -Bsymbolic) hands out our interposed exports as its "real" ones. */
static int is_ours(void *fn) {
    static void *our_base;
    Dl_info info;
    if (!our_base && dladdr((void *)&is_ours, &info)) our_base = info.dli_fbase;
    return dladdr(fn, &info) && info.dli_fbase == our_base;
}

struct find_ctx {
    const char *needle;
    char path[512];
};

static int find_lib_cb(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct find_ctx *ctx = data;
    if (info->dlpi_name && strstr(info->dlpi_name, ctx->needle)) {
        snprintf(ctx->path, sizeof ctx->path, "%s", info->dlpi_name);
        return 1;
    }
    return 0;
}

/* A symbol of an already loaded CUDA library, even one loaded RTLD_LOCAL. */
static void *lib_symbol(enum lib lib, const char *symbol) {
    void *fn = real_dlsym(RTLD_NEXT, symbol);
    if (fn && !is_ours(fn)) return fn;
    fn = NULL;
    struct find_ctx ctx = {.needle = LIB_NAMES[lib]};
    if (!dl_iterate_phdr(find_lib_cb, &ctx)) return NULL;
    void *handle = dlopen(ctx.path, RTLD_LAZY | RTLD_NOLOAD);
    if (!handle) return NULL;
    fn = real_dlsym(handle, symbol);
    dlclose(handle);
    return fn;
}

static void *real_of(enum hook_id id) {
    void *fn = __atomic_load_n(&g_hooks[id].real, __ATOMIC_ACQUIRE);
    if (fn) return fn;
    fn = lib_symbol(g_hooks[id].lib, g_hooks[id].symbol);
    if (fn) __atomic_store_n(&g_hooks[id].real, fn, __ATOMIC_RELEASE);
    return fn;
}

static void *driver(const char *symbol) { return lib_symbol(LIB_DRV, symbol); }

#define REAL(id, type) ((type)real_of(id))
#define MISSING(kind) fprintf(stderr, "omnicuda: real %s not found\n", kind)

/* -------------------------------------------------------- driver hooks */

typedef CUresult (*cuMemAllocManaged_t)(CUdeviceptr *, size_t, unsigned int);
typedef CUresult (*cuMemAdvise_v2_t)(CUdeviceptr, size_t, int, CUmemLocation);
typedef CUresult (*cuCtxGetCurrent_t)(CUcontext *);
typedef CUresult (*cuCtxSetCurrent_t)(CUcontext);
typedef CUresult (*cuCtxGetDevice_t)(CUdevice *);

/* Prefer the caller's GPU for new unified memory, and remember the context the
 * swap thread will move it in. */
static void place_on_gpu(CUdeviceptr ptr, size_t size) {
    CUdevice dev = 0;
    cuCtxGetDevice_t get_dev = (cuCtxGetDevice_t)driver("cuCtxGetDevice");
    if (get_dev) get_dev(&dev);
    cuMemAdvise_v2_t advise = (cuMemAdvise_v2_t)driver("cuMemAdvise_v2");
    if (advise) {
        CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, dev};
        advise(ptr, size, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, loc);
    }
    if (!__atomic_load_n(&g_ctx, __ATOMIC_ACQUIRE)) {
        cuCtxGetCurrent_t get_ctx = (cuCtxGetCurrent_t)driver("cuCtxGetCurrent");
        CUcontext ctx = NULL;
        if (get_ctx && get_ctx(&ctx) == CUDA_SUCCESS && ctx)
            __atomic_store_n(&g_ctx, ctx, __ATOMIC_RELEASE);
    }
}

/* Unified memory in place of device memory, preferred on the caller's GPU. */
static CUresult alloc_managed(CUdeviceptr *dptr, size_t size) {
    cuMemAllocManaged_t alloc = REAL(H_cuMemAllocManaged, cuMemAllocManaged_t);
    if (!alloc) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = alloc(dptr, size, CU_MEM_ATTACH_GLOBAL);
    if (rc == CUDA_SUCCESS) place_on_gpu(*dptr, size);
    return rc;
}

typedef CUresult (*cuMemAlloc_t)(CUdeviceptr *, size_t);
static CUresult hook_cuMemAlloc(CUdeviceptr *dptr, size_t size) {
    if (t_depth) return REAL(H_cuMemAlloc, cuMemAlloc_t)(dptr, size);
    if (!reserve(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = managed() ? alloc_managed(dptr, size)
                            : REAL(H_cuMemAlloc, cuMemAlloc_t)(dptr, size);
    if (rc != CUDA_SUCCESS) {
        unreserve(size);
        return rc;
    }
    track(*dptr, size, managed());
    return rc;
}

static CUresult hook_cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
    cuMemAllocManaged_t real = REAL(H_cuMemAllocManaged, cuMemAllocManaged_t);
    if (t_depth) return real(dptr, size, flags);
    if (!reserve(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(dptr, size, flags);
    if (rc != CUDA_SUCCESS) {
        unreserve(size);
        return rc;
    }
    track(*dptr, size, 1);
    return rc;
}

typedef CUresult (*cuMemAllocPitch_t)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
static CUresult hook_cuMemAllocPitch(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                     size_t height, unsigned int elem) {
    cuMemAllocPitch_t real = REAL(H_cuMemAllocPitch, cuMemAllocPitch_t);
    if (t_depth) return real(dptr, pitch, width, height, elem);
    size_t row = (width + PITCH_ALIGN - 1) / PITCH_ALIGN * PITCH_ALIGN;
    uint64_t size = (uint64_t)row * height;
    if (!reserve(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc;
    if (managed()) {
        rc = alloc_managed(dptr, size);
        if (rc == CUDA_SUCCESS) *pitch = row;
    } else {
        rc = real(dptr, pitch, width, height, elem);
    }
    if (rc != CUDA_SUCCESS) {
        unreserve(size);
        return rc;
    }
    track(*dptr, size, managed());
    return rc;
}

typedef CUresult (*cuMemAllocAsync_t)(CUdeviceptr *, size_t, CUstream);
static CUresult hook_cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream stream) {
    cuMemAllocAsync_t real = REAL(H_cuMemAllocAsync, cuMemAllocAsync_t);
    if (t_depth) return real(dptr, size, stream);
    if (!reserve(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    /* managed: stream-ordered pools cannot hand out unified memory; allocate now */
    CUresult rc = managed() ? alloc_managed(dptr, size) : real(dptr, size, stream);
    if (rc != CUDA_SUCCESS) {
        unreserve(size);
        return rc;
    }
    track(*dptr, size, managed());
    return rc;
}

typedef CUresult (*cuMemFree_t)(CUdeviceptr);
static CUresult hook_cuMemFree(CUdeviceptr dptr) {
    if (!t_depth) untrack(dptr);
    return REAL(H_cuMemFree, cuMemFree_t)(dptr);
}

typedef CUresult (*cuMemFreeAsync_t)(CUdeviceptr, CUstream);
typedef CUresult (*cuStreamSynchronize_t)(CUstream);
static CUresult hook_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    if (t_depth) return REAL(H_cuMemFreeAsync, cuMemFreeAsync_t)(dptr, stream);
    if (untrack(dptr) & FLAG_MANAGED) {
        /* unified memory is not pool memory: free it the synchronous way, after the stream */
        cuStreamSynchronize_t sync = (cuStreamSynchronize_t)driver("cuStreamSynchronize");
        if (sync) sync(stream);
        return REAL(H_cuMemFree, cuMemFree_t)(dptr);
    }
    return REAL(H_cuMemFreeAsync, cuMemFreeAsync_t)(dptr, stream);
}

typedef CUresult (*cuMemGetInfo_t)(size_t *, size_t *);
static CUresult hook_cuMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    CUresult rc = REAL(H_cuMemGetInfo, cuMemGetInfo_t)(free_bytes, total_bytes);
    if (rc == CUDA_SUCCESS) report_mem(free_bytes, total_bytes);
    return rc;
}

typedef CUresult (*cuMemCreate_t)(CUmemGenericAllocationHandle *, size_t, const void *,
                                  unsigned long long);
static CUresult hook_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                 const void *prop, unsigned long long flags) {
    cuMemCreate_t real = REAL(H_cuMemCreate, cuMemCreate_t);
    if (t_depth) return real(handle, size, prop, flags);
    if (managed()) {
        if (!__atomic_exchange_n(&g_warned_vmm, 1, __ATOMIC_RELAXED))
            fprintf(stderr,
                    "omnicuda: cuMemCreate (virtual memory management) is refused in managed "
                    "mode: its memory could not be swapped. For PyTorch, leave "
                    "PYTORCH_CUDA_ALLOC_CONF without expandable_segments.\n");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (!reserve(size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(handle, size, prop, flags);
    if (rc != CUDA_SUCCESS) {
        unreserve(size);
        return rc;
    }
    track(*handle, size, 0);
    return rc;
}

typedef CUresult (*cuMemRelease_t)(CUmemGenericAllocationHandle);
static CUresult hook_cuMemRelease(CUmemGenericAllocationHandle handle) {
    if (!t_depth) untrack(handle);
    return REAL(H_cuMemRelease, cuMemRelease_t)(handle);
}

typedef CUresult (*cuLaunchKernel_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned,
                                     unsigned, unsigned, CUstream, void **, void **);
static CUresult hook_cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                    unsigned by, unsigned bz, unsigned shmem, CUstream stream,
                                    void **params, void **extra) {
    touch();
    return REAL(H_cuLaunchKernel, cuLaunchKernel_t)(f, gx, gy, gz, bx, by, bz, shmem, stream,
                                                    params, extra);
}

typedef CUresult (*cuLaunchKernelEx_t)(const void *, void *, void **, void **);
static CUresult hook_cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) {
    touch();
    return REAL(H_cuLaunchKernelEx, cuLaunchKernelEx_t)(config, f, params, extra);
}

typedef CUresult (*cuGraphLaunch_t)(CUgraphExec, CUstream);
static CUresult hook_cuGraphLaunch(CUgraphExec exec, CUstream stream) {
    touch();
    return REAL(H_cuGraphLaunch, cuGraphLaunch_t)(exec, stream);
}

/* cuGetProcAddress: where cudart (and PyTorch, Triton) find driver entry points. */
static void redirect(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    if (!*pfn || (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)) return;
    for (int i = 0; i < H_COUNT; i++) {
        struct hook *h = &g_hooks[i];
        if (h->lib == LIB_DRV && h->proc_name && version >= h->min_version &&
            strcmp(symbol, h->proc_name) == 0) {
            if (!is_ours(*pfn)) __atomic_store_n(&h->real, *pfn, __ATOMIC_RELEASE);
            *pfn = h->hook;
            return;
        }
    }
}

typedef CUresult (*cuGetProcAddress_t)(const char *, void **, int, cuuint64_t);
static CUresult hook_cuGetProcAddress(const char *symbol, void **pfn, int version,
                                      cuuint64_t flags) {
    CUresult rc = REAL(H_cuGetProcAddress, cuGetProcAddress_t)(symbol, pfn, version, flags);
    if (rc == CUDA_SUCCESS) redirect(symbol, pfn, version, flags);
    return rc;
}

typedef CUresult (*cuGetProcAddress_v2_t)(const char *, void **, int, cuuint64_t, void *);
static CUresult hook_cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                         cuuint64_t flags, void *status) {
    CUresult rc =
        REAL(H_cuGetProcAddress_v2, cuGetProcAddress_v2_t)(symbol, pfn, version, flags, status);
    if (rc == CUDA_SUCCESS) redirect(symbol, pfn, version, flags);
    return rc;
}

/* ------------------------------------------------------- runtime hooks */

#define RT_CALL(expr)  \
    ({                 \
        t_depth++;     \
        __auto_type r_ = (expr); \
        t_depth--;     \
        r_;            \
    })

typedef cudaError_t (*cudaMalloc_t)(void **, size_t);
typedef cudaError_t (*cudaMallocManaged_t)(void **, size_t, unsigned int);

static cudaError_t rt_alloc(void **ptr, size_t size, int as_managed) {
    if (!reserve(size)) return cudaErrorMemoryAllocation;
    cudaError_t rc = as_managed
        ? RT_CALL(REAL(H_cudaMallocManaged, cudaMallocManaged_t)(ptr, size, cudaMemAttachGlobal))
        : RT_CALL(REAL(H_cudaMalloc, cudaMalloc_t)(ptr, size));
    if (rc != cudaSuccess) {
        unreserve(size);
        return rc;
    }
    if (as_managed && managed()) place_on_gpu((CUdeviceptr)*ptr, size);
    track((uint64_t)*ptr, size, as_managed);
    return rc;
}

EXPORT cudaError_t cudaMalloc(void **ptr, size_t size) {
    if (t_depth) return REAL(H_cudaMalloc, cudaMalloc_t)(ptr, size);
    return rt_alloc(ptr, size, managed());
}

EXPORT cudaError_t cudaMallocManaged(void **ptr, size_t size, unsigned int flags) {
    if (t_depth || flags != cudaMemAttachGlobal)
        return REAL(H_cudaMallocManaged, cudaMallocManaged_t)(ptr, size, flags);
    return rt_alloc(ptr, size, 1);
}

typedef cudaError_t (*cudaMallocAsync_t)(void **, size_t, cudaStream_t);
EXPORT cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream) {
    if (t_depth || !managed()) {
        if (t_depth) return REAL(H_cudaMallocAsync, cudaMallocAsync_t)(ptr, size, stream);
        if (!reserve(size)) return cudaErrorMemoryAllocation;
        cudaError_t rc = RT_CALL(REAL(H_cudaMallocAsync, cudaMallocAsync_t)(ptr, size, stream));
        if (rc != cudaSuccess) {
            unreserve(size);
            return rc;
        }
        track((uint64_t)*ptr, size, 0);
        return rc;
    }
    return rt_alloc(ptr, size, 1);
}

typedef cudaError_t (*cudaMallocPitch_t)(void **, size_t *, size_t, size_t);
EXPORT cudaError_t cudaMallocPitch(void **ptr, size_t *pitch, size_t width, size_t height) {
    cudaMallocPitch_t real = REAL(H_cudaMallocPitch, cudaMallocPitch_t);
    if (t_depth) return real(ptr, pitch, width, height);
    size_t row = (width + PITCH_ALIGN - 1) / PITCH_ALIGN * PITCH_ALIGN;
    if (managed()) {
        cudaError_t rc = rt_alloc(ptr, (size_t)row * height, 1);
        if (rc == cudaSuccess) *pitch = row;
        return rc;
    }
    uint64_t size = (uint64_t)row * height;
    if (!reserve(size)) return cudaErrorMemoryAllocation;
    cudaError_t rc = RT_CALL(real(ptr, pitch, width, height));
    if (rc != cudaSuccess) {
        unreserve(size);
        return rc;
    }
    track((uint64_t)*ptr, size, 0);
    return rc;
}

typedef cudaError_t (*cudaFree_t)(void *);
EXPORT cudaError_t cudaFree(void *ptr) {
    if (!t_depth) untrack((uint64_t)ptr);
    return RT_CALL(REAL(H_cudaFree, cudaFree_t)(ptr));
}

typedef cudaError_t (*cudaFreeAsync_t)(void *, cudaStream_t);
typedef cudaError_t (*cudaStreamSynchronize_t)(cudaStream_t);
EXPORT cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream) {
    if (t_depth) return REAL(H_cudaFreeAsync, cudaFreeAsync_t)(ptr, stream);
    if (untrack((uint64_t)ptr) & FLAG_MANAGED) { /* unified memory: free after the stream */
        cudaStreamSynchronize_t sync =
            (cudaStreamSynchronize_t)lib_symbol(LIB_RT, "cudaStreamSynchronize");
        if (sync) RT_CALL(sync(stream));
        return RT_CALL(REAL(H_cudaFree, cudaFree_t)(ptr));
    }
    return RT_CALL(REAL(H_cudaFreeAsync, cudaFreeAsync_t)(ptr, stream));
}

typedef cudaError_t (*cudaMemGetInfo_t)(size_t *, size_t *);
EXPORT cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    cudaError_t rc = RT_CALL(REAL(H_cudaMemGetInfo, cudaMemGetInfo_t)(free_bytes, total_bytes));
    if (rc == cudaSuccess) report_mem(free_bytes, total_bytes);
    return rc;
}

/* Direct (PLT) calls into libcuda land here too. */
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t s) { return hook_cuMemAlloc(d, s); }
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *d, size_t s, unsigned int f) {
    return hook_cuMemAllocManaged(d, s, f);
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *d, size_t *p, size_t w, size_t h, unsigned e) {
    return hook_cuMemAllocPitch(d, p, w, h, e);
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *d, size_t s, CUstream st) {
    return hook_cuMemAllocAsync(d, s, st);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr d) { return hook_cuMemFree(d); }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr d, CUstream st) { return hook_cuMemFreeAsync(d, st); }
EXPORT CUresult cuMemGetInfo_v2(size_t *f, size_t *t) { return hook_cuMemGetInfo(f, t); }
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t s, const void *p,
                            unsigned long long f) {
    return hook_cuMemCreate(h, s, p, f);
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) { return hook_cuMemRelease(h); }
EXPORT CUresult cuGetProcAddress(const char *s, void **p, int v, cuuint64_t f) {
    return hook_cuGetProcAddress(s, p, v, f);
}
EXPORT CUresult cuGetProcAddress_v2(const char *s, void **p, int v, cuuint64_t f, void *st) {
    return hook_cuGetProcAddress_v2(s, p, v, f, st);
}

/* ---------------------------------------------------------- NVML hooks */

/* NVML's view under a quota: total = quota, free = quota - used. 0: no quota. */
static int quota_view(unsigned long long *total, unsigned long long *free_bytes,
                      unsigned long long *used) {
    if (!__atomic_load_n(&g_ctl->quota_bytes, __ATOMIC_RELAXED)) return 0;
    size_t f = 0, t = 0;
    report_mem(&f, &t);
    *total = t, *free_bytes = f, *used = t - f;
    return 1;
}

typedef nvmlReturn_t (*nvmlDeviceGetMemoryInfo_t)(nvmlDevice_t, nvmlMemory_t *);
static nvmlReturn_t hook_nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    nvmlReturn_t rc = REAL(H_nvmlDeviceGetMemoryInfo, nvmlDeviceGetMemoryInfo_t)(dev, mem);
    if (rc == NVML_SUCCESS) quota_view(&mem->total, &mem->free, &mem->used);
    return rc;
}

typedef nvmlReturn_t (*nvmlDeviceGetMemoryInfo_v2_t)(nvmlDevice_t, nvmlMemory_v2_t *);
static nvmlReturn_t hook_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem) {
    nvmlReturn_t rc = REAL(H_nvmlDeviceGetMemoryInfo_v2, nvmlDeviceGetMemoryInfo_v2_t)(dev, mem);
    if (rc == NVML_SUCCESS && quota_view(&mem->total, &mem->free, &mem->used)) mem->reserved = 0;
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    return hook_nvmlDeviceGetMemoryInfo(d, m);
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    return hook_nvmlDeviceGetMemoryInfo_v2(d, m);
}

/* ---------------------------------------------------------------- dlsym */

static void find_real_dlsym(void) {
    real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym)
        real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

EXPORT void *dlsym(void *handle, const char *symbol) {
    if (!real_dlsym) find_real_dlsym(); /* a library's constructor may run before ours */
    void *fn = real_dlsym(handle, symbol);
    if (!fn || !g_hooks[0].symbol) return fn;
    for (int i = 0; i < H_COUNT; i++) {
        if (strcmp(symbol, g_hooks[i].symbol) == 0) {
            if (!is_ours(fn)) __atomic_store_n(&g_hooks[i].real, fn, __ATOMIC_RELEASE);
            return g_hooks[i].hook;
        }
    }
    return fn;
}

/* ------------------------------------------------------- the KV pool */

/* One range of plain device memory whose contents the process can lose at a swap-out:
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
static CUresult pool_out(void) {
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
static CUresult pool_in(void) {
    pthread_mutex_lock(&g_pool.lock);
    g_pool.away = 0;
    pthread_cond_broadcast(&g_pool.cond);
    pthread_mutex_unlock(&g_pool.lock);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ swapping */

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

static void start_swapper(void) {
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

/* ---------------------------------------------------------------- setup */

static void after_fork_child(void) {
    /* The child has no swap thread and must not share the parent's accounting. */
    pthread_mutex_init(&g_lock, NULL);
    g_swapper_started = 0;
    pthread_mutex_init(&g_pool.lock, NULL); /* nor the parent's pool */
    pthread_cond_init(&g_pool.cond, NULL);
    g_pool.va = 0, g_pool.size = 0, g_pool.inside = g_pool.away = g_pool.closing = 0;
    g_pool.mapped = NULL, g_pool.runs = NULL, g_pool.n_runs = 0;
    g_local.pool_bytes = g_local.pool_mapped_bytes = 0;
    if (g_ctl != &g_local) {
        g_local.quota_bytes = g_ctl->quota_bytes;
        g_local.mode = g_ctl->mode;
        g_ctl = &g_local;
    }
}

#define HOOK(id, sym, proc, ver, lib_, fn) \
    g_hooks[id] = (struct hook){sym, proc, ver, lib_, (void *)(fn), NULL}

__attribute__((constructor)) static void omnicuda_init(void) {
    if (!real_dlsym) find_real_dlsym();
    HOOK(H_cudaMalloc, "cudaMalloc", NULL, 0, LIB_RT, cudaMalloc);
    HOOK(H_cudaMallocManaged, "cudaMallocManaged", NULL, 0, LIB_RT, cudaMallocManaged);
    HOOK(H_cudaMallocAsync, "cudaMallocAsync", NULL, 0, LIB_RT, cudaMallocAsync);
    HOOK(H_cudaMallocPitch, "cudaMallocPitch", NULL, 0, LIB_RT, cudaMallocPitch);
    HOOK(H_cudaFree, "cudaFree", NULL, 0, LIB_RT, cudaFree);
    HOOK(H_cudaFreeAsync, "cudaFreeAsync", NULL, 0, LIB_RT, cudaFreeAsync);
    HOOK(H_cudaMemGetInfo, "cudaMemGetInfo", NULL, 0, LIB_RT, cudaMemGetInfo);
    HOOK(H_cuMemAlloc, "cuMemAlloc_v2", "cuMemAlloc", 3020, LIB_DRV, hook_cuMemAlloc);
    HOOK(H_cuMemAllocManaged, "cuMemAllocManaged", "cuMemAllocManaged", 0, LIB_DRV,
         hook_cuMemAllocManaged);
    HOOK(H_cuMemAllocPitch, "cuMemAllocPitch_v2", "cuMemAllocPitch", 3020, LIB_DRV,
         hook_cuMemAllocPitch);
    HOOK(H_cuMemAllocAsync, "cuMemAllocAsync", "cuMemAllocAsync", 0, LIB_DRV,
         hook_cuMemAllocAsync);
    HOOK(H_cuMemFree, "cuMemFree_v2", "cuMemFree", 3020, LIB_DRV, hook_cuMemFree);
    HOOK(H_cuMemFreeAsync, "cuMemFreeAsync", "cuMemFreeAsync", 0, LIB_DRV, hook_cuMemFreeAsync);
    HOOK(H_cuMemGetInfo, "cuMemGetInfo_v2", "cuMemGetInfo", 3020, LIB_DRV, hook_cuMemGetInfo);
    HOOK(H_cuMemCreate, "cuMemCreate", "cuMemCreate", 0, LIB_DRV, hook_cuMemCreate);
    HOOK(H_cuMemRelease, "cuMemRelease", "cuMemRelease", 0, LIB_DRV, hook_cuMemRelease);
    HOOK(H_cuLaunchKernel, "cuLaunchKernel", "cuLaunchKernel", 0, LIB_DRV, hook_cuLaunchKernel);
    HOOK(H_cuLaunchKernelEx, "cuLaunchKernelEx", "cuLaunchKernelEx", 0, LIB_DRV,
         hook_cuLaunchKernelEx);
    HOOK(H_cuGraphLaunch, "cuGraphLaunch", "cuGraphLaunch", 0, LIB_DRV, hook_cuGraphLaunch);
    HOOK(H_cuGetProcAddress, "cuGetProcAddress", "cuGetProcAddress", 0, LIB_DRV,
         hook_cuGetProcAddress);
    HOOK(H_cuGetProcAddress_v2, "cuGetProcAddress_v2", NULL, 0, LIB_DRV,
         hook_cuGetProcAddress_v2);
    HOOK(H_nvmlDeviceGetMemoryInfo, "nvmlDeviceGetMemoryInfo", NULL, 0, LIB_NVML,
         hook_nvmlDeviceGetMemoryInfo);
    HOOK(H_nvmlDeviceGetMemoryInfo_v2, "nvmlDeviceGetMemoryInfo_v2", NULL, 0, LIB_NVML,
         hook_nvmlDeviceGetMemoryInfo_v2);

    const char *path = getenv("OMNI_CUDA_CONTROL");
    if (path && *path) {
        int fd = open(path, O_RDWR | O_CLOEXEC);
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct omni_control)) {
            void *p = mmap(NULL, sizeof(struct omni_control), PROT_READ | PROT_WRITE, MAP_SHARED,
                           fd, 0);
            struct omni_control *ctl = p;
            if (p != MAP_FAILED && ctl->magic == OMNI_CTL_MAGIC &&
                ctl->version == OMNI_CTL_VERSION) {
                g_ctl = ctl;
                g_ctl->pid = (uint32_t)getpid();
            } else {
                fprintf(stderr, "omnicuda: %s is not a version %u control block; not enforcing\n",
                        path, OMNI_CTL_VERSION);
                if (p != MAP_FAILED) munmap(p, sizeof(struct omni_control));
            }
        } else {
            fprintf(stderr, "omnicuda: cannot map control block %s: %s\n", path, strerror(errno));
        }
        if (fd >= 0) close(fd);
    }
    pthread_atfork(NULL, NULL, after_fork_child);
}
