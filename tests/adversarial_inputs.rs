//! The reading side of the adversarial suite: every file parity reads (GGUF, manifest.json, tap
//! .npy, golden folders), every model it accepts and every non-finite value it meets.
//!
//! Each case runs the real binary with a time limit (a hang fails the case, it never stalls
//! the suite) and holds it to the project's rule: bad input is one line naming the problem and
//! exit 2; data that is a finding (a NaN in a tap) is exit 1 with the finding named; never a
//! panic. The crafted models are also handed to llama.cpp where it is installed, to check that
//! parity refuses what llama.cpp refuses.

mod common;

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
        let o = Command::new(common::python())
            .args([
                "-c",
                "import sys, llama_cpp\n\
                 m = llama_cpp.Llama(sys.argv[1], n_ctx=64, verbose=False)\n\
                 m.eval([1, 2])\n",
            ])
            .arg(&p)
            .output()
            .unwrap();
        let ok = o.status.success();
        assert_eq!(
            ok,
            words.is_empty(),
            "llama.cpp on {}: exit {:?}\n{}",
            p.display(),
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
