"""rolloutd's TCPStore client (sync/tcpstore.h, through build/tcpstore-probe) against torch's own.

With torch (each python named in $ROLLOUTD_TORCH_PYTHONS, separated by ':', else this python if it
has torch; skipped with the reason when none imports torch):
  - byte for byte: torch's Python client and the probe make the same calls (set, get, add, check,
    compare_set, multi_set, multi_get, a wait that times out, a get after it) on fresh stores of
    both server kinds (libuv, classic) through a recording proxy; both directions must match, the
    PING nonce aside, and every answer of torch's store must be taken;
  - values cross both ways: what the probe sets, torch's client reads, and the reverse;
  - the group key sequence: a 2-rank gloo group made as init_custom_process_group makes one,
    recorded through a proxy, starts with exactly the probe's join (VALIDATE, PING, ADD "init/")
    and uses only keys "/G/G//cpu//..."; then torch's rendezvous as rank 0 of an SGLang-style
    weight-update group (world 2 and 3) returns only once the probes have joined, and the probes
    read the ncclUniqueId that rank 0 publishes the way ProcessGroupNCCL does, and the way torch
    2.15's nccl2 backend does (found by polling for either key, as the daemon's store watcher does).
Without torch (always): fake stores that send a garbage length, stall, or close in the middle of
a reply; the probe fails with a clear message within its timeout and a bounded peak RSS. The probe
is the one next to $ROLLOUTD_BIN (build-san/ in CI's sanitizer run).
"""
import json
import os
import pathlib
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
BIN = pathlib.Path(os.environ.get("ROLLOUTD_BIN", str(ROOT / "build" / "rolloutd")))
PROBE = BIN.parent / "tcpstore-probe"
PEER = HERE / "tcpstore_peer.py"


def _torch_pythons():
    env = os.environ.get("ROLLOUTD_TORCH_PYTHONS")
    cands = env.split(":") if env else [sys.executable]
    found, tried = [], []
    for py in cands:
        if not py or not os.path.exists(py) or py in found:
            continue
        r = subprocess.run([py, "-c", "import torch.distributed as d; import torch; assert d.is_available(); "
                            "print(torch.__version__)"], capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            found.append((py, r.stdout.strip()))
        else:
            tried.append(py)
    return found, tried


TORCH, TRIED = _torch_pythons()
NO_TORCH = f"no python with torch.distributed (tried {TRIED or 'none'}; set ROLLOUTD_TORCH_PYTHONS)"
needs_probe = pytest.mark.skipif(not PROBE.exists(), reason=f"{PROBE} not built (make all)")


def torch_params():
    if not TORCH:
        return [pytest.param(None, marks=pytest.mark.skip(reason=NO_TORCH))]
    return [pytest.param(py, id=f"torch-{ver}") for py, ver in TORCH]


def probe(port, *cmds, timeout=10.0):
    r = subprocess.run([str(PROBE), "--timeout", str(timeout), "127.0.0.1", str(port), *cmds],
                       capture_output=True, text=True, timeout=120)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    assert_clean(r.stderr)
    return r.returncode, lines, r.stderr


def assert_clean(stderr):
    """No sanitizer report (a sanitizer's exit status would pass for the probe's own 1)."""
    for mark in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
        assert mark not in stderr, stderr[-3000:]


def peer_json(py, *args, timeout=240):
    r = subprocess.run([py, str(PEER), *args], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


class TorchServer:
    """tcpstore_peer.py server: a torch TCPStore master and torch's client API on a pipe."""

    def __init__(self, py, libuv=True):
        self.p = subprocess.Popen([py, str(PEER), "server"] + ([] if libuv else ["--no-libuv"]),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"))
        self.port = json.loads(self.p.stdout.readline())["port"]

    def ask(self, **req):
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=30)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# against torch

@needs_probe
@pytest.mark.parametrize("py", torch_params())
@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "classic"])
def test_probe_sends_what_torch_sends(py, libuv):
    rec = peer_json(py, "record-api", "--probe", str(PROBE), *([] if libuv else ["--no-libuv"]))
    t, p = rec["torch"], rec["probe"]
    # the PING nonce is the pid: bytes 6..9 of the first request and 0..3 of the first answer
    mask = lambda h, a, b: h[:2 * a] + "00" * (b - a) + h[2 * b:]  # noqa: E731
    assert mask(p[">"], 6, 10) == mask(t[">"], 6, 10), (p[">"], t[">"])
    assert mask(p["<"], 0, 4) == mask(t["<"], 0, 4), (p["<"], t["<"])
    assert len(t[">"]) > 400, t  # the whole sequence was recorded


@needs_probe
@pytest.mark.parametrize("py", torch_params())
def test_values_cross_both_ways(py):
    srv = TorchServer(py)
    try:
        uid = bytes((i * 37 + 11) & 0xFF for i in range(128))
        rc, out, err = probe(srv.port, "set", "c/k", "hex:" + uid.hex(), "add", "ctr", "7", "add", "ctr", "-2",
                             "mset", "2", "m1", "one", "m2", "hex:00ff00")
        assert rc == 0, (out, err)
        assert srv.ask(op="get", key="c/k")["hex"] == uid.hex()
        assert srv.ask(op="get", key="ctr")["hex"] == b"5".hex()       # ADD stores decimal text
        assert srv.ask(op="get", key="m2")["hex"] == "00ff00"
        assert srv.ask(op="add", key="ctr", delta=10)["int"] == 15
        assert srv.ask(op="set", key="py", hex=b"from torch".hex())["ok"]
        rc, out, err = probe(srv.port, "get", "py", "add", "ctr", "0", "check", "py,m1", "check", "py,nope",
                             "wait", "py,m1", "mget", "m1,py", "cas", "py", "from torch", "swapped",
                             "cas", "py", "stale", "again", "get", "py")
        assert rc == 0, (out, err)
        assert [o.get("value") for o in out][1] == b"from torch".hex()
        assert out[2]["int"] == 15
        assert out[3]["all_set"] is True and out[4]["all_set"] is False
        assert out[6]["value"] == [b"one".hex(), b"from torch".hex()]
        assert out[7]["value"] == b"swapped".hex() and out[8]["value"] == b"swapped".hex()
        assert srv.ask(op="get", key="py")["hex"] == b"swapped".hex()
        # a wait that times out is cancelled and leaves the connection usable
        rc, out, err = probe(srv.port, "wait", "absent", "get", "py", timeout=0.5)
        assert rc == 1 and out[1]["error"] == "RS_EBUSY" and out[1]["http"] == 503
        assert "WAIT for 'absent'" in out[1]["message"] and 0.45 < out[1]["seconds"] < 0.5 + 1.5
        assert out[2]["ok"] and out[2]["value"] == b"swapped".hex()
    finally:
        srv.close()


@needs_probe
@pytest.mark.parametrize("py", torch_params())
def test_gloo_group_traffic_matches_the_key_sequence(py):
    g = "g-rec"
    rec = peer_json(py, "record-gloo", "--group", g, "--probe", str(PROBE))
    assert rec["broadcast"] == [[0, [0.0, 1.0, 2.0, 3.0]], [1, [0.0, 1.0, 2.0, 3.0]]]
    reqs = rec["requests"]
    assert reqs[:3] == [["VALIDATE"], ["PING"], ["ADD", "init/"]], reqs[:4]
    keys = [k for r in reqs[3:] for k in r[1:]]
    assert keys and all(k.startswith(f"/{g}/{g}//cpu//") for k in keys), keys
    # the probe's join is the same bytes as torch's rank-1 store connecting (nonce aside)
    hello = rec["probe_hello"]
    assert len(hello) == 2 * (10 + 22), hello
    assert hello[:12] + hello[20:] == rec["hello"][:12] + rec["hello"][20:len(hello)], (hello, rec["hello"])


@needs_probe
@pytest.mark.parametrize("py", torch_params())
@pytest.mark.parametrize("world,flavor,cmd", [(2, "legacy", "nccl-id"), (3, "legacy", "nccl-id"),
                                              (2, "legacy", "nccl-id-any"), (3, "nccl2", "nccl-id-any")])
def test_sglang_rendezvous_and_unique_id(py, world, flavor, cmd):
    port, group = free_port(), "slime-pp_0"
    uid = bytes((i * 13 + 5) & 0xFF for i in range(128))
    tr = subprocess.Popen([py, str(PEER), "trainer", "--port", str(port), "--world", str(world), "--group", group,
                           "--uid", uid.hex(), "--flavor", flavor], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"))
    results = [None] * (world - 1)

    def rank(i):  # started before the trainer's store listens, as slime and AReaL do
        results[i] = probe(port, "join", cmd, group, timeout=60)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(world - 1)]
    try:
        for t in threads:
            t.start()
            time.sleep(0.2)
        ev = json.loads(tr.stdout.readline())
        assert ev["event"] == "rendezvous" and ev["world"] == world, ev
        assert json.loads(tr.stdout.readline())["event"] == "id_set"
        for t in threads:
            t.join(90)
        for rc, out, err in results:
            assert rc == 0, (out, err)
            assert out[0]["cmd"] == "join" and 1 <= out[0]["int"] <= world
            assert out[1]["value"] == uid.hex()
            if cmd == "nccl-id-any":
                assert out[1]["flavor"] == {"legacy": "ProcessGroupNCCL", "nccl2": "nccl2"}[flavor], out[1]
        assert sorted(o[1][0]["int"] for o in results) == list(range(2, world + 1))
    finally:
        tr.stdin.close()
        tr.wait(timeout=60)


@needs_probe
@pytest.mark.parametrize("py", torch_params())
def test_unique_id_timeout_names_the_key(py):
    srv = TorchServer(py)
    try:
        rc, out, _ = probe(srv.port, "join", "nccl-id", "grp", timeout=0.6)
        assert rc == 1 and out[0]["ok"] and out[1]["error"] == "RS_EBUSY"
        assert "'/grp/grp//cuda//0'" in out[1]["message"] and "ncclUniqueId" in out[1]["message"]
        assert out[1]["seconds"] < 0.6 + 1.5
        # a value of the wrong size under the id key is a malformed reply, not an id
        assert srv.ask(op="set", key="grp/grp//cuda//0", hex="00" * 64)["ok"]
        rc, out, _ = probe(srv.port, "nccl-id", "grp")
        assert rc == 1 and out[1]["error"] == "RS_EIO" and "64 bytes, not 128" in out[1]["message"]
    finally:
        srv.close()


@needs_probe
@pytest.mark.parametrize("py", torch_params())
def test_unique_id_of_either_backend_timeout_names_both_keys(py):
    srv = TorchServer(py)
    try:
        rc, out, _ = probe(srv.port, "join", "nccl-id-any", "grp", timeout=0.6)
        assert rc == 1 and out[0]["ok"] and out[1]["error"] == "RS_EBUSY"
        msg = out[1]["message"]
        assert "'/grp/grp//cuda//0'" in msg and "'/grp/grp//cuda//grp/nccl_storekey_0'" in msg, msg
        assert out[1]["seconds"] < 0.6 + 1.5
        # the poll takes whichever key the trainer sets; a wrong-sized value is malformed
        assert srv.ask(op="set", key="grp/grp//cuda//grp/nccl_storekey_0", hex="00" * 64)["ok"]
        rc, out, _ = probe(srv.port, "nccl-id-any", "grp")
        assert rc == 1 and out[1]["error"] == "RS_EIO" and "64 bytes, not 128" in out[1]["message"]
        assert "nccl_storekey_0" in out[1]["message"]
    finally:
        srv.close()


# ------------------------------------------------------------------------------------------------
# fake stores (no torch needed)

HELLO_LEN = 10  # VALIDATE + magic, PING + nonce


def fake_store(behaviour):
    """A one-connection store on loopback that answers the handshake, then misbehaves."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)

    def run():
        c, _ = ls.accept()
        try:
            hello = b""
            while len(hello) < HELLO_LEN:
                hello += c.recv(HELLO_LEN - len(hello))
            behaviour(c, hello[6:10])
        except OSError:
            pass
        finally:
            c.close()
            ls.close()

    threading.Thread(target=run, daemon=True).start()
    return ls.getsockname()[1]


def _drain(c, n):
    got = b""
    while len(got) < n:
        b = c.recv(n - len(got))
        if not b:
            break
        got += b
    return got


def _garbage_length(c, nonce):
    c.sendall(nonce)
    _drain(c, 1 + 16 + 2)         # WAIT for "/x"
    c.sendall(b"\x00")
    _drain(c, 1 + 8 + 2)          # GET "/x"
    c.sendall(struct.pack("<Q", 1 << 62) + b"\x01" * 64)
    time.sleep(2)


def _stall(c, nonce):
    c.sendall(nonce)
    time.sleep(5)


def _close_mid_reply(c, nonce):
    c.sendall(nonce)
    _drain(c, 1 + 16 + 2)
    c.sendall(b"\x00")
    _drain(c, 1 + 8 + 2)
    c.sendall(struct.pack("<Q", 128) + b"\x07" * 50)  # 50 of 128 bytes, then gone


def _stall_mid_reply(c, nonce):
    c.sendall(nonce[:2])
    time.sleep(5)


# Runs argv and prints its exit code and peak RSS (KiB) as a last JSON line. Linux hands a child the
# peak RSS of the process it was forked from (exec records the old image's high-water mark), so the
# probe is started from this small interpreter rather than from pytest, whose peak after a long run
# of other tests says nothing about the probe.
_WAIT4 = ("import json, os, sys\n"
          "pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ)\n"
          "_, status, ru = os.wait4(pid, 0)\n"
          "sys.stdout.flush()\n"
          "print(json.dumps({'exit': os.waitstatus_to_exitcode(status), 'maxrss_kib': ru.ru_maxrss}))\n")


@needs_probe
@pytest.mark.parametrize("behaviour,cmds,want,code", [
    (_garbage_length, ["get", "x"], "a value of 4611686018427387904 bytes, more than", "RS_EIO"),
    (_stall, ["get", "x"], "WAIT for 'x': no answer before the deadline", "RS_EBUSY"),
    (_close_mid_reply, ["get", "x"], "closed the connection in the middle of a reply", "RS_EIO"),
], ids=["garbage-length", "stall", "close-mid-reply"])
def test_fake_store_fails_cleanly(behaviour, cmds, want, code):
    port = fake_store(behaviour)
    timeout = 1.0
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _WAIT4, str(PROBE), "--timeout", str(timeout), "127.0.0.1", str(port),
                        *cmds], capture_output=True, text=True, timeout=60)
    dt = time.monotonic() - t0
    out = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
    assert_clean(p.stderr)
    done = out.pop()
    assert p.returncode == 0 and done["exit"] == 1, (out, p.stderr)
    assert out[0]["ok"], out
    assert out[1]["error"] == code and want in out[1]["message"], out[1]
    assert dt < timeout + 1.0 + 2.0, dt                # the deadline, the cancel grace, two start-ups
    assert done["maxrss_kib"] < 256 * 1024, done       # nothing sized by the peer was allocated


@needs_probe
def test_fake_store_stalling_the_handshake():
    port = fake_store(_stall_mid_reply)
    t0 = time.monotonic()
    rc, out, err = probe(port, "get", "x", timeout=0.8)
    assert rc == 1 and len(out) == 1, (out, err)
    assert out[0]["cmd"] == "connect" and out[0]["error"] == "RS_EBUSY"
    assert "PING: no answer before the deadline" in out[0]["message"]
    assert time.monotonic() - t0 < 0.8 + 1.5


@needs_probe
def test_nothing_listening():
    rc, out, _ = probe(free_port(), "join", timeout=0.5)
    assert rc == 1 and out[0]["error"] == "RS_EBUSY" and out[0]["http"] == 503
    assert "Connection refused" in out[0]["message"] and "not listening" in out[0]["message"]
