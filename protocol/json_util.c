/*
 * json_util.c — field readers and writers shared by the protocol/ modules (see json_util.h).
 */
#include "json_util.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int rs_json_load_object(const char *body, size_t len, bool allow_empty, json_t **out, rs_error *err) {
    *out = NULL;
    size_t i = 0;
    while (i < len && (body[i] == ' ' || body[i] == '\t' || body[i] == '\r' || body[i] == '\n')) i++;
    if (i == len) {
        if (!allow_empty) return rs_error_set(err, RS_EINVAL, NULL, "request body is empty; expected a JSON object");
        *out = json_object();
        return *out ? RS_OK : rs_error_set(err, RS_ENOMEM, NULL, "out of memory");
    }
    json_error_t jerr;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return rs_error_set(err, RS_EINVAL, NULL, "invalid JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                            jerr.column);
    if (!json_is_object(root)) {
        char got[64];
        rs_json_describe(root, got, sizeof got);
        json_decref(root);
        return rs_error_set(err, RS_EINVAL, NULL, "body must be a JSON object, got %s", got);
    }
    *out = root;
    return RS_OK;
}

void rs_json_describe(const json_t *v, char *buf, size_t n) {
    switch (json_typeof(v)) {
    case JSON_INTEGER: snprintf(buf, n, "%" JSON_INTEGER_FORMAT, json_integer_value(v)); return;
    case JSON_REAL: snprintf(buf, n, "%g", json_real_value(v)); return;
    case JSON_TRUE: snprintf(buf, n, "true"); return;
    case JSON_FALSE: snprintf(buf, n, "false"); return;
    case JSON_NULL: snprintf(buf, n, "null"); return;
    case JSON_STRING: snprintf(buf, n, "a string"); return;
    case JSON_ARRAY: snprintf(buf, n, "a list"); return;
    case JSON_OBJECT: snprintf(buf, n, "an object"); return;
    }
    snprintf(buf, n, "?");
}

int rs_json_bad_type(rs_error *err, const char *param, const char *want, const json_t *v) {
    char got[64];
    rs_json_describe(v, got, sizeof got);
    return rs_error_set(err, RS_EINVAL, param, "%s must be %s, got %s", param, want, got);
}

int rs_json_get_int(const json_t *v, const char *param, long long min, long long max, long long *out,
                    rs_error *err) {
    if (!json_is_integer(v)) return rs_json_bad_type(err, param, "an integer", v);
    long long x = json_integer_value(v);
    if (x < min) return rs_error_set(err, RS_EINVAL, param, "%s must be >= %lld, got %lld", param, min, x);
    if (x > max) return rs_error_set(err, RS_EINVAL, param, "%s must be <= %lld, got %lld", param, max, x);
    *out = x;
    return RS_OK;
}

/* jansson already rejects NaN, inf and reals that overflow a double; sampling parameters are
 * stored as float, so the value must also fit one. */
int rs_json_get_float(const json_t *v, const char *param, double *out, rs_error *err) {
    if (!json_is_number(v)) return rs_json_bad_type(err, param, "a number", v);
    double x = json_number_value(v);
    if (!isfinite(x) || fabs(x) > FLT_MAX)
        return rs_error_set(err, RS_EINVAL, param, "%s is out of range, got %g", param, x);
    *out = x;
    return RS_OK;
}

int rs_json_get_bool(const json_t *v, const char *param, bool *out, rs_error *err) {
    if (!json_is_boolean(v)) return rs_json_bad_type(err, param, "true or false", v);
    *out = json_is_true(v);
    return RS_OK;
}

int rs_json_get_ids(const json_t *arr, const char *param, const char *path, int32_t **out, int *n_out,
                    rs_error *err) {
    if (!json_is_array(arr)) return rs_json_bad_type(err, path, "a list of token ids", arr);
    size_t n = json_array_size(arr);
    if (n > INT_MAX) return rs_error_set(err, RS_EINVAL, param, "%s has too many tokens", path);
    int32_t *ids = n ? malloc(sizeof(int32_t) * n) : NULL;
    if (n && !ids) return rs_error_set(err, RS_ENOMEM, param, "out of memory reading %s", path);
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(arr, i);
        int rc = RS_OK;
        if (!json_is_integer(v)) {
            char got[64];
            rs_json_describe(v, got, sizeof got);
            rc = rs_error_set(err, RS_EINVAL, param, "%s[%zu] must be an integer token id, got %s", path, i, got);
        } else if (json_integer_value(v) < 0) {
            rc = rs_error_set(err, RS_EINVAL, param, "%s[%zu] must be >= 0, got %" JSON_INTEGER_FORMAT, path, i,
                              json_integer_value(v));
        } else if (json_integer_value(v) > INT32_MAX) {
            rc = rs_error_set(err, RS_EINVAL, param, "%s[%zu] must be < 2147483648, got %" JSON_INTEGER_FORMAT,
                              path, i, json_integer_value(v));
        }
        if (rc != RS_OK) {
            free(ids);
            return rc;
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    *out = ids;
    *n_out = (int)n;
    return RS_OK;
}

int rs_json_check_name(const json_t *v, const char *param, size_t max_len, rs_error *err) {
    if (!json_is_string(v)) return rs_json_bad_type(err, param, "a string", v);
    const char *s = json_string_value(v);
    size_t len = json_string_length(v);
    if (len == 0) return rs_error_set(err, RS_EINVAL, param, "%s must not be empty", param);
    if (len > max_len)
        return rs_error_set(err, RS_EINVAL, param, "%s must be at most %zu bytes, got %zu", param, max_len, len);
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
            return rs_error_set(err, RS_EINVAL, param, "%s must not contain control characters", param);
    return RS_OK;
}

int rs_json_get_logprobs_mode(const json_t *v, rs_logprobs_mode *mode, rs_error *err) {
    if (!json_is_string(v)) return rs_json_bad_type(err, "logprobs_mode", "a string", v);
    const char *s = json_string_value(v);
    static const char *const names[] = {[RS_LOGPROBS_DEFAULT] = "default", [RS_LOGPROBS_RAW] = "raw",
                                        [RS_LOGPROBS_PROCESSED] = "processed"};
    for (size_t i = 0; i < RS_ARRAY_LEN(names); i++) {
        if (strcmp(s, names[i]) == 0) {
            *mode = (rs_logprobs_mode)i;
            return RS_OK;
        }
    }
    return rs_error_set(err, RS_EINVAL, "logprobs_mode",
                        "logprobs_mode must be one of 'default', 'raw', 'processed', got '%.64s'", s);
}

json_t *rs_json_string_lossy(const char *s) {
    json_t *v = json_string(s);
    if (v) return v;
    char *copy = strdup(s);
    if (!copy) return NULL;
    for (char *p = copy; *p; p++)
        if ((unsigned char)*p >= 0x80) *p = '?';
    v = json_string(copy);
    free(copy);
    return v;
}

json_t *rs_json_logprob(float lp) { return isfinite(lp) ? json_real((double)lp) : json_null(); }

static int buf_add(const char *s, size_t n, void *data) { return rs_buf_append(data, s, n) == RS_OK ? 0 : -1; }

char *rs_json_dump(json_t *v, size_t *len) {
    if (!v) return NULL;
    rs_buf b = {0};
    int rc = json_dump_callback(v, buf_add, &b, RS_JSON_DUMP_FLAGS);
    json_decref(v);
    if (rc != 0 || !b.data) {
        rs_buf_free(&b);
        return NULL;
    }
    if (len) *len = b.len;
    return b.data;
}

int rs_json_append(rs_buf *b, const json_t *v) {
    if (!v) return RS_ENOMEM;
    return json_dump_callback(v, buf_add, b, RS_JSON_DUMP_FLAGS) == 0 ? RS_OK : RS_ENOMEM;
}

int rs_json_sse_event(rs_buf *b, json_t *v) {
    if (!v) return RS_ENOMEM;
    size_t mark = b->len;
    int rc = rs_buf_append(b, "data: ", 6);
    if (rc == RS_OK) rc = rs_json_append(b, v);
    if (rc == RS_OK) rc = rs_buf_append(b, "\n\n", 2);
    json_decref(v);
    if (rc != RS_OK) { /* never leave half an event */
        b->len = mark;
        if (b->data) b->data[mark] = '\0';
    }
    return rc;
}
