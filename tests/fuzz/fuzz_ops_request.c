/*
 * fuzz_ops_request.c — libFuzzer target for the operations bodies (/abort_request,
 * /pause_generation, /continue_generation and /flush_cache): the first byte picks the parser, the
 * rest is the body.
 *
 *   build-fuzz/fuzz_ops_request -max_total_time=60 corpus tests/fuzz/seeds/fuzz_ops_request
 *
 * Properties beyond "no crash, no leak, no UB": a rejected body names a known code and has a
 * valid JSON error body; an accepted abort names a non-empty printable rid or abort_all; an
 * accepted pause has one of the three modes; the answers are valid JSON.
 */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../protocol/errors.h"
#include "../../protocol/ops.h"

static void check(int cond) {
    if (!cond) abort();
}

static void check_json(char *body, size_t len) {
    check(body != NULL);
    json_t *v = json_loadb(body, len, 0, NULL);
    check(v != NULL);
    json_decref(v);
    free(body);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const char *body = (const char *)data + 1;
    size_t n = size - 1, len;
    rs_error err = {0};
    int rc;
    switch (data[0] % 4) {
    case 0: {
        rs_abort_req a;
        rc = rs_abort_parse(body, n, &a, &err);
        if (rc == RS_OK) {
            check(a.abort_all ? a.rid[0] == '\0' : strlen(a.rid) >= 1);
            for (const char *p = a.rid; *p; p++) check((unsigned char)*p >= 0x20 && *p != 0x7f);
            check_json(rs_abort_body((int)strlen(a.rid), &len), len);
        }
        break;
    }
    case 1: {
        rs_pause_mode mode;
        rc = rs_pause_parse(body, n, &mode, &err);
        if (rc == RS_OK) {
            check(mode == RS_PAUSE_ABORT || mode == RS_PAUSE_RETRACT || mode == RS_PAUSE_IN_PLACE);
            check_json(rs_status_body(rs_pause_mode_name(mode), &len), len);
        }
        break;
    }
    case 2:
        rc = rs_continue_parse(body, n, &err);
        break;
    default:
        rc = rs_flush_parse(body, n, &err);
        break;
    }
    if (rc != RS_OK) {
        check(rc == RS_EINVAL || rc == RS_EUNSUPPORTED || rc == RS_ENOMEM);
        check(err.message[0] != '\0');
        check_json(rs_error_body(&err, &len), len);
    }
    return 0;
}
