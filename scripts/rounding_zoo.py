#!/usr/bin/env python3
"""The rounding-family matrix of docs/diagnosis.md: for each activation rounding family, the
numpy engine (scripts/numpy_engine.py) runs the clean model and every catalog bug that applies
to it, full and sparse dumps, through `parity selftest --engine numpy --rounding FAMILY`, which
judges each trace as `parity diff` does and checks each bug is found at its place and named.
Prints one markdown row per (family, dump, model): the clean verdict (exit code, the rounding
the judge measured, its matmul floor, the limits it states), how many bugs were found, found at
their place and named, the smallest margin by which a found bug stood over its floor, and each
row that was not as it must be (a bug named only as an equal of another, which the report says
the trace cannot tell apart, is listed as such). Exit 0 when every row of every selftest was ok.

  rounding_zoo.py [--parity target/release/parity] [--models fixtures/tiny-llama-q8_0.gguf ...]
      [--families ggml q8k f16-acc/none ...] [--taps all sparse] [--only rms-eps-10x,...]
      [--from-layer L] [--golden-dir golden] [--jobs 2]

With --from-layer L every compute bug acts from layer L on (token and layout bugs are skipped):
on a generated deep model it must be found at layer L with every layer before it clean.
--golden-dir is where each model's golden is (GOLDEN_DIR/NAME for NAME.gguf).
"""
import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every family parity models, the split prefill/decode of llama.cpp Vulkan, two engines whose
# output projection rounds unlike their layers, and f16-trunc (inputs cut to f16 toward zero):
# a rounding parity does not model (its verdicts state a widened floor).
FAMILIES = ["none", "ggml", "ggml-scalar", "q8k", "q8_1-gpu", "f16", "bf16", "f16-acc",
            "f16-acc-unfused", "tf32", "f16-acc/none", "f16-acc-unfused/none", "f16-trunc",
            # an output projection rounded unlike the layers (a Rust engine's Q8_K layers)
            "q8k+lm=ggml", "f16+lm=none"]
MODELS = ["fixtures/tiny-llama-q8_0.gguf", "fixtures/tiny-llama-q4_0.gguf",
          "fixtures/tiny-llama-q4_k.gguf", "../shared/models/TinyStories-656K-Q8_0.gguf"]


def golden_for(model, golden_dir):
    name = os.path.basename(model).removesuffix(".gguf")
    g = os.path.join(ROOT, golden_dir, name)
    return g if os.path.exists(os.path.join(g, "manifest.json")) else None


def selftest(parity, model, golden, fam, taps, only, from_layer):
    cmd = [parity, "selftest", model, "--golden", golden, "--engine", "numpy",
           "--rounding", fam, "--json"]
    if taps == "sparse":
        cmd.append("--sparse")
    if only:
        cmd += ["--only", only]
    if from_layer:
        cmd += ["--from-layer", str(from_layer)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
    return json.loads(p.stdout)


def summarize(fam, taps, model_name, rows):
    clean = next(r for r in rows if r["case"] == "clean")
    limits = []
    for lim in clean.get("limits", []):
        limits.append("widened floor" if lim.startswith("no known") else "spans")
    floor = clean.get("matmul_floor")
    named = clean.get("named") or "nothing confirmed"
    floor = f"{floor:.0e}" if floor is not None else "-"
    head = f"{int(clean['diverged'])}, {clean.get('measured') or '-'}, {floor}, {named}"
    head += f" ({', '.join(limits)})" if limits else ""
    bugs = [r for r in rows if r["case"] != "clean"]
    found = sum(r["diverged"] for r in bugs if "(declared)" not in r["case"])
    undeclared = sum("(declared)" not in r["case"] for r in bugs)
    ok = sum(r["ok"] for r in bugs)
    margins = [r["own_over_floor"] for r in bugs
               if r["diverged"] and r.get("own_over_floor") is not None]
    smallest = f"{min(margins):.1e}" if margins else "-"
    notes = []
    for r in bugs:
        if not r["ok"]:
            notes.append(f"{r['case']}: {r['why']} (found {r['found'] or '-'}, "
                         f"expected {r['expected']}, named {r['named'] or '-'})")
        elif r["named"] != r["expected_name"] and r["expected_name"] in r.get("also", []):
            notes.append(f"{r['case']}: named beside {r['named']} as an equal")
    if not clean["ok"]:
        notes.insert(0, f"clean: {clean['why']} at {clean['found']}")
    print(f"| {fam} | {taps} | {model_name} | {head} | {found}/{undeclared} | {ok}/{len(bugs)} | "
          f"{smallest} | {'; '.join(notes) or '-'} |", flush=True)
    return clean["ok"] and ok == len(bugs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parity", default=os.path.join(ROOT, "target/release/parity"))
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--families", nargs="+", default=FAMILIES)
    ap.add_argument("--taps", nargs="+", default=["all", "sparse"])
    ap.add_argument("--only", help="catalog names, comma-separated (the clean run always runs)")
    ap.add_argument("--from-layer", type=int, default=0)
    ap.add_argument("--golden-dir", default="golden")
    ap.add_argument("--jobs", type=int, default=1, help="selftests run at once")
    a = ap.parse_args()
    print("| family | dump | model | clean: exit, rounding measured, matmul floor, confirmed (limits stated) "
          "| bugs found | rows at their place and named | smallest found bug, own/floor | not as it must be |")
    print("|---|---|---|---|---|---|---|---|")
    jobs = []
    for fam in a.families:
        for taps in a.taps:
            for model in a.models:
                golden = golden_for(model, a.golden_dir)
                if not os.path.exists(os.path.join(ROOT, model)) or golden is None:
                    print(f"skipped {model}: model or its golden missing", file=sys.stderr)
                    continue
                jobs.append((fam, taps, model, golden))
    all_ok = True
    with ThreadPoolExecutor(max_workers=a.jobs) as ex:
        runs = [ex.submit(selftest, a.parity, m, g, f, t, a.only, a.from_layer) for f, t, m, g in jobs]
        # Rows print in the table's order as their selftests end.
        for (fam, taps, model, _), run in zip(jobs, runs):
            name = os.path.basename(model).removesuffix(".gguf")
            if a.from_layer:
                name += f" (bugs from layer {a.from_layer})"
            all_ok &= summarize(fam, taps, name, run.result())
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
