//! Embeds what the `parity` binary needs at run time besides itself — the default fixture, its
//! llama.cpp golden, the Python scripts and the Python trace writer they import — so that an
//! installed binary (`cargo install --path .`) works away from its source checkout
//! (src/cli/assets.rs unpacks them on first use).

use std::fmt::Write;
use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .collect();
    v.sort();
    for p in v {
        if p.is_dir() {
            files(&p, out);
        } else {
            out.push(p);
        }
    }
}

mod probe {
    include!("build/probe.rs");
}

/// What the test suite can use on this machine, as cfgs (build/probe.rs): a test that cannot
/// run is marked `#[cfg_attr(not(parity_llama_cpp), ignore = "…")]` and shows as ignored, with
/// its reason, instead of passing without having run. `.ci/run` installs everything, so nothing
/// is ignored in CI.
fn probe_test_tools(root: &Path) {
    for var in [
        "PARITY_PYTHON",
        "PARITY_HF_PYTHON",
        "VK_DRIVER_FILES",
        "VK_ICD_FILENAMES",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    // Packages installed into the venv change the answer. A venv made after the last build is
    // not seen (watching a missing path would rebuild every time): tests/tools_probe.rs says
    // so and asks for `touch build.rs`.
    for venv in [".venv", ".venv-hf"] {
        if root.join(venv).exists() {
            println!(
                "cargo:rerun-if-changed={}",
                root.join(venv).join("lib").display()
            );
        }
    }
    for (cfg, _, here) in probe::probes(root) {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        if here {
            println!("cargo:rustc-cfg={cfg}");
        }
    }
}

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    probe_test_tools(&root);
    let mut list = vec![root.join("fixtures/tiny-llama-q8_0.gguf")];
    files(&root.join("golden/tiny-llama-q8_0"), &mut list);
    for s in [
        "llama_golden.py",
        "llama_bench.py",
        "numpy_engine.py",
        "parity_trace.py",
    ] {
        list.push(root.join("scripts").join(s));
    }
    // The Python trace writer the numpy engine and scripts/parity_trace.py import (the
    // parity-trace package's source, beside scripts/ as in the repository). Each file is
    // watched, not the folder: Python writes __pycache__ into it on every import (a module
    // added later is caught by assets.rs's `the_python_package_is_embedded_whole`).
    let mut py = Vec::new();
    files(&root.join("bindings/python/parity_trace"), &mut py);
    list.extend(
        py.into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "py")),
    );
    let mut code = String::from(
        "/// (path relative to the repository, contents)\npub static ASSETS: &[(&str, &[u8])] = &[\n",
    );
    for p in &list {
        let rel = p
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        writeln!(
            code,
            "    ({rel:?}, include_bytes!({:?})),",
            p.display().to_string()
        )
        .unwrap();
        println!("cargo:rerun-if-changed={}", p.display());
    }
    code.push_str("];\n");
    println!("cargo:rerun-if-changed=golden/tiny-llama-q8_0");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("assets.rs");
    std::fs::write(out, code).unwrap();
}
