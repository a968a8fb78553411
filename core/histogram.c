/*
 * histogram.c — the bucket table and the observation (see histogram.h).
 */
#include "histogram.h"

#include <math.h>

const double rs_hist_bounds[RS_HIST_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                0.25,  0.5,    1.0,   2.5,  5.0,   10.0, INFINITY};

void rs_histogram_observe(rs_histogram *h, double seconds) {
    int i = 0;
    while (i < RS_HIST_BUCKETS - 1 && seconds > rs_hist_bounds[i]) i++;
    h->counts[i]++;
    h->n++;
    h->sum += seconds;
}
