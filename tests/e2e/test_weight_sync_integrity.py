"""Weight updates that must never commit something other than what the trainer meant, end to end:

  - a bucket joins the open update only when it names it (transaction_id from the first bucket's
    answer, and the same weight_version): bucket 1 of version B without is_last and a version-less
    bucket 2 is a 409 that stages nothing, and B still commits from its own bucket; the Python
    client ties its buckets with the id, so multi-bucket pushes work as before;
  - a NaN or an infinity in any tensor (an FP8-quantized projection, a norm, the BF16 embedding,
    client-side FP8 codes; bf16, fp8 dynamic-KV and fp8 calibrating daemons; shm and disk) is a 400
    naming the tensor and the first bad element, and the old weights keep serving; a checkpoint
    holding one does not start;
  - the client's per-tensor CRC-32C (on by default) makes a segment that changed between the
    client's write and the daemon's read a 400 naming the tensor instead of a commit: bytes
    overwritten (pwrite), and a shrink-then-regrow (ftruncate) that leaves zeros; both made
    deterministic by changing the segment after the checksum and before the POST.
"""
import json
import os
import shutil
import struct
import subprocess

import crc32c
import numpy as np
import pytest

from conftest import BIN
from test_golden import BF16_ARGS, FP8_ARGS
# (test_weight_sync puts clients/python on sys.path)
from test_weight_sync import ORIG, PERT, _write_all, check_bf16_golden, golden, prompt_lps, score_all, weights
from rolloutd_client import Client, RolloutdError  # noqa: E402
from rolloutd_client.shm import ALIGN, Segment  # noqa: E402

pytestmark = pytest.mark.skipif(not (PERT / "golden.json").is_file(), reason="no qwen3/perturbed fixture")


def _segment(sd):
    return Segment(sum((len(v[0]) + ALIGN - 1) // ALIGN * ALIGN for v in sd.values()))


def _bucket(d, seg, metas, **fields):
    return d.post("/update_weights_from_shm", dict({"shm_name": seg.name, "tensors": metas}, **fields))


# ================================================================ transactions

def test_versionless_bucket_cannot_complete_another_update(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    prompts = golden(ORIG, "golden.json")["prompts"]
    before = prompt_lps(score_all(d, prompts))
    pert = weights(PERT)
    seg = _segment(pert)
    try:
        metas = _write_all(pert, seg)
        half = len(metas) // 2
        r = _bucket(d, seg, metas[:half], weight_version="B")      # no is_last: commits when complete
        assert r.status_code == 200 and r.json()["committed"] is False, r.text
        txn = r.json()["transaction_id"]
        # another writer's bucket, without a version, that would complete the set
        r = _bucket(d, seg, metas[half:])
        assert r.status_code == 409, r.text
        assert r.json()["error"]["param"] == "weight_version" and "'B'" in r.json()["error"]["message"], r.text
        # ... or for another version, or naming another transaction
        r = _bucket(d, seg, metas[half:], weight_version="C")
        assert r.status_code == 409, r.text
        r = _bucket(d, seg, metas[half:], weight_version="B", transaction_id="not-" + txn)
        assert r.status_code == 409 and r.json()["error"]["param"] == "transaction_id", r.text
        assert prompt_lps(score_all(d, prompts)) == before
        assert d.get("/get_weight_version").json()["weight_version"] == "0"
        # B's own bucket 2 still completes B, which was never touched
        r = _bucket(d, seg, metas[half:], weight_version="B", transaction_id=txn)
        assert r.status_code == 200 and r.json()["committed"] is True and r.json()["transaction_id"] == txn, r.text
        assert d.get("/get_weight_version").json()["weight_version"] == "B"
        check_bf16_golden(d, golden(PERT, "golden.json"), "qwen3/perturbed, B committed whole")
        # the committed transaction's id opens nothing
        r = _bucket(d, seg, metas[:half], weight_version="D", transaction_id=txn)
        assert r.status_code == 409 and "is not open" in r.json()["error"]["message"], r.text
    finally:
        seg.close()


def test_client_pushes_tie_their_buckets(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    c = Client(d.url)
    seen = []
    post = c.update_weights_from_shm_body

    def spy(body, timeout=None):
        seen.append(dict(body))
        return post(body, timeout)

    c.update_weights_from_shm_body = spy
    res = c.push_weights(weights(PERT), version="tied", bucket_bytes=32 << 10)
    assert res.posts >= 5 and res.response["committed"] is True
    ids = {b.get("transaction_id") for b in seen[1:]}
    assert "transaction_id" not in seen[0] and len(ids) == 1 and None not in ids, [b.get("transaction_id") for b in seen]
    assert res.response["transaction_id"] in ids
    check_bf16_golden(d, golden(PERT, "golden.json"), "qwen3/perturbed pushed in tied buckets")
    # back, without is_last and without versions (an SGLang-style trainer): still one update
    seg = _segment(weights(ORIG))
    try:
        r = _bucket(d, seg, _write_all(weights(ORIG), seg))
        assert r.status_code == 200 and r.json()["committed"] is True, r.text
    finally:
        seg.close()
    check_bf16_golden(d, golden(ORIG, "golden.json"), "qwen3 pushed back without versions")
    c.close()


# ================================================================ non-finite weights

BF16_NAN, BF16_INF, BF16_NINF = 0x7fc0, 0x7f80, 0xff80
DAEMONS = {"bf16": BF16_ARGS, "fp8-dynamic": FP8_ARGS + ["--kv-cache-dtype", "fp8", "--kv-scale-mode", "dynamic"],
           "fp8-calibrate": FP8_ARGS + ["--kv-cache-dtype", "fp8", "--kv-scale-mode", "calibrate"]}
POISON = [("model.layers.1.mlp.down_proj.weight", BF16_NAN), ("model.norm.weight", BF16_INF),
          ("model.embed_tokens.weight", BF16_NINF), ("model.layers.0.self_attn.q_proj.weight", BF16_INF)]


def poisoned(sd, name, bits, elem):
    """sd with tensor `name`'s element `elem` (a BF16 tensor) set to the BF16 bits `bits`."""
    mv, dt, shape = sd[name]
    a = np.frombuffer(mv, np.uint16).copy()
    a[elem] = bits
    out = dict(sd)
    out[name] = (memoryview(a.tobytes()), dt, shape)
    return out


def at(shape, elem):
    return f"[{elem // shape[1]}][{elem % shape[1]}]" if len(shape) == 2 else f"[{elem}]"


@pytest.mark.parametrize("mode", list(DAEMONS))
def test_nonfinite_push_refused(rolloutd, mode):
    d = rolloutd(ORIG, *DAEMONS[mode])
    c = Client(d.url)
    prompts = golden(ORIG, "golden.json")["prompts"][:2]
    before = prompt_lps(score_all(d, prompts))
    pert = weights(PERT)
    what = {BF16_NAN: "NaN", BF16_INF: "+inf", BF16_NINF: "-inf"}
    for name, bits in POISON:
        shape = pert[name][2]
        elem = int(np.prod(shape)) - 7
        with pytest.raises(RolloutdError) as ei:
            c.push_weights(poisoned(pert, name, bits, elem), version="poisoned", bucket_bytes=64 << 10)
        e = ei.value
        assert e.status == 400 and e.param == name, (mode, name, e.status, e.param, e.message)
        assert f"holds {what[bits]} at {at(shape, elem)} (element {elem})" in e.message, e.message
        assert c.get_weight_version() == "0" and prompt_lps(score_all(d, prompts)) == before, (mode, name)
    if mode != "bf16":  # client-side FP8: the codes hold a NaN (0x7f)
        with pytest.raises(RolloutdError) as ei:
            c.push_weights(poisoned(pert, "model.layers.1.mlp.up_proj.weight", BF16_NAN, 3), version="p8", fp8=True)
        assert ei.value.status == 400 and "model.layers.1.mlp.up_proj.weight" in ei.value.message, ei.value.message
        assert "holds NaN at [0][3]" in ei.value.message, ei.value.message
    res = c.push_weights(pert, version="clean")
    assert res.response["weight_version"] == "clean"
    c.close()


def write_poisoned_checkpoint(src, dst, name, bits, elem):
    """Copies checkpoint dir src to dst with one BF16 element of `name` set to `bits` in place."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("perturbed", "golden*.json"))
    path = dst / "model.safetensors"
    with open(path, "r+b") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        start = 8 + hlen + header[name]["data_offsets"][0] + 2 * elem
        f.seek(start)
        f.write(struct.pack("<H", bits))


def test_nonfinite_checkpoint_refused_from_disk_and_at_start(rolloutd, tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    write_poisoned_checkpoint(PERT, allowed / "bad", "model.layers.0.mlp.gate_proj.weight", BF16_NAN, 100)
    d = rolloutd(ORIG, *FP8_ARGS, "--allowed-weight-dir", allowed)
    r = d.post("/update_weights_from_disk", {"model_path": str(allowed / "bad"), "weight_version": "bad"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model.layers.0.mlp.gate_proj.weight" and "holds NaN at [1][4] (element 100)" in err["message"], err  # [., 96]
    assert d.get("/get_weight_version").json()["weight_version"] == "0"
    # a daemon started on it refuses to start, naming the tensor
    out = subprocess.run([BIN, "--model", str(allowed / "bad"), "--port", "0", "--threads", "1"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "model.layers.0.mlp.gate_proj.weight" in out.stderr and "NaN" in out.stderr, (
        out.returncode, out.stderr[-2000:])


# ================================================================ checksums

def test_client_sends_checksums_the_daemon_checks(rolloutd):
    d = rolloutd(ORIG, *FP8_ARGS)
    c = Client(d.url)
    seen = []
    post = c.update_weights_from_shm_body
    c.update_weights_from_shm_body = lambda body, timeout=None: (seen.append(body), post(body, timeout))[1]
    pert = weights(PERT)
    c.push_weights(pert, version="crc", bucket_bytes=64 << 10)
    metas = [m for b in seen for m in b["tensors"]]
    assert len(metas) == len(pert)
    for m in metas:  # the daemon accepted them all: its CRC of what it read is the crc32c package's
        assert m["crc32c"] == crc32c.crc32c(pert[m["name"]][0]), m["name"]
    seen.clear()
    c.push_weights(weights(ORIG), version="no-crc", checksums=False)
    assert all("crc32c" not in m for b in seen for m in b["tensors"])
    c.close()


def _checksummed(sd, seg):
    metas = _write_all(sd, seg)
    for m in metas:
        m["crc32c"] = crc32c.crc32c(seg.buf[m["offset"]:m["offset"] + len(sd[m["name"]][0])])
    return metas


@pytest.mark.parametrize("change", ["pwrite", "shrink-regrow"])
def test_segment_changed_after_checksum_refused(rolloutd, change):
    d = rolloutd(ORIG, *BF16_ARGS)
    prompts = golden(ORIG, "golden.json")["prompts"][:2]
    before = prompt_lps(score_all(d, prompts))
    pert = weights(PERT)
    seg = _segment(pert)
    try:
        metas = _checksummed(pert, seg)
        # pwrite: the last tensor; shrink: the first tensor that reaches past a third of the segment
        victim = metas[-1] if change == "pwrite" else next(
            m for m in metas if m["offset"] + len(pert[m["name"]][0]) > seg.size // 3)
        fd = os.open("/dev/shm" + seg.name, os.O_RDWR)
        try:
            if change == "pwrite":  # another writer's bytes over the victim after the client's checksum
                os.pwrite(fd, np.frombuffer(weights(ORIG)[victim["name"]][0], np.uint8).tobytes(), victim["offset"])
            else:  # ftruncate(len / 3), then back: the tail reads as zeros
                os.ftruncate(fd, seg.size // 3)
                os.ftruncate(fd, seg.size)
        finally:
            os.close(fd)
        r = _bucket(d, seg, metas, is_last=True, weight_version="changed")
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == victim["name"] and "CRC-32C" in err["message"] and "changed" in err["message"], err
        assert d.get("/get_weight_version").json()["weight_version"] == "0"
        assert prompt_lps(score_all(d, prompts)) == before
        # without checksums the same bytes would have been committed: the daemon has no other way to tell
        r = _bucket(d, seg, [{k: v for k, v in m.items() if k != "crc32c"} for m in metas], is_last=True,
                    weight_version="unchecked")
        assert r.status_code == 200, r.text
    finally:
        seg.close()
