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
import shlex
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_fleet_push import cpu_model, proc_cpu  # noqa: E402
from bench_weight_sync import Daemon  # noqa: E402


def start_once(binary, kv_mb, extra, model_dir, log_path):
    """(seconds to ready, daemon CPU seconds by then, VmRSS MiB then) of one start; stops it."""
    d = Daemon(binary, model_dir, ["--kv-cache-mb", str(kv_mb), *extra], log_path, poll_s=0.01)
    try:
        cpu = proc_cpu(d.proc.pid)
        with open(f"/proc/{d.proc.pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    finally:
        d.stop()
    return d.startup_s, cpu, rss


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
    log = pathlib.Path(tempfile.mkdtemp(prefix="rolloutd-startup-")) / "rolloutd.log"
    for r in range(a.repeat):
        order = sizes if r % 2 == 0 else sizes[::-1]
        for s in order:
            ready, cpu, rss = start_once(a.bin, s, extra, a.model_dir, log)
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
