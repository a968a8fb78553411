/*
 * sync.h — the weight-sync service: one thread that runs weight updates off the HTTP threads.
 *
 * HTTP handlers parse a weight route's body (protocol/weights.h) into an rs_sync_job and submit
 * it; the service thread runs jobs one at a time in arrival order and calls the job's on_done on
 * its own thread (like engine jobs), so libmicrohttpd callbacks never block on a shared-memory
 * copy, a quantization, an NCCL receive or the engine's step boundary.
 *
 * At most one transaction (transaction.h) is open at a time, named by a transaction id that every
 * answer while it is open reports (transaction_id). A bucket (a shm or distributed request) joins
 * the open transaction only when it names it: its transaction_id, when it carries one, is the open
 * transaction's, and its weight_version is the open transaction's (both absent counts as equal:
 * an SGLang-style trainer that sends neither keeps working). Anything else is refused with
 * RS_ESTATE (409) and never joins: a bucket without a version cannot complete another writer's
 * update to version B, a bucket for version C cannot relabel an update opened without one, a
 * transaction_id of a transaction that committed, was dropped or expired matches nothing. The
 * refusal changes nothing, the open transaction included. With nothing open, a bucket without a
 * transaction_id opens a new transaction. Buckets keep streaming
 * while a transaction is open; the one marked is_last (or, with is_last absent, the one that
 * completes the set) commits it. Any other failure of a bucket that joined a transaction drops
 * the transaction whole: the old weights keep serving and the trainer starts again. A transaction
 * that receives nothing for txn_idle_timeout seconds (a trainer that died mid-stream) is dropped
 * too, so it cannot block every later update with 409s.
 *
 * Jobs:
 *   RS_SYNC_SHM            /update_weights_from_shm: map the segment (shm.h), stage, maybe commit
 *   RS_SYNC_DISK           /update_weights_from_disk: one whole transaction from a safetensors dir
 *   RS_SYNC_VERSION        /update_weight_version: relabel (and optionally abort in-flight work)
 *   RS_SYNC_NCCL_INIT, RS_SYNC_NCCL_UPDATE, RS_SYNC_NCCL_DESTROY: run sync/nccl.h's functions on
 *                          this thread; rs_nccl_update stages through the same transaction as the
 *                          shm transport (sync_internal.h).
 *
 * This header is what the rest of the daemon sees. The transports' side of the service (joining
 * and finishing a transaction) is sync_internal.h, and the transaction itself transaction.h: no
 * file outside sync/ includes either.
 *
 * Metrics: rs_sync_get_stats (thread-safe) for /metrics.
 */
#ifndef RS_SYNC_H
#define RS_SYNC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/histogram.h"
#include "../core/rs.h"
#include "../model/model.h"
#include "requests.h"
#include "../scheduler/engine.h"

typedef struct rs_sync rs_sync;

typedef struct rs_sync_opts {
    size_t staging_limit;               /* bytes (weight-staging-mb); 0 = the model's served size */
    bool keep_staging;                  /* weight-staging-keep: recycle replaced weights as the next staging */
    bool keep_shm_maps;                 /* weight-shm-keep: keep segments mapped between requests (shm.h) */
    const char *allowed_weight_dir;     /* copied; NULL or "" = /update_weights_from_disk disabled */
    double txn_idle_timeout;            /* seconds; 0 = an open transaction never expires */
    int threads;                        /* quantization threads; 0 = every online CPU */
} rs_sync_opts;

/* What a job did, for the answer. */
typedef struct rs_sync_result {
    char weight_version[RS_WEIGHT_VERSION_MAX + 1]; /* served after this job */
    uint64_t bytes;                     /* tensor bytes this job delivered (codes + scales as sent) */
    double seconds;                     /* this job's time on the service thread */
    double seconds_paused;              /* how long a commit held the engine's step loop */
    bool committed;                     /* this job switched the served weights */
    char txn_id[RS_WEIGHT_TXN_ID_MAX + 1]; /* the transaction this job joined, "" for none */
    int n_staged, n_required;           /* transaction progress after this job (0/0: none open) */
    char message[256];
} rs_sync_result;

typedef enum rs_sync_kind {
    RS_SYNC_SHM = 0,
    RS_SYNC_DISK,
    RS_SYNC_VERSION,
    RS_SYNC_NCCL_INIT,
    RS_SYNC_NCCL_UPDATE,
    RS_SYNC_NCCL_DESTROY,
} rs_sync_kind;

typedef struct rs_sync_job rs_sync_job;
typedef void (*rs_sync_done_fn)(rs_sync_job *job, void *user);

struct rs_sync_job {
    rs_sync_kind kind;
    union {                             /* the parsed body for `kind`; owned by the submitter */
        rs_shm_update_req shm;
        rs_disk_update_req disk;
        rs_version_update_req version;
        rs_nccl_group_req group;
        rs_nccl_update_req nccl;
        rs_nccl_destroy_req destroy;
    } req;
    rs_sync_done_fn on_done;            /* called once, on the service thread; must not block */
    void *user;
    /* filled by the service before on_done */
    int rc;                             /* RS_OK or the error's code (err holds the message) */
    rs_error err;
    rs_sync_result res;
    rs_sync_job *next;                  /* the service's queue */
};

/* Starts the service thread. Borrows e and m (both must outlive the service). */
int rs_sync_start(rs_sync **out, rs_engine *e, rs_model *m, const rs_sync_opts *opts, rs_error *err);

/* Stops taking jobs, answers every queued job with RS_EBUSY, lets the running one finish, drops an
 * open transaction, joins the thread and frees the service. Call before stopping the engine. */
void rs_sync_stop(rs_sync *s);

/* Thread-safe: queues `job` (the service owns it until on_done). RS_EBUSY once stopping, or when
 * RS_SYNC_MAX_QUEUED jobs already wait; the job is then not queued and on_done is not called. */
#define RS_SYNC_MAX_QUEUED 8
int rs_sync_submit(rs_sync *s, rs_sync_job *job, rs_error *err);

/* Submits and waits for the job (tests, tools): returns job->rc. Must not be called from on_done
 * or from the service thread. */
int rs_sync_run(rs_sync *s, rs_sync_job *job);

/* Counters since start, thread-safe. */
typedef struct rs_sync_stats {
    uint64_t updates;                   /* committed transactions (weight changes) */
    uint64_t updates_failed;            /* transactions dropped: a bad bucket, a missing tensor, idle */
    uint64_t requests;                  /* jobs run */
    uint64_t requests_failed;           /* jobs answered with an error */
    uint64_t bytes;                     /* tensor bytes received over all transports */
    uint64_t tensors;                   /* tensors staged */
    rs_histogram update_seconds;        /* a committed transaction, begin to commit (all buckets) */
    rs_histogram pause_seconds;         /* step loop held by each commit */
    bool txn_open;
    size_t staged_bytes;                /* backend bytes held by the open transaction */
    size_t shm_mapped_bytes;            /* shared memory kept mapped between requests (shm.h) */
    double last_update_seconds;
    uint64_t last_update_bytes;
} rs_sync_stats;
void rs_sync_get_stats(const rs_sync *s, rs_sync_stats *out);

#endif /* RS_SYNC_H */
