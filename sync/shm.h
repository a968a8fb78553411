/*
 * shm.h — the POSIX shared-memory transport: /update_weights_from_shm.
 *
 * The trainer (same host, same user) writes a bucket of tensors into a shared-memory segment it
 * created with shm_open(name, O_CREAT | O_RDWR, 0600), and posts the manifest: each tensor's name,
 * dtype, shape and byte offset. rolloutd opens the segment read-only and checks it before reading
 * a byte: it must exist, belong to rolloutd's own uid and have mode exactly 0600 (no group or
 * other access: another local user must not be able to feed or read weights), and its size must
 * cover every tensor's [offset, offset + nbytes). Then it maps the segment read-only (populating
 * only the pages the tensors cover), stages each tensor into the open transaction (converting it to
 * the served precision) and answers; the trainer may reuse or unlink the segment as soon as the
 * answer arrives.
 *
 * Mappings are kept between requests (weight-shm-keep, on by default; at most RS_SHM_KEEP, least
 * recently used dropped first). A trainer that reuses its bucket segments from push to push (the
 * client's keep_segments) then costs no mmap and no page-table walk per bucket: mapping and
 * unmapping 1 GB of 4 KiB tmpfs pages took 60% of the daemon's time for a push on the reference
 * VM. A kept mapping is used again only for the same file (device and inode, as the name resolves
 * now) at the same size, and only after the name has passed every check above again. One is
 * dropped as soon as its file is unlinked or resized (checked before every shm request and once a
 * second while the service is idle), after any failed request that read it, and at shutdown, so
 * a segment the trainer unlinks does not stay pinned by the daemon for more than about a second.
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

#include "sync_internal.h"

typedef struct rs_shm_segment {
    const uint8_t *base;                /* [size] mapped read-only; NULL when size == 0 */
    size_t size;                        /* bytes at open (fstat), what the manifest is checked against */
    int fd;                             /* the checked descriptor, kept for rs_shm_check_intact; -1 none */
    int guard;                          /* shm_guard.h slot of the mapping; -1 when nothing is mapped */
    bool kept;                          /* base and fd belong to an rs_shm_maps, not to this request */
} rs_shm_segment;

/* Mappings kept between requests (above). Service thread only. */
#define RS_SHM_KEEP 4
typedef struct rs_shm_maps rs_shm_maps;
rs_shm_maps *rs_shm_maps_new(void);
void rs_shm_maps_free(rs_shm_maps *maps); /* unmaps every kept mapping; NULL is a no-op */
/* Drops the mappings of segments that were unlinked or resized since they were mapped. */
void rs_shm_maps_sweep(rs_shm_maps *maps);
/* Drops the kept mapping a segment came from (after rs_shm_close_segment); no-op if not kept. */
void rs_shm_maps_forget(rs_shm_maps *maps, const rs_shm_segment *seg);
size_t rs_shm_maps_bytes(const rs_shm_maps *maps); /* bytes mapped by the kept mappings */

/* rs_shm_open_segment, taking the mapping from `maps` when it holds one of the same file at the
 * same size, and keeping a new one there (maps NULL: a mapping of this request's own). A new
 * mapping has every page populated. */
int rs_shm_open_kept(rs_shm_maps *maps, const char *name, rs_shm_segment *out, rs_error *err);

/* rs_shm_open_kept for request r (segment r->shm_name): r's manifest is checked against the
 * segment's size before anything is mapped (RS_EINVAL as rs_shm_check_manifest), and a new mapping
 * has only the pages r's tensors cover populated (a kept one is not populated again). */
int rs_shm_open_request(rs_shm_maps *maps, const rs_shm_update_req *r, rs_shm_segment *out, rs_error *err);

/* Opens and maps segment `name` after the checks above (every page populated), and registers the
 * mapping with the SIGBUS guard. RS_EINVAL (400) with param "shm_name" and a message saying which check failed: not a
 * valid name, does not exist, cannot be opened, not owned by this uid, mode not 0600; RS_EBUSY
 * (503) if every guard slot is taken. On failure *out is closed (safe to pass to close). */
int rs_shm_open_segment(const char *name, rs_shm_segment *out, rs_error *err);
/* Unregisters, unmaps and closes (a kept mapping: unregisters only); callable on a zeroed or
 * already closed segment. */
void rs_shm_close_segment(rs_shm_segment *seg);

/* After every read of the mapping (and before anything read from it is committed): RS_EINVAL
 * (400, param "shm_name") if the segment shrank meanwhile, seen either as a read the guard had to
 * serve zeros or as a size (fstat) below the one mapped. `name` is for the message. */
int rs_shm_check_intact(const rs_shm_segment *seg, const char *name, rs_error *err);

/* Every tensor of the manifest lies inside a segment of `size` bytes; RS_EINVAL naming
 * "tensors[i].offset" otherwise. */
int rs_shm_check_manifest(const rs_shm_update_req *r, size_t size, rs_error *err);

/* The job (sync service thread): join or open the transaction, check the manifest, map, stage,
 * check intact, unmap, commit if last. */
int rs_shm_update(rs_sync *s, const rs_shm_update_req *r, rs_sync_result *res, rs_error *err);

/* Tests only: when non-NULL, rs_shm_update calls it on the service thread once the segment is
 * open, mapped and its manifest checked, before the first tensor is read; a test truncates the
 * segment there to reproduce a trainer that shrinks it mid-request, deterministically. NULL in the
 * daemon. */
extern void (*rs_shm_test_hook_mapped)(const char *shm_name);

#endif /* RS_SYNC_SHM_H */
