//! A confirmation is never wrong (issue 18): "confirmed by experiment" only for a hypothesis
//! that explains an error by a wide factor and holds over the whole trace. Every clean trace
//! we can make (each fixture and shared model, full and sparse, plain and ggml-cpu rounding,
//! llama.cpp's own goldens, a 24-layer generated model) passes with nothing confirmed; a
//! hypothesis that reproduces one key but predicts differences the engine does not show
//! elsewhere is not confirmed; a knob with evidence in every layer still is.

use crate::common;
use common::*;
use parity::backend::mutation::Mutation;
use parity::backend::{self, Emulation, Reference};
use parity::judge::{self, JudgeOptions, Judgement, hypothesis};
use parity::model::Model;
use parity::trace::{MemorySink, Tap, TapFilter, TapKey, Trace};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Committed fixtures with their goldens, and the shared models' when ../shared exists.
fn model_goldens() -> Vec<(PathBuf, PathBuf)> {
    let mut v = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root().join("golden"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    dirs.sort();
    for g in dirs {
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(g.join("manifest.json")).unwrap())
                .unwrap();
        let p = root().join(m["model"]["path"].as_str().unwrap());
        if p.exists() {
            v.push((p, g));
        } else {
            eprintln!("skipped: {} (model not found)", g.display());
        }
    }
    v
}

/// The engine's tensors for `ids` then `forced` decode tokens.
fn run(
    model: &Model,
    ids: &[u32],
    forced: &[u32],
    m: Option<Mutation>,
    rounding: Emulation,
) -> (
    Vec<parity::trace::StepInfo>,
    BTreeMap<TapKey, ndarray::ArrayD<f32>>,
) {
    let mut b = Reference::new(model, rounding, ids.len() + forced.len() + 2).with_mutation(m);
    let mut sink = MemorySink::new(TapFilter::all());
    let info = backend::run(&mut b, ids, forced.len(), Some(forced), &mut sink).unwrap();
    (info, sink.tensors)
}

fn trace(
    steps: Vec<parity::trace::StepInfo>,
    tensors: BTreeMap<TapKey, ndarray::ArrayD<f32>>,
    keep: impl Fn(&TapKey) -> bool,
) -> Trace {
    let kept = tensors.into_iter().filter(|(k, _)| keep(k)).collect();
    memory_trace("test-engine", "whatever-it-says", "", steps, kept)
}

/// Which taps a dump keeps.
type Keep = fn(&TapKey) -> bool;

fn all(_: &TapKey) -> bool {
    true
}
/// What engine authors dump first.
fn sparse(k: &TapKey) -> bool {
    matches!(k.tap, Tap::Embd | Tap::LOut | Tap::ResultNorm | Tap::Logits)
}
/// Sparser still: the layer outputs and the logits (`dump --taps '^(l_out|logits)'`).
fn l_out_logits(k: &TapKey) -> bool {
    matches!(k.tap, Tap::LOut | Tap::Logits)
}

fn judged(model: &Model, t: &Trace) -> Judgement {
    judge::judge(model, t, &JudgeOptions::default()).unwrap()
}

/// Clean: passes, nothing confirmed, and no hypothesis cut an own error under the floors
/// anywhere near `EXPLAINS`.
fn assert_clean(what: &str, j: &Judgement) {
    assert!(
        j.passed(),
        "{what}: flagged\n{}",
        parity::report::judgement(j)
    );
    let text = parity::report::judgement(j);
    assert!(!text.contains("confirmed"), "{what}: {text}");
    for b in &j.below_floor {
        assert!(b.cut() < hypothesis::EXPLAINS, "{what}: {text}");
    }
}

#[test]
fn no_clean_trace_confirms_anything() {
    let pairs = model_goldens();
    assert!(pairs.len() >= 8, "the committed fixtures' goldens");
    let keeps: [(&str, Keep); 3] = [
        ("full", all),
        ("sparse", sparse),
        ("l_out+logits", l_out_logits),
    ];
    for (mp, gp) in pairs {
        let model = Model::open(&mp).unwrap();
        let g = Trace::open(&gp).unwrap();
        let name = gp.file_name().unwrap().to_string_lossy().to_string();
        // llama.cpp's own trace, whole and thinned out.
        for (kn, keep) in keeps {
            let t = trace(
                g.manifest.steps.clone(),
                g.keys().map(|k| (*k, g.get(k).unwrap().unwrap())).collect(),
                keep,
            );
            assert_clean(
                &format!("{name} llama.cpp golden {kn}"),
                &judged(&model, &t),
            );
        }
        let ids = g.manifest.steps[0].tokens.clone();
        let forced = g.manifest.decode_tokens();
        for rounding in [Emulation::None, Emulation::GgmlCpu] {
            let (steps, tensors) = run(&model, &ids, &forced, None, rounding);
            for (kn, keep) in keeps {
                let t = trace(steps.clone(), tensors.clone(), keep);
                assert_clean(&format!("{name} {rounding:?} {kn}"), &judged(&model, &t));
            }
        }
    }
}

/// A deep model (24 layers, generated at test time): clean dumps of both roundings, full and
/// sparse, through the CLI (`dump --taps`, `diff`): exit 0, nothing confirmed.
#[test]
fn deep_generated_model_confirms_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("deep.gguf");
    let m = m.to_str().unwrap();
    let o = parity(&[
        "fixture",
        "--out",
        m,
        "--n-layer",
        "24",
        "--n-embd",
        "128",
        "--n-ff",
        "256",
        "--seed",
        "7",
    ]);
    assert!(o.status.success(), "{}", show(&o));
    let d = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let dump = |out: &str, extra: &[&str]| {
        let mut a = vec!["dump", m, "--tokens", "1,20,31,42,53,64", "--steps", "3"];
        a.extend_from_slice(&["--out", out]);
        a.extend_from_slice(extra);
        let o = parity(&a);
        assert!(o.status.success(), "{}", show(&o));
    };
    dump(&d("base"), &[]);
    for (n, extra) in [
        ("plain-full", vec![]),
        ("plain-lo", vec!["--taps", "^(l_out|logits)"]),
        ("ggml-full", vec!["--emulate", "ggml-cpu"]),
        (
            "ggml-lo",
            vec!["--emulate", "ggml-cpu", "--taps", "^(l_out|logits)"],
        ),
        (
            "fast-lo",
            vec!["--backend", "fast", "--taps", "^(l_out|logits)"],
        ),
    ] {
        dump(&d(n), &extra);
        let o = parity(&["diff", &d("base"), &d(n), "--model", m]);
        let out = stdout(&o);
        assert_eq!(o.status.code(), Some(0), "{n}: {}", show(&o));
        assert!(!out.contains("confirmed"), "{n}: {out}");
    }
}

/// A candidate that has one key of a wrong-theta engine and is otherwise clean: rope-theta
/// reproduces that key exactly, but predicts differences at every other step the engine does
/// not show. Not confirmed (it used to be: a hypothesis was judged at the flagged key alone).
#[test]
fn a_hypothesis_that_fails_elsewhere_is_not_confirmed() {
    let model = Model::open(root().join("fixtures/tiny-llama-q8_0.gguf")).unwrap();
    let g = Trace::open(root().join("golden/tiny-llama-q8_0")).unwrap();
    let ids = g.manifest.steps[0].tokens.clone();
    let forced = g.manifest.decode_tokens();
    for rounding in [Emulation::None, Emulation::GgmlCpu] {
        let (steps, mut clean) = run(&model, &ids, &forced, None, rounding);
        let (_, wrong) = run(&model, &ids, &forced, Some(Mutation::RopeTheta), rounding);
        let at = TapKey::new(0, Some(0), Tap::LOut);
        clean.insert(at, wrong[&at].clone());
        let t = trace(steps, clean, sparse);
        let j = judged(&model, &t);
        let f = j
            .first
            .as_ref()
            .expect("the grafted key is out of its floor");
        assert_eq!(f.flagged, at, "{}", f.text);
        assert_eq!(f.confirmed, None, "{rounding:?}: {}", f.text);
        assert!(
            f.text.contains("not elsewhere in the trace") && f.text.contains("rope-theta"),
            "{rounding:?}: {}",
            f.text
        );
    }
}

/// An engine whose rms eps is another value engines use (1e-6 where the model says 1e-5):
/// evidence in every layer and step, confirmed as that knob, full and sparse.
#[test]
fn a_knob_with_evidence_everywhere_is_confirmed() {
    let model = Model::open(root().join("fixtures/tiny-llama-q8_0.gguf")).unwrap();
    assert_eq!(model.config.rms_eps, 1e-5, "the fixture's eps");
    let mut engine = Model::open(root().join("fixtures/tiny-llama-q8_0.gguf")).unwrap();
    engine.config.rms_eps = 1e-6;
    let g = Trace::open(root().join("golden/tiny-llama-q8_0")).unwrap();
    let ids = g.manifest.steps[0].tokens.clone();
    let forced = g.manifest.decode_tokens();
    let (steps, tensors) = run(&engine, &ids, &forced, None, Emulation::None);
    for (kn, keep) in [("full", all as Keep), ("sparse", sparse)] {
        let t = trace(steps.clone(), tensors.clone(), keep);
        let j = judged(&model, &t);
        let f = j.first.as_ref().unwrap_or_else(|| {
            panic!(
                "{kn}: eps 1e-6 not found\n{}",
                parity::report::judgement(&j)
            )
        });
        assert_eq!(
            f.confirmed.as_deref(),
            Some("rms-eps=1e-6"),
            "{kn}: {}",
            f.text
        );
        assert_eq!(
            f.key,
            TapKey::new(
                0,
                Some(0),
                if kn == "full" {
                    Tap::AttnNorm
                } else {
                    Tap::LOut
                }
            ),
            "{kn}: {}",
            f.text
        );
    }
}

/// An undeclared head-major q_rope and a planted bug after it (swiglu-swap, at ffn_act of
/// layer 0): the layout is named, aligned, and the judging goes on to the real first
/// divergence — both named, the place the bug's. Without the bug: the layout alone.
#[test]
fn a_layout_does_not_mask_the_bug_after_it() {
    let model = Model::open(root().join("fixtures/tiny-llama-q8_0.gguf")).unwrap();
    let g = Trace::open(root().join("golden/tiny-llama-q8_0")).unwrap();
    let ids = g.manifest.steps[0].tokens.clone();
    let forced = g.manifest.decode_tokens();
    let c = &model.config;
    for bug in [Some(Mutation::SwigluSwap), None] {
        let (steps, mut tensors) = run(&model, &ids, &forced, bug, Emulation::GgmlCpu);
        for (k, a) in tensors.iter_mut() {
            if k.tap == Tap::QRope {
                let t = a.len() / (c.n_head * c.head_dim);
                let x: Vec<f32> = a.iter().copied().collect();
                let hm = parity::backend::mutation::to_head_major(&x, t, c.n_head, c.head_dim);
                *a = ndarray::ArrayD::from_shape_vec(a.shape(), hm).unwrap();
            }
        }
        let t = trace(steps, tensors, all);
        let j = judged(&model, &t);
        let text = parity::report::judgement(&j);
        let f = j.first.as_ref().expect("diverged");
        assert_eq!(j.layouts.len(), 1, "{bug:?}: {text}");
        let l = &j.layouts[0];
        assert_eq!(l.key, TapKey::new(0, Some(0), Tap::QRope), "{text}");
        assert_eq!(l.catalog.as_deref(), Some("head-major-q-rope"), "{text}");
        match bug {
            Some(m) => {
                assert_eq!(f.catalog.as_deref(), Some(m.name()), "{text}");
                assert_eq!(f.key, m.first_shows(&model), "{text}");
                assert_eq!(j.place(), Some(f.key));
                assert!(
                    text.contains("layout named by experiment first")
                        && text.contains("layout:head-major")
                        && text.contains("confirmed by experiment: swiglu-swap"),
                    "{text}"
                );
            }
            None => {
                assert_eq!(f.catalog.as_deref(), Some("head-major-q-rope"), "{text}");
                assert_eq!(j.place(), Some(l.key), "{text}");
            }
        }
    }
}

/// Sparse Q4_0 dumps (embd, l_out, result_norm, logits), both roundings: a decode-step RoPE
/// position off by one is named as such (never rope-theta: that also changes the prompt),
/// and told from the cache slot off by one; one norm site from every norm; eps ×10 found.
/// Each at the step and layer where it first shows.
#[test]
fn sparse_q4_0_sites_and_decode_off_by_ones() {
    let model = Model::open(root().join("fixtures/tiny-llama-q4_0.gguf")).unwrap();
    let g = Trace::open(root().join("golden/tiny-llama-q4_0")).unwrap();
    let ids = g.manifest.steps[0].tokens.clone();
    let forced = g.manifest.decode_tokens();
    for rounding in [Emulation::None, Emulation::GgmlCpu] {
        for m in [
            Mutation::RopePosOffByOne,
            Mutation::KvOffByOne,
            Mutation::AttnNormWeightTwice,
            Mutation::NormWeightTwice,
            Mutation::RmsEps10x,
        ] {
            let (steps, tensors) = run(&model, &ids, &forced, Some(m), rounding);
            let j = judged(&model, &trace(steps, tensors, sparse));
            let text = parity::report::judgement(&j);
            let f = j
                .first
                .as_ref()
                .unwrap_or_else(|| panic!("{m} {rounding:?}: not found\n{text}"));
            assert_eq!(
                f.catalog.as_deref(),
                Some(m.name()),
                "{m} {rounding:?}: {text}"
            );
            let exp = m.first_shows(&model);
            assert_eq!(
                (f.key.step, f.key.layer),
                (exp.step, exp.layer),
                "{m} {rounding:?}: {text}"
            );
            assert!(
                !f.also.iter().any(|a| a.starts_with("rope-theta")),
                "{m} {rounding:?}: {text}"
            );
        }
    }
}
