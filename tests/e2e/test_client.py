"""The Python client (clients/python, package rolloutd_client).

Against the real daemon: generate (single, batch, n, scoring), the result objects, errors as
RolloutdError, health and the control routes. Without a daemon: the TIS / MIS helpers against
hand-computed values, the FP8 quantizer against the pre-quantized fixture checkpoint (made by
PyTorch in scripts/make_fixtures.py), the bfloat16 / e4m3 codecs against ml_dtypes, the safetensors
reader, and the shm transport against a stub HTTP server that checks what arrives (segment mode
0600, offsets, bytes, is_last, unlink, also on error).
"""
import http.server
import json
import math
import os
import pathlib
import stat
import sys
import threading
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))

from rolloutd_client import Client, RolloutdError, fp8, tis  # noqa: E402
from rolloutd_client import dtypes as rdt  # noqa: E402
from rolloutd_client import safetensors as rst  # noqa: E402
from rolloutd_client import shm as rshm  # noqa: E402
from rolloutd_client import tensors as rtensors  # noqa: E402

MODELS = ROOT / "tests" / "fixtures" / "models"
PROMPT = [11, 22, 33, 44, 55]

try:
    import ml_dtypes
except ImportError:  # the client works without it; the cross-checks against it are skipped
    ml_dtypes = None


# ================================================================ against the daemon

@pytest.fixture
def client(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "128", "--weight-version", "v-start", "--quantization", "bf16")
    return Client(d.url, timeout=120)


def test_generate_single(client):
    (r,) = client.generate(PROMPT, max_new_tokens=5, temperature=1.0, sampling_seed=3, ignore_eos=True)
    assert r.output_ids.dtype == np.int64 and r.output_ids.shape == (5,)
    assert r.output_logprobs.dtype == np.float64 and r.output_logprobs.shape == (5,)
    assert np.all(r.output_logprobs <= 0) and np.all(np.isfinite(r.output_logprobs))
    assert r.finish_reason == "length" and r.finish == {"type": "length", "length": 5}
    assert r.prompt_tokens == len(PROMPT) and r.completion_tokens == 5
    assert r.weight_version == "v-start"
    assert r.weight_versions == [("v-start", 0, 5)] and r.token_versions() == ["v-start"] * 5
    assert isinstance(r.rid, str) and r.e2e_latency >= 0
    # same seed, same tokens and logprobs
    (r2,) = client.generate(PROMPT, max_new_tokens=5, temperature=1.0, sampling_seed=3, ignore_eos=True)
    assert np.array_equal(r.output_ids, r2.output_ids) and np.array_equal(r.output_logprobs, r2.output_logprobs)


def test_generate_batch_and_n(client):
    prompts = [PROMPT, [7, 8, 9]]
    res = client.generate(prompts, n=3, max_new_tokens=4, temperature=1.0, sampling_seed=1, ignore_eos=True)
    assert len(res) == 6
    assert [r.prompt_tokens for r in res] == [5, 5, 5, 3, 3, 3]  # prompt-major
    assert all(len(r.output_ids) == 4 and len(r.output_logprobs) == 4 for r in res)


def test_generate_without_logprobs_and_rid(client):
    (r,) = client.generate(PROMPT, max_new_tokens=3, return_logprob=False, rid="my-rid-1", ignore_eos=True)
    assert r.output_logprobs is None and r.rid == "my-rid-1" and len(r.output_ids) == 3


def test_score_is_teacher_forcing(client):
    (g,) = client.generate(PROMPT, max_new_tokens=6, temperature=1.0, sampling_seed=9, ignore_eos=True)
    seq = PROMPT + g.output_ids.tolist()
    (lp,) = client.score(seq)
    assert lp.shape == (len(seq),) and math.isnan(lp[0])
    # the scored logprobs of the generated tokens are the rollout logprobs (T = 1)
    np.testing.assert_allclose(lp[len(PROMPT):], g.output_logprobs, rtol=0, atol=2e-5)
    (r,) = client.generate(seq, max_new_tokens=0, logprob_start_len=0)
    assert np.array_equal(r.input_ids, np.array(seq)) and len(r.output_ids) == 0


def test_bad_request_raises(client):
    with pytest.raises(RolloutdError) as ei:
        client.generate(PROMPT, max_new_tokens=2, temperature=-1.0)
    e = ei.value
    assert e.status == 400 and e.param == "sampling_params.temperature" and "temperature" in e.message
    with pytest.raises(RolloutdError) as ei:
        client.generate(PROMPT, max_new_tokens=2, extra={"bogus_field": 1})
    assert ei.value.status == 400 and "bogus_field" in ei.value.message


def test_health_and_wait_ready(client):
    assert client.health() is True
    assert client.wait_ready(timeout=5)
    assert Client("http://127.0.0.1:9").health() is False


def test_api_key(rolloutd):
    d = rolloutd(None, "--kv-cache-mb", "64", "--api-key", "sekrit")
    with pytest.raises(RolloutdError) as ei:
        Client(d.url).generate(PROMPT, max_new_tokens=1)
    assert ei.value.status == 401
    (r,) = Client(d.url, api_key="sekrit").generate(PROMPT, max_new_tokens=1)
    assert len(r.output_ids) == 1


def test_weight_version_routes(client):
    assert client.get_weight_version() == "v-start"
    resp = client.update_weight_version("v-next")
    assert resp.get("success", True) is not False
    assert client.get_weight_version() == "v-next"
    (r,) = client.generate(PROMPT, max_new_tokens=2)
    assert r.weight_version == "v-next"
    info = client.get_model_info()
    assert info["weight_version"] == "v-next"


def test_control_routes(client):
    client.flush_cache()
    client.pause("retract")
    client.continue_generation()
    client.abort()  # abort_all with nothing running
    client.abort(rid="nobody")
    (r,) = client.generate(PROMPT, max_new_tokens=2)
    assert len(r.output_ids) == 2
    with pytest.raises(RolloutdError) as ei:
        client.pause("sideways")
    assert ei.value.status == 400


def test_abort_running_request(client):
    out = {}

    def run():
        out["r"] = client.generate(PROMPT, max_new_tokens=4000, ignore_eos=True, rid="long-1")
    t = threading.Thread(target=run)
    t.start()
    import time
    time.sleep(0.5)
    client.abort(rid="long-1")
    t.join(60)
    assert not t.is_alive()
    (r,) = out["r"]
    assert r.finish_reason == "abort" and len(r.output_ids) < 4000
    assert len(r.output_logprobs) == len(r.output_ids)


# ================================================================ TIS / MIS (no daemon)

LP_TRAIN = [-1.0, -0.5, -2.0, -0.1, -3.0]
LP_ROLL = [-1.2, -0.5, -1.0, -1.0, -0.2]


def ratios(a, b):
    return [math.exp(x - y) for x, y in zip(a, b)]


def test_tis_weights_hand_computed():
    # rho = e^0.2, 1, e^-1, e^0.9, e^-2.8 = 1.2214, 1, 0.3679, 2.4596, 0.0608
    want = [min(r, 2.0) for r in ratios(LP_TRAIN, LP_ROLL)]
    assert want[3] == 2.0 and want[1] == 1.0
    got = tis.tis_weights(LP_TRAIN, LP_ROLL, cap=2.0)
    assert got.shape == (5,)
    np.testing.assert_allclose(got, want, rtol=1e-15)
    np.testing.assert_allclose(tis.tis_weights(LP_TRAIN, LP_ROLL, cap=10.0), ratios(LP_TRAIN, LP_ROLL), rtol=1e-15)
    # 2-D with a padding mask: padding gets weight 0
    a = np.array([LP_TRAIN, [-0.3, -0.3, 0, 0, 0]])
    b = np.array([LP_ROLL, [-0.1, -0.7, 0, 0, 0]])
    m = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=bool)
    got = tis.tis_weights(a, b, cap=2.0, mask=m)
    np.testing.assert_allclose(got[1], [math.exp(-0.2), math.exp(0.4), 0, 0, 0], rtol=1e-15)
    # ragged lists come back as lists
    got = tis.tis_weights([LP_TRAIN, [-0.3, -0.3]], [LP_ROLL, [-0.1, -0.7]])
    assert isinstance(got, list) and [len(x) for x in got] == [5, 2]
    np.testing.assert_allclose(got[1], [math.exp(-0.2), math.exp(0.4)], rtol=1e-15)
    # a ragged mask: one row per sequence, as long as it; any other shape is refused, never broadcast
    got = tis.tis_weights([LP_TRAIN, [-0.3, -0.3]], [LP_ROLL, [-0.1, -0.7]], mask=[[1] * 5, [0, 1]])
    np.testing.assert_allclose(got[1], [0, math.exp(0.4)], rtol=1e-15)
    for bad in ([[1] * 5], [[1] * 5, [1]], [[1] * 5, [1, 1, 1]], [[1] * 5, [1, 1], [1]]):
        with pytest.raises(ValueError, match="mask rows"):
            tis.tis_weights([LP_TRAIN, [-0.3, -0.3]], [LP_ROLL, [-0.1, -0.7]], mask=bad)


def test_log_ratio_clamped_at_20():
    got = tis.ratio([0.0, -50.0], [-50.0, 0.0])
    np.testing.assert_allclose(got, [math.exp(20), math.exp(-20)], rtol=1e-15)


def test_mis_hand_computed():
    r = ratios(LP_TRAIN, LP_ROLL)  # 1.2214, 1, 0.3679, 2.4596, 0.0608
    keep = [0.5 <= x <= 2.0 for x in r]
    assert keep == [True, True, False, False, False]
    assert tis.mis_mask(LP_TRAIN, LP_ROLL, 0.5, 2.0).tolist() == keep
    np.testing.assert_allclose(tis.mis_weights(LP_TRAIN, LP_ROLL, 0.5, 2.0), [x if k else 0 for x, k in zip(r, keep)],
                               rtol=1e-15)
    # bounds are inclusive
    assert tis.mis_mask([0.0], [0.0], 1.0, 1.0).tolist() == [True]


def test_sequence_level_hand_computed():
    a = [LP_TRAIN, [-0.3, -0.3]]
    b = [LP_ROLL, [-0.1, -0.7]]
    s0 = sum(x - y for x, y in zip(LP_TRAIN, LP_ROLL))   # 0.2 + 0 - 1 + 0.9 - 2.8 = -2.7
    s1 = (-0.3 + 0.1) + (-0.3 + 0.7)                       # 0.2
    assert abs(s0 + 2.7) < 1e-12 and abs(s1 - 0.2) < 1e-12
    np.testing.assert_allclose(tis.seq_tis_weights(a, b, cap=2.0), [math.exp(s0), math.exp(s1)], rtol=1e-12)
    np.testing.assert_allclose(tis.seq_tis_weights(a, b, cap=1.1), [math.exp(s0), 1.1], rtol=1e-12)
    # 1-D input -> a scalar
    assert abs(float(tis.seq_tis_weights(LP_TRAIN, LP_ROLL)) - math.exp(s0)) < 1e-12
    # Seq-MIS: drop when the product exceeds C (e^0.2 = 1.22 > 1.1)
    assert tis.seq_mis_mask(a, b, cap=1.1).tolist() == [True, False]
    assert tis.seq_mis_mask(a, b, cap=2.0, low=0.1).tolist() == [False, True]  # e^-2.7 = 0.067 < 0.1
    # Geo-RS: geometric mean per token: e^(-2.7/5) = 0.583, e^(0.2/2) = 1.105
    assert tis.geo_rs_mask(a, b, 0.5, 1.2).tolist() == [True, True]
    assert tis.geo_rs_mask(a, b, 0.6, 1.2).tolist() == [False, True]
    assert tis.geo_rs_mask(a, b, 0.5, 1.1).tolist() == [True, False]
    # padded 2-D with a mask gives the same as ragged
    pa = np.array([LP_TRAIN, [-0.3, -0.3, 9, 9, 9]])
    pb = np.array([LP_ROLL, [-0.1, -0.7, -9, -9, -9]])
    m = np.array([[1] * 5, [1, 1, 0, 0, 0]], dtype=bool)
    np.testing.assert_allclose(tis.seq_tis_weights(pa, pb, mask=m), tis.seq_tis_weights(a, b), rtol=1e-15)


def test_mismatch_report_hand_computed():
    d = [x - y for x, y in zip(LP_TRAIN, LP_ROLL)]
    r = [math.exp(x) for x in d]
    rep = tis.mismatch_report(LP_TRAIN, LP_ROLL, cap=2.0, low=0.5, high=2.0)
    assert rep["n_tokens"] == 5
    assert abs(rep["mean_abs_diff"] - sum(abs(x) for x in d) / 5) < 1e-12
    assert abs(rep["max_abs_diff"] - 2.8) < 1e-12
    assert abs(rep["mean_diff"] - sum(d) / 5) < 1e-12
    assert abs(rep["kl_k1"] - (-sum(d) / 5)) < 1e-12
    assert abs(rep["kl_k3"] - sum(x - 1 - math.log(x) for x in r) / 5) < 1e-12
    assert rep["kl_k3"] >= 0
    assert rep["tis_clipped_share"] == 1 / 5
    assert rep["mis_masked_share"] == 3 / 5
    assert tis.mismatch_report([], [])["n_tokens"] == 0


def test_tis_accepts_torch():
    torch = pytest.importorskip("torch")
    got = tis.tis_weights(torch.tensor(LP_TRAIN), torch.tensor(LP_ROLL))
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got, [min(x, 2.0) for x in ratios(LP_TRAIN, LP_ROLL)], rtol=1e-6)


# ================================================================ FP8, codecs, safetensors (no daemon)

def test_fp8_quantizer_matches_fixture_checkpoint():
    """Client-side quantization of qwen3's BF16 weights == qwen3_fp8/ (written by PyTorch's
    float8_e4m3fn cast in make_fixtures.py), codes and scales bit for bit."""
    src = rst.load_float32(MODELS / "qwen3" / "model.safetensors")
    ck = rst.load_file(MODELS / "qwen3_fp8" / "model.safetensors", raw=True)
    names = [k for k in src if fp8.is_fp8_weight(k)]
    assert len(names) == 21 and set(k for k in ck if not k.endswith("_scale_inv")) == set(src)
    for k in names:
        codes, s = fp8.quantize_weight(src[k])
        mv, dt, shape = ck[k]
        assert dt == "float8_e4m3fn" and codes.shape == tuple(shape)
        assert np.array_equal(codes, np.frombuffer(mv, np.uint8).reshape(shape)), k
        smv, sdt, sshape = ck[k + "_scale_inv"]
        assert sdt == "float32" and s.shape == tuple(sshape) == fp8.scale_shape(shape)
        assert np.array_equal(s, np.frombuffer(smv, np.float32).reshape(sshape)), k
    assert not fp8.is_fp8_weight("model.layers.0.mlp.gate.weight")      # MoE router
    assert fp8.is_fp8_weight("model.layers.0.mlp.experts.3.down_proj.weight")
    assert not fp8.is_fp8_weight("model.embed_tokens.weight") and not fp8.is_fp8_weight("lm_head.weight")


def test_fp8_ragged_blocks_and_zero_block():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((130, 300)).astype(np.float32)
    w[:128, 128:256] = 0  # an all-zero block: scale 1e-10/448, codes 0
    codes, s = fp8.quantize_weight(w)
    assert codes.shape == (130, 300) and s.shape == (2, 3)
    assert s[0, 1] == np.float32(np.float32(1e-10) / np.float32(448)) and not codes[:128, 128:256].any()
    blk = w[128:130, 256:300]
    assert s[1, 2] == np.float32(np.abs(blk).max() / np.float32(448))
    back = fp8.dequantize_weight(codes, s)
    assert np.abs(back - w).max() <= np.abs(w).max() * 2 ** -4  # E4M3: 3 mantissa bits


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes not installed")
def test_codecs_match_ml_dtypes():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1 << 18).astype(np.float32) * np.float32(60)
    special = np.array([0, -0.0, 448, 449, 464, -1e9, np.inf, -np.inf, 2 ** -6, 2 ** -7, 2 ** -9, 2 ** -10,
                        3 * 2 ** -10, 1.0625, 1.1875, 240, 232, 2 ** -9 * 7.5, 0.5 * 2 ** -9], np.float32)
    xs = np.concatenate([x, x * 1e-3, x * 1e-5, special])
    want = np.clip(xs, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(rdt.f32_to_e4m3_bits(xs), want)
    assert np.array_equal(rdt._f32_to_e4m3_bits_frexp(xs), want)
    nan = np.array([np.nan, -np.nan], np.float32)
    assert rdt.f32_to_e4m3_bits(nan).tolist() == [0x7F, 0x7F]  # NaN -> 0x7F whatever its sign, as rolloutd
    xb = np.concatenate([xs, np.array([3.3895314e38, -3.4e38, 1e-40], np.float32)])
    assert np.array_equal(rdt.f32_to_bf16_bits(xb), xb.astype(ml_dtypes.bfloat16).view(np.uint16))
    dec = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(rdt.E4M3_DECODE, dec, equal_nan=True)


def test_safetensors_reader():
    p = MODELS / "qwen3" / "model.safetensors"
    hdr, meta, start = rst.read_header(p)
    assert len(hdr) == 35 and meta.get("format") == "pt"
    raw = rst.load_file(p, raw=True)
    assert all(v[1] == "bfloat16" for v in raw.values())
    f32 = rst.load_float32(p)
    e = f32["model.embed_tokens.weight"]
    assert e.shape == (512, 96) and e.dtype == np.float32
    # bf16 -> f32 exactly: the low 16 bits are zero; norms are 1 + 0.1 randn
    assert not (e.view(np.uint32) & 0xFFFF).any()
    assert abs(float(f32["model.norm.weight"].mean()) - 1) < 0.05


# ================================================================ shm transport (stub server)

class _Stub(http.server.BaseHTTPRequestHandler):
    """Records each /update_weights_from_shm body plus the bytes of every tensor, read from the
    segment the way rolloutd does (open by name, check the mode); sleeps `delay_at[n]` seconds
    before answering call n; answers 400 on bucket `fail_at`, to a segment that does not exist (a
    client dropping its update) and, unless `complete` is set (every parameter staged), to a last
    bucket with no tensors, as rolloutd does; answers with `txn_id` as the transaction_id when set."""

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        path = "/dev/shm" + body["shm_name"]
        n = len(srv.calls)
        data = {}
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                seg = f.read()
        except FileNotFoundError:
            st = seg = None
        for t in body["tensors"] if seg is not None else []:
            nb = math.prod(t["shape"]) * rdt.ITEMSIZE[t["dtype"]]
            data[t["name"]] = seg[t["offset"]:t["offset"] + nb]
        srv.calls.append({"body": body, "mode": stat.S_IMODE(st.st_mode) if st else None,
                          "size": st.st_size if st else None, "data": data})
        time.sleep(srv.delay_at.get(n, 0))
        if n == srv.fail_at:
            out, code = {"error": {"message": "stub says no", "type": "invalid_request"}}, 400
        elif seg is None:
            out, code = {"error": {"message": f"shared-memory segment '{body['shm_name']}' does not exist",
                                   "type": "invalid_request", "param": "shm_name"}}, 400
        elif not body["tensors"] and body.get("is_last") and not srv.complete:
            out, code = {"error": {"message": "missing tensor 'x' at is_last; the update is dropped",
                                   "type": "invalid_request"}}, 400
        else:
            out, code = {"success": True, "message": "ok", "weight_version": body["weight_version"],
                         "bytes": sum(len(v) for v in data.values()), "seconds": 0.001}, 200
            if srv.txn_id:
                out["transaction_id"] = srv.txn_id
        raw = json.dumps(out).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        except OSError:  # the client timed out and left
            pass

    def log_message(self, *a):
        pass


@pytest.fixture
def stub():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    srv.calls, srv.fail_at, srv.delay_at, srv.txn_id, srv.complete = [], -1, {}, None, False
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _all_my_segments():
    return {p for p in os.listdir("/dev/shm") if p.startswith(f"rolloutd-w-{os.getpid()}-")}


_SEGMENTS_BEFORE = set()


@pytest.fixture(autouse=True)
def _segments_before():
    """Segments of this process that exist before a test (a Client of an earlier test that was not
    closed keeps its segments until it is collected) are not the test's."""
    global _SEGMENTS_BEFORE
    _SEGMENTS_BEFORE = _all_my_segments()
    yield


def _my_segments():
    """This test's segments of this process, sorted."""
    return sorted(_all_my_segments() - _SEGMENTS_BEFORE)


def _state_dict():
    rng = np.random.default_rng(1)
    sd = {
        "a.f32": rng.standard_normal((40, 50)).astype(np.float32),          # 8000 B
        "b.f16": rng.standard_normal((10, 7)).astype(np.float16),           # 140 B
        "c.raw_bf16": (rdt.f32_to_bf16_bits(rng.standard_normal(300).astype(np.float32)).tobytes(), "bfloat16", [300]),
        "d.big": rng.standard_normal((3000,)).astype(np.float32),           # 12000 B > bucket
        "e.noncontig": rng.standard_normal((20, 30)).astype(np.float32).T,  # 2400 B, transposed view
    }
    if ml_dtypes is not None:
        sd["f.bf16"] = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    return sd


def _expected_bytes(v):
    if isinstance(v, tuple):
        return bytes(v[0])
    return np.ascontiguousarray(v).tobytes()


def test_shm_push_buckets(stub):
    sd = _state_dict()
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    res = c.push_weights(sd, version="7", bucket_bytes=10000, keep_segments=False)
    calls = stub.calls
    assert len(calls) == res.posts >= 3
    assert [x["body"]["is_last"] for x in calls] == [False] * (len(calls) - 1) + [True]
    assert all(x["body"]["weight_version"] == "7" for x in calls)
    assert all(x["mode"] == 0o600 for x in calls), [oct(x["mode"]) for x in calls]
    sent = {}
    for x in calls:
        for t in x["body"]["tensors"]:
            assert t["offset"] % rshm.ALIGN == 0
            sent[t["name"]] = (t, x["data"][t["name"]], x["size"], len(x["body"]["tensors"]))
    assert list(sent) == list(sd)  # every tensor once, in order
    for name, v in sd.items():
        t, data, size, n_in_bucket = sent[name]
        assert data == _expected_bytes(v), name
        shape = list(v[2]) if isinstance(v, tuple) else list(v.shape)
        assert t["shape"] == shape
    assert sent["a.f32"][0]["dtype"] == "float32" and sent["b.f16"][0]["dtype"] == "float16"
    assert sent["c.raw_bf16"][0]["dtype"] == "bfloat16"
    # the oversized tensor went alone, in a segment of its own size
    assert sent["d.big"][3] == 1 and sent["d.big"][2] >= 12000 and sent["d.big"][0]["offset"] == 0
    # bucket segments: sized to the fullest bucket, never over bucket_bytes
    assert all(x["size"] <= 10000 for x in calls if x["body"]["tensors"][0]["name"] != "d.big")
    assert len({x["body"]["shm_name"] for x in calls}) == 3  # two bucket segments + the big one
    assert res.bytes == sum(len(_expected_bytes(v)) for v in sd.values())
    assert res.response["weight_version"] == "7" and res.weight_version == "7"
    assert res.seconds > 0 and res.gb_per_s > 0
    assert _my_segments() == []


def test_shm_keep_segments(stub):
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    sd = _state_dict()
    c.push_weights(sd, version="1", bucket_bytes=10000, keep_segments=True)
    first = {x["body"]["shm_name"] for x in stub.calls}
    kept = _my_segments()
    # two bucket segments and the big tensor's, all kept
    assert len(kept) == 3 and all("/" + k in first for k in kept) and len(first) == 3
    assert all(stat.S_IMODE(os.stat("/dev/shm/" + k).st_mode) == 0o600 for k in kept)
    big = {x["body"]["shm_name"] for x in stub.calls if x["body"]["tensors"][0]["name"] == "d.big"}
    assert len(big) == 1 and os.stat("/dev/shm" + next(iter(big))).st_size >= 12000
    n = len(stub.calls)
    c.push_weights(sd, version="2", bucket_bytes=10000, keep_segments=True)
    assert _my_segments() == kept  # reused
    assert {x["body"]["shm_name"] for x in stub.calls[n:]} == first
    stub.fail_at = len(stub.calls)
    with pytest.raises(RolloutdError):
        c.push_weights(sd, version="3", bucket_bytes=10000, keep_segments=True)
    assert _my_segments() == []  # an error unlinks the kept ones too
    c.push_weights(sd, version="4", bucket_bytes=10000, keep_segments=True)
    assert len(_my_segments()) == 3
    c.close()
    assert _my_segments() == []


def test_shm_keep_segments_two_big_tensors_in_a_row(stub):
    """Two tensors larger than a bucket, back to back, share the kept big segment: the second is
    packed only after the server has answered for the first (else the server would read the
    second's bytes under the first's name)."""
    rng = np.random.default_rng(2)
    sd = {"big1": rng.standard_normal(3000).astype(np.float32), "big2": rng.standard_normal(3500).astype(np.float32),
          "small": rng.standard_normal(100).astype(np.float32), "big3": rng.standard_normal(2900).astype(np.float32)}
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    for version in ("1", "2"):
        n = len(stub.calls)
        c.push_weights(sd, version=version, bucket_bytes=10000, keep_segments=True)
        got = {t["name"]: x["data"][t["name"]] for x in stub.calls[n:] for t in x["body"]["tensors"]}
        assert got == {k: v.tobytes() for k, v in sd.items()}
        big = {x["body"]["shm_name"] for x in stub.calls[n:] if x["body"]["tensors"][0]["name"].startswith("big")}
        assert len(big) == 1  # one kept segment, sized for the largest
    c.close()
    assert _my_segments() == []


def test_shm_push_error_unlinks_and_raises(stub):
    stub.fail_at = 1
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    with pytest.raises(RolloutdError) as ei:
        c.push_weights(_state_dict(), version="8", bucket_bytes=10000)
    assert ei.value.status == 400 and "stub says no" in ei.value.message
    assert len(stub.calls) == 2  # nothing is sent after a refused bucket
    assert _my_segments() == []


def test_shm_push_packing_error_unlinks(stub):
    sd = dict(_state_dict())
    sd["zz.bad"] = np.zeros(3, dtype=np.float64)
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    with pytest.raises(TypeError, match="zz.bad"):
        c.push_weights(sd, version="9", bucket_bytes=10000)
    assert stub.calls == [] and _my_segments() == []  # checked before anything is sent


def test_shm_push_fp8(stub):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((200, 96)).astype(np.float32)
    sd = {"model.layers.0.self_attn.q_proj.weight": q,
          "model.layers.0.input_layernorm.weight": np.ones(96, np.float32),
          "model.embed_tokens.weight": rng.standard_normal((64, 96)).astype(np.float32)}
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    res = c.push_weights(sd, version="10", fp8=True, bucket_bytes=20000)
    metas = {t["name"]: t for x in stub.calls for t in x["body"]["tensors"]}
    data = {k: v for x in stub.calls for k, v in x["data"].items()}
    assert list(metas) == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
                           "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"]
    assert metas["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "float8_e4m3fn"
    assert metas["model.layers.0.self_attn.q_proj.weight_scale_inv"] == dict(
        metas["model.layers.0.self_attn.q_proj.weight_scale_inv"], dtype="float32", shape=[2, 1])
    codes, s = fp8.quantize_weight(q)
    assert data["model.layers.0.self_attn.q_proj.weight"] == codes.tobytes()
    assert data["model.layers.0.self_attn.q_proj.weight_scale_inv"] == s.tobytes()
    assert metas["model.embed_tokens.weight"]["dtype"] == "float32"  # not quantized
    assert res.bytes == 200 * 96 + 2 * 4 + 96 * 4 + 64 * 96 * 4


def test_shm_push_torch(stub):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    sd = {"w.bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
          "w.f32t": torch.randn(8, 12, generator=g).t(),  # non-contiguous
          "w.f16": torch.randn(5, generator=g).to(torch.float16)}
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    c.push_weights(sd, version="11", bucket_bytes=4096)
    data = {k: v for x in stub.calls for k, v in x["data"].items()}
    metas = {t["name"]: t for x in stub.calls for t in x["body"]["tensors"]}
    assert metas["w.bf16"]["dtype"] == "bfloat16" and metas["w.f32t"]["shape"] == [12, 8]
    assert data["w.bf16"] == sd["w.bf16"].view(torch.int16).numpy().tobytes()
    assert data["w.f32t"] == sd["w.f32t"].contiguous().numpy().tobytes()
    assert data["w.f16"] == sd["w.f16"].numpy().tobytes()


def test_plan_buckets_never_reorders():
    ents = rtensors.entries({f"t{i}": np.zeros(n, np.float32)
                             for i, n in enumerate([10, 300, 5, 2000, 1, 400])})
    plan = rshm.plan_buckets(ents, 2048)
    names = [e.name for b in plan for e, _ in b[0]]
    assert names == [f"t{i}" for i in range(6)]
    for items, size, own in plan:
        assert own or size <= 2048
        assert all(off % rshm.ALIGN == 0 for _, off in items)
    assert [own for _, _, own in plan].count(True) == 1  # 8000 B > 2048


def test_unsupported_values_rejected():
    with pytest.raises(TypeError, match="x"):
        rtensors.entries({"x": np.zeros(3, np.int32)})
    with pytest.raises(ValueError, match="y"):
        rtensors.entries({"y": (b"\0" * 5, "bfloat16", [3])})
    with pytest.raises(TypeError, match="z"):
        rtensors.entries({"z": (b"\0" * 4, "float64", [1])})


def test_fp8_torch_matches_numpy(stub):
    """Torch tensors are quantized with torch on their own device; same codes and scales."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 200, generator=g) * 0.05).to(torch.bfloat16)
    w[:128, :128] = 0
    codes_t, s_t = fp8.quantize_weight_torch(w)
    codes, s = fp8.quantize_weight(w.float().numpy())
    assert np.array_equal(codes_t.view(torch.uint8).numpy(), codes) and np.array_equal(s_t.numpy(), s)
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    c.push_weights({"model.layers.0.mlp.down_proj.weight": w}, version="t", fp8=True, bucket_bytes=50000)
    data = {k: v for x in stub.calls for k, v in x["data"].items()}
    assert data["model.layers.0.mlp.down_proj.weight"] == codes.tobytes()
    assert data["model.layers.0.mlp.down_proj.weight_scale_inv"] == s.tobytes()
