/*
 * sampler.c — greedy, temperature, top-k, top-p and min-p sampling (see sampler.h).
 *
 * Order of operations, as in SGLang / vLLM: scale by 1/T, softmax, keep the top-k, keep the
 * smallest prefix of the sorted distribution whose mass reaches top_p (the token that crosses the
 * threshold is kept), drop tokens whose probability is below min_p x the maximum, renormalize,
 * draw. Without truncation the draw walks the vocabulary in id order and needs no sort.
 *
 * The distribution of a row (dist_init) is three passes over the vocabulary: the largest logit
 * (fp32, exact), d = x - max into the scratch (fp32; exact for every x within a factor of two of
 * the max, which is where the mass is), and e = rs_expf(d * (1/T)) in place, summed in double over
 * 16 fixed lanes (kernels/exp.h). The exp and the order of the sum are the same on every
 * ISA, so the sampler stays a pure function of its inputs. A token's logprob takes its difference
 * to the max and the scaling in double: (x - max) / T - log(sum). Every quantity is relative to
 * the max, so no temperature >= RS_SAMPLING_EPS overflows, and the draw walks e against u * sum,
 * never fp32 probabilities (which would underflow to 0 together far below the top). Sorting and
 * top-k ranking use the logits themselves: e is a non-decreasing function of x, and the logits
 * keep the order that e loses to underflow.
 */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

#include "../kernels/exp.h"

void rs_sampling_params_default(rs_sampling_params *sp) {
    *sp = (rs_sampling_params){.max_new_tokens = 128, .min_new_tokens = 0, .temperature = 1.0f,
                               .top_p = 1.0f, .top_k = -1, .min_p = 0.0f, .n = 1, .seed = 0,
                               .repetition_penalty = 1.0f};
}

bool rs_sampling_greedy(const rs_sampling_params *sp) { return !(sp->temperature >= RS_SAMPLING_EPS); }

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

/* A row's distribution at one temperature, everything relative to its largest logit. */
typedef struct dist {
    const float *x;             /* [vocab] the logits */
    float *e;                   /* [vocab] exp((x - max) / T), in the scratch */
    int vocab;
    float xmax;
    double inv_t;               /* 1/T; 1 when greedy */
    double sum, lse;            /* sum of e, its log */
} dist;

static double inv_temperature(float t) { return t >= RS_SAMPLING_EPS ? 1.0 / (double)t : 1.0; }

/* Fills d for logits x at 1/T = inv_t. False for an invalid row (a NaN, a +inf, no finite entry):
 * a NaN anywhere makes some e NaN, a +inf makes the max infinite, so the sum says it either way. */
static bool dist_init(dist *d, const float *x, int vocab, double inv_t, rs_sampler_scratch *s) {
    scratch_reserve(s, vocab);
    const rs_cpu_exp_vec *ex = rs_cpu_exp_best();
    *d = (dist){.x = x, .e = s->probs, .vocab = vocab, .inv_t = inv_t};
    d->xmax = ex->max(x, (size_t)vocab, 1.0f);
    if (!isfinite(d->xmax)) return false;
    for (int i = 0; i < vocab; i++) d->e[i] = x[i] - d->xmax;
    d->sum = ex->exp_sum_f64(d->e, d->e, (size_t)vocab, (float)inv_t, 0.0f);
    if (!isfinite(d->sum)) return false; /* >= 1 otherwise: the max contributes exp(0) */
    d->lse = log(d->sum);
    return true;
}

/* (x[t] - max) / T, exact differences in double; -inf for a masked token. */
static double scaled(const dist *d, int32_t t) { return ((double)d->x[t] - (double)d->xmax) * d->inv_t; }

static double logprob(const dist *d, int32_t t) { return scaled(d, t) - d->lse; }

float rs_logprob_of(const float *logits, int vocab, float temp, int32_t token, rs_sampler_scratch *s) {
    dist d;
    if (!dist_init(&d, logits, vocab, inv_temperature(temp), s)) return NAN;
    return (float)logprob(&d, token);
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

static bool truncates(const rs_sampling_params *sp, int vocab) {
    return (sp->top_k > 0 && sp->top_k < vocab) || sp->top_p < 1.0f || sp->min_p > 0.0f;
}

/* Sorts token ids by logit (descending, ties by id) into idx and returns how many survive top-k,
 * top-p and min-p, with the sum of their e in *mass (>= 1: the top token always stays). */
static int truncate_sorted(const dist *d, const rs_sampling_params *sp, int32_t *idx, double *mass) {
    const int vocab = d->vocab;
    for (int i = 0; i < vocab; i++) idx[i] = i;
    qsort_r(idx, (size_t)vocab, sizeof *idx, cmp_desc, (void *)d->x);
    int keep = vocab;
    if (sp->top_k > 0 && sp->top_k < keep) keep = sp->top_k;
    if (sp->top_p < 1.0f) {
        const double target = (double)sp->top_p * d->sum;
        double acc = 0.0;
        for (int i = 0; i < keep; i++) {
            acc += d->e[idx[i]];
            if (acc >= target) { keep = i + 1; break; }
        }
    }
    if (sp->min_p > 0.0f) { /* p >= min_p p_max, i.e. (x - max) / T >= log(min_p) */
        const double floor_lp = log((double)sp->min_p);
        int i = 1;
        while (i < keep && scaled(d, idx[i]) >= floor_lp) i++;
        keep = i;
    }
    double m = 0.0;
    for (int i = 0; i < keep; i++) m += d->e[idx[i]];
    *mass = m;
    return keep;
}

int32_t rs_sample(const float *logits, int vocab, const rs_sampling_params *sp, uint64_t sample_index,
                  uint64_t position, rs_sampler_scratch *s, rs_sample_info *info) {
    const bool greedy = rs_sampling_greedy(sp);
    dist d;
    if (!dist_init(&d, logits, vocab, inv_temperature(sp->temperature), s)) return -1;
    if (greedy) {
        const int32_t tok = argmax(logits, vocab);
        info->logprob = (float)logprob(&d, tok);
        info->logprob_processed = 0.0f; /* greedy: the sampled distribution is a point mass */
        info->n_kept = -1;
        return tok;
    }
    const double u = rs_rng_uniform(sp->seed, sample_index, position);
    int32_t tok = -1;
    double log_mass = d.lse;
    info->n_kept = -1;
    if (!truncates(sp, vocab)) {
        const double target = u * d.sum;
        double acc = 0.0;
        for (int i = 0; i < vocab; i++) {
            if (d.e[i] == 0.0f) continue;
            tok = i; /* the last token with mass, should rounding leave acc short of target */
            acc += d.e[i];
            if (target < acc) break;
        }
    } else {
        int32_t *idx = s->idx;
        double mass;
        const int keep = truncate_sorted(&d, sp, idx, &mass);
        const double target = u * mass;
        double acc = 0.0;
        tok = idx[0];
        for (int i = 0; i < keep; i++) {
            if (d.e[idx[i]] == 0.0f) break; /* sorted: nothing after it has mass */
            tok = idx[i];
            acc += d.e[idx[i]];
            if (target < acc) break;
        }
        log_mass = log(mass);
        info->n_kept = keep;
    }
    RS_ASSERT(tok >= 0); /* the max has e = 1 */
    info->logprob = (float)logprob(&d, tok);
    info->logprob_processed = (float)(scaled(&d, tok) - log_mass);
    return tok;
}

int rs_top_logprobs(const float *logits, int vocab, const rs_sampling_params *sp, bool processed, int k,
                    rs_sampler_scratch *s, int32_t *ids, float *lps) {
    if (k <= 0) return 0;
    if (k > vocab) k = vocab;
    dist d;
    if (!dist_init(&d, logits, vocab, inv_temperature(sp->temperature), s)) return -1;
    if (processed && rs_sampling_greedy(sp)) { /* greedy: the point mass on the argmax */
        ids[0] = argmax(logits, vocab);
        lps[0] = 0.0f;
        return 1;
    }
    int32_t *idx = s->idx;
    int n = k;
    double lse = d.lse;
    if (processed && truncates(sp, vocab)) {
        double mass;
        const int keep = truncate_sorted(&d, sp, idx, &mass);
        lse = log(mass);
        if (n > keep) n = keep;
    } else {
        /* partial selection of the k largest logits: k is small (top_logprobs_num) */
        for (int i = 0; i < n; i++) idx[i] = -1;
        for (int v = 0; v < vocab; v++) {
            if (idx[n - 1] >= 0 && !(logits[v] > logits[idx[n - 1]])) continue;
            int j = n - 1;
            while (j > 0 && (idx[j - 1] < 0 || logits[v] > logits[idx[j - 1]])) {
                idx[j] = idx[j - 1];
                j--;
            }
            idx[j] = v;
        }
    }
    for (int i = 0; i < n; i++) {
        ids[i] = idx[i];
        lps[i] = (float)(scaled(&d, idx[i]) - lse);
    }
    return n;
}

float rs_logprob_processed(const float *logits, int vocab, const rs_sampling_params *sp, int32_t token,
                           rs_sampler_scratch *s) {
    dist d;
    if (!dist_init(&d, logits, vocab, inv_temperature(sp->temperature), s)) return NAN;
    if (rs_sampling_greedy(sp)) return argmax(logits, vocab) == token ? 0.0f : -INFINITY;
    if (!truncates(sp, vocab)) return (float)logprob(&d, token);
    double mass;
    const int keep = truncate_sorted(&d, sp, s->idx, &mass);
    for (int i = 0; i < keep; i++)
        if (s->idx[i] == token) return (float)(scaled(&d, token) - log(mass));
    return -INFINITY;
}
