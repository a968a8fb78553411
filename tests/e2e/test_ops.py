"""The operations routes against the real daemon: /metrics (parsed with a small Prometheus text
parser; counters move after requests), /abort_request (by rid and all; partial outputs come back
with finish abort), /pause_generation in its three modes with requests in flight,
/continue_generation, /flush_cache (409 while requests run), /health_generate, the info routes
(/get_server_info lists every setting), and the API key on every route.
"""
import re
import subprocess
import threading
import time

import pytest
import requests

from conftest import BIN, Daemon

PROMPT = [11, 22, 33, 44, 55]
LONG = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(None, ["--kv-cache-mb", "64", "--log-level", "debug"], tmp_path_factory.mktemp("ops") / "rolloutd.log")
    yield d
    rc = d.stop()
    assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"


# ---------------------------------------------------------------- a small Prometheus text parser

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$')


def parse_prometheus(text):
    """{(name, ((label, value), ...)): float}; checks the exposition format on the way."""
    assert text.endswith("\n")
    families = {}  # name -> type
    samples = {}
    helped = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
            continue
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split()
            assert name in helped, f"TYPE before HELP for {name}"
            assert typ in ("counter", "gauge", "histogram", "summary", "untyped")
            assert name not in families, f"{name} declared twice"
            families[name] = typ
            continue
        assert not line.startswith("#"), line
        m = SAMPLE.match(line)
        assert m, f"bad sample line: {line!r}"
        name, labels, value = m.group(1), m.group(3), m.group(4)
        base = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name[:-len(suffix)] in families and families[name[:-len(suffix)]] == "histogram":
                base = name[:-len(suffix)]
        assert base in families, f"sample {name} without HELP/TYPE"
        if families[base] == "counter":
            assert name.endswith("_total"), name
        lab = tuple(sorted(tuple(kv.split("=", 1)) for kv in re.findall(r'[a-zA-Z_]+="[^"]*"', labels or "")))
        samples[(name, lab)] = float(value)
    # histograms: cumulative buckets ending at +Inf == _count
    for name, typ in families.items():
        if typ != "histogram":
            continue
        buckets = sorted(((float(dict(lab)["le"].strip('"')), v) for (n, lab), v in samples.items()
                          if n == name + "_bucket"), key=lambda x: x[0])
        assert buckets and buckets[-1][0] == float("inf")
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))
        assert buckets[-1][1] == samples[(name + "_count", ())]
    return samples


def metrics(d, refresh=False):
    if refresh:
        # At idle the engine's snapshot is from the start of its last step (it publishes when it
        # takes new work): a health probe makes it take some, so the snapshot read afterwards
        # includes every finished step. (Not needed once the engine publishes after each step.)
        assert d.get("/health_generate").status_code == 200
    r = d.get("/metrics")
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return parse_prometheus(r.text)


def m(s, name, **labels):
    return s[(name, tuple(sorted((k, f'"{v}"') for k, v in labels.items())))]


def wait_for(pred, timeout=10.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def in_background(d, body, path="/generate"):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", d.post(path, body)))
    t.start()
    return t, box


def generating(d, before):
    """Waits until the engine has produced tokens beyond `before` (a generation_tokens count)."""
    wait_for(lambda: m(metrics(d), "rolloutd_generation_tokens_total") > before + 5, what="tokens")


# ---------------------------------------------------------------- metrics

def test_metrics_parse_and_counters_move(daemon):
    s0 = metrics(daemon, refresh=True)
    for alias, native in [("sglang:num_running_reqs", "rolloutd_num_running_reqs"),
                          ("sglang:num_queue_reqs", "rolloutd_num_waiting_reqs"),
                          ("vllm:num_requests_running", "rolloutd_num_running_reqs"),
                          ("vllm:num_requests_waiting", "rolloutd_num_waiting_reqs"),
                          ("sglang:token_usage", "rolloutd_kv_cache_usage_ratio"),
                          ("vllm:kv_cache_usage_perc", "rolloutd_kv_cache_usage_ratio"),
                          ("vllm:num_preemptions_total", "rolloutd_num_preemptions_total"),
                          ("vllm:prompt_tokens_total", "rolloutd_prompt_tokens_total"),
                          ("vllm:generation_tokens_total", "rolloutd_generation_tokens_total"),
                          ("vllm:time_to_first_token_seconds_count", "rolloutd_time_to_first_token_seconds_count"),
                          ("vllm:e2e_request_latency_seconds_count", "rolloutd_e2e_request_latency_seconds_count"),
                          ("vllm:inter_token_latency_seconds_count", "rolloutd_inter_token_latency_seconds_count")]:
        assert m(s0, alias) == m(s0, native), alias
    n_req, n_tok = 3, 7
    for i in range(n_req):
        before = metrics(daemon)
        r = daemon.post("/generate", {"input_ids": [100 + i, 2, 3, 4],
                                      "sampling_params": {"max_new_tokens": n_tok, "ignore_eos": True}})
        assert r.status_code == 200
        # read at once, no refresh: the response's request is already counted, with its tokens
        after = metrics(daemon)
        for name, delta in [("rolloutd_requests_finished_total", 1), ("rolloutd_generation_tokens_total", n_tok),
                            ("rolloutd_prompt_tokens_total", 4), ("rolloutd_e2e_request_latency_seconds_count", 1),
                            ("rolloutd_time_to_first_token_seconds_count", 1)]:
            assert m(after, name) - m(before, name) == delta, (name, m(before, name), m(after, name))
    s1 = metrics(daemon, refresh=True)
    assert m(s1, "rolloutd_generation_tokens_total") - m(s0, "rolloutd_generation_tokens_total") >= n_req * n_tok
    assert m(s1, "rolloutd_prompt_tokens_total") > m(s0, "rolloutd_prompt_tokens_total")
    assert m(s1, "rolloutd_requests_finished_total") - m(s0, "rolloutd_requests_finished_total") >= n_req
    assert m(s1, "rolloutd_time_to_first_token_seconds_count") - m(s0, "rolloutd_time_to_first_token_seconds_count") >= n_req
    assert m(s1, "rolloutd_e2e_request_latency_seconds_count") - m(s0, "rolloutd_e2e_request_latency_seconds_count") >= n_req
    assert m(s1, "rolloutd_inter_token_latency_seconds_count") > m(s0, "rolloutd_inter_token_latency_seconds_count")
    assert m(s1, "rolloutd_e2e_request_latency_seconds_sum") > m(s0, "rolloutd_e2e_request_latency_seconds_sum")
    g0 = s0.get(("rolloutd_http_responses_total", (("code", '"200"'), ("route", '"/generate"'))), 0)
    assert m(s1, "rolloutd_http_responses_total", route="/generate", code=200) - g0 == n_req
    assert m(s1, "rolloutd_kv_cache_pages_total") > 0
    assert m(s1, "rolloutd_max_total_num_tokens") == 16 * m(s1, "rolloutd_kv_cache_pages_total")
    assert m(s1, "process_resident_memory_bytes") > 1e6
    daemon.post("/generate", {"input_ids": [1]})  # a 200 and a 400 are counted apart
    daemon.post("/generate", {"input_ids": "x"})
    s2 = metrics(daemon, refresh=True)
    assert m(s2, "rolloutd_http_responses_total", route="/generate", code=400) >= 1


# ---------------------------------------------------------------- abort

def test_abort_by_rid_returns_partial_output(daemon):
    before = m(metrics(daemon), "rolloutd_generation_tokens_total")
    t, box = in_background(daemon, {**LONG, "rid": "to-abort"})
    generating(daemon, before)
    r = daemon.post("/abort_request", {"rid": "to-abort"})
    assert r.status_code == 200 and r.json() == {"success": True, "aborted": 1}
    t.join(timeout=60)
    o = box["r"].json()
    assert o["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(o["output_ids"]) < 3000
    assert len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"])
    assert daemon.post("/abort_request", {"rid": "nobody"}).json()["aborted"] == 0


def test_abort_all(daemon):
    before = m(metrics(daemon), "rolloutd_generation_tokens_total")
    jobs = [in_background(daemon, {**LONG, "rid": f"all-{i}"}) for i in range(2)]
    jobs.append(in_background(daemon, {"input_ids": [[1, 2], [3, 4]], "sampling_params": {
        "n": 2, "max_new_tokens": 3000, "ignore_eos": True}}))
    generating(daemon, before)
    wait_for(lambda: m(metrics(daemon), "rolloutd_http_requests_in_flight") == 3, what="3 in flight")
    r = daemon.post("/abort_request", {"abort_all": True})
    assert r.status_code == 200 and r.json()["aborted"] == 3
    for t, box in jobs:
        t.join(timeout=60)
        out = box["r"].json()
        for o in out if isinstance(out, list) else [out]:
            assert o["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(o["output_ids"]) < 3000


# ---------------------------------------------------------------- pause / continue / flush

def test_pause_abort_then_continue(daemon):
    before = m(metrics(daemon), "rolloutd_generation_tokens_total")
    t, box = in_background(daemon, {**LONG, "rid": "p-abort"})
    generating(daemon, before)
    r = daemon.post("/pause_generation", {})  # SGLang's default mode: abort
    assert r.status_code == 200 and r.json()["status"] == "ok"
    t.join(timeout=60)
    assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert m(metrics(daemon), "rolloutd_paused") == 1
    # new requests are accepted while paused, and wait
    t2, box2 = in_background(daemon, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    time.sleep(0.3)
    assert "r" not in box2
    assert daemon.post("/continue_generation", None).status_code == 200
    t2.join(timeout=60)
    assert len(box2["r"].json()["output_ids"]) == 3
    assert m(metrics(daemon), "rolloutd_paused") == 0


def test_pause_retract_recomputes_after_continue(daemon):
    before = m(metrics(daemon), "rolloutd_generation_tokens_total")
    body = {"rid": "p-retract", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
    t, box = in_background(daemon, body)
    generating(daemon, before)
    try:
        assert daemon.post("/pause_generation", {"mode": "retract"}).status_code == 200
        s = metrics(daemon)
        assert m(s, "rolloutd_num_running_reqs") == 0 and m(s, "rolloutd_num_waiting_reqs") == 1
        assert m(s, "rolloutd_kv_cache_usage_ratio") == 0  # its pages went back
        tokens = m(s, "rolloutd_generation_tokens_total")
        time.sleep(0.3)
        assert m(metrics(daemon), "rolloutd_generation_tokens_total") == tokens  # nothing runs while paused
    finally:
        assert daemon.post("/continue_generation", {}).status_code == 200
    t.join(timeout=120)
    o = box["r"].json()
    assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 600}
    assert o["meta_info"]["num_retractions"] >= 1


def test_pause_in_place_keeps_kv_and_blocks_flush(daemon):
    before = m(metrics(daemon), "rolloutd_generation_tokens_total")
    body = {"rid": "p-inplace", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
    t, box = in_background(daemon, body)
    generating(daemon, before)
    try:
        assert daemon.post("/pause_generation", {"mode": "in_place"}).status_code == 200
        s = metrics(daemon)
        assert m(s, "rolloutd_num_running_reqs") == 1 and m(s, "rolloutd_kv_cache_usage_ratio") > 0
        tokens = m(s, "rolloutd_generation_tokens_total")
        time.sleep(0.3)
        assert m(metrics(daemon), "rolloutd_generation_tokens_total") == tokens
        r = daemon.post("/flush_cache", None)
        assert r.status_code == 409 and r.json()["error"]["type"] == "conflict"
    finally:
        assert daemon.post("/continue_generation", {}).status_code == 200
    t.join(timeout=120)
    o = box["r"].json()
    assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 600}
    assert o["meta_info"]["num_retractions"] == 0


def test_flush_cache_conflict_while_running_then_ok(daemon):
    before = m(metrics(daemon), "rolloutd_generation_tokens_total")
    t, box = in_background(daemon, {**LONG, "rid": "flush-busy"})
    generating(daemon, before)
    r = daemon.post("/flush_cache", None)
    assert r.status_code == 409, r.text
    assert "in flight" in r.json()["error"]["message"]
    daemon.post("/abort_request", {"rid": "flush-busy"})
    t.join(timeout=60)
    wait_for(lambda: daemon.post("/flush_cache", None).status_code == 200, what="flush after the abort")
    assert daemon.get("/flush_cache").status_code == 200  # GET too, as SGLang
    s = metrics(daemon)
    assert m(s, "rolloutd_kv_cache_pages_cached") == 0


def test_control_bodies_are_checked(daemon):
    r = daemon.post("/pause_generation", {"mode": "keep"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    r = daemon.post("/continue_generation", {"now": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "now"
    r = daemon.post("/abort_request", {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    assert m(metrics(daemon), "rolloutd_paused") == 0  # a rejected request changes nothing


# ---------------------------------------------------------------- health and info

def test_health_generate(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--health-generate-timeout", "0.5")
    r = d.get("/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert d.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    t0 = time.time()
    r = d.get("/health_generate")  # the probe cannot run while paused
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
    assert "0.5" in r.json()["error"]["message"]
    assert 0.4 < time.time() - t0 < 5
    assert d.get("/health").status_code == 200  # paused is not unhealthy
    assert d.post("/continue_generation", None).status_code == 200
    assert d.get("/health_generate").status_code == 200
    assert d.post("/health_generate", None).status_code == 405
    # probes are not requests: the request and token metrics do not count them (SGLang's probe
    # sets log_metrics off), the HTTP ones do
    s0 = metrics(d)
    for _ in range(3):
        assert d.get("/health_generate").status_code == 200
    s1 = metrics(d)
    for name in ("rolloutd_requests_finished_total", "sglang:num_requests_total", "rolloutd_generation_tokens_total",
                 "rolloutd_prompt_tokens_total", "rolloutd_e2e_request_latency_seconds_count",
                 "rolloutd_time_to_first_token_seconds_count"):
        assert m(s1, name) == m(s0, name), name
    assert m(s1, "rolloutd_http_responses_total", route="/health_generate", code="200") == \
        m(s0, "rolloutd_http_responses_total", route="/health_generate", code="200") + 3


def test_health_generate_timeouts_in_a_crowd(rolloutd):
    """Probes that time out while generation is paused are answered 503 by the disconnect scan,
    which aborts their jobs; the engine then ends each job and frees its request, while the HTTP
    thread finishes the answer (on_completed) and asks for the same abort. Many at once, a few
    rounds: the daemon answers every one and exits cleanly. on_completed once read the rid of a
    request the engine had just freed (an ASan abort, seen once in test_health_generate on a busy
    machine); the window is narrow and timing-dependent, so this crowd raises its odds rather
    than reproducing it every run."""
    d = rolloutd(None, "--kv-cache-mb", "64", "--health-generate-timeout", "0.2")
    assert d.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    for _ in range(3):
        boxes = [{} for _ in range(24)]
        threads = [threading.Thread(target=lambda b=b: b.setdefault("r", d.get("/health_generate"))) for b in boxes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert [b["r"].status_code for b in boxes] == [503] * len(boxes)
    assert d.post("/continue_generation", None).status_code == 200
    assert d.get("/health_generate").status_code == 200


def test_health_generate_survives_abort_all_and_pause_abort(rolloutd):
    """A probe is not a user request: /abort_request abort_all and /pause_generation (mode abort)
    that hit it while it waits in the queue leave it there, and it answers 200 once generation
    continues (before, each answered 503 "the health probe was aborted")."""
    d = rolloutd(None, "--kv-cache-mb", "64")
    for hit in ({"path": "/abort_request", "body": {"abort_all": True}},
                {"path": "/pause_generation", "body": {"mode": "abort"}}):
        assert d.post("/pause_generation", {"mode": "in_place"}).status_code == 200
        user_t, user_box = in_background(d, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
        probe_box = {}
        probe_t = threading.Thread(target=lambda: probe_box.setdefault("r", d.get("/health_generate")))
        probe_t.start()
        wait_for(lambda: m(metrics(d), "rolloutd_num_waiting_reqs") == 2, what="the probe and a request queued")
        r = d.post(hit["path"], hit["body"])
        assert r.status_code == 200, r.text
        if hit["path"] == "/abort_request":
            assert r.json()["aborted"] == 1  # the user's request, not the probe
        user_t.join(timeout=60)
        assert user_box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert "r" not in probe_box
        assert d.post("/continue_generation", {}).status_code == 200
        probe_t.join(timeout=60)
        assert probe_box["r"].status_code == 200, (hit, probe_box["r"].text)


def setting_names():
    out = subprocess.run([BIN, "--help"], capture_output=True, text=True, check=True).stdout
    names = re.findall(r"^  --([a-z0-9-]+) ", out, re.M)
    return [n for n in names if n not in ("config", "help")]


def test_server_info_lists_every_setting(daemon):
    info = daemon.get("/get_server_info").json()
    names = setting_names()
    assert len(names) >= 30
    for n in names:
        assert n.replace("-", "_") in info, n
    assert info["kv_cache_mb"] == 64 and info["log_level"] == "debug"
    assert info["backend"] == "cpu" and info["version"]
    assert info["numerics"] == "exact"  # the default, auto: exact on the CPU backend
    assert info["max_total_num_tokens"] == 16 * metrics(daemon)[("rolloutd_kv_cache_pages_total", ())]
    assert info["memory_usage"]["weight_bytes"] > 1e6 and info["memory_usage"]["kv_cache_bytes"] == 64 << 20
    assert info["page_size"] == 16 and info["max_context_len"] == 4096
    assert daemon.get("/server_info").json()["version"] == info["version"]


def test_capacity_published_before_the_first_request(rolloutd):
    """SGLang-shaped trainers size their batches from max_total_num_tokens right after /health turns
    200: the KV capacity is there before any request ran an engine step."""
    d = rolloutd(None, "--kv-cache-mb", "32")
    info = d.get("/get_server_info").json()
    pages = metrics(d)[("rolloutd_kv_cache_pages_total", ())]
    assert pages > 0, "kv_cache_pages_total reads 0 before the first engine step"
    assert info["max_total_num_tokens"] == 16 * pages > 0, info["max_total_num_tokens"]
    assert info["memory_usage"]["token_capacity"] == 16 * pages
    assert info["internal_states"][0]["memory_usage"]["token_capacity"] == 16 * pages
    assert metrics(d)[("rolloutd_kv_cache_pages_free", ())] == pages


def test_model_info_and_weight_version(daemon):
    mi = daemon.get("/get_model_info").json()
    assert mi["architecture"] == "Qwen3ForCausalLM" and mi["is_generation"] is True
    assert mi["weight_version"] == "0" and mi["kv_cache_dtype"] == "fp8" and mi["quantization"] in ("fp8", "bf16")
    assert mi["model_path"] and mi["vocab_size"] == 8192
    assert daemon.get("/get_weight_version").json() == {"weight_version": "0"}


ROUTES = [("GET", "/health_generate"), ("POST", "/generate"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
          ("GET", "/get_model_info"), ("GET", "/get_server_info"), ("GET", "/get_weight_version"),
          ("POST", "/abort_request"), ("POST", "/pause_generation"), ("POST", "/continue_generation"),
          ("POST", "/flush_cache")]


def test_api_key_on_every_route(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--api-key", "k3y")
    for method, path in ROUTES:
        r = requests.request(method, d.url + path, timeout=30)
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["type"] == "unauthorized"
        r = requests.request(method, d.url + path, headers={"Authorization": "Bearer nope"}, timeout=30)
        assert r.status_code == 401, path
    for path in ("/health", "/metrics"):
        assert requests.get(d.url + path, timeout=30).status_code == 200
    auth = {"Authorization": "Bearer k3y"}
    assert requests.get(d.url + "/get_model_info", headers=auth, timeout=30).status_code == 200
    assert requests.post(d.url + "/abort_request", json={"abort_all": True}, headers=auth, timeout=30).status_code == 200
    assert requests.post(d.url + "/continue_generation", headers=auth, timeout=30).status_code == 200
