"""Weight routes against hostile or careless inputs, end to end on the real daemon.

  - a FIFO named as the shared-memory segment (anyone can make one in /dev/shm), or put where a
    checkpoint's model.safetensors or index should be, gets a 400 at once: an open that waited for
    a writer would hold the sync thread, every weight job queued behind it, and shutdown (the
    fixture's SIGTERM must still end the daemon with status 0);
  - /update_weights_from_disk under --kv-scale-mode static applies the checkpoint's
    self_attn.k_scale / v_scale, exactly as a daemon started on that checkpoint (and as an shm push
    of the same tensors, test_weight_sync.test_shm_push_kv_scales) does;
  - a disk path outside --allowed-weight-dir, and one that does not resolve, get the same answer,
    which names neither the symlink's target nor errno;
  - each weight route's errors are logged under its own path;
  - a client that can write inside --allowed-weight-dir swaps the checkpoint's model.safetensors
    between the real file and symlinks to /etc/passwd and to a valid checkpoint outside, as fast
    as the kernel renames, while updates run: no answer holds a byte of the file outside, and
    every commit serves the checkpoint inside (its prompt logprobs, bit for bit).
"""
import ctypes
import os
import shutil
import threading
import time

import pytest

from test_golden import BF16_ARGS, score_body
# (test_weight_sync puts clients/python on sys.path)
from test_weight_sync import ORIG, PERT, STATIC_KV_ARGS, golden, kv_scale_checkpoints, prompt_lps, score_all
from rolloutd_client import Client  # noqa: E402

pytestmark = pytest.mark.skipif(not (PERT / "golden.json").is_file(), reason="no qwen3/perturbed fixture")

# Long enough for any answer on a loaded CI machine, far shorter than "never".
ANSWER_S = 20


def test_shm_fifo_refused_at_once(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    fifo = f"/dev/shm/rolloutd-e2e-fifo-{os.getpid()}"
    os.mkfifo(fifo, 0o600)
    try:
        r = d.post("/update_weights_from_shm", {"shm_name": "/" + os.path.basename(fifo), "tensors": [],
                                                "is_last": False}, timeout=ANSWER_S)
    finally:
        os.unlink(fifo)
    assert r.status_code == 400, r.text
    assert "is not a shared-memory segment" in r.json()["error"]["message"], r.text
    # the sync thread is free: the next weight job is answered
    r = d.post("/update_weight_version", {"new_version": "after-fifo"}, timeout=ANSWER_S)
    assert r.status_code == 200, r.text
    assert Client(d.url).get_weight_version() == "after-fifo"


def test_disk_fifo_refused_at_once(rolloutd, tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    d = rolloutd(ORIG, *BF16_ARGS, "--allowed-weight-dir", allowed)
    for name in ("model.safetensors", "model.safetensors.index.json"):
        ckpt = allowed / name.replace(".", "-")
        ckpt.mkdir()
        os.mkfifo(ckpt / name, 0o600)
        r = d.post("/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "fifo"},
                   timeout=ANSWER_S)
        assert r.status_code == 400, f"{name} a FIFO: {r.status_code} {r.text}"
        assert "not a regular file" in r.json()["error"]["message"], r.text
    shutil.copytree(PERT, allowed / "step", ignore=shutil.ignore_patterns("golden*.json"))
    assert Client(d.url).update_from_disk(allowed / "step", version="step")["weight_version"] == "step"


def test_disk_update_applies_kv_scales(rolloutd, tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    kv_scale_checkpoints(allowed / "a", allowed / "b")
    shutil.copytree(ORIG, allowed / "no-scales", ignore=shutil.ignore_patterns("perturbed", "golden*.json"))
    prompts = golden(ORIG, "golden.json")["prompts"]

    ref = rolloutd(allowed / "b", *STATIC_KV_ARGS)   # the reference: started on scales b
    want = prompt_lps(score_all(ref, prompts))
    ref.stop()
    d = rolloutd(allowed / "a", *STATIC_KV_ARGS, "--allowed-weight-dir", allowed)
    c = Client(d.url)
    before = prompt_lps(score_all(d, prompts))
    assert before != want, "k/v scales 4x and 3x larger should change FP8-KV logprobs"

    resp = c.update_from_disk(allowed / "b", version="disk-b")
    assert "KV scales from this update" in resp["message"], resp
    assert prompt_lps(score_all(d, prompts)) == want, "KV scales from disk serve differently from loaded ones"

    # a checkpoint without scales keeps them, as a push without them does
    c.update_from_disk(allowed / "no-scales", version="disk-kept")
    assert prompt_lps(score_all(d, prompts)) == want


def test_disk_refusal_reveals_nothing_outside(rolloutd, tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    d = rolloutd(ORIG, *BF16_ARGS, "--allowed-weight-dir", allowed)
    tails = {}
    for path in ("/proc/self/exe", "/proc/self/cwd", str(tmp_path / "no-such-dir"), str(allowed / "nothing")):
        r = d.post("/update_weights_from_disk", {"model_path": path}, timeout=ANSWER_S)
        assert r.status_code == 400, f"{path}: {r.status_code} {r.text}"
        msg = r.json()["error"]["message"]
        assert msg.startswith(f"model_path '{path}' does not resolve to a directory inside"), msg
        tails[path] = msg[len(f"model_path '{path}'"):]
        for leak in (os.path.realpath(d.proc.args[0]), os.getcwd(), os.strerror(2)):
            assert leak not in tails[path], f"{path}: the answer tells {leak!r}: {msg}"
    assert len(set(tails.values())) == 1, tails


def test_weight_routes_logged_by_path(rolloutd):
    d = rolloutd(ORIG, *BF16_ARGS)
    bad = {"/update_weights_from_disk": {"model_path": "/nowhere"},
           "/update_weight_version": {},
           "/destroy_weights_update_group": {"group_name": 3}}
    for route, body in bad.items():
        r = d.post(route, body, timeout=ANSWER_S)
        assert r.status_code == 400, f"{route}: {r.status_code} {r.text}"
    log = d.read_log()
    for route in bad:
        assert f"http | {route} | 400" in log, f"no 400 logged under {route}:\n{log[-3000:]}"
    assert "/update_weights_from_shm" not in log, f"a request was logged under the wrong route:\n{log[-3000:]}"


def _renameat2_exchange():
    """A function exchanging two paths atomically (renameat2 RENAME_EXCHANGE), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, exchange = -100, 2
    return lambda a, b: fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange) == 0


def test_disk_symlink_swap_race(rolloutd, tmp_path):
    exchange = _renameat2_exchange()
    if not os.path.exists("/etc/passwd"):
        pytest.skip("no /etc/passwd to point at")
    allowed = tmp_path / "allowed"
    step = allowed / "step"
    shutil.copytree(ORIG, step, ignore=shutil.ignore_patterns("perturbed", "golden*.json"))
    outside = tmp_path / "outside"
    shutil.copytree(PERT, outside, ignore=shutil.ignore_patterns("golden*.json"))
    target = step / "model.safetensors"
    alts = [step / ".passwd", step / ".outside"]
    os.symlink("/etc/passwd", alts[0])
    os.symlink(outside / "model.safetensors", alts[1])
    if exchange is None or not exchange(target, alts[0]) or not exchange(target, alts[0]):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    with open("/etc/passwd", "rb") as f:
        head = f.read(8)
    passwd_first8 = str(int.from_bytes(head.ljust(8, b"\0"), "little"))
    d = rolloutd(ORIG, *BF16_ARGS, "--allowed-weight-dir", allowed)
    prompt = golden(ORIG, "golden.json")["prompts"][0]["input_ids"]

    def scored():
        r = d.post("/generate", score_body(prompt), timeout=ANSWER_S)
        assert r.status_code == 200, r.text
        return [e[0] for e in r.json()["meta_info"]["input_token_logprobs"]]

    inside = scored()
    stop = threading.Event()
    swaps = [0]

    def race():
        i = 0
        while not stop.is_set():
            swaps[0] += exchange(target, alts[i % 2])
            i += 1

    racer = threading.Thread(target=race)
    racer.start()
    commits = refusals = 0
    try:
        deadline = time.time() + 90
        for i in range(1000):
            if time.time() > deadline:
                break
            r = d.post("/update_weights_from_disk", {"model_path": str(step), "weight_version": f"race-{i}"},
                       timeout=ANSWER_S)
            if r.status_code == 200:
                commits += 1
                assert scored() == inside, f"iteration {i}: the committed weights are not the checkpoint inside"
                continue
            refusals += 1
            assert r.status_code == 400, r.text
            for leak in ("root:", passwd_first8, "/etc/passwd", str(outside)):
                assert leak not in r.text, f"iteration {i}: the answer tells {leak!r}: {r.text}"
    finally:
        stop.set()
        racer.join()
    print(f"{commits} commits, {refusals} refusals, {swaps[0]} swaps")
    assert commits > 0 and refusals > 0 and swaps[0] > 100
