/*
 * regex.c — `tokenizers`' split and replace patterns on PCRE2.
 *
 * tokenizer.json patterns are written for Oniguruma with its Ruby syntax (the onig crate's
 * default). PCRE2 (8-bit, PCRE2_UTF | PCRE2_UCP, JIT when available) reads almost all of that the
 * same way; the differences that matter are rewritten before compiling, and the rest is refused:
 *   - \p{..}, \P{..}, \p{^..} (general categories, short or long names, case-insensitive as onig
 *     takes them), \s \S (White_Space), \d \D (Nd) and \h \H (Ruby: hex digits, PCRE2: horizontal
 *     space) become explicit code point ranges from our Unicode 16.0 table, so a character
 *     assigned after PCRE2's own tables (Unicode 14 in Debian 12) still splits as in `tokenizers`;
 *   - \uHHHH becomes \x{HHHH}; \v (Ruby: U+000B only; PCRE2: any vertical space) \x{0B}; {,n}
 *     becomes {0,n}; the Ruby option m (dot matches newline) is PCRE2's s; ^ and $ are line anchors
 *     (PCRE2_MULTILINE; ^ does not match after a final newline, in either engine);
 *   - a set that is empty in our table (\p{Cs}: surrogates never occur in UTF-8 text) stays an
 *     empty class (PCRE2_ALLOW_EMPTY_CLASS), so a ']' written first in a class is escaped;
 *   - refused (RS_EUNSUPPORTED): \w \W \b \B \X \Q and POSIX brackets (their Unicode sets differ
 *     between the engines and are not in our table), nested classes and && (onig only), script
 *     names in \p{..}, the x option, and property escapes under (?i).
 * Matches are iterated as the onig crate's FindMatches does: after a non-empty match, the next
 * empty match is skipped and the search moves one character on.
 *
 * Each thread matching keeps its own pcre2 match data, match context and JIT stack (a pthread
 * key, freed when the thread exits), so a compiled pattern is shared read-only.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <ctype.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>

#include "tok_internal.h"

#define RE_MATCH_LIMIT 50000000u /* backtracking steps per match before giving up */

struct rs_tok_regex {
    bool literal;
    char *lit;          /* literal bytes */
    size_t lit_len;
    pcre2_code *code;
    bool jit;
};

void rs_tok_spans_push(rs_tok_spans *s, size_t start, size_t end, bool match) {
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 32;
        s->v = rs_xrealloc(s->v, s->cap * sizeof *s->v);
    }
    s->v[s->n++] = (rs_tok_span){(uint32_t)start, (uint32_t)end, match};
}

/* ---- sets of code points ---- */

typedef struct cp_set {
    uint32_t (*r)[2]; /* [n][lo, hi] sorted, disjoint, no surrogates */
    size_t n, cap;
} cp_set;

static void set_add(cp_set *s, uint32_t lo, uint32_t hi) {
    /* drop surrogates: PCRE2 refuses them in UTF mode */
    if (lo <= 0xDFFF && hi >= 0xD800) {
        if (lo < 0xD800) set_add(s, lo, 0xD7FF);
        if (hi > 0xDFFF) set_add(s, 0xE000, hi);
        return;
    }
    if (s->n && s->r[s->n - 1][1] + 1 == lo) {
        s->r[s->n - 1][1] = hi;
        return;
    }
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->r = rs_xrealloc(s->r, s->cap * sizeof *s->r);
    }
    s->r[s->n][0] = lo, s->r[s->n][1] = hi;
    s->n++;
}

static void set_from_mask(cp_set *s, uint32_t mask) {
    uint32_t next = 0;
    for (size_t i = 0; i < rs_uc_n_ranges; i++) {
        const rs_uc_range *r = &rs_uc_ranges[i];
        if (r->lo > next && (mask & RS_UC_BIT(RS_UC_Cn))) set_add(s, next, r->lo - 1);
        if (mask & RS_UC_BIT(r->cat)) set_add(s, r->lo, r->hi);
        next = r->hi + 1;
    }
    if (next <= 0x10FFFF && (mask & RS_UC_BIT(RS_UC_Cn))) set_add(s, next, 0x10FFFF);
}

static void set_complement(const cp_set *in, cp_set *out) {
    uint32_t next = 0;
    for (size_t i = 0; i < in->n; i++) {
        if (in->r[i][0] > next) set_add(out, next, in->r[i][0] - 1);
        next = in->r[i][1] + 1;
    }
    if (next <= 0x10FFFF) set_add(out, next, 0x10FFFF);
}

static void emit_set(rs_tok_buf *b, const cp_set *s) {
    char tmp[48];
    for (size_t i = 0; i < s->n; i++) {
        int k = s->r[i][0] == s->r[i][1] ? snprintf(tmp, sizeof tmp, "\\x{%X}", s->r[i][0])
                                         : snprintf(tmp, sizeof tmp, "\\x{%X}-\\x{%X}", s->r[i][0], s->r[i][1]);
        rs_tok_buf_put(b, tmp, (size_t)k);
    }
}

/* General category names as Oniguruma accepts them (compared ignoring case, spaces, '_', '-'). */
static const struct {
    const char *name;
    uint32_t mask;
} cat_names[] = {
#define C(x) RS_UC_BIT(RS_UC_##x)
    {"l", RS_UC_MASK_L}, {"letter", RS_UC_MASK_L},
    {"lu", C(Lu)}, {"uppercaseletter", C(Lu)}, {"ll", C(Ll)}, {"lowercaseletter", C(Ll)},
    {"lt", C(Lt)}, {"titlecaseletter", C(Lt)}, {"lm", C(Lm)}, {"modifierletter", C(Lm)},
    {"lo", C(Lo)}, {"otherletter", C(Lo)}, {"lc", C(Lu) | C(Ll) | C(Lt)}, {"casedletter", C(Lu) | C(Ll) | C(Lt)},
    {"l&", C(Lu) | C(Ll) | C(Lt)},
    {"m", RS_UC_MASK_M}, {"mark", RS_UC_MASK_M}, {"combiningmark", RS_UC_MASK_M},
    {"mn", C(Mn)}, {"nonspacingmark", C(Mn)}, {"mc", C(Mc)}, {"spacingmark", C(Mc)},
    {"me", C(Me)}, {"enclosingmark", C(Me)},
    {"n", RS_UC_MASK_N}, {"number", RS_UC_MASK_N},
    {"nd", C(Nd)}, {"decimalnumber", C(Nd)}, {"digit", C(Nd)}, {"nl", C(Nl)}, {"letternumber", C(Nl)},
    {"no", C(No)}, {"othernumber", C(No)},
    {"p", C(Pc) | C(Pd) | C(Ps) | C(Pe) | C(Pi) | C(Pf) | C(Po)},
    {"punctuation", C(Pc) | C(Pd) | C(Ps) | C(Pe) | C(Pi) | C(Pf) | C(Po)},
    {"pc", C(Pc)}, {"connectorpunctuation", C(Pc)}, {"pd", C(Pd)}, {"dashpunctuation", C(Pd)},
    {"ps", C(Ps)}, {"openpunctuation", C(Ps)}, {"pe", C(Pe)}, {"closepunctuation", C(Pe)},
    {"pi", C(Pi)}, {"initialpunctuation", C(Pi)}, {"pf", C(Pf)}, {"finalpunctuation", C(Pf)},
    {"po", C(Po)}, {"otherpunctuation", C(Po)},
    {"s", C(Sm) | C(Sc) | C(Sk) | C(So)}, {"symbol", C(Sm) | C(Sc) | C(Sk) | C(So)},
    {"sm", C(Sm)}, {"mathsymbol", C(Sm)}, {"sc", C(Sc)}, {"currencysymbol", C(Sc)},
    {"sk", C(Sk)}, {"modifiersymbol", C(Sk)}, {"so", C(So)}, {"othersymbol", C(So)},
    {"z", C(Zs) | C(Zl) | C(Zp)}, {"separator", C(Zs) | C(Zl) | C(Zp)},
    {"zs", C(Zs)}, {"spaceseparator", C(Zs)}, {"zl", C(Zl)}, {"lineseparator", C(Zl)},
    {"zp", C(Zp)}, {"paragraphseparator", C(Zp)},
    {"c", C(Cc) | C(Cf) | C(Cs) | C(Co) | C(Cn)}, {"other", C(Cc) | C(Cf) | C(Cs) | C(Co) | C(Cn)},
    {"cc", C(Cc)}, {"control", C(Cc)}, {"cf", C(Cf)}, {"format", C(Cf)}, {"cs", C(Cs)}, {"surrogate", C(Cs)},
    {"co", C(Co)}, {"privateuse", C(Co)}, {"cn", C(Cn)}, {"unassigned", C(Cn)},
    {"any", 0xFFFFFFFFu},
#undef C
};

static bool cat_lookup(const char *name, size_t n, uint32_t *mask) {
    char norm[64];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (c == ' ' || c == '_' || c == '-') continue;
        if (k + 1 >= sizeof norm) return false;
        norm[k++] = (char)tolower((unsigned char)c);
    }
    norm[k] = '\0';
    for (size_t i = 0; i < RS_ARRAY_LEN(cat_names); i++)
        if (strcmp(norm, cat_names[i].name) == 0) {
            *mask = cat_names[i].mask;
            return true;
        }
    return false;
}

/* The set of an escape letter (s, d, h) or a category mask. */
static void escape_set(char e, uint32_t mask, cp_set *s) {
    switch (e) {
    case 's':
        set_add(s, 0x09, 0x0D), set_add(s, 0x20, 0x20), set_add(s, 0x85, 0x85), set_add(s, 0xA0, 0xA0);
        set_add(s, 0x1680, 0x1680), set_add(s, 0x2000, 0x200A), set_add(s, 0x2028, 0x2029);
        set_add(s, 0x202F, 0x202F), set_add(s, 0x205F, 0x205F), set_add(s, 0x3000, 0x3000);
        break;
    case 'h': set_add(s, '0', '9'), set_add(s, 'A', 'F'), set_add(s, 'a', 'f'); break;
    case 'd': set_from_mask(s, RS_UC_BIT(RS_UC_Nd)); break;
    default: set_from_mask(s, mask); break;
    }
}

typedef struct tr_state {
    const char *p;
    size_t n, i;
    const char *key;
    rs_error *err;
    rs_tok_buf out;
    bool in_class;
    bool caseless;
    bool stack[256]; /* caseless at each open group */
    int depth;
} tr_state;

static int tr_fail(tr_state *st, int code, const char *what) {
    return rs_error_set(st->err, code, st->key, "%s: pattern %.*s%s: %s", st->key, (int)RS_MIN(st->n, 120), st->p,
                        st->n > 120 ? "..." : "", what);
}

/* Emits the set for \<e> (e in sSdDhHpP) at st->i (just past the escape letter, or the '}'). */
static int tr_set(tr_state *st, char e, bool negate, uint32_t mask) {
    if (st->caseless && (e == 'p' || e == 'P'))
        return tr_fail(st, RS_EUNSUPPORTED, "a \\p{..} property under (?i) is not supported");
    cp_set s = {0}, c = {0};
    escape_set((char)tolower((unsigned char)e), mask, &s);
    if (st->in_class) {
        if (negate) {
            set_complement(&s, &c);
            emit_set(&st->out, &c);
        } else {
            emit_set(&st->out, &s);
        }
    } else {
        rs_tok_buf_put(&st->out, negate ? "[^" : "[", negate ? 2 : 1);
        emit_set(&st->out, &s);
        rs_tok_buf_putc(&st->out, ']');
    }
    free(s.r);
    free(c.r);
    return RS_OK;
}

static int tr_escape(tr_state *st) {
    if (st->i + 1 >= st->n) return tr_fail(st, RS_EFORMAT, "ends with a backslash");
    char d = st->p[st->i + 1];
    switch (d) {
    case 's': case 'S': case 'd': case 'D': case 'h': case 'H':
        st->i += 2;
        return tr_set(st, d, isupper((unsigned char)d) != 0, 0);
    case 'p': case 'P': {
        if (st->i + 2 >= st->n || st->p[st->i + 2] != '{')
            return tr_fail(st, RS_EUNSUPPORTED, "\\p without braces is not supported");
        size_t a = st->i + 3, b = a;
        while (b < st->n && st->p[b] != '}') b++;
        if (b >= st->n) return tr_fail(st, RS_EFORMAT, "unterminated \\p{");
        bool neg = d == 'P';
        if (a < b && st->p[a] == '^') neg = !neg, a++;
        uint32_t mask;
        if (!cat_lookup(st->p + a, b - a, &mask)) {
            char what[160];
            snprintf(what, sizeof what, "property \\p{%.*s} is not supported (general categories only)",
                     (int)RS_MIN(b - a, 60), st->p + a);
            return tr_fail(st, RS_EUNSUPPORTED, what);
        }
        st->i = b + 1;
        return tr_set(st, d, neg, mask);
    }
    case 'v': /* Ruby's \v is the vertical tab alone */
        rs_tok_buf_put(&st->out, "\\x{0B}", 6);
        st->i += 2;
        return RS_OK;
    case 'u': {
        size_t a = st->i + 2;
        if (a + 4 > st->n) return tr_fail(st, RS_EFORMAT, "\\u needs four hex digits");
        for (size_t k = a; k < a + 4; k++)
            if (!isxdigit((unsigned char)st->p[k])) return tr_fail(st, RS_EFORMAT, "\\u needs four hex digits");
        rs_tok_buf_put(&st->out, "\\x{", 3);
        rs_tok_buf_put(&st->out, st->p + a, 4);
        rs_tok_buf_putc(&st->out, '}');
        st->i = a + 4;
        return RS_OK;
    }
    case 'w': case 'W': case 'b': case 'B': case 'X': case 'Q': case 'E': case 'y': case 'Y': case 'K':
    case 'N': case 'O': case 'g': case 'o': case 'c': case 'C': case 'M': case 'e': {
        char what[64];
        snprintf(what, sizeof what, "\\%c is not supported", d);
        return tr_fail(st, RS_EUNSUPPORTED, what);
    }
    default: {
        size_t k = (unsigned char)d < 0x80 ? 1 : (size_t)rs_utf8_len((unsigned char)d);
        rs_tok_buf_put(&st->out, st->p + st->i, 1 + k);
        st->i += 1 + k;
        return RS_OK;
    }
    }
}

/* "(" at st->i outside a class: group openings and inline options. */
static int tr_group(tr_state *st) {
    if (st->i + 1 < st->n && st->p[st->i + 1] == '?') {
        size_t j = st->i + 2;
        if (j < st->n && st->p[j] == '#') { /* comment: copy to ')' */
            while (j < st->n && st->p[j] != ')') j++;
            if (j >= st->n) return tr_fail(st, RS_EFORMAT, "unterminated (?#");
            rs_tok_buf_put(&st->out, st->p + st->i, j + 1 - st->i);
            st->i = j + 1;
            return RS_OK;
        }
        size_t k = j;
        bool on = true, ci = st->caseless;
        while (k < st->n && strchr("imx-", st->p[k])) {
            char f = st->p[k];
            if (f == '-') on = false;
            else if (f == 'i') ci = on;
            else if (f == 'x') return tr_fail(st, RS_EUNSUPPORTED, "the x option is not supported");
            k++;
        }
        if (k > j && k < st->n && (st->p[k] == ':' || st->p[k] == ')')) {
            rs_tok_buf_put(&st->out, "(?", 2);
            for (size_t q = j; q < k; q++) rs_tok_buf_putc(&st->out, st->p[q] == 'm' ? 's' : st->p[q]);
            rs_tok_buf_putc(&st->out, st->p[k]);
            if (st->p[k] == ')') { /* options for the rest of the enclosing group */
                st->caseless = ci;
            } else {
                if (st->depth >= (int)RS_ARRAY_LEN(st->stack)) return tr_fail(st, RS_EUNSUPPORTED, "groups nest too deep");
                st->stack[st->depth++] = st->caseless;
                st->caseless = ci;
            }
            st->i = k + 1;
            return RS_OK;
        }
    }
    if (st->depth >= (int)RS_ARRAY_LEN(st->stack)) return tr_fail(st, RS_EUNSUPPORTED, "groups nest too deep");
    st->stack[st->depth++] = st->caseless;
    rs_tok_buf_putc(&st->out, '(');
    st->i++;
    return RS_OK;
}

static int translate(tr_state *st) {
    int rc;
    while (st->i < st->n) {
        char c = st->p[st->i];
        if (c == '\\') {
            if ((rc = tr_escape(st)) != RS_OK) return rc;
            continue;
        }
        if (st->in_class) {
            if (c == '[') return tr_fail(st, RS_EUNSUPPORTED, "nested character classes and POSIX brackets are not supported");
            if (c == '&' && st->i + 1 < st->n && st->p[st->i + 1] == '&')
                return tr_fail(st, RS_EUNSUPPORTED, "class intersection && is not supported");
            if (c == ']') st->in_class = false;
            rs_tok_buf_putc(&st->out, c);
            st->i++;
            continue;
        }
        if (c == '[') {
            st->in_class = true;
            rs_tok_buf_putc(&st->out, '[');
            st->i++;
            if (st->i < st->n && st->p[st->i] == '^') rs_tok_buf_putc(&st->out, '^'), st->i++;
            if (st->i < st->n && st->p[st->i] == ']') rs_tok_buf_put(&st->out, "\\]", 2), st->i++; /* a literal */
            continue;
        }
        if (c == '(') {
            if ((rc = tr_group(st)) != RS_OK) return rc;
            continue;
        }
        if (c == ')') {
            if (st->depth > 0) st->caseless = st->stack[--st->depth];
        } else if (c == '{' && st->i + 1 < st->n && st->p[st->i + 1] == ',') {
            size_t k = st->i + 2;
            while (k < st->n && isdigit((unsigned char)st->p[k])) k++;
            if (k > st->i + 2 && k < st->n && st->p[k] == '}') {
                rs_tok_buf_put(&st->out, "{0", 2);
                st->i++;
                continue;
            }
        }
        rs_tok_buf_putc(&st->out, c);
        st->i++;
    }
    if (st->in_class) return tr_fail(st, RS_EFORMAT, "unterminated character class");
    return RS_OK;
}

int rs_tok_regex_compile(const char *pat, size_t len, bool literal, const char *key, rs_tok_regex **out,
                         rs_error *err) {
    *out = NULL;
    if (len == 0) return rs_error_set(err, RS_EUNSUPPORTED, key, "%s: an empty pattern is not supported", key);
    if (rs_utf8_valid_prefix(pat, len) != len)
        return rs_error_set(err, RS_EFORMAT, key, "%s: pattern is not valid UTF-8", key);
    rs_tok_regex *re = rs_xcalloc(1, sizeof *re);
    if (literal) {
        re->literal = true;
        re->lit = rs_xmalloc(len);
        memcpy(re->lit, pat, len);
        re->lit_len = len;
        *out = re;
        return RS_OK;
    }
    tr_state st = {.p = pat, .n = len, .key = key, .err = err};
    int rc = translate(&st);
    if (rc != RS_OK) {
        free(st.out.p);
        free(re);
        return rc;
    }
    pcre2_compile_context *cc = pcre2_compile_context_create(NULL);
    pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
    pcre2_set_bsr(cc, PCRE2_BSR_UNICODE);
    int ec;
    PCRE2_SIZE eo;
    re->code = pcre2_compile((PCRE2_SPTR)st.out.p, st.out.n,
                             PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE | PCRE2_ALLOW_EMPTY_CLASS, &ec, &eo, cc);
    pcre2_compile_context_free(cc);
    free(st.out.p);
    if (!re->code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        free(re);
        return rs_error_set(err, RS_EFORMAT, key, "%s: pattern %.*s does not compile: %s", key, (int)RS_MIN(len, 120),
                            pat, (const char *)msg);
    }
    re->jit = pcre2_jit_compile(re->code, PCRE2_JIT_COMPLETE) == 0;
    *out = re;
    return RS_OK;
}

void rs_tok_regex_free(rs_tok_regex *re) {
    if (!re) return;
    free(re->lit);
    if (re->code) pcre2_code_free(re->code);
    free(re);
}

bool rs_tok_regex_literal(const rs_tok_regex *re, const char **lit, size_t *n) {
    *lit = re->lit, *n = re->lit_len;
    return re->literal;
}

/* ---- per-thread match state ---- */

typedef struct re_thread {
    pcre2_match_data *md;
    pcre2_match_context *mc;
    pcre2_jit_stack *js;
} re_thread;

static pthread_key_t re_key;
static pthread_once_t re_once = PTHREAD_ONCE_INIT;

static void re_thread_free(void *p) {
    re_thread *t = p;
    pcre2_match_data_free(t->md);
    pcre2_match_context_free(t->mc);
    pcre2_jit_stack_free(t->js);
    free(t);
}

static void re_key_init(void) { RS_ASSERT(pthread_key_create(&re_key, re_thread_free) == 0); }

static re_thread *re_thread_get(void) {
    pthread_once(&re_once, re_key_init);
    re_thread *t = pthread_getspecific(re_key);
    if (t) return t;
    t = rs_xcalloc(1, sizeof *t);
    t->md = pcre2_match_data_create(1, NULL);
    t->mc = pcre2_match_context_create(NULL);
    t->js = pcre2_jit_stack_create(64 << 10, 8 << 20, NULL);
    if (!t->md || !t->mc || !t->js) {
        RS_ERROR("tokenizer: out of memory for PCRE2 match data");
        abort();
    }
    pcre2_set_match_limit(t->mc, RE_MATCH_LIMIT);
    pcre2_jit_stack_assign(t->mc, NULL, t->js);
    RS_ASSERT(pthread_setspecific(re_key, t) == 0);
    return t;
}

static void find_literal(const rs_tok_regex *re, const char *s, size_t n, rs_tok_spans *out) {
    size_t prev = 0, at = 0;
    while (at + re->lit_len <= n) {
        const char *hit = memmem(s + at, n - at, re->lit, re->lit_len);
        if (!hit) break;
        size_t ms = (size_t)(hit - s), me = ms + re->lit_len;
        if (prev != ms) rs_tok_spans_push(out, prev, ms, false);
        rs_tok_spans_push(out, ms, me, true);
        prev = at = me;
    }
    if (prev != n) rs_tok_spans_push(out, prev, n, false);
}

int rs_tok_regex_find(const rs_tok_regex *re, const char *s, size_t n, rs_tok_spans *out, rs_error *err) {
    out->n = 0;
    if (n == 0) {
        rs_tok_spans_push(out, 0, 0, false);
        return RS_OK;
    }
    if (re->literal) {
        find_literal(re, s, n, out);
        return RS_OK;
    }
    re_thread *t = re_thread_get();
    size_t prev = 0, last_end = 0;
    bool skip_next_empty = false;
    while (last_end <= n) {
        int rc = re->jit ? pcre2_jit_match(re->code, (PCRE2_SPTR)s, n, last_end, 0, t->md, t->mc)
                         : pcre2_match(re->code, (PCRE2_SPTR)s, n, last_end, PCRE2_NO_UTF_CHECK, t->md, t->mc);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return rs_error_set(err, RS_EINVAL, NULL, "the text is too complex to split (%s)", (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(t->md);
        size_t ms = ov[0], me = ov[1];
        last_end = me;
        if (ms == me) {
            last_end += me < n ? (size_t)rs_utf8_len((unsigned char)s[me]) : 1;
            if (skip_next_empty) {
                skip_next_empty = false;
                continue;
            }
        } else {
            skip_next_empty = true;
        }
        if (prev != ms) rs_tok_spans_push(out, prev, ms, false);
        rs_tok_spans_push(out, ms, me, true);
        prev = me;
    }
    if (prev != n) rs_tok_spans_push(out, prev, n, false);
    return RS_OK;
}
