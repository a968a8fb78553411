/*
 * scan.h — finding non-finite values in weight tensors, at memory speed.
 *
 * A weight update or a load refuses a tensor that holds a NaN or an infinity (model/weight_store.c):
 * served, one would turn every logit it touches into NaN. The check runs on the bytes as they
 * are (no conversion): a BF16, F16 or F32 element is non-finite when its exponent field is all
 * ones, an E4M3 code when it is S.1111.111 (E4M3FN has no infinity). The host code that runs it is
 * kernels/cpu/cpu_scan.c (AVX-512BW, AVX2 or plain C); kernels/cpu/cpu_scan.h adds the entry that
 * forces a SIMD level, for tests.
 */
#ifndef RS_KERNELS_SCAN_H
#define RS_KERNELS_SCAN_H

#include <stddef.h>
#include <stdint.h>

#include "tensor.h"

/* Index of the first non-finite element of p[0, n) (dtype BF16, F16, F32 or E4M3; p is host
 * memory and may be unaligned), or -1 when every element is finite. At the widest level this CPU
 * runs (AVX-512BW, AVX2, else plain C), capped by RS_CPU_SIMD like the CPU backend. Thread-safe. */
int64_t rs_cpu_first_nonfinite(rs_dtype dt, const void *p, size_t n);

#endif /* RS_KERNELS_SCAN_H */
