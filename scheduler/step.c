/*
 * step.c — one engine step: decode rows first, then prefill chunks, within max_step_tokens; one
 * forward pass; then for every row whose logits matter the logits-processing step (penalties, the
 * min_new_tokens mask), sampling and logprobs, prompt scoring, the fan-out of a group's n samples,
 * the job's on_token hook (text stops), progress callbacks and the finishing checks.
 */
#include "engine_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

/* Whether s has reached max_new_tokens or the context limit with the token just pushed. */
static bool at_length_now(const rs_engine *e, const rs_seq *s) {
    return s->out->n_output >= s->job->sp.max_new_tokens || s->n_tokens >= e->opts.limits.max_context;
}

/* s's sampled token tok with its logprob (and top logprobs in e->top_ids / e->top_lps); false
 * (nothing pushed, the job failed) for an invalid row (tok < 0: the logits hold a NaN or +inf) or
 * a NaN logprob, which are bugs upstream. */
static bool record_sample(rs_engine *e, rs_seq *s, int32_t tok, float lp) {
    if (tok < 0 || isnan(lp)) {
        fail_job(e, s->job, tok < 0 ? "the logits hold a NaN or +inf" : "a logprob came out NaN", s->n_tokens);
        return false;
    }
    rs_eng_out_push(s->out, s->job->top_logprobs_num, tok, lp, e->top_ids, e->top_lps);
    rs_eng_seq_push_token(s, tok);
    if (rs_penalties_active(&s->job->sp)) rs_penalty_counts_add(&s->pen, tok);
    rs_gen_job *job = s->job;
    /* a token that will finish the output "stop" by its id is not text (check_finished); with
     * SGLang's order a stop token that is also the last allowed one finishes "length", and is */
    const bool stops = rs_eng_is_stop_token(e, &job->sp, tok) && !(job->sp.sglang_finish && at_length_now(e, s));
    if (job->on_token && !stops) {
        int k = job->on_token(job, (int)(s->out - job->outputs), tok, job->on_token_user);
        if (k >= 0) s->stop_text = k + 1;
    }
    double now = rs_now_s();
    const bool counted = !job->probe; /* health probes stay out of the request metrics */
    if (counted) e->stats.generation_tokens++;
    if (s->job->t_first_token == 0) {
        s->job->t_first_token = now;
        if (counted) rs_histogram_observe(&e->stats.ttft, now - s->job->t_arrival);
    } else if (s->t_last_token > 0 && counted) {
        rs_histogram_observe(&e->stats.itl, now - s->t_last_token);
    }
    s->t_last_token = now;
    return true;
}

/* Records the kept ids of the token s just sampled, before record_sample pushes it
 * (job->return_top_p_ids): the truncated set rs_sample left in the scratch, the token itself when
 * greedy, none when nothing truncates. False (the job failed with RS_ETOOBIG) when the job's
 * outputs would pass the limit on kept ids together. */
static bool record_kept(rs_engine *e, rs_seq *s, int32_t tok, const rs_sample_info *info) {
    rs_gen_job *job = s->job;
    const bool greedy = rs_sampling_greedy(&job->sp);
    const size_t n = greedy ? 1 : info->n_kept > 0 ? (size_t)info->n_kept : 0;
    const size_t max = e->opts.limits.max_kept_ids ? RS_MIN(e->opts.limits.max_kept_ids, RS_KEPT_IDS_MAX)
                                                   : RS_KEPT_IDS_MAX;
    if (n <= max - job->n_kept_ids) {
        rs_eng_out_push_kept(s->out, greedy ? &tok : e->sampler.idx, n);
        job->n_kept_ids += n;
        return true;
    }
    if (job->error.code == RS_OK)
        rs_error_set(&job->error, RS_ETOOBIG, "custom_params",
                     "return_top_p_token_ids: the request's outputs kept more than %zu token ids together "
                     "(output %d at its token %d); narrow top_p / top_k / min_p, n or max_new_tokens", max,
                     (int)(s->out - job->outputs), s->out->n_output);
    rs_engine_abort(e, job->rid);
    return false;
}

/* Samples s's next token from logits; false (nothing pushed, the job failed) on a bug. */
static bool sample_into(rs_engine *e, rs_seq *s, const float *logits) {
    RS_ASSERT(rs_eng_wants_sample(s));
    const float *proc = process_logits(e, s, logits);
    rs_sample_info info;
    int32_t tok = rs_sample(proc, e->model->cfg.vocab_size, &s->job->sp, (uint64_t)s->sample_index,
                            (uint64_t)s->n_tokens, &e->sampler, &info);
    /* the kept set lives in the scratch, which the top logprobs below reuse: record it first */
    if (tok >= 0 && s->job->return_top_p_ids && !record_kept(e, s, tok, &info)) return false;
    return record_sample(e, s, tok, tok >= 0 ? logprob_in_mode(e, s, logits, proc, tok, &info) : NAN);
}

/* ---- sampling on the device (rs_forward_sample: only tokens and logprobs come back) ---- */

/* Whether the device samples s's row as sample_into would: the row is the model's own (no
 * penalties, no stop tokens masked before min_new_tokens, so process_logits would change nothing). */
static bool device_samples(const rs_engine *e, const rs_seq *s) {
    return !rs_penalties_active(&s->job->sp) && !masks_stop_tokens(e, s) && !s->job->return_top_p_ids;
}

/* Whether the step leaves its logits on the backend: every logits row samples the next token of a
 * sequence (no prompt scoring, no fork to fan out) with top logprobs within the device sampler's
 * limit, and the device samples at least one of them; the host downloads the others' rows. */
static bool device_sampling_step(const rs_engine *e, int n_seq, int n_logits) {
    if (!e->dev_req || n_logits == 0) return false;
    bool any = false;
    for (int si = 0, li = 0; si < n_seq; si++) {
        const rs_seq *s = e->step_seqs[si];
        for (; li < n_logits && e->logit_rows[li] < e->b_seq_start[si + 1]; li++) {
            if (e->b_pos[e->logit_rows[li]] + 1 != s->n_tokens || s->n_forks > 0 ||
                s->job->top_logprobs_num > RS_SAMPLE_MAX_TOP)
                return false;
            any = any || device_samples(e, s);
        }
    }
    return any;
}

/* The request for logits row li, sequence s: sample_into's parameters and key. */
static rs_sample_req device_request(const rs_seq *s, int li) {
    const rs_gen_job *job = s->job;
    return (rs_sample_req){.row = li, .temperature = rs_sampling_greedy(&job->sp) ? 0.0f : job->sp.temperature,
                           .top_p = job->sp.top_p,
                           .min_p = job->sp.min_p, .top_k = job->sp.top_k, .seed = job->sp.seed,
                           .sample_index = (uint64_t)s->sample_index, .position = (uint64_t)s->n_tokens,
                           .lp_mode = job->logprobs_mode == RS_LOGPROBS_RAW         ? RS_SAMPLE_LP_RAW
                                      : job->logprobs_mode == RS_LOGPROBS_PROCESSED ? RS_SAMPLE_LP_PROCESSED
                                                                                    : RS_SAMPLE_LP_DEFAULT,
                           .n_top = job->top_logprobs_num};
}

/* Records what the device sampled for s (top entries past the ones it found: -1 / NaN, as
 * logprob_in_mode leaves them); false as record_sample. */
static bool sample_from_device(rs_engine *e, rs_seq *s, const rs_sample_res *r) {
    RS_ASSERT(rs_eng_wants_sample(s) && r->done);
    for (int i = 0; i < s->job->top_logprobs_num; i++) {
        e->top_ids[i] = i < r->n_top ? r->top_ids[i] : -1;
        e->top_lps[i] = i < r->n_top ? r->top_lps[i] : NAN;
    }
    return record_sample(e, s, r->token, r->logprob);
}

/* The group leader's prompt is computed: its siblings start from its pages and sample their
 * first token from the same logits. */
static void fan_out(rs_engine *e, rs_seq *leader, const float *logits, int *n_sampled) {
    rs_gen_job *job = leader->job;
    for (int k = 1; k <= leader->n_forks; k++) {
        rs_seq *c = rs_eng_seq_new(job, leader->prompt_index, k);
        rs_kv_seq_fork(&e->pool, &leader->kv, &c->kv);
        c->n_computed = leader->prompt_len;
        c->admitted_once = true;
        c->order = e->next_order++;
        c->out->cached_tokens = leader->prompt_len;
        if (!job->probe) e->stats.prefix_hit_tokens += (uint64_t)leader->prompt_len;
        rs_eng_out_copy_scoring(c->out, leader->out, job->top_logprobs_num);
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
    const bool at_length = at_length_now(e, s);
    if (at_length && sp->sglang_finish) {
        rs_eng_finish_running(e, s, RS_FINISH_LENGTH, -1, NULL);
    } else if (rs_eng_is_stop_token(e, sp, last)) { /* none before min_new_tokens: process_logits masked them */
        rs_eng_finish_running(e, s, RS_FINISH_STOP, last, NULL);
    } else if (s->stop_text > 0) { /* a text stop (job->on_token) */
        o->finish.matched_text = s->stop_text;
        rs_eng_finish_running(e, s, RS_FINISH_STOP, -1, NULL);
    } else if (at_length) {
        rs_eng_finish_running(e, s, RS_FINISH_LENGTH, -1, NULL);
    }
}

/* Appends s's next rows (up to `limit`) to the batch. */
static void add_rows(rs_engine *e, rs_seq *s, int limit, int *n_tok, int *n_seq, int *n_logits) {
    int rows = 0;
    while (rows < limit) {
        int pos = s->n_computed + rows;
        bool need = row_scores_prompt(s, pos) || (pos + 1 == s->n_tokens && rs_eng_wants_sample(s));
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
int rs_eng_step(rs_engine *e) {
    const rs_model_config *c = &e->model->cfg;
    if (!rs_eng_ensure_decode_pages(e)) rs_eng_admit_waiting(e);

    int budget = e->opts.max_step_tokens;
    int n_tok = 0, n_seq = 0, n_logits = 0;
    e->b_seq_start[0] = 0;
    /* decode rows first, then prefill chunks, oldest sequences first */
    for (int i = 0; i < e->n_running && n_tok < budget; i++)
        if (rs_eng_is_decode(e->running[i])) add_rows(e, e->running[i], 1, &n_tok, &n_seq, &n_logits);
    for (int i = 0; i < e->n_running && n_tok < budget; i++) {
        rs_seq *s = e->running[i];
        int want = s->n_tokens - s->n_computed;
        if (want > 0 && !rs_eng_is_decode(s)) add_rows(e, s, RS_MIN(want, budget - n_tok), &n_tok, &n_seq, &n_logits);
    }
    if (n_tok == 0) return 0;

    /* logit_rows is ascending: rows are appended in order and never revisited */
    rs_batch batch = {.n_tok = n_tok, .n_seq = n_seq, .tokens = e->b_tokens, .pos = e->b_pos,
                      .slot = e->b_slot, .seq_start = e->b_seq_start, .seq_ctx = e->b_seq_ctx,
                      .block_tables = e->b_tables, .max_blocks = e->max_blocks_per_seq};
    const bool dev = device_sampling_step(e, n_seq, n_logits);
    rs_forward(e->fwd, &batch, e->pool.layers, e->logit_rows, n_logits, dev ? NULL : e->logits);
    if (dev) {
        int n_req = 0;
        for (int si = 0, li = 0; si < n_seq; si++)
            for (; li < n_logits && e->logit_rows[li] < e->b_seq_start[si + 1]; li++) {
                const bool here = device_samples(e, e->step_seqs[si]);
                e->dev_idx[li] = here ? n_req : -1;
                if (here) e->dev_req[n_req++] = device_request(e->step_seqs[si], li);
            }
        rs_forward_sample(e->fwd, e->dev_req, n_req, e->dev_res);
    }
    e->stats.steps++;

    int li = 0, n_sampled = 0;
    for (int si = 0; si < n_seq; si++) {
        rs_seq *s = e->step_seqs[si];
        int r0 = e->b_seq_start[si], r1 = e->b_seq_start[si + 1];
        bool prefill = s->n_computed < s->prompt_len;
        if (prefill && !s->job->probe)
            e->stats.prompt_tokens += (uint64_t)RS_MIN(r1 - r0, s->prompt_len - s->n_computed);
        s->n_computed += r1 - r0;
        for (; li < n_logits && e->logit_rows[li] < r1; li++) {
            RS_ASSERT(e->logit_rows[li] >= r0);
            float *row = e->logits + (size_t)li * c->vocab_size;
            const int di = dev ? e->dev_idx[li] : -1;
            if (di >= 0 && e->dev_res[di].done) {
                if (sample_from_device(e, s, &e->dev_res[di])) e->sampled[n_sampled++] = s;
                continue;
            }
            /* left to the host: a processed row, or a kept prefix longer than the device sorts */
            if (dev) rs_forward_logits_row(e->fwd, li, row);
            handle_logits(e, s, e->b_pos[e->logit_rows[li]], row, &n_sampled);
        }
        if (e->opts.prefix_cache) rs_kv_seq_commit(&e->pool, &s->kv, s->tokens, s->n_computed);
        /* a prompt scored with max_new_tokens = 0 is done once computed */
        if (!rs_eng_wants_sample(s) && s->n_computed == s->n_tokens) rs_eng_finish_running(e, s, RS_FINISH_LENGTH, -1, NULL);
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
