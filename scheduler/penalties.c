/*
 * penalties.c — output-token counts and the penalties over them (see penalties.h).
 *
 * The map is open addressing with linear probing over a power-of-two table kept at most half full,
 * so a lookup is a probe or two; it only grows (a sequence's output only grows).
 */
#include "penalties.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

bool rs_penalties_active(const rs_sampling_params *sp) {
    return sp->frequency_penalty != 0.0f || sp->presence_penalty != 0.0f || sp->repetition_penalty != 1.0f;
}

static int slot_of(const rs_penalty_counts *c, int32_t token) {
    uint32_t h = (uint32_t)token * 2654435761u; /* Knuth's multiplicative hash */
    int mask = c->cap - 1, i = (int)(h >> 7) & mask;
    while (c->ids[i] >= 0 && c->ids[i] != token) i = (i + 1) & mask;
    return i;
}

static void grow(rs_penalty_counts *c) {
    rs_penalty_counts old = *c;
    c->cap = old.cap ? old.cap * 2 : 16;
    c->ids = rs_xmalloc(sizeof(int32_t) * (size_t)c->cap);
    c->counts = rs_xmalloc(sizeof(int32_t) * (size_t)c->cap);
    for (int i = 0; i < c->cap; i++) c->ids[i] = -1;
    for (int i = 0; i < old.cap; i++) {
        if (old.ids[i] < 0) continue;
        int j = slot_of(c, old.ids[i]);
        c->ids[j] = old.ids[i];
        c->counts[j] = old.counts[i];
    }
    free(old.ids);
    free(old.counts);
}

void rs_penalty_counts_add(rs_penalty_counts *c, int32_t token) {
    RS_ASSERT(token >= 0);
    if (2 * (c->n + 1) > c->cap) grow(c);
    int i = slot_of(c, token);
    if (c->ids[i] < 0) {
        c->ids[i] = token;
        c->counts[i] = 0;
        c->n++;
    }
    c->counts[i]++;
}

int rs_penalty_count(const rs_penalty_counts *c, int32_t token) {
    if (c->cap == 0) return 0;
    int i = slot_of(c, token);
    return c->ids[i] == token ? c->counts[i] : 0;
}

void rs_penalty_counts_free(rs_penalty_counts *c) {
    free(c->ids);
    free(c->counts);
    *c = (rs_penalty_counts){0};
}

void rs_penalties_apply(const rs_sampling_params *sp, const rs_penalty_counts *c, float *logits) {
    const float r = sp->repetition_penalty, f = sp->frequency_penalty, p = sp->presence_penalty;
    for (int i = 0; i < c->cap; i++) {
        if (c->ids[i] < 0) continue;
        const float x0 = logits[c->ids[i]];
        float x = x0;
        if (r != 1.0f) x = x > 0.0f ? x / r : x * r;
        x -= f * (float)c->counts[i];
        x -= p;
        /* a tiny repetition penalty (1e-40) takes a finite logit past fp32's range: it saturates,
         * the token as far ahead (or behind) as a logit can put it, rather than turning +inf,
         * which the step treats as a broken row (the sampler works relative to the row's largest
         * logit, in double: FLT_MAX is as safe as any other value there) */
        if (isinf(x) && isfinite(x0)) x = copysignf(FLT_MAX, x);
        logits[c->ids[i]] = x;
    }
}
