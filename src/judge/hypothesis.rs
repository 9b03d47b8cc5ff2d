//! Diagnosis by experiment: at the first op out of its floor, re-run that op (or span) under
//! each hypothesis and name the one that reproduces the candidate within the floor.
//!
//! Hypotheses: every catalog bug (`Mutation`, compute kind) that can show in the span, re-run
//! through `Reference::with_mutation`; other rms eps values; other rope thetas; and layouts of
//! the candidate's own tensor (tested without re-running). Each replay covers only the window
//! up to the flagged (step, layer), entering from the candidate's previous l_out when it has
//! one. Text heuristics (`compare::diagnose`) are used only when nothing reproduces it, and
//! say so.

use super::floor::{Floors, OpClass, SpanOps, class, clean_setup, span};
use super::layout::Layout;
use super::replay::{Candidate, Knob, KvCache, Replay, Setup, Window, replay};
use super::rounding;
use super::{Finding, Hypothesis, JudgeError, OpResult, Tried};
use crate::backend::mutation::{Mutation, MutationKind, wrong_theta};
use crate::backend::positions::RopeAt;
use crate::compare::position::first_row;
use crate::compare::{CompareOptions, PairKind, compare, slice_nmse as nmse};
use crate::model::{Model, RopeType};
use crate::trace::{ModelRef, Producer, StepInfo, Tap, TapKey, Trace};
use ndarray::{ArrayD, IxDyn};
use rayon::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// One catalog bug's experiment to run.
struct CatalogRun {
    name: String,
    catalog: Mutation,
    setup: Setup,
}

/// A knob's value as a user writes it: `10000`, `1e-5`; a fitted value of 1000 or more (a
/// RoPE base) to the unit, the fit being no finer (`15447`, not `1.5446748e4`).
fn fmt_num(x: f32) -> String {
    if x >= 1000.0 {
        format!("{}", x.round())
    } else if x >= 1.0 && x.fract() == 0.0 {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// Whether catalog bug `m` can change what the span computes.
pub(super) fn relevant(
    m: Mutation,
    model: &Model,
    k: &TapKey,
    classes: &BTreeSet<OpClass>,
) -> bool {
    if m.kind() != MutationKind::Compute || !m.applies_to(model) {
        return false;
    }
    let shows = m.first_shows(model);
    if shows.step > k.step {
        return false;
    }
    // A bug of the output norm or projection alone cannot change a layer's tap.
    let before_layers = matches!(shows.tap, Tap::Embd | Tap::EmbdScaled);
    if shows.layer.is_none() && !before_layers && k.layer.is_some() {
        return false;
    }
    match m {
        Mutation::DecoderNibbleOrder | Mutation::DecoderNoOffset => {
            classes.contains(&OpClass::Matmul) || classes.contains(&OpClass::Lookup)
        }
        _ => classes.contains(&class(shows.tap)),
    }
}

/// What the experiments at one key left: the clean replay of its window (the reference's own
/// tensors kept at the key's step and layer), each hypothesis tried with its NMSE, and the
/// setups of the re-run ones by name (layouts need none).
struct Experiments {
    plain: super::replay::Replay,
    tried: Vec<(Tried, Option<Mutation>)>,
    setups: BTreeMap<String, Setup>,
    window: Window,
    span: BTreeSet<TapKey>,
    /// Whether the hypotheses were run (not only the clean replay).
    ran: bool,
    /// Whether the knob fits and the output scale were left out (`defer_knobs`: a catalog bug
    /// already reproduces the key bit for bit).
    knobs_deferred: bool,
}

/// Re-run `k`'s op (or span) under each hypothesis that can change it (`only`: those of
/// these names; `fit_scales`: `k` is a flagged key, not a check under the floor — an output
/// scale is fitted too, and each knob's fit searches near the model's value and between the
/// walk's points, `fit`'s `near`).
/// The widest activation (rows × width) a replay may hold for hypotheses to be replayed side
/// by side (4 MB of f32: a fixture's, a long prompt's cut to its first rows).
const PARALLEL_REPLAY_VALUES: usize = 1 << 20;

#[allow(clippy::too_many_arguments)]
fn experiments(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    k: TapKey,
    run: bool,
    only: Option<&BTreeSet<String>>,
    fit_scales: bool,
    rows: Option<usize>,
    defer_knobs: bool,
) -> Result<Experiments, JudgeError> {
    let sp = span(cand, &k);
    let window = Window::for_key(cand, &k);
    let base = Setup {
        rows,
        ..clean_setup(floors, kv, window)
    };
    // The reference's own tensors at the flagged key and at the candidate's keys of the same
    // (step, layer): layouts are tested on them, the fallback heuristics read them.
    let mut keep: BTreeSet<TapKey> = cand
        .trace
        .keys()
        .filter(|x| x.step == k.step && x.layer == k.layer && **x <= k)
        .copied()
        .collect();
    // Probabilities cut to some rows: the attention output after them shows the rows left out.
    let after = TapKey::new(k.step, k.layer, Tap::KqvOut);
    let cut = cand.cut(&k).is_some() && cand.contains(&after);
    if cut {
        keep.insert(after);
    }
    let plain = replay(model, cand, &base, &keep)?;

    let mut tried: Vec<(Tried, Option<Mutation>)> = Vec::new();
    let mut setups: BTreeMap<String, Setup> = BTreeMap::new();
    let mut knobs_deferred = false;
    if run {
        let at = AtKey {
            model,
            cand,
            k,
            classes: sp.iter().map(|x| class(x.tap)).collect(),
            sp: &sp,
            own: plain.metrics.get(&k).map(|m| m.nmse),
            base,
            only,
        };
        let first = at.first_out(floors, &plain, cut.then_some(after))?;
        at.catalog(first, rows, &mut tried, &mut setups)?;
        // RoPE's positions solved from the trace, each rule one experiment. Under the floor
        // (a place `below_floor` checks), at a span whose own error starts at a clear edge
        // (`position::onset`) near its floor: a shift from there on can hide under a floor
        // that a bug in every layer lifted (a span's floor follows the trace's median span).
        let onset = match (fit_scales, plain.kept.get(&k), at.own) {
            (false, Some(ours), Some(own))
                if sp.len() > 1
                    && at.classes.contains(&OpClass::Rope)
                    && own >= ONSET_NEAR_FLOOR * floors.key(&k, &SpanOps::of(&sp)) =>
            {
                super::position::onset(cand, &k, ours)?
            }
            _ => None,
        };
        if fit_scales || onset.is_some() {
            let guess = first
                .or(onset)
                .filter(|_| at.classes.contains(&OpClass::Rope))
                .map(|(_, p)| p);
            // What the catalog already came to: the farther RoPE guesses only where nothing did.
            let catalog = tried
                .iter()
                .map(|(t, _)| t.nmse)
                .fold(f64::INFINITY, f64::min);
            let near = (at.own, catalog);
            for (t, setup) in rope_positions(model, cand, &at.base, k, guess, only, near)? {
                setups.insert(t.hypothesis.name(), setup);
                tried.push((t, None));
            }
        }
        // A catalog bug that reproduces a plainly visible error bit for bit is the cause
        // unless the trace contradicts it elsewhere (`diagnose` then runs everything): a
        // knob's walk over its decades (half of a sparse span's judgement) can only add rivals
        // it would outrank (pick leaves out the catalog's own values).
        knobs_deferred = defer_knobs
            && at.own.is_some_and(|o| o >= DEFER_KNOBS_OWN)
            && tried.iter().any(|(t, m)| m.is_some() && t.nmse <= VISIBLE);
        if !knobs_deferred {
            at.knobs(fit_scales, &mut tried, &mut setups)?;
            if fit_scales {
                at.output_scale(&plain, &mut tried, &mut setups)?;
            }
        }
        at.layouts(&plain, &mut tried)?;
    }
    Ok(Experiments {
        plain,
        tried,
        setups,
        window,
        span: sp,
        ran: run,
        knobs_deferred,
    })
}

/// Under the floor, RoPE rules are tried at a span whose own error is within this fraction of
/// its floor and starts at an edge (`position::onset`).
const ONSET_NEAR_FLOOR: f64 = 1e-2;

/// The own error above which `experiments` may defer the knobs to a catalog bug that
/// reproduces the key exactly: far above any rounding tie a knob could flip instead.
const DEFER_KNOBS_OWN: f64 = 1e-6;

/// What the experiments at one key share: the key, its span and the ops' classes in it, the
/// clean setup they vary, the clean replay's own error there, and the hypotheses asked for.
struct AtKey<'a, 'c, 't> {
    model: &'a Model,
    cand: &'a Candidate<'t>,
    k: TapKey,
    sp: &'a BTreeSet<TapKey>,
    classes: BTreeSet<OpClass>,
    base: Setup,
    own: Option<f64>,
    only: Option<&'c BTreeSet<String>>,
}

impl AtKey<'_, '_, '_> {
    /// The first (step, position) out of the floor at the key, or at the attention output
    /// after it (`after`: the key's probabilities are cut to some rows).
    fn first_out(
        &self,
        floors: &Floors,
        plain: &Replay,
        after: Option<TapKey>,
    ) -> Result<Option<(usize, usize)>, JudgeError> {
        let floor = floors.key(&self.k, &SpanOps::of(self.sp));
        let first_of = |key: &TapKey| match plain.kept.get(key) {
            Some(ours) => super::position::first_at(self.cand, key, ours, floor),
            None => Ok(None),
        };
        Ok(
            match (
                first_of(&self.k)?,
                after.map(|a| first_of(&a)).transpose()?.flatten(),
            ) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        )
    }

    /// A position bug at the width the error says: the first row out of the floor is where a
    /// ring of W slots or positions modulo W first act (position W), or where a mask's
    /// remainder block starts (row W of the step; one block past the step when it is row 0).
    fn fitted(&self, m: Mutation, first: Option<(usize, usize)>) -> Mutation {
        let Some((_, pos)) = first else { return m };
        let w = match m {
            // The smallest block that leaves its first remainder row here, given every step's
            // length (a later step shorter than a block is unmasked whole).
            Mutation::MaskTailBlock(_) => {
                let steps = crate::trace::step_shapes(self.cand.trace);
                let longest = steps.iter().map(|s| s.2).max().unwrap_or(1);
                (2..=longest + 1)
                    .find(|&w| {
                        u32::try_from(w).is_ok_and(|w| {
                            Mutation::MaskTailBlock(w).first_position(&steps)
                                == Some((self.k.step, pos))
                        })
                    })
                    .unwrap_or(pos)
            }
            _ => pos,
        };
        match u32::try_from(w) {
            Ok(w) if w >= 1 => m.with_wrap(w),
            _ => m,
        }
    }

    /// Every catalog bug that can change the key, each replayed (under the rounding's tie twins
    /// or another cache where that is what stands between it and the engine).
    fn catalog(
        &self,
        first: Option<(usize, usize)>,
        rows: Option<usize>,
        tried: &mut Vec<(Tried, Option<Mutation>)>,
        setups: &mut BTreeMap<String, Setup>,
    ) -> Result<(), JudgeError> {
        let (model, cand, k, own) = (self.model, self.cand, self.k, self.own);
        let first_step = cand.steps().into_iter().min().unwrap_or(0);
        let mut hyps: Vec<CatalogRun> = Mutation::ALL
            .iter()
            .filter(|&&m| relevant(m, model, &k, &self.classes))
            // Short of an overflow such a bug computes the right numbers to f32 rounding: in a
            // trace with no NaN or Inf it is a rounding twin, and one that flips the same
            // quantum as the engine "reproduces" a clean span bit for bit (softmax-no-max on a
            // clean numpy engine, Q8_0 with an f16 cache, 398-token prompt, sparse).
            .filter(|&&m| !(m.shows_only_on_overflow() && cand.all_finite()))
            .map(|&m| self.fitted(m, first))
            .map(|m| CatalogRun {
                name: m.name().to_string(),
                catalog: m,
                setup: Setup {
                    mutation: Some(m),
                    ..self.base.clone()
                },
            })
            .collect();
        hyps.retain(|h| self.only.is_none_or(|o| o.contains(&h.name)));
        // Each hypothesis on its own thread (rayon) where replays are small: a one-layer replay
        // of a few rows keeps two cores only half busy, and the hypotheses are independent.
        let each = |h: CatalogRun| -> Result<(CatalogRun, Setup, Option<f64>), JudgeError> {
            let r = replay(model, cand, &h.setup, &BTreeSet::new())?;
            let Some(mut best) = r.metrics.get(&k).map(|m| m.nmse) else {
                let setup = h.setup.clone();
                return Ok((h, setup, None));
            };
            let mut setup = h.setup.clone();
            // A hypothesis may differ from the engine only where an element sits on a rounding
            // tie the engine breaks the other way (ggml's scalar `roundf` against its SIMD
            // half-to-even; with a bug in the measurement window the measured family can be
            // either, and a flipped tie can weigh as much as a small bug): one that leaves the
            // error no more than doubled is replayed under the rounding's tie twins too, the
            // closest kept, as the own errors were. (One far off stays far off: a tie moves one
            // quantum of one element.)
            if best > VISIBLE
                && own.is_some_and(|o| best <= TWIN_RETRY * o)
                && let Some(c) =
                    closer(model, cand, &k, best, rounding::twin_setups(&setup, model))?
            {
                (best, setup) = c;
            }
            // A GELU where the model has none (`wrong-ffn-act` on a SiLU model): the
            // measurement never saw how the engine computes one, f16 table or f32.
            if h.catalog.swaps_ffn_activation()
                && best > VISIBLE
                && let Some(c) = closer(
                    model,
                    cand,
                    &k,
                    best,
                    rounding::gelu_twins(model, setup.rounding)
                        .into_iter()
                        .map(|rounding| Setup {
                            rounding,
                            ..setup.clone()
                        })
                        .collect(),
                )?
            {
                (best, setup) = c;
            }
            // The K/V cache was measured with the bug in the window, where a bug that moves
            // attention outweighs every cache's rounding (and the first, f32, is kept): a
            // hypothesis that cuts the error 2x but leaves a cache's own noise (1e-5..1e-2 for
            // a quantized one) is replayed under each other cache parity emulates, the closest
            // kept. (A wrong hypothesis stays far off under any cache.)
            if best > VISIBLE
                && own.is_some_and(|o| best * CACHE_RETRY < o)
                && let Some(c) = closer(
                    model,
                    cand,
                    &k,
                    best,
                    other_caches(&setup, model, k.step > first_step),
                )?
            {
                (best, setup) = c;
            }
            Ok((h, setup, Some(best)))
        };
        // A replay of many rows is parallel inside (its matmuls) and holds its steps'
        // activations: the hypotheses then run one after another, or rayon's work stealing
        // nests them (six replays at once seen on two cores, 360 MB at a 2,048-token prompt).
        let rows_replayed = rows.unwrap_or_else(|| {
            let steps = crate::trace::step_shapes(cand.trace);
            steps
                .iter()
                .filter(|s| s.0 <= k.step)
                .map(|s| s.2)
                .max()
                .unwrap_or(1)
        });
        let c = &model.config;
        let done: Vec<_> = if rows_replayed * c.n_ff.max(c.n_embd) > PARALLEL_REPLAY_VALUES {
            hyps.into_iter()
                .map(each)
                .collect::<Result<_, JudgeError>>()?
        } else {
            hyps.into_par_iter()
                .map(each)
                .collect::<Result<_, JudgeError>>()?
        };
        for (h, setup, best) in done {
            setups.insert(h.name.clone(), setup);
            if let Some(best) = best {
                tried.push((
                    Tried {
                        hypothesis: super::Hypothesis::Catalog(h.catalog),
                        nmse: best,
                    },
                    Some(h.catalog),
                ));
            }
        }
        Ok(())
    }

    /// Each scalar the model sets that the span's ops read, fitted to the key (`near`: search
    /// near the model's value and between the walk's points too; `fit`).
    fn knobs(
        &self,
        near: bool,
        tried: &mut Vec<(Tried, Option<Mutation>)>,
        setups: &mut BTreeMap<String, Setup>,
    ) -> Result<(), JudgeError> {
        let (model, cand, k, own) = (self.model, self.cand, self.k, self.own);
        for knob in Knob::ALL {
            if !knob_acts(knob, model, &self.classes, self.sp) {
                continue;
            }
            if self
                .only
                .is_some_and(|o| !o.iter().any(|n| n.starts_with(&knob.name())))
            {
                continue;
            }
            let span = self.sp.len() > 1;
            let mut values = fit(model, cand, &self.base, knob, k, own, span, near)?;
            // A value that cuts the own error tenfold but leaves more than f32's last bits may
            // differ from the engine only where an element sits on a tie the engine breaks the
            // other way (ggml's scalar roundf, a GPU's Q8_1, measured as ggml-cpu): the knob is
            // fitted again under the rounding's tie twins, the closest fit kept (an attention
            // scale 0.22 in a ggml-scalar engine: 3e-5 left at a decode step's span, 0 under
            // its own tie rule).
            let mut base = self.base.clone();
            let best = |v: &[(f32, f64)]| v.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
            if own.is_some_and(|o| best(&values) * 10.0 <= o) && best(&values) > VISIBLE {
                for twin in rounding::twins(model, self.base.rounding) {
                    let t = Setup {
                        rounding: twin,
                        ..self.base.clone()
                    };
                    let fitted = fit(model, cand, &t, knob, k, own, span, near)?;
                    if best(&fitted) < best(&values) {
                        (values, base) = (fitted, t);
                    }
                }
            }
            if span && knob == Knob::RmsEps {
                values = self.eps_at_final_norm(values)?;
            }
            for (v, mut nmse) in values {
                let name = knob_name(knob, v);
                let mut setup = Setup {
                    knob: Some((knob, v)),
                    ..base.clone()
                };
                // As a catalog bug (above), under the tie twins of a plain Q8_0 cache's
                // quantizer. (The rounding's twins are the whole fit's, above, where a value
                // cut tenfold: per value they would cost two replays wherever it has twins.)
                if nmse > VISIBLE
                    && own.is_some_and(|o| nmse <= TWIN_RETRY * o)
                    && let Some(c) =
                        closer(model, cand, &k, nmse, rounding::cache_twin_setups(&setup))?
                {
                    (nmse, setup) = c;
                }
                setups.insert(name.clone(), setup);
                tried.push((
                    Tried {
                        hypothesis: super::Hypothesis::Knob(knob, v),
                        nmse,
                    },
                    None,
                ));
            }
        }
        Ok(())
    }

    /// A span's eps fitted where the trace pins it: under 8-bit activations a sparse span
    /// cannot tell eps 3e-6 from 5e-6 (both reproduce it exactly, and the search meets 5e-6
    /// first), while the final norm of the same step, judged on its own, is one op whose
    /// NMSE is monotone in eps (an engine that uses one eps for every norm). Where the value
    /// fitted there reproduces this span as closely as the best of `fitted`, it joins them,
    /// and those the final norm puts `FINAL_NORM_SAYS` times further off (and above f32's
    /// last bits there) leave: the final norm of tiny-llama-q4_0 sits at 0 under 3e-6 and at
    /// 4e-13 under 5e-6. Otherwise (no final norm on its own, or its eps not the layers')
    /// `fitted` as it is.
    fn eps_at_final_norm(&self, fitted: Vec<(f32, f64)>) -> Result<Vec<(f32, f64)>, JudgeError> {
        let (model, cand, k) = (self.model, self.cand, self.k);
        let Some(best) = fitted.iter().map(|f| f.1).reduce(f64::min) else {
            return Ok(fitted);
        };
        let rn = TapKey::new(k.step, None, Tap::ResultNorm);
        if !cand.contains(&rn) || super::span::span(cand, &rn).len() != 1 {
            return Ok(fitted);
        }
        let at_rn = Setup {
            window: Window::for_key(cand, &rn),
            ..self.base.clone()
        };
        let own_rn = replay(model, cand, &at_rn, &BTreeSet::new())?
            .metrics
            .get(&rn)
            .map(|m| m.nmse);
        // The walk's value, then a golden-section search around it on that one op (whose
        // error sits far under f32's visible level there: a final norm's eps moves it by
        // ~1e-13), at the digits an engine writes.
        let Some(&(v1, _)) =
            fit(model, cand, &at_rn, Knob::RmsEps, rn, own_rn, false, true)?.first()
        else {
            return Ok(fitted);
        };
        let at = |v: f32| -> Result<f64, JudgeError> {
            let setup = Setup {
                knob: Some((Knob::RmsEps, v)),
                ..at_rn.clone()
            };
            let r = replay(model, cand, &setup, &BTreeSet::new())?;
            Ok(r.metrics.get(&rn).map_or(f64::INFINITY, |m| m.nmse))
        };
        let l1 = (v1 as f64).log10();
        let (l, _) = golden_section((l1 - 0.35, l1 + 0.35), f64::INFINITY, &mut |l| {
            at(10f64.powf(l) as f32)
        })?;
        let mut written: Vec<(f32, f64)> = Vec::new();
        for digits in 1..=3 {
            if let Ok(x) = format!("{:.*e}", digits - 1, 10f64.powf(l)).parse::<f32>()
                && !written.iter().any(|w| w.0 == x)
            {
                written.push((x, at(x)?));
            }
        }
        let min = written.iter().map(|w| w.1).fold(f64::INFINITY, f64::min);
        // The fewest digits that fit the final norm as well as any.
        let Some(&(v, at_v)) = written
            .iter()
            .find(|w| w.1 <= min * 1.01 + f64::MIN_POSITIVE)
        else {
            return Ok(fitted);
        };
        if fitted.iter().any(|f| f.0 == v) {
            return Ok(fitted);
        }
        let setup = Setup {
            knob: Some((Knob::RmsEps, v)),
            ..self.base.clone()
        };
        let r = replay(model, cand, &setup, &BTreeSet::new())?;
        let e = r.metrics.get(&k).map_or(f64::INFINITY, |m| m.nmse);
        if e > (best * 1.01).max(VISIBLE) {
            return Ok(fitted);
        }
        let mut out = vec![(v, e)];
        for f in fitted {
            if at(f.0)? <= FINAL_NORM_SAYS * at_v + FINAL_NORM_BITS {
                out.push(f);
            }
        }
        Ok(out)
    }

    /// A constant factor on this op's output (no catalog bug, no hyperparameter): fitted in
    /// closed form on the op alone (a span's ops would mix it with theirs); replayed over the
    /// trace like a knob, where it must hold at `KNOB_PLACES` places. Not for the attention
    /// probabilities (rows that sum to 1) nor a norm (another eps moves rows of alike RMS by
    /// nearly one factor: the eps fit reads it), and not in the below-floor check, where a
    /// clean engine's rounding is all there is to fit.
    fn output_scale(
        &self,
        plain: &Replay,
        tried: &mut Vec<(Tried, Option<Mutation>)>,
        setups: &mut BTreeMap<String, Setup>,
    ) -> Result<(), JudgeError> {
        let k = self.k;
        if self.sp.len() == 1
            && k.tap != Tap::KqSoftMax
            && class(k.tap) != OpClass::Norm
            && let (Some(ours), Some(theirs)) = (plain.kept.get(&k), self.cand.get(&k)?)
            && let Some((c, e)) = fit_scale(ours, &theirs)
            // Listed only where a factor explains most of the error: a least-squares factor
            // always removes some, which says nothing.
            && self.own.is_some_and(|o| e * CONFIRM_CUT <= o)
        {
            // In every layer, and in this layer alone (one tensor's scale read wrong): the same
            // at this key, told apart by the rest of the trace. Past layer 0 the layers before
            // matched: the factor is not in every layer.
            let sites: Vec<Option<usize>> = match k.layer {
                None => vec![None],
                Some(0) if self.model.config.n_layer > 1 => vec![None, Some(0)],
                Some(0) => vec![None],
                Some(l) => vec![Some(l)],
            };
            for layer in sites {
                let knob = Knob::OutputScale(k.tap, layer);
                let name = knob_name(knob, c);
                setups.insert(
                    name.clone(),
                    Setup {
                        knob: Some((knob, c)),
                        ..self.base.clone()
                    },
                );
                tried.push((
                    Tried {
                        hypothesis: super::Hypothesis::Knob(knob, c),
                        nmse: e,
                    },
                    None,
                ));
            }
        }
        Ok(())
    }

    /// Layouts: the candidate's own tensor read in another order, no re-run needed.
    fn layouts(
        &self,
        plain: &Replay,
        tried: &mut Vec<(Tried, Option<Mutation>)>,
    ) -> Result<(), JudgeError> {
        let (cand, k) = (self.cand, self.k);
        if let (Some(r), Some(raw), Some(dims)) = (plain.kept.get(&k), cand.raw(&k)?, cand.dims(&k))
        {
            let declared = cand.layouts.get(&k.tap).copied();
            for l in Layout::candidates(k.tap) {
                if Some(l) == declared {
                    continue;
                }
                let x = l.to_canonical(&raw, dims);
                let nmse = nmse(r, &x);
                let catalog = (k.tap == Tap::QRope && l == Layout::SwapOuter)
                    .then_some(Mutation::HeadMajorQRope);
                tried.push((
                    Tried {
                        hypothesis: super::Hypothesis::Layout(l, k.tap),
                        nmse,
                    },
                    catalog,
                ));
            }
        }
        Ok(())
    }
}

/// RoPE's positions solved row by row from the trace (a full dump's q/k on both sides of it,
/// at a flagged `q_rope` or `k_rope`), read as rules and each replayed over the window: a
/// position bug no catalog entry reproduces (positions from 1, a counter that stops, a shift
/// past the prompt) is one experiment too. At a span holding RoPE (a sparse dump: nothing to
/// solve them from), the rules that start at the first position out of the floor (`guess`:
/// `rope_fit::guesses`). Rules the catalog holds are left to it. `(own, catalog)`: the clean
/// replay's error at the key and the least the catalog's hypotheses left there.
#[allow(clippy::too_many_arguments)]
fn rope_positions(
    model: &Model,
    cand: &Candidate,
    base: &Setup,
    k: TapKey,
    guess: Option<usize>,
    only: Option<&BTreeSet<String>>,
    (own, catalog): (Option<f64>, f64),
) -> Result<Vec<(Tried, Setup)>, JudgeError> {
    let mut out = Vec::new();
    // The window renumbers its layers from l0; the trace's are the model's.
    let (rules, guessed) = match (k.tap, k.layer, guess) {
        (Tap::QRope | Tap::KRope, Some(layer), _) => {
            (super::rope_fit::hypotheses(model, cand, layer)?, None)
        }
        (Tap::QRope | Tap::KRope, ..) | (_, _, None) => return Ok(out),
        (.., Some(p0)) => (super::rope_fit::guesses(cand, p0), Some(p0)),
    };
    let run = |rules: Vec<RopeAt>, out: &mut Vec<(Tried, Setup)>| -> Result<(), JudgeError> {
        for at in rules {
            if only.is_some_and(|o| !o.contains(&at.name())) {
                continue;
            }
            let setup = Setup {
                rope_at: Some(at),
                ..base.clone()
            };
            let r = replay(model, cand, &setup, &BTreeSet::new())?;
            if let Some(m) = r.metrics.get(&k) {
                let t = Tried {
                    hypothesis: Hypothesis::RopeAt(at),
                    nmse: m.nmse,
                };
                out.push((t, setup));
            }
        }
        Ok(())
    };
    run(rules, &mut out)?;
    // Guessed at a span, and neither the catalog nor these came near (a hypothesis that
    // reproduces the span takes its error down by orders of magnitude): shifts by 2 to
    // `FAR_SHIFT`, one replay each.
    // Then, the same way, shifts by up to `LONG_SHIFT` (a template's length), of q and k
    // together or either alone: a few hundred rules, each replayed first over the prompt's
    // rows up to the first one out (`Setup::rows`: a causal forward's rows after it change
    // nothing before it), the closest `LONG_KEEP` then over the whole window. (Where the
    // window reaches a decode step the cut does not apply: each is one whole replay.)
    // A rule that only comes near is no reason to stop: at a decode step's one row a shift
    // of k by -4 and by +10 from position 20 differ by 9.5e-6 (own error 3e-3); the trace's
    // later steps tell them apart once both are replayed.
    if let (Some(p0), Some(own)) = (guessed, own) {
        let near = |out: &Vec<(Tried, Setup)>| {
            catalog <= own * FAR_TRIGGER
                || out
                    .iter()
                    .any(|(t, _)| t.nmse <= (own * RULE_TRIGGER).max(VISIBLE))
        };
        if !near(&out) {
            run(super::rope_fit::far_guesses(cand, p0), &mut out)?;
        }
        if !near(&out) {
            let mut screened: Vec<(f64, RopeAt)> = Vec::new();
            for at in super::rope_fit::long_shifts(cand, p0) {
                if only.is_some_and(|o| !o.contains(&at.name())) {
                    continue;
                }
                let setup = Setup {
                    rope_at: Some(at),
                    rows: Some(base.rows.map_or(p0 + 1, |r| r.min(p0 + 1))),
                    ..base.clone()
                };
                let r = replay(model, cand, &setup, &BTreeSet::new())?;
                let Some(m) = r.metrics.get(&k) else {
                    continue;
                };
                if r.cut {
                    screened.push((m.nmse, at));
                } else {
                    let t = Tried {
                        hypothesis: Hypothesis::RopeAt(at),
                        nmse: m.nmse,
                    };
                    out.push((
                        t,
                        Setup {
                            rows: base.rows,
                            ..setup
                        },
                    ));
                }
            }
            screened.sort_by(|a, b| a.0.total_cmp(&b.0));
            let best = screened.into_iter().take(LONG_KEEP).map(|(_, at)| at);
            run(best.collect(), &mut out)?;
        }
    }
    Ok(out)
}

/// How many of the long shifts screened over the prompt's first rows are replayed whole.
const LONG_KEEP: usize = 4;

/// A catalog bug that takes a span's error under this fraction of the clean replay's came
/// near enough: the farther RoPE shifts are not replayed.
const FAR_TRIGGER: f64 = 1e-2;
/// The same for a RoPE rule, which must reproduce the span to this fraction: shifts alias
/// one another at a single row far more closely than a catalog bug does.
const RULE_TRIGGER: f64 = 1e-5;

/// Whether `knob` can change what ops of these classes compute.
fn knob_acts(
    knob: Knob,
    model: &Model,
    classes: &BTreeSet<OpClass>,
    span: &BTreeSet<TapKey>,
) -> bool {
    match knob {
        // Only where the model caps (`model_value` is NaN otherwise and nothing is fitted).
        Knob::AttnSoftcap => classes.contains(&OpClass::Attention),
        Knob::FinalSoftcap => span.iter().any(|x| x.tap == Tap::Logits),
        Knob::RmsEps => classes.contains(&OpClass::Norm),
        // Where the span holds the final norm (a layer's norms are `RmsEps`'s).
        Knob::OutputNormEps => span.iter().any(|x| x.tap == Tap::ResultNorm),
        Knob::RopeTheta | Knob::RopeFreqScale => {
            classes.contains(&OpClass::Rope) && model.config.n_rot >= 2
        }
        Knob::AttnScale => classes.contains(&OpClass::Attention),
        // Fitted apart, on a single op (`fit_scale`).
        Knob::OutputScale(..) => false,
    }
}

/// The hypothesis name of a fitted value: `rms-eps=1e-3`, `attn-scale=3.125e-2`,
/// `scale:ffn_out=0.5`.
pub fn knob_name(knob: Knob, v: f32) -> String {
    match knob {
        Knob::OutputScale(..) | Knob::AttnSoftcap | Knob::FinalSoftcap | Knob::RopeFreqScale => {
            format!("{}={}", knob.name(), fmt_factor(v))
        }
        _ => format!("{}={}", knob.name(), fmt_num(v)),
    }
}

/// The "ruled out" list as a reader takes it in: each catalog bug by its name, and a family of
/// many tried values (one knob's values, the RoPE position rules) as one entry with its count,
/// NMSE range and closest member; a sparse dump tries a hundred position rules. The JSON
/// report keeps every experiment.
fn ruled_out_text(list: &[Tried]) -> String {
    /// A family up to this size is listed member by member.
    const LISTED: usize = 4;
    let mut families: Vec<(String, Vec<&Tried>)> = Vec::new();
    for t in list {
        let family = match t.hypothesis {
            Hypothesis::Knob(k, _) => k.name(),
            Hypothesis::RopeAt(_) => "rope-at".into(),
            _ => t.hypothesis.name(),
        };
        match families.iter_mut().find(|(f, _)| *f == family) {
            Some((_, members)) => members.push(t),
            None => families.push((family, vec![t])),
        }
    }
    let mut out = Vec::new();
    for (family, members) in families {
        if members.len() <= LISTED {
            out.extend(
                members
                    .iter()
                    .map(|t| format!("{} ({:.0e})", t.hypothesis, t.nmse)),
            );
            continue;
        }
        let closest = members
            .iter()
            .min_by(|a, b| a.nmse.total_cmp(&b.nmse))
            .expect("a family has members");
        let far = members.iter().map(|t| t.nmse).fold(f64::MIN, f64::max);
        let what = if matches!(closest.hypothesis, Hypothesis::RopeAt(_)) {
            "position rules"
        } else {
            "values"
        };
        out.push(format!(
            "{family}: {} {what} (NMSE {:.0e} to {far:.0e}, the closest {})",
            members.len(),
            closest.nmse,
            closest.hypothesis
        ));
    }
    out.join(", ")
}

/// A factor as a user writes it: `0.5`, `1.25`, `8`; `1e-5` beyond 1e-3..1e4.
fn fmt_factor(x: f32) -> String {
    if (1e-3..1e4).contains(&x.abs()) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// The constant factor that best maps the reference's output onto the candidate's
/// (least squares), as an engine would write it: the fewest significant digits whose NMSE is
/// within 1% of the exact fit's, or under f32 noise (`VISIBLE`: `x / 0.8` is not the f32 `x *
/// 1.25`, and is 1.25). None when there is no factor to fit (a zero output) or it is 1.
fn fit_scale(ours: &[f32], theirs: &[f32]) -> Option<(f32, f64)> {
    let (mut xy, mut xx) = (0f64, 0f64);
    for (&x, &y) in ours.iter().zip(theirs) {
        xy += x as f64 * y as f64;
        xx += x as f64 * x as f64;
    }
    let c = xy / xx;
    if !(c.is_finite() && c != 0.0) {
        return None;
    }
    let err = |f: f32| -> f64 {
        let scaled: Vec<f32> = ours.iter().map(|x| x * f).collect();
        nmse(&scaled, theirs)
    };
    let exact = c as f32;
    let best = err(exact);
    let pick = (1..=6)
        .map(|d| -> f32 { format!("{c:.*e}", d - 1).parse().unwrap_or(exact) })
        .map(|f| (f, err(f)))
        .find(|&(_, e)| e <= (best * 1.01).max(VISIBLE))
        .unwrap_or((exact, best));
    (pick.0 != 1.0).then_some(pick)
}

/// The step of the search in log10, and the range it may walk.
fn knob_search(knob: Knob, v0: f32) -> (f64, f64, f64) {
    let l0 = (v0 as f64).log10();
    match knob {
        // A decade a step, 1e-14 to 100 (engines use 1e-12 … 1e-1; past 1, an argument
        // passed in the wrong place).
        Knob::RmsEps | Knob::OutputNormEps => (1.0, -14.0, 2.0),
        // Half a decade, 10 to 1e9.
        Knob::RopeTheta => (0.5, 1.0, 9.0),
        // A factor 2, from 1/256 to 256 times the model's (an output scale is not walked).
        Knob::AttnScale
        | Knob::RopeFreqScale
        | Knob::AttnSoftcap
        | Knob::FinalSoftcap
        | Knob::OutputScale(..) => (
            std::f64::consts::LOG10_2,
            l0 - 8.0 * std::f64::consts::LOG10_2,
            l0 + 8.0 * std::f64::consts::LOG10_2,
        ),
    }
}

/// Values an engine plausibly uses near `v` (within a factor `span`): 1, 2 and 5 times a power
/// of ten, and for the attention scale 1, 1/head_dim and the model's own times a power of two.
fn round_values(knob: Knob, model: &Model, v: f64, span: f64) -> Vec<f32> {
    let near = |x: f64| x >= v / span && x <= v * span;
    let e = v.log10().floor() as i32;
    let mut out: Vec<f32> = (e - 2..=e + 2)
        .flat_map(|p| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(p)))
        .filter(|&x| near(x))
        // Parsed from decimal: the f32 an engine's `1e-3f` is.
        .map(|x| format!("{x:.6e}").parse().unwrap_or(f32::NAN))
        .collect();
    if matches!(knob, Knob::AttnSoftcap | Knob::FinalSoftcap) {
        // Caps are written as whole numbers of a decade (gemma2: 50 and 30), and an engine may
        // use the other cap of the two (swapped).
        out.extend(
            (e - 1..=e + 1)
                .flat_map(|p| (1..=9).map(move |m| m as f64 * 10f64.powi(p)))
                .filter(|&x| near(x))
                .map(|x| format!("{x:.6e}").parse().unwrap_or(f32::NAN)),
        );
        let c = &model.config;
        out.extend(
            [c.attn_softcap, c.final_softcap]
                .into_iter()
                .flatten()
                .filter(|&x| near(x as f64)),
        );
    }
    if knob == Knob::RopeFreqScale {
        // No scaling, and the factor where its inverse is meant.
        let fs = model.config.rope_freq_scale;
        out.extend([1.0, 1.0 / fs].into_iter().filter(|&x| near(x as f64)));
    }
    if knob == Knob::AttnScale {
        // As an engine computes them in f32.
        let hd = model.config.head_dim as f32;
        out.extend(
            [1.0, 1.0 / hd, 1.0 / hd.sqrt()]
                .into_iter()
                .filter(|&x| near(x as f64)),
        );
    }
    out
}

/// Fit `knob` to the candidate at `k`: from the model's value, walk to the ends of the knob's
/// range (a single op: only the way whose first step lowers the NMSE), then try the round values
/// around the best point; ties go to the value closest to the model's (the smallest change
/// that explains the key). `near` (a flagged key): where no point of the walk beats the model's
/// value, the round values within one step of it are tried too — a value closer to the model's
/// than one step (attention scale 0.2 for 0.25) is overshot by the walk's first steps. None
/// when nothing lowers the own error at all. The catalog's own wrong values (eps ×10, its
/// wrong theta) are left to the catalog.
#[allow(clippy::too_many_arguments)]
fn fit(
    model: &Model,
    cand: &Candidate,
    base: &Setup,
    knob: Knob,
    k: TapKey,
    own: Option<f64>,
    span: bool,
    near: bool,
) -> Result<Vec<(f32, f64)>, JudgeError> {
    let Some(own) = own else {
        return Ok(Vec::new());
    };
    let v0 = knob.model_value(&model.config);
    if !(v0.is_finite() && v0 > 0.0) {
        return Ok(Vec::new());
    }
    let (step, lo, hi) = knob_search(knob, v0);
    let l0 = (v0 as f64).log10();
    let mut seen: Vec<(f32, f64)> = Vec::new();
    let mut eval = |v: f32| -> Result<f64, JudgeError> {
        if let Some(&(_, e)) = seen.iter().find(|(x, _)| *x == v) {
            return Ok(e);
        }
        let setup = Setup {
            knob: Some((knob, v)),
            ..base.clone()
        };
        let r = replay(model, cand, &setup, &BTreeSet::new())?;
        let e = r.metrics.get(&k).map_or(f64::INFINITY, |m| m.nmse);
        seen.push((v, e));
        Ok(e)
    };
    // A point of the walk: for eps and theta rounded to 3 significant digits (engines use
    // round values; 10^-3, not its neighbour), for the scale the model's times a power of 2.
    let at = |l: f64| -> f32 {
        match knob {
            Knob::AttnScale | Knob::RopeFreqScale => {
                (v0 as f64 * 2f64.powf(((l - l0) / step).round())) as f32
            }
            _ => format!("{:.2e}", 10f64.powf(l)).parse().unwrap_or(f32::NAN),
        }
    };
    let (mut up_l, mut down_l) = (l0 + step, l0 - step);
    let (mut up, mut down) = (eval(at(up_l))?, eval(at(down_l))?);
    // A single op whose first steps change nothing says nothing yet of the way to go: the
    // knob's effect is under f32's resolution there (eps 1e-5 beside a final norm's mean
    // square of 400, for an engine whose final norm adds 10). Each way is walked on to the
    // first point that changes the op's output.
    if !span && up.min(down) >= own {
        let same = eval(v0)?;
        for (l, e, dir) in [(&mut up_l, &mut up, 1.0), (&mut down_l, &mut down, -1.0)] {
            while *e == same && (lo..=hi).contains(&(*l + dir * step)) {
                *l += dir * step;
                *e = eval(at(*l))?;
            }
        }
    }
    // The base the trace's own rotation says, where it has q or k on both sides of RoPE: a
    // base between the walk's half-decade points (12000) is reached no other way, RoPE's
    // error not being monotone in it.
    let mut solved: Option<(f64, f64)> = None;
    if knob == Knob::RopeTheta {
        for v in solve_theta(model, cand, k)? {
            let e = eval(v)?;
            if solved.is_none_or(|s| e < s.1) {
                solved = Some(((v as f64).log10(), e));
            }
        }
    }
    // Under 8-bit activations a span's NMSE is not monotone in the knob: near the model's value
    // requantization flips dominate (eps 1e-5 and 1e-4 both worse than 1e-6 on a span of an
    // engine whose eps is 1e-3, which reproduces it exactly). A span is searched both ways to
    // the ends of the range; a single op, whose NMSE is monotone, in the direction whose first
    // step helps, and not at all when neither does (two replays on a clean trace).
    let dirs: Vec<f64> = if span {
        vec![1.0, -1.0]
    } else if up.min(down) >= own && solved.is_none_or(|s| s.1 >= own) && !near {
        return Ok(Vec::new());
    } else if up.min(down) >= own {
        vec![]
    } else if up <= down {
        vec![1.0]
    } else {
        vec![-1.0]
    };
    let (mut best_l, mut best) = if up <= down {
        (up_l, up)
    } else {
        (down_l, down)
    };
    if let Some((l, e)) = solved.filter(|s| s.1 < best) {
        (best_l, best) = (l, e);
    }
    for dir in dirs {
        let mut l = if dir > 0.0 { up_l } else { down_l };
        loop {
            l += dir * step;
            if l < lo || l > hi {
                break;
            }
            let e = eval(at(l))?;
            if e < best {
                (best_l, best) = (l, e);
            }
        }
    }
    // The round values within a step of the model's: where no point of the walk beats the
    // model's value (a flagged key), the answer, if any, lies there; in a span, whose own
    // error is not monotone in the knob, the walk's best point can be a flip's accident far
    // away (eps 1e-13 at 6.5e-5 beside the model's 6.8e-5, on a 16-layer span of 8-bit
    // activations whose engine uses 2e-5, reproduced exactly there).
    let around_model = span || (best >= own && near);
    if best >= own && near {
        (best_l, best) = (l0, own);
    }
    if around_model {
        for v in round_values(knob, model, v0 as f64, 10f64.powf(step))
            .into_iter()
            .filter(|&v| v != v0)
        {
            let e = eval(v)?;
            if e < best {
                (best_l, best) = ((v as f64).log10(), e);
            }
        }
    }
    // A value between the walk's points and off the round ones (eps 3e-6, a scale of 0.15):
    // a golden-section search of the step either side of the best point, given up where it
    // has not halved the own error after a few probes (this knob is not the bug); then the
    // fewest significant digits that fit as well (below). Under the floor (not `near`) only
    // where a point already cut the own error `CONFIRM_CUT`-fold: a clean trace's replays
    // stay few.
    // The round values around the best point, before any finer search: an engine writes
    // those, and the search must do better than they do.
    if best < own {
        for v in round_values(knob, model, 10f64.powf(best_l), 10f64.powf(step)) {
            let e = eval(v)?;
            if e < best {
                (best_l, best) = ((v as f64).log10(), e);
            }
        }
    }
    // A span's RoPE base: under 8-bit activations the own error has a basin a fifth of the
    // base wide around the engine's value and is flat beyond it (a base 12000 for the model's
    // 10000, TinyStories-656K-Q8_0 sparse, layer 0's l_out: 1.4e-5 at 10000, 9.4e-6 at 11000,
    // 0 at 11900..12000, 4.1e-6 at 13000, 1.3e-5 at 16000 and on), so the half-decade walk
    // steps over it and no point cuts much; the search below then starts at the model's
    // value and gives up after a few probes where none is under it (a clean trace).
    let basin =
        span && matches!(knob, Knob::RopeTheta | Knob::AttnScale) && best * CONFIRM_CUT > own;
    if basin {
        (best_l, best) = (l0, best.min(own));
    }
    let mut probes: Vec<f32> = Vec::new();
    if best > VISIBLE && (near || basin || best * CONFIRM_CUT <= own) {
        // In the basin search, where the half-decade points said nothing, a probe under the
        // model's own value is enough to go on (an f16 cache's basin: 0 at the engine's value
        // and within 2× of the model's own error a tenth away).
        let go_on = if basin { own } else { own * 0.5 };
        let bracket = ((best_l - step).max(lo), (best_l + step).min(hi));
        let mut pt = |l: f64| {
            let v = 10f64.powf(l) as f32;
            probes.push(v);
            eval(v)
        };
        let (l, e) = golden_section(bracket, go_on, &mut pt)?;
        // Kept only where it halves the best error before it: short of that the search fit
        // the engine's rounding noise (a Vulkan golden's RoPE base, sparse: 501000 at 4.7e-6
        // beside 500000 at 4.8e-6), and the round value stands.
        if e * 2.0 <= best {
            probes.clear();
            best = e;
            let v = 10f64.powf(l);
            for digits in 1..=4 {
                if let Ok(x) = format!("{v:.*e}", digits - 1).parse::<f32>() {
                    eval(x)?;
                }
            }
        }
    }
    if best >= own {
        return Ok(Vec::new());
    }
    Ok(pick(knob, v0, &seen, &probes))
}

/// The value a knob's search reports among those it replayed (`seen`, with their NMSE; not
/// `probes`, a golden-section search's points where it was not kept): the best that is not
/// one of the catalog's own values (the model's, eps x10, the catalog's wrong theta), with the
/// ends of the values an engine writes that fit as well.
fn pick(knob: Knob, v0: f32, seen: &[(f32, f64)], probes: &[f32]) -> Vec<(f32, f64)> {
    let l0 = (v0 as f64).log10();
    // The catalog's own wrong values are the catalog's to name.
    let catalog = |v: f32| {
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 * b.abs();
        close(v, v0)
            || (knob == Knob::RmsEps && close(v, v0 * 10.0))
            || (knob == Knob::RopeTheta && close(v, wrong_theta(v0)))
    };
    let min = seen
        .iter()
        .filter(|(v, _)| !catalog(*v) && !probes.contains(v))
        .map(|&(_, e)| e)
        .fold(f64::INFINITY, f64::min);
    // As good as the best: within 1% of it (an exact fit, 0, ties only with 0); of those the
    // value an engine writes (the fewest significant digits), then the closest to the model's.
    let dist = |v: f32| ((v as f64).log10() - l0).abs();
    let alike: Vec<(f32, f64)> = seen
        .iter()
        .filter(|&&(v, e)| !catalog(v) && e <= min * 1.01)
        .filter(|(v, _)| !probes.contains(v))
        .copied()
        .collect();
    let Some(&pick) = alike.iter().min_by(|a, b| {
        digits(a.0)
            .cmp(&digits(b.0))
            .then(dist(a.0).total_cmp(&dist(b.0)))
    }) else {
        return Vec::new();
    };
    // Where other values fit as well (8-bit activations hide eps 3e-6 from 5e-6), the ends of
    // what was seen to tie go with it, for the verdict to say the trace cannot tell them apart
    // (values an engine writes: the search's own probes are not listed).
    let written: Vec<&(f32, f64)> = alike.iter().filter(|a| digits(a.0) <= 3).collect();
    let mut out = vec![pick];
    for end in [
        written.iter().min_by(|a, b| a.0.total_cmp(&b.0)),
        written.iter().max_by(|a, b| a.0.total_cmp(&b.0)),
    ]
    .into_iter()
    .flatten()
    {
        if !out.iter().any(|o| o.0 == end.0) {
            out.push(**end);
        }
    }
    out
}

/// A golden-section search of `bracket` (log10 of the value) for the lowest of `eval`: the
/// best point and its NMSE, given up at `REFINE_GIVE_UP` probes where none is under `go_on`.
fn golden_section(
    bracket: (f64, f64),
    go_on: f64,
    eval: &mut impl FnMut(f64) -> Result<f64, JudgeError>,
) -> Result<(f64, f64), JudgeError> {
    let (mut a, mut b) = bracket;
    let mut c = b - GOLDEN * (b - a);
    let mut d = a + GOLDEN * (b - a);
    let (mut fc, mut fd) = (eval(c)?, eval(d)?);
    for i in 0..REFINE_PROBES {
        if i == REFINE_GIVE_UP && fc.min(fd) >= go_on {
            break;
        }
        if fc < fd {
            (b, d, fd) = (d, c, fc);
            c = b - GOLDEN * (b - a);
            fc = eval(c)?;
        } else {
            (a, c, fc) = (c, d, fd);
            d = a + GOLDEN * (b - a);
            fd = eval(d)?;
        }
    }
    Ok(if fc < fd { (c, fc) } else { (d, fd) })
}

/// The golden ratio's inverse: each probe of a golden-section search keeps this much of the
/// bracket.
const GOLDEN: f64 = 0.618_033_988_749_895;
/// Probes of a knob's golden-section search: the bracket of two steps shrinks to 0.6% of
/// one (eps to within 1.5%, a scale to within 0.4%), closer than the 2 digits engines write.
const REFINE_PROBES: usize = 12;
/// The probe where a search that has not halved the own error gives up.
const REFINE_GIVE_UP: usize = 4;

/// Significant digits of `v` as the shortest decimal that reads back as it (`3e-6`: 1,
/// `3.16e-6`: 3).
fn digits(v: f32) -> usize {
    let s = format!("{v:e}");
    let mantissa = s.split('e').next().unwrap_or("");
    mantissa.chars().filter(|c| c.is_ascii_digit()).count()
}

/// The RoPE base the candidate's own rotation of pair 1 says at `k` (q_rope or k_rope, where
/// the trace has the same step's q or k before RoPE):
/// at positions 1..3 that pair turns by p·θ^(-2/n_rot) < π, so the angle between a head's pair
/// before and after RoPE gives θ with no wrap (the median over rows and heads), returned to 3
/// and 4 significant digits. Empty where the trace cannot say.
fn solve_theta(model: &Model, cand: &Candidate, k: TapKey) -> Result<Vec<f32>, JudgeError> {
    let pre = match k.tap {
        Tap::QRope => [Tap::QNormed, Tap::Q],
        Tap::KRope => [Tap::KNormed, Tap::K],
        _ => return Ok(Vec::new()),
    };
    let c = &model.config;
    let Some(pre) = pre
        .into_iter()
        .map(|t| TapKey::new(k.step, k.layer, t))
        .find(|p| cand.contains(p))
    else {
        return Ok(Vec::new());
    };
    let (Some(x), Some(y), Some([t, nh, hd])) = (cand.get(&pre)?, cand.get(&k)?, cand.dims(&k))
    else {
        return Ok(Vec::new());
    };
    let Some(step) = cand.trace.manifest.steps.iter().find(|s| s.step == k.step) else {
        return Ok(Vec::new());
    };
    if c.n_rot < 4 || c.n_rot > hd || x.len() != t * nh * hd || y.len() != x.len() {
        return Ok(Vec::new());
    }
    let (ia, ib) = match c.rope_type {
        RopeType::Norm => (2, 3),
        RopeType::Neox => (1, 1 + c.n_rot / 2),
    };
    let fs = c.rope_freq_scale as f64;
    let mut est: Vec<f64> = Vec::new();
    for (row, &p) in step.positions.iter().enumerate().take(t) {
        let turn = p as f64 * fs;
        if !(1.0..=3.0).contains(&turn) {
            continue;
        }
        for h in 0..nh {
            let at = (row * nh + h) * hd;
            let (a, b) = (x[at + ia] as f64, x[at + ib] as f64);
            let (a2, b2) = (y[at + ia] as f64, y[at + ib] as f64);
            if a * a + b * b < 1e-12 {
                continue;
            }
            let freq = (a * b2 - b * a2).atan2(a * a2 + b * b2) / turn;
            if freq > 0.0 && freq < 1.0 {
                est.push(freq.powf(-(c.n_rot as f64) / 2.0));
            }
        }
    }
    let Some(theta) = super::floor::median(est).filter(|v| v.is_finite()) else {
        return Ok(Vec::new());
    };
    // Engines use round values: the base to 3 and 4 significant digits, never the raw estimate
    // (an engine's angles an ulp off ggml's, numpy's float32 power, would pick 11999.98).
    Ok([2, 3]
        .into_iter()
        .filter_map(|d| format!("{theta:.d$e}").parse::<f32>().ok())
        .filter(|v| v.is_finite() && *v > 1.0)
        .collect())
}

/// A hypothesis within this factor of the own error is replayed under the tie twins too.
const TWIN_RETRY: f64 = 2.0;
/// A hypothesis that cuts an own error this much, unconfirmed, is retried under the other K/V
/// caches.
const CACHE_RETRY: f64 = 2.0;

/// Below this an own error is f32 noise (summation order, libm ulps), nothing to explain.
pub const VISIBLE: f64 = 1e-12;
/// A hypothesis *explains* an own error under its floor when it cuts it at least this much:
/// a correct engine's own error is noise (rounding it does unlike the reference, summation
/// order), which no bug hypothesis can remove; on clean traces the best cut any hypothesis
/// makes is measured in docs/tolerances.md ("Own errors under the floor").
pub const EXPLAINS: f64 = 100.0;
/// How many places (distinct layer and tap) the below-floor check tests.
pub const BELOW_FLOOR_PLACES: usize = 3;
/// The prompt rows the below-floor check replays at a prompt's keys (`Setup::rows`).
pub const BELOW_FLOOR_ROWS: usize = super::replay::MEASURE_ROWS;

/// The below-floor check at one key: its own error, and the hypothesis that came closest.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BelowFloor {
    pub key: TapKey,
    pub own_nmse: f64,
    pub floor: f64,
    /// The hypothesis with the lowest NMSE (None: none applies to the key).
    pub best: Option<Tried>,
    /// The hypotheses within 100× of the best, lowest first (four at most): what
    /// `judge::under_other_setups` screens where the measured rounding may be the bug's.
    #[serde(skip)]
    pub near: Vec<Tried>,
    /// The prompt rows the own error and the hypotheses were measured over (`Setup::rows`;
    /// None: every row).
    #[serde(skip)]
    pub rows: Option<usize>,
    /// Where the best hypothesis cut the own error `EXPLAINS`-fold but not to 0: what the
    /// engine's own arithmetic may flip at the key (`ambiguity::engine_like`), which the own
    /// error must stand `ambiguity::FACTOR` times above to be explained.
    pub ambiguity: Option<f64>,
    /// Where the best hypothesis explained the key but does not hold over the trace: why not
    /// (`holds`: the differences it predicts elsewhere that the engine does not show).
    pub not_held: Option<String>,
}

impl BelowFloor {
    /// Whether the best hypothesis explains the own error: cuts it `EXPLAINS`-fold, and the
    /// own error stands clear of the key's ambiguity.
    pub fn explained(&self) -> bool {
        self.cut() >= EXPLAINS
            && self
                .ambiguity
                .is_none_or(|d| self.own_nmse > super::ambiguity::FACTOR * d)
    }

    /// How many times the best hypothesis cuts the own error (1: not at all). An exact
    /// reproduction (NMSE 0) counts as NMSE 1e-20, so the cut stays finite (and JSON-able).
    pub fn cut(&self) -> f64 {
        match &self.best {
            Some(t) => self.own_nmse / t.nmse.max(1e-20),
            None => 1.0,
        }
    }
}

/// The hypotheses within 100× of the lowest NMSE, lowest first, four at most: the ones worth
/// replaying under another rounding or cache.
pub(super) fn closest(tried: impl Iterator<Item = Tried>) -> Vec<Tried> {
    let mut v: Vec<Tried> = tried.collect();
    v.sort_by(|a, b| a.nmse.total_cmp(&b.nmse));
    let lowest = v.first().map_or(0.0, |t| t.nmse);
    v.retain(|t| t.nmse <= 100.0 * lowest);
    v.truncate(4);
    v
}

/// Every hypothesis at `k` under the cache `kv` (the catalog's bugs, each knob fitted again
/// there), with the own NMSE of that setup's clean replay at `k`: a key judged under the floors
/// screened under another cache (`super::under_other_setups`).
pub(super) fn tried_under(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    k: TapKey,
    rows: Option<usize>,
) -> Result<(Option<f64>, Vec<Tried>), JudgeError> {
    let ex = experiments(model, cand, floors, kv, k, true, None, false, rows, false)?;
    let clean = ex.plain.metrics.get(&k).map(|m| m.nmse);
    Ok((clean, ex.tried.into_iter().map(|(t, _)| t).collect()))
}

/// Of `setups`, the one whose replay comes closest to the candidate at `k`, where closer than
/// `best`: its NMSE there, and the setup.
fn closer(
    model: &Model,
    cand: &Candidate,
    k: &TapKey,
    best: f64,
    setups: Vec<Setup>,
) -> Result<Option<(f64, Setup)>, JudgeError> {
    let mut out: Option<(f64, Setup)> = None;
    for setup in setups {
        let r = replay(model, cand, &setup, &BTreeSet::new())?;
        let bar = out.as_ref().map_or(best, |c| c.0);
        if let Some(m) = r.metrics.get(k).filter(|m| m.nmse < bar) {
            out = Some((m.nmse, setup));
        }
    }
    Ok(out)
}

/// `knob` alone fitted again at `k` under the cache `kv`: its value and NMSE there (None: the
/// span's ops do not read it). A value confirmed under a cache the measurement was unsure of,
/// fitted where another cache may reproduce the key closer (`super::knob_under_other_caches`).
pub(super) fn knob_under(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    k: TapKey,
    knob: Knob,
) -> Result<Option<(f32, f64)>, JudgeError> {
    let only = BTreeSet::from([knob.name()]);
    let ex = experiments(
        model,
        cand,
        floors,
        kv,
        k,
        true,
        Some(&only),
        true,
        None,
        false,
    )?;
    Ok(ex
        .tried
        .iter()
        .filter_map(|(t, _)| match t.hypothesis {
            Hypothesis::Knob(kn, v) if kn == knob => Some((v, t.nmse)),
            _ => None,
        })
        .min_by(|a, b| a.1.total_cmp(&b.1)))
}

/// When every op is within its floor: an own error well above f32 noise that a known bug
/// reproduces is that bug, not noise. A floor has to admit what correct engines do unlike the
/// reference (an f16 K/V cache moves a whole-layer span by up to ~1e-5), and a small bug in a
/// span (an rms eps ×10 moves a layer's output by ~1e-10 in a plain-f32 engine) can sit under
/// it; the experiment tells them apart where magnitude cannot. The keys tested: in the
/// trace's first step (the prompt: every compute bug but the KV cache's acts there, and the
/// window is one step), at most `BELOW_FLOOR_PLACES` keys above `VISIBLE`, the ones whose own
/// error stands highest above its floor.
pub(super) fn below_floor(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    ops: &[OpResult],
    run: bool,
) -> Result<(Vec<BelowFloor>, Option<Finding>), JudgeError> {
    let first_step = ops.iter().map(|o| o.key.step).min();
    let mut places: Vec<(f64, &OpResult)> = ops
        .iter()
        .filter(|o| Some(o.key.step) == first_step && o.own_nmse > VISIBLE && o.floor > 0.0)
        .map(|o| (o.own_nmse / o.floor, o))
        .collect();
    places.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.key.cmp(&b.1.key)));
    let mut checks = Vec::new();
    if !run {
        return Ok((checks, None));
    }
    // A hypothesis that moves a place far more than the engine's own error did is not the
    // engine's bug (catalog bugs act in every layer): later places try only the rest.
    let mut still: Option<BTreeSet<String>> = None;
    for (_, o) in places.into_iter().take(BELOW_FLOOR_PLACES) {
        // In a long prompt, the prompt's first rows (`BELOW_FLOOR_ROWS`): a catalog bug or a
        // knob acts on every row, and each experiment costs the same at any length. Where the
        // own error lies past them (under a tenth there), every row.
        let only = still.clone();
        let run = |rows| {
            experiments(
                model,
                cand,
                floors,
                kv,
                o.key,
                true,
                only.as_ref(),
                false,
                rows,
                false,
            )
        };
        let mut rows = Some(BELOW_FLOOR_ROWS);
        let mut ex = run(rows)?;
        let mut own = o.own_nmse;
        if ex.plain.cut {
            // As the own errors over every row were measured: the closest of the rounding's
            // tie twins (`rounding::refit_ties`), which the experiments try too.
            own = ex.plain.metrics.get(&o.key).map_or(0.0, |m| m.nmse);
            let base = Setup {
                rows,
                ..clean_setup(floors, kv, ex.window)
            };
            if let Some((n, _)) = closer(
                model,
                cand,
                &o.key,
                own,
                rounding::twin_setups(&base, model),
            )? {
                own = n;
            }
            if own * 10.0 < o.own_nmse {
                rows = None;
                own = o.own_nmse;
                ex = run(rows)?;
            }
        } else {
            rows = None;
        }
        if rows.is_none() {
            // Over every row the pass measured the own error under the rounding's tie twins
            // (`rounding::refit_ties`), not under the cache's, which the experiments try.
            let base = clean_setup(floors, kv, ex.window);
            if let Some((n, _)) =
                closer(model, cand, &o.key, own, rounding::cache_twin_setups(&base))?
            {
                own = n;
            }
        }
        still = Some(
            ex.tried
                .iter()
                .filter(|(t, _)| t.nmse <= EXPLAINS * own)
                .map(|(t, _)| t.hypothesis.name())
                .collect(),
        );
        let near = closest(ex.tried.iter().map(|(t, _)| t.clone()));
        let mut check = BelowFloor {
            key: o.key,
            own_nmse: own,
            floor: o.floor,
            best: near.first().cloned(),
            near,
            rows,
            ambiguity: None,
            not_held: None,
        };
        // An own error is explained only where it stands well above what this engine's own
        // arithmetic may flip at the key (`ambiguity::engine_like`): under that, a change that
        // flips a quantized cache's quantum the way the engine's sums did cuts it by chance (a
        // plain f32 engine summing in f32, a 398-token prompt, Q8_0 cache: own 2.4e-12 at
        // layer 1, cut 110x by eps x10; its own sums flip 2.4e-12 there).
        // A hypothesis that reproduces the key bit for bit is the engine's arithmetic there:
        // an engine whose own sums flipped a quantum would leave the rest of its noise.
        let exact = check.best.as_ref().is_some_and(|t| t.nmse == 0.0);
        if check.cut() >= EXPLAINS && !exact {
            let base = Setup {
                rows,
                ..clean_setup(floors, kv, ex.window)
            };
            let like = super::ambiguity::engine_like(floors);
            check.ambiguity = Some(super::ambiguity::distance(
                model, cand, &base, &o.key, like,
            )?);
        }
        if check.explained() {
            // Confirmed over every row, as any finding is.
            if rows.is_some() {
                ex = run(None)?;
            }
            let f = finding(model, cand, floors, o, ops, ex, o.own_nmse / EXPLAINS, true)?;
            // Under the floor only a confirmed bug is a finding: one that cuts this key but
            // does not hold over the trace leaves it noise, and the report says why.
            if f.confirmed.is_some() {
                checks.push(check);
                return Ok((checks, Some(f)));
            }
            let best = check.best.as_ref().map(|t| t.hypothesis.name());
            check.not_held = f
                .contradicted
                .iter()
                .find(|(h, _)| Some(h) == best.as_ref())
                .map(|(_, why)| why.clone());
        }
        checks.push(check);
    }
    Ok((checks, None))
}

pub(super) fn diagnose(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    op: &OpResult,
    ops: &[OpResult],
    run: bool,
) -> Result<Finding, JudgeError> {
    let ex = experiments(model, cand, floors, kv, op.key, run, None, true, None, true)?;
    if ex.knobs_deferred {
        let f = finding(model, cand, floors, op, ops, ex, op.floor, false)?;
        if f.catalog.is_some() {
            return Ok(f);
        }
        // The exact catalog bug did not hold over the trace: every hypothesis, knobs too.
        let ex = experiments(
            model, cand, floors, kv, op.key, run, None, true, None, false,
        )?;
        return finding(model, cand, floors, op, ops, ex, op.floor, false);
    }
    finding(model, cand, floors, op, ops, ex, op.floor, false)
}

/// The finding at `op` from its experiments: a hypothesis whose NMSE is at most `threshold`
/// is confirmed (`below`: `op` is within its floor, and only an explaining hypothesis makes it
/// a finding).
#[allow(clippy::too_many_arguments)]
fn finding(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    op: &OpResult,
    ops: &[OpResult],
    ex: Experiments,
    threshold: f64,
    below: bool,
) -> Result<Finding, JudgeError> {
    let k = op.key;
    let Experiments {
        plain,
        tried,
        setups,
        window,
        span: sp,
        ran: experiments,
        knobs_deferred: _,
    } = ex;
    let floor = op.floor;
    let Decision {
        confirmed,
        also,
        ruled_out,
        contradicted,
        located,
    } = decide(model, cand, floors, op, ops, &tried, &setups, threshold)?;

    // The text.
    let mut text = if below {
        format!(
            "first own error explained by experiment: {k} — own NMSE {:.2e}, under its floor {:.0e} (which admits what correct engines do unlike the reference) but {:.0}× the f32 noise level {VISIBLE:.0e}, and a known bug removes it (cosine {:.6})",
            op.own_nmse,
            floor,
            op.own_nmse / VISIBLE,
            op.cosine
        )
    } else {
        format!(
            "first op out of its noise floor: {k} — own NMSE {:.2e} (floor {:.0e}, cosine {:.6})",
            op.own_nmse, floor, op.cosine
        )
    };
    if let Some((e, plain_e, hyp_e)) = located {
        let fe = ops.iter().find(|o| o.key == e).map_or(0.0, |o| o.floor);
        text.push_str(&format!(
            "\n  placed by experiment at {e}: the hypothesis confirmed below reproduces it there too (own NMSE {plain_e:.1e}, {hyp_e:.1e} under it), below that key's floor {fe:.0e} — the bug shows from there on"
        ));
    } else if let Some(setup) = confirmed
        .as_ref()
        .and_then(|(t, _)| setups.get(&t.hypothesis.name()))
        && let Some((e, moved, own)) = acts_from(model, cand, setup, ops, &k)?
    {
        text.push_str(&format!(
            "\n  it acts from {e} on (the replays with and without it differ there, NMSE {moved:.1e}), where the engine's own error ({own:.1e}, its rounding) cannot tell it apart: {k} is the first key that shows it"
        ));
    }
    if sp.len() > 1 {
        let layers: BTreeSet<Option<usize>> = sp.iter().map(|x| x.layer).collect();
        text.push_str(&format!(
            "\n  judged as a span of {} ops (the trace has no taps inside it{}): the bug is in this span, at {} granularity",
            sp.len(),
            match window.l0 {
                0 => String::new(),
                l => format!("; recomputed from its l_out-{}", l - 1),
            },
            if layers.len() > 1 { "multi-layer" } else { "layer" }
        ));
    }
    let mut fallback = false;
    match &confirmed {
        Some((t, m)) => {
            text.push_str(&format!(
                "\n  confirmed by experiment: {} reproduces your {} at NMSE {:.1e}",
                t.hypothesis, k.tap, t.nmse
            ));
            let range = knob_range(&t.hypothesis, &also);
            text.push_str(&format!(
                " — {}",
                explain(model, &t.hypothesis, *m, &k, range)
            ));
            if let Hypothesis::Knob(Knob::RmsEps, v) = t.hypothesis
                && sp.len() > 1
                && range.is_none()
                && let Some(setup) = setups.get(&t.hypothesis.name())
                && !final_norm_pins(model, cand, setup, &k, v)?
            {
                text.push_str(
                    "\n  the value is read from a span of rounded activations, which values near it may reproduce as exactly (the same step's final norm, on its own, does not confirm it): the engine's eps is not the model's, and this one reproduces the span",
                );
            }
            if !also.is_empty() {
                let names: Vec<String> = also.iter().map(Hypothesis::name).collect();
                text.push_str(&format!(
                    "\n  also reproduces it: {} (this trace cannot tell these apart{})",
                    names.join(", "),
                    if sp.len() > 1 {
                        "; dump the taps inside the span to separate them"
                    } else {
                        ""
                    }
                ));
            }
        }
        None if experiments => {
            fallback = true;
            text.push_str("\n  no hypothesis reproduces it");
            if matches!(k.tap, Tap::QRope | Tap::KRope)
                && let Some(l) = k.layer
                && let Some(o) = super::rope_fit::observed(model, cand, l)?
            {
                text.push_str(&format!("\n  measured: {o}"));
            }
            if let Some(o) = super::lookup::observed(model, cand, &k)? {
                text.push_str(&format!("\n  measured: {o}"));
            }
            if sp.len() == 1
                && let Some(o) = super::normscale::observed(model, cand, &k)?
            {
                text.push_str(&format!("\n  measured: {o}"));
            }
            if k.tap == Tap::KqSoftMax
                && let Some(ours) = plain.kept.get(&k)
                && let (Some(theirs), Some(dims)) = (cand.get_over(&k, ours)?, cand.dims(&k))
                && let Some(row) = first_row(ours, &theirs, dims, k.tap, floor)
                && let Some(o) = super::kv_fit::observed(model, cand, &k, row)?
            {
                text.push_str(&format!("\n  measured: {o}"));
            }
            let h = heuristic(model, cand, &plain.kept, &k)?;
            text.push_str(&format!(
                "\n  fallback (text heuristics, not an experiment): {h}"
            ));
        }
        None => {
            fallback = true;
            let h = heuristic(model, cand, &plain.kept, &k)?;
            text.push_str(&format!(
                "\n  fallback (text heuristics; experiments not run): {h}"
            ));
        }
    }
    if !ruled_out.is_empty() {
        text.push_str(&format!(
            "\n  ruled out by experiment (NMSE under each): {}",
            ruled_out_text(&ruled_out)
        ));
    }
    if !contradicted.is_empty() {
        let list: Vec<String> = contradicted
            .iter()
            .map(|(h, why)| format!("{h} ({why})"))
            .collect();
        text.push_str(&format!(
            "\n  reproduces it here but not elsewhere in the trace, so not the cause: {}",
            list.join("; ")
        ));
    }
    Ok(Finding {
        position: None,
        zoom: None,
        key: located.map_or(k, |l| l.0),
        flagged: k,
        own_nmse: op.own_nmse,
        floor,
        span_ops: sp.len(),
        confirmed_nmse: confirmed.as_ref().map(|(t, _)| t.nmse),
        catalog: confirmed
            .as_ref()
            .and_then(|(_, m)| m.map(|m| m.name().to_string())),
        hypothesis: confirmed.as_ref().map(|(t, _)| t.hypothesis),
        confirmed: confirmed.map(|(t, _)| t.hypothesis.name()),
        also: also.iter().map(Hypothesis::name).collect(),
        ruled_out,
        fallback,
        explained: below,
        contradicted: contradicted
            .iter()
            .map(|(h, why)| (h.name(), why.clone()))
            .collect(),
        text,
    })
}

/// Which hypotheses the experiments at a key confirm, and why each other one is not the cause.
struct Decision {
    /// The cause, with its catalog entry where it is one.
    confirmed: Option<(Tried, Option<Mutation>)>,
    /// Hypotheses the trace cannot tell apart from it.
    also: Vec<Hypothesis>,
    /// Hypotheses that do not reproduce the key.
    ruled_out: Vec<Tried>,
    /// Hypotheses that reproduce it but not elsewhere in the trace, and why.
    contradicted: Vec<(Hypothesis, String)>,
    /// Where the confirmed one places the bug, earlier than the key: (key, own NMSE there,
    /// under it).
    located: Option<(TapKey, f64, f64)>,
}

/// The decision at `op` from the hypotheses `tried` there (`setups`: each one's replay setup;
/// a layout has none): one is confirmed within `threshold` (the floor; under it, the own error
/// cut `EXPLAINS`-fold), cutting the own error by a wide factor, holding over the whole trace.
#[allow(clippy::too_many_arguments)]
fn decide(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    op: &OpResult,
    ops: &[OpResult],
    tried: &[(Tried, Option<Mutation>)],
    setups: &BTreeMap<String, Setup>,
    threshold: f64,
) -> Result<Decision, JudgeError> {
    let k = op.key;
    // Confirmed: within the threshold (the floor; under it, the own error cut `EXPLAINS`-fold),
    // cutting the own error by a wide factor (`CONFIRM_CUT`, `KNOB_CUT` for a continuous knob)
    // and holding over the whole trace (`holds`); the lowest NMSE wins (the catalog first on
    // ties).
    let mut ok: Vec<&(Tried, Option<Mutation>)> = tried
        .iter()
        .filter(|(t, _)| t.nmse <= threshold && t.nmse * cut_needed(&t.hypothesis) <= op.own_nmse)
        .collect();
    ok.sort_by(|a, b| a.0.nmse.total_cmp(&b.0.nmse));
    let mut contradicted: Vec<(Hypothesis, String)> = Vec::new();
    let mut held = Vec::with_capacity(ok.len());
    for c in ok {
        match setups.get(&c.0.hypothesis.name()) {
            Some(setup) => match holds(
                model,
                cand,
                floors,
                setup,
                ops,
                &k,
                c.0.hypothesis.is_knob(),
            )? {
                Ok(n) => held.push((c, n)),
                Err(why) => contradicted.push((c.0.hypothesis, why)),
            },
            // A layout reads the candidate's own tensor in another order: nothing to re-run.
            None => held.push((c, 0)),
        }
    }
    // Equal at the flagged key, the one that explains more of the trace comes first (stable:
    // the lowest NMSE, the catalog first, among equals).
    // A fitted output scale comes after any catalog bug or knob that reproduces the key too:
    // those name the cause, the factor only its size.
    held.sort_by_key(|((t, _), n)| (t.hypothesis.is_scale(), std::cmp::Reverse(*n)));
    // One that brings fewer of the trace's keys within their floors than the best is told
    // apart by the trace (positions modulo 20 and positions counted inside each step agree at
    // the first decode step, not at the second): not listed as its equal.
    let most = held
        .iter()
        .filter(|((t, _), _)| !t.hypothesis.is_scale())
        .map(|(_, n)| *n)
        .max();
    let best = held
        .iter()
        .find(|((t, _), n)| Some(*n) == most && !t.hypothesis.is_scale())
        .map(|((t, _), _)| t.hypothesis.name())
        .unwrap_or_default();
    let mut kept = Vec::with_capacity(held.len());
    for (c, n) in held {
        match most {
            Some(m) if n < m && !c.0.hypothesis.is_scale() => contradicted.push((
                c.0.hypothesis,
                format!(
                    "of the keys out of their floors it brings {n} within them, {best} brings {m}"
                ),
            )),
            _ => kept.push(c),
        }
    }
    let held = kept;
    // Where each reproduces the bug from: the one that explains the earliest key is the bug
    // (on a tie the lowest NMSE, the catalog first); one that explains only later keys is
    // not (another eps can match a decode step the real one matches too, and miss the prompt).
    let mut placed = Vec::with_capacity(held.len());
    for c in held {
        let loc = match setups.get(&c.0.hypothesis.name()) {
            Some(setup) => place(model, cand, setup, ops, &k)?,
            // A layout reads the candidate's own tensor in another order: nothing to re-run.
            None => None,
        };
        placed.push((c, loc));
    }
    let earliest = placed.iter().map(|(_, l)| l.map_or(k, |l| l.0)).min();
    let mut ok = Vec::with_capacity(placed.len());
    let mut located = None;
    for (c, loc) in placed {
        let at = loc.map_or(k, |l| l.0);
        if Some(at) == earliest {
            if ok.is_empty() {
                located = loc;
            }
            ok.push(c);
        } else if let Some(e) = earliest {
            contradicted.push((
                c.0.hypothesis,
                format!("it does not reproduce {e}, where the bug already shows"),
            ));
        }
    }
    let confirmed = ok.first().map(|(t, m)| (t.clone(), *m));
    // A scale confirmed in every layer: the same factor in one layer alone is a narrower
    // reading of it (short of support where the trace is short), not a rival.
    if let Some((t, _)) = &confirmed
        && matches!(
            t.hypothesis,
            Hypothesis::Knob(Knob::OutputScale(_, None), _)
        )
    {
        contradicted.retain(|(h, _)| !h.is_scale());
    }
    // A catalog bug that is a constant factor (a missing embedding scale) is what a fitted
    // output scale reproduces too: its name says more, the factor is not listed beside it.
    // Nor is one scale listed beside another: the one confirmed (every layer where the trace
    // shows it there too, else the flagged layer's) says where it acts.
    let named = confirmed
        .as_ref()
        .is_some_and(|(t, m)| m.is_some() || t.hypothesis.is_scale());
    let also: Vec<Hypothesis> = ok
        .iter()
        .skip(1)
        .filter(|(t, _)| !(named && t.hypothesis.is_scale()))
        .map(|(t, _)| t.hypothesis)
        .collect();
    let ruled_out: Vec<Tried> = tried
        .iter()
        .filter(|(t, _)| {
            !ok.iter().any(|(o, _)| o.hypothesis == t.hypothesis)
                && !contradicted.iter().any(|(h, _)| *h == t.hypothesis)
        })
        .map(|(t, _)| t.clone())
        .collect();

    Ok(Decision {
        confirmed,
        also,
        ruled_out,
        contradicted,
        located,
    })
}

/// How many times a hypothesis must cut the own error at the flagged key to be confirmed: a
/// bug explains an error, it does not nudge it (a rounding tie flipped by a tiny change of the
/// arithmetic cuts one key's error too, by chance).
pub const CONFIRM_CUT: f64 = 10.0;
/// The same for a continuous knob (another rms eps or rope theta): any small change of a
/// norm or rotation moves which way a value on a rounding tie falls, so a knob needs the
/// strongest evidence — this cut, and support at `KNOB_PLACES` places of the trace.
pub const KNOB_CUT: f64 = 100.0;
pub const KNOB_PLACES: usize = 2;
/// A hypothesis is contradicted at a key where it makes the own error this many times worse
/// than the model's own setting (and above f32 noise): it predicts a difference the engine
/// does not show.
pub const CONTRADICTS: f64 = 10.0;

/// How many keys a hypothesis contradicts `holds` tries as the engine's own flips before it
/// counts the rest as they stand (each costs a few replays of one key's window).
const MAX_TIE_CHECKS: usize = 16;

fn cut_needed(h: &Hypothesis) -> f64 {
    if h.is_knob() { KNOB_CUT } else { CONFIRM_CUT }
}

/// Whether the hypothesis of `setup` holds over the whole trace: replayed at every step and
/// layer, it must nowhere make an own error `CONTRADICTS` times worse than the model's own
/// setting (`ops`) — a hypothesis that predicts a difference the engine does not show is not
/// its bug (another eps or theta that happens to flip one rounding tie back changes every
/// other norm or rotation too; a wrong theta for a decode position off by one changes the
/// prompt too). Keys before the flagged key's layer are not held against it (a bug may act
/// only from a deep layer on); a knob must also cut the own error at `KNOB_PLACES` distinct
/// (step, layer) places. Ok: how many keys out of their floor it brings within them (the
/// whole-trace evidence that tells apart hypotheses equal at the flagged key: positions
/// modulo 32 and positions restarting at a turn at 32 agree until the next turn). Err: why
/// not, in words.
fn holds(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    setup: &Setup,
    ops: &[OpResult],
    flagged: &TapKey,
    knob: bool,
) -> Result<Result<usize, String>, JudgeError> {
    let n_layer = model.config.n_layer;
    let s_max = cand.steps().into_iter().max().unwrap_or(0);
    let full = Setup {
        window: Window::full(n_layer, s_max),
        ..setup.clone()
    };
    // Layer order of a key: embedding taps before layer 0, output taps after the last.
    let depth = |x: &TapKey| match (x.layer, x.tap) {
        (Some(l), _) => l as isize,
        (None, Tap::Embd | Tap::EmbdScaled) => -1,
        (None, _) => n_layer as isize,
    };
    // A knob is a setting the model applies wherever the op runs (one eps for every norm):
    // it is held in every layer, before the flagged one too. (Another eps that flips the
    // flagged span's rounding ties back changes every earlier norm as well, by far more than
    // an engine reproducing its rounding there shows.)
    let from = if knob { -1 } else { depth(flagged) };
    // Where it predicts a difference the engine does not show, and where it cuts the own error,
    // each key taking the closest of the replays.
    let weigh = |runs: &[Replay]| {
        let mut places: BTreeSet<(usize, isize)> = BTreeSet::new();
        let mut worse: Vec<(TapKey, f64, f64)> = Vec::new();
        let mut explained = 0;
        for o in ops {
            let Some(h) = runs
                .iter()
                .filter_map(|r| r.metrics.get(&o.key))
                .map(|m| m.nmse)
                .reduce(f64::min)
            else {
                continue;
            };
            let p = o.own_nmse;
            if depth(&o.key) >= from && h > CONTRADICTS * p.max(VISIBLE) {
                worse.push((o.key, p, h));
            }
            if p > VISIBLE && h * CONFIRM_CUT <= p {
                places.insert((o.key.step, depth(&o.key)));
            }
            if !o.pass && h <= o.floor {
                explained += 1;
            }
        }
        (worse, places, explained)
    };
    let mut runs = vec![replay(model, cand, &full, &BTreeSet::new())?];
    let (mut worse, mut places, mut explained) = weigh(&runs);
    // Where that fails, under the tie twins of the rounding too, as the own errors it is held
    // against were measured: otherwise an element on a rounding tie reads as a difference the
    // hypothesis predicts and the engine does not show. (More replays only lower each key's
    // error, so trying them only on a failure gives the same answer.)
    if !worse.is_empty() || (knob && places.len() < KNOB_PLACES) {
        for twin in rounding::twin_setups(&full, model) {
            runs.push(replay(model, cand, &twin, &BTreeSet::new())?);
        }
        (worse, places, explained) = weigh(&runs);
    }
    // A key the hypothesis moves only by what the engine's own sums may flip there is no
    // evidence against it: an engine with eps x10 summing in f32 with 8-bit activations
    // matches the reference to 4.6e-15 at a deep decode layer, where the eps barely moves
    // anything, and the replay with eps x10 flips one quantum there (5.7e-7). Each such key's
    // hypothesis replay is nudged as the engine's sums differ (`ambiguity::engine_like`); the
    // first key that stands `CONTRADICTS` times above that too contradicts it.
    // The keys from the first that stands on (past `MAX_TIE_CHECKS` unchecked keys stand).
    let like = super::ambiguity::engine_like_held(floors);
    let mut first = worse.len().min(MAX_TIE_CHECKS);
    for (i, (key, _, h)) in worse.iter().take(MAX_TIE_CHECKS).enumerate() {
        let at = Setup {
            window: Window::for_key(cand, key),
            ..setup.clone()
        };
        let flips =
            super::ambiguity::distance_reaching(model, cand, &at, key, like, h / CONTRADICTS)?;
        if *h > CONTRADICTS * flips {
            first = i;
            break;
        }
    }
    let worse = &worse[first..];
    if let Some((key, p, h)) = worse.first() {
        return Ok(Err(format!(
            "at {key} it moves the own error from {p:.1e} to {h:.1e}{}",
            match worse.len() {
                1 => String::new(),
                n => format!(", and at {} other keys", n - 1),
            }
        )));
    }
    if knob && places.len() < KNOB_PLACES {
        return Ok(Err(format!(
            "a knob needs the strongest evidence: it cuts the own error at {} (step, layer) place{}, {KNOB_PLACES} needed",
            places.len(),
            if places.len() == 1 { "" } else { "s" }
        )));
    }
    Ok(Ok(explained))
}

/// The lowest and highest value of the confirmed knob that reproduce the key alike, where
/// other values of it are listed beside it (None: one value, or not a knob).
fn knob_range(h: &Hypothesis, also: &[Hypothesis]) -> Option<(f32, f32)> {
    let Hypothesis::Knob(knob, v) = *h else {
        return None;
    };
    let vs = also.iter().filter_map(|a| match *a {
        Hypothesis::Knob(k2, v2) if k2 == knob => Some(v2),
        _ => None,
    });
    let (lo, hi) = vs.fold((v, v), |(lo, hi), x| (lo.min(x), hi.max(x)));
    // Within a few percent is the value to the digits an engine writes (a full dump's norm
    // ties 3e-6 with 3.02e-6 through f32's rounding of mean + eps): not a range to report.
    (hi as f64 > RANGE_WIDE * lo as f64).then_some((lo, hi))
}

/// Whether the step's final norm, judged on its own, confirms an eps `v` read from a span:
/// it reproduces `result_norm` `FINAL_NORM_SAYS` times closer than the model's own eps (an
/// engine with one eps for every norm). No: the trace has no final norm on its own there, the
/// final norm does not move with eps (a mean square far above it), or the engine's final norm
/// keeps the model's eps.
fn final_norm_pins(
    model: &Model,
    cand: &Candidate,
    setup: &Setup,
    k: &TapKey,
    v: f32,
) -> Result<bool, JudgeError> {
    let rn = TapKey::new(k.step, None, Tap::ResultNorm);
    if !cand.contains(&rn) || super::span::span(cand, &rn).len() != 1 {
        return Ok(false);
    }
    let at = |knob: Option<(Knob, f32)>| -> Result<f64, JudgeError> {
        let s = Setup {
            window: Window::for_key(cand, &rn),
            knob,
            ..setup.clone()
        };
        let r = replay(model, cand, &s, &BTreeSet::new())?;
        Ok(r.metrics.get(&rn).map_or(f64::INFINITY, |m| m.nmse))
    };
    let (with, without) = (at(Some((Knob::RmsEps, v)))?, at(None)?);
    Ok(with * FINAL_NORM_SAYS + FINAL_NORM_BITS <= without)
}

/// How many times further off the final norm must put a span's eps than the value fitted
/// there for the span's to leave (`AtKey::eps_at_final_norm`), and the NMSE under which a
/// final norm's difference is f32's last bits (a norm's own floor is 1e-11).
const FINAL_NORM_SAYS: f64 = 10.0;
const FINAL_NORM_BITS: f64 = 1e-14;

/// How far apart the ends of a knob's tie must lie to be reported as a range.
const RANGE_WIDE: f64 = 1.1;

/// One sentence on what the confirmed hypothesis means for the engine. `range`: where values
/// of a knob from one end to the other reproduce the key alike (8-bit activations in a sparse
/// span hide eps 3e-6 from 5e-6), the sentence gives the range, not the value picked.
fn explain(
    model: &Model,
    h: &Hypothesis,
    m: Option<Mutation>,
    k: &TapKey,
    range: Option<(f32, f32)>,
) -> String {
    let c = &model.config;
    if let Hypothesis::Knob(knob, v) = *h {
        let fitted = "fitted by experiment over many values";
        // The value, or the range this trace cannot narrow (a factor's words for a scale).
        let val = |f: fn(f32) -> String, factor: bool| match range {
            None => f(v),
            Some((lo, hi)) => format!(
                "{}between {} and {} (each end reproduces it alike: this trace cannot narrow it further)",
                if factor { "a factor " } else { "" },
                f(lo),
                f(hi)
            ),
        };
        let num: fn(f32) -> String = fmt_num;
        let factor: fn(f32) -> String = fmt_factor;
        return match knob {
            Knob::RmsEps => format!(
                "the engine's RMSNorm adds eps {}; the model says {:e} (attention.layer_norm_rms_epsilon; {fitted})",
                val(num, false),
                c.rms_eps
            ),
            Knob::OutputNormEps => format!(
                "the engine's final RMSNorm (output_norm) adds eps {}, its layers' norms the model's {:e} (attention.layer_norm_rms_epsilon, for every norm; {fitted})",
                val(num, false),
                c.rms_eps
            ),
            Knob::RopeTheta => format!(
                "the engine's RoPE frequency base is {}; the model says {} (rope.freq_base; {fitted})",
                val(num, false),
                c.rope_theta
            ),
            Knob::RopeFreqScale => {
                let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 * b.abs();
                let fs = c.rope_freq_scale;
                let model_says = if close(fs, 1.0) {
                    "the model has no RoPE scaling".to_string()
                } else {
                    format!(
                        "the model scales them by {} (linear scaling, rope.scaling.factor {})",
                        fmt_factor(fs),
                        fmt_factor(1.0 / fs)
                    )
                };
                let what = if range.is_some() {
                    String::new()
                } else if close(v, 1.0) {
                    " (no scaling: the engine ignores rope.scaling)".to_string()
                } else if close(v, 1.0 / fs) {
                    " (the factor itself, where its inverse is meant)".to_string()
                } else {
                    String::new()
                };
                format!(
                    "the engine's RoPE scales positions by {}{what}; {model_says} ({fitted})",
                    val(factor, true)
                )
            }
            Knob::AttnScale => {
                let hd = c.head_dim as f32;
                let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 * b.abs();
                let what = if range.is_some() {
                    String::new()
                } else if close(v, 1.0) {
                    " (no scaling at all)".to_string()
                } else if close(v, 1.0 / hd) {
                    format!(
                        " = 1/head_dim ({} where 1/sqrt({}) is meant)",
                        c.head_dim, c.head_dim
                    )
                } else if close(v, 1.0 / hd.sqrt()) {
                    " = 1/sqrt(head_dim)".to_string()
                } else {
                    String::new()
                };
                format!(
                    "the engine scales attention scores by {}{what}; the model says {} ({fitted})",
                    val(num, true),
                    fmt_num(c.kq_scale)
                )
            }
            Knob::AttnSoftcap | Knob::FinalSoftcap => {
                let (what, key, own, other) = if knob == Knob::AttnSoftcap {
                    (
                        "attention scores",
                        "attn_logit_softcapping",
                        c.attn_softcap,
                        c.final_softcap,
                    )
                } else {
                    (
                        "logits",
                        "final_logit_softcapping",
                        c.final_softcap,
                        c.attn_softcap,
                    )
                };
                let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 * b.abs();
                let swapped = if range.is_none() && other.is_some_and(|o| close(v, o)) {
                    " (the other soft-cap's value: the two are swapped)"
                } else {
                    ""
                };
                format!(
                    "the engine soft-caps the {what} at {}{swapped}; the model says {} ({key}; {fitted})",
                    val(factor, false),
                    own.map_or("none".into(), fmt_factor)
                )
            }
            Knob::OutputScale(t, layer) => {
                let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * b.abs();
                let (e, hd) = (c.n_embd as f32, c.head_dim as f32);
                let named = [
                    (e.sqrt(), "sqrt(n_embd)"),
                    (1.0 / e.sqrt(), "1/sqrt(n_embd)"),
                    (hd.sqrt(), "sqrt(head_dim)"),
                    (1.0 / hd.sqrt(), "1/sqrt(head_dim)"),
                    (1.0 / hd, "1/head_dim"),
                ]
                .into_iter()
                .find(|&(x, _)| close(v, x))
                .map_or(String::new(), |(_, n)| format!(" = {n}"));
                let typical = match t {
                    Tap::Logits | Tap::LogitsUncapped => format!(
                        "a sampling temperature applied to the logits before they were dumped (T = {}), or the output weight's scale",
                        fmt_factor(1.0 / v)
                    ),
                    Tap::Embd | Tap::EmbdScaled => {
                        "an embedding scale the architecture does not have (gemma's sqrt(n_embd)), or the embedding's block scale read wrong".into()
                    }
                    _ => "a weight's or a block's scale read wrong, a residual or output multiplier the model does not have".into(),
                };
                let r = fmt_factor(v);
                match layer {
                    None => format!(
                        "the engine's {t} is the right value times {r}{named} wherever it runs: a constant factor the op writing it applies and the model does not — {typical} (fitted in closed form, replayed over the trace)"
                    ),
                    Some(l) => format!(
                        "the engine's {t} of layer {l} is the right value times {r}{named}, in that layer only (the other layers' match): a constant factor one tensor or kernel of that layer applies — {typical} (fitted in closed form, replayed over the trace)"
                    ),
                }
            }
        };
    }
    if let Hypothesis::RopeAt(at) = h {
        // Solved at RoPE's own keys; guessed at a span's (`rope_positions`).
        return at.describe(matches!(k.tap, Tap::QRope | Tap::KRope));
    }
    if let Hypothesis::Layout(l, tap) = *h {
        let l = l.name(tap);
        return format!(
            "the numbers are right, stored {l}: declare it in the trace's manifest.json as \"layouts\": {{\"{}\": \"{l}\"}}, or store it canonical",
            k.tap
        );
    }
    match m {
        Some(Mutation::RopeNeox) => format!(
            "{} (the model pairs {})",
            Mutation::RopeNeox.describe(),
            match c.rope_type {
                RopeType::Norm => "NORM: (2i, 2i+1)",
                RopeType::Neox => "NEOX: (i, i+n_rot/2)",
            }
        ),
        Some(Mutation::RopeTheta) => format!(
            "{} (the engine's base {} is what reproduces it; the model says {})",
            Mutation::RopeTheta.describe(),
            wrong_theta(c.rope_theta),
            c.rope_theta
        ),
        Some(m) => m.describe_width(),
        None => String::new(),
    }
}

/// The comparison heuristics of `compare::diagnose`, run on the reference's recomputation
/// against the candidate at the flagged (step, layer): a fallback when no experiment
/// reproduced the candidate.
fn heuristic(
    model: &Model,
    cand: &Candidate,
    kept: &BTreeMap<TapKey, Vec<f32>>,
    k: &TapKey,
) -> Result<String, JudgeError> {
    // A key's shape as the comparison reads it ([T, n] or [T, heads, d]).
    let shape = |key: &TapKey| {
        cand.dims(key).map(|d| match d {
            [a, 1, c] => vec![a, c],
            d => d.to_vec(),
        })
    };
    let array =
        |v: Vec<f32>, shape: &[usize]| ArrayD::from_shape_vec(IxDyn(shape), v).expect("dims");
    let mut ref_t = BTreeMap::new();
    let mut cand_t = BTreeMap::new();
    for (key, v) in kept {
        if let (Some(c), Some(shape)) = (cand.get(key)?, shape(key)) {
            ref_t.insert(*key, array(v.clone(), &shape));
            cand_t.insert(*key, array(c, &shape));
        }
    }
    if !ref_t.contains_key(k) {
        return Ok("no heuristic applies".into());
    }
    // The window's inputs are the candidate's own (each op is judged on its own inputs): they
    // match by construction, and the heuristics see them so, not as taps the trace lacks.
    for key in crate::compare::op_inputs(*k, model.config.n_layer) {
        if !ref_t.contains_key(&key)
            && let (Some(c), Some(shape)) = (cand.get(&key)?, shape(&key))
        {
            let t = array(c, &shape);
            ref_t.insert(key, t.clone());
            cand_t.insert(key, t);
        }
    }
    let steps: Vec<StepInfo> = cand.trace.manifest.steps.clone();
    let mref = ModelRef {
        path: String::new(),
        sha256: String::new(),
        size: None,
    };
    let prod = |b: &str| Producer {
        name: "parity".into(),
        backend: b.into(),
        version: String::new(),
        settings: serde_json::Value::Null,
    };
    let a = Trace::from_memory(mref.clone(), prod("reference/replay"), steps.clone(), ref_t);
    let b = Trace::from_memory(mref, prod("candidate"), steps, cand_t);
    let opt = CompareOptions {
        pair: PairKind::OpByOp,
        weight_type: model.main_weight_type(),
        require_same_model: false,
    };
    let c = compare(&a, &b, &opt)?;
    // The flagged key's own signature: under another rounding an earlier key (q at ~1e-5) is
    // over the op-by-op threshold too, and its diagnosis would name the wrong op.
    Ok(
        crate::compare::diagnose_at(&c, &a, &b, k)?
            .unwrap_or_else(|| "no heuristic applies".into()),
    )
}

/// `setup` under each other K/V cache parity emulates for this model's heads, for every step;
/// for a key of a decode step (`decode`) also with the prompt's cache kept and each other one
/// read by the decode steps alone (a decode-only bug hides which cache they read: the
/// measurement keeps the prompt's).
fn other_caches(setup: &Setup, model: &Model, decode: bool) -> Vec<Setup> {
    let (hd, ekv) = (model.config.head_dim, model.config.n_embd_kv());
    // The decode steps' cache alone first: it changes the least (the prompt's steps stay as
    // measured), and a tie keeps the first.
    let mut v: Vec<Setup> = Vec::new();
    if decode {
        let now = setup.kv_decode.unwrap_or(setup.kv);
        v.extend(now.alternatives(hd, ekv).into_iter().map(|c| Setup {
            kv_decode: (c != setup.kv).then_some(c),
            ..setup.clone()
        }));
    }
    v.extend(setup.kv.alternatives(hd, ekv).into_iter().map(|kv| Setup {
        kv,
        kv_decode: None,
        ..setup.clone()
    }));
    v
}

/// The earliest key a hypothesis reproduces (`locate`), under every K/V cache parity emulates:
/// the cache was measured with the bug in the window, and where the bug moves attention more
/// than the cache's rounding does, the measurement can pick the wrong one.
fn place(
    model: &Model,
    cand: &Candidate,
    setup: &Setup,
    ops: &[OpResult],
    k: &TapKey,
) -> Result<Option<(TapKey, f64, f64)>, JudgeError> {
    let mut best = locate(model, cand, setup, ops, k)?;
    let first_step = ops.iter().map(|o| o.key.step).min().unwrap_or(0);
    for other in other_caches(setup, model, k.step > first_step) {
        if let Some(y) = locate(model, cand, &other, ops, k)?
            && best.as_ref().is_none_or(|x| y.0 < x.0)
        {
            best = Some(y);
        }
    }
    Ok(best)
}

/// Where a confirmed bug acts from when no earlier key shows it (`locate` found none): the
/// earliest key before `k` whose value the hypothesis changes at all (NMSE over f32 noise
/// between the replays with and without it) where the engine's own error could hide it (a
/// change over the key's floor that the engine does not show rules the key out), with that
/// change and the key's own error. In a
/// sparse dump of an engine whose spans carry more rounding noise than the bug moves them (an
/// eps ×10 beside f16 sums), the bug is first seen later than it acts; this says where.
fn acts_from(
    model: &Model,
    cand: &Candidate,
    setup: &Setup,
    ops: &[OpResult],
    k: &TapKey,
) -> Result<Option<(TapKey, f64, f64)>, JudgeError> {
    let earlier: Vec<&OpResult> = ops
        .iter()
        .filter(|o| o.key < *k && o.key.step <= k.step)
        .collect();
    if earlier.is_empty() {
        return Ok(None);
    }
    let keep: BTreeSet<TapKey> = earlier.iter().map(|o| o.key).collect();
    let window = Window {
        s_max: k.step,
        l0: 0,
        l_end: k.layer.map_or(model.config.n_layer, |l| l + 1),
        end: false,
    };
    let with = replay(
        model,
        cand,
        &Setup {
            window,
            ..setup.clone()
        },
        &keep,
    )?;
    let without = replay(
        model,
        cand,
        &Setup {
            window,
            mutation: None,
            knob: None,
            ..setup.clone()
        },
        &keep,
    )?;
    for o in earlier {
        let (Some(a), Some(b)) = (with.kept.get(&o.key), without.kept.get(&o.key)) else {
            continue;
        };
        let (mut d, mut p) = (0.0f64, 0.0f64);
        for (&x, &y) in a.iter().zip(b) {
            d += (x as f64 - y as f64).powi(2);
            p += (y as f64).powi(2);
        }
        let moved = if p > 0.0 { d / p } else { d };
        // Where the engine would show that change and does not, the bug does not act there
        // (one placed from a deep layer on, under a hypothesis replayed in every layer).
        let shown = moved > o.floor && moved > CONTRADICTS * o.own_nmse.max(VISIBLE);
        if moved > VISIBLE && !shown {
            return Ok(Some((o.key, moved, o.own_nmse)));
        }
    }
    Ok(None)
}

/// Where a confirmed bug first shows: the earliest key (graph order, up to `k`'s step) whose
/// own error, under its floor but clearly above f32 noise, the hypothesis cuts (÷10, or ÷3 above 1e-9). A
/// span through rounded matmuls can hide a small bug in every layer (an rms eps ×10 moves a
/// layer's output by ~1e-5, inside such a span's noise); the hypothesis finds it there anyway.
fn locate(
    model: &Model,
    cand: &Candidate,
    setup: &Setup,
    ops: &[OpResult],
    k: &TapKey,
) -> Result<Option<(TapKey, f64, f64)>, JudgeError> {
    let earlier: Vec<&OpResult> = ops
        .iter()
        .filter(|o| o.key < *k && o.key.step <= k.step && o.own_nmse > VISIBLE)
        .collect();
    if earlier.is_empty() {
        return Ok(None);
    }
    let n_layer = model.config.n_layer;
    let window = Window {
        s_max: k.step,
        l0: 0,
        l_end: k.layer.map_or(n_layer, |l| l + 1),
        end: k.layer.is_none() && !matches!(k.tap, Tap::Embd | Tap::EmbdScaled),
    };
    let r = replay(
        model,
        cand,
        &Setup {
            window,
            ..setup.clone()
        },
        &BTreeSet::new(),
    )?;
    // Tenfold, or threefold where the own error is well above f32 noise (a span through
    // rounded matmuls carries flips the hypothesis cannot remove; where the bug does not act,
    // the hypothesis only adds error).
    let cuts = |with: f64, own: f64| with * 10.0 <= own || (own > 1e-9 && with * 3.0 <= own);
    // The same setup without the hypothesis, replayed where a key is cut: under another cache
    // than the measured one (`place`) the cache alone may reproduce an earlier key (an f16
    // cache's scores where the bug acts only on the values); the bug is placed where it, not
    // the cache, does.
    let mut without: Option<super::replay::Replay> = None;
    for o in earlier {
        let Some(m) = r.metrics.get(&o.key).filter(|m| cuts(m.nmse, o.own_nmse)) else {
            continue;
        };
        if without.is_none() {
            let bare = Setup {
                window,
                mutation: None,
                knob: None,
                rope_at: None,
                ..setup.clone()
            };
            without = Some(replay(model, cand, &bare, &BTreeSet::new())?);
        }
        let plain = without.as_ref().and_then(|w| w.metrics.get(&o.key));
        if plain.is_none_or(|p| cuts(m.nmse, p.nmse)) {
            return Ok(Some((o.key, o.own_nmse, m.nmse)));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_ruled_out_list_is_summarised_by_family() {
        use crate::backend::positions::PosRule;
        let tried = |hypothesis, nmse| Tried { hypothesis, nmse };
        let shift = |by| {
            let r = PosRule::Shift { from: 20, by };
            Hypothesis::RopeAt(RopeAt { q: r, k: r })
        };
        let mut list = vec![tried(Hypothesis::Catalog(Mutation::RopeNeox), 1e-2)];
        list.extend((1..=120).map(|by| tried(shift(by), 0.1 + by as f64 * 1e-3)));
        list.push(tried(shift(-3), 2e-3));
        list.extend([1e-6f32, 1e-8].map(|v| tried(Hypothesis::Knob(Knob::RmsEps, v), 0.5)));
        list.extend(
            [5e3f32, 2e4, 5e4, 1e5, 1e6].map(|v| tried(Hypothesis::Knob(Knob::RopeTheta, v), 0.7)),
        );
        let text = ruled_out_text(&list);
        assert_eq!(
            text,
            "rope-neox (1e-2), \
             rope-at: 121 position rules (NMSE 2e-3 to 2e-1, the closest rope-at:q,k=p-3@20), \
             rms-eps=1e-6 (5e-1), rms-eps=1e-8 (5e-1), \
             rope-theta: 5 values (NMSE 7e-1 to 7e-1, the closest rope-theta=5000)"
        );
        // A short list reads as before: every member by name.
        assert_eq!(
            ruled_out_text(&list[..3]),
            "rope-neox (1e-2), rope-at:q,k=p+1@20 (1e-1), rope-at:q,k=p+2@20 (1e-1)"
        );
    }

    #[test]
    fn a_knob_s_value_is_written_as_a_user_writes_it() {
        assert_eq!(knob_name(Knob::RopeTheta, 15446.748), "rope-theta=15447");
        assert_eq!(knob_name(Knob::RopeTheta, 10000.0), "rope-theta=10000");
        assert_eq!(knob_name(Knob::RmsEps, 1e-4), "rms-eps=1e-4");
        assert_eq!(knob_name(Knob::RmsEps, 3.16e-6), "rms-eps=3.16e-6");
    }

    #[test]
    fn a_factor_is_fitted_as_an_engine_writes_it() {
        let ours: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        // Halved exactly: 0.5, at NMSE 0.
        let half: Vec<f32> = ours.iter().map(|x| x * 0.5).collect();
        assert_eq!(fit_scale(&ours, &half), Some((0.5, 0.0)));
        // Divided by a temperature 0.8 (not the same f32 as times 1.25): written 1.25.
        let temp: Vec<f32> = ours.iter().map(|x| x / 0.8).collect();
        let (c, e) = fit_scale(&ours, &temp).unwrap();
        assert_eq!(c, 1.25);
        assert!(e < 1e-13, "{e}");
        // The same tensor: no factor to name; a zero one: none to fit.
        assert_eq!(fit_scale(&ours, &ours), None);
        assert_eq!(fit_scale(&[0.0; 4], &[1.0; 4]), None);
        // Not a factor at all: the fit is poor, and the caller's cut rules it out.
        let other: Vec<f32> = ours.iter().rev().copied().collect();
        let (_, e) = fit_scale(&ours, &other).unwrap();
        assert!(e > 1e-2, "{e}");
    }

    #[test]
    fn fitted_names_parse_back() {
        for (knob, v, name) in [
            (
                Knob::OutputScale(Tap::FfnOut, None),
                0.5,
                "scale:ffn_out=0.5",
            ),
            (
                Knob::OutputScale(Tap::FfnOut, Some(1)),
                0.5,
                "scale:ffn_out@1=0.5",
            ),
            (
                Knob::OutputScale(Tap::Logits, None),
                1.25,
                "scale:logits=1.25",
            ),
            (Knob::AttnSoftcap, 5.0, "attn-softcap=5"),
            (Knob::FinalSoftcap, 1.5, "final-softcap=1.5"),
            (Knob::RmsEps, 1e-3, "rms-eps=1e-3"),
        ] {
            assert_eq!(knob_name(knob, v), name);
            assert_eq!(Knob::parse(name), Some((knob, v)), "{name}");
            let h = Hypothesis::Knob(knob, v);
            assert_eq!(h.name(), name);
            assert!(h.is_knob(), "{name}");
            assert_eq!(
                h.is_scale(),
                matches!(knob, Knob::OutputScale(..)),
                "{name}"
            );
        }
        // Written by name in the JSON report.
        assert_eq!(
            serde_json::to_string(&Hypothesis::Catalog(Mutation::RopeNeox)).unwrap(),
            "\"rope-neox\""
        );
        assert_eq!(
            Hypothesis::Layout(Layout::SwapOuter, Tap::QRope).name(),
            "layout:head-major"
        );
        assert!(!Hypothesis::Catalog(Mutation::RmsEps10x).is_knob());
        for bad in [
            "scale:nope=0.5",
            "scale:ffn_out@x=0.5",
            "scale:ffn_out=",
            "rope-neox",
        ] {
            assert_eq!(Knob::parse(bad), None, "{bad}");
        }
    }

    /// A knob whose other values reproduce the key alike is reported as the range they span,
    /// not as the value picked (a sparse span under 8-bit activations: eps 1e-13 and 5e-6
    /// alike); values within 10% of it (f32's rounding of mean + eps) stay one value.
    #[test]
    fn a_knob_the_trace_cannot_narrow_is_reported_as_a_range() {
        let model = Model::open(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama-q8_0.gguf"),
        )
        .unwrap();
        let k = TapKey::new(0, Some(1), Tap::LOut);
        let eps = |v| Hypothesis::Knob(Knob::RmsEps, v);
        let theta = |v| Hypothesis::Knob(Knob::RopeTheta, v);
        let other = Hypothesis::Catalog(Mutation::RopeNeox);
        // Wide: the ends, whichever the pick.
        let r = knob_range(&eps(5e-6), &[eps(1e-13), other]);
        assert_eq!(r, Some((1e-13, 5e-6)));
        let text = explain(&model, &eps(5e-6), None, &k, r);
        assert!(
            text.contains("adds eps between 1e-13 and 5e-6 (each end reproduces it alike")
                && !text.contains("adds eps 5e-6"),
            "{text}"
        );
        assert_eq!(
            knob_range(&eps(2e-6), &[eps(5e-6), eps(1e-6)]),
            Some((1e-6, 5e-6))
        );
        // Narrow, another knob, or none: one value.
        assert_eq!(knob_range(&eps(3e-6), &[eps(3.02e-6)]), None);
        assert_eq!(knob_range(&eps(3e-6), &[theta(20000.0), other]), None);
        assert_eq!(knob_range(&other, &[eps(3e-6)]), None);
        let one = explain(&model, &eps(3e-6), None, &k, None);
        assert!(one.contains("adds eps 3e-6; the model says 1e-5"), "{one}");
        // A scale's range is a factor's.
        let scale = Hypothesis::Knob(Knob::AttnScale, 0.2);
        let r = knob_range(&scale, &[Hypothesis::Knob(Knob::AttnScale, 0.1)]);
        let text = explain(&model, &scale, None, &k, r);
        assert!(
            text.contains("scales attention scores by a factor between 1e-1 and 2e-1"),
            "{text}"
        );
    }
}
