//! Which position RoPE actually used for each row, solved from the trace itself: where a
//! full dump has q (or k) on both sides of RoPE, each pair of a row turned by the position
//! times its frequency, so the angles give the position the engine rotated at — whatever
//! rule produced it, in the catalog or not. The rows' positions are then read as a rule
//! ([`PosRule`]: shifted, stopped, modulo a width, counted inside the step) that the reference
//! replays over the whole trace as one experiment (`hypothesis::experiments`).

use super::JudgeError;
use super::replay::{Candidate, n_ctx};
use crate::arch::Rope;
use crate::backend::positions::{PosRule, RopeAt};
use crate::backend::reference::rope;
use crate::model::{Model, RopeType};
use crate::trace::{Tap, TapKey};

/// Each row's (position, first position of its step, position rotated at).
pub type SolvedRows = Vec<(usize, usize, usize)>;

/// The rows' (position, first position of its step, position rotated at) of `q` (or k) at
/// `layer` over every step the trace shows it on both sides of RoPE; None where it cannot
/// say (no tensor before RoPE, or under half of a step's rows rotated by the model's own RoPE
/// at any whole position: not a position bug).
pub fn solve(
    model: &Model,
    cand: &Candidate,
    layer: usize,
    q: bool,
) -> Result<Option<SolvedRows>, JudgeError> {
    let c = &model.config;
    if c.n_rot < 2 || layer >= model.layers.len() {
        return Ok(None);
    }
    // The input RoPE reads: the per-head norm's output where the model has one.
    let (pre, post) = match (q, crate::arch::records(c, Tap::QNormed)) {
        (true, true) => (Tap::QNormed, Tap::QRope),
        (true, false) => (Tap::Q, Tap::QRope),
        (false, true) => (Tap::KNormed, Tap::KRope),
        (false, false) => (Tap::K, Tap::KRope),
    };
    let steps = &cand.trace.manifest.steps;
    let rope_at = Rope::for_layer(
        c,
        layer,
        model.layers[layer].rope_factors(n_ctx(steps.iter()), c),
    );
    let factors = rope_at.factors.map(|f| model.vector(f));
    let hd = c.head_dim;
    let half = c.n_rot / 2;
    let pair = |i: usize| match c.rope_type {
        RopeType::Norm => (2 * i, 2 * i + 1),
        RopeType::Neox => (i, i + half),
    };
    // Each pair's angle at position 1 (its frequency, with the model's scale and factors):
    // a row of unit pairs rotated once.
    let mut unit = vec![0f32; hd];
    for i in 0..half {
        unit[pair(i).0] = 1.0;
    }
    rope(
        &mut unit,
        1,
        1,
        &rope_at,
        factors.as_deref(),
        &mut Vec::new(),
    );
    let mut freqs: Vec<(f64, usize)> = (0..half)
        .map(|i| {
            let (a, b) = pair(i);
            ((unit[b] as f64).atan2(unit[a] as f64), i)
        })
        .filter(|(w, _)| *w > 0.0)
        .collect();
    if freqs.is_empty() {
        return Ok(None);
    }
    freqs.sort_by(|a, b| a.0.total_cmp(&b.0));

    let mut out = Vec::new();
    let mut any = false;
    for s in steps {
        let (kx, ky) = (
            TapKey::new(s.step, Some(layer), pre),
            TapKey::new(s.step, Some(layer), post),
        );
        if !(cand.contains(&kx) && cand.contains(&ky)) {
            continue;
        }
        let (Some(x), Some(y), Some([t, nh, d])) = (cand.get(&kx)?, cand.get(&ky)?, cand.dims(&ky))
        else {
            continue;
        };
        if d != hd || x.len() != t * nh * hd || y.len() != x.len() {
            continue;
        }
        any = true;
        let step0 = s.positions.first().copied().unwrap_or(0);
        let mut solved = 0;
        for (row, &p) in s.positions.iter().enumerate().take(t) {
            let w = nh * hd;
            let (xr, yr) = (&x[row * w..(row + 1) * w], &y[row * w..(row + 1) * w]);
            if let Some(at) = row_position(xr, yr, nh, &freqs, &pair, &rope_at, factors.as_deref())
            {
                out.push((p, step0, at));
                solved += 1;
            }
        }
        if solved * 2 < t {
            return Ok(None);
        }
    }
    Ok((any && !out.is_empty()).then_some(out))
}

/// The whole position a row `y` is `x` rotated at, where RoPE at it reproduces `y` and the
/// positions either side do not.
fn row_position(
    x: &[f32],
    y: &[f32],
    nh: usize,
    freqs: &[(f64, usize)],
    pair: &dyn Fn(usize) -> (usize, usize),
    r: &Rope,
    factors: Option<&[f32]>,
) -> Option<usize> {
    let hd = r.head_dim;
    // The turn of pair i over the heads: arg of sum conj(x) * y.
    let angle = |i: usize| -> Option<f64> {
        let (a, b) = pair(i);
        let (mut re, mut im, mut mag) = (0f64, 0f64, 0f64);
        for h in 0..nh {
            let (xa, xb) = (x[h * hd + a] as f64, x[h * hd + b] as f64);
            let (ya, yb) = (y[h * hd + a] as f64, y[h * hd + b] as f64);
            re += xa * ya + xb * yb;
            im += xa * yb - xb * ya;
            mag += (xa * xa + xb * xb).sqrt() * (ya * ya + yb * yb).sqrt();
        }
        (mag > 0.0 && (re * re + im * im).sqrt() > 0.5 * mag).then(|| im.atan2(re))
    };
    // The slowest pair first (its turn below π up to thousands of positions), each faster one
    // resolving the last estimate's remainder to a whole number of turns.
    let mut est: Option<f64> = None;
    for &(w, i) in freqs {
        let Some(phi) = angle(i) else { continue };
        est = Some(match est {
            None => phi / w,
            Some(p) => {
                let n = ((p * w - phi) / std::f64::consts::TAU).round();
                (phi + n * std::f64::consts::TAU) / w
            }
        });
    }
    let p = est?.round();
    if !(0.0..1e9).contains(&p) {
        return None;
    }
    let p = p as usize;
    let err = |q: usize| -> f64 {
        let mut z = x.to_vec();
        rope(&mut z, q, nh, r, factors, &mut Vec::new());
        let (mut see, mut saa) = (0f64, 0f64);
        for (a, b) in z.iter().zip(y) {
            see += ((a - b) as f64).powi(2);
            saa += (*b as f64).powi(2);
        }
        if saa == 0.0 { f64::INFINITY } else { see / saa }
    };
    let e = err(p);
    let side = err(p + 1).min(if p > 0 { err(p - 1) } else { f64::INFINITY });
    (e <= ROW_FIT && e * ROW_APART <= side).then_some(p)
}

/// A row's NMSE against RoPE at the solved position at most this (an engine's angles computed
/// another way in f32 differ by ~1e-8 at position 2,000), ...
const ROW_FIT: f64 = 1e-5;
/// ... and this many times under the positions either side.
const ROW_APART: f64 = 100.0;

/// The rules that give every solved row its position: none where the rows are the model's
/// own (nothing to say) or no rule fits them all (several where the rows cannot tell them
/// apart: one decode step at 0 is a counter stopped at 0, positions modulo its position, or
/// counted inside the step).
pub fn rules(rows: &[(usize, usize, usize)]) -> Vec<PosRule> {
    let Some(&(from, s0, at)) = rows
        .iter()
        .filter(|(p, _, a)| p != a)
        .min_by_key(|(p, _, _)| *p)
    else {
        return Vec::new();
    };
    // The shift the last row says, from position 0: a shift clamped at 0 (`max(p - 3, 0)`)
    // first shows at 1, as a shift of 1.
    let &(pl, _, al) = rows.iter().max_by_key(|(p, _, _)| *p).expect("not empty");
    let by_last = al as i64 - pl as i64;
    let mut cands = vec![
        PosRule::StepLocal { from },
        PosRule::Modulo(from),
        PosRule::Shift {
            from,
            by: at as i64 - from as i64,
        },
        PosRule::Shift {
            from: 0,
            by: by_last,
        },
        PosRule::Fixed { from, at },
    ];
    cands.retain(|r| match r {
        PosRule::StepLocal { .. } => at == from - s0,
        PosRule::Modulo(w) => at == 0 && *w > 0,
        _ => true,
    });
    // A shift clamped at 0 only from position 0 on (a counter that starts late); past it a
    // shift below 0 would be a counter stopped at 0, which `Fixed` says.
    cands.retain(|r| match *r {
        PosRule::Shift { from, by } => from == 0 || from as i64 + by >= 0,
        _ => true,
    });
    cands.retain(|r| rows.iter().all(|&(p, s, a)| r.at(p, s) == a));
    let mut seen = Vec::new();
    cands.retain(|r| {
        let new = !seen.contains(r);
        seen.push(*r);
        new
    });
    cands
}

/// The hypotheses RoPE's solved positions at `layer` make: q's rules with k's (where k cannot
/// be solved, its own positions or q's rule), at most `MAX` of them.
pub fn hypotheses(
    model: &Model,
    cand: &Candidate,
    layer: usize,
) -> Result<Vec<RopeAt>, JudgeError> {
    const MAX: usize = 6;
    let side = |q: bool| -> Result<Option<Vec<PosRule>>, JudgeError> {
        Ok(solve(model, cand, layer, q)?.map(|rows| {
            let r = rules(&rows);
            // Solved and all the model's own: that side is right.
            if r.is_empty() && rows.iter().all(|(p, _, a)| p == a) {
                vec![PosRule::Own]
            } else {
                r
            }
        }))
    };
    let (q, k) = (side(true)?, side(false)?);
    let product = |q: &[PosRule], k: &[PosRule]| -> Vec<(PosRule, PosRule)> {
        q.iter()
            .flat_map(|&a| k.iter().map(move |&b| (a, b)))
            .collect()
    };
    let pairs = match (q, k) {
        (None, None) => return Ok(Vec::new()),
        // The side the trace cannot solve: its own positions, or the other side's rule.
        (Some(q), None) => {
            let mut k = vec![PosRule::Own];
            k.extend(q.iter().copied());
            product(&q, &k)
        }
        (None, Some(k)) => {
            let mut q = vec![PosRule::Own];
            q.extend(k.iter().copied());
            product(&q, &k)
        }
        // Where both sides fit a rule, the same one (several where the rows cannot tell
        // them apart), not each of q's with each of k's.
        (Some(q), Some(k)) => {
            let both: Vec<(PosRule, PosRule)> = q
                .iter()
                .filter(|r| k.contains(r))
                .map(|&r| (r, r))
                .collect();
            if both.is_empty() {
                product(&q, &k)
            } else {
                both
            }
        }
    };
    Ok(novel(cand, pairs, MAX))
}

/// Rules for where the trace cannot solve RoPE's positions (a sparse dump: no q or k on both
/// sides of it), from the first position out of the floor `p0`: from there on a counter
/// stopped the row before (`min(p, p0 - 1)`), no rotation, a shift by one either way, the
/// index inside the step; each for q and k together and for either alone. A rotation at the
/// wrong position moves the row at once, so the first row out is where the rule starts (one
/// that moves q and k alike is invisible: attention sees only their difference).
pub fn guesses(cand: &Candidate, p0: usize) -> Vec<RopeAt> {
    let mut rules = Vec::new();
    // From the row before too: a small move of a row's own output can stay under its floor
    // (k rotated one early from position 9 on under ggml's rounding first showed at row 10,
    // and `p-1@10` fitted within the floor).
    for from in [p0, p0.saturating_sub(1)] {
        rules.extend([
            PosRule::StepLocal { from },
            PosRule::Fixed { from, at: 0 },
            PosRule::Shift { from, by: 1 },
        ]);
        if from > 0 {
            rules.extend([
                PosRule::Fixed { from, at: from - 1 },
                PosRule::Shift { from, by: -1 },
            ]);
        }
    }
    // A shift of q or k alone from position 0 first shows at row 1: row 0 attends to itself
    // alone, whatever the score.
    if p0 <= 2 {
        rules.extend([-1, 1].map(|by| PosRule::Shift { from: 0, by }));
    }
    let pairs = rules
        .iter()
        .flat_map(|&r| [(r, r), (r, PosRule::Own), (PosRule::Own, r)])
        .collect();
    novel(cand, pairs, usize::MAX)
}

/// The largest shift [`far_guesses`] replays, either way.
pub const FAR_SHIFT: i64 = 8;

/// Where [`guesses`] reproduced nothing: shifts by 2 to [`FAR_SHIFT`] either way from the
/// first row out `p0` (and the row before), for q and k together and either alone, and where
/// `p0 <= 2` from position 0 (`max(p - 3, 0)`: a counter that starts late, clamped at 0, first
/// shows at row 1). A position counter that adds a template's or a BOS's length, or leaves
/// it out, is such a shift. Past [`FAR_SHIFT`], by as many positions as lie before the first
/// row out, either way (a decode counter that adds the prompt's length twice, or restarts at 0).
pub fn far_guesses(cand: &Candidate, p0: usize) -> Vec<RopeAt> {
    let mut rules = Vec::new();
    let mut froms = vec![p0, p0.saturating_sub(1)];
    if p0 <= 2 {
        froms.push(0);
    }
    froms.dedup();
    for by in (2..=FAR_SHIFT).flat_map(|b| [b, -b]) {
        for &from in &froms {
            // Below 0 past position 0 is a counter stopped at 0 (`Fixed`), tried before.
            if from == 0 || from as i64 + by >= 0 {
                rules.push(PosRule::Shift { from, by });
            }
        }
    }
    // The positions before it counted twice, or left out: a decode counter that adds the
    // prompt's length to a position that already holds it, or starts again from 0.
    for &from in &froms {
        let n = from as i64;
        if n > FAR_SHIFT {
            rules.extend([n, -n].map(|by| PosRule::Shift { from, by }));
        }
    }
    let pairs = rules
        .iter()
        .flat_map(|&r| [(r, r), (r, PosRule::Own), (PosRule::Own, r)])
        .collect();
    novel(cand, pairs, usize::MAX)
}

/// The largest shift [`long_shifts`] replays, either way.
pub const LONG_SHIFT: i64 = 64;

/// Where [`far_guesses`] reproduced nothing either: q and k shifted from the first row out
/// `p0` by [`FAR_SHIFT`] + 1 to [`LONG_SHIFT`] positions, later or (as far as `p0`) earlier,
/// together or either alone. A position counter that adds or leaves out a chat template's or
/// a system prompt's tokens moves every row by that many (a shift of 12 from position 20 was
/// placed, unnamed, before); one kept for the cache's keys apart from the queries' moves one
/// side only.
pub fn long_shifts(cand: &Candidate, p0: usize) -> Vec<RopeAt> {
    let n = p0 as i64;
    let pairs = (FAR_SHIFT + 1..=LONG_SHIFT)
        .flat_map(|b| [b, -b])
        // ±p0 is a far guess; further back than p0 is a counter clamped at 0.
        .filter(|&by| by != n && by != -n && n + by >= 0)
        .flat_map(|by| {
            let r = PosRule::Shift { from: p0, by };
            [(r, r), (r, PosRule::Own), (PosRule::Own, r)]
        })
        .collect();
    novel(cand, pairs, usize::MAX)
}

/// The (q, k) rules that move something and that no catalog bug names (rope-q-skipped,
/// rope-k-skipped, rope-pos-wrap, rope-pos-off-by-one: the first decode position on at
/// p + 1 — the catalog's to name), each once, at most `max`.
fn novel(cand: &Candidate, pairs: Vec<(PosRule, PosRule)>, max: usize) -> Vec<RopeAt> {
    let decode0 = cand
        .trace
        .manifest
        .steps
        .iter()
        .filter_map(|s| s.positions.first().copied())
        .filter(|&p| p > 0)
        .min();
    let catalog = |h: RopeAt| match (h.q, h.k) {
        (PosRule::Fixed { from: 0, at: 0 }, PosRule::Own)
        | (PosRule::Own, PosRule::Fixed { from: 0, at: 0 }) => true,
        (PosRule::Modulo(a), PosRule::Modulo(b)) => a == b,
        (PosRule::Shift { from, by: 1 }, b) => b == h.q && Some(from) == decode0,
        _ => false,
    };
    let mut out: Vec<RopeAt> = Vec::new();
    for (qr, kr) in pairs {
        let h = RopeAt { q: qr, k: kr };
        if (qr, kr) != (PosRule::Own, PosRule::Own)
            && !catalog(h)
            && !out.contains(&h)
            && out.len() < max
        {
            out.push(h);
        }
    }
    out
}

/// What the trace's own rotations say at `layer`, where no experiment reproduced the key:
/// the first rows rotated at another position than their own, or that no whole position
/// under the model's RoPE gives them (then the positions are not what is wrong). None where
/// the trace has no q/k before RoPE.
pub fn observed(
    model: &Model,
    cand: &Candidate,
    layer: usize,
) -> Result<Option<String>, JudgeError> {
    let mut parts = Vec::new();
    for (q, who) in [(true, "q"), (false, "k")] {
        let pre = if q {
            [Tap::Q, Tap::QNormed]
        } else {
            [Tap::K, Tap::KNormed]
        };
        if !cand
            .trace
            .keys()
            .any(|x| x.layer == Some(layer) && pre.contains(&x.tap))
        {
            continue;
        }
        match solve(model, cand, layer, q)? {
            None => parts.push(format!(
                "{who}: no whole position under the model's RoPE (its base, pairing, scaling) reproduces the rotated rows, so the positions are not the bug"
            )),
            Some(rows) => {
                let off: Vec<&(usize, usize, usize)> = rows.iter().filter(|(p, _, a)| p != a).collect();
                if off.is_empty() {
                    parts.push(format!("{who}: every row at its own position"));
                } else {
                    let list: Vec<String> = off.iter().take(8).map(|(p, _, a)| format!("{p}→{a}")).collect();
                    parts.push(format!(
                        "{who}: {} of {} rows at another position than their own ({}{})",
                        off.len(),
                        rows.len(),
                        list.join(", "),
                        if off.len() > 8 { ", …" } else { "" }
                    ));
                }
            }
        }
    }
    Ok((!parts.is_empty()).then(|| {
        format!(
            "RoPE's angles solved row by row (position → the position rotated at): {}",
            parts.join("; ")
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_read_as_the_rule_that_gives_them_all() {
        // A prompt of 20 rows, then decode steps at 20, 21, 22.
        let rows_of = |f: &dyn Fn(usize, usize) -> usize| -> Vec<(usize, usize, usize)> {
            (0..20)
                .map(|p| (p, 0))
                .chain((20..23).map(|p| (p, p)))
                .map(|(p, s)| (p, s, f(p, s)))
                .collect()
        };
        assert!(rules(&rows_of(&|p, _| p)).is_empty());
        assert_eq!(rules(&rows_of(&|p, _| p % 8)), vec![PosRule::Modulo(8)]);
        assert_eq!(
            rules(&rows_of(&|p, _| if p >= 20 { p + 2 } else { p })),
            vec![PosRule::Shift { from: 20, by: 2 }]
        );
        assert_eq!(
            rules(&rows_of(&|p, _| p + 1)),
            vec![PosRule::Shift { from: 0, by: 1 }]
        );
        assert_eq!(
            rules(&rows_of(&|p, _| if p >= 20 { 19 } else { p })),
            vec![PosRule::Fixed { from: 20, at: 19 }]
        );
        assert_eq!(
            rules(&rows_of(&|p, s| p - s)),
            // One-row decode steps at 0: counted inside the step, or a counter stuck at 0.
            vec![
                PosRule::StepLocal { from: 20 },
                PosRule::Fixed { from: 20, at: 0 }
            ]
        );
        // Clamped at 0: first shows at 1, a shift of 3 by the last row.
        assert_eq!(
            rules(&rows_of(&|p, _| p.saturating_sub(3))),
            vec![PosRule::Shift { from: 0, by: -3 }]
        );
        // Nothing fits: no rule.
        assert!(rules(&rows_of(&|p, _| if p == 5 { 9 } else { p })).is_empty());
    }
}
