/*
 * tokenize.h — POST /tokenize and POST /detokenize with the model's tokenizer, in a shape that both
 * SGLang's and vLLM's clients read.
 *
 *   /tokenize   {"prompt": "text" | ["a", "b"], "add_special_tokens": true, "return_token_strs": false,
 *                "model": ...}
 *               -> {"tokens": [ids], "count": N, "max_model_len": M, "token_strs": [..] (when asked)};
 *               a list of prompts gives "tokens": [[ids], ...] and "count": [N, ...] (SGLang's batch
 *               shape). SGLang (TokenizeReqInput) and vLLM (TokenizeCompletionRequest) take the same
 *               body and answer the same keys; token_strs are the vocabulary strings
 *               (convert_ids_to_tokens), as vLLM gives them. vLLM's chat form ("messages") is not
 *               implemented.
 *   /detokenize {"tokens": [ids] | [[ids], ...], "skip_special_tokens": false, "model": ...}
 *               -> {"text": "...", "prompt": "..."} (a list of each for a batch): SGLang reads
 *               "text", vLLM "prompt", so both are given. Ids the vocabulary does not have are
 *               skipped, as Tokenizer.decode does.
 * Both are a 400 saying why when the model has no tokenizer.json; ids are checked against the
 * model's vocabulary like a prompt's.
 */
#ifndef RS_PROTOCOL_TOKENIZE_H
#define RS_PROTOCOL_TOKENIZE_H

#include <stdbool.h>
#include <stddef.h>

#include "../core/rs.h"
#include "../scheduler/engine.h"
#include "../tokenizer/tokenizer.h"

typedef struct rs_tokenize_req {
    rs_gen_job *prompts;        /* owned: holds the ids (n_prompts, prompts, prompt_lens, batched) only */
    bool add_special_tokens;    /* default true */
    bool return_token_strs;
    bool skip_special_tokens;   /* /detokenize; default false, as Tokenizer.decode */
    const rs_tok *tok;          /* borrowed, for the readers */
    int vocab;                  /* ids must be below this */
} rs_tokenize_req;

/* /tokenize: encodes the prompt(s) with tok (NULL: the 400 saying there is none). RS_OK with *out
 * (free with rs_tokenize_req_free), else RS_EINVAL / RS_EUNSUPPORTED with err naming the field. */
int rs_tokenize_parse(const char *body, size_t len, const rs_tok *tok, rs_tokenize_req *out, rs_error *err);
/* /detokenize: reads the ids; every id must be below vocab. */
int rs_detokenize_parse(const char *body, size_t len, const rs_tok *tok, int vocab, rs_tokenize_req *out,
                        rs_error *err);
void rs_tokenize_req_free(rs_tokenize_req *r);

char *rs_tokenize_body(const rs_tokenize_req *r, const rs_tok *tok, int max_model_len, size_t *len);
char *rs_detokenize_body(const rs_tokenize_req *r, const rs_tok *tok, size_t *len);

struct rs_jobject;
extern const struct rs_jobject rs_tokenize_fields, rs_detokenize_fields;

#endif /* RS_PROTOCOL_TOKENIZE_H */
