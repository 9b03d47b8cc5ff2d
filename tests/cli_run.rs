//! `parity generate`, `parity tokenize`, `parity dump` (and a trace written from Python) as a
//! user runs them: the real binary, checked against llama.cpp's own ids and goldens.
//!
//! Parts that need `../shared` (models, vocabularies) print "skipped: …" when it is absent; the
//! numpy example skips when no Python with numpy is found.

use crate::common;
use common::*;
use parity::trace::{Tap, TapKey, Trace};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

fn ok(args: &[&str]) -> String {
    let o = parity(args);
    assert_eq!(o.status.code(), Some(0), "parity {args:?}\n{}", show(&o));
    String::from_utf8(o.stdout).expect("UTF-8 stdout")
}

fn sha256_file(p: &Path) -> String {
    let bytes = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The `ids: …` line of `parity generate`.
fn generated_ids(stdout: &str) -> Vec<u32> {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("ids:"))
        .unwrap_or_else(|| panic!("no `ids:` line in\n{stdout}"));
    line["ids:".len()..]
        .split_whitespace()
        .map(|s| s.parse().expect("an id"))
        .collect()
}

fn last_row(a: &ndarray::ArrayD<f32>) -> Vec<f32> {
    let n = *a.shape().last().unwrap();
    a.iter().copied().collect::<Vec<_>>()[a.len() - n..].to_vec()
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

// ---------------------------------------------------------------------------------------------
// generate

const STORY: &str =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.";

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (models, vocab)")]
fn generate_stories260k_both_backends() {
    let Some(models) = shared("models") else {
        return;
    };
    let m = models.join("stories260K.gguf");
    for backend in ["reference", "fast"] {
        let out = ok(&[
            "generate",
            m.to_str().unwrap(),
            "-n",
            "40",
            "--backend",
            backend,
        ]);
        assert!(
            out.starts_with(STORY),
            "--backend {backend}: stdout does not start with the story:\n{out}"
        );
        assert_eq!(generated_ids(&out).len(), 40, "--backend {backend}\n{out}");
    }
}

/// A golden: its folder, the model it was made from, the prompt ids (step 0) and llama.cpp's
/// greedy decode ids (the forced tokens of steps 1..N).
struct Golden {
    dir: PathBuf,
    model: PathBuf,
    prompt: Vec<u32>,
    decoded: Vec<u32>,
    trace: Trace,
}

/// Every committed golden whose model is present (those of ../shared models skip without it).
fn goldens() -> Vec<Golden> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root().join("golden"))
        .expect("golden/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("manifest.json").exists())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no goldens in golden/");
    let mut out = Vec::new();
    for dir in dirs {
        let trace = Trace::open(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let m = &trace.manifest;
        let model = root().join(&m.model.path);
        if !model.exists() {
            eprintln!(
                "skipped: {} (its model {} is not here)",
                dir.display(),
                m.model.path
            );
            continue;
        }
        assert_eq!(
            sha256_file(&model),
            m.model.sha256,
            "{}: the golden is stale for {}",
            dir.display(),
            model.display()
        );
        assert!(m.steps.len() >= 2, "{}: no decode steps", dir.display());
        let decoded: Vec<u32> = m.steps[1..].iter().flat_map(|s| s.tokens.clone()).collect();
        out.push(Golden {
            prompt: m.steps[0].tokens.clone(),
            decoded,
            dir,
            model,
            trace,
        });
    }
    out
}

/// The golden's logits at `step` (last row).
fn golden_logits(g: &Golden, step: usize) -> Vec<f32> {
    let a = g
        .trace
        .get(&TapKey::new(step, None, Tap::Logits))
        .unwrap()
        .unwrap_or_else(|| panic!("{}: no logits at step {step}", g.dir.display()));
    last_row(&a)
}

/// `parity generate --tokens PROMPT -n N` must give llama.cpp's own greedy ids.
///
/// `fast` and `reference --emulate ggml-cpu` round activations as ggml's CPU does: their ids must
/// equal llama.cpp's exactly. The plain `reference` keeps f32 activations where llama.cpp rounds
/// them (to Q8 for quantized weights, to F16 for F16 weights), so on a step where llama.cpp's own
/// top-2 logits are closer than that rounding moves them, it may pick the runner-up. Such a flip
/// is accepted only if it is explained by the measured plain-f32 logit error at that step
/// (margin ≤ 2·max|Δlogit| of a teacher-forced dump) and that error is small (< 0.5); the
/// comparison stops there, as free-running sequences part after a different token.
fn check_generate_against_golden(g: &Golden) {
    let model = g.model.to_str().unwrap();
    let n = g.decoded.len().to_string();
    let prompt = join_ids(&g.prompt);
    let name = g.dir.file_name().unwrap().to_string_lossy().to_string();

    // The golden itself: the forced ids are llama.cpp's argmax, step by step.
    for (i, &id) in g.decoded.iter().enumerate() {
        assert_eq!(
            argmax(&golden_logits(g, i)),
            id as usize,
            "{name}: golden step {} token is not the argmax of step {i}'s logits",
            i + 1
        );
    }

    for (backend, extra) in [
        ("fast", &[][..]),
        ("reference:ggml-cpu", &["--emulate", "ggml-cpu"][..]),
        ("reference", &[][..]),
    ] {
        let b = backend.split(':').next().unwrap();
        let mut args = vec![
            "generate",
            model,
            "--tokens",
            &prompt,
            "-n",
            &n,
            "--backend",
            b,
        ];
        args.extend_from_slice(extra);
        let got = generated_ids(&ok(&args));
        if backend != "reference" {
            assert_eq!(
                got, g.decoded,
                "{name}: --backend {backend} greedy ids differ from llama.cpp's"
            );
            continue;
        }
        if got == g.decoded {
            continue;
        }
        let i = got
            .iter()
            .zip(&g.decoded)
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| {
                panic!(
                    "{name}: --backend reference gave {} ids, llama.cpp {}",
                    got.len(),
                    g.decoded.len()
                )
            });
        // Measure the plain reference's logits at that step, teacher-forced like the golden.
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("d");
        let forced = join_ids(&g.decoded);
        ok(&[
            "dump",
            model,
            "--tokens",
            &prompt,
            "--forced",
            &forced,
            "--taps",
            "^logits$",
            "--out",
            out.to_str().unwrap(),
        ]);
        let d = Trace::open(&out).unwrap();
        let ours = last_row(&d.get(&TapKey::new(i, None, Tap::Logits)).unwrap().unwrap());
        let theirs = golden_logits(g, i);
        let err = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let (want, have) = (g.decoded[i] as usize, got[i] as usize);
        let margin = theirs[want] - theirs[have];
        assert!(
            argmax(&ours) == have && err < 0.5 && margin <= 2.0 * err,
            "{name}: --backend reference picked {have} at decode step {}, llama.cpp {want}: llama.cpp's margin {margin} is not explained by the plain-f32 logit error {err}",
            i + 1
        );
        eprintln!(
            "{name}: plain reference takes runner-up {have} over llama.cpp's {want} at decode step {} (llama.cpp margin {margin:.4}, plain-f32 logit error {err:.4}); ids before it match",
            i + 1
        );
    }
}

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (models, vocab)")]
fn generate_tinystories_656k_q8_0_matches_llama_cpp() {
    if shared("models").is_none() {
        return;
    }
    let g = goldens()
        .into_iter()
        .find(|g| g.dir.ends_with("TinyStories-656K-Q8_0"))
        .expect("golden/TinyStories-656K-Q8_0 with its model");
    assert_eq!(g.decoded.len(), 4);
    // The exact command of the brief, both backends.
    for backend in ["reference", "fast"] {
        let out = ok(&[
            "generate",
            g.model.to_str().unwrap(),
            "--tokens",
            &join_ids(&g.prompt),
            "-n",
            "4",
            "--backend",
            backend,
        ]);
        assert_eq!(generated_ids(&out), g.decoded, "--backend {backend}");
    }
    check_generate_against_golden(&g);
}

#[test]
fn generate_matches_llama_cpp_on_every_golden() {
    let gs: Vec<Golden> = goldens()
        .into_iter()
        .filter(|g| g.model.starts_with(root().join("fixtures")))
        .collect();
    assert!(gs.len() >= 8, "every fixture should have a golden");
    for g in &gs {
        check_generate_against_golden(g);
    }
}

/// … and on the goldens of the ../shared models.
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (models)")]
fn generate_matches_llama_cpp_on_every_shared_golden() {
    let gs: Vec<Golden> = goldens()
        .into_iter()
        .filter(|g| !g.model.starts_with(root().join("fixtures")))
        .collect();
    assert!(
        gs.len() >= 3,
        "only {} goldens of ../shared models",
        gs.len()
    );
    for g in &gs {
        check_generate_against_golden(g);
    }
}

// ---------------------------------------------------------------------------------------------
// tokenize

/// stdout must be exactly one line of space-separated ids.
fn tokenize(args: &[&str]) -> Vec<u32> {
    let mut a = vec!["tokenize"];
    a.extend_from_slice(args);
    let out = ok(&a);
    assert!(out.ends_with('\n'), "tokenize {args:?}: {out:?}");
    let body = &out[..out.len() - 1];
    assert!(
        !body.contains('\n'),
        "tokenize {args:?}: more than one line: {out:?}"
    );
    assert!(
        !body.is_empty()
            && body
                .split(' ')
                .all(|w| !w.is_empty() && w.bytes().all(|c| c.is_ascii_digit())),
        "tokenize {args:?}: not only ids: {out:?}"
    );
    body.split(' ').map(|w| w.parse().unwrap()).collect()
}

#[test]
fn tokenize_prints_ids_and_matches_llama_cpp() {
    // The fixture prompt: llama.cpp tokenized it for golden/tiny-llama-q8_0 (with BOS).
    let g = Trace::open(root().join("golden/tiny-llama-q8_0")).unwrap();
    let prompt = g.manifest.producer.settings["prompt"]
        .as_str()
        .expect("the golden records its prompt");
    let with = tokenize(&["fixtures/tiny-llama-q8_0.gguf", prompt]);
    assert_eq!(with, g.manifest.steps[0].tokens, "vs llama.cpp's ids");
    assert_eq!(with[0], 1, "BOS first");
    let without = tokenize(&["--no-bos", "fixtures/tiny-llama-q8_0.gguf", prompt]);
    assert_eq!(without, with[1..], "--no-bos drops exactly the BOS");
}

#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (models, vocab)")]
fn tokenize_real_models_and_vocab_only_file() {
    if let Some(models) = shared("models") {
        // golden/stories260K was made from the prompt "Once upon a time".
        let g = Trace::open(root().join("golden/stories260K")).unwrap();
        assert_eq!(
            g.manifest.producer.settings["prompt"].as_str(),
            Some("Once upon a time")
        );
        let m = models.join("stories260K.gguf");
        let ids = tokenize(&[m.to_str().unwrap(), "Once upon a time"]);
        assert_eq!(ids, g.manifest.steps[0].tokens);
    }
    let Some(vocab) = shared("vocab") else { return };
    let v = vocab.join("ggml-vocab-llama-spm.gguf");
    let v = v.to_str().unwrap();
    // llama.cpp's own expectations (ggml-vocab-llama-spm.gguf.out): "Hello world" → 15043 3186.
    assert_eq!(tokenize(&[v, "Hello world"]), [1, 15043, 3186]);
    assert_eq!(tokenize(&["--no-bos", v, "Hello world"]), [15043, 3186]);
    assert_eq!(
        tokenize(&["--no-bos", v, " Hello world"]),
        [29871, 15043, 3186]
    );
}

// ---------------------------------------------------------------------------------------------
// dump

struct Dims {
    n_vocab: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    n_ff: usize,
}

fn dims(model: &str) -> Dims {
    let j: serde_json::Value = serde_json::from_str(&ok(&["inspect", "--json", model])).unwrap();
    let c = &j["config"];
    let g = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("config.{k}")) as usize;
    Dims {
        n_vocab: g("n_vocab"),
        n_embd: g("n_embd"),
        n_layer: g("n_layer"),
        n_head: g("n_head"),
        n_head_kv: g("n_head_kv"),
        head_dim: g("head_dim"),
        n_ff: g("n_ff"),
    }
}

/// The numpy shape of a tap, from the table of docs/trace-format.md.
fn doc_shape(tap: &str, t: usize, n_kv: usize, d: &Dims) -> Vec<usize> {
    match tap {
        "embd" | "attn_norm" | "attn_out" | "ffn_inp" | "ffn_norm" | "ffn_out" | "l_out"
        | "result_norm" => vec![t, d.n_embd],
        "q" | "q_rope" => vec![t, d.n_head, d.head_dim],
        "k" | "v" | "k_rope" => vec![t, d.n_head_kv, d.head_dim],
        "kq_soft_max" => vec![d.n_head, t, n_kv],
        "kqv_out" => vec![t, d.n_head * d.head_dim],
        "ffn_gate" | "ffn_up" | "ffn_act" => vec![t, d.n_ff],
        "logits" => vec![t, d.n_vocab],
        other => panic!("tap {other} is not in docs/trace-format.md"),
    }
}

const DOC_TAPS: [&str; 19] = [
    "embd",
    "attn_norm",
    "q",
    "k",
    "v",
    "q_rope",
    "k_rope",
    "kq_soft_max",
    "kqv_out",
    "attn_out",
    "ffn_inp",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_act",
    "ffn_out",
    "l_out",
    "result_norm",
    "logits",
];

fn per_layer(tap: &str) -> bool {
    !matches!(tap, "embd" | "result_norm" | "logits")
}

/// The raw .npy header: little-endian f32, C order.
fn assert_npy_f32_c(p: &Path) {
    let b = std::fs::read(p).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY", "{}", p.display());
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let h = String::from_utf8_lossy(&b[10..10 + hlen]);
    assert!(h.contains("'descr': '<f4'"), "{}: {h}", p.display());
    assert!(h.contains("'fortran_order': False"), "{}: {h}", p.display());
}

#[test]
fn dump_round_trips() {
    let model = "fixtures/tiny-llama-q8_0.gguf";
    let d = dims(model);
    let text = "Once upon a time";
    let prompt = tokenize(&[model, text]);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("trace");
    let out_s = out.to_str().unwrap();
    ok(&["dump", model, "-p", text, "--steps", "3", "--out", out_s]);

    let tr = Trace::open(&out).unwrap_or_else(|e| panic!("{e}"));
    let m = &tr.manifest;
    assert_eq!(m.format, "parity-trace");
    assert_eq!(m.version, 1);
    assert_eq!(m.model.sha256, sha256_file(&root().join(model)));
    assert_eq!(m.model.path, model);
    assert_eq!(m.producer.name, "parity");
    assert_eq!(m.producer.backend, "reference");

    // Steps: the prefill, then three greedy decode steps (teacher-forced from the greedy ids).
    let greedy = generated_ids(&ok(&[
        "generate",
        model,
        "--tokens",
        &join_ids(&prompt),
        "-n",
        "3",
    ]));
    assert_eq!(m.steps.len(), 4);
    assert_eq!(m.steps[0].step, 0);
    assert_eq!(m.steps[0].tokens, prompt);
    assert_eq!(m.steps[0].positions, (0..prompt.len()).collect::<Vec<_>>());
    assert_eq!(m.steps[0].forced, None, "the prefill is not forced");
    for s in 1..4 {
        let st = &m.steps[s];
        assert_eq!(st.step, s);
        assert_eq!(st.tokens, [greedy[s - 1]], "step {s}: the greedy token");
        assert_eq!(st.positions, [prompt.len() + s - 1], "step {s}");
        assert_eq!(st.forced, Some(true), "step {s}");
    }

    // Every tap of the table, every layer, every step, with the documented shape.
    assert_eq!(m.tensors.len(), 4 * (3 + 16 * d.n_layer));
    for st in &m.steps {
        let t = st.tokens.len();
        let n_kv = st.positions.last().unwrap() + 1;
        for tap in DOC_TAPS {
            let layers: Vec<Option<usize>> = if per_layer(tap) {
                (0..d.n_layer).map(Some).collect()
            } else {
                vec![None]
            };
            for layer in layers {
                let e = m
                    .tensors
                    .iter()
                    .find(|e| e.step == st.step && e.tap == tap && e.layer == layer)
                    .unwrap_or_else(|| panic!("step {} {tap} {layer:?} missing", st.step));
                let want = doc_shape(tap, t, n_kv, &d);
                assert_eq!(e.shape, want, "step {} {tap} {layer:?}", st.step);
                assert_eq!(e.dtype, "<f4");
                let name = match layer {
                    Some(l) => format!("{tap}-{l}"),
                    None => tap.to_string(),
                };
                assert_eq!(e.file, format!("s{:03}/{name}.npy", st.step));
                assert_npy_f32_c(&out.join(&e.file));
                let key = TapKey::new(st.step, layer, Tap::parse(tap).unwrap());
                let a = tr.get(&key).unwrap().expect("listed");
                assert_eq!(a.shape(), want.as_slice());
                assert!(a.iter().all(|x| x.is_finite()), "{key}: non-finite");
                if tap == "kq_soft_max" {
                    // Rows are probability distributions over the cached positions.
                    for row in a.as_slice().unwrap().chunks(n_kv) {
                        let s: f32 = row.iter().sum();
                        assert!((s - 1.0).abs() < 1e-4, "{key}: row sums to {s}");
                    }
                }
            }
        }
    }
    // The greedy token of each step is the argmax of the previous step's logits.
    for s in 1..4 {
        let l = tr
            .get(&TapKey::new(s - 1, None, Tap::Logits))
            .unwrap()
            .unwrap();
        assert_eq!(argmax(&last_row(&l)) as u32, m.steps[s].tokens[0]);
    }

    // A trace equals itself.
    let o = parity(&["diff", out_s, out_s]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("verdict: parity"),
        "{}",
        show(&o)
    );
}

/// `dump --out T.npz` writes the trace a folder dump holds, as one archive: the same
/// manifest (layouts declared included) and every tap with the same bits; numpy's own
/// `np.load` opens it, and `diff` judges it as it judges the folder.
#[test]
fn dump_to_an_npz_archive_is_the_folder_trace() {
    let model = "fixtures/tiny-llama-q8_0.gguf";
    let tmp = tempfile::tempdir().unwrap();
    let (dir, npz) = (tmp.path().join("t"), tmp.path().join("t.npz"));
    let args = |out: &Path| {
        let mut v: Vec<String> = ["dump", model, "--golden", "golden/tiny-llama-q8_0"]
            .map(String::from)
            .to_vec();
        v.extend(["--mutate", "head-major-q-rope", "--declare-layout", "--out"].map(String::from));
        v.push(out.to_str().unwrap().into());
        v
    };
    for out in [&dir, &npz] {
        let a = args(out);
        ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
    }
    assert!(npz.is_file(), "one file");
    let (a, b) = (Trace::open(&dir).unwrap(), Trace::open(&npz).unwrap());
    let strip = |t: &Trace| {
        let mut m = serde_json::to_value(&t.manifest).unwrap();
        m["producer"]["settings"]["command"] = serde_json::Value::Null;
        m
    };
    assert_eq!(strip(&a), strip(&b));
    assert_eq!(b.manifest.layouts["q_rope"], "head-major");
    assert_eq!(a.keys().count(), 175);
    for k in a.keys() {
        let (x, y) = (a.get(k).unwrap().unwrap(), b.get(k).unwrap().unwrap());
        assert_eq!(x.shape(), y.shape(), "{k:?}");
        assert!(
            x.iter()
                .zip(y.iter())
                .all(|(p, q)| p.to_bits() == q.to_bits()),
            "{k:?}"
        );
    }
    for t in [&dir, &npz] {
        let o = parity(&["diff", "golden/tiny-llama-q8_0", t.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    }
    if let Some(py) = numpy_engine_python() {
        let o = Command::new(py)
            .args(["-c", "import numpy as np, sys; z = np.load(sys.argv[1]); print(len(z.files), z['s000/logits'].shape)"])
            .arg(&npz)
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).trim(),
            "176 (20, 393)",
            "{}",
            show(&o)
        );
    }
}

#[test]
fn dump_taps_filter_keeps_only_those() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("t");
    ok(&[
        "dump",
        "fixtures/tiny-llama-q8_0.gguf",
        "--tokens",
        "1,259,300",
        "--steps",
        "2",
        "--taps",
        "l_out|logits",
        "--out",
        out.to_str().unwrap(),
    ]);
    let tr = Trace::open(&out).unwrap();
    let mut names: Vec<String> = tr.manifest.tensors.iter().map(|e| e.file.clone()).collect();
    names.sort();
    let mut want = Vec::new();
    for s in 0..3 {
        for n in ["l_out-0", "l_out-1", "logits"] {
            want.push(format!("s{s:03}/{n}.npy"));
        }
    }
    assert_eq!(names, want);
    // Nothing else was written.
    assert_eq!(npy_files(&out), want);
    // Bad regex: an error naming --taps.
    let o = parity(&[
        "dump",
        "fixtures/tiny-llama-q8_0.gguf",
        "--tokens",
        "1",
        "--taps",
        "l_out(",
        "--out",
        tmp.path().join("bad").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("error: --taps"), "{}", show(&o));
}

#[test]
fn dump_refuses_a_non_empty_folder_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("t");
    std::fs::create_dir(&out).unwrap();
    let keep = out.join("notes.txt");
    std::fs::write(&keep, "mine").unwrap();
    let args = [
        "dump",
        "fixtures/tiny-llama-q8_0.gguf",
        "--tokens",
        "1,259",
        "--steps",
        "1",
        "--out",
        out.to_str().unwrap(),
    ];
    let o = parity(&args);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{}", show(&o));
    assert_eq!(
        err.lines().last(),
        Some(errors[0]),
        "the error is the last line"
    );
    assert!(
        errors[0].contains("not empty") && errors[0].contains("--force"),
        "{}",
        show(&o)
    );
    assert!(!out.join("manifest.json").exists(), "nothing written");
    assert_eq!(std::fs::read_to_string(&keep).unwrap(), "mine");
    // With --force it writes (and leaves the user's file alone).
    let mut forced = args.to_vec();
    forced.push("--force");
    ok(&forced);
    assert!(Trace::open(&out).is_ok());
    assert_eq!(std::fs::read_to_string(&keep).unwrap(), "mine");
}

// ---------------------------------------------------------------------------------------------
// A trace written from Python (scripts/example_numpy_trace.py)

/// A Python with numpy: the repo's .venv, else python3.
fn numpy_python() -> Option<PathBuf> {
    let mut tried = Vec::new();
    for p in [root().join(".venv/bin/python"), PathBuf::from("python3")] {
        let ok = Command::new(&p)
            .args(["-c", "import numpy"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(p);
        }
        tried.push(p.display().to_string());
    }
    eprintln!("skipped: numpy not available (tried {})", tried.join(", "));
    None
}

#[test]
#[cfg_attr(
    not(parity_numpy),
    ignore = "needs numpy (.ci/run installs it; then touch build.rs)"
)]
fn numpy_example_trace_diffs() {
    let Some(py) = numpy_python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("t");
    let o = Command::new(&py)
        .arg(root().join("scripts/example_numpy_trace.py"))
        .arg(&t)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    let tr = Trace::open(&t).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(tr.manifest.steps.len(), 2);
    assert!(tr.manifest.tensors.len() >= 4);
    let ts = t.to_str().unwrap();
    // The example's model is not on disk, so parity cannot read its weight type: it refuses to
    // guess the tolerances until told.
    let o = parity(&["diff", ts, ts]);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--weight-type"),
        "{}",
        show(&o)
    );
    let o = parity(&["diff", ts, ts, "--weight-type", "f32"]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));

    // One value changed → divergence, exit 1, at that tap.
    let c = tmp.path().join("c");
    copy_dir(&t, &c);
    let f = c.join("s001/l_out-0.npy");
    let (shape, mut data) = read_npy(&f);
    data[3] += 0.5;
    write_npy(&f, &shape, &data);
    let json = tmp.path().join("c.json");
    let o = parity(&[
        "diff",
        ts,
        c.to_str().unwrap(),
        "--weight-type",
        "f32",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let key = &j["comparisons"][0]["first_divergence"]["at"]["key"];
    assert_eq!(
        key,
        &serde_json::json!({"step": 1, "layer": 0, "tap": "l_out"}),
        "{}",
        show(&o)
    );
}

#[test]
fn docs_show_the_numpy_example_verbatim() {
    let doc = std::fs::read_to_string(root().join("docs/trace-format.md")).unwrap();
    let script = std::fs::read_to_string(root().join("scripts/example_numpy_trace.py")).unwrap();
    let sec = doc
        .find("## Writing a trace from Python")
        .expect("docs/trace-format.md has the section");
    let rest = &doc[sec..];
    let start = rest.find("```python\n").expect("a python block") + "```python\n".len();
    let end = rest[start..].find("```").unwrap();
    assert_eq!(
        &rest[start..start + end],
        script,
        "docs/trace-format.md and scripts/example_numpy_trace.py disagree"
    );
}

/// 40 greedy tokens of TinyStories-656K-Q8_0 from BOS, against the real llama.cpp run live
/// (its greedy continuation, written by `parity golden`): the fast and emulating reference
/// backends must produce exactly llama.cpp's ids, and the text must be English.
#[test]
#[cfg_attr(
    not(all(parity_llama_cpp, parity_shared)),
    ignore = "needs llama-cpp-python and ../shared/models (.ci/run installs the first; then touch build.rs)"
)]
fn generate_tinystories_40_tokens_matches_live_llama_cpp() {
    let Some(model) = shared("models/TinyStories-656K-Q8_0.gguf") else {
        return;
    };
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("g");
    let m = model.to_str().unwrap();
    ok(&[
        "golden",
        m,
        "--tokens",
        "1",
        "--steps",
        "40",
        "--out",
        out.to_str().unwrap(),
    ]);
    let g = Trace::open(&out).unwrap();
    let llama: Vec<u32> = g.manifest.steps[1..].iter().map(|s| s.tokens[0]).collect();
    assert_eq!(llama.len(), 40);
    for (backend, emulate) in [("fast", "ggml-cpu"), ("reference", "ggml-cpu")] {
        let o = ok(&[
            "generate",
            m,
            "--tokens",
            "1",
            "-n",
            "40",
            "--ignore-eos",
            "--backend",
            backend,
            "--emulate",
            emulate,
        ]);
        assert_eq!(generated_ids(&o), llama, "{backend}: {o}");
        let text = o.lines().next().unwrap_or("");
        let words = text.split_whitespace().count();
        assert!(
            words >= 20 && (text.contains(" the ") || text.contains(" a ")),
            "{text}"
        );
    }
}

/// `parity bench` measures our fast backend and the real llama.cpp in one run and prints their
/// ratios (values are timings, so only their presence and consistency are checked; the
/// numbers themselves live in docs/performance.md). The greedy ids it times are the fast
/// backend's own greedy continuation.
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn bench_reports_both_engines_and_ratios() {
    let args = [
        "bench",
        "fixtures/tiny-llama-q8_0.gguf",
        "--reps",
        "1",
        "--prompt-tokens",
        "8",
        "--gen",
        "4",
        "--threads",
        "2",
        "--json",
    ];
    let o = parity(&args);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("bench --json");
    let fast = &j["parity_fast"];
    let greedy: Vec<u32> = serde_json::from_value(fast["generated"].clone()).unwrap();
    assert_eq!(greedy.len(), 4);
    assert!(fast["pp_tok_s"].as_f64().unwrap() > 0.0);
    assert!(fast["tg_tok_s"].as_f64().unwrap() > 0.0);
    let ll = &j["llama_cpp"];
    assert!(ll["pp_tok_s"].as_f64().unwrap() > 0.0, "{j}");
    let ratio = j["ratio"]["pp"].as_f64().unwrap();
    let expect = fast["pp_tok_s"].as_f64().unwrap() / ll["pp_tok_s"].as_f64().unwrap();
    assert!(
        (ratio - expect).abs() <= 1e-9 * expect,
        "{ratio} vs {expect}"
    );
    // The same greedy ids via generate (fast backend, same prompt ids).
    let ids: Vec<u32> = serde_json::from_value(j["prompt_ids"].clone()).unwrap();
    let out = ok(&[
        "generate",
        "fixtures/tiny-llama-q8_0.gguf",
        "--tokens",
        &join_ids(&ids),
        "-n",
        "4",
        "--ignore-eos",
        "--backend",
        "fast",
    ]);
    assert_eq!(generated_ids(&out), greedy);
}

/// The VNNI tile kernels (Q4_0, Q8_0; AVX-VNNI, else AVX512-VNNI) change no bit: a
/// fast-backend dump with them and one with `PARITY_NO_VNNI=1` are byte-identical, tap for
/// tap, and `parity bench` says which ran.
#[test]
fn vnni_kernels_change_no_tap() {
    #[cfg(target_arch = "x86_64")]
    let (avx2, vex, evex) = (
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"),
        is_x86_feature_detected!("avxvnni"),
        is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl"),
    );
    #[cfg(not(target_arch = "x86_64"))]
    let (avx2, vex, evex) = (false, false, false);
    let label = match (avx2, vex, evex) {
        (true, true, _) => Some("+AVX-VNNI"),
        (true, false, true) => Some("+AVX512-VNNI"),
        _ => None,
    };
    if label.is_none() {
        eprintln!("note: this CPU has no AVX-VNNI or AVX512-VNNI: both runs use the AVX2 kernels");
    }
    let run = |args: &[&str], vnni: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_parity"));
        c.args(args)
            .current_dir(root())
            .env_remove("PARITY_NO_VNNI");
        if !vnni {
            c.env("PARITY_NO_VNNI", "1");
        }
        c.output().expect("run parity")
    };
    let tmp = tempfile::tempdir().unwrap();
    for fixture in ["tiny-llama-q4_0", "tiny-llama-q8_0"] {
        let model = format!("fixtures/{fixture}.gguf");
        let mut dirs = Vec::new();
        for vnni in [true, false] {
            let out = tmp.path().join(format!("{fixture}-{vnni}"));
            let o = run(
                &[
                    "dump",
                    &model,
                    "-p",
                    "Once upon a time",
                    "--steps",
                    "2",
                    "--backend",
                    "fast",
                    "--out",
                    out.to_str().unwrap(),
                ],
                vnni,
            );
            assert!(o.status.success(), "{}", show(&o));
            dirs.push(out);
        }
        let files = npy_files(&dirs[0]);
        assert!(
            files.len() > 40,
            "{fixture}: only {} tap files",
            files.len()
        );
        assert_eq!(files, npy_files(&dirs[1]), "{fixture}: different tap sets");
        for f in &files {
            let a = std::fs::read(dirs[0].join(f)).unwrap();
            let b = std::fs::read(dirs[1].join(f)).unwrap();
            assert!(a == b, "{fixture}: {f} differs with and without VNNI");
        }

        let bench = [
            "bench",
            &model,
            "--no-llama",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--gen",
            "1",
        ];
        let with = run(&bench, true);
        let without = run(&bench, false);
        assert!(
            with.status.success() && without.status.success(),
            "{}",
            show(&with)
        );
        if let Some(label) = label {
            assert!(stdout(&with).contains(label), "{}", show(&with));
        }
        assert!(
            !stdout(&with).contains("VNNI") || label.is_some(),
            "{}",
            show(&with)
        );
        assert!(!stdout(&without).contains("VNNI"), "{}", show(&without));
    }
}

/// Without llama.cpp (a Python that cannot import it), bench refuses in one line with the
/// install hint, exit 2, unless told `--no-llama`; with it, parity's column alone.
#[test]
fn bench_without_llama_cpp_refuses_unless_no_llama() {
    let dir = tempfile::tempdir().unwrap();
    let py = dir.path().join("python");
    std::fs::write(
        &py,
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'llama_cpp'\" >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&py, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let args = [
        "bench",
        "fixtures/tiny-llama-q8_0.gguf",
        "--reps",
        "1",
        "--prompt-tokens",
        "8",
        "--gen",
        "4",
        "--json",
    ];
    let env = [("PARITY_PYTHON", py.to_str().unwrap())];
    let o = common::parity_env(&args, &env);
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    let o = common::parity_env(&[&args[..], &["--no-llama"]].concat(), &env);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("bench --json");
    assert!(
        j["parity_fast"]["tg_tok_s"]
            .as_f64()
            .is_some_and(|v| v > 0.0)
    );
    assert!(j["llama_cpp"].is_null());
}
