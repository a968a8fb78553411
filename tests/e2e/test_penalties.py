"""Sampling penalties (frequency, presence, repetition) against an independent reference.

The reference is numpy: the fixture Qwen3's logits from a float64 forward pass of its own
(qwen3_numpy.py, checked against transformers' golden logprobs first), and the penalty math written
from SGLang's definition: over the tokens the sample has output (not the prompt), a positive logit
is divided by repetition_penalty and a negative one multiplied, then frequency_penalty x count and
presence_penalty are subtracted; temperature and truncation come after. For every output position
the daemon's logprob (and its top alternatives) must be the reference's for the logprobs_mode asked:
  default    log_softmax(penalized / T)          (SGLang's: after penalties and temperature,
                                                   before top-k / top-p / min-p)
  raw        log_softmax(logits)                 (vLLM's raw_logprobs: no penalty, no temperature)
  processed  log of the renormalized probability over what top-k / top-p / min-p keep of
             softmax(penalized / T)              (vLLM's processed_logprobs)
Greedy decoding must pick the reference's argmax of the penalized logits. The same request alone,
inside a batch with other prompts and samples, repeated with its seed, and through /v1/completions
must produce the same tokens.
"""
import math
from collections import Counter

import numpy as np
import pytest

from conftest import FIXTURES, Daemon
import qwen3_numpy

MODEL = FIXTURES / "models" / "qwen3"
ARGS = ["--quantization", "bf16", "--kv-cache-dtype", "f32", "--kv-cache-mb", "64", "--max-top-logprobs", "8"]
TOL = 1e-3          # rolloutd's fp32 forward vs the float64 reference (test_golden's tolerance)
NEAR_TIE = 2e-3     # greedy steps this close to a tie may go either way: token comparison stops there
PEN = {"frequency_penalty": 0.4, "presence_penalty": 0.3, "repetition_penalty": 1.7}


@pytest.fixture(scope="module")
def ref():
    model = qwen3_numpy.Qwen3(MODEL)
    qwen3_numpy.check_against_golden(model)
    return model


@pytest.fixture(scope="module")
def prompt():
    import json
    return json.loads((MODEL / "golden.json").read_text())["prompts"][2]["input_ids"]  # 33 tokens


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(MODEL, ARGS, tmp_path_factory.mktemp("penalties") / "rolloutd.log")
    yield d
    rc = d.stop()
    assert rc == 0, f"rolloutd exited with {rc}:\n{d.read_log()[-4000:]}"


def penalize(z, counted, prompt_too=(), freq=0.0, pres=0.0, rep=1.0):
    """SGLang's penalties over the `counted` tokens (vLLM additionally repetition-penalizes prompt_too)."""
    z = np.array(z, dtype=np.float64)
    counts = Counter(counted)
    for t in set(counts) | set(prompt_too):
        if rep != 1.0:
            z[t] = z[t] / rep if z[t] > 0 else z[t] * rep
    for t, c in counts.items():
        z[t] -= freq * c + pres
    return z


def log_softmax(z):
    return qwen3_numpy.log_softmax(z)


def generate(d, prompt, n_new, **sp):
    mode = sp.pop("logprobs_mode", "default")
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 5, "logprobs_mode": mode,
            "sampling_params": {"max_new_tokens": n_new, "ignore_eos": True, **sp}}
    r = d.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def reference_rows(ref, prompt, out):
    """The reference logits that chose each output token: row i predicts out[i]."""
    lg = ref.logits(prompt + out)
    return [lg[len(prompt) - 1 + i] for i in range(len(out))]


def expected_dist(z, out_before, temp, mode, top_k=-1, pen=PEN):
    """The reference log-distribution the daemon's logprobs come from, for one position."""
    if mode == "raw":
        return log_softmax(z)
    zp = penalize(z, out_before, freq=pen["frequency_penalty"], pres=pen["presence_penalty"],
                  rep=pen["repetition_penalty"])
    lp = log_softmax(zp / (temp if temp > 0 else 1.0))
    if mode == "processed" and top_k > 0:
        keep = np.argsort(-lp, kind="stable")[:top_k]
        out = np.full_like(lp, -np.inf)
        out[keep] = lp[keep] - np.log(np.exp(lp[keep]).sum())
        return out
    return lp


def check_logprobs(o, rows, temp, mode, top_k=-1, pen=PEN):
    ids = o["output_ids"]
    meta = o["meta_info"]
    for i, (z, t) in enumerate(zip(rows, ids)):
        want = expected_dist(z, ids[:i], temp, mode, top_k, pen)
        got = meta["output_token_logprobs"][i][0]
        assert abs(got - want[t]) < TOL, (mode, i, got, want[t])
        for lp, alt, _ in meta["output_top_logprobs"][i]:
            assert abs(lp - want[alt]) < TOL, (mode, i, alt, lp, want[alt])
        best = sorted(range(len(want)), key=lambda k: -want[k])[:5]
        got_ids = [alt for _, alt, _ in meta["output_top_logprobs"][i]]
        # the same alternatives, up to the order of (near-)ties
        assert all(abs(want[a] - want[b]) < TOL for a, b in zip(got_ids, best)), (mode, i, got_ids, best)


def test_reference_matches_transformers(ref):
    assert qwen3_numpy.check_against_golden(ref) < 1e-4


def test_greedy_with_penalties_picks_the_reference_argmax(daemon, ref, prompt):
    o = generate(daemon, prompt, 24, temperature=0.0, **PEN)
    ids = o["output_ids"]
    plain = generate(daemon, prompt, 24, temperature=0.0)["output_ids"]
    assert ids != plain, "the penalties changed nothing"
    assert max(Counter(plain).values()) > max(Counter(ids).values())  # the fixture repeats itself; less so now
    rows = reference_rows(ref, prompt, ids)
    for i, z in enumerate(rows):
        zp = penalize(z, ids[:i], freq=PEN["frequency_penalty"], pres=PEN["presence_penalty"],
                      rep=PEN["repetition_penalty"])
        top2 = np.sort(zp)[-2:]
        assert abs(log_softmax(zp)[ids[i]] - o["meta_info"]["output_token_logprobs"][i][0]) < TOL
        if top2[1] - top2[0] < NEAR_TIE:
            break  # a near-tie: either token is right, and later steps continue a different text
        assert ids[i] == int(np.argmax(zp)), (i, ids[i], int(np.argmax(zp)))
    check_logprobs(o, rows, 0.0, "default")


@pytest.mark.parametrize("mode", ["default", "raw", "processed"])
def test_sampled_logprobs_follow_logprobs_mode(daemon, ref, prompt, mode):
    o = generate(daemon, prompt, 20, temperature=0.8, sampling_seed=5, logprobs_mode=mode, **PEN)
    check_logprobs(o, reference_rows(ref, prompt, o["output_ids"]), 0.8, mode)


def test_processed_mode_with_top_k(daemon, ref, prompt):
    o = generate(daemon, prompt, 16, temperature=0.9, top_k=6, sampling_seed=8, logprobs_mode="processed", **PEN)
    check_logprobs(o, reference_rows(ref, prompt, o["output_ids"]), 0.9, "processed", top_k=6)


@pytest.mark.parametrize("pen", [{"frequency_penalty": 1.5}, {"presence_penalty": -1.0},
                                 {"repetition_penalty": 0.6}, {"frequency_penalty": -0.5, "repetition_penalty": 1.2}])
def test_each_penalty_alone(daemon, ref, prompt, pen):
    full = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, **pen}
    o = generate(daemon, prompt, 16, temperature=1.0, sampling_seed=3, **pen)
    check_logprobs(o, reference_rows(ref, prompt, o["output_ids"]), 1.0, "default", pen=full)


def test_only_output_tokens_count(daemon, ref, prompt):
    """SGLang's rule: the prompt's tokens are not repetition-penalized (vLLM would penalize them). The
    test is only meaningful where the two rules differ, so it checks that they do."""
    pen = {"repetition_penalty": 1.9}
    o = generate(daemon, prompt, 12, temperature=1.0, sampling_seed=21, **pen)
    ids, rows = o["output_ids"], reference_rows(ref, prompt, o["output_ids"])
    gap = 0.0
    for i, z in enumerate(rows):
        sglang = log_softmax(penalize(z, ids[:i], rep=1.9))[ids[i]]
        vllm = log_softmax(penalize(z, ids[:i], prompt_too=prompt, rep=1.9))[ids[i]]
        got = o["meta_info"]["output_token_logprobs"][i][0]
        assert abs(got - sglang) < TOL, (i, got, sglang, vllm)
        gap = max(gap, abs(vllm - sglang))
    assert gap > 0.05, "the prompt-counting rule would not have been told apart"


def test_neutral_penalties_change_nothing(daemon, prompt):
    a = generate(daemon, prompt, 12, temperature=1.0, sampling_seed=4)
    b = generate(daemon, prompt, 12, temperature=1.0, sampling_seed=4,
                 frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0)
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def test_batch_invariant_and_seeded(daemon, prompt):
    sp = {"max_new_tokens": 14, "temperature": 1.0, "sampling_seed": 17, "ignore_eos": True, **PEN}
    alone = daemon.post("/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": sp}).json()
    again = daemon.post("/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": sp}).json()
    assert again["output_ids"] == alone["output_ids"]
    # the same prompt among others, n = 2 (sample 0 uses the same (seed, 0) stream)
    batch = daemon.post("/generate", {"input_ids": [prompt[:7], prompt, prompt[5:]], "return_logprob": True,
                                      "sampling_params": dict(sp, n=2)}).json()
    assert len(batch) == 6
    assert batch[2]["output_ids"] == alone["output_ids"]
    assert [t[0] for t in batch[2]["meta_info"]["output_token_logprobs"]] == \
        [t[0] for t in alone["meta_info"]["output_token_logprobs"]]
    assert batch[3]["output_ids"] != alone["output_ids"]  # sample 1: its own stream, its own counts


def test_completions_route_applies_the_same_penalties(daemon, prompt):
    sp = {"temperature": 1.0, "ignore_eos": True, **PEN}
    gen = daemon.post("/generate", {"input_ids": prompt, "return_logprob": True,
                                    "sampling_params": dict(sp, max_new_tokens=10, sampling_seed=12)}).json()
    r = daemon.post("/v1/completions", {"prompt": prompt, "max_tokens": 10, "seed": 12, "logprobs": 0, **sp})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["token_ids"] == gen["output_ids"]
    assert all(abs(a - b[0]) < 1e-6 for a, b in zip(c["logprobs"]["token_logprobs"],
                                                     gen["meta_info"]["output_token_logprobs"]))


def test_extreme_repetition_penalties(daemon, prompt):
    """A repetition penalty so small that a repeated token's logit leaves fp32's range saturates it:
    greedy then repeats the first output token for ever, with logprob 0 (the reference's limit),
    instead of a 500. One that rounds to 0 in fp32 is out of (0, 2] and a 400, as 0 is."""
    o = generate(daemon, prompt, 6, temperature=0, repetition_penalty=1e-40)
    ids = o["output_ids"]
    assert ids[1:] == [ids[0]] * 5, ids
    lps = [t[0] for t in o["meta_info"]["output_token_logprobs"]]
    assert all(lp == 0.0 for lp in lps[1:]), lps
    o = generate(daemon, prompt, 6, temperature=1.0, sampling_seed=3, repetition_penalty=1e-40)
    assert all(lp is not None and math.isfinite(lp) for lp, _, _ in o["meta_info"]["output_token_logprobs"])
    for body, route in (({"input_ids": prompt, "sampling_params": {"repetition_penalty": 3e-258}}, "/generate"),
                        ({"prompt": prompt, "repetition_penalty": 3e-258}, "/v1/completions")):
        r = daemon.post(route, body)
        assert r.status_code == 400 and r.json()["error"]["param"].endswith("repetition_penalty"), r.text
