/*
 * moe_route.c — top-k routing and per-expert grouping for the MoE block (see moe_route.h).
 */
#include "moe_route.h"

#include <math.h>
#include <string.h>

void rs_moe_route_row(float *logits, int n, int k, bool norm, int32_t *sel_e, float *sel_w) {
    float max = logits[0], sum = 0.0f;
    for (int e = 1; e < n; e++) max = logits[e] > max ? logits[e] : max;
    for (int e = 0; e < n; e++) {
        logits[e] = expf(logits[e] - max);
        sum += logits[e];
    }
    for (int e = 0; e < n; e++) logits[e] = logits[e] / sum;

    for (int i = 0; i < k; i++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            bool taken = false;
            for (int m = 0; m < i; m++) taken |= sel_e[m] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        sel_e[i] = best;
        sel_w[i] = logits[best];
    }
    if (norm) {
        float s = 0.0f;
        for (int i = 0; i < k; i++) s += sel_w[i];
        for (int i = 0; i < k; i++) sel_w[i] = sel_w[i] / s;
    }
}

void rs_moe_group(const int32_t *sel_e, const float *sel_w, int n_rows, int k, int n_experts, int32_t *offsets,
                  int32_t *fill, int32_t *rows, float *wts) {
    const size_t n_sel = (size_t)n_rows * (size_t)k;
    memset(offsets, 0, ((size_t)n_experts + 1) * sizeof *offsets);
    for (size_t i = 0; i < n_sel; i++) offsets[sel_e[i] + 1]++;
    for (int e = 0; e < n_experts; e++) offsets[e + 1] += offsets[e];
    memcpy(fill, offsets, (size_t)n_experts * sizeof *fill);
    for (int r = 0; r < n_rows; r++) {
        for (int i = 0; i < k; i++) {
            int32_t at = fill[sel_e[(size_t)r * k + i]]++;
            rows[at] = r;
            wts[at] = sel_w[(size_t)r * k + i];
        }
    }
}
