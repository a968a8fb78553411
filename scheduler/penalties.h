/*
 * penalties.h — frequency, presence and repetition penalties over the tokens a sample has output,
 * applied to its logits before temperature.
 *
 * Semantics, as SGLang's penaltylib (python/sglang/srt/sampling/penaltylib/{frequency,presence,
 * repetition}_penalty.py, sgl-project/sglang main of mid 2026, 0.5.16) and vLLM's apply_penalties
 * (vllm/model_executor/layers/utils.py) define them:
 *   counted tokens  the sample's own output tokens. SGLang counts only those for all three
 *                   penalties; vLLM counts the prompt too for repetition_penalty. rolloutd follows
 *                   SGLang on both /generate and /v1/completions.
 *   repetition r    for each counted token t: logit[t] = logit[t] > 0 ? logit[t] / r : logit[t] * r
 *   frequency f     logit[t] -= f * count[t]
 *   presence p      logit[t] -= p
 * in that order, each step in fp32 (vLLM's explicit order; SGLang applies its penalizers in the
 * iteration order of a set, which leaves repetition's place unspecified; the two additive ones
 * commute). Temperature, softmax and top-k / top-p / min-p then run on the penalized logits
 * exactly as without penalties. Prompt positions scored by teacher forcing have no output yet, so
 * no penalty applies there.
 *
 * The counts live with the sequence: a sparse open-addressing map token -> count over its output
 * (memory O(distinct output tokens), not a vocabulary-sized array per sequence), kept when the
 * sequence is preempted and recomputed (its output is kept), empty for a freshly forked sibling.
 * Applying them visits only the counted tokens. The result is a function of (logits, params, this
 * sample's own output), so a sample's tokens do not depend on what else is in its batch.
 */
#ifndef RS_PENALTIES_H
#define RS_PENALTIES_H

#include <stdbool.h>
#include <stdint.h>

#include "engine.h"

typedef struct rs_penalty_counts {
    int32_t *ids;               /* [cap] token ids, -1 = empty slot */
    int32_t *counts;            /* [cap] occurrences in the output */
    int cap;                    /* 0 or a power of two */
    int n;                      /* distinct tokens */
} rs_penalty_counts;

/* Whether sp asks for any penalty (frequency != 0, presence != 0 or repetition != 1). */
bool rs_penalties_active(const rs_sampling_params *sp);

/* Counts one more output token (token >= 0). */
void rs_penalty_counts_add(rs_penalty_counts *c, int32_t token);
/* The count of token (0 when it never occurred). */
int rs_penalty_count(const rs_penalty_counts *c, int32_t token);
void rs_penalty_counts_free(rs_penalty_counts *c);   /* leaves *c empty */

/* Applies sp's penalties for the counted tokens to logits [vocab] in place (every counted token
 * is < vocab: the engine counts only sampled tokens). */
void rs_penalties_apply(const rs_sampling_params *sp, const rs_penalty_counts *c, float *logits);

#endif /* RS_PENALTIES_H */
