#!/usr/bin/env bash
# A/B speed of two parity binaries (e.g. before and after a restructure) and of llama.cpp, on
# the same models in one run: rounds alternate A, B, llama.cpp so that machine noise hits all
# three alike. Prints per model the median prompt and decode tok/s of each (with ranges) and
# the ratios B/A and B/llama.cpp.
#
#   scripts/bench_ab.sh OLD_PARITY NEW_PARITY MODEL... [-- --rounds 3 --threads 2]
#
# Each round is one `parity bench --reps 1` per engine (prompt 64 tokens, 32 decode steps).
# Needs llama-cpp-python in .venv (or $PARITY_PYTHON) for the llama.cpp column, and python3.
set -euo pipefail

A="$1"; B="$2"; shift 2
MODELS=(); ROUNDS=3; THREADS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --) shift ;;
    *) MODELS+=("$1"); shift ;;
  esac
done
OUT=$(mktemp -d)
for m in "${MODELS[@]}"; do
  for r in $(seq 1 "$ROUNDS"); do
    "$A" bench "$m" --threads "$THREADS" --reps 1 --no-llama --json > "$OUT/$(basename "$m")-A-$r.json"
    "$B" bench "$m" --threads "$THREADS" --reps 1 --json > "$OUT/$(basename "$m")-B-$r.json"
  done
done
python3 - "$OUT" "${MODELS[@]}" <<'EOF'
import json, os, statistics, sys
out, models = sys.argv[1], sys.argv[2:]
def load(m, who):
    rows = []
    for f in sorted(os.listdir(out)):
        if f.startswith(os.path.basename(m) + f"-{who}-"):
            rows.append(json.load(open(os.path.join(out, f))))
    return rows
def med(xs):
    return statistics.median(xs), min(xs), max(xs)
def fmt(t):
    return f"{t[0]:7.1f} ({t[1]:.1f}-{t[2]:.1f})"
print(f"{'model':28} {'':6} {'A (old)':>22} {'B (new)':>22} {'llama.cpp':>22} {'B/A':>6} {'B/llama':>8}")
for m in models:
    a, b = load(m, "A"), load(m, "B")
    for key, name in (("pp_tok_s", "prompt"), ("tg_tok_s", "decode")):
        ta = med([r["parity_fast"][key] for r in a])
        tb = med([r["parity_fast"][key] for r in b])
        ll = [r["llama_cpp"][key] for r in b if r.get("llama_cpp")]
        tl = med(ll) if ll else None
        ratio_l = f"{tb[0] / tl[0]:8.2f}" if tl else "       -"
        print(f"{os.path.basename(m):28} {name:6} {fmt(ta):>22} {fmt(tb):>22} {fmt(tl) if tl else '-':>22} {tb[0] / ta[0]:6.2f} {ratio_l}")
EOF
