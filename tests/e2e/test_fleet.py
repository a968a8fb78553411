"""rolloutd_client.Fleet: many daemons as one (clients/python/rolloutd_client/fleet.py, fleet_push.py).

Against real daemons:
  - three daemons of the embedded default model (--threads 1 each), ten shm pushes of ten different
    weight sets (one per step) while generation runs on all three: afterwards every daemon reports
    the last version and gives bit-identical greedy tokens and logprobs, equal to those of a daemon
    started from a checkpoint of those weights written to disk (no push involved); the same kept
    segments serve every step;
  - a push that one daemon rejects leaves every daemon on its old weights (version, greedy tokens
    and prompt logprobs compared before and after), raises FleetPushError naming each daemon, and
    leaves nothing open (the next push is accepted at once): a daemon with a model of fewer layers
    (it refuses the last bucket, after the others have staged every parameter), one with more
    layers (every bucket accepted, short of parameters at the check), one killed mid-push;
  - the commit window: a daemon whose transaction expires before the commit is reported on its old
    version while the others serve the new one, and pushing again brings all to one version;
  - least-load routing spreads concurrent calls (each daemon's own request counter), splits a
    batch by prompt with each prompt's n samples on one daemon and reassembles it in order (the same
    tokens as one daemon gives), and avoids a daemon busy with another client's work (its /metrics);
  - a daemon that is down, or dies during a request, makes generate fail over; with every daemon
    down generate raises FleetError naming each.
Without daemons: the request bodies of a fleet push against two stub servers (each bucket written
once and read by both, is_last false until an empty committing bucket, each daemon's own
transaction_id, the drop after a refusal), the load parsers against SGLang's /get_load shapes, and
the NCCL rank layout, init bodies, commit carrier and check (the NCCL push itself runs on a GPU:
test_nccl_gpu.py).
"""
import collections
import json
import os
import pathlib
import signal
import struct
import sys
import threading
import time

import numpy as np
import pytest
import requests

from conftest import Daemon, free_port
from test_client import stub  # noqa: F401 -- a pytest fixture
from test_golden import BF16_ARGS
from test_ops import m as metric, parse_prometheus

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))
from rolloutd_client import Client, Fleet, FleetError, FleetPushError, RolloutdError  # noqa: E402
from rolloutd_client import fleet as rfleet  # noqa: E402
from rolloutd_client import fleet_push as rfp  # noqa: E402
from rolloutd_client import nccl as rnccl  # noqa: E402
from rolloutd_client import shm as rshm  # noqa: E402
from rolloutd_client import tensors as rtensors  # noqa: E402
from rolloutd_client.safetensors import load_file  # noqa: E402

MODELS = ROOT / "tests" / "fixtures" / "models"
ORIG = MODELS / "qwen3"
PERT = ORIG / "perturbed"
DEFAULT_ARGS = ["--threads", "1", "--kv-cache-mb", "64"]  # the embedded default model, 2-core machines
QWEN_ARGS = [*BF16_ARGS, "--threads", "1", "--kv-cache-mb", "16"]


# ================================================================ helpers

def write_checkpoint(out, config, sd):
    """A model directory: config.json (a dict) and model.safetensors written here from raw
    (bytes-like, "bfloat16", shape) triples, in the safetensors layout (8-byte little-endian header
    length, JSON header padded to 8 bytes, the tensors' bytes back to back)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    hdr, off, blobs = {}, 0, []
    for k, (data, dt, shape) in sd.items():
        b = bytes(memoryview(data).cast("B"))
        assert dt == "bfloat16" and len(b) == 2 * int(np.prod(shape)), k
        hdr[k] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    hdr["__metadata__"] = {"format": "pt"}
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)
    return out


def raw(model_dir):
    """name -> (uint16 array of bfloat16 bits, "bfloat16", shape), in the checkpoint's order."""
    return {k: (np.frombuffer(mv, np.uint16).copy(), dt, tuple(shape))
            for k, (mv, dt, shape) in load_file(pathlib.Path(model_dir) / "model.safetensors", raw=True).items()}


def step_weights(base, k):
    """The weights of training step k: every bfloat16 value moved k representable steps away
    from zero (bits + k: a relative change of about k/128, finite for these weights)."""
    return {n: (a + np.uint16(k), dt, shape) for n, (a, dt, shape) in base.items()}


def greedy(url, prompts, n_new=16):
    """(token ids, output logprobs, prompt logprobs) of each prompt, greedy."""
    c = Client(url, timeout=300)
    outs = c.generate(prompts, max_new_tokens=n_new, temperature=0, ignore_eos=True)
    scored = c.generate(prompts, max_new_tokens=0, logprob_start_len=0)
    return [(o.output_ids.tolist(), o.output_logprobs.tolist(), s.input_logprobs[1:].tolist())
            for o, s in zip(outs, scored)]


def my_segments(before=()):
    """This process's shm segments, less those in `before` (segments of other tests' Fleets that
    were not closed live until their Fleet is collected)."""
    return sorted(p for p in os.listdir("/dev/shm") if p.startswith(f"rolloutd-w-{os.getpid()}-")
                  and p not in before)


def default_model_dir(url):
    return pathlib.Path(Client(url).get_model_info()["model_path"])


def _metric(url, name):
    return metric(parse_prometheus(requests.get(url + "/metrics", timeout=30).text), name)


def served(url):
    """Generation requests the daemon has finished (its own counter)."""
    return _metric(url, "sglang:num_requests_total")


def served_since(n0, want, wait_s=10.0):
    """{url: requests finished since n0[url]}, read until it equals `want` or wait_s passes: the
    engine publishes its counters after each step, so the last answer can arrive before them."""
    deadline = time.time() + wait_s
    while True:
        got = {u: served(u) - n0[u] for u in n0}
        if got == want or time.time() > deadline:
            return got
        time.sleep(0.05)


def running(url):
    return _metric(url, "sglang:num_running_reqs")


PROMPTS = [np.random.default_rng(s).integers(1, 500, 10 + s).tolist() for s in range(4)]  # any vocab >= 500


# ================================================================ ten steps, three daemons

def test_ten_pushes_during_generation_end_bit_identical(rolloutd, tmp_path):
    ds = [rolloutd(None, *DEFAULT_ARGS) for _ in range(3)]
    others = set(my_segments())
    fleet = Fleet([d.url for d in ds], timeout=300)
    mdir = default_model_dir(ds[0].url)
    base = raw(mdir)
    before = greedy(ds[0].url, PROMPTS)
    pushed = {"0"}
    seen, errors, stop = collections.Counter(), [], threading.Event()

    def generate_loop(seed):
        while not stop.is_set():
            try:
                outs = fleet.generate(PROMPTS[:3], n=2, max_new_tokens=12, temperature=1.0, sampling_seed=seed,
                                      ignore_eos=True)
                for o in outs:
                    assert o.finish_reason == "length" and len(o.output_ids) == 12, o
                    assert {v for v, _, _ in o.weight_versions} <= set(pushed), o.weight_versions
                    seen[(o.server, o.weight_version)] += 1
            except Exception as e:  # noqa: BLE001 -- reported by the main thread
                errors.append(e)
                return

    threads = [threading.Thread(target=generate_loop, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    kept = None
    try:
        for k in range(1, 11):
            v = f"step-{k}"
            pushed.add(v)
            res = fleet.push_weights(step_weights(base, k), version=v, bucket_bytes=8 << 20)
            assert res.weight_version == v and res.rounds >= 3, res
            assert all(r.get("committed") is True and r["weight_version"] == v for r in res.responses.values())
            if kept is None:
                kept = my_segments(others)
            assert my_segments(others) == kept  # the same segments every step: nothing new is mapped
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert {s for s, _ in seen} == {d.url for d in ds}, seen          # generation ran on all three
    assert len({v for _, v in seen}) > 2, seen                        # and through the pushes
    assert fleet.weight_versions() == {d.url: "step-10" for d in ds}

    outs = [greedy(d.url, PROMPTS) for d in ds]
    assert outs[0] == outs[1] == outs[2]                              # bit-identical, floats compared exactly
    assert outs[0] != before
    # a daemon that never saw a push, started on a checkpoint of step 10's weights
    ref_dir = write_checkpoint(tmp_path / "step10", json.loads((mdir / "config.json").read_text()),
                               step_weights(base, 10))
    ref = rolloutd(ref_dir, *DEFAULT_ARGS)
    assert greedy(ref.url, PROMPTS) == outs[0]
    fleet.close()
    assert my_segments(others) == []


# ================================================================ one daemon rejects

def qwen_variant(tmp_path, layers):
    """qwen3 with `layers` decoder layers: fewer drops the last ones, more repeats layer 2."""
    cfg = json.loads((ORIG / "config.json").read_text())
    sd = raw(ORIG)
    n = cfg["num_hidden_layers"]
    out = {k: v for k, v in sd.items() if not any(k.startswith(f"model.layers.{i}.") for i in range(layers, n))}
    for i in range(n, layers):
        out.update({k.replace(f"model.layers.{n - 1}.", f"model.layers.{i}."): v for k, v in sd.items()
                    if k.startswith(f"model.layers.{n - 1}.")})
    cfg["num_hidden_layers"] = layers
    cfg["layer_types"] = ["full_attention"] * layers
    return write_checkpoint(tmp_path / f"qwen3-{layers}-layers", cfg, out)


def snapshot(urls):
    return {u: (Client(u).get_weight_version(), greedy(u, PROMPTS[:2], 8)) for u in urls}


def check_failed_push(ei, stage, urls, before):
    e = ei.value
    assert e.stage == stage and e.committed == [], e
    assert set(e.outcomes) == set(urls) and all(u in str(e) for u in urls), e
    after = snapshot([u for u in urls if e.versions.get(u) is not None])
    for u, got in after.items():
        assert got == before[u], f"{u} changed although the fleet push failed:\n{e}"
        assert e.versions[u] == before[u][0]
    return e


def test_daemon_with_fewer_layers_refuses_the_last_bucket(rolloutd, tmp_path):
    """Every bucket but the last holds what all three serve; the last holds layer 2, which the
    third daemon's model lacks: the first two have staged every parameter when it refuses, and must
    still commit nothing."""
    a, b = rolloutd(ORIG, *QWEN_ARGS), rolloutd(ORIG, *QWEN_ARGS)
    c = rolloutd(qwen_variant(tmp_path, 2), *QWEN_ARGS)
    urls = [a.url, b.url, c.url]
    sd = raw(PERT)
    sd = dict(sorted(sd.items(), key=lambda kv: kv[0].startswith("model.layers.2.")))  # layer 2 last
    ents = rtensors.entries(sd)
    first = sum(rshm._align(e.nbytes) for e in ents if not e.name.startswith("model.layers.2."))
    plan = rshm.plan_buckets(ents, first)
    assert len(plan) == 2 and all(e.name.startswith("model.layers.2.") for e, _ in plan[1][0]), "bucket layout"
    before = snapshot(urls)
    fleet = Fleet(urls)
    with pytest.raises(FleetPushError) as ei:
        fleet.push_weights(sd, version="pert", bucket_bytes=first)
    e = check_failed_push(ei, "stage", urls, before)
    assert isinstance(e.errors[c.url], RolloutdError) and e.errors[c.url].status == 400
    assert "model.layers.2." in e.errors[c.url].message, e.errors[c.url].message
    assert e.outcomes[a.url] == e.outcomes[b.url] == "its open update was dropped", e.outcomes
    # nothing was left open: the next version is accepted at once by the two that can take it
    res = Fleet([a.url, b.url]).push_weights(sd, version="pert-2", bucket_bytes=first)
    assert res.weight_version == "pert-2"
    assert greedy(a.url, PROMPTS[:2], 8) == greedy(b.url, PROMPTS[:2], 8) != before[a.url][1]


def test_daemon_with_more_layers_fails_the_check(rolloutd, tmp_path):
    """Every bucket is accepted everywhere, but the third daemon's model has a fourth layer the push
    does not carry: its commit would fail while the others' succeeded, so nobody commits."""
    a, b = rolloutd(ORIG, *QWEN_ARGS), rolloutd(ORIG, *QWEN_ARGS)
    c = rolloutd(qwen_variant(tmp_path, 4), *QWEN_ARGS)
    urls = [a.url, b.url, c.url]
    before = snapshot(urls)
    with pytest.raises(FleetPushError) as ei:
        Fleet(urls).push_weights(raw(PERT), version="pert", bucket_bytes=64 << 10)
    e = check_failed_push(ei, "check", urls, before)
    assert set(e.errors) == {c.url} and "of its model's" in str(e.errors[c.url]), e
    assert all(f == "its open update was dropped" for f in e.outcomes.values()), e.outcomes
    res = Fleet([a.url, b.url]).push_weights(raw(PERT), version="pert-2", bucket_bytes=64 << 10)
    assert res.weight_version == "pert-2"


def test_daemon_killed_mid_push(rolloutd, tmp_path):
    a, b = rolloutd(ORIG, *QWEN_ARGS), rolloutd(ORIG, *QWEN_ARGS)
    k = Daemon(ORIG, QWEN_ARGS, tmp_path / "killed.log")
    try:
        urls = [a.url, b.url, k.url]
        before = snapshot(urls)
        fleet = Fleet(urls, timeout=60)
        real, calls = fleet.clients[2].post, []

        def post(path, body=None, timeout=None):  # the daemon dies just before its second bucket
            calls.append(body)
            if len(calls) == 2:
                k.proc.send_signal(signal.SIGKILL)
                k.proc.wait(30)
            return real(path, body, timeout)
        fleet.clients[2].post = post
        with pytest.raises(FleetPushError) as ei:
            fleet.push_weights(raw(PERT), version="pert", bucket_bytes=64 << 10)
        e = check_failed_push(ei, "stage", urls, before)
        assert isinstance(e.errors[k.url], requests.ConnectionError), e.errors
        assert e.versions[k.url] is None and "could not be told" in e.outcomes[k.url], e.outcomes
        assert e.outcomes[a.url] == e.outcomes[b.url] == "its open update was dropped", e.outcomes
        assert Fleet([a.url, b.url]).push_weights(raw(PERT), version="pert-2").weight_version == "pert-2"
    finally:
        k.stop()


def test_commit_window_reports_who_serves_what(rolloutd):
    """The third daemon's transaction expires (--weight-update-timeout 2) while its commit is held
    back: the others commit, it refuses, and FleetPushError says so; pushing again converges."""
    a, b = rolloutd(ORIG, *QWEN_ARGS), rolloutd(ORIG, *QWEN_ARGS)
    c = rolloutd(ORIG, *QWEN_ARGS, "--weight-update-timeout", "2")
    urls = [a.url, b.url, c.url]
    v0 = Client(c.url).get_weight_version()
    fleet = Fleet(urls)
    real = fleet.clients[2].post

    def post(path, body=None, timeout=None):
        if body.get("is_last"):
            time.sleep(3.0)
        return real(path, body, timeout)
    fleet.clients[2].post = post
    with pytest.raises(FleetPushError) as ei:
        fleet.push_weights(raw(PERT), version="pert", bucket_bytes=64 << 10)
    e = ei.value
    assert e.stage == "commit" and e.committed == [a.url, b.url], e
    assert e.versions == {a.url: "pert", b.url: "pert", c.url: v0}, e
    assert isinstance(e.errors[c.url], RolloutdError) and e.errors[c.url].status == 409, e.errors
    assert "no longer open" in e.outcomes[c.url] and e.outcomes[a.url] == "committed 'pert'", e.outcomes
    fleet.clients[2].post = real
    assert fleet.push_weights(raw(PERT), version="pert").weight_version == "pert"
    assert fleet.weight_versions() == {u: "pert" for u in urls}
    outs = [greedy(u, PROMPTS[:2], 8) for u in urls]
    assert outs[0] == outs[1] == outs[2]


# ================================================================ routing

def test_least_load_routing(rolloutd):
    ds = [rolloutd(None, *DEFAULT_ARGS) for _ in range(3)]
    urls = [d.url for d in ds]
    # concurrent calls: two on each (this Fleet's own count; the daemons' counters agree)
    fleet = Fleet(urls, load_poll_s=0)
    n0 = {u: served(u) for u in urls}
    go, outs = threading.Barrier(6), []

    def one(i):
        go.wait()
        outs.extend(fleet.generate(PROMPTS[i % 4], max_new_tokens=150, ignore_eos=True))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(collections.Counter(o.server for o in outs).values()) == [2, 2, 2], [o.server for o in outs]
    assert served_since(n0, {u: 2 for u in urls}) == {u: 2 for u in urls}

    # a batch: split by prompt, each prompt's samples together, back in prompt order
    prompts = [PROMPTS[i % 4] + [i] for i in range(6)]
    got = fleet.generate(prompts, n=2, max_new_tokens=6, temperature=1.0, sampling_seed=5)
    want = Client(urls[0]).generate(prompts, n=2, max_new_tokens=6, temperature=1.0, sampling_seed=5)
    assert [g.output_ids.tolist() for g in got] == [w.output_ids.tolist() for w in want]
    assert [g.output_logprobs.tolist() for g in got] == [w.output_logprobs.tolist() for w in want]
    assert [g.prompt_tokens for g in got] == [len(p) for p in prompts for _ in range(2)]
    assert all(got[2 * i].server == got[2 * i + 1].server for i in range(6))
    assert sorted(collections.Counter(g.server for g in got).values()) == [4, 4, 4]

    # another client's work on daemon 0, seen through its /metrics, keeps new calls away from it
    busy = Client(urls[0])
    hogs = [threading.Thread(target=busy.generate, args=(PROMPTS[0],),
                             kwargs={"max_new_tokens": 3000, "ignore_eos": True, "rid": f"hog-{i}"}) for i in range(3)]
    for t in hogs:
        t.start()
    try:
        deadline = time.time() + 60
        while running(urls[0]) < 3 and time.time() < deadline:
            time.sleep(0.05)
        polled = Fleet(urls, load_poll_s=0.1)
        polled.generate(PROMPTS[1], max_new_tokens=1)  # starts the first poll
        deadline = time.time() + 30
        while polled.loads()[urls[0]] < 3 and time.time() < deadline:
            polled.generate(PROMPTS[1], max_new_tokens=1)
            time.sleep(0.1)
        assert polled.loads()[urls[0]] >= 3, polled.loads()
        res = []
        threads = [threading.Thread(target=lambda: res.extend(polled.generate(PROMPTS[2], max_new_tokens=20)))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(res) == 4 and urls[0] not in {r.server for r in res}, [r.server for r in res]
        polled.close()
    finally:
        busy.abort()
        for t in hogs:
            t.join(120)

    # through a router: everything goes to its one URL (here a daemon stands in for sglang-router)
    routed = Fleet(urls[:2], router_url=urls[2])
    assert {o.server for o in routed.generate([PROMPTS[0], PROMPTS[1]], n=3, max_new_tokens=2)} == {urls[2]}
    assert fleet.nccl_ranks() == ([1, 2, 3], 4)  # tp_size 1 each, from /get_server_info


def test_generate_fails_over(rolloutd, tmp_path):
    a = rolloutd(None, *DEFAULT_ARGS)
    k = Daemon(None, DEFAULT_ARGS, tmp_path / "killed.log")
    try:
        fleet = Fleet([k.url, a.url], load_poll_s=0, down_s=30)
        out = {}
        # (800 tokens take ~4 s on one thread of a 2-core VM; the poll below sees the request within
        # ~0.1 s of its start, and the survivor then generates all 800)
        t = threading.Thread(target=lambda: out.update(r=fleet.generate(PROMPTS[0], max_new_tokens=800,
                                                                         ignore_eos=True, sampling_seed=3)))
        t.start()  # goes to the first daemon (equal loads: round robin from the first)
        deadline = time.time() + 60
        while running(k.url) < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert running(k.url) == 1
        k.proc.send_signal(signal.SIGKILL)  # dies with the request in flight
        k.proc.wait(30)
        t.join(600)
        (r,) = out["r"]
        assert r.server == a.url and len(r.output_ids) == 800 and r.finish_reason == "length"
        # the dead daemon is passed over without being tried again
        assert {o.server for _ in range(3) for o in fleet.generate(PROMPTS[1], max_new_tokens=2)} == {a.url}
        # a bad request is not retried elsewhere: it raises as it is
        with pytest.raises(RolloutdError) as ei:
            fleet.generate(PROMPTS[1], max_new_tokens=2, temperature=-1.0)
        assert ei.value.status == 400
    finally:
        k.stop()
    # every daemon down: FleetError naming each, with its connection error
    dead = Fleet([k.url, f"http://127.0.0.1:{free_port()}"], load_poll_s=0)
    with pytest.raises(FleetError) as ei:
        dead.generate(PROMPTS[0], max_new_tokens=2)
    assert set(ei.value.errors) == set(dead.urls)
    assert all(isinstance(x, requests.ConnectionError) for x in ei.value.errors.values())
    assert all(u in str(ei.value) for u in dead.urls)


# ================================================================ without daemons

@pytest.fixture
def stub2():
    import http.server
    from test_client import _Stub
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    srv.calls, srv.fail_at, srv.delay_at, srv.txn_id, srv.complete = [], -1, {}, None, False
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _sd():
    rng = np.random.default_rng(4)
    return {f"t{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate([1000, 700, 1500, 3000, 300])}


def test_fleet_push_request_bodies(stub, stub2):
    """Each bucket is written once and read by both servers (same segment, same bytes), every data
    bucket has is_last false and, after the first, the server's own transaction_id; an empty
    committing bucket with is_last true names a kept segment; a second push reuses the segments."""
    stub.txn_id, stub2.txn_id = "00000000000000a1", "00000000000000b2"
    stub.complete = stub2.complete = True
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in (stub, stub2)]
    others = set(my_segments())
    fleet = Fleet(urls)
    sd = _sd()
    res = fleet.push_weights(sd, version="7", bucket_bytes=8192)
    kept = my_segments(others)
    for srv in (stub, stub2):
        assert [c["body"]["is_last"] for c in srv.calls] == [False] * (len(srv.calls) - 1) + [True]
        assert [c["body"].get("transaction_id") for c in srv.calls] == [None] + [srv.txn_id] * (len(srv.calls) - 1)
        last = srv.calls[-1]["body"]
        assert last["tensors"] == [] and last["shm_name"].lstrip("/") in kept
        got = {t["name"]: c["data"][t["name"]] for c in srv.calls for t in c["body"]["tensors"]}
        assert got == {k: v.tobytes() for k, v in sd.items()}
        assert all(c["mode"] == 0o600 for c in srv.calls)
    assert [c["body"]["shm_name"] for c in stub.calls] == [c["body"]["shm_name"] for c in stub2.calls]
    assert res.rounds == len(stub.calls) and res.bytes == sum(v.nbytes for v in sd.values())
    n = len(stub.calls)
    fleet.push_weights(sd, version="8", bucket_bytes=8192)
    assert my_segments(others) == kept and {c["body"]["shm_name"].lstrip("/") for c in stub.calls[n:]} <= set(kept)

    # the second server refuses bucket 2: nothing more goes to either but a drop to the first
    stub.calls.clear()
    stub2.calls.clear()
    stub2.fail_at = 1
    with pytest.raises(FleetPushError) as ei:
        fleet.push_weights(sd, version="9", bucket_bytes=8192)
    assert ei.value.stage == "stage" and "stub says no" in str(ei.value.errors[urls[1]])
    for srv in (stub, stub2):
        drop = srv.calls[-1]["body"]
        assert len(srv.calls) == 3 and drop["is_last"] is False and drop["tensors"] == []
        assert "-drop-" in drop["shm_name"] and drop["transaction_id"] == srv.txn_id
    assert ei.value.outcomes[urls[0]] == "its open update was dropped"
    fleet.close()
    assert my_segments(others) == []


def test_load_parsers_and_rank_layout():
    # SGLang's /get_load: a list with one entry per DP rank (GetLoadReqOutput); older {"load": N}
    assert rfleet.load_from_get_load([{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 900},
                                      {"dp_rank": 1, "num_reqs": 3, "num_waiting_reqs": 0, "num_tokens": 10}]) == 8
    assert rfleet.load_from_get_load({"load": 4}) == 4
    assert rfleet.load_from_get_load({"status": "ok"}) is None and rfleet.load_from_get_load([]) is None
    text = ("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 3\nsglang:num_queue_reqs 2\n"
            'vllm:num_requests_running{model_name="m"} 9\n')
    assert rfleet.load_from_metrics(text) == 5
    assert rfleet.load_from_metrics('vllm:num_requests_running{engine="0"} 4\nvllm:num_requests_waiting 1\n') == 5
    assert rfleet.load_from_metrics("rolloutd_paused 0\n") is None
    with pytest.raises(ValueError):
        Fleet(["http://127.0.0.1:1", "http://127.0.0.1:1/"])

    # NCCL: trainer rank 0, then each server's ranks in order (SGLang: rank_offset + tp_rank)
    assert rnccl.rank_layout([1, 1, 1]) == ([1, 2, 3], 4)
    assert rnccl.rank_layout([2, 1, 4]) == ([1, 3, 4], 8)
    with pytest.raises(ValueError):
        rnccl.rank_layout([1, 0])
    bodies = rnccl.group_bodies(3, "g", "QUJD", "10.0.0.1", "29501", 2)
    assert [(b["rank_offset"], b["world_size"]) for b in bodies] == [(1, 7), (3, 7), (5, 7)]
    assert all(b == dict(bodies[0], rank_offset=b["rank_offset"]) for b in bodies)
    assert bodies[0] == {"master_address": "10.0.0.1", "master_port": 29501, "rank_offset": 1, "world_size": 7,
                         "group_name": "g", "backend": "nccl", "nccl_unique_id_b64": "QUJD"}
    assert Fleet(["http://127.0.0.1:1", "http://127.0.0.1:2"]).nccl_ranks(3) == ([1, 4], 7)


def test_nccl_commit_carrier_and_check():
    ents = rtensors.entries(raw(ORIG), fp8=True)
    k = rfp.commit_carrier(ents)
    one_d = [e for e in ents if len(e.shape) == 1 and not e.name.endswith("_scale_inv")]
    assert len(ents[k].shape) == 1 and ents[k].nbytes == min(e.nbytes for e in one_d), ents[k].name
    assert ents[k].dtype == "bfloat16" and not ents[k].name.endswith(("_scale_inv", "k_scale", "v_scale"))
    lm = rtensors.entries({"lm_head.weight": (bytes(8), "bfloat16", (4,)), "w": (bytes(64), "bfloat16", (4, 8))})
    assert rfp.commit_carrier(lm) == 1

    class C:
        def __init__(self, url):
            self.url = url
    txn = rfp.FleetTxn([C("a"), C("b")], "v", 10, "/x")
    try:
        def answers(*counts):
            for m, (s, r) in zip(txn.members, counts):
                m.answer, m.error = {"message": f"staged; {s} of {r} parameters of version 'v' received"}, None
        answers((89, 90), (89, 90))
        txn.check(1)                     # both lack only the carrier
        answers((90, 90), (90, 90))
        txn.check(0)
        for bad, allowed in ((((90, 90), (89, 90)), 1), (((89, 90), (89, 91)), 1), (((90, 90), (89, 90)), 0)):
            answers(*bad)
            with pytest.raises(rfp._Failed):
                txn.check(allowed)
    finally:
        txn.close()
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:  # says what is missing before it sends anything
        with pytest.raises(rnccl.NcclError, match="CUDA|PyTorch"):
            Fleet(["http://127.0.0.1:9"]).init_nccl_group(ranks_per_server=1)
