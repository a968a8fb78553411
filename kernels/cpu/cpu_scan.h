/*
 * cpu_scan.h — finding non-finite values in weight tensors, at memory speed.
 *
 * A weight update or a load refuses a tensor that holds a NaN or an infinity (model/weight_store.c):
 * served, one would turn every logit it touches into NaN. The check runs on the bytes as they
 * are (no conversion): a BF16, F16 or F32 element is non-finite when its exponent field is all
 * ones, an E4M3 code when it is S.1111.111 (E4M3FN has no infinity). Blocks of 4 KiB are reduced
 * to the largest |bits| (an unsigned maximum of the bits without the sign, which orders finite
 * values below inf below NaN) with AVX-512BW or AVX2; a block whose maximum reaches the threshold
 * is searched element by element for the first offender.
 */
#ifndef RS_CPU_SCAN_H
#define RS_CPU_SCAN_H

#include <stddef.h>
#include <stdint.h>

#include "../tensor.h"
#include "cpu_internal.h"

/* Index of the first non-finite element of p[0, n) (dtype BF16, F16, F32 or E4M3; p may be
 * unaligned), or -1 when every element is finite. At the widest level this CPU runs (AVX-512BW,
 * AVX2, else plain C), capped by RS_CPU_SIMD like the backend. Thread-safe. */
int64_t rs_cpu_first_nonfinite(rs_dtype dt, const void *p, size_t n);

/* The same at level simd (which the CPU must support; AVX512 needs AVX-512BW): for tests. */
int64_t rs_cpu_first_nonfinite_ex(rs_cpu_simd simd, rs_dtype dt, const void *p, size_t n);

/* The level rs_cpu_first_nonfinite uses. */
rs_cpu_simd rs_cpu_scan_simd(void);

#endif /* RS_CPU_SCAN_H */
