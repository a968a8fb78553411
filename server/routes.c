/*
 * routes.c — the route table: every path the server answers, the methods it takes, whether it is
 * open without the API key, and the handlers that serve it (rs_route_def, http_internal.h). http.c
 * looks a request's path up here once its headers are in and then only calls the row's handlers;
 * adding a route is one row here and its handlers. The rows also describe the routes for GET
 * /openapi.json (a summary, the body's descriptor table, the name of the answer's schema).
 */
#include <string.h>

#include "../protocol/ops.h"
#include "../protocol/tokenize.h"
#include "../protocol/weights.h"
#include "../sync/sync.h"
#include "http_internal.h"
#include "weights_routes.h"

#define GEN rs_http_gen_start, rs_http_gen_answer, rs_http_gen_cleanup
#define CTL rs_http_control, rs_http_control_answer, rs_http_control_cleanup
#define WTS rs_weights_routes_handle, rs_weights_routes_answer, rs_weights_routes_cleanup
static const rs_route_def routes[] = {
    {"/health", RS_ROUTE_HEALTH, "GET", true, 0, rs_http_health, NULL, NULL,
     "200 once the model is loaded and the engine runs (503 while starting or draining)", NULL, "Status"},
    {"/health_generate", RS_ROUTE_HEALTH_GENERATE, "GET", false, 0, GEN,
     "200 once a one-token generation went through the engine", NULL, "Status"},
    {"/generate", RS_ROUTE_GENERATE, "POST, PUT", false, 0, GEN, /* SGLang takes both */
     "SGLang's generation: sampled tokens with their logprobs", &rs_generate_fields, "Generation"},
    {"/v1/completions", RS_ROUTE_COMPLETIONS, "POST", false, 0, GEN, "OpenAI's completions",
     &rs_openai_completion_fields, "Completion"},
    {"/v1/models", RS_ROUTE_MODELS, "GET", false, 0, rs_http_models, NULL, NULL,
     "OpenAI's model list: the served model", NULL, "Models"},
    {"/get_model_info", RS_ROUTE_MODEL_INFO, "GET", false, 0, rs_http_model_info, NULL, NULL,
     "the model: path, architecture, quantization", NULL, "ModelInfo"},
    {"/model_info", RS_ROUTE_MODEL_INFO, "GET", false, 0, rs_http_model_info, NULL, NULL, /* SGLang's newer names */
     "the model (SGLang's newer name of /get_model_info)", NULL, "ModelInfo"},
    {"/get_server_info", RS_ROUTE_SERVER_INFO, "GET", false, 0, rs_http_server_info, NULL, NULL,
     "the settings, the engine's state and counters", NULL, "ServerInfo"},
    {"/server_info", RS_ROUTE_SERVER_INFO, "GET", false, 0, rs_http_server_info, NULL, NULL,
     "the settings and state (SGLang's newer name of /get_server_info)", NULL, "ServerInfo"},
    {"/get_load", RS_ROUTE_LOAD, "GET", false, RS_LOAD_LIST, rs_http_load, NULL, NULL,
     "SGLang's load list: running and waiting requests, tokens in use", NULL, "LoadList"},
    {"/v1/loads", RS_ROUTE_LOAD, "GET", false, RS_LOAD_V1, rs_http_load, NULL, NULL, /* SGLang's newer name */
     "the load (SGLang's newer shape)", NULL, "Loads"},
    {"/get_weight_version", RS_ROUTE_WEIGHT_VERSION, "GET", false, 0, rs_http_weight_version, NULL, NULL,
     "the version of the weights being served", NULL, "WeightVersion"},
    {"/metrics", RS_ROUTE_METRICS, "GET", true, 0, rs_http_metrics, NULL, NULL, "Prometheus metrics", NULL,
     "Metrics"},
    {"/openapi.json", RS_ROUTE_OPENAPI, "GET", false, 0, rs_http_openapi, NULL, NULL, "this document", NULL,
     "OpenAPI"},
    {"/abort_request", RS_ROUTE_ABORT, "POST", false, 0, rs_http_abort, NULL, NULL,
     "aborts a request by rid, or every request", &rs_abort_fields, "Aborted"},
    {"/pause_generation", RS_ROUTE_PAUSE, "POST", false, 0, CTL, "pauses generation (abort, retract or in place)",
     &rs_pause_fields, "Status"},
    {"/continue_generation", RS_ROUTE_CONTINUE, "POST", false, 0, CTL, "resumes generation after a pause",
     &rs_continue_fields, "Status"},
    {"/flush_cache", RS_ROUTE_FLUSH, "GET, POST", false, 0, CTL, /* SGLang takes both */
     "drops the cached prefixes (409 while requests run)", &rs_flush_fields, "Status"},
    {"/tokenize", RS_ROUTE_TOKENIZE, "POST", false, 0, rs_http_tokenize, NULL, NULL, "text to token ids",
     &rs_tokenize_fields, "Tokens"},
    {"/detokenize", RS_ROUTE_DETOKENIZE, "POST", false, 0, rs_http_tokenize, NULL, NULL, "token ids to text",
     &rs_detokenize_fields, "Text"},
    {"/update_weights_from_shm", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_SHM, WTS,
     "stages (and commits) a bucket of tensors from a POSIX shared-memory segment", &rs_shm_update_fields,
     "WeightUpdate"},
    {"/update_weights_from_disk", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_DISK, WTS,
     "loads new weights from a safetensors directory below --allowed-weight-dir", &rs_disk_update_fields,
     "WeightUpdate"},
    {"/update_weight_version", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_VERSION, WTS,
     "renames the version being served", &rs_version_update_fields, "WeightUpdate"},
    {"/init_weights_update_group", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_NCCL_INIT, WTS,
     "joins the trainer's NCCL group (a TCPStore rendezvous, or an ncclUniqueId)", &rs_nccl_group_fields,
     "WeightUpdate"},
    {"/update_weights_from_distributed", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_NCCL_UPDATE, WTS,
     "receives tensors broadcast over the NCCL group", &rs_nccl_update_fields, "WeightUpdate"},
    {"/destroy_weights_update_group", RS_ROUTE_WEIGHTS, "POST", false, RS_SYNC_NCCL_DESTROY, WTS,
     "leaves the NCCL group", &rs_nccl_destroy_fields, "WeightUpdate"},
};
#undef GEN
#undef CTL
#undef WTS

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

char *rs_routes_openapi(bool api_key, const struct rs_jlimits *lim, size_t *len) {
    rs_openapi_route doc[sizeof routes / sizeof routes[0]];
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        doc[i] = (rs_openapi_route){.path = routes[i].path, .methods = routes[i].allow, .summary = routes[i].summary,
                                    .body = routes[i].body, .answer = routes[i].answer_schema, .open = routes[i].open};
    return rs_openapi_body(doc, sizeof routes / sizeof routes[0], RS_VERSION, api_key, lim, len);
}
