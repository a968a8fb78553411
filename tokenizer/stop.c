/*
 * stop.c — stop strings and stop regexes on text that grows at its end (see tokenizer.h). The
 * string functions look only at the last (longest stop - 1) bytes before what is new, so a
 * generation loop that calls them after every delta does O(delta + stops) work per token.
 */
#include <string.h>

#include "tok_internal.h"

int rs_tok_stop_find(const char *const *stops, const size_t *stop_lens, int n_stops, const char *text, size_t len,
                     size_t scanned, size_t *pos) {
    for (int i = 0; i < n_stops; i++) {
        size_t sl = stop_lens[i];
        if (sl == 0 || sl > len) continue;
        size_t from = scanned >= sl - 1 ? scanned - (sl - 1) : 0;
        if (from > len - sl) continue;
        const char *hit = memmem(text + from, len - from, stops[i], sl);
        if (!hit) continue;
        *pos = (size_t)(hit - text);
        return i;
    }
    return -1;
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

/* ---- stop regular expressions ----
 * Incremental search with PCRE2_PARTIAL_SOFT: a complete match anywhere from *from is reported as
 * a plain search would report it; otherwise PCRE2 says whether some start position reached the end
 * of the text still matching (a partial match, the earliest such start in ovector[0]). Every start
 * before that one failed without looking at the end, so it fails whatever text follows, and the
 * next search begins there. Without a partial match no start up to len can ever match. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>

struct rs_tok_stop_re {
    char *pattern;
    pcre2_code *code;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
};

void rs_tok_stop_re_free(rs_tok_stop_re *re) {
    if (!re) return;
    pcre2_match_data_free(re->md);
    pcre2_match_context_free(re->mctx);
    pcre2_code_free(re->code);
    free(re->pattern);
    free(re);
}

int rs_tok_stop_re_compile(const char *pat, size_t len, const char *param, rs_tok_stop_re **out, rs_error *err) {
    *out = NULL;
    int ec;
    PCRE2_SIZE eo;
    /* \C (one byte, even inside a character) would let a match end inside a UTF-8 character, and the
     * text cut there would not be UTF-8: PCRE2_NEVER_BACKSLASH_C makes it a compile error */
    pcre2_code *code = pcre2_compile((PCRE2_SPTR)pat, len, PCRE2_UTF | PCRE2_UCP | PCRE2_NEVER_BACKSLASH_C, &ec, &eo,
                                     NULL);
    if (!code) {
        PCRE2_UCHAR msg[256];
        if (pcre2_get_error_message(ec, msg, sizeof msg) < 0) snprintf((char *)msg, sizeof msg, "error %d", ec);
        return rs_error_set(err, RS_EINVAL, param, "%s is not a valid regular expression: %s at offset %zu", param,
                            (const char *)msg, (size_t)eo);
    }
    rs_tok_stop_re *re = rs_xcalloc(1, sizeof *re);
    re->pattern = rs_xmalloc(len + 1);
    memcpy(re->pattern, pat, len);
    re->pattern[len] = '\0';
    re->code = code;
    re->md = pcre2_match_data_create_from_pattern(code, NULL);
    re->mctx = pcre2_match_context_create(NULL);
    if (!re->md || !re->mctx) RS_ASSERT(!"out of memory making PCRE2 match data");
    pcre2_set_match_limit(re->mctx, RS_TOK_STOP_RE_MATCH_LIMIT);
    *out = re;
    return RS_OK;
}

const char *rs_tok_stop_re_pattern(const rs_tok_stop_re *re) { return re->pattern; }

int rs_tok_stop_re_find(rs_tok_stop_re *re, const char *text, size_t len, size_t *from, size_t *ms, size_t *me) {
    if (*from > len) *from = len;
    int rc = pcre2_match(re->code, (PCRE2_SPTR)(text ? text : ""), len, *from, PCRE2_PARTIAL_SOFT,
                         re->md, re->mctx);
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(re->md);
    if (rc >= 0) {
        *ms = ov[0];
        *me = ov[1];
        return 1;
    }
    if (rc == PCRE2_ERROR_PARTIAL) {
        /* ovector[0] is the partial match's start; a lookbehind may have read before it, but a
         * later search still sees the whole text, so starting there loses nothing */
        if (ov[0] > *from) *from = ov[0];
        return 0;
    }
    if (rc == PCRE2_ERROR_NOMATCH) {
        *from = len;
        return 0;
    }
    if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT) return RS_ETOOBIG;
    return RS_EINTERNAL; /* text that is not UTF-8 (the caller's bug): PCRE2 checks what it reads */
}
