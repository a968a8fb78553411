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

/* ---- temperatures far from 1 (double-precision references) ---- */

/* log_softmax((x - max) / T)[tok] in double; T as the float the request carries. */
static double ref_logprob_t(const float *l, int n, float t, int tok) {
    const double it = 1.0 / (double)t;
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++) mx = fmax(mx, (double)l[i]);
    for (int i = 0; i < n; i++) sum += exp(((double)l[i] - mx) * it);
    return ((double)l[tok] - mx) * it - log(sum);
}

static int ref_argmax(const float *l, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (l[i] > l[best]) best = i;
    return best;
}

/* Logits with a near tie at the top (tokens 7 and 8, 4 ulps of 2.0 apart) and a spread below. */
static void fill_tie_logits(float *l, int n) {
    fill_logits(l, n, 19);
    l[7] = 2.0f;
    l[8] = 2.0f - 4 * 0x1p-23f;
    for (int i = 0; i < n; i++)
        if (i != 7 && i != 8 && l[i] > 1.0f) l[i] = 1.0f - (float)i * 1e-4f;
}

/* Temperatures from the smallest positive float to 10: below RS_SAMPLING_EPS the sampler is
 * greedy and reports T = 1 (SGLang's rule); above it every token is drawn from softmax(x / T)
 * and reported with its logprob there, never NaN, never a token the distribution does not hold. */
RS_TEST(sampler_tiny_temperatures_match_double_reference) {
    enum { V = 1000, N = 4000 };
    static float l[V];
    fill_tie_logits(l, V);
    const float temps[] = {1e-45f, 1e-38f, 1e-20f, 1e-6f, 1e-3f, 0.1f, 1.0f, 10.0f};
    rs_sampler_scratch sc = {0};
    for (size_t ti = 0; ti < RS_ARRAY_LEN(temps); ti++) {
        rs_sampling_params sp;
        rs_sampling_params_default(&sp);
        sp.temperature = temps[ti];
        sp.seed = 7 + ti;
        const bool greedy = temps[ti] < 1e-6f;
        int hits7 = 0;
        for (int i = 0; i < N; i++) {
            rs_sample_info info;
            const int t = rs_sample(l, V, &sp, 0, (uint64_t)i, &sc, &info);
            ASSERT_TRUE(t >= 0 && t < V);
            ASSERT_TRUE(!isnan(info.logprob) && !isnan(info.logprob_processed));
            if (greedy) {
                ASSERT_EQ(t, ref_argmax(l, V));
                ASSERT_NEAR(info.logprob, ref_logprob_t(l, V, 1.0f, t), 1e-5);
                continue;
            }
            const double want = ref_logprob_t(l, V, temps[ti], t);
            ASSERT_TRUE(want > -700); /* a token the distribution holds */
            ASSERT_NEAR(info.logprob, want, 2e-5 + 1e-6 * fabs(want));
            ASSERT_NEAR(info.logprob_processed, want, 2e-5 + 1e-6 * fabs(want));
            hits7 += t == 7;
        }
        if (!greedy && temps[ti] <= 1e-3f) { /* only the tie is drawn: token 7 at its share */
            const double p7 = exp(ref_logprob_t(l, V, temps[ti], 7));
            ASSERT_NEAR((double)hits7 / N, p7, 4 * sqrt(p7 * (1 - p7) / N) + 1e-3);
        }
    }
    rs_sampler_scratch_free(&sc);
}

/* Ranks by logits, not by probabilities that underflow: at T = 1e-6 every runner-up's probability
 * is 0 in fp32, and the alternatives are still the next-largest logits with their exact (large
 * negative) logprobs; the truncated (processed) distribution likewise. */
RS_TEST(sampler_top_logprobs_at_low_temperature) {
    enum { V = 600, K = 6 };
    static float l[V];
    fill_tie_logits(l, V);
    const float temps[] = {1e-6f, 1e-3f, 0.1f, 1.0f};
    rs_sampler_scratch sc = {0};
    for (size_t ti = 0; ti < RS_ARRAY_LEN(temps); ti++) {
        const float t = temps[ti];
        rs_sampling_params sp;
        rs_sampling_params_default(&sp);
        sp.temperature = t;
        int32_t ids[K];
        float lps[K];
        ASSERT_EQ(rs_top_logprobs(l, V, &sp, false, K, &sc, ids, lps), K);
        int used[V] = {0};
        for (int r = 0; r < K; r++) { /* selection by logit, ties by id */
            int best = -1;
            for (int v = 0; v < V; v++)
                if (!used[v] && (best < 0 || l[v] > l[best])) best = v;
            used[best] = 1;
            ASSERT_EQ(ids[r], best);
            const double want = ref_logprob_t(l, V, t, best);
            ASSERT_NEAR(lps[r], want, 2e-5 + 1e-6 * fabs(want));
        }
        /* processed, top-k 4: the four largest logits renormalized among themselves */
        sp.top_k = 4;
        ASSERT_EQ(rs_top_logprobs(l, V, &sp, true, K, &sc, ids, lps), 4);
        double lse4 = -INFINITY;
        for (int r = 0; r < 4; r++) {
            const double a = ref_logprob_t(l, V, t, ids[r]);
            lse4 = lse4 > a ? lse4 + log1p(exp(a - lse4)) : a + log1p(exp(lse4 - a));
        }
        for (int r = 0; r < 4; r++) {
            const double want = ref_logprob_t(l, V, t, ids[r]) - lse4;
            ASSERT_NEAR(lps[r], want, 2e-5 + 1e-6 * fabs(want));
        }
    }
    rs_sampler_scratch_free(&sc);
}
