//! Instrumenting an engine: the Rust example (examples/trace_engine.rs, a toy forward using
//! `parity::trace::api::TraceWriter`) and the numpy writer (scripts/parity_trace.py) produce
//! traces that `parity diff` accepts against the committed goldens; the Hugging Face adapter
//! (scripts/hf_trace.py) runs under a Python with torch and transformers (.venv-hf, made by
//! .ci/run, or $PARITY_HF_PYTHON).

use crate::common;
use common::*;
use std::path::PathBuf;
use std::process::Command;

/// The example binary beside this test (target/<profile>/examples/): `cargo test` builds it;
/// a `cargo test --test suite instrument::` alone does not, so then it is built here.
fn example() -> PathBuf {
    static BUILD: std::sync::Once = std::sync::Once::new();
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let p = profile_dir.join("examples/trace_engine");
    BUILD.call_once(|| {
        if !p.exists() {
            let mut c = Command::new(env!("CARGO"));
            c.args(["build", "--example", "trace_engine"])
                .current_dir(root());
            if profile_dir.file_name().is_some_and(|n| n == "release") {
                c.arg("--release");
            }
            let o = c.output().expect("run cargo");
            assert!(
                o.status.success(),
                "cargo build --example trace_engine\n{}",
                show(&o)
            );
        }
    });
    assert!(p.exists(), "{} not built", p.display());
    p
}

#[test]
fn rust_example_engine_traces_pass_diff_against_goldens() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["tiny-llama-q8_0", "tiny-llama-f32", "tiny-qwen2-q4_k"] {
        let out = tmp.path().join(name);
        let model = root().join(format!("fixtures/{name}.gguf"));
        let golden = root().join(format!("golden/{name}"));
        let o = Command::new(example())
            .args([&model, &golden, &out])
            .output()
            .unwrap();
        assert!(o.status.success(), "{name}: {}", show(&o));
        assert!(stdout(&o).contains("5 steps, 175 taps"), "{}", show(&o));
        let o = parity(&[
            "diff",
            golden.to_str().unwrap(),
            out.to_str().unwrap(),
            "--json",
            "-",
        ]);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", show(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(j["verdict"], "parity");
        // The manifest names the engine and the model file by sha256.
        let cand = &j["traces"][1];
        assert_eq!(cand["label"], "toy-engine/cpu-f32");
        assert_eq!(cand["model"]["sha256"], j["traces"][0]["model"]["sha256"]);
    }
}

#[test]
fn rust_example_refuses_bad_arguments() {
    let o = Command::new(example()).arg("x").output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("usage"));
}

fn python_with(modules: &str) -> Option<PathBuf> {
    let py = std::env::var_os("PARITY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"));
    let ok = Command::new(&py)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(py)
}

#[test]
#[cfg_attr(
    not(parity_numpy),
    ignore = "needs numpy (.ci/run installs it; then touch build.rs)"
)]
fn numpy_writer_round_trips_a_golden_and_refuses_bad_taps() {
    let Some(py) = python_with("numpy") else {
        eprintln!("skipped: no Python with numpy (.venv or PARITY_PYTHON)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("copy");
    let o = Command::new(&py)
        .arg(root().join("scripts/parity_trace.py"))
        .arg(root().join("golden/tiny-llama-q8_0"))
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    let o = parity(&["diff", "golden/tiny-llama-q8_0", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    // The writer's own checks, as an engine author meets them.
    let script = format!(
        r#"
import sys; sys.path.insert(0, {scripts:?})
import numpy as np
from parity_trace import TraceWriter, TraceError
w = TraceWriter({out:?})
w.step([1, 2], [0, 1])
bad = [lambda: w.tap(0, "embd", np.zeros((2, 4))), lambda: w.tap(None, "q", np.zeros((2, 4))),
       lambda: w.tap(0, "qq", np.zeros((2, 4))), lambda: w.tap(0, "l_out", np.zeros((3, 4))),
       lambda: w.tap(0, "l_out", np.zeros(8), shape=[2, 3])]
w.tap(0, "l_out", np.zeros((2, 4)))
bad.append(lambda: w.tap(0, "l_out", np.zeros((2, 4))))
for b in bad:
    try:
        b(); print("accepted")
    except TraceError as e:
        print("refused:", e)
"#,
        scripts = root().join("scripts").display().to_string(),
        out = tmp.path().join("bad").display().to_string()
    );
    let o = Command::new(&py).args(["-c", &script]).output().unwrap();
    assert!(o.status.success(), "{}", show(&o));
    let s = stdout(&o);
    assert_eq!(s.matches("refused:").count(), 6, "{s}");
    assert!(!s.contains("accepted"), "{s}");
}

/// The HF checkpoint of TinyStories-656K is the F16 GGUF before conversion: its trace says parity
/// against that GGUF's llama.cpp golden. Needs torch + transformers (.venv-hf or
/// $PARITY_HF_PYTHON, as build/probe.rs finds them) and ../shared.
#[test]
#[cfg_attr(
    not(parity_hf),
    ignore = "needs torch and transformers (.ci/run makes .venv-hf; or PARITY_HF_PYTHON) and ../shared"
)]
fn hf_adapter_trace_passes_against_the_f16_golden() {
    let py = std::env::var_os("PARITY_HF_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv-hf/bin/python"));
    let Some(hf) = shared("models/hf/TinyStories-656K") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("hf");
    let o = Command::new(&py)
        .arg(root().join("scripts/hf_trace.py"))
        .arg(&hf)
        .arg(root().join("golden/TinyStories-656K.f16"))
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    let o = parity(&["diff", "golden/TinyStories-656K.f16", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));

    // HF's own rotary order (`--hf-order`: the Q/K rows before convert_hf_to_gguf.py permutes
    // them): right numbers in another order, named by experiment at every tap it touches.
    let hf_order = tmp.path().join("hf-order");
    let o = Command::new(&py)
        .arg(root().join("scripts/hf_trace.py"))
        .arg(&hf)
        .arg(root().join("golden/TinyStories-656K.f16"))
        .arg(&hf_order)
        .arg("--hf-order")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    let o = parity(&[
        "diff",
        "golden/TinyStories-656K.f16",
        hf_order.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let verdict = stdout(&o);
    assert!(
        verdict.contains("first divergence at step 0 layer 0 q ")
            && verdict.contains("confirmed by experiment: layout:rotary-halves reproduces your q")
            && verdict.contains(r#"declare them all: "layouts": {"q": "rotary-halves", "k": "rotary-halves", "q_rope": "rotary-halves", "k_rope": "rotary-halves"}"#),
        "{verdict}"
    );
    // Declared, it is aligned and the trace passes.
    let manifest = hf_order.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    m["layouts"] = serde_json::json!({
        "q": "rotary-halves", "k": "rotary-halves", "q_rope": "rotary-halves", "k_rope": "rotary-halves"
    });
    std::fs::write(&manifest, serde_json::to_string(&m).unwrap()).unwrap();
    let o = parity(&[
        "diff",
        "golden/TinyStories-656K.f16",
        hf_order.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
}
