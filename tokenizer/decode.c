/*
 * decode.c — ids back to text, as `tokenizers`' Tokenizer::decode: each id becomes its token
 * string (an added token's content — its normalized form for a normalized one — else the model's;
 * unknown ids and, with skip_special_tokens, special tokens are left out), the decoder chain turns
 * the list of strings into another, and the result is joined ("" with a decoder, " " without).
 *
 *   ByteLevel     all tokens -> bytes (each character through the GPT-2 alphabet; a token with
 *                 any other character as its own UTF-8), then one String::from_utf8_lossy
 *   Replace       every match of the pattern in each token -> the content
 *   ByteFallback  runs of "<0xXX>" tokens -> their bytes as one string if valid UTF-8, else one
 *                 U+FFFD per byte token
 *   Fuse          all tokens -> one
 *   Strip         up to `start` leading and `stop` trailing `content` characters off each token
 *   Metaspace     the replacement -> ' ' (dropped in the first token unless prepend_scheme never)
 *
 * This is the reference form, list in, list out; stream.c produces the same text incrementally.
 */
#include <stdlib.h>

#include "tok_internal.h"

typedef struct slist {
    rs_tok_buf b;
    size_t *off, *len;
    size_t n, cap;
} slist;

static void sl_push(slist *l, const char *s, size_t n) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 16;
        l->off = rs_xrealloc(l->off, l->cap * sizeof *l->off);
        l->len = rs_xrealloc(l->len, l->cap * sizeof *l->len);
    }
    l->off[l->n] = l->b.n;
    l->len[l->n] = n;
    l->n++;
    rs_tok_buf_put(&l->b, s, n);
}

/* Starts a new element whose bytes the caller appends to l->b, then closes with sl_end. */
static void sl_begin(slist *l) { sl_push(l, NULL, 0); }
static void sl_end(slist *l) { l->len[l->n - 1] = l->b.n - l->off[l->n - 1]; }

static void sl_free(slist *l) {
    free(l->b.p);
    free(l->off);
    free(l->len);
    memset(l, 0, sizeof *l);
}

/* Piece i of a list; "" while the list's buffer is still unallocated (every piece empty). */
#define SL_AT(l, i) ((l)->b.p ? (l)->b.p + (l)->off[i] : "")

static int hex_digit(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

int rs_tok_fallback_byte(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    if (s[3] == '+') return hex_digit(s[4]); /* u8::from_str_radix takes a leading '+' */
    int hi = hex_digit(s[3]), lo = hex_digit(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

/* Appends the bytes ByteLevel's decoder takes from one token. */
void rs_tok_bytelevel_bytes(const char *s, size_t n, rs_tok_buf *out) {
    size_t mark = out->n, i = 0;
    while (i < n) {
        int b = rs_tok_char_byte(rs_utf8_next(s, &i));
        if (b < 0) { /* not all in the alphabet: the token's own bytes */
            out->n = mark;
            rs_tok_buf_put(out, s, n);
            return;
        }
        rs_tok_buf_putc(out, (char)b);
    }
}

static void flush_bytes(slist *out, rs_tok_buf *bytes) {
    if (!bytes->n) return;
    if (rs_utf8_valid_prefix(bytes->p, bytes->n) == bytes->n) {
        sl_push(out, bytes->p, bytes->n);
    } else {
        for (size_t k = 0; k < bytes->n; k++) sl_push(out, "\xEF\xBF\xBD", 3);
    }
    bytes->n = 0;
}

/* Strip of one token; where `tokenizers` would panic (more to strip than the token has) the
 * token is emptied. */
void rs_tok_strip_token(const rs_tok_dec *d, const char *s, size_t n, size_t *a, size_t *b) {
    size_t i = 0, k = 0, cut = 0;
    while (i < n && k < d->start) {
        size_t j = i;
        if (rs_utf8_next(s, &j) != d->ch) break;
        i = j, k++, cut = i;
    }
    size_t end = n;
    for (k = 0; k < d->stop && end > 0; k++) {
        size_t j = end - 1;
        while (j > 0 && ((unsigned char)s[j] & 0xC0) == 0x80) j--;
        size_t q = j;
        if (rs_utf8_next(s, &q) != d->ch) break;
        end = j;
    }
    if (cut > end) cut = end;
    *a = cut, *b = end;
}

static int apply(const rs_tok_dec *d, const slist *in, slist *out, rs_error *err) {
    rs_tok_spans sp = {0};
    int rc = RS_OK;
    switch (d->kind) {
    case RS_TOK_DEC_BYTELEVEL: {
        rs_tok_buf bytes = {0};
        for (size_t i = 0; i < in->n; i++) rs_tok_bytelevel_bytes(SL_AT(in, i), in->len[i], &bytes);
        sl_begin(out);
        rs_tok_buf_put_lossy(&out->b, bytes.p, bytes.n);
        sl_end(out);
        free(bytes.p);
        break;
    }
    case RS_TOK_DEC_REPLACE:
        for (size_t i = 0; i < in->n && rc == RS_OK; i++) {
            const char *s = SL_AT(in, i);
            if ((rc = rs_tok_regex_find(d->re, s, in->len[i], &sp, err)) != RS_OK) break;
            sl_begin(out);
            for (size_t k = 0; k < sp.n; k++) {
                if (sp.v[k].match) rs_tok_buf_put(&out->b, d->str, d->str_len);
                else rs_tok_buf_put(&out->b, s + sp.v[k].start, sp.v[k].end - sp.v[k].start);
            }
            sl_end(out);
        }
        break;
    case RS_TOK_DEC_BYTEFALLBACK: {
        rs_tok_buf bytes = {0};
        for (size_t i = 0; i < in->n; i++) {
            int b = rs_tok_fallback_byte(SL_AT(in, i), in->len[i]);
            if (b >= 0) {
                rs_tok_buf_putc(&bytes, (char)b);
                continue;
            }
            flush_bytes(out, &bytes);
            sl_push(out, SL_AT(in, i), in->len[i]);
        }
        flush_bytes(out, &bytes);
        free(bytes.p);
        break;
    }
    case RS_TOK_DEC_FUSE:
        sl_begin(out);
        for (size_t i = 0; i < in->n; i++) rs_tok_buf_put(&out->b, SL_AT(in, i), in->len[i]);
        sl_end(out);
        break;
    case RS_TOK_DEC_STRIP:
        for (size_t i = 0; i < in->n; i++) {
            size_t a, b;
            rs_tok_strip_token(d, SL_AT(in, i), in->len[i], &a, &b);
            sl_push(out, SL_AT(in, i) + a, b - a);
        }
        break;
    case RS_TOK_DEC_METASPACE:
        for (size_t i = 0; i < in->n; i++) {
            const char *s = SL_AT(in, i);
            sl_begin(out);
            for (size_t k = 0; k < in->len[i];) {
                size_t b = k;
                uint32_t cp = rs_utf8_next(s, &k);
                if (cp != d->ch) rs_tok_buf_put(&out->b, s + b, k - b);
                else if (!(i == 0 && d->prepend != RS_TOK_PREPEND_NEVER)) rs_tok_buf_putc(&out->b, ' ');
            }
            sl_end(out);
        }
        break;
    }
    free(sp.v);
    return rc;
}

char *rs_tok_decode(const rs_tok *t, const int32_t *ids, size_t n, bool skip_special_tokens, size_t *len) {
    slist a = {0}, b = {0};
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids || !t->id_str[id]) continue;
        if (skip_special_tokens && t->id_special[id]) continue;
        sl_push(&a, t->id_str[id], t->id_len[id]);
    }
    slist *cur = &a, *nxt = &b;
    for (size_t k = 0; k < t->n_decs; k++) {
        nxt->n = 0, nxt->b.n = 0;
        rs_error err;
        if (apply(&t->decs[k], cur, nxt, &err) != RS_OK) {
            /* only a Replace pattern that exceeds the match limit on a token: keep the tokens */
            RS_WARN("tokenizer: decoder %zu skipped: %s", k, err.message);
            continue;
        }
        slist *tmp = cur;
        cur = nxt, nxt = tmp;
    }
    rs_tok_buf out = {0};
    for (size_t i = 0; i < cur->n; i++) {
        if (i && !t->has_decoder) rs_tok_buf_putc(&out, ' ');
        rs_tok_buf_put(&out, SL_AT(cur, i), cur->len[i]);
    }
    rs_tok_buf_putc(&out, '\0');
    if (len) *len = out.n - 1;
    sl_free(&a);
    sl_free(&b);
    return out.p;
}

char *rs_tok_token_text(const rs_tok *t, int32_t id, size_t *len) { return rs_tok_decode(t, &id, 1, false, len); }
