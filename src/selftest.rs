//! `parity selftest` as a library call: the clean engine and each catalog bug
//! (`backend::mutation`) write their trace to a file, parity's own engine through `parity
//! dump`'s library call (`backend::dump`), the numpy engine as a process of its own, exactly
//! as an external engine's dump is made; `diff`'s own library call judges it; each [`Row`] says whether
//! the clean run passes and each bug is found at its place and named. What each bug must show
//! (its place in a full and a sparse dump, its name) is the catalog's, beside it in
//! `backend/mutation.rs`. The CLI renders the rows; nothing here prints.

use crate::backend::Reference;
use crate::backend::dump;
use crate::backend::family::{Emulation, FAMILIES};
use crate::backend::mutation::{Mutation, MutationKind};
use crate::judge::verdict::{DiffOptions, Diffed, diff};
use crate::judge::{JudgeError, rounding_label};
use crate::model::Model;
use crate::trace::{TapFilter, TapKey, Trace, TraceError, TraceWriter};
use std::path::{Path, PathBuf};

mod worker;

#[derive(Debug, thiserror::Error)]
pub enum SelftestError {
    #[error("{golden}: the golden is for another model (sha256 {sha}…)")]
    GoldenOtherModel { golden: String, sha: String },
    #[error("{0}: selftest needs a golden with a prompt of 2+ ids and 1+ decode steps")]
    GoldenTooShort(String),
    #[error("--from-layer {from}: the model has {n_layer} layers")]
    FromLayer { from: usize, n_layer: usize },
    #[error("unknown mutation '{0}' (known: {known})", known = Mutation::names())]
    UnknownMutation(String),
    #[error("--kv {0} needs --engine numpy (parity's own engine keeps an f32 K/V cache)")]
    KvNeedsNumpy(String),
    #[error(
        "--rounding {0} needs --engine numpy (parity's own engine runs one family parity models at every step)"
    )]
    RoundingNeedsNumpy(String),
    #[error("running {program} for {case}: {source}")]
    Spawn {
        program: String,
        case: String,
        source: std::io::Error,
    },
    #[error("{engine} engine failed on {case}: {last}")]
    EngineFailed {
        engine: &'static str,
        case: String,
        last: String,
    },
    /// The folder the traces are written to cannot be made (`flag`: `--keep ` when given).
    #[error("{flag}{path}: {what}")]
    TraceFolder {
        flag: &'static str,
        path: String,
        what: String,
    },
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(transparent)]
    Judge(#[from] JudgeError),
}

/// Which engine writes the traces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// parity's reference, through `parity dump --mutate`'s library call.
    Parity,
    /// scripts/numpy_engine.py.
    Numpy,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Parity => "parity",
            Engine::Numpy => "numpy",
        }
    }
}

/// One rounding an engine can run with: a family parity models (`backend::family::FAMILIES`),
/// or the numpy engine's `f16-trunc` (every matmul input cut to f16 toward zero, as a
/// hand-written conversion that drops bits does), which no family reproduces: its verdicts state
/// a widened floor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineRounding {
    Family(Emulation),
    F16Trunc,
}

impl EngineRounding {
    /// Its name in selftest's rows: the family's (`backend::family::FAMILIES`), or `f16-trunc`.
    pub fn name(self) -> &'static str {
        match self {
            EngineRounding::Family(e) => e.name(),
            EngineRounding::F16Trunc => "f16-trunc",
        }
    }

    /// A family's name or alias (`backend::family::FAMILIES`), or `f16-trunc`.
    pub fn parse(s: &str) -> Option<EngineRounding> {
        match s {
            "f16-trunc" => Some(EngineRounding::F16Trunc),
            _ => Emulation::parse(s).map(EngineRounding::Family),
        }
    }

    /// Its name in scripts/numpy_engine.py's own vocabulary (`--rounding`).
    fn numpy_name(self) -> &'static str {
        match self {
            EngineRounding::Family(Emulation::None) => "none",
            EngineRounding::Family(Emulation::GgmlCpu) => "ggml",
            EngineRounding::Family(Emulation::Q8_1Gpu) => "q8_1",
            r => r.name(),
        }
    }
}

/// The engine's activation rounding: one for every step, or the prompt step's own beside the
/// decode steps' (`f16-acc/none`: llama.cpp Vulkan's tiled prefill, f32 decode), and the output
/// projection's own where it differs (`q8k+lm=ggml`: a Rust engine's Q8_K layers, its lm_head
/// another kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rounding {
    pub prefill: Option<EngineRounding>,
    pub decode: EngineRounding,
    pub output: Option<EngineRounding>,
}

impl Rounding {
    pub const NONE: Rounding = Rounding::one(EngineRounding::Family(Emulation::None));
    pub const GGML: Rounding = Rounding::one(EngineRounding::Family(Emulation::GgmlCpu));

    pub const fn one(r: EngineRounding) -> Rounding {
        Rounding {
            prefill: None,
            decode: r,
            output: None,
        }
    }

    /// `ggml`, `q8k`, `f16-acc/none` (PREFILL/DECODE), `q8k+lm=ggml` (LAYERS+lm=OUTPUT).
    pub fn name(self) -> String {
        let steps = match self.prefill {
            Some(p) => format!("{}/{}", p.name(), self.decode.name()),
            None => self.decode.name().to_string(),
        };
        match self.output {
            Some(o) => format!("{steps}+lm={}", o.name()),
            None => steps,
        }
    }

    pub fn parse(s: &str) -> Option<Rounding> {
        let (steps, output) = match s.split_once("+lm=") {
            Some((steps, o)) => (steps, Some(EngineRounding::parse(o)?)),
            None => (s, None),
        };
        let r = match steps.split_once('/') {
            Some((p, d)) => Rounding {
                prefill: Some(EngineRounding::parse(p)?),
                decode: EngineRounding::parse(d)?,
                output: None,
            },
            None => Rounding::one(EngineRounding::parse(steps)?),
        };
        Some(Rounding { output, ..r })
    }

    /// Every name `parse` takes, for error messages.
    pub fn names() -> String {
        let mut v: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
        v.push("f16-trunc");
        format!("{}, PREFILL/DECODE, or ROUNDING+lm=OUTPUT", v.join(", "))
    }
}

impl serde::Serialize for Rounding {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

/// How the numpy engine is started as its own process (parity's own engine runs in this one,
/// through `parity dump`'s library call).
#[derive(Clone, Debug)]
pub struct Programs {
    /// The Python that runs the numpy engine, and its script.
    pub python: PathBuf,
    pub numpy_engine: PathBuf,
}

/// What a selftest runs.
#[derive(Clone, Debug)]
pub struct SelftestOptions {
    /// The model's llama.cpp golden folder.
    pub golden: PathBuf,
    /// Each engine with each rounding, in this order.
    pub engines: Vec<Engine>,
    pub roundings: Vec<Rounding>,
    /// Dump only [`SPARSE_TAPS`]; a bug must then be found at the right layer.
    pub sparse: bool,
    /// The numpy engine's K/V cache type (`f32`, or `f16` as llama.cpp's default cache).
    pub kv: String,
    /// Each compute bug acts from this layer on (and on the output norm and projection).
    pub from_layer: usize,
    /// Only these mutations by name (the clean run always runs).
    pub only: Option<Vec<String>>,
    /// Keep the traces in this folder instead of a temporary one (one `.npz` archive per
    /// row, named ENGINE-ROUNDING-CASE.npz; `parity diff` reads them as folders).
    pub keep: Option<PathBuf>,
    pub programs: Programs,
    /// Cases judged at once, each with its engine process (0: one per core).
    pub jobs: usize,
}

/// The taps of a sparse dump: what engine authors dump first.
pub const SPARSE_TAPS: &str = r"^(embd|l_out-\d+|result_norm|logits)$";

/// One case: the clean engine, or one bug, through one engine configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Case {
    Clean,
    Bug(Mutation),
    /// A layout bug whose manifest declares the layout: must be aligned (pass) or named.
    Declared(Mutation),
}

impl Case {
    pub fn label(self) -> String {
        match self {
            Case::Clean => "clean".into(),
            Case::Bug(m) => m.name().into(),
            Case::Declared(m) => format!("{m} (declared)"),
        }
    }
}

/// One case through one engine and rounding, judged.
#[derive(serde::Serialize)]
pub struct Row {
    pub case: String,
    pub engine: Engine,
    pub rounding: Rounding,
    pub sparse: bool,
    /// Where the bug must be found (none for the clean run).
    pub expected: Option<String>,
    pub expected_name: Option<String>,
    /// Whether a divergence was found (exit 1 from `diff`).
    pub diverged: bool,
    pub found: Option<String>,
    /// The name the diagnosis gave (confirmed hypothesis, or the token difference's kind).
    pub named: Option<String>,
    /// Other hypotheses that reproduce the candidate as well.
    pub also: Vec<String>,
    /// The largest cut a hypothesis made of an own error under the floors (a clean row must
    /// stay below `judge::hypothesis::EXPLAINS`; None when none was tested).
    pub below_floor_cut: Option<f64>,
    /// The rounding the judge measured as the one that reproduces the trace (`prefill: F,
    /// decode: G` where the steps differ), the matmul floor it judged at, and the limits its
    /// verdict states (a floor widened for an unknown rounding, spans of a sparse dump).
    pub measured: Option<String>,
    pub matmul_floor: Option<f64>,
    pub limits: Vec<String>,
    /// The found key's own NMSE over its floor: the margin by which a bug is seen.
    pub own_over_floor: Option<f64>,
    /// The token position where a bug acting from some position on must be found, and the
    /// position the verdict names (any row's).
    pub expected_position: Option<usize>,
    pub position: Option<usize>,
    pub ok: bool,
    pub why: String,
}

/// `step 0, layer 3, q_rope` / `step 1, logits`.
pub fn place(k: &TapKey) -> String {
    match k.layer {
        Some(l) => format!("step {}, layer {l}, {}", k.step, k.tap),
        None => format!("step {}, {}", k.step, k.tap),
    }
}

/// Run the selftest of `model` (at `model_path`): every case through every engine and
/// rounding. `on_row` hears each row as it is judged.
pub fn run(
    model: &Model,
    model_path: &Path,
    opt: &SelftestOptions,
    on_row: &mut dyn FnMut(&Row),
) -> Result<Vec<Row>, SelftestError> {
    let golden = open_golden(model, opt)?;
    // (A scan of every score of the golden: only where the case is asked for.)
    let asked = |m: Mutation| {
        opt.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|n| n == m.name()))
    };
    let overflows = Mutation::ALL
        .iter()
        .any(|&m| m.shows_only_on_overflow() && asked(m))
        && overflow_at(&golden, model, opt.from_layer)?.is_some();
    let cases = cases(model, opt, &crate::trace::step_shapes(&golden), overflows)?;
    let made = match &opt.keep {
        Some(k) => std::fs::create_dir_all(k).map(|()| k.clone()),
        None => private_temp_dir(),
    };
    let tmp = made.map_err(|e| {
        let tmp = opt.keep.clone().unwrap_or_else(std::env::temp_dir);
        let what = match (&opt.keep, std::fs::metadata(&tmp)) {
            (Some(_), Ok(m)) if !m.is_dir() => "exists and is not a folder".to_string(),
            _ => e.to_string(),
        };
        let flag = if opt.keep.is_some() { "--keep " } else { "" };
        SelftestError::TraceFolder {
            flag,
            path: tmp.display().to_string(),
            what,
        }
    })?;
    let mut rows = Vec::new();
    let jobs = match opt.jobs {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let pool = worker::Pool::new(&opt.programs.python, &opt.programs.numpy_engine);
    let result = (|| -> Result<(), SelftestError> {
        for &engine in &opt.engines {
            for &rounding in &opt.roundings {
                let row = |case: Case, clean: Option<&Trace>| {
                    one_row(
                        engine, rounding, case, clean, model, model_path, &golden, opt, &tmp, &pool,
                    )
                };
                // The clean engine's trace first: in a sparse dump it says where a bug first
                // makes the trace differ at all. Then the bugs, `jobs` at a time (each an
                // engine process and a judgement of its own), their rows in catalog order.
                let (first, clean) = row(cases[0], None)?;
                on_row(&first);
                rows.push(first);
                let clean = matches!(cases[0], Case::Clean).then_some(clean);
                in_order(
                    &cases[1..],
                    jobs,
                    |&case| row(case, clean.as_ref()).map(|(r, _)| r),
                    |r| {
                        on_row(&r);
                        rows.push(r);
                    },
                )?;
            }
        }
        Ok(())
    })();
    if opt.keep.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result?;
    Ok(rows)
}

/// One case through one engine configuration: its trace written by the engine into `tmp`, judged by `diff`'s library call against the golden, and the row (with the
/// trace, which the clean case hands to the bug cases).
#[allow(clippy::too_many_arguments)]
fn one_row(
    engine: Engine,
    rounding: Rounding,
    case: Case,
    clean: Option<&Trace>,
    model: &Model,
    model_path: &Path,
    golden: &Trace,
    opt: &SelftestOptions,
    tmp: &Path,
    pool: &worker::Pool,
) -> Result<(Row, Trace), SelftestError> {
    // One `.npz` file per trace: a folder of one file per tap costs more in inode creation
    // than the engine and the judge together on small models.
    let dir = tmp.join(format!(
        "{}-{}-{}.npz",
        engine.name(),
        rounding.name().replace('/', "+"),
        case.label().replace([' ', '(', ')'], "")
    ));
    write_trace(
        engine, model, model_path, golden, case, rounding, opt, &dir, pool,
    )?;
    let cand = Trace::open(&dir)?;
    let o = outcome(golden, &cand, model)?;
    // In a sparse trace a small bug can leave the first layers' outputs bit-identical
    // (activation rounding to 8 bits absorbs it): it cannot be placed before the first key
    // where the trace differs at all.
    let observable = match (clean, case) {
        (Some(c), Case::Bug(_)) if opt.sparse => c.first_difference(&cand)?,
        _ => None,
    };
    let steps = crate::trace::step_shapes(golden);
    let overflow = match case {
        Case::Bug(m) if m.shows_only_on_overflow() => first_non_finite(&cand, model)?,
        _ => None,
    };
    let seen = Seen {
        observable,
        steps: &steps,
        overflow,
    };
    let mut row = judge_row(case, engine, rounding, opt, model, &o, &seen);
    if let (Some(k), Some(exp)) = (observable, &row.expected)
        && !row.ok
        && place(&k) != *exp
    {
        row.why = format!(
            "{} (first difference in this trace: {})",
            row.why,
            place(&k)
        );
    }
    Ok((row, cand))
}

/// `work` on each item, on up to `jobs` threads, each result handed to `emit` in the items'
/// order as soon as it and those before it are done. The first error (in item order) stops
/// the work: threads finish the item they hold and take no more.
fn in_order<T: Sync, R: Send, E: Send>(
    items: &[T],
    jobs: usize,
    work: impl Fn(&T) -> Result<R, E> + Sync,
    mut emit: impl FnMut(R),
) -> Result<(), E> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let (next, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, items.len().max(1)) {
            let (tx, next, stop, work) = (tx.clone(), &next, &stop, &work);
            s.spawn(move || {
                while !stop.load(Relaxed) {
                    let i = next.fetch_add(1, Relaxed);
                    let Some(item) = items.get(i) else { break };
                    if tx.send((i, work(item))).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        let mut pending = std::collections::BTreeMap::new();
        let mut want = 0;
        for (i, r) in rx {
            pending.insert(i, r);
            while let Some(r) = pending.remove(&want) {
                want += 1;
                match r {
                    Ok(v) => emit(v),
                    Err(e) => {
                        stop.store(true, Relaxed);
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    })
}

/// A new folder of our own in the shared temp folder: made with `mkdir` (mode 0700), never
/// one that is already there, so a link planted at a guessable name is not written through.
fn private_temp_dir() -> std::io::Result<std::path::PathBuf> {
    let mut b = std::fs::DirBuilder::new();
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    let base = std::env::temp_dir();
    let mut last = None;
    for n in 0..100 {
        let p = base.join(format!("parity-selftest-{}-{n}", std::process::id()));
        match b.create(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no free name")))
}

/// The golden, checked to be this model's and long enough for every bug to show.
fn open_golden(model: &Model, opt: &SelftestOptions) -> Result<Trace, SelftestError> {
    let golden = Trace::open(&opt.golden)?;
    if golden.manifest.model.sha256 != model.sha256() {
        return Err(SelftestError::GoldenOtherModel {
            golden: opt.golden.display().to_string(),
            sha: golden.manifest.model.sha256.chars().take(12).collect(),
        });
    }
    let prompt_len = golden.manifest.steps.first().map_or(0, |s| s.tokens.len());
    if prompt_len < 2 || golden.manifest.steps.len() < 2 {
        return Err(SelftestError::GoldenTooShort(
            opt.golden.display().to_string(),
        ));
    }
    if opt.from_layer >= model.config.n_layer {
        return Err(SelftestError::FromLayer {
            from: opt.from_layer,
            n_layer: model.config.n_layer,
        });
    }
    Ok(golden)
}

/// ln(f32::MAX): exp of a larger score is +Inf in f32.
const EXP_OVERFLOW: f32 = 88.722_84;

/// Where an engine whose softmax does not subtract its row's max (softmax-no-max) overflows
/// on the golden's run (whether it is a case here): the first (step, layer from `from` on) at whose
/// `kq_soft_max` a visible score q·k·scale, from the golden's own q_rope and k_rope (the
/// earlier steps' k_rope its cache), passes ln(f32::MAX). None where none does, where the
/// golden lacks those taps, or where the largest score lies within 1e-2 of the limit (an
/// engine's own rounding could land it either side).
pub fn overflow_at(
    golden: &Trace,
    model: &Model,
    from: usize,
) -> Result<Option<TapKey>, SelftestError> {
    use crate::trace::Tap;
    let c = &model.config;
    // A soft-cap bounds every score: exp(cap) is finite for any cap a model uses.
    if c.attn_softcap.is_some() {
        return Ok(None);
    }
    let (nh, nkv, hd) = (c.n_head, c.n_head_kv, c.head_dim);
    if nh == 0 || nkv == 0 || !nh.is_multiple_of(nkv) {
        return Ok(None);
    }
    let mut keys: Vec<Vec<f32>> = vec![Vec::new(); c.n_layer];
    for s in &golden.manifest.steps {
        let Some(&pos0) = s.positions.first() else {
            continue;
        };
        for (l, cache) in keys.iter_mut().enumerate() {
            let q = golden.get(&TapKey::new(s.step, Some(l), Tap::QRope))?;
            let k = golden.get(&TapKey::new(s.step, Some(l), Tap::KRope))?;
            let (Some(q), Some(k)) = (q, k) else {
                return Ok(None);
            };
            let (q, k) = (q.into_raw_vec_and_offset().0, k.into_raw_vec_and_offset().0);
            let t = s.positions.len();
            if q.len() != t * nh * hd || k.len() != t * nkv * hd || cache.len() != pos0 * nkv * hd {
                return Ok(None);
            }
            cache.extend_from_slice(&k);
            if l < from {
                continue;
            }
            let window = if c.swa_layers.get(l).copied().unwrap_or(false) {
                c.n_swa
            } else {
                0
            };
            let mut max = f32::NEG_INFINITY;
            for i in 0..t {
                let p = pos0 + i;
                let first = if window > 0 {
                    (p + 1).saturating_sub(window)
                } else {
                    0
                };
                for h in 0..nh {
                    let qh = &q[(i * nh + h) * hd..][..hd];
                    let g = h / (nh / nkv);
                    for j in first..=p {
                        let kh = &cache[(j * nkv + g) * hd..][..hd];
                        let dot: f32 = qh.iter().zip(kh).map(|(a, b)| a * b).sum();
                        max = max.max(dot * c.kq_scale);
                    }
                }
            }
            if (max - EXP_OVERFLOW).abs() < 1e-2 {
                return Ok(None);
            }
            if max > EXP_OVERFLOW {
                return Ok(Some(TapKey::new(s.step, Some(l), Tap::KqSoftMax)));
            }
        }
    }
    Ok(None)
}

/// The first key (in graph order) where `t` holds a NaN or an Inf. Where softmax-no-max's
/// engine overflows is its own: on a deep model whose attention is nearly one-hot, an
/// engine's rounding moves its scores by more than a golden's can say (a 16-layer model with
/// q and k 5x the usual, plain f32 against llama.cpp's golden: NMSE 0.3 by the last layer,
/// and the first overflow at step 1 layer 15 where the golden's largest score is 66).
fn first_non_finite(t: &Trace, model: &Model) -> Result<Option<TapKey>, SelftestError> {
    let cand = crate::judge::replay::Candidate::new(t, &model.config)?;
    Ok(cand.first_non_finite()?.map(|(k, ..)| k))
}

/// The clean run, then each catalog bug that applies to the model and can show in this
/// dump at this depth (a layout bug also with its layout declared; a position bug where the
/// golden's run reaches its position; softmax-no-max where a score `overflows`).
fn cases(
    model: &Model,
    opt: &SelftestOptions,
    steps: &[(usize, usize, usize)],
    overflows: bool,
) -> Result<Vec<Case>, SelftestError> {
    let mut cases = vec![Case::Clean];
    for &m in Mutation::ALL {
        if let Some(only) = &opt.only
            && !only.iter().any(|n| n == m.name())
        {
            continue;
        }
        if !m.applies_to(model) || (m.positional() && m.first_position(steps).is_none()) {
            continue;
        }
        // Without an overflow it computes the same numbers to f32 rounding: nothing to find.
        if m.shows_only_on_overflow() && !overflows {
            continue;
        }
        // A prompt shorter than a block of mask-tail-block is unmasked whole: at the first
        // step, where it shows, that is no-causal-mask exactly.
        if matches!(m, Mutation::MaskTailBlock(_)) && m.first_position(steps) == Some((0, 0)) {
            continue;
        }
        if opt.sparse && !m.shows_in_sparse() {
            continue;
        }
        if opt.from_layer > 0
            && (m.kind() != MutationKind::Compute
                || m.first_shows_from(model, opt.from_layer).is_none())
        {
            continue; // token and layout bugs have no depth
        }
        cases.push(Case::Bug(m));
        if m.kind() == MutationKind::Layout {
            cases.push(Case::Declared(m));
        }
    }
    if let Some(only) = &opt.only
        && let Some(bad) = only.iter().find(|n| Mutation::parse(n).is_none())
    {
        return Err(SelftestError::UnknownMutation(bad.clone()));
    }
    if opt.kv != "f32" && opt.engines.contains(&Engine::Parity) {
        return Err(SelftestError::KvNeedsNumpy(opt.kv.clone()));
    }
    if opt.engines.contains(&Engine::Parity)
        && let Some(r) = opt.roundings.iter().find(|r| {
            r.prefill.is_some() || r.output.is_some() || r.decode == EngineRounding::F16Trunc
        })
    {
        return Err(SelftestError::RoundingNeedsNumpy(r.name()));
    }
    Ok(cases)
}

/// `diff`'s verdict on a candidate: the library call `parity diff` makes when it has the model
/// (`judge::verdict::diff`, with diff's default options), so the two cannot disagree.
fn outcome(golden: &Trace, cand: &Trace, model: &Model) -> Result<Diffed, SelftestError> {
    Ok(diff(
        golden,
        cand,
        Some(model),
        &DiffOptions::new(model.main_weight_type()),
    )?)
}

/// Write the case's trace into `dir`: parity's own engine through `parity dump`'s library
/// call, the numpy engine as a process of its own, as an external engine's dump is made.
#[allow(clippy::too_many_arguments)]
fn write_trace(
    engine: Engine,
    model: &Model,
    model_path: &Path,
    golden: &Trace,
    case: Case,
    rounding: Rounding,
    opt: &SelftestOptions,
    dir: &Path,
    pool: &worker::Pool,
) -> Result<(), SelftestError> {
    match engine {
        Engine::Parity => own_engine(model, model_path, golden, case, rounding, opt, dir),
        Engine::Numpy => numpy_engine(model_path, case, rounding, opt, dir, pool),
    }
}

/// The numpy engine writes the case's trace, through a kept worker where every argument is
/// text (JSON carries the lines); a path that is not UTF-8 gets a process of its own.
fn numpy_engine(
    model_path: &Path,
    case: Case,
    rounding: Rounding,
    opt: &SelftestOptions,
    dir: &Path,
    pool: &worker::Pool,
) -> Result<(), SelftestError> {
    let failed = |stderr: &str| SelftestError::EngineFailed {
        engine: "numpy",
        case: case.label(),
        last: stderr.lines().last().unwrap_or("").trim().to_string(),
    };
    let spawn = |e| SelftestError::Spawn {
        program: opt.programs.python.display().to_string(),
        case: case.label(),
        source: e,
    };
    let args = numpy_args(model_path, case, rounding, opt, dir);
    let text: Option<Vec<String>> = args
        .iter()
        .map(|a| a.to_str().map(str::to_string))
        .collect();
    if let Some(text) = text {
        let a = pool.run(&text).map_err(spawn)?;
        return match a.rc {
            0 => Ok(()),
            _ => Err(failed(&a.stderr)),
        };
    }
    let mut c = std::process::Command::new(&opt.programs.python);
    // Isolated (`-I`): no working folder or script folder on sys.path, no PYTHON* variables,
    // no user site, so a `numpy.py` where selftest runs is not imported.
    c.arg("-I").arg(&opt.programs.numpy_engine);
    crate::trace::staging::isolate_python(&mut c);
    c.args(args);
    let out = c.output().map_err(spawn)?;
    match out.status.success() {
        true => Ok(()),
        false => Err(failed(&String::from_utf8_lossy(&out.stderr))),
    }
}

/// parity's reference engine writes the case's trace, as `parity dump MODEL --golden G
/// [--emulate E] [--taps SPARSE] [--mutate M [--declare-layout]]` would, through the same
/// library call (`backend::dump`).
fn own_engine(
    model: &Model,
    model_path: &Path,
    golden: &Trace,
    case: Case,
    rounding: Rounding,
    opt: &SelftestOptions,
    dir: &Path,
) -> Result<(), SelftestError> {
    let failed = |last: String| SelftestError::EngineFailed {
        engine: "parity dump",
        case: case.label(),
        last,
    };
    // `cases` let only the numpy engine take f16-trunc or a prefill or output rounding of its
    // own.
    let EngineRounding::Family(family) = rounding.decode else {
        return Err(SelftestError::RoundingNeedsNumpy(rounding.name()));
    };
    let (prompt, feed) =
        dump::replay(golden).ok_or_else(|| failed("the golden has no prompt ids".into()))?;
    let (bug, from_layer, declared) = match case {
        Case::Clean => (None, 0, false),
        Case::Bug(m) => (Some(m), opt.from_layer, false),
        Case::Declared(m) => (Some(m), 0, true),
    };
    let prompt = match bug {
        Some(m) => dump::mutate_ids(&prompt, m, model).map_err(|e| failed(e.to_string()))?,
        None => prompt,
    };
    // A token bug is in the ids alone; the others are the reference's hooks.
    let hooks = bug.filter(|m| m.kind() != MutationKind::Tokens);
    let mut engine = Reference::new(model, family, prompt.len() + feed.n_ids())
        .with_mutation(hooks)
        .mutation_from_layer(from_layer);
    let filter = if opt.sparse {
        TapFilter::regex(SPARSE_TAPS).map_err(|e| failed(e.to_string()))?
    } else {
        TapFilter::all()
    };
    let mut sink = TraceWriter::create(dir, filter, true)?;
    if declared && let Some((tap, layout)) = bug.and_then(|m| m.declared_layout()) {
        sink.declare_layout(tap, layout);
    }
    let settings = serde_json::json!({
        "bos_policy": format!("ids replayed from the golden {}", opt.golden.display()),
        "selftest": case.label(),
    });
    dump::write(
        &mut engine,
        &prompt,
        &feed,
        sink,
        dump::model_ref(model_path, model),
        settings,
    )
    .map_err(|e| failed(e.to_string()))?;
    Ok(())
}

/// The numpy engine's command line for a case (after the script's path).
fn numpy_args(
    model_path: &Path,
    case: Case,
    rounding: Rounding,
    opt: &SelftestOptions,
    dir: &Path,
) -> Vec<std::ffi::OsString> {
    let mut c: Vec<std::ffi::OsString> = vec![model_path.into(), "--golden".into()];
    c.push(opt.golden.clone().into());
    let mut push = |xs: &[&str]| c.extend(xs.iter().map(|&x| x.into()));
    push(&["--rounding", rounding.decode.numpy_name()]);
    if let Some(p) = rounding.prefill {
        push(&["--prefill-rounding", p.numpy_name()]);
    }
    if let Some(o) = rounding.output {
        push(&["--output-rounding", o.numpy_name()]);
    }
    push(&["--taps", if opt.sparse { "sparse" } else { "all" }]);
    push(&["--kv", &opt.kv]);
    let from = opt.from_layer.to_string();
    match case {
        Case::Clean => {}
        Case::Bug(m) => {
            push(&["--mutate", m.name()]);
            if opt.from_layer > 0 {
                push(&["--mutate-from-layer", &from]);
            }
        }
        Case::Declared(m) => push(&["--mutate", m.name(), "--declare"]),
    }
    c.push("--out".into());
    c.push(dir.into());
    c
}

/// What a row is judged against besides the verdict: where a sparse trace first differs from
/// the clean engine's, and the golden's steps (step, first position, token count).
struct Seen<'a> {
    observable: Option<TapKey>,
    steps: &'a [(usize, usize, usize)],
    /// Where the engine of a bug that shows only on an overflow (softmax-no-max) first
    /// overflowed: the first non-finite key of its trace.
    overflow: Option<TapKey>,
}

/// The row of one case: whether `diff`'s verdict `o` is what the case must give.
fn judge_row(
    case: Case,
    engine: Engine,
    rounding: Rounding,
    opt: &SelftestOptions,
    model: &Model,
    d: &Diffed,
    seen: &Seen,
) -> Row {
    let (observable, steps) = (seen.observable, seen.steps);
    let sparse = opt.sparse;
    let o = &d.verdict;
    let j = d.judgement.as_ref();
    let base = Row {
        case: case.label(),
        engine,
        rounding,
        sparse,
        expected: None,
        expected_name: None,
        diverged: o.diverged,
        found: o.place.as_ref().map(place),
        named: o.named.clone(),
        also: o.also.clone(),
        below_floor_cut: o.below_floor_cut,
        measured: j.map(rounding_label),
        matmul_floor: j.map(|j| j.matmul_floor),
        limits: j.map(|j| j.limits()).unwrap_or_default(),
        own_over_floor: j
            .and_then(|j| j.first.as_ref())
            .map(|f| f.own_nmse / f.floor),
        expected_position: None,
        position: j
            .and_then(|j| j.first.as_ref())
            .and_then(|f| f.position)
            .map(|p| p.position),
        ok: false,
        why: String::new(),
    };
    match case {
        Case::Clean => {
            let ok = !o.diverged;
            Row {
                ok,
                why: if ok {
                    "clean run passes".into()
                } else {
                    "false alarm on the clean run".into()
                },
                ..base
            }
        }
        Case::Bug(m) | Case::Declared(m) => {
            let mut exp = m
                .first_shows_from(model, opt.from_layer)
                .unwrap_or_else(|| m.first_shows(model));
            // A position bug shows in the step holding its first position, at that position.
            let at_position = m.first_position(steps);
            if let Some((step, _)) = at_position {
                exp.step = step;
            }
            // Where a bug that shows only on an overflow first shows is where its engine's own
            // scores overflowed (`one_row` records it for such a bug alone).
            if let Some(k) = seen.overflow {
                exp = k;
            }
            // Where the sparse trace first differs from the clean engine's, if that is later.
            // (TapKey orders by graph: embedding taps, layers, output taps.)
            if let Some(k) = observable
                && k.step == exp.step
                && k > exp
            {
                exp = k;
            }
            let name = m.diagnosed_as();
            let at = o.place.is_some_and(|p| m.found_at(&exp, &p, sparse));
            // From a sparse trace, bugs that compute the same layer output cannot be told
            // apart (qk-permute and rope-neox give the same attention scores): there the
            // name may be among those that reproduce the candidate equally well.
            let named = o.named.as_deref() == Some(name)
                || (sparse && o.diverged && o.also.iter().any(|h| h == name));
            let (ok, why) = if matches!(case, Case::Declared(_)) {
                // Declared layouts are aligned (no divergence) or named as layout.
                match (o.diverged, at && named) {
                    (false, _) => (true, "declared layout aligned: no divergence".to_string()),
                    (true, true) => (true, "declared layout named".to_string()),
                    (true, false) => (
                        false,
                        "declared layout reported as a numeric bug".to_string(),
                    ),
                }
            } else if !o.diverged {
                (false, "not found: diff passed".to_string())
            } else if !at {
                (false, "found at the wrong place".to_string())
            } else if !named {
                (false, "not named".to_string())
            } else if at_position.is_some_and(|(_, p)| base.position != Some(p)) {
                (false, "found at the wrong position".to_string())
            } else {
                (true, "found at its place and named".to_string())
            };
            Row {
                expected: Some(place(&exp)),
                expected_name: Some(name.to_string()),
                expected_position: at_position.map(|(_, p)| p),
                ok,
                why,
                ..base
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::in_order;

    /// Results come out in the items' order whatever order the threads finish in (the later
    /// items here finish first), and the first error in that order is returned with every
    /// result before it emitted and none after.
    #[test]
    fn in_order_emits_in_item_order_and_stops_at_the_first_error() {
        let items: Vec<u64> = (0..24).collect();
        let slow_first = |&i: &u64| -> Result<u64, String> {
            std::thread::sleep(std::time::Duration::from_millis(24 - i));
            Ok(i * 10)
        };
        let mut got = Vec::new();
        in_order(&items, 4, slow_first, |r| got.push(r)).unwrap();
        assert_eq!(got, items.iter().map(|i| i * 10).collect::<Vec<_>>());

        let mut got = Vec::new();
        let failing = |&i: &u64| if i == 7 || i == 12 { Err(i) } else { Ok(i) };
        assert_eq!(in_order(&items, 3, failing, |r| got.push(r)), Err(7));
        assert_eq!(got, (0..7).collect::<Vec<_>>());
        // One thread, or none asked for: the same, in sequence.
        let mut got = Vec::new();
        in_order(&items, 0, |&i: &u64| Ok::<_, ()>(i), |r| got.push(r)).unwrap();
        assert_eq!(got, items);
        in_order(
            &[] as &[u64],
            2,
            |&i: &u64| Ok::<_, ()>(i),
            |_| panic!("no items"),
        )
        .unwrap();
    }
}
