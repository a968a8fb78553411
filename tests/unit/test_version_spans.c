/*
 * test_version_spans.c — which weight version a response attributes its numbers to, when the
 * request crosses updates placed exactly between engine steps (rs_engine_step_once):
 *   - a prompt whose scoring (chunked prefill) an update interrupts is scored again, all of it,
 *     with the new weights: equal to an engine that only ever had them;
 *   - each output of a batched request reports the version of its own last token, not the job's;
 *   - spans: a relabel back to the version before merges into that span (A, B, A), and an update
 *     after the last token leaves no empty span behind.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../model/presets.h"
#include "../../model/quant.h"
#include "../../model/safetensors.h"
#include "../../protocol/generate.h"
#include "../../scheduler/engine.h"
#include "../../sync/transaction.h"
#include "test.h"

static void two_models(char *a, char *b, size_t cap) {
    rs_model_config c;
    ASSERT_EQ(rs_model_preset("default", &c), RS_OK);
    c.vocab_size = 200;
    c.hidden = 64;
    c.intermediate = 96;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 16;
    c.max_position = 256;
    snprintf(a, cap, "%s/va", rs_test_tmpdir());
    snprintf(b, cap, "%s/vb", rs_test_tmpdir());
    rs_error err = {0};
    ASSERT_EQ(rs_testmodel_write(a, &c, 1, &err), RS_OK);
    ASSERT_EQ(rs_testmodel_write(b, &c, 2, &err), RS_OK);
}

static rs_model *load_bf16(const char *dir, rs_backend *b) {
    rs_quant_policy qp;
    rs_error err = {0};
    ASSERT_EQ(rs_quant_policy_init(&qp, "bf16", "", 0, 0, &err), RS_OK);
    rs_model *m = NULL;
    if (rs_model_load(dir, b, &qp, &m, &err) != RS_OK) RS_TEST_FAIL("load %s: %s", dir, err.message);
    return m;
}

/* max_step_tokens 24: a 64-token prompt takes several steps to prefill */
static rs_engine *engine(rs_model *m) {
    rs_engine_opts o = {.kv_cache_bytes = 4 << 20, .max_running = 4, .max_step_tokens = 24,
                        .limits = {.max_context = 256, .max_new_tokens = 16, .max_n = 1, .max_batch = 4}};
    rs_engine *e = NULL;
    rs_error err = {0};
    if (rs_engine_init(&e, m, &o, &err) != RS_OK) RS_TEST_FAIL("engine: %s", err.message);
    return e;
}

/* An update to the weights in dir, staged and ready to commit. */
static rs_txn *staged(rs_model *m, const char *dir, const char *version) {
    rs_txn *u = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_txn_begin(&u, m, version, 0, &err), RS_OK);
    rs_st_dir *d = NULL;
    ASSERT_EQ(rs_st_dir_open(&d, dir, &err), RS_OK);
    for (size_t i = 0; i < rs_st_dir_count(d); i++) {
        const rs_st_tensor *t = rs_st_dir_tensor_at(d, i, NULL);
        rs_txn_tensor ut = {.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .shape = t->shape,
                               .data = t->data};
        if (rs_txn_add(u, &ut, &err) != RS_OK) RS_TEST_FAIL("add %s: %s", t->name, err.message);
    }
    rs_st_dir_close(d);
    return u;
}

static rs_generate_req parse(const char *body) {
    rs_generate_req r;
    rs_error err = {0};
    if (rs_generate_parse(body, strlen(body), NULL, &r, &err) != RS_OK) RS_TEST_FAIL("parse: %s", err.message);
    return r;
}

#define PROMPT64                                                                                                      \
    "[5, 42, 79, 116, 153, 190, 27, 64, 101, 138, 175, 12, 49, 86, 123, 160, 197, 34, 71, 108, 145, 182, 19, 56,"   \
    " 93, 130, 167, 4, 41, 78, 115, 152, 189, 26, 63, 100, 137, 174, 11, 48, 85, 122, 159, 196, 33, 70, 107, 144,"   \
    " 181, 18, 55, 92, 129, 166, 3, 40, 77, 114, 151, 188, 25, 62, 99, 136]"

static const char *score_body = "{\"rid\": \"b\", \"input_ids\": " PROMPT64 ", \"return_logprob\": true,"
                                " \"logprob_start_len\": 0, \"sampling_params\": {\"max_new_tokens\": 1,"
                                " \"temperature\": 0, \"ignore_eos\": true}}";

/* One request scored across an update: `ref` on an engine that only ever had B's weights; `r` on
 * A's, where one step runs (its rows scored with A), then B commits and the rest runs. */
typedef struct across {
    rs_model *m, *mref;
    rs_engine *e, *eref;
    rs_generate_req r, ref;
} across;

/* Runs body across the update; `scored`: a prompt position the first step must have scored. */
static void across_run(across *x, rs_backend *b, const char *a, const char *bdir, const char *body, int scored) {
    rs_error err = {0};
    x->mref = load_bf16(bdir, b);
    x->eref = engine(x->mref);
    x->ref = parse(body);
    ASSERT_EQ(rs_engine_submit(x->eref, x->ref.job, &err), RS_OK);
    rs_engine_run_until_idle(x->eref);

    x->m = load_bf16(a, b);
    x->e = engine(x->m);
    x->r = parse(body);
    ASSERT_EQ(rs_engine_submit(x->e, x->r.job, &err), RS_OK);
    ASSERT_TRUE(rs_engine_step_once(x->e)); /* 24 rows scored with the old weights */
    const rs_gen_output *o = &x->r.job->outputs[0];
    ASSERT_EQ(o->n_output, 0);
    ASSERT_TRUE(!isnan(o->input_logprobs[scored]));
    ASSERT_EQ(rs_txn_commit(staged(x->m, bdir, "v1"), x->e, false, NULL, &err), RS_OK);
    rs_engine_run_until_idle(x->e);
}

static void across_free(across *x) {
    rs_generate_req_free(&x->r);
    rs_generate_req_free(&x->ref);
    rs_engine_free(x->e);
    rs_engine_free(x->eref);
    rs_model_free(x->m);
    rs_model_free(x->mref);
}

RS_TEST(update_mid_prompt_scoring_rescores_whole_prompt) {
    char a[512], bdir[512];
    two_models(a, bdir, sizeof a);
    rs_backend *b = rs_backend_cpu_init(1);
    across x;
    across_run(&x, b, a, bdir, score_body, 5);

    const rs_gen_output *o = &x.r.job->outputs[0], *w = &x.ref.job->outputs[0];
    ASSERT_EQ(o->n_input_logprobs, 64);
    for (int i = 1; i < 64; i++)
        if (!(o->input_logprobs[i] == w->input_logprobs[i]))
            RS_TEST_FAIL("prompt position %d scored %.9g, the new weights give %.9g", i, (double)o->input_logprobs[i],
                         (double)w->input_logprobs[i]);
    ASSERT_TRUE(o->output_logprobs[0] == w->output_logprobs[0]);
    ASSERT_EQ(o->n_spans, 1);
    ASSERT_STREQ(o->spans[0].version, "v1");
    across_free(&x);
    rs_backend_free(b);
}

/* The same when the update lands after the prompt is scored in full but before the output's first
 * token: the first prefill step (24 rows) scores all 24 scored tokens of a 25-token prompt, the
 * update commits, and the last row (and the token) come from the new weights. The output reports
 * only the new version, so its prompt scores must be the new weights' too; also for a scoring
 * request (max_new_tokens 0), which has no token at all. */
RS_TEST(update_after_prompt_scored_before_first_token_rescores) {
    char a[512], bdir[512];
    two_models(a, bdir, sizeof a);
    rs_backend *b = rs_backend_cpu_init(1);
    for (int mnt = 0; mnt <= 1; mnt++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"input_ids\": [5, 42, 79, 116, 153, 190, 27, 64, 101, 138, 175, 12, 49, 86, 123, 160, 197, 34, "
                 "71, 108, 145, 182, 19, 56, 93], \"return_logprob\": true, \"logprob_start_len\": 0, "
                 "\"sampling_params\": {\"max_new_tokens\": %d, \"temperature\": 0, \"ignore_eos\": true}}", mnt);
        across x;
        across_run(&x, b, a, bdir, body, 24); /* rows 0..23: every scored token */

        const rs_gen_output *o = &x.r.job->outputs[0], *w = &x.ref.job->outputs[0];
        ASSERT_EQ(o->n_input_logprobs, 25);
        ASSERT_EQ(o->n_spans, 1);
        ASSERT_STREQ(o->spans[0].version, "v1");
        for (int i = 1; i < 25; i++)
            if (!(o->input_logprobs[i] == w->input_logprobs[i]))
                RS_TEST_FAIL("max_new_tokens %d: prompt position %d scored %.9g, reported as v1, whose weights give "
                             "%.9g", mnt, i, (double)o->input_logprobs[i], (double)w->input_logprobs[i]);
        ASSERT_EQ(o->n_output, mnt);
        if (mnt) ASSERT_TRUE(o->output_logprobs[0] == w->output_logprobs[0]);
        across_free(&x);
    }
    rs_backend_free(b);
}

/* Model A served by an engine (step by step), B's directory ready to be pushed. */
typedef struct served {
    char a[512], bdir[512];
    rs_backend *b;
    rs_model *m;
    rs_engine *e;
} served;

static void serve_a(served *v) {
    two_models(v->a, v->bdir, sizeof v->a);
    v->b = rs_backend_cpu_init(1);
    v->m = load_bf16(v->a, v->b);
    v->e = engine(v->m);
}

static void served_close(served *v) {
    rs_engine_free(v->e);
    rs_model_free(v->m);
    rs_backend_free(v->b);
}

RS_TEST(update_version_reported_per_output) {
    served v;
    serve_a(&v);
    rs_engine *e = v.e;
    rs_model *m = v.m;
    const char *bdir = v.bdir;
    rs_error err = {0};
    rs_generate_req r = parse("{\"rid\": \"j\", \"input_ids\": [[1, 2, 3, 4, 5, 6, 7, 8], " PROMPT64 "],"
                              " \"return_logprob\": true, \"sampling_params\": {\"max_new_tokens\": 2,"
                              " \"temperature\": 0, \"ignore_eos\": true}}");
    ASSERT_EQ(rs_engine_submit(e, r.job, &err), RS_OK);
    while (r.job->outputs == NULL || r.job->outputs[0].finish.type == RS_FINISH_NONE)
        ASSERT_TRUE(rs_engine_step_once(e));
    ASSERT_EQ(r.job->outputs[1].finish.type, RS_FINISH_NONE); /* still prefilling its 64 tokens */
    ASSERT_EQ(rs_txn_commit(staged(m, bdir, "v1"), e, false, NULL, &err), RS_OK);
    rs_engine_run_until_idle(e);

    size_t len = 0;
    char *body = rs_generate_response(&r, &len);
    json_error_t je;
    json_t *resp = json_loadb(body, len, 0, &je);
    ASSERT_TRUE(json_is_array(resp) && json_array_size(resp) == 2);
    const char *want[2] = {"0", "v1"};
    for (size_t i = 0; i < 2; i++) {
        json_t *meta = json_object_get(json_array_get(resp, i), "meta_info");
        const char *got = json_string_value(json_object_get(meta, "weight_version"));
        if (!got || strcmp(got, want[i]) != 0) RS_TEST_FAIL("output %zu reports version %s, want %s", i, got, want[i]);
        json_t *spans = json_object_get(meta, "weight_version_spans");
        ASSERT_EQ(json_array_size(spans), 1);
        ASSERT_STREQ(json_string_value(json_array_get(json_array_get(spans, 0), 0)), want[i]);
    }
    json_decref(resp);
    free(body);
    rs_generate_req_free(&r);
    served_close(&v);
}

RS_TEST(update_spans_merge_and_drop_empty_tail) {
    served v;
    serve_a(&v);
    rs_engine *e = v.e;
    rs_error err = {0};
    rs_generate_req r = parse("{\"rid\": \"s\", \"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8],"
                              " \"sampling_params\": {\"max_new_tokens\": 6, \"temperature\": 0, \"ignore_eos\": true}}");
    ASSERT_EQ(rs_engine_submit(e, r.job, &err), RS_OK);
    ASSERT_TRUE(rs_engine_step_once(e));
    ASSERT_TRUE(rs_engine_step_once(e));
    const rs_gen_output *o = &r.job->outputs[0];
    ASSERT_EQ(o->n_output, 2);
    /* relabelled and relabelled back before another token: still one span */
    ASSERT_EQ(rs_engine_set_weight_version(e, "x", &err), RS_OK);
    ASSERT_EQ(rs_engine_set_weight_version(e, "0", &err), RS_OK);
    ASSERT_TRUE(rs_engine_step_once(e));
    ASSERT_EQ(o->n_output, 3);
    /* an update after the last token, then the request ends: no span without tokens */
    ASSERT_EQ(rs_engine_set_weight_version(e, "y", &err), RS_OK);
    rs_engine_abort(e, r.job->rid);
    rs_engine_run_until_idle(e);
    ASSERT_EQ(o->finish.type, RS_FINISH_ABORT);
    ASSERT_EQ(o->n_output, 3);
    if (o->n_spans != 1) RS_TEST_FAIL("%d spans, the second [%s, %d, %d]", o->n_spans, o->spans[1].version,
                                      o->spans[1].start, o->spans[1].end);
    ASSERT_STREQ(o->spans[0].version, "0");
    ASSERT_EQ(o->spans[0].start, 0);
    ASSERT_EQ(o->spans[0].end, 3);
    rs_generate_req_free(&r);
    served_close(&v);
}

/* A relabel (/update_weight_version: same weights) in the middle of a prompt's scoring keeps the
 * rows already scored: nothing recomputes them, so none may be cleared. */
RS_TEST(update_relabel_mid_prompt_scoring_keeps_scores) {
    served v;
    serve_a(&v);
    rs_error err = {0};
    rs_engine *eref = engine(v.m);
    rs_generate_req ref = parse(score_body), r = parse(score_body);
    ASSERT_EQ(rs_engine_submit(eref, ref.job, &err), RS_OK);
    rs_engine_run_until_idle(eref);
    ASSERT_EQ(rs_engine_submit(v.e, r.job, &err), RS_OK);
    ASSERT_TRUE(rs_engine_step_once(v.e));
    ASSERT_EQ(rs_engine_set_weight_version(v.e, "relabelled", &err), RS_OK);
    rs_engine_run_until_idle(v.e);
    const rs_gen_output *o = &r.job->outputs[0], *w = &ref.job->outputs[0];
    for (int i = 1; i < o->n_input_logprobs; i++)
        if (!(o->input_logprobs[i] == w->input_logprobs[i]))
            RS_TEST_FAIL("prompt position %d: %.9g, want %.9g", i, (double)o->input_logprobs[i],
                         (double)w->input_logprobs[i]);
    ASSERT_EQ(o->n_spans, 1);
    ASSERT_STREQ(o->spans[0].version, "relabelled");
    rs_generate_req_free(&r);
    rs_generate_req_free(&ref);
    rs_engine_free(eref);
    served_close(&v);
}
