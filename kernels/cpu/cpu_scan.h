/*
 * cpu_scan.h — the non-finite scan of kernels/scan.h at a chosen SIMD level, for tests.
 *
 * Blocks of 4 KiB are reduced to the largest |bits| (an unsigned maximum of the bits without the
 * sign, which orders finite values below inf below NaN) with AVX-512BW or AVX2; a block whose
 * maximum reaches the threshold is searched element by element for the first offender.
 */
#ifndef RS_CPU_SCAN_H
#define RS_CPU_SCAN_H

#include <stddef.h>
#include <stdint.h>

#include "../scan.h"
#include "../tensor.h"
#include "cpu_internal.h"

/* rs_cpu_first_nonfinite (kernels/scan.h) at level simd (which the CPU must support; AVX512 needs AVX-512BW): for tests. */
int64_t rs_cpu_first_nonfinite_ex(rs_cpu_simd simd, rs_dtype dt, const void *p, size_t n);

/* The level rs_cpu_first_nonfinite uses. */
rs_cpu_simd rs_cpu_scan_simd(void);

#endif /* RS_CPU_SCAN_H */
