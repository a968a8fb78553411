/*
 * bpe.c — the BPE model: one pre-tokenized word to token ids, as `tokenizers`' BPE::tokenize.
 *
 * A word starts as one symbol per character (per byte in byte-level mode), looked up in the
 * vocabulary with continuing_subword_prefix / end_of_word_suffix applied; a character not in it
 * becomes its "<0xXX>" byte tokens (byte_fallback) or the unk token (consecutive ones fused with
 * fuse_unk), or is dropped when there is neither. Then merges are applied lowest rank first, ties
 * to the leftmost, with a binary heap of candidate pairs and a doubly linked list of symbols:
 * O(n log n) for a word of n symbols (Word::merge_all). ignore_merges takes a word that is itself
 * in the vocabulary as one token.
 *
 * Words shorter than RS_TOK_CACHE_MAX_WORD bytes are cached (word -> ids) in shards, each behind
 * its own mutex, so that concurrent encodes share the cache safely; a full shard is emptied.
 */
#include <stdlib.h>

#include "tok_internal.h"

#define RS_TOK_CACHE_MAX_WORD 256
#define RS_TOK_CACHE_SHARD_WORDS 2048

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes, in
 * increasing order, for U+0100, U+0101, ... */
static uint16_t byte_char[256];
static int16_t char_byte[256 + 68];
static pthread_once_t alphabet_once = PTHREAD_ONCE_INIT;

static void alphabet_build(void) {
    unsigned n = 0;
    for (unsigned c = 0; c < 256 + 68; c++) char_byte[c] = -1;
    for (unsigned b = 0; b < 256; b++) {
        bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        byte_char[b] = (uint16_t)(printable ? b : 256 + n++);
        char_byte[byte_char[b]] = (int16_t)b;
    }
}

uint32_t rs_tok_byte_char(unsigned b) {
    pthread_once(&alphabet_once, alphabet_build);
    return byte_char[b & 0xFF];
}

int rs_tok_char_byte(uint32_t cp) {
    pthread_once(&alphabet_once, alphabet_build);
    return cp < 256 + 68 ? char_byte[cp] : -1;
}

void rs_tok_bpe_init_cache(rs_tok_bpe *m) {
    m->cache = rs_xcalloc(RS_TOK_CACHE_SHARDS, sizeof *m->cache);
    for (int i = 0; i < RS_TOK_CACHE_SHARDS; i++) RS_ASSERT(pthread_mutex_init(&m->cache[i].mu, NULL) == 0);
}

void rs_tok_bpe_free(rs_tok_bpe *m) {
    rs_tok_strmap_free(&m->vocab);
    rs_tok_strmap_free(&m->raw_vocab);
    rs_tok_pairmap_free(&m->merges);
    free(m->prefix);
    free(m->suffix);
    if (m->cache) {
        for (int i = 0; i < RS_TOK_CACHE_SHARDS; i++) {
            pthread_mutex_destroy(&m->cache[i].mu);
            rs_tok_strmap_free(&m->cache[i].map);
            free(m->cache[i].ids.v);
        }
        free(m->cache);
    }
    memset(m, 0, sizeof *m);
}

/* ---- the word being merged ---- */

typedef struct sym {
    int32_t c;          /* token id */
    int32_t prev, next; /* neighbours, -1 at the ends */
    uint32_t len;       /* bytes covered; 0 once merged into its left neighbour */
} sym;

typedef struct cand {
    uint32_t rank, pos;
    int32_t out;
} cand;

typedef struct word {
    sym *s;
    size_t n, cap;
    cand *h;     /* min-heap on (rank, pos) */
    size_t hn, hcap;
} word;

static void word_add(word *w, int32_t c, uint32_t len) {
    if (w->n == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 32;
        w->s = rs_xrealloc(w->s, w->cap * sizeof *w->s);
    }
    int32_t i = (int32_t)w->n;
    if (i > 0) w->s[i - 1].next = i;
    w->s[w->n++] = (sym){c, i - 1, -1, len};
}

static bool cand_less(cand a, cand b) { return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos; }

static void heap_push(word *w, cand c) {
    if (w->hn == w->hcap) {
        w->hcap = w->hcap ? 2 * w->hcap : 32;
        w->h = rs_xrealloc(w->h, w->hcap * sizeof *w->h);
    }
    size_t i = w->hn++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(c, w->h[p])) break;
        w->h[i] = w->h[p];
        i = p;
    }
    w->h[i] = c;
}

static cand heap_pop(word *w) {
    cand top = w->h[0], last = w->h[--w->hn];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        cand best = last;
        if (l < w->hn && cand_less(w->h[l], best)) m = l, best = w->h[l];
        if (r < w->hn && cand_less(w->h[r], best)) m = r;
        if (m == i) break;
        w->h[i] = w->h[m];
        i = m;
    }
    if (w->hn) w->h[i] = last;
    return top;
}

static void try_push(const rs_tok_bpe *m, word *w, size_t pos, int32_t a, int32_t b) {
    uint32_t rank;
    int32_t out;
    if (rs_tok_pairmap_get(&m->merges, a, b, &rank, &out)) heap_push(w, (cand){rank, (uint32_t)pos, out});
}

static void merge_all(const rs_tok_bpe *m, word *w) {
    w->hn = 0;
    for (size_t i = 0; i + 1 < w->n; i++) try_push(m, w, i, w->s[i].c, w->s[i + 1].c);
    while (w->hn) {
        cand top = heap_pop(w);
        sym *cur = &w->s[top.pos];
        if (cur->len == 0 || cur->next == -1) continue;
        size_t next_pos = (size_t)cur->next;
        sym right = w->s[next_pos];
        uint32_t rank;
        int32_t out;
        if (!rs_tok_pairmap_get(&m->merges, cur->c, right.c, &rank, &out) || out != top.out) continue; /* stale */
        cur->c = top.out;
        cur->len += right.len;
        cur->next = right.next;
        w->s[next_pos].len = 0;
        if (right.next > -1 && (size_t)right.next < w->n) w->s[right.next].prev = (int32_t)top.pos;
        if (cur->prev >= 0) try_push(m, w, (size_t)cur->prev, w->s[cur->prev].c, cur->c);
        if (cur->next >= 0) try_push(m, w, top.pos, cur->c, w->s[cur->next].c);
    }
}

/* The initial symbols of w[0,n) (BPE::merge_word before merge_all). */
static void initial_symbols(const rs_tok_bpe *m, const char *w, size_t n, word *wd) {
    int32_t unk = -1;
    uint32_t unk_len = 0;
    char buf[64];
    size_t i = 0;
    while (i < n) {
        size_t b = i;
        const char *s;
        size_t sl;
        int32_t id;
        char alpha[4];
        if (m->byte_level) {
            i++;
            id = m->byte_id[(unsigned char)w[b]];
            if (id >= 0 && unk < 0) {
                word_add(wd, id, 1);
                continue;
            }
            sl = (size_t)rs_utf8_put(alpha, rs_tok_byte_char((unsigned char)w[b]));
            s = alpha;
        } else {
            i += (size_t)rs_utf8_len((unsigned char)w[b]);
            bool first = b == 0, last = i >= n;
            if ((m->prefix && !first) || (m->suffix && last)) {
                size_t k = 0;
                if (m->prefix && !first) memcpy(buf, m->prefix, m->prefix_len), k = m->prefix_len;
                memcpy(buf + k, w + b, i - b), k += i - b;
                if (m->suffix && last) memcpy(buf + k, m->suffix, m->suffix_len), k += m->suffix_len;
                s = buf, sl = k;
            } else {
                s = w + b, sl = i - b;
            }
            id = rs_tok_strmap_get(&m->vocab, s, sl);
        }
        uint32_t byte_len = (uint32_t)(i - b);
        if (id >= 0) {
            if (unk >= 0) word_add(wd, unk, unk_len), unk = -1;
            word_add(wd, id, byte_len);
            continue;
        }
        if (m->byte_fallback) {
            bool all = true;
            for (size_t k = 0; k < sl && all; k++) all = m->fallback_id[(unsigned char)s[k]] >= 0;
            if (all) {
                for (size_t k = 0; k < sl; k++) word_add(wd, m->fallback_id[(unsigned char)s[k]], 1);
                continue;
            }
        }
        if (m->unk_id >= 0) {
            if (unk >= 0 && m->fuse_unk) {
                unk_len += byte_len;
            } else {
                if (unk >= 0) word_add(wd, unk, unk_len);
                unk = m->unk_id, unk_len = byte_len;
            }
        }
    }
    if (unk >= 0) word_add(wd, unk, unk_len);
}

static bool cache_get(const rs_tok_bpe *m, const char *w, size_t n, uint64_t h, rs_tok_ids *out) {
    rs_tok_cache_shard *sh = &m->cache[h % RS_TOK_CACHE_SHARDS];
    pthread_mutex_lock(&sh->mu);
    int32_t at = rs_tok_strmap_get(&sh->map, w, n);
    if (at >= 0) {
        int32_t k = sh->ids.v[at];
        for (int32_t j = 0; j < k; j++) rs_tok_ids_push(out, sh->ids.v[at + 1 + j]);
    }
    pthread_mutex_unlock(&sh->mu);
    return at >= 0;
}

static void cache_put(const rs_tok_bpe *m, const char *w, size_t n, uint64_t h, const int32_t *ids, size_t k) {
    rs_tok_cache_shard *sh = &m->cache[h % RS_TOK_CACHE_SHARDS];
    pthread_mutex_lock(&sh->mu);
    if (sh->map.n >= RS_TOK_CACHE_SHARD_WORDS) { /* full: start over */
        rs_tok_strmap_free(&sh->map);
        sh->ids.n = 0;
    }
    if (rs_tok_strmap_get(&sh->map, w, n) < 0) {
        rs_tok_strmap_put(&sh->map, w, n, (int32_t)sh->ids.n);
        rs_tok_ids_push(&sh->ids, (int32_t)k);
        for (size_t j = 0; j < k; j++) rs_tok_ids_push(&sh->ids, ids[j]);
    }
    pthread_mutex_unlock(&sh->mu);
}

void rs_tok_bpe_encode(const rs_tok_bpe *m, const char *w, size_t n, rs_tok_ids *out) {
    if (m->ignore_merges) {
        int32_t id = rs_tok_strmap_get(m->byte_level ? &m->raw_vocab : &m->vocab, w, n);
        if (id >= 0) {
            rs_tok_ids_push(out, id);
            return;
        }
    }
    bool cacheable = n < RS_TOK_CACHE_MAX_WORD && m->cache;
    uint64_t h = 0;
    if (cacheable) {
        h = rs_tok_hash_bytes(w, n) >> 7;
        if (cache_get(m, w, n, h, out)) return;
    }
    word wd = {0};
    initial_symbols(m, w, n, &wd);
    merge_all(m, &wd);
    size_t first = out->n;
    for (size_t i = 0; i < wd.n; i++)
        if (wd.s[i].len) rs_tok_ids_push(out, wd.s[i].c);
    if (cacheable) cache_put(m, w, n, h, out->v ? out->v + first : NULL, out->n - first); /* NULL: nothing pushed */
    free(wd.s);
    free(wd.h);
}
