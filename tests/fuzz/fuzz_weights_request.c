/*
 * fuzz_weights_request.c — libFuzzer target for the weight-update request parsers
 * (protocol/weights.h): untrusted JSON straight from the network, and the manifests that later
 * index into a shared-memory segment.
 *
 *   make fuzz
 *   build-fuzz/fuzz_weights_request -max_total_time=60 corpus tests/fuzz/seeds/fuzz_weights_request
 *
 * The first byte picks the route (mod 6), the rest is the body. Properties checked beyond "no
 * crash, no leak, no UB" (ASan + UBSan): a rejected body gets RS_EINVAL or RS_EUNSUPPORTED with a
 * message and leaves nothing allocated; an accepted manifest keeps the invariants sync/ relies on
 * (dtype one of the four, nbytes == numel * element size, offset + nbytes <= 2^62, distributed
 * offsets the running sum), the segment bounds check agrees with a direct computation, and the
 * success answer is valid JSON.
 */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../protocol/weights.h"
#include "../../sync/shm.h"

static void check(int cond) {
    if (!cond) abort();
}

static void check_desc(const rs_weight_desc *d) {
    check(d->name[0] != '\0' && strlen(d->name) <= RS_WEIGHT_NAME_MAX);
    check(d->dtype == RS_DTYPE_BF16 || d->dtype == RS_DTYPE_F16 || d->dtype == RS_DTYPE_F32 ||
          d->dtype == RS_DTYPE_E4M3);
    check(d->ndim >= 0 && d->ndim <= RS_TENSOR_MAX_DIMS);
    unsigned __int128 bytes = rs_dtype_size(d->dtype);
    for (int i = 0; i < d->ndim; i++) {
        check(d->shape[i] >= 0);
        bytes *= (unsigned __int128)d->shape[i];
    }
    check(bytes == d->nbytes);
    check((unsigned __int128)d->offset + d->nbytes <= ((unsigned __int128)1 << 62));
}

static void check_answer(const char *version) {
    size_t len = 0;
    char *body = rs_weights_response("fuzz", version, 12, 0.5, true, "t1", &len);
    check(body != NULL && strlen(body) == len);
    json_error_t je;
    json_t *v = json_loads(body, 0, &je);
    check(v != NULL && json_is_true(json_object_get(v, "success")));
    json_decref(v);
    free(body);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const char *body = (const char *)data + 1;
    const size_t n = size - 1;
    rs_error err = {0};
    int rc;
    switch (data[0] % 6) {
    case 0: {
        rs_shm_update_req r;
        rc = rs_weights_parse_shm(body, n, &r, &err);
        if (rc != RS_OK) break;
        check(rs_shm_name_valid(r.shm_name));
        check(r.n_tensors >= 0 && (r.n_tensors == 0) == (r.tensors == NULL));
        uint64_t need = 0;
        for (int i = 0; i < r.n_tensors; i++) {
            check_desc(&r.tensors[i]);
            if (r.tensors[i].offset + r.tensors[i].nbytes > need) need = r.tensors[i].offset + r.tensors[i].nbytes;
        }
        rs_error e2 = {0};
        check((rs_shm_check_manifest(&r, (size_t)need, &e2) == RS_OK) == (need <= SIZE_MAX));
        if (need > 0) check(rs_shm_check_manifest(&r, (size_t)(need - 1), &e2) == RS_EINVAL);
        if (r.has_version) check_answer(r.weight_version);
        rs_shm_update_req_free(&r);
        break;
    }
    case 1: {
        rs_disk_update_req r;
        rc = rs_weights_parse_disk(body, n, &r, &err);
        if (rc == RS_OK) check(r.model_path[0] == '/');
        break;
    }
    case 2: {
        rs_version_update_req r;
        rc = rs_weights_parse_version(body, n, &r, &err);
        if (rc == RS_OK) {
            check(r.new_version[0] && strlen(r.new_version) <= RS_WEIGHT_VERSION_MAX);
            check_answer(r.new_version);
        }
        break;
    }
    case 3: {
        rs_nccl_group_req r;
        rc = rs_weights_parse_nccl_group(body, n, &r, &err);
        if (rc == RS_OK) check(r.world_size >= 2 && r.rank_offset >= 0 && r.rank_offset < r.world_size);
        break;
    }
    case 4: {
        rs_nccl_update_req r;
        rc = rs_weights_parse_nccl_update(body, n, &r, &err);
        if (rc != RS_OK) break;
        check(r.n_tensors >= 1);
        uint64_t off = 0;
        for (int i = 0; i < r.n_tensors; i++) {
            check_desc(&r.tensors[i]);
            check(r.tensors[i].offset == off);
            off += r.tensors[i].nbytes;
        }
        check(off == r.total_bytes);
        rs_nccl_update_req_free(&r);
        break;
    }
    default: {
        rs_nccl_destroy_req r;
        rc = rs_weights_parse_nccl_destroy(body, n, &r, &err);
        if (rc == RS_OK) check(r.group_name[0] != '\0');
        break;
    }
    }
    if (rc != RS_OK) check((rc == RS_EINVAL || rc == RS_EUNSUPPORTED) && err.code == rc && err.message[0]);
    return 0;
}
