//! The HTML report (`--html FILE`) of a clean `parity check` and of a diff that finds a mutated
//! kernel: self-contained, with the curves, the heat map, the marked divergence, the tokens and
//! the settings; rendered to PNG by headless Chromium (the tests show as ignored when build.rs
//! found none; .ci/run installs it). `PARITY_UPDATE_DOCS=1` also copies the PNGs to docs/.

use crate::common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn chromium() -> Option<PathBuf> {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(o) = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            && o.status.success()
        {
            let p = String::from_utf8_lossy(&o.stdout).trim().to_string();
            if !p.is_empty() {
                return Some(PathBuf::from(p));
            }
        }
    }
    None
}

/// Render `html` to `png` at `width`×`height` in headless Chromium, offline.
fn screenshot(browser: &Path, html: &Path, png: &Path, width: u32, height: u32) {
    let profile = tempfile::tempdir().unwrap();
    let o = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("--window-size={width},{height}"))
        .arg(format!("file://{}", html.display()))
        .output()
        .expect("run chromium");
    assert!(
        o.status.success(),
        "chromium failed\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let bytes = std::fs::read(png).unwrap_or_else(|e| panic!("{}: {e}", png.display()));
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", png.display());
    // A blank page compresses to a few KB; the report with its curves is far larger.
    assert!(
        bytes.len() > 50_000,
        "{}: {} bytes",
        png.display(),
        bytes.len()
    );
}

/// No script, no fetch: nothing but inline CSS and SVG.
fn assert_self_contained(html: &str) {
    for bad in ["<script", "src=", "<link", "url(", "@import", "href=\"http"] {
        assert!(!html.contains(bad), "the page contains {bad:?}");
    }
}

fn render(name: &str, html: &Path, height: u32) {
    match chromium() {
        None => panic!(
            "chromium not found (apt-get install -y chromium), though build.rs found one: touch build.rs; {name} not rendered to PNG"
        ),
        Some(b) => {
            let png = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.png"));
            screenshot(&b, html, &png, 1300, height);
            eprintln!("rendered {}", png.display());
            if std::env::var_os("PARITY_UPDATE_DOCS").is_some() {
                std::fs::copy(&png, root().join("docs").join(format!("{name}.png"))).unwrap();
            }
        }
    }
}

#[test]
#[cfg_attr(
    not(parity_chromium),
    ignore = "needs chromium to render the report (apt-get install chromium; then touch build.rs)"
)]
fn clean_check_report() {
    let tmp = tempfile::tempdir().unwrap();
    let html = tmp.path().join("clean.html");
    let o = parity(&["check", "--html", html.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let page = std::fs::read_to_string(&html).unwrap();
    assert_self_contained(&page);
    assert!(page.contains("PARITY") && !page.contains("DIVERGED"));
    // One curve and two heat maps per comparison (8: 3 backends, 2 op by op, 3 pairs; 13 with
    // the gpu where a driver exists).
    assert_eq!(page.matches("<svg").count(), default_comparisons());
    assert_eq!(
        page.matches("<table class=heat>").count(),
        2 * default_comparisons()
    );
    assert!(!page.contains("class=first"), "no divergence to mark");
    // The run's settings: model, sha256, llama.cpp version; the ids decoded.
    assert!(page.contains("fixtures/tiny-llama-q8_0.gguf"));
    assert!(page.contains("fa08a5e951872d2819ec235bf53bb36e5d54a4fc149b97b4550c0f4922a9f1b7"));
    assert!(page.contains("0c1e570-dirty"));
    assert!(page.contains("Once upon a time there was a little girl named Lily"));
    assert!(page.contains("threshold 1e"));
    render("report-clean", &html, 2600);
}

#[test]
#[cfg_attr(
    not(parity_chromium),
    ignore = "needs chromium to render the report (apt-get install chromium; then touch build.rs)"
)]
fn mutated_kernel_report_marks_the_divergence() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("neox");
    let o = parity(&[
        "dump",
        "fixtures/tiny-llama-q8_0.gguf",
        "--golden",
        "golden/tiny-llama-q8_0",
        "--backend",
        "reference",
        "--emulate",
        "ggml-cpu",
        "--mutate",
        "rope-neox",
        "--out",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let html = tmp.path().join("neox.html");
    let o = parity(&[
        "diff",
        "golden/tiny-llama-q8_0",
        trace.to_str().unwrap(),
        "--html",
        html.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let page = std::fs::read_to_string(&html).unwrap();
    assert_self_contained(&page);
    assert!(page.contains("DIVERGED"));
    // Marked in the curve and in the heat map, and named with its evidence.
    assert!(page.contains("first divergence: step 0 layer 0 q_rope"));
    // One marked cell per comparison: the own-error judgement and the end-to-end one.
    assert_eq!(page.matches("class=first").count(), 2);
    assert!(page.contains("◆ "));
    assert!(page.contains("Diagnosis:") && page.contains("rope-neox"));
    assert!(page.contains("still matching"));
    render("report-mutated", &html, 1900);
}
