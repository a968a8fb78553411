/*
 * test_cuda_attention.c — the CUDA kv_store and attention (kernels/cuda/cuda_attention.cu) against
 * the CPU backend, the reference, on the same inputs (built with `make CUDA=1`; skipped without a
 * GPU). Every case runs on F32, BF16, E4M3 per-head and E4M3 per-token pages.
 *
 *   kv_store   pages and per-token scales equal the CPU's byte for byte, with zeros, an all-zero
 *              head (the amax floor), NaNs of both signs, infinities, fp32 subnormals and values far
 *              beyond 448 * scale (saturation), into distinct random slots over several pages.
 *   attention  a mixed batch over shuffled pages: a decode row at context 700 (44 pages), a prefill
 *              chunk of 20 rows at positions 30..49 of another sequence, a 1-token sequence; group
 *              sizes 1, 2, 4 and 12 (12 with head_dim 256 splits the group over two blocks, 8 + 4
 *              heads), head_dim 40, 64, 128 and 256. The pages are filled by kv_store on both backends
 *              and checked equal first, so the two attentions read the same K/V bits; their outputs
 *              then differ only by fp32 summation order and expf (see the tolerance below).
 */
#ifdef RS_CUDA
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "test.h"
#include "test_util.h"

/* ---- helpers ---- */

static void shuffle(int32_t *a, int n, uint64_t *rng) {
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(rs_test_rng(rng) % (uint64_t)(i + 1));
        int32_t t = a[i];
        a[i] = a[j], a[j] = t;
    }
}

typedef struct kv_kind {
    rs_dtype dt;
    rs_kv_scale_mode mode;
    const char *name;
} kv_kind;

static const kv_kind kv_kinds[] = {
    {RS_DTYPE_F32, RS_KV_SCALE_NONE, "f32"},
    {RS_DTYPE_BF16, RS_KV_SCALE_NONE, "bf16"},
    {RS_DTYPE_E4M3, RS_KV_SCALE_PER_HEAD, "e4m3 per-head"},
    {RS_DTYPE_E4M3, RS_KV_SCALE_PER_TOKEN, "e4m3 per-token"},
};
#define N_KINDS ((int)(sizeof kv_kinds / sizeof kv_kinds[0]))

static size_t page_bytes(const rs_kv_layer *kv) {
    return (size_t)kv->n_blocks * 2 * RS_KV_BLOCK * (size_t)kv->n_kv_heads * (size_t)kv->head_dim *
           rs_dtype_size(kv->dtype);
}

static size_t token_scale_bytes(const rs_kv_layer *kv) {
    return (size_t)kv->n_blocks * 2 * RS_KV_BLOCK * (size_t)kv->n_kv_heads * sizeof(float);
}

/* A zeroed layer in b's memory; PER_HEAD takes the scales ks, vs [n_kv]. */
static rs_kv_layer layer_new(rs_backend *b, const kv_kind *kind, int n_blocks, int n_kv, int hd, const float *ks,
                             const float *vs) {
    rs_kv_layer kv = {.dtype = kind->dt, .n_blocks = n_blocks, .n_kv_heads = n_kv, .head_dim = hd,
                      .scale_mode = kind->mode};
    kv.pages = rs_backend_alloc(b, page_bytes(&kv));
    ASSERT_TRUE(kv.pages != NULL);
    if (kind->mode == RS_KV_SCALE_PER_HEAD) {
        kv.k_scale = rs_test_to_backend(b, ks, (size_t)n_kv * sizeof(float));
        kv.v_scale = rs_test_to_backend(b, vs, (size_t)n_kv * sizeof(float));
    } else if (kind->mode == RS_KV_SCALE_PER_TOKEN) {
        kv.token_scales = rs_backend_alloc(b, token_scale_bytes(&kv));
        ASSERT_TRUE(kv.token_scales != NULL);
    }
    return kv;
}

/* The pages (and per-token scales) of the CPU's layer kc and the GPU's kg, byte for byte. On a
 * difference, names the first element: (slot, half, head, dim) and both values' bytes. */
static void assert_same_layers(rs_backend *c, const rs_kv_layer *kc, rs_backend *g, const rs_kv_layer *kg,
                               const char *what) {
    const size_t es = rs_dtype_size(kc->dtype), hd = (size_t)kc->head_dim, n_kv = (size_t)kc->n_kv_heads;
    for (int part = 0; part < 2; part++) {
        if (part == 1 && kc->scale_mode != RS_KV_SCALE_PER_TOKEN) break;
        const size_t bytes = part == 0 ? page_bytes(kc) : token_scale_bytes(kc);
        const size_t elem = part == 0 ? es : sizeof(float), row = part == 0 ? n_kv * hd : n_kv;
        unsigned char *a = rs_test_to_host(c, part == 0 ? kc->pages : (void *)kc->token_scales, bytes);
        unsigned char *b = rs_test_to_host(g, part == 0 ? kg->pages : (void *)kg->token_scales, bytes);
        for (size_t i = 0; i < bytes; i++) {
            if (a[i] == b[i]) continue;
            size_t e = i / elem, r = e / row, in_row = e % row; /* r = (block * 2 + half) * 16 + off */
            size_t blk = r / (2 * RS_KV_BLOCK), half = r / RS_KV_BLOCK % 2, off = r % RS_KV_BLOCK;
            uint32_t va = 0, vb = 0;
            memcpy(&va, a + e * elem, elem), memcpy(&vb, b + e * elem, elem);
            if (part == 0)
                RS_TEST_FAIL("%s: pages differ at slot %zu %s head %zu dim %zu: cpu 0x%0*x, cuda 0x%0*x", what,
                             blk * RS_KV_BLOCK + off, half ? "V" : "K", in_row / hd, in_row % hd, (int)(2 * elem), va,
                             (int)(2 * elem), vb);
            RS_TEST_FAIL("%s: token_scales differ at slot %zu %s head %zu: cpu %.9g (0x%08x), cuda %.9g (0x%08x)",
                         what, blk * RS_KV_BLOCK + off, half ? "V" : "K", in_row, (double)((float *)a)[e], va,
                         (double)((float *)b)[e], vb);
        }
        free(a), free(b);
    }
}

/* kv_store of host k, v [n][n_kv][hd] into `slot` [n] on both backends. */
static void store_both(rs_backend *c, rs_kv_layer *kc, rs_backend *g, rs_kv_layer *kg, const float *k, const float *v,
                       const int32_t *slot, int n) {
    const size_t bytes = (size_t)n * (size_t)kc->n_kv_heads * (size_t)kc->head_dim * sizeof(float);
    int32_t start[2] = {0, n};
    rs_batch bt = {.n_tok = n, .n_seq = 1, .slot = slot, .seq_start = start};
    rs_backend *be[2] = {c, g};
    rs_kv_layer *kv[2] = {kc, kg};
    for (int i = 0; i < 2; i++) {
        float *dk = rs_test_to_backend(be[i], k, bytes), *dv = rs_test_to_backend(be[i], v, bytes);
        rs_op_kv_store(be[i], kv[i], dk, dv, &bt);
        rs_backend_free_mem(be[i], dk); /* synchronizes before the free */
        rs_backend_free_mem(be[i], dv);
    }
}

/* ---- kv_store ---- */

RS_TEST(cuda_kv_store_matches_cpu) {
    rs_backend *g = rs_test_cuda_or_skip();
    rs_backend *c = rs_backend_cpu_init(2);
    uint64_t rng = 11;
    enum { N_BLOCKS = 8, N_SLOTS = N_BLOCKS * RS_KV_BLOCK, N1 = 45, N2 = 20 };
    static const int shapes[][2] = {{4, 128}, {3, 7}, {2, 256}}; /* n_kv, head_dim */
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int n_kv = shapes[si][0], hd = shapes[si][1];
        const size_t row = (size_t)n_kv * (size_t)hd, n = (size_t)(N1 + N2) * row;
        for (int ki = 0; ki < N_KINDS; ki++) {
            const kv_kind *kind = &kv_kinds[ki];
            int32_t slots[N_SLOTS];
            for (int i = 0; i < N_SLOTS; i++) slots[i] = i;
            shuffle(slots, N_SLOTS, &rng);
            float *k = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float));
            for (size_t i = 0; i < n; i++) {
                k[i] = 3.0f * rs_test_uniform(&rng);
                v[i] = 2.0f * rs_test_uniform(&rng);
                if (i % 11 == 3) k[i] = 0.0f, v[i] = -0.0f;
            }
            for (size_t i = 0; i < (size_t)hd; i++) k[2 * row + i] = 0.0f; /* an all-zero head: the floor */
            for (size_t i = 0; i < (size_t)hd; i++) v[5 * row + i] = 1e-4f * rs_test_uniform(&rng); /* E4M3 subnormals */
            k[1] = NAN, v[row + 2] = -NAN, k[7 * row + 1] = INFINITY, v[9 * row] = -INFINITY;
            k[4 * row] = 1e5f, k[4 * row + 1] = -3e4f, v[6 * row] = 1e30f, v[N1 * row + 3] = -5000.0f;
            k[8 * row] = 1e-40f, v[8 * row + 1] = -3e-39f; /* fp32 subnormals */
            /* per-head scales so small that |x| / scale > 448 for many of the values above */
            float ks[4], vs[4];
            for (int h = 0; h < n_kv; h++) ks[h] = 0.005f * (float)(h + 1), vs[h] = 0.0037f * (float)(h + 2);
            char what[96];
            snprintf(what, sizeof what, "kv_store %s n_kv %d hd %d", kind->name, n_kv, hd);
            rs_kv_layer kc = layer_new(c, kind, N_BLOCKS, n_kv, hd, ks, vs);
            rs_kv_layer kg = layer_new(g, kind, N_BLOCKS, n_kv, hd, ks, vs);
            /* two batches, as two steps: the second's slots reach the GPU through the mirror again */
            store_both(c, &kc, g, &kg, k, v, slots, N1);
            store_both(c, &kc, g, &kg, k + (size_t)N1 * row, v + (size_t)N1 * row, slots + N1, N2);
            assert_same_layers(c, &kc, g, &kg, what);
            rs_test_kv_layer_free(c, &kc);
            rs_test_kv_layer_free(g, &kg);
            free(k), free(v);
        }
    }
    rs_backend_free(c);
    rs_backend_free(g);
}

/* ---- attention ---- */

/* A decodes at 699 (context 700), B prefills positions 30..49 after 0..29 were stored by an
 * earlier step, C is a 1-token sequence. */
enum { A_CTX = 700, B_HIST = 30, B_ROWS = 20, N_SEQ = 3, MAX_BLOCKS = (A_CTX + RS_KV_BLOCK - 1) / RS_KV_BLOCK,
       N_PAGES = 64 };
static const int seq_ctx_of[N_SEQ] = {A_CTX, B_HIST + B_ROWS, 1};
static const int seq_first[N_SEQ] = {A_CTX - 1, B_HIST, 0}; /* the first position of this step */

/* One attention case on both backends; returns the worst |cuda - cpu| / tol. */
static double check_attention(rs_backend *c, rs_backend *g, const kv_kind *kind, int n_heads, int n_kv, int hd,
                              uint64_t *rng) {
    const size_t row = (size_t)n_kv * (size_t)hd;
    /* block tables over a shuffled page list; unused entries -1 (nothing may read them) */
    int32_t pages[N_PAGES], tables[N_SEQ * MAX_BLOCKS];
    for (int i = 0; i < N_PAGES; i++) pages[i] = i;
    shuffle(pages, N_PAGES, rng);
    int used = 0;
    for (int s = 0; s < N_SEQ; s++)
        for (int blk = 0; blk < MAX_BLOCKS; blk++)
            tables[s * MAX_BLOCKS + blk] = blk * RS_KV_BLOCK < seq_ctx_of[s] ? pages[used++] : -1;
    ASSERT_TRUE(used <= N_PAGES);

    /* K/V of every position of every sequence: K in [-1.5, 1.5), V in [-1, 1) */
    float *kall[N_SEQ], *vall[N_SEQ];
    float kmax = 1.5f, vmax = 1.0f;
    for (int s = 0; s < N_SEQ; s++) {
        const size_t m = (size_t)seq_ctx_of[s] * row;
        kall[s] = malloc(m * sizeof(float)), vall[s] = malloc(m * sizeof(float));
        for (size_t i = 0; i < m; i++) kall[s][i] = kmax * rs_test_uniform(rng), vall[s][i] = vmax * rs_test_uniform(rng);
    }
    /* per-head scales: K at 0.8 of amax / 448 (the largest 20% of the values saturate), V at
     * amax / 448 times 0.4, 0.8, 1.2, ... by head (head 0 saturates, the later ones do not) */
    float ks[8], vs[8];
    for (int h = 0; h < n_kv; h++) ks[h] = 0.8f * kmax / 448.0f, vs[h] = 0.8f * vmax / 448.0f * (float)(h + 1) / 2.0f;

    rs_kv_layer kc = layer_new(c, kind, N_PAGES, n_kv, hd, ks, vs);
    rs_kv_layer kg = layer_new(g, kind, N_PAGES, n_kv, hd, ks, vs);

    /* the two steps: history (positions before seq_first), then this step's rows */
    const int max_rows = A_CTX + B_HIST + B_ROWS + 1;
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)max_rows), *slot = malloc(sizeof(int32_t) * (size_t)max_rows);
    float *kstep = malloc((size_t)max_rows * row * sizeof(float)), *vstep = malloc((size_t)max_rows * row * sizeof(float));
    int32_t starts[N_SEQ + 1], ctx[N_SEQ], tokens[64] = {0};
    int n = 0;
    for (int step = 0; step < 2; step++) {
        n = 0;
        for (int s = 0; s < N_SEQ; s++) {
            starts[s] = n;
            const int p0 = step == 0 ? 0 : seq_first[s], p1 = step == 0 ? seq_first[s] : seq_ctx_of[s];
            for (int p = p0; p < p1; p++, n++) {
                pos[n] = p;
                slot[n] = tables[s * MAX_BLOCKS + p / RS_KV_BLOCK] * RS_KV_BLOCK + p % RS_KV_BLOCK;
                memcpy(kstep + (size_t)n * row, kall[s] + (size_t)p * row, row * sizeof(float));
                memcpy(vstep + (size_t)n * row, vall[s] + (size_t)p * row, row * sizeof(float));
            }
            ctx[s] = p1;
        }
        starts[N_SEQ] = n;
        store_both(c, &kc, g, &kg, kstep, vstep, slot, n);
    }
    ASSERT_EQ(n, 1 + B_ROWS + 1);
    char what[128];
    snprintf(what, sizeof what, "attention %s heads %d/%d hd %d", kind->name, n_heads, n_kv, hd);
    assert_same_layers(c, &kc, g, &kg, what);

    rs_batch bt = {.n_tok = n, .n_seq = N_SEQ, .tokens = tokens, .pos = pos, .slot = slot, .seq_start = starts,
                   .seq_ctx = ctx, .block_tables = tables, .max_blocks = MAX_BLOCKS};
    const size_t nq = (size_t)n * (size_t)n_heads * (size_t)hd;
    float *q = malloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++) q[i] = 3.0f * rs_test_uniform(rng); /* scores of std ~1.5: peaked, not one-hot */
    const float scale = 1.0f / sqrtf((float)hd);
    float *qc = rs_test_to_backend(c, q, nq * sizeof(float)), *oc = rs_backend_alloc(c, nq * sizeof(float));
    float *qg = rs_test_to_backend(g, q, nq * sizeof(float)), *og = rs_backend_alloc(g, nq * sizeof(float));
    rs_op_attention(c, oc, qc, &kc, n_heads, scale, &bt);
    rs_op_attention(g, og, qg, &kg, n_heads, scale, &bt);
    float *want = rs_test_to_host(c, oc, nq * sizeof(float)), *got = rs_test_to_host(g, og, nq * sizeof(float));

    /* Each output is a convex combination of V values, |out| <= vmax. The two sides compute the
     * scores and the weighted sums in different orders and with different expf (each within a few
     * ulp): a score error of d changes the weights by a relative ~d, and the scores' fp32 errors
     * are ~1e-6 here (sums of <= 256 products of size ~1), so the outputs differ by ~1e-6 * vmax.
     * 2e-5 * (1 + vmax) leaves a margin of ~10x; a wrong page, head, position or scale is off by
     * far more (order vmax / sqrt(context)). */
    const double tol = 2e-5 * (1.0 + (double)vmax);
    double worst = 0.0;
    size_t worst_i = 0;
    for (size_t i = 0; i < nq; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        if (isnan(d)) d = INFINITY; /* a NaN on either side fails */
        if (d > worst) worst = d, worst_i = i;
    }
    if (!(worst <= tol)) {
        const size_t r = worst_i / ((size_t)n_heads * (size_t)hd), h = worst_i / (size_t)hd % (size_t)n_heads;
        RS_TEST_FAIL("%s: row %zu (pos %d) head %zu dim %zu: cuda %.9g, cpu %.9g, |diff| %.3g > tol %.3g", what, r,
                     pos[r], h, worst_i % (size_t)hd, (double)got[worst_i], (double)want[worst_i], worst, tol);
    }

    free(want), free(got), free(q);
    rs_backend_free_mem(c, qc), rs_backend_free_mem(c, oc);
    rs_backend_free_mem(g, qg), rs_backend_free_mem(g, og);
    free(pos), free(slot), free(kstep), free(vstep);
    for (int s = 0; s < N_SEQ; s++) free(kall[s]), free(vall[s]);
    rs_test_kv_layer_free(c, &kc);
    rs_test_kv_layer_free(g, &kg);
    return worst / tol;
}

RS_TEST(cuda_attention_matches_cpu) {
    rs_backend *g = rs_test_cuda_or_skip();
    rs_backend *c = rs_backend_cpu_init(2);
    uint64_t rng = 23;
    /* n_heads, n_kv_heads, head_dim: groups 4 and 1 at head_dim 64 and 128; group 12 at 256 is
     * split over two blocks of 8 and 4 query heads; head_dim 40 leaves lanes idle in a warp's row */
    static const int shapes[][3] = {{8, 2, 64}, {8, 8, 64}, {8, 2, 128}, {8, 8, 128}, {24, 2, 256}, {6, 3, 40}};
    double worst = 0.0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int ki = 0; ki < N_KINDS; ki++) {
            double w = check_attention(c, g, &kv_kinds[ki], shapes[si][0], shapes[si][1], shapes[si][2], &rng);
            worst = w > worst ? w : worst;
        }
    printf("  cuda attention vs cpu: worst |diff| = %.3g of the tolerance over %d cases\n", worst,
           (int)(sizeof shapes / sizeof shapes[0]) * N_KINDS);
    rs_backend_free(c);
    rs_backend_free(g);
}
#endif
