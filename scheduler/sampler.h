/*
 * sampler.h — next-token sampling and logprobs, a pure function of (logits, params, rng key).
 *
 * The random draw for a token is keyed by (sampling_seed, sample index, position) through a
 * counter-based hash, so a sequence's tokens do not depend on what else shares its batch, on the
 * thread count, or on when it was scheduled.
 *
 * The returned logprob is log_softmax(logits / T)[token] in fp32 over the full vocabulary,
 * before top-k / top-p / min-p truncation (SGLang's default; what trainers recompute). Greedy
 * (T = 0) reports log_softmax(logits)[token].
 */
#ifndef RS_SAMPLER_H
#define RS_SAMPLER_H

#include <stdint.h>

#include "engine.h"

typedef struct rs_sampler_scratch {
    float *probs;       /* [vocab] */
    int32_t *idx;       /* [vocab] */
    int cap;
} rs_sampler_scratch;

void rs_sampler_scratch_free(rs_sampler_scratch *s);

/* Uniform double in [0, 1) from the key, 53 random bits. */
double rs_rng_uniform(uint64_t seed, uint64_t sample_index, uint64_t position);

/* log_softmax(logits / temp)[token], temp <= 0 meaning 1. Accumulates in double. */
float rs_logprob_of(const float *logits /* [vocab] */, int vocab, float temp, int32_t token);

/* What rs_sample reports besides the token. */
typedef struct rs_sample_info {
    float logprob;              /* log_softmax(logits / T)[token] (T = 1 when greedy) */
    float logprob_processed;    /* log of the token's probability in the distribution actually
                                 * sampled from: after top-k / top-p / min-p and renormalization */
} rs_sample_info;

/* Picks the next token. `position` is the position the new token will occupy. */
int32_t rs_sample(const float *logits /* [vocab] */, int vocab, const rs_sampling_params *sp,
                  uint64_t sample_index, uint64_t position, rs_sampler_scratch *scratch,
                  rs_sample_info *info);

/* log of token's probability in the processed distribution (T, top-k/p, min-p, renormalized);
 * -INFINITY when truncation removed it, 0 for greedy's argmax. */
float rs_logprob_processed(const float *logits /* [vocab] */, int vocab, const rs_sampling_params *sp,
                           int32_t token, rs_sampler_scratch *scratch);

/* The k most likely tokens of softmax(logits / temp) (temp <= 0 meaning 1), most likely first
 * (ties: lower id first), with their logprobs. With `processed`, the distribution is the one
 * sp's truncation leaves (renormalized), and fewer than k entries come back when it keeps fewer
 * tokens. Returns the number written. */
int rs_top_logprobs(const float *logits /* [vocab] */, int vocab, const rs_sampling_params *sp, bool processed,
                    int k, rs_sampler_scratch *scratch, int32_t *ids /* [k] */, float *lps /* [k] */);

#endif /* RS_SAMPLER_H */
