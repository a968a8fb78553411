/*
 * http_ops.c — the operations routes: /health, /get_model_info, /get_server_info, /server_info,
 * /model_info, /get_load, /v1/loads, /get_weight_version, /v1/models, /metrics, /abort_request, /tokenize and
 * /detokenize answer at once on the MHD thread;
 * /pause_generation, /continue_generation and /flush_cache wait for an engine step boundary, so
 * they run on this module's control thread while their connection is suspended.
 *
 * Operations keep working while the server drains (SIGTERM): a trainer may still abort or read
 * metrics. Only /health (and new generation) answer 503 then.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../model/model.h"
#include "../model/weight_store.h"
#include "../protocol/errors.h"
#include "../protocol/json_util.h"
#include "../protocol/metrics.h"
#include "../protocol/ops.h"
#include "../protocol/tokenize.h"
#include "http_internal.h"
#include "weights_routes.h"

/* `len` is read after `body` was made: call as send_json(r, make_body(&len), &len). */
static enum MHD_Result send_json(rs_http_req *r, char *body, const size_t *len) {
    return rs_http_send(r, 200, body, *len, "application/json");
}

/* The names of the enum settings rs_model_info quotes, kept with it. */
typedef struct setting_names {
    char quantization[16], kv_cache_dtype[16];
} setting_names;

static void model_info(rs_http *h, rs_engine *e, rs_model_info *mi, setting_names *sn) {
    const rs_model_config *mc = rs_engine_model_config(e);
    rs_config_get(h->info.cfg, "quantization", sn->quantization, sizeof sn->quantization);
    rs_config_get(h->info.cfg, "kv-cache-dtype", sn->kv_cache_dtype, sizeof sn->kv_cache_dtype);
    *mi = (rs_model_info){
        .model_path = h->info.model_path,
        .served_model_name = h->info.served_model_name,
        .architecture = rs_arch_name(mc->arch),
        .weight_version = rs_engine_weight_version(e),
        .quantization = sn->quantization,
        .kv_cache_dtype = sn->kv_cache_dtype,
        .fp8_checkpoint = mc->fp8_checkpoint,
        .vocab_size = mc->vocab_size,
        .max_context_len = rs_engine_get_limits(e)->max_context,
        .tokenizer_path = h->info.tok ? rs_tok_path(h->info.tok) : NULL,
        .bos_token_id = mc->bos_token_id,
        .eos_token_ids = mc->eos_token_ids,
        .n_eos = mc->n_eos,
    };
}

/* Resident set size from /proc/self/statm (the server's own file, not a request's); -1 if unknown. */
static double rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return -1;
    unsigned long long size = 0, resident = 0;
    int n = fscanf(f, "%llu %llu", &size, &resident);
    fclose(f);
    return n == 2 ? (double)resident * (double)sysconf(_SC_PAGESIZE) : -1;
}

static enum MHD_Result metrics(rs_http_req *r, rs_engine *e) {
    rs_http *h = r->h;
    rs_engine_stats st;
    rs_engine_get_stats(e, &st);
    rs_metrics_http counts[RS_ROUTE_COUNT * RS_HTTP_CODE_COUNT];
    static const int codes[] = {
#define RS_HTTP_CODE_VALUE(c) c,
        RS_HTTP_CODES(RS_HTTP_CODE_VALUE)
#undef RS_HTTP_CODE_VALUE
    };
    size_t n = 0;
    for (int ro = 0; ro < RS_ROUTE_COUNT; ro++) {
        for (int c = 0; c < RS_HTTP_CODE_COUNT; c++) {
            uint64_t v = atomic_load_explicit(&h->responses[ro][c], memory_order_relaxed);
            if (v) counts[n++] = (rs_metrics_http){rs_route_name((rs_route)ro), codes[c], v};
        }
    }
    rs_sync_stats sy;
    const bool have_sync = rs_weights_routes_stats(&sy);
    rs_metrics_input in = {.stats = &st, .http_in_flight = rs_http_in_flight(h), .http = counts, .n_http = n,
                           .rss_bytes = rss_bytes(), .start_time_s = h->start_time_unix, .version = RS_VERSION,
                           .sync = have_sync ? &sy : NULL,
                           .weight_bytes = (double)__atomic_load_n(&h->info.model->weight_bytes, __ATOMIC_RELAXED),
                           .weight_spare_bytes = (double)rs_weight_store_spare_bytes(h->info.model->store)};
    size_t len = 0;
    char *body = rs_metrics_text(&in, &len);
    return rs_http_send(r, 200, body, len, "text/plain; version=0.0.4; charset=utf-8");
}

static enum MHD_Result server_info(rs_http_req *r, rs_engine *e) {
    rs_http *h = r->h;
    rs_engine_stats st;
    rs_engine_get_stats(e, &st);
    rs_server_info si = {
        .cfg = h->info.cfg,
        .backend = h->info.backend,
        .limits = rs_engine_get_limits(e),
        .stats = &st,
        .weight_bytes = __atomic_load_n(&h->info.model->weight_bytes, __ATOMIC_RELAXED),
        .kv_cache_bytes = (size_t)h->info.cfg->kv_cache_mb << 20,
        .http_in_flight = rs_http_in_flight(h),
        .uptime_s = 0,
    };
    setting_names sn;
    model_info(h, e, &si.model, &sn);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    si.uptime_s = (double)ts.tv_sec + ts.tv_nsec * 1e-9 - h->start_time_unix;
    size_t len = 0;
    return send_json(r, rs_server_info_body(&si, &len), &len);
}


/* ---------------------------------------------------------------- the control thread */

/* A control route's context: what it asked for and how it went. */
typedef struct ctl_call {
    rs_pause_mode pause_mode;
    int rc;
    rs_error err;
} ctl_call;

void rs_http_control_cleanup(rs_http_req *r) {
    free(r->ctx);
    r->ctx = NULL;
}

/* Queues r for the control thread; false (nothing queued) once that thread is stopping: a request
 * queued after it has drained and exited would stay suspended, and libmicrohttpd aborts the
 * process when it is stopped with a suspended connection. */
static bool ctl_push(rs_http *h, rs_http_req *r) {
    pthread_mutex_lock(&h->mu);
    if (h->ctl_stop) {
        pthread_mutex_unlock(&h->mu);
        return false;
    }
    r->held = true;
    r->ctl_next = NULL;
    if (h->ctl_tail) h->ctl_tail->ctl_next = r;
    else h->ctl_head = r;
    h->ctl_tail = r;
    pthread_cond_signal(&h->ctl_cv);
    pthread_mutex_unlock(&h->mu);
    return true;
}

/* Runs one control operation on the engine (blocks until a step boundary). */
static void ctl_run(rs_http_req *r, rs_engine *e) {
    ctl_call *c = r->ctx;
    c->rc = RS_OK;
    switch (r->route) {
    case RS_ROUTE_PAUSE:
        rs_engine_pause(e, c->pause_mode);
        RS_INFO("http | /pause_generation | mode %s", rs_pause_mode_name(c->pause_mode));
        break;
    case RS_ROUTE_CONTINUE:
        rs_engine_continue(e);
        RS_INFO("http | /continue_generation");
        break;
    case RS_ROUTE_FLUSH:
        c->rc = rs_engine_flush_cache(e, &c->err);
        if (c->rc == RS_OK) RS_INFO("http | /flush_cache | prefix cache dropped");
        break;
    default:
        RS_ASSERT(!"not a control route");
    }
}

static void *ctl_main(void *arg) {
    rs_http *h = arg;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (!h->ctl_head && !h->ctl_stop) pthread_cond_wait(&h->ctl_cv, &h->mu);
        rs_http_req *r = h->ctl_head;
        if (!r) break; /* stopping, and nothing left */
        h->ctl_head = r->ctl_next;
        if (!h->ctl_head) h->ctl_tail = NULL;
        rs_engine *e = h->engine;
        h->ctl_busy = e != NULL;
        pthread_mutex_unlock(&h->mu);

        ctl_call *c = r->ctx;
        if (e) ctl_run(r, e);
        else c->rc = rs_error_set(&c->err, RS_EBUSY, NULL, "server is shutting down");

        pthread_mutex_lock(&h->mu);
        h->ctl_busy = false;
        pthread_cond_broadcast(&h->ctl_idle_cv);
        r->done = true;
        r->held = false;
        bool wake = rs_http_claim_resume_locked(r);
        bool free_now = !r->in_mhd;
        pthread_mutex_unlock(&h->mu);
        if (free_now) rs_http_req_free(r);
        else if (wake) MHD_resume_connection(r->conn); /* suspended, so still alive */
        pthread_mutex_lock(&h->mu);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

void rs_http_ctl_start(rs_http *h) {
    if (pthread_create(&h->ctl_thread, NULL, ctl_main, h) != 0) {
        RS_ERROR("http: cannot start the control thread");
        RS_ASSERT(!"pthread_create failed");
    }
    h->ctl_started = true;
}

void rs_http_ctl_stop(rs_http *h) {
    if (!h->ctl_started) return;
    pthread_mutex_lock(&h->mu);
    h->ctl_stop = true;
    pthread_cond_broadcast(&h->ctl_cv);
    pthread_mutex_unlock(&h->mu);
    pthread_join(h->ctl_thread, NULL);
    h->ctl_started = false;
}

/* ---------------------------------------------------------------- the routes */

/* The engine for a route that needs one (503 while starting, or once detached). */
#define ENGINE_OR_ANSWER(r, e)                                                                                \
    rs_error err_ = {0};                                                                                      \
    rs_engine *e = rs_http_engine((r)->h, false, &err_);                                                      \
    if (!e) return rs_http_send_error((r), &err_)

enum MHD_Result rs_http_health(rs_http_req *r) {
    rs_error err = {0};
    size_t len = 0;
    if (!rs_http_engine(r->h, true, &err)) return rs_http_send_error(r, &err);
    return send_json(r, rs_health_body(&len), &len);
}

enum MHD_Result rs_http_metrics(rs_http_req *r) {
    ENGINE_OR_ANSWER(r, e);
    return metrics(r, e);
}

enum MHD_Result rs_http_server_info(rs_http_req *r) {
    ENGINE_OR_ANSWER(r, e);
    return server_info(r, e);
}

enum MHD_Result rs_http_load(rs_http_req *r) {
    ENGINE_OR_ANSWER(r, e);
    rs_engine_stats st;
    rs_engine_get_stats(e, &st);
    size_t len = 0;
    char *body = r->def->arg == RS_LOAD_V1 ? rs_loads_body(&st, &len) : rs_load_body(&st, &len);
    return send_json(r, body, &len);
}

enum MHD_Result rs_http_model_info(rs_http_req *r) {
    ENGINE_OR_ANSWER(r, e);
    rs_model_info mi;
    setting_names sn;
    model_info(r->h, e, &mi, &sn);
    size_t len = 0;
    return send_json(r, rs_model_info_body(&mi, &len), &len);
}

enum MHD_Result rs_http_weight_version(rs_http_req *r) {
    ENGINE_OR_ANSWER(r, e);
    size_t len = 0;
    return send_json(r, rs_weight_version_body(rs_engine_weight_version(e), &len), &len);
}

enum MHD_Result rs_http_models(rs_http_req *r) {
    ENGINE_OR_ANSWER(r, e);
    rs_http *h = r->h;
    size_t len = 0;
    return send_json(r, rs_openai_models_body(h->info.served_model_name, h->info.model_path,
                                              (long long)h->start_time_unix, rs_engine_get_limits(e)->max_context,
                                              &len),
                     &len);
}

/* With the engine up, the request schemas state its limits and vocabulary (what a schema can say
 * of them: each field's own cap, not sums such as prompt + max_new_tokens); while the model loads,
 * the tables' ranges alone. */
enum MHD_Result rs_http_openapi(rs_http_req *r) {
    rs_error err = {0};
    rs_engine *e = rs_http_engine(r->h, false, &err);
    rs_jlimits lim = {0}, *have = NULL;
    if (e) {
        const rs_engine_limits *el = rs_engine_get_limits(e);
        /* a prompt has a token at least, so the context caps new tokens too */
        lim.max[RS_JL_NEW_TOKENS] = RS_MIN(el->max_new_tokens, el->max_context - 1);
        lim.max[RS_JL_N] = el->max_n;
        lim.max[RS_JL_TOP_LOGPROBS] = el->max_top_logprobs;
        lim.vocab = rs_engine_model_config(e)->vocab_size;
        have = &lim;
    }
    size_t len = 0;
    return send_json(r, rs_routes_openapi(r->h->api_key[0] != '\0', have, &len), &len);
}

enum MHD_Result rs_http_abort(rs_http_req *r) {
    ENGINE_OR_ANSWER(r, e);
    rs_abort_req a;
    rs_error err = {0};
    if (rs_abort_parse(r->body, r->n, &a, &err) != RS_OK) return rs_http_send_error(r, &err);
    int n = rs_http_gen_abort(r->h, e, a.abort_all ? NULL : a.rid);
    RS_INFO("http | /abort_request | %s | %d request%s in flight matched", a.abort_all ? "all" : a.rid, n,
            n == 1 ? "" : "s");
    size_t len = 0;
    return send_json(r, rs_abort_body(n, &len), &len);
}

/* /pause_generation, /continue_generation, /flush_cache: parsed here, run on the control thread. */
enum MHD_Result rs_http_control(rs_http_req *r) {
    ENGINE_OR_ANSWER(r, e);
    (void)e;
    rs_error err = {0};
    ctl_call c = {0};
    int rc = RS_OK;
    if (r->route == RS_ROUTE_PAUSE) rc = rs_pause_parse(r->body, r->n, &c.pause_mode, &err);
    else if (r->route == RS_ROUTE_CONTINUE) rc = rs_continue_parse(r->body, r->n, &err);
    else rc = rs_flush_parse(r->body, r->n, &err);
    if (rc != RS_OK) return rs_http_send_error(r, &err);
    r->ctx = rs_xmalloc(sizeof c);
    memcpy(r->ctx, &c, sizeof c);
    const rs_phase phase = r->phase;
    r->phase = RS_PHASE_WAITING;
    if (!ctl_push(r->h, r)) { /* between the engine check above and here, shutdown began */
        r->phase = phase;
        rs_error_set(&err, RS_EBUSY, NULL, "server is shutting down");
        return rs_http_send_error(r, &err);
    }
    rs_http_suspend(r); /* the operation may already be done: then this goes straight on */
    return MHD_YES;
}

enum MHD_Result rs_http_control_answer(rs_http_req *r) {
    const ctl_call *c = r->ctx;
    if (c->rc != RS_OK) return rs_http_send_error(r, &c->err);
    const char *msg = r->route == RS_ROUTE_PAUSE      ? "Generation paused successfully."
                      : r->route == RS_ROUTE_CONTINUE ? "Generation continued successfully."
                                                      : "Cache flushed.";
    size_t len = 0;
    return send_json(r, rs_status_body(msg, &len), &len);
}

/* /tokenize and /detokenize: the model's tokenizer on this MHD thread (it is thread-safe). */
enum MHD_Result rs_http_tokenize(rs_http_req *r) {
    ENGINE_OR_ANSWER(r, e);
    rs_http *h = r->h;
    rs_error err = {0};
    rs_tokenize_req q;
    const bool enc = r->route == RS_ROUTE_TOKENIZE;
    int rc = enc ? rs_tokenize_parse(r->body, r->n, h->info.tok, &q, &err)
                 : rs_detokenize_parse(r->body, r->n, h->info.tok, rs_engine_model_config(e)->vocab_size, &q, &err);
    if (rc != RS_OK) return rs_http_send_error(r, &err);
    size_t len = 0;
    char *body = enc ? rs_tokenize_body(&q, h->info.tok, rs_engine_get_limits(e)->max_context, &len)
                     : rs_detokenize_body(&q, h->info.tok, &len);
    rs_tokenize_req_free(&q);
    return send_json(r, body, &len);
}
