/*
 * test_kvcache.c — the block manager: refcounts, prefix cache hits and misses, LRU eviction,
 * fork + copy-on-write, flush, and a 100,000-operation random stress run that checks every
 * invariant after each operation and that no sequence ever reads KV it did not compute.
 *
 * The pool lives on the CPU backend, whose memory is host memory, so the tests write and read
 * pages directly. "KV" here is a fingerprint of the token prefix written into each slot: a shared
 * or cached block is correct iff every slot a sequence sees holds its own prefix's fingerprint.
 */
#include <stdint.h>

#include "../../core/rs.h"
#include "../../kvcache/kvcache.h"
#include "test.h"

enum { T_LAYERS = 2, T_KV_HEADS = 2, T_HEAD_DIM = 2 };

/* n_blocks-block pool of fp32 pages: a K or V row is T_KV_HEADS * T_HEAD_DIM * 4 = 16 bytes. */
static rs_kv_pool make_pool(rs_backend *b, int n_blocks) {
    rs_kv_pool p;
    rs_kv_pool tmp = {.n_layers = T_LAYERS, .n_kv_heads = T_KV_HEADS, .head_dim = T_HEAD_DIM,
                      .dtype = RS_DTYPE_F32};
    ASSERT_EQ(rs_kv_pool_init(&p, b, T_LAYERS, T_KV_HEADS, T_HEAD_DIM, RS_DTYPE_F32,
                              (size_t)n_blocks * rs_kv_bytes_per_block(&tmp)),
              RS_OK);
    ASSERT_EQ(p.n_blocks, n_blocks);
    return p;
}

static size_t layer_page_bytes(const rs_kv_pool *p) { return rs_kv_bytes_per_block(p) / (size_t)p->n_layers; }

static uint8_t *page_ptr(const rs_kv_pool *p, int layer, int32_t block) {
    return (uint8_t *)p->layers[layer].pages + (size_t)block * layer_page_bytes(p);
}

/* Row of position pos of s: kv 0 = K, 1 = V. */
static uint8_t *row_ptr(const rs_kv_pool *p, const rs_kv_seq *s, int layer, int kv, int pos) {
    size_t row = (size_t)p->n_kv_heads * (size_t)p->head_dim * rs_dtype_size(p->dtype);
    return page_ptr(p, layer, s->blocks[pos / RS_KV_BLOCK]) + ((size_t)kv * RS_KV_BLOCK + pos % RS_KV_BLOCK) * row;
}

/* The fingerprint goes into the K row of the first layer and the V row of the last one, so a
 * copy that missed a layer or a half shows. */
static void write_fp(const rs_kv_pool *p, const rs_kv_seq *s, int pos, uint64_t fp) {
    memcpy(row_ptr(p, s, 0, 0, pos), &fp, sizeof fp);
    memcpy(row_ptr(p, s, p->n_layers - 1, 1, pos) + 8, &fp, sizeof fp);
}

static bool fp_ok(const rs_kv_pool *p, const rs_kv_seq *s, int pos, uint64_t fp) {
    uint64_t k, v;
    memcpy(&k, row_ptr(p, s, 0, 0, pos), sizeof k);
    memcpy(&v, row_ptr(p, s, p->n_layers - 1, 1, pos) + 8, sizeof v);
    return k == fp && v == fp;
}

static uint64_t rng_next(uint64_t *st) { /* xorshift64* */
    uint64_t x = *st;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *st = x;
    return x * 0x2545f4914f6cdd1dull;
}

static int rng_int(uint64_t *st, int n) { return (int)(rng_next(st) % (uint64_t)n); }

static void fill_tokens(int32_t *t, int n, int32_t base) {
    for (int i = 0; i < n; i++) t[i] = base + i * 7 % 1000;
}

/* Reserve + commit n computed tokens for a fresh sequence; returns the matched token count. */
static int prefill(rs_kv_pool *p, rs_kv_seq *s, const int32_t *t, int n) {
    int m = rs_kv_seq_match_prefix(p, s, t, n);
    ASSERT_EQ(rs_kv_seq_reserve(p, s, n), RS_OK);
    rs_kv_seq_commit(p, s, t, n);
    return m;
}

RS_TEST(kv_cow_copies_page_bytes) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_kv_pool p = make_pool(b, 4);
    rs_kv_seq a = {0}, c = {0};
    ASSERT_EQ(rs_kv_seq_reserve(&p, &a, 20), RS_OK); /* one full block, one partial */
    size_t pb = layer_page_bytes(&p);
    uint8_t *saved = rs_xmalloc(pb * T_LAYERS);
    for (int l = 0; l < T_LAYERS; l++) {
        uint8_t *pg = page_ptr(&p, l, a.blocks[1]);
        for (size_t i = 0; i < pb; i++) pg[i] = (uint8_t)(i * 31 + (size_t)l * 7 + 1);
        memcpy(saved + (size_t)l * pb, pg, pb);
    }
    rs_kv_seq_fork(&p, &a, &c);
    const rs_kv_seq *live[] = {&a, &c};
    rs_kv_pool_check(&p, live, 2);
    rs_kv_stats st;
    rs_kv_pool_stats(&p, &st);
    ASSERT_EQ(st.n_used, 2);

    ASSERT_EQ(rs_kv_seq_prepare_write(&p, &c, 17), RS_OK);
    rs_kv_pool_check(&p, live, 2);
    ASSERT_EQ(c.blocks[0], a.blocks[0]);       /* the full block stays shared */
    ASSERT_NE(c.blocks[1], a.blocks[1]);
    for (int l = 0; l < T_LAYERS; l++) {
        ASSERT_TRUE(memcmp(page_ptr(&p, l, c.blocks[1]), saved + (size_t)l * pb, pb) == 0);
        memset(page_ptr(&p, l, c.blocks[1]), 0xee, pb); /* the child's write */
        ASSERT_TRUE(memcmp(page_ptr(&p, l, a.blocks[1]), saved + (size_t)l * pb, pb) == 0);
    }
    /* now exclusive on both sides: no further copies */
    int32_t ab = a.blocks[1], cb = c.blocks[1];
    ASSERT_EQ(rs_kv_seq_prepare_write(&p, &a, 18), RS_OK);
    ASSERT_EQ(rs_kv_seq_prepare_write(&p, &c, 18), RS_OK);
    ASSERT_EQ(a.blocks[1], ab);
    ASSERT_EQ(c.blocks[1], cb);

    /* a shared block with no block left to copy into: RS_ENOMEM, nothing changed */
    rs_kv_seq d = {0}, e = {0};
    ASSERT_EQ(rs_kv_seq_reserve(&p, &d, 1), RS_OK);
    ASSERT_EQ(rs_kv_available_blocks(&p), 0);
    rs_kv_seq_fork(&p, &d, &e);
    ASSERT_EQ(rs_kv_seq_prepare_write(&p, &e, 1), RS_ENOMEM);
    ASSERT_EQ(e.blocks[0], d.blocks[0]);
    const rs_kv_seq *live4[] = {&a, &c, &d, &e};
    rs_kv_pool_check(&p, live4, 4);

    rs_kv_seq_release(&p, &a);
    rs_kv_seq_release(&p, &c);
    rs_kv_seq_release(&p, &d);
    rs_kv_seq_release(&p, &e);
    ASSERT_EQ(p.n_free, p.n_blocks);
    free(saved);
    rs_kv_pool_free(&p);
    rs_backend_free(b);
}

/* n = 8 samples of one 100-token prompt: the prompt's 7 blocks are held once; the first decoded
 * token copies the partial block for all but the last sample to write. */
RS_TEST(kv_fork_shares_prompt_blocks) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_kv_pool p = make_pool(b, 64);
    int32_t t[100];
    fill_tokens(t, 100, 5);
    rs_kv_seq s[8] = {{0}};
    const rs_kv_seq *live[8];
    ASSERT_EQ(prefill(&p, &s[0], t, 100), 0);
    for (int i = 1; i < 8; i++) rs_kv_seq_fork(&p, &s[0], &s[i]);
    for (int i = 0; i < 8; i++) live[i] = &s[i];
    rs_kv_pool_check(&p, live, 8);
    rs_kv_stats st;
    rs_kv_pool_stats(&p, &st);
    ASSERT_EQ(st.n_used, 7);
    for (int i = 0; i < 8; i++) {
        ASSERT_EQ(rs_kv_seq_reserve(&p, &s[i], 101), RS_OK);
        ASSERT_EQ(rs_kv_seq_prepare_write(&p, &s[i], 100), RS_OK);
    }
    rs_kv_pool_check(&p, live, 8);
    rs_kv_pool_stats(&p, &st);
    ASSERT_EQ(st.n_used, 6 + 8);
    for (int i = 0; i < 8; i++) rs_kv_seq_release(&p, &s[i]);
    rs_kv_pool_stats(&p, &st);
    ASSERT_EQ(st.n_used, 0);
    ASSERT_EQ(st.n_evictable, 6);
    rs_kv_pool_free(&p);
    rs_backend_free(b);
}

RS_TEST(kv_prefix_hit_after_release) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_kv_pool p = make_pool(b, 32);
    int32_t t[100];
    fill_tokens(t, 100, 11);
    rs_kv_seq a = {0}, c = {0};
    ASSERT_EQ(prefill(&p, &a, t, 100), 0);
    int32_t first[7];
    memcpy(first, a.blocks, sizeof first);
    rs_kv_seq_release(&p, &a);
    rs_kv_stats st;
    rs_kv_pool_stats(&p, &st);
    ASSERT_EQ(st.n_evictable, 6);
    ASSERT_EQ(st.n_free, 32 - 6);

    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &c, t, 100), 96);
    for (int i = 0; i < 6; i++) ASSERT_EQ(c.blocks[i], first[i]);
    rs_kv_pool_stats(&p, &st);
    ASSERT_EQ(st.hit_tokens, 96);
    ASSERT_EQ(st.query_tokens, 200);
    ASSERT_EQ(st.n_evictable, 0);
    ASSERT_EQ(st.n_used, 6);
    const rs_kv_seq *live[] = {&c};
    rs_kv_pool_check(&p, live, 1);
    /* a match taken back (the sequence waits on): the blocks are evictable again, the counts as before */
    rs_kv_seq_unmatch(&p, &c, 100);
    rs_kv_pool_stats(&p, &st);
    ASSERT_TRUE(st.hit_tokens == 0 && st.query_tokens == 100 && st.n_evictable == 6 && st.n_used == 0);
    ASSERT_EQ(c.n_blocks, 0);
    rs_kv_pool_check(&p, NULL, 0);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &c, t, 100), 96);
    rs_kv_seq_release(&p, &c);

    /* a 96-token prompt: the last token must be computed, so only 5 blocks match */
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &c, t, 96), 80);
    rs_kv_seq_release(&p, &c);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &c, t, 97), 96);
    rs_kv_seq_release(&p, &c);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &c, t, 0), 0);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &c, t, 16), 0);
    rs_kv_pool_check(&p, NULL, 0);
    rs_kv_pool_free(&p);
    rs_backend_free(b);
}

RS_TEST(kv_prefix_differs_in_block_3) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_kv_pool p = make_pool(b, 32);
    int32_t t[100], u[100];
    fill_tokens(t, 100, 3);
    memcpy(u, t, sizeof u);
    u[3 * RS_KV_BLOCK + 9] += 1;
    rs_kv_seq a = {0}, c = {0};
    prefill(&p, &a, t, 100);
    rs_kv_seq_release(&p, &a);
    ASSERT_EQ(prefill(&p, &c, u, 100), 48);
    /* c's own blocks 3.. registered under c's chain: both prompts now hit fully */
    rs_kv_seq_release(&p, &c);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &a, u, 100), 96);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &c, t, 100), 96);
    for (int i = 0; i < 3; i++) ASSERT_EQ(a.blocks[i], c.blocks[i]);
    for (int i = 3; i < 6; i++) ASSERT_NE(a.blocks[i], c.blocks[i]);
    const rs_kv_seq *live[] = {&a, &c};
    rs_kv_pool_check(&p, live, 2);
    rs_kv_seq_release(&p, &a);
    rs_kv_seq_release(&p, &c);
    rs_kv_pool_free(&p);
    rs_backend_free(b);
}

/* Every key hashes to the same value: lookups still only return blocks with equal tokens and
 * parents, and deletion from the one long probe run keeps the table consistent. */
RS_TEST(kv_hash_collision_never_shares) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_kv_pool p = make_pool(b, 12);
    p.hash_mask = 0;
    int32_t t1[33], t2[33], t3[33];
    fill_tokens(t1, 33, 100);
    fill_tokens(t2, 33, 200);
    memcpy(t3, t1, sizeof t3);
    t3[15] = -7;  /* same block 1 as t1, different block 0: block 1 must not match under t3 */
    rs_kv_seq a = {0}, c = {0};
    prefill(&p, &a, t1, 33);
    rs_kv_seq_release(&p, &a);
    prefill(&p, &a, t2, 33);
    rs_kv_seq_release(&p, &a);
    rs_kv_pool_check(&p, NULL, 0);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &c, t3, 33), 0);
    rs_kv_seq_release(&p, &c);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &c, t2, 33), 32);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &a, t1, 33), 32);
    for (int i = 0; i < 2; i++) ASSERT_NE(a.blocks[i], c.blocks[i]);
    rs_kv_seq_release(&p, &a);
    rs_kv_seq_release(&p, &c);
    /* t3 computed in full: its block 1 has t1's tokens under another parent, so it registers */
    prefill(&p, &a, t3, 33);
    rs_kv_seq_release(&p, &a);
    rs_kv_stats st;
    rs_kv_pool_stats(&p, &st);
    ASSERT_EQ(st.n_evictable, 6);
    /* evict everything through the single probe run, checking after each step */
    for (int i = 0; i < 6; i++) {
        ASSERT_EQ(rs_kv_seq_reserve(&p, &a, 16 * (12 - 6 + 1 + i)), RS_OK);
        const rs_kv_seq *live[] = {&a};
        rs_kv_pool_check(&p, live, 1);
    }
    ASSERT_EQ(p.evictions, 6);
    rs_kv_seq_release(&p, &a);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &c, t1, 33), 0);
    rs_kv_pool_free(&p);
    rs_backend_free(b);
}

/* Three cached 2-block prompts released X, Y, Z, then Y hit again: eviction takes X's last block,
 * then X's first, then Z. */
RS_TEST(kv_eviction_is_lru) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_kv_pool p = make_pool(b, 8);
    int32_t x[33], y[33], z[33];
    fill_tokens(x, 33, 1000);
    fill_tokens(y, 33, 2000);
    fill_tokens(z, 33, 3000);
    rs_kv_seq s = {0}, w = {0};
    prefill(&p, &s, x, 32);
    rs_kv_seq_release(&p, &s);
    prefill(&p, &s, y, 32);
    rs_kv_seq_release(&p, &s);
    prefill(&p, &s, z, 32);
    rs_kv_seq_release(&p, &s);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &s, y, 33), 32);
    rs_kv_seq_release(&p, &s); /* LRU: X1 X0 Z1 Z0 Y1 Y0 */
    ASSERT_EQ(p.n_free, 2);

    ASSERT_EQ(rs_kv_seq_reserve(&p, &w, 48), RS_OK); /* 2 free + X1 */
    ASSERT_EQ(p.evictions, 1);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &s, x, 33), 16);
    rs_kv_seq_release(&p, &s); /* LRU: Z1 Z0 Y1 Y0 X0 */
    ASSERT_EQ(rs_kv_seq_reserve(&p, &w, 80), RS_OK); /* Z1, Z0 */
    ASSERT_EQ(p.evictions, 3);
    const rs_kv_seq *live[] = {&w};
    rs_kv_pool_check(&p, live, 1);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &s, z, 33), 0);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &s, y, 33), 32);
    rs_kv_seq_release(&p, &s);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &s, x, 33), 16);
    rs_kv_seq_release(&p, &s);
    /* nothing left to take: RS_ENOMEM and no change */
    ASSERT_EQ(rs_kv_seq_reserve(&p, &w, 80 + 4 * 16), RS_ENOMEM);
    ASSERT_EQ(w.n_blocks, 5);
    ASSERT_EQ(p.evictions, 3);
    ASSERT_EQ(rs_kv_available_blocks(&p), 3);
    rs_kv_seq_release(&p, &w);
    rs_kv_pool_free(&p);
    rs_backend_free(b);
}

RS_TEST(kv_flush_drops_cached_and_in_use_entries) {
    rs_backend *b = rs_backend_cpu_init(1);
    rs_kv_pool p = make_pool(b, 16);
    int32_t t[50], u[50];
    fill_tokens(t, 50, 1);
    fill_tokens(u, 50, 9);
    rs_kv_seq a = {0}, c = {0}, d = {0};
    prefill(&p, &a, t, 50);
    rs_kv_seq_release(&p, &a);
    prefill(&p, &c, u, 50);                  /* in use and registered */
    ASSERT_EQ(rs_kv_seq_reserve(&p, &d, 40), RS_OK);
    rs_kv_seq_commit(&p, &d, t, 16);         /* d registers nothing: t's block 0 is cached */
    rs_kv_pool_flush_cache(&p);
    const rs_kv_seq *live[] = {&c, &d};
    rs_kv_pool_check(&p, live, 2);
    rs_kv_stats st;
    rs_kv_pool_stats(&p, &st);
    ASSERT_EQ(st.n_evictable, 0);
    ASSERT_EQ(st.n_used, 4 + 3);
    /* d's KV predates the flush: committing it now must not register anything */
    rs_kv_seq_commit(&p, &d, t, 40);
    rs_kv_seq_release(&p, &d);
    rs_kv_seq_release(&p, &c);
    ASSERT_EQ(p.n_free, p.n_blocks);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &a, u, 50), 0);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &a, t, 50), 0);
    /* a sequence started after the flush caches again */
    ASSERT_EQ(prefill(&p, &a, t, 50), 0);
    rs_kv_seq_release(&p, &a);
    ASSERT_EQ(rs_kv_seq_match_prefix(&p, &a, t, 50), 48);
    rs_kv_seq_release(&p, &a);
    rs_kv_pool_free(&p);
    rs_backend_free(b);
}

/* ---- stress ---------------------------------------------------------------------------------- */

enum { S_MAX_TOK = 160, S_MAX_LIVE = 12, S_BLOCKS = 48, S_N_PREFIX = 4 };

typedef struct tseq {
    int32_t tok[S_MAX_TOK];
    uint64_t fp[S_MAX_TOK];      /* fp[i]: fingerprint of tok[0..i] */
    int n_tokens, n_computed;
    rs_kv_seq kv;
} tseq;

typedef struct stress {
    rs_kv_pool p;
    tseq seqs[S_MAX_LIVE];
    int n_live;
    int32_t prefix[S_N_PREFIX][100];
    int prefix_len[S_N_PREFIX];
    uint64_t rng;
    long n_cow, n_matched, n_enomem;
} stress;

static void tseq_push(tseq *s, int32_t tok) {
    uint64_t prev = s->n_tokens ? s->fp[s->n_tokens - 1] : 0x1234567ull;
    s->tok[s->n_tokens] = tok;
    s->fp[s->n_tokens] = (prev ^ (uint64_t)(uint32_t)tok) * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    s->n_tokens++;
}

static void tseq_verify(const rs_kv_pool *p, const tseq *s, int upto) {
    for (int i = 0; i < upto; i++)
        if (!fp_ok(p, &s->kv, i, s->fp[i])) RS_TEST_FAIL("seq sees wrong KV at position %d of %d", i, upto);
}

static void stress_drop(stress *st, int i) {
    rs_kv_seq_release(&st->p, &st->seqs[i].kv);
    st->seqs[i] = st->seqs[--st->n_live];
    memset(&st->seqs[st->n_live], 0, sizeof st->seqs[0]);
}

static void op_create(stress *st) {
    if (st->n_live == S_MAX_LIVE) return;
    tseq *s = &st->seqs[st->n_live];
    memset(s, 0, sizeof *s);
    int k = rng_int(&st->rng, S_N_PREFIX);
    for (int i = 0; i < st->prefix_len[k]; i++) tseq_push(s, st->prefix[k][i]);
    for (int n = 1 + rng_int(&st->rng, 40); n > 0; n--) tseq_push(s, rng_int(&st->rng, 4));
    int m = rs_kv_seq_match_prefix(&st->p, &s->kv, s->tok, s->n_tokens);
    ASSERT_TRUE(m % RS_KV_BLOCK == 0 && m < s->n_tokens && m == s->kv.n_blocks * RS_KV_BLOCK);
    tseq_verify(&st->p, s, m);
    st->n_matched += m;
    s->n_computed = m;
    st->n_live++;
    if (rs_kv_seq_reserve(&st->p, &s->kv, s->n_tokens) != RS_OK) {
        st->n_enomem++;
        stress_drop(st, st->n_live - 1);
    }
}

static void op_compute(stress *st, tseq *s) {
    int chunk = 1 + rng_int(&st->rng, 24); /* not inside RS_MIN: it evaluates twice */
    int end = RS_MIN(s->n_tokens, s->n_computed + chunk);
    for (int pos = s->n_computed; pos < end; pos++) {
        int32_t before = s->kv.blocks[pos / RS_KV_BLOCK];
        if (rs_kv_seq_prepare_write(&st->p, &s->kv, pos) != RS_OK) {
            ASSERT_EQ(s->kv.blocks[pos / RS_KV_BLOCK], before);
            st->n_enomem++;
            break;
        }
        st->n_cow += s->kv.blocks[pos / RS_KV_BLOCK] != before;
        write_fp(&st->p, &s->kv, pos, s->fp[pos]);
        s->n_computed = pos + 1;
    }
}

static void op_decode(stress *st, tseq *s) {
    if (s->n_computed < s->n_tokens || s->n_tokens == S_MAX_TOK) return;
    tseq_push(s, rng_int(&st->rng, 2));
    if (rs_kv_seq_reserve(&st->p, &s->kv, s->n_tokens) != RS_OK) {
        s->n_tokens--;
        st->n_enomem++;
    }
}

static void op_fork(stress *st, const tseq *s) {
    if (st->n_live == S_MAX_LIVE) return;
    tseq *c = &st->seqs[st->n_live++];
    memcpy(c->tok, s->tok, sizeof c->tok);
    memcpy(c->fp, s->fp, sizeof c->fp);
    c->n_tokens = s->n_tokens;
    c->n_computed = s->n_computed;
    memset(&c->kv, 0, sizeof c->kv);
    rs_kv_seq_fork(&st->p, &s->kv, &c->kv);
}

static void stress_check(const stress *st) {
    const rs_kv_seq *live[S_MAX_LIVE];
    for (int i = 0; i < st->n_live; i++) live[i] = &st->seqs[i].kv;
    rs_kv_pool_check(&st->p, live, st->n_live);
}

static void stress_op(stress *st) {
    int r = rng_int(&st->rng, 1000);
    int i = st->n_live ? rng_int(&st->rng, st->n_live) : -1;
    tseq *s = i >= 0 ? &st->seqs[i] : NULL;
    if (r < 200 || !s) op_create(st);
    else if (r < 500) op_compute(st, s);
    else if (r < 600) rs_kv_seq_commit(&st->p, &s->kv, s->tok, s->n_computed);
    else if (r < 750) op_decode(st, s);
    else if (r < 830) op_fork(st, s);
    else if (r < 960) stress_drop(st, i);
    else if (r < 998) tseq_verify(&st->p, s, s->n_computed);
    else rs_kv_pool_flush_cache(&st->p);
}

static void stress_run(int n_ops, uint64_t hash_mask) {
    rs_backend *b = rs_backend_cpu_init(1);
    stress *st = rs_xcalloc(1, sizeof *st);
    st->p = make_pool(b, S_BLOCKS);
    st->p.hash_mask = hash_mask;
    st->rng = 0x9e3779b97f4a7c15ull;
    for (int k = 0; k < S_N_PREFIX; k++) {
        st->prefix_len[k] = 10 + 30 * k; /* 10, 40, 70, 100 */
        for (int i = 0; i < st->prefix_len[k]; i++) st->prefix[k][i] = rng_int(&st->rng, 50000);
    }
    for (int op = 0; op < n_ops; op++) {
        stress_op(st);
        stress_check(st);
    }
    for (int i = 0; i < st->n_live; i++) tseq_verify(&st->p, &st->seqs[i], st->seqs[i].n_computed);
    while (st->n_live) stress_drop(st, st->n_live - 1);
    rs_kv_pool_check(&st->p, NULL, 0);
    rs_kv_stats s;
    rs_kv_pool_stats(&st->p, &s);
    ASSERT_EQ(s.n_free + s.n_evictable, s.n_blocks);
    rs_kv_pool_flush_cache(&st->p);
    rs_kv_pool_check(&st->p, NULL, 0);
    ASSERT_EQ(st->p.n_free, st->p.n_blocks);
    /* every path was exercised */
    ASSERT_TRUE(st->n_matched > 0 && s.hit_tokens == (uint64_t)st->n_matched);
    ASSERT_TRUE(s.evictions > 0);
    ASSERT_TRUE(st->n_cow > 0);
    ASSERT_TRUE(st->n_enomem > 0);
    rs_kv_pool_free(&st->p);
    free(st);
    rs_backend_free(b);
}

RS_TEST(kv_stress_random_ops) { stress_run(100000, ~0ull); }

/* The same with every key in one bucket: a long probe run under random inserts and deletes. */
RS_TEST(kv_stress_all_keys_collide) { stress_run(20000, 0); }
