//! The mutation catalog: each bug changes the reference's taps exactly from its `first_shows`
//! key on (never before), on every committed fixture and shared model with a golden; `dump
//! --mutate` writes what an engine with the bug would; the numpy engine (an out-of-process
//! engine of our own) passes `diff` when clean and is caught when mutated.

use crate::common;

use common::{numpy_engine_python, parity, root, shared, show};
use parity::backend::mutation::{Mutation, MutationKind};
use parity::backend::{self, Emulation, Reference};
use parity::model::Model;
use parity::trace::{MemorySink, TapFilter, TapKey, Trace};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// (model, golden) for every committed fixture and, when ../shared is here, the shared models.
fn models_with_goldens() -> Vec<(PathBuf, PathBuf)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root().join("golden")).unwrap().flatten() {
        let g = e.path();
        let t = Trace::open(&g).unwrap();
        let rel = PathBuf::from(&t.manifest.model.path);
        let model = if root().join(&rel).exists() {
            root().join(&rel)
        } else {
            match shared("models") {
                Some(dir) => dir.join(rel.file_name().unwrap()),
                None => continue,
            }
        };
        if model.exists() {
            out.push((model, g));
        }
    }
    out.sort();
    assert!(out.len() >= 8, "the committed fixtures have goldens");
    out
}

fn taps(
    model: &Model,
    m: Option<Mutation>,
    ids: &[u32],
    forced: &[u32],
) -> BTreeMap<TapKey, ndarray::ArrayD<f32>> {
    let mut b = Reference::new(model, Emulation::None, ids.len() + forced.len()).with_mutation(m);
    let mut sink = MemorySink::new(TapFilter::all());
    backend::run(&mut b, ids, forced.len(), Some(forced), &mut sink).unwrap();
    sink.tensors
}

#[test]
fn every_mutation_shows_first_at_its_place() {
    let checked = mutations_show_first_at_their_place(true);
    assert!(checked >= 8 * 13, "{checked} (model, mutation) pairs");
}

/// … and on the ../shared models.
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (models)")]
fn every_mutation_shows_first_at_its_place_on_shared_models() {
    let checked = mutations_show_first_at_their_place(false);
    assert!(checked >= 3 * 13, "{checked} (model, mutation) pairs");
}

/// On the fixtures (`fixtures`) or on the other models with goldens: how many (model,
/// mutation) pairs were checked.
fn mutations_show_first_at_their_place(fixtures: bool) -> usize {
    let mut checked = 0;
    let dir = root().join("fixtures");
    for (path, golden) in models_with_goldens()
        .into_iter()
        .filter(|(p, _)| p.starts_with(&dir) == fixtures)
    {
        let model = Model::open(&path).unwrap();
        let g = Trace::open(&golden).unwrap();
        let ids = g.manifest.steps[0].tokens.clone();
        let forced = g.manifest.decode_tokens();
        assert!(ids.len() >= 2 && !forced.is_empty(), "{}", golden.display());
        let clean = taps(&model, None, &ids, &forced);
        for &m in Mutation::ALL {
            if m.kind() == MutationKind::Tokens || !m.applies_to(&model) {
                continue;
            }
            let mut at = m.first_shows(&model);
            // A bug that acts from a position or a turn on shows in the step holding it.
            if m.positional() {
                let run: Vec<(usize, usize, usize)> = std::iter::once((0, 0, ids.len()))
                    .chain((1..=forced.len()).map(|s| (s, ids.len() + s - 1, 1)))
                    .collect();
                match m.first_position(&run) {
                    Some((step, _)) => at.step = step,
                    None => continue,
                }
            }
            let bad = taps(&model, Some(m), &ids, &forced);
            for (k, a) in &clean {
                let b = &bad[k];
                if *k < at {
                    assert!(a == b, "{}: {m} changed {k} before {at}", path.display());
                } else if *k == at {
                    assert!(
                        a.shape() != b.shape() || a != b,
                        "{}: {m} left {at} unchanged",
                        path.display()
                    );
                }
            }
            checked += 1;
        }
        eprintln!("{}: catalog checked", path.display());
    }
    checked
}

#[test]
fn mutations_that_cannot_show_are_not_applicable() {
    // The f32 fixture has no 4-bit weights; q4_0 has.
    let f32m = Model::open(root().join("fixtures/tiny-llama-f32.gguf")).unwrap();
    let q4 = Model::open(root().join("fixtures/tiny-llama-q4_0.gguf")).unwrap();
    assert!(!Mutation::DecoderNibbleOrder.applies_to(&f32m));
    assert!(Mutation::DecoderNibbleOrder.applies_to(&q4));
    let o = parity(&[
        "dump",
        "fixtures/tiny-llama-f32.gguf",
        "--tokens",
        "1,2,3",
        "--mutate",
        "decoder-nibble-order",
        "--out",
        "/nonexistent/never-written",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("does not apply") && err.contains("rope-neox"),
        "{err}"
    );
    let o = parity(&[
        "dump",
        "fixtures/tiny-llama-f32.gguf",
        "--tokens",
        "1,2,3",
        "--mutate",
        "rope-sideways",
        "--out",
        "/nonexistent/never-written",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("unknown mutation 'rope-sideways'") && err.contains("kv-off-by-one"));
}

#[test]
fn mutations_lists_the_catalog() {
    let o = parity(&["mutations", "fixtures/tiny-llama-q4_0.gguf", "--json"]);
    assert!(o.status.success(), "{}", show(&o));
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), Mutation::ALL.len());
    let nib = rows
        .iter()
        .find(|r| r["name"] == "decoder-nibble-order")
        .unwrap();
    assert_eq!(nib["applies"], true);
    assert_eq!(nib["kind"], "compute");
    let kv = rows.iter().find(|r| r["name"] == "kv-off-by-one").unwrap();
    assert_eq!(kv["first_shows"], "step 1, layer 0, kq_soft_max");
}

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

#[test]
fn dump_mutate_writes_token_and_layout_bugs_as_an_engine_would() {
    let tmp = tempfile::tempdir().unwrap();
    let golden = root().join("golden/tiny-llama-q8_0");
    let g = manifest(&golden);
    let ids: Vec<u64> = g["steps"][0]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let run = |name: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut args = vec![
            "dump",
            "fixtures/tiny-llama-q8_0.gguf",
            "--golden",
            golden.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = parity(&args);
        assert!(o.status.success(), "{}", show(&o));
        manifest(&out)
    };
    let step0 = |m: &serde_json::Value| -> Vec<u64> {
        m["steps"][0]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    assert_eq!(ids[0], 1, "the golden starts with BOS");
    assert_eq!(step0(&run("clean", &[])), ids);
    assert_eq!(step0(&run("nobos", &["--mutate", "no-bos"])), ids[1..]);
    let dbl = step0(&run("dbl", &["--mutate", "double-bos"]));
    assert_eq!(dbl[..2], [1, 1]);
    assert_eq!(dbl[1..], ids[..]);
    // The decode ids are the golden's in every case.
    assert_eq!(
        run("nobos2", &["--mutate", "no-bos"])["steps"][1]["tokens"],
        g["steps"][1]["tokens"]
    );

    let hm = run("hm", &["--mutate", "head-major-q-rope"]);
    let q = hm["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tap"] == "q_rope" && t["layer"] == 0 && t["step"] == 0)
        .unwrap();
    let cfg = Model::open(root().join("fixtures/tiny-llama-q8_0.gguf"))
        .unwrap()
        .config;
    assert_eq!(
        q["shape"],
        serde_json::json!([cfg.n_head, ids.len(), cfg.head_dim])
    );
    assert!(hm.get("layouts").is_none());
    let declared = run(
        "hmd",
        &["--mutate", "head-major-q-rope", "--declare-layout"],
    );
    assert_eq!(declared["layouts"]["q_rope"], "head-major");
    // The head-major tensor holds the clean tensor's values, transposed.
    let (_, clean) = common::read_npy(&tmp.path().join("clean/s000/q_rope-0.npy"));
    let (_, moved) = common::read_npy(&tmp.path().join("hm/s000/q_rope-0.npy"));
    let (t, nh, hd) = (ids.len(), cfg.n_head, cfg.head_dim);
    for i in 0..t {
        for h in 0..nh {
            assert_eq!(
                clean[(i * nh + h) * hd..][..hd],
                moved[(h * t + i) * hd..][..hd]
            );
        }
    }
}

fn numpy_engine(py: &Path, model: &Path, golden: &Path, out: &Path, extra: &[&str]) {
    let o = Command::new(py)
        .arg(root().join("scripts/numpy_engine.py"))
        .arg(model)
        .arg("--golden")
        .arg(golden)
        .arg("--out")
        .arg(out)
        .args(extra)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
}

#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs numpy and gguf-py (.ci/run installs them; then touch build.rs)"
)]
fn numpy_engine_passes_diff_when_clean_and_is_caught_when_mutated() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // The numpy engine is a second, independent llama/qwen2 engine; the newer architectures
    // are checked against llama.cpp's goldens and parity's own engine (tests/arch_verdicts.rs).
    let numpy_runs = |m: &Path| {
        matches!(
            Model::open(m).unwrap().config.arch,
            parity::model::Arch::Llama | parity::model::Arch::Qwen2
        ) && Model::open(m).unwrap().layers[0].rope_freqs.is_none()
    };
    for (model, golden) in models_with_goldens()
        .into_iter()
        .filter(|(m, _)| numpy_runs(m))
    {
        for rounding in ["none", "ggml"] {
            let out = tmp.path().join(format!(
                "{}-{rounding}",
                golden.file_name().unwrap().to_string_lossy()
            ));
            numpy_engine(&py, &model, &golden, &out, &["--rounding", rounding]);
            let o = parity(&["diff", golden.to_str().unwrap(), out.to_str().unwrap()]);
            assert_eq!(o.status.code(), Some(0), "{}: {}", out.display(), show(&o));
        }
    }
    // The same engine with NEOX pairing on a NORM model is a divergence (exit 1).
    let golden = root().join("golden/tiny-llama-q8_0");
    let out = tmp.path().join("neox");
    numpy_engine(
        &py,
        &root().join("fixtures/tiny-llama-q8_0.gguf"),
        &golden,
        &out,
        &["--rounding", "ggml", "--mutate", "rope-neox"],
    );
    let o = parity(&["diff", golden.to_str().unwrap(), out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
}

#[test]
#[cfg_attr(
    not(parity_gguf_py),
    ignore = "needs numpy and gguf-py (.ci/run installs them; then touch build.rs)"
)]
fn numpy_engine_with_ggml_rounding_sits_at_the_f32_floor_on_q8_0() {
    let Some(py) = numpy_engine_python() else {
        return;
    };
    // Rounding activations as ggml does makes an independent engine agree with llama.cpp op
    // by op to f32 noise; without it, to the Q8_0 activation noise.
    let tmp = tempfile::tempdir().unwrap();
    let golden = root().join("golden/tiny-llama-q8_0");
    let model = root().join("fixtures/tiny-llama-q8_0.gguf");
    let g = Trace::open(&golden).unwrap();
    let mut worst = BTreeMap::new();
    for rounding in ["ggml", "none"] {
        let out = tmp.path().join(rounding);
        numpy_engine(&py, &model, &golden, &out, &["--rounding", rounding]);
        let c = Trace::open(&out).unwrap();
        let mut w = 0.0f64;
        for k in g.keys() {
            let a = g.get(k).unwrap().unwrap();
            let b = c.get(k).unwrap().unwrap();
            let num: f64 = a
                .iter()
                .zip(b.iter())
                .map(|(x, y)| ((x - y) as f64).powi(2))
                .sum();
            let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
            if den > 0.0 {
                w = w.max(num / den);
            }
        }
        worst.insert(rounding, w);
    }
    assert!(worst["ggml"] < 1e-10, "{worst:?}");
    assert!(worst["none"] > 1e-7, "{worst:?}");
}

#[test]
fn selftest_runs_on_the_default_fixture_and_its_clean_rows_pass() {
    let o = parity(&[
        "selftest",
        "fixtures/tiny-llama-q8_0.gguf",
        "--only",
        "rope-neox,no-bos",
        "--json",
    ]);
    assert!(matches!(o.status.code(), Some(0 | 1)), "{}", show(&o));
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    let clean: Vec<_> = rows.iter().filter(|r| r["case"] == "clean").collect();
    assert_eq!(clean.len(), 2, "one clean row per rounding");
    for r in clean {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["diverged"], false, "{r}");
    }
    for name in ["rope-neox", "no-bos"] {
        assert!(rows.iter().any(|r| r["case"] == name), "{name}");
    }
}

#[test]
fn selftest_refuses_bad_input_with_one_line() {
    let o = parity(&[
        "selftest",
        "fixtures/tiny-llama-q8_0.gguf",
        "--only",
        "rope",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let o = parity(&[
        "selftest",
        "fixtures/tiny-llama-q8_0.gguf",
        "--golden",
        "golden/tiny-llama-q4_0",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("another model"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn generate_with_a_mutation_generates_what_the_buggy_engine_would() {
    let ids = |extra: &[&str]| -> String {
        let mut args = vec![
            "generate",
            "fixtures/tiny-llama-q8_0.gguf",
            "-p",
            "Once upon a time",
            "-n",
            "12",
            "--ignore-eos",
        ];
        args.extend_from_slice(extra);
        let o = parity(&args);
        assert!(o.status.success(), "{}", show(&o));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        out.lines()
            .find(|l| l.starts_with("ids:"))
            .unwrap()
            .to_string()
    };
    let clean = ids(&[]);
    assert_ne!(clean, ids(&["--mutate", "no-causal-mask"]));
    assert_ne!(clean, ids(&["--mutate", "swiglu-swap"]));
    // A layout bug changes how a tap is stored, not what is generated.
    assert_eq!(clean, ids(&["--mutate", "head-major-q-rope"]));
    let o = parity(&[
        "generate",
        "fixtures/tiny-llama-q8_0.gguf",
        "--mutate",
        "swiglu",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
}
