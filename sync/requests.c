/*
 * requests.c — what the weight-update request structs own (requests.h).
 */
#include "requests.h"

#include <stdlib.h>
#include <string.h>

bool rs_shm_name_valid(const char *name) {
    size_t len = strnlen(name, RS_SHM_NAME_MAX + 1);
    if (len < 2 || len > RS_SHM_NAME_MAX || name[0] != '/') return false;
    if (strcmp(name, "/.") == 0 || strcmp(name, "/..") == 0) return false;
    for (size_t i = 1; i < len; i++)
        if (name[i] == '/' || (unsigned char)name[i] < 0x20 || name[i] == 0x7f) return false;
    return true;
}

void rs_shm_update_req_free(rs_shm_update_req *r) {
    free(r->tensors);
    memset(r, 0, sizeof *r);
}

void rs_nccl_update_req_free(rs_nccl_update_req *r) {
    free(r->tensors);
    memset(r, 0, sizeof *r);
}
