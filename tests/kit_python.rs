//! The Python kit (bindings/python): maturin builds the parity-trace wheel — the `parity` binary
//! plus the pure-Python `parity_trace` package — it is installed into a fresh venv, and from
//! that venv alone (no repository folder on sys.path, parity run as an installed binary) the
//! numpy engine writes traces through the installed writer that the installed `parity diff`
//! passes and fails as it should, the pytest helper turns that verdict into a test result, and
//! `parity golden` runs the llama.cpp of the venv it is installed in.
//!
//! Needs maturin (`pip install maturin` into .venv, or on PATH; build/probe.rs), `python -m
//! venv` and PyPI (numpy, gguf, pytest); the golden test also llama-cpp-python (a wheel in
//! ../shared/wheels, else pip's cache or a source build). The wheel is built into cargo's target
//! folder with the test profile's settings, so it reuses what `cargo test` compiled (see
//! `wheel_build`).

use crate::common;
use common::*;

#[allow(dead_code)]
mod probe {
    include!("../build/probe.rs");
}
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Instant;

const GOLDEN: &str = "golden/tiny-llama-q8_0";
const FIXTURE: &str = "fixtures/tiny-llama-q8_0.gguf";

/// The wheel, installed in a fresh venv: shared by the tests of this file (built once).
struct Kit {
    dir: PathBuf,
    venv: PathBuf,
    wheel: PathBuf,
}

impl Kit {
    fn bin(&self, name: &str) -> PathBuf {
        self.venv.join("bin").join(name)
    }

    /// A command of the venv's as a user's shell would run it: nothing of the repository's
    /// environment (PARITY_PYTHON, PYTHONPATH) leaks in, and parity behaves as an installed
    /// binary away from its checkout (its scripts and fixture unpacked into `dir/cache`).
    fn cmd(&self, program: &Path) -> Command {
        let mut c = Command::new(program);
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy().into_owned();
            if k.starts_with("PYTHON") || k.starts_with("PARITY_") || k == "VIRTUAL_ENV" {
                c.env_remove(&k);
            }
        }
        c.env("PARITY_NO_CHECKOUT", "1")
            .env("XDG_CACHE_HOME", self.dir.join("cache"))
            .current_dir(&self.dir);
        c
    }

    fn parity(&self, args: &[&str]) -> Output {
        self.cmd(&self.bin("parity"))
            .args(args)
            .output()
            .expect("run the venv's parity")
    }

    fn pip(&self, args: &[&str]) -> Output {
        self.cmd(&self.bin("python"))
            .args(["-m", "pip", "--disable-pip-version-check", "install", "-q"])
            .args(args)
            .output()
            .expect("run pip")
    }
}

/// The Python the build probed (build/probe.rs: $PARITY_PYTHON, else .venv, else python3).
fn probe_python() -> PathBuf {
    probe::python(&root())
}

/// maturin as build/probe.rs found it: the probe Python's module, else one on PATH.
fn maturin() -> Command {
    let py = probe_python();
    if probe::python_can(&py, "import maturin") {
        let mut c = Command::new(py);
        c.args(["-m", "maturin"]);
        c
    } else {
        Command::new("maturin")
    }
}

/// Where and how to build the wheel so that it reuses what `cargo test` compiled: cargo's own
/// target folder (CARGO_BIN_EXE_parity is `TARGET/<profile folder>/parity`) and, for `debug/`,
/// the `dev` profile with the `test` profile's settings (`CARGO_PROFILE_DEV_*` taken from
/// Cargo.toml's `[profile.test]`), so that dependencies compiled alike are the same artifacts.
/// maturin cannot ask for `--profile test` itself: it builds with `cargo rustc`, where that
/// means "build the test harness". The features the dev-dependencies widen under `cargo test`
/// are turned on in every build (Cargo.toml), so the dependencies are the same artifacts and
/// only parity itself is compiled once more (before that, every dependency serde_json or
/// hashbrown reaches was too: 12 min on 2 shared cores).
fn wheel_build() -> (PathBuf, &'static str, Vec<(String, String)>) {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_parity"));
    let profile_dir = exe.parent().unwrap();
    let target = profile_dir.parent().unwrap().to_path_buf();
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        return (target, "release", Vec::new());
    }
    (target, "dev", dev_profile_as_test())
}

fn build_kit() -> Result<Kit, String> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kit-python");
    // Fresh every run: the venv of an earlier run is removed, never reused.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (target, profile, env) = wheel_build();
    let wheels = dir.join("wheels");
    let t = Instant::now();
    // In bindings/python: maturin reads the pyproject.toml of the folder it runs in. Compiled
    // in cargo's own build folder (what `cargo test` built is reused), the binary linked into
    // a target folder of its own: never over TARGET/<profile>/parity, which other tests run.
    let o = maturin()
        .args(["build", "--profile", profile])
        .arg("--target-dir")
        .arg(dir.join("target"))
        .arg("--out")
        .arg(&wheels)
        .env("CARGO_BUILD_BUILD_DIR", &target)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(root().join("bindings/python"))
        .output()
        .map_err(|e| format!("run maturin: {e}"))?;
    if !o.status.success() {
        return Err(format!("maturin build\n{}", show(&o)));
    }
    eprintln!(
        "maturin build --profile {profile} {env:?}, build dir {}: {:.1} s",
        target.display(),
        t.elapsed().as_secs_f64()
    );
    let wheel = std::fs::read_dir(&wheels)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or("maturin wrote no wheel")?;
    let name = wheel.file_name().unwrap().to_string_lossy().into_owned();
    if !name.starts_with("parity_trace-") || !name.contains("-py3-none-") {
        return Err(format!("unexpected wheel name {name}"));
    }
    let venv = dir.join("venv");
    let o = Command::new(probe_python())
        .args(["-m", "venv"])
        .arg(&venv)
        .output()
        .map_err(|e| format!("python -m venv: {e}"))?;
    if !o.status.success() {
        return Err(format!("python -m venv\n{}", show(&o)));
    }
    let kit = Kit { dir, venv, wheel };
    let t = Instant::now();
    // The wheel with its dependency (numpy), gguf-py for the numpy engine, pytest for the helper.
    let o = kit.pip(&[kit.wheel.to_str().unwrap(), "gguf", "pytest"]);
    if !o.status.success() {
        return Err(format!("pip install the wheel (needs PyPI)\n{}", show(&o)));
    }
    eprintln!("pip install: {:.1} s", t.elapsed().as_secs_f64());
    Ok(kit)
}

fn kit() -> &'static Kit {
    static KIT: OnceLock<Result<Kit, String>> = OnceLock::new();
    match KIT.get_or_init(build_kit) {
        Ok(k) => k,
        Err(e) => panic!("{e}"),
    }
}

/// Run a copy of scripts/numpy_engine.py — alone in a folder, no bindings/python beside it —
/// with the venv's Python; returns the file parity_trace was imported from.
fn numpy_engine(kit: &Kit, out: &Path, extra: &[&str]) -> String {
    let engine = kit.dir.join("engine/numpy_engine.py");
    if !engine.exists() {
        std::fs::create_dir_all(engine.parent().unwrap()).unwrap();
        std::fs::copy(root().join("scripts/numpy_engine.py"), &engine).unwrap();
    }
    let mut argv = vec![
        engine.display().to_string(),
        root().join(FIXTURE).display().to_string(),
        "--golden".into(),
        root().join(GOLDEN).display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    // Isolated as parity runs it (-I: no working folder on sys.path); the module the engine
    // imported is printed after it ran.
    let code = format!(
        "import runpy, sys; sys.argv = {argv:?}; runpy.run_path(sys.argv[0], run_name='__main__'); \
         print(sys.modules['parity_trace'].__file__)"
    );
    let o = kit
        .cmd(&kit.bin("python"))
        .args(["-I", "-c", &code])
        .output()
        .unwrap();
    assert!(o.status.success(), "numpy engine {extra:?}\n{}", show(&o));
    stdout(&o).trim().to_string()
}

#[test]
#[cfg_attr(
    not(parity_maturin),
    ignore = "needs maturin (pip install maturin into .venv; then touch build.rs) and PyPI"
)]
fn the_wheel_installs_parity_and_the_writer_and_its_verdicts_reach_pytest() {
    let kit = kit();
    // The wheel's own files: the binary and the package.
    let o = kit.parity(&["--version"]);
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        stdout(&o).contains(env!("CARGO_PKG_VERSION")),
        "{}",
        show(&o)
    );
    let site = kit.venv.join("lib");

    // A clean engine and one with a planted bug (NEOX RoPE pairs on a NORM model), written by
    // the installed parity_trace.
    let clean = kit.dir.join("clean");
    let bug = kit.dir.join("bug");
    for (out, extra) in [
        (&clean, &["--rounding", "ggml"][..]),
        (&bug, &["--rounding", "ggml", "--mutate", "rope-neox"][..]),
    ] {
        let module = numpy_engine(kit, out, extra);
        assert!(
            Path::new(&module).starts_with(&site) && module.contains("site-packages"),
            "the numpy engine imported parity_trace from {module}, not from the wheel in {}",
            site.display()
        );
    }
    let golden = root().join(GOLDEN);
    let g = golden.to_str().unwrap();
    let o = kit.parity(&["diff", g, clean.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(stdout(&o).contains("verdict: parity"), "{}", show(&o));
    let o = kit.parity(&["diff", g, bug.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let verdict = stdout(&o);
    assert!(
        verdict.contains("first op out of its noise floor: step 0 layer 0 q_rope")
            && verdict.contains("confirmed by experiment: rope-neox"),
        "{verdict}"
    );

    // The pytest helper, as an engine's own test suite uses it: the clean trace passes, the
    // bug fails the test with parity's verdict, an unreadable trace is an error (exit 2), the
    // parity found is the wheel's, and torch-like tensors are converted without torch.
    let tests = kit.dir.join("test_engine.py");
    std::fs::write(
        &tests,
        format!(
            r#"
import os, sys
import numpy as np
import pytest
import parity_trace
from parity_trace import TraceWriter
from parity_trace.testing import ParityError, assert_trace_matches, find_parity

GOLDEN, CLEAN, BUG = {g:?}, {clean:?}, {bug:?}

def test_clean_engine_matches():
    report = assert_trace_matches(GOLDEN, CLEAN)
    assert "verdict: parity" in report

def test_planted_bug():
    assert_trace_matches(GOLDEN, BUG)  # fails: pytest prints parity's verdict

def test_the_bug_is_an_assertion_error_naming_the_cause():
    with pytest.raises(AssertionError, match="confirmed by experiment: rope-neox"):
        assert_trace_matches(GOLDEN, BUG)

def test_an_unreadable_trace_is_an_error_not_a_failure():
    with pytest.raises(ParityError, match=r"exit 2"):
        assert_trace_matches(GOLDEN, os.path.join(os.path.dirname(CLEAN), "no-such-trace"))

def test_the_parity_used_is_the_wheels():
    assert find_parity() == os.path.join(sys.prefix, "bin", "parity")
    assert parity_trace.__file__.startswith(sys.prefix)

class FakeTorchTensor:
    """What the writer needs of a torch.Tensor: detach, cpu, float, numpy."""
    def __init__(self, a): self.a = a
    def detach(self): return self
    def cpu(self): return self
    def is_floating_point(self): return True
    def float(self): return FakeTorchTensor(self.a.astype(np.float32))
    def numpy(self): return self.a

def test_torch_like_tensors_are_converted_without_importing_torch(tmp_path):
    w = TraceWriter(str(tmp_path / "t"))
    w.step([1, 2], [0, 1])
    w.tap(None, "embd", FakeTorchTensor(np.ones((2, 4), np.float16)))
    w.tap(0, "l_out", [[1.0, 2.0], [3.0, 4.0]])
    m = w.finish()
    assert [t["shape"] for t in m["tensors"]] == [[2, 4], [2, 2]]
    assert np.load(str(tmp_path / "t/s000/embd.npy")).dtype == np.dtype("<f4")
    assert "torch" not in sys.modules and "mlx" not in sys.modules
"#,
            g = g,
            clean = clean.display().to_string(),
            bug = bug.display().to_string()
        ),
    )
    .unwrap();
    let o = kit
        .cmd(&kit.bin("python"))
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf"])
        .arg(&tests)
        .output()
        .unwrap();
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    assert!(out.contains("1 failed, 5 passed"), "{}", show(&o));
    // What docs/instrument.md shows of this run.
    let shown = out
        .replace(g, "golden/tiny-llama-q8_0")
        .replace(bug.to_str().unwrap(), "bug");
    assert_shown("docs/instrument.md", "tests/kit_python.rs: pytest", &shown);
    assert!(
        out.contains("FAILED test_engine.py::test_planted_bug")
            && out.contains("the trace does not match (exit 1)")
            && out.contains("first op out of its noise floor: step 0 layer 0 q_rope")
            && out.contains("confirmed by experiment: rope-neox"),
        "{}",
        show(&o)
    );
}

/// `pip install 'parity-trace[golden]'` then `parity golden`: the wheel's parity runs the Python
/// of its own venv, so llama.cpp is the one that extra installed there.
#[test]
#[cfg_attr(
    not(all(parity_maturin, parity_llama_cpp)),
    ignore = "needs maturin and llama-cpp-python (.ci/run installs them into .venv; then touch build.rs) and PyPI"
)]
fn parity_golden_from_the_wheel_runs_the_llama_cpp_of_its_venv() {
    let kit = kit();
    let tmp = tempfile::tempdir_in(&kit.dir).unwrap();
    let out = tmp.path().join("golden");
    let golden = |out: &Path| {
        kit.parity(&[
            "golden",
            root().join(FIXTURE).to_str().unwrap(),
            "--prompt",
            "Once upon a time there was a little girl named Lily",
            "--steps",
            "4",
            "--threads",
            "1",
            "--out",
            out.to_str().unwrap(),
        ])
    };
    // Without the extra, the venv's Python has no llama_cpp, and parity says whose it asked
    // (not the checkout's .venv, which has one).
    let venv_python = kit.bin("python");
    let has_llama = kit
        .cmd(&venv_python)
        .args(["-c", "import llama_cpp"])
        .output()
        .unwrap()
        .status
        .success();
    if !has_llama {
        let o = golden(&out);
        assert_eq!(o.status.code(), Some(2), "{}", show(&o));
        assert!(
            String::from_utf8_lossy(&o.stderr)
                .contains(&format!("is not installed for {}", venv_python.display())),
            "{}",
            show(&o)
        );
    }
    let spec = format!("{}[golden]", kit.wheel.display());
    let mut args = vec![spec.as_str()];
    let wheels = root().join("../shared/wheels");
    let wheels_s = wheels.display().to_string();
    if wheels.is_dir() {
        args.extend(["--find-links", &wheels_s]);
    }
    let t = Instant::now();
    let o = kit.pip(&args);
    assert!(o.status.success(), "pip install {args:?}\n{}", show(&o));
    eprintln!("pip install [golden]: {:.1} s", t.elapsed().as_secs_f64());

    let o = golden(&out);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    // The same llama.cpp and ids as the committed golden: parity between the two.
    let o = kit.parity(&[
        "diff",
        root().join(GOLDEN).to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
}
