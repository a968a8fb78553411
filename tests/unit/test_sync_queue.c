/*
 * test_sync_queue.c — the weight-sync service's queue is bounded: while one job runs, at most
 * RS_SYNC_MAX_QUEUED more wait, and one beyond that is refused at once (RS_EBUSY, a 503) rather
 * than held in memory; every queued job is still answered exactly once.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "test.h"
#include "test_util.h"

typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool entered, open;
    int answered;
} gate;

/* The first job's answer holds the service thread until the test opens the gate. */
static void on_done_gated(rs_sync_job *job, void *user) {
    gate *g = user;
    pthread_mutex_lock(&g->mu);
    if (!strcmp(job->req.version.new_version, "first")) {
        g->entered = true;
        pthread_cond_broadcast(&g->cv);
        while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
    }
    g->answered++;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void version_job(rs_sync_job *j, const char *v, gate *g) {
    memset(j, 0, sizeof *j);
    j->kind = RS_SYNC_VERSION;
    snprintf(j->req.version.new_version, sizeof j->req.version.new_version, "%s", v);
    j->on_done = on_done_gated;
    j->user = g;
}

RS_TEST(sync_queue_is_bounded) {
    rs_test_sync_env v = rs_test_sync_open("bf16", NULL);
    gate g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false, 0};
    rs_sync_job first, queued[RS_SYNC_MAX_QUEUED], extra;
    rs_error err = {0};
    version_job(&first, "first", &g);
    ASSERT_EQ(rs_sync_submit(v.s, &first, &err), RS_OK);
    pthread_mutex_lock(&g.mu);
    while (!g.entered) pthread_cond_wait(&g.cv, &g.mu); /* running, out of the queue */
    pthread_mutex_unlock(&g.mu);
    for (int i = 0; i < RS_SYNC_MAX_QUEUED; i++) {
        char name[16];
        snprintf(name, sizeof name, "q%d", i);
        version_job(&queued[i], name, &g);
        ASSERT_EQ(rs_sync_submit(v.s, &queued[i], &err), RS_OK);
    }
    version_job(&extra, "extra", &g);
    ASSERT_EQ(rs_sync_submit(v.s, &extra, &err), RS_EBUSY);
    ASSERT_TRUE(strstr(err.message, "already waiting") != NULL);
    pthread_mutex_lock(&g.mu);
    g.open = true;
    pthread_cond_broadcast(&g.cv);
    while (g.answered < 1 + RS_SYNC_MAX_QUEUED) pthread_cond_wait(&g.cv, &g.mu);
    pthread_mutex_unlock(&g.mu);
    for (int i = 0; i < RS_SYNC_MAX_QUEUED; i++) ASSERT_EQ(queued[i].rc, RS_OK);
    /* the queue drained: a new job is taken again */
    version_job(&extra, "again", &g);
    ASSERT_EQ(rs_sync_submit(v.s, &extra, &err), RS_OK);
    pthread_mutex_lock(&g.mu);
    while (g.answered < 2 + RS_SYNC_MAX_QUEUED) pthread_cond_wait(&g.cv, &g.mu);
    pthread_mutex_unlock(&g.mu);
    ASSERT_EQ(extra.rc, RS_OK);
    rs_test_sync_close(&v);
}
