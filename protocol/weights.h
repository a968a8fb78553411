/*
 * weights.h — the weight-update routes' bodies: JSON -> the request structs of sync/requests.h,
 * and the answer.
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
 * SGLang compatibility fields that are accepted: abort_all_requests (and AReaL's spelling
 * abort_all_request) on every route that commits: abort in-flight requests before the commit,
 * which return their partial output with finish "abort"; default false, unlike SGLang's
 * /update_weight_version. flush_cache and torch_empty_cache are
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
#include "../sync/requests.h"

/* Parsers: body need not be NUL-terminated. On success *out is filled (free the ones that own
 * memory with the matching _free); on failure *out is left zeroed and nothing is allocated. */
int rs_weights_parse_shm(const char *body, size_t len, rs_shm_update_req *out, rs_error *err);
int rs_weights_parse_disk(const char *body, size_t len, rs_disk_update_req *out, rs_error *err);
int rs_weights_parse_version(const char *body, size_t len, rs_version_update_req *out, rs_error *err);
int rs_weights_parse_nccl_group(const char *body, size_t len, rs_nccl_group_req *out, rs_error *err);
int rs_weights_parse_nccl_update(const char *body, size_t len, rs_nccl_update_req *out, rs_error *err);
int rs_weights_parse_nccl_destroy(const char *body, size_t len, rs_nccl_destroy_req *out, rs_error *err);

/* The bodies' descriptor tables (json_util.h), for the field reference. */
struct rs_jobject;
extern const struct rs_jobject rs_shm_update_fields, rs_disk_update_fields, rs_version_update_fields,
    rs_nccl_group_fields, rs_nccl_update_fields, rs_nccl_destroy_fields;

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
