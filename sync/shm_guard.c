/*
 * shm_guard.c — the SIGBUS handler and the registry of guarded mappings (see shm_guard.h).
 *
 * The registry is a fixed array of slots made of lock-free atomics, because the handler reads it
 * and a handler may take no lock: it can interrupt the very thread that holds one. A slot is
 * claimed with a CAS on `used`; `size` is stored before `base` is published (release), and the
 * handler loads `base` (acquire) before `size`, so it never pairs a new base with a stale size.
 * `base` 0 means "no mapping"; it is cleared first on removal.
 *
 * The handler is installed once (pthread_once) by the first rs_shm_guard_add, after any sanitizer
 * runtime has installed its own (those do it before main), and remembers the handler it replaced
 * so that a SIGBUS it does not own is handled exactly as it would have been without the guard.
 */
#include "shm_guard.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../core/rs.h"

/* The handler may only touch lock-free atomics (C11 7.14.1.1; a lock-based atomic could deadlock
 * against the thread it interrupted). uintptr_t and size_t are unsigned long on the LP64 targets
 * rolloutd builds for. */
_Static_assert(ATOMIC_LONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2 && ATOMIC_BOOL_LOCK_FREE == 2,
               "the SIGBUS guard needs lock-free atomics");
_Static_assert(sizeof(uintptr_t) == sizeof(long) && sizeof(size_t) == sizeof(long),
               "the SIGBUS guard assumes an LP64 target");

typedef struct guard_slot {
    atomic_int used;                    /* claimed by an owner (0/1) */
    _Atomic uintptr_t base;             /* start of the mapping; 0 = none */
    _Atomic size_t size;                /* bytes mapped (the mapping covers whole pages past it) */
    atomic_bool truncated;              /* a fault past the segment's end was served zeros */
} guard_slot;

static guard_slot slots[RS_SHM_GUARD_SLOTS];
static pthread_once_t install_once = PTHREAD_ONCE_INIT;
static struct sigaction prev_action;    /* what SIGBUS did before the guard; read-only once installed */
static uintptr_t page_size;             /* cached: sysconf is not async-signal-safe */

/* A SIGBUS the guard does not own: do what the previous disposition would have done. */
static void chain(int sig, siginfo_t *si, void *uctx) {
    const bool dfl_or_ign = prev_action.sa_handler == SIG_DFL || prev_action.sa_handler == SIG_IGN;
    if (!dfl_or_ign && (prev_action.sa_flags & SA_SIGINFO)) {
        prev_action.sa_sigaction(sig, si, uctx);
        return;
    }
    if (!dfl_or_ign) {
        prev_action.sa_handler(sig);
        return;
    }
    if (prev_action.sa_handler == SIG_IGN && si->si_code <= 0) return; /* sent by a process: ignorable */
    /* The default action (a hardware fault cannot be ignored either): restore it and re-raise.
     * SIGBUS is blocked while this handler runs, so the raised one is delivered as the handler
     * returns, with the faulting thread's registers intact for the core dump. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, NULL);
    raise(SIGBUS);
}

static void on_sigbus(int sig, siginfo_t *si, void *uctx) {
    const int saved_errno = errno;
    /* BUS_ADRERR is the kernel's code for an access past the end of a mapped file; kill -BUS and
     * alignment faults carry other codes and are never ours. */
    if (si->si_code == BUS_ADRERR) {
        const uintptr_t addr = (uintptr_t)si->si_addr;
        for (int i = 0; i < RS_SHM_GUARD_SLOTS; i++) {
            guard_slot *g = &slots[i];
            const uintptr_t base = atomic_load_explicit(&g->base, memory_order_acquire);
            const size_t size = atomic_load_explicit(&g->size, memory_order_relaxed);
            if (!base || addr < base || addr - base >= size) continue;
            /* The segment shrank under the mapping. Anonymous zero pages from the faulting page to
             * the mapping's end make the restarted load (and any later one there) read zeros; the
             * owner sees `truncated` and drops what it read. mmap is not on POSIX's list of
             * async-signal-safe functions, but on Linux it is a plain system call with no user-space
             * lock (glibc's wrapper, and ASan's interceptor, keep no state a handler could find
             * half-updated), so it is safe here in practice. Pages below the faulting one keep
             * their data; one of them past the new end faults on its own and lands here again. */
            const uintptr_t from = addr & ~(page_size - 1);
            const uintptr_t end = base + ((size + page_size - 1) & ~(page_size - 1));
            void *p = mmap((void *)from, end - from, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) break; /* cannot repair it: fatal, like any other SIGBUS */
            atomic_store_explicit(&g->truncated, true, memory_order_release);
            errno = saved_errno;
            return;
        }
    }
    chain(sig, si, uctx);
    errno = saved_errno;
}

static void install(void) {
    page_size = (uintptr_t)sysconf(_SC_PAGESIZE);
    RS_ASSERT(page_size > 0 && (page_size & (page_size - 1)) == 0);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    /* SA_ONSTACK: use a thread's alternate stack where it has one (sanitizers set them up), so a
     * fault near the end of a worker's stack can still be handled. Every signal is blocked while
     * the handler runs so that no other handler observes a half-replaced mapping. */
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigfillset(&sa.sa_mask);
    RS_ASSERT(sigaction(SIGBUS, &sa, &prev_action) == 0);
}

int rs_shm_guard_add(const void *base, size_t size) {
    RS_ASSERT(base && size > 0);
    pthread_once(&install_once, install);
    for (int i = 0; i < RS_SHM_GUARD_SLOTS; i++) {
        guard_slot *g = &slots[i];
        int expect = 0;
        if (!atomic_compare_exchange_strong(&g->used, &expect, 1)) continue;
        atomic_store_explicit(&g->truncated, false, memory_order_relaxed);
        atomic_store_explicit(&g->size, size, memory_order_relaxed);
        atomic_store_explicit(&g->base, (uintptr_t)base, memory_order_release);
        return i;
    }
    return RS_EBUSY;
}

bool rs_shm_guard_truncated(int slot) {
    RS_ASSERT(slot >= 0 && slot < RS_SHM_GUARD_SLOTS);
    /* the handler ran on whichever thread faulted; acquire pairs with its release store (the
     * pool's own join already orders the workers' reads before this call) */
    return atomic_load_explicit(&slots[slot].truncated, memory_order_acquire);
}

void rs_shm_guard_remove(int slot) {
    if (slot < 0) return;
    RS_ASSERT(slot < RS_SHM_GUARD_SLOTS);
    guard_slot *g = &slots[slot];
    RS_ASSERT(atomic_load(&g->used));
    atomic_store_explicit(&g->base, 0, memory_order_release);
    atomic_store_explicit(&g->size, 0, memory_order_relaxed);
    atomic_store_explicit(&g->truncated, false, memory_order_relaxed);
    atomic_store_explicit(&g->used, 0, memory_order_release);
}
