#!/usr/bin/env python3
"""rolloutd against llama.cpp on the same random-weight Qwen3-0.6B-shaped model, side by side.

    scripts/bench_vs_llamacpp.py [--isa native|avx2] [--rounds 3] [--threads 2] [--only decode,prefill,rl]

Everything it downloads and builds lives under build-llamacpp/ (git ignores /build*/; nothing of
llama.cpp is ever committed). Steps, each skipped when its output is already there:

 1. llama.cpp: the llama-cpp-python sdist from PyPI (`pip download --no-deps --no-binary :all:
    llama-cpp-python==VERSION`), its vendor/llama.cpp built with cmake (llama-bench, llama-server,
    llama-quantize). --isa native builds with GGML_NATIVE (AVX-512 where the CPU has it); --isa avx2
    builds for AVX2 + FMA + F16C only (GGML_NATIVE=OFF, AVX-512 off) and runs rolloutd with
    --cpu-kernels avx2: the class of AVX2-only CPUs, on whatever CPU runs the script.
 2. the model: Qwen3-0.6B's shapes (28 layers, hidden 1024, vocab 151936, tied embeddings) with
    random weights from transformers' Qwen3ForCausalLM init (/opt/torchvenv or any python with
    torch + transformers; --model-source preset uses rolloutd's own random-weight writer), saved as
    BF16 safetensors, and written to GGUF with the sdist's gguf-py. There is no model hub: the GGUF
    gets a synthetic byte-level BPE vocabulary of the model's size, and both systems are given
    token ids, never text.
 3. llama-quantize to Q8_0 twice: llama.cpp's default (Q8_0 embeddings and output) and with
    --output-tensor-type bf16 --token-embedding-type bf16, the bytes per token of rolloutd's FP8
    policy (8-bit linears, BF16 embedding and lm_head).
 4. ROUNDS rounds; in each, every system runs every measurement once, alternating, with the same
    threads:
      decode   llama-bench -p 0 -n 128 (tg128)  vs  rollout-bench --batches 1 --gen 128 --prompt 1
      prefill  llama-bench -p 512 -n 0 (pp512)  vs  rollout-bench --prefill 512 (one unchunked pass)
      rl       64 concurrent requests (16 prompts x 4 samples, PROMPT random tokens, 128 new tokens,
               ignore_eos, temperature 1) to llama-server -np 64 (continuous batching) vs 16
               concurrent /generate requests with n = 4 to rolloutd (whose scheduler prefills each
               prompt once for its 4 samples; llama-server prefills it 4 times)
    rolloutd runs with --kv-cache-dtype bf16 (the bytes of llama.cpp's default f16 KV cache).
    Where llama.cpp crashes with its default extra weight buffers (AMX on Xeons with AMX-INT8:
    prompt processing of Q8_0 segfaults there), that model's measurement reruns, and from then on
    runs, with --repack 0 (llama-server --no-repack), which the output and the JSON say.
 5. prints min / median / max tokens/s per system and each rolloutd/llama.cpp ratio of medians, the
    servers' user+system CPU seconds for the RL workload, and the load average around each run
    (the machine may be shared: rerun on a quiet one for figures to quote). Results also go to
    build-llamacpp/results-ISA-DATE.json.

Pairs compared: rolloutd FP8 vs llama.cpp Q8_0 with BF16 embedding/output (same bytes per token) and
vs default Q8_0 (fewer bytes); rolloutd BF16 vs llama.cpp BF16. rolloutd runs its default (exact)
numerics; with --isa native on a CPU with AVX512_BF16 two more systems run --numerics fast, whose BF16
matmuls round their activations to BF16 and sum on vdpbf16ps (AMX tiles where the CPU has AMX-BF16)
as llama.cpp's BF16 path does there ("rolloutd bf16 fast" against llama.cpp BF16 is the same
arithmetic; "rolloutd fp8 fast" changes the BF16 lm_head so, and on AMX CPUs also takes the FP8
block sums in fp32 on AMX tiles). --systems picks a subset by name.

Needs cmake, a C/C++ compiler, and numpy, pyyaml, requests, tqdm in the python that runs it (the
sdist's gguf-py imports them); torch + transformers in /opt/torchvenv, $TORCH_PYTHON or that python
(else --model-source preset). A first run downloads ~77 MB and builds for tens of minutes.
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tarfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 151936, 1024, 3072, 28, 16, 8, 128
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": HIDDEN,
    "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "attention_bias": False, "bos_token_id": 151643, "eos_token_id": [151645, 151643],
}


def log(*a):
    print(*a, flush=True)


def run(cmd, **kw):
    log("  $", " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# ---------------------------------------------------------------- 1. llama.cpp

def fetch_llamacpp(work, version):
    src = work / f"llama.cpp-{version}"
    if (src / "CMakeLists.txt").is_file():
        return src
    sdist = work / "sdist"
    sdist.mkdir(parents=True, exist_ok=True)
    tgz = sdist / f"llama_cpp_python-{version}.tar.gz"
    if not tgz.is_file():  # pip prepares the sdist's metadata too: a few minutes
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", sdist])
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    tmp = work / "extract.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(tgz) as t:
        members = [m for m in t.getmembers() if m.name.startswith(prefix)]
        try:
            t.extractall(tmp, members=members, filter="data")
        except TypeError:  # Python without extraction filters
            t.extractall(tmp, members=members)
    shutil.move(str(tmp / prefix), str(src))
    shutil.rmtree(tmp)
    return src


def build_llamacpp(work, src, isa, jobs, targets):
    """Builds the llama.cpp programs in `targets` that are not built yet."""
    out = work / f"build-{isa}"
    bins = {t: out / "bin" / t for t in targets}
    if all(b.is_file() for b in bins.values()):
        return bins
    flags = ["-DGGML_NATIVE=ON"] if isa == "native" else [
        "-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
        "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"]
    run(["cmake", "-S", src, "-B", out, "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
         "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *flags],
        stdout=subprocess.DEVNULL)
    run(["cmake", "--build", out, "-j", str(jobs), "--target", *bins])
    return bins


# ---------------------------------------------------------------- 2. the model

TRANSFORMERS_INIT = """
import sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size={VOCAB}, hidden_size={HIDDEN}, intermediate_size={INTER}, num_hidden_layers={LAYERS},
                  num_attention_heads={HEADS}, num_key_value_heads={KV_HEADS}, head_dim={HEAD_DIM},
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151645)
Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1], safe_serialization=True)
"""


def torch_python():
    for py in (os.environ.get("TORCH_PYTHON"), "/opt/torchvenv/bin/python", sys.executable):
        if py and subprocess.run([py, "-c", "import torch, transformers"], capture_output=True).returncode == 0:
            return py
    return None


def make_model(work, source, build):
    d = work / f"qwen3-0.6b-random-{source}"
    if (d / "model.safetensors").is_file():
        return d
    tmp = work / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if source == "transformers":
        py = torch_python()
        if not py:
            sys.exit("no python with torch + transformers (set TORCH_PYTHON, or use --model-source preset)")
        run([py, "-c", TRANSFORMERS_INIT.format(**globals()), tmp])
        shards = sorted(tmp.glob("*.safetensors"))
        if len(shards) != 1:
            sys.exit(f"expected one safetensors file in {tmp}, got {shards}")
        shards[0].rename(tmp / "model.safetensors")
    else:  # rolloutd's own random-weight writer, through rollout-bench's preset
        run([build / "rollout-bench", "--preset", "qwen3-0.6b", "--batches", "1", "--gen", "2", "--prompt", "1",
             "--no-bandwidth"], stdout=subprocess.DEVNULL)
        preset = pathlib.Path(f"/tmp/rolloutd-bench-qwen3-0.6b-{os.getuid()}")
        tmp.mkdir()
        shutil.copy(preset / "model.safetensors", tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(QWEN3_CONFIG, indent=1))  # one config both readers parse
    tmp.rename(d)
    return d


def read_safetensors(path):
    """{name: (dtype, shape, numpy array view)} of a safetensors file (no safetensors package)."""
    import numpy as np
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    n = struct.unpack("<Q", raw[:8].tobytes())[0]
    header = json.loads(raw[8:8 + n].tobytes())
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[info["dtype"]]
        out[name] = (info["dtype"], info["shape"], raw[8 + n + a:8 + n + b].view(dt).reshape(info["shape"]))
    return out


def synthetic_vocab():
    """A byte-level BPE vocabulary of VOCAB tokens (the 256 byte symbols of GPT-2's byte encoder, all
    their pairs, then triples), with one merge per multi-symbol token and Qwen's special tokens at the
    top; enough for llama.cpp to load and detokenize what it samples."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    sym = [chr(c) for c in cs]
    n_regular = 151643
    tokens, merges = list(sym), []
    for a in sym:
        for b in sym:
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    i = 0
    while len(tokens) < n_regular:
        pair = tokens[256 + i // 256]
        tokens.append(pair + sym[i % 256])
        merges.append(f"{pair} {sym[i % 256]}")
        i += 1
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    specials += [f"<|reserved_{i}|>" for i in range(VOCAB - n_regular - len(specials))]
    types = [1] * n_regular + [3] * len(specials)  # NORMAL, CONTROL
    return tokens + specials, types, merges


def write_gguf(model_dir, out, src):
    if out.is_file():
        return out
    sys.path.insert(0, str(src / "gguf-py"))
    import gguf
    import numpy as np
    t = read_safetensors(model_dir / "model.safetensors")
    w = gguf.GGUFWriter(str(out) + ".tmp", "qwen3")
    w.add_block_count(LAYERS)
    w.add_context_length(40960)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    tokens, types, merges = synthetic_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(151643)
    w.add_eos_token_id(151645)
    w.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, LAYERS)
    for name, (dtype, shape, arr) in sorted(t.items()):
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            sys.exit(f"no GGUF name for {name}")
        if len(shape) == 1:  # norms in F32, as convert_hf_to_gguf.py writes them
            f32 = (arr.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else arr.astype(np.float32)
            w.add_tensor(gname, np.ascontiguousarray(f32))
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.rename(str(out) + ".tmp", out)
    return out


def quantize(bins, bf16, out, extra):
    if not out.is_file():
        run([bins["llama-quantize"], *extra, bf16, str(out) + ".tmp", "Q8_0"], stdout=subprocess.DEVNULL)
        os.rename(str(out) + ".tmp", out)
    return out


# ---------------------------------------------------------------- 4. measurements

def loadavg():
    return os.getloadavg()[0]


# Measurements where llama.cpp's extra weight buffers (AMX tiles on CPUs with AMX-INT8, repacked
# layouts elsewhere) crashed and the figure is llama.cpp's plain CPU path (--repack 0, --no-repack).
# On a Xeon with AMX, llama.cpp 0.3.36's ggml_backend_amx_mul_mat segfaults on every batched Q8_0
# matmul (prompt processing; upstream llama.cpp issue 20824), while its batch-1 decode through the
# same buffers runs: so each measurement tries the default first.
NO_REPACK = set()
PROBED = set()


def llama_bench(bins, model, threads, p, n):
    cmd = [bins["llama-bench"], "-m", model, "-t", threads, "-p", p, "-n", n, "-r", "1", "-o", "json"]
    key = (pathlib.Path(model).name, "decode" if p == 0 else "prefill")
    if key not in NO_REPACK:
        log("  $", " ".join(str(c) for c in cmd))
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
        if r.returncode == 0:
            PROBED.add(key)
            return json.loads(r.stdout)[0]["avg_ts"]
        if r.returncode > 0:
            sys.exit(f"llama-bench failed ({r.returncode}):\n{r.stderr[-2000:]}")
        log(f"  llama-bench died of signal {-r.returncode} with its default weight buffers; "
            f"{key[0]} {key[1]} runs with --repack 0 from now on")
        NO_REPACK.add(key)
    r = run(cmd + ["--repack", "0"], capture_output=True, text=True)
    return json.loads(r.stdout)[0]["avg_ts"]


def rollout_bench(build, model, threads, what, kernels, args):
    quant, numerics = what
    r = run([build / "rollout-bench", "--model", model, "--threads", threads, "--quantization", quant,
             "--numerics", numerics, "--kv-cache-dtype", "bf16", "--cpu-kernels", kernels, "--no-bandwidth", *args],
            capture_output=True, text=True)
    if f"numerics {numerics}," not in r.stdout:
        sys.exit(f"rollout-bench did not run {numerics} numerics:\n{r.stdout}")
    return r.stdout


def rolloutd_decode(build, model, threads, what, kernels):
    out = rollout_bench(build, model, threads, what, kernels, ["--batches", "1", "--gen", "128", "--prompt", "1"])
    # rows: numerics batch decode ms/step tokens/s ...
    row = next(l.split()[1:] for l in out.splitlines() if l.split()[:3] in (["exact", "1", "127"], ["fast", "1", "127"]))
    return float(row[3])


def rolloutd_prefill(build, model, threads, what, kernels):
    out = rollout_bench(build, model, threads, what, kernels, ["--batches", "0", "--prefill", "512"])
    line = next(l for l in out.splitlines() if "prefill 512 tokens" in l)
    return float(line.split(":")[1].split()[0])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=3600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def cpu_seconds(pid):
    f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class Server:
    def __init__(self, cmd, url, log_path):
        self.url = url
        self.log = open(log_path, "wb")
        log("  $", " ".join(str(c) for c in cmd))
        self.proc = subprocess.Popen([str(c) for c in cmd], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"server exited ({self.proc.returncode}); see {log_path}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        sys.exit(f"server did not come up; see {log_path}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def rl_prompts(n_prompts, length):
    rng = random.Random(17)
    return [[rng.randrange(0, 151643) for _ in range(length)] for _ in range(n_prompts)]


def rl_llama(bins, model, threads, prompts, samples, new, work):
    port = free_port()
    ctx = len(prompts) * samples * (len(prompts[0]) + new + 16)
    # the server prefills in batches: the path that crashes where llama-bench's prefill does (a short
    # llama-bench prefill finds out, once per model, where no prefill was measured yet)
    key = (pathlib.Path(model).name, "prefill")
    if key not in NO_REPACK | PROBED:
        llama_bench(bins, model, threads, 64, 0)  # adds key to PROBED or NO_REPACK
    nr = ["--no-repack"] if key in NO_REPACK else []
    srv = Server([bins["llama-server"], "-m", model, "-t", threads, "-tb", threads, "-np", len(prompts) * samples,
                  "-c", ctx, "--host", "127.0.0.1", "--port", port, "--no-webui", *nr], f"http://127.0.0.1:{port}",
                 work / "llama-server.log")
    try:
        url = srv.url + "/completion"
        post(url, {"prompt": prompts[0][:8], "n_predict": 4, "ignore_eos": True})  # warm-up
        jobs = [(p, s) for p in range(len(prompts)) for s in range(samples)]
        cpu0, t0 = cpu_seconds(srv.proc.pid), time.time()
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            outs = list(ex.map(lambda j: post(url, {"prompt": prompts[j[0]], "n_predict": new, "ignore_eos": True,
                                                    "temperature": 1.0, "seed": 1000 * j[0] + j[1],
                                                    "cache_prompt": False}), jobs))
        dt, cpu = time.time() - t0, cpu_seconds(srv.proc.pid) - cpu0
        got = sum(o["tokens_predicted"] for o in outs)
        if got != len(jobs) * new:
            sys.exit(f"llama-server produced {got} tokens, expected {len(jobs) * new}")
        return got / dt, cpu
    finally:
        srv.stop()


def rl_rolloutd(build, model, threads, what, kernels, prompts, samples, new, work):
    quant, numerics = what
    port = free_port()
    srv = Server([build / "rolloutd", "--model", model, "--threads", threads, "--quantization", quant,
                  "--numerics", numerics, "--kv-cache-dtype", "bf16", "--cpu-kernels", kernels, "--max-running", len(prompts) * samples,
                  "--kv-cache-mb", 4096, "--host", "127.0.0.1", "--port", port, "--log-level", "warn"],
                 f"http://127.0.0.1:{port}", work / "rolloutd.log")
    try:
        url = srv.url + "/generate"
        post(url, {"input_ids": prompts[0][:8], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        cpu0, t0 = cpu_seconds(srv.proc.pid), time.time()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(lambda p: post(url, {"input_ids": prompts[p], "sampling_params": {
                "n": samples, "max_new_tokens": new, "ignore_eos": True, "temperature": 1.0,
                "sampling_seed": 1000 * p}}), range(len(prompts))))
        dt, cpu = time.time() - t0, cpu_seconds(srv.proc.pid) - cpu0
        got = sum(len(o["output_ids"]) for out in outs for o in out)
        if got != len(prompts) * samples * new:
            sys.exit(f"rolloutd produced {got} tokens, expected {len(prompts) * samples * new}")
        return got / dt, cpu
    finally:
        srv.stop()


# ---------------------------------------------------------------- 5. report

def summary(v):
    return min(v), statistics.median(v), max(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isa", choices=["native", "avx2"], default="native")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", default="decode,prefill,rl", help="comma list of decode, prefill, rl")
    ap.add_argument("--llama-cpp-python", default="0.3.36", help="the sdist version whose vendor/llama.cpp is built")
    ap.add_argument("--model-source", choices=["transformers", "preset"], default="transformers")
    ap.add_argument("--rl-prompt", type=int, default=128, help="prompt tokens of the RL workload")
    ap.add_argument("--build", default=str(ROOT / "build"), help="rolloutd's build directory")
    ap.add_argument("--systems", default="", help="';'-separated names of the systems to run, as printed (default: "
                    "every one), e.g. 'rolloutd bf16 fast;llama.cpp bf16'")
    ap.add_argument("--work", default=str(ROOT / "build-llamacpp"))
    a = ap.parse_args()
    if a.rounds < 3:
        sys.exit("--rounds must be at least 3")
    missing = [m for m in ("numpy", "yaml", "requests", "tqdm") if subprocess.run(
        [sys.executable, "-c", f"import {m}"], capture_output=True).returncode != 0]
    if missing or not shutil.which("cmake"):  # what the sdist's gguf-py and the build need
        sys.exit(f"needs cmake and, in this python, {' '.join(['numpy', 'pyyaml', 'requests', 'tqdm'])}"
                 f" (missing: {' '.join(missing) or 'cmake'})")
    work, build = pathlib.Path(a.work), pathlib.Path(a.build)
    work.mkdir(parents=True, exist_ok=True)
    only = set(a.only.split(","))
    kernels = "auto" if a.isa == "native" else "avx2"
    run(["make", "-C", ROOT, "-j2", f"BUILD={build}", build / "rolloutd", build / "rollout-bench"],
        stdout=subprocess.DEVNULL)

    src = fetch_llamacpp(work, a.llama_cpp_python)
    model = make_model(work, a.model_source, build)
    bf16 = write_gguf(model, work / f"{model.name}-bf16.gguf", src)
    # llama-bench also probes, before an RL run, whether llama.cpp's batched path runs (rl_llama)
    targets = ["llama-bench"] + (["llama-server"] if "rl" in only else [])
    if not all((work / f"{model.name}-{q}.gguf").is_file() for q in ("q8_0", "q8_0-bf16emb")):
        targets.append("llama-quantize")
    bins = build_llamacpp(work, src, a.isa, a.threads, targets)
    q8 = quantize(bins, bf16, work / f"{model.name}-q8_0.gguf", [])
    q8b = quantize(bins, bf16, work / f"{model.name}-q8_0-bf16emb.gguf",
                   ["--output-tensor-type", "bf16", "--token-embedding-type", "bf16"])

    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in cpu.splitlines() if l.startswith("Flags")), [])
    simd = " ".join(f for f in flags if f.startswith(("avx", "fma", "f16c", "gfni")))
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    log(f"\n{date}  {model_name}  ({simd})")
    log(f"class {a.isa}: rolloutd --cpu-kernels {kernels}, llama.cpp {a.isa} build; {a.threads} threads; "
        f"rolloutd {rev}, llama.cpp from llama-cpp-python {a.llama_cpp_python}; model {model.name}")

    systems = {  # name: (kind, what)
        "rolloutd fp8": ("rolloutd", ("fp8", "exact")),
        "llama.cpp q8_0, bf16 emb/output": ("llama", q8b),
        "llama.cpp q8_0": ("llama", q8),
        "rolloutd bf16": ("rolloutd", ("bf16", "exact")),
        "llama.cpp bf16": ("llama", bf16),
    }
    # rolloutd's fast numerics (BF16 matmuls on BF16-rounded activations, vdpbf16ps or AMX tiles) exist
    # on CPUs with AVX512_BF16 in the avx512 class: llama.cpp's own BF16 arithmetic there. FP8 models
    # run their BF16 lm_head that way, and on AMX CPUs their FP8 GEMMs with fp32 block sums on tiles.
    if kernels == "auto" and "avx512_bf16" in flags:
        systems["rolloutd fp8 fast"] = ("rolloutd", ("fp8", "fast"))
        systems["rolloutd bf16 fast"] = ("rolloutd", ("bf16", "fast"))
    if a.systems:
        want = [x.strip() for x in a.systems.split(";")]
        unknown = [x for x in want if x not in systems]
        if unknown:
            sys.exit(f"--systems: unknown {unknown}; known here: {list(systems)}")
        systems = {k: v for k, v in systems.items() if k in want}
    rl_systems = {k: v for k, v in systems.items() if k != "llama.cpp q8_0"}
    prompts = rl_prompts(16, a.rl_prompt)
    res = {m: {s: [] for s in systems} for m in ("decode", "prefill", "rl")}
    cpu_rl = {s: [] for s in systems}
    loads = []
    for r in range(a.rounds):
        log(f"\n== round {r + 1}/{a.rounds} (load average {loadavg():.1f})")
        for name, (kind, what) in systems.items():
            loads.append(loadavg())
            if "decode" in only:
                v = (llama_bench(bins, what, a.threads, 0, 128) if kind == "llama"
                     else rolloutd_decode(build, model, a.threads, what, kernels))
                res["decode"][name].append(v)
                log(f"  decode   {name:34s} {v:8.1f} tok/s")
            if "prefill" in only:
                v = (llama_bench(bins, what, a.threads, 512, 0) if kind == "llama"
                     else rolloutd_prefill(build, model, a.threads, what, kernels))
                res["prefill"][name].append(v)
                log(f"  prefill  {name:34s} {v:8.1f} tok/s")
            if "rl" in only and name in rl_systems:
                v, c = (rl_llama(bins, what, a.threads, prompts, 4, 128, work) if kind == "llama"
                        else rl_rolloutd(build, model, a.threads, what, kernels, prompts, 4, 128, work))
                res["rl"][name].append(v)
                cpu_rl[name].append(c)
                log(f"  rl       {name:34s} {v:8.1f} tok/s  ({c:.1f} s server CPU)")

    log(f"\n{date} | {model_name} | class {a.isa} (rolloutd --cpu-kernels {kernels}) | {a.threads} threads | "
        f"{a.rounds} rounds | load average {min(loads):.1f}..{max(loads):.1f}")
    titles = {"decode": "decode, batch 1 (tok/s)", "prefill": "prefill, 512-token prompt (tok/s)",
              "rl": f"RL workload: 16 prompts x n=4 x 128 new tokens, {a.rl_prompt}-token prompts (output tok/s)"}
    pairs = [("rolloutd fp8", "llama.cpp q8_0, bf16 emb/output"), ("rolloutd fp8", "llama.cpp q8_0"),
             ("rolloutd bf16", "llama.cpp bf16"), ("rolloutd fp8 fast", "llama.cpp q8_0, bf16 emb/output"),
             ("rolloutd bf16 fast", "llama.cpp bf16")]
    for m, title in titles.items():
        if m not in only:
            continue
        log(f"\n{title}\n  {'system':34s} {'min':>8s} {'median':>8s} {'max':>8s}")
        for s, v in res[m].items():
            if v:
                lo, mid, hi = summary(v)
                extra = f"   server CPU {statistics.median(cpu_rl[s]):.1f} s" if m == "rl" else ""
                log(f"  {s:34s} {lo:8.1f} {mid:8.1f} {hi:8.1f}{extra}")
        for x, y in pairs:
            if res[m].get(x) and res[m].get(y):
                log(f"  ratio {x} / {y}: {statistics.median(res[m][x]) / statistics.median(res[m][y]):.2f}x")
    if NO_REPACK:
        log("\nllama.cpp ran with --repack 0 (its plain CPU path; the default crashed) for: "
            + ", ".join(f"{m} {what}" for m, what in sorted(NO_REPACK)))
    out = work / f"results-{a.isa}-{datetime.datetime.now().strftime('%Y%m%d-%H%M')}.json"
    out.write_text(json.dumps({"date": date, "cpu": model_name, "simd": simd, "isa": a.isa, "kernels": kernels,
                               "threads": a.threads, "rounds": a.rounds, "rolloutd": rev,
                               "llama_cpp_python": a.llama_cpp_python, "results": res, "rl_server_cpu_s": cpu_rl,
                               "llama_cpp_no_repack": sorted(" ".join(k) for k in NO_REPACK),
                               "load_average": loads}, indent=1))
    log(f"\nresults: {out}")


if __name__ == "__main__":
    main()
