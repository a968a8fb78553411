/*
 * test_kv_static.c — the "static" FP8 KV scale mode reads self_attn.k_scale / v_scale from the
 * checkpoint. Writing the scales that calibration computes into the checkpoint must give exactly
 * the logprobs of calibrate mode; a checkpoint without them is refused at start. Scales pushed
 * with a weight update replace them exactly as loading a checkpoint that holds them would.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../model/kv_calibrate.h"
#include "../../model/kv_scales.h"
#include "../../model/presets.h"
#include "../../model/quant.h"
#include "../../model/safetensors.h"
#include "../../scheduler/engine.h"
#include "../../sync/transaction.h"
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
                        .kv_dtype = RS_DTYPE_E4M3, .kv_scales = is_static ? RS_KV_SCALES_STATIC : RS_KV_SCALES_CALIBRATE,
                        .kv_calib_margin = 1.2f, .kv_calib_percentile = 1.0f,
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

enum { L = 2, H = 2 }; /* small_config's layers and KV heads */

/* Rewrites dir's model.safetensors: every tensor as it is, except that with double_proj every BF16
 * projection (q/k/v/o, gate/up/down) is multiplied by 2 (exact, and quantized to the same E4M3
 * codes with twice the block scales); then `extra` is appended. */
static void rewrite_checkpoint(const char *dir, bool double_proj, const rs_st_wtensor *extra, size_t n_extra) {
    char path[600], tmp[700];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    snprintf(tmp, sizeof tmp, "%s.new", path);
    rs_error err = {0};
    rs_st_file *f = NULL;
    ASSERT_EQ(rs_st_open(&f, path, &err), RS_OK);
    const size_t n = rs_st_count(f);
    rs_st_wtensor *w = calloc(n + n_extra, sizeof *w);
    uint16_t **bufs = calloc(n, sizeof *bufs);
    for (size_t i = 0; i < n; i++) {
        const rs_st_tensor *t = rs_st_tensor_at(f, i);
        w[i] = (rs_st_wtensor){.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .data = t->data};
        for (int d = 0; d < t->ndim; d++) w[i].shape[d] = t->shape[d];
        if (!double_proj || t->dtype != RS_DTYPE_BF16 || t->ndim != 2 || !strstr(t->name, "_proj.")) continue;
        const size_t numel = (size_t)(t->shape[0] * t->shape[1]);
        bufs[i] = malloc(numel * sizeof(uint16_t));
        for (size_t j = 0; j < numel; j++) {
            uint16_t h;
            memcpy(&h, (const uint8_t *)t->data + 2 * j, 2);
            bufs[i][j] = rs_f32_to_bf16(2.0f * rs_bf16_to_f32(h));
        }
        w[i].data = bufs[i];
    }
    for (size_t i = 0; i < n_extra; i++) w[n + i] = extra[i];
    ASSERT_EQ(rs_st_write(tmp, w, n + n_extra, &err), RS_OK);
    rs_st_close(f);
    ASSERT_EQ(rename(tmp, path), 0);
    for (size_t i = 0; i < n; i++) free(bufs[i]);
    free(bufs);
    free(w);
}

/* Rewrites dir's model.safetensors with per-head k[L*H], v[L*H] as self_attn.k_scale / v_scale. */
static void add_scales(const char *dir, int nl, int nh, const float *k, const float *v) {
    rs_st_wtensor *extra = calloc(2 * (size_t)nl, sizeof *extra);
    char(*names)[64] = calloc(2 * (size_t)nl, 64);
    for (int l = 0; l < nl; l++) {
        for (int kv = 0; kv < 2; kv++) {
            int i = 2 * l + kv;
            snprintf(names[i], 64, "model.layers.%d.self_attn.%s", l, kv ? "v_scale" : "k_scale");
            extra[i] = (rs_st_wtensor){.name = names[i], .dtype = RS_DTYPE_F32, .ndim = 1, .shape = {nh},
                                       .data = (kv ? v : k) + l * nh};
        }
    }
    rewrite_checkpoint(dir, false, extra, 2 * (size_t)nl);
    free(extra);
    free(names);
}

RS_TEST(kv_static_scales_from_checkpoint) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/m", rs_test_tmpdir());
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
    float k[L * H], v[L * H];
    rs_kv_calib_opts co = {.percentile = 1.0f, .margin = 1.2f};
    ASSERT_EQ(rs_kv_calibrate(m, &co, k, v, &err), RS_OK);
    add_scales(dir, L, H, k, v);

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

/* Stages every tensor of checkpoint `dir`; with_scales false leaves out the KV scales, and
 * only_layer >= 0 keeps just that layer's. */
static void stage_dir(rs_txn *u, const char *dir, bool with_scales, int only_layer) {
    rs_st_dir *d = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_st_dir_open(&d, dir, &err), RS_OK);
    for (size_t i = 0; i < rs_st_dir_count(d); i++) {
        const rs_st_tensor *t = rs_st_dir_tensor_at(d, i, NULL);
        int layer = -1;
        bool is_v = false, is_scale = rs_kv_scale_name(t->name, L, &layer, &is_v);
        if (is_scale && (!with_scales || (only_layer >= 0 && layer != only_layer))) continue;
        rs_txn_tensor ut = {.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .shape = t->shape,
                               .data = t->data};
        if (rs_txn_add(u, &ut, &err) != RS_OK) RS_TEST_FAIL("add %s: %s", t->name, err.message);
    }
    rs_st_dir_close(d);
}

/* Checkpoints <tmp>/<tag>a and <tag>b of small_config, both with seed 5 (the same weights). */
static void two_checkpoints(char *a_dir, char *b_dir, size_t cap, const char *tag) {
    snprintf(a_dir, cap, "%s/%sa", rs_test_tmpdir(), tag);
    snprintf(b_dir, cap, "%s/%sb", rs_test_tmpdir(), tag);
    rs_model_config cfg;
    small_config(&cfg);
    rs_error err = {0};
    ASSERT_EQ(rs_testmodel_write(a_dir, &cfg, 5, &err), RS_OK);
    ASSERT_EQ(rs_testmodel_write(b_dir, &cfg, 5, &err), RS_OK);
}

static bool same(const float *a, const float *b, int n) {
    for (int i = 0; i < n; i++)
        if (!(a[i] == b[i])) return false;
    return true;
}

/* k_scale / v_scale pushed with the weights (NeMo-RL streams its calibrated scales that way):
 * under static mode the engine serves exactly what a fresh load of a checkpoint holding them
 * serves; a push without scales keeps them; a partial set is refused whole; other modes do not
 * use them. */
RS_TEST(kv_static_scales_pushed_with_weights) {
    char a_dir[512], b_dir[512];
    two_checkpoints(a_dir, b_dir, sizeof a_dir, ""); /* the same weights */
    rs_error err = {0};
    rs_backend *b = rs_backend_cpu_init(1);
    rs_model *m = NULL;
    ASSERT_EQ(rs_model_load(a_dir, b, NULL, &m, &err), RS_OK);
    float ka[L * H], va[L * H], kb[L * H], vb[L * H];
    rs_kv_calib_opts co = {.percentile = 1.0f, .margin = 1.0f};
    ASSERT_EQ(rs_kv_calibrate(m, &co, ka, va, &err), RS_OK);
    for (int i = 0; i < L * H; i++) kb[i] = 4.0f * ka[i], vb[i] = 3.0f * va[i]; /* coarser: other logprobs */
    add_scales(a_dir, L, H, ka, va);
    add_scales(b_dir, L, H, kb, vb);

    /* the reference: an engine started on checkpoint b */
    float sa[39], sb[39], s[39];
    rs_model *mb = NULL;
    rs_engine *e = NULL;
    ASSERT_EQ(rs_model_load(b_dir, b, NULL, &mb, &err), RS_OK);
    ASSERT_EQ(engine_for(mb, true, &e, &err), RS_OK);
    score(e, sb);
    rs_engine_free(e);
    rs_model_free(mb);

    ASSERT_EQ(engine_for(m, true, &e, &err), RS_OK);
    ASSERT_EQ(rs_engine_kv_scales(e), RS_KV_SCALES_STATIC);
    score(e, sa);
    ASSERT_TRUE(!(same(sa, sb, 39))); /* the scales matter */

    rs_txn *u = NULL;
    ASSERT_EQ(rs_txn_begin(&u, m, "v1", 0, &err), RS_OK);
    stage_dir(u, b_dir, true, -1);
    ASSERT_TRUE(rs_txn_has_kv_scales(u));
    ASSERT_EQ(rs_txn_commit(u, e, false, NULL, &err), RS_OK);
    score(e, s);
    ASSERT_TRUE(same(s, sb, 39));

    ASSERT_EQ(rs_txn_begin(&u, m, "v2", 0, &err), RS_OK); /* weights only: scales kept */
    stage_dir(u, a_dir, false, -1);
    ASSERT_TRUE(!(rs_txn_has_kv_scales(u)));
    ASSERT_EQ(rs_txn_commit(u, e, false, NULL, &err), RS_OK);
    score(e, s);
    ASSERT_TRUE(same(s, sb, 39));

    ASSERT_EQ(rs_txn_begin(&u, m, "v3", 0, &err), RS_OK); /* layer 0's scales only: refused whole */
    stage_dir(u, a_dir, true, 0);
    ASSERT_TRUE(!(rs_txn_complete(u)));
    ASSERT_EQ(rs_txn_commit(u, e, false, NULL, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "model.layers.1.self_attn.k_scale");
    ASSERT_TRUE(strstr(err.message, "every layer") != NULL);
    score(e, s);
    ASSERT_TRUE(same(s, sb, 39));
    ASSERT_STREQ(rs_engine_weight_version(e), "v2");

    /* bad scale tensors */
    ASSERT_EQ(rs_txn_begin(&u, m, NULL, 0, &err), RS_OK);
    const int64_t one[1] = {1}, three[1] = {3};
    const float nan1 = NAN, neg = -1.0f, ok[H] = {0.5f, 0.25f};
    rs_txn_tensor t = {.name = "model.layers.0.self_attn.k_scale", .dtype = RS_DTYPE_F32, .ndim = 1,
                          .shape = one, .data = &nan1};
    ASSERT_EQ(rs_txn_add(u, &t, &err), RS_EINVAL);
    t.data = &neg;
    ASSERT_EQ(rs_txn_add(u, &t, &err), RS_EINVAL);
    t.shape = three;
    t.data = ok;
    ASSERT_EQ(rs_txn_add(u, &t, &err), RS_EFORMAT); /* neither a scalar nor one per KV head */
    t.ndim = 0;                                       /* a scalar: broadcast */
    ASSERT_EQ(rs_txn_add(u, &t, &err), RS_OK);
    ASSERT_EQ(rs_txn_add(u, &t, &err), RS_EINVAL); /* duplicate */
    ASSERT_STREQ(err.param, "model.layers.0.self_attn.k_scale");
    t.name = "model.layers.2.self_attn.v_scale"; /* no layer 2 */
    ASSERT_EQ(rs_txn_add(u, &t, &err), RS_EINVAL);
    ASSERT_TRUE(strstr(err.message, "unknown tensor") != NULL);
    t.name = "model.layers.0.self_attn.q_scale";
    ASSERT_EQ(rs_txn_add(u, &t, &err), RS_EINVAL);
    ASSERT_TRUE(strstr(err.message, "query scale") != NULL);
    rs_txn_abort(u);
    rs_engine_free(e);

    /* calibrate mode: pushed scales are not used; the scales follow the weights */
    rs_engine *ec = NULL, *fresh = NULL;
    ASSERT_EQ(engine_for(m, false, &ec, &err), RS_OK);
    ASSERT_EQ(rs_engine_kv_scales(ec), RS_KV_SCALES_CALIBRATE);
    ASSERT_EQ(rs_txn_begin(&u, m, "v4", 0, &err), RS_OK);
    stage_dir(u, b_dir, true, -1);
    ASSERT_EQ(rs_txn_commit(u, ec, false, NULL, &err), RS_OK);
    score(ec, s);
    ASSERT_EQ(engine_for(m, false, &fresh, &err), RS_OK);
    score(fresh, sa);
    ASSERT_TRUE(same(s, sa, 39));
    ASSERT_TRUE(!(same(s, sb, 39)));
    rs_engine_free(fresh);
    rs_engine_free(ec);
    rs_model_free(m);
    rs_backend_free(b);
}

/* Calibrate mode with a calibration backend (the sync service's): the scales are computed over
 * the staged weights before the commit, on that backend (here with another thread count than the
 * engine's), and what the engine then serves is bit for bit what an engine started on the new
 * checkpoint serves, FP8 weights included. The new weights are the old ones with every projection
 * doubled: the same E4M3 codes with twice the block scales, so a calibration that read the old
 * scales (or the old weights) would get other KV scales. New weights whose K/V are not finite on
 * the calibration set are refused before the swap: the old weights keep serving. */
RS_TEST(kv_calibrated_before_commit) {
    char a_dir[512], b_dir[512];
    two_checkpoints(a_dir, b_dir, sizeof a_dir, "c");
    rewrite_checkpoint(b_dir, true, NULL, 0); /* every projection doubled */
    rs_error err = {0};
    rs_quant_policy qp;
    ASSERT_EQ(rs_quant_policy_init(&qp, "fp8", "", 0, 0, &err), RS_OK);
    rs_backend *b = rs_backend_cpu_init(1), *calib = rs_backend_cpu_init(3);

    float sa[39], sb[39], s[39];
    rs_model *mb = NULL, *m = NULL;
    rs_engine *e = NULL;
    ASSERT_EQ(rs_model_load(b_dir, b, &qp, &mb, &err), RS_OK);
    ASSERT_TRUE(mb->n_quantized > 0);
    ASSERT_EQ(engine_for(mb, false, &e, &err), RS_OK);
    score(e, sb);
    rs_engine_free(e);
    rs_model_free(mb);

    ASSERT_EQ(rs_model_load(a_dir, b, &qp, &m, &err), RS_OK);
    ASSERT_EQ(engine_for(m, false, &e, &err), RS_OK);
    ASSERT_EQ(rs_engine_kv_scales(e), RS_KV_SCALES_CALIBRATE);
    score(e, sa);
    ASSERT_TRUE(!(same(sa, sb, 39)));

    rs_txn *u = NULL;
    ASSERT_EQ(rs_txn_begin(&u, m, "v1", 0, &err), RS_OK);
    rs_txn_set_calib_backend(u, calib);
    stage_dir(u, b_dir, false, -1);
    if (rs_txn_commit(u, e, false, NULL, &err) != RS_OK) RS_TEST_FAIL("commit: %s", err.message);
    score(e, s);
    ASSERT_TRUE(same(s, sb, 39));

    /* back to A, with layer 0's k_norm made FLT_MAX: K overflows, and so the calibration is not finite */
    ASSERT_EQ(rs_txn_begin(&u, m, "v2", 0, &err), RS_OK);
    rs_txn_set_calib_backend(u, calib);
    rs_st_dir *d = NULL;
    ASSERT_EQ(rs_st_dir_open(&d, a_dir, &err), RS_OK);
    float inf[16];
    for (int i = 0; i < 16; i++) inf[i] = FLT_MAX; /* finite, so staged (a non-finite weight is refused there) */
    for (size_t i = 0; i < rs_st_dir_count(d); i++) {
        const rs_st_tensor *t = rs_st_dir_tensor_at(d, i, NULL);
        rs_txn_tensor ut = {.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .shape = t->shape,
                               .data = t->data};
        if (!strcmp(t->name, "model.layers.0.self_attn.k_norm.weight")) {
            ASSERT_EQ(t->shape[0], 16);
            ut.dtype = RS_DTYPE_F32;
            ut.data = inf;
        }
        if (rs_txn_add(u, &ut, &err) != RS_OK) RS_TEST_FAIL("add %s: %s", t->name, err.message);
    }
    rs_st_dir_close(d);
    ASSERT_EQ(rs_txn_commit(u, e, false, NULL, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "kv-cache-dtype");
    if (!strstr(err.message, "weights in service are unchanged")) RS_TEST_FAIL("message: %s", err.message);
    ASSERT_STREQ(rs_engine_weight_version(e), "v1");
    score(e, s);
    ASSERT_TRUE(same(s, sb, 39));

    rs_engine_free(e);
    rs_model_free(m);
    rs_backend_free(calib);
    rs_backend_free(b);
}
