//! `kq_soft_max` kept for some heads or rows (issue 29 item 2): a plan's `kq_heads` and
//! `kq_rows` cut the one tap that grows with the square of the length, every producer writes
//! what it kept in the manifest, and every comparison reads the values both sides hold. A long
//! step's zoom keeps the rows from the first position out on, and there the bug is named.

use crate::common::*;
use std::path::{Path, PathBuf};

const MODEL: &str = "fixtures/tiny-llama-q8_0.gguf";

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn manifest(trace: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(trace.join("manifest.json")).unwrap()).unwrap()
}

/// The cut kq_soft_max entries of `trace`: (step, layer, shape, heads, rows).
fn probs(
    trace: &Path,
) -> Vec<(
    u64,
    u64,
    serde_json::Value,
    serde_json::Value,
    serde_json::Value,
)> {
    manifest(trace)["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["tap"] == "kq_soft_max")
        .map(|t| {
            (
                t["step"].as_u64().unwrap(),
                t["layer"].as_u64().unwrap(),
                t["shape"].clone(),
                t["heads"].clone(),
                t["rows"].clone(),
            )
        })
        .collect()
}

/// `parity dump` of the fixture model to `out`: fed `golden`'s ids, or `tokens` (2 decode
/// steps) when no golden is given.
fn dump(out: &Path, golden: Option<&Path>, extra: &[&str]) {
    let mut args = vec!["dump", MODEL, "--out", path(out), "--emulate", "ggml-cpu"];
    let ids = long_prompt();
    match golden {
        Some(g) => args.extend(["--golden", path(g)]),
        None => args.extend(["--tokens", &ids, "--steps", "2"]),
    }
    args.extend(extra);
    let o = parity(&args);
    assert!(o.status.success(), "{args:?}: {}", show(&o));
}

/// 100 prompt ids (a step longer than a zoom keeps whole).
fn long_prompt() -> String {
    (0..100)
        .map(|i| (1 + (i * 37) % 250).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn diffed(golden: &Path, trace: &Path) -> (Option<i32>, serde_json::Value) {
    let o = parity(&["diff", path(golden), path(trace), "--json", "-"]);
    let j: serde_json::Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", show(&o)));
    (o.status.code(), j)
}

/// A 100-token golden of the fixture (parity's own ggml-cpu dump: every tap).
fn golden(dir: &Path) -> PathBuf {
    let g = dir.join("golden");
    dump(&g, None, &[]);
    g
}

/// A scan of a 100-token prompt with a ring buffer wrapping at 70 asks for step 0 with the
/// probabilities' rows 70–85 alone; the zoom recorded to it holds 16 of 100 rows and names the
/// ring at its op and position, as a whole dump does.
#[test]
fn a_long_step_s_zoom_keeps_the_rows_from_its_first_position_and_names_the_bug_there() {
    let tmp = tempfile::tempdir().unwrap();
    let g = golden(tmp.path());
    let scan = tmp.path().join("scan");
    dump(
        &scan,
        Some(&g),
        &[
            "--mutate",
            "kv-ring-wrap=70",
            "--record",
            "taps=l_out,result_norm,logits",
        ],
    );
    let (code, j) = diffed(&g, &scan);
    assert_eq!(code, Some(1), "{j:#}");
    let d = &own_inputs(&j)["first_divergence"];
    assert_eq!(d["position"]["position"], 70, "{d:#}");
    let plan = d["zoom"]["record"].as_str().unwrap().to_string();
    assert_eq!(
        plan, "taps=l_out,result_norm,logits;full=0;layers=0;kq_rows=70-85",
        "{d:#}"
    );
    assert!(
        d["diagnosis"]
            .as_str()
            .unwrap()
            .contains("record step 0 whole (layer 0 alone; kq_soft_max for positions 70-85 only)"),
        "{d:#}"
    );

    let zoom = tmp.path().join("zoom");
    dump(
        &zoom,
        Some(&g),
        &["--mutate", "kv-ring-wrap=70", "--record", &plan],
    );
    let cut = probs(&zoom);
    assert_eq!(cut.len(), 1, "layer 0 of step 0 alone: {cut:?}");
    let rows: Vec<u64> = (70..86).collect();
    for (step, _, shape, heads, r) in &cut {
        assert_eq!(*step, 0);
        assert_eq!(shape[1], 16, "{shape}");
        assert_eq!(shape[2], 100, "every key: {shape}");
        assert!(heads.is_null());
        assert_eq!(*r, serde_json::json!(rows));
    }
    let (code, j) = diffed(&g, &zoom);
    assert_eq!(code, Some(1), "{j:#}");
    let d = &own_inputs(&j)["first_divergence"];
    assert_eq!(
        d["at"]["key"],
        serde_json::json!({"step": 0, "layer": 0, "tap": "kq_soft_max"}),
        "{d:#}"
    );
    assert_eq!(d["position"]["position"], 70, "{d:#}");
    let text = d["diagnosis"].as_str().unwrap();
    assert!(
        text.contains("confirmed by experiment: kv-ring-wrap reproduces your kq_soft_max"),
        "{text}"
    );
    assert!(text.contains("a ring buffer of 70 slots"), "{text}");
    assert!(
        d.get("zoom").is_none_or(|z| z.is_null()),
        "asked again: {d:#}"
    );

    // The ring in layer 1 alone: the scan flags layer 1's l_out, and the zoom keeps that
    // layer whole (the others' l_out as scanned), its probabilities from the scan's position.
    let bug = ["--mutate", "kv-ring-wrap=70", "--mutate-from-layer", "1"];
    let scan = tmp.path().join("scan1");
    dump(
        &scan,
        Some(&g),
        &[&bug[..], &["--record", "taps=l_out,result_norm,logits"]].concat(),
    );
    let (code, j) = diffed(&g, &scan);
    assert_eq!(code, Some(1), "{j:#}");
    let d = &own_inputs(&j)["first_divergence"];
    assert_eq!(d["at"]["key"]["layer"], 1, "{d:#}");
    // (Rows 70 and 71 of layer 1's output move by less than its floor: 72 first shows.)
    let p = d["position"]["position"].as_u64().unwrap();
    assert!((70..=72).contains(&p), "{d:#}");
    let plan = d["zoom"]["record"].as_str().unwrap().to_string();
    assert_eq!(
        plan,
        format!(
            "taps=l_out,result_norm,logits;full=0;layers=1;kq_rows={p}-{}",
            p + 15
        )
    );
    let zoom = tmp.path().join("zoom1");
    dump(&zoom, Some(&g), &[&bug[..], &["--record", &plan]].concat());
    let m = manifest(&zoom);
    for t in m["tensors"].as_array().unwrap() {
        let (tap, layer) = (t["tap"].as_str().unwrap(), &t["layer"]);
        let scanned = ["l_out", "result_norm", "logits"].contains(&tap);
        assert!(
            scanned || (t["step"] == 0 && (layer.is_null() || *layer == 1)),
            "kept outside layer 1 of step 0: {t}"
        );
    }
    let (code, j) = diffed(&g, &zoom);
    assert_eq!(code, Some(1), "{j:#}");
    let d = &own_inputs(&j)["first_divergence"];
    assert_eq!(
        d["at"]["key"],
        serde_json::json!({"step": 0, "layer": 1, "tap": "kq_soft_max"}),
        "{d:#}"
    );
    // Rows before the kept ones read through the attention output after them.
    assert_eq!(d["position"]["position"], 70, "{d:#}");
    assert!(
        d["diagnosis"]
            .as_str()
            .unwrap()
            .contains("confirmed by experiment: kv-ring-wrap reproduces your kq_soft_max"),
        "{d:#}"
    );
}

/// Clean dumps cut every way (heads alone, rows alone, both, rows no step holds) pass; bugs
/// acting inside the kept rows are placed at kq_soft_max and named; where the rows that show a
/// bug were left out, the attention output after them shows it (a span of two ops, the
/// probabilities not claimed to match where they were not recorded) and names its position.
#[test]
fn cut_probabilities_pass_clean_and_place_bugs_at_their_first_position() {
    let tmp = tempfile::tempdir().unwrap();
    let g = golden(tmp.path());
    for (i, plan) in [
        "kq_heads=1",
        "kq_rows=30-33,99",
        "kq_heads=0,3;kq_rows=0,50-60",
        "taps=l_out,kq_soft_max,logits;kq_rows=100-101",
        "kq_rows=5000",
    ]
    .iter()
    .enumerate()
    {
        let t = tmp.path().join(format!("clean{i}"));
        dump(&t, Some(&g), &["--record", plan]);
        let (code, j) = diffed(&g, &t);
        assert_eq!(code, Some(0), "{plan}: {j:#}");
        assert!(manifest(&t)["record"].is_string(), "{plan}");
    }
    // Rows 100 and 101 are the two decode steps: one row each, every head.
    let t = tmp.path().join("clean3");
    let cut = probs(&t);
    assert_eq!(cut.len(), 4, "{cut:?}");
    assert!(
        cut.iter()
            .all(|(s, _, _, _, r)| *s >= 1 && r.as_array().unwrap().len() == 1)
    );
    assert!(probs(&tmp.path().join("clean4")).is_empty());

    // (bug, plan, the key's tap, its position, named)
    for (bug, plan, tap, pos, named) in [
        (
            "kv-ring-wrap=70",
            "kq_rows=60-80",
            "kq_soft_max",
            70,
            "kv-ring-wrap",
        ),
        (
            "causal-mask-off-by-one",
            "kq_heads=2;kq_rows=40-41",
            "kq_soft_max",
            0,
            "causal-mask-off-by-one",
        ),
        // 4 heads over 2 K/V heads: head 1 reads K/V head 1 instead of 0; head 3 reads
        // its own either way, and the bug shows after it.
        ("gqa-modulo", "kq_heads=1", "kq_soft_max", 0, "gqa-modulo"),
        ("gqa-modulo", "kq_heads=3", "kqv_out", 0, "gqa-modulo"),
        (
            "kv-ring-wrap=70",
            "kq_rows=0-10",
            "kqv_out",
            70,
            "kv-ring-wrap",
        ),
    ] {
        let t = tmp.path().join("bug");
        let _ = std::fs::remove_dir_all(&t);
        dump(&t, Some(&g), &["--mutate", bug, "--record", plan]);
        let (code, j) = diffed(&g, &t);
        assert_eq!(code, Some(1), "{bug} {plan}: {j:#}");
        let d = &own_inputs(&j)["first_divergence"];
        assert_eq!(d["at"]["key"]["tap"], tap, "{bug} {plan}: {d:#}");
        assert_eq!(d["at"]["key"]["step"], 0, "{bug} {plan}: {d:#}");
        assert_eq!(d["position"]["position"], pos, "{bug} {plan}: {d:#}");
        let text = d["diagnosis"].as_str().unwrap();
        assert!(
            text.contains(&format!("confirmed by experiment: {named}")),
            "{bug} {plan}: {text}"
        );
    }
}

/// A golden cut one way and a trace cut another meet on what both kept: `diff` and `check`
/// compare those values, and a divergence there is still found.
#[test]
fn a_cut_golden_and_a_cut_trace_are_compared_on_what_both_keep() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = golden(tmp.path());
    let g = tmp.path().join("g-cut");
    dump(
        &g,
        Some(&whole),
        &["--record", "kq_heads=0-2;kq_rows=20-60"],
    );
    let t = tmp.path().join("t-cut");
    dump(
        &t,
        Some(&whole),
        &["--record", "kq_heads=2-3;kq_rows=50-99"],
    );
    let (code, j) = diffed(&g, &t);
    assert_eq!(code, Some(0), "{j:#}");
    let o = parity(&["check", MODEL, "--golden", path(&g)]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));

    let bad = tmp.path().join("t-bad");
    dump(
        &bad,
        Some(&whole),
        &[
            "--mutate",
            "kv-ring-wrap=55",
            "--record",
            "kq_heads=2-3;kq_rows=50-99",
        ],
    );
    let (code, j) = diffed(&g, &bad);
    assert_eq!(code, Some(1), "{j:#}");
    let d = &own_inputs(&j)["first_divergence"];
    assert_eq!(d["at"]["key"]["tap"], "kq_soft_max", "{d:#}");
    assert_eq!(d["position"]["position"], 55, "{d:#}");
}

/// The size estimate counts what a cut keeps: a 100-token dump of the probabilities over a
/// budget whole fits it cut to 16 rows, and the refusal names the flag.
#[test]
fn the_size_estimate_counts_the_cut() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = long_prompt();
    // Whole: 2 layers x 4 heads x 100 x 100 x 4 bytes = 320 kB; 16 rows: 51 kB.
    let run = |out: &str, plan: &str| {
        let out = tmp.path().join(out);
        parity(&[
            "dump",
            MODEL,
            "--tokens",
            &ids,
            "--steps",
            "0",
            "--out",
            path(&out),
            "--max-trace-size",
            "200k",
            "--record",
            plan,
        ])
    };
    let o = run("whole", "taps=kq_soft_max");
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let e = String::from_utf8_lossy(&o.stderr);
    let e = e
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default();
    assert!(
        e.contains("over the budget of 200 kB: raise it with --max-trace-size")
            && e.contains("or keep kq_soft_max for some rows or heads alone"),
        "{e}"
    );
    let o = run("cut", "taps=kq_soft_max;kq_rows=70-85");
    assert!(o.status.success(), "{}", show(&o));
    let cut = probs(&tmp.path().join("cut"));
    assert_eq!(cut.len(), 2, "{cut:?}");
}

/// A manifest that lists a cut it does not hold is refused in one line (exit 2): on another
/// tap, out of order, at a position the step does not hold, not matching the stored axes.
#[test]
fn a_manifest_whose_cut_does_not_hold_is_refused_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let g = golden(tmp.path());
    let src = tmp.path().join("cut");
    dump(&src, Some(&g), &["--record", "kq_heads=1-2;kq_rows=10-12"]);
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("manifest.json")).unwrap()).unwrap();
    let probs_at = |m: &serde_json::Value| {
        m["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .position(|t| t["tap"] == "kq_soft_max" && t["step"] == 0 && t["layer"] == 0)
            .unwrap()
    };
    let i = probs_at(&m);
    let l_out = m["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .position(|t| t["tap"] == "l_out")
        .unwrap();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "on l_out",
            Box::new(move |m| m["tensors"][l_out]["rows"] = serde_json::json!([0])),
            "only kq_soft_max can be cut",
        ),
        (
            "heads out of order",
            Box::new(move |m| m["tensors"][i]["heads"] = serde_json::json!([2, 1])),
            "increasing order",
        ),
        (
            "a position past the step",
            Box::new(move |m| m["tensors"][i]["rows"] = serde_json::json!([10, 11, 400])),
            "which step 0 does not hold",
        ),
        (
            "more rows than stored",
            Box::new(move |m| m["tensors"][i]["rows"] = serde_json::json!([10, 11, 12, 13])),
            "lists 4 rows but stores 3",
        ),
        (
            "no head",
            Box::new(move |m| m["tensors"][i]["heads"] = serde_json::json!([])),
            "at least one",
        ),
        (
            "a head the model does not have",
            Box::new(move |m| m["tensors"][i]["heads"] = serde_json::json!([1, 99])),
            "the manifest lists head 99 kept, and the model has 4 heads",
        ),
    ];
    for (what, edit, says) in cases {
        let t = tmp.path().join("crafted");
        let _ = std::fs::remove_dir_all(&t);
        copy_dir(&src, &t);
        let mut m = m.clone();
        edit(&mut m);
        std::fs::write(t.join("manifest.json"), serde_json::to_vec(&m).unwrap()).unwrap();
        let o = parity(&["diff", path(&g), path(&t)]);
        assert_eq!(o.status.code(), Some(2), "{what}: {}", show(&o));
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            e.contains(says) && e.trim().lines().count() == 1,
            "{what}: {e}"
        );
    }
}

/// An engine out of process (the numpy engine, through the Python kit) follows a scan's zoom
/// of a long step against a real llama.cpp golden: the zoom asks for `kq_soft_max` at the 16
/// rows from the first position out, the engine records to that plan, and the judge measures
/// what the attention read there (a cache read 60 slots early for keys 60..70, from position
/// 80 on) from the rows kept.
#[test]
#[cfg_attr(not(parity_llama_cpp), ignore = "needs llama-cpp-python (.venv)")]
fn an_engine_follows_a_long_step_s_zoom_and_its_read_is_measured_from_the_kept_rows() {
    if !llama_cpp_or_skip() {
        return;
    }
    let Some(py) = numpy_engine_python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let g = tmp.path().join("golden");
    let ids = long_prompt();
    let o = parity(&[
        "golden",
        MODEL,
        "--tokens",
        &ids,
        "--steps",
        "2",
        "--out",
        path(&g),
    ]);
    assert!(o.status.success(), "{}", show(&o));
    const READ: &str = "j - 60 if (i >= 80 and j >= 60 and j < 70) else j";
    let engine = |out: &Path, plan: &str| {
        numpy_engine_trace(
            &py,
            MODEL,
            &g,
            out,
            None,
            &["--taps", "all", "--record", plan, "--kv-read", READ],
        );
    };
    let scan = tmp.path().join("scan");
    engine(&scan, "taps=l_out,result_norm,logits");
    let (code, j) = diffed(&g, &scan);
    assert_eq!(code, Some(1), "{j:#}");
    let d = &own_inputs(&j)["first_divergence"];
    assert_eq!(d["position"]["position"], 80, "{d:#}");
    let plan = d["zoom"]["record"].as_str().unwrap().to_string();
    assert_eq!(
        plan,
        "taps=l_out,result_norm,logits;full=0;layers=0;kq_rows=80-95"
    );

    let zoom = tmp.path().join("zoom");
    engine(&zoom, &plan);
    assert!(
        probs(&zoom)
            .iter()
            .all(|(s, _, shape, _, _)| *s == 0 && shape[1] == 16),
        "{:?}",
        probs(&zoom)
    );
    let (code, j) = diffed(&g, &zoom);
    assert_eq!(code, Some(1), "{j:#}");
    let d = &own_inputs(&j)["first_divergence"];
    assert_eq!(
        d["at"]["key"],
        serde_json::json!({"step": 0, "layer": 0, "tap": "kq_soft_max"}),
        "{d:#}"
    );
    assert_eq!(d["position"]["position"], 80, "{d:#}");
    let text = d["diagnosis"].as_str().unwrap();
    assert!(
        text.contains("measured: the attention at position 80 read")
            && text.contains("60→position 0's key")
            && text.contains("each of those columns held the key 60 positions earlier"),
        "{text}"
    );
}
