"""Slow and hostile clients against the real daemon, over raw loopback sockets (bounded counts and
times): what one client can hold of the server.

  - http-idle-timeout closes a connection that stops sending its headers or its body, or sits idle
    between requests; a request waiting for the engine (longer than the timeout) is not touched;
  - max-connections-per-ip: a connection beyond it is answered 503 as soon as its headers are in
    (never queued, never closed unanswered), except GET /health and /metrics, which the reserve
    serves; other addresses (127.0.0.2 and up: loopback) are not affected;
  - a full server (the issue's scenario at the default settings: more connections than
    max-connections, each having sent one byte) still answers /health and /metrics, and refuses
    work at once with 503;
  - bodies announced large and stalled one byte short pin no more than body-memory-budget: the
    daemon's VmRSS stays bounded, the bodies over the budget are answered 503 when they end;
  - streaming clients that stop reading are cut at max-stream-buffer / stream-memory-budget: their
    requests finish "abort", their KV pages come back at once, VmRSS stays bounded, and the idle
    timeout closes their connections.

Against an AddressSanitizer build the VmRSS bounds are not checked (its quarantine keeps freed
memory resident); everything else is.
"""
import json
import resource
import socket
import threading
import time

import pytest
import requests

from conftest import BIN, read_answer
from test_ops import m, metrics, wait_for

with open(BIN, "rb") as _f:
    SANITIZED = b"__asan_init" in _f.read()

PROMPT = [11, 22, 33, 44, 55]


def check_growth(grown, bound, what):
    print(f"{what}: VmRSS grew {grown / 2**20:.1f} MiB (bound {bound / 2**20:.0f} MiB)")
    if not SANITIZED:
        assert grown < bound, f"{what}: VmRSS grew {grown >> 20} MiB"


def rss(d):
    """The daemon's resident set size in bytes (/proc/PID/status VmRSS)."""
    with open(f"/proc/{d.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def connect(d, src="127.0.0.1", rcvbuf=None):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((src, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", d.port))
    return s


def ask(d, method, path, body=b"", src="127.0.0.1", extra=""):
    """One request on a fresh connection from address `src`: (status, headers, body, seconds)."""
    t0 = time.time()
    s = connect(d, src)
    try:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body)
        status, headers, out = read_answer(s)
    finally:
        s.close()
    return status, headers, out, time.time() - t0


def closed_by_peer(s, within):
    """True when the daemon ends the connection within `within` seconds (EOF or reset)."""
    s.settimeout(within)
    try:
        while True:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


GEN = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}).encode()


# ---------------------------------------------------------------- idle timeout

def test_idle_timeout_closes_silent_connections(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--http-idle-timeout", "1")
    # a generation that waits for the (paused) engine well past the timeout is answered in full
    assert d.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    box = {}
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    t = threading.Thread(target=lambda: box.setdefault("r", d.post("/generate", body)))
    t.start()
    half_headers = connect(d)
    half_headers.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    half_body = connect(d)
    half_body.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{\"input_ids\": [")
    idle = connect(d)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert read_answer(idle)[0] == 200  # then silent, kept alive
    t0 = time.time()
    for name, s in (("headers", half_headers), ("body", half_body), ("keep-alive", idle)):
        assert closed_by_peer(s, 6), f"a connection stalled in its {name} was not closed"
        s.close()
    assert time.time() - t0 < 6
    time.sleep(max(0.0, 2.5 - (time.time() - t0)))
    assert "r" not in box
    assert d.post("/continue_generation", {}).status_code == 200
    t.join(timeout=120)
    o = box["r"].json()
    assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert d.get("/health").status_code == 200


# ---------------------------------------------------------------- connection caps

def answered_once(s):
    """One keep-alive GET /health on s, answered: the daemon counts a connection when one of its HTTP
    pool threads accepts it, so a later connection can be counted before an earlier one; a connection
    that has had an answer is counted before anything that connects after it."""
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert read_answer(s)[0] == 200


def test_per_ip_cap_answers_503_at_once(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--max-connections-per-ip", "8", "--max-connections", "64")
    # each held connection counted before the one asked next, which must be over the cap
    held = [connect(d, "127.0.0.2") for _ in range(8)]
    for s in held:
        answered_once(s)
        s.sendall(b"GET /health HTTP/1.1\r\n")  # and never the rest
    status, headers, body, secs = ask(d, "POST", "/generate", GEN, src="127.0.0.2")
    assert status == 503 and secs < 2, (status, body)
    err = json.loads(body)["error"]
    assert err["type"] == "unavailable" and "max-connections-per-ip 8" in err["message"], err
    assert headers["retry-after"] == "1" and headers["connection"].lower() == "close"
    # the reserve: /health and /metrics still answer that address, and close after
    for path in ("/health", "/metrics"):
        status, headers, body, _ = ask(d, "GET", path, src="127.0.0.2")
        assert status == 200 and headers["connection"].lower() == "close", (path, status, body[:200])
    # another address is served as usual
    status, _, body, _ = ask(d, "POST", "/generate", GEN, src="127.0.0.1")
    assert status == 200, body
    # a connection over the cap that sends nothing does not keep its place in the reserve
    silent = connect(d, "127.0.0.2")
    assert closed_by_peer(silent, 10)
    silent.close()
    for s in held:
        s.close()
    wait_for(lambda: ask(d, "POST", "/generate", GEN, src="127.0.0.2")[0] == 200, what="the cap to free")


def test_full_server_still_answers_health(rolloutd):
    """More connections than max-connections (default 2048), each having sent one byte, spread over
    eight addresses: GET /health and /metrics answer from the reserve, work is refused at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2048 + 8 + 64
    if max(soft, hard) < need:
        pytest.skip(f"needs {need} open files, the limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    d = rolloutd(None, "--kv-cache-mb", "64")
    held = []
    try:
        for i in range(2048 + 8):
            s = connect(d, f"127.0.0.{2 + i % 8}")
            if i < 2048:  # counted before the requests below connect
                answered_once(s)
            s.sendall(b"G")
            held.append(s)
        for path in ("/health", "/metrics"):
            status, _, body, secs = ask(d, "GET", path)
            assert status == 200 and secs < 5, (path, status, secs, body[:200])
        status, _, body, secs = ask(d, "POST", "/generate", GEN)
        assert status == 503 and secs < 5 and "max-connections 2048" in json.loads(body)["error"]["message"]
    finally:
        for s in held:
            s.close()
    wait_for(lambda: ask(d, "POST", "/generate", GEN)[0] == 200, timeout=20, what="the server to empty")


# ---------------------------------------------------------------- memory budgets

BODY_MAX = 4 << 20


def test_stalled_bodies_are_bounded_by_the_budget(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--max-body-bytes", "4M", "--body-memory-budget", "16M")
    body = GEN + b" " * (BODY_MAX - len(GEN))  # valid JSON, 4 MiB
    base = rss(d)
    conns = []
    for _ in range(24):  # 96 MiB announced and sent but the last byte
        s = connect(d)
        s.settimeout(30)
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:-1])
        conns.append(s)
    time.sleep(1.0)  # the daemon reads what is in flight
    check_growth(rss(d) - base, (16 << 20) + (24 << 20), "24 stalled 4 MiB bodies, a 16 MiB budget")
    assert d.get("/health", timeout=5).status_code == 200
    answers = []
    for s in conns:
        s.sendall(body[-1:])
        answers.append(read_answer(s))
        s.close()
    codes = [a[0] for a in answers]
    assert set(codes) <= {200, 503} and codes.count(200) <= 4, codes
    for status, _, out in answers:
        if status == 503:
            assert "body-memory-budget" in json.loads(out)["error"]["message"]
    assert ask(d, "POST", "/generate", GEN)[0] == 200  # the budget is free again


def stop_reading_stream(d, rid):
    """A streamed /generate whose client never reads (a 4 KiB receive buffer): the socket."""
    body = json.dumps({"rid": rid, "input_ids": PROMPT, "stream": True, "return_logprob": True,
                       "top_logprobs_num": 20,
                       "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}).encode()
    s = connect(d, rcvbuf=4096)
    s.sendall(f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def test_streams_that_stop_reading_are_cut(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--max-stream-buffer", "1M", "--stream-memory-budget", "4M",
                 "--http-idle-timeout", "20")
    # The KV pool's pages become resident when first used (it is mapped, not written, at start), so
    # a first round of six such streams makes resident the pages these requests take; the bound is
    # checked on a second round, from where the first left the daemon.
    socks = []
    for rnd in range(2):
        base = rss(d)
        aborted0 = m(metrics(d), "rolloutd_requests_aborted_total")
        socks += [stop_reading_stream(d, f"stall-{rnd}-{i}") for i in range(6)]
        peak = 0

        def all_cut():
            nonlocal peak
            peak = max(peak, rss(d))
            return m(metrics(d), "rolloutd_requests_aborted_total") >= aborted0 + 6

        wait_for(all_cut, timeout=60, what="six streams cut")
        log = d.read_log()
        assert log.count("the client reads too slowly") == 6 * (rnd + 1), log[-3000:]
        # their pages came back while their clients still hold the connections
        wait_for(lambda: m(metrics(d), "rolloutd_kv_cache_usage_ratio") == 0, timeout=5, what="pages freed")
        if rnd == 0:
            check_growth(peak - base, (4 << 20) + (32 << 20) + (64 << 20),
                         "6 streams that stop reading, a 4 MiB budget, the KV pool's pages made resident")
        else:
            check_growth(peak - base, (4 << 20) + (32 << 20), "6 streams that stop reading, a 4 MiB budget")
    status, _, body, _ = ask(d, "POST", "/generate", GEN)
    assert status == 200, body
    # the idle timeout ends the connections of readers that stopped
    for s in socks:
        assert closed_by_peer(s, 40)
        s.close()


def test_streams_read_normally_are_not_cut(rolloutd):
    """A reader that keeps up gets the whole cumulative stream under a small max-stream-buffer."""
    d = rolloutd(None, "--kv-cache-mb", "64", "--max-stream-buffer", "256K", "--stream-memory-budget", "1M")
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    r = requests.post(d.url + "/generate", json=body, stream=True, timeout=60)
    events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    last = json.loads(events[-2][len(b"data: "):])
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    # one step's events alone larger than the buffer (a batch x n streamed cumulatively with top
    # logprobs: 16 outputs x 120 tokens x 5 alternatives) still reach a reader that keeps up
    d2 = rolloutd(None, "--kv-cache-mb", "64", "--max-stream-buffer", "64K", "--stream-memory-budget", "64M")
    body = {"input_ids": [[1, 2, 3], [4, 5, 6]], "stream": True, "return_logprob": True, "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": 120, "temperature": 1.0, "n": 8, "ignore_eos": True}}
    r = requests.post(d2.url + "/generate", json=body, stream=True, timeout=120)
    sizes, finals = [], {}
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            sizes.append(len(line))
            o = json.loads(line[len(b"data: "):])
            if o["meta_info"]["finish_reason"] is not None:
                finals[o["index"]] = o["meta_info"]["finish_reason"]
        if line:
            last_line = line
    assert last_line == b"data: [DONE]" and "reads too slowly" not in d2.read_log()
    assert len(finals) == 16 and all(f == {"type": "length", "length": 120} for f in finals.values()), finals
    assert max(sizes) * 16 > 64 * 1024  # one step's events outgrow the buffer
