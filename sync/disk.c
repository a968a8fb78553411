/*
 * disk.c — /update_weights_from_disk (see disk.h).
 *
 * Nothing is checked by name and opened later. The allowed directory is opened once per request,
 * and everything below it is opened relative to descriptors with confine.h, which follows no
 * symlink and crosses no mount point: the checkpoint directory (walked from the allowed one), then
 * model.safetensors, the index and every shard (from the checkpoint directory's descriptor). What
 * each open returned is checked (a directory or a regular file, on the allowed directory's
 * device), and only those descriptors are read. So a client that can write inside the directory
 * and swaps a name for a symlink to elsewhere, at any moment, gets a refusal or the file that was
 * inside: never a byte of another. A refusal says the same whatever the reason (a symlink, a
 * missing name, another device), and names neither a target nor errno.
 *
 * The shards are mapped from files the trainer may rewrite in place while they are read
 * (safetensors' save_file and torch.save open with O_TRUNC). A read past the new end of a mapped
 * file raises SIGBUS, so each shard's mapping is registered with the SIGBUS guard (shm_guard.h)
 * while its tensors are converted, one shard at a time (the guard has few slots), and a shard that
 * shrank fails the whole update with a 400: the service drops the transaction and the old weights
 * keep serving.
 */
#include "disk.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../model/kv_scales.h"
#include "../model/safetensors.h"
#include "../model/weight_store.h"
#include "confine.h"
#include "shm_guard.h"

void (*rs_disk_test_hook_opened)(const char *model_dir);

/* The one answer for every refusal of a path: it does not resolve, it resolves outside DIR, or
 * something on its way is a symlink or another file system. */
static int refuse(rs_error *err, const char *label, const char *path, const char *kind, const char *allowed) {
    return rs_error_set(err, RS_EINVAL, "model_path",
                        "%s'%s' does not resolve to a %s inside allowed-weight-dir '%s' (it does not exist, or a "
                        "symlink or another file system is on its way: none is followed)", label, path, kind, allowed);
}

/* The part of the absolute `path` below `allowed` (a realpath): the rest after the shortest
 * leading run of path's names that resolves to `allowed` itself. That prefix may hold symlinks
 * (e.g. /data -> /mnt/data): it only says where the walk starts, and the walk itself starts from a
 * descriptor of `allowed`, so whatever the prefix resolves to later cannot matter. NULL when no
 * prefix resolves to `allowed`. */
static const char *below_allowed(const char *path, const char *allowed) {
    if (path[0] != '/') return NULL;
    size_t n = strlen(path);
    char prefix[PATH_MAX], real[PATH_MAX];
    if (n >= sizeof prefix) return NULL;
    for (size_t i = 1; i <= n; i++) {
        if (i < n && path[i] != '/') continue;
        memcpy(prefix, path, i);
        prefix[i] = '\0';
        if (realpath(prefix, real) && strcmp(real, allowed) == 0) {
            const char *rest = path + i;
            while (*rest == '/') rest++;
            return rest;
        }
    }
    return strcmp(allowed, "/") == 0 ? path + 1 : NULL;
}

typedef struct disk_dir {
    const rs_confine *root;
    int fd;                     /* the checkpoint directory, opened below root */
    const char *model_path;     /* as the request wrote it: labels */
    const char *allowed;
} disk_dir;

/* rs_st_open_fn: a file of the checkpoint directory, opened below it without following symlinks. */
static int open_in_checkpoint(void *ctx, const char *name, int *fd, rs_error *err) {
    const disk_dir *dd = ctx;
    char label[PATH_MAX + 300];
    snprintf(label, sizeof label, "%s/%s", dd->model_path, name);
    int rc = rs_confine_openat(dd->root, dd->fd, name, false, fd);
    switch (rc) {
    case RS_OK: return RS_OK;
    case RS_ENOTFOUND: return rs_error_set(err, RS_ENOTFOUND, "model_path", "'%s' does not exist", label);
    case RS_EUNSUPPORTED: return rs_error_set(err, RS_EINVAL, "model_path", "'%s' is not a regular file", label);
    case RS_EINVAL: return refuse(err, "", label, "file", dd->allowed);
    default: return rs_error_set(err, RS_EIO, "model_path", "cannot open '%s': %s", label, strerror(errno));
    }
}

/* Stages the tensors of one shard that are parameters of the served model or KV scales (the same
 * names an shm push may carry), reading them under the SIGBUS guard. */
static int stage_shard(rs_sync *s, rs_txn *u, const rs_st_file *f, rs_sync_result *res, int *skipped,
                       rs_error *err) {
    rs_model *m = rs_sync_model(s);
    size_t len;
    const void *base = rs_st_mapping(f, &len);
    RS_ASSERT(base && len > 0); /* rs_st_open maps every file, and a file holds at least its header */
    const int guard = rs_shm_guard_add(base, len);
    if (guard < 0)
        return rs_error_set(err, RS_EBUSY, "model_path",
                            "cannot guard checkpoint file '%s': %d mappings are already guarded; retry",
                            rs_st_label(f), RS_SHM_GUARD_SLOTS);
    int rc = RS_OK;
    for (size_t i = 0; i < rs_st_count(f) && rc == RS_OK; i++) {
        const rs_st_tensor *t = rs_st_tensor_at(f, i);
        int layer;
        bool is_v;
        if (!rs_model_slot(m, t->name, NULL) && !rs_kv_scale_name(t->name, m->cfg.n_layers, &layer, &is_v)) {
            RS_DEBUG("sync | disk | skipping tensor '%s' (not a parameter of the served model)", t->name);
            (*skipped)++;
            continue;
        }
        const rs_txn_tensor ut = {.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .shape = t->shape,
                                     .data = t->data};
        if ((rc = rs_txn_add(u, &ut, err)) == RS_OK) res->bytes += t->nbytes;
        /* zeros served by the guard stop the shard at once rather than after it */
        if (rc == RS_OK && rs_shm_guard_truncated(guard)) break;
    }
    /* Checked whatever the outcome, as shm.c does: a tensor refused because it was read as zeros
     * is really a file that shrank, and the answer should say so. A shrink inside the last page
     * raises no SIGBUS, hence the size as well. */
    const bool faulted = rs_shm_guard_truncated(guard);
    rs_shm_guard_remove(guard);
    uint64_t now = 0;
    rs_error stat_err = {0};
    if (rs_st_size_now(f, &now, &stat_err) != RS_OK)
        return rs_error_set(err, RS_EINVAL, "model_path", "%s after reading it; the update is dropped",
                            stat_err.message);
    if (faulted || now < len)
        return rs_error_set(err, RS_EINVAL, "model_path",
                            "checkpoint file '%s' shrank while rolloutd was reading it (%zu bytes at open, %llu "
                            "now); the update is dropped; write each checkpoint to a new file (or directory) and "
                            "rename it into place rather than rewriting one in place", rs_st_label(f), len,
                            (unsigned long long)now);
    return rc;
}

int rs_disk_update(rs_sync *s, const rs_disk_update_req *r, rs_sync_result *res, rs_error *err) {
    const char *allowed = rs_sync_allowed_dir(s);
    if (!allowed[0])
        return rs_error_set(err, RS_EINVAL, "model_path",
                            "/update_weights_from_disk is disabled: start rolloutd with --allowed-weight-dir DIR to "
                            "allow checkpoints under DIR");
    /* A request never needs '..': refuse it outright rather than reason about where it leads. */
    for (const char *p = r->model_path; (p = strstr(p, "..")) != NULL; p += 2) {
        bool starts = p == r->model_path || p[-1] == '/', ends = p[2] == '\0' || p[2] == '/';
        if (starts && ends)
            return rs_error_set(err, RS_EINVAL, "model_path", "model_path '%s' contains a '..' component",
                                r->model_path);
    }
    const char *rel = below_allowed(r->model_path, allowed);
    if (!rel) return refuse(err, "model_path ", r->model_path, "directory", allowed);
    if (rs_sync_open_txn(s)) {
        rs_txn *open = rs_sync_open_txn(s);
        return rs_error_set(err, RS_ESTATE, "model_path",
                            "a streamed weight update to version '%s' is in progress (%d of %d parameters staged); a "
                            "disk update is a whole transaction of its own", rs_txn_version(open),
                            rs_txn_n_staged(open), rs_txn_n_required(open));
    }
    rs_confine root;
    int rc = rs_confine_open(&root, allowed, err);
    if (rc != RS_OK) {
        snprintf(err->param, sizeof err->param, "model_path");
        return err->code = RS_EINVAL;
    }
    disk_dir dd = {.root = &root, .fd = -1, .model_path = r->model_path, .allowed = allowed};
    rc = rs_confine_openat(&root, root.root_fd, rel, true, &dd.fd);
    if (rc != RS_OK) {
        rs_confine_close(&root);
        if (rc == RS_EIO)
            return rs_error_set(err, RS_EINVAL, "model_path", "cannot open model_path '%s': %s", r->model_path,
                                strerror(errno));
        return refuse(err, "model_path ", r->model_path, "directory", allowed);
    }
    rs_st_dir *d = NULL;
    rc = rs_st_dir_open_with(&d, r->model_path, open_in_checkpoint, &dd, err);
    close(dd.fd);
    rs_confine_close(&root); /* every file is open: nothing below is looked up by name again */
    if (rc != RS_OK) {
        if (rc == RS_ENOTFOUND || rc == RS_EIO) err->code = rc = RS_EINVAL; /* the request's path, not the server */
        if (!err->param[0]) snprintf(err->param, sizeof err->param, "model_path");
        return rc;
    }
    rs_txn *u = NULL;
    rc = rs_sync_txn(s, r->has_version ? r->weight_version : NULL, &u, err);
    if (rc == RS_OK && rs_disk_test_hook_opened) rs_disk_test_hook_opened(r->model_path);
    int skipped = 0;
    for (size_t i = 0; i < rs_st_dir_shard_count(d) && rc == RS_OK; i++)
        rc = stage_shard(s, u, rs_st_dir_shard(d, i), res, &skipped, err);
    rs_st_dir_close(d); /* every tensor is converted into staging: the mappings can go */
    if (rc != RS_OK) return rc; /* the service drops the transaction: nothing read here is committed */
    if (skipped)
        RS_INFO("sync | disk | %s: %d tensors skipped (not parameters of the served model)", r->model_path, skipped);
    return rs_sync_txn_finish(s, RS_WEIGHT_LAST_YES, r->abort_all_requests, res, err);
}
