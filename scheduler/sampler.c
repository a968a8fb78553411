/*
 * sampler.c — greedy, temperature, top-k, top-p and min-p sampling (see sampler.h).
 *
 * Order of operations, as in SGLang / vLLM: scale by 1/T, softmax, keep the top-k, keep the
 * smallest prefix of the sorted distribution whose mass reaches top_p (the token that crosses the
 * threshold is kept), drop tokens whose probability is below min_p x the maximum, renormalize,
 * draw. Without truncation the draw walks the vocabulary in id order and needs no sort.
 *
 * The softmax is one vector pass over the vocabulary (kernels/cpu/cpu_exp.h): z = x * (1/T) and
 * max(z) in fp32, e = exp(z - max) by the fp32 rs_expf (within 1.02 ulp), summed in double over 16
 * fixed lanes; log-sum-exp = log(sum) in double and p = e / sum in fp32. The exp and the order of
 * the sum are the same on every ISA, so the sampler stays a pure function of its inputs. Against
 * exp in double throughout, log-sum-exp moves by about 1e-7 (each e is within 1.02 ulp), which
 * changes a returned fp32 logprob by an ulp or less.
 */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

#include "../kernels/cpu/cpu_exp.h"

void rs_sampling_params_default(rs_sampling_params *sp) {
    *sp = (rs_sampling_params){.max_new_tokens = 128, .min_new_tokens = 0, .temperature = 1.0f,
                               .top_p = 1.0f, .top_k = -1, .min_p = 0.0f, .n = 1, .seed = 0,
                               .repetition_penalty = 1.0f};
}

static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

double rs_rng_uniform(uint64_t seed, uint64_t sample_index, uint64_t position) {
    uint64_t h = splitmix64(seed);
    h = splitmix64(h ^ splitmix64(sample_index ^ 0x5851f42d4c957f2dull));
    h = splitmix64(h ^ splitmix64(position ^ 0x14057b7ef767814full));
    return (double)(h >> 11) * 0x1.0p-53;
}

void rs_sampler_scratch_free(rs_sampler_scratch *s) {
    free(s->probs);
    free(s->idx);
    s->probs = NULL;
    s->idx = NULL;
    s->cap = 0;
}

static void scratch_reserve(rs_sampler_scratch *s, int vocab) {
    if (s->cap >= vocab) return;
    free(s->probs);
    free(s->idx);
    s->probs = rs_xmalloc(sizeof(float) * (size_t)vocab);
    s->idx = rs_xmalloc(sizeof(int32_t) * (size_t)vocab);
    s->cap = vocab;
}

/* max of x/T and sum(exp(x/T - max)) over the vocabulary; e[i] = exp(x[i]/T - max) unless e is
 * NULL. Returns the sum. */
static double softmax_stats(const float *logits, int vocab, float inv_t, float *e /* [vocab] or NULL */,
                            float *max_out) {
    const rs_cpu_exp_vec *ex = rs_cpu_exp_best();
    float mx = ex->max(logits, (size_t)vocab, inv_t);
    *max_out = mx;
    return ex->exp_sum_f64(e, logits, (size_t)vocab, inv_t, mx);
}

float rs_logprob_of(const float *logits, int vocab, float temp, int32_t token) {
    float inv_t = temp > 0.0f ? 1.0f / temp : 1.0f;
    float mx;
    double lse = log(softmax_stats(logits, vocab, inv_t, NULL, &mx));
    return (float)((double)(logits[token] * inv_t - mx) - lse);
}

static int32_t argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static int cmp_desc(const void *a, const void *b, void *keys) {
    const float *sort_keys = keys;
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    float x = sort_keys[i], y = sort_keys[j];
    if (x != y) return x > y ? -1 : 1;
    return i < j ? -1 : (i > j); /* ties: lower id first, so the order is total */
}

/* Sorts token ids by probability (descending, ties by id) and returns how many survive top-k,
 * top-p and min-p. p must hold softmax(logits / T). */
static int truncate_sorted(const float *p, int vocab, const rs_sampling_params *sp, int32_t *idx) {
    for (int i = 0; i < vocab; i++) idx[i] = i;
    qsort_r(idx, (size_t)vocab, sizeof *idx, cmp_desc, (void *)p);
    int keep = vocab;
    if (sp->top_k > 0 && sp->top_k < keep) keep = sp->top_k;
    if (sp->top_p < 1.0f) {
        double acc = 0.0;
        for (int i = 0; i < keep; i++) {
            acc += p[idx[i]];
            if (acc >= sp->top_p) { keep = i + 1; break; }
        }
    }
    if (sp->min_p > 0.0f) {
        float floor_p = sp->min_p * p[idx[0]];
        int i = 1;
        while (i < keep && p[idx[i]] >= floor_p) i++;
        keep = i;
    }
    return keep;
}

static bool truncates(const rs_sampling_params *sp, int vocab) {
    return (sp->top_k > 0 && sp->top_k < vocab) || sp->top_p < 1.0f || sp->min_p > 0.0f;
}

/* p[i] = softmax(logits / T)[i]; returns max and log-sum-exp of the scaled logits. */
static void fill_probs(const float *logits, int vocab, float inv_t, float *p, float *mx, double *lse) {
    double sum = softmax_stats(logits, vocab, inv_t, p, mx);
    *lse = log(sum);
    rs_cpu_exp_best()->div(p, (size_t)vocab, (float)sum);
}

int32_t rs_sample(const float *logits, int vocab, const rs_sampling_params *sp, uint64_t sample_index,
                  uint64_t position, rs_sampler_scratch *s, rs_sample_info *info) {
    if (sp->temperature <= 0.0f) {
        int32_t tok = argmax(logits, vocab);
        info->logprob = rs_logprob_of(logits, vocab, 0.0f, tok);
        info->logprob_processed = 0.0f; /* greedy: the sampled distribution is a point mass */
        return tok;
    }
    scratch_reserve(s, vocab);
    float inv_t = 1.0f / sp->temperature, mx;
    double lse;
    float *p = s->probs;
    fill_probs(logits, vocab, inv_t, p, &mx, &lse);

    double u = rs_rng_uniform(sp->seed, sample_index, position);
    int32_t tok = vocab - 1;
    double mass = 1.0;
    if (!truncates(sp, vocab)) {
        double acc = 0.0;
        for (int i = 0; i < vocab; i++) {
            acc += p[i];
            if (u < acc) { tok = i; break; }
        }
    } else {
        int32_t *idx = s->idx;
        int keep = truncate_sorted(p, vocab, sp, idx);
        mass = 0.0;
        for (int i = 0; i < keep; i++) mass += p[idx[i]];
        double target = u * mass, acc = 0.0;
        tok = idx[keep - 1];
        for (int i = 0; i < keep; i++) {
            acc += p[idx[i]];
            if (target < acc) { tok = idx[i]; break; }
        }
    }
    info->logprob = (float)((double)(logits[tok] * inv_t - mx) - lse);
    info->logprob_processed = (float)((double)info->logprob - log(mass));
    return tok;
}

int rs_top_logprobs(const float *logits, int vocab, const rs_sampling_params *sp, bool processed, int k,
                    rs_sampler_scratch *s, int32_t *ids, float *lps) {
    if (k <= 0) return 0;
    if (k > vocab) k = vocab;
    scratch_reserve(s, vocab);
    float inv_t = sp->temperature > 0.0f ? 1.0f / sp->temperature : 1.0f, mx;
    double lse;
    float *p = s->probs;
    fill_probs(logits, vocab, inv_t, p, &mx, &lse);
    int32_t *idx = s->idx;
    int n = k;
    double log_mass = 0.0;
    if (processed && sp->temperature <= 0.0f) { /* greedy: the point mass on the argmax */
        ids[0] = argmax(logits, vocab);
        lps[0] = 0.0f;
        return 1;
    }
    if (processed && truncates(sp, vocab)) {
        int keep = truncate_sorted(p, vocab, sp, idx);
        double mass = 0.0;
        for (int i = 0; i < keep; i++) mass += p[idx[i]];
        log_mass = log(mass);
        if (n > keep) n = keep;
    } else {
        /* partial selection of the k largest: k is small (top_logprobs_num) */
        for (int i = 0; i < n; i++) idx[i] = -1;
        for (int v = 0; v < vocab; v++) {
            if (idx[n - 1] >= 0 && !(p[v] > p[idx[n - 1]])) continue;
            int j = n - 1;
            while (j > 0 && (idx[j - 1] < 0 || p[v] > p[idx[j - 1]])) {
                idx[j] = idx[j - 1];
                j--;
            }
            idx[j] = v;
        }
    }
    for (int i = 0; i < n; i++) {
        ids[i] = idx[i];
        lps[i] = (float)((double)(logits[idx[i]] * inv_t - mx) - lse - log_mass);
    }
    return n;
}

float rs_logprob_processed(const float *logits, int vocab, const rs_sampling_params *sp, int32_t token,
                           rs_sampler_scratch *s) {
    if (sp->temperature <= 0.0f) return argmax(logits, vocab) == token ? 0.0f : -INFINITY;
    if (!truncates(sp, vocab)) return rs_logprob_of(logits, vocab, sp->temperature, token);
    scratch_reserve(s, vocab);
    float inv_t = 1.0f / sp->temperature, mx;
    double lse;
    fill_probs(logits, vocab, inv_t, s->probs, &mx, &lse);
    int keep = truncate_sorted(s->probs, vocab, sp, s->idx);
    double mass = 0.0;
    bool kept = false;
    for (int i = 0; i < keep; i++) {
        mass += s->probs[s->idx[i]];
        kept |= s->idx[i] == token;
    }
    if (!kept) return -INFINITY;
    return (float)((double)(logits[token] * inv_t - mx) - lse - log(mass));
}
