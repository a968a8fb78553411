/*
 * shm_guard.h — survive a shared-memory segment that shrinks under a read-only mapping.
 *
 * rolloutd maps the trainer's segment (shm.h), or a checkpoint shard (disk.h), and converts
 * tensors straight out of the mapping, on the sync thread and on its quantization pool's workers.
 * If the trainer truncates the file meanwhile, a load from a page past the new end raises SIGBUS,
 * whose default action kills the daemon. The guard works for any read-only file mapping, and turns
 * that into a failed request:
 *
 *   - a process-wide SIGBUS handler, installed on the first rs_shm_guard_add, looks the faulting
 *     address up in a small lock-free registry of guarded mappings;
 *   - if it lies in one, it replaces the mapping from the faulting page to its end with anonymous
 *     zero pages, marks the mapping truncated and returns: the faulting load restarts and reads
 *     zeros, on whichever thread it ran (no longjmp, nothing to unwind);
 *   - the owner then asks rs_shm_guard_truncated before it commits what it read, and drops it.
 *
 * A SIGBUS anywhere else (a genuine bug, a kill -BUS) goes to the handler that was installed before
 * the guard (ASan's, say), or gets the default action: the process still dies of it.
 *
 * Bytes between the new end and the end of its page raise nothing (the kernel serves them as
 * zeros), so a shrink that stays inside the last page never reaches the handler. Owners that keep
 * the descriptor therefore also compare its size (fstat) with the size they mapped (shm.c does).
 *
 * Threads: add and remove from any thread; a slot is owned by whoever added it. The owner must not
 * remove a slot while another thread may still read the mapping, and must remove it before munmap
 * (a fault in an unmapped range is not the guard's to repair).
 */
#ifndef RS_SYNC_SHM_GUARD_H
#define RS_SYNC_SHM_GUARD_H

#include <stdbool.h>
#include <stddef.h>

/* Mappings guarded at once: the sync thread guards one segment per shm request, or one shard at a
 * time of a disk request; the rest is margin. */
#define RS_SHM_GUARD_SLOTS 8

/* Registers the mapping [base, base + size) (borrowed: a PROT_READ mapping the caller made and
 * keeps until rs_shm_guard_remove) and installs the SIGBUS handler on first use. Returns the slot
 * (>= 0), or RS_EBUSY when every slot is in use. */
int rs_shm_guard_add(const void *base, size_t size);

/* True once a read of the slot's mapping faulted past the segment's end and was served zeros. */
bool rs_shm_guard_truncated(int slot);

/* Forgets the slot (negative: no-op). */
void rs_shm_guard_remove(int slot);

#endif /* RS_SYNC_SHM_GUARD_H */
