#!/usr/bin/env python3
"""Measure the gpu backend's noise floor: run `parity check --backends reference,gpu --json` on
every fixture and shared model that has a golden and print a markdown table of the worst NMSE
per tap kind of the gpu fed the golden's tensors (op by op) against the plain reference fed the
same tensors, and the worst end-to-end NMSE of the gpu against the plain reference. Output goes
into docs/tolerances.md ("The gpu backend").

Usage: python3 scripts/gpu_floor.py [PARITY_BINARY]  (default target/release/parity)
On lavapipe: VK_DRIVER_FILES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json.
"""
import glob, json, os, subprocess, sys, tempfile

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
parity = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "target/release/parity")
models = sorted(glob.glob(os.path.join(root, "fixtures/*.gguf")))
models += sorted(glob.glob(os.path.join(root, "../shared/models/*.gguf")))
taps = ["embd", "embd_scaled", "attn_norm", "q", "k", "v", "q_normed", "k_normed", "q_rope", "k_rope", "kq_soft_max",
        "kqv_out", "attn_out", "attn_post_norm", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up",
        "ffn_act", "ffn_out", "ffn_post_norm", "l_out", "result_norm", "logits_uncapped", "logits"]


def fmt(x):
    return "0" if x == 0 else f"{x:.1e}"


rows, overall = [], {}
for m in models:
    with tempfile.NamedTemporaryFile(suffix=".json") as tf:
        r = subprocess.run([parity, "check", m, "--backends", "reference,gpu", "--json", tf.name],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"<!-- {os.path.basename(m)}: exit {r.returncode}: {r.stderr.strip()[:200]} -->")
            continue
        cs = json.load(open(tf.name))
    cs = cs["comparisons"] if isinstance(cs, dict) else cs
    op = [c for c in cs if "gpu" in c["candidate"] and "op-by-op" in c["candidate"]]
    e2e = [c for c in cs if c["candidate"].endswith("/gpu") and c["baseline"].endswith("/reference")]
    if not op:
        print(f"<!-- {os.path.basename(m)}: no op-by-op comparison (no tight golden) -->")
        continue
    worst = {}
    for c in op:
        for t in c["results"]:
            k = t["key"]["tap"]
            worst[k] = max(worst.get(k, 0.0), t["metrics"]["nmse"])
            overall[k] = max(overall.get(k, 0.0), t["metrics"]["nmse"])
    e = max((t["metrics"]["nmse"] for c in e2e for t in c["results"]), default=float("nan"))
    rows.append((os.path.basename(m).removesuffix(".gguf"), op[0]["weight_type"],
                 max(worst.values()), max(worst, key=worst.get), e))
    print(f"<!-- {rows[-1][0]}: " + ", ".join(f"{k} {fmt(v)}" for k, v in worst.items()) + " -->",
          flush=True)

print("| model | weights | worst op by op (tap) | worst end to end vs plain reference |")
print("|---|---|---|---|")
for name, w, x, k, e in rows:
    print(f"| {name} | {w} | {fmt(x)} ({k}) | {fmt(e)} |")
print()
print("| tap | worst op by op over all models |")
print("|---|---|")
for k in taps:
    if k in overall:
        print(f"| {k} | {fmt(overall[k])} |")
