/*
 * openapi.h — the OpenAPI 3.1 description of the HTTP API (GET /openapi.json), made from the route
 * table (server/routes.c) and the descriptor tables the parsers read bodies with (json_util.h), so
 * that it says what the server checks: a body that the document's schema refuses is a 4xx, and
 * every error is the one error shape of errors.h.
 */
#ifndef RS_PROTOCOL_OPENAPI_H
#define RS_PROTOCOL_OPENAPI_H

#include <stdbool.h>
#include <stddef.h>

struct rs_jobject;
struct rs_jlimits;

typedef struct rs_openapi_route {
    const char *path;
    const char *methods;            /* as the Allow header lists them: "GET, POST" */
    const char *summary;
    const struct rs_jobject *body;  /* the body's table, or NULL: the route reads no body */
    const char *answer;             /* what a 200 holds: the name of one of openapi.c's answer schemas
                                     * ("Generation", "Status", ...) */
    bool open;                      /* answered without the API key */
} rs_openapi_route;

/* The document as compact JSON (new malloc'd string, *len set), or NULL when memory is exhausted.
 * api_key: the server has one (a bearer token guards every route that is not open). lim: the
 * server's limits and vocabulary, which the request schemas then state (NULL: the tables' ranges
 * alone, as while the model loads). */
char *rs_openapi_body(const rs_openapi_route *routes, size_t n, const char *version, bool api_key,
                      const struct rs_jlimits *lim, size_t *len);

#endif /* RS_PROTOCOL_OPENAPI_H */
