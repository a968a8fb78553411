/*
 * presets.h — named synthetic models: the embedded default model the daemon serves when no
 * --model is given, and benchmark models with real checkpoints' shapes. Each preset is a config
 * plus a seed for rs_testmodel_write, so the same name gives the same bytes everywhere.
 *
 *   "default"     Qwen3, 8 layers, hidden 512, 8/4 heads of 64, vocab 8192, tied; seed 1
 *   "qwen3-0.6b"  Qwen3-0.6B's shapes (28 layers, hidden 1024, 16/8 heads of 128, vocab 151936); seed 2
 *   "qwen3-8b"    Qwen3-8B's shapes (36 layers, hidden 4096, intermediate 12288, 32/8 heads of 128,
 *                 vocab 151936, untied lm_head; 8.2 G parameters, 16 GB of BF16); seed 3
 */
#ifndef RS_PRESETS_H
#define RS_PRESETS_H

#include <stdint.h>

#include "model.h"

#define RS_MODEL_PRESET_NAMES "default, qwen3-0.6b, qwen3-8b"

/* Fills *cfg with preset `name`. RS_OK, or RS_ENOTFOUND for an unknown name (cfg untouched). */
int rs_model_preset(const char *name, rs_model_config *cfg);
/* The weight seed of preset `name`; 0 for an unknown name. */
uint64_t rs_model_preset_seed(const char *name);
/* rs_testmodel_write(dir, preset config, preset seed). */
int rs_model_preset_write(const char *name, const char *dir, rs_error *err);

#endif /* RS_PRESETS_H */
