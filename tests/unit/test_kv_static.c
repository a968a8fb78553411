/*
 * test_kv_static.c — the "static" FP8 KV scale mode reads self_attn.k_scale / v_scale from the
 * checkpoint. Writing the scales that calibration computes into the checkpoint must give exactly
 * the logprobs of calibrate mode; a checkpoint without them is refused at start.
 */
#include <stdio.h>
#include <stdlib.h>

#include "../../kvcache/calibrate.h"
#include "../../model/presets.h"
#include "../../model/safetensors.h"
#include "../../scheduler/engine.h"
#include "test.h"

static void small_config(rs_model_config *c) {
    ASSERT_EQ(rs_model_preset("default", c), RS_OK);
    c->vocab_size = 256;
    c->hidden = 64;
    c->intermediate = 128;
    c->n_layers = 2;
    c->n_heads = 4;
    c->n_kv_heads = 2;
    c->head_dim = 16;
    c->max_position = 256;
}

static int engine_for(rs_model *m, bool is_static, rs_engine **e, rs_error *err) {
    rs_engine_opts o = {.kv_cache_bytes = 1 << 20, .max_running = 4, .max_step_tokens = 256,
                        .kv_dtype = RS_DTYPE_E4M3, .kv_scale_mode = RS_KV_SCALE_PER_HEAD,
                        .kv_calib_margin = 1.2f, .kv_calib_percentile = 1.0f, .kv_scales_static = is_static,
                        .limits = {.max_context = 256, .max_new_tokens = 16, .max_n = 1, .max_batch = 1}};
    return rs_engine_init(e, m, &o, err);
}

static void score(rs_engine *e, float *out /* [39] */) {
    rs_gen_job *j = rs_gen_job_new();
    j->n_prompts = 1;
    j->prompts = calloc(1, sizeof(int32_t *));
    j->prompt_lens = calloc(1, sizeof(int));
    j->prompt_lens[0] = 40;
    j->prompts[0] = malloc(40 * sizeof(int32_t));
    for (int i = 0; i < 40; i++) j->prompts[0][i] = (i * 37 + 11) % 256;
    j->sp.max_new_tokens = 0;
    j->logprob_start_len = 1;
    rs_error err = {0};
    ASSERT_EQ(rs_engine_submit(e, j, &err), RS_OK);
    rs_engine_run_until_idle(e);
    for (int i = 0; i < 39; i++) out[i] = j->outputs[0].input_logprobs[i];
    rs_gen_job_free(j);
}

RS_TEST(kv_static_scales_from_checkpoint) {
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/m", rs_test_tmpdir());
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    rs_model_config cfg;
    small_config(&cfg);
    rs_error err = {0};
    ASSERT_EQ(rs_testmodel_write(dir, &cfg, 5, &err), RS_OK);
    rs_backend *b = rs_backend_cpu_init(1);
    rs_model *m = NULL;
    ASSERT_EQ(rs_model_load(dir, b, NULL, &m, &err), RS_OK);

    rs_engine *e = NULL;
    ASSERT_EQ(engine_for(m, true, &e, &err), RS_ENOTFOUND); /* no scales in the checkpoint yet */
    ASSERT_STREQ(err.param, "model.layers.0.self_attn.k_scale");

    /* calibrate mode's scales, written into the checkpoint as per-head tensors */
    enum { L = 2, H = 2 };
    float k[L * H], v[L * H];
    rs_kv_calib_opts co = {.percentile = 1.0f, .margin = 1.2f};
    ASSERT_EQ(rs_kv_calibrate(m, &co, k, v, &err), RS_OK);
    rs_st_file *f = NULL;
    ASSERT_EQ(rs_st_open(&f, path, &err), RS_OK);
    size_t n = rs_st_count(f);
    rs_st_wtensor *w = calloc(n + 2 * L, sizeof *w);
    char names[2 * L][64];
    for (size_t i = 0; i < n; i++) {
        const rs_st_tensor *t = rs_st_tensor_at(f, i);
        w[i] = (rs_st_wtensor){.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .data = t->data};
        for (int d = 0; d < t->ndim; d++) w[i].shape[d] = t->shape[d];
    }
    for (int l = 0; l < L; l++) {
        for (int kv = 0; kv < 2; kv++) {
            int i = 2 * l + kv;
            snprintf(names[i], sizeof names[i], "model.layers.%d.self_attn.%s", l, kv ? "v_scale" : "k_scale");
            w[n + i] = (rs_st_wtensor){.name = names[i], .dtype = RS_DTYPE_F32, .ndim = 1, .shape = {H},
                                       .data = (kv ? v : k) + l * H};
        }
    }
    char tmp[700];
    snprintf(tmp, sizeof tmp, "%s.new", path);
    ASSERT_EQ(rs_st_write(tmp, w, n + 2 * L, &err), RS_OK);
    rs_st_close(f);
    ASSERT_EQ(rename(tmp, path), 0);
    free(w);

    float a[39], c[39];
    ASSERT_EQ(engine_for(m, true, &e, &err), RS_OK);
    score(e, a);
    rs_engine_free(e);
    ASSERT_EQ(engine_for(m, false, &e, &err), RS_OK);
    score(e, c);
    rs_engine_free(e);
    for (int i = 0; i < 39; i++) ASSERT_TRUE(a[i] == c[i]);
    rs_model_free(m);
    rs_backend_free(b);
}
