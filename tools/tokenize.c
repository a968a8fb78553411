/*
 * tokenize.c — rolloutd's tokenizer from the command line, for tests and benchmarks against
 * Hugging Face `tokenizers` (tests/e2e/test_tokenizer_hf.py, scripts/bench_tokenizer.py).
 *
 *   tokenize DIR|FILE.json             JSON lines on stdin, one answer line each on stdout:
 *     {"op":"encode","text":"..."|"hex":"..","special":true}  -> {"ids":[..]} | {"error":".."}
 *     {"op":"decode","ids":[..],"skip":false}                 -> {"text":".."}
 *     {"op":"stream","ids":[..],"skip":false}                 -> {"deltas":[..]} (checked: each
 *        delta valid UTF-8, their concatenation equal to decode; else {"error":..})
 *     {"op":"token_text","id":N} -> {"text":".."};  {"op":"info"} -> vocab size, eos, bos
 *   tokenize --bench DIR|FILE.json CORPUS [REPEATS]
 *     encodes every line of CORPUS (JSON strings, one per line) REPEATS times single-threaded
 *     and prints bytes, seconds (wall and CPU) and MB/s, then streams the ids back through
 *     rs_tok_stream and prints ns per token (wall and CPU); all as one JSON line.
 * A DIR loads DIR/tokenizer.json with its config files; FILE.json loads the file alone.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "../core/rs.h"
#include "../tokenizer/tokenizer.h"

static int load(const char *arg, rs_tok **t, rs_error *err) {
    struct stat st;
    if (stat(arg, &st) == 0 && S_ISDIR(st.st_mode)) return rs_tok_load(arg, t, err);
    FILE *f = fopen(arg, "rb");
    if (!f) return rs_error_set(err, RS_EIO, NULL, "cannot open %s", arg);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = rs_xmalloc((size_t)n + 1);
    size_t got = fread(buf, 1, (size_t)n, f);
    fclose(f);
    int rc = rs_tok_load_json(buf, got, arg, t, err);
    free(buf);
    return rc;
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

static json_t *ids_json(const int32_t *ids, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

static int32_t *ids_from(json_t *a, size_t *n) {
    *n = json_array_size(a);
    int32_t *ids = rs_xmalloc((*n ? *n : 1) * sizeof *ids);
    for (size_t i = 0; i < *n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(a, i));
    return ids;
}

static bool valid_utf8(const char *s, size_t n) {
    json_t *j = json_stringn(s, n); /* jansson validates UTF-8 */
    bool ok = j != NULL;
    json_decref(j);
    return ok;
}

static json_t *op_stream(const rs_tok *t, json_t *req) {
    size_t n;
    int32_t *ids = ids_from(json_object_get(req, "ids"), &n);
    bool skip = json_is_true(json_object_get(req, "skip"));
    rs_tok_stream *s = rs_tok_stream_new(t, skip);
    json_t *deltas = json_array();
    char *all = rs_xmalloc(1);
    size_t all_n = 0;
    const char *err = NULL;
    for (size_t i = 0; i <= n; i++) {
        const char *d;
        size_t k = i < n ? rs_tok_stream_push(s, ids[i], &d) : rs_tok_stream_finish(s, &d);
        if (!valid_utf8(d, k)) err = "a delta is not valid UTF-8";
        json_array_append_new(deltas, json_stringn_nocheck(d, k));
        all = rs_xrealloc(all, all_n + k + 1);
        memcpy(all + all_n, d, k);
        all_n += k;
    }
    size_t dn;
    char *full = rs_tok_decode(t, ids, n, skip, &dn);
    if (!err && (dn != all_n || memcmp(full, all, dn) != 0)) err = "the deltas do not concatenate to decode";
    rs_tok_stream_free(s);
    free(all);
    free(full);
    free(ids);
    if (err) {
        json_decref(deltas);
        return json_pack("{s:s}", "error", err);
    }
    return json_pack("{s:o}", "deltas", deltas);
}

static json_t *handle(const rs_tok *t, json_t *req) {
    const char *op = json_string_value(json_object_get(req, "op"));
    if (!op) return json_pack("{s:s}", "error", "no op");
    if (!strcmp(op, "encode")) {
        json_t *text = json_object_get(req, "text"), *hex = json_object_get(req, "hex");
        char *buf;
        size_t len;
        if (json_is_string(text)) {
            len = json_string_length(text);
            buf = rs_xmalloc(len + 1);
            memcpy(buf, json_string_value(text), len);
        } else {
            const char *h = json_string_value(hex);
            len = h ? strlen(h) / 2 : 0;
            buf = rs_xmalloc(len + 1);
            for (size_t i = 0; i < len; i++) buf[i] = (char)(hexval(h[2 * i]) * 16 + hexval(h[2 * i + 1]));
        }
        int32_t *ids;
        size_t n;
        rs_error err = {0};
        int rc = rs_tok_encode(t, buf, len, json_is_true(json_object_get(req, "special")), &ids, &n, &err);
        free(buf);
        if (rc != RS_OK) return json_pack("{s:s,s:s}", "error", err.message, "code", rs_err_name(rc));
        json_t *out = json_pack("{s:o}", "ids", ids_json(ids, n));
        free(ids);
        return out;
    }
    if (!strcmp(op, "decode")) {
        size_t n, len;
        int32_t *ids = ids_from(json_object_get(req, "ids"), &n);
        char *s = rs_tok_decode(t, ids, n, json_is_true(json_object_get(req, "skip")), &len);
        json_t *out = valid_utf8(s, len) ? json_pack("{s:s%}", "text", s, len) : json_pack("{s:s}", "error", "invalid UTF-8");
        free(s);
        free(ids);
        return out;
    }
    if (!strcmp(op, "stream")) return op_stream(t, req);
    if (!strcmp(op, "token_text")) {
        size_t len;
        char *s = rs_tok_token_text(t, (int32_t)json_integer_value(json_object_get(req, "id")), &len);
        json_t *out = json_pack("{s:s%}", "text", s, len);
        free(s);
        return out;
    }
    if (!strcmp(op, "info")) {
        const int32_t *eos;
        int ne = rs_tok_eos_ids(t, &eos);
        json_t *special = json_array();
        for (int32_t id = 0; id < rs_tok_vocab_size(t); id++)
            if (rs_tok_is_special(t, id)) json_array_append_new(special, json_integer(id));
        return json_pack("{s:i,s:o,s:i,s:o}", "vocab_size", rs_tok_vocab_size(t), "eos", ids_json(eos, (size_t)ne), "bos",
                         rs_tok_bos_id(t), "special", special);
    }
    return json_pack("{s:s}", "error", "unknown op");
}

static double now_cpu(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int bench(const rs_tok *t, const char *corpus, int repeats) {
    FILE *f = fopen(corpus, "r");
    if (!f) {
        fprintf(stderr, "tokenize: cannot open %s\n", corpus);
        return 1;
    }
    char **lines = NULL;
    size_t *lens = NULL, n = 0, cap = 0, bytes = 0;
    char *line = NULL;
    size_t lcap = 0;
    while (getline(&line, &lcap, f) > 0) {
        json_error_t je;
        json_t *s = json_loads(line, JSON_DECODE_ANY, &je);
        if (!json_is_string(s)) {
            json_decref(s);
            continue;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 1024;
            lines = rs_xrealloc(lines, cap * sizeof *lines);
            lens = rs_xrealloc(lens, cap * sizeof *lens);
        }
        lens[n] = json_string_length(s);
        lines[n] = rs_xmalloc(lens[n] + 1);
        memcpy(lines[n], json_string_value(s), lens[n]);
        bytes += lens[n++];
        json_decref(s);
    }
    free(line);
    fclose(f);
    int32_t **ids = rs_xcalloc(n ? n : 1, sizeof *ids);
    size_t *nids = rs_xcalloc(n ? n : 1, sizeof *nids), tokens = 0;
    double t0 = rs_now_s(), c0 = now_cpu();
    for (int r = 0; r < repeats; r++)
        for (size_t i = 0; i < n; i++) {
            rs_error err;
            free(ids[i]);
            if (rs_tok_encode(t, lines[i], lens[i], false, &ids[i], &nids[i], &err) != RS_OK) {
                fprintf(stderr, "tokenize: line %zu: %s\n", i, err.message);
                return 1;
            }
        }
    double secs = rs_now_s() - t0, cpu = now_cpu() - c0;
    for (size_t i = 0; i < n; i++) tokens += nids[i];
    double s0 = rs_now_s(), sc0 = now_cpu();
    size_t out_bytes = 0;
    for (int r = 0; r < repeats; r++)
        for (size_t i = 0; i < n; i++) {
            rs_tok_stream *s = rs_tok_stream_new(t, false);
            const char *d;
            for (size_t k = 0; k < nids[i]; k++) out_bytes += rs_tok_stream_push(s, ids[i][k], &d);
            out_bytes += rs_tok_stream_finish(s, &d);
            rs_tok_stream_free(s);
        }
    double ssecs = rs_now_s() - s0, scpu = now_cpu() - sc0;
    size_t all_tokens = tokens * (size_t)repeats;
    printf("{\"bytes\": %zu, \"seconds\": %.6f, \"cpu_seconds\": %.6f, \"mb_per_s\": %.3f, \"tokens\": %zu, "
           "\"stream_ns_per_token\": %.2f, \"stream_cpu_ns_per_token\": %.2f, \"stream_bytes\": %zu}\n",
           bytes * (size_t)repeats, secs, cpu, (double)bytes * repeats / secs / 1e6, all_tokens,
           ssecs * 1e9 / (double)(all_tokens ? all_tokens : 1), scpu * 1e9 / (double)(all_tokens ? all_tokens : 1),
           out_bytes);
    for (size_t i = 0; i < n; i++) free(lines[i]), free(ids[i]);
    free(lines), free(lens), free(ids), free(nids);
    return 0;
}

int main(int argc, char **argv) {
    rs_error err = {0};
    rs_tok *t = NULL;
    if (argc >= 4 && !strcmp(argv[1], "--bench")) {
        if (load(argv[2], &t, &err) != RS_OK) {
            fprintf(stderr, "tokenize: %s\n", err.message);
            return 1;
        }
        int rc = bench(t, argv[3], argc > 4 ? atoi(argv[4]) : 1);
        rs_tok_free(t);
        return rc;
    }
    if (argc != 2) {
        fprintf(stderr, "usage: tokenize DIR|FILE.json  (JSON lines on stdin)\n"
                        "       tokenize --bench DIR|FILE.json CORPUS [REPEATS]\n");
        return 2;
    }
    int rc = load(argv[1], &t, &err);
    if (rc != RS_OK) {
        json_t *o = json_pack("{s:s,s:s,s:s}", "load_error", err.message, "code", rs_err_name(rc), "param", err.param);
        char *s = json_dumps(o, JSON_COMPACT);
        puts(s);
        free(s);
        json_decref(o);
        return 1;
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) > 0) {
        json_error_t je;
        json_t *req = json_loads(line, JSON_ALLOW_NUL, &je), *out;
        out = req ? handle(t, req) : json_pack("{s:s}", "error", je.text);
        char *s = json_dumps(out, JSON_COMPACT);
        puts(s);
        fflush(stdout);
        free(s);
        json_decref(out);
        json_decref(req);
    }
    free(line);
    rs_tok_free(t);
    return 0;
}
