/*
 * The runtime's (cuda*) hooks: the exported functions themselves. Each calls into
 * cudart under the depth guard, so the driver hook below does not count it again.
 */
#include "shim.h"

#define RT_CALL(expr)  \
    ({                 \
        t_depth++;     \
        __auto_type r_ = (expr); \
        t_depth--;     \
        r_;            \
    })

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

EXPORT cudaError_t cudaFree(void *ptr) {
    if (!t_depth) untrack((uint64_t)ptr);
    return RT_CALL(REAL(H_cudaFree, cudaFree_t)(ptr));
}

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

EXPORT cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    cudaError_t rc = RT_CALL(REAL(H_cudaMemGetInfo, cudaMemGetInfo_t)(free_bytes, total_bytes));
    if (rc == cudaSuccess) report_mem(free_bytes, total_bytes);
    return rc;
}
