/*
 * fp8_exhaustive.c — compares kernels/fp8.c with CUDA's cuda_fp8.h host path on every input.
 *
 *   build/fp8-exhaustive [threads]      threads <= 0 or absent: all online CPUs
 *
 * Encoders: all 2^32 fp32 bit patterns through rs_fp8_e4m3_from_f32 / rs_fp8_e5m2_from_f32 and
 * through __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3 / __NV_E5M2) (tools/fp8_cuda_ref.cpp),
 * code for code. Decoders: all 256 codes of each format against __nv_cvt_fp8_to_halfraw, bit for
 * bit (NaN codes: both must be NaN with the code's sign), plus decode -> encode round trips.
 * Prints the first mismatches, the totals and the time; exits 1 on any mismatch.
 *
 * This needs the CUDA headers (not the runtime, not a GPU), so it is a separate program from the
 * unit tests, which must build without the toolkit.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/pool.h"
#include "../core/rs.h"
#include "../kernels/fp8.h"

/* tools/fp8_cuda_ref.cpp */
unsigned char cuda_ref_e4m3(float x);
unsigned char cuda_ref_e5m2(float x);
float cuda_ref_e4m3_to_f32(unsigned char c);
float cuda_ref_e5m2_to_f32(unsigned char c);

#define MAX_THREADS 256
#define MAX_REPORT 8

typedef struct thread_result {
    uint64_t mismatch_e4m3, mismatch_e5m2;
    uint32_t first_e4m3[MAX_REPORT], first_e5m2[MAX_REPORT];
} thread_result;

static thread_result results[MAX_THREADS];

static float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t bits_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static void check_range(void *ctx, int64_t begin, int64_t end, int tid) {
    (void)ctx;
    thread_result *res = &results[tid];
    for (int64_t i = begin; i < end; i++) {
        float x = f32_from_bits((uint32_t)i);
        if (rs_fp8_e4m3_from_f32(x) != cuda_ref_e4m3(x)) {
            if (res->mismatch_e4m3 < MAX_REPORT) res->first_e4m3[res->mismatch_e4m3] = (uint32_t)i;
            res->mismatch_e4m3++;
        }
        if (rs_fp8_e5m2_from_f32(x) != cuda_ref_e5m2(x)) {
            if (res->mismatch_e5m2 < MAX_REPORT) res->first_e5m2[res->mismatch_e5m2] = (uint32_t)i;
            res->mismatch_e5m2++;
        }
    }
}

/* Bitwise equality, except that two NaNs of the same sign are equal whatever their payload. */
static int same_value(float a, float b) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b) && signbit(a) == signbit(b);
    return bits_from_f32(a) == bits_from_f32(b);
}

static int check_decoders(void) {
    int bad = 0;
    for (int c = 0; c < 256; c++) {
        float ours4 = rs_fp8_e4m3_to_f32((uint8_t)c), cuda4 = cuda_ref_e4m3_to_f32((unsigned char)c);
        float ours5 = rs_fp8_e5m2_to_f32((uint8_t)c), cuda5 = cuda_ref_e5m2_to_f32((unsigned char)c);
        if (!same_value(ours4, cuda4)) {
            printf("  decode e4m3 0x%02x: ours %a, cuda %a\n", c, ours4, cuda4);
            bad++;
        }
        if (!same_value(ours5, cuda5)) {
            printf("  decode e5m2 0x%02x: ours %a, cuda %a\n", c, ours5, cuda5);
            bad++;
        }
        /* Round trips: every non-NaN code is its own encoding; E5M2 inf saturates to max. */
        if (!isnan(ours4) && rs_fp8_e4m3_from_f32(ours4) != c) {
            printf("  round trip e4m3 0x%02x -> %a -> 0x%02x\n", c, ours4, rs_fp8_e4m3_from_f32(ours4));
            bad++;
        }
        uint8_t want5 = isinf(ours5) ? (uint8_t)((c & 0x80) | 0x7b) : (uint8_t)c;
        if (!isnan(ours5) && rs_fp8_e5m2_from_f32(ours5) != want5) {
            printf("  round trip e5m2 0x%02x -> %a -> 0x%02x\n", c, ours5, rs_fp8_e5m2_from_f32(ours5));
            bad++;
        }
    }
    return bad;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    rs_pool *pool = rs_pool_init(threads);
    threads = rs_pool_threads(pool);
    if (threads > MAX_THREADS) {
        fprintf(stderr, "at most %d threads\n", MAX_THREADS);
        return 2;
    }

    int bad_decode = check_decoders();
    printf("decoders: 2 x 256 codes vs __nv_cvt_fp8_to_halfraw, %d mismatches\n", bad_decode);

    double t0 = rs_now_s();
    rs_pool_run(pool, (int64_t)1 << 32, (int64_t)1 << 20, check_range, NULL);
    double dt = rs_now_s() - t0;

    uint64_t m4 = 0, m5 = 0;
    int shown4 = 0, shown5 = 0;
    for (int t = 0; t < threads; t++) {
        const thread_result *r = &results[t];
        for (uint64_t j = 0; j < r->mismatch_e4m3 && j < MAX_REPORT && shown4 < MAX_REPORT; j++, shown4++) {
            float x = f32_from_bits(r->first_e4m3[j]);
            printf("  e4m3 0x%08" PRIx32 " (%a): ours 0x%02x, cuda 0x%02x\n", r->first_e4m3[j], x,
                   rs_fp8_e4m3_from_f32(x), cuda_ref_e4m3(x));
        }
        for (uint64_t j = 0; j < r->mismatch_e5m2 && j < MAX_REPORT && shown5 < MAX_REPORT; j++, shown5++) {
            float x = f32_from_bits(r->first_e5m2[j]);
            printf("  e5m2 0x%08" PRIx32 " (%a): ours 0x%02x, cuda 0x%02x\n", r->first_e5m2[j], x,
                   rs_fp8_e5m2_from_f32(x), cuda_ref_e5m2(x));
        }
        m4 += r->mismatch_e4m3;
        m5 += r->mismatch_e5m2;
    }
    printf("encoders: 2^32 inputs x {e4m3, e5m2} SATFINITE vs __nv_cvt_float_to_fp8 (host path), "
           "%d threads, %.1f s\n", threads, dt);
    printf("  e4m3 mismatches %" PRIu64 ", e5m2 mismatches %" PRIu64 "\n", m4, m5);
    rs_pool_free(pool);
    int ok = bad_decode == 0 && m4 == 0 && m5 == 0;
    printf("%s\n", ok ? "OK" : "FAIL");
    return ok ? 0 : 1;
}
