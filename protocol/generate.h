/*
 * generate.h — SGLang's POST /generate: JSON body -> rs_gen_job, finished job -> JSON response,
 * and the Server-Sent Events of a streamed one.
 *
 * The parser reads the body by its descriptor tables (generate.c; docs/api-fields.md lists them):
 * every field SGLang's GenerateReqInput and SamplingParams define is accepted, implemented ones
 * work, null or the neutral value of an unimplemented one is accepted silently, and any other
 * value of an unimplemented one is RS_EUNSUPPORTED naming the field. Unknown fields, wrong JSON
 * types (1.5 or true where an integer belongs), out-of-range values, duplicate keys, invalid
 * UTF-8 and numbers that do not fit are RS_EINVAL with an rs_error whose param names the field
 * ("sampling_params.top_p", "input_ids[2]") and whose message quotes the value. Checks that need
 * the model or the server limits (token id < vocab, prompt + max_new_tokens <= context, n <=
 * max-n) are rs_gen_job_validate's, in scheduler/; rs_generate_invalid words its answer.
 *
 * Ids. `rid` is the id the user sees (and aborts by); job->rid is the server's own unique name for
 * the job, which the engine aborts by, so that two requests reusing one rid stay apart. Output
 * ids (meta_info.id): the rid when the request was one prompt with n == 1. Otherwise prompt p is
 * named by rid[p] when "rid" was a list, else "<rid>_<p>" for a batch (SGLang's own naming of a
 * batch with one string rid) or "<rid>" for one prompt; with n > 1, sample s appends "_<s>".
 *
 * Text (when the model has a tokenizer.json): `text` prompts are encoded with add_special_tokens,
 * as SGLang does; every output has "text", its decoded output_ids (skip_special_tokens, stop
 * strings and no_stop_trim as gen_text.h says); finish_reason is {"type":"stop","matched":"<the
 * stop string>"} when a stop string ended it; with return_text_in_logprobs the third element of
 * each logprob triple and top entry is the token's text (decode([id]), special tokens kept).
 * Streamed events carry the text that is final so far: cumulative events the text from the
 * start, incremental ones the new part; a UTF-8 character is never cut, and the text that could
 * still turn into a stop string is held back until it is decided, so the incremental texts of an
 * output concatenate to its final text.
 *
 * Answers follow SGLang's shape (API.md); meta_info adds "weight_version_spans": [[version,
 * start, end], ...], the weight versions that produced output tokens [start, end) (more than one
 * when the request crossed a weight update; weight_version is the latest).
 *
 * Streaming (`"stream": true`), as SGLang sends it: one event `data: {...}\n\n` per output each
 * time that output gains tokens, then `data: [DONE]\n\n`. An event is the output's object as in
 * the non-streamed answer, with finish_reason null until the output finishes (the output's last
 * event carries its finish_reason, possibly with no new tokens) and e2e_latency only in that last
 * event; when the request is batched or n > 1 the event also has "index" (the output's position
 * in the non-streamed list). By default every event is cumulative (output_ids and the logprob
 * lists from the first token, SGLang's default), so the last event of an output is its complete
 * answer. With `incremental` (SGLang's --incremental-streaming-output) each event carries only
 * the tokens (and their logprobs) that are new since that output's previous event, and the
 * prompt's input_token_logprobs only in its first event. sampling_params.stream_interval = k
 * sends an output's event only once it has k new tokens (or has finished).
 */
#ifndef RS_PROTOCOL_GENERATE_H
#define RS_PROTOCOL_GENERATE_H

#include <stdbool.h>
#include <stddef.h>

#include "../core/rs.h"
#include "../scheduler/engine.h"
#include "../tokenizer/tokenizer.h"
#include "gen_text.h"
#include "sse.h"

#define RS_RID_MAX 127 /* bytes; rs_gen_job.rid holds one more for the NUL */

typedef struct rs_generate_req {
    rs_gen_job *job;            /* owned; lent to the engine between rs_engine_submit and on_done */
    char **prompt_rids;         /* [job->n_prompts] when "rid" was a list, else NULL; owned */
    char rid[RS_RID_MAX + 1];   /* the user's rid ("" when absent, for the server to name) */
    bool stream;
    bool seed_given;            /* false: the server draws job->sp.seed (SGLang: random when absent) */
    bool max_new_tokens_given;  /* false: job->sp.max_new_tokens is the default, which the server
                                 * lowers to its cap and the context the prompts leave (SGLang) */
    bool incremental;           /* streaming: events carry only new tokens (set by the server) */
    int stream_interval;        /* streaming: tokens between an output's events (sampling_params.stream_interval) */
    int *sent;                  /* streaming: [outputs] tokens already sent, allocated on first use */
    size_t *text_sent;          /* streaming: [outputs] bytes of text already sent (incremental events) */
    bool *closed;               /* streaming: [outputs] finish already sent */
    /* text (gen_text.h): tok is NULL when the model has no tokenizer.json; then no "text" is
     * answered and every text field is a 400 saying so */
    const rs_tok *tok;          /* borrowed */
    rs_gen_text *text;          /* owned: stop strings, trimming, each output's text; the job's on_token */
    bool from_text;             /* the prompts came as "text" (errors then name text[p]) */
    bool text_in_logprobs;      /* return_text_in_logprobs */
} rs_generate_req;

/* Parses a request body (need not be NUL-terminated). tok (NULL: the model has no tokenizer.json)
 * encodes `text` prompts and makes the outputs' text; with it, stop strings or a stream set the
 * job's on_token hook (gen_text.h). On success fills *out (the caller frees it with rs_generate_req_free) and
 * returns RS_OK; rid and job->rid are left empty for the caller to name. On failure returns RS_EINVAL (or RS_EUNSUPPORTED for a valid value this server does not
 * implement) with err filled, and *out zeroed. */
int rs_generate_parse(const char *body, size_t len, const rs_tok *tok, rs_generate_req *out, rs_error *err);

/* The 400 of a text field (`param`) when the model has no tokenizer.json. */
int rs_generate_no_tokenizer(const char *param, rs_error *err);

/* The body's descriptor table (json_util.h), for the field reference. */
struct rs_jobject;
extern const struct rs_jobject rs_generate_fields;

/* rs_gen_job_validate's refusal in /generate's words ("input_ids[1]", "sampling_params.n"):
 * fills err and returns RS_EINVAL. */
int rs_generate_invalid(const rs_generate_req *r, const rs_gen_invalid *why, rs_error *err);

/* Frees the job (if any), the rids and the streaming state; leaves *r zeroed. */
void rs_generate_req_free(rs_generate_req *r);

/* The meta_info.id of output (p, s), written into buf. */
void rs_generate_output_id(const rs_generate_req *r, int p, int s, char *buf, size_t n);

/* True when `rid` names this request: its rid, one of its prompt rids, or one of its output ids. */
bool rs_generate_matches_rid(const rs_generate_req *r, const char *rid);

/* Serializes a finished job: one object when the job was not batched and n == 1, else a list in
 * prompt-major order (outputs[p * n + s]). Returns a new malloc'd NUL-terminated body (the caller
 * frees it) and its length in *len, or NULL when memory is exhausted. */
char *rs_generate_response(const rs_generate_req *r, size_t *len);

/* Streaming: appends an event for every output that gained tokens or finished since the last
 * call; with `final` (the job is done) also every output's closing event not yet sent and the
 * [DONE] event. Call it where the outputs are stable (the engine's progress and done callbacks).
 * RS_OK or RS_ENOMEM. */
int rs_generate_stream_events(rs_generate_req *r, bool final, rs_buf *out);

#endif /* RS_PROTOCOL_GENERATE_H */
