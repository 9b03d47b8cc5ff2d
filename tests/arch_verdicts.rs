//! Verdicts on every architecture parity runs: on each committed fixture (llama, llama3,
//! qwen2, qwen3, gemma, gemma2, gemma3, phi3) and on generated 16-layer models with a fresh
//! llama.cpp golden, `parity check` passes with every backend and op by op, and every
//! applicable catalog bug — including each architecture's own (gemma's +1 applied twice, a
//! missing embedding scale or soft-cap, a sliding window off by one, skipped q/k norms, a fused
//! QKV split in the wrong order, ignored RoPE factors) — is found at its place and named by
//! `parity diff`, from full and from sparse traces, and placed at layer 11 of 16.

use crate::common;

use common::{parity, root, show, stdout};
use std::path::Path;

const ARCHS: &[&str] = &["llama3", "qwen3", "gemma", "gemma2", "gemma3", "phi3"];

/// The catalog bugs that belong to each architecture (each must have a row, and pass).
fn own_bugs(arch: &str) -> &'static [&'static str] {
    match arch {
        "llama3" => &["rope-factors-ignored"],
        "qwen3" => &["qk-norm-skipped"],
        "gemma" => &["gemma-norm-plus-one", "no-embd-scale"],
        "gemma2" => &[
            "gemma-norm-plus-one",
            "no-embd-scale",
            "no-softcap",
            "swa-off-by-one",
        ],
        "gemma3" => &[
            "gemma-norm-plus-one",
            "no-embd-scale",
            "swa-off-by-one",
            "qk-norm-skipped",
        ],
        "phi3" => &["qkv-split-order", "rope-factors-ignored"],
        _ => &[],
    }
}

fn check_passes(model: &Path, golden: Option<&Path>) {
    let mut args = vec!["check", model.to_str().unwrap(), "--verbose"];
    if let Some(g) = golden {
        args.extend(["--golden", g.to_str().unwrap()]);
    }
    let o = parity(&args);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(out.contains(&common::default_verdict()), "{}", show(&o));
    // Op by op ran for both replayable ggml-rounding backends (and the gpu, against the plain
    // reference fed the same inputs, where the default set has it).
    assert!(
        out.matches("op by op on the baseline's inputs").count() == common::default_backends() - 1,
        "{}",
        show(&o)
    );
}

/// `parity selftest` exits 0 (every row ok) and has an ok row for each of `bugs`.
fn selftest_finds(model: &Path, golden: Option<&Path>, extra: &[&str], bugs: &[&str]) {
    let mut args = vec!["selftest", model.to_str().unwrap()];
    if let Some(g) = golden {
        args.extend(["--golden", g.to_str().unwrap()]);
    }
    args.extend_from_slice(extra);
    let o = parity(&args);
    let out = stdout(&o);
    let failing: Vec<&str> = out.lines().filter(|l| l.contains("FAIL")).collect();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{} {extra:?}: {}\n{}",
        model.display(),
        failing.join("\n"),
        show(&o)
    );
    for bug in bugs {
        let row = out
            .lines()
            .find(|l| l.starts_with(&format!("{bug} ")))
            .unwrap_or_else(|| panic!("{} {extra:?}: no row for {bug}\n{out}", model.display()));
        assert!(row.trim_end().ends_with("ok"), "{row}");
        assert!(row.contains(bug), "named: {row}");
    }
}

/// A fresh golden of `model` from the real llama.cpp (a 16-token story prompt, 4 decode steps).
fn make_golden(model: &Path, golden: &Path) {
    let o = parity(&[
        "golden",
        model.to_str().unwrap(),
        "-p",
        "Once upon a time there was a little girl who liked to play",
        "--steps",
        "4",
        "--out",
        golden.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", show(&o));
}

#[test]
fn every_architecture_fixture_passes_check_in_every_mode() {
    for arch in ARCHS.iter().chain(&["llama", "qwen2"]) {
        let model = root().join(format!("fixtures/tiny-{arch}-q8_0.gguf"));
        check_passes(&model, None);
    }
}

#[test]
fn every_architecture_bug_is_found_and_named_on_the_fixtures() {
    for arch in ARCHS {
        let model = root().join(format!("fixtures/tiny-{arch}-q8_0.gguf"));
        selftest_finds(&model, None, &[], own_bugs(arch));
        selftest_finds(&model, None, &["--sparse"], own_bugs(arch));
    }
}

/// 16-layer models of the newer architectures (Q4_0, sliding windows, soft-caps, q/k norms,
/// fused weights), a fresh golden from the real llama.cpp each.
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn deep_models_of_every_new_architecture_pass_and_their_bugs_are_placed_at_depth() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["gemma2", "gemma3", "qwen3", "phi3"] {
        let model = dir.path().join(format!("{arch}.gguf"));
        let golden = dir.path().join(format!("golden-{arch}"));
        let o = parity(&[
            "fixture",
            "--arch",
            arch,
            "--type",
            "q4_0",
            "--n-layer",
            "16",
            "--seed",
            "3",
            "--out",
            model.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", show(&o));
        make_golden(&model, &golden);
        check_passes(&model, Some(&golden));
        let own: Vec<&str> = own_bugs(arch)
            .iter()
            .copied()
            // The embedding is before layer 11: a bug there cannot act from layer 11 on.
            .filter(|b| *b != "no-embd-scale")
            .collect();
        selftest_finds(&model, Some(&golden), &["--from-layer", "11"], &own);
        // Sparse at depth too (placed to layer 11's span). From layer 0 a sparse row repeats
        // the fixtures' sparse rows at 4× the time (tests/selftest.rs keeps one deep model's).
        selftest_finds(
            &model,
            Some(&golden),
            &["--sparse", "--from-layer", "11"],
            &own,
        );
    }
}

/// A model written by llama.cpp's own GGUF writer (gguf-py) in a shape parity's `fixture` does
/// not make (head_dim 96, n_head·head_dim ≠ n_embd, 6 over 2 heads, f16): parity reads it as
/// llama.cpp does, `check` passes against llama.cpp's golden, and the catalog is found.
#[test]
#[cfg_attr(
    not(all(parity_llama_cpp, parity_gguf_py)),
    ignore = "needs llama-cpp-python and gguf-py (.ci/run installs them; then touch build.rs)"
)]
fn models_written_by_gguf_py_in_another_shape_pass() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["qwen3", "gemma3"] {
        let model = dir.path().join(format!("{arch}.gguf"));
        let golden = dir.path().join(format!("golden-{arch}"));
        let o = std::process::Command::new(common::python())
            .arg(root().join("scripts/gguf_py_model.py"))
            .args([arch, model.to_str().unwrap()])
            .current_dir(root())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", show(&o));
        make_golden(&model, &golden);
        let info = stdout(&parity(&["inspect", model.to_str().unwrap()]));
        assert!(info.contains("head_dim 96"), "{info}");
        check_passes(&model, Some(&golden));
        selftest_finds(&model, Some(&golden), &[], own_bugs(arch));
    }
}

/// phi3's LongRoPE: llama.cpp uses the long factors when its context is longer than the one the
/// factors were trained for (256 in the fixture). A golden made with a 512-token context must
/// pass too: parity's backends hold the golden's context and pick the same factors (with the
/// short ones, q_rope is off by NMSE ~3e-2 at layer 0).
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn phi3_long_context_golden_uses_the_long_rope_factors() {
    let dir = tempfile::tempdir().unwrap();
    let golden = dir.path().join("phi3-long");
    let model = root().join("fixtures/tiny-phi3-q8_0.gguf");
    let o = std::process::Command::new(common::python())
        .arg(root().join("scripts/llama_golden.py"))
        .arg(&model)
        .args(["--tokens", "1,259,300,273,262,264,324,325,329,333,336,325"])
        .args(["--steps", "3", "--n-ctx", "512", "--out"])
        .arg(&golden)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    check_passes(&model, Some(&golden));
}
