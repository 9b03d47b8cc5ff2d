//! Helpers shared by the CLI tests: run the real binary from the repository root, find
//! ../shared, read and write .npy files, list and copy trace folders.
#![allow(dead_code)]

pub mod alloc;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn shared(sub: &str) -> Option<PathBuf> {
    let p = root().join("..").join("shared").join(sub);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: ../shared/{sub} not found");
        None
    }
}

pub fn parity_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_parity"));
    c.args(args).current_dir(root());
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run parity")
}

/// `parity_env` with the variables in `remove` taken out of the inherited environment.
pub fn parity_env_without(args: &[&str], env: &[(&str, &str)], remove: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_parity"));
    c.args(args).current_dir(root());
    for k in remove {
        c.env_remove(k);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run parity")
}

pub fn parity(args: &[&str]) -> Output {
    parity_env(args, &[])
}

pub fn show(o: &Output) -> String {
    // A process killed by a signal has no exit code: name the signal (a driver's crash).
    #[cfg(unix)]
    let signal = std::os::unix::process::ExitStatusExt::signal(&o.status)
        .map_or(String::new(), |s| format!(" (killed by signal {s})"));
    #[cfg(not(unix))]
    let signal = String::new();
    format!(
        "exit {:?}{signal}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

pub fn read_npy(p: &Path) -> (Vec<u64>, Vec<f32>) {
    let bytes = std::fs::read(p).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    assert_eq!(npy.order(), npyz::Order::C, "{}", p.display());
    let shape = npy.shape().to_vec();
    (shape, npy.into_vec::<f32>().unwrap())
}

pub fn write_npy(p: &Path, shape: &[u64], data: &[f32]) {
    use npyz::WriterBuilder;
    let f = std::io::BufWriter::new(std::fs::File::create(p).unwrap());
    let mut w = npyz::WriteOptions::<f32>::new()
        .default_dtype()
        .shape(shape)
        .writer(f)
        .begin_nd()
        .unwrap();
    w.extend(data.iter().copied()).unwrap();
    w.finish().unwrap();
}

/// The `.npy` files of a trace folder as sorted `step_dir/file` names (one level of step
/// folders below `dir`).
pub fn npy_files(dir: &Path) -> Vec<String> {
    let mut v = Vec::new();
    for s in std::fs::read_dir(dir).unwrap().flatten() {
        if s.path().is_dir() {
            for f in std::fs::read_dir(s.path()).unwrap().flatten() {
                v.push(format!(
                    "{}/{}",
                    s.file_name().to_string_lossy(),
                    f.file_name().to_string_lossy()
                ));
            }
        }
    }
    v.sort();
    v
}

/// The Python parity runs scripts with ($PARITY_PYTHON, else the checkout's .venv).
pub fn python() -> PathBuf {
    std::env::var_os("PARITY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"))
}

/// Whether llama.cpp (llama-cpp-python) and numpy import; says "skipped: …" when not. Tests
/// that need it are also marked `#[cfg_attr(not(parity_llama_cpp), ignore = …)]` (build.rs).
pub fn llama_cpp_or_skip() -> bool {
    let py = python();
    let ok = std::process::Command::new(&py)
        .args(["-c", "import llama_cpp, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: llama_cpp not importable from {}", py.display());
    }
    ok
}

/// What the long-prompt tests run on: the numpy engine's Python, TinyStories-656K-Q8_0, and
/// llama.cpp's golden of a 398-token story prompt (one story three times; 4 decode steps) in
/// `tmp` — long enough for the rounding ties and position edges a 20-token prompt never shows.
pub struct LongStory {
    pub py: PathBuf,
    pub model: PathBuf,
    pub golden: PathBuf,
    pub tmp: tempfile::TempDir,
}

/// [`LongStory`], or None (said why) where the numpy engine, the shared models or llama.cpp
/// are missing.
#[allow(dead_code)]
pub fn long_story() -> Option<LongStory> {
    let py = numpy_engine_python()?;
    let model = shared("models")?.join("TinyStories-656K-Q8_0.gguf");
    if !llama_cpp_or_skip() {
        return None;
    }
    let story = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine with her dog, Max. One day, Lily and Max went to the park. They saw a big tree with red apples. Lily wanted to pick an apple, but the tree was too tall. She asked her mom for help. Her mom lifted her up, and Lily picked the biggest apple. She shared it with Max and they were very happy. Then they saw a boy named Tim who was sad because he lost his ball. Lily and Max helped Tim look for the ball under the bushes and near the pond. Max found the ball and brought it back to Tim. Tim smiled and said thank you. They all played together until the sun went down. ";
    let tmp = tempfile::tempdir().unwrap();
    let golden = tmp.path().join("golden");
    let o = parity(&[
        "golden",
        model.to_str().unwrap(),
        "-p",
        &story.repeat(3),
        "--out",
        golden.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", show(&o));
    assert!(stdout(&o).contains("prompt 398 tokens"), "{}", show(&o));
    Some(LongStory {
        py,
        model,
        golden,
        tmp,
    })
}

/// `python()` if it can run scripts/numpy_engine.py (numpy and gguf-py); else None after
/// saying why the test skips.
pub fn numpy_engine_python() -> Option<PathBuf> {
    let py = python();
    let ok = std::process::Command::new(&py)
        .args(["-c", "import numpy, gguf"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "skipped: {} cannot import numpy and gguf (the numpy engine needs them)",
            py.display()
        );
        return None;
    }
    Some(py)
}

/// scripts/numpy_engine.py on `model`, fed `golden`'s steps with ggml's rounding, writing `out`;
/// `bug` is a catalog mutation, `args` the rest of its flags. Panics if the engine fails.
#[allow(dead_code)]
pub fn numpy_engine_trace(
    py: &Path,
    model: &str,
    golden: &Path,
    out: &Path,
    bug: Option<&str>,
    args: &[&str],
) {
    let mut c = std::process::Command::new(py);
    c.arg(root().join("scripts/numpy_engine.py"))
        .arg(model)
        .args(["--golden", golden.to_str().unwrap(), "--rounding", "ggml"])
        .args(["--out", out.to_str().unwrap()])
        .args(args);
    if let Some(b) = bug {
        c.args(["--mutate", b]);
    }
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", show(&o));
}

/// Backends of the default `parity check` set on this machine: reference, reference:ggml-cpu
/// and fast, plus gpu where a hardware GPU adapter exists (`parity gpu --json` says which
/// adapter the gpu backend gets; one that runs on the CPU, lavapipe, is left out).
pub fn default_backends() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        let o = parity(&["gpu", "--json"]);
        let hw = o.status.success()
            && serde_json::from_slice::<serde_json::Value>(&o.stdout)
                .is_ok_and(|v| v["device_type"].as_str().is_some_and(|t| t != "Cpu"));
        if hw { 4 } else { 3 }
    })
}

/// Comparisons of a clean default `parity check` against a tight golden: op by op for every
/// backend but the plain reference, each backend against the golden, and every pair of
/// backends. 3 backends give 2 op-by-op comparisons (ggml-cpu, fast) + 3 against the golden +
/// 3 pairs = 8; with gpu, 3 op by op (gpu against the plain reference fed the same inputs) +
/// 4 + 6 = 13.
pub fn default_comparisons() -> usize {
    let n = default_backends();
    (n - 1) + n + n * (n - 1) / 2
}

/// The verdict line of a clean default `parity check` against a tight golden.
pub fn default_verdict() -> String {
    format!("verdict: parity ({} comparisons)", default_comparisons())
}

/// Copy the committed golden (`golden/tiny-llama-q8_0`) to `dir/name`, with its model reference
/// made unknown (so that `diff` compares end to end with --weight-type, without the judge) and
/// `edit` applied to its folder and manifest.
pub fn golden_unknown_model(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&Path, &mut serde_json::Value),
) -> PathBuf {
    let d = dir.join(name);
    copy_dir(&root().join("golden/tiny-llama-q8_0"), &d);
    let mp = d.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mp).unwrap()).unwrap();
    m["model"]["path"] = "elsewhere/model.gguf".into();
    m["model"]["sha256"] = "0".repeat(64).into();
    edit(&d, &mut m);
    std::fs::write(&mp, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    d
}

/// The lines a doc shows as a command's output: the ```text block after the marker
/// `<!-- output of tests/FILE.rs: NAME -->` in `doc`, without its `$ ` command lines.
#[allow(dead_code)]
pub fn shown_output(doc: &str, marker: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(doc)).unwrap();
    let tag = format!("<!-- output of {marker} -->");
    let at = text
        .find(&tag)
        .unwrap_or_else(|| panic!("{doc} has no `{tag}`"));
    let block = text[at..]
        .split("```text\n")
        .nth(1)
        .and_then(|b| b.split("\n```").next())
        .unwrap_or_else(|| panic!("{doc}: no ```text block after `{tag}`"));
    block
        .lines()
        .filter(|l| !l.starts_with("$ ") && l.trim() != "…")
        .map(String::from)
        .collect()
}

/// Every line `doc` shows after `marker` is a line the run printed, `…` standing for any text
/// (the pieces between must appear in order).
#[allow(dead_code)]
pub fn assert_shown(doc: &str, marker: &str, printed: &str) {
    let lines = shown_output(doc, marker);
    assert!(!lines.is_empty(), "{doc}: `{marker}` shows nothing");
    let matches = |shown: &str, p: &str| {
        let mut pieces = shown.split('…');
        let Some(mut rest) = p.strip_prefix(pieces.next().unwrap_or("")) else {
            return false;
        };
        for piece in pieces {
            match rest.find(piece) {
                Some(k) => rest = &rest[k + piece.len()..],
                None => return false,
            }
        }
        shown.ends_with('…') || rest.is_empty()
    };
    for l in lines {
        assert!(
            printed.lines().any(|p| matches(&l, p)),
            "{doc} shows `{l}` ({marker}) but the run printed:\n{printed}"
        );
    }
}

/// The trace `dir` cut to what engine authors dump first (embd, l_out, result_norm, logits),
/// written to `to`: a sparse dump of the same run.
#[allow(dead_code)]
pub fn sparse_copy(dir: &Path, to: &Path) {
    let text = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let keep = ["embd", "l_out", "result_norm", "logits"];
    let tensors: Vec<serde_json::Value> = m["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| keep.contains(&t["tap"].as_str().unwrap()))
        .cloned()
        .collect();
    for t in &tensors {
        let f = t["file"].as_str().unwrap();
        std::fs::create_dir_all(to.join(f).parent().unwrap()).unwrap();
        std::fs::copy(dir.join(f), to.join(f)).unwrap();
    }
    m["tensors"] = tensors.into();
    std::fs::write(to.join("manifest.json"), m.to_string()).unwrap();
}

/// The own-inputs comparison of a `parity diff --json` report (the op-by-op judgement).
#[allow(dead_code)]
pub fn own_inputs(report: &serde_json::Value) -> &serde_json::Value {
    report["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["pair"] == "own-inputs")
        .unwrap_or_else(|| panic!("no own-inputs comparison: {report:#}"))
}

/// The `dev` profile with the `test` profile's settings, as `CARGO_PROFILE_DEV_*` variables
/// taken from Cargo.toml's `[profile.test]`: what the tests that build parity without its
/// dev-dependencies (the Python kit's wheel, the packaged crates' install) build with, in
/// cargo's own build folder, so the dependencies the first compiles the second reuses (their
/// features differ from `cargo test`'s, which dev-dependencies widen).
#[allow(dead_code)]
pub fn dev_profile_as_test() -> Vec<(String, String)> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let mut env = Vec::new();
    let mut in_test = false;
    for line in manifest.lines() {
        let line = line.split('#').next().unwrap().trim();
        if line.starts_with('[') {
            in_test = line == "[profile.test]";
        } else if let (true, Some((k, v))) = (in_test, line.split_once('=')) {
            let key = k.trim().to_uppercase().replace('-', "_");
            env.push((
                format!("CARGO_PROFILE_DEV_{key}"),
                v.trim().trim_matches('"').to_string(),
            ));
        }
    }
    env
}

/// A fresh folder under the temporary one, named `parity-NAME-…`, removed when dropped.
pub struct Tmp(tempfile::TempDir);

impl std::ops::Deref for Tmp {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

pub fn tempdir(name: &str) -> Tmp {
    Tmp(tempfile::Builder::new()
        .prefix(&format!("parity-{name}-"))
        .tempdir()
        .unwrap())
}

/// Lavapipe when it is installed (a machine with a real GPU keeps its own driver list), with
/// uninitialised device memory poisoned so that a kernel reading what it never wrote shows.
pub fn gpu_env() -> Vec<(&'static str, &'static str)> {
    let lvp = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json";
    let mut env = vec![("LVP_POISON_MEMORY", "true"), ("XDG_RUNTIME_DIR", "/tmp")];
    if Path::new(lvp).exists() && std::env::var_os("VK_DRIVER_FILES").is_none() {
        env.push(("VK_DRIVER_FILES", lvp));
    }
    env
}

/// Whether this is the child `in_child_with` started. A test that must run with variables
/// the Vulkan loader and driver read through C's getenv (which a set_var in the shared test
/// process would race, and leak into every other test's children) calls
/// `if !in_child_with(module_path!(), "its_name", &env) { return; }`: the parent runs the test
/// binary again for that one test with `env` set, asserts it passed, and returns.
pub fn in_child_with(module: &str, test: &str, env: &[(&str, &str)]) -> bool {
    const MARK: &str = "PARITY_TEST_CHILD";
    if std::env::var_os(MARK).is_some() {
        return true;
    }
    // module_path!() is `suite::file`; libtest names the test `file::test`.
    let name = match module.split_once("::") {
        Some((_, rest)) => format!("{rest}::{test}"),
        None => test.to_string(),
    };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name.as_str(), "--exact", "--include-ignored", "--nocapture"])
        .envs(env.iter().copied())
        .env(MARK, "1")
        .output()
        .expect("run the test binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{name} with {env:?}:\n{text}");
    assert!(text.contains("1 passed"), "{name} did not run:\n{text}");
    false
}

/// A trace held in memory, as an engine named `name` (backend `backend`) would write it for
/// the model of `sha256` ("" where the test does not check it).
pub fn memory_trace(
    name: &str,
    backend: &str,
    sha256: &str,
    steps: Vec<parity::trace::StepInfo>,
    tensors: std::collections::BTreeMap<parity::trace::TapKey, ndarray::ArrayD<f32>>,
) -> parity::trace::Trace {
    parity::trace::Trace::from_memory(
        parity::trace::ModelRef {
            path: String::new(),
            sha256: sha256.into(),
            size: None,
        },
        parity::trace::Producer {
            name: name.into(),
            backend: backend.into(),
            version: String::new(),
            settings: serde_json::Value::Null,
        },
        steps,
        tensors,
    )
}

/// The own-inputs `first_divergence` of a report is at step 0 layer 0 `tap` and its diagnosis
/// confirms `named` by experiment (`named`: the text after "confirmed by experiment: ").
#[allow(dead_code)]
pub fn assert_at_layer0_named(own: &serde_json::Value, tap: &str, named: &str, what: &str) {
    let d = &own["first_divergence"];
    assert_eq!(
        d["at"]["key"],
        serde_json::json!({"step": 0, "layer": 0, "tap": tap}),
        "{what}: {d:#}"
    );
    let why = d["diagnosis"].as_str().unwrap_or_default();
    assert!(
        why.contains(&format!("confirmed by experiment: {named}")),
        "{what}: {why}"
    );
}

/// `cmd`'s exit status and what it wrote to stderr, or None where it ran past `limit` (then
/// killed): a third-party program may hang on a crafted input (llama.cpp once sat blocked on
/// one of adversarial_inputs' models until CI's limit).
pub fn status_within(cmd: &mut Command, limit: Duration) -> Option<(ExitStatus, String)> {
    let err = tempfile::NamedTempFile::new().unwrap();
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(err.reopen().unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some((
                status,
                std::fs::read_to_string(err.path()).unwrap_or_default(),
            ));
        }
        if start.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
