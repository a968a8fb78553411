/*
 * http_gen.c — the generation routes: POST /generate (SGLang), POST /v1/completions (OpenAI /
 * vLLM) and GET /health_generate (a one-token probe through the engine), plain or streamed.
 *
 * A request is parsed and validated on the MHD thread, admitted (or refused with 503 when
 * max-waiting-requests are in flight), and submitted. A plain answer suspends the connection
 * until the engine's on_done resumes it. A streamed answer queues an SSE callback response at
 * once; the engine thread writes events into the request's buffer from on_progress and on_done
 * (the only place the outputs may be read while the job runs), and stream_reader gives them to
 * MHD, suspending the connection while the buffer is empty. A client that leaves is noticed by a
 * failed write, by MHD's completion notice, or by http.c's scan of suspended sockets; its job is
 * aborted either way.
 *
 * Streamed bytes wait in the request's buffer until MHD takes them. Cumulative /generate events
 * repeat every token so far, so a client that reads slowly makes that buffer grow with the square
 * of the output: the bytes not yet taken are bounded per stream (max-stream-buffer) and over all
 * streams (stream-memory-budget). The stream whose next events would pass either bound is cut: its
 * unsent bytes are freed at once, its job is aborted (the output finishes "abort" and its KV pages
 * are freed at the engine's next step), and the connection ends with an error once MHD has sent
 * what it already held, or at http-idle-timeout if the client reads nothing at all.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../protocol/errors.h"
#include "http_internal.h"

/* ---------------------------------------------------------------- engine callbacks (engine thread) */

/* Under h->mu: ends r's stream with an error, giving its unsent bytes back at once. */
static void cut_stream_locked(rs_http_req *r) {
    if (r->sse.len > r->sse_off) rs_http_budget_give(&r->h->lim.stream_bytes, r->sse.len - r->sse_off);
    rs_buf_free(&r->sse);
    r->sse_off = 0;
    r->stream_error = true;
}

/* Appends freshly built events (tmp, consumed) to r's stream; `final`: the job is done. */
static void push_stream(rs_http_req *r, rs_buf *tmp, int rc, bool final) {
    rs_http *h = r->h;
    bool abort = false;
    pthread_mutex_lock(&h->mu);
    if (rc == RS_OK && !r->stream_error) {
        size_t pending = r->sse.len - r->sse_off;
        const char *limit = NULL;
        /* a client is too slow when what it left unsent from earlier steps is over the bound: one
         * step's events may alone be larger (every sample of a batch, cumulative text, top
         * logprobs), and a client that keeps up must still get them */
        if (pending > h->opts.max_stream_buffer / 2 && pending + tmp->len > h->opts.max_stream_buffer)
            limit = "max-stream-buffer";
        else if (!rs_http_budget_take(&h->lim.stream_bytes, h->opts.stream_memory_budget, tmp->len))
            limit = "stream-memory-budget";
        if (limit) {
            RS_WARN("http | rid %s | the client reads too slowly (%zu bytes unsent, %zu more to send): over %s; "
                    "ending its stream and aborting the request", r->engine_rid, pending, tmp->len, limit);
            cut_stream_locked(r);
            abort = !final;
        } else if (pending == 0) { /* nothing pending: take the new buffer as is */
            rs_buf old = r->sse;
            r->sse = *tmp;
            r->sse_off = 0;
            *tmp = old;
        } else if (rs_buf_append(&r->sse, tmp->data, tmp->len) != RS_OK) {
            rs_http_budget_give(&h->lim.stream_bytes, tmp->len);
            RS_ERROR("http | rid %s | out of memory writing stream events", r->engine_rid);
            cut_stream_locked(r);
            abort = !final;
        }
    } else if (rc != RS_OK) {
        if (rc != RS_EINTERNAL) /* RS_EINTERNAL: the engine failed the job and logged why */
            RS_ERROR("http | rid %s | out of memory writing stream events", r->engine_rid);
        cut_stream_locked(r);
        abort = !final;
    }
    if (final) {
        r->stream_end = true;
        r->done = true;
        r->held = false;
    }
    rs_engine *e = h->engine;
    bool wake = rs_http_claim_resume_locked(r);
    bool free_now = final && !r->in_mhd;
    pthread_mutex_unlock(&h->mu);
    rs_buf_free(tmp);
    if (abort && e) rs_engine_abort(e, r->engine_rid);
    if (free_now) rs_http_req_free(r);
    else if (wake) MHD_resume_connection(r->conn);
}

static int stream_events(rs_http_req *r, bool final, rs_buf *out) {
    return r->route == RS_ROUTE_COMPLETIONS ? rs_openai_stream_events(&r->oai, final, out)
                                            : rs_generate_stream_events(&r->gen, final, out);
}

static void on_job_progress(rs_gen_job *job, void *user) {
    (void)job;
    rs_http_req *r = user;
    rs_buf tmp = {0};
    int rc = stream_events(r, false, &tmp);
    if (rc == RS_OK && tmp.len == 0) {
        rs_buf_free(&tmp);
        return;
    }
    push_stream(r, &tmp, rc, false);
}

static void on_job_done(rs_gen_job *job, void *user) {
    rs_http_req *r = user;
    if (r->stream) {
        rs_buf tmp = {0};
        /* a failed job (engine.h: job->error) gets no final events: the stream ends without [DONE] */
        int rc = job->error.code != RS_OK ? RS_EINTERNAL : stream_events(r, true, &tmp);
        push_stream(r, &tmp, rc, true);
        return;
    }
    rs_http *h = r->h;
    pthread_mutex_lock(&h->mu);
    r->done = true;
    r->held = false;
    bool wake = rs_http_claim_resume_locked(r);
    bool free_now = !r->in_mhd; /* the client left while its job ran */
    pthread_mutex_unlock(&h->mu);
    if (free_now) rs_http_req_free(r);
    else if (wake) MHD_resume_connection(r->conn); /* suspended, so still alive */
}

/* ---------------------------------------------------------------- the stream */

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    rs_http_req *r = cls;
    rs_http *h = r->h;
    pthread_mutex_lock(&h->mu);
    size_t avail = r->sse.len - r->sse_off;
    if (avail > 0) {
        size_t n = RS_MIN(avail, max);
        memcpy(buf, r->sse.data + r->sse_off, n);
        r->sse_off += n;
        rs_http_budget_give(&h->lim.stream_bytes, n);
        if (r->sse_off == r->sse.len) {
            if (r->sse.cap > ((size_t)1 << 20)) rs_buf_free(&r->sse); /* a burst's buffer is not kept */
            r->sse.len = r->sse_off = 0;
        } else if (r->sse_off > ((size_t)1 << 20) && r->sse_off * 2 > r->sse.len) {
            rs_buf_consume(&r->sse, r->sse_off);
            r->sse_off = 0;
        }
        pthread_mutex_unlock(&h->mu);
        return (ssize_t)n;
    }
    bool end = r->stream_end && !r->stream_error, error = r->stream_error || r->client_gone;
    pthread_mutex_unlock(&h->mu);
    if (end) return MHD_CONTENT_READER_END_OF_STREAM;
    if (error) return MHD_CONTENT_READER_END_WITH_ERROR;
    rs_http_suspend(r); /* until the engine appends (or the client is found gone) */
    return 0;
}

static enum MHD_Result queue_stream(rs_http_req *r) {
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 32 * 1024, stream_reader, r, NULL);
    if (!resp) return MHD_NO; /* closes: the completion notice aborts the job */
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    enum MHD_Result ret = MHD_queue_response(r->conn, 200, resp);
    MHD_destroy_response(resp);
    rs_http_count(r->h, r->route, 200);
    return ret;
}

/* ---------------------------------------------------------------- parsing */

/* The engine's unique name for the job: the client's rid (cut to fit) + "#<seq>". */
static void name_job(rs_http *h, rs_gen_job *job, const char *rid) {
    char suffix[32];
    int sl = snprintf(suffix, sizeof suffix, "#%llu", (unsigned long long)atomic_fetch_add(&h->next_job, 1));
    snprintf(job->rid, sizeof job->rid, "%.*s%s", (int)(sizeof job->rid - 1) - sl, rid, suffix);
}

static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The context the longest prompt of job leaves. */
static int context_room(const rs_gen_job *job, const rs_engine_limits *lim) {
    int longest = 0;
    for (int p = 0; p < job->n_prompts; p++) longest = RS_MAX(longest, job->prompt_lens[p]);
    return lim->max_context - longest;
}

/* The new tokens of a job that asked for none in particular: def, as far as --max-new-tokens and
 * the context allow. A prompt that leaves no room asks for 1, which validation refuses naming that
 * prompt (SGLang refuses a prompt that fills its context too), rather than getting an empty output. */
static int default_new_tokens(const rs_gen_job *job, const rs_engine_limits *lim, int def) {
    return RS_MIN(def, RS_MIN(lim->max_new_tokens, RS_MAX(1, context_room(job, lim))));
}

static int parse_generate(rs_http_req *r, rs_engine *e, rs_error *err) {
    rs_http *h = r->h;
    int rc = rs_generate_parse(r->body, r->n, h->info.tok, &r->gen, err);
    if (rc != RS_OK) return rc;
    if (!r->gen.rid[0])
        snprintf(r->gen.rid, sizeof r->gen.rid, "req-%llu", (unsigned long long)atomic_fetch_add(&h->next_rid, 1));
    r->job = r->gen.job;
    r->stream = r->gen.stream;
    r->gen.incremental = h->info.cfg->incremental_streaming_output;
    /* No sampling_seed: a fresh random one, as SGLang does, so that a GRPO group sent as separate
     * requests does not sample n identical rollouts. A given seed reproduces the tokens exactly. */
    if (!r->gen.seed_given) r->job->sp.seed = splitmix64(atomic_fetch_add(&h->seed_state, 0x9e3779b97f4a7c15ull));
    name_job(h, r->job, r->gen.rid);
    const rs_engine_limits *lim = rs_engine_get_limits(e);
    /* No max_new_tokens: SGLang's default (128), as far as the cap and the context allow, as SGLang's
     * scheduler lowers it; a given one past either is a 400, as SGLang refuses it. */
    if (!r->gen.max_new_tokens_given)
        r->job->sp.max_new_tokens = default_new_tokens(r->job, lim, r->job->sp.max_new_tokens);
    rs_gen_invalid why;
    if (rs_gen_job_validate(r->job, rs_engine_model_config(e), lim, &why) != RS_OK)
        return rs_generate_invalid(&r->gen, &why, err);
    return RS_OK;
}

static int parse_completions(rs_http_req *r, rs_engine *e, rs_error *err) {
    rs_http *h = r->h;
    rs_openai_req *q = &r->oai;
    int rc = rs_openai_parse_completions(r->body, r->n, h->info.tok, q, err);
    if (rc != RS_OK) return rc;
    if ((rc = rs_openai_check_model(q, h->served_model_name, err)) != RS_OK) return rc;
    snprintf(q->model, sizeof q->model, "%s", h->served_model_name);
    q->created = (long long)time(NULL);
    if (!q->id[0]) {
        uint64_t x = splitmix64(atomic_fetch_add(&h->seed_state, 0x632be59bd9b4e019ull));
        snprintf(q->id, sizeof q->id, "cmpl-%016llx", (unsigned long long)x);
    }
    rs_gen_job *job = q->job;
    if (!q->seed_given) job->sp.seed = splitmix64(atomic_fetch_add(&h->seed_state, 0x9e3779b97f4a7c15ull));
    const rs_engine_limits *lim = rs_engine_get_limits(e);
    if (!q->max_tokens_given) /* absent or null: the default (16), as far as there is room */
        job->sp.max_new_tokens = default_new_tokens(job, lim, job->sp.max_new_tokens);
    r->job = job;
    r->stream = q->stream;
    name_job(h, job, q->id);
    rs_gen_invalid why;
    if (rs_gen_job_validate(job, rs_engine_model_config(e), lim, &why) != RS_OK) return rs_openai_invalid(&why, err);
    return RS_OK;
}

/* /health_generate: one greedy token after token 0, as SGLang's probe. */
static void make_probe(rs_http_req *r) {
    rs_http *h = r->h;
    rs_gen_job *job = rs_gen_job_new();
    job->n_prompts = 1;
    job->prompts = rs_xcalloc(1, sizeof(int32_t *));
    job->prompt_lens = rs_xcalloc(1, sizeof(int));
    job->prompts[0] = rs_xcalloc(1, sizeof(int32_t));
    job->prompt_lens[0] = 1;
    job->sp.max_new_tokens = 1;
    job->sp.temperature = 0.0f;
    job->probe = true; /* a trainer's abort-all or pause(abort) must not fail the probe */
    r->gen.job = job;
    snprintf(r->gen.rid, sizeof r->gen.rid, "health_generate");
    name_job(h, job, r->gen.rid);
    r->job = job;
    r->deadline = rs_now_s() + h->info.cfg->health_generate_timeout;
}

/* ---------------------------------------------------------------- the routes */

void rs_http_gen_cleanup(rs_http_req *r) {
    rs_generate_req_free(&r->gen);
    rs_openai_req_free(&r->oai);
}

enum MHD_Result rs_http_gen_start(rs_http_req *r) {
    rs_http *h = r->h;
    rs_error err = {0};
    rs_engine *e = rs_http_engine(h, true, &err);
    if (!e) return rs_http_send_error(r, &err);
    int rc = RS_OK;
    bool probe = r->route == RS_ROUTE_HEALTH_GENERATE;
    if (r->route == RS_ROUTE_GENERATE) rc = parse_generate(r, e, &err);
    else if (r->route == RS_ROUTE_COMPLETIONS) rc = parse_completions(r, e, &err);
    else make_probe(r);
    rs_http_body_drop(r); /* the job holds everything now */
    if (rc != RS_OK) return rs_http_send_error(r, &err);

    /* before r is on the live list, where the disconnect scan and /abort_request read it */
    snprintf(r->engine_rid, sizeof r->engine_rid, "%s", r->job->rid);
    pthread_mutex_lock(&h->mu);
    if (h->state != RS_HTTP_STATE_READY || !h->engine) {
        rc = rs_error_set(&err, RS_EBUSY, NULL, "server is shutting down");
    } else if (!probe && h->in_flight >= h->opts.max_waiting_requests) {
        rc = rs_error_set(&err, RS_EBUSY, NULL, "too many requests in flight (max-waiting-requests = %d); retry",
                          h->opts.max_waiting_requests);
        r->extra_header = MHD_HTTP_HEADER_RETRY_AFTER;
        r->extra_value = "1";
    } else {
        h->in_flight++;
        r->counted = true;
        r->held = true;
        r->live_next = h->live;
        if (h->live) h->live->live_prev = r;
        h->live = r;
    }
    pthread_mutex_unlock(&h->mu);
    if (rc != RS_OK) return rs_http_send_error(r, &err);

    rs_gen_job *job = r->job;
    job->on_done = on_job_done;
    job->on_progress = r->stream ? on_job_progress : NULL;
    job->on_done_user = r;
    job->t_arrival = r->t_arrival;
    r->phase = r->stream ? RS_PHASE_STREAMING : RS_PHASE_WAITING;
    RS_DEBUG("rid %s | submit | job %s | %d prompt%s x n=%d%s", r->route == RS_ROUTE_COMPLETIONS ? r->oai.id : r->gen.rid,
             job->rid, job->n_prompts, job->n_prompts == 1 ? "" : "s", job->sp.n, r->stream ? " | stream" : "");
    rc = rs_engine_submit(e, job, &err);
    if (rc != RS_OK) { /* never reached the engine: still ours */
        pthread_mutex_lock(&h->mu);
        r->held = false;
        pthread_mutex_unlock(&h->mu);
        r->phase = RS_PHASE_BODY;
        return rs_http_send_error(r, &err);
    }
    if (r->stream) return queue_stream(r);
    rs_http_suspend(r); /* the job may already be done: then this goes straight on */
    return MHD_YES;
}

enum MHD_Result rs_http_gen_answer(rs_http_req *r) {
    const rs_gen_job *job = r->job;
    size_t len = 0;
    char *body;
    if (job->error.code != RS_OK) return rs_http_send_error(r, &job->error); /* never served: a 500 */
    if (r->route == RS_ROUTE_HEALTH_GENERATE) {
        const rs_finish *f = &job->outputs[0].finish;
        if (f->type == RS_FINISH_ABORT) {
            rs_error err;
            rs_error_set(&err, RS_EBUSY, NULL, "the health probe was aborted: %s", f->message);
            return rs_http_send_error(r, &err);
        }
        body = rs_health_body(&len);
    } else if (r->route == RS_ROUTE_COMPLETIONS) {
        body = rs_openai_completions_response(&r->oai, &len);
    } else {
        body = rs_generate_response(&r->gen, &len);
    }
    if (!body) RS_ERROR("rid %s | out of memory writing the response", job->rid);
    RS_DEBUG("rid %s | 200 | %d prompt%s x n=%d | %zu bytes | %.3fs", job->rid, job->n_prompts,
             job->n_prompts == 1 ? "" : "s", job->sp.n, len, rs_now_s() - r->t_arrival);
    return rs_http_send(r, 200, body, len, "application/json");
}

int rs_http_gen_abort(rs_http *h, rs_engine *e, const char *rid) {
    int n = 0, cap = 0;
    char(*rids)[128] = NULL;
    pthread_mutex_lock(&h->mu);
    for (rs_http_req *r = h->live; r; r = r->live_next) {
        if (!r->held || r->done) continue;
        if (!rid && r->route == RS_ROUTE_HEALTH_GENERATE) continue; /* as the engine: abort-all skips probes */
        bool match = !rid || (r->route == RS_ROUTE_COMPLETIONS ? rs_openai_matches_rid(&r->oai, rid)
                                                               : rs_generate_matches_rid(&r->gen, rid));
        if (!match) continue;
        if (rid) {
            if (n == cap) {
                cap = cap ? cap * 2 : 8;
                rids = rs_xrealloc(rids, sizeof *rids * (size_t)cap);
            }
            snprintf(rids[n], sizeof rids[0], "%s", r->engine_rid);
        }
        n++;
    }
    pthread_mutex_unlock(&h->mu);
    if (!rid) rs_engine_abort(e, NULL);
    for (int i = 0; rid && i < n; i++) rs_engine_abort(e, rids[i]);
    free(rids);
    return n;
}
