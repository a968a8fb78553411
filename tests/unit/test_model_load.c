/*
 * test_model_load.c — config.json parsing, synthetic model writing, and loading a model directory
 * onto a backend (model/hfconfig.c, model/testmodel.c, model/loader.c).
 *
 * The backend here is a minimal host-memory one (alloc/upload/download/free only) that counts live
 * allocations, so every test also checks that rs_model_free and every failure path give back all
 * memory. Config texts are modelled on real checkpoints (Qwen3-0.6B, Qwen2.5-0.5B, Llama-3.2-1B,
 * Qwen3-30B-A3B) with their sizes reduced where it does not matter.
 */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../model/model.h"
#include "../../model/presets.h"
#include "../../model/safetensors.h"
#include "test.h"
#include "test_util.h"

/* ---- helpers ---- */

static void write_text(const char *dir, const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp) RS_TEST_FAIL("cannot write %s", path);
    fputs(text, fp);
    fclose(fp);
}

static char *subdir(const char *name) {
    static char buf[4][512];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", rs_test_tmpdir(), name);
    return p;
}

/* Writes base JSON with `patch` applied: a key set to "__delete__" is removed, others replaced. */
static void write_config(const char *dir, const char *base, const char *patch) {
    json_error_t je;
    json_t *o = json_loads(base, 0, &je);
    if (!o) RS_TEST_FAIL("base config: %s", je.text);
    if (patch) {
        json_t *p = json_loads(patch, 0, &je);
        if (!p) RS_TEST_FAIL("patch: %s", je.text);
        const char *k;
        json_t *v;
        json_object_foreach(p, k, v) {
            if (json_is_string(v) && strcmp(json_string_value(v), "__delete__") == 0) json_object_del(o, k);
            else json_object_set(o, k, v);
        }
        json_decref(p);
    }
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_dump_file(o, path, 0);
    json_decref(o);
}

static const char *QWEN3_0_6B =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"attention_bias\": false, \"attention_dropout\": 0.0,"
    " \"bos_token_id\": 151643, \"eos_token_id\": 151645, \"head_dim\": 128, \"hidden_act\": \"silu\","
    " \"hidden_size\": 1024, \"initializer_range\": 0.02, \"intermediate_size\": 3072,"
    " \"max_position_embeddings\": 40960, \"max_window_layers\": 28, \"model_type\": \"qwen3\","
    " \"num_attention_heads\": 16, \"num_hidden_layers\": 28, \"num_key_value_heads\": 8,"
    " \"rms_norm_eps\": 1e-06, \"rope_scaling\": null, \"rope_theta\": 1000000, \"sliding_window\": null,"
    " \"tie_word_embeddings\": true, \"torch_dtype\": \"bfloat16\", \"transformers_version\": \"4.51.0\","
    " \"use_cache\": true, \"use_sliding_window\": false, \"vocab_size\": 151936}";

static const char *QWEN2_5_0_5B =
    "{\"architectures\": [\"Qwen2ForCausalLM\"], \"attention_dropout\": 0.0, \"bos_token_id\": 151643,"
    " \"eos_token_id\": 151643, \"hidden_act\": \"silu\", \"hidden_size\": 896, \"initializer_range\": 0.02,"
    " \"intermediate_size\": 4864, \"max_position_embeddings\": 32768, \"max_window_layers\": 24,"
    " \"model_type\": \"qwen2\", \"num_attention_heads\": 14, \"num_hidden_layers\": 24,"
    " \"num_key_value_heads\": 2, \"rms_norm_eps\": 1e-06, \"rope_theta\": 1000000.0, \"sliding_window\": 32768,"
    " \"tie_word_embeddings\": true, \"torch_dtype\": \"bfloat16\", \"use_cache\": true,"
    " \"use_sliding_window\": false, \"vocab_size\": 151936}";

static const char *LLAMA_3_2_1B =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"attention_bias\": false, \"attention_dropout\": 0.0,"
    " \"bos_token_id\": 128000, \"eos_token_id\": [128001, 128008, 128009], \"head_dim\": 64,"
    " \"hidden_act\": \"silu\", \"hidden_size\": 2048, \"initializer_range\": 0.02, \"intermediate_size\": 8192,"
    " \"max_position_embeddings\": 131072, \"mlp_bias\": false, \"model_type\": \"llama\","
    " \"num_attention_heads\": 32, \"num_hidden_layers\": 16, \"num_key_value_heads\": 8,"
    " \"pretraining_tp\": 1, \"rms_norm_eps\": 1e-05, \"rope_scaling\": {\"factor\": 32.0,"
    " \"high_freq_factor\": 4.0, \"low_freq_factor\": 1.0, \"original_max_position_embeddings\": 8192,"
    " \"rope_type\": \"llama3\"}, \"rope_theta\": 500000.0, \"tie_word_embeddings\": true,"
    " \"torch_dtype\": \"bfloat16\", \"use_cache\": true, \"vocab_size\": 128256}";

static const char *QWEN3_MOE =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"attention_bias\": false, \"bos_token_id\": 151643,"
    " \"decoder_sparse_step\": 2, \"eos_token_id\": 151645, \"head_dim\": 128, \"hidden_act\": \"silu\","
    " \"hidden_size\": 2048, \"intermediate_size\": 6144, \"max_position_embeddings\": 40960,"
    " \"max_window_layers\": 48, \"mlp_only_layers\": [3], \"model_type\": \"qwen3_moe\","
    " \"moe_intermediate_size\": 768, \"norm_topk_prob\": true, \"num_attention_heads\": 32,"
    " \"num_experts\": 128, \"num_experts_per_tok\": 8, \"num_hidden_layers\": 6, \"num_key_value_heads\": 4,"
    " \"rms_norm_eps\": 1e-06, \"rope_scaling\": null, \"rope_theta\": 1000000.0, \"sliding_window\": null,"
    " \"tie_word_embeddings\": false, \"use_sliding_window\": false, \"vocab_size\": 151936}";

static void load_cfg_ok(const char *dir, rs_model_config *c) {
    rs_error err = {0};
    if (rs_model_config_load(dir, c, &err) != RS_OK) RS_TEST_FAIL("config: %s", err.message);
}

/* ---- config.json ---- */

RS_TEST(model_load_config_qwen3) {
    const char *d = rs_test_tmpdir();
    rs_model_config c;
    write_config(d, QWEN3_0_6B, NULL);
    write_text(d, "generation_config.json",
               "{\"bos_token_id\": 151643, \"do_sample\": true, \"eos_token_id\": [151645, 151643],"
               " \"pad_token_id\": 151643, \"temperature\": 0.6, \"top_k\": 20, \"top_p\": 0.95}");
    load_cfg_ok(d, &c);
    ASSERT_EQ(c.arch, RS_ARCH_QWEN3);
    ASSERT_STREQ(rs_arch_name(c.arch), "Qwen3ForCausalLM");
    ASSERT_EQ(c.vocab_size, 151936);
    ASSERT_EQ(c.hidden, 1024);
    ASSERT_EQ(c.intermediate, 3072);
    ASSERT_EQ(c.n_layers, 28);
    ASSERT_EQ(c.n_heads, 16);
    ASSERT_EQ(c.n_kv_heads, 8);
    ASSERT_EQ(c.head_dim, 128); /* != hidden / heads = 64 */
    ASSERT_EQ(c.max_position, 40960);
    ASSERT_TRUE(c.rms_eps == 1e-6f);
    ASSERT_TRUE(c.rope_theta == 1e6);
    ASSERT_EQ(c.rope_scaling, RS_ROPE_SCALING_NONE);
    ASSERT_TRUE(c.tie_embeddings);
    ASSERT_TRUE(c.qk_norm);
    ASSERT_TRUE(!c.qkv_bias);
    ASSERT_EQ(c.n_experts, 0);
    ASSERT_EQ(c.bos_token_id, 151643);
    ASSERT_EQ(c.n_eos, 2); /* config's 151645 plus generation_config's 151643, deduplicated */
    ASSERT_EQ(c.eos_token_ids[0], 151645);
    ASSERT_EQ(c.eos_token_ids[1], 151643);

    /* Qwen3Config's head_dim default is 128, not hidden / heads; kv heads default to heads */
    write_config(d, QWEN3_0_6B, "{\"head_dim\": \"__delete__\", \"num_key_value_heads\": \"__delete__\","
                                " \"hidden_size\": 512}");
    unlink(subdir("generation_config.json"));
    load_cfg_ok(d, &c);
    ASSERT_EQ(c.head_dim, 128);
    ASSERT_EQ(c.n_kv_heads, 16);
    ASSERT_EQ(c.n_eos, 1);
}

RS_TEST(model_load_config_qwen2) {
    const char *d = rs_test_tmpdir();
    rs_model_config c;
    write_config(d, QWEN2_5_0_5B, NULL);
    rs_error ok_err = {0};
    ASSERT_EQ(rs_model_config_load(d, &c, &ok_err), RS_OK);
    ASSERT_EQ(ok_err.message[0], 0); /* no generation_config.json is not an error, not even a stale one */
    ASSERT_EQ(c.arch, RS_ARCH_QWEN2);
    ASSERT_EQ(c.head_dim, 64); /* 896 / 14 */
    ASSERT_EQ(c.n_kv_heads, 2);
    ASSERT_TRUE(c.qkv_bias);
    ASSERT_TRUE(!c.qk_norm);
    ASSERT_TRUE(c.rope_theta == 1e6);
    ASSERT_EQ(c.n_eos, 1);
    ASSERT_EQ(c.eos_token_ids[0], 151643);
    /* tie_word_embeddings defaults to false; rope_theta to 10000; bos absent -> -1 */
    write_config(d, QWEN2_5_0_5B, "{\"tie_word_embeddings\": \"__delete__\", \"rope_theta\": \"__delete__\","
                                  " \"bos_token_id\": null}");
    load_cfg_ok(d, &c);
    ASSERT_TRUE(!c.tie_embeddings);
    ASSERT_TRUE(c.rope_theta == 10000.0);
    ASSERT_EQ(c.bos_token_id, -1);
    /* sliding window on layers >= max_window_layers is not implemented */
    write_config(d, QWEN2_5_0_5B, "{\"use_sliding_window\": true, \"max_window_layers\": 21}");
    rs_error err = {0};
    ASSERT_EQ(rs_model_config_load(d, &c, &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "use_sliding_window");
    /* ... but with max_window_layers >= num_hidden_layers no layer slides */
    write_config(d, QWEN2_5_0_5B, "{\"use_sliding_window\": true, \"max_window_layers\": 24}");
    load_cfg_ok(d, &c);
    /* ... nor with sliding_window null (absent would be the class's 4096) */
    write_config(d, QWEN2_5_0_5B, "{\"use_sliding_window\": true, \"max_window_layers\": 21, \"sliding_window\": null}");
    load_cfg_ok(d, &c);
    /* neutral values of FineGrainedFP8Config's arithmetic keys are accepted */
    write_config(d, QWEN2_5_0_5B, "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": "
                                  "[128, 128], \"dequantize\": false, \"scale_fmt\": \"float\"}}");
    load_cfg_ok(d, &c);
}

RS_TEST(model_load_config_llama3_rope) {
    const char *d = rs_test_tmpdir();
    rs_model_config c;
    write_config(d, LLAMA_3_2_1B, NULL);
    load_cfg_ok(d, &c);
    ASSERT_EQ(c.arch, RS_ARCH_LLAMA);
    ASSERT_EQ(c.head_dim, 64);
    ASSERT_TRUE(!c.qk_norm && !c.qkv_bias);
    ASSERT_TRUE(c.rms_eps == 1e-5f);
    ASSERT_TRUE(c.rope_theta == 500000.0);
    ASSERT_EQ(c.rope_scaling, RS_ROPE_SCALING_LLAMA3);
    ASSERT_TRUE(c.rope_factor == 32.0);
    ASSERT_TRUE(c.rope_low_freq_factor == 1.0);
    ASSERT_TRUE(c.rope_high_freq_factor == 4.0);
    ASSERT_EQ(c.rope_original_max_position, 8192);
    ASSERT_EQ(c.bos_token_id, 128000);
    ASSERT_EQ(c.n_eos, 3);
    ASSERT_EQ(c.eos_token_ids[2], 128009);

    /* old "type" key; original_max_position_embeddings falls back to max_position_embeddings */
    write_config(d, LLAMA_3_2_1B,
                 "{\"rope_scaling\": {\"type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0,"
                 " \"high_freq_factor\": 4.0}, \"max_position_embeddings\": 4096}");
    load_cfg_ok(d, &c);
    ASSERT_EQ(c.rope_scaling, RS_ROPE_SCALING_LLAMA3);
    ASSERT_TRUE(c.rope_factor == 8.0);
    ASSERT_EQ(c.rope_original_max_position, 4096);

    /* transformers 5 layout: everything in rope_parameters, its rope_theta wins */
    write_config(d, LLAMA_3_2_1B,
                 "{\"rope_scaling\": \"__delete__\", \"rope_theta\": 10000.0, \"rope_parameters\":"
                 " {\"rope_type\": \"llama3\", \"rope_theta\": 500000.0, \"factor\": 16.0, \"low_freq_factor\": 2.0,"
                 " \"high_freq_factor\": 8.0, \"original_max_position_embeddings\": 2048}}");
    load_cfg_ok(d, &c);
    ASSERT_TRUE(c.rope_theta == 500000.0);
    ASSERT_TRUE(c.rope_factor == 16.0 && c.rope_low_freq_factor == 2.0 && c.rope_high_freq_factor == 8.0);
    ASSERT_EQ(c.rope_original_max_position, 2048);

    /* rope_parameters {"rope_type": "default"} is no scaling; null rope_scaling likewise */
    write_config(d, LLAMA_3_2_1B,
                 "{\"rope_scaling\": null, \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 7.5}}");
    load_cfg_ok(d, &c);
    ASSERT_EQ(c.rope_scaling, RS_ROPE_SCALING_NONE);
    ASSERT_TRUE(c.rope_theta == 7.5);
}

RS_TEST(model_load_config_moe) {
    const char *d = rs_test_tmpdir();
    rs_model_config c;
    write_config(d, QWEN3_MOE, NULL);
    load_cfg_ok(d, &c);
    ASSERT_EQ(c.arch, RS_ARCH_QWEN3_MOE);
    ASSERT_TRUE(c.qk_norm);
    ASSERT_EQ(c.n_experts, 128);
    ASSERT_EQ(c.n_experts_per_tok, 8);
    ASSERT_EQ(c.moe_intermediate, 768);
    ASSERT_TRUE(c.norm_topk_prob);
    ASSERT_EQ(c.decoder_sparse_step, 2);
    /* sparse iff l not in mlp_only_layers and (l + 1) % 2 == 0: layers 1 and 5 (3 is mlp-only) */
    static const bool want[6] = {false, true, false, false, false, true};
    for (int l = 0; l < 6; l++) ASSERT_EQ(c.layer_is_moe[l], want[l]);
    ASSERT_TRUE(!c.tie_embeddings);

    write_config(d, QWEN3_MOE, "{\"decoder_sparse_step\": \"__delete__\", \"mlp_only_layers\": \"__delete__\","
                               " \"norm_topk_prob\": \"__delete__\"}");
    load_cfg_ok(d, &c);
    for (int l = 0; l < 6; l++) ASSERT_TRUE(c.layer_is_moe[l]);
    ASSERT_TRUE(!c.norm_topk_prob);
    /* transformers 5 saves num_experts as num_local_experts (Qwen3MoeConfig.attribute_map) */
    write_config(d, QWEN3_MOE, "{\"num_experts\": \"__delete__\", \"num_local_experts\": 64}");
    load_cfg_ok(d, &c);
    ASSERT_EQ(c.n_experts, 64);
    rs_error err = {0};
    write_config(d, QWEN3_MOE, "{\"num_local_experts\": 64}");
    ASSERT_EQ(rs_model_config_load(d, &c, &err), RS_EFORMAT);
    ASSERT_STREQ(err.param, "num_local_experts");
    /* num_experts 0: every layer dense */
    write_config(d, QWEN3_MOE, "{\"num_experts\": 0}");
    load_cfg_ok(d, &c);
    for (int l = 0; l < 6; l++) ASSERT_TRUE(!c.layer_is_moe[l]);
}

/* quantization_config of an FP8 checkpoint: Qwen3-8B-FP8's object, then with both skip lists */
RS_TEST(model_load_config_fp8) {
    const char *d = rs_test_tmpdir();
    rs_model_config c;
    write_config(d, QWEN3_0_6B, NULL);
    load_cfg_ok(d, &c);
    ASSERT_TRUE(!c.fp8_checkpoint);
    ASSERT_STREQ(c.fp8_not_converted, "");
    write_config(d, QWEN3_0_6B,
                 "{\"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\","
                 " \"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}}");
    load_cfg_ok(d, &c);
    ASSERT_TRUE(c.fp8_checkpoint);
    ASSERT_STREQ(c.fp8_not_converted, "");
    /* other keys are allowed; null lists read as absent; both lists are kept, in order */
    write_config(d, QWEN3_MOE,
                 "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128],"
                 " \"fmt\": \"float8_e4m3fn\", \"modules_to_not_convert\": [\"lm_head\", \"model.layers.1.mlp.gate\"],"
                 " \"ignored_layers\": [\"re:.*\\\\.mlp\\\\.gate$\"], \"weight_scale_format\": null}}");
    load_cfg_ok(d, &c);
    ASSERT_TRUE(c.fp8_checkpoint);
    ASSERT_STREQ(c.fp8_not_converted, "lm_head\nmodel.layers.1.mlp.gate\nre:.*\\.mlp\\.gate$");
    write_config(d, QWEN3_0_6B, "{\"quantization_config\": null}");
    load_cfg_ok(d, &c);
    ASSERT_TRUE(!c.fp8_checkpoint);
}

RS_TEST(model_load_config_errors) {
    static const struct {
        const char *base, *patch;
        int code;
        const char *param;      /* err.param */
        const char *needle;     /* in err.message */
    } cases[] = {
        {NULL, "{\"architectures\": [\"MistralForCausalLM\"]}", RS_EUNSUPPORTED, "architectures", "MistralForCausalLM"},
        {NULL, "{\"architectures\": []}", RS_EFORMAT, "architectures", "architectures"},
        {NULL, "{\"hidden_size\": \"__delete__\"}", RS_EFORMAT, "hidden_size", "hidden_size"},
        {NULL, "{\"hidden_size\": \"1024\"}", RS_EFORMAT, "hidden_size", "integer"},
        {NULL, "{\"vocab_size\": 0}", RS_EFORMAT, "vocab_size", "vocab_size"},
        {NULL, "{\"num_hidden_layers\": 300}", RS_EFORMAT, "num_hidden_layers", "300"},
        {NULL, "{\"num_key_value_heads\": 6}", RS_EFORMAT, "num_key_value_heads", "multiple"},
        {NULL, "{\"num_key_value_heads\": 32}", RS_EFORMAT, "num_key_value_heads", "num_key_value_heads"},
        {NULL, "{\"head_dim\": 127}", RS_EFORMAT, "head_dim", "even"},
        {NULL, "{\"rms_norm_eps\": -1}", RS_EFORMAT, "rms_norm_eps", "rms_norm_eps"},
        {NULL, "{\"rope_theta\": 0}", RS_EFORMAT, "rope_theta", "rope_theta"},
        {NULL, "{\"tie_word_embeddings\": 1}", RS_EFORMAT, "tie_word_embeddings", "true or false"},
        {NULL, "{\"attention_bias\": true}", RS_EUNSUPPORTED, "attention_bias", "attention_bias"},
        {NULL, "{\"hidden_act\": \"gelu\"}", RS_EUNSUPPORTED, "hidden_act", "silu"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"fp8\"}}", RS_EUNSUPPORTED, "weight_block_size",
         "per-tensor"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4}}", RS_EUNSUPPORTED,
         "quant_method", "gptq"},
        {NULL, "{\"quantization_config\": {\"weight_block_size\": [128, 128]}}", RS_EFORMAT, "quant_method",
         "quant_method"},
        {NULL, "{\"quantization_config\": \"fp8\"}", RS_EFORMAT, "quantization_config", "object"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [64, 64]}}",
         RS_EUNSUPPORTED, "weight_block_size", "[64, 64]"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128]}}", RS_EFORMAT,
         "weight_block_size", "two integers"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128],"
               " \"activation_scheme\": \"static\"}}", RS_EUNSUPPORTED, "activation_scheme", "dynamic"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128],"
               " \"fmt\": \"e5m2\"}}", RS_EUNSUPPORTED, "fmt", "e4m3"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128],"
               " \"modules_to_not_convert\": \"lm_head\"}}", RS_EFORMAT, "modules_to_not_convert", "list"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128],"
               " \"ignored_layers\": [\"lm_head\", 3]}}", RS_EFORMAT, "ignored_layers", "ignored_layers[1]"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128],"
               " \"ignored_layers\": [\"re:model.layers.(1\"]}}", RS_EFORMAT, "ignored_layers", "re:"},
        {NULL, "{\"layer_types\": [\"full_attention\", \"sliding_attention\"]}", RS_EUNSUPPORTED, "layer_types",
         "layer_types[1]"},
        {NULL, "{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}}", RS_EUNSUPPORTED, "rope_scaling",
         "yarn"},
        {NULL, "{\"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 2.0}}", RS_EUNSUPPORTED,
         "rope_parameters", "linear"},
        {NULL, "{\"rope_scaling\": {\"rope_type\": \"llama3\", \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0}}",
         RS_EFORMAT, "factor", "factor"},
        {NULL, "{\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 4.0,"
               " \"high_freq_factor\": 4.0}}", RS_EFORMAT, "rope_scaling", "low_freq_factor"},
        {NULL, "{\"rope_scaling\": 3}", RS_EFORMAT, "rope_scaling", "rope_scaling"},
        {NULL, "{\"partial_rotary_factor\": 0.5}", RS_EUNSUPPORTED, "partial_rotary_factor", "partial"},
        {NULL, "{\"eos_token_id\": 151936}", RS_EFORMAT, "eos_token_id", "eos_token_id"},
        {NULL, "{\"eos_token_id\": [1, \"x\"]}", RS_EFORMAT, "eos_token_id", "eos_token_id"},
        {NULL, "{\"eos_token_id\": [1, 2, 3, 4, 5, 6, 7, 8, 9]}", RS_EUNSUPPORTED, "eos_token_id", "eos"},
        {NULL, "{\"bos_token_id\": -5}", RS_EFORMAT, "bos_token_id", "bos_token_id"},
        /* transformers builds from model_type: a LlamaForCausalLM there would drop Qwen2's biases */
        {NULL, "{\"model_type\": \"llama\"}", RS_EUNSUPPORTED, "model_type", "qwen3"},
        /* use_sliding_window with sliding_window absent: the config class's 4096 */
        {NULL, "{\"use_sliding_window\": true, \"sliding_window\": \"__delete__\", \"layer_types\": \"__delete__\","
               " \"max_window_layers\": 0}", RS_EUNSUPPORTED, "use_sliding_window", "sliding"},
        /* Qwen3-MoE slides every layer (it has no layer_types), window given or not */
        {"moe", "{\"use_sliding_window\": true, \"sliding_window\": \"__delete__\"}", RS_EUNSUPPORTED,
         "use_sliding_window", "sliding"},
        {"moe", "{\"use_sliding_window\": true, \"sliding_window\": 4096, \"layer_types\": [\"full_attention\"]}",
         RS_EUNSUPPORTED, "use_sliding_window", "sliding"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128],"
               " \"dequantize\": true}}", RS_EUNSUPPORTED, "dequantize", "dequantize"},
        {NULL, "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128],"
               " \"scale_fmt\": \"ue8m0\"}}", RS_EUNSUPPORTED, "scale_fmt", "ue8m0"},
        {"moe", "{\"num_experts_per_tok\": 129}", RS_EFORMAT, "num_experts_per_tok", "num_experts_per_tok"},
        {"moe", "{\"moe_intermediate_size\": \"__delete__\"}", RS_EFORMAT, "moe_intermediate_size", "missing"},
        {"moe", "{\"mlp_only_layers\": [-1]}", RS_EFORMAT, "mlp_only_layers", "mlp_only_layers[0]"},
        {"moe", "{\"decoder_sparse_step\": 0}", RS_EFORMAT, "decoder_sparse_step", "decoder_sparse_step"},
    };
    const char *d = rs_test_tmpdir();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_config(d, cases[i].base ? QWEN3_MOE : QWEN3_0_6B, cases[i].patch);
        rs_model_config c;
        rs_error err = {0};
        int rc = rs_model_config_load(d, &c, &err);
        if (rc != cases[i].code || strcmp(err.param, cases[i].param) != 0 || !strstr(err.message, cases[i].needle) ||
            !strstr(err.message, "config.json"))
            RS_TEST_FAIL("patch %s: rc %d (want %d), param \"%s\" (want \"%s\"), message \"%s\"", cases[i].patch, rc,
                         cases[i].code, err.param, cases[i].param, err.message);
    }
    rs_model_config c;
    rs_error err = {0};
    write_text(d, "config.json", "{\"architectures\": [\"Qwen3ForCausalLM\"],");
    ASSERT_EQ(rs_model_config_load(d, &c, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "config.json"));
    write_config(d, QWEN3_0_6B, NULL);
    write_text(d, "generation_config.json", "{\"eos_token_id\": \"x\"}");
    ASSERT_EQ(rs_model_config_load(d, &c, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "generation_config.json"));
    ASSERT_EQ(rs_model_config_load(subdir("nowhere"), &c, &err), RS_ENOTFOUND);
    ASSERT_TRUE(strstr(err.message, "config.json"));
}

/* ---- synthetic models ---- */

static rs_model_config small_cfg(rs_arch arch) {
    /* n_heads * head_dim = 64 != hidden: a transposed weight cannot pass */
    return rs_test_config(arch, (rs_test_dims){.vocab = 96, .hidden = 32, .intermediate = 48, .n_layers = 2,
                                               .n_heads = 4, .n_kv_heads = 2, .head_dim = 16, .max_position = 256,
                                               .moe_intermediate = 24, .rms_eps = 1e-5f});
}

static void write_model(const char *dir, const rs_model_config *c, uint64_t seed) { rs_test_write_model(dir, c, seed); }

static rs_model *load_ok(const char *dir, rs_backend *b) {
    rs_model *m = NULL;
    rs_error err = {0};
    if (rs_model_load(dir, b, NULL, &m, &err) != RS_OK) RS_TEST_FAIL("load: %s", err.message);
    return m;
}

static uint16_t ld16(const void *p, int64_t i) {
    uint16_t v;
    memcpy(&v, (const uint8_t *)p + 2 * i, 2);
    return v;
}

static float ldf32(const void *p, int64_t i) {
    float v;
    memcpy(&v, (const uint8_t *)p + 4 * i, 4);
    return v;
}

/* Checks a loaded tensor against the file: shape, dtype, and values (1-D: converted to f32). */
static void check_tensor(const rs_st_file *f, const char *name, const rs_tensor *t, int64_t d0, int64_t d1) {
    const rs_st_tensor *s = rs_st_find(f, name);
    if (!s) RS_TEST_FAIL("no tensor %s in the file", name);
    ASSERT_EQ(t->ndim, d1 ? 2 : 1);
    ASSERT_EQ(t->shape[0], d0);
    if (d1) ASSERT_EQ(t->shape[1], d1);
    ASSERT_EQ(s->shape[0], d0);
    if (t->ndim == 2) {
        ASSERT_EQ(t->dtype, s->dtype);
        if (memcmp(t->data, s->data, s->nbytes) != 0) RS_TEST_FAIL("%s: loaded bytes differ from the file", name);
        return;
    }
    ASSERT_EQ(t->dtype, RS_DTYPE_F32);
    for (int64_t i = 0; i < d0; i++) {
        float want;
        if (s->dtype == RS_DTYPE_BF16) want = rs_bf16_to_f32(ld16(s->data, i));
        else if (s->dtype == RS_DTYPE_F16) want = rs_f16_to_f32(ld16(s->data, i));
        else want = ldf32(s->data, i);
        if (((const float *)t->data)[i] != want) RS_TEST_FAIL("%s[%lld] = %g, want %g", name, (long long)i,
                                                             ((const float *)t->data)[i], want);
    }
}

static void check_model(const char *dir, const rs_model *m) {
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    rs_st_file *f = NULL;
    rs_error err = {0};
    if (rs_st_open(&f, path, &err) != RS_OK) RS_TEST_FAIL("%s", err.message);
    const rs_model_config *c = &m->cfg;
    const int64_t h = c->hidden, hd = c->head_dim, q = c->n_heads * hd, kv = c->n_kv_heads * hd;
    size_t bytes = 0;
    check_tensor(f, "model.embed_tokens.weight", &m->embed, c->vocab_size, h);
    check_tensor(f, "model.norm.weight", &m->final_norm, h, 0);
    bytes += rs_tensor_nbytes(&m->embed) + rs_tensor_nbytes(&m->final_norm);
    if (c->tie_embeddings) {
        ASSERT_TRUE(m->lm_head.data == m->embed.data);
    } else {
        check_tensor(f, "lm_head.weight", &m->lm_head, c->vocab_size, h);
        bytes += rs_tensor_nbytes(&m->lm_head);
    }
    for (int l = 0; l < c->n_layers; l++) {
        const rs_layer_weights *w = &m->layers[l];
        char n[256];
#define CHECK(field, suffix, d0, d1)                                                   \
    do {                                                                               \
        snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);                        \
        check_tensor(f, n, &w->field, d0, d1);                                         \
        bytes += rs_tensor_nbytes(&w->field);                                          \
    } while (0)
        CHECK(attn_norm, "input_layernorm.weight", h, 0);
        CHECK(mlp_norm, "post_attention_layernorm.weight", h, 0);
        CHECK(wq, "self_attn.q_proj.weight", q, h);
        CHECK(wk, "self_attn.k_proj.weight", kv, h);
        CHECK(wv, "self_attn.v_proj.weight", kv, h);
        CHECK(wo, "self_attn.o_proj.weight", h, q);
        if (c->qkv_bias) {
            CHECK(bq, "self_attn.q_proj.bias", q, 0);
            CHECK(bk, "self_attn.k_proj.bias", kv, 0);
            CHECK(bv, "self_attn.v_proj.bias", kv, 0);
        } else {
            ASSERT_TRUE(!rs_tensor_present(&w->bq) && !rs_tensor_present(&w->bk) && !rs_tensor_present(&w->bv));
        }
        if (c->qk_norm) {
            CHECK(q_norm, "self_attn.q_norm.weight", hd, 0);
            CHECK(k_norm, "self_attn.k_norm.weight", hd, 0);
        } else {
            ASSERT_TRUE(!rs_tensor_present(&w->q_norm) && !rs_tensor_present(&w->k_norm));
        }
        if (c->layer_is_moe[l]) {
            ASSERT_TRUE(!rs_tensor_present(&w->w_gate));
            CHECK(router, "mlp.gate.weight", c->n_experts, h);
            for (int e = 0; e < c->n_experts; e++) {
                char s[128];
                snprintf(s, sizeof s, "mlp.experts.%d.gate_proj.weight", e);
                CHECK(e_gate[e], s, c->moe_intermediate, h);
                snprintf(s, sizeof s, "mlp.experts.%d.up_proj.weight", e);
                CHECK(e_up[e], s, c->moe_intermediate, h);
                snprintf(s, sizeof s, "mlp.experts.%d.down_proj.weight", e);
                CHECK(e_down[e], s, h, c->moe_intermediate);
            }
        } else {
            ASSERT_TRUE(!rs_tensor_present(&w->router) && w->e_gate == NULL);
            CHECK(w_gate, "mlp.gate_proj.weight", c->intermediate, h);
            CHECK(w_up, "mlp.up_proj.weight", c->intermediate, h);
            CHECK(w_down, "mlp.down_proj.weight", h, c->intermediate);
        }
#undef CHECK
    }
    ASSERT_EQ(m->weight_bytes, bytes);
    rs_st_close(f);
}

RS_TEST(model_load_testmodel_qwen3) {
    const char *d = subdir("m");
    rs_model_config c = small_cfg(RS_ARCH_QWEN3);
    write_model(d, &c, 7);
    rs_backend *b = rs_test_host_backend();
    rs_model *m = load_ok(d, b);
    ASSERT_EQ(m->cfg.arch, RS_ARCH_QWEN3);
    ASSERT_EQ(m->cfg.head_dim, 16);
    ASSERT_TRUE(m->cfg.rms_eps == 1e-5f);
    ASSERT_STREQ(m->path, d);
    ASSERT_TRUE(m->backend == b);
    ASSERT_EQ(m->embed.dtype, RS_DTYPE_BF16);
    check_model(d, m);

    /* the generator's distributions: matrices uniform(+-0.0346), norms 1 +- 0.05 */
    const uint16_t *wq = m->layers[1].wq.data;
    double sum = 0, sum2 = 0, amax = 0;
    int64_t n = rs_tensor_numel(&m->layers[1].wq);
    for (int64_t i = 0; i < n; i++) {
        double v = rs_bf16_to_f32(wq[i]);
        sum += v;
        sum2 += v * v;
        amax = fmax(amax, fabs(v));
    }
    ASSERT_TRUE(amax <= 0.0347 && amax > 0.03);
    ASSERT_NEAR(sum / (double)n, 0.0, 0.003);
    ASSERT_NEAR(sqrt(sum2 / (double)n), 0.02, 0.002);
    const float *norm = m->layers[0].attn_norm.data;
    for (int i = 0; i < 32; i++) ASSERT_NEAR(norm[i], 1.0, 0.051);
    rs_model_free(m);
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);
}

RS_TEST(model_load_testmodel_archs) {
    static const rs_arch archs[] = {RS_ARCH_QWEN2, RS_ARCH_LLAMA, RS_ARCH_QWEN3_MOE};
    rs_backend *b = rs_test_host_backend();
    for (size_t i = 0; i < 3; i++) {
        char *d = subdir(rs_arch_name(archs[i]));
        rs_model_config c = small_cfg(archs[i]);
        if (archs[i] == RS_ARCH_LLAMA) {
            c.tie_embeddings = true;
            c.rope_scaling = RS_ROPE_SCALING_LLAMA3;
            c.rope_factor = 8.0;
            c.rope_high_freq_factor = 4.0;
            c.rope_original_max_position = 64;
            c.n_eos = 3;
            c.eos_token_ids[1] = 5;
            c.eos_token_ids[2] = 9;
            c.bos_token_id = -1;
        }
        write_model(d, &c, 11);
        rs_model *m = load_ok(d, b);
        ASSERT_EQ(m->cfg.arch, archs[i]);
        ASSERT_EQ(m->cfg.rope_scaling, c.rope_scaling);
        ASSERT_EQ(m->cfg.n_eos, c.n_eos);
        ASSERT_EQ(m->cfg.bos_token_id, c.bos_token_id);
        ASSERT_EQ(m->cfg.layer_is_moe[0], c.layer_is_moe[0]);
        ASSERT_EQ(m->cfg.layer_is_moe[1], c.layer_is_moe[1]);
        check_model(d, m);
        rs_model_free(m);
        ASSERT_EQ(rs_test_live_allocs, 0);
    }
    rs_backend_free(b);
}

static uint64_t fnv1a_file(const char *path) {
    FILE *fp = fopen(path, "rb");
    if (!fp) RS_TEST_FAIL("cannot open %s", path);
    uint64_t h = 0xcbf29ce484222325ull;
    int ch;
    while ((ch = fgetc(fp)) != EOF) h = (h ^ (uint64_t)ch) * 0x100000001b3ull;
    fclose(fp);
    return h;
}

RS_TEST(model_load_testmodel_deterministic) {
    rs_model_config c = small_cfg(RS_ARCH_QWEN3);
    write_model(subdir("a"), &c, 3);
    write_model(subdir("b"), &c, 3);
    write_model(subdir("c"), &c, 4);
    char pa[512], pb[512], pc[512];
    snprintf(pa, sizeof pa, "%s/model.safetensors", subdir("a"));
    snprintf(pb, sizeof pb, "%s/model.safetensors", subdir("b"));
    snprintf(pc, sizeof pc, "%s/model.safetensors", subdir("c"));
    uint64_t ha = fnv1a_file(pa);
    ASSERT_TRUE(ha == fnv1a_file(pb));
    ASSERT_TRUE(ha != fnv1a_file(pc));
    /* Pinned: the bytes must not change across machines or commits (the daemon's default model and
     * every reference logit computed from it depend on them). Value from the first run of this test;
     * change it only together with a deliberate change of the generator. */
    if (ha != 0x6d1b389bbef93d0eull) RS_TEST_FAIL("model.safetensors FNV-1a 0x%016llx changed", (unsigned long long)ha);
    snprintf(pa, sizeof pa, "%s/config.json", subdir("a"));
    snprintf(pc, sizeof pc, "%s/config.json", subdir("c"));
    ASSERT_TRUE(fnv1a_file(pa) == fnv1a_file(pc));
}

RS_TEST(model_load_testmodel_refuses_inconsistent_cfg) {
    rs_error err = {0};
    rs_model_config c = small_cfg(RS_ARCH_QWEN3);
    c.qk_norm = false; /* Qwen3 always has q/k norms */
    ASSERT_EQ(rs_testmodel_write(subdir("x"), &c, 1, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "qk_norm");
    c = small_cfg(RS_ARCH_QWEN3);
    c.n_kv_heads = 3;
    ASSERT_EQ(rs_testmodel_write(subdir("x"), &c, 1, &err), RS_EFORMAT);
    ASSERT_STREQ(err.param, "num_key_value_heads");
    c = small_cfg(RS_ARCH_QWEN3_MOE);
    c.decoder_sparse_step = 2;
    c.layer_is_moe[0] = true; /* (0 + 1) % 2 != 0: not expressible */
    ASSERT_EQ(rs_testmodel_write(subdir("x"), &c, 1, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "layer_is_moe[l]");
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", subdir("x"));
    ASSERT_TRUE(access(path, F_OK) != 0);
}

/* ---- damaged checkpoints ---- */

/* A checkpoint's tensors as a writable list; data pointers borrow from the open file. */
typedef struct st_list {
    rs_st_file *f;
    rs_st_wtensor t[256];
    size_t n;
} st_list;

static st_list *st_list_load(const char *dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_list *L = calloc(1, sizeof *L);
    rs_error err = {0};
    if (rs_st_open(&L->f, path, &err) != RS_OK) RS_TEST_FAIL("%s", err.message);
    for (size_t i = 0; i < rs_st_count(L->f); i++) {
        const rs_st_tensor *s = rs_st_tensor_at(L->f, i);
        rs_st_wtensor *w = &L->t[L->n++];
        w->name = s->name;
        w->dtype = s->dtype;
        w->ndim = s->ndim;
        memcpy(w->shape, s->shape, sizeof w->shape);
        w->data = s->data;
    }
    return L;
}

static rs_st_wtensor *st_list_get(st_list *L, const char *name) {
    for (size_t i = 0; i < L->n; i++)
        if (strcmp(L->t[i].name, name) == 0) return &L->t[i];
    RS_TEST_FAIL("no tensor %s", name);
}

static void st_list_drop(st_list *L, const char *name) {
    rs_st_wtensor *w = st_list_get(L, name);
    memmove(w, w + 1, (size_t)(&L->t[L->n] - (w + 1)) * sizeof *w);
    L->n--;
}

static void st_list_write(st_list *L, const char *dir, const char *file, size_t from, size_t to) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    rs_error err = {0};
    if (rs_st_write(path, L->t + from, to - from, &err) != RS_OK) RS_TEST_FAIL("%s", err.message);
}

static void st_list_free(st_list *L) {
    rs_st_close(L->f);
    free(L);
}

/* Loads dir and expects failure with code, err.param == param and needles in the message. */
static void expect_load_error(const char *dir, int code, const char *param, const char *n1, const char *n2) {
    rs_backend *b = rs_test_host_backend();
    rs_model *m = (rs_model *)&rs_test_live_allocs; /* sentinel: must stay untouched */
    rs_error err = {0};
    int rc = rs_model_load(dir, b, NULL, &m, &err);
    if (rc != code || strcmp(err.param, param) != 0 || !strstr(err.message, n1) || (n2 && !strstr(err.message, n2)))
        RS_TEST_FAIL("rc %d (want %d), param \"%s\" (want \"%s\"), message \"%s\"", rc, code, err.param, param,
                     err.message);
    ASSERT_TRUE(m == (rs_model *)&rs_test_live_allocs);
    ASSERT_EQ(rs_test_live_allocs, 0); /* everything uploaded before the failure was freed */
    rs_backend_free(b);
}

RS_TEST(model_load_missing_tensor) {
    const char *d = subdir("m");
    rs_model_config c = small_cfg(RS_ARCH_QWEN3);
    write_model(d, &c, 1);
    st_list *L = st_list_load(d);
    st_list_drop(L, "model.layers.1.self_attn.k_norm.weight");
    st_list_write(L, d, "model.safetensors", 0, L->n);
    st_list_free(L);
    expect_load_error(d, RS_EFORMAT, "model.layers.1.self_attn.k_norm.weight", "missing tensor", "[16]");

    /* untied model without lm_head.weight */
    c.tie_embeddings = false;
    write_model(d, &c, 1);
    L = st_list_load(d);
    st_list_drop(L, "lm_head.weight");
    st_list_write(L, d, "model.safetensors", 0, L->n);
    st_list_free(L);
    expect_load_error(d, RS_EFORMAT, "lm_head.weight", "missing tensor", "[96, 32]");

    /* no weights file at all */
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    unlink(path);
    expect_load_error(d, RS_ENOTFOUND, "", "model.safetensors", NULL);
}

RS_TEST(model_load_wrong_shape_and_dtype) {
    const char *d = subdir("m");
    rs_model_config c = small_cfg(RS_ARCH_QWEN2);
    write_model(d, &c, 1);
    /* q_proj [64][32] stored transposed: same bytes, wrong shape */
    st_list *L = st_list_load(d);
    rs_st_wtensor *w = st_list_get(L, "model.layers.0.self_attn.q_proj.weight");
    w->shape[0] = 32;
    w->shape[1] = 64;
    st_list_write(L, d, "model.safetensors", 0, L->n);
    st_list_free(L);
    expect_load_error(d, RS_EFORMAT, "model.layers.0.self_attn.q_proj.weight", "shape [32, 64]", "expected [64, 32]");

    /* the bias of a Qwen2 layer stored as a matrix */
    write_model(d, &c, 1);
    L = st_list_load(d);
    w = st_list_get(L, "model.layers.1.self_attn.v_proj.bias");
    w->ndim = 2;
    w->shape[0] = 2;
    w->shape[1] = 16;
    st_list_write(L, d, "model.safetensors", 0, L->n);
    st_list_free(L);
    expect_load_error(d, RS_EFORMAT, "model.layers.1.self_attn.v_proj.bias", "shape [2, 16], expected [32]", NULL);

    /* the BF16 bytes of up_proj [48][32] relabelled as FP8 [48][64]: the shape is checked first */
    write_model(d, &c, 1);
    L = st_list_load(d);
    w = st_list_get(L, "model.layers.0.mlp.up_proj.weight");
    w->dtype = RS_DTYPE_E4M3;
    w->shape[0] = 48;
    w->shape[1] = 64;
    st_list_write(L, d, "model.safetensors", 0, L->n);
    st_list_free(L);
    expect_load_error(d, RS_EFORMAT, "model.layers.0.mlp.up_proj.weight", "shape [48, 64]", "expected [48, 32]");
}

RS_TEST(model_load_dtypes) {
    const char *d = subdir("m");
    rs_model_config c = small_cfg(RS_ARCH_QWEN3);
    write_model(d, &c, 5);
    st_list *L = st_list_load(d);
    /* an F16 norm (converted to f32 on load), an F32 matrix (kept F32), an FP8 matrix (refused) */
    rs_st_wtensor *n = st_list_get(L, "model.norm.weight");
    uint16_t f16[32];
    for (int i = 0; i < 32; i++) f16[i] = rs_f32_to_f16(rs_bf16_to_f32(ld16(n->data, i)));
    n->dtype = RS_DTYPE_F16;
    n->data = f16;
    rs_st_wtensor *q = st_list_get(L, "model.layers.0.self_attn.q_proj.weight");
    float *q32 = malloc(64 * 32 * sizeof *q32);
    for (int i = 0; i < 64 * 32; i++) q32[i] = rs_bf16_to_f32(ld16(q->data, i));
    q->dtype = RS_DTYPE_F32;
    q->data = q32;
    st_list_write(L, d, "model.safetensors", 0, L->n);
    rs_backend *b = rs_test_host_backend();
    rs_model *m = load_ok(d, b);
    ASSERT_EQ(m->final_norm.dtype, RS_DTYPE_F32);
    ASSERT_EQ(m->layers[0].wq.dtype, RS_DTYPE_F32);
    ASSERT_EQ(m->layers[1].wq.dtype, RS_DTYPE_BF16);
    check_model(d, m);
    for (int i = 0; i < 32; i++) ASSERT_TRUE(((float *)m->final_norm.data)[i] == rs_f16_to_f32(f16[i]));
    rs_model_free(m);

    uint8_t fp8[48 * 32] = {0};
    rs_st_wtensor *u = st_list_get(L, "model.layers.1.mlp.down_proj.weight");
    u->dtype = RS_DTYPE_E4M3;
    u->data = fp8;
    st_list_write(L, d, "model.safetensors", 0, L->n);
    st_list_free(L);
    free(q32);
    expect_load_error(d, RS_EUNSUPPORTED, "model.layers.1.mlp.down_proj.weight", "F8_E4M3", "BF16, F16 or F32");
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);
}

RS_TEST(model_load_ignores_extra_tensors) {
    rs_backend *b = rs_test_host_backend();
    for (int differs = 0; differs <= 1; differs++) {
        const char *d = subdir("m");
        rs_model_config c = small_cfg(RS_ARCH_LLAMA);
        c.tie_embeddings = true;
        write_model(d, &c, 2);
        st_list *L = st_list_load(d);
        float inv[8] = {0};
        uint16_t lm[96 * 32];
        for (size_t i = 0; i < L->n; i++)
            if (strcmp(L->t[i].name, "model.embed_tokens.weight") == 0) memcpy(lm, L->t[i].data, sizeof lm);
        lm[5] ^= (uint16_t)differs;
        L->t[L->n++] = (rs_st_wtensor){.name = "model.layers.0.self_attn.rotary_emb.inv_freq", .dtype = RS_DTYPE_F32,
                                       .ndim = 1, .shape = {8}, .data = inv};
        /* tied, and the file carries the embedding again as lm_head.weight: served tied. An
         * lm_head.weight that differs is what transformers 5 computes the logits with (it does not
         * tie then): refused, naming tie_word_embeddings, rather than served as another model */
        L->t[L->n++] = (rs_st_wtensor){.name = "lm_head.weight", .dtype = RS_DTYPE_BF16, .ndim = 2,
                                       .shape = {96, 32}, .data = lm};
        st_list_write(L, d, "model.safetensors", 0, L->n);
        st_list_free(L);
        if (differs) {
            rs_model *m = NULL;
            rs_error err = {0};
            ASSERT_EQ(rs_model_load(d, b, NULL, &m, &err), RS_EUNSUPPORTED);
            ASSERT_STREQ(err.param, "tie_word_embeddings");
            ASSERT_TRUE(strstr(err.message, "lm_head.weight differs") != NULL);
        } else {
            rs_model *m = load_ok(d, b);
            ASSERT_TRUE(m->lm_head.data == m->embed.data);
            check_model(d, m);
            rs_model_free(m);
        }
        ASSERT_EQ(rs_test_live_allocs, 0);
    }
    rs_backend_free(b);
}

RS_TEST(model_load_sharded) {
    const char *d = subdir("m");
    rs_model_config c = small_cfg(RS_ARCH_QWEN3_MOE);
    write_model(d, &c, 9);
    rs_backend *b = rs_test_host_backend();
    rs_model *single = load_ok(d, b);

    /* split into two shards with an index, as save_pretrained does for large models */
    st_list *L = st_list_load(d);
    size_t half = L->n / 2;
    st_list_write(L, d, "model-00001-of-00002.safetensors", 0, half);
    st_list_write(L, d, "model-00002-of-00002.safetensors", half, L->n);
    json_t *wm = json_object();
    for (size_t i = 0; i < L->n; i++)
        json_object_set_new(wm, L->t[i].name,
                            json_string(i < half ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors"));
    json_t *index = json_pack("{s:{s:i}, s:o}", "metadata", "total_size", 0, "weight_map", wm);
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", d);
    json_dump_file(index, path, JSON_INDENT(2));
    json_decref(index);
    st_list_free(L);
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    char keep[600];
    snprintf(keep, sizeof keep, "%s.single", path);
    ASSERT_EQ(rename(path, keep), 0);

    rs_model *sharded = load_ok(d, b);
    ASSERT_EQ(sharded->weight_bytes, single->weight_bytes);
    ASSERT_TRUE(memcmp(sharded->embed.data, single->embed.data, rs_tensor_nbytes(&single->embed)) == 0);
    ASSERT_TRUE(memcmp(sharded->lm_head.data, single->lm_head.data, rs_tensor_nbytes(&single->lm_head)) == 0);
    for (int l = 0; l < c.n_layers; l++) {
        const rs_layer_weights *a = &single->layers[l], *s = &sharded->layers[l];
        ASSERT_TRUE(memcmp(a->mlp_norm.data, s->mlp_norm.data, rs_tensor_nbytes(&a->mlp_norm)) == 0);
        ASSERT_TRUE(memcmp(a->wo.data, s->wo.data, rs_tensor_nbytes(&a->wo)) == 0);
        if (c.layer_is_moe[l])
            for (int e = 0; e < c.n_experts; e++)
                ASSERT_TRUE(memcmp(a->e_down[e].data, s->e_down[e].data, rs_tensor_nbytes(&a->e_down[e])) == 0);
    }
    rs_model_free(sharded);
    rs_model_free(single);
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);

    /* a shard named outside the directory is refused even though the file exists there */
    char target[600];
    snprintf(target, sizeof target, "%s/../escape.safetensors", d);
    ASSERT_EQ(rename(keep, target), 0);
    write_text(d, "model.safetensors.index.json",
               "{\"weight_map\": {\"model.embed_tokens.weight\": \"../escape.safetensors\"}}");
    expect_load_error(d, RS_EFORMAT, "model.embed_tokens.weight", "plain file name", "../escape.safetensors");
}

/* ---- RoPE ---- */

RS_TEST(model_load_rope_inv_freq) {
    /* Produced with transformers 5.24.0 / torch 2.15 on CPU (AVX512):
     *   LlamaRotaryEmbedding(LlamaConfig(hidden_size=128, num_attention_heads=4, rope_theta=500000.0,
     *       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
     *       original_max_position_embeddings=8192))).inv_freq          (head_dim 32)
     *   Qwen3RotaryEmbedding(Qwen3Config(hidden_size=256, num_attention_heads=4, head_dim=64,
     *       rope_theta=1000000.0)).inv_freq                              (head_dim 64)
     * printed with float.hex(). torch's CPU pow is SLEEF's 1-ulp powf, ours is libm's, hence the
     * 2-ulp tolerance. */
    static const float llama3[16] = {
        0x1.000000p+0f,  0x1.c2ef78p-2f,  0x1.8d2760p-3f,  0x1.5dc95ap-4f,  0x1.341190p-5f,  0x1.0f5386p-6f,
        0x1.ddee9ep-8f,  0x1.a4ee40p-9f,  0x1.132ba4p-11f, 0x1.46831ap-14f, 0x1.1f91f0p-15f, 0x1.fa8b86p-17f,
        0x1.be2188p-18f, 0x1.88ec20p-19f, 0x1.5a0f4ep-20f, 0x1.30c94ep-21f};
    static const float qwen3[32] = {
        0x1.000000p+0f,  0x1.4c7bc0p-1f,  0x1.afd136p-2f,  0x1.186a08p-2f,  0x1.6c310ep-3f,  0x1.d8ffacp-4f,
        0x1.33281ap-4f,  0x1.8eec7ep-5f,  0x1.030dc6p-5f,  0x1.507316p-6f,  0x1.b4f7e4p-7f,  0x1.1bc25ap-7f,
        0x1.708938p-8f,  0x1.dea41cp-9f,  0x1.36d21ap-9f,  0x1.93aeb8p-10f, 0x1.0624dep-10f, 0x1.547688p-11f,
        0x1.ba2e4ap-12f, 0x1.1f24e4p-12f, 0x1.74eea6p-13f, 0x1.e459c4p-14f, 0x1.3a8748p-14f, 0x1.987f7cp-15f,
        0x1.094564p-15f, 0x1.58863ap-16f, 0x1.bf749ep-17f, 0x1.2291c6p-17f, 0x1.796182p-18f, 0x1.ea20e0p-19f,
        0x1.3e47c8p-19f, 0x1.9d5ef2p-20f};
    rs_backend *b = rs_test_host_backend();

    rs_model_config c = small_cfg(RS_ARCH_LLAMA);
    c.hidden = 128;
    c.n_heads = 4;
    c.n_kv_heads = 4;
    c.head_dim = 32;
    c.rope_theta = 500000.0;
    c.max_position = 131072;
    c.rope_scaling = RS_ROPE_SCALING_LLAMA3;
    c.rope_factor = 8.0;
    c.rope_low_freq_factor = 1.0;
    c.rope_high_freq_factor = 4.0;
    c.rope_original_max_position = 8192;
    write_model(subdir("llama"), &c, 1);
    rs_model *m = load_ok(subdir("llama"), b);
    int bands[3] = {0};
    for (int i = 0; i < 16; i++) {
        ASSERT_NEAR(m->rope_inv_freq[i], llama3[i], 2.5e-7 * llama3[i]);
        /* independently, in double: the three llama3 bands */
        double inv = 1.0 / pow(500000.0, 2.0 * i / 32.0), wl = 2 * M_PI / inv, want;
        if (wl < 8192.0 / 4.0) want = inv, bands[0]++;
        else if (wl > 8192.0) want = inv / 8.0, bands[2]++;
        else {
            double s = (8192.0 / wl - 1.0) / 3.0;
            want = (1 - s) * inv / 8.0 + s * inv;
            bands[1]++;
        }
        ASSERT_NEAR(m->rope_inv_freq[i], want, 1e-6 * want);
    }
    ASSERT_TRUE(bands[0] > 0 && bands[1] > 0 && bands[2] > 0);
    rs_model_free(m);

    c = small_cfg(RS_ARCH_QWEN3);
    c.hidden = 256;
    c.head_dim = 64;
    c.rope_theta = 1e6;
    write_model(subdir("qwen3"), &c, 1);
    m = load_ok(subdir("qwen3"), b);
    for (int i = 0; i < 32; i++) ASSERT_NEAR(m->rope_inv_freq[i], qwen3[i], 2.5e-7 * qwen3[i]);
    rs_model_free(m);
    rs_backend_free(b);
}

/* ---- presets ---- */

RS_TEST(model_load_presets) {
    rs_model_config c;
    ASSERT_EQ(rs_model_preset("nope", &c), RS_ENOTFOUND);
    ASSERT_EQ(rs_model_preset_seed("nope"), 0);
    ASSERT_EQ(rs_model_preset("qwen3-0.6b", &c), RS_OK);
    ASSERT_EQ(c.vocab_size, 151936);
    ASSERT_EQ(c.n_layers, 28);
    ASSERT_EQ(c.head_dim, 128);
    ASSERT_EQ(c.max_position, 40960);
    ASSERT_EQ(rs_model_preset_seed("qwen3-0.6b"), 2);
    ASSERT_EQ(rs_model_preset("qwen3-8b", &c), RS_OK);
    ASSERT_EQ(c.hidden, 4096);
    ASSERT_EQ(c.intermediate, 12288);
    ASSERT_EQ(c.n_layers, 36);
    ASSERT_EQ(c.n_heads, 32);
    ASSERT_EQ(c.n_kv_heads, 8);
    ASSERT_TRUE(!c.tie_embeddings);
    ASSERT_EQ(rs_model_preset_seed("qwen3-8b"), 3);
    ASSERT_EQ(rs_model_preset("default", &c), RS_OK);
    ASSERT_EQ(rs_model_preset_seed("default"), 1);

    rs_error err = {0};
    const char *d = subdir("default");
    ASSERT_EQ(rs_model_preset_write("nope", d, &err), RS_ENOTFOUND);
    ASSERT_EQ(rs_model_preset_write("default", d, &err), RS_OK);
    rs_backend *b = rs_test_host_backend();
    rs_model *m = load_ok(d, b);
    const rs_model_config *l = &m->cfg;
    ASSERT_EQ(l->arch, RS_ARCH_QWEN3);
    ASSERT_EQ(l->vocab_size, 8192);
    ASSERT_EQ(l->hidden, 512);
    ASSERT_EQ(l->intermediate, 1536);
    ASSERT_EQ(l->n_layers, 8);
    ASSERT_EQ(l->n_heads, 8);
    ASSERT_EQ(l->n_kv_heads, 4);
    ASSERT_EQ(l->head_dim, 64);
    ASSERT_EQ(l->max_position, 4096);
    ASSERT_TRUE(l->rms_eps == 1e-6f);
    ASSERT_TRUE(l->rope_theta == 1e6);
    ASSERT_TRUE(l->tie_embeddings && l->qk_norm);
    ASSERT_EQ(l->bos_token_id, 1);
    ASSERT_EQ(l->n_eos, 1);
    ASSERT_EQ(l->eos_token_ids[0], 2);
    check_model(d, m);
    rs_model_free(m);
    ASSERT_EQ(rs_test_live_allocs, 0);
    rs_backend_free(b);

    /* the generator's bytes are pinned (benchmarks compare runs across builds): FNV-1a 64 of the
     * whole file, as written by the single-threaded generator before tensors were filled in parallel */
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    FILE *fp = fopen(path, "rb");
    ASSERT_TRUE(fp != NULL);
    uint64_t h = 0xcbf29ce484222325ull, len = 0;
    unsigned char buf[1 << 16];
    for (size_t got; (got = fread(buf, 1, sizeof buf, fp)) > 0; len += got)
        for (size_t i = 0; i < got; i++) h = (h ^ buf[i]) * 0x100000001b3ull;
    fclose(fp);
    ASSERT_EQ(len, 58749528u);
    ASSERT_EQ(h, 0x2c621483527ca5e7ull);
}
