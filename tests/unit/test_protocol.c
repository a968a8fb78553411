/*
 * test_protocol.c — the /generate parser and response writer, and error bodies (protocol/).
 *
 * Parsing: valid requests land in the job with the right values and defaults; every kind of bad
 * input gets the right code, names the right param, and says what was wrong. Writing: a hand-built
 * finished job serializes to the expected JSON, compared as parsed JSON values (not strings).
 */
#include <jansson.h>
#include <math.h>
#include <string.h>

#include "../../protocol/errors.h"
#include "../../protocol/generate.h"
#include "test.h"

static int parse(const char *body, rs_generate_req *r, rs_error *err) {
    memset(err, 0, sizeof *err);
    return rs_generate_parse(body, strlen(body), NULL, r, err);
}

static rs_generate_req parse_ok(const char *body) {
    rs_generate_req r;
    rs_error err;
    int rc = parse(body, &r, &err);
    if (rc != RS_OK) RS_TEST_FAIL("parse(%s) failed: %s (param %s)", body, err.message, err.param);
    return r;
}

RS_TEST(protocol_parse_single_defaults) {
    rs_generate_req r = parse_ok("{\"input_ids\": [5, 6, 7]}");
    rs_gen_job *j = r.job;
    ASSERT_EQ(j->n_prompts, 1);
    ASSERT_TRUE(!j->batched);
    ASSERT_EQ(j->prompt_lens[0], 3);
    ASSERT_EQ(j->prompts[0][0], 5);
    ASSERT_EQ(j->prompts[0][2], 7);
    ASSERT_STREQ(j->rid, ""); /* the server names it */
    ASSERT_STREQ(r.rid, "");
    ASSERT_TRUE(r.prompt_rids == NULL);
    rs_sampling_params d;
    rs_sampling_params_default(&d);
    ASSERT_EQ(j->sp.max_new_tokens, d.max_new_tokens);
    ASSERT_EQ(j->sp.n, 1);
    ASSERT_EQ(j->sp.top_k, -1);
    ASSERT_NEAR(j->sp.temperature, 1.0, 0);
    ASSERT_NEAR(j->sp.top_p, 1.0, 0);
    ASSERT_NEAR(j->sp.min_p, 0.0, 0);
    ASSERT_EQ(j->sp.n_stop_token_ids, 0);
    ASSERT_TRUE(!j->sp.ignore_eos);
    ASSERT_TRUE(!j->return_logprob);
    ASSERT_EQ(j->logprob_start_len, -1);
    ASSERT_TRUE(!j->stream);
    rs_generate_req_free(&r);
    ASSERT_TRUE(r.job == NULL);
}

/* Whether max_new_tokens was given: the server lowers only the default to its cap and the context. */
RS_TEST(protocol_parse_max_new_tokens_given) {
    static const struct { const char *body; bool given; int value; } cases[] = {
        {"{\"input_ids\": [1]}", false, 128},
        {"{\"input_ids\": [1], \"sampling_params\": null}", false, 128},
        {"{\"input_ids\": [1], \"sampling_params\": {\"max_new_tokens\": null}}", false, 128},
        {"{\"input_ids\": [1], \"sampling_params\": {\"max_new_tokens\": 128}}", true, 128},
        {"{\"input_ids\": [1], \"sampling_params\": {\"max_new_tokens\": 0}}", true, 0},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(cases); i++) {
        rs_generate_req r = parse_ok(cases[i].body);
        if (r.max_new_tokens_given != cases[i].given || r.job->sp.max_new_tokens != cases[i].value)
            RS_TEST_FAIL("%s: given %d, max_new_tokens %d", cases[i].body, r.max_new_tokens_given,
                         r.job->sp.max_new_tokens);
        rs_generate_req_free(&r);
    }
}

/* JSON Schema's "integer" (and pydantic's and Python's int) takes 16.0 and 1e1: every integer
 * field and token id does too, with the value it names. */
RS_TEST(protocol_parse_integral_reals_are_integers) {
    rs_generate_req r = parse_ok("{\"input_ids\": [[5.0, 6], [7e0]], \"return_logprob\": true, \"top_logprobs_num\": 2.0,"
                                 " \"logprob_start_len\": -1.0, \"sampling_params\": {\"max_new_tokens\": 16.0,"
                                 " \"top_k\": 1e1, \"n\": 2.0, \"stop_token_ids\": [3.0, 4],"
                                 " \"sampling_seed\": 9007199254740992.0}}");
    rs_gen_job *j = r.job;
    ASSERT_EQ(j->n_prompts, 2);
    ASSERT_EQ(j->prompt_lens[0], 2);
    ASSERT_EQ(j->prompts[0][0], 5);
    ASSERT_EQ(j->prompts[0][1], 6);
    ASSERT_EQ(j->prompts[1][0], 7);
    ASSERT_EQ(j->top_logprobs_num, 2);
    ASSERT_EQ(j->logprob_start_len, -1);
    ASSERT_EQ(j->sp.max_new_tokens, 16);
    ASSERT_EQ(j->sp.top_k, 10);
    ASSERT_EQ(j->sp.n, 2);
    ASSERT_EQ(j->sp.n_stop_token_ids, 2);
    ASSERT_EQ(j->sp.stop_token_ids[0], 3);
    ASSERT_EQ(j->sp.stop_token_ids[1], 4);
    ASSERT_TRUE(j->sp.seed == 9007199254740992ull);
    rs_generate_req_free(&r);
}

RS_TEST(protocol_parse_every_field) {
    rs_generate_req r = parse_ok(
        "{\"rid\": \"grp7-s3\", \"input_ids\": [151644, 872, 198],"
        " \"sampling_params\": {\"max_new_tokens\": 4096, \"min_new_tokens\": 2, \"temperature\": 0.5,"
        "   \"top_p\": 0.9, \"top_k\": 40, \"min_p\": 0.05, \"n\": 1, \"sampling_seed\": 1234,"
        "   \"stop_token_ids\": [151645, 7], \"ignore_eos\": true},"
        " \"return_logprob\": true, \"logprob_start_len\": 0, \"top_logprobs_num\": 0,"
        " \"logprobs_mode\": \"default\", \"stream\": false}");
    rs_gen_job *j = r.job;
    ASSERT_STREQ(r.rid, "grp7-s3");
    ASSERT_STREQ(j->rid, ""); /* the engine's name for the job is the server's to choose */
    ASSERT_EQ(j->prompts[0][0], 151644);
    ASSERT_EQ(j->sp.max_new_tokens, 4096);
    ASSERT_EQ(j->sp.min_new_tokens, 2);
    ASSERT_NEAR(j->sp.temperature, 0.5, 0);
    ASSERT_NEAR(j->sp.top_p, 0.9f, 0);
    ASSERT_EQ(j->sp.top_k, 40);
    ASSERT_NEAR(j->sp.min_p, 0.05f, 0);
    ASSERT_EQ(j->sp.seed, 1234);
    ASSERT_EQ(j->sp.n_stop_token_ids, 2);
    ASSERT_EQ(j->sp.stop_token_ids[0], 151645);
    ASSERT_EQ(j->sp.stop_token_ids[1], 7);
    ASSERT_TRUE(j->sp.ignore_eos);
    ASSERT_TRUE(j->return_logprob);
    ASSERT_EQ(j->logprob_start_len, 0);
    rs_generate_req_free(&r);
}

RS_TEST(protocol_parse_batched_and_n) {
    rs_generate_req r = parse_ok("{\"rid\": \"b\", \"input_ids\": [[1, 2], [3], [4, 5, 6]],"
                                 " \"sampling_params\": {\"n\": 4, \"temperature\": 1}}");
    rs_gen_job *j = r.job;
    ASSERT_TRUE(j->batched);
    ASSERT_EQ(j->n_prompts, 3);
    ASSERT_EQ(j->prompt_lens[0], 2);
    ASSERT_EQ(j->prompt_lens[1], 1);
    ASSERT_EQ(j->prompt_lens[2], 3);
    ASSERT_EQ(j->prompts[2][2], 6);
    ASSERT_EQ(j->sp.n, 4);
    ASSERT_NEAR(j->sp.temperature, 1.0, 0); /* an integer where a number belongs is fine */
    rs_generate_req_free(&r);

    r = parse_ok("{\"input_ids\": [[9]]}"); /* a batch of one is still a batch */
    ASSERT_TRUE(r.job->batched);
    ASSERT_EQ(r.job->n_prompts, 1);
    rs_generate_req_free(&r);
}

RS_TEST(protocol_parse_rid_list) {
    rs_generate_req r = parse_ok("{\"rid\": [\"a\", \"b\"], \"input_ids\": [[1], [2]]}");
    ASSERT_TRUE(r.prompt_rids != NULL);
    ASSERT_STREQ(r.prompt_rids[0], "a");
    ASSERT_STREQ(r.prompt_rids[1], "b");
    ASSERT_STREQ(r.rid, "a");
    rs_generate_req_free(&r);
}

RS_TEST(protocol_parse_null_means_default) {
    rs_generate_req r = parse_ok("{\"rid\": null, \"input_ids\": [1], \"sampling_params\": {\"top_k\": null,"
                                 " \"stop_token_ids\": null, \"temperature\": null}, \"return_logprob\": null,"
                                 " \"stream\": null, \"logprobs_mode\": null}");
    ASSERT_EQ(r.job->sp.top_k, -1);
    ASSERT_NEAR(r.job->sp.temperature, 1.0, 0);
    ASSERT_STREQ(r.job->rid, "");
    rs_generate_req_free(&r);
    r = parse_ok("{\"input_ids\": [1], \"logprob_start_len\": 0}"); /* no effect without return_logprob */
    ASSERT_EQ(r.job->logprob_start_len, -1);
    rs_generate_req_free(&r);
    r = parse_ok("{\"input_ids\": [1], \"sampling_params\": null}");
    ASSERT_EQ(r.job->sp.n, 1);
    rs_generate_req_free(&r);
}

typedef struct bad_case {
    const char *body;
    int code;
    const char *param;      /* "" = null param */
    const char *message;    /* a substring of the message */
} bad_case;

static const bad_case bad_cases[] = {
    /* malformed bodies */
    {"", RS_EINVAL, "", "empty"},
    {"{\"input_ids\": [1, 2", RS_EINVAL, "", "invalid JSON"},
    {"{\"input_ids\": [1]}}", RS_EINVAL, "", "invalid JSON"},
    {"[1, 2, 3]", RS_EINVAL, "", "must be a JSON object"},
    {"\"input_ids\"", RS_EINVAL, "", "invalid JSON"},
    {"{\"input_ids\": [1], \"input_ids\": [2]}", RS_EINVAL, "", "duplicate"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"n\": 1, \"n\": 2}}", RS_EINVAL, "", "duplicate"},
    {"{\"input_ids\": [1e400]}", RS_EINVAL, "", "invalid JSON"},
    {"{\"input_ids\": [9223372036854775808]}", RS_EINVAL, "", "invalid JSON"},
    {"{\"input_ids\": [NaN]}", RS_EINVAL, "", "invalid JSON"},
    {"{\"input_ids\": [1], \"rid\": \"a\\u0000b\"}", RS_EINVAL, "", "invalid JSON"},
    /* unknown fields */
    {"{\"input_ids\": [1], \"foo\": 1}", RS_EINVAL, "foo", "unknown field 'foo'"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"seed\": 1}}", RS_EINVAL, "sampling_params.seed",
     "unknown field 'sampling_params.seed'"},
    {"{\"text\": \"hi\"}", RS_EINVAL, "text", "no tokenizer.json"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"sampling_seed\": 1, \"seed\": 1}}", RS_EINVAL,
     "sampling_params.seed", "sampling_seed"},
    {"{\"input_ids\": [1], \"Input_ids\": [1]}", RS_EINVAL, "Input_ids", "unknown field 'Input_ids'"},
    /* input_ids */
    {"{}", RS_EINVAL, "input_ids", "input_ids is required"},
    {"{\"input_ids\": null}", RS_EINVAL, "input_ids", "required"},
    {"{\"input_ids\": []}", RS_EINVAL, "input_ids", "must not be empty"},
    {"{\"input_ids\": [[1], []]}", RS_EINVAL, "input_ids[1]", "input_ids[1] must not be empty"},
    {"{\"input_ids\": \"1 2 3\"}", RS_EINVAL, "input_ids", "got a string"},
    {"{\"input_ids\": [1, -5]}", RS_EINVAL, "input_ids", "input_ids[1] must be >= 0, got -5"},
    {"{\"input_ids\": [1, 2147483648]}", RS_EINVAL, "input_ids", "input_ids[1] must be < 2147483648"},
    {"{\"input_ids\": [1, 1.5]}", RS_EINVAL, "input_ids", "got 1.5"},
    {"{\"input_ids\": [true]}", RS_EINVAL, "input_ids", "got true"},
    {"{\"input_ids\": [1, [2]]}", RS_EINVAL, "input_ids", "got a list"},
    {"{\"input_ids\": [[1], 2]}", RS_EINVAL, "input_ids[1]", "got 2"},
    {"{\"input_ids\": [[1], [2, -1]]}", RS_EINVAL, "input_ids[1]", "input_ids[1][1] must be >= 0"},
    /* rid */
    {"{\"input_ids\": [1], \"rid\": 5}", RS_EINVAL, "rid", "rid must be a string or a list of strings, got 5"},
    {"{\"input_ids\": [1], \"rid\": \"\"}", RS_EINVAL, "rid", "must not be empty"},
    {"{\"input_ids\": [[1], [2]], \"rid\": [\"a\"]}", RS_EINVAL, "rid", "rid has 1 entries but input_ids has 2"},
    {"{\"input_ids\": [[1], [2]], \"rid\": [\"a\", 3]}", RS_EINVAL, "rid[1]", "rid[1] must be a string"},
    {"{\"input_ids\": [1], \"rid\": \"a\\nb\"}", RS_EINVAL, "rid", "control characters"},
    /* sampling_params */
    {"{\"input_ids\": [1], \"sampling_params\": [1]}", RS_EINVAL, "sampling_params", "must be an object"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"temperature\": -1}}", RS_EINVAL, "sampling_params.temperature",
     "sampling_params.temperature must be >= 0, got -1"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"temperature\": \"hot\"}}", RS_EINVAL,
     "sampling_params.temperature", "must be a number, got a string"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"temperature\": 1e300}}", RS_EINVAL,
     "sampling_params.temperature", "out of range"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"top_p\": 0}}", RS_EINVAL, "sampling_params.top_p", "(0, 1]"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"top_p\": 1.01}}", RS_EINVAL, "sampling_params.top_p", "got 1.01"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"top_k\": 0}}", RS_EINVAL, "sampling_params.top_k", "-1 (off) or >= 1"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"top_k\": -2}}", RS_EINVAL, "sampling_params.top_k", ">= -1"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"top_k\": 2.5}}", RS_EINVAL, "sampling_params.top_k", "integer"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"min_p\": -0.1}}", RS_EINVAL, "sampling_params.min_p", "[0, 1]"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"min_p\": 2}}", RS_EINVAL, "sampling_params.min_p", "got 2"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"n\": 0}}", RS_EINVAL, "sampling_params.n", ">= 1, got 0"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"n\": true}}", RS_EINVAL, "sampling_params.n", "got true"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"max_new_tokens\": -1}}", RS_EINVAL,
     "sampling_params.max_new_tokens", ">= 0, got -1"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"max_new_tokens\": 3000000000}}", RS_EINVAL,
     "sampling_params.max_new_tokens", "<= 2147483647"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"max_new_tokens\": 16.5}}", RS_EINVAL,
     "sampling_params.max_new_tokens", "integer, got 16.5"},
    /* an integral real is an integer (16.0 is parsed as 16 below); its range is checked as given */
    {"{\"input_ids\": [1], \"sampling_params\": {\"max_new_tokens\": 1e300}}", RS_EINVAL,
     "sampling_params.max_new_tokens", "<= 2147483647, got 1e+300"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"max_new_tokens\": -1e300}}", RS_EINVAL,
     "sampling_params.max_new_tokens", ">= 0, got -1e+300"},
    {"{\"input_ids\": [1, 2147483648.0]}", RS_EINVAL, "input_ids", "input_ids[1] must be < 2147483648"},
    {"{\"input_ids\": [1, -5.0]}", RS_EINVAL, "input_ids", "input_ids[1] must be >= 0, got -5"},
    {"{\"input_ids\": [1, 1e19]}", RS_EINVAL, "input_ids", "input_ids[1] must be < 2147483648, got 1e+19"},
    {"{\"input_ids\": [1, -1e19]}", RS_EINVAL, "input_ids", "input_ids[1] must be >= 0, got -1e+19"},
    /* 2^63 as a real is past every long long, LLONG_MAX included */
    {"{\"input_ids\": [1], \"sampling_params\": {\"sampling_seed\": 9223372036854775808.0}}", RS_EINVAL,
     "sampling_params.sampling_seed", "<= 9223372036854775807, got 9.22337e+18"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"min_new_tokens\": -3}}", RS_EINVAL,
     "sampling_params.min_new_tokens", ">= 0"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"sampling_seed\": -1}}", RS_EINVAL,
     "sampling_params.sampling_seed", ">= 0"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"stop_token_ids\": 5}}", RS_EINVAL,
     "sampling_params.stop_token_ids", "list of token ids"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"stop_token_ids\": [1, -1]}}", RS_EINVAL,
     "sampling_params.stop_token_ids", "sampling_params.stop_token_ids[1] must be >= 0"},
    {"{\"input_ids\": [1], \"sampling_params\": {\"ignore_eos\": 1}}", RS_EINVAL, "sampling_params.ignore_eos",
     "true or false, got 1"},
    /* the rest */
    {"{\"input_ids\": [1], \"return_logprob\": \"yes\"}", RS_EINVAL, "return_logprob", "true or false"},
    {"{\"input_ids\": [1], \"logprob_start_len\": -2}", RS_EINVAL, "logprob_start_len", ">= -1, got -2"},
    {"{\"input_ids\": [1], \"logprob_start_len\": 0.5}", RS_EINVAL, "logprob_start_len", "integer"},
    {"{\"input_ids\": [1], \"top_logprobs_num\": -1}", RS_EINVAL, "top_logprobs_num", ">= 0"},
    {"{\"input_ids\": [1], \"top_logprobs_num\": 1.5}", RS_EINVAL, "top_logprobs_num", "integer"},
    {"{\"input_ids\": [1], \"logprobs_mode\": \"Raw\"}", RS_EINVAL, "logprobs_mode", "must be one of"},
    {"{\"input_ids\": [1], \"logprobs_mode\": \"fancy\"}", RS_EINVAL, "logprobs_mode", "must be one of"},
    {"{\"input_ids\": [1], \"logprobs_mode\": 3}", RS_EINVAL, "logprobs_mode", "must be a string"},
    {"{\"input_ids\": [1], \"stream\": \"no\"}", RS_EINVAL, "stream", "true or false"},
};

RS_TEST(protocol_parse_rejects_bad_requests) {
    for (size_t i = 0; i < RS_ARRAY_LEN(bad_cases); i++) {
        const bad_case *c = &bad_cases[i];
        rs_generate_req r;
        rs_error err;
        int rc = parse(c->body, &r, &err);
        if (rc != c->code)
            RS_TEST_FAIL("case %zu %s: code %d, want %d (%s)", i, c->body, rc, c->code, err.message);
        if (strcmp(err.param, c->param) != 0)
            RS_TEST_FAIL("case %zu %s: param '%s', want '%s' (%s)", i, c->body, err.param, c->param, err.message);
        if (!strstr(err.message, c->message))
            RS_TEST_FAIL("case %zu %s: message '%s' lacks '%s'", i, c->body, err.message, c->message);
        ASSERT_TRUE(r.job == NULL);
    }
}

RS_TEST(protocol_parse_rejects_invalid_utf8) {
    static const char body[] = "{\"input_ids\": [1], \"rid\": \"a\xff\xfe\"}";
    rs_generate_req r;
    rs_error err;
    ASSERT_EQ(rs_generate_parse(body, sizeof body - 1, NULL, &r, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "rid"); /* the field whose bytes are not UTF-8 is named */
    ASSERT_TRUE(strstr(err.message, "rid is not valid UTF-8 (byte 0xff at offset 28") != NULL);
    static const char text[] = "{\"text\": [\"ok\", \"[\\\"x\\\"]\", \"b\xe4\xb8\"], \"input_ids\": [1]}";
    ASSERT_EQ(rs_generate_parse(text, sizeof text - 1, NULL, &r, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "text[2]");
    static const char stop[] = "{\"input_ids\": [1], \"sampling_params\": {\"n\": 1, \"stop\": [\"\\u00e9\", \"\xc3\"]}}";
    ASSERT_EQ(rs_generate_parse(stop, sizeof stop - 1, NULL, &r, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "sampling_params.stop[1]");
    /* a key that is not UTF-8 either */
    static const char body2[] = "{\"input_ids\": [1], \"\xc3\x28\": 1}";
    ASSERT_EQ(rs_generate_parse(body2, sizeof body2 - 1, NULL, &r, &err), RS_EINVAL);
    /* bytes after the object */
    static const char body3[] = "{\"input_ids\": [1]}\0garbage";
    ASSERT_EQ(rs_generate_parse(body3, sizeof body3 - 1, NULL, &r, &err), RS_EINVAL);
    /* the error body stays valid JSON even when the message quotes odd bytes */
    rs_error e2;
    rs_error_set(&e2, RS_EINVAL, "k\xff", "unknown field 'k\xff'");
    size_t len;
    char *b = rs_error_body(&e2, &len);
    json_t *v = json_loadb(b, len, 0, NULL);
    ASSERT_TRUE(v != NULL);
    json_decref(v);
    free(b);
}

RS_TEST(protocol_parse_not_nul_terminated) {
    /* The parser reads exactly len bytes: the body is not a C string. */
    char buf[64];
    memset(buf, 'x', sizeof buf);
    const char *s = "{\"input_ids\": [3]}";
    memcpy(buf, s, strlen(s));
    rs_generate_req r;
    rs_error err;
    ASSERT_EQ(rs_generate_parse(buf, strlen(s), NULL, &r, &err), RS_OK);
    ASSERT_EQ(r.job->prompts[0][0], 3);
    rs_generate_req_free(&r);
}

/* ---------------------------------------------------------------- responses */

/* Fills outputs as the engine would. */
static void finish_output(rs_gen_job *j, int i, const int32_t *ids, const float *lps, int n, rs_finish f,
                          double latency) {
    rs_gen_output *o = &j->outputs[i];
    o->output_ids = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    o->output_logprobs = malloc(sizeof(float) * (size_t)(n ? n : 1));
    memcpy(o->output_ids, ids, sizeof(int32_t) * (size_t)n);
    memcpy(o->output_logprobs, lps, sizeof(float) * (size_t)n);
    o->n_output = o->cap = n;
    o->finish = f;
    o->e2e_latency = latency;
}

static void expect_json(const char *got, size_t len, const char *want) {
    json_error_t e1, e2;
    json_t *g = json_loadb(got, len, 0, &e1), *w = json_loads(want, 0, &e2);
    if (!g) RS_TEST_FAIL("response is not JSON (%s): %.*s", e1.text, (int)len, got);
    if (!w) RS_TEST_FAIL("expected JSON is not JSON (%s)", e2.text);
    if (!json_equal(g, w)) RS_TEST_FAIL("response\n    %.*s\n  differs from\n    %s", (int)len, got, want);
    json_decref(g);
    json_decref(w);
}

RS_TEST(protocol_response_single_with_logprobs) {
    rs_generate_req r = parse_ok("{\"rid\": \"grp7-s3\", \"input_ids\": [10, 11, 12], \"return_logprob\": true,"
                                 " \"logprob_start_len\": 0}");
    rs_gen_job *j = r.job;
    snprintf(j->weight_version, sizeof j->weight_version, "17");
    j->outputs = calloc(1, sizeof(rs_gen_output));
    int32_t ids[] = {220, 19, 151645};
    float lps[] = {-0.5f, -1.25f, -0.125f};
    finish_output(j, 0, ids, lps, 3, (rs_finish){.type = RS_FINISH_STOP, .matched = 151645}, 1.5);
    j->outputs[0].prompt_tokens = 3;
    j->outputs[0].cached_tokens = 1;
    j->outputs[0].n_input_logprobs = 3;
    j->outputs[0].input_logprobs = malloc(3 * sizeof(float));
    j->outputs[0].input_logprobs[0] = NAN;
    j->outputs[0].input_logprobs[1] = -2.0f;
    j->outputs[0].input_logprobs[2] = -3.5f;
    size_t len;
    char *body = rs_generate_response(&r, &len);
    ASSERT_TRUE(body != NULL);
    ASSERT_EQ(strlen(body), len);
    expect_json(body, len,
                "{\"output_ids\": [220, 19, 151645], \"meta_info\": {\"id\": \"grp7-s3\","
                " \"finish_reason\": {\"type\": \"stop\", \"matched\": 151645}, \"prompt_tokens\": 3,"
                " \"completion_tokens\": 3, \"cached_tokens\": 1, \"weight_version\": \"17\", \"num_retractions\": 0,"
                " \"output_token_logprobs\": [[-0.5, 220, null], [-1.25, 19, null], [-0.125, 151645, null]],"
                " \"input_token_logprobs\": [[null, 10, null], [-2.0, 11, null], [-3.5, 12, null]],"
                " \"output_top_logprobs\": [], \"input_top_logprobs\": [], \"e2e_latency\": 1.5}}");
    free(body);
    rs_generate_req_free(&r);
}

RS_TEST(protocol_response_batched_n_ids_and_finishes) {
    rs_generate_req r = parse_ok("{\"rid\": \"g\", \"input_ids\": [[1, 2], [3]], \"sampling_params\": {\"n\": 2}}");
    rs_gen_job *j = r.job;
    snprintf(j->weight_version, sizeof j->weight_version, "3");
    j->outputs = calloc(4, sizeof(rs_gen_output));
    int32_t ids[] = {7, 8};
    float lps[] = {-1, -1};
    finish_output(j, 0, ids, lps, 2, (rs_finish){.type = RS_FINISH_LENGTH, .length = 2}, 0.25);
    finish_output(j, 1, ids, lps, 1, (rs_finish){.type = RS_FINISH_STOP, .matched = 7}, 0.25);
    rs_finish ab = {.type = RS_FINISH_ABORT};
    snprintf(ab.message, sizeof ab.message, "server shutting down");
    finish_output(j, 2, ids, lps, 0, ab, 0.25);
    finish_output(j, 3, ids, lps, 2, (rs_finish){.type = RS_FINISH_LENGTH, .length = 2}, 0.25);
    for (int i = 0; i < 4; i++) j->outputs[i].prompt_tokens = j->prompt_lens[i / 2];
    size_t len;
    char *body = rs_generate_response(&r, &len);
    /* no logprob keys without return_logprob */
    expect_json(body, len,
                "[{\"output_ids\": [7, 8], \"meta_info\": {\"id\": \"g_0_0\", \"finish_reason\": {\"type\": \"length\","
                "   \"length\": 2}, \"prompt_tokens\": 2, \"completion_tokens\": 2, \"cached_tokens\": 0,"
                "   \"weight_version\": \"3\", \"num_retractions\": 0, \"e2e_latency\": 0.25}},"
                " {\"output_ids\": [7], \"meta_info\": {\"id\": \"g_0_1\", \"finish_reason\": {\"type\": \"stop\","
                "   \"matched\": 7}, \"prompt_tokens\": 2, \"completion_tokens\": 1, \"cached_tokens\": 0,"
                "   \"weight_version\": \"3\", \"num_retractions\": 0, \"e2e_latency\": 0.25}},"
                " {\"output_ids\": [], \"meta_info\": {\"id\": \"g_1_0\", \"finish_reason\": {\"type\": \"abort\","
                "   \"message\": \"server shutting down\"}, \"prompt_tokens\": 1, \"completion_tokens\": 0,"
                "   \"cached_tokens\": 0, \"weight_version\": \"3\", \"num_retractions\": 0, \"e2e_latency\": 0.25}},"
                " {\"output_ids\": [7, 8], \"meta_info\": {\"id\": \"g_1_1\", \"finish_reason\": {\"type\": \"length\","
                "   \"length\": 2}, \"prompt_tokens\": 1, \"completion_tokens\": 2, \"cached_tokens\": 0,"
                "   \"weight_version\": \"3\", \"num_retractions\": 0, \"e2e_latency\": 0.25}}]");
    free(body);
    rs_generate_req_free(&r);
}

RS_TEST(protocol_response_ids) {
    char id[200];
    rs_generate_req r = parse_ok("{\"rid\": [\"p\", \"q\"], \"input_ids\": [[1], [2]]}");
    rs_generate_output_id(&r, 1, 0, id, sizeof id);
    ASSERT_STREQ(id, "q");
    rs_generate_req_free(&r);
    r = parse_ok("{\"rid\": \"x\", \"input_ids\": [1], \"sampling_params\": {\"n\": 3}}");
    rs_generate_output_id(&r, 0, 2, id, sizeof id);
    ASSERT_STREQ(id, "x_2");
    rs_generate_req_free(&r);
    r = parse_ok("{\"rid\": \"x\", \"input_ids\": [[1], [2]]}");
    rs_generate_output_id(&r, 1, 0, id, sizeof id);
    ASSERT_STREQ(id, "x_1");
    rs_generate_req_free(&r);
}

RS_TEST(protocol_response_nonfinite_logprob_is_null) {
    rs_generate_req r = parse_ok("{\"input_ids\": [1], \"return_logprob\": true}");
    rs_gen_job *j = r.job;
    snprintf(r.rid, sizeof r.rid, "req-1");
    j->outputs = calloc(1, sizeof(rs_gen_output));
    int32_t ids[] = {4};
    float lps[] = {-INFINITY};
    finish_output(j, 0, ids, lps, 1, (rs_finish){.type = RS_FINISH_LENGTH, .length = 1}, 0);
    size_t len;
    char *body = rs_generate_response(&r, &len);
    json_t *v = json_loadb(body, len, 0, NULL);
    ASSERT_TRUE(v != NULL);
    json_t *meta = json_object_get(v, "meta_info");
    ASSERT_TRUE(json_is_null(json_array_get(json_array_get(json_object_get(meta, "output_token_logprobs"), 0), 0)));
    ASSERT_EQ(json_array_size(json_object_get(meta, "input_token_logprobs")), 0); /* logprob_start_len -1 */
    ASSERT_STREQ(json_string_value(json_object_get(meta, "id")), "req-1");
    json_decref(v);
    free(body);
    rs_generate_req_free(&r);
}

RS_TEST(protocol_error_body_shape) {
    rs_error err;
    rs_error_set(&err, RS_EINVAL, "sampling_params.temperature", "sampling_params.temperature must be >= 0, got %d", -1);
    size_t len;
    char *b = rs_error_body(&err, &len);
    expect_json(b, len,
                "{\"error\": {\"message\": \"sampling_params.temperature must be >= 0, got -1\","
                " \"type\": \"invalid_request\", \"param\": \"sampling_params.temperature\", \"code\": 400}}");
    free(b);
    rs_error_set(&err, RS_EBUSY, NULL, "server is shutting down");
    b = rs_error_body(&err, &len);
    expect_json(b, len, "{\"error\": {\"message\": \"server is shutting down\", \"type\": \"unavailable\", \"param\": null, \"code\": 503}}");
    free(b);
    b = rs_health_body(&len);
    expect_json(b, len, "{\"status\": \"ok\"}");
    free(b);
}
