/*
 * nccl.h — weight updates broadcast over NCCL from the trainer (SGLang's
 * /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group).
 *
 * The group. The trainer is rank 0 and the broadcast root; this server joins as rank
 * `rank_offset` of `world_size` (SGLang's convention, reference/engines.md §2.1). Two rendezvous:
 *   - SGLang's (no nccl_unique_id_b64): master_address:master_port is the trainer's c10d TCPStore,
 *     as SGLang's init_custom_process_group(init_method="tcp://...") uses it (sync/tcpstore.h has
 *     the key sequence and the torch versions verified). The init request connects as rank
 *     rank_offset and adds itself to the store's "init/" count, which the trainer's
 *     init_process_group waits for, and answers. The communicator is created by a thread of the
 *     group (nccl.c "the store watcher") as soon as rank 0 publishes its ncclUniqueId in the store,
 *     under the key of the trainer's NCCL backend: torch's nccl2 (the default "nccl" from torch
 *     2.15) creates its communicator in init_process_group and waits there for this server;
 *     ProcessGroupNCCL publishes the id at the first collective (dist.broadcast) unless the group
 *     was made with device_id. The first update request waits for that join, up to
 *     init_timeout_s. The store connection is kept until the group is destroyed.
 *   - rolloutd's own: the trainer's ncclUniqueId, created with ncclGetUniqueId and sent base64-
 *     encoded as `nccl_unique_id_b64` (clients/python/rolloutd_client/nccl.py does this); the init
 *     request joins at once (master_address and master_port are then unused), so the trainer
 *     posts it and calls ncclCommInitRank(rank 0) at the same time.
 * Every store operation of the init request, and the wait for the id, are bounded by
 * init_timeout_s (--weight-update-timeout): an unreachable store, one that stalls, closes, or
 * answers garbage fails the request (RS_EBUSY, 503, for a timeout, naming the key waited for;
 * RS_EIO, 500, for a closed or malformed stream; RS_EINVAL, 400, for a master_address that does
 * not resolve) and leaves no group behind.
 *
 * Joining never blocks forever: the communicator is created non-blocking and polled until it is
 * ready, fails, or `init_timeout_s` passes; then it is aborted and the request fails (RS_EBUSY, 503,
 * for a timeout; RS_EIO, 500, for an NCCL error such as a version mismatch with the trainer's NCCL,
 * which must be the same release as the one rolloutd links). A failure to join at the first update
 * aborts the group like any transport failure (below).
 *
 * An update. Each request names its tensors (names, dtypes, shapes, in order). The trainer then
 * broadcasts either one buffer per tensor, in that order (load_format null, SGLang's default), or
 * one buffer holding every tensor of the request concatenated in order without padding
 * (load_format "flattened_bucket", SGLang's FlattenedTensorBucket layout). This server receives
 * every broadcast as ncclUint8 with count = the buffer's bytes, whatever the tensors' dtypes;
 * rolloutd_client sends the same, and a torch trainer's dist.broadcast of a tensor of N elements
 * of S bytes meets it because NCCL carries a broadcast as N * S bytes whatever its datatype. A
 * tensor or bucket of 0 bytes is not broadcast at all. This server receives each broadcast into a device
 * staging buffer on its own stream, copies it to pinned host memory, and hands the tensors to the
 * weight-update transaction (transaction.h: rs_txn_add validates the name, dtype and shape
 * against the model and converts to the served precision). Receiving the next buffer overlaps
 * converting the current one (two staging slots).
 *
 * Commit. The transaction spans requests the way shm buckets do (sync.h): a request with is_last
 * true commits; with is_last absent (SGLang sends none) the request that completes the set of the
 * model's parameters commits, so a trainer that sends every parameter, in one request or in many
 * buckets, needs no extra field; is_last false only stages.
 *
 * Failures. A request refused for its contents — an unknown name, a wrong shape or dtype, a
 * version that conflicts with the open transaction (409) — is still received in full and
 * discarded, so the group stays in step with the trainer and can take the next update; the
 * transaction it joined is dropped (the old weights keep serving). A transport failure (an NCCL
 * error, the peer gone, no progress within `op_timeout_s`) or a buffer over `max_buffer_bytes`
 * (which cannot be received without matching the trainer's broadcast) aborts the group instead:
 * the answer says so, and the trainer must init a new one. The daemon never exits on any of these.
 *
 * Threads. The three entry points run on the sync service thread (sync.h), one job at a time, and
 * are the only users of the group state they keep in rs_sync_nccl_state(s), but for a store group's
 * watcher thread, which owns the store connection until the first update (or the group's end)
 * joins it.
 *
 * The CPU build (no RS_CUDA) has no NCCL: the entry points answer RS_EUNSUPPORTED (400) with
 * RS_NCCL_UNSUPPORTED_MESSAGE, and that is all they do there.
 */
#ifndef RS_SYNC_NCCL_H
#define RS_SYNC_NCCL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/rs.h"

/* Declared in sync.h and protocol/weights.h; repeated here so that this header stays free of the
 * model and engine headers (sync/nccl_staging.cu includes it). */
typedef struct rs_sync rs_sync;
typedef struct rs_sync_result rs_sync_result;
typedef struct rs_nccl_group_req rs_nccl_group_req;
typedef struct rs_nccl_update_req rs_nccl_update_req;

#define RS_NCCL_UNSUPPORTED_MESSAGE "NCCL weight updates need the CUDA build (make CUDA=1)"
#define RS_NCCL_MAX_GROUPS 4            /* groups joined at once */

typedef struct rs_nccl_opts {
    int device;                         /* CUDA device (of those visible) the groups use; default 0 */
    double init_timeout_s;              /* joining a group: the store, the id, the communicator
                                         * (--weight-update-timeout); default 300 */
    double op_timeout_s;                /* one broadcast, or finalizing a group; default 300 */
    uint64_t max_buffer_bytes;          /* largest tensor or flattened bucket; default 8 GiB */
} rs_nccl_opts;

void rs_nccl_opts_default(rs_nccl_opts *o);
/* Sets the options every later call uses (process-wide). Call before the sync service starts, or
 * from its thread. Values out of range (device < 0, timeouts <= 0, max_buffer_bytes 0) keep the
 * default. */
void rs_nccl_set_opts(const rs_nccl_opts *o);
void rs_nccl_get_opts(rs_nccl_opts *o);

/* ---- the routes (sync service thread) ---- */

/* Joins group r->group_name as rank r->rank_offset (through the trainer's store without a unique
 * id). RS_EINVAL: bad request (rank_offset 0, ...); RS_ESTATE: a group of that name exists, or
 * RS_NCCL_MAX_GROUPS do; RS_EUNSUPPORTED: CPU build, or no CUDA device visible; RS_EBUSY: the
 * trainer (or its store) did not answer within init_timeout_s; RS_EIO: NCCL, CUDA or the store
 * connection failed; RS_ENOMEM: no memory for the group. */
int rs_nccl_init_group(rs_sync *s, const rs_nccl_group_req *r, rs_error *err);

/* Receives one request's broadcasts and stages them (see "An update" above); res as for shm. */
int rs_nccl_update(rs_sync *s, const rs_nccl_update_req *r, rs_sync_result *res, rs_error *err);

/* Leaves the group: finalizes and destroys the communicator (aborts it if finalizing does not end
 * within op_timeout_s) and frees its staging. RS_EINVAL for an unknown group. */
int rs_nccl_destroy_group(rs_sync *s, const char *group_name, rs_error *err);

/* Aborts every group and frees the state in rs_sync_nccl_state(s): for rs_sync_stop, after the
 * service thread has stopped. No-op when no group exists (and in the CPU build). */
void rs_nccl_release(rs_sync *s);

/* ---- pure checks (both builds; tested without a GPU) ---- */

/* The group request as this server can take it: backend "nccl", world_size >= 2,
 * 1 <= rank_offset < world_size (rank 0 is the trainer), group_name non-empty, a unique id (when
 * given) not all zeros. */
int rs_nccl_check_group_req(const rs_nccl_group_req *r, rs_error *err);

/* The update request's broadcast plan: n_tensors >= 1, offsets the running sum of nbytes,
 * total_bytes their sum, and every broadcast buffer (each tensor, or the whole bucket) at most
 * max_buffer_bytes. RS_EINVAL naming the tensor (or "names") otherwise. */
int rs_nccl_check_update_req(const rs_nccl_update_req *r, uint64_t max_buffer_bytes, rs_error *err);

/* Broadcast buffers of the request, in order: each tensor, or one bucket. Buffer i covers tensors
 * [*first, *first + *count) and *bytes bytes (0: nothing is broadcast for it). */
int rs_nccl_n_buffers(const rs_nccl_update_req *r);
void rs_nccl_buffer(const rs_nccl_update_req *r, int i, int *first, int *count, uint64_t *bytes);

/* ---- transport (sync/nccl_staging.cu; defined in a CUDA=1 build only, declared in every build,
 * as kernels/backend.h says why) ----
 * A communicator with its stream and two pinned staging slots. Every call checks every CUDA and
 * NCCL status and returns an error instead of aborting the process; after any failure of
 * recv_post / recv_wait the communicator has been aborted and only rs_nccl_comm_free remains. */
typedef struct rs_nccl_comm rs_nccl_comm;

int rs_nccl_cuda_device_count(void);    /* 0 when none is visible or the driver is missing */
int rs_nccl_version(void);              /* NCCL_VERSION_CODE of the linked library, e.g. 22809 */
/* A fresh ncclUniqueId (tests: the trainer's side of the handshake). */
int rs_nccl_new_unique_id(uint8_t id[128], rs_error *err);

/* Joins the communicator of `id` as `rank`, waiting up to timeout_s for the other ranks, or until
 * *cancel (may be NULL; read atomically while waiting) is set: RS_EBUSY for either. */
int rs_nccl_comm_init(rs_nccl_comm **out, const uint8_t id[128], int world_size, int rank, int device,
                      double timeout_s, const volatile int *cancel, rs_error *err);
/* Posts the receive of a broadcast from rank 0 of `bytes` bytes (> 0) into staging slot `slot`
 * (0 or 1), followed by its copy to the slot's pinned host buffer. The slot's previous contents
 * must no longer be needed. */
int rs_nccl_comm_recv_post(rs_nccl_comm *c, int slot, uint64_t bytes, double timeout_s, rs_error *err);
/* Waits for slot's receive and host copy; *host (borrowed, valid until the slot is posted again)
 * holds the bytes. */
int rs_nccl_comm_recv_wait(rs_nccl_comm *c, int slot, double timeout_s, const void **host, rs_error *err);
bool rs_nccl_comm_aborted(const rs_nccl_comm *c);
/* Finalizes (bounded by timeout_s, then aborts) or, when abort is true or the communicator
 * already failed, aborts; then frees the stream and staging. NULL is a no-op. */
void rs_nccl_comm_free(rs_nccl_comm *c, bool abort, double timeout_s);

#endif /* RS_SYNC_NCCL_H */
