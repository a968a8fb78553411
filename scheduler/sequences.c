/*
 * sequences.c — a job's prompts become sequences (one per prompt, or a group leader that forks
 * its n samples after the shared prefill); their outputs (tokens, logprobs, scoring), the waiting
 * queue, and finishing: one sequence, every sequence of a job, aborts by rid, shutdown.
 */
#include "engine_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- sequences and outputs */

void rs_eng_seq_push_token(rs_seq *s, int32_t t) {
    if (s->n_tokens == s->cap) {
        s->cap = s->cap * 2 + 16;
        s->tokens = rs_xrealloc(s->tokens, sizeof(int32_t) * (size_t)s->cap);
    }
    s->tokens[s->n_tokens++] = t;
}

void rs_eng_out_push(rs_gen_output *o, int k, int32_t tok, float lp, const int32_t *top_ids, const float *top_lps) {
    if (o->n_output == o->cap) {
        o->cap = o->cap * 2 + 16;
        o->output_ids = rs_xrealloc(o->output_ids, sizeof(int32_t) * (size_t)o->cap);
        o->output_logprobs = rs_xrealloc(o->output_logprobs, sizeof(float) * (size_t)o->cap);
        if (k > 0) {
            o->output_top_ids = rs_xrealloc(o->output_top_ids, sizeof(int32_t) * (size_t)o->cap * k);
            o->output_top_lps = rs_xrealloc(o->output_top_lps, sizeof(float) * (size_t)o->cap * k);
        }
    }
    o->output_ids[o->n_output] = tok;
    o->output_logprobs[o->n_output] = lp;
    if (k > 0) {
        memcpy(o->output_top_ids + (size_t)o->n_output * k, top_ids, sizeof(int32_t) * (size_t)k);
        memcpy(o->output_top_lps + (size_t)o->n_output * k, top_lps, sizeof(float) * (size_t)k);
    }
    o->n_output++;
}

void rs_eng_out_push_kept(rs_gen_output *o, const int32_t *ids, size_t n) {
    RS_ASSERT(n <= UINT32_MAX - o->n_kept_ids); /* the caller holds the job under its limit */
    if (o->n_kept_ids + n > o->cap_kept_ids) {
        o->cap_kept_ids = RS_MAX(o->n_kept_ids + n, o->cap_kept_ids * 2 + 64);
        o->kept_ids = rs_xrealloc(o->kept_ids, sizeof(int32_t) * o->cap_kept_ids);
    }
    const int row = o->n_output; /* the token about to be pushed: offsets [0, row + 1] */
    if (row + 2 > o->cap_kept_offsets) {
        o->cap_kept_offsets = o->cap_kept_offsets * 2 + 16;
        o->kept_offsets = rs_xrealloc(o->kept_offsets, sizeof(uint32_t) * (size_t)o->cap_kept_offsets);
    }
    if (row == 0) o->kept_offsets[0] = 0;
    if (n) memcpy(o->kept_ids + o->n_kept_ids, ids, sizeof(int32_t) * n);
    o->n_kept_ids += n;
    o->kept_offsets[row + 1] = (uint32_t)o->n_kept_ids;
}

/* Prompt scoring arrays of an output, NaN / -1 until filled. */
static void out_init_scoring(rs_gen_output *o, const rs_gen_job *job, int prompt_len) {
    if (job->logprob_start_len < 0) return;
    int n = prompt_len - job->logprob_start_len, k = job->top_logprobs_num;
    o->n_input_logprobs = n;
    o->input_logprobs = rs_xmalloc(sizeof(float) * (size_t)n);
    for (int i = 0; i < n; i++) o->input_logprobs[i] = NAN;
    if (k > 0) {
        o->input_top_ids = rs_xmalloc(sizeof(int32_t) * (size_t)n * k);
        o->input_top_lps = rs_xmalloc(sizeof(float) * (size_t)n * k);
        for (size_t i = 0; i < (size_t)n * k; i++) {
            o->input_top_ids[i] = -1;
            o->input_top_lps[i] = NAN;
        }
    }
}

void rs_eng_out_copy_scoring(rs_gen_output *dst, const rs_gen_output *src, int k) {
    int n = src->n_input_logprobs;
    if (n == 0) return;
    memcpy(dst->input_logprobs, src->input_logprobs, sizeof(float) * (size_t)n);
    if (k > 0) {
        memcpy(dst->input_top_ids, src->input_top_ids, sizeof(int32_t) * (size_t)n * k);
        memcpy(dst->input_top_lps, src->input_top_lps, sizeof(float) * (size_t)n * k);
    }
}

rs_seq *rs_eng_seq_new(rs_gen_job *job, int p, int si) {
    rs_seq *s = rs_xcalloc(1, sizeof *s);
    s->job = job;
    s->prompt_index = p;
    s->sample_index = si;
    s->out = &job->outputs[p * job->sp.n + si];
    s->prompt_len = job->prompt_lens[p];
    s->out->prompt_tokens = s->prompt_len;
    s->cap = s->prompt_len + 16;
    s->tokens = rs_xmalloc(sizeof(int32_t) * (size_t)s->cap);
    memcpy(s->tokens, job->prompts[p], sizeof(int32_t) * (size_t)s->prompt_len);
    s->n_tokens = s->prompt_len;
    return s;
}

static void wait_push_back(rs_engine *e, rs_seq *s) {
    s->next = NULL;
    if (e->wait_tail) e->wait_tail->next = s;
    else e->wait_head = s;
    e->wait_tail = s;
    e->n_waiting++;
}

void rs_eng_wait_push_front(rs_engine *e, rs_seq *s) {
    s->next = e->wait_head;
    e->wait_head = s;
    if (!e->wait_tail) e->wait_tail = s;
    e->n_waiting++;
}

rs_seq *rs_eng_wait_pop_front(rs_engine *e) {
    rs_seq *s = e->wait_head;
    e->wait_head = s->next;
    if (!e->wait_head) e->wait_tail = NULL;
    s->next = NULL;
    e->n_waiting--;
    return s;
}

void rs_eng_running_remove(rs_engine *e, rs_seq *s) {
    for (int i = 0; i < e->n_running; i++) {
        if (e->running[i] != s) continue;
        memmove(&e->running[i], &e->running[i + 1], sizeof(rs_seq *) * (size_t)(e->n_running - i - 1));
        e->n_running--;
        return;
    }
    RS_ASSERT(!"sequence not running");
}

/* A job's sequences: one per prompt, the group leader; its n - 1 siblings fork from it once its
 * prompt is computed, so the group's prompt is prefilled once. */
void rs_eng_admit_job(rs_engine *e, rs_gen_job *job) {
    int n = job->sp.n;
    job->outputs = rs_xcalloc((size_t)job->n_prompts * (size_t)n, sizeof(rs_gen_output));
    snprintf(job->weight_version, sizeof job->weight_version, "%s", e->weight_version);
    for (int p = 0; p < job->n_prompts; p++) {
        for (int si = 0; si < n; si++) {
            rs_gen_output *o = &job->outputs[p * n + si];
            o->prompt_tokens = job->prompt_lens[p];
            out_init_scoring(o, job, job->prompt_lens[p]);
            o->spans = rs_xcalloc(1, sizeof *o->spans);
            o->n_spans = 1;
            snprintf(o->spans[0].version, sizeof o->spans[0].version, "%s", e->weight_version);
        }
        rs_seq *s = rs_eng_seq_new(job, p, 0);
        s->n_forks = n - 1;
        wait_push_back(e, s);
    }
}

static bool job_finished(const rs_gen_job *job) {
    for (int i = 0; i < job->n_prompts * job->sp.n; i++)
        if (job->outputs[i].finish.type == RS_FINISH_NONE) return false;
    return true;
}

static void set_finish(rs_gen_output *o, rs_finish_type type, int32_t matched, const char *msg, double t_arrival) {
    /* an update after the last token (then an abort, or a stop found on it) gave it no token */
    if (o->n_spans > 1 && o->spans[o->n_spans - 1].start == o->n_output) o->n_spans--;
    if (o->n_spans > 0) o->spans[o->n_spans - 1].end = o->n_output;
    o->finish.type = type;
    o->finish.matched = matched;
    o->finish.length = o->n_output;
    if (msg) snprintf(o->finish.message, sizeof o->finish.message, "%s", msg);
    o->e2e_latency = rs_now_s() - t_arrival;
}

/* Finishes s (which must be in neither list), returns its pages, finishes any siblings it never
 * forked, and completes the job when it was the last sequence. */
void rs_eng_finish_seq(rs_engine *e, rs_seq *s, rs_finish_type type, int32_t matched, const char *msg) {
    rs_gen_job *job = s->job;
    set_finish(s->out, type, matched, msg, job->t_arrival);
    for (int k = 1; k <= s->n_forks; k++) { /* siblings that never started: same prompt, same fate */
        rs_gen_output *o = &job->outputs[s->prompt_index * job->sp.n + k];
        rs_eng_out_copy_scoring(o, s->out, job->top_logprobs_num);
        o->cached_tokens = s->n_computed >= s->prompt_len ? s->prompt_len : 0;
        set_finish(o, type == RS_FINISH_STOP ? RS_FINISH_LENGTH : type, -1, msg, job->t_arrival);
    }
    rs_kv_seq_release(&e->pool, &s->kv);
    rs_penalty_counts_free(&s->pen);
    free(s->tokens);
    free(s);
    if (!job_finished(job)) return;
    if (!job->probe) { /* a health probe is no request (SGLang sends its probe with log_metrics off) */
        rs_histogram_observe(&e->stats.e2e, rs_now_s() - job->t_arrival);
        e->stats.requests_finished++;
        for (int i = 0; i < job->n_prompts * job->sp.n; i++) {
            if (job->outputs[i].finish.type == RS_FINISH_ABORT) {
                e->stats.requests_aborted++;
                break;
            }
        }
    }
    /* before the requester wakes: a client that reads /metrics on receiving its response sees the
     * request counted, with its tokens and latencies */
    rs_eng_publish_stats(e);
    if (job->on_done) job->on_done(job, job->on_done_user);
}

void rs_eng_finish_running(rs_engine *e, rs_seq *s, rs_finish_type type, int32_t matched, const char *msg) {
    rs_eng_running_remove(e, s);
    rs_eng_finish_seq(e, s, type, matched, msg);
}

static bool rid_matches(char **rids, int n, bool all, const rs_gen_job *job) {
    if (all) return !job->probe;
    for (int i = 0; i < n; i++)
        if (strcmp(rids[i], job->rid) == 0) return true;
    return false;
}

/* Finishes with "abort" (`why`) every running and waiting sequence whose job rid_matches. */
void rs_eng_abort_matching(rs_engine *e, char **rids, int n_rids, bool all, const char *why) {
    for (int i = e->n_running - 1; i >= 0; i--) {
        rs_seq *s = e->running[i];
        if (rid_matches(rids, n_rids, all, s->job)) rs_eng_finish_running(e, s, RS_FINISH_ABORT, -1, why);
    }
    rs_seq **link = &e->wait_head;
    e->wait_tail = NULL;
    while (*link) {
        rs_seq *s = *link;
        if (rid_matches(rids, n_rids, all, s->job)) {
            *link = s->next;
            e->n_waiting--;
            rs_eng_finish_seq(e, s, RS_FINISH_ABORT, -1, why);
        } else {
            e->wait_tail = s;
            link = &s->next;
        }
    }
}

void rs_eng_finish_all(rs_engine *e, const char *why) {
    rs_eng_step_boundary(e, false);
    while (e->n_running > 0) rs_eng_finish_running(e, e->running[e->n_running - 1], RS_FINISH_ABORT, -1, why);
    while (e->wait_head) rs_eng_finish_seq(e, rs_eng_wait_pop_front(e), RS_FINISH_ABORT, -1, why);
}

bool rs_eng_is_stop_token(const rs_engine *e, const rs_sampling_params *sp, int32_t t) {
    if (sp->ignore_eos && sp->sglang_finish) return false;
    for (int i = 0; i < sp->n_stop_token_ids; i++)
        if (sp->stop_token_ids[i] == t) return true;
    if (!sp->ignore_eos) {
        const rs_model_config *c = &e->model->cfg;
        for (int i = 0; i < c->n_eos; i++)
            if (c->eos_token_ids[i] == t) return true;
    }
    return false;
}
