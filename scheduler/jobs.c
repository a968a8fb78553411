/*
 * jobs.c — generation jobs: allocation, freeing, and validation against the model and the
 * engine's limits. Validation answers with data (rs_gen_invalid: field, problem, index, limits);
 * each protocol names the field in its own words (protocol/invalid.h).
 */
#include "engine_internal.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

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
            free(o->kept_ids);
            free(o->kept_offsets);
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
