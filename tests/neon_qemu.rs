//! The NEON twins, run for real on an x86 machine: `scripts/test_aarch64.sh` builds the
//! library's unit tests and the quant integration tests for aarch64 and runs them under qemu
//! user-mode emulation (once on qemu's default CPU, once on a plain ARMv8.0 cortex-a53), so
//! every `mod neon` kernel is checked against its scalar twin and ggml's vectors.
//!
//! Needs qemu-aarch64, the aarch64 cross linker and glibc (`.ci/run` installs them from
//! Debian) and rustup's aarch64-unknown-linux-gnu standard library; skips, saying what is
//! missing, without them. On an aarch64 host the ordinary `cargo test` already runs NEON.

use std::path::Path;
use std::process::Command;

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd} >/dev/null 2>&1")])
        .status()
        .is_ok_and(|s| s.success())
}

/// What this machine lacks to run the aarch64 tests, if anything.
fn missing() -> Vec<String> {
    let mut m = Vec::new();
    if !have("qemu-aarch64-static") && !have("qemu-aarch64") {
        m.push("qemu-aarch64 (Debian: qemu-user-static)".to_string());
    }
    if !have("aarch64-linux-gnu-gcc") {
        m.push("aarch64-linux-gnu-gcc (Debian: gcc-aarch64-linux-gnu)".to_string());
    }
    if !Path::new("/usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1").exists() {
        m.push("the aarch64 glibc (Debian: libc6-dev-arm64-cross)".to_string());
    }
    let std_installed = Command::new("rustc")
        .args([
            "--print",
            "target-libdir",
            "--target",
            "aarch64-unknown-linux-gnu",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .is_some_and(|d| has_std(d.trim()));
    if !std_installed {
        m.push(
            "Rust's aarch64 standard library (rustup target add aarch64-unknown-linux-gnu)"
                .to_string(),
        );
    }
    m
}

/// Whether `dir` holds a `libstd-*.rlib`.
fn has_std(dir: &str) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten().any(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with("libstd-") && n.ends_with(".rlib")
        })
    })
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
    let lacking = missing();
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
    assert!(
        text.matches("test result: ok.").count() >= 5,
        "fewer test binaries than expected ran:\n{text}"
    );
}
