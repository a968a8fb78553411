/*
 * make_default_model.c — writes a synthetic model directory from a named preset (model/presets.h).
 *
 *   make-default-model [--out DIR] [--preset default|qwen3-0.6b]
 *
 * The "default" preset is the model rolloutd serves when started without --model (written with its
 * tokenizer.json and tokenizer_config.json, as the daemon writes it); "qwen3-0.6b" has Qwen3-0.6B's
 * shapes for benchmarks (token ids only). The same preset writes the same bytes on every machine,
 * and transformers can load the directory to compute reference outputs.
 */
#include <stdio.h>
#include <string.h>

#include "../model/presets.h"
#include "../tokenizer/tokenizer.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: make-default-model [--out DIR] [--preset NAME]\n"
            "  --out DIR       output directory, created if missing (default build/default-model)\n"
            "  --preset NAME   %s (default \"default\")\n",
            RS_MODEL_PRESET_NAMES);
}

int main(int argc, char **argv) {
    const char *out = "build/default-model";
    const char *preset = "default";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
            out = argv[++i];
        } else if (strcmp(argv[i], "--preset") == 0 && i + 1 < argc) {
            preset = argv[++i];
        } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "make-default-model: unknown or incomplete argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    rs_error err = {0};
    double t0 = rs_now_s();
    if (rs_model_preset_write(preset, out, &err) != RS_OK ||
        (strcmp(preset, "default") == 0 && rs_tok_write_default(out, &err) != RS_OK)) {
        fprintf(stderr, "make-default-model: %s\n", err.message);
        return 1;
    }
    printf("wrote %s (preset %s) in %.2f s\n", out, preset, rs_now_s() - t0);
    return 0;
}
