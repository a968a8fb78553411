/*
 * quant.c — the weight quantization policy (see quant.h): which matrices become FP8 at load.
 *
 * Everything here is a pure function of names and settings, so the loader, the weight-sync path
 * and the tests ask the same questions and get the same answers. Names are parsed structurally
 * ("model.layers.<int>.<suffix>" against a fixed suffix table), never matched by substring.
 */
#include "quant.h"

#include <ctype.h>
#include <fnmatch.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *rs_quant_mode_name(rs_quant_mode m) { return m == RS_QUANT_FP8 ? "fp8" : "bf16"; }

int rs_quant_mode_parse(const char *s, rs_quant_mode *out) {
    if (strcmp(s, "fp8") == 0) return *out = RS_QUANT_FP8, RS_OK;
    if (strcmp(s, "bf16") == 0) return *out = RS_QUANT_BF16, RS_OK;
    return RS_EINVAL;
}

int rs_quant_policy_init(rs_quant_policy *p, const char *mode, const char *ignore, int bf16_first_layers,
                         int bf16_last_layers, rs_error *err) {
    rs_quant_policy q;
    memset(&q, 0, sizeof q);
    if (rs_quant_mode_parse(mode, &q.mode) != RS_OK)
        return rs_error_set(err, RS_EINVAL, "quantization", "quantization must be fp8 or bf16, got '%.64s'", mode);
    if (strlen(ignore) >= sizeof q.ignore)
        return rs_error_set(err, RS_EINVAL, "quant-ignore", "quant-ignore is %zu bytes, at most %zu", strlen(ignore),
                            sizeof q.ignore - 1);
    memcpy(q.ignore, ignore, strlen(ignore) + 1);
    if (bf16_first_layers < 0)
        return rs_error_set(err, RS_EINVAL, "bf16-first-layers", "bf16-first-layers must be >= 0, got %d",
                            bf16_first_layers);
    if (bf16_last_layers < 0)
        return rs_error_set(err, RS_EINVAL, "bf16-last-layers", "bf16-last-layers must be >= 0, got %d",
                            bf16_last_layers);
    q.bf16_first_layers = bf16_first_layers;
    q.bf16_last_layers = bf16_last_layers;
    *p = q;
    return RS_OK;
}

/* Parses a non-negative decimal integer without sign or leading zeros at *s; advances *s. */
static bool parse_index(const char **s, int *out) {
    const char *p = *s;
    if (!isdigit((unsigned char)*p) || (p[0] == '0' && isdigit((unsigned char)p[1]))) return false;
    long v = 0;
    for (; isdigit((unsigned char)*p); p++) {
        v = v * 10 + (*p - '0');
        if (v > 1000000) return false;
    }
    *out = (int)v;
    *s = p;
    return true;
}

bool rs_quant_eligible(const char *name, int *layer) {
    static const char *layer_suffixes[] = {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight",    "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    };
    static const char *expert_suffixes[] = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"};
    static const char prefix[] = "model.layers.", experts[] = "mlp.experts.";
    if (strncmp(name, prefix, sizeof prefix - 1) != 0) return false;
    const char *p = name + sizeof prefix - 1;
    int l, e;
    if (!parse_index(&p, &l) || *p++ != '.') return false;
    bool ok = false;
    for (size_t i = 0; i < RS_ARRAY_LEN(layer_suffixes) && !ok; i++) ok = strcmp(p, layer_suffixes[i]) == 0;
    if (!ok && strncmp(p, experts, sizeof experts - 1) == 0) {
        p += sizeof experts - 1;
        if (parse_index(&p, &e) && *p++ == '.')
            for (size_t i = 0; i < RS_ARRAY_LEN(expert_suffixes) && !ok; i++) ok = strcmp(p, expert_suffixes[i]) == 0;
    }
    if (ok && layer) *layer = l;
    return ok;
}

/* The module a parameter belongs to: the name without a trailing ".weight" / ".bias". */
static void module_name(const char *tensor_name, char *buf, size_t cap) {
    size_t n = strlen(tensor_name);
    static const char *params[] = {".weight", ".bias"};
    for (size_t i = 0; i < RS_ARRAY_LEN(params); i++) {
        size_t k = strlen(params[i]);
        if (n > k && strcmp(tensor_name + n - k, params[i]) == 0) {
            n -= k;
            break;
        }
    }
    snprintf(buf, cap, "%.*s", (int)RS_MIN(n, cap - 1), tensor_name);
}

/* True when `entry` (len bytes) occurs in `module` starting and ending on '.' boundaries. */
static bool dotted_match(const char *module, const char *entry, size_t len) {
    if (len == 0) return false;
    for (const char *p = module; *p; p++) {
        if (p != module && p[-1] != '.') continue;
        if (strncmp(p, entry, len) == 0 && (p[len] == '\0' || p[len] == '.')) return true;
    }
    return false;
}

/* Compiles "re:PATTERN" anchored at the start, as Python's re.match. RS_OK or RS_EFORMAT. */
static int compile_re(const char *pattern, size_t len, regex_t *re) {
    char buf[1100];
    if (len + 8 > sizeof buf) return RS_EFORMAT;
    snprintf(buf, sizeof buf, "^(%.*s)", (int)len, pattern);
    return regcomp(re, buf, REG_EXTENDED | REG_NOSUB) == 0 ? RS_OK : RS_EFORMAT;
}

int rs_quant_check_list_entry(const char *entry) {
    if (strncmp(entry, "re:", 3) != 0) return *entry ? RS_OK : RS_EFORMAT;
    regex_t re;
    if (compile_re(entry + 3, strlen(entry + 3), &re) != RS_OK) return RS_EFORMAT;
    regfree(&re);
    return RS_OK;
}

bool rs_quant_listed(const char *list, const char *tensor_name) {
    char module[512];
    module_name(tensor_name, module, sizeof module);
    for (const char *p = list; *p;) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        bool hit;
        if (len > 3 && strncmp(p, "re:", 3) == 0) {
            regex_t re;
            hit = compile_re(p + 3, len - 3, &re) == RS_OK;
            if (hit) {
                hit = regexec(&re, module, 0, NULL, 0) == 0 || regexec(&re, tensor_name, 0, NULL, 0) == 0;
                regfree(&re);
            }
        } else {
            hit = dotted_match(module, p, len) || dotted_match(tensor_name, p, len);
        }
        if (hit) return true;
        p += len + (nl ? 1 : 0);
    }
    return false;
}

/* True when one of the comma-separated globs matches the tensor or its module name. */
static bool ignore_matches(const char *globs, const char *tensor_name) {
    char module[512], glob[RS_QUANT_IGNORE_MAX];
    module_name(tensor_name, module, sizeof module);
    for (const char *p = globs; *p;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        const char *b = p, *e = p + len;
        while (b < e && isspace((unsigned char)*b)) b++;
        while (e > b && isspace((unsigned char)e[-1])) e--;
        if (e > b) {
            snprintf(glob, sizeof glob, "%.*s", (int)(e - b), b);
            if (fnmatch(glob, tensor_name, 0) == 0 || fnmatch(glob, module, 0) == 0) return true;
        }
        p += len + (comma ? 1 : 0);
    }
    return false;
}

bool rs_quant_is_head(const rs_model_config *cfg, const char *tensor_name) {
    return strcmp(tensor_name, cfg->tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight") == 0;
}

bool rs_quant_should_quantize(const rs_quant_policy *qp, const rs_model_config *cfg, const char *tensor_name,
                              int layer) {
    if (!qp || qp->mode != RS_QUANT_FP8) return false;
    if (rs_quant_is_head(cfg, tensor_name)) return qp->quantize_lm_head;
    if (!rs_quant_eligible(tensor_name, NULL)) return false;
    if (layer < 0 || layer < qp->bf16_first_layers || layer >= cfg->n_layers - qp->bf16_last_layers) return false;
    if (ignore_matches(qp->ignore, tensor_name)) return false;
    if (cfg->fp8_checkpoint && rs_quant_listed(cfg->fp8_not_converted, tensor_name)) return false;
    return true;
}
