/*
 * The driver's (cu*) hooks: allocations, frees and memory queries counted against the
 * quota, unified memory in place of device memory in managed mode, launches as
 * activity, and cuGetProcAddress answered with our hooks.
 */
#include "shim.h"

#include <stdio.h>

static int g_warned_vmm;

/* Prefer the caller's GPU for new unified memory, and remember the context the
 * swap thread will move it in. */
void place_on_gpu(CUdeviceptr ptr, size_t size) {
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

CUresult hook_cuMemAlloc(CUdeviceptr *dptr, size_t size) {
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

CUresult hook_cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
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

CUresult hook_cuMemAllocPitch(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                              unsigned int elem) {
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

CUresult hook_cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream stream) {
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

CUresult hook_cuMemFree(CUdeviceptr dptr) {
    if (!t_depth) untrack(dptr);
    return REAL(H_cuMemFree, cuMemFree_t)(dptr);
}

CUresult hook_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    if (t_depth) return REAL(H_cuMemFreeAsync, cuMemFreeAsync_t)(dptr, stream);
    if (untrack(dptr) & FLAG_MANAGED) {
        /* unified memory is not pool memory: free it the synchronous way, after the stream */
        cuStreamSynchronize_t sync = (cuStreamSynchronize_t)driver("cuStreamSynchronize");
        if (sync) sync(stream);
        return REAL(H_cuMemFree, cuMemFree_t)(dptr);
    }
    return REAL(H_cuMemFreeAsync, cuMemFreeAsync_t)(dptr, stream);
}

CUresult hook_cuMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    CUresult rc = REAL(H_cuMemGetInfo, cuMemGetInfo_t)(free_bytes, total_bytes);
    if (rc == CUDA_SUCCESS) report_mem(free_bytes, total_bytes);
    return rc;
}

CUresult hook_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const void *prop,
                          unsigned long long flags) {
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

CUresult hook_cuMemRelease(CUmemGenericAllocationHandle handle) {
    if (!t_depth) untrack(handle);
    return REAL(H_cuMemRelease, cuMemRelease_t)(handle);
}

CUresult hook_cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, unsigned shmem, CUstream stream,
                             void **params, void **extra) {
    touch();
    return REAL(H_cuLaunchKernel, cuLaunchKernel_t)(f, gx, gy, gz, bx, by, bz, shmem, stream,
                                                    params, extra);
}

CUresult hook_cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) {
    touch();
    return REAL(H_cuLaunchKernelEx, cuLaunchKernelEx_t)(config, f, params, extra);
}

CUresult hook_cuGraphLaunch(CUgraphExec exec, CUstream stream) {
    touch();
    return REAL(H_cuGraphLaunch, cuGraphLaunch_t)(exec, stream);
}

/* cuGetProcAddress: the driver's entry point, answered with our hooks (redirect, hooks.c). */
CUresult hook_cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    CUresult rc = REAL(H_cuGetProcAddress, cuGetProcAddress_t)(symbol, pfn, version, flags);
    if (rc == CUDA_SUCCESS) redirect(symbol, pfn, version, flags);
    return rc;
}

CUresult hook_cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                  void *status) {
    CUresult rc =
        REAL(H_cuGetProcAddress_v2, cuGetProcAddress_v2_t)(symbol, pfn, version, flags, status);
    if (rc == CUDA_SUCCESS) redirect(symbol, pfn, version, flags);
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

