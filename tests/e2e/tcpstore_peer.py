"""torch's side of the TCPStore tests (tests/e2e/test_tcpstore.py); run with a python that has torch.

    python tcpstore_peer.py server [--no-libuv]
        a TCPStore master; prints {"port"}; then answers JSON-line requests on stdin with torch's
        own client API: {"op": "get"|"set"|"add"|"check"|"num_keys", "key", "hex", "delta", "keys"}
    python tcpstore_peer.py trainer --port P --world W --group G --uid HEX [--flavor F] [--no-libuv]
        rank 0 of an SGLang-style weight-update group, as init_custom_process_group and torch's
        NCCL backend run it (the NCCL communicator aside, which needs a GPU): the tcp://
        rendezvous (returns once W ranks have joined), PrefixStore(G), _new_process_group_helper's
        PrefixStore(G + "/") and PrefixStore("cuda/"), then the id: with --flavor legacy (the
        default) ProcessGroupNCCL's broadcastUniqueNCCLID set("0", id); with --flavor nccl2 torch
        2.15's c10d::nccl2::NCCLBootstrap::exchangeUniqueId, PrefixStore(G).set("nccl_storekey_0",
        id); prints {"event": "rendezvous"} and {"event": "id_set"}, then holds the store until
        stdin closes
    python tcpstore_peer.py record-api --probe BIN
        the same calls made by torch's client and by BIN (tcpstore-probe), each on a fresh store
        through a recording proxy; prints {"torch": [...], "probe": [...]} (hex, per direction)
    python tcpstore_peer.py record-gloo --group G [--probe BIN]
        a 2-rank gloo group made the way init_custom_process_group makes one, rank 1 through a
        recording proxy; prints {"requests": [[op, keys...]], "hello": hex, "probe_hello": hex}
"""
import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import struct
import subprocess
import sys
import threading
import time

T = datetime.timedelta(seconds=60)
OPS = {0: "VALIDATE", 1: "SET", 2: "COMPARE_SET", 3: "GET", 4: "ADD", 5: "CHECK", 6: "WAIT", 7: "GETNUMKEYS",
       8: "DELETE_KEY", 9: "APPEND", 10: "MULTI_GET", 11: "MULTI_SET", 12: "CANCEL_WAIT", 13: "PING"}


def out(obj):
    print(json.dumps(obj), flush=True)


# ------------------------------------------------------------------------------------------------
# a recording proxy (one listener, any number of connections, each recorded in both directions)

class Proxy:
    def __init__(self, target_port):
        self.target = ("127.0.0.1", target_port)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns = []                 # [{">": bytearray, "<": bytearray}]
        threading.Thread(target=self._accept, daemon=True).start()

    def _pump(self, src, dst, buf):
        while True:
            try:
                b = src.recv(65536)
            except OSError:
                break
            if not b:
                break
            buf += b
            try:
                dst.sendall(b)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _accept(self):
        while True:
            c, _ = self.sock.accept()
            s = socket.create_connection(self.target)
            rec = {">": bytearray(), "<": bytearray()}
            self.conns.append(rec)
            threading.Thread(target=self._pump, args=(c, s, rec[">"]), daemon=True).start()
            threading.Thread(target=self._pump, args=(s, c, rec["<"]), daemon=True).start()


def parse_requests(b):
    """Client-to-store bytes -> [[op, key...]] (values omitted)."""
    out_, i = [], 0

    def u64():
        nonlocal i
        v = struct.unpack_from("<Q", b, i)[0]
        i += 8
        return v

    def vec():
        nonlocal i
        n = u64()
        v = bytes(b[i:i + n])
        i += n
        return v

    while i < len(b):
        op = OPS.get(b[i], f"?{b[i]}")
        i += 1
        if op in ("VALIDATE", "PING"):
            i += 4
            out_.append([op])
        elif op in ("SET", "APPEND"):
            k = vec()
            vec()
            out_.append([op, k.decode()])
        elif op == "COMPARE_SET":
            k = vec()
            vec()
            vec()
            out_.append([op, k.decode()])
        elif op in ("GET", "DELETE_KEY"):
            out_.append([op, vec().decode()])
        elif op == "ADD":
            k = vec()
            i += 8
            out_.append([op, k.decode()])
        elif op in ("CHECK", "WAIT", "MULTI_GET"):
            out_.append([op] + [vec().decode() for _ in range(u64())])
        elif op == "MULTI_SET":
            keys = []
            for _ in range(u64()):
                keys.append(vec().decode())
                vec()
            out_.append([op] + keys)
        elif op in ("CANCEL_WAIT", "GETNUMKEYS"):
            out_.append([op])
        else:
            out_.append([op, bytes(b[i:]).hex()])
            break
    return out_


# ------------------------------------------------------------------------------------------------

def master(use_libuv=True):
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, None, True, T, wait_for_workers=False, use_libuv=use_libuv)


def cmd_server(a):
    s = master(not a.no_libuv)
    out({"port": s.port})
    for line in sys.stdin:
        r = json.loads(line)
        try:
            op = r["op"]
            if op == "get":
                out({"hex": s.get(r["key"]).hex()})
            elif op == "set":
                s.set(r["key"], bytes.fromhex(r["hex"]))
                out({"ok": True})
            elif op == "add":
                out({"int": s.add(r["key"], r["delta"])})
            elif op == "check":
                out({"all_set": s.check(r["keys"])})
            elif op == "num_keys":
                out({"int": s.num_keys()})
        except Exception as e:  # answered, so the test sees torch's own error
            out({"error": repr(e)})


def cmd_trainer(a):
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import rendezvous
    t0 = time.monotonic()
    url = f"tcp://127.0.0.1:{a.port}" + ("?use_libuv=0" if a.no_libuv else "")
    store, rank, world = next(rendezvous(url, 0, a.world, timeout=T))
    store.set_timeout(T)
    out({"event": "rendezvous", "seconds": time.monotonic() - t0, "rank": rank, "world": world})
    group = PrefixStore(a.group, store)                  # init_custom_process_group
    pg_store = PrefixStore(f"{a.group}/", group)         # _new_process_group_helper
    backend_store = PrefixStore("cuda/", pg_store)       # ... for device "cuda" of backend "nccl"
    if a.flavor == "nccl2":                              # nccl2::NCCLBootstrap::exchangeUniqueId, rank 0,
        PrefixStore(a.group, backend_store).set("nccl_storekey_0", bytes.fromhex(a.uid))  # generation 0
    else:
        backend_store.set("0", bytes.fromhex(a.uid))     # ProcessGroupNCCL::broadcastUniqueNCCLID, rank 0
    out({"event": "id_set"})
    sys.stdin.read()


API_SEQUENCE = [("set", "k", b"v1"), ("get", "k"), ("add", "n", 5), ("check", ["k", "zz"]),
                ("cas", "k", b"v1", b"v2"), ("mset", ["a", "b"], [b"1", b"22"]), ("mget", ["a", "b"]),
                ("wait", ["never"]), ("get", "k")]


def probe_args(seq):
    args = []
    for c in seq:
        if c[0] == "set":
            args += ["set", c[1], "hex:" + c[2].hex()]
        elif c[0] in ("get",):
            args += ["get", c[1]]
        elif c[0] == "add":
            args += ["add", c[1], str(c[2])]
        elif c[0] in ("check", "wait", "mget"):
            args += [c[0], ",".join(c[1])]
        elif c[0] == "cas":
            args += ["cas", c[1], "hex:" + c[2].hex(), "hex:" + c[3].hex()]
        elif c[0] == "mset":
            args += ["mset", str(len(c[1]))]
            for k, v in zip(c[1], c[2]):
                args += [k, "hex:" + v.hex()]
    return args


def torch_calls(store, seq):
    for c in seq:
        if c[0] == "set":
            store.set(c[1], c[2])
        elif c[0] == "get":
            store.get(c[1])
        elif c[0] == "add":
            store.add(c[1], c[2])
        elif c[0] == "check":
            store.check(c[1])
        elif c[0] == "cas":
            store.compare_set(c[1], c[2], c[3])
        elif c[0] == "mset":
            store.multi_set(c[1], c[2])
        elif c[0] == "mget":
            store.multi_get(c[1])
        elif c[0] == "wait":
            try:
                store.wait(c[1], datetime.timedelta(milliseconds=300))
            except Exception:
                pass


def settle(proxy, n_conns):
    for _ in range(100):
        if len(proxy.conns) >= n_conns:
            break
        time.sleep(0.02)
    time.sleep(0.3)


def cmd_record_api(a):
    import torch.distributed as dist
    rec = {}
    for who in ("torch", "probe"):
        srv = master(not a.no_libuv)
        px = Proxy(srv.port)
        if who == "torch":
            c = dist.TCPStore("127.0.0.1", px.port, None, False, T, wait_for_workers=False)
            torch_calls(c, API_SEQUENCE)
            del c
        else:
            subprocess.run([a.probe, "--timeout", "0.3", "127.0.0.1", str(px.port)] + probe_args(API_SEQUENCE),
                           capture_output=True, timeout=60)
        settle(px, 1)
        rec[who] = {d: px.conns[0][d].hex() for d in (">", "<")}
    out(rec)


def _gloo_rank(rank, port, group, q):
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world, rendezvous
    # SGLang's init_custom_process_group, with backend "gloo" (NCCL needs a GPU)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, 2, timeout=T))
    store.set_timeout(T)
    store = PrefixStore(group, store)
    # pg_options became backend_options in torch 2.6 (SGLang compares the version strings, which
    # takes "2.15" for older than "2.6"; the numbers are compared here)
    ver = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    opt = "backend_options" if ver >= (2, 6) else "pg_options"
    pg, _ = _new_process_group_helper(2, rank, [], Backend("gloo"), store, group_name=group, timeout=T,
                                      **{opt: None})
    _world.pg_group_ranks[pg] = {i: i for i in range(2)}
    t = torch.arange(4, dtype=torch.float32) if rank == 0 else torch.zeros(4)
    dist.broadcast(t, src=0, group=pg)
    q.put((rank, t.tolist()))
    time.sleep(1.0)


def cmd_record_gloo(a):
    ctx = mp.get_context("spawn")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    q = ctx.Queue()
    p0 = ctx.Process(target=_gloo_rank, args=(0, port, a.group, q))
    p0.start()
    for _ in range(300):                                 # until rank 0's store listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    px = Proxy(port)
    p1 = ctx.Process(target=_gloo_rank, args=(1, px.port, a.group, q))
    p1.start()
    got, t0 = [], time.monotonic()
    while len(got) < 2:
        try:
            got.append(q.get(timeout=1))
        except Exception:
            if any(p.exitcode not in (None, 0) for p in (p0, p1)) or time.monotonic() - t0 > 120:
                raise RuntimeError(f"a gloo rank failed: exit codes {p0.exitcode}, {p1.exitcode}")
    got.sort()
    p1.join(60)
    p0.join(60)
    res = {"broadcast": got, "requests": parse_requests(bytes(px.conns[0][">"])),
           "hello": bytes(px.conns[0][">"][:32]).hex()}
    if a.probe:
        srv = master()
        px2 = Proxy(srv.port)
        subprocess.run([a.probe, "127.0.0.1", str(px2.port), "join"], capture_output=True, timeout=60)
        settle(px2, 1)
        res["probe_hello"] = bytes(px2.conns[0][">"]).hex()
    out(res)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["server", "trainer", "record-api", "record-gloo"])
    ap.add_argument("--port", type=int)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--group", default="weight_update_group")
    ap.add_argument("--uid", default="")
    ap.add_argument("--flavor", choices=["legacy", "nccl2"], default="legacy")
    ap.add_argument("--probe")
    ap.add_argument("--no-libuv", action="store_true")
    a = ap.parse_args()
    {"server": cmd_server, "trainer": cmd_trainer, "record-api": cmd_record_api,
     "record-gloo": cmd_record_gloo}[a.mode](a)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    main()
