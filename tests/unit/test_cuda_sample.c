/*
 * test_cuda_sample.c — sampling on the device (kernels/cuda/cuda_sample.cu) against the CPU
 * sampler (scheduler/sampler.c) on the same logits: token, logprob (each logprobs mode, as the
 * engine's logprob_in_mode takes it) and top logprobs bit for bit, for greedy, temperature, top-k,
 * top-p, min-p and their combinations, seeded draws over many (seed, sample index, position)
 * keys, peaked and flat rows, tied logits, masked (-inf) tokens, a temperature below
 * RS_SAMPLING_EPS (greedy) and vocabularies that are not multiples of the block; a row with a NaN
 * or a +inf is refused (token -1) on both.
 * Requests whose kept prefix is longer than the device sorts come back undone; every other one
 * must be done. Exact numerics (the CPU's sequential draw) and fast numerics (chunked draw sums:
 * the same token unless u falls within rounding of a boundary, never seen here). Fast numerics run
 * the requests that need no sorted order over parts of the row (rescaled part sums): the same
 * tokens, logprobs within a few fp32 ulps, on vocabularies of one part to twenty. And through the
 * engine (scheduler/engine.c's device-sampling hook): a seeded mix of jobs gives the same outputs
 * with device sampling as with every row sampled on the host from the same logits, including jobs
 * whose rows the logits-processing step changes (penalties, min_new_tokens), which stay on the host.
 */
#ifdef RS_CUDA
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "../../model/model.h"
#include "../../model/quant.h"
#include "../../scheduler/engine.h"
#include "../../scheduler/sampler.h"
#include "test.h"
#include "test_util.h"

/* The engine's logprob and top logprobs for a sampled token (scheduler/engine.c logprob_in_mode). */
static float host_logprob(const float *logits, int V, const rs_sampling_params *sp, rs_logprobs_mode mode, int32_t tok,
                          const rs_sample_info *info, int k, rs_sampler_scratch *scr, int32_t *ids, float *lps, int *n_top) {
    rs_sampling_params raw = *sp;
    raw.temperature = 0.0f;
    float lp = mode == RS_LOGPROBS_RAW ? rs_logprob_of(logits, V, 0.0f, tok, scr)
               : mode == RS_LOGPROBS_PROCESSED ? info->logprob_processed
                                               : info->logprob;
    *n_top = k > 0 ? rs_top_logprobs(logits, V, mode == RS_LOGPROBS_RAW ? &raw : sp, mode == RS_LOGPROBS_PROCESSED, k,
                                     scr, ids, lps)
                   : 0;
    return lp;
}

/* Whether fast numerics sample request r over parts of the row (kernels/cuda/cuda_sample.cu): no
 * truncation, and no top logprobs unless greedy's point mass (processed) answers them. */
static bool over_parts(rs_numerics numerics, const rs_sample_req *r, int V) {
    const bool greedy = !(r->temperature > 0.0f);
    const bool trunc = (r->top_k > 0 && r->top_k < V) || r->top_p < 1.0f || r->min_p > 0.0f;
    return numerics == RS_NUMERICS_FAST && (greedy || !trunc) &&
           (r->n_top == 0 || (greedy && r->lp_mode == RS_SAMPLE_LP_PROCESSED));
}

/* The parts' rescaled sums against the CPU's 16 lanes: the log of the sum moves by a few ulps of
 * the double, the logprob by its own fp32 rounding on top (its ulp is 2^-23 relative). */
static bool lp_close(float dev, float host) {
    return fabsf(dev - host) <= 1e-6f + 4e-7f * fabsf(host);
}

/* parts_only: only requests that fast numerics run over parts (no truncation, no top logprobs),
 * for vocabularies too large to push the single-block kernel's sorts through the emulation. */
static void check_rows(rs_backend *g, rs_numerics numerics, const float *logits, int rows, int V, bool parts_only,
                       uint64_t *s) {
    ASSERT_EQ(rs_backend_set_numerics(g, numerics), numerics);
    float *dl = rs_test_to_backend(g, logits, (size_t)rows * V * sizeof(float));
    static const float temps[] = {0.0f, 1e-7f, 0.7f, 1.0f, 1.3f}; /* 1e-7: greedy (below RS_SAMPLING_EPS) */
    static const int top_ks[] = {-1, 1, 5, 40, 100};
    static const float top_ps[] = {1.0f, 0.9f, 0.5f};
    static const float min_ps[] = {0.0f, 0.05f};
    enum { N = 96 };
    rs_sample_req req[N];
    rs_sampling_params sp[N];
    rs_logprobs_mode mode[N];
    rs_sample_res *res = malloc(sizeof(rs_sample_res) * N);
    rs_sampler_scratch scr = {0};
    int done = 0, undone_ok = 0, invalid = 0, parts = 0;
    for (int rep = 0; rep < 6; rep++) {
        for (int i = 0; i < N; i++) {
            rs_sampling_params_default(&sp[i]);
            sp[i].temperature = temps[rs_test_rng(s) % 5];
            const int shape = parts_only ? 0 : (int)(rs_test_rng(s) % 4); /* plain, top-k, top-p, mixed */
            if (shape == 1 || shape == 3) sp[i].top_k = top_ks[rs_test_rng(s) % 5];
            if (shape == 2 || shape == 3) sp[i].top_p = top_ps[rs_test_rng(s) % 3];
            if (shape == 3) sp[i].min_p = min_ps[rs_test_rng(s) % 2];
            sp[i].seed = rs_test_rng(s);
            mode[i] = (rs_logprobs_mode)(rs_test_rng(s) % 3);
            req[i] = (rs_sample_req){.row = (int)(rs_test_rng(s) % (uint64_t)rows),
                                     .temperature = rs_sampling_greedy(&sp[i]) ? 0.0f : sp[i].temperature, /* as the engine */
                                     .top_p = sp[i].top_p, .min_p = sp[i].min_p, .top_k = sp[i].top_k,
                                     .seed = sp[i].seed, .sample_index = rs_test_rng(s) % 16,
                                     .position = rs_test_rng(s) % 5000,
                                     .lp_mode = mode[i] == RS_LOGPROBS_RAW ? RS_SAMPLE_LP_RAW
                                                : mode[i] == RS_LOGPROBS_PROCESSED ? RS_SAMPLE_LP_PROCESSED
                                                                                   : RS_SAMPLE_LP_DEFAULT,
                                     .n_top = (int)(rs_test_rng(s) % 3) * 10};
            if (parts_only && !over_parts(numerics, &req[i], V)) req[i].n_top = 0;
        }
        rs_backend_sample(g, dl, V, req, N, res);
        for (int i = 0; i < N; i++) {
            const float *x = logits + (size_t)req[i].row * V;
            rs_sample_info info;
            const int32_t tok = rs_sample(x, V, &sp[i], req[i].sample_index, req[i].position, &scr, &info);
            if (tok < 0) { /* an invalid row: done, token -1, as the host's */
                if (!res[i].done || res[i].token != -1)
                    RS_TEST_FAIL("request %d on invalid row %d: done %d token %d", i, req[i].row, (int)res[i].done,
                                 res[i].token);
                invalid++;
                continue;
            }
            int32_t ids[RS_SAMPLE_MAX_TOP];
            float lps[RS_SAMPLE_MAX_TOP];
            int n_top;
            const float lp = host_logprob(x, V, &sp[i], mode[i], tok, &info, req[i].n_top, &scr, ids, lps, &n_top);
            const bool simple = !((sp[i].top_k > 0 && sp[i].top_k < V) || sp[i].top_p < 1.0f || sp[i].min_p > 0.0f) ||
                                (sp[i].top_k > 0 && sp[i].top_k <= RS_SAMPLE_MAX_TOP);
            if (!res[i].done) {
                if (simple)
                    RS_TEST_FAIL("request %d (T %g top_k %d top_p %g min_p %g) left undone", i, sp[i].temperature,
                                 sp[i].top_k, sp[i].top_p, sp[i].min_p);
                undone_ok++;
                continue;
            }
            done++;
            const bool by_parts = over_parts(numerics, &req[i], V);
            parts += by_parts;
            if (res[i].token != tok || (by_parts ? !lp_close(res[i].logprob, lp)
                                                 : rs_test_f32_bits(res[i].logprob) != rs_test_f32_bits(lp)))
                RS_TEST_FAIL("%s request %d (T %g top_k %d top_p %g min_p %g mode %d, row %d): device token %d lp %a, "
                             "host %d %a",
                             rs_numerics_name(numerics), i, sp[i].temperature, sp[i].top_k, sp[i].top_p, sp[i].min_p,
                             (int)mode[i], req[i].row, res[i].token, res[i].logprob, tok, lp);
            ASSERT_EQ(res[i].n_top, n_top);
            for (int j = 0; j < n_top; j++)
                if (res[i].top_ids[j] != ids[j] || rs_test_f32_bits(res[i].top_lps[j]) != rs_test_f32_bits(lps[j]))
                    RS_TEST_FAIL("request %d top %d: device %d %a, host %d %a", i, j, res[i].top_ids[j],
                                 res[i].top_lps[j], ids[j], lps[j]);
        }
    }
    ASSERT_TRUE(done > 0 && invalid > 0);
    if (numerics == RS_NUMERICS_FAST) ASSERT_TRUE(parts > 0);
    fprintf(stderr,
            "  %s vocab %d: %d done (%d over parts), %d left to the host (kept prefix > %d), %d invalid rows refused\n",
            rs_numerics_name(numerics), V, done, parts, undone_ok, RS_SAMPLE_MAX_TOP, invalid);
    rs_sampler_scratch_free(&scr);
    free(res);
    rs_backend_free_mem(g, dl);
}

/* ---- through the engine ---- */

uint64_t rs_cuda_test_sampled(const rs_backend *b); /* kernels/cuda/cuda_sample.cu */

/* Runs a fixed mix of seeded jobs on the fixture qwen3 (CUDA backend, exact numerics) with device
 * sampling on or off and returns the jobs: n = 2 groups (their first token samples on the host,
 * where the group fans out), top logprobs, every logprobs mode, top-p / min-p truncation short
 * enough for the device, top-k long enough for the host, and a job with penalties and
 * min_new_tokens (its rows are processed on the host). */
enum { NJOBS = 5 };
static void engine_jobs(bool device, rs_gen_job **jobs) {
    rs_backend *g = rs_test_cuda_or_skip();
    rs_backend_cuda_set_device_sampling(g, device);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/models/qwen3", rs_test_fixtures_dir());
    rs_error err = {0};
    rs_quant_policy qp;
    ASSERT_EQ(rs_quant_policy_init(&qp, "bf16", "", 0, 0, &err), RS_OK);
    rs_model *m = NULL;
    if (rs_model_load(dir, g, &qp, &m, &err) != RS_OK) RS_TEST_FAIL("load: %s", err.message);
    rs_engine_opts o = {.kv_cache_bytes = 4 << 20, .max_running = 8, .max_step_tokens = 64, .prefix_cache = true,
                        .admission_new_token_ratio = 0.4f,
                        .limits = {.max_context = 128, .max_new_tokens = 16, .max_n = 4, .max_batch = 16,
                                   .max_top_logprobs = 8}};
    rs_engine *e = NULL;
    if (rs_engine_init(&e, m, &o, &err) != RS_OK) RS_TEST_FAIL("engine: %s", err.message);
    for (int j = 0; j < NJOBS; j++) {
        rs_gen_job *job = rs_gen_job_new();
        job->n_prompts = 1;
        job->prompts = calloc(1, sizeof(int32_t *));
        job->prompt_lens = calloc(1, sizeof(int));
        job->prompt_lens[0] = 5 + 3 * j;
        job->prompts[0] = malloc(sizeof(int32_t) * (size_t)job->prompt_lens[0]);
        for (int i = 0; i < job->prompt_lens[0]; i++) job->prompts[0][i] = (int32_t)((i * 37 + j * 11 + 3) % 512);
        job->sp.ignore_eos = true;
        job->sp.max_new_tokens = 12;
        job->sp.seed = 1000 + (uint64_t)j;
        job->sp.temperature = j == 3 ? 0.0f : 0.9f;
        job->sp.n = j == 0 ? 2 : 1;
        job->return_logprob = true;
        job->top_logprobs_num = 3;
        job->logprobs_mode = (rs_logprobs_mode)(j % 3);
        if (j == 1) job->sp.top_p = 0.8f, job->sp.min_p = 0.05f;
        if (j == 2) job->sp.top_k = 200; /* a kept prefix past the device's: the host samples it */
        if (j == 4) job->sp.repetition_penalty = 1.3f, job->sp.presence_penalty = 0.5f, job->sp.min_new_tokens = 6;
        rs_gen_invalid why;
        ASSERT_EQ(rs_gen_job_validate(job, &m->cfg, rs_engine_get_limits(e), &why), RS_OK);
        ASSERT_EQ(rs_engine_submit(e, job, &err), RS_OK);
        jobs[j] = job;
    }
    rs_engine_run_until_idle(e);
    if (device && rs_cuda_test_sampled(g) < 30) RS_TEST_FAIL("the engine sampled only %llu tokens on the device",
                                                              (unsigned long long)rs_cuda_test_sampled(g));
    rs_engine_free(e);
    rs_model_free(m);
    rs_backend_free(g);
}

/* The engine's outputs with device sampling equal those it makes sampling every row on the host
 * from the same (downloaded) logits: tokens, logprobs and top logprobs, bit for bit. */
RS_TEST(cuda_engine_device_sampling_matches_host) {
    rs_gen_job *dev[NJOBS], *host[NJOBS];
    engine_jobs(true, dev);
    engine_jobs(false, host);
    for (int j = 0; j < NJOBS; j++)
        for (int k = 0; k < dev[j]->sp.n; k++) {
            const rs_gen_output *a = &dev[j]->outputs[k], *b = &host[j]->outputs[k];
            ASSERT_EQ(a->n_output, b->n_output);
            ASSERT_EQ(a->n_output, 12);
            for (int i = 0; i < a->n_output; i++) {
                if (a->output_ids[i] != b->output_ids[i] ||
                    rs_test_f32_bits(a->output_logprobs[i]) != rs_test_f32_bits(b->output_logprobs[i]))
                    RS_TEST_FAIL("job %d sample %d token %d: device %d %a, host %d %a", j, k, i, a->output_ids[i],
                                 a->output_logprobs[i], b->output_ids[i], b->output_logprobs[i]);
                for (int t = 0; t < 3; t++) {
                    const size_t at = (size_t)i * 3 + t;
                    ASSERT_EQ(a->output_top_ids[at], b->output_top_ids[at]);
                    ASSERT_EQ(rs_test_f32_bits(a->output_top_lps[at]), rs_test_f32_bits(b->output_top_lps[at]));
                }
            }
        }
    for (int j = 0; j < NJOBS; j++) rs_gen_job_free(dev[j]), rs_gen_job_free(host[j]);
}

RS_TEST(cuda_sample_matches_cpu_sampler) {
    rs_backend *g = rs_test_cuda_or_skip();
    uint64_t s = 151;
    /* 9001: three tiles of the ordered sums, five parts; 40000: twenty parts, the last ragged (fast
     * numerics' part requests only) */
    static const int vocabs[] = {512, 3001, 9001, 40000};
    for (size_t vi = 0; vi < RS_ARRAY_LEN(vocabs); vi++) {
        const int V = vocabs[vi], rows = 9;
        const bool big = V > 10000;
        float *l = malloc((size_t)rows * V * sizeof(float));
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < V; i++) {
                float v = rs_test_uniform(&s);
                if (r == 1) v *= 12.0f;                            /* peaked */
                if (r == 2) v = (float)((i * 7) % 5);              /* ties everywhere */
                if (r == 3) v = i == V / 2 ? 30.0f : v;            /* one dominant token */
                if (r == 4) v = 0.01f * v;                         /* nearly flat */
                if (r == 5) v = v * 3.0f + (i % 97 == 0 ? 6.0f : 0.0f);
                if (r == 6) v = i % 5 == 0 ? -INFINITY : v * 4.0f;    /* masked tokens: -inf, valid */
                if (r == 7 && i == V / 3) v = NAN;                 /* invalid rows */
                if (r == 8 && i == V - 2) v = INFINITY;
                l[(size_t)r * V + i] = v;
            }
        if (!big) check_rows(g, RS_NUMERICS_EXACT, l, rows, V, false, &s);
        check_rows(g, RS_NUMERICS_FAST, l, rows, V, big, &s);
        free(l);
    }
    rs_backend_free(g);
}
#endif
