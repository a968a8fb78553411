/*
 * engine_internal.h — the engine's state and the functions its files share. Private to scheduler/.
 *
 * The engine (engine.h) is one concept in six files, read in this order:
 *   engine.c      lifecycle, stats, submit and abort, the engine thread and its loop
 *   controls.c    the step boundary: submitted jobs and aborts taken in, control requests (pause,
 *                 continue, flush, weight swaps, version relabels) applied; version spans
 *   admission.c   which waiting sequences run, the one page estimate (blocks_needed), preemption
 *   step.c        one forward step over decode rows and prefill chunks, logits processing,
 *                 sampling, n-sample fan-out, finishing checks
 *   sequences.c   sequences and their outputs, the waiting queue, finishing and aborting
 *   jobs.c        generation jobs and their validation (validation errors are data: rs_gen_invalid)
 * Everything here belongs to the thread that runs the steps, except what is marked "under mu".
 */
#ifndef RS_ENGINE_INTERNAL_H
#define RS_ENGINE_INTERNAL_H

#include "engine.h"

#include <pthread.h>

#include "../kvcache/kvcache.h"
#include "penalties.h"
#include "sampler.h"

typedef struct rs_seq {
    rs_gen_job *job;
    rs_gen_output *out;
    int prompt_index, sample_index;
    int32_t *tokens;            /* [cap] prompt then generated tokens */
    int n_tokens, cap;
    int prompt_len;
    int n_computed;             /* tokens whose K/V are in the cache */
    int n_forks;                /* group leader: samples still to fork when its prompt completes */
    uint64_t order;             /* admission order: larger is newer (preempted first) */
    double t_last_token;        /* for inter-token latency */
    bool admitted_once;
    rs_kv_seq kv;
    rs_penalty_counts pen;      /* its output tokens, counted when the job asks for penalties */
    int stop_text;              /* 1 + the text stop job->on_token reported for its last token, 0 = none */
    struct rs_seq *next;        /* waiting queue */
} rs_seq;

struct rs_engine {
    rs_model *model;            /* borrowed */
    rs_engine_opts opts;
    rs_kv_pool pool;
    rs_forward_ctx *fwd;
    rs_sampler_scratch sampler;
    char weight_version[64];

    /* step buffers, sized once: rows = max_step_tokens, logits rows = max_logits */
    int32_t *b_tokens, *b_pos, *b_slot, *b_seq_start, *b_seq_ctx, *b_tables;
    int32_t *logit_rows;
    float *logits;              /* [max_logits][vocab] host */
    int max_blocks_per_seq;
    int max_logits;             /* rows of logits per step: every decode row plus some scoring */
    rs_seq **step_seqs;         /* [max_running] sequences in this step's batch */
    rs_seq **sampled;           /* [max_running] sequences that sampled this step */
    int32_t *top_ids;           /* [max_top] scratch */
    float *top_lps;
    float *proc_logits;         /* [vocab] a row after the logits-processing step (process_logits) */
    rs_sample_req *dev_req;     /* [max_logits] sampling on the device (rs_forward_sample), or NULL */
    rs_sample_res *dev_res;
    int *dev_idx;               /* [max_logits] a logits row's request in dev_req, -1: the host samples it */

    rs_seq *wait_head, *wait_tail;
    int n_waiting;
    rs_seq **running;           /* [max_running], oldest first */
    int n_running;
    uint64_t next_order;
    rs_engine_stats stats;

    pthread_mutex_t stats_mu;
    rs_engine_stats published;  /* under stats_mu: what rs_engine_get_stats returns */
    rs_gen_job **progress;      /* [max_running] jobs whose outputs grew this step */
    bool paused;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_cond_t ctl_cv;      /* signals finished control requests */
    struct rs_ctl *ctl_head;    /* control requests, under mu */
    rs_gen_job **inbox;         /* jobs submitted since the last step, under mu */
    int n_inbox, cap_inbox;
    char **abort_rids;          /* under mu */
    int n_abort_rids;
    bool abort_all;
    bool stop;
    bool thread_started;
    pthread_t thread;
};

static inline int blocks_for(int tokens) { return (tokens + RS_KV_BLOCK - 1) / RS_KV_BLOCK; }

/* A control request from another thread, applied at a step boundary (controls.c). */
typedef enum rs_ctl_kind { RS_CTL_PAUSE, RS_CTL_CONTINUE, RS_CTL_FLUSH, RS_CTL_WEIGHTS, RS_CTL_VERSION } rs_ctl_kind;
typedef struct rs_ctl {
    rs_ctl_kind kind;
    int arg;                    /* RS_CTL_PAUSE: rs_pause_mode */
    const rs_weight_swap *swap; /* RS_CTL_WEIGHTS */
    const char *version;        /* RS_CTL_VERSION */
    double seconds;             /* RS_CTL_WEIGHTS: time the step loop was held */
    rs_error *err;
    int rc;
    bool done;
    struct rs_ctl *next;
} rs_ctl;

/* engine.c: lifecycle, stats, submit and abort, the thread and its loop */
void rs_eng_publish_stats(rs_engine *e); /* the counters rs_engine_get_stats returns, under stats_mu */

/* sequences.c: sequences, their outputs, the waiting queue, finishing and aborting */
void rs_eng_seq_push_token(rs_seq *s, int32_t t);
void rs_eng_out_push(rs_gen_output *o, int k, int32_t tok, float lp, const int32_t *top_ids, const float *top_lps);
void rs_eng_out_copy_scoring(rs_gen_output *dst, const rs_gen_output *src, int k);
/* Records the kept ids of o's next output token, the one rs_eng_out_push adds next
 * (rs_gen_output.kept_ids). The caller keeps the job within rs_engine_limits.max_kept_ids. */
void rs_eng_out_push_kept(rs_gen_output *o, const int32_t *ids, size_t n);
rs_seq *rs_eng_seq_new(rs_gen_job *job, int p, int si);
void rs_eng_wait_push_front(rs_engine *e, rs_seq *s);
rs_seq *rs_eng_wait_pop_front(rs_engine *e);
void rs_eng_running_remove(rs_engine *e, rs_seq *s);
void rs_eng_admit_job(rs_engine *e, rs_gen_job *job);
void rs_eng_finish_seq(rs_engine *e, rs_seq *s, rs_finish_type type, int32_t matched, const char *msg);
void rs_eng_finish_running(rs_engine *e, rs_seq *s, rs_finish_type type, int32_t matched, const char *msg);
void rs_eng_abort_matching(rs_engine *e, char **rids, int n_rids, bool all, const char *why);
void rs_eng_finish_all(rs_engine *e, const char *why);
bool rs_eng_is_stop_token(const rs_engine *e, const rs_sampling_params *sp, int32_t t);

/* admission.c: admission and preemption over the KV pool */
bool rs_eng_wants_sample(const rs_seq *s);
bool rs_eng_is_decode(const rs_seq *s);
void rs_eng_preempt(rs_engine *e, rs_seq *s);
bool rs_eng_ensure_decode_pages(rs_engine *e);
void rs_eng_admit_waiting(rs_engine *e);

/* step.c: one forward step and what it samples */
int rs_eng_step(rs_engine *e); /* returns the rows it ran */

/* controls.c: the step boundary, control requests, weight swaps and version spans */
/* Takes in submitted jobs and aborts and applies control requests (after waiting for something to
 * do when `block`); true when there is a sequence to run. */
bool rs_eng_step_boundary(rs_engine *e, bool block);

#endif /* RS_ENGINE_INTERNAL_H */
