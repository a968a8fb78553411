/*
 * test_gen_text.c — outputs' text and stop strings (protocol/gen_text.h) against a naive
 * reference: after every token, decode the whole output again (rs_tok_decode, itself checked
 * against Hugging Face tokenizers in test_tokenizer and tests/e2e/test_tokenizer_hf.py) and search
 * it with strstr for every stop string. The incremental matcher must stop on the same token, at
 * the same position, with the same string; what it shows while running must always be a prefix of
 * the final text; and the final text must be the reference text cut as SGLang cuts it.
 *
 * Token sequences are random ids of the embedded default tokenizer (byte-level BPE, so lone
 * bytes of multi-byte characters are common) mixed with ids from a real encoding, and stop strings
 * are pieces of the reference text taken across token boundaries, plus strings that never occur.
 */
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "../../protocol/gen_text.h"
#include "test.h"

static rs_tok *default_tok(void) {
    size_t n;
    const char *json = rs_tok_default_json(&n);
    rs_tok *t = NULL;
    rs_error err = {0};
    if (rs_tok_load_json(json, n, "default", &t, &err) != RS_OK) RS_TEST_FAIL("load: %s", err.message);
    return t;
}

static uint32_t rnd(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

/* A job of one output holding ids[0, n) as if the engine had produced them. */
static rs_gen_job *fake_job(const int32_t *ids, int n) {
    rs_gen_job *j = rs_gen_job_new();
    j->n_prompts = 1;
    j->prompts = calloc(1, sizeof(int32_t *));
    j->prompt_lens = calloc(1, sizeof(int));
    j->outputs = calloc(1, sizeof(rs_gen_output));
    j->outputs[0].output_ids = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    memcpy(j->outputs[0].output_ids, ids, sizeof(int32_t) * (size_t)n);
    return j;
}

/* The naive reference, SGLang's check_finished: the first k at which decode(ids[0, k]) contains a
 * stop string, and the first stop string in list order that it contains, at its first
 * occurrence. -1 when none. */
static int naive_stop(const rs_tok *tok, const int32_t *ids, int n, bool skip, char *const *stops, int n_stops,
                      int *stop_index, size_t *pos) {
    for (int k = 1; k <= n; k++) {
        char *text = rs_tok_decode(tok, ids, (size_t)k, skip, NULL);
        for (int i = 0; i < n_stops; i++) {
            const char *hit = strstr(text, stops[i]);
            if (!hit) continue;
            *stop_index = i;
            *pos = (size_t)(hit - text);
            free(text);
            return k;
        }
        free(text);
    }
    return -1;
}

/* see_special: stops are searched in the text with special tokens kept (/generate), and the
 * answer's text (skip_special_tokens = skip) is cut at the stop's first occurrence in it, if any. */
static void run_case_ex(const rs_tok *tok, const int32_t *ids, int n, char **stops, int n_stops, bool skip,
                        bool no_stop_trim, bool see_special) {
    int want_index = -1;
    size_t want_pos = 0;
    int want_k = naive_stop(tok, ids, n, see_special ? false : skip, stops, n_stops, &want_index, &want_pos);

    rs_gen_text *t = rs_gen_text_new(tok);
    t->skip_special_tokens = skip;
    t->no_stop_trim = no_stop_trim;
    t->stops_see_special = see_special;
    rs_error err = {0};
    for (int i = 0; i < n_stops; i++) ASSERT_EQ(rs_gen_text_add_stop(t, stops[i], strlen(stops[i]), "stop", &err), RS_OK);
    rs_gen_job *job = fake_job(ids, n);
    rs_gen_text_attach(t, job);
    rs_gen_output *o = &job->outputs[0];
    char shown[4096] = "";
    size_t n_shown = 0;
    int got_k = -1, got_index = -1;
    for (int k = 1; k <= n; k++) {
        o->n_output = k;
        int r = job->on_token(job, 0, ids[k - 1], job->on_token_user);
        const char *text;
        size_t stable = rs_gen_text_stable(t, job, 0, &text);
        ASSERT_TRUE(stable >= n_shown && stable < sizeof shown); /* shown text only grows */
        ASSERT_TRUE(memcmp(text, shown, n_shown) == 0);
        memcpy(shown, text, stable);
        n_shown = stable;
        if (r >= 0) {
            got_k = k, got_index = r;
            break;
        }
    }
    ASSERT_EQ(got_k, want_k);
    ASSERT_EQ(got_index, want_index);
    o->finish.type = got_k > 0 ? RS_FINISH_STOP : RS_FINISH_LENGTH;
    o->finish.matched = -1;
    o->finish.matched_text = got_k > 0 ? got_index + 1 : 0;
    size_t len;
    const char *final = rs_gen_text_get(t, job, 0, &len);
    size_t ref_len;
    char *ref = rs_tok_decode(tok, ids, (size_t)(got_k > 0 ? got_k : n), skip, &ref_len);
    if (got_k > 0 && see_special && skip) {
        const char *hit = strstr(ref, stops[want_index]);
        if (hit) ref_len = (size_t)(hit - ref) + (no_stop_trim ? strlen(stops[want_index]) : 0);
    } else if (got_k > 0) {
        ref_len = no_stop_trim ? want_pos + strlen(stops[want_index]) : want_pos;
    }
    ASSERT_EQ(len, ref_len);
    ASSERT_TRUE(memcmp(final, ref, len) == 0);
    ASSERT_TRUE(n_shown <= len && memcmp(final, shown, n_shown) == 0); /* what streamed is a prefix */
    if (got_k > 0) ASSERT_STREQ(rs_gen_text_stop_string(t, &o->finish), stops[want_index]);
    free(ref);
    rs_gen_job_free(job);
    rs_gen_text_free(t);
}


RS_TEST(gen_text_stops_match_a_naive_redecode) {
    rs_tok *tok = default_tok();
    const char *corpus = "The answer is <answer>42</answer>. 你好，世界! Ünïcödé 🙂👍🏽 done\n\tok";
    int32_t *enc;
    size_t n_enc;
    rs_error err = {0};
    ASSERT_EQ(rs_tok_encode(tok, corpus, strlen(corpus), false, &enc, &n_enc, &err), RS_OK);
    uint32_t seed = 12345;
    int cases_with_match = 0, spanning = 0;
    for (int c = 0; c < 400; c++) {
        int32_t ids[40];
        int n = 8 + (int)(rnd(&seed) % 32);
        for (int i = 0; i < n; i++) /* runs of the real encoding, random ids, and special tokens */
            ids[i] = c % 3 == 0 ? (int32_t)(rnd(&seed) % 8192)
                     : c % 3 == 1 ? enc[(size_t)(i + c) % n_enc]
                                  : (rnd(&seed) % 5 == 0 ? (int32_t)(rnd(&seed) % 4) : enc[(size_t)(i + c) % n_enc]);
        bool skip = c % 2 == 0, see_special = c % 8 >= 4;
        char *ref = rs_tok_decode(tok, ids, (size_t)n, see_special ? false : skip, NULL);
        size_t rl = strlen(ref);
        char *stops[3];
        int n_stops = 0;
        /* a piece of the reference from a random point: it often spans tokens; cut at a character */
        if (rl > 4) {
            size_t a = rnd(&seed) % (rl - 2), l = 1 + rnd(&seed) % 6;
            while (a > 0 && ((unsigned char)ref[a] & 0xc0) == 0x80) a--;
            if (a + l > rl) l = rl - a;
            while (a + l < rl && ((unsigned char)ref[a + l] & 0xc0) == 0x80) l++;
            stops[n_stops++] = strndup(ref + a, l); /* U+FFFD included: a re-decode reads it at once */
            spanning++;
        }
        stops[n_stops++] = strdup("</answer>");
        stops[n_stops++] = strdup("\xe2\x9c\x93never"); /* "✓never" does not occur */
        int want_index;
        size_t want_pos;
        if (naive_stop(tok, ids, n, skip, stops, n_stops, &want_index, &want_pos) > 0) cases_with_match++;
        run_case_ex(tok, ids, n, stops, n_stops, skip, c % 4 >= 2, see_special);
        for (int i = 0; i < n_stops; i++) free(stops[i]);
        free(ref);
    }
    ASSERT_TRUE(cases_with_match > 150 && spanning > 150); /* the cases do exercise matches */
    free(enc);
    rs_tok_free(tok);
}

/* Stop regexes: the naive reference compiles each pattern on its own and, after every token,
 * searches the whole re-decoded output from its start (no partial matching, nothing carried
 * over): the first token on which any regex matches, the first regex in the request's order that
 * does, and its leftmost match. The incremental matcher must agree on all three, show only
 * prefixes of the final text while it runs, and cut the text where the match starts (or, with
 * no_stop_trim, ends). The patterns cover what makes incremental search subtle: matches that
 * span tokens, unbounded repeats, lazy repeats, alternation, lookahead and lookbehind, $ at the
 * end of the text, Unicode properties, and a pattern that can match the empty string. */
static int naive_regex(const rs_tok *tok, const int32_t *ids, int n, bool skip, const char *const *pats, int n_pats,
                       int *which, size_t *ms, size_t *me) {
    pcre2_code *code[8];
    pcre2_match_data *md = pcre2_match_data_create(8, NULL);
    for (int i = 0; i < n_pats; i++) {
        int ec;
        PCRE2_SIZE eo;
        code[i] = pcre2_compile((PCRE2_SPTR)pats[i], PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
        RS_ASSERT(code[i]);
    }
    int found = -1;
    for (int k = 1; k <= n && found < 0; k++) {
        size_t tl;
        char *text = rs_tok_decode(tok, ids, (size_t)k, skip, &tl); /* random ids may decode to a NUL byte */
        for (int i = 0; i < n_pats; i++) {
            if (pcre2_match(code[i], (PCRE2_SPTR)text, tl, 0, 0, md, NULL) < 0) continue;
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            *which = i, *ms = ov[0], *me = ov[1], found = k;
            break;
        }
        free(text);
    }
    for (int i = 0; i < n_pats; i++) pcre2_code_free(code[i]);
    pcre2_match_data_free(md);
    return found;
}

RS_TEST(gen_text_stop_regex_matches_a_full_search) {
    rs_tok *tok = default_tok();
    const char *corpus = "The answer is <answer>42</answer>. 3.14 and 2.5. 你好，世界! ÜNÏCÖDÉ 🙂👍🏽 done\n\tok ok";
    static const char *const pool[] = {
        "\\d+\\.\\d", "<answer>.*?</answer>", "(?<=is )\\w+", "[A-Z]{3,}", "ok$",  "wor(?=ld)",
        "\\p{Han}{2}",  "x{3}|qq",              "é|🙂",          "a(?!n)",    "z*",   "\\s\\S+\\s\\d",
    };
    const int n_pool = (int)(sizeof pool / sizeof pool[0]);
    int32_t *enc;
    size_t n_enc;
    rs_error err = {0};
    ASSERT_EQ(rs_tok_encode(tok, corpus, strlen(corpus), false, &enc, &n_enc, &err), RS_OK);
    uint32_t seed = 777;
    int matched = 0, late = 0;
    for (int c = 0; c < 600; c++) {
        int32_t ids[48];
        int n = 8 + (int)(rnd(&seed) % 40);
        int off = (int)(rnd(&seed) % n_enc);
        for (int i = 0; i < n; i++)
            ids[i] = c % 4 == 0 ? (int32_t)(rnd(&seed) % 8192) : enc[(size_t)(off + i) % n_enc];
        const char *pats[3];
        int n_pats = 1 + (int)(rnd(&seed) % 3);
        for (int i = 0; i < n_pats; i++) {
            pats[i] = pool[rnd(&seed) % (uint32_t)n_pool];
            if (strcmp(pats[i], "z*") == 0 && c % 7 != 0) pats[i] = pool[0]; /* it matches at once: now and then */
        }
        const bool skip = c % 2 == 0, trim = c % 3 != 0;
        int want_which = -1;
        size_t want_ms = 0, want_me = 0;
        int want_k = naive_regex(tok, ids, n, skip, pats, n_pats, &want_which, &want_ms, &want_me);

        rs_gen_text *t = rs_gen_text_new(tok);
        t->skip_special_tokens = skip;
        t->no_stop_trim = !trim;
        for (int i = 0; i < n_pats; i++)
            ASSERT_EQ(rs_gen_text_add_stop_regex(t, pats[i], strlen(pats[i]), "stop_regex", &err), RS_OK);
        rs_gen_job *job = fake_job(ids, n);
        rs_gen_text_attach(t, job);
        rs_gen_output *o = &job->outputs[0];
        char shown[4096] = "";
        size_t n_shown = 0;
        int got_k = -1, got = -1;
        for (int k = 1; k <= n; k++) {
            o->n_output = k;
            int r = job->on_token(job, 0, ids[k - 1], job->on_token_user);
            const char *text;
            size_t stable = rs_gen_text_stable(t, job, 0, &text);
            ASSERT_TRUE(stable >= n_shown && stable < sizeof shown);
            ASSERT_TRUE(memcmp(text, shown, n_shown) == 0);
            memcpy(shown, text, stable);
            n_shown = stable;
            if (r >= 0) {
                got_k = k, got = r;
                break;
            }
        }
        ASSERT_EQ(got_k, want_k);
        if (want_k > 0) {
            ASSERT_EQ(got, RS_GEN_TEXT_REGEX_STOP(want_which));
            matched++;
            late += want_k > 3;
        }
        o->finish.type = got_k > 0 ? RS_FINISH_STOP : RS_FINISH_LENGTH;
        o->finish.matched = -1;
        o->finish.matched_text = got_k > 0 ? got + 1 : 0;
        size_t len;
        const char *final = rs_gen_text_get(t, job, 0, &len);
        size_t full;
        char *ref = rs_tok_decode(tok, ids, (size_t)(got_k > 0 ? got_k : n), skip, &full);
        size_t ref_len = got_k > 0 ? (trim ? want_ms : want_me) : full;
        ASSERT_EQ(len, ref_len);
        ASSERT_TRUE(memcmp(final, ref, len) == 0);
        ASSERT_TRUE(n_shown <= len && memcmp(final, shown, n_shown) == 0);
        if (got_k > 0) ASSERT_STREQ(rs_gen_text_stop_string(t, &o->finish), pats[want_which]);
        free(ref);
        rs_gen_job_free(job);
        rs_gen_text_free(t);
    }
    ASSERT_TRUE(matched > 250 && late > 150); /* the cases do exercise matches, and late ones */
    free(enc);
    rs_tok_free(tok);
}

/* A stop string and a stop regex completed by the same token: the string wins (SGLang checks
 * strings first). A pattern that does not compile is a 400 naming it; the limits hold; a search
 * that exceeds its step limit gives that regex up instead of stalling the engine. */
RS_TEST(gen_text_stop_regex_order_errors_and_limits) {
    rs_tok *tok = default_tok();
    const char *s = "say 12 then stop";
    int32_t *ids;
    size_t n;
    rs_error err = {0};
    ASSERT_EQ(rs_tok_encode(tok, s, strlen(s), false, &ids, &n, &err), RS_OK);
    rs_gen_text *t = rs_gen_text_new(tok);
    ASSERT_EQ(rs_gen_text_add_stop_regex(t, "st.p", 4, "stop_regex", &err), RS_OK);
    ASSERT_EQ(rs_gen_text_add_stop(t, "stop", 4, "stop", &err), RS_OK);
    ASSERT_EQ(rs_gen_text_add_stop_regex(t, "", 0, "stop_regex[1]", &err), RS_OK); /* ignored */
    ASSERT_EQ(t->n_regexes, 1);
    rs_gen_job *job = fake_job(ids, (int)n);
    rs_gen_text_attach(t, job);
    int r = -1;
    for (size_t k = 0; k < n && r < 0; k++) {
        job->outputs[0].n_output = (int)k + 1;
        r = job->on_token(job, 0, ids[k], t);
    }
    ASSERT_EQ(r, 0); /* the stop string, not RS_GEN_TEXT_REGEX_STOP(0) */
    rs_gen_job_free(job);

    ASSERT_EQ(rs_gen_text_add_stop_regex(t, "a(b", 3, "stop_regex[2]", &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "stop_regex[2]");
    ASSERT_TRUE(strstr(err.message, "not a valid regular expression") != NULL);
    /* \C matches one byte, so a match could end (or, after \K, start) inside a UTF-8 character */
    ASSERT_EQ(rs_gen_text_add_stop_regex(t, "\\C\\C", 4, "stop_regex[2]", &err), RS_EINVAL);
    ASSERT_TRUE(strstr(err.message, "not a valid regular expression") != NULL && strstr(err.message, "\\C"));
    for (int i = 1; i < RS_GEN_TEXT_MAX_REGEXES; i++) ASSERT_EQ(rs_gen_text_add_stop_regex(t, "q", 1, "x", &err), RS_OK);
    ASSERT_EQ(rs_gen_text_add_stop_regex(t, "q", 1, "stop_regex[16]", &err), RS_EINVAL);
    rs_gen_text_free(t);

    /* catastrophic backtracking: (a+)+b over a run of a's never matches, and each search is cut
     * at the step limit; the output then runs on (no stop) instead of stalling every step */
    rs_tok_stop_re *re;
    ASSERT_EQ(rs_tok_stop_re_compile("(a+)+b", 6, "stop_regex", &re, &err), RS_OK);
    char as[64];
    memset(as, 'a', sizeof as);
    size_t from = 0, ms, me;
    ASSERT_EQ(rs_tok_stop_re_find(re, as, sizeof as, &from, &ms, &me), RS_ETOOBIG);
    ASSERT_EQ(from, 0);
    from = 0;
    ASSERT_EQ(rs_tok_stop_re_find(re, "aab", 3, &from, &ms, &me), 1);
    ASSERT_TRUE(ms == 0 && me == 3);
    from = 0;
    ASSERT_EQ(rs_tok_stop_re_find(re, "xxaa", 4, &from, &ms, &me), 0); /* partial from 2 on */
    ASSERT_EQ(from, 2);
    rs_tok_stop_re_free(re);
    free(ids);
    rs_tok_free(tok);
}

/* A stop string whose bytes arrive over several tokens (one character per token here) is found on
 * the token that completes it; until then the part that could still become it is held back. */
RS_TEST(gen_text_stop_spanning_tokens_and_holdback) {
    rs_tok *tok = default_tok();
    const char *s = "ab</answer>cd";
    int32_t ids[16];
    int n = 0;
    for (const char *p = s; *p; p++) {
        int32_t *one;
        size_t k;
        rs_error err = {0};
        ASSERT_EQ(rs_tok_encode(tok, p, 1, false, &one, &k, &err), RS_OK);
        ASSERT_EQ(k, 1);
        ids[n++] = one[0];
        free(one);
    }
    rs_gen_text *t = rs_gen_text_new(tok);
    rs_error err = {0};
    ASSERT_EQ(rs_gen_text_add_stop(t, "</answer>", 9, "stop", &err), RS_OK);
    ASSERT_EQ(rs_gen_text_add_stop(t, "", 0, "stop", &err), RS_OK); /* ignored */
    ASSERT_EQ(t->n_stops, 1);
    rs_gen_job *job = fake_job(ids, n);
    rs_gen_text_attach(t, job);
    const char *text;
    for (int k = 1; k <= 10; k++) {
        job->outputs[0].n_output = k;
        ASSERT_EQ(job->on_token(job, 0, ids[k - 1], t), -1);
        size_t st = rs_gen_text_stable(t, job, 0, &text);
        ASSERT_EQ(st, k < 2 ? (size_t)k : 2); /* "ab" is final; "</answe" may still be the stop string */
    }
    job->outputs[0].n_output = 11;
    ASSERT_EQ(job->on_token(job, 0, ids[10], t), 0);
    ASSERT_EQ(rs_gen_text_stable(t, job, 0, &text), 2);
    job->outputs[0].finish = (rs_finish){.type = RS_FINISH_STOP, .matched = -1, .matched_text = 1};
    size_t len;
    text = rs_gen_text_get(t, job, 0, &len);
    ASSERT_EQ(len, 2);
    ASSERT_TRUE(memcmp(text, "ab", 2) == 0);
    /* the limits */
    char big[RS_GEN_TEXT_MAX_STOP_LEN + 2];
    memset(big, 'x', sizeof big);
    ASSERT_EQ(rs_gen_text_add_stop(t, big, sizeof big, "stop[3]", &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "stop[3]");
    for (int i = 1; i < RS_GEN_TEXT_MAX_STOPS; i++) ASSERT_EQ(rs_gen_text_add_stop(t, "y", 1, "stop", &err), RS_OK);
    ASSERT_EQ(rs_gen_text_add_stop(t, "z", 1, "stop[64]", &err), RS_EINVAL);
    rs_gen_job_free(job);
    rs_gen_text_free(t);
    rs_tok_free(tok);
}

/* A stop token or EOS ends the output without reaching the hook: the text is the tokens' before
 * it, and with no_stop_trim it also has the stop token's text (empty for a special token skipped).
 * The same without the hook (a plain answer without stop strings decodes the finished output). */
RS_TEST(gen_text_stop_token_trim) {
    rs_tok *tok = default_tok();
    int32_t *ids;
    size_t n;
    rs_error err = {0};
    ASSERT_EQ(rs_tok_encode(tok, "hi there", 8, false, &ids, &n, &err), RS_OK);
    for (int trim = 0; trim < 4; trim++) {
        const bool hooked = trim >= 2;
        for (int skip = 0; skip < 2; skip++) {
            rs_gen_text *t = rs_gen_text_new(tok);
            t->no_stop_trim = trim % 2 == 1;
            t->skip_special_tokens = skip == 1;
            int32_t all[16];
            memcpy(all, ids, sizeof(int32_t) * n);
            all[n] = 2; /* <|endoftext|> */
            rs_gen_job *job = fake_job(all, (int)n + 1);
            if (hooked) rs_gen_text_attach(t, job);
            for (size_t k = 0; hooked && k < n; k++) {
                job->outputs[0].n_output = (int)k + 1;
                ASSERT_EQ(job->on_token(job, 0, all[k], t), -1);
            }
            job->outputs[0].n_output = (int)n + 1; /* the stop token: the engine does not pass it */
            job->outputs[0].finish = (rs_finish){.type = RS_FINISH_STOP, .matched = 2};
            size_t len;
            const char *text = rs_gen_text_get(t, job, 0, &len);
            const char *want = t->no_stop_trim && !skip ? "hi there<|endoftext|>" : "hi there";
            ASSERT_EQ(len, strlen(want));
            ASSERT_TRUE(memcmp(text, want, len) == 0);
            ASSERT_TRUE(rs_gen_text_stop_string(t, &job->outputs[0].finish) == NULL);
            rs_gen_job_free(job);
            rs_gen_text_free(t);
        }
    }
    free(ids);
    rs_tok_free(tok);
}

/* A SentencePiece tokenizer with byte fallback (tests/fixtures/tokenizers/spm: Replace, ByteFallback,
 * Fuse, Strip(1, 0), as Llama 2's). */
static rs_tok *spm_tok(void) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tokenizers/spm", rs_test_fixtures_dir());
    rs_tok *t = NULL;
    rs_error err = {0};
    if (rs_tok_load(dir, &t, &err) != RS_OK) RS_TEST_FAIL("load %s: %s", dir, err.message);
    return t;
}

static int32_t *encode(const rs_tok *tok, const char *s, size_t *n) {
    int32_t *ids;
    rs_error err = {0};
    if (rs_tok_encode(tok, s, strlen(s), false, &ids, n, &err) != RS_OK) RS_TEST_FAIL("encode: %s", err.message);
    return ids;
}

/* Feeds ids[0, n) to t as output 0 of job until a stop; returns the token (1-based) that stopped it,
 * or 0. With `shown`, what a stream shows after each token that does not stop it
 * (rs_gen_text_stable) is left there. */
static int feed_shown(rs_gen_text *t, rs_gen_job *job, const int32_t *ids, int n, size_t *shown) {
    for (int k = 1; k <= n; k++) {
        job->outputs[0].n_output = k;
        if (job->on_token(job, 0, ids[k - 1], t) >= 0) {
            job->outputs[0].finish = (rs_finish){.type = RS_FINISH_STOP, .matched = -1, .matched_text = t->outs[0].stop + 1};
            return k;
        }
        const char *x;
        if (shown) *shown = rs_gen_text_stable(t, job, 0, &x);
    }
    job->outputs[0].finish = (rs_finish){.type = RS_FINISH_LENGTH};
    return 0;
}

static int feed(rs_gen_text *t, rs_gen_job *job, const int32_t *ids, int n) { return feed_shown(t, job, ids, n, NULL); }

/* A stop string inside a ByteFallback run (CJK written as <0xE4><0xB8><0xAD>...) is found on the
 * token that completes it, as a re-decode finds it (SGLang's check_finished), though the stream
 * holds the run until it ends; and an output that ends with the run held is searched with it. */
RS_TEST(gen_text_stop_inside_a_byte_fallback_run) {
    rs_tok *tok = spm_tok();
    size_t n;
    int32_t *ids = encode(tok, "\xe4\xb8\xad\xe6\x96\x87 x", &n); /* "中文 x": "▁", six byte tokens, "▁x" */
    ASSERT_TRUE(n == 8);
    const char *cases[][2] = {{"\xe4\xb8\xad", "4"}, {"\xe4\xb8\xad\xe6\x96\x87", "7"}, {"\xe6\x96\x87", "7"}};
    for (int c = 0; c < 3; c++) {
        rs_gen_text *t = rs_gen_text_new(tok);
        rs_error err = {0};
        ASSERT_EQ(rs_gen_text_add_stop(t, cases[c][0], strlen(cases[c][0]), "stop", &err), RS_OK);
        rs_gen_job *job = fake_job(ids, (int)n);
        rs_gen_text_attach(t, job);
        ASSERT_EQ(feed(t, job, ids, (int)n), atoi(cases[c][1]));
        size_t len;
        const char *text = rs_gen_text_get(t, job, 0, &len);
        const char *want = c == 2 ? "\xe4\xb8\xad" : "";
        ASSERT_EQ(len, strlen(want));
        ASSERT_TRUE(memcmp(text, want, len) == 0);
        rs_gen_job_free(job);
        rs_gen_text_free(t);
    }
    /* the run cut short (max_new_tokens 5): the output "中" + one byte of "文" holds no stop "文" */
    rs_gen_text *t = rs_gen_text_new(tok);
    rs_error err = {0};
    ASSERT_EQ(rs_gen_text_add_stop(t, "\xe6\x96\x87", 3, "stop", &err), RS_OK);
    rs_gen_job *job = fake_job(ids, 5);
    rs_gen_text_attach(t, job);
    ASSERT_EQ(feed(t, job, ids, 5), 0);
    size_t len;
    const char *text = rs_gen_text_get(t, job, 0, &len);
    char *ref = rs_tok_decode(tok, ids, 5, true, NULL); /* an invalid run: one U+FFFD per byte */
    ASSERT_EQ(len, strlen(ref));
    ASSERT_TRUE(memcmp(text, ref, len) == 0);
    free(ref);
    rs_gen_job_free(job);
    rs_gen_text_free(t);
    free(ids);
    rs_tok_free(tok);
}

/* An output is decoded after its prompt, as SGLang's and vLLM's detokenizers do: with a
 * SentencePiece tokenizer the first output token keeps its leading space (decode(prompt + output)
 * minus decode(prompt)), hooked or decoded at the end; a prompt ending inside a byte run leaves
 * nothing held for the output. */
RS_TEST(gen_text_output_is_decoded_after_the_prompt) {
    rs_tok *tok = spm_tok();
    size_t np, no;
    int32_t *prompt = encode(tok, "The answer is", &np);
    int32_t *out = encode(tok, "Hello world", &no); /* "▁Hello ▁world"-style pieces */
    int32_t all[64];
    ASSERT_TRUE(np + no < 64);
    memcpy(all, prompt, sizeof(int32_t) * np);
    memcpy(all + np, out, sizeof(int32_t) * no);
    char *whole = rs_tok_decode(tok, all, np + no, true, NULL), *head = rs_tok_decode(tok, prompt, np, true, NULL);
    const char *want = whole + strlen(head);
    ASSERT_STREQ(want, " Hello world");
    for (int hooked = 0; hooked < 2; hooked++) {
        rs_gen_text *t = rs_gen_text_new(tok);
        rs_gen_job *job = fake_job(out, (int)no);
        job->prompts[0] = malloc(sizeof(int32_t) * np);
        memcpy(job->prompts[0], prompt, sizeof(int32_t) * np);
        job->prompt_lens[0] = (int)np;
        job->outputs[0].n_output = (int)no;
        if (hooked) {
            rs_gen_text_attach(t, job);
            feed(t, job, out, (int)no);
        }
        job->outputs[0].finish = (rs_finish){.type = RS_FINISH_LENGTH};
        size_t len;
        const char *text = rs_gen_text_get(t, job, 0, &len);
        ASSERT_EQ(len, strlen(want));
        ASSERT_TRUE(memcmp(text, want, len) == 0);
        rs_gen_job_free(job);
        rs_gen_text_free(t);
    }
    /* a prompt that ends with the first byte of "中": the output's bytes alone decode as decode does */
    size_t nb;
    int32_t *bytes = encode(tok, "\xe4\xb8\xad", &nb); /* "▁" and three byte tokens */
    ASSERT_EQ(nb, 4);
    rs_tok_stream *s = rs_tok_stream_new(tok, true);
    rs_tok_stream_prime(s, bytes, 2);
    const char *d;
    rs_buf b = {0};
    for (int i = 2; i < 4; i++) {
        size_t k = rs_tok_stream_push(s, bytes[i], &d);
        ASSERT_EQ(rs_buf_append(&b, d, k), RS_OK);
    }
    size_t k = rs_tok_stream_finish(s, &d);
    ASSERT_EQ(rs_buf_append(&b, d, k), RS_OK);
    char *ref = rs_tok_decode(tok, bytes + 2, 2, true, NULL);
    ASSERT_EQ(b.len, strlen(ref));
    ASSERT_TRUE(memcmp(b.data, ref, b.len) == 0);
    free(ref);
    rs_buf_free(&b);
    rs_tok_stream_free(s);
    free(bytes);
    free(whole);
    free(head);
    free(prompt);
    free(out);
    rs_tok_free(tok);
}

/* /generate searches stops with special tokens kept, and cuts the answer's text (special tokens
 * skipped) at the stop's first occurrence there, which may come earlier: skipping a special token
 * can join a stop string ("m<|im_end|>i" reads "mi"). What streams must never pass that cut, for a
 * stop string and for a stop regex alike. */
RS_TEST(gen_text_stream_never_passes_a_cut_in_the_answer) {
    rs_tok *tok = default_tok();
    int32_t ids[32];
    int n = 0;
    const char *parts[] = {"m", "", "i", " and", " more", " text", " mi"};
    for (size_t p = 0; p < RS_ARRAY_LEN(parts); p++) {
        if (!parts[p][0]) {
            ids[n++] = 4; /* <|im_end|>, special */
            continue;
        }
        size_t k;
        int32_t *e = encode(tok, parts[p], &k);
        for (size_t j = 0; j < k; j++) ids[n++] = e[j];
        free(e);
    }
    for (int regex = 0; regex < 2; regex++) {
        rs_gen_text *t = rs_gen_text_new(tok);
        t->stops_see_special = true;
        rs_error err = {0};
        if (regex) ASSERT_EQ(rs_gen_text_add_stop_regex(t, "m\\s?i", 5, "stop_regex", &err), RS_OK);
        else ASSERT_EQ(rs_gen_text_add_stop(t, "mi", 2, "stop", &err), RS_OK);
        rs_gen_job *job = fake_job(ids, n);
        rs_gen_text_attach(t, job);
        size_t shown = 0, len;
        ASSERT_EQ(feed_shown(t, job, ids, n, &shown), n); /* the searched text holds the stop only at the end */
        rs_gen_text_get(t, job, 0, &len);
        ASSERT_EQ(len, 0);                /* the answer "mi and more text mi" is cut at its first "mi" */
        ASSERT_TRUE(shown <= len);        /* and nothing past it was shown */
        rs_gen_job_free(job);
        rs_gen_text_free(t);
    }
    rs_tok_free(tok);
}

/* A byte run longer than RS_GEN_TEXT_PEEK_MAX is not re-decoded at every token (that would cost
 * time quadratic in its length): a stop string that only its part past the bound holds is found
 * once the run ends, on the next token, and the text is cut as usual. */
RS_TEST(gen_text_long_byte_runs_are_searched_when_they_end) {
    rs_tok *tok = spm_tok();
    char text[2048];
    size_t n = 0;
    for (int i = 0; i < 300; i++) n += (size_t)snprintf(text + n, sizeof text - n, "\xe4\xb8\xad"); /* 中 x 300 */
    n += (size_t)snprintf(text + n, sizeof text - n, "\xe6\x96\x87 x");                            /* 文 x */
    size_t n_ids;
    int32_t *ids = encode(tok, text, &n_ids); /* "▁", 903 byte tokens, "▁x" */
    ASSERT_EQ(n_ids, 905);
    rs_gen_text *t = rs_gen_text_new(tok);
    rs_error err = {0};
    ASSERT_EQ(rs_gen_text_add_stop(t, "\xe6\x96\x87", 3, "stop", &err), RS_OK);
    rs_gen_job *job = fake_job(ids, (int)n_ids);
    rs_gen_text_attach(t, job);
    ASSERT_EQ(feed(t, job, ids, (int)n_ids), (int)n_ids); /* found with "▁x", which ends the run */
    size_t len;
    const char *out = rs_gen_text_get(t, job, 0, &len);
    ASSERT_EQ(len, 900); /* 中 x 300, cut before 文 */
    ASSERT_TRUE(memcmp(out, text, 900) == 0);
    rs_gen_job_free(job);
    rs_gen_text_free(t);
    free(ids);
    rs_tok_free(tok);
}
