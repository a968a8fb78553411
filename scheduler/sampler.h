/*
 * sampler.h — next-token sampling and logprobs, a pure function of (logits, params, rng key).
 *
 * The random draw for a token is keyed by (sampling_seed, sample index, position) through a
 * counter-based hash, so a sequence's tokens do not depend on what else shares its batch, on the
 * thread count, or on when it was scheduled.
 *
 * Temperature. T below RS_SAMPLING_EPS (1e-6, SGLang's _SAMPLING_EPS), 0 included, is greedy:
 * the argmax, reported with the logprobs of T = 1, as SGLang does (it sets temperature 1 and
 * top_k 1). vLLM's rule differs (_SAMPLING_EPS 1e-5 for greedy, and 0 < T < 1e-2 raised to 1e-2);
 * rolloutd serves SGLang-shaped trainers and follows SGLang. Any larger T is sampled from
 * softmax(x / T) computed in log space: d = x - max(x) (fp32, exact near the top), scaled by 1/T
 * (e = exp(d / T), fp32 product, summed in double), and a token's logprob is
 * (x - max(x)) / T - log(sum) with the difference and the scaling in double. Nothing overflows for
 * any T >= RS_SAMPLING_EPS (1/T <= 1e6), probabilities that underflow to 0 cost no precision to the
 * tokens that remain, and tokens are ranked by their logits, never by fp32 probabilities (which
 * tie at 0 far below the top).
 *
 * The returned logprob is log_softmax(logits / T)[token] over the full vocabulary, before top-k /
 * top-p / min-p truncation (SGLang's default; what trainers recompute); the processed one is the
 * token's logprob in the distribution actually drawn from (after truncation, renormalized).
 *
 * Masked steps. Before min_new_tokens outputs the engine hands the sampler its processed row, with
 * every stop id and EOS id at -inf (step.c, process_logits; SGLang's MinNewTokensPenalizer and
 * vLLM's min_tokens do the same). What such a step reports follows logprobs_mode:
 *   default    log_softmax(masked / T)[token] = lp_T(token) - log(1 - sum of p_T over the stop ids):
 *              the masked distribution, renormalized (SGLang's, whose logprobs come after its
 *              penalizers);
 *   processed  the distribution drawn from: masked, T, top-k / top-p / min-p, renormalized (vLLM's
 *              processed_logprobs);
 *   raw        log_softmax(logits)[token] of the model's own row: unmasked, T = 1 (vLLM's
 *              raw_logprobs, computed before its logits processors).
 * Top logprobs come from the same distribution as the token's: in default and processed modes a
 * masked id has logprob -inf (null in JSON) and ranks below every finite one.
 *
 * Logits may hold -inf: a token that cannot be drawn (a masked stop token); its logprob is -inf.
 * A row with a NaN, a +inf or no finite entry is
 * invalid: rs_sample returns -1, the logprob functions NaN and rs_top_logprobs -1. That is a bug
 * upstream (non-finite weights are refused when loaded or pushed), never something to serve: the
 * engine fails the request with a 500 instead.
 */
#ifndef RS_SAMPLER_H
#define RS_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine.h"

#define RS_SAMPLING_EPS 1e-6f   /* temperatures below this are greedy (SGLang's _SAMPLING_EPS) */

typedef struct rs_sampler_scratch {
    float *probs;       /* [vocab] */
    int32_t *idx;       /* [vocab] */
    int cap;
} rs_sampler_scratch;

void rs_sampler_scratch_free(rs_sampler_scratch *s);

/* Whether sp samples greedily (temperature < RS_SAMPLING_EPS). */
bool rs_sampling_greedy(const rs_sampling_params *sp);

/* Uniform double in [0, 1) from the key, 53 random bits. */
double rs_rng_uniform(uint64_t seed, uint64_t sample_index, uint64_t position);

/* log_softmax(logits / temp)[token], temp < RS_SAMPLING_EPS meaning 1; NaN for an invalid row. */
float rs_logprob_of(const float *logits /* [vocab] */, int vocab, float temp, int32_t token,
                    rs_sampler_scratch *scratch);

/* What rs_sample reports besides the token. */
typedef struct rs_sample_info {
    float logprob;              /* log_softmax(logits / T)[token] (T = 1 when greedy) */
    float logprob_processed;    /* log of the token's probability in the distribution actually
                                 * sampled from: after top-k / top-p / min-p and renormalization */
    int n_kept;                 /* the tokens top-k / top-p / min-p kept, in scratch->idx[0, n_kept)
                                 * (most likely first, ties by id) until the next call on the
                                 * scratch; -1 when nothing truncates or greedy */
} rs_sample_info;

/* Picks the next token. `position` is the position the new token will occupy. -1 (info
 * untouched) for an invalid row. */
int32_t rs_sample(const float *logits /* [vocab] */, int vocab, const rs_sampling_params *sp,
                  uint64_t sample_index, uint64_t position, rs_sampler_scratch *scratch,
                  rs_sample_info *info);

/* log of token's probability in the processed distribution (T, top-k/p, min-p, renormalized);
 * -INFINITY when truncation removed it, 0 for greedy's argmax, NaN for an invalid row. */
float rs_logprob_processed(const float *logits /* [vocab] */, int vocab, const rs_sampling_params *sp,
                           int32_t token, rs_sampler_scratch *scratch);

/* The k most likely tokens of softmax(logits / temp) (temp < RS_SAMPLING_EPS meaning 1): the k
 * largest logits, most likely first (ties: lower id first), with their logprobs. With
 * `processed`, the distribution is the one sp's truncation leaves (renormalized), and fewer than
 * k entries come back when it keeps fewer tokens. Returns the number written, -1 for an invalid
 * row. */
int rs_top_logprobs(const float *logits /* [vocab] */, int vocab, const rs_sampling_params *sp, bool processed,
                    int k, rs_sampler_scratch *scratch, int32_t *ids /* [k] */, float *lps /* [k] */);

#endif /* RS_SAMPLER_H */
