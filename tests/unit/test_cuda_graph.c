/*
 * test_cuda_graph.c — step graphs (kernels/cuda/cuda_graph.cu, model/forward.c): decode steps of a
 * fixture model recorded and replayed give the logits of the same steps run op by op, bit for bit
 * (both numerics: padding rows change nothing, and decode sizes stay on per-row kernels), through
 * new batch sizes, a weight commit that moves a tensor (a stale recording would read the old one),
 * and scratch buffers that move, as growth moves them (a stale recording would read freed memory,
 * which the emulation refuses); fast numerics also with the tensor-core GEMVs launched as
 * programmatic dependents (PDL), whose capture a GPU checks; fast numerics also with decode
 * attention over pages that forked sequences share. And CUDA's capture rules as the backend relies on them: a copy
 * from pageable memory or an allocation invalidates a capture, a pinned copy replays fresh data.
 */
#ifdef RS_CUDA
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/rs.h"
#include "../../kernels/backend.h"
#include "../../kvcache/kvcache.h"
#include "../../model/model.h"
#include "../../model/quant.h"
#include "test.h"
#include "test_util.h"

enum { MAXS = 6, MAXT = 96 };

void rs_cuda_test_move_buffers(rs_backend *b); /* kernels/cuda/backend_cuda.cu */
unsigned long long rs_cuda_test_attention_shared_runs(rs_backend *b); /* kernels/cuda/cuda_attention.cu */

typedef struct dec {
    rs_backend *b;
    rs_model *m;
    rs_kv_pool p;
    rs_kv_seq s[MAXS];
    int len[MAXS];
    rs_forward_ctx *f;
} dec;

static void dec_open(dec *d, rs_backend *b, const char *model, const char *quant) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/models/%s", rs_test_fixtures_dir(), model);
    rs_error err = {0};
    rs_quant_policy qp;
    ASSERT_EQ(rs_quant_policy_init(&qp, quant, "", 0, 0, &err), RS_OK);
    memset(d, 0, sizeof *d);
    d->b = b;
    if (rs_model_load(dir, b, &qp, &d->m, &err) != RS_OK) RS_TEST_FAIL("load %s: %s", dir, err.message);
    const rs_model_config *c = &d->m->cfg;
    const rs_kv_cache_opts ko = {RS_DTYPE_BF16, RS_KV_SCALE_NONE};
    ASSERT_EQ(rs_kv_pool_init_ex(&d->p, b, c->n_layers, c->n_kv_heads, c->head_dim, &ko, 4 << 20), RS_OK);
    d->f = rs_forward_ctx_init(d->m, MAXT, MAXS);
    ASSERT_TRUE(d->f != NULL);
}

static void dec_close(dec *d) {
    rs_forward_ctx_free(d->f);
    for (int i = 0; i < MAXS; i++) rs_kv_seq_release(&d->p, &d->s[i]);
    rs_kv_pool_free(&d->p);
    rs_model_free(d->m);
}

/* One step: sequences [0, ns) each advance to new_len[i] (prefill rows when more than one), token
 * of position q of sequence i a fixed function of (i, q); logits of each sequence's last row. */
static void dec_step(dec *d, int ns, const int *new_len, float *logits) {
    const int V = d->m->cfg.vocab_size, mb = 8;
    int32_t tok[MAXT], pos[MAXT], slot[MAXT], start[MAXS + 1], ctx[MAXS], rows[MAXS], tables[MAXS * 8];
    int n = 0;
    memset(tables, 0, sizeof tables);
    for (int i = 0; i < ns; i++) {
        ASSERT_EQ(rs_kv_seq_reserve(&d->p, &d->s[i], new_len[i]), RS_OK);
        ASSERT_TRUE(d->s[i].n_blocks <= mb);
        start[i] = n;
        for (int q = d->len[i]; q < new_len[i]; q++) {
            ASSERT_EQ(rs_kv_seq_prepare_write(&d->p, &d->s[i], q), RS_OK); /* a forked page is copied first */
            tok[n] = (int32_t)((q * 131 + i * 17 + 5) % V), pos[n] = q, slot[n] = rs_kv_slot(&d->s[i], q);
            n++;
        }
        ctx[i] = new_len[i], rows[i] = n - 1, d->len[i] = new_len[i];
        memcpy(tables + i * mb, d->s[i].blocks, sizeof(int32_t) * (size_t)d->s[i].n_blocks);
    }
    start[ns] = n;
    rs_batch bt = {.n_tok = n, .n_seq = ns, .tokens = tok, .pos = pos, .slot = slot, .seq_start = start,
                   .seq_ctx = ctx, .block_tables = tables, .max_blocks = mb};
    rs_forward(d->f, &bt, d->p.layers, rows, ns, logits);
}

/* Both runs take the same step; their logits must be the same bits. */
static void both_step(dec *g, dec *e, int ns, const int *new_len, const char *what) {
    const int V = g->m->cfg.vocab_size;
    float *lg = malloc(sizeof(float) * MAXS * (size_t)V), *le = malloc(sizeof(float) * MAXS * (size_t)V);
    dec_step(g, ns, new_len, lg);
    dec_step(e, ns, new_len, le);
    for (size_t i = 0; i < (size_t)ns * V; i++)
        if (rs_test_f32_bits(lg[i]) != rs_test_f32_bits(le[i]))
            RS_TEST_FAIL("%s: seq %zu logit %zu: graphed %a, op by op %a", what, i / V, i % V, lg[i], le[i]);
    free(lg), free(le);
}

/* A copy of weight t in new device memory, times `scale` (BF16): a commit that moves the tensor. */
static void move_weight(rs_backend *b, rs_tensor *t, float scale) {
    ASSERT_EQ(t->dtype, RS_DTYPE_BF16);
    const size_t n = (size_t)rs_tensor_numel(t);
    uint16_t *h = rs_test_to_host(b, t->data, n * 2);
    for (size_t i = 0; i < n; i++) h[i] = rs_f32_to_bf16(rs_bf16_to_f32(h[i]) * scale);
    t->data = rs_test_to_backend(b, h, n * 2); /* the old allocation stays (the store owns it) */
    free(h);
}

static void graph_case(rs_numerics numerics, bool pdl) {
    rs_backend *g = rs_test_cuda_or_skip(), *e = rs_test_cuda_or_skip();
    rs_backend_cuda_set_graphs(e, false);
    rs_backend_cuda_set_pdl(g, pdl), rs_backend_cuda_set_pdl(e, pdl);
    ASSERT_EQ(rs_backend_set_numerics(g, numerics), numerics);
    ASSERT_EQ(rs_backend_set_numerics(e, numerics), numerics);
    dec dg, de;
    dec_open(&dg, g, "qwen3", "bf16");
    dec_open(&de, e, "qwen3", "bf16");
    int len[MAXS] = {6, 9, 3, 0, 0, 0};
    both_step(&dg, &de, 3, len, "prefill");
    for (int st = 0; st < 4; st++) { /* 3 decode rows -> recordings of 4 rows: warm-up, record, replay x2 */
        for (int i = 0; i < 3; i++) len[i]++;
        both_step(&dg, &de, 3, len, "decode of 3");
    }
    uint64_t rec, rep, refused;
    rs_backend_cuda_graph_stats(g, &rec, &rep, &refused);
    if (rec != 1 || rep != 2 || refused != 0)
        RS_TEST_FAIL("3-row decode: %llu recorded, %llu replayed, %llu refused; want 1, 2, 0", (unsigned long long)rec,
                     (unsigned long long)rep, (unsigned long long)refused);
    /* a fourth and fifth sequence join (prefill), then 5-row decode: a second size, 8 rows */
    for (int i = 0; i < 3; i++) len[i]++; /* decode rows mixed with the newcomers' prefill */
    len[3] = 4, len[4] = 2;
    both_step(&dg, &de, 5, len, "prefill of two more");
    for (int st = 0; st < 3; st++) {
        for (int i = 0; i < 5; i++) len[i]++;
        both_step(&dg, &de, 5, len, "decode of 5");
    }
    /* a commit moves wo of layer 1 (new values, new address) in both: the 8-row recording must go */
    void *g_wo = dg.m->layers[1].wo.data, *e_wo = de.m->layers[1].wo.data;
    move_weight(g, &dg.m->layers[1].wo, 0.5f);
    move_weight(e, &de.m->layers[1].wo, 0.5f);
    for (int st = 0; st < 3; st++) {
        for (int i = 0; i < 5; i++) len[i]++;
        both_step(&dg, &de, 5, len, "decode of 5 after a commit");
    }
    /* the scratch moves (as a long prefill makes it grow): every recording points at freed buffers
     * and must go */
    for (int i = 0; i < 5; i++) len[i]++;
    len[5] = 60;
    both_step(&dg, &de, 6, len, "long prefill");
    for (int st = 0; st < 3; st++) {
        for (int i = 0; i < 6; i++) len[i]++;
        both_step(&dg, &de, 6, len, "decode of 6");
    }
    rs_cuda_test_move_buffers(g);
    for (int st = 0; st < 3; st++) {
        for (int i = 0; i < 6; i++) len[i]++;
        both_step(&dg, &de, 6, len, "decode of 6 after the scratch moved");
    }
    rs_backend_cuda_graph_stats(g, &rec, &rep, &refused);
    /* recordings: 4 rows; 5 rows (the context's 6-row limit keeps 5 unpadded), again after the
     * commit; 6 rows, again after the move */
    if (rec != 5 || rep != 6 || refused != 0)
        RS_TEST_FAIL("%llu recorded, %llu replayed, %llu refused", (unsigned long long)rec, (unsigned long long)rep,
                     (unsigned long long)refused);
    rs_backend_free_mem(g, dg.m->layers[1].wo.data), rs_backend_free_mem(e, de.m->layers[1].wo.data);
    dg.m->layers[1].wo.data = g_wo, de.m->layers[1].wo.data = e_wo; /* the store's, which it frees */
    dec_close(&dg), dec_close(&de);
    rs_backend_free(g), rs_backend_free(e);
}

RS_TEST(cuda_graph_decode_matches_op_by_op_exact) { graph_case(RS_NUMERICS_EXACT, false); }
RS_TEST(cuda_graph_decode_matches_op_by_op_fast) { graph_case(RS_NUMERICS_FAST, false); }
/* the tensor-core GEMVs as programmatic dependents (PDL), recorded and replayed */
RS_TEST(cuda_graph_decode_matches_op_by_op_fast_pdl) { graph_case(RS_NUMERICS_FAST, true); }

/* Decode attention over shared pages (rs_backend_cuda_set_attention_shared): a prompt forked into
 * four sequences, decoded as a recorded step (units of the four rows, computed on the device from
 * the step's tables), then two forks end and two unrelated sequences take their places, and the
 * same recording replays with units of two: the logits of every step are those of the same steps
 * op by op, bit for bit. */
RS_TEST(cuda_graph_decode_shared_pages) {
    rs_backend *g = rs_test_cuda_or_skip(), *e = rs_test_cuda_or_skip();
    rs_backend_cuda_set_graphs(e, false);
    rs_backend *both[2] = {g, e};
    for (int i = 0; i < 2; i++) {
        ASSERT_EQ(rs_backend_set_numerics(both[i], RS_NUMERICS_FAST), RS_NUMERICS_FAST);
        rs_backend_cuda_set_attention_shared(both[i], true);
    }
    dec dg, de;
    dec_open(&dg, g, "qwen3", "bf16");
    dec_open(&de, e, "qwen3", "bf16");
    /* the prompt (sequence 0) and two unrelated sequences beside it, which then move to 4 and 5 and
     * join the decode later; sequences 1..3 are the prompt's forks */
    dec *d2[2] = {&dg, &de};
    int len[MAXS] = {40, 20, 33, 0, 0, 0};
    both_step(&dg, &de, 3, len, "prompt beside two others");
    for (int k = 0; k < 2; k++) {
        d2[k]->s[4] = d2[k]->s[1], d2[k]->s[5] = d2[k]->s[2], d2[k]->len[4] = 20, d2[k]->len[5] = 33;
        memset(&d2[k]->s[1], 0, sizeof d2[k]->s[1]), memset(&d2[k]->s[2], 0, sizeof d2[k]->s[2]);
        d2[k]->len[1] = d2[k]->len[2] = 0;
    }
    for (int k = 0; k < 2; k++)
        for (int i = 1; i < 4; i++) rs_kv_seq_fork(&d2[k]->p, &d2[k]->s[0], &d2[k]->s[i]), d2[k]->len[i] = 40;
    for (int i = 1; i < 4; i++) len[i] = 40;
    const unsigned long long runs0 = rs_cuda_test_attention_shared_runs(g);
    for (int st = 0; st < 4; st++) { /* warm-up, record, replay x2 */
        for (int i = 0; i < 4; i++) len[i]++;
        both_step(&dg, &de, 4, len, "decode of 4 forks");
    }
    /* forks 2 and 3 end; sequences 4 and 5 take their rows: the recording replays with units of 2 */
    for (int k = 0; k < 2; k++) {
        for (int i = 2; i < 4; i++) rs_kv_seq_release(&d2[k]->p, &d2[k]->s[i]);
        d2[k]->s[2] = d2[k]->s[4], d2[k]->s[3] = d2[k]->s[5], d2[k]->len[2] = 20, d2[k]->len[3] = 33;
        memset(&d2[k]->s[4], 0, sizeof d2[k]->s[4]), memset(&d2[k]->s[5], 0, sizeof d2[k]->s[5]);
        d2[k]->len[4] = d2[k]->len[5] = 0;
    }
    len[2] = 20, len[3] = 33, len[4] = len[5] = 0;
    for (int st = 0; st < 3; st++) {
        for (int i = 0; i < 4; i++) len[i]++;
        both_step(&dg, &de, 4, len, "decode of 2 forks and 2 others");
    }
    uint64_t rec, rep, refused;
    rs_backend_cuda_graph_stats(g, &rec, &rep, &refused);
    if (rec != 1 || rep != 5 || refused != 0)
        RS_TEST_FAIL("%llu recorded, %llu replayed, %llu refused; want 1, 5, 0", (unsigned long long)rec,
                     (unsigned long long)rep, (unsigned long long)refused);
    if (rs_cuda_test_attention_shared_runs(g) == runs0) RS_TEST_FAIL("the shared-page kernel never ran");
    dec_close(&dg), dec_close(&de);
    rs_backend_free(g), rs_backend_free(e);
}

/* Weight staging runs on a thread of its own beside the engine: its allocations, uploads, copies,
 * downloads and frees must not land inside a step graph's recording (global-mode capture refuses
 * them, or records them into the graph). A thread doing them without pause while decode steps record
 * and replay: every recording is kept (none refused), the graphed logits match op by op bit for bit,
 * and every round trip of the staging thread reads back what it wrote. */
typedef struct stager {
    rs_backend *b;
    _Atomic int stop;
    _Atomic int rounds, bad;
} stager;

static void *stager_main(void *arg) {
    stager *st = arg;
    uint8_t buf[4096], back[64];
    while (!st->stop) {
        memset(buf, (int)(st->rounds & 0x7f) + 1, sizeof buf);
        void *p = rs_backend_alloc(st->b, sizeof buf), *q = rs_backend_alloc(st->b, sizeof buf);
        if (!p || !q) {
            st->bad = 1;
            return NULL;
        }
        rs_backend_upload(st->b, p, buf, sizeof buf);
        rs_backend_copy(st->b, q, p, sizeof buf);
        rs_backend_download(st->b, back, q, sizeof back);
        if (memcmp(back, buf, sizeof back) != 0) st->bad = 1;
        rs_backend_free_mem(st->b, p), rs_backend_free_mem(st->b, q);
        st->rounds++;
    }
    return NULL;
}

RS_TEST(cuda_graph_recording_beside_weight_staging) {
    rs_backend *g = rs_test_cuda_or_skip(), *e = rs_test_cuda_or_skip();
    rs_backend_set_numerics(g, RS_NUMERICS_FAST), rs_backend_set_numerics(e, RS_NUMERICS_FAST);
    rs_backend_cuda_set_graphs(e, false);
    dec dg, de;
    dec_open(&dg, g, "qwen3", "bf16");
    dec_open(&de, e, "qwen3", "bf16");
    stager st = {.b = g};
    pthread_t th;
    ASSERT_EQ(pthread_create(&th, NULL, stager_main, &st), 0);
    int len[MAXS] = {3, 2, 4};
    both_step(&dg, &de, 3, len, "prefill beside staging");
    for (int s = 0; s < 12; s++) {
        for (int i = 0; i < 3; i++) len[i]++;
        both_step(&dg, &de, 3, len, "decode beside staging");
    }
    st.stop = 1;
    ASSERT_EQ(pthread_join(th, NULL), 0);
    uint64_t rec, rep, refused;
    rs_backend_cuda_graph_stats(g, &rec, &rep, &refused);
    if (rec != 1 || rep < 10 || refused != 0)
        RS_TEST_FAIL("%llu recorded, %llu replayed, %llu refused", (unsigned long long)rec, (unsigned long long)rep,
                     (unsigned long long)refused);
    ASSERT_TRUE(st.rounds > 0 && !st.bad);
    dec_close(&dg), dec_close(&de);
    rs_backend_free(g), rs_backend_free(e);
}

/* MoE decode steps: exact numerics route on the host, so the recording is refused once and the
 * size runs op by op from then on; fast numerics keep decode-sized MoE blocks on the device, so they
 * record and replay, matching op by op bit for bit. */
RS_TEST(cuda_graph_moe) {
    for (int fast = 0; fast < 2; fast++) {
        rs_backend *g = rs_test_cuda_or_skip(), *e = rs_test_cuda_or_skip();
        const rs_numerics nu = fast ? RS_NUMERICS_FAST : RS_NUMERICS_EXACT;
        rs_backend_set_numerics(g, nu), rs_backend_set_numerics(e, nu);
        rs_backend_cuda_set_graphs(e, false);
        dec dg, de;
        dec_open(&dg, g, "qwen3_moe", fast ? "fp8" : "bf16");
        dec_open(&de, e, "qwen3_moe", fast ? "fp8" : "bf16");
        int len[MAXS] = {3, 2};
        both_step(&dg, &de, 2, len, "moe prefill");
        for (int st = 0; st < 4; st++) {
            len[0]++, len[1]++;
            both_step(&dg, &de, 2, len, fast ? "moe decode, fast" : "moe decode, exact");
        }
        uint64_t rec, rep, refused;
        rs_backend_cuda_graph_stats(g, &rec, &rep, &refused);
        if (fast ? (rec != 1 || rep != 2 || refused != 0) : (rec != 0 || rep != 0 || refused != 1))
            RS_TEST_FAIL("%s: %llu recorded, %llu replayed, %llu refused", fast ? "fast" : "exact",
                         (unsigned long long)rec, (unsigned long long)rep, (unsigned long long)refused);
        dec_close(&dg), dec_close(&de);
        rs_backend_free(g), rs_backend_free(e);
    }
}

/* CUDA's capture rules: an allocation during a capture is refused and invalidates it; copies from
 * pinned memory are recorded and read their source at each replay. A copy from pageable host
 * memory is refused by the emulation (and by CUDA before 12.x) and recorded by CUDA 13.0 on an
 * H200; the backend never asks for one while recording (it stages through pinned buffers), so
 * either answer passes, as long as a refusal invalidates the capture. */
RS_TEST(cuda_capture_rules) {
    rs_backend *g = rs_test_cuda_or_skip();
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    int *dev = NULL, *pinned = NULL, pageable[4] = {1, 2, 3, 4}, back[4];
    ASSERT_EQ(cudaMalloc((void **)&dev, sizeof back), cudaSuccess);
    ASSERT_EQ(cudaMallocHost((void **)&pinned, sizeof back), cudaSuccess);
    cudaGraph_t graph = NULL;

    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    if (cudaMemcpyAsync(dev, pageable, sizeof pageable, cudaMemcpyHostToDevice, s) != cudaSuccess)
        ASSERT_TRUE(cudaStreamEndCapture(s, &graph) != cudaSuccess);
    else
        ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();

    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    void *p = NULL;
    ASSERT_TRUE(cudaMalloc(&p, 64) != cudaSuccess);
    ASSERT_TRUE(cudaStreamEndCapture(s, &graph) != cudaSuccess);
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();

    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(dev, pinned, sizeof back, cudaMemcpyHostToDevice, s), cudaSuccess);
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int rep = 0; rep < 2; rep++) {
        for (int i = 0; i < 4; i++) pinned[i] = 10 * rep + i; /* the source as of the replay */
        ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(back, dev, sizeof back, cudaMemcpyDeviceToHost), cudaSuccess);
        for (int i = 0; i < 4; i++) ASSERT_EQ(back[i], 10 * rep + i);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFreeHost(pinned);
    cudaFree(dev);
    cudaStreamDestroy(s);
    rs_backend_free(g);
}

/* The fused MoE's device table of expert pointers (cuda_moe_fast.cu moe_table) across commits that
 * bring a layer's expert pointers back (A, B, A: the weight store's spares make commits alternate
 * between two allocations). Weights A are served at step size 1, B at size 2, then A again at size
 * 1, whose output must be A's, bit for bit:
 *   - refused: size 1 records when A comes back; the table saw the pointers change while
 *     recording (the recording is refused) and must still upload them on the op-by-op rerun;
 *   - replay: size 1 was recorded under A; B's steps rewrote the table; a replay of size 1 would
 *     read B's experts, so the recording must be dropped. */
static rs_tensor moe_bf16(rs_backend *b, int64_t d0, int64_t d1, uint64_t *rng) {
    const size_t n = (size_t)(d0 * d1);
    uint16_t *h = malloc(n * 2);
    for (size_t i = 0; i < n; i++) h[i] = rs_f32_to_bf16(0.2f * rs_test_uniform(rng));
    rs_tensor t = {.dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {d0, d1}, .data = rs_test_to_backend(b, h, n * 2)};
    free(h);
    return t;
}

static void moe_table_case(bool replay) {
    rs_backend *g = rs_test_cuda_or_skip();
    if (!g) return;
    ASSERT_EQ(rs_backend_set_numerics(g, RS_NUMERICS_FAST), RS_NUMERICS_FAST);
    rs_backend_cuda_set_graphs(g, true);
    enum { E = 4, HID = 128, INTER = 128 };
    uint64_t rng = replay ? 77 : 99;
    rs_tensor router = moe_bf16(g, E, HID, &rng), ws[2][3][E], cur[3][E];
    for (int v = 0; v < 2; v++)
        for (int e = 0; e < E; e++)
            ws[v][0][e] = moe_bf16(g, INTER, HID, &rng), ws[v][1][e] = moe_bf16(g, INTER, HID, &rng),
            ws[v][2][e] = moe_bf16(g, HID, INTER, &rng);
    rs_moe_weights w = {.router = &router, .gate = cur[0], .up = cur[1], .down = cur[2], .n_experts = E, .top_k = 2,
                        .norm_topk_prob = true};
    float xh[HID];
    for (int i = 0; i < HID; i++) xh[i] = rs_test_uniform(&rng);
    float *x = rs_test_to_backend(g, xh, sizeof xh), *out = rs_backend_alloc(g, sizeof xh), *ref[2];
    int owner;
    /* one step of `size` on weights v, run as the forward pass runs a step (graph or op by op) */
#define MOE_STEP(v, size)                                                                                       \
    do {                                                                                                     \
        memcpy(cur, ws[v], sizeof cur);                                                                      \
        const rs_graph_state st_ = rs_backend_graph_begin(g, &owner, size, 0xA0 + (size));                    \
        if (st_ != RS_GRAPH_REPLAYED) {                                                                      \
            rs_op_moe(g, out, x, 1, HID, &w);                                                                \
            if (st_ == RS_GRAPH_RECORDING && !rs_backend_graph_end(g)) rs_op_moe(g, out, x, 1, HID, &w);     \
        }                                                                                                    \
    } while (0)
    MOE_STEP(0, 1); /* A, size 1: seen */
    ref[0] = rs_test_to_host(g, out, sizeof xh);
    if (replay) MOE_STEP(0, 1); /* recorded under A */
    MOE_STEP(1, 2); /* B, size 2: seen */
    ref[1] = rs_test_to_host(g, out, sizeof xh);
    MOE_STEP(0, 1); /* A again, size 1: recording (refused) or a replay of A's recording */
#undef MOE_STEP
    float *got = rs_test_to_host(g, out, sizeof xh);
    int bad = 0, like_b = 0;
    for (int i = 0; i < HID; i++) {
        bad += rs_test_f32_bits(got[i]) != rs_test_f32_bits(ref[0][i]);
        like_b += rs_test_f32_bits(got[i]) == rs_test_f32_bits(ref[1][i]);
    }
    if (bad)
        RS_TEST_FAIL("%s: %d of %d outputs differ from weights A's (%d equal weights B's)",
                     replay ? "replay" : "refused recording", bad, HID, like_b);
    free(ref[0]), free(ref[1]), free(got);
    for (int v = 0; v < 2; v++)
        for (int j = 0; j < 3; j++)
            for (int e = 0; e < E; e++) rs_backend_free_mem(g, ws[v][j][e].data);
    rs_backend_free_mem(g, router.data), rs_backend_free_mem(g, x), rs_backend_free_mem(g, out);
    rs_backend_free(g);
}

RS_TEST(cuda_graph_moe_table_after_refused_recording) { moe_table_case(false); }
RS_TEST(cuda_graph_moe_table_not_replayed_stale) { moe_table_case(true); }
#endif
