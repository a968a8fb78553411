/*
 * stream.c — incremental detokenization: the decoder chain of decode.c run as a transducer, so
 * each new id costs O(1) amortized and the concatenated output is exactly decode(all ids).
 *
 * The chain has three parts (load.c refuses chains that do not fit; see rs_tok_fuse_index):
 *   1. element stages before the join, on one token string at a time: Replace, Strip, Metaspace
 *      (which knows whether its element is the first it has seen), and ByteFallback, which holds
 *      a run of "<0xXX>" tokens until a non-byte token or the end, because the whole run decodes
 *      as one string or as one U+FFFD per byte depending on all of its bytes;
 *   2. the join: ByteLevel (bytes through a streaming from_utf8_lossy that holds an incomplete
 *      character, at most 3 bytes) or Fuse, or the implicit final join ("" with a decoder, " "
 *      without one);
 *   3. text stages after the join, on the one joined string as a stream of whole characters:
 *      Fuse (nothing to do), Metaspace, Strip (leading characters as they come; up to `stop`
 *      trailing `content` characters held until something else follows or the end) and Replace
 *      with a literal pattern (the longest suffix that could start a match held).
 * Nothing is held for any other reason, so text reaches the caller as soon as no later token can
 * change it.
 */
#include <stdlib.h>

#include "tok_internal.h"

typedef struct el_stage {  /* before the join */
    size_t count;          /* elements seen (Metaspace's "first element") */
    rs_tok_buf scratch;
    rs_tok_buf group;      /* ByteFallback: the bytes of the pending run */
    rs_tok_spans spans;    /* Replace */
} el_stage;

typedef struct tx_stage {  /* after the join */
    size_t lead;           /* Strip: leading characters stripped so far */
    bool past_lead;        /* Strip: a non-content character has been seen or lead == start */
    rs_tok_buf held;       /* Strip: trailing content characters; Replace: a possible match start */
    size_t held_chars;
    rs_tok_buf scratch;
} tx_stage;

struct rs_tok_stream {
    const rs_tok *t;
    bool skip_special;
    bool finished;
    size_t fuse;            /* index of the joining decoder, or n_decs */
    bool joined_any;        /* the implicit " " join: an element has been joined */
    unsigned char pend[4];  /* ByteLevel: incomplete character */
    size_t pend_n;
    el_stage el[RS_TOK_MAX_DEC];
    tx_stage tx[RS_TOK_MAX_DEC];
    rs_tok_buf joinbuf, lossy;
    rs_tok_buf out;
    rs_tok_stream *peek;    /* rs_tok_stream_peek_finish's copy, made on first use */
};

size_t rs_tok_fuse_index(const rs_tok *t) {
    for (size_t k = 0; k < t->n_decs; k++)
        if (t->decs[k].kind == RS_TOK_DEC_BYTELEVEL || t->decs[k].kind == RS_TOK_DEC_FUSE) return k;
    return t->n_decs;
}

rs_tok_stream *rs_tok_stream_new(const rs_tok *t, bool skip_special_tokens) {
    rs_tok_stream *s = rs_xcalloc(1, sizeof *s);
    s->t = t;
    s->skip_special = skip_special_tokens;
    s->fuse = rs_tok_fuse_index(t);
    return s;
}

void rs_tok_stream_free(rs_tok_stream *s) {
    if (!s) return;
    for (size_t k = 0; k < RS_TOK_MAX_DEC; k++) {
        free(s->el[k].scratch.p);
        free(s->el[k].group.p);
        free(s->el[k].spans.v);
        free(s->tx[k].held.p);
        free(s->tx[k].scratch.p);
    }
    free(s->joinbuf.p);
    free(s->lossy.p);
    free(s->out.p);
    rs_tok_stream_free(s->peek);
    free(s);
}

/* ---- after the join: a stream of whole characters ---- */

static void tx_put(rs_tok_stream *s, size_t k, const char *p, size_t n);

static void tx_strip(rs_tok_stream *s, size_t k, const char *p, size_t n) {
    const rs_tok_dec *d = &s->t->decs[k];
    tx_stage *st = &s->tx[k];
    st->scratch.n = 0;
    size_t i = 0;
    while (i < n) {
        size_t b = i;
        bool is_c = rs_utf8_next(p, &i) == d->ch;
        if (!st->past_lead) {
            if (is_c && st->lead < d->start) {
                st->lead++;
                if (st->lead == d->start) st->past_lead = true;
                continue;
            }
            st->past_lead = true;
        }
        if (d->stop == 0) {
            rs_tok_buf_put(&st->scratch, p + b, i - b);
        } else if (is_c) {
            rs_tok_buf_put(&st->held, p + b, i - b);
            if (++st->held_chars > d->stop) { /* the oldest held one can no longer be stripped */
                size_t j = 0;
                rs_utf8_next(st->held.p, &j);
                rs_tok_buf_put(&st->scratch, st->held.p, j);
                memmove(st->held.p, st->held.p + j, st->held.n - j);
                st->held.n -= j;
                st->held_chars--;
            }
        } else {
            rs_tok_buf_put(&st->scratch, st->held.p, st->held.n);
            st->held.n = 0, st->held_chars = 0;
            rs_tok_buf_put(&st->scratch, p + b, i - b);
        }
    }
    if (st->scratch.n) tx_put(s, k + 1, st->scratch.p, st->scratch.n);
}

static void tx_metaspace(rs_tok_stream *s, size_t k, const char *p, size_t n) {
    const rs_tok_dec *d = &s->t->decs[k];
    tx_stage *st = &s->tx[k];
    st->scratch.n = 0;
    for (size_t i = 0; i < n;) {
        size_t b = i;
        uint32_t cp = rs_utf8_next(p, &i);
        if (cp != d->ch) rs_tok_buf_put(&st->scratch, p + b, i - b);
        else if (d->prepend == RS_TOK_PREPEND_NEVER) rs_tok_buf_putc(&st->scratch, ' ');
    }
    if (st->scratch.n) tx_put(s, k + 1, st->scratch.p, st->scratch.n);
}

/* Literal Replace on the joined text: held = bytes not yet known to be outside a match. */
static void tx_replace(rs_tok_stream *s, size_t k, const char *p, size_t n, bool final) {
    const rs_tok_dec *d = &s->t->decs[k];
    const char *pat;
    size_t pl;
    rs_tok_regex_literal(d->re, &pat, &pl);
    tx_stage *st = &s->tx[k];
    rs_tok_buf_put(&st->held, p, n);
    st->scratch.n = 0;
    size_t i = 0, h = st->held.n;
    const char *x = st->held.p;
    for (;;) {
        const char *hit = h - i >= pl ? memmem(x + i, h - i, pat, pl) : NULL;
        if (!hit) break;
        size_t at = (size_t)(hit - x);
        rs_tok_buf_put(&st->scratch, x + i, at - i);
        rs_tok_buf_put(&st->scratch, d->str, d->str_len);
        i = at + pl;
    }
    size_t keep = 0;
    if (!final)
        for (size_t q = RS_MIN(pl - 1, h - i); q > 0; q--)
            if (memcmp(x + h - q, pat, q) == 0) {
                keep = q;
                break;
            }
    if (h) {
        rs_tok_buf_put(&st->scratch, x + i, h - i - keep);
        memmove(st->held.p, x + h - keep, keep);
    }
    st->held.n = keep;
    if (st->scratch.n) tx_put(s, k + 1, st->scratch.p, st->scratch.n);
}

static void tx_put(rs_tok_stream *s, size_t k, const char *p, size_t n) {
    if (k >= s->t->n_decs) {
        rs_tok_buf_put(&s->out, p, n);
        return;
    }
    switch (s->t->decs[k].kind) {
    case RS_TOK_DEC_STRIP: tx_strip(s, k, p, n); break;
    case RS_TOK_DEC_METASPACE: tx_metaspace(s, k, p, n); break;
    case RS_TOK_DEC_REPLACE: tx_replace(s, k, p, n, false); break;
    default: tx_put(s, k + 1, p, n); break; /* Fuse: already one string */
    }
}

/* The end of the output for the text stages from k on. */
static void tx_finish(rs_tok_stream *s, size_t k) {
    for (; k < s->t->n_decs; k++) {
        tx_stage *st = &s->tx[k];
        if (s->t->decs[k].kind == RS_TOK_DEC_REPLACE) {
            tx_replace(s, k, "", 0, true);
        } else if (s->t->decs[k].kind == RS_TOK_DEC_STRIP) {
            /* up to `stop` trailing content characters are what Strip removes: drop them */
            st->held.n = 0, st->held_chars = 0;
        }
    }
}

/* ---- the join ---- */

/* Streaming from_utf8_lossy: the bytes of one token after what is pending, into s->lossy; an
 * incomplete but valid character at the end stays pending (it may complete with the next token). */
static void join_bytes(rs_tok_stream *s, const char *b, size_t n) {
    rs_tok_buf *w = &s->joinbuf;
    w->n = 0;
    rs_tok_buf_put(w, s->pend, s->pend_n);
    rs_tok_buf_put(w, b, n);
    s->pend_n = 0;
    s->lossy.n = 0;
    const unsigned char *u = (const unsigned char *)w->p;
    size_t m = w->n, i = 0;
    while (i < m) {
        if (u[i] < 0x80) {
            size_t j = i;
            while (j < m && u[j] < 0x80) j++;
            rs_tok_buf_put(&s->lossy, u + i, j - i);
            i = j;
            continue;
        }
        size_t bad = 0, k = rs_utf8_lossy_step(u + i, m - i, &bad);
        if (k) {
            rs_tok_buf_put(&s->lossy, u + i, k);
            i += k;
        } else if (i + bad == m && rs_utf8_incomplete(u + i, bad)) {
            memcpy(s->pend, u + i, bad);
            s->pend_n = bad;
            i = m;
        } else {
            rs_tok_buf_put(&s->lossy, "\xEF\xBF\xBD", 3);
            i += bad;
        }
    }
}

static void join_element(rs_tok_stream *s, const char *p, size_t n) {
    const rs_tok *t = s->t;
    if (s->fuse < t->n_decs && t->decs[s->fuse].kind == RS_TOK_DEC_BYTELEVEL) {
        el_stage *st = &s->el[s->fuse];
        st->scratch.n = 0;
        rs_tok_bytelevel_bytes(p, n, &st->scratch);
        join_bytes(s, st->scratch.p, st->scratch.n);
        if (s->lossy.n) tx_put(s, s->fuse + 1, s->lossy.p, s->lossy.n);
        return;
    }
    if (s->fuse == t->n_decs && !t->has_decoder && s->joined_any) tx_put(s, s->fuse + 1, " ", 1);
    s->joined_any = true;
    if (n) tx_put(s, s->fuse + 1, p, n);
}

/* ---- before the join: one element at a time ---- */

static void el_put(rs_tok_stream *s, size_t k, const char *p, size_t n);

static void fallback_flush(rs_tok_stream *s, size_t k) {
    rs_tok_buf *g = &s->el[k].group; /* the stages after k never touch it */
    if (!g->n) return;
    if (rs_utf8_valid_prefix(g->p, g->n) == g->n) {
        el_put(s, k + 1, g->p, g->n);
    } else {
        for (size_t i = 0; i < g->n; i++) el_put(s, k + 1, "\xEF\xBF\xBD", 3);
    }
    g->n = 0;
}

static void el_put(rs_tok_stream *s, size_t k, const char *p, size_t n) {
    if (!p) p = ""; /* an empty piece from a stage's scratch that never held anything: the stages below offset p */
    if (k == s->fuse) {
        join_element(s, p, n);
        return;
    }
    const rs_tok_dec *d = &s->t->decs[k];
    el_stage *st = &s->el[k];
    size_t index = st->count++;
    switch (d->kind) {
    case RS_TOK_DEC_BYTEFALLBACK: {
        int b = rs_tok_fallback_byte(p, n);
        if (b >= 0) {
            rs_tok_buf_putc(&st->group, (char)b);
            return;
        }
        fallback_flush(s, k);
        el_put(s, k + 1, p, n);
        return;
    }
    case RS_TOK_DEC_STRIP: {
        size_t a, e;
        rs_tok_strip_token(d, p, n, &a, &e);
        el_put(s, k + 1, p + a, e - a);
        return;
    }
    case RS_TOK_DEC_METASPACE: {
        st->scratch.n = 0;
        for (size_t i = 0; i < n;) {
            size_t b = i;
            uint32_t cp = rs_utf8_next(p, &i);
            if (cp != d->ch) rs_tok_buf_put(&st->scratch, p + b, i - b);
            else if (!(index == 0 && d->prepend != RS_TOK_PREPEND_NEVER)) rs_tok_buf_putc(&st->scratch, ' ');
        }
        el_put(s, k + 1, st->scratch.p, st->scratch.n);
        return;
    }
    case RS_TOK_DEC_REPLACE: {
        rs_error err;
        st->scratch.n = 0;
        if (rs_tok_regex_find(d->re, p, n, &st->spans, &err) != RS_OK) { /* as decode: keep the token */
            el_put(s, k + 1, p, n);
            return;
        }
        for (size_t i = 0; i < st->spans.n; i++) {
            rs_tok_span sp = st->spans.v[i];
            if (sp.match) rs_tok_buf_put(&st->scratch, d->str, d->str_len);
            else rs_tok_buf_put(&st->scratch, p + sp.start, sp.end - sp.start);
        }
        el_put(s, k + 1, st->scratch.p, st->scratch.n);
        return;
    }
    default: RS_ASSERT(!"a joining decoder before the join");
    }
}

static size_t take(rs_tok_stream *s, const char **delta) {
    rs_tok_buf_putc(&s->out, '\0');
    s->out.n--;
    *delta = s->out.p;
    return s->out.n;
}

size_t rs_tok_stream_push(rs_tok_stream *s, int32_t id, const char **delta) {
    RS_ASSERT(!s->finished);
    const rs_tok *t = s->t;
    s->out.n = 0;
    if (id >= 0 && id < t->n_ids && t->id_str[id] && !(s->skip_special && t->id_special[id]))
        el_put(s, 0, t->id_str[id], t->id_len[id]);
    return take(s, delta);
}

size_t rs_tok_stream_finish(rs_tok_stream *s, const char **delta) {
    RS_ASSERT(!s->finished);
    s->finished = true;
    s->out.n = 0;
    for (size_t k = 0; k < s->fuse; k++)
        if (s->t->decs[k].kind == RS_TOK_DEC_BYTEFALLBACK) fallback_flush(s, k);
    if (s->pend_n) { /* an incomplete character at the end: one U+FFFD, as from_utf8_lossy */
        s->pend_n = 0;
        tx_put(s, s->fuse + 1, "\xEF\xBF\xBD", 3);
    }
    tx_finish(s, s->fuse + 1);
    return take(s, delta);
}

/* ---- what is held ---- */

static void buf_copy(rs_tok_buf *dst, const rs_tok_buf *src) {
    dst->n = 0;
    if (src->n) rs_tok_buf_put(dst, src->p, src->n);
}

size_t rs_tok_stream_held_bytes(const rs_tok_stream *s) {
    size_t n = s->pend_n;
    for (size_t k = 0; k < RS_TOK_MAX_DEC; k++) n += s->el[k].group.n + s->tx[k].held.n;
    return n;
}

size_t rs_tok_stream_peek_finish(rs_tok_stream *s, const char **text) {
    RS_ASSERT(!s->finished);
    if (rs_tok_stream_held_bytes(s) == 0) {
        *text = "";
        return 0;
    }
    if (!s->peek) s->peek = rs_tok_stream_new(s->t, s->skip_special);
    rs_tok_stream *c = s->peek; /* the state a later push or finish reads; scratch buffers are per call */
    c->finished = false;
    c->joined_any = s->joined_any;
    memcpy(c->pend, s->pend, sizeof c->pend);
    c->pend_n = s->pend_n;
    for (size_t k = 0; k < RS_TOK_MAX_DEC; k++) {
        c->el[k].count = s->el[k].count;
        buf_copy(&c->el[k].group, &s->el[k].group);
        c->tx[k].lead = s->tx[k].lead;
        c->tx[k].past_lead = s->tx[k].past_lead;
        buf_copy(&c->tx[k].held, &s->tx[k].held);
        c->tx[k].held_chars = s->tx[k].held_chars;
    }
    return rs_tok_stream_finish(c, text);
}

void rs_tok_stream_prime(rs_tok_stream *s, const int32_t *ids, size_t n) {
    const char *d;
    for (size_t i = 0; i < n; i++) (void)rs_tok_stream_push(s, ids[i], &d);
    s->pend_n = 0;
    for (size_t k = 0; k < RS_TOK_MAX_DEC; k++) {
        s->el[k].group.n = 0;
        s->tx[k].held.n = 0;
        s->tx[k].held_chars = 0;
    }
    s->out.n = 0;
}
