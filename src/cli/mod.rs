//! The command line: one subcommand per job. Errors become one line on stderr and exit code 2;
//! a divergence found is exit code 1.

mod bench;
mod check;
mod diff;
mod inspect;
mod output;
mod run;
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
    /// Write a deterministic tiny random-weight model (for tests and goldens).
    Fixture(inspect::FixtureArgs),
    /// Print the token ids of TEXT, space-separated, on one line.
    Tokenize(run::TokenizeArgs),
    /// Greedy generation: prints the text and the ids.
    Generate(run::GenerateArgs),
    /// Run a backend and write every tap as a trace folder.
    Dump(run::DumpArgs),
    /// Make a llama.cpp golden trace (runs scripts/llama_golden.py with the real llama.cpp).
    Golden(check::GoldenArgs),
    /// Run backends on a model, compare them with each other and with its llama.cpp golden.
    Check(check::CheckArgs),
    /// Compare two trace folders (e.g. an external engine's dump against a golden).
    Diff(diff::DiffArgs),
    /// Benchmark the fast backend against the real llama.cpp on the same model and threads.
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
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Inspect(a) => inspect::inspect(a),
        Cmd::Fixture(a) => inspect::fixture(a),
        Cmd::Tokenize(a) => run::tokenize(a),
        Cmd::Generate(a) => run::generate(a),
        Cmd::Dump(a) => run::dump(a),
        Cmd::Golden(a) => check::golden(a),
        Cmd::Check(a) => check::check(a),
        Cmd::Diff(a) => diff::diff(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Mutations(a) => selftest::mutations(a),
        Cmd::Selftest(a) => selftest::selftest(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // One line, whatever the error's own formatting.
            let msg = e.to_string().replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
    }
}

/// The repository root this binary was built from (fixtures/, golden/, scripts/ live there).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Python that runs scripts/ (goldens, the llama.cpp side of `bench`): $PARITY_PYTHON, else
/// the repository's .venv, else python3.
pub fn python() -> PathBuf {
    if let Ok(p) = std::env::var("PARITY_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = repo_root().join(".venv/bin/python");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}
