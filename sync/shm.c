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
 *
 * Checksums. A manifest entry may carry "crc32c", the CRC-32C of the tensor's bytes as the trainer
 * wrote them (the Python client sends one by default). The conversion checks it in the pass that
 * reads the bytes (model/weight_store.h), so a segment rewritten under the read, or shrunk and grown back
 * (zeros, which the size checks here cannot see once the size is back), is refused with a 400
 * naming the tensor instead of committed. Without it only the size checks guard the read.
 *
 * A request's manifest is checked against the segment's size before anything is mapped, and a new
 * mapping has only the pages its tensors cover populated. Populating the whole segment would let
 * any request that names a large sparse segment make the daemon allocate (tmpfs allocates a page
 * on a read fault in a hole) and keep every page of it, however little the manifest covers.
 */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shm_guard.h"

/* shm_open + the checks of shm.h on the descriptor. Returns the descriptor, or -1 with err set. */
static int open_checked(const char *name, struct stat *st, rs_error *err) {
    if (!rs_shm_name_valid(name)) {
        rs_error_set(err, RS_EINVAL, "shm_name", "shm_name '%.64s' is not a valid POSIX shared-memory name", name);
        return -1;
    }
    /* O_NONBLOCK: /dev/shm is world-writable, and an open of a FIFO someone made there would wait
     * for a writer forever, on the sync thread that every weight job and shutdown wait for. A FIFO
     * now opens at once and fails S_ISREG below; the flag changes nothing for a regular file or its
     * mapping. */
    int fd = shm_open(name, O_RDONLY | O_NONBLOCK, 0);
    if (fd < 0) {
        if (errno == ENOENT) rs_error_set(err, RS_EINVAL, "shm_name", "shared-memory segment '%s' does not exist", name);
        else rs_error_set(err, RS_EINVAL, "shm_name", "cannot open shared-memory segment '%s': %s", name, strerror(errno));
        return -1;
    }
    if (fstat(fd, st) != 0) {
        rs_error_set(err, RS_EINVAL, "shm_name", "cannot stat shared-memory segment '%s': %s", name, strerror(errno));
    } else if (!S_ISREG(st->st_mode)) {
        rs_error_set(err, RS_EINVAL, "shm_name", "'%s' is not a shared-memory segment", name);
    } else if (st->st_uid != geteuid()) {
        rs_error_set(err, RS_EINVAL, "shm_name",
                     "shared-memory segment '%s' belongs to uid %u, not to rolloutd's uid %u; create it as the user "
                     "rolloutd runs as", name, (unsigned)st->st_uid, (unsigned)geteuid());
    } else if ((st->st_mode & 07777) != 0600) {
        rs_error_set(err, RS_EINVAL, "shm_name",
                     "shared-memory segment '%s' has mode %04o; it must be 0600 (no group or other access), "
                     "e.g. shm_open(name, O_CREAT | O_RDWR, 0600)", name, (unsigned)(st->st_mode & 07777));
    } else {
        return fd;
    }
    close(fd);
    return -1;
}

/* ---------------------------------------------------------------- mappings kept between requests */

typedef struct shm_map {
    const uint8_t *base;                /* NULL = free slot */
    size_t size;
    int fd;                             /* the segment, for st_nlink and st_size */
    dev_t dev;
    ino_t ino;
    uint64_t used;                      /* maps->tick at the last request that read it */
} shm_map;

struct rs_shm_maps {
    shm_map m[RS_SHM_KEEP];
    uint64_t tick;
};

rs_shm_maps *rs_shm_maps_new(void) { return rs_xcalloc(1, sizeof(rs_shm_maps)); }

static void map_drop(shm_map *m) {
    munmap((void *)m->base, m->size);
    close(m->fd);
    *m = (shm_map){.fd = -1};
}

void rs_shm_maps_free(rs_shm_maps *maps) {
    if (!maps) return;
    for (int i = 0; i < RS_SHM_KEEP; i++)
        if (maps->m[i].base) map_drop(&maps->m[i]);
    free(maps);
}

void rs_shm_maps_sweep(rs_shm_maps *maps) {
    for (int i = 0; i < RS_SHM_KEEP; i++) {
        shm_map *m = &maps->m[i];
        struct stat st;
        if (m->base && (fstat(m->fd, &st) != 0 || st.st_nlink == 0 || st.st_size < 0 || (size_t)st.st_size != m->size))
            map_drop(m);
    }
}

size_t rs_shm_maps_bytes(const rs_shm_maps *maps) {
    size_t b = 0;
    for (int i = 0; maps && i < RS_SHM_KEEP; i++) b += maps->m[i].base ? maps->m[i].size : 0;
    return b;
}

void rs_shm_maps_forget(rs_shm_maps *maps, const rs_shm_segment *seg) {
    for (int i = 0; maps && seg->base && i < RS_SHM_KEEP; i++)
        if (maps->m[i].base == seg->base) map_drop(&maps->m[i]);
}

/* The kept mapping of this file at this size, or NULL; one of another size is dropped. */
static shm_map *maps_find(rs_shm_maps *maps, const struct stat *st) {
    for (int i = 0; i < RS_SHM_KEEP; i++) {
        shm_map *m = &maps->m[i];
        if (!m->base || m->dev != st->st_dev || m->ino != st->st_ino) continue;
        if (m->size == (size_t)st->st_size) return m;
        map_drop(m);
    }
    return NULL;
}

/* A free slot, made by dropping the least recently used mapping if need be. */
static shm_map *maps_slot(rs_shm_maps *maps) {
    shm_map *lru = &maps->m[0];
    for (int i = 0; i < RS_SHM_KEEP; i++) {
        if (!maps->m[i].base) return &maps->m[i];
        if (maps->m[i].used < lru->used) lru = &maps->m[i];
    }
    map_drop(lru);
    return lru;
}

/* ---------------------------------------------------------------- populating what is read */

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14; headers older than that lack it, kernels older refuse it */
#endif

/* Maps bytes [from, to) of a new mapping in one pass: the tensors there are read whole right after,
 * and one minor fault per 4 KiB page costs several times the copy on a virtual machine. A kernel
 * without MADV_POPULATE_READ (before 5.14) answers EINVAL: the pages then fault in as they are read,
 * which is slower but the same bytes. Any other failure (the segment shrank meanwhile) is left to
 * the reads and the guard. */
static void populate_range(const uint8_t *base, size_t from, size_t to) {
    if (madvise((void *)(base + from), to - from, MADV_POPULATE_READ) != 0 && errno == EINVAL)
        madvise((void *)(base + from), to - from, MADV_WILLNEED);
}

typedef struct byte_range {
    uint64_t from, to;
} byte_range;

static int cmp_range(const void *a, const void *b) {
    const byte_range *x = a, *y = b;
    return x->from < y->from ? -1 : x->from > y->from;
}

/* Populates the pages of a new mapping [size] that r's tensors cover (all of it when r is NULL),
 * merged into runs so that tensors packed back to back cost one call. r has passed
 * rs_shm_check_manifest against size. */
static void populate(const uint8_t *base, size_t size, const rs_shm_update_req *r) {
    if (!r) {
        populate_range(base, 0, size);
        return;
    }
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    byte_range *rg = rs_xmalloc((size_t)(r->n_tensors ? r->n_tensors : 1) * sizeof *rg);
    int n = 0;
    for (int i = 0; i < r->n_tensors; i++)
        if (r->tensors[i].nbytes > 0)
            rg[n++] = (byte_range){r->tensors[i].offset & ~(page - 1), r->tensors[i].offset + r->tensors[i].nbytes};
    qsort(rg, (size_t)n, sizeof *rg, cmp_range);
    for (int i = 0; i < n;) {
        byte_range run = rg[i++];
        for (; i < n && rg[i].from <= ((run.to + page - 1) & ~(page - 1)); i++)
            if (rg[i].to > run.to) run.to = rg[i].to;
        populate_range(base, (size_t)run.from, (size_t)run.to);
    }
    free(rg);
}

/* ---------------------------------------------------------------- one request's segment */

/* rs_shm_open_kept for a request's manifest r (NULL: the whole segment is read). */
static int open_segment(rs_shm_maps *maps, const char *name, const rs_shm_update_req *r, rs_shm_segment *out,
                        rs_error *err) {
    *out = (rs_shm_segment){.fd = -1, .guard = -1};
    struct stat st;
    int fd = open_checked(name, &st, err);
    if (fd < 0) return err ? err->code : RS_EINVAL;
    int rc;
    /* before anything is mapped: a manifest that overruns the segment costs no page */
    if (r && (rc = rs_shm_check_manifest(r, (size_t)st.st_size, err)) != RS_OK) {
        close(fd);
        return rc;
    }
    if (st.st_size == 0) {
        out->fd = fd;
        return RS_OK;
    }
    shm_map *hit = maps ? maps_find(maps, &st) : NULL;
    if (hit) {
        close(fd); /* the kept descriptor is of the same file */
        hit->used = ++maps->tick;
        *out = (rs_shm_segment){.base = hit->base, .size = hit->size, .fd = hit->fd, .guard = -1, .kept = true};
    } else {
        /* no MAP_POPULATE: only the pages the manifest covers are populated, once guarded (below) */
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            rc = rs_error_set(err, RS_EINVAL, "shm_name", "cannot map shared-memory segment '%s' (%lld bytes): %s",
                              name, (long long)st.st_size, strerror(errno));
            close(fd);
            return rc;
        }
        *out = (rs_shm_segment){.base = p, .size = (size_t)st.st_size, .fd = fd, .guard = -1};
        if (maps) {
            shm_map *m = maps_slot(maps);
            *m = (shm_map){.base = p, .size = out->size, .fd = fd, .dev = st.st_dev, .ino = st.st_ino,
                           .used = ++maps->tick};
            out->kept = true;
        }
    }
    /* guarded before the first byte is read: from here a shrinking segment fails the request */
    if ((out->guard = rs_shm_guard_add(out->base, out->size)) < 0) {
        rc = rs_error_set(err, RS_EBUSY, "shm_name",
                          "cannot guard shared-memory segment '%s': %d segments are already mapped; retry", name,
                          RS_SHM_GUARD_SLOTS);
        if (out->kept) rs_shm_maps_forget(maps, out);
        else rs_shm_close_segment(out);
        *out = (rs_shm_segment){.fd = -1, .guard = -1};
        return rc;
    }
    /* A kept mapping is not populated again: its pages stay mapped from earlier requests (a page a
     * manifest covers for the first time faults in once, when read), which is what makes a steady
     * push through kept segments cost no page-table work. */
    if (!hit) populate(out->base, out->size, r);
    return RS_OK;
}

int rs_shm_open_kept(rs_shm_maps *maps, const char *name, rs_shm_segment *out, rs_error *err) {
    return open_segment(maps, name, NULL, out, err);
}

int rs_shm_open_request(rs_shm_maps *maps, const rs_shm_update_req *r, rs_shm_segment *out, rs_error *err) {
    return open_segment(maps, r->shm_name, r, out, err);
}

int rs_shm_open_segment(const char *name, rs_shm_segment *out, rs_error *err) {
    return rs_shm_open_kept(NULL, name, out, err);
}

void rs_shm_close_segment(rs_shm_segment *seg) {
    rs_shm_guard_remove(seg->guard); /* before munmap: the range may be reused by the next mapping */
    if (!seg->kept) {
        if (seg->base) munmap((void *)seg->base, seg->size);
        if (seg->fd >= 0) close(seg->fd);
    }
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
    rs_txn *u;
    int rc = rs_sync_txn_join(s, r->has_version ? r->weight_version : NULL, r->has_txn_id ? r->txn_id : NULL, &u, err);
    if (rc != RS_OK) return rc;
    rs_shm_maps *maps = rs_sync_shm_maps(s);
    if (maps) rs_shm_maps_sweep(maps);
    rs_shm_segment seg;
    if ((rc = rs_shm_open_request(maps, r, &seg, err)) != RS_OK) return rc;
    if (rs_shm_test_hook_mapped) rs_shm_test_hook_mapped(r->shm_name);
    for (int i = 0; i < r->n_tensors && rc == RS_OK; i++) {
        const rs_weight_desc *d = &r->tensors[i];
        const rs_txn_tensor t = {.name = d->name, .dtype = d->dtype, .ndim = d->ndim, .shape = d->shape,
                                    .data = seg.base ? seg.base + d->offset : NULL, .has_crc32c = d->has_crc32c,
                                    .crc32c = d->crc32c};
        if ((rc = rs_txn_add(u, &t, err)) == RS_OK) res->bytes += d->nbytes;
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
    const rs_shm_segment read = seg;
    rs_shm_close_segment(&seg);
    /* A failed request may have had zero pages put under the mapping by the guard: map it anew
     * next time (and the trainer is likely to replace the segment anyway). */
    if (rc != RS_OK) rs_shm_maps_forget(maps, &read);
    if (rc != RS_OK) return rc; /* the service drops the transaction: nothing read here is committed */
    return rs_sync_txn_finish(s, r->is_last, r->abort_all_requests, res, err);
}
