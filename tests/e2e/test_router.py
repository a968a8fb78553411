"""sglang-router in front of rolloutd: the real router (the Rust load balancer on PyPI that slime and
AReaL put in front of their SGLang workers) over two daemons.

The router is installed into a throwaway venv under build/ (pip from PyPI, once; later runs reuse
it); where that cannot be done the tests skip, saying why. ROLLOUTD_ROUTER_SPEC picks another pip
requirement (default: the version these tests were written against). The router probes /health,
/model_info or /get_model_info and /server_info or /get_server_info, re-serializes every /generate
with SGLang's defaults filled in ("model": null, "return_text_in_logprobs": false, "log_metrics":
true, ...) and every /v1/completions with SGLang's CompletionRequest defaults ("no_stop_trim",
"skip_special_tokens", "return_hidden_states"), and fans /flush_cache out to every worker. These
tests check that rolloutd accepts all of that and that what comes back through the router is the
daemons' own answer: greedy outputs through the router equal the ones a daemon gives directly,
for one prompt, a batch, n > 1, streaming and /v1/completions; both daemons get traffic; a flush
through the router empties both prefix caches.

The router's /v1/completions takes string prompts only (its CompletionRequest has no token-id
form), so that route is compared with whatever the daemon answers directly to the same body: the
completion where the daemon has a tokenizer for text, its own 400 naming `prompt` where it has not.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import ROOT, Daemon, free_port, tool_venv

ROUTER_SPEC = os.environ.get("ROLLOUTD_ROUTER_SPEC", "sglang-router==0.3.2")
GREEDY = {"max_new_tokens": 6, "temperature": 0}


def router_python():
    """The venv's python with sglang-router importable (conftest.tool_venv)."""
    return tool_venv("router-venv", ROUTER_SPEC, "import sglang_router.launch_router")


class Router:
    """sglang-router over `workers`, round robin, bound to loopback (its metrics listener too)."""

    def __init__(self, python, workers, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", "round_robin",
               "--log-level", "warn", "--worker-startup-timeout-secs", "120", "--worker-urls",
               *[w.url for w in workers]]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                w = requests.get(self.url + "/workers", timeout=2).json()
                if sum(1 for x in w.get("workers", []) if x.get("is_healthy")) == len(workers):
                    return
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"sglang-router did not report {len(workers)} healthy workers:\n{self.read_log()}")

    def read_log(self):
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def post(self, path, body, **kw):
        return requests.post(self.url + path, json=body, timeout=120, **kw)

    def get(self, path):
        return requests.get(self.url + path, timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _start_daemons(tmp, n):
    out, errors = [None] * n, []

    def start(i):
        try:
            out[i] = Daemon(None, ["--threads", "1", "--kv-cache-mb", "64"], tmp / f"rolloutd-{i}.log")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for d in out:
            if d is not None:
                d.stop()
        raise errors[0]
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    python = router_python()  # skips before any daemon starts
    tmp = tmp_path_factory.mktemp("router")
    daemons = _start_daemons(tmp, 2)
    try:
        router = Router(python, daemons, tmp / "router.log")
    except Exception:
        for d in daemons:
            d.stop()
        raise
    yield router, daemons
    router.stop()
    for d in daemons:
        rc = d.stop()
        assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"


def finished(d):
    for line in d.get("/metrics").text.splitlines():
        if line.startswith("rolloutd_requests_finished_total "):
            return float(line.split()[1])
    raise AssertionError("rolloutd_requests_finished_total is not exported")


def test_router_generate_single_batched_n(fleet):
    router, daemons = fleet
    one = {"input_ids": [5, 6, 7], "sampling_params": GREEDY}
    direct = [d.post("/generate", one).json()["output_ids"] for d in daemons]
    assert direct[0] == direct[1] and len(direct[0]) == 6  # the same weights: either daemon is the reference
    before = [finished(d) for d in daemons]
    for _ in range(4):  # round robin: both daemons answer
        r = router.post("/generate", dict(one, return_logprob=True))
        assert r.status_code == 200, r.text
        o = r.json()
        assert o["output_ids"] == direct[0]
        assert [t[1] for t in o["meta_info"]["output_token_logprobs"]] == direct[0]
    assert all(finished(d) > b for d, b in zip(daemons, before)), "the router sent everything to one daemon"

    batch = {"input_ids": [[5, 6, 7], [8, 9], [10, 11, 12, 13]], "sampling_params": GREEDY}
    want = [o["output_ids"] for o in daemons[1].post("/generate", batch).json()]
    r = router.post("/generate", batch)
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == want

    r = router.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "n": 3}})
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [direct[0]] * 3


def _events(r):
    return [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]


def test_router_streaming(fleet):
    router, daemons = fleet
    body = {"input_ids": [11, 12], "sampling_params": GREEDY}
    direct = daemons[1].post("/generate", body).json()
    for _ in range(2):  # one stream from each daemon
        r = router.post("/generate", dict(body, stream=True), stream=True)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
        assert events[-1] == b"[DONE]" and len(events) >= 3
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["output_ids"] == direct["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def _same_answer(via, direct):
    assert via.status_code == direct.status_code, (via.text, direct.text)
    a, b = via.json(), direct.json()
    if direct.status_code != 200:
        assert a["error"]["param"] == b["error"]["param"] and a["error"]["message"] == b["error"]["message"]
        return
    assert [(c["text"], c["token_ids"], c["finish_reason"]) for c in a["choices"]] == \
        [(c["text"], c["token_ids"], c["finish_reason"]) for c in b["choices"]]


def test_router_completions(fleet):
    router, daemons = fleet
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    direct = daemons[0].post("/v1/completions", body)
    if direct.status_code != 200:  # no tokenizer for text: the daemon's refusal must come back unchanged
        assert direct.json()["error"]["param"] == "prompt", direct.text
    for _ in range(2):
        _same_answer(router.post("/v1/completions", body), direct)
    batch = dict(body, prompt=["The capital of France is", "One, two,"])
    _same_answer(router.post("/v1/completions", batch), daemons[1].post("/v1/completions", batch))
    if direct.status_code == 200:
        r = router.post("/v1/completions", dict(body, stream=True), stream=True)
        assert r.status_code == 200, r.text
        chunks = [json.loads(e) for e in _events(r)[:-1]]
        assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == \
            direct.json()["choices"][0]["token_ids"]


def test_router_flush_cache_and_workers(fleet):
    router, daemons = fleet
    body = {"input_ids": list(range(40, 80)), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    for d in daemons:  # the prompt is cached on both
        d.post("/generate", body)
        assert d.post("/generate", body).json()["meta_info"]["cached_tokens"] > 0
    r = router.post("/flush_cache", {})
    assert r.status_code == 200, r.text
    assert r.json().get("workers_flushed") == 2, r.text
    for d in daemons:
        assert d.post("/generate", body).json()["meta_info"]["cached_tokens"] == 0
    w = router.get("/workers").json()
    assert sorted(x["url"] for x in w["workers"]) == sorted(d.url for d in daemons)
    assert all(x["is_healthy"] for x in w["workers"])
    assert {x["model_id"] for x in w["workers"]} == {"default"}  # read from the daemons' model info


def test_router_probed_routes(fleet):
    """What the router reads from each worker: JSON answers, SGLang's names and the get_ aliases."""
    _, daemons = fleet
    d = daemons[0]
    for path in ("/health", "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/get_load"):
        r = d.get(path)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["content-type"].startswith("application/json"), (path, r.headers)
        r.json()
    assert d.get("/model_info").json() == d.get("/get_model_info").json()
    info = d.get("/server_info").json()
    assert info.get("tp_size", 1) == 1 and info.get("dp_size", 1) == 1


def test_fleet_client_through_router(fleet):
    """rolloutd_client.Fleet with router_url generates through the router."""
    sys.path.insert(0, str(ROOT / "clients" / "python"))
    from rolloutd_client import Fleet

    router, daemons = fleet
    f = Fleet([d.url for d in daemons], router_url=router.url, load_poll_s=0)
    try:
        want = [o["output_ids"] for o in daemons[0].post(
            "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": GREEDY}).json()]
        outs = f.generate([[5, 6, 7], [8, 9]], max_new_tokens=6, temperature=0)
        assert [o.output_ids.tolist() for o in outs] == want
        assert {o.server for o in outs} == {router.url}
    finally:
        f.close()
