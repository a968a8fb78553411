/*
 * openapi.c — the OpenAPI document (see openapi.h).
 */
#include "openapi.h"

#include <string.h>

#include "json_util.h"

/* The error body of errors.h: {"error": {"message", "type", "param"}}. */
static json_t *error_schema(void) {
    return json_pack("{s:s, s:[s], s:{s:{s:s, s:[s,s,s], s:{s:{s:s}, s:{s:s}, s:{s:[s,s]}}}}}", "type", "object",
                     "required", "error", "properties", "error", "type", "object", "required", "message", "type",
                     "param", "properties", "message", "type", "string", "type", "type", "string", "param", "type",
                     "string", "null");
}

static json_t *json_content(json_t *schema) { return json_pack("{s:{s:o}}", "application/json", "schema", schema); }

static json_t *error_response(const char *what) {
    return json_pack("{s:s, s:o}", "description", what,
                     "content", json_content(json_pack("{s:s}", "$ref", "#/components/schemas/Error")));
}

static json_t *ok_response(rs_openapi_answer a) {
    json_t *content = NULL;
    switch (a) {
    case RS_OA_JSON: content = json_content(json_pack("{s:s}", "type", "object")); break;
    case RS_OA_LIST: content = json_content(json_pack("{s:s, s:{s:s}}", "type", "array", "items", "type", "object")); break;
    case RS_OA_GENERATE:
        content = json_content(json_pack("{s:[{s:s}, {s:s, s:{s:s}}]}", "anyOf", "type", "object", "type", "array",
                                         "items", "type", "object"));
        json_object_set_new(content, "text/event-stream", json_pack("{s:{s:s}}", "schema", "type", "string"));
        break;
    case RS_OA_TEXT: content = json_pack("{s:{s:{s:s}}}", "text/plain", "schema", "type", "string"); break;
    }
    return json_pack("{s:s, s:o}", "description", "OK", "content", content);
}

static json_t *operation(const rs_openapi_route *r, const char *method) {
    json_t *responses = json_pack("{s:o, s:o, s:o}", "200", ok_response(r->answer), "4XX",
                                  error_response("the request was refused: what and why are in the message, the field "
                                                 "at fault in param"),
                                  "503", error_response("starting, draining, paused past the wait, or at capacity"));
    json_t *op = json_pack("{s:s, s:s, s:o}", "summary", r->summary, "operationId", "", "responses", responses);
    /* operationId: method and path, e.g. post_update_weights_from_shm */
    char id[128];
    size_t o = (size_t)snprintf(id, sizeof id, "%s", method);
    for (const char *p = r->path; *p && o + 1 < sizeof id; p++) id[o++] = (*p == '/' || *p == '.') ? '_' : *p;
    id[o] = '\0';
    json_object_set_new(op, "operationId", json_string(id));
    if (r->body && strcmp(method, "get") != 0) {
        bool required = false;
        for (size_t i = 0; i < r->body->n; i++) required |= (r->body->fields[i].flags & RS_JF_REQUIRED) != 0;
        json_object_set_new(op, "requestBody", json_pack("{s:b, s:o}", "required", required, "content",
                                                         json_content(rs_json_schema(r->body))));
    }
    if (r->open) json_object_set_new(op, "security", json_array()); /* no key needed */
    return op;
}

char *rs_openapi_body(const rs_openapi_route *routes, size_t n, const char *version, bool api_key, size_t *len) {
    json_t *paths = json_object();
    for (size_t i = 0; i < n; i++) {
        const rs_openapi_route *r = &routes[i];
        json_t *item = json_object();
        for (const char *p = r->methods; *p;) {
            size_t k = strcspn(p, ", ");
            char m[8] = "";
            if (k < sizeof m) {
                for (size_t j = 0; j < k; j++) m[j] = (char)(p[j] | 0x20); /* "GET" -> "get" */
                m[k] = '\0';
                json_object_set_new(item, m, operation(r, m));
            }
            p += k;
            p += strspn(p, ", ");
        }
        json_object_set_new(paths, r->path, item);
    }
    json_t *components = json_pack("{s:{s:o}}", "schemas", "Error", error_schema());
    json_t *doc = json_pack("{s:s, s:{s:s, s:s, s:s}, s:o, s:o}", "openapi", "3.1.0", "info", "title", "rolloutd",
                            "version", version, "description",
                            "A rollout server for LLM reinforcement learning: SGLang's and OpenAI's request shapes, "
                            "weight updates, operations. Field reference: docs/api-fields.md.",
                            "paths", paths, "components", components);
    if (doc && api_key) {
        json_object_set_new(components, "securitySchemes",
                            json_pack("{s:{s:s, s:s}}", "bearer", "type", "http", "scheme", "bearer"));
        json_object_set_new(doc, "security", json_pack("[{s:[]}]", "bearer"));
    }
    return rs_json_dump(doc, len);
}
