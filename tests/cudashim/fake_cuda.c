/*
 * A fake CUDA for machines without a GPU: built twice, as libcuda.so.1 (the
 * driver, -DFAKE_DRIVER) and libcudart.so.13 (the runtime, -DFAKE_RUNTIME).
 *
 * "Device" memory is host memory. Every driver call is logged, one line each,
 * to the file named by $FAKE_CUDA_LOG, so tests can see exactly what the shim
 * asked for. Like the real cudart, the fake runtime reaches the driver through
 * dlopen("libcuda.so.1") + dlsym("cuGetProcAddress_v2") + cuGetProcAddress: the
 * routes the shim must intercept.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;
typedef struct {
    int type, id;
} CUmemLocation;

#define FAKE_TOTAL (80ull << 30)

#ifdef FAKE_DRIVER
static uint64_t g_live;
static uint64_t g_next_handle = 1;

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void logf_(const char *fmt, ...) {
    const char *path = getenv("FAKE_CUDA_LOG");
    if (!path) return;
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    line[n++] = '\n';
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (fd >= 0) {
        (void)!write(fd, line, n);
        close(fd);
    }
}

static void *take(size_t size) {
    __atomic_fetch_add(&g_live, size, __ATOMIC_RELAXED);
    return calloc(1, size ? size : 1);
}

CUresult cuInit(unsigned flags) { (void)flags; return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t s) {
    *d = (CUdeviceptr)take(s);
    logf_("cuMemAlloc_v2 %zu %#llx", s, *d);
    return 0;
}
CUresult cuMemAllocManaged(CUdeviceptr *d, size_t s, unsigned flags) {
    *d = (CUdeviceptr)take(s);
    logf_("cuMemAllocManaged %zu %#llx %u", s, *d, flags);
    return 0;
}
CUresult cuMemAllocPitch_v2(CUdeviceptr *d, size_t *pitch, size_t w, size_t h, unsigned e) {
    (void)e;
    *pitch = (w + 511) / 512 * 512;
    *d = (CUdeviceptr)take(*pitch * h);
    logf_("cuMemAllocPitch_v2 %zu %#llx", *pitch * h, *d);
    return 0;
}
CUresult cuMemAllocAsync(CUdeviceptr *d, size_t s, CUstream st) {
    (void)st;
    *d = (CUdeviceptr)take(s);
    logf_("cuMemAllocAsync %zu %#llx", s, *d);
    return 0;
}
CUresult cuMemFree_v2(CUdeviceptr d) {
    logf_("cuMemFree_v2 %#llx", d);
    free((void *)d);
    return 0;
}
CUresult cuMemFreeAsync(CUdeviceptr d, CUstream st) {
    (void)st;
    logf_("cuMemFreeAsync %#llx", d);
    free((void *)d);
    return 0;
}
CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total) {
    *total = FAKE_TOTAL;
    *free_b = FAKE_TOTAL - __atomic_load_n(&g_live, __ATOMIC_RELAXED);
    return 0;
}
CUresult cuMemCreate(unsigned long long *handle, size_t s, const void *prop, unsigned long long f) {
    (void)prop;
    (void)f;
    *handle = __atomic_fetch_add(&g_next_handle, 1, __ATOMIC_RELAXED);
    logf_("cuMemCreate %zu %llu", s, *handle);
    return 0;
}
CUresult cuMemRelease(unsigned long long handle) {
    logf_("cuMemRelease %llu", handle);
    return 0;
}
CUresult cuCtxGetCurrent(void **ctx) { *ctx = (void *)0x1; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { (void)ctx; return 0; }
CUresult cuCtxGetDevice(int *dev) { *dev = 0; return 0; }
CUresult cuStreamCreate(CUstream *s, unsigned flags) { (void)flags; *s = (CUstream)0x2; return 0; }
CUresult cuStreamSynchronize(CUstream s) {
    logf_("cuStreamSynchronize %p", s);
    return 0;
}
CUresult cuMemPrefetchAsync_v2(CUdeviceptr d, size_t s, CUmemLocation loc, unsigned f, CUstream st) {
    (void)f;
    (void)st;
    logf_("prefetch %#llx %zu %s", d, s, loc.type == 2 ? "host" : "device");
    return 0;
}
/* Virtual memory management, for the shim's KV pool: addresses are host addresses no
 * one touches, and every call is logged. */
CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    (void)prop;
    (void)option;
    *g = 2u << 20;
    return 0;
}
CUresult cuMemAddressReserve(CUdeviceptr *d, size_t s, size_t align, CUdeviceptr addr,
                             unsigned long long f) {
    (void)align;
    (void)addr;
    (void)f;
    *d = (CUdeviceptr)malloc(s);
    logf_("cuMemAddressReserve %zu %#llx", s, *d);
    return *d ? 0 : 2;
}
CUresult cuMemAddressFree(CUdeviceptr d, size_t s) {
    logf_("cuMemAddressFree %#llx %zu", d, s);
    free((void *)d);
    return 0;
}
CUresult cuMemMap(CUdeviceptr d, size_t s, size_t off, unsigned long long h, unsigned long long f) {
    (void)off;
    (void)f;
    __atomic_fetch_add(&g_live, s, __ATOMIC_RELAXED);
    logf_("cuMemMap %#llx %zu %llu", d, s, h);
    return 0;
}
CUresult cuMemUnmap(CUdeviceptr d, size_t s) {
    __atomic_fetch_sub(&g_live, s, __ATOMIC_RELAXED);
    logf_("cuMemUnmap %#llx %zu", d, s);
    return 0;
}
CUresult cuMemSetAccess(CUdeviceptr d, size_t s, const void *desc, size_t n) {
    (void)desc;
    (void)n;
    logf_("cuMemSetAccess %#llx %zu", d, s);
    return 0;
}
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t s) {
    logf_("cuMemsetD8 %#llx %u %zu", d, v, s);
    return 0;
}
CUresult cuCtxSynchronize(void) {
    logf_("cuCtxSynchronize");
    return 0;
}
CUresult cuMemAdvise_v2(CUdeviceptr d, size_t s, int advice, CUmemLocation loc) {
    logf_("advise %#llx %zu %d %s", d, s, advice, loc.type == 2 ? "host" : "device");
    return 0;
}

static const struct {
    const char *name;
    void *fn;
} PROCS[] = {
    {"cuMemAlloc", (void *)cuMemAlloc_v2},       {"cuMemAllocManaged", (void *)cuMemAllocManaged},
    {"cuMemAllocPitch", (void *)cuMemAllocPitch_v2}, {"cuMemAllocAsync", (void *)cuMemAllocAsync},
    {"cuMemFree", (void *)cuMemFree_v2},         {"cuMemFreeAsync", (void *)cuMemFreeAsync},
    {"cuMemGetInfo", (void *)cuMemGetInfo_v2},   {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemRelease", (void *)cuMemRelease},      {"cuStreamSynchronize", (void *)cuStreamSynchronize},
};

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, uint64_t flags, void *status) {
    (void)ver;
    (void)flags;
    (void)status;
    for (size_t i = 0; i < sizeof PROCS / sizeof PROCS[0]; i++)
        if (strcmp(sym, PROCS[i].name) == 0) {
            *pfn = PROCS[i].fn;
            return 0;
        }
    *pfn = NULL;
    return 500; /* CUDA_ERROR_NOT_FOUND */
}
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, uint64_t flags) {
    return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}
#endif

#ifdef FAKE_RUNTIME
typedef CUresult (*gpa_t)(const char *, void **, int, uint64_t, void *);
static void *driver_fn(const char *name) {
    static gpa_t gpa;
    if (!gpa) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!h) return NULL;
        gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
    }
    void *fn = NULL;
    return gpa && gpa(name, &fn, 13000, 0, NULL) == 0 ? fn : NULL;
}

#define DRV(name, type) ((type)driver_fn(name))
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*alloc_flags_t)(CUdeviceptr *, size_t, unsigned);
typedef CUresult (*alloc_async_t)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*pitch_t)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
typedef CUresult (*free_t)(CUdeviceptr);
typedef CUresult (*free_async_t)(CUdeviceptr, CUstream);
typedef CUresult (*info_t)(size_t *, size_t *);
typedef CUresult (*sync_t)(CUstream);

int cudaMalloc(void **p, size_t s) { return DRV("cuMemAlloc", alloc_t)((CUdeviceptr *)p, s); }
int cudaMallocManaged(void **p, size_t s, unsigned f) {
    return DRV("cuMemAllocManaged", alloc_flags_t)((CUdeviceptr *)p, s, f);
}
int cudaMallocAsync(void **p, size_t s, CUstream st) {
    return DRV("cuMemAllocAsync", alloc_async_t)((CUdeviceptr *)p, s, st);
}
int cudaMallocPitch(void **p, size_t *pitch, size_t w, size_t h) {
    return DRV("cuMemAllocPitch", pitch_t)((CUdeviceptr *)p, pitch, w, h, 4);
}
int cudaFree(void *p) { return p ? DRV("cuMemFree", free_t)((CUdeviceptr)p) : 0; }
int cudaFreeAsync(void *p, CUstream st) {
    return DRV("cuMemFreeAsync", free_async_t)((CUdeviceptr)p, st);
}
int cudaMemGetInfo(size_t *f, size_t *t) { return DRV("cuMemGetInfo", info_t)(f, t); }
int cudaStreamSynchronize(CUstream st) { return DRV("cuStreamSynchronize", sync_t)(st); }
#endif
