/* cuda_runtime.h — the CPU emulation of the CUDA runtime and device intrinsics (tests/cuda_emu/README.md).
 * The C part is usable from C. */
#ifndef EMU_CUDA_RUNTIME_H
#define EMU_CUDA_RUNTIME_H
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
typedef struct emu_stream *cudaStream_t;
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
cudaError_t cudaFreeHost(void *p);
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
void emu_run_grid(const char *name, dim3 g, dim3 b, void (*body)(void *), void *arg);
template <class F> struct EmuLaunch;
/* operator() takes the kernel's own parameter types, so arguments convert as in a real launch
 * (NULL to a pointer parameter, int to size_t, ...) */
template <class... P> struct EmuLaunch<void (*)(P...)> {
    const char *name;
    dim3 g, b;
    void (*f)(P...);
    void operator()(P... a) {
        int i = 0;
        (emu_check_arg(name, i++, a), ...);
        auto call = [&]() { f(a...); };
        emu_run_grid(name, g, b, [](void *p) { (*(decltype(call) *)p)(); }, &call);
    }
};
template <class F> static inline EmuLaunch<F> emu_launch_(const char *name, dim3 g, dim3 b, size_t smem, cudaStream_t s,
                                                          F f) {
    (void)s;
    if (smem) { fprintf(stderr, "emu: dynamic shared memory not supported\n"); abort(); }
    return EmuLaunch<F>{name, g, b, f};
}
#define emu_launch(g, b, smem, s, ...) emu_launch_(#__VA_ARGS__, g, b, smem, s, __VA_ARGS__)
#endif /* __cplusplus */
#endif
