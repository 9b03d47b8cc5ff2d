#!/usr/bin/env bash
# The performance numbers of docs/performance.md, end to end:
#   1. writes TinyLlama-1.1B-shaped random-weight models (n_embd 2048, n_ff 5632, 22 layers,
#      32 heads, 4 kv heads, vocab 32000, ctx 2048) in Q4_0, Q8_0 and Q4_K into bench-models/
#      (gitignored; skipped when already there),
#   2. runs `parity bench` on each (parity's fast backend vs the real llama.cpp, same file,
#      same threads, same token ids),
#   3. runs `cargo bench -p parity-quant --bench dequant` (SIMD vs scalar dequantization, GB/s) twice: through
#      memory (64 MiB of output per pass) and in cache (a 16 KiB output, one weight row's
#      worth, decoded again and again: the kernels' own speed),
#   4. measures the peak memory (max RSS) of `parity dump` with the reference backend on the
#      Q4_0 model, as a ratio to the file size (goal: < 2x).
#
#   scripts/bench.sh [--threads N] [--reps R] [--skip-dequant] [--only q4_0,q8_0,q4_k]
#
# Needs: cargo; for the llama.cpp column, llama-cpp-python in .venv (or $PARITY_PYTHON);
# GNU time (/usr/bin/time, installed with apt-get when missing and possible).
# The machine should be otherwise idle: `parity bench` prints the load average and warns when
# its main thread had to wait for a CPU.
set -euo pipefail

cd "$(dirname "$0")/.."
THREADS=2
REPS=3
SKIP_DEQUANT=0
ONLY="q4_0,q8_0,q4_k"
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) THREADS="$2"; shift 2 ;;
    --reps) REPS="$2"; shift 2 ;;
    --skip-dequant) SKIP_DEQUANT=1; shift ;;
    --only) ONLY="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "bench.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

section() { printf '\n==== %s ====\n' "$*"; }

section "build"
cargo build --release
PARITY=target/release/parity
mkdir -p bench-models

section "machine"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
grep -m1 'model name' /proc/cpuinfo || uname -m
echo "cores: $(nproc)"
grep -E '^(MemTotal)' /proc/meminfo || true
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"

SHAPE=(--n-embd 2048 --n-ff 5632 --n-layer 22 --n-head 32 --n-head-kv 4 --n-vocab 32000 --n-ctx 2048)
IFS=',' read -r -a TYPES <<< "$ONLY"
for ty in "${TYPES[@]}"; do
  model="bench-models/tinyllama-1.1b-$ty.gguf"
  if [ ! -s "$model" ]; then
    section "fixture $model"
    "$PARITY" fixture --out "$model" --type "$ty" "${SHAPE[@]}"
  fi
done

for ty in "${TYPES[@]}"; do
  model="bench-models/tinyllama-1.1b-$ty.gguf"
  section "parity bench $model --threads $THREADS"
  # Exit code 2 (llama.cpp missing) should not stop the rest of the report.
  "$PARITY" bench "$model" --threads "$THREADS" --reps "$REPS" || echo "(parity bench exited with $?)"
done

if [ "$SKIP_DEQUANT" = 0 ]; then
  section "cargo bench -p parity-quant --bench dequant (through memory)"
  cargo bench -p parity-quant --bench dequant
  section "cargo bench -p parity-quant --bench dequant -- --kib 16 (in cache)"
  cargo bench -p parity-quant --bench dequant -- --kib 16
fi

section "peak memory: parity dump (reference backend) on the Q4_0 model"
TIME=/usr/bin/time
if [ ! -x "$TIME" ]; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "installing GNU time (apt-get install -y time)"
    (apt-get install -y time >/dev/null 2>&1 || { apt-get update >/dev/null 2>&1 && apt-get install -y time >/dev/null 2>&1; }) || true
  fi
fi
model=bench-models/tinyllama-1.1b-q4_0.gguf
if [ ! -s "$model" ]; then
  "$PARITY" fixture --out "$model" --type q4_0 "${SHAPE[@]}"
fi
out=$(mktemp -d /tmp/parity-bench-dump.XXXXXX)
if [ -x "$TIME" ]; then
  "$TIME" -v "$PARITY" dump "$model" --tokens 1,2,3,4,5,6,7,8 --steps 2 --out "$out" --force 2> "$out.time" >/dev/null
  rss_kb=$(awk -F': *' '/Maximum resident set size/ {print $2}' "$out.time")
  wall=$(sed -n 's/.*Elapsed (wall clock) time.*: //p' "$out.time")
  file_bytes=$(stat -c %s "$model")
  python3 - "$rss_kb" "$file_bytes" "$wall" <<'EOF'
import sys
rss = int(sys.argv[1]) * 1024
size = int(sys.argv[2])
print(f"max RSS {rss / 1e6:.1f} MB, file {size / 1e6:.1f} MB, ratio {rss / size:.2f}x "
      f"(goal < 2x: {'met' if rss < 2 * size else 'NOT met'}), wall {sys.argv[3]}")
EOF
  rm -f "$out.time"
else
  echo "GNU time (/usr/bin/time) is not available: install it (apt-get install time) to measure peak memory"
fi
rm -rf "$out"
