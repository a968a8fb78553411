/*
 * bench_inproc.c — the latency of one generation request through the engine, in process: no HTTP,
 * no JSON. scripts/bench_http.sh times the same request over HTTP and reports the difference,
 * which is what the HTTP front end and protocol/ cost per request.
 *
 *   bench-inproc --model DIR [--iterations N] [--warmup N] [--max-new-tokens-per-request K]
 *                [any rolloutd setting, e.g. --threads 2 --kv-cache-mb 64]
 *
 * The engine is built exactly as rolloutd builds it (server/setup.c), runs on its own thread, and
 * each iteration submits the job the HTTP benchmark sends ({"input_ids": [1, 2, 3, 4],
 * "sampling_params": {"max_new_tokens": K}}), waits for on_done, and frees it. Prints one line:
 *   inproc iterations=N median_ms=.. p99_ms=.. mean_ms=..
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../config/config.h"
#include "../core/latch.h"
#include "../core/rs.h"
#include "../kernels/backend.h"
#include "../model/model.h"
#include "../model/quant.h"
#include "../scheduler/engine.h"
#include "../server/setup.h"

static void on_done(rs_gen_job *job, void *user) {
    (void)job;
    rs_latch_arrive(user);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double one_request(rs_engine *e, int max_new_tokens, rs_latch *done) {
    rs_gen_job *job = rs_gen_job_new();
    job->n_prompts = 1;
    job->prompts = rs_xcalloc(1, sizeof(int32_t *));
    job->prompt_lens = rs_xcalloc(1, sizeof(int));
    job->prompts[0] = rs_xmalloc(4 * sizeof(int32_t));
    for (int i = 0; i < 4; i++) job->prompts[0][i] = i + 1;
    job->prompt_lens[0] = 4;
    job->sp.max_new_tokens = max_new_tokens;
    job->on_done = on_done;
    job->on_done_user = done;
    snprintf(job->rid, sizeof job->rid, "bench");
    const int arrived = done->arrived; /* only this thread submits, and the job is not in yet */
    double t0 = rs_now_s();
    rs_error err;
    if (rs_engine_submit(e, job, &err) != RS_OK) {
        fprintf(stderr, "bench-inproc: submit: %s\n", err.message);
        exit(1);
    }
    rs_latch_wait(done, arrived + 1);
    double dt = rs_now_s() - t0;
    rs_gen_job_free(job);
    return dt;
}

int main(int argc, char **argv) {
    int iterations = 2000, warmup = 100, max_new = 1;
    char **rest = rs_xcalloc((size_t)argc + 1, sizeof(char *));
    int n_rest = 0;
    rest[n_rest++] = argv[0];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iterations") && i + 1 < argc) iterations = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--max-new-tokens-per-request") && i + 1 < argc) max_new = atoi(argv[++i]);
        else rest[n_rest++] = argv[i];
    }
    if (iterations < 1 || warmup < 0 || max_new < 0) {
        fprintf(stderr, "bench-inproc: bad --iterations / --warmup / --max-new-tokens-per-request\n");
        return 1;
    }
    rs_config cfg;
    rs_config_default(&cfg);
    rs_error err = {0};
    bool help = false;
    if (rs_config_parse_args(&cfg, n_rest, rest, &help, &err) != RS_OK || help || !cfg.model[0]) {
        fprintf(stderr, "usage: %s --model DIR [--iterations N] [--warmup N] [--max-new-tokens-per-request K] "
                        "[rolloutd settings]%s%s\n", argv[0], err.message[0] ? "\n" : "", err.message);
        return 1;
    }
    free(rest);
    rs_log_min_level = RS_LOG_LEVEL_WARN;

    rs_backend *b = rs_backend_cpu_init(cfg.threads);
    rs_quant_policy qp;
    char quant[16];
    rs_config_get(&cfg, "quantization", quant, sizeof quant);
    rs_model *m = NULL;
    rs_engine *e = NULL;
    if (!b || rs_quant_policy_init(&qp, quant, cfg.quant_ignore, cfg.bf16_first_layers,
                                   cfg.bf16_last_layers, &err) != RS_OK ||
        rs_model_load(cfg.model, b, &qp, &m, &err) != RS_OK) {
        fprintf(stderr, "bench-inproc: %s\n", err.message);
        return 1;
    }
    rs_engine_opts eo;
    rs_setup_engine_opts(&cfg, m->cfg.max_position, &eo);
    if (rs_engine_init(&e, m, &eo, &err) != RS_OK || rs_engine_start(e) != RS_OK) {
        fprintf(stderr, "bench-inproc: engine: %s\n", err.message);
        return 1;
    }

    rs_latch w;
    rs_latch_init(&w);
    for (int i = 0; i < warmup; i++) one_request(e, max_new, &w);
    double *t = rs_xmalloc(sizeof(double) * (size_t)iterations), sum = 0;
    for (int i = 0; i < iterations; i++) {
        t[i] = one_request(e, max_new, &w);
        sum += t[i];
    }
    qsort(t, (size_t)iterations, sizeof(double), cmp_double);
    int p99 = (int)((double)iterations * 0.99);
    if (p99 >= iterations) p99 = iterations - 1;
    printf("inproc iterations=%d median_ms=%.4f p99_ms=%.4f mean_ms=%.4f\n", iterations, t[iterations / 2] * 1e3,
           t[p99] * 1e3, sum / iterations * 1e3);
    free(t);
    rs_engine_stop(e);
    rs_engine_free(e);
    rs_model_free(m);
    rs_backend_free(b);
    rs_latch_destroy(&w);
    return 0;
}
