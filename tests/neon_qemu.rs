//! The NEON twins, run for real on an x86 machine: `scripts/test_aarch64.sh` builds the block
//! format crate's (crates/parity-quant) unit and integration tests for aarch64 and runs them
//! under qemu user-mode emulation (once on qemu's default CPU, once on a plain ARMv8.0
//! cortex-a53), so every `mod neon` kernel is checked against its scalar twin and ggml's vectors.
//!
//! Needs qemu-aarch64, the aarch64 cross linker and glibc (`.ci/run` installs them from
//! Debian) and rustup's aarch64-unknown-linux-gnu standard library; skips, saying what is
//! missing, without them. On an aarch64 host the ordinary `cargo test` already runs NEON.

use std::path::Path;
use std::process::Command;

/// The probe build.rs ran for the `parity_qemu` cfg (`include!`d): what this machine lacks.
#[allow(dead_code)]
mod probe {
    include!("../build/probe.rs");
}

#[test]
#[cfg_attr(
    any(target_arch = "aarch64", not(parity_qemu)),
    ignore = "needs qemu-aarch64, the aarch64 cross gcc and glibc, and rustup's aarch64 std (.ci/run installs them; then touch build.rs); an aarch64 host runs NEON natively"
)]
fn neon_twins_pass_under_qemu() {
    if cfg!(target_arch = "aarch64") {
        eprintln!("skipped: on an aarch64 host `cargo test` runs the NEON kernels natively");
        return;
    }
    let lacking = probe::qemu_missing();
    if !lacking.is_empty() {
        eprintln!(
            "skipped: the aarch64 (NEON) tests need {}; .ci/run installs the Debian packages",
            lacking.join(", ")
        );
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // Its own target dir: the outer `cargo test` holds the lock on the main one.
    let out = Command::new("bash")
        .arg(root.join("scripts/test_aarch64.sh"))
        .current_dir(root)
        .env("SKIP_INSTALL", "1")
        .env("CARGO_TARGET_DIR", root.join("target/aarch64"))
        .output()
        .expect("run scripts/test_aarch64.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let tail: Vec<&str> = text.lines().rev().take(60).collect();
    assert!(
        out.status.success(),
        "aarch64 tests under qemu failed:\n{}",
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    );
    // The script must have run the suites, not skipped them.
    for suite in ["quant_props", "quant_oracle"] {
        assert!(text.contains(suite), "{suite} did not run:\n{text}");
    }
    // Unit tests, quant_props and quant_oracle, on each of the two CPUs.
    assert!(
        text.matches("test result: ok.").count() >= 6,
        "fewer test binaries than expected ran:\n{text}"
    );
}
