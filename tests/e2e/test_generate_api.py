"""POST /generate against the real daemon: response shapes (single, batched, n > 1), finish reasons,
logprob lists, stop tokens and limits, seeded and greedy reproducibility, concurrency, auth-free
/health, the drain on SIGTERM, payloads shaped like the ones slime and veRL send, streaming (SSE:
cumulative, incremental, batched with indices), and client disconnects (plain and streamed) aborting
their jobs.

The embedded default model has random weights (vocab 8192), so tests assert structure and
reproducibility, never particular tokens.
"""
import json
import math
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Daemon

META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
             "num_retractions", "e2e_latency", "weight_version_spans"}
LOGPROB_KEYS = {"output_token_logprobs", "input_token_logprobs", "output_top_logprobs", "input_top_logprobs"}
PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(None, ["--kv-cache-mb", "256"], tmp_path_factory.mktemp("generate") / "rolloutd.log")
    yield d
    rc = d.stop()
    assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"


def generate(d, body, status=200):
    r = d.post("/generate", body)
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"] == "application/json"
    return r.json()


def check_output(o, prompt_len, logprobs=False):
    assert set(o) == {"text", "output_ids", "meta_info"}  # the default model has a tokenizer.json: text too
    assert isinstance(o["text"], str)
    m = o["meta_info"]
    assert set(m) == META_KEYS | (LOGPROB_KEYS if logprobs else set())
    ids = o["output_ids"]
    assert all(isinstance(t, int) and 0 <= t < 8192 for t in ids)
    assert m["completion_tokens"] == len(ids)
    assert m["prompt_tokens"] == prompt_len
    assert isinstance(m["cached_tokens"], int) and m["cached_tokens"] >= 0
    assert isinstance(m["weight_version"], str)
    assert m["num_retractions"] == 0
    assert isinstance(m["e2e_latency"], float) and m["e2e_latency"] >= 0
    assert m["weight_version_spans"] == [[m["weight_version"], 0, len(o["output_ids"])]]  # no update crossed
    fr = m["finish_reason"]
    assert fr["type"] in ("stop", "length")
    if fr["type"] == "length":
        assert fr == {"type": "length", "length": len(ids)}
    else:
        assert set(fr) == {"type", "matched"} and fr["matched"] == ids[-1]
    if logprobs:
        lps = m["output_token_logprobs"]
        assert len(lps) == m["completion_tokens"]
        for (lp, tok, text), t in zip(lps, ids):
            assert tok == t and text is None
            assert isinstance(lp, float) and lp <= 0 and math.isfinite(lp)
        assert m["output_top_logprobs"] == [] and m["input_top_logprobs"] == []


def test_single_shape(daemon):
    o = generate(daemon, {"rid": "one", "input_ids": PROMPT,
                          "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
    assert isinstance(o, dict)
    check_output(o, len(PROMPT))
    assert o["meta_info"]["id"] == "one"
    assert len(o["output_ids"]) == 8
    assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_generated_rid_and_put(daemon):
    o = generate(daemon, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    assert o["meta_info"]["id"].startswith("req-")
    import requests
    r = requests.put(daemon.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}},
                     timeout=60)
    assert r.status_code == 200, r.text  # SGLang accepts PUT too


def test_logprobs(daemon):
    o = generate(daemon, {"input_ids": PROMPT, "return_logprob": True,
                          "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
    check_output(o, len(PROMPT), logprobs=True)
    assert o["meta_info"]["input_token_logprobs"] == []  # logprob_start_len -1: outputs only


def test_input_token_logprobs_from_zero(daemon):
    o = generate(daemon, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                          "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    check_output(o, len(PROMPT), logprobs=True)
    inp = o["meta_info"]["input_token_logprobs"]
    assert len(inp) == len(PROMPT)
    assert inp[0] == [None, PROMPT[0], None]  # no context for the first token
    for (lp, tok, text), t in zip(inp[1:], PROMPT[1:]):
        assert tok == t and text is None and isinstance(lp, float) and lp <= 0


def test_input_token_logprobs_from_two(daemon):
    o = generate(daemon, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 2,
                          "sampling_params": {"max_new_tokens": 1}})
    inp = o["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inp] == PROMPT[2:]
    assert all(isinstance(lp, float) for lp, _, _ in inp)
    # the same positions scored from 0 give the same numbers
    full = generate(daemon, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                             "sampling_params": {"max_new_tokens": 1}})["meta_info"]["input_token_logprobs"]
    assert [lp for lp, _, _ in inp] == pytest.approx([lp for lp, _, _ in full[2:]], abs=1e-5)


def test_scoring_without_generating(daemon):
    o = generate(daemon, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                          "sampling_params": {"max_new_tokens": 0}})
    assert o["output_ids"] == []
    assert o["meta_info"]["completion_tokens"] == 0
    assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(o["meta_info"]["input_token_logprobs"]) == len(PROMPT)


def test_batched_shape(daemon):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    out = generate(daemon, {"rid": "b", "input_ids": prompts, "return_logprob": True,
                            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert isinstance(out, list) and len(out) == 3
    for p, o in enumerate(out):
        check_output(o, len(prompts[p]), logprobs=True)
        assert o["meta_info"]["id"] == f"b_{p}"
    out = generate(daemon, {"rid": ["x", "y"], "input_ids": prompts[:2], "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["id"] for o in out] == ["x", "y"]
    out = generate(daemon, {"input_ids": [[5, 6]], "sampling_params": {"max_new_tokens": 1}})
    assert isinstance(out, list) and len(out) == 1  # a batch of one is still a list


def test_n_samples_shape(daemon):
    out = generate(daemon, {"rid": "g", "input_ids": PROMPT,
                            "sampling_params": {"n": 4, "max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True,
                                                "sampling_seed": 7}})
    assert isinstance(out, list) and len(out) == 4
    for s, o in enumerate(out):
        check_output(o, len(PROMPT))
        assert o["meta_info"]["id"] == f"g_{s}"
    assert len({tuple(o["output_ids"]) for o in out}) > 1  # samples differ


def test_batched_n_prompt_major(daemon):
    prompts = [[1, 2], [3, 4, 5, 6]]
    out = generate(daemon, {"rid": "m", "input_ids": prompts,
                            "sampling_params": {"n": 3, "max_new_tokens": 2, "ignore_eos": True}})
    assert len(out) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 2, 2, 4, 4, 4]
    assert [o["meta_info"]["id"] for o in out] == ["m_0_0", "m_0_1", "m_0_2", "m_1_0", "m_1_1", "m_1_2"]


def test_max_new_tokens_respected(daemon):
    for n in (1, 5, 17):
        o = generate(daemon, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}})
        assert len(o["output_ids"]) == n
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": n}


def test_stop_token_ids_respected(daemon):
    # seeded sampling is reproducible, so the run with a stop token follows the same path until it stops
    base = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 99}}
    ids = generate(daemon, base)["output_ids"]
    k = next((i for i in range(2, len(ids)) if ids[i] not in ids[:i]), None)
    assert k is not None, ids
    stop = ids[k]
    o = generate(daemon, {**base, "sampling_params": {**base["sampling_params"], "stop_token_ids": [stop]}})
    assert o["output_ids"] == ids[:k + 1]
    assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # min_new_tokens keeps going past an early stop token
    o = generate(daemon, {**base, "sampling_params": {**base["sampling_params"], "stop_token_ids": [stop],
                                                      "min_new_tokens": k + 1}})
    assert len(o["output_ids"]) > k + 1 or o["meta_info"]["finish_reason"]["type"] == "length"


def test_finish_checks_are_sglangs_on_generate(daemon):
    """SGLang's Req.check_finished on /generate: max_new_tokens is checked before stop tokens and stop
    strings, and ignore_eos turns stop_token_ids off too. /v1/completions keeps vLLM's: a stop
    finishes "stop" on the last allowed token, and ignore_eos leaves stop_token_ids on."""
    sp = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 99, "ignore_eos": True}
    full = generate(daemon, {"input_ids": PROMPT, "sampling_params": sp})
    ids = full["output_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    stop = ids[k]

    def both(**kw):
        g = generate(daemon, {"input_ids": PROMPT, "sampling_params": {**sp, **kw}})
        c = daemon.post("/v1/completions", {"prompt": PROMPT, "max_tokens": kw.get("max_new_tokens", 12),
                                            "temperature": 1.0, "seed": 99, "ignore_eos": True,
                                            **{n: v for n, v in kw.items() if n != "max_new_tokens"}})
        assert c.status_code == 200, c.text
        return g, c.json()["choices"][0]

    # the stop token is the last allowed one
    g, c = both(max_new_tokens=k + 1, ignore_eos=False, stop_token_ids=[stop])
    assert g["output_ids"] == ids[:k + 1] and g["meta_info"]["finish_reason"] == {"type": "length", "length": k + 1}
    assert c["token_ids"] == ids[:k + 1] and c["finish_reason"] == "stop" and c["stop_reason"] == stop
    # that last token is text (it did not stop the output), with or without stop strings or a stream
    plain = generate(daemon, {"input_ids": PROMPT, "sampling_params": {**sp, "max_new_tokens": k + 1}})["text"]
    g2 = generate(daemon, {"input_ids": PROMPT, "sampling_params": {**sp, "max_new_tokens": k + 1, "ignore_eos": False,
                                                                    "stop_token_ids": [stop], "stop": ["\u2713no"]}})
    assert g["text"] == plain and g2["text"] == plain, (g["text"], g2["text"], plain)
    # ignore_eos with stop_token_ids
    g, c = both(stop_token_ids=[stop])
    assert g["output_ids"] == ids and g["meta_info"]["finish_reason"]["type"] == "length"
    assert c["token_ids"] == ids[:k + 1] and c["finish_reason"] == "stop"
    # a stop string completed by the last allowed token: length, and the text is not cut
    text = full["text"]
    piece = next((p for p in (text[j:j + 2] for j in range(len(text) - 1)) if p.strip() and text.count(p) == 1), None)
    assert piece is not None, text
    g1 = generate(daemon, {"input_ids": PROMPT, "sampling_params": {**sp, "stop": [piece]}})
    n = len(g1["output_ids"])
    assert g1["meta_info"]["finish_reason"] == {"type": "stop", "matched": piece}
    g, c = both(max_new_tokens=n, stop=[piece])
    assert g["output_ids"] == ids[:n] and g["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    assert piece in g["text"] and g1["text"] == g["text"][:g["text"].find(piece)]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == piece and piece not in c["text"]


def test_same_seed_same_output(daemon):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1234,
                                                     "ignore_eos": True}}
    a = generate(daemon, body)["output_ids"]
    b = generate(daemon, body)["output_ids"]
    assert a == b
    c = generate(daemon, {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 4321}})["output_ids"]
    assert c != a


def test_greedy_deterministic(daemon):
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    a = generate(daemon, body)
    b = generate(daemon, body)
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def test_concurrent_requests(daemon):
    def one(i):
        body = {"rid": f"c{i}", "input_ids": [1 + i, 2 + i, 3 + i], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4 + i % 5, "ignore_eos": True, "sampling_seed": i}}
        r = daemon.post("/generate", body)
        return i, r.status_code, r.json()

    with ThreadPoolExecutor(max_workers=16) as ex:
        results = list(ex.map(one, range(48)))
    for i, status, o in results:
        assert status == 200, o
        check_output(o, 3, logprobs=True)
        assert o["meta_info"]["id"] == f"c{i}"
        assert len(o["output_ids"]) == 4 + i % 5


def test_signal_during_start_up_exits_at_once(tmp_path):
    """A SIGTERM while the model loads (here a long KV calibration) ends the daemon at once with
    status 0, rather than when loading ends."""
    import subprocess
    from conftest import BIN, EXTRA_ARGS, free_port
    log = tmp_path / "rolloutd.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([BIN, "--port", str(free_port()), "--threads", "2", *EXTRA_ARGS,
                              "--kv-calib-tokens", "8192"], stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while "listening on" not in log.read_text(errors="replace"):
            assert p.poll() is None and time.time() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        time.sleep(0.3)
        assert p.poll() is None, "loading ended before the signal: the test needs a longer start-up"
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
        assert time.time() - t0 < 3
        assert "signal during start-up" in log.read_text(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()


def test_port_0_reports_the_bound_port(tmp_path):
    """--port 0 lets the system choose; /get_server_info reports the port in effect."""
    import re
    import subprocess
    import requests
    from conftest import BIN, EXTRA_ARGS
    log = tmp_path / "rolloutd.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([BIN, "--port", "0", "--threads", "2", "--kv-cache-mb", "64", *EXTRA_ARGS],
                             stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not (m := re.search(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))):
            assert p.poll() is None and time.time() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        port = int(m.group(1))
        while True:
            try:
                r = requests.get(f"http://127.0.0.1:{port}/get_server_info", timeout=5)
                if r.status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.time() < deadline
            time.sleep(0.05)
        assert port > 0 and r.json()["port"] == port
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_client_disconnect_mid_generation(daemon):
    import requests
    # 1000 tokens take the default model ~0.75 s on two cores (400 once took 0.30 s, under the old
    # 0.3 s timeout): the client gives up well before the end
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    with pytest.raises(requests.exceptions.ReadTimeout):
        daemon.post("/generate", body, timeout=0.1)
    # the daemon finishes the orphaned job and frees it; it keeps serving
    o = generate(daemon, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert len(o["output_ids"]) <= 2
    assert daemon.get("/health").status_code == 200


def wait_submitted(d, rid, timeout=30):
    """Waits until the daemon (started with --log-level debug) has handed `rid` to the engine."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if f"rid {rid} | submit" in d.read_log():
            return
        time.sleep(0.02)
    raise AssertionError(f"{rid} was never submitted:\n{d.read_log()[-2000:]}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_signal_drains_in_flight(rolloutd, sig):
    """SIGTERM drains: the request in flight gets its whole answer, then exit 0. SIGHUP (the
    terminal or session that started rolloutd went away) does exactly the same."""
    d = rolloutd(None, "--kv-cache-mb", "64", "--log-level", "debug")
    body = {"rid": "long", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", d.post("/generate", body)))
    t.start()
    wait_submitted(d, "long")
    d.proc.send_signal(sig)
    deadline = time.time() + 5
    while time.time() < deadline and d.get("/health").status_code == 200:
        time.sleep(0.01)
    assert d.get("/health").status_code == 503
    r = d.post("/generate", {"input_ids": PROMPT})
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
    t.join()
    assert result["r"].status_code == 200
    o = result["r"].json()
    assert len(o["output_ids"]) == 300  # ran to completion
    assert d.proc.wait(timeout=30) == 0
    assert f"{signal.strsignal(sig)}: draining" in d.read_log()


def test_drain_timeout_aborts(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--drain-timeout", "0.5", "--log-level", "debug")
    body = {"rid": "long", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", d.post("/generate", body)))
    t.start()
    wait_submitted(d, "long")
    time.sleep(0.2)  # a few tokens in
    d.proc.send_signal(signal.SIGTERM)
    t.join(timeout=30)
    assert result["r"].status_code == 200
    o = result["r"].json()
    assert o["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(o["output_ids"]) < 4000  # partial output comes back
    assert o["meta_info"]["completion_tokens"] == len(o["output_ids"])
    assert d.proc.wait(timeout=30) == 0


def test_sigterm_while_paused_aborts_at_once(rolloutd):
    """Paused generation cannot finish: SIGTERM aborts it at once (partial output, finish abort)
    instead of waiting the whole drain timeout."""
    d = rolloutd(None, "--kv-cache-mb", "64", "--drain-timeout", "60", "--log-level", "debug")
    body = {"rid": "paused", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", d.post("/generate", body)))
    t.start()
    wait_submitted(d, "paused")
    assert d.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    t0 = time.time()
    d.proc.send_signal(signal.SIGTERM)
    t.join(timeout=90)
    assert time.time() - t0 < 20, "the drain waited for paused generation"
    o = result["r"].json()
    assert o["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(o["output_ids"]) < 4000
    assert d.proc.wait(timeout=30) == 0
    assert "generation is paused; aborting the 1 request in flight now" in d.read_log()


def test_weight_version_setting_is_reported(rolloutd):
    d = rolloutd(None, "--weight-version", "step-17", "--kv-cache-mb", "64")
    out = generate(d, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["weight_version"] == "step-17"


# ---------------------------------------------------------------- SGLang-shaped payloads

def test_slime_style_payload(daemon):
    """The request slime / AReaL / NeMo-RL send (SGLang GenerateReqInput / SamplingParams fields), every field included; ids
    remapped into the default model's 8192-token vocabulary."""
    body = {"rid": "grp7-s3", "input_ids": [1644, 872, 198, 3838],
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                "stop_token_ids": [1645], "stop": None, "ignore_eos": False,
                                "skip_special_tokens": False, "no_stop_trim": True,
                                "spaces_between_special_tokens": False, "n": 1, "sampling_seed": 1234,
                                "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                                "min_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": None,
            "return_routed_experts": False, "stream": False}
    o = generate(daemon, body)
    check_output(o, 4, logprobs=True)
    assert o["meta_info"]["id"] == "grp7-s3"
    # slime reads tokens and logprobs from the triples: item[1], item[0]
    assert [t[1] for t in o["meta_info"]["output_token_logprobs"]] == o["output_ids"]


def test_verl_style_batched_groups(daemon):
    """veRL-style: a batch of prompts, n samples each, seeded, logprobs for importance sampling."""
    prompts = [[101, 102, 103], [201, 202], [301, 302, 303, 304]]
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 4,
                                "sampling_seed": 42, "ignore_eos": True, "skip_special_tokens": True}}
    out = generate(daemon, body)
    assert len(out) == 12
    for i, o in enumerate(out):
        check_output(o, len(prompts[i // 4]), logprobs=True)
        assert len(o["output_ids"]) == 5
    # same request, same tokens (the seed and the sample index key the RNG)
    again = generate(daemon, body)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]


def test_neutral_fields_refused_when_not_neutral(daemon):
    r = daemon.post("/generate", {"input_ids": PROMPT, "sampling_params": {"json_schema": "{}"}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "unsupported"
    assert r.json()["error"]["param"] == "sampling_params.json_schema"
    assert "not implemented" in r.json()["error"]["message"]
    r = daemon.post("/generate", {"input_ids": PROMPT, "token_ids_logprob": [1, 2]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids_logprob"


# ---------------------------------------------------------------- streaming

def sse_events(r):
    """The JSON events of a text/event-stream answer, which must end with [DONE]."""
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"] == "text/event-stream"
    chunks = r.content.decode().split("\n\n")
    assert chunks[-1] == ""
    chunks = chunks[:-1]
    assert all(c.startswith("data: ") for c in chunks), chunks
    assert chunks[-1] == "data: [DONE]"
    assert "data: [DONE]" not in chunks[:-1]
    return [json.loads(c[len("data: "):]) for c in chunks[:-1]]


def strip_latency(o):
    o = json.loads(json.dumps(o))
    o["meta_info"].pop("e2e_latency", None)
    o.pop("index", None)
    return o


def test_stream_single_cumulative(daemon):
    body = {"rid": "st", "input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}}
    plain = generate(daemon, body)
    events = sse_events(daemon.post("/generate", {**body, "stream": True}))
    assert len(events) >= 2
    prev = []
    for ev in events[:-1]:
        assert "index" not in ev  # one output: no index, as SGLang
        assert ev["meta_info"]["finish_reason"] is None
        assert "e2e_latency" not in ev["meta_info"]
        ids = ev["output_ids"]
        assert ids[:len(prev)] == prev and len(ids) > len(prev)  # cumulative, growing
        assert len(ev["meta_info"]["output_token_logprobs"]) == len(ids)
        prev = ids
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert isinstance(last["meta_info"]["e2e_latency"], float)
    assert strip_latency(last) == strip_latency(plain)  # the last event is the whole answer


def test_stream_batched_n_indices(daemon):
    body = {"rid": "sb", "input_ids": [[1, 2, 3], [4, 5]], "return_logprob": True,
            "sampling_params": {"n": 2, "max_new_tokens": 6, "sampling_seed": 9, "ignore_eos": True}}
    plain = generate(daemon, body)
    events = sse_events(daemon.post("/generate", {**body, "stream": True}))
    last = {}
    for ev in events:
        i = ev["index"]
        assert 0 <= i < 4
        assert i not in last or last[i]["meta_info"]["finish_reason"] is None  # nothing after an output's finish
        last[i] = ev
    assert sorted(last) == [0, 1, 2, 3]
    for i in range(4):
        assert last[i]["meta_info"]["id"] == plain[i]["meta_info"]["id"]
        assert strip_latency(last[i]) == strip_latency(plain[i])


def test_stream_interval(daemon):
    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "stream_interval": 4}}
    events = sse_events(daemon.post("/generate", body))
    lens = [len(ev["output_ids"]) for ev in events]
    assert lens[-1] == 12
    assert all(n % 4 == 0 for n in lens[:-1]), lens  # an event every 4 tokens (plus the closing one)


def test_stream_incremental(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--incremental-streaming-output", "true")
    body = {"input_ids": [[7, 8, 9], [10, 11]], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"n": 2, "max_new_tokens": 8, "sampling_seed": 3, "ignore_eos": True}}
    plain = generate(d, body)
    events = sse_events(d.post("/generate", {**body, "stream": True}))
    ids = {i: [] for i in range(4)}
    lps = {i: [] for i in range(4)}
    for ev in events:
        i = ev["index"]
        ids[i] += ev["output_ids"]
        lps[i] += ev["meta_info"]["output_token_logprobs"]
        # the prompt's scores whole in every event (SGLang slices only the output keys)
        assert ev["meta_info"]["input_token_logprobs"] == plain[i]["meta_info"]["input_token_logprobs"]
    for i in range(4):
        assert ids[i] == plain[i]["output_ids"]
        assert lps[i] == plain[i]["meta_info"]["output_token_logprobs"]


def metric(d, name):
    for line in d.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


def wait_for(pred, timeout=10.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_stream_client_disconnect_aborts(daemon):
    before = metric(daemon, "rolloutd_requests_aborted_total")
    body = json.dumps({"rid": "gone-stream", "input_ids": PROMPT, "stream": True,
                       "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}).encode()
    s = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    data = b""
    while b"data: " not in data:  # the headers and at least one event
        data += s.recv(4096)
    t0 = time.time()
    s.close()
    wait_for(lambda: metric(daemon, "rolloutd_requests_aborted_total") > before, what="the abort")
    assert time.time() - t0 < 5
    wait_for(lambda: metric(daemon, "rolloutd_num_running_reqs") == 0, what="nothing running")
    assert daemon.get("/health").status_code == 200


def test_plain_client_disconnect_aborts_promptly(daemon):
    before = metric(daemon, "rolloutd_requests_aborted_total")
    body = {"rid": "gone-plain", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    import requests
    with pytest.raises(requests.exceptions.ReadTimeout):
        daemon.post("/generate", body, timeout=0.3)
    t0 = time.time()
    # the connection is suspended while the job runs: the server notices the close by peeking at the socket
    wait_for(lambda: metric(daemon, "rolloutd_requests_aborted_total") > before, what="the abort")
    assert time.time() - t0 < 5
    assert "rid gone-plain#" in daemon.read_log() and "aborting" in daemon.read_log()


def test_reused_rid_in_flight(daemon):
    """Two requests in flight with one rid stay apart; an abort by that rid reaches both."""
    body = {"rid": "dup", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    results = [None, None]

    def run(i):
        results[i] = daemon.post("/generate", body)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: metric(daemon, "rolloutd_http_requests_in_flight") >= 2, what="both in flight")
    time.sleep(0.1)
    r = daemon.post("/abort_request", {"rid": "dup"})
    assert r.status_code == 200 and r.json()["aborted"] == 2
    for t in threads:
        t.join()
    for res in results:
        o = res.json()
        assert o["meta_info"]["id"] == "dup"
        assert o["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(o["output_ids"]) < 2000
    # short requests with one rid both complete on their own
    short = {"rid": "dup2", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}}
    with ThreadPoolExecutor(max_workers=4) as ex:
        outs = list(ex.map(lambda _: generate(daemon, short), range(4)))
    assert all(len(o["output_ids"]) == 7 and o["meta_info"]["id"] == "dup2" for o in outs)


def test_drain_timeout_ends_streams_with_abort(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--drain-timeout", "0.5", "--log-level", "debug")
    body = {"rid": "long-stream", "input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", d.post("/generate", body)))
    t.start()
    wait_submitted(d, "long-stream")
    time.sleep(0.2)
    d.proc.send_signal(signal.SIGTERM)
    t.join(timeout=30)
    events = sse_events(result["r"])  # still ends with [DONE]
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(last["output_ids"]) < 4000
    assert d.proc.wait(timeout=30) == 0
