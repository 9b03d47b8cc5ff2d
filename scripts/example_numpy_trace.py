#!/usr/bin/env python3
"""Write a tiny parity trace with numpy (docs/trace-format.md): python3 example_numpy_trace.py OUT_DIR"""
import json, os, sys
import numpy as np

out = sys.argv[1]
rng = np.random.default_rng(0)
n_embd, n_vocab = 8, 32
steps = [{"step": 0, "tokens": [1, 415, 2936], "positions": [0, 1, 2]},       # the prefill
         {"step": 1, "tokens": [9060], "positions": [3], "forced": True}]     # one decode step
tensors = []
for s in steps:
    T = len(s["tokens"])
    for tap, layer, shape in [("embd", None, [T, n_embd]), ("attn_norm", 0, [T, n_embd]),
                              ("l_out", 0, [T, n_embd]), ("logits", None, [T, n_vocab])]:
        x = rng.standard_normal(shape)  # your engine's tensor here, numpy shape = ggml ne reversed
        file = f"s{s['step']:03}/{tap}.npy" if layer is None else f"s{s['step']:03}/{tap}-{layer}.npy"
        os.makedirs(os.path.join(out, os.path.dirname(file)), exist_ok=True)
        np.save(os.path.join(out, file), np.ascontiguousarray(x, dtype="<f4"))
        tensors.append({"step": s["step"], "tap": tap, "layer": layer, "file": file,
                        "shape": shape, "dtype": "<f4"})
manifest = {"format": "parity-trace", "version": 1,
            "model": {"path": "model.gguf", "sha256": ""},  # the GGUF's sha256 hex; "" skips the check
            "producer": {"name": "my-engine", "backend": "cpu", "version": "0.1", "settings": {}},
            "steps": steps, "tensors": tensors}
with open(os.path.join(out, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
