"""Client-side blockwise FP8 weight quantization, exactly as rolloutd does it (docs/design.md "Numerics").

A weight matrix w [out][in] is cut into 128x128 blocks (ragged at the right and bottom edges); each
block gets `scale_inv = max(amax, 1e-10) / 448` (fp32), and its elements become
`q = sat_e4m3(w / scale_inv)`: fp32 division, clamp to +-448, round to nearest even. Non-finite
weights as in rolloutd's reference (kernels/fp8.c rs_fp8_quantize_weight_ref): a NaN does not count
in its block's amax (fmaxf), an inf makes the amax inf (the block's finite values become 0, the inf
itself inf/inf = NaN), and every NaN encodes as 0x7F, whatever its sign. The scales form
`<name>_scale_inv` float32 [ceil(out/128)][ceil(in/128)], the layout of Qwen3-FP8 / DeepSeek-V3
checkpoints' `weight_scale_inv` and of slime / veRL's trainer-side quantizer.

Quantized tensors (`is_fp8_weight`): the `.weight` of attention q/k/v/o, MLP gate/up/down and MoE
expert gate/up/down projections. Embeddings, lm_head, norms, biases and the MoE router stay as sent.
"""
import os

import numpy as np

from .dtypes import E4M3_MAX, f32_to_e4m3_bits

BLOCK = 128
AMAX_FLOOR = np.float32(1e-10)

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def is_fp8_weight(name):
    """True for the Hub-layout tensor names rolloutd stores as FP8 (the MoE router `mlp.gate.weight`
    and everything not listed in the module docstring stay unquantized)."""
    if not name.endswith(".weight"):
        return False
    mod = name[:-len(".weight")]
    if ".mlp.experts." in mod:
        return mod.rsplit(".", 1)[1] in ("gate_proj", "up_proj", "down_proj")
    return mod.endswith(_LINEARS)


def scale_shape(shape):
    rows, cols = shape
    return (-(-rows // BLOCK), -(-cols // BLOCK))


def _quantize_rows(w, codes, scale_inv, bo0, bo1):
    """Block-rows [bo0, bo1) of w into codes / scale_inv (both preallocated)."""
    rows, cols = w.shape
    nbi = scale_inv.shape[1]
    r0, r1 = bo0 * BLOCK, min(bo1 * BLOCK, rows)
    part = w[r0:r1]
    nr = bo1 - bo0
    if part.shape == (nr * BLOCK, nbi * BLOCK):
        blocks = part.reshape(nr, BLOCK, nbi, BLOCK)
    else:  # ragged edge: zero padding does not change any block's amax
        pad = np.zeros((nr * BLOCK, nbi * BLOCK), dtype=np.float32)
        pad[:r1 - r0, :cols] = part
        blocks = pad.reshape(nr, BLOCK, nbi, BLOCK)
    a = np.abs(blocks)
    amax = a.max(axis=(1, 3))
    if np.isnan(amax).any():  # NaN is ignored, as fmaxf does (0 for a block of nothing but NaN)
        amax = np.fmax.reduce(a, axis=(1, 3), initial=np.float32(0))
    del a
    s = (np.maximum(amax, AMAX_FLOOR) / np.float32(E4M3_MAX)).astype(np.float32)
    with np.errstate(invalid="ignore"):  # inf / inf in a block whose amax is inf: NaN, as in C
        q = blocks / s[:, None, :, None]                    # fp32 IEEE division per element
    codes[r0:r1] = f32_to_e4m3_bits(q).reshape(nr * BLOCK, nbi * BLOCK)[:r1 - r0, :cols]
    scale_inv[bo0:bo1] = s


_POOL = None
_PARALLEL_MIN = 1 << 20  # elements; below this one thread is faster


def _pool():
    global _POOL
    if _POOL is None:
        import concurrent.futures as cf
        _POOL = cf.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="rolloutd-fp8")
    return _POOL


def quantize_weight(w):
    """w: 2-D float array [out][in] -> (codes uint8 [out][in] E4M3FN bits, scale_inv float32
    [ceil(out/128)][ceil(in/128)]). Large matrices are split by block-rows over threads (numpy
    releases the GIL); the result does not depend on the split."""
    if _is_torch(w):
        return quantize_weight_torch(w)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D matrix, got shape {w.shape}")
    nbo, nbi = scale_shape(w.shape)
    codes = np.empty(w.shape, dtype=np.uint8)
    scale_inv = np.empty((nbo, nbi), dtype=np.float32)
    workers = min(os.cpu_count() or 1, 16, nbo)
    if w.size < _PARALLEL_MIN or workers <= 1:
        _quantize_rows(w, codes, scale_inv, 0, nbo)
    else:
        step = -(-nbo // workers)
        futs = [_pool().submit(_quantize_rows, w, codes, scale_inv, b, min(b + step, nbo))
                for b in range(0, nbo, step)]
        for f in futs:
            f.result()
    return codes, scale_inv


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def quantize_weight_torch(w):
    """The same quantization with torch ops on w's own device (a trainer's GPU): fp32 division,
    clamp to +-448, then torch's float8_e4m3fn cast (round to nearest even; identical to ml_dtypes
    once clamped). Returns torch tensors (codes as float8_e4m3fn, scale_inv float32) on w's device."""
    import torch
    w = w.detach().to(torch.float32)
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D matrix, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    nbo, nbi = scale_shape((rows, cols))
    pad = torch.zeros(nbo * BLOCK, nbi * BLOCK, dtype=torch.float32, device=w.device)
    pad[:rows, :cols] = w
    blocks = pad.view(nbo, BLOCK, nbi, BLOCK)
    a = blocks.abs()
    amax = a.masked_fill(a.isnan(), 0).amax(dim=(1, 3))     # NaN ignored, as fmaxf does
    s = torch.clamp_min(amax, float(AMAX_FLOOR)) / E4M3_MAX
    x = blocks / s[:, None, :, None]
    q = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q.view(torch.uint8).masked_fill_(x.isnan(), 0x7F)        # torch keeps NaN's sign bit; rolloutd does not
    return q.view(nbo * BLOCK, nbi * BLOCK)[:rows, :cols].contiguous(), s.contiguous()


def dequantize_weight(codes, scale_inv):
    """Inverse for checks: float32 [out][in] = e4m3(codes) * scale_inv of each element's block."""
    from .dtypes import e4m3_bits_to_f32
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        codes = codes.view(np.uint8)
    rows, cols = codes.shape
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), BLOCK, 0)[:rows], BLOCK, 1)[:, :cols]
    return e4m3_bits_to_f32(codes) * s
