/*
 * openai.h — OpenAI / vLLM POST /v1/completions over token ids: JSON body -> rs_gen_job, finished
 * job -> a text_completion object, and the chunks of a streamed one; GET /v1/models.
 *
 * Request. `prompt` is token ids (one list, or a list of lists: a batch) or, when the model has a
 * tokenizer.json (tok), text: a string, or a list of strings (a batch), encoded with
 * add_special_tokens (default true); without one a string prompt is a 400 saying so. The body is
 * read by its descriptor table (openai.c; docs/api-fields.md lists it): every field vLLM's
 * CompletionRequest, SGLang's and OpenAI define is accepted, implemented ones work (model,
 * max_tokens (default 16; null = up to the context limit),
 * temperature, top_p, top_k (0 or -1 = off), min_p, the frequency / presence / repetition
 * penalties, n, seed, stop_token_ids, ignore_eos, min_tokens, logprobs (k: the sampled token's
 * logprob plus the k most likely alternatives per position, vLLM's shape), echo (with logprobs,
 * the prompt's tokens are scored and listed before the output's, the first one null; `max_tokens:
 * 0` with echo scores a prompt), stream, stream_options.include_usage, return_token_ids (adds
 * prompt_token_ids), request_id (vLLM's: the response id becomes "cmpl-<request_id>", and
 * /abort_request takes either; SGLang's rid, one string, is the same) and logprobs_mode (rolloutd's: as on /generate)); null or the
 * neutral value of an unimplemented one is accepted, any other value of it is a 400
 * "unsupported" naming the field; any other name is a 400 naming it. null means "default" for
 * every field. Without `seed` every request draws a fresh one (OpenAI semantics; the server
 * fills it).
 *
 * Response: {"id":"cmpl-…","object":"text_completion","created","model","choices":[{"index",
 * "text":"","logprobs":null|{"tokens":["token_id:N"],"token_logprobs","top_logprobs":[{"token_id:N":
 * lp}],"text_offset"},"finish_reason":"stop"|"length"|"abort","stop_reason":id|null,"token_ids",
 * "prompt_token_ids"?}],"usage":{"prompt_tokens","completion_tokens","total_tokens"}}. Choice
 * index = prompt * n + sample. stop_reason is the stop string or the stop token when one of `stop`
 * or stop_token_ids ended the choice, null for EOS. With a tokenizer, text is the decoded output
 * (gen_text.h: skip_special_tokens, stop strings cut, include_stop_str_in_output = SGLang's
 * no_stop_trim), after the prompt's text with echo, and logprobs.tokens (and the top_logprobs keys)
 * are each token's text (decode([id])) unless return_tokens_as_token_ids; without one text is ""
 * and tokens are "token_id:N". text_offset[i] is the offset, in characters, of tokens[i] in the
 * concatenated token strings (vLLM's arithmetic).
 *
 * Streaming: each event is a text_completion chunk with one choice carrying only what is new for
 * it (the text delta, never a cut UTF-8 character nor text that may still become a stop string, so
 * the deltas concatenate to the final text; token_ids and logprobs deltas; prompt_token_ids and echoed prompt scores in its first
 * chunk; finish_reason in its last), then, with stream_options.include_usage, a chunk with no
 * choices and the usage, then [DONE].
 */
#ifndef RS_PROTOCOL_OPENAI_H
#define RS_PROTOCOL_OPENAI_H

#include <stdbool.h>
#include <stddef.h>

#include "../core/rs.h"
#include "../scheduler/engine.h"
#include "generate.h"
#include "../tokenizer/tokenizer.h"
#include "gen_text.h"
#include "sse.h"

#define RS_OPENAI_MODEL_MAX 255

typedef struct rs_openai_req {
    rs_gen_job *job;            /* owned; lent to the engine between rs_engine_submit and on_done */
    char id[RS_RID_MAX + 1];    /* response id "cmpl-…" (the server names it when request_id was absent) */
    char request_id[RS_RID_MAX + 1]; /* the client's request_id, "" when absent */
    char model[RS_OPENAI_MODEL_MAX + 1]; /* as requested ("" when absent); the server sets the answer's */
    long long created;          /* unix seconds (set by the server) */
    int logprobs;               /* -1: none; else alternatives per position */
    bool echo, stream, include_usage, return_token_ids;
    bool seed_given;            /* false: the server draws job->sp.seed */
    bool add_special_tokens;    /* string prompts: encode with the post-processor's special tokens */
    bool tokens_as_ids;         /* return_tokens_as_token_ids */
    const rs_tok *tok;          /* borrowed; NULL when the model has no tokenizer.json */
    rs_gen_text *text;          /* owned: stop strings and each choice's text; the job's on_token */
    char **prompt_texts;        /* [job->n_prompts] owned: text prompts as given (echo answers them, as
                                 * vLLM does, not their tokens decoded); NULL for token-id prompts */
    size_t *prompt_text_lens;   /* their bytes */
    bool max_tokens_given;      /* false (absent or null): the default, which the server lowers to its
                                 * cap and the context the prompts leave */
    /* streaming state, [outputs] each, allocated on first use */
    int *sent;
    bool *closed, *started;
    long long *text_offset;
    size_t *text_sent;          /* bytes of each choice's text already streamed */
} rs_openai_req;

/* Parses a body. RS_OK with *out filled (free with rs_openai_req_free); else RS_EINVAL or
 * RS_EUNSUPPORTED with err naming the field, and *out zeroed. */
int rs_openai_parse_completions(const char *body, size_t len, const rs_tok *tok, rs_openai_req *out,
                                rs_error *err);
void rs_openai_req_free(rs_openai_req *r);

/* 404 (RS_ENOTFOUND, param "model") unless the request named no model or `served`. */
int rs_openai_check_model(const rs_openai_req *r, const char *served, rs_error *err);

/* rs_gen_job_validate's refusal in this API's words ("prompt[1]", "max_tokens", "logprobs"):
 * fills err and returns RS_EINVAL. */
int rs_openai_invalid(const rs_gen_invalid *why, rs_error *err);

/* The body's descriptor table (json_util.h), for the field reference. */
struct rs_jobject;
extern const struct rs_jobject rs_openai_completion_fields;

/* True when rid is this request's id or its request_id. */
bool rs_openai_matches_rid(const rs_openai_req *r, const char *rid);

/* The answer to a finished job: new malloc'd body and *len, or NULL on OOM. */
char *rs_openai_completions_response(const rs_openai_req *r, size_t *len);

/* Streaming, as rs_generate_stream_events: chunks for outputs that gained tokens or finished;
 * with `final`, the closing chunks, the usage chunk if asked, and [DONE]. */
int rs_openai_stream_events(rs_openai_req *r, bool final, rs_buf *out);

/* GET /v1/models: {"object":"list","data":[{"id":name,"object":"model","created","owned_by":
 * "rolloutd","root":model_path,"max_model_len"}]}. */
char *rs_openai_models_body(const char *name, const char *model_path, long long created, int max_model_len,
                            size_t *len);

#endif /* RS_PROTOCOL_OPENAI_H */
