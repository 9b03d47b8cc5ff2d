//! The command line: one subcommand per job. Errors become one line on stderr and exit code 2;
//! a divergence found is exit code 1.

mod assets;
mod backends;
mod bench;
mod check;
mod diff;
mod dump;
mod generate;
mod golden;
mod input;
mod inspect;
mod output;
mod selftest;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

pub type Error = Box<dyn std::error::Error + Send + Sync>;
pub type Result<T> = std::result::Result<T, Error>;

/// Make an error from a message.
pub fn err(msg: impl Into<String>) -> Error {
    msg.into().into()
}

#[derive(Parser)]
#[command(
    name = "parity",
    version,
    about = "Find where an LLM inference engine stops agreeing with llama.cpp",
    long_about = "Find where an LLM inference engine stops agreeing with llama.cpp.\n\nparity runs a model tap by tap (every named intermediate tensor of every layer, for the prefill and each decode step), compares against llama.cpp goldens or any other trace, and names the first diverging (step, layer, tap) with a likely cause.\n\nExit codes: 0 parity, 1 divergence found, 2 error."
)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print architecture, hyperparameters, tokenizer summary and the tensor table of a GGUF file.
    Inspect(inspect::InspectArgs),
    /// Print the GPU adapter the gpu backend uses: driver, API, limits, subgroup size, f16.
    Gpu(inspect::GpuArgs),
    /// Write a deterministic tiny random-weight model (for tests and goldens).
    Fixture(inspect::FixtureArgs),
    /// Print the token ids of TEXT, space-separated, on one line.
    Tokenize(input::TokenizeArgs),
    /// Greedy generation: prints the text and the ids.
    Generate(generate::GenerateArgs),
    /// Run a backend and write every tap as a trace folder.
    Dump(dump::DumpArgs),
    /// Make a llama.cpp golden trace (runs scripts/llama_golden.py with the real llama.cpp).
    Golden(golden::GoldenArgs),
    /// Run backends on a model, compare them with each other and with its llama.cpp golden.
    Check(check::CheckArgs),
    /// Compare two traces, folders or .npz archives (e.g. an external engine's dump against a golden).
    Diff(diff::DiffArgs),
    /// Benchmark parity's backends (fast by default; --backends fast,gpu) against the real
    /// llama.cpp on the same model and threads: tok/s and decode weight bandwidth.
    Bench(bench::BenchArgs),
    /// List the catalog of known engine bugs (`--mutate NAME` switches one on).
    Mutations(selftest::MutationsArgs),
    /// Check parity on itself: the clean run passes, and each catalog bug written as an external
    /// engine's trace is found by `diff` at its place and named.
    Selftest(selftest::SelftestArgs),
}

pub fn main() -> ExitCode {
    // Die quietly on a closed pipe (`parity inspect m.gguf | head`) like other Unix tools,
    // instead of panicking in println!.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    #[cfg(unix)]
    on_sigbus_explain();
    // println! panics when stdout cannot be written (`> /dev/full`): say so in one line, exit 2.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if let Some(rest) = msg.strip_prefix("failed printing to stdout: ") {
            eprintln!("error: cannot write to stdout: {rest}");
            std::process::exit(2);
        }
        default_hook(info)
    }));
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        // clap quotes a bad value as given: with a newline or an escape in it, its error could
        // print a forged line. Parsed again with every argument shown escaped, the same error
        // says it in one piece (help and version print as they are).
        Err(e) if e.use_stderr() => {
            let args = std::env::args_os()
                .map(|a| crate::report::shown::shown(&a.to_string_lossy()).into_owned());
            match Cli::try_parse_from(args) {
                Err(e) => e.exit(),
                Ok(_) => e.exit(),
            }
        }
        Err(e) => e.exit(),
    };
    let result = match cli.cmd {
        Cmd::Inspect(a) => inspect::inspect(a),
        Cmd::Gpu(a) => inspect::gpu(a),
        Cmd::Fixture(a) => inspect::fixture(a),
        Cmd::Tokenize(a) => input::tokenize(a),
        Cmd::Generate(a) => generate::generate(a),
        Cmd::Dump(a) => dump::dump(a),
        Cmd::Golden(a) => golden::golden(a),
        Cmd::Check(a) => check::check(a),
        Cmd::Diff(a) => diff::diff(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Mutations(a) => selftest::mutations(a),
        Cmd::Selftest(a) => selftest::selftest(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // One line, whatever the error's own formatting: parity's own line breaks read as
            // spaces; whatever a file put into the message (an ESC, a CR, a bidi override) is
            // escaped, and a quoted excerpt cannot make the line unbounded.
            let msg = e.to_string().replace('\n', " ");
            eprintln!("error: {}", crate::report::shown::line(&msg));
            ExitCode::from(2)
        }
    }
}

/// A model file truncated while it is mapped makes the next read of a lost page raise SIGBUS
/// (Linux, macOS): there is no way to resume, but the user gets one line naming the cause and
/// exit code 2 instead of "Bus error" and 135.
#[cfg(unix)]
fn on_sigbus_explain() {
    extern "C" fn handler(_: libc::c_int) {
        const MSG: &[u8] = b"error: a mapped file shrank while parity was reading it (SIGBUS): \
was the model truncated or rewritten during the run?\n";
        // Several threads may fault at once: one line only.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        // SAFETY: write(2), _exit(2) and a lock-free atomic are async-signal-safe.
        unsafe {
            if !SAID.swap(true, std::sync::atomic::Ordering::SeqCst) {
                libc::write(2, MSG.as_ptr().cast(), MSG.len());
            }
            libc::_exit(2);
        }
    }
    // SAFETY: installing a handler that only calls async-signal-safe functions, before any
    // thread starts.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

/// Where fixtures/, golden/ and scripts/ are: the checkout this binary was built from, or the
/// copy it unpacks from itself when installed elsewhere (`assets`).
pub fn repo_root() -> PathBuf {
    assets::root()
}

/// A command running [`python`] isolated (`-I`): neither the working folder nor the script's
/// folder on `sys.path`, no PYTHON* variables (PYTHONPATH, PYTHONSTARTUP), no user
/// site-packages, so a `llama_cpp.py`, `numpy.py` or `sitecustomize.py` lying where parity runs
/// is never imported. parity's scripts import no module beside them, and are passed by
/// absolute path ([`script`]).
pub fn python_command() -> std::process::Command {
    let mut c = std::process::Command::new(python());
    c.arg("-I");
    crate::trace::staging::isolate_python(&mut c);
    c
}

/// The absolute path of scripts/`name` (the working folder never decides which file runs).
pub fn script(name: &str) -> PathBuf {
    let p = repo_root().join("scripts").join(name);
    std::path::absolute(&p).unwrap_or(p)
}

/// The Python that runs scripts/ (goldens, the llama.cpp side of `bench`): $PARITY_PYTHON, else
/// the venv this binary was installed into (`pip install 'parity-trace[golden]'` puts parity and
/// llama-cpp-python there), else the repository's .venv, else python3.
pub fn python() -> PathBuf {
    if let Ok(p) = std::env::var("PARITY_PYTHON") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::current_exe()
        .ok()
        .and_then(|exe| venv_python(&exe))
    {
        return p;
    }
    // The checkout's venv (where .ci/run and the README put llama-cpp-python), if any.
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// The environment's Python when `exe` lies in the `bin/` (`Scripts\` on Windows) of a venv
/// (a folder with `pyvenv.cfg`, PEP 405) or a conda environment (`conda-meta/`): pip installs
/// the wheel's parity there, beside that Python.
fn venv_python(exe: &std::path::Path) -> Option<PathBuf> {
    let bin = exe.parent()?;
    let env = bin.parent()?;
    let py = bin.join(if cfg!(windows) {
        "python.exe"
    } else {
        "python"
    });
    let is_env = env.join("pyvenv.cfg").is_file() || env.join("conda-meta").is_dir();
    (is_env && py.is_file()).then_some(py)
}

#[cfg(test)]
mod tests {
    use super::venv_python;

    #[test]
    fn a_binary_in_a_venv_runs_that_venvs_python() {
        let t = tempfile::tempdir().unwrap();
        let (bin, py) = if cfg!(windows) {
            ("Scripts", "python.exe")
        } else {
            ("bin", "python")
        };
        let venv = t.path().join("venv");
        std::fs::create_dir_all(venv.join(bin)).unwrap();
        let exe = venv.join(bin).join("parity");
        std::fs::write(&exe, "").unwrap();
        // A bin/ with a python but no pyvenv.cfg (/usr/local/bin, ~/.cargo/bin): not a venv.
        std::fs::write(venv.join(bin).join(py), "").unwrap();
        assert_eq!(venv_python(&exe), None);
        std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").unwrap();
        assert_eq!(venv_python(&exe), Some(venv.join(bin).join(py)));
        // A venv without its python (broken): not used.
        std::fs::remove_file(venv.join(bin).join(py)).unwrap();
        assert_eq!(venv_python(&exe), None);
        // A conda environment.
        let conda = t.path().join("conda");
        std::fs::create_dir_all(conda.join(bin)).unwrap();
        std::fs::create_dir_all(conda.join("conda-meta")).unwrap();
        std::fs::write(conda.join(bin).join(py), "").unwrap();
        assert_eq!(
            venv_python(&conda.join(bin).join("parity")),
            Some(conda.join(bin).join(py))
        );
        // cargo's own build of parity (target/<profile>/) is not in a venv.
        assert_eq!(venv_python(&std::env::current_exe().unwrap()), None);
    }
}
