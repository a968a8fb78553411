/*
 * tensor.h — the one tensor descriptor shared by model/, kernels/ and sync/.
 *
 * A tensor is a dtype, a shape (row-major, outermost first, as in safetensors) and a data pointer
 * that lives in some backend's memory (host memory for the CPU backend, device memory for CUDA).
 * Weights of a linear layer are [out_features][in_features], as PyTorch stores them.
 */
#ifndef RS_TENSOR_H
#define RS_TENSOR_H

#include <stddef.h>
#include <stdint.h>

typedef enum rs_dtype {
    RS_DTYPE_F32 = 0,
    RS_DTYPE_F16,
    RS_DTYPE_BF16,
    RS_DTYPE_E4M3, /* float8_e4m3fn: uint8 codes */
    RS_DTYPE_E5M2, /* float8_e5m2: uint8 codes */
    RS_DTYPE_I32,
    RS_DTYPE_I64,
    RS_DTYPE_COUNT
} rs_dtype;

#define RS_TENSOR_MAX_DIMS 4

/* How an E4M3 weight's codes are laid out in backend memory (rs_tensor.layout). Every other tensor,
 * and an FP8 weight a backend reads as the checkpoint stores it, is RS_LAYOUT_ROWS. */
typedef enum rs_layout {
    RS_LAYOUT_ROWS = 0, /* row-major [out][in], as in safetensors */
    RS_LAYOUT_FP8_PAIRS32, /* the CPU backend's AVX-512 VNNI layout: kernels/cpu/fp8_layout.h */
} rs_layout;

typedef struct rs_tensor {
    rs_dtype dtype;
    int ndim;                           /* 0 means "absent" (an optional weight not present) */
    int64_t shape[RS_TENSOR_MAX_DIMS];
    void *data;                         /* backend memory; borrowed from the weight store */
    /* FP8 weights only: per 128x128 block dequantization scales, [ceil(out/128)][ceil(in/128)] f32,
     * the checkpoint's `weight_scale_inv`. NULL for other dtypes. */
    float *scale_inv;
    /* FP8 weights only: the order of the codes in `data`, chosen by the backend that serves the
     * tensor when the weight is converted (rs_weight_convert); scale_inv is always as above. */
    rs_layout layout;
} rs_tensor;

size_t rs_dtype_size(rs_dtype dt);               /* bytes per element */
const char *rs_dtype_name(rs_dtype dt);          /* "bfloat16", "float32", ... */
int rs_dtype_from_safetensors(const char *s, rs_dtype *out); /* "BF16" -> RS_DTYPE_BF16; RS_OK/RS_EUNSUPPORTED */
int64_t rs_tensor_numel(const rs_tensor *t);
size_t rs_tensor_nbytes(const rs_tensor *t);
static inline int rs_tensor_present(const rs_tensor *t) { return t && t->ndim > 0; }

/* Scalar conversions (host). BF16 -> F32 is exact; F32 -> BF16 rounds to nearest even. */
static inline float rs_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}
uint16_t rs_f32_to_bf16(float f);
float rs_f16_to_f32(uint16_t h);
uint16_t rs_f32_to_f16(float f);

#endif /* RS_TENSOR_H */
