/*
 * test_protocol_fields.c — the descriptor tables and their walker (protocol/json_util.c): the
 * defaults the field reference documents are the values a request gets when it omits the field,
 * null means the default everywhere, neutral values are accepted and others refused by name,
 * aliases of one field cannot both be given, and the walker's messages name the field.
 */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../protocol/fields_doc.h"
#include "../../protocol/generate.h"
#include "../../protocol/json_util.h"
#include "../../protocol/openai.h"
#include "test.h"

/* The value at a READ row's destination, as a double (bool: 0/1, enum: the index). */
static double value_at(const rs_jfield *f, void *const *dst) {
    const char *p = (const char *)dst[f->base] + f->offset;
    switch (f->type) {
    case RS_JT_BOOL: return *(const bool *)p;
    case RS_JT_INT: return f->size == sizeof(int) ? *(const int *)p : (double)*(const long long *)p;
    case RS_JT_FLOAT: return f->size == sizeof(float) ? *(const float *)p : *(const double *)p;
    case RS_JT_ENUM: return *(const int *)p;
    default: break;
    }
    RS_TEST_FAIL("field %s: no scalar value", f->name);
}

/* The documented default as the same double. */
static double documented(const rs_jfield *f) {
    if (strcmp(f->def, "true") == 0) return 1;
    if (strcmp(f->def, "false") == 0) return 0;
    if (f->type == RS_JT_ENUM) {
        size_t len = strlen(f->def) - 2; /* "\"name\"" */
        int i = 0;
        for (const char *c = f->choices; c; c = strchr(c, '|') ? strchr(c, '|') + 1 : NULL, i++)
            if (strncmp(c, f->def + 1, len) == 0 && (c[len] == '|' || c[len] == '\0')) return i;
        RS_TEST_FAIL("field %s: default %s is not a choice", f->name, f->def);
    }
    char *end;
    double x = strtod(f->def, &end);
    if (*end) RS_TEST_FAIL("field %s: default '%s' is not a number", f->name, f->def);
    return x;
}

static int check_defaults(const rs_jobject *t, void *const *dst) {
    int n = 0;
    for (size_t i = 0; i < t->n; i++) {
        const rs_jfield *f = &t->fields[i];
        if (f->sub && f->type == RS_JT_OBJECT) n += check_defaults(f->sub, dst);
        if (f->use != RS_JU_READ || !f->def || strcmp(f->def, "null") == 0) continue;
        if (f->type != RS_JT_BOOL && f->type != RS_JT_INT && f->type != RS_JT_FLOAT && f->type != RS_JT_ENUM) continue;
        double got = value_at(f, dst), want = documented(f);
        if (got != want) RS_TEST_FAIL("%s.%s: documented default %s, a request without it gets %g", t->title,
                                      f->name, f->def, got);
        n++;
    }
    return n;
}

RS_TEST(protocol_fields_documented_defaults_are_the_defaults) {
    rs_generate_req g;
    rs_error err;
    const char *body = "{\"input_ids\": [1]}";
    ASSERT_EQ(rs_generate_parse(body, strlen(body), NULL, &g, &err), RS_OK);
    void *const gdst[] = {&g, g.job, &g.job->sp, g.text};
    ASSERT_TRUE(check_defaults(&rs_generate_fields, gdst) == 20);
    rs_generate_req_free(&g);

    rs_openai_req o;
    body = "{\"prompt\": [1]}";
    ASSERT_EQ(rs_openai_parse_completions(body, strlen(body), NULL, &o, &err), RS_OK);
    void *const odst[] = {&o, o.job, &o.job->sp, o.text};
    ASSERT_TRUE(check_defaults(&rs_openai_completion_fields, odst) == 19);
    ASSERT_EQ(o.job->sp.max_new_tokens, 16); /* documented "16" on a custom row */
    rs_openai_req_free(&o);
}

typedef struct toy {
    int k;
    float x;
    bool flag;
    char name[8];
} toy;

static int parse_toy(const rs_jobject *t, const char *body, toy *out, rs_error *err) {
    json_t *root;
    int rc = rs_json_load_object(body, strlen(body), false, &root, err);
    if (rc != RS_OK) return rc;
    void *const dst[] = {out};
    rc = rs_json_read(root, t, dst, "", err);
    json_decref(root);
    return rc;
}

RS_TEST(protocol_fields_walker) {
    static const rs_jfield fields[] = {
        {.name = "k", .type = RS_JT_INT, .flags = RS_JF_REQUIRED, .offset = offsetof(toy, k), .size = sizeof(int),
         .min = -1, .max = 10},
        {.name = "x", .type = RS_JT_FLOAT, .flags = RS_JF_MIN_OPEN, .offset = offsetof(toy, x), .size = sizeof(float),
         .min = 0, .max = 1},
        {.name = "flag", .type = RS_JT_BOOL, .offset = offsetof(toy, flag), .size = sizeof(bool)},
        {.name = "alias", .type = RS_JT_BOOL, .offset = offsetof(toy, flag), .size = sizeof(bool)},
        {.name = "name", .type = RS_JT_STRING, .offset = offsetof(toy, name), .size = sizeof(((toy *)0)->name)},
        {.name = "later", .type = RS_JT_LIST, .use = RS_JU_NEUTRAL, .neutral = "[]|\"\"", .doc = "later things"},
        {.name = "tag", .type = RS_JT_TEXT, .use = RS_JU_NO_EFFECT},
        {.name = "elsewhere", .use = RS_JU_ELSEWHERE, .doc = "it belongs to /other"},
    };
    static const rs_jobject t = {.title = "toy", .fields = fields, .n = RS_ARRAY_LEN(fields)};
    toy v = {0};
    rs_error err;
    ASSERT_EQ(parse_toy(&t, "{\"k\": 3, \"x\": 0.5, \"alias\": true, \"name\": \"abc\", \"later\": [], \"tag\": \"t\"}",
                        &v, &err), RS_OK);
    ASSERT_EQ(v.k, 3);
    ASSERT_NEAR(v.x, 0.5, 0);
    ASSERT_TRUE(v.flag);
    ASSERT_STREQ(v.name, "abc");
    v = (toy){.x = 0.25f};
    ASSERT_EQ(parse_toy(&t, "{\"k\": -1, \"x\": null, \"later\": null, \"tag\": null}", &v, &err), RS_OK);
    ASSERT_NEAR(v.x, 0.25, 0); /* null keeps the default */
    ASSERT_EQ(parse_toy(&t, "{\"k\": 4.0}", &v, &err), RS_OK); /* JSON Schema's integer: 4.0 is 4 */
    ASSERT_EQ(v.k, 4);
    ASSERT_EQ(parse_toy(&t, "{\"k\": -1e0}", &v, &err), RS_OK);
    ASSERT_EQ(v.k, -1);
    static const struct { const char *body, *param, *needle; int code; } bad[] = {
        {"{}", "k", "k is required", RS_EINVAL},
        {"{\"k\": null}", "k", "k is required", RS_EINVAL},
        {"{\"k\": 11}", "k", "k must be <= 10, got 11", RS_EINVAL},
        {"{\"k\": 1.5}", "k", "k must be an integer, got 1.5", RS_EINVAL},
        {"{\"k\": 1e300}", "k", "k must be <= 10, got 1e+300", RS_EINVAL},
        {"{\"k\": -1e300}", "k", "k must be >= -1, got -1e+300", RS_EINVAL},
        {"{\"k\": 1, \"x\": 0}", "x", "x must be in (0, 1], got 0", RS_EINVAL},
        /* checked as stored: an fp32 x rounds 3e-258 to 0 */
        {"{\"k\": 1, \"x\": 3e-258}", "x", "x must be in (0, 1], got 3e-258", RS_EINVAL},
        /* and as given: 1.00000001 would be stored as 1 */
        {"{\"k\": 1, \"x\": 1.00000001}", "x", "x must be in (0, 1], got 1", RS_EINVAL},
        {"{\"k\": 1, \"x\": \"0.5\"}", "x", "x must be a number, got a string", RS_EINVAL},
        {"{\"k\": 1, \"flag\": true, \"alias\": false}", "alias", "alias and flag name the same field", RS_EINVAL},
        {"{\"k\": 1, \"name\": \"12345678\"}", "name", "at most 7 bytes", RS_EINVAL},
        {"{\"k\": 1, \"later\": [1]}", "later", "later is not supported: it is not implemented in rolloutd (later "
         "things); accepted: null, [], \"\"; got a list of 1 entry", RS_EUNSUPPORTED},
        {"{\"k\": 1, \"later\": \"x\"}", "later", "must be a list, got a string", RS_EINVAL},
        {"{\"k\": 1, \"tag\": 5}", "tag", "tag must be a string, got 5", RS_EINVAL},
        {"{\"k\": 1, \"elsewhere\": 1}", "elsewhere", "unknown field 'elsewhere' (it belongs to /other)", RS_EINVAL},
        {"{\"k\": 1, \"nope\": 1}", "nope", "unknown field 'nope'", RS_EINVAL},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(bad); i++) {
        memset(&err, 0, sizeof err);
        int rc = parse_toy(&t, bad[i].body, &v, &err);
        if (rc != bad[i].code || strcmp(err.param, bad[i].param) != 0 || !strstr(err.message, bad[i].needle))
            RS_TEST_FAIL("%s: rc %d param '%s' message '%s'", bad[i].body, rc, err.param, err.message);
    }
}

RS_TEST(protocol_fields_neutral_literals) {
    static const struct { const char *json, *neutral; bool want; } cases[] = {
        {"null", "", true},     {"false", "false", true}, {"true", "false", false}, {"0", "0", true},
        {"0.0", "0", true},     {"1", "0", false},        {"[]", "[]", true},       {"[0]", "[]", false},
        {"{}", "{}", true},     {"{\"a\": 1}", "{}", false}, {"\"\"", "\"\"|[]", true}, {"[]", "\"\"|[]", true},
        {"\"x\"", "\"\"|[]", false}, {"1", "1", true},     {"1.0", "1", true},       {"false", "0", false},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(cases); i++) {
        json_t *v = json_loads(cases[i].json, JSON_DECODE_ANY, NULL);
        ASSERT_TRUE(v != NULL);
        if (rs_json_neutral(v, cases[i].neutral) != cases[i].want)
            RS_TEST_FAIL("%s against '%s': want %d", cases[i].json, cases[i].neutral, cases[i].want);
        json_decref(v);
    }
}

/* Every table's rows are well formed: a known neutral literal list (a typo would assert when a
 * request sends the field), READ rows with a destination size, CUSTOM rows with a reader, OBJECT
 * rows with a table, no name twice in one object. */
static void check_table(const rs_jobject *t) {
    json_t *probe = json_integer(12345);
    for (size_t i = 0; i < t->n; i++) {
        const rs_jfield *f = &t->fields[i];
        for (size_t j = 0; j < i; j++)
            if (strcmp(f->name, t->fields[j].name) == 0) RS_TEST_FAIL("%s: %s twice", t->title, f->name);
        if (f->use == RS_JU_NEUTRAL) (void)rs_json_neutral(probe, f->neutral);
        if (f->type == RS_JT_CUSTOM && !f->read) RS_TEST_FAIL("%s.%s: no reader", t->title, f->name);
        if (f->type == RS_JT_OBJECT && !f->sub) RS_TEST_FAIL("%s.%s: no table", t->title, f->name);
        if (f->use == RS_JU_READ && f->type != RS_JT_CUSTOM && f->type != RS_JT_OBJECT && f->size == 0)
            RS_TEST_FAIL("%s.%s: no destination", t->title, f->name);
        if (f->use != RS_JU_ELSEWHERE && !f->doc && f->type != RS_JT_CUSTOM && f->use != RS_JU_READ)
            RS_TEST_FAIL("%s.%s: no doc", t->title, f->name);
        if (f->sub) check_table(f->sub);
    }
    json_decref(probe);
}

RS_TEST(protocol_fields_tables_are_well_formed) {
    size_t n;
    const rs_jobject *const *tables = rs_protocol_tables(&n);
    ASSERT_EQ(n, 14);
    for (size_t i = 0; i < n; i++) check_table(tables[i]);
}

/* The schema of one table against the table: one property per field that is not ELSEWHERE, no
 * others, `required` as the flags say; every CUSTOM row's schema text parses (rs_json_schema
 * asserts that) and has every shorthand ($sub, $ids, ...) expanded. Recurses through the nested tables. */
static void check_schema(const rs_jobject *t, const json_t *s) {
    ASSERT_TRUE(json_is_object(s));
    ASSERT_TRUE(json_is_false(json_object_get(s, "additionalProperties")));
    const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    size_t n_fields = 0, n_req = 0;
    for (size_t i = 0; i < t->n; i++) {
        const rs_jfield *f = &t->fields[i];
        if (f->use == RS_JU_ELSEWHERE) {
            if (json_object_get(props, f->name)) RS_TEST_FAIL("%s: %s (ELSEWHERE) in the schema", t->title, f->name);
            continue;
        }
        n_fields++;
        const json_t *p = json_object_get(props, f->name);
        if (!p) RS_TEST_FAIL("%s: %s missing from the schema", t->title, f->name);
        char *text = json_dumps(p, JSON_COMPACT);
        if (strstr(text, "\"$")) RS_TEST_FAIL("%s.%s: a shorthand not expanded: %s", t->title, f->name, text);
        free(text);
        if (f->flags & RS_JF_REQUIRED) n_req++;
        if (f->type == RS_JT_OBJECT) check_schema(f->sub, json_array_get(json_object_get(p, "anyOf"), 0));
    }
    ASSERT_EQ(json_object_size(props), n_fields);
    ASSERT_EQ(req ? json_array_size(req) : 0, n_req);
}

RS_TEST(protocol_fields_schemas_match_the_tables) {
    size_t n;
    const rs_jobject *const *tables = rs_protocol_tables(&n);
    for (size_t i = 0; i < n; i++) {
        json_t *s = rs_json_schema(tables[i], NULL);
        ASSERT_TRUE(s != NULL);
        check_schema(tables[i], s);
        json_decref(s);
    }
    /* a few rows, by what the walker checks */
    json_t *g = rs_json_schema(&rs_generate_fields, NULL);
    char *text = json_dumps(g, JSON_COMPACT | JSON_SORT_KEYS);
    const char *want[] = {
        /* top_p in (0, 1] as an fp32 holds it (past 2^-150, which rounds to 0), null allowed */
        "\"top_p\":{\"anyOf\":[{\"exclusiveMinimum\":7.0064923216240854e-46,\"maximum\":1,\"type\":\"number\"},"
        "{\"type\":\"null\"}]",
        /* top_k: -1 or >= 1 */
        "\"not\":{\"const\":0},\"type\":\"integer\"",
        /* image_data, not implemented: null or [] */
        ("\"image_data\":{\"description\":\"multimodal inputs; not implemented: other values are a 400\","
         "\"enum\":[null,[]]}"),
        /* exactly one of input_ids and text, given and not null */
        "\"oneOf\":[{\"properties\":{\"input_ids\":{\"not\":{\"type\":\"null\"}}},\"required\":[\"input_ids\"]},",
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(want); i++)
        if (!strstr(text, want[i])) RS_TEST_FAIL("the /generate schema lacks %s", want[i]);
    free(text);
    json_decref(g);
}

/* A rule between fields the parser checks is in the object's schema: /v1/completions' stream_options
 * needs stream: true (the parser refuses it otherwise; null is absent). */
RS_TEST(protocol_fields_schema_states_rules_between_fields) {
    json_t *s = rs_json_schema(&rs_openai_completion_fields, NULL);
    char *text = json_dumps(s, JSON_COMPACT | JSON_SORT_KEYS);
    ASSERT_TRUE(strstr(text, "\"if\":{\"properties\":{\"stream_options\":{\"type\":\"object\"}},"
                             "\"required\":[\"stream_options\"]}") != NULL);
    ASSERT_TRUE(strstr(text, "\"then\":{\"properties\":{\"stream\":{\"const\":true}},\"required\":[\"stream\"]}")
                != NULL);
    ASSERT_TRUE(json_object_get(json_object_get(s, "properties"), "stream_options") != NULL); /* kept */
    free(text);
    json_decref(s);
    static const struct { const char *body; int rc; } cases[] = {
        {"{\"prompt\": [1], \"stream_options\": {}}", RS_EINVAL},
        {"{\"prompt\": [1], \"stream\": false, \"stream_options\": {}}", RS_EINVAL},
        {"{\"prompt\": [1], \"stream\": true, \"stream_options\": {}}", RS_OK},
        {"{\"prompt\": [1], \"stream_options\": null}", RS_OK},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(cases); i++) {
        rs_openai_req r;
        rs_error err;
        int rc = rs_openai_parse_completions(cases[i].body, strlen(cases[i].body), NULL, &r, &err);
        if (rc != cases[i].rc) RS_TEST_FAIL("%s: %d, want %d", cases[i].body, rc, cases[i].rc);
        if (rc == RS_OK) rs_openai_req_free(&r);
    }
}

/* With a server's limits, the rows that name one are capped by it, and token ids by its vocabulary,
 * as rs_gen_job_validate checks them; the tables' own ranges stay where they are tighter. */
RS_TEST(protocol_fields_schemas_state_server_limits) {
    rs_jlimits lim = {.vocab = 8192};
    lim.max[RS_JL_NEW_TOKENS] = 16;
    lim.max[RS_JL_N] = 4;
    lim.max[RS_JL_TOP_LOGPROBS] = 20;
    struct { const rs_jobject *t; const char *want; } cases[] = {
        {&rs_generate_fields, "\"max_new_tokens\":{\"anyOf\":[{\"maximum\":16,\"minimum\":0,"},
        {&rs_generate_fields, "\"min_new_tokens\":{\"anyOf\":[{\"maximum\":16,\"minimum\":0,"},
        {&rs_generate_fields, "\"n\":{\"anyOf\":[{\"maximum\":4,\"minimum\":1,"},
        /* top_logprobs_num is capped only with return_logprob, which a schema of the field cannot say */
        {&rs_generate_fields, "\"top_logprobs_num\":{\"anyOf\":[{\"maximum\":2147483647,\"minimum\":0,"},
        {&rs_generate_fields, "\"items\":{\"maximum\":8191,\"minimum\":0,\"type\":\"integer\"}"},
        {&rs_generate_fields, "\"stop_token_ids\":{\"anyOf\":[{\"items\":{\"maximum\":8191,"},
        {&rs_openai_completion_fields, "\"max_tokens\":{\"anyOf\":[{\"maximum\":16,\"minimum\":0,"},
        {&rs_openai_completion_fields, "\"logprobs\":{\"anyOf\":[{\"maximum\":20,\"minimum\":0,"},
        {&rs_openai_completion_fields, "\"n\":{\"anyOf\":[{\"maximum\":4,\"minimum\":1,"},
        {&rs_openai_completion_fields, "\"min_tokens\":{\"anyOf\":[{\"maximum\":16,\"minimum\":0,"},
        /* seed has no server limit: the table's range stands */
        {&rs_openai_completion_fields, "\"maximum\":9223372036854775807,\"minimum\":-9223372036854775808"},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(cases); i++) {
        json_t *s = rs_json_schema(cases[i].t, &lim);
        char *text = json_dumps(s, JSON_COMPACT | JSON_SORT_KEYS);
        if (!strstr(text, cases[i].want)) RS_TEST_FAIL("%s lacks %s", cases[i].t->title, cases[i].want);
        free(text);
        json_decref(s);
    }
    /* a limit above the table's range leaves the range */
    lim.max[RS_JL_NEW_TOKENS] = 1LL << 40;
    json_t *s = rs_json_schema(&rs_generate_fields, &lim);
    char *text = json_dumps(s, JSON_COMPACT | JSON_SORT_KEYS);
    ASSERT_TRUE(strstr(text, "\"max_new_tokens\":{\"anyOf\":[{\"maximum\":2147483647,") != NULL);
    free(text);
    json_decref(s);
}
