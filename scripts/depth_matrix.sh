#!/usr/bin/env bash
# Verdicts at depth: generate deep random-weight models, make a tight llama.cpp golden and one
# with llama.cpp's defaults forced to the same ids (llama.cpp's own spread), then run
# `parity check` (every backend, op by op) and `parity diff tight defaults`. Prints one summary
# line per model; JSON reports, and each check's wall time and peak RSS (time-*.txt: seconds,
# KiB), stay in OUT for scripts/depth_summary.py (docs/tolerances.md).
#
# Usage: scripts/depth_matrix.sh OUT SHAPE TYPE...
#   SHAPE: 7b  (Llama-2-7B: 4096/11008, 32 layers, 32/32 heads, 32000 vocab; q4_0 3.8 GB)
#          8b  (Llama-3-8B: llama3 arch, 4096/14336, 32 layers, 32/8 heads, vocab cut to 4000)
#          w32 (32 layers, 512/1408, 8/8 heads, 4000 vocab: the 7B depth at CI width)
#          tl  (TinyLlama-1.1B: 2048/5632, 22 layers, 32/4 heads, 32000 vocab)
#          d64 (64 layers, 512/1408, 8/2 heads, 4000 vocab)
#          d16 (16 layers, 256/512, 4/2 heads, built-in vocab)
#   TYPE: f32 f16 q8_0 q4_0 q4_k q4_k_m q6_k …
# With DEEP_BUGS=name,name (catalog names, `parity selftest --only`) each model also gets those
# bugs planted from layer DEEP_LAYER (default 28) on, written as an external engine's trace and
# judged by `parity diff` against the golden: each must be found at that layer and named.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
P=${PARITY:-$root/target/release/parity}
out=$1; shape=$2; shift 2
mkdir -p "$out"
case $shape in
  7b) args=(--n-embd 4096 --n-ff 11008 --n-layer 32 --n-head 32 --n-head-kv 32 --n-vocab 32000 --n-ctx 4096)
      ids=1,450,4996,17354,1701,432,17204,975,278,17366,11203,29889,1576,338,263,1243 ;;
  8b) args=(--arch llama3 --n-embd 4096 --n-ff 14336 --n-layer 32 --n-head 32 --n-head-kv 8 --n-vocab 4000 --n-ctx 8192)
      ids=1,450,496,1735,170,432,1720,975,278,1736,1120,2988,1576,338,263,1243 ;;
  w32) args=(--n-embd 512 --n-ff 1408 --n-layer 32 --n-head 8 --n-head-kv 8 --n-vocab 4000 --n-ctx 512)
      ids=1,450,496,1735,170,432,1720,975,278,1736,1120,2988,1576,338,263,1243 ;;
  tl) args=(--n-embd 2048 --n-ff 5632 --n-layer 22 --n-head 32 --n-head-kv 4 --n-vocab 32000 --n-ctx 2048)
      ids=1,450,4996,17354,1701,432,17204,975,278,17366,11203,29889,1576,338,263,1243 ;;
  d64) args=(--n-embd 512 --n-ff 1408 --n-layer 64 --n-head 8 --n-head-kv 2 --n-vocab 4000 --n-ctx 512)
      ids=1,450,496,1735,170,432,1720,975,278,1736,1120,2988,1576,338,263,1243 ;;
  d16) args=(--n-embd 256 --n-ff 512 --n-layer 16 --n-head 4 --n-head-kv 2 --n-ctx 256)
      ids=1,259,300,273,262,264,324,325,329,333,336,325,342,346,351,259 ;;
  *) echo "unknown shape $shape" >&2; exit 2 ;;
esac
for ty in "$@"; do
  m=$out/$shape-$ty.gguf
  [ -f "$m" ] || "$P" fixture --type "$ty" "${args[@]}" --out "$m" >/dev/null
  g=$out/golden-$shape-$ty
  [ -f "$g/manifest.json" ] || "$P" golden "$m" --tokens "$ids" --steps 4 --threads 2 --out "$g" >/dev/null 2>&1
  forced=$(python3 -c "import json,sys;m=json.load(open(sys.argv[1]));print(','.join(str(t) for s in m['steps'][1:] for t in s['tokens']))" "$g/manifest.json")
  gd=$out/golden-$shape-$ty-defaults
  [ -f "$gd/manifest.json" ] || "$P" golden "$m" --tokens "$ids" --steps 4 --forced "$forced" --llama-defaults --threads 2 --out "$gd" >/dev/null 2>&1
  set +e
  /usr/bin/time -f "%e %M" -o "$out/time-check-$shape-$ty.txt" \
    "$P" check "$m" --golden "$g" --threads 2 --json "$out/check-$shape-$ty.json" > "$out/check-$shape-$ty.txt" 2>&1
  rc=$?
  "$P" diff "$g" "$gd" --json "$out/spread-$shape-$ty.json" > "$out/spread-$shape-$ty.txt" 2>&1
  rs=$?
  # No golden: the backends against each other only (an empty folder holds no golden).
  mkdir -p "$out/none"
  /usr/bin/time -f "%e %M" -o "$out/time-nogolden-$shape-$ty.txt" \
    "$P" check "$m" --tokens "$ids" --steps 4 --golden "$out/none" --threads 2 --json "$out/nogolden-$shape-$ty.json" > "$out/nogolden-$shape-$ty.txt" 2>&1
  rn=$?
  set -e
  if [ -n "${DEEP_BUGS:-}" ]; then
    "$P" selftest "$m" --golden "$g" --rounding ggml --from-layer "${DEEP_LAYER:-28}" --only "$DEEP_BUGS" \
      > "$out/selftest-$shape-$ty.txt" 2>&1
    echo "$shape $ty: deep bugs (selftest exit $?):"; cat "$out/selftest-$shape-$ty.txt"
  fi
  echo "$shape $ty: check exit $rc ($(tail -1 "$out/check-$shape-$ty.txt")) in $(cut -d' ' -f1 "$out/time-check-$shape-$ty.txt") s, peak RSS $(( $(cut -d' ' -f2 "$out/time-check-$shape-$ty.txt") / 1024 )) MiB; without a golden: exit $rn; llama.cpp tight vs defaults: exit $rs"
done
