/*
 * config.h — every setting of rolloutd, in one table.
 *
 * The table (config.c) gives each setting its name, type, range, default and a one-line doc, and
 * the offset of its field in rs_config. Everything else is driven from it: command-line flags
 * (`--name value` or `--name=value`), `--config FILE` (`name = value` lines, # comments), `--help`,
 * and the effective-config log line at start-up. Adding a setting is one table row plus one field.
 *
 * Precedence: defaults, then every `--config` file in the order given, then the other flags in the
 * order given (a flag always wins over a file, wherever it appears on the command line). Names use
 * dashes; underscores are accepted as the same name (`max_body_bytes` == `max-body-bytes`).
 */
#ifndef RS_CONFIG_H
#define RS_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "../core/rs.h"

/* The values of the enum settings, in the order of their table row's choices ("fp8|bf16" is
 * RS_CFG_QUANT_FP8, RS_CFG_QUANT_BF16); tests/unit/test_config.c checks the two agree. */
typedef enum rs_cfg_quantization { RS_CFG_QUANT_FP8 = 0, RS_CFG_QUANT_BF16 } rs_cfg_quantization;
typedef enum rs_cfg_device { RS_CFG_DEVICE_CPU = 0, RS_CFG_DEVICE_CUDA } rs_cfg_device;
typedef enum rs_cfg_numerics { RS_CFG_NUMERICS_EXACT = 0, RS_CFG_NUMERICS_FAST, RS_CFG_NUMERICS_AUTO } rs_cfg_numerics;
typedef enum rs_cfg_cpu_kernels {
    RS_CFG_CPU_KERNELS_AUTO = 0, RS_CFG_CPU_KERNELS_AVX512, RS_CFG_CPU_KERNELS_AVX2, RS_CFG_CPU_KERNELS_SCALAR
} rs_cfg_cpu_kernels;
typedef enum rs_cfg_log_level {
    RS_CFG_LOG_DEBUG = 0, RS_CFG_LOG_INFO, RS_CFG_LOG_WARN, RS_CFG_LOG_ERROR
} rs_cfg_log_level;
typedef enum rs_cfg_kv_dtype { RS_CFG_KV_FP8 = 0, RS_CFG_KV_BF16, RS_CFG_KV_F32 } rs_cfg_kv_dtype;
typedef enum rs_cfg_kv_scales {
    RS_CFG_KV_SCALES_CALIBRATE = 0, RS_CFG_KV_SCALES_DYNAMIC, RS_CFG_KV_SCALES_STATIC
} rs_cfg_kv_scales;

typedef struct rs_config {
    char model[4096];           /* model directory; empty = the embedded default model */
    rs_cfg_quantization quantization; /* precision of attention and MLP matrices */
    char quant_ignore[1024];    /* comma-separated globs of tensors kept as stored */
    int bf16_first_layers;      /* first N decoder layers kept as stored */
    int bf16_last_layers;       /* last N decoder layers kept as stored */
    bool quantize_lm_head;      /* fp8: the output projection (tied: the embedding table) in FP8 too */
    char host[256];             /* bind address */
    int port;                   /* 0 = any free port */
    rs_cfg_device device;       /* the backend that runs the model */
    int cuda_device;            /* CUDA device ordinal with --device cuda */
    rs_cfg_numerics numerics;   /* the backend's arithmetic (kernels/backend.h rs_numerics) */
    bool cuda_graphs;           /* record and replay decode steps as CUDA graphs (--device cuda) */
    int threads;                /* CPU backend threads; 0 = all cores */
    rs_cfg_cpu_kernels cpu_kernels; /* the CPU backend's kernel class */
    int kv_cache_mb;            /* KV pool budget in MiB */
    int max_running;            /* sequences per engine step */
    int max_step_tokens;        /* rows per forward step */
    int max_context;            /* tokens per sequence; 0 = the model's max_position_embeddings */
    int max_new_tokens;         /* cap on sampling_params.max_new_tokens */
    int max_n;                  /* cap on sampling_params.n */
    int max_batch;              /* cap on prompts x n per request */
    size_t max_body_bytes;      /* request body limit (413 above it) */
    int max_waiting_requests;   /* generate requests in flight before 503 */
    int http_idle_timeout;      /* seconds a silent connection stays open */
    int max_connections;        /* connections served before 503 (a reserve still answers /health, /metrics) */
    int max_connections_per_ip; /* the same, per client address */
    size_t body_memory_budget;  /* request bodies in memory, all connections */
    size_t stream_memory_budget; /* unsent streamed bytes, all streams */
    size_t max_stream_buffer;   /* unsent bytes of one stream */
    double drain_timeout;       /* seconds to wait for in-flight requests on SIGTERM */
    rs_cfg_log_level log_level;
    char api_key[256];          /* empty = no auth */
    char weight_version[64];            /* version reported for the weights loaded at start */
    int max_top_logprobs;       /* cap on top_logprobs_num */
    bool prefix_cache;
    rs_cfg_kv_dtype kv_cache_dtype;
    rs_cfg_kv_scales kv_scale_mode;
    double kv_calib_margin, kv_calib_percentile;
    int kv_calib_tokens;
    double admission_new_token_ratio;    /* share of remaining max_new_tokens admission reserves pages for */
    char served_model_name[256];         /* /v1 "model"; empty = the --model value, or "default" */
    bool incremental_streaming_output;   /* /generate SSE events carry only new tokens */
    double health_generate_timeout;      /* seconds /health_generate waits for its probe */
    int http_threads;                    /* libmicrohttpd worker threads; 0 = one per core */
    int weight_staging_mb;               /* weight-update staging limit in MiB; 0 = the model's own size */
    bool weight_shm_keep;                /* keep update segments mapped between requests (sync/shm.h) */
    bool weight_staging_keep;            /* recycle replaced weights' memory as the next update's staging */
    char allowed_weight_dir[4096];       /* /update_weights_from_disk reads only below this; empty = off */
    int weight_sync_threads;             /* quantization threads of the sync service; 0 = all CPUs */
    double weight_update_timeout;        /* seconds an open streamed update may wait for its next bucket */
} rs_config;

typedef enum rs_config_type {
    RS_CONFIG_TYPE_INT = 0,     /* int field; decimal */
    RS_CONFIG_TYPE_SIZE,        /* size_t field; bytes, with an optional K/M/G (binary) suffix */
    RS_CONFIG_TYPE_FLOAT,       /* double field */
    RS_CONFIG_TYPE_STRING,      /* char[size] field; min/max bound its length */
    RS_CONFIG_TYPE_BOOL,        /* bool field; true/false, 1/0, yes/no, on/off */
    RS_CONFIG_TYPE_ENUM,        /* enum field (int-sized); one of choices, stored as its index */
} rs_config_type;

enum {
    RS_CONFIG_SECRET = 1u << 0, /* never printed: logs and info pages show "(set)" */
};

typedef struct rs_config_entry {
    const char *name;           /* flag and file key, with dashes */
    rs_config_type type;
    size_t offset;              /* of the field in rs_config */
    size_t size;                /* of the field (the buffer size for strings) */
    double min, max;            /* inclusive range (string: length range) */
    const char *def;            /* default, as text, parsed like user input */
    const char *choices;        /* enums only: "a|b|c", the names of values 0, 1, 2 */
    const char *doc;
    unsigned flags;
} rs_config_entry;

/* The table, in the order --help prints it. */
const rs_config_entry *rs_config_entries(size_t *n);
const rs_config_entry *rs_config_find(const char *name); /* dashes or underscores; NULL if unknown */

void rs_config_default(rs_config *c);

/* Sets one setting from text. On a bad value returns RS_EINVAL with param = the setting's name
 * and a message that names it and quotes the value. */
int rs_config_set(rs_config *c, const char *name, const char *value, rs_error *err);

/* Applies a `name = value` file. Errors are prefixed "FILE:LINE: ". */
int rs_config_load_file(rs_config *c, const char *path, rs_error *err);

/* Parses argv (argv[0] is the program name) over the current contents of c. Sets *help when
 * --help or -h was given (nothing else is applied then). */
int rs_config_parse_args(rs_config *c, int argc, char **argv, bool *help, rs_error *err);

/* Formats a setting's current value into buf (secrets as "(set)" or ""). */
void rs_config_format(const rs_config *c, const rs_config_entry *e, char *buf, size_t n);
/* rs_config_format of the setting called `name` (it must exist): an enum's value as its name. */
void rs_config_get(const rs_config *c, const char *name, char *buf, size_t n);

void rs_config_print_help(FILE *f, const char *prog);
void rs_config_log(const rs_config *c); /* one info line per setting */

rs_log_level rs_config_log_level(const rs_config *c);

#endif /* RS_CONFIG_H */
