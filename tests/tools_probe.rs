//! The tools the build found for the test suite (build.rs: llama_cpp, numpy, gguf-py, ../shared,
//! jq, chromium, the aarch64 tools for qemu)
//! are still the ones this machine has: otherwise tests would be ignored that could run (or
//! the reverse), and this test says how to refresh the probe.

mod common;
use common::*;
use std::process::Command;

fn python() -> std::path::PathBuf {
    std::env::var_os("PARITY_PYTHON")
        .map(Into::into)
        .unwrap_or_else(|| {
            let v = root().join(".venv/bin/python");
            if v.exists() { v } else { "python3".into() }
        })
}

fn can(code: &str) -> bool {
    Command::new(python())
        .args(["-c", code])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn on_path(names: &[&str]) -> bool {
    names.iter().any(|n| {
        Command::new("sh")
            .args(["-c", &format!("command -v {n}")])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Whether rustup's aarch64-unknown-linux-gnu standard library is installed.
fn aarch64_std() -> bool {
    let Some(dir) = Command::new("rustc")
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
    else {
        return false;
    };
    std::fs::read_dir(dir.trim()).is_ok_and(|rd| {
        rd.flatten().any(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("libstd-") && n.ends_with(".rlib")
        })
    })
}

#[test]
fn the_build_probe_matches_this_machine() {
    let now = [
        (
            "llama_cpp",
            can("import llama_cpp, numpy"),
            cfg!(parity_llama_cpp),
        ),
        ("numpy", can("import numpy"), cfg!(parity_numpy)),
        ("gguf-py", can("import numpy, gguf"), cfg!(parity_gguf_py)),
        (
            "../shared",
            root().join("../shared/models").is_dir(),
            cfg!(parity_shared),
        ),
        ("jq", on_path(&["jq"]), cfg!(parity_jq)),
        (
            "qemu (aarch64 cross tools)",
            (on_path(&["qemu-aarch64-static"]) || on_path(&["qemu-aarch64"]))
                && on_path(&["aarch64-linux-gnu-gcc"])
                && std::path::Path::new("/usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1")
                    .exists()
                && aarch64_std(),
            cfg!(parity_qemu),
        ),
        (
            "chromium",
            on_path(&["chromium", "chromium-browser", "google-chrome"]),
            cfg!(parity_chromium),
        ),
    ];
    for (what, here, built) in now {
        assert_eq!(
            here, built,
            "{what}: available now = {here}, when the tests were built = {built}; run `touch build.rs` and test again so that tests needing it run (or show as ignored)"
        );
    }
}
