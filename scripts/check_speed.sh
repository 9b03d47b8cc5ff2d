#!/usr/bin/env bash
# `parity check` against llama.cpp's own golden run, side by side on one machine (issue 30):
# each round makes a fresh golden for the same ids with `parity golden` (llama.cpp through
# llama-cpp-python, its default 1 thread), then runs `parity check` on it (every CPU backend
# end to end and op by op, --threads 2), alternating so that both see the same machine load.
# Prints each round, then medians and ranges of: the check's wall time, its ratio to the
# golden's wall time and to llama.cpp's own time inside it (model load included, the taps'
# writing not), and the check's peak RSS as a multiple of the file.
#
# Usage: scripts/check_speed.sh MODEL IDS [ROUNDS] [STEPS]
#   IDS: comma-separated prompt ids (scripts/depth_matrix.sh lists the ones it uses per shape),
#        or @FILE holding them
#   ROUNDS: default 3; STEPS: decode steps, default 4
# RECORD='taps=l_out,result_norm,logits' makes scan goldens (`parity golden --record`: a long
# run's cheap taps at every step; check then judges the golden on its own inputs and runs the
# fast backend end to end); the golden's size on disk is printed too.
# PARITY=path picks the binary (default target/release/parity). BASE=path times a second
# binary's check on the same golden in each round too (before/after A/B, alternating), with
# the CPU backends named (an older default set adds a software GPU where one is installed).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
P=${PARITY:-$root/target/release/parity}
model=$1; ids=$2; rounds=${3:-3}; steps=${4:-4}
case $ids in @*) ids=$(tr -d ' \n' < "${ids#@}") ;; esac
record=()
if [ -n "${RECORD:-}" ]; then record=(--record "$RECORD"); fi
size=$(stat -c %s "$model")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rows=()
for i in $(seq "$rounds"); do
  rm -rf "$work/golden"
  /usr/bin/time -f "%e %M" -o "$work/tg" "$P" golden "$model" --tokens "$ids" --steps "$steps" \
    "${record[@]}" --out "$work/golden" > "$work/golden.txt" 2>&1
  read -r tg _ < "$work/tg"
  disk=$(du -sm "$work/golden" | cut -f1)
  # The golden's own line: "… in 14.26s (llama.cpp 10.39s) …".
  tl=$(grep -o 'llama\.cpp [0-9.]*s' "$work/golden.txt" | tail -1 | sed -E 's/llama\.cpp ([0-9.]+)s/\1/')
  set +e
  /usr/bin/time -f "%e %M" -o "$work/tc" "$P" check "$model" --golden "$work/golden" --threads 2 \
    > "$work/check.txt" 2>&1
  rc=$?
  set -e
  read -r tc kib < "$work/tc"
  echo "round $i: golden ${tg} s (llama.cpp ${tl} s, ${disk} MiB on disk); check ${tc} s (exit $rc), peak RSS $((kib / 1024)) MiB"
  grep '^backends:' "$work/check.txt" | sed 's/^/         /'
  tb=0; kb=0
  if [ -n "${BASE:-}" ]; then
    set +e
    /usr/bin/time -f "%e %M" -o "$work/tb" "$BASE" check "$model" --golden "$work/golden" \
      --backends reference,reference:ggml-cpu,fast --threads 2 > "$work/base.txt" 2>&1
    rb=$?
    set -e
    read -r tb kb < "$work/tb"
    echo "         BASE check ${tb} s (exit $rb), peak RSS $((kb / 1024)) MiB"
  fi
  rows+=("$tg $tl $tc $kib $tb $kb")
done
python3 - "$size" "${rows[@]}" <<'PY'
import statistics, sys
size = int(sys.argv[1])
rows = [list(map(float, r.split())) for r in sys.argv[2:]]
def line(name, xs, unit=""):
    print(f"{name}: median {statistics.median(xs):.2f}{unit} (range {min(xs):.2f}-{max(xs):.2f})")
line("golden wall", [r[0] for r in rows], " s")
line("llama.cpp inside the golden", [r[1] for r in rows], " s")
line("check wall", [r[2] for r in rows], " s")
line("check / golden wall (same round)", [r[2] / r[0] for r in rows], "x")
line("check / llama.cpp's own time (same round)", [r[2] / r[1] for r in rows], "x")
line("check peak RSS / file", [r[3] * 1024 / size for r in rows], "x")
if rows[0][4] > 0:
    line("BASE check wall", [r[4] for r in rows], " s")
    line("BASE check / golden wall (same round)", [r[4] / r[0] for r in rows], "x")
    line("check / BASE check (same round)", [r[2] / r[4] for r in rows], "x")
    line("BASE peak RSS / file", [r[5] * 1024 / size for r in rows], "x")
print(f"file {size / 2**20:.0f} MiB; load average {open('/proc/loadavg').read().split()[0]}")
PY
