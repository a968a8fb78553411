"""Weight updates that must never commit something other than what the trainer meant, end to end:

  - a bucket joins the open update only when it names it (transaction_id from the first bucket's
    answer, and the same weight_version): bucket 1 of version B without is_last and a version-less
    bucket 2 is a 409 that stages nothing, and B still commits from its own bucket; the Python
    client ties its buckets with the id, so multi-bucket pushes work as before;
"""
import numpy as np
import pytest

from test_golden import BF16_ARGS
# (test_weight_sync puts clients/python on sys.path)
from test_weight_sync import ORIG, PERT, _write_all, check_bf16_golden, golden, prompt_lps, score_all, weights
from rolloutd_client import Client  # noqa: E402
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
