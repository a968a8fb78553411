/*
 * ops.c — operations route bodies (see ops.h).
 */
#include "ops.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "json_util.h"

int rs_abort_parse(const char *body, size_t len, rs_abort_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = rs_json_load_object(body, len, false, &root, err);
    if (rc != RS_OK) return rc;
    const char *key;
    json_t *v;
    bool have_rid = false;
    json_object_foreach(root, key, v) {
        if (json_is_null(v)) continue;
        if (strcmp(key, "rid") == 0) {
            if ((rc = rs_json_check_name(v, "rid", RS_RID_MAX, err)) != RS_OK) break;
            snprintf(out->rid, sizeof out->rid, "%s", json_string_value(v));
            have_rid = true;
        } else if (strcmp(key, "abort_all") == 0) {
            if ((rc = rs_json_get_bool(v, "abort_all", &out->abort_all, err)) != RS_OK) break;
        } else {
            rc = rs_error_set(err, RS_EINVAL, key, "unknown field '%s'", key);
            break;
        }
    }
    json_decref(root);
    if (rc == RS_OK && !have_rid && !out->abort_all)
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

int rs_pause_parse(const char *body, size_t len, rs_pause_mode *mode, rs_error *err) {
    *mode = RS_PAUSE_ABORT;
    json_t *root;
    int rc = rs_json_load_object(body, len, true, &root, err);
    if (rc != RS_OK) return rc;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "mode") != 0) {
            rc = rs_error_set(err, RS_EINVAL, key, "unknown field '%s'", key);
            break;
        }
        if (json_is_null(v)) continue;
        if (!json_is_string(v)) {
            rc = rs_json_bad_type(err, "mode", "\"abort\", \"retract\" or \"in_place\"", v);
            break;
        }
        size_t i = 0;
        while (i < RS_ARRAY_LEN(pause_names) && strcmp(json_string_value(v), pause_names[i]) != 0) i++;
        if (i == RS_ARRAY_LEN(pause_names)) {
            rc = rs_error_set(err, RS_EINVAL, "mode", "mode must be one of 'abort', 'retract', 'in_place', got '%.64s'",
                              json_string_value(v));
            break;
        }
        *mode = (rs_pause_mode)i;
    }
    json_decref(root);
    return rc;
}

int rs_empty_parse(const char *body, size_t len, const char *route, rs_error *err) {
    json_t *root;
    int rc = rs_json_load_object(body, len, true, &root, err);
    if (rc != RS_OK) return rc;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        (void)v;
        rc = rs_error_set(err, RS_EINVAL, key, "unknown field '%s' (%s takes no parameters)", key, route);
        break;
    }
    json_decref(root);
    return rc;
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
    json_object_set_new(o, "tokenizer_path", json_null());
    json_object_set_new(o, "architecture", json_string(mi->architecture));
    json_object_set_new(o, "is_generation", json_true());
    json_object_set_new(o, "weight_version", rs_json_string_lossy(mi->weight_version));
    json_object_set_new(o, "quantization", json_string(mi->quantization));
    json_object_set_new(o, "kv_cache_dtype", json_string(mi->kv_cache_dtype));
    json_object_set_new(o, "served_model_name", rs_json_string_lossy(mi->served_model_name));
    json_object_set_new(o, "fp8_checkpoint", json_boolean(mi->fp8_checkpoint));
    json_object_set_new(o, "vocab_size", json_integer(mi->vocab_size));
    json_object_set_new(o, "max_context_len", json_integer(mi->max_context_len));
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
