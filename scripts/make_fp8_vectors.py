#!/usr/bin/env python3
"""make_fp8_vectors.py -- golden FP8 vectors for tests/unit/test_fp8.c, from NumPy + ml_dtypes.

    python3 scripts/make_fp8_vectors.py [outdir]        (default tests/fixtures/fp8)

The oracle is someone else's code: ml_dtypes' float8_e4m3fn / float8_e5m2 casts (round to nearest
even). Those casts do not saturate (out of range -> NaN for e4m3fn, inf for e5m2), so inputs are
clamped to +-max first, which is exactly CUDA's __NV_SATFINITE behaviour for every non-NaN input.
NaN inputs stay NaN through the clamp; ml_dtypes encodes them as sign|0x7F (e4m3fn) and
sign|0x7E (e5m2), while CUDA (and our codec) give 0x7F for every NaN. The files keep ml_dtypes'
codes as they are; the C test checks that both sides are NaN codes and that ours is 0x7F.

Quantization fixtures implement docs/design.md's formulas in float32 NumPy, every step an IEEE float32
operation (max, maximum, true division), then the clamped ml_dtypes cast:
    scale = max(amax, 1e-10) / 448 ;  q = e4m3(clip(v / scale, -448, 448))

Files (little-endian, no padding):
  codec.bin   "RSFP8VEC" u32 version=1, u32 n, f32 x[n], u8 e4m3[n], u8 e5m2[n]
  weight.bin  "RSFP8WGT" u32 version=1, u32 out, u32 in, u16 w_bf16[out][in], u8 q[out][in],
              f32 scale_inv[ceil(out/128)][ceil(in/128)]
  act.bin     "RSFP8ACT" u32 version=1, u32 rows, u32 k, f32 x[rows][k], u8 q[rows][k],
              f32 scale[rows][ceil(k/128)]
"""
import os
import struct
import sys

import ml_dtypes
import numpy as np

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
E4M3_MAX, E5M2_MAX = np.float32(448.0), np.float32(57344.0)
BLOCK = 128
SEED = 20240611
F32 = np.float32


def to_e4m3(v):
    """Saturating E4M3 codes of float32 array v: clamp, then ml_dtypes' RNE cast."""
    with np.errstate(invalid="ignore"):  # NaN inputs are expected here
        return np.clip(v.astype(F32), -E4M3_MAX, E4M3_MAX).astype(E4M3).view(np.uint8)


def to_e5m2(v):
    with np.errstate(invalid="ignore"):
        return np.clip(v.astype(F32), -E5M2_MAX, E5M2_MAX).astype(E5M2).view(np.uint8)


def format_values(dtype):
    """Non-negative finite values of an FP8 format, ascending."""
    v = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    v = v[np.isfinite(v) & (v >= 0)]
    return np.unique(v)


def f32_neighbours(v):
    v = v.astype(F32)
    return [v, np.nextafter(v, F32(np.inf)), np.nextafter(v, F32(-np.inf))]


def boundary_inputs():
    parts = []
    for dtype in (E4M3, E5M2):
        vals = format_values(dtype)
        mids = (vals[:-1] + vals[1:]) / 2
        assert np.all(mids.astype(F32).astype(np.float64) == mids), "midpoints must be exact in f32"
        parts += f32_neighbours(vals)
        parts += f32_neighbours(mids)
        top, ulp = vals[-1], vals[-1] - vals[-2]
        tiny = vals[1]  # smallest subnormal
        parts += f32_neighbours(np.array([top + ulp / 2, top + ulp, top + 1.5 * ulp, 2 * top, 4 * top,
                                          tiny / 2, tiny / 4, tiny * 0.75, tiny * 1.5]))
    # far outside either range, and fp32 specials
    parts.append(np.array([1e6, 1e30, 3.4028235e38, 1e-30, 1e-40, 1.4e-45, 1.17549435e-38,
                           2.0 ** -126, 2.0 ** -149 * 3, 0.0, np.inf], dtype=F32))
    bits = np.array([0x7FC00000, 0x7F800001, 0x7FBFFFFF, 0x7FFFFFFF, 0x7FC00001, 0x00000001,
                     0x007FFFFF, 0x00400000], dtype=np.uint32)
    parts.append(bits.view(F32))
    x = np.concatenate(parts).astype(F32)
    x = np.concatenate([x, -x])  # negation flips the sign of NaNs and zeros too
    return x


def random_inputs(rng):
    def signed(mag):
        return np.where(rng.random(mag.size) < 0.5, -mag, mag).astype(F32)

    def log_uniform(lo_exp, hi_exp, n):
        return signed(np.exp2(rng.uniform(lo_exp, hi_exp, n)))

    parts = [
        rng.integers(0, 2 ** 32, 30000, dtype=np.uint64).astype(np.uint32).view(F32),  # any pattern
        log_uniform(-20, 20, 30000),   # both formats' normal ranges and around them
        log_uniform(-12, -5, 15000),   # e4m3 subnormals (< 2^-6) and the first normals
        log_uniform(-19, -13, 15000),  # e5m2 subnormals (< 2^-14)
        signed(rng.uniform(400.0, 520.0, 5000)),        # around e4m3 max
        signed(rng.uniform(50000.0, 70000.0, 5000)),    # around e5m2 max
    ]
    return np.concatenate(parts).astype(F32)


def block_quantize(w, bo, bi, reciprocal=False):
    """Blockwise E4M3 of float32 w [out][in] with bo x bi blocks: (q codes, float32 scales).
    reciprocal=True multiplies by 1/scale instead of dividing (only to check that the fixtures
    tell the two apart)."""
    out, inn = w.shape
    nbo, nbi = -(-out // bo), -(-inn // bi)
    q = np.empty((out, inn), dtype=np.uint8)
    s = np.empty((nbo, nbi), dtype=F32)
    for i in range(nbo):
        for j in range(nbi):
            blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]
            amax = np.max(np.abs(blk))
            sc = np.maximum(amax, F32(1e-10)) / F32(448.0)
            assert sc.dtype == F32
            s[i, j] = sc
            qb = blk * (F32(1.0) / sc) if reciprocal else blk / sc
            assert qb.dtype == F32
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = to_e4m3(qb)
    return q, s


def weight_fixture(rng, out=300, inn=260):
    # Per-block magnitudes spanning many binades, plus the edge cases the formula has to handle.
    w = rng.standard_normal((out, inn)).astype(np.float64)
    mags = np.exp2(rng.uniform(-12, 4, (3, 3)))
    for i in range(3):
        for j in range(3):
            w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= mags[i, j]
    w[0:128, 128:256] = 0.0                      # all-zero block: scale from the 1e-10 floor
    w[256:300, 0:128] *= 1e-13                   # amax below the floor
    w[5, 7] = 3.0e4                              # outlier dominates its block
    w[130, 257] = -w[130, 257]                   # ragged corner block, negative values
    w[200, 3] = -0.0
    wb = w.astype(F32).astype(ml_dtypes.bfloat16)  # weights are BF16 (RNE from the f32 draw)
    wf = wb.astype(F32)
    q, s = block_quantize(wf, BLOCK, BLOCK)
    assert np.any(block_quantize(wf, BLOCK, BLOCK, reciprocal=True)[0] != q)
    return wb.view(np.uint16), q, s


def act_fixture(rng, rows=8, k=1000):
    x = rng.standard_normal((rows, k)).astype(F32)
    x[1] *= F32(1e-3)
    x[2, 128:256] = 0.0                          # all-zero group
    x[3, 10] = F32(5e4)                          # outlier
    x[4] = (x[4] * F32(1e-12)).astype(F32)       # below the floor
    x[0, k - 1] = -0.0
    # Rows 4.. hold bf16-representable values, as activations computed in bf16 are: with few
    # significant bits, x / s often lands exactly on an E4M3 tie, which is where true division and
    # multiplication by 1/s disagree (the assert below keeps the fixture able to tell them apart).
    x[4:] = x[4:].astype(ml_dtypes.bfloat16).astype(F32)
    q, s = block_quantize(x, 1, BLOCK)
    assert np.any(block_quantize(x, 1, BLOCK, reciprocal=True)[0] != q)
    return x, q, s


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join("tests", "fixtures", "fp8")
    os.makedirs(outdir, exist_ok=True)
    rng = np.random.default_rng(SEED)

    x = np.concatenate([boundary_inputs(), random_inputs(rng)]).astype(F32)
    e4, e5 = to_e4m3(x), to_e5m2(x)
    with open(os.path.join(outdir, "codec.bin"), "wb") as f:
        f.write(b"RSFP8VEC" + struct.pack("<II", 1, x.size))
        f.write(x.astype("<f4").tobytes() + e4.tobytes() + e5.tobytes())

    wb, q, s = weight_fixture(rng)
    with open(os.path.join(outdir, "weight.bin"), "wb") as f:
        f.write(b"RSFP8WGT" + struct.pack("<III", 1, *wb.shape))
        f.write(wb.astype("<u2").tobytes() + q.tobytes() + s.astype("<f4").tobytes())

    xa, qa, sa = act_fixture(rng)
    with open(os.path.join(outdir, "act.bin"), "wb") as f:
        f.write(b"RSFP8ACT" + struct.pack("<III", 1, *xa.shape))
        f.write(xa.astype("<f4").tobytes() + qa.tobytes() + sa.astype("<f4").tobytes())

    print(f"{outdir}: codec {x.size} inputs, weight {wb.shape}, act {xa.shape} "
          f"(numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__})")


if __name__ == "__main__":
    main()
