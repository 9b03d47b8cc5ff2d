//! The adversarial CLI suite: every bad input a user can hand parity, as a table row: the crafted
//! input (made in a temporary folder), the command, the exit code, the words the one error line
//! must hold, and, where it applies, a check that nothing half-written was left behind.
//!
//! Bad input is answered with one line on stderr and exit code 2: never a panic (101), an abort
//! (134), a signal, a Python traceback, or exit 1 (which means "divergence found").
//! Rows that need ../shared or llama.cpp (the repository's .venv) are their own tests, shown as
//! ignored when build.rs did not find them.

use crate::common;

use common::{copy_dir, root, shared};
use parity::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const FIX: &str = "fixtures/tiny-llama-q8_0.gguf";
const GOLDEN: &str = "golden/tiny-llama-q8_0";

/// What a row needs beyond the repository.
#[derive(Clone, Copy, PartialEq)]
enum Need {
    /// A path under ../shared.
    Shared(&'static str),
    /// A Python with llama_cpp and numpy (as `parity golden` picks it).
    Llama,
}

struct Case {
    name: &'static str,
    needs: &'static [Need],
    /// Crafts the input in the temp folder and returns the arguments.
    args: fn(&Path) -> Vec<OsString>,
    /// Extra environment.
    env: &'static [(&'static str, &'static str)],
    /// Send stdout to this file instead of a pipe (`/dev/full`).
    stdout_to: Option<&'static str>,
    code: i32,
    /// Words the stderr's error line must contain (exit 2), or stdout+stderr (exit 0).
    words: &'static [&'static str],
    /// Afterwards: what must (not) be in the temp folder. Returns a complaint.
    after: Option<fn(&Path) -> Option<String>>,
}

fn os(v: &[&dyn AsRef<OsStr>]) -> Vec<OsString> {
    v.iter().map(|s| s.as_ref().to_os_string()).collect()
}

fn fix() -> PathBuf {
    root().join(FIX)
}

/// A non-UTF-8 file name inside `dir`.
fn non_utf8(dir: &Path, stem: &str) -> PathBuf {
    let mut b = stem.as_bytes().to_vec();
    b.extend_from_slice(b"-\xff\xfe");
    dir.join(OsStr::from_bytes(&b))
}

/// Nothing half-written: no temporary `.NAME.partial-PID` left in `dir`, and none of `names`.
fn clean(dir: &Path, names: &[&str]) -> Option<String> {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if n.contains(".partial-") {
            return Some(format!("left behind: {n}"));
        }
        if names.contains(&n.as_str()) {
            return Some(format!("left behind: {n}"));
        }
    }
    None
}

/// The committed fixture rewritten to `dir/name` with metadata `edits`, and every value of
/// tensor `nan` (an f32 tensor) made NaN.
fn rewrite_fixture(dir: &Path, name: &str, edits: &[(&str, Value)], nan: Option<&str>) -> PathBuf {
    let f = GgufFile::open(fix()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in &f.metadata {
        w.set(k, v.clone());
    }
    for (k, v) in edits {
        w.set(k, v.clone());
    }
    for t in &f.tensors {
        let mut data = f.tensor_data(t).to_vec();
        if Some(t.name.as_str()) == nan {
            assert_eq!(t.ty, GgmlType::F32, "{}", t.name);
            for c in data.chunks_mut(4) {
                c.copy_from_slice(&f32::NAN.to_le_bytes());
            }
        }
        w.add_tensor(&t.name, &t.dims, t.ty, data);
    }
    let p = dir.join(name);
    w.write(&p).unwrap();
    p
}

/// A process id that ran and has ended.
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

fn truncated_copy(dir: &Path, src: &Path, keep: usize) -> PathBuf {
    let b = std::fs::read(src).unwrap();
    let p = dir.join("truncated.gguf");
    std::fs::write(&p, &b[..keep.min(b.len())]).unwrap();
    p
}

/// A .npy file image (format 1.0) with the given dtype descr, C order.
fn npy_image(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_txt = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_txt}, }}");
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(h.len() as u16).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out
}

use common::golden_unknown_model as trace_copy;

/// Rewrite the trace's logits as `descr` (`<f2` or `<f8`).
fn logits_as(d: &Path, descr: &str) {
    let p = d.join("s000/logits.npy");
    let (shape, data) = common::read_npy(&p);
    let shape: Vec<usize> = shape.iter().map(|&x| x as usize).collect();
    let bytes: Vec<u8> = match descr {
        "<f2" => data
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
        "<f8" => data
            .iter()
            .flat_map(|&x| (x as f64).to_le_bytes())
            .collect(),
        _ => unreachable!(),
    };
    std::fs::write(&p, npy_image(descr, &shape, &bytes)).unwrap();
}

/// A Python stand-in for `parity golden`: passes the llama_cpp probe, then fails the way a
/// crashing script does (a traceback, exit 1).
fn fake_python(dir: &Path) -> PathBuf {
    let p = dir.join("fake-python");
    std::fs::write(
        &p,
        "#!/bin/sh\n[ \"$1\" = -I ] && shift\nif [ \"$1\" = -c ]; then exit 0; fi\n\
         echo 'Traceback (most recent call last):' >&2\n\
         echo '  File \"llama_golden.py\", line 1, in <module>' >&2\n\
         echo 'MemoryError' >&2\nexit 1\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// A Python stand-in whose run dies by a signal after starting its temporary output folder,
/// the way llama.cpp's GGML_ABORT kills the script (no atexit cleanup).
fn aborting_python(dir: &Path) -> PathBuf {
    let p = dir.join("abort-python");
    std::fs::write(
        &p,
        "#!/bin/sh\n[ \"$1\" = -I ] && shift\nif [ \"$1\" = -c ]; then exit 0; fi\n\
         mkdir \"$(dirname \"$4\")/.$(basename \"$4\").partial-$$\"\n\
         echo 'GGML_ASSERT(false) failed' >&2\nkill -ABRT $$\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn cases() -> Vec<Case> {
    vec![
        // ---- dump: paths as OsStr, traces written under a temporary name and renamed
        Case {
            name: "dump to a non-UTF-8 folder",
            needs: &[],
            args: |d| {
                os(&[
                    &"dump",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--steps",
                    &"1",
                    &"--out",
                    &non_utf8(d, "trace"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["wrote"],
            after: Some(|d| {
                let t = non_utf8(d, "trace");
                if !t.join("manifest.json").is_file() {
                    return Some("no manifest.json in the non-UTF-8 folder".into());
                }
                clean(d, &[])
            }),
        },
        Case {
            name: "dump past the context leaves nothing",
            needs: &[],
            args: |d| {
                os(&[
                    &"dump",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--steps",
                    &"100000",
                    &"--out",
                    &d.join("t"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--steps 100000", "exceed the model's context of 256"],
            after: Some(|d| clean(d, &["t"])),
        },
        Case {
            name: "dump --force over a trace keeps other files",
            needs: &[],
            args: |d| {
                let t = d.join("t");
                copy_dir(&root().join(GOLDEN), &t);
                std::fs::write(t.join("notes.txt"), "mine").unwrap();
                os(&[
                    &"dump",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--steps",
                    &"1",
                    &"--out",
                    &t,
                    &"--force",
                ])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["wrote"],
            after: Some(|d| {
                let t = d.join("t");
                if std::fs::read_to_string(t.join("notes.txt")).ok().as_deref() != Some("mine") {
                    return Some("--force removed a file that is not part of a trace".into());
                }
                let m = std::fs::read_to_string(t.join("manifest.json")).unwrap();
                if !m.contains("\"parity\"") {
                    return Some("the manifest is not the new trace's".into());
                }
                if t.join("s004").exists() {
                    return Some("the old trace's step 4 is still there".into());
                }
                clean(d, &[])
            }),
        },
        Case {
            name: "dump into a non-empty folder without --force",
            needs: &[],
            args: |d| {
                std::fs::create_dir(d.join("t")).unwrap();
                std::fs::write(d.join("t/x"), "x").unwrap();
                os(&[&"dump", &fix(), &"-p", &"hi", &"--out", &d.join("t")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["not empty", "--force"],
            after: Some(|d| clean(d, &[])),
        },
        // ---- limits
        Case {
            name: "generate --threads 100000 (capped)",
            needs: &[],
            args: |_| {
                os(&[
                    &"generate",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"-n",
                    &"2",
                    &"--backend",
                    &"fast",
                    &"--threads",
                    &"100000",
                ])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["ids:", "note: --threads 100000 capped at"],
            after: None,
        },
        Case {
            name: "generate past the context, refused up front",
            needs: &[],
            args: |_| {
                os(&[
                    &"generate",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"-n",
                    &"1000",
                    &"--ignore-eos",
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["-n 1000", "exceed the model's context of 256"],
            after: None,
        },
        Case {
            name: "dump --golden past the context of another model",
            needs: &[],
            args: |d| {
                let m = rewrite_fixture(
                    d,
                    "short.gguf",
                    &[("llama.context_length", Value::U32(6))],
                    None,
                );
                // The golden's model check skipped (`"sha256": ""`): the context is what fails.
                let g = trace_copy(d, "g", |_, m| m["model"]["sha256"] = "".into());
                os(&[&"dump", &m, &"--golden", &g, &"--out", &d.join("t")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["forced decode ids", "exceed the model's context of 6"],
            after: Some(|d| clean(d, &["t"])),
        },
        Case {
            name: "dump clears a killed run's leftover staging folder",
            needs: &[],
            args: |d| {
                let dead = dead_pid();
                std::fs::create_dir_all(d.join(format!(".t.partial-{dead}/s000"))).unwrap();
                std::fs::create_dir_all(d.join(format!(".t.partial-{dead}.gone"))).unwrap();
                // Another writer's folder, alive (this test process), and folders that are not
                // this output's: kept.
                std::fs::create_dir(d.join(format!(".t.partial-{}", std::process::id()))).unwrap();
                std::fs::create_dir(d.join(format!(".tt.partial-{dead}"))).unwrap();
                std::fs::create_dir(d.join(".t.partial-notapid")).unwrap();
                std::fs::write(d.join("dead-pid"), dead.to_string()).unwrap();
                os(&[
                    &"dump",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--steps",
                    &"1",
                    &"--out",
                    &d.join("t"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["wrote"],
            after: Some(|d| {
                let mut left: Vec<String> = std::fs::read_dir(d)
                    .unwrap()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.contains(".partial-"))
                    .collect();
                left.sort();
                let dead = std::fs::read_to_string(d.join("dead-pid")).unwrap();
                let mut want = vec![
                    format!(".t.partial-{}", std::process::id()),
                    ".t.partial-notapid".to_string(),
                    format!(".tt.partial-{dead}"),
                ];
                want.sort();
                if left != want {
                    return Some(format!("staging folders left: {left:?}"));
                }
                (!d.join("t/manifest.json").is_file()).then(|| "no trace written".into())
            }),
        },
        Case {
            name: "generate names its backend and warns it rounds unlike llama.cpp",
            needs: &[],
            args: |_| os(&[&"generate", &fix(), &"-p", &"hi", &"-n", &"2"]),
            env: &[],
            stdout_to: None,
            code: 0,
            words: &[
                "prompt ids: 1 388 268 — BOS <s> (1) prepended",
                "backend: reference (plain f32 activations; q8_0 weights)",
                "warning: llama.cpp rounds activations before q8_0 matmuls",
                "--emulate ggml-cpu",
            ],
            after: None,
        },
        Case {
            name: "generate --backend fast: llama.cpp's rounding, no warning",
            needs: &[],
            args: |_| {
                os(&[
                    &"generate",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"-n",
                    &"2",
                    &"--backend",
                    &"fast",
                ])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["backend: fast (activations rounded as llama.cpp's CPU backend does"],
            after: None,
        },
        Case {
            name: "generate --backend fast --emulate none (ignored before)",
            needs: &[],
            args: |_| {
                os(&[
                    &"generate",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--backend",
                    &"fast",
                    &"--emulate",
                    &"none",
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--backend fast always rounds", "--emulate none"],
            after: None,
        },
        Case {
            name: "generate on a model whose logits are NaN",
            needs: &[],
            args: |d| {
                let m = rewrite_fixture(d, "nan.gguf", &[], Some("output_norm.weight"));
                os(&[&"generate", &m, &"-p", &"hi", &"-n", &"3"])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["logits at step 0 are not finite", "NaN"],
            after: None,
        },
        Case {
            name: "mutate double-bos without a BOS says so in words",
            needs: &[],
            args: |_| {
                os(&[
                    &"generate",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--no-bos",
                    &"--mutate",
                    &"double-bos",
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["do not start with the model's BOS (1)"],
            after: None,
        },
        // ---- tokenization as llama.cpp: add_eos_token, BERT's [CLS] … [SEP]
        Case {
            name: "tokenize on an add_eos_token model appends EOS",
            needs: &[],
            args: |d| {
                let m = rewrite_fixture(
                    d,
                    "eos.gguf",
                    &[("tokenizer.ggml.add_eos_token", Value::Bool(true))],
                    None,
                );
                os(&[&"tokenize", &m, &"hi"])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["1 388 268 2\n"],
            after: None,
        },
        Case {
            name: "tokenize --no-eos on an add_eos_token model",
            needs: &[],
            args: |d| {
                let m = rewrite_fixture(
                    d,
                    "eos.gguf",
                    &[("tokenizer.ggml.add_eos_token", Value::Bool(true))],
                    None,
                );
                os(&[&"tokenize", &m, &"--no-eos", &"hi"])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["1 388 268\n"],
            after: None,
        },
        Case {
            name: "tokenize on the BERT vocabulary: [CLS] … [SEP]",
            needs: &[Need::Shared("vocab/ggml-vocab-bert-bge.gguf")],
            args: |_| {
                let v = shared("vocab/ggml-vocab-bert-bge.gguf").unwrap();
                os(&[&"tokenize", &v, &"Hello world"])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["101 7592 2088 102\n"],
            after: None,
        },
        Case {
            name: "golden then check on an add_eos_token model",
            needs: &[Need::Llama],
            args: |d| {
                let m = rewrite_fixture(
                    d,
                    "eos.gguf",
                    &[("tokenizer.ggml.add_eos_token", Value::Bool(true))],
                    None,
                );
                let g = d.join("g");
                let o = Command::new(env!("CARGO_BIN_EXE_parity"))
                    .args([
                        OsStr::new("golden"),
                        m.as_os_str(),
                        OsStr::new("-p"),
                        OsStr::new("hi"),
                    ])
                    .args([
                        OsStr::new("--steps"),
                        OsStr::new("2"),
                        OsStr::new("--out"),
                        g.as_os_str(),
                    ])
                    .output()
                    .unwrap();
                assert!(
                    o.status.success(),
                    "golden: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                let man = std::fs::read_to_string(g.join("manifest.json")).unwrap();
                let man: serde_json::Value = serde_json::from_str(&man).unwrap();
                assert_eq!(
                    man["steps"][0]["tokens"],
                    serde_json::json!([1, 388, 268, 2])
                );
                os(&[&"check", &m, &"-p", &"hi", &"--golden", &g])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            // The default verdict line (its comparison count depends on the machine's GPU).
            words: Box::leak(Box::new([
                "EOS </s> (2) appended",
                common::default_verdict().leak(),
            ])),
            after: None,
        },
        Case {
            name: "a zip file as model: its magic shown as bytes and text",
            needs: &[],
            args: |d| {
                let p = d.join("model.gguf");
                std::fs::write(&p, b"PK\x03\x04 not a model at all, a zip").unwrap();
                os(&[&"inspect", &p])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["not a GGUF file", "50 4B 03 04 (\"PK\\x03\\x04\")"],
            after: None,
        },
        Case {
            name: "check with a golden made for other ids",
            needs: &[],
            args: |_| {
                os(&[
                    &"check",
                    &fix(),
                    &"-p",
                    &"a prompt the golden was not made for",
                    &"--golden",
                    &root().join(GOLDEN),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &[
                "other token ids (1 ",
                "not these (1 ",
                "without -p/--tokens",
            ],
            after: None,
        },
        Case {
            name: "inspect --json > /dev/full",
            needs: &[],
            args: |_| os(&[&"inspect", &"--json", &fix()]),
            env: &[],
            stdout_to: Some("/dev/full"),
            code: 2,
            words: &["cannot write to stdout", "No space left"],
            after: None,
        },
        Case {
            name: "tokenize > /dev/full",
            needs: &[],
            args: |_| os(&[&"tokenize", &fix(), &"hi"]),
            env: &[],
            stdout_to: Some("/dev/full"),
            code: 2,
            words: &["cannot write to stdout"],
            after: None,
        },
        Case {
            name: "fixture --n-embd 1000000 --n-layer 100",
            needs: &[],
            args: |d| {
                os(&[
                    &"fixture",
                    &"--n-embd",
                    &"1000000",
                    &"--n-layer",
                    &"100",
                    &"-o",
                    &d.join("big.gguf"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["GiB", "limit"],
            after: Some(|d| clean(d, &["big.gguf"])),
        },
        Case {
            name: "fixture --n-embd 0",
            needs: &[],
            args: |d| os(&[&"fixture", &"--n-embd", &"0", &"-o", &d.join("z.gguf")]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--n-embd", "at least 1"],
            after: Some(|d| clean(d, &["z.gguf"])),
        },
        Case {
            name: "fixture --rope-scale 0",
            needs: &[],
            args: |d| os(&[&"fixture", &"--rope-scale", &"0", &"-o", &d.join("z.gguf")]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--rope-scale 0", "positive"],
            after: Some(|d| clean(d, &["z.gguf"])),
        },
        Case {
            name: "fixture --rope-scale NaN",
            needs: &[],
            args: |d| {
                os(&[
                    &"fixture",
                    &"--rope-scale",
                    &"NaN",
                    &"-o",
                    &d.join("z.gguf"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--rope-scale NaN", "positive"],
            after: Some(|d| clean(d, &["z.gguf"])),
        },
        Case {
            name: "fixture --arch phi3 --rope-scale 4",
            needs: &[],
            args: |d| {
                os(&[
                    &"fixture",
                    &"--arch",
                    &"phi3",
                    &"--rope-scale",
                    &"4",
                    &"-o",
                    &d.join("z.gguf"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--rope-scale", "phi3", "LongRoPE"],
            after: Some(|d| clean(d, &["z.gguf"])),
        },
        Case {
            name: "fixture --qk-gain 0",
            needs: &[],
            args: |d| os(&[&"fixture", &"--qk-gain", &"0", &"-o", &d.join("z.gguf")]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--qk-gain 0", "positive"],
            after: Some(|d| clean(d, &["z.gguf"])),
        },
        Case {
            name: "fixture --arch qwen3 --qk-gain 2",
            needs: &[],
            args: |d| {
                os(&[
                    &"fixture",
                    &"--arch",
                    &"qwen3",
                    &"--qk-gain",
                    &"2",
                    &"-o",
                    &d.join("z.gguf"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--qk-gain", "qwen3", "per head"],
            after: Some(|d| clean(d, &["z.gguf"])),
        },
        Case {
            name: "fixture with an odd head size",
            needs: &[],
            args: |d| {
                os(&[
                    &"fixture",
                    &"--n-embd",
                    &"96",
                    &"--n-head",
                    &"32",
                    &"--type",
                    &"f32",
                    &"-o",
                    &d.join("z.gguf"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["even head size"],
            after: Some(|d| clean(d, &["z.gguf"])),
        },
        Case {
            name: "fixture over an existing file",
            needs: &[],
            args: |d| {
                std::fs::write(d.join("mine.gguf"), "precious").unwrap();
                os(&[&"fixture", &"-o", &d.join("mine.gguf")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["exists", "--force"],
            after: Some(|d| {
                (std::fs::read_to_string(d.join("mine.gguf")).unwrap() != "precious")
                    .then(|| "the existing file was overwritten".to_string())
            }),
        },
        // ---- outputs: checked before the work, whole or not at all, never a non-regular file
        Case {
            name: "fixture --force over a FIFO",
            needs: &[],
            args: |d| {
                let f = d.join("fifo.gguf");
                let c = std::ffi::CString::new(f.as_os_str().as_bytes()).unwrap();
                // SAFETY: mkfifo on a path we own.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
                os(&[&"fixture", &"--force", &"-o", &f])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--out", "fifo.gguf", "not a regular file"],
            after: Some(|d| {
                use std::os::unix::fs::FileTypeExt;
                let m = std::fs::symlink_metadata(d.join("fifo.gguf")).unwrap();
                (!m.file_type().is_fifo())
                    .then(|| "the FIFO was replaced".to_string())
                    .or_else(|| clean(d, &[]))
            }),
        },
        Case {
            name: "fixture --force over a folder",
            needs: &[],
            args: |d| {
                std::fs::create_dir(d.join("dir.gguf")).unwrap();
                std::fs::write(d.join("dir.gguf/keep"), "mine").unwrap();
                os(&[&"fixture", &"--force", &"-o", &d.join("dir.gguf")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--out", "dir.gguf", "is a folder"],
            after: Some(|d| {
                (std::fs::read_to_string(d.join("dir.gguf/keep"))
                    .ok()
                    .as_deref()
                    != Some("mine"))
                .then(|| "the folder was touched".to_string())
            }),
        },
        Case {
            name: "fixture --force over a device node",
            needs: &[],
            args: |_| os(&[&"fixture", &"--force", &"-o", &"/dev/null"]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--out", "/dev/null", "not a regular file"],
            after: Some(|_| {
                use std::os::unix::fs::FileTypeExt;
                let m = std::fs::symlink_metadata("/dev/null").unwrap();
                (!m.file_type().is_char_device()).then(|| "/dev/null was replaced".to_string())
            }),
        },
        Case {
            name: "fixture: a stale staging file of a dead writer is removed",
            needs: &[],
            args: |d| {
                let stale = d.join(format!(".f.gguf.partial-{}", dead_pid()));
                std::fs::write(stale, "half a fixture").unwrap();
                os(&[&"fixture", &"-o", &d.join("f.gguf")])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["wrote"],
            after: Some(|d| {
                clean(d, &[]).or_else(|| {
                    (!d.join("f.gguf").is_file()).then(|| "no fixture written".to_string())
                })
            }),
        },
        Case {
            name: "check --json ok.json --html nodir/r.html fails before the run",
            needs: &[],
            args: |d| {
                os(&[
                    &"check",
                    &fix(),
                    &"--json",
                    &d.join("ok.json"),
                    &"--html",
                    &d.join("nodir/r.html"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--html", "nodir", "No such file"],
            after: Some(|d| clean(d, &["ok.json", "nodir"])),
        },
        Case {
            name: "check --json - --html - (one stdout at most)",
            needs: &[],
            args: |_| os(&[&"check", &fix(), &"--json", &"-", &"--html", &"-"]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--html -", "only --json", "stdout"],
            after: Some(|_| {
                root()
                    .join("-")
                    .exists()
                    .then(|| "a file named - was written".to_string())
            }),
        },
        Case {
            name: "check --html and --snapshot on one path",
            needs: &[],
            args: |d| {
                let p = d.join("r.out");
                os(&[&"check", &fix(), &"--html", &p, &"--snapshot", &p])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--snapshot", "r.out", "same file as --html"],
            after: Some(|d| clean(d, &["r.out"])),
        },
        Case {
            name: "check --html into a FIFO",
            needs: &[],
            args: |d| {
                let f = d.join("page.html");
                let c = std::ffi::CString::new(f.as_os_str().as_bytes()).unwrap();
                // SAFETY: mkfifo on a path we own.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
                os(&[&"check", &fix(), &"--html", &f])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--html", "page.html", "not a regular file"],
            after: Some(|d| clean(d, &[])),
        },
        Case {
            name: "diff --snapshot into a folder",
            needs: &[],
            args: |d| {
                std::fs::create_dir(d.join("snap")).unwrap();
                os(&[&"diff", &GOLDEN, &GOLDEN, &"--snapshot", &d.join("snap")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--snapshot", "snap", "is a folder"],
            after: None,
        },
        Case {
            name: "diff --against a missing snapshot fails before the run",
            needs: &[],
            args: |d| {
                os(&[
                    &"diff",
                    &GOLDEN,
                    &GOLDEN,
                    &"--json",
                    &d.join("r.json"),
                    &"--against",
                    &d.join("none.snap"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--against", "none.snap", "--snapshot"],
            after: Some(|d| clean(d, &["r.json", "none.snap.new"])),
        },
        Case {
            name: "dump --force into a folder with a foreign s001/",
            needs: &[],
            args: |d| {
                std::fs::create_dir_all(d.join("t/s001")).unwrap();
                std::fs::write(d.join("t/s001/mine.npy"), "mine").unwrap();
                os(&[
                    &"dump",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--steps",
                    &"1",
                    &"--force",
                    &"--out",
                    &d.join("t"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["s001", "not a trace", "--force"],
            after: Some(|d| {
                let names: Vec<String> = std::fs::read_dir(d.join("t"))
                    .unwrap()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect();
                (names != ["s001"] || !d.join("t/s001/mine.npy").is_file())
                    .then(|| format!("the folder was changed: {names:?}"))
                    .or_else(|| clean(d, &[]))
            }),
        },
        Case {
            name: "dump --force over a trace replaces it whole",
            needs: &[],
            args: |d| {
                copy_dir(&root().join(GOLDEN), &d.join("t"));
                std::fs::write(d.join("t/notes.txt"), "mine").unwrap();
                os(&[
                    &"dump",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--steps",
                    &"1",
                    &"--force",
                    &"--out",
                    &d.join("t"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["wrote", "over 2 steps"],
            after: Some(|d| {
                let t = d.join("t");
                let steps = std::fs::read_dir(&t)
                    .unwrap()
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with('s'))
                    .count();
                (steps != 2 || !t.join("manifest.json").is_file())
                    .then(|| format!("{steps} step folders (the old trace's left?)"))
                    .or_else(|| {
                        (std::fs::read_to_string(t.join("notes.txt")).ok().as_deref()
                            != Some("mine"))
                        .then(|| "a file that is not the trace's was touched".to_string())
                    })
                    .or_else(|| clean(d, &[]))
            }),
        },
        Case {
            name: "dump: a lock held by another writer refuses the second",
            needs: &[],
            args: |d| {
                // A process holds the lock of d/t (as a running dump would) for the row's time.
                let lock = d.join(".t.lock");
                let f = std::fs::File::create(&lock).unwrap();
                use std::os::unix::io::AsRawFd;
                // SAFETY: flock on a file we own; leaked so that the lock outlives this fn
                // (parity is another process: the open description holds it).
                assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
                std::mem::forget(f);
                os(&[
                    &"dump",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--steps",
                    &"1",
                    &"--out",
                    &d.join("t"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["/t:", "is writing it now", ".t.lock"],
            after: Some(|d| clean(d, &["t"])),
        },
        // ---- flags that agree across subcommands
        Case {
            name: "dump --golden G --steps 10 (the golden has fewer)",
            needs: &[],
            args: |d| {
                os(&[
                    &"dump",
                    &fix(),
                    &"--golden",
                    &GOLDEN,
                    &"--steps",
                    &"10",
                    &"--out",
                    &d.join("t"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--steps 10", "golden"],
            after: Some(|d| clean(d, &["t"])),
        },
        Case {
            name: "dump --forced 5,6 --steps 7",
            needs: &[],
            args: |d| {
                os(&[
                    &"dump",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--forced",
                    &"5,6",
                    &"--steps",
                    &"7",
                    &"--out",
                    &d.join("t"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--steps 7", "--forced"],
            after: Some(|d| clean(d, &["t"])),
        },
        Case {
            name: "dump M --golden <another model's golden>",
            needs: &[],
            args: |d| {
                let m = rewrite_fixture(
                    d,
                    "other.gguf",
                    &[("general.name", Value::String("other".into()))],
                    None,
                );
                os(&[&"dump", &m, &"--golden", &GOLDEN, &"--out", &d.join("t")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--golden", "another model", "other.gguf"],
            after: Some(|d| clean(d, &["t"])),
        },
        Case {
            name: "check --backends fast,fast",
            needs: &[],
            args: |_| os(&[&"check", &fix(), &"--backends", &"fast,fast"]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--backends", "fast twice"],
            after: None,
        },
        Case {
            name: "selftest --keep FILE",
            needs: &[],
            args: |d| {
                std::fs::write(d.join("kept"), "mine").unwrap();
                os(&[&"selftest", &"--keep", &d.join("kept")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--keep", "kept", "exists and is not a folder"],
            after: Some(|d| {
                (std::fs::read_to_string(d.join("kept")).ok().as_deref() != Some("mine"))
                    .then(|| "the file was touched".to_string())
            }),
        },
        Case {
            name: "diff --model DIR",
            needs: &[],
            args: |d| os(&[&"diff", &GOLDEN, &GOLDEN, &"--model", &d]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--model", "is a folder"],
            after: None,
        },
        Case {
            name: "dump --threads -1",
            needs: &[],
            args: |d| {
                os(&[
                    &"dump",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--threads",
                    &"-1",
                    &"--out",
                    &d.join("t"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--threads", "-1"],
            after: Some(|d| clean(d, &["t"])),
        },
        Case {
            name: "check --threads -1",
            needs: &[],
            args: |_| os(&[&"check", &fix(), &"--threads", &"-1"]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--threads", "-1"],
            after: None,
        },
        // ---- models
        Case {
            name: "inspect a model at a non-UTF-8 path",
            needs: &[],
            args: |d| {
                let p = non_utf8(d, "model");
                std::fs::copy(fix(), &p).unwrap();
                os(&[&"inspect", &p])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["GGUF v3", "architecture: llama"],
            after: None,
        },
        Case {
            name: "a directory as model (inspect)",
            needs: &[],
            args: |d| os(&[&"inspect", &d]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["is a directory"],
            after: None,
        },
        Case {
            name: "a directory as model (check)",
            needs: &[],
            args: |d| os(&[&"check", &d, &"-p", &"hi"]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["is a directory"],
            after: None,
        },
        Case {
            name: "a directory as model (tokenize)",
            needs: &[],
            args: |d| os(&[&"tokenize", &d, &"hi"]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["is a directory"],
            after: None,
        },
        Case {
            name: "a directory as model (bench)",
            needs: &[],
            args: |d| os(&[&"bench", &d, &"--no-llama"]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["is a directory"],
            after: None,
        },
        Case {
            name: "bench past the context (checked up front)",
            needs: &[],
            args: |_| {
                os(&[
                    &"bench",
                    &fix(),
                    &"--no-llama",
                    &"--prompt-tokens",
                    &"100000",
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["exceeds the model's context length 256"],
            after: None,
        },
        Case {
            name: "bench --reps 0",
            needs: &[],
            args: |_| os(&[&"bench", &fix(), &"--no-llama", &"--reps", &"0"]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--reps must be at least 1"],
            after: None,
        },
        Case {
            name: "bench --json > /dev/full",
            needs: &[],
            args: |_| {
                os(&[
                    &"bench",
                    &fix(),
                    &"--no-llama",
                    &"--json",
                    &"--reps",
                    &"1",
                    &"--warmup",
                    &"0",
                    &"--prompt-tokens",
                    &"4",
                    &"--gen",
                    &"2",
                ])
            },
            env: &[],
            stdout_to: Some("/dev/full"),
            code: 2,
            words: &["cannot write to stdout"],
            after: None,
        },
        Case {
            name: "a vocab-only GGUF as model",
            needs: &[Need::Shared("vocab/ggml-vocab-llama-spm.gguf")],
            args: |_| {
                let v = shared("vocab/ggml-vocab-llama-spm.gguf").unwrap();
                os(&[&"generate", &v, &"-p", &"hi", &"-n", &"1"])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["vocab-only file: no tensors"],
            after: None,
        },
        Case {
            name: "a vocab-only GGUF of another architecture",
            needs: &[Need::Shared("vocab/ggml-vocab-baichuan.gguf")],
            args: |_| {
                let v = shared("vocab/ggml-vocab-baichuan.gguf").unwrap();
                os(&[&"check", &v, &"-p", &"hi"])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["vocab-only file: no tensors"],
            after: None,
        },
        Case {
            name: "a truncated model (check)",
            needs: &[],
            args: |d| {
                let len = std::fs::metadata(fix()).unwrap().len() as usize;
                let p = truncated_copy(d, &fix(), len - 1000);
                os(&[&"check", &p, &"-p", &"hi"])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["past the end of the file"],
            after: None,
        },
        // ---- golden: everything parity can check, up front; the Python side in one line
        Case {
            name: "golden --steps 100000",
            needs: &[],
            args: |d| {
                os(&[
                    &"golden",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--steps",
                    &"100000",
                    &"--out",
                    &d.join("g"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["exceed the model's context of 256"],
            after: Some(|d| clean(d, &["g"])),
        },
        // --steps is per turn and --forced holds every turn's decode ids: they must agree.
        Case {
            name: "golden --turn with --forced that does not split into the turns",
            needs: &[],
            args: |d| {
                os(&[
                    &"golden",
                    &fix(),
                    &"--tokens",
                    &"1,2,3",
                    &"--turn",
                    &"4,5",
                    &"--forced",
                    &"6,7,8",
                    &"--out",
                    &d.join("g"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--forced: 3 ids do not split into 2 turns' decode steps"],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden --turn --steps disagreeing with --forced over the turns",
            needs: &[],
            args: |d| {
                os(&[
                    &"golden",
                    &fix(),
                    &"--tokens",
                    &"1,2,3",
                    &"--turn",
                    &"4,5",
                    &"--steps",
                    &"4",
                    &"--forced",
                    &"6,7,8,9",
                    &"--out",
                    &d.join("g"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["--steps 4 disagrees with --forced (4 ids over 2 turns)"],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden --turn: prompt, turns and steps past the context",
            needs: &[],
            args: |d| {
                os(&[
                    &"golden",
                    &fix(),
                    &"--tokens",
                    &"1,2,3",
                    &"--turn",
                    &"4,5",
                    &"--steps",
                    &"126",
                    &"--out",
                    &d.join("g"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &[
                "3 prompt ids + 2 turn ids + --steps 126 over 2 turns exceed the model's context of 256",
            ],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden to a non-UTF-8 folder",
            needs: &[],
            args: |d| os(&[&"golden", &fix(), &"-p", &"hi", &"--out", &non_utf8(d, "g")]),
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["not valid UTF-8"],
            after: Some(|d| clean(d, &[])),
        },
        Case {
            name: "golden of a truncated model",
            needs: &[],
            args: |d| {
                let p = truncated_copy(d, &fix(), 300);
                os(&[&"golden", &p, &"-p", &"hi", &"--out", &d.join("g")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["truncated.gguf"],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden of a GGUF v1 model",
            needs: &[Need::Shared("legacy/stories260k-gguf-v1.gguf")],
            args: |d| {
                let p = shared("legacy/stories260k-gguf-v1.gguf").unwrap();
                os(&[&"golden", &p, &"-p", &"hi", &"--out", &d.join("g")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["version 1"],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden of a vocab-only file",
            needs: &[Need::Shared("vocab/ggml-vocab-llama-spm.gguf")],
            args: |d| {
                let p = shared("vocab/ggml-vocab-llama-spm.gguf").unwrap();
                os(&[&"golden", &p, &"-p", &"hi", &"--out", &d.join("g")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["vocab-only file: no tensors"],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden: the Python side's traceback",
            needs: &[],
            args: |d| {
                let py = fake_python(d);
                // The environment is per row; the fake Python is passed through it below.
                std::fs::write(d.join("PARITY_PYTHON"), py.as_os_str().as_bytes()).unwrap();
                os(&[&"golden", &fix(), &"-p", &"hi", &"--out", &d.join("g")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["the llama.cpp script failed: MemoryError", "--verbose"],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden: llama.cpp aborts the script",
            needs: &[],
            args: |d| {
                let py = aborting_python(d);
                std::fs::write(d.join("PARITY_PYTHON"), py.as_os_str().as_bytes()).unwrap();
                os(&[&"golden", &fix(), &"-p", &"hi", &"--out", &d.join("g")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["GGML_ASSERT(false) failed", "killed by signal 6"],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden --verbose (the flag the hint names exists)",
            needs: &[],
            args: |d| {
                let py = fake_python(d);
                std::fs::write(d.join("PARITY_PYTHON"), py.as_os_str().as_bytes()).unwrap();
                os(&[
                    &"golden",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--out",
                    &d.join("g"),
                    &"--verbose",
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["golden: the llama.cpp script exited with code 1"],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden into an unwritable place",
            needs: &[Need::Llama],
            args: |_| {
                os(&[
                    &"golden",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--out",
                    &"/proc/parity-golden",
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["/proc/parity-golden", "cannot write there"],
            after: None,
        },
        Case {
            // llama.cpp's own tokenizer aborts the process on this (no byte token for 0xF0 in
            // this vocabulary); parity tokenizes first and says so.
            name: "golden with an emoji prompt on a vocabulary without byte tokens",
            needs: &[Need::Shared("models/TinyStories-656K-Q8_0.gguf")],
            args: |d| {
                let m = shared("models/TinyStories-656K-Q8_0.gguf").unwrap();
                os(&[&"golden", &m, &"-p", &"😀 hi", &"--out", &d.join("g")])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["no byte token for byte 0xF0"],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden from a prompt: parity's ids, llama.cpp's run",
            needs: &[
                Need::Llama,
                Need::Shared("models/TinyStories-656K-Q8_0.gguf"),
            ],
            args: |d| {
                let m = shared("models/TinyStories-656K-Q8_0.gguf").unwrap();
                os(&[
                    &"golden",
                    &m,
                    &"-p",
                    &"Once upon a time",
                    &"--steps",
                    &"2",
                    &"--out",
                    &d.join("g"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["wrote", "prompt ids: 1,"],
            after: Some(|d| {
                let Ok(m) = std::fs::read_to_string(d.join("g/manifest.json")) else {
                    return Some("no golden written".into());
                };
                if !m.contains("\"prompt\": \"Once upon a time\"") {
                    return Some("the manifest does not record the prompt text".into());
                }
                clean(d, &[])
            }),
        },
        Case {
            name: "golden --tokens with an id past the vocabulary",
            needs: &[],
            args: |d| {
                os(&[
                    &"golden",
                    &fix(),
                    &"--tokens",
                    &"1,99999",
                    &"--out",
                    &d.join("g"),
                ])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["token id 99999 is out of range"],
            after: Some(|d| clean(d, &["g"])),
        },
        Case {
            name: "golden --force over a golden keeps other files",
            needs: &[Need::Llama],
            args: |d| {
                let g = d.join("g");
                copy_dir(&root().join(GOLDEN), &g);
                std::fs::write(g.join("notes.txt"), "mine").unwrap();
                os(&[
                    &"golden",
                    &fix(),
                    &"-p",
                    &"hi",
                    &"--steps",
                    &"1",
                    &"--out",
                    &g,
                    &"--force",
                ])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["wrote"],
            after: Some(|d| {
                let g = d.join("g");
                if std::fs::read_to_string(g.join("notes.txt")).ok().as_deref() != Some("mine") {
                    return Some("--force removed a file that is not part of a trace".into());
                }
                if g.join("s004").exists() || !g.join("s001").is_dir() {
                    return Some("the folder does not hold exactly the new golden".into());
                }
                clean(d, &[])
            }),
        },
        // ---- traces as an engine author writes them
        Case {
            name: "f16 .npy accepted",
            needs: &[],
            args: |d| {
                let a = trace_copy(d, "a", |p, _| logits_as(p, "<f2"));
                let b = trace_copy(d, "b", |p, _| logits_as(p, "<f2"));
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["PARITY"],
            after: None,
        },
        Case {
            name: "f64 .npy accepted",
            needs: &[],
            args: |d| {
                let a = trace_copy(d, "a", |p, _| logits_as(p, "<f8"));
                let b = trace_copy(d, "b", |p, _| logits_as(p, "<f8"));
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &["PARITY"],
            after: None,
        },
        Case {
            name: "a truncated .npy",
            needs: &[],
            args: |d| {
                let a = trace_copy(d, "a", |_, _| {});
                let b = trace_copy(d, "b", |p, _| {
                    let f = p.join("s000/logits.npy");
                    let bytes = std::fs::read(&f).unwrap();
                    std::fs::write(&f, &bytes[..bytes.len() - 100]).unwrap();
                });
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["s000/logits.npy: truncated (", "bytes"],
            after: None,
        },
        Case {
            name: "a tap parity does not know is kept, not compared",
            needs: &[],
            args: |d| {
                let a = trace_copy(d, "a", |_, _| {});
                let b = trace_copy(d, "b", |p, m| {
                    std::fs::copy(p.join("s000/embd.npy"), p.join("s000/my_probe.npy")).unwrap();
                    let e = m["tensors"][0].clone();
                    let mut e = e;
                    e["tap"] = "my_probe".into();
                    e["file"] = "s000/my_probe.npy".into();
                    m["tensors"].as_array_mut().unwrap().push(e);
                });
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            env: &[],
            stdout_to: None,
            code: 0,
            words: &[
                "Not compared",
                "1 only in the candidate",
                "the candidate records taps parity does not know (kept, not compared): my_probe",
            ],
            after: None,
        },
        Case {
            name: "positions not one per token",
            needs: &[],
            args: |d| {
                let a = trace_copy(d, "a", |_, _| {});
                let b = trace_copy(d, "b", |_, m| {
                    m["steps"][0]["positions"].as_array_mut().unwrap().pop();
                });
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            env: &[],
            stdout_to: None,
            code: 2,
            words: &["step 0 has", "positions"],
            after: None,
        },
    ]
}

/// A Python with llama_cpp and numpy, as `parity golden` picks it.
fn llama_python() -> Option<PathBuf> {
    let py = std::env::var_os("PARITY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"));
    let ok = Command::new(&py)
        .args(["-c", "import llama_cpp, numpy"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(py)
}

struct Outcome {
    name: &'static str,
    result: Result<(), String>,
}

fn run_case(c: &Case) -> Option<Outcome> {
    for n in c.needs {
        match n {
            Need::Shared(sub) => shared(sub)?,
            Need::Llama => {
                if llama_python().is_none() {
                    eprintln!("skipped: {} (llama_cpp not installed)", c.name);
                    return None;
                }
                PathBuf::new()
            }
        };
    }
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let args = (c.args)(d);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_parity"));
    cmd.args(&args).current_dir(root());
    for (k, v) in c.env {
        cmd.env(k, v);
    }
    if let Ok(py) = std::fs::read(d.join("PARITY_PYTHON")) {
        cmd.env("PARITY_PYTHON", OsStr::from_bytes(&py));
    }
    // Goldens made by a row go to the temp folder, never the user's.
    cmd.env("PARITY_GOLDEN_DIR", d.join("user-goldens"));
    match c.stdout_to {
        Some(f) => cmd.stdout(std::fs::OpenOptions::new().write(true).open(f).unwrap()),
        None => cmd.stdout(Stdio::piped()),
    };
    cmd.stderr(Stdio::piped());
    let o = cmd.output().expect("run parity");
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    let shown = format!(
        "exit {:?}\n--- stdout (tail)\n{}\n--- stderr\n{}",
        o.status.code(),
        stdout
            .lines()
            .rev()
            .take(8)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n"),
        stderr
    );
    let result = (|| {
        if o.status.code() != Some(c.code) {
            return Err(format!("expected exit {}, got:\n{shown}", c.code));
        }
        // --verbose asks for the Python side's whole output.
        let verbose = args.iter().any(|a| a == "--verbose");
        for bad in ["panicked", "RUST_BACKTRACE", "Traceback", "Some(", "None"] {
            if stderr.contains(bad) && !(verbose && bad == "Traceback") {
                return Err(format!("stderr holds '{bad}':\n{shown}"));
            }
        }
        let haystack = if c.code == 2 {
            let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
            if errors.len() != 1 {
                return Err(format!(
                    "expected exactly one error line, got {}:\n{shown}",
                    errors.len()
                ));
            }
            errors[0].to_string()
        } else {
            format!("{stdout}\n{stderr}")
        };
        for w in c.words {
            if !haystack.contains(w) {
                return Err(format!("'{w}' not found in:\n{haystack}\n\n{shown}"));
            }
        }
        if let Some(after) = c.after
            && let Some(why) = after(d)
        {
            return Err(format!("{why}\n{shown}"));
        }
        Ok(())
    })();
    Some(Outcome {
        name: c.name,
        result,
    })
}

/// Run the rows whose needs are exactly `needs`-compatible: `pick` chooses them.
fn run_rows(pick: impl Fn(&[Need]) -> bool, at_least: usize) {
    let mut failed = Vec::new();
    let mut ran = 0;
    for c in cases().into_iter().filter(|c| pick(c.needs)) {
        let Some(out) = run_case(&c) else {
            panic!(
                "{}: its tools are missing, though build.rs found them: touch build.rs",
                c.name
            )
        };
        ran += 1;
        match out.result {
            Ok(()) => eprintln!("ok    {}", out.name),
            Err(why) => {
                eprintln!("FAIL  {}\n{why}\n", out.name);
                failed.push(out.name);
            }
        }
    }
    eprintln!("{ran} rows run, {} failed", failed.len());
    assert!(ran >= at_least, "only {ran} rows");
    assert!(failed.is_empty(), "failed rows: {failed:?}");
}

fn needs_llama(n: &[Need]) -> bool {
    n.contains(&Need::Llama)
}

fn needs_shared(n: &[Need]) -> bool {
    n.iter().any(|x| matches!(x, Need::Shared(_)))
}

/// The rows that need nothing but the repository.
#[test]
fn every_bad_input_one_line_exit_2() {
    run_rows(|n| n.is_empty(), 30);
}

/// The rows that need ../shared (and not llama.cpp).
#[test]
#[cfg_attr(not(parity_shared), ignore = "needs ../shared (models, vocab)")]
fn every_bad_input_one_line_exit_2_shared() {
    run_rows(|n| needs_shared(n) && !needs_llama(n), 1);
}

/// The rows that run the real llama.cpp (`parity golden`).
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn every_bad_input_one_line_exit_2_llama_cpp() {
    run_rows(|n| needs_llama(n) && !needs_shared(n), 3);
}

/// The rows that run the real llama.cpp on a ../shared model.
#[test]
#[cfg_attr(
    not(all(parity_llama_cpp, parity_shared)),
    ignore = "needs llama-cpp-python and ../shared"
)]
fn every_bad_input_one_line_exit_2_llama_cpp_shared() {
    run_rows(|n| needs_llama(n) && needs_shared(n), 1);
}

/// The f16 and f64 readers convert exactly what they should (the CLI rows above only show that
/// such files are accepted).
#[test]
fn npy_f16_f64_big_endian_values() {
    let dir = tempfile::tempdir().unwrap();
    let vals = [1.0f32, -2.5, 0.000061035156, 65504.0];
    let cases: [(&str, Vec<u8>); 4] = [
        (
            "<f2",
            vals.iter()
                .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
                .collect(),
        ),
        (
            ">f2",
            vals.iter()
                .flat_map(|&x| half::f16::from_f32(x).to_bits().to_be_bytes())
                .collect(),
        ),
        (
            "<f8",
            vals.iter()
                .flat_map(|&x| (x as f64).to_le_bytes())
                .collect(),
        ),
        (">f4", vals.iter().flat_map(|&x| x.to_be_bytes()).collect()),
    ];
    // A one-tensor trace: step 0 of two tokens, its `embd` as [2, 2].
    let t = dir.path();
    std::fs::create_dir(t.join("s000")).unwrap();
    let manifest = serde_json::json!({
        "format": "parity-trace", "version": 1,
        "model": {"path": "m.gguf", "sha256": ""},
        "producer": {"name": "test", "backend": "cpu", "version": ""},
        "steps": [{"step": 0, "tokens": [1, 2], "positions": [0, 1]}],
        "tensors": [{"step": 0, "tap": "embd", "layer": null, "file": "s000/embd.npy",
                     "shape": [2, 2], "dtype": "<f4"}],
    });
    std::fs::write(t.join("manifest.json"), manifest.to_string()).unwrap();
    let key = parity::trace::TapKey::new(0, None, parity::trace::Tap::parse("embd").unwrap());
    let read = || parity::trace::Trace::open(t).and_then(|tr| tr.get(&key));
    for (descr, data) in cases {
        std::fs::write(t.join("s000/embd.npy"), npy_image(descr, &[2, 2], &data)).unwrap();
        let a = read()
            .unwrap_or_else(|e| panic!("{descr}: {e}"))
            .expect("embd is in the trace");
        assert_eq!(a.shape(), &[2, 2], "{descr}");
        assert_eq!(a.iter().copied().collect::<Vec<_>>(), vals, "{descr}");
    }
    // Integers are refused by name.
    std::fs::write(t.join("s000/embd.npy"), npy_image("<i4", &[2, 2], &[0; 16])).unwrap();
    let e = read().unwrap_err().to_string();
    assert!(e.contains("<i4") && e.contains("not a float type"), "{e}");
}

/// A model truncated while parity has it mapped: the next read of a lost page raises SIGBUS,
/// which parity turns into one line and exit 2 (not "Bus error", 135).
#[test]
fn model_truncated_while_mapped() {
    use std::io::BufRead as _;
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m.gguf");
    let o = common::parity(&[
        "fixture",
        "--n-embd",
        "512",
        "--n-ff",
        "1024",
        "--n-layer",
        "4",
        "--n-ctx",
        "4096",
        "--type",
        "f32",
        "-o",
        m.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", common::show(&o));
    let mut child = Command::new(env!("CARGO_BIN_EXE_parity"))
        .args(["generate", m.to_str().unwrap(), "-p", "hi", "-n", "4000"])
        .arg("--ignore-eos")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    // The first line ("prompt ids: …") comes once the model is mapped and running.
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    assert!(first.starts_with("prompt ids"), "{first}");
    let mut second = String::new();
    err.read_line(&mut second).unwrap();
    assert!(second.starts_with("backend: reference"), "{second}");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&m)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(2), "{rest}");
    let lines: Vec<&str> = rest.lines().collect();
    assert_eq!(lines.len(), 1, "{rest}");
    assert!(
        lines[0].contains("SIGBUS") && lines[0].contains("truncated"),
        "{rest}"
    );
}

/// Ctrl-C (SIGINT), `kill` (SIGTERM) or a closed terminal (SIGHUP) in the middle of a dump:
/// the unfinished trace is removed, nothing is left under the final name or beside it, one
/// line says so, and the process still ends by that signal (a shell sees 130 for Ctrl-C).
#[test]
fn interrupted_dump_leaves_nothing() {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m.gguf");
    let o = common::parity(&[
        "fixture",
        "--n-embd",
        "512",
        "--n-ff",
        "1024",
        "--n-layer",
        "4",
        "--n-ctx",
        "4096",
        "--type",
        "f32",
        "-o",
        m.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", common::show(&o));
    for (sig, name) in [
        (libc::SIGINT, "INT"),
        (libc::SIGTERM, "TERM"),
        (libc::SIGHUP, "HUP"),
    ] {
        let out = dir.path().join(format!("t-{name}"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_parity"));
        cmd.arg("dump")
            .arg(&m)
            .args(["-p", "hi", "--steps", "4000", "--out"])
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // A test run from a script may inherit SIGINT ignored, which parity respects.
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                libc::signal(sig, libc::SIG_DFL);
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        let staging = dir.path().join(format!(".t-{name}.partial-{}", child.id()));
        let t0 = std::time::Instant::now();
        while !staging.join("s002").exists() {
            assert!(
                t0.elapsed().as_secs() < 120,
                "no staging folder {} after 2 minutes",
                staging.display()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(child.id() as libc::pid_t, sig);
        }
        let o = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.signal(), Some(sig), "SIG{name}: {stderr}");
        let said: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("interrupted"))
            .collect();
        assert_eq!(said.len(), 1, "SIG{name}: {stderr}");
        assert!(said[0].contains("removed the unfinished trace"), "{stderr}");
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(&format!("t-{name}")))
            .collect();
        assert!(left.is_empty(), "SIG{name}: left behind {left:?}");
    }
}

/// A golden killed outright (SIGKILL: no chance to clean up) leaves its hidden staging folder;
/// the next `golden` into the same output removes it.
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn golden_clears_a_killed_runs_staging_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let stale = tmp.path().join(format!(".g.partial-{}", dead_pid()));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("embd.npy"), b"half written").unwrap();
    let out = tmp.path().join("g");
    let o = common::parity(&[
        "golden",
        fix().to_str().unwrap(),
        "-p",
        "Once upon",
        "--steps",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", common::show(&o));
    assert!(!stale.exists(), "the stale staging folder is still there");
    assert!(out.join("manifest.json").exists());
}

/// A file system that fills up while the reports are written (RLIMIT_FSIZE: a write past the
/// limit fails with EFBIG, as a full disk fails with ENOSPC): exit 2 naming the output, and
/// none of the outputs left, not even the ones that fitted.
#[test]
fn outputs_on_a_full_file_system_leave_nothing() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_parity"));
    cmd.arg("check")
        .arg(fix())
        .args([
            "-p",
            "hi",
            "--steps",
            "1",
            "--backends",
            "reference,fast",
            "--snapshot",
        ])
        .arg(d.join("r.snap"))
        .arg("--html")
        .arg(d.join("r.html"))
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // The snapshot (a few KB) fits under 16 KB, the HTML page (tens of KB) does not.
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit {
                rlim_cur: 16 << 10,
                rlim_max: 16 << 10,
            };
            libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
            Ok(())
        });
    }
    let o = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{}", common::show(&o));
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(
        errors[0].contains("--html") && errors[0].contains("r.html"),
        "{stderr}"
    );
    let left: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A fixture big enough to take a moment to write.
fn slow_model(dir: &Path) -> PathBuf {
    let m = dir.join("m.gguf");
    let o = common::parity(&[
        "fixture",
        "--n-embd",
        "512",
        "--n-ff",
        "1024",
        "--n-layer",
        "4",
        "--n-ctx",
        "4096",
        "--type",
        "f32",
        "-o",
        m.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", common::show(&o));
    m
}

/// Two `dump`s into one folder at once: the second is refused in one line while the first
/// writes, the first publishes a whole trace, and a later `dump --force` replaces it.
#[test]
fn two_dumps_into_one_folder() {
    let dir = tempfile::tempdir().unwrap();
    let m = slow_model(dir.path());
    let out = dir.path().join("t");
    let first = Command::new(env!("CARGO_BIN_EXE_parity"))
        .arg("dump")
        .arg(&m)
        .args(["-p", "hi", "--steps", "60", "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let staging = dir.path().join(format!(".t.partial-{}", first.id()));
    let t0 = std::time::Instant::now();
    while !staging.join("s001").exists() {
        assert!(t0.elapsed().as_secs() < 120, "the first dump did not start");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    for force in [false, true] {
        let mut args = vec!["dump", m.to_str().unwrap(), "-p", "hi", "--steps", "1"];
        if force {
            args.push("--force");
        }
        args.extend(["--out", out.to_str().unwrap()]);
        let o = common::parity(&args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(
            o.status.code(),
            Some(2),
            "force {force}: {}",
            common::show(&o)
        );
        let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
        assert_eq!(errors.len(), 1, "{stderr}");
        assert!(
            errors[0].contains(&format!("process {}", first.id()))
                && errors[0].contains("is writing it now"),
            "{stderr}"
        );
    }
    let o = first.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let written = || {
        parity::trace::Trace::open(&out)
            .unwrap()
            .manifest
            .steps
            .len()
    };
    assert_eq!(written(), 61);
    let o = common::parity(&[
        "dump",
        m.to_str().unwrap(),
        "-p",
        "hi",
        "--steps",
        "1",
        "--force",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", common::show(&o));
    assert_eq!(written(), 2);
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// `fixture` stopped by SIGINT, SIGTERM or SIGHUP while its file is being written removes its
/// `.NAME.partial-PID` and leaves no output.
#[test]
fn interrupted_fixture_leaves_nothing() {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    let dir = tempfile::tempdir().unwrap();
    for (sig, name) in [
        (libc::SIGINT, "INT"),
        (libc::SIGTERM, "TERM"),
        (libc::SIGHUP, "HUP"),
    ] {
        let out = dir.path().join(format!("f-{name}.gguf"));
        // Several tries: the signal must land while the file is written (it is built in
        // memory first); a run that finished before is retried.
        let mut caught = false;
        for _ in 0..5 {
            let _ = std::fs::remove_file(&out);
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_parity"));
            cmd.args([
                "fixture",
                "--n-embd",
                "1024",
                "--n-ff",
                "4096",
                "--n-layer",
                "6",
                "--type",
                "f32",
                "-o",
            ])
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    libc::signal(sig, libc::SIG_DFL);
                    Ok(())
                });
            }
            let mut child = cmd.spawn().unwrap();
            let staging = dir
                .path()
                .join(format!(".f-{name}.gguf.partial-{}", child.id()));
            while !staging.exists() && child.try_wait().unwrap().is_none() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            // SAFETY: signalling our own child (a no-op if it has ended).
            unsafe {
                libc::kill(child.id() as libc::pid_t, sig);
            }
            let o = child.wait_with_output().unwrap();
            if o.status.signal() == Some(sig) {
                caught = true;
                let left: Vec<String> = std::fs::read_dir(dir.path())
                    .unwrap()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.contains(&format!("f-{name}")))
                    .collect();
                assert!(
                    left.is_empty(),
                    "SIG{name}: left behind {left:?}; its stderr: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                break;
            }
        }
        assert!(
            caught,
            "SIG{name} never landed while the fixture was written"
        );
    }
}

/// `golden` stopped by SIGTERM while llama.cpp runs: its child is stopped with it, and
/// nothing is published, then or later.
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn golden_stopped_by_a_signal_stops_llama_cpp() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let m = slow_model(dir.path());
    let out = dir.path().join("g");
    let child = Command::new(env!("CARGO_BIN_EXE_parity"))
        .arg("golden")
        .arg(&m)
        .args(["-p", "hi", "--steps", "200", "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The script's staging folder names its own PID.
    let t0 = std::time::Instant::now();
    let (staging, py) = loop {
        let found = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .find_map(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                let pid = n.strip_prefix(".g.partial-")?.parse::<i32>().ok()?;
                Some((e.path(), pid))
            });
        if let Some(f) = found
            && f.0.join("s001").exists()
        {
            break f;
        }
        assert!(t0.elapsed().as_secs() < 120, "the golden did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let o = child.wait_with_output().unwrap();
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGTERM),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // Stopped: gone, or a zombie not yet reaped by whoever inherited it (SIGKILL came with
    // parity's end; under load its teardown and reaping can take a while).
    let running = || {
        // SAFETY: signal 0 asks whether the process exists.
        let exists = unsafe { libc::kill(py, 0) } == 0;
        let zombie = std::fs::read_to_string(format!("/proc/{py}/stat")).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        });
        exists && !zombie
    };
    let t0 = std::time::Instant::now();
    while running() && t0.elapsed() < std::time::Duration::from_secs(20) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(!running(), "llama.cpp's script (pid {py}) runs on");
    // "Later" too: nothing appears in the two seconds after.
    std::thread::sleep(std::time::Duration::from_secs(2).saturating_sub(t0.elapsed()));
    assert!(
        !out.exists(),
        "the golden was published after parity stopped"
    );
    assert!(!staging.exists(), "its staging folder is left");
}

/// A bad flag value that clap quotes back (a size, a number, a choice) holding a newline and an
/// escape is shown escaped: one error line, nothing forged, exit 2.
#[test]
fn a_bad_flag_value_with_control_characters_is_shown_escaped() {
    for args in [
        vec![
            "dump",
            "fixtures/tiny-llama-q8_0.gguf",
            "--tokens",
            "1,2",
            "--out",
            "/nonexistent/x",
            "--max-trace-size",
            "1k\n\u{1b}[31merror: forged",
        ],
        vec!["check", "--threads", "2\n\u{1b}[2Jforged"],
        vec![
            "selftest",
            "fixtures/tiny-llama-q8_0.gguf",
            "--engine",
            "numpy\nerror: forged",
        ],
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_parity"))
            .args(&args)
            .current_dir(root())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains('\u{1b}'), "{args:?}: {err:?}");
        assert_eq!(
            err.lines().filter(|l| l.contains("forged")).count(),
            1,
            "{args:?}: {err}"
        );
        assert!(
            err.lines()
                .find(|l| l.contains("forged"))
                .unwrap()
                .starts_with("error: invalid value"),
            "{args:?}: {err}"
        );
    }
}
