//! Judging any trace op by op on its own inputs, and naming a bug by experiment.
//!
//! The reference replays the candidate (`replay`): at every tap the candidate dumped, it
//! records what it computes from the candidate's own upstream tensors, then continues from the
//! candidate's tensor. The NMSE between the two at a key is the candidate's *own error* for the
//! op (or, where the candidate lacks the inputs, the smallest span of ops its taps bound) that
//! produced it. Nothing can compound, so each op is judged against its own noise floor
//! (`floor`) at any depth, and no golden is needed. An absent tap is unknown, never "matched".
//!
//! The activation rounding is measured, not taken from the producer's name: the replay runs
//! under each rounding parity knows and keeps the one that reproduces the candidate's matmuls
//! best. At the first op that stands out of its floor, `hypothesis` re-runs that op under each
//! known bug and names the one that reproduces the candidate.

pub mod floor;
pub mod hypothesis;
pub mod layout;
pub mod replay;
pub mod verdict;

use crate::backend::{BackendError, Emulation};
use crate::compare::{CompareError, Metrics};
use crate::gguf::GgufError;
use crate::model::{Model, ModelError};
use crate::trace::{TapKey, Trace, TraceError};
use floor::{Floors, OpClass, class, median, span};
use replay::{Candidate, KvCache, Setup, Window, replay};
use serde::Serialize;
use std::collections::BTreeSet;
use std::fmt::Write;

#[derive(Debug, thiserror::Error)]
pub enum JudgeError {
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("replaying the candidate: {0}")]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Compare(#[from] CompareError),
    #[error(
        "{key}: the candidate's tensor has shape {found:?} ({} elements), the model needs {want} elements for this tap",
        found.iter().product::<usize>()
    )]
    Shape {
        key: TapKey,
        found: Vec<usize>,
        want: usize,
    },
    #[error("{key}: the model has only {n_layer} layers")]
    NoSuchLayer { key: TapKey, n_layer: usize },
    #[error("the candidate has tensors for step {0} but its manifest lists no such step")]
    MissingStep(usize),
    #[error("manifest layouts: {what}")]
    BadLayout { what: String },
    #[error("the candidate has no tap of this model to judge")]
    Empty,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct JudgeOptions {
    /// Roundings to try (the best one is kept); default: every rounding parity knows.
    pub roundings: Vec<Emulation>,
    /// K/V cache types to try (the best one is kept); default: f32 and f16.
    pub kv_caches: Vec<KvCache>,
    /// Run the experiments at the first flagged op.
    pub hypotheses: bool,
}

impl Default for JudgeOptions {
    fn default() -> Self {
        JudgeOptions {
            roundings: ROUNDINGS.to_vec(),
            kv_caches: KV_CACHES.to_vec(),
            hypotheses: true,
        }
    }
}

/// The K/V cache types parity emulates, in order of preference on ties.
pub const KV_CACHES: [KvCache; 2] = [KvCache::F32, KvCache::F16];

/// A rounding whose median matmul own NMSE is this low reproduces the engine (f32 summation
/// noise is ~1e-14; the nearest other rounding sits at ~1e-8 for f16, ~1e-5 for 8-bit).
pub const EXACT_FIT: f64 = 1e-11;

/// The activation roundings parity knows, in order of preference on ties.
pub const ROUNDINGS: [Emulation; 3] = [Emulation::None, Emulation::GgmlCpu, Emulation::F16];

pub fn rounding_name(r: Emulation) -> &'static str {
    match r {
        Emulation::None => "plain f32",
        Emulation::GgmlCpu => "ggml-cpu (matmul inputs quantized to the weight's vec_dot type)",
        Emulation::F16 => "f16 (matmul inputs rounded to f16)",
    }
}

/// One key's own error.
#[derive(Clone, Debug, Serialize)]
pub struct OpResult {
    pub key: TapKey,
    /// NMSE of the candidate against the reference's recomputation from the candidate's inputs.
    pub own_nmse: f64,
    pub cosine: f64,
    /// All metrics of the candidate against the reference's recomputation.
    pub metrics: Metrics,
    pub floor: f64,
    pub pass: bool,
    /// Ops recomputed for this key: 1 when judged on its own, more when the candidate lacks
    /// its inputs (a span, e.g. a whole layer from the previous l_out).
    pub span_ops: usize,
    pub class: OpClass,
    /// Whether the candidate stored this tensor in f16 (floor raised to f16's rounding).
    pub f16_storage: bool,
}

/// How well one K/V cache type reproduced the candidate's attention.
#[derive(Clone, Debug, Serialize)]
pub struct KvFit {
    pub kv: KvCache,
    /// Median own NMSE over the keys through attention in the first step's first two layers.
    pub median_nmse: f64,
}

/// How well one rounding reproduced the candidate's matmuls.
#[derive(Clone, Debug, Serialize)]
pub struct RoundingFit {
    pub rounding: Emulation,
    /// Median own NMSE over the keys through a matmul in the detection window.
    pub median_nmse: f64,
}

/// One experiment at the flagged op.
#[derive(Clone, Debug, Serialize)]
pub struct Tried {
    /// `rope-neox` (a catalog mutation), `rms-eps=1e-5`, `rope-theta=500000`, `layout:head-major`.
    pub hypothesis: String,
    /// The candidate's NMSE against the reference under this hypothesis.
    pub nmse: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// Where the bug first shows: the first key out of its floor, or an earlier one where the
    /// confirmed hypothesis removes an own error that sat under its floor (placed by
    /// experiment).
    pub key: TapKey,
    /// The first key out of its noise floor.
    pub flagged: TapKey,
    pub own_nmse: f64,
    pub floor: f64,
    pub span_ops: usize,
    /// The hypothesis that reproduces the candidate within the floor (lowest NMSE wins).
    pub confirmed: Option<String>,
    pub confirmed_nmse: Option<f64>,
    /// The catalog mutation (`Mutation::name()`) the confirmed hypothesis is, if it is one.
    pub catalog: Option<String>,
    /// Other hypotheses that reproduce it too.
    pub also: Vec<String>,
    pub ruled_out: Vec<Tried>,
    /// Whether the text is the heuristic fallback (no experiment reproduced the candidate).
    pub fallback: bool,
    /// Whether the flagged key is within its floor, and the finding stands because a known
    /// bug removes its own error (`hypothesis::below_floor`).
    pub explained: bool,
    pub text: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Judgement {
    pub rounding: Emulation,
    pub fits: Vec<RoundingFit>,
    /// The K/V cache type that reproduces the engine's attention best.
    pub kv: KvCache,
    pub kv_fits: Vec<KvFit>,
    /// Matmul floor in use (follows the trace's median matmul own error).
    pub matmul_floor: f64,
    pub ops: Vec<OpResult>,
    pub first: Option<Finding>,
    /// With every op within its floor: the own errors above f32 noise tested by experiment
    /// (`hypothesis::below_floor`), and the best cut a hypothesis made at each.
    pub below_floor: Vec<hypothesis::BelowFloor>,
    /// Declared layouts aligned on load, as `tap: layout`.
    pub aligned: Vec<String>,
}

impl Judgement {
    pub fn passed(&self) -> bool {
        self.first.is_none()
    }
}

/// How well a replay reproduced the candidate's matmuls: the median own NMSE over the matmuls
/// judged on their own, else over the spans through a matmul.
fn fit(cand: &Candidate, r: &replay::Replay) -> Option<f64> {
    let (mut own, mut spans) = (Vec::new(), Vec::new());
    for (k, m) in &r.metrics {
        let s = span(cand, k);
        if s.len() == 1 && class(k.tap) == OpClass::Matmul {
            own.push(m.nmse);
        } else if s.iter().any(|x| class(x.tap) == OpClass::Matmul) {
            spans.push(m.nmse);
        }
    }
    median(own).or(median(spans))
}

/// Where the rounding is measured: around the trace's first matmul judged on its own (two
/// layers from it, or the output projection alone when only result_norm and logits are
/// dumped), else the first step's first two layers.
fn detection_window(cand: &Candidate, first_step: usize) -> Window {
    let n_layer = cand.config.n_layer;
    let own_mm = cand
        .trace
        .keys()
        .find(|k| class(k.tap) == OpClass::Matmul && span(cand, k).len() == 1);
    match own_mm {
        Some(k) => {
            let w = Window::for_key(cand, k);
            match k.layer {
                Some(l) => {
                    let l_end = (l + 2).min(n_layer);
                    Window {
                        l_end,
                        end: l_end == n_layer,
                        ..w
                    }
                }
                None => w,
            }
        }
        None => Window {
            s_max: first_step,
            l0: 0,
            l_end: n_layer.min(2),
            end: n_layer <= 2,
        },
    }
}

/// Judge `trace` against `model`: own error per key, rounding, first op out of its floor, and
/// (with `opt.hypotheses`) the bug named by experiment.
pub fn judge(model: &Model, trace: &Trace, opt: &JudgeOptions) -> Result<Judgement, JudgeError> {
    let cand = Candidate::new(trace, &model.config)?;
    let steps = cand.steps();
    for k in trace.keys() {
        if !steps.contains(&k.step) {
            return Err(JudgeError::MissingStep(k.step));
        }
        if k.layer.is_some_and(|l| l >= model.config.n_layer) {
            return Err(JudgeError::NoSuchLayer {
                key: *k,
                n_layer: model.config.n_layer,
            });
        }
    }
    let s_max = steps.iter().copied().max().ok_or(JudgeError::Empty)?;
    if trace.keys().next().is_none() {
        return Err(JudgeError::Empty);
    }
    let n_layer = model.config.n_layer;
    let none = BTreeSet::new();

    // The rounding: the one that reproduces the candidate's matmuls best, measured in a small
    // window (`detection_window`). ggml-cpu first (what most engines that match llama.cpp do); skipped when it rounds no
    // weight of this model (F32: the same arithmetic as plain f32, reported as plain).
    let mut roundings = opt.roundings.clone();
    if roundings.is_empty() {
        roundings = ROUNDINGS.to_vec();
    }
    if roundings.len() > 1 {
        let ggml_rounds = model
            .layers
            .iter()
            .flat_map(|l| {
                [
                    l.wq.ty,
                    l.wk.ty,
                    l.wv.ty,
                    l.wo.ty,
                    l.w_gate.ty,
                    l.w_up.ty,
                    l.w_down.ty,
                ]
            })
            .chain([model.output.ty])
            .any(|ty| floor::rounds_inputs(Emulation::GgmlCpu, ty));
        roundings.retain(|&r| r != Emulation::GgmlCpu);
        if ggml_rounds {
            roundings.insert(0, Emulation::GgmlCpu);
        }
    }
    let first_step = steps.iter().copied().min().unwrap_or(0);
    let detect = detection_window(&cand, first_step);
    let mut fits = Vec::new();
    // (rounding, fit, its replay, whether that replay covered the whole trace)
    let mut best: Option<(Emulation, f64, replay::Replay, bool)> = None;
    if roundings.len() > 1 {
        for &r in &roundings {
            let setup = Setup {
                rounding: r,
                kv: KvCache::F32,
                mutation: None,
                rms_eps: None,
                rope_theta: None,
                window: detect,
            };
            let rep = replay(model, &cand, &setup, &none)?;
            let (f, rep, whole) = match fit(&cand, &rep) {
                Some(f) => (f, rep, detect == Window::full(n_layer, s_max)),
                None => {
                    // Nothing through a matmul in the window: measure on the whole trace.
                    let full = Setup {
                        window: Window::full(n_layer, s_max),
                        ..setup
                    };
                    let rep = replay(model, &cand, &full, &none)?;
                    (fit(&cand, &rep).unwrap_or(0.0), rep, true)
                }
            };
            fits.push(RoundingFit {
                rounding: r,
                median_nmse: f,
            });
            if best.as_ref().is_none_or(|b| f < b.1) {
                best = Some((r, f, rep, whole));
            }
            // A rounding that reproduces the matmuls to f32 summation noise cannot be beaten.
            if f <= EXACT_FIT {
                break;
            }
        }
    }
    let rounding = best.as_ref().map_or(roundings[0], |b| b.0);

    // The K/V cache type: the one whose replay reproduces the candidate's attention best, in
    // the first step's first two layers (every prompt row reads the cache, its own K/V too).
    // An f16 cache (llama.cpp's default) moves attention by ~1e-8..1e-7 and a whole-layer
    // span by as much: reproduced, the own errors drop back to f32 noise, and a small bug
    // under the floors stays visible to the below-floor experiments.
    let mut kv = opt.kv_caches.first().copied().unwrap_or_default();
    let mut kv_fits = Vec::new();
    if opt.kv_caches.len() > 1 {
        let window = Window {
            s_max: first_step,
            l0: 0,
            l_end: n_layer.min(2),
            end: n_layer <= 2,
        };
        for &c in &opt.kv_caches {
            let setup = Setup {
                rounding,
                kv: c,
                mutation: None,
                rms_eps: None,
                rope_theta: None,
                window,
            };
            let rep = replay(model, &cand, &setup, &none)?;
            let through_attention: Vec<f64> = rep
                .metrics
                .iter()
                .filter(|(k, _)| {
                    span(&cand, k)
                        .iter()
                        .any(|x| class(x.tap) == OpClass::Attention)
                })
                .map(|(_, m)| m.nmse)
                .collect();
            let Some(m) = median(through_attention) else {
                break; // nothing through attention to tell them apart
            };
            kv_fits.push(KvFit {
                kv: c,
                median_nmse: m,
            });
        }
        // Another type only when it reproduces the attention clearly better (2x).
        if let Some(first) = kv_fits.first() {
            let mut best = first;
            for f in &kv_fits[1..] {
                if f.median_nmse * 2.0 < best.median_nmse {
                    best = f;
                }
            }
            kv = best.kv;
        }
    }

    // The whole trace under the chosen rounding and cache (unless detection already ran it
    // whole).
    let full = Window::full(n_layer, s_max);
    let rep = match best {
        Some((_, _, rep, true)) if kv == KvCache::F32 => rep,
        _ => {
            let setup = Setup {
                rounding,
                kv,
                mutation: None,
                rms_eps: None,
                rope_theta: None,
                window: full,
            };
            replay(model, &cand, &setup, &none)?
        }
    };

    // Floors.
    let pos_max = trace
        .manifest
        .steps
        .iter()
        .flat_map(|s| s.positions.iter().copied())
        .max()
        .unwrap_or(0);
    let mut floors = Floors::new(model, rounding, pos_max);
    let spans: Vec<(TapKey, BTreeSet<TapKey>)> =
        rep.metrics.keys().map(|k| (*k, span(&cand, k))).collect();
    let own_mm: Vec<f64> = spans
        .iter()
        .filter(|(k, s)| s.len() == 1 && class(k.tap) == OpClass::Matmul)
        .map(|(k, _)| rep.metrics[k].nmse)
        .collect();
    let span_mm: Vec<f64> = spans
        .iter()
        .filter(|(_, s)| s.len() > 1 && s.iter().any(|x| class(x.tap) == OpClass::Matmul))
        .map(|(k, _)| rep.metrics[k].nmse)
        .collect();
    floors.mm_median_own = median(own_mm);
    floors.mm_median_span = median(span_mm);
    // Emulating an f16 cache brings most spans to f32 noise, but an f32 ulp upstream can
    // round a K/V value to the other f16 neighbour, and 8-bit activation rounding downstream
    // amplifies that flip (2.6e-5 on a 64-wide fixture whose other spans are exact): the
    // span floors are never tighter than without the emulation.
    if kv == KvCache::F16
        && let Some(f) = kv_fits.iter().find(|f| f.kv == KvCache::F32)
    {
        floors.mm_median_span = Some(floors.mm_median_span.unwrap_or(0.0).max(f.median_nmse));
    }

    let mut ops = Vec::with_capacity(spans.len());
    for (k, s) in &spans {
        let m: &Metrics = &rep.metrics[k];
        let f16 = rep.f16_storage.contains(k);
        let mut fl = floors.key(k, s);
        if f16 {
            fl = fl.max(floor::F16_STORAGE);
        }
        let pass = !m.non_finite_failure() && m.nmse <= fl;
        ops.push(OpResult {
            key: *k,
            own_nmse: m.nmse,
            cosine: m.cosine,
            metrics: *m,
            floor: fl,
            pass,
            span_ops: s.len(),
            class: class(k.tap),
            f16_storage: f16,
        });
    }
    let mut below_floor = Vec::new();
    let first = match ops.iter().find(|o| !o.pass) {
        Some(o) => Some(hypothesis::diagnose(
            model,
            &cand,
            &floors,
            kv,
            o,
            &ops,
            opt.hypotheses,
        )?),
        None => {
            let (checks, found) =
                hypothesis::below_floor(model, &cand, &floors, kv, &ops, opt.hypotheses)?;
            below_floor = checks;
            if let Some(f) = &found
                && let Some(o) = ops.iter_mut().find(|o| o.key == f.flagged)
            {
                // Not noise: a known bug reproduces it.
                o.pass = false;
            }
            found
        }
    };
    let aligned = cand
        .layouts
        .iter()
        .map(|(t, l)| format!("{t}: {}", l.name(*t)))
        .collect();
    Ok(Judgement {
        rounding,
        fits,
        kv,
        kv_fits,
        matmul_floor: floors.matmul(),
        ops,
        first,
        below_floor,
        aligned,
    })
}

/// The judgement for people: the rounding, a per-step summary, the finding.
pub fn render(j: &Judgement) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "== own error: each op recomputed by the reference from the candidate's own inputs"
    );
    if !j.fits.is_empty() {
        let fits: Vec<String> = j
            .fits
            .iter()
            .map(|f| format!("{} {:.1e}", short(f.rounding), f.median_nmse))
            .collect();
        let _ = writeln!(
            s,
            "rounding that reproduces the engine: {} (median matmul own NMSE: {}{})",
            rounding_name(j.rounding),
            fits.join(", "),
            if j.fits.last().is_some_and(|f| f.median_nmse <= EXACT_FIT) {
                "; an exact fit ends the search"
            } else {
                ""
            }
        );
    } else {
        let _ = writeln!(s, "rounding (given): {}", rounding_name(j.rounding));
    }
    if j.kv_fits.len() > 1 {
        let fits: Vec<String> = j
            .kv_fits
            .iter()
            .map(|f| format!("{} {:.1e}", f.kv.name(), f.median_nmse))
            .collect();
        let _ = writeln!(
            s,
            "K/V cache that reproduces the engine: {} (median own NMSE through attention: {})",
            j.kv.name(),
            fits.join(", ")
        );
    } else if j.kv != KvCache::F32 {
        let _ = writeln!(s, "K/V cache (given): {}", j.kv.name());
    }
    if !j.aligned.is_empty() {
        let _ = writeln!(s, "declared layouts aligned: {}", j.aligned.join(", "));
    }
    let spans = j.ops.iter().filter(|o| o.span_ops > 1).count();
    let _ = writeln!(
        s,
        "{} keys judged ({} on their own, {} as spans of ops the trace has no taps inside); matmul floor {:.0e}",
        j.ops.len(),
        j.ops.len() - spans,
        spans,
        j.matmul_floor
    );
    let mut by_step: std::collections::BTreeMap<usize, (usize, usize, f64, f64)> =
        Default::default();
    for o in &j.ops {
        let e = by_step.entry(o.key.step).or_insert((0, 0, 0.0, 0.0));
        e.0 += 1;
        e.1 += !o.pass as usize;
        // Worst margin: own NMSE / floor.
        let ratio = if o.floor > 0.0 {
            o.own_nmse / o.floor
        } else {
            0.0
        };
        if ratio > e.2 {
            e.2 = ratio;
            e.3 = o.own_nmse;
        }
    }
    for (step, (n, bad, ratio, _)) in &by_step {
        let _ = writeln!(
            s,
            "  step {step}: {n} keys, {bad} out of their floor, worst own/floor {}",
            if *ratio > 0.0 {
                format!("{ratio:.1e}")
            } else {
                "0 (exact)".into()
            }
        );
    }
    if !j.below_floor.is_empty() {
        let checks: Vec<String> = j
            .below_floor
            .iter()
            .map(|b| match &b.best {
                Some(t) => format!(
                    "{} {:.1e} (best {} {:.1e}, cut {})",
                    b.key,
                    b.own_nmse,
                    t.hypothesis,
                    t.nmse,
                    match b.cut() {
                        c if c < 100.0 => format!("{c:.1}×"),
                        c => format!("{c:.1e}×"),
                    }
                ),
                None => format!("{} {:.1e} (no hypothesis applies)", b.key, b.own_nmse),
            })
            .collect();
        let _ = writeln!(
            s,
            "under the floors, tested by experiment (a known bug that cuts an own error {:.0}× is a finding): {}",
            hypothesis::EXPLAINS,
            checks.join("; ")
        );
    }
    match &j.first {
        None => {
            let _ = writeln!(s, "own error: every op within its noise floor");
        }
        Some(f) => {
            let _ = writeln!(s, "{}", f.text);
        }
    }
    s
}

pub fn short(r: Emulation) -> &'static str {
    match r {
        Emulation::None => "plain-f32",
        Emulation::GgmlCpu => "ggml-cpu",
        Emulation::F16 => "f16",
    }
}
