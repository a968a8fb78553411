/*
 * nccl_staging.cu — the NCCL transport of weight updates (sync/nccl.h): a communicator joined
 * without blocking forever, and the receive of the trainer's broadcasts into device staging with a
 * copy to pinned host memory, on a stream of its own.
 *
 * Unlike the backend's CUDA_CHECK/NCCL_CHECK (kernels/cuda/cuda_check.h), nothing here aborts the
 * process: a trainer that dies, a network that drops or a peer that never joins is an error of
 * one request. Every CUDA and NCCL call goes through CUDA_TRY / NCCL_TRY, which log the call text,
 * file and line with the library's message and return RS_EIO (RS_ENOMEM for an allocation).
 *
 * Waiting. The communicator is non-blocking (ncclConfig_t.blocking = 0): ncclCommInitRankConfig
 * and ncclBroadcast may return ncclInProgress, and ncclCommGetAsyncError is polled until the
 * operation is enqueued or fails. Completion of a receive is an event after its host copy, polled
 * together with the communicator's asynchronous error. Every wait has a deadline; on a timeout or
 * an error the communicator is aborted (ncclCommAbort stops its kernels), after which only
 * rs_nccl_comm_free remains. Staging is freed only once the stream has drained, so that an aborted
 * kernel can never write into freed memory (if the stream does not drain, the memory is leaked and
 * logged instead).
 *
 * Slots. Two staging slots let the next broadcast land while the host converts the previous one.
 * A slot grows (to the buffer size rounded up to 2 MiB) only when no receive is in flight: freeing
 * device or pinned memory may synchronize the device, and an in-flight receive waits on the trainer.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <nccl.h>

extern "C" {
#include "../core/rs.h"
#include "../kernels/backend.h"
#include "nccl.h"
}

static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId is 128 bytes (RS_NCCL_UNIQUE_ID_BYTES)");

#define SLOT_ALIGN ((uint64_t)2 << 20)
#define DRAIN_TIMEOUT_S 10.0            /* stream drain after an abort */

struct staging_slot {
    void *dev;                          /* [cap] bytes, device */
    void *host;                         /* [cap] bytes, pinned host */
    uint64_t cap;
    uint64_t bytes;                     /* of the posted receive */
    cudaEvent_t done;                   /* recorded after the host copy */
    bool posted;                        /* a receive was posted and not yet waited for */
    bool complete;                      /* its event has fired (waited for by a slot growth) */
};

struct rs_nccl_comm {
    ncclComm_t comm;
    cudaStream_t stream;
    int device, rank, world_size;
    bool aborted;                       /* the communicator is gone: only free remains */
    staging_slot slot[2];
};

static int cuda_fail(rs_error *err, cudaError_t e, const char *call, const char *file, int line) {
    rs_log(RS_LOG_LEVEL_ERROR, "CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(e), cudaGetErrorString(e),
           call, file, line);
    int code = e == cudaErrorMemoryAllocation ? RS_ENOMEM : RS_EIO;
    return rs_error_set(err, code, NULL, "CUDA error %s (%s) in %s", cudaGetErrorName(e), cudaGetErrorString(e),
                        call);
}

static int nccl_fail(rs_error *err, ncclComm_t comm, ncclResult_t r, const char *call, const char *file,
                     int line) {
    const char *last = ncclGetLastError(comm);
    rs_log(RS_LOG_LEVEL_ERROR, "NCCL error %s in %s at %s:%d: %s", ncclGetErrorString(r), call, file, line,
           last ? last : "");
    return rs_error_set(err, RS_EIO, NULL, "NCCL error %s in %s%s%s", ncclGetErrorString(r), call,
                        last && *last ? ": " : "", last ? last : "");
}

#define CUDA_TRY(call)                                                                            \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            rc = cuda_fail(err, e_, #call, __FILE__, __LINE__);                                   \
            goto fail;                                                                            \
        }                                                                                         \
    } while (0)

/* Cleanup paths: log a failure and go on (there is nothing left to undo). */
#define CUDA_LOG(call)                                                                            \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess)                                                                    \
            rs_log(RS_LOG_LEVEL_ERROR, "CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(e_), \
                   cudaGetErrorString(e_), #call, __FILE__, __LINE__);                           \
    } while (0)

/* ncclInProgress is not a failure on a non-blocking communicator: the caller waits for it. */
#define NCCL_TRY(comm, call)                                                                      \
    do {                                                                                          \
        ncclResult_t r_ = (call);                                                                 \
        if (r_ != ncclSuccess && r_ != ncclInProgress) {                                          \
            rc = nccl_fail(err, (comm), r_, #call, __FILE__, __LINE__);                           \
            goto fail;                                                                            \
        }                                                                                         \
    } while (0)

/* Polling back-off: ~20 us for the first few thousand polls (a per-tensor update waits for many
 * short broadcasts), then 1 ms. */
static void poll_sleep(unsigned spin) {
    struct timespec ts = {0, spin < 4096 ? 20000L : 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Waits until the communicator's pending operation (init, an enqueue, finalize) leaves
 * ncclInProgress. RS_EBUSY at the deadline or once *cancel (may be NULL) is set, RS_EIO when it
 * failed. */
static int wait_comm(ncclComm_t comm, double deadline, const volatile int *cancel, const char *what, rs_error *err) {
    ncclResult_t st = ncclInProgress;
    for (unsigned spin = 0;; spin++) {
        ncclResult_t r = ncclCommGetAsyncError(comm, &st);
        if (r != ncclSuccess) return nccl_fail(err, comm, r, "ncclCommGetAsyncError", __FILE__, __LINE__);
        if (st != ncclInProgress) break;
        if (rs_now_s() > deadline)
            return rs_error_set(err, RS_EBUSY, NULL, "NCCL %s made no progress before its deadline", what);
        if (cancel && __atomic_load_n(cancel, __ATOMIC_ACQUIRE))
            return rs_error_set(err, RS_EBUSY, NULL, "NCCL %s was cancelled", what);
        poll_sleep(spin);
    }
    if (st != ncclSuccess) return nccl_fail(err, comm, st, what, __FILE__, __LINE__);
    return RS_OK;
}

/* Waits for the stream to finish its work, up to timeout_s; false if it did not (or failed). */
static bool drain_stream(cudaStream_t s, double timeout_s) {
    double deadline = rs_now_s() + timeout_s;
    for (unsigned spin = 0;; spin++) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) return true;
        if (e != cudaErrorNotReady) {
            rs_log(RS_LOG_LEVEL_ERROR, "nccl staging: cudaStreamQuery: %s", cudaGetErrorString(e));
            return false;
        }
        if (rs_now_s() > deadline) return false;
        poll_sleep(spin);
    }
}

static void abort_comm(rs_nccl_comm *c) {
    if (c->aborted) return;
    c->aborted = true;
    if (!c->comm) return;
    ncclResult_t r = ncclCommAbort(c->comm);
    if (r != ncclSuccess)
        rs_log(RS_LOG_LEVEL_ERROR, "NCCL error %s in ncclCommAbort at %s:%d", ncclGetErrorString(r), __FILE__,
               __LINE__);
    c->comm = NULL;
}

extern "C" int rs_nccl_cuda_device_count(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* clear it: no device is an answer, not a sticky error */
        return 0;
    }
    return n;
}

extern "C" int rs_nccl_version(void) {
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess) return 0;
    return v;
}

extern "C" int rs_nccl_new_unique_id(uint8_t id[128], rs_error *err) {
    ncclUniqueId uid;
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess) return nccl_fail(err, NULL, r, "ncclGetUniqueId(&uid)", __FILE__, __LINE__);
    memcpy(id, uid.internal, sizeof uid.internal);
    return RS_OK;
}

extern "C" int rs_nccl_comm_init(rs_nccl_comm **out, const uint8_t id[128], int world_size, int rank,
                                 int device, double timeout_s, const volatile int *cancel, rs_error *err) {
    int rc = RS_OK;
    *out = NULL;
    rs_nccl_comm *c = (rs_nccl_comm *)calloc(1, sizeof *c);
    if (!c) return rs_error_set(err, RS_ENOMEM, NULL, "out of memory");
    c->device = device;
    c->rank = rank;
    c->world_size = world_size;

    ncclUniqueId uid;
    memcpy(uid.internal, id, sizeof uid.internal);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    cfg.commName = "rolloutd-weights";
    double deadline = rs_now_s() + timeout_s;

    CUDA_TRY(cudaSetDevice(device));
    CUDA_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    for (int i = 0; i < 2; i++) CUDA_TRY(cudaEventCreateWithFlags(&c->slot[i].done, cudaEventDisableTiming));

    NCCL_TRY(c->comm, ncclCommInitRankConfig(&c->comm, world_size, uid, rank, &cfg));
    rc = wait_comm(c->comm, deadline, cancel, "ncclCommInitRankConfig", err);
    if (rc == RS_EBUSY)
        rs_error_set(err, RS_EBUSY, NULL,
                     "rank 0 (the trainer) and the other ranks did not join within %.0f s: the trainer "
                     "must call ncclCommInitRank with the same unique id while this request waits",
                     timeout_s);
    if (rc != RS_OK) goto fail;
    *out = c;
    return RS_OK;

fail:
    rs_nccl_comm_free(c, true, 0);
    return rc;
}

/* Waits for a posted slot's event (receive + host copy) up to the deadline. */
static int wait_slot(rs_nccl_comm *c, staging_slot *sl, double deadline, rs_error *err) {
    int rc = RS_OK;
    for (unsigned spin = 0; !sl->complete; spin++) {
        cudaError_t e = cudaEventQuery(sl->done);
        if (e == cudaSuccess) {
            sl->complete = true;
            break;
        }
        if (e != cudaErrorNotReady) CUDA_TRY(e);
        ncclResult_t st = ncclSuccess;
        NCCL_TRY(c->comm, ncclCommGetAsyncError(c->comm, &st));
        if (st != ncclSuccess && st != ncclInProgress) {
            rc = nccl_fail(err, c->comm, st, "ncclBroadcast (asynchronous error)", __FILE__, __LINE__);
            goto fail;
        }
        if (rs_now_s() > deadline) {
            rc = rs_error_set(err, RS_EBUSY, NULL,
                              "NCCL broadcast of %llu bytes from rank 0 did not complete before its deadline "
                              "(the trainer stopped broadcasting, or broadcast a different size)",
                              (unsigned long long)sl->bytes);
            goto fail;
        }
        poll_sleep(spin);
    }
    return RS_OK;
fail:
    return rc;
}

/* Frees and reallocates slot `sl` with room for `bytes`; nothing may be in flight on the stream.
 * Under the backend's capture lock: the engine may be recording a step graph meanwhile. */
static int grow_slot_locked(staging_slot *sl, uint64_t bytes, rs_error *err) {
    int rc = RS_OK;
    uint64_t cap = (bytes + SLOT_ALIGN - 1) / SLOT_ALIGN * SLOT_ALIGN;
    if (sl->dev) CUDA_TRY(cudaFree(sl->dev));
    sl->dev = NULL;
    if (sl->host) CUDA_TRY(cudaFreeHost(sl->host));
    sl->host = NULL;
    sl->cap = 0;
    CUDA_TRY(cudaMalloc(&sl->dev, cap));
    CUDA_TRY(cudaHostAlloc(&sl->host, cap, cudaHostAllocDefault));
    sl->cap = cap;
    return RS_OK;
fail:
    return rc;
}

static int grow_slot(staging_slot *sl, uint64_t bytes, rs_error *err) {
    rs_backend_cuda_capture_lock();
    const int rc = grow_slot_locked(sl, bytes, err);
    rs_backend_cuda_capture_unlock();
    return rc;
}

extern "C" int rs_nccl_comm_recv_post(rs_nccl_comm *c, int slot, uint64_t bytes, double timeout_s,
                                      rs_error *err) {
    int rc = RS_OK;
    RS_ASSERT(slot == 0 || slot == 1);
    RS_ASSERT(bytes > 0);
    staging_slot *sl = &c->slot[slot];
    RS_ASSERT(!sl->posted);
    if (c->aborted) return rs_error_set(err, RS_EIO, NULL, "the NCCL communicator was aborted");
    double deadline = rs_now_s() + timeout_s;
    CUDA_TRY(cudaSetDevice(c->device));
    if (sl->cap < bytes) {
        staging_slot *other = &c->slot[1 - slot];
        if (other->posted && (rc = wait_slot(c, other, deadline, err)) != RS_OK) goto fail;
        if ((rc = grow_slot(sl, bytes, err)) != RS_OK) goto fail;
    }
    NCCL_TRY(c->comm, ncclBroadcast(sl->dev, sl->dev, (size_t)bytes, ncclUint8, 0, c->comm, c->stream));
    /* On a non-blocking communicator the broadcast may not be enqueued yet (the first one also
     * connects the ranks): the copy must follow it on the stream. */
    if ((rc = wait_comm(c->comm, deadline, NULL, "ncclBroadcast", err)) != RS_OK) goto fail;
    CUDA_TRY(cudaMemcpyAsync(sl->host, sl->dev, (size_t)bytes, cudaMemcpyDeviceToHost, c->stream));
    CUDA_TRY(cudaEventRecord(sl->done, c->stream));
    sl->bytes = bytes;
    sl->posted = true;
    sl->complete = false;
    return RS_OK;
fail:
    abort_comm(c);
    return rc;
}

extern "C" int rs_nccl_comm_recv_wait(rs_nccl_comm *c, int slot, double timeout_s, const void **host,
                                      rs_error *err) {
    int rc = RS_OK;
    RS_ASSERT(slot == 0 || slot == 1);
    staging_slot *sl = &c->slot[slot];
    RS_ASSERT(sl->posted);
    *host = NULL;
    if (c->aborted) return rs_error_set(err, RS_EIO, NULL, "the NCCL communicator was aborted");
    CUDA_TRY(cudaSetDevice(c->device));
    if ((rc = wait_slot(c, sl, rs_now_s() + timeout_s, err)) != RS_OK) goto fail;
    sl->posted = false;
    *host = sl->host;
    return RS_OK;
fail:
    abort_comm(c);
    return rc;
}

extern "C" bool rs_nccl_comm_aborted(const rs_nccl_comm *c) { return c->aborted; }

extern "C" void rs_nccl_comm_free(rs_nccl_comm *c, bool abort, double timeout_s) {
    if (!c) return;
    CUDA_LOG(cudaSetDevice(c->device));
    if (c->comm && !c->aborted && !abort) {
        /* A clean leave: finalize (flushes this rank's work) within the deadline, then destroy. */
        rs_error err = {};
        int rc = RS_OK;
        double deadline = rs_now_s() + timeout_s;
        for (int i = 0; i < 2 && rc == RS_OK; i++)
            if (c->slot[i].posted) rc = wait_slot(c, &c->slot[i], deadline, &err);
        if (rc == RS_OK) {
            ncclResult_t r = ncclCommFinalize(c->comm);
            if (r != ncclSuccess && r != ncclInProgress)
                rc = nccl_fail(&err, c->comm, r, "ncclCommFinalize", __FILE__, __LINE__);
            else
                rc = wait_comm(c->comm, deadline, NULL, "ncclCommFinalize", &err);
        }
        if (rc == RS_OK) {
            ncclResult_t r = ncclCommDestroy(c->comm);
            if (r != ncclSuccess && r != ncclInProgress)
                rs_log(RS_LOG_LEVEL_ERROR, "NCCL error %s in ncclCommDestroy at %s:%d", ncclGetErrorString(r),
                       __FILE__, __LINE__);
            c->comm = NULL;
        } else {
            rs_log(RS_LOG_LEVEL_WARN, "nccl: leaving the group cleanly failed (%s); aborting the communicator",
                   err.message);
        }
    }
    abort_comm(c);
    bool drained = !c->stream || drain_stream(c->stream, DRAIN_TIMEOUT_S);
    if (!drained) {
        /* A kernel may still write into staging: keep it (and the stream) rather than free it. */
        rs_log(RS_LOG_LEVEL_ERROR, "nccl: the staging stream did not drain after the abort; leaking %llu bytes "
               "of staging", (unsigned long long)(c->slot[0].cap + c->slot[1].cap));
        free(c);
        return;
    }
    rs_backend_cuda_capture_lock();
    for (int i = 0; i < 2; i++) {
        staging_slot *sl = &c->slot[i];
        if (sl->dev) CUDA_LOG(cudaFree(sl->dev));
        if (sl->host) CUDA_LOG(cudaFreeHost(sl->host));
        if (sl->done) CUDA_LOG(cudaEventDestroy(sl->done));
    }
    rs_backend_cuda_capture_unlock();
    if (c->stream) CUDA_LOG(cudaStreamDestroy(c->stream));
    free(c);
}
