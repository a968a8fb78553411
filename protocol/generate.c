/*
 * generate.c — the /generate request parser and response writer (see generate.h).
 *
 * The request is read by two descriptor tables (json_util.h), one for the body and one for
 * sampling_params, that list every field SGLang defines for /generate: GenerateReqInput
 * (python/sglang/srt/managers/io_struct.py, sgl-project/sglang at 001067ff, the msgspec
 * version of mid 2026) and SamplingParams (python/sglang/srt/sampling/sampling_params.py at
 * 00c17caf), plus what sglang-router's GenerateRequest adds when it re-serializes a request
 * (sgl-router/src/protocols/generate.rs: "model", "data_parallel_rank_decode") and rolloutd's
 * logprobs_mode. Ranges follow SamplingParams.verify (penalties: frequency and presence in
 * [-2, 2], repetition in (0, 2]). Anything a request allocates is bounded by its body size,
 * which the server caps before calling in.
 *
 * The response is written one output at a time (each output's JSON tree is built, dumped and
 * freed before the next), so peak memory is one output's tree plus the text, not the whole batch.
 */
#include "generate.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/base64.h"
#include "invalid.h"
#include "json_util.h"

/* ---------------------------------------------------------------- request fields */

enum { B_REQ, B_JOB, B_SP, B_TEXT }; /* destinations: rs_generate_req, its rs_gen_job, the job's sampling
                                       * params, its rs_gen_text */

#define DST(T, b, field) .base = b, .offset = offsetof(T, field), .size = sizeof(((T *)0)->field)
#define REQ(field) DST(rs_generate_req, B_REQ, field)
#define JOB(field) DST(rs_gen_job, B_JOB, field)
#define SP(field) DST(rs_sampling_params, B_SP, field)
#define TXT(field) DST(rs_gen_text, B_TEXT, field)

static rs_gen_job *job_of(const rs_jctx *c) { return c->dst[B_JOB]; }

static rs_generate_req *req_of(const rs_jctx *c) { return c->dst[B_REQ]; }

int rs_generate_no_tokenizer(const char *param, rs_error *err) {
    return rs_error_set(err, RS_EINVAL, param,
                        "%s needs the model's tokenizer, and the model directory has no tokenizer.json: rolloutd "
                        "serves token ids only for this model (send input_ids, stop_token_ids)", param);
}

static int read_text(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_generate_req *r = req_of(c);
    if (!r->tok) return rs_generate_no_tokenizer(c->param, err);
    r->from_text = true;
    return rs_json_get_text_prompts(v, c->param, r->tok, true, job_of(c), err);
}

static int read_input_ids(const rs_jctx *c, const json_t *v, rs_error *err) {
    if (req_of(c)->from_text)
        return rs_error_set(err, RS_EINVAL, c->param, "input_ids and text are both given: send one of them");
    return rs_json_get_prompts(v, c->param, job_of(c), err);
}

static int read_stops(const rs_jctx *c, const json_t *v, bool regex, rs_error *err) {
    rs_generate_req *r = req_of(c);
    int rc = rs_json_read_stops(v, c->param, r->text, regex, err);
    if (rc == RS_OK && rs_gen_text_has_stops(r->text) && !r->tok) return rs_generate_no_tokenizer(c->param, err);
    return rc;
}

static int read_stop(const rs_jctx *c, const json_t *v, rs_error *err) { return read_stops(c, v, false, err); }
static int read_stop_regex(const rs_jctx *c, const json_t *v, rs_error *err) { return read_stops(c, v, true, err); }

static int read_rid(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_generate_req *r = c->dst[B_REQ];
    rs_gen_job *job = job_of(c);
    if (json_is_string(v)) {
        int rc = rs_json_check_name(v, "rid", RS_RID_MAX, err);
        if (rc != RS_OK) return rc;
        snprintf(r->rid, sizeof r->rid, "%s", json_string_value(v));
        return RS_OK;
    }
    if (!json_is_array(v)) return rs_json_bad_type(err, "rid", "a string or a list of strings", v);
    if (json_array_size(v) != (size_t)job->n_prompts)
        return rs_error_set(err, RS_EINVAL, "rid", "rid has %zu entries but input_ids has %d prompt%s",
                            json_array_size(v), job->n_prompts, job->n_prompts == 1 ? "" : "s");
    for (int p = 0; p < job->n_prompts; p++) {
        char param[32];
        snprintf(param, sizeof param, "rid[%d]", p);
        int rc = rs_json_check_name(json_array_get(v, (size_t)p), param, RS_RID_MAX, err);
        if (rc != RS_OK) return rc;
    }
    r->prompt_rids = rs_xcalloc((size_t)job->n_prompts, sizeof(char *));
    for (int p = 0; p < job->n_prompts; p++)
        r->prompt_rids[p] = rs_xstrdup(json_string_value(json_array_get(v, (size_t)p)));
    snprintf(r->rid, sizeof r->rid, "%s", r->prompt_rids[0]); /* names the request in logs */
    return RS_OK;
}

/* SGLang passes custom_params to a custom logit processor and ignores them without one. The one
 * key rolloutd reads is slime's return_top_p_token_ids (its top-p patch of SGLang): with true,
 * each finished output carries the ids its sampler kept per token (top_p_token_ids and
 * top_p_token_offsets) and its logprobs are the processed ones (renormalized over that set), as
 * slime's trainer recomputes them. */
static int read_custom_params(const rs_jctx *c, const json_t *v, rs_error *err) {
    if (json_is_null(v)) return RS_OK;
    if (!json_is_object(v)) return rs_json_bad_type(err, c->param, "an object", v);
    const json_t *flag = json_object_get(v, "return_top_p_token_ids");
    if (!flag || json_is_null(flag)) return RS_OK;
    char param[96];
    snprintf(param, sizeof param, "%s.return_top_p_token_ids", c->param);
    if (!json_is_boolean(flag)) return rs_json_bad_type(err, param, "a boolean", flag);
    job_of(c)->return_top_p_ids = json_is_true(flag);
    return RS_OK;
}

static int read_sampling_seed(const rs_jctx *c, const json_t *v, rs_error *err) {
    long long x;
    int rc = rs_json_get_int(v, c->param, 0, LLONG_MAX, &x, err);
    if (rc != RS_OK) return rc;
    ((rs_sampling_params *)c->dst[B_SP])->seed = (uint64_t)x;
    ((rs_generate_req *)c->dst[B_REQ])->seed_given = true;
    return RS_OK;
}

/* SamplingParams: every field of SGLang's, in the order they are read. */
static const rs_jfield sampling_fields[] = {
    {.name = "max_new_tokens", .type = RS_JT_INT, SP(max_new_tokens), .min = 0, .max = INT_MAX,
     .limit = RS_JL_NEW_TOKENS, .def = "128",
     .doc = "tokens to generate at most: up to --max-new-tokens, and prompt + max_new_tokens within the "
            "context: a 400 past either (SGLang refuses a request past its context too); absent or null, the "
            "default lowered to what both leave, as SGLang's scheduler lowers it"},
    {.name = "min_new_tokens", .type = RS_JT_INT, SP(min_new_tokens), .min = 0, .max = INT_MAX,
     .limit = RS_JL_NEW_TOKENS, .def = "0",
     .doc = "stop tokens and EOS do not end the output before this many tokens"},
    {.name = "temperature", .type = RS_JT_FLOAT, SP(temperature), .min = 0, .max = INFINITY, .def = "1.0",
     .doc = "0 = greedy"},
    {.name = "top_p", .type = RS_JT_FLOAT, .flags = RS_JF_MIN_OPEN, SP(top_p), .min = 0, .max = 1, .def = "1.0",
     .doc = "nucleus truncation"},
    {.name = "top_k", .type = RS_JT_INT, .flags = RS_JF_NOT_ZERO, SP(top_k), .min = -1, .max = INT_MAX, .def = "-1",
     .doc = "-1 = off"},
    {.name = "min_p", .type = RS_JT_FLOAT, SP(min_p), .min = 0, .max = 1, .def = "0.0",
     .doc = "drop tokens below min_p x the most likely one's probability"},
    {.name = "frequency_penalty", .type = RS_JT_FLOAT, SP(frequency_penalty), .min = -2, .max = 2, .def = "0.0",
     .doc = "logit -= this x the token's count in this sample's output (before temperature)"},
    {.name = "presence_penalty", .type = RS_JT_FLOAT, SP(presence_penalty), .min = -2, .max = 2, .def = "0.0",
     .doc = "logit -= this once the token occurs in this sample's output"},
    {.name = "repetition_penalty", .type = RS_JT_FLOAT, .flags = RS_JF_MIN_OPEN, SP(repetition_penalty), .min = 0,
     .max = 2, .def = "1.0",
     .doc = "for tokens in this sample's output (not the prompt, as SGLang): a positive logit is divided by it, "
            "a negative one multiplied"},
    {.name = "n", .type = RS_JT_INT, .limit = RS_JL_N, SP(n), .min = 1, .max = INT_MAX, .def = "1",
     .doc = "samples per prompt (capped by --max-n); the answer is a list when n > 1"},
    {.name = "sampling_seed", .type = RS_JT_CUSTOM, .read = read_sampling_seed, .shape = "integer >= 0",
     .def = "random", .doc = "seeds the sample's random draws (sample s of a group uses (seed, s))",
     .schema = "{'type': 'integer', 'minimum': 0, 'maximum': 9223372036854775807}"},
    {.name = "stop_token_ids", .type = RS_JT_IDS, SP(stop_token_ids), .offset2 = offsetof(rs_sampling_params,
     n_stop_token_ids), .def = "[]", .doc = "token ids that end the output (the stop token is kept)"},
    {.name = "ignore_eos", .type = RS_JT_BOOL, SP(ignore_eos), .def = "false",
     .doc = "neither the model's EOS tokens nor stop_token_ids end the output (SGLang's)"},
    {.name = "stream_interval", .type = RS_JT_INT, REQ(stream_interval), .min = 1, .max = INT_MAX, .def = "1",
     .doc = "streaming: tokens between an output's events"},
    {.name = "stop", .type = RS_JT_CUSTOM, .flags = RS_JF_TOKENIZER, .read = read_stop,
     .shape = "string, or a list of strings (<= 64, each <= 1024 bytes)", .def = "[]",
     .doc = "the output ends once its text contains one (matched on the decoded text, across tokens); the "
            "text is cut before it, output_ids keep the token that completed it",
     .schema = "{'anyOf': [{'type': 'string', 'maxLength': 1024}, {'type': 'array', 'maxItems': 64, "
               "'items': {'type': 'string', 'maxLength': 1024}}]}"},
    {.name = "stop_regex", .type = RS_JT_CUSTOM, .flags = RS_JF_TOKENIZER, .read = read_stop_regex,
     .shape = "string, or a list of strings (<= 16, each <= 1024 bytes)", .def = "[]",
     .doc = "the output ends once a regex (PCRE2, UTF-8) finds a match in its text; cut like stop, matched "
            "names the pattern",
     .schema = "{'anyOf': [{'type': 'string', 'maxLength': 1024}, {'type': 'array', 'maxItems': 16, "
               "'items': {'type': 'string', 'maxLength': 1024}}]}"},
    {.name = "skip_special_tokens", .type = RS_JT_BOOL, .flags = RS_JF_TOKENIZER, TXT(skip_special_tokens),
     .def = "true", .doc = "special tokens are left out of the text (and of stop-string matching)"},
    {.name = "spaces_between_special_tokens", .type = RS_JT_BOOL, .use = RS_JU_NO_EFFECT, .def = "true",
     .doc = "no effect with a tokenizer.json (fast) tokenizer, as in transformers"},
    {.name = "no_stop_trim", .type = RS_JT_BOOL, .flags = RS_JF_TOKENIZER, TXT(no_stop_trim), .def = "false",
     .doc = "the text keeps the matched stop string (or the stop token's text); output_ids always keep the "
            "stop token"},
    {.name = "custom_params", .type = RS_JT_CUSTOM, .read = read_custom_params, .shape = "object",
     .doc = "arguments of a custom logit processor, ignored as in SGLang without one, except slime's "
            "return_top_p_token_ids: true adds meta_info top_p_token_ids / top_p_token_offsets to a "
            "finished output (base64 int32: the ids top-k / top-p / min-p kept at each token, most likely "
            "first; the token when greedy; none without truncation) and makes logprobs_mode processed",
     .schema = "{'type': 'object', 'properties': {'return_top_p_token_ids': {'type': ['boolean', 'null']}}}"},
    {.name = "logit_bias", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .neutral = "{}", .doc = "logit biases"},
    {.name = "json_schema", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "constrained decoding"},
    {.name = "regex", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "constrained decoding"},
    {.name = "ebnf", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "constrained decoding"},
    {.name = "structural_tag", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "constrained decoding"},
    {.name = "beam_width", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "1", .doc = "beam search"},
    {.name = "seed", .use = RS_JU_ELSEWHERE, .doc = "/generate calls it sampling_seed"},
};

static const rs_jobject sampling_object = {
    .title = "POST /generate: sampling_params", .fields = sampling_fields, .n = RS_ARRAY_LEN(sampling_fields)};

/* GenerateReqInput: every field of SGLang's (and sglang-router's), in the order they are read. */
static const rs_jfield generate_fields[] = {
    {.name = "text", .type = RS_JT_CUSTOM, .flags = RS_JF_TOKENIZER, .read = read_text,
     .shape = "non-empty string, or a list of them (a batch)",
     .doc = "the prompt(s) as text, encoded as Tokenizer.encode(text) does (instead of input_ids)",
     .schema = "{'anyOf': [{'type': 'string', 'minLength': 1}, {'type': 'array', 'minItems': 1, "
               "'items': {'type': 'string', 'minLength': 1}}]}"},
    {.name = "input_ids", .type = RS_JT_CUSTOM, .read = read_input_ids,
     .shape = "list of token ids, or a list of such lists (a batch)",
     .doc = "the prompt(s); this or text is required",
     .schema = "{'anyOf': ['$ids1', {'type': 'array', 'minItems': 1, 'items': '$ids1'}]}"},
    {.name = "rid", .type = RS_JT_CUSTOM, .read = read_rid, .shape = "string, or a list of strings (one per prompt)",
     .doc = "request id (<= 127 bytes): /abort_request takes it; outputs are named after it",
     .schema = "{'anyOf': [{'type': 'string', 'minLength': 1, 'maxLength': 127, 'pattern': '$name'}, "
               "{'type': 'array', 'items': {'type': 'string', 'minLength': 1, 'maxLength': 127, "
               "'pattern': '$name'}}]}"},
    {.name = "sampling_params", .type = RS_JT_OBJECT, .sub = &sampling_object, .doc = "see below"},
    {.name = "return_logprob", .type = RS_JT_BOOL, JOB(return_logprob), .def = "false",
     .doc = "return each output token's logprob (and the prompt's, with logprob_start_len)"},
    {.name = "logprob_start_len", .type = RS_JT_INT, JOB(logprob_start_len), .min = -1, .max = INT_MAX, .def = "-1",
     .doc = "-1: output tokens only; k >= 0: also score prompt tokens from position k"},
    /* (no .limit: past --max-top-logprobs it is a 400 only with return_logprob; without, it is
     * ignored, as in SGLang) */
    {.name = "top_logprobs_num", .type = RS_JT_INT, JOB(top_logprobs_num), .min = 0, .max = INT_MAX, .def = "0",
     .doc = "alternatives per position (capped by --max-top-logprobs)"},
    {.name = "logprobs_mode", .type = RS_JT_ENUM, JOB(logprobs_mode), .choices = "default|raw|processed",
     .def = "\"default\"", .doc = "rolloutd's: which distribution logprobs come from (see the README)"},
    {.name = "stream", .type = RS_JT_BOOL, REQ(stream), .def = "false", .doc = "answer with Server-Sent Events"},
    {.name = "return_text_in_logprobs", .type = RS_JT_BOOL, .flags = RS_JF_TOKENIZER, REQ(text_in_logprobs),
     .def = "false", .doc = "the third element of each logprob triple (and top entry) is the token's text"},
    {.name = "log_metrics", .type = RS_JT_BOOL, .use = RS_JU_NO_EFFECT, .def = "true",
     .doc = "every request is counted in /metrics"},
    {.name = "no_logs", .type = RS_JT_BOOL, .use = RS_JU_NO_EFFECT, .def = "false",
     .doc = "rolloutd never logs prompts or outputs (only ids and counts)"},
    {.name = "model", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT,
     .doc = "sglang-router's: the model it routed by; this server serves one"},
    {.name = "conversation_id", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT, .doc = "a tracking id; not used"},
    {.name = "input_embeds", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL, .doc = "embedding inputs"},
    {.name = "image_data", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .neutral = "[]", .doc = "multimodal inputs"},
    {.name = "video_data", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .neutral = "[]", .doc = "multimodal inputs"},
    {.name = "audio_data", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .neutral = "[]", .doc = "multimodal inputs"},
    {.name = "mm_hashes", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL, .neutral = "[]", .doc = "multimodal inputs"},
    {.name = "mm_content_hashes", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL, .neutral = "[]",
     .doc = "multimodal inputs"},
    {.name = "use_audio_in_video", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "multimodal inputs"},
    {.name = "video_config", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .neutral = "{}", .doc = "multimodal inputs"},
    {.name = "modalities", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL, .neutral = "[]", .doc = "multimodal inputs"},
    {.name = "token_ids_logprob", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL, .neutral = "[]",
     .doc = "logprobs of chosen token ids; use top_logprobs_num"},
    {.name = "return_sampling_mask", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "sampling supports; logprobs_mode \"processed\" gives the renormalized logprob"},
    {.name = "return_flat_raw_top_logprobs", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "flat top-logprob arrays"},
    {.name = "return_flat_raw_top_logprobs_b64", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "flat top-logprob arrays"},
    {.name = "return_hidden_states", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "hidden states"},
    {.name = "return_routed_experts", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "MoE routing replay"},
    {.name = "routed_experts_start_len", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "MoE routing replay"},
    {.name = "return_indexer_topk", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "sparse-attention indexer replay"},
    {.name = "return_entropy", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false", .doc = "entropies"},
    {.name = "return_bytes", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "image generation"},
    {.name = "return_prompt_token_ids", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "prompt ids in the answer"},
    {.name = "session_id", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "sessions"},
    {.name = "session_params", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "sessions"},
    {.name = "lora_path", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "LoRA adapters"},
    {.name = "lora_id", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "LoRA adapters"},
    {.name = "custom_logit_processor", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "custom logit processors"},
    {.name = "positional_embed_overrides", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "embedding overrides"},
    {.name = "bootstrap_host", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "prefill/decode disaggregation"},
    {.name = "bootstrap_port", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "prefill/decode disaggregation"},
    {.name = "bootstrap_room", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "prefill/decode disaggregation"},
    {.name = "bootstrap_pair_key", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "prefill/decode disaggregation"},
    {.name = "decode_tp_size", .type = RS_JT_ANY, .use = RS_JU_NEUTRAL, .doc = "prefill/decode disaggregation"},
    {.name = "disagg_prefill_dp_rank", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "prefill/decode disaggregation"},
    {.name = "routed_dp_rank", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "data-parallel ranks: this server is rank 0 of 1"},
    {.name = "data_parallel_rank", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "data-parallel ranks: this server is rank 0 of 1"},
    {.name = "data_parallel_rank_decode", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0",
     .doc = "sglang-router's decode rank: this server is rank 0 of 1"},
    {.name = "kv_router_hint", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "KV-cache routing hints"},
    {.name = "routing_key", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "routing-key scheduling"},
    {.name = "http_worker_ipc", .type = RS_JT_TEXT, .use = RS_JU_NEUTRAL, .doc = "SGLang's internal IPC"},
    {.name = "background", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "background responses"},
    {.name = "require_reasoning", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "reasoning control"},
    {.name = "max_thinking_tokens", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .doc = "reasoning control"},
    {.name = "priority", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .neutral = "0", .doc = "priority scheduling"},
    {.name = "extra_key", .type = RS_JT_STRINGS, .use = RS_JU_NEUTRAL, .neutral = "\"\"",
     .doc = "prefix-cache namespaces"},
    {.name = "cache_salt", .type = RS_JT_STRINGS, .use = RS_JU_NEUTRAL, .neutral = "\"\"",
     .doc = "prefix-cache namespaces"},
    {.name = "custom_labels", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .neutral = "{}",
     .doc = "per-request metric labels"},
    {.name = "external_trace_header", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .neutral = "{}", .doc = "tracing"},
    {.name = "received_time", .type = RS_JT_NUMBER, .use = RS_JU_NEUTRAL, .doc = "SGLang's internal timing"},
    {.name = "need_wait_for_mm_inputs", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "encoder disaggregation"},
    {.name = "num_items_assigned", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "encoder disaggregation"},
    {.name = "encoder_urls", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL, .neutral = "[]",
     .doc = "encoder disaggregation"},
    {.name = "max_dynamic_patch", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .doc = "multimodal tiling"},
    {.name = "min_dynamic_patch", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .doc = "multimodal tiling"},
    {.name = "image_max_dynamic_patch", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .doc = "multimodal tiling"},
    {.name = "video_max_dynamic_patch", .type = RS_JT_INT, .use = RS_JU_NEUTRAL, .doc = "multimodal tiling"},
    {.name = "images_config", .type = RS_JT_MAP, .use = RS_JU_NEUTRAL, .doc = "multimodal tiling"},
    {.name = "multi_item_delimiter_indices", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL,
     .doc = "multi-item scoring"},
};

const rs_jobject rs_generate_fields = {
    .title = "POST /generate", .fields = generate_fields, .n = RS_ARRAY_LEN(generate_fields),
    .one_of = "input_ids|text"};

int rs_generate_parse(const char *body, size_t len, const rs_tok *tok, rs_generate_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    json_t *root;
    int rc = rs_json_load_object(body, len, false, &root, err);
    if (rc != RS_OK) return rc;
    out->job = rs_gen_job_new();
    out->stream_interval = 1;
    out->tok = tok;
    out->text = rs_gen_text_new(tok);
    out->text->stops_see_special = true; /* SGLang searches stops in tokenizer.decode(ids), specials kept */
    void *const dst[] = {[B_REQ] = out, [B_JOB] = out->job, [B_SP] = &out->job->sp, [B_TEXT] = out->text};
    /* whether max_new_tokens is given: -1 (below its range) stays only where it is absent or null */
    const int max_new_default = out->job->sp.max_new_tokens;
    out->job->sp.max_new_tokens = -1;
    rc = rs_json_read(root, &rs_generate_fields, dst, "", err);
    json_decref(root);
    out->max_new_tokens_given = out->job->sp.max_new_tokens >= 0;
    if (!out->max_new_tokens_given) out->job->sp.max_new_tokens = max_new_default;
    out->job->sp.sglang_finish = true;
    if (rc == RS_OK && out->job->n_prompts == 0)
        rc = rs_error_set(err, RS_EINVAL, "input_ids", "input_ids is required (or text)");
    if (rc == RS_OK && out->text_in_logprobs && !tok) rc = rs_generate_no_tokenizer("return_text_in_logprobs", err);
    if (rc != RS_OK) {
        rs_generate_req_free(out);
        return rc;
    }
    rs_gen_job *job = out->job;
    if (tok && (rs_gen_text_has_stops(out->text) || out->stream)) rs_gen_text_attach(out->text, job);
    job->stream = out->stream;
    /* As in SGLang, logprob_start_len only means something with return_logprob; without it the
     * engine must not spend a forward row per prompt token on scores nobody receives. */
    if (!job->return_logprob) {
        job->logprob_start_len = -1;
        job->top_logprobs_num = 0;
    }
    if (job->return_top_p_ids) {
        if (job->logprobs_mode == RS_LOGPROBS_RAW) {
            rs_generate_req_free(out);
            return rs_error_set(err, RS_EINVAL, "logprobs_mode",
                                "logprobs_mode \"raw\" conflicts with custom_params.return_top_p_token_ids, whose "
                                "logprobs are renormalized over the kept tokens (\"processed\")");
        }
        job->logprobs_mode = RS_LOGPROBS_PROCESSED;
    }
    return RS_OK;
}

int rs_generate_invalid(const rs_generate_req *r, const rs_gen_invalid *why, rs_error *err) {
    rs_invalid_names names = {
        .prompts = r->from_text ? "text" : "input_ids", .n = "sampling_params.n",
        .max_new_tokens = "sampling_params.max_new_tokens", .max_new_tokens_short = "max_new_tokens",
        .min_new_tokens = "sampling_params.min_new_tokens", .top_logprobs = "top_logprobs_num",
        .stop_token_ids = "sampling_params.stop_token_ids", .logprob_start = "logprob_start_len"};
    return rs_invalid_error(why, &names, err);
}

void rs_generate_req_free(rs_generate_req *r) {
    if (r->prompt_rids) {
        for (int p = 0; p < r->job->n_prompts; p++) free(r->prompt_rids[p]);
        free(r->prompt_rids);
    }
    rs_gen_job_free(r->job);
    rs_gen_text_free(r->text);
    free(r->sent);
    free(r->text_sent);
    free(r->closed);
    memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------- response */

void rs_generate_output_id(const rs_generate_req *r, int p, int s, char *buf, size_t n) {
    const rs_gen_job *job = r->job;
    int len;
    if (r->prompt_rids) len = snprintf(buf, n, "%s", r->prompt_rids[p]);
    else if (job->batched) len = snprintf(buf, n, "%s_%d", r->rid, p);
    else len = snprintf(buf, n, "%s", r->rid);
    if (job->sp.n > 1 && len >= 0 && (size_t)len < n) snprintf(buf + len, n - (size_t)len, "_%d", s);
}

bool rs_generate_matches_rid(const rs_generate_req *r, const char *rid) {
    if (strcmp(r->rid, rid) == 0) return true;
    const rs_gen_job *job = r->job;
    for (int p = 0; r->prompt_rids && p < job->n_prompts; p++)
        if (strcmp(r->prompt_rids[p], rid) == 0) return true;
    if (!job->batched && job->sp.n == 1) return false;
    for (int p = 0; p < job->n_prompts; p++) {
        for (int s = 0; s < job->sp.n; s++) {
            char id[RS_RID_MAX + 32];
            rs_generate_output_id(r, p, s, id, sizeof id);
            if (strcmp(id, rid) == 0) return true;
        }
    }
    return false;
}

/* [logprob, token_id, null]: null logprob when it is not finite (the first prompt position has no
 * context; a token sampled with probability 0 would be -inf, which JSON cannot hold). */
static json_t *triple(const rs_generate_req *r, float lp, int32_t id) {
    json_t *t = json_array();
    json_array_append_new(t, rs_json_logprob(lp));
    json_array_append_new(t, json_integer(id));
    json_array_append_new(t, r->text_in_logprobs ? rs_json_token_text(r->tok, id) : json_null());
    return t;
}

/* [[logprob, id, text|null], ...] for one position's alternatives; ids of -1 are absent entries. */
static json_t *top_json(const rs_generate_req *r, const int32_t *ids, const float *lps, int k) {
    json_t *a = json_array();
    for (int j = 0; j < k && ids[j] >= 0; j++) json_array_append_new(a, triple(r, lps[j], ids[j]));
    return a;
}

static json_t *finish_json(const rs_generate_req *r, const rs_finish *f) {
    const char *stop = rs_gen_text_stop_string(r->text, f);
    switch (f->type) {
    case RS_FINISH_STOP:
        if (stop) return json_pack("{s:s,s:s}", "type", "stop", "matched", stop);
        return json_pack("{s:s,s:i}", "type", "stop", "matched", (int)f->matched);
    case RS_FINISH_LENGTH: return json_pack("{s:s,s:i}", "type", "length", "length", f->length);
    case RS_FINISH_ABORT: return json_pack("{s:s,s:s}", "type", "abort", "message", f->message);
    case RS_FINISH_NONE: break;
    }
    return json_null();
}

/* [[version, start, end], ...]: the weights each run of output tokens came from (more than one
 * when the request crossed a weight update); the last run ends at the tokens so far. */
static json_t *spans_json(const rs_gen_output *o) {
    json_t *a = json_array();
    for (int i = 0; i < o->n_spans; i++) {
        const rs_weight_span *sp = &o->spans[i];
        int end = i == o->n_spans - 1 ? o->n_output : RS_MIN(sp->end, o->n_output);
        json_t *t = json_array();
        json_array_append_new(t, rs_json_string_lossy(sp->version));
        json_array_append_new(t, json_integer(RS_MIN(sp->start, end)));
        json_array_append_new(t, json_integer(end));
        json_array_append_new(a, t);
    }
    return a;
}

/* n int32 values, little-endian, as a base64 string (slime's top-p arrays); a NULL v reads as
 * zeros (the one offset of an output without tokens). */
static json_t *int32_base64(const int32_t *v, size_t n) {
    uint8_t *bytes = rs_xcalloc(n ? n : 1, 4);
    for (size_t i = 0; v && i < n; i++) {
        const uint32_t x = (uint32_t)v[i];
        bytes[4 * i] = (uint8_t)x, bytes[4 * i + 1] = (uint8_t)(x >> 8);
        bytes[4 * i + 2] = (uint8_t)(x >> 16), bytes[4 * i + 3] = (uint8_t)(x >> 24);
    }
    char *s = rs_xmalloc(rs_base64_len(4 * n) + 1);
    rs_base64_encode(bytes, 4 * n, s);
    json_t *j = json_string(s);
    free(s);
    free(bytes);
    return j;
}

/* The object of output (p, s) with its output tokens [from, n_output) and text[0, tlen) (no "text"
 * when text is NULL); the prompt's scores only when with_input. A finished answer: from = 0,
 * with_input, and e2e_latency. */
static json_t *output_json(const rs_generate_req *r, int p, int s, int from, bool with_input, bool with_latency,
                           const char *text, size_t tlen) {
    const rs_gen_job *job = r->job;
    const rs_gen_output *o = &job->outputs[p * job->sp.n + s];
    char id[RS_RID_MAX + 32];
    rs_generate_output_id(r, p, s, id, sizeof id);

    json_t *ids = json_array();
    for (int i = from; i < o->n_output; i++) json_array_append_new(ids, json_integer(o->output_ids[i]));

    json_t *meta = json_object();
    json_object_set_new(meta, "id", json_string(id));
    json_object_set_new(meta, "finish_reason", finish_json(r, &o->finish));
    json_object_set_new(meta, "prompt_tokens", json_integer(o->prompt_tokens));
    json_object_set_new(meta, "completion_tokens", json_integer(o->n_output));
    json_object_set_new(meta, "cached_tokens", json_integer(o->cached_tokens));
    /* the version of this output's last token (of its prompt scores when it has none); a request
     * that crossed an update lists the others in weight_version_spans */
    json_object_set_new(meta, "weight_version",
                        json_string(o->n_spans > 0 ? o->spans[o->n_spans - 1].version : job->weight_version));
    json_object_set_new(meta, "num_retractions", json_integer(o->num_retractions));
    if (o->n_spans > 0) json_object_set_new(meta, "weight_version_spans", spans_json(o));
    if (job->return_logprob) {
        json_t *out_lp = json_array(), *in_lp = json_array();
        for (int i = from; i < o->n_output; i++)
            json_array_append_new(out_lp, triple(r, o->output_logprobs[i], o->output_ids[i]));
        int start = job->logprob_start_len;
        for (int i = 0; with_input && start >= 0 && i < o->n_input_logprobs && start + i < job->prompt_lens[p]; i++)
            json_array_append_new(in_lp, triple(r, o->input_logprobs[i], job->prompts[p][start + i]));
        json_object_set_new(meta, "output_token_logprobs", out_lp);
        json_object_set_new(meta, "input_token_logprobs", in_lp);
        int k = job->top_logprobs_num;
        json_t *out_top = json_array(), *in_top = json_array();
        for (int i = from; k > 0 && i < o->n_output; i++)
            json_array_append_new(out_top, top_json(r, o->output_top_ids + (size_t)i * k,
                                                    o->output_top_lps + (size_t)i * k, k));
        for (int i = 0; with_input && k > 0 && i < o->n_input_logprobs; i++) {
            const int32_t *alt = o->input_top_ids + (size_t)i * k;
            json_array_append_new(in_top,
                                  alt[0] < 0 ? json_null() : top_json(r, alt, o->input_top_lps + (size_t)i * k, k));
        }
        json_object_set_new(meta, "output_top_logprobs", out_top);
        json_object_set_new(meta, "input_top_logprobs", in_top);
    }
    if (job->return_top_p_ids && o->finish.type != RS_FINISH_NONE) {
        json_object_set_new(meta, "top_p_token_ids", int32_base64(o->kept_ids, o->kept_offsets ? o->n_kept_ids : 0));
        const size_t n_offsets = o->kept_offsets ? (size_t)o->n_output + 1 : 1;
        json_object_set_new(meta, "top_p_token_offsets", int32_base64((const int32_t *)o->kept_offsets, n_offsets));
    }
    if (with_latency) json_object_set_new(meta, "e2e_latency", json_real(o->e2e_latency));

    json_t *root = json_object();
    if (text) json_object_set_new(root, "text", json_stringn(text, tlen));
    json_object_set_new(root, "output_ids", ids);
    json_object_set_new(root, "meta_info", meta);
    return root;
}

char *rs_generate_response(const rs_generate_req *r, size_t *len) {
    const rs_gen_job *job = r->job;
    bool list = job->batched || job->sp.n > 1;
    rs_buf b = {0};
    int rc = list ? rs_buf_append(&b, "[", 1) : RS_OK;
    /* one output's tree at a time: peak memory is one tree plus the text, not the whole batch */
    for (int p = 0; rc == RS_OK && p < job->n_prompts; p++) {
        for (int s = 0; rc == RS_OK && s < job->sp.n; s++) {
            if (p + s > 0) rc = rs_buf_append(&b, ",", 1);
            const char *text = NULL;
            size_t tlen = 0;
            if (r->tok) text = rs_gen_text_get(r->text, job, p * job->sp.n + s, &tlen);
            json_t *o = output_json(r, p, s, 0, true, true, text, tlen);
            if (rc == RS_OK) rc = rs_json_append(&b, o);
            json_decref(o);
        }
    }
    if (rc == RS_OK && list) rc = rs_buf_append(&b, "]", 1);
    if (rc == RS_OK && !b.data) rc = rs_buf_append(&b, "", 0);
    if (rc != RS_OK) {
        rs_buf_free(&b);
        return NULL;
    }
    *len = b.len;
    return b.data;
}

int rs_generate_stream_events(rs_generate_req *r, bool final, rs_buf *out) {
    const rs_gen_job *job = r->job;
    int n_out = job->n_prompts * job->sp.n;
    if (!r->sent) {
        r->sent = calloc((size_t)n_out, sizeof *r->sent);
        r->text_sent = calloc((size_t)n_out, sizeof *r->text_sent);
        r->closed = calloc((size_t)n_out, sizeof *r->closed);
        if (!r->sent || !r->text_sent || !r->closed) return RS_ENOMEM;
    }
    bool list = job->batched || job->sp.n > 1;
    for (int i = 0; i < n_out; i++) {
        const rs_gen_output *o = &job->outputs[i];
        bool finished = o->finish.type != RS_FINISH_NONE;
        if (r->closed[i] || (o->n_output == r->sent[i] && !finished)) continue;
        if (!finished && o->n_output - r->sent[i] < RS_MAX(r->stream_interval, 1)) continue;
        int from = r->incremental ? r->sent[i] : 0;
        const char *text = NULL;
        size_t stable = 0, tfrom = 0;
        if (r->tok) {
            stable = rs_gen_text_stable(r->text, job, i, &text);
            if (r->incremental) tfrom = RS_MIN(r->text_sent[i], stable);
        }
        /* the prompt's scores in every event, incremental ones too: SGLang slices only the output
         * keys (slice_streaming_output_meta_info), so its clients read them from any chunk */
        json_t *ev = output_json(r, i / job->sp.n, i % job->sp.n, from, true, finished, text ? text + tfrom : NULL,
                                 stable - tfrom);
        if (ev && list) json_object_set_new(ev, "index", json_integer(i));
        int rc = rs_json_sse_event(out, ev);
        if (rc != RS_OK) return rc;
        r->sent[i] = o->n_output;
        r->text_sent[i] = RS_MAX(r->text_sent[i], stable);
        r->closed[i] = finished;
    }
    return final ? rs_sse_done(out) : RS_OK;
}
