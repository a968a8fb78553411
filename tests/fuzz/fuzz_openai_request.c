/*
 * fuzz_openai_request.c — libFuzzer target for the /v1/completions parser (untrusted bytes from
 * the network) and, for every request it accepts, the answer and the streamed chunks.
 *
 *   make fuzz                          every target, bounded run
 *   build-fuzz/fuzz_openai_request -max_total_time=60 corpus tests/fuzz/seeds/fuzz_openai_request
 *
 * Properties beyond "no crash, no leak, no UB" (ASan + UBSan): a rejected request names a known
 * code, leaves nothing allocated and has a valid JSON error body; an accepted one has sane fields;
 * its validation errors, renamed to this API's fields, still make valid bodies; its answer (built
 * from fake engine output of the right shape) is valid JSON with one choice per sequence; its
 * stream is a sequence of `data: <json>` events ending with [DONE].
 */
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../protocol/errors.h"
#include "../../protocol/openai.h"

static void check(int cond) {
    if (!cond) abort();
}

static void check_error_body(const rs_error *err) {
    size_t len;
    char *body = rs_error_body(err, &len);
    json_t *v = json_loadb(body, len, 0, NULL);
    check(v != NULL);
    json_decref(v);
    free(body);
}

/* Outputs as the engine fills them: `step` tokens so far, finished when final. */
static void fake_outputs(rs_gen_job *job, int step, bool final) {
    size_t n = (size_t)job->n_prompts * (size_t)job->sp.n;
    int k = job->top_logprobs_num;
    if (!job->outputs) {
        job->outputs = calloc(n, sizeof(rs_gen_output));
        for (size_t i = 0; i < n; i++) {
            rs_gen_output *o = &job->outputs[i];
            int p = (int)(i / (size_t)job->sp.n), plen = job->prompt_lens[p];
            o->output_ids = calloc(3, sizeof(int32_t));
            o->output_logprobs = calloc(3, sizeof(float));
            if (k > 0) {
                o->output_top_ids = calloc((size_t)(3 * k), sizeof(int32_t));
                o->output_top_lps = calloc((size_t)(3 * k), sizeof(float));
                for (int t = 0; t < 3 * k; t++) o->output_top_ids[t] = t % 3 == 2 ? -1 : t;
            }
            o->cap = 3;
            if (job->logprob_start_len == 0) {
                o->n_input_logprobs = plen;
                o->input_logprobs = calloc((size_t)plen, sizeof(float));
                o->input_logprobs[0] = NAN;
                if (k > 0) {
                    o->input_top_ids = calloc((size_t)plen * (size_t)k, sizeof(int32_t));
                    o->input_top_lps = calloc((size_t)plen * (size_t)k, sizeof(float));
                    for (int t = 0; t < k; t++) o->input_top_ids[t] = -1;
                }
            }
            o->prompt_tokens = plen;
        }
    }
    for (size_t i = 0; i < n; i++) {
        rs_gen_output *o = &job->outputs[i];
        int want = (int)(i % 3) < step ? (int)(i % 3) + 1 : step;
        while (o->n_output < want && o->n_output < 3 && o->finish.type == RS_FINISH_NONE) {
            o->output_ids[o->n_output] = (int32_t)(o->n_output * 5 + 1);
            o->output_logprobs[o->n_output] = o->n_output == 2 ? -INFINITY : -0.5f;
            o->n_output++;
            int stop = job->on_token ? job->on_token(job, (int)i, o->output_ids[o->n_output - 1], job->on_token_user)
                                     : -1;
            if (stop >= 0) /* a stop string: the engine finishes it on this token */
                o->finish = (rs_finish){.type = RS_FINISH_STOP, .matched = -1, .matched_text = stop + 1,
                                        .length = o->n_output};
        }
        if (final && o->finish.type == RS_FINISH_NONE) {
            o->finish.type = (rs_finish_type)(1 + i % 3);
            o->finish.matched = 1;
            o->finish.length = o->n_output;
        }
    }
}

static void check_stream(const rs_buf *b) {
    const char *p = b->data, *end = b->data + b->len;
    bool done = false;
    while (p < end) {
        check(!done && strncmp(p, "data: ", 6) == 0);
        const char *e = strstr(p, "\n\n");
        check(e != NULL);
        if (e - p == 12 && strncmp(p + 6, "[DONE]", 6) == 0) {
            done = true;
        } else {
            json_t *v = json_loadb(p + 6, (size_t)(e - p - 6), 0, NULL);
            check(v != NULL && json_is_object(v));
            json_decref(v);
        }
        p = e + 2;
    }
    check(done);
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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    rs_openai_req req;
    rs_error err = {0};
    int rc = rs_openai_parse_completions((const char *)data, size, fuzz_tokenizer(), &req, &err);
    if (rc != RS_OK) {
        check(rc == RS_EINVAL || rc == RS_EUNSUPPORTED || rc == RS_ENOMEM);
        check(req.job == NULL);
        check_error_body(&err);
        return 0;
    }
    rs_gen_job *job = req.job;
    check(job->n_prompts >= 1 && job->sp.n >= 1);
    check(job->batched || job->n_prompts == 1);
    check(job->sp.temperature >= 0 && job->sp.top_p > 0 && job->sp.top_p <= 1);
    check(job->sp.top_k == -1 || job->sp.top_k >= 1);
    check(req.logprobs >= -1 && job->return_logprob == (req.logprobs >= 0));
    check(job->logprob_start_len == -1 || job->logprob_start_len == 0);
    check(strlen(req.id) <= RS_RID_MAX && strlen(req.model) <= RS_OPENAI_MODEL_MAX);

    /* validation against a small model: every error, renamed, still makes a valid body */
    rs_model_config mc = {.vocab_size = 1000, .max_position = 64};
    rs_engine_limits lim = {.max_context = 64, .max_top_logprobs = 5, .max_new_tokens = 50, .max_n = 4,
                            .max_batch = 16};
    rs_error verr = {0};
    rs_gen_invalid why;
    if (rs_gen_job_validate(job, &mc, &lim, &why) != RS_OK) {
        check(rs_openai_invalid(&why, &verr) == RS_EINVAL && verr.param[0]);
        check_error_body(&verr);
        rs_openai_req_free(&req);
        return 0;
    }
    snprintf(req.id, sizeof req.id, "cmpl-fuzz");
    snprintf(req.model, sizeof req.model, "m");
    rs_buf b = {0};
    for (int step = 0; step <= 3; step++) {
        fake_outputs(job, step, step == 3);
        check(rs_openai_stream_events(&req, step == 3, &b) == RS_OK);
    }
    check_stream(&b);
    rs_buf_free(&b);
    size_t len;
    char *body = rs_openai_completions_response(&req, &len);
    check(body != NULL);
    json_t *v = json_loadb(body, len, 0, NULL);
    check(v != NULL);
    check(json_array_size(json_object_get(v, "choices")) == (size_t)job->n_prompts * (size_t)job->sp.n);
    json_decref(v);
    free(body);
    rs_openai_req_free(&req);
    return 0;
}
