/*
 * openai.c — /v1/completions parser and writers (see openai.h).
 *
 * Like generate.c, the parser collects the top-level fields first and interprets them in a fixed
 * order, so the error a bad request gets does not depend on the order of its keys; every error
 * names the field as the client wrote it.
 */
#include "openai.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_util.h"

#define RS_OPENAI_DEFAULT_MAX_TOKENS 16 /* OpenAI's and vLLM's default for completions */

/* ---------------------------------------------------------------- request */

enum {
    F_MODEL, F_PROMPT, F_MAX_TOKENS, F_TEMPERATURE, F_TOP_P, F_TOP_K, F_MIN_P, F_N, F_SEED, F_STOP_TOKEN_IDS,
    F_IGNORE_EOS, F_MIN_TOKENS, F_LOGPROBS, F_ECHO, F_STREAM, F_STREAM_OPTIONS, F_RETURN_TOKEN_IDS,
    F_REQUEST_ID, F_LOGPROBS_MODE,
    /* no effect without a tokenizer, or metadata: any value of the right type */
    F_AS_TOKEN_IDS, F_SKIP_SPECIAL, F_SPACES_SPECIAL, F_INCLUDE_STOP_STR, F_ADD_SPECIAL, F_USER,
    /* only their neutral value */
    F_FREQ_PENALTY, F_PRES_PENALTY, F_REP_PENALTY, F_STOP, F_LOGIT_BIAS, F_BEST_OF, F_SUFFIX, F_PROMPT_LOGPROBS,
    F_COUNT
};
static const char *const fields[F_COUNT] = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop_token_ids",
    "ignore_eos", "min_tokens", "logprobs", "echo", "stream", "stream_options", "return_token_ids",
    "request_id", "logprobs_mode",
    "return_tokens_as_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "add_special_tokens", "user",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "logit_bias", "best_of", "suffix",
    "prompt_logprobs",
};

static int no_tokenizer(rs_error *err) {
    return rs_error_set(err, RS_EINVAL, "prompt",
                        "rolloutd takes token ids (no tokenizer configured): prompt must be a list of token ids "
                        "or a list of lists");
}

static int parse_prompt(const json_t *v, rs_gen_job *job, rs_error *err) {
    if (json_is_string(v)) return no_tokenizer(err);
    if (!json_is_array(v)) return rs_json_bad_type(err, "prompt", "a list of token ids or a list of lists", v);
    size_t n = json_array_size(v);
    if (n == 0) return rs_error_set(err, RS_EINVAL, "prompt", "prompt must not be empty");
    const json_t *first = json_array_get(v, 0);
    if (json_is_string(first)) return no_tokenizer(err);
    job->batched = json_is_array(first);
    if (!job->batched) {
        job->prompts = rs_xcalloc(1, sizeof(int32_t *));
        job->prompt_lens = rs_xcalloc(1, sizeof(int));
        job->n_prompts = 1;
        return rs_json_get_ids(v, "prompt", "prompt", &job->prompts[0], &job->prompt_lens[0], err);
    }
    if (n > INT_MAX) return rs_error_set(err, RS_EINVAL, "prompt", "prompt has too many entries");
    job->prompts = rs_xcalloc(n, sizeof(int32_t *));
    job->prompt_lens = rs_xcalloc(n, sizeof(int));
    job->n_prompts = (int)n;
    for (size_t p = 0; p < n; p++) {
        char path[48];
        snprintf(path, sizeof path, "prompt[%zu]", p);
        const json_t *one = json_array_get(v, p);
        if (json_is_string(one)) return no_tokenizer(err);
        if (!json_is_array(one))
            return rs_json_bad_type(err, path, "a list of token ids (prompt[0] is a list, so this is a batch)", one);
        int rc = rs_json_get_ids(one, path, path, &job->prompts[p], &job->prompt_lens[p], err);
        if (rc != RS_OK) return rc;
        if (job->prompt_lens[p] == 0) return rs_error_set(err, RS_EINVAL, path, "%s must not be empty", path);
    }
    return RS_OK;
}

static int unsupported(rs_error *err, const char *param, const char *why) {
    return rs_error_set(err, RS_EUNSUPPORTED, param, "%s is not supported: %s", param, why);
}

/* Fields accepted only at their neutral value. */
static int check_neutral(int k, const json_t *v, const rs_gen_job *job, rs_error *err) {
    const char *name = fields[k];
    double f = 0;
    long long i = 0;
    int rc;
    switch (k) {
    case F_FREQ_PENALTY:
    case F_PRES_PENALTY:
    case F_REP_PENALTY: {
        if ((rc = rs_json_get_float(v, name, &f, err)) != RS_OK) return rc;
        double neutral = k == F_REP_PENALTY ? 1.0 : 0.0;
        if (f != neutral) {
            char why[64];
            snprintf(why, sizeof why, "only %g (no penalty) is implemented", neutral);
            return unsupported(err, name, why);
        }
        return RS_OK;
    }
    case F_STOP:
        if (json_is_array(v) && json_array_size(v) == 0) return RS_OK;
        if (json_is_string(v) && json_string_length(v) == 0) return RS_OK;
        if (!json_is_string(v) && !json_is_array(v)) return rs_json_bad_type(err, name, "a string or a list of strings", v);
        return unsupported(err, name, "stop strings need a tokenizer; use stop_token_ids");
    case F_LOGIT_BIAS:
        if (!json_is_object(v)) return rs_json_bad_type(err, name, "an object", v);
        return json_object_size(v) == 0 ? RS_OK : unsupported(err, name, "logit biases are not implemented");
    case F_BEST_OF:
        if ((rc = rs_json_get_int(v, name, 1, INT_MAX, &i, err)) != RS_OK) return rc;
        return i == job->sp.n ? RS_OK : unsupported(err, name, "best_of must equal n (no beam or best-of search)");
    case F_SUFFIX:
        if (!json_is_string(v)) return rs_json_bad_type(err, name, "a string", v);
        return json_string_length(v) == 0 ? RS_OK : unsupported(err, name, "suffixes are not implemented");
    case F_PROMPT_LOGPROBS:
        if ((rc = rs_json_get_int(v, name, 0, INT_MAX, &i, err)) != RS_OK) return rc;
        return unsupported(err, name, "use echo with logprobs to score the prompt");
    }
    return RS_OK;
}

static int parse_stream_options(const json_t *v, rs_openai_req *r, rs_error *err) {
    if (!json_is_object(v)) return rs_json_bad_type(err, "stream_options", "an object", v);
    const char *key;
    json_t *x;
    json_object_foreach((json_t *)v, key, x) {
        char param[160];
        snprintf(param, sizeof param, "stream_options.%s", key);
        if (json_is_null(x)) continue;
        int rc;
        if (strcmp(key, "include_usage") == 0) {
            if ((rc = rs_json_get_bool(x, param, &r->include_usage, err)) != RS_OK) return rc;
        } else if (strcmp(key, "continuous_usage_stats") == 0) {
            bool on = false;
            if ((rc = rs_json_get_bool(x, param, &on, err)) != RS_OK) return rc;
            if (on) return unsupported(err, param, "usage comes once, at the end (include_usage)");
        } else {
            return rs_error_set(err, RS_EINVAL, param, "unknown field '%s'", param);
        }
    }
    return RS_OK;
}

static int parse_fields(json_t *root, rs_openai_req *r, rs_error *err) {
    rs_gen_job *job = r->job;
    rs_sampling_params *sp = &job->sp;
    const json_t *f[F_COUNT] = {0};
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        int k = 0;
        while (k < F_COUNT && strcmp(key, fields[k]) != 0) k++;
        if (k == F_COUNT) {
            if (strcmp(key, "input_ids") == 0)
                return rs_error_set(err, RS_EINVAL, key, "unknown field 'input_ids' (/v1/completions takes prompt)");
            return rs_error_set(err, RS_EINVAL, key, "unknown field '%s'", key);
        }
        if (!json_is_null(v)) f[k] = v; /* null = absent = default */
    }
    int rc;
    long long i = 0;
    double x = 0;
    bool b = false;
    if (!f[F_PROMPT]) return rs_error_set(err, RS_EINVAL, "prompt", "prompt is required");
    if ((rc = parse_prompt(f[F_PROMPT], job, err)) != RS_OK) return rc;
    if (f[F_MODEL]) {
        if (!json_is_string(f[F_MODEL])) return rs_json_bad_type(err, "model", "a string", f[F_MODEL]);
        if (json_string_length(f[F_MODEL]) > RS_OPENAI_MODEL_MAX)
            return rs_error_set(err, RS_EINVAL, "model", "model must be at most %d bytes", RS_OPENAI_MODEL_MAX);
        snprintf(r->model, sizeof r->model, "%s", json_string_value(f[F_MODEL]));
    }
    if (f[F_REQUEST_ID]) {
        if ((rc = rs_json_check_name(f[F_REQUEST_ID], "request_id", RS_RID_MAX - 5, err)) != RS_OK) return rc;
        snprintf(r->request_id, sizeof r->request_id, "%s", json_string_value(f[F_REQUEST_ID]));
        snprintf(r->id, sizeof r->id, "cmpl-%.*s", RS_RID_MAX - 5, r->request_id);
    }
    sp->max_new_tokens = RS_OPENAI_DEFAULT_MAX_TOKENS;
    if (f[F_MAX_TOKENS]) {
        if ((rc = rs_json_get_int(f[F_MAX_TOKENS], "max_tokens", 0, INT_MAX, &i, err)) != RS_OK) return rc;
        sp->max_new_tokens = (int)i;
    } else if (json_object_get(root, "max_tokens")) { /* explicit null: as much as the context allows */
        r->max_tokens_to_context = true;
    }
    if (f[F_TEMPERATURE]) {
        if ((rc = rs_json_get_float(f[F_TEMPERATURE], "temperature", &x, err)) != RS_OK) return rc;
        if (x < 0) return rs_error_set(err, RS_EINVAL, "temperature", "temperature must be >= 0, got %g", x);
        sp->temperature = (float)x;
    }
    if (f[F_TOP_P]) {
        if ((rc = rs_json_get_float(f[F_TOP_P], "top_p", &x, err)) != RS_OK) return rc;
        if (!(x > 0 && x <= 1)) return rs_error_set(err, RS_EINVAL, "top_p", "top_p must be in (0, 1], got %g", x);
        sp->top_p = (float)x;
    }
    if (f[F_TOP_K]) { /* vLLM: 0 and -1 both turn it off */
        if ((rc = rs_json_get_int(f[F_TOP_K], "top_k", -1, INT_MAX, &i, err)) != RS_OK) return rc;
        sp->top_k = i == 0 ? -1 : (int)i;
    }
    if (f[F_MIN_P]) {
        if ((rc = rs_json_get_float(f[F_MIN_P], "min_p", &x, err)) != RS_OK) return rc;
        if (!(x >= 0 && x <= 1)) return rs_error_set(err, RS_EINVAL, "min_p", "min_p must be in [0, 1], got %g", x);
        sp->min_p = (float)x;
    }
    if (f[F_N]) {
        if ((rc = rs_json_get_int(f[F_N], "n", 1, INT_MAX, &i, err)) != RS_OK) return rc;
        sp->n = (int)i;
    }
    if (f[F_SEED]) { /* vLLM takes any 64-bit integer */
        if ((rc = rs_json_get_int(f[F_SEED], "seed", LLONG_MIN, LLONG_MAX, &i, err)) != RS_OK) return rc;
        sp->seed = (uint64_t)i;
        r->seed_given = true;
    }
    if (f[F_STOP_TOKEN_IDS] &&
        (rc = rs_json_get_ids(f[F_STOP_TOKEN_IDS], "stop_token_ids", "stop_token_ids", &sp->stop_token_ids,
                              &sp->n_stop_token_ids, err)) != RS_OK)
        return rc;
    if (f[F_IGNORE_EOS] && (rc = rs_json_get_bool(f[F_IGNORE_EOS], "ignore_eos", &sp->ignore_eos, err)) != RS_OK)
        return rc;
    if (f[F_MIN_TOKENS]) {
        if ((rc = rs_json_get_int(f[F_MIN_TOKENS], "min_tokens", 0, INT_MAX, &i, err)) != RS_OK) return rc;
        sp->min_new_tokens = (int)i;
    }
    r->logprobs = -1;
    if (f[F_LOGPROBS]) {
        if ((rc = rs_json_get_int(f[F_LOGPROBS], "logprobs", 0, INT_MAX, &i, err)) != RS_OK) return rc;
        r->logprobs = (int)i;
    }
    if (f[F_ECHO] && (rc = rs_json_get_bool(f[F_ECHO], "echo", &r->echo, err)) != RS_OK) return rc;
    if (f[F_STREAM] && (rc = rs_json_get_bool(f[F_STREAM], "stream", &r->stream, err)) != RS_OK) return rc;
    if (f[F_STREAM_OPTIONS]) {
        if (!r->stream) return rs_error_set(err, RS_EINVAL, "stream_options", "stream_options needs stream: true");
        if ((rc = parse_stream_options(f[F_STREAM_OPTIONS], r, err)) != RS_OK) return rc;
    }
    if (f[F_RETURN_TOKEN_IDS] &&
        (rc = rs_json_get_bool(f[F_RETURN_TOKEN_IDS], "return_token_ids", &r->return_token_ids, err)) != RS_OK)
        return rc;
    if (f[F_LOGPROBS_MODE] && (rc = rs_json_get_logprobs_mode(f[F_LOGPROBS_MODE], &job->logprobs_mode, err)) != RS_OK)
        return rc;
    for (int k = F_AS_TOKEN_IDS; k <= F_ADD_SPECIAL; k++)
        if (f[k] && (rc = rs_json_get_bool(f[k], fields[k], &b, err)) != RS_OK) return rc;
    if (f[F_USER] && !json_is_string(f[F_USER])) return rs_json_bad_type(err, "user", "a string", f[F_USER]);
    for (int k = F_FREQ_PENALTY; k < F_COUNT; k++)
        if (f[k] && (rc = check_neutral(k, f[k], job, err)) != RS_OK) return rc;

    /* logprobs k: the sampled token plus k alternatives; echo scores the prompt from its start */
    job->return_logprob = r->logprobs >= 0;
    job->top_logprobs_num = r->logprobs > 0 ? r->logprobs : 0;
    job->logprob_start_len = r->echo && job->return_logprob ? 0 : -1;
    job->stream = r->stream;
    return RS_OK;
}

int rs_openai_parse_completions(const char *body, size_t len, rs_openai_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = rs_json_load_object(body, len, false, &root, err);
    if (rc != RS_OK) return rc;
    out->job = rs_gen_job_new();
    rc = parse_fields(root, out, err);
    json_decref(root);
    if (rc != RS_OK) rs_openai_req_free(out);
    return rc;
}

void rs_openai_req_free(rs_openai_req *r) {
    rs_gen_job_free(r->job);
    free(r->sent);
    free(r->closed);
    free(r->started);
    free(r->text_offset);
    memset(r, 0, sizeof *r);
}

int rs_openai_check_model(const rs_openai_req *r, const char *served, rs_error *err) {
    if (!r->model[0] || strcmp(r->model, served) == 0) return RS_OK;
    return rs_error_set(err, RS_ENOTFOUND, "model", "The model `%.255s` does not exist (this server serves `%.255s`)",
                        r->model, served);
}

bool rs_openai_matches_rid(const rs_openai_req *r, const char *rid) {
    return strcmp(r->id, rid) == 0 || (r->request_id[0] && strcmp(r->request_id, rid) == 0);
}

/* Replaces every occurrence of `from` in s (capacity n) with `to`, at name boundaries (the
 * character before is not part of a longer name). */
static void replace_names(char *s, size_t n, const char *from, const char *to) {
    char out[1024];
    size_t o = 0, fl = strlen(from), tl = strlen(to);
    for (const char *p = s; *p && o + 1 < sizeof out;) {
        bool boundary = p == s || !(p[-1] == '_' || p[-1] == '.' || (p[-1] >= 'a' && p[-1] <= 'z'));
        if (boundary && strncmp(p, from, fl) == 0 && o + tl + 1 < sizeof out) {
            memcpy(out + o, to, tl);
            o += tl;
            p += fl;
        } else {
            out[o++] = *p++;
        }
    }
    out[o] = '\0';
    size_t len = RS_MIN(o, n - 1);
    memcpy(s, out, len);
    s[len] = '\0';
}

void rs_openai_map_error(rs_error *err) {
    static const char *const map[][2] = {
        {"sampling_params.max_new_tokens", "max_tokens"},
        {"sampling_params.min_new_tokens", "min_tokens"},
        {"sampling_params.stop_token_ids", "stop_token_ids"},
        {"sampling_params.n", "n"},
        {"max_new_tokens", "max_tokens"},
        {"min_new_tokens", "min_tokens"},
        {"top_logprobs_num", "logprobs"},
        {"logprob_start_len", "echo"},
        {"input_ids", "prompt"},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(map); i++) {
        replace_names(err->param, sizeof err->param, map[i][0], map[i][1]);
        replace_names(err->message, sizeof err->message, map[i][0], map[i][1]);
    }
}

/* ---------------------------------------------------------------- response */

static const char *finish_name(rs_finish_type t) {
    switch (t) {
    case RS_FINISH_STOP: return "stop";
    case RS_FINISH_LENGTH: return "length";
    case RS_FINISH_ABORT: return "abort";
    case RS_FINISH_NONE: break;
    }
    return NULL;
}

/* The stop token when one of the request's stop_token_ids ended the output; null for EOS. */
static json_t *stop_reason(const rs_gen_job *job, const rs_gen_output *o) {
    if (o->finish.type != RS_FINISH_STOP) return json_null();
    for (int i = 0; i < job->sp.n_stop_token_ids; i++)
        if (job->sp.stop_token_ids[i] == o->finish.matched) return json_integer(o->finish.matched);
    return json_null();
}

typedef struct lp_lists {
    json_t *tokens, *token_logprobs, *top_logprobs, *text_offset;
    long long offset;           /* running offset into the concatenated token strings */
} lp_lists;

/* One position: token `id` with logprob `lp` and alternatives [k] (ids -1 = absent); `first_prompt`
 * is the context-less first prompt token (null logprob and alternatives). */
static void lp_add(lp_lists *l, int32_t id, float lp, const int32_t *alt_ids, const float *alt_lps, int k,
                   bool first_prompt) {
    char tok[32];
    int tl = snprintf(tok, sizeof tok, "token_id:%d", (int)id);
    json_array_append_new(l->tokens, json_string(tok));
    json_array_append_new(l->token_logprobs, first_prompt ? json_null() : rs_json_logprob(lp));
    json_array_append_new(l->text_offset, json_integer(l->offset));
    l->offset += tl;
    if (first_prompt) {
        json_array_append_new(l->top_logprobs, json_null());
        return;
    }
    json_t *top = json_object();
    json_object_set_new(top, tok, rs_json_logprob(lp)); /* the chosen token is always listed */
    for (int j = 0; j < k && alt_ids[j] >= 0; j++) {
        char alt[32];
        snprintf(alt, sizeof alt, "token_id:%d", (int)alt_ids[j]);
        if (!json_object_get(top, alt)) json_object_set_new(top, alt, rs_json_logprob(alt_lps[j]));
    }
    json_array_append_new(l->top_logprobs, top);
}

/* The logprobs object of output i: the prompt's scored tokens first when with_prompt (echo),
 * then output tokens [from, n_output). *offset carries text_offset across streamed chunks. */
static json_t *logprobs_json(const rs_openai_req *r, int i, int from, bool with_prompt, long long *offset) {
    const rs_gen_job *job = r->job;
    const rs_gen_output *o = &job->outputs[i];
    int p = i / job->sp.n, k = job->top_logprobs_num;
    lp_lists l = {json_array(), json_array(), json_array(), json_array(), *offset};
    if (with_prompt && job->logprob_start_len == 0) {
        for (int t = 0; t < o->n_input_logprobs && t < job->prompt_lens[p]; t++)
            lp_add(&l, job->prompts[p][t], o->input_logprobs[t], k ? o->input_top_ids + (size_t)t * k : NULL,
                   k ? o->input_top_lps + (size_t)t * k : NULL, k, t == 0);
    }
    for (int t = from; t < o->n_output; t++)
        lp_add(&l, o->output_ids[t], o->output_logprobs[t], k ? o->output_top_ids + (size_t)t * k : NULL,
               k ? o->output_top_lps + (size_t)t * k : NULL, k, false);
    *offset = l.offset;
    json_t *obj = json_object();
    json_object_set_new(obj, "tokens", l.tokens);
    json_object_set_new(obj, "token_logprobs", l.token_logprobs);
    json_object_set_new(obj, "top_logprobs", l.top_logprobs);
    json_object_set_new(obj, "text_offset", l.text_offset);
    return obj;
}

static json_t *ids_json(const int32_t *ids, int from, int to) {
    json_t *a = json_array();
    for (int t = from; t < to; t++) json_array_append_new(a, json_integer(ids[t]));
    return a;
}

/* Choice i with output tokens [from, n_output); first: the choice's first (or only) chunk. */
static json_t *choice_json(const rs_openai_req *r, int i, int from, bool first, bool finished, long long *offset) {
    const rs_gen_job *job = r->job;
    const rs_gen_output *o = &job->outputs[i];
    int p = i / job->sp.n;
    json_t *c = json_object();
    json_object_set_new(c, "index", json_integer(i));
    json_object_set_new(c, "text", json_string(""));
    json_object_set_new(c, "logprobs",
                        job->return_logprob ? logprobs_json(r, i, from, first && r->echo, offset) : json_null());
    const char *fr = finished ? finish_name(o->finish.type) : NULL;
    json_object_set_new(c, "finish_reason", fr ? json_string(fr) : json_null());
    json_object_set_new(c, "stop_reason", finished ? stop_reason(job, o) : json_null());
    json_object_set_new(c, "token_ids", ids_json(o->output_ids, from, o->n_output));
    if (first && r->return_token_ids)
        json_object_set_new(c, "prompt_token_ids", ids_json(job->prompts[p], 0, job->prompt_lens[p]));
    return c;
}

static json_t *usage_json(const rs_gen_job *job) {
    long long prompt = 0, completion = 0;
    for (int p = 0; p < job->n_prompts; p++) prompt += job->prompt_lens[p];
    for (int i = 0; i < job->n_prompts * job->sp.n; i++) completion += job->outputs[i].n_output;
    return json_pack("{s:I,s:I,s:I}", "prompt_tokens", (json_int_t)prompt, "completion_tokens",
                     (json_int_t)completion, "total_tokens", (json_int_t)(prompt + completion));
}

static json_t *envelope(const rs_openai_req *r, json_t *choices) {
    json_t *root = json_object();
    json_object_set_new(root, "id", json_string(r->id));
    json_object_set_new(root, "object", json_string("text_completion"));
    json_object_set_new(root, "created", json_integer(r->created));
    json_object_set_new(root, "model", rs_json_string_lossy(r->model));
    json_object_set_new(root, "choices", choices);
    return root;
}

char *rs_openai_completions_response(const rs_openai_req *r, size_t *len) {
    const rs_gen_job *job = r->job;
    json_t *choices = json_array();
    for (int i = 0; i < job->n_prompts * job->sp.n; i++) {
        long long offset = 0;
        json_array_append_new(choices, choice_json(r, i, 0, true, true, &offset));
    }
    json_t *root = envelope(r, choices);
    json_object_set_new(root, "usage", usage_json(job));
    return rs_json_dump(root, len);
}

int rs_openai_stream_events(rs_openai_req *r, bool final, rs_buf *out) {
    const rs_gen_job *job = r->job;
    int n_out = job->n_prompts * job->sp.n;
    if (!r->sent) {
        r->sent = calloc((size_t)n_out, sizeof *r->sent);
        r->closed = calloc((size_t)n_out, sizeof *r->closed);
        r->started = calloc((size_t)n_out, sizeof *r->started);
        r->text_offset = calloc((size_t)n_out, sizeof *r->text_offset);
        if (!r->sent || !r->closed || !r->started || !r->text_offset) return RS_ENOMEM;
    }
    for (int i = 0; i < n_out; i++) {
        const rs_gen_output *o = &job->outputs[i];
        bool finished = o->finish.type != RS_FINISH_NONE;
        if (r->closed[i] || (o->n_output == r->sent[i] && !finished)) continue;
        json_t *choices = json_array();
        json_array_append_new(choices, choice_json(r, i, r->sent[i], !r->started[i], finished, &r->text_offset[i]));
        int rc = rs_json_sse_event(out, envelope(r, choices));
        if (rc != RS_OK) return rc;
        r->sent[i] = o->n_output;
        r->started[i] = true;
        r->closed[i] = finished;
    }
    if (!final) return RS_OK;
    if (r->include_usage) {
        json_t *root = envelope(r, json_array());
        json_object_set_new(root, "usage", usage_json(job));
        int rc = rs_json_sse_event(out, root);
        if (rc != RS_OK) return rc;
    }
    return rs_sse_done(out);
}

char *rs_openai_models_body(const char *name, const char *model_path, long long created, int max_model_len,
                            size_t *len) {
    json_t *m = json_object();
    json_object_set_new(m, "id", rs_json_string_lossy(name));
    json_object_set_new(m, "object", json_string("model"));
    json_object_set_new(m, "created", json_integer(created));
    json_object_set_new(m, "owned_by", json_string("rolloutd"));
    json_object_set_new(m, "root", rs_json_string_lossy(model_path));
    json_object_set_new(m, "max_model_len", json_integer(max_model_len));
    json_t *data = json_array();
    json_array_append_new(data, m);
    return rs_json_dump(json_pack("{s:s,s:o}", "object", "list", "data", data), len);
}
