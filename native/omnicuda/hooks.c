/*
 * The hook table (filled from hooks.def), the real functions behind the hooks, and the
 * two ways a caller looks a CUDA function up by name: dlsym, and cuGetProcAddress
 * (redirect, called by its hooks in driver.c).
 */
#include "shim.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>

__thread int t_depth;

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
void *lib_symbol(enum lib lib, const char *symbol) {
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

void *real_of(enum hook_id id) {
    void *fn = __atomic_load_n(&g_hooks[id].real, __ATOMIC_ACQUIRE);
    if (fn) return fn;
    fn = lib_symbol(g_hooks[id].lib, g_hooks[id].symbol);
    if (fn) __atomic_store_n(&g_hooks[id].real, fn, __ATOMIC_RELEASE);
    return fn;
}

void *driver(const char *symbol) { return lib_symbol(LIB_DRV, symbol); }

/* cuGetProcAddress: where cudart (and PyTorch, Triton) find driver entry points. */
void redirect(const char *symbol, void **pfn, int version, cuuint64_t flags) {
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

/* Fill the table from hooks.def. Called by the constructor: until then dlsym hands out
 * the real functions (g_hooks[0].symbol is unset). */
void register_hooks(void) {
    if (!real_dlsym) find_real_dlsym();
#define HOOK(name, symbol, proc_name, min_version, lib, fn, ret, params) \
    g_hooks[H_##name] = (struct hook){symbol, proc_name, min_version, lib, (void *)(fn), NULL};
#include "hooks.def"
#undef HOOK
}
