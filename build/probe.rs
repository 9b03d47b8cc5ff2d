// The test suite's tool probes, written once: build.rs turns each into a `parity_*` cfg (a
// test that cannot run shows as ignored, with its reason), and tests/tools_probe.rs and
// tests/neon_qemu.rs `include!` this same file to check the cfgs still match the machine and
// to say what is missing. (Plain comments: an included file cannot carry inner doc comments.)

use std::path::{Path, PathBuf};
use std::process::Command;

/// Every probe: its cfg, what it stands for in words, and whether this machine has it.
pub fn probes(root: &Path) -> Vec<(&'static str, &'static str, bool)> {
    let python = python(root);
    let can = |code: &str| python_can(&python, code);
    vec![
        (
            "parity_llama_cpp",
            "llama_cpp",
            can("import llama_cpp, numpy"),
        ),
        ("parity_numpy", "numpy", can("import numpy")),
        ("parity_gguf_py", "gguf-py", can("import numpy, gguf")),
        (
            "parity_shared",
            "../shared",
            root.join("../shared/models").is_dir(),
        ),
        // Programs on PATH: jq (docs' examples, tests/docs.rs), a Chromium (tests/report_html.rs
        // renders the HTML report).
        ("parity_jq", "jq", on_path(&["jq"])),
        ("parity_chromium", "chromium", on_path(CHROMIUMS)),
        // A C99 and a C++11 compiler as `cc` and `c++` (tests/kit_c.rs builds the C trace
        // writer bindings/c/parity_trace.h and a toy C engine with them).
        (
            "parity_cc",
            "a C compiler and a C++ compiler (cc, c++)",
            on_path(&["cc"]) && on_path(&["c++"]),
        ),
        // The Rust kit's toy engine built for wasm32 and run under Node (tests/kit_rust.rs):
        // rustup's wasm32-unknown-unknown standard library, and Node 18 or later.
        (
            "parity_wasm32",
            "the wasm32-unknown-unknown target (rustup target add wasm32-unknown-unknown)",
            wasm32_std(),
        ),
        ("parity_node", "Node 18 or later", node18()),
        // The HF-checkpoint adapter (tests/instrument.rs) needs torch and transformers: several
        // GB, so in a venv of their own (.venv-hf, which .ci/run makes) or PARITY_HF_PYTHON.
        (
            "parity_hf",
            "torch and transformers (.venv-hf or $PARITY_HF_PYTHON) and ../shared/models/hf",
            hf(root),
        ),
        // The NEON kernels under qemu (tests/neon_qemu.rs, which names what is missing).
        (
            "parity_qemu",
            "qemu (aarch64 cross tools)",
            qemu_missing().is_empty(),
        ),
        // A GPU for the wgpu backend's tests (tests/gpu*.rs): Metal and DX12 come with their
        // OS; on Linux, the Vulkan loader and at least one driver manifest (lavapipe is
        // Debian's mesa-vulkan-drivers). The tests ask wgpu for an adapter themselves and say
        // if none came.
        (
            "parity_gpu",
            "a Vulkan loader and driver (or macOS, Windows)",
            vulkan_driver() || cfg!(target_os = "macos") || cfg!(target_os = "windows"),
        ),
        // Root with `unshare -m`: tests/adversarial_writes.rs replaces /dev with a tmpfs in a
        // private mount namespace to try `--json /dev/stdout` as root without risking the
        // machine's own /dev.
        (
            "parity_mount_ns",
            "root and a private mount namespace (unshare -m)",
            mount_namespace(),
        ),
        // maturin builds the parity-trace wheel (tests/kit_python.rs): the Python's module
        // (`pip install maturin` into .venv) or a `maturin` on PATH.
        (
            "parity_maturin",
            "maturin (in .venv or on PATH)",
            can("import maturin") || on_path(&["maturin"]),
        ),
    ]
}

/// Can this process make a private mount namespace and mount a tmpfs in it (root, unshare)?
/// The mount lives and dies with the namespace.
pub fn mount_namespace() -> bool {
    Command::new("unshare")
        .args([
            "-m",
            "sh",
            "-c",
            "mount --make-rprivate / && mount -t tmpfs tmpfs /mnt",
        ])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The Python that runs scripts/: $PARITY_PYTHON, else the checkout's .venv, else python3.
pub fn python(root: &Path) -> PathBuf {
    std::env::var_os("PARITY_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let venv = root.join(".venv/bin/python");
            if venv.exists() {
                venv
            } else {
                PathBuf::from("python3")
            }
        })
}

/// Does `python -I -c code` succeed? Isolated, as parity runs Python: the working folder's
/// modules neither satisfy nor break the probe.
pub fn python_can(python: &Path, code: &str) -> bool {
    let mut c = Command::new(python);
    c.args(["-I", "-c", code]);
    // As parity runs it: no PYTHON* variable reaches it (-I still honours PYTHONEXECUTABLE).
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("PYTHON") {
            c.env_remove(&k);
        }
    }
    c.output()
        .is_ok_and(|o| o.status.success())
}

/// The Python with torch and transformers: $PARITY_HF_PYTHON, else the checkout's .venv-hf.
pub fn hf_python(root: &Path) -> PathBuf {
    std::env::var_os("PARITY_HF_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".venv-hf/bin/python"))
}

fn hf(root: &Path) -> bool {
    python_can(&hf_python(root), "import torch, transformers, numpy")
        && root.join("../shared/models/hf").is_dir()
}

/// What the aarch64 tests under qemu need and this machine lacks, with where to get it.
pub fn qemu_missing() -> Vec<&'static str> {
    let mut m = Vec::new();
    if !on_path(&["qemu-aarch64-static", "qemu-aarch64"]) {
        m.push("qemu-aarch64 (Debian: qemu-user-static)");
    }
    if !on_path(&["aarch64-linux-gnu-gcc"]) {
        m.push("aarch64-linux-gnu-gcc (Debian: gcc-aarch64-linux-gnu)");
    }
    if !Path::new("/usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1").exists() {
        m.push("the aarch64 glibc (Debian: libc6-dev-arm64-cross)");
    }
    if !aarch64_std() {
        m.push("Rust's aarch64 standard library (rustup target add aarch64-unknown-linux-gnu)");
    }
    m
}

/// Whether rustup's aarch64-unknown-linux-gnu standard library is installed.
fn aarch64_std() -> bool {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let Some(dir) = Command::new(rustc)
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

/// The Vulkan loader and an ICD manifest in one of the loader's standard folders (or named by
/// VK_DRIVER_FILES / VK_ICD_FILENAMES).
pub fn vulkan_driver() -> bool {
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

/// The names a headless Chromium goes by (tests/report_html.rs tries the same ones).
pub const CHROMIUMS: &[&str] = &["chromium", "chromium-browser", "google-chrome"];

/// Is one of `names` an executable file in a folder of $PATH?
pub fn on_path(names: &[&str]) -> bool {
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

/// Is the wasm32-unknown-unknown standard library installed for this rustc?
pub fn wasm32_std() -> bool {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    Command::new(rustc)
        .args(["--print", "target-libdir", "--target", "wasm32-unknown-unknown"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|dir| std::fs::read_dir(dir.trim()).ok())
        .is_some_and(|mut rd| {
            rd.any(|e| {
                e.is_ok_and(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.starts_with("libstd-") && n.ends_with(".rlib")
                })
            })
        })
}

/// Does `node --version` say v18 or later?
pub fn node18() -> bool {
    Command::new("node")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| v.trim().strip_prefix('v')?.split('.').next()?.parse::<u32>().ok())
        .is_some_and(|major| major >= 18)
}
