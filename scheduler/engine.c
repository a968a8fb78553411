/*
 * engine.c — the engine thread: turns submitted jobs into sequences and runs forward steps over
 * every running sequence at once until each finishes.
 *
 * Walking-skeleton scheduling, kept deliberately simple (the engine issue replaces it with the
 * real scheduler): a sequence is admitted, first come first served, once the KV pool can hold its
 * whole prompt plus max_new_tokens, so nothing is ever preempted. Each step takes every running
 * sequence's pending tokens (one decode token, or the next prefill chunk) up to max_step_tokens
 * rows, runs one batched forward pass, then samples for each sequence whose tokens are all
 * computed.
 *
 * Threading: rs_engine_submit is the only entry point called from other threads; it appends to
 * `inbox` under `mu`. Everything else (sequences, KV pool, forward buffers) belongs to whichever
 * thread runs the steps: the engine thread, or the caller of rs_engine_run_until_idle.
 */
#include "engine.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kvcache/kvcache.h"
#include "sampler.h"

typedef struct rs_seq {
    rs_gen_job *job;
    rs_gen_output *out;
    int sample_index;           /* s of outputs[p * n + s] */
    int32_t *tokens;            /* [cap] prompt then generated tokens */
    int n_tokens, cap;
    int prompt_len;
    int n_computed;             /* tokens whose K/V are in the cache */
    rs_kv_seq kv;
    struct rs_seq *next;
} rs_seq;

struct rs_engine {
    rs_model *model;            /* borrowed */
    rs_engine_opts opts;
    rs_kv_pool pool;
    rs_forward_ctx *fwd;
    rs_sampler_scratch sampler;
    char weight_version[64];

    /* step buffers, sized once: rows = max_step_tokens, logits rows = max_logits */
    int32_t *b_tokens, *b_pos, *b_slot, *b_seq_start, *b_seq_ctx, *b_tables;
    int32_t *logit_rows;
    float *logits;              /* [max_step_tokens][vocab] host */
    int max_blocks_per_seq;
    int max_logits;             /* rows of logits per step: every decode row plus some scoring */
    rs_seq **step_seqs;         /* [max_running] sequences in this step's batch */

    rs_seq *waiting;            /* FIFO of sequences not yet admitted */
    rs_seq *running;
    int n_running;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    rs_gen_job **inbox;         /* jobs submitted since the last step, under mu */
    int n_inbox, cap_inbox;
    int n_jobs_open;            /* jobs accepted and not yet finished (engine side) */
    bool stop;
    bool thread_started;
    pthread_t thread;
};

/* ---------------------------------------------------------------- jobs */

rs_gen_job *rs_gen_job_new(void) {
    rs_gen_job *job = rs_xcalloc(1, sizeof *job);
    rs_sampling_params_default(&job->sp);
    job->logprob_start_len = -1;
    return job;
}

void rs_gen_job_free(rs_gen_job *job) {
    if (!job) return;
    for (int i = 0; i < job->n_prompts; i++) free(job->prompts ? job->prompts[i] : NULL);
    free(job->prompts);
    free(job->prompt_lens);
    free(job->sp.stop_token_ids);
    if (job->outputs) {
        for (int i = 0; i < job->n_prompts * job->sp.n; i++) {
            free(job->outputs[i].output_ids);
            free(job->outputs[i].output_logprobs);
            free(job->outputs[i].input_logprobs);
        }
    }
    free(job->outputs);
    free(job);
}

int rs_gen_job_validate(const rs_gen_job *job, const rs_model_config *cfg, const rs_engine_limits *lim,
                        rs_error *err) {
    const rs_sampling_params *sp = &job->sp;
    if (job->n_prompts <= 0) return rs_error_set(err, RS_EINVAL, "input_ids", "input_ids must not be empty");
    if (sp->n < 1 || sp->n > lim->max_n)
        return rs_error_set(err, RS_EINVAL, "sampling_params.n", "sampling_params.n must be in [1, %d], got %d",
                            lim->max_n, sp->n);
    if ((long)job->n_prompts * sp->n > lim->max_batch)
        return rs_error_set(err, RS_EINVAL, "input_ids",
                            "%d prompts x n=%d sequences exceeds the per-request limit of %d",
                            job->n_prompts, sp->n, lim->max_batch);
    if (sp->max_new_tokens < 0 || sp->max_new_tokens > lim->max_new_tokens)
        return rs_error_set(err, RS_EINVAL, "sampling_params.max_new_tokens",
                            "sampling_params.max_new_tokens must be in [0, %d], got %d", lim->max_new_tokens,
                            sp->max_new_tokens);
    if (sp->min_new_tokens < 0 || sp->min_new_tokens > sp->max_new_tokens)
        return rs_error_set(err, RS_EINVAL, "sampling_params.min_new_tokens",
                            "sampling_params.min_new_tokens must be in [0, max_new_tokens=%d], got %d",
                            sp->max_new_tokens, sp->min_new_tokens);
    for (int i = 0; i < sp->n_stop_token_ids; i++) {
        if (sp->stop_token_ids[i] < 0 || sp->stop_token_ids[i] >= cfg->vocab_size)
            return rs_error_set(err, RS_EINVAL, "sampling_params.stop_token_ids",
                                "stop token id %d is outside the vocabulary [0, %d)", sp->stop_token_ids[i],
                                cfg->vocab_size);
    }
    for (int p = 0; p < job->n_prompts; p++) {
        char param[64];
        snprintf(param, sizeof param, job->batched ? "input_ids[%d]" : "input_ids", p);
        int len = job->prompt_lens[p];
        if (len <= 0) return rs_error_set(err, RS_EINVAL, param, "%s must not be empty", param);
        for (int i = 0; i < len; i++) {
            int32_t t = job->prompts[p][i];
            if (t < 0 || t >= cfg->vocab_size)
                return rs_error_set(err, RS_EINVAL, param, "%s[%d] = %d is outside the vocabulary [0, %d)", param,
                                    i, t, cfg->vocab_size);
        }
        if ((long)len + sp->max_new_tokens > lim->max_context)
            return rs_error_set(err, RS_EINVAL, param,
                                "%s has %d tokens; with max_new_tokens=%d that exceeds the context limit of %d",
                                param, len, sp->max_new_tokens, lim->max_context);
        if (job->logprob_start_len >= len)
            return rs_error_set(err, RS_EINVAL, "logprob_start_len",
                                "logprob_start_len=%d must be less than the prompt length %d",
                                job->logprob_start_len, len);
    }
    if (job->logprob_start_len < -1)
        return rs_error_set(err, RS_EINVAL, "logprob_start_len", "logprob_start_len must be >= -1, got %d",
                            job->logprob_start_len);
    return RS_OK;
}

/* ---------------------------------------------------------------- engine lifecycle */

int rs_engine_init(rs_engine **out, rs_model *m, const rs_engine_opts *opts, rs_error *err) {
    const rs_model_config *c = &m->cfg;
    rs_engine *e = rs_xcalloc(1, sizeof *e);
    e->model = m;
    e->opts = *opts;
    if (e->opts.max_running < 1) e->opts.max_running = 1;
    if (e->opts.max_step_tokens < e->opts.max_running) e->opts.max_step_tokens = e->opts.max_running;
    if (e->opts.limits.max_context <= 0 || e->opts.limits.max_context > c->max_position)
        e->opts.limits.max_context = c->max_position;
    snprintf(e->weight_version, sizeof e->weight_version, "%s", opts->weight_version ? opts->weight_version : "0");
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);

    int rc = rs_kv_pool_init(&e->pool, m->backend, c->n_layers, c->n_kv_heads, c->head_dim, RS_DTYPE_F32,
                             opts->kv_cache_bytes);
    if (rc != RS_OK) {
        rs_error_set(err, rc, "kv-cache-mb", "cannot allocate the KV cache (%zu bytes)", opts->kv_cache_bytes);
        goto fail;
    }
    int T = e->opts.max_step_tokens;
    e->max_logits = e->opts.max_running + 64;
    e->fwd = rs_forward_ctx_init(m, T, e->max_logits);
    if (!e->fwd) {
        rc = rs_error_set(err, RS_ENOMEM, "max-step-tokens", "cannot allocate activations for %d tokens", T);
        goto fail;
    }
    e->max_blocks_per_seq = (e->opts.limits.max_context + RS_KV_BLOCK - 1) / RS_KV_BLOCK;
    e->b_tokens = rs_xmalloc(sizeof(int32_t) * (size_t)T);
    e->b_pos = rs_xmalloc(sizeof(int32_t) * (size_t)T);
    e->b_slot = rs_xmalloc(sizeof(int32_t) * (size_t)T);
    e->logit_rows = rs_xmalloc(sizeof(int32_t) * (size_t)e->max_logits);
    e->b_seq_start = rs_xmalloc(sizeof(int32_t) * (size_t)(e->opts.max_running + 1));
    e->b_seq_ctx = rs_xmalloc(sizeof(int32_t) * (size_t)e->opts.max_running);
    e->b_tables = rs_xmalloc(sizeof(int32_t) * (size_t)e->opts.max_running * (size_t)e->max_blocks_per_seq);
    e->step_seqs = rs_xmalloc(sizeof(rs_seq *) * (size_t)e->opts.max_running);
    e->logits = rs_xmalloc(sizeof(float) * (size_t)e->max_logits * (size_t)c->vocab_size);
    RS_INFO("engine: kv pool %d blocks x %d tokens (%.1f MiB, %s), max_running=%d max_step_tokens=%d "
            "max_context=%d",
            e->pool.n_blocks, RS_KV_BLOCK, (double)e->pool.bytes / (1 << 20), rs_dtype_name(e->pool.dtype),
            e->opts.max_running, T, e->opts.limits.max_context);
    *out = e;
    return RS_OK;
fail:
    rs_engine_free(e);
    return rc;
}

static void finish_all(rs_engine *e, const char *why);

void rs_engine_free(rs_engine *e) {
    if (!e) return;
    rs_engine_stop(e);
    finish_all(e, "server shutting down");
    if (e->pool.layers) rs_kv_pool_free(&e->pool);
    rs_forward_ctx_free(e->fwd);
    rs_sampler_scratch_free(&e->sampler);
    free(e->b_tokens);
    free(e->b_pos);
    free(e->b_slot);
    free(e->logit_rows);
    free(e->b_seq_start);
    free(e->b_seq_ctx);
    free(e->b_tables);
    free(e->step_seqs);
    free(e->logits);
    free(e->inbox);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

void rs_engine_get_stats(const rs_engine *e, rs_engine_stats *out) {
    out->kv_blocks_total = e->pool.n_blocks;
    out->kv_blocks_free = e->pool.n_free;
    out->n_running = e->n_running;
    out->n_waiting = 0;
    for (const rs_seq *s = e->waiting; s; s = s->next) out->n_waiting++;
}

const rs_model_config *rs_engine_model_config(const rs_engine *e) { return &e->model->cfg; }
const rs_engine_limits *rs_engine_get_limits(const rs_engine *e) { return &e->opts.limits; }
const char *rs_engine_weight_version(const rs_engine *e) { return e->weight_version; }

int rs_engine_submit(rs_engine *e, rs_gen_job *job, rs_error *err) {
    pthread_mutex_lock(&e->mu);
    if (e->stop) {
        pthread_mutex_unlock(&e->mu);
        return rs_error_set(err, RS_EBUSY, NULL, "the engine is shutting down");
    }
    if (e->n_inbox == e->cap_inbox) {
        e->cap_inbox = e->cap_inbox ? e->cap_inbox * 2 : 16;
        e->inbox = rs_xrealloc(e->inbox, sizeof(rs_gen_job *) * (size_t)e->cap_inbox);
    }
    job->t_arrival = job->t_arrival > 0 ? job->t_arrival : rs_now_s();
    e->inbox[e->n_inbox++] = job;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return RS_OK;
}

/* ---------------------------------------------------------------- sequences */

static void seq_push_token(rs_seq *s, int32_t t) {
    if (s->n_tokens == s->cap) {
        s->cap = s->cap * 2 + 16;
        s->tokens = rs_xrealloc(s->tokens, sizeof(int32_t) * (size_t)s->cap);
    }
    s->tokens[s->n_tokens++] = t;
}

static void out_push(rs_gen_output *o, int32_t tok, float lp) {
    if (o->n_output == o->cap) {
        o->cap = o->cap * 2 + 16;
        o->output_ids = rs_xrealloc(o->output_ids, sizeof(int32_t) * (size_t)o->cap);
        o->output_logprobs = rs_xrealloc(o->output_logprobs, sizeof(float) * (size_t)o->cap);
    }
    o->output_ids[o->n_output] = tok;
    o->output_logprobs[o->n_output] = lp;
    o->n_output++;
}

static void append_seq(rs_seq **list, rs_seq *s) {
    s->next = NULL;
    while (*list) list = &(*list)->next;
    *list = s;
}

/* Expands a job into its sequences, appended to the waiting queue. */
static void admit_job(rs_engine *e, rs_gen_job *job) {
    int n = job->sp.n;
    job->outputs = rs_xcalloc((size_t)job->n_prompts * (size_t)n, sizeof(rs_gen_output));
    snprintf(job->weight_version, sizeof job->weight_version, "%s", e->weight_version);
    e->n_jobs_open++;
    for (int p = 0; p < job->n_prompts; p++) {
        for (int si = 0; si < n; si++) {
            rs_seq *s = rs_xcalloc(1, sizeof *s);
            s->job = job;
            s->out = &job->outputs[p * n + si];
            s->sample_index = si;
            s->prompt_len = job->prompt_lens[p];
            s->out->prompt_tokens = s->prompt_len;
            for (int i = 0; i < s->prompt_len; i++) seq_push_token(s, job->prompts[p][i]);
            if (job->logprob_start_len >= 0) {
                s->out->n_input_logprobs = s->prompt_len - job->logprob_start_len;
                s->out->input_logprobs = rs_xmalloc(sizeof(float) * (size_t)s->out->n_input_logprobs);
                for (int i = 0; i < s->out->n_input_logprobs; i++) s->out->input_logprobs[i] = NAN;
            }
            append_seq(&e->waiting, s);
        }
    }
}

static bool job_finished(const rs_gen_job *job) {
    for (int i = 0; i < job->n_prompts * job->sp.n; i++)
        if (job->outputs[i].finish.type == RS_FINISH_NONE) return false;
    return true;
}

/* Marks s finished, returns its pages, and completes its job when it was the last sequence. */
static void finish_seq(rs_engine *e, rs_seq *s, rs_finish_type type, int32_t matched, const char *msg) {
    rs_gen_output *o = s->out;
    o->finish.type = type;
    o->finish.matched = matched;
    o->finish.length = o->n_output;
    if (msg) snprintf(o->finish.message, sizeof o->finish.message, "%s", msg);
    o->e2e_latency = rs_now_s() - s->job->t_arrival;
    rs_kv_seq_release(&e->pool, &s->kv);
    rs_gen_job *job = s->job;
    free(s->tokens);
    free(s);
    if (job_finished(job)) {
        e->n_jobs_open--;
        if (job->on_done) job->on_done(job, job->on_done_user);
    }
}

static void finish_all(rs_engine *e, const char *why) {
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < e->n_inbox; i++) admit_job(e, e->inbox[i]);
    e->n_inbox = 0;
    pthread_mutex_unlock(&e->mu);
    rs_seq **lists[] = {&e->running, &e->waiting};
    for (size_t i = 0; i < RS_ARRAY_LEN(lists); i++) {
        while (*lists[i]) {
            rs_seq *s = *lists[i];
            *lists[i] = s->next;
            finish_seq(e, s, RS_FINISH_ABORT, -1, why);
        }
    }
    e->n_running = 0;
}

static bool is_stop_token(const rs_engine *e, const rs_sampling_params *sp, int32_t t) {
    for (int i = 0; i < sp->n_stop_token_ids; i++)
        if (sp->stop_token_ids[i] == t) return true;
    if (!sp->ignore_eos) {
        const rs_model_config *c = &e->model->cfg;
        for (int i = 0; i < c->n_eos; i++)
            if (c->eos_token_ids[i] == t) return true;
    }
    return false;
}

/* Moves waiting sequences into the running set while the pool can hold their whole budget
 * (prompt + max_new_tokens), so a running sequence never runs out of pages. A sequence that could
 * never fit, even in an empty pool, is aborted. */
static void admit_waiting(rs_engine *e) {
    while (e->waiting && e->n_running < e->opts.max_running) {
        rs_seq *s = e->waiting;
        if (s->job->sp.max_new_tokens == 0 && s->job->logprob_start_len < 0) { /* nothing to compute */
            e->waiting = s->next;
            finish_seq(e, s, RS_FINISH_LENGTH, -1, NULL);
            continue;
        }
        int budget = s->prompt_len + s->job->sp.max_new_tokens;
        if (budget > e->opts.limits.max_context) budget = e->opts.limits.max_context;
        int need = (budget + RS_KV_BLOCK - 1) / RS_KV_BLOCK;
        if (need > e->pool.n_blocks) {
            e->waiting = s->next;
            RS_WARN("rid %s | needs %d KV blocks, pool has %d", s->job->rid, need, e->pool.n_blocks);
            finish_seq(e, s, RS_FINISH_ABORT, -1, "request needs more KV cache than the server has");
            continue;
        }
        if (rs_kv_seq_reserve(&e->pool, &s->kv, budget) != RS_OK) break; /* wait for pages */
        e->waiting = s->next;
        append_seq(&e->running, s);
        e->n_running++;
    }
}

/* ---------------------------------------------------------------- one step */

/* Rows a sequence contributes this step and whether the step ends with its tokens all computed. */
static int seq_rows_wanted(const rs_seq *s) { return s->n_tokens - s->n_computed; }

/* Prompt rows whose logits score prompt tokens: row at position p scores token p+1. */
static bool row_scores_prompt(const rs_seq *s, int pos) {
    int start = s->job->logprob_start_len;
    return start >= 0 && pos + 1 >= RS_MAX(start, 1) && pos + 1 < s->prompt_len;
}

static bool wants_sample(const rs_seq *s) { return s->out->n_output < s->job->sp.max_new_tokens; }

static void handle_logits(rs_engine *e, rs_seq *s, int pos, const float *logits) {
    const rs_model_config *c = &e->model->cfg;
    const rs_sampling_params *sp = &s->job->sp;
    if (pos + 1 < s->prompt_len) { /* prompt scoring */
        int32_t next = s->tokens[pos + 1];
        s->out->input_logprobs[pos + 1 - s->job->logprob_start_len] =
            rs_logprob_of(logits, c->vocab_size, sp->temperature, next);
        return;
    }
    RS_ASSERT(wants_sample(s));
    float lp;
    int32_t tok = rs_sample(logits, c->vocab_size, sp, (uint64_t)s->sample_index, (uint64_t)s->n_tokens,
                            &e->sampler, &lp);
    out_push(s->out, tok, lp);
    seq_push_token(s, tok);
}

/* Checks the finish conditions of a sequence that just sampled (or has nothing to sample). */
static bool check_finished(rs_engine *e, rs_seq *s) {
    const rs_sampling_params *sp = &s->job->sp;
    rs_gen_output *o = s->out;
    if (o->n_output > 0) {
        int32_t last = o->output_ids[o->n_output - 1];
        if (o->n_output > sp->min_new_tokens && is_stop_token(e, sp, last)) {
            finish_seq(e, s, RS_FINISH_STOP, last, NULL);
            return true;
        }
    }
    if (o->n_output >= sp->max_new_tokens || s->n_tokens >= e->opts.limits.max_context) {
        finish_seq(e, s, RS_FINISH_LENGTH, -1, NULL);
        return true;
    }
    return false;
}

/* Runs one batched forward step over the running set. Returns the number of rows computed. */
static int engine_step(rs_engine *e) {
    const rs_model_config *c = &e->model->cfg;
    int budget = e->opts.max_step_tokens;
    int n_tok = 0, n_seq = 0, n_logits = 0;
    e->b_seq_start[0] = 0;

    /* Decode rows first (one row each), then prefill chunks, in running order. A chunk also ends
     * early when the step's logits buffer is full (prompt scoring asks for a row of logits per
     * prompt token). */
    for (int pass = 0; pass < 2; pass++) {
        for (rs_seq *s = e->running; s && n_tok < budget; s = s->next) {
            int want = seq_rows_wanted(s);
            bool decode = want == 1 && s->n_computed >= s->prompt_len;
            if (want <= 0 || decode != (pass == 0)) continue;
            int limit = RS_MIN(want, budget - n_tok), rows = 0;
            while (rows < limit) {
                int pos = s->n_computed + rows;
                bool need = row_scores_prompt(s, pos) || (pos + 1 == s->n_tokens && wants_sample(s));
                if (need && n_logits == e->max_logits) break;
                e->b_tokens[n_tok] = s->tokens[pos];
                e->b_pos[n_tok] = pos;
                e->b_slot[n_tok] = rs_kv_slot(&s->kv, pos);
                if (need) e->logit_rows[n_logits++] = n_tok;
                n_tok++;
                rows++;
            }
            if (rows == 0) continue;
            e->step_seqs[n_seq] = s;
            e->b_seq_ctx[n_seq] = s->n_computed + rows;
            memcpy(e->b_tables + (size_t)n_seq * e->max_blocks_per_seq, s->kv.blocks,
                   sizeof(int32_t) * (size_t)s->kv.n_blocks);
            n_seq++;
            e->b_seq_start[n_seq] = n_tok;
        }
    }
    if (n_tok == 0) return 0;

    /* logit_rows must be ascending: rows were appended in order within each pass, and decode
     * rows (pass 0) all precede prefill rows (pass 1). */
    rs_batch batch = {.n_tok = n_tok, .n_seq = n_seq, .tokens = e->b_tokens, .pos = e->b_pos,
                      .slot = e->b_slot, .seq_start = e->b_seq_start, .seq_ctx = e->b_seq_ctx,
                      .block_tables = e->b_tables, .max_blocks = e->max_blocks_per_seq};
    rs_forward(e->fwd, &batch, e->pool.layers, e->logit_rows, n_logits, e->logits);

    int li = 0;
    for (int si = 0; si < n_seq; si++) {
        rs_seq *s = e->step_seqs[si];
        int r0 = e->b_seq_start[si], r1 = e->b_seq_start[si + 1];
        for (; li < n_logits && e->logit_rows[li] < r1; li++) {
            int r = e->logit_rows[li];
            RS_ASSERT(r >= r0);
            handle_logits(e, s, e->b_pos[r], e->logits + (size_t)li * c->vocab_size);
        }
        s->n_computed += r1 - r0;
    }
    /* Finish checks after every sequence has consumed its logits. */
    rs_seq **link = &e->running;
    while (*link) {
        rs_seq *s = *link;
        bool ready = s->n_computed >= s->prompt_len && seq_rows_wanted(s) <= 1;
        bool sampled = s->n_tokens > s->prompt_len || s->job->sp.max_new_tokens == 0;
        if (ready && sampled && (*link = s->next, check_finished(e, s))) {
            e->n_running--;
            continue;
        }
        *link = s;
        link = &s->next;
    }
    return n_tok;
}

/* Moves submitted jobs into the waiting queue. Returns true if the engine has any work. */
static bool take_inbox(rs_engine *e, bool block) {
    pthread_mutex_lock(&e->mu);
    while (block && !e->stop && e->n_inbox == 0 && !e->running && !e->waiting)
        pthread_cond_wait(&e->cv, &e->mu);
    rs_gen_job **jobs = e->inbox;
    int n = e->n_inbox;
    e->inbox = NULL;
    e->n_inbox = e->cap_inbox = 0;
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < n; i++) admit_job(e, jobs[i]);
    free(jobs);
    return e->running || e->waiting;
}

static void run_once(rs_engine *e) {
    admit_waiting(e);
    engine_step(e);
}

void rs_engine_run_until_idle(rs_engine *e) {
    RS_ASSERT(!e->thread_started);
    while (take_inbox(e, false)) run_once(e);
}

static void *engine_main(void *arg) {
    rs_engine *e = arg;
    for (;;) {
        bool work = take_inbox(e, true);
        pthread_mutex_lock(&e->mu);
        bool stop = e->stop;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
        if (work) run_once(e);
    }
    finish_all(e, "server shutting down");
    return NULL;
}

int rs_engine_start(rs_engine *e) {
    RS_ASSERT(!e->thread_started);
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) return RS_EINTERNAL;
    e->thread_started = true;
    return RS_OK;
}

void rs_engine_stop(rs_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->stop = true;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (e->thread_started) {
        pthread_join(e->thread, NULL);
        e->thread_started = false;
    }
}
