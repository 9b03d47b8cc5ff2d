#!/usr/bin/env python3
"""Summarise scripts/depth_matrix.sh output as markdown (docs/tolerances.md, "Verdicts at depth").

For each model: the worst end-to-end NMSE (and its ratio to the threshold) and the worst logit
KLD of every comparison `parity check` made, next to llama.cpp's own spread (the same model
under llama.cpp's defaults against the tight golden).

Usage: python3 scripts/depth_summary.py OUT_DIR
"""
import glob, json, os, sys

out = sys.argv[1]


def load(p):
    j = json.load(open(p))
    return j["comparisons"] if isinstance(j, dict) else j


def worst(c):
    rs = [r for r in c["results"] if r["metrics"]["nmse"] is not None]
    if not rs:
        return None
    r = max(rs, key=lambda r: r["metrics"]["nmse"] / r["threshold"])
    k = r["key"]
    where = f"s{k['step']} " + (f"L{k['layer']} " if k["layer"] is not None else "") + k["tap"]
    kld = max((l["kld_mean"] for l in c["logits"]), default=0.0)
    return r["metrics"]["nmse"], r["threshold"], where, kld, c["kld_threshold"]


print("| model | comparison | worst NMSE (where) | / threshold | worst KLD | / threshold | verdict |")
print("|---|---|---|---|---|---|---|")
for p in sorted(glob.glob(os.path.join(out, "check-*.json"))):
    name = os.path.basename(p)[len("check-"):-len(".json")]
    rows = [(c["candidate"] + " vs " + ("golden" if c["baseline"].startswith("llama.cpp") else c["baseline"]), c) for c in load(p)]
    sp = os.path.join(out, f"spread-{name}.json")
    if os.path.exists(sp):
        rows += [("llama.cpp defaults vs golden (spread)", c) for c in load(sp)]
    for label, c in rows:
        w = worst(c)
        if w is None:
            continue
        nmse, thr, where, kld, kthr = w
        verdict = "diverged" if c.get("verdict", "") == "diverged" or c.get("first_divergence") or c.get("token_mismatch") else "parity"
        ratio = lambda x, t: f"{x / t:.2f}" if t else "-"
        print(f"| {name} | {label} | {nmse:.1e} ({where}) | {ratio(nmse, thr)} | {kld:.1e} | {ratio(kld, kthr)} | {verdict} |")
