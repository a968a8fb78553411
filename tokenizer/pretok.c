/*
 * pretok.c — pre-tokenizers: how a normalized piece of text is cut into the words the BPE model
 * sees, as `tokenizers` does it.
 *
 *   Split      find_matches of the pattern (regex.c), then the delimiter behavior: Removed,
 *              Isolated, MergedWithPrevious, MergedWithNext, Contiguous; invert flips matches.
 *   ByteLevel  a leading space on each piece that lacks one (add_prefix_space), then the GPT-2
 *              pattern split (use_regex); the byte-to-alphabet mapping itself is left to the model,
 *              which looks words up by their raw bytes (bpe.c).
 *   Digits     split on char::is_numeric, each digit alone (individual_digits) or runs together.
 *   Metaspace  ' ' -> the replacement, the replacement prepended per prepend_scheme ("first": only
 *              on the piece that starts the input), then a MergedWithNext split on it (split).
 *   Sequence   is the flat list: each level's pieces go through the next level, in order.
 *
 * Pieces are processed depth first: a piece is split, and each sub-piece runs through the next
 * pre-tokenizers and the model before the following sub-piece. Since every pre-tokenizer acts on
 * one piece at a time, this yields the same words in the same order as `tokenizers`' level by
 * level splitting, with memory bounded by one piece.
 */
#include <stdlib.h>

#include "tok_internal.h"

void rs_tok_split_apply(rs_tok_spans *s, rs_tok_split_behavior behavior, bool invert) {
    if (invert)
        for (size_t i = 0; i < s->n; i++) s->v[i].match = !s->v[i].match;
    size_t n = s->n, k = 0;
    bool prev = false;
    rs_tok_span *v = s->v;
    switch (behavior) {
    case RS_TOK_SPLIT_REMOVED: return;
    case RS_TOK_SPLIT_ISOLATED:
        for (size_t i = 0; i < n; i++) v[i].match = false;
        return;
    case RS_TOK_SPLIT_CONTIGUOUS:
        for (size_t i = 0; i < n; i++) {
            bool m = v[i].match;
            if (m == prev && k > 0) v[k - 1].end = v[i].end;
            else v[k++] = (rs_tok_span){v[i].start, v[i].end, false};
            prev = m;
        }
        break;
    case RS_TOK_SPLIT_MERGED_WITH_PREVIOUS:
        for (size_t i = 0; i < n; i++) {
            bool m = v[i].match;
            if (m && !prev && k > 0) v[k - 1].end = v[i].end;
            else v[k++] = (rs_tok_span){v[i].start, v[i].end, false};
            prev = m;
        }
        break;
    case RS_TOK_SPLIT_MERGED_WITH_NEXT: {
        /* folded from the end; written from the end of the array, then moved to the front */
        size_t w = n;
        for (size_t i = n; i-- > 0;) {
            bool m = v[i].match;
            rs_tok_span cur = v[i];
            if (m && !prev && w < n) v[w].start = cur.start;
            else v[--w] = (rs_tok_span){cur.start, cur.end, false};
            prev = m;
        }
        memmove(v, v + w, (n - w) * sizeof *v);
        k = n - w;
        break;
    }
    }
    s->n = k;
}

/* Pattern::find_matches for a character predicate: each matching character is its own match. */
typedef bool (*char_pred)(uint32_t cp, const rs_tok_pretok *p);

static bool pred_numeric(uint32_t cp, const rs_tok_pretok *p) {
    (void)p;
    return rs_uc_is_numeric(cp);
}

static bool pred_replacement(uint32_t cp, const rs_tok_pretok *p) {
    size_t i = 0;
    return cp == rs_utf8_next(p->rep, &i);
}

static void find_chars(const char *s, size_t n, char_pred pred, const rs_tok_pretok *p, rs_tok_spans *out) {
    out->n = 0;
    if (n == 0) {
        rs_tok_spans_push(out, 0, 0, false);
        return;
    }
    size_t last = 0, i = 0;
    while (i < n) {
        size_t b = i;
        uint32_t cp = rs_utf8_next(s, &i);
        if (pred(cp, p)) {
            if (last < b) rs_tok_spans_push(out, last, b, false);
            rs_tok_spans_push(out, b, i, true);
            last = i;
        }
    }
    if (n > last) rs_tok_spans_push(out, last, n, false);
}

/* Runs the next level on every kept, non-empty span of level `level` over work[off, ...). */
static int run_spans(rs_tok_enc *e, size_t level, size_t off, bool at_start) {
    rs_tok_spans *sp = &e->spans[level];
    for (size_t i = 0; i < sp->n; i++) {
        rs_tok_span s = sp->v[i];
        if (s.match || s.end == s.start) continue;
        int rc = rs_tok_pretok_run(e, level + 1, off + s.start, s.end - s.start, at_start && s.start == 0);
        if (rc != RS_OK) return rc;
    }
    return RS_OK;
}

/* Metaspace: ' ' -> replacement and the prepended replacement, written at the end of work. */
static size_t metaspace_rewrite(rs_tok_enc *e, const rs_tok_pretok *p, size_t off, size_t len, bool at_start,
                                size_t *new_len) {
    size_t start = e->work.n;
    rs_tok_buf_reserve(&e->work, len * (size_t)p->rep_len + (size_t)p->rep_len);
    const char *s = e->work.p + off;
    /* `tokenizers` checks after replacing ' ': the text starts with the replacement when it
     * started with a space or with the replacement itself */
    bool starts = len > 0 && (s[0] == ' ' || (len >= (size_t)p->rep_len && memcmp(s, p->rep, (size_t)p->rep_len) == 0));
    bool prepend = !starts && (p->prepend == RS_TOK_PREPEND_ALWAYS || (p->prepend == RS_TOK_PREPEND_FIRST && at_start));
    if (prepend) rs_tok_buf_put(&e->work, p->rep, (size_t)p->rep_len);
    for (size_t i = 0; i < len; i++) {
        char c = e->work.p[off + i];
        if (c == ' ') rs_tok_buf_put(&e->work, p->rep, (size_t)p->rep_len);
        else rs_tok_buf_putc(&e->work, c);
    }
    *new_len = e->work.n - start;
    return start;
}

int rs_tok_pretok_run(rs_tok_enc *e, size_t level, size_t off, size_t len, bool at_start) {
    const rs_tok *t = e->t;
    if (len == 0) return RS_OK;
    if (level == t->n_pretoks) {
        rs_tok_bpe_encode(&t->bpe, e->work.p + off, len, e->out);
        return RS_OK;
    }
    const rs_tok_pretok *p = &t->pretoks[level];
    rs_tok_spans *sp = &e->spans[level];
    size_t mark = e->work.n;
    int rc = RS_OK;
    switch (p->kind) {
    case RS_TOK_PRE_SPLIT:
        if ((rc = rs_tok_regex_find(p->re, e->work.p + off, len, sp, e->err)) != RS_OK) return rc;
        rs_tok_split_apply(sp, p->behavior, p->invert);
        rc = run_spans(e, level, off, at_start);
        break;
    case RS_TOK_PRE_BYTELEVEL:
        if (p->add_prefix_space && e->work.p[off] != ' ') {
            size_t start = e->work.n;
            rs_tok_buf_reserve(&e->work, len + 1);
            rs_tok_buf_putc(&e->work, ' ');
            rs_tok_buf_put(&e->work, e->work.p + off, len);
            off = start, len += 1;
        }
        if (p->re) {
            if ((rc = rs_tok_regex_find(p->re, e->work.p + off, len, sp, e->err)) != RS_OK) break;
            rs_tok_split_apply(sp, RS_TOK_SPLIT_ISOLATED, false);
            rc = run_spans(e, level, off, at_start);
        } else {
            rc = rs_tok_pretok_run(e, level + 1, off, len, at_start);
        }
        break;
    case RS_TOK_PRE_DIGITS:
        find_chars(e->work.p + off, len, pred_numeric, p, sp);
        rs_tok_split_apply(sp, p->individual_digits ? RS_TOK_SPLIT_ISOLATED : RS_TOK_SPLIT_CONTIGUOUS, false);
        rc = run_spans(e, level, off, at_start);
        break;
    case RS_TOK_PRE_METASPACE: {
        size_t n2;
        size_t off2 = metaspace_rewrite(e, p, off, len, at_start, &n2);
        if (p->split) {
            find_chars(e->work.p + off2, n2, pred_replacement, p, sp);
            rs_tok_split_apply(sp, RS_TOK_SPLIT_MERGED_WITH_NEXT, false);
            rc = run_spans(e, level, off2, at_start);
        } else {
            rc = rs_tok_pretok_run(e, level + 1, off2, n2, at_start);
        }
        break;
    }
    }
    e->work.n = mark; /* what this level wrote is no longer referenced */
    return rc;
}
