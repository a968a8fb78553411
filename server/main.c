/*
 * main.c — rolloutd's lifecycle: settings, model, engine, HTTP, and the libuv loop that ties them
 * together until SIGTERM, SIGINT or SIGHUP.
 *
 * Start-up: parse settings (bad ones exit 1 with a message naming them), start HTTP first in the
 * STARTING state (so that /health answers 503 while the model loads, and a taken port fails fast),
 * create the CPU backend, load the model (or write the embedded default model into a cache
 * directory once and load that), start the engine, then switch HTTP to READY.
 *
 * Shutdown: the first signal drains. /health and new /generate requests answer 503, admitted
 * requests run to completion for up to drain-timeout seconds; then anything left is aborted (its
 * client gets the partial output with finish_reason abort), MHD stops, the engine stops, and
 * everything is freed; exit status 0. A second signal stops waiting. While generation is paused
 * (/pause_generation) nothing in flight can finish, so then the requests are aborted at once
 * rather than after the drain timeout, whether the pause came before the signal or during the
 * drain.
 *
 * A signal that comes before the model is served (while it loads) exits at once, status 0:
 * nothing is in flight, and the loop that drains does not run until loading ends.
 *
 * SIGHUP drains and exits exactly as SIGTERM does. rolloutd has no configuration to reload, and a
 * hangup (the terminal or SSH session that started it went away) is a request to end: drained,
 * in-flight requests keep their answers, rather than the default action of dying on the spot.
 */
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "../config/config.h"
#include "../core/rs.h"
#include "../kernels/backend.h"
#include "../model/model.h"
#include "../model/presets.h"
#include "../model/quant.h"
#include "../scheduler/engine.h"
#include "../sync/nccl.h"
#include "../sync/sync.h"
#include "../tokenizer/tokenizer.h"
#include "http.h"
#include "setup.h"
#include "weights_routes.h"

#define RS_ABORT_GRACE_S 5.0 /* after aborting on drain timeout: time to send the abort answers */

typedef enum rs_phase {
    RS_PHASE_SERVING = 0,
    RS_PHASE_DRAINING,          /* waiting for in-flight requests */
    RS_PHASE_ABORTING,          /* engine stopped; waiting for the abort answers to be sent */
} rs_phase;

typedef struct rs_daemon {
    rs_config cfg;
    uv_loop_t loop;
    uv_signal_t sig_int, sig_term, sig_hup;
    uv_timer_t drain_timer;
    rs_http *http;
    rs_backend *backend;
    rs_model *model;
    rs_tok *tok;                /* the model directory's tokenizer.json; NULL: token ids only */
    rs_engine *engine;
    rs_sync *sync;              /* weight updates; started after the engine, stopped before it */
    bool engine_stopped;
    char model_dir[4096];       /* the directory loaded */
    char served_model_name[256];
    rs_phase phase;
    double deadline;
} rs_daemon;

/* ---------------------------------------------------------------- the default model */

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* A name for the preset's exact contents and its tokenizer, so a changed preset never reuses a
 * stale cache. */
static uint64_t preset_hash(const rs_model_config *c, uint64_t seed) {
    char buf[1024];
    int n = snprintf(buf, sizeof buf,
                     "v1 arch=%d vocab=%d hidden=%d inter=%d layers=%d heads=%d kv=%d hd=%d maxpos=%d eps=%.9g "
                     "theta=%.17g scaling=%d/%.9g/%.9g/%.9g/%d tie=%d qkn=%d qkvb=%d experts=%d/%d/%d/%d/%d "
                     "bos=%d seed=%llu eos=",
                     (int)c->arch, c->vocab_size, c->hidden, c->intermediate, c->n_layers, c->n_heads, c->n_kv_heads,
                     c->head_dim, c->max_position, (double)c->rms_eps, c->rope_theta, (int)c->rope_scaling,
                     c->rope_factor, c->rope_low_freq_factor, c->rope_high_freq_factor,
                     c->rope_original_max_position, c->tie_embeddings, c->qk_norm, c->qkv_bias, c->n_experts,
                     c->n_experts_per_tok, c->moe_intermediate, c->norm_topk_prob, c->decoder_sparse_step,
                     c->bos_token_id, (unsigned long long)seed);
    for (int i = 0; i < c->n_eos && n > 0 && (size_t)n < sizeof buf; i++)
        n += snprintf(buf + n, sizeof buf - (size_t)n, "%d,", c->eos_token_ids[i]);
    size_t tok_len;
    return fnv1a(buf) ^ fnv1a(rs_tok_default_json(&tok_len)); /* the tokenizer written beside it */
}

static int mkdir_p(const char *path, rs_error *err) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(tmp, 0700) != 0 && errno != EEXIST)
            return rs_error_set(err, RS_EIO, "model", "cannot create %s: %s", tmp, strerror(errno));
        *p = '/';
    }
    if (mkdir(tmp, 0700) != 0 && errno != EEXIST)
        return rs_error_set(err, RS_EIO, "model", "cannot create %s: %s", tmp, strerror(errno));
    return RS_OK;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    if (remove(path) != 0) RS_WARN("cannot remove %s: %s", path, strerror(errno));
    return 0;
}

static void rm_rf(const char *path) { nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* Where cached models live: $XDG_CACHE_HOME/rolloutd, else $HOME/.cache/rolloutd, else a
 * per-user directory under /tmp that must belong to us. */
static int cache_dir(char *out, size_t n, rs_error *err) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (xdg && xdg[0] == '/') snprintf(out, n, "%s/rolloutd", xdg);
    else if (home && home[0] == '/') snprintf(out, n, "%s/.cache/rolloutd", home);
    else snprintf(out, n, "/tmp/rolloutd-%u", (unsigned)getuid());
    int rc = mkdir_p(out, err);
    if (rc != RS_OK) return rc;
    struct stat st;
    if (stat(out, &st) != 0 || st.st_uid != getuid())
        return rs_error_set(err, RS_EIO, "model", "cache directory %s is not owned by this user", out);
    return RS_OK;
}

/* Writes the embedded default model and its tokenizer.json into the cache (once: concurrent
 * daemons race harmlessly, each writing a private temporary directory and renaming it into place)
 * and returns its path. */
static int default_model_dir(char *out, size_t n, rs_error *err) {
    rs_model_config cfg;
    memset(&cfg, 0, sizeof cfg);
    int rc = rs_model_preset("default", &cfg);
    if (rc != RS_OK) return rs_error_set(err, rc, "model", "the built-in 'default' model preset is missing");
    uint64_t seed = rs_model_preset_seed("default");
    char base[3800];
    if ((rc = cache_dir(base, sizeof base, err)) != RS_OK) return rc;
    uint64_t hash = preset_hash(&cfg, seed);
    snprintf(out, n, "%s/default-%016llx", base, (unsigned long long)hash);
    struct stat st;
    if (stat(out, &st) == 0 && S_ISDIR(st.st_mode)) return RS_OK;

    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s/.default-%016llx.tmp-XXXXXX", base, (unsigned long long)hash);
    if (!mkdtemp(tmp)) return rs_error_set(err, RS_EIO, "model", "cannot create %s: %s", tmp, strerror(errno));
    RS_INFO("model: writing the default model into %s", out);
    rc = rs_testmodel_write(tmp, &cfg, seed, err);
    if (rc == RS_OK) rc = rs_tok_write_default(tmp, err);
    if (rc != RS_OK) {
        rm_rf(tmp);
        return rc;
    }
    if (rename(tmp, out) != 0) {
        int e = errno;
        rm_rf(tmp);
        if (!(stat(out, &st) == 0 && S_ISDIR(st.st_mode))) /* not a lost race: a real failure */
            return rs_error_set(err, RS_EIO, "model", "cannot rename %s to %s: %s", tmp, out, strerror(e));
    }
    return RS_OK;
}

/* ---------------------------------------------------------------- start-up */

/* The model directory's tokenizer.json, when it has one: text prompts, output text, stop strings.
 * A directory without one serves token ids only; a corrupt or unsupported one fails the start
 * (its error names the file and the key). */
static int load_tokenizer(rs_daemon *d, rs_error *err) {
    int rc = rs_tok_load(d->model_dir, &d->tok, err);
    if (rc == RS_ENOTFOUND) {
        RS_INFO("no tokenizer.json in %s: serving token ids only (text fields answer 400)", d->model_dir);
        memset(err, 0, sizeof *err);
        return RS_OK;
    }
    if (rc != RS_OK) return rc;
    int vocab = rs_tok_vocab_size(d->tok);
    if (vocab > d->model->cfg.vocab_size)
        RS_WARN("the tokenizer has %d ids, the model %d: prompts with ids beyond the model's are refused", vocab,
                d->model->cfg.vocab_size);
    RS_INFO("tokenizer: %s (%d ids)", rs_tok_path(d->tok), vocab);
    return RS_OK;
}

static int load(rs_daemon *d, rs_error *err) {
    const rs_config *c = &d->cfg;
    if (c->device == RS_CFG_DEVICE_CUDA) {
#ifdef RS_CUDA
        d->backend = rs_backend_cuda_init(c->cuda_device);
        if (!d->backend)
            return rs_error_set(err, RS_EINVAL, "cuda-device", "cannot use CUDA device %d (the log says why)",
                                c->cuda_device);
        rs_backend_cuda_set_graphs(d->backend, c->cuda_graphs);
#else
        return rs_error_set(err, RS_EUNSUPPORTED, "device",
                            "--device cuda needs a CUDA build of rolloutd (make CUDA=1); this one is CPU-only");
#endif
    } else {
        char kernels[16];
        rs_config_get(c, "cpu-kernels", kernels, sizeof kernels);
        d->backend = rs_backend_cpu_init_kernels(c->threads, kernels, err);
        if (!d->backend) return err->code;
    }
    /* auto: the device's tensor cores where there is a device, the CPU's reference arithmetic on the CPU */
    const bool fast = c->numerics == RS_CFG_NUMERICS_FAST || (c->numerics == RS_CFG_NUMERICS_AUTO &&
                                                              c->device == RS_CFG_DEVICE_CUDA);
    const rs_numerics want = fast ? RS_NUMERICS_FAST : RS_NUMERICS_EXACT;
    const rs_numerics got = rs_backend_set_numerics(d->backend, want);
    if (got != want)
        RS_INFO("numerics: %s asked; the %s backend has no fast kernels here (the CPU's need AVX512_BF16 at the "
                "avx512 kernel level), so it runs %s", rs_numerics_name(want), rs_backend_name(d->backend),
                rs_numerics_name(got));
    else if (got == RS_NUMERICS_FAST && c->device == RS_CFG_DEVICE_CPU)
        RS_INFO("numerics: fast: BF16 matmuls round their activations to BF16 and sum in fp32 (on AMX tiles where "
                "the cpu line says so, else vdpbf16ps), and so does attention over a bf16 KV cache (q and "
                "probabilities, vdpbf16ps); with AMX tiles the FP8 GEMMs take their block sums in fp32 too; every "
                "other op is exact");
    /* /get_server_info reports the arithmetic in effect */
    d->cfg.numerics = got == RS_NUMERICS_FAST ? RS_CFG_NUMERICS_FAST : RS_CFG_NUMERICS_EXACT;

    char *dir = d->model_dir;
    int rc;
    if (c->model[0]) snprintf(dir, sizeof d->model_dir, "%s", c->model);
    else if ((rc = default_model_dir(dir, sizeof d->model_dir, err)) != RS_OK) return rc;
    rs_quant_policy qp;
    char quant[16];
    rs_config_get(c, "quantization", quant, sizeof quant);
    if ((rc = rs_quant_policy_init(&qp, quant, c->quant_ignore, c->bf16_first_layers, c->bf16_last_layers,
                                   err)) != RS_OK)
        return rc;
    qp.quantize_lm_head = c->quantize_lm_head;
    if (qp.quantize_lm_head && c->device != RS_CFG_DEVICE_CPU)
        return rs_error_set(err, RS_EUNSUPPORTED, "quantize-lm-head", "quantize-lm-head needs --device cpu");
    if ((rc = rs_model_load(dir, d->backend, &qp, &d->model, err)) != RS_OK) return rc;
    const rs_model_config *mc = &d->model->cfg;
    if ((rc = load_tokenizer(d, err)) != RS_OK) return rc;

    rs_engine_opts eo;
    rs_setup_engine_opts(c, mc->max_position, &eo);
    if ((rc = rs_engine_init(&d->engine, d->model, &eo, err)) != RS_OK) return rc;
    if ((rc = rs_engine_start(d->engine)) != RS_OK)
        return rs_error_set(err, rc, NULL, "cannot start the engine thread");
    rs_sync_opts so = {.staging_limit = (size_t)c->weight_staging_mb << 20, .keep_staging = c->weight_staging_keep,
                       .keep_shm_maps = c->weight_shm_keep,
                       .allowed_weight_dir = c->allowed_weight_dir, .txn_idle_timeout = c->weight_update_timeout,
                       .threads = c->weight_sync_threads};
    /* NCCL groups: joining one (the trainer's store, its unique id, the communicator) is bounded by
     * weight-update-timeout too; 0 there means "no expiry" for transactions, not for a join */
    rs_nccl_opts no;
    rs_nccl_get_opts(&no);
    if (c->weight_update_timeout > 0) no.init_timeout_s = c->weight_update_timeout;
    rs_nccl_set_opts(&no);
    if ((rc = rs_sync_start(&d->sync, d->engine, d->model, &so, err)) != RS_OK) return rc;
    return RS_OK;
}

/* ---------------------------------------------------------------- shutdown */

/* Aborts what the engine still runs (each client gets its partial output: on_done resumes it). */
static void stop_engine(rs_daemon *d) {
    if (!d->engine || d->engine_stopped) return;
    if (d->http) rs_http_detach_engine(d->http); /* no control operation may call in from now on */
    rs_weights_routes_detach();
    rs_sync_stop(d->sync); /* finishes the update in progress (it needs the engine), answers the rest */
    d->sync = NULL;
    rs_engine_stop(d->engine);
    d->engine_stopped = true;
}

static void close_all(rs_daemon *d) {
    uv_timer_stop(&d->drain_timer);
    stop_engine(d);
    if (d->http) {
        rs_http_close(d->http);
        d->http = NULL;
    }
    uv_close((uv_handle_t *)&d->drain_timer, NULL);
    uv_close((uv_handle_t *)&d->sig_int, NULL);
    uv_close((uv_handle_t *)&d->sig_term, NULL);
    uv_close((uv_handle_t *)&d->sig_hup, NULL);
}

/* Whether the engine is paused: then nothing in flight finishes until /continue_generation. */
static bool engine_paused(const rs_daemon *d) {
    if (!d->engine || d->engine_stopped) return false;
    rs_engine_stats st;
    rs_engine_get_stats(d->engine, &st);
    return st.paused;
}

static void on_drain_tick(uv_timer_t *t) {
    rs_daemon *d = t->data;
    int n = rs_http_in_flight(d->http);
    double now = rs_now_s();
    const bool paused = n > 0 && d->phase == RS_PHASE_DRAINING && engine_paused(d);
    if (n > 0 && now < d->deadline && !paused) return;
    if (n > 0 && d->phase == RS_PHASE_DRAINING) {
        if (paused)
            RS_WARN("drain: generation is paused; aborting the %d request%s in flight now", n, n == 1 ? "" : "s");
        else
            RS_WARN("drain: %d request%s still running after the drain timeout; aborting them", n, n == 1 ? "" : "s");
        stop_engine(d);
        d->phase = RS_PHASE_ABORTING;
        d->deadline = now + RS_ABORT_GRACE_S;
        return;
    }
    if (n > 0) RS_WARN("drain: closing %d connection%s that did not finish", n, n == 1 ? "" : "s");
    RS_INFO("drain: done; stopping");
    close_all(d);
}

static void on_signal(uv_signal_t *s, int signum) {
    rs_daemon *d = s->data;
    if (d->phase != RS_PHASE_SERVING) {
        RS_WARN("%s again: not waiting any longer", strsignal(signum));
        d->deadline = 0;
        return;
    }
    d->phase = RS_PHASE_DRAINING;
    d->deadline = rs_now_s() + d->cfg.drain_timeout;
    RS_INFO("%s: draining %d in-flight request(s), up to %gs", strsignal(signum), rs_http_in_flight(d->http),
            d->cfg.drain_timeout);
    rs_http_drain(d->http);
    uv_timer_start(&d->drain_timer, on_drain_tick, 0, 50);
}

/* A signal before the model is served: nothing to drain, so exit at once (loading a large
 * checkpoint takes minutes, and the loop that would see a libuv signal does not run until then). */
static void on_signal_starting(int signum) {
    (void)signum;
    static const char msg[] = "rolloutd: signal during start-up: exiting\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
    _exit(0);
}

/* ---------------------------------------------------------------- main */

/* Trainers hold one connection per in-flight request: lift the soft descriptor limit to the hard one. */
static void raise_fd_limit(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max) return;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) RS_WARN("cannot raise the open-file limit: %s", strerror(errno));
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    static rs_daemon daemon; /* large (the config holds paths); static keeps it off the stack */
    rs_daemon *d = &daemon;
    rs_error err = {0};
    bool help = false;

    rs_config_default(&d->cfg);
    if (rs_config_parse_args(&d->cfg, argc, argv, &help, &err) != RS_OK) {
        fprintf(stderr, "rolloutd: %s\n", err.message);
        return 1;
    }
    if (help) {
        rs_config_print_help(stdout, argv[0]);
        return 0;
    }
    rs_log_min_level = rs_config_log_level(&d->cfg);
    RS_INFO("rolloutd starting, pid %d", (int)getpid());
    rs_config_log(&d->cfg);
    raise_fd_limit();

    uv_loop_init(&d->loop);
    uv_timer_init(&d->loop, &d->drain_timer);
    uv_signal_init(&d->loop, &d->sig_int);
    uv_signal_init(&d->loop, &d->sig_term);
    uv_signal_init(&d->loop, &d->sig_hup);
    d->drain_timer.data = d->sig_int.data = d->sig_term.data = d->sig_hup.data = d;
    struct sigaction sa = {.sa_handler = on_signal_starting};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);

    int status = 0;
    rs_http_opts ho = {.host = d->cfg.host, .port = d->cfg.port, .threads = d->cfg.http_threads,
                       .max_body_bytes = d->cfg.max_body_bytes, .max_waiting_requests = d->cfg.max_waiting_requests,
                       .api_key = d->cfg.api_key, .idle_timeout = d->cfg.http_idle_timeout,
                       .max_connections = d->cfg.max_connections,
                       .max_connections_per_ip = d->cfg.max_connections_per_ip,
                       .body_memory_budget = d->cfg.body_memory_budget,
                       .stream_memory_budget = d->cfg.stream_memory_budget,
                       .max_stream_buffer = d->cfg.max_stream_buffer};
    if (rs_http_start(&d->http, &ho, &d->loop, &err) != RS_OK) {
        RS_ERROR("%s", err.message);
        status = 1;
        close_all(d);
        goto out;
    }
    d->cfg.port = rs_http_port(d->http); /* --port 0: the port the system chose, in /get_server_info */
    bool v6 = strchr(d->cfg.host, ':') != NULL;
    RS_INFO("listening on http://%s%s%s:%d", v6 ? "[" : "", d->cfg.host, v6 ? "]" : "", rs_http_port(d->http));
    if (load(d, &err) != RS_OK) {
        RS_ERROR("start-up failed: %s%s%s", err.message, err.param[0] ? " | setting: " : "", err.param);
        status = 1;
        close_all(d);
        goto out;
    }
    const char *served = d->cfg.served_model_name[0] ? d->cfg.served_model_name : d->cfg.model[0] ? d->cfg.model : "default";
    snprintf(d->served_model_name, sizeof d->served_model_name, "%.*s", (int)sizeof d->served_model_name - 1, served);
    rs_http_info info = {.cfg = &d->cfg, .model = d->model, .model_path = d->model_dir,
                         .served_model_name = d->served_model_name, .backend = rs_backend_name(d->backend),
                         .tok = d->tok};
    uv_signal_start(&d->sig_int, on_signal, SIGINT); /* from here on a signal drains */
    uv_signal_start(&d->sig_term, on_signal, SIGTERM);
    uv_signal_start(&d->sig_hup, on_signal, SIGHUP);
    rs_http_set_engine(d->http, d->engine, &info);
    rs_weights_routes_attach(d->sync);
    RS_INFO("ready: model %s (served as %s)", d->model_dir, d->served_model_name);

out:
    uv_run(&d->loop, UV_RUN_DEFAULT);
    rs_engine_free(d->engine);
    rs_tok_free(d->tok);
    if (d->model) rs_model_free(d->model);
    if (d->backend) rs_backend_free(d->backend);
    if (uv_loop_close(&d->loop) != 0) RS_WARN("libuv loop closed with handles still open");
    RS_INFO("stopped");
    return status;
}
