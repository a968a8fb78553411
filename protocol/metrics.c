/*
 * metrics.c — Prometheus text for GET /metrics (see metrics.h).
 *
 * Each value is written once per name it is published under: a small table lists the names, the
 * type and the help text, and the writer loops over it, so an alias can never drift from the
 * rolloutd_* value it mirrors.
 */
#include "metrics.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "sse.h"

typedef struct out {
    rs_buf b;
    int rc;
} out;

static void put(out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(out *o, const char *fmt, ...) {
    if (o->rc != RS_OK) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof line) {
        o->rc = RS_EINTERNAL;
        return;
    }
    o->rc = rs_buf_append(&o->b, line, (size_t)n);
}

#define MAX_NAMES 4

typedef struct family {
    const char *names[MAX_NAMES]; /* the rolloutd name first, then aliases; NULL-terminated */
    const char *type;             /* "gauge" | "counter" */
    const char *help;
    double value;
} family;

static void scalar(out *o, const family *f) {
    for (int i = 0; i < MAX_NAMES && f->names[i]; i++) {
        put(o, "# HELP %s %s\n# TYPE %s %s\n", f->names[i], f->help, f->names[i], f->type);
        put(o, "%s %.17g\n", f->names[i], f->value);
    }
}

static void histogram(out *o, const char *const names[MAX_NAMES], const char *help, const rs_histogram *h) {
    for (int i = 0; i < MAX_NAMES && names[i]; i++) {
        const char *n = names[i];
        put(o, "# HELP %s %s\n# TYPE %s histogram\n", n, help, n);
        uint64_t cum = 0;
        for (int k = 0; k < RS_HIST_BUCKETS; k++) {
            cum += h->counts[k];
            if (k == RS_HIST_BUCKETS - 1) put(o, "%s_bucket{le=\"+Inf\"} %llu\n", n, (unsigned long long)cum);
            else put(o, "%s_bucket{le=\"%g\"} %llu\n", n, rs_hist_bounds[k], (unsigned long long)cum);
        }
        put(o, "%s_sum %.17g\n", n, h->sum);
        put(o, "%s_count %llu\n", n, (unsigned long long)cum);
    }
}

char *rs_metrics_text(const rs_metrics_input *in, size_t *len) {
    const rs_engine_stats *st = in->stats;
    out o = {.rc = RS_OK};
    double total = st->kv_blocks_total, used = st->kv_blocks_total - st->kv_blocks_free;
    double usage = total > 0 ? used / total : 0.0;
    const family fams[] = {
        {{"rolloutd_num_running_reqs", "sglang:num_running_reqs", "vllm:num_requests_running"}, "gauge",
         "Sequences running in the engine (a request with n samples runs n).", st->n_running},
        {{"rolloutd_num_waiting_reqs", "sglang:num_queue_reqs", "vllm:num_requests_waiting"}, "gauge",
         "Sequences waiting for admission (queued or preempted).", st->n_waiting},
        {{"rolloutd_kv_cache_usage_ratio", "sglang:token_usage", "vllm:kv_cache_usage_perc"}, "gauge",
         "Fraction of KV cache pages held by sequences (0..1; evictable cached prefixes count as free).", usage},
        {{"rolloutd_kv_cache_pages_total"}, "gauge", "KV cache pages (16 tokens each).", total},
        {{"rolloutd_kv_cache_pages_free"}, "gauge", "KV cache pages free or holding evictable cached prefixes.",
         st->kv_blocks_free},
        {{"rolloutd_kv_cache_pages_cached"}, "gauge", "KV cache pages holding evictable cached prefixes.",
         st->kv_blocks_cached},
        {{"rolloutd_max_total_num_tokens", "sglang:max_total_num_tokens"}, "gauge",
         "Tokens the KV cache holds (pages x 16).", total * 16},
        {{"rolloutd_num_used_tokens", "sglang:num_used_tokens"}, "gauge", "Tokens of KV cache held by sequences.",
         used * 16},
        {{"rolloutd_paused"}, "gauge", "1 while generation is paused (/pause_generation).", st->paused ? 1 : 0},
        {{"rolloutd_http_requests_in_flight"}, "gauge", "Generation requests admitted over HTTP and not yet answered.",
         in->http_in_flight},
        {{"rolloutd_peak_running_seqs"}, "gauge", "Most sequences ever running in one engine step.", st->peak_running},
        {{"rolloutd_prompt_tokens_total", "sglang:prompt_tokens_total", "vllm:prompt_tokens_total"}, "counter",
         "Prompt tokens computed by prefill (prefix-cache hits excluded, recomputation included).",
         (double)st->prompt_tokens},
        {{"rolloutd_generation_tokens_total", "sglang:generation_tokens_total", "vllm:generation_tokens_total"},
         "counter", "Tokens generated.", (double)st->generation_tokens},
        {{"rolloutd_prefix_cache_hit_tokens_total", "sglang:cached_tokens_total"}, "counter",
         "Prompt tokens served from the prefix cache.", (double)st->prefix_hit_tokens},
        {{"rolloutd_num_preemptions_total", "vllm:num_preemptions_total", "sglang:num_retracted_requests_total"},
         "counter", "Sequences preempted (retracted) and later recomputed.", (double)st->num_retractions},
        {{"rolloutd_requests_finished_total", "sglang:num_requests_total"}, "counter",
         "Generation requests finished (any finish reason).", (double)st->requests_finished},
        {{"rolloutd_requests_aborted_total", "sglang:num_aborted_requests_total"}, "counter",
         "Generation requests with at least one aborted output.", (double)st->requests_aborted},
        {{"rolloutd_engine_steps_total"}, "counter", "Forward steps run by the engine.", (double)st->steps},
        {{"process_resident_memory_bytes"}, "gauge", "Resident memory size in bytes.", in->rss_bytes},
        {{"process_start_time_seconds"}, "gauge", "Start time of the process since unix epoch in seconds.",
         in->start_time_s},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(fams); i++) {
        if (fams[i].value < 0) continue; /* unknown (no /proc) */
        scalar(&o, &fams[i]);
    }
    const rs_sync_stats *sy = in->sync;
    if (sy) {
        const family wf[] = {
            {{"rolloutd_weight_bytes"}, "gauge", "Resident bytes of the served weights (FP8: codes + block scales).",
             in->weight_bytes},
            {{"rolloutd_weight_spare_bytes"}, "gauge",
             "Memory of replaced weights kept for the next update's staging (weight-staging-keep).",
             in->weight_spare_bytes},
            {{"rolloutd_weight_staging_bytes"}, "gauge", "Bytes staged by the weight update in progress.",
             (double)sy->staged_bytes},
            {{"rolloutd_weight_shm_mapped_bytes"}, "gauge",
             "Shared-memory update segments kept mapped between requests (weight-shm-keep).",
             (double)sy->shm_mapped_bytes},
            {{"rolloutd_weight_update_in_progress"}, "gauge", "1 while a weight update transaction is open.",
             sy->txn_open ? 1 : 0},
            {{"rolloutd_weight_updates_total"}, "counter", "Weight updates committed.", (double)sy->updates},
            {{"rolloutd_weight_updates_failed_total"}, "counter",
             "Weight updates dropped (a refused bucket, a missing tensor at is_last, an idle timeout).",
             (double)sy->updates_failed},
            {{"rolloutd_weight_update_requests_total"}, "counter",
             "Weight-update requests handled (buckets, version changes, NCCL group operations).",
             (double)sy->requests},
            {{"rolloutd_weight_update_requests_failed_total"}, "counter", "Weight-update requests answered with an error.",
             (double)sy->requests_failed},
            {{"rolloutd_weight_update_received_bytes_total"}, "counter", "Tensor bytes received by weight updates.",
             (double)sy->bytes},
            {{"rolloutd_weight_update_tensors_total"}, "counter", "Tensors staged by weight updates.",
             (double)sy->tensors},
        };
        for (size_t i = 0; i < RS_ARRAY_LEN(wf); i++) scalar(&o, &wf[i]);
    }
    static const char *const ttft[MAX_NAMES] = {"rolloutd_time_to_first_token_seconds",
                                                "sglang:time_to_first_token_seconds",
                                                "vllm:time_to_first_token_seconds"};
    static const char *const itl[MAX_NAMES] = {"rolloutd_inter_token_latency_seconds",
                                               "sglang:inter_token_latency_seconds",
                                               "vllm:inter_token_latency_seconds"};
    static const char *const e2e[MAX_NAMES] = {"rolloutd_e2e_request_latency_seconds",
                                               "sglang:e2e_request_latency_seconds",
                                               "vllm:e2e_request_latency_seconds"};
    histogram(&o, ttft, "Time from a request's arrival to its first generated token.", &st->ttft);
    histogram(&o, itl, "Time between consecutive tokens of a sequence.", &st->itl);
    histogram(&o, e2e, "Time from a request's arrival to its finish.", &st->e2e);
    if (sy) {
        static const char *const upd[MAX_NAMES] = {"rolloutd_weight_update_seconds"};
        static const char *const hold[MAX_NAMES] = {"rolloutd_weight_update_pause_seconds"};
        histogram(&o, upd, "A committed weight update, from its first bucket to the commit.", &sy->update_seconds);
        histogram(&o, hold, "Time a commit held the engine's step loop (swap, retraction, KV recalibration).",
                  &sy->pause_seconds);
    }

    put(&o, "# HELP rolloutd_http_responses_total HTTP responses sent, by route and status.\n"
            "# TYPE rolloutd_http_responses_total counter\n");
    for (size_t i = 0; i < in->n_http; i++)
        put(&o, "rolloutd_http_responses_total{route=\"%s\",code=\"%d\"} %llu\n", in->http[i].route,
            in->http[i].code, (unsigned long long)in->http[i].count);
    put(&o, "# HELP rolloutd_build_info rolloutd version.\n# TYPE rolloutd_build_info gauge\n"
            "rolloutd_build_info{version=\"%s\"} 1\n", in->version);
    if (o.rc != RS_OK) {
        rs_buf_free(&o.b);
        return NULL;
    }
    *len = o.b.len;
    return o.b.data;
}
