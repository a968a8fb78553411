/*
 * nccl.c — the NCCL weight-update routes: the groups this server has joined, the broadcast plan of
 * a request, and the feeding of received tensors into the update transaction (contract in nccl.h;
 * the CUDA and NCCL calls themselves are in sync/nccl_staging.cu).
 *
 * The request checks and the broadcast plan are pure and built in both builds (tested without a
 * GPU). The CPU build has no NCCL: there the routes answer RS_EUNSUPPORTED and nothing else. The
 * store rendezvous itself is sync/tcpstore.c, built and tested in both.
 */
#include "nccl.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "requests.h"
#include "sync_internal.h"
#include "tcpstore.h"
#include "transaction.h"

static rs_nccl_opts g_opts = {
    .device = 0,
    .init_timeout_s = 300.0,
    .op_timeout_s = 300.0,
    .max_buffer_bytes = (uint64_t)8 << 30,
};

void rs_nccl_opts_default(rs_nccl_opts *o) {
    o->device = 0;
    o->init_timeout_s = 300.0;
    o->op_timeout_s = 300.0;
    o->max_buffer_bytes = (uint64_t)8 << 30;
}

void rs_nccl_set_opts(const rs_nccl_opts *o) {
    rs_nccl_opts d;
    rs_nccl_opts_default(&d);
    g_opts.device = o->device >= 0 ? o->device : d.device;
    g_opts.init_timeout_s = o->init_timeout_s > 0 ? o->init_timeout_s : d.init_timeout_s;
    g_opts.op_timeout_s = o->op_timeout_s > 0 ? o->op_timeout_s : d.op_timeout_s;
    g_opts.max_buffer_bytes = o->max_buffer_bytes > 0 ? o->max_buffer_bytes : d.max_buffer_bytes;
}

void rs_nccl_get_opts(rs_nccl_opts *o) { *o = g_opts; }

/* ---- pure checks ---- */

int rs_nccl_check_group_req(const rs_nccl_group_req *r, rs_error *err) {
    if (strcmp(r->backend, "nccl") != 0)
        return rs_error_set(err, RS_EINVAL, "backend", "backend must be \"nccl\", got \"%.15s\"", r->backend);
    if (r->world_size < 2)
        return rs_error_set(err, RS_EINVAL, "world_size",
                            "world_size must be >= 2 (the trainer and this server), got %d", r->world_size);
    if (r->rank_offset < 1 || r->rank_offset >= r->world_size)
        return rs_error_set(err, RS_EINVAL, "rank_offset",
                            "rank_offset must be in [1, world_size): rank 0 is the trainer, the broadcast root; "
                            "got %d with world_size %d", r->rank_offset, r->world_size);
    size_t n = strnlen(r->group_name, sizeof r->group_name);
    if (n == 0 || n == sizeof r->group_name)
        return rs_error_set(err, RS_EINVAL, "group_name", "group_name must be 1..%d bytes",
                            RS_NCCL_GROUP_NAME_MAX);
    if (!r->has_unique_id) return RS_OK; /* the trainer's TCPStore at master_address:master_port */
    bool zero = true;
    for (int i = 0; i < RS_NCCL_UNIQUE_ID_BYTES; i++) zero = zero && r->unique_id[i] == 0;
    if (zero)
        return rs_error_set(err, RS_EINVAL, "nccl_unique_id_b64",
                            "nccl_unique_id_b64 decodes to 128 zero bytes, not an ncclUniqueId");
    return RS_OK;
}

int rs_nccl_check_update_req(const rs_nccl_update_req *r, uint64_t max_buffer_bytes, rs_error *err) {
    if (r->n_tensors < 1 || !r->tensors)
        return rs_error_set(err, RS_EINVAL, "names", "names must list at least one tensor");
    size_t n = strnlen(r->group_name, sizeof r->group_name);
    if (n == 0 || n == sizeof r->group_name)
        return rs_error_set(err, RS_EINVAL, "group_name", "group_name must be 1..%d bytes",
                            RS_NCCL_GROUP_NAME_MAX);
    uint64_t sum = 0;
    for (int i = 0; i < r->n_tensors; i++) {
        const rs_weight_desc *t = &r->tensors[i];
        char param[32];
        snprintf(param, sizeof param, "names[%d]", i);
        if (t->offset != sum)
            return rs_error_set(err, RS_EINVAL, param, "tensor %s: bucket offset %llu, expected %llu", t->name,
                                (unsigned long long)t->offset, (unsigned long long)sum);
        if (t->nbytes > UINT64_MAX - sum)
            return rs_error_set(err, RS_EINVAL, param, "tensor %s: the request's bytes overflow", t->name);
        if (!r->flattened_bucket && t->nbytes > max_buffer_bytes)
            return rs_error_set(err, RS_EINVAL, param,
                                "tensor %s is %llu bytes, over the NCCL staging limit of %llu bytes per broadcast",
                                t->name, (unsigned long long)t->nbytes, (unsigned long long)max_buffer_bytes);
        sum += t->nbytes;
    }
    if (sum != r->total_bytes)
        return rs_error_set(err, RS_EINVAL, "names", "the tensors add up to %llu bytes, the request says %llu",
                            (unsigned long long)sum, (unsigned long long)r->total_bytes);
    if (r->flattened_bucket && sum > max_buffer_bytes)
        return rs_error_set(err, RS_EINVAL, "names",
                            "the flattened bucket is %llu bytes, over the NCCL staging limit of %llu bytes per "
                            "broadcast: send smaller buckets", (unsigned long long)sum,
                            (unsigned long long)max_buffer_bytes);
    return RS_OK;
}

int rs_nccl_n_buffers(const rs_nccl_update_req *r) { return r->flattened_bucket ? 1 : r->n_tensors; }

void rs_nccl_buffer(const rs_nccl_update_req *r, int i, int *first, int *count, uint64_t *bytes) {
    if (r->flattened_bucket) {
        *first = 0;
        *count = r->n_tensors;
        *bytes = r->total_bytes;
    } else {
        *first = i;
        *count = 1;
        *bytes = r->tensors[i].nbytes;
    }
}

#ifdef RS_CUDA

/* Appends to err->message, keeping it NUL-terminated. */
static __attribute__((format(printf, 2, 3))) void err_append(rs_error *err, const char *fmt, ...) {
    size_t n = strlen(err->message);
    if (n + 1 >= sizeof err->message) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message + n, sizeof err->message - n, fmt, ap);
    va_end(ap);
}

/* ---- groups ---- */

typedef struct nccl_group {
    char name[RS_NCCL_GROUP_NAME_MAX + 1];
    int rank, world_size, device;
    rs_nccl_comm *comm;                 /* owned; of a store group: NULL until its watcher is taken */
    rs_tcpstore *store;                 /* owned: the trainer's TCPStore (SGLang's rendezvous), or NULL */
    uint64_t requests, bytes;           /* update requests and bytes received through the group */
    /* A store group's watcher thread (store_watch): it owns `store` while it runs, and leaves its
     * outcome under `mu` for the sync thread, which joins it (watcher_take). */
    pthread_t watcher;
    bool watching;                      /* started and not yet joined (sync thread only) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool watch_done;                    /* under mu */
    int watch_rc;                       /* under mu: the outcome, with watch_err and watch_comm */
    rs_error watch_err;
    rs_nccl_comm *watch_comm;
    volatile int cancel;                /* set (atomically) to stop the watcher */
} nccl_group;


/* What rs_sync_nccl_state(s) points to (owned here; NULL while no group exists). */
typedef struct nccl_state {
    nccl_group *groups[RS_NCCL_MAX_GROUPS];
} nccl_state;

static nccl_state *state_get(rs_sync *s) { return (nccl_state *)*rs_sync_nccl_state(s); }

static nccl_group *group_find(rs_sync *s, const char *name) {
    nccl_state *st = state_get(s);
    if (!st) return NULL;
    for (int i = 0; i < RS_NCCL_MAX_GROUPS; i++)
        if (st->groups[i] && strcmp(st->groups[i]->name, name) == 0) return st->groups[i];
    return NULL;
}

/* ---- the store watcher ----
 * A store group's communicator is created as soon as the trainer's rank 0 publishes the id, under
 * the key of whichever NCCL backend the trainer runs (tcpstore.h rs_c10d_id_flavor): torch's nccl2
 * (the default from torch 2.15) sets it while its init_process_group creates the group, and waits
 * there in ncclCommInitRank for every rank, so this server must join before the trainer returns
 * from it, with no request of its own to wait in; ProcessGroupNCCL sets it at the first broadcast,
 * after the trainer has posted its first update. A thread per group therefore polls the store from
 * the rendezvous on and joins when either key appears; the first update request waits for it. */

static void *store_watch(void *arg) {
    nccl_group *g = arg;
    rs_error err = {0};
    uint8_t id[RS_C10D_UNIQUE_ID_BYTES];
    rs_c10d_id_flavor flavor = RS_C10D_ID_LEGACY;
    rs_nccl_comm *comm = NULL;
    const double t0 = rs_now_s();
    int rc = rs_c10d_nccl_unique_id_either(g->store, g->name, id, &flavor, INFINITY, g_opts.init_timeout_s,
                                           &g->cancel, &err);
    if (rc == RS_OK) {
        RS_INFO("nccl | group %s | the trainer published its unique id (%s) after %.2f s; joining", g->name,
                rs_c10d_id_flavor_name(flavor), rs_now_s() - t0);
        const double t1 = rs_now_s();
        rc = rs_nccl_comm_init(&comm, id, g->world_size, g->rank, g->device, g_opts.init_timeout_s, &g->cancel, &err);
        if (rc != RS_OK) {
            int v = rs_nccl_version();
            err_append(&err, " (this server's NCCL is %d.%d.%d and the trainer's must be the same release)",
                       v / 10000, v / 100 % 100, v % 100);
        } else {
            RS_INFO("nccl | group %s | joined as rank %d of %d with the unique id from the trainer's store in %.2f s",
                    g->name, g->rank, g->world_size, rs_now_s() - t1);
        }
    }
    if (rc != RS_OK && !__atomic_load_n(&g->cancel, __ATOMIC_ACQUIRE))
        RS_WARN("nccl | group %s | joining from the trainer's store failed: %s", g->name, err.message);
    pthread_mutex_lock(&g->mu);
    g->watch_done = true;
    g->watch_rc = rc;
    g->watch_err = err;
    g->watch_comm = comm;
    pthread_cond_signal(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

static int watcher_start(nccl_group *g, rs_error *err) {
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    int e = pthread_create(&g->watcher, NULL, store_watch, g);
    if (e != 0) return rs_error_set(err, RS_EINTERNAL, NULL, "cannot start the store watcher: %s", strerror(e));
    g->watching = true;
    return RS_OK;
}

/* Waits for the watcher until `deadline` (then cancels it), joins it, and takes its outcome:
 * g->comm on success. */
static int watcher_take(nccl_group *g, double deadline, rs_error *err) {
    pthread_mutex_lock(&g->mu);
    while (!g->watch_done) {
        double left = deadline - rs_now_s();
        if (left <= 0) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double end = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 + RS_MIN(left, 0.5);
        ts.tv_sec = (time_t)end;
        ts.tv_nsec = (long)((end - (double)ts.tv_sec) * 1e9);
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
    }
    const bool done = g->watch_done;
    pthread_mutex_unlock(&g->mu);
    if (!done) {
        __atomic_store_n(&g->cancel, 1, __ATOMIC_RELEASE);
        rs_tcpstore_interrupt(g->store); /* a store call it waits in returns at once */
    }
    pthread_join(g->watcher, NULL);
    g->watching = false;
    if (!done) {
        if (g->watch_comm) rs_nccl_comm_free(g->watch_comm, true, 0); /* joined as it was cancelled */
        g->watch_comm = NULL;
        char legacy[RS_TCPSTORE_KEY_MAX], nccl2[RS_TCPSTORE_KEY_MAX];
        rs_c10d_nccl_id_key(legacy, sizeof legacy, g->name, RS_C10D_ID_LEGACY);
        rs_c10d_nccl_id_key(nccl2, sizeof nccl2, g->name, RS_C10D_ID_NCCL2);
        return rs_error_set(err, RS_EBUSY, NULL,
                            "timed out after %g s waiting for the trainer to publish its ncclUniqueId in the "
                            "TCPStore at %s, under '/%s' (torch's ProcessGroupNCCL sets it at the first collective "
                            "on the group, dist.broadcast) or '/%s' (torch's nccl2 backend, as the group is created)",
                            g_opts.init_timeout_s, rs_tcpstore_peer(g->store), legacy, nccl2);
    }
    if (g->watch_rc != RS_OK) {
        *err = g->watch_err;
        if (g->world_size > 128 && g->watch_rc == RS_EBUSY)
            err_append(err, "; a group of more than TORCH_NCCL_RANKS_PER_ROOT ranks (128 by default) exchanges several "
                       "ids, which this server does not read");
        return g->watch_rc;
    }
    g->comm = g->watch_comm;
    g->watch_comm = NULL;
    return RS_OK;
}

/* Stops and joins the watcher, if it runs, and frees whatever it joined. */
static void watcher_stop(nccl_group *g) {
    if (!g->watching) return;
    __atomic_store_n(&g->cancel, 1, __ATOMIC_RELEASE);
    rs_tcpstore_interrupt(g->store);
    pthread_join(g->watcher, NULL);
    g->watching = false;
    if (g->watch_comm) rs_nccl_comm_free(g->watch_comm, true, 0);
    g->watch_comm = NULL;
}

/* Takes g out of the state (freeing the state when it was the last group) and frees it, leaving
 * the communicator cleanly, or aborting it. */
static void group_drop(rs_sync *s, nccl_group *g, bool abort) {
    nccl_state *st = state_get(s);
    int left = 0;
    for (int i = 0; st && i < RS_NCCL_MAX_GROUPS; i++) {
        if (st->groups[i] == g) st->groups[i] = NULL;
        left += st->groups[i] != NULL;
    }
    if (st && left == 0) {
        free(st);
        *rs_sync_nccl_state(s) = NULL;
    }
    watcher_stop(g);
    double finalize_s = RS_MIN(g_opts.op_timeout_s, 30.0);
    rs_nccl_comm_free(g->comm, abort, finalize_s);
    rs_tcpstore_close(g->store);
    RS_INFO("nccl | group %s | %s after %llu update requests, %llu bytes", g->name, abort ? "aborted" : "left",
            (unsigned long long)g->requests, (unsigned long long)g->bytes);
    if (g->store) {
        pthread_mutex_destroy(&g->mu);
        pthread_cond_destroy(&g->cv);
    }
    free(g);
}

int rs_nccl_init_group(rs_sync *s, const rs_nccl_group_req *r, rs_error *err) {
    int rc = rs_nccl_check_group_req(r, err);
    if (rc != RS_OK) return rc;
    if (group_find(s, r->group_name))
        return rs_error_set(err, RS_ESTATE, "group_name",
                            "weights update group '%s' already exists: destroy it first", r->group_name);
    nccl_state *st = state_get(s);
    int free_slot = -1;
    for (int i = RS_NCCL_MAX_GROUPS - 1; i >= 0; i--)
        if (!st || !st->groups[i]) free_slot = i;
    if (free_slot < 0)
        return rs_error_set(err, RS_ESTATE, "group_name",
                            "this server is already in %d weights update groups, the most it joins: destroy one",
                            RS_NCCL_MAX_GROUPS);
    int n_dev = rs_nccl_cuda_device_count();
    if (n_dev == 0)
        return rs_error_set(err, RS_EUNSUPPORTED, NULL,
                            "no CUDA device is visible to this server: NCCL weight updates need one");
    if (g_opts.device >= n_dev)
        return rs_error_set(err, RS_EUNSUPPORTED, NULL,
                            "NCCL weight updates are configured for CUDA device %d, but %d are visible",
                            g_opts.device, n_dev);

    int v = rs_nccl_version();
    double t0 = rs_now_s();
    rs_nccl_comm *comm = NULL;
    rs_tcpstore *store = NULL;
    if (r->has_unique_id) {
        RS_INFO("nccl | group %s | joining as rank %d of %d on cuda:%d, NCCL %d.%d.%d, with the trainer's unique id",
                r->group_name, r->rank_offset, r->world_size, g_opts.device, v / 10000, v / 100 % 100, v % 100);
        rc = rs_nccl_comm_init(&comm, r->unique_id, r->world_size, r->rank_offset, g_opts.device,
                               g_opts.init_timeout_s, NULL, err);
        if (rc != RS_OK)
            err_append(err, " (group '%s', rank %d of %d; this server's NCCL is %d.%d.%d and the trainer's must be "
                       "the same release)", r->group_name, r->rank_offset, r->world_size, v / 10000, v / 100 % 100,
                       v % 100);
    } else {
        int64_t joined = 0;
        rc = rs_c10d_join(&store, r->master_address, r->master_port, &joined, t0 + g_opts.init_timeout_s, err);
        if (rc == RS_OK)
            RS_INFO("nccl | group %s | rank %d of %d in the trainer's TCPStore %s (%lld ranks there so far); the "
                    "communicator is created when the trainer publishes its unique id there (nccl2: as it creates "
                    "the group; ProcessGroupNCCL: at its first broadcast)",
                    r->group_name, r->rank_offset, r->world_size, rs_tcpstore_peer(store), (long long)joined);
        else
            err_append(err, " (rendezvous of group '%s' as rank %d of %d, within %g s)", r->group_name,
                       r->rank_offset, r->world_size, g_opts.init_timeout_s);
    }
    if (rc != RS_OK) {
        RS_WARN("nccl | group %s | join failed: %s", r->group_name, err->message);
        return rc;
    }
    if (!st) {
        st = rs_xcalloc(1, sizeof *st);
        *rs_sync_nccl_state(s) = st;
    }
    nccl_group *g = rs_xcalloc(1, sizeof *g);
    snprintf(g->name, sizeof g->name, "%s", r->group_name);
    g->rank = r->rank_offset;
    g->world_size = r->world_size;
    g->device = g_opts.device;
    g->comm = comm;
    g->store = store;
    st->groups[free_slot] = g;
    if (store && (rc = watcher_start(g, err)) != RS_OK) {
        group_drop(s, g, true);
        return rc;
    }
    RS_INFO("nccl | group %s | %s as rank %d of %d in %.2f s", g->name, comm ? "joined" : "rendezvous done",
            g->rank, g->world_size, rs_now_s() - t0);
    return RS_OK;
}

int rs_nccl_destroy_group(rs_sync *s, const char *group_name, rs_error *err) {
    nccl_group *g = group_find(s, group_name);
    if (!g)
        return rs_error_set(err, RS_EINVAL, "group_name", "no weights update group '%s'", group_name);
    group_drop(s, g, false);
    return RS_OK;
}

void rs_nccl_release(rs_sync *s) {
    nccl_state *st = state_get(s);
    if (!st) return;
    for (int i = 0; i < RS_NCCL_MAX_GROUPS; i++) {
        nccl_state *cur = state_get(s); /* group_drop frees the state with the last group */
        if (cur && cur->groups[i]) group_drop(s, cur->groups[i], true);
    }
}

/* Stages the tensors of buffer i (bytes at `base`, which is the buffer's first byte) into u. */
static int stage_buffer(rs_txn *u, const rs_nccl_update_req *r, int i, const uint8_t *base, rs_error *err) {
    static const uint8_t empty[1];
    int first, count;
    uint64_t bytes;
    rs_nccl_buffer(r, i, &first, &count, &bytes);
    uint64_t start = r->tensors[first].offset;
    for (int k = first; k < first + count; k++) {
        const rs_weight_desc *t = &r->tensors[k];
        rs_txn_tensor ut = {
            .name = t->name,
            .dtype = t->dtype,
            .ndim = t->ndim,
            .shape = t->shape,
            .data = t->nbytes ? base + (t->offset - start) : empty,
        };
        int rc = rs_txn_add(u, &ut, err);
        if (rc != RS_OK) {
            if (!err->param[0]) snprintf(err->param, sizeof err->param, "names[%d]", k);
            return rc;
        }
    }
    return RS_OK;
}

/* The next buffer at or after i that is broadcast (bytes > 0), or n_buffers. */
static int next_sent(const rs_nccl_update_req *r, int i) {
    int n = rs_nccl_n_buffers(r);
    for (; i < n; i++) {
        int first, count;
        uint64_t bytes;
        rs_nccl_buffer(r, i, &first, &count, &bytes);
        if (bytes > 0) return i;
    }
    return n;
}

int rs_nccl_update(rs_sync *s, const rs_nccl_update_req *r, rs_sync_result *res, rs_error *err) {
    double t0 = rs_now_s();
    nccl_group *g = group_find(s, r->group_name);
    if (!g)
        return rs_error_set(err, RS_EINVAL, "group_name",
                            "no weights update group '%s': POST /init_weights_update_group first", r->group_name);
    g->requests++;
    int rc = rs_nccl_check_update_req(r, g_opts.max_buffer_bytes, err);
    if (rc != RS_OK) {
        /* The trainer is broadcasting buffers this server cannot take: the group cannot stay in step. */
        err_append(err, "; group '%s' aborted: init a new one", g->name);
        group_drop(s, g, true);
        return rc;
    }
    if (!g->comm && (rc = watcher_take(g, t0 + g_opts.init_timeout_s, err)) != RS_OK) {
        err_append(err, "; group '%s' aborted: init a new one", g->name);
        RS_WARN("nccl | group %s | join at the first update failed: %s", g->name, err->message);
        group_drop(s, g, true);
        return rc;
    }

    /* Join the transaction. A refusal (another version's transaction is open: 409) or a tensor the
     * model refuses still receives every broadcast, and discards it, so that the group stays in step
     * with the trainer; the first such error is the answer. */
    rs_txn *u = NULL;
    rs_error refusal = {0};
    int refused = rs_sync_txn_join(s, r->has_version ? r->weight_version : NULL, r->has_txn_id ? r->txn_id : NULL, &u,
                                   &refusal);

    int n_buf = rs_nccl_n_buffers(r);
    uint64_t received = 0;
    int k = 0; /* broadcast buffers posted so far; buffer number k uses slot k % 2 */
    int next = next_sent(r, 0);
    if (next < n_buf) {
        int first, count;
        uint64_t bytes;
        rs_nccl_buffer(r, next, &first, &count, &bytes);
        if ((rc = rs_nccl_comm_recv_post(g->comm, k % 2, bytes, g_opts.op_timeout_s, err)) != RS_OK) goto transport;
        k++;
    }
    for (int i = 0; i < n_buf; i++) {
        int first, count;
        uint64_t bytes;
        rs_nccl_buffer(r, i, &first, &count, &bytes);
        const void *host = NULL;
        if (bytes > 0) {
            int slot = (k - 1) % 2; /* buffer i is the last one posted */
            int after = next_sent(r, i + 1);
            if (after < n_buf) {
                int f2, c2;
                uint64_t b2;
                rs_nccl_buffer(r, after, &f2, &c2, &b2);
                if ((rc = rs_nccl_comm_recv_post(g->comm, k % 2, b2, g_opts.op_timeout_s, err)) != RS_OK)
                    goto transport;
                k++;
                slot = (k - 2) % 2;
            }
            if ((rc = rs_nccl_comm_recv_wait(g->comm, slot, g_opts.op_timeout_s, &host, err)) != RS_OK)
                goto transport;
            received += bytes;
        }
        if (refused == RS_OK) refused = stage_buffer(u, r, i, host, &refusal);
    }
    g->bytes += received;

    if (refused != RS_OK) {
        *err = refusal;
        err_append(err, " (the request's %llu bytes were received and discarded; group '%s' stays usable)",
                   (unsigned long long)received, g->name);
        RS_WARN("nccl | group %s | update refused: %s", g->name, err->message);
        return refused;
    }
    rc = rs_sync_txn_finish(s, r->is_last, r->abort_all_requests, res, err);
    if (rc != RS_OK) return rc;
    if (res) res->bytes = received;
    RS_INFO("nccl | group %s | %d tensors, %llu bytes in %d broadcasts, %.3f s%s", g->name, r->n_tensors,
            (unsigned long long)received, k, rs_now_s() - t0, res && res->committed ? ", committed" : "");
    return RS_OK;

transport:
    err_append(err, " (group '%s', after %llu of %llu bytes); the group was aborted: init a new one", g->name,
               (unsigned long long)received, (unsigned long long)r->total_bytes);
    RS_WARN("nccl | group %s | update failed: %s", g->name, err->message);
    group_drop(s, g, true);
    return rc;
}

#else /* no RS_CUDA: the CPU build has no NCCL */

static int unsupported(rs_error *err) {
    return rs_error_set(err, RS_EUNSUPPORTED, NULL, "%s", RS_NCCL_UNSUPPORTED_MESSAGE);
}

int rs_nccl_init_group(rs_sync *s, const rs_nccl_group_req *r, rs_error *err) {
    (void)s;
    (void)r;
    return unsupported(err);
}

int rs_nccl_update(rs_sync *s, const rs_nccl_update_req *r, rs_sync_result *res, rs_error *err) {
    (void)s;
    (void)r;
    (void)res;
    return unsupported(err);
}

int rs_nccl_destroy_group(rs_sync *s, const char *group_name, rs_error *err) {
    (void)s;
    (void)group_name;
    return unsupported(err);
}

void rs_nccl_release(rs_sync *s) { (void)s; }

#endif
