/*
 * transaction.h — one weight update as a transaction: stage, validate, convert, commit.
 *
 * A transaction collects the trainer's tensors for one new weight version, bucket by bucket, and
 * swaps them into the served model all at once at an engine step boundary:
 *
 *   rs_txn_begin    opens it for `version` against the served model;
 *   rs_txn_add      validates one tensor (name -> model slot, dtype, shape; duplicates refused)
 *                      and converts it at once into a new backend allocation in the slot's served
 *                      format (model/weight_store.h: BF16 -> E4M3 + block scales for an FP8 slot, FP8 +
 *                      scale_inv copied, 1-D tensors to F32), so the caller can release its raw
 *                      bucket right away;
 *   rs_txn_commit   checks that every parameter of the model has been staged (a tied lm_head is
 *                      optional), settles the KV scales by the commit policy (transaction.c,
 *                      kv_scales_policy), then swaps the staged tensors in through
 *                      rs_engine_swap_weights and frees the old ones; the transaction ends either way;
 *   rs_txn_abort    drops it.
 *
 * Memory. Staging holds the converted, served-precision tensors of the transaction until commit,
 * never raw BF16 for the whole model: an FP8-served model needs up to about its quantized size on
 * top of the weights it serves (plus, transiently, one matrix in host memory while it is
 * quantized), a BF16-served model up to its BF16 size. A staging limit bounds this: a tensor that
 * would take staging past it is refused with RS_EINVAL (400) instead of running the backend out of
 * memory (verl #4641, vllm #32773). A failed, partial or aborted update frees its staging and
 * leaves the old weights untouched: nothing the model serves changes before the commit, and the
 * commit itself cannot fail once it has started swapping.
 *
 * FP8 pairs. An FP8 slot takes either a BF16/F16/F32 matrix (quantized here exactly as at load)
 * or E4M3 codes plus `<name>_scale_inv`, which may arrive in either order and in different
 * buckets, or together through rs_txn_tensor.scale_inv; the commit refuses a slot that has only
 * one half. A slot that is not FP8 refuses E4M3 data and scale tensors (the served dtype of a
 * slot never changes silently).
 *
 * Threads. A transaction is used by one thread at a time (the sync service thread); the commit's
 * swap runs on the engine thread while that thread waits. Reading the model's slots while staging
 * is safe because only a commit changes them, and the committing thread is the one staging.
 */
#ifndef RS_SYNC_TRANSACTION_H
#define RS_SYNC_TRANSACTION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/pool.h"
#include "../core/rs.h"
#include "../kernels/tensor.h"
#include "../model/model.h"
#include "../scheduler/engine.h"

typedef struct rs_txn rs_txn;

#define RS_TXN_VERSION_BYTES 64      /* a weight_version and its NUL, as rs_weight_span.version */

/* One incoming tensor, host memory (borrowed for the call; need not be aligned). */
typedef struct rs_txn_tensor {
    const char *name;                   /* HF parameter name, or `<matrix>_scale_inv` */
    rs_dtype dtype;                     /* BF16, F16, F32 or E4M3 */
    int ndim;
    const int64_t *shape;               /* [ndim] */
    const void *data;                   /* [numel] of dtype */
    /* optional, E4M3 matrices only: the block scales sent with the codes */
    const void *scale_inv;              /* [ceil(out/128)][ceil(in/128)] of scale_dtype, or NULL */
    rs_dtype scale_dtype;               /* F32 or BF16 */
    /* optional: the CRC-32C data's bytes must have (an shm manifest's "crc32c"); checked in the
     * conversion pass, a mismatch refused like a bad tensor (RS_EFORMAT, 400, naming it) */
    bool has_crc32c;
    uint32_t crc32c;
} rs_txn_tensor;

/* Opens a transaction on `m` (borrowed; it must outlive the transaction). `version` (copied) is
 * the weight_version the commit sets; NULL or "" keeps the version in service. staging_limit is
 * in bytes; 0 means the model's own resident weight size. */
int rs_txn_begin(rs_txn **out, rs_model *m, const char *version, size_t staging_limit, rs_error *err);

/* Stages one tensor. On failure (unknown name, wrong shape or dtype, duplicate, FP8 data for a
 * slot that is not FP8, bad scales, a NaN or infinity anywhere in it, a CRC-32C that does not
 * match, staging limit, backend out of memory) returns the error with
 * err->param naming the tensor; what was staged before stays staged, and the caller decides
 * whether to abort (the sync service always does). */
int rs_txn_add(rs_txn *u, const rs_txn_tensor *t, rs_error *err);

/* True when every parameter of the model (a tied lm_head excepted) is staged, FP8 pairs whole,
 * and the pushed KV scales, if any, cover every layer (k_scale and v_scale). */
bool rs_txn_complete(const rs_txn *u);

/* True when the update carries static FP8 KV scales (`model.layers.N.self_attn.k_scale` /
 * `v_scale`). They are optional; once one is sent, every layer's pair is required at the commit,
 * which hands them to the engine under --kv-scale-mode static (RS_KV_SCALES_STATIC); other scale
 * sources leave them unused. A `*.q_scale` is refused: queries stay fp32. */
bool rs_txn_has_kv_scales(const rs_txn *u);

/* Commits and ends the transaction (u is freed whether or not it succeeds). If a parameter is
 * missing, returns RS_EINVAL naming the first one in the model's order (or an FP8 half-pair) and
 * drops the transaction. Otherwise swaps the staged tensors in through rs_engine_swap_weights
 * (at a step boundary; in-flight sequences are recomputed, not aborted, unless abort_all) and
 * frees the old allocations. `e` NULL swaps directly on the caller's thread (no engine: tests,
 * tools; the caller guarantees no forward pass runs meanwhile). *seconds_paused (may be NULL)
 * receives how long the engine's step loop was held.
 *
 * With a calibration backend (rs_txn_set_calib_backend) and an engine that recalibrates
 * per-head FP8 KV scales after every update (RS_KV_SCALES_CALIBRATE), the calibration runs here, on the caller's thread,
 * over a view of the model holding the staged weights, before the commit: the engine keeps
 * generating with the old weights meanwhile and is held only for the swap. New weights whose
 * K/V come out non-finite on the calibration set are then refused (RS_EINVAL, "kv-cache-dtype")
 * before anything is swapped. */
int rs_txn_commit(rs_txn *u, rs_engine *e, bool abort_all, double *seconds_paused, rs_error *err);

/* True when u stages no parameter, only what may come besides them: a tied lm_head.weight
 * (validated, then ignored) and/or KV scales. A bucket like that after an update committed
 * without is_last is its tail (a trainer sending state_dict() order puts lm_head last, alone in
 * a bucket when it is larger than one): see rs_txn_commit_extras. */
bool rs_txn_only_extras(const rs_txn *u);
/* True unless u holds KV scales for some layers but not yet all of them. */
bool rs_txn_kv_scales_whole(const rs_txn *u);

/* Ends u, which holds only extras (rs_txn_only_extras) for the weights in service: pushed KV
 * scales covering every layer are installed when the engine takes them (static mode), else
 * unused; a tied lm_head is ignored. Nothing else changes (not the version). *kv_installed says
 * whether scales went in. u is freed either way. */
int rs_txn_commit_extras(rs_txn *u, rs_engine *e, bool *kv_installed, rs_error *err);

/* Drops the transaction and frees everything it staged. NULL is a no-op. */
void rs_txn_abort(rs_txn *u);

/* Threads to quantize with (borrowed, used only inside rs_txn_add; NULL = the caller's). */
void rs_txn_set_pool(rs_txn *u, rs_pool *pool);

/* A backend of the caller's own (borrowed; NULL = none) that can read the model's weights, to
 * calibrate KV scales before the commit (above). */
void rs_txn_set_calib_backend(rs_txn *u, rs_backend *b);

/* Names the version the commit sets when the transaction was opened without one. */
void rs_txn_set_version(rs_txn *u, const char *version);

/* Progress, for answers, logs and metrics. */
const char *rs_txn_version(const rs_txn *u);  /* "" when the commit keeps the current one */
int rs_txn_n_staged(const rs_txn *u);         /* parameters staged (an FP8 pair counts once) */
int rs_txn_n_required(const rs_txn *u);       /* parameters the commit needs */
size_t rs_txn_staged_bytes(const rs_txn *u);  /* backend bytes held by staging */
uint64_t rs_txn_received_bytes(const rs_txn *u); /* source bytes of every tensor added */
double rs_txn_started_at(const rs_txn *u);    /* rs_now_s() at begin */

#endif /* RS_SYNC_TRANSACTION_H */
