/*
 * config.c — the settings table and the code it drives (see config.h).
 *
 * Defaults are written as text and go through the same parser as user input, so the table cannot
 * hold a default its own range check would reject (rs_config_default asserts on that), and --help
 * prints exactly what a user would type. Values are checked for type and range when they are set;
 * nothing downstream re-validates them.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#define F(field) offsetof(rs_config, field), sizeof(((rs_config *)0)->field)

static const rs_config_entry entries[] = {
    {"model", RS_CONFIG_TYPE_STRING, F(model), 0, 4095, "", NULL,
     "model directory (config.json + safetensors); empty = the embedded default model", 0},
    {"quantization", RS_CONFIG_TYPE_ENUM, F(quantization), 0, 0, "fp8", "fp8|bf16",
     "weight precision of attention and MLP matrices: fp8 (128x128 blocks, W8A8) or bf16 (as stored)", 0},
    {"quant-ignore", RS_CONFIG_TYPE_STRING, F(quant_ignore), 0, 1023, "", NULL,
     "comma-separated globs of tensor names kept as stored with --quantization fp8 (e.g. '*.mlp.down_proj')", 0},
    {"bf16-first-layers", RS_CONFIG_TYPE_INT, F(bf16_first_layers), 0, 256, "0", NULL,
     "first N decoder layers kept as stored with --quantization fp8", 0},
    {"bf16-last-layers", RS_CONFIG_TYPE_INT, F(bf16_last_layers), 0, 256, "0", NULL,
     "last N decoder layers kept as stored with --quantization fp8", 0},
    {"quantize-lm-head", RS_CONFIG_TYPE_BOOL, F(quantize_lm_head), 0, 1, "false", NULL,
     "with --quantization fp8, the output projection in FP8 too (lm_head; for a tied model the shared embedding "
     "table): faster decode with a large vocabulary, at an accuracy cost the recipe avoids; CPU backend only", 0},
    {"host", RS_CONFIG_TYPE_STRING, F(host), 1, 255, "127.0.0.1", NULL,
     "address to listen on (0.0.0.0 or :: for every interface)", 0},
    {"port", RS_CONFIG_TYPE_INT, F(port), 0, 65535, "8000", NULL, "TCP port to listen on (0 = any free port)", 0},
    {"device", RS_CONFIG_TYPE_ENUM, F(device), 0, 0, "cpu", "cpu|cuda",
     "backend that runs the model: cpu, or cuda (a build with `make CUDA=1`)", 0},
    {"cuda-device", RS_CONFIG_TYPE_INT, F(cuda_device), 0, 63, "0", NULL, "CUDA device ordinal used with --device cuda",
     0},
    {"numerics", RS_CONFIG_TYPE_ENUM, F(numerics), 0, 0, "auto", "exact|fast|auto",
     "arithmetic of the model's kernels: exact (the reference: bit-identical across backends where roundings "
     "allow), fast (on the GPU: tensor cores with fp32 accumulation, BF16 activations into BF16 GEMMs; on a CPU "
     "with AVX512_BF16: BF16 matmuls on BF16-rounded activations with vdpbf16ps, and attention over a bf16 KV "
     "cache on BF16 q and probabilities, every other op exact; other "
     "CPUs run exact), or auto (fast with --device cuda, exact on the CPU)", 0},
    {"cuda-graphs", RS_CONFIG_TYPE_BOOL, F(cuda_graphs), 0, 1, "true", NULL,
     "with --device cuda: record each decode batch size's step once as a CUDA graph and replay it (false = "
     "launch every kernel of every step)", 0},
    {"threads", RS_CONFIG_TYPE_INT, F(threads), 0, 4096, "0", NULL, "CPU backend threads (0 = all cores)", 0},
    {"cpu-kernels", RS_CONFIG_TYPE_ENUM, F(cpu_kernels), 0, 0, "auto", "auto|avx512|avx2|scalar",
     "CPU backend kernels: auto = the best this CPU runs (RS_CPU_SIMD may cap it); avx2 or scalar "
     "force a lower class (to test or benchmark it on a bigger CPU); logged at start", 0},
    {"kv-cache-mb", RS_CONFIG_TYPE_INT, F(kv_cache_mb), 1, 16777216, "1024", NULL,
     "KV cache budget in MiB", 0},
    {"max-running", RS_CONFIG_TYPE_INT, F(max_running), 1, 65536, "64", NULL,
     "sequences decoded together in one engine step", 0},
    {"max-step-tokens", RS_CONFIG_TYPE_INT, F(max_step_tokens), 1, 1048576, "2048", NULL,
     "tokens per forward step (longer prompts are prefilled in chunks)", 0},
    {"max-context", RS_CONFIG_TYPE_INT, F(max_context), 0, 16777216, "0", NULL,
     "tokens per sequence, prompt + output (0 = the model's max_position_embeddings)", 0},
    {"max-new-tokens", RS_CONFIG_TYPE_INT, F(max_new_tokens), 1, 16777216, "32768", NULL,
     "largest sampling_params.max_new_tokens a request may ask for", 0},
    {"max-n", RS_CONFIG_TYPE_INT, F(max_n), 1, 4096, "64", NULL, "largest sampling_params.n", 0},
    {"max-batch", RS_CONFIG_TYPE_INT, F(max_batch), 1, 1048576, "1024", NULL,
     "most sequences (prompts x n) in one request", 0},
    {"max-body-bytes", RS_CONFIG_TYPE_SIZE, F(max_body_bytes), 1024, 1073741824.0, "16M", NULL,
     "largest request body (413 above it); K/M/G suffixes are powers of 1024", 0},
    {"max-waiting-requests", RS_CONFIG_TYPE_INT, F(max_waiting_requests), 1, 1048576, "1024", NULL,
     "generate requests in flight before new ones get 503 + Retry-After", 0},
    {"http-idle-timeout", RS_CONFIG_TYPE_INT, F(http_idle_timeout), 1, 86400, "30", NULL,
     "seconds a connection may stay silent before it is closed: no request bytes while its headers or body are "
     "read, no response bytes taken by a client that stopped reading, or idle between requests (requests waiting "
     "for the engine are not affected)", 0},
    {"max-connections", RS_CONFIG_TYPE_INT, F(max_connections), 16, 1048576, "2048", NULL,
     "open connections served; above it (and above max-connections-per-ip) a request gets 503 at once, except "
     "GET /health and /metrics, which a reserve of 32 more connections keeps answering", 0},
    {"max-connections-per-ip", RS_CONFIG_TYPE_INT, F(max_connections_per_ip), 1, 1048576, "1536", NULL,
     "open connections served from one client address (trainers hold one per in-flight request: keep it above "
     "max-waiting-requests)", 0},
    {"body-memory-budget", RS_CONFIG_TYPE_SIZE, F(body_memory_budget), 1048576, 1099511627776.0, "1G", NULL,
     "request bodies held in memory at once, all connections together; a body that would exceed it gets 503 "
     "(at least max-body-bytes)", 0},
    {"stream-memory-budget", RS_CONFIG_TYPE_SIZE, F(stream_memory_budget), 1048576, 1099511627776.0, "1G", NULL,
     "streamed bytes generated but not yet sent, all streams together; the stream that would exceed it is cut "
     "and its request aborted", 0},
    {"max-stream-buffer", RS_CONFIG_TYPE_SIZE, F(max_stream_buffer), 65536, 1099511627776.0, "64M", NULL,
     "unsent bytes of one stream before it is cut and its request aborted (a client that reads too slowly: "
     "over half of it left unsent from earlier steps, and the new events past it; at most stream-memory-budget)",
     0},
    {"drain-timeout", RS_CONFIG_TYPE_FLOAT, F(drain_timeout), 0, 86400, "30", NULL,
     "seconds SIGTERM (or SIGHUP, SIGINT) waits for in-flight requests before aborting them; paused generation "
     "is aborted at once", 0},
    {"log-level", RS_CONFIG_TYPE_ENUM, F(log_level), 0, 0, "info", "debug|info|warn|error",
     "least severe log level printed", 0},
    {"max-top-logprobs", RS_CONFIG_TYPE_INT, F(max_top_logprobs), 0, 1024, "20", NULL,
     "largest top_logprobs_num a request may ask for", 0},
    {"prefix-cache", RS_CONFIG_TYPE_BOOL, F(prefix_cache), 0, 1, "true", NULL,
     "share the KV pages of identical prompt prefixes across requests (and of an n-sample group)", 0},
    {"kv-cache-dtype", RS_CONFIG_TYPE_ENUM, F(kv_cache_dtype), 0, 0, "fp8", "fp8|bf16|f32",
     "KV cache page format: fp8 (E4M3 with scales), bf16, or f32", 0},
    {"kv-scale-mode", RS_CONFIG_TYPE_ENUM, F(kv_scale_mode), 0, 0, "calibrate", "calibrate|dynamic|static",
     "fp8 KV scales: per layer and head from a fixed calibration set (redone after weight updates), per token, "
     "or the checkpoint's self_attn.k_scale/v_scale", 0},
    {"kv-calib-margin", RS_CONFIG_TYPE_FLOAT, F(kv_calib_margin), 0.1, 100, "1.2", NULL,
     "calibrated KV scale = statistic x margin / 448", 0},
    {"kv-calib-tokens", RS_CONFIG_TYPE_INT, F(kv_calib_tokens), 16, 65536, "256", NULL,
     "tokens in the fixed KV calibration set, run at start and after every weight update", 0},
    {"kv-calib-percentile", RS_CONFIG_TYPE_FLOAT, F(kv_calib_percentile), 0.5, 1, "1", NULL,
     "statistic of |K|, |V| per layer and head that calibration uses (1 = max)", 0},
    {"admission-new-token-ratio", RS_CONFIG_TYPE_FLOAT, F(admission_new_token_ratio), 0, 1, "0.4", NULL,
     "share of each running sequence's remaining max_new_tokens that admission keeps pages for", 0},
    {"weight-version", RS_CONFIG_TYPE_STRING, F(weight_version), 1, 63, "0", NULL,
     "weight_version reported for the weights loaded at start", 0},
    {"weight-staging-mb", RS_CONFIG_TYPE_INT, F(weight_staging_mb), 0, 16777216, "0", NULL,
     "memory a weight update may stage (converted tensors, until commit) in MiB; 0 = the model's own size", 0},
    {"weight-staging-keep", RS_CONFIG_TYPE_BOOL, F(weight_staging_keep), 0, 1, "true", NULL,
     "keep the memory of replaced weights for the next update's staging (no page faults on the next push; "
     "memory stays at the update peak); false = free it after each commit", 0},
    {"weight-shm-keep", RS_CONFIG_TYPE_BOOL, F(weight_shm_keep), 0, 1, "true", NULL,
     "keep shared-memory segments mapped between weight updates while the trainer keeps them (reused bucket "
     "segments cost no mmap; a segment is let go within a second of being unlinked)", 0},
    {"allowed-weight-dir", RS_CONFIG_TYPE_STRING, F(allowed_weight_dir), 0, 4095, "", NULL,
     "/update_weights_from_disk reads checkpoints only below this directory; empty = the route is disabled", 0},
    {"weight-sync-threads", RS_CONFIG_TYPE_INT, F(weight_sync_threads), 0, 1024, "0", NULL,
     "threads that quantize pushed weights; 0 = every online CPU (a push usually lands between rollout steps, "
     "while generation is idle; set fewer to leave cores to generation when updates overlap it)", 0},
    {"weight-update-timeout", RS_CONFIG_TYPE_FLOAT, F(weight_update_timeout), 0, 86400, "300", NULL,
     "seconds a streamed weight update may wait for its next bucket before it is dropped (0 = forever); also "
     "the most joining an NCCL weight-update group may take (the trainer's TCPStore, its unique id, the "
     "communicator; 300 when 0)", 0},
    {"api-key", RS_CONFIG_TYPE_STRING, F(api_key), 0, 255, "", NULL,
     "if set, every route but /health and /metrics needs 'Authorization: Bearer <key>'", RS_CONFIG_SECRET},
    {"served-model-name", RS_CONFIG_TYPE_STRING, F(served_model_name), 0, 255, "", NULL,
     "model name of /v1/completions and /v1/models (a request naming another model gets 404); "
     "empty = the --model value, or 'default' for the embedded model", 0},
    {"incremental-streaming-output", RS_CONFIG_TYPE_BOOL, F(incremental_streaming_output), 0, 1, "false", NULL,
     "streamed /generate events carry only the tokens new since the previous event (SGLang's flag); "
     "false = cumulative events, SGLang's default", 0},
    {"health-generate-timeout", RS_CONFIG_TYPE_FLOAT, F(health_generate_timeout), 0.1, 3600, "20", NULL,
     "seconds /health_generate waits for its one-token probe before answering 503", 0},
    {"http-threads", RS_CONFIG_TYPE_INT, F(http_threads), 0, 256, "0", NULL,
     "HTTP worker threads (libmicrohttpd thread pool; 0 = one per core)", 0},
};

#undef F

const rs_config_entry *rs_config_entries(size_t *n) {
    *n = RS_ARRAY_LEN(entries);
    return entries;
}

/* Compares a user-written name with a table name, '_' matching '-'. */
static bool name_eq(const char *user, size_t user_len, const char *name) {
    size_t i = 0;
    for (; i < user_len && name[i]; i++) {
        char u = user[i] == '_' ? '-' : user[i];
        if (u != name[i]) return false;
    }
    return i == user_len && name[i] == '\0';
}

static const rs_config_entry *find_n(const char *name, size_t len) {
    for (size_t i = 0; i < RS_ARRAY_LEN(entries); i++)
        if (name_eq(name, len, entries[i].name)) return &entries[i];
    return NULL;
}

const rs_config_entry *rs_config_find(const char *name) { return find_n(name, strlen(name)); }

/* ---------------------------------------------------------------- values */

static int parse_int(const rs_config_entry *e, const char *v, long long *out, rs_error *err) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end != '\0')
        return rs_error_set(err, RS_EINVAL, e->name, "invalid value for %s: '%s' is not an integer", e->name, v);
    if (errno == ERANGE || (double)x < e->min || (double)x > e->max)
        return rs_error_set(err, RS_EINVAL, e->name, "%s must be in [%.0f, %.0f], got %s", e->name, e->min,
                            e->max, v);
    *out = x;
    return RS_OK;
}

static int parse_size(const rs_config_entry *e, const char *v, unsigned long long *out, rs_error *err) {
    static const struct { const char *suffix; unsigned shift; } units[] = {
        {"", 0}, {"b", 0}, {"k", 10}, {"kb", 10}, {"kib", 10}, {"m", 20}, {"mb", 20}, {"mib", 20},
        {"g", 30}, {"gb", 30}, {"gib", 30},
    };
    char *end;
    errno = 0;
    if (!isdigit((unsigned char)v[0])) goto bad;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno == ERANGE) goto range;
    for (size_t i = 0; i < RS_ARRAY_LEN(units); i++) {
        if (strcasecmp(end, units[i].suffix) != 0) continue;
        if (x > (ULLONG_MAX >> units[i].shift)) goto range;
        x <<= units[i].shift;
        if ((double)x < e->min || (double)x > e->max) goto range;
        *out = x;
        return RS_OK;
    }
bad:
    return rs_error_set(err, RS_EINVAL, e->name,
                        "invalid value for %s: '%s' is not a size (bytes, or a number with K, M or G)", e->name, v);
range:
    return rs_error_set(err, RS_EINVAL, e->name, "%s must be in [%.0f, %.0f] bytes, got %s", e->name, e->min,
                        e->max, v);
}

static int parse_float(const rs_config_entry *e, const char *v, double *out, rs_error *err) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end != '\0' || !isfinite(x))
        return rs_error_set(err, RS_EINVAL, e->name, "invalid value for %s: '%s' is not a number", e->name, v);
    if (x < e->min || x > e->max)
        return rs_error_set(err, RS_EINVAL, e->name, "%s must be in [%g, %g], got %s", e->name, e->min, e->max, v);
    *out = x;
    return RS_OK;
}

static int parse_bool(const rs_config_entry *e, const char *v, bool *out, rs_error *err) {
    static const char *yes[] = {"true", "1", "yes", "on"}, *no[] = {"false", "0", "no", "off"};
    for (size_t i = 0; i < RS_ARRAY_LEN(yes); i++) {
        if (strcasecmp(v, yes[i]) == 0) return *out = true, RS_OK;
        if (strcasecmp(v, no[i]) == 0) return *out = false, RS_OK;
    }
    return rs_error_set(err, RS_EINVAL, e->name, "invalid value for %s: '%s' is not true or false", e->name, v);
}

/* The index of v among choices "a|b|c", or -1. */
static int choice_index(const char *choices, const char *v) {
    size_t n = strlen(v);
    int i = 0;
    for (const char *p = choices; *p; i++) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, v, n) == 0) return i;
        p += len + (bar ? 1 : 0);
    }
    return -1;
}

/* The name of choice i into buf ("?" when there is none). */
static void choice_name(const char *choices, int i, char *buf, size_t n) {
    const char *p = choices;
    for (int k = 0; k < i && p; k++) {
        p = strchr(p, '|');
        if (p) p++;
    }
    if (!p || i < 0) {
        snprintf(buf, n, "?");
        return;
    }
    const char *bar = strchr(p, '|');
    snprintf(buf, n, "%.*s", (int)(bar ? (size_t)(bar - p) : strlen(p)), p);
}

static int set_entry(rs_config *c, const rs_config_entry *e, const char *v, rs_error *err) {
    char *field = (char *)c + e->offset;
    int rc;
    switch (e->type) {
    case RS_CONFIG_TYPE_INT: {
        long long x = 0;
        if ((rc = parse_int(e, v, &x, err)) != RS_OK) return rc;
        *(int *)field = (int)x;
        return RS_OK;
    }
    case RS_CONFIG_TYPE_SIZE: {
        unsigned long long x = 0;
        if ((rc = parse_size(e, v, &x, err)) != RS_OK) return rc;
        *(size_t *)field = (size_t)x;
        return RS_OK;
    }
    case RS_CONFIG_TYPE_FLOAT:
        return parse_float(e, v, (double *)field, err);
    case RS_CONFIG_TYPE_BOOL:
        return parse_bool(e, v, (bool *)field, err);
    case RS_CONFIG_TYPE_STRING: {
        size_t len = strlen(v);
        if ((double)len < e->min || (double)len > e->max || len >= e->size)
            return rs_error_set(err, RS_EINVAL, e->name, "%s must be %.0f to %.0f characters long, got %zu",
                                e->name, e->min, e->max, len);
        memcpy(field, v, len + 1);
        return RS_OK;
    }
    case RS_CONFIG_TYPE_ENUM: {
        RS_ASSERT(e->size == sizeof(int) && e->choices);
        int i = choice_index(e->choices, v);
        if (i < 0) return rs_error_set(err, RS_EINVAL, e->name, "%s must be one of %s, got '%s'", e->name, e->choices, v);
        *(int *)field = i;
        return RS_OK;
    }
    }
    return rs_error_set(err, RS_EINTERNAL, e->name, "setting %s has an unknown type", e->name);
}

void rs_config_default(rs_config *c) {
    memset(c, 0, sizeof *c);
    for (size_t i = 0; i < RS_ARRAY_LEN(entries); i++) {
        if ((entries[i].type == RS_CONFIG_TYPE_ENUM) != (entries[i].choices != NULL))
            RS_ERROR("config table: %s: a setting with choices is RS_CONFIG_TYPE_ENUM, over an enum field of "
                     "config.h, and only it has choices", entries[i].name);
        RS_ASSERT((entries[i].type == RS_CONFIG_TYPE_ENUM) == (entries[i].choices != NULL));
        rs_error err;
        int rc = set_entry(c, &entries[i], entries[i].def, &err);
        if (rc != RS_OK) RS_ERROR("config table: default of %s: %s", entries[i].name, err.message);
        RS_ASSERT(rc == RS_OK);
    }
}

int rs_config_set(rs_config *c, const char *name, const char *value, rs_error *err) {
    const rs_config_entry *e = rs_config_find(name);
    if (!e) return rs_error_set(err, RS_EINVAL, name, "unknown setting '%s' (see --help)", name);
    return set_entry(c, e, value, err);
}

/* ---------------------------------------------------------------- file */

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1])) *--end = '\0';
    return s;
}

/* Cuts a comment off a value: a `#` at its start or after a space or tab, outside quotes. A quoted
 * value ends at its closing quote, and only a comment may follow it. False for text after a
 * closing quote or an unterminated quote. */
static bool strip_comment(char *val) {
    if (val[0] == '"') {
        char *q = strchr(val + 1, '"');
        if (!q) return false;
        char *rest = q + 1;
        while (*rest == ' ' || *rest == '\t') rest++;
        if (*rest != '\0' && *rest != '#') return false;
        q[1] = '\0';
        return true;
    }
    for (char *p = val; *p; p++)
        if (*p == '#' && (p == val || p[-1] == ' ' || p[-1] == '\t')) {
            *p = '\0';
            break;
        }
    return true;
}

int rs_config_load_file(rs_config *c, const char *path, rs_error *err) {
    FILE *f = fopen(path, "r");
    if (!f) return rs_error_set(err, RS_EIO, "config", "cannot open config file %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || S_ISDIR(st.st_mode)) { /* a pipe or <(...) is fine */
        fclose(f);
        return rs_error_set(err, RS_EINVAL, "config", "config file %s is a directory", path);
    }
    char line[8192];
    int lineno = 0, rc = RS_OK;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n' && !feof(f)) {
            rc = rs_error_set(err, RS_EINVAL, "config", "%s:%d: line too long", path, lineno);
            break;
        }
        char *s = trim(line);
        if (*s == '\0' || *s == '#') continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            rc = rs_error_set(err, RS_EINVAL, "config", "%s:%d: expected 'name = value', got '%s'", path, lineno, s);
            break;
        }
        *eq = '\0';
        char *key = trim(s), *val = trim(eq + 1);
        if (!strip_comment(val)) {
            rc = rs_error_set(err, RS_EINVAL, key, "%s:%d: '%s': a quoted value must end with its quote (only a "
                              "comment may follow)", path, lineno, key);
            break;
        }
        val = trim(val);
        size_t vlen = strlen(val);
        if (vlen >= 2 && val[0] == '"' && val[vlen - 1] == '"') { /* "quoted" keeps inner spaces */
            val[vlen - 1] = '\0';
            val++;
        }
        const rs_config_entry *e = rs_config_find(key);
        if (!e) {
            rc = rs_error_set(err, RS_EINVAL, key, "%s:%d: unknown setting '%s'", path, lineno, key);
            break;
        }
        rs_error e2;
        if (set_entry(c, e, val, &e2) != RS_OK) {
            rc = rs_error_set(err, e2.code, e->name, "%s:%d: %s", path, lineno, e2.message);
            break;
        }
    }
    if (rc == RS_OK && ferror(f))
        rc = rs_error_set(err, RS_EIO, "config", "cannot read config file %s: %s", path, strerror(errno));
    fclose(f);
    return rc;
}

/* ---------------------------------------------------------------- command line */

int rs_config_parse_args(rs_config *c, int argc, char **argv, bool *help, rs_error *err) {
    *help = false;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) return *help = true, RS_OK;

    /* Two passes: --config files first, then every other flag over them. */
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 1; i < argc; i++) {
            const char *arg = argv[i];
            if (strncmp(arg, "--", 2) != 0 || arg[2] == '\0')
                return rs_error_set(err, RS_EINVAL, arg, "unexpected argument '%s' (flags are --name value)", arg);
            const char *name = arg + 2, *eq = strchr(name, '='), *value;
            size_t name_len = eq ? (size_t)(eq - name) : strlen(name);
            if (eq) {
                value = eq + 1;
            } else {
                if (i + 1 >= argc) return rs_error_set(err, RS_EINVAL, name, "--%s needs a value", name);
                value = argv[++i];
            }
            bool is_config = name_eq(name, name_len, "config");
            if (pass == 0) {
                if (is_config) {
                    int rc = rs_config_load_file(c, value, err);
                    if (rc != RS_OK) return rc;
                }
                continue;
            }
            if (is_config) continue;
            const rs_config_entry *e = find_n(name, name_len);
            if (!e)
                return rs_error_set(err, RS_EINVAL, name, "unknown flag --%.*s (see --help)", (int)name_len, name);
            int rc = set_entry(c, e, value, err);
            if (rc != RS_OK) return rc;
        }
    }
    return RS_OK;
}

/* ---------------------------------------------------------------- output */

void rs_config_format(const rs_config *c, const rs_config_entry *e, char *buf, size_t n) {
    const char *field = (const char *)c + e->offset;
    switch (e->type) {
    case RS_CONFIG_TYPE_INT: snprintf(buf, n, "%d", *(const int *)field); return;
    case RS_CONFIG_TYPE_SIZE: snprintf(buf, n, "%zu", *(const size_t *)field); return;
    case RS_CONFIG_TYPE_FLOAT: snprintf(buf, n, "%g", *(const double *)field); return;
    case RS_CONFIG_TYPE_BOOL: snprintf(buf, n, "%s", *(const bool *)field ? "true" : "false"); return;
    case RS_CONFIG_TYPE_ENUM: choice_name(e->choices, *(const int *)field, buf, n); return;
    case RS_CONFIG_TYPE_STRING:
        if (e->flags & RS_CONFIG_SECRET) snprintf(buf, n, "%s", *field ? "(set)" : "");
        else snprintf(buf, n, "%s", field);
        return;
    }
    snprintf(buf, n, "?");
}

void rs_config_get(const rs_config *c, const char *name, char *buf, size_t n) {
    const rs_config_entry *e = rs_config_find(name);
    RS_ASSERT(e != NULL);
    rs_config_format(c, e, buf, n);
}

static const char *type_word(const rs_config_entry *e) {
    switch (e->type) {
    case RS_CONFIG_TYPE_INT: return "INT";
    case RS_CONFIG_TYPE_SIZE: return "SIZE";
    case RS_CONFIG_TYPE_FLOAT: return "NUM";
    case RS_CONFIG_TYPE_BOOL: return "BOOL";
    case RS_CONFIG_TYPE_ENUM: return "WORD";
    case RS_CONFIG_TYPE_STRING: return "TEXT";
    }
    return "?";
}

void rs_config_print_help(FILE *f, const char *prog) {
    fprintf(f,
            "usage: %s [--config FILE] [--name value | --name=value]...\n\n"
            "Serves LLM rollouts over HTTP (SGLang /generate). Every setting below is a flag and a\n"
            "key of the --config file ('name = value' lines, # comments); flags override the file.\n\n",
            prog);
    fprintf(f, "  %-30s %s\n", "--config FILE", "read settings from FILE");
    fprintf(f, "  %-30s %s\n", "--help", "print this and exit");
    for (size_t i = 0; i < RS_ARRAY_LEN(entries); i++) {
        const rs_config_entry *e = &entries[i];
        char flag[64], range[96] = "";
        snprintf(flag, sizeof flag, "--%s %s", e->name, type_word(e));
        if (e->type == RS_CONFIG_TYPE_ENUM) snprintf(range, sizeof range, "; one of %s", e->choices);
        else if (e->type == RS_CONFIG_TYPE_FLOAT)
            snprintf(range, sizeof range, "; %g..%g", e->min, e->max);
        else if (e->type == RS_CONFIG_TYPE_INT || e->type == RS_CONFIG_TYPE_SIZE)
            snprintf(range, sizeof range, "; %.0f..%.0f", e->min, e->max);
        fprintf(f, "  %-30s %s\n  %-30s (default: %s%s%s%s)\n", flag, e->doc, "", *e->def ? "" : "\"",
                e->def, *e->def ? "" : "\"", range);
    }
}

void rs_config_log(const rs_config *c) {
    for (size_t i = 0; i < RS_ARRAY_LEN(entries); i++) {
        char v[4200];
        rs_config_format(c, &entries[i], v, sizeof v);
        RS_INFO("config | %-20s = %s", entries[i].name, v);
    }
}

rs_log_level rs_config_log_level(const rs_config *c) {
    switch (c->log_level) {
    case RS_CFG_LOG_DEBUG: return RS_LOG_LEVEL_DEBUG;
    case RS_CFG_LOG_WARN: return RS_LOG_LEVEL_WARN;
    case RS_CFG_LOG_ERROR: return RS_LOG_LEVEL_ERROR;
    case RS_CFG_LOG_INFO: break;
    }
    return RS_LOG_LEVEL_INFO;
}
