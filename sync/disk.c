/*
 * disk.c — /update_weights_from_disk (see disk.h).
 *
 * Every file is vetted before it is opened: the directory, model.safetensors and the index here,
 * each shard through rs_st_dir_open_checked's callback. A shard symlinked out of
 * allowed-weight-dir is thus refused before a byte of it is read; parsing it first would let the
 * parser's errors describe the file outside (whether it exists, its size, its first bytes). A path
 * that resolves outside and one that does not resolve at all get the same answer, which names
 * neither the target nor errno: the client learns nothing about what lies outside DIR.
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
#include <sys/stat.h>

#include "../model/kv_scales.h"
#include "../model/safetensors.h"
#include "../model/update.h"
#include "shm_guard.h"

void (*rs_disk_test_hook_opened)(const char *model_dir);

bool rs_disk_path_inside(const char *real, const char *dir) {
    size_t n = strlen(dir);
    if (n == 1 && dir[0] == '/') return real[0] == '/';
    return strncmp(real, dir, n) == 0 && (real[n] == '\0' || real[n] == '/');
}

/* The one answer for a path that does not resolve and for one that resolves outside DIR. */
static int refuse(rs_error *err, const char *label, const char *path, const char *kind, const char *allowed) {
    return rs_error_set(err, RS_EINVAL, "model_path",
                        "%s'%s' does not resolve to a %s inside allowed-weight-dir '%s' (it does not exist, or it "
                        "or a symlink on its way leads outside)", label, path, kind, allowed);
}

/* `path` is <resolved model dir>/<plain file name>, so lstat looks only at an entry inside DIR and
 * its errno is the client's to know. The file must then resolve inside DIR, symlinks followed (a
 * dangling symlink is refused like one that leads outside); absent is fine when `optional`. */
static int check_file(const char *path, const char *allowed, bool optional, rs_error *err) {
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (optional && errno == ENOENT) return RS_OK;
        return rs_error_set(err, RS_EINVAL, "model_path", "cannot read '%s': %s", path, strerror(errno));
    }
    char real[PATH_MAX];
    if (!realpath(path, real) || !rs_disk_path_inside(real, allowed)) return refuse(err, "", path, "file", allowed);
    return RS_OK;
}

/* rs_st_check_fn: every file rs_st_dir_open_checked is about to open (ctx: the allowed dir). */
static int check_before_open(void *ctx, const char *path, rs_error *err) {
    return check_file(path, ctx, false, err);
}

/* Stages the tensors of one shard that are parameters of the served model or KV scales (the same
 * names an shm push may carry), reading them under the SIGBUS guard. */
static int stage_shard(rs_sync *s, rs_update *u, const rs_st_file *f, rs_sync_result *res, int *skipped,
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
        const rs_update_tensor ut = {.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .shape = t->shape,
                                     .data = t->data};
        if ((rc = rs_update_add(u, &ut, err)) == RS_OK) res->bytes += t->nbytes;
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
    char real[PATH_MAX];
    if (!realpath(r->model_path, real) || !rs_disk_path_inside(real, allowed))
        return refuse(err, "model_path ", r->model_path, "directory", allowed);
    struct stat st;
    if (stat(real, &st) != 0 || !S_ISDIR(st.st_mode))
        return rs_error_set(err, RS_EINVAL, "model_path", "model_path '%s' is not a directory", r->model_path);
    if (rs_sync_open_txn(s)) {
        rs_update *open = rs_sync_open_txn(s);
        return rs_error_set(err, RS_ESTATE, "model_path",
                            "a streamed weight update to version '%s' is in progress (%d of %d parameters staged); a "
                            "disk update is a whole transaction of its own", rs_update_version(open),
                            rs_update_n_staged(open), rs_update_n_required(open));
    }
    /* Checked here even when rs_st_dir_open would not open them: a dangling symlink under either
     * name must not read as "absent" (that would tell whether its target exists). */
    char path[PATH_MAX + 64];
    int rc;
    snprintf(path, sizeof path, "%s/model.safetensors", real);
    if ((rc = check_file(path, allowed, true, err)) != RS_OK) return rc;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", real);
    if ((rc = check_file(path, allowed, true, err)) != RS_OK) return rc;

    rs_st_dir *d = NULL;
    if ((rc = rs_st_dir_open_checked(&d, real, check_before_open, (void *)allowed, err)) != RS_OK) {
        if (rc == RS_ENOTFOUND || rc == RS_EIO) err->code = rc = RS_EINVAL; /* the request's path, not the server */
        if (!err->param[0]) snprintf(err->param, sizeof err->param, "model_path");
        return rc;
    }
    rs_update *u = NULL;
    rc = rs_sync_txn(s, r->has_version ? r->weight_version : NULL, &u, err);
    if (rc == RS_OK && rs_disk_test_hook_opened) rs_disk_test_hook_opened(real);
    int skipped = 0;
    for (size_t i = 0; i < rs_st_dir_shard_count(d) && rc == RS_OK; i++)
        rc = stage_shard(s, u, rs_st_dir_shard(d, i), res, &skipped, err);
    rs_st_dir_close(d); /* every tensor is converted into staging: the mappings can go */
    if (rc != RS_OK) return rc; /* the service drops the transaction: nothing read here is committed */
    if (skipped) RS_INFO("sync | disk | %s: %d tensors skipped (not parameters of the served model)", real, skipped);
    return rs_sync_txn_finish(s, RS_WEIGHT_LAST_YES, r->abort_all_requests, res, err);
}
