/*
 * tok_internal.h — the tokenizer's internal data structures, shared by its files and by nothing
 * else (callers see tokenizer.h only).
 *
 * The pipeline mirrors Hugging Face `tokenizers` TokenizerImpl::encode step for step:
 *   added tokens (not normalized) -> normalizer -> added tokens (normalized) -> pre-tokenizer
 *   -> BPE model -> post-processor,
 * and decode: ids -> token strings -> decoder chain. Component lists are flattened at load (a
 * Sequence of normalizers, pre-tokenizers, decoders or post-processors runs its items in order,
 * which is what a flat list does). Everything here is immutable after rs_tok_load, except the
 * BPE word cache, which has its own locks.
 */
#ifndef RS_TOK_INTERNAL_H
#define RS_TOK_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../core/rs.h"
#include "tokenizer.h"
#include "unicode.h"

/* ---- growable byte buffer ---- */
typedef struct rs_tok_buf {
    char *p;
    size_t n, cap;
} rs_tok_buf;

void rs_tok_buf_reserve(rs_tok_buf *b, size_t extra);
static inline void rs_tok_buf_put(rs_tok_buf *b, const void *s, size_t n) {
    if (b->n + n > b->cap) rs_tok_buf_reserve(b, n);
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
}
static inline void rs_tok_buf_putc(rs_tok_buf *b, char c) {
    if (b->n + 1 > b->cap) rs_tok_buf_reserve(b, 1);
    b->p[b->n++] = c;
}
void rs_tok_buf_put_cp(rs_tok_buf *b, uint32_t cp);
/* Appends from_utf8_lossy(s[0,n)): each maximal invalid subpart becomes U+FFFD. */
void rs_tok_buf_put_lossy(rs_tok_buf *b, const char *s, size_t n);

/* ---- ids ---- */
typedef struct rs_tok_ids {
    int32_t *v;
    size_t n, cap;
} rs_tok_ids;

static inline void rs_tok_ids_push(rs_tok_ids *a, int32_t id) {
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 64;
        a->v = rs_xrealloc(a->v, a->cap * sizeof *a->v);
    }
    a->v[a->n++] = id;
}

/* ---- string -> int32 hash map (open addressing; keys are copied into an arena) ---- */
typedef struct rs_tok_strmap {
    uint32_t *slots;     /* [cap] entry index + 1, 0 = empty */
    uint32_t cap;        /* power of two */
    uint32_t n;
    uint64_t *hash;      /* [n] */
    uint32_t *off, *len; /* [n] key position in keys */
    int32_t *val;        /* [n] */
    rs_tok_buf keys;
} rs_tok_strmap;

uint64_t rs_tok_hash_bytes(const void *p, size_t n);
/* Inserts or overwrites; returns the entry index. */
uint32_t rs_tok_strmap_put(rs_tok_strmap *m, const char *k, size_t n, int32_t val);
/* The value of key k, or -1. */
int32_t rs_tok_strmap_get(const rs_tok_strmap *m, const char *k, size_t n);
void rs_tok_strmap_free(rs_tok_strmap *m);

/* (u32, u32) -> (rank, new id), for merges. */
typedef struct rs_tok_pairmap {
    uint64_t *keys;  /* [cap] (a << 32 | b) + 1, 0 = empty */
    uint32_t *rank;  /* [cap] */
    int32_t *out;    /* [cap] */
    uint32_t cap, n;
} rs_tok_pairmap;

void rs_tok_pairmap_put(rs_tok_pairmap *m, int32_t a, int32_t b, uint32_t rank, int32_t out);
/* True and (rank, out) when the pair is a merge. */
static inline bool rs_tok_pairmap_get(const rs_tok_pairmap *m, int32_t a, int32_t b, uint32_t *rank, int32_t *out) {
    if (!m->cap) return false;
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    uint32_t mask = m->cap - 1, i = (uint32_t)(h >> 32) & mask;
    for (;;) {
        uint64_t k = m->keys[i];
        if (k == key) {
            *rank = m->rank[i];
            *out = m->out[i];
            return true;
        }
        if (k == 0) return false;
        i = (i + 1) & mask;
    }
}
void rs_tok_pairmap_free(rs_tok_pairmap *m);

/* ---- regular expressions (regex.c) ---- */
typedef struct rs_tok_regex rs_tok_regex;

/* A piece of a split: [start, end) and whether it is a match of the pattern. */
typedef struct rs_tok_span {
    uint32_t start, end;
    bool match;
} rs_tok_span;

typedef struct rs_tok_spans {
    rs_tok_span *v;
    size_t n, cap;
} rs_tok_spans;

void rs_tok_spans_push(rs_tok_spans *s, size_t start, size_t end, bool match);

/* Compiles an Oniguruma (Ruby syntax) pattern, as `tokenizers` writes them, into PCRE2 with the
 * same meaning; a literal (Split/Replace "String" pattern) matches its bytes exactly. A pattern
 * whose meaning cannot be reproduced is RS_EUNSUPPORTED and a bad one RS_EFORMAT, with err
 * naming `key`. */
int rs_tok_regex_compile(const char *pat, size_t len, bool literal, const char *key, rs_tok_regex **out,
                         rs_error *err);
void rs_tok_regex_free(rs_tok_regex *re);
/* True for a literal pattern, with its bytes. */
bool rs_tok_regex_literal(const rs_tok_regex *re, const char **lit, size_t *n);
/* `tokenizers`' Pattern::find_matches: the pieces of s[0,n) in order, covering it, each marked as
 * a match or not (an empty s gives one empty non-match). Matches are iterated as the onig crate's
 * find_iter does (empty matches included, the empty match after a non-empty one skipped).
 * RS_OK, or RS_EINVAL if the match engine gave up (too complex), with err set. */
int rs_tok_regex_find(const rs_tok_regex *re, const char *s, size_t n, rs_tok_spans *out, rs_error *err);

/* ---- normalizers (normalize.c) ---- */
typedef enum rs_tok_norm_kind {
    RS_TOK_NORM_NFC,
    RS_TOK_NORM_NFD,
    RS_TOK_NORM_NFKC,
    RS_TOK_NORM_NFKD,
    RS_TOK_NORM_REPLACE,
    RS_TOK_NORM_PREPEND,
} rs_tok_norm_kind;

typedef struct rs_tok_norm {
    rs_tok_norm_kind kind;
    rs_tok_regex *re; /* Replace: the pattern */
    char *str;        /* Replace: content; Prepend: the prefix */
    size_t str_len;
} rs_tok_norm;

/* Applies norms[0, n) to s[0,len) (valid UTF-8) and appends the result to out. RS_OK, or the
 * error of a Replace pattern that gave up. */
int rs_tok_normalize(const rs_tok_norm *norms, size_t n, const char *s, size_t len, rs_tok_buf *out, rs_error *err);

/* ---- pre-tokenizers (pretok.c) ---- */
typedef enum rs_tok_split_behavior {
    RS_TOK_SPLIT_REMOVED,
    RS_TOK_SPLIT_ISOLATED,
    RS_TOK_SPLIT_MERGED_WITH_PREVIOUS,
    RS_TOK_SPLIT_MERGED_WITH_NEXT,
    RS_TOK_SPLIT_CONTIGUOUS,
} rs_tok_split_behavior;

typedef enum rs_tok_pretok_kind {
    RS_TOK_PRE_SPLIT,
    RS_TOK_PRE_BYTELEVEL,
    RS_TOK_PRE_DIGITS,
    RS_TOK_PRE_METASPACE,
} rs_tok_pretok_kind;

typedef enum rs_tok_prepend_scheme {
    RS_TOK_PREPEND_ALWAYS,
    RS_TOK_PREPEND_FIRST,
    RS_TOK_PREPEND_NEVER,
} rs_tok_prepend_scheme;

typedef struct rs_tok_pretok {
    rs_tok_pretok_kind kind;
    rs_tok_regex *re;                /* Split: pattern; ByteLevel with use_regex: the GPT-2 pattern */
    rs_tok_split_behavior behavior;  /* Split */
    bool invert;                     /* Split */
    bool add_prefix_space;           /* ByteLevel */
    bool individual_digits;          /* Digits */
    char rep[4];                     /* Metaspace replacement character, UTF-8 */
    int rep_len;
    rs_tok_prepend_scheme prepend;   /* Metaspace */
    bool split;                      /* Metaspace */
} rs_tok_pretok;

/* Applies the split behavior to find_matches' pieces (NormalizedString::split), in place: the
 * result's pieces are those with match == false (empty ones included; the caller drops them),
 * pieces with match == true are removed. */
void rs_tok_split_apply(rs_tok_spans *s, rs_tok_split_behavior behavior, bool invert);

#define RS_TOK_MAX_PRETOK 16

/* The state of one encode call (encode.c): pieces live in `work` by offset (it may move). */
typedef struct rs_tok_enc {
    const rs_tok *t;
    rs_tok_buf work;
    rs_tok_spans spans[RS_TOK_MAX_PRETOK]; /* one per pre-tokenizer level */
    rs_tok_ids *out;
    rs_error *err;
} rs_tok_enc;

/* Runs pre-tokenizers [level, n) on work[off, off+len) and the model on each resulting word,
 * appending ids to e->out. RS_OK or a split pattern's error. */
int rs_tok_pretok_run(rs_tok_enc *e, size_t level, size_t off, size_t len, bool at_start);

/* ---- the BPE model (bpe.c) ---- */
#define RS_TOK_CACHE_SHARDS 64

typedef struct rs_tok_cache_shard {
    pthread_mutex_t mu;
    rs_tok_strmap map;   /* word -> offset into ids */
    rs_tok_ids ids;      /* [n][len, id...] */
} rs_tok_cache_shard;

typedef struct rs_tok_bpe {
    rs_tok_strmap vocab;        /* token string -> id */
    rs_tok_pairmap merges;      /* (left, right) -> (rank, merged id) */
    int32_t unk_id;             /* -1 when there is no unk_token */
    bool fuse_unk, byte_fallback, ignore_merges;
    char *prefix, *suffix;      /* continuing_subword_prefix / end_of_word_suffix, or NULL */
    size_t prefix_len, suffix_len;
    int32_t fallback_id[256];   /* id of "<0xXX>", or -1 */
    /* Byte-level mode (the pre-tokenizer ends with ByteLevel): words are raw bytes and each byte
     * stands for its GPT-2 alphabet character, so vocabulary keys are looked up by the bytes they
     * spell (raw_vocab) instead of by their alphabet text. */
    bool byte_level;
    rs_tok_strmap raw_vocab;    /* raw bytes -> id, for keys made only of alphabet characters */
    int32_t byte_id[256];       /* id of the alphabet character of byte b, or -1 */
    rs_tok_cache_shard *cache;  /* [RS_TOK_CACHE_SHARDS] */
} rs_tok_bpe;

/* GPT-2's byte-to-unicode map: the alphabet character of byte b. */
uint32_t rs_tok_byte_char(unsigned b);
/* The byte whose alphabet character is cp, or -1. */
int rs_tok_char_byte(uint32_t cp);

void rs_tok_bpe_init_cache(rs_tok_bpe *m);
void rs_tok_bpe_free(rs_tok_bpe *m);
/* BPE::tokenize of one pre-tokenized word w[0,n) (n > 0), appending the ids. */
void rs_tok_bpe_encode(const rs_tok_bpe *m, const char *w, size_t n, rs_tok_ids *out);

/* ---- added tokens (added.c) ---- */
typedef struct rs_tok_added {
    char *content;
    size_t len;
    int32_t id;
    bool special, normalized, lstrip, rstrip, single_word;
    char *norm;      /* the normalizer's output for a normalized token when it differs, else NULL */
    size_t norm_len;
} rs_tok_added;

/* A byte trie for leftmost-longest matching of added-token contents. */
typedef struct rs_tok_trie {
    int32_t *child;  /* [n_nodes][...] first child index, -1 */
    int32_t *next;   /* [n_nodes] next sibling, -1 */
    uint8_t *byte;   /* [n_nodes] */
    int32_t *tok;    /* [n_nodes] index into added[], -1 */
    size_t n, cap;
    uint8_t first[32]; /* bit set of first bytes */
} rs_tok_trie;

void rs_tok_trie_free(rs_tok_trie *t);
int rs_tok_trie_add(rs_tok_trie *t, const char *s, size_t n, int32_t tok);

/* A piece of text being encoded: bytes [off, off+len) of the work buffer; id >= 0 when the piece
 * is an added token; at_start when it begins at offset 0 of the original input (Metaspace's
 * prepend_scheme "first"). */
typedef struct rs_tok_piece {
    size_t off, len;
    int32_t id;
    bool at_start;
} rs_tok_piece;

typedef struct rs_tok_pieces {
    rs_tok_piece *v;
    size_t n, cap;
} rs_tok_pieces;

/* AddedVocabulary::find_matches + split_with_indices over s[0,n): appends the pieces (offsets
 * relative to base_off) to out. */
void rs_tok_added_split(const rs_tok *t, const rs_tok_trie *trie, const char *s, size_t n, size_t base_off,
                        bool at_start, rs_tok_pieces *out);

/* ---- decoders (decode.c) ---- */
typedef enum rs_tok_dec_kind {
    RS_TOK_DEC_BYTELEVEL,
    RS_TOK_DEC_REPLACE,
    RS_TOK_DEC_BYTEFALLBACK,
    RS_TOK_DEC_FUSE,
    RS_TOK_DEC_STRIP,
    RS_TOK_DEC_METASPACE,
} rs_tok_dec_kind;

typedef struct rs_tok_dec {
    rs_tok_dec_kind kind;
    rs_tok_regex *re;        /* Replace: pattern */
    char *str;               /* Replace: content */
    size_t str_len;
    uint32_t ch;             /* Strip: content; Metaspace: replacement */
    size_t start, stop;      /* Strip */
    rs_tok_prepend_scheme prepend; /* Metaspace */
} rs_tok_dec;

#define RS_TOK_MAX_DEC 16

/* The byte of a "<0xXX>" token, or -1 (ByteFallback's test, u8::from_str_radix included). */
int rs_tok_fallback_byte(const char *s, size_t n);
/* Appends the bytes ByteLevel's decoder makes of one token. */
void rs_tok_bytelevel_bytes(const char *s, size_t n, rs_tok_buf *out);
/* Strip on one token: the kept range [*a, *b) of s[0,n). */
void rs_tok_strip_token(const rs_tok_dec *d, const char *s, size_t n, size_t *a, size_t *b);
/* Index of the decoder that joins the token list into one string (ByteLevel or Fuse), or n_decs
 * when none does (decode then joins at the end). */
size_t rs_tok_fuse_index(const rs_tok *t);

/* ---- the tokenizer ---- */
typedef struct rs_tok_tpl_piece {
    bool is_seq;          /* $A, else a special token */
    int32_t *ids;         /* special token ids */
    size_t n_ids;
} rs_tok_tpl_piece;

struct rs_tok {
    char path[4096];
    rs_tok_norm *norms;
    size_t n_norms;
    bool has_normalizer;
    rs_tok_pretok *pretoks;
    size_t n_pretoks;
    rs_tok_bpe bpe;
    rs_tok_added *added;
    size_t n_added;
    rs_tok_strmap added_map;  /* content -> index in added[] */
    rs_tok_trie trie, trie_norm;
    bool encode_special_tokens;
    rs_tok_tpl_piece *tpl;    /* post-processor's single template; NULL: just $A */
    size_t n_tpl;
    bool has_tpl;
    rs_tok_dec *decs;
    size_t n_decs;
    bool has_decoder;
    /* id -> the token string decode() starts from (an added token's content or normalized form,
     * else the model's), and whether that string is a special token's content. */
    int32_t n_ids;            /* max id + 1 */
    char **id_str;            /* [n_ids], NULL where no token has that id */
    uint32_t *id_len;         /* [n_ids] */
    uint8_t *id_special;      /* [n_ids] */
    int32_t eos[RS_TOK_MAX_EOS];
    int n_eos;
    int32_t bos;
};

#endif /* RS_TOK_INTERNAL_H */
