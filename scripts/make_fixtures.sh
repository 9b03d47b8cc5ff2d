#!/usr/bin/env bash
# Regenerates the committed fixtures (fixtures/*.gguf) and their llama.cpp goldens (golden/*).
# Fixtures are made by parity itself (deterministic, seeded); goldens by the real llama.cpp.
# Usage: scripts/make_fixtures.sh [--fixtures-only] [NAME...]   (NAMEs: only those fixtures)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q
P=target/release/parity

# name                 arch   type  extra dims
FIXTURES=(
  "tiny-llama-f32      llama  f32   --n-embd 128 --n-ff 256"
  "tiny-llama-f16      llama  f16   --n-embd 128 --n-ff 256"
  "tiny-llama-q8_0     llama  q8_0  --n-embd 256 --n-ff 256"
  "tiny-llama-q4_0     llama  q4_0  --n-embd 256 --n-ff 256"
  "tiny-llama-q4_k     llama  q4_k  --n-embd 256 --n-ff 256"
  "tiny-llama-q6_k     llama  q6_k  --n-embd 256 --n-ff 256"
  "tiny-qwen2-q8_0     qwen2  q8_0  --n-embd 256 --n-ff 256"
  "tiny-qwen2-q4_k     qwen2  q4_k  --n-embd 256 --n-ff 256"
  # the newer architectures, each with its features on (docs/architectures.md, "Fixtures")
  "tiny-llama3-q8_0    llama3 q8_0  --n-embd 256 --n-ff 256"
  "tiny-qwen3-q8_0     qwen3  q8_0  --n-embd 256 --n-ff 256"
  "tiny-gemma-q8_0     gemma  q8_0  --n-embd 256 --n-ff 256 --n-head-kv 1"
  "tiny-gemma2-q8_0    gemma2 q8_0  --n-embd 256 --n-ff 256 --n-swa 4"
  "tiny-gemma3-q8_0    gemma3 q8_0  --n-embd 256 --n-ff 256 --n-swa 4 --n-layer 3"
  "tiny-phi3-q8_0      phi3   q8_0  --n-embd 256 --n-ff 256"
)
PROMPT="Once upon a time there was a little girl named Lily"
ONLY=0
[ "${1:-}" = "--fixtures-only" ] && { ONLY=1; shift; }
if [ $# -gt 0 ]; then
  SEL=()
  for f in "${FIXTURES[@]}"; do
    read -r name _ <<<"$f"
    for want in "$@"; do [ "$name" = "$want" ] && SEL+=("$f"); done
  done
  FIXTURES=("${SEL[@]}")
fi
for f in "${FIXTURES[@]}"; do
  read -r name arch type dims <<<"$f"
  $P fixture --arch "$arch" --type "$type" --seed 7 $dims --out "fixtures/$name.gguf" --force
done
[ "$ONLY" = 1 ] && exit 0

for f in "${FIXTURES[@]}"; do
  read -r name _ <<<"$f"
  $P golden "fixtures/$name.gguf" -p "$PROMPT" --steps 4 --out "golden/$name" --force
done
[ $# -gt 0 ] && exit 0
for m in stories260K TinyStories-656K-Q8_0 TinyStories-656K.f16 TinyStories-656K-Q4_0; do
  $P golden "../shared/models/$m.gguf" -p "Once upon a time" --steps 4 --out "golden/$m" --force
done
