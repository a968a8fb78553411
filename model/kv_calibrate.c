/*
 * kv_calibrate.c — FP8 KV scales from a calibration run (kv_calibrate.h says what and why).
 *
 * The calibration sequence is prefilled in chunks of RS_KV_CALIB_CHUNK rows, as one sequence, into
 * a temporary fp32 pool sized for exactly that sequence; then each layer's pages are downloaded
 * once and, per KV head and half (K, V), the |x| of the written slots are gathered into one buffer
 * whose percentile is found by selection (O(n), no sort). Nothing here depends on the backend
 * beyond the forward pass and rs_backend_download.
 */
#include "kv_calibrate.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/fp8.h"
#include "../kvcache/kvcache.h"

#define RS_KV_CALIB_CHUNK 256 /* rows per forward step */

/* ---- the default token set ---- */

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

enum { SEG = 128, SEG_RANDOM = 96, SEG_COPY = 24 }; /* the rest of a segment repeats one id */
_Static_assert(SEG_RANDOM >= SEG_COPY, "the first segment copies from its own random part");

void rs_kv_calib_default_tokens(int vocab, int32_t *out, int n) {
    RS_ASSERT(vocab > 0 && n >= 0);
    uint64_t rng = 0x6b765f63616c6962ull; /* "kv_calib" */
    for (int base = 0; base < n; base += SEG) {
        int end = RS_MIN(base + SEG, n), copy = base + SEG_RANDOM, repeat = copy + SEG_COPY;
        for (int i = base; i < RS_MIN(copy, end); i++) out[i] = (int32_t)(splitmix64(&rng) % (uint64_t)vocab);
        /* the copied span [src, src + SEG_COPY) lies within the ids before `copy` */
        int src = (int)(splitmix64(&rng) % (uint64_t)(copy - SEG_COPY + 1));
        int32_t rep = (int32_t)(splitmix64(&rng) % (uint64_t)vocab);
        for (int i = copy; i < RS_MIN(repeat, end); i++) out[i] = out[src + (i - copy)];
        for (int i = repeat; i < end; i++) out[i] = rep;
    }
}

/* ---- statistics ---- */

/* The k-th smallest of a[0..n) (0-based), reordering a. Hoare partition around the median of
 * three: deterministic, expected O(n). */
static float select_kth(float *a, size_t n, size_t k) {
    size_t lo = 0, hi = n - 1;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        float x = a[lo], y = a[mid], z = a[hi];
        float pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        size_t i = lo, j = hi;
        for (;;) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i >= j) break;
            float t = a[i];
            a[i] = a[j], a[j] = t;
            i++, j--;
        }
        /* now a[lo..j] <= pivot <= a[j+1..hi] */
        if (k <= j) hi = j;
        else lo = j + 1;
    }
    return a[k];
}

/* The nearest-rank percentile p in (0, 1] of a[0..n) (n >= 1): the ceil(p n)-th smallest. */
static float percentile_of(float *a, size_t n, float p) {
    if (p >= 1.0f) {
        float m = a[0];
        for (size_t i = 1; i < n; i++) m = a[i] > m ? a[i] : m;
        return m;
    }
    double r = ceil((double)p * (double)n);
    size_t k = r < 1.0 ? 0 : (size_t)r - 1;
    return select_kth(a, n, k < n ? k : n - 1);
}

/* max(stat * margin, floor) / 448, raised an ulp at a time until stat * margin / scale <= 448.
 * A finite stat whose product with the margin overflows is taken as FLT_MAX (the scale stays
 * finite: inf / inf would end the loop with an infinite scale). */
static float scale_for(float stat, float margin) {
    float a = fminf(fmaxf(stat * margin, RS_KV_CALIB_SCALE_FLOOR), FLT_MAX);
    float s = a / RS_FP8_E4M3_MAX;
    while (a / s > RS_FP8_E4M3_MAX) s = nextafterf(s, INFINITY);
    return s;
}

/* ---- calibration ---- */

static int check_opts(const rs_model_config *c, const rs_kv_calib_opts *o, int n, rs_error *err) {
    if (!(o->percentile > 0.0f && o->percentile <= 1.0f))
        return rs_error_set(err, RS_EINVAL, "kv_calib.percentile", "kv calibration percentile %g is not in (0, 1]",
                            (double)o->percentile);
    if (!(isfinite(o->margin) && o->margin > 0.0f))
        return rs_error_set(err, RS_EINVAL, "kv_calib.margin", "kv calibration margin %g is not finite and > 0",
                            (double)o->margin);
    if (n < 1 || n > c->max_position)
        return rs_error_set(err, RS_EINVAL, "kv_calib.n_tokens",
                            "kv calibration needs 1..%d tokens (max_position), got %d", c->max_position, n);
    if (o->tokens) {
        for (int i = 0; i < n; i++)
            if (o->tokens[i] < 0 || o->tokens[i] >= c->vocab_size)
                return rs_error_set(err, RS_EINVAL, "kv_calib.tokens",
                                    "kv calibration token %d at %d is outside the vocabulary (%d)", o->tokens[i], i,
                                    c->vocab_size);
    }
    return RS_OK;
}

/* Prefills tokens[0..n) as one sequence s into pool. */
static void run_sequence(rs_forward_ctx *f, rs_kv_pool *pool, const rs_kv_seq *s, const int32_t *tokens, int n) {
    int32_t pos[RS_KV_CALIB_CHUNK], slot[RS_KV_CALIB_CHUNK];
    for (int p0 = 0; p0 < n; p0 += RS_KV_CALIB_CHUNK) {
        int rows = RS_MIN(RS_KV_CALIB_CHUNK, n - p0);
        for (int i = 0; i < rows; i++) {
            pos[i] = p0 + i;
            slot[i] = rs_kv_slot(s, p0 + i);
        }
        int32_t seq_start[2] = {0, rows}, seq_ctx[1] = {p0 + rows};
        rs_batch batch = {.n_tok = rows,
                          .n_seq = 1,
                          .tokens = tokens + p0,
                          .pos = pos,
                          .slot = slot,
                          .seq_start = seq_start,
                          .seq_ctx = seq_ctx,
                          .block_tables = s->blocks,
                          .max_blocks = s->n_blocks};
        rs_forward(f, &batch, pool->layers, NULL, 0, NULL);
    }
}

/* Scales of one layer from its downloaded pages [n_blocks][2][16][n_kv][hd] f32; vals: [n * hd]. */
static int layer_scales(const rs_kv_calib_opts *o, const rs_kv_seq *s, int n, int layer, int n_kv, int hd,
                        const float *pages, float *vals, float *k_out, float *v_out, rs_error *err) {
    size_t row = (size_t)n_kv * (size_t)hd;
    for (int half = 0; half < 2; half++) {
        for (int h = 0; h < n_kv; h++) {
            size_t m = 0;
            for (int p = 0; p < n; p++) {
                size_t slot = (size_t)rs_kv_slot(s, p), block = slot / RS_KV_BLOCK, off = slot % RS_KV_BLOCK;
                const float *x = pages + ((block * 2 + (size_t)half) * RS_KV_BLOCK + off) * row + (size_t)h * hd;
                for (int i = 0; i < hd; i++) {
                    if (!isfinite(x[i]))
                        return rs_error_set(err, RS_EINVAL, "kv_calib",
                                            "kv calibration: layer %d kv head %d: %s value %g at position %d",
                                            layer, h, half ? "V" : "K", (double)x[i], p);
                    vals[m++] = fabsf(x[i]);
                }
            }
            float sc = scale_for(percentile_of(vals, m, o->percentile), o->margin);
            (half ? v_out : k_out)[h] = sc;
        }
    }
    return RS_OK;
}

int rs_kv_calibrate(const rs_model *m, const rs_kv_calib_opts *o, float *k_scales, float *v_scales, rs_error *err) {
    const rs_model_config *c = &m->cfg;
    int n = o->n_tokens;
    if (!o->tokens && n <= 0) n = RS_MIN(RS_KV_CALIB_DEFAULT_TOKENS, c->max_position);
    int rc = check_opts(c, o, n, err);
    if (rc != RS_OK) return rc;
    double t0 = rs_now_s();

    int32_t *own_tokens = NULL;
    const int32_t *tokens = o->tokens;
    rs_kv_pool pool = {0};
    rs_kv_seq seq = {0};
    rs_forward_ctx *f = NULL;
    float *pages = NULL, *vals = NULL, *ks = NULL, *vs = NULL;
    size_t n_scales = (size_t)c->n_layers * (size_t)c->n_kv_heads;
    if (!tokens) {
        own_tokens = rs_xmalloc(sizeof(int32_t) * (size_t)n);
        rs_kv_calib_default_tokens(c->vocab_size, own_tokens, n);
        if (c->bos_token_id >= 0 && c->bos_token_id < c->vocab_size) own_tokens[0] = c->bos_token_id;
        tokens = own_tokens;
    }

    int n_blocks = (n + RS_KV_BLOCK - 1) / RS_KV_BLOCK;
    rs_kv_cache_opts ko = {.dtype = RS_DTYPE_F32, .scale_mode = RS_KV_SCALE_NONE};
    rs_kv_pool shape = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                        .dtype = RS_DTYPE_F32};
    size_t layer_bytes = rs_kv_bytes_per_block(&shape) / (size_t)c->n_layers * (size_t)n_blocks;
    if ((rc = rs_kv_pool_init_ex(&pool, m->backend, c->n_layers, c->n_kv_heads, c->head_dim, &ko,
                                 rs_kv_bytes_per_block(&shape) * (size_t)n_blocks)) != RS_OK) {
        rc = rs_error_set(err, rc, "kv_calib", "kv calibration: cannot allocate an fp32 KV cache for %d tokens", n);
        goto fail;
    }
    RS_ASSERT(pool.n_blocks == n_blocks);
    rc = rs_kv_seq_reserve(&pool, &seq, n);
    RS_ASSERT(rc == RS_OK); /* the pool was sized for exactly this sequence */
    if (!(f = rs_forward_ctx_init(m, RS_MIN(n, RS_KV_CALIB_CHUNK), 1))) {
        rc = rs_error_set(err, RS_ENOMEM, "kv_calib", "kv calibration: cannot allocate activations");
        goto fail;
    }
    run_sequence(f, &pool, &seq, tokens, n);

    pages = rs_xmalloc(layer_bytes);
    vals = rs_xmalloc(sizeof(float) * (size_t)n * (size_t)c->head_dim);
    ks = rs_xmalloc(sizeof(float) * n_scales); /* the caller's arrays change only on success */
    vs = rs_xmalloc(sizeof(float) * n_scales);
    for (int l = 0; l < c->n_layers; l++) {
        rs_backend_download(m->backend, pages, pool.layers[l].pages, layer_bytes);
        size_t at = (size_t)l * (size_t)c->n_kv_heads;
        if ((rc = layer_scales(o, &seq, n, l, c->n_kv_heads, c->head_dim, pages, vals, ks + at, vs + at, err)) !=
            RS_OK)
            goto fail;
    }
    float kmin = INFINITY, kmax = 0.0f, vmin = INFINITY, vmax = 0.0f;
    for (size_t i = 0; i < n_scales; i++) {
        kmin = fminf(kmin, ks[i]), kmax = fmaxf(kmax, ks[i]);
        vmin = fminf(vmin, vs[i]), vmax = fmaxf(vmax, vs[i]);
    }
    memcpy(k_scales, ks, sizeof(float) * n_scales);
    memcpy(v_scales, vs, sizeof(float) * n_scales);
    RS_INFO("kv calibrate | %d tokens%s, percentile %g, margin %g | k scale %.4g..%.4g, v scale %.4g..%.4g | %.2f s",
            n, own_tokens ? " (default set)" : "", (double)o->percentile, (double)o->margin, (double)kmin,
            (double)kmax, (double)vmin, (double)vmax, rs_now_s() - t0);
    rc = RS_OK;
fail:
    free(vs);
    free(ks);
    free(vals);
    free(pages);
    rs_forward_ctx_free(f);
    if (pool.layers) {
        rs_kv_seq_release(&pool, &seq);
        rs_kv_pool_free(&pool);
    }
    free(own_tokens);
    return rc;
}
