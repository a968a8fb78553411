/*
 * engine.h — the engine thread and the generation jobs it runs.
 *
 * One engine thread owns the model, the KV pool and the backend. Other threads hand it work as
 * rs_gen_job values through rs_engine_submit (thread-safe) and are told of completion through the
 * job's on_done callback, which runs on the engine thread and must not block (the server pushes
 * the job onto its completion queue and wakes its libuv loop).
 *
 * A job is one HTTP request: n_prompts prompts x sp.n samples. Each (prompt, sample) pair is one
 * sequence and one rs_gen_output, in prompt-major order: outputs[p * n + s].
 */
#ifndef RS_ENGINE_H
#define RS_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "../core/histogram.h"
#include "../core/rs.h"
#include "../kvcache/kvcache.h"
#include "../model/model.h"

typedef struct rs_sampling_params {
    int max_new_tokens;         /* default 128 */
    int min_new_tokens;         /* default 0: before this many outputs every stop token (stop_token_ids
                                 * and the model's EOS ids, ignore_eos or not) is masked out of the
                                 * distribution, as SGLang and vLLM do; see process_logits in step.c
                                 * and the logprob rule in sampler.h */
    float temperature;          /* default 1.0; 0 = greedy */
    float top_p;                /* default 1.0 */
    int top_k;                  /* default -1 (off) */
    float min_p;                /* default 0.0 (off) */
    int n;                      /* samples per prompt, default 1 */
    uint64_t seed;              /* sampling_seed; default 0 */
    int32_t *stop_token_ids;    /* owned by the job */
    int n_stop_token_ids;
    bool ignore_eos;
    /* SGLang's finish checks (/generate; Req.check_finished): max_new_tokens is checked before
     * stop tokens and stop strings (the last allowed token finishes "length" even when it stops),
     * and ignore_eos turns off stop_token_ids too. Off: vLLM's (/v1/completions): a stop token or
     * string finishes "stop" whenever it comes, and ignore_eos leaves stop_token_ids on. */
    bool sglang_finish;
    /* Penalties over the tokens this sample has output (scheduler/penalties.h), applied to the
     * logits before temperature: default 0, 0, 1 (off). */
    float frequency_penalty;    /* minus this x the token's count */
    float presence_penalty;     /* minus this once the token occurs */
    float repetition_penalty;   /* divides a positive logit, multiplies a negative one */
} rs_sampling_params;

void rs_sampling_params_default(rs_sampling_params *sp);

typedef enum rs_finish_type {
    RS_FINISH_NONE = 0,         /* still running */
    RS_FINISH_STOP,             /* matched a stop token or EOS; `matched` holds it */
    RS_FINISH_LENGTH,           /* max_new_tokens or the context limit; `length` holds the count */
    RS_FINISH_ABORT,            /* aborted; `message` says why */
} rs_finish_type;

typedef struct rs_finish {
    rs_finish_type type;
    int32_t matched;            /* STOP by a token: that token; -1 when a text stop ended it */
    int matched_text;           /* STOP by a text stop (rs_gen_job.on_token): 1 + the index the hook
                                 * returned; 0 otherwise (zeroed outputs read as "no text stop") */
    int length;
    char message[128];
} rs_finish;

/* Which distribution a returned logprob (and its top alternatives) comes from. "penalized" is the
 * model's logits with the sample's frequency / presence / repetition penalties applied
 * (scheduler/penalties.h; the logits themselves when no penalty is asked). */
typedef enum rs_logprobs_mode {
    RS_LOGPROBS_DEFAULT = 0,    /* log_softmax(penalized / T), before top-k/p, min-p truncation (T = 1
                                 * when greedy): SGLang's default, what its trainers recompute */
    RS_LOGPROBS_RAW,            /* log_softmax(logits): no penalty, no temperature (vLLM's raw_logprobs) */
    RS_LOGPROBS_PROCESSED,      /* the distribution actually sampled from: penalties, T, top-k/p, min-p,
                                 * renormalized (vLLM's processed_logprobs) */
} rs_logprobs_mode;

/* Tokens [start, end) of an output came from weights `version`. */
typedef struct rs_weight_span {
    char version[64];
    int start, end;
} rs_weight_span;

typedef struct rs_gen_output {
    int32_t *output_ids;        /* [n_output] */
    float *output_logprobs;     /* [n_output]: the sampled token's logprob under job->logprobs_mode */
    int32_t *output_top_ids;    /* [n_output][top_logprobs_num] alternatives, -1 where fewer exist */
    float *output_top_lps;      /* [n_output][top_logprobs_num] */
    int n_output, cap;
    /* With job->return_top_p_ids: the token ids the sampler kept for output token i (its top-k /
     * top-p / min-p set, most likely first; the token itself when greedy; none when nothing was
     * truncated) are kept_ids[kept_offsets[i], kept_offsets[i + 1]); kept_offsets has n_output + 1
     * entries once the first token is in (NULL before), [cap_kept_offsets] allocated. */
    int32_t *kept_ids;
    size_t n_kept_ids, cap_kept_ids;
    uint32_t *kept_offsets;
    int cap_kept_offsets;
    /* Prompt scoring when logprob_start_len >= 0: input_logprobs[i] is the logprob of prompt token
     * logprob_start_len + i given the tokens before it; NAN for position 0 (no context). All of
     * them come from one weight version, spans[0]'s: a prompt not fully scored at an update is
     * scored again with the new weights. */
    float *input_logprobs;
    int32_t *input_top_ids;     /* [n_input_logprobs][top_logprobs_num], -1 where absent (position 0) */
    float *input_top_lps;
    int n_input_logprobs;
    rs_finish finish;
    int prompt_tokens;
    int cached_tokens;          /* prompt tokens whose KV this sample did not compute itself: prefix
                                 * cache hits, or the shared prefill of its n-sample group */
    int num_retractions;        /* times this sample was preempted and recomputed */
    /* Weight versions that produced the output tokens, in order, adjacent spans of different
     * versions; more than one when the request crossed a weight update. Once finished, the spans
     * tile [0, n_output) and only the first may be empty (an output without tokens). */
    rs_weight_span *spans;
    int n_spans;
    double e2e_latency;         /* seconds from arrival to finish */
} rs_gen_output;

typedef struct rs_gen_job rs_gen_job;
typedef void (*rs_job_done_fn)(rs_gen_job *job, void *user);
/* A text stop check (stop strings), implemented above the scheduler, which knows no tokenizer:
 * see rs_gen_job.on_token. Returns the index (>= 0) of the stop condition that `token` completed
 * in output `output` (outputs[] index), or -1. */
typedef int (*rs_job_token_fn)(rs_gen_job *job, int output, int32_t token, void *user);

struct rs_gen_job {
    char rid[128];              /* the request's rid, or generated */
    int n_prompts;
    int32_t **prompts;          /* [n_prompts][prompt_lens[i]], owned */
    int *prompt_lens;           /* [n_prompts], owned */
    bool batched;               /* input_ids was a list of lists: the response is a list */
    rs_sampling_params sp;
    bool return_logprob;
    int logprob_start_len;      /* -1: outputs only; >= 0: also score prompt tokens from there */
    int top_logprobs_num;       /* k alternatives per scored position, 0 = none */
    rs_logprobs_mode logprobs_mode;
    /* slime's custom_params.return_top_p_token_ids: record, for every output token, the ids the
     * sampler kept (rs_gen_output.kept_ids). Such a job samples on the host. */
    bool return_top_p_ids;
    bool stream;                /* reserved: the API issue adds SSE */
    /* A health probe (/health_generate), not a user request: an abort of every job
     * (rs_engine_abort with NULL) and pause(ABORT) leave it be, so a trainer's abort-all or pause
     * never fails the probe; it is aborted only by its rid, or when the engine stops. */
    bool probe;
    /* filled by the engine */
    rs_gen_output *outputs;     /* [n_prompts * sp.n] */
    char weight_version[64];    /* the version in service at the job's last update or admission */
    double t_arrival;
    /* completion: called once on the engine thread when every output has finished */
    rs_job_done_fn on_done;
    void *on_done_user;
    /* progress (optional, for streaming): called on the engine thread after each step in which
     * any output gained tokens, before on_done; it may read the outputs, which the engine does not
     * touch while it runs. It must not block. */
    rs_job_done_fn on_progress;
    /* text stops (optional): called on the engine thread with each token an output gains, in
     * order, right after it is sampled and before on_progress sees it, except a token that ends
     * the output as a stop token or EOS (never passed: the caller finds it in output_ids). A
     * return k >= 0 finishes that output "stop" with finish.matched = -1 and matched_text = k + 1
     * (before max_new_tokens or the context limit is checked, as for stop tokens); tokens stay in
     * output_ids, the one that completed the match included. It is never called again for an
     * output it stopped, nor for tokens recomputed after a retraction (outputs only grow). It
     * may read the job's outputs and must not block: its cost is part of every step. */
    rs_job_token_fn on_token;
    void *on_token_user;
    double t_first_token;       /* filled by the engine: first token of any output (0 = none yet) */
    /* filled by the engine: RS_EINTERNAL when producing the outputs hit a bug (a logits row holding
     * a NaN or +inf, a logprob that came out NaN), RS_ETOOBIG when the kept ids of the job's
     * outputs passed the limit (rs_engine_limits.max_kept_ids). Every output then finishes "abort"
     * and none may be served: the server answers 500 (413) with this message (a stream ends
     * without [DONE]). */
    rs_error error;
    size_t n_kept_ids;          /* engine: kept ids recorded over all outputs (return_top_p_ids) */
};

/* Kept ids a job may record over all its outputs (return_top_p_ids) unless the limits say
 * otherwise: 256 MiB of int32 (341 MiB of base64 in the answer). Past it the job fails with
 * RS_ETOOBIG. */
#define RS_KEPT_IDS_MAX ((size_t)1 << 26)

rs_gen_job *rs_gen_job_new(void);                 /* zeroed, sampling defaults, rid empty */
void rs_gen_job_free(rs_gen_job *job);            /* frees everything the job owns */

typedef struct rs_engine_limits {
    int max_context;            /* tokens per sequence (prompt + output) */
    int max_top_logprobs;       /* cap on top_logprobs_num */
    int max_new_tokens;         /* cap on sampling_params.max_new_tokens */
    int max_n;                  /* cap on sampling_params.n */
    int max_batch;              /* cap on n_prompts * n */
    size_t max_kept_ids;        /* cap on a job's kept ids (return_top_p_ids); 0: RS_KEPT_IDS_MAX */
} rs_engine_limits;

/* Why rs_gen_job_validate refused a job, as data: which field, which problem, where and against
 * which limit. The engine knows no API's field names; each protocol names the field in its own
 * words (protocol/invalid.h: "sampling_params.n" for /generate, "n" for /v1/completions). */
typedef enum rs_gen_field {
    RS_GEN_FIELD_PROMPTS = 0,   /* the list of prompts as a whole */
    RS_GEN_FIELD_PROMPT,        /* one prompt: `index` (-1 when the request was not batched) */
    RS_GEN_FIELD_N,             /* samples per prompt */
    RS_GEN_FIELD_MAX_NEW_TOKENS,
    RS_GEN_FIELD_MIN_NEW_TOKENS,
    RS_GEN_FIELD_TOP_LOGPROBS,  /* alternatives per position (top_logprobs_num) */
    RS_GEN_FIELD_STOP_TOKEN_IDS,
    RS_GEN_FIELD_LOGPROB_START, /* first prompt position scored (logprob_start_len) */
} rs_gen_field;

typedef enum rs_gen_problem {
    RS_GEN_EMPTY = 0,           /* the field has no tokens */
    RS_GEN_RANGE,               /* value is outside [min, max] */
    RS_GEN_BATCH,               /* value prompts x `other` samples is over max sequences */
    RS_GEN_VOCAB,               /* token `value` at position `pos` is outside [0, max) */
    RS_GEN_CONTEXT,             /* a prompt of `value` tokens + `other` new tokens is over max */
    RS_GEN_PAST_PROMPT,         /* value is not below the prompt length max */
    RS_GEN_ALL_MASKED,          /* the stop ids and EOS ids (value distinct ids) cover the vocabulary
                                 * `max`: with min_new_tokens = `other` nothing could be sampled */
} rs_gen_problem;

typedef struct rs_gen_invalid {
    rs_gen_field field;
    rs_gen_problem problem;
    int index;                  /* RS_GEN_FIELD_PROMPT: the prompt (-1: the only one, not batched) */
    int pos;                    /* RS_GEN_VOCAB: position in the list */
    long long value;            /* the offending value */
    long long min, max;         /* the limit, as `problem` says */
    long long other;            /* RS_GEN_BATCH: n; RS_GEN_CONTEXT: max_new_tokens;
                                 * RS_GEN_ALL_MASKED: min_new_tokens */
} rs_gen_invalid;

/* Checks a parsed job against the model and server limits: non-empty prompts, token ids in
 * [0, vocab), n, prompts x n, max/min_new_tokens and top_logprobs_num within the limits, prompt +
 * max_new_tokens within the context, logprob_start_len < prompt length; with min_new_tokens > 0 the
 * stop ids and EOS ids must leave some token to sample. RS_OK, or RS_EINVAL with
 * *why filled (the first problem, in that order). */
int rs_gen_job_validate(const rs_gen_job *job, const rs_model_config *cfg, const rs_engine_limits *lim,
                        rs_gen_invalid *why);

typedef struct rs_engine_opts {
    size_t kv_cache_bytes;      /* KV pool budget */
    int max_running;            /* sequences per step */
    int max_step_tokens;        /* rows per forward step (prefill chunking) */
    /* Admission reserves pages for this share of each sequence's remaining max_new_tokens, so
     * that preemption stays rare (1.0: never preempt; small: admit more, preempt more). */
    float admission_new_token_ratio;
    bool prefix_cache;          /* share KV pages of identical prompt prefixes across requests */
    /* KV cache pages: F32, BF16 or E4M3 (0 = F32), and for E4M3 where their scales come from
     * (kvcache.h; required for E4M3, ignored otherwise). */
    rs_dtype kv_dtype;
    rs_kv_scales kv_scales;
    float kv_calib_margin;      /* calibrated scale = stat * margin / 448 */
    float kv_calib_percentile;  /* stat = this percentile of |K|, |V| (1.0 = amax) */
    int kv_calib_tokens;        /* length of the calibration token set (<= 0: 512) */
    rs_engine_limits limits;
    const char *weight_version; /* version of the loaded weights; NULL = "0" */
} rs_engine_opts;

typedef struct rs_engine rs_engine;

/* The engine borrows the model; it must outlive the engine. */
int rs_engine_init(rs_engine **out, rs_model *m, const rs_engine_opts *opts, rs_error *err);
void rs_engine_free(rs_engine *e);               /* stops the thread if running */

int rs_engine_start(rs_engine *e);               /* spawns the engine thread */
void rs_engine_stop(rs_engine *e);               /* aborts remaining jobs, joins the thread */

/* Thread-safe: queues the job (ownership passes to the engine until on_done). */
int rs_engine_submit(rs_engine *e, rs_gen_job *job, rs_error *err);

/* Thread-safe: aborts the jobs whose rid equals `rid` (every job but probes when rid is NULL) at
 * the next step boundary. Their sequences free their pages at once and finish with type "abort", keeping
 * the tokens and logprobs produced so far. */
void rs_engine_abort(rs_engine *e, const char *rid);

/* Pausing, as SGLang's /pause_generation. Thread-safe; takes effect at the next step boundary and
 * returns once it has. New requests are accepted while paused and wait.
 *   ABORT     abort every request in flight (partial outputs, finish "abort"); probes wait
 *   RETRACT   put every running sequence back in the queue, freeing its pages (recomputed later)
 *   IN_PLACE  stop stepping; running sequences keep their pages */
typedef enum rs_pause_mode { RS_PAUSE_ABORT = 0, RS_PAUSE_RETRACT, RS_PAUSE_IN_PLACE } rs_pause_mode;
void rs_engine_pause(rs_engine *e, rs_pause_mode mode);
void rs_engine_continue(rs_engine *e);

/* Drops every cached prefix. RS_ESTATE (and nothing dropped) while any request is in flight.
 * Thread-safe; runs at the next step boundary. */
int rs_engine_flush_cache(rs_engine *e, rs_error *err);

/* Weight updates: the one operation the engine offers sync/ (whose commit policy decides what
 * goes in it). At a step boundary, when no forward pass is in flight, the engine
 *   1. settles the KV scales the new weights are served with: swap->k_scales / v_scales, or what
 *      swap->calibrate computes here (holding the step loop), or, with neither, the ones in
 *      service; given or computed, they must be finite and > 0, else the update is refused;
 *   2. calls swap->apply, which swaps the staged tensors into the model (it cannot fail: all that
 *      can fail happened before, while staging, or in step 1);
 *   3. retracts sequences in flight, which recompute their tokens with the new weights (KV from
 *      the old weights is never read again, so a token's logprob is exactly that of the version it
 *      reports), drops the prefix cache, installs the scales and sets weight_version.
 * A refusal in step 1 leaves the old weights, scales and version in service. In-flight requests
 * are not aborted: tokens sampled after the commit come from the new weights, and outputs record
 * version spans. Scales are [n_layers][n_kv_heads] each and only for an engine with per-head
 * scales (CALIBRATE or STATIC). Thread-safe; returns once committed or refused. RS_EBUSY when the
 * engine is shutting down. */
typedef void (*rs_weights_apply_fn)(rs_model *m, void *ctx);
typedef int (*rs_weights_calibrate_fn)(void *ctx, const rs_engine *e, float *k, float *v, rs_error *err);
typedef struct rs_weight_swap {
    rs_weights_apply_fn apply;
    void *ctx;                          /* for apply and calibrate */
    const float *k_scales, *v_scales;   /* the scales to install, or NULL */
    rs_weights_calibrate_fn calibrate;  /* or: computes them before the swap; NULL = none */
    const char *scales_param;           /* what a refusal of the scales names ("k_scale") */
    const char *scales_what;            /* and says ("the pushed KV scales") */
    const char *version;                /* served from the swap on */
} rs_weight_swap;
int rs_engine_swap_weights(rs_engine *e, const rs_weight_swap *swap, double *seconds_paused, rs_error *err);

/* Where this engine's FP8 KV scales come from: NONE unless its pages are E4M3. */
rs_kv_scales rs_engine_kv_scales(const rs_engine *e);

/* Relabels the weights in service (no weight change); later tokens report `version`. */
int rs_engine_set_weight_version(rs_engine *e, const char *version, rs_error *err);

/* Without a thread (tests, benchmarks): run steps on the caller's thread until every submitted
 * job has finished. */
void rs_engine_run_until_idle(rs_engine *e);
/* One step of rs_engine_run_until_idle (false: nothing left to do). Between two calls is a step
 * boundary, where a control (a weight update, a version) applies at once: tests of what crosses
 * an update use it to place the update exactly. */
bool rs_engine_step_once(rs_engine *e);

/* A snapshot of the engine's counters and occupancy; thread-safe (published after every step). */
typedef struct rs_engine_stats {
    int kv_blocks_total;
    int kv_blocks_free;         /* free or holding evictable cached prefixes */
    int kv_blocks_cached;       /* evictable cached prefix blocks (part of kv_blocks_free) */
    int n_running;
    int n_waiting;
    uint64_t waiting_tokens;    /* tokens the waiting sequences will (re)compute */
    uint64_t waiting_blocks;    /* KV pages those tokens fill */
    int peak_running;           /* most sequences ever running in one step */
    uint64_t num_retractions;   /* preemptions since start */
    uint64_t prefix_hit_tokens; /* prompt tokens served from the prefix cache: the sum of the outputs'
                                 * cached_tokens (not a retracted sequence's recomputation) */
    uint64_t prompt_tokens, generation_tokens, steps;
    uint64_t requests_finished, requests_aborted;
    uint64_t weight_updates;
    bool paused;
    rs_histogram ttft;          /* arrival to first token of a request */
    rs_histogram itl;           /* between consecutive tokens of a sequence */
    rs_histogram e2e;           /* arrival to finish of a request */
} rs_engine_stats;
void rs_engine_get_stats(const rs_engine *e, rs_engine_stats *out);

/* Recomputes the per-head FP8 KV scales from the calibration token set (no-op unless the engine
 * calibrates: RS_KV_SCALES_CALIBRATE). Runs on the caller's thread: call it at init or from the engine thread at a step
 * boundary with no sequence holding KV (it flushes the prefix cache). */
int rs_engine_calibrate_kv(rs_engine *e, rs_error *err);

/* The scales rs_engine_calibrate_kv would compute for model m (the engine's options, m's
 * weights), into k, v [n_layers][n_kv_heads], without installing them. Runs on m's backend on
 * the caller's thread, which must be the only user of that backend; m may be a view holding
 * staged weights on a backend of the caller's own (rs_model_view), so that an update calibrates
 * before its commit while the engine keeps generating. Bit-identical to the engine's own
 * calibration of the same weights on the CPU backend (its forward pass does not depend on the
 * thread count). Thread-safe with respect to the engine (reads only its immutable options). */
int rs_engine_calibrate_kv_on(const rs_engine *e, const rs_model *m, float *k, float *v, rs_error *err);

const rs_model_config *rs_engine_model_config(const rs_engine *e);
const rs_engine_limits *rs_engine_get_limits(const rs_engine *e);
/* Thread-safe: a copy in a per-thread buffer, valid until this thread's next call. */
const char *rs_engine_weight_version(const rs_engine *e);

#endif /* RS_ENGINE_H */
