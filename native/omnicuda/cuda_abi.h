/*
 * The few CUDA driver/runtime and NVML types and constants the shim uses,
 * declared here so it builds with a plain C compiler and no CUDA toolkit.
 * Values are those of the public CUDA 12/13 and NVML headers.
 */
#ifndef OMNICUDA_CUDA_ABI_H
#define OMNICUDA_CUDA_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int cudaError_t;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef uint64_t cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUstream_st *cudaStream_t;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef int nvmlReturn_t;

typedef struct {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;

typedef struct { /* CUmemAllocationProp: what cuMemCreate makes */
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType, gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_NOT_SUPPORTED 801
#define cudaSuccess 0
#define cudaErrorMemoryAllocation 2
#define NVML_SUCCESS 0

#define CU_MEM_ATTACH_GLOBAL 0x1
#define cudaMemAttachGlobal 0x1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_LOCATION_TYPE_HOST 2
#define CU_MEM_ADVISE_SET_READ_MOSTLY 1
#define CU_MEM_ADVISE_UNSET_READ_MOSTLY 2
#define CU_MEM_ADVISE_SET_PREFERRED_LOCATION 3
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_HANDLE_TYPE_NONE 0
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 0x2
#define PITCH_ALIGN 512 /* what the allocator rounds a managed pitch row to */

#endif
