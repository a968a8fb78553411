/*
 * engine.c — the engine thread: continuous batching over the paged KV cache.
 *
 * Every step the engine
 *   1. applies aborts and admits newly submitted jobs to the waiting queue;
 *   2. makes sure every decoding sequence has a writable page for its next token; when the pool
 *      runs out it preempts the newest running sequence (its pages are freed and it goes back to
 *      the front of the queue, to be recomputed from its tokens later: "retraction");
 *   3. admits waiting sequences, oldest first, while the pool can hold their prompt plus a share
 *      (admission_new_token_ratio) of the growth of everything running, so preemption stays
 *      rare; a prompt's leading full blocks come from the prefix cache when they are there;
 *   4. runs one forward pass over decode rows first, then prefill chunks, within max_step_tokens;
 *   5. samples (after the sequence's penalties over its own output, scheduler/penalties.h), scores
 *      prompt tokens, fans a prompt out to its n samples (one shared prefill, the pages forked, the
 *      partial last page copied on first write), registers full blocks in the prefix cache, and
 *      finishes sequences (stop token, EOS, a text stop reported by the job's on_token hook,
 *      max_new_tokens, context limit).
 *
 * Reproducibility: a token's random draw is keyed by (sampling_seed, sample index, position) and
 * every op computes each row independently of the others in the batch, so a request produces the
 * same tokens alone, batched, chunked, or preempted and recomputed.
 *
 * Threading: rs_engine_submit and rs_engine_abort are the only entry points for other threads;
 * they append to the inbox under `mu`. Everything else (sequences, KV pool, forward buffers)
 * belongs to whichever thread runs the steps: the engine thread, or the caller of
 * rs_engine_run_until_idle.
 */
#include "engine.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/kv_calibrate.h"
#include "../kvcache/kvcache.h"
#include "../model/kv_scales.h"
#include "penalties.h"
#include "sampler.h"

typedef struct rs_seq {
    rs_gen_job *job;
    rs_gen_output *out;
    int prompt_index, sample_index;
    int32_t *tokens;            /* [cap] prompt then generated tokens */
    int n_tokens, cap;
    int prompt_len;
    int n_computed;             /* tokens whose K/V are in the cache */
    int n_forks;                /* group leader: samples still to fork when its prompt completes */
    uint64_t order;             /* admission order: larger is newer (preempted first) */
    double t_last_token;        /* for inter-token latency */
    bool admitted_once;
    rs_kv_seq kv;
    rs_penalty_counts pen;      /* its output tokens, counted when the job asks for penalties */
    int stop_text;              /* 1 + the text stop job->on_token reported for its last token, 0 = none */
    struct rs_seq *next;        /* waiting queue */
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
    float *logits;              /* [max_logits][vocab] host */
    int max_blocks_per_seq;
    int max_logits;             /* rows of logits per step: every decode row plus some scoring */
    rs_seq **step_seqs;         /* [max_running] sequences in this step's batch */
    rs_seq **sampled;           /* [max_running] sequences that sampled this step */
    int32_t *top_ids;           /* [max_top] scratch */
    float *top_lps;
    float *proc_logits;         /* [vocab] a row after the logits-processing step (process_logits) */

    rs_seq *wait_head, *wait_tail;
    int n_waiting;
    rs_seq **running;           /* [max_running], oldest first */
    int n_running;
    uint64_t next_order;
    rs_engine_stats stats;

    pthread_mutex_t stats_mu;
    rs_engine_stats published;  /* under stats_mu: what rs_engine_get_stats returns */
    rs_gen_job **progress;      /* [max_running] jobs whose outputs grew this step */
    bool paused;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_cond_t ctl_cv;      /* signals finished control requests */
    struct rs_ctl *ctl_head;    /* control requests, under mu */
    rs_gen_job **inbox;         /* jobs submitted since the last step, under mu */
    int n_inbox, cap_inbox;
    char **abort_rids;          /* under mu */
    int n_abort_rids;
    bool abort_all;
    bool stop;
    bool thread_started;
    pthread_t thread;
};

static int blocks_for(int tokens) { return (tokens + RS_KV_BLOCK - 1) / RS_KV_BLOCK; }

/* A control request from another thread, applied at a step boundary (see apply_control). */
typedef enum rs_ctl_kind { RS_CTL_PAUSE, RS_CTL_CONTINUE, RS_CTL_FLUSH, RS_CTL_WEIGHTS, RS_CTL_VERSION } rs_ctl_kind;
typedef struct rs_ctl {
    rs_ctl_kind kind;
    int arg;                    /* RS_CTL_PAUSE: rs_pause_mode */
    const rs_weight_swap *swap; /* RS_CTL_WEIGHTS */
    const char *version;        /* RS_CTL_VERSION */
    double seconds;             /* RS_CTL_WEIGHTS: time the step loop was held */
    rs_error *err;
    int rc;
    bool done;
    struct rs_ctl *next;
} rs_ctl;

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
            rs_gen_output *o = &job->outputs[i];
            free(o->output_ids);
            free(o->output_logprobs);
            free(o->output_top_ids);
            free(o->output_top_lps);
            free(o->input_logprobs);
            free(o->input_top_ids);
            free(o->input_top_lps);
            free(o->spans);
        }
    }
    free(job->outputs);
    free(job);
}

static int invalid(rs_gen_invalid *why, rs_gen_field field, rs_gen_problem problem, long long value, long long min,
                   long long max) {
    *why = (rs_gen_invalid){.field = field, .problem = problem, .index = -1, .pos = -1, .value = value,
                            .min = min, .max = max};
    return RS_EINVAL;
}

int rs_gen_job_validate(const rs_gen_job *job, const rs_model_config *cfg, const rs_engine_limits *lim,
                        rs_gen_invalid *why) {
    const rs_sampling_params *sp = &job->sp;
    if (job->n_prompts <= 0) return invalid(why, RS_GEN_FIELD_PROMPTS, RS_GEN_EMPTY, 0, 1, 0);
    if (sp->n < 1 || sp->n > lim->max_n) return invalid(why, RS_GEN_FIELD_N, RS_GEN_RANGE, sp->n, 1, lim->max_n);
    if ((long long)job->n_prompts * sp->n > lim->max_batch) {
        invalid(why, RS_GEN_FIELD_PROMPTS, RS_GEN_BATCH, job->n_prompts, 1, lim->max_batch);
        why->other = sp->n;
        return RS_EINVAL;
    }
    if (sp->max_new_tokens < 0 || sp->max_new_tokens > lim->max_new_tokens)
        return invalid(why, RS_GEN_FIELD_MAX_NEW_TOKENS, RS_GEN_RANGE, sp->max_new_tokens, 0, lim->max_new_tokens);
    if (sp->min_new_tokens < 0 || sp->min_new_tokens > sp->max_new_tokens)
        return invalid(why, RS_GEN_FIELD_MIN_NEW_TOKENS, RS_GEN_RANGE, sp->min_new_tokens, 0, sp->max_new_tokens);
    if (job->top_logprobs_num < 0 || job->top_logprobs_num > lim->max_top_logprobs)
        return invalid(why, RS_GEN_FIELD_TOP_LOGPROBS, RS_GEN_RANGE, job->top_logprobs_num, 0,
                       lim->max_top_logprobs);
    for (int i = 0; i < sp->n_stop_token_ids; i++) {
        if (sp->stop_token_ids[i] < 0 || sp->stop_token_ids[i] >= cfg->vocab_size) {
            invalid(why, RS_GEN_FIELD_STOP_TOKEN_IDS, RS_GEN_VOCAB, sp->stop_token_ids[i], 0, cfg->vocab_size);
            why->pos = i;
            return RS_EINVAL;
        }
    }
    if (sp->min_new_tokens > 0 && sp->n_stop_token_ids + cfg->n_eos >= cfg->vocab_size) {
        /* every token masked until min_new_tokens: nothing could be sampled */
        uint8_t *seen = rs_xcalloc((size_t)cfg->vocab_size, 1);
        int distinct = 0;
        for (int i = 0; i < sp->n_stop_token_ids + cfg->n_eos; i++) {
            const int32_t t = i < sp->n_stop_token_ids ? sp->stop_token_ids[i] : cfg->eos_token_ids[i - sp->n_stop_token_ids];
            if (t >= 0 && t < cfg->vocab_size && !seen[t]) {
                seen[t] = 1;
                distinct++;
            }
        }
        free(seen);
        if (distinct >= cfg->vocab_size) {
            invalid(why, RS_GEN_FIELD_STOP_TOKEN_IDS, RS_GEN_ALL_MASKED, distinct, 0, cfg->vocab_size);
            why->other = sp->min_new_tokens;
            return RS_EINVAL;
        }
    }
    for (int p = 0; p < job->n_prompts; p++) {
        int len = job->prompt_lens[p], rc = RS_OK;
        if (len <= 0) rc = invalid(why, RS_GEN_FIELD_PROMPT, RS_GEN_EMPTY, 0, 1, 0);
        for (int i = 0; rc == RS_OK && i < len; i++) {
            int32_t t = job->prompts[p][i];
            if (t < 0 || t >= cfg->vocab_size) {
                rc = invalid(why, RS_GEN_FIELD_PROMPT, RS_GEN_VOCAB, t, 0, cfg->vocab_size);
                why->pos = i;
            }
        }
        if (rc == RS_OK && (long long)len + sp->max_new_tokens > lim->max_context) {
            rc = invalid(why, RS_GEN_FIELD_PROMPT, RS_GEN_CONTEXT, len, 0, lim->max_context);
            why->other = sp->max_new_tokens;
        }
        if (rc != RS_OK) {
            why->index = job->batched ? p : -1;
            return rc;
        }
        if (job->logprob_start_len >= len)
            return invalid(why, RS_GEN_FIELD_LOGPROB_START, RS_GEN_PAST_PROMPT, job->logprob_start_len, -1, len);
    }
    if (job->logprob_start_len < -1)
        return invalid(why, RS_GEN_FIELD_LOGPROB_START, RS_GEN_RANGE, job->logprob_start_len, -1, INT_MAX);
    return RS_OK;
}

/* ---------------------------------------------------------------- engine lifecycle */

static int load_static_kv_scales(rs_engine *e, rs_error *err);
static void publish_stats(rs_engine *e);

int rs_engine_init(rs_engine **out, rs_model *m, const rs_engine_opts *opts, rs_error *err) {
    const rs_model_config *c = &m->cfg;
    const char *missing = rs_backend_missing_op(m->backend);
    if (missing) /* a model only ever runs on a complete backend */
        return rs_error_set(err, RS_EUNSUPPORTED, "device", "the %s backend does not provide op '%s'",
                            m->backend->ops->name, missing);
    rs_engine *e = rs_xcalloc(1, sizeof *e);
    e->model = m;
    e->opts = *opts;
    if (e->opts.max_running < 1) e->opts.max_running = 1;
    if (e->opts.max_step_tokens < e->opts.max_running) e->opts.max_step_tokens = e->opts.max_running;
    if (e->opts.limits.max_context <= 0 || e->opts.limits.max_context > c->max_position)
        e->opts.limits.max_context = c->max_position;
    if (e->opts.limits.max_n > e->opts.max_running) { /* a group runs together after its shared prefill */
        RS_WARN("engine: max-n %d exceeds max-running %d; using %d", e->opts.limits.max_n, e->opts.max_running,
                e->opts.max_running);
        e->opts.limits.max_n = e->opts.max_running;
    }
    if (!(e->opts.admission_new_token_ratio >= 0.0f)) e->opts.admission_new_token_ratio = 0.0f;
    if (e->opts.admission_new_token_ratio > 1.0f) e->opts.admission_new_token_ratio = 1.0f;
    snprintf(e->weight_version, sizeof e->weight_version, "%s", opts->weight_version ? opts->weight_version : "0");
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    pthread_cond_init(&e->ctl_cv, NULL);
    pthread_mutex_init(&e->stats_mu, NULL);

    int rc;
    if (opts->kv_dtype != RS_DTYPE_E4M3) {
        e->opts.kv_scales = RS_KV_SCALES_NONE;
    } else if (opts->kv_scales == RS_KV_SCALES_NONE) {
        rc = rs_error_set(err, RS_EINVAL, "kv-scale-mode", "an FP8 KV cache needs a scale source (dynamic, "
                          "calibrate or static)");
        goto fail;
    }
    rs_kv_cache_opts ko = {.dtype = opts->kv_dtype, .scale_mode = rs_kv_scales_storage(e->opts.kv_scales)};
    rc = rs_kv_pool_init_ex(&e->pool, m->backend, c->n_layers, c->n_kv_heads, c->head_dim, &ko,
                                opts->kv_cache_bytes);
    if (rc != RS_OK) {
        rs_error_set(err, rc, "kv-cache-mb", "cannot allocate the KV cache (%zu bytes, %s)", opts->kv_cache_bytes,
                     rs_dtype_name(ko.dtype));
        goto fail;
    }
    if ((rc = e->opts.kv_scales == RS_KV_SCALES_STATIC ? load_static_kv_scales(e, err) : rs_engine_calibrate_kv(e, err)) !=
        RS_OK)
        goto fail;
    int T = e->opts.max_step_tokens, R = e->opts.max_running;
    e->max_logits = R + 64;
    e->fwd = rs_forward_ctx_init(m, T, e->max_logits);
    if (!e->fwd) {
        rc = rs_error_set(err, RS_ENOMEM, "max-step-tokens", "cannot allocate activations for %d tokens", T);
        goto fail;
    }
    e->max_blocks_per_seq = blocks_for(e->opts.limits.max_context);
    e->b_tokens = rs_xmalloc(sizeof(int32_t) * (size_t)T);
    e->b_pos = rs_xmalloc(sizeof(int32_t) * (size_t)T);
    e->b_slot = rs_xmalloc(sizeof(int32_t) * (size_t)T);
    e->logit_rows = rs_xmalloc(sizeof(int32_t) * (size_t)e->max_logits);
    e->b_seq_start = rs_xmalloc(sizeof(int32_t) * (size_t)(R + 1));
    e->b_seq_ctx = rs_xmalloc(sizeof(int32_t) * (size_t)R);
    e->b_tables = rs_xmalloc(sizeof(int32_t) * (size_t)R * (size_t)e->max_blocks_per_seq);
    e->step_seqs = rs_xmalloc(sizeof(rs_seq *) * (size_t)R);
    e->sampled = rs_xmalloc(sizeof(rs_seq *) * (size_t)R);
    e->running = rs_xmalloc(sizeof(rs_seq *) * (size_t)R);
    e->progress = rs_xmalloc(sizeof(rs_gen_job *) * (size_t)R);
    e->logits = rs_xmalloc(sizeof(float) * (size_t)e->max_logits * (size_t)c->vocab_size);
    int max_top = RS_MAX(e->opts.limits.max_top_logprobs, 1);
    e->top_ids = rs_xmalloc(sizeof(int32_t) * (size_t)max_top);
    e->top_lps = rs_xmalloc(sizeof(float) * (size_t)max_top);
    e->proc_logits = rs_xmalloc(sizeof(float) * (size_t)c->vocab_size);
    /* the capacity is readable (/get_server_info, /metrics) from the moment the pool exists, before
     * /health turns 200 and before any step ran */
    publish_stats(e);
    RS_INFO("engine: kv pool %d blocks x %d tokens (%.1f MiB, %s), max_running=%d max_step_tokens=%d "
            "max_context=%d prefix_cache=%s admission_new_token_ratio=%.2f",
            e->pool.n_blocks, RS_KV_BLOCK, (double)e->pool.bytes / (1 << 20), rs_dtype_name(e->pool.dtype), R, T,
            e->opts.limits.max_context, e->opts.prefix_cache ? "on" : "off", e->opts.admission_new_token_ratio);
    *out = e;
    return RS_OK;
fail:
    rs_engine_free(e);
    return rc;
}

static void finish_all(rs_engine *e, const char *why);

/* Per-head FP8 KV scales from the checkpoint, once at start ("static" mode). */
static int load_static_kv_scales(rs_engine *e, rs_error *err) {
    const rs_model_config *c = &e->model->cfg;
    size_t n = (size_t)c->n_layers * (size_t)c->n_kv_heads;
    float *k = rs_xmalloc(sizeof(float) * n), *v = rs_xmalloc(sizeof(float) * n);
    int rc = rs_model_load_kv_scales(e->model->path, c, k, v, err);
    if (rc == RS_OK && (rc = rs_kv_pool_set_scales(&e->pool, k, v)) != RS_OK)
        rs_error_set(err, rc, "kv-scale-mode", "the checkpoint's KV scales are unusable");
    if (rc == RS_OK) RS_INFO("kv cache: %zu static per-head FP8 scales from %s", n, e->model->path);
    free(k);
    free(v);
    return rc;
}

rs_kv_scales rs_engine_kv_scales(const rs_engine *e) { return e->opts.kv_scales; }

int rs_engine_calibrate_kv_on(const rs_engine *e, const rs_model *m, float *k, float *v, rs_error *err) {
    const rs_model_config *c = &m->cfg;
    rs_kv_calib_opts co = {.tokens = NULL, .n_tokens = RS_MIN(e->opts.kv_calib_tokens, c->max_position),
                           .percentile = e->opts.kv_calib_percentile > 0 ? e->opts.kv_calib_percentile : 1.0f,
                           .margin = e->opts.kv_calib_margin > 0 ? e->opts.kv_calib_margin : 1.0f};
    const double t0 = rs_now_s();
    int rc = rs_kv_calibrate(m, &co, k, v, err);
    if (rc == RS_OK) {
        const size_t n = (size_t)c->n_layers * (size_t)c->n_kv_heads;
        float kmax = 0, vmax = 0;
        for (size_t i = 0; i < n; i++) {
            kmax = fmaxf(kmax, k[i]);
            vmax = fmaxf(vmax, v[i]);
        }
        RS_INFO("kv cache: calibrated %zu per-head FP8 scales (percentile %.4g, margin %.3g) in %.2f s; "
                "max k_scale %.4g, v_scale %.4g",
                n, co.percentile, co.margin, rs_now_s() - t0, kmax, vmax);
    }
    return rc;
}

int rs_engine_calibrate_kv(rs_engine *e, rs_error *err) {
    const rs_model_config *c = &e->model->cfg;
    if (e->opts.kv_scales != RS_KV_SCALES_CALIBRATE) return RS_OK;
    size_t n = (size_t)c->n_layers * (size_t)c->n_kv_heads;
    float *k = rs_xmalloc(sizeof(float) * n), *v = rs_xmalloc(sizeof(float) * n);
    int rc = rs_engine_calibrate_kv_on(e, e->model, k, v, err);
    if (rc == RS_OK && (rc = rs_kv_pool_set_scales(&e->pool, k, v)) != RS_OK)
        rs_error_set(err, rc, "kv-cache-dtype", "calibration produced unusable KV scales");
    free(k);
    free(v);
    return rc;
}

void rs_engine_free(rs_engine *e) {
    if (!e) return;
    rs_engine_stop(e);
    finish_all(e, "server shutting down");
    if (e->pool.layers) rs_kv_pool_free(&e->pool);
    rs_forward_ctx_free(e->fwd);
    rs_sampler_scratch_free(&e->sampler);
    void *bufs[] = {e->b_tokens, e->b_pos, e->b_slot, e->logit_rows, e->b_seq_start, e->b_seq_ctx,
                    e->b_tables, e->step_seqs, e->sampled, e->running, e->logits, e->proc_logits, e->top_ids,
                    e->top_lps, e->inbox, e->progress};
    for (size_t i = 0; i < RS_ARRAY_LEN(bufs); i++) free(bufs[i]);
    for (int i = 0; i < e->n_abort_rids; i++) free(e->abort_rids[i]);
    free(e->abort_rids);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    pthread_cond_destroy(&e->ctl_cv);
    pthread_mutex_destroy(&e->stats_mu);
    free(e);
}

/* Publishes the engine thread's counters for rs_engine_get_stats. */
static void publish_stats(rs_engine *e) {
    rs_engine_stats st = e->stats;
    st.kv_blocks_total = e->pool.n_blocks;
    st.kv_blocks_free = rs_kv_available_blocks(&e->pool);
    st.kv_blocks_cached = e->pool.n_evictable;
    st.n_running = e->n_running;
    st.n_waiting = e->n_waiting;
    st.waiting_tokens = st.waiting_blocks = 0;
    for (const rs_seq *s = e->wait_head; s; s = s->next) {
        st.waiting_tokens += (uint64_t)s->n_tokens;
        st.waiting_blocks += (uint64_t)blocks_for(s->n_tokens);
    }
    st.prefix_hit_tokens = e->pool.hit_tokens;
    st.paused = e->paused;
    pthread_mutex_lock(&e->stats_mu);
    e->published = st;
    pthread_mutex_unlock(&e->stats_mu);
}

void rs_engine_get_stats(const rs_engine *e, rs_engine_stats *out) {
    pthread_mutex_lock((pthread_mutex_t *)&e->stats_mu);
    *out = e->published;
    pthread_mutex_unlock((pthread_mutex_t *)&e->stats_mu);
}

const rs_model_config *rs_engine_model_config(const rs_engine *e) { return &e->model->cfg; }
const rs_engine_limits *rs_engine_get_limits(const rs_engine *e) { return &e->opts.limits; }
const char *rs_engine_weight_version(const rs_engine *e) {
    static _Thread_local char copy[64]; /* the engine thread rewrites e->weight_version under stats_mu */
    pthread_mutex_lock((pthread_mutex_t *)&e->stats_mu);
    snprintf(copy, sizeof copy, "%s", e->weight_version);
    pthread_mutex_unlock((pthread_mutex_t *)&e->stats_mu);
    return copy;
}

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

void rs_engine_abort(rs_engine *e, const char *rid) {
    pthread_mutex_lock(&e->mu);
    if (!rid) {
        e->abort_all = true;
    } else {
        e->abort_rids = rs_xrealloc(e->abort_rids, sizeof(char *) * (size_t)(e->n_abort_rids + 1));
        e->abort_rids[e->n_abort_rids++] = rs_xstrdup(rid);
    }
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* ---------------------------------------------------------------- sequences and outputs */

static void seq_push_token(rs_seq *s, int32_t t) {
    if (s->n_tokens == s->cap) {
        s->cap = s->cap * 2 + 16;
        s->tokens = rs_xrealloc(s->tokens, sizeof(int32_t) * (size_t)s->cap);
    }
    s->tokens[s->n_tokens++] = t;
}

static void out_push(rs_gen_output *o, int k, int32_t tok, float lp, const int32_t *top_ids, const float *top_lps) {
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

static void out_copy_scoring(rs_gen_output *dst, const rs_gen_output *src, int k) {
    int n = src->n_input_logprobs;
    if (n == 0) return;
    memcpy(dst->input_logprobs, src->input_logprobs, sizeof(float) * (size_t)n);
    if (k > 0) {
        memcpy(dst->input_top_ids, src->input_top_ids, sizeof(int32_t) * (size_t)n * k);
        memcpy(dst->input_top_lps, src->input_top_lps, sizeof(float) * (size_t)n * k);
    }
}

static rs_seq *seq_new(rs_gen_job *job, int p, int si) {
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

static void wait_push_front(rs_engine *e, rs_seq *s) {
    s->next = e->wait_head;
    e->wait_head = s;
    if (!e->wait_tail) e->wait_tail = s;
    e->n_waiting++;
}

static rs_seq *wait_pop_front(rs_engine *e) {
    rs_seq *s = e->wait_head;
    e->wait_head = s->next;
    if (!e->wait_head) e->wait_tail = NULL;
    s->next = NULL;
    e->n_waiting--;
    return s;
}

static void running_remove(rs_engine *e, rs_seq *s) {
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
static void admit_job(rs_engine *e, rs_gen_job *job) {
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
        rs_seq *s = seq_new(job, p, 0);
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
static void finish_seq(rs_engine *e, rs_seq *s, rs_finish_type type, int32_t matched, const char *msg) {
    rs_gen_job *job = s->job;
    set_finish(s->out, type, matched, msg, job->t_arrival);
    for (int k = 1; k <= s->n_forks; k++) { /* siblings that never started: same prompt, same fate */
        rs_gen_output *o = &job->outputs[s->prompt_index * job->sp.n + k];
        out_copy_scoring(o, s->out, job->top_logprobs_num);
        o->cached_tokens = s->n_computed >= s->prompt_len ? s->prompt_len : 0;
        set_finish(o, type == RS_FINISH_STOP ? RS_FINISH_LENGTH : type, -1, msg, job->t_arrival);
    }
    rs_kv_seq_release(&e->pool, &s->kv);
    rs_penalty_counts_free(&s->pen);
    free(s->tokens);
    free(s);
    if (!job_finished(job)) return;
    rs_histogram_observe(&e->stats.e2e, rs_now_s() - job->t_arrival);
    e->stats.requests_finished++;
    for (int i = 0; i < job->n_prompts * job->sp.n; i++) {
        if (job->outputs[i].finish.type == RS_FINISH_ABORT) {
            e->stats.requests_aborted++;
            break;
        }
    }
    if (job->on_done) job->on_done(job, job->on_done_user);
}

static void finish_running(rs_engine *e, rs_seq *s, rs_finish_type type, int32_t matched, const char *msg) {
    running_remove(e, s);
    finish_seq(e, s, type, matched, msg);
}

static bool rid_matches(char **rids, int n, bool all, const rs_gen_job *job) {
    if (all) return !job->probe;
    for (int i = 0; i < n; i++)
        if (strcmp(rids[i], job->rid) == 0) return true;
    return false;
}

/* Finishes with "abort" (`why`) every running and waiting sequence whose job rid_matches. */
static void abort_matching(rs_engine *e, char **rids, int n_rids, bool all, const char *why) {
    for (int i = e->n_running - 1; i >= 0; i--) {
        rs_seq *s = e->running[i];
        if (rid_matches(rids, n_rids, all, s->job)) finish_running(e, s, RS_FINISH_ABORT, -1, why);
    }
    rs_seq **link = &e->wait_head;
    e->wait_tail = NULL;
    while (*link) {
        rs_seq *s = *link;
        if (rid_matches(rids, n_rids, all, s->job)) {
            *link = s->next;
            e->n_waiting--;
            finish_seq(e, s, RS_FINISH_ABORT, -1, why);
        } else {
            e->wait_tail = s;
            link = &s->next;
        }
    }
}

/* Moves submitted jobs into the waiting queue and applies pending aborts. Returns true if the
 * engine has any sequence to run. */
static void apply_control(rs_engine *e, rs_ctl *c);

static bool take_inbox(rs_engine *e, bool block) {
    pthread_mutex_lock(&e->mu);
    while (block && !e->stop && e->n_inbox == 0 && e->n_abort_rids == 0 && !e->abort_all && !e->ctl_head &&
           (e->paused || (!e->n_running && !e->wait_head)))
        pthread_cond_wait(&e->cv, &e->mu);
    rs_ctl *ctl = e->ctl_head;
    e->ctl_head = NULL;
    rs_gen_job **jobs = e->inbox;
    int n = e->n_inbox;
    char **rids = e->abort_rids;
    int n_rids = e->n_abort_rids;
    bool all = e->abort_all;
    e->inbox = NULL;
    e->n_inbox = e->cap_inbox = 0;
    e->abort_rids = NULL;
    e->n_abort_rids = 0;
    e->abort_all = false;
    pthread_mutex_unlock(&e->mu);

    for (int i = 0; i < n; i++) admit_job(e, jobs[i]);
    free(jobs);
    if (n_rids > 0 || all) abort_matching(e, rids, n_rids, all, "aborted");
    for (int i = 0; i < n_rids; i++) free(rids[i]);
    free(rids);
    if (ctl) {
        for (rs_ctl *c = ctl; c; c = c->next) apply_control(e, c);
        publish_stats(e); /* before the requester wakes: it may read the stats at once */
        pthread_mutex_lock(&e->mu);
        for (rs_ctl *c = ctl; c; c = c->next) c->done = true;
        pthread_cond_broadcast(&e->ctl_cv);
        pthread_mutex_unlock(&e->mu);
    }
    publish_stats(e);
    return !e->paused && (e->n_running > 0 || e->wait_head);
}

static void finish_all(rs_engine *e, const char *why) {
    take_inbox(e, false);
    while (e->n_running > 0) finish_running(e, e->running[e->n_running - 1], RS_FINISH_ABORT, -1, why);
    while (e->wait_head) finish_seq(e, wait_pop_front(e), RS_FINISH_ABORT, -1, why);
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

/* ---------------------------------------------------------------- admission and preemption */

static bool wants_sample(const rs_seq *s) { return s->out->n_output < s->job->sp.max_new_tokens; }

static bool is_decode(const rs_seq *s) {
    return s->n_computed >= s->prompt_len && s->n_computed == s->n_tokens - 1;
}

/* The admission estimate, the one place it is made: the pages s is expected to need beyond the
 * `held` it holds, for its tokens so far plus admission_new_token_ratio of the new tokens it may
 * still sample, capped at max_context (where the engine stops every sequence). */
static int blocks_needed(const rs_engine *e, const rs_seq *s, int held) {
    int remaining = s->job->sp.max_new_tokens - s->out->n_output;
    int target = s->n_tokens + (int)ceilf((float)remaining * e->opts.admission_new_token_ratio);
    if (target > e->opts.limits.max_context) target = e->opts.limits.max_context;
    int need = blocks_for(target) - held;
    return need > 0 ? need : 0;
}

/* Preempts s by recompute: its pages go back to the pool (full blocks stay in the prefix cache),
 * and it waits at the front of the queue to prefill its tokens again. */
static void preempt(rs_engine *e, rs_seq *s) {
    running_remove(e, s);
    rs_kv_seq_release(&e->pool, &s->kv);
    s->n_computed = 0;
    s->out->num_retractions++;
    e->stats.num_retractions++;
    RS_DEBUG("rid %s | preempted sample %d at %d tokens (%d running)", s->job->rid, s->sample_index, s->n_tokens,
             e->n_running);
    wait_push_front(e, s);
}

/* Gives every decoding sequence a writable page for its next token, preempting the newest running
 * sequences while the pool is short. Returns true if anything was preempted. */
static bool ensure_decode_pages(rs_engine *e) {
    bool preempted = false;
    for (int i = 0; i < e->n_running; i++) {
        rs_seq *s = e->running[i];
        if (!is_decode(s)) continue;
        for (;;) {
            int rc = rs_kv_seq_reserve(&e->pool, &s->kv, s->n_computed + 1);
            if (rc == RS_OK) rc = rs_kv_seq_prepare_write(&e->pool, &s->kv, s->n_computed);
            if (rc == RS_OK) break;
            rs_seq *victim = e->running[e->n_running - 1];
            preempt(e, victim);
            preempted = true;
            if (victim == s) break;
        }
    }
    return preempted;
}

/* Tokens of s that may come from the prefix cache: never the positions whose logits are still
 * needed to score prompt tokens. */
static int cacheable_tokens(const rs_seq *s) {
    int start = s->job->logprob_start_len;
    if (start >= 0 && s->out->n_input_logprobs > 0 && isnan(s->out->input_logprobs[s->out->n_input_logprobs - 1]))
        return RS_MIN(s->n_tokens, start); /* the row before position `start` must be computed */
    return s->n_tokens;
}

/* Admits waiting sequences, oldest first, while the estimate says they fit. */
static void admit_waiting(rs_engine *e) {
    int slots = 0; /* running plus siblings still to fork */
    int reserved = 0;
    for (int i = 0; i < e->n_running; i++) {
        slots += 1 + e->running[i]->n_forks;
        reserved += blocks_needed(e, e->running[i], e->running[i]->kv.n_blocks) * (1 + e->running[i]->n_forks);
    }
    while (e->wait_head) {
        rs_seq *s = e->wait_head;
        if (s->job->sp.max_new_tokens == 0 && s->job->logprob_start_len < 0) { /* nothing to compute */
            wait_pop_front(e);
            finish_seq(e, s, RS_FINISH_LENGTH, -1, NULL);
            continue;
        }
        if (slots + 1 + s->n_forks > e->opts.max_running && e->n_running > 0) break;
        int budget = s->prompt_len + s->job->sp.max_new_tokens;
        if (blocks_for(RS_MIN(budget, e->opts.limits.max_context)) > e->pool.n_blocks) {
            wait_pop_front(e);
            RS_WARN("rid %s | needs %d KV blocks, the pool has %d", s->job->rid,
                    blocks_for(RS_MIN(budget, e->opts.limits.max_context)), e->pool.n_blocks);
            finish_seq(e, s, RS_FINISH_ABORT, -1, "request needs more KV cache than the server has");
            continue;
        }
        if (s->kv.n_blocks == 0 && e->opts.prefix_cache) {
            int hit = rs_kv_seq_match_prefix(&e->pool, &s->kv, s->tokens, cacheable_tokens(s));
            s->n_computed = hit;
            if (!s->admitted_once) s->out->cached_tokens = RS_MIN(hit, s->prompt_len);
        }
        int own = blocks_for(s->n_tokens) - s->kv.n_blocks;      /* pages for the tokens it has */
        int growth = blocks_needed(e, s, blocks_for(s->n_tokens)); /* and for what it may sample */
        int need = own + growth * (1 + s->n_forks) + s->n_forks; /* + one copied page per sibling */
        if (e->n_running > 0 && rs_kv_available_blocks(&e->pool) - reserved < need) break;
        if (rs_kv_seq_reserve(&e->pool, &s->kv, s->n_tokens) != RS_OK) break;
        wait_pop_front(e);
        s->order = e->next_order++;
        s->admitted_once = true;
        e->running[e->n_running++] = s;
        slots += 1 + s->n_forks;
        reserved += growth * (1 + s->n_forks);
    }
    if (e->n_running > e->stats.peak_running) e->stats.peak_running = e->n_running;
}

/* ---------------------------------------------------------------- one step */

/* Prompt rows whose logits score prompt tokens: row at position p scores token p + 1. */
static bool row_scores_prompt(const rs_seq *s, int pos) {
    int start = s->job->logprob_start_len;
    if (start < 0 || pos + 1 < RS_MAX(start, 1) || pos + 1 >= s->prompt_len) return false;
    return isnan(s->out->input_logprobs[pos + 1 - start]); /* not yet scored (recompute skips it) */
}

/* A bug found while producing a job's outputs (a logits row with a NaN or +inf, a NaN logprob):
 * the job is failed whole, never served. Its sequences are aborted at the next step boundary and
 * the server answers 500 with job->error. */
static void fail_job(rs_engine *e, rs_gen_job *job, const char *what, int pos) {
    if (job->error.code == RS_OK) {
        rs_error_set(&job->error, RS_EINTERNAL, NULL,
                     "internal error: %s at position %d (weight version '%s'); the request is failed rather than "
                     "served", what, pos, e->weight_version);
        RS_ERROR("rid %s | %s", job->rid, job->error.message);
    }
    rs_engine_abort(e, job->rid);
}

/* Stop tokens a sequence may not sample yet: before min_new_tokens outputs, every token that
 * would stop it is masked, as SGLang's MinNewTokensPenalizer and vLLM's min_tokens do (both mask
 * the stop ids and the model's EOS ids, ignore_eos or not). */
static bool masks_stop_tokens(const rs_engine *e, const rs_seq *s) {
    const rs_sampling_params *sp = &s->job->sp;
    return s->out->n_output < sp->min_new_tokens && (sp->n_stop_token_ids > 0 || e->model->cfg.n_eos > 0);
}

/* The logits-processing step between the forward pass and the sampler: the row s samples from.
 * It is the model's own row when nothing changes it, else a copy in e->proc_logits (the row of
 * e->logits may be shared by a whole n-sample group) with s's penalties over its output so far
 * (scheduler/penalties.h) and, before min_new_tokens outputs, its stop tokens masked. The raw row
 * stays for logprobs_mode "raw". */
static const float *process_logits(rs_engine *e, const rs_seq *s, const float *logits) {
    const bool mask = masks_stop_tokens(e, s), penalize = s->pen.n > 0;
    if (!mask && !penalize) return logits;
    const rs_model_config *c = &e->model->cfg;
    const rs_sampling_params *sp = &s->job->sp;
    memcpy(e->proc_logits, logits, sizeof(float) * (size_t)c->vocab_size);
    if (penalize) rs_penalties_apply(sp, &s->pen, e->proc_logits);
    if (mask) {
        for (int i = 0; i < sp->n_stop_token_ids; i++) e->proc_logits[sp->stop_token_ids[i]] = -INFINITY;
        for (int i = 0; i < c->n_eos; i++) e->proc_logits[c->eos_token_ids[i]] = -INFINITY;
    }
    return e->proc_logits;
}

/* The logprob of `tok` and its top alternatives under the job's logprobs mode: "raw" reads the
 * model's row, the others the processed one (what was sampled from: penalties applied, stop
 * tokens masked before min_new_tokens). NaN when a row is invalid;
 * every top entry written is finite or -inf otherwise. */
static float logprob_in_mode(rs_engine *e, const rs_seq *s, const float *raw_logits, const float *logits, int32_t tok,
                             const rs_sample_info *sampled) {
    const rs_gen_job *job = s->job;
    int V = e->model->cfg.vocab_size, k = job->top_logprobs_num;
    rs_sampling_params raw = job->sp;
    raw.temperature = 0.0f; /* rs_top_logprobs and rs_logprob_of read a greedy T as T = 1 */
    float lp;
    switch (job->logprobs_mode) {
    case RS_LOGPROBS_RAW:
        lp = rs_logprob_of(raw_logits, V, 0.0f, tok, &e->sampler);
        break;
    case RS_LOGPROBS_PROCESSED:
        lp = sampled ? sampled->logprob_processed : rs_logprob_processed(logits, V, &job->sp, tok, &e->sampler);
        break;
    default:
        lp = sampled ? sampled->logprob : rs_logprob_of(logits, V, job->sp.temperature, tok, &e->sampler);
        break;
    }
    if (k > 0) {
        for (int i = 0; i < k; i++) {
            e->top_ids[i] = -1;
            e->top_lps[i] = NAN;
        }
        const bool is_raw = job->logprobs_mode == RS_LOGPROBS_RAW;
        if (rs_top_logprobs(is_raw ? raw_logits : logits, V, is_raw ? &raw : &job->sp,
                            job->logprobs_mode == RS_LOGPROBS_PROCESSED, k, &e->sampler, e->top_ids, e->top_lps) < 0)
            lp = NAN;
        for (int i = 0; i < k; i++)
            if (e->top_ids[i] >= 0 && isnan(e->top_lps[i])) lp = NAN;
    }
    return lp;
}

/* Samples s's next token from logits; false (nothing pushed, the job failed) on a bug. */
static bool sample_into(rs_engine *e, rs_seq *s, const float *logits) {
    RS_ASSERT(wants_sample(s));
    const float *proc = process_logits(e, s, logits);
    rs_sample_info info;
    int32_t tok = rs_sample(proc, e->model->cfg.vocab_size, &s->job->sp, (uint64_t)s->sample_index,
                            (uint64_t)s->n_tokens, &e->sampler, &info);
    float lp = tok >= 0 ? logprob_in_mode(e, s, logits, proc, tok, &info) : NAN;
    if (isnan(lp)) {
        fail_job(e, s->job, tok < 0 ? "the logits hold a NaN or +inf" : "a logprob came out NaN", s->n_tokens);
        return false;
    }
    out_push(s->out, s->job->top_logprobs_num, tok, lp, e->top_ids, e->top_lps);
    seq_push_token(s, tok);
    if (rs_penalties_active(&s->job->sp)) rs_penalty_counts_add(&s->pen, tok);
    rs_gen_job *job = s->job;
    if (job->on_token && !is_stop_token(e, &job->sp, tok)) { /* a stop token ends it anyway */
        int k = job->on_token(job, (int)(s->out - job->outputs), tok, job->on_token_user);
        if (k >= 0) s->stop_text = k + 1;
    }
    e->stats.generation_tokens++;
    double now = rs_now_s();
    if (s->job->t_first_token == 0) {
        s->job->t_first_token = now;
        rs_histogram_observe(&e->stats.ttft, now - s->job->t_arrival);
    } else if (s->t_last_token > 0) {
        rs_histogram_observe(&e->stats.itl, now - s->t_last_token);
    }
    s->t_last_token = now;
    return true;
}

/* The group leader's prompt is computed: its siblings start from its pages and sample their
 * first token from the same logits. */
static void fan_out(rs_engine *e, rs_seq *leader, const float *logits, int *n_sampled) {
    rs_gen_job *job = leader->job;
    for (int k = 1; k <= leader->n_forks; k++) {
        rs_seq *c = seq_new(job, leader->prompt_index, k);
        rs_kv_seq_fork(&e->pool, &leader->kv, &c->kv);
        c->n_computed = leader->prompt_len;
        c->admitted_once = true;
        c->order = e->next_order++;
        c->out->cached_tokens = leader->prompt_len;
        out_copy_scoring(c->out, leader->out, job->top_logprobs_num);
        const bool ok = sample_into(e, c, logits);
        RS_ASSERT(e->n_running < e->opts.max_running); /* admission kept a slot for every sibling */
        e->running[e->n_running++] = c; /* a failed one holds pages too: the job's abort frees them */
        if (ok) e->sampled[(*n_sampled)++] = c;
    }
    leader->n_forks = 0;
}

static void handle_logits(rs_engine *e, rs_seq *s, int pos, const float *logits, int *n_sampled) {
    const rs_gen_job *job = s->job;
    if (pos + 1 < s->prompt_len) { /* prompt scoring */
        int i = pos + 1 - job->logprob_start_len, k = job->top_logprobs_num;
        const float lp = logprob_in_mode(e, s, logits, logits, s->tokens[pos + 1], NULL);
        if (isnan(lp)) { /* left NaN ("not scored"): the job's abort ends the sequence */
            fail_job(e, s->job, "a prompt logprob came out NaN (the logits hold a NaN or +inf)", pos + 1);
            return;
        }
        s->out->input_logprobs[i] = lp;
        if (k > 0) {
            memcpy(s->out->input_top_ids + (size_t)i * k, e->top_ids, sizeof(int32_t) * (size_t)k);
            memcpy(s->out->input_top_lps + (size_t)i * k, e->top_lps, sizeof(float) * (size_t)k);
        }
        return;
    }
    if (s->n_forks > 0) fan_out(e, s, logits, n_sampled);
    if (sample_into(e, s, logits)) e->sampled[(*n_sampled)++] = s;
}

/* Checks the finish conditions of a sequence that just sampled. */
static void check_finished(rs_engine *e, rs_seq *s) {
    const rs_sampling_params *sp = &s->job->sp;
    rs_gen_output *o = s->out;
    int32_t last = o->output_ids[o->n_output - 1];
    if (is_stop_token(e, sp, last)) { /* none before min_new_tokens: process_logits masked them */
        finish_running(e, s, RS_FINISH_STOP, last, NULL);
    } else if (s->stop_text > 0) { /* a text stop (job->on_token) */
        o->finish.matched_text = s->stop_text;
        finish_running(e, s, RS_FINISH_STOP, -1, NULL);
    } else if (o->n_output >= sp->max_new_tokens || s->n_tokens >= e->opts.limits.max_context)
        finish_running(e, s, RS_FINISH_LENGTH, -1, NULL);
}

/* Appends s's next rows (up to `limit`) to the batch. */
static void add_rows(rs_engine *e, rs_seq *s, int limit, int *n_tok, int *n_seq, int *n_logits) {
    int rows = 0;
    while (rows < limit) {
        int pos = s->n_computed + rows;
        bool need = row_scores_prompt(s, pos) || (pos + 1 == s->n_tokens && wants_sample(s));
        if (need && *n_logits == e->max_logits) break;
        e->b_tokens[*n_tok] = s->tokens[pos];
        e->b_pos[*n_tok] = pos;
        e->b_slot[*n_tok] = rs_kv_slot(&s->kv, pos);
        if (need) e->logit_rows[(*n_logits)++] = *n_tok;
        (*n_tok)++;
        rows++;
    }
    if (rows == 0) return;
    e->step_seqs[*n_seq] = s;
    e->b_seq_ctx[*n_seq] = s->n_computed + rows;
    memcpy(e->b_tables + (size_t)*n_seq * e->max_blocks_per_seq, s->kv.blocks,
           sizeof(int32_t) * (size_t)s->kv.n_blocks);
    (*n_seq)++;
    e->b_seq_start[*n_seq] = *n_tok;
}

/* Runs one step. Returns the number of rows computed. */
static int engine_step(rs_engine *e) {
    const rs_model_config *c = &e->model->cfg;
    if (!ensure_decode_pages(e)) admit_waiting(e);

    int budget = e->opts.max_step_tokens;
    int n_tok = 0, n_seq = 0, n_logits = 0;
    e->b_seq_start[0] = 0;
    /* decode rows first, then prefill chunks, oldest sequences first */
    for (int i = 0; i < e->n_running && n_tok < budget; i++)
        if (is_decode(e->running[i])) add_rows(e, e->running[i], 1, &n_tok, &n_seq, &n_logits);
    for (int i = 0; i < e->n_running && n_tok < budget; i++) {
        rs_seq *s = e->running[i];
        int want = s->n_tokens - s->n_computed;
        if (want > 0 && !is_decode(s)) add_rows(e, s, RS_MIN(want, budget - n_tok), &n_tok, &n_seq, &n_logits);
    }
    if (n_tok == 0) return 0;

    /* logit_rows is ascending: rows are appended in order and never revisited */
    rs_batch batch = {.n_tok = n_tok, .n_seq = n_seq, .tokens = e->b_tokens, .pos = e->b_pos,
                      .slot = e->b_slot, .seq_start = e->b_seq_start, .seq_ctx = e->b_seq_ctx,
                      .block_tables = e->b_tables, .max_blocks = e->max_blocks_per_seq};
    rs_forward(e->fwd, &batch, e->pool.layers, e->logit_rows, n_logits, e->logits);
    e->stats.steps++;

    int li = 0, n_sampled = 0;
    for (int si = 0; si < n_seq; si++) {
        rs_seq *s = e->step_seqs[si];
        int r0 = e->b_seq_start[si], r1 = e->b_seq_start[si + 1];
        bool prefill = s->n_computed < s->prompt_len;
        if (prefill) e->stats.prompt_tokens += (uint64_t)RS_MIN(r1 - r0, s->prompt_len - s->n_computed);
        s->n_computed += r1 - r0;
        for (; li < n_logits && e->logit_rows[li] < r1; li++) {
            RS_ASSERT(e->logit_rows[li] >= r0);
            handle_logits(e, s, e->b_pos[e->logit_rows[li]], e->logits + (size_t)li * c->vocab_size, &n_sampled);
        }
        if (e->opts.prefix_cache) rs_kv_seq_commit(&e->pool, &s->kv, s->tokens, s->n_computed);
        /* a prompt scored with max_new_tokens = 0 is done once computed */
        if (!wants_sample(s) && s->n_computed == s->n_tokens) finish_running(e, s, RS_FINISH_LENGTH, -1, NULL);
    }
    /* progress first (streaming sees every token), then finishes (on_done may free the job) */
    int n_progress = 0;
    for (int i = 0; i < n_sampled; i++) {
        rs_gen_job *job = e->sampled[i]->job;
        if (!job->on_progress) continue;
        int j = 0;
        while (j < n_progress && e->progress[j] != job) j++;
        if (j == n_progress) e->progress[n_progress++] = job;
    }
    for (int i = 0; i < n_progress; i++) e->progress[i]->on_progress(e->progress[i], e->progress[i]->on_done_user);
    for (int i = 0; i < n_sampled; i++) check_finished(e, e->sampled[i]);
    return n_tok;
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
 * version, that of the output's first span. */
static void out_restart_scoring(rs_gen_output *o, int k) {
    const int n = o->n_input_logprobs;
    if (n == 0 || !isnan(o->input_logprobs[n - 1])) return; /* scored in position order: all done */
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
    while (e->n_running > 0) preempt(e, e->running[e->n_running - 1]);
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
            abort_matching(e, NULL, 0, true, "paused"); /* probes stay, and run once generation continues */
        } else if (c->arg == RS_PAUSE_RETRACT) {
            while (e->n_running > 0) preempt(e, e->running[e->n_running - 1]);
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
        publish_stats(e);
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

void rs_engine_run_until_idle(rs_engine *e) {
    RS_ASSERT(!e->thread_started);
    while (take_inbox(e, false)) engine_step(e);
}

bool rs_engine_step_once(rs_engine *e) {
    RS_ASSERT(!e->thread_started);
    if (!take_inbox(e, false)) return false;
    engine_step(e);
    return true;
}

static void *engine_main(void *arg) {
    rs_engine *e = arg;
    for (;;) {
        bool work = take_inbox(e, true);
        pthread_mutex_lock(&e->mu);
        bool stop = e->stop;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
        if (work) {
            engine_step(e);
            publish_stats(e); /* so an idle engine's stats show its last step */
        }
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
    /* control requests that arrived after the thread's last look: answer them */
    pthread_mutex_lock(&e->mu);
    for (rs_ctl *c = e->ctl_head; c; c = c->next) {
        c->rc = RS_EBUSY;
        c->done = true;
    }
    e->ctl_head = NULL;
    pthread_cond_broadcast(&e->ctl_cv);
    pthread_mutex_unlock(&e->mu);
}
