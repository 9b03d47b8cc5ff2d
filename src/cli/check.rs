//! `parity golden` and `parity check` (the terminal side of `crate::check`).

use super::output::{ReportArgs, finish_with, run_info, show};
use super::run::InputArgs;
use super::{Result, err, python, repo_root};
use crate::check::{CheckOptions, Event};
use crate::compare::PairKind;
use crate::model::Model;
use crate::report::progress::Progress;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The committed default: `parity check` with no MODEL runs this fixture against its golden.
pub const DEFAULT_FIXTURE: &str = "fixtures/tiny-llama-q8_0.gguf";

#[derive(Args)]
pub struct GoldenArgs {
    model: PathBuf,
    #[command(flatten)]
    input: InputArgs,
    /// Decode steps after the prefill (teacher-forced from llama.cpp's greedy continuation).
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Ids to feed at the decode steps instead of llama.cpp's own greedy choice (comma
    /// separated), e.g. another golden's continuation, so two goldens see the same sequence.
    #[arg(long, value_delimiter = ',')]
    forced: Vec<u32>,
    /// Output trace folder.
    #[arg(long)]
    out: PathBuf,
    /// Keep llama.cpp's default settings (F16 KV cache, flash attention auto) instead of the
    /// tight ones (F32 KV cache, flash attention off, no weight repacking).
    #[arg(long)]
    llama_defaults: bool,
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Overwrite a non-empty output folder.
    #[arg(long)]
    force: bool,
}

pub fn golden(a: GoldenArgs) -> Result<ExitCode> {
    let script = repo_root().join("scripts/llama_golden.py");
    if !script.exists() {
        return Err(err(format!("{} not found", script.display())));
    }
    let py = python();
    let probe = Command::new(&py)
        .args(["-c", "import llama_cpp, numpy"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(_) => {
            return Err(err(format!(
                "llama_cpp (llama-cpp-python) or numpy is not installed for {}: pip install llama-cpp-python numpy (or set PARITY_PYTHON to a Python that has them)",
                py.display()
            )));
        }
        Err(e) => {
            return Err(err(format!(
                "cannot run {} ({e}): install Python 3 with llama-cpp-python, or set PARITY_PYTHON",
                py.display()
            )));
        }
    }
    let mut cmd = Command::new(&py);
    cmd.arg(&script).arg(&a.model).arg("--out").arg(&a.out);
    match (&a.input.prompt, &a.input.tokens) {
        (Some(p), _) => {
            cmd.arg("--prompt").arg(p);
        }
        (None, Some(t)) => {
            let s: Vec<String> = t.iter().map(|i| i.to_string()).collect();
            cmd.arg("--tokens").arg(s.join(","));
        }
        (None, None) => return Err(err("give a prompt (-p TEXT) or ids (--tokens 1,2,3)")),
    }
    if a.input.no_bos {
        cmd.arg("--no-bos");
    }
    cmd.arg("--steps").arg(a.steps.to_string());
    if !a.forced.is_empty() {
        let s: Vec<String> = a.forced.iter().map(|i| i.to_string()).collect();
        cmd.arg("--forced").arg(s.join(","));
    }
    cmd.arg("--threads").arg(a.threads.to_string());
    if a.llama_defaults {
        cmd.arg("--llama-defaults");
    }
    if a.force {
        cmd.arg("--force");
    }
    let status = cmd
        .status()
        .map_err(|e| err(format!("running {}: {e}", py.display())))?;
    match status.code() {
        Some(0) => Ok(ExitCode::SUCCESS),
        Some(1) => Ok(ExitCode::from(1)),
        _ => Ok(ExitCode::from(2)),
    }
}

#[derive(Args)]
pub struct CheckArgs {
    /// GGUF model (default: the committed fixture fixtures/tiny-llama-q8_0.gguf).
    model: Option<PathBuf>,
    #[command(flatten)]
    input: InputArgs,
    /// Decode steps (default: as many as the golden has, else 4).
    #[arg(long)]
    steps: Option<usize>,
    /// Backends to run: reference (plain f32), reference:ggml-cpu (emulating ggml's CPU
    /// activation rounding), fast.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "reference,reference:ggml-cpu,fast"
    )]
    backends: Vec<String>,
    /// Worker threads for the fast backend (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// A golden trace folder, or a folder of goldens searched by model sha256 (default:
    /// ./golden, then the goldens that ship with parity).
    #[arg(long)]
    golden: Option<PathBuf>,
    #[command(flatten)]
    report: ReportArgs,
    /// Skip the op-by-op comparison (each reference op fed the golden's inputs).
    #[arg(long)]
    no_op_by_op: bool,
    /// Print the per-layer table of every comparison, not only the ones against the golden.
    #[arg(long, short)]
    verbose: bool,
}

/// Where goldens are looked for when `--golden` is not given: ./golden (where `parity
/// golden --out golden/NAME` puts them), the user's golden folder, then the goldens that ship
/// with parity.
fn golden_dirs() -> Vec<PathBuf> {
    let mut v = vec![PathBuf::from("golden")];
    if let Some(d) = user_golden_dir() {
        v.push(d);
    }
    v.push(repo_root().join("golden"));
    v
}

/// `$PARITY_GOLDEN_DIR`, else `$XDG_DATA_HOME/parity/golden`, else
/// `~/.local/share/parity/golden`.
pub fn user_golden_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("PARITY_GOLDEN_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_DATA_HOME") {
        return Some(PathBuf::from(d).join("parity/golden"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share/parity/golden"))
}

pub fn check(a: CheckArgs) -> Result<ExitCode> {
    let model_path = a
        .model
        .clone()
        .unwrap_or_else(|| repo_root().join(DEFAULT_FIXTURE));
    if !model_path.exists() {
        return Err(err(format!("{}: no such file", model_path.display())));
    }
    let model = Progress::stage("loading the model", a.report.quiet, || {
        Model::open(&model_path)
    })?;
    let prompt = if a.input.given() {
        let (ids, policy) = a.input.resolve(&model.file)?;
        if !a.report.quiet {
            eprintln!("prompt ids: {ids:?} — {policy}");
        }
        Some(ids)
    } else {
        None
    };
    let opt = CheckOptions {
        backends: a.backends.clone(),
        threads: a.threads,
        steps: a.steps,
        op_by_op: !a.no_op_by_op,
        golden: a.golden.clone(),
        golden_dirs: golden_dirs(),
        prompt,
    };
    // One bar per backend pass (a tick per forward call), then one for the comparisons.
    let quiet = a.report.quiet;
    let mut bar: Option<Progress> = None;
    let mut on_event = |e: Event| match e {
        Event::PassStart {
            backend,
            op_by_op,
            forwards,
        } => {
            let what = if op_by_op {
                format!("{backend} op by op")
            } else {
                backend.to_string()
            };
            bar = Some(Progress::bar(&what, forwards as u64, quiet));
        }
        Event::Forward => {
            if let Some(b) = &bar {
                b.inc(1)
            }
        }
        Event::PassEnd => bar = None,
        Event::Comparing { n } => bar = Some(Progress::bar("comparing", n as u64, quiet)),
        Event::Compared => {
            if let Some(b) = &bar {
                b.inc(1)
            }
        }
    };
    let r = crate::check::run(&model, &model_path, &opt, &mut on_event)?;
    if !quiet {
        if prompt_from_golden(&r) {
            eprintln!("prompt ids: {:?} — {}", r.prompt, r.ids_from);
        }
        match &r.golden {
            Some((p, _)) => eprintln!("golden: {}", p.display()),
            None => eprintln!(
                "golden: none for sha256 {}… in {} — comparing backends with each other only (all fed the first one's greedy continuation)",
                &model.sha256()[..12],
                opt.golden_dirs
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
    let mut comparisons = Vec::with_capacity(r.comparisons.len());
    for j in r.comparisons {
        let c = j.comparison;
        let header = if j.against_golden {
            format!("== {} vs golden ({})", c.candidate, c.baseline)
        } else {
            format!("== {} vs {}", c.candidate, c.baseline)
        };
        // The end-to-end comparisons against the golden always show their table: it is the
        // picture of drift along the layers.
        let end_to_end = j.against_golden && c.pair != PairKind::OpByOp;
        show(
            &c,
            &header,
            end_to_end || a.verbose || c.diverged(),
            &a.report,
        );
        comparisons.push(c);
    }
    if !quiet {
        let mut line = String::from("backends:");
        for p in &r.passes {
            line.push_str(&format!(
                " {}{} {:.2} s{};",
                p.backend,
                if p.op_by_op { " op by op" } else { "" },
                p.seconds,
                p.peak_rss_bytes
                    .map(|b| format!(" (peak RSS {:.0} MiB)", b as f64 / (1 << 20) as f64))
                    .unwrap_or_default()
            ));
        }
        line.pop();
        if a.report.json.as_deref() == Some(Path::new("-")) {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    }
    let info = run_info(
        r.golden
            .iter()
            .map(|(_, g)| g)
            .chain(&r.traces_op)
            .chain(&r.traces),
    );
    finish_with(&comparisons, &info, &a.report)
}

fn prompt_from_golden(r: &crate::check::CheckReport) -> bool {
    r.ids_from == "from the golden"
}
