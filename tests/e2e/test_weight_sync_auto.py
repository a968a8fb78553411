"""Updates without is_last (SGLang-style trainers): an update commits once every parameter is in, and
a bucket that then brings only what may come besides the parameters, for the same version, is that
update's tail, not the start of a new one:
  - a tied lm_head.weight alone (a state_dict() ends with it, and a client sends a tensor larger
    than a bucket alone): accepted, nothing changes, and the next version is not held off (it used
    to open a transaction that could never complete: 409 for weight-update-timeout);
  - KV scales alone, under --kv-scale-mode static: installed, exactly as if they had come with the
    weights (they used to be staged and silently lost).
"""
import json

from test_golden import BF16_ARGS
# (test_weight_sync puts clients/python on sys.path)
from test_weight_sync import (ORIG, PERT, STATIC_KV_ARGS, _write_all, golden, kv_scale_checkpoints, prompt_lps,
                              score_all, weights)
from rolloutd_client.shm import ALIGN, Segment  # noqa: E402


def _post(d, seg, sd, version):
    body = {"shm_name": seg.name, "tensors": _write_all(sd, seg)}  # no is_last
    if version is not None:
        body["weight_version"] = version
    r = d.post("/update_weights_from_shm", body)
    assert r.status_code == 200, f"{version}: {r.status_code} {r.text[:300]}"
    return r.json()


def _segment(sd):
    return Segment(sum((len(v[0]) + ALIGN - 1) // ALIGN * ALIGN for v in sd.values()))


def test_auto_commit_then_tied_lm_head_alone(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    pert = weights(PERT)
    assert "lm_head.weight" not in pert and json.loads((ORIG / "config.json").read_text())["tie_word_embeddings"]
    seg = _segment(pert)
    try:
        r = _post(d, seg, pert, "18")
        assert r["committed"] is True, r
        tail = {"lm_head.weight": pert["model.embed_tokens.weight"]}
        r = _post(d, seg, tail, "18")
        assert r["committed"] is False and "tail of version '18'" in r["message"], r
        assert "follows embed_tokens" in r["message"], r
        # the next version goes through at once (no transaction left open by the tail)
        r = _post(d, seg, weights(ORIG), "19")
        assert r["committed"] is True, r
        assert d.get("/get_weight_version").json()["weight_version"] == "19"
        # a tail without a version belongs to the update just committed
        r = _post(d, seg, tail, None)
        assert r["committed"] is False and "tail of version '19'" in r["message"], r
        r = _post(d, seg, pert, "20")
        assert r["committed"] is True, r
    finally:
        seg.close()


def test_auto_commit_then_kv_scales_alone(rolloutd, tmp_path):
    layers, sd_b = kv_scale_checkpoints(tmp_path / "a", tmp_path / "b")
    prompts = golden(ORIG, "golden.json")["prompts"]
    ref = rolloutd(tmp_path / "b", *STATIC_KV_ARGS)
    want = prompt_lps(score_all(ref, prompts))
    ref.stop()

    d = rolloutd(tmp_path / "a", *STATIC_KV_ARGS)
    scales = {k: t for k, t in sd_b.items() if k.endswith(("k_scale", "v_scale"))}
    params = {k: t for k, t in sd_b.items() if k not in scales}
    assert len(scales) == 2 * layers
    seg = _segment(sd_b)
    try:
        r = _post(d, seg, params, "kv-b")
        assert r["committed"] is True, r
        assert prompt_lps(score_all(d, prompts)) != want, "scales a and b should serve differently"
        r = _post(d, seg, scales, "kv-b")
        assert "tail of version 'kv-b'" in r["message"] and "KV scales from this bucket installed" in r["message"], r
        assert prompt_lps(score_all(d, prompts)) == want, "KV scales in the tail bucket did not take effect"
        assert d.get("/get_weight_version").json()["weight_version"] == "kv-b"
        r = _post(d, seg, params, "kv-c")  # nothing left open
        assert r["committed"] is True, r
    finally:
        seg.close()
