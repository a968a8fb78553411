"""Many rolloutd daemons as one: generation routed to the least-loaded daemon, one weight push to all.

    from rolloutd_client import Fleet
    fleet = Fleet(["http://127.0.0.1:30000", "http://127.0.0.1:30001", "http://127.0.0.1:30002"])
    outs = fleet.generate(prompts, n=8, max_new_tokens=512, temperature=1.0)   # spread over the fleet
    res = fleet.push_weights(model.state_dict(), version="18")   # every daemon serves "18", or none does

Data-parallel rollouts run one daemon per GPU, per tensor-parallel group or per CPU socket. A Fleet
holds one Client per daemon (Fleet.clients) and

  - routes generation: a call's prompts (each with its n samples, which stay on one daemon so that
    their shared prefill stays shared) go to the daemons with the least load, a batch split across
    them and reassembled in the order of the prompts. The load of a daemon is the number of
    sequences this Fleet has in flight there, plus what the daemon itself reports (others' work),
    read at most every load_poll_s seconds in the background: GET /get_load (SGLang's shape: a list
    of {"dp_rank", "num_reqs", "num_waiting_reqs", ...}, num_reqs being running plus waiting), or,
    where that route is missing (404), GET /metrics (sglang:num_running_reqs +
    sglang:num_queue_reqs, which rolloutd exports). With router_url, generation goes through that
    one URL instead (sglang-router, or any load balancer speaking /generate) and the Fleet routes
    nothing itself;
  - fails over: a daemon that cannot be reached (connection refused or reset, including one that
    dies while it runs a request) or answers 503 (starting, draining, queue full) is marked down for
    down_s seconds and the request goes to the next least-loaded daemon; a generation retried that way
    is computed again from its prompt (with a sampling_seed, the same tokens). Only when every daemon
    failed does generate raise FleetError, naming each one's error. A 4xx answer or a read timeout is
    raised at once (a bad request is bad everywhere; a slow daemon is not asked twice);
  - pushes weights to every daemon as one transaction (push_weights; fleet_push.py): over shm each
    bucket is written once and read by every daemon on this host; over NCCL one broadcast group
    holds them all (init_nccl_group). Every daemon commits the same version, or none does, except
    for the failures during the commit itself that fleet_push.py lists (FleetPushError says who
    serves what);
  - fans the control routes out to every daemon (health, weight_versions, flush_cache, pause,
    continue_generation, abort).

Thread-safe: generate may be called from many threads at once; one push runs at a time.
"""
import concurrent.futures as cf
import re
import threading
import time

import requests

from . import fleet_push as _fp
from . import shm as _shm
from . import tensors as _tensors
from .client import Client, RolloutdError, _prompts

_METRIC = re.compile(r"^(sglang:num_running_reqs|sglang:num_queue_reqs|vllm:num_requests_running|"
                     r"vllm:num_requests_waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


class FleetError(RuntimeError):
    """A fleet operation that failed on every daemon it tried (generate) or on some daemon (the
    fanned-out control routes). errors: URL -> the exception there."""

    def __init__(self, message, errors=None):
        super().__init__(message)
        self.errors = dict(errors or {})

    def __reduce__(self):
        return type(self), (str(self), self.errors)


def load_from_get_load(data):
    """Sequences running plus waiting from a /get_load answer: SGLang's list of per-DP-rank
    {"num_reqs", ...} (summed), one such object, or an older {"load": N}; None otherwise."""
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not data:
        return None
    total = 0.0
    for d in data:
        v = d.get("num_reqs", d.get("load")) if isinstance(d, dict) else None
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return None
        total += v
    return total


def load_from_metrics(text):
    """Sequences running plus waiting from Prometheus text: sglang:num_running_reqs +
    sglang:num_queue_reqs (or vLLM's num_requests_running + num_requests_waiting); None if absent."""
    vals = {}
    for name, v in _METRIC.findall(text or ""):
        vals[name] = vals.get(name, 0.0) + float(v)
    if "sglang:num_running_reqs" in vals:
        return vals["sglang:num_running_reqs"] + vals.get("sglang:num_queue_reqs", 0.0)
    if "vllm:num_requests_running" in vals:
        return vals["vllm:num_requests_running"] + vals.get("vllm:num_requests_waiting", 0.0)
    return None


def _failover(exc):
    """Whether a generate error means "try another daemon": no connection (refused, reset, the
    daemon gone mid-request; a connect timeout included) or 503."""
    if isinstance(exc, RolloutdError):
        return exc.status == 503
    return isinstance(exc, requests.ConnectionError)


class Fleet:
    """rolloutd daemons as one (module docstring).

        fleet = Fleet(urls)                       # route generation here, push to all
        fleet = Fleet(urls, router_url=router)    # generation through a router, pushes to urls

    urls: the daemons (a push reaches each of them, so each URL once). api_key, timeout: as for
    Client (every daemon). load_poll_s: how often the daemons' own load is read (0: count only this
    Fleet's requests). down_s: how long a daemon that failed a request is passed over (it is tried
    again earlier when every other one has failed too, and as soon as a load poll reaches it)."""

    def __init__(self, urls, api_key=None, timeout=600.0, router_url=None, load_poll_s=0.5, down_s=5.0):
        urls = [urls] if isinstance(urls, str) else list(urls)
        norm = [u.rstrip("/") for u in urls]
        if not norm:
            raise ValueError("a Fleet needs at least one daemon URL")
        dup = sorted({u for u in norm if norm.count(u) > 1})
        if dup:
            raise ValueError(f"daemon URLs given more than once (a push would reach them twice): {dup}")
        self.clients = [Client(u, api_key=api_key, timeout=timeout) for u in norm]
        self.router = Client(router_url, api_key=api_key, timeout=timeout) if router_url else None
        self.load_poll_s, self.down_s = float(load_poll_s), float(down_s)
        n = len(self.clients)
        self._lock = threading.Lock()
        self._inflight = [0] * n        # sequences this Fleet has running on each daemon
        self._reported = [None] * n     # (sequences the daemon reported, our in-flight then, monotonic time)
        self._down_until = [0.0] * n
        self._load_route = [None] * n   # "/get_load" or "/metrics", once known
        self._next = 0                  # round-robin start among equally loaded daemons
        self._polled_at = 0.0
        self._polling = False
        self._pool = cf.ThreadPoolExecutor(max_workers=max(8, 8 * n), thread_name_prefix="rolloutd-fleet")
        self._segments = _shm.SegmentPool()
        self._push_lock = threading.Lock()
        self._closed = False

    @property
    def urls(self):
        return [c.url for c in self.clients]

    def close(self):
        """Unlinks the kept shm segments and closes every HTTP session."""
        self._closed = True
        with self._push_lock:
            self._segments.close()
        self._pool.shutdown(wait=False)
        for c in self.clients + ([self.router] if self.router else []):
            c.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ load
    def loads(self):
        """The load estimate routing uses for each daemon: {url: sequences}."""
        with self._lock:
            now = time.monotonic()
            return {c.url: self._estimate(i, now) for i, c in enumerate(self.clients)}

    def _estimate(self, i, now):
        """(under _lock) This Fleet's sequences on daemon i, plus the others' work it last reported."""
        local, rep = self._inflight[i], self._reported[i]
        if rep is None or now - rep[2] > max(4 * self.load_poll_s, 2.0):
            return float(local)
        return max(float(local), rep[0] + local - rep[1])

    def _pick(self, weight, tried):
        """(under _lock) The daemon to send `weight` sequences to: the least loaded of those up and
        not in `tried`, else of those not in `tried`; ties go round-robin. Counts them in flight."""
        now = time.monotonic()
        n = len(self.clients)
        order = [(self._next + k) % n for k in range(n)]
        cands = [i for i in order if i not in tried and self._down_until[i] <= now] or \
                [i for i in order if i not in tried]
        if not cands:
            return None
        i = min(cands, key=lambda j: self._estimate(j, now))  # min keeps the first of equals
        self._next = (i + 1) % n
        self._inflight[i] += weight
        return i

    def _maybe_poll(self):
        """(under _lock) Starts a background read of every daemon's load if the last is stale."""
        if self.load_poll_s <= 0 or self._polling or self._closed:
            return
        if time.monotonic() - self._polled_at < self.load_poll_s:
            return
        self._polling = True
        try:
            self._pool.submit(self._poll)
        except RuntimeError:  # closed meanwhile
            self._polling = False

    def _poll(self):
        try:
            for i, c in enumerate(self.clients):
                try:
                    load = self._read_load(i, c)
                except (requests.RequestException, ValueError):
                    with self._lock:
                        self._down_until[i] = time.monotonic() + self.down_s
                    continue
                with self._lock:
                    self._down_until[i] = 0.0
                    self._reported[i] = None if load is None else (load, self._inflight[i], time.monotonic())
        finally:
            with self._lock:
                self._polling = False
                self._polled_at = time.monotonic()

    def _read_load(self, i, c):
        """Daemon i's own count of sequences running plus waiting (None if it reports none)."""
        timeout = min(2.0, c.timeout)
        if self._load_route[i] != "/metrics":
            r = c.session.get(c.url + "/get_load", headers=c.headers, timeout=timeout)
            if r.status_code == 200:
                self._load_route[i] = "/get_load"
                return load_from_get_load(r.json())
            if r.status_code not in (404, 405):
                raise ValueError(f"/get_load answered {r.status_code}")
            self._load_route[i] = "/metrics"
        r = c.session.get(c.url + "/metrics", headers=c.headers, timeout=timeout)
        if r.status_code != 200:
            raise ValueError(f"/metrics answered {r.status_code}")
        return load_from_metrics(r.text)

    # ------------------------------------------------------------ generation
    def generate(self, input_ids, n=1, rid=None, extra=None, split=None, **kw):
        """Client.generate across the fleet (same arguments and results, in the same order:
        prompt-major, then sample). Each result's `server` is the URL that produced it.

        A batch is split by prompt across the least-loaded daemons (each prompt with its n samples
        on one daemon) when split is True; by default it is split unless `extra` is given or `rid`
        is a single string (a field of `extra` may be per prompt, so such a batch goes whole to one
        daemon); a list `rid` is split with the prompts. With router_url everything goes to the
        router. Raises FleetError when every daemon failed to take (part of) it (module docstring)."""
        if self.router is not None:
            return self.router.generate(input_ids, n=n, rid=rid, extra=extra, **kw)
        prompts = _prompts(input_ids)
        batch = bool(prompts) and isinstance(prompts[0], list)
        if split is None:
            split = extra is None and (rid is None or isinstance(rid, (list, tuple)))
        if batch and isinstance(rid, (list, tuple)) and len(rid) != len(prompts):
            raise ValueError(f"rid has {len(rid)} entries for {len(prompts)} prompts")
        if not batch or not split or len(self.clients) == 1:
            groups = [(list(range(len(prompts))) if batch else None, None)]
        else:
            groups = self._assign(len(prompts), n)
        parts = []
        for idx, server in groups:
            if idx is None:
                sub_ids, sub_rid = prompts, rid
            else:
                sub_ids = [prompts[k] for k in idx]
                sub_rid = [rid[k] for k in idx] if isinstance(rid, (list, tuple)) else rid
            weight = n * (len(sub_ids) if batch else 1)
            parts.append((idx, server, dict(kw, input_ids=sub_ids, n=n, rid=sub_rid, extra=extra), weight))
        futures = [self._pool.submit(self._run, p[1], p[2], p[3]) for p in parts[1:]]
        results = [self._run(parts[0][1], parts[0][2], parts[0][3])]
        results += [f.result() for f in futures]
        if len(parts) == 1:  # the whole call on one daemon (its prompts in order)
            return results[0]
        out = [None] * len(prompts)
        for (idx, _, _, _), res in zip(parts, results):
            for k, p in enumerate(idx):
                out[p] = res[k * n:(k + 1) * n]
        return [r for group in out for r in group]

    def _assign(self, n_prompts, n):
        """[(prompt indices, daemon)]: each prompt (n sequences) to the least-loaded daemon, counted
        in flight at once so that the next prompt sees it. The counts are handed to _run."""
        by_server = {}
        with self._lock:
            self._maybe_poll()
            for p in range(n_prompts):
                i = self._pick(n, ())
                by_server.setdefault(i, []).append(p)
        return [(idx, i) for i, idx in by_server.items()]

    def _run(self, server, kwargs, weight):
        """Sends one sub-request to `server` (already counted in flight; None: pick one now),
        failing over as the module docstring says. Returns its results."""
        tried, errors = set(), {}
        if server is None:
            with self._lock:
                self._maybe_poll()
                server = self._pick(weight, tried)
        while True:
            c = self.clients[server]
            try:
                res = c.generate(**kwargs)
            except Exception as e:  # noqa: BLE001
                with self._lock:
                    self._inflight[server] -= weight
                    if not _failover(e):
                        raise
                    errors[c.url] = e
                    tried.add(server)
                    self._down_until[server] = time.monotonic() + self.down_s
                    server = self._pick(weight, tried)
                if server is None:
                    raise FleetError("no daemon of the fleet could take the request:\n" + "\n".join(
                        f"  {u}: {ex}" for u, ex in errors.items()), errors) from e
                continue
            except BaseException:  # Ctrl-C: the request is no longer ours to count
                with self._lock:
                    self._inflight[server] -= weight
                raise
            with self._lock:
                self._inflight[server] -= weight
            return res

    def score(self, input_ids, logprob_start_len=0, timeout=None):
        """Client.score across the fleet."""
        ids = _prompts(input_ids)
        batch = ids if ids and isinstance(ids[0], list) else [ids]
        res = self.generate(batch, max_new_tokens=0, logprob_start_len=logprob_start_len, timeout=timeout)
        return [r.input_logprobs for r in res]

    # ------------------------------------------------------------ fan-out
    def each(self, fn):
        """{url: fn(client)} for every daemon, run concurrently; an exception is kept as the value."""
        def call(c):
            try:
                return fn(c)
            except Exception as e:  # noqa: BLE001
                return e
        futures = [self._pool.submit(call, c) for c in self.clients]
        return {c.url: f.result() for c, f in zip(self.clients, futures)}

    def _all(self, what, fn):
        res = self.each(fn)
        errors = {u: v for u, v in res.items() if isinstance(v, Exception)}
        if errors:
            raise FleetError(f"{what} failed on {len(errors)} of {len(res)} daemons:\n" + "\n".join(
                f"  {u}: {e}" for u, e in errors.items()), errors)
        return res

    def health(self):
        """{url: True when GET /health answers 200}."""
        return {u: v is True for u, v in self.each(lambda c: c.health()).items()}

    def weight_versions(self):
        """{url: the weight_version it serves, or None when it does not answer}."""
        return {u: None if isinstance(v, Exception) else v for u, v in self.each(lambda c: c.get_weight_version()).items()}

    def flush_cache(self):
        return self._all("flush_cache", lambda c: c.flush_cache())

    def pause(self, mode="abort"):
        return self._all("pause_generation", lambda c: c.pause(mode))

    def continue_generation(self):
        return self._all("continue_generation", lambda c: c.continue_generation())

    def abort(self, rid=None):
        return self._all("abort_request", lambda c: c.abort(rid))

    # ------------------------------------------------------------ weights
    def push_weights(self, state_dict, version, transport="shm", bucket_bytes=512 << 20, fp8=False,
                     fp8_filter=None, timeout=None, keep_segments=True, checksums=True, group_name=None,
                     flattened=True):
        """Pushes a full model (every parameter, HF names) to every daemon as weight version
        `version`: all of them commit it, or none does (fleet_push.py has the three stages and
        exactly what can fail where).

        state_dict, bucket_bytes, fp8, fp8_filter, checksums, keep_segments: as for Client.push_weights.
        transport "shm" (every daemon on this host): each bucket is packed once into a segment that
        every daemon reads; the segments are this Fleet's, kept between pushes (keep_segments), so a
        steady push maps nothing new on either side. transport "nccl": through the group
        init_nccl_group made (group_name, default rolloutd_client.nccl.DEFAULT_GROUP); flattened as
        for push_weights_nccl. timeout: seconds each request may take (default: the Fleet's over shm,
        the group's over NCCL, where it also bounds each broadcast).
        Returns FleetPushResult; raises FleetPushError when the update did not commit everywhere
        (every daemon's answer and version in it), or an exception raised while packing, after
        every daemon's open update was dropped."""
        ents = _tensors.entries(state_dict, fp8=fp8, fp8_filter=fp8_filter)
        if transport == "nccl":
            from . import nccl as _nccl
            name = group_name or _nccl.DEFAULT_GROUP
            group = _nccl.get_group(name)
            if group is None or group.urls != self.urls:
                raise ValueError(f"no NCCL group {name!r} over this fleet's daemons; call init_nccl_group first")
            with self._push_lock:
                return _fp.push_fleet_nccl(group, ents, version, int(bucket_bytes), timeout, flattened)
        if transport != "shm":
            raise ValueError(f"transport must be 'shm' or 'nccl', got {transport!r}")
        if group_name is not None:
            raise TypeError("group_name is for transport='nccl'")
        timeout = self.clients[0].timeout if timeout is None else timeout
        with self._push_lock:
            return _fp.push_fleet_shm(self.clients, ents, version, int(bucket_bytes), timeout,
                                      self._segments if keep_segments else None, checksums=checksums)

    def nccl_ranks(self, ranks_per_server=None):
        """(rank_offsets, world_size) of a weight-update group over this fleet with the trainer as
        rank 0 (rolloutd_client.nccl.rank_layout). ranks_per_server: an int for all, a list, or None
        to take each server's tp_size from GET /get_server_info (1 for a rolloutd daemon; an SGLang
        server with tp_size N joins N ranks)."""
        from . import nccl as _nccl
        return _nccl.rank_layout(self._ranks(ranks_per_server))

    def _ranks(self, ranks_per_server):
        if ranks_per_server is None:
            return [int(c.get_server_info().get("tp_size") or 1) for c in self.clients]
        if isinstance(ranks_per_server, int):
            return [ranks_per_server] * len(self.clients)
        return list(ranks_per_server)

    def init_nccl_group(self, group_name=None, device=None, timeout=300.0, nccl_so=None, ranks_per_server=None,
                        master_address=None, master_port=29500):
        """One NCCL weight-update group over every daemon: this process is rank 0 and the broadcast
        root; daemon i joins at rank_offset 1 + the ranks of the daemons before it, world_size 1 +
        all of them (nccl_ranks). Returns the NcclGroup (push_weights(transport="nccl") finds it by
        group_name). Needs torch with CUDA and libnccl (rolloutd_client.nccl.init_group)."""
        from . import nccl as _nccl
        return _nccl.init_group(self.clients, group_name or _nccl.DEFAULT_GROUP, device, timeout, nccl_so,
                                master_address, master_port, ranks_per_client=self._ranks(ranks_per_server))

    def destroy_nccl_group(self, group_name=None, timeout=60.0):
        from . import nccl as _nccl
        return _nccl.destroy_group(group_name or _nccl.DEFAULT_GROUP, timeout)
