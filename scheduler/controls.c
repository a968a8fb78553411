/*
 * controls.c — the step boundary. Between two steps the engine takes in what other threads sent
 * (submitted jobs, aborts) and applies control requests in the order they were made: pause,
 * continue, flush, a weight swap (rs_engine_swap_weights: scales settled, tensors swapped, old KV
 * dropped) and version relabels; outputs record the version spans their tokens came from.
 */
#include "engine_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void apply_control(rs_engine *e, rs_ctl *c);

/* What other threads sent since the last boundary, taken under mu (after waiting for some when
 * `block` and there is nothing to run). */
typedef struct inbox {
    rs_ctl *ctl;
    rs_gen_job **jobs;
    int n_jobs;
    char **rids;
    int n_rids;
    bool abort_all;
} inbox;

static inbox take_inbox(rs_engine *e, bool block) {
    pthread_mutex_lock(&e->mu);
    while (block && !e->stop && e->n_inbox == 0 && e->n_abort_rids == 0 && !e->abort_all && !e->ctl_head &&
           (e->paused || (!e->n_running && !e->wait_head)))
        pthread_cond_wait(&e->cv, &e->mu);
    inbox in = {.ctl = e->ctl_head, .jobs = e->inbox, .n_jobs = e->n_inbox, .rids = e->abort_rids,
                .n_rids = e->n_abort_rids, .abort_all = e->abort_all};
    e->ctl_head = NULL;
    e->inbox = NULL;
    e->n_inbox = e->cap_inbox = 0;
    e->abort_rids = NULL;
    e->n_abort_rids = 0;
    e->abort_all = false;
    pthread_mutex_unlock(&e->mu);
    return in;
}

/* Applies control requests in the order they were made, then wakes their requesters. */
static void run_controls(rs_engine *e, rs_ctl *ctl) {
    for (rs_ctl *c = ctl; c; c = c->next) apply_control(e, c);
    rs_eng_publish_stats(e); /* before the requester wakes: it may read the stats at once */
    pthread_mutex_lock(&e->mu);
    for (rs_ctl *c = ctl; c; c = c->next) c->done = true;
    pthread_cond_broadcast(&e->ctl_cv);
    pthread_mutex_unlock(&e->mu);
}

bool rs_eng_step_boundary(rs_engine *e, bool block) {
    inbox in = take_inbox(e, block);
    for (int i = 0; i < in.n_jobs; i++) rs_eng_admit_job(e, in.jobs[i]);
    free(in.jobs);
    if (in.n_rids > 0 || in.abort_all) rs_eng_abort_matching(e, in.rids, in.n_rids, in.abort_all, "aborted");
    for (int i = 0; i < in.n_rids; i++) free(in.rids[i]);
    free(in.rids);
    if (in.ctl) run_controls(e, in.ctl);
    rs_eng_publish_stats(e);
    return !e->paused && (e->n_running > 0 || e->wait_head);
}

/* Later tokens of output o come from `version`. */
static void out_new_span(rs_gen_output *o, const char *version) {
    rs_weight_span *last = &o->spans[o->n_spans - 1];
    if (strcmp(last->version, version) == 0) return;
    if (last->start == o->n_output) { /* no token under the old version: relabel it, or */
        if (o->n_spans > 1 && strcmp(o->spans[o->n_spans - 2].version, version) == 0)
            o->n_spans--; /* go on with the span before it, of this version (A, B, A) */
        else snprintf(last->version, sizeof last->version, "%s", version);
        return;
    }
    last->end = o->n_output;
    o->spans = rs_xrealloc(o->spans, sizeof *o->spans * (size_t)(o->n_spans + 1));
    rs_weight_span *sp = &o->spans[o->n_spans++];
    snprintf(sp->version, sizeof sp->version, "%s", version);
    sp->start = sp->end = o->n_output;
}

/* A prompt whose scores are not all computed yet is scored again from the start (with the new
 * weights: the sequence recomputes after the update), so that a prompt's scores all come from one
 * version, that of the output's first span. So is one scored in full whose output has no token
 * yet: its first span is relabelled to the new version (out_new_span), which the old scores would
 * then misreport (a scoring request, max_new_tokens 0, reports only that version). */
static void out_restart_scoring(rs_gen_output *o, int k) {
    const int n = o->n_input_logprobs;
    if (n == 0 || (o->n_output > 0 && !isnan(o->input_logprobs[n - 1]))) return; /* scored in order: all done */
    for (int i = 0; i < n; i++) o->input_logprobs[i] = NAN;
    for (size_t i = 0; k > 0 && i < (size_t)n * (size_t)k; i++) {
        o->input_top_ids[i] = -1;
        o->input_top_lps[i] = NAN;
    }
}

/* new_weights: the weights changed (every sequence recomputes); else only their label did. */
static void seq_new_version(rs_seq *s, const char *version, bool new_weights) {
    rs_gen_job *job = s->job;
    if (new_weights) out_restart_scoring(s->out, job->top_logprobs_num);
    out_new_span(s->out, version);
    for (int k = 1; k <= s->n_forks; k++) out_new_span(&job->outputs[s->prompt_index * job->sp.n + k], version);
    snprintf(job->weight_version, sizeof job->weight_version, "%s", version);
}

/* Every live output records the new version from its next token on. */
static void set_weight_version(rs_engine *e, const char *version, bool new_weights) {
    pthread_mutex_lock(&e->stats_mu);
    snprintf(e->weight_version, sizeof e->weight_version, "%s", version);
    pthread_mutex_unlock(&e->stats_mu);
    for (int i = 0; i < e->n_running; i++) seq_new_version(e->running[i], version, new_weights);
    for (rs_seq *s = e->wait_head; s; s = s->next) seq_new_version(s, version, new_weights);
}

/* New weights are in. No KV computed by the old ones is used again: sequences in flight are
 * retracted and recompute their tokens with the new weights (so every token's logprob is exactly
 * that of the version it reports), waiting ones drop matched or forked pages, and the prefix cache
 * is dropped. */
static void drop_old_kv(rs_engine *e) {
    while (e->n_running > 0) rs_eng_preempt(e, e->running[e->n_running - 1]);
    for (rs_seq *s = e->wait_head; s; s = s->next) {
        if (s->kv.n_blocks == 0) continue;
        rs_kv_seq_release(&e->pool, &s->kv);
        s->n_computed = 0;
    }
    rs_kv_pool_flush_cache(&e->pool);
}

/* RS_CTL_WEIGHTS (rs_engine_swap_weights, engine.h): settle the scales, swap, drop the old KV.
 * Everything that can fail happens before swap->apply; after it nothing can. */
static int commit_weights(rs_engine *e, rs_ctl *c) {
    const rs_weight_swap *w = c->swap;
    const size_t n = (size_t)e->pool.n_layers * (size_t)e->pool.n_kv_heads;
    const float *k = w->k_scales, *v = w->v_scales;
    float *ck = NULL, *cv = NULL;
    int rc = RS_OK;
    if (w->calibrate) {
        ck = rs_xmalloc(n * sizeof *ck);
        cv = rs_xmalloc(n * sizeof *cv);
        rc = w->calibrate(w->ctx, e, ck, cv, c->err);
        k = ck, v = cv;
    }
    RS_ASSERT(!k || e->pool.layers[0].scale_mode == RS_KV_SCALE_PER_HEAD); /* sync's policy gives none else */
    if (rc == RS_OK && k && !rs_kv_scales_valid(k, v, n))
        rc = rs_error_set(c->err, RS_EINVAL, w->scales_param ? w->scales_param : "k_scale",
                          "%s are unusable (each must be finite and > 0); the update is dropped and the weights "
                          "in service are unchanged", w->scales_what ? w->scales_what : "the KV scales");
    if (rc == RS_OK) {
        w->apply(e->model, w->ctx);
        drop_old_kv(e);
        if (k) {
            int set = rs_kv_pool_set_scales(&e->pool, k, v);
            RS_ASSERT(set == RS_OK); /* checked above */
            RS_INFO("kv cache: per-head FP8 scales: %s", w->scales_what ? w->scales_what : "installed");
        }
        set_weight_version(e, w->version, true);
        e->stats.weight_updates++;
    }
    free(ck);
    free(cv);
    return rc;
}

static void apply_control(rs_engine *e, rs_ctl *c) {
    c->rc = RS_OK;
    switch (c->kind) {
    case RS_CTL_PAUSE:
        if (c->arg == RS_PAUSE_ABORT) {
            rs_eng_abort_matching(e, NULL, 0, true, "paused"); /* probes stay, and run once generation continues */
        } else if (c->arg == RS_PAUSE_RETRACT) {
            while (e->n_running > 0) rs_eng_preempt(e, e->running[e->n_running - 1]);
        }
        e->paused = true;
        RS_INFO("engine: paused (%s)", c->arg == RS_PAUSE_ABORT ? "abort" : c->arg == RS_PAUSE_RETRACT ? "retract"
                                                                                                    : "in_place");
        break;
    case RS_CTL_CONTINUE:
        if (e->paused) RS_INFO("engine: continuing");
        e->paused = false;
        break;
    case RS_CTL_WEIGHTS: {
        double t0 = rs_now_s();
        c->rc = commit_weights(e, c);
        c->seconds = rs_now_s() - t0;
        if (c->rc == RS_OK)
            RS_INFO("engine: weights updated to version %s (step loop held %.3f s, %d running, %d waiting)",
                    c->swap->version, c->seconds, e->n_running, e->n_waiting);
        break;
    }
    case RS_CTL_VERSION:
        set_weight_version(e, c->version, false);
        break;
    case RS_CTL_FLUSH:
        if (e->n_running > 0 || e->wait_head) {
            c->rc = RS_ESTATE;
        } else {
            rs_kv_pool_flush_cache(&e->pool);
            RS_INFO("engine: prefix cache flushed");
        }
        break;
    }
}

/* Runs a control request at the next step boundary and waits for it. */
static int engine_control_req(rs_engine *e, rs_ctl *req) {
    rs_ctl c = *req;
    c.next = NULL;
    c.done = false;
    if (!e->thread_started) { /* the caller owns the engine */
        apply_control(e, &c);
        rs_eng_publish_stats(e);
        *req = c;
        return c.rc;
    }
    pthread_mutex_lock(&e->mu);
    if (e->stop) {
        pthread_mutex_unlock(&e->mu);
        return RS_EBUSY;
    }
    rs_ctl **tail = &e->ctl_head; /* FIFO: requests apply in the order they were made */
    while (*tail) tail = &(*tail)->next;
    *tail = &c;
    pthread_cond_signal(&e->cv);
    while (!c.done) pthread_cond_wait(&e->ctl_cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    *req = c;
    return c.rc;
}

static int engine_control(rs_engine *e, rs_ctl_kind kind, int arg) {
    rs_ctl c = {.kind = kind, .arg = arg};
    return engine_control_req(e, &c);
}

int rs_engine_swap_weights(rs_engine *e, const rs_weight_swap *swap, double *seconds_paused, rs_error *err) {
    rs_ctl c = {.kind = RS_CTL_WEIGHTS, .swap = swap, .err = err};
    int rc = engine_control_req(e, &c);
    if (seconds_paused) *seconds_paused = c.seconds;
    if (rc == RS_EBUSY) return rs_error_set(err, rc, NULL, "the engine is shutting down");
    return rc;
}

int rs_engine_set_weight_version(rs_engine *e, const char *version, rs_error *err) {
    rs_ctl c = {.kind = RS_CTL_VERSION, .version = version};
    int rc = engine_control_req(e, &c);
    if (rc != RS_OK) return rs_error_set(err, rc, NULL, "the engine is shutting down");
    return RS_OK;
}

void rs_engine_pause(rs_engine *e, rs_pause_mode mode) { engine_control(e, RS_CTL_PAUSE, (int)mode); }
void rs_engine_continue(rs_engine *e) { engine_control(e, RS_CTL_CONTINUE, 0); }

int rs_engine_flush_cache(rs_engine *e, rs_error *err) {
    int rc = engine_control(e, RS_CTL_FLUSH, 0);
    if (rc == RS_ESTATE) return rs_error_set(err, rc, NULL, "cannot flush the cache while requests are in flight");
    if (rc != RS_OK) return rs_error_set(err, rc, NULL, "the engine is shutting down");
    return RS_OK;
}
