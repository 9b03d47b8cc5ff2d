//! NaN and Inf in a candidate. No tap of a transformer holds one, so the first key holding
//! one is the finding; the judge describes where the non-finite values sit (whole softmax rows,
//! whole token rows, scattered values) from the trace itself, and names the cause by
//! experiment: a known bug whose replay puts non-finite values at exactly the candidate's places
//! and reproduces the finite rest within the key's floor (a fully masked softmax row is NaN in
//! every entry: `exp(-inf - (-inf))`). No rounding or knob is fitted on such data.

use super::floor::clean_setup;
use super::floor::{Floors, class};
use super::hypothesis::relevant;
use super::replay::{Candidate, KvCache, Setup, Window, replay};
use super::span::span;
use super::{Finding, JudgeError, OpResult};
use crate::backend::Emulation;
use crate::backend::mutation::Mutation;
use crate::trace::{Tap, TapKey};
use std::collections::BTreeSet;

/// Where non-finite values first appear (graph order) and how many.
#[derive(Clone, Copy, Debug)]
pub struct NonFinite {
    pub key: TapKey,
    pub nan: usize,
    pub inf: usize,
    /// Values in the tensor.
    pub n: usize,
    pub whose: &'static str,
}

/// The first key of the candidate (graph order) holding a NaN or an Inf.
pub fn first(cand: &Candidate) -> Result<Option<NonFinite>, JudgeError> {
    Ok(cand
        .first_non_finite()?
        .map(|(key, nan, inf, n)| NonFinite {
            key,
            nan,
            inf,
            n,
            whose: "the candidate",
        }))
}

/// The finding `b` is at its op `o` (own error and floor as measured on the finite rest),
/// with `text` after the counts.
fn base_finding(b: &NonFinite, o: &OpResult, text: &str) -> Finding {
    let counts: Vec<String> = [(b.nan, "NaN"), (b.inf, "±Inf")]
        .iter()
        .filter(|(c, _)| *c > 0)
        .map(|(c, w)| format!("{c} {w}"))
        .collect();
    Finding {
        position: None,
        zoom: None,
        key: b.key,
        flagged: b.key,
        own_nmse: o.own_nmse,
        floor: o.floor,
        span_ops: o.span_ops,
        confirmed: None,
        hypothesis: None,
        confirmed_nmse: None,
        catalog: None,
        also: Vec::new(),
        ruled_out: Vec::new(),
        fallback: false,
        explained: false,
        contradicted: Vec::new(),
        text: format!(
            "{} first appears at {} ({} in {}, of {} values){text}",
            if b.nan > 0 { "NaN" } else { "Inf" },
            b.key,
            counts.join(", "),
            b.whose,
            b.n
        ),
    }
}

/// The finding when the reference's own recomputation (from the candidate's finite inputs) is
/// what holds the non-finite values: nothing to experiment on.
pub fn recomputed(b: &NonFinite, o: &OpResult) -> Finding {
    base_finding(
        b,
        o,
        ": a non-finite value is a finding of its own (an overflow, a division by zero, a fully masked softmax row); no experiment runs on it",
    )
}

/// The finding of the candidate's first non-finite key `b` (op `o`): where the values sit, and
/// (`run`) the known bugs that reproduce them, replayed on the key's window (under the
/// measured rounding, and where the places match under each of `roundings` too).
#[allow(clippy::too_many_arguments)]
pub fn candidate(
    model: &crate::model::Model,
    cand: &Candidate,
    floors: &Floors,
    kv: KvCache,
    b: &NonFinite,
    o: &OpResult,
    run: bool,
    roundings: &[Emulation],
) -> Result<Finding, JudgeError> {
    let k = b.key;
    let Some(want) = cand.get(&k)? else {
        return Ok(recomputed(b, o));
    };
    let (shape, whole_softmax_rows) = pattern(cand, &k, &want);
    if !run {
        return Ok(base_finding(
            b,
            o,
            &format!(
                "{shape}: a non-finite value is a finding of its own ({}); no experiment runs on it (--no-experiments)",
                hint(whole_softmax_rows)
            ),
        ));
    }
    let classes: BTreeSet<_> = span(cand, &k).iter().map(|x| class(x.tap)).collect();
    let base = clean_setup(floors, kv, Window::for_key(cand, &k));
    let keep = BTreeSet::from([k]);
    let mut tried = 0;
    let mut matched: Vec<(Mutation, f64)> = Vec::new();
    for &m in Mutation::ALL {
        if !relevant(m, model, &k, &classes) {
            continue;
        }
        tried += 1;
        let setup = Setup {
            mutation: Some(m),
            ..base.clone()
        };
        // The rounding measured on data holding NaN may not be the engine's, and an emulated
        // 8-bit quantizer turns a NaN input into a finite value (a float-to-int cast), so
        // the places are looked for under the measured rounding, else in plain f32 (which
        // carries a NaN on as engines' float paths do); a bug that puts the non-finite values
        // at the candidate's places keeps the closest finite rest over every rounding.
        let under = |rounding, kv| Setup {
            rounding,
            decode: (rounding == floors.rounding)
                .then_some(floors.decode)
                .flatten(),
            output: (rounding == floors.rounding)
                .then_some(floors.output)
                .flatten(),
            kv,
            ..setup.clone()
        };
        let places = |rounding, kv| -> Result<Option<f64>, JudgeError> {
            let r = replay(model, cand, &under(rounding, kv), &keep)?;
            Ok(r.kept.get(&k).and_then(|x| same_places(x, &want)))
        };
        let mut e = match places(floors.rounding, kv)? {
            Some(e) => e,
            None if floors.rounding != Emulation::None => match places(Emulation::None, kv)? {
                Some(e) => e,
                None => continue,
            },
            None => continue,
        };
        // The K/V cache, measured on the same data (where the NaNs outweigh any cache's
        // rounding), is tried every way parity emulates too.
        let mut caches = vec![kv];
        caches.extend(kv.alternatives(model.config.head_dim, model.config.n_embd_kv()));
        for (rounding, kv) in caches
            .iter()
            .flat_map(|&c| roundings.iter().map(move |&r| (r, c)))
            .filter(|&(r, c)| (r, c) != (floors.rounding, kv))
        {
            if e <= o.floor * 1e-3 {
                break;
            }
            if let Some(e2) = places(rounding, kv)? {
                e = e.min(e2);
            }
        }
        if e <= o.floor {
            matched.push((m, e));
        }
    }
    matched.sort_by(|a, b| a.1.total_cmp(&b.1));
    let Some(&(m, e)) = matched.first() else {
        return Ok(base_finding(
            b,
            o,
            &format!(
                "{shape}: a non-finite value is a finding of its own ({}); no known bug reproduces it ({tried} replayed at this key)",
                hint(whole_softmax_rows)
            ),
        ));
    };
    let mut f = base_finding(
        b,
        o,
        &format!(
            "{shape}; confirmed by experiment: {} reproduces it (the same non-finite values at the same places, the finite rest at NMSE {e:.1e}) — {}",
            m.name(),
            m.describe()
        ),
    );
    f.confirmed = Some(m.name().to_string());
    f.hypothesis = Some(super::Hypothesis::Catalog(m));
    f.confirmed_nmse = Some(e);
    f.catalog = Some(m.name().to_string());
    f.also = matched[1..]
        .iter()
        .map(|(m, _)| m.name().to_string())
        .collect();
    Ok(f)
}

/// Whether `x` holds NaN and ±Inf at exactly `want`'s places (the same infinities); then the
/// NMSE of the finite rest (0 when nothing else is finite).
fn same_places(x: &[f32], want: &[f32]) -> Option<f64> {
    if x.len() != want.len() {
        return None;
    }
    let (mut d, mut s) = (0.0f64, 0.0f64);
    for (&a, &b) in x.iter().zip(want) {
        match (a.is_finite(), b.is_finite()) {
            (true, true) => {
                d += (a as f64 - b as f64).powi(2);
                s += (b as f64).powi(2);
            }
            (false, false) if a.is_nan() == b.is_nan() && (a.is_nan() || a == b) => {}
            _ => return None,
        }
    }
    Some(if s > 0.0 { d / s } else { d })
}

/// Where the non-finite values of `v` (the candidate at `k`, canonical order) sit, in words,
/// and whether they fill whole softmax rows.
fn pattern(cand: &Candidate, k: &TapKey, v: &[f32]) -> (String, bool) {
    let Some(dims) = cand.dims(k) else {
        return (String::new(), false);
    };
    let pos0 = cand.step_shape(k.step).map_or(0, |s| s.1);
    let probs = k.tap == Tap::KqSoftMax;
    // A softmax row per (head, query) of kq_soft_max [n_head, t, n_kv]; else a row per token.
    let (rows, len) = if probs {
        (dims[0] * dims[1], dims[2])
    } else {
        (dims[0], dims[1] * dims[2])
    };
    if rows == 0 || len == 0 || rows * len != v.len() {
        return (String::new(), false);
    }
    let mut whole = Vec::new();
    let mut part = Vec::new();
    for r in 0..rows {
        let bad = v[r * len..][..len]
            .iter()
            .filter(|x| !x.is_finite())
            .count();
        if bad == len {
            whole.push(r);
        } else if bad > 0 {
            part.push(r);
        }
    }
    let position = |r: usize| if probs { pos0 + r % dims[1] } else { pos0 + r };
    let positions = |rs: &[usize]| {
        let mut p: Vec<usize> = rs.iter().map(|&r| position(r)).collect();
        p.sort_unstable();
        p.dedup();
        let shown: Vec<String> = p.iter().take(8).map(|x| x.to_string()).collect();
        let more = if p.len() > 8 {
            format!(" and {} more", p.len() - 8)
        } else {
            String::new()
        };
        format!("{}{more}", shown.join(", "))
    };
    let what = if probs { "softmax rows" } else { "token rows" };
    let mut parts = Vec::new();
    if !whole.is_empty() {
        parts.push(format!(
            "every value of {} of {rows} {what} (position {})",
            whole.len(),
            positions(&whole)
        ));
    }
    if !part.is_empty() {
        parts.push(format!(
            "some values of {} {what} (position {})",
            part.len(),
            positions(&part)
        ));
    }
    let text = format!("; non-finite: {}", parts.join("; "));
    (text, probs && part.is_empty() && !whole.is_empty())
}

/// The likely causes of non-finite values that sit as they do.
fn hint(whole_softmax_rows: bool) -> &'static str {
    if whole_softmax_rows {
        "whole softmax rows are what a softmax over a row masked everywhere gives, exp(-inf - (-inf)) = NaN: the mask leaves those positions nothing to attend to (its own position excluded, a window of 0, a cache read past what was written)"
    } else {
        "an overflow, a division by zero, a fully masked softmax row upstream"
    }
}
