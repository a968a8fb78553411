/*
 * backend_cuda.cu — the CUDA backend: device memory, one stream, the cuBLASLt handle, and the op
 * table of kernels/backend.h.
 *
 * This file owns the device plumbing every kernel uses: allocation, transfers on the one stream,
 * the stream-ordered scratch buffers and host-array mirrors of cuda_internal.h, the cuBLASLt handle
 * with its workspace, and NCCL's presence. The compute ops live one concept per file (cuda_ops.cu,
 * cuda_matmul.cu, cuda_attention.cu, cuda_moe.cu), each with its CPU-twin comparison tests in
 * tests/unit/test_cuda_*.c, which scripts/gpu-check.sh runs on a machine with a GPU.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

static rs_cuda_ctx *ctx_of(rs_backend *b) { return rs_cuda_ctx_of(b); }

/* These may be called from any thread (weight staging runs beside the engine): each holds the
 * capture lock (backend.h), so none lands in the middle of a step graph's recording. So does every
 * other allocation and free here, since a second backend on the same GPU (the sync service's KV
 * calibration) runs its own ops on another thread while the engine's backend may record. */

static void *cuda_alloc(rs_backend *b, size_t bytes) {
    rs_cuda_ctx *c = ctx_of(b);
    void *p = NULL;
    rs_backend_cuda_capture_lock();
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        rs_backend_cuda_capture_unlock();
        rs_log(RS_LOG_LEVEL_ERROR, "cudaMalloc(%zu) failed: %s", bytes, cudaGetErrorString(e));
        return NULL;
    }
    CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, c->stream));
    rs_backend_cuda_capture_unlock();
    return p;
}

static void cuda_free(rs_backend *b, void *p) {
    rs_backend_cuda_capture_lock();
    CUDA_CHECK(cudaStreamSynchronize(ctx_of(b)->stream));
    CUDA_CHECK(cudaFree(p));
    rs_backend_cuda_capture_unlock();
}

static void cuda_upload(rs_backend *b, void *dst, const void *src, size_t bytes) {
    rs_cuda_ctx *c = ctx_of(b);
    rs_backend_cuda_capture_lock();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
    /* The source is host memory the caller may reuse at once: wait until it has been read. */
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    rs_backend_cuda_capture_unlock();
}

static void cuda_download(rs_backend *b, void *dst, const void *src, size_t bytes) {
    rs_cuda_ctx *c = ctx_of(b);
    rs_backend_cuda_capture_lock();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    rs_backend_cuda_capture_unlock();
}

static void cuda_sync(rs_backend *b) { CUDA_CHECK(cudaStreamSynchronize(ctx_of(b)->stream)); }

static void cuda_copy(rs_backend *b, void *dst, const void *src, size_t bytes) {
    rs_backend_cuda_capture_lock();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx_of(b)->stream));
    rs_backend_cuda_capture_unlock();
}

/* ---- scratch and mirrors (cuda_internal.h) ---- */

/* buf holds at least `bytes`; the old contents are not kept. Stream-ordered, so a kernel queued
 * earlier still reads the old allocation before it is released. */
static void *buf_reserve(rs_cuda_ctx *c, rs_cuda_buf *buf, size_t bytes) {
    if (bytes <= buf->cap && buf->p) return buf->p;
    if (c->recording) { /* a recorded step may not allocate: it reruns op by op, which grows it */
        rs_cuda_recording_broken(c, "a scratch buffer must grow");
        return buf->p;
    }
    c->mem_gen++;
    size_t cap = RS_MAX(bytes, buf->cap + buf->cap / 2);
    cap = (cap + ((size_t)1 << 16) - 1) & ~(((size_t)1 << 16) - 1); /* 64 KiB granules */
    void *p = NULL; /* the new one first: a moved buffer never reuses the old address */
    rs_backend_cuda_capture_lock(); /* another thread's backend (KV calibration) may be recording */
    CUDA_CHECK(cudaMallocAsync(&p, cap, c->stream));
    if (buf->p) CUDA_CHECK(cudaFreeAsync(buf->p, c->stream));
    rs_backend_cuda_capture_unlock();
    buf->p = p;
    buf->cap = cap;
    return buf->p;
}

void *rs_cuda_scratch(rs_cuda_ctx *c, int slot, size_t bytes) {
    RS_ASSERT(slot >= 0 && slot < RS_CUDA_S_COUNT);
    return buf_reserve(c, &c->scratch[slot], bytes);
}

/* Recording: the copy of host[0, bytes) into m's device buffer is recorded from m's pinned buffer
 * (each mirror copies one host array per step; the first copy of a step serves its later uses). */
static const void *mirror_record(rs_cuda_ctx *c, int slot, const void *host, size_t bytes) {
    rs_cuda_mirror *m = &c->mirror[slot];
    if (m->rec_src == host && m->rec_bytes == bytes) return m->dev.p;
    if (m->rec_src) rs_cuda_recording_broken(c, "one mirror copies two host arrays in one step");
    else if (!m->dev.p || m->dev.cap < bytes || m->pinned_cap < bytes) rs_cuda_recording_broken(c, "a mirror must grow");
    if (c->rec_broken) return m->dev.p;
    CUDA_CHECK(cudaMemcpyAsync(m->dev.p, m->pinned, bytes, cudaMemcpyHostToDevice, c->stream));
    m->rec_src = host;
    m->rec_bytes = bytes;
    rs_cuda_graph_note_copy(c, slot, host, bytes);
    return m->dev.p;
}

const void *rs_cuda_mirror_of(rs_cuda_ctx *c, int slot, const void *host, size_t bytes) {
    RS_ASSERT(slot >= 0 && slot < RS_CUDA_M_COUNT);
    rs_cuda_mirror *m = &c->mirror[slot];
    if (bytes == 0) return buf_reserve(c, &m->dev, 1);
    if (c->recording) return mirror_record(c, slot, host, bytes);
    if (c->graphs && m->pinned_cap < bytes) { /* room for a later recording's staging */
        rs_backend_cuda_capture_lock();
        if (m->pinned) {
            CUDA_CHECK(cudaFreeHost(m->pinned));
            c->mem_gen++; /* recordings copy from the old staging buffer: they go */
        }
        m->pinned_cap = RS_MAX(bytes, m->pinned_cap + m->pinned_cap / 2);
        CUDA_CHECK(cudaMallocHost(&m->pinned, m->pinned_cap));
        rs_backend_cuda_capture_unlock();
    }
    if (m->dev.p && bytes == m->bytes && memcmp(host, m->host, bytes) == 0) return m->dev.p;
    void *dev = buf_reserve(c, &m->dev, bytes);
    /* Pageable source: the driver stages it before returning, so `host` may change afterwards;
     * the copy is queued behind every kernel that still reads the previous contents. */
    CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, c->stream));
    if (m->host_cap < bytes) {
        free(m->host);
        m->host = rs_xmalloc(bytes);
        m->host_cap = bytes;
    }
    memcpy(m->host, host, bytes);
    m->bytes = bytes;
    return dev;
}

/* Test hook: every scratch and mirror buffer moves to a new allocation (what growth does), so a
 * recording that still pointed at one would read freed memory. */
extern "C" void rs_cuda_test_move_buffers(rs_backend *b) {
    rs_cuda_ctx *c = ctx_of(b);
    for (int i = 0; i < RS_CUDA_S_COUNT + RS_CUDA_M_COUNT; i++) {
        rs_cuda_buf *buf = i < RS_CUDA_S_COUNT ? &c->scratch[i] : &c->mirror[i - RS_CUDA_S_COUNT].dev;
        if (!buf->p) continue;
        const size_t cap = buf->cap;
        buf_reserve(c, buf, cap + 1);
        if (i >= RS_CUDA_S_COUNT) c->mirror[i - RS_CUDA_S_COUNT].bytes = 0; /* contents gone */
    }
}

static void cuda_destroy(rs_backend *b) {
    rs_cuda_ctx *c = ctx_of(b);
    rs_backend_cuda_capture_lock();
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    for (int i = 0; i < RS_CUDA_S_COUNT; i++)
        if (c->scratch[i].p) CUDA_CHECK(cudaFreeAsync(c->scratch[i].p, c->stream));
    rs_cuda_graphs_free(c);
    rs_cuda_moe_tables_free(c);
    for (int i = 0; i < RS_CUDA_M_COUNT; i++) {
        if (c->mirror[i].dev.p) CUDA_CHECK(cudaFreeAsync(c->mirror[i].dev.p, c->stream));
        if (c->mirror[i].pinned) CUDA_CHECK(cudaFreeHost(c->mirror[i].pinned));
        free(c->mirror[i].host);
    }
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    rs_cuda_blas_free(c);
    CUDA_CHECK(cudaStreamDestroy(c->stream));
    rs_backend_cuda_capture_unlock();
    free(c);
    free(b);
}

static rs_numerics cuda_set_numerics(rs_backend *b, rs_numerics want) {
    rs_cuda_ctx *c = ctx_of(b);
    c->numerics = want;
    return c->numerics;
}

static rs_numerics cuda_numerics(const rs_backend *b) { return ((const rs_cuda_ctx *)b->ctx)->numerics; }

static rs_backend_ops make_ops(void) {
    rs_backend_ops ops;
    memset(&ops, 0, sizeof ops);
    ops.name = "cuda";
    ops.alloc = cuda_alloc;
    ops.free = cuda_free;
    ops.upload = cuda_upload;
    ops.download = cuda_download;
    ops.copy = cuda_copy;
    ops.embed = rs_cuda_op_embed;
    ops.rmsnorm = rs_cuda_op_rmsnorm;
    ops.matmul = rs_cuda_op_matmul;
    ops.matmul_group = rs_cuda_op_matmul_group;
    ops.rope = rs_cuda_op_rope;
    ops.add_rmsnorm = rs_cuda_op_add_rmsnorm;
    ops.qk_norm_rope = rs_cuda_op_qk_norm_rope;
    ops.kv_store = rs_cuda_op_kv_store;
    ops.attention = rs_cuda_op_attention;
    ops.swiglu = rs_cuda_op_swiglu;
    ops.add = rs_cuda_op_add;
    ops.gather_rows = rs_cuda_op_gather_rows;
    ops.moe = rs_cuda_op_moe;
    ops.set_numerics = cuda_set_numerics;
    ops.numerics = cuda_numerics;
    ops.sample = rs_cuda_op_sample;
    ops.graph_begin = rs_cuda_graph_begin;
    ops.graph_end = rs_cuda_graph_end;
    ops.graph_forget = rs_cuda_graph_forget;
    ops.sync = cuda_sync;
    ops.destroy = cuda_destroy;
    return ops;
}

static const rs_backend_ops cuda_ops = make_ops();

extern "C" int rs_backend_cuda_device(const rs_backend *b) {
    return b->ops == &cuda_ops ? ((const rs_cuda_ctx *)b->ctx)->device : -1;
}

extern "C" void rs_backend_cuda_set_pdl(rs_backend *b, bool on) {
    RS_ASSERT(b->ops == &cuda_ops);
    ctx_of(b)->pdl = on;
}

extern "C" int rs_backend_cuda_set_gemv_rows(rs_backend *b, rs_dtype weight_dtype, int rows) {
    RS_ASSERT(b->ops == &cuda_ops && rows >= 0);
    RS_ASSERT(weight_dtype == RS_DTYPE_E4M3 || weight_dtype == RS_DTYPE_BF16);
    rs_cuda_ctx *c = ctx_of(b);
    int *slot = weight_dtype == RS_DTYPE_E4M3 ? &c->gemv_rows_fp8 : &c->gemv_rows_bf16;
    const int old = *slot;
    *slot = rows;
    return old;
}

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

    rs_cuda_ctx *c = (rs_cuda_ctx *)rs_xcalloc(1, sizeof *c);
    c->device = device;
    c->sm_count = prop.multiProcessorCount;
    const char *pdl = getenv("RS_CUDA_PDL"); /* backend.h rs_backend_cuda_set_pdl */
    c->pdl = pdl && strcmp(pdl, "1") == 0;
    const char *att_sh = getenv("RS_CUDA_ATTENTION_SHARED"); /* backend.h rs_backend_cuda_set_attention_shared */
    c->att_shared = att_sh && strcmp(att_sh, "1") == 0;
    const char *att = getenv("RS_CUDA_ATTENTION"); /* backend.h rs_backend_cuda_set_attention_kernel */
    c->att_kernel = RS_CUDA_ATTENTION_PIPELINED;
    if (att && strcmp(att, "tiles") == 0) c->att_kernel = RS_CUDA_ATTENTION_TILES;
    else if (att && strcmp(att, "staged") == 0) c->att_kernel = RS_CUDA_ATTENTION_STAGED;
    else if (att && strcmp(att, "warps") == 0) c->att_kernel = RS_CUDA_ATTENTION_WARPS;
    else if (att && strcmp(att, "mma") == 0) c->att_kernel = RS_CUDA_ATTENTION_MMA;
    else if (att && *att && strcmp(att, "pipelined") != 0)
        rs_log(RS_LOG_LEVEL_WARN, "RS_CUDA_ATTENTION=%s is none of tiles, staged, warps, pipelined, mma: pipelined", att);
    c->numerics = RS_NUMERICS_EXACT;
    c->gemv_rows_fp8 = RS_CUDA_GEMV_ROWS_FP8;
    c->gemv_rows_bf16 = RS_CUDA_GEMV_ROWS_BF16;
    rs_backend_cuda_capture_lock(); /* a second backend (KV calibration) starts beside the engine's */
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    rs_cuda_blas_init(c);
    rs_backend_cuda_capture_unlock();

    rs_backend *b = (rs_backend *)rs_xcalloc(1, sizeof *b);
    b->ops = &cuda_ops;
    b->ctx = c;
    rs_backend_cuda_set_graphs(b, true);
    rs_log(RS_LOG_LEVEL_INFO, "cuda backend: device %d %s (sm_%d%d, %.1f GiB), cuBLASLt %zu, NCCL %d",
           device, prop.name, prop.major, prop.minor, (double)prop.totalGlobalMem / (1 << 30),
           rs_cuda_blas_version(c), nccl_version);
    return b;
}
