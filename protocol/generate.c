/*
 * generate.c — the /generate request parser and response writer (see generate.h).
 *
 * Parsing walks the JSON objects key by key rather than through one json_unpack format: that way
 * an unknown key is reported by name, and every type or range error names the exact field and
 * quotes the value. Top-level fields are collected first and then checked in a fixed order
 * (input_ids, rid, sampling_params, ...), so the error a bad request gets does not depend on the
 * order of its keys. Anything a request allocates is bounded by its body size, which the server
 * caps before calling in.
 *
 * The response is written one output at a time (each output's JSON tree is built, dumped and
 * freed before the next), so peak memory is one output's tree plus the text, not the whole batch.
 */
#include "generate.h"

#include <float.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- field readers */

/* A JSON value as a message shows it: numbers and literals by value, containers by kind. */
static void describe(const json_t *v, char *buf, size_t n) {
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

static int bad_type(rs_error *err, const char *param, const char *want, const json_t *v) {
    char got[64];
    describe(v, got, sizeof got);
    return rs_error_set(err, RS_EINVAL, param, "%s must be %s, got %s", param, want, got);
}

static int get_int(const json_t *v, const char *param, long long min, long long max, long long *out,
                   rs_error *err) {
    if (!json_is_integer(v)) return bad_type(err, param, "an integer", v);
    long long x = json_integer_value(v);
    if (x < min) return rs_error_set(err, RS_EINVAL, param, "%s must be >= %lld, got %lld", param, min, x);
    if (x > max) return rs_error_set(err, RS_EINVAL, param, "%s must be <= %lld, got %lld", param, max, x);
    *out = x;
    return RS_OK;
}

/* An int or a real (jansson already rejects NaN, inf and reals that overflow a double); also
 * bounded to what a float holds, since sampling parameters are stored as float. */
static int get_float(const json_t *v, const char *param, double *out, rs_error *err) {
    if (!json_is_number(v)) return bad_type(err, param, "a number", v);
    double x = json_number_value(v);
    if (!isfinite(x) || fabs(x) > FLT_MAX)
        return rs_error_set(err, RS_EINVAL, param, "%s is out of range, got %g", param, x);
    *out = x;
    return RS_OK;
}

static int get_bool(const json_t *v, const char *param, bool *out, rs_error *err) {
    if (!json_is_boolean(v)) return bad_type(err, param, "true or false", v);
    *out = json_is_true(v);
    return RS_OK;
}

/* A list of token ids into a new int32 array (*out may be NULL when the list is empty). `param`
 * is what err names; `path` is how messages name the list ("input_ids[2]"). */
static int get_ids(const json_t *arr, const char *param, const char *path, int32_t **out, int *n_out,
                   rs_error *err) {
    if (!json_is_array(arr)) return bad_type(err, path, "a list of token ids", arr);
    size_t n = json_array_size(arr);
    if (n > INT_MAX) return rs_error_set(err, RS_EINVAL, param, "%s has too many tokens", path);
    int32_t *ids = n ? malloc(sizeof(int32_t) * n) : NULL;
    if (n && !ids) return rs_error_set(err, RS_ENOMEM, param, "out of memory reading %s", path);
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(arr, i);
        int rc = RS_OK;
        if (!json_is_integer(v)) {
            char got[64];
            describe(v, got, sizeof got);
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

/* A rid: a non-empty string of at most RS_RID_MAX bytes without control characters (it is echoed
 * into logs). */
static int check_rid(const json_t *v, const char *param, rs_error *err) {
    if (!json_is_string(v)) return bad_type(err, param, "a string", v);
    const char *s = json_string_value(v);
    size_t len = json_string_length(v);
    if (len == 0) return rs_error_set(err, RS_EINVAL, param, "%s must not be empty", param);
    if (len > RS_RID_MAX)
        return rs_error_set(err, RS_EINVAL, param, "%s must be at most %d bytes, got %zu", param, RS_RID_MAX, len);
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
            return rs_error_set(err, RS_EINVAL, param, "%s must not contain control characters", param);
    return RS_OK;
}

/* ---------------------------------------------------------------- request parts */

static int parse_input_ids(const json_t *v, rs_gen_job *job, rs_error *err) {
    if (!json_is_array(v)) return bad_type(err, "input_ids", "a list of token ids or a list of lists", v);
    size_t n = json_array_size(v);
    if (n == 0) return rs_error_set(err, RS_EINVAL, "input_ids", "input_ids must not be empty");
    job->batched = json_is_array(json_array_get(v, 0));
    if (!job->batched) {
        job->prompts = rs_xcalloc(1, sizeof(int32_t *));
        job->prompt_lens = rs_xcalloc(1, sizeof(int));
        job->n_prompts = 1;
        return get_ids(v, "input_ids", "input_ids", &job->prompts[0], &job->prompt_lens[0], err);
    }
    if (n > INT_MAX) return rs_error_set(err, RS_EINVAL, "input_ids", "input_ids has too many prompts");
    job->prompts = rs_xcalloc(n, sizeof(int32_t *));
    job->prompt_lens = rs_xcalloc(n, sizeof(int));
    job->n_prompts = (int)n; /* entries stay NULL until read, which rs_gen_job_free accepts */
    for (size_t p = 0; p < n; p++) {
        char path[48];
        snprintf(path, sizeof path, "input_ids[%zu]", p);
        const json_t *prompt = json_array_get(v, p);
        if (!json_is_array(prompt))
            return bad_type(err, path, "a list of token ids (input_ids[0] is a list, so this is a batch)", prompt);
        int rc = get_ids(prompt, path, path, &job->prompts[p], &job->prompt_lens[p], err);
        if (rc != RS_OK) return rc;
        if (job->prompt_lens[p] == 0) return rs_error_set(err, RS_EINVAL, path, "%s must not be empty", path);
    }
    return RS_OK;
}

static int parse_rid(const json_t *v, rs_generate_req *r, rs_error *err) {
    rs_gen_job *job = r->job;
    if (json_is_string(v)) {
        int rc = check_rid(v, "rid", err);
        if (rc != RS_OK) return rc;
        snprintf(job->rid, sizeof job->rid, "%s", json_string_value(v));
        return RS_OK;
    }
    if (!json_is_array(v)) return bad_type(err, "rid", "a string or a list of strings", v);
    if (json_array_size(v) != (size_t)job->n_prompts)
        return rs_error_set(err, RS_EINVAL, "rid", "rid has %zu entries but input_ids has %d prompt%s",
                            json_array_size(v), job->n_prompts, job->n_prompts == 1 ? "" : "s");
    for (int p = 0; p < job->n_prompts; p++) {
        char param[32];
        snprintf(param, sizeof param, "rid[%d]", p);
        int rc = check_rid(json_array_get(v, (size_t)p), param, err);
        if (rc != RS_OK) return rc;
    }
    r->prompt_rids = rs_xcalloc((size_t)job->n_prompts, sizeof(char *));
    for (int p = 0; p < job->n_prompts; p++)
        r->prompt_rids[p] = rs_xstrdup(json_string_value(json_array_get(v, (size_t)p)));
    snprintf(job->rid, sizeof job->rid, "%s", r->prompt_rids[0]); /* names the job in logs */
    return RS_OK;
}

static int parse_sampling(const json_t *obj, rs_sampling_params *sp, rs_error *err) {
    if (!json_is_object(obj)) return bad_type(err, "sampling_params", "an object", obj);
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)obj, key, v) {
        char param[160];
        snprintf(param, sizeof param, "sampling_params.%s", key);
        long long i = 0;
        double f = 0;
        int rc = RS_OK;
        bool known = true, null = json_is_null(v); /* null keeps the default, as in SGLang */
        if (strcmp(key, "max_new_tokens") == 0) {
            if (!null && (rc = get_int(v, param, 0, INT_MAX, &i, err)) == RS_OK) sp->max_new_tokens = (int)i;
        } else if (strcmp(key, "min_new_tokens") == 0) {
            if (!null && (rc = get_int(v, param, 0, INT_MAX, &i, err)) == RS_OK) sp->min_new_tokens = (int)i;
        } else if (strcmp(key, "temperature") == 0) {
            if (!null && (rc = get_float(v, param, &f, err)) == RS_OK) {
                if (f < 0) rc = rs_error_set(err, RS_EINVAL, param, "%s must be >= 0, got %g", param, f);
                else sp->temperature = (float)f;
            }
        } else if (strcmp(key, "top_p") == 0) {
            if (!null && (rc = get_float(v, param, &f, err)) == RS_OK) {
                if (!(f > 0 && f <= 1)) rc = rs_error_set(err, RS_EINVAL, param, "%s must be in (0, 1], got %g", param, f);
                else sp->top_p = (float)f;
            }
        } else if (strcmp(key, "top_k") == 0) {
            if (!null && (rc = get_int(v, param, -1, INT_MAX, &i, err)) == RS_OK) {
                if (i == 0) rc = rs_error_set(err, RS_EINVAL, param, "%s must be -1 (off) or >= 1, got 0", param);
                else sp->top_k = (int)i;
            }
        } else if (strcmp(key, "min_p") == 0) {
            if (!null && (rc = get_float(v, param, &f, err)) == RS_OK) {
                if (!(f >= 0 && f <= 1)) rc = rs_error_set(err, RS_EINVAL, param, "%s must be in [0, 1], got %g", param, f);
                else sp->min_p = (float)f;
            }
        } else if (strcmp(key, "n") == 0) {
            if (!null && (rc = get_int(v, param, 1, INT_MAX, &i, err)) == RS_OK) sp->n = (int)i;
        } else if (strcmp(key, "sampling_seed") == 0) {
            if (!null && (rc = get_int(v, param, 0, LLONG_MAX, &i, err)) == RS_OK) sp->seed = (uint64_t)i;
        } else if (strcmp(key, "stop_token_ids") == 0) {
            if (!null) {
                free(sp->stop_token_ids);
                sp->stop_token_ids = NULL;
                sp->n_stop_token_ids = 0;
                rc = get_ids(v, param, param, &sp->stop_token_ids, &sp->n_stop_token_ids, err);
            }
        } else if (strcmp(key, "ignore_eos") == 0) {
            if (!null) rc = get_bool(v, param, &sp->ignore_eos, err);
        } else {
            known = false;
        }
        if (!known) return rs_error_set(err, RS_EINVAL, param, "unknown field '%s'", param);
        if (rc != RS_OK) return rc;
    }
    return RS_OK;
}

static int parse_logprobs_mode(const json_t *v, rs_logprobs_mode *mode, rs_error *err) {
    if (!json_is_string(v)) return bad_type(err, "logprobs_mode", "a string", v);
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

/* The top-level fields, collected before any is interpreted. */
enum { F_RID, F_INPUT_IDS, F_SAMPLING, F_RETURN_LOGPROB, F_LOGPROB_START, F_TOP_LOGPROBS, F_LOGPROBS_MODE,
       F_STREAM, F_COUNT };
static const char *const top_fields[F_COUNT] = {
    "rid", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "logprobs_mode", "stream",
};

static int parse_fields(json_t *root, rs_generate_req *r, rs_error *err) {
    rs_gen_job *job = r->job;
    const json_t *f[F_COUNT] = {0};
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        int k = 0;
        while (k < F_COUNT && strcmp(key, top_fields[k]) != 0) k++;
        if (k == F_COUNT) {
            if (strcmp(key, "text") == 0)
                return rs_error_set(err, RS_EINVAL, key, "unknown field 'text' (rolloutd takes token ids: use input_ids)");
            return rs_error_set(err, RS_EINVAL, key, "unknown field '%s'", key);
        }
        if (!json_is_null(v)) f[k] = v; /* null = absent = default, as SGLang's optional fields */
    }
    int rc;
    long long i;
    if (!f[F_INPUT_IDS]) return rs_error_set(err, RS_EINVAL, "input_ids", "input_ids is required");
    if ((rc = parse_input_ids(f[F_INPUT_IDS], job, err)) != RS_OK) return rc;
    if (f[F_RID] && (rc = parse_rid(f[F_RID], r, err)) != RS_OK) return rc;
    if (f[F_SAMPLING] && (rc = parse_sampling(f[F_SAMPLING], &job->sp, err)) != RS_OK) return rc;
    if (f[F_RETURN_LOGPROB] && (rc = get_bool(f[F_RETURN_LOGPROB], "return_logprob", &job->return_logprob, err)))
        return rc;
    if (f[F_LOGPROB_START]) {
        if ((rc = get_int(f[F_LOGPROB_START], "logprob_start_len", -1, INT_MAX, &i, err)) != RS_OK) return rc;
        job->logprob_start_len = (int)i;
    }
    if (f[F_TOP_LOGPROBS]) {
        if ((rc = get_int(f[F_TOP_LOGPROBS], "top_logprobs_num", 0, INT_MAX, &i, err)) != RS_OK) return rc;
        job->top_logprobs_num = (int)i; /* the server's cap is checked by rs_gen_job_validate */
    }
    if (f[F_LOGPROBS_MODE] && (rc = parse_logprobs_mode(f[F_LOGPROBS_MODE], &job->logprobs_mode, err)) != RS_OK)
        return rc;
    if (f[F_STREAM]) {
        bool stream = false;
        if ((rc = get_bool(f[F_STREAM], "stream", &stream, err)) != RS_OK) return rc;
        if (stream) return rs_error_set(err, RS_EUNSUPPORTED, "stream", "stream is not supported yet");
    }
    /* As in SGLang, logprob_start_len only means something with return_logprob; without it the
     * engine must not spend a forward row per prompt token on scores nobody receives. */
    if (!job->return_logprob) {
        job->logprob_start_len = -1;
        job->top_logprobs_num = 0;
    }
    return RS_OK;
}

int rs_generate_parse(const char *body, size_t len, rs_generate_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    if (len == 0) return rs_error_set(err, RS_EINVAL, NULL, "request body is empty; expected a JSON object");
    json_error_t jerr;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return rs_error_set(err, RS_EINVAL, NULL, "invalid JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                            jerr.column);
    if (!json_is_object(root)) {
        int rc = bad_type(err, "body", "a JSON object", root);
        err->param[0] = '\0';
        json_decref(root);
        return rc;
    }
    out->job = rs_gen_job_new();
    int rc = parse_fields(root, out, err);
    json_decref(root);
    if (rc != RS_OK) rs_generate_req_free(out);
    return rc;
}

void rs_generate_req_free(rs_generate_req *r) {
    if (r->prompt_rids) {
        for (int p = 0; p < r->job->n_prompts; p++) free(r->prompt_rids[p]);
        free(r->prompt_rids);
    }
    rs_gen_job_free(r->job);
    memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------- response */

void rs_generate_output_id(const rs_generate_req *r, int p, int s, char *buf, size_t n) {
    const rs_gen_job *job = r->job;
    int len;
    if (r->prompt_rids) len = snprintf(buf, n, "%s", r->prompt_rids[p]);
    else if (job->batched) len = snprintf(buf, n, "%s_%d", job->rid, p);
    else len = snprintf(buf, n, "%s", job->rid);
    if (job->sp.n > 1 && len >= 0 && (size_t)len < n) snprintf(buf + len, n - (size_t)len, "_%d", s);
}

/* A logprob as JSON: null when it is not a finite number (the first prompt position has no
 * context; a token sampled with probability 0 would be -inf, which JSON cannot hold). */
static json_t *logprob_json(float lp) { return isfinite(lp) ? json_real((double)lp) : json_null(); }

static json_t *triple(float lp, int32_t id) {
    json_t *t = json_array();
    json_array_append_new(t, logprob_json(lp));
    json_array_append_new(t, json_integer(id));
    json_array_append_new(t, json_null());
    return t;
}

/* [[logprob, id, null], ...] for one position's alternatives; ids of -1 are absent entries. */
static json_t *top_json(const int32_t *ids, const float *lps, int k) {
    json_t *a = json_array();
    for (int j = 0; j < k && ids[j] >= 0; j++) json_array_append_new(a, triple(lps[j], ids[j]));
    return a;
}

static json_t *finish_json(const rs_finish *f) {
    switch (f->type) {
    case RS_FINISH_STOP: return json_pack("{s:s,s:i}", "type", "stop", "matched", (int)f->matched);
    case RS_FINISH_LENGTH: return json_pack("{s:s,s:i}", "type", "length", "length", f->length);
    case RS_FINISH_ABORT: return json_pack("{s:s,s:s}", "type", "abort", "message", f->message);
    case RS_FINISH_NONE: break;
    }
    return json_null();
}

static json_t *output_json(const rs_generate_req *r, int p, int s) {
    const rs_gen_job *job = r->job;
    const rs_gen_output *o = &job->outputs[p * job->sp.n + s];
    char id[RS_RID_MAX + 32];
    rs_generate_output_id(r, p, s, id, sizeof id);

    json_t *ids = json_array();
    for (int i = 0; i < o->n_output; i++) json_array_append_new(ids, json_integer(o->output_ids[i]));

    json_t *meta = json_object();
    json_object_set_new(meta, "id", json_string(id));
    json_object_set_new(meta, "finish_reason", finish_json(&o->finish));
    json_object_set_new(meta, "prompt_tokens", json_integer(o->prompt_tokens));
    json_object_set_new(meta, "completion_tokens", json_integer(o->n_output));
    json_object_set_new(meta, "cached_tokens", json_integer(o->cached_tokens));
    json_object_set_new(meta, "weight_version", json_string(job->weight_version));
    json_object_set_new(meta, "num_retractions", json_integer(o->num_retractions));
    if (job->return_logprob) {
        json_t *out_lp = json_array(), *in_lp = json_array();
        for (int i = 0; i < o->n_output; i++)
            json_array_append_new(out_lp, triple(o->output_logprobs[i], o->output_ids[i]));
        int start = job->logprob_start_len;
        for (int i = 0; start >= 0 && i < o->n_input_logprobs && start + i < job->prompt_lens[p]; i++)
            json_array_append_new(in_lp, triple(o->input_logprobs[i], job->prompts[p][start + i]));
        json_object_set_new(meta, "output_token_logprobs", out_lp);
        json_object_set_new(meta, "input_token_logprobs", in_lp);
        int k = job->top_logprobs_num;
        json_t *out_top = json_array(), *in_top = json_array();
        for (int i = 0; k > 0 && i < o->n_output; i++)
            json_array_append_new(out_top, top_json(o->output_top_ids + (size_t)i * k, o->output_top_lps + (size_t)i * k, k));
        for (int i = 0; k > 0 && i < o->n_input_logprobs; i++) {
            const int32_t *alt = o->input_top_ids + (size_t)i * k;
            json_array_append_new(in_top, alt[0] < 0 ? json_null() : top_json(alt, o->input_top_lps + (size_t)i * k, k));
        }
        json_object_set_new(meta, "output_top_logprobs", out_top);
        json_object_set_new(meta, "input_top_logprobs", in_top);
    }
    json_object_set_new(meta, "e2e_latency", json_real(o->e2e_latency));

    json_t *root = json_object();
    json_object_set_new(root, "output_ids", ids);
    json_object_set_new(root, "meta_info", meta);
    return root;
}

typedef struct text_buf {
    char *p;
    size_t n, cap;
} text_buf;

static int text_add(const char *s, size_t n, void *data) {
    text_buf *b = data;
    if (b->n + n + 1 > b->cap) {
        size_t cap = RS_MAX(b->cap * 2, b->n + n + 1);
        char *q = realloc(b->p, cap);
        if (!q) return -1;
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return 0;
}

char *rs_generate_response(const rs_generate_req *r, size_t *len) {
    const rs_gen_job *job = r->job;
    const size_t flags = JSON_COMPACT | JSON_REAL_PRECISION(9); /* 9 digits round-trip an fp32 logprob */
    bool list = job->batched || job->sp.n > 1;
    text_buf b = {0};
    int rc = list ? text_add("[", 1, &b) : 0;
    for (int p = 0; rc == 0 && p < job->n_prompts; p++) {
        for (int s = 0; rc == 0 && s < job->sp.n; s++) {
            if (p + s > 0) rc = text_add(",", 1, &b);
            json_t *o = output_json(r, p, s);
            if (rc == 0) rc = o ? json_dump_callback(o, text_add, &b, flags) : -1;
            json_decref(o);
        }
    }
    if (rc == 0 && list) rc = text_add("]", 1, &b);
    if (rc != 0) {
        free(b.p);
        return NULL;
    }
    *len = b.n;
    return b.p;
}
