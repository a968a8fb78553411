/*
 * test_protocol_stream.c — SSE framing and /generate streaming events (protocol/generate.c,
 * protocol/sse.c): cumulative and incremental events, per-output indices, the closing event of
 * each output, [DONE], and the abort-matching of client rids.
 */
#include <jansson.h>
#include <math.h>
#include <string.h>

#include "../../protocol/generate.h"
#include "../../protocol/sse.h"
#include "test.h"

/* Splits `data: ...\n\n` events; returns their count and the parsed JSON of each (NULL for [DONE]). */
static int split_events(const rs_buf *b, json_t **ev, int max, int *n_done) {
    int n = 0;
    *n_done = 0;
    const char *p = b->data, *end = b->data + b->len;
    while (p < end) {
        if (strncmp(p, "data: ", 6) != 0) RS_TEST_FAIL("event does not start with 'data: ': %.40s", p);
        const char *e = strstr(p, "\n\n");
        if (!e) RS_TEST_FAIL("event without its blank line: %.40s", p);
        p += 6;
        if (e - p == 6 && strncmp(p, "[DONE]", 6) == 0) {
            (*n_done)++;
            ASSERT_TRUE(e + 2 == end); /* [DONE] is last */
        } else {
            json_error_t je;
            json_t *v = json_loadb(p, (size_t)(e - p), 0, &je);
            if (!v) RS_TEST_FAIL("event is not JSON (%s): %.*s", je.text, (int)(e - p), p);
            if (n >= max) RS_TEST_FAIL("too many events");
            ev[n++] = v;
        }
        p = e + 2;
    }
    return n;
}

static rs_generate_req parse_ok(const char *body) {
    rs_generate_req r;
    rs_error err = {0};
    if (rs_generate_parse(body, strlen(body), NULL, &r, &err) != RS_OK) RS_TEST_FAIL("parse: %s", err.message);
    return r;
}

/* Outputs with room for `cap` tokens, nothing generated yet. */
static void alloc_outputs(rs_gen_job *j, int cap) {
    int n = j->n_prompts * j->sp.n;
    j->outputs = calloc((size_t)n, sizeof(rs_gen_output));
    for (int i = 0; i < n; i++) {
        j->outputs[i].output_ids = calloc((size_t)cap, sizeof(int32_t));
        j->outputs[i].output_logprobs = calloc((size_t)cap, sizeof(float));
        j->outputs[i].cap = cap;
        j->outputs[i].prompt_tokens = j->prompt_lens[i / j->sp.n];
    }
    snprintf(j->weight_version, sizeof j->weight_version, "5");
}

static void push(rs_gen_output *o, int32_t id, float lp) {
    o->output_ids[o->n_output] = id;
    o->output_logprobs[o->n_output] = lp;
    o->n_output++;
}

static void free_events(json_t **ev, int n) {
    for (int i = 0; i < n; i++) json_decref(ev[i]);
}

RS_TEST(protocol_sse_framing) {
    rs_buf b = {0};
    ASSERT_EQ(rs_sse_done(&b), RS_OK);
    ASSERT_STREQ(b.data, "data: [DONE]\n\n");
    ASSERT_EQ(rs_buf_append(&b, "abc", 3), RS_OK);
    rs_buf_consume(&b, 14);
    ASSERT_STREQ(b.data, "abc");
    ASSERT_EQ(b.len, 3);
    rs_buf_consume(&b, 3);
    ASSERT_EQ(b.len, 0);
    rs_buf_free(&b);
    ASSERT_TRUE(b.data == NULL && b.cap == 0);
}

RS_TEST(protocol_stream_cumulative_single) {
    rs_generate_req r = parse_ok("{\"rid\": \"s\", \"input_ids\": [1, 2], \"return_logprob\": true, \"stream\": true}");
    ASSERT_TRUE(r.stream);
    ASSERT_TRUE(r.job->stream);
    alloc_outputs(r.job, 8);
    rs_gen_output *o = &r.job->outputs[0];
    rs_buf b = {0};
    ASSERT_EQ(rs_generate_stream_events(&r, false, &b), RS_OK);
    ASSERT_EQ(b.len, 0); /* nothing new: no event */
    push(o, 10, -0.5f);
    ASSERT_EQ(rs_generate_stream_events(&r, false, &b), RS_OK);
    push(o, 11, -0.25f);
    ASSERT_EQ(rs_generate_stream_events(&r, false, &b), RS_OK);
    ASSERT_EQ(rs_generate_stream_events(&r, false, &b), RS_OK); /* again nothing new */
    o->finish = (rs_finish){.type = RS_FINISH_LENGTH, .length = 2};
    o->e2e_latency = 0.5;
    ASSERT_EQ(rs_generate_stream_events(&r, true, &b), RS_OK);
    json_t *ev[8];
    int n_done, n = split_events(&b, ev, 8, &n_done);
    ASSERT_EQ(n, 3);
    ASSERT_EQ(n_done, 1);
    /* cumulative: every event has all tokens so far; finish_reason null until the last */
    ASSERT_EQ(json_array_size(json_object_get(ev[0], "output_ids")), 1);
    ASSERT_EQ(json_array_size(json_object_get(ev[1], "output_ids")), 2);
    ASSERT_EQ(json_array_size(json_object_get(ev[2], "output_ids")), 2);
    for (int i = 0; i < 2; i++) {
        json_t *m = json_object_get(ev[i], "meta_info");
        ASSERT_TRUE(json_is_null(json_object_get(m, "finish_reason")));
        ASSERT_TRUE(json_object_get(m, "e2e_latency") == NULL);
        ASSERT_TRUE(json_object_get(ev[i], "index") == NULL); /* one output: no index, as SGLang */
        ASSERT_STREQ(json_string_value(json_object_get(m, "id")), "s");
    }
    json_t *m = json_object_get(ev[2], "meta_info");
    ASSERT_STREQ(json_string_value(json_object_get(json_object_get(m, "finish_reason"), "type")), "length");
    ASSERT_EQ(json_array_size(json_object_get(m, "output_token_logprobs")), 2);
    ASSERT_NEAR(json_real_value(json_object_get(m, "e2e_latency")), 0.5, 0);
    ASSERT_EQ(json_integer_value(json_object_get(m, "completion_tokens")), 2);
    free_events(ev, n);
    rs_buf_free(&b);
    rs_generate_req_free(&r);
}

RS_TEST(protocol_stream_incremental_batched_n) {
    rs_generate_req r = parse_ok("{\"rid\": \"g\", \"input_ids\": [[1], [2, 3]], \"return_logprob\": true,"
                                 " \"logprob_start_len\": 0, \"sampling_params\": {\"n\": 2}, \"stream\": true}");
    r.incremental = true;
    alloc_outputs(r.job, 8);
    for (int i = 0; i < 4; i++) { /* prompt scores, as the engine fills them */
        rs_gen_output *o = &r.job->outputs[i];
        o->n_input_logprobs = r.job->prompt_lens[i / 2];
        o->input_logprobs = calloc((size_t)o->n_input_logprobs, sizeof(float));
        o->input_logprobs[0] = NAN;
    }
    rs_buf b = {0};
    push(&r.job->outputs[1], 5, -1);
    push(&r.job->outputs[3], 6, -1);
    ASSERT_EQ(rs_generate_stream_events(&r, false, &b), RS_OK);
    push(&r.job->outputs[1], 7, -1);
    r.job->outputs[3].finish = (rs_finish){.type = RS_FINISH_STOP, .matched = 6};
    ASSERT_EQ(rs_generate_stream_events(&r, false, &b), RS_OK);
    r.job->outputs[0].finish = (rs_finish){.type = RS_FINISH_ABORT, .message = "aborted"};
    r.job->outputs[1].finish = (rs_finish){.type = RS_FINISH_LENGTH, .length = 2};
    r.job->outputs[2].finish = (rs_finish){.type = RS_FINISH_ABORT, .message = "aborted"};
    ASSERT_EQ(rs_generate_stream_events(&r, true, &b), RS_OK);
    json_t *ev[16];
    int n_done, n = split_events(&b, ev, 16, &n_done);
    ASSERT_EQ(n_done, 1);
    /* step 1: outputs 1 and 3; step 2: 1 (new token) and 3 (its finish); final: 0, 1 (finish), 2 */
    int want_index[] = {1, 3, 1, 3, 0, 1, 2};
    int want_ids[] = {1, 1, 1, 0, 0, 0, 0};
    ASSERT_EQ(n, 7);
    for (int i = 0; i < n; i++) {
        ASSERT_EQ(json_integer_value(json_object_get(ev[i], "index")), want_index[i]);
        ASSERT_EQ(json_array_size(json_object_get(ev[i], "output_ids")), want_ids[i]);
        json_t *m = json_object_get(ev[i], "meta_info");
        /* the prompt's scores in every event, whole, as SGLang streams them */
        ASSERT_EQ(json_array_size(json_object_get(m, "input_token_logprobs")),
                  (size_t)r.job->prompt_lens[want_index[i] / 2]);
        ASSERT_EQ(json_array_size(json_object_get(m, "output_token_logprobs")), want_ids[i]);
    }
    ASSERT_EQ(json_integer_value(json_array_get(json_object_get(ev[2], "output_ids"), 0)), 7);
    ASSERT_STREQ(json_string_value(json_object_get(json_object_get(ev[2], "meta_info"), "id")), "g_0_1");
    ASSERT_STREQ(json_string_value(json_object_get(json_object_get(json_object_get(ev[3], "meta_info"),
                                                                   "finish_reason"), "type")), "stop");
    free_events(ev, n);
    rs_buf_free(&b);
    rs_generate_req_free(&r);
}

RS_TEST(protocol_matches_rid) {
    rs_generate_req r = parse_ok("{\"rid\": \"grp\", \"input_ids\": [[1], [2]], \"sampling_params\": {\"n\": 2}}");
    ASSERT_TRUE(rs_generate_matches_rid(&r, "grp"));
    ASSERT_TRUE(rs_generate_matches_rid(&r, "grp_1_0"));
    ASSERT_TRUE(!rs_generate_matches_rid(&r, "grp_2_0"));
    ASSERT_TRUE(!rs_generate_matches_rid(&r, "gr"));
    rs_generate_req_free(&r);
    r = parse_ok("{\"rid\": [\"a\", \"b\"], \"input_ids\": [[1], [2]]}");
    ASSERT_TRUE(rs_generate_matches_rid(&r, "b"));
    ASSERT_TRUE(!rs_generate_matches_rid(&r, "c"));
    rs_generate_req_free(&r);
}

RS_TEST(protocol_weight_version_spans) {
    rs_generate_req r = parse_ok("{\"rid\": \"v\", \"input_ids\": [1]}");
    alloc_outputs(r.job, 8);
    rs_gen_output *o = &r.job->outputs[0];
    for (int i = 0; i < 5; i++) push(o, 10 + i, -1);
    o->spans = calloc(2, sizeof *o->spans);
    o->n_spans = 2;
    snprintf(o->spans[0].version, sizeof o->spans[0].version, "17");
    o->spans[0].start = 0;
    o->spans[0].end = 3;
    snprintf(o->spans[1].version, sizeof o->spans[1].version, "18");
    o->spans[1].start = 3;
    o->spans[1].end = 3; /* the engine closes the last span at finish; the writer uses n_output */
    o->finish = (rs_finish){.type = RS_FINISH_LENGTH, .length = 5};
    size_t len;
    char *body = rs_generate_response(&r, &len);
    json_t *v = json_loadb(body, len, 0, NULL);
    json_t *want = json_loads("[[\"17\", 0, 3], [\"18\", 3, 5]]", 0, NULL);
    ASSERT_TRUE(json_equal(json_object_get(json_object_get(v, "meta_info"), "weight_version_spans"), want));
    json_decref(want);
    json_decref(v);
    free(body);
    rs_generate_req_free(&r);
}
