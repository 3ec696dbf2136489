/*
 * Exercises libomnicuda under LD_PRELOAD; linked against (fake) libcudart, so
 * its cudaMalloc calls take the ordinary PLT route. Prints key=value lines.
 *
 *   probe boundary Q   allocations around a quota of Q bytes
 *   probe threads      8 threads of mixed allocations and frees
 *   probe routes N     N bytes through dlsym(cudart), dlsym(libcuda) and
 *                      cuGetProcAddress; memory info through each
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cudaMalloc(void **p, size_t s);
int cudaFree(void *p);
int cudaMemGetInfo(size_t *f, size_t *t);

static void boundary(size_t quota) {
    void *a = NULL, *b = NULL, *c = NULL;
    printf("exact=%d\n", cudaMalloc(&a, quota));        /* fits exactly */
    printf("one_more=%d\n", cudaMalloc(&b, 1));         /* 1 byte past */
    cudaFree(a);
    printf("over=%d\n", cudaMalloc(&a, quota + 1));     /* never fits */
    printf("most=%d\n", cudaMalloc(&a, quota - 1));
    printf("last_byte=%d\n", cudaMalloc(&b, 1));
    printf("past=%d\n", cudaMalloc(&c, 1));
    size_t f = 0, t = 0;
    cudaMemGetInfo(&f, &t);
    printf("free=%zu\ntotal=%zu\n", f, t);
    cudaFree(a);
    cudaFree(b);
    cudaMemGetInfo(&f, &t);
    printf("free_after=%zu\n", f);
}

#define THREADS 8
#define OPS 20000
static uint64_t g_outstanding[THREADS];

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned seed = 1234u + (unsigned)id;
    void *held[64] = {0};
    size_t sizes[64] = {0};
    for (int i = 0; i < OPS; i++) {
        int k = rand_r(&seed) % 64;
        if (held[k]) {
            cudaFree(held[k]);
            g_outstanding[id] -= sizes[k];
            held[k] = NULL;
        } else {
            sizes[k] = 1 + (size_t)(rand_r(&seed) % 100000);
            if (cudaMalloc(&held[k], sizes[k]) == 0) g_outstanding[id] += sizes[k];
            else held[k] = NULL;
        }
    }
    return NULL;
}

static void threads(void) {
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
    for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    uint64_t expected = 0;
    for (int i = 0; i < THREADS; i++) expected += g_outstanding[i];
    size_t f = 0, total = 0;
    cudaMemGetInfo(&f, &total);
    printf("expected=%llu\nreported=%llu\n", (unsigned long long)expected,
           (unsigned long long)(total - f));
}

typedef int (*malloc_t)(void **, size_t);
typedef int (*info_t)(size_t *, size_t *);
typedef int (*dalloc_t)(unsigned long long *, size_t);
typedef int (*gpa_t)(const char *, void **, int, unsigned long long, void *);

static void routes(size_t n) {
    void *rt = dlopen("libcudart.so.13", RTLD_NOW | RTLD_LOCAL); /* as PyTorch does */
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    malloc_t rt_malloc = (malloc_t)dlsym(rt, "cudaMalloc");
    dalloc_t drv_alloc = (dalloc_t)dlsym(drv, "cuMemAlloc_v2");
    info_t drv_info = (info_t)dlsym(drv, "cuMemGetInfo_v2");
    gpa_t gpa = (gpa_t)dlsym(drv, "cuGetProcAddress_v2");
    void *p = NULL;
    unsigned long long d = 0;
    dalloc_t proc_alloc = NULL;
    gpa("cuMemAlloc", (void **)&proc_alloc, 13000, 0, NULL);
    printf("dlsym_runtime=%d\n", rt_malloc(&p, n));
    printf("dlsym_driver=%d\n", drv_alloc(&d, n));
    printf("proc_address=%d\n", proc_alloc(&d, n));
    size_t f = 0, t = 0;
    drv_info(&f, &t);
    printf("driver_used=%zu\ndriver_total=%zu\n", t - f, t);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    if (strcmp(argv[1], "boundary") == 0) boundary(strtoull(argv[2], NULL, 10));
    else if (strcmp(argv[1], "threads") == 0) threads();
    else if (strcmp(argv[1], "routes") == 0) routes(strtoull(argv[2], NULL, 10));
    else return 2;
    return 0;
}
