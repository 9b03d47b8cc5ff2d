#!/usr/bin/env python3
"""Summarise scripts/depth_matrix.sh output as markdown (docs/tolerances.md, "Verdicts at depth").

For each model and each comparison `parity check` made (and llama.cpp's own spread: the same
model under llama.cpp's defaults against the tight golden): the pair kind, the worst NMSE among
the taps that gate the verdict against its threshold (between different roundings only embd and
the logits gate; the other taps are drift, shown in their own column), the worst mean logit KLD
against its threshold, top-1 agreement, and the verdict. Then each check's wall time and peak
RSS (time-*.txt, written by depth_matrix.sh).

Usage: python3 scripts/depth_summary.py OUT_DIR
"""
import glob, json, os, sys

out = sys.argv[1]


def load(p):
    j = json.load(open(p))
    return j["comparisons"] if isinstance(j, dict) else j


def where(r):
    k = r["key"]
    return f"s{k['step']} " + (f"L{k['layer']} " if k["layer"] is not None else "") + k["tap"]


def row(c):
    rs = [r for r in c["results"] if r["metrics"]["nmse"] is not None]
    gating = [r for r in rs if r.get("gating", True)]
    drift = [r for r in rs if not r.get("gating", True)]
    g = max(gating, key=lambda r: r["metrics"]["nmse"] / r["threshold"], default=None)
    d = max(drift, key=lambda r: r["metrics"]["nmse"], default=None)
    kld = max((l["kld_mean"] for l in c["logits"]), default=0.0)
    agree = sum(l["top1_agree"] for l in c["logits"])
    rows = sum(l["rows"] for l in c["logits"])
    gate = (
        f"{g['metrics']['nmse']:.1e} ({where(g)}) / {g['threshold']:.0e} = {g['metrics']['nmse'] / g['threshold']:.2f}"
        if g
        else "-"
    )
    drift = f"{d['metrics']['nmse']:.1e} ({where(d)})" if d else "-"
    kthr = c["kld_threshold"]
    k = f"{kld:.1e} / {kthr:.0e} = {kld / kthr:.3f}" if kthr else "-"
    verdict = c.get("verdict", "diverged" if c.get("first_divergence") else "parity")
    return f"{c['pair']} | {gate} | {drift} | {k} | {agree}/{rows} | {verdict}"


print("| model | comparison | pair | worst gating NMSE (where) / threshold | worst drift (not judged) | max mean KLD / threshold | top-1 | verdict |")
print("|---|---|---|---|---|---|---|---|")
for p in sorted(glob.glob(os.path.join(out, "check-*.json"))):
    name = os.path.basename(p)[len("check-"):-len(".json")]
    label = lambda c: c["candidate"] + " vs " + ("golden" if c["baseline"].startswith("llama.cpp") else c["baseline"])
    rows = [(label(c), c) for c in load(p)]
    for extra, what in (("nogolden", "no golden: "), ("spread", "")):
        q = os.path.join(out, f"{extra}-{name}.json")
        if os.path.exists(q):
            rows += [(("llama.cpp defaults vs golden (spread)" if extra == "spread" else what + label(c)), c) for c in load(q)]
    for lab, c in rows:
        print(f"| {name} | {lab} | {row(c)} |")

print()
print("| run | wall time (s) | peak RSS (MiB) |")
print("|---|---|---|")
for p in sorted(glob.glob(os.path.join(out, "time-*.txt"))):
    secs, kib = open(p).read().split()[:2]
    print(f"| {os.path.basename(p)[len('time-'):-len('.txt')]} | {float(secs):.0f} | {int(kib) // 1024} |")
