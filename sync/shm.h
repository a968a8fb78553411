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
 * The trainer must not resize the segment while a request that names it is in flight: a segment
 * truncated under the mapping would fault on access (SIGBUS), which the daemon does not survive.
 * The ownership check limits that to the trainer's own uid, i.e. to a trainer that breaks its own
 * protocol.
 */
#ifndef RS_SYNC_SHM_H
#define RS_SYNC_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "sync.h"

typedef struct rs_shm_segment {
    const uint8_t *base;                /* [size] mapped read-only; NULL when size == 0 */
    size_t size;
} rs_shm_segment;

/* Opens and maps segment `name` after the checks above. RS_EINVAL (400) with param "shm_name" and
 * a message saying which check failed: not a valid name, does not exist, cannot be opened, not
 * owned by this uid, mode not 0600. */
int rs_shm_open_segment(const char *name, rs_shm_segment *out, rs_error *err);
void rs_shm_close_segment(rs_shm_segment *seg);

/* Every tensor of the manifest lies inside a segment of `size` bytes; RS_EINVAL naming
 * "tensors[i].offset" otherwise. */
int rs_shm_check_manifest(const rs_shm_update_req *r, size_t size, rs_error *err);

/* The job (sync service thread): join or open the transaction, map, stage, unmap, commit if last. */
int rs_shm_update(rs_sync *s, const rs_shm_update_req *r, rs_sync_result *res, rs_error *err);

#endif /* RS_SYNC_SHM_H */
