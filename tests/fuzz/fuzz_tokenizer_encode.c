/*
 * fuzz_tokenizer_encode.c — libFuzzer target for encode and decode of arbitrary bytes on real
 * committed tokenizers (tests/fixtures/tokenizers: llama3, byte-level without a normalizer, and
 * spm, SentencePiece-style with byte fallback).
 *
 * The first byte picks the tokenizer and add_special_tokens; the rest is the text. Invalid UTF-8
 * must be RS_EINVAL and valid UTF-8 must encode, to ids below vocab_size. For llama3 every text
 * must decode back to itself (byte-level BPE without a normalizer round-trips everything), with
 * and without streaming, where every delta is valid UTF-8. For spm, the stream must concatenate to
 * decode. Fixtures are read from $RS_FIXTURES or tests/fixtures (run from the repository root).
 *
 *   make fuzz   (or: build-fuzz/fuzz_tokenizer_encode -max_total_time=60 tests/fuzz/seeds/fuzz_tokenizer_encode)
 */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static rs_tok *toks[2];

static rs_tok *load(const char *name) {
    const char *root = getenv("RS_FIXTURES");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/tokenizers/%s", root && *root ? root : "tests/fixtures", name);
    rs_tok *t = NULL;
    rs_error err;
    if (rs_tok_load(dir, &t, &err) != RS_OK) {
        fprintf(stderr, "fuzz_tokenizer_encode: %s\n", err.message);
        abort();
    }
    return t;
}

static bool valid_utf8(const char *s, size_t n) {
    json_t *j = json_stringn(s, n); /* jansson's own UTF-8 check, independent of ours */
    bool ok = j != NULL;
    json_decref(j);
    return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!toks[0]) toks[0] = load("llama3"), toks[1] = load("spm");
    if (size == 0) return 0;
    const rs_tok *t = toks[data[0] & 1];
    bool special = data[0] & 2;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int32_t *ids;
    size_t n;
    rs_error err;
    int rc = rs_tok_encode(t, text, len, special, &ids, &n, &err);
    if (!valid_utf8(text, len)) {
        if (rc != RS_EINVAL) abort();
        return 0;
    }
    if (rc != RS_OK) abort();
    for (size_t k = 0; k < n; k++)
        if (ids[k] < 0 || ids[k] >= rs_tok_vocab_size(t)) abort();
    size_t dn;
    char *dec = rs_tok_decode(t, ids, n, false, &dn);
    if (t == toks[0] && !special && (dn != len || memcmp(dec, text, len) != 0)) abort();
    rs_tok_stream *s = rs_tok_stream_new(t, false);
    size_t at = 0;
    for (size_t i = 0; i <= n; i++) {
        const char *d;
        size_t k = i < n ? rs_tok_stream_push(s, ids[i], &d) : rs_tok_stream_finish(s, &d);
        if (!valid_utf8(d, k) || at + k > dn || memcmp(dec + at, d, k) != 0) abort();
        at += k;
    }
    if (at != dn) abort();
    rs_tok_stream_free(s);
    free(dec);
    free(ids);
    return 0;
}
