/*
 * generate.h — SGLang's POST /generate: JSON body -> rs_gen_job, finished job -> JSON response.
 *
 * The parser is strict: unknown fields, wrong JSON types (1.5 or true where an integer belongs),
 * out-of-range values, duplicate keys, invalid UTF-8 and numbers that do not fit are all rejected
 * with an rs_error whose param names the field ("sampling_params.top_p", "input_ids[2]") and whose
 * message quotes the value. Checks that need the model or the server limits (token id < vocab,
 * prompt + max_new_tokens <= context, n <= max-n) are rs_gen_job_validate's, in scheduler/.
 *
 * Output ids (meta_info.id): the rid when the request was one prompt with n == 1. Otherwise prompt
 * p is named by rid[p] when "rid" was a list, else "<rid>_<p>" for a batch (SGLang's own naming of
 * a batch with one string rid) or "<rid>" for one prompt; with n > 1, sample s appends "_<s>".
 */
#ifndef RS_PROTOCOL_GENERATE_H
#define RS_PROTOCOL_GENERATE_H

#include <stddef.h>

#include "../core/rs.h"
#include "../scheduler/engine.h"

#define RS_RID_MAX 127 /* bytes; rs_gen_job.rid holds one more for the NUL */

typedef struct rs_generate_req {
    rs_gen_job *job;            /* owned; lent to the engine between rs_engine_submit and on_done */
    char **prompt_rids;         /* [job->n_prompts] when "rid" was a list, else NULL; owned */
} rs_generate_req;

/* Parses a request body (need not be NUL-terminated). On success fills *out (the caller frees it
 * with rs_generate_req_free) and returns RS_OK; job->rid is left empty when the request had no
 * rid, for the caller to name it. On failure returns RS_EINVAL (or RS_EUNSUPPORTED for a valid
 * value this server does not implement: stream, top_logprobs_num > 0, logprobs_mode other than
 * "default") with err filled, and *out zeroed. */
int rs_generate_parse(const char *body, size_t len, rs_generate_req *out, rs_error *err);

/* Frees the job (if any) and the rids; leaves *r zeroed. */
void rs_generate_req_free(rs_generate_req *r);

/* The meta_info.id of output (p, s), written into buf. */
void rs_generate_output_id(const rs_generate_req *r, int p, int s, char *buf, size_t n);

/* Serializes a finished job: one object when the job was not batched and n == 1, else a list in
 * prompt-major order (outputs[p * n + s]). Returns a new malloc'd NUL-terminated body (the caller
 * frees it) and its length in *len, or NULL when memory is exhausted. */
char *rs_generate_response(const rs_generate_req *r, size_t *len);

#endif /* RS_PROTOCOL_GENERATE_H */
