/*
 * sync.c — the weight-sync service thread, its queue, the open transaction and the metrics (see
 * sync.h).
 *
 * The queue is a FIFO under one mutex; the thread sleeps on a condition variable, with a deadline
 * while a transaction is open so that an abandoned one expires even when no request comes. Only
 * the service thread touches the transaction, the NCCL state and the per-job bookkeeping; the
 * stats are copied out under their own mutex.
 *
 * A job's errors are answered as they are, with one rule on top: once a job has joined the open
 * transaction (rs_sync_txn), any failure drops the transaction, so a corrupt bucket can never
 * leave half an update staged for a later is_last to commit.
 */
#include "sync_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "disk.h"
#include "nccl.h"
#include "shm.h"
#include "../core/latch.h"
#include "../model/weight_store.h"

struct rs_sync {
    rs_engine *e;                       /* borrowed */
    rs_model *m;                        /* borrowed */
    size_t staging_limit;
    char allowed_dir[PATH_MAX];         /* realpath of allowed-weight-dir, or "" */
    double idle_timeout;
    rs_pool *pool;                      /* quantizes staged matrices; service thread only */
    rs_backend *calib;                  /* calibrates KV scales of staged weights before a commit, or NULL */

    pthread_t thread;
    bool started;
    pthread_mutex_t mu;                 /* guards the queue and stop */
    pthread_cond_t cv;
    rs_sync_job *head, *tail;
    int n_queued;                       /* jobs in head..tail */
    bool stop;

    /* service thread only */
    rs_txn *txn;                     /* the open transaction, or NULL */
    char txn_id[RS_WEIGHT_TXN_ID_MAX + 1]; /* its id (random, 16 hex digits) */
    char auto_version[RS_TXN_VERSION_BYTES]; /* committed by an update without is_last, or "" */
    double txn_touched;                 /* rs_now_s() of its last bucket */
    bool joined;                        /* the running job joined txn */
    void *nccl;                         /* sync/nccl.c's state */
    rs_shm_maps *shm_maps;              /* shm.c's kept mappings; NULL = none kept */

    pthread_mutex_t stats_mu;           /* guards stats (read by other threads) */
    rs_sync_stats stats;
};

/* ---------------------------------------------------------------- stats */

static void stats_add(rs_sync *s, void (*fn)(rs_sync_stats *st, const void *arg), const void *arg) {
    pthread_mutex_lock(&s->stats_mu);
    fn(&s->stats, arg);
    pthread_mutex_unlock(&s->stats_mu);
}

static void st_txn_state(rs_sync_stats *st, const void *arg) {
    const rs_sync *s = arg;
    st->txn_open = s->txn != NULL;
    st->staged_bytes = s->txn ? rs_txn_staged_bytes(s->txn) : 0;
}

static void st_shm(rs_sync_stats *st, const void *arg) { st->shm_mapped_bytes = *(const size_t *)arg; }

/* Lets go of kept mappings whose segments were unlinked or resized, and publishes what is left. */
static void sweep_shm(rs_sync *s) {
    if (!s->shm_maps) return;
    rs_shm_maps_sweep(s->shm_maps);
    const size_t b = rs_shm_maps_bytes(s->shm_maps);
    stats_add(s, st_shm, &b);
}

static void st_failed_update(rs_sync_stats *st, const void *arg) {
    (void)arg;
    st->updates_failed++;
}

void rs_sync_get_stats(const rs_sync *s, rs_sync_stats *out) {
    pthread_mutex_t *mu = (pthread_mutex_t *)&s->stats_mu; /* logically const */
    pthread_mutex_lock(mu);
    *out = s->stats;
    pthread_mutex_unlock(mu);
}

/* ---------------------------------------------------------------- the transaction */

/* Drops the open transaction (a failed bucket, an expired one, shutdown). */
static void drop_txn(rs_sync *s, const char *why) {
    if (!s->txn) return;
    RS_WARN("sync | update to version '%s' dropped (%s): %d of %d parameters had been staged; the weights in "
            "service are unchanged", rs_txn_version(s->txn), why, rs_txn_n_staged(s->txn),
            rs_txn_n_required(s->txn));
    rs_txn_abort(s->txn);
    s->txn = NULL;
    stats_add(s, st_failed_update, NULL);
    stats_add(s, st_txn_state, s);
}

static void expire_txn(rs_sync *s) {
    if (s->txn && s->idle_timeout > 0 && rs_now_s() - s->txn_touched >= s->idle_timeout) {
        char why[96];
        snprintf(why, sizeof why, "no bucket for %g s, weight-update-timeout", s->idle_timeout);
        drop_txn(s, why);
    }
}

/* A fresh transaction id: 64 random bits (the kernel's), or the clock's if it has none to give. */
static void new_txn_id(char *out, size_t cap) {
    uint64_t x = 0;
    if (getrandom(&x, sizeof x, GRND_NONBLOCK) != (ssize_t)sizeof x) x = (uint64_t)(rs_now_s() * 1e9) * 0x9e3779b97f4a7c15ull;
    snprintf(out, cap, "%016llx", (unsigned long long)x);
}

int rs_sync_txn_join(rs_sync *s, const char *version, const char *txn_id, rs_txn **out, rs_error *err) {
    if (version && !version[0]) version = NULL;
    if (txn_id && !txn_id[0]) txn_id = NULL;
    if (s->txn) {
        const char *open = rs_txn_version(s->txn);
        if (txn_id && strcmp(txn_id, s->txn_id) != 0)
            return rs_error_set(err, RS_ESTATE, "transaction_id",
                                "transaction_id '%s' is not the open weight update (transaction '%s', version '%s', %d "
                                "of %d parameters staged); the bucket is refused and the open update is unchanged",
                                txn_id, s->txn_id, open[0] ? open : "(unchanged)", rs_txn_n_staged(s->txn),
                                rs_txn_n_required(s->txn));
        if (strcmp(open, version ? version : "") != 0)
            return rs_error_set(err, RS_ESTATE, "weight_version",
                                "a weight update to version '%s' is in progress (transaction '%s', %d of %d parameters "
                                "staged); a bucket %s%s%s does not join it: finish it (is_last) before sending another "
                                "version, or let it expire after weight-update-timeout seconds without buckets",
                                open[0] ? open : "(unchanged)", s->txn_id, rs_txn_n_staged(s->txn),
                                rs_txn_n_required(s->txn), version ? "for version '" : "without a weight_version",
                                version ? version : "", version ? "'" : "");
    } else {
        if (txn_id)
            return rs_error_set(err, RS_ESTATE, "transaction_id",
                                "transaction_id '%s' is not open (it committed, was dropped or expired); send the next "
                                "update's first bucket without a transaction_id", txn_id);
        int rc = rs_txn_begin(&s->txn, s->m, version, s->staging_limit, err);
        if (rc != RS_OK) return rc;
        rs_txn_set_pool(s->txn, s->pool);
        rs_txn_set_calib_backend(s->txn, s->calib);
        new_txn_id(s->txn_id, sizeof s->txn_id);
        RS_INFO("sync | update to version '%s' begins as transaction %s (%d parameters, staging limit %.1f MiB)",
                version ? version : "(unchanged)", s->txn_id, rs_txn_n_required(s->txn),
                (double)(s->staging_limit ? s->staging_limit : s->m->weight_bytes) / (1 << 20));
    }
    s->joined = true;
    s->txn_touched = rs_now_s();
    *out = s->txn;
    return RS_OK;
}

int rs_sync_txn(rs_sync *s, const char *version, rs_txn **out, rs_error *err) {
    return rs_sync_txn_join(s, version, NULL, out, err);
}

typedef struct commit_stats {
    double seconds, paused;
    uint64_t bytes;
} commit_stats;

static void st_commit(rs_sync_stats *st, const void *arg) {
    const commit_stats *c = arg;
    st->updates++;
    rs_histogram_observe(&st->update_seconds, c->seconds);
    rs_histogram_observe(&st->pause_seconds, c->paused);
    st->last_update_seconds = c->seconds;
    st->last_update_bytes = c->bytes;
}

/* The open transaction is the tail of the update committed without is_last (see below). */
static int finish_tail(rs_sync *s, rs_sync_result *res, rs_error *err) {
    rs_txn *u = s->txn;
    s->txn = NULL;
    const bool kv = rs_txn_has_kv_scales(u);
    bool installed = false;
    int rc = rs_txn_commit_extras(u, s->e, &installed, err);
    stats_add(s, st_txn_state, s);
    if (rc != RS_OK) {
        stats_add(s, st_failed_update, NULL);
        return rc;
    }
    snprintf(res->message, sizeof res->message, "the tail of version '%s', committed without is_last: %s",
             s->auto_version,
             !kv         ? "a tied lm_head.weight follows embed_tokens; nothing changes"
             : installed ? "KV scales from this bucket installed"
                         : "the pushed KV scales are unused (only --kv-cache-dtype fp8 --kv-scale-mode static takes "
                           "them)");
    RS_INFO("sync | %s", res->message);
    return RS_OK;
}

int rs_sync_txn_finish(rs_sync *s, rs_weight_last last, bool abort_all, rs_sync_result *res, rs_error *err) {
    RS_ASSERT(s->txn);
    rs_txn *u = s->txn;
    snprintf(res->txn_id, sizeof res->txn_id, "%s", s->txn_id);
    res->n_staged = rs_txn_n_staged(u);
    res->n_required = rs_txn_n_required(u);
    const char *uv = rs_txn_version(u);
    /* Without is_last an update commits once every parameter is in; a bucket of nothing but a
     * tied lm_head or KV scales after it, for the same version, is its tail, not a new update
     * (which could never complete, and would hold off the next version for weight-update-timeout). */
    if (last == RS_WEIGHT_LAST_AUTO && s->e && s->auto_version[0] && rs_txn_only_extras(u) &&
        (!uv[0] || !strcmp(uv, s->auto_version)) && !strcmp(rs_engine_weight_version(s->e), s->auto_version) &&
        rs_txn_kv_scales_whole(u))
        return finish_tail(s, res, err);
    const bool commit = last == RS_WEIGHT_LAST_YES || (last == RS_WEIGHT_LAST_AUTO && rs_txn_complete(u));
    if (!commit) {
        snprintf(res->message, sizeof res->message,
                 "staged; %d of %d parameters of version '%s' received, waiting for more buckets", res->n_staged,
                 res->n_required, rs_txn_version(u)[0] ? rs_txn_version(u) : "(unchanged)");
        stats_add(s, st_txn_state, s);
        return RS_OK;
    }
    s->txn = NULL; /* the commit consumes it, whatever happens */
    commit_stats c = {.bytes = rs_txn_received_bytes(u)};
    const double t_begin = rs_txn_started_at(u);
    const size_t staged = rs_txn_staged_bytes(u);
    const bool kv_pushed = rs_txn_has_kv_scales(u);
    int rc = rs_txn_commit(u, s->e, abort_all, &c.paused, err);
    stats_add(s, st_txn_state, s);
    if (rc != RS_OK) {
        RS_WARN("sync | update dropped at commit: %s", err->message);
        stats_add(s, st_failed_update, NULL);
        return rc;
    }
    c.seconds = rs_now_s() - t_begin;
    stats_add(s, st_commit, &c);
    snprintf(s->auto_version, sizeof s->auto_version, "%s",
             last == RS_WEIGHT_LAST_AUTO && s->e ? rs_engine_weight_version(s->e) : "");
    res->committed = true;
    res->n_staged = res->n_required;
    res->seconds_paused = c.paused;
    snprintf(res->message, sizeof res->message,
             "committed %d parameters (%.1f MiB received, %.1f MiB staged) in %.3f s since the first bucket; "
             "generation held %.3f s%s", res->n_required, (double)c.bytes / (1 << 20), (double)staged / (1 << 20),
             c.seconds, c.paused,
             !kv_pushed ? ""
             : s->e && rs_engine_kv_scales(s->e) == RS_KV_SCALES_STATIC
                 ? "; KV scales from this update"
                 : "; the pushed KV scales are unused (only --kv-cache-dtype fp8 --kv-scale-mode static takes them)");
    RS_INFO("sync | version '%s' in service: %s", rs_engine_weight_version(s->e), res->message);
    return RS_OK;
}

rs_model *rs_sync_model(rs_sync *s) { return s->m; }
rs_engine *rs_sync_engine(rs_sync *s) { return s->e; }
void **rs_sync_nccl_state(rs_sync *s) { return &s->nccl; }
rs_shm_maps *rs_sync_shm_maps(rs_sync *s) { return s->shm_maps; }
const char *rs_sync_allowed_dir(const rs_sync *s) { return s->allowed_dir; }
rs_txn *rs_sync_open_txn(rs_sync *s) { return s->txn; }

/* ---------------------------------------------------------------- jobs */

static int run_version(rs_sync *s, const rs_version_update_req *r, rs_sync_result *res, rs_error *err) {
    if (r->abort_all_requests) rs_engine_abort(s->e, NULL);
    int rc = rs_engine_set_weight_version(s->e, r->new_version, err);
    if (rc != RS_OK) return rc;
    snprintf(res->message, sizeof res->message, "weight_version set to '%s'%s", r->new_version,
             r->abort_all_requests ? "; in-flight requests aborted" : "");
    RS_INFO("sync | %s", res->message);
    return RS_OK;
}

typedef struct job_stats {
    uint64_t bytes;
    int tensors;
    bool failed;
} job_stats;

static void st_job(rs_sync_stats *st, const void *arg) {
    const job_stats *j = arg;
    st->requests++;
    st->requests_failed += j->failed;
    st->bytes += j->bytes;
    st->tensors += (uint64_t)j->tensors;
}

static void run_job(rs_sync *s, rs_sync_job *job) {
    const double t0 = rs_now_s();
    rs_sync_result *res = &job->res;
    memset(res, 0, sizeof *res);
    memset(&job->err, 0, sizeof job->err);
    s->joined = false;
    expire_txn(s);
    int rc = RS_OK, tensors = 0;
    switch (job->kind) {
    case RS_SYNC_SHM:
        rc = rs_shm_update(s, &job->req.shm, res, &job->err);
        tensors = job->req.shm.n_tensors;
        break;
    case RS_SYNC_DISK:
        rc = rs_disk_update(s, &job->req.disk, res, &job->err);
        break;
    case RS_SYNC_VERSION:
        rc = run_version(s, &job->req.version, res, &job->err);
        break;
    case RS_SYNC_NCCL_INIT:
        rc = rs_nccl_init_group(s, &job->req.group, &job->err);
        if (rc == RS_OK)
            snprintf(res->message, sizeof res->message, "joined weight update group '%s' as rank %d of %d",
                     job->req.group.group_name, job->req.group.rank_offset, job->req.group.world_size);
        break;
    case RS_SYNC_NCCL_UPDATE:
        rc = rs_nccl_update(s, &job->req.nccl, res, &job->err);
        tensors = job->req.nccl.n_tensors;
        break;
    case RS_SYNC_NCCL_DESTROY:
        rc = rs_nccl_destroy_group(s, job->req.destroy.group_name, &job->err);
        if (rc == RS_OK)
            snprintf(res->message, sizeof res->message, "left weight update group '%s'",
                     job->req.destroy.group_name);
        break;
    }
    if (rc != RS_OK && job->err.code == RS_OK) /* a transport that forgot to fill err */
        rs_error_set(&job->err, rc, NULL, "weight update failed (%s)", rs_err_name(rc));
    if (rc != RS_OK && s->joined) drop_txn(s, job->err.message);
    s->joined = false;
    job->rc = rc;
    if (s->txn && rc == RS_OK) {
        res->n_staged = rs_txn_n_staged(s->txn);
        res->n_required = rs_txn_n_required(s->txn);
    }
    snprintf(res->weight_version, sizeof res->weight_version, "%s", rs_engine_weight_version(s->e));
    res->seconds = rs_now_s() - t0;
    job_stats js = {.bytes = res->bytes, .tensors = rc == RS_OK ? tensors : 0, .failed = rc != RS_OK};
    stats_add(s, st_job, &js);
    if (job->kind == RS_SYNC_SHM) sweep_shm(s);
    if (rc != RS_OK) RS_INFO("sync | %s | %s", rs_err_type(rc), job->err.message);
}

static void *sync_main(void *arg) {
    rs_sync *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop) {
            /* txn, txn_touched and shm_maps are only written by this thread: safe to read here */
            const bool kept = s->shm_maps && rs_shm_maps_bytes(s->shm_maps) > 0;
            const bool expires = s->txn && s->idle_timeout > 0;
            if (!kept && !expires) {
                pthread_cond_wait(&s->cv, &s->mu);
                continue;
            }
            const double now = rs_now_s();
            const double expiry = expires ? s->txn_touched + s->idle_timeout + 0.01 : INFINITY; /* CLOCK_MONOTONIC */
            if (now >= expiry) {
                pthread_mutex_unlock(&s->mu);
                expire_txn(s);
                pthread_mutex_lock(&s->mu);
                continue;
            }
            /* kept mappings: look once a second for segments the trainer has unlinked */
            const double deadline = kept ? RS_MIN(expiry, now + 1.0) : expiry;
            struct timespec ts = {.tv_sec = (time_t)deadline};
            ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
            if (kept) {
                pthread_mutex_unlock(&s->mu);
                sweep_shm(s);
                pthread_mutex_lock(&s->mu);
            }
        }
        if (s->stop) break;
        rs_sync_job *job = s->head;
        s->head = job->next;
        if (!s->head) s->tail = NULL;
        s->n_queued--;
        pthread_mutex_unlock(&s->mu);
        run_job(s, job);
        job->on_done(job, job->user); /* the job belongs to its submitter again */
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---------------------------------------------------------------- lifecycle */

int rs_sync_start(rs_sync **out, rs_engine *e, rs_model *m, const rs_sync_opts *opts, rs_error *err) {
    rs_sync *s = rs_xcalloc(1, sizeof *s);
    s->e = e;
    s->m = m;
    s->staging_limit = opts->staging_limit;
    rs_weight_store_keep_released(m->store, opts->keep_staging);
    s->idle_timeout = opts->txn_idle_timeout;
    if (opts->allowed_weight_dir && opts->allowed_weight_dir[0]) {
        if (!realpath(opts->allowed_weight_dir, s->allowed_dir)) {
            int rc = rs_error_set(err, RS_EINVAL, "allowed-weight-dir", "allowed-weight-dir '%s' cannot be used: %s",
                                  opts->allowed_weight_dir, strerror(errno));
            free(s);
            return rc;
        }
    }
    if (opts->keep_shm_maps) s->shm_maps = rs_shm_maps_new();
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    /* every core by default: a push usually lands between rollout steps, while generation is idle
     * (measured on two cores, a BF16 push into an FP8 daemon, with the trainer packing on the same
     * cores: 0.45x memcpy with one thread, 0.49x with two) */
    const int threads = opts->threads > 0 ? opts->threads : (int)RS_MAX(1, cpus);
    s->pool = rs_pool_init(threads);
    /* An engine that recalibrates KV scales after every update gets them computed here, before the
     * commit, on a backend of the service's own that reads the staged weights where the model's
     * backend holds them: a CPU backend for host memory, a CUDA backend with a stream of its own on
     * the same GPU for device memory. Generation goes on meanwhile instead of waiting for a prefill. */
    if (rs_engine_kv_scales(e) == RS_KV_SCALES_CALIBRATE) {
        /* the serving backend's kernel class: --cpu-kernels avx2 on an AVX-512 CPU calibrates with
         * the AVX2 kernels it serves with (their roundings differ), as the scales made at load were */
        if (rs_backend_host_memory(m->backend)) s->calib = rs_backend_cpu_init_like(m->backend, threads);
#ifdef RS_CUDA
        else if (rs_backend_cuda_device(m->backend) >= 0)
            s->calib = rs_backend_cuda_init(rs_backend_cuda_device(m->backend));
#endif
        /* the scales are calibrated with the arithmetic that will read them */
        if (s->calib) rs_backend_set_numerics(s->calib, rs_backend_numerics(m->backend));
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->stats_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* the idle deadline is on rs_now_s()'s clock */
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&s->thread, NULL, sync_main, s) != 0) {
        rs_pool_free(s->pool);
        rs_backend_free(s->calib);
        rs_shm_maps_free(s->shm_maps);
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        pthread_mutex_destroy(&s->stats_mu);
        free(s);
        return rs_error_set(err, RS_EINTERNAL, NULL, "cannot start the weight-sync thread");
    }
    s->started = true;
    RS_INFO("sync | weight updates ready: staging limit %s (%s), disk updates %s%s, idle timeout %g s, %d "
            "quantization thread%s%s", s->staging_limit ? "weight-staging-mb" : "the model's size",
            opts->keep_staging ? "kept for reuse between updates" : "freed after each update",
            s->allowed_dir[0] ? "from " : "disabled", s->allowed_dir, s->idle_timeout, rs_pool_threads(s->pool),
            rs_pool_threads(s->pool) == 1 ? "" : "s",
            s->calib ? ", KV scales calibrated before each commit" : "");
    *out = s;
    return RS_OK;
}

void rs_sync_stop(rs_sync *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    rs_sync_job *queued = s->head;
    s->head = s->tail = NULL;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->started) pthread_join(s->thread, NULL);
    while (queued) { /* answered here, on the stopping thread */
        rs_sync_job *next = queued->next;
        memset(&queued->res, 0, sizeof queued->res);
        queued->rc = rs_error_set(&queued->err, RS_EBUSY, NULL, "the server is shutting down");
        queued->on_done(queued, queued->user);
        queued = next;
    }
    drop_txn(s, "server shutting down");
    rs_nccl_release(s);
    rs_shm_maps_free(s->shm_maps);
    rs_backend_free(s->calib);
    rs_pool_free(s->pool);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->stats_mu);
    free(s);
}

int rs_sync_submit(rs_sync *s, rs_sync_job *job, rs_error *err) {
    RS_ASSERT(job->on_done);
    job->next = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->stop) {
        pthread_mutex_unlock(&s->mu);
        return rs_error_set(err, RS_EBUSY, NULL, "the server is shutting down");
    }
    /* A trainer sends one bucket at a time. Each queued job holds its parsed tensor list (a few
     * times its body), so a client that posts without waiting is answered 503 instead of growing
     * the daemon's memory without bound. */
    if (s->n_queued >= RS_SYNC_MAX_QUEUED) {
        pthread_mutex_unlock(&s->mu);
        return rs_error_set(err, RS_EBUSY, NULL,
                            "%d weight requests are already waiting for the weight-sync service; send the next "
                            "one when an earlier one is answered", RS_SYNC_MAX_QUEUED);
    }
    s->n_queued++;
    if (s->tail) s->tail->next = job;
    else s->head = job;
    s->tail = job;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return RS_OK;
}

static void on_waited(rs_sync_job *job, void *user) {
    (void)job;
    rs_latch_arrive(user);
}

int rs_sync_run(rs_sync *s, rs_sync_job *job) {
    rs_latch done;
    rs_latch_init(&done);
    job->on_done = on_waited;
    job->user = &done;
    int rc = rs_sync_submit(s, job, &job->err);
    if (rc == RS_OK) {
        rs_latch_wait(&done, 1);
        rc = job->rc;
    } else {
        job->rc = rc;
    }
    rs_latch_destroy(&done);
    return rc;
}
