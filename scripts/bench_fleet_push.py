#!/usr/bin/env python3
"""Fleet push benchmark: one shm weight push to N same-host daemons against the same push to one.

    python3 scripts/bench_fleet_push.py [--daemons 3] [--repeat 5] [--preset default|qwen3-0.6b]

Starts N daemons on one BF16 model (the preset written by make-default-model unless --model-dir is
given; same flags for all), loads the model into memory (disk reads are not timed) and, in one
run, alternates rolloutd_client.Fleet([daemon 0]).push_weights with Fleet(all N).push_weights, so
that the machine's drift hits both alike; with --client, Client(daemon 0).push_weights (one
daemon, no fleet transaction) joins the rotation. Every push is end to end: packing each bucket
once into the kept segments, every daemon reading and converting it (requantizing to FP8 blocks
with the default --quantization fp8), the check, and the commit of every daemon (with the default
FP8 KV cache, the KV recalibration). The first push of each kind allocates segments and staging
and is not counted. Prints each push, then per kind the min / median / max seconds, the median
GB/s (model bytes / seconds), the CPU seconds of this process and of the daemons (user + system,
from getrusage and /proc/PID/stat) per push, and the ratio of the N-daemon push to the one-daemon
push (target: <= 1.3 with a core or more per daemon; a machine with fewer cores than daemons
converts N copies on the same cores). --fp8 quantizes on the client, once per push: the daemons
then copy E4M3 codes and scales instead of each requantizing the BF16 model.
"""
import argparse
import os
import pathlib
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_weight_sync import Daemon, load_model  # noqa: E402
from rolloutd_client import Client, Fleet  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid):
    """User + system CPU seconds of process pid so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def self_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.environ.get("ROLLOUTD_BIN", str(ROOT / "build" / "rolloutd")))
    ap.add_argument("--make-model", default=None, help="make-default-model binary (default: next to --bin)")
    ap.add_argument("--model-dir", default=None, help="an existing BF16 model directory (default: write the preset)")
    ap.add_argument("--preset", default="default", help="make-default-model preset: default (58 MB) or qwen3-0.6b")
    ap.add_argument("--daemons", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5, help="timed pushes of each kind")
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="each daemon's --threads")
    ap.add_argument("--kv-cache-mb", type=int, default=64)
    ap.add_argument("--daemon-args", default="", help="extra flags for every daemon")
    ap.add_argument("--client", action="store_true", help="also time Client.push_weights into one daemon")
    ap.add_argument("--fp8", action="store_true",
                    help="quantize on the client (push_weights fp8=True: once per push, whatever the number of "
                         "daemons, which then copy E4M3 codes and scales instead of requantizing BF16)")
    args = ap.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-fleet-push-"))
    daemons, fleets = [], []
    try:
        model_dir = args.model_dir
        if model_dir is None:
            mk = args.make_model or str(pathlib.Path(args.bin).parent / "make-default-model")
            model_dir = tmp / "model"
            subprocess.run([mk, "--preset", args.preset, "--out", str(model_dir)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sd = load_model(model_dir)
        total = sum(v[0].nbytes for v in sd.values())
        dargs = ["--threads", str(args.threads), "--kv-cache-mb", str(args.kv_cache_mb), *args.daemon_args.split()]
        for i in range(args.daemons):
            daemons.append(Daemon(args.bin, model_dir, dargs, tmp / f"rolloutd-{i}.log"))
        one, all_ = Fleet([daemons[0].url], timeout=1800), Fleet([d.url for d in daemons], timeout=1800)
        single = Client(daemons[0].url, timeout=1800)
        fleets += [one, all_]
        kinds = [("fleet of 1", one.push_weights), (f"fleet of {args.daemons}", all_.push_weights)]
        if args.client:
            kinds.append(("Client, 1 daemon", single.push_weights))
        print(f"{len(sd)} tensors, {total / 1e9:.3f} GB BF16 ({model_dir}){', quantized by the client' if args.fp8 else ''}, "
              f"bucket {args.bucket_mb} MiB, "
              f"{args.daemons} daemons with {' '.join(dargs)}; {os.cpu_count()} CPUs ({cpu_model()}), "
              f"load average {os.getloadavg()[0]:.1f} at the start", flush=True)
        rows = {k: [] for k, _ in kinds}
        for r in range(args.repeat + 1):  # round 0 warms up (segments, staging)
            order = kinds if r % 2 == 0 else kinds[::-1]
            for name, push in order:
                pids = [d.proc.pid for d in daemons]
                c0, d0 = self_cpu(), sum(proc_cpu(p) for p in pids)
                t0 = time.perf_counter()
                res = push(sd, version=f"bench-{r}-{name.replace(' ', '-')}", bucket_bytes=args.bucket_mb << 20,
                           fp8=args.fp8)
                secs = time.perf_counter() - t0
                cpu_c, cpu_d = self_cpu() - c0, sum(proc_cpu(p) for p in pids) - d0
                assert res.weight_version, res
                print(f"round {r}{' (warm-up)' if r == 0 else ''} | {name}: {secs:.3f} s, "
                      f"{total / secs / 1e9:.2f} GB/s, client CPU {cpu_c:.2f} s, daemons CPU {cpu_d:.2f} s", flush=True)
                if r:
                    rows[name].append((secs, cpu_c, cpu_d))
        print()
        print("| push | pushes | min s | median s | max s | median GB/s | client CPU s | daemons CPU s |")
        print("|---|---|---|---|---|---|---|---|")
        med = {}
        for name, v in rows.items():
            s = sorted(x[0] for x in v)
            med[name] = (statistics.median(s), s[0])
            print(f"| {name} | {len(v)} | {s[0]:.3f} | {med[name][0]:.3f} | {s[-1]:.3f} | "
                  f"{total / med[name][0] / 1e9:.2f} | {statistics.median(x[1] for x in v):.2f} | "
                  f"{statistics.median(x[2] for x in v):.2f} |")
        a, b = med["fleet of 1"], med[f"fleet of {args.daemons}"]
        print()
        print(f"ratio, fleet of {args.daemons} / fleet of 1: median {b[0] / a[0]:.2f}x, min {b[1] / a[1]:.2f}x "
              f"(load average {os.getloadavg()[0]:.1f} at the end)")
    finally:
        for f in fleets:
            f.close()
        for d in daemons:
            rc = d.stop()
            if rc != 0:
                print(f"rolloutd exited with {rc}; log {d.log_path}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
