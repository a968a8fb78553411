/*
 * default_tokenizer.c — the embedded default model's tokenizer.json, built into the binary.
 *
 * tokenizer/default_tokenizer.json (byte-level BPE, exactly 8192 ids, trained on the test corpus
 * by scripts/make_tokenizers.py) is included by the assembler's .incbin, so no tool generates
 * source from it; builds run from the repository root, which the path is relative to. The model
 * preset "default" (model/presets.h) has bos 1 and eos 2, which are this tokenizer's
 * <|begin_of_text|> and <|endoftext|>; tests/unit/test_tokenizer.c checks that they agree.
 */
#include <errno.h>
#include <stdio.h>

#include "tok_internal.h"

__asm__(".section .rodata\n"
        ".balign 16\n"
        "rs_tok_default_json_start:\n"
        ".incbin \"tokenizer/default_tokenizer.json\"\n"
        "rs_tok_default_json_end:\n"
        ".byte 0\n"
        ".previous\n");

extern const char rs_tok_default_json_start[] __asm__("rs_tok_default_json_start");
extern const char rs_tok_default_json_end[] __asm__("rs_tok_default_json_end");

/* transformers reads these from tokenizer_config.json; bos is not added (Qwen style). */
static const char default_config[] = "{\n"
                                     "  \"bos_token\": \"<|begin_of_text|>\",\n"
                                     "  \"eos_token\": \"<|endoftext|>\",\n"
                                     "  \"pad_token\": \"<|pad|>\",\n"
                                     "  \"clean_up_tokenization_spaces\": false,\n"
                                     "  \"model_max_length\": 4096,\n"
                                     "  \"tokenizer_class\": \"PreTrainedTokenizerFast\"\n"
                                     "}\n";

const char *rs_tok_default_json(size_t *len) {
    *len = (size_t)(rs_tok_default_json_end - rs_tok_default_json_start);
    return rs_tok_default_json_start;
}

static int write_file(const char *dir, const char *name, const char *data, size_t n, rs_error *err) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path)
        return rs_error_set(err, RS_EINVAL, NULL, "path too long: %.200s", dir);
    FILE *f = fopen(path, "wb");
    int ok = f && fwrite(data, 1, n, f) == n;
    if (f && fclose(f) != 0) ok = 0;
    if (!ok) return rs_error_set(err, RS_EIO, NULL, "cannot write %s: %s", path, strerror(errno));
    return RS_OK;
}

int rs_tok_write_default(const char *dir, rs_error *err) {
    size_t n;
    const char *json = rs_tok_default_json(&n);
    int rc = write_file(dir, "tokenizer.json", json, n, err);
    if (rc == RS_OK) rc = write_file(dir, "tokenizer_config.json", default_config, sizeof default_config - 1, err);
    return rc;
}
