"""State-dict entries, whatever they are, as (name, wire dtype, shape, bytes) the transports can pack.

A state_dict maps HF tensor names to any of
  - a torch.Tensor (any device; bfloat16, float16, float32 or float8_e4m3fn): copied straight into
    the destination buffer with Tensor.copy_ (device-to-host included), no intermediate copy;
  - a numpy array: float32, float16, ml_dtypes.bfloat16 or ml_dtypes.float8_e4m3fn;
  - a raw triple (bytes-like, dtype, shape), dtype one of "bfloat16", "float16", "float32",
    "float8_e4m3fn" (e.g. uint16 bfloat16 bits from a checkpoint, without ml_dtypes).
Anything else (float64, int tensors, ...) is rejected with TypeError naming the tensor: the client
never casts silently. The wire is little-endian: big-endian numpy arrays (">f4", ">f2", a raw triple
over a ">u2" array of bfloat16 bits) are byte-swapped on the way into the segment, which changes no
value. torch is imported only when a torch tensor is seen.
"""
import math
import sys

import numpy as np

from . import dtypes as _dt
from . import fp8 as _fp8

_TORCH_WIRE = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32",
               "torch.float8_e4m3fn": "float8_e4m3fn"}


def _is_torch_tensor(x):
    t = type(x)
    return t.__module__.split(".")[0] == "torch" and hasattr(x, "detach") and hasattr(x, "dtype")


class Entry:
    """One tensor to send. `write_into(buf)` fills a writable buffer of exactly `nbytes`;
    `float32()` gives its values as a numpy float32 array (for client-side FP8)."""
    __slots__ = ("name", "dtype", "shape", "nbytes", "_kind", "_obj")

    def __init__(self, name, wire, shape, kind, obj):
        self.name, self.dtype, self.shape = name, wire, tuple(int(s) for s in shape)
        self.nbytes = math.prod(self.shape) * _dt.ITEMSIZE[wire]
        self._kind, self._obj = kind, obj

    def meta(self, offset):
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": int(offset)}

    def write_into(self, buf):
        if self.nbytes == 0:
            return
        mv = memoryview(buf).cast("B")
        assert len(mv) == self.nbytes, (self.name, len(mv), self.nbytes)
        if self._kind == "torch":
            import torch
            t = self._obj.detach()
            dst = torch.frombuffer(mv, dtype=torch.uint8).view(t.dtype).view(t.shape)
            dst.copy_(t)
        elif self._kind == "numpy":
            a = self._obj  # the segment gets little-endian bytes whatever a's byte order ("equiv")
            np.copyto(np.frombuffer(mv, dtype=a.dtype.newbyteorder("<")).reshape(a.shape), a, casting="equiv")
        else:  # raw bytes-like: copied by numpy, which lets go of the GIL (a memoryview slice
            # assignment holds it, stalling the thread that POSTs the previous bucket)
            np.copyto(np.frombuffer(mv, dtype=np.uint8), np.frombuffer(self._obj, dtype=np.uint8))

    def float32(self):
        if self._kind == "torch":
            import torch
            return self._obj.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        if self._kind == "numpy":
            return _dt.as_float32(self._obj, self.dtype)
        raw = np.frombuffer(self._obj, dtype=np.uint8)
        bits = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "float8_e4m3fn": np.uint8}
        return _dt.as_float32(raw.view(bits[self.dtype]).reshape(self.shape), self.dtype)


class _LazyFp8:
    """The two entries a client-side FP8 quantization of `src` produces; computed once, when the
    first of them is written (so quantization streams bucket by bucket, never the whole model)."""

    def __init__(self, src):
        self.src, self.result = src, None

    def get(self):
        if self.result is None:
            if self.src._kind == "torch":  # on the tensor's own device (a trainer's GPU)
                self.result = _fp8.quantize_weight_torch(self.src._obj)
            else:
                self.result = _fp8.quantize_weight(self.src.float32())
        return self.result


class _Fp8Part(Entry):
    __slots__ = ()

    def write_into(self, buf):
        codes, scale_inv = self._obj[0].get()
        a = codes if self._obj[1] == 0 else scale_inv
        if self._obj[1] == 1:
            self._obj[0].result = None  # both parts written: free the quantized copy
        mv = memoryview(buf).cast("B")
        if isinstance(a, np.ndarray):
            np.copyto(np.frombuffer(mv, dtype=a.dtype).reshape(a.shape), a, casting="no")
        else:
            import torch
            torch.frombuffer(mv, dtype=torch.uint8).view(a.dtype).view(a.shape).copy_(a)


def _little_endian_bytes(name, data, wire):
    """The bytes of a raw triple's data as a flat memoryview, little-endian: data whose buffer says
    it is big-endian (a ">u2" numpy array of bfloat16 bits, say) is byte-swapped when its item size
    is the wire dtype's, and refused otherwise (which bytes make an element would be a guess)."""
    mv = memoryview(data)
    order = mv.format[:1] if mv.format[:1] in ("@", "=", "<", ">", "!") else "@"
    big = order in (">", "!") or (order in ("@", "=") and sys.byteorder == "big")
    if big and mv.itemsize > 1:
        if mv.itemsize != _dt.ITEMSIZE[wire]:
            raise TypeError(f"{name}: big-endian data of {mv.itemsize}-byte items ({mv.format!r}) for {wire}; "
                            f"pass little-endian bytes or a numpy array")
        a = np.asarray(mv)
        mv = memoryview(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")))
    return mv.cast("B")


def entry(name, value):
    """One state-dict value as an Entry (TypeError/ValueError naming the tensor if unsupported)."""
    if _is_torch_tensor(value):
        wire = _TORCH_WIRE.get(str(value.dtype))
        if wire is None:
            raise TypeError(f"{name}: torch dtype {value.dtype} is not sent as is; convert it to one of "
                            f"bfloat16, float16, float32, float8_e4m3fn")
        return Entry(name, wire, tuple(value.shape), "torch", value)
    if isinstance(value, np.ndarray) or (hasattr(value, "__array_interface__") and not isinstance(value, tuple)):
        a = np.asarray(value)
        wire = _dt.wire_dtype_of_numpy(a.dtype)
        if wire is None:
            raise TypeError(f"{name}: numpy dtype {a.dtype} is not sent as is; use float32, float16, "
                            f"ml_dtypes.bfloat16 or ml_dtypes.float8_e4m3fn (or a raw (bytes, dtype, shape) triple)")
        return Entry(name, wire, a.shape, "numpy", a)
    if isinstance(value, (tuple, list)) and len(value) == 3:
        data, wire, shape = value
        if wire not in _dt.ITEMSIZE:
            raise TypeError(f"{name}: dtype {wire!r} must be one of {', '.join(_dt.WIRE_DTYPES)}")
        mv = _little_endian_bytes(name, data, wire)
        e = Entry(name, wire, tuple(shape), "raw", mv)
        if len(mv) != e.nbytes:
            raise ValueError(f"{name}: {len(mv)} bytes for shape {list(shape)} {wire} ({e.nbytes} expected)")
        return e
    raise TypeError(f"{name}: expected a torch tensor, a numpy array or (bytes, dtype, shape), "
                    f"got {type(value).__name__}")


def entries(state_dict, fp8=False, fp8_filter=None):
    """All entries to send, in state_dict order. fp8=True: every 2-D tensor whose name passes
    fp8_filter (default rolloutd_client.fp8.is_fp8_weight) and is not already float8 is replaced by
    its E4M3 codes (`name`, float8_e4m3fn) and `name + "_scale_inv"` (float32), quantized lazily."""
    items = state_dict.items() if hasattr(state_dict, "items") else state_dict
    filt = fp8_filter or _fp8.is_fp8_weight
    out = []
    for name, value in items:
        e = entry(name, value)
        if fp8 and len(e.shape) == 2 and e.dtype != "float8_e4m3fn" and filt(name):
            lazy = _LazyFp8(e)
            out.append(_Fp8Part(name, "float8_e4m3fn", e.shape, "fp8", (lazy, 0)))
            out.append(_Fp8Part(name + "_scale_inv", "float32", _fp8.scale_shape(e.shape), "fp8", (lazy, 1)))
        else:
            out.append(e)
    return out
