#!/usr/bin/env python3
"""Write a parity trace from a Hugging Face `transformers` Llama model with forward hooks.

    python3 scripts/hf_trace.py HF_DIR GOLDEN_DIR OUT_DIR [--gguf MODEL.gguf] [--hf-order]

A shim: the adapter is parity_trace.hf in bindings/python (`python -m parity_trace.hf` where the
parity-trace package is installed); `--help` describes it.
"""
import os
import sys

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 os.pardir, "bindings", "python")))
from parity_trace.hf import main  # noqa: E402

if __name__ == "__main__":
    main()
