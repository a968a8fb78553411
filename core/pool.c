/*
 * pool.c — worker threads that sleep on a condition variable between jobs (see pool.h).
 *
 * A job is published by bumping `generation` under the mutex; each worker runs its own range and
 * decrements `pending`; the last one to finish signals the caller. Workers never allocate.
 */
#define _POSIX_C_SOURCE 200809L
#include "pool.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rs.h"

struct rs_pool {
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_cond_t done;
    uint64_t generation;
    int pending;
    int stop;
    /* the current job */
    rs_pool_fn fn;
    void *ctx;
    int64_t n, grain;
};

typedef struct worker_arg {
    rs_pool *p;
    int tid;
} worker_arg;

static void run_range(rs_pool *p, int tid) {
    int64_t chunks = (p->n + p->grain - 1) / p->grain;
    int64_t per = chunks / p->n_threads, extra = chunks % p->n_threads;
    int64_t c0 = tid * per + (tid < extra ? tid : extra);
    int64_t c1 = c0 + per + (tid < extra ? 1 : 0);
    int64_t begin = c0 * p->grain, end = c1 * p->grain;
    if (end > p->n) end = p->n;
    if (begin < end) p->fn(p->ctx, begin, end, tid);
}

static void *worker_main(void *argp) {
    worker_arg *arg = argp;
    rs_pool *p = arg->p;
    int tid = arg->tid;
    free(arg);
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->stop && p->generation == seen) pthread_cond_wait(&p->wake, &p->mu);
        if (p->stop) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);

        run_range(p, tid);

        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0) pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
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
    p->stop = 1;
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

void rs_pool_run(rs_pool *p, int64_t n, int64_t grain, rs_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (p->n_threads == 1 || n <= grain) {
        fn(ctx, 0, n, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->grain = grain;
    p->pending = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);

    run_range(p, 0);

    pthread_mutex_lock(&p->mu);
    while (p->pending > 0) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
