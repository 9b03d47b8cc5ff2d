#!/usr/bin/env python3
"""Measure noise floors: run `parity check --json` on every fixture and shared model that has a
golden and print markdown tables of the worst NMSE per tap kind, per comparison against the
llama.cpp golden. Output goes into docs/tolerances.md (appendix).

Usage: python3 scripts/noise_floors.py [PARITY_BINARY]  (default target/release/parity)
"""
import glob, json, os, subprocess, sys, tempfile

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
parity = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "target/release/parity")
models = sorted(glob.glob(os.path.join(root, "fixtures/*.gguf")))
models += [os.path.join(root, "../shared/models", m) for m in
           ["stories260K.gguf", "TinyStories-656K-Q8_0.gguf", "TinyStories-656K.f16.gguf", "TinyStories-656K-Q4_0.gguf"]]
taps = ["embd", "attn_norm", "q", "k", "v", "q_rope", "k_rope", "kq_soft_max", "kqv_out", "attn_out",
        "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_act", "ffn_out", "l_out", "result_norm", "logits"]
cols = [("reference", "plain f32"), ("reference:ggml-cpu", "emulated"), ("reference:ggml-cpu/op-by-op", "emulated op-by-op"),
        ("fast", "fast"), ("fast/op-by-op", "fast op-by-op")]

def fmt(x):
    return "0" if x == 0 else f"{x:.1e}"

print("| model | weights | " + " | ".join(h for _, h in cols) + " | KLD plain | KLD emulated |")
print("|---|---|" + "---|" * len(cols) + "---|---|")
details = []
for m in models:
    if not os.path.exists(m):
        continue
    with tempfile.NamedTemporaryFile(suffix=".json") as tf:
        r = subprocess.run([parity, "check", m, "--json", tf.name], capture_output=True, text=True)
        if r.returncode not in (0, 1):
            print(f"<!-- {m}: {r.stderr.strip()} -->")
            continue
        cs = json.load(open(tf.name))
    vs_golden = {c["candidate"].split("/", 1)[1]: c for c in cs if c["baseline"].startswith("llama.cpp")}
    worst, kld, per_tap = {}, {}, {}
    for key, _ in cols:
        c = vs_golden.get(key)
        if not c:
            continue
        w = {}
        for res in c["results"]:
            t = res["key"]["tap"]
            w[t] = max(w.get(t, 0.0), res["metrics"]["nmse"])
        per_tap[key] = w
        worst[key] = max(w.values())
        kld[key] = max((l["kld_mean"] for l in c["logits"]), default=0.0)
        wtype = c["weight_type"]
    name = os.path.basename(m)[:-5]
    print(f"| {name} | {wtype} | " + " | ".join(fmt(worst[k]) if k in worst else "—" for k, _ in cols)
          + f" | {fmt(kld.get('reference', 0))} | {fmt(kld.get('reference:ggml-cpu', 0))} |")
    details.append((name, wtype, per_tap))

for name, wtype, per_tap in details:
    print(f"\n#### {name} ({wtype}): worst NMSE per tap kind vs the llama.cpp golden\n")
    print("| tap | " + " | ".join(h for _, h in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for t in taps:
        if any(t in per_tap.get(k, {}) for k, _ in cols):
            print(f"| {t} | " + " | ".join(fmt(per_tap[k][t]) if t in per_tap.get(k, {}) else "—" for k, _ in cols) + " |")
