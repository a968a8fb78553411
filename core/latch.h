/*
 * latch.h — waiting for callbacks that run on another thread.
 *
 * Engine jobs and sync jobs report completion through callbacks on the engine or service thread;
 * a caller that wants to block until they have run (rs_sync_run, tools, tests) counts them with a
 * latch: each callback arrives once, the caller waits until n have. Static initialization with
 * RS_LATCH_INIT, or rs_latch_init / rs_latch_destroy.
 */
#ifndef RS_LATCH_H
#define RS_LATCH_H

#include <pthread.h>

typedef struct rs_latch {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
} rs_latch;

#define RS_LATCH_INIT {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0}

void rs_latch_init(rs_latch *l);
void rs_latch_destroy(rs_latch *l);
void rs_latch_arrive(rs_latch *l);       /* one more arrived; wakes waiters. Thread-safe. */
void rs_latch_wait(rs_latch *l, int n);  /* returns once n have arrived in all. Thread-safe. */

#endif /* RS_LATCH_H */
