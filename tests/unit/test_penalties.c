/*
 * test_penalties.c — the output-token count map and the penalty arithmetic (scheduler/penalties.c)
 * against values worked out by hand from SGLang's definition, and, in the engine, penalized
 * sampling staying independent of batching, chunking, preemption and recompute. (The penalties
 * against an independent numpy reference over a real model: tests/e2e/test_penalties.py.)
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "../../scheduler/penalties.h"
#include "test.h"

RS_TEST(penalties_count_map) {
    rs_penalty_counts c = {0};
    ASSERT_EQ(rs_penalty_count(&c, 7), 0);
    unsigned x = 5;
    int want[64] = {0};
    for (int i = 0; i < 5000; i++) { /* many tokens, few distinct: memory follows the distinct ones */
        x = x * 1664525u + 1013904223u;
        int32_t t = (int32_t)((x >> 10) % 64) * 4099; /* spread over a large vocabulary */
        rs_penalty_counts_add(&c, t);
        want[t / 4099]++;
    }
    int distinct = 0;
    for (int t = 0; t < 64; t++) {
        ASSERT_EQ(rs_penalty_count(&c, t * 4099), want[t]);
        distinct += want[t] > 0;
    }
    ASSERT_EQ(c.n, distinct);
    ASSERT_TRUE(c.cap <= 4 * distinct && c.cap >= 2 * distinct);
    ASSERT_EQ(rs_penalty_count(&c, 1), 0);
    rs_penalty_counts_free(&c);
    ASSERT_EQ(c.cap, 0);
    ASSERT_TRUE(c.ids == NULL);
}

RS_TEST(penalties_arithmetic) {
    rs_sampling_params sp;
    rs_sampling_params_default(&sp);
    ASSERT_TRUE(!rs_penalties_active(&sp));
    float logits[6] = {2.0f, -2.0f, 0.0f, 3.0f, -1.0f, 5.0f};
    rs_penalty_counts c = {0};
    rs_penalty_counts_add(&c, 0); /* token 0 twice, 1 once, 2 once; 3, 4, 5 never */
    rs_penalty_counts_add(&c, 1);
    rs_penalty_counts_add(&c, 0);
    rs_penalty_counts_add(&c, 2);
    rs_penalties_apply(&sp, &c, logits); /* neutral: nothing moves */
    ASSERT_NEAR(logits[0], 2.0, 0);
    ASSERT_NEAR(logits[1], -2.0, 0);

    sp.repetition_penalty = 2.0f; /* positive logits divided, negative multiplied, 0 stays 0 */
    sp.frequency_penalty = 0.5f;
    sp.presence_penalty = 0.25f;
    ASSERT_TRUE(rs_penalties_active(&sp));
    rs_penalties_apply(&sp, &c, logits);
    ASSERT_NEAR(logits[0], 2.0 / 2 - 0.5 * 2 - 0.25, 1e-7); /* -0.25 */
    ASSERT_NEAR(logits[1], -2.0 * 2 - 0.5 * 1 - 0.25, 1e-7); /* -4.75 */
    ASSERT_NEAR(logits[2], 0.0 - 0.5 - 0.25, 1e-7);
    ASSERT_NEAR(logits[3], 3.0, 0); /* never output: untouched */
    ASSERT_NEAR(logits[4], -1.0, 0);
    ASSERT_NEAR(logits[5], 5.0, 0);

    /* repetition below 1 rewards a repeat; negative penalties too */
    float l2[3] = {1.0f, -1.0f, 4.0f};
    rs_sampling_params_default(&sp);
    sp.repetition_penalty = 0.5f;
    sp.presence_penalty = -1.0f;
    rs_penalty_counts d = {0};
    rs_penalty_counts_add(&d, 0);
    rs_penalty_counts_add(&d, 1);
    rs_penalties_apply(&sp, &d, l2);
    ASSERT_NEAR(l2[0], 1.0 / 0.5 + 1.0, 1e-7);
    ASSERT_NEAR(l2[1], -1.0 * 0.5 + 1.0, 1e-7);
    ASSERT_NEAR(l2[2], 4.0, 0);
    rs_penalty_counts_free(&c);
    rs_penalty_counts_free(&d);
}

/* A repetition penalty tiny enough to take a logit past fp32's range saturates it at +-FLT_MAX
 * (the step treats +inf as a broken row), and the greedy pick and the sampler's logprob of the
 * repeated token stay finite: it is as far ahead as a logit can put it. */
RS_TEST(penalties_tiny_repetition_penalty_saturates) {
    rs_sampling_params sp;
    rs_sampling_params_default(&sp);
    sp.repetition_penalty = 1e-40f; /* an fp32 subnormal: > 0, as the request's range asks */
    ASSERT_TRUE(sp.repetition_penalty > 0.0f);
    float logits[4] = {3.0f, -3.0f, 1.0f, 0.0f};
    rs_penalty_counts c = {0};
    rs_penalty_counts_add(&c, 0);
    rs_penalty_counts_add(&c, 1);
    rs_penalty_counts_add(&c, 3);
    rs_penalties_apply(&sp, &c, logits);
    ASSERT_TRUE(logits[0] == FLT_MAX);                 /* 3 / 1e-40: past the range */
    ASSERT_NEAR(logits[1], -3.0 * 1e-40f, 1e-45);      /* a negative logit multiplied: near 0 */
    ASSERT_NEAR(logits[2], 1.0, 0);                    /* not in the output */
    ASSERT_NEAR(logits[3], 0.0, 0);
    rs_sampling_params_default(&sp);
    rs_penalty_counts_free(&c);

    /* a logit that is already +-inf stays what it is (a broken row is still seen as broken) */
    float bad[1] = {INFINITY};
    rs_penalty_counts_add(&c, 0);
    sp.repetition_penalty = 0.5f;
    rs_penalties_apply(&sp, &c, bad);
    ASSERT_TRUE(isinf(bad[0]));
    rs_penalty_counts_free(&c);
}
