/*
 * test_protocol_openai.c — /v1/completions (protocol/openai.c): what a request sets on the job,
 * what is refused and how it is named, the text_completion shape with vLLM-style logprobs, echo,
 * streaming chunks and the usage chunk, and the renaming of validation errors.
 */
#include <jansson.h>
#include <math.h>
#include <string.h>

#include "../../protocol/openai.h"
#include "test.h"

static int parse(const char *body, rs_openai_req *r, rs_error *err) {
    memset(err, 0, sizeof *err);
    return rs_openai_parse_completions(body, strlen(body), NULL, r, err);
}

static rs_openai_req parse_ok(const char *body) {
    rs_openai_req r;
    rs_error err;
    if (parse(body, &r, &err) != RS_OK) RS_TEST_FAIL("parse(%s): %s (param %s)", body, err.message, err.param);
    return r;
}

RS_TEST(protocol_openai_parse_defaults_and_fields) {
    rs_openai_req r = parse_ok("{\"model\": \"m\", \"prompt\": [1, 2, 3]}");
    rs_gen_job *j = r.job;
    ASSERT_EQ(j->n_prompts, 1);
    ASSERT_TRUE(!j->batched);
    ASSERT_EQ(j->sp.max_new_tokens, 16); /* OpenAI's default */
    ASSERT_TRUE(!r.max_tokens_given); /* the server lowers it where it must */
    ASSERT_EQ(r.logprobs, -1);
    ASSERT_TRUE(!j->return_logprob);
    ASSERT_TRUE(!r.seed_given);
    ASSERT_STREQ(r.model, "m");
    ASSERT_STREQ(r.id, "");
    rs_openai_req_free(&r);

    r = parse_ok("{\"model\": \"m\", \"prompt\": [[1], [2, 3]], \"max_tokens\": 8, \"temperature\": 0.5,"
                 " \"top_p\": 0.9, \"top_k\": 0, \"min_p\": 0.1, \"n\": 3, \"seed\": -7, \"stop_token_ids\": [5],"
                 " \"ignore_eos\": true, \"min_tokens\": 2, \"logprobs\": 2, \"echo\": true, \"stream\": true,"
                 " \"stream_options\": {\"include_usage\": true}, \"return_token_ids\": true,"
                 " \"return_tokens_as_token_ids\": true, \"skip_special_tokens\": false, \"user\": \"u\","
                 " \"frequency_penalty\": 0.5, \"presence_penalty\": -0.25, \"repetition_penalty\": 1.5, \"stop\": [],"
                 " \"logit_bias\": {}, \"best_of\": 3, \"suffix\": null, \"request_id\": \"abc\","
                 " \"logprobs_mode\": \"raw\"}");
    j = r.job;
    ASSERT_TRUE(j->batched);
    ASSERT_EQ(j->n_prompts, 2);
    ASSERT_EQ(j->sp.max_new_tokens, 8);
    ASSERT_TRUE(r.max_tokens_given);
    ASSERT_NEAR(j->sp.temperature, 0.5, 0);
    ASSERT_EQ(j->sp.top_k, -1); /* vLLM: 0 is off */
    ASSERT_EQ(j->sp.n, 3);
    ASSERT_EQ((int64_t)j->sp.seed, -7);
    ASSERT_TRUE(r.seed_given);
    ASSERT_EQ(j->sp.n_stop_token_ids, 1);
    ASSERT_TRUE(j->sp.ignore_eos);
    ASSERT_EQ(j->sp.min_new_tokens, 2);
    ASSERT_EQ(r.logprobs, 2);
    ASSERT_TRUE(j->return_logprob);
    ASSERT_EQ(j->top_logprobs_num, 2);
    ASSERT_EQ(j->logprob_start_len, 0); /* echo + logprobs scores the prompt */
    ASSERT_TRUE(r.stream && r.include_usage && r.return_token_ids);
    ASSERT_STREQ(r.request_id, "abc");
    ASSERT_STREQ(r.id, "cmpl-abc");
    ASSERT_EQ(j->logprobs_mode, RS_LOGPROBS_RAW);
    ASSERT_NEAR(j->sp.frequency_penalty, 0.5, 0);
    ASSERT_NEAR(j->sp.presence_penalty, -0.25, 0);
    ASSERT_NEAR(j->sp.repetition_penalty, 1.5, 0);
    ASSERT_TRUE(rs_openai_matches_rid(&r, "abc") && rs_openai_matches_rid(&r, "cmpl-abc"));
    ASSERT_TRUE(!rs_openai_matches_rid(&r, "ab"));
    rs_openai_req_free(&r);

    r = parse_ok("{\"prompt\": [1], \"max_tokens\": null, \"logprobs\": 0}");
    ASSERT_TRUE(!r.max_tokens_given && r.job->sp.max_new_tokens == 16); /* null is the default, as in vLLM */
    ASSERT_EQ(r.job->top_logprobs_num, 0);
    ASSERT_TRUE(r.job->return_logprob);
    rs_openai_req_free(&r);
}

typedef struct bad_case {
    const char *body;
    int code;
    const char *param;
    const char *message;
} bad_case;

static const bad_case bad[] = {
    {"", RS_EINVAL, "", "empty"},
    {"{\"prompt\": [1", RS_EINVAL, "", "invalid JSON"},
    {"{\"model\": \"m\"}", RS_EINVAL, "prompt", "prompt is required"},
    {"{\"prompt\": \"hello\"}", RS_EINVAL, "prompt", "rolloutd takes token ids (no tokenizer configured)"},
    {"{\"prompt\": [\"a\", \"b\"]}", RS_EINVAL, "prompt", "no tokenizer configured"},
    {"{\"prompt\": [[1], \"b\"]}", RS_EINVAL, "prompt", "no tokenizer configured"},
    {"{\"prompt\": []}", RS_EINVAL, "prompt", "must not be empty"},
    {"{\"prompt\": [[1], []]}", RS_EINVAL, "prompt[1]", "prompt[1] must not be empty"},
    {"{\"prompt\": [1, -2]}", RS_EINVAL, "prompt", "prompt[1] must be >= 0"},
    {"{\"prompt\": [1], \"input_ids\": [1]}", RS_EINVAL, "input_ids", "takes prompt"},
    {"{\"prompt\": [1], \"foo\": 1}", RS_EINVAL, "foo", "unknown field 'foo'"},
    {"{\"prompt\": [1], \"model\": 3}", RS_EINVAL, "model", "must be a string"},
    {"{\"prompt\": [1], \"max_tokens\": -1}", RS_EINVAL, "max_tokens", ">= 0"},
    {"{\"prompt\": [1], \"max_tokens\": 1.5}", RS_EINVAL, "max_tokens", "integer"},
    {"{\"prompt\": [1], \"temperature\": -0.5}", RS_EINVAL, "temperature", ">= 0"},
    {"{\"prompt\": [1], \"top_p\": 0}", RS_EINVAL, "top_p", "(0, 1]"},
    {"{\"prompt\": [1], \"top_k\": -3}", RS_EINVAL, "top_k", ">= -1"},
    {"{\"prompt\": [1], \"min_p\": 1.5}", RS_EINVAL, "min_p", "[0, 1]"},
    {"{\"prompt\": [1], \"n\": 0}", RS_EINVAL, "n", ">= 1"},
    {"{\"prompt\": [1], \"seed\": 1.5}", RS_EINVAL, "seed", "integer"},
    {"{\"prompt\": [1], \"logprobs\": true}", RS_EINVAL, "logprobs", "integer, got true"},
    {"{\"prompt\": [1], \"logprobs\": -1}", RS_EINVAL, "logprobs", ">= 0"},
    {"{\"prompt\": [1], \"echo\": 1}", RS_EINVAL, "echo", "true or false"},
    {"{\"prompt\": [1], \"stream_options\": {\"include_usage\": true}}", RS_EINVAL, "stream_options", "stream: true"},
    {"{\"prompt\": [1], \"stream\": true, \"stream_options\": {\"x\": 1}}", RS_EINVAL, "stream_options.x", "unknown"},
    {"{\"prompt\": [1], \"stream\": true, \"stream_options\": {\"continuous_usage_stats\": true}}", RS_EUNSUPPORTED,
     "stream_options.continuous_usage_stats", "not supported"},
    {"{\"prompt\": [1], \"frequency_penalty\": 2.5}", RS_EINVAL, "frequency_penalty",
     "frequency_penalty must be in [-2, 2], got 2.5"},
    {"{\"prompt\": [1], \"presence_penalty\": \"high\"}", RS_EINVAL, "presence_penalty", "must be a number"},
    {"{\"prompt\": [1], \"repetition_penalty\": 0}", RS_EINVAL, "repetition_penalty",
     "repetition_penalty must be > 0, got 0"},
    {"{\"prompt\": [1], \"use_beam_search\": true}", RS_EUNSUPPORTED, "use_beam_search", "not implemented"},
    {"{\"prompt\": [1], \"priority\": 2}", RS_EUNSUPPORTED, "priority", "accepted: null, 0; got 2"},
    {"{\"prompt\": [1], \"stop\": [\"\\n\"]}", RS_EINVAL, "stop", "stop_token_ids"},
    {"{\"prompt\": [1], \"stop\": 5}", RS_EINVAL, "stop", "a string or a list of strings"},
    {"{\"prompt\": [1], \"logit_bias\": {\"5\": 1}}", RS_EUNSUPPORTED, "logit_bias", "not supported"},
    {"{\"prompt\": [1], \"best_of\": 2}", RS_EUNSUPPORTED, "best_of", "equal n"},
    {"{\"prompt\": [1], \"suffix\": \"x\"}", RS_EUNSUPPORTED, "suffix", "not supported"},
    {"{\"prompt\": [1], \"prompt_logprobs\": 1}", RS_EUNSUPPORTED, "prompt_logprobs", "echo"},
    {"{\"prompt\": [1], \"user\": 5}", RS_EINVAL, "user", "a string"},
    {"{\"prompt\": [1], \"skip_special_tokens\": \"no\"}", RS_EINVAL, "skip_special_tokens", "true or false"},
    {"{\"prompt\": [1], \"request_id\": \"\"}", RS_EINVAL, "request_id", "must not be empty"},
    {"{\"prompt\": [1], \"logprobs_mode\": \"fancy\"}", RS_EINVAL, "logprobs_mode", "must be one of"},
};

RS_TEST(protocol_openai_parse_rejects) {
    for (size_t i = 0; i < RS_ARRAY_LEN(bad); i++) {
        rs_openai_req r;
        rs_error err;
        int rc = parse(bad[i].body, &r, &err);
        if (rc != bad[i].code) RS_TEST_FAIL("case %zu %s: code %d, want %d (%s)", i, bad[i].body, rc, bad[i].code, err.message);
        if (strcmp(err.param, bad[i].param) != 0)
            RS_TEST_FAIL("case %zu %s: param '%s', want '%s'", i, bad[i].body, err.param, bad[i].param);
        if (!strstr(err.message, bad[i].message))
            RS_TEST_FAIL("case %zu %s: message '%s' lacks '%s'", i, bad[i].body, err.message, bad[i].message);
        ASSERT_TRUE(r.job == NULL);
    }
}

RS_TEST(protocol_openai_model_check_and_error_names) {
    rs_openai_req r = parse_ok("{\"model\": \"other\", \"prompt\": [1]}");
    rs_error err;
    ASSERT_EQ(rs_openai_check_model(&r, "served", &err), RS_ENOTFOUND);
    ASSERT_STREQ(err.param, "model");
    ASSERT_EQ(rs_openai_check_model(&r, "other", &err), RS_OK);
    rs_openai_req_free(&r);
    /* the engine's refusals, in this API's words */
    rs_gen_invalid w = {.field = RS_GEN_FIELD_MAX_NEW_TOKENS, .problem = RS_GEN_RANGE, .index = -1, .value = 10,
                        .min = 0, .max = 9};
    ASSERT_EQ(rs_openai_invalid(&w, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "max_tokens");
    ASSERT_STREQ(err.message, "max_tokens must be in [0, 9], got 10");
    w = (rs_gen_invalid){.field = RS_GEN_FIELD_PROMPT, .problem = RS_GEN_CONTEXT, .index = 1, .value = 5,
                         .max = 12, .other = 9};
    rs_openai_invalid(&w, &err);
    ASSERT_STREQ(err.param, "prompt[1]");
    ASSERT_STREQ(err.message, "prompt[1] has 5 tokens; with max_tokens=9 that exceeds the context limit of 12");
    w = (rs_gen_invalid){.field = RS_GEN_FIELD_TOP_LOGPROBS, .problem = RS_GEN_RANGE, .index = -1, .value = 21,
                         .max = 20};
    rs_openai_invalid(&w, &err);
    ASSERT_STREQ(err.param, "logprobs");
    ASSERT_STREQ(err.message, "logprobs must be in [0, 20], got 21");
    w = (rs_gen_invalid){.field = RS_GEN_FIELD_N, .problem = RS_GEN_RANGE, .index = -1, .value = 65, .min = 1,
                         .max = 64};
    rs_openai_invalid(&w, &err);
    ASSERT_STREQ(err.param, "n");
    ASSERT_STREQ(err.message, "n must be in [1, 64], got 65");
    w = (rs_gen_invalid){.field = RS_GEN_FIELD_MIN_NEW_TOKENS, .problem = RS_GEN_RANGE, .index = -1, .value = 5,
                         .max = 4};
    rs_openai_invalid(&w, &err);
    ASSERT_STREQ(err.param, "min_tokens");
    ASSERT_STREQ(err.message, "min_tokens must be in [0, max_tokens=4], got 5");
    w = (rs_gen_invalid){.field = RS_GEN_FIELD_PROMPT, .problem = RS_GEN_VOCAB, .index = -1, .pos = 1,
                         .value = 9000, .max = 8192};
    rs_openai_invalid(&w, &err);
    ASSERT_STREQ(err.param, "prompt");
    ASSERT_STREQ(err.message, "prompt[1] = 9000 is outside the vocabulary [0, 8192)");
    /* the same refusals in /generate's words */
    rs_generate_invalid(&(rs_generate_req){0}, &w, &err);
    ASSERT_STREQ(err.param, "input_ids");
    ASSERT_STREQ(err.message, "input_ids[1] = 9000 is outside the vocabulary [0, 8192)");
    w = (rs_gen_invalid){.field = RS_GEN_FIELD_MIN_NEW_TOKENS, .problem = RS_GEN_RANGE, .index = -1, .value = 5,
                         .max = 4};
    rs_generate_invalid(&(rs_generate_req){0}, &w, &err);
    ASSERT_STREQ(err.param, "sampling_params.min_new_tokens");
    ASSERT_STREQ(err.message, "sampling_params.min_new_tokens must be in [0, max_new_tokens=4], got 5");
    w = (rs_gen_invalid){.field = RS_GEN_FIELD_PROMPTS, .problem = RS_GEN_BATCH, .index = -1, .value = 17,
                         .max = 1024, .other = 64};
    rs_generate_invalid(&(rs_generate_req){0}, &w, &err);
    ASSERT_STREQ(err.param, "input_ids");
    ASSERT_STREQ(err.message, "17 prompts x n=64 sequences exceeds the per-request limit of 1024");
}

/* Fills outputs as the engine would: two tokens each, top alternatives when asked. */
static void fill(rs_openai_req *r) {
    rs_gen_job *j = r->job;
    int n = j->n_prompts * j->sp.n, k = j->top_logprobs_num;
    j->outputs = calloc((size_t)n, sizeof(rs_gen_output));
    for (int i = 0; i < n; i++) {
        rs_gen_output *o = &j->outputs[i];
        o->output_ids = malloc(2 * sizeof(int32_t));
        o->output_logprobs = malloc(2 * sizeof(float));
        o->output_ids[0] = 220;
        o->output_ids[1] = 19 + i;
        o->output_logprobs[0] = -0.5f;
        o->output_logprobs[1] = -1.0f;
        o->n_output = o->cap = 2;
        if (k > 0) {
            o->output_top_ids = malloc(sizeof(int32_t) * 2 * (size_t)k);
            o->output_top_lps = malloc(sizeof(float) * 2 * (size_t)k);
            for (int t = 0; t < 2 * k; t++) {
                o->output_top_ids[t] = t % k == 0 ? o->output_ids[t / k] : 1000 + t; /* the sampled token is top-1 */
                o->output_top_lps[t] = -0.5f - (float)(t % k);
            }
        }
        int plen = j->prompt_lens[i / j->sp.n];
        if (j->logprob_start_len == 0) {
            o->n_input_logprobs = plen;
            o->input_logprobs = malloc(sizeof(float) * (size_t)plen);
            o->input_top_ids = k ? malloc(sizeof(int32_t) * (size_t)(plen * k)) : NULL;
            o->input_top_lps = k ? malloc(sizeof(float) * (size_t)(plen * k)) : NULL;
            for (int t = 0; t < plen; t++) {
                o->input_logprobs[t] = t == 0 ? NAN : -2.0f;
                for (int a = 0; a < k; a++) {
                    o->input_top_ids[t * k + a] = t == 0 ? -1 : 500 + a;
                    o->input_top_lps[t * k + a] = -3.0f;
                }
            }
        }
        o->prompt_tokens = plen;
        o->finish = i == 0 ? (rs_finish){.type = RS_FINISH_STOP, .matched = 19}
                           : (rs_finish){.type = RS_FINISH_LENGTH, .length = 2};
    }
    snprintf(r->id, sizeof r->id, "cmpl-x");
    snprintf(r->model, sizeof r->model, "m");
    r->created = 1700000000;
}

RS_TEST(protocol_openai_response_shape) {
    rs_openai_req r = parse_ok("{\"model\": \"m\", \"prompt\": [7, 8], \"n\": 2, \"logprobs\": 1,"
                               " \"stop_token_ids\": [19], \"return_token_ids\": true}");
    fill(&r);
    size_t len;
    char *body = rs_openai_completions_response(&r, &len);
    json_t *v = json_loadb(body, len, 0, NULL);
    ASSERT_TRUE(v != NULL);
    ASSERT_STREQ(json_string_value(json_object_get(v, "object")), "text_completion");
    ASSERT_STREQ(json_string_value(json_object_get(v, "id")), "cmpl-x");
    ASSERT_EQ(json_integer_value(json_object_get(v, "created")), 1700000000);
    json_t *choices = json_object_get(v, "choices");
    ASSERT_EQ(json_array_size(choices), 2);
    json_t *c0 = json_array_get(choices, 0), *c1 = json_array_get(choices, 1);
    ASSERT_EQ(json_integer_value(json_object_get(c1, "index")), 1);
    ASSERT_STREQ(json_string_value(json_object_get(c0, "text")), "");
    ASSERT_STREQ(json_string_value(json_object_get(c0, "finish_reason")), "stop");
    ASSERT_EQ(json_integer_value(json_object_get(c0, "stop_reason")), 19); /* one of stop_token_ids */
    ASSERT_STREQ(json_string_value(json_object_get(c1, "finish_reason")), "length");
    ASSERT_TRUE(json_is_null(json_object_get(c1, "stop_reason")));
    ASSERT_EQ(json_integer_value(json_array_get(json_object_get(c0, "token_ids"), 1)), 19);
    ASSERT_EQ(json_array_size(json_object_get(c0, "prompt_token_ids")), 2);
    json_t *lp = json_object_get(c0, "logprobs");
    ASSERT_STREQ(json_string_value(json_array_get(json_object_get(lp, "tokens"), 0)), "token_id:220");
    ASSERT_NEAR(json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), 1)), -1.0, 0);
    /* logprobs 1: the sampled token plus one alternative (here the same token: one entry) */
    json_t *top0 = json_array_get(json_object_get(lp, "top_logprobs"), 0);
    ASSERT_EQ(json_object_size(top0), 1);
    ASSERT_NEAR(json_real_value(json_object_get(top0, "token_id:220")), -0.5, 0);
    /* text_offset: offsets into the concatenated token strings ("token_id:220" is 12 bytes) */
    ASSERT_EQ(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 1)), 12);
    json_t *usage = json_object_get(v, "usage");
    ASSERT_EQ(json_integer_value(json_object_get(usage, "prompt_tokens")), 2); /* the prompt once, not per sample */
    ASSERT_EQ(json_integer_value(json_object_get(usage, "completion_tokens")), 4);
    ASSERT_EQ(json_integer_value(json_object_get(usage, "total_tokens")), 6);
    json_decref(v);
    free(body);
    rs_openai_req_free(&r);
}

RS_TEST(protocol_openai_response_echo_scores_prompt) {
    rs_openai_req r = parse_ok("{\"prompt\": [7, 8, 9], \"logprobs\": 2, \"echo\": true}");
    fill(&r);
    size_t len;
    char *body = rs_openai_completions_response(&r, &len);
    json_t *v = json_loadb(body, len, 0, NULL);
    json_t *lp = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "logprobs");
    json_t *tokens = json_object_get(lp, "tokens"), *tlp = json_object_get(lp, "token_logprobs");
    json_t *top = json_object_get(lp, "top_logprobs");
    ASSERT_EQ(json_array_size(tokens), 5); /* 3 prompt + 2 output */
    ASSERT_STREQ(json_string_value(json_array_get(tokens, 0)), "token_id:7");
    ASSERT_TRUE(json_is_null(json_array_get(tlp, 0)));
    ASSERT_TRUE(json_is_null(json_array_get(top, 0)));
    ASSERT_NEAR(json_real_value(json_array_get(tlp, 1)), -2.0, 0);
    ASSERT_EQ(json_object_size(json_array_get(top, 1)), 3); /* token 8 itself + 2 alternatives */
    ASSERT_STREQ(json_string_value(json_array_get(tokens, 3)), "token_id:220");
    json_decref(v);
    free(body);
    rs_openai_req_free(&r);
}

RS_TEST(protocol_openai_stream_chunks) {
    rs_openai_req r = parse_ok("{\"prompt\": [[7], [8]], \"stream\": true, \"stream_options\": {\"include_usage\": true},"
                               " \"return_token_ids\": true}");
    fill(&r);
    /* pretend the first call sees one token per output, unfinished */
    rs_finish f0 = r.job->outputs[0].finish, f1 = r.job->outputs[1].finish;
    for (int i = 0; i < 2; i++) {
        r.job->outputs[i].n_output = 1;
        r.job->outputs[i].finish.type = RS_FINISH_NONE;
    }
    rs_buf b = {0};
    ASSERT_EQ(rs_openai_stream_events(&r, false, &b), RS_OK);
    for (int i = 0; i < 2; i++) r.job->outputs[i].n_output = 2;
    r.job->outputs[0].finish = f0;
    r.job->outputs[1].finish = f1;
    ASSERT_EQ(rs_openai_stream_events(&r, true, &b), RS_OK);
    /* 2 first chunks, 2 last chunks, usage, [DONE] */
    const char *p = b.data;
    int n = 0;
    json_t *ev[8];
    while (*p) {
        ASSERT_TRUE(strncmp(p, "data: ", 6) == 0);
        const char *e = strstr(p, "\n\n");
        ASSERT_TRUE(e != NULL);
        if (strncmp(p + 6, "[DONE]", 6) == 0) {
            ASSERT_TRUE(e[2] == '\0');
            break;
        }
        ev[n] = json_loadb(p + 6, (size_t)(e - p - 6), 0, NULL);
        ASSERT_TRUE(ev[n] != NULL);
        n++;
        p = e + 2;
    }
    ASSERT_EQ(n, 5);
    for (int i = 0; i < 4; i++) {
        json_t *choices = json_object_get(ev[i], "choices");
        ASSERT_EQ(json_array_size(choices), 1);
        json_t *c = json_array_get(choices, 0);
        ASSERT_EQ(json_integer_value(json_object_get(c, "index")), i % 2);
        ASSERT_EQ(json_array_size(json_object_get(c, "token_ids")), 1); /* deltas */
        ASSERT_EQ(json_object_get(c, "prompt_token_ids") != NULL, i < 2); /* first chunk only */
        ASSERT_EQ(json_is_null(json_object_get(c, "finish_reason")), i < 2);
        ASSERT_STREQ(json_string_value(json_object_get(ev[i], "object")), "text_completion");
    }
    ASSERT_EQ(json_array_size(json_object_get(ev[4], "choices")), 0);
    ASSERT_EQ(json_integer_value(json_object_get(json_object_get(ev[4], "usage"), "completion_tokens")), 4);
    for (int i = 0; i < n; i++) json_decref(ev[i]);
    rs_buf_free(&b);
    rs_openai_req_free(&r);
}

RS_TEST(protocol_openai_models_body) {
    size_t len;
    char *b = rs_openai_models_body("m", "/x/\xff", 5, 4096, &len);
    json_t *v = json_loadb(b, len, 0, NULL);
    ASSERT_TRUE(v != NULL);
    json_t *m = json_array_get(json_object_get(v, "data"), 0);
    ASSERT_STREQ(json_string_value(json_object_get(m, "id")), "m");
    ASSERT_STREQ(json_string_value(json_object_get(m, "root")), "/x/?"); /* not UTF-8: made so */
    ASSERT_EQ(json_integer_value(json_object_get(m, "max_model_len")), 4096);
    json_decref(v);
    free(b);
}
