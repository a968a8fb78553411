/*
 * encode.c — text to ids (TokenizerImpl::encode for one sequence) and the small accessors.
 *
 *   1. the input must be valid UTF-8 (a Rust &str);
 *   2. added tokens with normalized = false are found in the raw text;
 *   3. every other piece is normalized, and added tokens with normalized = true are found in it;
 *   4. the remaining pieces go through the pre-tokenizers and the model (pretok.c, bpe.c);
 *   5. the post-processor's single template puts special tokens around the sequence when
 *      add_special_tokens is set (TemplateProcessing; ByteLevel and a missing one add nothing).
 */
#include <stdlib.h>

#include "tok_internal.h"

static int encode_piece(rs_tok_enc *e, const rs_tok_piece *piece, rs_tok_pieces *sub) {
    const rs_tok *t = e->t;
    size_t mark = e->work.n, off = piece->off, len = piece->len;
    int rc = RS_OK;
    if (t->has_normalizer) {
        rs_tok_buf nb = {0};
        rc = rs_tok_normalize(t->norms, t->n_norms, e->work.p + off, len, &nb, e->err);
        off = e->work.n, len = nb.n;
        rs_tok_buf_put(&e->work, nb.p, nb.n);
        free(nb.p);
        if (rc != RS_OK) return rc;
    }
    sub->n = 0;
    rs_tok_added_split(t, &t->trie_norm, e->work.p + off, len, off, piece->at_start, sub);
    for (size_t i = 0; i < sub->n && rc == RS_OK; i++) {
        const rs_tok_piece *q = &sub->v[i];
        if (q->id >= 0) rs_tok_ids_push(e->out, q->id);
        else rc = rs_tok_pretok_run(e, 0, q->off, q->len, q->at_start);
    }
    e->work.n = mark;
    return rc;
}

static int encode_sequence(const rs_tok *t, const char *text, size_t len, rs_tok_ids *out, rs_error *err) {
    rs_tok_enc e = {.t = t, .out = out, .err = err};
    rs_tok_pieces top = {0}, sub = {0};
    rs_tok_buf_put(&e.work, text, len);
    rs_tok_added_split(t, &t->trie, e.work.p, len, 0, true, &top);
    int rc = RS_OK;
    for (size_t i = 0; i < top.n && rc == RS_OK; i++) {
        if (top.v[i].id >= 0) rs_tok_ids_push(out, top.v[i].id);
        else rc = encode_piece(&e, &top.v[i], &sub);
    }
    free(e.work.p);
    for (size_t k = 0; k < RS_TOK_MAX_PRETOK; k++) free(e.spans[k].v);
    free(top.v);
    free(sub.v);
    return rc;
}

int rs_tok_encode(const rs_tok *t, const char *text, size_t len, bool add_special_tokens, int32_t **ids, size_t *n,
                  rs_error *err) {
    *ids = NULL, *n = 0;
    size_t valid = rs_utf8_valid_prefix(text, len);
    if (valid != len) return rs_error_set(err, RS_EINVAL, NULL, "text is not valid UTF-8 (at byte %zu)", valid);
    rs_tok_ids seq = {0};
    int rc = encode_sequence(t, text, len, &seq, err);
    if (rc != RS_OK) {
        free(seq.v);
        return rc;
    }
    if (t->has_tpl) {
        rs_tok_ids out = {0};
        for (size_t i = 0; i < t->n_tpl; i++) {
            const rs_tok_tpl_piece *p = &t->tpl[i];
            if (p->is_seq)
                for (size_t k = 0; k < seq.n; k++) rs_tok_ids_push(&out, seq.v[k]);
            else if (add_special_tokens)
                for (size_t k = 0; k < p->n_ids; k++) rs_tok_ids_push(&out, p->ids[k]);
        }
        free(seq.v);
        seq = out;
    }
    *ids = seq.v;
    *n = seq.n;
    if (!seq.n) {
        free(seq.v);
        *ids = NULL;
    }
    return RS_OK;
}

const char *rs_tok_id_to_token(const rs_tok *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_ids || !t->id_str[id]) return NULL;
    if (len) *len = t->id_len[id];
    return t->id_str[id];
}

int32_t rs_tok_token_to_id(const rs_tok *t, const char *tok, size_t len) {
    int32_t a = rs_tok_strmap_get(&t->added_map, tok, len);
    if (a >= 0) return t->added[a].id;
    return rs_tok_strmap_get(&t->bpe.vocab, tok, len);
}

int32_t rs_tok_vocab_size(const rs_tok *t) { return t->n_ids; }

int rs_tok_eos_ids(const rs_tok *t, const int32_t **ids) {
    *ids = t->eos;
    return t->n_eos;
}

int32_t rs_tok_bos_id(const rs_tok *t) { return t->bos; }

bool rs_tok_is_special(const rs_tok *t, int32_t id) { return id >= 0 && id < t->n_ids && t->id_special[id]; }

const char *rs_tok_path(const rs_tok *t) { return t->path; }
