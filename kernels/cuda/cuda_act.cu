/*
 * cuda_act.cu — the cached low-precision forms of one activation (cuda_internal.h rs_cuda_act) that
 * the fast numerics' GEMMs read: BF16 values for BF16 GEMMs, E4M3 codes with 1x128 scales for FP8
 * GEMMs. Both are exact functions of the fp32 activation (round to nearest even; the FP8 recipe's
 * quantizer, bit-identical to rs_fp8_quantize_act), so where they are computed (fused into the
 * producing kernel, or here when a matmul finds none) never changes a result; caching only saves
 * the conversion for the second and third matmul of the same input.
 */
#include "cuda_act.h"

/* out[i] = bf16(x[i]) */
__global__ void act_bf16_kernel(uint16_t *__restrict__ out /* [n] bf16 */, const float *__restrict__ x /* [n] f32 */,
                                size_t n) {
    rs_cuda_pdl_trigger(); /* the GEMV of this form may start loading its weights (cuda_internal.h) */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = rs_cuda_bf16_bits(x[i]);
}

static size_t form_groups(size_t n, int group_len) {
    if (group_len == 0) return n / RS_FP8_BLOCK;
    return n / (size_t)group_len * (size_t)rs_fp8_blocks(group_len);
}

void rs_cuda_act_produce(rs_cuda_ctx *c, const float *x, size_t n, int group_len, uint16_t **bf16, uint8_t **q,
                         float **s) {
    RS_ASSERT(group_len > 0 ? n % (size_t)group_len == 0 : n % RS_FP8_BLOCK == 0);
    *bf16 = (uint16_t *)rs_cuda_scratch(c, RS_CUDA_S_FORM_BF16, n * sizeof(uint16_t) + 16);
    *q = (uint8_t *)rs_cuda_scratch(c, RS_CUDA_S_FORM_Q8, n + 16);
    *s = (float *)rs_cuda_scratch(c, RS_CUDA_S_FORM_Q8S, (form_groups(n, group_len) + 1) * sizeof(float));
    c->act = rs_cuda_act{x, n, group_len, true, true};
}

/* Whether the cache holds forms of x as [rows][k]. */
static bool cached(const rs_cuda_ctx *c, const float *x, int rows, int k) {
    return c->act.x == x && c->act.n == (size_t)rows * (size_t)k;
}

const uint16_t *rs_cuda_act_bf16(rs_cuda_ctx *c, const float *x, int rows, int k) {
    const size_t n = (size_t)rows * (size_t)k;
    if (cached(c, x, rows, k) && c->act.bf16) return (const uint16_t *)c->scratch[RS_CUDA_S_FORM_BF16].p;
    if (!cached(c, x, rows, k)) c->act = rs_cuda_act{x, n, k, false, false};
    uint16_t *out = (uint16_t *)rs_cuda_scratch(c, RS_CUDA_S_FORM_BF16, n * sizeof(uint16_t) + 16);
    const unsigned blocks = (unsigned)RS_MIN((size_t)rs_cuda_blocks(n, 256), (size_t)RS_MAX(c->sm_count, 1) * 8);
    act_bf16_kernel<<<blocks, 256, 0, c->stream>>>(out, x, n);
    CUDA_CHECK_LAUNCH();
    c->act.bf16 = true;
    return out;
}

const uint8_t *rs_cuda_act_fp8(rs_cuda_ctx *c, const float *x, int rows, int k, const float **scales) {
    const size_t n = (size_t)rows * (size_t)k;
    const bool groups_fit = c->act.group_len == k || (c->act.group_len == 0 && k % RS_FP8_BLOCK == 0);
    if (cached(c, x, rows, k) && c->act.fp8 && groups_fit) {
        *scales = (const float *)c->scratch[RS_CUDA_S_FORM_Q8S].p;
        return (const uint8_t *)c->scratch[RS_CUDA_S_FORM_Q8].p;
    }
    if (!cached(c, x, rows, k) || !groups_fit) c->act = rs_cuda_act{x, n, k, false, false};
    uint8_t *q = (uint8_t *)rs_cuda_scratch(c, RS_CUDA_S_FORM_Q8, n + 16);
    float *s = (float *)rs_cuda_scratch(c, RS_CUDA_S_FORM_Q8S, ((size_t)rows * (size_t)rs_fp8_blocks(k) + 1) * sizeof(float));
    rs_cuda_fp8_quantize_act(c, x, rows, k, q, s);
    c->act.group_len = k; /* the BF16 form, if present, stays valid: it has no groups */
    c->act.fp8 = true;
    *scales = s;
    return q;
}

/* ---- C-callable hooks for tests/unit/test_cuda_blas.c ---- */

/* Device copies of the cached forms of x [rows][k] (computed unless cached): bf16 [rows][k],
 * q [rows][k], s [rows][ceil(k/128)]. Keeps the cache, as a matmul does. */
extern "C" void rs_cuda_test_act_forms(rs_backend *b, const float *x, int rows, int k, uint16_t *bf16, uint8_t *q,
                                       float *s) {
    rs_cuda_ctx *c = rs_cuda_ctx_keep(b);
    const float *sc;
    const uint8_t *qq = rs_cuda_act_fp8(c, x, rows, k, &sc);
    const size_t n = (size_t)rows * (size_t)k;
    CUDA_CHECK(cudaMemcpyAsync(q, qq, n, cudaMemcpyDeviceToDevice, c->stream));
    CUDA_CHECK(cudaMemcpyAsync(s, sc, (size_t)rows * (size_t)rs_fp8_blocks(k) * sizeof(float), cudaMemcpyDeviceToDevice,
                               c->stream));
    const uint16_t *bb = rs_cuda_act_bf16(c, x, rows, k);
    CUDA_CHECK(cudaMemcpyAsync(bf16, bb, n * sizeof(uint16_t), cudaMemcpyDeviceToDevice, c->stream));
}

/* Whether forms of x [n] are cached right now (a test that an op produced or dropped them). */
extern "C" int rs_cuda_test_act_cached(rs_backend *b, const float *x, size_t n) {
    const rs_cuda_ctx *c = (const rs_cuda_ctx *)b->ctx;
    return c->act.x == x && c->act.n == n && c->act.bf16 && c->act.fp8;
}
