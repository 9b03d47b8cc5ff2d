#!/usr/bin/env bash
# Makes llama.cpp goldens on a GPU device (every layer offloaded) at the committed CPU goldens'
# ids, then asks parity whether the GPU traces agree with llama.cpp's CPU: `parity diff` (the
# GPU trace judged as an external engine, op by op on its own inputs) and `parity check --golden`
# (parity's backends against the GPU golden). A correct llama.cpp GPU build must pass both.
#
# Needs a Python whose llama-cpp-python has a GPU backend, e.g. Vulkan:
#   apt-get install glslc libvulkan-dev spirv-headers   (Vulkan headers >= 1.3.261: Debian 13's)
#   CMAKE_ARGS="-DGGML_VULKAN=on" pip install llama-cpp-python numpy     (~9 min on 2 cores)
# On a machine with no GPU, Mesa's lavapipe is a Vulkan device; ggml skips CPU-type devices
# unless GGML_VK_VISIBLE_DEVICES names them, which this script does.
#
# Usage: PARITY_PYTHON=/path/to/python scripts/gpu_goldens.sh OUT_DIR [NAME...]
#   (that Python also needs gguf-py, `pip install gguf`, for the planted bugs at the end)
#   NAMEs: committed goldens (golden/NAME) to redo; default all. Each is written to
#   OUT_DIR/NAME. With ../shared/models, TinyStories-656K-Q8_0 and -Q4_0 also get two longer
#   prompts (OUT_DIR/NAME-pN, N its token count, beside a CPU golden OUT_DIR/NAME-pN-cpu):
#   prompts over 8 tokens take Vulkan's tiled matmul. Last, two bugs are planted into the GPU
#   run (OUT_DIR/planted/*); each must be found. Exit 0 when every row is as it must be.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: PARITY_PYTHON=python scripts/gpu_goldens.sh OUT_DIR [NAME...]}
shift
: "${PARITY_PYTHON:?set PARITY_PYTHON to a Python whose llama_cpp has a GPU backend}"
export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0} NODEVICE_SELECT=1
cargo build --release -q
P=target/release/parity
names=("$@")
[ ${#names[@]} -eq 0 ] && names=($(ls golden))
mkdir -p "$out"
fail=0
row() { # name model golden gpu_golden
  local d c
  $P diff "$3" "$4" -q >/dev/null 2>&1 && d=0 || d=$?
  $P check "$2" --golden "$4" -q >/dev/null 2>&1 && c=0 || c=$?
  printf '%-32s diff %s  check %s\n' "$1" "$d" "$c"
  [ "$d" = 0 ] && [ "$c" = 0 ] || fail=1
}
ids() { "$PARITY_PYTHON" - "$1" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1] + "/manifest.json"))
print(m["model"]["path"], ",".join(map(str, m["steps"][0]["tokens"])),
      ",".join(str(s["tokens"][0]) for s in m["steps"][1:]))
EOF
}
for n in "${names[@]}"; do
  read -r model toks forced < <(ids "golden/$n")
  [ -f "$model" ] || { echo "$n: $model not here, skipped"; continue; }
  $P golden "$model" --tokens "$toks" --forced "$forced" --gpu-layers -1 --out "$out/$n" --force 2>/dev/null
  row "$n" "$model" "golden/$n" "$out/$n"
done
# Longer prompts, on the real TinyStories models: a CPU golden and a GPU one at the same ids.
long21="Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends"
long58="$long21. One day, she saw a big red ball under a tall tree. She ran to get it, but a small dog took the ball and ran away. Lily was sad and started to cry"
for m in TinyStories-656K-Q8_0 TinyStories-656K-Q4_0; do
  model=../shared/models/$m.gguf
  [ -f "$model" ] || continue
  for p in "$long21" "$long58"; do
    toks=$($P tokenize "$model" "$p" | tr ' ' ',')
    k=$(echo "$toks" | tr ',' '\n' | wc -l)
    n=$m-p$k
    PARITY_PYTHON=${PARITY_CPU_PYTHON:-$PARITY_PYTHON} $P golden "$model" --tokens "$toks" --steps 4 --out "$out/$n-cpu" --force 2>/dev/null
    read -r _ _ forced < <(ids "$out/$n-cpu")
    $P golden "$model" --tokens "$toks" --forced "$forced" --gpu-layers -1 --out "$out/$n" --force 2>/dev/null
    row "$n" "$model" "$out/$n-cpu" "$out/$n"
  done
done
# Bugs planted into the real llama.cpp on the GPU: it runs a copy of the Q4_0 fixture whose
# metadata says rms eps x10 or RoPE base 500000, and the trace is judged against the real model
# (--model): parity must find each at step 0 layer 0 and name it.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
read -r model toks forced < <(ids golden/tiny-llama-q4_0)
for bug in "rms-eps-10x llama.attention.layer_norm_rms_epsilon 0.0001" \
           "rope-theta-500000 llama.rope.freq_base 500000"; do
  read -r name key value <<<"$bug"
  cp "$model" "$tmp/$name.gguf"
  "$PARITY_PYTHON" -m gguf.scripts.gguf_set_metadata "$tmp/$name.gguf" "$key" "$value" --force 2>/dev/null
  $P golden "$tmp/$name.gguf" --tokens "$toks" --forced "$forced" --gpu-layers -1 --out "$out/planted/$name" --force 2>/dev/null
  $P diff golden/tiny-llama-q4_0 "$out/planted/$name" --model "$model" --allow-model-mismatch -q >/dev/null 2>&1 && d=0 || d=$?
  printf '%-32s diff %s (1: found)\n' "planted/$name" "$d"
  [ "$d" = 1 ] || fail=1
done
exit $fail
