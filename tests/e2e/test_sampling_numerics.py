"""Sampling at the edges, end to end on the qwen3 fixture (bf16, f32 KV):

  - temperatures from the smallest positive float to 10, on /generate and /v1/completions: below
    1e-6 the answer is greedy with T = 1 logprobs (SGLang's rule); above it every token is drawn
    from softmax(x / T) and reported with its logprob there, against a double-precision reference
    built from the prompt-scoring path's raw top-20 logprobs (at T <= 0.1 the rest of the
    vocabulary is below 1e-6 of the mass); never a null logprob, never a token outside the
    distribution;
  - top_logprobs at low temperature: the next-largest logits with their exact logprobs (not ids
    0, 1, ... tied at probability 0), in every logprobs_mode, and the truncated distribution of
    "processed";
  - min_new_tokens masks EOS and stop_token_ids until that many tokens are out, on a prompt where
    EOS is likely; the masked steps' logprobs follow the documented rule (default and processed:
    the masked distribution, lp - log(1 - p(stop ids)); raw: the model's own), computed here from
    teacher-forced scores of every candidate.
"""
import math
import pathlib

import pytest

from test_golden import BF16_ARGS

ROOT = pathlib.Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "tests" / "fixtures" / "models" / "qwen3"
pytestmark = pytest.mark.skipif(not (QWEN3 / "config.json").is_file(), reason="no qwen3 fixture")

PROMPT = [186, 456, 151, 288, 273, 473]   # EOS (511) is the third most likely next token here
EOS = 511
TEMPS = [1e-45, 1e-38, 1e-20, 1e-6, 1e-3, 0.1, 1.0, 10.0]


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    from conftest import Daemon
    daemon = Daemon(QWEN3, BF16_ARGS, tmp_path_factory.mktemp("sampling") / "rolloutd.log")
    yield daemon
    assert daemon.stop() == 0, daemon.read_log()[-3000:]


def post(d, body, path="/generate"):
    r = d.post(path, body)
    assert r.status_code == 200, f"{path} -> {r.status_code}: {r.text[:400]}"
    return r.json()


def f32(x):
    import struct
    return struct.unpack("f", struct.pack("f", x))[0]


EPS = f32(1e-6)


def raw_top(d, ctx, k=20):
    """{token: log_softmax(x)[token]} for the k largest logits after ctx (raw mode, T = 1)."""
    out = post(d, {"input_ids": ctx + [0], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                   "logprob_start_len": len(ctx), "top_logprobs_num": k, "logprobs_mode": "raw"})
    return {tok: lp for lp, tok, _ in out["meta_info"]["input_top_logprobs"][0]}


def ref_logprob(raw, tok, t):
    """log_softmax(x / t)[tok] in double from raw log_softmax(x) values (t as the float sent)."""
    t = f32(t)
    top = max(raw.values())
    z = {i: (l - top) / t for i, l in raw.items()}
    m = max(z.values())
    return z[tok] - (m + math.log(sum(math.exp(v - m) for v in z.values())))


def tol(want, raw=None, tok=None, t=1.0):
    """Tolerance against ref_logprob: the raw values come as fp32 (half an ulp each), which the
    reference divides by t."""
    slack = 0.0 if raw is None else 2.0 ** -24 * (abs(raw[tok]) + abs(max(raw.values()))) / f32(t)
    return 1e-4 + 1e-6 * abs(want) + slack


@pytest.mark.parametrize("t", TEMPS)
def test_temperature_edges_generate(d, t):
    raw = raw_top(d, PROMPT)
    best = max(raw, key=raw.get)
    outs = post(d, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": t, "n": 16,
                                                              "sampling_seed": 11},
                    "return_logprob": True, "top_logprobs_num": 5})
    for o in outs:
        (lp, tok, _), = o["meta_info"]["output_token_logprobs"]
        assert lp is not None and 0 <= tok < 512, (t, lp, tok)
        if f32(t) < EPS:
            assert tok == best and abs(lp - raw[best]) <= 1e-5, (t, tok, lp, best, raw[best])
        elif t <= 0.1:
            assert tok in raw, f"T={t}: token {tok} is not among the 20 most likely"
            want = ref_logprob(raw, tok, t)
            assert abs(lp - want) <= tol(want, raw, tok, t), (t, tok, lp, want)
        else:
            assert math.isfinite(lp) and lp < 0
        top = o["meta_info"]["output_top_logprobs"][0]
        assert [e[1] for e in top] == sorted(raw, key=lambda i: (-raw[i], i))[:5], (t, top)
        if t <= 0.1:
            for tlp, ttok, _ in top:
                want = raw[ttok] if f32(t) < EPS else ref_logprob(raw, ttok, t)
                assert tlp is not None and abs(tlp - want) <= tol(want, raw, ttok, t), (t, ttok, tlp, want)


@pytest.mark.parametrize("t", TEMPS)
def test_temperature_edges_completions(d, t):
    raw = raw_top(d, PROMPT)
    best = max(raw, key=raw.get)
    out = post(d, {"model": None, "prompt": PROMPT, "max_tokens": 1, "temperature": t, "n": 8, "seed": 5,
                   "logprobs": 3}, "/v1/completions")
    for ch in out["choices"]:
        (tok,) = ch["token_ids"]
        (lp,) = ch["logprobs"]["token_logprobs"]
        assert lp is not None and 0 <= tok < 512, (t, lp, tok)
        if f32(t) < EPS:
            assert tok == best and abs(lp - raw[best]) <= 1e-5
        elif t <= 0.1:
            want = ref_logprob(raw, tok, t)
            assert abs(lp - want) <= tol(want, raw, tok, t), (t, tok, lp, want)
        alts = ch["logprobs"]["top_logprobs"][0]
        assert all(v is not None and math.isfinite(v) for v in alts.values()), alts


@pytest.mark.parametrize("t", [1e-6, 1e-3, 0.1])
def test_top_logprobs_low_temperature_every_mode(d, t):
    raw = raw_top(d, PROMPT)
    order = sorted(raw, key=lambda i: (-raw[i], i))
    for mode in ("default", "raw", "processed"):
        sp = {"max_new_tokens": 1, "temperature": t, "sampling_seed": 2}
        if mode == "processed":
            sp["top_k"] = 3
        (o,) = [post(d, {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True,
                         "top_logprobs_num": 6, "logprobs_mode": mode})]
        top = o["meta_info"]["output_top_logprobs"][0]
        ids = [e[1] for e in top]
        if mode == "processed":
            assert ids == order[:3], (mode, t, top)
            kept = {i: ref_logprob(raw, i, t) for i in order[:3]}
            m = max(kept.values())
            lse = m + math.log(sum(math.exp(v - m) for v in kept.values()))
            wants = [kept[i] - lse for i in ids]
        else:
            assert ids == order[:6], (mode, t, top)
            wants = [raw[i] if mode == "raw" else ref_logprob(raw, i, t) for i in ids]
        for (lp, tok, _), want in zip(top, wants):
            slack = tol(want) if mode == "raw" else tol(want, raw, tok, t) + (tol(0, raw, ids[0], t) if mode == "processed" else 0)
            assert lp is not None and abs(lp - want) <= slack, (mode, t, tok, lp, want)


def scores(d, ctxs, toks, t):
    """log_softmax(x / t)[toks[i]] after ctxs[i] for every i, teacher-forced in one batch."""
    outs = post(d, {"input_ids": [c + [k] for c, k in zip(ctxs, toks)],
                    "sampling_params": {"max_new_tokens": 0, "temperature": t}, "return_logprob": True,
                    "logprob_start_len": len(ctxs[0])})
    return [o["meta_info"]["input_token_logprobs"][0][0] for o in outs]


def test_min_new_tokens_masks_eos_and_stop_ids(d):
    t, n, min_new = 0.3, 24, 4
    stop = 493   # the second most likely first token
    base = {"input_ids": PROMPT, "return_logprob": True}
    sp = {"max_new_tokens": 6, "temperature": t, "n": n, "sampling_seed": 3}
    free = post(d, dict(base, sampling_params=dict(sp, stop_token_ids=[stop])))
    early = sum(any(x in (EOS, stop) for x in o["output_ids"][:min_new - 1]) for o in free)
    assert early >= 4, f"only {early} of {n} unmasked samples stop early: EOS is not likely enough here"

    sp.update(min_new_tokens=min_new, stop_token_ids=[stop])
    runs = {mode: post(d, dict(base, sampling_params=sp, logprobs_mode=mode)) for mode in ("default", "processed", "raw")}
    outs = runs["default"]
    for mode in ("processed", "raw"):
        assert [o["output_ids"] for o in runs[mode]] == [o["output_ids"] for o in outs], mode
    for o in outs:
        ids = o["output_ids"]
        assert len(ids) >= min_new and not {EOS, stop} & set(ids[:min_new]), ids
        if len(ids) < 6:
            assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[-1]}, o["meta_info"]
    for i in range(min_new + 1):
        live = [o for o in outs if len(o["output_ids"]) > i]
        ctxs = [PROMPT + o["output_ids"][:i] for o in live]
        toks = [o["output_ids"][i] for o in live]
        lp_t, lp_raw = scores(d, ctxs, toks, t), scores(d, ctxs, toks, 1.0)
        p_eos = [math.exp(x) for x in scores(d, ctxs, [EOS] * len(live), t)]
        p_stop = [math.exp(x) for x in scores(d, ctxs, [stop] * len(live), t)]
        for j, o in enumerate(live):
            k = outs.index(o)
            masked = i < min_new
            want = lp_t[j] - math.log1p(-(p_eos[j] + p_stop[j])) if masked else lp_t[j]
            for mode, w in (("default", want), ("processed", want), ("raw", lp_raw[j])):
                got = runs[mode][k]["meta_info"]["output_token_logprobs"][i][0]
                assert got is not None and abs(got - w) <= 1e-4, (mode, i, toks[j], got, w, masked)
