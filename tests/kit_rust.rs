//! The Rust kit (issue #31): an engine instrumented only through `parity-trace` — the toy
//! llama engine in tests/engines/rust (its own GGUF reader, a plain f32 forward, no `parity`
//! dependency) — writes traces that `parity diff` accepts against the llama.cpp golden, both
//! natively (a folder, or an `.npz` archive) and built for wasm32-unknown-unknown and run under
//! Node (run.mjs); and each bug planted in it is found at its place and named.

use crate::common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const MODEL: &str = "fixtures/tiny-llama-f32.gguf";
const GOLDEN: &str = "golden/tiny-llama-f32";

/// The target folder this test was built into (`target/<profile>/deps/kit_rust-…` → `target`)
/// and whether it is the release profile: the engine is built there, beside it.
fn target_dir() -> (PathBuf, bool) {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    (profile_dir.parent().unwrap().to_path_buf(), release)
}

/// `cargo build -p toy-engine ARGS --target-dir <this test's target>`, checked.
fn cargo_build(args: &[&str]) {
    let (target, _) = target_dir();
    let o = Command::new(env!("CARGO"))
        .args(["build", "-p", "toy-engine"])
        .args(args)
        .arg("--target-dir")
        .arg(&target)
        .current_dir(root())
        .output()
        .expect("run cargo");
    assert!(
        o.status.success(),
        "cargo build -p toy-engine {}\n{}",
        args.join(" "),
        show(&o)
    );
}

/// The native engine binary, built once per test run (in this test's profile).
fn engine() -> PathBuf {
    static BUILD: std::sync::Once = std::sync::Once::new();
    let (target, release) = target_dir();
    BUILD.call_once(|| cargo_build(if release { &["--release"] } else { &[] }));
    let p = target
        .join(if release { "release" } else { "debug" })
        .join(format!("toy-engine{}", std::env::consts::EXE_SUFFIX));
    assert!(p.exists(), "{} not built", p.display());
    p
}

/// The wasm32 engine (release: a debug wasm engine is slow), built once per test run.
fn engine_wasm() -> PathBuf {
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| cargo_build(&["--lib", "--target", "wasm32-unknown-unknown", "--release"]));
    let p = target_dir()
        .0
        .join("wasm32-unknown-unknown/release/toy_engine.wasm");
    assert!(p.exists(), "{} not built", p.display());
    p
}

/// Run the native engine on the f32 fixture and its golden.
fn run_engine(out: &Path, extra: &[&str]) -> Output {
    Command::new(engine())
        .arg(MODEL)
        .arg(GOLDEN)
        .arg(out)
        .args(extra)
        .current_dir(root())
        .output()
        .unwrap()
}

/// `node run.mjs ENGINE.wasm MODEL GOLDEN OUT [BUG]`.
fn run_wasm(model: &str, out: &Path, bug: Option<&str>) -> Output {
    Command::new("node")
        .arg(root().join("tests/engines/rust/run.mjs"))
        .arg(engine_wasm())
        .arg(model)
        .arg(GOLDEN)
        .arg(out)
        .args(bug)
        .current_dir(root())
        .output()
        .unwrap()
}

/// `parity diff GOLDEN trace --json -`: the exit code and the report.
fn diff(trace: &Path) -> (Option<i32>, Value, Output) {
    let o = parity(&["diff", GOLDEN, trace.to_str().unwrap(), "--json", "-"]);
    let j: Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}\n{}", show(&o)));
    (o.status.code(), j, o)
}

/// A clean trace: exit 0, parity, the candidate named `toy-engine/<backend>` and recorded
/// with the golden's model (by sha256), 5 steps and 175 taps.
fn assert_parity(trace: &Path, backend: &str) {
    let (code, j, o) = diff(trace);
    assert_eq!(code, Some(0), "{}", show(&o));
    assert_eq!(j["verdict"], "parity", "{}", show(&o));
    let cand = &j["traces"][1];
    assert_eq!(cand["label"], format!("toy-engine/{backend}"));
    assert_eq!(cand["model"]["sha256"], j["traces"][0]["model"]["sha256"]);
    assert_eq!(cand["tensors"], 175);
    assert_eq!(cand["steps"].as_array().unwrap().len(), 5);
    // The own-error judgement ran (the model was found) and found plain f32 rounding.
    let own = own_inputs(&j);
    assert_eq!(own["verdict"], "parity", "{}", show(&o));
    assert_eq!(own["rounding_family"], "plain-f32", "{}", show(&o));
}

/// The own-error comparison (each op recomputed from the candidate's own inputs).
fn own_inputs(j: &Value) -> &Value {
    j["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["pair"] == "own-inputs")
        .expect("an own-inputs comparison (the model was found)")
}

/// A trace with a planted bug: exit 1, the own-error judgement's first divergence at step 0,
/// `layer`, `tap`, and its diagnosis containing each of `says`.
fn assert_named(trace: &Path, bug: &str, layer: Option<usize>, tap: &str, says: &[&str]) {
    let (code, j, o) = diff(trace);
    assert_eq!(code, Some(1), "{bug}: {}", show(&o));
    assert_eq!(j["verdict"], "diverged", "{bug}");
    let own = own_inputs(&j);
    assert_eq!(own["verdict"], "diverged", "{bug}");
    let fd = &own["first_divergence"];
    assert_eq!(
        fd["at"]["key"],
        serde_json::json!({"step": 0, "layer": layer, "tap": tap}),
        "{bug}: {}",
        show(&o)
    );
    let why = fd["diagnosis"].as_str().unwrap();
    for s in says {
        assert!(why.contains(s), "{bug}: diagnosis lacks {s:?}: {why}");
    }
    // The text report (stderr under --json -) says the same.
    let text = String::from_utf8_lossy(&o.stderr);
    let place = match layer {
        Some(l) => format!("first divergence at step 0 layer {l} {tap} "),
        None => format!("first divergence at step 0 {tap} "),
    };
    assert!(text.contains(&place), "{bug}: {text}");
}

#[test]
fn native_engine_trace_passes_diff_as_a_folder_and_as_an_npz() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("clean");
    let o = run_engine(&out, &[]);
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(
        stdout(&o).trim(),
        format!("wrote {}: 5 steps, 175 taps", out.display())
    );
    assert_parity(&out, "cpu-f32");

    // The same run kept in memory and written as one archive (what the wasm build hands back).
    let npz = tmp.path().join("clean.npz");
    let o = run_engine(&npz, &["--npz"]);
    assert!(o.status.success(), "{}", show(&o));
    assert!(stdout(&o).contains("5 steps, 175 taps"), "{}", show(&o));
    assert!(std::fs::read(&npz).unwrap().starts_with(b"PK\x03\x04"));
    assert_parity(&npz, "cpu-f32");
    // A bug planted in an archive is named as in a folder.
    let npz = tmp.path().join("neox.npz");
    let o = run_engine(&npz, &["--npz", "--bug", "rope-neox"]);
    assert!(o.status.success(), "{}", show(&o));
    assert_named(
        &npz,
        "rope-neox",
        Some(0),
        "q_rope",
        &["confirmed by experiment: rope-neox reproduces your q_rope"],
    );
}

/// Each planted bug: where parity places it (the first op out of its noise floor, at step 0)
/// and what it says. Four are confirmed by experiment under their own names; a missing
/// attention scale has no experiment in parity's catalog, so it is placed at kq_soft_max (q and
/// k after RoPE still matching) with the heuristic that names the score scale first.
#[test]
fn native_engine_planted_bugs_are_placed_and_named() {
    let cases: &[(&str, Option<usize>, &str, &[&str])] = &[
        (
            "rope-neox",
            Some(0),
            "q_rope",
            &[
                "confirmed by experiment: rope-neox reproduces your q_rope",
                "the model pairs NORM: (2i, 2i+1)",
            ],
        ),
        (
            "no-attn-scale",
            Some(0),
            "kq_soft_max",
            &[
                "confirmed by experiment: attn-scale=1 reproduces your kq_soft_max",
                "the engine scales attention scores by 1 (no scaling at all)",
            ],
        ),
        (
            "gqa-modulo",
            Some(0),
            "kq_soft_max",
            &["confirmed by experiment: gqa-modulo reproduces your kq_soft_max"],
        ),
        (
            "swiglu-swap",
            Some(0),
            "ffn_act",
            &["confirmed by experiment: swiglu-swap reproduces your ffn_act"],
        ),
        (
            "tied-output",
            None,
            "logits",
            &["confirmed by experiment: tied-output reproduces your logits"],
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    for &(bug, layer, tap, says) in cases {
        let out = tmp.path().join(bug);
        let o = run_engine(&out, &["--bug", bug]);
        assert!(o.status.success(), "{bug}: {}", show(&o));
        assert_named(&out, bug, layer, tap, says);
    }
}

#[test]
fn native_engine_refuses_what_it_cannot_run() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("t");
    let o = Command::new(engine()).arg("x").output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("usage"));
    let o = run_engine(&out, &["--bug", "nope"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("unknown bug 'nope' (known: rope-neox, no-attn-scale"),
        "{}",
        show(&o)
    );
    // Its GGUF reader reads F32 tensors only, and says which tensor is not.
    let o = Command::new(engine())
        .args(["fixtures/tiny-llama-q8_0.gguf", "golden/tiny-llama-q8_0"])
        .arg(&out)
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("tensor 'token_embd.weight' is Q8_0: this engine reads F32 tensors only"),
        "{}",
        show(&o)
    );
}

#[test]
#[cfg_attr(
    not(all(parity_wasm32, parity_node)),
    ignore = "needs the wasm32-unknown-unknown target (rustup target add wasm32-unknown-unknown) and Node 18 or later on PATH; then touch build.rs"
)]
fn wasm32_engine_under_node_passes_diff_and_its_bug_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("wasm.npz");
    let o = run_wasm(MODEL, &out, None);
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        stdout(&o).starts_with(&format!("wrote {}: ", out.display())),
        "{}",
        show(&o)
    );
    assert_parity(&out, "wasm32-f32");

    let out = tmp.path().join("wasm-neox.npz");
    let o = run_wasm(MODEL, &out, Some("rope-neox"));
    assert!(o.status.success(), "{}", show(&o));
    assert_named(
        &out,
        "rope-neox",
        Some(0),
        "q_rope",
        &["confirmed by experiment: rope-neox reproduces your q_rope"],
    );

    // The engine's errors come back through the result buffer: exit 1 with its message.
    let o = run_wasm(
        "fixtures/tiny-llama-q8_0.gguf",
        &tmp.path().join("q8.npz"),
        None,
    );
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("this engine reads F32 tensors only"),
        "{}",
        show(&o)
    );
    assert!(!tmp.path().join("q8.npz").exists());

    // What docs/instrument.md shows for this run.
    let out = tmp.path().join("neox.npz");
    let o = run_wasm(MODEL, &out, Some("rope-neox"));
    let d = parity(&["diff", GOLDEN, out.to_str().unwrap()]);
    let printed = (show(&o) + &show(&d)).replace(out.to_str().unwrap(), "trace.npz");
    assert_shown("docs/instrument.md", "tests/kit_rust.rs: wasm32", &printed);
}

/// docs/instrument.md shows what the native engine and `parity diff` print.
#[test]
fn the_docs_show_what_the_native_engine_prints() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("trace");
    let o = run_engine(&out, &[]);
    let d = parity(&["diff", GOLDEN, out.to_str().unwrap()]);
    let printed = (show(&o) + &show(&d)).replace(out.to_str().unwrap(), "trace");
    assert_shown("docs/instrument.md", "tests/kit_rust.rs: native", &printed);
}

/// The crate's writer cuts `kq_soft_max` to the plan in `PARITY_RECORD` (`kq_heads`,
/// `kq_rows` by position) with no change to the engine: the entries list what was kept, a step
/// holding none of the rows writes none, the clean trace passes and a bug in the kept rows is
/// placed at kq_soft_max.
#[test]
fn native_engine_cuts_kq_soft_max_to_the_plan_from_the_environment() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, bug: Option<&str>| {
        let out = tmp.path().join(name);
        let mut c = Command::new(engine());
        c.arg(MODEL).arg(GOLDEN).arg(&out).current_dir(root());
        if let Some(b) = bug {
            c.args(["--bug", b]);
        }
        let o = c
            .env("PARITY_RECORD", "kq_heads=1-2;kq_rows=12-15,21")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", show(&o));
        out
    };
    let clean = run("clean", None);
    let m: Value =
        serde_json::from_slice(&std::fs::read(clean.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["record"], "taps=all;kq_heads=1-2;kq_rows=12-15,21");
    let probs: Vec<&Value> = m["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["tap"] == "kq_soft_max" && t["layer"] == 0)
        .collect();
    // The prompt is positions 0..20, then one decode step per position from 20.
    let got: Vec<(u64, Value, Value, Value)> = probs
        .iter()
        .map(|t| {
            (
                t["step"].as_u64().unwrap(),
                t["shape"].clone(),
                t["heads"].clone(),
                t["rows"].clone(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (
                0,
                serde_json::json!([2, 4, 20]),
                serde_json::json!([1, 2]),
                serde_json::json!([12, 13, 14, 15])
            ),
            (
                2,
                serde_json::json!([2, 1, 22]),
                serde_json::json!([1, 2]),
                serde_json::json!([21])
            ),
        ]
    );
    let (code, j, o) = diff(&clean);
    assert_eq!(code, Some(0), "{}", show(&o));
    assert_eq!(own_inputs(&j)["verdict"], "parity", "{}", show(&o));

    let bug = run("gqa", Some("gqa-modulo"));
    let (code, j, o) = diff(&bug);
    assert_eq!(code, Some(1), "{}", show(&o));
    let d = &own_inputs(&j)["first_divergence"];
    assert_eq!(
        d["at"]["key"],
        serde_json::json!({"step": 0, "layer": 0, "tap": "kq_soft_max"}),
        "{d:#}"
    );
    assert!(
        d["diagnosis"]
            .as_str()
            .unwrap()
            .contains("confirmed by experiment: gqa-modulo"),
        "{d:#}"
    );
}
