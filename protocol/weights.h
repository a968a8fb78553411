/*
 * weights.h — the weight-update routes' bodies: JSON -> plain request structs, and the answer.
 *
 *   POST /update_weights_from_shm          rs_shm_update_req
 *   POST /update_weights_from_disk         rs_disk_update_req
 *   POST /update_weight_version            rs_version_update_req
 *   POST /init_weights_update_group        rs_nccl_group_req
 *   POST /update_weights_from_distributed  rs_nccl_update_req
 *   POST /destroy_weights_update_group     rs_nccl_destroy_req
 *
 * Each body is read by a descriptor table (weights.c, json_util.h; docs/api-fields.md lists them)
 * that names every field SGLang's request struct for the route defines. The parsers are strict
 * like /generate's: unknown keys, duplicate keys, wrong JSON types,
 * out-of-range numbers and invalid UTF-8 are RS_EINVAL with err->param naming the field
 * ("tensors[3].shape[1]", "names[7]"); a dtype rolloutd cannot take is RS_EUNSUPPORTED. Nothing
 * here knows the model: a manifest that parses may still name a tensor the model lacks (sync/
 * checks that). What the parser does guarantee for every rs_weight_desc:
 *   - name: 1..RS_WEIGHT_NAME_MAX bytes, no control characters;
 *   - dtype: BF16, F16, F32 or E4M3, from "bfloat16" / "float16" / "float32" / "float8_e4m3fn"
 *     (torch's names, with or without a "torch." prefix) or the safetensors names "BF16", "F16",
 *     "F32", "F8_E4M3";
 *   - shape: 0..RS_TENSOR_MAX_DIMS dims, each >= 0, and nbytes = numel * element size computed
 *     without overflow (and <= 2^62);
 *   - shm: offset + nbytes does not overflow (the segment size is checked when it is opened).
 *
 * weight_version strings are 1..RS_WEIGHT_VERSION_MAX bytes without control characters (they end
 * up in every /generate answer and in logs). is_last is three-valued: absent means "commit as
 * soon as every parameter of the model has been staged", which lets an SGLang-style trainer that
 * streams buckets without an is_last flag work unchanged.
 *
 * SGLang compatibility fields that are accepted: abort_all_requests (and AReaL's spelling
 * abort_all_request) on every route that commits: abort in-flight requests before the commit,
 * which return their partial output with finish "abort"; default false, unlike SGLang's
 * /update_weight_version, see reference/engines.md §4.6. flush_cache and torch_empty_cache are
 * accepted and ignored: every commit drops the prefix cache, since KV computed by the old weights
 * must never be reused. master_port may be an integer or a string of decimal digits (AReaL sends
 * a string).
 */
#ifndef RS_PROTOCOL_WEIGHTS_H
#define RS_PROTOCOL_WEIGHTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/rs.h"
#include "../kernels/tensor.h"

#define RS_WEIGHT_NAME_MAX 255          /* bytes of a tensor name */
#define RS_WEIGHT_VERSION_MAX 63        /* bytes of a weight_version (rs_weight_span.version holds 64) */
#define RS_SHM_NAME_MAX 255             /* bytes of a POSIX shm name, its leading '/' included */
#define RS_NCCL_GROUP_NAME_MAX 127
#define RS_NCCL_ADDRESS_MAX 255
#define RS_NCCL_UNIQUE_ID_BYTES 128     /* sizeof(ncclUniqueId) */
#define RS_WEIGHT_MAX_TENSORS (1 << 20) /* per request */
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

/* Parsers: body need not be NUL-terminated. On success *out is filled (free the ones that own
 * memory with the matching _free); on failure *out is left zeroed and nothing is allocated. */
int rs_shm_update_parse(const char *body, size_t len, rs_shm_update_req *out, rs_error *err);
void rs_shm_update_req_free(rs_shm_update_req *r);
int rs_disk_update_parse(const char *body, size_t len, rs_disk_update_req *out, rs_error *err);
int rs_version_update_parse(const char *body, size_t len, rs_version_update_req *out, rs_error *err);
int rs_nccl_group_parse(const char *body, size_t len, rs_nccl_group_req *out, rs_error *err);
int rs_nccl_update_parse(const char *body, size_t len, rs_nccl_update_req *out, rs_error *err);
void rs_nccl_update_req_free(rs_nccl_update_req *r);
int rs_nccl_destroy_parse(const char *body, size_t len, rs_nccl_destroy_req *out, rs_error *err);

/* The bodies' descriptor tables (json_util.h), for the field reference. */
struct rs_jobject;
extern const struct rs_jobject rs_shm_update_fields, rs_disk_update_fields, rs_version_update_fields,
    rs_nccl_group_fields, rs_nccl_update_fields, rs_nccl_destroy_fields;

/* A usable POSIX shared-memory name: "/" then 1..RS_SHM_NAME_MAX-1 bytes, no further '/', not
 * "/." or "/..", no control characters. */
bool rs_shm_name_valid(const char *name);

/* The dtype names a manifest may use -> rs_dtype; RS_EUNSUPPORTED for other torch / safetensors
 * dtypes, RS_EINVAL for anything else. */
int rs_weight_dtype_parse(const char *s, rs_dtype *out);
const char *rs_weight_dtype_name(rs_dtype dt); /* "bfloat16", "float16", "float32", "float8_e4m3fn" */

/* A success answer: {"success": true, "message": "...", "weight_version": "18", "bytes": N,
 * "seconds": S, "committed": bool[, "transaction_id": "..."]}. `committed` says whether this request
 * switched the served weights (false for a bucket that only staged tensors, and for the NCCL group
 * routes); transaction_id (NULL or "": left out) names the transaction the bucket joined.
 * Returns a new malloc'd NUL-terminated body (the caller frees it) and its length, or NULL when
 * memory is exhausted. */
char *rs_weights_response(const char *message, const char *weight_version, uint64_t bytes, double seconds,
                          bool committed, const char *transaction_id, size_t *len);

#endif /* RS_PROTOCOL_WEIGHTS_H */
