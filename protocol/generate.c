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

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_util.h"

/* ---------------------------------------------------------------- field readers */

#define bad_type rs_json_bad_type
#define get_int rs_json_get_int
#define get_float rs_json_get_float
#define get_bool rs_json_get_bool
#define get_ids rs_json_get_ids

static int check_rid(const json_t *v, const char *param, rs_error *err) {
    return rs_json_check_name(v, param, RS_RID_MAX, err);
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
        snprintf(r->rid, sizeof r->rid, "%s", json_string_value(v));
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
    snprintf(r->rid, sizeof r->rid, "%s", r->prompt_rids[0]); /* names the request in logs */
    return RS_OK;
}

/* SGLang sampling fields that trainers send at their neutral value (slime and veRL send them all,
 * see reference/engines.md 1.1). Accepted at that value, or with no effect when they only shape
 * text (there is no tokenizer); anything else is RS_EUNSUPPORTED naming the field. Sets *known. */
static int sglang_neutral(const char *key, const json_t *v, const char *param, bool *known, rs_error *err) {
    static const char *const text_only[] = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"};
    static const char *const constrained[] = {"json_schema", "regex", "ebnf", "structural_tag", "stop_regex",
                                              "custom_params"};
    *known = true;
    double f = 0;
    int rc;
    bool b;
    for (size_t i = 0; i < RS_ARRAY_LEN(text_only); i++)
        if (strcmp(key, text_only[i]) == 0) return json_is_null(v) ? RS_OK : get_bool(v, param, &b, err);
    for (size_t i = 0; i < RS_ARRAY_LEN(constrained); i++)
        if (strcmp(key, constrained[i]) == 0)
            return json_is_null(v) ? RS_OK
                                   : rs_error_set(err, RS_EUNSUPPORTED, param, "%s is not supported: constrained "
                                                  "decoding and custom parameters are not implemented", param);
    if (!strcmp(key, "frequency_penalty") || !strcmp(key, "presence_penalty") || !strcmp(key, "repetition_penalty")) {
        if (json_is_null(v)) return RS_OK;
        if ((rc = get_float(v, param, &f, err)) != RS_OK) return rc;
        double neutral = strcmp(key, "repetition_penalty") == 0 ? 1.0 : 0.0;
        if (f != neutral)
            return rs_error_set(err, RS_EUNSUPPORTED, param, "%s is not supported: only %g (no penalty) is implemented",
                                param, neutral);
        return RS_OK;
    }
    if (strcmp(key, "stop") == 0) {
        if (json_is_null(v) || (json_is_array(v) && json_array_size(v) == 0) ||
            (json_is_string(v) && json_string_length(v) == 0))
            return RS_OK;
        if (!json_is_string(v) && !json_is_array(v)) return bad_type(err, param, "a string or a list of strings", v);
        return rs_error_set(err, RS_EUNSUPPORTED, param,
                            "%s is not supported: stop strings need a tokenizer; use stop_token_ids", param);
    }
    if (strcmp(key, "logit_bias") == 0) {
        if (json_is_null(v)) return RS_OK;
        if (!json_is_object(v)) return bad_type(err, param, "an object", v);
        if (json_object_size(v) == 0) return RS_OK;
        return rs_error_set(err, RS_EUNSUPPORTED, param, "%s is not supported: logit biases are not implemented", param);
    }
    *known = false;
    return RS_OK;
}

static int parse_sampling(const json_t *obj, rs_sampling_params *sp, int *stream_interval, bool *seed_given,
                          rs_error *err) {
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
            if (!null && (rc = get_int(v, param, 0, LLONG_MAX, &i, err)) == RS_OK) {
                sp->seed = (uint64_t)i;
                *seed_given = true;
            }
        } else if (strcmp(key, "stop_token_ids") == 0) {
            if (!null) {
                free(sp->stop_token_ids);
                sp->stop_token_ids = NULL;
                sp->n_stop_token_ids = 0;
                rc = get_ids(v, param, param, &sp->stop_token_ids, &sp->n_stop_token_ids, err);
            }
        } else if (strcmp(key, "ignore_eos") == 0) {
            if (!null) rc = get_bool(v, param, &sp->ignore_eos, err);
        } else if (strcmp(key, "stream_interval") == 0) {
            if (!null && (rc = get_int(v, param, 1, INT_MAX, &i, err)) == RS_OK) *stream_interval = (int)i;
        } else {
            rc = sglang_neutral(key, v, param, &known, err);
        }
        if (!known) return rs_error_set(err, RS_EINVAL, param, "unknown field '%s'", param);
        if (rc != RS_OK) return rc;
    }
    return RS_OK;
}

#define parse_logprobs_mode rs_json_get_logprobs_mode

/* The top-level fields, collected before any is interpreted. */
enum { F_RID, F_INPUT_IDS, F_SAMPLING, F_RETURN_LOGPROB, F_LOGPROB_START, F_TOP_LOGPROBS, F_LOGPROBS_MODE,
       F_STREAM,
       /* SGLang fields accepted only at their neutral value (see check_top_neutral) */
       F_TOKEN_IDS_LOGPROB, F_RETURN_TEXT_IN_LOGPROBS, F_RETURN_ROUTED_EXPERTS, F_RETURN_HIDDEN_STATES,
       F_RETURN_SAMPLING_MASK, F_LOG_METRICS, F_COUNT };
static const char *const top_fields[F_COUNT] = {
    "rid", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "logprobs_mode", "stream",
    "token_ids_logprob", "return_text_in_logprobs", "return_routed_experts", "return_hidden_states",
    "return_sampling_mask", "log_metrics",
};

/* token_ids_logprob: null only. return_text_in_logprobs, log_metrics: any bool (no tokenizer: the
 * text slot of a logprob triple is always null; metrics are always kept). The return_* extras:
 * false only. */
static int check_top_neutral(int k, const json_t *v, rs_error *err) {
    const char *name = top_fields[k];
    if (k == F_TOKEN_IDS_LOGPROB)
        return rs_error_set(err, RS_EUNSUPPORTED, name, "%s is not supported: use top_logprobs_num", name);
    bool b = false;
    int rc = get_bool(v, name, &b, err);
    if (rc != RS_OK || k == F_RETURN_TEXT_IN_LOGPROBS || k == F_LOG_METRICS || !b) return rc;
    return rs_error_set(err, RS_EUNSUPPORTED, name, "%s is not supported", name);
}

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
    if (f[F_SAMPLING] && (rc = parse_sampling(f[F_SAMPLING], &job->sp, &r->stream_interval, &r->seed_given, err)) != RS_OK) return rc;
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
    if (f[F_STREAM] && (rc = get_bool(f[F_STREAM], "stream", &r->stream, err)) != RS_OK) return rc;
    for (int k = F_TOKEN_IDS_LOGPROB; k < F_COUNT; k++)
        if (f[k] && (rc = check_top_neutral(k, f[k], err)) != RS_OK) return rc;
    job->stream = r->stream;
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
    json_t *root;
    int rc = rs_json_load_object(body, len, false, &root, err);
    if (rc != RS_OK) return rc;
    out->job = rs_gen_job_new();
    rc = parse_fields(root, out, err);
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
    free(r->sent);
    free(r->closed);
    memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------- response */

void rs_generate_output_id(const rs_generate_req *r, int p, int s, char *buf, size_t n) {
    const rs_gen_job *job = r->job;
    int len;
    if (r->prompt_rids) len = snprintf(buf, n, "%s", r->prompt_rids[p]);
    else if (job->batched) len = snprintf(buf, n, "%s_%d", r->rid, p);
    else len = snprintf(buf, n, "%s", r->rid);
    if (job->sp.n > 1 && len >= 0 && (size_t)len < n) snprintf(buf + len, n - (size_t)len, "_%d", s);
}

bool rs_generate_matches_rid(const rs_generate_req *r, const char *rid) {
    if (strcmp(r->rid, rid) == 0) return true;
    const rs_gen_job *job = r->job;
    for (int p = 0; r->prompt_rids && p < job->n_prompts; p++)
        if (strcmp(r->prompt_rids[p], rid) == 0) return true;
    if (!job->batched && job->sp.n == 1) return false;
    for (int p = 0; p < job->n_prompts; p++) {
        for (int s = 0; s < job->sp.n; s++) {
            char id[RS_RID_MAX + 32];
            rs_generate_output_id(r, p, s, id, sizeof id);
            if (strcmp(id, rid) == 0) return true;
        }
    }
    return false;
}

/* [logprob, token_id, null]: null logprob when it is not finite (the first prompt position has no
 * context; a token sampled with probability 0 would be -inf, which JSON cannot hold). */
static json_t *triple(float lp, int32_t id) {
    json_t *t = json_array();
    json_array_append_new(t, rs_json_logprob(lp));
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

/* [[version, start, end], ...]: the weights each run of output tokens came from (more than one
 * when the request crossed a weight update); the last run ends at the tokens so far. */
static json_t *spans_json(const rs_gen_output *o) {
    json_t *a = json_array();
    for (int i = 0; i < o->n_spans; i++) {
        const rs_weight_span *sp = &o->spans[i];
        int end = i == o->n_spans - 1 ? o->n_output : RS_MIN(sp->end, o->n_output);
        json_t *t = json_array();
        json_array_append_new(t, rs_json_string_lossy(sp->version));
        json_array_append_new(t, json_integer(RS_MIN(sp->start, end)));
        json_array_append_new(t, json_integer(end));
        json_array_append_new(a, t);
    }
    return a;
}

/* The object of output (p, s) with its output tokens [from, n_output); the prompt's scores only
 * when with_input. A finished answer: from = 0, with_input, and e2e_latency. */
static json_t *output_json(const rs_generate_req *r, int p, int s, int from, bool with_input, bool with_latency) {
    const rs_gen_job *job = r->job;
    const rs_gen_output *o = &job->outputs[p * job->sp.n + s];
    char id[RS_RID_MAX + 32];
    rs_generate_output_id(r, p, s, id, sizeof id);

    json_t *ids = json_array();
    for (int i = from; i < o->n_output; i++) json_array_append_new(ids, json_integer(o->output_ids[i]));

    json_t *meta = json_object();
    json_object_set_new(meta, "id", json_string(id));
    json_object_set_new(meta, "finish_reason", finish_json(&o->finish));
    json_object_set_new(meta, "prompt_tokens", json_integer(o->prompt_tokens));
    json_object_set_new(meta, "completion_tokens", json_integer(o->n_output));
    json_object_set_new(meta, "cached_tokens", json_integer(o->cached_tokens));
    /* the version of this output's last token (of its prompt scores when it has none); a request
     * that crossed an update lists the others in weight_version_spans */
    json_object_set_new(meta, "weight_version",
                        json_string(o->n_spans > 0 ? o->spans[o->n_spans - 1].version : job->weight_version));
    json_object_set_new(meta, "num_retractions", json_integer(o->num_retractions));
    if (o->n_spans > 0) json_object_set_new(meta, "weight_version_spans", spans_json(o));
    if (job->return_logprob) {
        json_t *out_lp = json_array(), *in_lp = json_array();
        for (int i = from; i < o->n_output; i++)
            json_array_append_new(out_lp, triple(o->output_logprobs[i], o->output_ids[i]));
        int start = job->logprob_start_len;
        for (int i = 0; with_input && start >= 0 && i < o->n_input_logprobs && start + i < job->prompt_lens[p]; i++)
            json_array_append_new(in_lp, triple(o->input_logprobs[i], job->prompts[p][start + i]));
        json_object_set_new(meta, "output_token_logprobs", out_lp);
        json_object_set_new(meta, "input_token_logprobs", in_lp);
        int k = job->top_logprobs_num;
        json_t *out_top = json_array(), *in_top = json_array();
        for (int i = from; k > 0 && i < o->n_output; i++)
            json_array_append_new(out_top, top_json(o->output_top_ids + (size_t)i * k, o->output_top_lps + (size_t)i * k, k));
        for (int i = 0; with_input && k > 0 && i < o->n_input_logprobs; i++) {
            const int32_t *alt = o->input_top_ids + (size_t)i * k;
            json_array_append_new(in_top, alt[0] < 0 ? json_null() : top_json(alt, o->input_top_lps + (size_t)i * k, k));
        }
        json_object_set_new(meta, "output_top_logprobs", out_top);
        json_object_set_new(meta, "input_top_logprobs", in_top);
    }
    if (with_latency) json_object_set_new(meta, "e2e_latency", json_real(o->e2e_latency));

    json_t *root = json_object();
    json_object_set_new(root, "output_ids", ids);
    json_object_set_new(root, "meta_info", meta);
    return root;
}

char *rs_generate_response(const rs_generate_req *r, size_t *len) {
    const rs_gen_job *job = r->job;
    bool list = job->batched || job->sp.n > 1;
    rs_buf b = {0};
    int rc = list ? rs_buf_append(&b, "[", 1) : RS_OK;
    /* one output's tree at a time: peak memory is one tree plus the text, not the whole batch */
    for (int p = 0; rc == RS_OK && p < job->n_prompts; p++) {
        for (int s = 0; rc == RS_OK && s < job->sp.n; s++) {
            if (p + s > 0) rc = rs_buf_append(&b, ",", 1);
            json_t *o = output_json(r, p, s, 0, true, true);
            if (rc == RS_OK) rc = rs_json_append(&b, o);
            json_decref(o);
        }
    }
    if (rc == RS_OK && list) rc = rs_buf_append(&b, "]", 1);
    if (rc == RS_OK && !b.data) rc = rs_buf_append(&b, "", 0);
    if (rc != RS_OK) {
        rs_buf_free(&b);
        return NULL;
    }
    *len = b.len;
    return b.data;
}

int rs_generate_stream_events(rs_generate_req *r, bool final, rs_buf *out) {
    const rs_gen_job *job = r->job;
    int n_out = job->n_prompts * job->sp.n;
    if (!r->sent) {
        r->sent = calloc((size_t)n_out, sizeof *r->sent);
        r->closed = calloc((size_t)n_out, sizeof *r->closed);
        if (!r->sent || !r->closed) return RS_ENOMEM;
    }
    bool list = job->batched || job->sp.n > 1;
    for (int i = 0; i < n_out; i++) {
        const rs_gen_output *o = &job->outputs[i];
        bool finished = o->finish.type != RS_FINISH_NONE;
        if (r->closed[i] || (o->n_output == r->sent[i] && !finished)) continue;
        if (!finished && o->n_output - r->sent[i] < RS_MAX(r->stream_interval, 1)) continue;
        bool first = r->sent[i] == 0;
        int from = r->incremental ? r->sent[i] : 0;
        json_t *ev = output_json(r, i / job->sp.n, i % job->sp.n, from, !r->incremental || first, finished);
        if (ev && list) json_object_set_new(ev, "index", json_integer(i));
        int rc = rs_json_sse_event(out, ev);
        if (rc != RS_OK) return rc;
        r->sent[i] = o->n_output;
        r->closed[i] = finished;
    }
    return final ? rs_sse_done(out) : RS_OK;
}
