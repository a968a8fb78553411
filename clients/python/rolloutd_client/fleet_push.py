"""One weight update pushed to every daemon of a fleet, committed on all of them or on none.

rolloutd runs each update as a transaction (docs/api.md "How an update behaves"): every bucket is
validated and converted as it arrives, a bucket with is_last false only stages, and the one with
is_last true commits the whole set at a step boundary. A fleet push runs one such transaction on
every daemon at once, in three stages:

  1. stage: every bucket, with is_last false, goes to every daemon. Over shm the bucket is written
     once into a segment and all daemons read that segment concurrently (one POST each, in
     parallel); the segment is refilled only after every daemon has answered. Over NCCL the
     bucket's request goes to every daemon and one broadcast reaches them all. Each daemon names
     its own transaction in its first answer (transaction_id); its later buckets carry it.
  2. check: each daemon's last answer says how many of the model's parameters it has staged ("N of
     M parameters"). Over shm every daemon must have all of them; over NCCL, which needs at least
     one tensor in the committing request, all daemons must lack the same one (the commit carrier,
     below) and nothing else.
  3. commit: every daemon gets the committing request in parallel: over shm a bucket with no tensors
     and is_last true (naming a segment the daemon already has mapped); over NCCL a request with is_last
     true that carries one small tensor (a 1-D norm weight, held back from stage 1 for this). Every
     tensor but that one has been validated and converted by then.

If anything fails in stages 1-2 (a daemon answers 4xx/5xx, a POST times out or cannot connect, the
check finds a daemon short of parameters, the trainer's side raises while packing), no daemon has
committed, and every daemon's open update is dropped: a bucket tied to it by its transaction_id that
names a segment which does not exist (shm.abort_update; is_last false, so it can never commit). A
daemon whose bucket was refused has dropped its update already (a 409 means the bucket never joined
it); one that cannot be reached keeps its update open until --weight-update-timeout drops it. Every
daemon then serves the weights it served before. FleetPushError lists each daemon's answer, the fate
of its update and the version it now reports; an exception raised while packing propagates itself,
after the drops.

The commit cannot be rolled back. It fails on one daemon and succeeds on another only when that
daemon dies or stalls past the POST timeout during it, or its transaction expired
(--weight-update-timeout) between its last bucket and the commit, or its commit itself refuses:
KV-cache scales calibrated from the new weights come out non-finite on one daemon's configuration
(--kv-cache-dtype fp8 with calibrate), or, over NCCL, the one carrier tensor is refused. Then the
daemons that committed serve the new version, and FleetPushError(stage "commit") says which daemon
serves which version; pushing the same state_dict again brings them all to it.
"""
import concurrent.futures as cf
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict

from . import shm as _shm

_STAGED = re.compile(r"\b(\d+) of (\d+) parameters\b")


def staged_counts(answer):
    """(staged, required) from a rolloutd bucket answer ("staged; 5 of 90 parameters of version ...
    received"), or None when the answer does not say (a server other than rolloutd)."""
    msg = answer.get("message") if isinstance(answer, dict) else None
    m = _STAGED.search(msg) if isinstance(msg, str) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


class FleetPushError(RuntimeError):
    """A fleet push that did not commit everywhere.

    stage: "stage" (a bucket was refused or lost), "check" (a daemon would not have committed) or
    "commit" (the commit failed on some daemons). committed: URLs that serve `version` now (empty
    unless stage is "commit"). outcomes: URL -> what happened there, in words. errors: URL -> the
    exception that daemon raised (RolloutdError, a requests exception). versions: URL -> the
    weight_version it reports after the push (None when it did not answer)."""

    def __init__(self, message, stage, version, committed=(), outcomes=None, errors=None, versions=None):
        super().__init__(message)
        self.stage, self.version, self.committed = stage, version, list(committed)
        self.outcomes, self.errors, self.versions = dict(outcomes or {}), dict(errors or {}), dict(versions or {})

    def __reduce__(self):  # survives pickle (Ray, multiprocessing)
        return type(self), (str(self), self.stage, self.version, self.committed, self.outcomes, self.errors,
                            self.versions)


@dataclass
class FleetPushResult:
    """A fleet push that committed on every daemon: each daemon's committing answer, payload bytes
    (written once, whatever the number of daemons), wall seconds from the first pack to the last
    commit answer, GB/s (1e9 bytes/s), the number of request rounds (buckets plus the commit), and
    each daemon's own "seconds" summed over its requests."""
    responses: Dict[str, Dict[str, Any]]
    bytes: int
    seconds: float
    gb_per_s: float
    rounds: int
    server_seconds: Dict[str, float] = field(default_factory=dict)
    transport: str = "shm"

    @property
    def weight_version(self):
        versions = {r.get("weight_version") for r in self.responses.values()}
        return versions.pop() if len(versions) == 1 else None


class _Member:
    """One daemon's side of a fleet transaction."""
    __slots__ = ("client", "txn_id", "answer", "error", "buckets", "server_s")

    def __init__(self, client):
        self.client, self.txn_id, self.answer, self.error, self.buckets, self.server_s = client, None, None, None, 0, 0.0

    @property
    def url(self):
        return self.client.url


class _Failed(Exception):
    """Some daemon failed stage 1 ("stage") or the check ("check"); the message says how many."""

    def __init__(self, stage, message):
        super().__init__(message)
        self.stage = stage


def _refused(exc):
    return _shm._refused(exc)


def _describe(exc):
    return str(exc) if str(exc) else type(exc).__name__


def _commit_outcome(e):
    """What a failed commit request means for that daemon's update."""
    status = getattr(e, "status", None)
    if status is None:
        return f"no answer to the commit (it may have committed or not): {_describe(e)}"
    if status == 409:
        return f"its update was no longer open (expired or dropped), so nothing committed: {_describe(e)}"
    if status == 503:
        return (f"it did not run the commit (busy or draining): its update stays open until its "
                f"--weight-update-timeout drops it: {_describe(e)}")
    return f"it refused the commit, which drops its update: {_describe(e)}"


class FleetTxn:
    """The fleet transaction of one push: rounds of requests to every member, the check, the
    commit, and the drops and the report when it fails before the commit."""

    def __init__(self, clients, version, timeout, path):
        self.members = [_Member(c) for c in clients]
        self.version, self.timeout, self.path = str(version), timeout, path
        self.pool = cf.ThreadPoolExecutor(max_workers=len(self.members), thread_name_prefix="rolloutd-fleet-post")
        self.rounds = 0
        self.pending = None         # the futures of the round in flight, until all have returned
        self.committing = False     # stage 3 has begun: nothing may be dropped any more
        self.dropped = False

    def close(self, wait=True):
        self.pool.shutdown(wait=wait)

    def start(self, body):
        """Sends `body` to every member, each with its own transaction_id; returns the futures."""
        self.rounds += 1
        futures = []
        for m in self.members:
            b = dict(body, transaction_id=m.txn_id) if m.txn_id else body
            futures.append(self.pool.submit(m.client.post, self.path, b, self.timeout))
        self.pending = futures
        return futures

    def _collect(self, futures, wait_s=None):
        """(member, answer, error) for every future, waiting at most wait_s seconds in all (None:
        as long as the POSTs take; a future still running then counts as a TimeoutError)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        out = []
        for m, f in zip(self.members, futures):
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                out.append((m, f.result(timeout=left), None))
            except cf.TimeoutError:
                out.append((m, None, TimeoutError(f"no answer within {wait_s:.0f} s after the push failed")))
            except Exception as e:  # noqa: BLE001 -- recorded per daemon, reported together
                out.append((m, None, e))
        if futures is self.pending:
            self.pending = None
        return out

    def finish(self, futures, what, wait_s=None):
        """Waits for every future of a stage-1 round; records each member's answer or error; raises
        _Failed("stage") when any failed (after all have returned)."""
        for m, answer, err in self._collect(futures, wait_s):
            if err is not None:
                m.error = m.error or err
                continue
            m.answer = answer
            m.buckets += 1
            m.server_s += float(m.answer.get("seconds") or 0.0)
            if not m.txn_id and m.answer.get("transaction_id"):
                m.txn_id = m.answer["transaction_id"]
        bad = [m for m in self.members if m.error is not None]
        if bad:
            raise _Failed("stage", f"{len(bad)} of {len(self.members)} daemons failed {what}")

    def settle(self, wait_s=None):
        """After an exception on this side: lets the round in flight return (for at most wait_s
        seconds), recording what it did."""
        if self.pending is not None:
            try:
                self.finish(self.pending, "the last round", wait_s)
            except _Failed:
                pass

    def check(self, missing_allowed):
        """Stage 2. missing_allowed: how many parameters each daemon may still lack (0 over shm; over
        NCCL the carrier: at most 1, and the same number on every daemon)."""
        known = {m.url: staged_counts(m.answer) for m in self.members}
        gaps = {u: c[1] - c[0] for u, c in known.items() if c is not None}
        worst = max(gaps.values(), default=0)
        bad = {u for u, g in gaps.items() if g > missing_allowed or (missing_allowed and g != worst)}
        for m in self.members:
            if m.url in bad:
                s, r = known[m.url]
                m.error = _Failed("check", f"it staged {s} of its model's {r} parameters, so its commit would not "
                                           f"match the others' (a daemon serving a different model?)")
        if bad:
            raise _Failed("check", f"{len(bad)} of {len(self.members)} daemons would not commit the same update")

    def finish_commit(self, futures):
        """Stage 3's answers. Returns {url: answer} when every member committed; otherwise raises
        FleetPushError(stage "commit") saying which daemon serves which version."""
        committed, errors, outcomes = [], {}, {}
        for m, answer, e in self._collect(futures):
            if e is not None:
                errors[m.url] = e
                outcomes[m.url] = _commit_outcome(e)
                continue
            m.answer = answer
            m.server_s += float(m.answer.get("seconds") or 0.0)
            committed.append(m.url)
            outcomes[m.url] = f"committed '{m.answer.get('weight_version')}'"
        if not errors:
            return {m.url: m.answer for m in self.members}
        versions = self.versions()
        lines = [f"  {u} (serves {versions.get(u)!r}): {outcomes[u]}" for u in outcomes]
        raise FleetPushError(
            f"fleet push of version '{self.version}': the commit failed on {len(errors)} of {len(self.members)} "
            f"daemons and {len(committed)} committed; a commit cannot be undone: push again to bring every daemon "
            f"to one version:\n" + "\n".join(lines),
            "commit", self.version, committed, outcomes, errors, versions)

    def drop_all(self):
        """Before the commit only: drops every member's open update (shm.abort_update, which never
        commits); returns {url: what happened to its update}."""
        assert not self.committing
        self.dropped = True
        targets = [m for m in self.members if m.buckets or (m.error is not None and not _refused(m.error))]
        futures = {m.url: self.pool.submit(_shm.abort_update, m.client, self.version, self.timeout, m.txn_id)
                   for m in targets}
        fates = {}
        for m in self.members:
            if m.url not in futures:
                status = getattr(m.error, "status", None)
                fates[m.url] = ("nothing had been sent to it" if m.error is None else
                                "it refused the first bucket (409), which opened nothing" if status == 409 else
                                "its refusal of the first bucket dropped the update it opened")
                continue
            ans = futures[m.url].result()
            status = getattr(ans, "status", None)
            if status == 400:
                fates[m.url] = "its open update was dropped"
            elif status == 409:
                fates[m.url] = ("its refusal dropped its update" if _refused(m.error) else
                                "no update of this push was open there any more")
            elif isinstance(ans, Exception):
                fates[m.url] = (f"it could not be told to drop its update ({_describe(ans)}): an update left open "
                                f"expires after its --weight-update-timeout")
            else:  # a server that is not rolloutd accepted the bucket
                fates[m.url] = f"the drop was answered {ans!r}"
        return fates

    def versions(self):
        """{url: the weight_version each member reports now, or None}."""
        def get(m):
            try:
                return m.client.get("/get_weight_version", timeout=10).get("weight_version")
            except Exception:  # noqa: BLE001 -- reported as None
                return None
        futures = [self.pool.submit(get, m) for m in self.members]
        return {m.url: f.result() for m, f in zip(self.members, futures)}

    def failure(self, exc):
        """Drops every open update and returns the FleetPushError of a push that failed before
        its commit (exc: the _Failed)."""
        fates = self.drop_all()
        versions = self.versions()
        lines, errors = [], {}
        for m in self.members:
            said = f"{_describe(m.error)}; " if m.error is not None else ""
            if m.error is not None:
                errors[m.url] = m.error
            lines.append(f"  {m.url} (serves {versions.get(m.url)!r}): {said}{fates[m.url]}")
        return FleetPushError(
            f"fleet push of version '{self.version}' failed before its commit ({exc}); no daemon committed it, "
            f"each serves the weights it served:\n" + "\n".join(lines),
            exc.stage, self.version, (), fates, errors, versions)

    def abandon(self, wait_s=None):
        """After an exception on this side (packing, Ctrl-C): lets the round in flight return, then,
        before the commit, drops every open update (rolloutd runs weight requests in arrival order,
        so a drop sent while a POST is still running comes after it)."""
        self.settle(wait_s)
        if not self.committing and not self.dropped and self.rounds:
            self.drop_all()

    def result(self, responses, nbytes, t0, transport):
        secs = time.perf_counter() - t0
        return FleetPushResult(responses=responses, bytes=nbytes, seconds=secs,
                               gb_per_s=nbytes / secs / 1e9 if secs > 0 else math.inf, rounds=self.rounds,
                               server_seconds={m.url: m.server_s for m in self.members}, transport=transport)


# ------------------------------------------------------------------------------------------------ shm

def push_fleet_shm(clients, entries, version, bucket_bytes, timeout, pool, checksums=True):
    """Stages every bucket of `entries` on every client through one set of segments, checks, and
    commits (module docstring). pool: a shm.SegmentPool whose segments are used and kept (None: fresh
    segments, unlinked after the push). Returns FleetPushResult; raises FleetPushError, or an
    exception raised while packing (after dropping every open update)."""
    crc = _shm._crc32c() if checksums else None
    if _shm._posixshmem is None:
        raise RuntimeError("POSIX shared memory is not available on this platform (no _posixshmem)")
    if bucket_bytes < _shm.ALIGN:
        raise ValueError(f"bucket_bytes must be >= {_shm.ALIGN}, got {bucket_bytes}")
    buckets = _shm.plan_buckets(entries, bucket_bytes)
    t0 = time.perf_counter()
    txn = FleetTxn(clients, version, timeout, "/update_weights_from_shm")
    segs, extra, inflight, total, ok = [], [], None, 0, False

    def wait_round():
        nonlocal inflight
        futures, tmp, _, i = inflight
        try:
            txn.finish(futures, f"bucket {i + 1} of {len(buckets)}")
        finally:
            inflight = None
            if tmp is not None:
                tmp.close()

    try:
        _shm.open_shared_segments(segs, buckets, pool)
        try:
            slot = 0
            for i, bucket in enumerate(buckets):
                seg, own, slot = _shm.bucket_segment(bucket, buckets, segs, slot, pool, extra)
                # pack while the previous bucket is read out of the other segment; two large tensors in
                # a row share the kept big segment: the first must be read by every daemon before
                if inflight is not None and inflight[2] is seg:
                    wait_round()
                metas, nbytes = _shm.pack_bucket(seg, bucket[0], crc)
                total += nbytes
                if inflight is not None:
                    wait_round()
                body = {"shm_name": seg.name, "tensors": metas, "is_last": False, "weight_version": str(version)}
                inflight = (txn.start(body), seg if own else None, seg, i)
                if own:
                    extra.remove(seg)
            wait_round()
            txn.check(0)
        except _Failed as e:
            raise txn.failure(e) from None
        # Stage 3 names a segment every daemon has mapped already (kept: nothing new is mapped).
        alive = [s for s in segs + ([pool.big] if pool is not None and pool.big else []) if s.buf is not None]
        commit_seg = alive[0] if alive else _shm.Segment(_shm.ALIGN)
        try:
            txn.committing = True
            responses = txn.finish_commit(txn.start({"shm_name": commit_seg.name, "tensors": [], "is_last": True,
                                                     "weight_version": str(version)}))
        finally:
            if not alive:
                commit_seg.close()
        ok = True
        return txn.result(responses, total, t0, "shm")
    except BaseException:
        txn.abandon()  # the round in flight returns before its segment is unmapped
        if inflight is not None and inflight[1] is not None:
            inflight[1].close()
        raise
    finally:
        txn.close()
        for s in extra:
            s.close()
        if pool is None:
            for s in segs:
                s.close()
        elif not ok:
            pool.close()


# ------------------------------------------------------------------------------------------------ NCCL

_NOT_CARRIERS = ("_scale_inv", ".k_scale", ".v_scale", ".q_scale")


def commit_carrier(entries):
    """The index of the entry an NCCL fleet push holds back for its committing request (which must
    name at least one tensor): the smallest 1-D tensor that is a parameter on its own (not a scale
    of another, not lm_head.weight, which a tied model does not count, not FP8 codes), else the
    smallest such tensor of any rank, else the last entry."""
    def ok(e):
        return not e.name.endswith(_NOT_CARRIERS) and e.name != "lm_head.weight" and e.dtype != "float8_e4m3fn"
    cands = [i for i, e in enumerate(entries) if ok(e) and len(e.shape) == 1] or \
            [i for i, e in enumerate(entries) if ok(e)]
    if not cands:
        return len(entries) - 1
    return min(cands, key=lambda i: (entries[i].nbytes, -i))


def push_fleet_nccl(group, entries, version, bucket_bytes, timeout, flattened=True):
    """The NCCL form of push_fleet_shm over NcclGroup `group`, whose engines are the members: stage 1
    broadcasts every bucket but the commit carrier (commit_carrier) with is_last false; stage 3
    broadcasts the carrier alone with is_last true. A transport failure (NcclError) aborts the group
    (init a new one) and fails the push like a refusal; during the commit it is reported per daemon."""
    from . import nccl as _nccl
    torch = _nccl._torch()
    if not entries:
        raise ValueError("state_dict is empty")
    k = commit_carrier(entries)
    carrier, staged = entries[k], entries[:k] + entries[k + 1:]
    buckets = _nccl.plan_buckets(staged, int(bucket_bytes))
    op_timeout = group.timeout if timeout is None else float(timeout)
    dev = torch.device("cuda", group.device)
    t0 = time.perf_counter()
    txn = FleetTxn(group.clients, version, op_timeout + 60, "/update_weights_from_distributed")
    total = 0

    def broadcast(items, is_last):
        """One round: the request to every engine, then the bucket's broadcasts; returns its futures.
        A failed broadcast (NcclError, or a refusal seen before the broadcast completed: the group
        is aborted either way) is _Failed("stage") before the commit; during it, the answers say."""
        nonlocal total
        sends = _nccl.bucket_sends(torch, group, items, flattened, dev)
        futures = txn.start(_nccl.bucket_body(items, group.group_name, flattened, version, is_last))
        try:
            for s in sends:
                group.broadcast(s, futures, op_timeout)
        except Exception as e:  # noqa: BLE001 -- NcclError, or the refusal of a POST (RolloutdError, ...)
            if is_last:
                return futures
            txn.settle(_nccl._ABORT_WAIT_S)  # an engine still waiting for the broadcast answers late
            for m in txn.members:
                m.error = m.error or e
            raise _Failed("stage", f"a broadcast failed, so group '{group.group_name}' was aborted "
                                   f"(init a new one): {_describe(e)}") from None
        total += sum(e.nbytes for e in items)
        return futures

    try:
        with torch.cuda.device(group.device):
            group.stream.wait_stream(torch.cuda.current_stream(group.device))
            try:
                for i, items in enumerate(buckets):
                    txn.finish(broadcast(items, False), f"bucket {i + 1} of {len(buckets) + 1}")
                txn.check(1)
            except _Failed as e:
                raise txn.failure(e) from None
            txn.committing = True
            responses = txn.finish_commit(broadcast([carrier], True))
    except BaseException:
        txn.abandon(_nccl._ABORT_WAIT_S)
        raise
    finally:
        txn.close(wait=False)  # a POST an aborted group left waiting returns on its own
    return txn.result(responses, total, t0, "nccl")
