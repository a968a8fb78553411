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

/* The naive reference: the first k at which decode(ids[0, k]) contains a stop string, with the
 * earliest match position (the longest string on a tie). -1 when none. */
static int naive_stop(const rs_tok *tok, const int32_t *ids, int n, bool skip, char *const *stops, int n_stops,
                      int *stop_index, size_t *pos) {
    for (int k = 1; k <= n; k++) {
        char *text = rs_tok_decode(tok, ids, (size_t)k, skip, NULL);
        int best = -1;
        size_t best_pos = 0;
        for (int i = 0; i < n_stops; i++) {
            const char *hit = strstr(text, stops[i]);
            if (!hit) continue;
            size_t at = (size_t)(hit - text);
            if (best < 0 || at < best_pos || (at == best_pos && strlen(stops[i]) > strlen(stops[best])))
                best = i, best_pos = at;
        }
        free(text);
        if (best >= 0) {
            *stop_index = best;
            *pos = best_pos;
            return k;
        }
    }
    return -1;
}

static void run_case(const rs_tok *tok, const int32_t *ids, int n, char **stops, int n_stops, bool skip,
                     bool no_stop_trim) {
    int want_index = -1;
    size_t want_pos = 0;
    int want_k = naive_stop(tok, ids, n, skip, stops, n_stops, &want_index, &want_pos);

    rs_gen_text *t = rs_gen_text_new(tok);
    t->skip_special_tokens = skip;
    t->no_stop_trim = no_stop_trim;
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
    char *ref = rs_tok_decode(tok, ids, (size_t)(got_k > 0 ? got_k : n), skip, NULL);
    size_t ref_len = strlen(ref);
    if (got_k > 0) ref_len = no_stop_trim ? want_pos + strlen(stops[want_index]) : want_pos;
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
        bool skip = c % 2 == 0;
        char *ref = rs_tok_decode(tok, ids, (size_t)n, skip, NULL);
        size_t rl = strlen(ref);
        char *stops[3];
        int n_stops = 0;
        /* a piece of the reference from a random point: it often spans tokens; cut at a character */
        if (rl > 4) {
            size_t a = rnd(&seed) % (rl - 2), l = 1 + rnd(&seed) % 6;
            while (a > 0 && ((unsigned char)ref[a] & 0xc0) == 0x80) a--;
            if (a + l > rl) l = rl - a;
            while (a + l < rl && ((unsigned char)ref[a + l] & 0xc0) == 0x80) l++;
            stops[n_stops] = strndup(ref + a, l);
            /* U+FFFD (a byte that is not UTF-8) is text only once the next token shows it is one:
             * a stop string holding it is matched a token later than a re-decode would (gen_text.h) */
            if (strstr(stops[n_stops], "\xef\xbf\xbd")) free(stops[n_stops]);
            else n_stops++, spanning++;
        }
        stops[n_stops++] = strdup("</answer>");
        stops[n_stops++] = strdup("\xe2\x9c\x93never"); /* "✓never" does not occur */
        int want_index;
        size_t want_pos;
        if (naive_stop(tok, ids, n, skip, stops, n_stops, &want_index, &want_pos) > 0) cases_with_match++;
        run_case(tok, ids, n, stops, n_stops, skip, c % 4 >= 2);
        for (int i = 0; i < n_stops; i++) free(stops[i]);
        free(ref);
    }
    ASSERT_TRUE(cases_with_match > 150 && spanning > 150); /* the cases do exercise matches */
    free(enc);
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
