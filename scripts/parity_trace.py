#!/usr/bin/env python3
"""Write a parity trace (docs/trace-format.md) from any Python engine: numpy only.

A shim: the writer lives in bindings/python/parity_trace (the `parity-trace` package, which pip
installs with the parity binary); this file keeps `scripts/parity_trace.py` and
`sys.path.insert(0, "scripts"); from parity_trace import TraceWriter` working in a checkout.

    from parity_trace import TraceWriter
    w = TraceWriter("my-trace", model="model.gguf", engine="my-engine", backend="cpu")
    w.step([1, 415, 2936], [0, 1, 2])            # the prefill: ids and positions
    w.tap(None, "embd", x)                       # graph-wide taps: layer None
    w.tap(0, "attn_norm", xn)                    # per-layer taps: the layer index
    ...
    w.step([9060], [3])                          # each decode step
    w.finish()                                   # writes manifest.json

Run as a script (parity_trace.py GOLDEN_DIR OUT_DIR), it copies a golden's tensors through the
writer: `parity diff GOLDEN_DIR OUT_DIR` then says parity (bit-identical).
"""
import os
import sys

_PKG = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                     "bindings", "python"))
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)
if __name__ != "__main__":
    # Imported as the module `parity_trace` (from scripts/ on sys.path): stand aside for the
    # package, which bindings/python (now first on sys.path) provides under the same name.
    del sys.modules[__name__]
    import parity_trace as _package  # noqa: E402
    sys.modules[__name__] = _package
else:
    from parity_trace.__main__ import main  # noqa: E402
    sys.exit(main())
