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

__device__ float block_max(smp_shared *sh, float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) sh->fred[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = sh->fred[0];
        for (int w = 1; w < SMP_THREADS / 32; w++) m = fmaxf(m, sh->fred[w]);
        sh->bcast_f = m;
    }
    __syncthreads();
    const float m = sh->bcast_f;
    __syncthreads();
    return m;
}

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
    const int per = (V + SMP_THREADS - 1) / SMP_THREADS, i0 = threadIdx.x * per, i1 = min(V, i0 + per);
    double acc = 0.0;
    int last = -1; /* the chunk's last id with mass */
#pragma unroll 8
    for (int i = i0; i < i1; i++) {
        acc = __dadd_rn(acc, (double)w[i]);
        if (w[i] != 0.0f) last = i;
    }
    sh->chunk[threadIdx.x] = acc;
    sh->last[threadIdx.x] = last;
    __syncthreads();
    if (threadIdx.x == 0) {
        double run = 0.0;
        int tok = -1, c = 0;
        for (; c < SMP_THREADS; c++) {
            if (sh->last[c] >= 0) tok = sh->last[c]; /* the last id with mass so far: rounding's fallback */
            if (target < __dadd_rn(run, sh->chunk[c])) break;
            run = __dadd_rn(run, sh->chunk[c]);
        }
        if (c < SMP_THREADS)
            for (int i = c * per; i < min(V, (c + 1) * per); i++) {
                if (w[i] == 0.0f) continue;
                tok = i;
                run = __dadd_rn(run, (double)w[i]);
                if (target < run) break;
            }
        sh->bcast_i = tok;
    }
    __syncthreads();
    const int tok = sh->bcast_i;
    __syncthreads();
    return tok;
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

__global__ void __launch_bounds__(SMP_THREADS)
    sample_kernel(const float *__restrict__ logits /* [rows][V] */, int V, const rs_sample_req *__restrict__ reqs,
                  int n, float *__restrict__ scratch /* [gridDim.x][V] */, rs_sample_res *__restrict__ res, bool exact) {
    __shared__ smp_shared sh;
    __shared__ int sorted[SMP_SORTED];
    float *w = scratch + (size_t)blockIdx.x * (size_t)V;
    for (int ri = blockIdx.x; ri < n; ri += gridDim.x) {
        const rs_sample_req rq = reqs[ri];
        rs_sample_res *out = &res[ri];
        const float *x = logits + (size_t)rq.row * (size_t)V;
        const int k = min(rq.n_top, V);
        const bool greedy = !(rq.temperature > 0.0f); /* the engine sends 0 for rs_sampling_greedy */
        const double inv_t = greedy ? 1.0 : __ddiv_rn(1.0, (double)rq.temperature);
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
    const int grid = RS_MIN(n, 2 * RS_MAX(c->sm_count, 1));
    rs_sample_req *dreq = (rs_sample_req *)rs_cuda_scratch(c, RS_CUDA_S_SAMPLE_REQ, (size_t)n * sizeof *req);
    rs_sample_res *dres = (rs_sample_res *)rs_cuda_scratch(c, RS_CUDA_S_SAMPLE_RES, (size_t)n * sizeof *res);
    float *w = (float *)rs_cuda_scratch(c, RS_CUDA_S_SAMPLE_W, (size_t)grid * (size_t)vocab * sizeof(float));
    CUDA_CHECK(cudaMemcpyAsync(dreq, req, (size_t)n * sizeof *req, cudaMemcpyHostToDevice, c->stream));
    sample_kernel<<<grid, SMP_THREADS, 0, c->stream>>>(logits, vocab, dreq, n, w, dres,
                                                       c->numerics == RS_NUMERICS_EXACT);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaMemcpyAsync(res, dres, (size_t)n * sizeof *res, cudaMemcpyDeviceToHost, c->stream));
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    for (int i = 0; i < n; i++) c->sampled += res[i].done;
}

extern "C" void rs_backend_cuda_set_device_sampling(rs_backend *b, bool on) { rs_cuda_ctx_of(b)->no_device_sampling = !on; }

/* Requests sampled on the device so far (tests: the engine's hook really ran). */
extern "C" uint64_t rs_cuda_test_sampled(const rs_backend *b) { return ((const rs_cuda_ctx *)b->ctx)->sampled; }
