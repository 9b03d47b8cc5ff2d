//! The floor of a span no clean replay can tell apart from noise.
//!
//! A span's floor follows the trace's median span noise, but a span through a quantized K/V
//! cache (or 8-bit activations) is noisier than the median says where it reads more cells
//! near a rounding boundary: one K value an ulp away rounds to the neighbouring Q4_0 quantum
//! and moves that step's attention a thousand times more than an ulp. A decode step's one row
//! shows it undiluted; the decode steps' spans, most of which cross no boundary, pull the
//! median down. Where a span stands out of its floor, parity replays its window again with
//! each input the candidate fed it nudged by a few ulps (as an engine summing in another
//! order differs): the distance between those clean replays is what two correct engines may
//! differ by there, and the span is judged against `FACTOR` times it. A bug moves the
//! candidate, never the clean replays: it is found whenever it stands out of that distance.

use super::floor::clean_setup;
use super::replay::{Candidate, JITTER_ULPS, Jitter, KvCache, Nudged, Setup, Window, replay};
use super::rounding::EXACT_FIT;
use super::{Floors, JudgeError, OpResult};
use crate::compare::metrics;
use crate::model::Model;
use ndarray::{ArrayViewD, IxDyn};
use std::collections::BTreeSet;

/// How many times the clean replays' own distance a span may sit at and still be noise (as
/// every floor sits 10× or more above what a correct engine shows).
pub const FACTOR: f64 = 10.0;
/// The jittered replays, each its own pattern of nudges: the distance is the largest.
const SEEDS: [u64; 3] = [0x5eed_0001, 0x5eed_0002, 0x5eed_0003];
/// Spans re-judged at most per judgement (the first that stays out of its floor ends it).
const MAX_SPANS: usize = 8;
/// A span still out of its floor after `SEEDS` but within this factor of the floor it had
/// is replayed under up to `MORE_SEEDS` more patterns, until one clears it (`distance_reaching`):
/// a nudge flips an 8-bit quantum only now and then. One decode row of a clean 32-layer Q8_0
/// engine (ggml's rounding, f32 cache, sparse) sat at 1.06e-5 over its 1e-5 floor where three
/// patterns had flipped nothing.
const NEAR: f64 = 10.0;
const MORE_SEEDS: u64 = 13;

/// How jittered replays nudge, their seeds left to `distance`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Nudge {
    pub rel: f32,
    pub what: Nudged,
}

/// How a span's jittered replays nudge: each input by a few ulps, as
/// engines summing in another order differ at every op. Where no rounding reproduces the
/// engine's matmuls (their median own NMSE over `EXACT_FIT`), every tensor of the span, the
/// reference's own inside it too, by as much as those matmuls differ from the closest rounding
/// (the square root of that NMSE): such an engine's K and V differ from the replay's by that
/// much at every matmul, and a quantized cache turns it into flips of whole quanta (a clean
/// engine that cuts its f16 inputs toward zero, with a Q8_0 cache: a decode step's span 1.5e-5
/// over its 1e-5 floor, its 4-ulp distance under a tenth of that; one with per-token uint8
/// inputs and a Q4_0 cache: 1.87e-3 over the 1.74e-3 its inputs' nudges alone gave).
pub(super) fn nudge(floors: &Floors) -> Nudge {
    let ulps = JITTER_ULPS * f32::EPSILON;
    match floors.mm_median_own {
        Some(own) if own > EXACT_FIT => Nudge {
            rel: ulps.max(own.sqrt() as f32),
            what: Nudged::Every,
        },
        _ => Nudge {
            rel: ulps,
            what: Nudged::Inputs,
        },
    }
}

/// Nudges as large as the engine's own matmuls differ from the measured rounding (the square
/// root of their median own NMSE), at most 4 ulps (what summing in another order moves; more is
/// a rounding the judge does not reproduce, such as a soft-capped output projection's, not the
/// layers' sums), on the matmul outputs inside a span: what this engine's summation order may
/// flip downstream (an 8-bit activation, a quantized cache's quantum) where nothing is wrong. An
/// engine the rounding reproduces bit for bit is nudged by nothing.
pub(super) fn engine_like(floors: &Floors) -> Nudge {
    let ulps = JITTER_ULPS * f32::EPSILON;
    Nudge {
        rel: floors
            .mm_median_own
            .map_or(ulps, |own| ulps.min(own.sqrt() as f32)),
        what: Nudged::Matmuls,
    }
}

/// [`engine_like`] for a hypothesis held against the trace: where the spans through the
/// matmuls do not reproduce bit for bit (their median own NMSE over `EXACT_FIT`), every tensor
/// of the key's window is nudged by the full few ulps. Such an engine differs from the
/// reference at ops its matmuls' fit does not show (norms summed in f32, attention in f64), and
/// an 8-bit quantum one of them flips is no evidence against a bug. Nudged as `engine_like`
/// (its matmul outputs alone, by nothing where they are exact), eps x10 went unnamed on
/// 32-layer Q8_0 engines with Q8_K inputs, sparse: with an f32 cache (4.2e-6 at step 2 layer 6,
/// where the clean replay was 1.2e-9), and summing in f32 with an f16 cache (2.2e-6 at step 2
/// layer 23, 8.6e-12: a flip of attn_norm's output, upstream of every matmul).
pub(super) fn engine_like_held(floors: &Floors) -> Nudge {
    let spans_off = floors.mm_median_span.is_some_and(|s| s > EXACT_FIT);
    match spans_off {
        true => Nudge {
            rel: JITTER_ULPS * f32::EPSILON,
            what: Nudged::Every,
        },
        false => engine_like(floors),
    }
}

/// The NMSE between the clean replay under `base` at `key` and replays of it jittered as
/// `like` (`nudge`), one per seed.
pub(super) fn distance(
    model: &Model,
    cand: &Candidate,
    base: &Setup,
    key: &super::TapKey,
    like: Nudge,
) -> Result<f64, JudgeError> {
    distance_over(model, cand, base, key, like, &SEEDS, f64::INFINITY)
}

/// [`distance`], and where it stays under `enough`, under up to `MORE_SEEDS` more patterns
/// until one reaches it: a rare flip is what this asks about.
pub(super) fn distance_reaching(
    model: &Model,
    cand: &Candidate,
    base: &Setup,
    key: &super::TapKey,
    like: Nudge,
    enough: f64,
) -> Result<f64, JudgeError> {
    let d = distance(model, cand, base, key, like)?;
    if d >= enough {
        return Ok(d);
    }
    let more: Vec<u64> = (1..=MORE_SEEDS).map(|i| SEEDS[2] + i).collect();
    Ok(d.max(distance_over(model, cand, base, key, like, &more, enough)?))
}

/// [`distance`] over `seeds`, stopping at the first that reaches `enough`.
fn distance_over(
    model: &Model,
    cand: &Candidate,
    base: &Setup,
    key: &super::TapKey,
    like: Nudge,
    seeds: &[u64],
    enough: f64,
) -> Result<f64, JudgeError> {
    let keep = BTreeSet::from([*key]);
    let plain = replay(model, cand, base, &keep)?;
    let Some(a) = plain.kept.get(key) else {
        return Ok(0.0);
    };
    let a = ArrayViewD::from_shape(IxDyn(&[a.len()]), a).expect("1-d");
    let mut worst = 0.0f64;
    for &seed in seeds {
        let setup = Setup {
            jitter: Some(Jitter {
                seed,
                rel: like.rel,
                what: like.what,
            }),
            ..base.clone()
        };
        let r = replay(model, cand, &setup, &keep)?;
        if let Some(b) = r.kept.get(key) {
            let b = ArrayViewD::from_shape(IxDyn(&[b.len()]), b).expect("1-d");
            worst = worst.max(metrics(&b, &a).nmse);
        }
        if worst >= enough {
            break;
        }
    }
    Ok(worst)
}

/// Judges again each span out of its floor (in key order, until one stays out) against
/// `FACTOR` times the distance between its clean replays, raising its floor to that where
/// higher. Returns how many spans the distance brought within their floor.
pub(super) fn refloor(
    model: &Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    ops: &mut [OpResult],
) -> Result<usize, JudgeError> {
    let mut cleared = 0;
    let mut tried = 0;
    for o in ops.iter_mut() {
        if o.pass || o.span_ops <= 1 || o.metrics.non_finite_failure() {
            continue;
        }
        if tried == MAX_SPANS {
            break;
        }
        tried += 1;
        let base = clean_setup(floors, kv, Window::for_key(cand, &o.key));
        let like = nudge(floors);
        let d = match o.own_nmse < NEAR * o.floor {
            true => distance_reaching(model, cand, &base, &o.key, like, o.own_nmse / FACTOR)?,
            false => distance(model, cand, &base, &o.key, like)?,
        };
        o.floor = o.floor.max(FACTOR * d);
        if o.own_nmse > o.floor {
            break;
        }
        o.pass = true;
        o.ambiguous = true;
        cleared += 1;
    }
    Ok(cleared)
}
