"""Weight updates end to end (docs/api.md "Weight updates"), driven by the Python client.

The daemon starts on tests/fixtures/models/qwen3/ and receives qwen3/perturbed/ (the same model after
a pretend training step: every tensor bf16(w + 0.02 std(w) randn); scripts/make_fixtures.py), whose
golden.json / golden_fp8.json transformers computed. After a push the daemon must reproduce them:
  - over shared memory, bucketed (several POSTs, one tensor larger than a bucket), BF16 within 1e-3
    (test_golden's TOL); FP8 (server-side requantization, and client-side FP8 codes + _scale_inv)
    with test_golden's two tiers, and both FP8 routes give identical logprobs;
  - weight_version is reported by /get_weight_version and by every output afterwards; /metrics
    counts updates, bytes, failures and the kept staging memory;
  - corrupt updates (unknown name, wrong shape or dtype, offset beyond the segment, a segment too
    small, a missing tensor at is_last, no such segment, ...) each get 400 and change nothing
    (outputs and version compared before/after), also when an earlier bucket was accepted;
  - static FP8 KV scales (self_attn.k_scale / v_scale) pushed with the weights: a daemon in
    --kv-scale-mode static then serves exactly what a daemon started on a checkpoint holding those
    scales serves; a partial set or a q_scale gets 400; calibrate mode says it does not use them;
  - generation keeps running through 20 back-to-back updates: every request completes, every version
    span is a version that was pushed, and every token's logprob is what the weights of its reported
    version give (teacher-forced on daemons started on those weights; bf16 with f32 KV, and with
    the default FP8 KV, recalibrated over the staged weights on every update);
  - /update_weights_from_disk accepts paths under --allowed-weight-dir only;
  - the NCCL routes answer 400 with a clear message in a build without CUDA.
"""
import os
import pathlib
import shutil
import sys
import threading
import time

import numpy as np
import pytest
import requests

from test_ops import m, metrics
from test_golden import (BF16_ARGS, FP8_AGG_FRAC, FP8_ARGS, check_fp8_aggregate, check_greedy,
                         check_prompt_logprobs, greedy_body, got_prompt_logprobs, ref_prompt_logprobs,
                         score_body)

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))
from rolloutd_client import Client, RolloutdError  # noqa: E402
from rolloutd_client import dtypes as rdt  # noqa: E402
from rolloutd_client.safetensors import load_file  # noqa: E402
from rolloutd_client.shm import ALIGN, Segment  # noqa: E402

MODELS = ROOT / "tests" / "fixtures" / "models"
ORIG = MODELS / "qwen3"
PERT = ORIG / "perturbed"
pytestmark = pytest.mark.skipif(not (PERT / "golden.json").is_file(), reason="no qwen3/perturbed fixture")

# Teacher-forced logprob of a generated token vs the logprob it was sampled with (same weights,
# bf16, f32 KV): prefill and decode may sum in different orders.
SPAN_TOL = 2e-5


def golden(d, name):
    import json
    return json.loads((d / name).read_text())


def weights(d):
    """name -> raw (memoryview, "bfloat16", shape) triple: no ml_dtypes needed."""
    return load_file(d / "model.safetensors", raw=True)


def nbytes(sd):
    return sum(len(v[0]) for v in sd.values())


def score_all(d, prompts):
    """Every prompt's prompt logprobs, one batched request; returns the raw outputs."""
    r = d.post("/generate", score_body([p["input_ids"] for p in prompts]))
    assert r.status_code == 200, f"/generate -> {r.status_code}: {r.text[:500]}"
    return r.json()


def prompt_lps(outs):
    return [[e[0] for e in o["meta_info"]["input_token_logprobs"]] for o in outs]


def check_bf16_golden(d, g, label):
    for i, p in enumerate(g["prompts"]):
        r = d.post("/generate", score_body(p["input_ids"]))
        assert r.status_code == 200, r.text
        check_prompt_logprobs(label, i, p, r.json())
        r = d.post("/generate", greedy_body(p["input_ids"]))
        assert r.status_code == 200, r.text
        check_greedy(label, i, p, r.json())


def check_fp8_golden(d, g8, g16, label, other_g8=None):
    """test_golden's two FP8 tiers; with other_g8 (the goldens of the weights before the update),
    also that the outputs follow the new weights: much closer to g8 than other_g8 is."""
    scored = []
    for i, p in enumerate(g8["prompts"]):
        r = d.post("/generate", score_body(p["input_ids"]))
        assert r.status_code == 200, r.text
        scored.append(r.json())
        check_prompt_logprobs(label, i, p, scored[-1], p["stable_prompt_logprobs"])
        r = d.post("/generate", greedy_body(p["input_ids"]))
        assert r.status_code == 200, r.text
        check_greedy(label, i, p, r.json(), p["stable_greedy_steps"])
    check_fp8_aggregate(label, scored, g8["prompts"], g16["prompts"])
    if other_g8 is not None:
        got, want, old = got_prompt_logprobs(scored), ref_prompt_logprobs(g8["prompts"]), ref_prompt_logprobs(other_g8["prompts"])
        moved = float(np.abs(want - old).mean())
        to_new = float(np.abs(got - want).mean())
        assert to_new <= FP8_AGG_FRAC * moved, (
            f"{label}: mean |logprob - new weights' golden_fp8| {to_new:.3g} is not small against the "
            f"update's effect {moved:.3g}: were the weights swapped?")
    return prompt_lps(scored)


# ================================================================ pushes that must work

def test_shm_push_bf16_matches_golden(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    c = Client(d.url)
    g_orig, g_pert = golden(ORIG, "golden.json"), golden(PERT, "golden.json")
    v0 = c.get_weight_version()
    pert = weights(PERT)

    # 64 KiB buckets: the 96 KiB embedding goes alone in its own segment; ~12 POSTs.
    res = c.push_weights(pert, version="step-1", bucket_bytes=64 << 10)
    assert res.posts >= 5, res
    assert res.response.get("success") is True and res.response.get("weight_version") == "step-1", res.response
    assert res.bytes == nbytes(pert)
    assert isinstance(res.response.get("bytes"), int) and res.response["bytes"] > 0, res.response
    assert isinstance(res.response.get("seconds"), (int, float)), res.response
    assert c.get_weight_version() == "step-1" != v0
    check_bf16_golden(d, g_pert, "qwen3/perturbed pushed (bf16)")
    (out,) = c.generate([1, 2, 3], max_new_tokens=2)
    assert out.weight_version == "step-1" and all(v == "step-1" for v, _, _ in out.weight_versions)

    # back to the original weights in one bucket
    res = c.push_weights(weights(ORIG), version="step-2")
    assert res.posts == 1 and res.response["weight_version"] == "step-2"
    check_bf16_golden(d, g_orig, "qwen3 pushed back (bf16)")

    # float32 values of the same bf16 weights: the daemon stores the same model
    f32 = {k: rdt.as_float32(np.frombuffer(v[0], np.uint16).reshape(v[2]), "bfloat16") for k, v in pert.items()}
    res = c.push_weights(f32, version="step-3", bucket_bytes=128 << 10)
    assert res.bytes == 2 * nbytes(pert)
    check_bf16_golden(d, g_pert, "qwen3/perturbed pushed as float32")

    # /metrics counts the three updates; the replaced weights' memory is kept for the next staging
    s = metrics(d)
    assert m(s, "rolloutd_weight_updates_total") == 3
    assert m(s, "rolloutd_weight_update_seconds_count") == 3 and m(s, "rolloutd_weight_update_pause_seconds_count") == 3
    assert m(s, "rolloutd_weight_update_received_bytes_total") == 4 * nbytes(pert)
    assert m(s, "rolloutd_weight_update_tensors_total") == 3 * len(pert)
    assert m(s, "rolloutd_weight_updates_failed_total") == 0 and m(s, "rolloutd_weight_update_in_progress") == 0
    assert m(s, "rolloutd_weight_spare_bytes") == m(s, "rolloutd_weight_bytes") > 0
    with pytest.raises(RolloutdError):
        c.push_weights({"model.layers.0.mlp.bogus.weight": pert["model.norm.weight"]}, version="bad")
    s = metrics(d)
    assert m(s, "rolloutd_weight_updates_failed_total") == 1 and m(s, "rolloutd_weight_update_requests_failed_total") == 1
    assert m(s, "rolloutd_weight_updates_total") == 3 and m(s, "rolloutd_weight_staging_bytes") == 0
    assert c.get_weight_version() == "step-3"


def test_shm_push_fp8(rolloutd):
    d = rolloutd(ORIG, *FP8_ARGS)
    c = Client(d.url)
    g8, g16 = golden(PERT, "golden_fp8.json"), golden(PERT, "golden.json")
    o8 = golden(ORIG, "golden_fp8.json")
    pert = weights(PERT)

    # BF16 push, requantized by the daemon
    res = c.push_weights(pert, version="fp8-a", bucket_bytes=32 << 10)
    assert res.posts >= 5 and res.response["weight_version"] == "fp8-a"
    server_q = check_fp8_golden(d, g8, g16, "qwen3/perturbed pushed bf16 into --quantization fp8", o8)

    # back to the original, then the same perturbed weights quantized by the client (E4M3 codes +
    # _scale_inv, small buckets so codes and their scales land in different POSTs)
    c.push_weights(weights(ORIG), version="fp8-b")
    check_fp8_golden(d, o8, golden(ORIG, "golden.json"), "qwen3 pushed back (fp8)")
    res = c.push_weights(pert, version="fp8-c", bucket_bytes=16 << 10, fp8=True)
    assert res.bytes < nbytes(pert) * 0.6, res
    assert res.response["weight_version"] == "fp8-c"
    client_q = check_fp8_golden(d, g8, g16, "qwen3/perturbed pushed as client-side FP8", o8)
    # docs/design.md: one quantization rule, so the same codes and scales, bit-identical outputs
    for i, (a, b) in enumerate(zip(server_q, client_q)):
        assert a == b, (f"prompt {i}: logprobs after a client-quantized FP8 push differ from those after a "
                        f"BF16 push requantized by the daemon (max |diff| "
                        f"{max(abs(x - y) for x, y in zip(a[1:], b[1:])):.3g})")


def test_push_calibrates_with_the_served_kernel_class(rolloutd):
    """KV scales recalibrated on a push are computed with the kernel class the daemon serves with
    (--cpu-kernels scalar here, on any CPU): pushing the very weights it serves changes nothing,
    as the scales it made at load from the same weights say. (A calibration at the CPU's best class
    rounded differently and moved the scales, and with them every logprob.)"""
    d = rolloutd(ORIG, "--cpu-kernels", "scalar", "--kv-cache-dtype", "fp8", "--kv-scale-mode", "calibrate")
    g = golden(ORIG, "golden.json")
    ids = [p["input_ids"] for p in g["prompts"][:2]]
    before = score_all(d, [{"input_ids": x} for x in ids])
    Client(d.url).push_weights(weights(ORIG), version="same")
    after = score_all(d, [{"input_ids": x} for x in ids])
    assert prompt_lps(after) == prompt_lps(before)
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in before]


# ================================================================ corrupt updates

def _write_all(sd, seg, skip=()):
    """Packs sd into seg (256-aligned, in order); returns the tensor list for the POST."""
    metas, off = [], 0
    for k, (mv, dt, shape) in sd.items():
        if k in skip:
            continue
        seg.buf[off:off + len(mv)] = mv
        metas.append({"name": k, "dtype": dt, "shape": list(shape), "offset": off})
        off = (off + len(mv) + ALIGN - 1) // ALIGN * ALIGN
    return metas


def test_corrupt_updates_rejected(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    c = Client(d.url)
    prompts = golden(ORIG, "golden.json")["prompts"]
    pert = weights(PERT)
    total = sum((len(v[0]) + ALIGN - 1) // ALIGN * ALIGN for v in pert.values())
    before = prompt_lps(score_all(d, prompts))
    v0 = c.get_weight_version()
    q = "model.layers.0.self_attn.q_proj.weight"       # [128, 96]
    seg = Segment(total)
    small = Segment(4096)
    try:
        good = _write_all(pert, seg)

        def with_(name, **kw):
            return [dict(m, **kw) if m["name"] == name else m for m in good]

        cases = {
            "unknown name": (seg.name, good + [{"name": "model.layers.0.mlp.bogus.weight", "dtype": "bfloat16",
                                                 "shape": [96], "offset": 0}], True),
            "wrong shape": (seg.name, with_(q, shape=[96, 128]), True),
            "wrong rank": (seg.name, with_(q, shape=[128 * 96]), True),
            "unsupported dtype": (seg.name, with_(q, dtype="float64"), True),
            "unknown dtype": (seg.name, with_(q, dtype="bf16"), True),
            "int dtype": (seg.name, with_("model.norm.weight", dtype="int16"), True),
            "offset beyond the segment": (seg.name, with_(q, offset=seg.size + 4096), True),
            "tensor past the segment end": (seg.name, with_(q, offset=seg.size - 1024), True),
            "negative offset": (seg.name, with_(q, offset=-256), True),
            "missing tensor at is_last": (seg.name, [m for m in good if m["name"] != "model.norm.weight"], True),
            "segment too small": (small.name, [dict(m, offset=0) for m in good if m["name"] == q], False),
            "segment that does not exist": ("/rolloutd-w-no-such-segment-" + os.urandom(4).hex(), good, True),
            "shm name with a path": ("/../dev/shm" + seg.name, good, True),
            "duplicate tensor": (seg.name, good + [m for m in good if m["name"] == q], True),
        }
        for label, (name, tensors, is_last) in cases.items():
            body = {"shm_name": name, "tensors": tensors, "is_last": is_last, "weight_version": "bad-" + label}
            r = d.post("/update_weights_from_shm", body)
            assert r.status_code == 400, f"{label}: /update_weights_from_shm -> {r.status_code}: {r.text[:300]}"
            err = r.json().get("error")
            assert isinstance(err, dict) and err.get("message"), f"{label}: error body {r.text[:300]}"
            print(f"{label}: 400 {err['message']}")
            after = prompt_lps(score_all(d, prompts))
            assert after == before, f"{label}: outputs changed after a refused update ({err['message']})"
            assert c.get_weight_version() == v0, f"{label}: version changed after a refused update"

        # A transaction whose first bucket was accepted and whose second is bad: void as a whole.
        half = len(good) // 2
        r = d.post("/update_weights_from_shm", {"shm_name": seg.name, "tensors": good[:half], "is_last": False,
                                                "weight_version": "half"})
        assert r.status_code == 200, f"first bucket: {r.status_code} {r.text[:300]}"
        bad = good[half:] + [{"name": "model.layers.9.mlp.up_proj.weight", "dtype": "bfloat16",
                              "shape": [256, 96], "offset": 0}]
        r = d.post("/update_weights_from_shm", {"shm_name": seg.name, "tensors": bad, "is_last": True,
                                                "weight_version": "half"})
        assert r.status_code == 400, f"bad second bucket: {r.status_code} {r.text[:300]}"
        assert prompt_lps(score_all(d, prompts)) == before, "a voided two-bucket update changed outputs"
        assert c.get_weight_version() == v0

        # After all that, a correct update still goes through.
        r = d.post("/update_weights_from_shm", {"shm_name": seg.name, "tensors": good, "is_last": True,
                                                "weight_version": "good"})
        assert r.status_code == 200, f"valid update after refused ones: {r.status_code} {r.text[:300]}"
        assert c.get_weight_version() == "good"
        check_bf16_golden(d, golden(PERT, "golden.json"), "qwen3/perturbed after refused updates")
    finally:
        seg.close()
        small.close()


# ================================================================ static KV scales

STATIC_KV_ARGS = ["--quantization", "bf16", "--kv-cache-dtype", "fp8", "--kv-scale-mode", "static"]


def _with_kv_scales(src, dst, k, v):
    """Copies checkpoint dir src to dst with per-layer, per-KV-head F32 self_attn.k_scale / v_scale
    (k, v: [layers][kv heads]) appended to model.safetensors."""
    import json
    import struct
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("perturbed", "golden*.json"))
    sd = load_file(src / "model.safetensors", raw=True)
    for l, (kl, vl) in enumerate(zip(k, v)):
        for which, vals in (("k_scale", kl), ("v_scale", vl)):
            sd[f"model.layers.{l}.self_attn.{which}"] = (memoryview(np.asarray(vals, "<f4").tobytes()), "float32",
                                                          (len(vals),))
    header, off = {}, 0
    st = {"bfloat16": "BF16", "float32": "F32"}
    for name, (mv, dt, shape) in sd.items():
        header[name] = {"dtype": st[dt], "shape": list(shape), "data_offsets": [off, off + len(mv)]}
        off += len(mv)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(dst / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for mv, _, _ in sd.values():
            f.write(mv)
    return sd


def kv_scale_checkpoints(dir_a, dir_b):
    """ORIG copied to dir_a and dir_b with static per-head KV scales, b's 4x (k) and 3x (v) a's;
    returns (number of layers, b's tensors)."""
    import json
    cfg = json.loads((ORIG / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    ka = [[0.02 + 0.01 * h for h in range(heads)] for _ in range(layers)]
    va = [[0.01 + 0.005 * h for h in range(heads)] for _ in range(layers)]
    kb = [[4 * x for x in row] for row in ka]
    vb = [[3 * x for x in row] for row in va]
    _with_kv_scales(ORIG, dir_a, ka, va)
    return layers, _with_kv_scales(ORIG, dir_b, kb, vb)


def test_shm_push_kv_scales(rolloutd, tmp_path):
    layers, sd_b = kv_scale_checkpoints(tmp_path / "a", tmp_path / "b")
    prompts = golden(ORIG, "golden.json")["prompts"]

    ref = rolloutd(tmp_path / "b", *STATIC_KV_ARGS)   # the reference: started on scales b
    want = prompt_lps(score_all(ref, prompts))
    ref.stop()
    d = rolloutd(tmp_path / "a", *STATIC_KV_ARGS)
    c = Client(d.url)
    before = prompt_lps(score_all(d, prompts))
    assert before != want, "k/v scales 4x and 3x larger should change FP8-KV logprobs"

    res = c.push_weights(sd_b, version="kv-b", bucket_bytes=64 << 10)
    assert "KV scales from this update" in res.response["message"], res.response
    assert prompt_lps(score_all(d, prompts)) == want, "pushed KV scales serve differently from loaded ones"

    # a push without scales keeps them; a partial set and a q_scale are refused whole
    no_scales = {k: t for k, t in sd_b.items() if not k.endswith(("k_scale", "v_scale"))}
    c.push_weights(no_scales, version="kv-kept")
    assert prompt_lps(score_all(d, prompts)) == want
    partial = {k: t for k, t in sd_b.items() if not k.startswith(f"model.layers.{layers - 1}.self_attn.v_scale")}
    with pytest.raises(RolloutdError) as ei:
        c.push_weights(partial, version="kv-partial")
    assert ei.value.status == 400 and f"model.layers.{layers - 1}.self_attn.v_scale" in str(ei.value)
    q_scale = dict(no_scales)
    q_scale["model.layers.0.self_attn.q_scale"] = (memoryview(np.float32(0.1).tobytes()), "float32", ())
    with pytest.raises(RolloutdError) as ei:
        c.push_weights(q_scale, version="kv-q")
    assert ei.value.status == 400 and "query scale" in str(ei.value)
    assert prompt_lps(score_all(d, prompts)) == want and c.get_weight_version() == "kv-kept"
    d.stop()

    # calibrate mode takes the push and says the scales are not used
    d = rolloutd(tmp_path / "a", "--quantization", "bf16", "--kv-cache-dtype", "fp8")
    res = Client(d.url).push_weights(sd_b, version="kv-cal")
    assert "pushed KV scales are unused" in res.response["message"], res.response


# ================================================================ updates under load

N_UPDATES = 20
GEN_TOKENS = 40


# f32 KV, and the default FP8 KV whose per-head scales every update recalibrates over the staged
# weights on the sync service's threads while generation goes on (then the references, daemons
# started on each weight set, calibrate the same scales at start: the logprobs must still match)
KV_UNDER_LOAD = {"f32": BF16_ARGS,
                 "fp8-calibrate": ["--quantization", "bf16", "--kv-cache-dtype", "fp8", "--kv-scale-mode", "calibrate"]}


@pytest.mark.parametrize("kv", list(KV_UNDER_LOAD))
def test_generation_during_updates(rolloutd, tmp_path, kv):
    args = KV_UNDER_LOAD[kv]
    d = rolloutd(ORIG, *args)
    c = Client(d.url)
    orig, pert = weights(ORIG), weights(PERT)
    v0 = c.get_weight_version()
    which = {v0: "orig"}
    prompts = [p["input_ids"] for p in golden(ORIG, "golden.json")["prompts"]][1:3]  # 7 and 33 tokens
    stop = threading.Event()
    results, errors = [], []

    def generator(k):
        i = 0
        while not stop.is_set():
            i += 1
            try:
                outs = Client(d.url).generate(prompts, n=2, max_new_tokens=GEN_TOKENS, temperature=1.0,
                                              sampling_seed=1000 * k + i, ignore_eos=True)
            except Exception as e:  # noqa: BLE001 -- reported below
                errors.append(repr(e))
                return
            for j, o in enumerate(outs):
                results.append((prompts[j // 2], o))

    threads = [threading.Thread(target=generator, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        timings = []
        for u in range(1, N_UPDATES + 1):
            v = f"u{u}"
            which[v] = "pert" if u % 2 else "orig"
            res = c.push_weights(pert if u % 2 else orig, version=v, bucket_bytes=256 << 10)
            assert res.response["weight_version"] == v
            timings.append(res.seconds)
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors[:3]
    assert c.get_weight_version() == f"u{N_UPDATES}"
    assert len(results) >= 8, f"only {len(results)} outputs came back"

    crossed = 0
    for prompt, o in results:
        assert o.finish_reason == "length" and len(o.output_ids) == GEN_TOKENS, (o.finish, len(o.output_ids))
        assert len(o.output_logprobs) == GEN_TOKENS and np.all(np.isfinite(o.output_logprobs))
        assert o.weight_version in which, f"reported weight_version {o.weight_version!r} was never pushed"
        spans = o.weight_versions
        assert spans and spans[0][1] == 0 and spans[-1][2] == GEN_TOKENS and all(
            a[2] == b[1] for a, b in zip(spans, spans[1:])), f"spans do not tile the output: {spans}"
        assert all(v in which for v, _, _ in spans), f"span versions {spans} include one never pushed"
        crossed += len(spans) > 1
    print(f"\n{len(results)} outputs, {crossed} crossed an update; push seconds "
          f"median {sorted(timings)[len(timings) // 2]:.4f} max {max(timings):.4f}")
    if any(o.spans_reported for _, o in results):
        assert crossed > 0, "no output crossed any of the 20 updates: the test did not exercise anything"
    d.stop()

    # Teacher-force every output on daemons serving each weight set; compare token by token.
    refs = {"orig": rolloutd(ORIG, *args), "pert": rolloutd(PERT, *args)}
    worst, checked, bad = 0.0, 0, []
    for prompt, o in results:
        seq = list(prompt) + o.output_ids.tolist()
        ref_lps = {}
        for kind, ref in refs.items():
            r = ref.post("/generate", {"input_ids": seq, "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": len(prompt)})
            assert r.status_code == 200, r.text
            ref_lps[kind] = [e[0] for e in r.json()["meta_info"]["input_token_logprobs"]]
            assert len(ref_lps[kind]) == len(o.output_ids), (len(ref_lps[kind]), len(o.output_ids))
        # whatever the labels say, every token comes from one of the two weight sets
        mixed = [t for t in range(len(o.output_ids)) if min(abs(ref_lps[k][t] - o.output_logprobs[t])
                                                           for k in refs) > SPAN_TOL]
        assert not mixed, (f"output {o.rid}: tokens {mixed[:10]} match neither weight set "
                           f"(retractions {o.num_retractions})")
        for t, v in enumerate(o.token_versions()):
            kind = which[v]
            diff = abs(ref_lps[kind][t] - o.output_logprobs[t])
            worst = max(worst, diff)
            checked += 1
            if diff > SPAN_TOL:
                other = "orig" if kind == "pert" else "pert"
                bad.append(f"output {o.rid} token {t} (id {o.output_ids[t]}) reports version {v} ({kind}) with "
                           f"logprob {o.output_logprobs[t]:.8f}; {kind} weights give {ref_lps[kind][t]:.8f} "
                           f"(|diff| {diff:.3g}), {other} weights {ref_lps[other][t]:.8f} (|diff| "
                           f"{abs(ref_lps[other][t] - o.output_logprobs[t]):.3g}); spans {o.weight_versions}, "
                           f"retractions {o.num_retractions}")
    print(f"checked {checked} tokens against their version's weights: max |diff| {worst:.2e}")
    spans = any(o.spans_reported for _, o in results)
    assert not bad, (f"{len(bad)} of {checked} tokens do not have the logprob of the version they report"
                     + ("" if spans else " (meta_info has no per-token weight version spans, only "
                        "weight_version: tokens sampled before an update are reported under the new version)")
                     + ":\n" + "\n".join(bad[:10]))


# ================================================================ from disk

def test_update_from_disk(rolloutd, tmp_path):
    d = rolloutd(ORIG, *BF16_ARGS, "--allowed-weight-dir", MODELS)
    c = Client(d.url)
    prompts = golden(ORIG, "golden.json")["prompts"]
    before = prompt_lps(score_all(d, prompts))
    v0 = c.get_weight_version()
    outside = tmp_path / "outside"
    shutil.copytree(PERT, outside)
    refused = {
        "outside the allowed dir": outside,
        "'..' resolving outside": pathlib.Path(str(MODELS) + "/.." * (len(MODELS.parts) - 1) + str(outside)),
        "not a model dir": MODELS / "does-not-exist",
        "another architecture": MODELS / "qwen2",
        "relative path": pathlib.Path("tests/fixtures/models/qwen3/perturbed"),
    }
    for label, path in refused.items():
        try:
            resp = c.update_from_disk(path, version="bad")
        except RolloutdError as e:
            assert e.status == 400, f"{label} ({path}): {e}"
        else:
            pytest.fail(f"{label}: /update_weights_from_disk {path} was accepted: {resp}")
        assert prompt_lps(score_all(d, prompts)) == before, f"{label}: outputs changed"
        assert c.get_weight_version() == v0

    resp = c.update_from_disk(PERT, version="disk-1")
    assert resp.get("success") is True and resp.get("weight_version") == "disk-1", resp
    assert c.get_weight_version() == "disk-1"
    check_bf16_golden(d, golden(PERT, "golden.json"), "qwen3/perturbed from disk")
    c.update_from_disk(ORIG, version="disk-2")
    check_bf16_golden(d, golden(ORIG, "golden.json"), "qwen3 from disk")


def test_update_from_disk_rejects_dotdot(rolloutd):
    """A path with a '..' component is refused even when it resolves inside the allowed dir: the
    daemon never has to reason about what a '..' walk reaches."""
    d = rolloutd(ORIG, *BF16_ARGS, "--allowed-weight-dir", MODELS)
    c = Client(d.url)
    v0 = c.get_weight_version()
    path = MODELS / "qwen3" / ".." / "qwen3" / "perturbed"
    try:
        resp = c.update_from_disk(path, version="dotdot")
    except RolloutdError as e:
        assert e.status == 400, e
    else:
        pytest.fail(f"/update_weights_from_disk {path} was accepted: {resp}")
    assert c.get_weight_version() == v0


def test_update_from_disk_symlink_escape(rolloutd, tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copytree(PERT, allowed / "inside")
    shutil.copytree(PERT, tmp_path / "outside")
    os.symlink(tmp_path / "outside", allowed / "escape")
    d = rolloutd(ORIG, *BF16_ARGS, "--allowed-weight-dir", allowed)
    c = Client(d.url)
    with pytest.raises(RolloutdError) as ei:
        c.update_from_disk(allowed / "escape", version="esc")
    assert ei.value.status == 400, ei.value
    assert c.update_from_disk(allowed / "inside", version="in")["weight_version"] == "in"


def test_update_from_disk_needs_allowed_dir(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    with pytest.raises(RolloutdError) as ei:
        Client(d.url).update_from_disk(PERT, version="x")
    assert ei.value.status == 400 and ei.value.message, ei.value


# ================================================================ NCCL in a CPU build

def test_nccl_routes_refused_without_cuda(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    info = d.get("/get_server_info")
    if info.status_code == 200 and "cuda" in str(info.json().get("backend", "")).lower():
        pytest.skip("CUDA build: NCCL routes are live")
    bodies = {
        "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 29711, "rank_offset": 1,
                                       "world_size": 2, "group_name": "g0", "backend": "nccl"},
        "/update_weights_from_distributed": {"names": ["model.norm.weight"], "dtypes": ["bfloat16"],
                                             "shapes": [[96]], "group_name": "g0", "weight_version": "n1"},
        "/destroy_weights_update_group": {"group_name": "g0"},
    }
    for route, body in bodies.items():
        r = d.post(route, body)
        assert r.status_code == 400, f"{route} -> {r.status_code}: {r.text[:300]}"
        msg = r.json()["error"]["message"]
        assert msg, route
        if route == "/init_weights_update_group":
            assert "nccl" in msg.lower() or "cuda" in msg.lower(), f"{route}: unclear message {msg!r}"
    assert Client(d.url).get_weight_version() != "n1"
    r = requests.get(d.url + "/health", timeout=10)
    assert r.status_code == 200
