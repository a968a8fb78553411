/* cuda_runtime.h — the CPU emulation of the CUDA runtime and device intrinsics (tests/cuda_emu/README.md).
 * The C part is usable from C. */
#ifndef EMU_CUDA_RUNTIME_H
#define EMU_CUDA_RUNTIME_H
#define RS_CUDA_EMU 1 /* code that needs an emulation of a device-only instruction tests this */
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif
typedef int cudaError_t;
#define cudaSuccess 0
#define cudaErrorMemoryAllocation 2
#define cudaErrorInvalidDevice 101
#define cudaErrorNoDevice 100
#define cudaErrorStreamCaptureUnsupported 900
#define cudaErrorStreamCaptureInvalidated 901
typedef struct emu_stream *cudaStream_t;
typedef struct emu_graph *cudaGraph_t;
typedef struct emu_graph_exec *cudaGraphExec_t;
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1,
                             cudaStreamCaptureModeRelaxed = 2 };
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1,
                               cudaStreamCaptureStatusInvalidated = 2 };
#define cudaHostAllocDefault 0
typedef enum { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
               cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 } cudaMemcpyKind;
#define cudaStreamNonBlocking 1
typedef struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int major, minor;
    int multiProcessorCount;
    int warpSize;
} cudaDeviceProp;
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags);
cudaError_t cudaFreeHost(void *p);
/* stream capture as record and replay (emu_rt.cpp) */
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t st);
cudaError_t cudaMemset(void *d, int v, size_t n);
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorName(cudaError_t e);
const char *cudaGetErrorString(cudaError_t e);
/* emulator bookkeeping, for tests of the emulator itself */
extern size_t emu_launches, emu_blocks_run;
int emu_is_device_ptr(const void *p);
#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
#include <math.h>
#include <string.h>
#include <stdlib.h>
#include <stdio.h>
#include <algorithm>
#include <type_traits>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint3 { unsigned x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
/* one copy per OS thread; the emulator runs one block at a time per OS thread (and only one OS
 * thread runs blocks), so every block sees its own shared memory in sequence */
#define __shared__ static
#define __launch_bounds__(...)
#define __constant__ static

extern dim3 threadIdx, blockIdx, blockDim, gridDim;
void emu_syncthreads(void);
void emu_syncwarp(void);
void emu_shfl_put(uint64_t v);
uint64_t emu_shfl_get(int src_lane);
void emu_check_mask(unsigned mask);

static inline void __syncthreads(void) { emu_syncthreads(); }
static inline void __syncwarp(unsigned m = 0xffffffffu) { emu_check_mask(m); emu_syncwarp(); }

/* Atomics: a block's fibers switch only at the scheduling points above and blocks run one after
 * another, so a read-modify-write is atomic as it stands. */
static inline int atomicMin(int *p, int v) {
    const int old = *p;
    if (v < old) *p = v;
    return old;
}

template <class T> static inline T emu_shfl(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 8, "shfl of > 8 bytes");
    emu_check_mask(mask);
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    emu_shfl_put(u);
    uint64_t r = emu_shfl_get(src & 31);
    T out;
    memcpy(&out, &r, sizeof out);
    return out;
}
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int laneMask, int width = 32) {
    if (width != 32) abort();
    return emu_shfl(mask, v, (int)(threadIdx.x % 32) ^ laneMask);
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    if (width != 32) abort();
    return emu_shfl(mask, v, src);
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    if (width != 32) abort();
    int l = (int)(threadIdx.x % 32) + (int)d;
    return emu_shfl(mask, v, l < 32 ? l : (int)(threadIdx.x % 32));
}
template <class T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    if (width != 32) abort();
    int l = (int)(threadIdx.x % 32) - (int)d;
    return emu_shfl(mask, v, l >= 0 ? l : (int)(threadIdx.x % 32));
}
template <class T> static inline T __ldg(const T *p) { return *p; }

/* The warp-collective exchange: every lane of the warp passes `bytes` (<= EMU_WARP_ROW) and gets
 * the 32 lanes' contributions in lane order, row l at offset EMU_WARP_ROW * l of what it returns (a
 * scheduling point, like a shuffle). The rows are the runtime's own buffer, which the warp's
 * collective after next overwrites: read them before this lane's next scheduling point. */
enum { EMU_WARP_ROW = 64 };
const uint8_t *emu_warp_exchange(const void *mine, size_t bytes);
#define EMU_NOSAN __attribute__((no_sanitize("address", "undefined")))
EMU_NOSAN static inline uint32_t emu_warp_word(const uint8_t *rows, int lane, int i) { /* word i of lane's row */
    uint32_t w;
    memcpy(&w, rows + EMU_WARP_ROW * lane + 4 * i, 4);
    return w;
}

/* mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 on the warp, d += A B, with the PTX ISA's
 * fragment layouts (groupID g = lane / 4, t = lane % 4): a[0] holds A[g][2t, 2t+1] (low half first),
 * a[1] A[g+8][2t..], a[2] A[g][2t+8..], a[3] A[g+8][2t+8..]; b[0] B[2t, 2t+1][g], b[1] B[2t+8..][g];
 * d[0..1] D[g][2t, 2t+1], d[2..3] D[g+8][2t..]. Products of BF16 (or F16) values are exact in fp32;
 * the sum over k runs in order. */
EMU_NOSAN static inline float emu_half_bits_f32(uint32_t h) { /* IEEE binary16 bits -> float, exact */
    const uint32_t sg = (h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float f;
    if (e == 0x1f) { uint32_t u = sg | 0x7f800000u | (m << 13); memcpy(&f, &u, 4); return f; }
    if (e) { uint32_t u = sg | ((e + 112) << 23) | (m << 13); memcpy(&f, &u, 4); return f; }
    f = (float)m * 0x1p-24f;
    return sg ? -f : f;
}
/* The warp-level matrix helpers below work on register values (the lanes' rows in the exchange
 * buffer and their own arrays, never on the kernels' memory), so they are left out of the
 * sanitizers' instrumentation: a cost with nothing to find (they were the sanitized emulation's
 * hottest function, 13% of a tensor-core test; GCC does not inline an instrumented function into
 * them, so their callees are marked too). */
/* This lane's C fragment of d += A B: A holds the lane's rows g and g + 8, B its columns 2t and
 * 2t + 1 (only those are decoded: a lane reads 1/8 of A and 1/4 of B); the sum over k in order. */
template <int K> EMU_NOSAN static inline void emu_mma_accumulate(float d[4], const float (&A)[2][K], const float (&B)[K][2]) {
    for (int i = 0; i < 4; i++) {
        float acc = d[i];
        for (int k = 0; k < K; k++) acc += A[i >> 1][k] * B[k][i & 1];
        d[i] = acc;
    }
}
EMU_NOSAN static inline float emu_b16_f32(uint32_t v, int hi, bool f16) { /* half `hi` of v, BF16 or F16 bits */
    const uint32_t h16 = hi ? v >> 16 : v & 0xffffu;
    if (f16) return emu_half_bits_f32(h16);
    const uint32_t u = h16 << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
EMU_NOSAN static inline void emu_mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2], bool f16) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    const uint8_t *all = emu_warp_exchange(mine, sizeof mine);
    const int l = (int)(threadIdx.x % 32), g = l / 4, t = l % 4;
    float A[2][16], B[16][2];
    for (int u = 0; u < 4; u++) /* A rows g, g + 8 are in lanes 4g + u; B column c in lanes 4c + u */
        for (int h = 0; h < 2; h++) {
            const int la = 4 * g + u;
            A[0][2 * u + h] = emu_b16_f32(emu_warp_word(all, la, 0), h, f16);
            A[1][2 * u + h] = emu_b16_f32(emu_warp_word(all, la, 1), h, f16);
            A[0][2 * u + 8 + h] = emu_b16_f32(emu_warp_word(all, la, 2), h, f16);
            A[1][2 * u + 8 + h] = emu_b16_f32(emu_warp_word(all, la, 3), h, f16);
            for (int c = 0; c < 2; c++) {
                const int lb = 4 * (2 * t + c) + u;
                B[2 * u + h][c] = emu_b16_f32(emu_warp_word(all, lb, 4), h, f16);
                B[2 * u + 8 + h][c] = emu_b16_f32(emu_warp_word(all, lb, 5), h, f16);
            }
        }
    emu_mma_accumulate(d, A, B);
}

/* mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 on the warp, d += A B, with the PTX ISA's
 * fragment layout for 8-bit operands (g = lane / 4, t = lane % 4; byte i of a register is its bits
 * [8i, 8i + 8)): a[0] holds A[g][4t + i], a[1] A[g+8][4t + i], a[2] A[g][16 + 4t + i], a[3]
 * A[g+8][16 + 4t + i]; b[0] B[4t + i][g], b[1] B[16 + 4t + i][g]; d as in emu_mma_16816. Codes
 * decode with the project's CPU codec (kernels/fp8.h; NaN codes give NaN); the products are exact in
 * fp32 and the sum over k runs in order, in fp32 (the hardware's is coarser: test_cuda_blas.c
 * FP8_MMA_REL). */
extern "C" const float rs_fp8_e4m3_f32[256]; /* kernels/fp8.h */
EMU_NOSAN static inline void emu_mma_16832_e4m3(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    const uint8_t *all = emu_warp_exchange(mine, sizeof mine);
    const int l = (int)(threadIdx.x % 32), g = l / 4, t = l % 4;
    float A[2][32], B[32][2];
    for (int u = 0; u < 4; u++) /* A rows g, g + 8 are in lanes 4g + u; B column c in lanes 4c + u */
        for (int i = 0; i < 4; i++) {
            auto code = [i](uint32_t r) { return rs_fp8_e4m3_f32[(r >> (8 * i)) & 0xffu]; };
            const int la = 4 * g + u;
            A[0][4 * u + i] = code(emu_warp_word(all, la, 0)), A[1][4 * u + i] = code(emu_warp_word(all, la, 1));
            A[0][16 + 4 * u + i] = code(emu_warp_word(all, la, 2)), A[1][16 + 4 * u + i] = code(emu_warp_word(all, la, 3));
            for (int c = 0; c < 2; c++) {
                const int lb = 4 * (2 * t + c) + u;
                B[4 * u + i][c] = code(emu_warp_word(all, lb, 4)), B[16 + 4 * u + i][c] = code(emu_warp_word(all, lb, 5));
            }
        }
    emu_mma_accumulate(d, A, B);
}

/* movmatrix.sync.aligned.m8n8.trans.b16: lane l holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1
 * (low half first) of an 8x8 matrix of 16-bit elements; it gets the same of the transpose. */
EMU_NOSAN static inline uint32_t emu_movmatrix_trans(uint32_t x) {
    const uint8_t *all = emu_warp_exchange(&x, sizeof x);
    const int l = (int)(threadIdx.x % 32), g = l / 4, t = l % 4;
    uint32_t y = 0;
    for (int i = 0; i < 2; i++) { /* element (g, 2t + i) of the transpose = (2t + i, g) of the original */
        const uint32_t src = emu_warp_word(all, 4 * (2 * t + i) + g / 2, 0);
        y |= ((g % 2 ? src >> 16 : src) & 0xffffu) << (16 * i);
    }
    return y;
}

/* correctly rounded float / double ops (the host FPU is IEEE; compiled with -ffp-contract=off) */
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline float __double2float_rn(double d) { return (float)d; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline double __longlong_as_double(long long l) { double d; memcpy(&d, &l, 8); return d; }
static inline long long __double_as_longlong(double d) { long long l; memcpy(&l, &d, 8); return l; }
static inline double __hiloint2double(int hi, int lo) {
    uint64_t u = ((uint64_t)(uint32_t)hi << 32) | (uint32_t)lo;
    double d;
    memcpy(&d, &u, 8);
    return d;
}
static inline int __double2hiint(double d) { uint64_t u; memcpy(&u, &d, 8); return (int)(u >> 32); }
static inline int __double2loint(double d) { uint64_t u; memcpy(&u, &d, 8); return (int)u; }
/* CUDA's device min/max overloads */
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline long min(long a, long b) { return a < b ? a : b; }
static inline long max(long a, long b) { return a > b ? a : b; }
static inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
static inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
using std::isnan;
using std::isinf;
using std::isfinite;

/* kernel launches: `k<<<g, b, smem, s>>>(args)` is rewritten to emu_launch(g, b, smem, s, k)(args) */
void emu_check_kernel_ptr(const char *name, int i, const void *p);
template <class T> static inline void emu_check_arg(const char *name, int i, const T &v) {
    if constexpr (std::is_pointer<T>::value) emu_check_kernel_ptr(name, i, (const void *)v);
}
#include <functional>
/* runs the grid now, or records it when s is capturing */
void emu_launch_grid(cudaStream_t s, const char *name, dim3 g, dim3 b, std::function<void()> body);
template <class F> struct EmuLaunch;
/* operator() takes the kernel's own parameter types, so arguments convert as in a real launch
 * (NULL to a pointer parameter, int to size_t, ...); the kernel keeps copies of them, as a real
 * launch or a captured graph node does */
template <class... P> struct EmuLaunch<void (*)(P...)> {
    const char *name;
    dim3 g, b;
    cudaStream_t s;
    void (*f)(P...);
    void operator()(P... a) {
        int i = 0;
        (emu_check_arg(name, i++, a), ...);
        void (*fn)(P...) = f;
        emu_launch_grid(s, name, g, b, [fn, a...]() { fn(a...); });
    }
};
template <class F> static inline EmuLaunch<F> emu_launch_(const char *name, dim3 g, dim3 b, size_t smem, cudaStream_t s,
                                                          F f) {
    if (smem) { fprintf(stderr, "emu: dynamic shared memory not supported\n"); abort(); }
    return EmuLaunch<F>{name, g, b, s, f};
}
#define emu_launch(g, b, smem, s, ...) emu_launch_(#__VA_ARGS__, g, b, smem, s, __VA_ARGS__)

/* cudaLaunchKernelEx with its attributes: programmatic stream serialization (PDL) changes nothing
 * here, where launches run one after another (griddepcontrol is compiled only for the device). */
enum cudaLaunchAttributeID { cudaLaunchAttributeProgrammaticStreamSerialization = 4 };
union cudaLaunchAttributeValue {
    int programmaticStreamSerializationAllowed;
};
struct cudaLaunchAttribute {
    cudaLaunchAttributeID id;
    cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
    dim3 gridDim, blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute *attrs;
    unsigned numAttrs;
};
template <class... P, class... A>
static inline cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t *cfg, void (*k)(P...), A &&...a) {
    for (unsigned i = 0; i < cfg->numAttrs; i++)
        if (cfg->attrs[i].id != cudaLaunchAttributeProgrammaticStreamSerialization) {
            fprintf(stderr, "emu: cudaLaunchKernelEx attribute %d not emulated\n", (int)cfg->attrs[i].id);
            abort();
        }
    emu_launch_("cudaLaunchKernelEx", cfg->gridDim, cfg->blockDim, cfg->dynamicSmemBytes, cfg->stream, k)(a...);
    return cudaSuccess;
}
#endif /* __cplusplus */
#endif
