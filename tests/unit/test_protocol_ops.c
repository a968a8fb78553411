/*
 * test_protocol_ops.c — operations bodies (protocol/ops.c) and the Prometheus text
 * (protocol/metrics.c): strict parsing of abort/pause/continue bodies, /get_server_info listing
 * every setting of the config table, and metrics that a Prometheus parser accepts (HELP and TYPE
 * before samples, cumulative buckets ending at +Inf, _count equal to the +Inf bucket).
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "../../config/config.h"
#include "../../protocol/metrics.h"
#include "../../protocol/ops.h"
#include "test.h"

static int parse_abort(const char *body, rs_abort_req *a, rs_error *err) {
    memset(err, 0, sizeof *err);
    return rs_abort_parse(body, strlen(body), a, err);
}

RS_TEST(protocol_ops_abort_bodies) {
    rs_abort_req a;
    rs_error err;
    ASSERT_EQ(parse_abort("{\"rid\": \"grp7\"}", &a, &err), RS_OK);
    ASSERT_STREQ(a.rid, "grp7");
    ASSERT_TRUE(!a.abort_all);
    ASSERT_EQ(parse_abort("{\"abort_all\": true}", &a, &err), RS_OK);
    ASSERT_TRUE(a.abort_all);
    ASSERT_EQ(parse_abort("{\"abort_all\": true, \"rid\": \"x\"}", &a, &err), RS_OK);
    ASSERT_TRUE(a.abort_all);
    ASSERT_STREQ(a.rid, "");
    /* SGLang's AbortReq defaults rid to "", and its clients send it with abort_all (veRL's adapter) */
    ASSERT_EQ(parse_abort("{\"rid\": \"\", \"abort_all\": true}", &a, &err), RS_OK);
    ASSERT_TRUE(a.abort_all);
    static const struct { const char *body, *param, *msg; } bad[] = {
        {"", "", "empty"},
        {"{}", "rid", "abort_all"},
        {"{\"abort_all\": false}", "rid", "abort_all"},
        {"{\"rid\": 5}", "rid", "must be a string"},
        {"{\"rid\": \"\"}", "rid", "abort_all"},
        {"{\"abort_all\": \"yes\"}", "abort_all", "true or false"},
        {"{\"rid\": \"a\", \"x\": 1}", "x", "unknown field 'x'"},
        {"[1]", "", "must be a JSON object"},
        {"{\"rid\": \"a\"", "", "invalid JSON"},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(bad); i++) {
        if (parse_abort(bad[i].body, &a, &err) != RS_EINVAL) RS_TEST_FAIL("case %zu accepted", i);
        if (strcmp(err.param, bad[i].param) != 0 || !strstr(err.message, bad[i].msg))
            RS_TEST_FAIL("case %zu %s: param '%s' message '%s'", i, bad[i].body, err.param, err.message);
    }
}

RS_TEST(protocol_ops_pause_and_empty_bodies) {
    rs_pause_mode m;
    rs_error err;
    ASSERT_EQ(rs_pause_parse("", 0, &m, &err), RS_OK);
    ASSERT_EQ(m, RS_PAUSE_ABORT); /* SGLang's default */
    ASSERT_EQ(rs_pause_parse("{}", 2, &m, &err), RS_OK);
    ASSERT_EQ(m, RS_PAUSE_ABORT);
    const char *b = "{\"mode\": \"retract\"}";
    ASSERT_EQ(rs_pause_parse(b, strlen(b), &m, &err), RS_OK);
    ASSERT_EQ(m, RS_PAUSE_RETRACT);
    b = "{\"mode\": \"in_place\"}";
    ASSERT_EQ(rs_pause_parse(b, strlen(b), &m, &err), RS_OK);
    ASSERT_EQ(m, RS_PAUSE_IN_PLACE);
    ASSERT_STREQ(rs_pause_mode_name(m), "in_place");
    b = "{\"mode\": \"keep\"}";
    ASSERT_EQ(rs_pause_parse(b, strlen(b), &m, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "mode");
    b = "{\"mode\": 1}";
    ASSERT_EQ(rs_pause_parse(b, strlen(b), &m, &err), RS_EINVAL);
    b = "{\"mode\": \"abort\", \"x\": 1}";
    ASSERT_EQ(rs_pause_parse(b, strlen(b), &m, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "x");
    ASSERT_EQ(rs_continue_parse(" \n", 2, &err), RS_OK);
    ASSERT_EQ(rs_continue_parse("{}", 2, &err), RS_OK);
    b = "{\"torch_empty_cache\": false, \"rid\": \"x\"}"; /* SGLang's fields, no effect here */
    ASSERT_EQ(rs_continue_parse(b, strlen(b), &err), RS_OK);
    b = "{\"now\": true}";
    ASSERT_EQ(rs_flush_parse(b, strlen(b), &err), RS_EINVAL);
    ASSERT_TRUE(strstr(err.message, "/flush_cache takes no parameters") != NULL);
    ASSERT_EQ(rs_flush_parse("[]", 2, &err), RS_EINVAL);
    b = "{\"timeout_s\": null}";
    ASSERT_EQ(rs_flush_parse(b, strlen(b), &err), RS_OK);
    b = "{\"timeout_s\": 5}"; /* SGLang's wait for idle: not implemented */
    ASSERT_EQ(rs_flush_parse(b, strlen(b), &err), RS_EUNSUPPORTED);
    ASSERT_STREQ(err.param, "timeout_s");
}

RS_TEST(protocol_ops_server_info_lists_every_setting) {
    rs_config cfg;
    rs_config_default(&cfg);
    rs_error err;
    ASSERT_EQ(rs_config_set(&cfg, "api-key", "hunter2", &err), RS_OK);
    rs_engine_stats st = {.kv_blocks_total = 100, .kv_blocks_free = 60, .n_running = 3};
    rs_engine_limits lim = {.max_context = 4096};
    rs_server_info si = {.cfg = &cfg, .backend = "cpu", .limits = &lim, .stats = &st, .weight_bytes = 1 << 20,
                         .kv_cache_bytes = 64 << 20};
    si.model = (rs_model_info){.model_path = "/m", .served_model_name = "default", .architecture = "Qwen3ForCausalLM",
                               .weight_version = "7", .quantization = "bf16", .kv_cache_dtype = "fp8"};
    size_t len;
    char *body = rs_server_info_body(&si, &len);
    json_t *v = json_loadb(body, len, 0, NULL);
    ASSERT_TRUE(v != NULL);
    size_t n;
    const rs_config_entry *e = rs_config_entries(&n);
    for (size_t i = 0; i < n; i++) {
        char key[64];
        snprintf(key, sizeof key, "%s", e[i].name);
        for (char *p = key; *p; p++)
            if (*p == '-') *p = '_';
        if (!json_object_get(v, key)) RS_TEST_FAIL("setting %s missing from server info", key);
    }
    ASSERT_STREQ(json_string_value(json_object_get(v, "api_key")), "(set)"); /* never the secret */
    ASSERT_TRUE(strstr(body, "hunter2") == NULL);
    ASSERT_EQ(json_integer_value(json_object_get(v, "kv_cache_mb")), 1024); /* typed */
    ASSERT_TRUE(json_is_boolean(json_object_get(v, "prefix_cache")));
    ASSERT_EQ(json_integer_value(json_object_get(v, "max_total_num_tokens")), 1600);
    ASSERT_STREQ(json_string_value(json_object_get(v, "backend")), "cpu");
    ASSERT_STREQ(json_string_value(json_object_get(v, "version")), RS_VERSION);
    ASSERT_STREQ(json_string_value(json_object_get(v, "weight_version")), "7");
    json_t *mu = json_object_get(v, "memory_usage");
    ASSERT_EQ(json_integer_value(json_object_get(mu, "weight_bytes")), 1 << 20);
    ASSERT_EQ(json_integer_value(json_object_get(mu, "kv_cache_bytes")), 64 << 20);
    json_decref(v);
    free(body);
}

/* A small Prometheus text parser: every sample's family was declared by HELP and TYPE first. */
static double sample_value(const char *text, const char *name_and_labels) {
    size_t n = strlen(name_and_labels);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        if (strncmp(p, name_and_labels, n) == 0 && p[n] == ' ') return strtod(p + n + 1, NULL);
    }
    RS_TEST_FAIL("no sample %s", name_and_labels);
}

RS_TEST(protocol_metrics_text) {
    rs_engine_stats st = {.kv_blocks_total = 200, .kv_blocks_free = 150, .kv_blocks_cached = 10, .n_running = 4,
                          .n_waiting = 2, .num_retractions = 3, .prompt_tokens = 1000, .generation_tokens = 250};
    rs_histogram_observe(&st.ttft, 0.003);
    rs_histogram_observe(&st.ttft, 0.2);
    rs_histogram_observe(&st.ttft, 1e6);
    rs_metrics_http http[] = {{"/generate", 200, 7}, {"/generate", 400, 1}};
    rs_metrics_input in = {.stats = &st, .http_in_flight = 1, .http = http, .n_http = 2, .rss_bytes = 1e6,
                           .start_time_s = 1.7e9, .version = "0.1.0"};
    size_t len;
    char *t = rs_metrics_text(&in, &len);
    ASSERT_TRUE(t != NULL);
    ASSERT_EQ(strlen(t), len);
    ASSERT_NEAR(sample_value(t, "rolloutd_num_running_reqs"), 4, 0);
    ASSERT_NEAR(sample_value(t, "sglang:num_running_reqs"), 4, 0);
    ASSERT_NEAR(sample_value(t, "vllm:num_requests_waiting"), 2, 0);
    ASSERT_NEAR(sample_value(t, "sglang:num_queue_reqs"), 2, 0);
    ASSERT_NEAR(sample_value(t, "vllm:kv_cache_usage_perc"), 0.25, 1e-12);
    ASSERT_NEAR(sample_value(t, "sglang:token_usage"), 0.25, 1e-12);
    ASSERT_NEAR(sample_value(t, "vllm:num_preemptions_total"), 3, 0);
    ASSERT_NEAR(sample_value(t, "vllm:prompt_tokens_total"), 1000, 0);
    ASSERT_NEAR(sample_value(t, "vllm:generation_tokens_total"), 250, 0);
    ASSERT_NEAR(sample_value(t, "rolloutd_prompt_tokens_total"), 1000, 0);
    ASSERT_NEAR(sample_value(t, "rolloutd_time_to_first_token_seconds_bucket{le=\"0.005\"}"), 1, 0);
    ASSERT_NEAR(sample_value(t, "rolloutd_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), 3, 0);
    ASSERT_NEAR(sample_value(t, "vllm:time_to_first_token_seconds_count"), 3, 0);
    ASSERT_NEAR(sample_value(t, "rolloutd_http_responses_total{route=\"/generate\",code=\"400\"}"), 1, 0);
    ASSERT_NEAR(sample_value(t, "process_resident_memory_bytes"), 1e6, 0);

    /* structure: HELP then TYPE precede a family's samples; buckets are cumulative */
    char declared[128][96];
    int n_declared = 0;
    double last_bucket = -1;
    for (char *line = t; *line;) {
        char *nl = strchr(line, '\n');
        ASSERT_TRUE(nl != NULL); /* every line ends with \n */
        *nl = '\0';
        if (strncmp(line, "# HELP ", 7) == 0) {
            char name[96];
            ASSERT_EQ(sscanf(line + 7, "%95s", name), 1);
            char *next = nl + 1;
            char want[128];
            snprintf(want, sizeof want, "# TYPE %s ", name);
            ASSERT_TRUE(strncmp(next, want, strlen(want)) == 0);
            ASSERT_TRUE(n_declared < 128);
            snprintf(declared[n_declared++], sizeof declared[0], "%s", name);
            last_bucket = -1;
        } else if (line[0] != '#') {
            char name[160];
            ASSERT_EQ(sscanf(line, "%159[^ {]", name), 1);
            bool found = false;
            for (int i = 0; i < n_declared && !found; i++) {
                size_t dl = strlen(declared[i]);
                found = strcmp(name, declared[i]) == 0 ||
                        (strncmp(name, declared[i], dl) == 0 &&
                         (!strcmp(name + dl, "_bucket") || !strcmp(name + dl, "_sum") || !strcmp(name + dl, "_count")));
            }
            if (!found) RS_TEST_FAIL("sample %s without HELP/TYPE", name);
            if (strstr(name, "_bucket")) {
                double v = strtod(strrchr(line, ' ') + 1, NULL);
                ASSERT_TRUE(v >= last_bucket);
                last_bucket = v;
            }
        }
        line = nl + 1;
    }
    free(t);
}
