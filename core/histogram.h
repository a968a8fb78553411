/*
 * histogram.h — latency histograms with fixed Prometheus "le" buckets.
 *
 * The engine times requests (time to first token, inter-token latency, end to end), sync times
 * weight updates and the pause each commit holds the step loop for, and protocol/metrics.c
 * renders them all as Prometheus histograms. One bucket table serves every one of them, so
 * /metrics lines up across families. Not thread-safe by itself: each owner updates its own under
 * its own lock and publishes copies.
 */
#ifndef RS_HISTOGRAM_H
#define RS_HISTOGRAM_H

#include <stdint.h>

#define RS_HIST_BUCKETS 14
extern const double rs_hist_bounds[RS_HIST_BUCKETS]; /* seconds, ascending; the last is +Inf */

typedef struct rs_histogram {
    uint64_t counts[RS_HIST_BUCKETS]; /* non-cumulative: counts[i] holds bounds[i-1] < x <= bounds[i] */
    uint64_t n;
    double sum;
} rs_histogram;

void rs_histogram_observe(rs_histogram *h, double seconds);

#endif /* RS_HISTOGRAM_H */
