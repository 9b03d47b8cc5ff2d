//! `parity golden`: llama.cpp's own run of a model, tap by tap, through llama-cpp-python
//! (scripts/llama_golden.py), in stages: everything parity can check is checked before
//! llama.cpp starts (the paths, the model, the ids, the context, the size, the output folder),
//! then the script runs, and any failure of the Python side is one line (exit 2).

use super::input::InputArgs;
use super::{Result, err, python};
use crate::model::Model;
use crate::report::progress::Progress;
use crate::trace::goldens;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Output};

#[derive(Args)]
pub struct GoldenArgs {
    /// GGUF model file (UTF-8 path: the golden's manifest records it as text).
    pub(super) model: PathBuf,
    #[command(flatten)]
    pub(super) input: InputArgs,
    /// Decode steps after the prefill (teacher-forced from llama.cpp's greedy continuation);
    /// default 4, or as many as --forced gives. Prompt + steps must fit the model's context.
    #[arg(long)]
    pub(super) steps: Option<usize>,
    /// Ids to feed at the decode steps instead of llama.cpp's own greedy choice (comma
    /// separated), e.g. another golden's continuation, so two goldens see the same sequence.
    #[arg(long, value_delimiter = ',')]
    pub(super) forced: Vec<u32>,
    /// Output trace folder (written under a temporary name beside it, moved into place at the
    /// end; UTF-8 path). Default: the user's golden folder ($PARITY_GOLDEN_DIR, else
    /// ~/.local/share/parity/golden), one subfolder per model file.
    #[arg(long)]
    pub(super) out: Option<PathBuf>,
    /// Keep llama.cpp's default settings (F16 KV cache, flash attention auto) instead of the
    /// tight ones (F32 KV cache, flash attention off, no weight repacking).
    #[arg(long)]
    pub(super) llama_defaults: bool,
    /// Feed the prompt (and each --turn) to llama.cpp in calls of this many tokens, one step
    /// each: a chunked prefill (1: one token at a time). Default: the whole prompt at once.
    #[arg(long, default_value_t = 0)]
    pub(super) chunk: usize,
    /// The ids of a further turn (comma separated), fed as one step (or chunks) after the
    /// decode steps and followed by as many decode steps again; repeat for more turns.
    #[arg(long)]
    pub(super) turn: Vec<String>,
    /// K cache type (llama.cpp's -ctk: f32, f16, q8_0, q4_0). Default f32, or f16 with
    /// --llama-defaults. The golden records it and the judge holds it to that cache.
    #[arg(long, value_parser = ["f32", "f16", "q8_0", "q4_0"])]
    pub(super) cache_type_k: Option<String>,
    /// V cache type (llama.cpp's -ctv; a quantized V cache needs flash attention).
    #[arg(long, value_parser = ["f32", "f16", "q8_0", "q4_0"])]
    pub(super) cache_type_v: Option<String>,
    /// Flash attention (llama.cpp's -fa: on, off, auto). Default off, or auto with
    /// --llama-defaults; the golden records what llama.cpp resolved it to.
    #[arg(long, value_parser = ["on", "off", "auto"])]
    pub(super) flash_attn: Option<String>,
    /// llama.cpp threads.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub(super) threads: usize,
    /// Layers to offload to the GPU device of a llama-cpp-python built with one (-1: all, the
    /// output included; e.g. CMAKE_ARGS=-DGGML_VULKAN=on). The manifest names the device
    /// (llama.cpp-vulkan, …) and `check` holds such a golden to GPU rounding.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-1..))]
    pub(super) gpu_layers: i32,
    /// Overwrite a non-empty output folder.
    #[arg(long)]
    pub(super) force: bool,
    /// A recording plan, as `parity diff` prints it for a zoom: `taps=l_out,result_norm,logits`
    /// keeps those taps at every step (a scan of a long run at a fraction of the size),
    /// `;full=3,7-8` every tap at those steps (docs/trace-format.md, "Scan and zoom").
    #[arg(long, value_name = "PLAN")]
    pub(super) record: Option<String>,
    /// Refuse a golden whose trace would be larger than this (bytes, or 500M, 4G, 1T), before
    /// llama.cpp runs. The attention probabilities grow with the square of the length.
    #[arg(long, value_name = "SIZE", default_value = "4G", value_parser = crate::arch::size::parse_size)]
    pub(super) max_trace_size: u64,
    /// Show llama.cpp's own log and the script's full error output.
    #[arg(long)]
    pub(super) verbose: bool,
}

/// A path handed to the Python side and recorded in a manifest: it must be text.
fn utf8_path<'p>(p: &'p Path, what: &str) -> Result<&'p str> {
    p.to_str().ok_or_else(|| {
        err(format!(
            "{what} {}: the path is not valid UTF-8 (a golden records it as text): rename it or use a link",
            p.display()
        ))
    })
}

pub fn golden(a: GoldenArgs) -> Result<ExitCode> {
    make_golden(a, Aside::No)
}

/// Where a golden made inside another command reports.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Aside {
    /// `parity golden` itself: the script's report on stdout, llama.cpp's log on stderr.
    No,
    /// A zoom inside `check`, whose stdout may be its JSON: all of it on stderr.
    Stderr,
    /// A zoom inside `check --quiet`: nothing but an error.
    Quiet,
}

/// What the checks before llama.cpp settled: the paths as text, the ids and how they were
/// made, the decode steps per turn, the recording plan.
struct Prepared {
    model_s: String,
    out_dir: PathBuf,
    out_s: String,
    /// How the output folder is named in messages.
    out_what: &'static str,
    ids: Vec<u32>,
    policy: String,
    steps: usize,
    plan: Option<crate::trace::Record>,
}

pub(super) fn make_golden(a: GoldenArgs, aside: Aside) -> Result<ExitCode> {
    let p = prepare(&a)?;
    // One writer of the folder at a time, held until the script has published (or failed).
    let _lock = claim_out_dir(&p, a.force)?;
    let script = super::script("llama_golden.py");
    if !script.exists() {
        return Err(err(format!("{} not found", script.display())));
    }
    probe_python()?;
    if aside != Aside::Quiet {
        eprintln!("prompt ids: {} — {}", join_ids(&p.ids), p.policy);
    }
    let cmd = command(&a, &p, &script, aside);
    let (out, pid) = run_script(cmd, &p.out_dir, a.verbose, aside)?;
    let log = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // llama.cpp's log quotes the model's metadata: kept as lines, controls escaped.
        if aside != Aside::Quiet {
            eprint!("{}", crate::report::shown::text(&log));
        }
        return Ok(ExitCode::SUCCESS);
    }
    // The script removes its temporary folder on exit; killed by a signal (llama.cpp's
    // GGML_ABORT), it cannot: remove it here (`.NAME.partial-PID` beside the output).
    if let (Ok(abs), Some(name)) = (std::path::absolute(&p.out_dir), p.out_dir.file_name())
        && let Some(parent) = abs.parent()
    {
        let mut tmp = std::ffi::OsString::from(".");
        tmp.push(name);
        tmp.push(format!(".partial-{pid}"));
        let _ = crate::trace::staging::remove_any(&parent.join(tmp));
    }
    Err(failure(&out, &log, a.verbose))
}

/// Stage 1: everything parity can check before llama.cpp starts: the paths, the model (the
/// same reader as every other command), the ids, the steps, the context, the size.
fn prepare(a: &GoldenArgs) -> Result<Prepared> {
    let model_s = utf8_path(&a.model, "model")?.to_string();
    let model = Model::open(&a.model)?;
    let out_dir = match &a.out {
        Some(d) => d.clone(),
        None => default_golden_out(&a.model)?,
    };
    let out_what = if a.out.is_some() {
        "--out"
    } else {
        "the golden folder"
    };
    let out_s = utf8_path(&out_dir, out_what)?.to_string();
    crate::trace::paths::check_paths(&[(&a.model, "the model")], &[(&out_dir, out_what)])
        .map_err(err)?;
    if !a.input.given() {
        return Err(err("give a prompt (-p TEXT) or ids (--tokens 1,2,3)"));
    }
    // parity tokenizes (as llama.cpp does) and hands llama.cpp ids: its tokenizer aborts the
    // whole process on some inputs (an emoji on a vocabulary without byte tokens).
    let (ids, policy) = a.input.resolve(&model.file)?;
    let n_vocab = model.config.n_vocab;
    if let Some(&t) = ids
        .iter()
        .chain(&a.forced)
        .find(|&&t| t as usize >= n_vocab)
    {
        return Err(err(format!(
            "token id {t} is out of range (the vocabulary has {n_vocab})"
        )));
    }
    let steps = steps(a)?;
    let rounds = 1 + a.turn.len();
    let n_ctx = model.config.n_ctx_train;
    let turns: Vec<usize> = a.turn.iter().map(|t| t.split(',').count()).collect();
    let turned: usize = turns.iter().sum();
    if ids.len() + turned + steps * rounds > n_ctx {
        return Err(err(format!(
            "{} prompt ids{} + --steps {steps}{} exceed the model's context of {n_ctx} positions",
            ids.len(),
            if turned > 0 {
                format!(" + {turned} turn ids")
            } else {
                String::new()
            },
            over(rounds)
        )));
    }
    if a.threads == 0 {
        return Err(err("--threads must be at least 1"));
    }
    // Turn ids are checked by the script; here only counted.
    let run = crate::arch::size::golden_feed(ids.len(), a.chunk, steps, &turns);
    let plan = super::dump::record_plan(a.record.as_deref())?;
    let (bytes, probs) = crate::arch::size::trace_bytes(
        &model.config,
        &run,
        &|k| {
            plan.as_ref()
                .is_none_or(|p| p.keeps(k.step, k.layer, k.tap))
        },
        plan.as_ref(),
    );
    if let Some(msg) = crate::arch::size::over_budget(
        "this golden",
        bytes,
        probs,
        a.max_trace_size,
        if plan.is_some() {
            "make it of fewer positions (a shorter prompt, fewer --steps), or record fewer steps whole"
        } else {
            "make it of fewer positions (a shorter prompt, fewer --steps), or scan it: --record 'taps=l_out,result_norm,logits'"
        },
    ) {
        return Err(err(msg));
    }
    Ok(Prepared {
        model_s,
        out_dir,
        out_s,
        out_what,
        ids,
        policy,
        steps,
        plan,
    })
}

/// " over N turns" where there are several.
fn over(rounds: usize) -> String {
    if rounds > 1 {
        format!(" over {rounds} turns")
    } else {
        String::new()
    }
}

/// The decode steps per turn: --steps, or as many as --forced gives (every turn's decode ids
/// in order), default 4.
fn steps(a: &GoldenArgs) -> Result<usize> {
    let rounds = 1 + a.turn.len();
    Ok(match (a.steps, a.forced.len()) {
        (Some(s), f) if f > 0 && s * rounds != f => {
            return Err(err(format!(
                "--steps {s} disagrees with --forced ({f} ids{}): give one of them",
                over(rounds)
            )));
        }
        (Some(s), _) => s,
        (None, 0) => 4,
        (None, f) if f % rounds != 0 => {
            return Err(err(format!(
                "--forced: {f} ids do not split into {rounds} turns' decode steps"
            )));
        }
        (None, f) => f / rounds,
    })
}

/// Stage 2: the output folder, locked for this run: a folder, empty unless --force; hidden
/// staging folders of goldens killed outright (`.NAME.partial-PID`) cleared.
fn claim_out_dir(p: &Prepared, force: bool) -> Result<crate::trace::staging::Lock> {
    let (out_what, out_s) = (p.out_what, &p.out_s);
    if let Some(parent) = std::path::absolute(&p.out_dir)?.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| err(format!("{out_what} {out_s}: {}: {e}", parent.display())))?;
    }
    let lock = crate::trace::staging::lock(&p.out_dir)
        .map_err(|e| err(format!("{out_what} {out_s}: {e}")))?;
    match std::fs::metadata(&p.out_dir) {
        Ok(m) if !m.is_dir() => {
            return Err(err(format!(
                "{out_what} {out_s}: exists and is not a folder"
            )));
        }
        Ok(_) if !force && std::fs::read_dir(&p.out_dir)?.next().is_some() => {
            return Err(err(format!(
                "{out_what} {out_s}: not empty (pass --force to overwrite)"
            )));
        }
        _ => {}
    }
    crate::trace::staging::remove_stale(&p.out_dir);
    Ok(lock)
}

/// Stage 3: a Python with llama_cpp and numpy, asked isolated (`-I`: a `llama_cpp.py` in the
/// working folder is not what gets imported).
fn probe_python() -> Result<()> {
    let py = python();
    match super::python_command()
        .args(["-c", "import llama_cpp, numpy"])
        .output()
    {
        Ok(o) if o.status.success() => Ok(()),
        Ok(_) => Err(err(format!(
            "llama_cpp (llama-cpp-python) or numpy is not installed for {}: pip install llama-cpp-python numpy (or set PARITY_PYTHON to a Python that has them)",
            py.display()
        ))),
        Err(e) => Err(err(format!(
            "cannot run {} ({e}): install Python 3 with llama-cpp-python, or set PARITY_PYTHON",
            py.display()
        ))),
    }
}

/// Stage 4: the script's command line, from the flags and what stage 1 settled.
fn command(a: &GoldenArgs, p: &Prepared, script: &Path, aside: Aside) -> Command {
    let mut cmd = super::python_command();
    cmd.arg(script).arg(&p.model_s).arg("--out").arg(&p.out_s);
    cmd.arg("--tokens").arg(join_ids(&p.ids));
    if let Some(t) = &a.input.prompt {
        cmd.arg("--prompt-text").arg(t);
    }
    cmd.arg("--steps").arg(p.steps.to_string());
    if !a.forced.is_empty() {
        cmd.arg("--forced").arg(join_ids(&a.forced));
    }
    cmd.arg("--threads").arg(a.threads.to_string());
    if a.gpu_layers != 0 {
        cmd.arg("--gpu-layers").arg(a.gpu_layers.to_string());
    }
    if a.llama_defaults {
        cmd.arg("--llama-defaults");
    }
    if a.chunk > 0 {
        cmd.arg("--chunk").arg(a.chunk.to_string());
    }
    for t in &a.turn {
        cmd.arg("--turn").arg(t);
    }
    if let Some(plan) = &p.plan {
        cmd.arg("--record").arg(plan.to_string());
    }
    for (flag, v) in [
        ("--cache-type-k", &a.cache_type_k),
        ("--cache-type-v", &a.cache_type_v),
        ("--flash-attn", &a.flash_attn),
    ] {
        if let Some(v) = v {
            cmd.arg(flag).arg(v);
        }
    }
    if a.force {
        cmd.arg("--force");
    }
    if a.verbose {
        cmd.arg("--verbose");
    } else {
        cmd.stderr(std::process::Stdio::piped());
        // ggml's abort would attach gdb for a backtrace (printed past the pipe, and its last
        // line buries GGML_ASSERT's): the assertion line alone is the message.
        cmd.env("GGML_NO_BACKTRACE", "1");
    }
    match aside {
        Aside::No => {}
        Aside::Stderr => {
            cmd.stdout(std::io::stderr());
        }
        Aside::Quiet => {
            cmd.stdout(std::process::Stdio::null());
        }
    }
    // The script words its hints for `parity golden`'s flags, not its own.
    cmd.env("PARITY_GOLDEN", "1");
    cmd
}

/// Stage 5: run the script to its end, a spinner while llama.cpp runs (its log is captured
/// unless --verbose shows it). llama.cpp stops with parity: killed outright with it (Linux),
/// and on SIGINT/SIGTERM/SIGHUP killed and its unfinished folder removed before parity ends,
/// so that nothing is published after the user stopped the run. Returns its output and pid.
fn run_script(
    mut cmd: Command,
    out_dir: &Path,
    verbose: bool,
    aside: Aside,
) -> Result<(Output, u32)> {
    let py = python();
    crate::trace::staging::die_with_parent(&mut cmd);
    let child = cmd
        .spawn()
        .map_err(|e| err(format!("running {}: {e}", py.display())))?;
    let pid = child.id();
    crate::trace::staging::register_child(pid);
    let child_tmp = crate::trace::staging::partial_path(out_dir)
        .ok()
        .and_then(|p| {
            let n = p.file_name()?.to_string_lossy().into_owned();
            let (base, _) = n.rsplit_once(".partial-")?;
            Some(p.with_file_name(format!("{base}.partial-{pid}")))
        });
    if let Some(t) = &child_tmp {
        crate::trace::staging::register(t);
    }
    let spin = (!verbose).then(|| Progress::spinner("llama.cpp golden", aside == Aside::Quiet));
    let out = child.wait_with_output();
    crate::trace::staging::forget_child(pid);
    if let Some(t) = &child_tmp {
        // The script published or removed it itself (or a signal killed it: removed later).
        crate::trace::staging::settle(t, || ());
    }
    let out = out.map_err(|e| err(format!("running {}: {e}", py.display())))?;
    drop(spin);
    Ok((out, pid))
}

/// Stage 6: a failure of the Python side as one line (exit 2, never a divergence):
/// llama.cpp's own words when it aborted (`ops.cpp:4132: GGML_ASSERT(eps >= 0.0f) failed`,
/// its source path shortened), else the script's own message or a traceback's last line.
fn failure(out: &Output, log: &str, verbose: bool) -> super::Error {
    let lines = || log.lines().rev().map(str::trim).filter(|l| !l.is_empty());
    let at = regex::Regex::new(r"^(\S+\.(?:c|cc|cpp|cu|h|m)):(\d+): (.+)$").expect("valid");
    let abort = lines().find_map(|l| {
        let c = at.captures(l)?;
        let file = c[1].rsplit_once("/llama.cpp/").map_or(&c[1], |(_, f)| f);
        Some(format!("llama.cpp aborted: {file}:{}: {}", &c[2], &c[3]))
    });
    let last = abort.or_else(|| {
        lines()
            .next()
            .map(|l| l.strip_prefix("llama_golden: ").unwrap_or(l).to_string())
    });
    let why = match (out.status.code(), last) {
        (_, Some(l)) if log.contains("Traceback (most recent call last)") => {
            format!("the llama.cpp script failed: {l}")
        }
        (_, Some(l)) => l,
        (Some(c), None) => format!("the llama.cpp script exited with code {c}"),
        (None, None) => "the llama.cpp script was killed by a signal".to_string(),
    };
    let hint = if verbose || why.contains("--verbose") {
        ""
    } else {
        " (rerun with --verbose for llama.cpp's log)"
    };
    let signal = {
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            out.status
                .signal()
                .map(|s| format!(" (killed by signal {s})"))
                .unwrap_or_default()
        }
        #[cfg(not(unix))]
        String::new()
    };
    err(format!("golden: {why}{signal}{hint}"))
}

/// Where `parity golden` writes when no --out is given: the user's golden folder, one
/// subfolder per model file and content (`stem-sha12`).
fn default_golden_out(model: &Path) -> Result<PathBuf> {
    let file = std::fs::File::open(model).map_err(|e| err(format!("{}: {e}", model.display())))?;
    // SAFETY: read-only map of a file we only hash; a concurrent truncation is the same
    // hazard as in every GGUF read.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| err(format!("{}: {e}", model.display())))?;
    let sha = crate::model::sha256_hex(&map);
    let stem = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    goldens::default_out(&stem, &sha).ok_or_else(|| {
        err("no home folder to keep goldens in: pass --out DIR (or set PARITY_GOLDEN_DIR)")
    })
}

/// Ids as the script and the messages take them: comma separated.
pub(super) fn join_ids(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}
