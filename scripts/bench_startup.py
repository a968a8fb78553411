#!/usr/bin/env python3
"""Start-up benchmark: how long a daemon takes from exec to a 200 from /health, against its KV pool.

    python3 scripts/bench_startup.py [--bin build/rolloutd] [--kv-mb 1,1024,8192] [--repeat 5]
                                     [--args "--threads 2"] [--model-dir DIR]

Starts the daemon (the embedded default model unless --model-dir) once per --kv-mb value per
round, the values alternated round by round so that the machine's drift hits each alike, and
measures for each start: the wall seconds until /health answers 200 (polled every 10 ms), the
daemon's CPU seconds by then (user + system, /proc/PID/stat) and its resident memory (VmRSS). Each
daemon is stopped with SIGTERM before the next starts. Prints every start, then per pool size the
min / median / max seconds to ready, the median CPU seconds and RSS, and the ratio of the median
to the first pool size's (the baseline: the smallest pool). On the CPU backend the pool is mapped,
not written, at start, so the ratio should stay near 1.0 whatever the pool's size.
"""
import argparse
import os
import pathlib
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def start_once(binary, kv_mb, extra, model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--kv-cache-mb", str(kv_mb)] + extra
    if model_dir:
        cmd += ["--model", model_dir]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not healthy(url):
            if proc.poll() is not None:
                raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}")
            if time.perf_counter() - t0 > 300:
                raise SystemExit(f"{' '.join(cmd)} not ready after 300 s")
            time.sleep(0.01)
        ready = time.perf_counter() - t0
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        with open(f"/proc/{proc.pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return ready, cpu, rss


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "build" / "rolloutd"))
    ap.add_argument("--kv-mb", default="1,1024,8192", help="pool sizes in MiB, the first is the baseline")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--args", default="--threads 2", help="more daemon flags")
    ap.add_argument("--model-dir", default=None)
    a = ap.parse_args()
    sizes = [int(x) for x in a.kv_mb.split(",")]
    extra = shlex.split(a.args)
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs; {a.bin} {' '.join(extra)}; "
          f"model {a.model_dir or 'the embedded default'}; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    runs = {s: [] for s in sizes}
    for r in range(a.repeat):
        order = sizes if r % 2 == 0 else sizes[::-1]
        for s in order:
            ready, cpu, rss = start_once(a.bin, s, extra, a.model_dir)
            runs[s].append((ready, cpu, rss))
            print(f"round {r + 1} kv {s:>6} MiB: ready {ready:.3f} s, cpu {cpu:.2f} s, rss {rss:.0f} MiB", flush=True)
    base = statistics.median(x[0] for x in runs[sizes[0]])
    print(f"{'kv MiB':>8} {'ready s min / median / max':>28} {'cpu s':>7} {'rss MiB':>8} {'x baseline':>10}")
    for s in sizes:
        ready = [x[0] for x in runs[s]]
        med = statistics.median(ready)
        print(f"{s:>8} {min(ready):>10.3f} / {med:.3f} / {max(ready):.3f} "
              f"{statistics.median(x[1] for x in runs[s]):>7.2f} {statistics.median(x[2] for x in runs[s]):>8.0f} "
              f"{med / base:>10.2f}")


if __name__ == "__main__":
    main()
