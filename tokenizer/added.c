/*
 * added.c — added tokens found in text before the model sees it, as `tokenizers`'
 * AddedVocabulary::find_matches does it.
 *
 * Two tries hold the contents: one of tokens with normalized = false, matched against the raw
 * input, and one of the others (by their normalized form), matched against each normalized piece
 * in between. Matches are leftmost-longest and non-overlapping (daachorse's LeftmostLongest);
 * a match is then discarded when encode_special_tokens (tokenizer_config's split_special_tokens)
 * applies to it or when a single_word token touches a word character (Rust regex \w) on either
 * side; the search goes on after a discarded match, not inside it. lstrip widens a match over the
 * whitespace before it (not into the previous match), rstrip over the whitespace after it.
 */
#include <stdlib.h>

#include "tok_internal.h"

void rs_tok_trie_free(rs_tok_trie *t) {
    free(t->child);
    free(t->next);
    free(t->byte);
    free(t->tok);
    memset(t, 0, sizeof *t);
}

static int32_t trie_node(rs_tok_trie *t, uint8_t b) {
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 256;
        t->child = rs_xrealloc(t->child, t->cap * sizeof *t->child);
        t->next = rs_xrealloc(t->next, t->cap * sizeof *t->next);
        t->byte = rs_xrealloc(t->byte, t->cap * sizeof *t->byte);
        t->tok = rs_xrealloc(t->tok, t->cap * sizeof *t->tok);
    }
    int32_t i = (int32_t)t->n++;
    t->child[i] = -1, t->next[i] = -1, t->byte[i] = b, t->tok[i] = -1;
    return i;
}

static int32_t trie_step(const rs_tok_trie *t, int32_t node, uint8_t b) {
    for (int32_t c = t->child[node]; c >= 0; c = t->next[c])
        if (t->byte[c] == b) return c;
    return -1;
}

int rs_tok_trie_add(rs_tok_trie *t, const char *s, size_t n, int32_t tok) {
    RS_ASSERT(n > 0);
    if (t->n == 0) trie_node(t, 0); /* the root */
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)s[i];
        int32_t c = trie_step(t, node, b);
        if (c < 0) {
            c = trie_node(t, b);
            t->next[c] = t->child[node];
            t->child[node] = c;
        }
        node = c;
    }
    if (t->tok[node] >= 0) return RS_EFORMAT; /* the same pattern twice */
    t->tok[node] = tok;
    t->first[(uint8_t)s[0] >> 3] |= (uint8_t)(1u << ((uint8_t)s[0] & 7));
    return RS_OK;
}

/* The longest pattern starting at s[i]: its end (> i) and token, or 0. */
static size_t trie_longest(const rs_tok_trie *t, const char *s, size_t n, size_t i, int32_t *tok) {
    int32_t node = 0;
    size_t end = 0;
    for (size_t k = i; k < n; k++) {
        node = trie_step(t, node, (uint8_t)s[k]);
        if (node < 0) break;
        if (t->tok[node] >= 0) end = k + 1, *tok = t->tok[node];
    }
    return end;
}

/* Rust regex \w$ on s[0,n): the last character is a word character. */
static bool ends_with_word(const char *s, size_t n) {
    if (n == 0) return false;
    size_t i = n - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
    return rs_uc_is_word(rs_utf8_next(s, &i));
}

static bool starts_with_word(const char *s, size_t n) {
    size_t i = 0;
    return n > 0 && rs_uc_is_word(rs_utf8_next(s, &i));
}

/* Start of the whitespace run that ends s[0,n) (the \s*$ match). */
static size_t space_run_before(const char *s, size_t n) {
    size_t i = n;
    while (i > 0) {
        size_t j = i - 1;
        while (j > 0 && ((unsigned char)s[j] & 0xC0) == 0x80) j--;
        size_t k = j;
        if (!rs_uc_is_space(rs_utf8_next(s, &k))) break;
        i = j;
    }
    return i;
}

/* Length of the whitespace run that starts s[0,n) (the ^\s* match). */
static size_t space_run_after(const char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        size_t k = i;
        if (!rs_uc_is_space(rs_utf8_next(s, &k))) break;
        i = k;
    }
    return i;
}

static void piece_push(rs_tok_pieces *p, size_t off, size_t len, int32_t id, bool at_start) {
    if (p->n == p->cap) {
        p->cap = p->cap ? 2 * p->cap : 16;
        p->v = rs_xrealloc(p->v, p->cap * sizeof *p->v);
    }
    p->v[p->n++] = (rs_tok_piece){off, len, id, at_start};
}

void rs_tok_added_split(const rs_tok *t, const rs_tok_trie *trie, const char *s, size_t n, size_t base_off,
                        bool at_start, rs_tok_pieces *out) {
    if (n == 0) return;
    if (trie->n == 0) {
        piece_push(out, base_off, n, -1, at_start);
        return;
    }
    size_t start_offset = 0, i = 0;
    while (i < n) {
        uint8_t b = (uint8_t)s[i];
        int32_t tok = -1;
        size_t end = (trie->first[b >> 3] & (1u << (b & 7))) ? trie_longest(trie, s, n, i, &tok) : 0;
        if (!end) {
            i++;
            continue;
        }
        size_t start = i, stop = end;
        i = end;
        const rs_tok_added *a = &t->added[tok];
        if (t->encode_special_tokens && a->special) continue;
        if (a->single_word) {
            bool start_space = start == 0 || !ends_with_word(s, start);
            bool stop_space = stop == n || !starts_with_word(s + stop, n - stop);
            if (!start_space || !stop_space) continue;
        }
        if (a->lstrip) start = RS_MAX(space_run_before(s, start), start_offset);
        if (a->rstrip) stop += space_run_after(s + stop, n - stop);
        if (start_offset < start) piece_push(out, base_off + start_offset, start - start_offset, -1, at_start && start_offset == 0);
        piece_push(out, base_off + start, stop - start, a->id, at_start && start == 0);
        start_offset = stop;
    }
    if (start_offset != n) piece_push(out, base_off + start_offset, n - start_offset, -1, at_start && start_offset == 0);
}
