//! Embeds what the `parity` binary needs at run time besides itself — the default fixture, its
//! llama.cpp golden and the Python scripts — so that an installed binary (`cargo install
//! --path .`) works away from its source checkout (src/cli/assets.rs unpacks them on first use).

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

/// Does `python -c code` succeed?
fn python_can(python: &Path, code: &str) -> bool {
    std::process::Command::new(python)
        .args(["-c", code])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// What the test suite can use on this machine, as cfgs: a test that cannot run is marked
/// `#[cfg_attr(not(parity_llama_cpp), ignore = "…")]` and shows as ignored, with its reason,
/// instead of passing without having run. `.ci/run` installs everything, so nothing is ignored
/// in CI.
fn probe_test_tools(root: &Path) {
    for cfg in [
        "parity_llama_cpp",
        "parity_numpy",
        "parity_gguf_py",
        "parity_shared",
        "parity_jq",
        "parity_chromium",
        "parity_hf",
        "parity_qemu",
        "parity_gpu",
    ] {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
    }
    println!("cargo:rerun-if-env-changed=PARITY_PYTHON");
    println!("cargo:rerun-if-env-changed=PARITY_HF_PYTHON");
    // The HF-checkpoint adapter (tests/instrument.rs) needs torch: several GB, never installed
    // by CI; a Python that has it is named by PARITY_HF_PYTHON.
    if let Some(hf) = std::env::var_os("PARITY_HF_PYTHON")
        && python_can(Path::new(&hf), "import torch, transformers")
        && root.join("../shared/models/hf").is_dir()
    {
        println!("cargo:rustc-cfg=parity_hf");
    }
    let venv = root.join(".venv/bin/python");
    // Packages installed into the venv change the answer. A venv made after the last build is
    // not seen (watching a missing path would rebuild every time): tests/tools_probe.rs says
    // so and asks for `touch build.rs`.
    if root.join(".venv").exists() {
        println!(
            "cargo:rerun-if-changed={}",
            root.join(".venv/lib").display()
        );
    }
    let python = std::env::var_os("PARITY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            if venv.exists() {
                venv
            } else {
                PathBuf::from("python3")
            }
        });
    if python_can(&python, "import llama_cpp, numpy") {
        println!("cargo:rustc-cfg=parity_llama_cpp");
    }
    if python_can(&python, "import numpy") {
        println!("cargo:rustc-cfg=parity_numpy");
    }
    if python_can(&python, "import numpy, gguf") {
        println!("cargo:rustc-cfg=parity_gguf_py");
    }
    let shared = root.join("../shared/models");
    if shared.is_dir() {
        println!("cargo:rustc-cfg=parity_shared");
    }
    // Programs on PATH: jq (docs' examples, tests/docs.rs), a Chromium (tests/report_html.rs
    // renders the HTML report).
    if on_path(&["jq"]) {
        println!("cargo:rustc-cfg=parity_jq");
    }
    if on_path(CHROMIUMS) {
        println!("cargo:rustc-cfg=parity_chromium");
    }
    // The NEON kernels under qemu (tests/neon_qemu.rs, which names what is missing).
    if (on_path(&["qemu-aarch64-static"]) || on_path(&["qemu-aarch64"]))
        && on_path(&["aarch64-linux-gnu-gcc"])
        && Path::new("/usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1").exists()
        && aarch64_std()
    {
        println!("cargo:rustc-cfg=parity_qemu");
    }
    // A GPU for the wgpu backend's tests (tests/gpu*.rs): Metal and DX12 come with their OS; on
    // Linux, the Vulkan loader and at least one driver manifest (lavapipe is Debian's
    // mesa-vulkan-drivers). The tests ask wgpu for an adapter themselves and say if none came.
    if vulkan_driver() || cfg!(target_os = "macos") || cfg!(target_os = "windows") {
        println!("cargo:rustc-cfg=parity_gpu");
    }
}

/// The Vulkan loader and an ICD manifest in one of the loader's standard folders (or named by
/// VK_DRIVER_FILES / VK_ICD_FILENAMES).
fn vulkan_driver() -> bool {
    println!("cargo:rerun-if-env-changed=VK_DRIVER_FILES");
    println!("cargo:rerun-if-env-changed=VK_ICD_FILENAMES");
    let loader = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
        "/usr/lib64",
    ]
    .iter()
    .any(|d| Path::new(d).join("libvulkan.so.1").exists());
    let named = ["VK_DRIVER_FILES", "VK_ICD_FILENAMES"]
        .iter()
        .filter_map(std::env::var_os)
        .any(|v| std::env::split_paths(&v).any(|p| p.exists()));
    let icd = named
        || [
            "/usr/share/vulkan/icd.d",
            "/etc/vulkan/icd.d",
            "/usr/local/share/vulkan/icd.d",
        ]
        .iter()
        .any(|d| std::fs::read_dir(d).is_ok_and(|mut rd| rd.next().is_some()));
    loader && icd
}

/// Whether rustup's aarch64-unknown-linux-gnu standard library is installed.
fn aarch64_std() -> bool {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let Some(dir) = std::process::Command::new(rustc)
        .args([
            "--print",
            "target-libdir",
            "--target",
            "aarch64-unknown-linux-gnu",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
    else {
        return false;
    };
    std::fs::read_dir(dir.trim()).is_ok_and(|rd| {
        rd.flatten().any(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("libstd-") && n.ends_with(".rlib")
        })
    })
}

/// The names a headless Chromium goes by (tests/report_html.rs tries the same ones).
const CHROMIUMS: &[&str] = &["chromium", "chromium-browser", "google-chrome"];

/// Is one of `names` an executable file in a folder of $PATH?
fn on_path(names: &[&str]) -> bool {
    let Some(path) = std::env::var_os("PATH") else {
        return false;
    };
    std::env::split_paths(&path).any(|dir| {
        names
            .iter()
            .any(|n| std::fs::metadata(dir.join(n)).is_ok_and(|m| m.is_file() && executable(&m)))
    })
}

#[cfg(unix)]
fn executable(m: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::PermissionsExt;
    m.permissions().mode() & 0o111 != 0
}

#[cfg(not(unix))]
fn executable(_: &std::fs::Metadata) -> bool {
    true
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
