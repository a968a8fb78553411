"""Weight push over POSIX shared memory (POST /update_weights_from_shm, docs/api.md "Weight updates").

The client creates segments with shm_open(O_CREAT | O_EXCL | O_RDWR, 0600), as Python's
multiprocessing.shared_memory does (only the owner can map them), packs tensors into buckets at
256-byte aligned offsets, and POSTs one bucket at a time: {"shm_name", "tensors": [{"name", "dtype", "shape",
"offset", "crc32c"}], "is_last", "weight_version"} (crc32c: the CRC-32C of the bytes written, which
rolloutd checks in the pass that reads them; checksums=False leaves it out), every bucket after the
first with the "transaction_id" the
first one's answer gave, so that a bucket can only ever join this push's update (a 409 otherwise).
The server has read a bucket when its POST returns, so the segment can be refilled.

Double buffering: two segments (each the size of the fullest bucket, <= bucket_bytes); bucket i+1 is packed (and, with fp8=True, quantized)
into one while the server is still reading bucket i out of the other. POSTs never overlap.

A tensor larger than bucket_bytes is sent alone in its own segment, sized to it and unlinked right
after its POST (peak extra memory: 2 x bucket_bytes + the largest tensor). Every segment is unlinked
at the end, also when a POST fails or packing raises.

Segments are reserved with posix_fallocate before they are mapped: on tmpfs, ftruncate only makes a
sparse file and MAP_POPULATE ignores pages it cannot get, so a /dev/shm smaller than a bucket (Docker's
default is 64 MiB) would otherwise kill the trainer with SIGBUS at the first write past what fits;
reserved, it is an OSError (ENOSPC) naming /dev/shm, and the segment is unlinked.

A push that fails after a bucket reached the server (an exception while packing, Ctrl-C, a POST
timeout) leaves the server's update transaction open, which would refuse the next version (409) until
weight-update-timeout. Once the last POST has returned, push_shm ends it with abort_update: a bucket
with is_last false and no tensors, tied to the update by its transaction_id, that names a segment no
process creates; the server answers 400 (the segment does not exist) and drops the whole update. It
can never commit anything, also when every parameter had already been staged (a state_dict whose last
tensor, a tied lm_head, failed to pack): a last bucket with no tensors would have committed that set.
A bucket the server itself refused (400, 409) needs none: that already dropped it.

Segments are mapped with MAP_POPULATE. Allocating tmpfs pages is the expensive part of a push (the
kernel zeroes them: ~1.5 GB/s on a small VM, against >10 GB/s for the copy itself), so by default
(keep_segments=True) the two bucket segments, and a third for tensors larger than a bucket, stay
allocated between pushes (owned by the Client; unlinked by
Client.close(), on any error, and at interpreter exit). rolloutd keeps its mappings of segments that
stay (weight-shm-keep), so a reused segment costs neither side a page fault or an mmap.
"""
import concurrent.futures as cf
import errno
import itertools
import mmap
import os
import secrets
import time
import weakref

try:
    import _posixshmem  # what multiprocessing.shared_memory uses: shm_open / shm_unlink
except ImportError:  # pragma: no cover
    _posixshmem = None

ALIGN = 256
_counter = itertools.count()


def _align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(entries, bucket_bytes):
    """[(entries_with_offsets [(entry, offset)], size, own_segment)] in order; greedy, never reorders."""
    buckets, cur, used = [], [], 0
    for e in entries:
        if e.nbytes > bucket_bytes:
            if cur:
                buckets.append((cur, used, False))
                cur, used = [], 0
            buckets.append(([(e, 0)], e.nbytes, True))
            continue
        off = _align(used)
        if off + e.nbytes > bucket_bytes:
            buckets.append((cur, used, False))
            cur, off = [], 0
        cur.append((e, off))
        used = off + e.nbytes
    if cur or not buckets:
        buckets.append((cur, used, False))
    return buckets


def _unlink(name, state):
    """Finalizer of a Segment. state: {"fd", "mm", "pid" (the creator), "registered"}. A forked child
    inherits the finalizer (it runs at the child's exit): there it only drops the child's copies of
    the fd and the mapping, never the parent's segment."""
    try:
        state["mm"].close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with the process
        pass
    os.close(state["fd"])
    if os.getpid() != state["pid"]:
        return
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass
    if state["registered"]:
        try:
            from multiprocessing import resource_tracker
            resource_tracker.unregister(name, "shared_memory")
        except Exception:  # noqa: BLE001
            pass


_NO_RESERVE = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def _reserve(fd, size, name):
    """Allocates the segment's pages now (posix_fallocate), so that a full /dev/shm is an OSError
    here, not a SIGBUS at the first write into a page tmpfs cannot supply. Where the platform or
    filesystem cannot reserve (no posix_fallocate, EOPNOTSUPP), the segment stays as ftruncate left
    it, as before."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:
        return
    try:
        fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in _NO_RESERVE:
            return
        if e.errno != errno.ENOSPC:
            raise
        try:
            st = os.statvfs("/dev/shm")
            free = f"{st.f_bavail * st.f_frsize} of {st.f_blocks * st.f_frsize} bytes free"
        except OSError:
            free = "size unknown"
        raise OSError(errno.ENOSPC,
                      f"No space left on device: cannot reserve {size} bytes for shared-memory segment "
                      f"{name} in /dev/shm ({free}); enlarge /dev/shm (docker run --shm-size, a memory-"
                      f"backed emptyDir on Kubernetes) or push with a smaller bucket_bytes") from e


class Segment:
    """An owned POSIX shm segment: shm_open(O_CREAT | O_EXCL | O_RDWR, 0600), sized, reserved
    (posix_fallocate: OSError ENOSPC when /dev/shm is full), mapped MAP_SHARED | MAP_POPULATE.
    `name` is what the server opens ("/rolloutd-w-..."). Registered with multiprocessing's resource
    tracker, so it is unlinked even if this process dies; unlinked only by the process that made it
    (not by a forked child's exit)."""

    def __init__(self, size):
        size = max(int(size), 1)
        self.name = f"/rolloutd-w-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        self.size = size
        self.buf = None
        fd = _posixshmem.shm_open(self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            _reserve(fd, size, self.name)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink(self.name)
            raise
        # The finalizer before anything else can raise (a Ctrl-C in the tracker registration below
        # would otherwise leave a segment nobody unlinks).
        state = {"fd": fd, "mm": mm, "pid": os.getpid(), "registered": False}
        self._fin = weakref.finalize(self, _unlink, self.name, state)
        self.buf = memoryview(mm)
        try:
            from multiprocessing import resource_tracker
            resource_tracker.register(self.name, "shared_memory")
            state["registered"] = True
        except Exception:  # noqa: BLE001 -- cleanup on crash is a bonus
            pass

    def close(self):
        """Unmap and unlink (idempotent)."""
        if self.buf is not None:
            try:
                self.buf.release()
            except BufferError:
                pass
            self.buf = None
        self._fin()


class SegmentPool:
    """The segments a Client keeps between pushes with keep_segments=True: two for buckets, one for
    tensors larger than a bucket."""

    def __init__(self):
        self.segs = []
        self.big = None

    def take_big(self, size):
        """The segment for a tensor larger than a bucket: kept if big enough, else replaced."""
        if self.big is None or self.big.size < size:
            if self.big is not None:
                self.big.close()
                self.big = None
            self.big = Segment(size)
        return self.big

    def take(self, n, size):
        """n segments of at least `size` bytes (reused when big enough, else replaced)."""
        keep = [s for s in self.segs if s.size >= size][:n]
        for s in self.segs:
            if s not in keep:
                s.close()
        self.segs = keep  # new ones join at once: if the next cannot be made, close() frees them
        while len(keep) < n:
            keep.append(Segment(size))
        return list(keep)

    def close(self):
        for s in self.segs:
            s.close()
        self.segs = []
        if self.big is not None:
            self.big.close()
            self.big = None


def _refused(exc):
    """True for the server's refusal of a bucket (400, 409): it dropped the update itself, or never
    opened one for this version."""
    from .client import RolloutdError
    return isinstance(exc, RolloutdError) and exc.status in (400, 409)


def _update_left_open(futures, n_buckets):
    """Whether the POSTs `futures` (every one sent, in order, all returned) of a failed push of
    n_buckets may have left the server's update open: something was sent, the last bucket did not
    commit, and no bucket was refused."""
    if not futures:
        return False
    done = [f for f in futures if f.done() and not f.cancelled()]
    if len(futures) == n_buckets and futures[-1] in done and futures[-1].exception() is None:
        return False
    return not any(_refused(f.exception()) for f in done)


def drop_segment_name():
    """A shared-memory name no process creates (Segment names carry a counter where this has
    "drop"): a bucket naming it always fails to open on the server, whatever host that is."""
    return f"/rolloutd-w-{os.getpid()}-drop-{secrets.token_hex(8)}"


def drop_body(version, transaction_id=None):
    """The body abort_update sends: is_last false, no tensors, a segment that does not exist."""
    body = {"shm_name": drop_segment_name(), "tensors": [], "is_last": False, "weight_version": str(version)}
    if transaction_id:
        body["transaction_id"] = transaction_id
    return body


def abort_update(client, version, timeout=None, transaction_id=None):
    """Best effort: make the server drop its open update to `version` (after a push failed on this
    side) without ever committing it. POSTs drop_body(version, transaction_id): the bucket joins the
    open update that transaction_id names (without one: the open update to `version`), the segment it
    names cannot be opened, and a bucket that joined an update and fails drops that update whole; the
    server answers 400 ("shared-memory segment ... does not exist") and keeps serving the weights it
    had. is_last is false, so nothing commits even when every parameter was already staged. Another
    writer's update (another transaction_id or version) is refused with 409 and left alone, as is a
    transaction_id that is no longer open (409). Without a transaction_id and nothing open, the
    server opens an update for `version` and drops it at once. Never raises for the server's answer
    or a transport error; returns the answer, or the exception."""
    try:
        return client.update_weights_from_shm_body(drop_body(version, transaction_id), timeout)
    except Exception as e:  # noqa: BLE001 -- 400 is the expected answer
        return e


def _crc32c():
    try:
        import crc32c
    except ImportError as e:  # pragma: no cover -- a declared dependency
        raise ImportError("push_weights(checksums=True) needs the crc32c package (pip install crc32c, or Debian's "
                          "python3-crc32c); pass checksums=False to push without them") from e
    return crc32c.crc32c


def open_shared_segments(segs, buckets, pool):
    """Fills segs (a list, in place, so that a caller's cleanup frees those made before a failure)
    with the at most two segments the buckets within bucket_bytes alternate between: the pool's
    (kept) or new ones sized for the largest of those buckets."""
    n_shared = min(2, sum(1 for b in buckets if not b[2]))
    size = max((b[1] for b in buckets if not b[2]), default=1)  # <= bucket_bytes
    if pool is not None:
        segs.extend(pool.take(n_shared, size) if n_shared else [])
    else:
        for _ in range(n_shared):
            segs.append(Segment(size))  # one by one: those made are freed if the next fails


def bucket_segment(bucket, buckets, segs, slot, pool, extra):
    """Where bucket (items, used, own) of buckets is packed: (segment, whether it is freed once its
    POSTs return, the next slot). A bucket within bucket_bytes takes the next shared segment; a
    tensor larger than that takes the pool's kept big segment, or a new one of its own (added to
    extra, which the caller frees on failure)."""
    _, used, own = bucket
    if own and pool is not None:
        return pool.take_big(max(b[1] for b in buckets if b[2])), False, slot
    if own:
        seg = Segment(used)
        extra.append(seg)
        return seg, True, slot
    return segs[slot % len(segs)], False, slot + 1


def pack_bucket(seg, items, crc):
    """Writes a bucket's tensors into seg at their offsets. Returns (manifest entries, bytes
    written); crc: the CRC-32C function whose value each entry carries as "crc32c", or None."""
    metas, nbytes = [], 0
    for e, off in items:
        view = seg.buf[off:off + e.nbytes]
        e.write_into(view)
        metas.append(e.meta(off) if crc is None else dict(e.meta(off), crc32c=crc(view)))
        view.release()
        nbytes += e.nbytes
    return metas, nbytes


def push_shm(client, entries, version, bucket_bytes, timeout=None, pool=None, checksums=True):
    """Returns (final response, bytes, seconds, posts, server_seconds). pool: a SegmentPool whose
    segments are used and kept (unlinked here only on error). checksums: each tensor's manifest
    entry carries the CRC-32C of the bytes written into the segment ("crc32c"), which rolloutd
    checks as it reads them: a segment that changes under the read (the trainer writing the next
    bucket into it, a truncation) is refused with 400 instead of committed. On any failure after a
    bucket was sent, the server's update is ended (abort_update) before the exception propagates."""
    crc = _crc32c() if checksums else None
    if _posixshmem is None:
        raise RuntimeError("POSIX shared memory is not available on this platform (no _posixshmem)")
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    buckets = plan_buckets(entries, bucket_bytes)
    t0 = time.perf_counter()
    segs, extra = [], []
    executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutd-shm-post")
    inflight = None   # (future, segment to free when done or None, segment it reads)
    futures = []      # every POST, in order
    final, total, server_s = None, 0, 0.0

    def wait_inflight():
        nonlocal inflight, final, server_s
        if inflight is None:
            return
        fut, tmp, _ = inflight
        inflight = None
        try:
            final = fut.result()
        finally:
            if tmp is not None:
                tmp.close()
        server_s += float(final.get("seconds") or 0.0)

    ok = False
    try:
        open_shared_segments(segs, buckets, pool)
        slot = 0
        for i, bucket in enumerate(buckets):
            seg, own, slot = bucket_segment(bucket, buckets, segs, slot, pool, extra)
            # Pack while the previous bucket's POST is in flight (it reads another segment; the
            # one before it, which may have used this segment, has returned). Two large tensors in a
            # row share the kept big segment: wait for the first before packing the second.
            if inflight is not None and inflight[2] is seg:
                wait_inflight()
            metas, nbytes = pack_bucket(seg, bucket[0], crc)
            total += nbytes
            body = {"shm_name": seg.name, "tensors": metas, "is_last": i == len(buckets) - 1,
                    "weight_version": str(version)}
            wait_inflight()
            if final is not None and final.get("transaction_id"):  # ties this bucket to the first one's update
                body["transaction_id"] = final["transaction_id"]
            fut = executor.submit(client.update_weights_from_shm_body, body, timeout)
            futures.append(fut)
            inflight = (fut, seg if own else None, seg)
            if own:
                extra.remove(seg)
        wait_inflight()
        ok = True
    finally:
        try:
            if inflight is not None:  # a packing error: let the POST finish before unmapping
                try:
                    inflight[0].result()
                except Exception:  # noqa: BLE001 -- the packing error is the one to raise
                    pass
                if inflight[1] is not None:
                    inflight[1].close()
        finally:
            executor.shutdown(wait=True)  # every POST has returned
            try:
                if not ok and _update_left_open(futures, len(buckets)):
                    abort_update(client, version, timeout if timeout is not None else getattr(client, "timeout", None),
                                 final.get("transaction_id") if isinstance(final, dict) else None)
            finally:
                for s in extra:
                    s.close()
                if pool is None:
                    for s in segs:
                        s.close()
                elif not ok:
                    pool.close()
    return final, total, time.perf_counter() - t0, len(buckets), server_s
