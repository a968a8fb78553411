/*
 * weights.c — parsers for the weight-update routes and their answer (see weights.h).
 *
 * Each route's body is read by a descriptor table (json_util.h) listing every field of SGLang's
 * request struct for it (python/sglang/srt/managers/io_struct.py at 001067ff:
 * UpdateWeightFromDiskReqInput, UpdateWeightsFromDistributedReqInput,
 * InitWeightsUpdateGroupReqInput, DestroyWeightsUpdateGroupReqInput, UpdateWeightVersionReqInput,
 * and BaseReq's rid / http_worker_ipc), rolloutd's own fields (the shm route, is_last,
 * nccl_unique_id_b64) and AReaL's spelling abort_all_request. An unknown key is reported by name
 * (a misspelt "is_lats" must not turn a last bucket into a silent non-commit), and fields are
 * checked in table order, so the error a bad body gets does not depend on the order of its keys.
 * JSON null for an optional field means "absent", as SGLang treats it. Everything a request
 * allocates is bounded by its body size, which the server caps before calling in, and by
 * RS_WEIGHT_MAX_TENSORS: a tensor's descriptor (320 bytes, its name buffer included) costs up to 80
 * times the 4 body bytes of a one-letter name in a list, so the cap keeps a request's descriptors,
 * which a queued update holds until it runs, within 20 MiB, below what the JSON parser itself
 * spends on a body of the default max-body-bytes.
 */
#include "weights.h"
#include "json_util.h"
#include "../core/base64.h"

#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- dtypes, shapes, names */

int rs_weight_dtype_parse(const char *s, rs_dtype *out) {
    static const struct { const char *name; rs_dtype dt; } ok[] = {
        {"bfloat16", RS_DTYPE_BF16}, {"float16", RS_DTYPE_F16}, {"float32", RS_DTYPE_F32},
        {"float8_e4m3fn", RS_DTYPE_E4M3}, {"BF16", RS_DTYPE_BF16}, {"F16", RS_DTYPE_F16},
        {"F32", RS_DTYPE_F32}, {"F8_E4M3", RS_DTYPE_E4M3}, {"half", RS_DTYPE_F16}, {"float", RS_DTYPE_F32},
    };
    static const char *const known[] = {
        "float64", "double", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "int8", "uint8",
        "int16", "int32", "int64", "bool", "complex64", "F64", "F8_E5M2", "I8", "U8", "I16", "I32", "I64", "BOOL",
    };
    if (strncmp(s, "torch.", 6) == 0) s += 6;
    for (size_t i = 0; i < RS_ARRAY_LEN(ok); i++)
        if (strcmp(s, ok[i].name) == 0) return *out = ok[i].dt, RS_OK;
    for (size_t i = 0; i < RS_ARRAY_LEN(known); i++)
        if (strcmp(s, known[i]) == 0) return RS_EUNSUPPORTED;
    return RS_EINVAL;
}

const char *rs_weight_dtype_name(rs_dtype dt) {
    switch (dt) {
    case RS_DTYPE_BF16: return "bfloat16";
    case RS_DTYPE_F16: return "float16";
    case RS_DTYPE_F32: return "float32";
    case RS_DTYPE_E4M3: return "float8_e4m3fn";
    default: return rs_dtype_name(dt);
    }
}

static int get_dtype(const json_t *v, const char *param, rs_dtype *out, rs_error *err) {
    if (!json_is_string(v)) return rs_json_bad_type(err, param, "a dtype string such as \"bfloat16\"", v);
    const char *s = json_string_value(v);
    int rc = json_string_length(v) < 64 ? rs_weight_dtype_parse(s, out) : RS_EINVAL;
    if (rc == RS_EUNSUPPORTED)
        return rs_error_set(err, RS_EUNSUPPORTED, param,
                            "%s '%s' is not supported: weights are bfloat16, float16, float32 or float8_e4m3fn "
                            "(with float32/bfloat16 scale_inv)", param, s);
    if (rc != RS_OK)
        return rs_error_set(err, RS_EINVAL, param,
                            "%s must be one of bfloat16, float16, float32, float8_e4m3fn (or BF16, F16, F32, "
                            "F8_E4M3), got '%.64s'", param, s);
    return RS_OK;
}

#define RS_WEIGHT_MAX_BYTES (1ull << 62)

/* shape -> desc->ndim/shape/nbytes, overflow-checked against the dtype's element size. */
static int get_shape(const json_t *v, const char *param, rs_weight_desc *d, rs_error *err) {
    if (!json_is_array(v)) return rs_json_bad_type(err, param, "a list of dimensions", v);
    size_t nd = json_array_size(v);
    if (nd > RS_TENSOR_MAX_DIMS)
        return rs_error_set(err, RS_EINVAL, param, "%s has %zu dimensions, at most %d are supported", param, nd,
                            RS_TENSOR_MAX_DIMS);
    uint64_t bytes = rs_dtype_size(d->dtype);
    for (size_t i = 0; i < nd; i++) {
        char p[300];
        snprintf(p, sizeof p, "%s[%zu]", param, i);
        long long x;
        int rc = rs_json_get_int(json_array_get(v, i), p, 0, (long long)RS_WEIGHT_MAX_BYTES, &x, err);
        if (rc != RS_OK) return rc;
        if (x > 0 && bytes > RS_WEIGHT_MAX_BYTES / (uint64_t)x)
            return rs_error_set(err, RS_EINVAL, param, "%s describes more than 2^62 bytes", param);
        bytes *= (uint64_t)x;
        d->shape[i] = x;
    }
    d->ndim = (int)nd;
    d->nbytes = bytes;
    return RS_OK;
}

/* ---------------------------------------------------------------- readers shared by the routes */

static int read_last(const rs_jctx *c, const json_t *v, rs_error *err) {
    bool b = false;
    int rc = rs_json_get_bool(v, c->param, &b, err);
    if (rc == RS_OK) *(rs_weight_last *)rs_json_dst(c) = b ? RS_WEIGHT_LAST_YES : RS_WEIGHT_LAST_NO;
    return rc;
}

static int read_name(const rs_jctx *c, const json_t *v, rs_error *err) {
    int rc = rs_json_check_name(v, c->param, RS_WEIGHT_NAME_MAX, err);
    if (rc == RS_OK) snprintf(rs_json_dst(c), RS_WEIGHT_NAME_MAX + 1, "%s", json_string_value(v));
    return rc;
}

static int read_dtype(const rs_jctx *c, const json_t *v, rs_error *err) {
    return get_dtype(v, c->param, rs_json_dst(c), err);
}

static int read_shape(const rs_jctx *c, const json_t *v, rs_error *err) {
    return get_shape(v, c->param, c->dst[0], err);
}

#define DST(T, field) .offset = offsetof(T, field), .size = sizeof(((T *)0)->field)

/* Rows every committing route has: SGLang's abort_all_requests and AReaL's abort_all_request
 * for it, flush_cache, torch_empty_cache, and BaseReq's fields. */
#define COMMIT_FIELDS(T)                                                                                       \
    {.name = "abort_all_requests", .type = RS_JT_BOOL, DST(T, abort_all_requests), .def = "false",           \
     .doc = "abort in-flight requests before the commit; they return their partial output with finish "      \
            "\"abort\" (SGLang defaults to true on /update_weight_version; rolloutd never aborts unless asked)"}, \
    {.name = "abort_all_request", .type = RS_JT_BOOL, DST(T, abort_all_requests),                             \
     .doc = "the same as abort_all_requests (AReaL's spelling)"},                                             \
    {.name = "flush_cache", .type = RS_JT_BOOL, .use = RS_JU_NO_EFFECT, .def = "true",                         \
     .doc = "every commit drops the prefix cache: KV of old weights is never reused"},                       \
    {.name = "torch_empty_cache", .type = RS_JT_BOOL, .use = RS_JU_NO_EFFECT, .doc = "there is no torch allocator"}, \
    {.name = "rid", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT, .doc = "SGLang's request id of the update; not used"}, \
    {.name = "http_worker_ipc", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "SGLang's internal IPC"}

#define VERSION_FIELD(T)                                                                                        \
    {.name = "weight_version", .type = RS_JT_STRING, DST(T, weight_version),                                  \
     .doc = "the version the new weights report (1..63 bytes); default: keep the current label"}

#define TXN_FIELD(T)                                                                                            \
    {.name = "transaction_id", .type = RS_JT_STRING, DST(T, txn_id),                                           \
     .doc = "rolloutd's: the id the first bucket's answer gave; a bucket naming another open update gets 409"}

static int read_body(const char *body, size_t len, const rs_jobject *t, void *dst, rs_error *err) {
    json_t *root;
    int rc = rs_json_load_object(body, len, false, &root, err);
    if (rc != RS_OK) return rc;
    void *const dsts[] = {dst};
    rc = rs_json_read(root, t, dsts, "", err);
    json_decref(root);
    return rc;
}

/* ---------------------------------------------------------------- /update_weights_from_shm */

static int read_shm_name(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_shm_update_req *r = c->dst[0];
    int rc = rs_json_check_name(v, c->param, RS_SHM_NAME_MAX, err);
    if (rc != RS_OK) return rc;
    snprintf(r->shm_name, sizeof r->shm_name, "%s", json_string_value(v));
    if (!rs_shm_name_valid(r->shm_name))
        return rs_error_set(err, RS_EINVAL, c->param,
                            "shm_name must be a POSIX shared-memory name: '/' followed by a name without '/', got '%s'",
                            r->shm_name);
    return RS_OK;
}

static int read_shm_offset(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_weight_desc *d = c->dst[0];
    long long off;
    int rc = rs_json_get_int(v, c->param, 0, (long long)RS_WEIGHT_MAX_BYTES, &off, err);
    if (rc != RS_OK) return rc;
    d->offset = (uint64_t)off;
    if (d->offset + d->nbytes > RS_WEIGHT_MAX_BYTES) /* both <= 2^62: the sum cannot wrap */
        return rs_error_set(err, RS_EINVAL, c->param, "%s + the tensor's %llu bytes goes past 2^62", c->param,
                            (unsigned long long)d->nbytes);
    return RS_OK;
}

static int read_crc32c(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_weight_desc *d = c->dst[0];
    long long x;
    int rc = rs_json_get_int(v, c->param, 0, 0xffffffffll, &x, err);
    if (rc != RS_OK) return rc;
    d->has_crc32c = true;
    d->crc32c = (uint32_t)x;
    return RS_OK;
}

static const rs_jfield shm_tensor_fields[] = {
    {.name = "name", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, DST(rs_weight_desc, name), .read = read_name,
     .shape = "string (1..255 bytes)", .doc = "the parameter's name in the checkpoint",
     .schema = "{'type': 'string', 'minLength': 1, 'maxLength': 255, 'pattern': '$name'}"},
    {.name = "dtype", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, DST(rs_weight_desc, dtype), .read = read_dtype,
     .shape = "string", .doc = "bfloat16, float16, float32 or float8_e4m3fn (torch's or safetensors' names)",
     .schema = "{'type': 'string'}"},
    {.name = "shape", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_shape,
     .shape = "list of integers >= 0", .doc = "at most 4 dimensions",
     .schema = "{'type': 'array', 'maxItems': 4, 'items': {'type': 'integer', 'minimum': 0, "
               "'maximum': 4611686018427387904}}"},
    {.name = "offset", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_shm_offset,
     .shape = "integer >= 0", .doc = "byte offset of the tensor in the segment",
     .schema = "{'type': 'integer', 'minimum': 0, 'maximum': 4611686018427387904}"},
    {.name = "crc32c", .type = RS_JT_CUSTOM, .read = read_crc32c, .shape = "integer 0..2^32-1",
     .doc = "rolloutd's: the CRC-32C of the tensor's bytes as written, checked as they are read (400 on a "
            "mismatch); the Python client sends it",
     .schema = "{'type': 'integer', 'minimum': 0, 'maximum': 4294967295}"},
};

static const rs_jobject shm_tensor_object = {.title = "POST /update_weights_from_shm: tensors[i]",
                                             .fields = shm_tensor_fields, .n = RS_ARRAY_LEN(shm_tensor_fields)};

static int get_tensor_list(const json_t *v, const char *param, rs_weight_desc **out, int *n_out, rs_error *err) {
    if (!json_is_array(v)) return rs_json_bad_type(err, param, "a list", v);
    size_t n = json_array_size(v);
    if (n > RS_WEIGHT_MAX_TENSORS)
        return rs_error_set(err, RS_EINVAL, param, "%s has %zu entries, at most %d per request", param, n,
                            RS_WEIGHT_MAX_TENSORS);
    *out = n ? rs_xcalloc(n, sizeof **out) : NULL;
    *n_out = (int)n;
    return RS_OK;
}

static int read_shm_tensors(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_shm_update_req *r = c->dst[0];
    int rc = get_tensor_list(v, c->param, &r->tensors, &r->n_tensors, err);
    for (int i = 0; rc == RS_OK && i < r->n_tensors; i++) {
        char prefix[48];
        snprintf(prefix, sizeof prefix, "%s[%d]", c->param, i);
        void *const dst[] = {&r->tensors[i]};
        rc = rs_json_read(json_array_get(v, (size_t)i), &shm_tensor_object, dst, prefix, err);
    }
    return rc;
}

static const rs_jfield shm_fields[] = {
    {.name = "shm_name", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_shm_name,
     .shape = "string", .doc = "the POSIX shared-memory segment: '/' and a name without '/'",
     .schema = "{'type': 'string', 'minLength': 1, 'maxLength': 255, 'pattern': '$name'}"},
    {.name = "tensors", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_shm_tensors,
     .shape = "list of objects", .sub = &shm_tensor_object, .doc = "the bucket's tensors; see below",
     .schema = "{'type': 'array', 'items': '$sub'}"},
    {.name = "is_last", .type = RS_JT_CUSTOM, DST(rs_shm_update_req, is_last), .read = read_last, .shape = "boolean",
     .doc = "true: commit now; false: more buckets follow; absent: commit once every parameter is staged",
     .schema = "{'type': 'boolean'}"},
    VERSION_FIELD(rs_shm_update_req),
    TXN_FIELD(rs_shm_update_req),
    COMMIT_FIELDS(rs_shm_update_req),
};

const rs_jobject rs_shm_update_fields = {
    .title = "POST /update_weights_from_shm", .fields = shm_fields, .n = RS_ARRAY_LEN(shm_fields)};

int rs_weights_parse_shm(const char *body, size_t len, rs_shm_update_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    rs_shm_update_req r = {0};
    int rc = read_body(body, len, &rs_shm_update_fields, &r, err);
    if (rc != RS_OK) {
        free(r.tensors);
        return rc;
    }
    r.has_version = r.weight_version[0] != '\0';
    r.has_txn_id = r.txn_id[0] != '\0';
    *out = r;
    return RS_OK;
}

/* ---------------------------------------------------------------- /update_weights_from_disk */

static int read_model_path(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_disk_update_req *r = c->dst[0];
    int rc = rs_json_check_name(v, c->param, RS_WEIGHT_PATH_MAX, err);
    if (rc != RS_OK) return rc;
    snprintf(r->model_path, sizeof r->model_path, "%s", json_string_value(v));
    if (r->model_path[0] != '/')
        return rs_error_set(err, RS_EINVAL, c->param, "model_path must be an absolute path, got '%.200s'",
                            r->model_path);
    return RS_OK;
}

static int read_disk_load_format(const rs_jctx *c, const json_t *v, rs_error *err) {
    if (!json_is_string(v)) return rs_json_bad_type(err, c->param, "null, \"auto\" or \"safetensors\"", v);
    if (strcmp(json_string_value(v), "auto") == 0 || strcmp(json_string_value(v), "safetensors") == 0) return RS_OK;
    return rs_error_set(err, RS_EUNSUPPORTED, c->param, "load_format '%.64s' is not supported: only safetensors "
                        "directories (null, \"auto\" or \"safetensors\")", json_string_value(v));
}

static const rs_jfield disk_fields[] = {
    {.name = "model_path", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_model_path,
     .shape = "string", .doc = "an absolute path below --allowed-weight-dir",
     .schema = "{'type': 'string', 'minLength': 1, 'maxLength': 4095, 'pattern': '$name'}"},
    VERSION_FIELD(rs_disk_update_req),
    {.name = "load_format", .type = RS_JT_CUSTOM, .read = read_disk_load_format,
     .shape = "`\"auto\"` \\| `\"safetensors\"`", .doc = "safetensors directories only",
     .schema = "{'enum': ['auto', 'safetensors']}"},
    COMMIT_FIELDS(rs_disk_update_req),
    {.name = "recapture_cuda_graph", .type = RS_JT_BOOL, .use = RS_JU_NO_EFFECT, .doc = "there are no CUDA graphs"},
    {.name = "is_async", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "asynchronous loading; the request returns once committed"},
    {.name = "keep_pause", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "the update does not pause generation"},
    {.name = "token_step", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "per-token trainer steps; weight_version labels the tokens"},
    {.name = "manifest", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "tensor manifests for disk loads"},
};

const rs_jobject rs_disk_update_fields = {
    .title = "POST /update_weights_from_disk", .fields = disk_fields, .n = RS_ARRAY_LEN(disk_fields)};

int rs_weights_parse_disk(const char *body, size_t len, rs_disk_update_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    rs_disk_update_req *r = rs_xcalloc(1, sizeof *r);
    int rc = read_body(body, len, &rs_disk_update_fields, r, err);
    if (rc == RS_OK) {
        r->has_version = r->weight_version[0] != '\0';
        *out = *r;
    }
    free(r);
    return rc;
}

/* ---------------------------------------------------------------- /update_weight_version */

static const rs_jfield version_fields[] = {
    {.name = "new_version", .type = RS_JT_STRING, .flags = RS_JF_REQUIRED, DST(rs_version_update_req, new_version),
     .doc = "the label later tokens report (1..63 bytes)"},
    {.name = "abort_all_requests", .type = RS_JT_BOOL, DST(rs_version_update_req, abort_all_requests),
     .def = "false", .doc = "abort in-flight requests first (SGLang defaults to true; rolloutd never aborts unless "
                            "asked); they return their partial output with finish \"abort\""},
    {.name = "abort_all_request", .type = RS_JT_BOOL, DST(rs_version_update_req, abort_all_requests),
     .doc = "the same as abort_all_requests (AReaL's spelling)"},
    {.name = "rid", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT, .doc = "SGLang's request id of the update; not used"},
    {.name = "http_worker_ipc", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "SGLang's internal IPC"},
};

const rs_jobject rs_version_update_fields = {
    .title = "POST /update_weight_version", .fields = version_fields, .n = RS_ARRAY_LEN(version_fields)};

int rs_weights_parse_version(const char *body, size_t len, rs_version_update_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    rs_version_update_req r = {0};
    int rc = read_body(body, len, &rs_version_update_fields, &r, err);
    if (rc == RS_OK) *out = r;
    return rc;
}

/* ---------------------------------------------------------------- NCCL routes */

#define GROUP_DEFAULT "weight_update_group" /* SGLang's default group_name */

#define GROUP_FIELD(T)                                                                                          \
    {.name = "group_name", .type = RS_JT_STRING, DST(T, group_name), .def = "\"" GROUP_DEFAULT "\"",          \
     .doc = "the group (1..127 bytes)"}

/* An integer or a string of decimal digits (AReaL sends master_port as a string), 1..65535. */
static int read_master_port(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_nccl_group_req *r = c->dst[0];
    if (rs_json_is_int(v)) {
        long long x;
        int rc = rs_json_get_int(v, c->param, 1, 65535, &x, err);
        if (rc == RS_OK) r->master_port = (int)x;
        return rc;
    }
    if (!json_is_string(v)) return rs_json_bad_type(err, c->param, "a port number (an integer or a decimal string)", v);
    const char *s = json_string_value(v);
    size_t len = json_string_length(v);
    long x = len >= 1 && len <= 5 ? 0 : -1;
    for (size_t i = 0; x >= 0 && i < len; i++) x = s[i] >= '0' && s[i] <= '9' ? x * 10 + (s[i] - '0') : -1;
    if (x < 1 || x > 65535)
        return rs_error_set(err, RS_EINVAL, c->param, "%s must be a port in [1, 65535] (an integer or a decimal "
                            "string), got '%.16s'", c->param, s);
    r->master_port = (int)x;
    return RS_OK;
}

static int read_rank_offset(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_nccl_group_req *r = c->dst[0];
    long long x;
    int rc = rs_json_get_int(v, c->param, 0, r->world_size - 1, &x, err);
    if (rc == RS_OK) r->rank_offset = (int)x;
    return rc;
}

static int read_backend(const rs_jctx *c, const json_t *v, rs_error *err) {
    if (!json_is_string(v)) return rs_json_bad_type(err, c->param, "\"nccl\"", v);
    if (strcmp(json_string_value(v), "nccl") == 0) return RS_OK;
    return rs_error_set(err, RS_EUNSUPPORTED, c->param, "backend '%.32s' is not supported: only \"nccl\"",
                        json_string_value(v));
}

static int read_unique_id(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_nccl_group_req *r = c->dst[0];
    if (!json_is_string(v)) return rs_json_bad_type(err, c->param, "a base64 string", v);
    if (rs_base64_decode_exact(json_string_value(v), json_string_length(v), r->unique_id, RS_NCCL_UNIQUE_ID_BYTES))
        return rs_error_set(err, RS_EINVAL, c->param, "nccl_unique_id_b64 must be standard padded base64 of exactly "
                            "%d bytes (an ncclUniqueId)", RS_NCCL_UNIQUE_ID_BYTES);
    r->has_unique_id = true;
    return RS_OK;
}

static const rs_jfield group_fields[] = {
    {.name = "master_address", .type = RS_JT_STRING, .flags = RS_JF_REQUIRED, DST(rs_nccl_group_req, master_address),
     .doc = "the trainer's rendezvous host"},
    {.name = "master_port", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_master_port,
     .shape = "integer, or a string of decimal digits", .doc = "1..65535",
     .schema = "{'anyOf': [{'type': 'integer', 'minimum': 1, 'maximum': 65535}, {'type': 'string', "
               "'pattern': '^[0-9]+$'}]}"},
    {.name = "world_size", .type = RS_JT_INT, .flags = RS_JF_REQUIRED, DST(rs_nccl_group_req, world_size), .min = 2,
     .max = 65536, .doc = "trainer rank 0 plus every server rank"},
    {.name = "rank_offset", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_rank_offset,
     .shape = "integer in [0, world_size - 1]", .doc = "this server's rank",
     .schema = "{'type': 'integer', 'minimum': 0, 'maximum': 65535}"},
    GROUP_FIELD(rs_nccl_group_req),
    {.name = "backend", .type = RS_JT_CUSTOM, .read = read_backend, .shape = "`\"nccl\"`", .def = "\"nccl\"",
     .schema = "{'enum': ['nccl']}"},
    {.name = "nccl_unique_id_b64", .type = RS_JT_CUSTOM, .read = read_unique_id, .shape = "string (base64)",
     .doc = "rolloutd's: the trainer's ncclUniqueId (128 bytes); without it rolloutd joins the trainer's "
            "torch TCPStore at master_address:master_port, as an SGLang server does",
     .schema = "{'type': 'string', 'pattern': '^[A-Za-z0-9+/]*={0,2}$'}"},
    {.name = "rid", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT, .doc = "SGLang's request id; not used"},
    {.name = "http_worker_ipc", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "SGLang's internal IPC"},
};

const rs_jobject rs_nccl_group_fields = {
    .title = "POST /init_weights_update_group", .fields = group_fields, .n = RS_ARRAY_LEN(group_fields)};

int rs_weights_parse_nccl_group(const char *body, size_t len, rs_nccl_group_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    rs_nccl_group_req *r = rs_xcalloc(1, sizeof *r);
    snprintf(r->group_name, sizeof r->group_name, GROUP_DEFAULT);
    snprintf(r->backend, sizeof r->backend, "nccl");
    int rc = read_body(body, len, &rs_nccl_group_fields, r, err);
    if (rc == RS_OK) *out = *r;
    free(r);
    return rc;
}

static int read_names(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_nccl_update_req *r = c->dst[0];
    int rc = get_tensor_list(v, c->param, &r->tensors, &r->n_tensors, err);
    if (rc == RS_OK && r->n_tensors == 0) rc = rs_error_set(err, RS_EINVAL, c->param, "names must not be empty");
    for (int i = 0; rc == RS_OK && i < r->n_tensors; i++) {
        char param[48];
        snprintf(param, sizeof param, "names[%d]", i);
        rc = rs_json_check_name(json_array_get(v, (size_t)i), param, RS_WEIGHT_NAME_MAX, err);
        if (rc == RS_OK) snprintf(r->tensors[i].name, sizeof r->tensors[i].name, "%s",
                                  json_string_value(json_array_get(v, (size_t)i)));
    }
    return rc;
}

/* dtypes and shapes: lists as long as names (read first). */
static int same_length(const rs_jctx *c, const json_t *v, rs_error *err) {
    const rs_nccl_update_req *r = c->dst[0];
    if (!json_is_array(v)) return rs_json_bad_type(err, c->param, "a list", v);
    if (json_array_size(v) != (size_t)r->n_tensors)
        return rs_error_set(err, RS_EINVAL, c->param, "%s has %zu entries, names has %d", c->param, json_array_size(v),
                            r->n_tensors);
    return RS_OK;
}

static int read_dtypes(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_nccl_update_req *r = c->dst[0];
    int rc = same_length(c, v, err);
    for (int i = 0; rc == RS_OK && i < r->n_tensors; i++) {
        char param[48];
        snprintf(param, sizeof param, "dtypes[%d]", i);
        rc = get_dtype(json_array_get(v, (size_t)i), param, &r->tensors[i].dtype, err);
    }
    return rc;
}

/* Shapes, and the offsets of a flattened bucket (the running sum of the sizes, no padding). */
static int read_shapes(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_nccl_update_req *r = c->dst[0];
    int rc = same_length(c, v, err);
    for (int i = 0; rc == RS_OK && i < r->n_tensors; i++) {
        rs_weight_desc *d = &r->tensors[i];
        char param[48];
        snprintf(param, sizeof param, "shapes[%d]", i);
        if ((rc = get_shape(json_array_get(v, (size_t)i), param, d, err)) != RS_OK) break;
        d->offset = r->total_bytes;
        if (d->nbytes > RS_WEIGHT_MAX_BYTES - r->total_bytes)
            return rs_error_set(err, RS_EINVAL, "shapes", "the tensors add up to more than 2^62 bytes");
        r->total_bytes += d->nbytes;
    }
    return rc;
}

static int read_nccl_load_format(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_nccl_update_req *r = c->dst[0];
    if (!json_is_string(v)) return rs_json_bad_type(err, c->param, "null or \"flattened_bucket\"", v);
    if (strcmp(json_string_value(v), "flattened_bucket") != 0)
        return rs_error_set(err, RS_EUNSUPPORTED, c->param, "load_format '%.64s' is not supported: null (one "
                            "broadcast per tensor) or \"flattened_bucket\"", json_string_value(v));
    r->flattened_bucket = true;
    return RS_OK;
}

static const rs_jfield nccl_update_fields[] = {
    {.name = "names", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_names,
     .shape = "list of strings", .doc = "the tensors, in broadcast order",
     .schema = "{'type': 'array', 'minItems': 1, 'items': {'type': 'string', 'minLength': 1, 'maxLength': 255, "
               "'pattern': '$name'}}"},
    {.name = "dtypes", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_dtypes,
     .shape = "list of strings", .doc = "one per name",
     .schema = "{'type': 'array', 'items': {'type': 'string'}}"},
    {.name = "shapes", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_shapes,
     .shape = "list of lists of integers", .doc = "one per name",
     .schema = "{'type': 'array', 'items': {'type': 'array', 'maxItems': 4, 'items': {'type': 'integer', "
               "'minimum': 0, 'maximum': 4611686018427387904}}}"},
    GROUP_FIELD(rs_nccl_update_req),
    {.name = "load_format", .type = RS_JT_CUSTOM, .read = read_nccl_load_format, .shape = "`\"flattened_bucket\"`",
     .doc = "null: one broadcast per tensor; flattened_bucket: one of their concatenation",
     .schema = "{'enum': ['flattened_bucket']}"},
    VERSION_FIELD(rs_nccl_update_req),
    TXN_FIELD(rs_nccl_update_req),
    {.name = "is_last", .type = RS_JT_CUSTOM, DST(rs_nccl_update_req, is_last), .read = read_last,
     .shape = "boolean", .doc = "rolloutd's: as on /update_weights_from_shm",
     .schema = "{'type': 'boolean'}"},
    COMMIT_FIELDS(rs_nccl_update_req),
};

const rs_jobject rs_nccl_update_fields = {.title = "POST /update_weights_from_distributed",
                                          .fields = nccl_update_fields, .n = RS_ARRAY_LEN(nccl_update_fields)};

int rs_weights_parse_nccl_update(const char *body, size_t len, rs_nccl_update_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    rs_nccl_update_req r = {0};
    snprintf(r.group_name, sizeof r.group_name, GROUP_DEFAULT);
    int rc = read_body(body, len, &rs_nccl_update_fields, &r, err);
    if (rc != RS_OK) {
        free(r.tensors);
        return rc;
    }
    r.has_version = r.weight_version[0] != '\0';
    r.has_txn_id = r.txn_id[0] != '\0';
    *out = r;
    return RS_OK;
}

static const rs_jfield destroy_fields[] = {
    GROUP_FIELD(rs_nccl_destroy_req),
    {.name = "rid", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT, .doc = "SGLang's request id; not used"},
    {.name = "http_worker_ipc", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "SGLang's internal IPC"},
};

const rs_jobject rs_nccl_destroy_fields = {
    .title = "POST /destroy_weights_update_group", .fields = destroy_fields, .n = RS_ARRAY_LEN(destroy_fields)};

int rs_weights_parse_nccl_destroy(const char *body, size_t len, rs_nccl_destroy_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    rs_nccl_destroy_req r = {{0}};
    snprintf(r.group_name, sizeof r.group_name, GROUP_DEFAULT);
    int rc = read_body(body, len, &rs_nccl_destroy_fields, &r, err);
    if (rc == RS_OK) *out = r;
    return rc;
}

/* ---------------------------------------------------------------- the answer */

char *rs_weights_response(const char *message, const char *weight_version, uint64_t bytes, double seconds,
                          bool committed, const char *transaction_id, size_t *len) {
    json_t *o = json_object();
    if (!o) return NULL;
    json_t *msg = json_string(message);
    if (!msg) msg = json_string("(message not valid UTF-8)");
    json_object_set_new(o, "success", json_true());
    json_object_set_new(o, "message", msg);
    json_object_set_new(o, "weight_version", json_string(weight_version));
    json_object_set_new(o, "bytes", json_integer((json_int_t)RS_MIN(bytes, (uint64_t)LLONG_MAX)));
    json_object_set_new(o, "seconds", json_real(seconds >= 0 ? seconds : 0));
    json_object_set_new(o, "committed", json_boolean(committed));
    if (transaction_id && transaction_id[0]) json_object_set_new(o, "transaction_id", json_string(transaction_id));
    char *s = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(6));
    json_decref(o);
    if (s && len) *len = strlen(s);
    return s;
}
