/*
 * ops.c — operations route bodies (see ops.h).
 *
 * Request bodies are read by descriptor tables (json_util.h) listing every field of SGLang's
 * request struct for the route (python/sglang/srt/managers/io_struct.py at 001067ff: AbortReq,
 * PauseGenerationReqInput, ContinueGenerationReqInput, FlushCacheReqInput, and BaseReq's rid /
 * http_worker_ipc).
 */
#include "ops.h"

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "json_util.h"

#define DST(T, field) .offset = offsetof(T, field), .size = sizeof(((T *)0)->field)
#define IPC_FIELD {.name = "http_worker_ipc", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "SGLang's internal IPC"}
#define RID_FIELD {.name = "rid", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT, .doc = "SGLang's request id; not used"}

static int read_body(const char *body, size_t len, bool allow_empty, const rs_jobject *t, void *dst, rs_error *err) {
    json_t *root;
    int rc = rs_json_load_object(body, len, allow_empty, &root, err);
    if (rc != RS_OK) return rc;
    void *const dsts[] = {dst};
    rc = rs_json_read(root, t, dsts, "", err);
    json_decref(root);
    return rc;
}

/* rid: a request's name, or "" (SGLang's AbortReq default, which its clients send with abort_all). */
static int read_abort_rid(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_abort_req *r = c->dst[0];
    if (json_is_string(v) && json_string_length(v) == 0) return RS_OK;
    int rc = rs_json_check_name(v, c->param, sizeof r->rid - 1, err);
    if (rc != RS_OK) return rc;
    memcpy(r->rid, json_string_value(v), json_string_length(v) + 1);
    return RS_OK;
}

static const rs_jfield abort_fields[] = {
    {.name = "rid", .type = RS_JT_CUSTOM, .read = read_abort_rid, .shape = "string", .def = "\"\"",
     .doc = "the request to abort: its rid, one of its prompt rids or output ids (either aborts the whole "
            "request), or a /v1 request_id (\"\" names none, for abort_all)",
     .schema = "{'type': 'string', 'maxLength': 127}"},
    {.name = "abort_all", .type = RS_JT_BOOL, DST(rs_abort_req, abort_all), .def = "false",
     .doc = "abort every request in flight"},
    {.name = "abort_message", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL,
     .doc = "custom abort messages; the finish reason says \"aborted\""},
    {.name = "finished_reason", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "SGLang's internal finish reason"},
    {.name = "weight_versions", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "SGLang's internal version spans"},
    IPC_FIELD,
};

const rs_jobject rs_abort_fields = {
    .title = "POST /abort_request", .fields = abort_fields, .n = RS_ARRAY_LEN(abort_fields)};

int rs_abort_parse(const char *body, size_t len, rs_abort_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    int rc = read_body(body, len, false, &rs_abort_fields, out, err);
    if (rc == RS_OK && !out->rid[0] && !out->abort_all)
        rc = rs_error_set(err, RS_EINVAL, "rid", "give the rid to abort, or \"abort_all\": true");
    if (rc != RS_OK) memset(out, 0, sizeof *out);
    else if (out->abort_all) out->rid[0] = '\0';
    return rc;
}

char *rs_abort_body(int n_aborted, size_t *len) {
    return rs_json_dump(json_pack("{s:b,s:i}", "success", 1, "aborted", n_aborted), len);
}

static const char *const pause_names[] = {[RS_PAUSE_ABORT] = "abort", [RS_PAUSE_RETRACT] = "retract",
                                          [RS_PAUSE_IN_PLACE] = "in_place"};

const char *rs_pause_mode_name(rs_pause_mode mode) {
    return (size_t)mode < RS_ARRAY_LEN(pause_names) ? pause_names[mode] : "?";
}

typedef struct pause_req {
    int mode;                   /* rs_pause_mode */
} pause_req;

static const rs_jfield pause_fields[] = {
    {.name = "mode", .type = RS_JT_ENUM, DST(pause_req, mode), .choices = "abort|retract|in_place",
     .def = "\"abort\"", .doc = "abort in-flight requests, retract them (recomputed on continue), or freeze them "
                                "with their KV"},
    RID_FIELD,
    IPC_FIELD,
};

const rs_jobject rs_pause_fields = {
    .title = "POST /pause_generation", .fields = pause_fields, .n = RS_ARRAY_LEN(pause_fields)};

int rs_pause_parse(const char *body, size_t len, rs_pause_mode *mode, rs_error *err) {
    pause_req r = {.mode = RS_PAUSE_ABORT};
    int rc = read_body(body, len, true, &rs_pause_fields, &r, err);
    *mode = rc == RS_OK ? (rs_pause_mode)r.mode : RS_PAUSE_ABORT;
    return rc;
}

static const rs_jfield continue_fields[] = {
    {.name = "torch_empty_cache", .type = RS_JT_BOOL, .use = RS_JU_NO_EFFECT, .def = "true",
     .doc = "there is no torch allocator"},
    RID_FIELD,
    IPC_FIELD,
};

const rs_jobject rs_continue_fields = {.title = "POST /continue_generation", .fields = continue_fields,
                                       .n = RS_ARRAY_LEN(continue_fields),
                                       .unknown_hint = "/continue_generation takes no parameters rolloutd uses"};

static const rs_jfield flush_fields[] = {
    {.name = "timeout_s", .type = RS_JT_NUMBER, .use = RS_JU_NEUTRAL,
     .doc = "waiting for the server to go idle; the flush answers 409 at once while requests run"},
    RID_FIELD,
    IPC_FIELD,
};

const rs_jobject rs_flush_fields = {.title = "GET or POST /flush_cache", .fields = flush_fields,
                                    .n = RS_ARRAY_LEN(flush_fields),
                                    .unknown_hint = "/flush_cache takes no parameters rolloutd uses"};

int rs_continue_parse(const char *body, size_t len, rs_error *err) {
    return read_body(body, len, true, &rs_continue_fields, NULL, err);
}

int rs_flush_parse(const char *body, size_t len, rs_error *err) {
    return read_body(body, len, true, &rs_flush_fields, NULL, err);
}

/* The one rank's entry of /get_load; with `v1`, also /v1/loads' num_running_reqs and token_usage. */
static json_t *load_rank(const rs_engine_stats *st, bool v1) {
    long long used_pages = (long long)st->kv_blocks_total - st->kv_blocks_free;
    json_t *rank = json_pack("{s:i,s:i,s:i,s:I,s:I}", "dp_rank", 0, "num_reqs", st->n_running + st->n_waiting,
                             "num_waiting_reqs", st->n_waiting, "num_tokens",
                             (json_int_t)(used_pages * RS_KV_PAGE_TOKENS + (long long)st->waiting_tokens),
                             "num_pages", (json_int_t)(used_pages + (long long)st->waiting_blocks));
    if (v1 && rank) {
        json_object_set_new(rank, "num_running_reqs", json_integer(st->n_running));
        json_object_set_new(rank, "token_usage",
                            json_real(st->kv_blocks_total ? (double)used_pages / (double)st->kv_blocks_total : 0.0));
    }
    return rank;
}

char *rs_load_body(const rs_engine_stats *st, size_t *len) {
    json_t *list = json_array();
    json_array_append_new(list, load_rank(st, false));
    return rs_json_dump(list, len);
}

char *rs_loads_body(const rs_engine_stats *st, size_t *len) {
    json_t *list = json_array();
    json_array_append_new(list, load_rank(st, true));
    return rs_json_dump(json_pack("{s:o}", "loads", list), len);
}

char *rs_status_body(const char *message, size_t *len) {
    return rs_json_dump(json_pack("{s:s,s:o}", "status", "ok", "message", rs_json_string_lossy(message)), len);
}

char *rs_weight_version_body(const char *version, size_t *len) {
    return rs_json_dump(json_pack("{s:o}", "weight_version", rs_json_string_lossy(version)), len);
}

static json_t *model_info_json(const rs_model_info *mi) {
    json_t *o = json_object();
    json_object_set_new(o, "model_path", rs_json_string_lossy(mi->model_path));
    json_object_set_new(o, "tokenizer_path", mi->tokenizer_path ? rs_json_string_lossy(mi->tokenizer_path) : json_null());
    json_object_set_new(o, "architecture", json_string(mi->architecture));
    json_object_set_new(o, "is_generation", json_true());
    json_object_set_new(o, "weight_version", rs_json_string_lossy(mi->weight_version));
    json_object_set_new(o, "quantization", json_string(mi->quantization));
    json_object_set_new(o, "kv_cache_dtype", json_string(mi->kv_cache_dtype));
    json_object_set_new(o, "served_model_name", rs_json_string_lossy(mi->served_model_name));
    json_object_set_new(o, "fp8_checkpoint", json_boolean(mi->fp8_checkpoint));
    json_object_set_new(o, "vocab_size", json_integer(mi->vocab_size));
    json_object_set_new(o, "max_context_len", json_integer(mi->max_context_len));
    json_object_set_new(o, "bos_token_id", mi->bos_token_id >= 0 ? json_integer(mi->bos_token_id) : json_null());
    json_object_set_new(o, "eos_token_id", mi->n_eos > 0 ? json_integer(mi->eos_token_ids[0]) : json_null());
    json_t *eos = json_array();
    for (int i = 0; i < mi->n_eos; i++) json_array_append_new(eos, json_integer(mi->eos_token_ids[i]));
    json_object_set_new(o, "eos_token_ids", eos);
    return o;
}

char *rs_model_info_body(const rs_model_info *mi, size_t *len) { return rs_json_dump(model_info_json(mi), len); }

/* A setting's current value, typed. */
static json_t *setting_json(const rs_config *c, const rs_config_entry *e) {
    const char *field = (const char *)c + e->offset;
    switch (e->type) {
    case RS_CONFIG_TYPE_INT: return json_integer(*(const int *)field);
    case RS_CONFIG_TYPE_SIZE: return json_integer((json_int_t) * (const size_t *)field);
    case RS_CONFIG_TYPE_FLOAT: return json_real(*(const double *)field);
    case RS_CONFIG_TYPE_BOOL: return json_boolean(*(const bool *)field);
    case RS_CONFIG_TYPE_ENUM:
    case RS_CONFIG_TYPE_STRING: {
        char buf[4200];
        rs_config_format(c, e, buf, sizeof buf); /* secrets come out as "(set)" */
        return rs_json_string_lossy(buf);
    }
    }
    return json_null();
}

char *rs_server_info_body(const rs_server_info *si, size_t *len) {
    json_t *o = json_object();
    size_t n;
    const rs_config_entry *entries = rs_config_entries(&n);
    for (size_t i = 0; i < n; i++) {
        char key[64];
        snprintf(key, sizeof key, "%s", entries[i].name);
        for (char *p = key; *p; p++)
            if (*p == '-') *p = '_';
        json_object_set_new(o, key, setting_json(si->cfg, &entries[i]));
    }
    const rs_engine_stats *st = si->stats;
    long long token_capacity = (long long)st->kv_blocks_total * RS_KV_PAGE_TOKENS;
    json_object_set_new(o, "version", json_string(RS_VERSION));
    json_object_set_new(o, "backend", json_string(si->backend));
    json_object_set_new(o, "model_path", rs_json_string_lossy(si->model.model_path));
    json_object_set_new(o, "served_model_name", rs_json_string_lossy(si->model.served_model_name));
    json_object_set_new(o, "architecture", json_string(si->model.architecture));
    json_object_set_new(o, "weight_version", rs_json_string_lossy(si->model.weight_version));
    json_object_set_new(o, "max_total_num_tokens", json_integer(token_capacity));
    json_object_set_new(o, "page_size", json_integer(RS_KV_PAGE_TOKENS));
    json_object_set_new(o, "max_context_len", json_integer(si->limits->max_context));
    json_object_set_new(o, "max_req_input_len", json_integer(si->limits->max_context - 1));
    json_object_set_new(o, "tp_size", json_integer(1));
    json_object_set_new(o, "dp_size", json_integer(1));
    json_object_set_new(o, "pp_size", json_integer(1));
    json_object_set_new(o, "ep_size", json_integer(1));
    /* SGLang server arguments that trainers compare with their own (slime's external engines):
     * what rolloutd does, in SGLang's terms. */
    json_object_set_new(o, "dtype", json_string("bfloat16"));
    json_object_set_new(o, "enable_memory_saver", json_false());
    json_object_set_new(o, "enable_return_routed_experts", json_false());
    json_object_set_new(o, "disaggregation_mode", json_string("null"));
    json_object_set_new(o, "encoder_only", json_false());
    json_object_set_new(o, "enable_metrics", json_true());
    json_object_set_new(o, "uptime_s", json_real(si->uptime_s));
    json_object_set_new(o, "memory_usage",
                        json_pack("{s:I,s:I,s:I}", "weight_bytes", (json_int_t)si->weight_bytes, "kv_cache_bytes",
                                  (json_int_t)si->kv_cache_bytes, "token_capacity", (json_int_t)token_capacity));
    const double gib = 1024.0 * 1024.0 * 1024.0;
    json_t *state = json_pack("{s:{s:f,s:f,s:I},s:i,s:i,s:i,s:b}", "memory_usage", "weight",
                              (double)si->weight_bytes / gib, "kvcache", (double)si->kv_cache_bytes / gib,
                              "token_capacity", (json_int_t)token_capacity, "num_running_reqs", st->n_running,
                              "num_waiting_reqs", st->n_waiting, "http_in_flight", si->http_in_flight, "paused",
                              (int)st->paused);
    json_t *states = json_array();
    json_array_append_new(states, state);
    json_object_set_new(o, "internal_states", states);
    return rs_json_dump(o, len);
}
