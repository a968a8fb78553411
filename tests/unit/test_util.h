/*
 * test_util.h — helpers shared by the unit tests.
 *
 * rs_test_host_backend: a host-memory backend that counts live allocations, so a test can check
 * that a failed load or update freed everything it had uploaded. It implements only the memory
 * ops (alloc, free, upload, download, copy): enough for loading and weight updates, not for
 * running a model.
 *
 * rs_test_logits: the logits of every position of one token sequence, computed in a single
 * prefill through a private F32 KV pool: the reference "what does this model say" for tests that
 * compare two ways of arriving at the same weights. rs_test_probe_logits runs a fixed 10-token
 * probe through it, and rs_test_same_probe compares two such results bit for bit.
 *
 * rs_test_tiny_qwen3: a two-layer Qwen3 config (hidden 160, vocab 256; tied embeddings, q/k
 * norms) small enough for a test to load, update and score many times.
 */
#ifndef RS_TEST_UTIL_H
#define RS_TEST_UTIL_H

#include "../../kernels/backend.h"
#include "../../model/model.h"

extern int rs_test_live_allocs; /* allocations not yet freed, in this test process */

rs_backend *rs_test_host_backend(void);

/* Returns malloc'd logits [n][vocab] of tokens[0..n) run through m (on a backend that computes). */
float *rs_test_logits(rs_model *m, const int32_t *tokens, int n);

#define RS_TEST_PROBE_TOKENS 10
/* malloc'd logits [RS_TEST_PROBE_TOKENS][vocab] of the fixed probe sequence. */
float *rs_test_probe_logits(rs_model *m);
/* Bit-identical probe logits of two models with `vocab` tokens. */
int rs_test_same_probe(const float *x, const float *y, int vocab);

rs_model_config rs_test_tiny_qwen3(void);

#endif /* RS_TEST_UTIL_H */
