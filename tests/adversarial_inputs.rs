//! The reading side of the adversarial suite: every file parity reads (GGUF, manifest.json, tap
//! .npy, golden folders), every model it accepts and every non-finite value it meets.
//!
//! Each case runs the real binary with a time limit (a hang fails the case, it never stalls
//! the suite) and holds it to the project's rule: bad input is one line naming the problem and
//! exit 2; data that is a finding (a NaN in a tap) is exit 1 with the finding named; never a
//! panic. The crafted models are also handed to llama.cpp where it is installed, to check that
//! parity refuses what llama.cpp refuses.

use crate::common;

use common::{copy_dir, root};
use parity::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const FIX: &str = "fixtures/tiny-llama-q8_0.gguf";
const GOLDEN: &str = "golden/tiny-llama-q8_0";
/// No case needs more; a case past it hangs.
const LIMIT: Duration = Duration::from_secs(60);

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Out {
    fn show(&self) -> String {
        format!(
            "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// Run parity in `cwd` with a time limit: killed and failed when it runs past it.
fn run_in(cwd: &Path, args: &[&dyn AsRef<std::ffi::OsStr>]) -> Out {
    let mut c = Command::new(env!("CARGO_BIN_EXE_parity"));
    c.args(args.iter().map(|a| a.as_ref()))
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("run parity");
    // Drain the pipes beside the wait, so a chatty child cannot block on a full pipe.
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let to = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut so, &mut s).ok();
        s
    });
    let te = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut se, &mut s).ok();
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > LIMIT {
            child.kill().ok();
            child.wait().ok();
            panic!(
                "parity {:?} hung (killed after {LIMIT:?})",
                args.iter().map(|a| a.as_ref()).collect::<Vec<_>>()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Out {
        code: status.code(),
        stdout: to.join().unwrap(),
        stderr: te.join().unwrap(),
    }
}

fn run(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Out {
    run_in(&root(), args)
}

/// Exit 2 with exactly one error line holding every word, no panic.
fn refused(o: &Out, words: &[&str]) {
    assert_eq!(o.code, Some(2), "expected exit 2:\n{}", o.show());
    assert!(!o.stderr.contains("panicked"), "{}", o.show());
    let errors: Vec<&str> = o.stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "expected one error line:\n{}", o.show());
    for w in words {
        assert!(
            errors[0].contains(w),
            "the error line lacks '{w}':\n{}",
            o.show()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Crafted models: the committed fixture with one thing changed, as llama.cpp would meet it.

type Tensors = Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>;

/// The fixture rewritten to `dir/name` after `edit` of its metadata and tensors.
fn craft(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Tensors),
) -> PathBuf {
    let f = GgufFile::open(root().join(FIX)).unwrap();
    let mut meta = f.metadata.clone();
    let mut tensors: Tensors = f
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dims.clone(),
                t.ty,
                f.tensor_data(t).to_vec(),
            )
        })
        .collect();
    edit(&mut meta, &mut tensors);
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.set(&k, v);
    }
    for (n, d, ty, data) in tensors {
        w.add_tensor(&n, &d, ty, data);
    }
    let p = dir.join(name);
    w.write(&p).unwrap();
    p
}

fn set(meta: &mut [(String, Value)], key: &str, v: Value) {
    meta.iter_mut().find(|(k, _)| k == key).unwrap().1 = v;
}

/// Q8_0 blocks of `x` (32 values: an f16 scale, 32 int8).
fn q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in x.chunks(32) {
        let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        out.extend_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        for v in b {
            let q = if d == 0.0 { 0.0 } else { (v / d).round() };
            out.push(q as i8 as u8);
        }
    }
    out
}

/// The fixture with `extra` bytes of slack before `output.weight`'s data (its offset moved
/// on by that much, the bytes inserted): every tensor in bounds, none overlapping.
fn with_slack(dir: &Path, extra: u64) -> PathBuf {
    let src = root().join(FIX);
    let f = GgufFile::open(&src).unwrap();
    let t = f.tensor("output.weight").unwrap().clone();
    let mut b = std::fs::read(&src).unwrap();
    // The tensor's index entry: name, n_dims, dims, type, then the offset.
    let mut key = (t.name.len() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(t.name.as_bytes());
    let at = b
        .windows(key.len())
        .position(|w| w == key.as_slice())
        .unwrap();
    let off_at = at + key.len() + 4 + 8 * t.dims.len() + 4;
    let off = u64::from_le_bytes(b[off_at..off_at + 8].try_into().unwrap());
    assert_eq!(off, t.offset);
    b[off_at..off_at + 8].copy_from_slice(&(off + extra).to_le_bytes());
    let data_at = (f.data_offset + off) as usize;
    b.splice(data_at..data_at, std::iter::repeat_n(0u8, extra as usize));
    let p = dir.join("slack.gguf");
    std::fs::write(&p, b).unwrap();
    p
}

/// Every crafted model llama.cpp must refuse (or abort on), with the words parity's refusal
/// must hold.
fn bad_models(dir: &Path) -> Vec<(PathBuf, &'static [&'static str])> {
    vec![
        (
            // A vocabulary of 300 tokens over 393 embedding rows.
            craft(dir, "vocab300.gguf", |m, _| {
                for key in [
                    "tokenizer.ggml.tokens",
                    "tokenizer.ggml.scores",
                    "tokenizer.ggml.token_type",
                ] {
                    let (_, v) = m.iter_mut().find(|(k, _)| k == key).unwrap();
                    if let Value::Array(_, items) = v {
                        items.truncate(300);
                    }
                }
            }),
            &["vocab300.gguf", "300", "393", "token_embd.weight"],
        ),
        (
            // block_count 1 with the tensors of 2 layers.
            craft(dir, "blocks1.gguf", |m, _| {
                set(m, "llama.block_count", Value::U32(1))
            }),
            &["blocks1.gguf", "blk.1.", "block_count"],
        ),
        (
            // A norm stored as Q8_0: llama.cpp's graph asserts on it.
            craft(dir, "q8norm.gguf", |_, t| {
                let n = t
                    .iter_mut()
                    .find(|t| t.0 == "blk.0.attn_norm.weight")
                    .unwrap();
                let x: Vec<f32> =
                    n.3.chunks(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                n.2 = GgmlType::Q8_0;
                n.3 = q8_0(&x);
            }),
            &["q8norm.gguf", "blk.0.attn_norm.weight", "q8_0"],
        ),
        (
            // block_count 3 over the tensors of 2 layers: layer 2's are missing.
            craft(dir, "blocks3.gguf", |m, _| {
                set(m, "llama.block_count", Value::U32(3))
            }),
            &["blocks3.gguf", "block_count", "blk.2."],
        ),
        (
            with_slack(dir, 64),
            &["slack.gguf", "output.weight", "offset"],
        ),
    ]
}

#[test]
fn models_llama_cpp_refuses_are_refused_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let mut models = bad_models(tmp.path());
    // block_count 2^24 passes the hyperparameters' range: refused by its tensors before any
    // per-layer allocation (it reserved 24 GB once).
    models.push((
        craft(tmp.path(), "blocks2p24.gguf", |m, _| {
            set(m, "llama.block_count", Value::U32(1 << 24))
        }),
        &["blocks2p24.gguf", "16777216 layers", "blk.2."],
    ));
    for (p, words) in models {
        for cmd in ["inspect", "generate"] {
            let args: Vec<&dyn AsRef<std::ffi::OsStr>> = if cmd == "inspect" {
                vec![&"inspect", &p]
            } else {
                vec![&"generate", &p, &"--tokens", &"1,2", &"-n", &"1"]
            };
            let o = run(&args);
            // inspect shows a file as it is; it refuses only what cannot be read.
            if cmd == "inspect" {
                assert!(
                    !o.stderr.contains("panicked") && o.code.is_some(),
                    "{}",
                    o.show()
                );
                continue;
            }
            refused(&o, words);
        }
    }
}

/// The same crafted models, handed to llama.cpp: each is refused at load or aborts at its first
/// eval, so parity's refusals hold llama.cpp's line, not a stricter one of its own.
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama.cpp (llama-cpp-python in .venv)"
)]
fn llama_cpp_refuses_the_same_models() {
    if !common::llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut models = bad_models(tmp.path());
    // And the fixture itself loads and evaluates: the probe can tell the two apart.
    models.push((root().join(FIX), &[]));
    for (p, words) in models {
        // A model llama.cpp hangs on (it once sat blocked on one of these) is not one it runs.
        let run = common::status_within(
            Command::new(common::python())
                .args([
                    "-c",
                    "import sys, llama_cpp\n\
                     m = llama_cpp.Llama(sys.argv[1], n_ctx=64, verbose=False)\n\
                     m.eval([1, 2])\n",
                ])
                .arg(&p),
            std::time::Duration::from_secs(120),
        );
        let ok = run.as_ref().is_some_and(|(status, _)| status.success());
        assert_eq!(
            ok,
            words.is_empty(),
            "llama.cpp on {}: {}",
            p.display(),
            match &run {
                Some((status, err)) => format!("exit {status:?}\n{err}"),
                None => "still running after 120 s".into(),
            }
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Non-finite values: a finding of their own (exit 1, named where they first appear), never a
// bug "confirmed by experiment" from them.

/// A copy of the committed golden in `dir/name` with `edit` applied to the values of `tap`'s
/// file of step `step` (e.g. `ffn_out-1`).
fn golden_with(dir: &Path, name: &str, step: usize, tap: &str, edit: fn(&mut [f32])) -> PathBuf {
    let to = dir.join(name);
    copy_dir(&root().join(GOLDEN), &to);
    let f = to.join(format!("s{step:03}/{tap}.npy"));
    let (shape, mut v) = common::read_npy(&f);
    edit(&mut v);
    common::write_npy(&f, &shape, &v);
    to
}

/// `diff` of `base` against `cand` with the model at hand, a JSON report beside: exit 1, the
/// text and the JSON name `words`, and no experiment is said to confirm anything.
fn non_finite_found(base: &Path, cand: &Path, words: &[&str]) {
    let json = cand.with_extension("json");
    let o = run(&[&"diff", &base, &cand, &"--json", &json]);
    assert_eq!(o.code, Some(1), "{}", o.show());
    assert!(!o.stderr.contains("panicked"), "{}", o.show());
    let j = std::fs::read_to_string(&json).unwrap();
    for w in words {
        assert!(o.stdout.contains(w), "the text lacks '{w}':\n{}", o.show());
        assert!(j.contains(w), "the JSON lacks '{w}':\n{j}");
    }
    for t in [&o.stdout, &j] {
        assert!(
            !t.contains("confirmed by experiment") && !t.contains("reproduces your"),
            "a bug confirmed from non-finite data:\n{}",
            o.show()
        );
    }
}

#[test]
fn a_nan_in_the_candidate_is_named_where_it_first_appears() {
    let tmp = tempfile::tempdir().unwrap();
    let cand = golden_with(tmp.path(), "cand", 0, "ffn_out-1", |v| v[5] = f32::NAN);
    non_finite_found(
        &root().join(GOLDEN),
        &cand,
        &["NaN first appears at step 0 layer 1 ffn_out (1 NaN in the candidate, of "],
    );
}

#[test]
fn inf_logits_on_both_sides_are_no_parity() {
    let tmp = tempfile::tempdir().unwrap();
    let inf = |v: &mut [f32]| v[3] = f32::INFINITY;
    let base = golden_with(tmp.path(), "base", 0, "logits", inf);
    let cand = golden_with(tmp.path(), "cand", 0, "logits", inf);
    non_finite_found(
        &base,
        &cand,
        &["Inf first appears at step 0 logits (1 ±Inf in the candidate"],
    );
}

#[test]
fn minus_inf_logits_in_the_candidate_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let cand = golden_with(tmp.path(), "cand", 2, "logits", |v| {
        v[..4].fill(f32::NEG_INFINITY)
    });
    non_finite_found(
        &root().join(GOLDEN),
        &cand,
        &["Inf first appears at step 2 logits (4 ±Inf in the candidate, of "],
    );
}

/// A softmax row NaN in every entry, as an engine's softmax over a row masked everywhere gives,
/// with every other value right: the text says where the NaN sits (whole softmax rows, at
/// position 0) and what gives that, and no known bug is said to reproduce it (the one that
/// masks position 0 out also changes every other row).
#[test]
fn whole_nan_softmax_rows_are_described_from_the_trace() {
    let tmp = tempfile::tempdir().unwrap();
    let cand = golden_with(tmp.path(), "cand", 0, "kq_soft_max-0", |v| {
        // [n_head, t, n_kv]: row 0 of each head.
        let (nh, t) = (4, 20);
        let n_kv = v.len() / (nh * t);
        for h in 0..nh {
            v[h * t * n_kv..][..n_kv].fill(f32::NAN);
        }
    });
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cand.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(m["steps"][0]["tokens"].as_array().unwrap().len(), 20);
    non_finite_found(
        &root().join(GOLDEN),
        &cand,
        &[
            "NaN first appears at step 0 layer 0 kq_soft_max",
            "non-finite: every value of 4 of 80 softmax rows (position 0)",
            "a softmax over a row masked everywhere",
            "no known bug reproduces it",
        ],
    );
}

/// An engine whose causal mask leaves each row's own position out: position 0 sees nothing
/// and its softmax is NaN. Named by experiment, from the full dump (at kq_soft_max) and from
/// its sparse cut (at layer 0's l_out, where position 0's row is NaN): the replay with that
/// bug puts NaN at exactly the candidate's places and reproduces the finite rest.
#[test]
fn a_mask_that_hides_a_rows_own_position_is_named_from_its_nan() {
    let tmp = tempfile::tempdir().unwrap();
    let full = tmp.path().join("full");
    let o = run(&[
        &"dump",
        &FIX,
        &"--golden",
        &GOLDEN,
        &"--mutate",
        &"causal-mask-excludes-self",
        &"--out",
        &full,
    ]);
    assert_eq!(o.code, Some(0), "{}", o.show());
    let sparse = tmp.path().join("sparse");
    common::sparse_copy(&full, &sparse);
    for (trace, place, rows) in [
        (
            &full,
            "step 0 layer 0 kq_soft_max",
            "softmax rows (position 0)",
        ),
        (
            &sparse,
            "step 0 layer 0 l_out",
            "every value of 1 of 20 token rows (position 0)",
        ),
    ] {
        let o = run(&[&"diff", &GOLDEN, trace]);
        assert_eq!(o.code, Some(1), "{}", o.show());
        for w in [
            &format!("NaN first appears at {place}") as &str,
            rows,
            "confirmed by experiment: causal-mask-excludes-self reproduces it",
        ] {
            assert!(
                o.stdout.contains(w),
                "{}: lacks '{w}'\n{}",
                trace.display(),
                o.show()
            );
        }
    }
}

/// A NaN in the golden: the candidate (the clean golden) judges clean on its own inputs, and
/// the end-to-end comparison names the baseline's NaN.
#[test]
fn a_nan_in_the_golden_is_named_as_the_baselines() {
    let tmp = tempfile::tempdir().unwrap();
    let base = golden_with(tmp.path(), "base", 0, "ffn_out-1", |v| v[0] = f32::NAN);
    let cand = tmp.path().join("cand");
    copy_dir(&root().join(GOLDEN), &cand);
    non_finite_found(
        &base,
        &cand,
        &["NaN first appears at step 0 layer 1 ffn_out (1 NaN in the baseline"],
    );
}

// ---------------------------------------------------------------------------------------------
// A property: `diff`'s library call on a committed golden with one random corruption of its
// manifest or of a tap file never panics and never hangs; it refuses (Err: exit 2) or names a
// finding.

use proptest::prelude::*;
use serde_json::Value as Json;

/// One corruption, its choices drawn as indices (reduced modulo what the golden holds).
#[derive(Clone, Debug)]
enum Corrupt {
    /// Remove a field of any object in the manifest.
    Remove(usize),
    /// Give a value another type.
    Retype(usize, usize),
    /// A number set huge, negative or fractional.
    Number(usize, usize),
    /// A position set to any value.
    Position(usize, u64),
    /// A tensor's shape in the manifest changed.
    Shape(usize, Vec<u64>),
    /// A tap file cut short (keep this many thousandths).
    Truncate(usize, u16),
    /// A tap file's header states another shape.
    HeaderShape(usize, Vec<u64>),
    /// A tap file's header states another dtype.
    Dtype(usize, usize),
    /// A byte of a tap file's header changed.
    Flip(usize, usize, u8),
}

fn corrupt() -> impl Strategy<Value = Corrupt> {
    let dims = || {
        prop::collection::vec(
            prop_oneof![0u64..300, Just(u64::MAX), Just(1 << 32), Just(1 << 62)],
            0..4,
        )
    };
    prop_oneof![
        any::<usize>().prop_map(Corrupt::Remove),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Corrupt::Retype(a, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Corrupt::Number(a, b)),
        (
            any::<usize>(),
            prop_oneof![0u64..64, Just(u64::MAX), Just(1 << 40), any::<u64>()]
        )
            .prop_map(|(a, p)| Corrupt::Position(a, p)),
        (any::<usize>(), dims()).prop_map(|(a, d)| Corrupt::Shape(a, d)),
        (any::<usize>(), 0u16..1000).prop_map(|(a, k)| Corrupt::Truncate(a, k)),
        (any::<usize>(), dims()).prop_map(|(a, d)| Corrupt::HeaderShape(a, d)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Corrupt::Dtype(a, b)),
        (any::<usize>(), 0usize..128, any::<u8>()).prop_map(|(a, i, b)| Corrupt::Flip(a, i, b)),
    ]
}

/// JSON pointers of every value under `v` (`leaf` keeps only some).
fn pointers(v: &Json, at: String, keep: &dyn Fn(&Json) -> bool, out: &mut Vec<String>) {
    if keep(v) {
        out.push(at.clone());
    }
    match v {
        Json::Object(m) => {
            for (k, x) in m {
                // RFC 6901: a key's '~' and '/' are escaped ("kq_soft_max=softmax(q.k/sqrt(d))").
                let k = k.replace('~', "~0").replace('/', "~1");
                pointers(x, format!("{at}/{k}"), keep, out);
            }
        }
        Json::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), keep, out);
            }
        }
        _ => {}
    }
}

/// A .npy header stating `descr` and `shape` before the data of `bytes` (a version 1 file).
fn npy_header(bytes: &[u8], descr: &str, shape: &[u64]) -> Vec<u8> {
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let data = &bytes[10 + hlen..];
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple}, }}");
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut out = bytes[..8].to_vec();
    out.extend_from_slice(&(h.len() as u16).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Apply `c` to the trace folder `dir`.
fn apply(dir: &Path, c: &Corrupt) {
    let mpath = dir.join("manifest.json");
    let mut m: Json = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    let files: Vec<String> = m["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["file"].as_str().unwrap().to_string())
        .collect();
    let tap = |i: usize| dir.join(&files[i % files.len()]);
    let pick = |i: usize, keep: &dyn Fn(&Json) -> bool| {
        let mut ps = Vec::new();
        pointers(&m, String::new(), keep, &mut ps);
        ps.retain(|p| !p.is_empty());
        ps[i % ps.len()].clone()
    };
    match c {
        Corrupt::Remove(i) => {
            let p = pick(*i, &|_| true);
            let (parent, key) = p.rsplit_once('/').unwrap();
            let key = &key.replace("~1", "/").replace("~0", "~");
            match m.pointer_mut(parent).unwrap() {
                Json::Object(o) => {
                    o.remove(key);
                }
                Json::Array(a) => {
                    a.remove(key.parse::<usize>().unwrap());
                }
                _ => unreachable!(),
            }
        }
        Corrupt::Retype(i, t) => {
            let p = pick(*i, &|_| true);
            let to = [
                Json::Null,
                Json::Bool(true),
                Json::from("x"),
                Json::Array(vec![]),
                Json::Object(Default::default()),
                Json::from(1.5),
                Json::from(-1),
            ];
            *m.pointer_mut(&p).unwrap() = to[t % to.len()].clone();
        }
        Corrupt::Number(i, n) => {
            let p = pick(*i, &|v| v.is_number());
            let to = [
                Json::from(u64::MAX),
                Json::from(i64::MIN),
                Json::from(-1),
                Json::from(1e300),
                Json::from(1u64 << 53),
                Json::from(1u64 << 32),
                Json::from(0.5),
                Json::from(0),
            ];
            *m.pointer_mut(&p).unwrap() = to[n % to.len()].clone();
        }
        Corrupt::Position(i, v) => {
            let mut ps = Vec::new();
            pointers(&m, String::new(), &|v| v.is_number(), &mut ps);
            ps.retain(|p| p.contains("/positions/"));
            let p = ps[i % ps.len()].clone();
            *m.pointer_mut(&p).unwrap() = Json::from(*v);
        }
        Corrupt::Shape(i, d) => {
            let n = m["tensors"].as_array().unwrap().len();
            m["tensors"][i % n]["shape"] = Json::from(d.clone());
        }
        Corrupt::Truncate(i, k) => {
            let f = tap(*i);
            let b = std::fs::read(&f).unwrap();
            std::fs::write(&f, &b[..b.len() * *k as usize / 1000]).unwrap();
        }
        Corrupt::HeaderShape(i, d) => {
            let f = tap(*i);
            let b = std::fs::read(&f).unwrap();
            std::fs::write(&f, npy_header(&b, "<f4", d)).unwrap();
        }
        Corrupt::Dtype(i, t) => {
            let f = tap(*i);
            let b = std::fs::read(&f).unwrap();
            let (shape, _) = common::read_npy(&f);
            let to = ["<f8", "<f2", ">f4", "|u1", "<i4", "|b1", "<c8", "<U3", "|O"];
            std::fs::write(&f, npy_header(&b, to[t % to.len()], &shape)).unwrap();
        }
        Corrupt::Flip(i, at, byte) => {
            let f = tap(*i);
            let mut b = std::fs::read(&f).unwrap();
            b[at % 128] = *byte;
            std::fs::write(&f, b).unwrap();
        }
    }
    std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

/// What `parity diff GOLDEN CAND` decides, as its library call, in a thread with a time limit:
/// Ok(None) for an Err (exit 2, its message), Ok(Some(diverged)) for a verdict, Err for a
/// panic or a hang.
fn diff_outcome(base: PathBuf, cand: PathBuf) -> Result<Result<bool, String>, String> {
    use parity::judge::verdict::{DiffOptions, diff};
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let run = || -> Result<bool, String> {
            let base = parity::trace::Trace::open(&base).map_err(|e| e.to_string())?;
            let cand = parity::trace::Trace::open(&cand).map_err(|e| e.to_string())?;
            let model = parity::model::Model::open(root().join(FIX)).unwrap();
            let opt = DiffOptions::new(model.main_weight_type());
            let d = diff(&base, &cand, Some(&model), &opt).map_err(|e| e.to_string())?;
            // A divergence is named: where, at least.
            assert!(!d.verdict.diverged || d.verdict.place.is_some());
            Ok(d.verdict.diverged)
        };
        tx.send(run()).ok();
    });
    match rx.recv_timeout(LIMIT) {
        Ok(r) => Ok(r),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(format!("hung past {LIMIT:?}")),
        Err(_) => Err("panicked".into()),
    }
}

proptest! {
    // Each case judges the tiny golden once (a fraction of a second): a modest count.
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn diff_of_a_corrupted_trace_refuses_or_finds(c in corrupt(), baseline_side in any::<bool>()) {
        let tmp = tempfile::tempdir().unwrap();
        let bad = tmp.path().join("bad");
        copy_dir(&root().join(GOLDEN), &bad);
        apply(&bad, &c);
        let (base, cand) = if baseline_side {
            (bad, root().join(GOLDEN))
        } else {
            (root().join(GOLDEN), bad)
        };
        match diff_outcome(base, cand) {
            Err(e) => prop_assert!(false, "{c:?}: {e}"),
            // A refusal is one line.
            Ok(Err(msg)) => prop_assert!(!msg.is_empty() && !msg.contains('\n'), "{c:?}: {msg:?}"),
            Ok(Ok(_)) => {}
        }
    }
}

/// The corruptions reach values under keys holding a '/' (the manifest's
/// "kq_soft_max=softmax(q.k/sqrt(d))"): their pointers are escaped (RFC 6901). This case once
/// panicked in `apply` itself (two proptest cases seen).
#[test]
fn corruptions_reach_values_under_keys_holding_a_slash() {
    for c in [
        Corrupt::Number(18093315437754228553, 0),
        Corrupt::Number(15051761409519340113, 0),
        Corrupt::Remove(18093315437754228553),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let bad = tmp.path().join("bad");
        copy_dir(&root().join(GOLDEN), &bad);
        apply(&bad, &c);
        match diff_outcome(root().join(GOLDEN), bad) {
            Err(e) => panic!("{c:?}: {e}"),
            Ok(Err(msg)) => assert!(!msg.contains('\n'), "{c:?}: {msg:?}"),
            Ok(Ok(_)) => {}
        }
    }
}

/// The same kinds of corruption through the binary, with a time limit: one line, exit 2.
#[test]
fn corrupted_traces_are_refused_by_the_cli_in_one_line() {
    let cases: Vec<(Corrupt, &[&str])> = vec![
        (Corrupt::Truncate(7, 500), &["truncated", ".npy"]),
        (
            Corrupt::HeaderShape(7, vec![1 << 62, 4]),
            &["shape", ".npy"],
        ),
        (Corrupt::Dtype(7, 3), &["dtype", "not a float type"]),
        (Corrupt::Position(1, u64::MAX), &["manifest", "position"]),
        (Corrupt::Shape(7, vec![3, 3]), &["manifest", "shape"]),
    ];
    for (c, words) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let bad = tmp.path().join("bad");
        copy_dir(&root().join(GOLDEN), &bad);
        apply(&bad, &c);
        let o = run(&[&"diff", &root().join(GOLDEN), &bad]);
        refused(&o, words);
    }
}

// ---------------------------------------------------------------------------------------------
// `golden` of a model llama.cpp aborts on: llama.cpp's own assertion line, no debugger noise,
// no hint naming a flag `golden` lacks, "--verbose" once; nothing left behind.

#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama.cpp (llama-cpp-python in .venv)"
)]
fn golden_shows_llama_cpps_own_abort_line() {
    if !common::llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // A negative RMS epsilon: parity reads it, llama.cpp asserts at its first norm.
    let neg = craft(tmp.path(), "negeps.gguf", |m, _| {
        set(
            m,
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(-1e-5),
        )
    });
    let out = tmp.path().join("g");
    let o = run(&[
        &"golden",
        &neg,
        &"--tokens",
        &"1,2,3",
        &"--steps",
        &"1",
        &"--out",
        &out,
    ]);
    refused(
        &o,
        &["llama.cpp aborted", "GGML_ASSERT(eps >= 0.0f) failed"],
    );
    let all = format!("{}{}", o.stdout, o.stderr);
    for noise in ["libc-start", "gdb", "#0 ", "Inferior", "--no-check"] {
        assert!(!all.contains(noise), "'{noise}' shown:\n{}", o.show());
    }
    assert_eq!(all.matches("--verbose").count(), 1, "{}", o.show());
    // Nothing published, no staging folder left.
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".gguf"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");

    // A Q8_0 norm: refused by parity before llama.cpp runs (llama.cpp would abort the same way).
    let q8 = bad_models(tmp.path()).swap_remove(2);
    let o = run(&[
        &"golden",
        &q8.0,
        &"--tokens",
        &"1,2,3",
        &"--steps",
        &"1",
        &"--out",
        &out,
    ]);
    refused(&o, q8.1);
}
