#!/usr/bin/env python3
"""Encode speed of rolloutd's tokenizer against Hugging Face `tokenizers`, measured in the same run.

    make build/tokenize && python3 scripts/bench_tokenizer.py [--mb 10] [--runs 3] [NAME ...]

NAME is a committed tokenizer (tests/fixtures/tokenizers/NAME; default: qwen2 llama3 spm) or
"default" (the default model's). The input is MB megabytes of the mixed test corpus
(tests/fixtures/tokenizers/corpus.txt: English, code, CJK, Arabic, emoji, digits, whitespace),
lines shuffled with a fixed seed and joined into ~4 KB documents. Both sides encode every
document single-threaded without special tokens: `tokenizers` with RAYON_NUM_THREADS=1 and
TOKENIZERS_PARALLELISM=false, one Tokenizer.encode call per document (no encode_batch), and
build/tokenize --bench, which calls rs_tok_encode per document. The token counts must agree (the
ids themselves are compared by tests/e2e/test_tokenizer_hf.py). Each side runs --runs times; the table shows the best wall-clock MB/s of each (the
machine may be shared), the CPU seconds of that run, and the ratio. Streaming detokenization is
the cost per token of rs_tok_stream_push over the same ids, beside `tokenizers`' DecodeStream.
"""
import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "tokenizers"


def documents(mb):
    lines = [json.loads(x) for x in (FIX / "corpus.txt").read_text().splitlines()]
    rng = random.Random(10)
    docs, cur, size, total = [], [], 0, 0
    while total < mb * 1e6:
        s = rng.choice(lines)
        cur.append(s)
        size += len(s.encode()) + 1
        if size >= 4096:
            d = "\n".join(cur)
            docs.append(d)
            total += len(d.encode())
            cur, size = [], 0
    return docs, total


def bench_hf(path, docs, runs):
    tok = Tokenizer.from_file(str(path))
    best = None
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        ids = [tok.encode(d, add_special_tokens=False).ids for d in docs]
        t, c = time.perf_counter() - t0, time.process_time() - c0
        if best is None or t < best[0]:
            best = (t, c)
    return best, ids, tok


def bench_hf_stream(tok, ids, limit=200000):
    from tokenizers.decoders import DecodeStream
    n, t0 = 0, time.perf_counter()
    for doc in ids:
        ds = DecodeStream(skip_special_tokens=False)
        for i in doc:
            ds.step(tok, i)
            n += 1
        if n >= limit:
            break
    return (time.perf_counter() - t0) * 1e9 / max(n, 1)


def bench_c(tool, d, corpus, runs):
    best = None
    for _ in range(runs):
        out = subprocess.run([str(tool), "--bench", str(d), str(corpus)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout)
        if best is None or r["seconds"] < best["seconds"]:
            best = r
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=["qwen2", "llama3", "spm"])
    ap.add_argument("--mb", type=float, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tool", default=str(ROOT / "build" / "tokenize"))
    args = ap.parse_args()
    docs, nbytes = documents(args.mb)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = pathlib.Path(tmp) / "docs.jsonl"
        corpus.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
        print(f"{nbytes / 1e6:.1f} MB in {len(docs)} documents, best of {args.runs} runs, single thread\n")
        print("| tokenizer | rolloutd MB/s (cpu s) | tokenizers MB/s (cpu s) | ratio | rolloutd stream ns/token (cpu) | tokenizers DecodeStream ns/token |")
        print("|---|---|---|---|---|---|")
        for name in args.names:
            if name == "default":
                d = pathlib.Path(tmp) / "default"
                d.mkdir()
                (d / "tokenizer.json").write_bytes((ROOT / "tokenizer" / "default_tokenizer.json").read_bytes())
            else:
                d = FIX / name
            (hf_t, hf_c), hf_ids, tok = bench_hf(d / "tokenizer.json", docs, args.runs)
            c = bench_c(args.tool, d / "tokenizer.json", corpus, args.runs)
            n_hf = sum(len(x) for x in hf_ids)
            if c["tokens"] != n_hf:
                sys.exit(f"{name}: rolloutd made {c['tokens']} tokens, tokenizers {n_hf}")
            hf_mb = nbytes / hf_t / 1e6
            ds = bench_hf_stream(tok, hf_ids)
            print(f"| {name} | {c['mb_per_s']:.2f} ({c['cpu_seconds']:.2f}) | {hf_mb:.2f} ({hf_c:.2f}) | "
                  f"{c['mb_per_s'] / hf_mb:.2f}x | {c['stream_ns_per_token']:.0f} ({c['stream_cpu_ns_per_token']:.0f}) | {ds:.0f} |")


if __name__ == "__main__":
    main()
