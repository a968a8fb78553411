/*
 * latch.c — see latch.h.
 */
#include "latch.h"

void rs_latch_init(rs_latch *l) {
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    l->arrived = 0;
}

void rs_latch_destroy(rs_latch *l) {
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
}

void rs_latch_arrive(rs_latch *l) {
    pthread_mutex_lock(&l->mu);
    l->arrived++;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

void rs_latch_wait(rs_latch *l, int n) {
    pthread_mutex_lock(&l->mu);
    while (l->arrived < n) pthread_cond_wait(&l->cv, &l->mu);
    pthread_mutex_unlock(&l->mu);
}
