/*
 * invalid.h — a job the engine refuses (rs_gen_job_validate's rs_gen_invalid), as an rs_error in
 * the words of the API the request came through.
 *
 * The engine reports which field and what was wrong as data; each protocol gives the names its
 * clients wrote (/generate: "input_ids[2]", "sampling_params.max_new_tokens"; /v1/completions:
 * "prompt[2]", "max_tokens"), and this module writes the one message both use:
 *   "sampling_params.n must be in [1, 64], got 65"           "n must be in [1, 64], got 65"
 *   "input_ids[1] has 5 tokens; with max_new_tokens=9 that exceeds the context limit of 12"
 */
#ifndef RS_PROTOCOL_INVALID_H
#define RS_PROTOCOL_INVALID_H

#include "../core/rs.h"
#include "../scheduler/engine.h"

/* How one API names the fields of rs_gen_field (each a full param, as the client wrote it). */
typedef struct rs_invalid_names {
    const char *prompts;            /* the prompt list ("input_ids"); prompt p is "<prompts>[p]" */
    const char *n;
    const char *max_new_tokens;
    const char *max_new_tokens_short; /* as other messages quote it ("max_new_tokens=16") */
    const char *min_new_tokens;
    const char *top_logprobs;
    const char *stop_token_ids;
    const char *logprob_start;
} rs_invalid_names;

/* Fills err (RS_EINVAL, param and message in `names`' words) and returns RS_EINVAL. */
int rs_invalid_error(const rs_gen_invalid *why, const rs_invalid_names *names, rs_error *err);

#endif /* RS_PROTOCOL_INVALID_H */
