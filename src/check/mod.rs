//! `parity check` as a library call: find the model's golden, settle the ids, run every
//! backend (end to end, and op by op on the golden's inputs), and compare each against the
//! golden and against each other. The terminal, JSON, HTML and snapshot printers all render
//! the [`CheckReport`] this returns; nothing here prints (a zoom's llama.cpp run reports where
//! its `golden::Aside` says).

use crate::backend::lockstep::{Fanout, Lockstep};
use crate::backend::{self, BackendError, registry};
use crate::compare::{CompareError, CompareOptions, Comparison, PairKind, compare};
use crate::model::Model;
use crate::trace::{
    MemorySink, ModelRef, Producer, ReplaySink, Sink, StepInfo, Tap, TapFilter, TapKey, Trace,
    TraceError, goldens,
};
use std::path::{Path, PathBuf};
use std::time::Instant;

mod zoom;
pub use zoom::{Zoomed, zoom, zoom_check, zoom_spec};

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(
        "no golden for {model} (sha256 {sha}…) in {searched}: give a prompt (-p TEXT) to compare backends only, or make a golden with `parity golden`"
    )]
    NoGolden {
        model: String,
        sha: String,
        searched: String,
    },
    #[error(
        "golden {golden} was made for another model (sha256 {golden_sha}…), not {model} (sha256 {sha}…)"
    )]
    GoldenOtherModel {
        golden: String,
        golden_sha: String,
        model: String,
        sha: String,
    },
    #[error(
        "golden {golden} was made for other token ids ({}), not these ({}): make one for these ids with `parity golden MODEL -p ... --out DIR`, or run `parity check MODEL --golden {golden}` without -p/--tokens to use the golden's own ids",
        join_ids(.golden_ids),
        join_ids(.ids)
    )]
    GoldenOtherIds {
        golden: String,
        golden_ids: Vec<u32>,
        ids: Vec<u32>,
    },
    #[error("golden {0}: no such folder or .npz trace")]
    GoldenMissing(String),
    #[error("nothing to compare: one backend and no golden")]
    NothingToCompare,
    #[error(
        "--steps {steps}: golden {golden} has only {has} decode steps (make a longer one with `parity golden --steps {steps}`)"
    )]
    StepsPastGolden {
        steps: usize,
        golden: String,
        has: usize,
    },
    /// A run over the trace budget, said in one line (`arch::size::over_budget`).
    #[error("{0}")]
    OverBudget(String),
    #[error("no backend to run (give --backends)")]
    NoBackend,
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(transparent)]
    Compare(#[from] CompareError),
    #[error(transparent)]
    Judge(#[from] crate::judge::JudgeError),
    #[error("a temporary folder for the zoom golden: {0}")]
    ZoomFolder(std::io::Error),
}

/// Ids as text: `1 388 268`.
fn join_ids(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// What a check runs and where it looks for goldens.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// Registry names (`backend::registry`), run in this order; the first one's greedy
    /// continuation is forced into the others when there is no golden.
    pub backends: Vec<String>,
    /// Threads for backends with their own pool (0 = all cores).
    pub threads: usize,
    /// Decode steps (None: as many as the golden has, else 4). More than the golden has is
    /// refused rather than silently capped.
    pub steps: Option<usize>,
    /// Also run each replayable backend op by op on a tight golden's inputs.
    pub op_by_op: bool,
    /// A golden folder given explicitly: it must be for this model (and these ids).
    pub golden: Option<PathBuf>,
    /// Folders searched, in order, for a golden whose model sha256 matches.
    pub golden_dirs: Vec<PathBuf>,
    /// Prompt ids given by the user (None: take them from the golden).
    pub prompt: Option<Vec<u32>>,
    /// The default set: a device backend (gpu) runs only on a hardware adapter it can build,
    /// else it is left out with a note instead of failing the check; against a scan golden
    /// the plain references are left out (`against_a_scan`).
    pub device_optional: bool,
    /// The largest trace one pass may hold, in bytes (`arch::size::DEFAULT_BUDGET`): a run
    /// over it is refused before any pass starts.
    pub max_trace_size: u64,
}

/// What a check is doing, for progress displays.
pub enum Event {
    /// A backend pass starts: `forwards` forward calls (prefill + decode steps) follow.
    PassStart {
        backend: String,
        op_by_op: bool,
        forwards: usize,
    },
    /// One forward call (prefill or decode step) finished.
    Forward,
    PassEnd,
    /// Comparing starts: `n` comparisons.
    Comparing {
        n: usize,
    },
    Compared,
    /// A scan golden's check diverged at `step`: llama.cpp runs again with that step recorded
    /// whole (`record`, the plan).
    Zooming {
        step: usize,
        record: String,
    },
}

/// One backend run: its time and the process's peak resident memory after it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Pass {
    pub backend: String,
    pub op_by_op: bool,
    pub seconds: f64,
    pub peak_rss_bytes: Option<u64>,
}

/// One comparison and its role in the report.
pub struct Judged {
    pub comparison: Comparison,
    /// Against the llama.cpp golden (as opposed to between two backends).
    pub against_golden: bool,
}

pub struct CheckReport {
    pub prompt: Vec<u32>,
    /// Decode ids every backend was fed.
    pub forced: Vec<u32>,
    /// Where the prompt ids came from, in words.
    pub ids_from: String,
    pub golden: Option<(PathBuf, Trace)>,
    /// The end-to-end traces, one per backend, then the op-by-op ones.
    pub traces: Vec<Trace>,
    pub traces_op: Vec<Trace>,
    pub comparisons: Vec<Judged>,
    pub passes: Vec<Pass>,
    /// What the backends said about themselves (the GPU they ran on, weights dequantized at
    /// load), and the backends left out (no GPU adapter: not checked).
    pub notes: Vec<String>,
}

impl CheckReport {
    pub fn diverged(&self) -> bool {
        self.comparisons.iter().any(|j| j.comparison.diverged())
    }
}

/// A llama.cpp golden made with the tight settings (F32 KV cache, no flash attention).
pub fn golden_is_tight(g: &Trace) -> bool {
    let s = &g.manifest.producer.settings;
    let kv_f32 = s
        .get("type_k")
        .and_then(|v| v.as_str())
        .is_none_or(|k| k == "f32");
    let no_fa = s
        .get("flash_attn")
        .is_none_or(|v| v.as_bool() == Some(false) || v.as_str() == Some("disabled"));
    kv_f32 && no_fa
}

/// Where a llama.cpp golden was computed, from its manifest's provenance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GoldenDevice {
    /// ggml's CPU backend: activations rounded to Q8_0/Q8_1/Q8_K/f16 as parity's
    /// `ggml-cpu` emulation does.
    Cpu,
    /// A GPU backend (Vulkan, CUDA, Metal, …; the name as the manifest gives it): other
    /// activation roundings (Q8_1 integer dots, f16 tiles), never parity's same-rounding pair.
    Gpu(String),
}

/// The device a llama.cpp golden ran on: its producer backend (`llama.cpp-cpu`,
/// `llama.cpp-vulkan`, …) and, when scripts/llama_golden.py recorded it, the layers it
/// offloaded (`n_gpu_layers` > 0 is a GPU golden whatever the backend name says).
pub fn golden_device(g: &Trace) -> GoldenDevice {
    let p = &g.manifest.producer;
    let offloaded = p
        .settings
        .get("n_gpu_layers")
        .and_then(|v| v.as_i64())
        .is_some_and(|n| n != 0);
    let name = p.backend.strip_prefix("llama.cpp-").unwrap_or(&p.backend);
    if name == "cpu" && !offloaded {
        GoldenDevice::Cpu
    } else if name == "cpu" {
        GoldenDevice::Gpu("offloaded".into())
    } else {
        GoldenDevice::Gpu(name.to_string())
    }
}

/// A llama.cpp golden that rounds as parity's `ggml-cpu` backends do: computed on the CPU with
/// the tight settings. Only such a golden holds them to same-rounding and op-by-op thresholds;
/// a GPU golden is compared end to end as a different rounding (its logits against the
/// depth-aware bound), its own backends never held to the CPU's arithmetic.
pub fn golden_is_ggml_cpu(g: &Trace) -> bool {
    golden_device(g) == GoldenDevice::Cpu && golden_is_tight(g)
}

/// A golden recorded to a plan that leaves taps out (a scan, `golden --record`): it cannot feed
/// every op its inputs, so its own ops are judged as spans on its own inputs instead.
pub fn golden_is_scan(g: &Trace) -> bool {
    scan_plan(g).is_some_and(|r| !r.keeps_all())
}

/// The recording plan a golden was made to (None: every tap, or a plan parity cannot read).
fn scan_plan(g: &Trace) -> Option<crate::trace::Record> {
    g.manifest
        .record
        .as_deref()
        .and_then(|r| crate::trace::Record::parse(r).ok())
}

/// The steps a scan golden keeps whole (a zoom's): there every op has its inputs.
fn whole_steps(g: &Trace) -> Vec<usize> {
    let Some(r) = scan_plan(g).filter(|r| !r.keeps_all()) else {
        return Vec::new();
    };
    g.manifest
        .steps
        .iter()
        .map(|s| s.step)
        .filter(|&s| r.full_step(s))
        .collect()
}

/// An op-by-op trace against a scan golden keeps only the steps (and at them the layers) the
/// golden has whole: elsewhere its taps are spans of ops computed from the golden's, not ops.
fn op_by_op_steps(
    plan: &Plan,
    tensors: std::collections::BTreeMap<TapKey, ndarray::ArrayD<f32>>,
) -> std::collections::BTreeMap<TapKey, ndarray::ArrayD<f32>> {
    match &plan.record {
        Some(r) => tensors
            .into_iter()
            .filter(|(k, _)| r.whole_at(k.step, k.layer))
            .collect(),
        None => tensors,
    }
}

/// How two traces made or read by this check round activations. Only what the check knows
/// counts: a golden made by llama.cpp's CPU with the tight settings, and parity's own
/// backends by their registry row; never a name an external trace gives itself.
fn pair_kind(a: &Trace, b: &Trace) -> PairKind {
    pair_of(trace_rounding(a), trace_rounding(b))
}

/// [`pair_kind`] of `golden` and the trace of a backend that rounds as `rounding` does.
fn pair_kind_of(golden: &Trace, rounding: backend::Emulation) -> PairKind {
    pair_of(trace_rounding(golden), Some(rounding))
}

/// The activation rounding a trace was made with, where known: a tight llama.cpp CPU golden
/// rounds as ggml's CPU does (a GPU golden's is not known); parity's backends state theirs
/// (gpu and reference: plain f32).
fn trace_rounding(t: &Trace) -> Option<backend::Emulation> {
    match t.manifest.producer.name.as_str() {
        "llama.cpp" => golden_is_ggml_cpu(t).then_some(backend::Emulation::GgmlCpu),
        "parity" => registry::find(&t.manifest.producer.backend)
            .ok()
            .map(|e| e.rounding),
        _ => None,
    }
}

fn pair_of(a: Option<backend::Emulation>, b: Option<backend::Emulation>) -> PairKind {
    match (a, b) {
        (Some(x), Some(y)) if x == y => PairKind::SameRounding,
        _ => PairKind::DifferentRounding,
    }
}

/// Hand the heap this process freed back to the system: between passes, so that one pass's
/// freed temporaries do not stay resident under the next one's (glibc keeps them per thread).
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's own.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Peak resident set size of this process so far (Linux: getrusage's ru_maxrss in KiB).
pub fn peak_rss_bytes() -> Option<u64> {
    #[cfg(unix)]
    {
        // SAFETY: getrusage writes into the struct we pass and nothing else.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } == 0 {
            let kib = ru.ru_maxrss.max(0) as u64;
            return Some(if cfg!(target_os = "macos") {
                kib
            } else {
                kib * 1024
            });
        }
    }
    None
}

/// Run the check, in its stages: the backends, the golden and the ids, the steps and the
/// context, the end-to-end passes, the op-by-op passes, the comparisons. `events` hears about progress (pass
/// `&mut |_| {}` for none).
pub fn run(
    model: &Model,
    model_path: &Path,
    opt: &CheckOptions,
    events: &mut dyn FnMut(Event),
) -> Result<CheckReport, CheckError> {
    // One golden named, made from a file of this size: the sha256 it names stands in for the
    // model's while the model's own hash (2 s for a 7B, serial) runs beside the passes; the
    // two are compared before anything, result or error, is returned. Any other golden (a
    // size that differs is another model, refused at once) waits for the hash, and so does a
    // file larger than half of memory (its hash and the passes would both read it from disk).
    let named = opt
        .golden
        .as_deref()
        .filter(|_| !model.sha256_known() && !model.releases_layers())
        .and_then(|g| named_golden_sha(g, model.file.bytes().len() as u64));
    let Some(named) = named else {
        return run_with(model, model_path, opt, model.sha256(), events);
    };
    std::thread::scope(|s| {
        let hashing = s.spawn(|| {
            model.sha256();
        });
        let r = run_with(model, model_path, opt, &named, events);
        if hashing.join().is_err() {
            // Only a panic inside the hash; hashed again here, where it would surface.
            model.sha256();
        }
        if model.sha256() != named {
            let short = |s: &str| s.chars().take(12).collect::<String>();
            return Err(CheckError::GoldenOtherModel {
                golden: opt.golden.as_ref().expect("named").display().to_string(),
                golden_sha: short(&named),
                model: model_path.display().to_string(),
                sha: short(model.sha256()),
            });
        }
        r
    })
}

/// The sha256 a golden named by its own path (a folder with a manifest, or an `.npz`) says
/// it was made from, when it reads as one and names a file of `size` bytes.
fn named_golden_sha(dir: &Path, size: u64) -> Option<String> {
    let one =
        dir.join("manifest.json").exists() || (dir.is_file() && crate::trace::is_archive_path(dir));
    let m = Trace::open(dir).ok().filter(|_| one)?.manifest.model;
    let hex = m.sha256.len() == 64 && m.sha256.bytes().all(|b| b.is_ascii_hexdigit());
    (hex && m.size == Some(size)).then_some(m.sha256)
}

/// [`run`] with the model's sha256 (or the named golden's, while the model's is hashed).
fn run_with(
    model: &Model,
    model_path: &Path,
    opt: &CheckOptions,
    sha: &str,
    events: &mut dyn FnMut(Event),
) -> Result<CheckReport, CheckError> {
    let entries = backends(opt)?;
    let (golden, prompt, golden_forced, ids_from) = select_golden(model_path, sha, opt)?;
    let plan = plan(model, model_path, sha, opt, &golden, prompt, &golden_forced)?;
    let mut notes = Vec::new();
    let entries = with_devices(&plan, entries, opt, &mut notes)?;
    let entries = against_a_scan(entries, golden.as_ref(), opt, &mut notes);
    let mut passes = Vec::new();
    let op_entries = op_entries(&entries, golden.as_ref(), opt, &mut notes)?;
    let mut ledger = Ledger::new(
        model,
        golden.as_ref().map(|(_, g)| g),
        &entries,
        &op_entries,
    )?;
    walk(
        &plan,
        &entries,
        &op_entries,
        &golden_forced,
        &mut ledger,
        &mut passes,
        events,
    )?;
    let forced = end_to_end(
        &plan,
        &entries,
        &golden_forced,
        &mut ledger,
        &mut passes,
        &mut notes,
        events,
    )?;
    op_by_op(
        &plan,
        &op_entries,
        golden.as_ref(),
        &mut ledger,
        &mut passes,
        events,
    )?;
    // The weights are done with: their pages leave this process (they stay in the page cache)
    // before the golden's own ops are judged.
    model.file.release_range(0, usize::MAX);
    let (mut comparisons, traces, traces_op) = ledger.finish();
    if opt.op_by_op
        && let Some(g) = golden
            .as_ref()
            .filter(|(_, g)| !golden_is_ggml_cpu(g) || golden_is_scan(g))
    {
        comparisons.insert(0, judge_golden(model, g)?);
    }
    Ok(CheckReport {
        prompt: plan.prompt,
        forced,
        ids_from,
        golden,
        traces,
        traces_op,
        comparisons,
        passes,
        notes,
    })
}

/// Stage 3b: in the default set (`device_optional`), a device backend (gpu) runs only on a
/// hardware adapter: without one, or with only a device that runs on the CPU (lavapipe: the
/// same check takes minutes and proves nothing about a GPU), it is left out with a note that
/// says how to include it. Asked for by name, it runs wherever it can, and fails without a
/// device.
fn with_devices<'e>(
    plan: &Plan,
    entries: Vec<&'e registry::Entry>,
    opt: &CheckOptions,
    notes: &mut Vec<String>,
) -> Result<Vec<&'e registry::Entry>, CheckError> {
    if !opt.device_optional {
        return Ok(entries);
    }
    let mut kept = Vec::new();
    for e in entries {
        if let Some(probe) = e.probe {
            match probe() {
                registry::Probe::Hardware(_) => {}
                registry::Probe::Missing(why) => {
                    notes.push(format!("{}: not checked — {why}", e.name));
                    continue;
                }
                registry::Probe::Software(name) => {
                    let all: Vec<&str> = opt.backends.iter().map(String::as_str).collect();
                    notes.push(format!(
                        "{}: not checked — the only GPU adapter ({}) runs on the CPU; `--backends {}` includes it",
                        e.name,
                        crate::report::shown::shown(&name),
                        all.join(",")
                    ));
                    continue;
                }
            }
        }
        if e.device
            && let Err(err) = e.build(plan.model, plan.n_ctx, plan.threads)
        {
            notes.push(format!("{}: not checked — {err}", e.name));
            continue;
        }
        kept.push(e);
    }
    if kept.is_empty() {
        return Err(CheckError::NoBackend);
    }
    Ok(kept)
}

/// Stage 3c: against a scan golden (no step kept whole), the default set runs the plain
/// references (`lockstep`) nowhere: the golden's own ops are judged with the reference's
/// arithmetic on its own inputs at every step (`judge_golden`), which is what their
/// end-to-end passes would add, and those passes are f64 forwards of every position (over
/// an hour for 2,048 prompt ids on a 1.1B model). The others (fast) run end to end, as
/// quick as llama.cpp. A zoom golden (a step whole) keeps them: they run op by op there.
fn against_a_scan<'e>(
    entries: Vec<&'e registry::Entry>,
    golden: Option<&(PathBuf, Trace)>,
    opt: &CheckOptions,
    notes: &mut Vec<String>,
) -> Vec<&'e registry::Entry> {
    let scan = golden.is_some_and(|(_, g)| golden_is_scan(g) && whole_steps(g).is_empty());
    if !(scan && opt.device_optional && opt.op_by_op) || entries.iter().all(|e| e.lockstep) {
        return entries;
    }
    let (left, kept): (Vec<_>, Vec<_>) = entries.into_iter().partition(|e| e.lockstep);
    if !left.is_empty() {
        let names: Vec<&str> = left.iter().map(|e| e.name).collect();
        let all: Vec<&str> = left.iter().chain(&kept).map(|e| e.name).collect();
        notes.push(format!(
            "{}: not run end to end against a scan golden — the golden's own ops are judged \
             with the reference's arithmetic on its inputs at every step instead; `--backends {}` \
             runs them too",
            names.join(", "),
            all.join(",")
        ));
    }
    kept
}

/// Stage 1: the registry rows of the backends asked for, in order.
fn backends(opt: &CheckOptions) -> Result<Vec<&'static registry::Entry>, CheckError> {
    if opt.backends.is_empty() {
        return Err(CheckError::NoBackend);
    }
    Ok(opt
        .backends
        .iter()
        .map(|n| registry::find(n))
        .collect::<Result<Vec<_>, _>>()?)
}

/// The golden (if any), the prompt ids, the golden's decode ids, and where the ids came from.
type Selected = (Option<(PathBuf, Trace)>, Vec<u32>, Vec<u32>, String);

/// Stage 2: settle the golden and the ids.
fn select_golden(model_path: &Path, sha: &str, opt: &CheckOptions) -> Result<Selected, CheckError> {
    let sha = sha.to_string();
    let short = |s: &str| s.chars().take(12).collect::<String>();
    let mut goldens = match &opt.golden {
        Some(dir) => {
            let one = dir.join("manifest.json").exists()
                || (dir.is_file() && crate::trace::is_archive_path(dir));
            if !dir.is_dir() && !one {
                return Err(CheckError::GoldenMissing(dir.display().to_string()));
            }
            let found = goldens::find(dir, &sha)?;
            if one {
                let g = &found[0].1;
                if g.manifest.model.sha256 != sha {
                    return Err(CheckError::GoldenOtherModel {
                        golden: dir.display().to_string(),
                        golden_sha: short(&g.manifest.model.sha256),
                        model: model_path.display().to_string(),
                        sha: short(&sha),
                    });
                }
            }
            found
        }
        None => goldens::find_first(&opt.golden_dirs, &sha)?,
    };
    let searched = || match &opt.golden {
        Some(d) => d.display().to_string(),
        None => opt
            .golden_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    };
    let prompt_of = |g: &Trace| {
        g.manifest
            .steps
            .first()
            .map(|s| s.tokens.clone())
            .unwrap_or_default()
    };
    match &opt.prompt {
        Some(ids) => {
            let all = goldens.len();
            goldens.retain(|(_, g)| &prompt_of(g) == ids);
            if let Some(dir) = opt
                .golden
                .as_ref()
                .filter(|_| goldens.is_empty() && all == 1)
            {
                let g = &goldens::find(dir, &sha)?[0];
                return Err(CheckError::GoldenOtherIds {
                    golden: g.0.display().to_string(),
                    golden_ids: prompt_of(&g.1),
                    ids: ids.clone(),
                });
            }
            let golden = goldens.into_iter().next();
            let forced = golden
                .as_ref()
                .map(|(_, g)| g.manifest.decode_tokens())
                .unwrap_or_default();
            Ok((golden, ids.clone(), forced, "given".into()))
        }
        None => match goldens.into_iter().next() {
            Some((p, g)) => {
                let (ids, forced) = (prompt_of(&g), g.manifest.decode_tokens());
                Ok((Some((p, g)), ids, forced, "from the golden".into()))
            }
            None => Err(CheckError::NoGolden {
                model: model_path.display().to_string(),
                sha: short(&sha),
                searched: searched(),
            }),
        },
    }
}

/// What every pass runs: the model, the prompt, the decode steps and the context the
/// backends hold.
struct Plan<'m> {
    model: &'m Model,
    model_ref: ModelRef,
    prompt: Vec<u32>,
    steps: usize,
    /// The golden's steps after the first, where one holds more than one token (a prompt fed
    /// in chunks, a further turn): every backend is fed them step by step, as the golden was.
    later: Option<Vec<Vec<u32>>>,
    n_ctx: usize,
    threads: usize,
    /// A golden exists: its decode ids are forced into every backend.
    has_golden: bool,
    /// A scan golden's recording plan (`golden --record`): every pass keeps only what it
    /// keeps, so a long check holds a scan's memory, not every tap of every step.
    record: Option<crate::trace::Record>,
}

/// Stage 3: the steps and the context, refused when the golden cannot cover them or the
/// model cannot hold them.
fn plan<'m>(
    model: &'m Model,
    model_path: &Path,
    sha: &str,
    opt: &CheckOptions,
    golden: &Option<(PathBuf, Trace)>,
    prompt: Vec<u32>,
    golden_forced: &[u32],
) -> Result<Plan<'m>, CheckError> {
    if prompt.is_empty() {
        return Err(BackendError::Empty.into());
    }
    // A golden whose later steps are not all one token is fed step by step.
    let mut later: Option<Vec<Vec<u32>>> = golden.as_ref().and_then(|(_, g)| {
        let s: Vec<Vec<u32>> = g.manifest.steps[1..]
            .iter()
            .map(|s| s.tokens.clone())
            .collect();
        s.iter().any(|t| t.len() != 1).then_some(s)
    });
    let has = later.as_ref().map_or(golden_forced.len(), |l| l.len());
    // Steps: the golden's, or fewer if asked; more than it has cannot be compared.
    let steps = match (golden, opt.steps) {
        (Some((p, _)), Some(n)) if n > has => {
            return Err(CheckError::StepsPastGolden {
                steps: n,
                golden: p.display().to_string(),
                has,
            });
        }
        (Some(_), n) => n.unwrap_or(has),
        (None, n) => n.unwrap_or(4),
    };
    if let Some(l) = &mut later {
        l.truncate(steps);
    }
    // Each pass holds its trace in memory: refused before any runs when one is over budget.
    let run: Vec<(usize, usize)> = match &later {
        Some(l) => crate::arch::size::fed_steps(
            std::iter::once(prompt.len()).chain(l.iter().map(Vec::len)),
        ),
        None => crate::arch::size::golden_feed(prompt.len(), 0, steps, &[]),
    };
    let record = golden
        .as_ref()
        .filter(|(_, g)| golden_is_scan(g))
        .and_then(|(_, g)| g.manifest.record.as_deref())
        .and_then(|r| crate::trace::Record::parse(r).ok());
    let (bytes, probs) = crate::arch::size::trace_bytes(
        &model.config,
        &run,
        &|k| {
            record
                .as_ref()
                .is_none_or(|r| r.keeps(k.step, k.layer, k.tap))
        },
        record.as_ref(),
    );
    if let Some(msg) = crate::arch::size::over_budget(
        "each trace this check holds in memory",
        bytes,
        probs,
        opt.max_trace_size,
        "check fewer positions (a shorter prompt, fewer --steps), or against a scan golden (golden --record 'taps=l_out,result_norm,logits'): the check then keeps only its taps",
    ) {
        return Err(CheckError::OverBudget(msg));
    }
    let n_ctx = prompt.len()
        + later
            .as_ref()
            .map_or(steps, |l| l.iter().map(Vec::len).sum());
    if n_ctx > model.config.n_ctx_train {
        return Err(BackendError::ContextOverflow {
            end: n_ctx,
            n_ctx: model.config.n_ctx_train,
        }
        .into());
    }
    // Backends hold the context the golden's engine held (at least the run): a LongRoPE model
    // picks its RoPE factors by it, as llama.cpp does.
    let n_ctx = golden
        .as_ref()
        .and_then(|(_, g)| g.manifest.producer.settings.get("n_ctx")?.as_u64())
        .map_or(n_ctx, |g| {
            (g as usize).clamp(n_ctx, model.config.n_ctx_train.max(n_ctx))
        });
    Ok(Plan {
        model,
        model_ref: ModelRef {
            path: model_path.display().to_string(),
            sha256: sha.to_string(),
            size: Some(model.file.bytes().len() as u64),
        },
        prompt,
        steps,
        later,
        n_ctx,
        threads: opt.threads,
        has_golden: golden.is_some(),
        record,
    })
}

impl Plan<'_> {
    /// A pass's trace of this plan's model, held in memory.
    fn trace(
        &self,
        producer: Producer,
        steps: Vec<StepInfo>,
        tensors: std::collections::BTreeMap<TapKey, ndarray::ArrayD<f32>>,
    ) -> Trace {
        Trace::from_memory(self.model_ref.clone(), producer, steps, tensors)
    }

    /// Run the plan's steps on `b`: the golden's step by step where it has steps of several
    /// tokens, else the prompt and one-token decode steps (`forced`, else greedy).
    fn feed(
        &self,
        b: &mut dyn backend::Backend,
        forced: Option<&[u32]>,
        sink: &mut dyn Sink,
    ) -> Result<Vec<StepInfo>, BackendError> {
        match &self.later {
            Some(l) => backend::run_steps(b, &self.prompt, l, sink),
            None => backend::run(b, &self.prompt, self.steps, forced, sink),
        }
    }

    /// One backend pass into `sink`: its trace parts, the sink back, and its time and memory.
    fn pass<S: Sink>(
        &self,
        e: &registry::Entry,
        op_by_op: bool,
        sink: S,
        forced: Option<&[u32]>,
        events: &mut dyn FnMut(Event),
    ) -> Result<Ran<S>, CheckError> {
        events(Event::PassStart {
            backend: e.name.to_string(),
            op_by_op,
            forwards: self.steps + 1,
        });
        let t0 = Instant::now();
        let mut b = e.build(self.model, self.n_ctx, self.threads)?;
        let mut sink = sink;
        let info = self.feed(
            b.as_mut(),
            forced,
            &mut Counting {
                inner: &mut sink,
                events: &mut *events,
            },
        )?;
        let notes = b.notes();
        events(Event::PassEnd);
        let producer = Producer {
            name: "parity".into(),
            backend: format!("{}{}", b.name(), if op_by_op { "/op-by-op" } else { "" }),
            version: env!("CARGO_PKG_VERSION").into(),
            settings: serde_json::json!({ "rounding": b.rounding().name() }),
        };
        drop(b);
        trim_heap();
        let pass = Pass {
            backend: e.name.into(),
            op_by_op,
            seconds: t0.elapsed().as_secs_f64(),
            peak_rss_bytes: peak_rss_bytes(),
        };
        Ok(Ran {
            info,
            sink,
            producer,
            pass,
            notes,
        })
    }
}

/// One backend pass done: its steps, its sink, who produced it, its time, what it noted.
struct Ran<S> {
    info: Vec<StepInfo>,
    sink: S,
    producer: Producer,
    pass: Pass,
    notes: Vec<String>,
}

/// Stage 4: every backend end to end, each recording every tap. One sequence for every
/// backend: the golden's ids, else the first backend's own greedy continuation forced into
/// the others (their greedy agreement is a statistic of the logits comparison, never a
/// divergence of its own). Returns the traces and the decode ids fed.
fn end_to_end(
    plan: &Plan,
    entries: &[&registry::Entry],
    golden_forced: &[u32],
    ledger: &mut Ledger,
    passes: &mut Vec<Pass>,
    notes: &mut Vec<String>,
    events: &mut dyn FnMut(Event),
) -> Result<Vec<u32>, CheckError> {
    let mut forced: Option<Vec<u32>> = plan
        .has_golden
        .then(|| golden_forced[..plan.steps.min(golden_forced.len())].to_vec());
    for (i, e) in entries.iter().enumerate() {
        // Made by the walk: its ids lead where it came first.
        if let Some(t) = ledger.trace(Side::E2e(i)) {
            if forced.is_none() {
                forced = Some(decode_ids(&t.manifest.steps));
            }
            continue;
        }
        let filter = TapFilter::all().with_record(plan.record.clone());
        // Compared only with the golden: compared as it records, never held whole.
        if let Some((k, golden)) = ledger.golden_only(Side::E2e(i)) {
            let opt = CompareOptions {
                pair: pair_kind_of(golden, e.rounding),
                weight_type: ledger.weight_type,
                require_same_model: true,
            };
            let sink = crate::compare::Streamed::new(golden, opt, filter);
            let ran = plan.pass(e, false, sink, forced.as_deref(), events)?;
            book(&mut forced, notes, passes, &ran.info, ran.notes, ran.pass);
            events(Event::Comparing { n: 1 });
            let (trace, compared) = ran
                .sink
                .finish(plan.model_ref.clone(), ran.producer, ran.info);
            debug_assert_eq!(pair_kind(golden, &trace), pair_kind_of(golden, e.rounding));
            ledger.put_compared(Side::E2e(i), trace, k, compared?);
            events(Event::Compared);
            ledger.settle(events)?;
            continue;
        }
        let sink = MemorySink::new(filter);
        let ran = plan.pass(e, false, sink, forced.as_deref(), events)?;
        book(&mut forced, notes, passes, &ran.info, ran.notes, ran.pass);
        ledger.put(
            Side::E2e(i),
            plan.trace(ran.producer, ran.info, ran.sink.tensors)
                .with_cuts(ran.sink.cuts),
        );
        ledger.settle(events)?;
    }
    Ok(forced.unwrap_or_default())
}

/// An end-to-end pass entered in the check's books: its decode ids lead where none did yet,
/// its notes are added (each once), its time and memory listed.
fn book(
    forced: &mut Option<Vec<u32>>,
    notes: &mut Vec<String>,
    passes: &mut Vec<Pass>,
    info: &[StepInfo],
    new: Vec<String>,
    pass: Pass,
) {
    if forced.is_none() {
        *forced = Some(decode_ids(info));
    }
    for n in new {
        if !notes.contains(&n) {
            notes.push(n);
        }
    }
    passes.push(pass);
}

/// The ids fed at the decode steps of a run.
fn decode_ids(steps: &[StepInfo]) -> Vec<u32> {
    steps
        .iter()
        .skip(1)
        .flat_map(|s| s.tokens.clone())
        .collect()
}

/// Stage 5a: which backends run op by op: each replayable backend that rounds like ggml's CPU,
/// when the golden is a CPU one and op by op was not turned off; with a device backend (gpu,
/// f32 activations), the plain reference too (the device is judged against it, both fed the
/// golden's inputs: the golden's own ops round activations as ggml's CPU does, the gpu does
/// not).
fn op_entries<'e>(
    entries: &[&'e registry::Entry],
    golden: Option<&(PathBuf, Trace)>,
    opt: &CheckOptions,
    notes: &mut Vec<String>,
) -> Result<Vec<&'e registry::Entry>, CheckError> {
    // Op by op replays a golden's tensors through ggml-cpu arithmetic: only a CPU golden's.
    if let Some((_, g)) = golden.filter(|_| opt.op_by_op)
        && let GoldenDevice::Gpu(dev) = golden_device(g)
    {
        notes.push(format!(
            "op by op: the golden ran on llama.cpp's {dev} backend, whose ops round unlike \
             ggml's CPU: parity's backends are compared with it end to end, as a different \
             rounding, and its own ops are judged on its own inputs under its measured rounding, \
             as `parity diff` judges an engine"
        ));
    }
    if let Some((_, g)) = golden.filter(|(_, g)| opt.op_by_op && golden_is_scan(g)) {
        // The plan as parity writes it, never the file's own text.
        let plan = scan_plan(g).map(|r| r.to_string()).unwrap_or_default();
        let whole = whole_steps(g);
        let cpu = golden_is_ggml_cpu(g);
        if whole.is_empty() || !cpu {
            // Op by op needs a tight CPU golden: for any other, whole steps would not help.
            let at_whole = if cpu {
                "; parity's backends are compared op by op only at a step the golden keeps \
                 whole (--record '…;full=S', as check's zoom records it)"
            } else {
                ""
            };
            notes.push(format!(
                "op by op: the golden is a scan (recorded to '{plan}'): it has not every op's \
                 inputs, so parity's backends keep only its taps and are compared with it end to \
                 end, and its own ops are judged on its own inputs (as spans where it has no taps \
                 inside){at_whole}"
            ));
            return Ok(Vec::new());
        }
        // A zoom golden: its whole steps feed every op its inputs (the K/V of the steps before
        // them too: the plan keeps k_rope and v at every step).
        let steps: Vec<String> = whole.iter().map(usize::to_string).collect();
        notes.push(format!(
            "op by op: the golden is a scan (recorded to '{plan}') with step{} {} whole: \
             parity's backends are compared with it op by op there, fed its tensors, and end to \
             end at every step",
            if whole.len() > 1 { "s" } else { "" },
            steps.join(", ")
        ));
    }
    if golden.is_none_or(|(_, g)| !opt.op_by_op || !golden_is_ggml_cpu(g)) {
        return Ok(Vec::new());
    }
    let mut op_entries: Vec<&registry::Entry> = entries
        .iter()
        .copied()
        .filter(|e| e.replayable && e.rounding == backend::Emulation::GgmlCpu)
        .collect();
    let devices: Vec<&registry::Entry> = entries
        .iter()
        .copied()
        .filter(|e| e.replayable && e.device)
        .collect();
    if !devices.is_empty() {
        op_entries.push(registry::find("reference")?);
        op_entries.extend(devices);
    }
    Ok(op_entries)
}

/// Stage 6b: a golden that is not a tight CPU one (a GPU's, or one made with an f16 or
/// quantized K/V cache or flash attention) cannot feed parity's backends op by op, and end to
/// end its own rounding hides a small bug under the tolerances between roundings; so its own
/// ops are judged on its own inputs, under its own cache, as `parity diff` judges an engine
/// (the same library call). A golden with a bug fails the check, the bug placed and named.
fn judge_golden(model: &Model, golden: &(PathBuf, Trace)) -> Result<Judged, CheckError> {
    let g = &golden.1;
    let mut opt = crate::judge::verdict::DiffOptions::new(model.main_weight_type());
    if golden_is_ggml_cpu(g) {
        // A tight CPU golden rounds as ggml's CPU does: nothing to measure (nine families
        // replayed, the f16-accumulating ones in scalar f16 sums: most of a long scan's time).
        // Its tie twins are still tried, as for any engine.
        opt.judge.roundings = vec![backend::Emulation::GgmlCpu];
    }
    // Against itself end to end: the verdict is the judgement's alone, and its comparison
    // diverges exactly when it does.
    let d = crate::judge::verdict::diff(g, g, Some(model), &opt)?;
    let c = d.own.expect("judged with the model");
    Ok(Judged {
        comparison: c,
        against_golden: true,
    })
}

/// Stage 4: the reference passes, end to end and op by op, in one walk of the weights
/// (`Lockstep`): each weight row decoded once for all of them, every member computing what it
/// computes alone. They share the ids: the golden's, or (without one) the first backend's
/// greedy continuation, so the walk leads only when a reference is the first backend.
fn walk(
    plan: &Plan,
    entries: &[&registry::Entry],
    op_entries: &[&registry::Entry],
    golden_forced: &[u32],
    ledger: &mut Ledger,
    passes: &mut Vec<Pass>,
    events: &mut dyn FnMut(Event),
) -> Result<(), CheckError> {
    let golden = ledger.golden;
    let e2e: Vec<&registry::Entry> = entries.iter().copied().filter(|e| e.lockstep).collect();
    let op: Vec<&registry::Entry> = op_entries.iter().copied().filter(|e| e.lockstep).collect();
    let leads = plan.has_golden || entries.first().is_some_and(|e| e.lockstep);
    if !leads || e2e.len() + op.len() < 2 {
        return Ok(());
    }
    let members: Vec<(&registry::Entry, bool)> = e2e
        .iter()
        .map(|&e| (e, false))
        .chain(op.iter().map(|&e| (e, true)))
        .collect();
    let label: Vec<String> = members
        .iter()
        .map(|(e, o)| format!("{}{}", e.name, if *o { " op by op" } else { "" }))
        .collect();
    let label = format!("{} (one walk of the weights)", label.join(" + "));
    events(Event::PassStart {
        backend: label.clone(),
        op_by_op: false,
        forwards: plan.steps + 1,
    });
    let t0 = Instant::now();
    let roundings: Vec<backend::Emulation> = members.iter().map(|(e, _)| e.rounding).collect();
    let mut b = Lockstep::new(plan.model, &roundings, plan.n_ctx);
    let forced = plan
        .has_golden
        .then(|| golden_forced[..plan.steps.min(golden_forced.len())].to_vec());
    let mut mem: Vec<MemorySink> = e2e
        .iter()
        .map(|_| MemorySink::new(TapFilter::all().with_record(plan.record.clone())))
        .collect();
    let mut replay: Vec<ReplaySink> = match golden {
        Some(g) => op.iter().map(|_| ReplaySink::new(g)).collect(),
        None => Vec::new(),
    };
    let info = {
        let mut sinks = mem
            .iter_mut()
            .map(|s| s as &mut dyn Sink)
            .chain(replay.iter_mut().map(|s| s as &mut dyn Sink));
        // The first member's forwards tick the progress bar.
        let first = sinks.next().expect("two members at least");
        let mut first = Counting {
            inner: first,
            events: &mut *events,
        };
        let mut fanout = Fanout {
            sinks: std::iter::once(&mut first as &mut dyn Sink)
                .chain(sinks)
                .collect(),
        };
        plan.feed(&mut b, forced.as_deref(), &mut fanout)?
    };
    events(Event::PassEnd);
    drop(b);
    trim_heap();
    passes.push(Pass {
        backend: label,
        op_by_op: false,
        seconds: t0.elapsed().as_secs_f64(),
        peak_rss_bytes: peak_rss_bytes(),
    });
    let trace = |(e, o): (&registry::Entry, bool), tensors| {
        let producer = Producer {
            name: "parity".into(),
            backend: format!("{}{}", e.name, if o { "/op-by-op" } else { "" }),
            version: env!("CARGO_PKG_VERSION").into(),
            settings: serde_json::json!({ "rounding": e.rounding.name() }),
        };
        plan.trace(producer, info.clone(), tensors)
    };
    let index = |list: &[&registry::Entry], e: &registry::Entry| {
        list.iter()
            .position(|x| x.name == e.name)
            .expect("a member is one of the entries")
    };
    for (m, s) in members.iter().take(e2e.len()).zip(mem) {
        let t = trace(*m, s.tensors).with_cuts(s.cuts);
        ledger.put(Side::E2e(index(entries, m.0)), t);
    }
    for (m, s) in members.iter().skip(e2e.len()).zip(replay) {
        if let Some(err) = s.error {
            return Err(err.into());
        }
        let tensors = op_by_op_steps(plan, s.inner.tensors);
        let t = trace(*m, tensors).with_cuts(s.inner.cuts);
        ledger.put(Side::Op(index(op_entries, m.0)), t);
    }
    ledger.settle(events)
}

/// Stage 5: op by op, each of `op_entries` fed a tight golden's tensor at every tap
/// (ReplaySink), so each op is judged on identical inputs; a device backend is judged against
/// the plain reference fed them too.
fn op_by_op(
    plan: &Plan,
    op_entries: &[&registry::Entry],
    golden: Option<&(PathBuf, Trace)>,
    ledger: &mut Ledger,
    passes: &mut Vec<Pass>,
    events: &mut dyn FnMut(Event),
) -> Result<(), CheckError> {
    let Some((_, g)) = golden.filter(|_| !op_entries.is_empty()) else {
        return Ok(());
    };
    let forced = g.manifest.decode_tokens();
    let forced = forced[..plan.steps.min(forced.len())].to_vec();
    for (i, &e) in op_entries.iter().enumerate() {
        if ledger.trace(Side::Op(i)).is_some() {
            continue;
        }
        let ran = plan.pass(e, true, ReplaySink::new(g), Some(&forced), events)?;
        if let Some(err) = ran.sink.error {
            return Err(err.into());
        }
        passes.push(ran.pass);
        let tensors = op_by_op_steps(plan, ran.sink.inner.tensors);
        let t = plan.trace(ran.producer, ran.info, tensors);
        ledger.put(Side::Op(i), t.with_cuts(ran.sink.inner.cuts));
        ledger.settle(events)?;
    }
    Ok(())
}

/// One side of a comparison: the golden, or the trace of `entries[i]` end to end or of
/// `op_entries[i]` op by op.
#[derive(Clone, Copy, PartialEq)]
enum Side {
    Golden,
    E2e(usize),
    Op(usize),
}

/// Stage 6, as the passes end: every trace against the golden (op by op first: it is the
/// tight verdict; a device backend's op by op against the plain reference's), then every pair
/// of backends. Each comparison runs once both its traces exist, and a trace keeps its
/// tensors only until its last comparison: beside the weights a check holds the traces still
/// waiting for a partner, not every trace at once.
struct Ledger<'g> {
    golden: Option<&'g Trace>,
    e2e: Vec<Option<Trace>>,
    op: Vec<Option<Trace>>,
    /// In the order the report lists them: (baseline, candidate, op by op, against the golden).
    pairs: Vec<(Side, Side, bool, bool)>,
    done: Vec<Option<Judged>>,
    weight_type: crate::gguf::GgmlType,
}

impl<'g> Ledger<'g> {
    fn new(
        model: &Model,
        golden: Option<&'g Trace>,
        entries: &[&registry::Entry],
        op_entries: &[&registry::Entry],
    ) -> Result<Self, CheckError> {
        let devices: Vec<usize> = (0..op_entries.len())
            .filter(|&i| op_entries[i].device)
            .collect();
        let plain = op_entries
            .iter()
            .rposition(|e| !e.device && e.rounding == backend::Emulation::None);
        let mut pairs = Vec::new();
        if golden.is_some() {
            pairs.extend(
                (0..op_entries.len())
                    .filter(|i| Some(*i) != plain && !devices.contains(i))
                    .map(|i| (Side::Golden, Side::Op(i), true, true)),
            );
            if let Some(p) = plain {
                pairs.extend(
                    devices
                        .iter()
                        .map(|&d| (Side::Op(p), Side::Op(d), true, false)),
                );
            }
            pairs.extend((0..entries.len()).map(|i| (Side::Golden, Side::E2e(i), false, true)));
        }
        for i in 0..entries.len() {
            for j in i + 1..entries.len() {
                pairs.push((Side::E2e(i), Side::E2e(j), false, false));
            }
        }
        if pairs.is_empty() {
            return Err(CheckError::NothingToCompare);
        }
        Ok(Ledger {
            golden,
            e2e: entries.iter().map(|_| None).collect(),
            op: op_entries.iter().map(|_| None).collect(),
            done: pairs.iter().map(|_| None).collect(),
            pairs,
            weight_type: model.main_weight_type(),
        })
    }

    fn trace(&self, s: Side) -> Option<&Trace> {
        match s {
            Side::Golden => self.golden,
            Side::E2e(i) => self.e2e[i].as_ref(),
            Side::Op(i) => self.op[i].as_ref(),
        }
    }

    /// The golden and the index of the one comparison `s` takes part in, where that is
    /// against the golden.
    fn golden_only(&self, s: Side) -> Option<(usize, &'g Trace)> {
        let mine: Vec<usize> = (0..self.pairs.len())
            .filter(|&k| self.pairs[k].0 == s || self.pairs[k].1 == s)
            .collect();
        match mine[..] {
            [k] if self.pairs[k].0 == Side::Golden && self.done[k].is_none() => {
                Some((k, self.golden?))
            }
            _ => None,
        }
    }

    /// A finished trace already compared with the golden as it was made (pair `k`, from
    /// [`Ledger::golden_only`]).
    fn put_compared(&mut self, s: Side, t: Trace, k: usize, c: Comparison) {
        debug_assert!(self.pairs[k].0 == Side::Golden && self.pairs[k].1 == s);
        self.put(s, t);
        self.done[k] = Some(Judged {
            comparison: c,
            against_golden: true,
        });
    }

    /// A finished trace (compared at the next [`Ledger::settle`]).
    fn put(&mut self, s: Side, t: Trace) {
        match s {
            Side::Golden => unreachable!("the golden is given"),
            Side::E2e(i) => self.e2e[i] = Some(t),
            Side::Op(i) => self.op[i] = Some(t),
        }
    }

    /// Run every comparison whose two traces exist (side by side: each reads only its two),
    /// then drop the tensors of every trace whose comparisons are all done.
    fn settle(&mut self, events: &mut dyn FnMut(Event)) -> Result<(), CheckError> {
        let ready: Vec<usize> = (0..self.pairs.len())
            .filter(|&k| {
                let (a, b, ..) = self.pairs[k];
                self.done[k].is_none() && self.trace(a).is_some() && self.trace(b).is_some()
            })
            .collect();
        if ready.is_empty() {
            return Ok(());
        }
        events(Event::Comparing { n: ready.len() });
        use rayon::prelude::*;
        let this = &*self;
        let results: Vec<Result<Comparison, CompareError>> = ready
            .par_iter()
            .map(|&k| {
                let (a, b, op_by_op, _) = this.pairs[k];
                let (a, b) = (this.trace(a).expect("ready"), this.trace(b).expect("ready"));
                let opt = CompareOptions {
                    pair: if op_by_op {
                        PairKind::OpByOp
                    } else {
                        pair_kind(a, b)
                    },
                    weight_type: this.weight_type,
                    require_same_model: true,
                };
                compare(a, b, &opt)
            })
            .collect();
        for (k, r) in ready.into_iter().zip(results) {
            self.done[k] = Some(Judged {
                comparison: r?,
                against_golden: self.pairs[k].3,
            });
            events(Event::Compared);
        }
        let waiting = |s: Side, l: &Ledger| {
            l.pairs
                .iter()
                .zip(&l.done)
                .any(|((a, b, ..), d)| d.is_none() && (*a == s || *b == s))
        };
        let done: Vec<Side> = (0..self.e2e.len())
            .map(Side::E2e)
            .chain((0..self.op.len()).map(Side::Op))
            .filter(|&s| self.trace(s).is_some() && !waiting(s, self))
            .collect();
        for &s in &done {
            match s {
                Side::E2e(i) => self.e2e[i].as_mut(),
                Side::Op(i) => self.op[i].as_mut(),
                Side::Golden => None,
            }
            .expect("present")
            .drop_tensors();
        }
        if !done.is_empty() {
            trim_heap();
        }
        Ok(())
    }

    /// The comparisons in the report's order, and the traces (their manifests) end to end
    /// and op by op.
    fn finish(self) -> (Vec<Judged>, Vec<Trace>, Vec<Trace>) {
        let all = |v: Vec<Option<Trace>>| v.into_iter().flatten().collect();
        let comparisons = self
            .done
            .into_iter()
            .map(|d| d.expect("every trace made: every pair compared"))
            .collect();
        (comparisons, all(self.e2e), all(self.op))
    }
}

/// A sink that reports each finished forward call (the logits are its last tap) and
/// otherwise does what its inner sink does.
struct Counting<'e, S> {
    inner: S,
    events: &'e mut dyn FnMut(Event),
}

impl<S: Sink + ?Sized> Sink for Counting<'_, &mut S> {
    fn wants(&self, key: &TapKey) -> bool {
        self.inner.wants(key) || key.tap == Tap::Logits
    }
    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]) {
        if key.tap == Tap::Logits {
            (self.events)(Event::Forward);
        }
        if self.inner.wants(&key) {
            self.inner.record(key, shape, data);
        }
    }
    fn substitute(&mut self, key: &TapKey, data: &mut [f32]) -> bool {
        self.inner.substitute(key, data)
    }
    fn replays(&self, key: &TapKey) -> bool {
        self.inner.replays(key)
    }
    fn row_slice(&self, key: &TapKey) -> Option<usize> {
        match key.tap == Tap::Logits && !self.inner.wants(key) {
            true => Some(usize::MAX),
            false => self.inner.row_slice(key),
        }
    }
    fn record_rows(&mut self, key: TapKey, shape: &[usize], row0: usize, data: &[f32]) {
        let rows = data.len() / shape.iter().skip(1).product::<usize>().max(1);
        if row0 + rows == shape[0] {
            (self.events)(Event::Forward);
        }
        if self.inner.wants(&key) {
            self.inner.record_rows(key, shape, row0, data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each comparison runs once both its traces are in, in the report's order at the end, and
    /// a trace gives up its tensors at its last comparison (not before: a later partner still
    /// reads them).
    #[test]
    fn a_trace_keeps_its_tensors_until_its_last_comparison() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let model = Model::open(root.join("fixtures/tiny-llama-q8_0.gguf")).unwrap();
        let g = Trace::open(root.join("golden/tiny-llama-q8_0")).unwrap();
        let entries: Vec<&registry::Entry> = ["reference", "reference:ggml-cpu", "fast"]
            .map(|n| registry::find(n).unwrap())
            .to_vec();
        let copy = |name: &str| {
            let tensors = g.keys().map(|k| (*k, g.get(k).unwrap().unwrap())).collect();
            let mut producer = g.manifest.producer.clone();
            producer.backend = name.into();
            Trace::from_memory(
                g.manifest.model.clone(),
                producer,
                g.manifest.steps.clone(),
                tensors,
            )
        };
        let key = *g.keys().next().unwrap();
        let mut l = Ledger::new(&model, Some(&g), &entries, &[]).unwrap();
        let mut compared = 0;
        let has =
            |l: &Ledger, i: usize| l.trace(Side::E2e(i)).unwrap().get(&key).unwrap().is_some();
        l.put(Side::E2e(1), copy("b"));
        l.settle(&mut |e| compared += matches!(e, Event::Compared) as usize)
            .unwrap();
        // Against the golden done; it waits for the other two backends.
        assert_eq!(compared, 1);
        assert!(has(&l, 1));
        l.put(Side::E2e(0), copy("a"));
        l.settle(&mut |e| compared += matches!(e, Event::Compared) as usize)
            .unwrap();
        assert_eq!(compared, 3);
        assert!(has(&l, 0) && has(&l, 1));
        l.put(Side::E2e(2), copy("c"));
        l.settle(&mut |e| compared += matches!(e, Event::Compared) as usize)
            .unwrap();
        assert_eq!(compared, 6);
        assert!(
            (0..3).all(|i| !has(&l, i)),
            "every comparison done: no tensors kept"
        );
        let (c, traces, op) = l.finish();
        let sides: Vec<(String, String)> = c
            .iter()
            .map(|j| {
                (
                    j.comparison.baseline.clone(),
                    j.comparison.candidate.clone(),
                )
            })
            .collect();
        let name = |t: &Trace| {
            format!(
                "{}/{}",
                t.manifest.producer.name, t.manifest.producer.backend
            )
        };
        let (gn, [a, b, cc]) = (name(&g), ["a", "b", "c"].map(|x| name(&copy(x))));
        let want = [
            (&gn, &a),
            (&gn, &b),
            (&gn, &cc),
            (&a, &b),
            (&a, &cc),
            (&b, &cc),
        ]
        .map(|(x, y)| (x.clone(), y.clone()));
        assert_eq!(sides, want);
        assert!(c.iter().all(|j| !j.comparison.diverged()));
        assert_eq!((traces.len(), op.len()), (3, 0));
    }

    /// The default set keeps a device backend only on a hardware adapter that it can build:
    /// no adapter, a software one, or a build that fails each leave it out with one note
    /// saying why (the CPU backends go on); asked for by name, nothing is left out here.
    #[test]
    fn default_set_leaves_out_a_device_it_cannot_use() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama-q8_0.gguf");
        let model = Model::open(&path).unwrap();
        let device = |probe: fn() -> registry::Probe, build: registry::Build| registry::Entry {
            name: "gpu",
            aliases: &[],
            rounding: backend::Emulation::None,
            replayable: true,
            about: "",
            device: true,
            lockstep: false,
            probe: Some(probe),
            build,
        };
        let fails: registry::Build = |_, _, _| Err(BackendError::Gpu("tensor too big".into()));
        let builds: registry::Build = |m, n, _| {
            Ok(Box::new(backend::Reference::new(
                m,
                backend::Emulation::None,
                n,
            )))
        };
        type Case = (
            fn() -> registry::Probe,
            registry::Build,
            Option<&'static str>,
        );
        let cases: [Case; 4] = [
            (
                || registry::Probe::Missing("no GPU adapter".into()),
                builds,
                Some("gpu: not checked — no GPU adapter"),
            ),
            (
                || registry::Probe::Software("llvmpipe".into()),
                builds,
                Some(
                    "gpu: not checked — the only GPU adapter (llvmpipe) runs on the CPU; `--backends reference,gpu` includes it",
                ),
            ),
            (
                || registry::Probe::Hardware("a GPU".into()),
                fails,
                Some("gpu: not checked — tensor too big"),
            ),
            (|| registry::Probe::Hardware("a GPU".into()), builds, None),
        ];
        for (probe, build, note) in cases {
            let gpu = device(probe, build);
            let plain = registry::find("reference").unwrap();
            let mut opt = CheckOptions {
                backends: vec!["reference".into(), "gpu".into()],
                device_optional: true,
                max_trace_size: crate::arch::size::DEFAULT_BUDGET,
                threads: 1,
                steps: None,
                op_by_op: true,
                golden: None,
                golden_dirs: Vec::new(),
                prompt: None,
            };
            let plan = Plan {
                model: &model,
                model_ref: ModelRef {
                    path: String::new(),
                    sha256: String::new(),
                    size: None,
                },
                prompt: vec![1, 2],
                steps: 1,
                later: None,
                n_ctx: 4,
                threads: 1,
                has_golden: false,
                record: None,
            };
            let mut notes = Vec::new();
            let kept = with_devices(&plan, vec![plain, &gpu], &opt, &mut notes).unwrap();
            let names: Vec<&str> = kept.iter().map(|e| e.name).collect();
            match note {
                Some(n) => {
                    assert_eq!(names, ["reference"], "{n}");
                    assert_eq!(notes, [n.to_string()]);
                }
                None => {
                    assert_eq!(names, ["reference", "gpu"]);
                    assert!(notes.is_empty(), "{notes:?}");
                }
            }
            // Named by the user: kept whatever the probe says (a failure is the pass's error).
            opt.device_optional = false;
            let mut notes = Vec::new();
            let kept = with_devices(&plan, vec![plain, &gpu], &opt, &mut notes).unwrap();
            assert_eq!(kept.len(), 2);
            assert!(notes.is_empty());
        }
    }
}
