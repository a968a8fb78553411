/*
 * hashmap.c — the tokenizer's containers: a growable byte buffer, a string -> int32 map (vocab,
 * added tokens, the BPE word cache) and a (u32, u32) -> (rank, id) map (merges). Open addressing
 * with linear probing at load factor <= 1/2; keys live in one arena, each NUL-terminated, so a
 * 150k-entry vocabulary is a handful of allocations.
 */
#include <stdlib.h>

#include "tok_internal.h"

void rs_tok_buf_reserve(rs_tok_buf *b, size_t extra) {
    size_t need = b->n + extra;
    if (need <= b->cap) return;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) cap *= 2;
    b->p = rs_xrealloc(b->p, cap);
    b->cap = cap;
}

void rs_tok_buf_put_cp(rs_tok_buf *b, uint32_t cp) {
    char tmp[4];
    rs_tok_buf_put(b, tmp, (size_t)rs_utf8_put(tmp, cp));
}

void rs_tok_buf_put_lossy(rs_tok_buf *b, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    rs_tok_buf_reserve(b, n);
    while (i < n) {
        size_t run = i;
        while (run < n && u[run] < 0x80) run++;
        if (run > i) {
            rs_tok_buf_put(b, s + i, run - i);
            i = run;
            continue;
        }
        size_t bad = 0, k = rs_utf8_lossy_step(u + i, n - i, &bad);
        if (k) {
            rs_tok_buf_put(b, s + i, k);
            i += k;
        } else {
            rs_tok_buf_put(b, "\xEF\xBF\xBD", 3);
            i += bad;
        }
    }
}

/* FNV-1a over 8-byte words, then a 64-bit mix: quick for short keys, well spread. */
uint64_t rs_tok_hash_bytes(const void *p, size_t n) {
    const unsigned char *s = p;
    uint64_t h = 0xcbf29ce484222325ull ^ (n * 0x9E3779B97F4A7C15ull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
        s += 8, n -= 8;
    }
    uint64_t w = 0;
    if (n) memcpy(&w, s, n);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ull;
    h ^= h >> 32;
    return h;
}

static void strmap_grow(rs_tok_strmap *m) {
    uint32_t cap = m->cap ? 2 * m->cap : 64;
    uint32_t *slots = rs_xcalloc(cap, sizeof *slots);
    for (uint32_t e = 0; e < m->n; e++) {
        uint32_t i = (uint32_t)m->hash[e] & (cap - 1);
        while (slots[i]) i = (i + 1) & (cap - 1);
        slots[i] = e + 1;
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    m->hash = rs_xrealloc(m->hash, (size_t)cap / 2 * sizeof *m->hash);
    m->off = rs_xrealloc(m->off, (size_t)cap / 2 * sizeof *m->off);
    m->len = rs_xrealloc(m->len, (size_t)cap / 2 * sizeof *m->len);
    m->val = rs_xrealloc(m->val, (size_t)cap / 2 * sizeof *m->val);
}

static uint32_t strmap_find(const rs_tok_strmap *m, const char *k, size_t n, uint64_t h) {
    if (!m->cap) return 0;
    uint32_t i = (uint32_t)h & (m->cap - 1);
    for (;;) {
        uint32_t e = m->slots[i];
        if (!e) return 0;
        if (m->hash[e - 1] == h && m->len[e - 1] == n && memcmp(m->keys.p + m->off[e - 1], k, n) == 0) return e;
        i = (i + 1) & (m->cap - 1);
    }
}

uint32_t rs_tok_strmap_put(rs_tok_strmap *m, const char *k, size_t n, int32_t val) {
    uint64_t h = rs_tok_hash_bytes(k, n);
    uint32_t e = strmap_find(m, k, n, h);
    if (e) {
        m->val[e - 1] = val;
        return e - 1;
    }
    RS_ASSERT(n < UINT32_MAX && m->keys.n + n < UINT32_MAX);
    if ((m->n + 1) * 2 > m->cap) strmap_grow(m);
    e = m->n++;
    m->hash[e] = h;
    m->off[e] = (uint32_t)m->keys.n;
    m->len[e] = (uint32_t)n;
    m->val[e] = val;
    rs_tok_buf_put(&m->keys, k, n);
    rs_tok_buf_putc(&m->keys, '\0'); /* keys read as C strings too */
    uint32_t i = (uint32_t)h & (m->cap - 1);
    while (m->slots[i]) i = (i + 1) & (m->cap - 1);
    m->slots[i] = e + 1;
    return e;
}

int32_t rs_tok_strmap_get(const rs_tok_strmap *m, const char *k, size_t n) {
    uint32_t e = strmap_find(m, k, n, rs_tok_hash_bytes(k, n));
    return e ? m->val[e - 1] : -1;
}

void rs_tok_strmap_free(rs_tok_strmap *m) {
    free(m->slots);
    free(m->hash);
    free(m->off);
    free(m->len);
    free(m->val);
    free(m->keys.p);
    memset(m, 0, sizeof *m);
}

static void pairmap_grow(rs_tok_pairmap *m) {
    uint32_t cap = m->cap ? 2 * m->cap : 1024;
    uint64_t *keys = rs_xcalloc(cap, sizeof *keys);
    uint32_t *rank = rs_xmalloc(cap * sizeof *rank);
    int32_t *out = rs_xmalloc(cap * sizeof *out);
    for (uint32_t j = 0; j < m->cap; j++) {
        if (!m->keys[j]) continue;
        uint64_t h = m->keys[j] * 0x9E3779B97F4A7C15ull;
        uint32_t i = (uint32_t)(h >> 32) & (cap - 1);
        while (keys[i]) i = (i + 1) & (cap - 1);
        keys[i] = m->keys[j], rank[i] = m->rank[j], out[i] = m->out[j];
    }
    free(m->keys);
    free(m->rank);
    free(m->out);
    m->keys = keys, m->rank = rank, m->out = out, m->cap = cap;
}

void rs_tok_pairmap_put(rs_tok_pairmap *m, int32_t a, int32_t b, uint32_t rank, int32_t out) {
    if ((m->n + 1) * 2 > m->cap) pairmap_grow(m);
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    uint32_t i = (uint32_t)(h >> 32) & (m->cap - 1);
    while (m->keys[i] && m->keys[i] != key) i = (i + 1) & (m->cap - 1);
    if (!m->keys[i]) m->n++;
    m->keys[i] = key, m->rank[i] = rank, m->out[i] = out;
}

void rs_tok_pairmap_free(rs_tok_pairmap *m) {
    free(m->keys);
    free(m->rank);
    free(m->out);
    memset(m, 0, sizeof *m);
}
