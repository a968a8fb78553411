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
 * compare two ways of arriving at the same weights.
 */
#ifndef RS_TEST_UTIL_H
#define RS_TEST_UTIL_H

#include "../../kernels/backend.h"
#include "../../model/model.h"

extern int rs_test_live_allocs; /* allocations not yet freed, in this test process */

rs_backend *rs_test_host_backend(void);

/* Returns malloc'd logits [n][vocab] of tokens[0..n) run through m (on a backend that computes). */
float *rs_test_logits(rs_model *m, const int32_t *tokens, int n);

#endif /* RS_TEST_UTIL_H */
