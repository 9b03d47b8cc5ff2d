//! Making a golden: llama.cpp's own run of a model, tap by tap, through llama-cpp-python
//! (scripts/llama_golden.py), in stages: everything parity can check is checked before
//! llama.cpp starts (the paths, the model, the ids, the context, the size, the output folder),
//! then the script runs, and any failure of the Python side is one line. `parity golden` and
//! `check`'s zoom (which runs llama.cpp again on a scan golden's feed) both make theirs here.

use crate::model::Model;
use crate::report::progress::Progress;
use crate::trace::goldens;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// One golden to make: the model, the ids fed, and llama.cpp's settings (the flags of
/// `parity golden`, documented there).
#[derive(Clone, Debug, Default)]
pub struct Spec {
    pub model: PathBuf,
    /// The prompt ids, and the line saying how they were made (printed before llama.cpp runs).
    pub ids: Vec<u32>,
    pub policy: String,
    /// The prompt's text, recorded in the manifest, when the ids came from one.
    pub prompt_text: Option<String>,
    /// Decode steps per turn; `None`: as many as `forced` gives, else 4.
    pub steps: Option<usize>,
    /// Ids fed at the decode steps instead of llama.cpp's greedy choice.
    pub forced: Vec<u32>,
    /// The output folder; `None`: the user's golden folder, one subfolder per model file.
    pub out: Option<PathBuf>,
    pub llama_defaults: bool,
    /// Tokens per call of a chunked prefill (0: the whole prompt at once).
    pub chunk: usize,
    /// Further turns' ids, each comma separated (checked by the script).
    pub turns: Vec<String>,
    pub cache_type_k: Option<String>,
    pub cache_type_v: Option<String>,
    pub flash_attn: Option<String>,
    pub threads: usize,
    pub gpu_layers: i32,
    /// Overwrite a non-empty output folder.
    pub force: bool,
    /// A recording plan (`taps=…;full=…`).
    pub record: Option<String>,
    pub max_trace_size: u64,
    /// llama.cpp's own log and the script's full error output shown.
    pub verbose: bool,
}

/// The programs a golden is made with: a Python with llama-cpp-python and numpy, and
/// scripts/llama_golden.py (absolute paths: the working folder never decides what runs).
#[derive(Clone, Debug)]
pub struct Tools {
    pub python: PathBuf,
    pub script: PathBuf,
}

impl Tools {
    /// [`Tools::python`] run isolated (`-I`): neither the working folder nor the script's
    /// folder on `sys.path`, no PYTHON* variables, no user site-packages, so a `llama_cpp.py`
    /// or `sitecustomize.py` lying where parity runs is never imported.
    pub fn python_command(&self) -> Command {
        let mut c = Command::new(&self.python);
        c.arg("-I");
        crate::trace::staging::isolate_python(&mut c);
        c
    }
}

/// Where a golden made inside another command reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Aside {
    /// `parity golden` itself: the script's report on stdout, llama.cpp's log on stderr.
    No,
    /// A zoom inside `check`, whose stdout may be its JSON: all of it on stderr.
    Stderr,
    /// A zoom inside `check --quiet`: nothing but an error.
    Quiet,
}

/// A path handed to the Python side and recorded in a manifest: it must be text.
fn utf8_path<'p>(p: &'p Path, what: &str) -> Result<&'p str, String> {
    p.to_str().ok_or_else(|| {
        format!(
            "{what} {}: the path is not valid UTF-8 (a golden records it as text): rename it or use a link",
            p.display()
        )
    })
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

/// Makes the golden `s` describes with `tools`. Err: one line (a refusal before llama.cpp
/// runs, or why the Python side failed).
pub fn make(s: &Spec, tools: &Tools, aside: Aside) -> Result<(), String> {
    let p = prepare(s)?;
    // One writer of the folder at a time, held until the script has published (or failed).
    let _lock = claim_out_dir(&p, s.force)?;
    if !tools.script.exists() {
        return Err(format!("{} not found", tools.script.display()));
    }
    probe_python(tools)?;
    if aside != Aside::Quiet {
        eprintln!("prompt ids: {} — {}", join_ids(&p.ids), p.policy);
    }
    let cmd = command(s, &p, tools, aside);
    let (out, pid) = run_script(cmd, tools, &p.out_dir, s.verbose, aside)?;
    let log = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // llama.cpp's log quotes the model's metadata: kept as lines, controls escaped.
        if aside != Aside::Quiet {
            eprint!("{}", crate::report::shown::text(&log));
        }
        return Ok(());
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
    Err(failure(&out, &log, s.verbose))
}

/// Stage 1: everything parity can check before llama.cpp starts: the paths, the model (the
/// same reader as every other command), the ids, the steps, the context, the size.
fn prepare(a: &Spec) -> Result<Prepared, String> {
    let model_s = utf8_path(&a.model, "model")?.to_string();
    let model = Model::open(&a.model).map_err(|e| e.to_string())?;
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
    crate::trace::paths::check_paths(&[(&a.model, "the model")], &[(&out_dir, out_what)])?;
    // The caller tokenized (as llama.cpp does) and hands llama.cpp ids: its tokenizer aborts
    // the whole process on some inputs (an emoji on a vocabulary without byte tokens).
    let (ids, policy) = (a.ids.clone(), a.policy.clone());
    if ids.is_empty() {
        return Err("no prompt ids to feed".into());
    }
    let n_vocab = model.config.n_vocab;
    if let Some(&t) = ids
        .iter()
        .chain(&a.forced)
        .find(|&&t| t as usize >= n_vocab)
    {
        return Err(format!(
            "token id {t} is out of range (the vocabulary has {n_vocab})"
        ));
    }
    let steps = steps(a)?;
    let rounds = 1 + a.turns.len();
    let n_ctx = model.config.n_ctx_train;
    let turns: Vec<usize> = a.turns.iter().map(|t| t.split(',').count()).collect();
    let turned: usize = turns.iter().sum();
    if ids.len() + turned + steps * rounds > n_ctx {
        return Err(format!(
            "{} prompt ids{} + --steps {steps}{} exceed the model's context of {n_ctx} positions",
            ids.len(),
            if turned > 0 {
                format!(" + {turned} turn ids")
            } else {
                String::new()
            },
            over(rounds)
        ));
    }
    if a.threads == 0 {
        return Err("--threads must be at least 1".into());
    }
    // Turn ids are checked by the script; here only counted.
    let run = crate::arch::size::golden_feed(ids.len(), a.chunk, steps, &turns);
    let plan = a
        .record
        .as_deref()
        .map(crate::trace::Record::parse)
        .transpose()
        .map_err(|e| format!("--record: {e}"))?;
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
        return Err(msg);
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
fn steps(a: &Spec) -> Result<usize, String> {
    let rounds = 1 + a.turns.len();
    Ok(match (a.steps, a.forced.len()) {
        (Some(s), f) if f > 0 && s * rounds != f => {
            return Err(format!(
                "--steps {s} disagrees with --forced ({f} ids{}): give one of them",
                over(rounds)
            ));
        }
        (Some(s), _) => s,
        (None, 0) => 4,
        (None, f) if f % rounds != 0 => {
            return Err(format!(
                "--forced: {f} ids do not split into {rounds} turns' decode steps"
            ));
        }
        (None, f) => f / rounds,
    })
}

/// Stage 2: the output folder, locked for this run: a folder, empty unless --force; hidden
/// staging folders of goldens killed outright (`.NAME.partial-PID`) cleared.
fn claim_out_dir(p: &Prepared, force: bool) -> Result<crate::trace::staging::Lock, String> {
    let (out_what, out_s) = (p.out_what, &p.out_s);
    let abs = std::path::absolute(&p.out_dir).map_err(|e| format!("{out_what} {out_s}: {e}"))?;
    if let Some(parent) = abs.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("{out_what} {out_s}: {}: {e}", parent.display()))?;
    }
    let lock =
        crate::trace::staging::lock(&p.out_dir).map_err(|e| format!("{out_what} {out_s}: {e}"))?;
    match std::fs::metadata(&p.out_dir) {
        Ok(m) if !m.is_dir() => {
            return Err(format!("{out_what} {out_s}: exists and is not a folder"));
        }
        Ok(_)
            if !force
                && std::fs::read_dir(&p.out_dir)
                    .map_err(|e| format!("{out_what} {out_s}: {e}"))?
                    .next()
                    .is_some() =>
        {
            return Err(format!(
                "{out_what} {out_s}: not empty (pass --force to overwrite)"
            ));
        }
        _ => {}
    }
    crate::trace::staging::remove_stale(&p.out_dir);
    Ok(lock)
}

/// Stage 3: a Python with llama_cpp and numpy, asked isolated (`-I`: a `llama_cpp.py` in the
/// working folder is not what gets imported).
fn probe_python(tools: &Tools) -> Result<(), String> {
    let py = &tools.python;
    match tools
        .python_command()
        .args(["-c", "import llama_cpp, numpy"])
        .output()
    {
        Ok(o) if o.status.success() => Ok(()),
        Ok(_) => Err(format!(
            "llama_cpp (llama-cpp-python) or numpy is not installed for {}: pip install llama-cpp-python numpy (or set PARITY_PYTHON to a Python that has them)",
            py.display()
        )),
        Err(e) => Err(format!(
            "cannot run {} ({e}): install Python 3 with llama-cpp-python, or set PARITY_PYTHON",
            py.display()
        )),
    }
}

/// Stage 4: the script's command line, from the flags and what stage 1 settled.
fn command(a: &Spec, p: &Prepared, tools: &Tools, aside: Aside) -> Command {
    let mut cmd = tools.python_command();
    cmd.arg(&tools.script)
        .arg(&p.model_s)
        .arg("--out")
        .arg(&p.out_s);
    cmd.arg("--tokens").arg(join_ids(&p.ids));
    if let Some(t) = &a.prompt_text {
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
    for t in &a.turns {
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
    tools: &Tools,
    out_dir: &Path,
    verbose: bool,
    aside: Aside,
) -> Result<(Output, u32), String> {
    let py = &tools.python;
    crate::trace::staging::die_with_parent(&mut cmd);
    let child = cmd
        .spawn()
        .map_err(|e| format!("running {}: {e}", py.display()))?;
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
    let out = out.map_err(|e| format!("running {}: {e}", py.display()))?;
    drop(spin);
    Ok((out, pid))
}

/// Stage 6: a failure of the Python side as one line (exit 2, never a divergence):
/// llama.cpp's own words when it aborted (`ops.cpp:4132: GGML_ASSERT(eps >= 0.0f) failed`,
/// its source path shortened), else the script's own message or a traceback's last line.
fn failure(out: &Output, log: &str, verbose: bool) -> String {
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
    format!("golden: {why}{signal}{hint}")
}

/// Where `parity golden` writes when no --out is given: the user's golden folder, one
/// subfolder per model file and content (`stem-sha12`).
fn default_golden_out(model: &Path) -> Result<PathBuf, String> {
    let file = std::fs::File::open(model).map_err(|e| format!("{}: {e}", model.display()))?;
    // SAFETY: read-only map of a file we only hash; a concurrent truncation is the same
    // hazard as in every GGUF read.
    let map =
        unsafe { memmap2::Mmap::map(&file) }.map_err(|e| format!("{}: {e}", model.display()))?;
    let sha = crate::model::sha256_hex(&map);
    let stem = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    goldens::default_out(&stem, &sha).ok_or_else(|| {
        "no home folder to keep goldens in: pass --out DIR (or set PARITY_GOLDEN_DIR)".to_string()
    })
}

/// Ids as the script and the messages take them: comma separated.
pub fn join_ids(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}
