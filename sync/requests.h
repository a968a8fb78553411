/*
 * requests.h — the weight-update requests, as the sync service runs them.
 *
 *   /update_weights_from_shm          rs_shm_update_req
 *   /update_weights_from_disk         rs_disk_update_req
 *   /update_weight_version            rs_version_update_req
 *   /init_weights_update_group        rs_nccl_group_req
 *   /update_weights_from_distributed  rs_nccl_update_req
 *   /destroy_weights_update_group     rs_nccl_destroy_req
 *
 * sync/ owns these structs: protocol/weights.h fills them from JSON (and guarantees what its
 * header lists for every field), server/ hands them to rs_sync_submit in an rs_sync_job, and the
 * transports read them. Nothing here knows the model: a request may still name a tensor the model
 * lacks (the transaction checks that).
 *
 * weight_version strings are 1..RS_WEIGHT_VERSION_MAX bytes without control characters (they end
 * up in every /generate answer and in logs). is_last is three-valued: absent means "commit as
 * soon as every parameter of the model has been staged", which lets an SGLang-style trainer that
 * streams buckets without an is_last flag work unchanged. transaction_id (shm and distributed
 * buckets) is the id the first bucket's answer gave, tying a bucket to that open transaction
 * (sync.h).
 */
#ifndef RS_SYNC_REQUESTS_H
#define RS_SYNC_REQUESTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../kernels/tensor.h"

#define RS_WEIGHT_NAME_MAX 255          /* bytes of a tensor name */
#define RS_WEIGHT_VERSION_MAX 63        /* bytes of a weight_version (rs_weight_span.version holds 64) */
#define RS_SHM_NAME_MAX 255             /* bytes of a POSIX shm name, its leading '/' included */
#define RS_NCCL_GROUP_NAME_MAX 127
#define RS_NCCL_ADDRESS_MAX 255
#define RS_NCCL_UNIQUE_ID_BYTES 128     /* sizeof(ncclUniqueId) */
#define RS_WEIGHT_MAX_TENSORS (1 << 16) /* per request: its descriptors take up to 20 MiB (a bucket
                                         * of a 671B MoE checkpoint holds a few thousand) */
#define RS_WEIGHT_PATH_MAX 4095
#define RS_WEIGHT_TXN_ID_MAX 63         /* bytes of a transaction_id */

/* One tensor of a manifest. */
typedef struct rs_weight_desc {
    char name[RS_WEIGHT_NAME_MAX + 1];
    rs_dtype dtype;                     /* BF16, F16, F32 or E4M3 */
    int ndim;                           /* 0..RS_TENSOR_MAX_DIMS */
    int64_t shape[RS_TENSOR_MAX_DIMS];
    uint64_t offset;                    /* shm: byte offset in the segment; distributed: byte offset in
                                         * the flattened bucket (the running sum of the nbytes before
                                         * it, no padding, SGLang's FlattenedTensorBucket layout) */
    uint64_t nbytes;                    /* numel * element size */
    bool has_crc32c;                    /* shm: "crc32c", the CRC-32C of the tensor's bytes (0..2^32-1) */
    uint32_t crc32c;
} rs_weight_desc;

typedef enum rs_weight_last {
    RS_WEIGHT_LAST_AUTO = 0,            /* is_last absent: commit once the set is complete */
    RS_WEIGHT_LAST_NO,                  /* is_last: false: more buckets follow */
    RS_WEIGHT_LAST_YES,                 /* is_last: true: commit now (every parameter must be staged) */
} rs_weight_last;

/* {"shm_name": "/rolloutd-w-1", "tensors": [{"name", "dtype", "shape", "offset"[, "crc32c"]}], "is_last": true,
 *  "weight_version": "18", "transaction_id": "...", "abort_all_requests": false, "flush_cache": true}
 * transaction_id (optional, shm and distributed buckets): the id the first bucket's answer gave,
 * tying a bucket to that open transaction (sync.h). */
typedef struct rs_shm_update_req {
    char shm_name[RS_SHM_NAME_MAX + 1]; /* "/" + 1..254 bytes, no other '/', not "/." or "/.." */
    rs_weight_desc *tensors;            /* [n_tensors], owned; NULL when empty */
    int n_tensors;
    rs_weight_last is_last;
    bool has_version;
    char weight_version[RS_WEIGHT_VERSION_MAX + 1];
    bool has_txn_id;
    char txn_id[RS_WEIGHT_TXN_ID_MAX + 1];
    bool abort_all_requests;
} rs_shm_update_req;

/* {"model_path": "/ckpt/step18", "weight_version": "18", "abort_all_requests": false,
 *  "load_format": null | "auto" | "safetensors", "flush_cache": true} */
typedef struct rs_disk_update_req {
    char model_path[RS_WEIGHT_PATH_MAX + 1];
    bool has_version;
    char weight_version[RS_WEIGHT_VERSION_MAX + 1];
    bool abort_all_requests;
} rs_disk_update_req;

/* {"new_version": "18", "abort_all_requests": false} */
typedef struct rs_version_update_req {
    char new_version[RS_WEIGHT_VERSION_MAX + 1];
    bool abort_all_requests;            /* default false */
} rs_version_update_req;

/* {"master_address": "127.0.0.1", "master_port": 29711, "rank_offset": 1, "world_size": 2,
 *  "group_name": "g0", "backend": "nccl", "nccl_unique_id_b64": "..."}
 * group_name defaults to "weight_update_group" and backend to "nccl" (SGLang's defaults).
 * master_port is an integer or a decimal string ("29711", as AReaL sends it). Without
 * nccl_unique_id_b64, master_address:master_port is the trainer's c10d TCPStore (sync/nccl.h). */
typedef struct rs_nccl_group_req {
    char master_address[RS_NCCL_ADDRESS_MAX + 1];  /* non-empty, no control characters */
    int master_port;                    /* 1..65535 */
    int rank_offset;                    /* 0 <= rank_offset < world_size: this server's rank */
    int world_size;                     /* 2..65536 */
    char group_name[RS_NCCL_GROUP_NAME_MAX + 1];
    char backend[16];                   /* "nccl", the only one accepted */
    bool has_unique_id;
    uint8_t unique_id[RS_NCCL_UNIQUE_ID_BYTES]; /* nccl_unique_id_b64 decoded: exactly 128 bytes */
} rs_nccl_group_req;

/* {"names": [..], "dtypes": [..], "shapes": [[..]], "group_name": "g0",
 *  "load_format": "flattened_bucket" | null, "weight_version": "18", "is_last": true,
 *  "abort_all_requests": false, "flush_cache": true}
 * names, dtypes and shapes have the same length (>= 1) and are zipped into tensors[]. */
typedef struct rs_nccl_update_req {
    rs_weight_desc *tensors;            /* [n_tensors], owned; offsets as in a flattened bucket */
    int n_tensors;
    uint64_t total_bytes;               /* sum of tensors[i].nbytes: the flattened bucket's size */
    char group_name[RS_NCCL_GROUP_NAME_MAX + 1];
    bool flattened_bucket;              /* load_format "flattened_bucket": one broadcast of the
                                         * concatenation; else one broadcast per tensor, in order */
    rs_weight_last is_last;
    bool has_version;
    char weight_version[RS_WEIGHT_VERSION_MAX + 1];
    bool has_txn_id;
    char txn_id[RS_WEIGHT_TXN_ID_MAX + 1];
    bool abort_all_requests;
} rs_nccl_update_req;

/* {"group_name": "g0"} (default "weight_update_group") */
typedef struct rs_nccl_destroy_req {
    char group_name[RS_NCCL_GROUP_NAME_MAX + 1];
} rs_nccl_destroy_req;

/* Free the tensors a request owns and leave it zeroed. */
void rs_shm_update_req_free(rs_shm_update_req *r);
void rs_nccl_update_req_free(rs_nccl_update_req *r);

/* A usable POSIX shared-memory name: "/" then 1..RS_SHM_NAME_MAX-1 bytes, no further '/', not
 * "/." or "/..", no control characters. */
bool rs_shm_name_valid(const char *name);

#endif /* RS_SYNC_REQUESTS_H */
