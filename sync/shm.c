/*
 * shm.c — /update_weights_from_shm (see shm.h).
 *
 * The checks run on the open descriptor (fstat after shm_open), never on the name again, so the
 * segment that was checked is the one that is mapped. glibc's shm_open opens /dev/shm/<name> with
 * O_NOFOLLOW, and the name has no '/' past the first byte (protocol/weights.c), so a name cannot
 * reach outside the shared-memory directory.
 */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int rs_shm_open_segment(const char *name, rs_shm_segment *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    if (!rs_shm_name_valid(name))
        return rs_error_set(err, RS_EINVAL, "shm_name", "shm_name '%.64s' is not a valid POSIX shared-memory name",
                            name);
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) {
        if (errno == ENOENT)
            return rs_error_set(err, RS_EINVAL, "shm_name", "shared-memory segment '%s' does not exist", name);
        return rs_error_set(err, RS_EINVAL, "shm_name", "cannot open shared-memory segment '%s': %s", name,
                            strerror(errno));
    }
    struct stat st;
    int rc = RS_OK;
    if (fstat(fd, &st) != 0) {
        rc = rs_error_set(err, RS_EINVAL, "shm_name", "cannot stat shared-memory segment '%s': %s", name,
                          strerror(errno));
    } else if (!S_ISREG(st.st_mode)) {
        rc = rs_error_set(err, RS_EINVAL, "shm_name", "'%s' is not a shared-memory segment", name);
    } else if (st.st_uid != geteuid()) {
        rc = rs_error_set(err, RS_EINVAL, "shm_name",
                          "shared-memory segment '%s' belongs to uid %u, not to rolloutd's uid %u; create it as the "
                          "user rolloutd runs as", name, (unsigned)st.st_uid, (unsigned)geteuid());
    } else if ((st.st_mode & 07777) != 0600) {
        rc = rs_error_set(err, RS_EINVAL, "shm_name",
                          "shared-memory segment '%s' has mode %04o; it must be 0600 (no group or other access), "
                          "e.g. shm_open(name, O_CREAT | O_RDWR, 0600)", name, (unsigned)(st.st_mode & 07777));
    } else if (st.st_size > 0) {
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
            rc = rs_error_set(err, RS_EINVAL, "shm_name", "cannot map shared-memory segment '%s' (%lld bytes): %s",
                              name, (long long)st.st_size, strerror(errno));
        else
            *out = (rs_shm_segment){.base = p, .size = (size_t)st.st_size};
    }
    close(fd);
    return rc;
}

void rs_shm_close_segment(rs_shm_segment *seg) {
    if (seg->base) munmap((void *)seg->base, seg->size);
    memset(seg, 0, sizeof *seg);
}

int rs_shm_check_manifest(const rs_shm_update_req *r, size_t size, rs_error *err) {
    for (int i = 0; i < r->n_tensors; i++) {
        const rs_weight_desc *d = &r->tensors[i];
        /* the parser bounds offset and nbytes by 2^62 each, so the sum cannot wrap */
        if (d->offset > size || d->nbytes > size - d->offset) {
            char param[48];
            snprintf(param, sizeof param, "tensors[%d].offset", i);
            return rs_error_set(err, RS_EINVAL, param,
                                "tensor '%s' occupies bytes [%llu, %llu) but segment '%s' has only %zu bytes", d->name,
                                (unsigned long long)d->offset, (unsigned long long)(d->offset + d->nbytes),
                                r->shm_name, size);
        }
    }
    return RS_OK;
}

int rs_shm_update(rs_sync *s, const rs_shm_update_req *r, rs_sync_result *res, rs_error *err) {
    rs_update *u;
    int rc = rs_sync_txn(s, r->has_version ? r->weight_version : NULL, &u, err);
    if (rc != RS_OK) return rc;
    rs_shm_segment seg;
    if ((rc = rs_shm_open_segment(r->shm_name, &seg, err)) != RS_OK) return rc;
    if ((rc = rs_shm_check_manifest(r, seg.size, err)) == RS_OK) {
        for (int i = 0; i < r->n_tensors && rc == RS_OK; i++) {
            const rs_weight_desc *d = &r->tensors[i];
            const rs_update_tensor t = {.name = d->name, .dtype = d->dtype, .ndim = d->ndim, .shape = d->shape,
                                        .data = seg.base ? seg.base + d->offset : NULL};
            if ((rc = rs_update_add(u, &t, err)) == RS_OK) res->bytes += d->nbytes;
        }
    }
    rs_shm_close_segment(&seg);
    if (rc != RS_OK) return rc;
    return rs_sync_txn_finish(s, r->is_last, r->abort_all_requests, res, err);
}
