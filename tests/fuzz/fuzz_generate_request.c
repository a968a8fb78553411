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
 * sequence.
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
        o->prompt_tokens = job->prompt_lens[p];
        if (job->logprob_start_len >= 0 && job->logprob_start_len < job->prompt_lens[p]) {
            o->n_input_logprobs = job->prompt_lens[p] - job->logprob_start_len;
            o->input_logprobs = malloc(sizeof(float) * (size_t)o->n_input_logprobs);
            for (int k = 0; k < o->n_input_logprobs; k++) o->input_logprobs[k] = k == 0 ? NAN : -1.0f;
        }
        o->finish.type = (rs_finish_type)(1 + i % 3);
        o->finish.matched = 1;
        o->finish.length = o->n_output;
        strcpy(o->finish.message, "aborted");
    }
    strcpy(job->weight_version, "7");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    rs_generate_req req;
    rs_error err = {0};
    int rc = rs_generate_parse((const char *)data, size, &req, &err);
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
