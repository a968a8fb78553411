/*
 * errors.c — error and status bodies (see errors.h).
 */
#include "errors.h"

#include <jansson.h>

#include "json_util.h"

char *rs_error_body(const rs_error *err, size_t *len) {
    json_t *inner = json_object();
    if (!inner) return NULL;
    json_object_set_new(inner, "message", rs_json_string_lossy(err->message));
    json_object_set_new(inner, "type", json_string(rs_err_type(err->code)));
    json_object_set_new(inner, "param", err->param[0] ? rs_json_string_lossy(err->param) : json_null());
    json_object_set_new(inner, "code", json_integer(rs_err_http_status(err->code)));
    json_t *root = json_object();
    if (!root) {
        json_decref(inner);
        return NULL;
    }
    json_object_set_new(root, "error", inner);
    return rs_json_dump(root, len);
}

char *rs_health_body(size_t *len) { return rs_json_dump(json_pack("{s:s}", "status", "ok"), len); }
