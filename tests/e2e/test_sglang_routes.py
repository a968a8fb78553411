"""SGLang's route aliases and control semantics:
  - /model_info and /server_info answer what /get_model_info and /get_server_info answer;
  - GET /get_load in SGLang's shape (a list with one entry per data-parallel rank: dp_rank,
    num_reqs = running + waiting, num_waiting_reqs, num_tokens = KV tokens in use + waiting
    tokens, num_pages), following the engine while requests run and queue, and GET /v1/loads
    (SGLang's newer route, {"loads": [...]}, which slime's abort_server_until_idle polls with
    ?include=core) with num_running_reqs and token_usage besides, against /metrics;
  - /server_info carries the SGLang server arguments slime compares for an external engine
    (enable_memory_saver, dtype, enable_return_routed_experts, ...) with rolloutd's values;
  - abort_all_requests (and AReaL's spelling abort_all_request) on every weight-update route that
    commits: requests in flight are aborted before the commit and come back with the tokens they had,
    finish type "abort", all from the old weights; without it they carry on across the update;
  - master_port as an integer or a string of decimal digits.
Requests are frozen with /pause_generation in_place while the update is sent, so "in flight" does not
depend on timing.
"""
import threading
import time

import pytest

from conftest import Daemon
from test_golden import BF16_ARGS
from test_ops import generating, m, metrics, wait_for
# (test_weight_sync puts clients/python on sys.path)
from test_weight_sync import MODELS, ORIG, PERT, _write_all, weights
from rolloutd_client.shm import ALIGN, Segment  # noqa: E402

LONG = {"return_logprob": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(ORIG, [*BF16_ARGS, "--kv-cache-mb", "32", "--allowed-weight-dir", MODELS, "--max-running", "2"],
               tmp_path_factory.mktemp("routes") / "rolloutd.log")
    yield d
    rc = d.stop()
    assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"


@pytest.fixture(autouse=True)
def settled(daemon):
    """After each test, whatever it left: generation resumed, every request aborted, the engine idle,
    so that one failing test does not leave the next a paused daemon."""
    yield
    daemon.post("/continue_generation", {})
    daemon.post("/abort_request", {"abort_all": True})
    wait_for(lambda: load(daemon)["num_reqs"] == 0, timeout=60.0, what="idle after the test")


def test_info_aliases(daemon):
    a, b = daemon.get("/get_model_info"), daemon.get("/model_info")
    assert a.status_code == b.status_code == 200 and a.json() == b.json()
    a, b = daemon.get("/get_server_info").json(), daemon.get("/server_info").json()
    a.pop("uptime_s"), b.pop("uptime_s")
    a.pop("internal_states"), b.pop("internal_states")
    assert a == b


def test_server_info_answers_slimes_external_engine_check(daemon):
    """slime (sglang_engine.py _init_external) asserts that an external engine's /server_info has
    each server argument slime would have launched it with: enable_memory_saver = offload_rollout
    (False unless the trainer offloads a colocated engine), plus dtype "float16" under --fp16 and
    enable_return_routed_experts under routing replay, which rolloutd does not do."""
    info = daemon.get("/server_info").json()
    assert info["enable_memory_saver"] is False
    assert info["dtype"] == "bfloat16" and info["enable_return_routed_experts"] is False
    assert info["disaggregation_mode"] == "null" and info["encoder_only"] is False  # slime: a regular worker
    assert info["tp_size"] == info["pp_size"] == info["ep_size"] == info["dp_size"] == 1


def load(d):
    r = d.get("/get_load")
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    body = r.json()
    assert isinstance(body, list) and len(body) == 1
    assert set(body[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pages"}
    assert body[0]["dp_rank"] == 0
    return body[0]


def start(d, bodies):
    out = [None] * len(bodies)

    def one(i, b):
        out[i] = d.post("/generate", b)
    threads = [threading.Thread(target=one, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    return threads, out


MAX_RUNNING = 2  # the daemon's --max-running


def running(d):
    body = load(d)
    return body["num_reqs"] - body["num_waiting_reqs"]


def frozen_in_flight(d, n, attempts=5):
    """Starts n long requests (2 run, the rest wait: --max-running 2), lets them produce tokens, and
    freezes them in place. The fixture model makes 400 tokens in a fraction of a second, so a
    request can finish between seeing tokens and the pause; and a request that arrives after a step
    began waits for the next boundary, so at the pause a running slot may still be free (seen under
    ASan). Either way the attempt is let run out and made again."""
    for _ in range(attempts):
        before = m(metrics(d), "rolloutd_generation_tokens_total")
        threads, out = start(d, [dict(LONG, input_ids=[7 + i, 8, 9, 10], rid=f"long-{i}",
                                      sampling_params=dict(LONG["sampling_params"], sampling_seed=i))
                                 for i in range(n)])
        generating(d, before)
        assert d.post("/pause_generation", {"mode": "in_place"}).status_code == 200
        try:
            wait_for(lambda: load(d)["num_reqs"] == n and running(d) == min(n, MAX_RUNNING), timeout=3.0,
                     what="every request admitted, the running slots taken")
            return threads, out
        except AssertionError:  # one finished, or one was not yet running, at the pause
            finish(d, threads, out)
            wait_for(lambda: load(d)["num_reqs"] == 0, what="idle again")
    raise AssertionError(f"requests finished before the pause in {attempts} attempts")


def finish(d, threads, out):
    assert d.post("/continue_generation", {}).status_code == 200
    for t in threads:
        t.join(timeout=120)
    return [r.json() for r in out]


def loads(d):
    r = d.get("/v1/loads?include=core")
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    body = r.json()
    assert set(body) == {"loads"} and isinstance(body["loads"], list) and len(body["loads"]) == 1
    entry = body["loads"][0]
    assert set(entry) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pages", "num_running_reqs",
                          "token_usage"}
    return entry


def test_get_load_follows_the_engine(daemon):
    idle = load(daemon)
    assert idle["num_reqs"] == 0 and idle["num_waiting_reqs"] == 0 and idle["num_tokens"] == 0
    assert loads(daemon)["num_running_reqs"] == 0 and loads(daemon)["token_usage"] == 0.0
    threads, out = frozen_in_flight(daemon, 3)
    busy = load(daemon)
    assert busy["num_reqs"] == 3 and busy["num_waiting_reqs"] == 1
    assert busy["num_tokens"] >= 3 * 4 and busy["num_pages"] >= 3  # two running, one waiting 4-token prompt
    v1 = loads(daemon)  # frozen: nothing moves between the reads
    assert {k: v1[k] for k in busy} == busy
    assert v1["num_running_reqs"] == 2 and v1["num_running_reqs"] + v1["num_waiting_reqs"] == v1["num_reqs"]
    mt = metrics(daemon)
    total, free = m(mt, "rolloutd_kv_cache_pages_total"), m(mt, "rolloutd_kv_cache_pages_free")
    assert v1["token_usage"] == pytest.approx((total - free) / total) and v1["token_usage"] > 0
    assert daemon.post("/abort_request", {"abort_all": True}).status_code == 200
    for o in finish(daemon, threads, out):
        assert o["meta_info"]["finish_reason"]["type"] == "abort"
    wait_for(lambda: load(daemon)["num_reqs"] == 0, what="idle again")


def check_aborted(outs, old_version):
    produced = 0
    for o in outs:
        meta = o["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta["finish_reason"]
        n = len(o["output_ids"])
        assert n < LONG["sampling_params"]["max_new_tokens"]
        assert len(meta["output_token_logprobs"]) == n  # the partial output keeps its logprobs
        assert [s[0] for s in meta["weight_version_spans"]] == [old_version]  # nothing from the new weights
        produced += n
    assert produced > 0


def version(d):
    return d.get("/get_weight_version").json()["weight_version"]


@pytest.mark.parametrize("flag", ["abort_all_requests", "abort_all_request"])
def test_version_update_aborts_in_flight(daemon, flag):
    old = version(daemon)
    threads, out = frozen_in_flight(daemon, 3)
    r = daemon.post("/update_weight_version", {"new_version": f"v-{flag}", flag: True})
    assert r.status_code == 200, r.text
    check_aborted(finish(daemon, threads, out), old)
    assert version(daemon) == f"v-{flag}"


def test_version_update_without_abort_keeps_requests(daemon):
    # one request: frozen_in_flight knows that tokens were produced, not that each of several
    # requests produced some (a second one admitted just before the pause has none from `old`)
    old = version(daemon)
    threads, out = frozen_in_flight(daemon, 1)
    r = daemon.post("/update_weight_version", {"new_version": "relabel", "abort_all_requests": False})
    assert r.status_code == 200, r.text
    for o in finish(daemon, threads, out):
        assert o["meta_info"]["finish_reason"]["type"] == "length"
        assert [s[0] for s in o["meta_info"]["weight_version_spans"]] == [old, "relabel"]


def test_disk_update_aborts_in_flight_areal_spelling(daemon):
    old = version(daemon)
    threads, out = frozen_in_flight(daemon, 3)
    r = daemon.post("/update_weights_from_disk", {"model_path": str(PERT), "weight_version": "disk-abort",
                                                  "abort_all_request": True, "load_format": None})
    assert r.status_code == 200, r.text
    assert r.json()["committed"] is True
    check_aborted(finish(daemon, threads, out), old)
    assert version(daemon) == "disk-abort"


def test_shm_update_aborts_in_flight(daemon):
    old = version(daemon)
    sd = weights(ORIG)
    seg = Segment(sum((len(v[0]) + ALIGN - 1) // ALIGN * ALIGN for v in sd.values()))
    try:
        threads, out = frozen_in_flight(daemon, 2)
        body = {"shm_name": seg.name, "tensors": _write_all(sd, seg), "is_last": True, "weight_version": "shm-abort",
                "abort_all_requests": True, "flush_cache": True}
        r = daemon.post("/update_weights_from_shm", body)
        assert r.status_code == 200, r.text
        check_aborted(finish(daemon, threads, out), old)
        assert version(daemon) == "shm-abort"
    finally:
        seg.close()


def test_both_spellings_at_once_are_refused(daemon):
    r = daemon.post("/update_weight_version", {"new_version": "x", "abort_all_requests": True,
                                               "abort_all_request": True})
    assert r.status_code == 400 and "give one of them" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("port,ok", [(29711, True), ("29711", True), ("0", False), ("65536", False), ("2971a", False),
                                     ("", False), (" 29711", False), (29711.0, True), (29711.5, False),
                                     (True, False)])
def test_master_port_integer_or_decimal_string(daemon, port, ok):
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "g-port"}
    r = daemon.post("/init_weights_update_group", body)
    err = r.json().get("error", {})
    if ok:  # parsed: whatever this build then says about NCCL, it is not about the port
        assert err.get("param") != "master_port", r.text
    else:
        assert r.status_code == 400 and err["param"] == "master_port", r.text
