#!/usr/bin/env python3
"""The rounding-family matrix of docs/diagnosis.md: each activation rounding family of the numpy
engine (scripts/numpy_engine.py), clean and with each planted catalog bug, on full and sparse
dumps, judged by `parity diff`. Prints one markdown row per (family, dump, model) with the clean
verdict, whether any hypothesis was confirmed on the clean trace, and how many planted bugs
were named (confirmed as that catalog entry) of those found (exit 1); a bug named only as an equal
of the confirmed one ("also reproduces it: …, this trace cannot tell these apart") is listed as
such.

  rounding_zoo.py [--parity target/release/parity] [--models fixtures/tiny-llama-q8_0.gguf ...]
      [--families ggml ggml-scalar f16-acc/none ...] [--bugs rms-eps-10x rope-neox ...] [--work /tmp/zoo]
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ["none", "ggml", "ggml-scalar", "q8k", "q8_1", "f16", "bf16", "f16-acc", "f16-acc-unfused"]
BUGS = ["rope-neox", "rope-theta", "gqa-modulo", "transposed-wo", "rms-eps-10x",
        "norm-weight-twice", "norm-weight-missing", "swiglu-swap", "kv-off-by-one",
        "no-causal-mask", "decoder-nibble-order", "qk-permute"]


def golden_for(model):
    name = os.path.basename(model).removesuffix(".gguf")
    g = os.path.join(ROOT, "golden", name)
    return g if os.path.exists(os.path.join(g, "manifest.json")) else None


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return p.returncode, p.stdout + p.stderr


def judge(parity, golden, out, model):
    """exit code, confirmed hypothesis, family measured, first divergence, its own NMSE over its
    floor (None when it passed), the matmul floor, the text."""
    p = subprocess.run([parity, "diff", golden, out, "--model", model, "--json", "-"],
                       capture_output=True, text=True, cwd=ROOT)
    text = p.stderr
    conf = re.search(r"confirmed by experiment: (\S+)", text)
    # Hypotheses that reproduce it equally, which the report says the trace cannot tell apart.
    also = re.search(r"also reproduces it: ([^(]+) \(this trace cannot tell these apart", text)
    also = [h.strip() for h in also.group(1).split(",")] if also else []
    first = re.search(r"first divergence at (step \d+ (?:layer \d+ )?\S+)", text)
    floor = re.search(r"matmul floor (\S+)", text)
    fam, ratio = "-", None
    try:
        own = next(c for c in json.loads(p.stdout)["comparisons"] if c["pair"] == "own-inputs")
        fam = own.get("rounding_family", "-")
        if "prefill:" in own.get("baseline", ""):
            fam = own["baseline"].split("/", 1)[1]  # prefill and decode measured apart
        fd = own.get("first_divergence")
        if fd:
            ratio = fd["at"]["metrics"]["nmse"] / fd["at"]["threshold"]
    except (ValueError, StopIteration, KeyError, ZeroDivisionError):
        pass
    return (p.returncode, conf.group(1) if conf else None, also, fam,
            first.group(1) if first else None, ratio, floor.group(1) if floor else "-", text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parity", default=os.path.join(ROOT, "target/release/parity"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv/bin/python"))
    ap.add_argument("--models", nargs="+", default=[
        "fixtures/tiny-llama-q8_0.gguf", "fixtures/tiny-llama-q4_0.gguf",
        "../shared/models/TinyStories-656K-Q8_0.gguf"])
    ap.add_argument("--families", nargs="+", default=FAMILIES)
    ap.add_argument("--bugs", nargs="*", default=BUGS)
    ap.add_argument("--taps", nargs="+", default=["all", "sparse"])
    ap.add_argument("--work", default="/tmp/rounding-zoo")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each wrong verdict's text")
    a = ap.parse_args()
    print("| family | dump | model | clean: exit, family measured, matmul floor, confirmed | bugs found | bugs named | smallest found bug, own/floor | misnamed or missed |")
    print("|---|---|---|---|---|---|---|---|")
    for fam in a.families:
        for taps in a.taps:
            for model in a.models:
                model_name = os.path.basename(model).removesuffix(".gguf")
                golden = golden_for(model)
                if not os.path.exists(os.path.join(ROOT, model)) or golden is None:
                    print(f"skipped {model}: model or its golden missing", file=sys.stderr)
                    continue
                # PREFILL/DECODE: the prompt step rounds as PREFILL, the decode steps as DECODE.
                pre, _, dec = fam.rpartition("/")
                base = [a.python, "scripts/numpy_engine.py", model, "--golden", golden,
                        "--rounding", dec, "--taps", taps]
                if pre:
                    base += ["--prefill-rounding", pre]
                out = os.path.join(a.work, f"{fam.replace('/', '+')}-{taps}-{model_name}")
                rc, text = run(base + ["--out", out + "-clean"])
                if rc != 0:
                    print(f"numpy engine failed: {text}", file=sys.stderr)
                    continue
                crc, cconf, _, cfam, _, _, cfloor, ctext = judge(a.parity, golden, out + "-clean", model)
                if a.verbose and (crc != 0 or cconf):
                    print(ctext, file=sys.stderr)
                # The decoder bug swaps 4-bit nibbles: it applies to 4-bit weights only.
                bugs = [b for b in a.bugs if b != "decoder-nibble-order" or "q4" in model_name.lower()]
                found = named = 0
                smallest = None
                wrong = []
                for bug in bugs:
                    o = f"{out}-{bug}"
                    rc, text = run(base + ["--out", o, "--mutate", bug])
                    if rc != 0:
                        continue
                    brc, bconf, balso, _, _, ratio, _, btext = judge(a.parity, golden, o, model)
                    found += brc == 1
                    if brc == 1 and ratio is not None:
                        smallest = ratio if smallest is None else min(smallest, ratio)
                    # A catalog bug is named when the confirmed hypothesis is its catalog entry.
                    ok = brc == 1 and bconf == bug
                    named += ok
                    if not ok:
                        # Named beside an equal the report says the trace cannot separate.
                        tie = " (named with it as an equal)" if brc == 1 and bug in balso else ""
                        wrong.append(f"{bug}→{bconf or ('missed' if brc == 0 else 'unnamed')}{tie}")
                        if a.verbose:
                            print(btext, file=sys.stderr)
                margin = f"{smallest:.1e}" if smallest is not None else "-"
                print(f"| {fam} | {taps} | {model_name} | {crc}, {cfam}, {cfloor}, {cconf or 'none'} | "
                      f"{found}/{len(bugs)} | {named}/{len(bugs)} | {margin} | {', '.join(wrong) or '-'} |",
                      flush=True)


if __name__ == "__main__":
    main()
