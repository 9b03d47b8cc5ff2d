#!/usr/bin/env bash
# A model larger than memory (issue 30, item 3): writes a 70B-shaped Q4_0 model (about 38 GB,
# scripts/huge_model.py; kept in DIR for the next run), then times `parity check` against a fresh
# llama.cpp golden of the same ids with scripts/check_speed.sh: wall times, the check's ratio to
# the golden and to llama.cpp's own time, and the check's peak RSS (MiB, and as a multiple of
# the file). Both map the file; on a machine with less memory than the file every forward
# rereads most of it from disk.
#
# Usage: scripts/huge_check.sh DIR [SHAPE] [ROUNDS] [STEPS]
#   SHAPE: 70b (default) or 7b, tiny (scripts/huge_model.py); ROUNDS default 1; STEPS default 2
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$1; shape=${2:-70b}; rounds=${3:-1}; steps=${4:-2}
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$dir"
m=$dir/huge-$shape-q4_0.gguf
if [ ! -f "$m" ]; then
  /usr/bin/time -f "model written in %e s" "$py" "$root/scripts/huge_model.py" "$m.part" \
    --shape "$shape" --vocab-from "$root/fixtures/tiny-llama-q8_0.gguf"
  mv "$m.part" "$m"
fi
echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 2^20}' /proc/meminfo); model: $(du -h "$m" | cut -f1)"
# 16 prompt ids inside the 4000-token vocabulary (scripts/depth_matrix.sh's, for the cut ones).
"$root/scripts/check_speed.sh" "$m" 1,450,496,1735,170,432,1720,975,278,1736,1120,2988,1576,338,263,1243 "$rounds" "$steps"
