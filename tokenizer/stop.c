/*
 * stop.c — stop strings on text that grows at its end (see tokenizer.h). Both functions look only
 * at the last (longest stop - 1) bytes before what is new, so a generation loop that calls them
 * after every delta does O(delta + stops) work per token.
 */
#include <string.h>

#include "tok_internal.h"

int rs_tok_stop_find(const char *const *stops, const size_t *stop_lens, int n_stops, const char *text, size_t len,
                     size_t scanned, size_t *pos) {
    int best = -1;
    size_t best_pos = 0;
    for (int i = 0; i < n_stops; i++) {
        size_t sl = stop_lens[i];
        if (sl == 0 || sl > len) continue;
        size_t from = scanned >= sl - 1 ? scanned - (sl - 1) : 0;
        if (from > len - sl) continue;
        const char *hit = memmem(text + from, len - from, stops[i], sl);
        if (!hit) continue;
        size_t at = (size_t)(hit - text);
        if (best < 0 || at < best_pos || (at == best_pos && sl > stop_lens[best])) best = i, best_pos = at;
    }
    if (best >= 0) *pos = best_pos;
    return best;
}

size_t rs_tok_stop_holdback(const char *const *stops, const size_t *stop_lens, int n_stops, const char *text,
                            size_t len) {
    size_t hold = 0;
    for (int i = 0; i < n_stops; i++) {
        size_t sl = stop_lens[i];
        for (size_t q = RS_MIN(sl ? sl - 1 : 0, len); q > hold; q--)
            if (memcmp(text + len - q, stops[i], q) == 0) {
                hold = q;
                break;
            }
    }
    return hold;
}
