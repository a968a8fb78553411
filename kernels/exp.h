/*
 * exp.h — fp32 exp and the loops built on it (softmax, silu), vectorized, the same bits on
 * every ISA (kernels/cpu/cpu_exp.c has the numerics).
 *
 * rs_expf is the definition: within 2 ulp of exp over the whole fp32 range (1.02 ulp measured on
 * every fp32 input, subnormal results included); exp(0) = 1 exactly, 0 for x < -103.98 and -inf,
 * inf for x > 88.723 and inf, NaN for NaN.
 * The tables run it 8 or 16 lanes at a time and agree with it bit for bit; their sums go over 16
 * fixed lanes combined by a fixed tree, so a sum does not depend on the table either. The
 * attention kernels pick a table with the backend's SIMD level (rs_cpu_exp_for in cpu_internal.h);
 * code outside the backend (the sampler) takes rs_cpu_exp_best.
 */
#ifndef RS_KERNELS_EXP_H
#define RS_KERNELS_EXP_H

#include <stddef.h>

float rs_expf(float x);

typedef struct rs_cpu_exp_vec {
    /* dst[i] = rs_expf(src[i]); dst may alias src */
    void (*exp)(float *dst /* [n] */, const float *src /* [n] */, size_t n);
    /* the largest x[i] * scale (one fp32 product), NaN products skipped; -inf when there is none */
    float (*max)(const float *x /* [n] */, size_t n, float scale);
    /* e[i] = rs_expf(x[i] * scale - shift), the product and the difference each rounded to fp32;
     * stores e into dst unless dst is NULL (dst may alias x) and returns the sum of e in fp32:
     * lane i % 16 accumulates in order of i, the lanes are combined as a tree (8, 4, 2, 1) */
    float (*exp_sum)(float *dst /* [n] or NULL */, const float *x /* [n] */, size_t n, float scale,
                     float shift);
    /* the same, each e[i] widened and summed in double (same lanes, same tree) */
    double (*exp_sum_f64)(float *dst /* [n] or NULL */, const float *x /* [n] */, size_t n, float scale,
                          float shift);
    /* x[i] = x[i] / d */
    void (*div)(float *x /* [n] */, size_t n, float d);
    /* out[i] = gate[i] / (1 + rs_expf(-gate[i])) * up[i]: silu times up, one fp32 rounding per
     * operation; out may alias gate or up */
    void (*silu_mul)(float *out /* [n] */, const float *gate /* [n] */, const float *up /* [n] */, size_t n);
} rs_cpu_exp_vec;

extern const rs_cpu_exp_vec rs_cpu_exp_scalar, rs_cpu_exp_avx2, rs_cpu_exp_avx512;

/* The widest table this CPU runs (AVX-512F, else AVX2+FMA, else plain C), found on the first call;
 * RS_CPU_SIMD=scalar|avx2 caps it as it caps the backend. Thread-safe. */
const rs_cpu_exp_vec *rs_cpu_exp_best(void);

#endif /* RS_KERNELS_EXP_H */
