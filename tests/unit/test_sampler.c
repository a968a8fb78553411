/*
 * test_sampler.c — sampling and logprobs against independent double-precision computations.
 */
#include <math.h>

#include "../../scheduler/sampler.h"
#include "test.h"

static double ref_logprob(const float *logits, int n, double temp, int tok) {
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++) mx = fmax(mx, logits[i] / temp);
    for (int i = 0; i < n; i++) sum += exp(logits[i] / temp - mx);
    return logits[tok] / temp - mx - log(sum);
}

static void fill_logits(float *l, int n, unsigned seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        l[i] = (float)((seed >> 8) % 10000) / 1000.0f - 5.0f;
    }
}

RS_TEST(sampler_greedy_is_argmax_with_logprob) {
    enum { V = 1000 };
    float l[V];
    fill_logits(l, V, 7);
    l[321] = 9.0f;
    rs_sampling_params sp;
    rs_sampling_params_default(&sp);
    sp.temperature = 0.0f;
    rs_sampler_scratch sc = {0};
    rs_sample_info info;
    ASSERT_EQ(rs_sample(l, V, &sp, 0, 5, &sc, &info), 321);
    ASSERT_NEAR(info.logprob, ref_logprob(l, V, 1.0, 321), 1e-6);
    rs_sampler_scratch_free(&sc);
}

RS_TEST(sampler_rng_is_keyed_and_uniform) {
    ASSERT_TRUE(rs_rng_uniform(1, 2, 3) == rs_rng_uniform(1, 2, 3));
    ASSERT_TRUE(rs_rng_uniform(1, 2, 3) != rs_rng_uniform(1, 2, 4));
    ASSERT_TRUE(rs_rng_uniform(1, 2, 3) != rs_rng_uniform(1, 3, 3));
    ASSERT_TRUE(rs_rng_uniform(1, 2, 3) != rs_rng_uniform(2, 2, 3));
    int bins[10] = {0};
    for (int i = 0; i < 100000; i++) {
        double u = rs_rng_uniform(42, 0, (uint64_t)i);
        ASSERT_TRUE(u >= 0.0 && u < 1.0);
        bins[(int)(u * 10)]++;
    }
    for (int b = 0; b < 10; b++) ASSERT_NEAR(bins[b], 10000, 500);
}

/* Empirical frequencies over many positions match softmax(logits / T). */
RS_TEST(sampler_temperature_matches_softmax) {
    float l[4] = {1.0f, 2.0f, 0.5f, -1.0f};
    rs_sampling_params sp;
    rs_sampling_params_default(&sp);
    sp.temperature = 0.7f;
    sp.seed = 99;
    rs_sampler_scratch sc = {0};
    int counts[4] = {0};
    enum { N = 200000 };
    for (int i = 0; i < N; i++) {
        rs_sample_info info;
        int t = rs_sample(l, 4, &sp, 0, (uint64_t)i, &sc, &info);
        ASSERT_NEAR(info.logprob, ref_logprob(l, 4, 0.7, t), 1e-5);
        ASSERT_TRUE(info.logprob_processed == info.logprob); /* no truncation */
        counts[t]++;
    }
    for (int t = 0; t < 4; t++) {
        double p = exp(ref_logprob(l, 4, 0.7, t));
        ASSERT_NEAR((double)counts[t] / N, p, 4 * sqrt(p * (1 - p) / N) + 1e-4);
    }
    rs_sampler_scratch_free(&sc);
}

/* top-k / top-p / min-p never emit a truncated token, and logprobs stay pre-truncation. */
RS_TEST(sampler_truncation_sets) {
    float l[6] = {3.0f, 2.5f, 2.0f, 0.0f, -1.0f, -2.0f};
    double p[6], z = 0;
    for (int i = 0; i < 6; i++) z += exp(l[i]);
    for (int i = 0; i < 6; i++) p[i] = exp(l[i]) / z;
    rs_sampler_scratch sc = {0};
    struct { int top_k; float top_p, min_p; int allowed; } cases[] = {
        {1, 1.0f, 0.0f, 1},               /* only token 0 */
        {2, 1.0f, 0.0f, 2},               /* tokens 0, 1 */
        {-1, (float)(p[0] + 0.01), 0.0f, 2}, /* mass of token 0 is short of top_p: 0 and 1 */
        {-1, 1.0f, 0.5f, 2},              /* p >= 0.5 * p0: p1/p0 = 0.61 kept, p2/p0 = 0.37 dropped */
    };
    for (size_t c = 0; c < RS_ARRAY_LEN(cases); c++) {
        rs_sampling_params sp;
        rs_sampling_params_default(&sp);
        sp.top_k = cases[c].top_k;
        sp.top_p = cases[c].top_p;
        sp.min_p = cases[c].min_p;
        sp.seed = 5;
        int seen[6] = {0};
        for (int i = 0; i < 5000; i++) {
            rs_sample_info info;
            int t = rs_sample(l, 6, &sp, 1, (uint64_t)i, &sc, &info);
            ASSERT_TRUE(t < cases[c].allowed);
            ASSERT_NEAR(info.logprob, log(p[t]), 1e-5);
            double kept = 0;
            for (int j = 0; j < cases[c].allowed; j++) kept += p[j];
            ASSERT_NEAR(info.logprob_processed, log(p[t] / kept), 1e-5);
            seen[t]++;
        }
        for (int t = 0; t < cases[c].allowed; t++) ASSERT_TRUE(seen[t] > 0);
    }
    rs_sampler_scratch_free(&sc);
}

RS_TEST(sampler_same_key_same_token) {
    enum { V = 5000 };
    static float l[V];
    fill_logits(l, V, 3);
    rs_sampling_params sp;
    rs_sampling_params_default(&sp);
    sp.top_p = 0.9f;
    sp.seed = 1234;
    rs_sampler_scratch sc = {0};
    for (int pos = 0; pos < 50; pos++) {
        rs_sample_info a, b;
        int t1 = rs_sample(l, V, &sp, 3, (uint64_t)pos, &sc, &a);
        int t2 = rs_sample(l, V, &sp, 3, (uint64_t)pos, &sc, &b);
        ASSERT_EQ(t1, t2);
        ASSERT_TRUE(a.logprob == b.logprob);
    }
    rs_sampler_scratch_free(&sc);
}

/* Top-k alternatives: the k largest of the (scaled) distribution in order, with exact logprobs;
 * processed ones come from the truncated, renormalized distribution. */
RS_TEST(sampler_top_logprobs) {
    enum { V = 300 };
    float l[V];
    fill_logits(l, V, 11);
    rs_sampling_params sp;
    rs_sampling_params_default(&sp);
    sp.temperature = 0.5f;
    rs_sampler_scratch sc = {0};
    int32_t ids[5];
    float lps[5];
    ASSERT_EQ(rs_top_logprobs(l, V, &sp, false, 5, &sc, ids, lps), 5);
    /* reference: selection sort over a copy, ties by id */
    int used[V] = {0};
    for (int r = 0; r < 5; r++) {
        int best = -1;
        for (int v = 0; v < V; v++)
            if (!used[v] && (best < 0 || l[v] > l[best])) best = v;
        used[best] = 1;
        ASSERT_EQ(ids[r], best);
        ASSERT_NEAR(lps[r], ref_logprob(l, V, 0.5, best), 1e-5);
    }
    sp.top_k = 3;
    ASSERT_EQ(rs_top_logprobs(l, V, &sp, true, 5, &sc, ids, lps), 3);
    double mass = 0;
    for (int r = 0; r < 3; r++) mass += exp(ref_logprob(l, V, 0.5, ids[r]));
    for (int r = 0; r < 3; r++) ASSERT_NEAR(lps[r], ref_logprob(l, V, 0.5, ids[r]) - log(mass), 1e-5);
    rs_sampler_scratch_free(&sc);
}
