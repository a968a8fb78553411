/*
 * fp8_mismatch.c — what a trainer will have to correct: the rollout (FP8) vs reference (BF16)
 * policy mismatch on the same prompts and the same sampled tokens.
 *
 *   build/fp8-mismatch [--model DIR | --preset NAME] [--prompts 8] [--prompt-len 32] [--gen 48]
 *                      [--temperature 1.0] [--seed 1] [--threads N] [--quantize-lm-head]
 *                      [--numerics exact|fast]
 *
 * The FP8 model (W8A8, 128x128 weight blocks, 1x128 activation groups) samples the rollouts, as
 * rolloutd does in production. Both models then score every sampled token by teacher forcing
 * (one prefill over prompt + rollout, logits at every rollout position), and the tool reports per
 * token: mean and max |logprob_bf16 - logprob_fp8|, mean KL(BF16 || FP8) over the full
 * vocabulary, and the share of tokens whose ratio pi_bf16 / pi_fp8 is above 2 or below 1/2 —
 * the tokens a TIS cap of C = 2 would clip. Logprobs are of softmax(logits / T).
 * --quantize-lm-head serves the FP8 model's output projection in FP8 too (quant.h): the table
 * then shows what that opt-in adds to the recipe's mismatch. --numerics fast runs the FP8 model
 * (sampling and scoring) under the CPU backend's fast numerics (on AMX CPUs its FP8 and BF16
 * matmuls in fp32 sums on AMX tiles; the line under the table says whether they applied); the BF16
 * reference stays exact.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/rs.h"
#include "../kvcache/kvcache.h"
#include "../model/model.h"
#include "../model/presets.h"
#include "../model/quant.h"
#include "../scheduler/engine.h"

typedef struct opts {
    const char *model, *preset;
    int prompts, prompt_len, gen, threads;
    bool quantize_lm_head, fast;
    float temperature;
    uint64_t seed;
} opts;

typedef struct scorer {
    rs_model *m;
    rs_forward_ctx *fwd;
    rs_kv_pool pool;
} scorer;

static void scorer_open(scorer *s, const char *dir, rs_backend *b, const char *mode, bool head, int max_tokens) {
    rs_quant_policy qp;
    rs_error err = {0};
    int rc = rs_quant_policy_init(&qp, mode, "", 0, 0, &err);
    qp.quantize_lm_head = head;
    if (rc != RS_OK || rs_model_load(dir, b, &qp, &s->m, &err) != RS_OK) {
        fprintf(stderr, "cannot load %s as %s: %s\n", dir, mode, err.message);
        exit(1);
    }
    const rs_model_config *c = &s->m->cfg;
    size_t kv = (size_t)(max_tokens + RS_KV_BLOCK) * c->n_layers * 2 * c->n_kv_heads * c->head_dim * 4;
    if (rs_kv_pool_init(&s->pool, b, c->n_layers, c->n_kv_heads, c->head_dim, RS_DTYPE_F32, kv) != RS_OK) exit(1);
    s->fwd = rs_forward_ctx_init(s->m, max_tokens, max_tokens);
    if (!s->fwd) exit(1);
}

static void scorer_close(scorer *s) {
    rs_forward_ctx_free(s->fwd);
    rs_kv_pool_free(&s->pool);
    rs_model_free(s->m);
}

/* One prefill over tokens[0, n): logits [n_rows][vocab] of the rows [first, n - 1). */
static void score(scorer *s, const int32_t *tokens, int n, int first, float *logits) {
    rs_kv_seq seq = {0};
    RS_ASSERT(rs_kv_seq_reserve(&s->pool, &seq, n) == RS_OK);
    int32_t *pos = rs_xmalloc(sizeof(int32_t) * (size_t)n), *slot = rs_xmalloc(sizeof(int32_t) * (size_t)n);
    int32_t *rows = rs_xmalloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) {
        pos[i] = i;
        slot[i] = rs_kv_slot(&seq, i);
    }
    int n_rows = 0;
    for (int i = first; i < n - 1; i++) rows[n_rows++] = i;
    int32_t seq_start[2] = {0, n}, seq_ctx[1] = {n};
    rs_batch batch = {.n_tok = n, .n_seq = 1, .tokens = tokens, .pos = pos, .slot = slot,
                      .seq_start = seq_start, .seq_ctx = seq_ctx, .block_tables = seq.blocks,
                      .max_blocks = seq.n_blocks};
    rs_forward(s->fwd, &batch, s->pool.layers, rows, n_rows, logits);
    rs_kv_seq_release(&s->pool, &seq);
    free(pos);
    free(slot);
    free(rows);
}

/* Samples `gen` tokens after each prompt with the FP8 model through the engine, as the daemon
 * does: tokens[p][prompt_len + t] receives rollout token t of prompt p. */
static void rollouts(scorer *fp8, int32_t **tokens, int n_prompts, const opts *o) {
    rs_engine_opts eo = {.kv_cache_bytes = fp8->pool.bytes * (size_t)n_prompts, .max_running = n_prompts,
                         .max_step_tokens = n_prompts * o->prompt_len,
                         .limits = {.max_context = o->prompt_len + o->gen, .max_new_tokens = o->gen, .max_n = 1,
                                    .max_batch = n_prompts}};
    rs_engine *e = NULL;
    rs_error err = {0};
    if (rs_engine_init(&e, fp8->m, &eo, &err) != RS_OK) {
        fprintf(stderr, "engine: %s\n", err.message);
        exit(1);
    }
    rs_gen_job *job = rs_gen_job_new();
    job->n_prompts = n_prompts;
    job->batched = true;
    job->prompts = rs_xcalloc((size_t)n_prompts, sizeof(int32_t *));
    job->prompt_lens = rs_xcalloc((size_t)n_prompts, sizeof(int));
    for (int p = 0; p < n_prompts; p++) {
        job->prompt_lens[p] = o->prompt_len;
        job->prompts[p] = rs_xmalloc(sizeof(int32_t) * (size_t)o->prompt_len);
        memcpy(job->prompts[p], tokens[p], sizeof(int32_t) * (size_t)o->prompt_len);
    }
    job->sp.max_new_tokens = o->gen;
    job->sp.temperature = o->temperature;
    job->sp.seed = o->seed;
    job->sp.ignore_eos = true;
    if (rs_engine_submit(e, job, &err) != RS_OK) exit(1);
    rs_engine_run_until_idle(e);
    for (int p = 0; p < n_prompts; p++) {
        RS_ASSERT(job->outputs[p].n_output == o->gen);
        memcpy(tokens[p] + o->prompt_len, job->outputs[p].output_ids, sizeof(int32_t) * (size_t)o->gen);
    }
    rs_gen_job_free(job);
    rs_engine_free(e);
}

static void logsoftmax(const float *x, int n, float inv_t, double *out) {
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++) mx = fmax(mx, (double)(x[i] * inv_t));
    for (int i = 0; i < n; i++) sum += exp((double)(x[i] * inv_t) - mx);
    double lse = mx + log(sum);
    for (int i = 0; i < n; i++) out[i] = (double)(x[i] * inv_t) - lse;
}

static void usage(void) {
    fprintf(stderr, "usage: fp8-mismatch [--model DIR | --preset NAME] [--prompts N] [--prompt-len N] "
                    "[--gen N] [--temperature T] [--seed S] [--threads N] [--quantize-lm-head] "
                    "[--numerics exact|fast]\n");
    exit(2);
}

int main(int argc, char **argv) {
    opts o = {.preset = "default", .prompts = 8, .prompt_len = 32, .gen = 48, .temperature = 1.0f, .seed = 1};
    for (int i = 1; i < argc; i += 2) {
        if (!strcmp(argv[i], "--quantize-lm-head")) {
            o.quantize_lm_head = true;
            i--;
            continue;
        }
        if (i + 1 >= argc) usage();
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--model")) o.model = v;
        else if (!strcmp(a, "--preset")) o.preset = v;
        else if (!strcmp(a, "--prompts")) o.prompts = atoi(v);
        else if (!strcmp(a, "--prompt-len")) o.prompt_len = atoi(v);
        else if (!strcmp(a, "--gen")) o.gen = atoi(v);
        else if (!strcmp(a, "--temperature")) o.temperature = (float)atof(v);
        else if (!strcmp(a, "--seed")) o.seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--threads")) o.threads = atoi(v);
        else if (!strcmp(a, "--numerics") && (!strcmp(v, "exact") || !strcmp(v, "fast"))) o.fast = !strcmp(v, "fast");
        else usage();
    }
    if (o.prompts < 1 || o.prompt_len < 1 || o.gen < 1 || o.temperature <= 0) usage();
    rs_log_min_level = RS_LOG_LEVEL_WARN;

    char dir[4096];
    if (o.model) {
        snprintf(dir, sizeof dir, "%s", o.model);
    } else {
        snprintf(dir, sizeof dir, "/tmp/rolloutd-mismatch-%s-%d", o.preset, (int)getuid());
        struct stat st;
        char probe[4200];
        snprintf(probe, sizeof probe, "%s/config.json", dir);
        rs_error err = {0};
        if (stat(probe, &st) != 0 && rs_model_preset_write(o.preset, dir, &err) != RS_OK) {
            fprintf(stderr, "preset %s: %s\n", o.preset, err.message);
            return 1;
        }
    }
    int max_tokens = o.prompt_len + o.gen;
    rs_backend *b = rs_backend_cpu_init(o.threads), *bq = b; /* bq: the FP8 model's */
    rs_numerics numerics = RS_NUMERICS_EXACT;
    if (o.fast) {
        bq = rs_backend_cpu_init(o.threads);
        numerics = rs_backend_set_numerics(bq, RS_NUMERICS_FAST);
    }
    scorer bf16, fp8;
    scorer_open(&bf16, dir, b, "bf16", false, max_tokens);
    scorer_open(&fp8, dir, bq, "fp8", o.quantize_lm_head, max_tokens);
    const rs_model_config *c = &bf16.m->cfg;
    int V = c->vocab_size;
    float *la = rs_xmalloc(sizeof(float) * (size_t)o.gen * V), *lb = rs_xmalloc(sizeof(float) * (size_t)o.gen * V);
    double *pa = rs_xmalloc(sizeof(double) * (size_t)V), *pb = rs_xmalloc(sizeof(double) * (size_t)V);
    int32_t **tokens = rs_xcalloc((size_t)o.prompts, sizeof(int32_t *));

    double sum_abs = 0, max_abs = 0, sum_kl = 0;
    long n_tok = 0, over2 = 0, under_half = 0;
    uint64_t x = o.seed * 0x9e3779b97f4a7c15ull + 1;
    float inv_t = 1.0f / o.temperature;
    for (int p = 0; p < o.prompts; p++) {
        tokens[p] = rs_xmalloc(sizeof(int32_t) * (size_t)max_tokens);
        for (int i = 0; i < o.prompt_len; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            tokens[p][i] = (int32_t)((x >> 33) % (uint64_t)V);
        }
    }
    rollouts(&fp8, tokens, o.prompts, &o);
    for (int p = 0; p < o.prompts; p++) {
        /* rows prompt_len-1 .. n-2 predict the rollout tokens prompt_len .. n-1 */
        score(&bf16, tokens[p], max_tokens, o.prompt_len - 1, la);
        score(&fp8, tokens[p], max_tokens, o.prompt_len - 1, lb);
        for (int t = 0; t < o.gen; t++) {
            int32_t tok = tokens[p][o.prompt_len + t];
            logsoftmax(la + (size_t)t * V, V, inv_t, pa);
            logsoftmax(lb + (size_t)t * V, V, inv_t, pb);
            double d = pa[tok] - pb[tok];
            sum_abs += fabs(d);
            max_abs = fmax(max_abs, fabs(d));
            if (d > log(2.0)) over2++;
            if (d < -log(2.0)) under_half++;
            double kl = 0;
            for (int v = 0; v < V; v++) kl += exp(pa[v]) * (pa[v] - pb[v]);
            sum_kl += kl;
            n_tok++;
        }
    }
    printf("%s: %s, %d layers, hidden %d, vocab %d; FP8 %d tensors, %.1f MiB (BF16 %.1f MiB)%s\n", dir,
           rs_arch_name(c->arch), c->n_layers, c->hidden, V, fp8.m->n_quantized,
           (double)fp8.m->quantized_bytes / (1 << 20), (double)fp8.m->quantized_bf16_bytes / (1 << 20),
           o.quantize_lm_head ? "; lm_head in FP8 too (--quantize-lm-head)" : "");
    printf("rollouts: %d prompts x %d tokens sampled by the FP8 model at T=%.2f (seed %llu); FP8 model's numerics %s%s\n",
           o.prompts, o.gen, o.temperature, (unsigned long long)o.seed,
           numerics == RS_NUMERICS_FAST ? "fast" : "exact",
           o.fast && numerics != RS_NUMERICS_FAST ? " (fast asked: this CPU has no fast kernels)" : "");
    printf("| tokens | mean abs dlogprob | max abs dlogprob | mean KL(bf16||fp8) | ratio > 2 | ratio < 1/2 |\n");
    printf("|---|---|---|---|---|---|\n");
    printf("| %ld | %.4g | %.4g | %.4g | %.2f%% | %.2f%% |\n", n_tok, sum_abs / n_tok, max_abs, sum_kl / n_tok,
           100.0 * over2 / n_tok, 100.0 * under_half / n_tok);
    free(la);
    free(lb);
    free(pa);
    free(pb);
    for (int p = 0; p < o.prompts; p++) free(tokens[p]);
    free(tokens);
    scorer_close(&fp8);
    scorer_close(&bf16);
    if (bq != b) rs_backend_free(bq);
    rs_backend_free(b);
    return 0;
}
