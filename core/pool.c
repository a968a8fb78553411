/*
 * pool.c — worker threads that spin briefly, then sleep, between jobs (see pool.h).
 *
 * A job is published by storing its fields and then bumping the atomic `generation` (release);
 * a worker that sees the new generation (acquire) sees the fields. Each worker runs its own range
 * and decrements the atomic `pending`; the caller runs range 0 and waits for pending == 0.
 *
 * Why spin. A decode step of a 0.6B model at batch 1 is ~300 pool jobs of ~100 us each. With
 * workers asleep on a condition variable every job costs a futex wake-up (an inter-processor
 * interrupt, a VM exit on a virtual machine) and a sleep: perf put ~13% of batch-1 decode in the
 * kernel's scheduler. So a worker that finishes a job polls `generation` for up to SPIN_ROUNDS
 * pause instructions (~100-200 us) before it sleeps, and the caller polls `pending` the same way:
 * back-to-back jobs then hand off through one cache line. `pause` keeps a spinning hyperthread
 * from starving its sibling of execution resources. Idle workers still end up asleep.
 *
 * Sleeping without lost wake-ups: a worker gives up spinning by taking the mutex, counting itself
 * in `sleepers` and re-checking `generation` under the mutex before pthread_cond_wait; the caller
 * bumps `generation` first and then, under the mutex, broadcasts if anyone sleeps. Either the
 * worker's re-check sees the new generation, or it is already waiting when the broadcast comes.
 * The same pattern covers the caller sleeping on `done`: the worker that brings pending to 0
 * signals under the mutex, and the caller re-checks pending under it. Workers never allocate.
 */
#define _POSIX_C_SOURCE 200809L
#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#include "rs.h"

#define SPIN_ROUNDS 4096 /* pause instructions before sleeping (~35-140 cycles each) */

struct rs_pool {
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_cond_t done;
    _Atomic uint64_t generation;
    atomic_int pending;
    atomic_int stop;
    int sleepers;      /* workers in pthread_cond_wait(wake); under mu */
    int caller_asleep; /* the caller is in pthread_cond_wait(done); under mu */
    /* the current job: written by the caller before generation is bumped */
    rs_pool_fn fn;
    void *ctx;
    int64_t n, grain;
    bool dynamic;            /* rs_pool_run_dynamic: grains are taken from `next` */
    _Atomic int64_t next;    /* the next grain to take */
};

typedef struct worker_arg {
    rs_pool *p;
    int tid;
} worker_arg;

static void run_range(rs_pool *p, int tid) {
    int64_t chunks = (p->n + p->grain - 1) / p->grain;
    if (p->dynamic) {
        for (int64_t c; (c = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed)) < chunks;)
            p->fn(p->ctx, c * p->grain, c + 1 < chunks ? (c + 1) * p->grain : p->n, tid);
        return;
    }
    int64_t per = chunks / p->n_threads, extra = chunks % p->n_threads;
    int64_t c0 = tid * per + (tid < extra ? tid : extra);
    int64_t c1 = c0 + per + (tid < extra ? 1 : 0);
    int64_t begin = c0 * p->grain, end = c1 * p->grain;
    if (end > p->n) end = p->n;
    if (begin < end) p->fn(p->ctx, begin, end, tid);
}

/* Waits until generation != seen or stop; returns the generation seen (acquire). */
static uint64_t wait_for_job(rs_pool *p, uint64_t seen) {
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        uint64_t g = atomic_load_explicit(&p->generation, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&p->stop, memory_order_relaxed)) return g;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    p->sleepers++;
    uint64_t g;
    while ((g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen &&
           !atomic_load_explicit(&p->stop, memory_order_relaxed))
        pthread_cond_wait(&p->wake, &p->mu);
    p->sleepers--;
    pthread_mutex_unlock(&p->mu);
    return g;
}

static void *worker_main(void *argp) {
    worker_arg *arg = argp;
    rs_pool *p = arg->p;
    int tid = arg->tid;
    free(arg);
    uint64_t seen = 0;
    for (;;) {
        seen = wait_for_job(p, seen);
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) return NULL;
        run_range(p, tid);
        if (atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->mu);
            if (p->caller_asleep) pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

rs_pool *rs_pool_init(int n_threads) {
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    rs_pool *p = rs_xcalloc(1, sizeof *p);
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->generation, 0);
    atomic_init(&p->pending, 0);
    atomic_init(&p->stop, 0);
    p->threads = rs_xcalloc((size_t)n_threads, sizeof(pthread_t));
    for (int t = 1; t < n_threads; t++) {
        worker_arg *arg = rs_xmalloc(sizeof *arg);
        arg->p = p;
        arg->tid = t;
        int rc = pthread_create(&p->threads[t], NULL, worker_main, arg);
        if (rc != 0) { /* start-up failure, not a bug: say why and exit */
            RS_ERROR("cannot start worker thread %d of %d: %s", t, n_threads, strerror(rc));
            exit(1);
        }
    }
    return p;
}

void rs_pool_free(rs_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store_explicit(&p->stop, 1, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int t = 1; t < p->n_threads; t++) pthread_join(p->threads[t], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p->threads);
    free(p);
}

int rs_pool_threads(const rs_pool *p) { return p->n_threads; }

static void run(rs_pool *p, int64_t n, int64_t grain, rs_pool_fn fn, void *ctx, bool dynamic) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (p->n_threads == 1 || n <= grain) {
        fn(ctx, 0, n, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->grain = grain;
    p->dynamic = dynamic;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->pending, p->n_threads - 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release); /* publishes the fields above */
    pthread_mutex_lock(&p->mu);
    if (p->sleepers > 0) pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);

    run_range(p, 0);

    for (int i = 0; i < SPIN_ROUNDS; i++) {
        if (atomic_load_explicit(&p->pending, memory_order_acquire) == 0) return;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    p->caller_asleep = 1;
    while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) pthread_cond_wait(&p->done, &p->mu);
    p->caller_asleep = 0;
    pthread_mutex_unlock(&p->mu);
}

void rs_pool_run(rs_pool *p, int64_t n, int64_t grain, rs_pool_fn fn, void *ctx) { run(p, n, grain, fn, ctx, false); }

void rs_pool_run_dynamic(rs_pool *p, int64_t n, int64_t grain, rs_pool_fn fn, void *ctx) {
    run(p, n, grain, fn, ctx, true);
}
