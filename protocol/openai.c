/*
 * openai.c — /v1/completions parser and writers (see openai.h).
 *
 * The request is read by a descriptor table (json_util.h) that lists every field of vLLM's
 * CompletionRequest (vllm/entrypoints/openai/completion/protocol.py, vllm-project/vllm at
 * d5dba2d7, mid 2026), of SGLang's (python/sglang/srt/entrypoints/openai/protocol.py,
 * sgl-project/sglang at 004c82e0: sglang-router re-serializes every completion with its
 * no_stop_trim, skip_special_tokens and return_hidden_states defaults filled in) and of OpenAI's
 * completions API (best_of), plus rolloutd's logprobs_mode.
 * Ranges follow vLLM's SamplingParams (presence and frequency penalties in [-2, 2], repetition
 * penalty > 0). Every error names the field as the client wrote it.
 */
#include "openai.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "invalid.h"
#include "json_util.h"

#define RS_OPENAI_DEFAULT_MAX_TOKENS 16 /* OpenAI's and vLLM's default for completions */

/* ---------------------------------------------------------------- request */

enum { B_REQ, B_JOB, B_SP, B_TEXT }; /* destinations: rs_openai_req, its rs_gen_job, the job's sampling params,
                                       * its rs_gen_text */

#define DST(T, b, field) .base = b, .offset = offsetof(T, field), .size = sizeof(((T *)0)->field)
#define REQ(field) DST(rs_openai_req, B_REQ, field)
#define JOB(field) DST(rs_gen_job, B_JOB, field)
#define SP(field) DST(rs_sampling_params, B_SP, field)
#define TXT(field) DST(rs_gen_text, B_TEXT, field)

static rs_openai_req *req_of(const rs_jctx *c) { return c->dst[B_REQ]; }

static int no_tokenizer(rs_error *err) {
    return rs_error_set(err, RS_EINVAL, "prompt",
                        "rolloutd takes token ids (no tokenizer configured): the model directory has no "
                        "tokenizer.json, so prompt must be a list of token ids or a list of lists");
}

/* Text prompts (a string, or a list of strings) or token ids (a list, or a list of lists). */
static int read_prompt(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_openai_req *r = req_of(c);
    bool text = json_is_string(v) || (json_is_array(v) && json_is_string(json_array_get(v, 0)));
    if (!text) {
        for (size_t p = 0; json_is_array(v) && p < json_array_size(v); p++)
            if (json_is_string(json_array_get(v, p))) {
                char path[64];
                snprintf(path, sizeof path, "%s[%zu]", c->param, p);
                return r->tok ? rs_json_bad_type(err, path, "a list of token ids (prompt[0] is one)",
                                                 json_array_get(v, p))
                              : no_tokenizer(err);
            }
        return rs_json_get_prompts(v, c->param, r->job, err);
    }
    if (!r->tok) return no_tokenizer(err);
    int rc = rs_json_get_text_prompts(v, c->param, r->tok, r->add_special_tokens, r->job, err);
    if (rc != RS_OK) return rc;
    r->prompt_texts = rs_xcalloc((size_t)r->job->n_prompts, sizeof *r->prompt_texts);
    r->prompt_text_lens = rs_xcalloc((size_t)r->job->n_prompts, sizeof *r->prompt_text_lens);
    for (int p = 0; p < r->job->n_prompts; p++) {
        const json_t *s = json_is_string(v) ? v : json_array_get(v, (size_t)p);
        r->prompt_text_lens[p] = json_string_length(s);
        r->prompt_texts[p] = rs_xmalloc(r->prompt_text_lens[p] + 1);
        memcpy(r->prompt_texts[p], json_string_value(s), r->prompt_text_lens[p] + 1);
    }
    return RS_OK;
}

static int read_stops(const rs_jctx *c, const json_t *v, bool regex, rs_error *err) {
    rs_openai_req *r = req_of(c);
    int rc = rs_json_read_stops(v, c->param, r->text, regex, err);
    if (rc == RS_OK && rs_gen_text_has_stops(r->text) && !r->tok) return rs_generate_no_tokenizer(c->param, err);
    return rc;
}

static int read_stop(const rs_jctx *c, const json_t *v, rs_error *err) { return read_stops(c, v, false, err); }
static int read_stop_regex(const rs_jctx *c, const json_t *v, rs_error *err) { return read_stops(c, v, true, err); }

static int read_model(const rs_jctx *c, const json_t *v, rs_error *err) {
    if (!json_is_string(v)) return rs_json_bad_type(err, c->param, "a string", v);
    if (json_string_length(v) > RS_OPENAI_MODEL_MAX)
        return rs_error_set(err, RS_EINVAL, c->param, "model must be at most %d bytes", RS_OPENAI_MODEL_MAX);
    snprintf(req_of(c)->model, sizeof req_of(c)->model, "%s", json_string_value(v));
    return RS_OK;
}

static int read_request_id(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_openai_req *r = req_of(c);
    int rc = rs_json_check_name(v, c->param, RS_RID_MAX - 5, err);
    if (rc != RS_OK) return rc;
    snprintf(r->request_id, sizeof r->request_id, "%s", json_string_value(v));
    snprintf(r->id, sizeof r->id, "cmpl-%.*s", RS_RID_MAX - 5, r->request_id);
    return RS_OK;
}

/* SGLang's rid: one string is the request_id; one per prompt (a list) is not implemented. */
static int read_rid(const rs_jctx *c, const json_t *v, rs_error *err) {
    if (json_is_string(v)) return read_request_id(c, v, err);
    if (!json_is_array(v)) return rs_json_bad_type(err, c->param, "a string", v);
    return rs_error_set(err, RS_EUNSUPPORTED, c->param, "%s is not supported: it is not implemented in rolloutd "
                        "(one rid per prompt; give one string, or request_id)", c->param);
}

/* An explicit null is the default, as absent (vLLM's CompletionRequest.normalize_null_max_tokens:
 * null once meant the whole context there, which ran generations to its end unasked). */
static int read_max_tokens(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_openai_req *r = req_of(c);
    if (json_is_null(v)) return RS_OK;
    long long x;
    int rc = rs_json_get_int(v, c->param, 0, INT_MAX, &x, err);
    if (rc == RS_OK) r->job->sp.max_new_tokens = (int)x;
    r->max_tokens_given = rc == RS_OK;
    return rc;
}

static int read_seed(const rs_jctx *c, const json_t *v, rs_error *err) { /* vLLM takes any 64-bit integer */
    long long x;
    int rc = rs_json_get_int(v, c->param, LLONG_MIN, LLONG_MAX, &x, err);
    if (rc != RS_OK) return rc;
    req_of(c)->job->sp.seed = (uint64_t)x;
    req_of(c)->seed_given = true;
    return RS_OK;
}

static int read_best_of(const rs_jctx *c, const json_t *v, rs_error *err) {
    long long x;
    int rc = rs_json_get_int(v, c->param, 1, INT_MAX, &x, err);
    if (rc != RS_OK || x == req_of(c)->job->sp.n) return rc;
    return rs_error_set(err, RS_EUNSUPPORTED, c->param, "%s is not supported: it is not implemented in rolloutd "
                        "(best_of must equal n: there is no beam or best-of search); got %lld with n = %d", c->param,
                        x, req_of(c)->job->sp.n);
}

static const rs_jfield stream_options_fields[] = {
    {.name = "include_usage", .type = RS_JT_BOOL, REQ(include_usage), .def = "false",
     .doc = "a last chunk with no choices and the usage"},
    {.name = "continuous_usage_stats", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "usage comes once, at the end (include_usage)"},
    {.name = "include_obfuscation", .type = RS_JT_BOOL, .use = RS_JU_NO_EFFECT,
     .doc = "OpenAI's stream padding against side channels (the openai client sends it); none is added"},
};

static const rs_jobject stream_options_object = {.title = "POST /v1/completions: stream_options",
                                                 .fields = stream_options_fields,
                                                 .n = RS_ARRAY_LEN(stream_options_fields)};

static int read_stream_options(const rs_jctx *c, const json_t *v, rs_error *err) {
    if (!req_of(c)->stream) return rs_error_set(err, RS_EINVAL, c->param, "stream_options needs stream: true");
    return rs_json_read(v, &stream_options_object, c->dst, c->param, err);
}

/* CompletionRequest: every field of vLLM's (and OpenAI's), in the order they are read. */
static const rs_jfield completion_fields[] = {
    {.name = "add_special_tokens", .type = RS_JT_BOOL, .flags = RS_JF_TOKENIZER, REQ(add_special_tokens),
     .def = "true", .doc = "string prompts are encoded with the tokenizer's special tokens (its post-processor)"},
    {.name = "prompt", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED, .read = read_prompt,
     .shape = "string, list of strings, list of token ids, or a list of such lists (a batch)",
     .doc = "the prompt(s); strings need the model's tokenizer.json",
     .schema = "{'anyOf': [{'type': 'string', 'minLength': 1}, {'type': 'array', 'minItems': 1, "
               "'items': {'type': 'string', 'minLength': 1}}, '$ids1', {'type': 'array', 'minItems': 1, "
               "'items': '$ids1'}]}"},
    {.name = "model", .type = RS_JT_CUSTOM, .read = read_model, .shape = "string (<= 255 bytes)",
     .doc = "must be the served model name when given (404 otherwise)",
     .schema = "{'type': 'string', 'maxLength': 255}"},
    {.name = "request_id", .type = RS_JT_CUSTOM, .read = read_request_id, .shape = "string (<= 122 bytes)",
     .doc = "vLLM's: the answer's id becomes cmpl-<request_id>; /abort_request takes either",
     .schema = "{'type': 'string', 'minLength': 1, 'maxLength': 122, 'pattern': '$name'}"},
    {.name = "max_tokens", .type = RS_JT_CUSTOM, .flags = RS_JF_READ_NULL,
     .limit = RS_JL_NEW_TOKENS, .read = read_max_tokens,
     .shape = "integer >= 0, or null", .def = "16",
     .doc = "absent or null (vLLM's reading of null): the default, lowered to --max-new-tokens and the context",
     .schema = "{'type': 'integer', 'minimum': 0, 'maximum': 2147483647}"},
    {.name = "temperature", .type = RS_JT_FLOAT, SP(temperature), .min = 0, .max = INFINITY, .def = "1.0",
     .doc = "0 = greedy"},
    {.name = "top_p", .type = RS_JT_FLOAT, .flags = RS_JF_MIN_OPEN, SP(top_p), .min = 0, .max = 1, .def = "1.0",
     .doc = "nucleus truncation"},
    {.name = "top_k", .type = RS_JT_INT, .flags = RS_JF_ZERO_OFF, SP(top_k), .min = -1, .max = INT_MAX, .def = "-1",
     .doc = "0 or -1 = off (vLLM)"},
    {.name = "min_p", .type = RS_JT_FLOAT, SP(min_p), .min = 0, .max = 1, .def = "0.0",
     .doc = "drop tokens below min_p x the most likely one's probability"},
    {.name = "frequency_penalty", .type = RS_JT_FLOAT, SP(frequency_penalty), .min = -2, .max = 2, .def = "0.0",
     .doc = "logit -= this x the token's count in this choice's output (before temperature)"},
    {.name = "presence_penalty", .type = RS_JT_FLOAT, SP(presence_penalty), .min = -2, .max = 2, .def = "0.0",
     .doc = "logit -= this once the token occurs in this choice's output"},
    {.name = "repetition_penalty", .type = RS_JT_FLOAT, .flags = RS_JF_MIN_OPEN, SP(repetition_penalty), .min = 0,
     .max = INFINITY, .def = "1.0",
     .doc = "for tokens in this choice's output (SGLang's rule; vLLM also counts the prompt): a positive logit "
            "is divided by it, a negative one multiplied"},
    {.name = "n", .type = RS_JT_INT, SP(n), .min = 1, .max = INT_MAX, .def = "1",
     .limit = RS_JL_N, .doc = "choices per prompt"},
    {.name = "best_of", .type = RS_JT_CUSTOM, .use = RS_JU_NEUTRAL, .read = read_best_of, .shape = "integer >= 1",
     .doc = "accepted when equal to n (no best-of search)",
     .schema = "{'type': 'integer', 'minimum': 1, 'maximum': 2147483647}"},
    {.name = "seed", .type = RS_JT_CUSTOM, .read = read_seed, .shape = "integer (64-bit)", .def = "random",
     .doc = "seeds the draws; choice s of a prompt uses (seed, s)",
     .schema = "{'type': 'integer', 'minimum': -9223372036854775808, 'maximum': 9223372036854775807}"},
    {.name = "stop_token_ids", .type = RS_JT_IDS, SP(stop_token_ids), .offset2 = offsetof(rs_sampling_params,
     n_stop_token_ids), .def = "[]", .doc = "token ids that end a choice (stop_reason names it)"},
    {.name = "ignore_eos", .type = RS_JT_BOOL, SP(ignore_eos), .def = "false",
     .doc = "the model's EOS tokens do not end a choice"},
    {.name = "min_tokens", .type = RS_JT_INT, SP(min_new_tokens), .min = 0, .max = INT_MAX,
     .limit = RS_JL_NEW_TOKENS, .def = "0",
     .doc = "stop tokens and EOS do not end a choice before this many tokens"},
    {.name = "logprobs", .type = RS_JT_INT, REQ(logprobs), .min = 0, .max = INT_MAX,
     .limit = RS_JL_TOP_LOGPROBS, .def = "null",
     .doc = "k: the sampled token's logprob plus the k most likely alternatives per position"},
    {.name = "echo", .type = RS_JT_BOOL, REQ(echo), .def = "false",
     .doc = "text starts with the prompt's text (its tokens decoded); with logprobs the prompt's tokens are "
            "scored and listed first"},
    {.name = "stream", .type = RS_JT_BOOL, REQ(stream), .def = "false", .doc = "answer with Server-Sent Events"},
    {.name = "stream_options", .type = RS_JT_CUSTOM, .read = read_stream_options, .shape = "object",
     .sub = &stream_options_object, .doc = "needs stream: true; see below",
     .schema = "'$sub'"},
    {.name = "return_token_ids", .type = RS_JT_BOOL, REQ(return_token_ids), .def = "false",
     .doc = "adds prompt_token_ids (token_ids are always there)"},
    {.name = "logprobs_mode", .type = RS_JT_ENUM, JOB(logprobs_mode), .choices = "default|raw|processed",
     .def = "\"default\"", .doc = "rolloutd's: which distribution logprobs come from (see the README)"},
    {.name = "return_tokens_as_token_ids", .type = RS_JT_BOOL, REQ(tokens_as_ids), .def = "false",
     .doc = "logprobs tokens (and top_logprobs keys) are \"token_id:N\" instead of the token's text (always so "
            "without a tokenizer)"},
    {.name = "skip_special_tokens", .type = RS_JT_BOOL, .flags = RS_JF_TOKENIZER, TXT(skip_special_tokens),
     .def = "true", .doc = "special tokens are left out of the text (and of stop-string matching)"},
    {.name = "spaces_between_special_tokens", .type = RS_JT_BOOL, .use = RS_JU_NO_EFFECT, .def = "true",
     .doc = "no effect with a tokenizer.json (fast) tokenizer, as in transformers"},
    {.name = "include_stop_str_in_output", .type = RS_JT_BOOL, .flags = RS_JF_TOKENIZER, TXT(no_stop_trim),
     .def = "false", .doc = "the text keeps the matched stop string (or the stop token's text); token_ids always "
                            "keep the stop token"},
    {.name = "user", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT, .doc = "OpenAI's end-user id; not used"},
    {.name = "stop", .type = RS_JT_CUSTOM, .flags = RS_JF_TOKENIZER, .read = read_stop,
     .shape = "string, or a list of strings (<= 64, each <= 1024 bytes)", .def = "[]",
     .doc = "a choice ends once its text contains one (stop_reason names it); the text is cut before it, "
            "token_ids keep the token that completed it",
     .schema = "{'anyOf': [{'type': 'string', 'maxLength': 1024}, {'type': 'array', 'maxItems': 64, "
               "'items': {'type': 'string', 'maxLength': 1024}}]}"},
    {.name = "suffix", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .flags = RS_JF_TOKENIZER, .neutral = "\"\"",
     .doc = "suffixes"},
    {.name = "logit_bias", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .neutral = "{}", .doc = "logit biases"},
    {.name = "prompt_logprobs", .type = RS_JT_INT, .use = RS_JU_NEUTRAL,
     .doc = "use echo with logprobs to score the prompt"},
    {.name = "use_beam_search", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false", .doc = "beam search"},
    {.name = "length_penalty", .type = RS_JT_NUMBER, .use = RS_JU_NEUTRAL, .neutral = "1", .doc = "beam search"},
    {.name = "truncate_prompt_tokens", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .doc = "prompt truncation"},
    {.name = "allowed_token_ids", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL, .doc = "allowed-token masks"},
    {.name = "prompt_embeds", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "embedding inputs"},
    {.name = "response_format", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "structured outputs"},
    {.name = "structured_outputs", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "structured outputs"},
    {.name = "priority", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0", .doc = "priority scheduling"},
    {.name = "logits_processors", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL, .neutral = "[]",
     .doc = "custom logits processors"},
    {.name = "cache_salt", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .neutral = "\"\"",
     .doc = "prefix-cache namespaces"},
    {.name = "kv_transfer_params", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "disaggregated serving"},
    {.name = "vllm_xargs", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .neutral = "{}", .doc = "vLLM extensions"},
    {.name = "max_repetition_pattern_size", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "stopping on repeated patterns"},
    {.name = "min_repetition_pattern_size", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "stopping on repeated patterns"},
    {.name = "repetition_min_count", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "stopping on repeated patterns"},
    /* SGLang's CompletionRequest adds these (its top_k, min_p, min_tokens, repetition_penalty,
     * stop_token_ids, ignore_eos, skip_special_tokens, response_format, cache_salt and priority are
     * rows above) */
    {.name = "rid", .type = RS_JT_CUSTOM, .read = read_rid, .shape = "string (<= 122 bytes)",
     .doc = "SGLang's name for request_id",
     .schema = "{'type': 'string', 'minLength': 1, 'maxLength': 122, 'pattern': '$name'}"},
    {.name = "no_stop_trim", .type = RS_JT_BOOL, .flags = RS_JF_TOKENIZER, TXT(no_stop_trim), .def = "false",
     .doc = "SGLang's name for include_stop_str_in_output (one of the two may be given)"},
    {.name = "stop_regex", .type = RS_JT_CUSTOM, .flags = RS_JF_TOKENIZER, .read = read_stop_regex,
     .shape = "string, or a list of strings (<= 16, each <= 1024 bytes)", .def = "[]",
     .doc = "the output ends once a regex (PCRE2, UTF-8) finds a match in its text; cut like stop, matched "
            "names the pattern",
     .schema = "{'anyOf': [{'type': 'string', 'maxLength': 1024}, {'type': 'array', 'maxItems': 16, "
               "'items': {'type': 'string', 'maxLength': 1024}}]}"},
    {.name = "custom_params", .type = RS_JT_MAP, .use = RS_JU_NO_EFFECT,
     .doc = "arguments of a custom logit processor; ignored without one, as in SGLang"},
    {.name = "custom_logit_processor", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "custom logit processors"},
    {.name = "json_schema", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "constrained decoding"},
    {.name = "regex", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "constrained decoding"},
    {.name = "ebnf", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "constrained decoding"},
    {.name = "return_hidden_states", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "hidden states"},
    {.name = "return_routed_experts", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "MoE routing replay"},
    {.name = "routed_experts_start_len", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "MoE routing replay"},
    {.name = "return_cached_tokens_details", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "per-source cached-token counts"},
    {.name = "lora_path", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "LoRA adapters"},
    {.name = "session_id", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "sessions"},
    {.name = "session_params", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "sessions"},
    {.name = "images_config", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "multimodal tiling"},
    {.name = "bootstrap_host", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "prefill/decode disaggregation"},
    {.name = "bootstrap_port", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "prefill/decode disaggregation"},
    {.name = "bootstrap_room", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "prefill/decode disaggregation"},
    {.name = "disagg_prefill_dp_rank", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "prefill/decode disaggregation"},
    {.name = "routed_dp_rank", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "data-parallel ranks: this server is rank 0 of 1"},
    {.name = "data_parallel_rank", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "data-parallel ranks: this server is rank 0 of 1"},
    {.name = "extra_key", .type = RS_JT_STRINGS, .use = RS_JU_NEUTRAL, .neutral = "\"\"",
     .doc = "prefix-cache namespaces"},
    {.name = "ngram_corpus_id", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "n-gram speculative decoding"},
    {.name = "custom_labels", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .neutral = "{}",
     .doc = "per-request metric labels"},
    {.name = "input_ids", .use = RS_JU_ELSEWHERE, .doc = "/v1/completions takes prompt"},
};

const rs_jobject rs_openai_completion_fields = {
    .title = "POST /v1/completions", .fields = completion_fields, .n = RS_ARRAY_LEN(completion_fields),
    /* read_stream_options: stream_options (not null) needs stream: true, as in vLLM */
    .schema_also = "{'if': {'required': ['stream_options'], 'properties': {'stream_options': {'type': 'object'}}}, "
                   "'then': {'required': ['stream'], 'properties': {'stream': {'const': true}}}}"};

int rs_openai_parse_completions(const char *body, size_t len, const rs_tok *tok, rs_openai_req *out,
                                rs_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = rs_json_load_object(body, len, false, &root, err);
    if (rc != RS_OK) return rc;
    out->job = rs_gen_job_new();
    out->job->sp.max_new_tokens = RS_OPENAI_DEFAULT_MAX_TOKENS;
    out->logprobs = -1;
    out->add_special_tokens = true;
    out->tok = tok;
    out->text = rs_gen_text_new(tok);
    void *const dst[] = {[B_REQ] = out, [B_JOB] = out->job, [B_SP] = &out->job->sp, [B_TEXT] = out->text};
    rc = rs_json_read(root, &rs_openai_completion_fields, dst, "", err);
    json_decref(root);
    if (rc != RS_OK) {
        rs_openai_req_free(out);
        return rc;
    }
    /* logprobs k: the sampled token plus k alternatives; echo scores the prompt from its start */
    rs_gen_job *job = out->job;
    job->return_logprob = out->logprobs >= 0;
    job->top_logprobs_num = out->logprobs > 0 ? out->logprobs : 0;
    job->logprob_start_len = out->echo && job->return_logprob ? 0 : -1;
    job->stream = out->stream;
    if (tok && (rs_gen_text_has_stops(out->text) || out->stream)) rs_gen_text_attach(out->text, job);
    return RS_OK;
}

void rs_openai_req_free(rs_openai_req *r) {
    for (int p = 0; r->prompt_texts && p < r->job->n_prompts; p++) free(r->prompt_texts[p]);
    free(r->prompt_texts);
    free(r->prompt_text_lens);
    rs_gen_job_free(r->job);
    rs_gen_text_free(r->text);
    free(r->text_sent);
    free(r->sent);
    free(r->closed);
    free(r->started);
    free(r->text_offset);
    memset(r, 0, sizeof *r);
}

int rs_openai_check_model(const rs_openai_req *r, const char *served, rs_error *err) {
    if (!r->model[0] || strcmp(r->model, served) == 0) return RS_OK;
    return rs_error_set(err, RS_ENOTFOUND, "model", "The model `%.255s` does not exist (this server serves `%.255s`)",
                        r->model, served);
}

bool rs_openai_matches_rid(const rs_openai_req *r, const char *rid) {
    return strcmp(r->id, rid) == 0 || (r->request_id[0] && strcmp(r->request_id, rid) == 0);
}

int rs_openai_invalid(const rs_gen_invalid *why, rs_error *err) {
    static const rs_invalid_names names = {
        .prompts = "prompt", .n = "n", .max_new_tokens = "max_tokens", .max_new_tokens_short = "max_tokens",
        .min_new_tokens = "min_tokens", .top_logprobs = "logprobs", .stop_token_ids = "stop_token_ids",
        .logprob_start = "echo"};
    return rs_invalid_error(why, &names, err);
}

/* ---------------------------------------------------------------- response */

static const char *finish_name(rs_finish_type t) {
    switch (t) {
    case RS_FINISH_STOP: return "stop";
    case RS_FINISH_LENGTH: return "length";
    case RS_FINISH_ABORT: return "abort";
    case RS_FINISH_NONE: break;
    }
    return NULL;
}

/* The stop string or the stop token when one of the request's stop strings or stop_token_ids ended
 * the output; null for EOS. */
static json_t *stop_reason(const rs_openai_req *r, const rs_gen_output *o) {
    const rs_gen_job *job = r->job;
    if (o->finish.type != RS_FINISH_STOP) return json_null();
    const char *stop = rs_gen_text_stop_string(r->text, &o->finish);
    if (stop) return json_string(stop);
    for (int i = 0; i < job->sp.n_stop_token_ids; i++)
        if (job->sp.stop_token_ids[i] == o->finish.matched) return json_integer(o->finish.matched);
    return json_null();
}

typedef struct lp_lists {
    json_t *tokens, *token_logprobs, *top_logprobs, *text_offset;
    long long offset;           /* running offset (characters) into the concatenated token strings */
    const rs_tok *tok;          /* token text from it; NULL: "token_id:N" */
} lp_lists;

/* A token as vLLM lists it: its text (decode([id])), or "token_id:N" (return_tokens_as_token_ids, or
 * no tokenizer). New malloc'd string. */
static char *token_str(const rs_tok *tok, int32_t id, size_t *len) {
    if (tok) return rs_tok_token_text(tok, id, len);
    char *b = rs_xmalloc(32);
    *len = (size_t)snprintf(b, 32, "token_id:%d", (int)id);
    return b;
}

/* One position: token `id` with logprob `lp` and alternatives [k] (ids -1 = absent); `first_prompt`
 * is the context-less first prompt token (null logprob and alternatives). Two alternatives with the
 * same text (lone bytes read U+FFFD) share one key: the more likely one's. */
static void lp_add(lp_lists *l, int32_t id, float lp, const int32_t *alt_ids, const float *alt_lps, int k,
                   bool first_prompt) {
    size_t tl;
    char *tok = token_str(l->tok, id, &tl);
    json_array_append_new(l->tokens, json_stringn(tok, tl));
    json_array_append_new(l->token_logprobs, first_prompt ? json_null() : rs_json_logprob(lp));
    json_array_append_new(l->text_offset, json_integer(l->offset));
    l->offset += (long long)rs_utf8_chars(tok, tl);
    if (first_prompt) {
        json_array_append_new(l->top_logprobs, json_null());
        free(tok);
        return;
    }
    json_t *top = json_object();
    json_object_setn_new(top, tok, tl, rs_json_logprob(lp)); /* the chosen token is always listed */
    free(tok);
    for (int j = 0; j < k && alt_ids[j] >= 0; j++) {
        size_t al;
        char *alt = token_str(l->tok, alt_ids[j], &al);
        if (!json_object_getn(top, alt, al)) json_object_setn_new(top, alt, al, rs_json_logprob(alt_lps[j]));
        free(alt);
    }
    json_array_append_new(l->top_logprobs, top);
}

/* The logprobs object of output i: the prompt's scored tokens first when with_prompt (echo),
 * then output tokens [from, n_output). *offset carries text_offset across streamed chunks. */
static json_t *logprobs_json(const rs_openai_req *r, int i, int from, bool with_prompt, long long *offset) {
    const rs_gen_job *job = r->job;
    const rs_gen_output *o = &job->outputs[i];
    int p = i / job->sp.n, k = job->top_logprobs_num;
    lp_lists l = {json_array(), json_array(), json_array(), json_array(), *offset,
                  r->tokens_as_ids ? NULL : r->tok};
    if (with_prompt && job->logprob_start_len == 0) {
        for (int t = 0; t < o->n_input_logprobs && t < job->prompt_lens[p]; t++)
            lp_add(&l, job->prompts[p][t], o->input_logprobs[t], k ? o->input_top_ids + (size_t)t * k : NULL,
                   k ? o->input_top_lps + (size_t)t * k : NULL, k, t == 0);
    }
    for (int t = from; t < o->n_output; t++)
        lp_add(&l, o->output_ids[t], o->output_logprobs[t], k ? o->output_top_ids + (size_t)t * k : NULL,
               k ? o->output_top_lps + (size_t)t * k : NULL, k, false);
    *offset = l.offset;
    json_t *obj = json_object();
    json_object_set_new(obj, "tokens", l.tokens);
    json_object_set_new(obj, "token_logprobs", l.token_logprobs);
    json_object_set_new(obj, "top_logprobs", l.top_logprobs);
    json_object_set_new(obj, "text_offset", l.text_offset);
    return obj;
}

static json_t *ids_json(const int32_t *ids, int from, int to) {
    json_t *a = json_array();
    for (int t = from; t < to; t++) json_array_append_new(a, json_integer(ids[t]));
    return a;
}

/* The choice's text: with echo in its first chunk, the prompt first: as given when it was text,
 * else its tokens decoded. */
static json_t *text_json(const rs_openai_req *r, int p, bool first, const char *text, size_t len) {
    if (!r->tok) return json_string("");
    if (!(first && r->echo)) return json_stringn(text, len);
    char *decoded = NULL;
    const char *prompt;
    size_t pl;
    if (r->prompt_texts) prompt = r->prompt_texts[p], pl = r->prompt_text_lens[p];
    else prompt = decoded = rs_tok_decode(r->tok, r->job->prompts[p], (size_t)r->job->prompt_lens[p], false, &pl);
    rs_buf b = {0};
    int rc = rs_buf_append(&b, prompt, pl);
    if (rc == RS_OK) rc = rs_buf_append(&b, text, len);
    free(decoded);
    json_t *v = rc == RS_OK ? json_stringn(b.data ? b.data : "", b.len) : NULL;
    rs_buf_free(&b);
    return v ? v : json_string("");
}

/* Choice i with output tokens [from, n_output) and text[0, tlen); first: the choice's first (or
 * only) chunk. */
static json_t *choice_json(const rs_openai_req *r, int i, int from, bool first, bool finished, long long *offset,
                           const char *text, size_t tlen) {
    const rs_gen_job *job = r->job;
    const rs_gen_output *o = &job->outputs[i];
    int p = i / job->sp.n;
    json_t *c = json_object();
    json_object_set_new(c, "index", json_integer(i));
    json_object_set_new(c, "text", text_json(r, p, first, text, tlen));
    json_object_set_new(c, "logprobs",
                        job->return_logprob ? logprobs_json(r, i, from, first && r->echo, offset) : json_null());
    const char *fr = finished ? finish_name(o->finish.type) : NULL;
    json_object_set_new(c, "finish_reason", fr ? json_string(fr) : json_null());
    json_object_set_new(c, "stop_reason", finished ? stop_reason(r, o) : json_null());
    json_object_set_new(c, "token_ids", ids_json(o->output_ids, from, o->n_output));
    if (first && r->return_token_ids)
        json_object_set_new(c, "prompt_token_ids", ids_json(job->prompts[p], 0, job->prompt_lens[p]));
    return c;
}

static json_t *usage_json(const rs_gen_job *job) {
    long long prompt = 0, completion = 0;
    for (int p = 0; p < job->n_prompts; p++) prompt += job->prompt_lens[p];
    for (int i = 0; i < job->n_prompts * job->sp.n; i++) completion += job->outputs[i].n_output;
    return json_pack("{s:I,s:I,s:I}", "prompt_tokens", (json_int_t)prompt, "completion_tokens",
                     (json_int_t)completion, "total_tokens", (json_int_t)(prompt + completion));
}

static json_t *envelope(const rs_openai_req *r, json_t *choices) {
    json_t *root = json_object();
    json_object_set_new(root, "id", json_string(r->id));
    json_object_set_new(root, "object", json_string("text_completion"));
    json_object_set_new(root, "created", json_integer(r->created));
    json_object_set_new(root, "model", rs_json_string_lossy(r->model));
    json_object_set_new(root, "choices", choices);
    return root;
}

char *rs_openai_completions_response(const rs_openai_req *r, size_t *len) {
    const rs_gen_job *job = r->job;
    json_t *choices = json_array();
    for (int i = 0; i < job->n_prompts * job->sp.n; i++) {
        long long offset = 0;
        const char *text = "";
        size_t tlen = 0;
        if (r->tok) text = rs_gen_text_get(r->text, job, i, &tlen);
        json_array_append_new(choices, choice_json(r, i, 0, true, true, &offset, text, tlen));
    }
    json_t *root = envelope(r, choices);
    json_object_set_new(root, "usage", usage_json(job));
    return rs_json_dump(root, len);
}

int rs_openai_stream_events(rs_openai_req *r, bool final, rs_buf *out) {
    const rs_gen_job *job = r->job;
    int n_out = job->n_prompts * job->sp.n;
    if (!r->sent) {
        r->sent = calloc((size_t)n_out, sizeof *r->sent);
        r->closed = calloc((size_t)n_out, sizeof *r->closed);
        r->started = calloc((size_t)n_out, sizeof *r->started);
        r->text_offset = calloc((size_t)n_out, sizeof *r->text_offset);
        r->text_sent = calloc((size_t)n_out, sizeof *r->text_sent);
        if (!r->sent || !r->closed || !r->started || !r->text_offset || !r->text_sent) return RS_ENOMEM;
    }
    for (int i = 0; i < n_out; i++) {
        const rs_gen_output *o = &job->outputs[i];
        bool finished = o->finish.type != RS_FINISH_NONE;
        if (r->closed[i] || (o->n_output == r->sent[i] && !finished)) continue;
        const char *text = "";
        size_t stable = 0, from = 0;
        if (r->tok) {
            stable = rs_gen_text_stable(r->text, job, i, &text);
            from = RS_MIN(r->text_sent[i], stable);
        }
        json_t *choices = json_array();
        json_array_append_new(choices, choice_json(r, i, r->sent[i], !r->started[i], finished, &r->text_offset[i],
                                                   text + from, stable - from));
        int rc = rs_json_sse_event(out, envelope(r, choices));
        if (rc != RS_OK) return rc;
        r->sent[i] = o->n_output;
        r->text_sent[i] = RS_MAX(r->text_sent[i], stable);
        r->started[i] = true;
        r->closed[i] = finished;
    }
    if (!final) return RS_OK;
    if (r->include_usage) {
        json_t *root = envelope(r, json_array());
        json_object_set_new(root, "usage", usage_json(job));
        int rc = rs_json_sse_event(out, root);
        if (rc != RS_OK) return rc;
    }
    return rs_sse_done(out);
}

char *rs_openai_models_body(const char *name, const char *model_path, long long created, int max_model_len,
                            size_t *len) {
    json_t *m = json_object();
    json_object_set_new(m, "id", rs_json_string_lossy(name));
    json_object_set_new(m, "object", json_string("model"));
    json_object_set_new(m, "created", json_integer(created));
    json_object_set_new(m, "owned_by", json_string("rolloutd"));
    json_object_set_new(m, "root", rs_json_string_lossy(model_path));
    json_object_set_new(m, "max_model_len", json_integer(max_model_len));
    json_t *data = json_array();
    json_array_append_new(data, m);
    return rs_json_dump(json_pack("{s:s,s:o}", "object", "list", "data", data), len);
}
