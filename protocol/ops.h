/*
 * ops.h — bodies of the operations routes (SGLang's shapes): /abort_request, /pause_generation,
 * /continue_generation, /flush_cache, /get_model_info, /get_server_info, /get_weight_version.
 *
 * Request bodies are read by descriptor tables as strictly as /generate's (every field SGLang's
 * request struct defines is known; unknown fields are 400s naming them); the routes whose body is
 * optional in SGLang (pause, continue, flush) take an empty body as {}. GET /get_load answers in
 * SGLang's shape.
 */
#ifndef RS_PROTOCOL_OPS_H
#define RS_PROTOCOL_OPS_H

#include <stdbool.h>
#include <stddef.h>

#include "../config/config.h"
#include "../core/rs.h"
#include "../scheduler/engine.h"
#include "generate.h"

#define RS_VERSION "0.1.0"
#define RS_KV_PAGE_TOKENS 16 /* tokens per KV page (kvcache/) */

/* POST /abort_request: {"rid": "..."} or {"abort_all": true} (a rid and abort_all: everything). */
typedef struct rs_abort_req {
    char rid[RS_RID_MAX + 1];   /* "" with abort_all */
    bool abort_all;
} rs_abort_req;
int rs_abort_parse(const char *body, size_t len, rs_abort_req *out, rs_error *err);
/* {"success":true,"aborted":n}: n = requests in flight that matched. */
char *rs_abort_body(int n_aborted, size_t *len);

/* POST /pause_generation: {"mode": "abort"|"retract"|"in_place"}; empty body or no mode = abort
 * (SGLang's default). */
int rs_pause_parse(const char *body, size_t len, rs_pause_mode *mode, rs_error *err);
const char *rs_pause_mode_name(rs_pause_mode mode);

/* POST /continue_generation and /flush_cache: nothing rolloutd uses (an empty body, {}, or SGLang's
 * fields at values without effect). */
int rs_continue_parse(const char *body, size_t len, rs_error *err);
int rs_flush_parse(const char *body, size_t len, rs_error *err);

/* The bodies' descriptor tables (json_util.h), for the field reference. */
struct rs_jobject;
extern const struct rs_jobject rs_abort_fields, rs_pause_fields, rs_continue_fields, rs_flush_fields;

/* GET /get_load, SGLang's shape: one entry per data-parallel rank (rolloutd is one rank),
 * [{"dp_rank":0, "num_reqs": running + waiting, "num_waiting_reqs", "num_tokens": KV tokens in
 * use + the waiting sequences' tokens, "num_pages": the same in 16-token pages}] (SGLang's
 * scheduler get_load; sglang-router sums num_tokens across a worker's entries). */
char *rs_load_body(const rs_engine_stats *st, size_t *len);
/* GET /v1/loads (SGLang's newer load route, its "core" section): {"loads": [that entry plus
 * "num_running_reqs" and "token_usage", the KV pages in use / all]}. */
char *rs_loads_body(const rs_engine_stats *st, size_t *len);

/* {"status":"ok","message":message} (all bodies below: new malloc'd text and *len, NULL on OOM) */
char *rs_status_body(const char *message, size_t *len);
/* {"weight_version":"17"} */
char *rs_weight_version_body(const char *version, size_t *len);

typedef struct rs_model_info {
    const char *model_path;     /* the directory loaded */
    const char *served_model_name;
    const char *architecture;   /* "Qwen3ForCausalLM" */
    const char *weight_version;
    const char *quantization;   /* "fp8" | "bf16" (the setting) */
    const char *kv_cache_dtype;
    bool fp8_checkpoint;        /* the checkpoint itself was FP8 */
    int vocab_size;
    int max_context_len;        /* effective tokens per sequence */
    const char *tokenizer_path; /* the tokenizer.json served, NULL when the model has none */
    int bos_token_id;           /* the model's (config.json), -1 when absent */
    const int *eos_token_ids;   /* [n_eos] the ids that end an output (config / generation_config) */
    int n_eos;
} rs_model_info;
/* {"model_path","tokenizer_path":path|null,"architecture","is_generation":true,"weight_version",
 *  "quantization","kv_cache_dtype","served_model_name","fp8_checkpoint","vocab_size","max_context_len",
 *  "bos_token_id":id|null,"eos_token_id":first|null,"eos_token_ids":[..]} */
char *rs_model_info_body(const rs_model_info *mi, size_t *len);

typedef struct rs_server_info {
    const rs_config *cfg;       /* every setting, as configured */
    rs_model_info model;
    const char *backend;        /* "cpu" */
    const rs_engine_limits *limits; /* effective request limits */
    const rs_engine_stats *stats;
    size_t weight_bytes;        /* resident bytes of the weights on the backend */
    size_t kv_cache_bytes;      /* the KV pool budget (kv-cache-mb) */
    int http_in_flight;
    double uptime_s;
} rs_server_info;
/* Every setting of the config table as a top-level key (dashes as underscores; typed; secrets
 * "(set)" or ""), then the facts: version, backend, model_path, served_model_name, architecture,
 * weight_version (the live one), max_total_num_tokens (KV pages x 16), page_size, max_context_len,
 * max_req_input_len, tp/dp/pp/ep_size (1: one device), memory_usage {weight_bytes, kv_cache_bytes,
 * token_capacity}, and SGLang's internal_states[0] {memory_usage {weight, kvcache} in GiB,
 * token_capacity, num_running_reqs, num_waiting_reqs, paused}. */
char *rs_server_info_body(const rs_server_info *si, size_t *len);

#endif /* RS_PROTOCOL_OPS_H */
