/*
 * shm.h — the POSIX shared-memory transport: /update_weights_from_shm.
 *
 * The trainer (same host, same user) writes a bucket of tensors into a shared-memory segment it
 * created with shm_open(name, O_CREAT | O_RDWR, 0600), and posts the manifest: each tensor's name,
 * dtype, shape and byte offset. rolloutd opens the segment read-only and checks it before reading
 * a byte: it must exist, belong to rolloutd's own uid and have mode exactly 0600 (no group or
 * other access: another local user must not be able to feed or read weights), and its size must
 * cover every tensor's [offset, offset + nbytes). Then it maps the segment read-only, stages each
 * tensor into the open transaction (converting it to the served precision), and unmaps it before
 * answering, so the trainer may reuse or unlink the segment as soon as the answer arrives.
 *
 * The trainer must not resize the segment while a request that names it is in flight. One that
 * does (truncates it under the mapping) fails the request instead of the daemon: the mapping is
 * registered with the SIGBUS guard (shm_guard.h), which serves zeros for pages past the new end,
 * and before the transaction may go on, rs_shm_check_intact looks at the guard's flag and at the
 * descriptor's size again; a segment that shrank fails the request with RS_EINVAL (400), so the
 * service drops the transaction and the old weights keep serving. A trainer that shrinks and
 * regrows the segment without any read landing past the end is indistinguishable from one that
 * rewrites the bytes under the request: both break the protocol, and only the trainer can tell.
 */
#ifndef RS_SYNC_SHM_H
#define RS_SYNC_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "sync.h"

typedef struct rs_shm_segment {
    const uint8_t *base;                /* [size] mapped read-only; NULL when size == 0 */
    size_t size;                        /* bytes at open (fstat), what the manifest is checked against */
    int fd;                             /* the checked descriptor, kept for rs_shm_check_intact; -1 none */
    int guard;                          /* shm_guard.h slot of the mapping; -1 when nothing is mapped */
} rs_shm_segment;

/* Opens and maps segment `name` after the checks above, and registers the mapping with the SIGBUS
 * guard. RS_EINVAL (400) with param "shm_name" and a message saying which check failed: not a
 * valid name, does not exist, cannot be opened, not owned by this uid, mode not 0600; RS_EBUSY
 * (503) if every guard slot is taken. On failure *out is closed (safe to pass to close). */
int rs_shm_open_segment(const char *name, rs_shm_segment *out, rs_error *err);
/* Unregisters, unmaps and closes; callable on a zeroed or already closed segment. */
void rs_shm_close_segment(rs_shm_segment *seg);

/* After every read of the mapping (and before anything read from it is committed): RS_EINVAL
 * (400, param "shm_name") if the segment shrank meanwhile, seen either as a read the guard had to
 * serve zeros or as a size (fstat) below the one mapped. `name` is for the message. */
int rs_shm_check_intact(const rs_shm_segment *seg, const char *name, rs_error *err);

/* Every tensor of the manifest lies inside a segment of `size` bytes; RS_EINVAL naming
 * "tensors[i].offset" otherwise. */
int rs_shm_check_manifest(const rs_shm_update_req *r, size_t size, rs_error *err);

/* The job (sync service thread): join or open the transaction, map, stage, check intact, unmap,
 * commit if last. */
int rs_shm_update(rs_sync *s, const rs_shm_update_req *r, rs_sync_result *res, rs_error *err);

/* Tests only: when non-NULL, rs_shm_update calls it on the service thread once the segment is
 * open, mapped and its manifest checked, before the first tensor is read; a test truncates the
 * segment there to reproduce a trainer that shrinks it mid-request, deterministically. NULL in the
 * daemon. */
extern void (*rs_shm_test_hook_mapped)(const char *shm_name);

#endif /* RS_SYNC_SHM_H */
