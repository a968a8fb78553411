#!/usr/bin/env python3
"""The RL workload over HTTP against the walking skeleton itself, built from git history.

    make && python3 scripts/bench_skeleton.py [--bin build/rolloutd] [--skeleton-rev 9d6eeda]
                                      [--prompts 64] [--n 8] [--prompt-len 128] [--gen 256]

Issue 4 asks for the engine's tokens/s "against the walking skeleton's loop on the same workload".
`build/rl-bench` approximates that loop with today's engine in the skeleton's configuration, which
inherits every later kernel and scheduler improvement. This script measures the real thing: it
checks out --skeleton-rev (default 9d6eeda, the last commit before the continuous-batching scheduler:
the skeleton's engine with its batched forward pass, the threaded AVX-512 kernels and the HTTP
server) into a temporary directory, builds its daemon, and runs one GRPO step through each
daemon over HTTP: --prompts concurrent /generate requests of --n samples each, --prompt-len
random prompt tokens, --gen new tokens at T = 1 (ignore_eos). Both daemons serve the same model
directory (the embedded default model's preset, written by build/make-default-model) with BF16
weights, 2 threads, --max-running = prompts x n and a KV budget that holds everything; the engine
keeps its own defaults otherwise (FP8 KV, prefix cache). Prints a markdown table and the ratio.
"""
import argparse
import concurrent.futures as cf
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import requests

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_skeleton(rev, where):
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(["make", "-j", str(os.cpu_count() or 2), "build/rolloutd"], cwd=where, check=True,
                   stdout=subprocess.DEVNULL)
    return where / "build" / "rolloutd"


def serve(binary, model, args, log):
    port = free_port()
    cmd = [str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{binary} did not become healthy (log: {log.name})")


def run_step(url, prompts, n, gen):
    """One GRPO step: every prompt's request at once; returns (seconds, output tokens)."""
    def one(ids):
        r = requests.post(url + "/generate", json={
            "input_ids": ids, "sampling_params": {"n": n, "max_new_tokens": gen, "temperature": 1.0,
                                                  "ignore_eos": True}}, timeout=3600)
        r.raise_for_status()
        outs = r.json()
        outs = outs if isinstance(outs, list) else [outs]
        return sum(len(o["output_ids"]) for o in outs)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=len(prompts)) as ex:
        tokens = sum(ex.map(one, prompts))
    return time.perf_counter() - t0, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "build" / "rolloutd"))
    ap.add_argument("--skeleton-rev", default="9d6eeda")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="rolloutd-skeleton-"))
    model = tmp / "model"
    subprocess.run([str(ROOT / "build" / "make-default-model"), "--out", str(model)], check=True,
                   stdout=subprocess.DEVNULL)
    rng = random.Random(0)
    vocab = 8192
    prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    seqs = a.prompts * a.n
    common = ["--quantization", "bf16", "--threads", str(a.threads), "--max-running", str(seqs),
              "--kv-cache-mb", "3200", "--max-context", str(a.prompt_len + a.gen + 16)]
    rows = []
    try:
        skel_bin = build_skeleton(a.skeleton_rev, tmp / "skeleton")
        for label, binary in (("engine (this tree)", pathlib.Path(a.bin)),
                              (f"walking skeleton ({a.skeleton_rev})", skel_bin)):
            with open(tmp / f"{label.split()[0]}.log", "w") as log:
                proc, url = serve(binary, model, common, log)
                try:
                    secs, tokens = run_step(url, prompts, a.n, a.gen)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
            assert tokens == seqs * a.gen, (label, tokens)
            rows.append((label, secs, tokens / secs))
            print(f"{label}: {tokens} tokens in {secs:.1f} s, {tokens / secs:.1f} tok/s", file=sys.stderr)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "skeleton")],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nOne GRPO step over HTTP: {a.prompts} prompts x n={a.n}, prompt {a.prompt_len}, {a.gen} new tokens, "
          f"T=1, default model (BF16 weights), {a.threads} threads\n")
    print("| daemon | seconds | output tokens/s |")
    print("|---|---|---|")
    for label, secs, tps in rows:
        print(f"| {label} | {secs:.1f} | {tps:.1f} |")
    print(f"\nengine vs walking skeleton: {rows[0][2] / rows[1][2]:.2f}x output tokens/s")


if __name__ == "__main__":
    main()
