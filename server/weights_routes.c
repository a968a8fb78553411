/*
 * weights_routes.c — the weight-update routes: parse, hand to the sync service, answer (see
 * weights_routes.h).
 *
 * Lifetime. A request in the service is `held` (http_internal.h): if its client goes away
 * meanwhile, MHD's completion notice leaves it alone, and the job's on_done frees it. Otherwise
 * on_done marks it done and resumes it, whoever suspended it last (rs_http_claim_resume_locked),
 * so a resume is never lost or doubled. on_done runs on the service thread, or on the thread that
 * stops the service for jobs still queued; either way it only takes h->mu and calls MHD's resume.
 */
#include "weights_routes.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../protocol/weights.h"
#include "http_internal.h"

struct rs_weights_call {
    rs_http_req *r;                     /* the request that owns this call */
    rs_sync_job job;                    /* its parsed body and, once done, its result */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static rs_sync *g_sync;                 /* under g_mu; NULL before attach and after detach */

void rs_weights_routes_attach(rs_sync *s) {
    pthread_mutex_lock(&g_mu);
    g_sync = s;
    pthread_mutex_unlock(&g_mu);
}

void rs_weights_routes_detach(void) {
    pthread_mutex_lock(&g_mu);
    g_sync = NULL;
    pthread_mutex_unlock(&g_mu);
}

bool rs_weights_routes_stats(rs_sync_stats *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&g_mu);
    bool ok = g_sync != NULL;
    if (ok) rs_sync_get_stats(g_sync, out);
    pthread_mutex_unlock(&g_mu);
    return ok;
}

typedef struct rs_weights_call weights_call;

void rs_weights_routes_cleanup(rs_http_req *r) {
    weights_call *c = r->ctx;
    if (!c) return;
    if (c->job.kind == RS_SYNC_SHM) rs_shm_update_req_free(&c->job.req.shm);
    else if (c->job.kind == RS_SYNC_NCCL_UPDATE) rs_nccl_update_req_free(&c->job.req.nccl);
    free(c);
    r->ctx = NULL;
}

static int parse(rs_sync_job *job, const char *body, size_t n, rs_error *err) {
    switch (job->kind) {
    case RS_SYNC_SHM: return rs_weights_parse_shm(body, n, &job->req.shm, err);
    case RS_SYNC_DISK: return rs_weights_parse_disk(body, n, &job->req.disk, err);
    case RS_SYNC_VERSION: return rs_weights_parse_version(body, n, &job->req.version, err);
    case RS_SYNC_NCCL_INIT: return rs_weights_parse_nccl_group(body, n, &job->req.group, err);
    case RS_SYNC_NCCL_UPDATE: return rs_weights_parse_nccl_update(body, n, &job->req.nccl, err);
    case RS_SYNC_NCCL_DESTROY: return rs_weights_parse_nccl_destroy(body, n, &job->req.destroy, err);
    }
    return rs_error_set(err, RS_EINTERNAL, NULL, "unknown weight route");
}

/* Service thread (or the stopping thread): the job is done. */
static void on_done(rs_sync_job *job, void *user) {
    (void)job;
    struct rs_weights_call *c = user;
    rs_http_req *r = c->r;
    rs_http *h = r->h;
    rs_http_lock(h);
    r->done = true;
    r->held = false;
    bool wake = rs_http_claim_resume_locked(r);
    bool free_now = !r->in_mhd;
    rs_http_unlock(h);
    if (free_now) rs_http_req_free(r); /* the client left: nobody to answer */
    else if (wake) MHD_resume_connection(r->conn); /* suspended, so still alive */
}

enum MHD_Result rs_weights_routes_handle(rs_http_req *r) {
    rs_http *h = r->h;
    rs_error err = {0};
    if (!rs_http_engine(h, false, &err)) return rs_http_send_error(r, &err);
    struct rs_weights_call *c = rs_xcalloc(1, sizeof *c);
    c->r = r;
    c->job.kind = (rs_sync_kind)r->def->arg;
    if (parse(&c->job, r->body ? r->body : "", r->n, &err) != RS_OK) {
        free(c); /* a failed parse owns nothing */
        return rs_http_send_error(r, &err);
    }
    c->job.on_done = on_done;
    c->job.user = c;
    r->ctx = c;
    r->phase = RS_PHASE_WAITING;
    rs_http_lock(h);
    r->held = true; /* before the submit: on_done may run at once */
    rs_http_unlock(h);
    pthread_mutex_lock(&g_mu);
    int rc = g_sync ? rs_sync_submit(g_sync, &c->job, &err)
                    : rs_error_set(&err, RS_EBUSY, NULL, "weight updates are not available (starting or shutting down)");
    pthread_mutex_unlock(&g_mu);
    if (rc != RS_OK) { /* never queued: answer here */
        rs_http_lock(h);
        r->held = false;
        rs_http_unlock(h);
        r->phase = RS_PHASE_BODY;
        return rs_http_send_error(r, &err);
    }
    rs_http_suspend(r); /* the job may already be done: then this goes straight on */
    return MHD_YES;
}

enum MHD_Result rs_weights_routes_answer(rs_http_req *r) {
    const rs_sync_job *job = &((weights_call *)r->ctx)->job;
    if (job->rc != RS_OK) return rs_http_send_error(r, &job->err);
    const rs_sync_result *res = &job->res;
    RS_INFO("http | weights | 200 | %s | %.3f s", res->message, res->seconds);
    size_t len = 0;
    char *body = rs_weights_response(res->message, res->weight_version, res->bytes, res->seconds, res->committed,
                                     res->txn_id, &len);
    return rs_http_send(r, 200, body, len, "application/json");
}
