//! Which activation rounding, and which K/V cache type, reproduce the candidate: measured by
//! replaying a small window under each one parity knows and keeping the one whose matmuls (and
//! attention) sit closest to the candidate's. This decides the arithmetic every other part of
//! the judge holds the candidate to; it decides nothing about bugs.

use super::floor::{Floors, OpClass, class, median, span};
use super::replay::{self, Candidate, KvCache, Setup, Window, replay};
use super::{JudgeError, JudgeOptions};
use crate::backend::Emulation;
use crate::backend::family::{Accum, Quantizer};
use crate::gguf::GgmlType;
use crate::model::Model;
use crate::trace::{Tap, TapKey};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// A rounding whose median matmul own NMSE is this low reproduces the engine (f32 summation
/// noise is ~1e-14; the nearest other rounding sits at ~1e-8 for f16, ~1e-5 for 8-bit).
pub const EXACT_FIT: f64 = 1e-11;

/// The activation roundings parity knows, in order of preference on ties.
/// The engine families behind them: ggml-cpu (llama.cpp's CPU backend, SIMD quantizers),
/// ggml-scalar (ggml's `_ref` quantizers, as ports of them do), q8k (AVX512-VNNI engines),
/// q8_1-gpu (llama.cpp CUDA/Vulkan MMVQ), f16 and bf16 activations (GPU GEMMs), f16-accumulating
/// tiled matmuls (llama.cpp Vulkan), TF32 tensor-core GEMMs, plain f32.
pub const ROUNDINGS: [Emulation; 10] = Emulation::ALL;

/// The roundings a judgement tries: those asked for, else every one parity knows.
pub fn tried(opt: &JudgeOptions) -> Vec<Emulation> {
    match opt.roundings.is_empty() {
        true => ROUNDINGS.to_vec(),
        false => opt.roundings.clone(),
    }
}

pub fn rounding_name(r: Emulation) -> &'static str {
    r.family().about
}

/// A K/V cache fit this close rules out the quantized caches (they move attention by
/// 1e-5..1e-3; f16's own rounding by ~1e-8..1e-7).
pub const QUANT_RULED_OUT: f64 = 1e-7;

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

/// How well a replay reproduced the candidate's matmuls: the median own NMSE over the matmuls
/// judged on their own, else over the spans through a matmul.
pub fn fit(cand: &Candidate, r: &replay::Replay) -> Option<f64> {
    fit_where(cand, r, |_| true)
}

/// Whether a key can tell roundings apart: where at least half of what the candidate holds
/// there is finite. A key the candidate overflowed almost everywhere leaves nothing (or the
/// zeros beside a softmax row's NaN) to compare, and every rounding "fits" it at 0: ggml-cpu,
/// tried first, was taken for a plain-f32 engine whose every row is NaN from layer 0's
/// softmax on. Read from the candidate alone, so every rounding is measured on the same keys
/// (an emulated 8-bit quantizer turns a NaN row finite where plain f32 carries it). One NaN
/// token row of 16 leaves 15 that measure it.
fn says_rounding(m: &crate::compare::metrics::Metrics) -> bool {
    2 * (m.nan_b + m.inf_b) <= m.n
}

/// [`fit`] over the keys `which` accepts.
pub fn fit_where(
    cand: &Candidate,
    r: &replay::Replay,
    which: impl Fn(&TapKey) -> bool,
) -> Option<f64> {
    let (mut own, mut spans) = (Vec::new(), Vec::new());
    for (k, m) in r
        .metrics
        .iter()
        .filter(|(k, m)| which(k) && says_rounding(m))
    {
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
pub fn detection_window(cand: &Candidate, first_step: usize) -> Window {
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

/// Every matmul weight's (type, input row length).
pub fn weight_types(model: &Model) -> Vec<(GgmlType, usize)> {
    let mut v: Vec<(GgmlType, usize)> = Vec::new();
    for l in &model.layers {
        for w in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
            let x = (w.ty, w.rows().0);
            if !v.contains(&x) {
                v.push(x);
            }
        }
    }
    let x = (model.output.ty, model.output.rows().0);
    if !v.contains(&x) {
        v.push(x);
    }
    v
}

/// The tie twins of `r` (`Emulation::tie_twins`) that put this model's matmul inputs on the
/// same grid as `r` (on K-quants q8_1-gpu is no twin of ggml-cpu).
pub fn twins(model: &Model, r: Emulation) -> Vec<Emulation> {
    let tys = weight_types(model);
    // Q8_1's values are Q8_0's (its block sum is not a value).
    let grid = |a: GgmlType| match a {
        GgmlType::Q8_1 => GgmlType::Q8_0,
        a => a,
    };
    r.tie_twins()
        .iter()
        .copied()
        .filter(|t| {
            tys.iter()
                .all(|&(ty, n)| grid(t.act_type(ty, n)) == grid(r.act_type(ty, n)))
        })
        .collect()
}

/// The families that round every matmul input of this model as `r` does but compute GELU the
/// other way (ggml-cpu's f16 table, or in f32): on an F32 model plain f32 and ggml-cpu differ in
/// nothing else. A SiLU model's measurement never sees a GELU, so a hypothesis that brings one
/// in is replayed under these too.
pub fn gelu_twins(model: &Model, r: Emulation) -> Vec<Emulation> {
    let tys = weight_types(model);
    Emulation::ALL
        .into_iter()
        .filter(|t| t.gelu() != r.gelu())
        .filter(|t| {
            tys.iter()
                .all(|&(ty, n)| t.act_type(ty, n) == r.act_type(ty, n))
        })
        .collect()
}

/// `floors` with the layers rounded as `r`. The output projection keeps the rounding measured
/// for it: its own where it was measured apart, else the layers' (measured with them), which a
/// tie twin `r` stands for — the same grid, the ties settled per key by [`refit_ties`] (a
/// sparse dump of ggml's reference quantizers measured as ggml-cpu at its logits: held to
/// ggml-cpu there, the logits of the twin's judgement were out of their floor).
pub fn layers_as(model: &Model, floors: &Floors, r: Emulation) -> Floors {
    let output = match floors.output {
        None if twins(model, floors.rounding).contains(&r) => None,
        o => Some(o.unwrap_or(floors.rounding)),
    };
    floors.rounded(model, r, output)
}

/// `setup` under each tie twin of its rounding ([`twins`]): the same matmul grid, the other
/// tie rule (or GELU in f32); then under the tie twins of its cache's quantizer
/// (`KvCache::tie_twins`: a plain Q8_0 cache rounded as engines other than ggml round it).
pub fn twin_setups(setup: &Setup, model: &Model) -> Vec<Setup> {
    let roundings = twins(model, setup.rounding).into_iter().map(|t| Setup {
        rounding: t,
        ..setup.clone()
    });
    roundings.chain(cache_twin_setups(setup)).collect()
}

/// `setup` under the tie twins of its cache's quantizer only.
pub fn cache_twin_setups(setup: &Setup) -> Vec<Setup> {
    setup
        .kv
        .tie_twins()
        .into_iter()
        .map(|kv| Setup {
            kv,
            ..setup.clone()
        })
        .collect()
}

/// How close to the lowest floor it can have (this factor below it, or above) a key's own
/// error must sit for the tie twins of a given rounding to be replayed at it (`refit_ties`'
/// `near`).
pub const TIE_NEAR: f64 = 2.0;

/// Rounding ties in the clean replay `rep` of the whole trace (`full`) under `rounding`. An
/// element that lands exactly on a tie (or next to one, where the inverse-scale formulas differ
/// by an ulp) may take either neighbour, and which one is no bug. Where a key through a matmul
/// (or a GELU) sits above the tight matmul floor, the tie twins of `rounding` are replayed too
/// and each key keeps the closer error, its twin listed. A twin closer somewhere and farther
/// nowhere is the engine's family, returned in place of `rounding` (of several, the closest
/// over the trace; the first of equals). The GELU is measured the same way: ggml-cpu's f16
/// table beside its quantized matmuls, or GELU in f32 (a GPU's) on the same grid.
///
/// `near`: the rounding is given, not measured, and the twins are replayed only over the
/// smallest windows that recompute these keys (the keys near their floors); it stays the
/// rounding.
#[allow(clippy::too_many_arguments)]
pub fn refit_ties(
    model: &Model,
    cand: &Candidate,
    rep: &mut replay::Replay,
    rounding: Emulation,
    decode: Option<Emulation>,
    output: Option<Emulation>,
    (kv, kv_decode): (KvCache, Option<KvCache>),
    full: Window,
    near: Option<&BTreeSet<TapKey>>,
) -> Result<(Emulation, Vec<(TapKey, Emulation)>), JudgeError> {
    let mut ties: Vec<(TapKey, Emulation)> = Vec::new();
    let gelu = model.config.activation == crate::model::Activation::GeluTanh;
    let above_noise = rep.metrics.iter().any(|(k, m)| {
        near.is_none_or(|n| n.contains(k))
            && m.nmse > super::floor::MM_ABS
            && span(cand, k).iter().any(|x| {
                class(x.tap) == OpClass::Matmul || (gelu && x.tap == crate::trace::Tap::FfnAct)
            })
    });
    if !above_noise {
        return Ok((rounding, ties));
    }
    let base = rep.metrics.clone();
    // Per twin: keys it reproduces closer than the chosen rounding, and farther.
    let mut tally: Vec<(Emulation, usize, usize, f64)> = Vec::new();
    // The windows to replay: the whole trace, or the fewest that recompute the near keys (one
    // per distinct layer range, to the latest step asked of it).
    let windows: Vec<Window> = match near {
        None => vec![full],
        Some(keys) => {
            let mut by_layers: BTreeMap<(usize, usize, bool), usize> = BTreeMap::new();
            for k in keys {
                let w = Window::for_key(cand, k);
                let s = by_layers.entry((w.l0, w.l_end, w.end)).or_default();
                *s = (*s).max(w.s_max);
            }
            by_layers
                .into_iter()
                .map(|((l0, l_end, end), s_max)| Window {
                    s_max,
                    l0,
                    l_end,
                    end,
                })
                .collect()
        }
    };
    for t in twins(model, rounding) {
        let mut metrics = BTreeMap::new();
        for &w in &windows {
            let setup = Setup {
                decode,
                output,
                kv,
                kv_decode,
                ..Setup::clean(t, w)
            };
            metrics.extend(replay(model, cand, &setup, &BTreeSet::new())?.metrics);
        }
        let (mut wins, mut losses) = (0, 0);
        let total: f64 = metrics.values().map(|m| m.nmse).sum();
        for (k, m) in metrics {
            let Some(b) = base.get(&k) else { continue };
            if m.nmse > b.nmse {
                losses += 1;
            }
            if m.nmse < b.nmse && !m.non_finite_failure() {
                wins += 1;
                let own = rep.metrics.get_mut(&k).expect("same keys");
                if m.nmse < own.nmse {
                    *own = m;
                    ties.retain(|(x, _)| *x != k);
                    ties.push((k, t));
                }
            }
        }
        tally.push((t, wins, losses, total));
    }
    let mut rounding = rounding;
    if near.is_none()
        && let Some(&(t, ..)) = tally
            .iter()
            .filter(|x| x.1 > 0 && x.2 == 0)
            .min_by(|a, b| a.3.total_cmp(&b.3))
    {
        rounding = t;
        ties.retain(|(_, x)| *x != t);
    }
    Ok((rounding, ties))
}

/// What `r` does to the inputs of each of these weights: the activation type and the
/// quantizer (SIMD, scalar reference, GPU). Two roundings with one signature are one.
fn signature(r: Emulation, tys: &[(GgmlType, usize)]) -> (Accum, Vec<(GgmlType, Quantizer)>) {
    let inputs = tys
        .iter()
        .map(|&(ty, n)| {
            let act = r.act_type(ty, n);
            let q = match act {
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Quantizer::Simd,
                _ => r.family().quantizer,
            };
            (act, q)
        })
        .collect();
    (r.accum(), inputs)
}

/// Which measured roundings rest on data a bug may have moved (`Measured::unsure`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Unsure {
    pub layers: bool,
    pub output: bool,
}

/// What the measurement chose, and how well each candidate rounding and cache type fitted.
pub struct Measured {
    pub rounding: Emulation,
    /// The decode steps' rounding where it differs from the prefill's (`rounding`).
    pub decode: Option<Emulation>,
    /// How each rounding fitted the first decode step (empty: not measured).
    pub decode_fits: Vec<RoundingFit>,
    /// The output projection's rounding where it differs from its step's, and how each
    /// rounding fitted the first step's logits (empty: not measured).
    pub output: Option<Emulation>,
    pub output_fits: Vec<RoundingFit>,
    /// The roundings a bug may have hidden: the layers' (a sparse dump's rounding measured at
    /// its output projection, reproduced there to f32 noise, while no rounding reproduced the
    /// layers so) and the output projection's (the layers reproduced to f32 noise, the
    /// logits by none). A diagnosis that confirms nothing tries the others there.
    pub unsure: Unsure,
    pub fits: Vec<RoundingFit>,
    /// The chosen rounding's replay, and whether it covered the whole trace.
    pub best: Option<(Emulation, f64, replay::Replay, bool)>,
    pub kv: KvCache,
    pub kv_fits: Vec<KvFit>,
    /// The cache the decode steps read where it differs from the prompt's, and how each
    /// cache fitted the first decode step's attention (empty: not measured).
    pub kv_decode: Option<KvCache>,
    pub kv_decode_fits: Vec<KvFit>,
}

/// The rounding a measurement keeps: `first` (measured already: the one the trace's other
/// ops measured, or the step's) unless another of `others` fits clearly better (4x), so a bug
/// is not taken for a rounding; the search ends at a fit to f32 noise, or where `fit` finds
/// nothing to measure (`None`). Every fit is returned, `first`'s first.
fn clearly_better(
    first: (Emulation, f64),
    others: impl IntoIterator<Item = Emulation>,
    mut fit: impl FnMut(Emulation) -> Result<Option<f64>, JudgeError>,
) -> Result<(Vec<RoundingFit>, Emulation), JudgeError> {
    let mut fits = vec![RoundingFit {
        rounding: first.0,
        median_nmse: first.1,
    }];
    let mut best = first;
    if first.1 <= EXACT_FIT {
        return Ok((fits, best.0));
    }
    for r in others {
        let Some(f) = fit(r)? else {
            break;
        };
        fits.push(RoundingFit {
            rounding: r,
            median_nmse: f,
        });
        if f * 4.0 < best.1 {
            best = (r, f);
        }
        if f <= EXACT_FIT {
            break;
        }
    }
    Ok((fits, best.0))
}

/// The caches a measurement blind to the cache tries in turn: those parity would try (f32 first
/// by default; f32 where none is given), stored plainly (llama.cpp's arithmetic around a cache
/// moves a span less than the roundings differ), without `but`.
pub fn plain_caches(opt: &JudgeOptions, but: Option<KvCache>) -> Vec<KvCache> {
    let mut v: Vec<KvCache> = Vec::new();
    let given = opt.kv_caches.iter().map(|c| KvCache::plain(c.k));
    let all: Vec<KvCache> = match opt.kv_caches.is_empty() {
        true => vec![KvCache::F32],
        false => given.collect(),
    };
    for c in all {
        if Some(c) != but && !v.contains(&c) {
            v.push(c);
        }
    }
    v
}

/// The roundings `measure` tries, in order: ggml-cpu first (what most engines that match
/// llama.cpp do); a rounding that rounds this model's weights exactly as an earlier one does
/// is the same arithmetic and is left out (on an F32 model every 8-bit family is plain f32,
/// reported as plain).
fn to_try(model: &Model, opt: &JudgeOptions) -> Vec<Emulation> {
    let mut roundings = tried(opt);
    if roundings.len() <= 1 {
        return roundings;
    }
    let tys = weight_types(model);
    if roundings.contains(&Emulation::GgmlCpu) {
        roundings.retain(|&r| r != Emulation::GgmlCpu);
        roundings.insert(0, Emulation::GgmlCpu);
    }
    let mut seen = Vec::new();
    if roundings.contains(&Emulation::None) {
        seen.push(signature(Emulation::None, &tys));
    }
    roundings.retain(|&r| {
        if r == Emulation::None {
            return true;
        }
        let sig = signature(r, &tys);
        let new = !seen.contains(&sig);
        seen.push(sig);
        new
    });
    roundings
}

/// Each of `roundings` (more than one) replayed over the `detect` window (the whole trace
/// where nothing passes a matmul there) until one reproduces the matmuls to f32 noise: the
/// fits, and the best one as (rounding, fit, its replay, whether that covered the trace).
#[allow(clippy::type_complexity)]
fn detect_rounding(
    model: &Model,
    cand: &Candidate,
    roundings: &[Emulation],
    detect: Window,
    none: &BTreeSet<TapKey>,
) -> Result<
    (
        Vec<RoundingFit>,
        Option<(Emulation, f64, replay::Replay, bool)>,
    ),
    JudgeError,
> {
    let n_layer = model.config.n_layer;
    let s_max = cand.steps().iter().copied().max().unwrap_or(0);
    let mut fits = Vec::new();
    let mut best: Option<(Emulation, f64, replay::Replay, bool)> = None;
    if roundings.len() <= 1 {
        return Ok((fits, best));
    }
    for &r in roundings {
        let setup = Setup::clean(r, detect).measuring();
        let rep = replay(model, cand, &setup, none)?;
        let (f, rep, whole) = match fit(cand, &rep) {
            Some(f) => {
                let whole = detect == Window::full(n_layer, s_max) && !rep.cut;
                (f, rep, whole)
            }
            None => {
                // Nothing through a matmul in the window: measure on the whole trace.
                let full = Setup {
                    window: Window::full(n_layer, s_max),
                    ..setup
                };
                let rep = replay(model, cand, &full, none)?;
                let whole = !rep.cut;
                (fit(cand, &rep).unwrap_or(0.0), rep, whole)
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
    Ok((fits, best))
}

/// Measure the rounding (in `detection_window`) and then the K/V cache type (in the first
/// step's first two layers) that reproduce the candidate.
pub fn measure(
    model: &Model,
    cand: &Candidate,
    opt: &JudgeOptions,
    first_step: usize,
    none: &BTreeSet<TapKey>,
) -> Result<Measured, JudgeError> {
    let n_layer = model.config.n_layer;
    // The rounding: the one that reproduces the candidate's matmuls best, measured in a small
    // window (`detection_window`).
    let roundings = to_try(model, opt);
    let detect = detection_window(cand, first_step);
    let (mut fits, mut best) = detect_rounding(model, cand, &roundings, detect, none)?;
    let mut rounding = best.as_ref().map_or(roundings[0], |b| b.0);

    // A sparse dump's only matmul on its own is the output projection, where the rounding
    // above was measured; an engine whose lm_head rounds otherwise than its layers is told by
    // the first step's first two layers (spans through their matmuls). The output's rounding
    // first; another only where it reproduces the layers clearly better (4x).
    let layer_keys = |k: &TapKey| k.step == first_step && k.layer.is_some();
    let no_layers = detect.l0 >= detect.l_end;
    // Every rounding leaves the window's matmuls further off than a rounding can move a span:
    // a bug in every layer moved them, the pick among the roundings is a tie, and a diagnosis
    // that confirms nothing tries the others.
    // So too where the window had nothing finite enough to measure and the whole trace's
    // spans were (a sparse dump whose logits are NaN: 16-layer no-ffn-norm overflows at layer
    // 6, and the bug-dominated spans' lowest picked bf16 for a ggml-cpu engine).
    let fell_back = no_layers && best.as_ref().is_some_and(|b| b.3);
    let mut unsure = Unsure {
        layers: (!no_layers || fell_back)
            && !fits.is_empty()
            && fits.iter().all(|f| f.median_nmse > super::floor::SPAN_CAP),
        ..Unsure::default()
    };
    // Nor does the lowest of such fits say anything: the first tried (ggml-cpu where it rounds
    // this model's weights) stands until a diagnosis says otherwise.
    if unsure.layers && rounding != roundings[0] {
        rounding = roundings[0];
        best = None;
    }
    // The output's rounding and fits, where the layers' replaced them.
    let mut switched: Option<(Emulation, Vec<RoundingFit>)> = None;
    // Whether some rounding reproduced the layers' matmuls to f32 noise.
    let mut layers_exact = !no_layers && exact(&fits);
    // Measured only where the output's rounding leaves the layers within what a rounding can
    // move a layer (`SPAN_CAP`): beyond it a bug moved them, and no rounding is told there.
    let window = Window {
        s_max: first_step,
        l0: 0,
        l_end: n_layer.min(2),
        end: false,
    };
    // The layers' spans run through attention, which reads the cache: on a long prompt the
    // cache's own rounding moves them by as much as the roundings differ (a 308-token prompt:
    // q8k layers 2.3e-5 under an f32 cache, 7.5e-8 under f16; plain f32 7.3e-5 under both; a
    // Q8_0 or Q4_0 cache moves them more). They are measured under an f32 cache (or the one the
    // trace declares), and where that tells no rounding (none exact, none 4x ahead), under each
    // other cache parity would try, stored plainly (llama.cpp's arithmetic around it moves a
    // span less than the roundings differ), until one does.
    let layer_caches: Vec<KvCache> = match opt.kv_caches.as_slice() {
        [one] => vec![*one],
        _ => std::iter::once(KvCache::F32)
            .chain(plain_caches(opt, Some(KvCache::F32)))
            .collect(),
    };
    let run_layers = roundings.len() > 1 && no_layers && cand.trace.keys().any(layer_keys);
    // The output told no rounding either (`fell_back`): the layers stay unsure unless they
    // tell one exactly, and a confirmed bug measures them again with it in place.
    let nothing_told = unsure.layers;
    for (pass, &kv) in layer_caches
        .iter()
        .enumerate()
        .take(if run_layers { usize::MAX } else { 0 })
    {
        let setup = |r: Emulation| {
            Setup {
                kv,
                ..Setup::clean(r, window)
            }
            .measuring()
        };
        let Some(base) = fit_where(
            cand,
            &replay(model, cand, &setup(rounding), none)?,
            layer_keys,
        ) else {
            break;
        };
        if pass == 0 || base <= EXACT_FIT {
            layers_exact = base <= EXACT_FIT;
            unsure.layers = (exact(&fits) || nothing_told) && !layers_exact;
        }
        if base <= EXACT_FIT {
            break;
        }
        // Beyond `SPAN_CAP` a bug moved the layers, and no rounding is told there — or the
        // cache is not the engine's: a Q4_0 cache moves a 96-token prompt's layer-0 span by
        // 4.5e-3 against an f32 one, and under it the rounding is told (Q8_K layers, exact).
        if base > super::floor::SPAN_CAP {
            continue;
        }
        let others = roundings.iter().copied().filter(|&r| r != rounding);
        let (layer_fits, told_r) = clearly_better((rounding, base), others, |r| {
            Ok(fit_where(
                cand,
                &replay(model, cand, &setup(r), none)?,
                layer_keys,
            ))
        })?;
        let told = exact(&layer_fits) || told_r != rounding;
        if pass == 0 || told {
            layers_exact = exact(&layer_fits);
            unsure.layers = (exact(&fits) || nothing_told) && !layers_exact;
        }
        if told_r != rounding {
            // The layers' rounding is the engine's; the output projection's is the one the
            // detection measured there.
            switched = Some((rounding, std::mem::replace(&mut fits, layer_fits)));
            rounding = told_r;
            best = None;
        }
        if told {
            break;
        }
    }

    let (output, output_fits, unsure_output) = measure_output(
        model,
        cand,
        none,
        first_step,
        &roundings,
        rounding,
        (no_layers, layers_exact),
        switched,
        &fits,
    )?;
    unsure.output = unsure_output;
    let (decode, decode_fits) = measure_decode(
        model,
        cand,
        (first_step, detect, no_layers),
        &roundings,
        rounding,
        output,
    )?;
    // The detection replay ran the decode steps under the prefill's rounding, and the output
    // projection under its step's.
    let best =
        best.map(|(r, f, rep, whole)| (r, f, rep, whole && decode.is_none() && output.is_none()));

    let (kv, kv_fits) = measure_cache(
        model,
        cand,
        opt,
        none,
        first_step,
        (rounding, decode, output),
    )?;
    Ok(Measured {
        rounding,
        decode,
        decode_fits,
        output,
        output_fits,
        unsure,
        fits,
        best,
        kv,
        kv_fits,
        kv_decode: None,
        kv_decode_fits: Vec::new(),
    })
}

/// Whether some rounding reproduced what was measured to f32 noise.
fn exact(fits: &[RoundingFit]) -> bool {
    fits.iter().any(|f| f.median_nmse <= EXACT_FIT)
}

/// The output projection's rounding, measured on its own where the trace has it on its own
/// (result_norm and logits at the first step), under the step's `rounding`; with how each
/// rounding fitted there, and whether none reproduced it exactly where the layers' did.
/// `switched`: the output's rounding and fits where the layers' replaced them.
#[allow(clippy::too_many_arguments)]
fn measure_output(
    model: &Model,
    cand: &Candidate,
    none: &BTreeSet<TapKey>,
    first_step: usize,
    roundings: &[Emulation],
    rounding: Emulation,
    (no_layers, layers_exact): (bool, bool),
    switched: Option<(Emulation, Vec<RoundingFit>)>,
    fits: &[RoundingFit],
) -> Result<(Option<Emulation>, Vec<RoundingFit>, bool), JudgeError> {
    // The output projection's rounding, measured on its own where the trace has it on its
    // own (result_norm and logits at the first step): an engine may run its lm_head through
    // another kernel than its layers (a Rust engine's layers on Q8_K inputs, its output
    // projection not). The step's rounding first; another only where it fits clearly better
    // (4x), so a bug in the projection is not taken for a rounding.
    let mut output = None;
    let mut output_fits = Vec::new();
    let mut unsure_output = false;
    let lm = TapKey::new(first_step, None, Tap::Logits);
    if no_layers {
        // The detection measured the output projection alone: its rounding is measured.
        if let Some((o, mut f)) = switched {
            // The layers' rounding at the output projection too, unless the output's fits it
            // 4x better (ggml-scalar's layers, where a tie lands, and an output where none
            // does: one arithmetic there).
            let setup = Setup::clean(rounding, Window::for_key(cand, &lm)).measuring();
            let at_lm = replay(model, cand, &setup, none)?
                .metrics
                .get(&lm)
                .filter(|m| says_rounding(m))
                .map(|m| m.nmse);
            let o_fit = f.iter().find(|x| x.rounding == o).map(|x| x.median_nmse);
            if let (Some(a), Some(b)) = (at_lm, o_fit) {
                if !f.iter().any(|x| x.rounding == rounding) {
                    f.push(RoundingFit {
                        rounding,
                        median_nmse: a,
                    });
                }
                if b * 4.0 < a {
                    (output, output_fits) = (Some(o), f);
                }
            }
        }
        let measured = if output.is_some() { &output_fits } else { fits };
        unsure_output = !exact(measured) && layers_exact;
    } else if roundings.len() > 1 && cand.contains(&lm) && span(cand, &lm).len() == 1 {
        let window = Window::for_key(cand, &lm);
        // The first step's logits: the prefill's rounding, the output projection's varied.
        let at_lm = |r: Emulation| -> Result<Option<f64>, JudgeError> {
            let setup = Setup {
                output: Some(r),
                ..Setup::clean(rounding, window)
            }
            .measuring();
            Ok(replay(model, cand, &setup, none)?
                .metrics
                .get(&lm)
                .filter(|m| says_rounding(m))
                .map(|m| m.nmse))
        };
        if let Some(f) = at_lm(rounding)? {
            let others = roundings.iter().copied().filter(|&r| r != rounding);
            let (fits_o, o) = clearly_better((rounding, f), others, at_lm)?;
            output_fits = fits_o;
            output = (o != rounding).then_some(o);
        }
        unsure_output = !exact(&output_fits) && layers_exact;
    }
    Ok((output, output_fits, unsure_output))
}

/// The decode steps' rounding where it differs from the prefill's `rounding`, and how each
/// rounding fitted the first decode step (empty: not measured).
fn measure_decode(
    model: &Model,
    cand: &Candidate,
    (first_step, detect, no_layers): (usize, Window, bool),
    roundings: &[Emulation],
    rounding: Emulation,
    output: Option<Emulation>,
) -> Result<(Option<Emulation>, Vec<RoundingFit>), JudgeError> {
    let n_layer = model.config.n_layer;
    // The decode steps' rounding, measured on their own (GPU engines may tile the prefill
    // and not the decode): the first decode step in the detection window's layers, the prefill
    // under `rounding`; each step's keys depend only on that step's rounding. The prefill's
    // rounding first; another only where it fits clearly better (4x).
    let mut decode = None;
    let mut decode_fits = Vec::new();
    let d1 = cand.steps().into_iter().filter(|&s| s > first_step).min();
    if let (Some(d1), true) = (d1, roundings.len() > 1) {
        // In the layers where the rounding was measured there (a sparse dump's output
        // projection has its own, measured above).
        let window = match no_layers && cand.trace.keys().any(|k| k.step == d1 && k.layer.is_some())
        {
            true => Window {
                s_max: d1,
                l0: 0,
                l_end: n_layer.min(2),
                end: false,
            },
            false => Window {
                s_max: d1,
                ..detect
            },
        };
        // The steps before d1 replayed once, d1 under each rounding from the state they left
        // (a long prompt is not replayed once per rounding). `None`: no matmul of the decode
        // step in the window.
        let setup = Setup {
            output,
            ..Setup::clean(rounding, window)
        };
        let under = replay::replay_last_step_under(model, cand, &setup, roundings)?;
        let d1_fits: Vec<(Emulation, Option<f64>)> = roundings
            .iter()
            .zip(&under)
            .map(|(&r, rep)| (r, fit_where(cand, rep, |k| k.step == d1)))
            .collect();
        let at_d1 = |r: Emulation| -> Result<Option<f64>, JudgeError> {
            Ok(d1_fits.iter().find(|x| x.0 == r).and_then(|x| x.1))
        };
        if let Some(f) = at_d1(rounding)? {
            let others = roundings.iter().copied().filter(|&r| r != rounding);
            let (fits_d, d) = clearly_better((rounding, f), others, at_d1)?;
            decode_fits = fits_d;
            decode = (d != rounding).then_some(d);
        }
    }
    Ok((decode, decode_fits))
}

/// The K/V cache type among `opt.kv_caches` (the first unless another reproduces the
/// attention clearly better), and how each fitted.
fn measure_cache(
    model: &Model,
    cand: &Candidate,
    opt: &JudgeOptions,
    none: &BTreeSet<TapKey>,
    first_step: usize,
    (rounding, decode, output): (Emulation, Option<Emulation>, Option<Emulation>),
) -> Result<(KvCache, Vec<KvFit>), JudgeError> {
    let n_layer = model.config.n_layer;
    // The K/V cache type: the one whose replay reproduces the candidate's attention best, in
    // the first step's first two layers (every prompt row reads the cache, its own K/V too).
    // An f16 cache (llama.cpp's default) moves attention by ~1e-8..1e-7 and a whole-layer
    // span by as much, a quantized one by 1e-5..1e-3: reproduced, the own errors drop back to
    // f32 noise, and a small bug under the floors stays visible to the below-floor
    // experiments.
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
            // A quantized cache moves attention by 1e-5..1e-3: a cache tried before it that
            // fits to f16's level (llama.cpp's defaults: ~1e-7) rules it out.
            let best_so_far = kv_fits
                .iter()
                .map(|f: &KvFit| f.median_nmse)
                .fold(f64::INFINITY, f64::min);
            if (c.k.quantized() || c.v.quantized()) && best_so_far <= QUANT_RULED_OUT {
                break;
            }
            let setup = Setup {
                decode,
                output,
                kv: c,
                ..Setup::clean(rounding, window)
            }
            .measuring();
            let rep = replay(model, cand, &setup, none)?;
            let through_attention: Vec<f64> = rep
                .metrics
                .iter()
                .filter(|(k, m)| {
                    says_rounding(m)
                        && span(cand, k)
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
    Ok((kv, kv_fits))
}

/// A decode step's attention that the prompt's cache reproduces this closely leaves no cache
/// to tell apart (f16 against f32 moves it by ~1e-8..1e-7, a quantized cache by 1e-5 and up;
/// a sparse dump's spans carry 1e-11..1e-9 of f32 noise): no other cache is tried for the
/// decode steps.
pub const KV_DECODE_NOISE: f64 = 1e-9;
/// Another cache for the decode steps must reproduce their attention at least this closely,
/// and `KV_DECODE_CUT` times closer than the prompt's: a decode-only bug, which no cache
/// reproduces (1e-4 and up), leaves the prompt's cache in place. Not f32 noise: in a sparse
/// dump the reference computes K itself from the layer's input, and an f32 ulp there can
/// send a quantized cache's value to the other neighbour (measured: Q8_0 read at decode after
/// an f16 prompt, plain f32, 1.4e-8 against the f16 cache's 1.6e-5).
pub const KV_DECODE_CAP: f64 = 1e-6;
const KV_DECODE_CUT: f64 = 10.0;

/// The median own NMSE through attention of step `d1`'s keys in the first two layers of
/// `rep` (None: none there).
pub fn decode_attention_fit(
    model: &Model,
    cand: &Candidate,
    rep: &replay::Replay,
    d1: usize,
) -> Option<f64> {
    let l_end = model.config.n_layer.min(2);
    let v: Vec<f64> = rep
        .metrics
        .iter()
        .filter(|(k, m)| {
            k.step == d1
                && says_rounding(m)
                && k.layer.is_none_or(|l| l < l_end)
                && span(cand, k)
                    .iter()
                    .any(|x| class(x.tap) == OpClass::Attention)
        })
        .map(|(_, m)| m.nmse)
        .collect();
    median(v)
}

/// The cache as the decode steps read it, where it differs from the prompt's `kv`: an engine
/// may attend over its prompt's fresh f32 rows and read a quantized cache when it decodes, or
/// round the cache in one kernel and not in the other. Called where `kv` leaves the first
/// decode step `d1`'s attention above noise (`KV_DECODE_NOISE`; its fit there `under_kv`):
/// each other cache tried for the decode steps in the first two layers (the prompt replayed
/// under `kv`); the closest is kept where it reproduces that attention `KV_DECODE_CUT` times
/// closer than `kv`, and to `KV_DECODE_CAP`.
pub fn decode_cache(
    model: &Model,
    cand: &Candidate,
    opt: &JudgeOptions,
    (rounding, decode, output): (Emulation, Option<Emulation>, Option<Emulation>),
    (kv, under_kv): (KvCache, f64),
    d1: usize,
) -> Result<(Option<KvCache>, Vec<KvFit>), JudgeError> {
    let n_layer = model.config.n_layer;
    let window = Window {
        s_max: d1,
        l0: 0,
        l_end: n_layer.min(2),
        end: n_layer <= 2,
    };
    let mut fits = vec![KvFit {
        kv,
        median_nmse: under_kv,
    }];
    for c in opt.kv_caches.iter().copied().filter(|&c| c != kv) {
        let setup = Setup {
            decode,
            output,
            kv,
            kv_decode: Some(c),
            ..Setup::clean(rounding, window)
        };
        let rep = replay(model, cand, &setup, &BTreeSet::new())?;
        let Some(m) = decode_attention_fit(model, cand, &rep, d1) else {
            break;
        };
        fits.push(KvFit {
            kv: c,
            median_nmse: m,
        });
    }
    let best = fits[1..]
        .iter()
        .filter(|f| f.median_nmse * KV_DECODE_CUT < under_kv && f.median_nmse <= KV_DECODE_CAP)
        .min_by(|a, b| a.median_nmse.total_cmp(&b.median_nmse))
        .map(|f| f.kv);
    Ok((best, fits))
}
