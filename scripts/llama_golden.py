#!/usr/bin/env python3
"""Write a parity trace (docs/trace-format.md) from the REAL llama.cpp.

Runs llama.cpp through llama-cpp-python's low-level ctypes API with a `cb_eval`
callback, records every tapped tensor of the prefill (step 0) and of N
teacher-forced decode steps, and writes them as
DIR/manifest.json + DIR/s{step:03}/{tap}[-{layer}].npy (little-endian float32).

    llama_golden.py MODEL --out DIR (--prompt TEXT | --tokens 1,2,3) [--steps N]
                    [--forced 5,6,7] [--no-bos] [--threads N] [--llama-defaults]
                    [--n-ctx N] [--force] [--list-nodes] [--show-text] [--no-check]

Default settings are the tight ones (flash attention off, F32 KV cache, no
weight repacking, logits for every prompt row, 1 thread); --llama-defaults
keeps llama.cpp's own defaults (F16 KV cache, flash attention auto).

After recording, the script checks that every mapped tensor really is what the
trace format says (residual sums, SwiGLU, RoPE norm preservation, causal
softmax over positions, softmax(q.k)·v == kqv_out, logits == llama_get_logits)
and exits 1 if a check fails in the default tight mode (--no-check skips them).

Exit codes: 0 ok, 1 a self-check failed (nothing written), 2 bad input / llama_cpp missing.
The trace is written under a temporary name beside DIR and moved into place at the end.
"""

import argparse
import atexit
import ctypes
import hashlib
import json
import os
import re
import shlex
import shutil
import struct
import sys
import time

MISSING_LLAMA_CPP = (
    "llama_cpp (llama-cpp-python) is not installed: pip install llama-cpp-python "
    "(or: pip install /path/to/shared/wheels/llama_cpp_python-*.whl)"
)

# --------------------------------------------------------------------------
# tap table (docs/trace-format.md), in graph order
# --------------------------------------------------------------------------
GLOBAL_FIRST = ["embd", "embd_scaled"]
# K/V cache types a golden may be made with (llama.cpp's -ctk/-ctv); parity judges these.
CACHE_TYPES = ["f32", "f16", "q8_0", "q4_0"]
LAYER_TAPS = [
    "attn_norm", "q", "k", "v", "q_normed", "k_normed", "q_rope", "k_rope",
    "kq_soft_max", "kqv_out", "attn_out", "attn_post_norm", "ffn_inp", "ffn_norm",
    "ffn_gate", "ffn_up", "ffn_act", "ffn_out", "ffn_post_norm", "l_out",
]
GLOBAL_LAST = ["result_norm", "logits_uncapped", "logits"]

# llama.cpp base names (per layer: "<base>-<il>") that we ask the scheduler for
LAYER_NODE_BASES = {
    "attn_norm", "Qcur", "Kcur", "Vcur", "kq_soft_max", "kqv_out", "attn_out",
    "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_out", "l_out",
    # qwen3/gemma3 per-head q/k norms; gemma2/3 post-norms and first residual sum (sa_out)
    "Qcur_normed", "Kcur_normed", "attn_post_norm", "ffn_post_norm", "sa_out",
    # activation product: current trees fuse it (ffn_swiglu / ffn_geglu),
    # older trees name the silu(gate)*up product ffn_gate_par
    "ffn_swiglu", "ffn_geglu", "ffn_gate_par",
}
# gemma2 names its ffn_post_norm without a layer (cb with il = -1): taken in graph order
GLOBAL_NODES = {"inp_embd", "embd", "inp_scaled", "result_norm", "result_output", "ffn_post_norm"}
FFN_ACT_NODES = ["ffn_swiglu", "ffn_geglu", "ffn_gate_par"]

# The llama.cpp nodes each tap is read from (map_step): a recording plan that keeps a tap at a
# step asks the scheduler for these nodes only, so a scan of a long prompt never copies the
# probabilities or the feed-forward's wide rows out of the graph.
TAP_NODES = {
    "embd": {"inp_embd", "embd"}, "embd_scaled": {"inp_scaled"},
    "attn_norm": {"attn_norm"}, "q": {"Qcur"}, "q_rope": {"Qcur"}, "k": {"Kcur"},
    "k_rope": {"Kcur"}, "v": {"Vcur"}, "q_normed": {"Qcur_normed"}, "k_normed": {"Kcur_normed"},
    "kq_soft_max": {"kq_soft_max"}, "kqv_out": {"kqv_out"}, "attn_out": {"attn_out"},
    "attn_post_norm": {"attn_post_norm"}, "ffn_inp": {"ffn_inp", "sa_out"},
    "ffn_norm": {"ffn_norm"}, "ffn_gate": {"ffn_gate", "ffn_up", *FFN_ACT_NODES},
    "ffn_up": {"ffn_up", *FFN_ACT_NODES}, "ffn_act": set(FFN_ACT_NODES),
    "ffn_out": {"ffn_out"}, "ffn_post_norm": {"ffn_post_norm"}, "l_out": {"l_out"},
    "result_norm": {"result_norm"}, "logits_uncapped": {"logits_uncapped"},
    "logits": {"result_output"},
}

LAYER_NAME_RE = re.compile(r"^([A-Za-z_]+)-(\d+)$")
UNNAMED_RE = re.compile(r"^(node_\d+)?$")


_KEEP_ALIVE = []
_STAGING = []   # the temporary output folder, removed at exit unless published


def _remove_staging():
    for d in _STAGING:
        shutil.rmtree(d, ignore_errors=True)


atexit.register(_remove_staging)


def publish(staging, out):
    """Move the finished trace from `staging` to `out`: a rename when `out` is absent or empty,
    else (--force) the old trace's entries are removed, never other files, and the new ones
    moved in, manifest.json last."""
    if not os.path.isdir(out):
        os.rename(staging, out)
        return
    if not os.listdir(out):
        os.rmdir(out)
        os.rename(staging, out)
        return
    for e in os.listdir(out):
        p = os.path.join(out, e)
        if e == "manifest.json" or (re.fullmatch(r"s\d+", e) and os.path.isdir(p)):
            if os.path.isdir(p):
                shutil.rmtree(p)
            else:
                os.remove(p)
    names = sorted(os.listdir(staging), key=lambda n: n == "manifest.json")
    for n in names:
        os.rename(os.path.join(staging, n), os.path.join(out, n))
    os.rmdir(staging)


def die(msg, code=2):
    print(f"llama_golden: {msg}", file=sys.stderr)
    sys.exit(code)


def parse_ids(s, what):
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        die(f"{what} must be a comma-separated list of integer token ids, got {s!r}")
    if not ids:
        die(f"{what} is empty")
    return ids


def parse_plan(line):
    """A recording plan (`parity golden --record`, checked by parity before it gets here):
    (taps kept at every step or None for all, steps kept whole, the layers a whole step keeps
    every tap of, kq_soft_max's heads kept, its rows kept by position), the last four as
    inclusive ranges [(a, b), ...], the last three None when the plan has no such part. A plan
    parity would refuse raises ValueError."""
    taps, lists = None, {"full": [], "layers": None, "kq_heads": None, "kq_rows": None}
    for part in filter(None, (p.strip() for p in (line or "").split(";"))):
        key, eq, value = (x.strip() for x in part.partition("="))
        if not eq:
            raise ValueError(f"{part!r} is not key=value")
        if key == "taps":
            names = [t.strip() for t in value.split(",")]
            taps = None if "all" in names else set(names)
        elif key in lists:
            ranges = []
            for item in filter(None, (i.strip() for i in value.split(","))):
                m = re.fullmatch(r"([0-9]+)(?:\s*-\s*([0-9]+))?", item)
                if not m or int(m.group(1)) > int(m.group(2) or m.group(1)):
                    raise ValueError(f"{key}: {item!r} is not a number or a range a-b")
                ranges.append((int(m.group(1)), int(m.group(2) or m.group(1))))
            if key != "full" and not ranges:
                raise ValueError(f"{key}: empty")
            lists[key] = ranges
        else:
            raise ValueError(f"unknown part {key!r}")
    return taps, lists["full"], lists["layers"], lists["kq_heads"], lists["kq_rows"]


def in_ranges(x, ranges):
    return any(a <= x <= b for a, b in ranges)


def plan_keeps(taps, full, layers, s, tap, il):
    """The plan's keep rule: whether tap `tap` of layer `il` (None: graph-wide) is kept at step
    `s`: a tap of `taps` (None: all) everywhere, any tap at a whole step (`full`), a per-layer
    one there only at `layers` (None: every layer)."""
    if taps is None or tap in taps:
        return True
    return in_ranges(s, full) and (il is None or layers is None or in_ranges(il, layers))


def kq_cut(kq_heads, kq_rows, positions, n_head):
    """What a step of these positions keeps of kq_soft_max: (head indices, row indices within
    the step), each None where the plan keeps every one; an empty list: none of it."""
    def within(x, ranges):
        return any(a <= x <= b for a, b in ranges)
    heads = None if kq_heads is None else [h for h in range(n_head) if within(h, kq_heads)]
    rows = None if kq_rows is None else [i for i, p in enumerate(positions) if within(p, kq_rows)]
    return heads, rows


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------
# ggml access
# --------------------------------------------------------------------------
class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h, GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64,
    GGML_MAX_SRC 10, GGML_MAX_NAME 64). Checked against ggml_tensor_overhead()."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


GGML_OBJECT_SIZE = 32  # sizeof(struct ggml_object)


class Ggml:
    def __init__(self, lib):
        self.lib = lib
        lib.ggml_tensor_overhead.restype = ctypes.c_size_t
        lib.ggml_tensor_overhead.argtypes = []
        lib.ggml_nbytes.restype = ctypes.c_size_t
        lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
        lib.ggml_op_desc.restype = ctypes.c_char_p
        lib.ggml_op_desc.argtypes = [ctypes.c_void_p]
        lib.ggml_type_name.restype = ctypes.c_char_p
        lib.ggml_type_name.argtypes = [ctypes.c_int]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_backend_tensor_get.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        overhead = lib.ggml_tensor_overhead()
        if overhead - GGML_OBJECT_SIZE != ctypes.sizeof(GgmlTensor):
            die(f"struct ggml_tensor layout mismatch: ggml_tensor_overhead()-32 = "
                f"{overhead - GGML_OBJECT_SIZE}, ctypes struct = {ctypes.sizeof(GgmlTensor)}; "
                f"this llama-cpp-python's ggml is not supported by this script")

    def info(self, key, restype=ctypes.c_char_p):
        fn = getattr(self.lib, key, None)
        if fn is None:
            return None
        fn.restype = restype
        fn.argtypes = []
        v = fn()
        return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


    def devices(self):
        """ggml's registered devices (name, description, type): the golden's provenance.
        None when this ggml has no device registry."""
        lib = self.lib
        need = ["ggml_backend_dev_count", "ggml_backend_dev_get", "ggml_backend_dev_name",
                "ggml_backend_dev_description", "ggml_backend_dev_type"]
        if any(getattr(lib, n, None) is None for n in need):
            return None
        lib.ggml_backend_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_dev_count.argtypes = []
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        for n in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(lib, n).restype = ctypes.c_char_p
            getattr(lib, n).argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_type.restype = ctypes.c_int
        lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        kinds = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}
        out = []
        for i in range(lib.ggml_backend_dev_count()):
            d = lib.ggml_backend_dev_get(i)
            out.append({
                "name": (lib.ggml_backend_dev_name(d) or b"").decode("utf-8", "replace"),
                "description": (lib.ggml_backend_dev_description(d) or b"").decode("utf-8", "replace"),
                "type": kinds.get(lib.ggml_backend_dev_type(d), "unknown"),
            })
        return out


# --------------------------------------------------------------------------
# capture
# --------------------------------------------------------------------------
class Capture:
    """cb_eval state: records the wanted nodes of one llama_decode call."""

    def __init__(self, ggml, np, list_nodes):
        self.ggml = ggml
        self.np = np
        self.list_nodes = list_nodes
        self.flash_attn_seen = False  # what flash attention "auto" resolved to
        self.records = []   # (name, op, type_name, ne, array4d) in callback order
        self.seen = []      # every node asked about: (name, op, type, ne, is_view, wanted)
        self.error = None
        self.rope_params = {}  # node name -> raw op_params of its ROPE node
        self.kqv_out_ptrs = {}
        self.attn_out_ptrs = {}
        self.result_norm_ptr = None
        self.synthetic = {}
        self.synthetic_src = {}
        self.keep = None  # keep(base, layer): copied out at this step? (None: every wanted node)
        self.kq = (None, None)  # kq_soft_max's heads and rows kept at this step (None: all)

    def reset(self, keep=None, kq=(None, None)):
        self.records = []
        self.seen = []
        self.error = None
        self.rope_params = {}
        self.kqv_out_ptrs = {}   # address of kqv_out-L -> L (this graph)
        self.kqv_views = {}      # address of a reshape of kqv_out-L -> L
        self.kqv_unrotated = {}  # address of the product rotating kqv_out-L back -> L
        self.attn_out_ptrs = {}  # address of attn_out-L (named or synthetic) -> L
        self.result_norm_ptr = None
        self.synthetic = {}      # address of an unnamed node -> the llama.cpp-style name we give it
        self.synthetic_src = {}  # given name -> the node's real name
        self.keep = keep
        self.kq = kq

    @staticmethod
    def wanted(name):
        if name in GLOBAL_NODES or name == "logits_uncapped":
            return True
        m = LAYER_NAME_RE.match(name)
        return bool(m) and m.group(1) in LAYER_NODE_BASES

    def kept(self, name):
        """Whether a wanted node is copied out at this step: the others are only followed (the
        node-mapping below needs their addresses, never their data)."""
        m = LAYER_NAME_RE.match(name)
        base, il = (m.group(1), int(m.group(2))) if m else (name, None)
        if base == "kq_soft_max" and [] in self.kq:
            return False  # the plan keeps none of its heads or rows at this step
        return self.keep is None or self.keep(base, il)

    def callback(self, t, ask, _ud):
        try:
            g = GgmlTensor.from_address(t)
            name = g.name.decode("utf-8", "replace")
            if ask:
                want = self.wanted(name)
                op = self.ggml.lib.ggml_op_desc(t)
                if op == b"FLASH_ATTN_EXT":
                    self.flash_attn_seen = True
                if want:
                    m = LAYER_NAME_RE.match(name)
                    if m and m.group(1) == "kqv_out":
                        self.kqv_out_ptrs[t] = int(m.group(2))
                    if m and m.group(1) == "attn_out":
                        self.attn_out_ptrs[t] = int(m.group(2))
                    if name == "result_norm":
                        self.result_norm_ptr = t
                elif op == b"RESHAPE" and g.src[0] in self.kqv_out_ptrs:
                    self.kqv_views[t] = self.kqv_out_ptrs[g.src[0]]
                elif op == b"RESHAPE" and g.src[0] in self.kqv_unrotated:
                    # A quantized V cache is stored rotated (Walsh-Hadamard): llama.cpp names
                    # the attention output kqv_out-L before rotating it back. The rotated-back
                    # product (this view of it, in kqv_out's shape) is what Wo reads, and what
                    # kqv_out means in every other trace.
                    il = self.kqv_unrotated[g.src[0]]
                    self.synthetic[t] = f"kqv_out-{il}"
                    self.synthetic_src[f"kqv_out-{il}"] = name
                    self.kqv_out_ptrs[t] = il
                    want = True
                elif (op == b"MUL_MAT" and g.src[1] in self.kqv_views and g.src[0]
                      and GgmlTensor.from_address(g.src[0]).name.startswith(b"attn_inp_v_rot")):
                    self.kqv_unrotated[t] = self.kqv_views[g.src[1]]
                elif (UNNAMED_RE.match(name) and g.src[1] in self.kqv_out_ptrs
                      and op == b"MUL_MAT"):
                    # archs that leave Wo·kqv_out unnamed (qwen2 in 2026 trees): take the
                    # unnamed MUL_MAT that consumes kqv_out-L as attn_out-L
                    il = self.kqv_out_ptrs[g.src[1]]
                    self.synthetic[t] = f"attn_out-{il}"
                    self.synthetic_src[f"attn_out-{il}"] = name
                    self.attn_out_ptrs[t] = il
                    want = True
                elif (UNNAMED_RE.match(name) and g.src[0] in self.attn_out_ptrs
                      and op == b"GET_ROWS"):
                    # the last layer keeps only the output rows (inp_out_ids): still attn_out
                    self.attn_out_ptrs[t] = self.attn_out_ptrs[g.src[0]]
                elif (UNNAMED_RE.match(name) and g.src[0] in self.attn_out_ptrs
                      and op == b"ADD"):
                    # phi3 leaves the first residual sum unnamed: attn_out-L + layer input
                    il = self.attn_out_ptrs[g.src[0]]
                    self.synthetic[t] = f"ffn_inp-{il}"
                    self.synthetic_src[f"ffn_inp-{il}"] = name
                    want = True
                elif (UNNAMED_RE.match(name) and self.result_norm_ptr is not None
                      and g.src[1] == self.result_norm_ptr and op == b"MUL_MAT"):
                    # gemma2: the output projection before the final soft-cap is unnamed
                    self.synthetic[t] = "logits_uncapped"
                    self.synthetic_src["logits_uncapped"] = name
                    want = True
                want = want and self.kept(self.synthetic.get(t, name))
                if self.list_nodes:
                    self.seen.append((name, self.ggml.lib.ggml_op_desc(t).decode(),
                                      self.ggml.lib.ggml_type_name(g.type).decode(),
                                      list(g.ne), bool(g.view_src), want))
                return want
            name = self.synthetic.get(t, name)
            if not self.wanted(name) or not self.kept(name):
                return True
            op = self.ggml.lib.ggml_op_desc(t).decode()
            tname = self.ggml.lib.ggml_type_name(g.type).decode()
            arr = None
            if self.kq != (None, None) and name.startswith("kq_soft_max-"):
                arr = self.to_f32_cut(t, g, tname, *self.kq)
            if arr is None:
                arr = self.to_f32(t, g, tname)
            if op == "ROPE" and name not in self.rope_params:
                ff = None
                if g.src[2]:
                    # the frequency factors (llama3 rope_freqs, phi3 long/short): f32 [n_rot/2]
                    fg = GgmlTensor.from_address(g.src[2])
                    if self.ggml.lib.ggml_type_name(fg.type) == b"f32":
                        ff = self.to_f32(g.src[2], fg, "f32").reshape(-1)
                self.rope_params[name] = (bytes(g.op_params), bool(g.src[2]), ff)
            self.records.append((name, op, tname, list(g.ne), arr))
            return True
        except Exception as e:  # never let an exception cross the C boundary
            if self.error is None:
                self.error = f"{type(e).__name__}: {e}"
            return False  # abort the graph

    def dtype(self, g, tname):
        np = self.np
        if tname == "f32":
            return np.dtype("<f4")
        if tname == "f16":
            return np.dtype("<f2")
        if tname == "bf16":
            return np.dtype("<u2")
        if tname == "f64":
            return np.dtype("<f8")
        raise ValueError(f"node {g.name.decode()} has type {tname}; only f32/f16/bf16/f64 "
                         f"activations are supported")

    def widened(self, arr, tname):
        np = self.np
        if tname == "bf16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        return arr.astype(np.float32)

    def to_f32_cut(self, t, g, tname, heads, rows):
        """A kq_soft_max node [n_kv, T, n_head, 1] (numpy [1, n_head, T, n_kv]) read only at the
        plan's heads and rows (None: all), a run of consecutive rows at a time: a long prompt's
        probabilities are never copied out whole. None where the node is not of that form (the
        whole node is read then, and map_step says what is wrong with it)."""
        np = self.np
        dt = self.dtype(g, tname)
        ne = [int(x) for x in g.ne]
        nb = [int(x) for x in g.nb]
        if ne[3] != 1 or nb[0] != dt.itemsize or nb[1] % dt.itemsize:
            return None
        heads = range(ne[2]) if heads is None else heads
        rows = list(range(ne[1]) if rows is None else rows)
        if any(h >= ne[2] for h in heads) or any(r >= ne[1] for r in rows):
            return None
        out = np.empty((len(heads), len(rows), ne[0]), dt)
        runs, i = [], 0
        while i < len(rows):
            j = i
            while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
                j += 1
            runs.append((i, j - i + 1))
            i = j + 1
        for hi, h in enumerate(heads):
            for i, n in runs:
                span = (n - 1) * nb[1] + ne[0] * dt.itemsize
                raw = (ctypes.c_uint8 * (span + (-span) % dt.itemsize))()
                self.ggml.lib.ggml_backend_tensor_get(t, raw, h * nb[2] + rows[i] * nb[1], span)
                base = np.frombuffer(raw, dtype=dt)
                out[hi, i:i + n] = np.lib.stride_tricks.as_strided(
                    base, shape=(n, ne[0]), strides=(nb[1], dt.itemsize))
        return self.widened(out[None], tname)

    def to_f32(self, t, g, tname):
        np = self.np
        nbytes = self.ggml.lib.ggml_nbytes(t)
        raw = (ctypes.c_uint8 * nbytes)()
        self.ggml.lib.ggml_backend_tensor_get(t, raw, 0, nbytes)
        buf = np.frombuffer(raw, dtype=np.uint8)
        dt = self.dtype(g, tname)
        ne = [int(x) for x in g.ne]
        nb = [int(x) for x in g.nb]
        # pad the byte buffer to a whole number of elements, then view it strided
        pad = (-nbytes) % dt.itemsize
        if pad:
            buf = np.concatenate([buf, np.zeros(pad, np.uint8)])
        base = buf.view(dt)
        arr = np.lib.stride_tricks.as_strided(base, shape=tuple(ne[::-1]), strides=tuple(nb[::-1]))
        return self.widened(np.ascontiguousarray(arr), tname)


# --------------------------------------------------------------------------
# mapping llama.cpp nodes -> taps
# --------------------------------------------------------------------------
def map_step(records, n_layer, n_head, n_head_kv, T, n_kv, np, kq=(None, None)):
    """Return (taps, notes): taps maps (tap, layer|None) -> numpy array in canonical shape;
    kq_soft_max cut to kq's heads and rows (None: all), as the capture read it."""
    by_name = {}
    for name, op, tname, ne, arr in records:
        lst = by_name.setdefault(name, [])
        lst.append((op, tname, ne, arr, (name, len(lst))))
    taps = {}
    notes = {}
    source = {}   # (name, occurrence) -> tap label, for --list-nodes

    def put(tap, il, occ_entry, arr):
        taps[(tap, il)] = arr
        source[occ_entry[4]] = tap if il is None else f"{tap}-{il}"

    def as_2d(arr, what):
        # ggml [C, T, 1, 1] -> numpy [1, 1, T, C] -> [T, C]
        if arr.shape[0] != 1 or arr.shape[1] != 1:
            raise ValueError(f"{what}: expected a 2-D node, got numpy shape {arr.shape}")
        out = arr[0, 0]
        if out.shape[0] != T:
            raise ValueError(f"{what}: expected {T} rows, got {out.shape[0]} "
                             f"(were logits requested for every row?)")
        return out

    def as_heads(arr, nh, what):
        # [hd, nh, T, 1] -> [1, T, nh, hd] -> [T, nh, hd]; or a 2-D [nh*hd, T] node
        if arr.shape[0] != 1:
            raise ValueError(f"{what}: unexpected 4-D shape {arr.shape}")
        a = arr[0]
        if a.shape[0] == T and a.shape[1] == nh:          # reshaped node [hd, nh, T]
            return np.ascontiguousarray(a)
        if a.shape[0] == 1 and a.shape[1] == T and a.shape[2] % nh == 0:   # 2-D [nh*hd, T]
            return a[0].reshape(T, nh, a.shape[2] // nh)
        raise ValueError(f"{what}: cannot view numpy shape {arr.shape} as [T={T}, {nh}, head_dim]")

    def pick(name):
        return by_name.get(name, [])

    # graph-wide
    emb = pick("inp_embd") or pick("embd")
    if emb:
        put("embd", None, emb[0], as_2d(emb[0][3], "embd"))
        notes["embd"] = ("inp_embd" if pick("inp_embd") else "embd") + f" ({emb[0][0]})"
    if pick("inp_scaled"):
        put("embd_scaled", None, pick("inp_scaled")[0], as_2d(pick("inp_scaled")[0][3], "inp_scaled"))
    if pick("result_norm"):
        put("result_norm", None, pick("result_norm")[-1], as_2d(pick("result_norm")[-1][3], "result_norm"))
    if pick("logits_uncapped"):
        put("logits_uncapped", None, pick("logits_uncapped")[0],
            as_2d(pick("logits_uncapped")[0][3], "logits_uncapped"))
    # gemma2's unsuffixed ffn_post_norm nodes, one per layer in graph order
    for il, occ in enumerate(pick("ffn_post_norm")):
        if il < n_layer:
            put("ffn_post_norm", il, occ, as_2d(occ[3], f"ffn_post_norm (#{il})"))
    if pick("result_output"):
        outs = pick("result_output")
        if len(outs) != 1:
            raise ValueError(f"result_output emitted {len(outs)} times in one decode call "
                             f"(the batch was split into several ubatches?)")
        put("logits", None, outs[0], as_2d(outs[0][3], "logits"))

    for il in range(n_layer):
        def nm(base):
            return pick(f"{base}-{il}")

        for tap, base in [("attn_norm", "attn_norm"), ("kqv_out", "kqv_out"),
                          ("attn_out", "attn_out"), ("attn_post_norm", "attn_post_norm"),
                          ("ffn_inp", "ffn_inp"), ("ffn_inp", "sa_out"),
                          ("ffn_norm", "ffn_norm"), ("ffn_gate", "ffn_gate"),
                          ("ffn_up", "ffn_up"), ("ffn_post_norm", "ffn_post_norm"),
                          ("l_out", "l_out")]:
            occ = nm(base)
            if occ:
                put(tap, il, occ[-1], as_2d(occ[-1][3], f"{base}-{il}"))
                if len(occ) > 1:
                    notes[f"{base}-{il}"] = f"{len(occ)} occurrences, took the last"

        for base, tap_pre, tap_rope, nh in [("Qcur", "q", "q_rope", n_head),
                                            ("Kcur", "k", "k_rope", n_head_kv)]:
            occ = nm(base)
            if not occ:
                continue
            rope_idx = [i for i, o in enumerate(occ) if o[0] == "ROPE"]
            if rope_idx:
                r = rope_idx[0]
                put(tap_rope, il, occ[r], as_heads(occ[r][3], nh, f"{base}-{il} (ROPE)"))
                if r > 0:
                    put(tap_pre, il, occ[r - 1], as_heads(occ[r - 1][3], nh, f"{base}-{il} (#{r - 1})"))
            else:
                put(tap_pre, il, occ[-1], as_heads(occ[-1][3], nh, f"{base}-{il} (last)"))
        occ = nm("Vcur")
        if occ:
            put("v", il, occ[-1], as_heads(occ[-1][3], n_head_kv, f"Vcur-{il} (last)"))
        for base, tap, nh in [("Qcur_normed", "q_normed", n_head), ("Kcur_normed", "k_normed", n_head_kv)]:
            occ = nm(base)
            if occ:
                put(tap, il, occ[-1], as_heads(occ[-1][3], nh, f"{base}-{il}"))

        occ = [o for o in nm("kq_soft_max") if o[0] == "SOFT_MAX"] or nm("kq_soft_max")
        if occ:
            a = occ[0][3]  # numpy [1, n_head, T, n_kv_pad], or the plan's heads and rows of it
            nh = n_head if kq[0] is None else len(kq[0])
            nt = T if kq[1] is None else len(kq[1])
            if a.shape[0] != 1 or a.shape[1] != nh or a.shape[2] != nt or a.shape[3] < n_kv:
                raise ValueError(f"kq_soft_max-{il}: unexpected numpy shape {a.shape} "
                                 f"(want [1, {nh}, {nt}, >={n_kv}])")
            rest = a[0, :, :, n_kv:]
            if rest.size and float(np.max(np.abs(rest))) > 0.0:
                raise ValueError(f"kq_soft_max-{il}: columns past n_kv={n_kv} are not zero "
                                 f"(max {float(np.max(np.abs(rest)))}); KV cells are not in "
                                 f"position order")
            put("kq_soft_max", il, occ[0], np.ascontiguousarray(a[0, :, :, :n_kv]))

        for base in FFN_ACT_NODES:
            occ = nm(base)
            if occ:
                put("ffn_act", il, occ[-1], as_2d(occ[-1][3], f"{base}-{il}"))
                notes.setdefault("ffn_act", base)
                break
        # phi3: one fused up matmul, gate rows first (ggml_swiglu: silu(first half) * second)
        up, act = taps.get(("ffn_up", il)), taps.get(("ffn_act", il))
        if (up is not None and act is not None and ("ffn_gate", il) not in taps
                and up.shape[-1] == 2 * act.shape[-1]):
            half = act.shape[-1]
            occ = nm("ffn_up")[-1]
            put("ffn_gate", il, occ, np.ascontiguousarray(up[:, :half]))
            put("ffn_up", il, occ, np.ascontiguousarray(up[:, half:]))
            notes[f"ffn_up-{il}"] = "fused gate|up: ffn_gate = first half, ffn_up = second half"

        occ = nm("ffn_out")
        if occ:
            first = [o for o in occ if o[0] == "MUL_MAT"] or occ
            put("ffn_out", il, first[0], as_2d(first[0][3], f"ffn_out-{il}"))
            if len(occ) > 1:
                notes[f"ffn_out-{il}"] = f"{len(occ)} occurrences, took the first MUL_MAT"
                put("_ffn_out_second", il, occ[-1], as_2d(occ[-1][3], f"ffn_out-{il} (last)"))
    return taps, notes, source


def rope_decode(raw):
    """ROPE op_params (ggml_rope_impl): n_past, n_dims, mode, n_ctx, n_ctx_orig, then floats
    freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow."""
    ints = struct.unpack("<16i", raw[:64])
    fl = struct.unpack("<6f", raw[20:44])
    return {"n_dims": ints[1], "mode": ints[2], "n_ctx_orig": ints[4], "freq_base": fl[0],
            "freq_scale": fl[1], "ext_factor": fl[2], "attn_factor": fl[3]}


_LIBM = []   # the C library's math, loaded once (find_library runs a subprocess)


def _powf(x, y, np):
    """powf of the C library (what ggml calls), or numpy's float32 power where none loads."""
    if not _LIBM:
        try:
            import ctypes.util
            libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
            libm.powf.restype = ctypes.c_float
            libm.powf.argtypes = [ctypes.c_float, ctypes.c_float]
            _LIBM.append(libm.powf)
        except (OSError, AttributeError):
            _LIBM.append(None)
    if _LIBM[0] is None:
        return np.power(np.float32(x), np.float32(y), dtype=np.float32)
    return _LIBM[0](x, y)


def rope_ref(x, pos, rp, np, ff=None):
    """Reference RoPE (no YaRN ramp) of x [T, n_head, head_dim] in float64; pair i turns at
    theta_i / ff[i] with frequency factors `ff` (ggml: theta_extrap = theta / ff)."""
    x = x.astype(np.float64)
    n_dims = rp["n_dims"]
    half = n_dims // 2
    # angles exactly as ggml's CPU rope cache builds them, in float32:
    # theta_scale = powf(base, -2/n_dims); theta_0 = pos; theta_{i+1} = theta_i * theta_scale
    f32 = np.float32
    # theta_scale from the C library's powf, as ggml takes it: numpy's float32 power is an ulp
    # away for some bases (10000^(-2/64)), which turns the angles ~2 ulp apart by position 2,000
    theta_scale = f32(_powf(float(rp["freq_base"]), float(f32(-2.0) / f32(n_dims)), np))
    theta = np.empty((len(pos), half), np.float32)
    cur = np.asarray(pos, np.float32)
    for i in range(half):
        t = cur if ff is None else (cur / f32(ff[i])).astype(np.float32)
        theta[:, i] = t * f32(rp["freq_scale"])
        cur = (cur * theta_scale).astype(np.float32)
    theta = theta.astype(np.float64)                                              # [T, half]
    c = (np.cos(theta) * rp["attn_factor"])[:, None, :]
    s_ = (np.sin(theta) * rp["attn_factor"])[:, None, :]
    out = x.copy()
    if rp["mode"] & 2:   # NEOX: pairs (i, i + n_dims/2)
        a, b = x[..., :half], x[..., half:n_dims]
        out[..., :half] = a * c - b * s_
        out[..., half:n_dims] = a * s_ + b * c
    else:                # NORM: pairs (2i, 2i+1)
        a, b = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out[..., 0:n_dims:2] = a * c - b * s_
        out[..., 1:n_dims:2] = a * s_ + b * c
    return out


# --------------------------------------------------------------------------
# self-checks: is each mapped tensor what the trace format says?
# --------------------------------------------------------------------------
class Checker:
    def __init__(self, np):
        self.np = np
        self.n = 0
        self.failures = []
        self.worst = {}

    def close(self, what, a, b, rtol, atol=0.0):
        np = self.np
        self.n += 1
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            self.failures.append(f"{what}: shape {a.shape} vs {b.shape}")
            return
        # in float64, a million elements at a time: a long prompt's logits are hundreds of MB
        a, b = a.reshape(-1), b.reshape(-1)
        scale, err, finite = 1e-30, 0.0, True
        for i in range(0, a.size, 1 << 20):
            x = a[i:i + (1 << 20)].astype(np.float64)
            y = b[i:i + (1 << 20)].astype(np.float64)
            scale = max(scale, float(np.max(np.abs(y))))
            err = max(err, float(np.max(np.abs(x - y))))
            finite = finite and bool(np.all(np.isfinite(x)))
        kind = what.rsplit(" s", 1)[0]
        self.worst[kind] = max(self.worst.get(kind, 0.0), err / scale)
        if err > atol + rtol * scale or not finite:
            self.failures.append(f"{what}: max|diff| {err:.3g} (scale {scale:.3g})")


GELU_COEF_A = 0.044715
SQRT_2_OVER_PI = 0.79788456080286535587989211986876


def gelu_ggml_cpu(x, np):
    """ggml-cpu's f32 GELU (vec.h, GGML_GELU_FP16 defined): x rounded to f16, looked up in a
    table of f16(gelu_tanh(x)) computed in f32; x <= -10 gives 0, x >= 10 gives x."""
    f32 = np.float32
    x = np.asarray(x, f32)
    h = x.astype(np.float16).astype(f32)
    g = f32(0.5) * h * (f32(1.0) + np.tanh(f32(SQRT_2_OVER_PI) * h * (f32(1.0) + f32(GELU_COEF_A) * h * h)))
    t = g.astype(np.float16).astype(f32)
    return np.where(x <= -10.0, f32(0.0), np.where(x >= 10.0, x, t))


def arch_rules(meta, n_layer):
    """What the self-checks need to know of the architecture, read from the GGUF metadata the
    way llama.cpp's loader reads it (docs/architectures.md): score scale, attention soft-cap,
    sliding window and its layers, final soft-cap."""
    arch = meta("general.architecture") or ""

    def num(key, default=None):
        v = meta(f"{arch}.{key}")
        try:
            return float(v) if v is not None else default
        except ValueError:
            return default
    r = {"arch": arch, "kq_scale": None, "attn_softcap": None, "final_softcap": None,
         "n_swa": 0, "swa_layers": [False] * n_layer}
    period = None
    if arch == "gemma2":
        r["attn_softcap"] = num("attn_logit_softcapping", 50.0)
        r["final_softcap"] = num("final_logit_softcapping", 30.0)
        r["n_swa"] = int(num("attention.sliding_window", 4096))
        period = 2
    elif arch == "gemma3":
        r["final_softcap"] = num("final_logit_softcapping", None) or None
        r["n_swa"] = int(num("attention.sliding_window", 0))
        period = 6
    if r["n_swa"] > 0 and period is not None:
        p = num("attention.sliding_window_pattern", None)
        if p is None and meta(f"{arch}.attention.sliding_window_pattern") is not None:
            r["n_swa"] = -1  # a per-layer array: not read here, the window check is skipped
        else:
            period = int(p) if p is not None else period
            r["swa_layers"] = [period == 0 or il % period < period - 1 for il in range(n_layer)]
    n_embd, n_head = num("embedding_length", 0), num("attention.head_count", 1)
    if (arch, n_layer) in (("gemma2", 46), ("gemma3", 62)):
        r["kq_scale"] = (n_embd / n_head) ** -0.5
    return r


class StepChecks:
    """The self-checks, one step at a time (the trace is written step by step, not held)."""

    def __init__(self, n_head, n_head_kv, tight, np, rules=None):
        self.ck = Checker(np)
        self.np = np
        self.rules = rules or {"kq_scale": None, "attn_softcap": None, "final_softcap": None,
                               "n_swa": 0, "swa_layers": []}
        self.n_head, self.n_head_kv = n_head, n_head_kv
        # tolerances: exact for pure copies/adds, float-rounding level for recomputed ops
        self.r_exact = 0.0 if tight else 1e-6
        self.r_op = 2e-5 if tight else 5e-3
        self.k_all, self.v_all = {}, {}   # layer -> list of per-step arrays (positions in order)

    def step(self, s, taps, positions, rope, lg_api, act_node="ffn_swiglu", kq=(None, None)):
        """kq: the heads and rows (indices within the step; None: all) kq_soft_max holds: its
        checks are made on those alone."""
        np = self.np
        r_exact, r_op = self.r_exact, self.r_op
        rules = self.rules
        group = None
        pos = positions
        layers = sorted({l for (_, l) in taps if l is not None})
        # the layer's input: the embedding before layer 0, the previous layer's l_out after;
        # None where the step does not hold it (a plan's layers= or taps= left it out)
        prev = taps.get(("embd_scaled", None))
        if prev is None:
            prev = taps.get(("embd", None))
        prev_layer = -1
        for il in layers:
            g = lambda tap: taps.get((tap, il))
            lin = prev if prev_layer == il - 1 else None
            # gemma2/3 add the post-normed branch outputs to the residual stream
            attn_br = "attn_post_norm" if g("attn_post_norm") is not None else "attn_out"
            ffn_br = "ffn_post_norm" if g("ffn_post_norm") is not None else "ffn_out"
            if lin is not None and g("ffn_inp") is not None and g(attn_br) is not None:
                self.ck.close(f"ffn_inp=l_in+{attn_br} s{s} L{il}", g("ffn_inp"), lin + g(attn_br), r_exact)
            if all(x is not None for x in (g("l_out"), g("ffn_inp"), g(ffn_br))):
                self.ck.close(f"l_out=ffn_inp+{ffn_br} s{s} L{il}", g("l_out"), g("ffn_inp") + g(ffn_br), r_exact)
            if taps.get(("_ffn_out_second", il)) is not None and g("l_out") is not None:
                self.ck.close(f"ffn_out#2=l_out s{s} L{il}", taps[("_ffn_out_second", il)], g("l_out"), r_exact)
            if all(x is not None for x in (g("ffn_act"), g("ffn_gate"), g("ffn_up"))):
                if act_node == "ffn_geglu":
                    # the table's f16 entries come from libm tanhf, ours from numpy's: an entry
                    # can round to the neighbouring f16 (1 in ~5000 measured), so each element
                    # may be one f16 ulp of gelu off; exact f32 GELU is ~1e-3 relative away
                    gl = gelu_ggml_cpu(g("ffn_gate"), np).astype(np.float64)
                    up = g("ffn_up").astype(np.float64)
                    ref = gl * up
                    slack = np.abs(gl) * 2.0 ** -10 * np.abs(up) * 1.01
                    act = g("ffn_act").astype(np.float64)
                    near = np.where(np.abs(act - ref) <= slack, act, ref)
                    self.ck.close(f"ffn_act=gelu_f16_table(gate)*up s{s} L{il}", act, near, r_op)
                else:
                    gate = g("ffn_gate").astype(np.float64)
                    self.ck.close(f"ffn_act=silu(gate)*up s{s} L{il}", g("ffn_act"),
                             gate / (1.0 + np.exp(-gate)) * g("ffn_up"), r_op)
            for pre, post in (("q", "q_rope"), ("k", "k_rope")):
                if g(pre + "_normed") is not None:
                    pre = pre + "_normed"   # qwen3/gemma3: RoPE rotates the normed q/k
                a, b = g(pre), g(post)
                if a is not None and b is not None:
                    node = ("Qcur" if pre.startswith("q") else "Kcur") + f"-{il}"
                    rp = rope.get(node)
                    rpd = rope_decode(rp[0]) if rp is not None else None
                    # RoPE is a rotation times attn_factor (phi3's LongRoPE factor, else 1):
                    # per-head norms scale by it; position 0 is the identity times it
                    af = rpd["attn_factor"] if rpd is not None and rpd["ext_factor"] == 0.0 else 1.0
                    self.ck.close(f"|{post}|=attn_factor*|{pre}| s{s} L{il}", np.linalg.norm(b, axis=-1),
                             af * np.linalg.norm(a.astype(np.float64), axis=-1), r_op)
                    if pos[0] == 0:
                        self.ck.close(f"{post}@pos0=attn_factor*{pre} s{s} L{il}", b[0], af * a[0].astype(np.float64), r_op)
                    if rp is not None and (not rp[1] or rp[2] is not None):
                        if rpd["ext_factor"] == 0.0 and rpd["mode"] in (0, 2):
                            ffs = " with freq factors" if rp[2] is not None else ""
                            self.ck.close(f"{post}=rope_{'neox' if rpd['mode'] else 'norm'}({pre}){ffs} s{s} L{il}",
                                     b, rope_ref(a, pos, rpd, np, rp[2]), r_op * 10)
            # attention: softmax(scale q.k + causal mask) and P.V == kqv_out
            if g("k_rope") is not None:
                self.k_all.setdefault(il, []).append(g("k_rope"))
            if g("v") is not None:
                self.v_all.setdefault(il, []).append(g("v"))
            P = g("kq_soft_max")
            if P is not None:
                # the heads and rows P holds (a plan's kq_heads/kq_rows cut the rest away)
                hs = slice(None) if kq[0] is None else list(kq[0])
                rs = slice(None) if kq[1] is None else list(kq[1])
                nkv = P.shape[-1]
                self.ck.close(f"kq_soft_max rows sum to 1 s{s} L{il}", P.astype(np.float64).sum(-1),
                         np.ones(P.shape[:2]), r_op)
                pk = np.asarray(pos)[rs]                                      # P's rows' positions
                mask = np.arange(nkv)[None, :] > pk[:, None]                  # [rows, n_kv]
                # sliding window (llama_hparams::is_masked_swa, STANDARD): query p sees key j
                # iff p - j < n_swa
                swa = (rules["n_swa"] > 0 and il < len(rules["swa_layers"])
                       and rules["swa_layers"][il])
                if swa:
                    mask |= (pk[:, None] - np.arange(nkv)[None, :]) >= rules["n_swa"]
                self.ck.close(f"kq_soft_max causal zeros s{s} L{il}", np.where(mask[None], P, 0.0),
                         np.zeros(P.shape), 0.0, atol=0.0)
                q = g("q_rope")
                if q is not None and il in self.k_all and sum(x.shape[0] for x in self.k_all[il]) == nkv:
                    K = np.concatenate(self.k_all[il]).astype(np.float64)        # [n_kv, n_kv_head, hd]
                    group = self.n_head // self.n_head_kv
                    Kx = np.repeat(K, group, axis=1)[:, hs]                   # [n_kv, heads, hd]
                    scale = rules["kq_scale"] or 1.0 / np.sqrt(q.shape[-1])
                    qk = q[rs][:, hs].astype(np.float64)                          # [rows, heads, hd]
                    sc = np.einsum("thd,jhd->htj", qk, Kx) * scale
                    if rules["attn_softcap"]:
                        cap = rules["attn_softcap"]
                        sc = cap * np.tanh(sc / cap)
                    sc = np.where(mask[None], -np.inf, sc)
                    sc -= sc.max(-1, keepdims=True)
                    e = np.exp(sc)
                    what = "softmax(q.k*scale" + (", soft-capped" if rules["attn_softcap"] else "") + \
                        (", window)" if swa else ")")
                    self.ck.close(f"kq_soft_max={what} s{s} L{il}", P, e / e.sum(-1, keepdims=True), r_op * 10)
                if g("kqv_out") is not None and il in self.v_all and sum(x.shape[0] for x in self.v_all[il]) == nkv:
                    V = np.concatenate(self.v_all[il]).astype(np.float64)
                    group = self.n_head // self.n_head_kv
                    Vx = np.repeat(V, group, axis=1)                          # [n_kv, n_head, hd]
                    o = np.einsum("htj,jhd->thd", P.astype(np.float64), Vx[:, hs])
                    kqv = g("kqv_out")
                    kqv = kqv.reshape(kqv.shape[0], -1, Vx.shape[-1])[rs][:, hs]
                    self.ck.close(f"kqv_out=P.V s{s} L{il}", kqv.reshape(kqv.shape[0], -1),
                                  o.reshape(o.shape[0], -1), r_op)
            if g("l_out") is not None:
                prev, prev_layer = g("l_out"), il
        lg = taps.get(("logits", None))
        if lg is not None:
            self.ck.close(f"logits=llama_get_logits s{s}", lg, lg_api, 0.0)
        raw = taps.get(("logits_uncapped", None))
        if lg is not None and raw is not None and rules["final_softcap"]:
            cap = rules["final_softcap"]
            self.ck.close(f"logits=cap*tanh(logits_uncapped/cap) s{s}", lg,
                          cap * np.tanh(raw.astype(np.float64) / cap), r_op)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Record a parity trace (every named tensor of the prefill and of N "
                    "teacher-forced decode steps) from the real llama.cpp via llama-cpp-python.")
    ap.add_argument("model", help="GGUF model file")
    ap.add_argument("--out", required=True, help="output trace folder")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, tokenized by llama.cpp's own tokenizer")
    src.add_argument("--tokens", help="comma-separated prompt token ids, used as given (no BOS added)")
    ap.add_argument("--prompt-text", help="with --tokens: the text the ids were made from "
                                          "(recorded in the manifest only)")
    ap.add_argument("--steps", type=int, default=None,
                    help="number of decode steps after the prefill (default 0, or len(--forced))")
    ap.add_argument("--forced", help="comma-separated token ids to feed at the decode steps "
                                     "instead of the greedy continuation")
    ap.add_argument("--no-bos", action="store_true", help="with --prompt: do not add BOS/special tokens")
    ap.add_argument("--chunk", type=int, default=0,
                    help="feed the prompt (and each --turn) in llama_decode calls of this many tokens, "
                         "one step each (chunked prefill; 1: one token at a time); default: all at once")
    ap.add_argument("--turn", action="append", default=[],
                    help="comma-separated ids of a further turn, fed after the decode steps and "
                         "followed by as many decode steps again (repeatable: a multi-turn conversation)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default 1)")
    ap.add_argument("--gpu-layers", type=int, default=0,
                    help="layers to offload to this build's GPU device (-1: all, output included); "
                         "the manifest's backend names the device (llama.cpp-vulkan, ...), and "
                         "`parity check` then holds the golden to GPU rounding, not ggml-cpu's")
    ap.add_argument("--n-ctx", type=int, default=0,
                    help="context size (default: prompt+steps rounded up to 256)")
    ap.add_argument("--llama-defaults", action="store_true",
                    help="keep llama.cpp's default F16 KV cache and flash-attention auto "
                         "(and weight repacking) instead of the tight settings")
    ap.add_argument("--cache-type-k", choices=CACHE_TYPES, default=None,
                    help="K cache type (llama.cpp's -ctk; default f32, or f16 with --llama-defaults)")
    ap.add_argument("--cache-type-v", choices=CACHE_TYPES, default=None,
                    help="V cache type (llama.cpp's -ctv; a quantized V cache needs flash attention)")
    ap.add_argument("--flash-attn", choices=["on", "off", "auto"], default=None,
                    help="flash attention (llama.cpp's -fa; default off, or auto with --llama-defaults); "
                         "the manifest records what llama.cpp resolved it to")
    ap.add_argument("--force", action="store_true", help="overwrite a non-empty --out folder")
    ap.add_argument("--record", default=None,
                    help="a recording plan parity has checked: taps=A,B (kept at every step; "
                         "left out: all), full=3,7-8 (steps kept whole), layers=5 (the layers "
                         "a whole step keeps every tap of; left out: all), kq_heads=0-3 and "
                         "kq_rows=40-47 (kq_soft_max's heads and rows, by position, kept; "
                         "left out: all)")
    ap.add_argument("--list-nodes", action="store_true",
                    help="print every graph node of the prefill and the first decode step "
                         "with the tap it maps to (stderr)")
    ap.add_argument("--show-text", action="store_true",
                    help="print the decoded prompt + fed tokens on stderr")
    ap.add_argument("--no-check", action="store_true", help="skip the self-checks")
    ap.add_argument("--verbose", action="store_true", help="let llama.cpp log to stderr")
    args = ap.parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    t_start = time.time()

    try:
        import llama_cpp as L
        from llama_cpp._ggml import libggml
    except Exception:
        print(MISSING_LLAMA_CPP, file=sys.stderr)
        sys.exit(2)
    try:
        import numpy as np
    except ImportError:
        die("numpy is not installed: pip install numpy")

    if args.steps is not None and args.steps < 0:
        die("--steps must be >= 0")
    if args.threads < 1:
        die("--threads must be >= 1")
    if args.gpu_layers < -1:
        die("--gpu-layers must be -1 (all) or >= 0")
    if args.chunk < 0:
        die("--chunk must be >= 0")
    turns = [parse_ids(t, "--turn") for t in args.turn]
    if any(not t for t in turns):
        die("--turn: no ids")
    n_rounds = 1 + len(turns)
    forced = parse_ids(args.forced, "--forced") if args.forced else None
    if forced is not None:
        if args.steps is not None and args.steps * n_rounds != len(forced):
            die(f"--steps {args.steps} disagrees with --forced ({len(forced)} tokens"
                f"{f' over {n_rounds} turns' if n_rounds > 1 else ''})")
        if len(forced) % n_rounds:
            die(f"--forced: {len(forced)} ids do not split into {n_rounds} turns' decode steps")
        n_steps = len(forced) // n_rounds
    else:
        n_steps = args.steps or 0
    if args.no_bos and args.tokens:
        pass  # --tokens never adds BOS; --no-bos is implied
    # The recording plan (`parity golden --record`, checked by parity): taps kept at every step,
    # steps kept whole (at some layers), kq_soft_max's heads and rows (by position) kept.
    try:
        plan_taps, plan_full, plan_layers, plan_kq_heads, plan_kq_rows = parse_plan(args.record)
    except ValueError as e:
        die(f"--record: {e}")

    if not os.path.isfile(args.model):
        die(f"model file not found: {args.model}")
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        die(f"--out {out} exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not args.force:
        die(f"--out {out} is not empty (use --force to overwrite)")
    # The trace is written under a temporary name beside --out and moved into place at the
    # end: a failure leaves no half-written golden (and --force keeps the old one until then).
    out_abs = os.path.abspath(out)
    staging = os.path.join(os.path.dirname(out_abs),
                           f".{os.path.basename(out_abs)}.partial-{os.getpid()}")
    try:
        os.makedirs(os.path.dirname(out_abs), exist_ok=True)
        if os.path.isdir(staging):
            shutil.rmtree(staging)
        os.makedirs(staging)
    except OSError as e:
        die(f"--out {out}: cannot write there: {e.strerror or e}")
    _STAGING.append(staging)

    ggml = Ggml(libggml)

    # logging
    def _log(level, text, ud):
        if args.verbose:
            sys.stderr.write(text.decode("utf-8", "replace"))
    log_cb = L.llama_log_callback(_log)
    _KEEP_ALIVE.append(log_cb)  # llama.cpp may log until process exit
    L.llama_log_set(log_cb, None)
    L.llama_backend_init()

    # model
    mp = L.llama_model_default_params()
    backend = "llama.cpp-cpu"
    mp.n_gpu_layers = 0
    if args.gpu_layers != 0:
        gpus = [d for d in (ggml.devices() or []) if d["type"] in ("gpu", "igpu")]
        if not gpus:
            die("--gpu-layers: this llama.cpp build has no GPU device (build llama-cpp-python "
                "with e.g. CMAKE_ARGS=-DGGML_VULKAN=on, and check that a driver is installed)")
        # llama.cpp offloads the last n layers, and the output layer once n exceeds n_layer.
        mp.n_gpu_layers = 999 if args.gpu_layers < 0 else args.gpu_layers
        # The registry's name without its index: "Vulkan0" -> "vulkan", "CUDA0" -> "cuda".
        backend = "llama.cpp-" + gpus[0]["name"].rstrip("0123456789").lower()
    has_extra_bufts = any(f[0] == "use_extra_bufts" for f in type(mp)._fields_)
    if has_extra_bufts and not args.llama_defaults:
        mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    if not model:
        die(f"llama.cpp failed to load the model: {args.model} (rerun with --verbose for its log)")
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    n_layer = L.llama_model_n_layer(model)
    n_head = L.llama_model_n_head(model)
    n_head_kv = L.llama_model_n_head_kv(model)
    bos_id = L.llama_vocab_bos(vocab)

    def meta(key):
        buf = ctypes.create_string_buffer(256)
        n = L.llama_model_meta_val_str(model, key.encode(), buf, 256)
        return buf.value.decode("utf-8", "replace") if n >= 0 else None
    rules = arch_rules(meta, n_layer)

    # tokens
    if args.prompt is not None:
        text = args.prompt.encode("utf-8")
        cap = len(text) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(vocab, text, len(text), buf, cap, not args.no_bos, False)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(vocab, text, len(text), buf, cap, not args.no_bos, False)
        if n < 0:
            die("tokenization failed")
        prompt = list(buf[:n])
        bos_added = (not args.no_bos) and n > 0 and prompt[0] == bos_id
    else:
        prompt = parse_ids(args.tokens, "--tokens")
        bos_added = False
    if not prompt:
        die("the prompt tokenizes to zero tokens")
    for tok in prompt + (forced or []) + [t for turn in turns for t in turn]:
        if not 0 <= tok < n_vocab:
            die(f"token id {tok} out of range (n_vocab {n_vocab})")
    T = len(prompt)

    # context
    n_total = T + sum(len(t) for t in turns) + n_steps * n_rounds
    n_ctx = args.n_ctx or max(256, -(-n_total // 256) * 256)
    if n_ctx < n_total:
        die(f"--n-ctx {n_ctx} is smaller than prompt + turns + steps ({n_total})")
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = max([T, min(512, n_ctx)] + [len(t) for t in turns])
    cp.n_ubatch = cp.n_batch
    cp.n_seq_max = 1
    cp.n_threads = args.threads
    cp.n_threads_batch = args.threads
    cp_fields = {f[0] for f in type(cp)._fields_}
    fa_want = args.flash_attn or ("auto" if args.llama_defaults else "off")
    if "flash_attn_type" in cp_fields:
        cp.flash_attn_type = {"on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                              "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                              "auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO}[fa_want]
    elif "flash_attn" in cp_fields:
        cp.flash_attn = fa_want == "on"
    default_kv = "f16" if args.llama_defaults else "f32"
    for field, want in (("type_k", args.cache_type_k or default_kv),
                        ("type_v", args.cache_type_v or default_kv)):
        setattr(cp, field, getattr(L, "GGML_TYPE_" + want.upper()))
    capture = Capture(ggml, np, args.list_nodes)
    cb = L.ggml_backend_sched_eval_callback(capture.callback)
    cp.cb_eval = cb
    cp.cb_eval_user_data = None
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        die("llama.cpp failed to create a context (rerun with --verbose for its log)")
    type_names = {v: k[len("GGML_TYPE_"):].lower() for k, v in vars(L).items()
                  if k.startswith("GGML_TYPE_") and isinstance(v, int) and k != "GGML_TYPE_COUNT"}
    fa_desc = {-1: "auto", 0: "disabled", 1: "enabled"}
    if "flash_attn_type" in cp_fields:
        fa = fa_desc.get(cp.flash_attn_type, str(cp.flash_attn_type))
    else:
        fa = bool(getattr(cp, "flash_attn", False))

    steps_pos, steps_tokens, all_notes = [], [], {}
    # A GPU's arithmetic is not the CPU's (f16 tiles and softmax, f32 GELU): its recomputed ops
    # are checked at the loose level, as llama.cpp's defaults are.
    tight_kv = cp.type_k == L.GGML_TYPE_F32 and cp.type_v == L.GGML_TYPE_F32 and fa_want == "off"
    tight_checks = tight_kv and mp.n_gpu_layers == 0
    checks = None if args.no_check else StepChecks(n_head, n_head_kv, tight_checks, np, rules)
    order = [(t, None) for t in GLOBAL_FIRST] + \
            [(t, il) for il in range(n_layer) for t in LAYER_TAPS] + \
            [(t, None) for t in GLOBAL_LAST]
    tensors = []
    nbytes_total = 0
    def plan_wants(s, tap, il):
        return plan_keeps(plan_taps, plan_full, plan_layers, s, tap, il)

    def nodes_kept(s):
        """Which nodes llama.cpp copies out at step s, as keep(base, layer) (None: every one):
        the plan's taps there, every node of a whole step's layers (of `layers=`, else all) and
        its graph-wide ones, and K and V at those layers while the self-checks run and a later
        step is kept whole (it checks its attention against the keys and values of every
        earlier step; they are the size of the cache; RoPE is checked on the normed keys where
        an architecture norms them). Each node asked for splits llama.cpp's graph there: a scan
        asks for few."""
        whole = in_ranges(s, plan_full)
        if plan_taps is None or (whole and plan_layers is None):
            return None
        later_whole = any(b >= s for _, b in plan_full)
        kv = {"Kcur", "Kcur_normed", "Vcur"} if checks is not None and later_whole else set()
        every = set()
        for tap in plan_taps:
            every |= TAP_NODES.get(tap, set())

        def keep(base, il):
            if base in every:
                return True
            if il is None:
                # graph-wide nodes (and gemma2's unsuffixed per-layer ffn_post_norm, counted
                # in graph order: the write drops the layers the plan leaves out)
                return whole
            at = plan_layers is None or in_ranges(il, plan_layers)
            return at and (whole or base in kv)
        return keep

    def write_step(s, taps, positions, kq):
        """Each step goes to disk as soon as it is recorded: memory stays one step's taps (and
        the K/V the attention checks need), whatever the number of steps. kq_soft_max is cut
        already (kq: its heads and row indices); its entry lists them under a plan that cuts."""
        nonlocal nbytes_total
        os.makedirs(os.path.join(staging, f"s{s:03}"), exist_ok=True)
        for tap, il in order:
            a = taps.get((tap, il))
            if a is None or not plan_wants(s, tap, il):
                continue
            a = np.ascontiguousarray(a, dtype="<f4")
            rel = f"s{s:03}/{tap}.npy" if il is None else f"s{s:03}/{tap}-{il}.npy"
            np.save(os.path.join(staging, rel), a, allow_pickle=False)
            nbytes_total += a.nbytes
            e = {"step": s, "tap": tap, "layer": il, "file": rel, "shape": list(a.shape),
                 "dtype": "<f4"}
            if tap == "kq_soft_max" and plan_kq_heads is not None:
                e["heads"] = list(kq[0])
            if tap == "kq_soft_max" and plan_kq_rows is not None:
                e["rows"] = [positions[i] for i in kq[1]]
            tensors.append(e)
    listing = []

    def decode(tokens, pos0, step):
        nt = len(tokens)
        positions = list(range(pos0, pos0 + nt))
        kq = kq_cut(plan_kq_heads, plan_kq_rows, positions, n_head)
        batch = L.llama_batch_init(nt, 0, 1)
        try:
            batch.n_tokens = nt
            for i, tok in enumerate(tokens):
                batch.token[i] = tok
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            capture.reset(nodes_kept(step), kq)
            rc = L.llama_decode(ctx, batch)
        finally:
            L.llama_batch_free(batch)
        if capture.error:
            die(f"step {step}: error while copying a tensor: {capture.error}", 1)
        if rc != 0:
            die(f"step {step}: llama_decode returned {rc}", 1)
        lp = L.llama_get_logits(ctx)
        lg = np.ctypeslib.as_array(lp, shape=(nt * n_vocab,)).reshape(nt, n_vocab).copy()
        n_kv = pos0 + nt
        taps, notes, source = map_step(capture.records, n_layer, n_head, n_head_kv, nt, n_kv, np,
                                       kq)
        all_notes.update(notes)
        for given, real in capture.synthetic_src.items():
            how = ("MUL_MAT consuming result_norm" if given == "logits_uncapped" else
                   "ADD consuming attn_out" if given.startswith("ffn_inp") else
                   "the product rotating kqv_out back: a quantized V cache is stored rotated"
                   if given.startswith("kqv_out") else "MUL_MAT consuming kqv_out")
            all_notes[given] = f"unnamed node {real!r} ({how}) taken as {given}"
        if args.list_nodes and step <= 1:
            listing.append((step, list(capture.seen), source, dict(capture.synthetic_src)))
        if checks is not None:
            checks.step(step, taps, positions, dict(capture.rope_params), lg,
                         notes.get("ffn_act", "ffn_swiglu"), kq)
        try:
            write_step(step, taps, positions, kq)
        except OSError as e:
            die(f"--out {out}: writing step {step} failed: {e.strerror or e}")
        steps_pos.append(positions)
        steps_tokens.append(list(tokens))
        return lg

    t0 = time.time()
    try:
        step, pos, fi = 0, 0, 0

        def feed(ids):
            # the prompt or a turn: one step per chunk (--chunk), each chunk's rows attending to
            # the cache of every earlier step
            nonlocal step, pos
            c = args.chunk or len(ids)
            for i in range(0, len(ids), c):
                lg = decode(ids[i:i + c], pos, step)
                step, pos = step + 1, pos + len(ids[i:i + c])
            return lg

        lg = feed(prompt)
        for r in range(n_rounds):
            if r > 0:
                lg = feed(turns[r - 1])
            for _ in range(n_steps):
                tok = forced[fi] if forced is not None else int(np.argmax(lg[-1]))
                lg = decode([tok], pos, step)
                step, pos, fi = step + 1, pos + 1, fi + 1
    except ValueError as e:
        die(f"mapping llama.cpp nodes to taps failed: {e}", 1)
    next_token = int(np.argmax(lg[-1]))
    t_run = time.time() - t0

    if args.list_nodes:
        for step, seen, source, synth in listing:
            real_to_given = {v: k for k, v in synth.items()}
            print(f"--- step {step}: {len(seen)} graph nodes (* = requested, -> tap) ---", file=sys.stderr)
            occ = {}
            for name, op, tname, ne, is_view, want in seen:
                tap = ""
                if want:
                    given = real_to_given.get(name, name)
                    i = occ.get(given, 0)
                    occ[given] = i + 1
                    tap = source.get((given, i), "")
                    if given != name:
                        tap = f"{tap} (unnamed node, see notes)"
                    tap = f"-> {tap}" if tap else "-> (unused)"
                print(f"{'*' if want else ' '} {name:36s} {op:10s} {tname:5s} {str(ne):22s}"
                      f"{' view' if is_view else '     '} {tap}", file=sys.stderr)
        if all_notes:
            print("--- notes ---", file=sys.stderr)
            for k, v in all_notes.items():
                print(f"{k}: {v}", file=sys.stderr)

    # text
    def piece(tok):
        b = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(vocab, tok, b, 256, 0, False)
        if n < 0:
            b = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(vocab, tok, b, -n, 0, False)
        return b.raw[:max(n, 0)]

    if args.show_text:
        fed = [t for st in steps_tokens[1:] for t in st]
        ptxt = b"".join(piece(t) for t in prompt).decode("utf-8", "replace")
        gtxt = b"".join(piece(t) for t in fed).decode("utf-8", "replace")
        print(f"prompt: {ptxt!r}", file=sys.stderr)
        print(f"fed:    {gtxt!r}", file=sys.stderr)
        print(f"text:   {(ptxt + gtxt).strip()}", file=sys.stderr)

    # self-checks (run step by step in decode)
    check_summary = None
    if checks is not None:
        ck = checks.ck
        check_summary = {"checks": ck.n, "failed": len(ck.failures),
                         "worst_rel_err": {k: float(f"{v:.3g}") for k, v in sorted(ck.worst.items())}}
        if ck.failures:
            for f in ck.failures[:20]:
                print(f"llama_golden: check failed: {f}", file=sys.stderr)
            if len(ck.failures) > 20:
                print(f"llama_golden: ... {len(ck.failures) - 20} more", file=sys.stderr)

    settings = {
        "llama_cpp_python": L.__version__,
        "llama_cpp_commit": ggml.info("ggml_commit"),
        "ggml_version": ggml.info("ggml_version"),
        "system_info": L.llama_print_system_info().decode("utf-8", "replace").strip(),
        # Provenance: the layers offloaded to the GPU device (0: every layer ran on ggml's CPU
        # backend, whatever devices this build has); `parity check` holds only a CPU golden
        # to ggml-cpu rounding.
        "n_gpu_layers": mp.n_gpu_layers,
        "devices": ggml.devices(),
        "n_threads": args.threads,
        "type_k": type_names.get(cp.type_k, str(cp.type_k)),
        "type_v": type_names.get(cp.type_v, str(cp.type_v)),
        "flash_attn": fa,
        "flash_attn_resolved": capture.flash_attn_seen,
        "use_extra_bufts": bool(mp.use_extra_bufts) if has_extra_bufts else None,
        "n_ctx": n_ctx,
        "n_batch": cp.n_batch,
        "n_ubatch": cp.n_ubatch,
        "llama_defaults": args.llama_defaults,
        "chunk": args.chunk or None,
        "turns": [len(t) for t in turns],
        "bos": bos_added,
        "add_special": (not args.no_bos) if args.prompt is not None else False,
        "prompt": args.prompt if args.prompt is not None else args.prompt_text,
        "decode": "forced" if forced is not None else "greedy",
        "next_token": next_token,
        "command": command,
    }
    if check_summary is not None:
        settings["self_check"] = check_summary
    steps = []
    for s in range(len(steps_tokens)):
        e = {"step": s, "tokens": steps_tokens[s], "positions": steps_pos[s]}
        if s > 0:
            e["forced"] = True
        steps.append(e)
    manifest = {
        "format": "parity-trace",
        "version": 1,
        "model": {"path": args.model, "sha256": sha256_file(args.model),
                  "size": os.path.getsize(args.model)},
        "producer": {"name": "llama.cpp", "backend": backend, "version": L.__version__,
                     "settings": settings},
        "steps": steps,
        "tensors": tensors,
    }
    if args.record:
        manifest["record"] = args.record
    failed = check_summary is not None and check_summary["failed"] and not args.llama_defaults
    if failed:
        die(f"{check_summary['failed']} of {check_summary['checks']} self-checks failed: the "
            f"tensors taken from llama.cpp are not what the trace format says, so no golden "
            f"was written{'' if os.environ.get('PARITY_GOLDEN') else ' (--no-check to write it anyway)'}", 1)
    try:
        with open(os.path.join(staging, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        publish(staging, out)
    except OSError as e:
        die(f"--out {out}: {e.strerror or e}")
    _STAGING.remove(staging)

    L.llama_free(ctx)
    L.llama_model_free(model)

    n_fed = sum(len(t) for t in steps_tokens)
    chk = ""
    if check_summary is not None:
        chk = f", self-check {check_summary['checks'] - check_summary['failed']}/{check_summary['checks']} ok"
    print(f"llama_golden: wrote {len(tensors)} tensors ({nbytes_total / 1e6:.2f} MB) for "
          f"{len(steps_tokens)} steps (prompt {T} tokens{f' in chunks of {args.chunk}' if args.chunk else ''}"
          f"{f' + {len(turns)} more turns' if turns else ''} + {n_steps * n_rounds} decode), {n_fed} tokens, "
          f"to {out} in {time.time() - t_start:.2f}s (llama.cpp {t_run:.2f}s){chk}")
    return 0


if __name__ == "__main__":
    # Failures of the machine rather than of the input still end in one line and exit 2
    # (parity shows the last line; exit 1 is kept for a failed self-check).
    try:
        sys.exit(main())
    except MemoryError:
        die("out of memory (fewer --steps, or a smaller model)")
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        die(f"{where}{e.strerror or e}")
