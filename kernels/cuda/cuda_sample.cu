/*
 * cuda_sample.cu — sampling on the device (kernels/backend.h rs_sample_req), the semantics of
 * scheduler/sampler.c on the same logits, step for step, so that only tokens and logprobs cross to
 * the host:
 *
 *   dist       the CPU's dist_init: max(x) in fp32 (order-free, NaN skipped); d = x - max in fp32;
 *              e = rs_expf(d * (float)(1/T)) with the CPU's Cody-Waite polynomial in correctly
 *              rounded fp32 operations (kernels/cpu/cpu_exp.c), kept in a [vocab] scratch row; the
 *              sum over 16 lanes (lane i % 16 adds e_i in order of i, in double) and the same tree;
 *              lse = log(sum) in double. A row with a NaN, a +inf or no finite entry is invalid:
 *              token -1, which the engine fails as it fails an invalid row sampled on the host.
 *   draw       u = the (seed, sample index, position) splitmix64 draw of rs_rng_uniform, target
 *              u * sum. Without truncation the last id with mass at which the running double sum of
 *              e (in id order) passes target. With top-k / top-p / min-p, the order (logit desc, id
 *              asc) built one element at a time (a block-wide pick of the next element), the CPU's
 *              keep rules over it (top-p on the running sum of e against top_p * sum, min-p on
 *              (x - max) / T >= log(min_p) in double), mass and the draw over the kept prefix; a
 *              request whose kept prefix runs past SMP_SORTED entries is left undone (res.done
 *              false) for the host.
 *   greedy     T = 0 (the engine sends 0 for rs_sampling_greedy's T < 1e-6): the first index of the largest logit; its logprob under T = 1.
 *   logprobs   (x - max) / T - lse (or - log(mass), processed) with the difference and the scaling
 *              in double, per mode as the engine's logprob_in_mode; top logprobs: the first n of the
 *              order (logit desc, id asc), of the kept prefix when processed and truncated.
 * One block of SMP_THREADS threads per request (a grid of at most two per SM loops over the
 * requests), with a [vocab] fp32 scratch row per block for e.
 *
 * Exact numerics keep the CPU's sequential running sum of the draw, so a seeded request draws the
 * same token on both backends from the same logits. Fast numerics sum the draw in per-thread chunks
 * (a different rounding, the same distribution: the token differs only where u falls within
 * rounding of a boundary) to cut the sequential part from vocab to vocab / 256 + 256 additions.
 *
 * Fast numerics also spread a request over many blocks when it needs no sorted order (no top-k /
 * top-p / min-p, no top logprobs: the plain temperature draw and greedy, what RL rollouts ask):
 *   parts      sample_part_kernel, a block per (request, SMP_PART logits): the part's max and
 *              first argmax, a NaN flag, and its sum of rs_expf((x - part max) / T) in double (a
 *              fixed tree), again at T = 1 when the raw logprob needs it;
 *   finish     sample_finish_kernel, a block per request: the row's max, the sum as the parts'
 *              sums rescaled by exp((part max - max) / T) in part order, greedy's argmax, and the
 *              draw: the part where the running sum passes u * sum, then inside it the e of the
 *              exact path (relative to the row's max) summed per thread, then per element.
 * The parts' rescaling rounds differently from the 16-lane sum, so logprobs move by a few fp32 ulps
 * against the CPU's; tokens follow the same distribution. One block over a 151936-entry row took
 * 261 us on an H200 in the single-block kernel, most of it the 16 sequential double chains; the
 * parts put the row on vocab / SMP_PART blocks. Every sum runs in a fixed order, so a request's
 * result never depends on the other requests. Requests that need the order keep the single-block
 * kernel.
 * Libm difference: lse and log(mass) use CUDA's double log, within 1 ulp of glibc's; that can move a
 * returned fp32 logprob by one ulp only when the double result lies within 2^-29 relative of an
 * fp32 rounding boundary.
 */
#include <math.h>
#include <string.h>

#include "cuda_internal.h"

#define SMP_THREADS 256
#define SMP_SORTED RS_SAMPLE_MAX_TOP /* most of the order (p desc, id asc) a request may need */

/* ---- rs_expf (kernels/exp.h, kernels/cpu/cpu_exp.c), the same operations ---- */

__device__ __forceinline__ float pow2i(int e) { return __int_as_float((e + 127) << 23); }

__device__ __forceinline__ float exp_cpu(float x) {
    if (x != x) return __fadd_rn(x, x);
    x = x < -104.0f ? -104.0f : x > 89.0f ? 89.0f : x;
    const float n = __fsub_rn(__fmaf_rn(x, 0x1.715476p+0f, 0x1.8p23f), 0x1.8p23f);
    float r = __fmaf_rn(n, -0x1.62e430p-1f, x);
    r = __fmaf_rn(n, 0x1.05c610p-29f, r); /* -LN2_LO */
    const float r2 = __fmul_rn(r, r);
    float p = __fmaf_rn(0x1.6a22cep-10f, r, 0x1.123abap-7f);
    p = __fmaf_rn(p, r, 0x1.5558f6p-5f);
    p = __fmaf_rn(p, r, 0x1.555490p-3f);
    p = __fmaf_rn(p, r, 0x1.fffffcp-2f);
    const float y = __fadd_rn(__fmaf_rn(p, r2, r), 1.0f);
    const int k = (int)n, k1 = k / 2;
    return __fmul_rn(__fmul_rn(y, pow2i(k1)), pow2i(k - k1));
}

/* ---- rs_rng_uniform (scheduler/sampler.c) ---- */

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

__device__ __forceinline__ double rng_uniform(uint64_t seed, uint64_t sample_index, uint64_t position) {
    uint64_t h = splitmix64(seed);
    h = splitmix64(h ^ splitmix64(sample_index ^ 0x5851f42d4c957f2dull));
    h = splitmix64(h ^ splitmix64(position ^ 0x14057b7ef767814full));
    return __dmul_rn((double)(h >> 11), 0x1.0p-53);
}

/* ---- block helpers (every thread of the block calls them) ---- */

/* The ordered sums (the 16 lanes of dist_init, the exact draw's running sum) are sequential chains
 * of double additions. Read straight from global memory each addition would wait for its load; the
 * block stages SMP_TILE entries of e in shared memory at a time instead, so the chains run at the
 * latency of a double add. A multiple of 16, so lane i % 16 of the tile is lane i % 16 of the row. */
#define SMP_TILE 4096

struct smp_shared {
    float tile[SMP_TILE];
    float fred[SMP_THREADS / 32];
    int ired[SMP_THREADS / 32];
    double lanes[16];
    double chunk[SMP_THREADS];
    int last[SMP_THREADS];
    float bcast_f;
    int bcast_i;
    double bcast_d;
};

/* v reduced by op over the block in a fixed order: shuffles within warps, then thread 0 over the
 * warps' results in warp order (slots: a value a warp; bcast: the total). Every thread gets it. */
template <typename T, typename Op>
__device__ T block_reduce(T v, T *slots, T *bcast, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        T t = slots[0];
        for (int w = 1; w < SMP_THREADS / 32; w++) t = op(t, slots[w]);
        *bcast = t;
    }
    __syncthreads();
    const T t = *bcast;
    __syncthreads();
    return t;
}

struct smp_max_op {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct smp_add_op {
    __device__ double operator()(double a, double b) const { return __dadd_rn(a, b); }
};

__device__ float block_max(smp_shared *sh, float v) { return block_reduce(v, sh->fred, &sh->bcast_f, smp_max_op()); }

/* a before b in the order (value desc, id asc); id < 0 is "none" and comes last */
__device__ __forceinline__ bool before(float va, int ia, float vb, int ib) {
    if (ib < 0) return ia >= 0;
    if (ia < 0) return false;
    return va > vb || (va == vb && ia < ib);
}

/* The first element (value, id) of the block's candidates in the order above; id -1 if none. */
__device__ int block_first(smp_shared *sh, float v, int id) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, id, o);
        if (before(ov, oi, v, id)) v = ov, id = oi;
    }
    if (threadIdx.x % 32 == 0) sh->fred[threadIdx.x / 32] = v, sh->ired[threadIdx.x / 32] = id;
    __syncthreads();
    if (threadIdx.x == 0) {
        float bv = sh->fred[0];
        int bi = sh->ired[0];
        for (int w = 1; w < SMP_THREADS / 32; w++)
            if (before(sh->fred[w], sh->ired[w], bv, bi)) bv = sh->fred[w], bi = sh->ired[w];
        sh->bcast_i = bi;
    }
    __syncthreads();
    const int r = sh->bcast_i;
    __syncthreads();
    return r;
}

/* The CPU's dist_init for logits x at 1/T = inv_t: e into w, returns false for an invalid row
 * (the same verdict on every thread); else *xmax and *sum. */
__device__ bool dist_init(smp_shared *sh, const float *x, int V, double inv_t, float *w, float *xmax, double *sum) {
    float m = -INFINITY;
    for (int i = threadIdx.x; i < V; i += SMP_THREADS)
        if (x[i] > m) m = x[i]; /* NaN skipped, as max_scalar */
    const float mx = block_max(sh, m);
    if (!isfinite(mx)) return false;
    const float inv_tf = (float)inv_t;
    double acc = 0.0; /* lane threadIdx.x (< 16): its entries in order of i */
    for (int base = 0; base < V; base += SMP_TILE) {
        const int nt = min(SMP_TILE, V - base);
        for (int i = threadIdx.x; i < nt; i += SMP_THREADS) {
            const float e = exp_cpu(__fmul_rn(__fsub_rn(x[base + i], mx), inv_tf));
            w[base + i] = e;
            sh->tile[i] = e;
        }
        __syncthreads();
        if (threadIdx.x < 16) {
#pragma unroll 16
            for (int i = threadIdx.x; i < nt; i += 16) acc = __dadd_rn(acc, (double)sh->tile[i]);
        }
        __syncthreads();
    }
    if (threadIdx.x < 16) sh->lanes[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int wd = 8; wd >= 1; wd /= 2)
            for (int l = 0; l < wd; l++) sh->lanes[l] = __dadd_rn(sh->lanes[l], sh->lanes[l + wd]);
        sh->bcast_d = sh->lanes[0];
    }
    __syncthreads();
    const double s = sh->bcast_d;
    __syncthreads();
    *xmax = mx;
    *sum = s;
    return isfinite(s); /* >= 1 otherwise: the max contributes exp(0) */
}

/* (x - max) / T, the difference and the scaling in double (the CPU's scaled) */
__device__ __forceinline__ double scaled(float x, float mx, double inv_t) {
    return __dmul_rn(__dsub_rn((double)x, (double)mx), inv_t);
}

/* The first index of the largest x (a valid row: no NaN). */
__device__ int argmax(smp_shared *sh, const float *x, int V) {
    float bv = -INFINITY;
    int bi = -1;
    for (int i = threadIdx.x; i < V; i += SMP_THREADS)
        if (bi < 0 || x[i] > bv) bv = x[i], bi = i;
    const int r = block_first(sh, bv, bi);
    return r < 0 ? 0 : r;
}

/* sorted[0 .. n) = the first n elements of the order (logit desc, id asc) over x [V]. */
__device__ void sort_prefix(smp_shared *sh, const float *x, int V, int n, int *sorted) {
    float pv = INFINITY;
    int pi = -1;
    for (int s = 0; s < n; s++) {
        float bv = -INFINITY;
        int bi = -1;
        for (int i = threadIdx.x; i < V; i += SMP_THREADS) {
            const float v = x[i];
            const bool after = pi < 0 || v < pv || (v == pv && i > pi);
            if (after && before(v, i, bv, bi)) bv = v, bi = i;
        }
        const int r = block_first(sh, bv, bi);
        if (threadIdx.x == 0) sorted[s] = r;
        pi = r, pv = r >= 0 ? x[r] : pv;
    }
    __syncthreads();
}

/* The chunked draw over ids [i0, V): thread t sums the e of its chunk of `per` ids (from i0 + t per,
 * in order, in double) and notes the chunk's last id with mass; thread 0 then runs the sum from run0
 * over the chunks in order until it passes target, and over that chunk's ids. Where rounding leaves
 * the target unpassed, the last id with mass seen. e(i) gives id i's e. Every thread returns the
 * token. */
template <typename E>
__device__ int chunk_draw(smp_shared *sh, int i0, int per, int V, double run0, double target, E e) {
    const int c0 = i0 + (int)threadIdx.x * per, c1 = min(V, c0 + per);
    double acc = 0.0;
    int last = -1; /* the chunk's last id with mass */
#pragma unroll 8
    for (int i = c0; i < c1; i++) {
        const float v = e(i);
        acc = __dadd_rn(acc, (double)v);
        if (v != 0.0f) last = i;
    }
    sh->chunk[threadIdx.x] = acc;
    sh->last[threadIdx.x] = last;
    __syncthreads();
    if (threadIdx.x == 0) {
        double run = run0;
        int tok = -1, c = 0;
        for (; c < SMP_THREADS; c++) {
            if (sh->last[c] >= 0) tok = sh->last[c]; /* the last id with mass so far: rounding's fallback */
            if (target < __dadd_rn(run, sh->chunk[c])) break;
            run = __dadd_rn(run, sh->chunk[c]);
        }
        if (c < SMP_THREADS)
            for (int i = i0 + c * per; i < min(V, i0 + (c + 1) * per); i++) {
                const float v = e(i);
                if (v == 0.0f) continue;
                tok = i;
                run = __dadd_rn(run, (double)v);
                if (target < run) break;
            }
        sh->bcast_i = tok;
    }
    __syncthreads();
    const int tok = sh->bcast_i;
    __syncthreads();
    return tok;
}

/* e read from the single-block kernel's row w */
struct smp_w_of {
    const float *w;
    __device__ float operator()(int i) const { return w[i]; }
};

/* The draw without truncation: the last id with mass (e > 0) at which the running sum of e in id
 * order passes target. exact: the CPU's sequential double sum; else per-thread chunk sums first. */
__device__ int draw_all(smp_shared *sh, const float *w, int V, double target, bool exact) {
    if (exact) { /* thread 0 runs the sum over tiles of e staged by the block, until it passes target */
        double acc = 0.0;
        int tok = -1;
        for (int base = 0; base < V; base += SMP_TILE) {
            const int nt = min(SMP_TILE, V - base);
            for (int i = threadIdx.x; i < nt; i += SMP_THREADS) sh->tile[i] = w[base + i];
            __syncthreads();
            if (threadIdx.x == 0) {
                bool passed = false;
                for (int i = 0; i < nt && !passed; i++) {
                    const float e = sh->tile[i];
                    if (e == 0.0f) continue;
                    tok = base + i;
                    acc = __dadd_rn(acc, (double)e);
                    passed = target < acc;
                }
                sh->bcast_i = passed;
            }
            __syncthreads();
            const bool passed = sh->bcast_i;
            __syncthreads();
            if (passed) break;
        }
        if (threadIdx.x == 0) sh->bcast_i = tok;
        __syncthreads();
        tok = sh->bcast_i;
        __syncthreads();
        return tok;
    }
    return chunk_draw(sh, 0, (V + SMP_THREADS - 1) / SMP_THREADS, V, 0.0, target, smp_w_of{w});
}

/* The CPU's truncate_sorted over the prefix `sorted` of n_sorted ids: the kept count, or -1 when
 * it depends on elements past the prefix. */
__device__ int keep_count(const rs_sample_req *rq, const float *x, const float *w, int V, float mx, double inv_t,
                          double sum, const int *sorted, int n_sorted) {
    int keep = V;
    if (rq->top_k > 0 && rq->top_k < keep) keep = rq->top_k;
    if (rq->top_p < 1.0f) {
        const double target = __dmul_rn((double)rq->top_p, sum);
        double acc = 0.0;
        int kt = keep;
        for (int i = 0; i < keep; i++) {
            if (i >= n_sorted) return -1;
            acc = __dadd_rn(acc, (double)w[sorted[i]]);
            if (acc >= target) {
                kt = i + 1;
                break;
            }
        }
        keep = kt;
    }
    if (rq->min_p > 0.0f) { /* p >= min_p p_max, i.e. (x - max) / T >= log(min_p) */
        const double floor_lp = log((double)rq->min_p);
        int i = 1;
        while (i < keep) {
            if (i >= n_sorted) return -1;
            if (!(scaled(x[sorted[i]], mx, inv_t) >= floor_lp)) break;
            i++;
        }
        keep = i;
    }
    return keep <= n_sorted ? keep : -1;
}

__device__ __forceinline__ bool truncates(const rs_sample_req *rq, int V) {
    return (rq->top_k > 0 && rq->top_k < V) || rq->top_p < 1.0f || rq->min_p > 0.0f;
}

/* ---- fast numerics: a request over many blocks ---- */

#define SMP_PART      2048 /* logits a part block reads: 8 a thread */
#define SMP_MAX_PARTS 512  /* parts a request may have (a vocabulary up to 1M); larger ones keep one block */

/* Whether fast numerics run request rq over parts: it needs no sorted order (no truncation, no top
 * logprobs unless greedy's point mass answers them) and the vocabulary fits SMP_MAX_PARTS parts.
 * The host splits the requests by it and both kernels skip the others. */
__host__ __device__ __forceinline__ bool smp_parts(const rs_sample_req *rq, int V, bool exact) {
    const bool greedy = !(rq->temperature > 0.0f);
    const bool trunc = !greedy && ((rq->top_k > 0 && rq->top_k < V) || rq->top_p < 1.0f || rq->min_p > 0.0f);
    const bool point_mass = greedy && rq->lp_mode == RS_SAMPLE_LP_PROCESSED;
    return !exact && !trunc && (rq->n_top <= 0 || point_mass) && (V + SMP_PART - 1) / SMP_PART <= SMP_MAX_PARTS;
}

/* 1 / T in double, and 1 for greedy (its logprob is the T = 1 one) */
__device__ __forceinline__ double smp_inv_t(const rs_sample_req *rq) {
    return rq->temperature > 0.0f ? __ddiv_rn(1.0, (double)rq->temperature) : 1.0;
}

/* whether the raw logprob needs the T = 1 sum besides the request's */
__device__ __forceinline__ bool smp_needs_raw(const rs_sample_req *rq, double inv_t) {
    return rq->lp_mode == RS_SAMPLE_LP_RAW && inv_t != 1.0;
}

struct smp_part {
    float max;   /* the part's largest logit (NaN skipped; -inf when it has none larger) */
    int arg;     /* the first index of it */
    int bad;     /* the part holds a NaN */
    double sum;  /* sum of rs_expf((x - max) * (1/T)) over the part, a fixed tree */
    double sum1; /* the same at T = 1, when the raw logprob needs it */
};

/* A double sum over the block in a fixed order (block_reduce). */
__device__ double block_sum_d(smp_shared *sh, double v) { return block_reduce(v, sh->chunk, &sh->bcast_d, smp_add_op()); }

/* e of logit v against max mx at 1/T = inv_tf: the single-block kernel's w entries */
__device__ __forceinline__ float smp_e(float v, float mx, float inv_tf) {
    return exp_cpu(__fmul_rn(__fsub_rn(v, mx), inv_tf));
}

/* e computed from the logits x against the row's max */
struct smp_e_of {
    const float *x;
    float mx, inv_tf;
    __device__ float operator()(int i) const { return smp_e(x[i], mx, inv_tf); }
};

/* The sum of e over a part's logits x[i0, i1) against max mx (0 when mx is not finite). */
__device__ double part_sum(smp_shared *sh, const float *x, int i0, int i1, float mx, double inv_t) {
    if (!isfinite(mx)) return 0.0; /* all -inf (no mass), or +inf (the row is invalid) */
    const float inv_tf = (float)inv_t;
    double acc = 0.0;
    for (int i = i0 + (int)threadIdx.x; i < i1; i += SMP_THREADS) acc = __dadd_rn(acc, (double)smp_e(x[i], mx, inv_tf));
    return block_sum_d(sh, acc);
}

__global__ void __launch_bounds__(SMP_THREADS)
    sample_part_kernel(const float *__restrict__ logits /* [rows][V] */, int V, const rs_sample_req *__restrict__ reqs,
                       smp_part *__restrict__ parts /* [n][gridDim.x] */) {
    __shared__ smp_shared sh;
    const rs_sample_req rq = reqs[blockIdx.y];
    if (!smp_parts(&rq, V, false)) return;
    const float *x = logits + (size_t)rq.row * (size_t)V;
    const int i0 = (int)blockIdx.x * SMP_PART, i1 = min(V, i0 + SMP_PART);
    float bv = -INFINITY;
    int bi = -1, nan = 0;
    for (int i = i0 + (int)threadIdx.x; i < i1; i += SMP_THREADS) {
        const float v = x[i];
        if (v != v) nan = 1;
        else if (bi < 0 || v > bv) bv = v, bi = i; /* the thread's first largest, NaN skipped */
    }
    __shared__ int any_nan;
    if (threadIdx.x == 0) any_nan = 0;
    __syncthreads();
    if (nan) any_nan = 1;
    __syncthreads();
    const int bad = any_nan;
    const int arg = block_first(&sh, bv, bi);
    const float mx = arg >= 0 ? x[arg] : -INFINITY;
    const double inv_t = smp_inv_t(&rq);
    const double sum = part_sum(&sh, x, i0, i1, mx, inv_t);
    const double sum1 = smp_needs_raw(&rq, inv_t) ? part_sum(&sh, x, i0, i1, mx, 1.0) : 0.0;
    if (threadIdx.x == 0)
        parts[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = smp_part{mx, arg, bad, sum, sum1};
}

/* A request's parts p[0, np) combined by thread 0: the row's max and first argmax, whether it is
 * valid, and the rescaled part sums (mass[q] at 1/T; at T = 1 into *sum1 when raw needs it). */
__device__ bool parts_combine(const smp_part *p, int np, double inv_t, bool raw, float *mx, int *arg, double *mass,
                              double *sum, double *sum1) {
    float m = -INFINITY;
    int a = -1;
    bool bad = false;
    for (int q = 0; q < np; q++) {
        bad |= p[q].bad != 0;
        if (p[q].arg >= 0 && (a < 0 || p[q].max > m)) m = p[q].max, a = p[q].arg; /* parts in id order: the first wins ties */
    }
    double s = 0.0, s1 = 0.0;
    for (int q = 0; q < np; q++) {
        mass[q] = 0.0;
        if (!isfinite(p[q].max) || !isfinite(m)) continue;
        const double d = __dsub_rn((double)p[q].max, (double)m);
        mass[q] = __dmul_rn(p[q].sum, exp(__dmul_rn(d, inv_t)));
        s = __dadd_rn(s, mass[q]);
        if (raw) s1 = __dadd_rn(s1, __dmul_rn(p[q].sum1, exp(d)));
    }
    *mx = m, *arg = a, *sum = s, *sum1 = s1;
    return !bad && isfinite(m) && isfinite(s) && s > 0.0;
}

/* The draw over parts: the part where the running sum of mass passes target, then inside it the
 * per-thread sums of e (8 consecutive logits a thread), then the elements. Rounding between the
 * rescaled part sums and the elements' e can leave the target unpassed: then the last id with mass
 * seen, as draw_all's fast path. Every thread returns the token. */
__device__ int parts_draw(smp_shared *sh, const float *x, int V, int np, const double *mass, float mx, double inv_t,
                          double target) {
    __shared__ int part;
    __shared__ double before;
    if (threadIdx.x == 0) {
        double run = 0.0;
        int q = 0, last = -1;
        for (; q < np; q++) {
            if (mass[q] > 0.0) last = q;
            if (target < __dadd_rn(run, mass[q])) break;
            run = __dadd_rn(run, mass[q]);
        }
        if (q == np) { /* rounding: the last part with mass, from its start */
            q = last;
            run = 0.0;
            for (int r = 0; r < q; r++) run = __dadd_rn(run, mass[r]);
        }
        part = q, before = run;
    }
    __syncthreads();
    return chunk_draw(sh, part * SMP_PART, SMP_PART / SMP_THREADS, V, before, target,
                      smp_e_of{x, mx, (float)inv_t});
}

__global__ void __launch_bounds__(SMP_THREADS)
    sample_finish_kernel(const float *__restrict__ logits /* [rows][V] */, int V, const rs_sample_req *__restrict__ reqs,
                         const smp_part *__restrict__ parts /* [n][np] */, int np, rs_sample_res *__restrict__ res) {
    __shared__ smp_shared sh;
    __shared__ double mass[SMP_MAX_PARTS];
    __shared__ float s_mx;
    __shared__ int s_arg, s_ok;
    __shared__ double s_sum, s_sum1;
    const rs_sample_req rq = reqs[blockIdx.x];
    if (!smp_parts(&rq, V, false)) return;
    rs_sample_res *out = &res[blockIdx.x];
    const float *x = logits + (size_t)rq.row * (size_t)V;
    const bool greedy = !(rq.temperature > 0.0f);
    const double inv_t = smp_inv_t(&rq);
    const bool raw = smp_needs_raw(&rq, inv_t);
    if (threadIdx.x == 0)
        s_ok = parts_combine(parts + (size_t)blockIdx.x * np, np, inv_t, raw, &s_mx, &s_arg, mass, &s_sum, &s_sum1);
    __syncthreads();
    if (!s_ok) { /* invalid row: token -1, the engine fails it */
        if (threadIdx.x == 0) out->done = true, out->token = -1, out->logprob = NAN, out->n_top = 0;
        return;
    }
    const float mx = s_mx;
    const double sum = s_sum;
    const int tok = greedy ? s_arg
                           : parts_draw(&sh, x, V, np, mass, mx, inv_t,
                                        __dmul_rn(rng_uniform(rq.seed, rq.sample_index, rq.position), sum));
    if (threadIdx.x != 0) return;
    float lp;
    int n_top = 0;
    if (greedy && rq.lp_mode == RS_SAMPLE_LP_PROCESSED) { /* a point mass */
        lp = 0.0f;
        if (rq.n_top > 0) out->top_ids[0] = tok, out->top_lps[0] = 0.0f, n_top = 1;
    } else { /* untruncated: processed is the default (1/T, the whole mass); raw at T = 1 */
        const double inv_r = raw ? 1.0 : inv_t, lse_r = log(raw ? s_sum1 : sum);
        lp = (float)__dsub_rn(scaled(x[tok], mx, inv_r), lse_r);
    }
    out->done = true;
    out->token = tok;
    out->logprob = lp;
    out->n_top = n_top;
}

__global__ void __launch_bounds__(SMP_THREADS)
    sample_kernel(const float *__restrict__ logits /* [rows][V] */, int V, const rs_sample_req *__restrict__ reqs,
                  int n, float *__restrict__ scratch /* [gridDim.x][V] */, rs_sample_res *__restrict__ res, bool exact) {
    __shared__ smp_shared sh;
    __shared__ int sorted[SMP_SORTED];
    float *w = scratch + (size_t)blockIdx.x * (size_t)V;
    for (int ri = blockIdx.x; ri < n; ri += gridDim.x) {
        const rs_sample_req rq = reqs[ri];
        if (smp_parts(&rq, V, exact)) continue; /* sample_part_kernel and sample_finish_kernel's */
        rs_sample_res *out = &res[ri];
        const float *x = logits + (size_t)rq.row * (size_t)V;
        const int k = min(rq.n_top, V);
        const bool greedy = !(rq.temperature > 0.0f); /* the engine sends 0 for rs_sampling_greedy */
        const double inv_t = smp_inv_t(&rq);
        bool done = true;
        int tok = -1, n_top = 0;
        float lp = NAN, mx;
        double sum;
        if (!dist_init(&sh, x, V, inv_t, w, &mx, &sum)) { /* invalid row: token -1, the engine fails it */
            if (threadIdx.x == 0) out->done = true, out->token = -1, out->logprob = NAN, out->n_top = 0;
            __syncthreads();
            continue;
        }
        const double lse = log(sum);
        double log_mass = lse;
        int keep = V;
        const bool trunc = !greedy && truncates(&rq, V);
        const bool point_mass = greedy && rq.lp_mode == RS_SAMPLE_LP_PROCESSED;
        int need = trunc ? min(SMP_SORTED, V) : 0; /* the order (logit desc, id asc) does not depend on T */
        if (k > 0 && !point_mass) need = max(need, k);
        if (need > 0) sort_prefix(&sh, x, V, need, sorted);
        if (greedy) {
            tok = argmax(&sh, x, V);
        } else if (trunc) {
            keep = keep_count(&rq, x, w, V, mx, inv_t, sum, sorted, need);
            if (keep < 0) {
                done = false;
            } else {
                double mass = 0.0;
                for (int i = 0; i < keep; i++) mass = __dadd_rn(mass, (double)w[sorted[i]]);
                const double target = __dmul_rn(rng_uniform(rq.seed, rq.sample_index, rq.position), mass);
                double acc = 0.0;
                tok = sorted[0];
                for (int i = 0; i < keep; i++) {
                    if (w[sorted[i]] == 0.0f) break; /* sorted: nothing after it has mass */
                    tok = sorted[i];
                    acc = __dadd_rn(acc, (double)w[sorted[i]]);
                    if (target < acc) break;
                }
                log_mass = log(mass);
            }
        } else {
            tok = draw_all(&sh, w, V, __dmul_rn(rng_uniform(rq.seed, rq.sample_index, rq.position), sum), exact);
        }
        if (done) {
            /* the distribution the mode reports: raw is the T = 1 one (the same row when T is 1) */
            double inv_r = inv_t, lse_r = lse, lmass_r = lse;
            if (rq.lp_mode == RS_SAMPLE_LP_RAW && inv_t != 1.0) {
                double sum1;
                float mx1;
                dist_init(&sh, x, V, 1.0, w, &mx1, &sum1); /* valid: the same row */
                inv_r = 1.0, lse_r = log(sum1), lmass_r = lse_r;
            } else if (rq.lp_mode == RS_SAMPLE_LP_PROCESSED) {
                lmass_r = log_mass;
            }
            if (point_mass) {
                lp = 0.0f;
                n_top = k > 0 ? 1 : 0;
                if (threadIdx.x == 0 && k > 0) out->top_ids[0] = tok, out->top_lps[0] = 0.0f;
            } else {
                lp = (float)__dsub_rn(scaled(x[tok], mx, inv_r), lmass_r);
                n_top = rq.lp_mode == RS_SAMPLE_LP_PROCESSED && trunc ? min(k, keep) : k;
                if (threadIdx.x == 0)
                    for (int i = 0; i < n_top; i++) {
                        out->top_ids[i] = sorted[i];
                        out->top_lps[i] = (float)__dsub_rn(scaled(x[sorted[i]], mx, inv_r), lmass_r);
                    }
            }
        }
        if (threadIdx.x == 0) {
            out->done = done;
            out->token = done ? tok : 0;
            out->logprob = done ? lp : 0.0f;
            out->n_top = done ? n_top : 0;
        }
        __syncthreads();
    }
}

void rs_cuda_op_sample(rs_backend *b, const float *logits, int vocab, const rs_sample_req *req, int n, rs_sample_res *res) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    if (n <= 0) return;
    if (c->no_device_sampling) {
        for (int i = 0; i < n; i++) res[i].done = false, res[i].n_top = 0;
        return;
    }
    const bool exact = c->numerics == RS_NUMERICS_EXACT;
    int n_parts = 0; /* requests that run over parts (fast numerics); the rest take one block each */
    for (int i = 0; i < n; i++) n_parts += smp_parts(&req[i], vocab, exact);
    const int grid = RS_MIN(n - n_parts, 2 * RS_MAX(c->sm_count, 1));
    const int np = (vocab + SMP_PART - 1) / SMP_PART;
    rs_sample_req *dreq = (rs_sample_req *)rs_cuda_scratch(c, RS_CUDA_S_SAMPLE_REQ, (size_t)n * sizeof *req);
    rs_sample_res *dres = (rs_sample_res *)rs_cuda_scratch(c, RS_CUDA_S_SAMPLE_RES, (size_t)n * sizeof *res);
    /* one scratch: the single-block kernel's e rows [grid][vocab], then the parts [n][np] */
    const size_t w_bytes = (size_t)grid * (size_t)vocab * sizeof(float);
    const size_t parts_at = (w_bytes + 15) & ~(size_t)15;
    char *scratch = (char *)rs_cuda_scratch(c, RS_CUDA_S_SAMPLE_W,
                                            parts_at + (n_parts > 0 ? (size_t)n * (size_t)np * sizeof(smp_part) : 0));
    CUDA_CHECK(cudaMemcpyAsync(dreq, req, (size_t)n * sizeof *req, cudaMemcpyHostToDevice, c->stream));
    if (n_parts > 0) {
        smp_part *parts = (smp_part *)(void *)(scratch + parts_at);
        sample_part_kernel<<<dim3((unsigned)np, (unsigned)n), SMP_THREADS, 0, c->stream>>>(logits, vocab, dreq, parts);
        CUDA_CHECK_LAUNCH();
        sample_finish_kernel<<<(unsigned)n, SMP_THREADS, 0, c->stream>>>(logits, vocab, dreq, parts, np, dres);
        CUDA_CHECK_LAUNCH();
    }
    if (grid > 0) {
        sample_kernel<<<grid, SMP_THREADS, 0, c->stream>>>(logits, vocab, dreq, n, (float *)(void *)scratch, dres, exact);
        CUDA_CHECK_LAUNCH();
    }
    CUDA_CHECK(cudaMemcpyAsync(res, dres, (size_t)n * sizeof *res, cudaMemcpyDeviceToHost, c->stream));
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    for (int i = 0; i < n; i++) c->sampled += res[i].done;
}

extern "C" void rs_backend_cuda_set_device_sampling(rs_backend *b, bool on) { rs_cuda_ctx_of(b)->no_device_sampling = !on; }

/* Requests sampled on the device so far (tests: the engine's hook really ran). */
extern "C" uint64_t rs_cuda_test_sampled(const rs_backend *b) { return ((const rs_cuda_ctx *)b->ctx)->sampled; }
