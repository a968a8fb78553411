/*
 * backend_cuda.cu — the CUDA backend: device memory, one stream, the cuBLASLt handle, and the op
 * table of kernels/backend.h.
 *
 * At this stage the backend owns the device plumbing that every kernel will use (allocation,
 * transfers on its stream, the single cuBLASLt handle with its workspace, NCCL's presence) and
 * publishes an op table whose compute entries are filled as each kernel lands with its CPU-twin
 * comparison test. rs_backend_missing_op() names the first op not yet provided, and model loading
 * refuses a backend that lacks any op it needs, so nothing silently runs a partial forward pass.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "../backend.h"
}
#include "cuda_check.h"

struct cuda_ctx {
    int device;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_workspace; /* cuBLASLt workspace, 32 MiB (Hopper recommendation) */
    size_t lt_workspace_bytes;
    size_t bytes_allocated;
};

static cuda_ctx *ctx_of(rs_backend *b) { return (cuda_ctx *)b->ctx; }

static void *cuda_alloc(rs_backend *b, size_t bytes) {
    cuda_ctx *c = ctx_of(b);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        rs_log(RS_LOG_LEVEL_ERROR, "cudaMalloc(%zu) failed: %s", bytes, cudaGetErrorString(e));
        return NULL;
    }
    CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, c->stream));
    c->bytes_allocated += bytes;
    return p;
}

static void cuda_free(rs_backend *b, void *p) {
    CUDA_CHECK(cudaStreamSynchronize(ctx_of(b)->stream));
    CUDA_CHECK(cudaFree(p));
}

static void cuda_upload(rs_backend *b, void *dst, const void *src, size_t bytes) {
    cuda_ctx *c = ctx_of(b);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
    /* The source is host memory the caller may reuse at once: wait until it has been read. */
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

static void cuda_download(rs_backend *b, void *dst, const void *src, size_t bytes) {
    cuda_ctx *c = ctx_of(b);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

static void cuda_copy(rs_backend *b, void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx_of(b)->stream));
}

static void cuda_destroy(rs_backend *b) {
    cuda_ctx *c = ctx_of(b);
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    CUDA_CHECK(cudaFree(c->lt_workspace));
    CUBLAS_CHECK(cublasLtDestroy(c->lt));
    CUDA_CHECK(cudaStreamDestroy(c->stream));
    free(c);
    free(b);
}

static rs_backend_ops make_ops(void) {
    rs_backend_ops ops;
    memset(&ops, 0, sizeof ops);
    ops.name = "cuda";
    ops.alloc = cuda_alloc;
    ops.free = cuda_free;
    ops.upload = cuda_upload;
    ops.download = cuda_download;
    ops.copy = cuda_copy;
    ops.destroy = cuda_destroy;
    return ops;
}

static const rs_backend_ops cuda_ops = make_ops();

extern "C" rs_backend *rs_backend_cuda_init(int device) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || device < 0 || device >= n) {
        rs_log(RS_LOG_LEVEL_ERROR, "CUDA device %d not available (%d devices: %s)", device, n,
               e == cudaSuccess ? "ok" : cudaGetErrorString(e));
        return NULL;
    }
    CUDA_CHECK(cudaSetDevice(device));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    int nccl_version = 0;
    NCCL_CHECK(ncclGetVersion(&nccl_version));

    cuda_ctx *c = (cuda_ctx *)rs_xcalloc(1, sizeof *c);
    c->device = device;
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasLtCreate(&c->lt));
    c->lt_workspace_bytes = (size_t)32 << 20;
    CUDA_CHECK(cudaMalloc(&c->lt_workspace, c->lt_workspace_bytes));

    rs_backend *b = (rs_backend *)rs_xcalloc(1, sizeof *b);
    b->ops = &cuda_ops;
    b->ctx = c;
    rs_log(RS_LOG_LEVEL_INFO, "cuda backend: device %d %s (sm_%d%d, %.1f GiB), cuBLASLt %zu, NCCL %d",
           device, prop.name, prop.major, prop.minor, (double)prop.totalGlobalMem / (1 << 30),
           cublasLtGetVersion(), nccl_version);
    return b;
}
