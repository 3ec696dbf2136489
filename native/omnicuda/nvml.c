/* NVML's memory queries, answered with the quota's view. */
#include "shim.h"

/* NVML's view under a quota: total = quota, free = quota - used. 0: no quota. */
static int quota_view(unsigned long long *total, unsigned long long *free_bytes,
                      unsigned long long *used) {
    if (!__atomic_load_n(&g_ctl->quota_bytes, __ATOMIC_RELAXED)) return 0;
    size_t f = 0, t = 0;
    report_mem(&f, &t);
    *total = t, *free_bytes = f, *used = t - f;
    return 1;
}

nvmlReturn_t hook_nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    nvmlReturn_t rc = REAL(H_nvmlDeviceGetMemoryInfo, nvmlDeviceGetMemoryInfo_t)(dev, mem);
    if (rc == NVML_SUCCESS) quota_view(&mem->total, &mem->free, &mem->used);
    return rc;
}

nvmlReturn_t hook_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem) {
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
