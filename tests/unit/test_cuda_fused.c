/*
 * test_cuda_fused.c — the CUDA backend's fused ops (kernels/cuda/cuda_ops.cu) against the launches
 * they replace (built with `make CUDA=1`; skipped without a GPU; runs under the CPU emulation of
 * CUDA, tests/cuda_emu):
 *
 *   add + rmsnorm   x += y, then out = rmsnorm(x) * w: the residual x and out bit for bit those of
 *                   the add op then the rmsnorm op on the same backend, in exact and fast numerics,
 *                   and in fast numerics the BF16 values and E4M3 codes and scales that the fused
 *                   kernel leaves for the next GEMV byte for byte those that rmsnorm leaves; out
 *                   apart and out = y (as the forward pass calls it).
 *   q/k norm + rope the per-head norms of q and k (or none, as Qwen2 and Llama have) and the ropes
 *                   of both, bit for bit the two rmsnorm and two rope launches; MHA and GQA head
 *                   counts, including an odd total (a half-warp without a head) and more heads than
 *                   one round of the block's warps takes.
 *
 * In exact numerics both are also compared with the CPU backend, which runs the single ops
 * (kernels/backend.c), so a fused kernel cannot drift from the reference while agreeing with a
 * single kernel that drifts the same way: add + rmsnorm bit for bit, q/k within the rope's libm
 * bound (CUDA's sincos against glibc's; bit for bit under the emulation). Rows 1, 3 and 17; BF16 and F32 norm weights; model
 * widths that are not a multiple of 256 or of the 128-wide activation groups.
 */
#ifdef RS_CUDA
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "../../kernels/fp8.h"
#include "test.h"
#include "test_util.h"

/* Hooks in kernels/cuda/cuda_act.cu (device pointers). */
void rs_cuda_test_act_forms(rs_backend *b, const float *x, int rows, int k, uint16_t *bf16, uint8_t *q, float *s);
int rs_cuda_test_act_cached(rs_backend *b, const float *x, size_t n);

static const rs_dtype norm_dtypes[] = {RS_DTYPE_BF16, RS_DTYPE_F32};

/* n floats uniform in [-amp, amp). */
static float *random_floats(size_t n, uint64_t *rng, float amp) {
    float *x = malloc(n * sizeof(float) + 4);
    for (size_t i = 0; i < n; i++) x[i] = amp * rs_test_uniform(rng);
    return x;
}

/* A norm weight [dim] of dtype dt (BF16 or F32), values near 1, in host memory. */
static rs_tensor host_norm(rs_dtype dt, int dim, uint64_t *rng) {
    rs_tensor t = {.dtype = dt, .ndim = 1, .shape = {dim}};
    t.data = malloc((size_t)dim * rs_dtype_size(dt) + 4);
    for (int i = 0; i < dim; i++) {
        const float v = 1.0f + 0.25f * rs_test_uniform(rng);
        if (dt == RS_DTYPE_BF16) ((uint16_t *)t.data)[i] = rs_f32_to_bf16(v);
        else ((float *)t.data)[i] = v;
    }
    return t;
}

/* The same tensor with its data in backend b (free with rs_backend_free_mem(b, t.data)). */
static rs_tensor norm_on(rs_backend *b, const rs_tensor *host) {
    rs_tensor t = *host;
    t.data = rs_test_to_backend(b, host->data, rs_tensor_nbytes(host));
    return t;
}

/* a[0..bytes) and b[0..bytes) hold the same bytes; `what` names the two sides, a first, and the
 * message gives the first element of `elem` bytes that differs. */
static void expect_same_bytes(const void *a, const void *b, size_t bytes, size_t elem, const char *what) {
    if (memcmp(a, b, bytes) == 0) return;
    size_t i = 0;
    while (((const uint8_t *)a)[i] == ((const uint8_t *)b)[i]) i++;
    if (elem == sizeof(float)) {
        const float fa = ((const float *)a)[i / elem], fb = ((const float *)b)[i / elem];
        RS_TEST_FAIL("%s: float %zu differs: %.9g (0x%08x) vs %.9g (0x%08x)", what, i / elem, (double)fa,
                     rs_test_f32_bits(fa), (double)fb, rs_test_f32_bits(fb));
    }
    RS_TEST_FAIL("%s: element %zu (of %zu bytes) differs", what, i / elem, elem);
}

/* a[0..n) within rel * max |b| of b[0..n): the rope's cos and sin come from CUDA's double sincos on
 * a GPU and glibc's on the CPU, which differ by an ulp where the result sits on a rounding
 * boundary (cuda_rope_matches_cpu's bound, relative to the values' size). */
static void expect_close(const float *a, const float *b, size_t n, double rel, const char *what) {
    double big = 0;
    for (size_t i = 0; i < n; i++) big = fmax(big, fabs((double)b[i]));
    for (size_t i = 0; i < n; i++)
        if (!(fabs((double)a[i] - b[i]) <= rel * big))
            RS_TEST_FAIL("%s: float %zu differs: %.9g vs %.9g (bound %.3g)", what, i, (double)a[i], (double)b[i],
                         rel * big);
}

/* ---- add + rmsnorm ---- */

/* The activation forms of a [rows][dim] output: BF16 values, E4M3 codes, their 1x128 scales. */
typedef struct forms {
    uint16_t *bf;
    uint8_t *q;
    float *s;
} forms;

static size_t scales_of(int rows, int dim) { return (size_t)rows * (size_t)rs_fp8_blocks(dim); }

/* One way to run x += y, out = rmsnorm(x) * w on a backend, from the host arrays x, y; the
 * residual and the output come back as host copies, and (fast numerics) the forms left cached
 * for out, as host copies too. */
typedef struct norm_run {
    float *x, *out; /* [rows][dim] host */
    forms f;        /* host; NULL unless fast */
} norm_run;

static norm_run run_add_norm(rs_backend *b, bool fused, bool out_is_y, bool fast, const float *x, const float *y,
                             const rs_tensor *w, int rows, int dim) {
    const size_t n = (size_t)rows * (size_t)dim, ns = scales_of(rows, dim);
    float *dx = rs_test_to_backend(b, x, n * 4), *dy = rs_test_to_backend(b, y, n * 4);
    float *dout = out_is_y ? dy : rs_backend_alloc(b, n * 4);
    forms df = {0};
    if (fast) /* before the op: an allocation drops the cached forms */
        df = (forms){rs_backend_alloc(b, n * 2), rs_backend_alloc(b, n), rs_backend_alloc(b, ns * 4)};
    if (fused) {
        rs_op_add_rmsnorm(b, dx, dy, dout, w, rows, dim, 1e-6f);
    } else {
        rs_op_add(b, dx, dy, n);
        rs_op_rmsnorm(b, dout, dx, w, rows, dim, 1e-6f);
    }
    norm_run r = {0};
    if (fast) {
        if (!rs_cuda_test_act_cached(b, dout, n))
            RS_TEST_FAIL("%s over [%d][%d]: no activation forms of its output", fused ? "add+rmsnorm" : "rmsnorm", rows, dim);
        rs_cuda_test_act_forms(b, dout, rows, dim, df.bf, df.q, df.s); /* a hit: copies what the op wrote */
        r.f = (forms){rs_test_to_host(b, df.bf, n * 2), rs_test_to_host(b, df.q, n), rs_test_to_host(b, df.s, ns * 4)};
        rs_backend_free_mem(b, df.bf), rs_backend_free_mem(b, df.q), rs_backend_free_mem(b, df.s);
    }
    r.x = rs_test_to_host(b, dx, n * 4);
    r.out = rs_test_to_host(b, dout, n * 4);
    rs_backend_free_mem(b, dx), rs_backend_free_mem(b, dy);
    if (!out_is_y) rs_backend_free_mem(b, dout);
    return r;
}

static void norm_run_free(norm_run *r) { free(r->x), free(r->out), free(r->f.bf), free(r->f.q), free(r->f.s); }

RS_TEST(cuda_add_rmsnorm_fused_same_bits) {
    rs_backend *g = rs_test_cuda_or_skip(), *c = rs_backend_cpu_init(2);
    uint64_t rng = 707;
    static const int dims[] = {1000, 300, 96, 1030};
    static const int rows_of[] = {1, 3, 17};
    for (int fast = 0; fast < 2; fast++) {
        const rs_numerics num = fast ? RS_NUMERICS_FAST : RS_NUMERICS_EXACT;
        ASSERT_EQ(rs_backend_set_numerics(g, num), num);
        for (size_t di = 0; di < RS_ARRAY_LEN(dims); di++) {
            for (size_t ri = 0; ri < RS_ARRAY_LEN(rows_of); ri++) {
                const int dim = dims[di], rows = rows_of[ri];
                const size_t n = (size_t)rows * (size_t)dim, ns = scales_of(rows, dim);
                const bool out_is_y = (di + ri) % 2 == 1;
                rs_tensor hw = host_norm(norm_dtypes[(di + ri + (size_t)fast) % 2], dim, &rng);
                rs_tensor wg = norm_on(g, &hw), wc = norm_on(c, &hw);
                float *x = random_floats(n, &rng, 8.0f), *y = random_floats(n, &rng, 2.0f);
                norm_run fu = run_add_norm(g, true, out_is_y, fast, x, y, &wg, rows, dim);
                norm_run un = run_add_norm(g, false, out_is_y, fast, x, y, &wg, rows, dim);
                char what[160];
                snprintf(what, sizeof what, "%s rows %d dim %d w %s%s", rs_numerics_name(num), rows, dim,
                         rs_dtype_name(hw.dtype), out_is_y ? " out=y" : "");
                char side[200];
                snprintf(side, sizeof side, "%s: residual, fused vs add then rmsnorm", what);
                expect_same_bytes(fu.x, un.x, n * 4, 4, side);
                snprintf(side, sizeof side, "%s: output, fused vs add then rmsnorm", what);
                expect_same_bytes(fu.out, un.out, n * 4, 4, side);
                if (fast) {
                    snprintf(side, sizeof side, "%s: bf16 form, fused vs rmsnorm", what);
                    expect_same_bytes(fu.f.bf, un.f.bf, n * 2, 2, side);
                    snprintf(side, sizeof side, "%s: e4m3 codes, fused vs rmsnorm", what);
                    expect_same_bytes(fu.f.q, un.f.q, n, 1, side);
                    snprintf(side, sizeof side, "%s: e4m3 scales, fused vs rmsnorm", what);
                    expect_same_bytes(fu.f.s, un.f.s, ns * 4, 4, side);
                } else { /* the CPU backend runs the single ops: the reference */
                    norm_run cpu = run_add_norm(c, true, out_is_y, false, x, y, &wc, rows, dim);
                    snprintf(side, sizeof side, "%s: residual, cuda fused vs cpu", what);
                    expect_same_bytes(fu.x, cpu.x, n * 4, 4, side);
                    snprintf(side, sizeof side, "%s: output, cuda fused vs cpu", what);
                    expect_same_bytes(fu.out, cpu.out, n * 4, 4, side);
                    norm_run_free(&cpu);
                }
                norm_run_free(&fu), norm_run_free(&un);
                rs_backend_free_mem(g, wg.data), rs_backend_free_mem(c, wc.data);
                free(hw.data), free(x), free(y);
            }
        }
    }
    rs_backend_free(g), rs_backend_free(c);
}

/* ---- q/k norm + rope ---- */

typedef struct qk_shape {
    int n_heads, n_kv_heads, head_dim, rows;
} qk_shape;

/* q, k (host) through the q/k norms (NULL: none) and ropes on b, fused or as the single ops; the
 * results replace q and k. */
static void run_qk(rs_backend *b, bool fused, qk_shape s, float *q, float *k, const rs_tensor *qn, const rs_tensor *kn,
                   const int32_t *pos, const float *freq) {
    const size_t nq = (size_t)s.rows * s.n_heads * s.head_dim, nk = (size_t)s.rows * s.n_kv_heads * s.head_dim;
    float *dq = rs_test_to_backend(b, q, nq * 4), *dk = rs_test_to_backend(b, k, nk * 4);
    if (fused) {
        rs_op_qk_norm_rope(b, dq, dk, qn, kn, s.rows, s.n_heads, s.n_kv_heads, s.head_dim, 1e-6f, pos, freq);
    } else {
        if (qn) rs_op_rmsnorm(b, dq, dq, qn, s.rows * s.n_heads, s.head_dim, 1e-6f);
        if (kn) rs_op_rmsnorm(b, dk, dk, kn, s.rows * s.n_kv_heads, s.head_dim, 1e-6f);
        rs_op_rope(b, dq, s.rows, s.n_heads, s.head_dim, pos, freq);
        rs_op_rope(b, dk, s.rows, s.n_kv_heads, s.head_dim, pos, freq);
    }
    rs_backend_download(b, q, dq, nq * 4);
    rs_backend_download(b, k, dk, nk * 4);
    rs_backend_free_mem(b, dq), rs_backend_free_mem(b, dk);
}

RS_TEST(cuda_qk_norm_rope_fused_same_bits) {
    rs_backend *g = rs_test_cuda_or_skip(), *c = rs_backend_cpu_init(2);
    uint64_t rng = 808;
    /* (heads, kv heads): MHA; GQA with an odd total (one half-warp without a head); 16 + 8 (Qwen3's
     * 0.6B shape: 12 pairs, more than the block's 8 warps take in one round) */
    static const int heads[][2] = {{4, 4}, {6, 1}, {16, 8}};
    static const int head_dims[] = {64, 128};
    static const int rows_of[] = {1, 3, 17};
    int32_t pos[17];
    for (int fast = 0; fast < 2; fast++) {
        const rs_numerics num = fast ? RS_NUMERICS_FAST : RS_NUMERICS_EXACT;
        ASSERT_EQ(rs_backend_set_numerics(g, num), num);
        for (size_t hi = 0; hi < RS_ARRAY_LEN(heads); hi++) {
            for (size_t di = 0; di < RS_ARRAY_LEN(head_dims); di++) {
                const int hd = head_dims[di], half = hd / 2;
                float *freq = malloc((size_t)half * 4);
                for (int i = 0; i < half; i++) freq[i] = (float)(1.0 / pow(1000000.0, (double)(2 * i) / hd));
                for (size_t ri = 0; ri < RS_ARRAY_LEN(rows_of); ri++) {
                    for (int normed = 0; normed < 2; normed++) {
                        const qk_shape s = {heads[hi][0], heads[hi][1], hd, rows_of[ri]};
                        for (int r = 0; r < s.rows; r++) pos[r] = r < 4 ? r : (int32_t)(rs_test_rng(&rng) % 40960);
                        const size_t nq = (size_t)s.rows * s.n_heads * hd, nk = (size_t)s.rows * s.n_kv_heads * hd;
                        /* q's and k's weights of different dtypes, swapped from one case to the next */
                        const size_t t = hi + di + ri;
                        rs_tensor hq = host_norm(norm_dtypes[t % 2], hd, &rng), hk = host_norm(norm_dtypes[(t + 1) % 2], hd, &rng);
                        rs_tensor qg = norm_on(g, &hq), kg = norm_on(g, &hk), qc = norm_on(c, &hq), kc = norm_on(c, &hk);
                        float *q = random_floats(nq, &rng, 4.0f), *k = random_floats(nk, &rng, 4.0f);
                        float *qf = malloc(nq * 4), *kf = malloc(nk * 4), *qu = malloc(nq * 4), *ku = malloc(nk * 4);
                        memcpy(qf, q, nq * 4), memcpy(kf, k, nk * 4), memcpy(qu, q, nq * 4), memcpy(ku, k, nk * 4);
                        run_qk(g, true, s, qf, kf, normed ? &qg : NULL, normed ? &kg : NULL, pos, freq);
                        run_qk(g, false, s, qu, ku, normed ? &qg : NULL, normed ? &kg : NULL, pos, freq);
                        char what[160], side[200];
                        snprintf(what, sizeof what, "%s heads %d/%d head_dim %d rows %d %s", rs_numerics_name(num),
                                 s.n_heads, s.n_kv_heads, hd, s.rows, normed ? "q/k norms" : "no norms");
                        snprintf(side, sizeof side, "%s: q, fused vs norms then ropes", what);
                        expect_same_bytes(qf, qu, nq * 4, 4, side);
                        snprintf(side, sizeof side, "%s: k, fused vs norms then ropes", what);
                        expect_same_bytes(kf, ku, nk * 4, 4, side);
                        if (!fast) { /* the CPU backend runs the single ops: the reference */
                            run_qk(c, true, s, q, k, normed ? &qc : NULL, normed ? &kc : NULL, pos, freq);
                            snprintf(side, sizeof side, "%s: q, cuda fused vs cpu", what);
                            expect_close(qf, q, nq, 1e-6, side);
                            snprintf(side, sizeof side, "%s: k, cuda fused vs cpu", what);
                            expect_close(kf, k, nk, 1e-6, side);
                        }
                        free(q), free(k), free(qf), free(kf), free(qu), free(ku);
                        rs_backend_free_mem(g, qg.data), rs_backend_free_mem(g, kg.data);
                        rs_backend_free_mem(c, qc.data), rs_backend_free_mem(c, kc.data);
                        free(hq.data), free(hk.data);
                    }
                }
                free(freq);
            }
        }
    }
    rs_backend_free(g), rs_backend_free(c);
}

/* ---- the op profile ---- */

/* Each fused op counts once under its own name on the CUDA backend (one launch), and as the single
 * ops it stands for on the CPU backend (which runs those). */
RS_TEST(cuda_fused_ops_profile_names) {
    rs_backend *g = rs_test_cuda_or_skip(), *c = rs_backend_cpu_init(1);
    uint64_t rng = 909;
    const int rows = 2, heads = 2, hd = 64, dim = heads * hd;
    const int32_t pos[2] = {3, 70};
    float freq[32];
    for (int i = 0; i < hd / 2; i++) freq[i] = (float)(1.0 / pow(10000.0, (double)(2 * i) / hd));
    rs_tensor hw = host_norm(RS_DTYPE_BF16, dim, &rng), hn = host_norm(RS_DTYPE_F32, hd, &rng);
    float *x = random_floats((size_t)rows * dim, &rng, 1.0f);
    rs_backend *backends[2] = {g, c};
    for (int bi = 0; bi < 2; bi++) {
        rs_backend *b = backends[bi];
        rs_tensor w = norm_on(b, &hw), nw = norm_on(b, &hn);
        float *dx = rs_test_to_backend(b, x, sizeof(float) * rows * dim), *dy = rs_test_to_backend(b, x, sizeof(float) * rows * dim);
        float *dout = rs_backend_alloc(b, sizeof(float) * rows * dim);
        rs_backend_profile(b, true);
        rs_op_add_rmsnorm(b, dx, dy, dout, &w, rows, dim, 1e-6f);
        rs_op_qk_norm_rope(b, dx, dy, &nw, &nw, rows, heads, heads, hd, 1e-6f, pos, freq);
        char *text = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&text, &len);
        rs_backend_profile_print(b, f, 1);
        fclose(f);
        rs_backend_profile(b, false);
        unsigned long long n_fused = 0, n_qk = 0, n_add = 0, n_norm = 0, n_rope = 0;
        const char *p;
        if (b == g) {
            ASSERT_TRUE((p = strstr(text, "\n    add+rmsnorm ")) && sscanf(p, " add+rmsnorm %llu", &n_fused) == 1);
            ASSERT_TRUE((p = strstr(text, "\n    qk_norm+rope ")) && sscanf(p, " qk_norm+rope %llu", &n_qk) == 1);
            ASSERT_EQ(n_fused, 1);
            ASSERT_EQ(n_qk, 1);
            ASSERT_TRUE(!strstr(text, "\n    add ") && !strstr(text, "\n    rmsnorm ") && !strstr(text, "\n    rope "));
        } else {
            ASSERT_TRUE((p = strstr(text, "\n    add ")) && sscanf(p, " add %llu", &n_add) == 1);
            ASSERT_TRUE((p = strstr(text, "\n    rmsnorm ")) && sscanf(p, " rmsnorm %llu", &n_norm) == 1);
            ASSERT_TRUE((p = strstr(text, "\n    rope ")) && sscanf(p, " rope %llu", &n_rope) == 1);
            ASSERT_EQ(n_add, 1);
            ASSERT_EQ(n_norm, 3); /* the layer norm, then q's and k's per-head norms */
            ASSERT_EQ(n_rope, 2);
            ASSERT_TRUE(!strstr(text, "+"));
        }
        free(text);
        rs_backend_free_mem(b, dx), rs_backend_free_mem(b, dy), rs_backend_free_mem(b, dout);
        rs_backend_free_mem(b, w.data), rs_backend_free_mem(b, nw.data);
    }
    free(hw.data), free(hn.data), free(x);
    rs_backend_free(g), rs_backend_free(c);
}
#endif
