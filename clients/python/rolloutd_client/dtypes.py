"""Wire dtypes and exact numpy codecs for them.

rolloutd's weight routes take tensors as "bfloat16", "float16", "float32" or "float8_e4m3fn"
(docs/api.md "Weight updates"). numpy has no bfloat16 or float8 of its own: with `ml_dtypes` installed
those arrays come back as ml_dtypes arrays; without it the client still works, with the bit-exact
fallbacks below (round-to-nearest-even, checked against ml_dtypes in tests/e2e/test_client.py).
"""
import numpy as np

try:  # optional: numpy dtypes for bfloat16 / float8_e4m3fn
    import ml_dtypes as _ml
except ImportError:  # pragma: no cover - exercised where ml_dtypes is absent
    _ml = None

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
WIRE_DTYPES = tuple(ITEMSIZE)

E4M3_MAX = 448.0


def have_ml_dtypes():
    return _ml is not None


def numpy_dtype(wire):
    """The numpy dtype holding `wire` values: ml_dtypes' when present, else the raw bits
    (uint16 for bfloat16, uint8 for float8_e4m3fn)."""
    if wire == "float32":
        return np.dtype(np.float32)
    if wire == "float16":
        return np.dtype(np.float16)
    if wire == "bfloat16":
        return np.dtype(_ml.bfloat16) if _ml else np.dtype(np.uint16)
    if wire == "float8_e4m3fn":
        return np.dtype(_ml.float8_e4m3fn) if _ml else np.dtype(np.uint8)
    raise ValueError(f"unsupported dtype {wire!r} (rolloutd takes {', '.join(WIRE_DTYPES)})")


def wire_dtype_of_numpy(dt):
    """'float32' etc. for a numpy dtype rolloutd accepts, else None."""
    name = np.dtype(dt).name
    return name if name in ITEMSIZE else None


# ---------------------------------------------------------------- bfloat16

def f32_to_bf16_bits(x):
    """float32 array -> uint16 bfloat16 bits, round-to-nearest-even; NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        r[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return r


def bf16_bits_to_f32(b):
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_bf16(x):
    """float array -> bfloat16 (ml_dtypes array, or uint16 bits without ml_dtypes)."""
    x = np.asarray(x, dtype=np.float32)
    if _ml:
        return x.astype(_ml.bfloat16)
    return f32_to_bf16_bits(x)


# ---------------------------------------------------------------- float8 e4m3fn

def _e4m3_decode_table():
    t = np.empty(256, dtype=np.float32)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e, m = (c >> 3) & 0xF, c & 7
        if e == 0xF and m == 7:
            t[c] = np.nan
        elif e == 0:
            t[c] = s * m * 2.0 ** -9
        else:
            t[c] = s * (1 + m / 8) * 2.0 ** (e - 7)
    return t


E4M3_DECODE = _e4m3_decode_table()


def e4m3_bits_to_f32(codes):
    return E4M3_DECODE[np.asarray(codes, dtype=np.uint8)]


def f32_to_e4m3_bits(x):
    """float32 array -> uint8 E4M3FN codes: clamp to +-448 (saturating, as rolloutd's encoder and
    __nv_cvt_float_to_fp8(..., __NV_SATFINITE, __NV_E4M3)), then round to nearest even; every NaN ->
    0x7F whatever its sign bit (rolloutd's rs_fp8_e4m3_from_f32, which canonicalizes NaN as CUDA
    does). Bit-exact with ml_dtypes' cast of the clamped value for non-NaN (tests/e2e/test_client.py).
    Pure numpy integer arithmetic (no ml_dtypes needed; releases the GIL, so it parallelizes)."""
    x = np.clip(np.asarray(x, dtype=np.float32), np.float32(-E4M3_MAX), np.float32(E4M3_MAX))
    u = x.view(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    # Normal E4M3 (|x| >= 2^-6, fp32 biased exponent >= 121): round the fp32 bits to 3 mantissa bits,
    # nearest even (a carry moves into the exponent, as it should), then rebias the exponent 127 -> 7.
    r = (a + (np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1)))) >> np.uint32(20)
    code = r.astype(np.int32) - np.int32(120 << 3)
    # Subnormal E4M3 (|x| < 2^-6): steps of 2^-9, code = rint(|x| * 2^9) (exact scaling; 8 = 2^-6).
    with np.errstate(invalid="ignore"):  # NaN: replaced below
        sub = np.rint(np.abs(x) * np.float32(512)).astype(np.int32)
    code = np.where(a < np.uint32(121 << 23), sub, code).astype(np.uint8)
    code |= (u >> np.uint32(24)).astype(np.uint8) & np.uint8(0x80)
    return np.where(a > np.uint32(0x7F800000), np.uint8(0x7F), code)  # NaN, either sign


def _f32_to_e4m3_bits_frexp(x):
    """A second, independent formulation (frexp / ldexp), for cross-checks in the tests."""
    x = np.asarray(x, dtype=np.float32)
    sign = (np.signbit(x).astype(np.uint8) << np.uint8(7))
    a = np.minimum(np.abs(x), np.float32(E4M3_MAX)).astype(np.float64)  # exact widening
    nan = np.isnan(x)
    a = np.where(nan, 0.0, a)
    _, ex = np.frexp(a)                    # a = f * 2^ex, f in [0.5, 1)
    e = np.where(a < 2.0 ** -6, -6, ex.astype(np.int64) - 1)
    q = np.rint(np.ldexp(a, (3 - e).astype(np.int32))).astype(np.int64)
    code = ((e + 7) << 3) + (q - 8)        # e = -6 covers the subnormals (and 0) too: code = q
    return np.where(nan, np.uint8(0x7F), code.astype(np.uint8) | sign)


def to_e4m3(x):
    """float array -> float8_e4m3fn (ml_dtypes array, or uint8 codes without ml_dtypes)."""
    c = f32_to_e4m3_bits(x)
    return c.view(_ml.float8_e4m3fn) if _ml else c


def as_float32(arr, wire):
    """Values of a numpy array holding `wire` data (ml_dtypes or raw bits) as float32."""
    arr = np.asarray(arr)
    if wire in ("float32", "float16"):
        return arr.astype(np.float32)
    if wire == "bfloat16":
        if arr.dtype == np.uint16:
            return bf16_bits_to_f32(arr)
        return arr.astype(np.float32)
    if wire == "float8_e4m3fn":
        if arr.dtype == np.uint8:
            return e4m3_bits_to_f32(arr)
        return arr.astype(np.float32)
    raise ValueError(f"unsupported dtype {wire!r}")
