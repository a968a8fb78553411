#!/usr/bin/env python3
"""torch's GEMMs at the shapes of tools/bench_gpu.c's `gemm`, for comparison on the same GPU:

    python3 scripts/bench_scaled_mm.py [--shapes 6144:4096,...] [--tokens 512,2048,4096]

For each out[t][n] = x[t][k] @ w[n][k]^T: torch.matmul in BF16, and torch._scaled_mm with E4M3
operands block-scaled as rolloutd's recipe scales them (1x128 groups of x, 128x128 blocks of w,
fp32 scales; the same cuBLAS modes), if this PyTorch has block scaling (CUDA >= 12.9 builds: scale_a
[t][k/128] outer-dim-major, scale_b [k/128][n/128]); otherwise it says why and times BF16 only.
Times are CUDA-event medians of 20 calls after 5 warm-ups; prints TFLOP/s per line.
"""
import argparse
import sys


def shapes_arg(s):
    """N:K,... with N and K multiples of 128 (the weight blocks)."""
    try:
        out = [tuple(int(v) for v in item.split(":")) for item in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected N:K,...") from None
    for sh in out:
        if len(sh) != 2 or sh[0] <= 0 or sh[1] <= 0 or sh[0] % 128 or sh[1] % 128:
            raise argparse.ArgumentTypeError(f"{':'.join(map(str, sh))}: N and K must be positive multiples of 128")
    return out


def tokens_arg(s):
    """T,... with T positive."""
    try:
        out = [int(v) for v in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected T,...") from None
    if any(t <= 0 for t in out):
        raise argparse.ArgumentTypeError(f"{s!r}: token counts must be positive")
    return out


def main():
    ap = argparse.ArgumentParser(description="torch.matmul (BF16) and torch._scaled_mm (FP8, 1x128 x 128x128 "
                                 "block scales) TFLOP/s at bench-gpu gemm's shapes")
    ap.add_argument("--shapes", type=shapes_arg, default="6144:4096,4096:4096,12288:4096,4096:12288",
                    help="weight shapes N:K (out[t][n] = x[t][k] w[n][k]), default Qwen3-8B's projections")
    ap.add_argument("--tokens", type=tokens_arg, default="512,2048,4096", help="rows of x (prefill tokens)")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("skipped: no torch")
        return 0
    if not torch.cuda.is_available():
        print("skipped: torch without a CUDA device")
        return 0
    dev = "cuda"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")

    def timed(fn):
        for _ in range(5):
            fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in ev)
        return ms[len(ms) // 2] / 1e3

    block_ok, why = True, ""
    for n, k in a.shapes:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        w8 = w.to(torch.float8_e4m3fn)
        sw = torch.full((n // 128, k // 128), 1.0 / 64, device=dev, dtype=torch.float32)
        for t in a.tokens:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            x8 = x.to(torch.float8_e4m3fn)
            sx = torch.full((t, k // 128), 1.0 / 64, device=dev, dtype=torch.float32).t().contiguous().t()
            flop = 2.0 * t * n * k
            tb = timed(lambda: torch.matmul(x, w.t()))
            line = f"  torch n {n:5d} k {k:5d} t {t:5d}: bf16 {tb * 1e6:8.1f} us {flop / tb / 1e12:7.1f} TFLOP/s"
            if block_ok:
                try:
                    tf = timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16))
                    line += f" | _scaled_mm 1x128 x 128x128 {tf * 1e6:8.1f} us {flop / tf / 1e12:7.1f} TFLOP/s"
                except Exception as e:  # noqa: BLE001 - report whatever this build says
                    block_ok, why = False, str(e).splitlines()[0][:200]
            print(line, flush=True)
    if not block_ok:
        print(f"torch._scaled_mm has no 1x128 / 128x128 block scaling here: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
