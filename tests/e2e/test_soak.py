"""Soak: 2,000 /generate requests from 16 client threads against a KV cache small enough to force
preemption, with random aborts (/abort_request by rid, now and then abort_all), random client
disconnects (the socket closed mid-generation, plain and streamed) and streamed answers mixed in.

Every request must end cleanly: 200 with finish length / stop / abort and a consistent body, or the
client's own disconnect. Afterwards nothing runs, every KV page is free (or an evictable cached
prefix), the counters add up, and the daemon's resident memory is back within a small margin of
its post-warm-up level (no leak per request). The daemon exits 0 on SIGTERM (the fixture checks).
Against an AddressSanitizer build it runs 1,000 requests and leaves leaks to LeakSanitizer.
"""
import http.client
import json
import random
import re
import socket
import threading
import time

import pytest

from conftest import BIN, Daemon

# Under AddressSanitizer the quarantine keeps freed memory resident, so RSS says nothing about
# leaks there (LeakSanitizer checks them at exit instead), and everything runs ~3x slower.
with open(BIN, "rb") as _f:
    SANITIZED = b"__asan_init" in _f.read()
N_REQUESTS = 1000 if SANITIZED else 2000
N_THREADS = 16
WARMUP = 200
RSS_MARGIN_MIB = 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # 2 MiB of FP8 KV = 31 pages of 16 tokens: 16 clients with up to ~70 tokens each do not fit, and
    # admission that barely reserves for growth makes running sequences preempt each other
    d = Daemon(None, ["--kv-cache-mb", "2", "--admission-new-token-ratio", "0.05", "--max-waiting-requests", "4096"],
               tmp_path_factory.mktemp("soak") / "rolloutd.log")
    yield d
    rc = d.stop()
    assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024


def metrics(d):
    out = {}
    for line in d.get("/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.finish = {}
        self.disconnects = 0
        self.streams = 0
        self.errors = []
        self.inflight = {}  # rid -> time submitted (for the aborter)

    def count(self, kind):
        with self.lock:
            self.finish[kind] = self.finish.get(kind, 0) + 1


def check_output(o, max_new, stats, errors):
    m = o["meta_info"]
    fr = m["finish_reason"]["type"]
    if fr not in ("length", "stop", "abort"):
        errors.append(f"finish {fr}")
    if m["completion_tokens"] != len(o["output_ids"]) or len(o["output_ids"]) > max_new:
        errors.append(f"bad lengths {m['completion_tokens']} {len(o['output_ids'])} {max_new}")
    if fr == "length" and len(o["output_ids"]) != max_new:
        errors.append(f"length finish with {len(o['output_ids'])} of {max_new}")
    stats.count(fr)


def one_request(port, i, rng, stats):
    rid = f"soak-{i}"
    max_new = rng.randint(1, 24)
    n = 2 if rng.random() < 0.15 else 1
    prompt = [rng.randrange(1, 8192) for _ in range(rng.randint(2, 32))]
    if rng.random() < 0.3:  # shared prefixes feed the prefix cache
        prompt = [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7] + prompt[:8]
    stream = rng.random() < 0.15
    body = json.dumps({"rid": rid, "input_ids": prompt, "return_logprob": rng.random() < 0.5, "stream": stream,
                       "sampling_params": {"max_new_tokens": max_new, "n": n, "temperature": 1.0,
                                           "sampling_seed": i, "ignore_eos": rng.random() < 0.7}}).encode()
    if rng.random() < 0.1:  # the client leaves mid-generation
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(rng.random() * 0.05)
        s.close()
        with stats.lock:
            stats.disconnects += 1
        return
    with stats.lock:
        stats.inflight[rid] = time.time()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    with stats.lock:
        stats.inflight.pop(rid, None)
    errors = []
    if r.status != 200:
        errors.append(f"{rid}: status {r.status}: {data[:200]!r}")
    elif stream:
        with stats.lock:
            stats.streams += 1
        chunks = data.decode().split("\n\n")
        if chunks[-1] != "" or chunks[-2] != "data: [DONE]":
            errors.append(f"{rid}: stream does not end with [DONE]")
        last = {}
        for c in chunks[:-2]:
            ev = json.loads(c[len("data: "):])
            last[ev.get("index", 0)] = ev
        if sorted(last) != list(range(n)):
            errors.append(f"{rid}: stream indices {sorted(last)}")
        for ev in last.values():
            check_output(ev, max_new, stats, errors)
    else:
        out = json.loads(data)
        for o in out if isinstance(out, list) else [out]:
            check_output(o, max_new, stats, errors)
    if errors:
        with stats.lock:
            stats.errors += errors


def aborter(port, stats, stop, rng):
    # Paced by completions, not by the clock: at most one abort per 3 outputs finished since the
    # last one, so the mix of finishes is the same on a fast machine and on a loaded or sanitized one.
    last = 0
    while not stop.is_set():
        time.sleep(rng.random() * 0.2)
        with stats.lock:
            done = sum(stats.finish.values())
            rids = list(stats.inflight)
        if done - last < 3:
            continue
        last = done
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        if rids and rng.random() < 0.99:
            body = {"rid": rng.choice(rids)}
        else:
            body = {"abort_all": True}
        conn.request("POST", "/abort_request", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        conn.close()
        if r.status != 200:
            with stats.lock:
                stats.errors.append(f"abort_request answered {r.status}")


def run_requests(d, first, count, stats, with_chaos=True):
    rng_abort = random.Random(first)
    stop = threading.Event()
    chaos = threading.Thread(target=aborter, args=(d.port, stats, stop, rng_abort)) if with_chaos else None
    if chaos:
        chaos.start()
    nxt = [first]
    lock = threading.Lock()

    def worker(seed):
        rng = random.Random(seed)
        while True:
            with lock:
                i = nxt[0]
                if i >= first + count:
                    return
                nxt[0] += 1
            one_request(d.port, i, rng, stats)

    threads = [threading.Thread(target=worker, args=(first * 1000 + t,)) for t in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    if chaos:
        chaos.join()


def settle(d, timeout=30):
    """Waits until nothing runs, nothing waits and no KV page is held; returns the metrics."""
    deadline = time.time() + timeout
    while True:
        # at idle the engine's snapshot is from the start of its last step: a probe refreshes it
        r = d.get("/health_generate")
        assert r.status_code == 200, r.text
        m = metrics(d)
        if (m["rolloutd_num_running_reqs"] == 0 and m["rolloutd_kv_cache_usage_ratio"] == 0
                and m["rolloutd_http_requests_in_flight"] == 0):
            return m
        if time.time() > deadline:
            raise AssertionError(f"not idle: {m}")
        time.sleep(0.1)


def test_soak(daemon):
    t0 = time.time()
    stats = Stats()
    run_requests(daemon, 0, WARMUP, stats)
    settle(daemon)
    base = rss_mib(daemon.proc.pid)
    run_requests(daemon, WARMUP, N_REQUESTS - WARMUP, stats)
    m = settle(daemon)
    elapsed = time.time() - t0
    after = rss_mib(daemon.proc.pid)

    assert not stats.errors, stats.errors[:20]
    total_finished = sum(stats.finish.values())
    assert stats.disconnects > N_REQUESTS // 40 and stats.finish.get("abort", 0) > N_REQUESTS // 40, \
        (stats.disconnects, stats.finish)
    assert stats.finish.get("length", 0) > N_REQUESTS // 4, stats.finish
    assert stats.streams > N_REQUESTS // 20
    assert total_finished + stats.disconnects >= N_REQUESTS  # an answer (per output) or the client's own close
    assert m["rolloutd_num_preemptions_total"] > 0  # the pool was under pressure
    assert m["rolloutd_kv_cache_pages_free"] == m["rolloutd_kv_cache_pages_total"]
    assert m["rolloutd_requests_finished_total"] >= N_REQUESTS - stats.disconnects
    if not SANITIZED:
        assert after - base < RSS_MARGIN_MIB, f"RSS grew from {base:.1f} to {after:.1f} MiB"
    assert daemon.get("/health").status_code == 200
    log = daemon.read_log()
    for bad in ("assert", "AddressSanitizer", "runtime error", "microhttpd |"):
        assert bad not in log, bad
    print(f"\nsoak: {N_REQUESTS} requests in {elapsed:.1f}s | finishes {stats.finish} | disconnects "
          f"{stats.disconnects} | streams {stats.streams} | preemptions {m['rolloutd_num_preemptions_total']:.0f} | "
          f"RSS {base:.1f} -> {after:.1f} MiB")
