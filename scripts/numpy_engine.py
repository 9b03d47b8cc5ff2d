#!/usr/bin/env python3
"""An out-of-process inference engine of our own, in numpy, for testing parity on external traces.

It reads a GGUF file with gguf-py, runs a llama (llama3's RoPE frequency factors too) or qwen2
model (biases, NORM/NEOX RoPE, GQA, a KV cache, teacher-forced decode steps) and writes a parity trace (docs/trace-format.md), exactly as
an engine author's dump would look to `parity diff`. It shares no computation with parity: weights
are decoded by gguf-py, every op is written again here. The trace is written through the Python
writer an engine author would use (parity_trace: bindings/python beside scripts/, else the
installed parity-trace package).

  numpy_engine.py MODEL.gguf --golden golden/tiny-llama-q8_0 --out /tmp/np [--rounding ggml|ggml-scalar|q8k|q8_1|f16|bf16|f16-acc|f16-acc-unfused|tf32|f16-trunc|uint8-token]
      [--taps all|sparse] [--kv f32|f16] [--f32-sums] [--mutate NAME] [--no-bos|--double-bos]
      [--layout head-major [--declare]]

--rounding ggml quantizes each matmul input as ggml's CPU backend does before the dot product
(Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL weights, Q8_1 for Q4_1/Q5_1, Q8_K for K-quants, f16 for F16;
the x86 AVX quantizer: 127/amax, round half to even). The other rounding families:
ggml-scalar (ggml's quantize_row_q8_0_ref: 1/(amax/127), roundf, half away from zero), q8k (Q8_K
activations for every quantized weight, as an AVX512-VNNI engine), q8_1 (llama.cpp's GPU MMVQ:
x / (amax/127), roundf), f16 and bf16 (every matmul input rounded), f16-acc (inputs and weights
rounded to f16, products summed in one f16 running sum in the order of llama.cpp Vulkan's tiled
matmul, an f16 fma each) and f16-acc-unfused (the same with each product rounded to f16 before
its add, as that matmul runs on Mesa's lavapipe) and tf32 (inputs and weights rounded to TF32, as
tensor cores run f32 GEMMs). f16-trunc (every matmul input cut to f16 toward zero, as a
hand-written conversion that drops bits does) and uint8-token (every matmul input quantized per
token to uint8 with a zero point, as dynamic-quantization engines do) are roundings parity does
not model: engines for its unknown-rounding path. --mutate switches on one of parity's catalog bugs (`parity
mutations`); the manifest does not record it, so diff judges it blind.
--kv f16 stores the K/V cache in f16, as llama.cpp does by default; --kv-decode reads it as another
type in the steps after the first (the cache keeps the f32 values; each step kind rounds what it
reads): an engine whose prompt and decode kernels read the cache unlike each other.
"""
import argparse
import json
import os
import sys

# One BLAS thread (unless the caller says otherwise): the matmuls here are a few rows each, and
# OpenBLAS's idle workers spin between them; a selftest of a 16-layer model took 2x the CPU
# time (and 2x the wall time on 2 cores) with numpy's default threads. Set before the import.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

try:
    import gguf
    from gguf import GGMLQuantizationType as Q
except ImportError as e:  # pragma: no cover - reported to the caller
    print(f"error: numpy_engine.py needs gguf-py and numpy ({e})", file=sys.stderr)
    sys.exit(2)

# The trace writer: the checkout's bindings/python beside scripts/ (what parity runs, also
# unpacked with the installed binary), else an installed parity-trace package.
_PKG = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                     "bindings", "python"))
if os.path.isfile(os.path.join(_PKG, "parity_trace", "__init__.py")):
    sys.path.insert(0, _PKG)
try:
    from parity_trace import TraceError, TraceWriter
except ImportError as e:  # pragma: no cover - reported to the caller
    print(f"error: numpy_engine.py needs the parity_trace package: bindings/python in a parity "
          f"checkout beside scripts/, or `pip install parity-trace` ({e})", file=sys.stderr)
    sys.exit(2)

F32, F64 = np.float32, np.float64

COMPUTE_MUTATIONS = [
    "rope-neox", "rope-theta", "qk-permute", "gqa-modulo", "transposed-lm-head", "transposed-wo",
    "rms-eps-10x", "norm-weight-twice", "norm-weight-missing", "swiglu-swap", "kv-off-by-one",
    "no-causal-mask", "decoder-nibble-order", "tied-output", "attn-norm-weight-twice",
    "rope-pos-off-by-one", "kv-slot-late", "no-final-norm", "attn-out-twice",
    "causal-mask-off-by-one", "ffn-out-twice", "rope-q-skipped", "rope-k-skipped",
    "norm-weight-plus-one", "causal-mask-excludes-self", "no-attn-norm", "no-ffn-norm",
    "no-attn-residual", "no-ffn-residual", "no-qkv-bias", "wrong-ffn-act", "softmax-no-max",
    "rope-factors-ignored", "decoder-no-offset", "rms-sum-not-mean", "rms-no-sqrt", "layernorm-not-rms",
    "rope-angle-negated", "kv-head-zero", "v-from-k", "silu-wrong-sign", "residual-from-normed",
    "attn-residual-from-normed", "ffn-residual-from-normed", "attend-before-store",
    # position bugs, as src/backend/mutation.rs; a width may follow (kv-ring-wrap=128)
    "kv-ring-wrap", "rope-pos-wrap", "mask-tail-block", "kv-reset-per-turn", "pos-restart-per-turn",
]
WRAP = 8  # the catalog's width of the position bugs
# (offset of the nibble array in a block, its length, block bytes), as src/backend/mutation.rs.
NIBBLES = {
    Q.Q4_0: (2, 16, 18), Q.IQ4_NL: (2, 16, 18), Q.Q4_1: (4, 16, 20), Q.Q5_0: (6, 16, 22),
    Q.Q5_1: (8, 16, 24), Q.Q4_K: (16, 128, 144), Q.Q5_K: (48, 128, 176),
}
# (block bytes, offset) of the types whose decoder subtracts an offset from its quants.
OFFSETS = {Q.Q4_0: (18, 8.0), Q.Q5_0: (22, 16.0)}
KQUANTS = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS}


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


# With --serve, one model's reader and decoded weights outlive a run: the next run on the same
# file (same size and mtime) reuses them. Decoded arrays are read-only, so a run cannot leave a
# change for the next one.
_OPEN = {"key": None, "reader": None, "weights": {}}


def _opened(path):
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if _OPEN["key"] != key:
        _OPEN.update(key=None, reader=None, weights={})
        _OPEN.update(key=key, reader=gguf.GGUFReader(path))
    return _OPEN["reader"], _OPEN["weights"]


class Model:
    def __init__(self, path, mutation, from_layer=0):
        self.path = path
        self.from_layer = from_layer
        r, self.decoded = _opened(path)
        self.fields = r.fields
        self.tensors = {t.name: t for t in r.tensors}
        self.mutation = mutation
        arch = self.meta("general.architecture")
        if arch not in ("llama", "qwen2"):
            fail(f"unsupported architecture '{arch}' (llama, qwen2)")
        self.arch = arch
        k = lambda s: f"{arch}.{s}"
        self.n_embd = int(self.meta(k("embedding_length")))
        self.n_layer = int(self.meta(k("block_count")))
        self.n_head = int(self.meta(k("attention.head_count")))
        self.n_head_kv = int(self.meta(k("attention.head_count_kv"), self.n_head))
        self.head_dim = int(self.meta(k("attention.key_length"), self.n_embd // self.n_head))
        self.n_rot = int(self.meta(k("rope.dimension_count"), self.head_dim))
        self.eps = F32(self.meta(k("attention.layer_norm_rms_epsilon")))
        self.out_eps = None  # --output-norm-eps: the final norm's own eps
        self.theta = F32(self.meta(k("rope.freq_base"), 10000.0))
        self.freq_scale = F32(1.0)
        if self.meta(k("rope.scaling.type"), "none") == "linear":
            self.freq_scale = F32(1.0 / float(self.meta(k("rope.scaling.factor"), 1.0)))
        self.neox = arch == "qwen2"
        # llama3's frequency factors (rope_freqs.weight, [n_rot/2]): pair i turns at
        # freq_scale * (p * base^(-2i/n_rot) / factor[i]), as ggml's rope.
        self.has_rope_freqs = "rope_freqs.weight" in self.tensors
        self.bos = self.meta("tokenizer.ggml.bos_token_id", None)
        self.n_vocab = int(self.tensors["token_embd.weight"].shape[1])
        self.cache = {}

    def meta(self, key, default=KeyError):
        f = self.fields.get(key)
        if f is None:
            if default is KeyError:
                fail(f"missing metadata key '{key}'")
            return default
        v = f.parts[f.data[0]]
        if f.types and f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(v).decode("utf-8")
        return v[0].item()

    def bug_in(self, name):
        """Whether a bug acting from layer `from_layer` on reaches this tensor."""
        if name.startswith("blk."):
            return int(name.split(".")[1]) >= self.from_layer
        return name != "token_embd.weight" or self.from_layer == 0

    def has(self, name):
        return name in self.tensors

    def ty(self, name):
        return self.tensors[name].tensor_type

    def weight(self, name):
        """The tensor as float32, numpy shape (ggml ne reversed): matrices are [n_out, n_in]."""
        if name not in self.cache:
            t = self.tensors[name]
            nibbled = (self.mutation == "decoder-nibble-order" and t.tensor_type in NIBBLES
                       and self.bug_in(name))
            # decoder-no-offset: Q4_0/Q5_0 decoded as d * q, not d * (q - 8) (q - 16)
            unoffset = (self.mutation == "decoder-no-offset" and t.tensor_type in OFFSETS
                        and self.bug_in(name))
            variant = "nibbles" if nibbled else "no-offset" if unoffset else None
            if (name, variant) in self.decoded:
                self.cache[name] = self.decoded[(name, variant)]
                return self.cache[name]
            data = np.asarray(t.data)
            if nibbled:
                off, n, block = NIBBLES[t.tensor_type]
                raw = data.reshape(-1, block).copy()
                q = raw[:, off:off + n]
                raw[:, off:off + n] = ((q & 0x0F) << 4) | (q >> 4)
                data = raw.reshape(data.shape)
            w = gguf.quants.dequantize(data, t.tensor_type).astype(F32)
            if unoffset:
                block, off = OFFSETS[t.tensor_type]
                d = data.reshape(-1, block)[:, :2].copy().view(np.float16).astype(F32).reshape(-1)
                w = (w.reshape(-1, 32) + F32(off) * d[:, None]).astype(F32).reshape(w.shape)
            shape = tuple(int(d) for d in reversed(t.shape))
            w = w.reshape(shape)
            w.flags.writeable = False
            self.cache[name] = self.decoded[(name, variant)] = w
        return self.cache[name]


# ---- ggml's CPU activation rounding -------------------------------------------------------

def roundf(x):
    """C's roundf: half away from zero (ggml's scalar reference quantizers)."""
    return (np.sign(x) * np.floor(np.abs(x) + F32(0.5))).astype(F32)


def q8_0_x86(x, half_away=False):
    """quantize_row_q8_0 (x86 AVX) then dequantize: blocks of 32, d = f16(amax/127).
    half_away: quantize_row_q8_0_ref (ggml's scalar reference, roundf) instead of rint."""
    b = x.reshape(-1, 32)
    amax = np.max(np.abs(b), axis=1).astype(F32)
    with np.errstate(divide="ignore"):
        if half_away:  # id = 1/d, d = amax/127
            d = (amax / F32(127.0)).astype(F32)
            idv = np.where(d != 0, F32(1.0) / d, F32(0.0)).astype(F32)
        else:
            idv = np.where(amax != 0, F32(127.0) / amax, F32(0.0)).astype(F32)
    r = roundf if half_away else np.rint  # rint: half to even
    q = np.clip(r((b * idv[:, None]).astype(F32)), -128, 127).astype(F32)
    d = (amax / F32(127.0)).astype(np.float16).astype(F32)
    return (q * d[:, None]).reshape(x.shape).astype(F32)


def q8_k(x):
    """quantize_row_q8_K then dequantize: blocks of 256, iscale = -127/max (signed max)."""
    b = x.reshape(-1, 256)
    idx = np.argmax(np.abs(b), axis=1)  # the first of equal |x|, as ggml's strict >
    mx = b[np.arange(b.shape[0]), idx].astype(F32)
    out = np.zeros_like(b)
    nz = mx != 0
    iscale = (F32(-127.0) / mx[nz]).astype(F32)
    q = np.minimum(np.rint((iscale[:, None] * b[nz]).astype(F32)), 127).astype(F32)
    d = (F32(1.0) / iscale).astype(F32)
    out[nz] = q * d[:, None]
    return out.reshape(x.shape).astype(F32)


def bf16(x):
    u = x.astype(F32).view(np.uint32)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
    return u.astype(np.uint32).view(F32)


def q8_1_gpu(x):
    """llama.cpp's GPU quantize_q8_1 (CUDA/Vulkan MMVQ) then dequantize: blocks of 32,
    d = amax/127, q = roundf(x / d), d stored as f16."""
    b = x.reshape(-1, 32)
    amax = np.max(np.abs(b), axis=1).astype(F32)
    d = (amax / F32(127.0)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(amax[:, None] != 0, roundf((b / d[:, None]).astype(F32)), F32(0.0))
    return (q * d.astype(np.float16).astype(F32)[:, None]).reshape(x.shape).astype(F32)


QUANTIZED = {Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.IQ4_NL, Q.Q4_1, Q.Q5_1} | KQUANTS


def round_input(ty, x, family="ggml"):
    """The activation rounding of one rounding family before a matmul with a `ty` weight."""
    if family == "f16":
        return x.astype(np.float16).astype(F32)
    if family == "bf16":
        return bf16(x)
    if family == "q8k" and ty in QUANTIZED and x.shape[-1] % 256 == 0:
        return q8_k(x)  # an AVX512-VNNI engine: Q8_K activations for every quantized weight
    if family == "q8_1" and ty in QUANTIZED:
        return q8_1_gpu(x)
    if ty in (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.IQ4_NL, Q.Q4_1, Q.Q5_1):
        # Q8_1 differs from Q8_0 only in the stored block sum, which the dequantized values
        # do not carry: the same rounding of x.
        return q8_0_x86(x, half_away=family == "ggml-scalar")
    if ty in KQUANTS:
        return q8_k(x)
    if ty == Q.F16:
        return x.astype(np.float16).astype(F32)
    if ty == Q.BF16:
        return bf16(x)
    return x


def tf32(x):
    """Round f32 to TF32 (10 mantissa bits, half to even), as NVIDIA tensor cores read f32 GEMM
    inputs when TF32 is allowed (cuBLAS, PyTorch's allow_tf32)."""
    b = np.ascontiguousarray(x, F32).view(np.uint32).astype(np.uint64)
    b = (b + 0x0FFF + ((b >> 13) & 1)) & ~np.uint64(0x1FFF)
    return b.astype(np.uint32).view(F32)


def f16_trunc(x):
    """f32 to f16 by dropping the 13 low fraction bits (toward zero), as a hand-written f32 to f16
    conversion that shifts the bits without rounding does."""
    b = np.ascontiguousarray(x, F32).view(np.uint32) & np.uint32(0xFFFFE000)
    return b.view(F32).astype(np.float16).astype(F32)


def uint8_token(x):
    """Every row (token) quantized to uint8 with a zero point (asymmetric: its range, 0 included,
    in 255 steps; ties to even), as dynamic-quantization engines quantize matmul inputs (ONNX
    Runtime's DynamicQuantizeLinear, here per token)."""
    x = np.asarray(x, F32)
    lo = np.minimum(np.min(x, axis=-1, keepdims=True), F32(0.0))
    hi = np.maximum(np.max(x, axis=-1, keepdims=True), F32(0.0))
    d = ((hi - lo) / F32(255.0)).astype(F32)
    safe = np.where(d != 0, d, F32(1.0))
    zp = np.rint((-lo / safe).astype(F32))
    q = np.clip(np.rint((x / safe).astype(F32)) + zp, 0, 255)
    return np.where(d != 0, (q - zp) * d, F32(0.0)).astype(F32)


def f16_acc_matmul(x, w, ty, fused=True):
    """The f16-acc families: llama.cpp Vulkan's tiled matmul (mul_mm) with an f16 accumulator.
    Inputs and weights rounded to f16; for each output one f16 running sum over k, in the
    shader's order: k in vectors of 2 for dequantized weights, of 4 for F16 ones, the last of
    each vector first (its dot_product nests fma(a.x, b.x, fma(a.y, b.y, acc))). fused: one
    rounding per product and add (product and sum exact in f64 first); else the product is
    rounded to f16 before the add (drivers that split fma, as Mesa's lavapipe). F32 weights
    take the f32 accumulator on f16 inputs and weights."""
    x16 = x.astype(np.float16).astype(F64)
    w16 = w.astype(np.float16).astype(F64)
    if ty == Q.F32:
        return (x16 @ w16.T).astype(F32)
    group = 4 if ty == Q.F16 else 2
    K = x.shape[1]
    order = [g + group - 1 - j for g in range(0, K, group) for j in range(group) if g + group - 1 - j < K]
    acc = np.zeros((x.shape[0], w.shape[0]), np.float16)
    for k in order:
        p = x16[:, k, None] * w16[None, :, k]
        if not fused:
            p = p.astype(np.float16).astype(F64)
        acc = (acc.astype(F64) + p).astype(np.float16)
    return acc.astype(F32)


# ---- the forward pass ---------------------------------------------------------------------

def cache_store(kind, rows):
    """Rows as a K/V cache of type `kind` stores them and reads them back (f32)."""
    if kind == "f32":
        return rows
    if kind == "f16":
        return rows.astype(np.float16).astype(F32)
    b = rows.reshape(-1, 32).astype(F32)
    if kind == "q8_0":
        amax = np.abs(b).max(axis=1, keepdims=True)
        d = amax / F32(127)
        inv = np.where(d == 0, F32(0), F32(1) / np.where(d == 0, F32(1), d))
        q = np.rint(b * inv)
        out = q * d.astype(np.float16).astype(F32)
    else:  # q4_0, ggml's reference quantizer: the signed value of largest magnitude maps to -8
        idx = np.abs(b).argmax(axis=1)
        mx = b[np.arange(len(b)), idx][:, None]
        d = mx / F32(-8)
        inv = np.where(d == 0, F32(0), F32(1) / np.where(d == 0, F32(1), d))
        q = np.minimum(F32(15), np.trunc(b * inv + F32(8.5)))
        out = (q - F32(8)) * d.astype(np.float16).astype(F32)
    return out.astype(F32).reshape(rows.shape)


class Engine:
    def __init__(self, m, rounding, mutation, n_ctx, kv="f32"):
        self.m, self.rounding, self.mut = m, rounding, mutation
        # The output projection's own rounding, where it differs (None: `rounding`).
        self.output_rounding = None
        # Sum the plain matmuls in f32 (numpy's einsum order), as a plain loop engine does,
        # instead of in f64.
        self.f32_sums = False
        # "f16": the K/V cache stores f16 values, as llama.cpp's default cache type does (the
        # k_rope and v taps stay the f32 values computed before the store).
        self.kv = kv
        # The cache type the steps after the first read, where it differs (None: `kv`). The
        # cache then keeps the f32 values and each step kind rounds what it reads.
        self.kv_decode = None
        self.steps_run = 0
        self.n_ctx = n_ctx
        kv = m.n_head_kv * m.head_dim
        self.k_cache = [np.zeros((n_ctx + 1, kv), F32) for _ in range(m.n_layer)]
        self.v_cache = [np.zeros((n_ctx + 1, kv), F32) for _ in range(m.n_layer)]
        # the first position of the latest step of several tokens after the first (a turn, a
        # chunk): where kv-reset-per-turn empties the cache, pos-restart-per-turn counts from
        self.turn_start = 0

    def matmul(self, name, x, transposed=False, lm_head=False):
        rounding = self.output_rounding if lm_head and self.output_rounding else self.rounding
        w = self.m.weight(name)
        if transposed:
            # out[r] = sum_i W_flat[i * n_out + r] x[i]: the flat data read as [n_in, n_out].
            n_out, n_in = w.shape
            w = w.reshape(n_in, n_out).T
        if rounding in ("f16-acc", "f16-acc-unfused"):
            return f16_acc_matmul(x, w, self.m.ty(name), fused=rounding == "f16-acc")
        if rounding == "tf32":
            x, w = tf32(x), tf32(w)
        elif rounding in ("f16-trunc", "uint8-token"):
            x = f16_trunc(x) if rounding == "f16-trunc" else uint8_token(x)
        elif rounding != "none":
            x = round_input(self.m.ty(name), x, rounding)
        if self.f32_sums:
            return np.einsum("ti,oi->to", x.astype(F32), w.astype(F32), dtype=F32)
        return (x.astype(F64) @ w.T.astype(F64)).astype(F32)

    def norm(self, x, name, mut):
        w = self.m.weight(name)
        if mut == "norm-weight-missing":
            w = np.ones_like(w)
        if mut == "norm-weight-twice" or (
                mut == "attn-norm-weight-twice" and name.endswith(".attn_norm.weight")):
            w = (w * w).astype(F32)
        if mut == "norm-weight-plus-one":
            w = (w + F32(1.0)).astype(F32)
        eps = self.m.eps * F32(10.0) if mut == "rms-eps-10x" else self.m.eps
        if name == "output_norm.weight" and self.m.out_eps is not None:
            eps = self.m.out_eps
        if mut == "layernorm-not-rms":  # a LayerNorm (no bias) where the model's is RMSNorm
            x = (x - (np.sum(x.astype(F64), axis=1) / x.shape[1]).astype(F32)[:, None]).astype(F32)
        n = 1 if mut == "rms-sum-not-mean" else x.shape[1]  # the mean's / n left out
        mean = (np.sum((x * x).astype(F64), axis=1) / n).astype(F32)
        if mut == "rms-no-sqrt":
            scale = (F32(1.0) / (mean + eps)).astype(F32)
        else:
            scale = (F32(1.0) / np.sqrt(mean + eps)).astype(F32)
        return ((x * scale[:, None]).astype(F32) * w).astype(F32)

    def rope(self, x, positions, n_heads, mut):
        m = self.m
        neox = m.neox != (mut == "rope-neox")
        base = m.theta
        if mut == "rope-theta":
            base = F32(100000.0) if base == F32(10000.0) else F32(10000.0)
        theta_scale = F32(np.power(base, F32(-2.0) / F32(m.n_rot), dtype=F32))
        x = x.copy()
        half = m.n_rot // 2
        ff = np.ones(half, F32)
        if m.has_rope_freqs and mut != "rope-factors-ignored":
            ff = m.weight("rope_freqs.weight").reshape(-1)[:half].astype(F32)
        for t, pos in enumerate(positions):
            cos = np.zeros(half, F32)
            sin = np.zeros(half, F32)
            theta = F32(pos)
            for i in range(half):
                th = F32(m.freq_scale * F32(theta / ff[i]))
                cos[i], sin[i] = np.cos(th), np.sin(th)
                theta = F32(theta * theta_scale)
            v = x[t]  # [n_heads, head_dim]
            a = np.arange(half) if neox else 2 * np.arange(half)
            b = a + half if neox else a + 1
            x0, x1 = v[:, a].copy(), v[:, b].copy()
            if mut == "rope-angle-negated":  # rotated by -theta: the sine's sign flipped
                sin = -sin
            v[:, a] = x0 * cos - x1 * sin
            v[:, b] = x0 * sin + x1 * cos
        return x

    def forward(self, tokens, pos0, rec):
        m = self.m
        T = len(tokens)
        nh, nkv, hd = m.n_head, m.n_head_kv, m.head_dim
        positions = list(range(pos0, pos0 + T))
        n_kv = pos0 + T
        if T > 1 and pos0 > 0:
            self.turn_start = pos0
        # --embd-id: the lookup reads the row of the id an expression of t (the id) gives
        rows = [int(m.embd_id(t)) % m.n_vocab for t in tokens] if m.embd_id else tokens
        x = m.weight("token_embd.weight")[np.array(rows)].astype(F32)
        rec("embd", None, x)
        for l in range(m.n_layer):
            p = f"blk.{l}."
            # A bug placed deep (--mutate-from-layer) acts from that layer on.
            mut = self.mut if l >= m.from_layer else None
            xn = x if mut == "no-attn-norm" else self.norm(x, p + "attn_norm.weight", mut)
            rec("attn_norm", l, xn)
            q = self.matmul(p + "attn_q.weight", xn)
            k = self.matmul(p + "attn_k.weight", xn)
            v = self.matmul(p + "attn_v.weight", xn)
            for t, name in ((q, "attn_q.bias"), (k, "attn_k.bias"), (v, "attn_v.bias")):
                if m.has(p + name) and mut != "no-qkv-bias":
                    t += m.weight(p + name)
            q = q.reshape(T, nh, hd)
            k = k.reshape(T, nkv, hd)
            v = v.reshape(T, nkv, hd)
            if mut == "qk-permute":
                # dim 2i+s takes dim s*hd/2 + i (convert_hf_to_gguf's permute once more)
                perm = np.array([s * (hd // 2) + i for i in range(hd // 2) for s in range(2)])
                q, k = q[:, :, perm], k[:, :, perm]
            rec("q", l, q)
            rec("k", l, k)
            rec("v", l, v)
            # rope-pos-off-by-one: decode steps rotate one position late, the cache slot right.
            rp = [ps + 1 for ps in positions] if (mut == "rope-pos-off-by-one" and pos0 > 0) else positions
            if mut == "rope-pos-wrap":
                rp = [ps % m.wrap for ps in positions]
            if mut == "pos-restart-per-turn":
                rp = [ps - self.turn_start for ps in positions]
            # --rope-at/--rope-q-at/--rope-k-at: positions from an expression of p (the row's
            # position) and s (its step's first), a position bug of any shape.
            rq = [int(m.q_at(ps, pos0)) for ps in rp] if m.q_at else rp
            rk = [int(m.k_at(ps, pos0)) for ps in rp] if m.k_at else rp
            if mut != "rope-q-skipped":
                q = self.rope(q, rq, nh, mut)
            if mut != "rope-k-skipped":
                k = self.rope(k, rk, nkv, mut)
            rec("q_rope", l, q)
            rec("k_rope", l, k)
            slot = pos0 + 1 if ((mut == "kv-off-by-one" and pos0 > 0) or mut == "kv-slot-late") else pos0
            read = self.kv_decode if self.kv_decode and self.steps_run > 0 else self.kv
            if slot + T <= self.n_ctx:
                kst, vst = k.reshape(T, -1), v.reshape(T, -1)
                if not self.kv_decode:
                    kst, vst = cache_store(self.kv, kst), cache_store(self.kv, vst)
                self.k_cache[l][slot:slot + T] = kst
                self.v_cache[l][slot:slot + T] = vst
            kc = self.k_cache[l][:n_kv]
            vc = self.v_cache[l][:n_kv]
            if self.kv_decode:
                kc, vc = cache_store(read, kc), cache_store(read, vc)
            kc = kc.reshape(n_kv, nkv, hd)
            vc = vc.reshape(n_kv, nkv, hd)
            group = nh // nkv
            kq_scale = F32(1.0 / np.sqrt(F32(hd))) if m.attn_scale is None else m.attn_scale
            probs = np.zeros((nh, T, n_kv), F32)
            att = np.zeros((T, nh * hd), F32)
            for h in range(nh):
                g = h % nkv if mut == "gqa-modulo" else h // group
                if mut == "kv-head-zero":  # h // n_head: every head reads kv head 0
                    g = 0
                kh = kc[:, g, :].astype(F64)
                vh = (kc if mut == "v-from-k" else vc)[:, g, :].astype(F64)
                for i in range(T):
                    vis = n_kv if mut == "no-causal-mask" else pos0 + i + 1
                    if mut == "attend-before-store" and pos0 > 0:
                        vis = pos0  # the cache before the step's own K/V were stored
                    if mut == "mask-tail-block" and i >= T // m.wrap * m.wrap:
                        vis = n_kv  # the rows after the last full block: unmasked
                    if mut == "causal-mask-off-by-one":
                        vis = min(vis + 1, n_kv)
                    if mut == "causal-mask-excludes-self":
                        vis = pos0 + i
                    if vis == 0:
                        # A softmax over a row masked everywhere: exp(-inf - (-inf)) = NaN.
                        probs[h, i, :] = np.nan
                        att[i, h * hd:(h + 1) * hd] = np.nan
                        continue
                    # a ring of m.wrap slots: position j's slot holds the latest j' = j (mod W) so far
                    start = self.turn_start if mut == "kv-reset-per-turn" else 0
                    src = np.arange(start, vis)
                    if mut == "kv-ring-wrap":
                        src = src + (pos0 + i - src) // m.wrap * m.wrap
                    khs, vhs = kh[src], vh[src]
                    if m.kv_read:
                        # --kv-read: column j holds the K/V of the position an expression of i
                        # (the query's position) and j gives; a negative one, a zero slot.
                        at = [int(m.kv_read(pos0 + i, int(j))) for j in src]
                        khs = np.stack([kh[a] if 0 <= a < n_kv else np.zeros(hd, F64) for a in at])
                        vhs = np.stack([vh[a] if 0 <= a < n_kv else np.zeros(hd, F64) for a in at])
                    s = (khs @ q[i, h].astype(F64)).astype(F32) * kq_scale
                    if mut == "softmax-no-max":
                        # exp(s) / sum: a score over ln(f32 max) ~ 88.7 overflows to inf,
                        # 1/sum to 0, and inf * 0 is NaN there.
                        with np.errstate(over="ignore", invalid="ignore"):
                            e = np.exp(s).astype(F32)
                            pr = e * F32(1.0 / np.sum(e.astype(F64)))
                    else:
                        e = np.exp(s - s.max()).astype(F32)
                        pr = e * F32(1.0 / np.sum(e.astype(F64)))
                    probs[h, i, start:vis] = pr
                    att[i, h * hd:(h + 1) * hd] = (pr.astype(F64) @ vhs).astype(F32)
            rec("kq_soft_max", l, probs)
            rec("kqv_out", l, att)
            attn_out = self.matmul(p + "attn_output.weight", att, mut == "transposed-wo")
            rec("attn_out", l, attn_out)
            # residual-from-normed: x overwritten by its norm before the residual add
            if mut in ("residual-from-normed", "attn-residual-from-normed"):
                x = xn
            ffn_inp = attn_out if mut == "no-attn-residual" else (x + attn_out).astype(F32)
            if mut == "attn-out-twice":
                ffn_inp = (ffn_inp + attn_out).astype(F32)
            rec("ffn_inp", l, ffn_inp)
            xn = ffn_inp if mut == "no-ffn-norm" else self.norm(ffn_inp, p + "ffn_norm.weight", mut)
            rec("ffn_norm", l, xn)
            gate = self.matmul(p + "ffn_gate.weight", xn)
            rec("ffn_gate", l, gate)
            up = self.matmul(p + "ffn_up.weight", xn)
            rec("ffn_up", l, up)
            silu = lambda z: (z / (F32(1.0) + np.exp(-z))).astype(F32)
            if mut == "silu-wrong-sign":  # x * sigmoid(-x)
                silu = lambda z: (z / (F32(1.0) + np.exp(z))).astype(F32)
            if mut == "wrong-ffn-act":  # GELU (tanh) where the model uses SiLU
                silu = lambda z: (F32(0.5) * z * (F32(1.0) + np.tanh(
                    F32(0.7978846) * z * (F32(1.0) + F32(0.044715) * z * z)))).astype(F32)
            act = silu(up) * gate if mut == "swiglu-swap" else silu(gate) * up
            rec("ffn_act", l, act.astype(F32))
            ffn_out = self.matmul(p + "ffn_down.weight", act.astype(F32))
            rec("ffn_out", l, ffn_out)
            stream = xn if mut in ("residual-from-normed", "ffn-residual-from-normed") else ffn_inp
            x = ffn_out if mut == "no-ffn-residual" else (stream + ffn_out).astype(F32)
            if mut == "ffn-out-twice":
                x = (x + ffn_out).astype(F32)
            rec("l_out", l, x)
        mut = self.mut
        xn = x if mut == "no-final-norm" else self.norm(x, "output_norm.weight", mut)
        rec("result_norm", None, xn)
        out = "output.weight" if m.has("output.weight") else "token_embd.weight"
        if mut == "tied-output":
            out = "token_embd.weight"
        logits = self.matmul(out, xn, mut == "transposed-lm-head", lm_head=True)
        rec("logits", None, logits)
        self.steps_run += 1
        return logits[-1]


SPARSE = {"embd", "l_out", "result_norm", "logits"}


ROUNDINGS = ["none", "ggml", "ggml-scalar", "q8k", "q8_1", "f16", "bf16", "f16-acc", "f16-acc-unfused",
             "tf32", "f16-trunc", "uint8-token"]


def serve():
    """--serve: run the engine once per line of stdin, a JSON list of its arguments, and answer
    each with one JSON line on stdout: {"rc": exit code, "stderr": what the run printed}. One
    process for many runs spares the interpreter's start and numpy's import (most of a small
    model's run); parity selftest keeps one such worker per job."""
    import contextlib
    import io
    import traceback
    answer = sys.stdout
    for line in sys.stdin:
        err, rc = io.StringIO(), 0
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            try:
                try:
                    args = json.loads(line)
                except ValueError:
                    args = None
                if not isinstance(args, list) or not all(isinstance(x, str) for x in args):
                    fail("--serve: each line must be a JSON list of strings")
                main(args)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # a bug in the engine: reported with its run, the worker goes on
                traceback.print_exc()
                rc = 1
        answer.write(json.dumps({"rc": rc, "stderr": err.getvalue()}) + "\n")
        answer.flush()


def main(argv=None):
    if argv is None and sys.argv[1:] == ["--serve"]:
        return serve()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--out", required=True, help="the trace: a folder, or one .npz archive")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--golden", help="take the prompt and decode ids from this trace's manifest")
    src.add_argument("--tokens", help="prompt ids, comma-separated (used as given)")
    ap.add_argument("--forced", help="decode ids to feed, comma-separated (else greedy)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps without --forced/--golden")
    ap.add_argument("--taps", choices=["all", "sparse"], default="all")
    ap.add_argument("--record", help="a recording plan, as parity diff prints it for a zoom "
                                     "(taps=l_out,result_norm,logits;full=3; layers=1 keeps the whole "
                                     "step's other taps at that layer only; kq_heads=0-1 and "
                                     "kq_rows=20-23 cut kq_soft_max to those heads and rows); "
                                     "default: PARITY_RECORD, which the parity_trace writer reads")
    ap.add_argument("--rounding", default="none",
                    choices=ROUNDINGS)
    ap.add_argument("--prefill-rounding", choices=ROUNDINGS,
                    help="the prompt step's rounding, where it differs from the decode steps' "
                         "--rounding (llama.cpp Vulkan: f16-acc tiled prefill, f32 decode)")
    ap.add_argument("--output-rounding", choices=ROUNDINGS,
                    help="the output projection's rounding, where it differs from the layers' "
                         "(an engine whose lm_head runs another kernel than its layers)")
    ap.add_argument("--kv", choices=["f32", "f16", "q8_0", "q4_0"], default="f32",
                    help="K/V cache type (llama.cpp's default cache is f16); q8_0/q4_0 store each "
                         "row in 32-value blocks, read back as f32 (no rotation: a hand-written int8 cache)")
    ap.add_argument("--f32-sums", action="store_true",
                    help="sum the matmuls in f32 (numpy's einsum order), as a plain loop engine "
                         "or a tensor core does, instead of in f64 (all but the f16-acc roundings)")
    ap.add_argument("--kv-decode", choices=["f32", "f16", "q8_0", "q4_0"],
                    help="the cache type the steps after the first read, where it differs from --kv "
                         "(the prompt's): the cache keeps f32 values, each step kind rounds what it reads")
    ap.add_argument("--mutate", metavar="NAME[=WIDTH]",
                    help="a catalog bug: " + ", ".join(COMPUTE_MUTATIONS + ["no-bos", "double-bos", "head-major-q-rope"])
                    + f" (a position bug may give its width: kv-ring-wrap=128; default {WRAP})")
    ap.add_argument("--mutate-from-layer", type=int, default=0,
                    help="the bug acts from this layer on (and on the output norm and projection)")
    ap.add_argument("--no-bos", action="store_true", help="drop the leading BOS")
    ap.add_argument("--double-bos", action="store_true", help="prepend a second BOS")
    ap.add_argument("--layout", choices=["token-major", "head-major"], default="token-major",
                    help="how q_rope is stored")
    ap.add_argument("--declare", action="store_true", help="declare --layout in the manifest")
    # Wrong values no catalog lists (the judge fits them): an engine that hard-codes its own.
    ap.add_argument("--rms-eps", type=float, help="use this RMSNorm eps instead of the model's")
    ap.add_argument("--output-norm-eps", type=float,
                    help="use this eps in the final norm (output_norm) alone")
    ap.add_argument("--rope-theta", type=float, help="use this RoPE base instead of the model's")
    ap.add_argument("--attn-scale", type=float,
                    help="scale attention scores by this instead of 1/sqrt(head_dim)")
    ap.add_argument("--rope-at", metavar="EXPR",
                    help="rotate q and k at this position instead of their own: a Python expression "
                    "of p (the row's position) and s (its step's first position), e.g. 'p + 1', "
                    "'min(p, 30)', 'p - s'")
    ap.add_argument("--kv-read", metavar="EXPR",
                    help="attention's column j reads the K/V of this position instead of j's: a "
                    "Python expression of i (the query's position) and j, e.g. 'j - 1 if i >= 10 "
                    "else j'; below 0, an empty (zero) slot")
    ap.add_argument("--embd-id", metavar="EXPR",
                    help="the embedding lookup reads the row of the id this Python expression "
                         "of t (the token id) gives ('t + 1': a lookup off by one)")
    ap.add_argument("--rope-q-at", metavar="EXPR", help="as --rope-at, for q alone")
    ap.add_argument("--rope-k-at", metavar="EXPR", help="as --rope-at, for k alone")
    a = ap.parse_args(argv)

    mutation, width = a.mutate, WRAP
    if mutation and "=" in mutation:
        mutation, w = mutation.split("=", 1)
        if mutation not in ("kv-ring-wrap", "rope-pos-wrap", "mask-tail-block") or not w.isdigit() or int(w) < 1:
            fail(f"--mutate {a.mutate}: only a position bug takes a width, a whole number >= 1")
        width = int(w)
    if mutation is not None and mutation not in COMPUTE_MUTATIONS + ["no-bos", "double-bos", "head-major-q-rope"]:
        fail(f"--mutate {mutation}: unknown (known: {', '.join(COMPUTE_MUTATIONS)}, no-bos, double-bos, head-major-q-rope)")
    no_bos = a.no_bos or mutation == "no-bos"
    double_bos = a.double_bos or mutation == "double-bos"
    layout = "head-major" if mutation == "head-major-q-rope" else a.layout
    if mutation not in COMPUTE_MUTATIONS:
        mutation = None

    if not os.path.exists(a.model):
        fail(f"{a.model}: no such file")
    m = Model(a.model, mutation, a.mutate_from_layer)
    m.wrap = width
    if a.rms_eps is not None:
        m.eps = F32(a.rms_eps)
    m.out_eps = None if a.output_norm_eps is None else F32(a.output_norm_eps)
    if a.rope_theta is not None:
        m.theta = F32(a.rope_theta)
    m.attn_scale = None if a.attn_scale is None else F32(a.attn_scale)

    def rule(flag, expr, *names):
        """A bug planted from a Python expression (--rope-at, --kv-read, --embd-id): a function
        of `names`, in that order; None where the flag was not given."""
        if expr is None:
            return None
        try:
            code = compile(expr, flag, "eval")
        except SyntaxError as e:
            fail(f"{flag} {expr!r}: {e.msg}")
        return lambda *v: eval(code, {"min": min, "max": max}, dict(zip(names, v)))
    m.kv_read = rule("--kv-read", a.kv_read, "i", "j")
    m.embd_id = rule("--embd-id", a.embd_id, "t")
    m.q_at = rule("--rope-q-at" if a.rope_q_at else "--rope-at", a.rope_q_at or a.rope_at, "p", "s")
    m.k_at = rule("--rope-k-at" if a.rope_k_at else "--rope-at", a.rope_k_at or a.rope_at, "p", "s")
    if a.golden:
        with open(os.path.join(a.golden, "manifest.json")) as f:
            g = json.load(f)
        prompt = list(g["steps"][0]["tokens"])
        # the golden's later steps as it fed them: one-token decode steps, or chunks of a
        # prompt and further turns of several tokens each
        later = [list(s["tokens"]) for s in g["steps"][1:]]
        forced = [t for s in later for t in s]
    else:
        prompt = [int(t) for t in a.tokens.split(",")]
        forced = [int(t) for t in a.forced.split(",")] if a.forced else None
        later = None
    if no_bos or double_bos:
        if m.bos is None or not prompt or prompt[0] != m.bos:
            fail(f"--no-bos/--double-bos: the prompt does not start with BOS ({m.bos})")
        prompt = prompt[1:] if no_bos else [m.bos] + prompt
    if not prompt:
        fail("no prompt ids")
    n_steps = len(forced) if forced is not None else a.steps

    try:
        w = TraceWriter(a.out, model=a.model, engine="numpy-engine", backend="numpy", version="0.1",
                        settings={"rounding": a.rounding, "taps": a.taps, "kv": a.kv,
                                  "kv_decode": a.kv_decode or a.kv,
                                  "prefill_rounding": a.prefill_rounding or a.rounding,
                                  "output_rounding": a.output_rounding or a.rounding,
                                  "numpy": np.__version__},
                        layouts={"q_rope": layout} if a.declare and layout != "token-major" else None,
                        record=a.record)
    except TraceError as e:
        fail(str(e))

    def rec(tap, layer, x):
        # the plan's keep rule at this layer (layers= keeps a whole step's taps at some only)
        if a.taps == "sparse" and tap not in SPARSE or not w.wants(tap, layer):
            return
        if tap == "q_rope" and layout == "head-major":
            w.tap(layer, tap, np.ascontiguousarray(x.transpose(1, 0, 2)), layout=layout)
        else:
            w.tap(layer, tap, x)

    eng = Engine(m, a.prefill_rounding or a.rounding, mutation, len(prompt) + n_steps, a.kv)
    eng.output_rounding = a.output_rounding
    eng.f32_sums = a.f32_sums
    eng.kv_decode = a.kv_decode if a.kv_decode and a.kv_decode != a.kv else None
    w.step(prompt, range(len(prompt)))
    logits = eng.forward(prompt, 0, rec)
    eng.rounding = a.rounding
    pos = len(prompt)
    if later is not None and any(len(t) != 1 for t in later):
        n_steps = 0
        for toks in later:
            w.step(toks, range(pos, pos + len(toks)), forced=True)
            logits = eng.forward(toks, pos, rec)
            pos += len(toks)
    for s in range(1, n_steps + 1):
        tok = forced[s - 1] if forced is not None else int(np.argmax(logits))
        w.step([tok], [pos], forced=True)
        logits = eng.forward([tok], pos, rec)
        pos += 1
    mf = w.finish()
    tensors, steps = mf["tensors"], mf["steps"]
    print(f"wrote {len(tensors)} tensors over {len(steps)} steps to {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
