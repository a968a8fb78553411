/*
 * disk.c — /update_weights_from_disk (see disk.h).
 */
#include "disk.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../model/safetensors.h"
#include "../model/update.h"

bool rs_disk_path_inside(const char *real, const char *dir) {
    size_t n = strlen(dir);
    if (n == 1 && dir[0] == '/') return real[0] == '/';
    return strncmp(real, dir, n) == 0 && (real[n] == '\0' || real[n] == '/');
}

/* `path` (which need not exist) resolves inside the allowed directory. */
static int check_file(const char *path, const char *allowed, bool optional, rs_error *err) {
    char real[PATH_MAX];
    if (!realpath(path, real)) {
        if (optional && errno == ENOENT) return RS_OK;
        return rs_error_set(err, RS_EINVAL, "model_path", "cannot resolve '%s': %s", path, strerror(errno));
    }
    if (!rs_disk_path_inside(real, allowed))
        return rs_error_set(err, RS_EINVAL, "model_path", "'%s' resolves to '%s', outside allowed-weight-dir '%s'",
                            path, real, allowed);
    return RS_OK;
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
    if (!realpath(r->model_path, real))
        return rs_error_set(err, RS_EINVAL, "model_path", "model_path '%s' cannot be resolved: %s", r->model_path,
                            strerror(errno));
    if (!rs_disk_path_inside(real, allowed))
        return rs_error_set(err, RS_EINVAL, "model_path",
                            "model_path '%s' resolves to '%s', outside allowed-weight-dir '%s'", r->model_path, real,
                            allowed);
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
    char path[PATH_MAX + 64];
    int rc;
    snprintf(path, sizeof path, "%s/model.safetensors", real);
    if ((rc = check_file(path, allowed, true, err)) != RS_OK) return rc;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", real);
    if ((rc = check_file(path, allowed, true, err)) != RS_OK) return rc;

    rs_st_dir *d = NULL;
    if ((rc = rs_st_dir_open(&d, real, err)) != RS_OK) {
        if (rc == RS_ENOTFOUND || rc == RS_EIO) err->code = rc = RS_EINVAL; /* the request's path, not the server */
        if (!err->param[0]) snprintf(err->param, sizeof err->param, "model_path");
        return rc;
    }
    const size_t n = rs_st_dir_count(d);
    const char *last_file = NULL;
    for (size_t i = 0; i < n && rc == RS_OK; i++) { /* each shard once (tensors come shard by shard) */
        const char *file;
        rs_st_dir_tensor_at(d, i, &file);
        if (file != last_file) rc = check_file(file, allowed, false, err);
        last_file = file;
    }
    rs_update *u = NULL;
    if (rc == RS_OK) rc = rs_sync_txn(s, r->has_version ? r->weight_version : NULL, &u, err);
    int skipped = 0;
    for (size_t i = 0; i < n && rc == RS_OK; i++) {
        const rs_st_tensor *t = rs_st_dir_tensor_at(d, i, NULL);
        if (!rs_model_slot(rs_sync_model(s), t->name, NULL)) {
            RS_DEBUG("sync | disk | skipping tensor '%s' (not a parameter of the served model)", t->name);
            skipped++;
            continue;
        }
        const rs_update_tensor ut = {.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .shape = t->shape,
                                     .data = t->data};
        if ((rc = rs_update_add(u, &ut, err)) == RS_OK) res->bytes += t->nbytes;
    }
    rs_st_dir_close(d); /* every tensor is converted into staging: the mapping can go */
    if (rc != RS_OK) return rc;
    if (skipped) RS_INFO("sync | disk | %s: %d tensors skipped (not parameters of the served model)", real, skipped);
    return rs_sync_txn_finish(s, RS_WEIGHT_LAST_YES, r->abort_all_requests, res, err);
}
