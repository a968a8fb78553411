/*
 * cuda_graph.cu — step graphs (kernels/backend.h rs_backend_graph_begin): a decode step's kernels,
 * copies and cuBLASLt calls captured once per (owner, slot) with CUDA stream capture and replayed
 * with cudaGraphLaunch, which removes the per-kernel launch cost (hundreds of launches per step) and
 * the host work between them.
 *
 * Lifecycle of a recording, keyed by (owner, slot) with the caller's key:
 *   unseen key   OFF: the step runs op by op; every scratch and mirror buffer reaches its size and
 *                every mirror gets a pinned staging buffer; cuBLASLt's heuristics are cached.
 *   seen once    RECORDING: cudaStreamBeginCapture (global mode) on the context's stream; the ops
 *                enqueue as usual, except that each mirror records its copy from its pinned buffer
 *                (cudaMemcpyAsync from pageable memory cannot be captured) and notes which host
 *                array it stages. graph_end instantiates the graph, fills the pinned buffers from
 *                those arrays and launches it.
 *   recorded     REPLAYED: the pinned buffers are refilled from the same host arrays (the caller
 *                keeps them at fixed addresses: the contract in backend.h) and the graph launches.
 * A recording is refused (graph_end returns false; the caller reruns the step op by op; the key is
 * never recorded again) when an op needed what a capture forbids: a buffer that must grow, a host
 * synchronization (the MoE op's host routing), a mirror asked for two different host arrays. Every
 * buffer move bumps the context's mem_gen; recordings made before it are dropped at the next begin.
 * After a replay the mirrors' "bytes last sent" are unknown (the graph wrote new ones), so eager ops
 * send again. A replay first waits for the stream: the pinned buffers are read by the previous
 * launch's copies.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

/* backend.h rs_backend_cuda_capture_lock: one per process, as global-mode capture is */
static pthread_mutex_t capture_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;

extern "C" void rs_backend_cuda_capture_lock(void) { RS_ASSERT(pthread_mutex_lock(&capture_mu) == 0); }
extern "C" void rs_backend_cuda_capture_unlock(void) { RS_ASSERT(pthread_mutex_unlock(&capture_mu) == 0); }

#define GRAPHS_MAX 64 /* recordings per context; beyond, the oldest goes */

struct rs_cuda_graph_copy {
    int slot;
    const void *host;
    size_t bytes;
};

struct rs_cuda_graph_rec {
    const void *owner;
    int slot;
    uint64_t key, mem_gen, age;
    enum { REC_SEEN, REC_READY, REC_NEVER } state;
    cudaGraphExec_t exec;
    rs_cuda_graph_copy copies[RS_CUDA_M_COUNT];
    int n_copies;
};

struct rs_cuda_graphs {
    rs_cuda_graph_rec rec[GRAPHS_MAX];
    int n;
    rs_cuda_graph_rec *cur; /* the recording in progress */
    uint64_t clock;
    uint64_t recorded, replayed, refused;
};

static void rec_drop(rs_cuda_graph_rec *r) {
    if (r->exec) CUDA_CHECK(cudaGraphExecDestroy(r->exec));
    r->exec = NULL;
}

void rs_cuda_graphs_free(rs_cuda_ctx *c) {
    if (!c->graphs) return;
    RS_ASSERT(!c->recording);
    for (int i = 0; i < c->graphs->n; i++) rec_drop(&c->graphs->rec[i]);
    free(c->graphs);
    c->graphs = NULL;
}

void rs_cuda_recording_broken(rs_cuda_ctx *c, const char *why) {
    RS_ASSERT(c->recording);
    if (!c->rec_broken) c->rec_broken = why;
}

void rs_cuda_graph_note_copy(rs_cuda_ctx *c, int slot, const void *host, size_t bytes) {
    rs_cuda_graph_rec *r = c->graphs->cur;
    RS_ASSERT(c->recording && r && r->n_copies < RS_CUDA_M_COUNT);
    r->copies[r->n_copies++] = rs_cuda_graph_copy{slot, host, bytes};
}

/* The mirrors' device buffers now hold what a graph wrote: eager ops must send their bytes again. */
static void mirrors_unknown(rs_cuda_ctx *c) {
    for (int i = 0; i < RS_CUDA_M_COUNT; i++) {
        c->mirror[i].bytes = 0;
        c->mirror[i].rec_src = NULL;
        c->mirror[i].rec_bytes = 0;
    }
}

static rs_cuda_graph_rec *rec_find(rs_cuda_graphs *g, const void *owner, int slot) {
    for (int i = 0; i < g->n; i++)
        if (g->rec[i].owner == owner && g->rec[i].slot == slot) return &g->rec[i];
    return NULL;
}

/* r (dropped) as a fresh, seen-once recording of key. */
static void rec_reset(rs_cuda_graph_rec *r, const void *owner, int slot, uint64_t key, uint64_t mem_gen) {
    memset(r, 0, sizeof *r);
    r->owner = owner, r->slot = slot, r->key = key, r->mem_gen = mem_gen, r->state = rs_cuda_graph_rec::REC_SEEN;
}

static rs_cuda_graph_rec *rec_new(rs_cuda_graphs *g) {
    if (g->n < GRAPHS_MAX) return &g->rec[g->n++];
    rs_cuda_graph_rec *r = &g->rec[0]; /* the least recently used goes */
    for (int i = 1; i < g->n; i++)
        if (g->rec[i].age < r->age) r = &g->rec[i];
    rec_drop(r);
    return r;
}

/* Fills the pinned staging of r's copies from the caller's arrays and launches r. */
static void rec_launch(rs_cuda_ctx *c, rs_cuda_graph_rec *r) {
    CUDA_CHECK(cudaStreamSynchronize(c->stream)); /* the previous launch has read the pinned buffers */
    for (int i = 0; i < r->n_copies; i++) {
        const rs_cuda_graph_copy *cp = &r->copies[i];
        rs_cuda_mirror *m = &c->mirror[cp->slot];
        RS_ASSERT(m->pinned && m->pinned_cap >= cp->bytes);
        memcpy(m->pinned, cp->host, cp->bytes);
    }
    CUDA_CHECK(cudaGraphLaunch(r->exec, c->stream));
    mirrors_unknown(c);
}

rs_graph_state rs_cuda_graph_begin(rs_backend *b, const void *owner, int slot, uint64_t key) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    rs_cuda_graphs *g = c->graphs;
    if (!g) return RS_GRAPH_OFF;
    RS_ASSERT(!c->recording);
    rs_cuda_graph_rec *r = rec_find(g, owner, slot);
    if (r && r->state == rs_cuda_graph_rec::REC_NEVER && r->key == key) return RS_GRAPH_NEVER;
    /* a recording made before a buffer moved points at the old one; a warm-up may move buffers */
    if (!r || r->key != key || (r->state == rs_cuda_graph_rec::REC_READY && r->mem_gen != c->mem_gen)) {
        if (r) rec_drop(r);
        else r = rec_new(g);
        rec_reset(r, owner, slot, key, c->mem_gen);
        r->age = ++g->clock;
        return RS_GRAPH_OFF; /* warm-up: buffers reach their sizes, pinned staging exists */
    }
    r->age = ++g->clock;
    if (r->state == rs_cuda_graph_rec::REC_READY) {
        rec_launch(c, r);
        g->replayed++;
        return RS_GRAPH_REPLAYED;
    }
    mirrors_unknown(c);
    r->n_copies = 0;
    r->mem_gen = c->mem_gen; /* the buffers the recording will point at */
    g->cur = r;
    c->rec_broken = NULL;
    rs_backend_cuda_capture_lock(); /* until graph_end: other threads' allocations and transfers wait */
    CUDA_CHECK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeGlobal));
    c->recording = true;
    return RS_GRAPH_RECORDING;
}

bool rs_cuda_graph_end(rs_backend *b) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    rs_cuda_graphs *g = c->graphs;
    RS_ASSERT(g && c->recording && g->cur);
    rs_cuda_graph_rec *r = g->cur;
    c->recording = false;
    g->cur = NULL;
    cudaGraph_t graph = NULL;
    const cudaError_t e = cudaStreamEndCapture(c->stream, &graph);
    rs_backend_cuda_capture_unlock();
    mirrors_unknown(c);
    if (e != cudaSuccess || c->rec_broken || c->mem_gen != r->mem_gen) {
        RS_INFO("cuda: step graph (slot %d) not recorded: %s; this step shape runs op by op", r->slot,
                c->rec_broken ? c->rec_broken : e != cudaSuccess ? cudaGetErrorString(e) : "a buffer moved");
        (void)cudaGetLastError(); /* an invalidated capture leaves its error behind */
        if (graph) CUDA_CHECK(cudaGraphDestroy(graph));
        r->state = rs_cuda_graph_rec::REC_NEVER;
        g->refused++;
        return false;
    }
    CUDA_CHECK(cudaGraphInstantiate(&r->exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    r->state = rs_cuda_graph_rec::REC_READY;
    g->recorded++;
    rec_launch(c, r);
    return true;
}

void rs_cuda_graph_forget(rs_backend *b, const void *owner) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    rs_cuda_graphs *g = c->graphs;
    if (!g) return;
    RS_ASSERT(!c->recording);
    int keep = 0;
    for (int i = 0; i < g->n; i++) {
        if (g->rec[i].owner == owner) rec_drop(&g->rec[i]);
        else g->rec[keep++] = g->rec[i];
    }
    g->n = keep;
}

extern "C" void rs_backend_cuda_set_graphs(rs_backend *b, bool on) {
    rs_cuda_ctx *c = rs_cuda_ctx_of(b);
    if (on && !c->graphs) c->graphs = (rs_cuda_graphs *)rs_xcalloc(1, sizeof *c->graphs);
    if (!on) rs_cuda_graphs_free(c);
}

extern "C" void rs_backend_cuda_graph_stats(const rs_backend *b, uint64_t *recorded, uint64_t *replayed,
                                            uint64_t *refused) {
    const rs_cuda_graphs *g = ((const rs_cuda_ctx *)b->ctx)->graphs;
    *recorded = g ? g->recorded : 0;
    *replayed = g ? g->replayed : 0;
    *refused = g ? g->refused : 0;
}
