"""Starting and stopping rolloutd for a run.

PRECISIONS are the rollout configurations the runs compare:
  bf16: BF16 weights, fp32 KV pages: the daemon computes in fp32 on BF16 weights, exactly what the
        trainer computes, so rollout and trainer logprobs agree to fp32 rounding;
  fp8:  FP8 W8A8 (128x128 weight blocks, 1x128 dynamic activation groups) and FP8 KV pages with
        per-head scales recalibrated after every weight update: the daemon's defaults, the
        FP8-RL recipe.
The binary is $ROLLOUTD_BIN or build/rolloutd under the repository root.
"""
import os
import pathlib
import signal
import socket
import subprocess
import time

import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("ROLLOUTD_BIN", str(ROOT / "build" / "rolloutd"))
FP8_MISMATCH = str(pathlib.Path(BIN).with_name("fp8-mismatch"))

PRECISIONS = {
    "bf16": ["--quantization", "bf16", "--kv-cache-dtype", "f32"],
    "fp8": ["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--kv-scale-mode", "calibrate"],
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rolloutd:
    """One daemon serving model_dir at `precision` on a free loopback port; stop() ends it with
    SIGTERM and raises if it did not exit 0."""

    def __init__(self, model_dir, precision, log_path, threads=2, kv_cache_mb=256, max_running=512,
                 version="0", extra=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [BIN, "--host", "127.0.0.1", "--port", str(self.port), "--model", str(model_dir),
                    "--threads", str(threads), "--kv-cache-mb", str(kv_cache_mb), "--max-running",
                    str(max_running), "--weight-version", version, *PRECISIONS[precision], *extra]
        self.log_path = pathlib.Path(log_path)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rolloutd exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        self.proc.kill()
        raise RuntimeError(f"rolloutd did not become healthy in 120 s:\n{self.tail()}")

    def tail(self, n=4000):
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.proc.returncode != 0:
            raise RuntimeError(f"rolloutd exited with {self.proc.returncode}:\n{self.tail()}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def fp8_mismatch(model_dir, prompts, prompt_len, gen, seed, threads=2):
    """Runs build/fp8-mismatch on a model directory and returns its table row as a dict: tokens,
    mean_abs, max_abs, kl (mean KL(bf16 || fp8)), share_gt2, share_lt_half (ratio pi_bf16/pi_fp8
    above 2 / below 1/2)."""
    out = subprocess.run([FP8_MISMATCH, "--model", str(model_dir), "--prompts", str(prompts), "--prompt-len",
                          str(prompt_len), "--gen", str(gen), "--seed", str(seed), "--threads", str(threads)],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    row = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()][-1]
    cells = [c.strip().rstrip("%") for c in row.strip("|").split("|")]
    return {"tokens": int(cells[0]), "mean_abs": float(cells[1]), "max_abs": float(cells[2]), "kl": float(cells[3]),
            "share_gt2": float(cells[4]) / 100, "share_lt_half": float(cells[5]) / 100}
