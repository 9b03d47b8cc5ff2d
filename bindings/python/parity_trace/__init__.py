"""Write a parity trace (docs/trace-format.md) from any Python engine.

    from parity_trace import TraceWriter, golden_ids
    w = TraceWriter("my-trace", model="model.gguf", engine="my-engine", backend="cpu")
    for tokens, positions in golden_ids("golden/mine"):   # the golden's prompt, then each forced id
        w.step(tokens, positions)
        w.tap(None, "embd", x)                            # graph-wide taps: layer None
        w.tap(0, "attn_norm", xn)                         # per-layer taps: the layer index
        ...
    w.finish()                                            # writes manifest.json

`TraceWriter("my-trace.npz", ...)` writes the trace as one uncompressed .npz archive instead of a
folder (what `np.load` opens too; `parity diff` reads it as it reads a folder): one file, not
one per tap, written beside the target and moved into place by finish().

Arrays are numpy shapes with the token axis first ([T, n_embd], [T, n_head, head_dim];
kq_soft_max is [n_head, T, n_kv]); they are written as little-endian float32, C order. numpy
arrays, torch tensors (any device, any float dtype, with or without grad) and mlx / jax arrays
are accepted; torch and mlx are never imported unless such an array is given. The same checks as
parity's Rust TraceWriter refuse a wrong name, layer, shape or a repeated tap.

A recording plan (`record=`, else PARITY_RECORD: `taps=l_out,logits;full=3;layers=5;
kq_heads=0-1;kq_rows=40-47`) is honoured without a change to the engine: taps it leaves out are
dropped (`layers=`: at a whole step, the per-layer taps outside `taps=` are kept at those layers
only; `wants(name, layer)` says so to an engine that skips computing them), and kq_soft_max, handed over whole, is stored cut to the plan's heads and rows (rows named by
position; its manifest entry lists them as "heads" and "rows"), or not at all at a step that
keeps none of them.

Submodules: `parity_trace.hf` (forward hooks for a Hugging Face `transformers` Llama model, which
imports torch and transformers only when used) and `parity_trace.testing`
(`assert_trace_matches(golden, trace)`: `parity diff` as a pytest assertion).

`python -m parity_trace GOLDEN OUT` copies a golden through the writer (a self-check: `parity
diff GOLDEN OUT` then says parity, bit-identical).

This package is the one Python implementation of the format: scripts/parity_trace.py and
scripts/hf_trace.py in the parity repository import it from bindings/python.
"""
import hashlib
import io
import json
import os
import re
import shutil
import zipfile

import numpy as np

__all__ = ["TAPS", "GRAPH_WIDE", "LAYOUTS", "RECORD_ENV", "Record", "TraceError", "TraceWriter",
           "golden_ids", "sha256_file", "to_numpy"]

# docs/trace-format.md's taps, in graph order within a layer (src/trace/taps.rs).
TAPS = ["embd", "embd_scaled", "attn_norm", "q", "k", "v", "q_normed", "k_normed", "q_rope",
        "k_rope", "kq_soft_max", "kqv_out", "attn_out", "attn_post_norm", "ffn_inp", "ffn_norm",
        "ffn_gate", "ffn_up", "ffn_act", "ffn_out", "ffn_post_norm", "l_out", "result_norm",
        "logits_uncapped", "logits"]
GRAPH_WIDE = {"embd", "embd_scaled", "result_norm", "logits_uncapped", "logits"}
# Stored orders a manifest may declare (docs/diagnosis.md, "Layouts"), with the axis that holds
# the step's tokens in each (None: the tap's own default).
LAYOUTS = {"head-major": 1, "token-major": 0, "head-interleaved": 0, "rotary-halves": None,
           "transposed": -1}


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class TraceError(ValueError):
    pass


def to_numpy(x):
    """A numpy array of `x`'s values: numpy arrays as they are; torch tensors detached, moved to
    the CPU and widened to f32 (numpy has no bfloat16); mlx arrays widened to f32; anything else
    (jax arrays, lists, numbers) through np.asarray. torch and mlx are not imported here unless
    `x` is one of theirs."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__ or ""
    if hasattr(x, "detach") and hasattr(x, "cpu") and hasattr(x, "numpy"):  # torch.Tensor
        t = x.detach().cpu()
        if getattr(t, "is_floating_point", lambda: False)():
            t = t.float()
        return t.numpy()
    if mod.startswith("mlx"):
        import mlx.core as mx  # given an mlx array, mlx is installed
        return np.asarray(x.astype(mx.float32))
    return np.asarray(x)

# The recording plan a scan's zoom asks for (docs/trace-format.md, "Scan and zoom").
RECORD_ENV = "PARITY_RECORD"


def _shown(text):
    """A piece of a plan as an error line quotes it: cut, control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:60])


# The plan's lists of numbers (`full`, `layers`, `kq_heads`, `kq_rows`): what an item of each
# names, in the order the canonical line prints them.
_LISTS = {"full": "a step number", "layers": "a layer number", "kq_heads": "a head number",
          "kq_rows": "a position"}
_PARTS = "taps=…;full=…;layers=…;kq_heads=…;kq_rows=…"
# Bounds of a plan's lists, as parity's: the largest number an item may name (a position or
# layer index a manifest may hold) and the most items a list may have.
_MAX_NUMBER, _MAX_ITEMS = 1 << 24, 4096


def _ranges(key, value):
    """`3,7-8` as merged inclusive ranges [(a, b), ...] in increasing order; a bad item raises
    TraceError naming `key`."""
    what = _LISTS[key]
    ranges = []
    for item in (i.strip() for i in value.split(",")):
        if not item:
            continue
        if len(ranges) == _MAX_ITEMS:
            raise TraceError(f"{key}: more than {_MAX_ITEMS} items")
        ends = [e.strip() for e in item.split("-", 1)]
        for e in ends:
            if not re.fullmatch(r"[0-9]{1,9}", e) or int(e) > _MAX_NUMBER:
                raise TraceError(f"{key}: '{_shown(e)}' is not {what} or a range a-b")
        a, b = int(ends[0]), int(ends[-1])
        if a > b:
            raise TraceError(f"{key}: the range {a}-{b} runs backwards")
        ranges.append((a, b))
    return _merged(ranges)


def _merged(ranges):
    merged = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _printed(ranges):
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in _merged(ranges))


class Record:
    """A recording plan, `taps=l_out,result_norm,logits;full=3,7-8;layers=5;kq_heads=0-3;
    kq_rows=40-47`: the taps kept at every step (a scan; left out: all), the steps kept whole,
    the layers a whole step keeps every tap of (left out: all; the others keep `taps=`'s, and
    the graph-wide taps are kept whole), and the heads and rows (by position) of kq_soft_max
    kept wherever it is kept (left out: all). The same grammar as parity's (the Rust crate's
    `parity_trace::Record`); a bad plan raises TraceError, one line naming its part."""

    def __init__(self, line):
        self.taps, self.full = None, []
        # The layers a whole step keeps every tap of, and kq_soft_max's heads and rows
        # (positions) kept, as merged ranges; None: all of them.
        self.layers = self.kq_heads = self.kq_rows = None
        seen = set()
        for part in (p.strip() for p in line.split(";")):
            if not part:
                continue
            if "=" not in part:
                raise TraceError(f"'{_shown(part)}' is not key=value (taps=l_out,logits;full=3)")
            key, value = (x.strip() for x in part.split("=", 1))
            if key != "taps" and key not in _LISTS:
                raise TraceError(f"unknown part '{_shown(key)}' ({_PARTS})")
            if key in seen:
                raise TraceError(f"'{key}' is given twice")
            seen.add(key)
            if key == "taps":
                names = [n.strip() for n in value.split(",")]
                if "all" in names:
                    self.taps = None
                    continue
                for n in names:
                    if n not in TAPS:
                        raise TraceError(f"taps: unknown tap '{_shown(n)}' (docs/trace-format.md "
                                         "lists them)")
                self.taps = set(names)
            elif key == "full":
                self.full = _ranges(key, value)
            else:
                ranges = _ranges(key, value)
                if not ranges:
                    raise TraceError(f"{key}: no {_LISTS[key][2:]} given")
                setattr(self, key, ranges)

    @classmethod
    def from_env(cls):
        """The plan in PARITY_RECORD, or None when it is not set."""
        line = os.environ.get(RECORD_ENV)
        if line is None:
            return None
        try:
            return cls(line)
        except TraceError as e:
            raise TraceError(f"{RECORD_ENV}: {e}") from None

    def full_step(self, step):
        return any(a <= step <= b for a, b in self.full)

    def wants(self, step, tap, layer=None):
        """Whether `tap` is kept at `step` (kq_soft_max: some of it, see kq_cut): at layer
        `layer`, or, without one (and for a graph-wide tap), at any layer."""
        if self.taps is None or tap in self.taps:
            return True
        if not self.full_step(step):
            return False
        return layer is None or self.layers is None or any(a <= layer <= b for a, b in self.layers)

    def cuts(self):
        """Whether the plan keeps only some heads or rows of kq_soft_max."""
        return self.kq_heads is not None or self.kq_rows is not None

    def kq_cut(self, positions, n_head):
        """What a step of these `positions` keeps of a kq_soft_max of `n_head` heads: (heads,
        rows), the head numbers and the row indices within the step (i where positions[i] is
        in kq_rows), increasing; each None where the plan keeps every one. An empty list: the
        step keeps none of it (no file, no manifest entry)."""
        heads = rows = None
        if self.kq_heads is not None:
            heads = [h for h in range(n_head) if any(a <= h <= b for a, b in self.kq_heads)]
        if self.kq_rows is not None:
            rows = [i for i, p in enumerate(positions)
                    if any(a <= p <= b for a, b in self.kq_rows)]
        return heads, rows

    def __str__(self):
        taps = "all" if self.taps is None else ",".join(t for t in TAPS if t in self.taps)
        line = f"taps={taps}"
        for key in _LISTS:
            ranges = getattr(self, key)
            if ranges:
                line += f";{key}={_printed(ranges)}"
        return line


class TraceWriter:
    def __init__(self, out, model=None, sha256=None, engine="my-engine", backend="cpu",
                 version="", settings=None, layouts=None, record=None):
        """out: the trace folder (created; a previous trace there is replaced, other files kept).
        model: the GGUF file the engine ran (its sha256 and size are recorded so parity refuses a
        golden of another file); or pass sha256= directly, or neither to skip that check.
        layouts: {tap: layout} declared in the manifest for taps stored in another order
        (docs/diagnosis.md, "Layouts"), e.g. {"q_rope": "head-major"}.
        record: a recording plan (a Record or its line; default: PARITY_RECORD, if set): taps
        it leaves out are accepted by tap() and not stored, so an engine honours the zoom
        `parity diff` asks for without a change; wants(name) lets it skip computing them. Its
        kq_heads/kq_rows cut kq_soft_max (given whole, head-major or declared token-major)
        to those heads and rows; its layers keep a whole step's per-layer taps at those layers
        only (wants(name, layer))."""
        if isinstance(record, str):
            record = Record(record)
        self.record = record if record is not None else Record.from_env()
        self.out = out
        self._zip = None
        if os.fspath(out).lower().endswith(".npz"):
            # One archive, written under a staging name beside it and renamed by finish().
            if os.path.isdir(out) or os.path.islink(out):
                raise TraceError(f"{out}: is a folder or a link (an .npz trace is one file)")
            head, tail = os.path.split(os.path.abspath(out))
            self._tmp = os.path.join(head, f".{tail}.partial-{os.getpid()}")
            self._zip = zipfile.ZipFile(self._tmp, "w", zipfile.ZIP_STORED)
        else:
            if os.path.exists(os.path.join(out, "manifest.json")):
                # Replace a previous trace, never other files.
                for name in os.listdir(out):
                    if name.startswith("s") and name[1:].isdigit():
                        shutil.rmtree(os.path.join(out, name))
            os.makedirs(out, exist_ok=True)
        self.model = {"path": os.fspath(model) if model else "", "sha256": ""}
        if sha256 is not None:
            self.model["sha256"] = sha256
        elif model and os.path.isfile(model):
            self.model["sha256"] = sha256_file(model)
            self.model["size"] = os.path.getsize(model)
        self.producer = {"name": engine, "backend": backend, "version": version,
                         "settings": settings or {}}
        self.layouts = {}
        for tap, layout in (layouts or {}).items():
            self._layout_axis(tap, layout)
            self.layouts[tap] = layout
        self.steps, self.tensors, self.seen = [], [], set()

    def wants(self, name, layer=None):
        """Whether the current step keeps tap `name` under the recording plan: at layer
        `layer`, or, without one, at any layer (a plan's `layers=` keeps a whole step's other
        per-layer taps at some layers only)."""
        if self.record is None or not self.steps:
            return True
        s = self.steps[-1]
        if name == "kq_soft_max" and self.record.kq_rows is not None:
            # no row of this step kept: kq_soft_max is not written here
            if not self.record.kq_cut(s["positions"], 0)[1]:
                return False
        return self.record.wants(s["step"], name, layer)

    @staticmethod
    def _layout_axis(name, layout):
        if name not in TAPS:
            raise TraceError(f"unknown tap '{name}' (docs/trace-format.md lists them)")
        if layout not in LAYOUTS:
            raise TraceError(f"{name}: unknown layout '{layout}' (known: {', '.join(LAYOUTS)})")
        return LAYOUTS[layout]

    def step(self, tokens, positions, forced=None):
        """Begin a step: the prefill (step 0) with all prompt ids, then one call per decode step.
        forced: whether the step's ids were fed (teacher-forced) rather than sampled; recorded
        when given. Returns the step's index."""
        tokens, positions = [int(t) for t in tokens], [int(p) for p in positions]
        if not tokens or len(tokens) != len(positions):
            raise TraceError(f"step {len(self.steps)}: {len(tokens)} tokens and "
                             f"{len(positions)} positions (need the same, at least one)")
        s = {"step": len(self.steps), "tokens": tokens, "positions": positions}
        if forced is not None:
            s["forced"] = bool(forced)
        self.steps.append(s)
        return len(self.steps) - 1

    def tap(self, layer, name, data, shape=None, layout=None):
        """Record one tensor of the current step. layer: None for graph-wide taps (embd,
        result_norm, logits, ...), the layer index otherwise. shape: reshape the data to this
        numpy shape first. layout: the order the tensor is stored in, when not canonical (by
        default the one declared for this tap in the constructor's layouts); it only moves the
        token-axis check, and is not declared by this call."""
        if not self.steps:
            raise TraceError(f"tap '{name}' before the first step() call")
        if name not in TAPS:
            raise TraceError(f"unknown tap '{name}' (docs/trace-format.md lists them)")
        if (name in GRAPH_WIDE) != (layer is None):
            raise TraceError(f"tap '{name}' " + ("cannot have" if name in GRAPH_WIDE else "needs")
                             + " a layer")
        layer = None if layer is None else int(layer)
        if not self.wants(name, layer):
            return
        a = np.asarray(to_numpy(data), dtype=np.float32)
        if shape is not None:
            shape = [int(d) for d in shape]
            if int(np.prod(shape)) != a.size:
                raise TraceError(f"{name}: shape {shape} does not hold {a.size} values")
            a = a.reshape(shape)
        s = self.steps[-1]
        layout = layout or self.layouts.get(name)
        axis = self._layout_axis(name, layout) if layout else None
        if axis is None:
            axis = 1 if name == "kq_soft_max" else 0
        if axis < 0:
            axis += a.ndim
        if a.ndim <= axis or axis < 0 or a.shape[axis] != len(s["tokens"]):
            raise TraceError(f"{name} (layer {layer}, step {s['step']}): shape {list(a.shape)} "
                             f"should have the step's {len(s['tokens'])} tokens on axis {axis} "
                             "(numpy shape = ggml ne reversed)")
        key = (s["step"], layer, name)
        if key in self.seen:
            raise TraceError(f"{name} (layer {layer}, step {s['step']}) recorded twice")
        self.seen.add(key)
        cut = {}
        if name == "kq_soft_max" and self.record is not None and self.record.cuts():
            a, cut = self._kq_cut(a, layer, layout)
            if a is None:
                return  # none of its heads or rows kept at this step
        file = f"s{s['step']:03}/{name}.npy" if layer is None else f"s{s['step']:03}/{name}-{layer}.npy"
        a = np.ascontiguousarray(a, dtype="<f4")
        if self._zip is not None:
            buf = io.BytesIO()
            np.save(buf, a)
            self._zip.writestr(file, buf.getvalue())
        else:
            os.makedirs(os.path.join(self.out, os.path.dirname(file)), exist_ok=True)
            np.save(os.path.join(self.out, file), a)
        self.tensors.append({"step": s["step"], "tap": name, "layer": layer, "file": file,
                             "shape": list(a.shape), "dtype": "<f4", **cut})

    def _kq_cut(self, a, layer, layout):
        """kq_soft_max `a` (the step's whole tensor, stored in `layout`) cut to the plan's heads
        and rows: (the array, the entry's "heads"/"rows"), or (None, {}) when it keeps none."""
        s = self.steps[-1]
        if layout in (None, "head-major"):
            head_axis, row_axis = 0, 1
        elif layout == "token-major":
            head_axis, row_axis = 1, 0
        else:
            raise TraceError(f"kq_soft_max (layer {layer}, step {s['step']}): the plan's "
                             f"kq_heads/kq_rows cut a head-major or token-major tensor, not "
                             f"{layout}")
        if a.ndim != 3:
            raise TraceError(f"kq_soft_max (layer {layer}, step {s['step']}): shape "
                             f"{list(a.shape)} is not [n_head, T, n_kv] (or token-major "
                             "[T, n_head, n_kv]): the plan's kq_heads/kq_rows cannot cut it")
        heads, rows = self.record.kq_cut(s["positions"], a.shape[head_axis])
        if heads == [] or rows == []:
            return None, {}
        cut = {}
        if heads is not None:
            a = np.take(a, heads, axis=head_axis)
            cut["heads"] = heads
        if rows is not None:
            a = np.take(a, rows, axis=row_axis)
            cut["rows"] = [s["positions"][i] for i in rows]
        return a, cut

    def finish(self):
        """Write manifest.json; returns the manifest as a dict."""
        manifest = {"format": "parity-trace", "version": 1, "model": self.model,
                    "producer": self.producer, "steps": self.steps, "tensors": self.tensors}
        if self.layouts:
            manifest["layouts"] = dict(self.layouts)
        if self.record is not None:
            manifest["record"] = str(self.record)
        if self._zip is not None:
            self._zip.writestr("manifest.json", json.dumps(manifest, indent=1) + "\n")
            self._zip.close()
            os.replace(self._tmp, self.out)
            return manifest
        with open(os.path.join(self.out, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        return manifest


def golden_ids(golden_dir):
    """The ids and positions of each step of a golden (prompt, then the forced decode tokens):
    what an engine must be fed to be compared with it."""
    with open(os.path.join(golden_dir, "manifest.json")) as f:
        m = json.load(f)
    return [(s["tokens"], s["positions"]) for s in m["steps"]]


def copy_trace(golden, out):
    """Copy a trace's tensors through the writer (the self-check of `python -m parity_trace`):
    `parity diff GOLDEN OUT` then says parity, bit-identical. Returns the writer."""
    with open(os.path.join(golden, "manifest.json")) as f:
        m = json.load(f)
    w = TraceWriter(out, sha256=m["model"]["sha256"], engine="copy", backend="numpy",
                    layouts=m.get("layouts"), record=m.get("record"))
    w.model["path"] = m["model"]["path"]
    for s in m["steps"]:
        w.step(s["tokens"], s["positions"])
        for t in (t for t in m["tensors"] if t["step"] == s["step"]):
            a = np.load(os.path.join(golden, t["file"]))
            if "heads" in t or "rows" in t:
                a = _uncut(a, t, s["positions"], (m.get("layouts") or {}).get(t["tap"]))
            w.tap(t["layer"], t["tap"], a)
    w.finish()
    return w


def _uncut(a, entry, positions, layout):
    """A cut kq_soft_max put back in a whole step's shape (zeros where nothing was kept), so
    that the writer, cutting it to the same plan, stores the same values."""
    token_major = layout == "token-major"
    head_axis, row_axis = (1, 0) if token_major else (0, 1)
    heads = entry.get("heads", range(a.shape[head_axis]))
    rows = [positions.index(p) for p in entry["rows"]] if "rows" in entry else range(len(positions))
    shape = [0, 0, a.shape[2]]
    shape[head_axis], shape[row_axis] = (max(heads) + 1 if len(heads) else 0), len(positions)
    whole = np.zeros(shape, np.float32)
    ix = np.ix_(list(rows), list(heads)) if token_major else np.ix_(list(heads), list(rows))
    whole[ix] = a
    return whole
