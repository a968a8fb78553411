/*
 * test_tokenizer.c — the tokenizer module's own contracts (tokenizer/tokenizer.h). Agreement with
 * Hugging Face `tokenizers` on ids and decoded text is tests/e2e/test_tokenizer_hf.py's job; here:
 *   - load errors name the key path and the component; corrupt JSON and bad values are
 *     RS_EFORMAT, unimplemented parts RS_EUNSUPPORTED; a directory without tokenizer.json is the
 *     distinct RS_ENOTFOUND;
 *   - the streaming decoder: deltas are valid UTF-8 and concatenate to decode(ids), for every
 *     fixture, for random ids, and, with hand-written expectations, for an emoji and CJK split
 *     across byte-level tokens and byte-fallback tokens;
 *   - several threads encoding at once get the single-threaded ids;
 *   - invalid UTF-8 input is RS_EINVAL;
 *   - the default model's embedded tokenizer agrees with the model preset (8192 ids, bos, eos);
 *   - the stop-string helpers, on hand-checked cases.
 */
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../../core/rs.h"
#include "../../model/presets.h"
#include "../../tokenizer/tok_internal.h"
#include "../../tokenizer/tokenizer.h"
#include "test.h"

static const char *fixture(const char *name) {
    static char buf[8][512];
    static int k;
    char *p = buf[k++ & 7];
    snprintf(p, 512, "%s/tokenizers/%s", rs_test_fixtures_dir(), name);
    return p;
}

static rs_tok *load_fixture(const char *name) {
    rs_tok *t = NULL;
    rs_error err = {0};
    if (rs_tok_load(fixture(name), &t, &err) != RS_OK) RS_TEST_FAIL("load %s: %s", name, err.message);
    return t;
}

/* The corpus: one JSON string per line. */
static char **corpus(size_t *n, size_t **lens) {
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizers/corpus.txt", rs_test_fixtures_dir());
    FILE *f = fopen(path, "r");
    if (!f) RS_TEST_FAIL("cannot open %s", path);
    char **lines = NULL, *line = NULL;
    size_t cap = 0, lcap = 0;
    *n = 0;
    *lens = NULL;
    while (getline(&line, &lcap, f) > 0) {
        json_error_t je;
        json_t *s = json_loads(line, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
        if (!json_is_string(s)) RS_TEST_FAIL("corpus line %zu: %s", *n, je.text);
        if (*n == cap) {
            cap = cap ? 2 * cap : 512;
            lines = realloc(lines, cap * sizeof *lines);
            *lens = realloc(*lens, cap * sizeof **lens);
        }
        (*lens)[*n] = json_string_length(s);
        lines[*n] = malloc((*lens)[*n] + 1);
        memcpy(lines[*n], json_string_value(s), (*lens)[*n] + 1);
        (*n)++;
        json_decref(s);
    }
    free(line);
    fclose(f);
    return lines;
}

static void free_corpus(char **lines, size_t n, size_t *lens) {
    for (size_t i = 0; i < n; i++) free(lines[i]);
    free(lines);
    free(lens);
}

static bool valid_utf8(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    bool ok = j != NULL;
    json_decref(j);
    return ok;
}

/* ---- loader errors ---- */

static int load_text(const char *json, rs_error *err) {
    rs_tok *t = NULL;
    int rc = rs_tok_load_json(json, strlen(json), "tokenizer.json", &t, err);
    rs_tok_free(t);
    return rc;
}

#define TINY_MODEL "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\"]}"

RS_TEST(tokenizer_load_error_names_unsupported_component) {
    rs_error err = {0};
    const char *json = "{\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": ["
                       "{\"type\": \"Digits\", \"individual_digits\": true}, {\"type\": \"Whitespace\"}]}, " TINY_MODEL "}";
    ASSERT_EQ(load_text(json, &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "pre_tokenizer.pretokenizers[1].type");
    ASSERT_TRUE(strstr(err.message, "pre_tokenizer.pretokenizers[1].type") != NULL);
    ASSERT_TRUE(strstr(err.message, "\"Whitespace\" is not supported") != NULL);

    ASSERT_EQ(load_text("{\"normalizer\": {\"type\": \"BertNormalizer\"}, " TINY_MODEL "}", &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "normalizer.type");
    ASSERT_TRUE(strstr(err.message, "BertNormalizer") != NULL);
    ASSERT_EQ(load_text("{\"decoder\": {\"type\": \"WordPiece\"}, " TINY_MODEL "}", &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "decoder.type");
    ASSERT_EQ(load_text("{\"post_processor\": {\"type\": \"BertProcessing\"}, " TINY_MODEL "}", &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "post_processor.type");
    ASSERT_EQ(load_text("{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}", &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "model.type");
    ASSERT_EQ(load_text("{\"truncation\": {\"max_length\": 5}, " TINY_MODEL "}", &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "truncation");
    ASSERT_EQ(load_text("{\"model\": {\"type\": \"BPE\", \"dropout\": 0.1, \"vocab\": {}, \"merges\": []}}", &err),
              RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "model.dropout");
    /* a regex feature whose Unicode meaning differs between the engines */
    ASSERT_EQ(load_text("{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"\\\\w+\"}, "
                        "\"behavior\": \"Isolated\", \"invert\": false}, " TINY_MODEL "}",
                        &err),
              RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "pre_tokenizer.pattern.Regex");
    ASSERT_TRUE(strstr(err.message, "\\w is not supported") != NULL);
    /* ByteLevel must end the chain: the model reads its raw bytes */
    ASSERT_EQ(load_text("{\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"ByteLevel\", "
                        "\"add_prefix_space\": false, \"trim_offsets\": false}, {\"type\": \"Digits\", "
                        "\"individual_digits\": false}]}, " TINY_MODEL "}",
                        &err),
              RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "pre_tokenizer.pretokenizers[1]");
    /* a decoder the streaming decoder could not follow */
    ASSERT_EQ(load_text("{\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Fuse\"}, "
                        "{\"type\": \"ByteFallback\"}]}, " TINY_MODEL "}",
                        &err),
              RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "decoder.decoders[1]");
}

RS_TEST(tokenizer_load_error_bad_values) {
    rs_error err = {0};
    ASSERT_EQ(load_text("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0", &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "line 1") != NULL);
    ASSERT_EQ(load_text("[1, 2]", &err), RS_EFORMAT);
    ASSERT_EQ(load_text("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a c\"]}}", &err), RS_EFORMAT);
    ASSERT_STREQ(err.param, "model.merges[0]");
    ASSERT_TRUE(strstr(err.message, "\"c\" is not in the vocabulary") != NULL);
    ASSERT_EQ(load_text("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}", &err),
              RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "merged token") != NULL);
    ASSERT_EQ(load_text("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -1}, \"merges\": []}}", &err), RS_EFORMAT);
    ASSERT_STREQ(err.param, "model.vocab.a");
    ASSERT_EQ(load_text("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 0}, \"merges\": []}}", &err),
              RS_EFORMAT);
    ASSERT_EQ(load_text("{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, \"behavior\": "
                        "\"Isolated\", \"invert\": false}, " TINY_MODEL "}",
                        &err),
              RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "does not compile") != NULL);
    ASSERT_EQ(load_text("{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}, \"behavior\": "
                        "\"Sideways\", \"invert\": false}, " TINY_MODEL "}",
                        &err),
              RS_EFORMAT);
    ASSERT_STREQ(err.param, "pre_tokenizer.behavior");
    ASSERT_EQ(load_text("{\"added_tokens\": [{\"content\": \"x\"}], " TINY_MODEL "}", &err), RS_EFORMAT);
    ASSERT_STREQ(err.param, "added_tokens[0].single_word");
    ASSERT_EQ(load_text("{\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"vocab\": {}, \"merges\": []}}", &err),
              RS_EFORMAT);
    ASSERT_STREQ(err.param, "model.unk_token");
}

RS_TEST(tokenizer_load_corrupt_file_and_missing_dir) {
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/m", rs_test_tmpdir());
    mkdir(dir, 0700);
    rs_tok *t = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_tok_load(dir, &t, &err), RS_ENOTFOUND); /* a model directory without a tokenizer */
    ASSERT_TRUE(t == NULL);
    ASSERT_TRUE(strstr(err.message, "no tokenizer.json") != NULL);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0,", f);
    fclose(f);
    ASSERT_EQ(rs_tok_load(dir, &t, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, path) != NULL);
    /* a tokenizer_config.json that names a token tokenizer.json does not have */
    f = fopen(path, "w");
    fputs("{" TINY_MODEL "}", f);
    fclose(f);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    f = fopen(path, "w");
    fputs("{\"eos_token\": \"</s>\"}", f);
    fclose(f);
    ASSERT_EQ(rs_tok_load(dir, &t, &err), RS_EFORMAT);
    ASSERT_STREQ(err.param, "eos_token");
    f = fopen(path, "w");
    fputs("{\"added_tokens_decoder\": {\"7\": {\"content\": \"<x>\", \"special\": true}}}", f);
    fclose(f);
    ASSERT_EQ(rs_tok_load(dir, &t, &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "added_tokens_decoder.7");
    f = fopen(path, "w");
    fputs("{\"added_tokens_decoder\": {\"2\": {\"content\": \"ab\"}}}", f);
    fclose(f);
    ASSERT_EQ(rs_tok_load(dir, &t, &err), RS_OK);
    rs_tok_free(t);
}

RS_TEST(tokenizer_config_files) {
    rs_tok *t = load_fixture("llama3");
    const int32_t *eos;
    int n = rs_tok_eos_ids(t, &eos);
    /* generation_config.json [<|end_of_text|>, <|eot_id|>], then tokenizer_config's eos_token (<|eot_id|>) */
    ASSERT_EQ(n, 2);
    ASSERT_EQ(eos[0], rs_tok_token_to_id(t, "<|end_of_text|>", 15));
    ASSERT_EQ(eos[1], rs_tok_token_to_id(t, "<|eot_id|>", 10));
    ASSERT_EQ(rs_tok_bos_id(t), rs_tok_token_to_id(t, "<|begin_of_text|>", 17));
    ASSERT_TRUE(rs_tok_is_special(t, rs_tok_bos_id(t)));
    ASSERT_TRUE(!rs_tok_is_special(t, 100));
    int32_t *ids;
    size_t k;
    rs_error err;
    ASSERT_EQ(rs_tok_encode(t, "hi", 2, true, &ids, &k, &err), RS_OK);
    ASSERT_EQ(ids[0], rs_tok_bos_id(t)); /* Llama 3's TemplateProcessing */
    free(ids);
    ASSERT_EQ(rs_tok_encode(t, "", 0, true, &ids, &k, &err), RS_OK);
    ASSERT_EQ(k, 1);
    free(ids);
    ASSERT_EQ(rs_tok_encode(t, "", 0, false, &ids, &k, &err), RS_OK);
    ASSERT_EQ(k, 0);
    ASSERT_TRUE(ids == NULL);
    rs_tok_free(t);
}

RS_TEST(tokenizer_invalid_utf8_is_einval) {
    rs_tok *t = load_fixture("qwen2");
    static const char *bad[] = {"\xff", "ab\xc3", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "ok\xe2\x82"};
    for (size_t i = 0; i < RS_ARRAY_LEN(bad); i++) {
        int32_t *ids = (int32_t *)1;
        size_t n = 7;
        rs_error err = {0};
        ASSERT_EQ(rs_tok_encode(t, bad[i], strlen(bad[i]), true, &ids, &n, &err), RS_EINVAL);
        ASSERT_TRUE(ids == NULL && n == 0);
        ASSERT_TRUE(strstr(err.message, "not valid UTF-8") != NULL);
    }
    rs_tok_free(t);
}

/* ---- streaming ---- */

static const char *fixtures[] = {"qwen2", "llama3", "spm", "spm_metaspace"};

/* Streams ids and checks the deltas: valid UTF-8 and concatenating to decode. */
static void check_stream(const rs_tok *t, const int32_t *ids, size_t n, bool skip) {
    rs_tok_stream *s = rs_tok_stream_new(t, skip);
    char *all = malloc(1);
    size_t all_n = 0;
    for (size_t i = 0; i <= n; i++) {
        const char *d;
        size_t k = i < n ? rs_tok_stream_push(s, ids[i], &d) : rs_tok_stream_finish(s, &d);
        if (!valid_utf8(d, k)) RS_TEST_FAIL("delta %zu is not valid UTF-8", i);
        if (strlen(d) != k && memchr(d, '\0', k) == NULL) RS_TEST_FAIL("delta %zu is not NUL-terminated", i);
        all = realloc(all, all_n + k + 1);
        memcpy(all + all_n, d, k);
        all_n += k;
    }
    size_t dn;
    char *full = rs_tok_decode(t, ids, n, skip, &dn);
    if (dn != all_n || memcmp(full, all, dn) != 0)
        RS_TEST_FAIL("deltas (%zu bytes) do not concatenate to decode (%zu bytes: %.80s)", all_n, dn, full);
    free(full);
    free(all);
    rs_tok_stream_free(s);
}

RS_TEST(tokenizer_stream_concatenates_to_decode) {
    size_t n, *lens;
    char **lines = corpus(&n, &lens);
    uint64_t rng = 42;
    for (size_t f = 0; f < RS_ARRAY_LEN(fixtures); f++) {
        rs_tok *t = load_fixture(fixtures[f]);
        for (size_t i = 0; i < n; i += 3) {
            int32_t *ids;
            size_t k;
            rs_error err;
            if (rs_tok_encode(t, lines[i], lens[i], true, &ids, &k, &err) != RS_OK) RS_TEST_FAIL("%s", err.message);
            check_stream(t, ids, k, false);
            check_stream(t, ids, k, true);
            free(ids);
        }
        int32_t ids[24];
        for (int r = 0; r < 2000; r++) { /* random ids: halves of characters, byte tokens, specials */
            size_t k = (size_t)(r % 24);
            for (size_t j = 0; j < k; j++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                ids[j] = (int32_t)((rng >> 33) % (uint64_t)(rs_tok_vocab_size(t) + 2)) - 1; /* -1 and vocab: unknown */
            }
            check_stream(t, ids, k, r & 1);
        }
        rs_tok_free(t);
    }
    free_corpus(lines, n, lens);
}

/* Pushes ids one by one and compares each delta with want[i] (want[n] is finish's). */
static void expect_deltas(const rs_tok *t, const int32_t *ids, size_t n, const char *const *want) {
    rs_tok_stream *s = rs_tok_stream_new(t, false);
    for (size_t i = 0; i <= n; i++) {
        const char *d;
        size_t k = i < n ? rs_tok_stream_push(s, ids[i], &d) : rs_tok_stream_finish(s, &d);
        if (k != strlen(want[i]) || memcmp(d, want[i], k) != 0)
            RS_TEST_FAIL("delta %zu: \"%.*s\", want \"%s\"", i, (int)k, d, want[i]);
    }
    rs_tok_stream_free(s);
}

static int32_t id_of(const rs_tok *t, const char *tok) {
    int32_t id = rs_tok_token_to_id(t, tok, strlen(tok));
    if (id < 0) RS_TEST_FAIL("no token \"%s\"", tok);
    return id;
}

RS_TEST(tokenizer_stream_holds_split_characters) {
    rs_tok *t = load_fixture("qwen2");
    /* byte-level: U+1F600 is F0 9F 98 80 = alphabet "ðŁĺĢ"; 中 is E4 B8 AD = "ä¸Ń" */
    int32_t emoji[] = {id_of(t, "Hi"), id_of(t, "\xc3\xb0"), id_of(t, "\xc5\x81"), id_of(t, "\xc4\xba"),
                       id_of(t, "\xc4\xa2"), id_of(t, "\xc3\xa4"), id_of(t, "\xc2\xb8"), id_of(t, "\xc5\x83"),
                       id_of(t, "!")};
    const char *want[] = {"Hi", "", "", "", "\xf0\x9f\x98\x80", "", "", "\xe4\xb8\xad", "!", ""};
    expect_deltas(t, emoji, RS_ARRAY_LEN(emoji), want);
    /* an incomplete character at the end reads U+FFFD, as decode; a broken one at once */
    int32_t cut[] = {id_of(t, "\xc3\xa4"), id_of(t, "\xc2\xb8")};
    const char *want_cut[] = {"", "", "\xef\xbf\xbd"};
    expect_deltas(t, cut, 2, want_cut);
    int32_t broken[] = {id_of(t, "\xc3\xa4"), id_of(t, "a"), id_of(t, "\xc2\xb8")};
    const char *want_broken[] = {"", ("\xef\xbf\xbd" "a"), "", "\xef\xbf\xbd"};
    expect_deltas(t, broken, 3, want_broken);
    rs_tok_free(t);

    /* ByteFallback: a run of byte tokens decodes as a whole, so it is held until it ends */
    t = load_fixture("spm");
    int32_t fb[] = {id_of(t, "<0xF0>"), id_of(t, "<0x9F>"), id_of(t, "<0x98>"), id_of(t, "<0x80>"), id_of(t, "\xe2\x96\x81" "a")};
    const char *want_fb[] = {"", "", "", "", ("\xf0\x9f\x98\x80" " a"), ""};
    expect_deltas(t, fb, RS_ARRAY_LEN(fb), want_fb);
    int32_t fb_bad[] = {id_of(t, "<0xE4>"), id_of(t, "<0xB8>"), id_of(t, "<0xAD>"), id_of(t, "<0x80>")};
    const char *want_fb_bad[] = {"", "", "", "", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"};
    expect_deltas(t, fb_bad, 4, want_fb_bad); /* one trailing byte spoils the whole run */
    /* Strip(" ", 1, 0) after Fuse: only the output's first space goes */
    int32_t sp[] = {id_of(t, "\xe2\x96\x81" "a"), id_of(t, "\xe2\x96\x81" "a")};
    const char *want_sp[] = {"a", " a", ""};
    expect_deltas(t, sp, 2, want_sp);
    rs_tok_free(t);
}

RS_TEST(tokenizer_stream_replace_after_join) {
    /* Replace "ab" -> "Z" on the joined text: a match across two tokens, found only when the
     * second arrives; Strip then removes one trailing "x" at the end */
    const char *json = "{\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Fuse\"}, "
                       "{\"type\": \"Replace\", \"pattern\": {\"String\": \"ab\"}, \"content\": \"Z\"}, "
                       "{\"type\": \"Strip\", \"content\": \"x\", \"start\": 0, \"stop\": 1}]}, "
                       "\"model\": {\"type\": \"BPE\", \"vocab\": {\"xa\": 0, \"bx\": 1, \"a\": 2}, \"merges\": []}}";
    rs_tok *t = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_tok_load_json(json, strlen(json), "tokenizer.json", &t, &err), RS_OK);
    int32_t ids[] = {0, 1, 2, 1}; /* "xa" "bx" "a" "bx" = "xabxabx" -> "xZxZx" -> "xZxZ" */
    const char *want[] = {"", "xZ", "", "xZ", ""};
    expect_deltas(t, ids, 4, want);
    const char *none[] = {""};
    expect_deltas(t, ids, 0, none);
    size_t len;
    char *full = rs_tok_decode(t, ids, 4, false, &len);
    ASSERT_STREQ(full, "xZxZ");
    free(full);
    rs_tok_free(t);
}

/* Text that decodes to nothing at all (only skipped special tokens, or only empty pieces) is "",
 * through every decoder kind and the fixtures' own decoders, without touching a buffer that was
 * never allocated (UBSan's null-pointer-offset check in the sanitized run). */
RS_TEST(tokenizer_decode_to_nothing) {
    static const char *decoders[] = {
        "{\"type\": \"Fuse\"}",
        "{\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}",
        "{\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", \"pattern\": {\"String\": \"a\"}, "
        "\"content\": \"\"}, {\"type\": \"Fuse\"}, {\"type\": \"Strip\", \"content\": \"x\", \"start\": 0, "
        "\"stop\": 1}]}",
        ("{\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", \"pattern\": {\"String\": \"a\"}, "
         "\"content\": \"\"}, {\"type\": \"Strip\", \"content\": \" \", \"start\": 0, \"stop\": 0}]}"),
        "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": true}",
        "{\"type\": \"Metaspace\", \"replacement\": \"_\", \"prepend_scheme\": \"always\", \"split\": true}",
    };
    for (size_t i = 0; i <= RS_ARRAY_LEN(decoders); i++) {
        char json[1024];
        snprintf(json, sizeof json,
                 "{%s%s%s\"added_tokens\": [{\"id\": 3, \"content\": \"<s>\", \"special\": true, "
                 "\"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false}], "
                 "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2, \"<s>\": 3}, "
                 "\"merges\": [\"a b\"]}}",
                 i < RS_ARRAY_LEN(decoders) ? "\"decoder\": " : "", i < RS_ARRAY_LEN(decoders) ? decoders[i] : "",
                 i < RS_ARRAY_LEN(decoders) ? ", " : "");
        rs_tok *t = NULL;
        rs_error err = {0};
        if (rs_tok_load_json(json, strlen(json), "tokenizer.json", &t, &err) != RS_OK)
            RS_TEST_FAIL("decoder %zu: %s", i, err.message);
        const int32_t specials[] = {3, 3}, as[] = {0, 0};
        size_t len = 99;
        char *text = rs_tok_decode(t, specials, 2, true, &len);
        ASSERT_EQ(len, 0);
        ASSERT_STREQ(text, "");
        free(text);
        if (i == 2 || i == 3) { /* Replace removes every "a": empty pieces, then (Fuse and) Strip over them */
            text = rs_tok_decode(t, as, 2, false, &len);
            ASSERT_EQ(len, 0);
            ASSERT_STREQ(text, "");
            free(text);
            const char *want[] = {"", "", ""}; /* and streamed, piece by piece */
            expect_deltas(t, as, 2, want);
        }
        rs_tok_free(t);
    }
    static const char *names[] = {"llama3", "qwen2", "spm"};
    for (size_t f = 0; f < RS_ARRAY_LEN(names); f++) {
        rs_tok *t = load_fixture(names[f]);
        int32_t ids[2];
        size_t n = 0;
        for (int32_t id = 0; id < rs_tok_vocab_size(t) && n < 2; id++)
            if (rs_tok_is_special(t, id)) ids[n++] = id;
        if (n == 0) RS_TEST_FAIL("%s: no special token", names[f]);
        size_t len = 99;
        char *text = rs_tok_decode(t, ids, n, true, &len);
        ASSERT_EQ(len, 0);
        ASSERT_STREQ(text, "");
        free(text);
        rs_tok_free(t);
    }
}

/* ---- threads ---- */

typedef struct enc_job {
    const rs_tok *t;
    char **lines;
    size_t *lens, n;
    int32_t **want;
    size_t *want_n;
    int bad;
} enc_job;

static void *encode_all(void *arg) {
    enc_job *j = arg;
    for (int rep = 0; rep < 3; rep++)
        for (size_t i = 0; i < j->n; i++) {
            int32_t *ids;
            size_t k;
            rs_error err;
            if (rs_tok_encode(j->t, j->lines[i], j->lens[i], true, &ids, &k, &err) != RS_OK || k != j->want_n[i] ||
                (k && memcmp(ids, j->want[i], k * sizeof *ids) != 0))
                j->bad++;
            free(ids);
        }
    return NULL;
}

RS_TEST(tokenizer_threads_encode_the_same_ids) {
    size_t n, *lens;
    char **lines = corpus(&n, &lens);
    for (size_t f = 0; f < 2; f++) {
        rs_tok *ref = load_fixture(fixtures[f]), *t = load_fixture(fixtures[f]);
        int32_t **want = calloc(n, sizeof *want);
        size_t *want_n = calloc(n, sizeof *want_n);
        for (size_t i = 0; i < n; i++) {
            rs_error err;
            ASSERT_EQ(rs_tok_encode(ref, lines[i], lens[i], true, &want[i], &want_n[i], &err), RS_OK);
        }
        enum { NT = 4 };
        pthread_t th[NT];
        enc_job jobs[NT];
        for (int k = 0; k < NT; k++) {
            jobs[k] = (enc_job){t, lines, lens, n, want, want_n, 0};
            ASSERT_EQ(pthread_create(&th[k], NULL, encode_all, &jobs[k]), 0);
        }
        for (int k = 0; k < NT; k++) {
            pthread_join(th[k], NULL);
            ASSERT_EQ(jobs[k].bad, 0);
        }
        for (size_t i = 0; i < n; i++) free(want[i]);
        free(want);
        free(want_n);
        rs_tok_free(ref);
        rs_tok_free(t);
    }
    free_corpus(lines, n, lens);
}

/* ---- the default model's tokenizer ---- */

RS_TEST(tokenizer_default_matches_default_model) {
    rs_model_config cfg;
    ASSERT_EQ(rs_model_preset("default", &cfg), RS_OK);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/default", rs_test_tmpdir());
    mkdir(dir, 0700);
    rs_error err = {0};
    ASSERT_EQ(rs_tok_write_default(dir, &err), RS_OK);
    rs_tok *t = NULL;
    ASSERT_EQ(rs_tok_load(dir, &t, &err), RS_OK);
    ASSERT_EQ(rs_tok_vocab_size(t), cfg.vocab_size);
    ASSERT_EQ(rs_tok_bos_id(t), cfg.bos_token_id);
    const int32_t *eos;
    ASSERT_EQ(rs_tok_eos_ids(t, &eos), cfg.n_eos);
    ASSERT_EQ(eos[0], cfg.eos_token_ids[0]);
    size_t len;
    const char *s = rs_tok_id_to_token(t, eos[0], &len);
    ASSERT_STREQ(s, "<|endoftext|>");
    int32_t *ids;
    size_t n;
    ASSERT_EQ(rs_tok_encode(t, "Hello world<|im_end|>", 21, true, &ids, &n, &err), RS_OK);
    ASSERT_EQ(ids[n - 1], 4);
    char *text = rs_tok_decode(t, ids, n, true, &len);
    ASSERT_STREQ(text, "Hello world");
    free(text);
    free(ids);
    rs_tok_free(t);
}

/* ---- stop strings ---- */

RS_TEST(tokenizer_stop_strings) {
    const char *stops[] = {"</answer>", "STOP", "\xe4\xb8\xad\xe6\x96\x87"}; /* "中文" */
    size_t lens[] = {9, 4, 6};
    size_t pos = 99;
    const char *t1 = "the answer is 4</ans";
    ASSERT_EQ(rs_tok_stop_find(stops, lens, 3, t1, strlen(t1), 0, &pos), -1);
    ASSERT_EQ(rs_tok_stop_holdback(stops, lens, 3, t1, strlen(t1)), 5); /* "</ans" may still become "</answer>" */
    const char *t2 = "the answer is 4</answer> more";
    ASSERT_EQ(rs_tok_stop_find(stops, lens, 3, t2, strlen(t2), strlen(t1), &pos), 0);
    ASSERT_EQ(pos, 15);
    /* a match wholly inside what was scanned is not reported again */
    ASSERT_EQ(rs_tok_stop_find(stops, lens, 3, t2, strlen(t2), strlen(t2), &pos), -1);
    /* list order wins over the earliest start (SGLang's check_finished, vLLM's check_stop_strings) */
    const char *t3 = "xSTOP</answer>";
    ASSERT_EQ(rs_tok_stop_find(stops, lens, 3, t3, strlen(t3), 0, &pos), 0);
    ASSERT_EQ(pos, 5);
    ASSERT_EQ(rs_tok_stop_find(stops + 1, lens + 1, 2, t3, strlen(t3), 0, &pos), 0);
    ASSERT_EQ(pos, 1);
    /* the first occurrence of the stop string that wins */
    const char *t5 = "STOP and STOP";
    ASSERT_EQ(rs_tok_stop_find(stops, lens, 3, t5, strlen(t5), 0, &pos), 1);
    ASSERT_EQ(pos, 0);
    /* holdback ends on a character boundary: "中" (3 bytes) may start "中文" */
    const char *t4 = "abc\xe4\xb8\xad";
    ASSERT_EQ(rs_tok_stop_holdback(stops, lens, 3, t4, strlen(t4)), 3);
    ASSERT_EQ(rs_tok_stop_holdback(stops, lens, 3, "xyz", 3), 0);
    ASSERT_EQ(rs_tok_stop_holdback(stops, lens, 3, "ST", 2), 2);
    ASSERT_EQ(rs_tok_stop_find(stops, lens, 3, "STO", 3, 0, &pos), -1);
}

/* The matches of an Oniguruma pattern over s, as "start-end" pairs ("" when none). */
static const char *regex_matches(const char *pat, const char *s) {
    static char out[256];
    rs_tok_regex *re = NULL;
    rs_error err = {0};
    if (rs_tok_regex_compile(pat, strlen(pat), false, "pattern", &re, &err) != RS_OK)
        RS_TEST_FAIL("%s: %s", pat, err.message);
    rs_tok_spans sp = {0};
    ASSERT_EQ(rs_tok_regex_find(re, s, strlen(s), &sp, &err), RS_OK);
    out[0] = '\0';
    for (size_t i = 0; i < sp.n; i++)
        if (sp.v[i].match)
            snprintf(out + strlen(out), sizeof out - strlen(out), "%s%u-%u", out[0] ? " " : "", sp.v[i].start,
                     sp.v[i].end);
    free(sp.v);
    rs_tok_regex_free(re);
    return out;
}

/* Where Ruby-syntax Oniguruma (what `tokenizers` runs) and PCRE2 read the same text differently,
 * the translation gives Oniguruma's matches (each expectation is what tokenizers 0.23 splits):
 * \v is the vertical tab alone; ^ does not match after a final newline; \p{Cs} (surrogates, never
 * in UTF-8 text) is an empty set, alone or beside other branches, and a ']' written first in a
 * class is a literal. */
RS_TEST(tokenizer_regex_reads_as_oniguruma) {
    ASSERT_STREQ(regex_matches("\\v", "a\nb\x0b" "c"), "3-4");
    ASSERT_STREQ(regex_matches("[ \\t\\v]+", "a\nb \x0b c"), "3-6");
    ASSERT_STREQ(regex_matches("\\n^", "a\n"), "");
    ASSERT_STREQ(regex_matches("\\n^", "x\n\ny\n"), "1-2 2-3");
    ASSERT_STREQ(regex_matches("\\p{Cs}|\\s+", "a]b |[z"), "3-4");
    ASSERT_STREQ(regex_matches("\\p{Cs}", "a]b"), "");
    ASSERT_STREQ(regex_matches("[\\p{Cs}]", "a]b"), "");
    ASSERT_STREQ(regex_matches("[^\\p{Cs}]", "ab"), "0-1 1-2");
    ASSERT_STREQ(regex_matches("[]a]+", "x]a]y"), "1-4");
}
