/*
 * normalize.c — the normalizers `tokenizers` applies to each piece of text between added tokens:
 * NFC, NFD, NFKC, NFKD, Replace (every non-overlapping match of a pattern replaced by the content)
 * and Prepend (a prefix on non-empty text). A Sequence is the flat list in order.
 *
 * The Unicode forms are utf8proc's, restricted to what `tokenizers` knows: its normalization data
 * is Unicode 9.0, so a code point assigned later is to it an unassigned starter, which neither
 * decomposes, reorders nor composes. Such code points are copied through and the text between
 * them is normalized on its own; an inert starter blocks every interaction across it, and by
 * Unicode's stability policy utf8proc normalizes 9.0-only text as 9.0 did. (Lowercase is not
 * offered: `tokenizers` lowercases with Rust's Unicode 16.0 case tables, which no library here
 * has.)
 *
 * Only the normalized bytes are produced: rolloutd needs the ids, not offsets into the original.
 */
#include <stdlib.h>
#include <utf8proc.h>

#include "tok_internal.h"

static bool all_ascii(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80) return false;
    return true;
}

static void form_segment(int opt, const char *s, size_t n, rs_tok_buf *out) {
    if (n == 0) return;
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t m = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst, (utf8proc_option_t)opt);
    if (m < 0) { /* only on invalid UTF-8 or out of memory; the input was validated */
        RS_ERROR("tokenizer: utf8proc_map: %s", utf8proc_errmsg(m));
        abort();
    }
    rs_tok_buf_put(out, dst, (size_t)m);
    free(dst);
}

static void unicode_form(rs_tok_norm_kind k, const char *s, size_t n, rs_tok_buf *out) {
    if (all_ascii(s, n)) { /* every form leaves ASCII alone */
        rs_tok_buf_put(out, s, n);
        return;
    }
    int opt = UTF8PROC_STABLE;
    opt |= (k == RS_TOK_NORM_NFC || k == RS_TOK_NORM_NFKC) ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE;
    if (k == RS_TOK_NORM_NFKC || k == RS_TOK_NORM_NFKD) opt |= UTF8PROC_COMPAT;
    size_t seg = 0, i = 0;
    while (i < n) {
        size_t b = i;
        if ((unsigned char)s[i] < 0x80) {
            i++;
            continue;
        }
        if (!rs_uc_after_9(rs_utf8_next(s, &i))) continue;
        form_segment(opt, s + seg, b - seg, out);
        rs_tok_buf_put(out, s + b, i - b);
        seg = i;
    }
    form_segment(opt, s + seg, n - seg, out);
}

static int replace(const rs_tok_norm *nm, const char *s, size_t n, rs_tok_buf *out, rs_error *err) {
    rs_tok_spans sp = {0};
    int rc = rs_tok_regex_find(nm->re, s, n, &sp, err);
    if (rc == RS_OK)
        for (size_t i = 0; i < sp.n; i++) {
            if (sp.v[i].match) rs_tok_buf_put(out, nm->str, nm->str_len);
            else rs_tok_buf_put(out, s + sp.v[i].start, sp.v[i].end - sp.v[i].start);
        }
    free(sp.v);
    return rc;
}

int rs_tok_normalize(const rs_tok_norm *norms, size_t n, const char *s, size_t len, rs_tok_buf *out, rs_error *err) {
    rs_tok_buf a = {0}, b = {0};
    const char *cur = s;
    size_t cur_n = len;
    int rc = RS_OK;
    for (size_t k = 0; k < n; k++) {
        rs_tok_buf *dst = (cur == a.p && a.p) ? &b : &a;
        dst->n = 0;
        const rs_tok_norm *nm = &norms[k];
        switch (nm->kind) {
        case RS_TOK_NORM_NFC:
        case RS_TOK_NORM_NFD:
        case RS_TOK_NORM_NFKC:
        case RS_TOK_NORM_NFKD: unicode_form(nm->kind, cur, cur_n, dst); break;
        case RS_TOK_NORM_REPLACE:
            if ((rc = replace(nm, cur, cur_n, dst, err)) != RS_OK) goto done;
            break;
        case RS_TOK_NORM_PREPEND:
            if (cur_n) rs_tok_buf_put(dst, nm->str, nm->str_len);
            rs_tok_buf_put(dst, cur, cur_n);
            break;
        }
        rs_tok_buf_reserve(dst, 1); /* so that dst->p is set even for an empty result */
        cur = dst->p;
        cur_n = dst->n;
    }
    rs_tok_buf_put(out, cur, cur_n);
done:
    free(a.p);
    free(b.p);
    return rc;
}
