"""slime's top-p replay (custom_params.return_top_p_token_ids), against a float64 reference.

slime (its SGLang patch docker/patch/latest/sglang-top_p.patch, and slime/utils/types.py, which
reads the result) asks for the token ids the sampler kept at every output token, to renormalize its
training logprobs over the same set; the rollout's logprobs are then the renormalized ones. Checked
on the qwen3 fixture against qwen3_numpy (transformers' numbers, float64), with SGLang's rule for the
kept set: sorted by probability, rank < top_k, (cumsum - p) <= top_p, p >= p_max * min_p:
  - every finished output carries meta_info top_p_token_ids and top_p_token_offsets, base64 int32
    (little-endian), offsets[0] = 0 and one more offset than output tokens, as slime asserts;
  - each token's kept set is the reference's (ids within 1e-4 of a boundary may fall either way),
    most likely first, holds the sampled token, and its logprob is log(p / kept mass);
  - greedy keeps the token itself; nothing truncating keeps no list; streamed, only the last event
    carries the arrays;
  - a non-boolean flag, and logprobs_mode "raw" with it, are refused with a 400.
"""
import base64
import json

import numpy as np
import pytest

from conftest import Daemon
from test_penalties import MODEL, prompt, ref  # noqa: F401  (the numpy reference and the 33-token prompt)

ARGS = ["--quantization", "bf16", "--kv-cache-dtype", "f32", "--kv-cache-mb", "64"]
FLAG = {"custom_params": {"return_top_p_token_ids": True}}
EDGE = 1e-4     # rolloutd's fp32 forward vs the float64 reference, in probability mass
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="no qwen3 fixture")


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    daemon = Daemon(MODEL, ARGS, tmp_path_factory.mktemp("top_p_ids") / "rolloutd.log")
    yield daemon
    assert daemon.stop() == 0, daemon.read_log()[-3000:]


def int32s(b64):
    return np.frombuffer(base64.b64decode(b64), dtype="<i4")


def kept_rows(meta, n_out):
    ids, off = int32s(meta["top_p_token_ids"]), int32s(meta["top_p_token_offsets"])
    assert len(off) == n_out + 1 and off[0] == 0 and off[-1] == len(ids), (len(off), n_out, off[-1], len(ids))
    assert np.all(np.diff(off) >= 0)
    return [ids[off[i]:off[i + 1]].tolist() for i in range(n_out)]


def reference_sets(z, t, top_p, top_k, min_p):
    """(must keep, may keep, probs) for logits z under SGLang's truncation rule."""
    p = np.exp((z - z.max()) / t)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    ps = p[order]
    before = np.cumsum(ps) - ps
    rank = np.arange(len(ps))
    k = top_k if top_k > 0 else len(ps)
    must = (rank < k) & (before <= top_p - EDGE) & (ps >= ps[0] * min_p + EDGE)
    may = (rank < k) & (before <= top_p + EDGE) & (ps >= ps[0] * min_p - EDGE)
    return set(order[must].tolist()), set(order[may].tolist()), p


@pytest.mark.parametrize("sp", [
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 0.7, "top_p": 0.95, "top_k": 40},
    {"temperature": 1.3, "top_p": 1.0, "min_p": 0.05},
], ids=["top_p", "top_p+top_k", "min_p"])
def test_kept_ids_match_the_reference(d, ref, prompt, sp):
    n_new = 6
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n_new, "ignore_eos": True, "n": 2, "sampling_seed": 11, **sp,
                                **FLAG}}
    r = d.post("/generate", body)
    assert r.status_code == 200, r.text
    for out in r.json():
        ids, meta = out["output_ids"], out["meta_info"]
        assert len(ids) == n_new
        rows = kept_rows(meta, n_new)
        for i, tok in enumerate(ids):
            z = ref.logits(prompt + ids[:i])[-1]
            must, may, p = reference_sets(z, sp["temperature"], sp.get("top_p", 1.0), sp.get("top_k", -1),
                                          sp.get("min_p", 0.0))
            got = rows[i]
            assert len(set(got)) == len(got) and tok in got, (i, tok)
            assert must <= set(got) <= may, (i, sorted(must ^ set(got))[:10], len(must), len(got), len(may))
            assert all(p[a] >= p[b] - 1e-5 for a, b in zip(got, got[1:])), "not most likely first"
            want = np.log(p[tok] / p[got].sum())
            lp = meta["output_token_logprobs"][i][0]
            assert abs(lp - want) < 1e-3, (i, lp, want)


def test_greedy_and_untruncated_and_streamed(d, prompt):
    r = d.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, **FLAG}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert kept_rows(out["meta_info"], 4) == [[t] for t in out["output_ids"]]

    r = d.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 1.0,
                                                                      "sampling_seed": 2, **FLAG}})
    assert r.status_code == 200, r.text
    assert kept_rows(r.json()["meta_info"], 3) == [[], [], []]

    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "top_p": 0.5, "sampling_seed": 3, **FLAG}}
    r = d.post("/generate", body, stream=True)
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(events) >= 2
    assert all("top_p_token_ids" not in e["meta_info"] for e in events[:-1])
    last = events[-1]
    assert len(kept_rows(last["meta_info"], len(last["output_ids"]))) == 5


@pytest.mark.parametrize("body,param", [
    ({"sampling_params": {"custom_params": {"return_top_p_token_ids": "yes"}}},
     "sampling_params.custom_params.return_top_p_token_ids"),
    ({"sampling_params": {"custom_params": 3}}, "sampling_params.custom_params"),
    ({"logprobs_mode": "raw", "sampling_params": FLAG}, "logprobs_mode"),
])
def test_refused(d, body, param):
    r = d.post("/generate", {"input_ids": [1, 2, 3], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert d.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}).status_code == 200
