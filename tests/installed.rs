//! An installed binary (`cargo install --path .`) works away from its source checkout: it
//! unpacks the default fixture, its golden and the Python scripts from itself
//! (src/cli/assets.rs). `PARITY_NO_CHECKOUT=1` makes the binary behave as if the checkout were
//! gone.

mod common;
use common::*;
use std::process::Command;

fn installed(
    args: &[&str],
    cwd: &std::path::Path,
    cache: &std::path::Path,
) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_parity"))
        .args(args)
        .current_dir(cwd)
        .env("PARITY_NO_CHECKOUT", "1")
        .env("XDG_CACHE_HOME", cache)
        .output()
        .expect("run parity")
}

#[test]
fn the_default_check_runs_away_from_the_checkout() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let o = installed(&["check"], tmp.path(), &cache);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(
        stdout(&o).contains(&common::default_verdict()),
        "{}",
        show(&o)
    );
    let unpacked = cache
        .join("parity")
        .join(env!("CARGO_PKG_VERSION"))
        .join("fixtures/tiny-llama-q8_0.gguf");
    assert_eq!(
        std::fs::read(&unpacked).unwrap(),
        std::fs::read(root().join("fixtures/tiny-llama-q8_0.gguf")).unwrap()
    );
}

#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn golden_runs_away_from_the_checkout() {
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = root().join("fixtures/tiny-llama-q4_0.gguf");
    let out = tmp.path().join("g");
    let o = installed(
        &[
            "golden",
            model.to_str().unwrap(),
            "-p",
            "Once upon a time",
            "--steps",
            "2",
            "--out",
            out.to_str().unwrap(),
        ],
        tmp.path(),
        &tmp.path().join("cache"),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(out.join("manifest.json").exists());
}

/// `parity golden MODEL` without --out keeps the golden in the user's golden folder (never the
/// repository's golden/), and `parity check MODEL` finds it there by sha256.
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn a_user_golden_goes_to_the_user_folder_and_check_finds_it() {
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("mine.gguf");
    let gd = tmp.path().join("goldens");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_parity"))
            .args(args)
            .current_dir(tmp.path())
            .env("PARITY_GOLDEN_DIR", &gd)
            .output()
            .unwrap()
    };
    let o = run(&["fixture", "--seed", "9", "--out", m.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let o = run(&[
        "golden",
        m.to_str().unwrap(),
        "-p",
        "Once upon a time",
        "--steps",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let made: Vec<_> = std::fs::read_dir(&gd).unwrap().flatten().collect();
    assert_eq!(made.len(), 1);
    assert!(
        made[0].file_name().to_string_lossy().starts_with("mine-"),
        "{:?}",
        made[0].file_name()
    );
    let o = run(&["check", m.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(&format!("golden: {}", gd.display())),
        "{}",
        show(&o)
    );
}
