/*
 * admission.c — which waiting sequences run. A sequence is admitted, oldest first, while the pool
 * holds its pages plus what everything admitted is expected to grow by (blocks_needed, the one
 * estimate); a decoding sequence without a page for its next token preempts the newest running
 * ones (their pages go back; they are recomputed later from their tokens: "retraction").
 */
#include "engine_internal.h"

#include <math.h>

/* ---------------------------------------------------------------- admission and preemption */

bool rs_eng_wants_sample(const rs_seq *s) { return s->out->n_output < s->job->sp.max_new_tokens; }

bool rs_eng_is_decode(const rs_seq *s) {
    return s->n_computed >= s->prompt_len && s->n_computed == s->n_tokens - 1;
}

/* The admission estimate, the one place it is made: the pages s is expected to need beyond the
 * `held` it holds, for its tokens so far plus admission_new_token_ratio of the new tokens it may
 * still sample, capped at max_context (where the engine stops every sequence). */
static int blocks_needed(const rs_engine *e, const rs_seq *s, int held) {
    int remaining = s->job->sp.max_new_tokens - s->out->n_output;
    int target = s->n_tokens + (int)ceilf((float)remaining * e->opts.admission_new_token_ratio);
    if (target > e->opts.limits.max_context) target = e->opts.limits.max_context;
    int need = blocks_for(target) - held;
    return need > 0 ? need : 0;
}

/* Preempts s by recompute: its pages go back to the pool (full blocks stay in the prefix cache),
 * and it waits at the front of the queue to prefill its tokens again. */
void rs_eng_preempt(rs_engine *e, rs_seq *s) {
    rs_eng_running_remove(e, s);
    rs_kv_seq_release(&e->pool, &s->kv);
    s->n_computed = 0;
    s->out->num_retractions++;
    e->stats.num_retractions++;
    RS_DEBUG("rid %s | preempted sample %d at %d tokens (%d running)", s->job->rid, s->sample_index, s->n_tokens,
             e->n_running);
    rs_eng_wait_push_front(e, s);
}

/* Gives every decoding sequence a writable page for its next token, preempting the newest running
 * sequences while the pool is short. Returns true if anything was preempted. */
bool rs_eng_ensure_decode_pages(rs_engine *e) {
    bool preempted = false;
    for (int i = 0; i < e->n_running; i++) {
        rs_seq *s = e->running[i];
        if (!rs_eng_is_decode(s)) continue;
        for (;;) {
            int rc = rs_kv_seq_reserve(&e->pool, &s->kv, s->n_computed + 1);
            if (rc == RS_OK) rc = rs_kv_seq_prepare_write(&e->pool, &s->kv, s->n_computed);
            if (rc == RS_OK) break;
            rs_seq *victim = e->running[e->n_running - 1];
            rs_eng_preempt(e, victim);
            preempted = true;
            if (victim == s) break;
        }
    }
    return preempted;
}

/* Tokens of s that may come from the prefix cache: never the positions whose logits are still
 * needed to score prompt tokens. */
static int cacheable_tokens(const rs_seq *s) {
    int start = s->job->logprob_start_len;
    if (start >= 0 && s->out->n_input_logprobs > 0 && isnan(s->out->input_logprobs[s->out->n_input_logprobs - 1]))
        return RS_MIN(s->n_tokens, start); /* the row before position `start` must be computed */
    return s->n_tokens;
}

/* Admits waiting sequences, oldest first, while the estimate says they fit. */
void rs_eng_admit_waiting(rs_engine *e) {
    int slots = 0; /* running plus siblings still to fork */
    int reserved = 0;
    for (int i = 0; i < e->n_running; i++) {
        slots += 1 + e->running[i]->n_forks;
        reserved += blocks_needed(e, e->running[i], e->running[i]->kv.n_blocks) * (1 + e->running[i]->n_forks);
    }
    while (e->wait_head) {
        rs_seq *s = e->wait_head;
        if (s->job->sp.max_new_tokens == 0 && s->job->logprob_start_len < 0) { /* nothing to compute */
            rs_eng_wait_pop_front(e);
            rs_eng_finish_seq(e, s, RS_FINISH_LENGTH, -1, NULL);
            continue;
        }
        if (slots + 1 + s->n_forks > e->opts.max_running && e->n_running > 0) break;
        int budget = s->prompt_len + s->job->sp.max_new_tokens;
        if (blocks_for(RS_MIN(budget, e->opts.limits.max_context)) > e->pool.n_blocks) {
            rs_eng_wait_pop_front(e);
            RS_WARN("rid %s | needs %d KV blocks, the pool has %d", s->job->rid,
                    blocks_for(RS_MIN(budget, e->opts.limits.max_context)), e->pool.n_blocks);
            rs_eng_finish_seq(e, s, RS_FINISH_ABORT, -1, "request needs more KV cache than the server has");
            continue;
        }
        int queried = -1; /* the tokens matched against the prefix cache, if they were */
        if (s->kv.n_blocks == 0 && e->opts.prefix_cache) {
            queried = cacheable_tokens(s);
            int hit = rs_kv_seq_match_prefix(&e->pool, &s->kv, s->tokens, queried);
            s->n_computed = hit;
            if (!s->admitted_once) s->out->cached_tokens = RS_MIN(hit, s->prompt_len);
        }
        int own = blocks_for(s->n_tokens) - s->kv.n_blocks;      /* pages for the tokens it has */
        int growth = blocks_needed(e, s, blocks_for(s->n_tokens)); /* and for what it may sample */
        int need = own + growth * (1 + s->n_forks) + s->n_forks; /* + one copied page per sibling */
        if ((e->n_running > 0 && rs_kv_available_blocks(&e->pool) - reserved < need) ||
            rs_kv_seq_reserve(&e->pool, &s->kv, s->n_tokens) != RS_OK) {
            /* Not now. A waiting sequence holds no pages: the cached ones it matched would stay
             * pinned while it waits, and once every running sequence has been preempted to the
             * queue behind or ahead of it, nothing could free them (no step would ever run). */
            if (queried >= 0) {
                rs_kv_seq_unmatch(&e->pool, &s->kv, queried);
                s->n_computed = 0;
            }
            break;
        }
        rs_eng_wait_pop_front(e);
        s->order = e->next_order++;
        /* the prompt tokens a request found cached, once: recomputing a retracted sequence's own
         * pages is not a prefix hit */
        if (!s->admitted_once && !s->job->probe) e->stats.prefix_hit_tokens += (uint64_t)s->out->cached_tokens;
        s->admitted_once = true;
        e->running[e->n_running++] = s;
        slots += 1 + s->n_forks;
        reserved += growth * (1 + s->n_forks);
    }
    if (e->n_running > e->stats.peak_running) e->stats.peak_running = e->n_running;
}
