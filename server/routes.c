/*
 * routes.c — the route table: every path the server answers, the methods it takes, whether it is
 * open without the API key, and the handlers that serve it (rs_route_def, http_internal.h). http.c
 * looks a request's path up here once its headers are in and then only calls the row's handlers;
 * adding a route is one row here and its handlers.
 */
#include <string.h>

#include "../sync/sync.h"
#include "http_internal.h"
#include "weights_routes.h"

static const rs_route_def routes[] = {
    {"/health", RS_ROUTE_HEALTH, "GET", true, 0, rs_http_health, NULL, NULL},
    {"/health_generate", RS_ROUTE_HEALTH_GENERATE, "GET", false, 0, rs_http_gen_start, rs_http_gen_answer,
     rs_http_gen_cleanup},
    {"/generate", RS_ROUTE_GENERATE, "POST, PUT", false, 0, rs_http_gen_start, rs_http_gen_answer,
     rs_http_gen_cleanup}, /* SGLang takes both */
    {"/v1/completions", RS_ROUTE_COMPLETIONS, "POST", false, 0, rs_http_gen_start, rs_http_gen_answer,
     rs_http_gen_cleanup},
    {"/v1/models", RS_ROUTE_MODELS, "GET", false, 0, rs_http_models, NULL, NULL},
    {"/get_model_info", RS_ROUTE_MODEL_INFO, "GET", false, 0, rs_http_model_info, NULL, NULL},
    {"/model_info", RS_ROUTE_MODEL_INFO, "GET", false, 0, rs_http_model_info, NULL, NULL}, /* SGLang's newer names */
    {"/get_server_info", RS_ROUTE_SERVER_INFO, "GET", false, 0, rs_http_server_info, NULL, NULL},
    {"/server_info", RS_ROUTE_SERVER_INFO, "GET", false, 0, rs_http_server_info, NULL, NULL},
    {"/get_load", RS_ROUTE_LOAD, "GET", false, RS_LOAD_LIST, rs_http_load, NULL, NULL},
    {"/v1/loads", RS_ROUTE_LOAD, "GET", false, RS_LOAD_V1, rs_http_load, NULL, NULL}, /* SGLang's newer name */
    {"/get_weight_version", RS_ROUTE_WEIGHT_VERSION, "GET", false, 0, rs_http_weight_version, NULL, NULL},
    {"/metrics", RS_ROUTE_METRICS, "GET", true, 0, rs_http_metrics, NULL, NULL},
    {"/abort_request", RS_ROUTE_ABORT, "POST", false, 0, rs_http_abort, NULL, NULL},
    {"/pause_generation", RS_ROUTE_PAUSE, "POST", false, 0, rs_http_control, rs_http_control_answer,
     rs_http_control_cleanup},
    {"/continue_generation", RS_ROUTE_CONTINUE, "POST", false, 0, rs_http_control, rs_http_control_answer,
     rs_http_control_cleanup},
    {"/flush_cache", RS_ROUTE_FLUSH, "GET, POST", false, 0, rs_http_control, rs_http_control_answer,
     rs_http_control_cleanup}, /* SGLang takes both */
    {"/tokenize", RS_ROUTE_TOKENIZE, "POST", false, 0, rs_http_tokenize, NULL, NULL},
    {"/detokenize", RS_ROUTE_DETOKENIZE, "POST", false, 0, rs_http_tokenize, NULL, NULL},
    {"/update_weights_from_shm", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_SHM, rs_weights_routes_handle,
     rs_weights_routes_answer, rs_weights_routes_cleanup},
    {"/update_weights_from_disk", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_DISK, rs_weights_routes_handle,
     rs_weights_routes_answer, rs_weights_routes_cleanup},
    {"/update_weight_version", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_VERSION, rs_weights_routes_handle,
     rs_weights_routes_answer, rs_weights_routes_cleanup},
    {"/init_weights_update_group", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_NCCL_INIT, rs_weights_routes_handle,
     rs_weights_routes_answer, rs_weights_routes_cleanup},
    {"/update_weights_from_distributed", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_NCCL_UPDATE,
     rs_weights_routes_handle, rs_weights_routes_answer, rs_weights_routes_cleanup},
    {"/destroy_weights_update_group", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_NCCL_DESTROY,
     rs_weights_routes_handle, rs_weights_routes_answer, rs_weights_routes_cleanup},
};

const rs_route_def *rs_route_find(const char *path) {
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (strcmp(path, routes[i].path) == 0) return &routes[i];
    return NULL;
}

const char *rs_route_name(rs_route id) {
    if (id == RS_ROUTE_WEIGHTS) return "/update_weights"; /* the six weight routes count together */
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (routes[i].id == id) return routes[i].path;
    return "(none)";
}
