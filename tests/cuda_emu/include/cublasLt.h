#pragma once
#include <stddef.h>
typedef struct emu_lt *cublasLtHandle_t;
typedef int cublasStatus_t;
#define CUBLAS_STATUS_SUCCESS 0
static inline cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) { *h = (cublasLtHandle_t)0x1; return 0; }
static inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t) { return 0; }
static inline size_t cublasLtGetVersion(void) { return 0; }
