//! `parity golden` and `parity check` (the terminal side of `crate::check`).

use super::output::{ReportArgs, finish_with, run_info, show};
use super::run::InputArgs;
use super::{Result, err, python, repo_root};
use crate::check::{CheckOptions, Event};
use crate::compare::{Comparison, PairKind};
use crate::model::Model;
use crate::report::progress::Progress;
use crate::trace::goldens;
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The committed default: `parity check` with no MODEL runs this fixture against its golden.
pub const DEFAULT_FIXTURE: &str = "fixtures/tiny-llama-q8_0.gguf";

#[derive(Args)]
pub struct GoldenArgs {
    /// GGUF model file (UTF-8 path: the golden's manifest records it as text).
    model: PathBuf,
    #[command(flatten)]
    input: InputArgs,
    /// Decode steps after the prefill (teacher-forced from llama.cpp's greedy continuation);
    /// default 4, or as many as --forced gives. Prompt + steps must fit the model's context.
    #[arg(long)]
    steps: Option<usize>,
    /// Ids to feed at the decode steps instead of llama.cpp's own greedy choice (comma
    /// separated), e.g. another golden's continuation, so two goldens see the same sequence.
    #[arg(long, value_delimiter = ',')]
    forced: Vec<u32>,
    /// Output trace folder (written under a temporary name beside it, moved into place at the
    /// end; UTF-8 path). Default: the user's golden folder ($PARITY_GOLDEN_DIR, else
    /// ~/.local/share/parity/golden), one subfolder per model file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep llama.cpp's default settings (F16 KV cache, flash attention auto) instead of the
    /// tight ones (F32 KV cache, flash attention off, no weight repacking).
    #[arg(long)]
    llama_defaults: bool,
    /// Feed the prompt (and each --turn) to llama.cpp in calls of this many tokens, one step
    /// each: a chunked prefill (1: one token at a time). Default: the whole prompt at once.
    #[arg(long, default_value_t = 0)]
    chunk: usize,
    /// The ids of a further turn (comma separated), fed as one step (or chunks) after the
    /// decode steps and followed by as many decode steps again; repeat for more turns.
    #[arg(long)]
    turn: Vec<String>,
    /// K cache type (llama.cpp's -ctk: f32, f16, q8_0, q4_0). Default f32, or f16 with
    /// --llama-defaults. The golden records it and the judge holds it to that cache.
    #[arg(long, value_parser = ["f32", "f16", "q8_0", "q4_0"])]
    cache_type_k: Option<String>,
    /// V cache type (llama.cpp's -ctv; a quantized V cache needs flash attention).
    #[arg(long, value_parser = ["f32", "f16", "q8_0", "q4_0"])]
    cache_type_v: Option<String>,
    /// Flash attention (llama.cpp's -fa: on, off, auto). Default off, or auto with
    /// --llama-defaults; the golden records what llama.cpp resolved it to.
    #[arg(long, value_parser = ["on", "off", "auto"])]
    flash_attn: Option<String>,
    /// llama.cpp threads.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    threads: usize,
    /// Layers to offload to the GPU device of a llama-cpp-python built with one (-1: all, the
    /// output included; e.g. CMAKE_ARGS=-DGGML_VULKAN=on). The manifest names the device
    /// (llama.cpp-vulkan, …) and `check` holds such a golden to GPU rounding.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-1..))]
    gpu_layers: i32,
    /// Overwrite a non-empty output folder.
    #[arg(long)]
    force: bool,
    /// A recording plan, as `parity diff` prints it for a zoom: `taps=l_out,result_norm,logits`
    /// keeps those taps at every step (a scan of a long run at a fraction of the size),
    /// `;full=3,7-8` every tap at those steps (docs/trace-format.md, "Scan and zoom").
    #[arg(long, value_name = "PLAN")]
    record: Option<String>,
    /// Refuse a golden whose trace would be larger than this (bytes, or 500M, 4G, 1T), before
    /// llama.cpp runs. The attention probabilities grow with the square of the length.
    #[arg(long, value_name = "SIZE", default_value = "4G", value_parser = crate::arch::size::parse_size)]
    max_trace_size: u64,
    /// Show llama.cpp's own log and the script's full error output.
    #[arg(long)]
    verbose: bool,
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
enum Aside {
    /// `parity golden` itself: the script's report on stdout, llama.cpp's log on stderr.
    No,
    /// A zoom inside `check`, whose stdout may be its JSON: all of it on stderr.
    Stderr,
    /// A zoom inside `check --quiet`: nothing but an error.
    Quiet,
}

fn make_golden(a: GoldenArgs, aside: Aside) -> Result<ExitCode> {
    // Everything parity can check is checked before llama.cpp starts: the paths, the model
    // (the same reader as every other command), the ids, the context, the output folder.
    let model_s = utf8_path(&a.model, "model")?;
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
    let out_s = utf8_path(&out_dir, out_what)?;
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
    // --steps is per turn; --forced holds every turn's decode ids in order.
    let rounds = 1 + a.turn.len();
    let over = if rounds > 1 {
        format!(" over {rounds} turns")
    } else {
        String::new()
    };
    let steps = match (a.steps, a.forced.len()) {
        (Some(s), f) if f > 0 && s * rounds != f => {
            return Err(err(format!(
                "--steps {s} disagrees with --forced ({f} ids{over}): give one of them"
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
    };
    let n_ctx = model.config.n_ctx_train;
    let turned: usize = a.turn.iter().map(|t| t.split(',').count()).sum();
    if ids.len() + turned + steps * rounds > n_ctx {
        return Err(err(format!(
            "{} prompt ids{} + --steps {steps}{over} exceed the model's context of {n_ctx} positions",
            ids.len(),
            if turned > 0 {
                format!(" + {turned} turn ids")
            } else {
                String::new()
            }
        )));
    }
    if a.threads == 0 {
        return Err(err("--threads must be at least 1"));
    }
    // Turn ids are checked by the script; here only counted.
    let turns: Vec<usize> = a.turn.iter().map(|t| t.split(',').count()).collect();
    let run = crate::arch::size::golden_feed(ids.len(), a.chunk, steps, &turns);
    let plan = super::run::record_plan(a.record.as_deref())?;
    let (bytes, probs) = crate::arch::size::trace_bytes(&model.config, &run, &|k| {
        plan.as_ref().is_none_or(|p| p.wants(k.step, k.tap))
    });
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
    // One writer of the folder at a time, held until the script has published (or failed).
    if let Some(parent) = std::path::absolute(&out_dir)?.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| err(format!("{out_what} {out_s}: {}: {e}", parent.display())))?;
    }
    let _lock = crate::trace::staging::lock(&out_dir)
        .map_err(|e| err(format!("{out_what} {out_s}: {e}")))?;
    match std::fs::metadata(&out_dir) {
        Ok(m) if !m.is_dir() => {
            return Err(err(format!(
                "{out_what} {out_s}: exists and is not a folder"
            )));
        }
        Ok(_) if !a.force && std::fs::read_dir(&out_dir)?.next().is_some() => {
            return Err(err(format!(
                "{out_what} {out_s}: not empty (pass --force to overwrite)"
            )));
        }
        _ => {}
    }
    // A golden killed outright leaves its hidden staging folder (.NAME.partial-PID) beside
    // the output; the next run clears those whose process is gone.
    crate::trace::staging::remove_stale(&out_dir);
    drop(model);
    let script = super::script("llama_golden.py");
    if !script.exists() {
        return Err(err(format!("{} not found", script.display())));
    }
    let py = python();
    // Isolated (`-I`): a `llama_cpp.py` in the working folder is not what gets imported.
    let probe = super::python_command()
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
    if aside != Aside::Quiet {
        eprintln!("prompt ids: {} — {policy}", join_ids(&ids));
    }
    let mut cmd = super::python_command();
    cmd.arg(&script).arg(model_s).arg("--out").arg(out_s);
    cmd.arg("--tokens").arg(join_ids(&ids));
    if let Some(p) = &a.input.prompt {
        cmd.arg("--prompt-text").arg(p);
    }
    cmd.arg("--steps").arg(steps.to_string());
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
    if let Some(p) = &plan {
        cmd.arg("--record").arg(p.to_string());
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
    // llama.cpp stops with parity: killed outright with it (Linux), and on SIGINT/SIGTERM/
    // SIGHUP killed and its unfinished folder removed before parity ends, so that nothing is
    // published after the user stopped the run.
    crate::trace::staging::die_with_parent(&mut cmd);
    let child = cmd
        .spawn()
        .map_err(|e| err(format!("running {}: {e}", py.display())))?;
    let pid = child.id();
    crate::trace::staging::register_child(pid);
    let child_tmp = crate::trace::staging::partial_path(&out_dir)
        .ok()
        .and_then(|p| {
            let n = p.file_name()?.to_string_lossy().into_owned();
            let (base, _) = n.rsplit_once(".partial-")?;
            Some(p.with_file_name(format!("{base}.partial-{pid}")))
        });
    if let Some(t) = &child_tmp {
        crate::trace::staging::register(t);
    }
    // A spinner while llama.cpp runs (its log is captured unless --verbose shows it).
    let spin = (!a.verbose).then(|| Progress::spinner("llama.cpp golden", aside == Aside::Quiet));
    let out = child.wait_with_output();
    crate::trace::staging::forget_child(pid);
    if let Some(t) = &child_tmp {
        // The script published or removed it itself (or a signal killed it: removed below).
        crate::trace::staging::settle(t, || ());
    }
    let out = out.map_err(|e| err(format!("running {}: {e}", py.display())))?;
    drop(spin);
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
    if let (Ok(abs), Some(name)) = (std::path::absolute(&out_dir), out_dir.file_name())
        && let Some(parent) = abs.parent()
    {
        let mut tmp = std::ffi::OsString::from(".");
        tmp.push(name);
        tmp.push(format!(".partial-{pid}"));
        let _ = crate::trace::staging::remove_any(&parent.join(tmp));
    }
    // Any failure of the Python side is an error making the golden (exit 2), never a
    // divergence (exit 1): one line, the script's own message or a traceback's last line.
    let lines = || log.lines().rev().map(str::trim).filter(|l| !l.is_empty());
    // llama.cpp's own words when it aborted (`ops.cpp:4132: GGML_ASSERT(eps >= 0.0f) failed`,
    // its source path shortened), else the script's last line.
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
    let hint = if a.verbose || why.contains("--verbose") {
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
    Err(err(format!("golden: {why}{signal}{hint}")))
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
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
    /// activation rounding), fast, gpu (wgpu). Default: reference,reference:ggml-cpu,fast, and
    /// gpu when a hardware GPU adapter exists (a software one such as lavapipe only when named
    /// here; either way the report says in one line when the GPU was not checked).
    #[arg(long, value_delimiter = ',')]
    backends: Option<Vec<String>>,
    /// Worker threads for the fast backend (0 = all cores).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
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
    /// Print every comparison with its per-layer table (by default: the verdict, the
    /// comparisons that diverged, else the one that matters most, and a count of the rest).
    #[arg(long, short)]
    verbose: bool,
    /// Refuse a check whose traces (each pass holds one in memory) would be larger than this
    /// (bytes, or 500M, 4G, 1T), before any pass starts.
    #[arg(long, value_name = "SIZE", default_value = "4G", value_parser = crate::arch::size::parse_size)]
    max_trace_size: u64,
    /// Against a scan golden (`golden --record`), do not zoom: by default a check that
    /// diverges runs llama.cpp again with the first diverging step recorded whole and checks
    /// that step tap by tap, the golden's own ops judged one by one.
    #[arg(long)]
    no_zoom: bool,
    /// Keep the zoom's golden in this folder (new or empty) instead of a temporary one.
    #[arg(long, value_name = "DIR", conflicts_with = "no_zoom")]
    zoom_out: Option<PathBuf>,
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

pub fn check(a: CheckArgs) -> Result<ExitCode> {
    let model_path = a
        .model
        .clone()
        .unwrap_or_else(|| repo_root().join(DEFAULT_FIXTURE));
    let mut inputs: Vec<(&Path, &str)> = vec![(&model_path, "the model")];
    if let Some(g) = &a.golden {
        inputs.push((g, "--golden"));
    }
    a.report.validate(&inputs)?;
    if let Some(z) = &a.zoom_out {
        crate::trace::paths::check_paths(&inputs, &[(z, "--zoom-out")]).map_err(err)?;
        match std::fs::read_dir(z).map(|mut d| d.next().is_some()) {
            Ok(true) => {
                return Err(err(format!(
                    "--zoom-out {}: not empty (the zoom's golden needs a new or empty folder)",
                    crate::report::shown::line(&z.display().to_string())
                )));
            }
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(err(format!(
                    "--zoom-out {}: {e}",
                    crate::report::shown::line(&z.display().to_string())
                )));
            }
            _ => {}
        }
    }
    let named = a.backends.as_deref().unwrap_or_default();
    for (i, b) in named.iter().enumerate() {
        if named[..i].contains(b) {
            return Err(err(format!(
                "--backends names {b} twice: a backend compared with itself proves nothing"
            )));
        }
    }
    if !model_path.exists() {
        return Err(err(format!("{}: no such file", model_path.display())));
    }
    let model = Progress::stage("loading the model", a.report.quiet, || {
        Model::open(&model_path)
    })?;
    let prompt = if a.input.given() {
        let (ids, policy) = a.input.resolve(&model.file)?;
        if !a.report.quiet {
            eprintln!("prompt ids: {} — {policy}", join_ids(&ids));
        }
        Some(ids)
    } else {
        None
    };
    let opt = CheckOptions {
        backends: a.backends.clone().unwrap_or_else(|| {
            ["reference", "reference:ggml-cpu", "fast", "gpu"]
                .map(String::from)
                .to_vec()
        }),
        device_optional: a.backends.is_none(),
        threads: a.threads,
        steps: a.steps,
        op_by_op: !a.no_op_by_op,
        golden: a.golden.clone(),
        golden_dirs: goldens::search_dirs(&repo_root().join("golden")),
        prompt,
        max_trace_size: a.max_trace_size,
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
    let mut r = crate::check::run(&model, &model_path, &opt, &mut on_event)?;
    if !quiet {
        if prompt_from_golden(&r) {
            eprintln!("prompt ids: {} — {}", join_ids(&r.prompt), r.ids_from);
        }
        match &r.golden {
            Some((p, _)) => eprintln!(
                "golden: {}",
                crate::report::shown::line(&p.display().to_string())
            ),
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
    // A scan golden's check that diverged zooms: llama.cpp again for that step whole.
    let zoom = match crate::check::zoom(&r).filter(|_| !a.no_zoom) {
        Some(z) => zoom_check(&a, &model, &model_path, &opt, &r, z, &mut on_event)?,
        None => None,
    };
    if let Some(Err(why)) = &zoom {
        r.notes.push(why.clone());
    }
    let info = run_info(
        r.golden
            .iter()
            .map(|(_, g)| g)
            .chain(&r.traces_op)
            .chain(&r.traces),
    );
    // The golden found by sha256 is an input too (known only now).
    let golden_path = r.golden.as_ref().map(|(g, _)| g.clone());
    if let Some(g) = &golden_path {
        inputs.push((g, "the golden"));
    }
    let mut comparisons = render(&a, r, None);
    if let Some(Ok(z)) = zoom {
        let line = format!(
            "zoom: llama.cpp ran again with step {} recorded whole (--record '{}'){}: every tap of that step compared, the golden's own ops judged one by one",
            z.zoom.steps[0],
            z.zoom.record,
            match &z.kept {
                Some(d) => format!(", kept in {}", d.display()),
                None => String::new(),
            }
        );
        say(&a, &crate::report::shown::line(&line));
        comparisons.extend(render(&a, z.report, Some(z.zoom.steps[0])));
    }
    finish_with(&comparisons, &info, &a.report, &inputs)
}

/// A line of the report: on stdout, or on stderr when the JSON goes to stdout.
fn say(a: &CheckArgs, line: &str) {
    if a.report.quiet {
        return;
    }
    if a.report.json.as_deref() == Some(Path::new("-")) {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

/// Prints one check's comparisons (the diverged ones, else the one that matters most; all of
/// them with --verbose), its passes and notes; returns its comparisons, those of a zoom at
/// `zoomed` labelled with the step.
fn render(a: &CheckArgs, r: crate::check::CheckReport, zoomed: Option<usize>) -> Vec<Comparison> {
    let quiet = a.report.quiet;
    // The first screen: every comparison that diverged (its paragraph and table), else the one
    // that matters most — the tightest against the golden (op by op first), else the first
    // pair. The rest, and the drift tables of the end-to-end passes, behind --verbose (and in
    // the HTML page).
    let key = r
        .comparisons
        .iter()
        .position(|j| j.comparison.diverged())
        .or_else(|| r.comparisons.iter().position(|j| j.against_golden))
        .unwrap_or(0);
    let n = r.comparisons.len();
    let mut comparisons = Vec::with_capacity(n);
    for (i, j) in r.comparisons.into_iter().enumerate() {
        let mut c = j.comparison;
        if let Some(s) = zoomed {
            c.baseline = format!("{} (zoom: step {s} whole)", c.baseline);
        }
        let header = if j.against_golden {
            format!("== {} vs golden ({})", c.candidate, c.baseline)
        } else {
            format!("== {} vs {}", c.candidate, c.baseline)
        };
        if a.verbose || c.diverged() || i == key {
            // The end-to-end comparisons against the golden show their table when asked for
            // everything: it is the picture of drift along the layers.
            let end_to_end = j.against_golden && c.pair != PairKind::OpByOp;
            show(
                &c,
                &header,
                (end_to_end && a.verbose) || c.diverged(),
                &a.report,
            );
        }
        comparisons.push(c);
    }
    if !a.verbose {
        let diverged = comparisons.iter().filter(|c| c.diverged()).count();
        let shown = if diverged > 0 { diverged } else { 1 };
        say(
            a,
            &format!(
                "{n} comparisons, {diverged} diverged; {} more within tolerance not shown: --verbose prints each (with the drift tables along the layers), --html FILE makes the page",
                n - shown
            ),
        );
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
        // Notes quote the golden's manifest (its backend name): one escaped line each.
        for l in std::iter::once(&line).chain(&r.notes) {
            say(a, &crate::report::shown::line(l));
        }
    }
    comparisons
}

/// The first tap both traces hold whose tensors differ in any bit.
fn first_difference(
    a: &crate::trace::Trace,
    b: &crate::trace::Trace,
) -> Result<Option<crate::trace::TapKey>> {
    for k in a.keys().filter(|k| b.contains(k)) {
        let (x, y) = (a.get(k)?, b.get(k)?);
        let same = match (&x, &y) {
            (Some(x), Some(y)) => {
                x.shape() == y.shape()
                    && x.iter()
                        .zip(y.iter())
                        .all(|(p, q)| p.to_bits() == q.to_bits())
            }
            _ => x.is_none() && y.is_none(),
        };
        if !same {
            return Ok(Some(*k));
        }
    }
    Ok(None)
}

/// A zoom's result: the check against the zoom golden, and where that golden is kept.
struct Zoomed {
    zoom: crate::trace::Zoom,
    report: crate::check::CheckReport,
    kept: Option<PathBuf>,
}

/// Runs llama.cpp again on the scan golden's ids, fed in the same calls with the same
/// settings, recording `zoom`'s plan (into --zoom-out, else a temporary folder removed at the
/// end), and checks again against that golden. Err: why no zoom was made, one line for the
/// report (the scan's verdict stands on its own).
fn zoom_check(
    a: &CheckArgs,
    model: &Model,
    model_path: &Path,
    opt: &CheckOptions,
    r: &crate::check::CheckReport,
    zoom: crate::trace::Zoom,
    on_event: &mut dyn FnMut(Event),
) -> Result<Option<std::result::Result<Zoomed, String>>> {
    let (_, g) = r.golden.as_ref().expect("a zoom has a golden");
    let step = zoom.steps[0];
    let by_hand = format!(
        "make it with `parity golden` and the scan's own ids and settings, adding --record '{}', then check against it",
        zoom.record
    );
    let Some(feed) = goldens::feed(g) else {
        return Ok(Some(Err(format!(
            "zoom: not made — the golden's steps do not match how its settings say it was fed; {by_hand}"
        ))));
    };
    let tmp;
    let out = match &a.zoom_out {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::Builder::new()
                .prefix("parity-zoom-")
                .tempdir()
                .map_err(|e| err(format!("a temporary folder for the zoom golden: {e}")))?;
            tmp.path().join("golden")
        }
    };
    let s = &g.manifest.producer.settings;
    let text = |k: &str| s.get(k).and_then(|v| v.as_str());
    // Only values `parity golden` accepts are passed on (the manifest is an input).
    let cache = |k: &str| {
        text(k)
            .filter(|t| ["f32", "f16", "q8_0", "q4_0"].contains(t))
            .map(String::from)
    };
    let flash_attn = match s.get("flash_attn") {
        Some(serde_json::Value::Bool(b)) => Some(if *b { "on" } else { "off" }),
        Some(serde_json::Value::String(t)) => match t.as_str() {
            "enabled" | "on" => Some("on"),
            "disabled" | "off" => Some("off"),
            "auto" => Some("auto"),
            _ => None,
        },
        _ => None,
    };
    let args = GoldenArgs {
        model: model_path.to_path_buf(),
        input: InputArgs {
            prompt: None,
            tokens: Some(feed.prompt.clone()),
            no_bos: false,
            no_eos: false,
        },
        steps: Some(feed.steps),
        forced: feed.forced.clone(),
        out: Some(out.clone()),
        llama_defaults: s.get("llama_defaults").and_then(|v| v.as_bool()) == Some(true),
        chunk: feed.chunk,
        turn: feed.turns.iter().map(|t| join_ids(t)).collect(),
        cache_type_k: cache("type_k"),
        cache_type_v: cache("type_v"),
        flash_attn: flash_attn.map(String::from),
        threads: s
            .get("n_threads")
            .and_then(|v| v.as_u64())
            .map_or(1, |t| t.clamp(1, 1024) as usize),
        gpu_layers: s
            .get("n_gpu_layers")
            .and_then(|v| v.as_i64())
            .map_or(0, |l| l.clamp(-1, i32::MAX as i64) as i32),
        force: false,
        record: Some(zoom.record.clone()),
        max_trace_size: a.max_trace_size,
        verbose: false,
    };
    if !a.report.quiet {
        eprintln!(
            "zoom: the check diverged at step {step} of a scan golden: running llama.cpp again with that step recorded whole (--record '{}')",
            zoom.record
        );
    }
    let aside = if a.report.quiet {
        Aside::Quiet
    } else {
        Aside::Stderr
    };
    if let Err(e) = make_golden(args, aside) {
        return Ok(Some(Err(format!(
            "zoom: not made — llama.cpp could not run again ({}); {by_hand}",
            e.to_string().trim()
        ))));
    }
    let zopt = CheckOptions {
        golden: Some(out.clone()),
        prompt: None,
        ..opt.clone()
    };
    let mut report = crate::check::run(model, model_path, &zopt, on_event)?;
    // llama.cpp on the CPU repeats itself bit for bit: a zoom golden that does not (another
    // build, threads that split sums otherwise, a GPU) is a run other than the scan's.
    if let Some((_, zg)) = &report.golden
        && let Some(k) = first_difference(g, zg)?
    {
        report.notes.push(format!(
            "zoom: llama.cpp run again differs from the scan golden at {k}: the zoom shows a run of its own, not the scan's"
        ));
    }
    Ok(Some(Ok(Zoomed {
        zoom,
        report,
        kept: a.zoom_out.clone(),
    })))
}

fn prompt_from_golden(r: &crate::check::CheckReport) -> bool {
    r.ids_from == "from the golden"
}
