/*
 * invalid.c — rs_gen_invalid as an error in a protocol's words (see invalid.h).
 */
#include "invalid.h"

#include <stdio.h>

int rs_invalid_error(const rs_gen_invalid *why, const rs_invalid_names *names, rs_error *err) {
    const rs_gen_invalid *w = why;
    char prompt[96];
    if (w->index >= 0) snprintf(prompt, sizeof prompt, "%s[%d]", names->prompts, w->index);
    else snprintf(prompt, sizeof prompt, "%s", names->prompts);
    switch (w->field) {
    case RS_GEN_FIELD_PROMPTS:
        if (w->problem == RS_GEN_BATCH)
            return rs_error_set(err, RS_EINVAL, names->prompts,
                                "%lld prompts x n=%lld sequences exceeds the per-request limit of %lld", w->value,
                                w->other, w->max);
        return rs_error_set(err, RS_EINVAL, names->prompts, "%s must not be empty", names->prompts);
    case RS_GEN_FIELD_PROMPT:
        if (w->problem == RS_GEN_VOCAB)
            return rs_error_set(err, RS_EINVAL, prompt, "%s[%d] = %lld is outside the vocabulary [0, %lld)", prompt,
                                w->pos, w->value, w->max);
        if (w->problem == RS_GEN_CONTEXT)
            return rs_error_set(err, RS_EINVAL, prompt,
                                "%s has %lld tokens; with %s=%lld that exceeds the context limit of %lld", prompt,
                                w->value, names->max_new_tokens_short, w->other, w->max);
        return rs_error_set(err, RS_EINVAL, prompt, "%s must not be empty", prompt);
    case RS_GEN_FIELD_N:
        return rs_error_set(err, RS_EINVAL, names->n, "%s must be in [%lld, %lld], got %lld", names->n, w->min, w->max,
                            w->value);
    case RS_GEN_FIELD_MAX_NEW_TOKENS:
        return rs_error_set(err, RS_EINVAL, names->max_new_tokens, "%s must be in [%lld, %lld], got %lld",
                            names->max_new_tokens, w->min, w->max, w->value);
    case RS_GEN_FIELD_MIN_NEW_TOKENS:
        return rs_error_set(err, RS_EINVAL, names->min_new_tokens, "%s must be in [%lld, %s=%lld], got %lld",
                            names->min_new_tokens, w->min, names->max_new_tokens_short, w->max, w->value);
    case RS_GEN_FIELD_TOP_LOGPROBS:
        return rs_error_set(err, RS_EINVAL, names->top_logprobs, "%s must be in [%lld, %lld], got %lld",
                            names->top_logprobs, w->min, w->max, w->value);
    case RS_GEN_FIELD_STOP_TOKEN_IDS:
        if (w->problem == RS_GEN_ALL_MASKED)
            return rs_error_set(err, RS_EINVAL, names->stop_token_ids,
                                "%s and the EOS ids cover the whole vocabulary: with %s=%lld no token could be "
                                "sampled", names->stop_token_ids, names->min_new_tokens, w->other);
        return rs_error_set(err, RS_EINVAL, names->stop_token_ids, "stop token id %lld is outside the vocabulary "
                            "[0, %lld)", w->value, w->max);
    case RS_GEN_FIELD_LOGPROB_START:
        if (w->problem == RS_GEN_PAST_PROMPT)
            return rs_error_set(err, RS_EINVAL, names->logprob_start, "%s=%lld must be less than the prompt length %lld",
                                names->logprob_start, w->value, w->max);
        return rs_error_set(err, RS_EINVAL, names->logprob_start, "%s must be >= %lld, got %lld", names->logprob_start,
                            w->min, w->value);
    }
    return rs_error_set(err, RS_EINVAL, NULL, "invalid request");
}
