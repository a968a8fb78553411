/*
 * test_cuda_backend.c — CUDA backend plumbing (built with `make CUDA=1`; skipped without a GPU):
 * device allocation is zeroed, uploads and downloads round-trip, and the op table is complete
 * (rs_engine_init refuses a backend that is not).
 */
#ifdef RS_CUDA
#include <cuda_runtime.h>

#include "../../kernels/backend.h"
#include "test.h"
#include "test_util.h"

RS_TEST(cuda_memory_round_trip) {
    rs_backend *b = rs_test_cuda_or_skip();
    enum { N = 1 << 20 };
    float *host = malloc(N * sizeof(float)), *back = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++) host[i] = (float)i * 0.25f - 7.0f;
    float *dev = rs_backend_alloc(b, N * sizeof(float));
    ASSERT_TRUE(dev != NULL);
    rs_backend_download(b, back, dev, N * sizeof(float));
    for (int i = 0; i < N; i++) ASSERT_TRUE(back[i] == 0.0f);
    rs_backend_upload(b, dev, host, N * sizeof(float));
    rs_backend_download(b, back, dev, N * sizeof(float));
    ASSERT_TRUE(memcmp(host, back, N * sizeof(float)) == 0);
    rs_backend_free_mem(b, dev);
    rs_backend_free(b);
    free(host);
    free(back);
}

RS_TEST(cuda_op_table_is_complete) {
    rs_backend *b = rs_test_cuda_or_skip();
    const char *missing = rs_backend_missing_op(b);
    if (missing) RS_TEST_FAIL("the CUDA backend lacks op '%s'", missing);
    ASSERT_TRUE(!rs_backend_host_memory(b)); /* weight updates must upload, not write through pointers */
    rs_backend_free(b);
}
#endif
