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
 * One list, hooks.def, names every intercepted symbol (HAMi-core style). A thread-local
 * depth guard keeps a runtime hook's call into cudart from being counted again
 * by the driver hook below it. Hooks never call malloc: live allocations sit in
 * an mmap'd open-addressing table under one mutex.
 *
 * This header is what the shim's files share; nothing in it is exported but the hooks
 * hooks.def marks so. Each .c file includes it first.
 */
#ifndef OMNICUDA_SHIM_H
#define OMNICUDA_SHIM_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "cuda_abi.h"
#include "omnicuda.h"

#define EXPORT __attribute__((visibility("default")))
#define HIDDEN __attribute__((visibility("hidden")))

/* What the files share stays inside the library, even if built without
 * -fvisibility=hidden, and is reached without the GOT. */
#pragma GCC visibility push(hidden)

/* ------------------------------------------------------------------ state */

extern struct omni_control g_local; /* setup.c */
extern struct omni_control *g_ctl;  /* the shared block, or a private one (setup.c) */
extern __thread int t_depth;        /* >0 while a hook calls into CUDA (hooks.c) */
extern pthread_mutex_t g_lock;      /* the allocation table, read-only ranges (allocations.c) */
extern CUcontext g_ctx; /* context of the first managed allocation: used to swap (swap.c) */

static inline uint64_t now_realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void touch(void) {
    __atomic_store_n(&g_ctl->last_activity_ns, now_realtime_ns(), __ATOMIC_RELAXED);
}

static inline int managed(void) { return g_ctl->mode == OMNI_MODE_MANAGED; }

/* ------------------------------------ live allocations, accounting (allocations.c) */

#define TABLE_BITS 20
#define TABLE_SIZE (1ull << TABLE_BITS)
#define FLAG_MANAGED (1ull << 63) /* in the size word: prefetchable unified memory */

struct slot {
    uint64_t key; /* device pointer (or VMM handle); 0 = empty */
    uint64_t size;
};
extern struct slot *g_table;

/* Ranges the process declared it will not write again (a model's weights, through
 * omni_read_only): moved so that the host keeps its copy (see move_all). */
#define MAX_READ_ONLY 16384
struct range {
    uint64_t start, size;
};
extern struct range g_read_only[MAX_READ_ONLY];
extern int g_n_read_only;

void count_peak(uint64_t used);
int reserve(uint64_t n);
void unreserve(uint64_t n);
void track(uint64_t key, uint64_t size, int is_managed);
uint64_t untrack(uint64_t key);
void report_mem(size_t *free_bytes, size_t *total_bytes);

/* ------------------------------------------------ the hook table (hooks.c) */

enum lib { LIB_RT, LIB_DRV, LIB_NVML };
enum hook_id {
#define HOOK(name, symbol, proc_name, min_version, lib, fn, ret, params) H_##name,
#include "hooks.def"
#undef HOOK
    H_COUNT
};

void register_hooks(void);
void *real_of(enum hook_id id);
void *lib_symbol(enum lib lib, const char *symbol);
void *driver(const char *symbol);
void redirect(const char *symbol, void **pfn, int version, cuuint64_t flags);

#define REAL(id, type) ((type)real_of(id))

/* Driver functions the shim calls but does not hook. */
typedef CUresult (*cuMemAdvise_v2_t)(CUdeviceptr, size_t, int, CUmemLocation);
typedef CUresult (*cuCtxGetCurrent_t)(CUcontext *);
typedef CUresult (*cuCtxSetCurrent_t)(CUcontext);
typedef CUresult (*cuCtxGetDevice_t)(CUdevice *);
typedef CUresult (*cuStreamSynchronize_t)(CUstream);

/* ------------------------------------- the rest: driver.c, kv_pool.c, swap.c */

void place_on_gpu(CUdeviceptr ptr, size_t size);
CUresult pool_out(void);
CUresult pool_in(void);
void pool_after_fork(void);
void start_swapper(void);
void swap_after_fork(void);

#pragma GCC visibility pop

/* Each hook's real function type (cuMemAlloc_t, ...) and the hook's prototype: a runtime
 * hook is exported (it is the cuda* function), a driver or NVML hook is not. */
#define HOOK_VISIBILITY_LIB_RT EXPORT
#define HOOK_VISIBILITY_LIB_DRV HIDDEN
#define HOOK_VISIBILITY_LIB_NVML HIDDEN
#define HOOK(name, symbol, proc_name, min_version, lib, fn, ret, params) \
    typedef ret(*name##_t) params;                                        \
    HOOK_VISIBILITY_##lib ret fn params;
#include "hooks.def"
#undef HOOK

#endif
