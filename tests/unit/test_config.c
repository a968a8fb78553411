/*
 * test_config.c — the settings table: defaults, flags, config files, and errors that name the key.
 */
#include <stdio.h>
#include <string.h>

#include "../../config/config.h"
#include "test.h"

static int parse_args(rs_config *c, rs_error *err, bool *help, int argc, char **argv) {
    memset(err, 0, sizeof *err);
    return rs_config_parse_args(c, argc, argv, help, err);
}

#define ARGS(...) (char *[]){"rolloutd", __VA_ARGS__}
#define NARGS(...) (int)(sizeof((char *[]){"rolloutd", __VA_ARGS__}) / sizeof(char *))

RS_TEST(config_defaults) {
    rs_config c;
    rs_config_default(&c);
    ASSERT_STREQ(c.model, "");
    ASSERT_STREQ(c.host, "127.0.0.1");
    ASSERT_EQ(c.port, 8000);
    ASSERT_EQ(c.threads, 0);
    ASSERT_EQ(c.kv_cache_mb, 1024);
    ASSERT_EQ(c.max_running, 64);
    ASSERT_EQ(c.max_step_tokens, 2048);
    ASSERT_EQ(c.max_context, 0);
    ASSERT_EQ(c.max_new_tokens, 32768);
    ASSERT_EQ(c.max_n, 64);
    ASSERT_EQ(c.max_batch, 1024);
    ASSERT_EQ(c.max_body_bytes, 16 << 20);
    ASSERT_EQ(c.max_waiting_requests, 1024);
    ASSERT_NEAR(c.drain_timeout, 30, 0);
    ASSERT_EQ(c.log_level, RS_CFG_LOG_INFO);
    ASSERT_EQ(c.quantization, RS_CFG_QUANT_FP8);
    ASSERT_EQ(c.kv_cache_dtype, RS_CFG_KV_FP8);
    ASSERT_EQ(c.kv_scale_mode, RS_CFG_KV_SCALES_CALIBRATE);
    ASSERT_EQ(c.device, RS_CFG_DEVICE_CPU);
    ASSERT_STREQ(c.api_key, "");
    ASSERT_EQ(c.numerics, RS_CFG_NUMERICS_AUTO);
    ASSERT_EQ(rs_config_log_level(&c), RS_LOG_LEVEL_INFO);
}

RS_TEST(config_numerics) {
    rs_config c;
    rs_config_default(&c);
    rs_error err;
    bool help;
    ASSERT_EQ(parse_args(&c, &err, &help, NARGS("--numerics", "exact"), ARGS("--numerics", "exact")), RS_OK);
    ASSERT_EQ(c.numerics, RS_CFG_NUMERICS_EXACT);
    ASSERT_EQ(parse_args(&c, &err, &help, NARGS("--numerics", "tf32"), ARGS("--numerics", "tf32")), RS_EINVAL);
    ASSERT_STREQ(err.param, "numerics");
    ASSERT_EQ(c.numerics, RS_CFG_NUMERICS_EXACT); /* a refused value leaves the setting alone */
}

RS_TEST(config_every_entry_is_sane) {
    size_t n;
    const rs_config_entry *e = rs_config_entries(&n);
    ASSERT_TRUE(n >= 16);
    for (size_t i = 0; i < n; i++) {
        ASSERT_TRUE(e[i].doc && e[i].doc[0]);
        ASSERT_TRUE(e[i].min <= e[i].max);
        ASSERT_TRUE(strchr(e[i].name, '_') == NULL); /* names use dashes */
        ASSERT_TRUE(rs_config_find(e[i].name) == &e[i]);
        for (size_t k = 0; k < i; k++) ASSERT_TRUE(strcmp(e[i].name, e[k].name) != 0);
    }
}

/* Every enum setting: each name of its choices sets the C value config.h gives it (the table's
 * order and the enum's agree), prints back as that name, and anything else is refused. */
RS_TEST(config_enums_match_their_choices) {
    static const struct {
        const char *setting, *value;
        int want;
    } cases[] = {
        {"quantization", "fp8", RS_CFG_QUANT_FP8},          {"quantization", "bf16", RS_CFG_QUANT_BF16},
        {"device", "cpu", RS_CFG_DEVICE_CPU},               {"device", "cuda", RS_CFG_DEVICE_CUDA},
        {"cpu-kernels", "auto", RS_CFG_CPU_KERNELS_AUTO},   {"cpu-kernels", "avx512", RS_CFG_CPU_KERNELS_AVX512},
        {"numerics", "exact", RS_CFG_NUMERICS_EXACT},       {"numerics", "fast", RS_CFG_NUMERICS_FAST},
        {"numerics", "auto", RS_CFG_NUMERICS_AUTO},
        {"cpu-kernels", "avx2", RS_CFG_CPU_KERNELS_AVX2},   {"cpu-kernels", "scalar", RS_CFG_CPU_KERNELS_SCALAR},
        {"log-level", "debug", RS_CFG_LOG_DEBUG},           {"log-level", "info", RS_CFG_LOG_INFO},
        {"log-level", "warn", RS_CFG_LOG_WARN},             {"log-level", "error", RS_CFG_LOG_ERROR},
        {"kv-cache-dtype", "fp8", RS_CFG_KV_FP8},           {"kv-cache-dtype", "bf16", RS_CFG_KV_BF16},
        {"kv-cache-dtype", "f32", RS_CFG_KV_F32},           {"kv-scale-mode", "calibrate", RS_CFG_KV_SCALES_CALIBRATE},
        {"kv-scale-mode", "dynamic", RS_CFG_KV_SCALES_DYNAMIC}, {"kv-scale-mode", "static", RS_CFG_KV_SCALES_STATIC},
    };
    rs_config c;
    rs_config_default(&c);
    rs_error err;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const rs_config_entry *e = rs_config_find(cases[i].setting);
        ASSERT_TRUE(e && e->type == RS_CONFIG_TYPE_ENUM);
        ASSERT_EQ(rs_config_set(&c, cases[i].setting, cases[i].value, &err), RS_OK);
        ASSERT_EQ(*(const int *)((const char *)&c + e->offset), cases[i].want);
        char buf[32];
        rs_config_get(&c, cases[i].setting, buf, sizeof buf);
        ASSERT_STREQ(buf, cases[i].value);
        ASSERT_EQ(rs_config_set(&c, cases[i].setting, "nope", &err), RS_EINVAL);
        ASSERT_TRUE(strstr(err.message, e->choices) != NULL);
        ASSERT_EQ(*(const int *)((const char *)&c + e->offset), cases[i].want); /* unchanged */
    }
    /* and every enum row of the table has a case above */
    size_t n;
    const rs_config_entry *all = rs_config_entries(&n);
    for (size_t i = 0; i < n; i++) {
        if (all[i].type != RS_CONFIG_TYPE_ENUM) continue;
        bool covered = false;
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) covered |= !strcmp(cases[k].setting, all[i].name);
        if (!covered) RS_TEST_FAIL("enum setting %s has no case in this test", all[i].name);
    }
}

RS_TEST(config_flags) {
    rs_config c;
    rs_config_default(&c);
    rs_error err;
    bool help;
    ASSERT_EQ(parse_args(&c, &err, &help,
                         NARGS("--port", "9001", "--host=0.0.0.0", "--max-body-bytes", "2M", "--drain-timeout", "1.5",
                               "--log-level", "debug", "--api-key", "s3cret", "--max_n", "8", "--model", "/m"),
                         ARGS("--port", "9001", "--host=0.0.0.0", "--max-body-bytes", "2M", "--drain-timeout", "1.5",
                              "--log-level", "debug", "--api-key", "s3cret", "--max_n", "8", "--model", "/m")),
              RS_OK);
    ASSERT_TRUE(!help);
    ASSERT_EQ(c.port, 9001);
    ASSERT_STREQ(c.host, "0.0.0.0");
    ASSERT_EQ(c.max_body_bytes, 2 << 20);
    ASSERT_NEAR(c.drain_timeout, 1.5, 0);
    ASSERT_EQ(rs_config_log_level(&c), RS_LOG_LEVEL_DEBUG);
    ASSERT_STREQ(c.api_key, "s3cret");
    ASSERT_EQ(c.max_n, 8);
    ASSERT_STREQ(c.model, "/m");

    char buf[64];
    rs_config_format(&c, rs_config_find("api-key"), buf, sizeof buf);
    ASSERT_STREQ(buf, "(set)"); /* secrets never printed */
    rs_config_format(&c, rs_config_find("port"), buf, sizeof buf);
    ASSERT_STREQ(buf, "9001");

    ASSERT_EQ(parse_args(&c, &err, &help, NARGS("--port", "1", "--help"), ARGS("--port", "1", "--help")), RS_OK);
    ASSERT_TRUE(help);
}

typedef struct bad_flag {
    const char *flag, *value, *param, *message;
} bad_flag;

RS_TEST(config_flag_errors_name_the_key) {
    static const bad_flag cases[] = {
        {"--port", "70000", "port", "port must be in [0, 65535], got 70000"},
        {"--port", "80x", "port", "'80x' is not an integer"},
        {"--port", "", "port", "is not an integer"},
        {"--threads", "-1", "threads", "threads must be in"},
        {"--kv-cache-mb", "0", "kv-cache-mb", "kv-cache-mb must be in"},
        {"--max-body-bytes", "12Q", "max-body-bytes", "not a size"},
        {"--max-body-bytes", "2G", "max-body-bytes", "max-body-bytes must be in"},
        {"--max-body-bytes", "99999999999999999999999", "max-body-bytes", "must be in"},
        {"--drain-timeout", "nan", "drain-timeout", "not a number"},
        {"--drain-timeout", "-1", "drain-timeout", "drain-timeout must be in"},
        {"--log-level", "loud", "log-level", "log-level must be one of debug|info|warn|error, got 'loud'"},
        {"--host", "", "host", "host must be 1 to 255 characters"},
        {"--max-new-tokens", "99999999999999999999", "max-new-tokens", "must be in"},
        {"--bogus", "1", "bogus", "unknown flag --bogus"},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(cases); i++) {
        rs_config c;
        rs_config_default(&c);
        rs_error err;
        bool help;
        char *argv[] = {"rolloutd", (char *)cases[i].flag, (char *)cases[i].value};
        int rc = parse_args(&c, &err, &help, 3, argv);
        if (rc != RS_EINVAL) RS_TEST_FAIL("%s %s: rc %d", cases[i].flag, cases[i].value, rc);
        if (strcmp(err.param, cases[i].param) != 0)
            RS_TEST_FAIL("%s %s: param '%s', want '%s'", cases[i].flag, cases[i].value, err.param, cases[i].param);
        if (!strstr(err.message, cases[i].message))
            RS_TEST_FAIL("%s %s: message '%s' lacks '%s'", cases[i].flag, cases[i].value, err.message,
                         cases[i].message);
    }
    rs_config c;
    rs_config_default(&c);
    rs_error err;
    bool help;
    ASSERT_EQ(parse_args(&c, &err, &help, NARGS("--port"), ARGS("--port")), RS_EINVAL);
    ASSERT_TRUE(strstr(err.message, "--port needs a value") != NULL);
    ASSERT_EQ(parse_args(&c, &err, &help, NARGS("serve"), ARGS("serve")), RS_EINVAL);
    ASSERT_TRUE(strstr(err.message, "unexpected argument 'serve'") != NULL);
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    ASSERT_TRUE(f != NULL);
    fputs(text, f);
    fclose(f);
}

RS_TEST(config_file) {
    char path[512];
    snprintf(path, sizeof path, "%s/rolloutd.conf", rs_test_tmpdir());
    write_file(path,
               "# rolloutd settings\n"
               "\n"
               "port = 9100\n"
               "  max_running=16   \n"
               "api-key = \"two words\"\n"
               "log-level = warn\n");
    rs_config c;
    rs_config_default(&c);
    rs_error err;
    bool help;
    /* the flag wins over the file even though it comes first */
    ASSERT_EQ(parse_args(&c, &err, &help, NARGS("--port", "9200", "--config", path),
                         ARGS("--port", "9200", "--config", path)),
              RS_OK);
    ASSERT_EQ(c.port, 9200);
    ASSERT_EQ(c.max_running, 16);
    ASSERT_STREQ(c.api_key, "two words");
    ASSERT_EQ(rs_config_log_level(&c), RS_LOG_LEVEL_WARN);
}

RS_TEST(config_file_errors) {
    char path[512];
    snprintf(path, sizeof path, "%s/bad.conf", rs_test_tmpdir());
    rs_config c;
    rs_error err;

    write_file(path, "port = 1\nfrobnicate = 3\n");
    rs_config_default(&c);
    ASSERT_EQ(rs_config_load_file(&c, path, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "frobnicate");
    ASSERT_TRUE(strstr(err.message, ":2: unknown setting 'frobnicate'") != NULL);

    write_file(path, "# ok\nmax-n = 0\n");
    rs_config_default(&c);
    ASSERT_EQ(rs_config_load_file(&c, path, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "max-n");
    ASSERT_TRUE(strstr(err.message, ":2: max-n must be in [1, 4096], got 0") != NULL);

    write_file(path, "just words\n");
    ASSERT_EQ(rs_config_load_file(&c, path, &err), RS_EINVAL);
    ASSERT_TRUE(strstr(err.message, ":1: expected 'name = value'") != NULL);

    char missing[600];
    snprintf(missing, sizeof missing, "%s/nope.conf", rs_test_tmpdir());
    ASSERT_EQ(rs_config_load_file(&c, missing, &err), RS_EIO);
    ASSERT_TRUE(strstr(err.message, "nope.conf") != NULL);

    /* a directory is not an empty file */
    rs_config_default(&c);
    ASSERT_EQ(rs_config_load_file(&c, rs_test_tmpdir(), &err), RS_EINVAL);
    ASSERT_TRUE(strstr(err.message, "is a directory") != NULL);

    /* text after a closing quote, or a quote never closed */
    write_file(path, "served-model-name = \"a\" b\n");
    ASSERT_EQ(rs_config_load_file(&c, path, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "served-model-name");
    write_file(path, "served-model-name = \"a b\n");
    ASSERT_EQ(rs_config_load_file(&c, path, &err), RS_EINVAL);
}

/* A comment after a value is a comment, not part of it (rolloutd.conf.example's "# starts a
 * comment"): a served name or a --quant-ignore glob must not silently take it in. */
RS_TEST(config_file_inline_comments) {
    char path[512];
    snprintf(path, sizeof path, "%s/comments.conf", rs_test_tmpdir());
    write_file(path,
               "served-model-name = policy-7b   # the name trainers use\n"
               "port = 9100\t# a test port\n"
               "api-key = \"k #1\"  # quoted: the # inside stays\n"
               "weight-version = step#100\n");
    rs_config c;
    rs_config_default(&c);
    rs_error err;
    ASSERT_EQ(rs_config_load_file(&c, path, &err), RS_OK);
    ASSERT_STREQ(c.served_model_name, "policy-7b");
    ASSERT_EQ(c.port, 9100);
    ASSERT_STREQ(c.api_key, "k #1");
    ASSERT_STREQ(c.weight_version, "step#100"); /* a # inside a word is not a comment */
}

RS_TEST(config_help_lists_every_setting) {
    char path[512];
    snprintf(path, sizeof path, "%s/help.txt", rs_test_tmpdir());
    FILE *f = fopen(path, "w+");
    ASSERT_TRUE(f != NULL);
    rs_config_print_help(f, "rolloutd");
    long n = ftell(f);
    ASSERT_TRUE(n > 0);
    char *text = calloc(1, (size_t)n + 1);
    rewind(f);
    ASSERT_EQ(fread(text, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    size_t ne;
    const rs_config_entry *e = rs_config_entries(&ne);
    for (size_t i = 0; i < ne; i++) {
        char flag[80];
        snprintf(flag, sizeof flag, "--%s ", e[i].name);
        if (!strstr(text, flag)) RS_TEST_FAIL("--help lacks %s", flag);
    }
    free(text);
}

/* config/rolloutd.conf.example documents every setting and loads cleanly as a config file. */
RS_TEST(config_example_file_covers_every_key) {
    const char *path = "config/rolloutd.conf.example";
    FILE *f = fopen(path, "r");
    ASSERT_TRUE(f != NULL);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    size_t count;
    const rs_config_entry *e = rs_config_entries(&count);
    for (size_t i = 0; i < count; i++) {
        char key[128];
        snprintf(key, sizeof key, "\n%s =", e[i].name);
        char commented[128];
        snprintf(commented, sizeof commented, "\n# %s =", e[i].name);
        if (!strstr(text, key) && !strstr(text, commented)) RS_TEST_FAIL("%s does not document '%s'", path, e[i].name);
    }
    rs_config c;
    rs_config_default(&c);
    rs_error err = {0};
    ASSERT_EQ(rs_config_load_file(&c, path, &err), RS_OK);
}
