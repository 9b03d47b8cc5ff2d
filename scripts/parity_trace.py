#!/usr/bin/env python3
"""Write a parity trace (docs/trace-format.md) from any Python engine: numpy only.

    from parity_trace import TraceWriter
    w = TraceWriter("my-trace", model="model.gguf", engine="my-engine", backend="cpu")
    w.step([1, 415, 2936], [0, 1, 2])            # the prefill: ids and positions
    w.tap(None, "embd", x)                       # graph-wide taps: layer None
    w.tap(0, "attn_norm", xn)                    # per-layer taps: the layer index
    ...
    w.step([9060], [3])                          # each decode step
    w.finish()                                   # writes manifest.json

Arrays are numpy shapes with the token axis first ([T, n_embd], [T, n_head, head_dim];
kq_soft_max is [n_head, T, n_kv]); they are written as little-endian float32, C order. The same
checks as parity's Rust TraceWriter refuse a wrong name, layer, shape or a repeated tap.

Run as a script, it also works as an adapter for Hugging Face `transformers` Llama models:
see hf_trace.py beside it.
"""
import hashlib
import json
import os
import shutil

import numpy as np

TAPS = ["embd", "attn_norm", "q", "k", "v", "q_rope", "k_rope", "kq_soft_max", "kqv_out",
        "attn_out", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_act", "ffn_out", "l_out",
        "result_norm", "logits"]
GRAPH_WIDE = {"embd", "result_norm", "logits"}


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class TraceError(ValueError):
    pass


class TraceWriter:
    def __init__(self, out, model=None, sha256=None, engine="my-engine", backend="cpu",
                 version="", settings=None):
        """model: the GGUF file the engine ran (its sha256 is recorded so parity refuses a golden
        of another file); or pass sha256= directly, or neither to skip that check."""
        self.out = out
        if os.path.exists(os.path.join(out, "manifest.json")):
            # Replace a previous trace, never other files.
            for name in os.listdir(out):
                if name.startswith("s") and name[1:].isdigit():
                    shutil.rmtree(os.path.join(out, name))
        os.makedirs(out, exist_ok=True)
        if sha256 is None:
            sha256 = sha256_file(model) if model and os.path.isfile(model) else ""
        self.model = {"path": model or "", "sha256": sha256}
        self.producer = {"name": engine, "backend": backend, "version": version,
                         "settings": settings or {}}
        self.steps, self.tensors, self.seen = [], [], set()

    def step(self, tokens, positions):
        tokens, positions = [int(t) for t in tokens], [int(p) for p in positions]
        if not tokens or len(tokens) != len(positions):
            raise TraceError(f"step {len(self.steps)}: {len(tokens)} tokens and "
                             f"{len(positions)} positions (need the same, at least one)")
        self.steps.append({"step": len(self.steps), "tokens": tokens, "positions": positions})
        return len(self.steps) - 1

    def tap(self, layer, name, data, shape=None):
        if not self.steps:
            raise TraceError(f"tap '{name}' before the first step() call")
        if name not in TAPS:
            raise TraceError(f"unknown tap '{name}' (docs/trace-format.md lists them)")
        if (name in GRAPH_WIDE) != (layer is None):
            raise TraceError(f"tap '{name}' " + ("cannot have" if name in GRAPH_WIDE else "needs")
                             + " a layer")
        a = np.asarray(data, dtype=np.float32)
        if shape is not None:
            if int(np.prod(shape)) != a.size:
                raise TraceError(f"{name}: shape {list(shape)} does not hold {a.size} values")
            a = a.reshape(shape)
        s = self.steps[-1]
        axis = 1 if name == "kq_soft_max" else 0
        if a.ndim <= axis or a.shape[axis] != len(s["tokens"]):
            raise TraceError(f"{name} (layer {layer}, step {s['step']}): shape {list(a.shape)} "
                             f"should have the step's {len(s['tokens'])} tokens on axis {axis}")
        key = (s["step"], layer, name)
        if key in self.seen:
            raise TraceError(f"{name} (layer {layer}, step {s['step']}) recorded twice")
        self.seen.add(key)
        file = f"s{s['step']:03}/{name}.npy" if layer is None else f"s{s['step']:03}/{name}-{layer}.npy"
        os.makedirs(os.path.join(self.out, os.path.dirname(file)), exist_ok=True)
        np.save(os.path.join(self.out, file), np.ascontiguousarray(a, dtype="<f4"))
        self.tensors.append({"step": s["step"], "tap": name, "layer": layer, "file": file,
                             "shape": list(a.shape), "dtype": "<f4"})

    def finish(self):
        manifest = {"format": "parity-trace", "version": 1, "model": self.model,
                    "producer": self.producer, "steps": self.steps, "tensors": self.tensors}
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


if __name__ == "__main__":
    # Self-check: copy a golden's tensors through the writer; `parity diff GOLDEN OUT` then says
    # parity (bit-identical). Usage: parity_trace.py GOLDEN_DIR OUT_DIR
    import sys
    golden, out = sys.argv[1], sys.argv[2]
    with open(os.path.join(golden, "manifest.json")) as f:
        m = json.load(f)
    w = TraceWriter(out, sha256=m["model"]["sha256"], engine="copy", backend="numpy")
    w.model["path"] = m["model"]["path"]
    for s in m["steps"]:
        w.step(s["tokens"], s["positions"])
        for t in (t for t in m["tensors"] if t["step"] == s["step"]):
            w.tap(t["layer"], t["tap"], np.load(os.path.join(golden, t["file"])))
    w.finish()
    print(f"wrote {out}: {len(w.steps)} steps, {len(w.tensors)} taps")
