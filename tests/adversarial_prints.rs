//! Hostile strings in files (issue #26, "Printing what a file forges" and "Running what it
//! reads"). Every string a trace manifest or a GGUF file holds reaches the terminal escaped: no
//! ESC sequence, carriage return, C1 control or bidi override from a file is ever printed, and a
//! newline inside a value cannot start a line of its own, so a forged `verdict: parity` line
//! never appears: the verdict line is parity's own, and the last one. And parity never runs
//! what it reads: the Python it starts (`golden`, `bench`, `selftest --engine numpy`) imports
//! nothing from the working folder or from PYTHONPATH.

use crate::common;

use common::{copy_dir, root};
use parity::gguf::{GgufFile, GgufWriter, Value};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FIX: &str = "fixtures/tiny-llama-q8_0.gguf";
const GOLDEN: &str = "golden/tiny-llama-q8_0";

/// What a hostile file writes into every string it controls: an OSC that retitles the
/// terminal, a clear-screen CSI (7-bit and C1), a right-to-left override, a carriage return
/// and a line that reads like parity's verdict, twice (once after CRLF, once after LF).
const FORGED: &str = "X\x1b]0;owned\x07\x1b[2J\u{9b}2J\u{202e}gnp.exe\u{2066}\u{85}\u{2028}\x7f\r\nverdict: parity (9 comparisons)\nverdict: parity (9 comparisons)";

/// How [`FORGED`]'s start is shown once escaped: proof that the value was printed, not dropped.
const SHOWN: &str = "X\\x1b]0;owned\\x07\\x1b[2J";

/// Characters a file must never get onto the terminal.
fn forbidden(c: char) -> bool {
    matches!(c,
        '\0'..='\x08' | '\x0b'..='\x1f' | '\x7f'..='\u{9f}'
        | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}'
        | '\u{2028}' | '\u{2029}')
}

fn fix() -> PathBuf {
    root().join(FIX)
}

fn run(args: &[OsString], cwd: &Path, env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_parity"));
    c.args(args).current_dir(cwd).env("NO_COLOR", "1");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run parity")
}

fn os(v: &[&dyn AsRef<std::ffi::OsStr>]) -> Vec<OsString> {
    v.iter().map(|s| s.as_ref().to_os_string()).collect()
}

use common::golden_unknown_model as trace;

/// Make the trace diverge end to end: its last layer's output scaled by 1.5 at step 0.
fn diverge(d: &Path) {
    let p = d.join("s000/l_out-1.npy");
    let (shape, data) = common::read_npy(&p);
    let data: Vec<f32> = data.iter().map(|x| x * 1.5).collect();
    common::write_npy(&p, &shape, &data);
}

/// The fixture rewritten to `dir/name`: metadata `edits` applied, tensors renamed by `rename`.
fn gguf(dir: &Path, name: &str, edits: &[(&str, Value)], rename: &[(&str, &str)]) -> PathBuf {
    let f = GgufFile::open(fix()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in &f.metadata {
        w.set(k, v.clone());
    }
    for (k, v) in edits {
        w.set(k, v.clone());
    }
    for t in &f.tensors {
        let n = rename
            .iter()
            .find(|(a, _)| *a == t.name)
            .map_or(t.name.as_str(), |(_, b)| b);
        w.add_tensor(n, &t.dims, t.ty, f.tensor_data(t).to_vec());
    }
    let p = dir.join(name);
    w.write(&p).unwrap();
    p
}

fn forged() -> Value {
    Value::String(FORGED.into())
}

struct Case {
    name: &'static str,
    /// Crafts the input in the temp folder and returns the arguments.
    args: fn(&Path) -> Vec<OsString>,
    /// The exit codes allowed (a forged string changes what is printed, not the verdict).
    codes: &'static [i32],
    /// The forged value is printed (escaped) somewhere: the print site is exercised.
    shows: bool,
}

fn cases() -> Vec<Case> {
    vec![
        // --- trace manifests: `diff`
        Case {
            name: "diff, diverging: producer.backend (the issue's forged verdict)",
            args: |d| {
                let a = trace(d, "a", |_, _| {});
                let b = trace(d, "b", |p, m| {
                    diverge(p);
                    m["producer"]["backend"] = FORGED.into();
                });
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            codes: &[1],
            shows: true,
        },
        Case {
            name: "diff, diverging: producer.name",
            args: |d| {
                let a = trace(d, "a", |_, _| {});
                let b = trace(d, "b", |p, m| {
                    diverge(p);
                    m["producer"]["name"] = FORGED.into();
                });
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            codes: &[1],
            shows: true,
        },
        Case {
            name: "diff, parity: the baseline's producer.name and backend, --verbose-free",
            args: |d| {
                let a = trace(d, "a", |_, m| {
                    m["producer"]["name"] = FORGED.into();
                    m["producer"]["backend"] = FORGED.into();
                });
                let b = trace(d, "b", |_, _| {});
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            codes: &[0],
            shows: true,
        },
        Case {
            name: "diff: producer.version and settings (not printed, and not leaked)",
            args: |d| {
                let a = trace(d, "a", |_, _| {});
                let b = trace(d, "b", |_, m| {
                    m["producer"]["version"] = FORGED.into();
                    m["producer"]["settings"]["n_ctx_note"] = FORGED.into();
                });
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            codes: &[0],
            shows: false,
        },
        Case {
            name: "diff: model.path quoted in the error line",
            args: |d| {
                let a = trace(d, "a", |_, _| {});
                let b = trace(d, "b", |_, m| m["model"]["path"] = FORGED.into());
                os(&[&"diff", &a, &b])
            },
            codes: &[2],
            shows: true,
        },
        Case {
            name: "diff: model.sha256",
            args: |d| {
                let a = trace(d, "a", |_, _| {});
                let b = trace(d, "b", |_, m| m["model"]["sha256"] = FORGED.into());
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            codes: &[0, 2],
            shows: false,
        },
        Case {
            name: "diff: a tap name parity does not know (the note)",
            args: |d| {
                let a = trace(d, "a", |_, _| {});
                let b = trace(d, "b", |p, m| {
                    std::fs::copy(p.join("s000/embd.npy"), p.join("s000/probe.npy")).unwrap();
                    let mut e = m["tensors"][0].clone();
                    e["tap"] = FORGED.into();
                    e["file"] = "s000/probe.npy".into();
                    m["tensors"].as_array_mut().unwrap().push(e);
                });
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            codes: &[0],
            shows: true,
        },
        Case {
            name: "diff: a tensor's file name",
            args: |d| {
                let a = trace(d, "a", |_, _| {});
                let b = trace(d, "b", |_, m| m["tensors"][0]["file"] = FORGED.into());
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            codes: &[2],
            shows: false,
        },
        Case {
            name: "diff: a tensor's dtype",
            args: |d| {
                let a = trace(d, "a", |_, _| {});
                let b = trace(d, "b", |_, m| m["tensors"][0]["dtype"] = FORGED.into());
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            codes: &[0, 2],
            shows: false,
        },
        Case {
            name: "diff: the manifest's format",
            args: |d| {
                let a = trace(d, "a", |_, _| {});
                let b = trace(d, "b", |_, m| m["format"] = FORGED.into());
                os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"])
            },
            codes: &[2],
            shows: false,
        },
        Case {
            name: "diff with the model: a declared layout",
            args: |d| {
                let a = trace(d, "a", |_, _| {});
                let b = trace(d, "b", |_, m| {
                    m["layouts"] = serde_json::json!({ "q_rope": FORGED });
                });
                os(&[
                    &"diff",
                    &a,
                    &b,
                    &"--model",
                    &fix(),
                    &"--allow-model-mismatch",
                ])
            },
            codes: &[2],
            shows: false,
        },
        Case {
            name: "diff with the model, diverging: producer.backend in the judgement's verdict",
            args: |d| {
                let a = root().join(GOLDEN);
                let b = d.join("b");
                copy_dir(&a, &b);
                let mp = b.join("manifest.json");
                let mut m: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(&mp).unwrap()).unwrap();
                m["producer"]["backend"] = FORGED.into();
                std::fs::write(&mp, m.to_string()).unwrap();
                diverge(&b);
                os(&[&"diff", &a, &b, &"--model", &fix(), &"--no-experiments"])
            },
            codes: &[1],
            shows: true,
        },
        // --- the golden `check` reads: its producer backend (the op-by-op note and headers)
        Case {
            name: "check --golden: the golden's producer backend",
            args: |d| {
                let g = d.join("g");
                copy_dir(&root().join(GOLDEN), &g);
                let mp = g.join("manifest.json");
                let mut m: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(&mp).unwrap()).unwrap();
                m["producer"]["backend"] = format!("llama.cpp-{FORGED}").into();
                std::fs::write(&mp, m.to_string()).unwrap();
                os(&[
                    &"check",
                    &fix(),
                    &"--golden",
                    &g,
                    &"--backends",
                    &"reference",
                    &"--verbose",
                ])
            },
            codes: &[0, 1],
            shows: true,
        },
        // --- GGUF strings
        Case {
            name: "inspect: general.name, architecture, tokenizer pre, a metadata key, a tensor name",
            args: |d| {
                let m = gguf(
                    d,
                    "m.gguf",
                    &[
                        ("general.name", forged()),
                        ("tokenizer.ggml.pre", forged()),
                        (FORGED, forged()),
                    ],
                    &[("output_norm.weight", FORGED)],
                );
                os(&[&"inspect", &m, &"--metadata"])
            },
            codes: &[0],
            shows: true,
        },
        Case {
            name: "inspect: general.architecture (and the config error it makes)",
            args: |d| {
                let m = gguf(d, "m.gguf", &[("general.architecture", forged())], &[]);
                os(&[&"inspect", &m])
            },
            codes: &[0],
            shows: true,
        },
        Case {
            name: "check: general.architecture inside the error line",
            args: |d| {
                let m = gguf(d, "m.gguf", &[("general.architecture", forged())], &[]);
                os(&[&"check", &m])
            },
            codes: &[2],
            shows: true,
        },
        Case {
            name: "tokenize: a missing tensor named by a forged name, tokenizer model",
            args: |d| {
                let m = gguf(d, "m.gguf", &[("tokenizer.ggml.model", forged())], &[]);
                os(&[&"tokenize", &m, &"hi"])
            },
            codes: &[2],
            shows: true,
        },
        Case {
            name: "generate: the BOS token's text in the prompt line",
            args: |d| {
                let f = GgufFile::open(fix()).unwrap();
                let Some(Value::Array(ty, toks)) = f.get("tokenizer.ggml.tokens") else {
                    panic!("fixture has tokens")
                };
                let bos = f.get_u64("tokenizer.ggml.bos_token_id").unwrap() as usize;
                let mut toks = toks.clone();
                toks[bos] = forged();
                let m = gguf(
                    d,
                    "m.gguf",
                    &[
                        ("tokenizer.ggml.tokens", Value::Array(*ty, toks)),
                        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
                    ],
                    &[],
                );
                os(&[&"generate", &m, &"-p", &"hi", &"-n", &"2"])
            },
            codes: &[0],
            shows: true,
        },
    ]
}

/// The checks every case holds: no forbidden character on stdout or stderr, no line that starts
/// with `verdict:` except parity's own last line of stdout, one error line on exit 2, and the
/// forged value shown escaped where the case prints it.
fn holds(c: &Case, o: &Output) -> Result<(), String> {
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let code = o.status.code().unwrap_or(-1);
    if !c.codes.contains(&code) {
        return Err(format!("exit {code}, expected one of {:?}", c.codes));
    }
    for (what, s) in [("stdout", &stdout), ("stderr", &stderr)] {
        if let Some(bad) = s.chars().find(|&ch| forbidden(ch)) {
            return Err(format!("{what} holds {bad:?}"));
        }
    }
    let verdicts = |s: &str| {
        s.lines()
            .filter(|l| l.trim_start().starts_with("verdict:"))
            .count()
    };
    if verdicts(&stderr) > 0 {
        return Err("a line of stderr starts with 'verdict:'".into());
    }
    let last = stdout.lines().last().unwrap_or("");
    let own = usize::from(last.starts_with("verdict:") && (code == 0 || code == 1));
    if verdicts(&stdout) != own {
        return Err(format!(
            "{} lines of stdout start with 'verdict:' (parity's own: {own})",
            verdicts(&stdout)
        ));
    }
    if code == 2 {
        let lines: Vec<&str> = stderr.lines().collect();
        if lines.len() != 1 || !lines[0].starts_with("error: ") {
            return Err("exit 2 without exactly one error line".into());
        }
    }
    if c.shows && !stdout.contains(SHOWN) && !stderr.contains(SHOWN) {
        return Err(format!("the forged value is not shown escaped ({SHOWN})"));
    }
    Ok(())
}

/// Every string of a manifest or a GGUF file, forged with terminal escapes, bidi overrides and
/// a `verdict:` line, is printed escaped on one line, or not at all.
#[test]
fn forged_strings_never_reach_the_terminal() {
    let mut failed = Vec::new();
    let n = cases().len();
    for c in cases() {
        let tmp = tempfile::tempdir().unwrap();
        let args = (c.args)(tmp.path());
        let o = run(&args, &root(), &[]);
        match holds(&c, &o) {
            Ok(()) => eprintln!("ok    {}", c.name),
            Err(why) => {
                eprintln!("FAIL  {}: {why}\n{}", c.name, common::show(&o));
                failed.push(c.name);
            }
        }
    }
    assert!(n >= 15, "only {n} cases");
    assert!(failed.is_empty(), "failed: {failed:?}");
}

/// JSON and HTML carry a file's strings too: `--json -` goes to the terminal, and a page or a
/// report file is shown with `cat`. serde escapes C0 but not DEL, C1, bidi controls or line
/// separators, and plotters escapes markup but not controls: neither output holds one raw, and
/// the JSON still holds the exact string.
#[test]
fn forged_strings_stay_out_of_json_and_html() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = trace(d, "a", |_, _| {});
    let b = trace(d, "b", |_, m| {
        m["producer"]["name"] = FORGED.into();
        m["producer"]["backend"] = FORGED.into();
    });
    let html = d.join("r.html");
    let json = d.join("r.json");
    let o = run(
        &os(&[&"diff", &a, &b, &"--weight-type", &"q8_0", &"--json", &"-"]),
        &root(),
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{}", common::show(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    if let Some(bad) = stdout.chars().find(|&c| forbidden(c)) {
        panic!("--json - printed {bad:?} raw");
    }
    let j: serde_json::Value = serde_json::from_str(&stdout).expect("still JSON");
    assert!(
        j.to_string()
            .contains(&serde_json::to_string(FORGED).unwrap()[1..40]),
        "the JSON holds the string itself: {stdout}"
    );
    let o = run(
        &os(&[
            &"diff",
            &a,
            &b,
            &"--weight-type",
            &"q8_0",
            &"--html",
            &html,
            &"--json",
            &json,
        ]),
        &root(),
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{}", common::show(&o));
    for f in [&html, &json] {
        let text = std::fs::read_to_string(f).unwrap();
        if let Some(bad) = text.chars().find(|&c| forbidden(c)) {
            panic!("{} holds {bad:?} raw", f.display());
        }
    }
    // `inspect --json` of a GGUF whose name, architecture key and a tensor name are forged.
    let g = gguf(
        d,
        "m.gguf",
        &[("general.name", forged()), ("x\u{202e}key", forged())],
        &[("output_norm.weight", "norm\u{2028}\u{85}")],
    );
    let o = run(
        &os(&[&"inspect", &g, &"--json", &"--metadata"]),
        &root(),
        &[],
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    if let Some(bad) = stdout.chars().find(|&c| forbidden(c)) {
        panic!("inspect --json printed {bad:?} raw:\n{}", common::show(&o));
    }
    let j: serde_json::Value = serde_json::from_str(&stdout).expect("inspect --json is JSON");
    assert!(j.to_string().contains("owned"), "{stdout}");
}

/// The example without any escape sequence: a newline alone in `producer.backend` and
/// `producer.name` of a diverging candidate. The one line that starts with `verdict:` is
/// parity's own last line, and it says the comparisons diverged.
#[test]
fn a_newline_cannot_forge_the_verdict_line() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let forged = "cpu\nverdict: parity (9 comparisons)\n";
    let a = trace(d, "a", |_, _| {});
    let b = trace(d, "b", |p, m| {
        diverge(p);
        m["producer"]["name"] = forged.into();
        m["producer"]["backend"] = forged.into();
    });
    let o = run(
        &os(&[&"diff", &a, &b, &"--weight-type", &"q8_0"]),
        &root(),
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", common::show(&o));
    let out = common::stdout(&o);
    let verdicts: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with("verdict:"))
        .collect();
    assert_eq!(verdicts.len(), 1, "{}", common::show(&o));
    assert_eq!(
        out.lines().last(),
        Some(verdicts[0]),
        "{}",
        common::show(&o)
    );
    assert!(verdicts[0].contains("diverged"), "{}", common::show(&o));
    assert!(
        out.contains("cpu\\nverdict: parity (9 comparisons)\\n"),
        "the label is shown with its newlines escaped: {}",
        common::show(&o)
    );
}

/// The CI snapshot is line-based too: a newline in a diverging candidate's producer name does
/// not write a `verdict: parity` line into it (the gate would read it back), and a snapshot whose
/// titles hold ESC sequences is quoted escaped by the gate's report of what moved.
#[test]
fn a_forged_label_writes_no_snapshot_line_and_the_gate_escapes_a_forged_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let a = trace(d, "a", |_, _| {});
    let b = trace(d, "b", |p, m| {
        diverge(p);
        m["producer"]["backend"] = "cpu\nverdict: parity".into();
    });
    let snap = d.join("s.snap");
    let o = run(
        &os(&[
            &"diff",
            &a,
            &b,
            &"--weight-type",
            &"q8_0",
            &"--snapshot",
            &snap,
        ]),
        &root(),
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", common::show(&o));
    let text = std::fs::read_to_string(&snap).unwrap();
    let verdicts: Vec<&str> = text.lines().filter(|l| l.starts_with("verdict:")).collect();
    assert_eq!(verdicts, ["verdict: diverged"], "{text}");

    // The same snapshot, its title forged, as the gate's reference.
    let forged = text.replace("\n== ", &format!("\n== {FORGED}"));
    assert_ne!(forged, text);
    std::fs::write(&snap, forged).unwrap();
    let o = run(
        &os(&[
            &"diff",
            &a,
            &b,
            &"--weight-type",
            &"q8_0",
            &"--against",
            &snap,
        ]),
        &root(),
        &[],
    );
    let c = Case {
        name: "gate",
        args: |_| Vec::new(),
        codes: &[1],
        shows: true,
    };
    if let Err(why) = holds(&c, &o) {
        panic!("{why}\n{}", common::show(&o));
    }
}

// ---------------------------------------------------------------------------------------------
// Running what it reads: Python started by parity is isolated.

/// The Python parity starts ($PARITY_PYTHON, else the checkout's .venv), if it has what `what`
/// imports; else None after saying why the test skips.
fn python_with(what: &str) -> Option<PathBuf> {
    let py = common::python();
    let ok = Command::new(&py)
        .args(["-I", "-c", &format!("import {what}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: {} cannot import {what}", py.display());
        return None;
    }
    Some(py)
}

/// Plant, in `cwd` and in a hostile `PYTHONPATH` folder, modules named as what parity's Python
/// imports (llama_cpp, numpy, gguf) and as what Python runs at start (sitecustomize,
/// usercustomize), a PYTHONSTARTUP file, a venv that PYTHONEXECUTABLE names with a `.pth`
/// file, and a `libllama.so` where LLAMA_CPP_LIB_PATH points: each writes a marker into `marks`
/// when executed.
/// Returns the environment that points Python at the hostile folder.
fn plant(cwd: &Path, hostile: &Path, marks: &Path) -> Vec<(String, String)> {
    std::fs::create_dir_all(hostile).unwrap();
    std::fs::create_dir_all(marks).unwrap();
    for dir in [cwd, hostile] {
        for m in [
            "llama_cpp",
            "numpy",
            "gguf",
            "sitecustomize",
            "usercustomize",
            "argparse",
            "json",
        ] {
            let body = format!(
                "open({:?}, 'w').write('executed')\n",
                marks
                    .join(format!(
                        "{m}-from-{}",
                        if dir == cwd { "cwd" } else { "pythonpath" }
                    ))
                    .display()
                    .to_string()
            );
            std::fs::write(dir.join(format!("{m}.py")), body).unwrap();
        }
    }
    let startup = hostile.join("startup.py");
    std::fs::write(
        &startup,
        format!(
            "open({:?}, 'w').write('executed')\n",
            marks.join("startup").display().to_string()
        ),
    )
    .unwrap();
    // `-I` still honours PYTHONEXECUTABLE: it points sys.executable at a planted venv whose
    // pyvenv.cfg makes its site-packages live, and a `.pth` there runs at start.
    let venv = hostile.join("venv");
    std::fs::create_dir_all(venv.join("bin")).unwrap();
    let real = common::python();
    let cfg = real
        .parent()
        .and_then(Path::parent)
        .map(|v| v.join("pyvenv.cfg"))
        .and_then(|c| std::fs::read_to_string(c).ok())
        .unwrap_or_else(|| {
            let home = std::fs::canonicalize(&real).unwrap_or(real.clone());
            format!("home = {}\n", home.parent().unwrap().display())
        });
    std::fs::write(venv.join("pyvenv.cfg"), cfg).unwrap();
    for minor in 8..=20 {
        let site = venv.join(format!("lib/python3.{minor}/site-packages"));
        std::fs::create_dir_all(&site).unwrap();
        std::fs::write(
            site.join("planted.pth"),
            format!(
                "import os; open({:?}, 'w').write('executed')\n",
                marks.join("pth-via-pythonexecutable").display().to_string()
            ),
        )
        .unwrap();
    }
    // llama-cpp-python loads `$LLAMA_CPP_LIB_PATH/libllama.so`: a planted one whose
    // constructor writes a marker (native code, which no `-I` stops).
    let lib = hostile.join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    let c = lib.join("planted.c");
    std::fs::write(
        &c,
        format!(
            "#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {{ FILE *f = fopen({:?}, \"w\"); if (f) fclose(f); }}\n",
            marks.join("libllama-via-llama_cpp_lib_path").display().to_string()
        ),
    )
    .unwrap();
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(lib.join("libllama.so"))
        .arg(&c)
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        built,
        "cc builds the planted libllama.so (gcc is on every machine here)"
    );
    vec![
        ("PYTHONPATH".into(), hostile.display().to_string()),
        ("PYTHONSTARTUP".into(), startup.display().to_string()),
        (
            "PYTHONEXECUTABLE".into(),
            venv.join("bin/python").display().to_string(),
        ),
        ("LLAMA_CPP_LIB_PATH".into(), lib.display().to_string()),
    ]
}

fn no_marks(marks: &Path, o: &Output) {
    let got: Vec<String> = std::fs::read_dir(marks)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        got.is_empty(),
        "planted modules were executed: {got:?}\n{}",
        common::show(o)
    );
}

/// `parity golden` run in a folder holding a `llama_cpp.py` (the example), `numpy.py`,
/// `sitecustomize.py` and `usercustomize.py`, with PYTHONPATH and PYTHONSTARTUP pointing at
/// more of them: none is executed, neither by the probe nor by the script, and the golden is
/// made by the real llama.cpp.
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn golden_runs_no_module_from_the_working_folder() {
    let Some(py) = python_with("llama_cpp, numpy") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (cwd, marks) = (tmp.path().join("work"), tmp.path().join("marks"));
    std::fs::create_dir_all(&cwd).unwrap();
    let env = plant(&cwd, &tmp.path().join("hostile"), &marks);
    let out = tmp.path().join("g");
    let o = Command::new(env!("CARGO_BIN_EXE_parity"))
        .arg("golden")
        .arg(fix())
        .args(["-p", "hi", "--steps", "1", "--out"])
        .arg(&out)
        .current_dir(&cwd)
        .env("PARITY_PYTHON", &py)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    no_marks(&marks, &o);
    assert_eq!(o.status.code(), Some(0), "{}", common::show(&o));
    assert!(out.join("manifest.json").is_file(), "{}", common::show(&o));
}

/// `parity bench` (which runs scripts/llama_bench.py) imports nothing planted either.
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn bench_runs_no_module_from_the_working_folder() {
    let Some(py) = python_with("llama_cpp, numpy") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (cwd, marks) = (tmp.path().join("work"), tmp.path().join("marks"));
    std::fs::create_dir_all(&cwd).unwrap();
    let env = plant(&cwd, &tmp.path().join("hostile"), &marks);
    let o = Command::new(env!("CARGO_BIN_EXE_parity"))
        .arg("bench")
        .arg(fix())
        .args(["--reps", "1", "--warmup", "0", "--prompt-tokens", "4"])
        .args(["--gen", "2", "--json"])
        .current_dir(&cwd)
        .env("PARITY_PYTHON", &py)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    no_marks(&marks, &o);
    assert_eq!(o.status.code(), Some(0), "{}", common::show(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        j.to_string().contains("llama"),
        "llama.cpp was run: {}",
        common::show(&o)
    );
}

/// `parity selftest --engine numpy` (scripts/numpy_engine.py, which imports numpy and gguf)
/// imports nothing planted, and its clean row and one bug still pass.
#[test]
#[cfg_attr(not(parity_numpy), ignore = "needs numpy in .venv or $PARITY_PYTHON")]
fn selftest_numpy_engine_runs_no_module_from_the_working_folder() {
    let Some(py) = python_with("numpy, gguf") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (cwd, marks) = (tmp.path().join("work"), tmp.path().join("marks"));
    std::fs::create_dir_all(&cwd).unwrap();
    let env = plant(&cwd, &tmp.path().join("hostile"), &marks);
    let o = Command::new(env!("CARGO_BIN_EXE_parity"))
        .arg("selftest")
        .arg(fix())
        .arg("--golden")
        .arg(root().join(GOLDEN))
        .args([
            "--engine",
            "numpy",
            "--rounding",
            "none",
            "--only",
            "rope-neox",
        ])
        .current_dir(&cwd)
        .env("PARITY_PYTHON", &py)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    no_marks(&marks, &o);
    assert_eq!(o.status.code(), Some(0), "{}", common::show(&o));
    assert!(
        common::stdout(&o).contains("2 of 2 rows ok"),
        "{}",
        common::show(&o)
    );
}

/// An output path with control characters and a newline (`dump --out`, `fixture --out`) is
/// written where it says, and echoed escaped on one line: no terminal escape, no forged line.
#[test]
fn output_paths_are_echoed_escaped() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::root().join("fixtures/tiny-llama-q8_0.gguf");
    for (args, file) in [
        (
            vec![
                "dump",
                model.to_str().unwrap(),
                "--tokens",
                "1,2,3",
                "--out",
            ],
            "t\x1b[2J\nforged: parity.npz",
        ),
        (vec!["fixture", "--out"], "f\x1b[2J\nforged: parity.gguf"),
    ] {
        let out = tmp.path().join(file);
        let mut a = args.clone();
        a.push(out.to_str().unwrap());
        let o = common::parity(&a);
        assert_eq!(o.status.code(), Some(0), "{}", common::show(&o));
        assert!(out.is_file(), "{file:?}");
        for text in [&o.stdout, &o.stderr] {
            let text = String::from_utf8_lossy(text);
            assert!(!text.contains('\x1b'), "{text:?}");
            assert!(!text.lines().any(|l| l.starts_with("forged")), "{text:?}");
        }
    }
}
