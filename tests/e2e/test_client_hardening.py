"""The Python client (clients/python) where a trainer's process meets the unusual: a /dev/shm too
small for a bucket, a push that fails half way, big-endian arrays, a fork, non-finite weights, numpy
values in requests, an error crossing a process boundary, extreme log-ratios.

  - a full /dev/shm is an OSError (ENOSPC) naming /dev/shm, and nothing is left there, never a SIGBUS
    (for real in a private mount namespace with a 3 MiB tmpfs where unshare works; everywhere with
    posix_fallocate made to fail);
  - a push that fails after some buckets were accepted (packing raises, Ctrl-C, a POST timeout) ends
    the daemon's transaction: the next version is accepted at once, not refused with 409 until
    weight-update-timeout; a bucket the server refused is not followed by anything; ending it never
    commits, also when every parameter was staged (a tied lm_head that fails to pack last);
  - big-endian float32 / float16 arrays and raw ">u2" bfloat16 bits serve what their little-endian
    twins serve (prompt logprobs compared exactly);
  - a forked child that exits leaves its parent's segments alone; a Ctrl-C inside Segment() leaks none;
  - FP8 quantization of NaN / inf against a reference written here from the rules of the daemon's
    kernels/fp8.c (amax ignores NaN, NaN encodes as 0x7F) and ml_dtypes' E4M3 cast;
  - generate / score take numpy arrays, ragged lists of arrays and numpy scalars;
  - RolloutdError survives pickle; mismatch_report's delta statistics are not clamped; geo_rs_mask
    does not overflow.
"""
import errno
import gc
import math
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "clients" / "python"
sys.path.insert(0, str(CLIENT_DIR))

from rolloutd_client import Client, RolloutdError, fp8, tis  # noqa: E402
from rolloutd_client import dtypes as rdt  # noqa: E402
from rolloutd_client import shm as rshm  # noqa: E402
from rolloutd_client import tensors as rtensors  # noqa: E402
from rolloutd_client.safetensors import load_file  # noqa: E402

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

ORIG = ROOT / "tests" / "fixtures" / "models" / "qwen3"
BF16_ARGS = ["--quantization", "bf16", "--kv-cache-dtype", "f32"]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [11, 22, 33, 44, 55, 66]]


def _mine():
    return {p for p in os.listdir("/dev/shm") if p.startswith(f"rolloutd-w-{os.getpid()}-")}


@pytest.fixture
def segments():
    """Asserts the test leaves no segment of this process behind (others' are not looked at)."""
    before = _mine()
    yield
    gc.collect()
    assert _mine() - before == set()


def weights_f32():
    """The fixture model's bf16 weights as float32 (exact)."""
    raw = load_file(ORIG / "model.safetensors", raw=True)
    return {k: rdt.as_float32(np.frombuffer(v[0], np.uint16).reshape(v[2]), "bfloat16") for k, v in raw.items()}


def prompt_lps(c):
    return [lp[1:].tolist() for lp in c.score(PROMPTS)]


# the stub server of test_client.py: each call is {"body", "mode", "size", "data"}
from test_client import stub  # noqa: E402,F401 -- a pytest fixture


def _small_sd(n=6, elems=1000):
    rng = np.random.default_rng(0)
    return {f"t{i}": rng.standard_normal(elems).astype(np.float32) for i in range(n)}


# ================================================================ H1: /dev/shm too small

def test_shm_full_raises_enospc_and_cleans_up(stub, segments, monkeypatch):
    """posix_fallocate refusing the second segment: OSError ENOSPC naming /dev/shm, the first
    segment unlinked, nothing POSTed; both with and without kept segments."""
    real = os.posix_fallocate
    calls = []

    def fallocate(fd, off, size):
        calls.append(size)
        if len(calls) % 2 == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, off, size)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    before = _mine()
    for keep in (False, True):
        with pytest.raises(OSError) as ei:
            c.push_weights(_small_sd(), version="v", bucket_bytes=8192, keep_segments=keep)
        assert ei.value.errno == errno.ENOSPC, ei.value
        assert "/dev/shm" in str(ei.value) and "No space left on device" in str(ei.value)
        assert stub.calls == []
        assert _mine() - before == set()  # unlinked by the push itself, not by garbage collection
    assert len(calls) == 4

    def cannot(fd, off, size):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    # a filesystem that cannot reserve pushes as before
    monkeypatch.setattr(os, "posix_fallocate", cannot)
    res = c.push_weights(_small_sd(), version="w", bucket_bytes=8192, keep_segments=False)
    assert res.weight_version == "w" and len(stub.calls) == res.posts
    c.close()


_SMALL_SHM_SCRIPT = textwrap.dedent("""
    import os, sys
    print("READY", sorted(os.listdir("/dev/shm")), flush=True)
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    from rolloutd_client import Client
    sd = {f"w{i}": np.ones(1 << 18, np.float32) for i in range(6)}  # 6 x 1 MiB
    c = Client("http://127.0.0.1:9", timeout=5)
    try:  # two 2 MiB bucket segments into a 3 MiB /dev/shm
        c.push_weights(sd, version="x", bucket_bytes=2 << 20, keep_segments=sys.argv[2] == "keep")
        print("PUSHED", flush=True)
    except OSError as e:
        print("OSERROR", e.errno, e, flush=True)
    print("LEFT", sorted(os.listdir("/dev/shm")), flush=True)
""")


@pytest.mark.parametrize("mode", ["fresh", "keep"])
def test_small_dev_shm_for_real(mode):
    """A 3 MiB tmpfs on /dev/shm in a private mount namespace (needs root / unshare): the push ends
    in OSError ENOSPC and an empty /dev/shm, where it used to die of SIGBUS (exit 135)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=3m tmpfs /dev/shm && exec "$0" -c "$1" "$2" "$3"',
           sys.executable, _SMALL_SHM_SCRIPT, str(CLIENT_DIR), mode]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if "READY" not in p.stdout:
        pytest.skip(f"cannot mount a private tmpfs on /dev/shm here: {p.stderr.strip()[:200]}")
    assert p.returncode == 0, f"exit {p.returncode} (SIGBUS is -7 / 135):\n{p.stdout}\n{p.stderr}"
    assert f"OSERROR {errno.ENOSPC} " in p.stdout and "/dev/shm" in p.stdout, p.stdout
    assert "LEFT []" in p.stdout, p.stdout


# ================================================================ M1: a failed push ends the update

def _raise_at(monkeypatch, name, exc):
    real = rtensors.Entry.write_into

    def write_into(self, buf):
        if self.name == name:
            raise exc
        return real(self, buf)
    monkeypatch.setattr(rtensors.Entry, "write_into", write_into)


@pytest.mark.parametrize("exc", [RuntimeError("packing failed"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_failed_push_does_not_block_the_next(rolloutd, monkeypatch, segments, exc):
    """Packing raises after several buckets were staged (the daemon keeps the default
    weight-update-timeout, 300 s): the next push is accepted at once, with a new version (it was
    409) or again with the failed one (it was 400 "duplicate tensor"), and the weights never
    changed."""
    d = rolloutd(ORIG, *BF16_ARGS)
    c = Client(d.url, timeout=120)
    v0, lp0 = c.get_weight_version(), prompt_lps(c)
    sd = weights_f32()
    names = list(sd)
    for failed, retry in (("w1", "w2"), ("w3", "w3")):
        _raise_at(monkeypatch, names[len(names) // 2], exc)
        with pytest.raises(type(exc)):
            c.push_weights(sd, version=failed, bucket_bytes=64 << 10)
        monkeypatch.undo()
        assert c.get_weight_version() == v0
        res = c.push_weights(sd, version=retry, bucket_bytes=64 << 10)
        assert res.weight_version == retry
        v0 = retry
        assert prompt_lps(c) == lp0  # the same weights all along
    c.close()


def _is_drop(body, version, txn_id=None):
    """The bucket that drops an update without committing it (shm.abort_update): is_last false, no
    tensors, a segment nobody made, the transaction's id when it was known."""
    return (body["tensors"] == [] and body["is_last"] is False and body["weight_version"] == version
            and "-drop-" in body["shm_name"] and not os.path.exists("/dev/shm" + body["shm_name"])
            and body.get("transaction_id") == txn_id)


def test_post_timeout_ends_the_update(stub, segments):
    """A POST that times out on the client side: once it has returned, the client sends the drop
    bucket (no tensors, is_last false, the same version and transaction, a segment that does not
    exist)."""
    stub.delay_at = {1: 1.5}
    stub.txn_id = "00000000000000aa"
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    with pytest.raises(requests.Timeout):
        c.push_weights(_small_sd(), version="t1", bucket_bytes=8192, timeout=0.5)
    bodies = [x["body"] for x in stub.calls]
    assert len(bodies) == 3, [b["tensors"] for b in bodies]
    assert _is_drop(bodies[-1], "t1", "00000000000000aa"), bodies[-1]
    assert bodies[1].get("transaction_id") == "00000000000000aa"
    c.close()


def test_failed_push_of_a_complete_set_commits_nothing(rolloutd, monkeypatch, segments):
    """Every parameter staged, then packing the last tensor (a tied lm_head.weight, which the
    commit does not need) fails: the update must be dropped, not committed. (Ending it with a last
    bucket without tensors, as the client once did, commits the staged set.)"""
    d = rolloutd(ORIG, *BF16_ARGS)
    c = Client(d.url, timeout=120)
    v0, lp0 = c.get_weight_version(), prompt_lps(c)
    sd = {k: v * np.float32(1.5) for k, v in weights_f32().items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied: validated, then ignored
    _raise_at(monkeypatch, "lm_head.weight", RuntimeError("packing the tied lm_head failed"))
    with pytest.raises(RuntimeError, match="tied lm_head"):
        c.push_weights(sd, version="w-torn", bucket_bytes=64 << 10)
    monkeypatch.undo()
    assert c.get_weight_version() == v0 and prompt_lps(c) == lp0
    c.close()


def test_no_drop_when_nothing_was_sent_or_all_committed(stub, segments, monkeypatch):
    c = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    _raise_at(monkeypatch, "t0", RuntimeError("first tensor"))
    with pytest.raises(RuntimeError):
        c.push_weights(_small_sd(), version="a", bucket_bytes=8192)
    assert stub.calls == []
    monkeypatch.undo()
    res = c.push_weights(_small_sd(), version="b", bucket_bytes=8192)
    assert len(stub.calls) == res.posts and all(x["body"]["tensors"] for x in stub.calls)
    c.close()


def test_nccl_failure_ends_the_update_on_engines_that_did_not_refuse(stub):
    """nccl.push_weights_nccl's clean-up (no torch or GPU needed for it): of two engines, the one
    that refused the bucket in flight (400) gets nothing more, the other the drop bucket over the
    shm route (an /update_weights_from_distributed without names would abort the group)."""
    import concurrent.futures as cf
    from rolloutd_client import nccl
    a = Client(f"http://127.0.0.1:{stub.server_address[1]}")
    b = Client(f"http://127.0.0.1:{stub.server_address[1]}/")
    ok, refused = cf.Future(), cf.Future()
    ok.set_result({"success": True})
    refused.set_exception(RolloutdError(400, {"error": {"message": "bad shape"}}, "/update_weights_from_distributed"))
    nccl._abort_open_updates([a, b], "n1", [ok, refused], 10, ["00000000000000bb", None])
    assert len(stub.calls) == 1
    assert _is_drop(stub.calls[0]["body"], "n1", "00000000000000bb"), stub.calls[0]["body"]


# ================================================================ M2: big-endian arrays

def test_big_endian_arrays_serve_the_same_model(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    c = Client(d.url, timeout=120)
    lp0 = prompt_lps(c)
    sd = weights_f32()
    c.push_weights({k: v.astype(">f4") for k, v in sd.items()}, version="be32")
    assert prompt_lps(c) == lp0
    raw = load_file(ORIG / "model.safetensors", raw=True)
    be_bits = {k: (np.frombuffer(v[0], "<u2").astype(">u2"), "bfloat16", v[2]) for k, v in raw.items()}
    c.push_weights(be_bits, version="be-bf16-bits")
    assert prompt_lps(c) == lp0
    c.push_weights({k: v.astype("<f2") for k, v in sd.items()}, version="le16")
    lp16 = prompt_lps(c)
    c.push_weights({k: v.astype(">f2") for k, v in sd.items()}, version="be16")
    assert prompt_lps(c) == lp16
    c.close()


# ================================================================ L1, L7: segment lifetime

_FORK_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from rolloutd_client import shm
    s = shm.Segment(4096)
    path = "/dev/shm" + s.name
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a helper that exits normally: atexit handlers and finalizers run
    os.waitpid(pid, 0)
    print("EXISTS", os.path.exists(path), flush=True)
    s.close()
    print("CLOSED", os.path.exists(path), flush=True)
""")


def test_forked_child_exit_keeps_parent_segments():
    p = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, str(CLIENT_DIR)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "EXISTS True" in p.stdout and "CLOSED False" in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def test_ctrl_c_in_segment_registration_leaks_nothing(monkeypatch, segments):
    from multiprocessing import resource_tracker

    def register(name, rtype):
        raise KeyboardInterrupt

    monkeypatch.setattr(resource_tracker, "register", register)
    before = _mine()
    with pytest.raises(KeyboardInterrupt) as ei:
        rshm.Segment(4096)
    del ei
    gc.collect()
    assert _mine() - before == set()


# ================================================================ L2: FP8 of non-finite weights

def _ref_e4m3(x):
    """E4M3FN code of float32 x as rolloutd's rs_fp8_e4m3_from_f32: NaN -> 0x7F (either sign),
    else ml_dtypes' round-to-nearest-even cast of x saturated to +-448."""
    if math.isnan(x):
        return 0x7F
    y = np.float32(min(max(x, -448.0), 448.0))
    return int(np.array([y], np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0])


def _ref_quantize(w):
    """kernels/fp8.c rs_fp8_quantize_weight_ref, element by element: amax over |w| with NaN ignored
    (starting at 0), scale = max(amax, 1e-10) / 448 in fp32, code = e4m3(w / scale)."""
    rows, cols = w.shape
    nbo, nbi = -(-rows // 128), -(-cols // 128)
    codes = np.zeros((rows, cols), np.uint8)
    scale = np.zeros((nbo, nbi), np.float32)
    for bo in range(nbo):
        for bi in range(nbi):
            blk = w[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128]
            amax = np.float32(0)
            for v in blk.ravel():
                a = np.float32(abs(v))
                if a > amax:  # False for NaN
                    amax = a
            s = np.float32(np.float32(max(amax, np.float32(1e-10))) / np.float32(448))
            scale[bo, bi] = s
            with np.errstate(invalid="ignore"):
                q = (blk / s).astype(np.float32)
            codes[bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128] = \
                np.vectorize(_ref_e4m3, otypes=[np.uint8])(q)
    return codes, scale


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes not installed")
def test_fp8_non_finite_matches_daemon_rules():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    neg_nan = np.array([0xFFC00000], np.uint32).view(np.float32)[0]
    w[3, 5] = np.nan                      # block (0, 0): NaN among finite values
    w[10, 140] = neg_nan                  # block (0, 1): a negative NaN
    w[130, 10] = np.inf                   # block (1, 0): inf -> scale inf, the rest 0, inf/inf NaN
    w[131, 11] = -np.inf
    w[0:128, 256:300] = np.nan            # block (0, 2): nothing but NaN -> the amax floor
    w[140, 150] = np.nan
    w[141, 151] = np.inf                  # block (1, 1): both
    codes, scale = fp8.quantize_weight(w)
    want_codes, want_scale = _ref_quantize(w)
    assert np.array_equal(scale.view(np.uint32), want_scale.view(np.uint32)), (scale, want_scale)
    assert np.array_equal(codes, want_codes), np.argwhere(codes != want_codes)[:10]
    # the rules themselves, spelled out
    assert np.isfinite(scale[0, 0]) and scale[0, 0] == np.float32(np.nanmax(np.abs(w[:128, :128]))) / np.float32(448)
    assert codes[3, 5] == codes[10, 140] == 0x7F
    assert scale[0, 2] == np.float32(1e-10) / np.float32(448) and (codes[:128, 256:] == 0x7F).all()
    assert scale[1, 0] == np.inf and codes[130, 10] == codes[131, 11] == 0x7F
    assert set(np.unique(codes[128:, :128])) <= {0x00, 0x80, 0x7F}
    # the codec: every NaN is 0x7F, infinities saturate
    x = np.array([np.nan, -np.nan, neg_nan, np.inf, -np.inf], np.float32)
    assert rdt.f32_to_e4m3_bits(x).tolist() == [0x7F, 0x7F, 0x7F, 0x7E, 0xFE]
    assert rdt._f32_to_e4m3_bits_frexp(x).tolist() == [0x7F, 0x7F, 0x7F, 0x7E, 0xFE]


def test_fp8_push_with_a_nan_weight_is_refused(rolloutd):
    """One NaN in a pushed matrix is refused, naming the matrix and the element, whether the daemon
    quantizes it (a float push) or the client did (fp8=True: the client's scales stay finite, the
    NaN becomes an E4M3 NaN code, which the daemon refuses as such; not as a bad scale_inv)."""
    d = rolloutd(ORIG, "--quantization", "fp8", "--kv-cache-dtype", "f32")
    c = Client(d.url, timeout=120)
    sd = weights_f32()
    name = next(k for k in sd if fp8.is_fp8_weight(k))
    sd[name] = sd[name].copy()
    sd[name][0, 0] = np.nan
    for client_fp8 in (True, False):
        with pytest.raises(RolloutdError) as ei:
            c.push_weights(sd, version="nan-fp8", fp8=client_fp8)
        assert ei.value.status == 400 and ei.value.param == name, (client_fp8, ei.value.param, ei.value.message)
        assert "holds NaN at [0][0]" in ei.value.message, ei.value.message
    assert c.get_weight_version() != "nan-fp8"
    c.close()


# ================================================================ L3: numpy values in requests

def test_generate_and_score_take_numpy(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    c = Client(d.url, timeout=120)
    kw = dict(max_new_tokens=4, temperature=1.0, sampling_seed=5, ignore_eos=True)
    want = [r.output_ids.tolist() for r in c.generate(PROMPTS, **kw)]
    for ids in ([np.array(p) for p in PROMPTS],                       # ragged batch of arrays
                [[np.int64(t) for t in p] for p in PROMPTS],           # lists of numpy scalars
                tuple(np.array(p, np.int32) for p in PROMPTS)):
        got = c.generate(ids, max_new_tokens=np.int64(4), temperature=np.float32(1.0),
                         sampling_seed=np.int64(5), ignore_eos=np.bool_(True))
        assert [r.output_ids.tolist() for r in got] == want
    (one,) = c.generate(np.array(PROMPTS[0]), **kw)
    assert one.output_ids.tolist() == want[0]
    stop = want[0][1]
    (s,) = c.generate(PROMPTS[0], stop_token_ids=np.array([stop]), **dict(kw, ignore_eos=False))  # SGLang's
    # ignore_eos turns stop_token_ids off too
    assert s.output_ids.tolist() == want[0][:want[0].index(stop) + 1] and s.finish_reason == "stop"
    lp = [x[1:].tolist() for x in c.score(PROMPTS)]
    assert [x[1:].tolist() for x in c.score([np.array(p) for p in PROMPTS])] == lp
    assert [x[1:].tolist() for x in c.score(np.array(PROMPTS[0]))] == lp[:1]
    square = np.array([PROMPTS[0][:6], PROMPTS[1][:6]])
    assert len(c.score(square)) == 2
    with pytest.raises(TypeError, match="input_ids"):
        c.generate([1.5, 2.0], max_new_tokens=1)
    c.close()


# ================================================================ L4: RolloutdError and pickle

def test_rolloutd_error_pickles():
    e = RolloutdError(409, {"error": {"message": "in progress", "type": "conflict", "param": "weight_version"}},
                      "/update_weights_from_shm")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is RolloutdError and str(e2) == str(e)
    assert (e2.status, e2.message, e2.type, e2.param, e2.path, e2.body) == \
        (409, "in progress", "conflict", "weight_version", "/update_weights_from_shm", e.body)
    e3 = pickle.loads(pickle.dumps(RolloutdError(502, "bad gateway", "/generate")))
    assert e3.status == 502 and e3.message == "bad gateway"


# ================================================================ L5, L6: TIS helpers

def test_mismatch_report_delta_statistics_are_not_clamped():
    rep = tis.mismatch_report([-1.0, 100.0], [-1.0, 0.0], cap=2.0)
    assert rep["max_abs_diff"] == 100.0 and rep["mean_abs_diff"] == 50.0
    assert rep["mean_diff"] == 50.0 and rep["kl_k1"] == -50.0
    # rho, as the weights use it, is still exp(clamp(delta, +-20))
    assert rep["ratio_max"] == math.exp(20) and rep["ratio_mean"] == (1 + math.exp(20)) / 2
    assert rep["kl_k3"] == pytest.approx((math.exp(20) - 1 - 20) / 2, rel=1e-12) and rep["kl_k3"] >= 0
    assert rep["tis_clipped_share"] == 0.5


def test_geo_rs_mask_does_not_overflow():
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        assert not tis.geo_rs_mask([1000.0], [0.0], 0.9, 1.1)
        assert not tis.geo_rs_mask([-1000.0], [0.0], 0.9, 1.1)
        assert tis.geo_rs_mask([[1000.0, -1.0], [-0.5, -0.5]], [[0.0, -1.0], [-0.5, -0.5]], 0.9, 1.1).tolist() == \
            [False, True]
