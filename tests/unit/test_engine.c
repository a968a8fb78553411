/*
 * test_engine.c — the engine end to end on a small synthetic Qwen3 model, without HTTP.
 *
 * The references here are other code paths of the same model, chosen so that a bug in one path
 * cannot hide in the other: decode through the KV cache vs scoring the same tokens in one
 * prefill; a batch vs each request alone; a tiny KV pool (requests queue) vs a large one.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#include "../../core/latch.h"
#include "../../model/presets.h"
#include "../../scheduler/engine.h"
#include "../../scheduler/engine_internal.h" /* ctl_head: a test holds a step until a control is queued */
#include "test.h"
#include "test_util.h"

typedef struct env {
    rs_backend *b;
    rs_model *m;
    rs_engine *e;
} env;

static void tiny_config(rs_model_config *c) {
    ASSERT_EQ(rs_model_preset("default", c), RS_OK);
    c->vocab_size = 512;
    c->hidden = 64;
    c->intermediate = 128;
    c->n_layers = 2;
    c->n_heads = 4;
    c->n_kv_heads = 2;
    c->head_dim = 16;
    c->max_position = 256;
}

static size_t env_max_kept_ids; /* limits.max_kept_ids of the next engine opened (0: the default) */

static env env_open_opts(size_t kv_bytes, int max_running, int max_step_tokens, bool prefix_cache, float ratio) {
    static int made;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/model", rs_test_tmpdir());
    rs_error err = {0};
    if (!made) {
        rs_model_config c;
        tiny_config(&c);
        if (rs_testmodel_write(dir, &c, 11, &err) != RS_OK) RS_TEST_FAIL("testmodel: %s", err.message);
        made = 1;
    }
    env v = {0};
    v.b = rs_backend_cpu_init(2);
    if (rs_model_load(dir, v.b, NULL, &v.m, &err) != RS_OK) RS_TEST_FAIL("load: %s", err.message);
    rs_engine_opts o = {.kv_cache_bytes = kv_bytes, .max_running = max_running,
                        .max_step_tokens = max_step_tokens, .prefix_cache = prefix_cache,
                        .admission_new_token_ratio = ratio,
                        .limits = {.max_context = 256, .max_new_tokens = 128, .max_n = 8, .max_batch = 64,
                                   .max_top_logprobs = 8, .max_kept_ids = env_max_kept_ids}};
    if (rs_engine_init(&v.e, v.m, &o, &err) != RS_OK) RS_TEST_FAIL("engine: %s", err.message);
    return v;
}

static env env_open(size_t kv_bytes, int max_running, int max_step_tokens) {
    return env_open_opts(kv_bytes, max_running, max_step_tokens, true, 0.4f);
}

static void env_close(env *v) {
    rs_engine_stats st;
    rs_engine_get_stats(v->e, &st);
    ASSERT_EQ(st.kv_blocks_free, st.kv_blocks_total); /* every page came back */
    ASSERT_EQ(st.n_running, 0);
    rs_engine_free(v->e);
    rs_model_free(v->m);
    rs_backend_free(v->b);
}

static int32_t *prompt(int len, unsigned seed) {
    int32_t *p = malloc(sizeof(int32_t) * (size_t)len);
    for (int i = 0; i < len; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (int32_t)((seed >> 8) % 512);
    }
    return p;
}

static rs_gen_job *job_new(int n_prompts, const int *lens, unsigned seed0) {
    rs_gen_job *j = rs_gen_job_new();
    j->n_prompts = n_prompts;
    j->batched = n_prompts > 1;
    j->prompts = calloc((size_t)n_prompts, sizeof(int32_t *));
    j->prompt_lens = calloc((size_t)n_prompts, sizeof(int));
    for (int p = 0; p < n_prompts; p++) {
        j->prompt_lens[p] = lens[p];
        j->prompts[p] = prompt(lens[p], seed0 + (unsigned)p);
    }
    j->sp.ignore_eos = true;
    j->return_logprob = true;
    return j;
}

static void run(env *v, rs_gen_job *j) {
    rs_error err = {0};
    rs_gen_invalid why;
    ASSERT_EQ(rs_gen_job_validate(j, &v->m->cfg, rs_engine_get_limits(v->e), &why), RS_OK);
    ASSERT_EQ(rs_engine_submit(v->e, j, &err), RS_OK);
    rs_engine_run_until_idle(v->e);
}

static void assert_same_output(const rs_gen_output *a, const rs_gen_output *b) {
    ASSERT_EQ(a->n_output, b->n_output);
    for (int i = 0; i < a->n_output; i++) {
        ASSERT_EQ(a->output_ids[i], b->output_ids[i]);
        ASSERT_NEAR(a->output_logprobs[i], b->output_logprobs[i], 1e-5);
    }
    ASSERT_EQ(a->finish.type, b->finish.type);
}

/* Tokens decoded one at a time through the KV cache get the same logprobs as scoring the whole
 * sequence in one prefill pass (logprob_start_len), at the same temperature. */
RS_TEST(engine_decode_matches_prefill_scoring) {
    env v = env_open(8 << 20, 8, 512);
    int len = 21;
    rs_gen_job *g = job_new(1, &len, 1);
    g->sp.max_new_tokens = 40;
    g->sp.temperature = 0.8f;
    g->sp.seed = 77;
    run(&v, g);
    rs_gen_output *o = &g->outputs[0];
    ASSERT_EQ(o->n_output, 40);
    ASSERT_EQ(o->finish.type, RS_FINISH_LENGTH);

    int full = len + o->n_output;
    rs_gen_job *s = job_new(1, &full, 1);
    memcpy(s->prompts[0] + len, o->output_ids, sizeof(int32_t) * (size_t)o->n_output);
    s->sp.max_new_tokens = 0;
    s->sp.temperature = 0.8f;
    s->logprob_start_len = len;
    run(&v, s);
    ASSERT_EQ(s->outputs[0].n_output, 0);
    ASSERT_EQ(s->outputs[0].n_input_logprobs, o->n_output);
    for (int i = 0; i < o->n_output; i++) ASSERT_NEAR(s->outputs[0].input_logprobs[i], o->output_logprobs[i], 2e-5);
    rs_gen_job_free(g);
    rs_gen_job_free(s);
    env_close(&v);
}

/* A request's tokens do not depend on what shares its batch, nor on chunked prefill. */
RS_TEST(engine_batch_and_chunking_invariance) {
    int lens[3] = {5, 40, 17};
    rs_gen_job *alone[3], *batch;
    env v = env_open(8 << 20, 8, 512);
    for (int p = 0; p < 3; p++) {
        alone[p] = job_new(1, &lens[p], 100 + (unsigned)p);
        alone[p]->sp.max_new_tokens = 24;
        alone[p]->sp.seed = 9;
        alone[p]->sp.top_p = 0.9f;
        run(&v, alone[p]);
    }
    env_close(&v);
    /* small step budget: long prompts are prefilled in chunks next to other sequences' decodes */
    env w = env_open(8 << 20, 3, 7);
    batch = job_new(3, lens, 100);
    batch->sp.max_new_tokens = 24;
    batch->sp.seed = 9;
    batch->sp.top_p = 0.9f;
    run(&w, batch);
    for (int p = 0; p < 3; p++) assert_same_output(&batch->outputs[p], &alone[p]->outputs[0]);
    for (int p = 0; p < 3; p++) rs_gen_job_free(alone[p]);
    rs_gen_job_free(batch);
    env_close(&w);
}

static void set_penalties(rs_gen_job *j, float freq, float pres, float rep) {
    j->sp.frequency_penalty = freq;
    j->sp.presence_penalty = pres;
    j->sp.repetition_penalty = rep;
}

/* Penalized sampling depends only on a sample's own output: the same tokens and logprobs alone,
 * next to requests with other penalties, with n > 1 (siblings forked from one prefill), with
 * chunked prefill, and on a pool so small that sequences are preempted and recomputed. */
RS_TEST(engine_penalties_batch_and_preemption_invariance) {
    int lens[3] = {5, 40, 17};
    const float pen[3][3] = {{0.6f, 0.2f, 1.4f}, {0.0f, 1.0f, 1.0f}, {-0.3f, 0.0f, 0.7f}};
    rs_gen_job *alone[3], *plain;
    env v = env_open(8 << 20, 8, 512);
    for (int p = 0; p < 3; p++) {
        alone[p] = job_new(1, &lens[p], 300 + (unsigned)p);
        alone[p]->sp.max_new_tokens = 30;
        alone[p]->sp.seed = 4;
        alone[p]->sp.n = 2;
        alone[p]->sp.temperature = 0.7f;
        set_penalties(alone[p], pen[p][0], pen[p][1], pen[p][2]);
        run(&v, alone[p]);
    }
    plain = job_new(1, &lens[0], 300);
    plain->sp.max_new_tokens = 30;
    plain->sp.seed = 4;
    plain->sp.n = 2;
    plain->sp.temperature = 0.7f;
    run(&v, plain);
    bool differs = false; /* the penalties are in effect */
    for (int i = 0; i < 30; i++) differs |= plain->outputs[0].output_ids[i] != alone[0]->outputs[0].output_ids[i];
    ASSERT_TRUE(differs);
    env_close(&v);

    /* all three at once, prefill chunked next to decodes, on 10 blocks (160 tokens) for a demand of
     * about 18: sequences are preempted and recomputed (a group of 2 needs at most 8) */
    env w = env_open_opts(10 * 8192, 6, 9, true, 0.0f);
    rs_gen_job *batch[3];
    rs_error err = {0};
    for (int p = 0; p < 3; p++) {
        batch[p] = job_new(1, &lens[p], 300 + (unsigned)p);
        batch[p]->sp = alone[p]->sp;
        batch[p]->sp.stop_token_ids = NULL;
        ASSERT_EQ(rs_engine_submit(w.e, batch[p], &err), RS_OK);
    }
    rs_engine_run_until_idle(w.e);
    rs_engine_stats st;
    rs_engine_get_stats(w.e, &st);
    ASSERT_TRUE(st.num_retractions > 0);
    for (int p = 0; p < 3; p++) {
        for (int s = 0; s < 2; s++) assert_same_output(&batch[p]->outputs[s], &alone[p]->outputs[s]);
        rs_gen_job_free(batch[p]);
        rs_gen_job_free(alone[p]);
    }
    rs_gen_job_free(plain);
    env_close(&w);
}

/* n samples per prompt: distinct random streams, each reproducible from (seed, sample index). */
RS_TEST(engine_n_samples_are_distinct_and_reproducible) {
    env v = env_open(8 << 20, 8, 512);
    int len = 9;
    rs_gen_job *a = job_new(1, &len, 5), *b = job_new(1, &len, 5);
    a->sp.n = b->sp.n = 4;
    a->sp.max_new_tokens = b->sp.max_new_tokens = 16;
    a->sp.seed = b->sp.seed = 2024;
    run(&v, a);
    run(&v, b);
    int distinct = 0;
    for (int s = 0; s < 4; s++) {
        assert_same_output(&a->outputs[s], &b->outputs[s]);
        if (s > 0 && memcmp(a->outputs[s].output_ids, a->outputs[0].output_ids, 16 * sizeof(int32_t)) != 0)
            distinct++;
    }
    ASSERT_TRUE(distinct >= 2);
    rs_gen_job_free(a);
    rs_gen_job_free(b);
    env_close(&v);
}

/* Stop tokens end a sequence with finish "stop" and the matched id. */
RS_TEST(engine_stop_tokens_end_sequences) {
    env v = env_open(8 << 20, 8, 512);
    int len = 6;
    rs_gen_job *g = job_new(1, &len, 3);
    g->sp.max_new_tokens = 12;
    g->sp.temperature = 0.0f;
    run(&v, g);
    const rs_gen_output *o = &g->outputs[0];
    int k = 4; /* stop on the 5th generated token's id, at its first occurrence */
    int32_t stop = o->output_ids[k];
    int first = 0;
    while (o->output_ids[first] != stop) first++;

    rs_gen_job *s = job_new(1, &len, 3);
    s->sp.max_new_tokens = 12;
    s->sp.temperature = 0.0f;
    s->sp.stop_token_ids = malloc(sizeof(int32_t));
    s->sp.stop_token_ids[0] = stop;
    s->sp.n_stop_token_ids = 1;
    run(&v, s);
    ASSERT_EQ(s->outputs[0].finish.type, RS_FINISH_STOP);
    ASSERT_EQ(s->outputs[0].finish.matched, stop);
    ASSERT_EQ(s->outputs[0].n_output, first + 1);
    rs_gen_job_free(g);
    rs_gen_job_free(s);
    env_close(&v);
}

/* A text-stop hook that stops output i at the first token equal to `at[i]` (returning stop index
 * 2 + i), and records what it was shown. */
typedef struct hook_log {
    int32_t at[4];
    int32_t seen[4][32];
    int n_seen[4];
} hook_log;

static int stop_at_hook(rs_gen_job *job, int output, int32_t token, void *user) {
    hook_log *h = user;
    ASSERT_TRUE(output >= 0 && output < 4);
    ASSERT_EQ(job->outputs[output].output_ids[job->outputs[output].n_output - 1], token); /* already pushed */
    h->seen[output][h->n_seen[output]++] = token;
    return token == h->at[output] ? 2 + output : -1;
}

/* The on_token hook (text stops) sees every token of every output in order, except a stop token;
 * the output whose token it stops on finishes "stop" with matched_text = index + 1, keeping that
 * token; the others run on unaffected (same tokens as without the hook). */
RS_TEST(engine_token_hook_stops_outputs) {
    env v = env_open(8 << 20, 8, 512);
    int len = 6;
    rs_gen_job *g = job_new(1, &len, 5);
    g->sp.max_new_tokens = 12;
    g->sp.n = 2;
    g->sp.temperature = 1.0f;
    g->sp.seed = 7;
    run(&v, g);
    const rs_gen_output *o0 = &g->outputs[0], *o1 = &g->outputs[1];
    ASSERT_EQ(o0->n_output, 12);
    int k = 5, first = 0;
    while (o0->output_ids[first] != o0->output_ids[k]) first++;
    int32_t stop_id = o1->output_ids[8]; /* a stop token for output 1: never shown to the hook */
    int stop_first = 0;
    while (o1->output_ids[stop_first] != stop_id) stop_first++;

    rs_gen_job *s = job_new(1, &len, 5);
    s->sp.max_new_tokens = 12;
    s->sp.n = 2;
    s->sp.temperature = 1.0f;
    s->sp.seed = 7;
    s->sp.stop_token_ids = malloc(sizeof(int32_t));
    s->sp.stop_token_ids[0] = stop_id;
    s->sp.n_stop_token_ids = 1;
    hook_log h = {.at = {o0->output_ids[k], -1}};
    s->on_token = stop_at_hook;
    s->on_token_user = &h;
    run(&v, s);
    const rs_gen_output *s0 = &s->outputs[0], *s1 = &s->outputs[1];
    /* output 0: stopped by the hook on the token that completed the match, which stays */
    bool stop_id_in_0 = false;
    for (int i = 0; i <= first; i++) stop_id_in_0 |= o0->output_ids[i] == stop_id;
    ASSERT_TRUE(!stop_id_in_0); /* the seed is chosen so; else output 0 would end on the stop token */
    ASSERT_EQ(s0->finish.type, RS_FINISH_STOP);
    ASSERT_EQ(s0->finish.matched, -1);
    ASSERT_EQ(s0->finish.matched_text, 3);
    ASSERT_EQ(s0->n_output, first + 1);
    ASSERT_EQ(h.n_seen[0], first + 1);
    for (int i = 0; i <= first; i++) ASSERT_EQ(h.seen[0][i], o0->output_ids[i]);
    /* output 1: ended by its stop token, which the hook never saw */
    ASSERT_EQ(s1->finish.type, RS_FINISH_STOP);
    ASSERT_EQ(s1->finish.matched, stop_id);
    ASSERT_EQ(s1->finish.matched_text, 0);
    ASSERT_EQ(s1->n_output, stop_first + 1);
    ASSERT_EQ(h.n_seen[1], stop_first);
    for (int i = 0; i < stop_first; i++) ASSERT_EQ(h.seen[1][i], o1->output_ids[i]);
    rs_gen_job_free(g);
    rs_gen_job_free(s);
    env_close(&v);
}

/* log_softmax(logits / temp)[ctx[n - 1]] given ctx[0 .. n - 1), by prompt scoring (a prefill pass,
 * not the decode path that sampled). */
static double score_last(env *v, const int32_t *ctx, int n, float temp) {
    rs_gen_job *j = job_new(1, &n, 1);
    memcpy(j->prompts[0], ctx, sizeof(int32_t) * (size_t)n);
    j->sp.max_new_tokens = 0;
    j->sp.temperature = temp;
    j->logprob_start_len = n - 1;
    run(v, j);
    ASSERT_EQ(j->outputs[0].n_input_logprobs, 1);
    const double lp = j->outputs[0].input_logprobs[0];
    rs_gen_job_free(j);
    return lp;
}

/* Before min_new_tokens outputs no stop token can be drawn, as in SGLang and vLLM: the stop ids
 * and the model's EOS ids are masked out of the distribution. The stop ids here are the three most
 * likely first tokens, so without the mask the first token would be one of them. The logprob of a
 * masked step (sampler.h): "default" and "processed" are those of the masked distribution,
 * lp(t) - log(1 - sum of the stop ids' probabilities), "raw" is the model's own log_softmax(x)
 * (T = 1, unmasked); checked against prompt scoring of every candidate after each context. */
RS_TEST(engine_min_new_tokens_masks_stop_tokens) {
    env v = env_open(8 << 20, 8, 512);
    const rs_model_config *c = &v.m->cfg;
    int len = 6;
    enum { MIN = 4, MAX = 6, K = 3 };
    rs_gen_job *g = job_new(1, &len, 3);
    g->sp.max_new_tokens = 1;
    g->sp.temperature = 0.0f;
    g->top_logprobs_num = K;
    run(&v, g);
    int32_t stops[K + RS_MAX_EOS];
    int n_stops = 0;
    for (int i = 0; i < K; i++) stops[n_stops++] = g->outputs[0].output_top_ids[i];
    for (int i = 0; i < c->n_eos; i++) stops[n_stops++] = c->eos_token_ids[i];
    const float temp = 0.05f; /* a random model is nearly flat: a low T makes the stop ids likely */
    const rs_logprobs_mode modes[] = {RS_LOGPROBS_DEFAULT, RS_LOGPROBS_PROCESSED, RS_LOGPROBS_RAW};
    rs_gen_job *m[3];
    for (int k = 0; k < 3; k++) {
        m[k] = job_new(1, &len, 3);
        m[k]->sp.max_new_tokens = MAX;
        m[k]->sp.min_new_tokens = MIN;
        m[k]->sp.temperature = temp;
        m[k]->sp.seed = 5;
        m[k]->logprobs_mode = modes[k];
        m[k]->sp.stop_token_ids = malloc(sizeof(int32_t) * K);
        memcpy(m[k]->sp.stop_token_ids, stops, sizeof(int32_t) * K);
        m[k]->sp.n_stop_token_ids = K;
        run(&v, m[k]);
    }
    const rs_gen_output *o = &m[0]->outputs[0];
    ASSERT_TRUE(o->n_output >= MIN);
    for (int k = 1; k < 3; k++) { /* the mode changes what is reported, never what is drawn */
        ASSERT_EQ(m[k]->outputs[0].n_output, o->n_output);
        for (int i = 0; i < o->n_output; i++) ASSERT_EQ(m[k]->outputs[0].output_ids[i], o->output_ids[i]);
    }
    int32_t ctx[64];
    memcpy(ctx, m[0]->prompts[0], sizeof(int32_t) * (size_t)len);
    for (int i = 0; i < o->n_output; i++) {
        const int32_t tok = o->output_ids[i];
        ctx[len + i] = tok;
        const double lp_t = score_last(&v, ctx, len + i + 1, temp), lp_raw = score_last(&v, ctx, len + i + 1, 0.0f);
        double p_stop = 0.0;
        for (int j = 0; j < n_stops; j++) {
            if (i < MIN) ASSERT_NE(tok, stops[j]);
            bool dup = false;
            for (int q = 0; q < j; q++) dup |= stops[q] == stops[j];
            if (dup) continue;
            ctx[len + i] = stops[j];
            p_stop += exp(score_last(&v, ctx, len + i + 1, temp));
            ctx[len + i] = tok;
        }
        const double want = i < MIN ? lp_t - log1p(-p_stop) : lp_t;
        ASSERT_NEAR(m[0]->outputs[0].output_logprobs[i], want, 2e-5);
        ASSERT_NEAR(m[1]->outputs[0].output_logprobs[i], want, 2e-5); /* no truncation: the same */
        ASSERT_NEAR(m[2]->outputs[0].output_logprobs[i], lp_raw, 2e-5);
        if (i == 0) fprintf(stderr, "  p(stop) at the first step %.4f\n", p_stop);
        if (i == 0) ASSERT_TRUE(p_stop > 0.05); /* the mask moved the logprob measurably */
    }
    rs_gen_job_free(g);
    for (int k = 0; k < 3; k++) rs_gen_job_free(m[k]);
    env_close(&v);
}

/* Logits that hold a NaN (here: a NaN written into the served final norm, past every check a load
 * or a push makes) fail the job instead of producing tokens from NaNs: job->error is set (500),
 * every output finishes "abort", and no NaN logprob was stored; the engine keeps serving. */
RS_TEST(engine_nan_logits_fail_the_job) {
    env v = env_open(8 << 20, 8, 512);
    int len = 5;
    rs_gen_job *ok = job_new(1, &len, 4);
    ok->sp.max_new_tokens = 3;
    run(&v, ok);
    ASSERT_EQ(ok->error.code, RS_OK);
    ASSERT_EQ(v.m->final_norm.dtype, RS_DTYPE_F32);
    float *norm = v.m->final_norm.data, saved = norm[3];
    norm[3] = NAN;
    for (int scoring = 0; scoring < 2; scoring++) {
        rs_gen_job *j = job_new(1, &len, 4);
        j->sp.max_new_tokens = 3;
        j->sp.n = 2;
        j->top_logprobs_num = 2;
        j->logprob_start_len = scoring ? 0 : -1;
        run(&v, j);
        ASSERT_EQ(j->error.code, RS_EINTERNAL);
        ASSERT_TRUE(strstr(j->error.message, "NaN") != NULL);
        for (int i = 0; i < 2; i++) {
            const rs_gen_output *o = &j->outputs[i];
            ASSERT_EQ(o->finish.type, RS_FINISH_ABORT);
            for (int t = 0; t < o->n_output; t++) ASSERT_TRUE(!isnan(o->output_logprobs[t]));
        }
        rs_gen_job_free(j);
    }
    norm[3] = saved;
    rs_gen_job *again = job_new(1, &len, 4);
    again->sp.max_new_tokens = 3;
    run(&v, again);
    ASSERT_EQ(again->error.code, RS_OK);
    assert_same_output(&again->outputs[0], &ok->outputs[0]);
    rs_gen_job_free(ok);
    rs_gen_job_free(again);
    env_close(&v);
}

/* slime's return_top_p_token_ids: the kept ids of all a job's outputs count against one limit,
 * so n samples cannot each hold the most one output may. Each output here keeps 12 x 50 = 600
 * ids, under the limit of 1000 alone but not two together: the job fails with RS_ETOOBIG (413)
 * naming custom_params, every output finishes "abort", and the engine keeps serving. */
RS_TEST(engine_kept_ids_are_limited_per_request) {
    env_max_kept_ids = 1000;
    env v = env_open(8 << 20, 8, 512);
    env_max_kept_ids = 0;
    int len = 5;
    for (int n = 1; n <= 2; n++) {
        rs_gen_job *j = job_new(1, &len, 9);
        j->sp.n = n;
        j->sp.max_new_tokens = 12;
        j->sp.temperature = 1.0f;
        j->sp.top_k = 50;
        j->sp.seed = 3;
        j->return_top_p_ids = true;
        run(&v, j);
        if (n == 1) {
            ASSERT_EQ(j->error.code, RS_OK);
            ASSERT_EQ(j->outputs[0].n_output, 12);
            ASSERT_EQ(j->outputs[0].n_kept_ids, 600);
            ASSERT_EQ(j->n_kept_ids, 600);
        } else {
            ASSERT_EQ(j->error.code, RS_ETOOBIG);
            ASSERT_STREQ(j->error.param, "custom_params");
            ASSERT_TRUE(strstr(j->error.message, "more than 1000 token ids together") != NULL);
            ASSERT_TRUE(j->n_kept_ids <= 1000);
            for (int i = 0; i < 2; i++) ASSERT_EQ(j->outputs[i].finish.type, RS_FINISH_ABORT);
        }
        rs_gen_job_free(j);
    }
    env_close(&v);
}

/* A pool that fits one sequence at a time: requests queue and still produce the same tokens. A
 * request larger than the whole pool is aborted with a message instead of waiting forever. */
RS_TEST(engine_small_pool_queues_requests) {
    int lens[4] = {30, 12, 50, 3};
    env big = env_open(8 << 20, 8, 512);
    rs_gen_job *ref = job_new(4, lens, 40);
    ref->sp.max_new_tokens = 20;
    ref->sp.seed = 1;
    run(&big, ref);
    env_close(&big);

    /* 2 layers x 2 (K,V) x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB per block; 5 blocks
     * hold one sequence of at most 80 tokens */
    env small = env_open(5 * 8192, 8, 512);
    rs_gen_job *q = job_new(4, lens, 40);
    q->sp.max_new_tokens = 20;
    q->sp.seed = 1;
    run(&small, q);
    for (int p = 0; p < 4; p++) assert_same_output(&q->outputs[p], &ref->outputs[p]);

    int huge = 100;
    rs_gen_job *h = job_new(1, &huge, 2);
    h->sp.max_new_tokens = 20;
    run(&small, h);
    ASSERT_EQ(h->outputs[0].finish.type, RS_FINISH_ABORT);
    ASSERT_TRUE(strstr(h->outputs[0].finish.message, "KV cache") != NULL);
    rs_gen_job_free(ref);
    rs_gen_job_free(q);
    rs_gen_job_free(h);
    env_close(&small);
}

/* Admission estimates a waiting sequence's pages as it estimates a running one's: growth up to
 * max_context, never past it (the engine stops every sequence there). A job submitted to the
 * engine directly may ask for more new tokens than the context leaves (the server's validation
 * refuses that; the engine caps it); two such 200-token prompts at ratio 1 need 16 pages each at
 * most, and a pool of 34 holds both at once. An estimate that forgot the cap (21 pages each)
 * admitted them one after the other. */
RS_TEST(engine_admission_caps_growth_at_max_context) {
    env v = env_open_opts(34 * 8192, 8, 512, false, 1.0f);
    int lens[2] = {200, 200};
    rs_gen_job *j = job_new(2, lens, 70);
    j->sp.max_new_tokens = 128; /* 200 + 128 > max_context 256 */
    rs_error err = {0};
    ASSERT_EQ(rs_engine_submit(v.e, j, &err), RS_OK);
    rs_engine_run_until_idle(v.e);
    for (int p = 0; p < 2; p++) {
        ASSERT_EQ(j->outputs[p].finish.type, RS_FINISH_LENGTH);
        ASSERT_EQ(j->outputs[p].n_output, 256 - 200);
    }
    rs_engine_stats st;
    rs_engine_get_stats(v.e, &st);
    ASSERT_EQ(st.peak_running, 2);
    rs_gen_job_free(j);
    env_close(&v);
}

RS_TEST(engine_validate_rejects_bad_jobs) {
    env v = env_open(1 << 20, 4, 64);
    rs_gen_invalid why;
    int len = 200;
    rs_gen_job *j = job_new(1, &len, 1);
    j->prompts[0][2] = 512; /* == vocab */
    ASSERT_EQ(rs_gen_job_validate(j, &v.m->cfg, rs_engine_get_limits(v.e), &why), RS_EINVAL);
    ASSERT_EQ(why.field, RS_GEN_FIELD_PROMPT);
    ASSERT_EQ(why.problem, RS_GEN_VOCAB);
    ASSERT_EQ(why.index, -1); /* not batched */
    ASSERT_EQ(why.pos, 2);
    ASSERT_EQ(why.value, 512);
    ASSERT_EQ(why.max, 512);
    j->prompts[0][2] = 1;
    j->sp.max_new_tokens = 57; /* 200 + 57 > 256 */
    ASSERT_EQ(rs_gen_job_validate(j, &v.m->cfg, rs_engine_get_limits(v.e), &why), RS_EINVAL);
    ASSERT_EQ(why.problem, RS_GEN_CONTEXT);
    ASSERT_EQ(why.value, 200);
    ASSERT_EQ(why.other, 57);
    ASSERT_EQ(why.max, 256);
    j->sp.max_new_tokens = 8;
    j->logprob_start_len = 200;
    ASSERT_EQ(rs_gen_job_validate(j, &v.m->cfg, rs_engine_get_limits(v.e), &why), RS_EINVAL);
    ASSERT_EQ(why.field, RS_GEN_FIELD_LOGPROB_START);
    ASSERT_EQ(why.problem, RS_GEN_PAST_PROMPT);
    j->logprob_start_len = -1;
    j->sp.n = 5; /* over max-n (4) */
    ASSERT_EQ(rs_gen_job_validate(j, &v.m->cfg, rs_engine_get_limits(v.e), &why), RS_EINVAL);
    ASSERT_EQ(why.field, RS_GEN_FIELD_N);
    ASSERT_EQ(why.problem, RS_GEN_RANGE);
    ASSERT_EQ(why.value, 5);
    ASSERT_EQ(why.max, rs_engine_get_limits(v.e)->max_n);
    j->sp.n = 1;
    ASSERT_EQ(rs_gen_job_validate(j, &v.m->cfg, rs_engine_get_limits(v.e), &why), RS_OK);
    rs_gen_job_free(j);
    env_close(&v);
}

/* Scores prompt + output of `o` by teacher forcing and checks every output logprob. */
static void assert_teacher_forced(env *v, const int32_t *prompt, int len, const rs_gen_output *o, float temp) {
    int full = len + o->n_output;
    rs_gen_job *s = job_new(1, &full, 1);
    memcpy(s->prompts[0], prompt, sizeof(int32_t) * (size_t)len);
    memcpy(s->prompts[0] + len, o->output_ids, sizeof(int32_t) * (size_t)o->n_output);
    s->sp.max_new_tokens = 0;
    s->sp.temperature = temp;
    s->logprob_start_len = len;
    run(v, s);
    for (int i = 0; i < o->n_output; i++) ASSERT_NEAR(s->outputs[0].input_logprobs[i], o->output_logprobs[i], 2e-5);
    rs_gen_job_free(s);
}

/* An n-sample group prefills its prompt once and its samples fork the pages (the partial last
 * page is copied on first write); a repeated prompt hits the prefix cache. Teacher forcing each
 * sample's tokens from scratch must reproduce its logprobs: a sample that read another's pages,
 * or a stale cached page, would not. */
RS_TEST(engine_group_sharing_and_prefix_hits) {
    env v = env_open(8 << 20, 8, 512);
    int len = 100;
    rs_gen_job *g = job_new(1, &len, 21);
    g->sp.n = 8;
    g->sp.max_new_tokens = 24;
    g->sp.seed = 5;
    run(&v, g);
    for (int si = 0; si < 8; si++) {
        ASSERT_EQ(g->outputs[si].n_output, 24);
        ASSERT_EQ(g->outputs[si].cached_tokens, si == 0 ? 0 : 100);
        assert_teacher_forced(&v, g->prompts[0], len, &g->outputs[si], 1.0f);
    }
    rs_engine_stats st;
    rs_engine_get_stats(v.e, &st);
    uint64_t hits0 = st.prefix_hit_tokens;

    rs_gen_job *again = job_new(1, &len, 21); /* same prompt, new request */
    again->sp.max_new_tokens = 24;
    again->sp.seed = 5;
    run(&v, again);
    ASSERT_EQ(again->outputs[0].cached_tokens, 96); /* full blocks, the last token recomputed */
    assert_same_output(&again->outputs[0], &g->outputs[0]);
    rs_engine_get_stats(v.e, &st);
    ASSERT_TRUE(st.prefix_hit_tokens >= hits0 + 96);
    rs_gen_job_free(g);
    rs_gen_job_free(again);
    env_close(&v);
}

/* 300 requests of random lengths on a pool that holds about a tenth of their total demand: all
 * finish, sequences are preempted and recomputed, and every request's tokens and logprobs equal
 * those of the same request run alone. */
RS_TEST(engine_preemption_soak) {
    enum { N = 300 };
    int lens[N], news[N];
    long demand_tokens = 0;
    unsigned x = 99;
    for (int i = 0; i < N; i++) {
        x = x * 1664525u + 1013904223u;
        lens[i] = 8 + (int)((x >> 8) % 57);
        x = x * 1664525u + 1013904223u;
        news[i] = 8 + (int)((x >> 8) % 41);
        demand_tokens += lens[i] + news[i];
    }
    /* reference: each request alone on a roomy pool */
    rs_gen_job *ref[N], *jobs[N];
    env big = env_open_opts(16 << 20, 4, 512, false, 0.4f);
    for (int i = 0; i < N; i++) {
        ref[i] = job_new(1, &lens[i], 1000u + (unsigned)i);
        ref[i]->sp.max_new_tokens = news[i];
        ref[i]->sp.seed = (uint64_t)i;
        run(&big, ref[i]);
    }
    env_close(&big);

    size_t block_bytes = 8192; /* 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes */
    long demand_blocks = demand_tokens / RS_KV_BLOCK;
    env small = env_open_opts((size_t)(demand_blocks / 10) * block_bytes, 64, 256, true, 0.0f);
    rs_error err = {0};
    for (int i = 0; i < N; i++) {
        jobs[i] = job_new(1, &lens[i], 1000u + (unsigned)i);
        jobs[i]->sp.max_new_tokens = news[i];
        jobs[i]->sp.seed = (uint64_t)i;
        ASSERT_EQ(rs_engine_submit(small.e, jobs[i], &err), RS_OK);
    }
    rs_engine_run_until_idle(small.e);
    rs_engine_stats st;
    rs_engine_get_stats(small.e, &st);
    ASSERT_TRUE(st.num_retractions > 0);
    int retracted = 0;
    uint64_t cached = 0;
    for (int i = 0; i < N; i++) cached += (uint64_t)jobs[i]->outputs[0].cached_tokens;
    /* the prefix-hit metric is the requests' cached prompt tokens, not the retracted sequences'
     * recomputation of their own pages */
    ASSERT_EQ(st.prefix_hit_tokens, cached);
    for (int i = 0; i < N; i++) {
        ASSERT_EQ(jobs[i]->outputs[0].finish.type, RS_FINISH_LENGTH);
        assert_same_output(&jobs[i]->outputs[0], &ref[i]->outputs[0]);
        retracted += jobs[i]->outputs[0].num_retractions > 0;
        rs_gen_job_free(jobs[i]);
        rs_gen_job_free(ref[i]);
    }
    printf("  soak: %d of %d requests preempted, %llu retractions, peak running %d\n", retracted, N,
           (unsigned long long)st.num_retractions, st.peak_running);
    env_close(&small);
}

/* A waiting request that matched cached pages but was not admitted must not keep them: here A
 * matches the 4 cached blocks of a warm prefix and waits, X (running) then needs those pages,
 * preempts itself, and at the head of the queue can only be admitted if A let go of them. With A
 * holding them no step could run again (the engine spun on an empty step). Both requests must
 * finish with the tokens they get alone, and the prefix-cache counters count A's match once, not
 * once per step it waited (X may evict what A had matched meanwhile: A then finds less). */
RS_TEST(engine_waiting_request_does_not_pin_cached_pages) {
    const size_t block_bytes = 8192; /* 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes */
    int warm_len = 65, a_len = 100, x_len = 80;
    rs_gen_job *warm = job_new(1, &warm_len, 77), *a = job_new(1, &a_len, 78), *x = job_new(1, &x_len, 79);
    memcpy(a->prompts[0], warm->prompts[0], sizeof(int32_t) * (size_t)warm_len); /* A = P + 35 tokens */
    warm->sp.max_new_tokens = 1;
    a->sp.max_new_tokens = 100;
    x->sp.max_new_tokens = 120; /* 200 tokens: 13 of the pool's 15 blocks */
    a->sp.seed = x->sp.seed = 3;

    rs_gen_job *a_ref = job_new(1, &a_len, 78), *x_ref = job_new(1, &x_len, 79);
    memcpy(a_ref->prompts[0], warm->prompts[0], sizeof(int32_t) * (size_t)warm_len);
    a_ref->sp = a->sp;
    x_ref->sp = x->sp;
    env big = env_open(16 << 20, 8, 512);
    run(&big, a_ref);
    run(&big, x_ref);
    env_close(&big);

    env v = env_open(15 * block_bytes, 8, 512);
    rs_engine_stats st;
    rs_engine_get_stats(v.e, &st);
    ASSERT_EQ(st.kv_blocks_total, 15);
    run(&v, warm); /* P's 4 full blocks stay cached */
    rs_engine_get_stats(v.e, &st);
    const uint64_t hits0 = st.prefix_hit_tokens;
    rs_error err = {0};
    ASSERT_EQ(rs_engine_submit(v.e, x, &err), RS_OK);
    for (int i = 0; i < 3; i++) ASSERT_TRUE(rs_engine_step_once(v.e)); /* X runs */
    ASSERT_EQ(rs_engine_submit(v.e, a, &err), RS_OK);
    int steps = 0;
    while (rs_engine_step_once(v.e)) ASSERT_TRUE(++steps < 2000); /* 220 tokens to sample */
    ASSERT_EQ(x->outputs[0].finish.type, RS_FINISH_LENGTH);
    ASSERT_EQ(a->outputs[0].finish.type, RS_FINISH_LENGTH);
    assert_same_output(&x->outputs[0], &x_ref->outputs[0]);
    assert_same_output(&a->outputs[0], &a_ref->outputs[0]);
    ASSERT_TRUE(a->outputs[0].cached_tokens <= 64); /* what X left of P's blocks when A was admitted */
    rs_engine_get_stats(v.e, &st);
    /* A's 64 once (and X's own blocks when it came back), not once per step A waited */
    ASSERT_TRUE(st.prefix_hit_tokens - hits0 <= 64 + (uint64_t)(x_len + 120));
    rs_gen_job_free(warm);
    rs_gen_job_free(a);
    rs_gen_job_free(x);
    rs_gen_job_free(a_ref);
    rs_gen_job_free(x_ref);
    env_close(&v);
}

/* Aborting a request returns what it produced so far and frees its pages. */
RS_TEST(engine_abort_returns_partial_output) {
    env v = env_open(8 << 20, 8, 512);
    int lens[2] = {10, 12};
    rs_gen_job *a = job_new(2, lens, 3), *b = job_new(1, lens, 4);
    snprintf(a->rid, sizeof a->rid, "victim");
    snprintf(b->rid, sizeof b->rid, "bystander");
    a->sp.max_new_tokens = b->sp.max_new_tokens = 100;
    rs_error err = {0};
    ASSERT_EQ(rs_engine_submit(v.e, a, &err), RS_OK);
    ASSERT_EQ(rs_engine_submit(v.e, b, &err), RS_OK);
    rs_engine_abort(v.e, "victim");
    rs_engine_run_until_idle(v.e);
    for (int p = 0; p < 2; p++) {
        ASSERT_EQ(a->outputs[p].finish.type, RS_FINISH_ABORT);
        ASSERT_STREQ(a->outputs[p].finish.message, "aborted");
    }
    ASSERT_EQ(b->outputs[0].finish.type, RS_FINISH_LENGTH);
    ASSERT_EQ(b->outputs[0].n_output, 100);
    rs_gen_job_free(a);
    rs_gen_job_free(b);
    env_close(&v);
}

/* top_logprobs_num alternatives are sorted, include the sampled token when it is likely enough,
 * and match the token's own logprob; raw mode ignores the temperature. */
RS_TEST(engine_top_logprobs_and_modes) {
    env v = env_open(8 << 20, 8, 512);
    int len = 7;
    rs_gen_job *d = job_new(1, &len, 8), *r = job_new(1, &len, 8);
    d->sp.temperature = r->sp.temperature = 0.0f;
    d->sp.max_new_tokens = r->sp.max_new_tokens = 6;
    d->top_logprobs_num = 3;
    d->logprob_start_len = 0;
    r->logprobs_mode = RS_LOGPROBS_RAW;
    run(&v, d);
    run(&v, r);
    const rs_gen_output *o = &d->outputs[0];
    for (int i = 0; i < o->n_output; i++) {
        const int32_t *ids = o->output_top_ids + i * 3;
        const float *lps = o->output_top_lps + i * 3;
        ASSERT_EQ(ids[0], o->output_ids[i]); /* greedy: the top alternative is the token */
        ASSERT_NEAR(lps[0], o->output_logprobs[i], 1e-6);
        ASSERT_TRUE(lps[0] >= lps[1] && lps[1] >= lps[2]);
        ASSERT_NEAR(r->outputs[0].output_logprobs[i], o->output_logprobs[i], 1e-6); /* T=0 reads as T=1 */
    }
    ASSERT_EQ(o->input_top_ids[0], -1); /* position 0 has no context */
    ASSERT_TRUE(o->input_top_ids[3] >= 0);
    rs_gen_job_free(d);
    rs_gen_job_free(r);
    env_close(&v);
}

/* ---- the engine thread: control requests and progress callbacks ---- */

/* What a job's on_done saw of the engine's published counters. */
typedef struct stats_seen {
    rs_engine *e;
    rs_engine_stats st;
    int calls;
} stats_seen;

static void on_done_read_stats(rs_gen_job *job, void *user) {
    (void)job;
    stats_seen *s = user;
    rs_engine_get_stats(s->e, &s->st);
    s->calls++;
}

/* The counters a requester reads when its response arrives (/metrics right after /generate)
 * already count its request: they are published before on_done wakes it, not at the end of the
 * step that finished it. */
RS_TEST(engine_stats_published_before_on_done) {
    env v = env_open(8 << 20, 8, 512);
    uint64_t tokens = 0;
    for (int i = 0; i < 3; i++) {
        int lens[2] = {5 + i, 9};
        rs_gen_job *j = job_new(2, lens, 40u + (unsigned)i);
        j->sp.max_new_tokens = 4 + i;
        stats_seen seen = {.e = v.e};
        j->on_done = on_done_read_stats;
        j->on_done_user = &seen;
        run(&v, j);
        tokens += 2u * (uint64_t)(4 + i);
        ASSERT_EQ(seen.calls, 1);
        ASSERT_EQ(seen.st.requests_finished, (uint64_t)(i + 1));
        ASSERT_EQ(seen.st.generation_tokens, tokens);
        ASSERT_EQ(seen.st.e2e.n, (uint64_t)(i + 1));
        ASSERT_EQ(seen.st.n_running, 0);
        rs_gen_job_free(j);
    }
    env_close(&v);
}

typedef struct waiter {
    rs_latch done;              /* finished jobs */
    int progress_calls;         /* under done.mu */
    int tokens_seen;
    rs_engine *hold_until_ctl;  /* if set, the first progress call waits until a control is queued, */
    atomic_bool ctl_applied;    /* unless the control has been applied already */
} waiter;

static void on_done_cb(rs_gen_job *job, void *user) {
    (void)job;
    waiter *w = user;
    rs_latch_arrive(&w->done);
}

/* Keeps the engine inside its step until another thread has queued a control request (or had it
 * applied before the first token), so that the control lands while the request is still running
 * however the threads are scheduled. */
static void hold_until_control_queued(rs_engine *e, atomic_bool *applied) {
    while (!atomic_load(applied)) {
        pthread_mutex_lock(&e->mu);
        bool queued = e->ctl_head != NULL;
        pthread_mutex_unlock(&e->mu);
        if (queued) return;
        sched_yield();
    }
}

static void on_progress_cb(rs_gen_job *job, void *user) {
    waiter *w = user;
    if (w->hold_until_ctl && w->progress_calls == 0) hold_until_control_queued(w->hold_until_ctl, &w->ctl_applied);
    pthread_mutex_lock(&w->done.mu);
    w->progress_calls++;
    ASSERT_TRUE(job->outputs[0].n_output > w->tokens_seen); /* every call brings new tokens */
    w->tokens_seen = job->outputs[0].n_output;
    pthread_mutex_unlock(&w->done.mu);
}

static void wait_done(waiter *w, int n) { rs_latch_wait(&w->done, n); }

/* Pausing with retract frees every page and recomputes later: the output is the same as without
 * the pause. In-place pause keeps pages; abort pause ends requests. Flushing the prefix cache is
 * refused while requests are in flight. Progress callbacks see every token, in order. */
RS_TEST(engine_thread_pause_continue_flush_progress) {
    env v = env_open(8 << 20, 8, 512);
    int len = 20;
    rs_gen_job *ref = job_new(1, &len, 77);
    ref->sp.max_new_tokens = 60;
    ref->sp.seed = 3;
    run(&v, ref);

    waiter w = {.done = RS_LATCH_INIT, .hold_until_ctl = v.e};
    ASSERT_EQ(rs_engine_start(v.e), RS_OK);
    rs_gen_job *j = job_new(1, &len, 77);
    j->sp.max_new_tokens = 60;
    j->sp.seed = 3;
    j->on_done = on_done_cb;
    j->on_progress = on_progress_cb;
    j->on_done_user = &w;
    rs_error err = {0};
    ASSERT_EQ(rs_engine_submit(v.e, j, &err), RS_OK);
    rs_engine_pause(v.e, RS_PAUSE_RETRACT);
    atomic_store(&w.ctl_applied, true);
    rs_engine_stats st;
    rs_engine_get_stats(v.e, &st);
    ASSERT_TRUE(st.paused);
    ASSERT_EQ(st.n_running, 0);
    ASSERT_EQ(st.kv_blocks_free, st.kv_blocks_total);
    ASSERT_EQ(rs_engine_flush_cache(v.e, &err), RS_ESTATE); /* the retracted request still waits */
    rs_engine_continue(v.e);
    wait_done(&w, 1);
    assert_same_output(&j->outputs[0], &ref->outputs[0]);
    ASSERT_EQ(w.tokens_seen, 60);
    ASSERT_TRUE(w.progress_calls >= 2);
    ASSERT_EQ(rs_engine_flush_cache(v.e, &err), RS_OK);

    rs_gen_job *k = job_new(1, &len, 78);
    k->sp.max_new_tokens = 100;
    k->on_done = on_done_cb;
    k->on_done_user = &w;
    rs_engine_pause(v.e, RS_PAUSE_IN_PLACE);
    ASSERT_EQ(rs_engine_submit(v.e, k, &err), RS_OK);
    rs_engine_pause(v.e, RS_PAUSE_ABORT);
    wait_done(&w, 2);
    ASSERT_EQ(k->outputs[0].finish.type, RS_FINISH_ABORT);
    rs_engine_continue(v.e);
    rs_engine_stop(v.e);
    rs_engine_get_stats(v.e, &st);
    ASSERT_EQ(st.ttft.n, 2); /* the scored reference ran before start: 3 requests, 1 without tokens */
    ASSERT_TRUE(st.itl.n >= 59);
    ASSERT_TRUE(st.requests_aborted >= 1);
    rs_gen_job_free(ref);
    rs_gen_job_free(j);
    rs_gen_job_free(k);
    env_close(&v);
}

/* A probe (/health_generate's job) is not a user request: an abort of every job and
 * pause(ABORT) finish the user's jobs with "abort" but leave the probe, which completes once
 * generation continues; its own rid still aborts it. */
RS_TEST(engine_probe_survives_abort_all_and_pause_abort) {
    env v = env_open(8 << 20, 8, 512);
    waiter w = {.done = RS_LATCH_INIT};
    ASSERT_EQ(rs_engine_start(v.e), RS_OK);
    int len = 8;
    rs_gen_job *user[2], *probe[3];
    rs_error err = {0};
    rs_engine_pause(v.e, RS_PAUSE_IN_PLACE); /* everything below waits in the queue */
    for (int i = 0; i < 3; i++) {
        probe[i] = job_new(1, &len, 90 + (unsigned)i);
        probe[i]->probe = true;
        probe[i]->sp.max_new_tokens = 1;
        probe[i]->on_done = on_done_cb;
        probe[i]->on_done_user = &w;
        snprintf(probe[i]->rid, sizeof probe[i]->rid, "probe#%d", i);
    }
    for (int i = 0; i < 2; i++) {
        user[i] = job_new(1, &len, 80 + (unsigned)i);
        user[i]->sp.max_new_tokens = 100;
        user[i]->on_done = on_done_cb;
        user[i]->on_done_user = &w;
        snprintf(user[i]->rid, sizeof user[i]->rid, "user#%d", i);
    }
    ASSERT_EQ(rs_engine_submit(v.e, user[0], &err), RS_OK);
    ASSERT_EQ(rs_engine_submit(v.e, probe[0], &err), RS_OK);
    ASSERT_EQ(rs_engine_submit(v.e, probe[2], &err), RS_OK);
    rs_engine_abort(v.e, NULL);
    wait_done(&w, 1);
    ASSERT_EQ(user[0]->outputs[0].finish.type, RS_FINISH_ABORT);
    rs_engine_abort(v.e, "probe#2"); /* by its rid, a probe is aborted like any job */
    wait_done(&w, 2);
    ASSERT_EQ(probe[2]->outputs[0].finish.type, RS_FINISH_ABORT);
    ASSERT_EQ(rs_engine_submit(v.e, user[1], &err), RS_OK);
    ASSERT_EQ(rs_engine_submit(v.e, probe[1], &err), RS_OK);
    rs_engine_pause(v.e, RS_PAUSE_ABORT);
    wait_done(&w, 3);
    ASSERT_EQ(user[1]->outputs[0].finish.type, RS_FINISH_ABORT);
    ASSERT_STREQ(user[1]->outputs[0].finish.message, "paused");
    rs_engine_stats st;
    rs_engine_get_stats(v.e, &st);
    ASSERT_EQ(st.n_waiting, 2); /* both probes, still queued */
    rs_engine_continue(v.e);
    wait_done(&w, 5);
    for (int i = 0; i < 2; i++) {
        ASSERT_EQ(probe[i]->outputs[0].finish.type, RS_FINISH_LENGTH);
        ASSERT_EQ(probe[i]->outputs[0].n_output, 1);
    }
    rs_engine_stop(v.e);
    for (int i = 0; i < 3; i++) rs_gen_job_free(probe[i]);
    for (int i = 0; i < 2; i++) rs_gen_job_free(user[i]);
    env_close(&v);
}

/* ---- weight updates ---- */

typedef struct swap_ctx {
    rs_model *target, *source; /* target's tensors take source's (the structs are swapped) */
} swap_ctx;

static void swap_weights(rs_model *m, void *arg) {
    swap_ctx *s = arg;
    RS_ASSERT(m == s->target);
    const rs_model_config *c = &m->cfg;
    rs_tensor t;
#define SWAP(a, b) (t = (a), (a) = (b), (b) = t)
    SWAP(m->embed, s->source->embed);
    SWAP(m->final_norm, s->source->final_norm);
    m->lm_head = m->embed; /* tied */
    s->source->lm_head = s->source->embed;
    for (int l = 0; l < c->n_layers; l++) {
        rs_layer_weights tmp = m->layers[l];
        m->layers[l] = s->source->layers[l];
        s->source->layers[l] = tmp;
    }
#undef SWAP
}

/* 20 back-to-back weight updates (two models alternating) while 6 requests generate: every request
 * finishes, its version spans tile its tokens, and each token's logprob equals teacher forcing of
 * its context with the weights of the version it reports. */
RS_TEST(engine_weight_updates_during_generation) {
    env v = env_open(8 << 20, 8, 64);
    char dir_b[512];
    snprintf(dir_b, sizeof dir_b, "%s/model-b", rs_test_tmpdir());
    rs_model_config cb;
    tiny_config(&cb);
    rs_error err = {0};
    if (rs_testmodel_write(dir_b, &cb, 12, &err) != RS_OK) RS_TEST_FAIL("%s", err.message);
    rs_model *other = NULL; /* holds whichever weights are not serving */
    ASSERT_EQ(rs_model_load(dir_b, v.b, NULL, &other, &err), RS_OK);
    ASSERT_EQ(rs_engine_start(v.e), RS_OK);

    enum { R = 6 };
    waiter w = {.done = RS_LATCH_INIT};
    rs_gen_job *jobs[R];
    for (int i = 0; i < R; i++) {
        int len = 5 + 7 * i;
        jobs[i] = job_new(1, &len, 300u + (unsigned)i);
        jobs[i]->sp.max_new_tokens = 90;
        jobs[i]->sp.seed = (uint64_t)i;
        jobs[i]->on_done = on_done_cb;
        jobs[i]->on_done_user = &w;
        ASSERT_EQ(rs_engine_submit(v.e, jobs[i], &err), RS_OK);
    }
    swap_ctx sc = {.target = v.m, .source = other};
    for (int u = 1; u <= 20; u++) {
        char ver[16];
        snprintf(ver, sizeof ver, "%d", u);
        rs_weight_swap ws = {.apply = swap_weights, .ctx = &sc, .version = ver};
        ASSERT_EQ(rs_engine_swap_weights(v.e, &ws, NULL, &err), RS_OK);
    }
    wait_done(&w, R);
    rs_engine_stop(v.e);
    ASSERT_STREQ(rs_engine_weight_version(v.e), "20");

    /* v.m serves version 20: an even number of swaps, so it holds A's weights again, as it did for
     * version 0 and every even version; `other` holds B's, the odd versions' */
    rs_model *serving_even = v.m;
    int crossed = 0;
    for (int i = 0; i < R; i++) {
        const rs_gen_output *o = &jobs[i]->outputs[0];
        ASSERT_EQ(o->finish.type, RS_FINISH_LENGTH);
        ASSERT_TRUE(o->n_spans >= 1);
        ASSERT_EQ(o->spans[0].start, 0);
        ASSERT_EQ(o->spans[o->n_spans - 1].end, o->n_output);
        crossed += o->n_spans > 1;
        for (int k = 0; k < o->n_spans; k++) {
            if (k > 0) ASSERT_EQ(o->spans[k].start, o->spans[k - 1].end);
            int version = atoi(o->spans[k].version);
            for (int t = o->spans[k].start; t < o->spans[k].end; t++) {
                /* teacher-force prompt + outputs[0..t] on the version's weights */
                rs_model *weights = version % 2 == 0 ? serving_even : other;
                rs_engine *e2 = NULL;
                rs_engine_opts eo = {.kv_cache_bytes = 4 << 20, .max_running = 2, .max_step_tokens = 512,
                                     .limits = {.max_context = 256, .max_new_tokens = 128, .max_n = 1, .max_batch = 1}};
                ASSERT_EQ(rs_engine_init(&e2, weights, &eo, &err), RS_OK);
                int full = jobs[i]->prompt_lens[0] + t + 1;
                rs_gen_job *s = job_new(1, &full, 1);
                memcpy(s->prompts[0], jobs[i]->prompts[0], sizeof(int32_t) * (size_t)jobs[i]->prompt_lens[0]);
                memcpy(s->prompts[0] + jobs[i]->prompt_lens[0], o->output_ids, sizeof(int32_t) * (size_t)(t + 1));
                s->sp.max_new_tokens = 0;
                s->logprob_start_len = full - 1;
                ASSERT_EQ(rs_engine_submit(e2, s, &err), RS_OK);
                rs_engine_run_until_idle(e2);
                ASSERT_NEAR(s->outputs[0].input_logprobs[0], o->output_logprobs[t], 2e-5);
                rs_gen_job_free(s);
                rs_engine_free(e2);
            }
        }
        rs_gen_job_free(jobs[i]);
    }
    ASSERT_TRUE(crossed >= 1);
    rs_model_free(other);
    env_close(&v);
}

/* A model only runs on a backend with every op: a partial one (here the memory-only test backend,
 * as a device backend would be with a kernel missing) is refused when the engine is made, with the
 * missing op named, instead of crashing on the first step. */
RS_TEST(engine_refuses_an_incomplete_backend) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/model", rs_test_tmpdir());
    rs_model_config c = rs_test_tiny_qwen3();
    rs_error err = {0};
    if (rs_testmodel_write(dir, &c, 3, &err) != RS_OK) RS_TEST_FAIL("testmodel: %s", err.message);
    rs_backend *b = rs_test_host_backend();
    rs_model *m = NULL;
    ASSERT_EQ(rs_model_load(dir, b, NULL, &m, &err), RS_OK);
    rs_engine_opts o = {.kv_cache_bytes = 1 << 20, .max_running = 2, .max_step_tokens = 64,
                        .limits = {.max_context = 64, .max_new_tokens = 8, .max_n = 1, .max_batch = 2}};
    rs_engine *e = NULL;
    ASSERT_EQ(rs_engine_init(&e, m, &o, &err), RS_EUNSUPPORTED);
    ASSERT_TRUE(e == NULL);
    ASSERT_TRUE(strstr(err.message, "does not provide op 'embed'") != NULL);
    rs_model_free(m);
    rs_backend_free(b);
}
