/*
 * engine.c — the engine thread: continuous batching over the paged KV cache (engine_internal.h
 * lists the files it is made of).
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
#include "engine_internal.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/kv_calibrate.h"
#include "../model/kv_scales.h"

/* ---------------------------------------------------------------- engine lifecycle */

static int load_static_kv_scales(rs_engine *e, rs_error *err);

int rs_engine_init(rs_engine **out, rs_model *m, const rs_engine_opts *opts, rs_error *err) {
    const rs_model_config *c = &m->cfg;
    const char *missing = rs_backend_missing_op(m->backend);
    if (missing) /* a model only ever runs on a complete backend */
        return rs_error_set(err, RS_EUNSUPPORTED, "device", "the %s backend does not provide op '%s'",
                            rs_backend_name(m->backend), missing);
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
    if (rs_forward_samples(e->fwd)) {
        e->dev_req = rs_xmalloc(sizeof(rs_sample_req) * (size_t)e->max_logits);
        e->dev_res = rs_xmalloc(sizeof(rs_sample_res) * (size_t)e->max_logits);
        e->dev_idx = rs_xmalloc(sizeof(int) * (size_t)e->max_logits);
    }
    /* the capacity is readable (/get_server_info, /metrics) from the moment the pool exists, before
     * /health turns 200 and before any step ran */
    rs_eng_publish_stats(e);
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
    rs_eng_finish_all(e, "server shutting down");
    if (e->pool.layers) rs_kv_pool_free(&e->pool);
    rs_forward_ctx_free(e->fwd);
    rs_sampler_scratch_free(&e->sampler);
    void *bufs[] = {e->b_tokens, e->b_pos, e->b_slot, e->logit_rows, e->b_seq_start, e->b_seq_ctx,
                    e->b_tables, e->step_seqs, e->sampled, e->running, e->logits, e->proc_logits, e->top_ids,
                    e->top_lps, e->inbox, e->progress, e->dev_req, e->dev_res, e->dev_idx};
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
void rs_eng_publish_stats(rs_engine *e) {
    rs_engine_stats st = e->stats;
    rs_kv_stats kv;
    rs_kv_pool_stats(&e->pool, &kv);
    st.kv_blocks_total = kv.n_blocks;
    st.kv_blocks_free = rs_kv_available_blocks(&e->pool);
    st.kv_blocks_cached = kv.n_evictable;
    st.n_running = e->n_running;
    st.n_waiting = e->n_waiting;
    st.waiting_tokens = st.waiting_blocks = 0;
    for (const rs_seq *s = e->wait_head; s; s = s->next) {
        st.waiting_tokens += (uint64_t)s->n_tokens;
        st.waiting_blocks += (uint64_t)blocks_for(s->n_tokens);
    }
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

void rs_engine_run_until_idle(rs_engine *e) {
    RS_ASSERT(!e->thread_started);
    while (rs_eng_step_boundary(e, false)) rs_eng_step(e);
}

bool rs_engine_step_once(rs_engine *e) {
    RS_ASSERT(!e->thread_started);
    if (!rs_eng_step_boundary(e, false)) return false;
    rs_eng_step(e);
    return true;
}

static void *engine_main(void *arg) {
    rs_engine *e = arg;
    for (;;) {
        bool work = rs_eng_step_boundary(e, true);
        pthread_mutex_lock(&e->mu);
        bool stop = e->stop;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
        if (work) {
            rs_eng_step(e);
            rs_eng_publish_stats(e); /* so an idle engine's stats show its last step */
        }
    }
    rs_eng_finish_all(e, "server shutting down");
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
