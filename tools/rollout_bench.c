/*
 * rollout_bench.c — in-process decode throughput of the engine (no HTTP).
 *
 *   build/rollout-bench [--preset default|qwen3-0.6b|qwen3-8b|all] [--model DIR] [--threads N]
 *                       [--batches 1,16] [--prompt 32] [--gen 32] [--quantization bf16|fp8|both]
 *                       [--device cpu|cuda] [--numerics exact|fast|auto] [--graphs on|off]
 *                       [--cpu-kernels auto|avx512|avx2|scalar]
 *                       [--kv-cache-dtype f32|bf16|fp8] [--prefill 512[,128]] [--repeat 3]
 *                       [--no-bandwidth] [--quantize-lm-head] [--profile-ops]
 *
 * For each batch size B it runs B greedy sequences twice through the real engine: once with
 * max_new_tokens = 1 (prefill + first token) and once with max_new_tokens = gen. Decode tokens/s
 * is B * (gen - 1) / (t_gen - t_1), so prefill cost cancels out. The same run measures the
 * machine's memory bandwidth twice: a STREAM-like copy (one thread, memcpy, read + write bytes) and
 * a STREAM-like read (the benchmark's threads summing a 512 MiB buffer allocated like the weights,
 * i.e. in huge pages where the kernel grants them), so batch-1 decode can be read as a share of
 * what the memory system delivers (weights read per token / time per token). Decode only reads
 * weights, so the read figure is the closer ceiling; the copy figure is kept for comparison with
 * earlier runs. --quantization picks
 * the weight precision the model is loaded with (model/quant.h; "both" runs bf16, then fp8).
 * --device cuda (a `make CUDA=1` build) runs the model on GPU 0; both bandwidth figures are then
 * the GPU's own device-to-device copy (read + write bytes), the ceiling for its weight reads.
 * --cpu-kernels picks the CPU backend's kernel class exactly as the daemon's flag does (the same
 * constructor, rs_backend_cpu_init_kernels), and the header names the dispatch it got.
 * --prefill N also times one N-token prompt with max_new_tokens = 1 (a single forward pass over
 * the prompt, unchunked, and the first token): prefill tokens/s = N / t (--batches 0: prefill
 * only). --repeat R runs every measurement R times and prints min / median / max (and the
 * process's user CPU seconds). --no-bandwidth skips the memory measurements (a few seconds).
 * --quantize-lm-head loads the FP8 model with its output projection in FP8 too (model/quant.h).
 * --numerics exact|fast (default: the daemon's auto, fast with --device cuda and exact on the CPU)
 * picks the kernels (kernels/backend.h rs_numerics); every row says which ones ran (the CPU's fast
 * numerics exist for BF16 matmuls on AVX512_BF16 CPUs; elsewhere it runs exact). --graphs off (CUDA) launches
 * every kernel of every decode step instead of replaying recorded step graphs. --profile-ops (graphs
 * off) runs each batch once more and prints where its prefill and decode steps' time goes, op by
 * op, each op synchronized (kernels/backend.h rs_backend_profile), beside the steps' wall time: the
 * difference is the engine's own host work.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/pool.h"
#include "../core/rs.h"
#include "../kernels/backend.h"
#include "../model/model.h"
#include "../model/presets.h"
#include "../model/quant.h"
#include "../scheduler/engine.h"

typedef struct bench_opts {
    const char *preset;
    const char *model;
    int threads;
    int batches[8];
    int n_batches;
    int prompt_len;
    int gen;
    const char *quantization;   /* bf16 | fp8 | both */
    const char *device;         /* cpu | cuda */
    const char *cpu_kernels;    /* auto | avx512 | avx2 | scalar */
    const char *kv_dtype;       /* f32 | bf16 | fp8 */
    int prefill[4];             /* prompt lengths timed for prefill */
    int n_prefill;
    int repeat;                 /* runs of every measurement */
    rs_numerics numerics;       /* asked for (numerics_auto: by the device); the row says what runs */
    bool numerics_auto;
    bool graphs;                /* CUDA step graphs (--graphs on|off) */
    bool profile_ops;           /* --profile-ops: per-op time of the decode steps (graphs off) */
} bench_opts;

static rs_backend *make_backend(const bench_opts *o) {
    rs_backend *b = NULL;
    if (strcmp(o->device, "cuda") == 0) {
#ifdef RS_CUDA
        b = rs_backend_cuda_init(0);
#else
        fprintf(stderr, "--device cuda needs a CUDA build (make CUDA=1)\n");
        exit(2);
#endif
    } else {
        rs_error err = {0};
        b = rs_backend_cpu_init_kernels(o->threads, o->cpu_kernels, &err);
        if (!b) {
            fprintf(stderr, "%s\n", err.message);
            exit(2);
        }
    }
    if (!b) {
        fprintf(stderr, "cannot create the %s backend\n", o->device);
        exit(1);
    }
    rs_backend_set_numerics(b, o->numerics_auto ? (strcmp(o->device, "cuda") == 0 ? RS_NUMERICS_FAST
                                                                                   : RS_NUMERICS_EXACT)
                                                : o->numerics);
#ifdef RS_CUDA
    if (rs_backend_cuda_device(b) >= 0) rs_backend_cuda_set_graphs(b, o->graphs);
#endif
    return b;
}

/* A device backend's copy bandwidth in GB/s (bytes read + written), best of a few 512 MiB copies. */
static double device_copy_gbs(const bench_opts *o) {
    rs_backend *b = make_backend(o);
    const size_t n = (size_t)512 << 20;
    char *x = rs_backend_alloc(b, n), *y = rs_backend_alloc(b, n);
    if (!x || !y) {
        fprintf(stderr, "cannot allocate 1 GiB on the %s backend\n", o->device);
        exit(1);
    }
    char sync;
    double best = 0;
    for (int rep = 0; rep < 6; rep++) {
        double t0 = rs_now_s();
        rs_backend_copy(b, y, x, n);
        rs_backend_download(b, &sync, y, 1); /* waits for the copy */
        double gbs = 2.0 * (double)n / (rs_now_s() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    rs_backend_free_mem(b, x);
    rs_backend_free_mem(b, y);
    rs_backend_free(b);
    return best;
}

/* Copy bandwidth in GB/s (bytes read + written), best of a few passes over 512 MiB. */
static double stream_copy_gbs(void) {
    size_t n = (size_t)256 << 20;
    char *a = rs_xmalloc(n), *b = rs_xmalloc(n);
    memset(a, 1, n);
    memset(b, 2, n);
    double best = 0;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = rs_now_s();
        memcpy(b, a, n);
        double dt = rs_now_s() - t0;
        double gbs = 2.0 * (double)n / dt / 1e9;
        if (gbs > best) best = gbs;
        a[rep] = b[n - 1 - rep]; /* keep the copies observable */
    }
    free(a);
    free(b);
    return best;
}

/* The same copy through the CPU backend's upload (streaming stores from 1 MiB: what a weight load
 * or push pays per byte), in GB/s of bytes read + written. */
static double upload_copy_gbs(void) {
    size_t n = (size_t)256 << 20;
    rs_backend *b = rs_backend_cpu_init(1);
    char *a = rs_xmalloc(n), *d = rs_backend_alloc(b, n);
    memset(a, 1, n);
    double best = 0;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = rs_now_s();
        rs_backend_upload(b, d, a, n);
        double gbs = 2.0 * (double)n / (rs_now_s() - t0) / 1e9;
        if (gbs > best) best = gbs;
        a[rep] = d[n - 1 - rep];
    }
    free(a);
    rs_backend_free_mem(b, d);
    rs_backend_free(b);
    return best;
}

typedef struct read_job {
    const uint64_t *p;
    uint64_t sums[64];
} read_job;

static void read_range(void *ctx, int64_t begin, int64_t end, int tid) {
    read_job *j = ctx;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (int64_t i = begin; i < end; i += 4) a += j->p[i], b += j->p[i + 1], c += j->p[i + 2], d += j->p[i + 3];
    j->sums[tid % 64] += a ^ b ^ c ^ d;
}

/* Read bandwidth in GB/s with `threads` threads, best of a few passes over 512 MiB of backend
 * (weight-like) memory. */
static double stream_read_gbs(int threads) {
    const size_t n = (size_t)512 << 20;
    rs_backend *b = rs_backend_cpu_init(1);
    uint64_t *p = rs_backend_alloc(b, n);
    memset(p, 1, n);
    rs_pool *pool = rs_pool_init(threads);
    read_job j = {.p = p};
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = rs_now_s();
        rs_pool_run(pool, (int64_t)(n / 8), 4096, read_range, &j);
        double gbs = (double)n / (rs_now_s() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    uint64_t x = 0;
    for (int i = 0; i < 64; i++) x ^= j.sums[i];
    if (x == 42) printf(" "); /* keep the sums observable */
    rs_pool_free(pool);
    rs_backend_free_mem(b, p);
    rs_backend_free(b);
    return best;
}

/* A greedy job of `batch` pseudo-random prompts of prompt_len tokens, gen new tokens each. */
static rs_gen_job *bench_job(const rs_model_config *cfg, int batch, int prompt_len, int gen) {
    rs_gen_job *job = rs_gen_job_new();
    snprintf(job->rid, sizeof job->rid, "bench-b%d-g%d", batch, gen);
    job->n_prompts = batch;
    job->batched = true;
    job->prompts = rs_xcalloc((size_t)batch, sizeof(int32_t *));
    job->prompt_lens = rs_xcalloc((size_t)batch, sizeof(int));
    uint64_t x = 12345;
    for (int p = 0; p < batch; p++) {
        job->prompt_lens[p] = prompt_len;
        job->prompts[p] = rs_xmalloc(sizeof(int32_t) * (size_t)prompt_len);
        for (int i = 0; i < prompt_len; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            job->prompts[p][i] = (int32_t)((x >> 33) % (uint64_t)cfg->vocab_size);
        }
    }
    job->sp.max_new_tokens = gen;
    job->sp.temperature = 0.0f;
    job->sp.ignore_eos = true;
    return job;
}

static double run_batch(rs_engine *e, const rs_model_config *cfg, int batch, int prompt_len, int gen) {
    rs_gen_job *job = bench_job(cfg, batch, prompt_len, gen);
    rs_error err = {0};
    double t0 = rs_now_s();
    if (rs_engine_submit(e, job, &err) != RS_OK) {
        fprintf(stderr, "submit failed: %s\n", err.message);
        exit(1);
    }
    rs_engine_run_until_idle(e);
    double dt = rs_now_s() - t0;
    for (int i = 0; i < batch; i++) RS_ASSERT(job->outputs[i].n_output == gen);
    rs_gen_job_free(job);
    return dt;
}

/* --profile-ops: one more job of `batch` prompts with the backend's op profile on (kernels/backend.h
 * rs_backend_profile): its prefill step, then its decode steps together. Prints where a step's time
 * goes, per op, beside the step's wall time (what the ops leave is the engine's host work). */
static void profile_decode(rs_engine *e, rs_backend *b, const rs_model_config *cfg, int batch, int prompt_len,
                           int gen) {
    rs_gen_job *job = bench_job(cfg, batch, prompt_len, gen);
    rs_error err = {0};
    if (rs_engine_submit(e, job, &err) != RS_OK) {
        fprintf(stderr, "submit failed: %s\n", err.message);
        exit(1);
    }
    rs_backend_profile(b, true);
    double t0 = rs_now_s();
    rs_engine_step_once(e); /* the prefill: one step (max_step_tokens covers every prompt) */
    printf("  op profile, batch %d: the prefill step (%d rows), %.3f ms (each op synchronized)\n", batch,
           batch * prompt_len, 1e3 * (rs_now_s() - t0));
    rs_backend_profile_print(b, stdout, 1);
    rs_backend_profile(b, true);
    int steps = 0;
    t0 = rs_now_s();
    while (rs_engine_step_once(e)) steps++;
    const double ms = 1e3 * (rs_now_s() - t0) / RS_MAX(steps, 1);
    printf("  op profile, batch %d: %d decode steps, %.3f ms/step (each op synchronized)\n", batch, steps, ms);
    rs_backend_profile_print(b, stdout, steps);
    rs_backend_profile(b, false);
    rs_gen_job_free(job);
}

/* Sorts v[0..n) and returns its median. */
static double median(double *v, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            const double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* User CPU seconds of this process so far (all threads). */
static double user_cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec;
}

static long peak_rss_mib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024;
}

/* MiB of the process's anonymous memory backed by transparent huge pages, or -1 if unknown. The
 * BF16 decode speed depends on it (its 1.1 GB of weights stream at the memory's speed only when the
 * TLB covers them), and whether the kernel grants huge pages varies from run to run. */
static long thp_mib(void) {
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) break;
    fclose(f);
    return kb < 0 ? -1 : kb / 1024;
}

/* Benchmarks one model under one policy; tps_out[i] receives batches[i]'s decode tokens/s. */
static void bench_model(const char *label, const char *dir, const bench_opts *o, const rs_quant_policy *qp,
                        const double bw[2], double *tps_out) {
    rs_backend *b = make_backend(o);
    rs_model *m = NULL;
    rs_error err = {0};
    if (rs_model_load(dir, b, qp, &m, &err) != RS_OK) {
        fprintf(stderr, "cannot load %s: %s\n", dir, err.message);
        exit(1);
    }
    int max_batch = 1;
    for (int i = 0; i < o->n_batches; i++) max_batch = RS_MAX(max_batch, o->batches[i]);
    int max_prefill = 0;
    for (int i = 0; i < o->n_prefill; i++) max_prefill = RS_MAX(max_prefill, o->prefill[i]);
    const int max_context = RS_MAX(o->prompt_len + o->gen, max_prefill + 1);
    const size_t kv_tokens = RS_MAX((size_t)max_batch * (size_t)(o->prompt_len + o->gen + RS_KV_BLOCK),
                                    (size_t)(max_prefill + 2 * RS_KV_BLOCK));
    rs_engine_opts eo = {
        .kv_cache_bytes = kv_tokens * (size_t)m->cfg.n_layers * 2 * (size_t)m->cfg.n_kv_heads *
                          (size_t)m->cfg.head_dim * 4,
        .max_running = max_batch,
        .max_step_tokens = RS_MAX(RS_MAX(max_batch * o->prompt_len, max_batch), max_prefill),
        .kv_dtype = !strcmp(o->kv_dtype, "fp8") ? RS_DTYPE_E4M3 : !strcmp(o->kv_dtype, "bf16") ? RS_DTYPE_BF16
                                                                                               : RS_DTYPE_F32,
        .kv_scales = RS_KV_SCALES_CALIBRATE,
        .kv_calib_margin = 1.2f,
        .kv_calib_percentile = 1.0f,
        .limits = {.max_context = max_context, .max_new_tokens = o->gen, .max_n = 1, .max_batch = max_batch},
    };
    rs_engine *e = NULL;
    if (rs_engine_init(&e, m, &eo, &err) != RS_OK) {
        fprintf(stderr, "engine: %s\n", err.message);
        exit(1);
    }
    /* Weights read per decode step: every weight once, but the embedding table only one row per
     * token (it is re-read as lm_head when tied). */
    double step_bytes = (double)m->weight_bytes;
    if (!m->cfg.tie_embeddings) step_bytes -= (double)rs_tensor_nbytes(&m->embed);
    const char *numerics = rs_numerics_name(rs_backend_numerics(b));
    printf("\n%s [%s]: %s, %d layers, hidden %d, vocab %d, weights %.1f MiB (%s), %s backend, numerics %s%s, "
           "%d threads\n",
           label, rs_quant_mode_name(qp->mode), rs_arch_name(m->cfg.arch), m->cfg.n_layers, m->cfg.hidden,
           m->cfg.vocab_size, (double)m->weight_bytes / (1 << 20), rs_dtype_name(m->layers[0].wq.dtype),
           rs_backend_name(b), numerics, rs_backend_has_graphs(b) ? (o->graphs ? ", step graphs on" : ", step graphs off") : "",
           o->threads);
    printf("  %-8s %-6s %-10s %-12s %-14s %-12s %s\n", "numerics", "batch", "decode", "ms/step", "tokens/s",
           "x batch 1", "weight GB/s (share of copy / read bw)");
    run_batch(e, &m->cfg, 1, o->prompt_len, 2); /* warm-up: page in the weights */
    const long thp = thp_mib();
    double base = 0;
    for (int i = 0; i < o->n_batches; i++) {
        int B = o->batches[i];
        double tv[16], cpu0 = user_cpu_s();
        for (int r = 0; r < o->repeat; r++) {
            double t1 = run_batch(e, &m->cfg, B, o->prompt_len, 1);
            double tg = run_batch(e, &m->cfg, B, o->prompt_len, o->gen);
            tv[r] = B * (o->gen - 1) / (tg - t1);
        }
        double tps = median(tv, o->repeat), step = B / tps;
        if (i == 0) base = tps;
        tps_out[i] = tps;
        double gbs = step_bytes / step / 1e9;
        printf("  %-8s %-6d %-10d %-12.2f %-14.1f %-12.2f %.1f", numerics, B, o->gen - 1, step * 1e3, tps,
               tps / base, gbs);
        if (bw[0] > 0) printf(" (%.0f%% / %.0f%%)", 100.0 * gbs / bw[0], 100.0 * gbs / bw[1]);
        if (o->repeat > 1)
            printf("  [min %.1f median %.1f max %.1f tokens/s over %d runs, %.2f s user CPU]", tv[0], tps,
                   tv[o->repeat - 1], o->repeat, user_cpu_s() - cpu0);
        printf("\n");
    }
    for (int i = 0; i < o->n_batches && o->profile_ops; i++)
        profile_decode(e, b, &m->cfg, o->batches[i], o->prompt_len, o->gen);
    for (int i = 0; i < o->n_prefill; i++) {
        const int N = o->prefill[i];
        double tv[16], cpu0 = user_cpu_s();
        for (int r = 0; r < o->repeat; r++) tv[r] = N / run_batch(e, &m->cfg, 1, N, 1);
        printf("  prefill %d tokens (one prompt, one forward pass): %.1f tokens/s", N, median(tv, o->repeat));
        if (o->repeat > 1)
            printf("  [min %.1f median %.1f max %.1f over %d runs, %.2f s user CPU]", tv[0], median(tv, o->repeat),
                   tv[o->repeat - 1], o->repeat, user_cpu_s() - cpu0);
        printf("\n");
    }
    if (m->n_quantized > 0)
        printf("  quantized layers: %d tensors, %.1f MiB resident vs %.1f MiB in BF16 (%.3fx)\n", m->n_quantized,
               (double)m->quantized_bytes / (1 << 20), (double)m->quantized_bf16_bytes / (1 << 20),
               (double)m->quantized_bytes / (double)m->quantized_bf16_bytes);
    printf("  peak RSS %ld MiB; transparent huge pages %s%ld MiB (weights %.0f MiB)\n", peak_rss_mib(),
           thp < 0 ? "unknown " : "", thp < 0 ? 0 : thp, (double)m->weight_bytes / (1 << 20));
    rs_engine_free(e);
    rs_model_free(m);
    rs_backend_free(b);
}

static const char *ensure_preset(const char *name, char *dir, size_t cap) {
    rs_model_config cfg;
    if (rs_model_preset(name, &cfg) != RS_OK) {
        fprintf(stderr, "unknown preset '%s'\n", name);
        exit(2);
    }
    snprintf(dir, cap, "/tmp/rolloutd-bench-%s-%d", name, (int)getuid());
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/model.safetensors", dir);
    struct stat st;
    if (stat(probe, &st) != 0) {
        fprintf(stderr, "writing %s model to %s ...\n", name, dir);
        rs_error err = {0};
        if (rs_model_preset_write(name, dir, &err) != RS_OK) {
            fprintf(stderr, "cannot write %s: %s\n", dir, err.message);
            exit(1);
        }
    }
    return dir;
}

static void usage(void) {
    fprintf(stderr, "usage: rollout-bench [--preset NAME|all] [--model DIR] [--threads N]\n"
                    "                     [--batches 1,16] [--prompt 32] [--gen 32] [--quantization bf16|fp8|both]\n"
                    "                     [--device cpu|cuda] [--numerics exact|fast|auto] [--graphs on|off]\n"

                    "                     [--cpu-kernels auto|avx512|avx2|scalar]\n"
                    "                     [--kv-cache-dtype f32|bf16|fp8] [--prefill 512[,N]] [--repeat R]\n"
                    "                     [--no-bandwidth] [--quantize-lm-head] [--profile-ops]\n"
                    "                     (--batches 0: prefill only)\n");
    exit(2);
}

int main(int argc, char **argv) {
    bench_opts o = {.preset = "all", .threads = 0, .batches = {1, 16}, .n_batches = 2, .prompt_len = 32,
                    .gen = 32, .quantization = "bf16", .device = "cpu",
                    .cpu_kernels = "auto", .kv_dtype = "f32", .repeat = 1,
                    .numerics = RS_NUMERICS_EXACT, .numerics_auto = true, .graphs = true};
    bool bandwidth = true, head = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--no-bandwidth")) {
            bandwidth = false;
            continue;
        }
        if (!strcmp(a, "--quantize-lm-head")) {
            head = true;
            continue;
        }
        if (!strcmp(a, "--profile-ops")) {
            o.profile_ops = true;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) usage();
        if (!strcmp(a, "--preset")) o.preset = v;
        else if (!strcmp(a, "--model")) o.model = v;
        else if (!strcmp(a, "--threads")) o.threads = atoi(v);
        else if (!strcmp(a, "--prompt")) o.prompt_len = atoi(v);
        else if (!strcmp(a, "--gen")) o.gen = atoi(v);
        else if (!strcmp(a, "--quantization")) o.quantization = v;
        else if (!strcmp(a, "--device")) o.device = v;
        else if (!strcmp(a, "--cpu-kernels")) o.cpu_kernels = v;
        else if (!strcmp(a, "--kv-cache-dtype")) o.kv_dtype = v;
        else if (!strcmp(a, "--repeat")) o.repeat = atoi(v);
        else if (!strcmp(a, "--prefill")) {
            o.n_prefill = 0;
            for (char *q = (char *)v; *q && o.n_prefill < 4; q++) {
                o.prefill[o.n_prefill++] = (int)strtol(q, &q, 10);
                if (*q != ',') break;
            }
        } else if (!strcmp(a, "--numerics")) {
            o.numerics_auto = !strcmp(v, "auto");
            if (!o.numerics_auto && rs_numerics_parse(v, &o.numerics) != RS_OK) usage();
        } else if (!strcmp(a, "--graphs")) {
            if (strcmp(v, "on") && strcmp(v, "off")) usage();
            o.graphs = !strcmp(v, "on");
        } else if (!strcmp(a, "--batches")) {
            o.n_batches = 0;
            for (char *s = (char *)v; *s && o.n_batches < 8 && strcmp(v, "0") != 0; s++) {
                o.batches[o.n_batches++] = (int)strtol(s, &s, 10);
                if (*s != ',') break;
            }
        } else usage();
        i++;
    }
    if (o.profile_ops) o.graphs = false; /* a replayed graph calls no ops */
    if (o.gen < 2 || o.prompt_len < 1 || o.n_batches + o.n_prefill < 1 || o.repeat < 1 || o.repeat > 16) usage();
    for (int i = 0; i < o.n_batches; i++)
        if (o.batches[i] < 1) usage();
    for (int i = 0; i < o.n_prefill; i++)
        if (o.prefill[i] < 1) usage();
    if (strcmp(o.kv_dtype, "f32") != 0 && strcmp(o.kv_dtype, "bf16") != 0 && strcmp(o.kv_dtype, "fp8") != 0) usage();
    if (strcmp(o.device, "cpu") != 0 && strcmp(o.device, "cuda") != 0) usage();
    /* the policies to run, in order */
    rs_quant_policy policies[2];
    int n_policies = 0;
    bool both = strcmp(o.quantization, "both") == 0;
    const char *modes[2] = {both ? "bf16" : o.quantization, "fp8"};
    for (int i = 0; i < (both ? 2 : 1); i++) {
        rs_error err = {0};
        if (rs_quant_policy_init(&policies[n_policies], modes[i], "", 0, 0, &err) != RS_OK) usage();
        policies[n_policies++].quantize_lm_head = head;
    }
    if (o.threads <= 0) o.threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    rs_log_min_level = RS_LOG_LEVEL_WARN;

    double bw[2] = {0, 0}; /* copy, read; 0 when not measured */
    if (!bandwidth) {
        if (strcmp(o.device, "cpu") == 0) {
            rs_backend *b = make_backend(&o);
            char line[256];
            printf("%s (--cpu-kernels %s)\n", rs_backend_cpu_describe(b, line, sizeof line), o.cpu_kernels);
            rs_backend_free(b);
        }
    } else if (strcmp(o.device, "cuda") == 0) {
        bw[0] = bw[1] = device_copy_gbs(&o);
        printf("memory: device-to-device copy %.1f GB/s (read + write; the GPU's bandwidth, both columns below)\n",
               bw[0]);
    } else {
        bw[0] = stream_copy_gbs();
        bw[1] = stream_read_gbs(o.threads);
        printf("memory: STREAM-like copy %.1f GB/s (read + write, 1 thread; %.1f with the CPU backend's "
               "streaming-store upload), read %.1f GB/s (%d threads, weight-like memory)\n",
               bw[0], upload_copy_gbs(), bw[1], o.threads);
        rs_backend *b = make_backend(&o);
        char line[256];
        printf("%s (--cpu-kernels %s)\n", rs_backend_cpu_describe(b, line, sizeof line), o.cpu_kernels);
        rs_backend_free(b);
    }
    printf("workload: greedy, prompt %d tokens, %d new tokens; decode tokens/s = B*(gen-1)/(t_gen - t_1); "
           "KV cache %s\n",
           o.prompt_len, o.gen, o.kv_dtype);
    char dir[4096];
    /* "all" is the two small presets; any other preset name (qwen3-8b: 16 GB) runs alone */
    const char *all[] = {"default", "qwen3-0.6b"};
    const bool every = !strcmp(o.preset, "all");
    if (!every) all[0] = o.preset;
    const size_t n_all = every ? RS_ARRAY_LEN(all) : 1;
    for (size_t i = 0; i < n_all + 1; i++) {
        const char *label = i < n_all ? all[i] : o.model;
        if (o.model ? i < n_all : i == n_all) continue;
        const char *path = o.model ? o.model : ensure_preset(label, dir, sizeof dir);
        double tps[2][8];
        for (int q = 0; q < n_policies; q++) bench_model(label, path, &o, &policies[q], bw, tps[q]);
        if (n_policies == 2) {
            printf("  fp8 vs bf16 decode tokens/s:");
            for (int b = 0; b < o.n_batches; b++) printf("  batch %d %.2fx", o.batches[b], tps[1][b] / tps[0][b]);
            printf("\n");
        }
    }
    return 0;
}
