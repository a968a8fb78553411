"""Weight push over POSIX shared memory (POST /update_weights_from_shm, API.md "Weight updates").

The client creates segments with shm_open(O_CREAT | O_EXCL | O_RDWR, 0600), as Python's
multiprocessing.shared_memory does (only the owner can map them), packs tensors into buckets at
256-byte aligned offsets, and POSTs one bucket at a time: {"shm_name", "tensors": [{"name", "dtype", "shape",
"offset"}], "is_last", "weight_version"}. The server has read a bucket when its POST returns, so the
segment can be refilled.

Double buffering: two segments (each the size of the fullest bucket, <= bucket_bytes); bucket i+1 is packed (and, with fp8=True, quantized)
into one while the server is still reading bucket i out of the other. POSTs never overlap.

A tensor larger than bucket_bytes is sent alone in its own segment, sized to it and unlinked right
after its POST (peak extra memory: 2 x bucket_bytes + the largest tensor). Every segment is unlinked
at the end, also when a POST fails or packing raises.

Segments are mapped with MAP_POPULATE. Allocating tmpfs pages is the expensive part of a push (the
kernel zeroes them: ~1.5 GB/s on a small VM, against >10 GB/s for the copy itself), so by default
(keep_segments=True) the two bucket segments, and a third for tensors larger than a bucket, stay
allocated between pushes (owned by the Client; unlinked by
Client.close(), on any error, and at interpreter exit). rolloutd keeps its mappings of segments that
stay (weight-shm-keep), so a reused segment costs neither side a page fault or an mmap.
"""
import concurrent.futures as cf
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


def _unlink(name, fd_mmap):
    fd, mm = fd_mmap
    try:
        mm.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with the process
        pass
    os.close(fd)
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(name, "shared_memory")
    except Exception:  # noqa: BLE001
        pass


class Segment:
    """An owned POSIX shm segment: shm_open(O_CREAT | O_EXCL | O_RDWR, 0600), sized, mapped
    MAP_SHARED | MAP_POPULATE. `name` is what the server opens ("/rolloutd-w-..."). Registered with
    multiprocessing's resource tracker, so it is unlinked even if this process dies."""

    def __init__(self, size):
        size = max(int(size), 1)
        self.name = f"/rolloutd-w-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        fd = _posixshmem.shm_open(self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink(self.name)
            raise
        try:
            from multiprocessing import resource_tracker
            resource_tracker.register(self.name, "shared_memory")
        except Exception:  # noqa: BLE001 -- cleanup on crash is a bonus
            pass
        self.size = size
        self.buf = memoryview(mm)
        self._fin = weakref.finalize(self, _unlink, self.name, (fd, mm))

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
        while len(keep) < n:
            keep.append(Segment(size))
        self.segs = keep
        return list(keep)

    def close(self):
        for s in self.segs:
            s.close()
        self.segs = []
        if self.big is not None:
            self.big.close()
            self.big = None


def push_shm(client, entries, version, bucket_bytes, timeout=None, pool=None):
    """Returns (final response, bytes, seconds, posts, server_seconds). pool: a SegmentPool whose
    segments are used and kept (unlinked here only on error)."""
    if _posixshmem is None:
        raise RuntimeError("POSIX shared memory is not available on this platform (no _posixshmem)")
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    buckets = plan_buckets(entries, bucket_bytes)
    t0 = time.perf_counter()
    segs, extra = [], []
    executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutd-shm-post")
    inflight = None   # (future, segment to free when done or None, segment it reads)
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

    try:
        n_shared = min(2, sum(1 for b in buckets if not b[2]))
        size = max((b[1] for b in buckets if not b[2]), default=1)  # <= bucket_bytes
        if pool is not None:
            segs = pool.take(n_shared, size) if n_shared else []
        else:
            segs = [Segment(size) for _ in range(n_shared)]
        slot = 0
        for i, (items, used, own) in enumerate(buckets):
            if own and pool is not None:
                seg = pool.take_big(max(b[1] for b in buckets if b[2]))
                own = False  # kept, not freed after its POST
            elif own:
                seg = Segment(used)
                extra.append(seg)
            else:
                seg = segs[slot % len(segs)]
                slot += 1
            # Pack while the previous bucket's POST is in flight (it reads another segment; the
            # one before it, which may have used this segment, has returned). Two large tensors in a
            # row share the kept big segment: wait for the first before packing the second.
            if inflight is not None and inflight[2] is seg:
                wait_inflight()
            for e, off in items:
                e.write_into(seg.buf[off:off + e.nbytes])
                total += e.nbytes
            body = {"shm_name": seg.name, "tensors": [e.meta(off) for e, off in items],
                    "is_last": i == len(buckets) - 1, "weight_version": str(version)}
            wait_inflight()
            fut = executor.submit(client.update_weights_from_shm_body, body, timeout)
            inflight = (fut, seg if own else None, seg)
            if own:
                extra.remove(seg)
        wait_inflight()
        ok = True
    except BaseException:
        ok = False
        raise
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
            executor.shutdown(wait=True)
            for s in extra:
                s.close()
            if pool is None:
                for s in segs:
                    s.close()
            elif not ok:
                pool.close()
    return final, total, time.perf_counter() - t0, len(buckets), server_s
