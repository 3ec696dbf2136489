/*
 * libomnicuda: the control block shared between an instance's shim and omnid.
 *
 * One file per instance (path in $OMNI_CUDA_CONTROL), mapped by both sides.
 * omnid creates it and writes the "omnid" fields; the shim writes the rest.
 * omni/cudashim/control.py mirrors this layout with ctypes: change both, and
 * bump OMNI_CTL_VERSION.
 */
#ifndef OMNICUDA_H
#define OMNICUDA_H

#include <stdint.h>

#define OMNI_CTL_MAGIC 0x494e4d4fu /* "OMNI" */
#define OMNI_CTL_VERSION 2u

enum omni_mode { OMNI_MODE_PASSTHROUGH = 0, OMNI_MODE_MANAGED = 1 };
enum omni_residency { OMNI_RES_GPU = 0, OMNI_RES_HOST = 1, OMNI_RES_MOVING = 2 };

struct omni_control {
    uint32_t magic;
    uint32_t version;
    /* written by omnid */
    uint64_t quota_bytes;       /* 0: no quota */
    uint32_t mode;              /* enum omni_mode */
    uint32_t desired_residency; /* enum omni_residency: GPU or HOST */
    uint64_t request_seq;       /* bumped by omnid after setting desired_residency */
    /* written by the shim */
    uint64_t used_bytes;
    uint64_t peak_bytes;
    uint64_t live_allocs;
    uint64_t last_activity_ns; /* CLOCK_REALTIME of the last allocation, free or launch */
    uint32_t residency;        /* enum omni_residency */
    uint32_t pid;
    uint64_t ack_seq;       /* request_seq of the last swap carried out */
    uint64_t last_swap_ns;  /* how long it took */
    uint64_t swapped_bytes; /* bytes it moved */
    int32_t last_swap_error; /* CUresult of the swap, 0 on success */
    uint32_t reserved0;
    uint64_t alloc_failures; /* allocations refused by the quota */
    uint64_t window_peak_bytes; /* the most held at once since the last swap-in (or start) */
    uint64_t pool_bytes;        /* the KV pool's size, all of it committed against the quota */
    uint64_t pool_mapped_bytes; /* the part of it backed by memory now (in used_bytes) */
};

#endif
