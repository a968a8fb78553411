/*
 * cuda_check.h — every CUDA runtime, cuBLASLt and NCCL call goes through one of these macros,
 * which log the failing call's text, file and line with the library's own error string.
 * A failure of the device itself is a bug or a dead GPU: the macros abort (RS_ASSERT style).
 */
#ifndef RS_CUDA_CHECK_H
#define RS_CUDA_CHECK_H

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include "../../core/rs.h"

#define CUDA_CHECK(call)                                                                          \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            rs_log(RS_LOG_LEVEL_ERROR, "CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(e_), \
                   cudaGetErrorString(e_), #call, __FILE__, __LINE__);                           \
            abort();                                                                              \
        }                                                                                         \
    } while (0)

#define CUBLAS_CHECK(call)                                                                        \
    do {                                                                                          \
        cublasStatus_t s_ = (call);                                                               \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                        \
            rs_log(RS_LOG_LEVEL_ERROR, "cuBLAS error %d in %s at %s:%d", (int)s_, #call, __FILE__, \
                   __LINE__);                                                                     \
            abort();                                                                              \
        }                                                                                         \
    } while (0)

#define NCCL_CHECK(call)                                                                          \
    do {                                                                                          \
        ncclResult_t r_ = (call);                                                                 \
        if (r_ != ncclSuccess) {                                                                  \
            rs_log(RS_LOG_LEVEL_ERROR, "NCCL error %s in %s at %s:%d", ncclGetErrorString(r_),    \
                   #call, __FILE__, __LINE__);                                                    \
            abort();                                                                              \
        }                                                                                         \
    } while (0)

#endif /* RS_CUDA_CHECK_H */
