"""Every malformed request gets the right 4xx JSON error, and the daemon keeps serving.

Runs against the real rolloutd with the embedded default model (vocab 8192, max_position 4096).
One daemon serves the whole table (module scope); tests that need other settings start their own.
"""
import http.client
import json
import re
import socket
import threading
import time

import pytest
import requests

import malformed_corpus
from conftest import Daemon, read_answer

VOCAB = 8192
CONTEXT = 4096


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(None, ["--kv-cache-mb", "64", "--max-body-bytes", "256K"],
               tmp_path_factory.mktemp("errors") / "rolloutd.log")
    yield d
    rc = d.stop()
    assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"


def ok_body(**over):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    body.update(over)
    return body


def sp(**kw):
    return ok_body(sampling_params={"max_new_tokens": 2, **kw})


# (id, body (dict = JSON, str/bytes = raw), status, type, param (None = null), message substring)
BAD = [
    # not JSON, or not the right JSON
    ("empty-body", b"", 400, "invalid_request", None, "empty"),
    ("truncated", b'{"input_ids": [1, 2', 400, "invalid_request", None, "invalid JSON"),
    ("trailing-garbage", b'{"input_ids": [1]} x', 400, "invalid_request", None, "invalid JSON"),
    ("not-utf8", b'{"input_ids": [1], "rid": "\xff\xfe"}', 400, "invalid_request", "rid",
     "rid is not valid UTF-8 (byte 0xff at offset 27 of the body)"),
    ("nan-literal", b'{"input_ids": [NaN]}', 400, "invalid_request", None, "invalid JSON"),
    ("huge-real", b'{"input_ids": [1], "sampling_params": {"temperature": 1e400}}', 400, "invalid_request",
     None, "invalid JSON"),
    ("int-2-63", b'{"input_ids": [9223372036854775808]}', 400, "invalid_request", None, "invalid JSON"),
    ("duplicate-key", b'{"input_ids": [1], "input_ids": [2]}', 400, "invalid_request", None, "duplicate"),
    ("top-level-list", b"[1, 2, 3]", 400, "invalid_request", None, "must be a JSON object"),
    ("top-level-string", b'"hello"', 400, "invalid_request", None, "invalid JSON"),
    # unknown fields
    ("unknown-top", ok_body(foo=1), 400, "invalid_request", "foo", "unknown field 'foo'"),
    ("unknown-sampling", sp(seed=3), 400, "invalid_request", "sampling_params.seed",
     "unknown field 'sampling_params.seed'"),
    ("penalty-out-of-range", sp(repetition_penalty=2.5), 400, "invalid_request", "sampling_params.repetition_penalty",
     "sampling_params.repetition_penalty must be in (0, 2], got 2.5"),
    ("frequency-penalty-out-of-range", sp(frequency_penalty=-3), 400, "invalid_request",
     "sampling_params.frequency_penalty", "must be in [-2, 2], got -3"),
    ("logit-bias-not-neutral", sp(logit_bias={"5": 1.0}), 400, "unsupported", "sampling_params.logit_bias",
     "not implemented"),
    ("custom-logit-processor", ok_body(custom_logit_processor="{\"callable\": \"x\"}"), 400, "unsupported",
     "custom_logit_processor", "not implemented"),
    ("lora-path", ok_body(lora_path="/adapters/a"), 400, "unsupported", "lora_path", "not implemented"),
    ("image-data", ok_body(image_data=["http://x/cat.png"]), 400, "unsupported", "image_data", "not implemented"),
    ("dp-rank-1", ok_body(routed_dp_rank=1), 400, "unsupported", "routed_dp_rank", "accepted: null, 0; got 1"),
    ("stop-strings-too-many", sp(stop=[str(i) for i in range(65)]), 400, "invalid_request",
     "sampling_params.stop[64]", "at most 64 stop strings"),
    ("stop-string-too-long", sp(stop=["x" * 1025]), 400, "invalid_request", "sampling_params.stop[0]",
     "at most 1024"),
    ("stop-not-a-string", sp(stop=["a", 5]), 400, "invalid_request", "sampling_params.stop[1]", "a string"),
    ("routed-experts", ok_body(return_routed_experts=True), 400, "unsupported", "return_routed_experts",
     "not supported"),
    ("text-and-input-ids", {"text": "hello", "input_ids": [1]}, 400, "invalid_request", "input_ids",
     "input_ids and text are both given"),
    ("text-empty", {"text": ""}, 400, "invalid_request", "text", "text must not be empty"),
    ("text-list-empty-entry", {"text": ["a", ""]}, 400, "invalid_request", "text[1]", "text[1] must not be empty"),
    ("text-empty-list", {"text": []}, 400, "invalid_request", "text", "text must not be empty"),
    ("text-not-a-string", {"text": ["a", 3]}, 400, "invalid_request", "text[1]", "a string"),
    ("text-over-context", {"text": "ab " * 3000, "sampling_params": {"max_new_tokens": 1}}, 400, "invalid_request",
     "text", "exceeds the context limit of 4096"),
    ("seed-is-sampling-seed", sp(seed=3, sampling_seed=3), 400, "invalid_request", "sampling_params.seed",
     "sampling_seed"),
    # input_ids
    ("missing-input-ids", {"sampling_params": {}}, 400, "invalid_request", "input_ids", "input_ids is required"),
    ("empty-input-ids", ok_body(input_ids=[]), 400, "invalid_request", "input_ids", "must not be empty"),
    ("empty-prompt-in-batch", ok_body(input_ids=[[1], []]), 400, "invalid_request", "input_ids[1]",
     "input_ids[1] must not be empty"),
    ("input-ids-string", ok_body(input_ids="1 2 3"), 400, "invalid_request", "input_ids", "got a string"),
    ("negative-id", ok_body(input_ids=[1, -5]), 400, "invalid_request", "input_ids", "input_ids[1] must be >= 0"),
    ("float-id", ok_body(input_ids=[1, 2.5]), 400, "invalid_request", "input_ids", "got 2.5"),
    ("bool-id", ok_body(input_ids=[True]), 400, "invalid_request", "input_ids", "got true"),
    ("id-2-31", ok_body(input_ids=[2 ** 31]), 400, "invalid_request", "input_ids", "< 2147483648"),
    ("mixed-batch", ok_body(input_ids=[[1], 2]), 400, "invalid_request", "input_ids[1]", "got 2"),
    ("id-over-vocab", ok_body(input_ids=[1, VOCAB]), 400, "invalid_request", "input_ids", "outside the vocabulary"),
    ("id-over-vocab-batch", ok_body(input_ids=[[1], [2, VOCAB + 7]]), 400, "invalid_request", "input_ids[1]",
     "outside the vocabulary"),
    # rid
    ("rid-int", ok_body(rid=5), 400, "invalid_request", "rid", "rid must be a string or a list of strings"),
    ("rid-empty", ok_body(rid=""), 400, "invalid_request", "rid", "must not be empty"),
    ("rid-too-long", ok_body(rid="r" * 200), 400, "invalid_request", "rid", "at most 127 bytes"),
    ("rid-list-length", ok_body(rid=["a"], input_ids=[[1], [2]]), 400, "invalid_request", "rid",
     "rid has 1 entries but input_ids has 2"),
    # sampling_params types and ranges
    ("sampling-not-object", ok_body(sampling_params=[1]), 400, "invalid_request", "sampling_params",
     "must be an object"),
    ("temperature-negative", sp(temperature=-1), 400, "invalid_request", "sampling_params.temperature",
     "sampling_params.temperature must be >= 0, got -1"),
    ("temperature-string", sp(temperature="hot"), 400, "invalid_request", "sampling_params.temperature",
     "must be a number"),
    ("top-p-zero", sp(top_p=0), 400, "invalid_request", "sampling_params.top_p", "(0, 1]"),
    ("top-p-above-one", sp(top_p=1.5), 400, "invalid_request", "sampling_params.top_p", "got 1.5"),
    # the value as sent, not rounded to "1" (which would read as inside (0, 1])
    ("top-p-just-above-one", sp(top_p=1.00000001), 400, "invalid_request", "sampling_params.top_p",
     "got 1.00000001"),
    ("top-k-zero", sp(top_k=0), 400, "invalid_request", "sampling_params.top_k", "-1 (off) or >= 1"),
    ("top-k-minus-two", sp(top_k=-2), 400, "invalid_request", "sampling_params.top_k", ">= -1"),
    ("top-k-float", sp(top_k=2.5), 400, "invalid_request", "sampling_params.top_k", "must be an integer"),
    ("min-p-negative", sp(min_p=-0.1), 400, "invalid_request", "sampling_params.min_p", "[0, 1]"),
    ("n-zero", sp(n=0), 400, "invalid_request", "sampling_params.n", ">= 1, got 0"),
    ("n-over-max", sp(n=65), 400, "invalid_request", "sampling_params.n", "[1, 64]"),
    ("batch-over-max", ok_body(input_ids=[[1]] * 17, sampling_params={"n": 64, "max_new_tokens": 1}), 400,
     "invalid_request", "input_ids", "exceeds the per-request limit of 1024"),
    ("max-new-tokens-negative", sp(max_new_tokens=-1), 400, "invalid_request", "sampling_params.max_new_tokens",
     ">= 0, got -1"),
    ("max-new-tokens-float", sp(max_new_tokens=16.5), 400, "invalid_request", "sampling_params.max_new_tokens",
     "must be an integer"),
    ("max-new-tokens-over-cap", sp(max_new_tokens=40000), 400, "invalid_request",
     "sampling_params.max_new_tokens", "[0, 32768]"),
    ("min-over-max-new-tokens", sp(max_new_tokens=2, min_new_tokens=5), 400, "invalid_request",
     "sampling_params.min_new_tokens", "min_new_tokens"),
    ("seed-negative", sp(sampling_seed=-1), 400, "invalid_request", "sampling_params.sampling_seed", ">= 0"),
    ("stop-ids-not-list", sp(stop_token_ids=5), 400, "invalid_request", "sampling_params.stop_token_ids",
     "list of token ids"),
    ("stop-id-over-vocab", sp(stop_token_ids=[VOCAB]), 400, "invalid_request", "sampling_params.stop_token_ids",
     "outside the vocabulary"),
    ("ignore-eos-int", sp(ignore_eos=1), 400, "invalid_request", "sampling_params.ignore_eos", "true or false"),
    # context limit
    ("over-context", ok_body(input_ids=[1, 2], sampling_params={"max_new_tokens": CONTEXT - 1}), 400,
     "invalid_request", "input_ids", "exceeds the context limit of 4096"),
    ("long-prompt-over-context", ok_body(input_ids=[1] * (CONTEXT + 1), sampling_params={"max_new_tokens": 0}),
     400, "invalid_request", "input_ids", "context limit"),
    # logprob options
    ("return-logprob-string", ok_body(return_logprob="yes"), 400, "invalid_request", "return_logprob",
     "true or false"),
    ("logprob-start-below", ok_body(logprob_start_len=-2), 400, "invalid_request", "logprob_start_len",
     ">= -1, got -2"),
    ("logprob-start-past-prompt", ok_body(logprob_start_len=3, return_logprob=True), 400, "invalid_request", "logprob_start_len",
     "less than the prompt length"),
    ("top-logprobs-over-cap", ok_body(top_logprobs_num=21, return_logprob=True), 400, "invalid_request",
     "top_logprobs_num", "top_logprobs_num must be in [0, 20], got 21"),
    ("logprobs-mode-case", ok_body(logprobs_mode="Raw"), 400, "invalid_request", "logprobs_mode", "must be one of"),
    ("logprobs-mode-bogus", ok_body(logprobs_mode="fancy"), 400, "invalid_request", "logprobs_mode",
     "must be one of"),
    ("stream-string", ok_body(stream="yes"), 400, "invalid_request", "stream", "true or false"),
]


def check_error(r, status, etype, param, message):
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status  # vLLM's ErrorInfo.code: the HTTP status
    assert err["type"] == etype
    assert err["param"] == param
    assert message in err["message"], err["message"]


@pytest.mark.parametrize("body,status,etype,param,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_generate(daemon, body, status, etype, param, message):
    r = daemon.post("/generate", body if not isinstance(body, bytes) else body,
                    headers={"Content-Type": "application/json"})
    check_error(r, status, etype, param, message)


def test_table_is_large_enough():
    assert len(BAD) >= 40


CORPUS = malformed_corpus.cases(256 * 1024)


def raw_bytes_request(port, method, path, body, raw_headers, version="HTTP/1.1"):
    """One request written byte for byte (headers as given, duplicates and all): (status, headers, body).
    Answers that come before the body has been read end the connection, which may then be reset
    once the answer is in: reading stops at the answer's own length."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = f"{method} {path} {version}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{raw_headers}\r\n\r\n"
    try:
        s.sendall(head.encode() + (body or b""))
    except (BrokenPipeError, ConnectionResetError):
        pass  # answered and closed before the body was all sent
    try:
        return read_answer(s)
    finally:
        s.close()


def raw_request(port, method, path, body, headers):
    """One request over a fresh connection, sent as is (no URL normalization): (status, headers, body)."""
    if "Raw-Headers" in headers:
        return raw_bytes_request(port, method, path, body, headers["Raw-Headers"],
                                 headers.get("Raw-Version", "HTTP/1.1"))
    if "Content-Length-Override" in headers:  # a claim the body never backs: answered before the body
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {headers['Content-Length-Override']}\r\n"
                  "Expect: 100-continue\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
        head, rest = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += s.recv(65536)
        s.close()
        return int(head.split()[1]), {}, rest
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **headers})
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    conn.close()
    return out


@pytest.mark.parametrize("case", CORPUS, ids=[c.id for c in CORPUS])
def test_malformed_corpus(daemon, case):
    status, headers, body = raw_request(daemon.port, case.method, case.path, case.body, case.headers)
    assert status == case.status, (status, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == status, err
    assert err["type"] == case.etype, err
    if case.param is not None:
        assert err["param"] == case.param, err
    if status == 405:
        allowed = list(malformed_corpus.ROUTES[case.path])
        if "GET" in allowed:  # HEAD wherever GET (RFC 9110 9.1)
            allowed.insert(allowed.index("GET") + 1, "HEAD")
        assert headers["Allow"] == ", ".join(allowed)
    if case.id.startswith("framing-"):  # answered before the body: the connection cannot go on
        assert headers["connection"].lower() == "close", headers


def test_corpus_is_large():
    assert len(CORPUS) >= 200


def test_daemon_survives_the_corpus(daemon):
    assert daemon.get("/health").status_code == 200
    r = daemon.post("/generate", ok_body())
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    log = daemon.read_log()
    for bad in ("assert", "AddressSanitizer", "runtime error", "LeakSanitizer", "microhttpd |", "out of memory"):
        assert bad not in log, bad


def test_still_healthy_and_serving_after_bad_requests(daemon):
    for b in BAD[:10]:
        daemon.post("/generate", b[1])
    assert daemon.get("/health").status_code == 200
    r = daemon.post("/generate", ok_body())
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 2


@pytest.mark.parametrize("method,path,status,etype,allow", [
    ("GET", "/nope", 404, "not_found", None),
    ("POST", "/generate/extra", 404, "not_found", None),
    ("GET", "/", 404, "not_found", None),
    ("GET", "/generate", 405, "method_not_allowed", "POST, PUT"),
    ("DELETE", "/generate", 405, "method_not_allowed", "POST, PUT"),
    ("POST", "/health", 405, "method_not_allowed", "GET, HEAD"),
])
def test_wrong_route_or_method(daemon, method, path, status, etype, allow):
    r = requests.request(method, daemon.url + path, json={"input_ids": [1]}, timeout=30)
    check_error(r, status, etype, None, path)
    if allow:
        assert r.headers["Allow"] == allow


def test_oversized_body_with_content_length(daemon):
    body = b'{"input_ids": [' + b"1, " * 100000 + b"1]}"  # ~300 KB > 256 KiB
    r = daemon.post("/generate", body)
    check_error(r, 413, "request_too_large", None, "max-body-bytes")
    assert daemon.get("/health").status_code == 200


def test_oversized_body_chunked(daemon):
    def chunks():  # no Content-Length: the limit is found while reading
        yield b'{"input_ids": ['
        for _ in range(100):
            yield b"1, " * 1000
        yield b"1]}"
    r = requests.post(daemon.url + "/generate", data=chunks(), timeout=60)
    check_error(r, 413, "request_too_large", None, "max-body-bytes")
    r = daemon.post("/generate", ok_body())
    assert r.status_code == 200


def test_body_just_under_limit_is_read(daemon):
    ids = [1] * 60000  # ~180 KB of JSON, under 256 KiB, but over the 4096-token context
    r = daemon.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}})
    check_error(r, 400, "invalid_request", "input_ids", "context limit")


def test_oversized_with_expect_continue_is_answered_before_the_body(daemon):
    # A client that waits for "100 Continue" gets its 413 without sending the body.
    s = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100000000\r\nExpect: 100-continue\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, data
        data += chunk
    s.close()
    assert data.startswith(b"HTTP/1.1 413"), data


def test_client_sending_garbage_http(daemon):
    s = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    s.sendall(b"THIS IS NOT HTTP\r\n\r\n")
    try:
        s.recv(4096)
    except OSError:
        pass
    s.close()
    assert daemon.get("/health").status_code == 200


def test_waiting_queue_full_gives_503(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--max-waiting-requests", "1")
    long_req = {"rid": "holds-the-slot", "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    result = {}

    def send_long():  # retried while a probe below holds the only slot
        while True:
            r = d.post("/generate", long_req)
            if r.status_code != 503:
                result["r"] = r
                return
            time.sleep(0.01)

    t = threading.Thread(target=send_long)
    t.start()
    deadline = time.time() + 20
    r = None
    while time.time() < deadline and "r" not in result:
        r = d.post("/generate", ok_body())
        if r.status_code == 503:
            break
        time.sleep(0.05)
    check_error(r, 503, "unavailable", None, "max-waiting-requests")
    assert r.headers["Retry-After"] == "1"
    d.post("/abort_request", {"rid": "holds-the-slot"})  # it has served its purpose
    t.join()
    assert result["r"].status_code == 200
    # The slot frees when the long request's connection completes, which can come a moment after
    # its client has read the response: a retry within the advertised Retry-After must get in.
    deadline = time.time() + 1.0
    while (status := d.post("/generate", ok_body()).status_code) == 503 and time.time() < deadline:
        time.sleep(0.01)
    assert status == 200


def test_api_key(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--api-key", "sekrit")
    assert d.get("/health").status_code == 200  # /health stays open
    r = d.post("/generate", ok_body())
    check_error(r, 401, "unauthorized", None, "API key")
    assert r.headers["WWW-Authenticate"] == "Bearer"
    for bad in ["Bearer wrong", "Bearer sekrit2", "Bearer sekri", "Basic sekrit", "sekrit", "Bearer "]:
        r = d.post("/generate", ok_body(), headers={"Authorization": bad})
        check_error(r, 401, "unauthorized", None, "API key")
    r = d.post("/generate", ok_body(), headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200, r.text
    # whitespace around the field value is not part of it (RFC 9110 5.5)
    for ok in ["Bearer sekrit ", "Bearer sekrit\t", "bearer  sekrit"]:
        status, _, body = raw_bytes_request(d.port, "POST", "/generate", ok_body_bytes(),
                                            f"Authorization: {ok}\r\nContent-Length: {len(ok_body_bytes())}")
        assert status == 200, (ok, body)


UNKNOWN_PATHS = ["/nope", "/", "/admin", "/generate/", "/v1/chat/completions", "/update_weights", "/%00"]


def test_api_key_hides_routes(rolloutd):
    """With --api-key, a request without the key learns nothing about routes: a real route, an
    unknown path and a method the route does not take all get the same 401. Only GET /health and
    GET /metrics answer without it; with the key the 404s and 405s come back."""
    d = rolloutd(None, "--kv-cache-mb", "64", "--api-key", "sekrit")
    paths = list(malformed_corpus.ROUTES) + UNKNOWN_PATHS
    bodies = set()
    for path in paths:
        for method in malformed_corpus.METHODS:
            open_route = method == "GET" and path in ("/health", "/metrics")
            status, headers, body = raw_request(d.port, method, path, b"{}", {})
            if open_route:
                assert status == 200, (method, path, status, body[:200])
                continue
            assert status == 401, (method, path, status, body[:200])
            assert headers["WWW-Authenticate"] == "Bearer"
            bodies.add(body)
            status, _, body = raw_request(d.port, method, path, b"{}", {"Authorization": "Bearer wrong"})
            assert status == 401, (method, path, status)
            bodies.add(body)
            if path in UNKNOWN_PATHS or method not in malformed_corpus.ROUTES[path]:
                want = 404 if path in UNKNOWN_PATHS else 405
                status, _, body = raw_request(d.port, method, path, b"{}", {"Authorization": "Bearer sekrit"})
                assert status == want, (method, path, status, body[:200])
    assert len(bodies) == 1, bodies  # one answer, whatever the path or method


def test_401_log_lines_are_rate_limited(rolloutd):
    """A client can send bad keys as fast as it likes: at most one 401 line a second is logged, and
    the next says how many were not."""
    d = rolloutd(None, "--kv-cache-mb", "64", "--api-key", "sekrit")
    t0 = time.time()
    n = 200
    with requests.Session() as s:
        for _ in range(n):
            assert s.post(d.url + "/generate", json=ok_body(), timeout=30).status_code == 401
        elapsed = time.time() - t0
        time.sleep(1.1)
        assert s.get(d.url + "/nope", timeout=30).status_code == 401
    lines = [line for line in d.read_log().splitlines() if "| 401 unauthorized |" in line]
    assert 2 <= len(lines) <= elapsed + 3, (len(lines), elapsed, lines)
    not_logged = sum(int(m.group(1)) for m in (re.search(r"\| (\d+) more like it not logged", line)
                                               for line in lines) if m)
    assert not_logged + len(lines) == n + 1, (not_logged, lines)


def test_bad_flag_exits_1_naming_it(tmp_path):
    import subprocess
    from conftest import BIN
    p = subprocess.run([BIN, "--port", "70000"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert "port" in p.stderr and "70000" in p.stderr
    p = subprocess.run([BIN, "--frobnicate", "1"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert "--frobnicate" in p.stderr
    conf = tmp_path / "bad.conf"
    conf.write_text("max-n = 0\n")
    p = subprocess.run([BIN, "--config", str(conf)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert "max-n" in p.stderr and "bad.conf:1" in p.stderr


def test_device_flag_is_checked_at_start(tmp_path):
    """--device takes cpu|cuda; a CPU-only build refuses cuda at start (exit 1, saying how to get it)
    instead of serving on the CPU behind the operator's back."""
    import subprocess
    from conftest import BIN
    p = subprocess.run([BIN, "--device", "tpu"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert "device" in p.stderr and "cpu|cuda" in p.stderr
    if _links_cudart(BIN):
        pytest.skip("a CUDA build: --device cuda is valid here")
    p = subprocess.run([BIN, "--device", "cuda", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "make CUDA=1" in p.stderr and "device" in p.stderr


def _links_cudart(path):
    import subprocess
    return "libcudart" in subprocess.run(["ldd", path], capture_output=True, text=True).stdout


def ok_body_bytes():
    return json.dumps(ok_body()).encode()


def raw_head_request(port, head, body=b""):
    """A request whose request line and headers are exactly `head` (no Host added)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(head.encode() + b"\r\n\r\n" + body)
        return read_answer(s)
    finally:
        s.close()


def test_bodies_are_json_and_unencoded(daemon):
    """A body is read as JSON only with a JSON media type or none, as FastAPI reads one (SGLang, vLLM):
    a browser posts text/plain and form types cross-site without asking first (CSRF). A body in a
    content coding is refused, not read as the JSON it is not."""
    body = ok_body_bytes()
    for ct, status in [(None, 200), ("application/json", 200), ("application/json; charset=utf-8", 200),
                       ("Application/JSON", 200), ("application/vnd.api+json", 200), ("text/plain", 415),
                       ("text/plain;charset=UTF-8", 415), ("application/x-www-form-urlencoded", 415),
                       ("multipart/form-data; boundary=x", 415), ("application/jsonx", 415), ("", 415)]:
        head = f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}"
        if ct is not None:
            head += f"\r\nContent-Type: {ct}"
        status_got, _, answer = raw_head_request(daemon.port, head, body)
        assert status_got == status, (ct, answer)
        if status == 415:
            err = json.loads(answer)["error"]
            assert err["type"] == "unsupported_media_type" and "application/json" in err["message"], err
    # a body-less POST with a form type is refused too (a cross-site form can post nothing)
    status, _, _ = raw_head_request(daemon.port, "POST /flush_cache HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                    "Content-Type: text/plain\r\nContent-Length: 0")
    assert status == 415
    for ce, status in [("gzip", 415), ("br", 415), ("identity", 200)]:
        status_got, _, answer = raw_head_request(
            daemon.port, f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Content-Encoding: {ce}\r\nContent-Length: {len(body)}", body)
        assert status_got == status, (ce, answer)


def test_host_and_origin_guards(daemon):
    """RFC 9112 3.2: an HTTP/1.1 request carries exactly one valid Host. Listening on 127.0.0.1, the
    daemon answers requests addressed to localhost or an IP address only (a page whose DNS name is
    rebound to 127.0.0.1 sends its own name), and refuses browsers' cross-origin requests (an
    Origin that is not the Host): neither can pause, flush or use it."""
    port = daemon.port
    get = "GET /health HTTP/1.1\r\n"
    for host, status in [(f"127.0.0.1:{port}", 200), (f"localhost:{port}", 200), ("localhost", 200),
                         (f"[::1]:{port}", 200), (f"api.localhost:{port}", 200), ("10.1.2.3", 200),
                         (f"localhost.:{port}", 200), ("foo.localhost.", 200),
                         (f"evil.example:{port}", 403), ("evil.example", 403), ("127.0.0.1.nip.io", 403),
                         ("a b", 400), ("x/y", 400)]:
        status_got, _, answer = raw_head_request(port, get + f"Host: {host}")
        assert status_got == status, (host, answer)
        if status == 403:
            assert json.loads(answer)["error"]["type"] == "forbidden"
    assert raw_head_request(port, "GET /health HTTP/1.1")[0] == 400  # no Host
    assert raw_head_request(port, get + "Host: 127.0.0.1\r\nHost: 127.0.0.1")[0] == 400
    assert raw_head_request(port, "GET /health HTTP/1.0")[0] == 200  # HTTP/1.0 needs none
    host = f"127.0.0.1:{port}"
    for origin, status in [(f"http://{host}", 200), ("http://evil.example", 403), ("null", 403),
                           (f"http://localhost:{port}", 403)]:
        status_got, _, answer = raw_head_request(port, f"POST /pause_generation HTTP/1.1\r\nHost: {host}\r\n"
                                                       f"Origin: {origin}\r\nContent-Length: 0")
        assert status_got == status, (origin, answer)
        if status == 200:
            assert requests.post(daemon.url + "/continue_generation", timeout=30).status_code == 200


def test_head_wherever_get(daemon):
    """RFC 9110 9.1: HEAD is allowed wherever GET is (Starlette does the same for SGLang and vLLM)."""
    for path in ["/health", "/metrics", "/v1/models", "/get_model_info"]:
        r = requests.head(daemon.url + path, timeout=30)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
        assert r.headers["Content-Type"] == requests.get(daemon.url + path, timeout=30).headers["Content-Type"]
    r = requests.head(daemon.url + "/generate", timeout=30)
    assert r.status_code == 405 and r.headers["Allow"] == "POST, PUT"


def test_request_text_cannot_forge_log_lines(daemon):
    """A path, a field name or a model name holding a newline is logged on one line (CWE-117): the
    control characters of a logged message are written as '?'."""
    requests.get(daemon.url + "/x%0A[    9.999] error | FORGED-A", timeout=30)
    requests.post(daemon.url + "/generate", data=b'{"input_ids": [1], "a\\n[    9.999] error | FORGED-B": 1}',
                  headers={"Content-Type": "application/json"}, timeout=30)
    requests.post(daemon.url + "/v1/completions", json={"model": "m\n[    9.999] error | FORGED-C", "prompt": [1]},
                  timeout=30)
    time.sleep(0.2)
    log = daemon.read_log()
    for tag in ("FORGED-A", "FORGED-B", "FORGED-C"):
        assert tag in log, tag  # the requests were logged ...
        assert not any(line.startswith("[    9.999]") and tag in line for line in log.splitlines()), tag
