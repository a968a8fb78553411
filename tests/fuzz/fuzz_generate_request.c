/*
 * fuzz_generate_request.c — libFuzzer target for the /generate request parser (untrusted bytes
 * straight from the network) and, for every request it accepts, the response writer.
 *
 *   make fuzz                          every target, bounded run
 *   build-fuzz/fuzz_generate_request -max_total_time=60 corpus tests/fuzz/seeds/fuzz_generate_request
 *
 * Properties checked beyond "no crash, no leak, no UB" (ASan + UBSan): a rejected request names a
 * known error code and leaves nothing allocated; an accepted one has sane fields, and its
 * response, built from fake engine output of the right shape, is valid JSON with one entry per
 * sequence, and so is every event of its stream, which ends with [DONE].
 */
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../protocol/errors.h"
#include "../../protocol/generate.h"

static void check(int cond) {
    if (!cond) abort();
}

/* Fills outputs the way the engine would, with a few tokens each (bounded: the job may ask for
 * many prompts x n). */
static void fake_outputs(rs_gen_job *job) {
    size_t n = (size_t)job->n_prompts * (size_t)job->sp.n;
    job->outputs = calloc(n, sizeof(rs_gen_output));
    for (size_t i = 0; i < n; i++) {
        rs_gen_output *o = &job->outputs[i];
        int p = (int)(i / (size_t)job->sp.n);
        o->n_output = o->cap = (int)(i % 3);
        o->output_ids = malloc(sizeof(int32_t) * 3);
        o->output_logprobs = malloc(sizeof(float) * 3);
        for (int k = 0; k < 3; k++) {
            o->output_ids[k] = (int32_t)(k * 7 + 1);
            o->output_logprobs[k] = k == 2 ? -INFINITY : -0.5f * (float)k;
        }
        int k = job->top_logprobs_num < 64 ? job->top_logprobs_num : 64; /* the server caps it at validation */
        job->top_logprobs_num = k;
        if (k > 0) { /* alternatives, -1 where fewer exist */
            o->output_top_ids = malloc(sizeof(int32_t) * 3 * (size_t)k);
            o->output_top_lps = malloc(sizeof(float) * 3 * (size_t)k);
            for (int t = 0; t < 3 * k; t++) {
                o->output_top_ids[t] = t % 2 ? -1 : t;
                o->output_top_lps[t] = -1.0f;
            }
        }
        o->prompt_tokens = job->prompt_lens[p];
        if (job->logprob_start_len >= 0 && job->logprob_start_len < job->prompt_lens[p]) {
            o->n_input_logprobs = job->prompt_lens[p] - job->logprob_start_len;
            o->input_logprobs = malloc(sizeof(float) * (size_t)o->n_input_logprobs);
            for (int t = 0; t < o->n_input_logprobs; t++) o->input_logprobs[t] = t == 0 ? NAN : -1.0f;
            if (k > 0) {
                o->input_top_ids = malloc(sizeof(int32_t) * (size_t)o->n_input_logprobs * (size_t)k);
                o->input_top_lps = malloc(sizeof(float) * (size_t)o->n_input_logprobs * (size_t)k);
                for (size_t t = 0; t < (size_t)o->n_input_logprobs * (size_t)k; t++) {
                    o->input_top_ids[t] = t < (size_t)k ? -1 : (int32_t)t; /* position 0: none */
                    o->input_top_lps[t] = -2.0f;
                }
            }
        }
        o->finish.type = (rs_finish_type)(1 + i % 3);
        o->finish.matched = 1;
        o->finish.length = o->n_output;
        strcpy(o->finish.message, "aborted");
    }
    strcpy(job->weight_version, "7");
}

/* The embedded default model's tokenizer, loaded once: text prompts and stop strings are parsed
 * and encoded for real, and the fake outputs are fed through the job's text hook. */
static const rs_tok *fuzz_tokenizer(void) {
    static rs_tok *tok;
    if (!tok) {
        size_t n;
        const char *json = rs_tok_default_json(&n);
        rs_error e = {0};
        if (rs_tok_load_json(json, n, "default", &tok, &e) != RS_OK) abort();
    }
    return tok;
}

/* What the engine does with each sampled token: the hook sees it unless the output stopped. */
static void feed_hook(rs_gen_job *job) {
    for (int i = 0; job->on_token && i < job->n_prompts * job->sp.n; i++) {
        rs_gen_output *o = &job->outputs[i];
        int n = o->n_output;
        for (int t = 0; t < n; t++) {
            o->n_output = t + 1;
            int k = job->on_token(job, i, o->output_ids[t], job->on_token_user);
            if (k >= 0) {
                o->finish.type = RS_FINISH_STOP;
                o->finish.matched = -1;
                o->finish.matched_text = k + 1;
                break;
            }
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    rs_generate_req req;
    rs_error err = {0};
    int rc = rs_generate_parse((const char *)data, size, fuzz_tokenizer(), &req, &err);
    if (rc != RS_OK) {
        check(rc == RS_EINVAL || rc == RS_EUNSUPPORTED || rc == RS_ENOMEM);
        check(req.job == NULL && req.prompt_rids == NULL);
        size_t len;
        char *body = rs_error_body(&err, &len); /* must be valid JSON whatever the message quotes */
        json_t *v = json_loadb(body, len, 0, NULL);
        check(v != NULL);
        json_decref(v);
        free(body);
        return 0;
    }
    rs_gen_job *job = req.job;
    check(job->n_prompts >= 1 && job->sp.n >= 1);
    check(job->batched || job->n_prompts == 1);
    for (int p = 0; p < job->n_prompts; p++) {
        check(job->prompt_lens[p] >= 1);
        for (int i = 0; i < job->prompt_lens[p]; i++) check(job->prompts[p][i] >= 0);
    }
    check(job->sp.temperature >= 0 && job->sp.top_p > 0 && job->sp.top_p <= 1);
    check(job->sp.top_k == -1 || job->sp.top_k >= 1);
    check(job->logprob_start_len >= -1);
    check(strlen(job->rid) <= RS_RID_MAX);

    if ((size_t)job->n_prompts * (size_t)job->sp.n <= 4096) { /* the server caps this before serializing */
        fake_outputs(job);
        feed_hook(job);
        /* streamed: every output's closing event, then [DONE], each event valid JSON */
        rs_buf ev = {0};
        check(rs_generate_stream_events(&req, true, &ev) == RS_OK);
        check(ev.len >= 14 && strcmp(ev.data + ev.len - 14, "data: [DONE]\n\n") == 0);
        for (const char *p = ev.data; p < ev.data + ev.len - 14;) {
            const char *e = strstr(p, "\n\n");
            check(e != NULL && strncmp(p, "data: ", 6) == 0);
            json_t *one = json_loadb(p + 6, (size_t)(e - p - 6), 0, NULL);
            check(one != NULL);
            json_decref(one);
            p = e + 2;
        }
        rs_buf_free(&ev);
        check(rs_generate_matches_rid(&req, req.rid) || !req.rid[0]);
        size_t len;
        char *body = rs_generate_response(&req, &len);
        check(body != NULL);
        json_t *v = json_loadb(body, len, 0, NULL);
        check(v != NULL);
        bool list = job->batched || job->sp.n > 1;
        check(list ? json_array_size(v) == (size_t)job->n_prompts * (size_t)job->sp.n : json_is_object(v));
        json_decref(v);
        free(body);
    }
    rs_generate_req_free(&req);
    return 0;
}
