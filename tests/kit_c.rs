//! The C trace writer (bindings/c/parity_trace.h) and a toy C engine written against it
//! (tests/engines/c/toy_llama.c), built with the machine's `cc` (C99, warnings as errors) and
//! `c++` (the header as a C++11 translation unit): the engine's trace of
//! golden/tiny-llama-f32 passes `parity diff`; each bug it can plant is named by parity at its
//! step, layer and tap — the wrong values no catalog lists (eps 1e-3, RoPE base 20000, the
//! attention scale 1/head_dim or none) fitted and named with their value, from full and sparse
//! dumps; the header refuses bad taps with a message naming them, replaces only
//! a previous trace, never writes through a link, hashes like `sha256sum`, and its golden-ids
//! reader refuses malformed manifests (truncated, nested too deep, huge numbers) with a
//! message, never a crash. Everything is built in a temporary folder.

use crate::common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Compile `src` (relative to the repository) with `compiler` and `flags` into `dir/name`.
fn build(dir: &Path, compiler: &str, flags: &[&str], src: &str, name: &str) -> PathBuf {
    let exe = dir.join(name);
    let o = Command::new(compiler)
        .args(flags)
        .arg("-I")
        .arg(root().join("bindings/c"))
        .arg(root().join(src))
        .arg("-o")
        .arg(&exe)
        .arg("-lm")
        .output()
        .unwrap_or_else(|e| panic!("run {compiler}: {e}"));
    assert!(
        o.status.success(),
        "{compiler} {} {src}\n{}",
        flags.join(" "),
        show(&o)
    );
    exe
}

const C99: &[&str] = &[
    "-std=c99",
    "-O2",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-pedantic",
];

fn toy(dir: &Path) -> PathBuf {
    build(dir, "cc", C99, "tests/engines/c/toy_llama.c", "toy_llama")
}

fn checks(dir: &Path) -> PathBuf {
    build(
        dir,
        "cc",
        C99,
        "tests/engines/c/trace_checks.c",
        "trace_checks",
    )
}

fn run(exe: &Path, args: &[&Path]) -> Output {
    Command::new(exe).args(args).output().unwrap()
}

/// Run the toy engine on golden/tiny-llama-f32 (with `bug`) and diff its trace against the
/// golden: the exit code and the JSON report.
fn engine_diff(toy: &Path, out: &Path, bug: Option<&str>) -> (Option<i32>, serde_json::Value) {
    let mut c = Command::new(toy);
    c.arg(root().join("fixtures/tiny-llama-f32.gguf"))
        .arg(root().join("golden/tiny-llama-f32"))
        .arg(out);
    if let Some(b) = bug {
        c.args(["--bug", b]);
    }
    let o = c.output().unwrap();
    assert!(o.status.success(), "{bug:?}: {}", show(&o));
    assert!(stdout(&o).contains("5 steps, 175 taps"), "{}", show(&o));
    let o = parity(&[
        "diff",
        "golden/tiny-llama-f32",
        out.to_str().unwrap(),
        "--json",
        "-",
    ]);
    let j = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&o)));
    (o.status.code(), j)
}

#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_engine_trace_passes_diff_against_the_golden() {
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    let out = tmp.path().join("trace");
    let (code, j) = engine_diff(&toy, &out, None);
    assert_eq!(code, Some(0), "{j:#}");
    assert_eq!(j["verdict"], "parity", "{j:#}");
    // The manifest names the engine, and the model by the sha256 the header computed: the
    // golden's (made from the same fixture).
    let cand = &j["traces"][1];
    assert_eq!(cand["label"], "toy-c/cpu-f32");
    assert_eq!(cand["model"]["sha256"], j["traces"][0]["model"]["sha256"]);
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["model"]["size"], 1595168);
    assert_eq!(m["producer"]["settings"]["feed"], "one token at a time");
    // The files are named as parity's own writers name them, with the golden's shapes.
    let golden = root().join("golden/tiny-llama-f32");
    assert_eq!(npy_files(&out), npy_files(&golden));
    let (shape, _) = read_npy(&out.join("s000/kq_soft_max-1.npy"));
    assert_eq!(shape, vec![4, 20, 20]);
    let (shape, _) = read_npy(&out.join("s003/kq_soft_max-0.npy"));
    assert_eq!(shape, vec![4, 1, 23]);
    // Run again over the finished trace: it is replaced, not refused.
    let (code, _) = engine_diff(&toy, &out, None);
    assert_eq!(code, Some(0));
}

#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_engine_planted_bugs_are_named_where_they_are() {
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    // (bug, the op parity's own-error judgement finds first at step 0 layer 0, the hypothesis
    // it confirms by re-running that op with the bug)
    let cases = [
        ("rope-neox", Some(0), "q_rope", "rope-neox"),
        ("rms-eps-10x", Some(0), "attn_norm", "rms-eps-10x"),
        ("swiglu-swap", Some(0), "ffn_act", "swiglu-swap"),
        // The bugs hobby engines make that the catalog once lacked.
        ("kv-slot-late", Some(0), "kq_soft_max", "kv-slot-late"),
        ("attn-out-twice", Some(0), "ffn_inp", "attn-out-twice"),
        ("no-final-norm", None, "result_norm", "no-final-norm"),
        // An op left out at one site: either norm, either residual add.
        ("no-attn-norm", Some(0), "attn_norm", "no-attn-norm"),
        ("no-ffn-norm", Some(0), "ffn_norm", "no-ffn-norm"),
        ("no-attn-residual", Some(0), "ffn_inp", "no-attn-residual"),
        ("no-ffn-residual", Some(0), "l_out", "no-ffn-residual"),
        ("wrong-ffn-act", Some(0), "ffn_act", "wrong-ffn-act"),
        // The final norm's eps alone, fitted.
        ("out-norm-eps-1", None, "result_norm", "output-norm-eps=1"),
    ];
    for (bug, layer, tap, name) in cases {
        let out = tmp.path().join(bug);
        let (code, j) = engine_diff(&toy, &out, Some(bug));
        assert_eq!(code, Some(1), "{bug}: {j:#}");
        assert_eq!(j["verdict"], "diverged", "{bug}");
        assert_eq!(j["traces"][1]["producer"]["settings"]["bug"], bug);
        let own = own_inputs(&j);
        assert_eq!(own["verdict"], "diverged", "{bug}: {own:#}");
        let d = &own["first_divergence"];
        assert_eq!(
            d["at"]["key"],
            serde_json::json!({"step": 0, "layer": layer, "tap": tap}),
            "{bug}: {d:#}"
        );
        let why = d["diagnosis"].as_str().unwrap();
        assert!(
            why.contains(&format!(
                "confirmed by experiment: {name} reproduces your {tap}"
            )),
            "{bug}: {why}"
        );
        let text = own["explanation"].as_str().unwrap();
        let place = match layer {
            Some(l) => format!("step 0 layer {l} {tap} "),
            None => format!("step 0 {tap} "),
        };
        assert!(
            text.contains(&format!("first divergence at {place}")),
            "{bug}: {text}"
        );
    }
}

/// Bugs that act only from a position on, at widths the catalog never uses (a ring of 13 K/V
/// slots, RoPE at p % 11), in an engine fed one token at a time: found inside the prompt at
/// their first position, which the report names, and named with the width fitted from it.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_engine_position_bugs_are_found_at_their_first_position() {
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    for (bug, tap, name, width) in [
        ("kv-ring-13", "kq_soft_max", "kv-ring-wrap", 13),
        ("rope-pos-mod-11", "q_rope", "rope-pos-wrap", 11),
    ] {
        let out = tmp.path().join(bug);
        let (code, j) = engine_diff(&toy, &out, Some(bug));
        assert_eq!(code, Some(1), "{bug}: {j:#}");
        let d = &own_inputs(&j)["first_divergence"];
        assert_eq!(
            d["at"]["key"],
            serde_json::json!({"step": 0, "layer": 0, "tap": tap}),
            "{bug}: {d:#}"
        );
        // The 20-token prompt's rows before the width match; the first one past it does not.
        assert_eq!(
            d["position"],
            serde_json::json!({"position": width, "row": width, "rows": 20, "token": j["traces"][0]["steps"][0]["tokens"][width]}),
            "{bug}: {d:#}"
        );
        let why = d["diagnosis"].as_str().unwrap();
        assert!(
            why.contains(&format!(
                "confirmed by experiment: {name} reproduces your {tap}"
            )),
            "{bug}: {why}"
        );
        assert!(why.contains(&format!("mod {width}")), "{bug}: {why}");
        let text = own_inputs(&j)["explanation"].as_str().unwrap();
        assert!(
            text.contains(&format!(
                "first divergence at step 0 layer 0 {tap} from position {width} (row {width} of the step's 20"
            )),
            "{bug}: {text}"
        );
    }
}

/// Two RoPE position bugs of shapes no catalog lists: the judge solves each row's position
/// from the trace's q/k on both sides of RoPE and names the rule — every row one late from the
/// first prompt token, and a counter that stops at the first decode position (found at the
/// second decode step, position 21), also from a scan and the zoom it asks for.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_engine_rope_positions_of_no_catalog_shape_are_solved_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    for (bug, step, position, name, says) in [
        (
            "rope-pos-from-1",
            0,
            0,
            "rope-at:q,k=p+1@0",
            "a row is rotated at p + 1",
        ),
        (
            "rope-pos-stuck",
            2,
            21,
            "rope-at:q,k=20@21",
            "at position 20 whatever its own",
        ),
    ] {
        let out = tmp.path().join(bug);
        let (code, j) = engine_diff(&toy, &out, Some(bug));
        assert_eq!(code, Some(1), "{bug}: {j:#}");
        let d = &own_inputs(&j)["first_divergence"];
        assert_eq!(
            d["at"]["key"],
            serde_json::json!({"step": step, "layer": 0, "tap": "q_rope"}),
            "{bug}: {d:#}"
        );
        assert_eq!(d["position"]["position"], position, "{bug}: {d:#}");
        let why = d["diagnosis"].as_str().unwrap();
        assert!(
            why.contains(&format!(
                "confirmed by experiment: {name} reproduces your q_rope"
            )),
            "{bug}: {why}"
        );
        assert!(why.contains(says), "{bug}: {why}");
        assert!(!why.contains("also reproduces"), "{bug}: {why}");
    }
    // From a scan and the zoom it asks for (step 2 whole, k_rope and v at every step): the
    // same rule, solved from the one step that has q on both sides of RoPE.
    let run = |out: &Path, plan: &str| {
        let o = Command::new(&toy)
            .arg(root().join("fixtures/tiny-llama-f32.gguf"))
            .arg(root().join("golden/tiny-llama-f32"))
            .arg(out)
            .args(["--bug", "rope-pos-stuck"])
            .env("PARITY_RECORD", plan)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", show(&o));
        let o = parity(&[
            "diff",
            "golden/tiny-llama-f32",
            out.to_str().unwrap(),
            "--json",
            "-",
        ]);
        assert_eq!(o.status.code(), Some(1), "{}", show(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        own_inputs(&j)["first_divergence"].clone()
    };
    let d = run(&tmp.path().join("scan"), "taps=l_out,result_norm,logits");
    assert_eq!(d["at"]["key"]["step"], 2, "{d:#}");
    let plan = d["zoom"]["record"].as_str().unwrap().to_string();
    assert!(plan.ends_with(";full=2"), "{d:#}");
    let d = run(&tmp.path().join("zoom"), &plan);
    assert_eq!(
        d["at"]["key"],
        serde_json::json!({"step": 2, "layer": 0, "tap": "q_rope"}),
        "{d:#}"
    );
    let why = d["diagnosis"].as_str().unwrap();
    assert!(
        why.contains("confirmed by experiment: rope-at:q,k=20@21 reproduces your q_rope"),
        "{why}"
    );
}

/// The header honours a recording plan from `PARITY_RECORD` (the toy engine has no code for
/// it): a scan of the engine with a ring of 13 K/V slots is placed to layer 0's `l_out` at step
/// 0 and `diff` prints the plan that records step 0 whole; run again to that plan, the engine
/// is found at `kq_soft_max` and named. A bad plan stops the engine at pt_create, one line.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_engine_follows_a_recording_plan_from_the_environment() {
    const SCAN: &str = "taps=l_out,result_norm,logits";
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    let engine = |out: &Path, plan: &str| {
        Command::new(&toy)
            .arg(root().join("fixtures/tiny-llama-f32.gguf"))
            .arg(root().join("golden/tiny-llama-f32"))
            .arg(out)
            .args(["--bug", "kv-ring-13"])
            .env("PARITY_RECORD", plan)
            .output()
            .unwrap()
    };
    let judged = |out: &Path| {
        let o = parity(&[
            "diff",
            "golden/tiny-llama-f32",
            out.to_str().unwrap(),
            "--json",
            "-",
        ]);
        assert_eq!(o.status.code(), Some(1), "{}", show(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        own_inputs(&j)["first_divergence"].clone()
    };
    let manifest = |out: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap()
    };

    let scan = tmp.path().join("scan");
    let o = engine(&scan, SCAN);
    assert!(o.status.success(), "{}", show(&o));
    let m = manifest(&scan);
    assert_eq!(m["record"], SCAN);
    for t in m["tensors"].as_array().unwrap() {
        assert!(
            ["l_out", "result_norm", "logits"].contains(&t["tap"].as_str().unwrap()),
            "{t}"
        );
    }
    let d = judged(&scan);
    assert_eq!(
        d["at"]["key"],
        serde_json::json!({"step": 0, "layer": 0, "tap": "l_out"}),
        "{d:#}"
    );
    let plan = d["zoom"]["record"].as_str().unwrap().to_string();
    assert_eq!(plan, format!("{SCAN};full=0"), "{d:#}");

    let zoom = tmp.path().join("zoom");
    let o = engine(&zoom, &plan);
    assert!(o.status.success(), "{}", show(&o));
    let d = judged(&zoom);
    assert_eq!(
        d["at"]["key"],
        serde_json::json!({"step": 0, "layer": 0, "tap": "kq_soft_max"}),
        "{d:#}"
    );
    assert_eq!(d["position"]["position"], 13, "{d:#}");
    assert!(d.get("zoom").is_none(), "{d:#}");
    let why = d["diagnosis"].as_str().unwrap();
    assert!(
        why.contains("confirmed by experiment: kv-ring-wrap"),
        "{why}"
    );

    for (bad, says) in [
        (
            "taps=l_out;full=3-1",
            "PARITY_RECORD: full: the range 3-1 runs backwards",
        ),
        ("taps=nope", "PARITY_RECORD: taps: unknown tap 'nope'"),
        ("full=1;full=2", "PARITY_RECORD: 'full' is given twice"),
        // A control character is shown escaped, never sent to the terminal.
        (
            "taps=l_out\n\u{1b}[2J",
            "PARITY_RECORD: taps: unknown tap 'l_out\\x0a\\x1b[2J'",
        ),
    ] {
        let out = tmp.path().join("bad");
        let o = engine(&out, bad);
        assert!(!o.status.success(), "{bad}: {}", show(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{bad}: {err}");
        assert!(err.contains(says), "{bad}: {err}");
        assert!(!out.join("manifest.json").exists(), "{bad}");
    }
}

/// Run the toy engine on golden/tiny-llama-f32 into `out` to the recording plan `plan` (none:
/// every tap), with `bug` planted.
fn toy_to_plan(toy: &Path, out: &Path, plan: Option<&str>, bug: Option<&str>) -> Output {
    let mut c = Command::new(toy);
    c.arg(root().join("fixtures/tiny-llama-f32.gguf"))
        .arg(root().join("golden/tiny-llama-f32"))
        .arg(out)
        .env_remove("PARITY_RECORD");
    if let Some(p) = plan {
        c.env("PARITY_RECORD", p);
    }
    if let Some(b) = bug {
        c.args(["--bug", b]);
    }
    c.output().unwrap()
}

fn manifest_of(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

/// A plan's `kq_heads` / `kq_rows` parts cut `kq_soft_max` (the header does it; the toy engine
/// has no code for it): each file kept is the whole run's tensor with those heads and the rows
/// of those positions selected, every column kept; its entry lists `heads` and `rows`
/// (positions) exactly; a decode step whose position is not kept has no `kq_soft_max` at all;
/// every other tap is the whole run's, file for file. A part present is listed even when it
/// keeps everything.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_header_cuts_kq_soft_max_to_the_plans_heads_and_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    let whole = tmp.path().join("whole");
    let o = toy_to_plan(&toy, &whole, None, None);
    assert!(o.status.success(), "{}", show(&o));
    let wm = manifest_of(&whole);
    assert!(wm.get("record").is_none(), "{wm:#}");

    // The prompt is positions 0-19 (step 0), the decode steps 20, 21, 22 and 23 (steps 1-4):
    // rows 2-4 and 8 of the prompt kept, and decode step 2 (position 21) alone of the others.
    let plan = "kq_rows=21, 8,2-4 ; kq_heads=3,1";
    let cut = tmp.path().join("cut");
    let o = toy_to_plan(&toy, &cut, Some(plan), None);
    assert!(o.status.success(), "{}", show(&o));
    let cm = manifest_of(&cut);
    assert_eq!(cm["record"], "taps=all;kq_heads=1,3;kq_rows=2-4,8,21");
    let positions = |step: u64| -> Vec<u64> {
        wm["steps"][step as usize]["positions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_u64().unwrap())
            .collect()
    };
    let kept_rows = |step: u64| -> Vec<u64> {
        positions(step)
            .into_iter()
            .filter(|p| [2, 3, 4, 8, 21].contains(p))
            .collect()
    };
    let entries = |m: &serde_json::Value| -> Vec<serde_json::Value> {
        m["tensors"].as_array().unwrap().clone()
    };
    let find = |m: &serde_json::Value, w: &serde_json::Value| -> Option<serde_json::Value> {
        entries(m)
            .into_iter()
            .find(|t| t["step"] == w["step"] && t["tap"] == w["tap"] && t["layer"] == w["layer"])
    };
    let (mut cut_probs, mut others) = (0, 0);
    for w in entries(&wm) {
        let file = w["file"].as_str().unwrap();
        let (wshape, wdata) = read_npy(&whole.join(file));
        if w["tap"] != "kq_soft_max" {
            let c = find(&cm, &w).unwrap_or_else(|| panic!("{w} is missing from the cut run"));
            assert_eq!(c, w, "an entry of another tap is the whole run's");
            assert_eq!(read_npy(&cut.join(file)), (wshape, wdata), "{file}");
            others += 1;
            continue;
        }
        let step = w["step"].as_u64().unwrap();
        let rows = kept_rows(step);
        let Some(c) = find(&cm, &w) else {
            assert!(rows.is_empty(), "{w}: kept rows {rows:?} but no entry");
            assert!(!cut.join(file).exists(), "{file} written without an entry");
            continue;
        };
        assert!(
            !rows.is_empty(),
            "{c}: written at a step without a kept row"
        );
        let (n_head, t, n_kv) = (wshape[0], wshape[1], wshape[2]);
        assert_eq!((n_head, t), (4, positions(step).len() as u64), "{w}");
        assert_eq!(c["heads"], serde_json::json!([1, 3]), "{c}");
        assert_eq!(c["rows"], serde_json::json!(rows), "{c}");
        let shape = vec![2, rows.len() as u64, n_kv];
        assert_eq!(c["shape"], serde_json::json!(shape), "{c}");
        assert_eq!(c["file"], w["file"]);
        let (cshape, cdata) = read_npy(&cut.join(file));
        assert_eq!(cshape, shape, "{file}");
        let p0 = positions(step)[0];
        let mut selected = Vec::new();
        for h in [1u64, 3] {
            for p in &rows {
                let at = ((h * t + (p - p0)) * n_kv) as usize;
                selected.extend_from_slice(&wdata[at..at + n_kv as usize]);
            }
        }
        assert_eq!(
            cdata, selected,
            "{file}: not the whole run's heads 1, 3 and rows {rows:?}"
        );
        cut_probs += 1;
    }
    // Two layers at steps 0 and 2; nothing else in the cut run.
    assert_eq!(cut_probs, 4);
    assert_eq!(entries(&cm).len(), others + cut_probs);
    assert_eq!(npy_files(&cut).len(), others + cut_probs);
    for step in ["s001", "s003", "s004"] {
        for layer in 0..2 {
            assert!(!cut.join(format!("{step}/kq_soft_max-{layer}.npy")).exists());
        }
    }

    // A part is listed whenever the plan has it, even when it keeps every head: kq_heads
    // 0-99 of a 4-head model keeps all four (the tensor whole), and no kq_rows: no "rows".
    let heads = tmp.path().join("heads");
    let o = toy_to_plan(&toy, &heads, Some("taps=kq_soft_max;kq_heads=0-99"), None);
    assert!(o.status.success(), "{}", show(&o));
    let hm = manifest_of(&heads);
    assert_eq!(hm["record"], "taps=kq_soft_max;kq_heads=0-99");
    let probs: Vec<serde_json::Value> = entries(&wm)
        .into_iter()
        .filter(|t| t["tap"] == "kq_soft_max")
        .collect();
    assert_eq!(entries(&hm).len(), probs.len(), "{hm:#}");
    for w in probs {
        let c = find(&hm, &w).unwrap();
        assert_eq!(c["heads"], serde_json::json!([0, 1, 2, 3]), "{c}");
        assert!(c.get("rows").is_none(), "{c}");
        assert_eq!(c["shape"], w["shape"], "{c}");
        let file = w["file"].as_str().unwrap();
        assert_eq!(read_npy(&heads.join(file)), read_npy(&whole.join(file)));
    }
}

/// A bad `kq_heads` / `kq_rows` part stops the engine at pt_create with one line naming it,
/// and nothing is written.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_header_refuses_a_bad_kq_cut_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    let many = format!(
        "kq_rows={}",
        (0..4097)
            .map(|p| (2 * p).to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    for (bad, says) in [
        (
            "kq_rows=x",
            "PARITY_RECORD: kq_rows: 'x' is not a position or a range a-b",
        ),
        (
            "kq_heads=5-2",
            "PARITY_RECORD: kq_heads: the range 5-2 runs backwards",
        ),
        ("kq_rows=", "PARITY_RECORD: kq_rows: no position given"),
        (
            "kq_heads= , ",
            "PARITY_RECORD: kq_heads: no head number given",
        ),
        (
            "kq_rows=1;kq_rows=2",
            "PARITY_RECORD: 'kq_rows' is given twice",
        ),
        (
            "taps=l_out;kq_heads=0-x",
            "PARITY_RECORD: kq_heads: '0-x' is not a head number or a range a-b",
        ),
        (
            "kq_rows=99999999999999999999999",
            "PARITY_RECORD: kq_rows: '99999999999999999999999' is not a position",
        ),
        ("kq_cols=3", "PARITY_RECORD: unknown part 'kq_cols'"),
        (&many, "PARITY_RECORD: kq_rows: more than 4096 items"),
    ] {
        let out = tmp.path().join("bad");
        let o = toy_to_plan(&toy, &out, Some(bad), None);
        assert!(!o.status.success(), "{bad}: {}", show(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{bad}: {err}");
        assert!(err.contains(says), "{bad}: {err}");
        assert!(!out.exists(), "{bad}");
    }
}

/// `parity diff` reads a trace whose `kq_soft_max` is cut: the clean toy's is at parity, and the
/// K/V ring of 13 slots, which first reads a wrong key at position 13, is found there, at
/// layer 0's `kq_soft_max`, when position 13 is among the rows kept.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn parity_diff_judges_a_c_trace_with_a_cut_kq_soft_max() {
    const PLAN: &str = "kq_heads=1-2;kq_rows=12-15,21";
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    let diff = |out: &Path| {
        let o = parity(&[
            "diff",
            "golden/tiny-llama-f32",
            out.to_str().unwrap(),
            "--json",
            "-",
        ]);
        let j: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&o)));
        (o.status.code(), j)
    };

    let clean = tmp.path().join("clean");
    let o = toy_to_plan(&toy, &clean, Some(PLAN), None);
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(
        read_npy(&clean.join("s000/kq_soft_max-0.npy")).0,
        vec![2, 4, 20]
    );
    let (code, j) = diff(&clean);
    assert_eq!(code, Some(0), "{j:#}");
    assert_eq!(j["verdict"], "parity", "{j:#}");

    let ring = tmp.path().join("ring");
    let o = toy_to_plan(&toy, &ring, Some(PLAN), Some("kv-ring-13"));
    assert!(o.status.success(), "{}", show(&o));
    let (code, j) = diff(&ring);
    assert_eq!(code, Some(1), "{j:#}");
    let d = &own_inputs(&j)["first_divergence"];
    assert_eq!(
        d["at"]["key"],
        serde_json::json!({"step": 0, "layer": 0, "tap": "kq_soft_max"}),
        "{d:#}"
    );
    assert_eq!(d["position"]["position"], 13, "{d:#}");
}

/// A plan's `layers` part narrows its full steps to those layers (the header does it; the toy
/// engine has no code for it): under `taps=l_out,logits;full=0;layers=1` step 0 keeps every
/// tap of layer 1, `l_out` of every layer and the graph-wide taps, the other steps `l_out` and
/// `logits` alone, each file the whole run's; the manifest keeps the plan as parity prints it.
/// `pt_wants_layer` answers the same rule, `pt_wants` whether a tap is kept at any layer.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_header_keeps_every_tap_of_the_plans_layers_at_its_full_steps() {
    const PLAN: &str = "taps=l_out,logits;full=0;layers=1";
    const GRAPH_WIDE: [&str; 5] = [
        "embd",
        "embd_scaled",
        "result_norm",
        "logits_uncapped",
        "logits",
    ];
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    let whole = tmp.path().join("whole");
    let o = toy_to_plan(&toy, &whole, None, None);
    assert!(o.status.success(), "{}", show(&o));
    let wm = manifest_of(&whole);
    let planned = tmp.path().join("planned");
    let o = toy_to_plan(&toy, &planned, Some(PLAN), None);
    assert!(o.status.success(), "{}", show(&o));
    let pm = manifest_of(&planned);
    assert_eq!(pm["record"], PLAN);

    let kept = |t: &serde_json::Value| -> bool {
        let tap = t["tap"].as_str().unwrap();
        if tap == "l_out" || tap == "logits" {
            return true;
        }
        t["step"] == 0 && (t["layer"].is_null() || t["layer"] == 1)
    };
    let wanted: Vec<serde_json::Value> = wm["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| kept(t))
        .cloned()
        .collect();
    // Every tap of layer 1 at step 0 (16) plus layer 0's l_out and the three graph-wide taps
    // the toy writes; l_out of both layers and logits at each of the four decode steps.
    assert_eq!(wanted.len(), 16 + 1 + 3 + 4 * 3);
    assert_eq!(
        pm["tensors"].as_array().unwrap(),
        &wanted,
        "the entries kept are the whole run's, in its order"
    );
    for t in &wanted {
        if t["layer"].is_null() {
            assert!(GRAPH_WIDE.contains(&t["tap"].as_str().unwrap()), "{t}");
        }
        let file = t["file"].as_str().unwrap();
        assert_eq!(
            read_npy(&planned.join(file)),
            read_npy(&whole.join(file)),
            "{file}"
        );
    }
    assert_eq!(npy_files(&planned).len(), wanted.len());

    // Printed as parity prints a plan: parts in order, the list merged.
    let canon = tmp.path().join("canon");
    let o = toy_to_plan(
        &toy,
        &canon,
        Some(" kq_rows=3 ; layers = 1-1, 0 ;full=0;taps=logits,l_out"),
        None,
    );
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(
        manifest_of(&canon)["record"],
        "taps=l_out,logits;full=0;layers=0-1;kq_rows=3"
    );

    // The header's own answers, before a step, at a full step and at another.
    let src = tmp.path().join("wants.c");
    std::fs::write(
        &src,
        r#"#define PARITY_TRACE_IMPLEMENTATION
#include "parity_trace.h"
#include <stdio.h>

int main(int argc, char **argv) {
    uint32_t ids[2] = {1, 2};
    size_t pos[3] = {0, 1, 2};
    pt_writer *w = pt_create(argc > 1 ? argv[1] : "t", NULL, NULL, "wants", "cpu");
    if (!w || pt_error(w) || pt_set_record(w, "taps=l_out,logits;full=0;layers=1")) return 1;
    printf("before %d%d\n", pt_wants(w, "q"), pt_wants_layer(w, "q", 0));
    if (pt_step(w, ids, pos, 2)) return 1;
    printf("full q:%d%d%d%d l_out:%d%d embd:%d%d nope:%d\n", pt_wants(w, "q"),
           pt_wants_layer(w, "q", -1), pt_wants_layer(w, "q", 0), pt_wants_layer(w, "q", 1),
           pt_wants_layer(w, "l_out", 0), pt_wants_layer(w, "l_out", 7), pt_wants(w, "embd"),
           pt_wants_layer(w, "embd", -1), pt_wants_layer(w, "nope", 0));
    if (pt_step(w, ids, pos + 2, 1)) return 1;
    printf("next q:%d%d%d l_out:%d%d embd:%d logits:%d\n", pt_wants(w, "q"),
           pt_wants_layer(w, "q", 0), pt_wants_layer(w, "q", 1), pt_wants(w, "l_out"),
           pt_wants_layer(w, "l_out", 0), pt_wants(w, "embd"), pt_wants_layer(w, "logits", -1));
    pt_abort(w);
    return 0;
}
"#,
    )
    .unwrap();
    let exe = build(tmp.path(), "cc", C99, src.to_str().unwrap(), "wants");
    let o = run(&exe, &[&tmp.path().join("wants-trace")]);
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(
        stdout(&o),
        "before 11\n\
         full q:1101 l_out:11 embd:11 nope:1\n\
         next q:000 l_out:11 embd:0 logits:1\n"
    );
    assert!(!tmp.path().join("wants-trace").exists());
}

/// A bad `layers` part stops the engine at pt_create with one line naming it, and nothing is
/// written.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_header_refuses_a_bad_layers_part_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    for (bad, says) in [
        (
            "taps=l_out;full=0;layers=x",
            "PARITY_RECORD: layers: 'x' is not a layer number or a range a-b",
        ),
        (
            "full=0;layers=5-2",
            "PARITY_RECORD: layers: the range 5-2 runs backwards",
        ),
        (
            "full=0;layers=",
            "PARITY_RECORD: layers: no layer number given",
        ),
        (
            "layers=1;layers=2",
            "PARITY_RECORD: 'layers' is given twice",
        ),
        (
            "layer=1",
            "PARITY_RECORD: unknown part 'layer' (taps=...;full=...;layers=...;",
        ),
    ] {
        let out = tmp.path().join("bad");
        let o = toy_to_plan(&toy, &out, Some(bad), None);
        assert!(!o.status.success(), "{bad}: {}", show(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{bad}: {err}");
        assert!(err.contains(says), "{bad}: {err}");
        assert!(!out.exists(), "{bad}");
    }
}

/// `parity diff` reads a trace zoomed to one layer: the clean toy's is at parity, and the
/// attention output added twice (in every layer) is found at step 0 in layer 0's `l_out`,
/// judged as a span of the ops the trace has no taps inside, and named there by experiment.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn parity_diff_judges_a_c_trace_zoomed_to_one_layer() {
    const PLAN: &str = "taps=l_out,logits;full=0;layers=1";
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    let diff = |out: &Path| {
        let o = parity(&[
            "diff",
            "golden/tiny-llama-f32",
            out.to_str().unwrap(),
            "--json",
            "-",
        ]);
        let j: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&o)));
        (o.status.code(), j)
    };

    let clean = tmp.path().join("clean");
    let o = toy_to_plan(&toy, &clean, Some(PLAN), None);
    assert!(o.status.success(), "{}", show(&o));
    let (code, j) = diff(&clean);
    assert_eq!(code, Some(0), "{j:#}");
    assert_eq!(j["verdict"], "parity", "{j:#}");

    let bug = tmp.path().join("bug");
    let o = toy_to_plan(&toy, &bug, Some(PLAN), Some("attn-out-twice"));
    assert!(o.status.success(), "{}", show(&o));
    let (code, j) = diff(&bug);
    assert_eq!(code, Some(1), "{j:#}");
    assert_eq!(j["verdict"], "diverged", "{j:#}");
    let d = &own_inputs(&j)["first_divergence"];
    assert_eq!(
        d["at"]["key"],
        serde_json::json!({"step": 0, "layer": 0, "tap": "l_out"}),
        "{d:#}"
    );
    let why = d["diagnosis"].as_str().unwrap();
    assert!(
        why.contains("confirmed by experiment: attn-out-twice reproduces your l_out"),
        "{why}"
    );
}

/// Values no catalog lists, planted as a hobby engine gets them wrong (eps 1e-3, RoPE base
/// 20000, scores divided by head_dim or not scaled): parity fits each and names it with its
/// value, at its op in a full dump and at layer 0's l_out span in a sparse one.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_engine_wrong_values_are_fitted_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    // (bug, its op in a full dump, the fitted hypothesis, words of its explanation)
    let cases = [
        (
            "rms-eps-1e-3",
            "attn_norm",
            "rms-eps=1e-3",
            "adds eps 1e-3; the model says 1e-5",
        ),
        (
            "rope-theta-20000",
            "q_rope",
            "rope-theta=20000",
            "frequency base is 20000; the model says 10000",
        ),
        (
            "attn-scale-inv-d",
            "kq_soft_max",
            "attn-scale=3.125e-2",
            "= 1/head_dim (32 where 1/sqrt(32) is meant)",
        ),
        (
            "no-attn-scale",
            "kq_soft_max",
            "attn-scale=1",
            "by 1 (no scaling at all)",
        ),
    ];
    for (bug, tap, name, words) in cases {
        let out = tmp.path().join(bug);
        engine_diff(&toy, &out, Some(bug));
        let sparse = tmp.path().join(format!("{bug}-sparse"));
        sparse_copy(&out, &sparse);
        for (trace, at) in [(&out, tap), (&sparse, "l_out")] {
            let o = parity(&[
                "diff",
                "golden/tiny-llama-f32",
                trace.to_str().unwrap(),
                "--json",
                "-",
            ]);
            let what = format!("{bug} {}", trace.display());
            assert_eq!(o.status.code(), Some(1), "{what}: {}", show(&o));
            let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            let own = own_inputs(&j);
            assert_at_layer0_named(own, at, &format!("{name} reproduces your "), &what);
            let why = own["first_divergence"]["diagnosis"].as_str().unwrap();
            assert!(why.contains(words), "{what}: {why}");
        }
    }
}

/// Constant factors no catalog lists (the embedding times sqrt(n_embd) as gemma's is, the FFN
/// output halved in every layer or in layer 0 alone, the logits divided by a temperature before
/// the dump): the own-error judgement fits each as an output scale, confirms it by replaying it
/// over the trace (which tells every layer from one), and names it with its value at its op;
/// the end-to-end comparison's hint reads the factor too.
/// A sparse dump shows none of these ops alone: there the span is placed, and no scale is
/// claimed.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_engine_constant_factors_are_fitted_as_output_scales() {
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    // (bug, its key in a full dump, the fitted hypothesis, words of its explanation, the
    // factor the end-to-end hint reads)
    let cases = [
        (
            "embd-scale-sqrt",
            serde_json::json!({"step": 0, "layer": null, "tap": "embd"}),
            "scale:embd=11.31",
            "times 11.31", // then " = sqrt(n_embd)": sqrt(128) in f32
            Some("times 11.31371"),
        ),
        (
            "ffn-out-half",
            serde_json::json!({"step": 0, "layer": 0, "tap": "ffn_out"}),
            "scale:ffn_out=0.5",
            "ffn_out is the right value times 0.5 wherever it runs",
            // End to end the halved FFN reads as drift grown to the logits, not as a factor.
            None,
        ),
        (
            "ffn-out-half-l0",
            serde_json::json!({"step": 0, "layer": 0, "tap": "ffn_out"}),
            "scale:ffn_out@0=0.5",
            "ffn_out of layer 0 is the right value times 0.5, in that layer only",
            None,
        ),
        (
            "logits-temp",
            serde_json::json!({"step": 0, "layer": null, "tap": "logits"}),
            "scale:logits=1.25",
            "temperature applied to the logits before they were dumped (T = 0.8)",
            Some("times 1.25000"),
        ),
    ];
    for (bug, key, name, words, factor) in cases {
        let out = tmp.path().join(bug);
        let (code, j) = engine_diff(&toy, &out, Some(bug));
        assert_eq!(code, Some(1), "{bug}: {j:#}");
        let own = own_inputs(&j);
        let d = &own["first_divergence"];
        assert_eq!(d["at"]["key"], key, "{bug}: {d:#}");
        let why = d["diagnosis"].as_str().unwrap();
        assert!(
            why.contains(&format!("confirmed by experiment: {name}")),
            "{bug}: {why}"
        );
        assert!(why.contains(words), "{bug}: {why}");
        if bug == "embd-scale-sqrt" {
            assert!(
                why.contains(" = sqrt(n_embd) wherever it runs"),
                "{bug}: {why}"
            );
        } else {
            // The value as written, not an f32 neighbour of it (x / 0.8 is not x * 1.25).
            assert!(
                why.contains(&format!("{name} reproduces your")),
                "{bug}: {why}"
            );
        }
        assert!(!why.contains("also reproduces"), "{bug}: {why}");
        // The factor in every layer is told from the factor in layer 0 alone by layer 1.
        if bug == "ffn-out-half" {
            assert!(!why.contains("@0"), "{bug}: {why}");
        }
        if bug == "ffn-out-half-l0" {
            assert!(
                why.contains("not the cause: scale:ffn_out=0.5 (at step 0 layer 1 ffn_out"),
                "{bug}: {why}"
            );
        }
        let e2e = j["comparisons"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["pair"] != "own-inputs")
            .unwrap();
        let hint = e2e["first_divergence"]["diagnosis"].as_str().unwrap();
        match factor {
            Some(f) => {
                assert_eq!(e2e["first_divergence"]["at"]["key"], key, "{bug}: {e2e:#}");
                assert!(
                    hint.contains(&format!("is the baseline's {f} throughout")),
                    "{bug}: {hint}"
                );
            }
            None => assert!(!hint.contains("baseline's times"), "{bug}: {hint}"),
        }
        // A sparse dump: ffn_out is inside layer 0's span, the embedding and logits are still
        // taps of their own.
        let sparse = tmp.path().join(format!("{bug}-sparse"));
        sparse_copy(&out, &sparse);
        let o = parity(&[
            "diff",
            "golden/tiny-llama-f32",
            sparse.to_str().unwrap(),
            "--json",
            "-",
        ]);
        assert_eq!(o.status.code(), Some(1), "{bug} sparse: {}", show(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let d = &own_inputs(&j)["first_divergence"];
        let why = d["diagnosis"].as_str().unwrap();
        if bug.starts_with("ffn-out-half") {
            assert_eq!(
                d["at"]["key"],
                serde_json::json!({"step": 0, "layer": 0, "tap": "l_out"}),
                "{bug} sparse: {d:#}"
            );
            assert!(!why.contains("scale:"), "{bug} sparse: {why}");
        } else {
            assert_eq!(d["at"]["key"], key, "{bug} sparse: {d:#}");
            assert!(
                why.contains(&format!("confirmed by experiment: {name}")),
                "{bug} sparse: {why}"
            );
        }
    }
}

#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_header_refuses_bad_taps_and_writes_what_parity_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = checks(tmp.path());
    let out = tmp.path().join("checks");
    let o = run(&exe, &[Path::new("checks"), &out]);
    assert!(o.status.success(), "{}", show(&o));
    let s = stdout(&o);
    let refused: Vec<&str> = s
        .lines()
        .filter_map(|l| l.strip_prefix("refused: "))
        .collect();
    let expected = [
        "sha256 'xyz' is not 64 hex digits",
        "cannot hash the model /nonexistent/model.gguf",
        "/: name the trace folder itself",
        "tap 'l_out' before the first pt_step() call",
        "step 0: 0 tokens",
        "step 0 has position 1 at index 0, expected 0",
        "unknown tap 'qq'",
        "tap 'embd' cannot have a layer",
        "tap 'q' needs a layer",
        "tap 'q': layer -2 is not a layer index",
        "step 0 layer 0 l_out: 0 axes",
        "step 0 layer 0 l_out: 9 axes",
        "step 0 layer 0 l_out: shape [2, 0] has an empty axis",
        "step 0 layer 0 l_out: shape [2, 9223372036854775807] holds more than 8589934592 values",
        "step 0 layer 0 l_out: shape [3, 4] should have the step's 2 tokens on axis 0",
        "step 0 layer 0 kq_soft_max: shape [1, 3, 2] should have the step's 2 tokens on axis 1",
        "step 0 layer 0 l_out: shape or data is NULL",
        "step 0 layer 0 l_out recorded twice",
        "settings are not one JSON object (byte 6: expected a value)",
        "settings are not one JSON object (byte 0: not an object)",
        "settings are not one JSON object (byte 3: text after it)",
        "step 1 has position 5 at index 0, expected 2",
        "step 1 layer 0 l_out recorded twice",
    ];
    assert_eq!(refused.len(), expected.len(), "{s}");
    for (got, want) in refused.iter().zip(expected) {
        assert!(got.contains(want), "refused: {got}\nexpected: {want}\n{s}");
    }
    assert!(s.contains("finished: 23 refused"), "{s}");
    // What was accepted is a trace parity reads: the refused taps left nothing behind, the
    // producer strings are escaped (a byte that is not UTF-8 becomes U+FFFD).
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["producer"]["name"], "eng\"ine\\\n\u{fffd}\u{e9}");
    assert_eq!(m["producer"]["backend"], "cpu\t1");
    assert_eq!(m["producer"]["settings"]["k"][1]["x"], "\"}");
    assert_eq!(
        npy_files(&out),
        [
            "s000/embd.npy",
            "s000/kq_soft_max-0.npy",
            "s000/l_out-0.npy",
            "s001/l_out-0.npy"
        ]
    );
    let t: Vec<(&str, &serde_json::Value)> = m["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["file"].as_str().unwrap(), &t["layer"]))
        .collect();
    assert_eq!(t[0], ("s000/embd.npy", &serde_json::Value::Null));
    let o = parity(&[
        "diff",
        out.to_str().unwrap(),
        out.to_str().unwrap(),
        "--weight-type",
        "f32",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));

    // The header as C++11, implementation included: builds warning-free and writes a trace.
    let cxx = build(
        tmp.path(),
        "c++",
        &[
            "-std=c++11",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
        ],
        "tests/engines/c/cxx_check.cpp",
        "cxx_check",
    );
    let out = tmp.path().join("cxx");
    let o = run(&cxx, &[&out]);
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        stdout(&o).contains("refused: tap 'embd' cannot have a layer"),
        "{}",
        show(&o)
    );
    let (shape, data) = read_npy(&out.join("s000/embd.npy"));
    assert_eq!(shape, vec![2, 4]);
    assert_eq!(data, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]);
}

#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_header_replaces_only_a_trace_and_never_writes_through_a_link() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = checks(tmp.path());
    let write = |dir: &Path| run(&exe, &[Path::new("write"), dir]);

    // Over a previous trace: manifest.json and the sNNN folders are replaced (a stale s007
    // goes), other files stay.
    let t = tmp.path().join("t");
    std::fs::create_dir_all(t.join("s007")).unwrap();
    std::fs::write(t.join("s007/old.npy"), b"old").unwrap();
    std::fs::write(t.join("manifest.json"), b"{}").unwrap();
    std::fs::write(t.join("notes.txt"), b"mine").unwrap();
    let o = write(&t);
    assert!(o.status.success(), "{}", show(&o));
    assert!(!t.join("s007").exists());
    assert_eq!(std::fs::read(t.join("notes.txt")).unwrap(), b"mine");
    assert_eq!(
        npy_files(&t),
        [
            "s000/embd.npy",
            "s000/kq_soft_max-0.npy",
            "s000/l_out-0.npy",
            "s001/embd.npy",
            "s001/l_out-0.npy"
        ]
    );
    let (_, data) = read_npy(&t.join("s001/l_out-0.npy"));
    assert_eq!(data, [5.0, 6.0, -7.0, 8.0]);
    // No staging folder is left beside it; a stale one of a process that is gone is removed.
    let stale = tmp.path().join(".t.partial-999999999");
    std::fs::create_dir(&stale).unwrap();
    assert!(write(&t).status.success());
    assert!(!stale.exists());
    let names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.contains(".partial-")), "{names:?}");

    // A link is never written through; a folder with sNNN entries but no manifest, or a
    // step entry that is not a folder, is not replaced.
    let real = tmp.path().join("real");
    std::fs::create_dir(&real).unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir_all(foreign.join("s001")).unwrap();
    std::fs::write(t.join("s009"), b"").unwrap();
    for (dir, why) in [
        (
            &link,
            "is a symbolic link: parity never writes through a link",
        ),
        (
            &foreign,
            "s001: not a trace's step folder (the folder has no manifest.json)",
        ),
        (&t, "s009: not a trace's step folder (not a folder)"),
    ] {
        let o = write(dir);
        assert_eq!(o.status.code(), Some(1), "{}", show(&o));
        assert!(stdout(&o).contains(why), "{}", show(&o));
    }
    assert_eq!(std::fs::read_dir(&real).unwrap().count(), 0);
    assert!(!foreign.join("manifest.json").exists());

    // The big-endian path (forced on this host): the floats are byte-swapped as written.
    let be = build(
        tmp.path(),
        "cc",
        &[
            "-std=c99",
            "-Wall",
            "-Werror",
            "-DPARITY_TRACE_TEST_BIG_ENDIAN",
        ],
        "tests/engines/c/trace_checks.c",
        "trace_checks_be",
    );
    let out = tmp.path().join("be");
    let o = run(&be, &[Path::new("write"), &out]);
    assert!(o.status.success(), "{}", show(&o));
    let bytes = std::fs::read(out.join("s000/embd.npy")).unwrap();
    let data: Vec<f32> = bytes[128..]
        .chunks(4)
        .map(|c| f32::from_be_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(data, [1.0, -2.0, 3.5, 0.25, 5.0, 6.0, -7.0, 8.0]);
}

#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_sha256_matches_sha256sum() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = checks(tmp.path());
    // Lengths around SHA-256's 64-byte blocks and its 56-byte padding boundary, one over the
    // header's 64 KiB read, and the fixture.
    let mut files = vec![root().join("fixtures/tiny-llama-f32.gguf")];
    for n in [0usize, 1, 55, 56, 63, 64, 65, 119, 120, 1000, 65536 + 7] {
        let p = tmp.path().join(format!("f{n}"));
        std::fs::write(&p, (0..n).map(|i| (i * 7 + 3) as u8).collect::<Vec<u8>>()).unwrap();
        files.push(p);
    }
    let mut c = Command::new(&exe);
    c.arg("sha").args(&files);
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", show(&o));
    let ours: Vec<String> = stdout(&o).lines().map(|l| l.to_string()).collect();
    // The golden records the fixture's sha256 (llama_golden.py, Python's hashlib).
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("golden/tiny-llama-f32/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        ours[0],
        format!("{} 1595168", g["model"]["sha256"].as_str().unwrap())
    );
    assert!(
        ours[1].starts_with("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855 0")
    );
    let Ok(o) = Command::new("sha256sum").args(&files).output() else {
        eprintln!("skipped the sha256sum comparison: no sha256sum on PATH");
        return;
    };
    assert!(o.status.success(), "{}", show(&o));
    let theirs: Vec<String> = stdout(&o)
        .lines()
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect();
    assert_eq!(theirs.len(), files.len());
    for ((a, b), f) in ours.iter().zip(&theirs).zip(&files) {
        assert!(
            a.starts_with(b.as_str()),
            "{}: {a} vs sha256sum {b}",
            f.display()
        );
        let size = std::fs::metadata(f).unwrap().len();
        assert!(a.ends_with(&format!(" {size}")), "{a}");
    }
}

#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn c_golden_ids_reader_refuses_malformed_manifests_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = checks(tmp.path());
    let ids = |text: &[u8]| {
        let d = tempfile::tempdir_in(tmp.path()).unwrap();
        std::fs::write(d.path().join("manifest.json"), text).unwrap();
        let o = run(&exe, &[Path::new("ids"), d.path()]);
        // A clean refusal is exit 1 with a message; a crash would be a signal (no code).
        assert!(matches!(o.status.code(), Some(0 | 1)), "{}", show(&o));
        stdout(&o)
    };

    // The golden's ids, as serde_json reads them.
    let golden = root().join("golden/tiny-llama-f32");
    let text = std::fs::read(golden.join("manifest.json")).unwrap();
    let m: serde_json::Value = serde_json::from_slice(&text).unwrap();
    let want: String = m["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let j = |k: &str| {
                s[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            format!("{};{}\n", j("tokens"), j("positions"))
        })
        .collect();
    assert_eq!(ids(&text), want);
    assert_eq!(want.lines().count(), 5);

    let deep = format!(
        r#"{{"format": "parity-trace", "x": {}{}, "steps": []}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let deep_step = format!(
        r#"{{"format": "parity-trace", "steps": [{{"tokens": [1], "positions": [0], "x": {}1{}}}]}}"#,
        "{\"a\": ".repeat(200),
        "}".repeat(200)
    );
    let ok = r#"{"format": "parity-trace", "producer": {"name": "a\"}]\\", "n": [1, {"x": null}, -1.5e-3, true]},
                 "steps": [{"step": 0, "tok\u0065ns": [5, 6], "positions": [0, 1], "forced": true},
                           {"step": 1, "tokens": [4294967295], "positions": [2]}]}"#;
    assert_eq!(ids(ok.as_bytes()), "5,6;0,1\n4294967295;2\n");
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (text[..text.len() / 2].to_vec(), "manifest.json: byte"),
        (text[..20].to_vec(), "byte 20: unexpected end (truncated?)"),
        (text[..40].to_vec(), "byte 40: unexpected end (truncated?)"),
        (Vec::new(), "manifest.json: empty"),
        (b"[1]".to_vec(), "byte 0: not a JSON object"),
        (deep.into_bytes(), "nested deeper than 128 levels"),
        (deep_step.into_bytes(), "nested deeper than 128 levels"),
        (
            br#"{"format": "parity-trace", "steps": [{"tokens": [99999999999999999999999], "positions": [0]}]}"#.to_vec(),
            "number too large (4294967295 at most)",
        ),
        (
            br#"{"format": "parity-trace", "steps": [{"tokens": [4294967296], "positions": [0]}]}"#.to_vec(),
            "number too large (4294967295 at most)",
        ),
        (
            br#"{"format": "parity-trace", "steps": [{"tokens": [1], "positions": [16777217]}]}"#.to_vec(),
            "number too large (16777216 at most)",
        ),
        (
            br#"{"format": "parity-trace", "steps": [{"tokens": [-1], "positions": [0]}]}"#.to_vec(),
            "expected a non-negative integer",
        ),
        (
            br#"{"format": "parity-trace", "steps": [{"tokens": [1.5], "positions": [0]}]}"#.to_vec(),
            "expected a non-negative integer",
        ),
        (
            br#"{"format": "parity-trace", "steps": [{"tokens": [1, 2], "positions": [0]}]}"#.to_vec(),
            "step 0 has 2 tokens and 1 positions",
        ),
        (
            br#"{"format": "parity-trace", "steps": [{"tokens": [1], "positions": [0]}, {"tokens": [2], "positions": [5]}]}"#.to_vec(),
            "step 1 has position 5 at index 0, expected 1",
        ),
        (
            br#"{"format": "parity-trace", "steps": [{"step": 3, "tokens": [1], "positions": [0]}]}"#.to_vec(),
            "steps[0] is step 3",
        ),
        (
            br#"{"format": "parity-trace", "steps": [{"tokens": [1], "tokens": [1], "positions": [0]}]}"#.to_vec(),
            "duplicate key 'tokens'",
        ),
        (
            br#"{"steps": [{"tokens": [1], "positions": [0]}]}"#.to_vec(),
            "not a parity trace",
        ),
        (
            br#"{"format": "parity-trace", "steps": []}"#.to_vec(),
            "no steps",
        ),
        (
            br#"{"format": "parity-trace", "steps": [{"tokens": [1], "positions": [0]}]} x"#.to_vec(),
            "text after the manifest's object",
        ),
        (
            br#"{"format": "parity-trace", "x": "a\qb", "steps": []}"#.to_vec(),
            "bad escape in a string",
        ),
        (
            b"{\"format\": \"parity-trace\", \"x\": \"a\x01\", \"steps\": []}".to_vec(),
            "control character in a string",
        ),
        (
            br#"{"format": "parity-trace", "x": [1,, 2], "steps": []}"#.to_vec(),
            "expected a value",
        ),
    ];
    for (text, why) in cases {
        let s = ids(&text);
        assert!(
            s.starts_with("error: ") && s.contains(why),
            "{why}: {s}\n{}",
            String::from_utf8_lossy(&text[..text.len().min(200)])
        );
    }
    // Not a regular file: refused, never waited on.
    let d = tmp.path().join("fifo");
    std::fs::create_dir(&d).unwrap();
    if Command::new("mkfifo")
        .arg(d.join("manifest.json"))
        .status()
        .is_ok_and(|s| s.success())
    {
        let o = run(&exe, &[Path::new("ids"), &d]);
        assert!(stdout(&o).contains("not a regular file"), "{}", show(&o));
    }
    let o = run(&exe, &[Path::new("ids"), &tmp.path().join("absent")]);
    assert!(stdout(&o).contains("No such file"), "{}", show(&o));

    // Every prefix of a manifest with every kind of value, and the manifest with each byte
    // replaced by a JSON-significant one, parsed in one process: each ends with the steps or
    // a message, every prefix is refused; under AddressSanitizer and UBSan where the compiler
    // has them (an overread or overflow then aborts the run).
    let small = r#"{"format": "parity-trace", "version": 1,
 "model": {"path": "m\u00e9.gguf", "sha256": "", "size": 12},
 "producer": {"name": "a\"}]\\", "settings": {"n": [1, -2.5e+3, 0.0, true, false, null, {"x": [[]]}, "\/\b\f\n\r\t"]}},
 "steps": [{"step": 0, "tokens": [1, 2, 3], "positions": [0, 1, 2], "forced": false},
           {"step": 1, "tokens": [4294967295], "positions": [3]}],
 "tensors": [{"step": 0, "tap": "embd", "layer": null, "file": "s000/embd.npy", "shape": [3, 8], "dtype": "<f4"}]}
"#;
    let f = tmp.path().join("small.json");
    std::fs::write(&f, small).unwrap();
    let san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"];
    let with_sanitizers = Command::new("cc")
        .args(["-std=c99", "-O1", "-g"])
        .args(san)
        .arg("-I")
        .arg(root().join("bindings/c"))
        .arg(root().join("tests/engines/c/trace_checks.c"))
        .arg("-o")
        .arg(tmp.path().join("fuzz"))
        .output()
        .is_ok_and(|o| o.status.success());
    let fuzz = if with_sanitizers {
        tmp.path().join("fuzz")
    } else {
        eprintln!("cc has no AddressSanitizer here: the fuzz runs without it");
        exe.clone()
    };
    let o = run(&fuzz, &[Path::new("fuzz"), &f]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let s = stdout(&o);
    assert!(s.contains("accepted 0\n"), "{s}");
    assert!(s.contains("mutations: "), "{s}");
}

/// docs/instrument.md shows what the C engine with a planted rms eps and `parity diff` print.
#[test]
#[cfg_attr(
    not(parity_cc),
    ignore = "needs a C compiler and a C++ compiler as `cc` and `c++` (then touch build.rs)"
)]
fn the_docs_show_what_the_c_engine_prints() {
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    let out = tmp.path().join("trace");
    let o = Command::new(&toy)
        .arg(root().join("fixtures/tiny-llama-f32.gguf"))
        .arg(root().join("golden/tiny-llama-f32"))
        .arg(&out)
        .args(["--bug", "rms-eps-10x"])
        .output()
        .unwrap();
    let d = parity(&["diff", "golden/tiny-llama-f32", out.to_str().unwrap()]);
    let printed = (show(&o) + &show(&d)).replace(out.to_str().unwrap(), "trace");
    assert_shown(
        "docs/instrument.md",
        "tests/kit_c.rs: rms-eps-10x",
        &printed,
    );
}

/// A softmax that does not subtract its row's max, in the C engine on a model whose scores
/// pass exp's f32 overflow (`fixture --type f32 --qk-gain 8`: q·k/√d up to ~200): the clean
/// engine passes there, and the bug's NaN is placed at layer 0's kq_soft_max and named by
/// experiment (the same non-finite values at the same places). (Sparse dumps of it:
/// tests/selftest.rs, through the numpy engine.)
#[test]
#[cfg_attr(
    not(all(parity_cc, parity_llama_cpp)),
    ignore = "needs a C compiler and llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn c_engine_softmax_without_its_max_is_named_where_scores_overflow() {
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let toy = toy(tmp.path());
    let m = tmp.path().join("hot.gguf");
    let g = tmp.path().join("golden");
    let (ms, gs) = (m.to_str().unwrap(), g.to_str().unwrap());
    let o = parity(&["fixture", "--type", "f32", "--qk-gain", "8", "--out", ms]);
    assert!(o.status.success(), "{}", show(&o));
    let o = parity(&[
        "golden",
        ms,
        "--prompt",
        "Once upon a time there was a little girl named Lily",
        "--steps",
        "4",
        "--out",
        gs,
    ]);
    assert!(o.status.success(), "{}", show(&o));
    for bug in [None, Some("softmax-no-max")] {
        let out = tmp.path().join(bug.unwrap_or("clean"));
        let mut c = Command::new(&toy);
        c.arg(&m).arg(&g).arg(&out);
        if let Some(b) = bug {
            c.args(["--bug", b]);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{bug:?}: {}", show(&o));
        let o = parity(&["diff", gs, out.to_str().unwrap(), "--json", "-"]);
        let j: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&o)));
        let Some(_) = bug else {
            assert_eq!(o.status.code(), Some(0), "clean: {j:#}");
            continue;
        };
        assert_eq!(o.status.code(), Some(1), "{j:#}");
        let d = &own_inputs(&j)["first_divergence"];
        assert_eq!(
            d["at"]["key"],
            serde_json::json!({"step": 0, "layer": 0, "tap": "kq_soft_max"}),
            "{d:#}"
        );
        let why = d["diagnosis"].as_str().unwrap();
        assert!(
            why.contains("confirmed by experiment: softmax-no-max reproduces it (the same non-finite values at the same places"),
            "{why}"
        );
    }
}
