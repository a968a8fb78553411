/*
 * json_util.c — field readers and writers shared by the protocol/ modules (see json_util.h).
 */
#include "json_util.h"

#include "../tokenizer/unicode.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The path ("text[1]", "sampling_params.stop[0]") of the value that holds byte `at` of a JSON text
 * that is well formed up to there (a string's own bytes belong to it; a key's to the key), for
 * naming the field whose bytes are not UTF-8. Nesting deeper than 16 is named by its first 16. */
static void json_path_at(const char *s, size_t at, char *out, size_t n) {
    struct { bool obj; long idx; char key[48]; } st[16];
    int depth = 0, tracked = 0; /* depth: nesting; tracked: frames kept (<= 16) */
    bool in_str = false, esc = false, is_key = false, want_key = false;
    size_t klen = 0;
    for (size_t i = 0; i < at; i++) {
        char c = s[i];
        if (in_str) {
            if (esc) esc = false;
            else if (c == '\\') esc = true;
            else if (c == '"') in_str = false;
            else if (is_key && klen + 1 < sizeof st[0].key) st[tracked - 1].key[klen++] = c;
            if (is_key && tracked > 0) st[tracked - 1].key[klen] = '\0';
            continue;
        }
        bool top_obj = depth > 0 && depth <= 16 && st[depth - 1].obj;
        switch (c) {
        case '{': case '[':
            if (depth < 16) {
                st[depth].obj = c == '{';
                st[depth].idx = 0;
                st[depth].key[0] = '\0';
                tracked = depth + 1;
            }
            depth++;
            want_key = c == '{';
            break;
        case '}': case ']':
            depth--;
            tracked = RS_MIN(depth, 16);
            want_key = false;
            break;
        case ',':
            if (depth > 0 && depth <= 16 && !st[depth - 1].obj) st[depth - 1].idx++;
            want_key = top_obj;
            break;
        case ':': want_key = false; break;
        case '"':
            in_str = true;
            is_key = top_obj && want_key && depth == tracked;
            if (is_key) klen = 0, st[depth - 1].key[0] = '\0';
            break;
        default: break;
        }
    }
    size_t w = 0;
    out[0] = '\0';
    for (int f = 0; f < tracked && w < n; f++) {
        int k = st[f].obj ? snprintf(out + w, n - w, "%s%s", w ? "." : "", st[f].key)
                          : snprintf(out + w, n - w, "[%ld]", st[f].idx);
        if (k < 0) break;
        w += (size_t)k;
    }
    if (w >= n) out[n - 1] = '\0';
}

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
    if (!root && json_error_code(&jerr) == json_error_invalid_utf8) {
        size_t bad = rs_utf8_valid_prefix(body, len);
        if (bad < len) {
            char path[160];
            json_path_at(body, bad, path, sizeof path);
            return rs_error_set(err, RS_EINVAL, path[0] ? path : NULL,
                                "%s is not valid UTF-8 (byte 0x%02x at offset %zu of the body)",
                                path[0] ? path : "the body", (unsigned char)body[bad], bad);
        }
    }
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

bool rs_json_is_int(const json_t *v) {
    if (json_is_integer(v)) return true;
    if (!json_is_real(v)) return false;
    double x = json_real_value(v);
    return x == trunc(x); /* jansson holds no NaN or inf */
}

/* v (rs_json_is_int) as a long long; a real outside long long's range ([-2^63, 2^63)) gives
 * false and the side it is on in *sign, for the caller's range message. */
static bool int_value(const json_t *v, long long *out, int *sign) {
    if (json_is_integer(v)) {
        *out = json_integer_value(v);
        return true;
    }
    double x = json_real_value(v);
    *sign = x < 0 ? -1 : 1;
    if (x >= 0x1p63 || x < -0x1p63) return false;
    *out = (long long)x;
    return true;
}

int rs_json_get_int(const json_t *v, const char *param, long long min, long long max, long long *out,
                    rs_error *err) {
    if (!rs_json_is_int(v)) return rs_json_bad_type(err, param, "an integer", v);
    long long x = 0;
    int sign = 0;
    const bool fits = int_value(v, &x, &sign);
    if (fits && x >= min && x <= max) {
        *out = x;
        return RS_OK;
    }
    char got[64];
    rs_json_describe(v, got, sizeof got); /* as given: 1e+300 */
    if (fits ? x < min : sign < 0)
        return rs_error_set(err, RS_EINVAL, param, "%s must be >= %lld, got %s", param, min, got);
    return rs_error_set(err, RS_EINVAL, param, "%s must be <= %lld, got %s", param, max, got);
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
        long long x = 0;
        int sign = 0;
        const bool is_int = rs_json_is_int(v), fits = is_int && int_value(v, &x, &sign);
        if (!is_int || !fits || x < 0 || x > INT32_MAX) {
            char got[64];
            rs_json_describe(v, got, sizeof got);
            free(ids);
            if (!is_int)
                return rs_error_set(err, RS_EINVAL, param, "%s[%zu] must be an integer token id, got %s", path, i,
                                    got);
            if (fits ? x < 0 : sign < 0)
                return rs_error_set(err, RS_EINVAL, param, "%s[%zu] must be >= 0, got %s", path, i, got);
            return rs_error_set(err, RS_EINVAL, param, "%s[%zu] must be < 2147483648, got %s", path, i, got);
        }
        ids[i] = (int32_t)x;
    }
    *out = ids;
    *n_out = (int)n;
    return RS_OK;
}

int rs_json_get_prompts(const json_t *v, const char *param, rs_gen_job *job, rs_error *err) {
    if (!json_is_array(v)) return rs_json_bad_type(err, param, "a list of token ids or a list of lists", v);
    size_t n = json_array_size(v);
    if (n == 0) return rs_error_set(err, RS_EINVAL, param, "%s must not be empty", param);
    job->batched = json_is_array(json_array_get(v, 0));
    if (!job->batched) {
        job->prompts = rs_xcalloc(1, sizeof(int32_t *));
        job->prompt_lens = rs_xcalloc(1, sizeof(int));
        job->n_prompts = 1;
        return rs_json_get_ids(v, param, param, &job->prompts[0], &job->prompt_lens[0], err);
    }
    if (n > INT_MAX) return rs_error_set(err, RS_EINVAL, param, "%s has too many prompts", param);
    job->prompts = rs_xcalloc(n, sizeof(int32_t *));
    job->prompt_lens = rs_xcalloc(n, sizeof(int));
    job->n_prompts = (int)n; /* entries stay NULL until read, which rs_gen_job_free accepts */
    for (size_t p = 0; p < n; p++) {
        char path[64];
        snprintf(path, sizeof path, "%s[%zu]", param, p);
        const json_t *prompt = json_array_get(v, p);
        if (!json_is_array(prompt)) {
            char want[96];
            snprintf(want, sizeof want, "a list of token ids (%s[0] is a list, so this is a batch)", param);
            return rs_json_bad_type(err, path, want, prompt);
        }
        int rc = rs_json_get_ids(prompt, path, path, &job->prompts[p], &job->prompt_lens[p], err);
        if (rc != RS_OK) return rc;
        if (job->prompt_lens[p] == 0) return rs_error_set(err, RS_EINVAL, path, "%s must not be empty", path);
    }
    return RS_OK;
}

/* One text prompt: encoded into job->prompts[p]. */
static int encode_prompt(const json_t *v, const char *path, const rs_tok *tok, bool add_special, rs_gen_job *job,
                         int p, rs_error *err) {
    if (!json_is_string(v)) return rs_json_bad_type(err, path, "a string", v);
    size_t len = json_string_length(v);
    if (len == 0) return rs_error_set(err, RS_EINVAL, path, "%s must not be empty", path);
    int32_t *ids;
    size_t n;
    rs_error e = {0};
    if (rs_tok_encode(tok, json_string_value(v), len, add_special, &ids, &n, &e) != RS_OK)
        return rs_error_set(err, RS_EINVAL, path, "%s: %s", path, e.message);
    if (n > INT_MAX) {
        free(ids);
        return rs_error_set(err, RS_EINVAL, path, "%s has too many tokens", path);
    }
    job->prompts[p] = ids;
    job->prompt_lens[p] = (int)n;
    return RS_OK;
}

int rs_json_get_text_prompts(const json_t *v, const char *param, const rs_tok *tok, bool add_special,
                             rs_gen_job *job, rs_error *err) {
    if (!json_is_string(v) && !json_is_array(v)) return rs_json_bad_type(err, param, "a string or a list of strings", v);
    size_t n = json_is_array(v) ? json_array_size(v) : 1;
    if (n == 0) return rs_error_set(err, RS_EINVAL, param, "%s must not be empty", param);
    if (n > INT_MAX) return rs_error_set(err, RS_EINVAL, param, "%s has too many prompts", param);
    job->batched = json_is_array(v);
    job->prompts = rs_xcalloc(n, sizeof(int32_t *));
    job->prompt_lens = rs_xcalloc(n, sizeof(int));
    job->n_prompts = (int)n; /* entries stay NULL until read, which rs_gen_job_free accepts */
    if (!job->batched) return encode_prompt(v, param, tok, add_special, job, 0, err);
    for (size_t p = 0; p < n; p++) {
        char path[96];
        snprintf(path, sizeof path, "%s[%zu]", param, p);
        int rc = encode_prompt(json_array_get(v, p), path, tok, add_special, job, (int)p, err);
        if (rc != RS_OK) return rc;
    }
    return RS_OK;
}

int rs_json_read_stops(const json_t *v, const char *param, rs_gen_text *t, bool regex, rs_error *err) {
    int (*add)(rs_gen_text *, const char *, size_t, const char *, rs_error *) =
        regex ? rs_gen_text_add_stop_regex : rs_gen_text_add_stop;
    if (json_is_string(v)) return add(t, json_string_value(v), json_string_length(v), param, err);
    if (!json_is_array(v)) return rs_json_bad_type(err, param, "a string or a list of strings", v);
    for (size_t i = 0; i < json_array_size(v); i++) {
        char path[96];
        snprintf(path, sizeof path, "%s[%zu]", param, i);
        const json_t *e = json_array_get(v, i);
        if (!json_is_string(e)) return rs_json_bad_type(err, path, "a string", e);
        int rc = add(t, json_string_value(e), json_string_length(e), path, err);
        if (rc != RS_OK) return rc;
    }
    return RS_OK;
}

json_t *rs_json_token_text(const rs_tok *tok, int32_t id) {
    size_t n;
    char *t = rs_tok_token_text(tok, id, &n);
    json_t *v = json_stringn(t, n);
    free(t);
    return v ? v : json_null();
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

/* ---------------------------------------------------------------- the table walker */

static const char *type_want(rs_jtype t) {
    switch (t) {
    case RS_JT_BOOL: return "true or false";
    case RS_JT_INT: return "an integer";
    case RS_JT_FLOAT:
    case RS_JT_NUMBER: return "a number";
    case RS_JT_STRING:
    case RS_JT_TEXT:
    case RS_JT_ENUM: return "a string";
    case RS_JT_IDS: return "a list of token ids";
    case RS_JT_OBJECT:
    case RS_JT_MAP: return "an object";
    case RS_JT_LIST: return "a list";
    case RS_JT_STRINGS: return "a string or a list of strings";
    case RS_JT_CUSTOM:
    case RS_JT_ANY: break;
    }
    return "a JSON value";
}

static bool all_strings(const json_t *v) {
    if (!json_is_array(v)) return false;
    for (size_t i = 0; i < json_array_size(v); i++)
        if (!json_is_string(json_array_get(v, i))) return false;
    return true;
}

int rs_json_check_type(rs_jtype t, const json_t *v, const char *param, rs_error *err) {
    bool ok = true;
    switch (t) {
    case RS_JT_BOOL: ok = json_is_boolean(v); break;
    case RS_JT_INT: ok = rs_json_is_int(v); break;
    case RS_JT_FLOAT:
    case RS_JT_NUMBER: ok = json_is_number(v); break;
    case RS_JT_STRING:
    case RS_JT_TEXT:
    case RS_JT_ENUM: ok = json_is_string(v); break;
    case RS_JT_IDS:
    case RS_JT_LIST: ok = json_is_array(v); break;
    case RS_JT_OBJECT:
    case RS_JT_MAP: ok = json_is_object(v); break;
    case RS_JT_STRINGS: ok = json_is_string(v) || all_strings(v); break;
    case RS_JT_CUSTOM:
    case RS_JT_ANY: break;
    }
    return ok ? RS_OK : rs_json_bad_type(err, param, type_want(t), v);
}

/* One neutral literal s[0..n) against v. A literal the table cannot mean is a bug in the table. */
static bool neutral_is(const json_t *v, const char *s, size_t n) {
    if (n == 4 && strncmp(s, "true", n) == 0) return json_is_true(v);
    if (n == 5 && strncmp(s, "false", n) == 0) return json_is_false(v);
    if (n == 4 && strncmp(s, "null", n) == 0) return json_is_null(v);
    if (n == 2 && strncmp(s, "[]", n) == 0) return json_is_array(v) && json_array_size(v) == 0;
    if (n == 2 && strncmp(s, "{}", n) == 0) return json_is_object(v) && json_object_size(v) == 0;
    if (n == 2 && strncmp(s, "\"\"", n) == 0) return json_is_string(v) && json_string_length(v) == 0;
    char num[32];
    RS_ASSERT(n > 0 && n < sizeof num);
    memcpy(num, s, n);
    num[n] = '\0';
    char *end;
    double x = strtod(num, &end);
    RS_ASSERT(end != num && *end == '\0');
    return json_is_number(v) && json_number_value(v) == x;
}

bool rs_json_neutral(const json_t *v, const char *neutral) {
    if (json_is_null(v)) return true;
    for (const char *p = neutral ? neutral : ""; *p;) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (neutral_is(v, p, n)) return true;
        if (!bar) break;
        p = bar + 1;
    }
    return false;
}

/* v as a message quotes it: numbers and literals by value, strings quoted (cut at 40 bytes,
 * control characters as '?'), containers by kind and size. */
static void describe_quoted(const json_t *v, char *buf, size_t n) {
    if (json_is_string(v)) {
        char s[44];
        size_t len = RS_MIN(json_string_length(v), (size_t)40), o = 0;
        const char *in = json_string_value(v);
        for (size_t i = 0; i < len; i++) s[o++] = (unsigned char)in[i] < 0x20 || in[i] == 0x7f ? '?' : in[i];
        s[o] = '\0';
        snprintf(buf, n, "'%s%s'", s, json_string_length(v) > 40 ? "..." : "");
    } else if (json_is_array(v)) {
        snprintf(buf, n, "a list of %zu entr%s", json_array_size(v), json_array_size(v) == 1 ? "y" : "ies");
    } else if (json_is_object(v)) {
        snprintf(buf, n, "an object with %zu key%s", json_object_size(v), json_object_size(v) == 1 ? "" : "s");
    } else {
        rs_json_describe(v, buf, n);
    }
}

/* "null, false" from the neutral list "false". */
static void neutral_list(const char *neutral, char *buf, size_t n) {
    size_t o = (size_t)snprintf(buf, n, "null");
    for (const char *p = neutral ? neutral : ""; *p && o < n;) {
        const char *bar = strchr(p, '|');
        int len = bar ? (int)(bar - p) : (int)strlen(p);
        o += (size_t)snprintf(buf + o, n - o, ", %.*s", len, p);
        if (!bar) break;
        p = bar + 1;
    }
}

int rs_json_not_implemented(rs_error *err, const char *param, const rs_jfield *f, const json_t *v) {
    char got[80], ok[96];
    describe_quoted(v, got, sizeof got);
    neutral_list(f->neutral, ok, sizeof ok);
    return rs_error_set(err, RS_EUNSUPPORTED, param, "%s is not supported: it is not implemented in rolloutd (%s); "
                        "accepted: %s; got %s", param, f->doc ? f->doc : "", ok, got);
}

void *rs_json_dst(const rs_jctx *c) { return (char *)c->dst[c->f->base] + c->f->offset; }

static long long int_bound(double x) {
    if (x <= (double)LLONG_MIN) return LLONG_MIN;
    if (x >= 0x1p63) return LLONG_MAX;
    return (long long)x;
}

static int read_int(const rs_jctx *c, const json_t *v, rs_error *err) {
    const rs_jfield *f = c->f;
    long long x;
    int rc = rs_json_get_int(v, c->param, int_bound(f->min), int_bound(f->max), &x, err);
    if (rc != RS_OK) return rc;
    if (x == 0 && (f->flags & RS_JF_NOT_ZERO))
        return rs_error_set(err, RS_EINVAL, c->param, "%s must be -1 (off) or >= 1, got 0", c->param);
    if (x == 0 && (f->flags & RS_JF_ZERO_OFF)) x = -1;
    if (f->size == sizeof(int)) *(int *)rs_json_dst(c) = (int)x;
    else *(long long *)rs_json_dst(c) = x;
    return RS_OK;
}

/* The range of a FLOAT field, as a message shows it: ">= 0", "in (0, 1]", "<= 2". */
static void float_range(const rs_jfield *f, char *buf, size_t n) {
    bool lo = isfinite(f->min), hi = isfinite(f->max);
    if (lo && hi)
        snprintf(buf, n, "in %c%g, %g%c", f->flags & RS_JF_MIN_OPEN ? '(' : '[', f->min, f->max,
                 f->flags & RS_JF_MAX_OPEN ? ')' : ']');
    else if (lo) snprintf(buf, n, "%s %g", f->flags & RS_JF_MIN_OPEN ? ">" : ">=", f->min);
    else if (hi) snprintf(buf, n, "%s %g", f->flags & RS_JF_MAX_OPEN ? "<" : "<=", f->max);
    else snprintf(buf, n, "finite");
}

static int read_float(const rs_jctx *c, const json_t *v, rs_error *err) {
    const rs_jfield *f = c->f;
    double x;
    int rc = rs_json_get_float(v, c->param, &x, err);
    if (rc != RS_OK) return rc;
    /* the range holds for the number given and for the value stored: one that an fp32 destination
     * rounds out of the range (3e-258 to 0 for a range open at 0) is refused like that value */
    const double xs = f->size == sizeof(float) ? (double)(float)x : x;
    bool lo = f->flags & RS_JF_MIN_OPEN ? x > f->min && xs > f->min : x >= f->min && xs >= f->min;
    bool hi = f->flags & RS_JF_MAX_OPEN ? x < f->max && xs < f->max : x <= f->max && xs <= f->max;
    if (!lo || !hi) {
        char range[64];
        float_range(f, range, sizeof range);
        char got[32]; /* as sent: %g would print 1.00000001 as 1, "must be in (0, 1], got 1" */
        snprintf(got, sizeof got, "%.15g", x);
        if (strtod(got, NULL) != x) snprintf(got, sizeof got, "%.17g", x);
        return rs_error_set(err, RS_EINVAL, c->param, "%s must be %s, got %s", c->param, range, got);
    }
    if (f->size == sizeof(float)) *(float *)rs_json_dst(c) = (float)x;
    else *(double *)rs_json_dst(c) = x;
    return RS_OK;
}

static int read_enum(const rs_jctx *c, const json_t *v, rs_error *err) {
    const char *s = json_string_value(v);
    size_t len = json_string_length(v);
    int i = 0;
    for (const char *p = c->f->choices;; i++) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (n == len && strncmp(p, s, n) == 0) {
            *(int *)rs_json_dst(c) = i;
            return RS_OK;
        }
        if (!bar) break;
        p = bar + 1;
    }
    char want[160];
    size_t o = 0;
    for (const char *p = c->f->choices; *p && o < sizeof want;) {
        const char *bar = strchr(p, '|');
        int n = bar ? (int)(bar - p) : (int)strlen(p);
        o += (size_t)snprintf(want + o, sizeof want - o, "%s'%.*s'", o ? ", " : "", n, p);
        if (!bar) break;
        p = bar + 1;
    }
    return rs_error_set(err, RS_EINVAL, c->param, "%s must be one of %s, got '%.64s'", c->param, want, s);
}

static int read_value(const rs_jctx *c, const json_t *v, rs_error *err) {
    const rs_jfield *f = c->f;
    int rc;
    switch (f->type) {
    case RS_JT_BOOL:
        if ((rc = rs_json_get_bool(v, c->param, (bool *)rs_json_dst(c), err)) != RS_OK) return rc;
        return RS_OK;
    case RS_JT_INT: return read_int(c, v, err);
    case RS_JT_FLOAT: return read_float(c, v, err);
    case RS_JT_STRING:
        RS_ASSERT(f->size > 1);
        if ((rc = rs_json_check_name(v, c->param, f->size - 1, err)) != RS_OK) return rc;
        memcpy(rs_json_dst(c), json_string_value(v), json_string_length(v) + 1);
        return RS_OK;
    case RS_JT_ENUM: return read_enum(c, v, err);
    case RS_JT_IDS: {
        int32_t **ids = (int32_t **)rs_json_dst(c);
        int *n = (int *)((char *)c->dst[f->base] + f->offset2);
        free(*ids);
        *ids = NULL;
        *n = 0;
        return rs_json_get_ids(v, c->param, c->param, ids, n, err);
    }
    case RS_JT_OBJECT: return rs_json_read(v, f->sub, c->dst, c->param, err);
    default: break;
    }
    RS_ASSERT(!"a READ field of a check-only type");
    return RS_EINTERNAL;
}

static int read_field(const rs_jctx *c, const json_t *v, rs_error *err) {
    const rs_jfield *f = c->f;
    if (f->type == RS_JT_CUSTOM) return f->read(c, v, err); /* it applies the row's use itself */
    int rc = rs_json_check_type(f->type, v, c->param, err);
    if (rc != RS_OK) return rc;
    switch (f->use) {
    case RS_JU_READ: return read_value(c, v, err);
    case RS_JU_NO_EFFECT: return RS_OK;
    case RS_JU_NEUTRAL: return rs_json_neutral(v, f->neutral) ? RS_OK : rs_json_not_implemented(err, c->param, f, v);
    case RS_JU_ELSEWHERE: break;
    }
    RS_ASSERT(!"unreachable field use");
    return RS_EINTERNAL;
}

static void param_of(char *buf, size_t n, const char *prefix, const char *name) {
    snprintf(buf, n, "%s%s%.150s", prefix, prefix[0] ? "." : "", name);
}

/* Two rows that write the same destination (a name and its alias): only one may be given. */
static bool same_destination(const rs_jfield *a, const rs_jfield *b) {
    return a->use == RS_JU_READ && b->use == RS_JU_READ && a->type != RS_JT_CUSTOM && b->type != RS_JT_CUSTOM &&
           a->type != RS_JT_OBJECT && a->base == b->base && a->offset == b->offset;
}

int rs_json_read(const json_t *obj, const rs_jobject *t, void *const *dst, const char *prefix, rs_error *err) {
    if (!json_is_object(obj)) return rs_json_bad_type(err, prefix[0] ? prefix : "the request body", "an object", obj);
    RS_ASSERT(t->n <= RS_JOBJECT_MAX_FIELDS);
    const json_t *val[RS_JOBJECT_MAX_FIELDS] = {0};
    bool seen[RS_JOBJECT_MAX_FIELDS] = {0};
    char param[200];
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)obj, key, v) {
        size_t i = 0;
        while (i < t->n && strcmp(t->fields[i].name, key) != 0) i++;
        if (i == t->n || t->fields[i].use == RS_JU_ELSEWHERE) {
            const char *hint = i < t->n ? t->fields[i].doc : t->unknown_hint;
            param_of(param, sizeof param, prefix, key);
            return rs_error_set(err, RS_EINVAL, param, "unknown field '%s'%s%s%s", param, hint ? " (" : "",
                                hint ? hint : "", hint ? ")" : "");
        }
        seen[i] = true;
        val[i] = json_is_null(v) ? NULL : v;
    }
    for (size_t i = 0; i < t->n; i++) {
        for (size_t j = 0; val[i] && j < i; j++) {
            if (!val[j] || !same_destination(&t->fields[i], &t->fields[j])) continue;
            param_of(param, sizeof param, prefix, t->fields[i].name);
            return rs_error_set(err, RS_EINVAL, param, "%s and %s name the same field: give one of them", param,
                                t->fields[j].name);
        }
    }
    for (size_t i = 0; i < t->n; i++) {
        const rs_jfield *f = &t->fields[i];
        if (f->use == RS_JU_ELSEWHERE) continue;
        param_of(param, sizeof param, prefix, f->name);
        rs_jctx c = {.dst = dst, .f = f, .param = param};
        int rc = RS_OK;
        if (val[i]) rc = read_field(&c, val[i], err);
        else if (f->flags & RS_JF_REQUIRED) rc = rs_error_set(err, RS_EINVAL, param, "%s is required", param);
        else if (seen[i] && (f->flags & RS_JF_READ_NULL)) rc = f->read(&c, json_object_get(obj, f->name), err);
        if (rc != RS_OK) return rc;
    }
    return RS_OK;
}

/* ---------------------------------------------------------------- the field reference */

/* s with '|' escaped for a markdown cell. */
static void cell(FILE *out, const char *s) {
    for (; s && *s; s++) {
        if (*s == '|') fputs("\\|", out);
        else if (*s == '\n') fputc(' ', out);
        else fputc(*s, out);
    }
}

static void print_shape(FILE *out, const rs_jfield *f) {
    char range[64] = "";
    switch (f->type) {
    case RS_JT_BOOL: fputs("boolean", out); return;
    case RS_JT_INT:
        if (f->use != RS_JU_READ) {
            fputs("integer", out);
            return;
        }
        if (f->max < (double)INT_MAX) snprintf(range, sizeof range, " in [%.0f, %.0f]", f->min, f->max);
        else if (f->min > (double)INT_MIN) snprintf(range, sizeof range, " >= %.0f", f->min);
        fprintf(out, "integer%s%s", range, f->flags & RS_JF_NOT_ZERO ? ", not 0" : "");
        return;
    case RS_JT_FLOAT:
        if (f->use != RS_JU_READ) {
            fputs("number", out);
            return;
        }
        float_range(f, range, sizeof range);
        fprintf(out, "number %s", range);
        return;
    case RS_JT_STRING: fprintf(out, "string (1..%zu bytes)", f->size - 1); return;
    case RS_JT_ENUM:
        for (const char *p = f->choices; *p;) {
            const char *bar = strchr(p, '|');
            int n = bar ? (int)(bar - p) : (int)strlen(p);
            fprintf(out, "%s`\"%.*s\"`", p == f->choices ? "" : " \\| ", n, p);
            if (!bar) break;
            p = bar + 1;
        }
        return;
    case RS_JT_IDS: fputs("list of token ids", out); return;
    case RS_JT_OBJECT: fputs("object", out); return;
    case RS_JT_CUSTOM: cell(out, f->shape); return;
    case RS_JT_NUMBER: fputs("number", out); return;
    case RS_JT_TEXT: fputs("string", out); return;
    case RS_JT_LIST: fputs("list", out); return;
    case RS_JT_MAP: fputs("object", out); return;
    case RS_JT_STRINGS: fputs("string or list of strings", out); return;
    case RS_JT_ANY: fputs("any", out); return;
    }
}

static void print_status(FILE *out, const rs_jfield *f) {
    char ok[96];
    switch (f->use) {
    case RS_JU_READ: fputs("implemented", out); break;
    case RS_JU_NO_EFFECT: fputs("accepted, no effect", out); break;
    case RS_JU_NEUTRAL:
        neutral_list(f->neutral, ok, sizeof ok);
        fputs("not implemented; accepts ", out);
        cell(out, ok);
        break;
    case RS_JU_ELSEWHERE: fputs("not a field here", out); break;
    }
    if (f->flags & RS_JF_TOKENIZER) fputs(" (text: needs the model's tokenizer.json)", out);
}

static void print_one(FILE *out, const rs_jobject *t) {
    fprintf(out, "### %s\n\n| field | type | default | status | notes |\n|---|---|---|---|---|\n", t->title);
    for (size_t i = 0; i < t->n; i++) {
        const rs_jfield *f = &t->fields[i];
        if (f->use == RS_JU_ELSEWHERE) continue;
        fprintf(out, "| `%s`%s | ", f->name, f->flags & RS_JF_REQUIRED ? " (required)" : "");
        print_shape(out, f);
        fputs(" | ", out);
        if (f->def) {
            fputc('`', out);
            cell(out, f->def);
            fputc('`', out);
        }
        fputs(" | ", out);
        print_status(out, f);
        fputs(" | ", out);
        cell(out, f->doc);
        fputs(" |\n", out);
    }
    fputc('\n', out);
}

void rs_json_print_table(FILE *out, const rs_jobject *t) {
    print_one(out, t);
    for (size_t i = 0; i < t->n; i++)
        if (t->fields[i].sub && t->fields[i].use != RS_JU_ELSEWHERE) rs_json_print_table(out, t->fields[i].sub);
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

/* ---------------------------------------------------------------- JSON Schema */

/* A JSON literal of a table (a neutral value): the tables are constants, so text that does not
 * parse is a bug in one of them. */
static json_t *literal(const char *s, size_t n) {
    json_error_t je;
    json_t *v = json_loadb(s, n, JSON_DECODE_ANY, &je);
    RS_ASSERT(v && "a table's JSON literal does not parse");
    return v;
}

/* The walker's check of a name-like string (rs_json_check_name) as a pattern. */
#define NAME_PATTERN "^[^\\u0000-\\u001f\\u007f]*$"

static json_t *schema_of_type(const char *type) { return json_pack("{s:s}", "type", type); }

/* A number bound as JSON: an integer where the bound is one (INT_MAX stays 2147483647). */
static json_t *bound(double x) {
    if (x == nearbyint(x) && fabs(x) < 0x1p53) return json_integer((json_int_t)x);
    return json_real(x);
}

/* A list of token ids (non_empty: at least one), below the vocabulary where lim gives it. */
static json_t *ids_schema(bool non_empty, const rs_jlimits *lim) {
    const long long top = lim && lim->vocab > 0 ? RS_MIN(lim->vocab - 1, (long long)INT32_MAX) : INT32_MAX;
    json_t *s = json_pack("{s:s, s:{s:s, s:i, s:I}}", "type", "array", "items", "type", "integer", "minimum", 0,
                          "maximum", (json_int_t)top);
    if (s && non_empty) json_object_set_new(s, "minItems", json_integer(1));
    return s;
}

/* v (stolen) with the shorthands of rs_jfield.schema ($sub, $ids, $ids1, $name) expanded. */
static json_t *expand_shorthands(json_t *v, const rs_jobject *sub, const rs_jlimits *lim) {
    if (json_is_string(v) && json_string_value(v)[0] == '$') {
        const char *s = json_string_value(v);
        json_t *r = strcmp(s, "$ids") == 0 || strcmp(s, "$ids1") == 0 ? ids_schema(s[4] == '1', lim)
                    : strcmp(s, "$name") == 0                          ? json_string(NAME_PATTERN)
                                                                       : NULL;
        if (strcmp(s, "$sub") == 0) {
            RS_ASSERT(sub && "a schema names $sub in a row without one");
            r = rs_json_schema(sub, lim);
        }
        RS_ASSERT(r && "an unknown shorthand in a row's schema");
        json_decref(v);
        return r;
    }
    if (json_is_object(v)) {
        const char *k;
        json_t *e;
        json_object_foreach(v, k, e) json_object_set_new(v, k, expand_shorthands(json_incref(e), sub, lim));
    } else if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++)
            json_array_set_new(v, i, expand_shorthands(json_incref(json_array_get(v, i)), sub, lim));
    }
    return v;
}

json_t *rs_json_quoted(const char *text) {
    char *t = rs_xstrdup(text);
    for (char *p = t; *p; p++)
        if (*p == '\'') *p = '"';
    json_t *v = literal(t, strlen(t));
    free(t);
    return v;
}

/* The maximum of an integer schema s lowered to row f's server limit, where lim gives one. */
static void apply_limit(json_t *s, const rs_jfield *f, const rs_jlimits *lim) {
    if (!s || !lim || f->limit == RS_JL_NONE) return;
    RS_ASSERT(f->limit < RS_JL_COUNT && json_is_integer(json_object_get(s, "maximum")) &&
              "a limit on a row whose schema is not a bounded integer");
    const long long top = RS_MIN(json_integer_value(json_object_get(s, "maximum")), lim->max[f->limit]);
    json_object_set_new(s, "maximum", json_integer(top));
}

/* A CUSTOM row's schema, its shorthands expanded. */
static json_t *row_schema(const rs_jfield *f, const rs_jlimits *lim) {
    RS_ASSERT(f->schema && "a CUSTOM row without a schema");
    json_t *s = expand_shorthands(rs_json_quoted(f->schema), f->sub, lim);
    apply_limit(s, f, lim);
    return s;
}

/* [first, item(a), item(b), ...] for the "a|b|..." list of a table (first: NULL for none; stolen). */
static json_t *each_of(const char *list, json_t *(*item)(const char *, size_t), json_t *first) {
    json_t *a = json_array();
    if (first) json_array_append_new(a, first);
    for (const char *p = list ? list : ""; *p;) {
        const size_t n = strcspn(p, "|");
        json_array_append_new(a, item(p, n));
        p += n + (p[n] == '|');
    }
    return a;
}

/* The schema of an object in which field name[0..n) is given and not null (null is the default,
 * as absent). */
static json_t *given(const char *name, size_t n) {
    return json_pack("{s:[s%], s:{s%:{s:{s:s}}}}", "required", name, n, "properties", name, n, "not", "type", "null");
}

/* The value of a field, null aside. */
static json_t *field_value_schema(const rs_jfield *f, const rs_jlimits *lim) {
    json_t *s = NULL;
    const bool read = f->use == RS_JU_READ;
    switch (f->type) {
    case RS_JT_BOOL: return schema_of_type("boolean");
    case RS_JT_INT:
        s = schema_of_type("integer");
        if (read) {
            json_object_set_new(s, "minimum", bound(RS_MAX(f->min, -0x1p63)));
            json_object_set_new(s, "maximum", bound(RS_MIN(f->max, 0x1p63 - 1024)));
            if (f->flags & RS_JF_NOT_ZERO) json_object_set_new(s, "not", json_pack("{s:i}", "const", 0));
            apply_limit(s, f, lim);
        }
        return s;
    case RS_JT_FLOAT:
        s = schema_of_type("number");
        if (read) {
            /* finite and within fp32, and the table's range as read_float checks it; a range open at 0
             * for an fp32 destination starts past 2^-150, the largest number fp32 rounds to 0 */
            double lo = RS_MAX(f->min, -FLT_MAX), hi = RS_MIN(f->max, FLT_MAX);
            const bool lo_open = f->flags & RS_JF_MIN_OPEN && lo == f->min;
            const bool hi_open = f->flags & RS_JF_MAX_OPEN && hi == f->max;
            RS_ASSERT((!lo_open || lo == 0) && !hi_open); /* the only open bound the tables have */
            if (lo_open && f->size == sizeof(float)) lo = 0x1p-150;
            json_object_set_new(s, lo_open ? "exclusiveMinimum" : "minimum", bound(lo));
            json_object_set_new(s, hi_open ? "exclusiveMaximum" : "maximum", bound(hi));
        }
        return s;
    case RS_JT_STRING:
        /* maxLength counts characters where the walker counts bytes: a bound the walker's implies */
        return json_pack("{s:s, s:i, s:I, s:s}", "type", "string", "minLength", 1, "maxLength",
                         (json_int_t)(f->size - 1), "pattern", NAME_PATTERN);
    case RS_JT_ENUM: return json_pack("{s:s, s:o}", "type", "string", "enum", each_of(f->choices, json_stringn, NULL));
    case RS_JT_IDS: return ids_schema(false, lim);
    case RS_JT_OBJECT: return rs_json_schema(f->sub, lim);
    case RS_JT_CUSTOM: return row_schema(f, lim);
    case RS_JT_NUMBER: return schema_of_type("number");
    case RS_JT_TEXT: return schema_of_type("string");
    case RS_JT_LIST: return schema_of_type("array");
    case RS_JT_MAP: return schema_of_type("object");
    case RS_JT_STRINGS:
        return json_pack("{s:[{s:s}, {s:s, s:{s:s}}]}", "anyOf", "type", "string", "type", "array", "items", "type",
                         "string");
    case RS_JT_ANY: return json_object();
    }
    RS_ASSERT(!"unknown field type");
    return NULL;
}

static json_t *field_schema(const rs_jfield *f, const rs_jlimits *lim) {
    json_t *s;
    if (f->use == RS_JU_NEUTRAL && f->type != RS_JT_CUSTOM) {
        /* null and the neutral values (a CUSTOM row's schema says what its reader accepts) */
        s = json_pack("{s:o}", "enum", each_of(f->neutral, literal, json_null()));
    } else {
        s = field_value_schema(f, lim);
        if (!(f->flags & RS_JF_REQUIRED)) s = json_pack("{s:[o, {s:s}]}", "anyOf", s, "type", "null");
    }
    if (!s) return NULL;
    char desc[1024];
    int o = snprintf(desc, sizeof desc, "%s", f->doc ? f->doc : "");
    if (f->def && o >= 0 && (size_t)o < sizeof desc)
        o += snprintf(desc + o, sizeof desc - (size_t)o, "%sdefault: %s", o ? "; " : "", f->def);
    if (f->use == RS_JU_NO_EFFECT && o >= 0 && (size_t)o < sizeof desc)
        snprintf(desc + o, sizeof desc - (size_t)o, "%saccepted, no effect", o ? "; " : "");
    if (f->use == RS_JU_NEUTRAL && o >= 0 && (size_t)o < sizeof desc)
        snprintf(desc + o, sizeof desc - (size_t)o, "%snot implemented: other values are a 400", o ? "; " : "");
    if (desc[0]) json_object_set_new(s, "description", json_string(desc));
    return s;
}

json_t *rs_json_schema(const rs_jobject *t, const rs_jlimits *lim) {
    json_t *props = json_object(), *req = json_array();
    for (size_t i = 0; i < t->n; i++) {
        const rs_jfield *f = &t->fields[i];
        if (f->use == RS_JU_ELSEWHERE) continue;
        json_object_set_new(props, f->name, field_schema(f, lim));
        if (f->flags & RS_JF_REQUIRED) json_array_append_new(req, json_string(f->name));
    }
    json_t *s = json_pack("{s:s, s:s, s:o, s:b}", "title", t->title, "type", "object", "properties", props,
                          "additionalProperties", 0);
    if (s && json_array_size(req)) json_object_set_new(s, "required", req);
    else json_decref(req);
    if (s && t->one_of) json_object_set_new(s, "oneOf", each_of(t->one_of, given, NULL));
    if (s && t->schema_also) {
        json_t *also = rs_json_quoted(t->schema_also);
        json_object_update_missing(s, also); /* rules between fields, never a field's own schema */
        json_decref(also);
    }
    return s;
}
