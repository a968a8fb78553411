/*
 * openapi.c — the OpenAPI document (see openapi.h).
 */
#include "openapi.h"

#include <string.h>

#include "json_util.h"

/* The error body of errors.h: {"error": {"message", "type", "param", "code"}}. */
#define ERROR_SCHEMA                                                                                        \
    "{'type': 'object', 'required': ['error'], 'properties': {'error': {'type': 'object', "                 \
    "'required': ['message', 'type', 'param', 'code'], 'properties': {'message': {'type': 'string'}, "      \
    "'type': {'type': 'string'}, 'param': {'type': ['string', 'null']}, "                                   \
    "'code': {'type': 'integer', 'minimum': 400, 'maximum': 599}}}}}"

static json_t *json_content(json_t *schema) { return json_pack("{s:{s:o}}", "application/json", "schema", schema); }

static json_t *ref(const char *name) {
    char r[96];
    snprintf(r, sizeof r, "#/components/schemas/%s", name);
    return json_pack("{s:s}", "$ref", r);
}

static json_t *error_response(const char *what) {
    return json_pack("{s:s, s:o}", "description", what, "content", json_content(ref("Error")));
}

/* ---------------------------------------------------------------- what a 200 holds */

/* The answers, as the writers of protocol/ make them (generate.c, openai.c, ops.c, tokenize.c,
 * weights.c): the fields a client relies on, typed, and room for more (additionalProperties stays
 * open: a new field is not a break). Written with ' for " (rs_json_quoted). */
typedef enum answer_kind {
    A_PART = 0, /* a part of other schemas, no route's answer of its own */
    A_JSON,     /* application/json */
    A_GEN,      /* application/json, or text/event-stream with stream: true */
    A_TEXT,     /* text/plain */
} answer_kind;

#define INT0  "{'type': 'integer', 'minimum': 0}"
#define LP    "{'type': ['number', 'null']}"
#define TOKEN "{'type': 'array', 'prefixItems': [" LP ", {'type': 'integer'}, {'type': ['string', 'null']}], " \
              "'minItems': 3, 'maxItems': 3}"
#define TOKENS "{'type': 'array', 'items': " TOKEN "}"
#define TOPS  "{'type': 'array', 'items': {'anyOf': [{'type': 'null'}, " TOKENS "]}}"
#define IDS   "{'type': 'array', 'items': {'type': 'integer'}}"

static const struct answer {
    const char *name;
    answer_kind kind;
    const char *schema;
} answers[] = {
    {"GenerateOutput", A_PART,
     "{'type': 'object', 'required': ['output_ids', 'meta_info'], 'properties': {"
     "'text': {'type': 'string'}, 'output_ids': " IDS ", "
     "'meta_info': {'type': 'object', "
     "'required': ['id', 'finish_reason', 'prompt_tokens', 'completion_tokens', 'weight_version'], 'properties': {"
     "'id': {'type': 'string'}, "
     "'finish_reason': {'anyOf': [{'type': 'null'}, {'type': 'object', 'required': ['type'], "
     "'properties': {'type': {'enum': ['length', 'stop', 'abort']}}}]}, "
     "'prompt_tokens': " INT0 ", 'completion_tokens': " INT0 ", 'cached_tokens': " INT0 ", "
     "'weight_version': {'type': 'string'}, 'num_retractions': " INT0 ", "
     "'weight_version_spans': {'type': 'array', 'items': {'type': 'array', 'prefixItems': [{'type': 'string'}, "
     INT0 ", " INT0 "], 'minItems': 3, 'maxItems': 3}}, "
     "'output_token_logprobs': " TOKENS ", 'input_token_logprobs': " TOKENS ", "
     "'output_top_logprobs': " TOPS ", 'input_top_logprobs': " TOPS ", 'e2e_latency': {'type': 'number'}}}}}"},
    {"Generation", A_GEN,
     "{'anyOf': [{'$ref': '#/components/schemas/GenerateOutput'}, "
     "{'type': 'array', 'items': {'$ref': '#/components/schemas/GenerateOutput'}}]}"},
    {"Completion", A_GEN,
     "{'type': 'object', 'required': ['id', 'object', 'created', 'model', 'choices'], 'properties': {"
     "'id': {'type': 'string'}, 'object': {'const': 'text_completion'}, 'created': {'type': 'integer'}, "
     "'model': {'type': 'string'}, "
     "'choices': {'type': 'array', 'items': {'type': 'object', 'required': ['index', 'text', 'finish_reason'], "
     "'properties': {'index': " INT0 ", 'text': {'type': 'string'}, "
     "'finish_reason': {'enum': ['length', 'stop', 'abort', null]}, "
     "'stop_reason': {'type': ['string', 'integer', 'null']}, 'token_ids': " IDS ", "
     "'logprobs': {'anyOf': [{'type': 'null'}, {'type': 'object', "
     "'required': ['tokens', 'token_logprobs', 'top_logprobs', 'text_offset'], 'properties': {"
     "'tokens': {'type': 'array', 'items': {'type': 'string'}}, 'token_logprobs': {'type': 'array', 'items': " LP "}, "
     "'top_logprobs': {'type': 'array', 'items': {'type': ['object', 'null']}}, "
     "'text_offset': {'type': 'array', 'items': " INT0 "}}}]}}}}, "
     "'usage': {'type': 'object', 'required': ['prompt_tokens', 'completion_tokens', 'total_tokens'], "
     "'properties': {'prompt_tokens': " INT0 ", 'completion_tokens': " INT0 ", 'total_tokens': " INT0 "}}}}"},
    {"Status", A_JSON,
     "{'type': 'object', 'required': ['status'], 'properties': {'status': {'const': 'ok'}, "
     "'message': {'type': 'string'}}}"},
    {"Models", A_JSON,
     "{'type': 'object', 'required': ['object', 'data'], 'properties': {'object': {'const': 'list'}, "
     "'data': {'type': 'array', 'items': {'type': 'object', 'required': ['id', 'object'], 'properties': {"
     "'id': {'type': 'string'}, 'object': {'const': 'model'}, 'created': {'type': 'integer'}, "
     "'owned_by': {'type': 'string'}, 'max_model_len': " INT0 "}}}}}"},
    {"ModelInfo", A_JSON,
     "{'type': 'object', 'required': ['model_path', 'architecture', 'is_generation', 'weight_version'], "
     "'properties': {'model_path': {'type': 'string'}, 'tokenizer_path': {'type': ['string', 'null']}, "
     "'architecture': {'type': 'string'}, 'is_generation': {'const': true}, 'weight_version': {'type': 'string'}, "
     "'quantization': {'type': 'string'}, 'kv_cache_dtype': {'type': 'string'}, 'vocab_size': " INT0 ", "
     "'max_context_len': " INT0 ", 'eos_token_ids': " IDS "}}"},
    {"ServerInfo", A_JSON,
     "{'type': 'object', 'required': ['version', 'weight_version', 'numerics', 'max_total_num_tokens'], "
     "'properties': {'version': {'type': 'string'}, 'weight_version': {'type': 'string'}, "
     "'numerics': {'enum': ['exact', 'fast']}, 'max_total_num_tokens': " INT0 ", "
     "'api_key': {'enum': ['', '(set)']}}}"},
    {"Load", A_PART,
     "{'type': 'object', 'required': ['dp_rank', 'num_reqs', 'num_waiting_reqs', 'num_tokens', 'num_pages'], "
     "'properties': {'dp_rank': " INT0 ", 'num_reqs': " INT0 ", 'num_waiting_reqs': " INT0 ", "
     "'num_tokens': " INT0 ", 'num_pages': " INT0 ", 'num_running_reqs': " INT0 ", "
     "'token_usage': {'type': 'number', 'minimum': 0, 'maximum': 1}}}"},
    {"LoadList", A_JSON, "{'type': 'array', 'items': {'$ref': '#/components/schemas/Load'}}"},
    {"Loads", A_JSON,
     "{'type': 'object', 'required': ['loads'], 'properties': {"
     "'loads': {'type': 'array', 'items': {'$ref': '#/components/schemas/Load'}}}}"},
    {"WeightVersion", A_JSON,
     "{'type': 'object', 'required': ['weight_version'], 'properties': {'weight_version': {'type': 'string'}}}"},
    {"Metrics", A_TEXT, "{'type': 'string'}"},
    {"OpenAPI", A_JSON,
     "{'type': 'object', 'required': ['openapi', 'info', 'paths'], 'properties': {'openapi': {'type': 'string'}}}"},
    {"Aborted", A_JSON,
     "{'type': 'object', 'required': ['success', 'aborted'], 'properties': {'success': {'const': true}, "
     "'aborted': " INT0 "}}"},
    {"Tokens", A_JSON,
     "{'type': 'object', 'required': ['tokens', 'count', 'max_model_len'], 'properties': {"
     "'tokens': {'anyOf': [" IDS ", {'type': 'array', 'items': " IDS "}]}, "
     "'count': {'anyOf': [" INT0 ", {'type': 'array', 'items': " INT0 "}]}, 'max_model_len': " INT0 "}}"},
    {"Text", A_JSON,
     "{'type': 'object', 'required': ['text', 'prompt'], 'properties': {"
     "'text': {'type': ['string', 'array'], 'items': {'type': 'string'}}, "
     "'prompt': {'type': ['string', 'array'], 'items': {'type': 'string'}}}}"},
    {"WeightUpdate", A_JSON,
     "{'type': 'object', 'required': ['success', 'message'], 'properties': {'success': {'type': 'boolean'}, "
     "'message': {'type': 'string'}, 'weight_version': {'type': 'string'}}}"},
};

static const struct answer *answer_of(const char *name) {
    for (size_t i = 0; i < sizeof answers / sizeof answers[0]; i++)
        if (strcmp(answers[i].name, name) == 0) return &answers[i];
    RS_ASSERT(!"a route names an answer schema that openapi.c does not have");
    return NULL;
}

static json_t *ok_response(const char *name) {
    const struct answer *a = answer_of(name);
    json_t *content = NULL;
    switch (a->kind) {
    case A_JSON: content = json_content(ref(name)); break;
    case A_GEN:
        content = json_content(ref(name));
        /* one Server-Sent Event: its data is the answer so far as JSON (the application/json
         * schema), then [DONE] */
        json_object_set_new(content, "text/event-stream",
                            json_pack("{s:o}", "schema", rs_json_quoted(
                                "{'type': 'object', 'required': ['data'], 'properties': {'data': {'type': 'string', "
                                "'description': 'the answer so far as application/json has it, then [DONE]'}, "
                                "'event': {'type': 'string'}}}")));
        break;
    case A_TEXT: content = json_pack("{s:{s:o}}", "text/plain", "schema", ref(name)); break;
    case A_PART: RS_ASSERT(!"a part is no route's answer"); break;
    }
    return json_pack("{s:s, s:o}", "description", "OK", "content", content);
}

static json_t *operation(const rs_openapi_route *r, const char *method, const rs_jlimits *lim) {
    json_t *responses = json_pack("{s:o, s:o, s:o}", "200", ok_response(r->answer), "4XX",
                                  error_response("the request was refused: what and why are in the message, the field "
                                                 "at fault in param"),
                                  "503", error_response("starting or shutting down, too many requests waiting, "
                                                        "a resource busy; retry"));
    /* operationId: method and path, e.g. post_update_weights_from_shm */
    char id[128];
    size_t o = (size_t)snprintf(id, sizeof id, "%s", method);
    for (const char *p = r->path; *p && o + 1 < sizeof id; p++) id[o++] = (*p == '/' || *p == '.') ? '_' : *p;
    id[o] = '\0';
    json_t *op = json_pack("{s:s, s:s, s:o}", "summary", r->summary, "operationId", id, "responses", responses);
    if (r->body && strcmp(method, "get") != 0) {
        bool required = r->body->one_of != NULL; /* one of some fields: a body */
        for (size_t i = 0; i < r->body->n; i++) required |= (r->body->fields[i].flags & RS_JF_REQUIRED) != 0;
        json_object_set_new(op, "requestBody", json_pack("{s:b, s:o}", "required", required, "content",
                                                         json_content(rs_json_schema(r->body, lim))));
    }
    if (r->open) json_object_set_new(op, "security", json_array()); /* no key needed */
    return op;
}

char *rs_openapi_body(const rs_openapi_route *routes, size_t n, const char *version, bool api_key,
                      const rs_jlimits *lim, size_t *len) {
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
                json_object_set_new(item, m, operation(r, m, lim));
            }
            p += k;
            p += strspn(p, ", ");
        }
        json_object_set_new(paths, r->path, item);
    }
    json_t *schemas = json_pack("{s:o}", "Error", rs_json_quoted(ERROR_SCHEMA));
    for (size_t i = 0; schemas && i < sizeof answers / sizeof answers[0]; i++)
        json_object_set_new(schemas, answers[i].name, rs_json_quoted(answers[i].schema));
    json_t *components = json_pack("{s:o}", "schemas", schemas);
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
    /* 17 digits: every bound reads back as the double the walker compares with (2^-150 as 9 digits
     * would read back below it) */
    char *text = doc ? json_dumps(doc, JSON_COMPACT | JSON_REAL_PRECISION(17)) : NULL;
    json_decref(doc);
    if (text) *len = strlen(text);
    return text;
}
