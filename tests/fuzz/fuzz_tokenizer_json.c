/*
 * fuzz_tokenizer_json.c — libFuzzer target for the tokenizer.json loader (tokenizer/load.c and
 * everything it builds: patterns, tries, merges, templates, decoder chains).
 *
 * Arbitrary bytes are the file. A failure must say why (negative code, a message). A tokenizer
 * that loads is exercised: a few fixed texts are encoded with and without special tokens (every
 * id must be below vocab_size), decoded with and without skip_special_tokens, and streamed, and
 * the stream's concatenated deltas must equal decode. ASan/UBSan catch the rest.
 *
 *   make fuzz   (or: build-fuzz/fuzz_tokenizer_json -max_total_time=60 tests/fuzz/seeds/fuzz_tokenizer_json)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const texts[] = {"", "Hello, world!  123 4567", "a\tb\n\nc  ", "\xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80",
                                    "<s>x</s><|endoftext|>", "e\xcc\x81 \xef\xac\x81"};

static void check_stream(const rs_tok *t, const int32_t *ids, size_t n, bool skip) {
    rs_tok_stream *s = rs_tok_stream_new(t, skip);
    size_t dn, all_n = 0;
    char *full = rs_tok_decode(t, ids, n, skip, &dn), *all = malloc(dn + 1);
    for (size_t i = 0; i <= n; i++) {
        const char *d;
        size_t k = i < n ? rs_tok_stream_push(s, ids[i], &d) : rs_tok_stream_finish(s, &d);
        if (all_n + k > dn || memcmp(full + all_n, d, k) != 0) abort();
        memcpy(all + all_n, d, k);
        all_n += k;
    }
    if (all_n != dn) abort();
    free(all);
    free(full);
    rs_tok_stream_free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    rs_tok *t = NULL;
    rs_error err = {0};
    if (rs_tok_load_json((const char *)data, size, "<fuzz>", &t, &err) != RS_OK) {
        if (err.code >= 0 || err.message[0] == '\0' || t) abort();
        return 0;
    }
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        for (int special = 0; special < 2; special++) {
            int32_t *ids;
            size_t n;
            if (rs_tok_encode(t, texts[i], strlen(texts[i]), special, &ids, &n, &err) != RS_OK) {
                if (err.message[0] == '\0') abort();
                continue;
            }
            for (size_t k = 0; k < n; k++)
                if (ids[k] < 0 || ids[k] >= rs_tok_vocab_size(t)) abort();
            check_stream(t, ids, n, special);
            int32_t tail[3] = {0, rs_tok_vocab_size(t) - 1, -5};
            check_stream(t, tail, 3, !special);
            free(ids);
        }
    }
    rs_tok_free(t);
    return 0;
}
