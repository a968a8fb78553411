/*
 * load.c — tokenizer.json (and the model directory's tokenizer_config.json and
 * generation_config.json) into an rs_tok.
 *
 * Every key is read as `tokenizers`' serde types read it (defaults included: ByteLevel.use_regex
 * true, Metaspace.prepend_scheme "always" and split true, its legacy add_prefix_space false meaning
 * "never"), unknown keys are ignored as serde ignores them, and anything whose behaviour is not
 * implemented is RS_EUNSUPPORTED with the key path and the component in the message, e.g.
 *   tokenizer.json: pre_tokenizer.pretokenizers[1].type: "Whitespace" is not supported
 * so that a tokenizer never runs approximately. Malformed values are RS_EFORMAT naming the key.
 *
 * Added tokens get their ids as AddedVocabulary::add_tokens gives them (the id of an equal vocab
 * entry, else the next id after the model's vocabulary), and normalized ones their normalized
 * form, computed with the tokenizer's own normalizer. The decoder chain must have the shape the
 * streaming decoder handles (stream.c); rs_tok_fuse_index names the join.
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "tok_internal.h"

#define TOK_MAX_FILE (512u << 20)
#define KEYLEN 256
#define TOK_MAX_ID (1 << 24) /* ids beyond any real vocabulary: refused rather than allocated for */

static const char GPT2_PATTERN[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

typedef struct ld {
    const char *file; /* for messages: "tokenizer.json" or a path */
    rs_error *err;
    rs_tok *t;
    size_t model_vocab_n;
} ld;

static int fail(const ld *l, int code, const char *key, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static int fail(const ld *l, int code, const char *key, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (key && *key) return rs_error_set(l->err, code, key, "%s: %s: %s", l->file, key, msg);
    return rs_error_set(l->err, code, NULL, "%s: %s", l->file, msg);
}

/* Key paths longer than KEYLEN are cut (they only label messages). */
static const char *sub(char *buf, const char *prefix, const char *k) {
    if (snprintf(buf, KEYLEN, "%s%s%s", prefix, *prefix ? "." : "", k) >= KEYLEN) buf[KEYLEN - 1] = '\0';
    return buf;
}

static const char *idx(char *buf, const char *prefix, const char *k, size_t i) {
    if (snprintf(buf, KEYLEN, "%s%s%s[%zu]", prefix, *prefix ? "." : "", k, i) >= KEYLEN) buf[KEYLEN - 1] = '\0';
    return buf;
}

/* A key that is absent or null reads as absent (serde's Option). */
static json_t *get(const json_t *o, const char *k) {
    json_t *v = json_is_object(o) ? json_object_get(o, k) : NULL;
    return json_is_null(v) ? NULL : v;
}

static int get_bool(const ld *l, const json_t *o, const char *prefix, const char *k, bool def, bool *out) {
    char key[KEYLEN];
    json_t *v = get(o, k);
    if (!v) {
        *out = def;
        return RS_OK;
    }
    if (!json_is_boolean(v)) return fail(l, RS_EFORMAT, sub(key, prefix, k), "must be true or false");
    *out = json_is_true(v);
    return RS_OK;
}

static int get_str(const ld *l, const json_t *o, const char *prefix, const char *k, bool required, const char **s,
                   size_t *n) {
    char key[KEYLEN];
    json_t *v = get(o, k);
    *s = NULL, *n = 0;
    if (!v) return required ? fail(l, RS_EFORMAT, sub(key, prefix, k), "missing") : RS_OK;
    if (!json_is_string(v)) return fail(l, RS_EFORMAT, sub(key, prefix, k), "must be a string");
    *s = json_string_value(v);
    *n = json_string_length(v);
    return RS_OK;
}

static int get_size(const ld *l, const json_t *o, const char *prefix, const char *k, size_t def, size_t hi,
                    size_t *out) {
    char key[KEYLEN];
    json_t *v = get(o, k);
    if (!v) {
        *out = def;
        return RS_OK;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0 || (unsigned long long)json_integer_value(v) > hi)
        return fail(l, RS_EFORMAT, sub(key, prefix, k), "must be an integer in [0, %zu]", hi);
    *out = (size_t)json_integer_value(v);
    return RS_OK;
}

/* One Unicode character given as a JSON string (serde's char). */
static int get_char(const ld *l, const json_t *o, const char *prefix, const char *k, uint32_t *cp) {
    char key[KEYLEN];
    const char *s;
    size_t n;
    int rc = get_str(l, o, prefix, k, true, &s, &n);
    if (rc != RS_OK) return rc;
    size_t i = 0;
    if (n == 0 || (*cp = rs_utf8_next(s, &i), i != n)) return fail(l, RS_EFORMAT, sub(key, prefix, k), "must be one character");
    return RS_OK;
}

/* Keys serde requires (no default in `tokenizers`' struct): a file without them does not load there. */
static int require_bool(const ld *l, const json_t *o, const char *prefix, const char *k) {
    char key[KEYLEN];
    if (!json_is_boolean(json_object_get(o, k))) return fail(l, RS_EFORMAT, sub(key, prefix, k), "must be true or false");
    return RS_OK;
}

static char *dup_bytes(const char *s, size_t n) {
    char *p = rs_xmalloc(n + 1);
    memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

/* The component's "type", checked against names[]; returns its index or a negative error. */
static int get_type(const ld *l, const json_t *o, const char *prefix, const char *what, const char *const *names,
                    int n_names) {
    char key[KEYLEN];
    if (!json_is_object(o)) return fail(l, RS_EFORMAT, prefix, "%s must be an object", what);
    const char *s;
    size_t len;
    int rc = get_str(l, o, prefix, "type", true, &s, &len);
    if (rc != RS_OK) return rc;
    for (int i = 0; i < n_names; i++)
        if (strcmp(s, names[i]) == 0) return i;
    return fail(l, RS_EUNSUPPORTED, sub(key, prefix, "type"), "%s \"%.80s\" is not supported", what, s);
}

/* {"String": s} or {"Regex": r} (Split and Replace patterns). */
static int get_pattern(const ld *l, const json_t *o, const char *prefix, rs_tok_regex **re) {
    char key[KEYLEN];
    json_t *p = get(o, "pattern");
    sub(key, prefix, "pattern");
    if (!json_is_object(p) || json_object_size(p) != 1)
        return fail(l, RS_EFORMAT, key, "must be {\"String\": ...} or {\"Regex\": ...}");
    json_t *s = json_object_get(p, "String"), *r = json_object_get(p, "Regex");
    json_t *v = s ? s : r;
    if (!json_is_string(v)) return fail(l, RS_EFORMAT, key, "must be {\"String\": ...} or {\"Regex\": ...}");
    char full[KEYLEN + 420];
    snprintf(full, sizeof full, "%s: %s.%s", l->file, key, s ? "String" : "Regex");
    int rc = rs_tok_regex_compile(json_string_value(v), json_string_length(v), s != NULL, full, re, l->err);
    if (rc != RS_OK && snprintf(l->err->param, sizeof l->err->param, "%s.%s", key, s ? "String" : "Regex") >= (int)sizeof l->err->param)
        l->err->param[sizeof l->err->param - 1] = '\0';
    return rc;
}

/* ---- normalizers ---- */

static int load_normalizer(ld *l, const json_t *o, const char *prefix) {
    static const char *const names[] = {"NFC", "NFD", "NFKC", "NFKD", "Replace", "Prepend", "Sequence"};
    rs_tok *t = l->t;
    char key[KEYLEN];
    int k = get_type(l, o, prefix, "normalizer", names, (int)RS_ARRAY_LEN(names));
    if (k < 0) return k;
    if (k == 6) {
        json_t *a = get(o, "normalizers");
        if (!json_is_array(a)) return fail(l, RS_EFORMAT, sub(key, prefix, "normalizers"), "must be an array");
        for (size_t i = 0; i < json_array_size(a); i++) {
            int rc = load_normalizer(l, json_array_get(a, i), idx(key, prefix, "normalizers", i));
            if (rc != RS_OK) return rc;
        }
        return RS_OK;
    }
    t->norms = rs_xrealloc(t->norms, (t->n_norms + 1) * sizeof *t->norms);
    rs_tok_norm *nm = &t->norms[t->n_norms++];
    memset(nm, 0, sizeof *nm);
    static const rs_tok_norm_kind kinds[] = {RS_TOK_NORM_NFC, RS_TOK_NORM_NFD, RS_TOK_NORM_NFKC,
                                             RS_TOK_NORM_NFKD, RS_TOK_NORM_REPLACE, RS_TOK_NORM_PREPEND};
    nm->kind = kinds[k];
    const char *s;
    size_t n;
    int rc = RS_OK;
    if (nm->kind == RS_TOK_NORM_REPLACE) {
        if ((rc = get_pattern(l, o, prefix, &nm->re)) != RS_OK) return rc;
        if ((rc = get_str(l, o, prefix, "content", true, &s, &n)) != RS_OK) return rc;
        nm->str = dup_bytes(s, n), nm->str_len = n;
    } else if (nm->kind == RS_TOK_NORM_PREPEND) {
        if ((rc = get_str(l, o, prefix, "prepend", true, &s, &n)) != RS_OK) return rc;
        nm->str = dup_bytes(s, n), nm->str_len = n;
    }
    return RS_OK;
}

/* ---- pre-tokenizers ---- */

static int get_prepend_scheme(const ld *l, const json_t *o, const char *prefix, rs_tok_prepend_scheme *out) {
    char key[KEYLEN];
    const char *s;
    size_t n;
    int rc = get_str(l, o, prefix, "prepend_scheme", false, &s, &n);
    if (rc != RS_OK) return rc;
    *out = RS_TOK_PREPEND_ALWAYS;
    if (s) {
        if (!strcmp(s, "always")) *out = RS_TOK_PREPEND_ALWAYS;
        else if (!strcmp(s, "first")) *out = RS_TOK_PREPEND_FIRST;
        else if (!strcmp(s, "never")) *out = RS_TOK_PREPEND_NEVER;
        else return fail(l, RS_EFORMAT, sub(key, prefix, "prepend_scheme"), "\"%.40s\" is not always, first or never", s);
    }
    json_t *aps = get(o, "add_prefix_space"); /* the legacy form */
    if (aps && !json_is_boolean(aps)) return fail(l, RS_EFORMAT, sub(key, prefix, "add_prefix_space"), "must be true or false");
    if (json_is_false(aps)) {
        if (*out != RS_TOK_PREPEND_NEVER && s)
            return fail(l, RS_EFORMAT, sub(key, prefix, "add_prefix_space"), "does not match prepend_scheme");
        if (*out != RS_TOK_PREPEND_NEVER && !s && json_object_get(o, "prepend_scheme") == NULL) {
            /* absent prepend_scheme defaults to "always", which false contradicts */
            return fail(l, RS_EFORMAT, sub(key, prefix, "add_prefix_space"), "does not match prepend_scheme");
        }
        *out = RS_TOK_PREPEND_NEVER;
    }
    return RS_OK;
}

static int load_pretok(ld *l, const json_t *o, const char *prefix) {
    static const char *const names[] = {"Split", "ByteLevel", "Digits", "Metaspace", "Sequence"};
    static const char *const behaviors[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
    rs_tok *t = l->t;
    char key[KEYLEN];
    int k = get_type(l, o, prefix, "pre-tokenizer", names, (int)RS_ARRAY_LEN(names));
    if (k < 0) return k;
    if (k == 4) {
        json_t *a = get(o, "pretokenizers");
        if (!json_is_array(a)) return fail(l, RS_EFORMAT, sub(key, prefix, "pretokenizers"), "must be an array");
        for (size_t i = 0; i < json_array_size(a); i++) {
            int rc = load_pretok(l, json_array_get(a, i), idx(key, prefix, "pretokenizers", i));
            if (rc != RS_OK) return rc;
        }
        return RS_OK;
    }
    if (t->n_pretoks >= RS_TOK_MAX_PRETOK) return fail(l, RS_EUNSUPPORTED, prefix, "more than %d pre-tokenizers", RS_TOK_MAX_PRETOK);
    if (t->n_pretoks && t->pretoks[t->n_pretoks - 1].kind == RS_TOK_PRE_BYTELEVEL)
        return fail(l, RS_EUNSUPPORTED, prefix, "a pre-tokenizer after ByteLevel is not supported");
    t->pretoks = rs_xrealloc(t->pretoks, (t->n_pretoks + 1) * sizeof *t->pretoks);
    rs_tok_pretok *p = &t->pretoks[t->n_pretoks++];
    memset(p, 0, sizeof *p);
    int rc = RS_OK;
    const char *s;
    size_t n;
    switch (k) {
    case 0:
        p->kind = RS_TOK_PRE_SPLIT;
        if ((rc = get_pattern(l, o, prefix, &p->re)) != RS_OK) return rc;
        if ((rc = get_str(l, o, prefix, "behavior", true, &s, &n)) != RS_OK) return rc;
        for (size_t b = 0;; b++) {
            if (b == RS_ARRAY_LEN(behaviors))
                return fail(l, RS_EFORMAT, sub(key, prefix, "behavior"), "\"%.40s\" is not a split behavior", s);
            if (!strcmp(s, behaviors[b])) {
                p->behavior = (rs_tok_split_behavior)b;
                break;
            }
        }
        if (!json_is_boolean(get(o, "invert"))) return fail(l, RS_EFORMAT, sub(key, prefix, "invert"), "must be true or false");
        return get_bool(l, o, prefix, "invert", false, &p->invert);
    case 1: {
        p->kind = RS_TOK_PRE_BYTELEVEL;
        bool use_regex;
        if ((rc = require_bool(l, o, prefix, "add_prefix_space")) != RS_OK || (rc = require_bool(l, o, prefix, "trim_offsets")) != RS_OK)
            return rc;
        if ((rc = get_bool(l, o, prefix, "add_prefix_space", true, &p->add_prefix_space)) != RS_OK) return rc;
        if ((rc = get_bool(l, o, prefix, "use_regex", true, &use_regex)) != RS_OK) return rc;
        if (use_regex) return rs_tok_regex_compile(GPT2_PATTERN, sizeof GPT2_PATTERN - 1, false, "ByteLevel", &p->re, l->err);
        return RS_OK;
    }
    case 2:
        p->kind = RS_TOK_PRE_DIGITS;
        if ((rc = require_bool(l, o, prefix, "individual_digits")) != RS_OK) return rc;
        return get_bool(l, o, prefix, "individual_digits", false, &p->individual_digits);
    default: {
        p->kind = RS_TOK_PRE_METASPACE;
        uint32_t cp;
        if ((rc = get_char(l, o, prefix, "replacement", &cp)) != RS_OK) return rc;
        p->rep_len = rs_utf8_put(p->rep, cp);
        if ((rc = get_prepend_scheme(l, o, prefix, &p->prepend)) != RS_OK) return rc;
        if (p->prepend == RS_TOK_PREPEND_FIRST && t->n_pretoks > 1)
            return fail(l, RS_EUNSUPPORTED, prefix, "Metaspace with prepend_scheme \"first\" after another pre-tokenizer is not supported");
        return get_bool(l, o, prefix, "split", true, &p->split);
    }
    }
}

/* ---- the model ---- */

static int add_merge(ld *l, const char *key, const char *a, size_t an, const char *b, size_t bn, uint32_t rank) {
    rs_tok_bpe *m = &l->t->bpe;
    int32_t ia = rs_tok_strmap_get(&m->vocab, a, an), ib = rs_tok_strmap_get(&m->vocab, b, bn);
    if (ia < 0 || ib < 0)
        return fail(l, RS_EFORMAT, key, "token \"%.*s\" is not in the vocabulary", ia < 0 ? (int)RS_MIN(an, 80) : (int)RS_MIN(bn, 80),
                    ia < 0 ? a : b);
    if (bn < m->prefix_len) return fail(l, RS_EFORMAT, key, "right token is shorter than continuing_subword_prefix");
    char stack[512];
    size_t mn = an + bn - m->prefix_len;
    char *buf = mn <= sizeof stack ? stack : rs_xmalloc(mn);
    memcpy(buf, a, an);
    memcpy(buf + an, b + m->prefix_len, bn - m->prefix_len);
    int32_t out = rs_tok_strmap_get(&m->vocab, buf, mn);
    if (buf != stack) free(buf);
    if (out < 0) return fail(l, RS_EFORMAT, key, "the merged token is not in the vocabulary");
    rs_tok_pairmap_put(&m->merges, ia, ib, rank, out);
    return RS_OK;
}

static int load_merges(ld *l, const json_t *merges) {
    char key[KEYLEN];
    if (!json_is_array(merges)) return fail(l, RS_EFORMAT, "model.merges", "must be an array");
    for (size_t i = 0; i < json_array_size(merges); i++) {
        json_t *e = json_array_get(merges, i);
        idx(key, "model", "merges", i);
        int rc;
        if (json_is_string(e)) { /* "a b": exactly one space */
            const char *s = json_string_value(e);
            size_t n = json_string_length(e);
            const char *sp = memchr(s, ' ', n);
            if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s)))
                return fail(l, RS_EFORMAT, key, "a merge must be \"left right\" with one space");
            rc = add_merge(l, key, s, (size_t)(sp - s), sp + 1, n - (size_t)(sp + 1 - s), (uint32_t)i);
        } else if (json_is_array(e) && json_array_size(e) == 2 && json_is_string(json_array_get(e, 0)) &&
                   json_is_string(json_array_get(e, 1))) {
            json_t *a = json_array_get(e, 0), *b = json_array_get(e, 1);
            rc = add_merge(l, key, json_string_value(a), json_string_length(a), json_string_value(b),
                           json_string_length(b), (uint32_t)i);
        } else {
            return fail(l, RS_EFORMAT, key, "a merge must be a string or a pair of strings");
        }
        if (rc != RS_OK) return rc;
    }
    return RS_OK;
}

static int load_model(ld *l, const json_t *o, int32_t *max_id) {
    rs_tok_bpe *m = &l->t->bpe;
    char key[KEYLEN];
    if (!json_is_object(o)) return fail(l, RS_EFORMAT, "model", "missing or not an object");
    json_t *ty = get(o, "type");
    if (ty && (!json_is_string(ty) || strcmp(json_string_value(ty), "BPE") != 0))
        return fail(l, json_is_string(ty) ? RS_EUNSUPPORTED : RS_EFORMAT, "model.type", "model \"%.60s\" is not supported (BPE only)",
                    json_is_string(ty) ? json_string_value(ty) : "?");
    json_t *dropout = get(o, "dropout");
    if (dropout && (!json_is_number(dropout) || json_number_value(dropout) != 0.0))
        return fail(l, RS_EUNSUPPORTED, "model.dropout", "BPE dropout (random merges) is not supported");
    int rc;
    const char *s;
    size_t n;
    if ((rc = get_bool(l, o, "model", "fuse_unk", false, &m->fuse_unk)) != RS_OK) return rc;
    if ((rc = get_bool(l, o, "model", "byte_fallback", false, &m->byte_fallback)) != RS_OK) return rc;
    if ((rc = get_bool(l, o, "model", "ignore_merges", false, &m->ignore_merges)) != RS_OK) return rc;
    if ((rc = get_str(l, o, "model", "continuing_subword_prefix", false, &s, &n)) != RS_OK) return rc;
    if (s && n) { /* "" is no prefix (Qwen2 writes that) */
        if (n > 16) return fail(l, RS_EUNSUPPORTED, "model.continuing_subword_prefix", "longer than 16 bytes is not supported");
        m->prefix = dup_bytes(s, n), m->prefix_len = n;
    }
    if ((rc = get_str(l, o, "model", "end_of_word_suffix", false, &s, &n)) != RS_OK) return rc;
    if (s && n) { /* "" is no suffix (Qwen2 writes that) */
        if (n > 16) return fail(l, RS_EUNSUPPORTED, "model.end_of_word_suffix", "longer than 16 bytes is not supported");
        m->suffix = dup_bytes(s, n), m->suffix_len = n;
    }
    json_t *vocab = get(o, "vocab");
    if (!json_is_object(vocab)) return fail(l, RS_EFORMAT, "model.vocab", "missing or not an object");
    const char *k;
    json_t *v;
    *max_id = -1;
    json_object_foreach(vocab, k, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= TOK_MAX_ID)
            return fail(l, RS_EFORMAT, sub(key, "model.vocab", k), "must be an id in [0, 2^24)");
        int32_t id = (int32_t)json_integer_value(v);
        rs_tok_strmap_put(&m->vocab, k, strlen(k), id);
        if (id > *max_id) *max_id = id;
    }
    l->model_vocab_n = m->vocab.n;
    m->unk_id = -1;
    if ((rc = get_str(l, o, "model", "unk_token", false, &s, &n)) != RS_OK) return rc;
    if (s && (m->unk_id = rs_tok_strmap_get(&m->vocab, s, n)) < 0)
        return fail(l, RS_EFORMAT, "model.unk_token", "\"%.60s\" is not in the vocabulary", s);
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        m->fallback_id[b] = rs_tok_strmap_get(&m->vocab, name, 6);
    }
    json_t *merges = get(o, "merges");
    if (!merges) return fail(l, RS_EFORMAT, "model.merges", "missing");
    return load_merges(l, merges);
}

/* Byte-level mode: the vocabulary by raw bytes, for words that are raw bytes. */
static int init_byte_level(ld *l) {
    rs_tok_bpe *m = &l->t->bpe;
    if (m->prefix || m->suffix)
        return fail(l, RS_EUNSUPPORTED, "model", "continuing_subword_prefix / end_of_word_suffix with a ByteLevel pre-tokenizer are not supported");
    m->byte_level = true;
    rs_tok_buf raw = {0};
    for (uint32_t e = 0; e < m->vocab.n; e++) {
        const char *s = m->vocab.keys.p + m->vocab.off[e];
        size_t n = m->vocab.len[e], i = 0;
        raw.n = 0;
        bool ok = true;
        while (i < n && ok) {
            int b = rs_tok_char_byte(rs_utf8_next(s, &i));
            if (b < 0) ok = false;
            else rs_tok_buf_putc(&raw, (char)b);
        }
        if (ok && n) rs_tok_strmap_put(&m->raw_vocab, raw.p, raw.n, m->vocab.val[e]);
    }
    free(raw.p);
    for (int b = 0; b < 256; b++) {
        char c[4];
        m->byte_id[b] = rs_tok_strmap_get(&m->vocab, c, (size_t)rs_utf8_put(c, rs_tok_byte_char((unsigned)b)));
    }
    return RS_OK;
}

/* ---- added tokens ---- */

static int load_added(ld *l, const json_t *a) {
    rs_tok *t = l->t;
    char key[KEYLEN], sk[KEYLEN];
    if (!a) return RS_OK;
    if (!json_is_array(a)) return fail(l, RS_EFORMAT, "added_tokens", "must be an array");
    int32_t next_id = (int32_t)l->model_vocab_n;
    rs_tok_strmap special = {0};
    int rc = RS_OK;
    for (size_t i = 0; i < json_array_size(a) && rc == RS_OK; i++) {
        json_t *o = json_array_get(a, i);
        idx(key, "", "added_tokens", i);
        if (!json_is_object(o)) return fail(l, RS_EFORMAT, key, "must be an object");
        const char *s;
        size_t n;
        rs_tok_added tok = {0};
        static const char *const flags[] = {"single_word", "lstrip", "rstrip", "normalized", "special"};
        bool *dst[] = {&tok.single_word, &tok.lstrip, &tok.rstrip, &tok.normalized, &tok.special};
        if ((rc = get_str(l, o, key, "content", true, &s, &n)) != RS_OK) break;
        for (size_t f = 0; f < RS_ARRAY_LEN(flags) && rc == RS_OK; f++) {
            if (!json_is_boolean(json_object_get(o, flags[f]))) rc = fail(l, RS_EFORMAT, sub(sk, key, flags[f]), "must be true or false");
            else *dst[f] = json_is_true(json_object_get(o, flags[f]));
        }
        if (rc != RS_OK) break;
        if (n == 0) continue; /* add_tokens ignores empty contents */
        int32_t at = rs_tok_strmap_get(&t->added_map, s, n);
        int32_t id = at >= 0 ? t->added[at].id : rs_tok_strmap_get(&t->bpe.vocab, s, n);
        if (id < 0) id = next_id++;
        if (id >= TOK_MAX_ID) return fail(l, RS_EFORMAT, key, "more than 2^24 ids");
        json_t *jid = get(o, "id");
        if (json_is_integer(jid) && json_integer_value(jid) != id)
            RS_WARN("%s: %s: \"%.60s\" was given id %lld but gets id %d (as in tokenizers)", l->file, key, s,
                    (long long)json_integer_value(jid), id);
        if (tok.special) rs_tok_strmap_put(&special, s, n, 1);
        if (at < 0) {
            t->added = rs_xrealloc(t->added, (t->n_added + 1) * sizeof *t->added);
            at = (int32_t)t->n_added++;
            rs_tok_strmap_put(&t->added_map, s, n, at);
        } else {
            free(t->added[at].content);
        }
        /* a later entry for the same content replaces the earlier one, under the same id */
        tok.content = dup_bytes(s, n), tok.len = n, tok.id = id;
        t->added[at] = tok;
    }
    /* membership in the special set is by content, as AddedVocabulary's special_tokens_set */
    for (size_t q = 0; q < t->n_added; q++)
        t->added[q].special = rs_tok_strmap_get(&special, t->added[q].content, t->added[q].len) >= 0;
    rs_tok_strmap_free(&special);
    return rc;
}

/* Normalized forms and the two tries (AddedVocabulary::refresh_added_tokens). */
static int build_added(ld *l) {
    rs_tok *t = l->t;
    for (size_t i = 0; i < t->n_added; i++) {
        rs_tok_added *a = &t->added[i];
        const char *pat = a->content;
        size_t pn = a->len;
        if (a->normalized && t->has_normalizer) {
            rs_tok_buf nb = {0};
            int rc = rs_tok_normalize(t->norms, t->n_norms, a->content, a->len, &nb, l->err);
            if (rc != RS_OK) {
                free(nb.p);
                return rc;
            }
            if (nb.n != a->len || memcmp(nb.p, a->content, nb.n) != 0) {
                a->norm = dup_bytes(nb.p ? nb.p : "", nb.n), a->norm_len = nb.n;
                pat = a->norm, pn = a->norm_len;
            }
            free(nb.p);
        }
        if (pn == 0) return fail(l, RS_EUNSUPPORTED, "added_tokens", "\"%.60s\" normalizes to nothing", a->content);
        if (rs_tok_trie_add(a->normalized ? &t->trie_norm : &t->trie, pat, pn, (int32_t)i) != RS_OK)
            return fail(l, RS_EFORMAT, "added_tokens", "two added tokens match the same text \"%.60s\"", a->content);
    }
    return RS_OK;
}

/* ---- post-processor ---- */

static void tpl_free(rs_tok_tpl_piece *p, size_t n) {
    for (size_t i = 0; i < n; i++) free(p[i].ids);
    free(p);
}

/* The new template applied after the existing one: its $A is the existing output. */
static void tpl_compose(rs_tok *t, rs_tok_tpl_piece *outer, size_t n_outer) {
    if (!t->has_tpl) {
        t->tpl = outer, t->n_tpl = n_outer, t->has_tpl = true;
        return;
    }
    rs_tok_tpl_piece *res = NULL;
    size_t n = 0;
    for (size_t i = 0; i < n_outer; i++) {
        size_t k = outer[i].is_seq ? t->n_tpl : 1;
        res = rs_xrealloc(res, (n + k) * sizeof *res);
        for (size_t j = 0; j < k; j++) {
            const rs_tok_tpl_piece *src = outer[i].is_seq ? &t->tpl[j] : &outer[i];
            res[n] = *src;
            res[n].ids = src->n_ids ? rs_xmalloc(src->n_ids * sizeof *src->ids) : NULL;
            if (src->n_ids) memcpy(res[n].ids, src->ids, src->n_ids * sizeof *src->ids);
            n++;
        }
    }
    tpl_free(outer, n_outer);
    tpl_free(t->tpl, t->n_tpl);
    t->tpl = res, t->n_tpl = n;
}

static int load_template(ld *l, const json_t *o, const char *prefix) {
    char key[KEYLEN], k2[KEYLEN];
    json_t *single = get(o, "single"), *specials = get(o, "special_tokens");
    if (!json_is_array(single)) return fail(l, RS_EFORMAT, sub(key, prefix, "single"), "must be an array");
    if (specials && !json_is_object(specials)) return fail(l, RS_EFORMAT, sub(key, prefix, "special_tokens"), "must be an object");
    size_t n = json_array_size(single);
    rs_tok_tpl_piece *p = rs_xcalloc(n ? n : 1, sizeof *p);
    int rc = RS_OK;
    for (size_t i = 0; i < n && rc == RS_OK; i++) {
        json_t *e = json_array_get(single, i), *seq = get(e, "Sequence"), *sp = get(e, "SpecialToken");
        idx(key, prefix, "single", i);
        const char *s;
        size_t sn;
        if (seq) {
            if ((rc = get_str(l, seq, sub(k2, key, "Sequence"), "id", true, &s, &sn)) != RS_OK) break;
            if (strcmp(s, "A") != 0) rc = fail(l, RS_EUNSUPPORTED, key, "a single template with sequence \"%.10s\"", s);
            p[i].is_seq = true;
        } else if (sp) {
            if ((rc = get_str(l, sp, sub(k2, key, "SpecialToken"), "id", true, &s, &sn)) != RS_OK) break;
            json_t *st = get(specials, s), *ids = get(st, "ids");
            if (!json_is_array(ids)) {
                rc = fail(l, RS_EFORMAT, key, "special token \"%.60s\" has no ids in special_tokens", s);
                break;
            }
            p[i].n_ids = json_array_size(ids);
            p[i].ids = rs_xmalloc((p[i].n_ids ? p[i].n_ids : 1) * sizeof *p[i].ids);
            for (size_t j = 0; j < p[i].n_ids && rc == RS_OK; j++) {
                json_t *id = json_array_get(ids, j);
                if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= TOK_MAX_ID)
                    rc = fail(l, RS_EFORMAT, key, "special token \"%.60s\" has a bad id", s);
                else p[i].ids[j] = (int32_t)json_integer_value(id);
            }
        } else {
            rc = fail(l, RS_EFORMAT, key, "must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
        }
    }
    if (rc != RS_OK) {
        tpl_free(p, n);
        return rc;
    }
    tpl_compose(l->t, p, n);
    return RS_OK;
}

static int load_post(ld *l, const json_t *o, const char *prefix) {
    static const char *const names[] = {"TemplateProcessing", "ByteLevel", "Sequence"};
    char key[KEYLEN];
    int k = get_type(l, o, prefix, "post-processor", names, (int)RS_ARRAY_LEN(names));
    if (k < 0) return k;
    if (k == 0) return load_template(l, o, prefix);
    if (k == 2) {
        json_t *a = get(o, "processors");
        if (!json_is_array(a)) return fail(l, RS_EFORMAT, sub(key, prefix, "processors"), "must be an array");
        for (size_t i = 0; i < json_array_size(a); i++) {
            int rc = load_post(l, json_array_get(a, i), idx(key, prefix, "processors", i));
            if (rc != RS_OK) return rc;
        }
    }
    return RS_OK; /* ByteLevel: offsets only */
}

/* ---- decoders ---- */

static int load_decoder(ld *l, const json_t *o, const char *prefix) {
    static const char *const names[] = {"ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace", "Sequence"};
    rs_tok *t = l->t;
    char key[KEYLEN];
    int k = get_type(l, o, prefix, "decoder", names, (int)RS_ARRAY_LEN(names));
    if (k < 0) return k;
    if (k == 6) {
        json_t *a = get(o, "decoders");
        if (!json_is_array(a)) return fail(l, RS_EFORMAT, sub(key, prefix, "decoders"), "must be an array");
        for (size_t i = 0; i < json_array_size(a); i++) {
            int rc = load_decoder(l, json_array_get(a, i), idx(key, prefix, "decoders", i));
            if (rc != RS_OK) return rc;
        }
        return RS_OK;
    }
    if (t->n_decs >= RS_TOK_MAX_DEC) return fail(l, RS_EUNSUPPORTED, prefix, "more than %d decoders", RS_TOK_MAX_DEC);
    static const rs_tok_dec_kind kinds[] = {RS_TOK_DEC_BYTELEVEL, RS_TOK_DEC_REPLACE, RS_TOK_DEC_BYTEFALLBACK,
                                            RS_TOK_DEC_FUSE, RS_TOK_DEC_STRIP, RS_TOK_DEC_METASPACE};
    /* what the streaming decoder can do after the join (stream.c) */
    size_t fuse = rs_tok_fuse_index(t);
    bool after_join = fuse < t->n_decs;
    if (after_join && (kinds[k] == RS_TOK_DEC_BYTELEVEL || kinds[k] == RS_TOK_DEC_BYTEFALLBACK))
        return fail(l, RS_EUNSUPPORTED, prefix, "decoder %s after %s is not supported", names[k],
                    t->decs[fuse].kind == RS_TOK_DEC_FUSE ? "Fuse" : "ByteLevel");
    t->decs = rs_xrealloc(t->decs, (t->n_decs + 1) * sizeof *t->decs);
    rs_tok_dec *d = &t->decs[t->n_decs++];
    memset(d, 0, sizeof *d);
    d->kind = kinds[k];
    int rc = RS_OK;
    const char *s;
    size_t n;
    switch (d->kind) {
    case RS_TOK_DEC_REPLACE:
        if ((rc = get_pattern(l, o, prefix, &d->re)) != RS_OK) return rc;
        if ((rc = get_str(l, o, prefix, "content", true, &s, &n)) != RS_OK) return rc;
        d->str = dup_bytes(s, n), d->str_len = n;
        if (after_join && !rs_tok_regex_literal(d->re, &s, &n))
            return fail(l, RS_EUNSUPPORTED, prefix, "a Regex Replace decoder after the join is not supported");
        return RS_OK;
    case RS_TOK_DEC_STRIP:
        if ((rc = get_char(l, o, prefix, "content", &d->ch)) != RS_OK) return rc;
        if (!json_is_integer(get(o, "start")) || !json_is_integer(get(o, "stop")))
            return fail(l, RS_EFORMAT, prefix, "Strip needs integer start and stop");
        if ((rc = get_size(l, o, prefix, "start", 0, 1u << 20, &d->start)) != RS_OK) return rc;
        return get_size(l, o, prefix, "stop", 0, 1u << 20, &d->stop);
    case RS_TOK_DEC_METASPACE:
        if ((rc = get_char(l, o, prefix, "replacement", &d->ch)) != RS_OK) return rc;
        return get_prepend_scheme(l, o, prefix, &d->prepend);
    case RS_TOK_DEC_BYTELEVEL:
        if ((rc = require_bool(l, o, prefix, "add_prefix_space")) != RS_OK) return rc;
        return require_bool(l, o, prefix, "trim_offsets");
    default: return RS_OK;
    }
}

/* ---- the id table ---- */

static void build_ids(ld *l, int32_t max_model_id) {
    rs_tok *t = l->t;
    int32_t max_id = max_model_id;
    for (size_t i = 0; i < t->n_added; i++) max_id = RS_MAX(max_id, t->added[i].id);
    t->n_ids = max_id + 1;
    size_t cap = (size_t)(t->n_ids ? t->n_ids : 1);
    t->id_str = rs_xcalloc(cap, sizeof *t->id_str);
    t->id_len = rs_xcalloc(cap, sizeof *t->id_len);
    t->id_special = rs_xcalloc(cap, sizeof *t->id_special);
    const rs_tok_strmap *v = &t->bpe.vocab;
    for (uint32_t e = 0; e < v->n; e++) {
        int32_t id = v->val[e];
        t->id_str[id] = v->keys.p + v->off[e];
        t->id_len[id] = v->len[e];
    }
    for (size_t i = 0; i < t->n_added; i++) {
        const rs_tok_added *a = &t->added[i];
        t->id_str[a->id] = a->norm ? a->norm : a->content;
        t->id_len[a->id] = (uint32_t)(a->norm ? a->norm_len : a->len);
    }
    /* skip_special_tokens tests the token string against the contents of special tokens */
    rs_tok_strmap special = {0};
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].special) rs_tok_strmap_put(&special, t->added[i].content, t->added[i].len, 1);
    for (int32_t id = 0; id < t->n_ids; id++)
        t->id_special[id] = t->id_str[id] && rs_tok_strmap_get(&special, t->id_str[id], t->id_len[id]) >= 0;
    rs_tok_strmap_free(&special);
}

/* Two vocabulary entries with one id would make id -> token ambiguous. */
static int check_vocab_ids(ld *l) {
    const rs_tok_strmap *v = &l->t->bpe.vocab;
    int32_t n = l->t->n_ids;
    uint32_t *seen = rs_xcalloc((size_t)(n ? n : 1), sizeof *seen);
    int rc = RS_OK;
    for (uint32_t e = 0; e < v->n && rc == RS_OK; e++) {
        int32_t id = v->val[e];
        if (seen[id])
            rc = fail(l, RS_EFORMAT, "model.vocab", "id %d is given to both \"%.40s\" and \"%.40s\"", id,
                      v->keys.p + v->off[seen[id] - 1], v->keys.p + v->off[e]);
        seen[id] = e + 1;
    }
    free(seen);
    return rc;
}

static int load_root(ld *l, json_t *root) {
    rs_tok *t = l->t;
    int rc;
    if (!json_is_object(root)) return fail(l, RS_EFORMAT, NULL, "the top level is not an object");
    json_t *ver = get(root, "version");
    if (ver && (!json_is_string(ver) || strcmp(json_string_value(ver), "1.0") != 0))
        return fail(l, RS_EUNSUPPORTED, "version", "only version \"1.0\" is supported");
    if (get(root, "truncation")) return fail(l, RS_EUNSUPPORTED, "truncation", "truncation is not supported");
    if (get(root, "padding")) return fail(l, RS_EUNSUPPORTED, "padding", "padding is not supported");
    json_t *norm = get(root, "normalizer"), *pre = get(root, "pre_tokenizer"), *post = get(root, "post_processor");
    json_t *dec = get(root, "decoder");
    if (norm) {
        if ((rc = load_normalizer(l, norm, "normalizer")) != RS_OK) return rc;
        t->has_normalizer = true;
    }
    if (pre && (rc = load_pretok(l, pre, "pre_tokenizer")) != RS_OK) return rc;
    int32_t max_model_id = -1;
    if ((rc = load_model(l, get(root, "model"), &max_model_id)) != RS_OK) return rc;
    if (t->n_pretoks && t->pretoks[t->n_pretoks - 1].kind == RS_TOK_PRE_BYTELEVEL && (rc = init_byte_level(l)) != RS_OK)
        return rc;
    if ((rc = load_added(l, get(root, "added_tokens"))) != RS_OK) return rc;
    if ((rc = build_added(l)) != RS_OK) return rc;
    if (post && (rc = load_post(l, post, "post_processor")) != RS_OK) return rc;
    if (dec) {
        if ((rc = load_decoder(l, dec, "decoder")) != RS_OK) return rc;
        t->has_decoder = true;
    }
    build_ids(l, max_model_id);
    if ((rc = check_vocab_ids(l)) != RS_OK) return rc;
    for (size_t i = 0; i < t->n_tpl; i++) /* a template may only add tokens that exist */
        for (size_t k = 0; k < t->tpl[i].n_ids; k++)
            if (t->tpl[i].ids[k] >= t->n_ids || !t->id_str[t->tpl[i].ids[k]])
                return fail(l, RS_EFORMAT, "post_processor", "special token id %d is not a token", t->tpl[i].ids[k]);
    t->bos = -1;
    rs_tok_bpe_init_cache(&t->bpe);
    return RS_OK;
}

static rs_tok *tok_new(void) {
    rs_tok *t = rs_xcalloc(1, sizeof *t);
    t->bpe.unk_id = -1;
    for (int b = 0; b < 256; b++) t->bpe.fallback_id[b] = t->bpe.byte_id[b] = -1;
    return t;
}

int rs_tok_load_json(const char *json, size_t len, const char *name, rs_tok **out, rs_error *err) {
    *out = NULL;
    json_error_t jerr;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &jerr);
    if (!root)
        return rs_error_set(err, RS_EFORMAT, NULL, "%s: %s (line %d, column %d)", name, jerr.text, jerr.line, jerr.column);
    rs_tok *t = tok_new();
    snprintf(t->path, sizeof t->path, "%s", name);
    ld l = {.file = name, .err = err, .t = t};
    int rc = load_root(&l, root);
    json_decref(root);
    if (rc != RS_OK) {
        rs_tok_free(t);
        return rc;
    }
    *out = t;
    return RS_OK;
}

/* ---- the model directory's config files ---- */

static int read_json_file(const char *path, json_t **out, rs_error *err) {
    struct stat st;
    *out = NULL;
    if (stat(path, &st) != 0) return RS_ENOTFOUND;
    if ((unsigned long long)st.st_size > TOK_MAX_FILE)
        return rs_error_set(err, RS_EFORMAT, NULL, "%s: %lld bytes, over the %u-byte limit", path, (long long)st.st_size, TOK_MAX_FILE);
    json_error_t jerr;
    *out = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!*out) return rs_error_set(err, RS_EFORMAT, NULL, "%s: %s (line %d, column %d)", path, jerr.text, jerr.line, jerr.column);
    if (!json_is_object(*out)) {
        json_decref(*out);
        *out = NULL;
        return rs_error_set(err, RS_EFORMAT, NULL, "%s: the top level is not an object", path);
    }
    return RS_OK;
}

/* bos_token / eos_token: a string, or an AddedToken object with "content". -1: absent or null. */
static int config_token(const ld *l, const json_t *cfg, const char *k, int32_t *id) {
    json_t *v = get(cfg, k);
    *id = -1;
    if (!v) return RS_OK;
    if (json_is_object(v)) v = get(v, "content");
    if (!json_is_string(v)) return fail(l, RS_EFORMAT, k, "must be a string or {\"content\": ...}");
    *id = rs_tok_token_to_id(l->t, json_string_value(v), json_string_length(v));
    if (*id < 0) return fail(l, RS_EFORMAT, k, "\"%.60s\" is not in the vocabulary", json_string_value(v));
    return RS_OK;
}

static void add_eos(rs_tok *t, int32_t id) {
    for (int i = 0; i < t->n_eos; i++)
        if (t->eos[i] == id) return;
    if (t->n_eos < RS_TOK_MAX_EOS) t->eos[t->n_eos++] = id;
}

static int check_added_decoder(const ld *l, const json_t *dec) {
    char key[KEYLEN];
    const char *k;
    json_t *v;
    if (!json_is_object(dec)) return fail(l, RS_EFORMAT, "added_tokens_decoder", "must be an object");
    json_object_foreach((json_t *)dec, k, v) {
        sub(key, "added_tokens_decoder", k);
        char *end;
        errno = 0;
        long id = strtol(k, &end, 10);
        json_t *c = get(v, "content");
        if (*k == '\0' || *end != '\0' || errno || id < 0 || !json_is_string(c))
            return fail(l, RS_EFORMAT, key, "must map an id to {\"content\": ...}");
        int32_t have = rs_tok_token_to_id(l->t, json_string_value(c), json_string_length(c));
        if (have != id)
            return fail(l, RS_EUNSUPPORTED, key, "\"%.60s\" is not token %ld of tokenizer.json (adding tokens is not supported)",
                        json_string_value(c), id);
    }
    return RS_OK;
}

/* tokenizer_config.json as transformers 5's TokenizersBackend applies it. */
static int apply_tokenizer_config(ld *l, const json_t *cfg) {
    rs_tok *t = l->t;
    int rc;
    bool split_special;
    if ((rc = get_bool(l, cfg, "", "split_special_tokens", false, &split_special)) != RS_OK) return rc;
    t->encode_special_tokens = split_special;
    json_t *dec = get(cfg, "added_tokens_decoder");
    if (dec && (rc = check_added_decoder(l, dec)) != RS_OK) return rc;
    int32_t bos, eos;
    if ((rc = config_token(l, cfg, "bos_token", &bos)) != RS_OK) return rc;
    if ((rc = config_token(l, cfg, "eos_token", &eos)) != RS_OK) return rc;
    if (bos >= 0) t->bos = bos;
    if (eos >= 0) add_eos(t, eos);
    /* add_bos_token / add_eos_token: transformers 5 drops them when tokenizer.json exists
     * (PreTrainedTokenizerBase._from_pretrained), so the file's post-processor decides; without
     * one it installs "$A", which adds nothing either. */
    return RS_OK;
}

static int apply_generation_config(ld *l, const json_t *cfg) {
    rs_tok *t = l->t;
    json_t *eos = get(cfg, "eos_token_id"), *bos = get(cfg, "bos_token_id");
    int32_t tok_eos[RS_TOK_MAX_EOS];
    int n_tok = t->n_eos;
    memcpy(tok_eos, t->eos, sizeof tok_eos);
    t->n_eos = 0;
    if (json_is_integer(eos)) {
        if (json_integer_value(eos) < 0 || json_integer_value(eos) >= t->n_ids)
            return fail(l, RS_EFORMAT, "eos_token_id", "%lld is not a token id", (long long)json_integer_value(eos));
        add_eos(t, (int32_t)json_integer_value(eos));
    } else if (json_is_array(eos)) {
        for (size_t i = 0; i < json_array_size(eos); i++) {
            json_t *e = json_array_get(eos, i);
            if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) >= t->n_ids)
                return fail(l, RS_EFORMAT, "eos_token_id", "element %zu is not a token id", i);
            add_eos(t, (int32_t)json_integer_value(e));
        }
    } else if (eos) {
        return fail(l, RS_EFORMAT, "eos_token_id", "must be an id or a list of ids");
    }
    for (int i = 0; i < n_tok; i++) add_eos(t, tok_eos[i]);
    if (bos) {
        if (!json_is_integer(bos) || json_integer_value(bos) < 0 || json_integer_value(bos) >= t->n_ids)
            return fail(l, RS_EFORMAT, "bos_token_id", "must be a token id");
        if (t->bos < 0) t->bos = (int32_t)json_integer_value(bos);
    }
    return RS_OK;
}

static int read_file(const char *path, char **buf, size_t *len, rs_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return rs_error_set(err, RS_EIO, NULL, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || (unsigned long long)st.st_size > TOK_MAX_FILE) {
        fclose(f);
        return rs_error_set(err, RS_EFORMAT, NULL, "%s: unreadable or over the %u-byte limit", path, TOK_MAX_FILE);
    }
    *len = (size_t)st.st_size;
    *buf = rs_xmalloc(*len + 1);
    size_t got = fread(*buf, 1, *len, f);
    fclose(f);
    if (got != *len) {
        free(*buf);
        return rs_error_set(err, RS_EIO, NULL, "cannot read %s", path);
    }
    return RS_OK;
}

int rs_tok_load(const char *dir, rs_tok **out, rs_error *err) {
    char path[4096];
    *out = NULL;
    if (snprintf(path, sizeof path, "%s/tokenizer.json", dir) >= (int)sizeof path)
        return rs_error_set(err, RS_EINVAL, NULL, "path too long: %.200s", dir);
    struct stat st;
    if (stat(path, &st) != 0)
        return rs_error_set(err, RS_ENOTFOUND, NULL, "%s has no tokenizer.json: token ids only", dir);
    char *buf = NULL;
    size_t len = 0;
    int rc = read_file(path, &buf, &len, err);
    if (rc != RS_OK) return rc;
    rs_tok *t;
    rc = rs_tok_load_json(buf, len, path, &t, err);
    free(buf);
    if (rc != RS_OK) return rc;
    json_t *cfg = NULL;
    const char *names[2] = {"tokenizer_config.json", "generation_config.json"};
    for (int f = 0; f < 2 && rc == RS_OK; f++) {
        char cpath[4096];
        snprintf(cpath, sizeof cpath, "%s/%s", dir, names[f]);
        int r = read_json_file(cpath, &cfg, err);
        if (r == RS_ENOTFOUND) continue;
        if (r != RS_OK) {
            rc = r;
            break;
        }
        ld l = {.file = cpath, .err = err, .t = t};
        rc = f == 0 ? apply_tokenizer_config(&l, cfg) : apply_generation_config(&l, cfg);
        json_decref(cfg);
    }
    if (rc != RS_OK) {
        rs_tok_free(t);
        return rc;
    }
    *out = t;
    return RS_OK;
}

/* ---- free ---- */

void rs_tok_free(rs_tok *t) {
    if (!t) return;
    for (size_t i = 0; i < t->n_norms; i++) {
        rs_tok_regex_free(t->norms[i].re);
        free(t->norms[i].str);
    }
    free(t->norms);
    for (size_t i = 0; i < t->n_pretoks; i++) rs_tok_regex_free(t->pretoks[i].re);
    free(t->pretoks);
    rs_tok_bpe_free(&t->bpe);
    for (size_t i = 0; i < t->n_added; i++) {
        free(t->added[i].content);
        free(t->added[i].norm);
    }
    free(t->added);
    rs_tok_strmap_free(&t->added_map);
    rs_tok_trie_free(&t->trie);
    rs_tok_trie_free(&t->trie_norm);
    tpl_free(t->tpl, t->n_tpl);
    for (size_t i = 0; i < t->n_decs; i++) {
        rs_tok_regex_free(t->decs[i].re);
        free(t->decs[i].str);
    }
    free(t->decs);
    free(t->id_str);
    free(t->id_len);
    free(t->id_special);
    free(t);
}
