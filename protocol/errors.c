/*
 * errors.c — error and status bodies (see errors.h).
 */
#include "errors.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>

static char *dump(json_t *v, size_t *len) {
    if (!v) return NULL;
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    if (s && len) *len = strlen(s);
    return s;
}

/* Copies s into a JSON string value; text that is not valid UTF-8 (a message may quote request
 * bytes, or be cut inside a character) keeps its ASCII and has every other byte replaced by '?'. */
static json_t *safe_string(const char *s) {
    json_t *v = json_string(s);
    if (v) return v;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *p = buf; *p; p++)
        if ((unsigned char)*p >= 0x80) *p = '?';
    return json_string(buf);
}

char *rs_error_body(const rs_error *err, size_t *len) {
    json_t *inner = json_object();
    if (!inner) return NULL;
    json_object_set_new(inner, "message", safe_string(err->message));
    json_object_set_new(inner, "type", json_string(rs_err_type(err->code)));
    json_object_set_new(inner, "param", err->param[0] ? safe_string(err->param) : json_null());
    json_t *root = json_object();
    if (!root) {
        json_decref(inner);
        return NULL;
    }
    json_object_set_new(root, "error", inner);
    return dump(root, len);
}

char *rs_health_body(size_t *len) {
    return dump(json_pack("{s:s}", "status", "ok"), len);
}
