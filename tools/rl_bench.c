/*
 * rl_bench.c — an RL-shaped workload through the engine, in process (no HTTP).
 *
 *   build/rl-bench [--model DIR | --preset NAME] [--prompts 64] [--n 8] [--prompt-len 128]
 *                  [--gen 256] [--kv-mb 0] [--threads N] [--runs all|engine|skeleton|kv|loop]
 *                  [--loop-prompts 2] [--quantization bf16|fp8]
 *
 * Weights are served as stored (BF16) by default; --quantization fp8 serves the attention and MLP
 * matrices as W8A8 FP8 blocks, as the daemon's default does.
 *
 * A GRPO step: P prompts, n samples each, fixed-length outputs (ignore_eos), sampled at T = 1.
 * Every configuration runs the same requests in the same process:
 *
 *   engine      the engine as the daemon runs it: prefix cache on, an n-sample group prefilled
 *               once, admission with a 0.4 new-token ratio, FP8 KV cache
 *   skeleton    the walking skeleton's behaviour: every sample its own request with its own
 *               prefill, no prefix cache, whole max_new_tokens reserved at admission, fp32 KV
 *   kv          the engine at one fixed KV budget with each KV dtype: peak sequences running at
 *               once and preemptions (the budget defaults to what holds ~1/4 of the F32 demand)
 *   loop        a plain serving loop for scale: one request (one sample) at a time, each run to
 *               completion before the next is submitted, so decode runs at batch 1 (FP8 KV, no
 *               prefix cache); only the first
 *               --loop-prompts prompts (x n samples) run, since its tokens/s does not depend on
 *               how many requests follow
 *
 * It prints output tokens/s, wall time, peak running sequences, preemptions and the ratio of the
 * engine over the skeleton.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/rs.h"
#include "../model/model.h"
#include "../model/presets.h"
#include "../model/quant.h"
#include "../scheduler/engine.h"

typedef struct opts {
    const char *model, *preset, *runs, *quantization;
    int prompts, n, prompt_len, gen, threads, kv_mb, loop_prompts;
} opts;

typedef struct result {
    double seconds, tokens_per_s;
    int peak_running;
    unsigned long long retractions, prefix_hits;
} result;

static rs_gen_job *make_job(const opts *o, int p, int n, int sample0, const rs_model_config *cfg) {
    rs_gen_job *j = rs_gen_job_new();
    snprintf(j->rid, sizeof j->rid, "p%d-s%d", p, sample0);
    j->n_prompts = 1;
    j->prompts = rs_xcalloc(1, sizeof(int32_t *));
    j->prompt_lens = rs_xcalloc(1, sizeof(int));
    j->prompt_lens[0] = o->prompt_len;
    j->prompts[0] = rs_xmalloc(sizeof(int32_t) * (size_t)o->prompt_len);
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(p + 1);
    for (int i = 0; i < o->prompt_len; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        j->prompts[0][i] = (int32_t)((x >> 33) % (uint64_t)cfg->vocab_size);
    }
    j->sp.n = n;
    j->sp.max_new_tokens = o->gen;
    j->sp.ignore_eos = true;
    j->sp.temperature = 1.0f;
    j->sp.seed = (uint64_t)(p * 1000 + sample0);
    return j;
}

static result run(rs_model *m, const opts *o, const rs_engine_opts *eo, bool grouped) {
    rs_engine *e = NULL;
    rs_error err = {0};
    if (rs_engine_init(&e, m, eo, &err) != RS_OK) {
        fprintf(stderr, "engine: %s\n", err.message);
        exit(1);
    }
    int n_jobs = grouped ? o->prompts : o->prompts * o->n;
    rs_gen_job **jobs = rs_xcalloc((size_t)n_jobs, sizeof *jobs);
    double t0 = rs_now_s();
    for (int i = 0; i < n_jobs; i++) {
        jobs[i] = grouped ? make_job(o, i, o->n, 0, &m->cfg) : make_job(o, i / o->n, 1, i % o->n, &m->cfg);
        if (rs_engine_submit(e, jobs[i], &err) != RS_OK) exit(1);
    }
    rs_engine_run_until_idle(e);
    result r = {.seconds = rs_now_s() - t0};
    long tokens = 0;
    for (int i = 0; i < n_jobs; i++) {
        for (int k = 0; k < jobs[i]->sp.n; k++) {
            RS_ASSERT(jobs[i]->outputs[k].finish.type == RS_FINISH_LENGTH);
            tokens += jobs[i]->outputs[k].n_output;
        }
        rs_gen_job_free(jobs[i]);
    }
    free(jobs);
    rs_engine_stats st;
    rs_engine_get_stats(e, &st);
    r.tokens_per_s = (double)tokens / r.seconds;
    r.peak_running = st.peak_running;
    r.retractions = (unsigned long long)st.num_retractions;
    r.prefix_hits = (unsigned long long)st.prefix_hit_tokens;
    rs_engine_free(e);
    return r;
}

/* The plain loop: every sample its own request, submitted after the previous one finished. */
static result run_loop(rs_model *m, const opts *o, const rs_engine_opts *eo) {
    rs_engine *e = NULL;
    rs_error err = {0};
    if (rs_engine_init(&e, m, eo, &err) != RS_OK) {
        fprintf(stderr, "engine: %s\n", err.message);
        exit(1);
    }
    long tokens = 0;
    double t0 = rs_now_s();
    for (int p = 0; p < RS_MIN(o->loop_prompts, o->prompts); p++) {
        for (int k = 0; k < o->n; k++) {
            rs_gen_job *j = make_job(o, p, 1, k, &m->cfg);
            if (rs_engine_submit(e, j, &err) != RS_OK) exit(1);
            rs_engine_run_until_idle(e);
            RS_ASSERT(j->outputs[0].finish.type == RS_FINISH_LENGTH);
            tokens += j->outputs[0].n_output;
            rs_gen_job_free(j);
        }
    }
    result r = {.seconds = rs_now_s() - t0, .peak_running = 1};
    r.tokens_per_s = (double)tokens / r.seconds;
    rs_engine_free(e);
    return r;
}

static void print_row(const char *name, const char *kv, size_t kv_bytes, const result *r) {
    printf("| %-9s | %-5s | %8.1f MiB | %8.1f | %10.1f | %12d | %11llu | %11llu |\n", name, kv,
           (double)kv_bytes / (1 << 20), r->seconds, r->tokens_per_s, r->peak_running, r->retractions,
           r->prefix_hits);
}

static void usage(void) {
    fprintf(stderr, "usage: rl-bench [--model DIR | --preset NAME] [--prompts 64] [--n 8] [--prompt-len 128] "
                    "[--gen 256] [--kv-mb 0] [--threads N] [--runs all|engine|skeleton|kv|loop] [--loop-prompts 2] "
                    "[--quantization bf16|fp8]\n");
    exit(2);
}

int main(int argc, char **argv) {
    opts o = {.preset = "default", .runs = "all", .prompts = 64, .n = 8, .prompt_len = 128, .gen = 256,
              .loop_prompts = 2, .quantization = "bf16"};
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc) usage();
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--model")) o.model = v;
        else if (!strcmp(a, "--preset")) o.preset = v;
        else if (!strcmp(a, "--runs")) o.runs = v;
        else if (!strcmp(a, "--prompts")) o.prompts = atoi(v);
        else if (!strcmp(a, "--n")) o.n = atoi(v);
        else if (!strcmp(a, "--prompt-len")) o.prompt_len = atoi(v);
        else if (!strcmp(a, "--gen")) o.gen = atoi(v);
        else if (!strcmp(a, "--kv-mb")) o.kv_mb = atoi(v);
        else if (!strcmp(a, "--threads")) o.threads = atoi(v);
        else if (!strcmp(a, "--loop-prompts")) o.loop_prompts = atoi(v);
        else if (!strcmp(a, "--quantization")) o.quantization = v;
        else usage();
    }
    if (o.prompts < 1 || o.n < 1 || o.prompt_len < 1 || o.gen < 1) usage();
    bool all = !strcmp(o.runs, "all");
    rs_log_min_level = RS_LOG_LEVEL_WARN;

    char dir[4096];
    rs_error err = {0};
    if (o.model) {
        snprintf(dir, sizeof dir, "%s", o.model);
    } else {
        snprintf(dir, sizeof dir, "/tmp/rolloutd-bench-%s-%d", o.preset, (int)getuid());
        char probe[4200];
        struct stat st;
        snprintf(probe, sizeof probe, "%s/config.json", dir);
        if (stat(probe, &st) != 0 && rs_model_preset_write(o.preset, dir, &err) != RS_OK) {
            fprintf(stderr, "%s\n", err.message);
            return 1;
        }
    }
    rs_quant_policy qp;
    if (rs_quant_policy_init(&qp, o.quantization, "", 0, 0, &err) != RS_OK) {
        fprintf(stderr, "%s\n", err.message);
        return 2;
    }
    rs_backend *b = rs_backend_cpu_init(o.threads);
    rs_model *m = NULL;
    if (rs_model_load(dir, b, &qp, &m, &err) != RS_OK) {
        fprintf(stderr, "%s\n", err.message);
        return 1;
    }
    const rs_model_config *c = &m->cfg;
    int seqs = o.prompts * o.n, ctx = o.prompt_len + o.gen;
    size_t f32_token = (size_t)c->n_layers * 2 * (size_t)c->n_kv_heads * (size_t)c->head_dim * 4;
    size_t demand = (size_t)seqs * (size_t)(ctx + RS_KV_BLOCK) * f32_token;
    printf("model %s: %s, %d layers, hidden %d, %d kv heads x %d, weights %s; workload %d prompts x n=%d, "
           "prompt %d, %d new tokens, T=1\n",
           dir, rs_arch_name(c->arch), c->n_layers, c->hidden, c->n_kv_heads, c->head_dim, o.quantization,
           o.prompts, o.n, o.prompt_len, o.gen);
    printf("| run       | KV    | KV budget    | seconds  | tokens/s   | peak running | preemptions | prefix hits |\n");
    printf("|---|---|---|---|---|---|---|---|\n");

    rs_engine_opts base = {.max_running = seqs, .max_step_tokens = 2048,
                           .limits = {.max_context = ctx, .max_new_tokens = o.gen, .max_n = o.n,
                                      .max_batch = seqs, .max_top_logprobs = 0}};
    result eng = {0}, skel = {0};
    if (all || !strcmp(o.runs, "engine")) {
        rs_engine_opts eo = base;
        eo.kv_cache_bytes = demand; /* room for everything: throughput, not memory, is measured */
        eo.prefix_cache = true;
        eo.admission_new_token_ratio = 0.4f;
        eo.kv_dtype = RS_DTYPE_E4M3;
        eo.kv_scales = RS_KV_SCALES_CALIBRATE;
        eo.kv_calib_margin = 1.0f;
        eo.kv_calib_percentile = 1.0f;
        eng = run(m, &o, &eo, true);
        print_row("engine", "fp8", eo.kv_cache_bytes, &eng);
    }
    if (all || !strcmp(o.runs, "skeleton")) {
        rs_engine_opts eo = base;
        eo.kv_cache_bytes = demand;
        eo.prefix_cache = false;
        eo.admission_new_token_ratio = 1.0f;
        eo.kv_dtype = RS_DTYPE_F32;
        skel = run(m, &o, &eo, false);
        print_row("skeleton", "f32", eo.kv_cache_bytes, &skel);
    }
    if (eng.seconds > 0 && skel.seconds > 0)
        printf("engine vs skeleton: %.2fx output tokens/s\n", eng.tokens_per_s / skel.tokens_per_s);
    if (all || !strcmp(o.runs, "loop")) {
        rs_engine_opts eo = base;
        eo.kv_cache_bytes = demand;
        eo.prefix_cache = false; /* nothing shared: each request prefills its own prompt */
        eo.kv_dtype = RS_DTYPE_E4M3;
        eo.kv_scales = RS_KV_SCALES_CALIBRATE;
        eo.kv_calib_margin = 1.0f;
        eo.kv_calib_percentile = 1.0f;
        result lp = run_loop(m, &o, &eo);
        print_row("loop", "fp8", eo.kv_cache_bytes, &lp);
        if (eng.seconds > 0) printf("engine vs plain loop: %.2fx output tokens/s\n", eng.tokens_per_s / lp.tokens_per_s);
    }
    if (all || !strcmp(o.runs, "kv")) {
        size_t budget = o.kv_mb > 0 ? (size_t)o.kv_mb << 20 : demand / 4;
        const struct { const char *name; rs_dtype dt; } kvs[] = {
            {"f32", RS_DTYPE_F32}, {"bf16", RS_DTYPE_BF16}, {"fp8", RS_DTYPE_E4M3}};
        for (size_t i = 0; i < RS_ARRAY_LEN(kvs); i++) {
            rs_engine_opts eo = base;
            eo.kv_cache_bytes = budget;
            eo.prefix_cache = true;
            eo.admission_new_token_ratio = 0.4f;
            eo.kv_dtype = kvs[i].dt;
            eo.kv_scales = kvs[i].dt == RS_DTYPE_E4M3 ? RS_KV_SCALES_CALIBRATE : RS_KV_SCALES_NONE;
            eo.kv_calib_margin = 1.0f;
            eo.kv_calib_percentile = 1.0f;
            result r = run(m, &o, &eo, true);
            print_row("kv", kvs[i].name, budget, &r);
        }
    }
    rs_model_free(m);
    rs_backend_free(b);
    return 0;
}
