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

pub mod ambiguity;
pub mod floor;
pub mod hypothesis;
pub mod kv_fit;
pub mod layout;
pub mod lookup;
pub mod nonfinite;
pub mod normscale;
pub mod opclass;
pub mod position;
pub mod replay;
pub mod rope_fit;
pub mod rounding;
pub mod span;
pub mod verdict;
pub mod zoom;

use crate::backend::mutation::Mutation;
use crate::backend::positions::RopeAt;
use crate::backend::{BackendError, Emulation};
use crate::compare::{CompareError, Metrics};
use crate::gguf::GgufError;
use crate::model::{Model, ModelError};
use crate::trace::{Tap, TapKey, Trace, TraceError};
use floor::{Floors, OpClass, class, median};
use layout::Layout;
use replay::{Candidate, KvCache, Setup, Window, replay};
pub use rounding::{EXACT_FIT, KvFit, ROUNDINGS, RoundingFit, rounding_name};
use serde::Serialize;
use span::{SpanOps, span};
use std::collections::BTreeSet;

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
    #[error("{key}: the manifest lists head {head} kept, and the model has {n_head} heads")]
    NoSuchHead {
        key: TapKey,
        head: usize,
        n_head: usize,
    },
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
    /// K/V caches to try (the best one is kept); empty (the default): the cache the trace
    /// declares ([`declared_kv`]), else every one parity emulates ([`KvCache::candidates`]).
    pub kv_caches: Vec<KvCache>,
    /// Run the experiments at the first flagged op.
    pub hypotheses: bool,
}

impl Default for JudgeOptions {
    fn default() -> Self {
        JudgeOptions {
            roundings: ROUNDINGS.to_vec(),
            kv_caches: Vec::new(),
            hypotheses: true,
        }
    }
}

/// The K/V caches to try on `trace` when none is given: a llama.cpp golden's own (its
/// `type_k`, `type_v` and flash attention as resolved: exactly that one); for another producer
/// whose settings name `type_k` and `type_v`, the caches of those types (its arithmetic is
/// measured); else every cache parity emulates for this head size, in order of preference.
pub fn declared_kv(trace: &Trace, head_dim: usize, n_embd_kv: usize) -> Vec<KvCache> {
    let p = &trace.manifest.producer;
    let all = KvCache::candidates(head_dim, n_embd_kv);
    if (p.name == "llama.cpp" || p.backend.starts_with("llama.cpp"))
        && let Some(kv) = KvCache::from_llama_settings(&p.settings)
    {
        return vec![kv];
    }
    let ty = |f: &str| {
        p.settings
            .get(f)
            .and_then(|v| v.as_str())
            .and_then(replay::CacheType::parse)
    };
    match (ty("type_k"), ty("type_v")) {
        (Some(k), Some(v)) => {
            let mut c: Vec<KvCache> = all.into_iter().filter(|c| c.k == k && c.v == v).collect();
            if c.is_empty() {
                // A mix parity does not try by default (K q8_0 / V f16): plain and llama.cpp's.
                let plain = KvCache {
                    v,
                    ..KvCache::plain(k)
                };
                c = vec![
                    plain,
                    KvCache::llama_cpp(k, v, false),
                    KvCache::llama_cpp(k, v, true),
                ];
            }
            c
        }
        _ => all,
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
    /// Whether its floor was raised to what its clean replays differ by (`ambiguity`).
    pub ambiguous: bool,
}

/// What one experiment tried: a catalog bug (with the width fitted where it takes one), a
/// fitted value of a knob, the candidate's own tensor read in another layout, or the RoPE
/// positions solved from the trace. Reports and JSON write it by its name ([`Hypothesis::name`],
/// `rope-neox`, `rms-eps=1e-5`, `layout:head-major`, `rope-at:q,k=p+1@0`); the judge decides
/// on the value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Hypothesis {
    Catalog(Mutation),
    Knob(replay::Knob, f32),
    Layout(Layout, Tap),
    RopeAt(RopeAt),
}

impl Hypothesis {
    pub fn name(&self) -> String {
        match *self {
            Hypothesis::Catalog(m) => m.name().to_string(),
            Hypothesis::Knob(k, v) => hypothesis::knob_name(k, v),
            Hypothesis::Layout(l, tap) => format!("layout:{}", l.name(tap)),
            Hypothesis::RopeAt(r) => r.name(),
        }
    }

    /// A value of a continuous knob (not a catalog bug): confirmed on the strongest evidence.
    pub fn is_knob(&self) -> bool {
        matches!(self, Hypothesis::Knob(..))
    }

    /// A fitted constant factor on one op's output.
    pub fn is_scale(&self) -> bool {
        matches!(self, Hypothesis::Knob(replay::Knob::OutputScale(..), _))
    }
}

impl std::fmt::Display for Hypothesis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl Serialize for Hypothesis {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

/// One experiment at the flagged op.
#[derive(Clone, Debug, Serialize)]
pub struct Tried {
    /// What was tried (written by its name).
    pub hypothesis: Hypothesis,
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
    /// The confirmed hypothesis, typed (`confirmed` is its name).
    #[serde(skip)]
    pub hypothesis: Option<Hypothesis>,
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
    /// Hypotheses that reproduce the key but not the rest of the trace: (name, why not).
    #[serde(skip)]
    pub contradicted: Vec<(String, String)>,
    pub text: String,
    /// The token position it first shows at (`position::locate`).
    pub position: Option<crate::compare::position::Position>,
    /// Judged as a span at a step the trace did not record whole: the step to record whole.
    pub zoom: Option<crate::trace::Zoom>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Judgement {
    pub rounding: Emulation,
    /// The decode steps' rounding where it differs from the prefill's (`rounding`).
    pub decode_rounding: Option<Emulation>,
    pub fits: Vec<RoundingFit>,
    /// How each rounding fitted the first decode step, the prefill under `rounding`.
    pub decode_fits: Vec<RoundingFit>,
    /// The output projection's rounding where it differs from its step's (an engine whose
    /// lm_head runs another kernel), and how each rounding fitted the first step's logits.
    pub output_rounding: Option<Emulation>,
    pub output_fits: Vec<RoundingFit>,
    /// Whether `rounding` (or the output projection's) was measured again with the bug in
    /// view, after the first measurement rested on data the bug had moved (the finding says
    /// how); `fits` are the first measurement's.
    pub remeasured: bool,
    /// The K/V cache type that reproduces the engine's attention best.
    pub kv: KvCache,
    pub kv_fits: Vec<KvFit>,
    /// The cache the decode steps read where it differs from the prompt's (`kv`), and how
    /// each cache fitted the first decode step's attention (empty: not measured).
    pub kv_decode: Option<KvCache>,
    pub kv_decode_fits: Vec<KvFit>,
    /// Matmul floor in use (follows the trace's median matmul own error).
    pub matmul_floor: f64,
    pub ops: Vec<OpResult>,
    pub first: Option<Finding>,
    /// With every op within its floor: the own errors above f32 noise tested by experiment
    /// (`hypothesis::below_floor`), and the best cut a hypothesis made at each.
    pub below_floor: Vec<hypothesis::BelowFloor>,
    /// Declared layouts aligned on load, as `tap: layout`.
    pub aligned: Vec<String>,
    /// Keys a tie twin of the chosen rounding reproduces closer (an element on a rounding tie
    /// took the other neighbour), with that twin: judged under it.
    pub ties: Vec<(TapKey, Emulation)>,
    /// Undeclared layouts named by experiment, in the order found: each was aligned and the
    /// judging went on, so `first` is the first divergence after them (or, when nothing else
    /// diverges, the last layout's finding).
    pub layouts: Vec<Finding>,
    /// How many of the judged keys the trace kept cut (`kq_soft_max` for some heads or rows).
    pub cut: usize,
}

impl Judgement {
    pub fn passed(&self) -> bool {
        self.first.is_none()
    }

    /// Where the bug first shows: THE place of the verdict, the one the text names ("placed
    /// by experiment at …", else the flagged key) and the JSON's `first_divergence` reads.
    pub fn place(&self) -> Option<TapKey> {
        self.first.as_ref().map(|f| f.key)
    }

    /// What this judgement cannot see, in the verdict's words (empty when it judged every op
    /// on its own at the tight floors): a matmul floor widened because no known rounding
    /// reproduces the engine, and keys judged as spans of ops the trace has no taps inside.
    pub fn limits(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.matmul_floor > floor::MM_ABS {
            v.push(format!(
                "no known activation rounding reproduces this engine's matmuls to f32 noise (closest: {}), so the matmul floor follows its own error up to {:.0e}: a bug that moves a matmul by less is not seen",
                rounding_label(self),
                self.matmul_floor
            ));
        }
        let spans: Vec<&OpResult> = self.ops.iter().filter(|o| o.span_ops > 1).collect();
        if !spans.is_empty() {
            let widest = spans.iter().map(|o| o.floor).fold(0.0f64, f64::max);
            v.push(format!(
                "{} of {} keys are judged as spans of ops the trace has no taps inside (floors up to {widest:.0e}): there a bug is placed to the span, and one that moves it by less than its floor is seen only where a known bug explains it by experiment — dump every tap to judge each op on its own",
                spans.len(),
                self.ops.len()
            ));
        }
        if self.cut > 0 {
            v.push(format!(
                "{} kq_soft_max tensors were kept for some heads or rows: judged on those alone, the attention output after each as a span of the two ops (where it was recorded)",
                self.cut
            ));
        }
        v
    }
}

/// How many undeclared layouts one judgement names and aligns before it stops going on.
const MAX_LAYOUTS: usize = 4;

/// Judge `trace` against `model` (see [`judge_once`]); a layout named by experiment (an
/// undeclared head-major q_rope) is aligned and the trace judged again, so the report names
/// the layout *and* the real first divergence after it.
pub fn judge(model: &Model, trace: &Trace, opt: &JudgeOptions) -> Result<Judgement, JudgeError> {
    let mut named: Vec<(Tap, Layout)> = Vec::new();
    let mut layouts: Vec<Finding> = Vec::new();
    // The judgement that named the first layout: the verdict when nothing else diverges.
    let mut first_layout: Option<Judgement> = None;
    loop {
        let mut j = judge_once(model, trace, opt, &named)?;
        let layout = j.first.as_ref().and_then(|f| match f.hypothesis? {
            Hypothesis::Layout(l, tap) => Some((tap, l)),
            _ => None,
        });
        match layout {
            Some(l) if layouts.len() < MAX_LAYOUTS && !named.contains(&l) => {
                named.push(l);
                layouts.push(j.first.clone().expect("a layout finding"));
                if first_layout.is_none() {
                    first_layout = Some(j);
                }
            }
            _ => {
                if let Some(f) = &mut j.first
                    && !layouts.is_empty()
                {
                    let names: Vec<String> = layouts
                        .iter()
                        .map(|l| {
                            format!("{} {}", l.key, l.confirmed.as_deref().unwrap_or_default())
                        })
                        .collect();
                    f.text = format!(
                        "layout named by experiment first (the numbers right, stored in another order; aligned, and the judging went on): {}\n{}",
                        names.join(", "),
                        f.text
                    );
                }
                if j.first.is_none()
                    && let Some(mut f) = first_layout
                {
                    // Nothing else diverges: the layout is the finding (its own judgement,
                    // where the tap stands out of its floor), every layout named in it.
                    if let (Some(first), true) = (&mut f.first, named.len() > 1) {
                        let rest: Vec<String> = layouts[1..]
                            .iter()
                            .map(|l| {
                                format!("{} {}", l.key, l.confirmed.as_deref().unwrap_or_default())
                            })
                            .collect();
                        let all: Vec<String> = named
                            .iter()
                            .map(|(tap, l)| format!("\"{tap}\": \"{}\"", l.name(*tap)))
                            .collect();
                        first.text.push_str(&format!(
                            "\n  stored in another order too (named by experiment, aligned, and nothing else diverges): {}; declare them all: \"layouts\": {{{}}}",
                            rest.join(", "),
                            all.join(", ")
                        ));
                    }
                    f.layouts = layouts;
                    return Ok(f);
                }
                j.layouts = layouts;
                return Ok(j);
            }
        }
    }
}

/// Judge `trace` against `model`: own error per key, rounding, first op out of its floor, and
/// (with `opt.hypotheses`) the bug named by experiment; `layouts`: taps stored in a layout
/// named by experiment, aligned like declared ones.
fn judge_once(
    model: &Model,
    trace: &Trace,
    opt: &JudgeOptions,
    layouts: &[(Tap, Layout)],
) -> Result<Judgement, JudgeError> {
    let mut cand = Candidate::new(trace, &model.config)?;
    cand.layouts.extend(layouts.iter().copied());
    let steps = checked_steps(model, trace, &cand)?;
    steps.iter().max().ok_or(JudgeError::Empty)?;
    let first_step = steps.iter().copied().min().unwrap_or(0);

    // The guard: a NaN or an Inf in the candidate is the finding, and no experiment runs on it.
    let bad = nonfinite::first(&cand)?;
    let guarded = JudgeOptions {
        hypotheses: opt.hypotheses && bad.is_none(),
        kv_caches: match opt.kv_caches.is_empty() {
            true => declared_kv(trace, model.config.head_dim, model.config.n_embd_kv()),
            false => opt.kv_caches.clone(),
        },
        ..opt.clone()
    };
    let at = Judging {
        model,
        cand: &cand,
        opt: &guarded,
        steps: &steps,
        first_step,
        declared: layouts,
        bad,
        experiments: opt.hypotheses,
    };

    let mut measured = rounding::measure(model, &cand, &guarded, first_step, &BTreeSet::new())?;
    // A rounding measured again with the bug in view (`under_other_roundings`,
    // `layers_with_the_bug`) judges the trace once more under it, with this note.
    let mut remeasured: Option<String> = None;
    // The judgement a below-floor screen under another rounding and cache set aside
    // (`under_other_setups`): it stands where judging again confirms nothing.
    let mut held: Option<Judgement> = None;
    loop {
        let unsure = measured.unsure;
        let (mut j, floors) = at.pass(measured, held.is_some())?;
        let again = match at.first_out(&mut j, &floors, unsure, remeasured.is_some())? {
            Outcome::Again(again) => again,
            Outcome::Judged {
                first,
                below_floor,
                retry,
            } => {
                j.first = first.map(|f| *f);
                j.below_floor = below_floor;
                j.remeasured = remeasured.is_some();
                place(model, &cand, &mut j, remeasured.as_deref())?;
                let Some(again) = retry else {
                    // Judged again only for a bug under the floors: without one confirmed
                    // there, the measured setup's judgement stands.
                    return Ok(match held {
                        Some(h) if j.first.as_ref().is_none_or(|f| f.confirmed.is_none()) => h,
                        _ => j,
                    });
                };
                measured = measured_again(&j, &again);
                remeasured = Some(again.note);
                held = Some(j);
                continue;
            }
        };
        measured = measured_again(&j, &again);
        remeasured = Some(again.note);
    }
}

/// Another setup to judge the trace under: its rounding (the floors'), its cache, and the
/// note that says why.
struct Again {
    floors: Floors,
    kv: KvCache,
    note: String,
}

impl From<(Floors, KvCache, String)> for Again {
    fn from((floors, kv, note): (Floors, KvCache, String)) -> Again {
        Again { floors, kv, note }
    }
}

/// What a pass's first op out of its floor comes to (or, with none, the screen under the
/// floors).
enum Outcome {
    /// The finding (none: the trace passed), the checks under the floors, and another setup
    /// that screen asks to judge the trace under (the finding made there stands only where
    /// it confirms a bug).
    Judged {
        first: Option<Box<Finding>>,
        below_floor: Vec<hypothesis::BelowFloor>,
        retry: Option<Again>,
    },
    /// A bug named under a rounding measured again with it in view: judge the trace again
    /// under that rounding at once.
    Again(Again),
}

/// The setup a judgement measured, kept but for its rounding (the floors') and cache, to
/// judge the trace again under those.
fn measured_again(j: &Judgement, again: &Again) -> rounding::Measured {
    rounding::Measured {
        rounding: again.floors.rounding,
        decode: j.decode_rounding,
        decode_fits: j.decode_fits.clone(),
        output: again.floors.output,
        output_fits: j.output_fits.clone(),
        unsure: rounding::Unsure::default(),
        fits: j.fits.clone(),
        best: None,
        kv: again.kv,
        kv_fits: j.kv_fits.clone(),
        kv_decode: j.kv_decode,
        kv_decode_fits: j.kv_decode_fits.clone(),
    }
}

/// What one judgement holds fixed across its passes.
struct Judging<'a> {
    model: &'a Model,
    cand: &'a Candidate<'a>,
    /// The options guarded: no experiments on non-finite data, the caches to try.
    opt: &'a JudgeOptions,
    steps: &'a [usize],
    first_step: usize,
    /// The layouts named by experiment before this judgement (the rest `cand` aligns were
    /// declared).
    declared: &'a [(Tap, Layout)],
    /// The candidate's first non-finite values.
    bad: Option<nonfinite::NonFinite>,
    /// Whether experiments were asked for (the guard turns them off on non-finite data; the
    /// non-finite finding still says what they would have tried).
    experiments: bool,
}

impl Judging<'_> {
    /// The trace judged under a measured setup, each op against its floor, before its first
    /// finding; `held`: under the setup a below-floor screen chose, that rounding given (its
    /// tie twin, closer nowhere worse on data the bug moved, would take its place again in
    /// `rounding::refit_ties`).
    fn pass(&self, m: rounding::Measured, held: bool) -> Result<(Judgement, Floors), JudgeError> {
        let rounding::Measured {
            rounding,
            decode,
            decode_fits,
            output,
            output_fits,
            unsure: _,
            fits,
            best,
            kv,
            kv_fits,
            kv_decode,
            kv_decode_fits,
        } = m;
        let opt = match held {
            true => JudgeOptions {
                roundings: vec![rounding],
                ..self.opt.clone()
            },
            false => self.opt.clone(),
        };
        let Pass {
            rounding,
            kv,
            kv_decode,
            kv_decode_fits,
            ties,
            floors,
            ops,
        } = pass(
            self.model,
            self.cand,
            &opt,
            self.steps,
            Measure {
                rounding,
                decode,
                output,
                best,
                kv,
                kv_fits: &kv_fits,
                kv_decode,
                kv_decode_fits,
            },
        )?;
        let aligned = self
            .cand
            .layouts
            .iter()
            .filter(|(t, _)| !self.declared.iter().any(|(n, _)| n == *t))
            .map(|(t, l)| format!("{t}: {}", l.name(*t)))
            .collect();
        let cut = ops
            .iter()
            .filter(|o| self.cand.cut(&o.key).is_some())
            .count();
        let j = Judgement {
            rounding,
            decode_rounding: decode,
            fits,
            decode_fits,
            output_rounding: output,
            output_fits,
            remeasured: false,
            kv,
            kv_fits,
            kv_decode,
            kv_decode_fits,
            matmul_floor: floors.matmul(),
            ops,
            first: None,
            below_floor: Vec::new(),
            aligned,
            ties,
            layouts: Vec::new(),
            cut,
        };
        Ok((j, floors))
    }

    /// The first finding of a pass: non-finite data (the candidate's, else the
    /// recomputation's), else the first op out of its floor diagnosed, else a bug a known
    /// hypothesis confirms under the floors. (A tap the model's graph has no op for is not
    /// judged, its values neither.) `remeasured`: this pass is already the judgement again.
    fn first_out(
        &self,
        j: &mut Judgement,
        floors: &Floors,
        unsure: rounding::Unsure,
        remeasured: bool,
    ) -> Result<Outcome, JudgeError> {
        let (model, cand, opt, kv) = (self.model, self.cand, self.opt, j.kv);
        let found = |first| Outcome::Judged {
            first: Some(Box::new(first)),
            below_floor: Vec::new(),
            retry: None,
        };
        // A finite op out of its floor before the first non-finite value is where the engine
        // first diverges, the overflow a consequence: an engine without its FFN norm on a
        // generated 16-layer model is off at layer 0's ffn_norm and overflows at layer 8,
        // where a bug that scales the residual stream "reproduced" the same Inf places.
        let earlier = |b: &nonfinite::NonFinite| {
            j.ops
                .iter()
                .find(|o| !o.pass)
                .is_some_and(|o| o.key < b.key && !o.metrics.non_finite_failure())
        };
        if let Some((b, o)) = self
            .bad
            .filter(|b| !earlier(b))
            .and_then(|b| Some((b, j.ops.iter().find(|o| o.key == b.key)?)))
        {
            let f = nonfinite::candidate(
                model,
                cand,
                floors,
                kv,
                &b,
                o,
                self.experiments,
                &opt.roundings,
            )?;
            return Ok(found(f));
        }
        let Some(o) = j.ops.iter().find(|o| !o.pass) else {
            return self.below_floors(j, floors, remeasured);
        };
        if o.metrics.non_finite_failure() {
            let b = nonfinite::NonFinite {
                key: o.key,
                nan: o.metrics.nan_a,
                inf: o.metrics.inf_a,
                n: o.metrics.n,
                whose: "the reference's recomputation from the candidate's finite inputs",
            };
            return Ok(found(nonfinite::recomputed(&b, o)));
        }
        let ops = &j.ops;
        // Experiments run on the finite part of a trace that overflows later (`earlier`).
        let f = hypothesis::diagnose(model, cand, floors, kv, o, ops, self.experiments)?;
        let again = match &f.confirmed {
            _ if remeasured => None,
            None if opt.hypotheses => {
                match under_other_roundings(model, cand, floors, kv, o, ops, &f, unsure, opt)? {
                    None if cache_unsure(kv, &j.kv_fits) => {
                        flagged_under_other_caches(model, cand, floors, kv, o, ops, opt)?
                    }
                    r => r,
                }
            }
            Some(_) => {
                let mut again = None;
                if unsure.layers {
                    again = layers_with_the_bug(
                        model,
                        cand,
                        floors,
                        kv,
                        o,
                        ops,
                        &f,
                        self.first_step,
                        opt,
                    )?
                    .map(|(fl, note)| (fl, kv, note));
                }
                if again.is_none() && cache_unsure(kv, &j.kv_fits) {
                    again = knob_under_other_caches(model, cand, floors, kv, &f, opt)?;
                }
                again
            }
            None => None,
        };
        Ok(match again {
            Some(a) => Outcome::Again(a.into()),
            None => found(f),
        })
    }

    /// Every op within its floor: the own errors above f32 noise tested by experiment; where
    /// none is a known bug, the screen under another rounding and cache (`under_other_setups`)
    /// may ask to judge the trace again.
    fn below_floors(
        &self,
        j: &mut Judgement,
        floors: &Floors,
        remeasured: bool,
    ) -> Result<Outcome, JudgeError> {
        let (model, cand, opt, kv) = (self.model, self.cand, self.opt, j.kv);
        let (checks, found) =
            hypothesis::below_floor(model, cand, floors, kv, &j.ops, opt.hypotheses)?;
        let mut retry = None;
        if found.is_none() && opt.hypotheses && !remeasured {
            // No cache reproduced the attention (a clean trace's cache fits to its own
            // rounding): the cache was measured on data a bug moved.
            let unsure = cache_unsure(kv, &j.kv_fits);
            retry =
                under_other_setups(model, cand, floors, kv, &checks, unsure, opt)?.map(Again::from);
        }
        if let Some(f) = &found
            && opt.hypotheses
            && !remeasured
            && cache_unsure(kv, &j.kv_fits)
        {
            retry = knob_under_other_caches(model, cand, floors, kv, f, opt)?.map(Again::from);
        }
        if let Some(f) = &found
            && let Some(o) = j.ops.iter_mut().find(|o| o.key == f.flagged)
        {
            // Not noise: a known bug reproduces it.
            o.pass = false;
        }
        Ok(Outcome::Judged {
            first: found.map(Box::new),
            below_floor: checks,
            retry,
        })
    }
}

/// What a pass of `judge_once` starts from: the rounding and caches measured (or measured
/// again with the bug in view).
struct Measure<'a> {
    rounding: Emulation,
    decode: Option<Emulation>,
    output: Option<Emulation>,
    best: Option<(Emulation, f64, replay::Replay, bool)>,
    kv: KvCache,
    kv_fits: &'a [rounding::KvFit],
    kv_decode: Option<KvCache>,
    kv_decode_fits: Vec<rounding::KvFit>,
}

/// The ops of a pass against their floors, and the setup they were judged under.
struct Pass {
    rounding: Emulation,
    kv: KvCache,
    kv_decode: Option<KvCache>,
    kv_decode_fits: Vec<rounding::KvFit>,
    ties: Vec<(TapKey, Emulation)>,
    floors: Floors,
    ops: Vec<OpResult>,
}

/// The whole trace replayed under the measured setup, and each op against its floor: the
/// decode steps' cache settled, rounding ties refitted, the floors raised to the trace's own
/// noise and to the ambiguity of sparse spans.
fn pass(
    model: &Model,
    cand: &Candidate,
    opt: &JudgeOptions,
    steps: &[usize],
    m: Measure,
) -> Result<Pass, JudgeError> {
    let Measure {
        rounding,
        decode,
        output,
        best,
        kv,
        kv_fits,
        kv_decode,
        kv_decode_fits,
    } = m;
    let none = BTreeSet::new();
    let n_layer = model.config.n_layer;
    let s_max = steps.iter().copied().max().ok_or(JudgeError::Empty)?;
    let first_step = steps.iter().copied().min().unwrap_or(0);
    // The whole trace under the chosen rounding and cache (unless detection already ran it
    // whole).
    let full = Window::full(n_layer, s_max);
    let whole = |kv: KvCache, kv_decode: Option<KvCache>| Setup {
        decode,
        output,
        kv,
        kv_decode,
        ..Setup::clean(rounding, full)
    };
    let mut rep = match best {
        Some((_, _, rep, true)) if kv == KvCache::F32 && kv_decode.is_none() => rep,
        _ => replay(model, cand, &whole(kv, kv_decode), &none)?,
    };

    // The decode steps' cache, measured where the prompt's leaves their attention above
    // noise.
    let d1 = steps.iter().copied().filter(|&s| s > first_step).min();
    let (kv, kv_decode, kv_decode_fits, kv_from_decode) = decode_cache(
        model,
        cand,
        opt,
        (rounding, decode, output),
        (kv, kv_decode),
        (kv_fits, kv_decode_fits),
        d1,
        &whole,
        &mut rep,
    )?;
    // Floors.
    let pos_max = cand
        .trace
        .manifest
        .steps
        .iter()
        .flat_map(|s| s.positions.iter().copied())
        .max()
        .unwrap_or(0);
    let spans: Vec<(TapKey, SpanOps)> = rep
        .metrics
        .keys()
        .map(|k| (*k, SpanOps::of(&span(cand, k))))
        .collect();
    // Emulating an f16 cache brings most spans to f32 noise, but an f32 ulp upstream can
    // round a K/V value to the other f16 neighbour, and 8-bit activation rounding downstream
    // amplifies that flip (2.6e-5 on a 64-wide fixture whose other spans are exact): the
    // span floors are never tighter than without the emulation.
    // (Where the cache was taken from the decode steps, their f32 fit: the prompt's is the
    // bug's.)
    let fits_of_kv: &[rounding::KvFit] = if kv_from_decode {
        &kv_decode_fits
    } else {
        kv_fits
    };
    let f32_fit = (kv == KvCache::F16)
        .then(|| fits_of_kv.iter().find(|f| f.kv == KvCache::F32))
        .flatten()
        .map(|f| f.median_nmse);
    let setup_floors = |rounding: Emulation| {
        let mut floors = Floors::new(model, rounding, decode, pos_max).with_output(model, output);
        floors.kv_decode = kv_decode;
        floors
    };

    // Rounding ties: a key a tie twin of the chosen rounding reproduces closer keeps the
    // twin's error (an element on a tie may take either neighbour: no bug). Where the
    // rounding is given (a golden's, `--rounding`), the twins are replayed only where a key
    // sits within `rounding::TIE_NEAR` of the lowest floor it can have (the floors before
    // the trace's noise raises them): elsewhere no tie can make a finding, and their
    // replays of a long trace would cost more than the rest of the judgement.
    let near: Option<BTreeSet<TapKey>> = (opt.roundings.len() == 1).then(|| {
        let floors = setup_floors(rounding);
        spans
            .iter()
            .filter(|(k, s)| rep.metrics[k].nmse * rounding::TIE_NEAR > floors.key(k, s))
            .map(|(k, _)| *k)
            .collect()
    });
    let (rounding, ties) = rounding::refit_ties(
        model,
        cand,
        &mut rep,
        rounding,
        decode,
        output,
        (kv, kv_decode),
        full,
        near.as_ref(),
    )?;
    let floors = with_trace_noise(setup_floors(rounding), &spans, &rep, f32_fit);
    let mut ops = op_results(&spans, &rep, &floors);
    ambiguity::refloor(model, cand, &floors, kv, &mut ops)?;
    Ok(Pass {
        rounding,
        kv,
        kv_decode,
        kv_decode_fits,
        ties,
        floors,
        ops,
    })
}

/// The first finding of `j` placed (its first position out of the floor, the zoom that
/// records it whole) and, where the trace was judged again (`remeasured`), said so.
fn place(
    model: &Model,
    cand: &Candidate,
    j: &mut Judgement,
    remeasured: Option<&str>,
) -> Result<(), JudgeError> {
    let at = position::locate(model, cand, j)?;
    if let Some(f) = &mut j.first {
        f.position = at;
        f.zoom = zoom::plan(cand, f);
        if let Some(note) = remeasured {
            // Judged again under what a hypothesis confirmed with, the first op out of its
            // floor may be another one that nothing reproduces: the note then says only that
            // the trace was judged again.
            match f.confirmed {
                Some(_) => f.text.push_str(note),
                None => f
                    .text
                    .push_str(&note.replacen("confirmed with", "judged again with", 1)),
            }
        }
    }
    Ok(())
}

/// `floors` raised to the trace's own matmul noise: the median own error of its single
/// matmuls and of its spans holding one (in `rep`), the spans' never under `f32_fit` (an f16
/// cache's emulation flips values an f32 cache's fit shows).
fn with_trace_noise(
    mut floors: Floors,
    spans: &[(TapKey, SpanOps)],
    rep: &replay::Replay,
    f32_fit: Option<f64>,
) -> Floors {
    let own_mm: Vec<f64> = spans
        .iter()
        .filter(|(k, s)| s.len == 1 && class(k.tap) == OpClass::Matmul)
        .map(|(k, _)| rep.metrics[k].nmse)
        .collect();
    let span_mm: Vec<f64> = spans
        .iter()
        .filter(|(_, s)| s.len > 1 && s.taps.iter().any(|&t| class(t) == OpClass::Matmul))
        .map(|(k, _)| rep.metrics[k].nmse)
        .collect();
    floors.mm_median_own = median(own_mm);
    floors.mm_median_span = median(span_mm);
    if let Some(f) = f32_fit {
        floors.mm_median_span = Some(floors.mm_median_span.unwrap_or(0.0).max(f));
    }
    floors
}

/// Each key's own error against its floor (a tensor the engine stored in f16 never under
/// f16's step), in graph order.
fn op_results(spans: &[(TapKey, SpanOps)], rep: &replay::Replay, floors: &Floors) -> Vec<OpResult> {
    spans
        .iter()
        .map(|(k, s)| {
            let m: &Metrics = &rep.metrics[k];
            let f16 = rep.f16_storage.contains(k);
            let mut fl = floors.key(k, s);
            if f16 {
                fl = fl.max(floor::F16_STORAGE);
            }
            OpResult {
                key: *k,
                own_nmse: m.nmse,
                cosine: m.cosine,
                metrics: *m,
                floor: fl,
                pass: !m.non_finite_failure() && m.nmse <= fl,
                span_ops: s.len,
                class: class(k.tap),
                f16_storage: f16,
                ambiguous: false,
            }
        })
        .collect()
}

/// The decode steps' cache, measured where the prompt's leaves their attention above noise
/// (`rounding::decode_cache`; `d1` the first decode step), and `rep` replayed again under it
/// (the whole trace's setup under a cache: `whole`).
/// Returns the prompt's cache, the decode steps' where it differs, their fits, and whether
/// the prompt's was taken from the decode steps.
#[allow(clippy::too_many_arguments)]
fn decode_cache(
    model: &Model,
    cand: &Candidate,
    opt: &JudgeOptions,
    (rounding, decode, output): (Emulation, Option<Emulation>, Option<Emulation>),
    (mut kv, mut kv_decode): (KvCache, Option<KvCache>),
    (kv_fits, mut kv_decode_fits): (&[rounding::KvFit], Vec<rounding::KvFit>),
    d1: Option<usize>,
    whole: &dyn Fn(KvCache, Option<KvCache>) -> Setup,
    rep: &mut replay::Replay,
) -> Result<(KvCache, Option<KvCache>, Vec<rounding::KvFit>, bool), JudgeError> {
    let mut kv_from_decode = false;
    if let Some(d1) = d1
        && kv_decode_fits.is_empty()
        && opt.kv_caches.len() > 1
        && let Some(under_kv) = rounding::decode_attention_fit(model, cand, rep, d1)
        && under_kv > rounding::KV_DECODE_NOISE
    {
        let (c, fits) = rounding::decode_cache(
            model,
            cand,
            opt,
            (rounding, decode, output),
            (kv, under_kv),
            d1,
        )?;
        kv_decode_fits = fits;
        if let Some(c) = c {
            // Where no cache reproduced the prompt's attention (a bug there outweighs every
            // cache's rounding, and the first tried was kept), the decode steps, which
            // measure it cleanly, say which cache the engine keeps: one cache for both
            // step kinds, as most engines keep.
            let mut prompt: Vec<f64> = kv_fits.iter().map(|f| f.median_nmse).collect();
            prompt.sort_by(f64::total_cmp);
            // None under the cap, and none standing out (the best within 4x of the next):
            // an f16 cache 30x ahead of the rest under 8-bit flips is a measurement.
            let prompt_unmeasured = prompt.len() > 1
                && prompt[0] > rounding::KV_DECODE_CAP
                && prompt[1] < 4.0 * prompt[0];
            if prompt_unmeasured {
                kv = c;
                kv_from_decode = true;
            } else {
                kv_decode = Some(c);
            }
            *rep = replay(model, cand, &whole(kv, kv_decode), &BTreeSet::new())?;
        }
    }
    Ok((kv, kv_decode, kv_decode_fits, kv_from_decode))
}

/// The candidate's steps, every key checked to lie at one of them and in a layer the model has.
fn checked_steps(model: &Model, trace: &Trace, cand: &Candidate) -> Result<Vec<usize>, JudgeError> {
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
        // A cut's heads are checked against the stored axis on load; here against the model.
        let n_head = model.config.n_head;
        if let Some(head) = trace
            .cut(k)
            .and_then(|c| c.heads)
            .and_then(|h| h.into_iter().find(|&h| h >= n_head))
        {
            return Err(JudgeError::NoSuchHead {
                key: *k,
                head,
                n_head,
            });
        }
    }
    if trace.keys().next().is_none() {
        return Err(JudgeError::Empty);
    }
    Ok(steps)
}

/// A diagnosis that confirmed nothing, tried again where the measured rounding may rest on data
/// the bug moved (`rounding::Unsure`): the output projection under each other rounding when the
/// logits are flagged, the layers under each other rounding when a sparse dump's rounding came
/// from its output projection alone. The rounding under which a hypothesis is confirmed closest
/// is the engine's: its floors and cache are returned with the note the finding gets, and the
/// trace is judged again under them.
#[allow(clippy::too_many_arguments)]
fn under_other_roundings(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    o: &OpResult,
    ops: &[OpResult],
    f: &Finding,
    unsure: rounding::Unsure,
    opt: &JudgeOptions,
) -> Result<Option<(Floors, KvCache, String)>, JudgeError> {
    let all = rounding::tried(opt);
    let out_now = floors.output.unwrap_or(floors.rounding);
    let (which, tries): (&str, Vec<Floors>) = if unsure.output && o.key.tap == Tap::Logits {
        let tries = all
            .iter()
            .filter(|&&r| r != out_now)
            .map(|&r| floors.rounded(model, floors.rounding, Some(r)))
            .collect();
        ("the output projection", tries)
    } else if unsure.layers && o.key.layer.is_some() {
        let tries = all
            .iter()
            .filter(|&&r| r != floors.rounding)
            .map(|&r| rounding::layers_as(model, floors, r))
            .collect();
        ("the layers", tries)
    } else {
        return Ok(None);
    };
    // Screened first: each catalog bug and fitted value the diagnosis ruled out, replayed at
    // the key alone under every other rounding; the rounding where one lands within the key's
    // floor, closest, gets the whole diagnosis (confirmed as any: within the floor, cutting
    // the own error widely, holding over the trace). A full diagnosis per rounding (its knob
    // fits, its checks over the trace) costs ten times more on a 2-layer model.
    let closest: Vec<Screened> = f
        .ruled_out
        .iter()
        .filter_map(|t| screened(&t.hypothesis))
        .collect();
    let window = Window::for_key(cand, &o.key);
    let screen = |tries: &[Floors],
                  hyps: &[Screened],
                  kv: KvCache|
     -> Result<Option<(Floors, f64)>, JudgeError> {
        let mut best: Option<(Floors, f64)> = None;
        for fl in tries {
            for &(mutation, knob) in hyps {
                let setup = Setup {
                    mutation,
                    knob,
                    ..floor::clean_setup(fl, kv, window)
                };
                let Some(n) = nmse_at(model, cand, &setup, &o.key)? else {
                    continue;
                };
                if best.as_ref().is_none_or(|b| n < b.1) {
                    best = Some((fl.clone(), n));
                }
            }
        }
        Ok(best)
    };
    // The key's floor under a rounding and cache, as their clean replays differ when their
    // inputs are nudged (a quantized cache is noisier than the measured one), and the whole
    // diagnosis there: confirmed or not.
    let diagnosed = |fl: &Floors, kv2: KvCache| confirmed_under(model, cand, fl, kv2, o, ops);
    let mut found = None;
    if let Some((fl, n)) = screen(&tries, &closest, kv)?
        && n <= o.floor
        && diagnosed(&fl, kv)?
    {
        found = Some((fl, kv));
    }
    // A long prompt read through a cache moves a layer as much as the roundings differ: where
    // no rounding confirms under the measured cache (measured under the wrong rounding, every
    // cache tied there; or a rounding brings a hypothesis within the floor but not `KNOB_CUT`
    // under the own error, the cache's noise left: attention scale 0.2 under Q8_K layers and a
    // Q8_0 cache), the hypotheses that came closest (within 100x of the best, four at
    // most) are screened once more under each other cache parity would try (stored plainly),
    // the measured rounding included, until one lands within the floor. The rounding and cache
    // that bring one within the floor, or closest and closer than any came (a value fitted
    // under the wrong rounding is fitted again there: rms eps 5e-4 under plain f32 and an f32
    // cache, 1e-3 under ggml-cpu and f16), get the whole diagnosis, whose confirmation is held
    // to the same bar as any.
    let other_kv = rounding::plain_caches(opt, Some(kv));
    if found.is_none() && which == "the layers" && !other_kv.is_empty() {
        let near = hypothesis::closest(
            f.ruled_out
                .iter()
                .filter(|t| screened(&t.hypothesis).is_some())
                .cloned(),
        );
        let lowest = near.first().map_or(0.0, |t| t.nmse);
        let near: Vec<Screened> = near
            .iter()
            .filter_map(|t| screened(&t.hypothesis))
            .collect();
        let mut tries2 = vec![floors.clone()];
        tries2.extend(tries.iter().cloned());
        // Every cache screened (one within the floor may still leave the cache's noise that
        // a closer one removes), then the closest diagnosed in turn.
        let mut screened: Vec<(Floors, KvCache, f64)> = Vec::new();
        for kv2 in other_kv {
            if let Some((fl, n)) = screen(&tries2, &near, kv2)?
                && (n <= o.floor || n < lowest)
            {
                screened.push((fl, kv2, n));
            }
        }
        screened.sort_by(|a, b| a.2.total_cmp(&b.2));
        for (fl, kv2, _) in screened.into_iter().take(2) {
            if diagnosed(&fl, kv2)? {
                found = Some((fl, kv2));
                break;
            }
        }
    }
    let Some((fl, kv2)) = found else {
        return Ok(None);
    };
    let (r, r_now) = match which {
        "the layers" => (fl.rounding, floors.rounding),
        _ => (fl.output.unwrap_or(fl.rounding), out_now),
    };
    let cache = other_cache(kv2, kv);
    let note = format!(
        "\n  confirmed with {which} rounded as {}{cache}: the bug moved the data that rounding was measured on (no hypothesis reproduces it under {} and {} {} cache)",
        r.name(),
        r_now.name(),
        article(&kv.name()),
        kv.name(),
    );
    Ok(Some((fl, kv2, note)))
}

/// How much the best hypothesis under the floors must cut an own error before it is screened
/// under the other roundings and caches (`under_other_setups`). On clean traces the best cut
/// measured is 1.1× (docs/diagnosis.md, "Under the floor").
const SCREEN_CUT: f64 = 2.0;

/// Nothing under the floors was explained, but a hypothesis cut an own error there
/// (`SCREEN_CUT`): the rounding and cache may have been measured on data the bug moved (a
/// sparse dump's layers, where rms eps 1e-3 moves each span more than the roundings and caches
/// differ, and the first tried is kept). The closest hypotheses are replayed under each other
/// rounding of the layers and each cache parity would try, each against that setup's own clean
/// replay; one that there cuts the error `EXPLAINS`-fold, and lands `EXPLAINS`-fold under the
/// measured own error, makes that setup the one to judge the trace again under (the caller
/// keeps the first judgement unless that confirms a bug). A clean engine's error is not cut
/// so under any setup: the setup's own clean replay is the bar, not the measured one.
fn under_other_setups(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    checks: &[hypothesis::BelowFloor],
    cache_unsure: bool,
    opt: &JudgeOptions,
) -> Result<Option<(Floors, KvCache, String)>, JudgeError> {
    if let Some(c) = checks.iter().find(|c| c.cut() >= SCREEN_CUT)
        && let Some(found) = screen_closest(model, cand, floors, kv, c, opt)?
    {
        return Ok(Some(found));
    }
    if cache_unsure {
        for c in checks {
            if let Some(found) = under_other_caches(model, cand, floors, kv, c, opt)? {
                return Ok(Some(found));
            }
        }
    }
    Ok(None)
}

/// `under_other_setups` for the check `c` whose best hypothesis cut it `SCREEN_CUT`-fold: its
/// closest hypotheses replayed under every other setup.
fn screen_closest(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    c: &hypothesis::BelowFloor,
    opt: &JudgeOptions,
) -> Result<Option<(Floors, KvCache, String)>, JudgeError> {
    let hyps: Vec<Screened> = c
        .near
        .iter()
        .filter_map(|t| screened(&t.hypothesis))
        .collect();
    if hyps.is_empty() {
        return Ok(None);
    }
    let window = Window::for_key(cand, &c.key);
    let mut caches = vec![kv];
    caches.extend(rounding::plain_caches(opt, Some(kv)));
    let mut best = Explains::default();
    for r in rounding::tried(opt) {
        let fl = rounding::layers_as(model, floors, r);
        for &kv2 in &caches {
            if r == floors.rounding && kv2 == kv {
                continue;
            }
            let clean = Setup {
                rows: c.rows,
                ..floor::clean_setup(&fl, kv2, window)
            };
            let Some(bar) = nmse_at(model, cand, &clean, &c.key)? else {
                continue;
            };
            for &(mutation, knob) in &hyps {
                let setup = Setup {
                    mutation,
                    knob,
                    ..clean.clone()
                };
                if let Some(n) = nmse_at(model, cand, &setup, &c.key)? {
                    best.offer(c, bar, n, &fl, kv2);
                }
            }
        }
    }
    let Some((fl, kv2, _)) = best.0 else {
        return Ok(None);
    };
    let cache = other_cache(kv2, kv);
    let note = format!(
        "\n  confirmed with the layers rounded as {}{cache}: the bug moved the data that rounding was measured on (under {} and {} {} cache no hypothesis explained {} under its floor)",
        fl.rounding.name(),
        floors.rounding.name(),
        article(&kv.name()),
        kv.name(),
        c.key,
    );
    Ok(Some((fl, kv2, note)))
}

/// The best K/V cache fit's median own NMSE above which the cache is unsure: every cache
/// parity emulates reproduces a clean engine's attention to its own rounding (f16's ~1e-8),
/// a bug in the data moves them all (rms eps 1e-3 under bf16 layers and a Q8_0 cache,
/// TinyStories-656K-Q8_0, sparse: the best, f32, at 1.2e-5; the Q8_0 cache 2.2e-5).
const CACHE_UNSURE: f64 = 1e-6;

/// Whether the cache measurement may have been misled by a bug in the data: no cache
/// reproduced the attention (`CACHE_UNSURE`), or another cache reproduced it within 2x of the
/// chosen one (the measurement keeps the first type unless another is 2x closer: rms eps 1e-4
/// in a plain-f32 engine with an f16 cache, TinyStories-656K-Q8_0, sparse: f32 2.0e-8, f16
/// 3.1e-8, and under f32 the eps cuts its l_out 1.6x).
fn cache_unsure(kv: KvCache, fits: &[rounding::KvFit]) -> bool {
    let best = fits
        .iter()
        .map(|f| f.median_nmse)
        .fold(f64::INFINITY, f64::min);
    let chosen = fits.iter().find(|f| f.kv == kv).map(|f| f.median_nmse);
    // A chosen cache that reproduces the attention to f32's noise leaves no bug to hide in
    // it, whatever else fits as closely (an f16 cache and the same with flash attention, both
    // 1.8e-10 for an engine summing its matmuls in f32): every hypothesis tried again under the
    // other was 40 of that clean 398-token diagnosis's 46 s, and found nothing.
    best > CACHE_UNSURE
        || chosen.is_some_and(|c| {
            c > rounding::KV_DECODE_NOISE
                && fits.iter().any(|f| f.kv != kv && f.median_nmse < 2.0 * c)
        })
}

/// Whether the whole diagnosis of the flagged `o` confirms a hypothesis under the rounding of
/// `fl` and the cache `kv2`, its floor widened to that setup's ambiguity (a quantized cache is
/// noisier than the measured one: its clean replays differ more when their inputs are nudged).
fn confirmed_under(
    model: &Model,
    cand: &Candidate,
    fl: &Floors,
    kv2: KvCache,
    o: &OpResult,
    ops: &[OpResult],
) -> Result<bool, JudgeError> {
    let window = Window::for_key(cand, &o.key);
    let d = ambiguity::distance(
        model,
        cand,
        &floor::clean_setup(fl, kv2, window),
        &o.key,
        ambiguity::nudge(fl),
    )?;
    let at = OpResult {
        floor: o.floor.max(ambiguity::FACTOR * d),
        ..o.clone()
    };
    Ok(hypothesis::diagnose(model, cand, fl, kv2, &at, ops, true)?
        .confirmed
        .is_some())
}

/// A flagged key no hypothesis reproduces, where the cache choice was unsure
/// (`cache_unsure`): the whole diagnosis again under each other cache, the knobs fitted there.
/// Under the kept cache the engine's own cache rounding is in every replay, and no value of a
/// knob beats the key's own error (RoPE base 8000 in a plain-f32 engine with a Q8_0 cache,
/// TinyStories-656K-Q8_0, sparse: the cache measured f32 9.9e-6, Q8_0 1.2e-5; under Q8_0 the
/// base is fitted and confirmed). The first cache under which a hypothesis is confirmed, held
/// to the key's floor there, is returned with the note; the trace is judged again under it.
fn flagged_under_other_caches(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    o: &OpResult,
    ops: &[OpResult],
    opt: &JudgeOptions,
) -> Result<Option<(Floors, KvCache, String)>, JudgeError> {
    for kv2 in rounding::plain_caches(opt, Some(kv)) {
        if confirmed_under(model, cand, floors, kv2, o, ops)? {
            let note = format!(
                "\n  confirmed with {} {} K/V cache: the bug moved the data the cache was measured on (under {} {} cache no hypothesis reproduces {})",
                article(&kv2.name()),
                kv2.name(),
                article(&kv.name()),
                kv.name(),
                o.key,
            );
            return Ok(Some((floors.clone(), kv2, note)));
        }
    }
    Ok(None)
}

/// No hypothesis under the floors cut anything, and no cache reproduced the attention
/// (`CACHE_UNSURE`): the cache was measured on data a bug moved, and under the wrong one the
/// bug's own effect drowns in the cache's rounding (eps 1e-3 cuts 1.1×). At each check (the
/// first that explains one stands) every hypothesis is tried again under each other cache, each knob
/// fitted there, and held against that cache's own clean replay as `under_other_setups` holds
/// them; under the measured rounding of the layers and its tie twins (a matmul is judged on its
/// own inputs, so no other family is in question).
fn under_other_caches(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    c: &hypothesis::BelowFloor,
    opt: &JudgeOptions,
) -> Result<Option<(Floors, KvCache, String)>, JudgeError> {
    // The layers' rounding as measured, and its tie twins: on data the bug moved the twin
    // that fits closer can be the wrong one of the two (ggml's reference quantizers measured
    // as ggml-cpu), and then both the rounding and the cache are hidden.
    let roundings = std::iter::once(floors.rounding)
        .chain(rounding::twins(model, floors.rounding))
        .filter(|r| opt.roundings.contains(r));
    let mut best = Explains::default();
    for r in roundings {
        let fl = match r == floors.rounding {
            true => floors.clone(),
            false => rounding::layers_as(model, floors, r),
        };
        let mut caches = rounding::plain_caches(opt, Some(kv));
        if r != floors.rounding {
            caches.insert(0, kv);
        }
        for kv2 in caches {
            let (Some(bar), tried) = hypothesis::tried_under(model, cand, &fl, kv2, c.key, c.rows)?
            else {
                continue;
            };
            for t in tried {
                best.offer(c, bar, t.nmse, &fl, kv2);
            }
        }
    }
    let Some((fl, kv2, _)) = best.0 else {
        return Ok(None);
    };
    let layers = match fl.rounding == floors.rounding {
        true => String::new(),
        false => format!("the layers rounded as {} and ", fl.rounding.name()),
    };
    let note = format!(
        "\n  confirmed with {layers}{} {} K/V cache: the bug moved the data the cache was measured on (no cache reproduced the attention; under {} and {} {} cache no hypothesis explained {} under its floor)",
        article(&kv2.name()),
        kv2.name(),
        floors.rounding.name(),
        article(&kv.name()),
        kv.name(),
        c.key,
    );
    Ok(Some((fl, kv2, note)))
}

/// The setup (floors, cache, own NMSE) under which a hypothesis best explains a check under
/// the floors: it cuts the check's key `EXPLAINS`-fold below both that setup's clean replay
/// (`bar`) and the own error the judge measured.
#[derive(Default)]
struct Explains(Option<(Floors, KvCache, f64)>);

impl Explains {
    fn offer(&mut self, c: &hypothesis::BelowFloor, bar: f64, n: f64, fl: &Floors, kv: KvCache) {
        let cuts = n * hypothesis::EXPLAINS <= bar && n * hypothesis::EXPLAINS <= c.own_nmse;
        if cuts && self.0.as_ref().is_none_or(|b| n < b.2) {
            self.0 = Some((fl.clone(), kv, n));
        }
    }
}

/// A value fitted under a cache the measurement was unsure of (`cache_unsure`) can land a
/// little off the engine's: RoPE base 8025 for 8000 under f32, where the engine's f16 cache fit
/// the attention within 2x of it (the base fitted to 6.2e-9 under f32, 1.4e-15 under f16).
/// The confirmed knob alone is fitted again under each other cache; one that reproduces the
/// key `EXPLAINS`-fold closer there makes that cache the one to judge the trace again under.
fn knob_under_other_caches(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    f: &Finding,
    opt: &JudgeOptions,
) -> Result<Option<(Floors, KvCache, String)>, JudgeError> {
    let (Some(Hypothesis::Knob(knob, v)), Some(n)) = (f.hypothesis, f.confirmed_nmse) else {
        return Ok(None);
    };
    let mut best: Option<(KvCache, f32, f64)> = None;
    for kv2 in rounding::plain_caches(opt, Some(kv)) {
        if let Some((v2, n2)) = hypothesis::knob_under(model, cand, floors, kv2, f.flagged, knob)?
            // Where the measured cache leaves something to reproduce (a knob outside the
            // attention, the final norm's eps, reproduces the key to 0 under every cache).
            && n > hypothesis::VISIBLE
            && n2 * hypothesis::EXPLAINS <= n
            && best.is_none_or(|b| n2 < b.2)
        {
            best = Some((kv2, v2, n2));
        }
    }
    let Some((kv2, v2, n2)) = best else {
        return Ok(None);
    };
    let note = format!(
        "\n  fitted under {} {} K/V cache, which reproduces it closer ({} to {n2:.1e} there; {} to {n:.1e} under {} {} cache, which fit the attention nearly as well)",
        article(&kv2.name()),
        kv2.name(),
        hypothesis::knob_name(knob, v2),
        hypothesis::knob_name(knob, v),
        article(&kv.name()),
        kv.name(),
    );
    Ok(Some((floors.clone(), kv2, note)))
}

/// A catalog bug or a fitted value, as a setup sets it (None: a layout, or no such name).
type Screened = (Option<Mutation>, Option<(replay::Knob, f32)>);

fn screened(h: &Hypothesis) -> Option<Screened> {
    match *h {
        Hypothesis::Catalog(m) => Some((Some(m), None)),
        Hypothesis::Knob(k, v) => Some((None, Some((k, v)))),
        Hypothesis::Layout(..) | Hypothesis::RopeAt(_) => None,
    }
}

/// The own NMSE at `k` of the candidate replayed under `setup` (None: the replay has no `k`).
fn nmse_at(
    model: &Model,
    cand: &Candidate,
    setup: &Setup,
    k: &TapKey,
) -> Result<Option<f64>, JudgeError> {
    Ok(replay(model, cand, setup, &BTreeSet::new())?
        .metrics
        .get(k)
        .map(|m| m.nmse))
}

/// " and an f16 K/V cache" where a finding's cache is not the measured one, else "".
fn other_cache(kv2: KvCache, kv: KvCache) -> String {
    match kv2 == kv {
        true => String::new(),
        false => format!(" and {} {} K/V cache", article(&kv2.name()), kv2.name()),
    }
}

/// "an f16", "a q8_0": the article before a cache's name.
fn article(name: &str) -> &'static str {
    match name.starts_with(['f', 'a', 'e', 'i', 'o', 'u']) {
        true => "an",
        false => "a",
    }
}

/// A catalog bug confirmed where the layers' rounding was unsure (`rounding::Unsure::layers`):
/// the layers' rounding measured again with the bug in place. One that then reproduces the
/// first step's first two layers 4x closer than the measured one (and confirms the same bug)
/// is the engine's: its
/// floors are returned with the note, and the trace is judged again under it (a bug under the
/// layers' floors is then placed where it first acts).
#[allow(clippy::too_many_arguments)]
fn layers_with_the_bug(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    o: &OpResult,
    ops: &[OpResult],
    f: &Finding,
    first_step: usize,
    opt: &JudgeOptions,
) -> Result<Option<(Floors, String)>, JudgeError> {
    let Some(m) = f.catalog.as_deref().and_then(Mutation::parse) else {
        return Ok(None);
    };
    let all = rounding::tried(opt);
    let n_layer = model.config.n_layer;
    let window = Window {
        s_max: first_step,
        l0: 0,
        l_end: n_layer.min(2),
        end: false,
    };
    let layer_keys = |k: &TapKey| k.step == first_step && k.layer.is_some();
    // Each family's fit with the bug in place; the measured one's first (where it reproduces
    // the layers with the bug to f32 noise, no other is tried).
    let mut fits: Vec<(Emulation, f64)> = Vec::new();
    let order =
        std::iter::once(floors.rounding).chain(all.into_iter().filter(|&r| r != floors.rounding));
    for r in order {
        let setup = Setup {
            kv,
            mutation: Some(m),
            ..Setup::clean(r, window)
        };
        let rep = replay(model, cand, &setup, &BTreeSet::new())?;
        match rounding::fit_where(cand, &rep, layer_keys) {
            Some(f) if r == floors.rounding && f <= EXACT_FIT => return Ok(None),
            Some(f) => fits.push((r, f)),
            None => {}
        }
    }
    // Another family only where it fits clearly better (4x), as every measurement.
    let Some(&(_, now)) = fits.first().filter(|f| f.0 == floors.rounding) else {
        return Ok(None);
    };
    let Some(&(r, best)) = fits.iter().min_by(|a, b| a.1.total_cmp(&b.1)) else {
        return Ok(None);
    };
    if r == floors.rounding || best * 4.0 >= now {
        return Ok(None);
    }
    let fl = rounding::layers_as(model, floors, r);
    let g = hypothesis::diagnose(model, cand, &fl, kv, o, ops, true)?;
    if g.confirmed != f.confirmed {
        return Ok(None);
    }
    let note = format!(
        "\n  the layers round as {}: measured with {} in place (it moved the data the rounding was first measured on)",
        r.name(),
        m.name()
    );
    Ok(Some((fl, note)))
}

/// The rounding that reproduces the engine, in a baseline's words: one family, or
/// `prefill: F, decode: G` where the decode steps round otherwise.
pub fn rounding_label(j: &Judgement) -> String {
    let steps = match j.decode_rounding {
        Some(d) => format!("prefill: {}, decode: {}", j.rounding.name(), d.name()),
        None => j.rounding.name().to_string(),
    };
    match j.output_rounding {
        Some(o) => format!("{steps}; output projection: {}", o.name()),
        None => steps,
    }
}
