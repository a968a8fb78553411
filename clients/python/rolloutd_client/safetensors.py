"""A minimal safetensors reader (numpy only; the `safetensors` package is not needed).

Format: 8-byte little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}, then the data; offsets are relative to the
end of the header.

    tensors = load_file("model.safetensors")             # name -> numpy array (memory-mapped)
    client.push_weights(tensors, version="18")

BF16 / F8_E4M3 come back as ml_dtypes arrays when ml_dtypes is installed, else as raw triples
(memoryview, "bfloat16"/"float8_e4m3fn", shape), which push_weights also takes. raw=True always
returns triples (zero-copy views of the mapping).
"""
import json
import struct

import numpy as np

from . import dtypes as _dt

_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32,
          "U64": np.uint64, "BOOL": np.bool_}
_WIRE = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn"}
_ITEM = {"BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def read_header(path):
    """(header dict without __metadata__, metadata dict, data start offset)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: header length {n} is implausible")
        hdr = json.loads(f.read(n))
    meta = hdr.pop("__metadata__", None) or {}
    return hdr, meta, 8 + n


def load_file(path, raw=False):
    """{name: array} in file order (sorted by data offset)."""
    hdr, _, start = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        st, shape = info["dtype"], tuple(info["shape"])
        b, e = info["data_offsets"]
        buf = mm[start + b:start + e]
        item = np.dtype(_NUMPY[st]).itemsize if st in _NUMPY else _ITEM.get(st)
        if item is None:
            raise ValueError(f"{path}: {name} has unsupported dtype {st}")
        if len(buf) != item * int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{path}: {name} spans {len(buf)} bytes, shape {list(shape)} {st} needs "
                             f"{item * int(np.prod(shape, dtype=np.int64))}")
        wire = _WIRE.get(st)
        if raw and wire:
            out[name] = (memoryview(buf), wire, shape)
        elif st in _NUMPY:
            out[name] = buf.view(_NUMPY[st]).reshape(shape)
        elif wire and _dt.have_ml_dtypes():
            out[name] = buf.view(_dt.numpy_dtype(wire)).reshape(shape)
        elif wire:
            out[name] = (memoryview(buf), wire, shape)
        else:
            raise ValueError(f"{path}: {name}: dtype {st} needs ml_dtypes")
    return out


def load_float32(path):
    """{name: float32 array} (BF16, F16, F32, F8_E4M3 decoded exactly)."""
    out = {}
    for name, v in load_file(path, raw=True).items():
        if isinstance(v, tuple):
            mv, wire, shape = v
            bits = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32,
                    "float8_e4m3fn": np.uint8}[wire]
            out[name] = _dt.as_float32(np.frombuffer(mv, dtype=bits).reshape(shape), wire)
        else:
            out[name] = np.asarray(v, dtype=np.float32)
    return out
