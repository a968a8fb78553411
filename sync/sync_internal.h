/*
 * sync_internal.h — the service's side for its transports (shm.c, disk.c, nccl.c), which run on
 * the service thread (sync.h): joining the open transaction, finishing a job's part in it, and the
 * service state they share. Private to sync/.
 *
 * A weight push, read top to bottom: sync.h (the service and its jobs) -> sync.c (the thread, the
 * transaction rules, the commit policy) -> shm.c / disk.c / nccl.c (one transport each) ->
 * transaction.c (staging tensors into a complete set) -> model/weight_store.c (the slots the
 * staged set swaps into) and the engine's swap at a step boundary.
 */
#ifndef RS_SYNC_INTERNAL_H
#define RS_SYNC_INTERNAL_H

#include "sync.h"
#include "transaction.h"

/* ---- for transports running on the service thread (shm.c, disk.c, nccl.c) ---- */

/* The open transaction named by `version` and `txn_id` (NULL = the request named none), opened if
 * none is and txn_id is NULL; RS_ESTATE (409) when they do not name the open one (the rule above):
 * nothing changes then. Once this returns RS_OK the job has joined the transaction (res->txn_id,
 * filled by rs_sync_txn_finish, names it), and if the job then fails, the service drops it.
 * rs_sync_txn is rs_sync_txn_join without a transaction id (disk updates). */
int rs_sync_txn_join(rs_sync *s, const char *version, const char *txn_id, rs_txn **out, rs_error *err);
int rs_sync_txn(rs_sync *s, const char *version, rs_txn **out, rs_error *err);

/* Ends the job's part in the transaction: commits when `last` is YES, or AUTO and the set is
 * complete (abort_all: abort in-flight requests first); fills res (version, progress, committed,
 * seconds_paused, message). A commit that finds tensors missing fails with RS_EINVAL naming the
 * first. */
int rs_sync_txn_finish(rs_sync *s, rs_weight_last last, bool abort_all, rs_sync_result *res, rs_error *err);

rs_model *rs_sync_model(rs_sync *s);
rs_engine *rs_sync_engine(rs_sync *s);
rs_txn *rs_sync_open_txn(rs_sync *s);            /* the open transaction, or NULL */
struct rs_shm_maps *rs_sync_shm_maps(rs_sync *s);   /* kept shm mappings, or NULL (weight-shm-keep off) */
const char *rs_sync_allowed_dir(const rs_sync *s);  /* realpath of allowed-weight-dir, "" = disabled */
/* A pointer slot for sync/nccl.c's own state (groups, communicators): NULL at start; nccl.c owns
 * what it stores there; rs_sync_stop calls rs_nccl_release after the thread has stopped. */
void **rs_sync_nccl_state(rs_sync *s);

#endif /* RS_SYNC_INTERNAL_H */
