/*
 * weights.c — parsers for the weight-update routes and their answer (see weights.h).
 *
 * Like generate.c, parsing walks each object key by key: every key is matched against the route's
 * table of fields, so an unknown key is reported by name (a misspelt "is_lats" must not turn a
 * last bucket into a silent non-commit), and the known fields are then checked in a fixed order,
 * so the error a bad body gets does not depend on the order of its keys. JSON null for an optional
 * field means "absent", as SGLang treats it. Everything a request allocates is bounded by its body
 * size, which the server caps before calling in, and by RS_WEIGHT_MAX_TENSORS.
 */
#include "weights.h"
#include "json_util.h"

#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- field readers */

/* A string of 1..max bytes without control characters, copied into out[cap > max]. */
static int get_text(const json_t *v, const char *param, size_t max, char *out, size_t cap, rs_error *err) {
    RS_ASSERT(cap > max);
    if (!json_is_string(v)) return rs_json_bad_type(err, param, "a string", v);
    const char *s = json_string_value(v);
    size_t len = json_string_length(v);
    if (len == 0) return rs_error_set(err, RS_EINVAL, param, "%s must not be empty", param);
    if (len > max) return rs_error_set(err, RS_EINVAL, param, "%s must be at most %zu bytes, got %zu", param, max, len);
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
            return rs_error_set(err, RS_EINVAL, param, "%s must not contain control characters", param);
    memcpy(out, s, len + 1);
    return RS_OK;
}

/* An optional transaction_id: absent or null leaves *has false. */
static int get_txn_id(const json_t *v, bool *has, char *out, rs_error *err) {
    *has = false;
    if (!v) return RS_OK;
    int rc = get_text(v, "transaction_id", RS_WEIGHT_TXN_ID_MAX, out, RS_WEIGHT_TXN_ID_MAX + 1, err);
    if (rc == RS_OK) *has = true;
    return rc;
}

/* An optional weight_version: absent or null leaves *has false. */
static int get_version(const json_t *v, const char *param, bool *has, char *out, rs_error *err) {
    *has = false;
    if (!v) return RS_OK;
    int rc = get_text(v, param, RS_WEIGHT_VERSION_MAX, out, RS_WEIGHT_VERSION_MAX + 1, err);
    if (rc == RS_OK) *has = true;
    return rc;
}

static int get_last(const json_t *v, rs_weight_last *out, rs_error *err) {
    *out = RS_WEIGHT_LAST_AUTO;
    if (!v) return RS_OK;
    bool b = false;
    int rc = rs_json_get_bool(v, "is_last", &b, err);
    if (rc == RS_OK) *out = b ? RS_WEIGHT_LAST_YES : RS_WEIGHT_LAST_NO;
    return rc;
}

/* ---------------------------------------------------------------- objects */

typedef struct field {
    const char *name;
    json_t *v;                          /* NULL when absent or JSON null */
} field;

/* Collects obj's keys into fields[] (matched by name); an unknown key is an error naming it
 * (`prefix` + key). */
static int collect(const json_t *obj, const char *prefix, field *fields, size_t n, rs_error *err) {
    if (!json_is_object(obj)) return rs_json_bad_type(err, prefix[0] ? prefix : "the request body", "an object", obj);
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)obj, key, v) {
        size_t i = 0;
        while (i < n && strcmp(fields[i].name, key) != 0) i++;
        if (i == n) {
            char param[200];
            snprintf(param, sizeof param, "%s%s%.150s", prefix, prefix[0] ? "." : "", key);
            return rs_error_set(err, RS_EINVAL, param, "unknown field '%s'", param);
        }
        fields[i].v = json_is_null(v) ? NULL : v;
    }
    return RS_OK;
}

static json_t *field_get(const field *fields, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(fields[i].name, name) == 0) return fields[i].v;
    RS_ASSERT(!"field not in the table");
    return NULL;
}

static int required(const json_t *v, const char *param, rs_error *err) {
    return v ? RS_OK : rs_error_set(err, RS_EINVAL, param, "missing required field '%s'", param);
}

static int load_body(const char *body, size_t len, json_t **out, rs_error *err) {
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return rs_error_set(err, RS_EINVAL, NULL, "malformed JSON: %s (line %d, column %d)", je.text, je.line,
                            je.column);
    *out = root;
    return RS_OK;
}

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

static int get_name(const json_t *v, const char *param, char *out, rs_error *err) {
    return get_text(v, param, RS_WEIGHT_NAME_MAX, out, RS_WEIGHT_NAME_MAX + 1, err);
}

bool rs_shm_name_valid(const char *name) {
    size_t len = strnlen(name, RS_SHM_NAME_MAX + 1);
    if (len < 2 || len > RS_SHM_NAME_MAX || name[0] != '/') return false;
    if (strcmp(name, "/.") == 0 || strcmp(name, "/..") == 0) return false;
    for (size_t i = 1; i < len; i++)
        if (name[i] == '/' || (unsigned char)name[i] < 0x20 || name[i] == 0x7f) return false;
    return true;
}

/* ---------------------------------------------------------------- /update_weights_from_shm */

static int parse_shm_tensor(const json_t *obj, size_t i, rs_weight_desc *d, rs_error *err) {
    char prefix[48], param[96];
    snprintf(prefix, sizeof prefix, "tensors[%zu]", i);
    field f[] = {{"name", NULL}, {"dtype", NULL}, {"shape", NULL}, {"offset", NULL}, {"crc32c", NULL}};
    int rc = collect(obj, prefix, f, RS_ARRAY_LEN(f), err);
    if (rc != RS_OK) return rc;
    static const char *const order[] = {"name", "dtype", "shape", "offset"};
    for (size_t k = 0; k < RS_ARRAY_LEN(order); k++) {
        snprintf(param, sizeof param, "%s.%s", prefix, order[k]);
        if ((rc = required(field_get(f, RS_ARRAY_LEN(f), order[k]), param, err)) != RS_OK) return rc;
    }
    snprintf(param, sizeof param, "%s.name", prefix);
    if ((rc = get_name(field_get(f, 4, "name"), param, d->name, err)) != RS_OK) return rc;
    snprintf(param, sizeof param, "%s.dtype", prefix);
    if ((rc = get_dtype(field_get(f, 4, "dtype"), param, &d->dtype, err)) != RS_OK) return rc;
    snprintf(param, sizeof param, "%s.shape", prefix);
    if ((rc = get_shape(field_get(f, 4, "shape"), param, d, err)) != RS_OK) return rc;
    snprintf(param, sizeof param, "%s.offset", prefix);
    long long off;
    if ((rc = rs_json_get_int(field_get(f, 4, "offset"), param, 0, (long long)RS_WEIGHT_MAX_BYTES, &off, err)) != RS_OK)
        return rc;
    d->offset = (uint64_t)off;
    if (d->offset + d->nbytes > RS_WEIGHT_MAX_BYTES) /* both <= 2^62: the sum cannot wrap */
        return rs_error_set(err, RS_EINVAL, param, "%s + the tensor's %llu bytes goes past 2^62", param,
                            (unsigned long long)d->nbytes);
    json_t *crc = field_get(f, RS_ARRAY_LEN(f), "crc32c");
    if (crc) {
        snprintf(param, sizeof param, "%s.crc32c", prefix);
        long long c;
        if ((rc = rs_json_get_int(crc, param, 0, 0xffffffffll, &c, err)) != RS_OK) return rc;
        d->has_crc32c = true;
        d->crc32c = (uint32_t)c;
    }
    return RS_OK;
}

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

int rs_shm_update_parse(const char *body, size_t len, rs_shm_update_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = load_body(body, len, &root, err);
    if (rc != RS_OK) return rc;
    rs_shm_update_req r = {0};
    field f[] = {{"shm_name", NULL}, {"tensors", NULL}, {"is_last", NULL}, {"weight_version", NULL},
                 {"abort_all_requests", NULL}, {"flush_cache", NULL}, {"transaction_id", NULL}};
    const size_t nf = RS_ARRAY_LEN(f);
    bool ignored;
    if ((rc = collect(root, "", f, nf, err)) != RS_OK) goto fail;
    if ((rc = required(field_get(f, nf, "shm_name"), "shm_name", err)) != RS_OK) goto fail;
    if ((rc = get_text(field_get(f, nf, "shm_name"), "shm_name", RS_SHM_NAME_MAX, r.shm_name, sizeof r.shm_name,
                       err)) != RS_OK)
        goto fail;
    if (!rs_shm_name_valid(r.shm_name)) {
        rc = rs_error_set(err, RS_EINVAL, "shm_name",
                          "shm_name must be a POSIX shared-memory name: '/' followed by a name without '/', got '%s'",
                          r.shm_name);
        goto fail;
    }
    if ((rc = required(field_get(f, nf, "tensors"), "tensors", err)) != RS_OK) goto fail;
    if ((rc = get_tensor_list(field_get(f, nf, "tensors"), "tensors", &r.tensors, &r.n_tensors, err)) != RS_OK)
        goto fail;
    for (int i = 0; i < r.n_tensors; i++)
        if ((rc = parse_shm_tensor(json_array_get(field_get(f, nf, "tensors"), (size_t)i), (size_t)i, &r.tensors[i],
                                   err)) != RS_OK)
            goto fail;
    if ((rc = get_last(field_get(f, nf, "is_last"), &r.is_last, err)) != RS_OK) goto fail;
    if ((rc = get_version(field_get(f, nf, "weight_version"), "weight_version", &r.has_version, r.weight_version,
                          err)) != RS_OK)
        goto fail;
    if ((rc = get_txn_id(field_get(f, nf, "transaction_id"), &r.has_txn_id, r.txn_id, err)) != RS_OK) goto fail;
    if (field_get(f, nf, "abort_all_requests") &&
        (rc = rs_json_get_bool(field_get(f, nf, "abort_all_requests"), "abort_all_requests", &r.abort_all_requests, err)))
        goto fail;
    if (field_get(f, nf, "flush_cache") && (rc = rs_json_get_bool(field_get(f, nf, "flush_cache"), "flush_cache", &ignored,
                                                          err)) != RS_OK)
        goto fail;
    json_decref(root);
    *out = r;
    return RS_OK;
fail:
    free(r.tensors);
    json_decref(root);
    return rc;
}

void rs_shm_update_req_free(rs_shm_update_req *r) {
    free(r->tensors);
    memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------- /update_weights_from_disk */

int rs_disk_update_parse(const char *body, size_t len, rs_disk_update_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = load_body(body, len, &root, err);
    if (rc != RS_OK) return rc;
    rs_disk_update_req *r = rs_xcalloc(1, sizeof *r);
    field f[] = {{"model_path", NULL}, {"weight_version", NULL}, {"abort_all_requests", NULL},
                 {"flush_cache", NULL}, {"load_format", NULL}};
    const size_t nf = RS_ARRAY_LEN(f);
    bool ignored;
    json_t *lf;
    if ((rc = collect(root, "", f, nf, err)) != RS_OK) goto done;
    if ((rc = required(field_get(f, nf, "model_path"), "model_path", err)) != RS_OK) goto done;
    if ((rc = get_text(field_get(f, nf, "model_path"), "model_path", RS_WEIGHT_PATH_MAX, r->model_path,
                       sizeof r->model_path, err)) != RS_OK)
        goto done;
    if (r->model_path[0] != '/') {
        rc = rs_error_set(err, RS_EINVAL, "model_path", "model_path must be an absolute path, got '%.200s'",
                          r->model_path);
        goto done;
    }
    if ((rc = get_version(field_get(f, nf, "weight_version"), "weight_version", &r->has_version, r->weight_version,
                          err)) != RS_OK)
        goto done;
    if (field_get(f, nf, "abort_all_requests") &&
        (rc = rs_json_get_bool(field_get(f, nf, "abort_all_requests"), "abort_all_requests", &r->abort_all_requests, err)))
        goto done;
    if (field_get(f, nf, "flush_cache") &&
        (rc = rs_json_get_bool(field_get(f, nf, "flush_cache"), "flush_cache", &ignored, err)) != RS_OK)
        goto done;
    if ((lf = field_get(f, nf, "load_format")) != NULL) {
        if (!json_is_string(lf)) {
            rc = rs_json_bad_type(err, "load_format", "null, \"auto\" or \"safetensors\"", lf);
            goto done;
        }
        if (strcmp(json_string_value(lf), "auto") != 0 && strcmp(json_string_value(lf), "safetensors") != 0) {
            rc = rs_error_set(err, RS_EUNSUPPORTED, "load_format",
                              "load_format '%.64s' is not supported: only safetensors directories (null, \"auto\" "
                              "or \"safetensors\")", json_string_value(lf));
            goto done;
        }
    }
    *out = *r;
done:
    free(r);
    json_decref(root);
    return rc;
}

/* ---------------------------------------------------------------- /update_weight_version */

int rs_version_update_parse(const char *body, size_t len, rs_version_update_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = load_body(body, len, &root, err);
    if (rc != RS_OK) return rc;
    rs_version_update_req r = {0};
    field f[] = {{"new_version", NULL}, {"abort_all_requests", NULL}};
    if ((rc = collect(root, "", f, 2, err)) != RS_OK) goto done;
    if ((rc = required(f[0].v, "new_version", err)) != RS_OK) goto done;
    if ((rc = get_text(f[0].v, "new_version", RS_WEIGHT_VERSION_MAX, r.new_version, sizeof r.new_version, err)))
        goto done;
    if (f[1].v && (rc = rs_json_get_bool(f[1].v, "abort_all_requests", &r.abort_all_requests, err)) != RS_OK) goto done;
    *out = r;
done:
    json_decref(root);
    return rc;
}

/* ---------------------------------------------------------------- NCCL routes */

static int get_group_name(const json_t *v, char *out, rs_error *err) {
    if (!v) {
        snprintf(out, RS_NCCL_GROUP_NAME_MAX + 1, "weight_update_group"); /* SGLang's default */
        return RS_OK;
    }
    return get_text(v, "group_name", RS_NCCL_GROUP_NAME_MAX, out, RS_NCCL_GROUP_NAME_MAX + 1, err);
}

static int b64_value(char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Standard base64 with padding (Python's base64.b64encode), decoding to exactly `want` bytes. */
static int b64_decode_exact(const char *s, size_t len, uint8_t *out, size_t want) {
    if (len % 4 != 0) return -1;
    size_t n = 0;
    for (size_t i = 0; i < len; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            if (s[i + k] == '=' && i + 4 == len && k >= 2) {
                v[k] = 0;
                pad++;
            } else {
                if (pad) return -1; /* data after '=' */
                if ((v[k] = b64_value(s[i + k])) < 0) return -1;
            }
        }
        uint32_t x = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        uint8_t b[3] = {(uint8_t)(x >> 16), (uint8_t)(x >> 8), (uint8_t)x};
        for (int k = 0; k < 3 - pad; k++) {
            if (n == want) return -1;
            out[n++] = b[k];
        }
    }
    return n == want ? 0 : -1;
}

/* master_port: an integer, or a decimal string as AReaL sends it ("29500"); 1..65535. */
static int get_port(const json_t *v, int *out, rs_error *err) {
    long long x = 0;
    if (!json_is_string(v)) {
        int rc = rs_json_get_int(v, "master_port", 1, 65535, &x, err);
        if (rc == RS_OK) *out = (int)x;
        return rc;
    }
    const char *s = json_string_value(v);
    size_t n = json_string_length(v);
    bool digits = n >= 1 && n <= 5;
    for (size_t i = 0; digits && i < n; i++) {
        digits = s[i] >= '0' && s[i] <= '9';
        x = x * 10 + (s[i] - '0');
    }
    if (!digits || x < 1 || x > 65535)
        return rs_error_set(err, RS_EINVAL, "master_port",
                            "master_port must be an integer or a decimal string in [1, 65535], got \"%.16s\"", s);
    *out = (int)x;
    return RS_OK;
}

int rs_nccl_group_parse(const char *body, size_t len, rs_nccl_group_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = load_body(body, len, &root, err);
    if (rc != RS_OK) return rc;
    rs_nccl_group_req *r = rs_xcalloc(1, sizeof *r);
    field f[] = {{"master_address", NULL}, {"master_port", NULL}, {"rank_offset", NULL}, {"world_size", NULL},
                 {"group_name", NULL}, {"backend", NULL}, {"nccl_unique_id_b64", NULL}};
    const size_t nf = RS_ARRAY_LEN(f);
    long long x;
    json_t *v;
    if ((rc = collect(root, "", f, nf, err)) != RS_OK) goto done;
    for (size_t i = 0; i < 4; i++)
        if ((rc = required(f[i].v, f[i].name, err)) != RS_OK) goto done;
    if ((rc = get_text(f[0].v, "master_address", RS_NCCL_ADDRESS_MAX, r->master_address, sizeof r->master_address,
                       err)) != RS_OK)
        goto done;
    if ((rc = get_port(f[1].v, &r->master_port, err)) != RS_OK) goto done;
    if ((rc = rs_json_get_int(f[3].v, "world_size", 2, 65536, &x, err)) != RS_OK) goto done;
    r->world_size = (int)x;
    if ((rc = rs_json_get_int(f[2].v, "rank_offset", 0, r->world_size - 1, &x, err)) != RS_OK) goto done;
    r->rank_offset = (int)x;
    if ((rc = get_group_name(f[4].v, r->group_name, err)) != RS_OK) goto done;
    snprintf(r->backend, sizeof r->backend, "nccl");
    if ((v = f[5].v) != NULL) {
        if (!json_is_string(v)) {
            rc = rs_json_bad_type(err, "backend", "\"nccl\"", v);
            goto done;
        }
        if (strcmp(json_string_value(v), "nccl") != 0) {
            rc = rs_error_set(err, RS_EUNSUPPORTED, "backend", "backend '%.32s' is not supported: only \"nccl\"",
                              json_string_value(v));
            goto done;
        }
    }
    if ((v = f[6].v) != NULL) {
        if (!json_is_string(v)) {
            rc = rs_json_bad_type(err, "nccl_unique_id_b64", "a base64 string", v);
            goto done;
        }
        if (b64_decode_exact(json_string_value(v), json_string_length(v), r->unique_id, RS_NCCL_UNIQUE_ID_BYTES)) {
            rc = rs_error_set(err, RS_EINVAL, "nccl_unique_id_b64",
                              "nccl_unique_id_b64 must be standard padded base64 of exactly %d bytes (an "
                              "ncclUniqueId)", RS_NCCL_UNIQUE_ID_BYTES);
            goto done;
        }
        r->has_unique_id = true;
    }
    *out = *r;
done:
    free(r);
    json_decref(root);
    return rc;
}

int rs_nccl_update_parse(const char *body, size_t len, rs_nccl_update_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = load_body(body, len, &root, err);
    if (rc != RS_OK) return rc;
    rs_nccl_update_req r = {0};
    field f[] = {{"names", NULL}, {"dtypes", NULL}, {"shapes", NULL}, {"group_name", NULL},
                 {"load_format", NULL}, {"weight_version", NULL}, {"is_last", NULL},
                 {"abort_all_requests", NULL}, {"flush_cache", NULL}, {"transaction_id", NULL}};
    const size_t nf = RS_ARRAY_LEN(f);
    json_t *names, *dtypes, *shapes, *lf;
    bool ignored;
    if ((rc = collect(root, "", f, nf, err)) != RS_OK) goto fail;
    for (size_t i = 0; i < 3; i++)
        if ((rc = required(f[i].v, f[i].name, err)) != RS_OK) goto fail;
    names = f[0].v, dtypes = f[1].v, shapes = f[2].v;
    if ((rc = get_tensor_list(names, "names", &r.tensors, &r.n_tensors, err)) != RS_OK) goto fail;
    if (r.n_tensors == 0) {
        rc = rs_error_set(err, RS_EINVAL, "names", "names must not be empty");
        goto fail;
    }
    if (!json_is_array(dtypes) || json_array_size(dtypes) != (size_t)r.n_tensors) {
        rc = json_is_array(dtypes) ? rs_error_set(err, RS_EINVAL, "dtypes", "dtypes has %zu entries, names has %d",
                                                  json_array_size(dtypes), r.n_tensors)
                                   : rs_json_bad_type(err, "dtypes", "a list", dtypes);
        goto fail;
    }
    if (!json_is_array(shapes) || json_array_size(shapes) != (size_t)r.n_tensors) {
        rc = json_is_array(shapes) ? rs_error_set(err, RS_EINVAL, "shapes", "shapes has %zu entries, names has %d",
                                                  json_array_size(shapes), r.n_tensors)
                                   : rs_json_bad_type(err, "shapes", "a list", shapes);
        goto fail;
    }
    for (int i = 0; i < r.n_tensors; i++) {
        rs_weight_desc *d = &r.tensors[i];
        char param[48];
        snprintf(param, sizeof param, "names[%d]", i);
        if ((rc = get_name(json_array_get(names, (size_t)i), param, d->name, err)) != RS_OK) goto fail;
        snprintf(param, sizeof param, "dtypes[%d]", i);
        if ((rc = get_dtype(json_array_get(dtypes, (size_t)i), param, &d->dtype, err)) != RS_OK) goto fail;
        snprintf(param, sizeof param, "shapes[%d]", i);
        if ((rc = get_shape(json_array_get(shapes, (size_t)i), param, d, err)) != RS_OK) goto fail;
        d->offset = r.total_bytes;
        if (d->nbytes > RS_WEIGHT_MAX_BYTES - r.total_bytes) {
            rc = rs_error_set(err, RS_EINVAL, "shapes", "the tensors add up to more than 2^62 bytes");
            goto fail;
        }
        r.total_bytes += d->nbytes;
    }
    if ((rc = get_group_name(f[3].v, r.group_name, err)) != RS_OK) goto fail;
    if ((lf = f[4].v) != NULL) {
        if (!json_is_string(lf)) {
            rc = rs_json_bad_type(err, "load_format", "null or \"flattened_bucket\"", lf);
            goto fail;
        }
        if (strcmp(json_string_value(lf), "flattened_bucket") != 0) {
            rc = rs_error_set(err, RS_EUNSUPPORTED, "load_format",
                              "load_format '%.64s' is not supported: null (one broadcast per tensor) or "
                              "\"flattened_bucket\"", json_string_value(lf));
            goto fail;
        }
        r.flattened_bucket = true;
    }
    if ((rc = get_version(f[5].v, "weight_version", &r.has_version, r.weight_version, err)) != RS_OK) goto fail;
    if ((rc = get_last(f[6].v, &r.is_last, err)) != RS_OK) goto fail;
    if (f[7].v && (rc = rs_json_get_bool(f[7].v, "abort_all_requests", &r.abort_all_requests, err)) != RS_OK) goto fail;
    if (f[8].v && (rc = rs_json_get_bool(f[8].v, "flush_cache", &ignored, err)) != RS_OK) goto fail;
    if ((rc = get_txn_id(f[9].v, &r.has_txn_id, r.txn_id, err)) != RS_OK) goto fail;
    json_decref(root);
    *out = r;
    return RS_OK;
fail:
    free(r.tensors);
    json_decref(root);
    return rc;
}

void rs_nccl_update_req_free(rs_nccl_update_req *r) {
    free(r->tensors);
    memset(r, 0, sizeof *r);
}

int rs_nccl_destroy_parse(const char *body, size_t len, rs_nccl_destroy_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = load_body(body, len, &root, err);
    if (rc != RS_OK) return rc;
    rs_nccl_destroy_req r = {{0}};
    field f[] = {{"group_name", NULL}};
    if ((rc = collect(root, "", f, 1, err)) == RS_OK && (rc = get_group_name(f[0].v, r.group_name, err)) == RS_OK)
        *out = r;
    json_decref(root);
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
