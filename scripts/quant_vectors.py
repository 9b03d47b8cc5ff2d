#!/usr/bin/env python3
"""Write the committed ggml block-format test vectors in crates/parity-quant/tests/data/quant/.

Two independent oracles:

  ggml    the real ggml shipped inside llama-cpp-python (libggml-base.so /
          libggml-cpu.so next to the llama_cpp package), called through ctypes:
            * dequantization: ggml_get_type_traits(type)->to_float, or the
              exported dequantize_row_* symbol where the traits entry is NULL
              (Q8_K); Q8_1 has no ggml decoder at all (see below);
            * quantization: ggml_quantize_chunk(type, src, dst, 0, nrows,
              n_per_row, imatrix=NULL) where it supports the type, else the
              reference quantizer (type_traits->from_float_ref, or the
              exported quantize_row_q8_K_ref symbol);
            * the CPU backend's own activation quantizer
              (ggml_get_type_traits_cpu(type)->from_float, the SIMD code that
              runs before a matmul) for Q8_0/Q8_1/Q8_K, kept where it differs
              from the reference quantizer (informative).
  gguf-py the numpy re-implementation in PyPI `gguf` (gguf.quants.dequantize /
          gguf.quants.quantize) for every type it supports; the script checks
          that it agrees with ggml and records where it does not.

Output (deterministic, seeded):

  crates/parity-quant/tests/data/quant/index.json   provenance, versions, and for every type the
                                dequantization cases and quantization cases as
                                [offset, length] byte ranges into:
  crates/parity-quant/tests/data/quant/inputs.f32   shared f32 input rows (little endian)
  crates/parity-quant/tests/data/quant/<name>.bin   per type: block bytes, expected f32 (LE),
                                expected quantized bytes

    scripts/quant_vectors.py [--out DIR] [--check]

--check regenerates in memory and compares with what is on disk (exit 1 if it
differs). Exit codes: 0 ok, 1 oracle disagreement on a must-agree case or
--check mismatch, 2 llama_cpp / gguf / numpy missing.
"""

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import warnings

try:
    import numpy as np
    import gguf
    import gguf.quants as gq
    import llama_cpp
except ImportError as e:  # pragma: no cover
    print(f"quant_vectors.py: needs numpy, gguf and llama_cpp (llama-cpp-python): {e}")
    sys.exit(2)

warnings.filterwarnings("ignore", category=RuntimeWarning)  # gguf-py on Inf/NaN scales

SEED = 0x9A417
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "crates", "parity-quant", "tests", "data", "quant")

# name, ggml id, block size, type size (must equal the FORMAT entries in crates/parity-quant/src/*.rs)
TYPES = [
    ("f32", 0, 1, 4),
    ("f16", 1, 1, 2),
    ("q4_0", 2, 32, 18),
    ("q4_1", 3, 32, 20),
    ("q5_0", 6, 32, 22),
    ("q5_1", 7, 32, 24),
    ("q8_0", 8, 32, 34),
    ("q8_1", 9, 32, 36),
    ("q2_K", 10, 256, 84),
    ("q3_K", 11, 256, 110),
    ("q4_K", 12, 256, 144),
    ("q5_K", 13, 256, 176),
    ("q6_K", 14, 256, 210),
    ("q8_K", 15, 256, 292),
    ("iq4_nl", 20, 32, 18),
    ("iq4_xs", 23, 256, 136),
    ("bf16", 30, 1, 2),
]
BY_NAME = {t[0]: t for t in TYPES}

# Scale fields that random "sane" blocks get a finite, moderate value in:
# (byte offset, kind) with kind f16 or f32.
SCALES = {
    "q4_0": [(0, "f16")],
    "q4_1": [(0, "f16"), (2, "f16")],
    "q5_0": [(0, "f16")],
    "q5_1": [(0, "f16"), (2, "f16")],
    "q8_0": [(0, "f16")],
    "q8_1": [(0, "f16"), (2, "f16")],
    "iq4_nl": [(0, "f16")],
    "q2_K": [(80, "f16"), (82, "f16")],
    "q3_K": [(108, "f16")],
    "q4_K": [(0, "f16"), (2, "f16")],
    "q5_K": [(0, "f16"), (2, "f16")],
    "q6_K": [(208, "f16")],
    "q8_K": [(0, "f32")],
    "iq4_xs": [(0, "f16")],
}

# Types whose quantizer must be reproduced bit for bit by parity (activation types).
MUST_MATCH_QUANT = {"q8_0", "q8_1", "q8_K"}


# --------------------------------------------------------------------------
# ggml through ctypes
# --------------------------------------------------------------------------
class GgmlTypeTraits(ctypes.Structure):
    """struct ggml_type_traits (ggml.h, ggml 0.25.x)."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),  # void (*)(const void *, float *, int64_t)
        ("from_float_ref", ctypes.c_void_p),  # void (*)(const float *, void *, int64_t)
    ]


class GgmlTypeTraitsCpu(ctypes.Structure):
    """struct ggml_type_traits_cpu (ggml-cpu.h); only from_float is used."""

    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class Ggml:
    def __init__(self):
        from llama_cpp import _ggml  # loads libggml.so (and with it base + cpu)

        self.libdir = os.path.join(os.path.dirname(os.path.abspath(llama_cpp.__file__)), "lib")
        self.main = _ggml.libggml
        # Already loaded as dependencies of libggml.so: dlopen returns the same copies.
        self.base = ctypes.CDLL(os.path.join(self.libdir, "libggml-base.so"))
        self.cpu = ctypes.CDLL(os.path.join(self.libdir, "libggml-cpu.so"))
        b, c = self.base, self.cpu
        b.ggml_get_type_traits.restype = ctypes.POINTER(GgmlTypeTraits)
        b.ggml_get_type_traits.argtypes = [ctypes.c_int]
        c.ggml_get_type_traits_cpu.restype = ctypes.POINTER(GgmlTypeTraitsCpu)
        c.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        b.ggml_quantize_init.argtypes = [ctypes.c_int]
        b.ggml_quantize_init.restype = None
        b.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        b.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        b.ggml_quantize_chunk.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ]
        b.ggml_quantize_chunk.restype = ctypes.c_size_t
        c.ggml_cpu_init.argtypes = []
        c.ggml_cpu_init.restype = None
        c.ggml_cpu_init()
        self.version = self._lib_version()
        self.cpu_features = {
            f: bool(getattr(c, "ggml_cpu_has_" + f)())
            for f in ("sse3", "ssse3", "avx", "avx2", "f16c", "fma", "avx512", "bmi2")
            if hasattr(c, "ggml_cpu_has_" + f)
        }

    def _lib_version(self):
        # the wheel ships libggml-base.so, .so.0 and .so.0.25.3 as copies, not links
        names = [f for f in os.listdir(self.libdir) if f.startswith("libggml-base.so.")]
        best = max(names, key=lambda f: f.count("."), default="")
        return best.split(".so.")[-1] if best else "unknown"

    def traits(self, tid):
        t = self.base.ggml_get_type_traits(tid).contents
        return t

    def check_traits(self, name, tid, bs, ts):
        t = self.traits(tid)
        got = (t.type_name.decode(), t.blck_size, t.type_size)
        if got != (name, bs, ts):
            raise SystemExit(f"ggml_type_traits layout mismatch for {name}: {got}")

    def _fn(self, lib, sym):
        return ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value

    def to_float_fn(self, name, tid):
        """(function pointer, how) for decoding `name`, or (None, why)."""
        t = self.traits(tid)
        if t.to_float:
            return t.to_float, "ggml_get_type_traits(%d)->to_float" % tid
        if name == "q8_K":
            return self._fn(self.base, "dequantize_row_q8_K"), "dequantize_row_q8_K (exported; traits->to_float is NULL)"
        return None, "traits->to_float is NULL"

    def to_float(self, name, tid, src: bytes, n: int) -> np.ndarray:
        if name == "f32":
            # type_traits[F32].to_float is NULL in ggml: F32 rows are used as they are.
            return np.frombuffer(src, dtype="<f4").copy()
        fn, _ = self.to_float_fn(name, tid)
        if fn is None and name == "q8_1":
            # No ggml decoder exists for Q8_1; y = d * qs is Q8_0's decoder on the same
            # (d, qs) with the `s` field dropped.
            blocks = np.frombuffer(src, dtype=np.uint8).reshape(-1, 36)
            q8_0 = np.concatenate([blocks[:, :2], blocks[:, 4:]], axis=1).tobytes()
            return self.to_float("q8_0", 8, q8_0, n)
        sbuf = ctypes.create_string_buffer(src, len(src))
        out = np.zeros(n, dtype=np.float32)
        TO_FLOAT(fn)(ctypes.addressof(sbuf), out.ctypes.data, n)
        return out

    def quantize_chunk(self, tid, x: np.ndarray, nrows: int, ts: int, bs: int) -> bytes:
        x = np.ascontiguousarray(x, dtype=np.float32)
        n_per_row = x.size // nrows
        dst = ctypes.create_string_buffer(x.size // bs * ts)
        self.base.ggml_quantize_init(tid)
        wrote = self.base.ggml_quantize_chunk(tid, x.ctypes.data, ctypes.addressof(dst), 0, nrows, n_per_row, None)
        assert wrote == len(dst.raw), (wrote, len(dst.raw))
        return dst.raw

    def ref_quantize(self, name, tid, x: np.ndarray, ts, bs) -> bytes:
        t = self.traits(tid)
        fn = t.from_float_ref
        if not fn and name == "q8_K":
            fn = self._fn(self.base, "quantize_row_q8_K_ref")
        x = np.ascontiguousarray(x, dtype=np.float32)
        dst = ctypes.create_string_buffer(x.size // bs * ts)
        FROM_FLOAT(fn)(x.ctypes.data, ctypes.addressof(dst), x.size)
        return dst.raw

    def cpu_quantize(self, tid, x: np.ndarray, ts, bs) -> bytes:
        fn = self.cpu.ggml_get_type_traits_cpu(tid).contents.from_float
        x = np.ascontiguousarray(x, dtype=np.float32)
        dst = ctypes.create_string_buffer(x.size // bs * ts)
        FROM_FLOAT(fn)(x.ctypes.data, ctypes.addressof(dst), x.size)
        return dst.raw


def probe_quantize_chunk(name, tid, bs):
    """Does ggml_quantize_chunk accept `name`? Run in a child: unsupported types abort()."""
    code = (
        "import ctypes,sys;sys.path.insert(0,%r);import quant_vectors as q;g=q.Ggml();"
        "import numpy as np;x=np.ones(%d,dtype=np.float32);"
        "g.quantize_chunk(%d,x,1,%d,%d);print('ok')"
        % (os.path.dirname(os.path.abspath(__file__)), 256, tid, BY_NAME[name][3], bs)
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode == 0 and "ok" in r.stdout:
        return True, "supported"
    msg = (r.stderr.strip().splitlines() or ["?"])
    msg = [m for m in msg if "ggml" in m.lower() or "abort" in m.lower()] or msg
    return False, "aborts (rc %d): %s" % (r.returncode, msg[0][:160])


# --------------------------------------------------------------------------
# gguf-py
# --------------------------------------------------------------------------
def gguf_qtype(name):
    return getattr(gguf.GGMLQuantizationType, name.upper())


def gguf_dequant(name, src: bytes, n: int):
    try:
        out = gq.dequantize(np.frombuffer(src, dtype=np.uint8).copy(), gguf_qtype(name))
    except NotImplementedError:
        return None
    if name == "f32":
        out = np.frombuffer(src, dtype="<f4")
    return np.asarray(out, dtype=np.float32).reshape(-1)[:n]


def gguf_quant(name, x: np.ndarray):
    if name == "f32":
        return None  # identity, not interesting
    try:
        out = gq.quantize(np.asarray(x, dtype=np.float32).reshape(1, -1), gguf_qtype(name))
    except (NotImplementedError, gq.QuantError):
        return None
    if name == "f16":
        return np.asarray(out, dtype="<f2").tobytes()
    return np.asarray(out, dtype=np.uint8).tobytes()


def same_f32(a: np.ndarray, b: np.ndarray):
    """Bit-equal, with any NaN equal to any NaN. Returns (ok, first_bad_index, nan_payload_diffs)."""
    ab, bb = a.view(np.uint32), b.view(np.uint32)
    both_nan = np.isnan(a) & np.isnan(b)
    bad = (ab != bb) & ~both_nan
    idx = int(np.argmax(bad)) if bad.any() else -1
    return not bad.any(), idx, int(((ab != bb) & both_nan).sum())


# --------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------
def f16_bits(v):
    return np.asarray(v, dtype=np.float32).astype("<f2").view("<u2")


def sane_scale(rng, kind, size=None):
    mag = 10.0 ** rng.uniform(-3.0, 0.0, size)
    sign = np.where(rng.random(size) < 0.5, -1.0, 1.0)
    v = (mag * sign).astype(np.float32)
    return v


def put_scale(block: np.ndarray, off, kind, value):
    if kind == "f16":
        block[off:off + 2] = np.frombuffer(np.float32(value).astype("<f2").tobytes(), dtype=np.uint8)
    else:
        block[off:off + 4] = np.frombuffer(np.float32(value).astype("<f4").tobytes(), dtype=np.uint8)


def put_scale_bits(block, off, kind, bits):
    if kind == "f16":
        block[off:off + 2] = np.frombuffer(np.uint16(bits).astype("<u2").tobytes(), dtype=np.uint8)
    else:
        block[off:off + 4] = np.frombuffer(np.uint32(bits).astype("<u4").tobytes(), dtype=np.uint8)


def dequant_cases(g: Ggml, rng, name, tid, bs, ts):
    """[(case name, description, src bytes, n)] for one type."""
    cases = []
    if bs == 1:
        # plain float formats: raw bit patterns
        if name == "f32":
            sane = rng.standard_normal(384).astype("<f4") * np.float32(10.0) ** rng.uniform(-20, 20, 384).astype(np.float32)
            specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
                                 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x3F800000, 0xBF800000,
                                 0x33800000, 0x477FE000, 0x477FF000], dtype="<u4")
            raw = rng.integers(0, 2**32, 112, dtype=np.uint64).astype("<u4")
            cases.append(("finite", "random finite f32 at scales 1e-20..1e20", sane.astype("<f4").tobytes(), 384))
            cases.append(("specials", "zeros, infinities, NaNs, subnormals, extremes + random bit patterns",
                          specials.tobytes() + raw.tobytes(), 128))
        else:
            bits = rng.integers(0, 2**16, 384, dtype=np.uint64).astype("<u2")
            exp_mask = 0x7C00 if name == "f16" else 0x7F80
            finite = bits[(bits & exp_mask) != exp_mask][:256]
            specials = np.array([0x0000, 0x8000, exp_mask, 0x8000 | exp_mask, exp_mask | 1,
                                 exp_mask | (0x200 if name == "f16" else 0x40), 0xFFFF, 0x0001, 0x8001,
                                 (0x03FF if name == "f16" else 0x007F), (0x0400 if name == "f16" else 0x0080),
                                 (0x7BFF if name == "f16" else 0x7F7F), 0x3C00, 0x3F80, 0xC000, 0x7FFF],
                                dtype="<u2")
            raw = rng.integers(0, 2**16, 112, dtype=np.uint64).astype("<u2")
            cases.append(("finite", "random finite bit patterns", finite.tobytes(), len(finite)))
            cases.append(("specials", "zeros, infinities, NaNs (quiet and signalling), subnormals + random bits",
                          specials.tobytes() + raw.tobytes(), 128))
        return cases

    nb_sane, nb_rand = (16, 6) if bs == 32 else (4, 3)
    scales = SCALES[name]

    # sane: random bytes, scale fields finite in ±[1e-3, 1]
    blocks = rng.integers(0, 256, (nb_sane, ts), dtype=np.uint16).astype(np.uint8)
    for b in blocks:
        for off, kind in scales:
            put_scale(b, off, kind, sane_scale(rng, kind))
    cases.append(("sane", "random bytes; scale fields set to finite values in ±[1e-3, 1]",
                  blocks.tobytes(), nb_sane * bs))

    # edge: extreme-but-finite scales, all-zero and all-one quant bytes
    edge = []
    f16_edges = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF]
    f32_edges = [0x00000000, 0x80000000, 0x00000001, 0x00800000, 0x3F800000, 0x5A000000, 0xDA000000, 0x26000000]
    fill_patterns = [None, 0x00, 0xFF, 0x55, 0xAA, 0x0F, 0xF0, None]
    for i in range(len(f16_edges) if bs == 32 else 4):
        b = rng.integers(0, 256, ts, dtype=np.uint16).astype(np.uint8)
        pat = fill_patterns[i % len(fill_patterns)]
        if pat is not None:
            b[:] = pat
        for j, (off, kind) in enumerate(scales):
            edges = f16_edges if kind == "f16" else f32_edges
            put_scale_bits(b, off, kind, edges[(i * 2 + j * 3) % len(edges)])
        edge.append(b)
    edge = np.array(edge)
    cases.append(("edge", "scales at 0, -0, smallest/largest subnormal, largest finite; quant bytes "
                  "0x00/0xFF/0x55/0xAA/0x0F/0xF0 or random", edge.tobytes(), len(edge) * bs))

    # fully random bytes, kept where ggml's output is finite
    keep = []
    tries = 0
    while len(keep) < nb_rand and tries < 10000:
        tries += 1
        b = rng.integers(0, 256, ts, dtype=np.uint16).astype(np.uint8)
        y = g.to_float(name, tid, b.tobytes(), bs)
        if np.all(np.isfinite(y)):
            keep.append(b)
    keep = np.array(keep)
    cases.append(("random_finite", "fully random bytes, kept when ggml's output is all finite",
                  keep.tobytes(), len(keep) * bs))

    # fully random bytes with a non-finite scale: expected output holds Inf/NaN
    raw = rng.integers(0, 256, (2 if bs == 32 else 1, ts), dtype=np.uint16).astype(np.uint8)
    for i, b in enumerate(raw):
        off, kind = scales[0]
        put_scale_bits(b, off, kind, (0x7C00 if i == 0 else 0xFE00) if kind == "f16" else 0x7F800000)
    cases.append(("nonfinite", "random bytes with an Inf or NaN scale (NaN compares equal to NaN)",
                  raw.tobytes(), len(raw) * bs))
    return cases


def nudge_tie(x, mul, target):
    """An f32 near x with f32(x * mul) == target exactly, or None."""
    x = np.float32(x)
    mul = np.float32(mul)
    for step in range(0, 9):
        for sgn in (1, -1):
            c = x
            for _ in range(step):
                c = np.nextafter(c, np.float32(np.inf) * sgn, dtype=np.float32)
            if np.float32(c * mul) == np.float32(target):
                return c
    return None


def tie_rows(rng, n, block, kind, unit):
    """Rows where many x * scale land exactly on k + 0.5 for the given quantizer.

    kind q8_0: scale is ggml's id = 1 / (amax / 127); kind q8_K: iscale = -127 / max."""
    x = np.zeros(n, dtype=np.float32)
    for b0 in range(0, n, block):
        if unit:
            amax = np.float32(127.0)
        else:
            amax = np.float32(10.0 ** rng.uniform(-2, 2))
        sign = np.float32(-1.0 if rng.random() < 0.5 else 1.0)
        pos = int(rng.integers(0, block))
        if kind == "q8_0":
            d = np.float32(amax / np.float32(127.0))
            mul = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0)
        else:
            mx = np.float32(sign * amax)
            mul = np.float32(np.float32(-127.0) / mx)
        for j in range(block):
            if j == pos:
                x[b0 + j] = sign * amax
                continue
            k = int(rng.integers(-126, 126))
            target = np.float32(k + 0.5)
            c = nudge_tie(np.float32(target / mul), mul, target)
            if c is None or abs(c) >= amax:
                c = np.float32(0.0)
            x[b0 + j] = c
    return x


def input_rows(rng):
    """[(name, description, f32 array, used by)] — used by: 'all' or 'q8' or 'float'."""
    rows = []
    for off in (0.0, 1.0):
        i = np.arange(4096, dtype=np.float32)
        x = (0.1 + 2.0 * np.cos((i + np.float32(off)).astype(np.float32)).astype(np.float32).astype(np.float64)).astype(np.float32)
        rows.append((f"ggml_cos_{int(off)}", f"test-quantize-fns generate_data: 0.1 + 2*cos(i + {off}), n=4096",
                     x, "all"))
    n = 1024
    rows.append(("normal", "N(0, 1)", rng.standard_normal(n).astype(np.float32), "all"))
    x = rng.uniform(-1, 1, n) * np.repeat(10.0 ** rng.uniform(-3, 3, n // 32), 32)
    rows.append(("mixed_scale", "U(-1,1) * 10^U(-3,3) per 32 elements", x.astype(np.float32), "all"))
    x = rng.standard_normal(n)
    x[rng.integers(0, n, 12)] *= 100.0
    rows.append(("outliers", "N(0,1) with 12 elements scaled by 100", x.astype(np.float32), "all"))
    x = rng.uniform(0.5, 1.5, n) * np.repeat(10.0 ** rng.uniform(-2, 2, n // 256), 256)
    x[512:768] *= -1.0
    rows.append(("one_sided", "all-positive blocks (one all-negative 256 block)", x.astype(np.float32), "all"))
    x = np.zeros(n, dtype=np.float32)
    x[300] = 1.5
    x[600:616] = rng.standard_normal(16)
    x[900] = -1e-3
    rows.append(("zeros", "mostly exact zeros: all-zero blocks and blocks with one or a few non-zeros",
                 x.astype(np.float32), "all"))
    scales = np.repeat(np.array([1e-3, 1e-5, 1e-6, 1e-8, 1e-12, 1e-16, 1e-20, 1e-30] * 4), 32)
    x = rng.uniform(-1, 1, n) * scales
    rows.append(("tiny", "U(-1,1) * 1e-3 .. 1e-30 per 32 elements (f16 subnormal / zero scales, "
                 "below GROUP_MAX_EPS)", x.astype(np.float32), "all"))
    scales = np.repeat(np.array([1e2, 1e4, 1e5, 1e6, 5e6, 8.5e6, 1e7, 1e8] * 4), 32)
    x = rng.uniform(-1, 1, n) * scales
    rows.append(("large", "U(-1,1) * 1e2 .. 1e8 per 32 elements (f16 scale overflow to Inf at the top)",
                 x.astype(np.float32), "all"))
    x = np.repeat(rng.uniform(-2, 2, n // 32), 32).astype(np.float32)
    x[64:96] = np.where(np.arange(32) % 2 == 0, 0.75, -0.75)  # equal-magnitude max of both signs
    x[256:512] = np.where(np.arange(256) % 3 == 0, -3.0, 3.0)
    x[512:768] = np.where(np.arange(256) % 5 == 0, 2.0, -2.0)
    rows.append(("flat", "constant blocks, and blocks where ±max both occur (first-max sign rule)", x, "all"))
    rows.append(("ties_q8_0_unit", "d = 1 (amax 127): x = k + 0.5 exactly (roundf vs ties-to-even)",
                 tie_rows(rng, n, 32, "q8_0", True), "q8"))
    rows.append(("ties_q8_0_scaled", "random amax; x nudged so x * (1/(amax/127)) == k + 0.5 exactly in f32",
                 tie_rows(rng, n, 32, "q8_0", False), "q8"))
    rows.append(("ties_q8_K_unit", "max = ±127 so iscale = ∓1: x = k + 0.5 exactly",
                 tie_rows(rng, n, 256, "q8_K", True), "q8"))
    rows.append(("ties_q8_K_scaled", "random max; x nudged so x * (-127/max) == k + 0.5 exactly in f32",
                 tie_rows(rng, n, 256, "q8_K", False), "q8"))
    sp = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 5.96e-8, 2.98e-8, 65504.0, 65520.0,
                   65519.996, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8,
                   3.4e38, -3.4e38, 1e-40, 6.1e-5], dtype=np.float32)
    x = np.concatenate([sp, rng.standard_normal(236).astype(np.float32) *
                        np.float32(10.0) ** rng.uniform(-10, 10, 236).astype(np.float32)]).astype(np.float32)
    # a signalling NaN bit pattern too
    x.view(np.uint32)[20] = 0x7F800001
    x.view(np.uint32)[21] = 0xFFC12345
    rows.append(("float_specials", "NaN (quiet, signalling), ±Inf, subnormals, f16/bf16 rounding ties and "
                 "overflow edges, wide random magnitudes (F16/BF16/F32 only)", x, "float"))
    return rows


# --------------------------------------------------------------------------
def stable(call, x, undefined_sink):
    """Run a ggml quantizer so that bytes it leaves undefined are found and zeroed.

    Some ggml quantizers copy an uninitialised stack array into the output for blocks
    they skip (quantize_row_iq4_nl_ref on an all-zero block: its `L[]` is never
    written). Each call is preceded by a call on a different random "primer" row,
    which leaves different garbage in the same stack slots; bytes that differ between
    the two runs are undefined: they are stored as 0 and listed in `undefined`."""
    outs = []
    for seed in (1, 2):
        primer = np.random.default_rng(seed).standard_normal(x.size).astype(np.float32) * np.float32(seed * 3)
        call(primer)
        outs.append(bytearray(call(x)))
    a, b = outs
    bad = [i for i in range(len(a)) if a[i] != b[i]]
    for i in bad:
        a[i] = 0
    undefined_sink.extend(bad)
    return bytes(a)



def mask_iq4_nl_ref(x, q, undefined_sink):
    """quantize_row_iq4_nl_ref (ntry = -1) never writes L[] for a block whose max |x| is
    below GROUP_MAX_EPS (1e-15) but still packs it into qs: those 16 bytes are stack
    garbage (they differ from process to process). Zero them and list them."""
    q = bytearray(q)
    for b in range(x.size // 32):
        if np.max(np.abs(x[32 * b:32 * b + 32])) < np.float32(1e-15):
            for i in range(18 * b + 2, 18 * b + 18):
                q[i] = 0
                undefined_sink.append(i)
    return bytes(q)


def ranges(idx):
    out = []
    for i in idx:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return out


def build(out_dir, check_only=False):
    rng = np.random.default_rng(SEED)
    g = Ggml()
    for name, tid, bs, ts in TYPES:
        g.check_traits(name, tid, bs, ts)

    problems = []  # must-agree failures
    notes = []
    files = {}
    index = {
        "format": 1,
        "about": "ggml block-format test vectors for crates/parity-quant/tests/quant_oracle.rs, written by scripts/quant_vectors.py. "
                 "Ranges are [byte offset, byte length]; f32 data is little endian.",
        "generator": {
            "script": "scripts/quant_vectors.py",
            "seed": SEED,
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
            "ggml": g.version,
            "ggml_lib": os.path.realpath(os.path.join(g.libdir, "libggml-base.so")).split("site-packages/")[-1],
            "ggml_cpu_features": g.cpu_features,
            "gguf_py": _dist_version("gguf"),
        },
        "oracles": {
            "ggml.to_float": "ggml_get_type_traits(type)->to_float via ctypes (libggml-base)",
            "ggml.dequantize_row_q8_K": "exported dequantize_row_q8_K (type_traits[Q8_K].to_float is NULL)",
            "ggml.q8_0_to_float_on_q8_1": "no ggml decoder exists for Q8_1: Q8_0's to_float on (d, qs) with s dropped",
            "identity": "F32: ggml has no to_float; the bytes are the values",
            "ggml_quantize_chunk": "ggml_quantize_chunk(type, x, dst, 0, 1, n, imatrix=NULL) (== from_float_ref)",
            "ggml.from_float_ref": "ggml_get_type_traits(type)->from_float_ref (quantize_row_*_ref)",
            "ggml.quantize_row_q8_K_ref": "exported quantize_row_q8_K_ref (type_traits[Q8_K].from_float_ref is NULL)",
            "ggml_cpu.from_float": "ggml_get_type_traits_cpu(type)->from_float: the CPU backend's SIMD activation "
                                   "quantizer (informative, stored only where it differs from the reference)",
            "gguf_py": "gguf.quants.dequantize / gguf.quants.quantize (numpy)",
        },
        "inputs": {"file": "inputs.f32", "rows": []},
        "types": {},
    }

    # shared inputs
    inputs = bytearray()
    rows = input_rows(rng)
    row_data = {}
    for rname, desc, x, used_by in rows:
        x = np.asarray(x, dtype="<f4")
        index["inputs"]["rows"].append({"name": rname, "desc": desc, "n": int(x.size), "used_by": used_by,
                                        "range": [len(inputs), x.nbytes]})
        inputs += x.tobytes()
        row_data[rname] = (x, used_by)
    files["inputs.f32"] = bytes(inputs)

    chunk_support = {}
    for name, tid, bs, ts in TYPES:
        ok, how = probe_quantize_chunk(name, tid, bs)
        chunk_support[name] = (ok, how)

    for name, tid, bs, ts in TYPES:
        blob = bytearray()

        def put(data: bytes):
            off = len(blob)
            blob.extend(data)
            return [off, len(data)]

        entry = {"id": tid, "block_size": bs, "type_size": ts, "file": f"{name}.bin", "dequant": [], "quant": []}
        if name == "f32":
            deq_oracle = "identity"
        elif name == "q8_K":
            deq_oracle = "ggml.dequantize_row_q8_K"
        elif name == "q8_1":
            deq_oracle = "ggml.q8_0_to_float_on_q8_1"
        else:
            deq_oracle = "ggml.to_float"
        for cname, desc, src, n in dequant_cases(g, rng, name, tid, bs, ts):
            y = g.to_float(name, tid, src, n)
            gy = gguf_dequant(name, src, n)
            if gy is None:
                gg = "unsupported"
            else:
                ok, idx, nanp = same_f32(y, gy)
                if ok:
                    gg = "agree" if nanp == 0 else f"agree (NaN payloads differ in {nanp})"
                else:
                    nbad = int((~((y.view(np.uint32) == gy.view(np.uint32)) | (np.isnan(y) & np.isnan(gy)))).sum())
                    gg = (f"DISAGREE in {nbad}/{n}: first at {idx}: ggml {y[idx]!r} "
                          f"(0x{y.view(np.uint32)[idx]:08x}) gguf-py {gy[idx]!r} (0x{gy.view(np.uint32)[idx]:08x})")
                    problems.append(f"{name} dequant/{cname}: gguf-py vs ggml: {gg}")
            entry["dequant"].append({
                "name": cname, "desc": desc, "n": n, "src": put(src),
                "expected": put(y.astype("<f4").tobytes()), "oracle": deq_oracle, "gguf_py": gg,
                "nonfinite": int((~np.isfinite(y)).sum()),
            })

        # quantization
        ok_chunk, how_chunk = chunk_support[name]
        entry["ggml_quantize_chunk"] = how_chunk
        for rname, (x, used_by) in row_data.items():
            if used_by == "q8" and name not in MUST_MATCH_QUANT:
                continue
            if used_by == "float" and bs != 1:
                continue
            if used_by != "float" and name == "f32":
                continue
            if bs == 1 and rname.startswith("ggml_cos"):
                continue  # keeps the F16/BF16 files small; the other rows cover rounding
            ref_case = None
            if ok_chunk:
                und_q = []
                q = stable(lambda v: g.quantize_chunk(tid, v, 1, ts, bs), x, und_q)
                oracle = "ggml_quantize_chunk"
                t = g.traits(tid)
                if t.from_float_ref:
                    und_r = []
                    r = stable(lambda v: g.ref_quantize(name, tid, v, ts, bs), x, und_r)
                    if name == "iq4_nl":
                        r = mask_iq4_nl_ref(x, r, und_r)
                    if r != q:
                        # IQ4_NL: quantize_iq4_nl (the chunk path, llama-quantize) searches 7
                        # scales (ntry = 7); quantize_row_iq4_nl_ref uses ntry = -1.
                        nb = sum(1 for a, b in zip(r, q) if a != b)
                        ref_case = (r, nb, und_r)
                        notes.append(f"{name}/{rname}: ggml_quantize_chunk != from_float_ref in {nb} bytes")
            else:
                und_q = []
                q = stable(lambda v: g.ref_quantize(name, tid, v, ts, bs), x, und_q)
                oracle = "ggml.quantize_row_q8_K_ref" if name == "q8_K" else "ggml.from_float_ref"
            case = {"input": rname, "n": int(x.size), "expected": put(q), "oracle": oracle}
            if und_q:
                case["undefined"] = ranges(und_q)
                notes.append(f"{name}/{rname}: {oracle} leaves {len(und_q)} bytes undefined (stored as 0)")
            if ref_case is not None:
                case["from_float_ref"] = put(ref_case[0])
                case["from_float_ref_bytes_differing"] = ref_case[1]
                if ref_case[2]:
                    case["from_float_ref_undefined"] = ranges(ref_case[2])
                    notes.append(f"{name}/{rname}: from_float_ref leaves {len(ref_case[2])} bytes undefined "
                                 "(uninitialised L[] for all-zero blocks; stored as 0)")
            if name in MUST_MATCH_QUANT:
                und_c = []
                c = stable(lambda v: g.cpu_quantize(tid, v, ts, bs), x, und_c)
                assert not und_c, (name, rname)
                if c == q:
                    case["cpu_from_float"] = "same"
                else:
                    nb = sum(1 for a, b in zip(c, q) if a != b)
                    case["cpu_from_float"] = put(c)
                    case["cpu_from_float_bytes_differing"] = nb
                    notes.append(f"{name}/{rname}: CPU from_float differs from reference in {nb} bytes")
            gqb = gguf_quant(name, x)
            if gqb is None:
                case["gguf_py"] = "unsupported"
            elif gqb == q:
                case["gguf_py"] = "agree"
            else:
                nb = sum(1 for a, b in zip(gqb, q) if a != b)
                first = next(i for i, (a, b) in enumerate(zip(gqb, q)) if a != b)
                case["gguf_py"] = f"DISAGREE in {nb}/{len(q)} bytes, first at byte {first} (block {first // ts})"
                notes.append(f"{name} quant/{rname}: gguf-py {case['gguf_py']}")
            entry["quant"].append(case)
        files[f"{name}.bin"] = bytes(blob)
        index["types"][name] = entry

    index["notes"] = notes
    index["files"] = {k: {"bytes": len(v), "sha256": hashlib.sha256(v).hexdigest()} for k, v in sorted(files.items())}
    text = _dump(index)
    files["index.json"] = text.encode()

    total = sum(len(v) for v in files.values())
    if check_only:
        bad = []
        for k, v in files.items():
            p = os.path.join(out_dir, k)
            if not os.path.exists(p) or open(p, "rb").read() != v:
                bad.append(k)
        print(f"quant_vectors: {len(files)} files, {total} bytes; "
              + ("up to date" if not bad else "differ: " + ", ".join(bad)))
        return 1 if bad else 0

    os.makedirs(out_dir, exist_ok=True)
    for k, v in files.items():
        with open(os.path.join(out_dir, k), "wb") as f:
            f.write(v)
    for line in notes:
        print("  note:", line)
    for line in problems:
        print("  ORACLES DISAGREE:", line)
    print(f"quant_vectors: wrote {len(files)} files, {total} bytes to {os.path.relpath(out_dir, ROOT)} "
          f"(ggml {g.version}, llama_cpp {index['generator']['llama_cpp_python']}, gguf {index['generator']['gguf_py']}); "
          f"{len(notes)} notes")
    return 1 if problems else 0


def _dump(index):
    """JSON with one case per line: readable diffs, small file."""
    def compact(v):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    out = ["{"]
    items = list(index.items())
    for i, (k, v) in enumerate(items):
        sep = "," if i + 1 < len(items) else ""
        if k == "types":
            out.append(' "types": {')
            tys = list(v.items())
            for j, (tn, e) in enumerate(tys):
                head = {kk: vv for kk, vv in e.items() if kk not in ("dequant", "quant")}
                out.append(f'  {json.dumps(tn)}: {{' + compact(head)[1:-1] + ",")
                for key in ("dequant", "quant"):
                    out.append(f'   "{key}": [')
                    for n_, c in enumerate(e[key]):
                        out.append("    " + compact(c) + ("," if n_ + 1 < len(e[key]) else ""))
                    out.append("   ]" + ("," if key == "dequant" else ""))
                out.append("  }" + ("," if j + 1 < len(tys) else ""))
            out.append(" }" + sep)
        elif k == "inputs":
            out.append(f' "inputs": {{"file": {json.dumps(v["file"])}, "rows": [')
            for n_, r in enumerate(v["rows"]):
                out.append("   " + compact(r) + ("," if n_ + 1 < len(v["rows"]) else ""))
            out.append(" ]}" + sep)
        else:
            out.append(f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False, indent=None)}{sep}")
    out.append("}")
    text = "\n".join(out) + "\n"
    json.loads(text)
    return text


def _dist_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    a = ap.parse_args()
    sys.exit(build(a.out, a.check))


if __name__ == "__main__":
    main()
