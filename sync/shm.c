/*
 * shm.c — /update_weights_from_shm (see shm.h).
 *
 * The checks run on the open descriptor (fstat after shm_open), never on the name again, so the
 * segment that was checked is the one that is mapped. glibc's shm_open opens /dev/shm/<name> with
 * O_NOFOLLOW, and the name has no '/' past the first byte (protocol/weights.c), so a name cannot
 * reach outside the shared-memory directory.
 *
 * The descriptor stays open until the segment is closed, so that rs_shm_check_intact can ask the
 * same segment for its size again once every tensor has been read: a shrink inside the last page
 * raises no SIGBUS (shm_guard.h), and this is the check that sees it.
 */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shm_guard.h"

int rs_shm_open_segment(const char *name, rs_shm_segment *out, rs_error *err) {
    *out = (rs_shm_segment){.fd = -1, .guard = -1};
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
    out->fd = fd;
    struct stat st;
    int rc;
    if (fstat(fd, &st) != 0) {
        rc = rs_error_set(err, RS_EINVAL, "shm_name", "cannot stat shared-memory segment '%s': %s", name,
                          strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = rs_error_set(err, RS_EINVAL, "shm_name", "'%s' is not a shared-memory segment", name);
        goto fail;
    }
    if (st.st_uid != geteuid()) {
        rc = rs_error_set(err, RS_EINVAL, "shm_name",
                          "shared-memory segment '%s' belongs to uid %u, not to rolloutd's uid %u; create it as the "
                          "user rolloutd runs as", name, (unsigned)st.st_uid, (unsigned)geteuid());
        goto fail;
    }
    if ((st.st_mode & 07777) != 0600) {
        rc = rs_error_set(err, RS_EINVAL, "shm_name",
                          "shared-memory segment '%s' has mode %04o; it must be 0600 (no group or other access), "
                          "e.g. shm_open(name, O_CREAT | O_RDWR, 0600)", name, (unsigned)(st.st_mode & 07777));
        goto fail;
    }
    if (st.st_size == 0) return RS_OK;
    /* MAP_POPULATE maps every page in one pass: the tensors are read whole right after, and one
     * minor fault per 4 KiB page costs several times the copy on a virtual machine */
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) {
        rc = rs_error_set(err, RS_EINVAL, "shm_name", "cannot map shared-memory segment '%s' (%lld bytes): %s",
                          name, (long long)st.st_size, strerror(errno));
        goto fail;
    }
    out->base = p;
    out->size = (size_t)st.st_size;
    /* guarded before the first byte is read: from here a shrinking segment fails the request */
    if ((out->guard = rs_shm_guard_add(p, out->size)) < 0) {
        rc = rs_error_set(err, RS_EBUSY, "shm_name",
                          "cannot guard shared-memory segment '%s': %d segments are already mapped; retry", name,
                          RS_SHM_GUARD_SLOTS);
        goto fail;
    }
    return RS_OK;
fail:
    rs_shm_close_segment(out);
    return rc;
}

void rs_shm_close_segment(rs_shm_segment *seg) {
    rs_shm_guard_remove(seg->guard); /* before munmap: the range may be reused by the next mapping */
    if (seg->base) munmap((void *)seg->base, seg->size);
    if (seg->fd >= 0) close(seg->fd);
    *seg = (rs_shm_segment){.fd = -1, .guard = -1};
}

int rs_shm_check_intact(const rs_shm_segment *seg, const char *name, rs_error *err) {
    if (!seg->base) return RS_OK; /* nothing was mapped, nothing was read */
    const bool faulted = rs_shm_guard_truncated(seg->guard);
    struct stat st;
    if (fstat(seg->fd, &st) != 0)
        return rs_error_set(err, RS_EINVAL, "shm_name",
                            "cannot stat shared-memory segment '%s' after reading it: %s; the update is dropped", name,
                            strerror(errno));
    if (st.st_size < 0 || (size_t)st.st_size < seg->size)
        return rs_error_set(err, RS_EINVAL, "shm_name",
                            "shared-memory segment '%s' shrank to %lld bytes while rolloutd was reading it "
                            "(%zu bytes at open); the update is dropped", name, (long long)st.st_size, seg->size);
    if (faulted)
        return rs_error_set(err, RS_EINVAL, "shm_name",
                            "shared-memory segment '%s' shrank while rolloutd was reading it (it is %lld bytes "
                            "again now, %zu at open); the update is dropped", name, (long long)st.st_size, seg->size);
    return RS_OK;
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

void (*rs_shm_test_hook_mapped)(const char *shm_name);

int rs_shm_update(rs_sync *s, const rs_shm_update_req *r, rs_sync_result *res, rs_error *err) {
    rs_update *u;
    int rc = rs_sync_txn(s, r->has_version ? r->weight_version : NULL, &u, err);
    if (rc != RS_OK) return rc;
    rs_shm_segment seg;
    if ((rc = rs_shm_open_segment(r->shm_name, &seg, err)) != RS_OK) return rc;
    if ((rc = rs_shm_check_manifest(r, seg.size, err)) == RS_OK) {
        if (rs_shm_test_hook_mapped) rs_shm_test_hook_mapped(r->shm_name);
        for (int i = 0; i < r->n_tensors && rc == RS_OK; i++) {
            const rs_weight_desc *d = &r->tensors[i];
            const rs_update_tensor t = {.name = d->name, .dtype = d->dtype, .ndim = d->ndim, .shape = d->shape,
                                        .data = seg.base ? seg.base + d->offset : NULL};
            if ((rc = rs_update_add(u, &t, err)) == RS_OK) res->bytes += d->nbytes;
            /* zeros served by the guard stop the request at once rather than after the bucket */
            if (rc == RS_OK && seg.base && rs_shm_guard_truncated(seg.guard)) break;
        }
        /* Checked whatever the outcome: a tensor refused because it was read as zeros (bad FP8
         * scales, say) is really a segment that shrank, and the answer should say so. */
        rs_error shrank = {0};
        if (rs_shm_check_intact(&seg, r->shm_name, &shrank) != RS_OK) {
            if (err) *err = shrank;
            rc = shrank.code;
        }
    }
    rs_shm_close_segment(&seg);
    if (rc != RS_OK) return rc; /* the service drops the transaction: nothing read here is committed */
    return rs_sync_txn_finish(s, r->is_last, r->abort_all_requests, res, err);
}
