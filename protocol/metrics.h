/*
 * metrics.h — GET /metrics: the Prometheus text exposition format (version 0.0.4).
 *
 * Every family has its # HELP and # TYPE lines; counters end in _total (the TYPE line names the
 * sample as exposed, as prometheus_client does); histograms have cumulative _bucket{le=...}
 * lines ending with le="+Inf", then _sum and _count. rolloutd_* names come first, then the same
 * values under the names SGLang and vLLM dashboards query (sglang:num_running_reqs,
 * vllm:kv_cache_usage_perc, vllm:time_to_first_token_seconds, ...). Sequence counts are
 * sequences (a request with n = 8 runs 8), as in both engines' schedulers.
 */
#ifndef RS_PROTOCOL_METRICS_H
#define RS_PROTOCOL_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "../scheduler/engine.h"
#include "../sync/sync.h"

typedef struct rs_metrics_http {
    const char *route;          /* "/generate" */
    int code;                   /* HTTP status */
    uint64_t count;             /* responses sent so far */
} rs_metrics_http;

typedef struct rs_metrics_input {
    const rs_engine_stats *stats;
    int http_in_flight;         /* generation requests admitted and not yet answered */
    const rs_metrics_http *http; /* [n_http] non-zero counters */
    size_t n_http;
    double rss_bytes;           /* resident set size; < 0 when unknown */
    double start_time_s;        /* unix seconds */
    const char *version;
    const rs_sync_stats *sync;  /* weight-update counters; NULL when no sync service runs */
    double weight_bytes;        /* resident bytes of the served weights */
    double weight_spare_bytes;  /* replaced weights kept for the next update's staging */
} rs_metrics_input;

/* New malloc'd text and *len, or NULL on OOM. */
char *rs_metrics_text(const rs_metrics_input *in, size_t *len);

#endif /* RS_PROTOCOL_METRICS_H */
