#!/usr/bin/env bash
# Build the block-format crate (crates/parity-quant) and its tests for aarch64 and run them
# under qemu user-mode emulation, so the NEON twins (`mod neon` in crates/parity-quant/src/*.rs,
# `arm.rs`) are executed and checked against their scalar twins and ggml's vectors on an x86
# machine. All of parity's SIMD for aarch64 is in that crate (the backends' own kernels are
# AVX2 or portable Rust), so the rest of parity (wgpu, tokenizers, ...) is not cross-built.
#
# What runs (all must pass):
#   1. the crate's unit tests (every format's twins) and its `quant_props` and `quant_oracle`
#      integration tests, on qemu's default `max` CPU (has FP16, so `half` converts f16 with
#      the FCVT instruction);
#   2. the same again on `cortex-a53` (plain ARMv8.0: no FP16, no dotprod), which takes
#      `half`'s software f16 path, as on a Raspberry Pi 3/4 or a Graviton 1.
#
# On an aarch64 host the same tests run natively (no qemu, no cross linker).
#
# Environment:
#   CARGO_TARGET_DIR   build dir (default target/aarch64, apart from the host build)
#   SKIP_INSTALL=1     do not try to install missing packages
#   SKIP_BASELINE=1    skip pass 2 (cortex-a53)
#   PROPTEST_CASES     passed through (longer soak: PROPTEST_CASES=2000)
set -euo pipefail

cd "$(dirname "$0")/.."

TARGET=aarch64-unknown-linux-gnu
SYSROOT=/usr/aarch64-linux-gnu
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/aarch64}"

log() { printf '==> %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        log "need root (or sudo) to run: $*"
        return 1
    fi
}

qemu_bin() {
    command -v qemu-aarch64-static 2>/dev/null || command -v qemu-aarch64 2>/dev/null || true
}

native=0
[ "$(uname -m)" = aarch64 ] && native=1

if [ "$native" -eq 0 ]; then
    missing=()
    [ -n "$(qemu_bin)" ] || missing+=(qemu-user-static)
    command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || missing+=(gcc-aarch64-linux-gnu)
    [ -e "$SYSROOT/lib/ld-linux-aarch64.so.1" ] || missing+=(libc6-dev-arm64-cross)
    if [ "${#missing[@]}" -gt 0 ]; then
        if [ "${SKIP_INSTALL:-0}" = 1 ]; then
            log "missing: ${missing[*]} (SKIP_INSTALL=1)"
            exit 1
        fi
        command -v apt-get >/dev/null 2>&1 || { log "missing ${missing[*]} and no apt-get"; exit 1; }
        log "installing ${missing[*]}"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        if ! as_root env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${missing[@]}"; then
            # Newer Debian/Ubuntu fold the static build into qemu-user.
            log "retrying with qemu-user in place of qemu-user-static"
            as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                --no-install-recommends "${missing[@]/qemu-user-static/qemu-user}"
        fi
    fi
    QEMU="$(qemu_bin)"
    [ -n "$QEMU" ] || { log "no qemu-aarch64 after install"; exit 1; }
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="$QEMU -L $SYSROOT"
    log "$("$QEMU" --version | head -n1)"
fi

if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed | grep -qx "$TARGET"; then
    log "adding rust target $TARGET"
    rustup target add "$TARGET"
fi

# Release code (the NEON kernels as shipped), without its debuginfo: only the cross build's
# compile time would pay for it. The dependencies at opt-level 1: the tests run the crate's own
# code (generic and `#[inline]` code from a dependency is compiled into it, at its level); at 0
# proptest and half's software f16 ran 3-5x slower under qemu.
cargo_test() {
    CARGO_PROFILE_RELEASE_DEBUG=0 cargo test -p parity-quant --release --target "$TARGET" \
        --config 'profile.release.package."*".opt-level=1' "$@"
}

start=$SECONDS
status=0

log "pass 1: parity-quant --lib, quant_props, quant_oracle (qemu cpu: ${QEMU_CPU:-max})"
cargo_test --no-fail-fast --lib --test quant_props --test quant_oracle || status=1

if [ "$native" -eq 0 ] && [ "${SKIP_BASELINE:-0}" != 1 ]; then
    log "pass 2: quant tests on cortex-a53 (ARMv8.0, no FP16)"
    QEMU_CPU=cortex-a53 cargo_test --no-fail-fast --lib --test quant_props --test quant_oracle \
        || status=1
fi

log "done in $((SECONDS - start)) s: $([ "$status" -eq 0 ] && echo PASS || echo FAIL)"
exit "$status"
