/*
 * Setup: the constructor fills the hook table and maps the control block omnid made
 * ($OMNI_CUDA_CONTROL); a forked child drops the parent's state.
 */
#include "shim.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

struct omni_control g_local = {.magic = OMNI_CTL_MAGIC, .version = OMNI_CTL_VERSION};
struct omni_control *g_ctl = &g_local; /* the shared block, or a private one */

static void after_fork_child(void) {
    /* The child has no swap thread and must not share the parent's accounting. */
    pthread_mutex_init(&g_lock, NULL);
    swap_after_fork();
    pool_after_fork(); /* nor the parent's pool */
    g_local.pool_bytes = g_local.pool_mapped_bytes = 0;
    if (g_ctl != &g_local) {
        g_local.quota_bytes = g_ctl->quota_bytes;
        g_local.mode = g_ctl->mode;
        g_ctl = &g_local;
    }
}

/* Use the control block at `path` if it is one of this version; else stay private. */
static void attach_control(const char *path) {
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct omni_control)) {
        void *p = mmap(NULL, sizeof(struct omni_control), PROT_READ | PROT_WRITE, MAP_SHARED,
                       fd, 0);
        struct omni_control *ctl = p;
        if (p != MAP_FAILED && ctl->magic == OMNI_CTL_MAGIC && ctl->version == OMNI_CTL_VERSION) {
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

__attribute__((constructor)) static void omnicuda_init(void) {
    register_hooks();
    const char *path = getenv("OMNI_CUDA_CONTROL");
    if (path && *path) attach_control(path);
    pthread_atfork(NULL, NULL, after_fork_child);
}
