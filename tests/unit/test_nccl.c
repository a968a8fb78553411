/*
 * test_nccl.c — NCCL weight updates (sync/nccl.h).
 *
 * Both builds: the group request check (rank 0 is the trainer; with or without a unique id; a
 * master_port as an integer or a decimal string), the
 * broadcast plan of an update request (per tensor or one flattened bucket, the staging limit),
 * both fed through the real JSON parsers (protocol/weights.h) as a server would.
 * CPU build: the three routes answer RS_EUNSUPPORTED (400) with the CUDA-build message.
 * CUDA build: without a device, joining answers RS_EUNSUPPORTED naming the missing device; with
 * one, a join whose other ranks never come times out (RS_EBUSY, 503) within init_timeout_s, leaves
 * no group behind, and an unknown group is a 400. A real broadcast needs a second rank on another
 * GPU: tests/e2e/test_nccl_gpu.py.
 */
#include <stdio.h>
#include <string.h>

#include "../../protocol/weights.h"
#include "../../sync/nccl.h"
#include "../../sync/sync_internal.h"
#include "test.h"
#include "test_util.h"

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* Standard padded base64 of n bytes into out (4 * ceil(n / 3) + 1 chars). */
static void b64_encode(const uint8_t *in, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)in[i] << 16 | (i + 1 < n ? (uint32_t)in[i + 1] << 8 : 0) | (i + 2 < n ? in[i + 2] : 0);
        out[o++] = B64[v >> 18 & 63];
        out[o++] = B64[v >> 12 & 63];
        out[o++] = i + 1 < n ? B64[v >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? B64[v & 63] : '=';
    }
    out[o] = 0;
}

/* A group request body with a 128-byte id (bytes 1..128, or all zeros). */
static void group_body(char *buf, size_t cap, int rank_offset, int world_size, bool zero_id, bool with_id) {
    uint8_t id[128];
    for (int i = 0; i < 128; i++) id[i] = zero_id ? 0 : (uint8_t)(i + 1);
    char b64[200];
    b64_encode(id, sizeof id, b64);
    snprintf(buf, cap,
             "{\"master_address\": \"127.0.0.1\", \"master_port\": 29711, \"rank_offset\": %d, "
             "\"world_size\": %d, \"group_name\": \"g0\", \"backend\": \"nccl\"%s%s%s}",
             rank_offset, world_size, with_id ? ", \"nccl_unique_id_b64\": \"" : "", with_id ? b64 : "",
             with_id ? "\"" : "");
}

static int check_group(const char *body, rs_error *err) {
    rs_nccl_group_req r;
    rs_error perr = {0};
    int rc = rs_weights_parse_nccl_group(body, strlen(body), &r, &perr);
    if (rc != RS_OK) RS_TEST_FAIL("parse %s: %s", body, perr.message);
    return rs_nccl_check_group_req(&r, err);
}

RS_TEST(nccl_group_request_checks) {
    char body[1024];
    rs_error err = {0};
    group_body(body, sizeof body, 1, 2, false, true);
    ASSERT_EQ(check_group(body, &err), RS_OK);
    group_body(body, sizeof body, 3, 9, false, true);
    ASSERT_EQ(check_group(body, &err), RS_OK);

    /* rank 0 is the trainer (the broadcast root): this server cannot take it */
    group_body(body, sizeof body, 0, 2, false, true);
    memset(&err, 0, sizeof err);
    ASSERT_EQ(check_group(body, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "rank_offset");
    ASSERT_TRUE(strstr(err.message, "rank 0 is the trainer") != NULL);
    ASSERT_EQ(rs_err_http_status(err.code), 400);

    /* without the unique id: SGLang's request, the rendezvous is the trainer's TCPStore */
    group_body(body, sizeof body, 1, 2, false, false);
    memset(&err, 0, sizeof err);
    ASSERT_EQ(check_group(body, &err), RS_OK);

    group_body(body, sizeof body, 1, 2, true, true);
    memset(&err, 0, sizeof err);
    ASSERT_EQ(check_group(body, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "nccl_unique_id_b64");

    /* the id must decode to exactly NCCL_UNIQUE_ID_BYTES (the route's parser checks it) */
    {
        uint8_t id[129];
        char b64[200], bad[1024];
        rs_nccl_group_req r;
        for (int i = 0; i < 129; i++) id[i] = (uint8_t)(i * 3 + 1);
        for (int n = 127; n <= 129; n += 2) {
            b64_encode(id, (size_t)n, b64);
            snprintf(bad, sizeof bad, "{\"master_address\": \"h\", \"master_port\": 1, \"rank_offset\": 1, "
                     "\"world_size\": 2, \"nccl_unique_id_b64\": \"%s\"}", b64);
            memset(&err, 0, sizeof err);
            ASSERT_EQ(rs_weights_parse_nccl_group(bad, strlen(bad), &r, &err), RS_EINVAL);
            ASSERT_STREQ(err.param, "nccl_unique_id_b64");
        }
        b64_encode(id, 128, b64);
        snprintf(bad, sizeof bad, "{\"master_address\": \"h\", \"master_port\": 1, \"rank_offset\": 1, "
                 "\"world_size\": 2, \"nccl_unique_id_b64\": \"%s\"}", b64);
        ASSERT_EQ(rs_weights_parse_nccl_group(bad, strlen(bad), &r, &err), RS_OK);
        ASSERT_TRUE(r.has_unique_id && memcmp(r.unique_id, id, 128) == 0);
        ASSERT_STREQ(r.group_name, "weight_update_group"); /* SGLang's default */
        ASSERT_EQ(rs_nccl_check_group_req(&r, &err), RS_OK);
    }

    /* fields the parser leaves to us, set directly */
    rs_nccl_group_req r;
    group_body(body, sizeof body, 1, 2, false, true);
    ASSERT_EQ(rs_weights_parse_nccl_group(body, strlen(body), &r, &err), RS_OK);
    r.rank_offset = 2;
    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_check_group_req(&r, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "rank_offset");
    r.rank_offset = 1;
    r.world_size = 1;
    ASSERT_EQ(rs_nccl_check_group_req(&r, &err), RS_EINVAL);
    r.world_size = 2;
    r.group_name[0] = 0;
    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_check_group_req(&r, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "group_name");
    snprintf(r.group_name, sizeof r.group_name, "g0");
    snprintf(r.backend, sizeof r.backend, "gloo");
    ASSERT_EQ(rs_nccl_check_group_req(&r, &err), RS_EINVAL);
}

RS_TEST(nccl_group_master_port_integer_or_decimal_string) {
    /* AReaL sends master_port as a string */
    static const struct {
        const char *port;
        int want;                       /* 0: refused */
    } cases[] = {
        {"29500", 29500}, {"\"29500\"", 29500}, {"\"1\"", 1}, {"\"65535\"", 65535}, {"65535", 65535},
        {"\"65536\"", 0}, {"\"0\"", 0}, {"\"\"", 0}, {"\"29 500\"", 0}, {"\"-1\"", 0}, {"\"0x10\"", 0},
        {"\"123456\"", 0}, {"\"2950a\"", 0}, {"29500.5", 0}, {"true", 0}, {"0", 0},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(cases); i++) {
        char body[512];
        snprintf(body, sizeof body, "{\"master_address\": \"10.0.0.5\", \"master_port\": %s, \"rank_offset\": 1, "
                 "\"world_size\": 2}", cases[i].port);
        rs_nccl_group_req r;
        rs_error err = {0};
        int rc = rs_weights_parse_nccl_group(body, strlen(body), &r, &err);
        if (cases[i].want) {
            if (rc != RS_OK) RS_TEST_FAIL("master_port %s: %s", cases[i].port, err.message);
            ASSERT_EQ(r.master_port, cases[i].want);
            ASSERT_TRUE(!r.has_unique_id);
            ASSERT_EQ(rs_nccl_check_group_req(&r, &err), RS_OK);
        } else {
            if (rc != RS_EINVAL) RS_TEST_FAIL("master_port %s: accepted", cases[i].port);
            ASSERT_STREQ(err.param, "master_port");
        }
    }
}

/* bf16 [4][8] = 64 bytes, f32 [8] = 32 bytes, e4m3 [3][5] = 15 bytes, f16 [0][4] = 0 bytes */
static const char UPDATE_TENSORS[] =
    "\"names\": [\"a.weight\", \"b.weight\", \"c.weight\", \"d.weight\"], "
    "\"dtypes\": [\"bfloat16\", \"float32\", \"float8_e4m3fn\", \"float16\"], "
    "\"shapes\": [[4, 8], [8], [3, 5], [0, 4]], \"group_name\": \"g0\"";

static void parse_update(bool flattened, rs_nccl_update_req *r) {
    char body[1024];
    snprintf(body, sizeof body, "{%s, \"load_format\": %s, \"weight_version\": \"7\"}", UPDATE_TENSORS,
             flattened ? "\"flattened_bucket\"" : "null");
    rs_error err = {0};
    if (rs_weights_parse_nccl_update(body, strlen(body), r, &err) != RS_OK) RS_TEST_FAIL("parse: %s", err.message);
}

RS_TEST(nccl_update_broadcast_plan) {
    rs_error err = {0};
    rs_nccl_update_req r;
    int first, count;
    uint64_t bytes;

    /* one broadcast per tensor, in order; the empty tensor is not broadcast (bytes 0) */
    parse_update(false, &r);
    ASSERT_EQ(r.n_tensors, 4);
    ASSERT_EQ(r.total_bytes, 111);
    ASSERT_EQ(rs_nccl_check_update_req(&r, 1 << 20, &err), RS_OK);
    ASSERT_EQ(rs_nccl_n_buffers(&r), 4);
    const uint64_t want[4] = {64, 32, 15, 0};
    for (int i = 0; i < 4; i++) {
        rs_nccl_buffer(&r, i, &first, &count, &bytes);
        ASSERT_EQ(first, i);
        ASSERT_EQ(count, 1);
        ASSERT_EQ(bytes, want[i]);
    }
    /* the staging limit is per broadcast: the largest tensor must fit */
    ASSERT_EQ(rs_nccl_check_update_req(&r, 64, &err), RS_OK);
    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_check_update_req(&r, 63, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "names[0]");
    ASSERT_TRUE(strstr(err.message, "a.weight") != NULL);
    /* offsets must be the running sum (the flattened layout), whatever the parser produced */
    r.tensors[2].offset++;
    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_check_update_req(&r, 1 << 20, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "names[2]");
    r.tensors[2].offset--;
    r.total_bytes++;
    ASSERT_EQ(rs_nccl_check_update_req(&r, 1 << 20, &err), RS_EINVAL);
    rs_nccl_update_req_free(&r);

    /* flattened: one broadcast of every tensor, concatenated without padding */
    parse_update(true, &r);
    ASSERT_TRUE(r.flattened_bucket);
    ASSERT_EQ(rs_nccl_check_update_req(&r, 111, &err), RS_OK);
    ASSERT_EQ(rs_nccl_n_buffers(&r), 1);
    rs_nccl_buffer(&r, 0, &first, &count, &bytes);
    ASSERT_EQ(first, 0);
    ASSERT_EQ(count, 4);
    ASSERT_EQ(bytes, 111);
    ASSERT_EQ(r.tensors[1].offset, 64);
    ASSERT_EQ(r.tensors[2].offset, 96);
    ASSERT_EQ(r.tensors[3].offset, 111);
    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_check_update_req(&r, 110, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "names");
    ASSERT_TRUE(strstr(err.message, "smaller buckets") != NULL);
    rs_nccl_update_req_free(&r);

    rs_nccl_update_req empty = {0};
    snprintf(empty.group_name, sizeof empty.group_name, "g0");
    ASSERT_EQ(rs_nccl_check_update_req(&empty, 1 << 20, &err), RS_EINVAL);
}

RS_TEST(nccl_opts_keep_defaults_for_bad_values) {
    rs_nccl_opts saved, d, o;
    rs_nccl_get_opts(&saved);
    rs_nccl_opts_default(&d);
    o = (rs_nccl_opts){.device = -1, .init_timeout_s = 0, .op_timeout_s = -5, .max_buffer_bytes = 0};
    rs_nccl_set_opts(&o);
    rs_nccl_get_opts(&o);
    ASSERT_EQ(o.device, d.device);
    ASSERT_NEAR(o.init_timeout_s, d.init_timeout_s, 0);
    ASSERT_NEAR(o.op_timeout_s, d.op_timeout_s, 0);
    ASSERT_EQ(o.max_buffer_bytes, d.max_buffer_bytes);
    o = (rs_nccl_opts){.device = 1, .init_timeout_s = 2.5, .op_timeout_s = 7, .max_buffer_bytes = 4096};
    rs_nccl_set_opts(&o);
    rs_nccl_get_opts(&o);
    ASSERT_EQ(o.device, 1);
    ASSERT_NEAR(o.init_timeout_s, 2.5, 0);
    ASSERT_EQ(o.max_buffer_bytes, 4096);
    rs_nccl_set_opts(&saved);
}

#ifndef RS_CUDA

RS_TEST(nccl_cpu_build_unsupported) {
    char body[1024];
    rs_nccl_group_req g;
    rs_nccl_update_req u;
    rs_error err = {0};
    group_body(body, sizeof body, 1, 2, false, true);
    ASSERT_EQ(rs_weights_parse_nccl_group(body, strlen(body), &g, &err), RS_OK);
    parse_update(true, &u);

    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_init_group(NULL, &g, &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.message, RS_NCCL_UNSUPPORTED_MESSAGE);
    ASSERT_EQ(rs_err_http_status(err.code), 400);

    rs_sync_result res;
    memset(&res, 0, sizeof res);
    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_update(NULL, &u, &res, &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.message, "NCCL weight updates need the CUDA build (make CUDA=1)");

    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_destroy_group(NULL, "g0", &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.message, RS_NCCL_UNSUPPORTED_MESSAGE);
    rs_nccl_release(NULL);
    rs_nccl_update_req_free(&u);
}

#else /* RS_CUDA */

/* The NCCL routes touch only the service's NCCL slot: a service without engine or model will do,
 * as long as no job is submitted (the routes are called directly, on this thread). */
RS_TEST(nccl_cuda_no_device_is_unsupported) {
    if (rs_nccl_cuda_device_count() > 0) RS_TEST_SKIP("a CUDA device is present (this checks the answer without one)");
    char body[1024];
    rs_nccl_group_req g;
    rs_error err = {0};
    group_body(body, sizeof body, 1, 2, false, true);
    ASSERT_EQ(rs_weights_parse_nccl_group(body, strlen(body), &g, &err), RS_OK);
    rs_test_sync_env v = rs_test_sync_open("bf16", NULL);
    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_init_group(v.s, &g, &err), RS_EUNSUPPORTED);
    ASSERT_TRUE(strstr(err.message, "no CUDA device") != NULL);
    ASSERT_EQ(*rs_sync_nccl_state(v.s), NULL);
    rs_test_sync_close(&v);
}

RS_TEST(nccl_cuda_store_rendezvous_times_out_without_a_store) {
    if (rs_nccl_cuda_device_count() == 0) RS_TEST_SKIP("no CUDA device");
    rs_nccl_opts saved, o;
    rs_nccl_get_opts(&saved);
    o = saved;
    o.init_timeout_s = 1.0;
    rs_nccl_set_opts(&o);
    char body[512];
    /* port 1 on loopback: nothing listens (connection refused until the deadline) */
    snprintf(body, sizeof body, "{\"master_address\": \"127.0.0.1\", \"master_port\": \"1\", \"rank_offset\": 1, "
             "\"world_size\": 2, \"group_name\": \"nostore\"}");
    rs_nccl_group_req g;
    rs_error err = {0};
    ASSERT_EQ(rs_weights_parse_nccl_group(body, strlen(body), &g, &err), RS_OK);
    rs_test_sync_env v = rs_test_sync_open("bf16", NULL);
    double t0 = rs_now_s();
    int rc = rs_nccl_init_group(v.s, &g, &err);
    double dt = rs_now_s() - t0;
    fprintf(stderr, "  store rendezvous without a store: %s after %.2f s: %s\n", rs_err_name(rc), dt, err.message);
    ASSERT_EQ(rc, RS_EBUSY);
    ASSERT_TRUE(strstr(err.message, "not listening") && strstr(err.message, "nostore"));
    ASSERT_TRUE(dt >= 0.9 && dt < 5.0);
    ASSERT_EQ(*rs_sync_nccl_state(v.s), NULL);
    rs_test_sync_close(&v);
    rs_nccl_set_opts(&saved);
}

RS_TEST(nccl_cuda_join_times_out_without_peers) {
    if (rs_nccl_cuda_device_count() == 0) RS_TEST_SKIP("no CUDA device");
    rs_nccl_opts saved, o;
    rs_nccl_get_opts(&saved);
    o = saved;
    o.init_timeout_s = 3.0;
    rs_nccl_set_opts(&o);

    /* A real unique id whose rank 0 never joins: this process hosts its bootstrap root, rank 1
     * connects and waits for the others until the deadline, then the join is aborted. */
    rs_nccl_group_req g;
    memset(&g, 0, sizeof g);
    snprintf(g.master_address, sizeof g.master_address, "127.0.0.1");
    g.master_port = 29711;
    g.rank_offset = 1;
    g.world_size = 2;
    snprintf(g.group_name, sizeof g.group_name, "lonely");
    snprintf(g.backend, sizeof g.backend, "nccl");
    g.has_unique_id = true;
    rs_error err = {0};
    ASSERT_EQ(rs_nccl_new_unique_id(g.unique_id, &err), RS_OK);

    rs_test_sync_env v = rs_test_sync_open("bf16", NULL);
    double t0 = rs_now_s();
    memset(&err, 0, sizeof err);
    int rc = rs_nccl_init_group(v.s, &g, &err);
    double dt = rs_now_s() - t0;
    fprintf(stderr, "  join without peers: %s after %.2f s: %s\n", rs_err_name(rc), dt, err.message);
    ASSERT_EQ(rc, RS_EBUSY);
    ASSERT_EQ(rs_err_http_status(rc), 503);
    ASSERT_TRUE(strstr(err.message, "did not join") != NULL);
    ASSERT_TRUE(dt >= 2.9 && dt < 30.0);
    ASSERT_EQ(*rs_sync_nccl_state(v.s), NULL);

    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_destroy_group(v.s, "lonely", &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "group_name");

    rs_nccl_update_req u;
    parse_update(true, &u);
    rs_sync_result res;
    memset(&res, 0, sizeof res);
    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_nccl_update(v.s, &u, &res, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "group_name");
    ASSERT_TRUE(strstr(err.message, "/init_weights_update_group") != NULL);
    rs_nccl_update_req_free(&u);

    rs_test_sync_close(&v);
    rs_nccl_set_opts(&saved);
}

#endif
