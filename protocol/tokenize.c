/*
 * tokenize.c — /tokenize and /detokenize (see tokenize.h). Field lists: SGLang's TokenizeReqInput
 * and DetokenizeReqInput (python/sglang/srt/entrypoints/openai/protocol.py, mid 2026) and vLLM's
 * TokenizeCompletionRequest / DetokenizeRequest (vllm/entrypoints/openai/protocol.py).
 */
#include "tokenize.h"

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "generate.h"
#include "json_util.h"

enum { B_REQ };
#define DST(field) .base = B_REQ, .offset = offsetof(rs_tokenize_req, field), \
                   .size = sizeof(((rs_tokenize_req *)0)->field)

static int read_prompt(const rs_jctx *c, const json_t *v, rs_error *err) {
    rs_tokenize_req *r = c->dst[B_REQ];
    return rs_json_get_text_prompts(v, c->param, r->tok, r->add_special_tokens, r->prompts, err);
}

/* A list of ids, or a list of such lists; each id below the model's vocabulary. */
static int read_tokens(const rs_jctx *c, const json_t *v, rs_error *err) {
    const rs_tokenize_req *r = c->dst[B_REQ];
    rs_gen_job *j = r->prompts;
    if (!json_is_array(v)) return rs_json_bad_type(err, c->param, "a list of token ids or a list of lists", v);
    j->batched = json_array_size(v) > 0 && json_is_array(json_array_get(v, 0));
    size_t n = j->batched ? json_array_size(v) : 1;
    if (n > 1u << 20) return rs_error_set(err, RS_EINVAL, c->param, "%s has too many lists", c->param);
    j->prompts = rs_xcalloc(n, sizeof(int32_t *));
    j->prompt_lens = rs_xcalloc(n, sizeof(int));
    j->n_prompts = (int)n;
    for (size_t p = 0; p < n; p++) {
        char path[64];
        if (j->batched) snprintf(path, sizeof path, "%s[%zu]", c->param, p);
        else snprintf(path, sizeof path, "%s", c->param);
        int rc = rs_json_get_ids(j->batched ? json_array_get(v, p) : v, path, path, &j->prompts[p],
                                 &j->prompt_lens[p], err);
        if (rc != RS_OK) return rc;
        for (int i = 0; i < j->prompt_lens[p]; i++)
            if (j->prompts[p][i] >= r->vocab)
                return rs_error_set(err, RS_EINVAL, path, "%s[%d] = %d is outside the vocabulary [0, %d)", path, i,
                                    (int)j->prompts[p][i], r->vocab);
    }
    return RS_OK;
}

static const rs_jfield tokenize_fields[] = {
    {.name = "add_special_tokens", .type = RS_JT_BOOL, DST(add_special_tokens), .def = "true",
     .doc = "encode with the tokenizer's special tokens (its post-processor)"},
    {.name = "prompt", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED | RS_JF_TOKENIZER, .read = read_prompt,
     .shape = "non-empty string, or a list of them", .doc = "the text(s) to encode",
     .schema = "{'anyOf': [{'type': 'string', 'minLength': 1}, {'type': 'array', 'minItems': 1, "
               "'items': {'type': 'string', 'minLength': 1}}]}"},
    {.name = "return_token_strs", .type = RS_JT_BOOL, DST(return_token_strs), .def = "false",
     .doc = "vLLM's: adds token_strs, each id's vocabulary string"},
    {.name = "model", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT, .doc = "one model is served"},
    {.name = "messages", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL, .doc = "chat templates"},
    {.name = "add_generation_prompt", .type = RS_JT_BOOL, .use = RS_JU_NEUTRAL, .neutral = "false",
     .doc = "chat templates"},
};

const rs_jobject rs_tokenize_fields = {
    .title = "POST /tokenize", .fields = tokenize_fields, .n = RS_ARRAY_LEN(tokenize_fields)};

static const rs_jfield detokenize_fields[] = {
    {.name = "tokens", .type = RS_JT_CUSTOM, .flags = RS_JF_REQUIRED | RS_JF_TOKENIZER, .read = read_tokens,
     .shape = "list of token ids, or a list of such lists", .doc = "the ids to decode",
     .schema = "{'anyOf': ['$ids', {'type': 'array', 'items': '$ids'}]}"},
    {.name = "skip_special_tokens", .type = RS_JT_BOOL, DST(skip_special_tokens), .def = "false",
     .doc = "leave special tokens out of the text"},
    {.name = "model", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT, .doc = "one model is served"},
};

const rs_jobject rs_detokenize_fields = {
    .title = "POST /detokenize", .fields = detokenize_fields, .n = RS_ARRAY_LEN(detokenize_fields)};

static int parse(const char *body, size_t len, const rs_jobject *t, const rs_tok *tok, int vocab,
                 rs_tokenize_req *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    out->add_special_tokens = true;
    out->tok = tok;
    out->vocab = vocab;
    if (!tok) return rs_generate_no_tokenizer(t == &rs_tokenize_fields ? "prompt" : "tokens", err);
    json_t *root;
    int rc = rs_json_load_object(body, len, false, &root, err);
    if (rc != RS_OK) return rc;
    out->prompts = rs_gen_job_new();
    void *const dst[] = {[B_REQ] = out};
    rc = rs_json_read(root, t, dst, "", err);
    json_decref(root);
    if (rc != RS_OK) rs_tokenize_req_free(out);
    return rc;
}

int rs_tokenize_parse(const char *body, size_t len, const rs_tok *tok, rs_tokenize_req *out, rs_error *err) {
    return parse(body, len, &rs_tokenize_fields, tok, tok ? rs_tok_vocab_size(tok) : 0, out, err);
}

int rs_detokenize_parse(const char *body, size_t len, const rs_tok *tok, int vocab, rs_tokenize_req *out,
                        rs_error *err) {
    return parse(body, len, &rs_detokenize_fields, tok, vocab, out, err);
}

void rs_tokenize_req_free(rs_tokenize_req *r) {
    rs_gen_job_free(r->prompts);
    memset(r, 0, sizeof *r);
}

static json_t *ids_json(const int32_t *ids, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

static json_t *strs_json(const rs_tok *tok, const int32_t *ids, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) {
        size_t l;
        const char *s = rs_tok_id_to_token(tok, ids[i], &l);
        json_array_append_new(a, s ? json_stringn(s, l) : json_null());
    }
    return a;
}

char *rs_tokenize_body(const rs_tokenize_req *r, const rs_tok *tok, int max_model_len, size_t *len) {
    const rs_gen_job *j = r->prompts;
    json_t *o = json_object();
    if (!j->batched) {
        json_object_set_new(o, "tokens", ids_json(j->prompts[0], j->prompt_lens[0]));
        json_object_set_new(o, "count", json_integer(j->prompt_lens[0]));
        if (r->return_token_strs) json_object_set_new(o, "token_strs", strs_json(tok, j->prompts[0], j->prompt_lens[0]));
    } else {
        json_t *tokens = json_array(), *counts = json_array(), *strs = json_array();
        for (int p = 0; p < j->n_prompts; p++) {
            json_array_append_new(tokens, ids_json(j->prompts[p], j->prompt_lens[p]));
            json_array_append_new(counts, json_integer(j->prompt_lens[p]));
            json_array_append_new(strs, strs_json(tok, j->prompts[p], j->prompt_lens[p]));
        }
        json_object_set_new(o, "tokens", tokens);
        json_object_set_new(o, "count", counts);
        if (r->return_token_strs) json_object_set_new(o, "token_strs", strs);
        else json_decref(strs);
    }
    json_object_set_new(o, "max_model_len", json_integer(max_model_len));
    return rs_json_dump(o, len);
}

static json_t *decoded(const rs_tokenize_req *r, const rs_tok *tok, int p) {
    const rs_gen_job *j = r->prompts;
    size_t n;
    char *s = rs_tok_decode(tok, j->prompts[p], (size_t)j->prompt_lens[p], r->skip_special_tokens, &n);
    json_t *v = json_stringn(s, n);
    free(s);
    return v ? v : json_null();
}

char *rs_detokenize_body(const rs_tokenize_req *r, const rs_tok *tok, size_t *len) {
    const rs_gen_job *j = r->prompts;
    json_t *text;
    if (!j->batched) {
        text = decoded(r, tok, 0);
    } else {
        text = json_array();
        for (int p = 0; p < j->n_prompts; p++) json_array_append_new(text, decoded(r, tok, p));
    }
    json_t *o = json_object();
    json_object_set(o, "text", text);
    json_object_set_new(o, "prompt", text);
    return rs_json_dump(o, len);
}
