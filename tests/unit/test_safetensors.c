/*
 * test_safetensors.c — the safetensors parser, writer and model-directory view (model/safetensors.h).
 *
 * Corrupt inputs are built byte by byte here, so each test states exactly which rule it breaks;
 * every one must come back as RS_EFORMAT / RS_EUNSUPPORTED with a message that names the tensor
 * or key at fault (never a crash: ASan and the fuzz target cover what these cases do not).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../model/safetensors.h"
#include "test.h"

/* A file image: 8-byte little-endian length of `json`, the json, then data_len bytes 0, 1, 2, ... */
static uint8_t *image(const char *json, size_t data_len, size_t *len) {
    size_t n = strlen(json);
    *len = 8 + n + data_len;
    uint8_t *b = malloc(*len);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)n >> (8 * i));
    memcpy(b + 8, json, n);
    for (size_t i = 0; i < data_len; i++) b[8 + n + i] = (uint8_t)i;
    return b;
}

/* Parses json + data and expects failure with `code` and a message containing `needle`. */
static void expect_bad(const char *json, size_t data_len, int code, const char *needle) {
    size_t len;
    uint8_t *b = image(json, data_len, &len);
    rs_st_file *f = NULL;
    rs_error err = {0};
    int rc = rs_st_parse(&f, b, len, "t.safetensors", &err);
    if (rc != code || !strstr(err.message, needle) || !strstr(err.message, "t.safetensors"))
        RS_TEST_FAIL("header %s: rc %d (want %d), message \"%s\" (want \"%s\")", json, rc, code, err.message,
                     needle);
    ASSERT_TRUE(f == NULL);
    free(b);
}

RS_TEST(safetensors_parse_valid) {
    const char *json = "{\"__metadata__\":{\"format\":\"pt\"},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]},"
                       "\"a\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,8]},"
                       "\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[16,24]},"
                       "\"z\":{\"dtype\":\"F16\",\"shape\":[0,7],\"data_offsets\":[24,24]},"
                       "\"d\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[24,32]}}";
    size_t len;
    uint8_t *b = image(json, 32, &len);
    rs_st_file *f = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_st_parse(&f, b, len, "mem", &err), RS_OK);
    ASSERT_EQ(rs_st_count(f), 5);
    /* iteration is in data order */
    ASSERT_STREQ(rs_st_tensor_at(f, 0)->name, "a");
    ASSERT_STREQ(rs_st_tensor_at(f, 1)->name, "b");
    ASSERT_STREQ(rs_st_tensor_at(f, 2)->name, "s");
    const rs_st_tensor *a = rs_st_find(f, "a");
    ASSERT_TRUE(a != NULL);
    ASSERT_EQ(a->dtype, RS_DTYPE_BF16);
    ASSERT_EQ(a->ndim, 2);
    ASSERT_EQ(a->shape[0], 2);
    ASSERT_EQ(a->shape[1], 2);
    ASSERT_EQ(a->nbytes, 8);
    ASSERT_TRUE((const uint8_t *)a->data == b + len - 32);
    const rs_st_tensor *s = rs_st_find(f, "s");
    ASSERT_EQ(s->ndim, 0);
    ASSERT_EQ(s->nbytes, 8);
    ASSERT_EQ(((const uint8_t *)s->data)[0], 16);
    ASSERT_EQ(rs_st_find(f, "z")->nbytes, 0);
    /* a valid safetensors dtype rolloutd cannot hold still parses, marked RS_DTYPE_COUNT */
    ASSERT_EQ(rs_st_find(f, "d")->dtype, RS_DTYPE_COUNT);
    ASSERT_STREQ(rs_st_find(f, "d")->st_dtype, "F64");
    ASSERT_TRUE(rs_st_find(f, "nope") == NULL);
    ASSERT_TRUE(rs_st_find(f, "__metadata__") == NULL);
    ASSERT_STREQ(rs_st_metadata(f, "format"), "pt");
    ASSERT_TRUE(rs_st_metadata(f, "other") == NULL);
    rs_st_close(f);
    free(b);
}

RS_TEST(safetensors_bad_lengths) {
    rs_st_file *f = NULL;
    rs_error err = {0};
    uint8_t small[5] = {1, 0, 0, 0, 0};
    ASSERT_EQ(rs_st_parse(&f, small, sizeof small, "t.safetensors", &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "too short"));

    /* header length past the end of the file (truncated header) */
    size_t len;
    uint8_t *b = image("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, &len);
    ASSERT_EQ(rs_st_parse(&f, b, len - 20, "t.safetensors", &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "runs past the end"));
    /* data truncated: the offsets no longer fit */
    ASSERT_EQ(rs_st_parse(&f, b, len - 1, "t.safetensors", &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "'a'"));
    ASSERT_STREQ(err.param, "a");
    ASSERT_EQ(rs_st_parse(&f, b, len, "t.safetensors", &err), RS_OK);
    rs_st_close(f);

    /* header length over the 100 MB bound, and 2^64 - 1: refused without quoting the 8 bytes (the
     * start of whatever file this is), only the limit */
    for (int i = 0; i < 8; i++) b[i] = 0;
    b[3] = 0x10; /* 0x10000000 = 268 MB */
    ASSERT_EQ(rs_st_parse(&f, b, len, "t.safetensors", &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "invalid header length (over the 100000000-byte limit)"));
    ASSERT_TRUE(!strstr(err.message, "268435456"));
    memset(b, 0xff, 8);
    ASSERT_EQ(rs_st_parse(&f, b, len, "t.safetensors", &err), RS_EFORMAT);
    ASSERT_TRUE(!strstr(err.message, "18446744073709551615"));
    free(b);
}

RS_TEST(safetensors_bad_headers) {
    expect_bad("{\"a\": {", 0, RS_EFORMAT, "header JSON");
    expect_bad("[1, 2]", 0, RS_EFORMAT, "not a JSON object");
    expect_bad("{\"a\":1}", 0, RS_EFORMAT, "'a'");
    expect_bad("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, RS_EFORMAT, "dtype");
    expect_bad("{\"w\":{\"dtype\":\"Q7\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, RS_EUNSUPPORTED, "Q7");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,8]}}", 16, RS_EFORMAT, "'w'");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, RS_EFORMAT, "outside");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 8, RS_EFORMAT, "'w'");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 8, RS_EFORMAT, "data_offsets");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,-4]}}", 8, RS_EFORMAT, "'w'");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4.0]}}", 8, RS_EFORMAT, "'w'");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 8, RS_EFORMAT, "shape[0]");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 8, RS_EFORMAT, "shape[0]");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1],\"data_offsets\":[0,4]}}", 8, RS_EFORMAT, "dims");
    /* overflow: 2^40 * 2^40 elements, and 2^62 elements * 4 bytes */
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776],\"data_offsets\":[0,4]}}", 8,
               RS_EFORMAT, "overflows");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],\"data_offsets\":[0,4]}}", 8, RS_EFORMAT,
               "overflows");
    /* jansson rejects integers beyond int64 */
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,99999999999999999999]}}", 8, RS_EFORMAT,
               "header JSON");
    expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
               16, RS_EFORMAT, "overlaps");
    expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
               "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
               8, RS_EFORMAT, "duplicate");
    expect_bad("{\"__metadata__\":{\"format\":1}}", 0, RS_EFORMAT, "__metadata__.format");
    expect_bad("{\"__metadata__\":[]}", 0, RS_EFORMAT, "__metadata__");
    expect_bad("{\"w\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,1]}}", 8, RS_EFORMAT, "whole number");
    expect_bad("{\"w\\u0000x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, RS_EFORMAT,
               "header JSON");
}

RS_TEST(safetensors_open_errors) {
    char path[512];
    rs_st_file *f = NULL;
    rs_error err = {0};
    snprintf(path, sizeof path, "%s/missing.safetensors", rs_test_tmpdir());
    ASSERT_EQ(rs_st_open(&f, path, &err), RS_ENOTFOUND);
    ASSERT_TRUE(strstr(err.message, "missing.safetensors"));
    snprintf(path, sizeof path, "%s/empty.safetensors", rs_test_tmpdir());
    FILE *fp = fopen(path, "wb");
    fclose(fp);
    ASSERT_EQ(rs_st_open(&f, path, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "empty.safetensors"));
    fp = fopen(path, "wb");
    fwrite("\x40\0\0\0\0\0\0\0{\"a\":", 1, 13, fp);
    fclose(fp);
    ASSERT_EQ(rs_st_open(&f, path, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "empty.safetensors") && strstr(err.message, "past the end"));
    ASSERT_EQ(rs_st_open(&f, rs_test_tmpdir(), &err), RS_EIO);
}

typedef struct counting_fill {
    int calls;
} counting_fill;

static int fill_index(void *ctx, void *dst, uint64_t off, size_t n, rs_error *err) {
    (void)err;
    ((counting_fill *)ctx)->calls++;
    for (size_t i = 0; i < n; i++) ((uint8_t *)dst)[i] = (uint8_t)((off + i) * 7);
    return RS_OK;
}

RS_TEST(safetensors_write_roundtrip) {
    char path[512];
    snprintf(path, sizeof path, "%s/rt.safetensors", rs_test_tmpdir());
    float w[6] = {1, -2, 3.5f, 0, 1e-3f, 7};
    counting_fill cf = {0};
    /* 5 MiB of BF16 so the fill callback runs in more than one chunk */
    rs_st_wtensor ts[3] = {
        {.name = "model.w", .dtype = RS_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .data = w},
        {.name = "big", .dtype = RS_DTYPE_BF16, .ndim = 2, .shape = {1280, 2048}, .fill = fill_index, .fill_ctx = &cf},
        {.name = "scalar", .dtype = RS_DTYPE_I64, .ndim = 0, .data = "\x2a\0\0\0\0\0\0\0"},
    };
    rs_error err = {0};
    ASSERT_EQ(rs_st_write(path, ts, 3, &err), RS_OK);
    ASSERT_EQ(cf.calls, 2);
    ASSERT_TRUE(access(path, F_OK) == 0);

    rs_st_file *f = NULL;
    ASSERT_EQ(rs_st_open(&f, path, &err), RS_OK);
    ASSERT_EQ(rs_st_count(f), 3);
    ASSERT_STREQ(rs_st_metadata(f, "format"), "pt");
    const rs_st_tensor *t = rs_st_find(f, "model.w");
    ASSERT_EQ(t->dtype, RS_DTYPE_F32);
    ASSERT_EQ(t->shape[0], 2);
    ASSERT_EQ(t->shape[1], 3);
    ASSERT_EQ(t->offset, 0);
    ASSERT_TRUE(memcmp(t->data, w, sizeof w) == 0);
    /* the header is padded so the data section starts 8-byte aligned */
    ASSERT_EQ(((uintptr_t)t->data) % 8, 0);
    t = rs_st_find(f, "big");
    ASSERT_EQ(t->nbytes, 1280 * 2048 * 2);
    ASSERT_EQ(t->offset, 24);
    const uint8_t *p = t->data;
    for (size_t i = 0; i < t->nbytes; i += 4099) ASSERT_EQ(p[i], (uint8_t)(i * 7));
    ASSERT_EQ(p[t->nbytes - 1], (uint8_t)((t->nbytes - 1) * 7));
    t = rs_st_find(f, "scalar");
    ASSERT_EQ(t->ndim, 0);
    ASSERT_EQ(((const uint8_t *)t->data)[0], 42);
    rs_st_close(f);

    /* writer refuses duplicate and reserved names and leaves no file behind */
    snprintf(path, sizeof path, "%s/dup.safetensors", rs_test_tmpdir());
    rs_st_wtensor dup[2] = {ts[0], ts[0]};
    ASSERT_EQ(rs_st_write(path, dup, 2, &err), RS_EINVAL);
    ASSERT_TRUE(strstr(err.message, "model.w"));
    dup[1].name = "__metadata__";
    ASSERT_EQ(rs_st_write(path, dup, 2, &err), RS_EINVAL);
    ASSERT_TRUE(access(path, F_OK) != 0);
}

/* ---- model directories ---- */

static void write_file(const char *dir, const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp) RS_TEST_FAIL("cannot write %s", path);
    fputs(text, fp);
    fclose(fp);
}

static void write_shard(const char *dir, const char *name, const char *t1, const char *t2) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    float v[2] = {1, 2};
    rs_st_wtensor ts[2] = {
        {.name = t1, .dtype = RS_DTYPE_F32, .ndim = 1, .shape = {1}, .data = &v[0]},
        {.name = t2, .dtype = RS_DTYPE_F32, .ndim = 1, .shape = {1}, .data = &v[1]},
    };
    rs_error err = {0};
    if (rs_st_write(path, ts, t2 ? 2 : 1, &err) != RS_OK) RS_TEST_FAIL("%s", err.message);
}

RS_TEST(safetensors_dir_index) {
    const char *d = rs_test_tmpdir();
    rs_st_dir *dir = NULL;
    rs_error err = {0};
    ASSERT_EQ(rs_st_dir_open(&dir, d, &err), RS_ENOTFOUND);
    ASSERT_TRUE(strstr(err.message, "model.safetensors"));

    write_shard(d, "s-1.safetensors", "x", "y");
    write_shard(d, "s-2.safetensors", "z", NULL);
    write_file(d, "model.safetensors.index.json",
               "{\"metadata\":{\"total_size\":12},\"weight_map\":{\"x\":\"s-1.safetensors\","
               "\"y\":\"s-1.safetensors\",\"z\":\"s-2.safetensors\"}}");
    ASSERT_EQ(rs_st_dir_open(&dir, d, &err), RS_OK);
    ASSERT_EQ(rs_st_dir_count(dir), 3);
    ASSERT_EQ(rs_st_dir_nbytes(dir), 12);
    size_t ix;
    const char *file;
    const rs_st_tensor *t = rs_st_dir_find(dir, "z", &ix, &file);
    ASSERT_TRUE(t != NULL);
    ASSERT_TRUE(strstr(file, "s-2.safetensors"));
    ASSERT_TRUE(rs_st_dir_tensor_at(dir, ix, NULL) == t);
    ASSERT_EQ(*(const float *)t->data, 1.0f);
    ASSERT_TRUE(rs_st_dir_find(dir, "w", NULL, NULL) == NULL);
    rs_st_dir_close(dir);

    /* the weight map names a shard that lacks the tensor */
    write_file(d, "model.safetensors.index.json",
               "{\"weight_map\":{\"x\":\"s-2.safetensors\",\"z\":\"s-2.safetensors\"}}");
    ASSERT_EQ(rs_st_dir_open(&dir, d, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "'x'") && strstr(err.message, "s-2.safetensors"));
    /* a missing shard */
    write_file(d, "model.safetensors.index.json", "{\"weight_map\":{\"x\":\"s-9.safetensors\"}}");
    ASSERT_EQ(rs_st_dir_open(&dir, d, &err), RS_ENOTFOUND);
    ASSERT_TRUE(strstr(err.message, "s-9.safetensors"));
    /* the same tensor name in two shards */
    write_shard(d, "s-3.safetensors", "w", "z");
    write_file(d, "model.safetensors.index.json",
               "{\"weight_map\":{\"x\":\"s-1.safetensors\",\"z\":\"s-2.safetensors\",\"w\":\"s-3.safetensors\"}}");
    ASSERT_EQ(rs_st_dir_open(&dir, d, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "'z'"));
    /* malformed index */
    write_file(d, "model.safetensors.index.json", "{\"weight_map\": 3}");
    ASSERT_EQ(rs_st_dir_open(&dir, d, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "weight_map"));
    write_file(d, "model.safetensors.index.json", "{\"weight_map\": {\"x\": ");
    ASSERT_EQ(rs_st_dir_open(&dir, d, &err), RS_EFORMAT);
    ASSERT_TRUE(strstr(err.message, "index.json"));
}

RS_TEST(safetensors_dir_path_traversal) {
    const char *d = rs_test_tmpdir();
    static const char *bad[] = {"../s.safetensors", "sub/s.safetensors", "/etc/passwd", "..", ".", "",
                                "a\\\\b.safetensors", "x..y"};
    rs_st_dir *dir = NULL;
    rs_error err = {0};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char json[256];
        snprintf(json, sizeof json, "{\"weight_map\":{\"model.norm.weight\":\"%s\"}}", bad[i]);
        write_file(d, "model.safetensors.index.json", json);
        int rc = rs_st_dir_open(&dir, d, &err);
        if (rc != RS_EFORMAT || !strstr(err.message, "plain file name"))
            RS_TEST_FAIL("shard \"%s\": rc %d, %s", bad[i], rc, err.message);
        ASSERT_STREQ(err.param, "model.norm.weight");
    }
}
