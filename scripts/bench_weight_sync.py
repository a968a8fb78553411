#!/usr/bin/env python3
"""Weight-sync benchmark: push a Qwen3-0.6B-shaped BF16 model into rolloutd over shared memory.

    python3 scripts/bench_weight_sync.py [--bin build/rolloutd] [--quantizations bf16/bf16,fp8] [--sync-threads 2]

Writes the preset model (`make-default-model --preset qwen3-0.6b`, 1.19 GB BF16, 310 tensors) unless
--model-dir is given, loads it into memory (disk reads are not timed), starts the daemon once per
--quantizations entry and pushes the model --repeat times with fresh segments, then --repeat times
with kept ones (rolloutd_client.Client.push_weights keep_segments=True, what a trainer pushing every
step uses). Each push is end to end: packing into the segments, every POST, validation, conversion
(requantization to FP8 blocks with --quantization fp8), the commit and, with an FP8 KV cache in the
default per-head mode, the KV recalibration (a prefill of the fixed calibration set that holds
generation); the answer to the last POST ends it. `--kv-scale-mode dynamic` scales each token as it
is written, so its updates recalibrate nothing. In the same run it times a plain copy of the same
number of bytes (numpy copyto between two pre-faulted buffers: the memcpy rate of this machine) right
before every push, since a VM's memory bandwidth drifts between phases of a run, and reports push
rate / that memcpy rate (target: >= 0.5x). Prints a markdown table, then per daemon the median and range over
its steady pushes (kept segments, after the first, which allocates them). --client-fp8 adds a push
quantized by the client (E4M3 codes + _scale_inv, half the bytes) into the fp8 daemons. --stub
replaces the daemon with an HTTP stub that answers at once (client-side cost only). --checksums both
(the default) alternates kept-segment pushes with and without the per-tensor CRC-32C in the manifest
(the client's default is with), so both are measured against the same daemon in the same run.
"""
import argparse
import http.server
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import requests

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python"))
from rolloutd_client import Client  # noqa: E402
from rolloutd_client.safetensors import load_file  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Memcpy:
    """Two pre-faulted buffers of nbytes; rate() is the best-of-`repeat` GB/s of one np.copyto."""

    def __init__(self, nbytes):
        self.src = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        np.copyto(self.dst, self.src)  # faults dst in

    def rate(self, repeat=2):
        return self.src.nbytes / min(_timed(lambda: np.copyto(self.dst, self.src)) for _ in range(repeat)) / 1e9


def memcpy_rate(nbytes, repeat=3):
    """Best-of-`repeat` GB/s of one copy of nbytes between pre-faulted buffers, and of a copy into
    freshly allocated (not yet faulted) memory."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    del dst
    fresh = min(_timed(lambda: np.copyto(np.empty(nbytes, dtype=np.uint8), src)) for _ in range(repeat))
    return nbytes / best / 1e9, nbytes / fresh / 1e9


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class _Stub(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps({"success": True, "message": "stub", "weight_version": body.get("weight_version"),
                          "bytes": 0, "seconds": 0.0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        out = json.dumps({"weight_version": "stub", "status": "ok"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


class Daemon:
    """A daemon started and waited for (/health 200, polled every poll_s); startup_s is how long
    that took. model_dir None serves the embedded default model."""

    def __init__(self, binary, model_dir, args, log_path, poll_s=0.2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        self.log_path = log_path
        cmd = [binary, "--host", "127.0.0.1", "--port", str(self.port), *args]
        if model_dir is not None:
            cmd += ["--model", str(model_dir)]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rolloutd exited with {self.proc.returncode}:\n{pathlib.Path(log_path).read_text()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(poll_s)
        else:
            self.stop()
            raise RuntimeError("rolloutd did not become healthy")
        self.startup_s = time.perf_counter() - t0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def load_model(model_dir):
    """name -> (numpy uint16 array, "bfloat16", shape): the checkpoint copied into memory."""
    sd = {}
    for k, v in load_file(pathlib.Path(model_dir) / "model.safetensors", raw=True).items():
        mv, dt, shape = v
        bits = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "float8_e4m3fn": np.uint8}[dt]
        sd[k] = (np.array(np.frombuffer(mv, dtype=bits)), dt, shape)
    return sd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.environ.get("ROLLOUTD_BIN", str(ROOT / "build" / "rolloutd")))
    ap.add_argument("--make-model", default=None, help="make-default-model binary (default: next to --bin)")
    ap.add_argument("--model-dir", default=None, help="an existing BF16 model directory (default: write the preset)")
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--quantizations", default="bf16/bf16,fp8/bf16,fp8/fp8/dynamic,fp8,bf16",
                    help="daemon configs, comma-separated QUANT[/KV_DTYPE[/KV_SCALE_MODE]] (KV default: the "
                         "daemon's, fp8 with per-head scales recalibrated on every update; 'dynamic' scales "
                         "each token as it is written, so an update recalibrates nothing)")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="daemon --threads (0 = all cores)")
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--client-fp8", action="store_true", help="also push client-quantized FP8 into the fp8 daemon")
    ap.add_argument("--stub", action="store_true", help="push to an HTTP stub instead of rolloutd")
    ap.add_argument("--sync-threads", type=int, default=0,
                    help="daemon --weight-sync-threads (0 = the daemon's default, every core)")
    ap.add_argument("--daemon-args", default="", help="extra daemon flags")
    ap.add_argument("--checksums", choices=["both", "on", "off"], default="both",
                    help="per-tensor CRC-32C in the manifest for the kept-segment pushes: both (alternating, "
                         "same daemon), on (the client's default) or off")
    args = ap.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    try:
        model_dir = args.model_dir
        if model_dir is None:
            mk = args.make_model or str(pathlib.Path(args.bin).parent / "make-default-model")
            model_dir = tmp / "model"
            t = time.perf_counter()
            subprocess.run([mk, "--preset", args.preset, "--out", str(model_dir)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"wrote preset {args.preset} to {model_dir} in {time.perf_counter() - t:.1f} s", flush=True)
        t = time.perf_counter()
        sd = load_model(model_dir)
        total = sum(v[0].nbytes for v in sd.values())
        print(f"loaded {len(sd)} tensors, {total / 1e9:.3f} GB into memory in {time.perf_counter() - t:.1f} s", flush=True)
        mc, mc_fresh = memcpy_rate(total)
        print(f"memcpy of {total / 1e9:.3f} GB: {mc:.2f} GB/s (into fresh pages {mc_fresh:.2f} GB/s)", flush=True)
        memcpy = Memcpy(total)

        rows = []
        bucket = args.bucket_mb << 20
        for q in [x for x in args.quantizations.split(",") if x]:
            quant, _, kv = q.partition("/")
            kv, _, kv_mode = kv.partition("/")
            srv = daemon = None
            if args.stub:
                srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
                threading.Thread(target=srv.serve_forever, daemon=True).start()
                url, startup = f"http://127.0.0.1:{srv.server_address[1]}", 0.0
            else:
                dargs = ["--quantization", quant, "--threads", str(args.threads), "--kv-cache-mb", str(args.kv_cache_mb),
                         *(["--kv-cache-dtype", kv] if kv else []), *(["--kv-scale-mode", kv_mode] if kv_mode else []),
                         *(["--weight-sync-threads", str(args.sync_threads)] if args.sync_threads else []),
                         *args.daemon_args.split()]
                daemon = Daemon(args.bin, model_dir, dargs, tmp / f"rolloutd-{q.replace('/', '-')}.log")
                url, startup = daemon.url, daemon.startup_s
                print(f"[{q}] daemon healthy after {startup:.1f} s", flush=True)
            try:
                c = Client(url, timeout=1800)
                # fresh segments every push (the default), then segments kept between pushes (the
                # first of those allocates them)
                crcs = {"both": [True, False], "on": [True], "off": [False]}[args.checksums]
                tag = {True: ", crc", False: ", no crc"} if len(crcs) > 1 else {True: "", False: ", no crc"}
                pushes = [("bf16" + tag[crcs[0]], False, False, crcs[0])] * args.repeat
                for r in range(args.repeat):  # alternating, so drift between phases hits both alike
                    pushes += [("bf16, kept segs" + tag[crc], False, True, crc) for crc in (crcs if r % 2 == 0 else crcs[::-1])]
                if args.client_fp8 and quant == "fp8":
                    pushes += [("client fp8, kept segs" + tag[crcs[0]], True, True, crcs[0])] * args.repeat
                for i, (kind, fp8, keep, crc) in enumerate(pushes):
                    v = f"bench-{q.replace('/', '-')}-{i}"
                    mc_now = memcpy.rate()
                    res = c.push_weights(sd, version=v, bucket_bytes=bucket, fp8=fp8, keep_segments=keep, checksums=crc)
                    assert res.response.get("weight_version") == v, res.response
                    if not args.stub:
                        assert c.get_weight_version() == v
                        (o,) = c.generate([1, 2, 3, 4], max_new_tokens=2, temperature=0)
                        assert o.weight_version == v and len(o.output_ids) == 2
                    print(f"[{q}] push {i} ({kind}): {res.seconds:.3f} s, {res.gb_per_s:.2f} GB/s, "
                          f"{res.posts} POSTs, server {res.server_seconds:.3f} s (memcpy {mc_now:.2f} GB/s): "
                          f"{res.response.get('message')}", flush=True)
                    rows.append((q, kind, i, res, mc_now))
            finally:
                c.close()
                if daemon is not None:
                    rc = daemon.stop()
                    if rc != 0:
                        print(f"[{q}] rolloutd exited with {rc}; log {daemon.log_path}", flush=True)
                if srv is not None:
                    srv.shutdown()
                    srv.server_close()

        print()
        what = f"preset {args.preset}" if args.model_dir is None else f"model {args.model_dir}"
        print(f"Weight sync over shm, {what} ({len(sd)} tensors, {total / 1e9:.3f} GB BF16), "
              f"bucket {args.bucket_mb} MiB, {os.cpu_count()} CPUs{', STUB server' if args.stub else ''}; "
              f"memcpy {mc:.2f} GB/s (pre-faulted), {mc_fresh:.2f} GB/s (fresh pages) at the start")
        print()
        print("| daemon --quantization[/--kv-cache-dtype[/--kv-scale-mode]] | push | # | bytes sent | POSTs | "
              "end-to-end s | GB/s | server s | generation held s | memcpy GB/s | vs memcpy |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        steady = {}
        for q, kind, i, res, mc_now in rows:
            # the rate is over the BF16 model size for every row, so client-side FP8 (half the bytes
            # on the wire) is compared with the same amount of model
            rate = total / res.seconds / 1e9
            held = re.search(r"generation held ([0-9.]+) s", str(res.response.get("message")))
            print(f"| {q} | {kind} | {i} | {res.bytes / 1e9:.3f} GB | {res.posts} | {res.seconds:.3f} | "
                  f"{rate:.2f} | {res.server_seconds:.3f} | {held.group(1) if held else '-'} | {mc_now:.2f} | "
                  f"{rate / mc_now:.2f}x |")
            # the first kept push of a daemon allocates the segments: not steady
            if "kept" in kind and any("kept" in k for qq, k, ii, _, _ in rows if qq == q and ii < i):
                steady.setdefault((q, kind), []).append((rate / mc_now, res.seconds))
        print()
        print("| daemon | push | steady pushes | end-to-end s (median) | vs memcpy: median | min | max |")
        print("|---|---|---|---|---|---|---|")
        for (q, kind), v in steady.items():
            if not v:
                continue
            ratios = sorted(x[0] for x in v)
            print(f"| {q} | {kind} | {len(v)} | {statistics.median(x[1] for x in v):.3f} | "
                  f"{statistics.median(ratios):.2f}x | {ratios[0]:.2f}x | {ratios[-1]:.2f}x |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
