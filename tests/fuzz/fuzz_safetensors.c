/*
 * fuzz_safetensors.c — libFuzzer target for the safetensors parser (model/safetensors.c).
 *
 * Feeds arbitrary bytes to rs_st_parse as a whole file image. On success every tensor's data range
 * is read end to end (ASan flags any byte outside the buffer), every name is looked up again, and
 * every metadata key is read, so a parser that accepted a lying header cannot go unnoticed. The
 * invariants the loader relies on are asserted: nbytes == numel * element size, the range lies in
 * the input, and lookups find the tensor they were handed.
 *
 *   make fuzz   (or: build-fuzz/fuzz_safetensors -max_total_time=60 tests/fuzz/seeds/fuzz_safetensors)
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    rs_st_file *f = NULL;
    rs_error err;
    if (rs_st_parse(&f, data, size, "<fuzz>", &err) != RS_OK) {
        if (err.code >= 0 || err.message[0] == '\0') abort(); /* a failure always says why */
        return 0;
    }
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < rs_st_count(f); i++) {
        const rs_st_tensor *t = rs_st_tensor_at(f, i);
        const uint8_t *p = t->data;
        if (p < data || t->nbytes > size || p + t->nbytes > data + size) abort();
        for (uint64_t k = 0; k < t->nbytes; k++) sink ^= p[k];
        if (t->ndim < 0 || t->ndim > RS_TENSOR_MAX_DIMS) abort();
        if (t->dtype != RS_DTYPE_COUNT) {
            uint64_t numel = 1;
            for (int d = 0; d < t->ndim; d++) numel *= (uint64_t)t->shape[d];
            if (numel * rs_dtype_size(t->dtype) != t->nbytes) abort();
        }
        if (rs_st_find(f, t->name) != t) abort();
        if (i > 0 && rs_st_tensor_at(f, i - 1)->offset + rs_st_tensor_at(f, i - 1)->nbytes > t->offset) abort();
    }
    (void)rs_st_metadata(f, "format");
    (void)sink;
    rs_st_close(f);
    return 0;
}
