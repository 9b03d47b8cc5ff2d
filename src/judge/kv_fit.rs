//! Which cached key each column of the attention actually read, solved from the trace: a full
//! dump has the step's q after RoPE, every earlier step's k after RoPE (the cache's rows, by
//! position) and the engine's probabilities. For a row, log p[h, j] = s[h, σ(j)] − L[h], with
//! s the scores of q against each position's key and L the row's log-sum-exp; the positions
//! whose scores match a column's log-probabilities over every head say which key it held —
//! its own, another position's (a ring that wrapped, a slot written late), or none (an empty
//! slot: a zero key). Said in the finding's words where no experiment reproduces the key.

use super::JudgeError;
use super::replay::Candidate;
use crate::arch::Attn;
use crate::model::Model;
use crate::trace::{Tap, TapKey};

/// What column `j` of a row held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// The key of this position (its own where it equals the column).
    Key(usize),
    /// A zero key (a slot nothing was written to).
    Empty,
    /// Masked: probability 0 where the model attends.
    Masked,
    /// Attended where the model masks (a later position, or past a sliding window).
    Unmasked,
    /// No cached key and no zero key gives its scores.
    Unknown,
}

/// The keys every column of row `row` of step `step`'s probabilities at `layer` held; None
/// where the trace lacks a tensor it needs.
pub fn solve_row(
    model: &Model,
    cand: &Candidate,
    step: usize,
    layer: usize,
    row: usize,
) -> Result<Option<Vec<Held>>, JudgeError> {
    let c = &model.config;
    let at = |tap| TapKey::new(step, Some(layer), tap);
    let (Some(q), Some([nh, t, n_kv])) =
        (cand.get(&at(Tap::QRope))?, cand.dims(&at(Tap::KqSoftMax)))
    else {
        return Ok(None);
    };
    let (hd, nkv) = (c.head_dim, c.n_head_kv);
    if row >= t || q.len() != t * nh * hd || nkv == 0 || nh % nkv != 0 {
        return Ok(None);
    }
    // The row's probabilities of each head the trace kept (`heads[x]`'s at `p[x][j]`): every
    // head, or those a cut tensor kept where it kept this row.
    let (_, pos0) = cand.step_shape(step).unwrap_or((t, 0));
    let (heads, p): (Vec<usize>, Vec<&[f32]>);
    let whole;
    let cut_v;
    match cand.cut_values(&at(Tap::KqSoftMax))? {
        Some((cut, v)) => {
            let rows = cut.row_index(pos0, t);
            let Ok(r) = rows.binary_search(&row) else {
                return Ok(None);
            };
            heads = cut.head_index(nh);
            cut_v = v;
            if cut_v.len() != heads.len() * rows.len() * n_kv {
                return Ok(None);
            }
            p = (0..heads.len())
                .map(|x| &cut_v[(x * rows.len() + r) * n_kv..][..n_kv])
                .collect();
        }
        None => {
            let Some(v) = cand.get(&at(Tap::KqSoftMax))? else {
                return Ok(None);
            };
            whole = v;
            heads = (0..nh).collect();
            p = heads
                .iter()
                .map(|&h| &whole[(h * t + row) * n_kv..][..n_kv])
                .collect();
        }
    }
    // The cache's rows by position: each step's k after RoPE.
    let mut keys: Vec<Option<Vec<f32>>> = vec![None; n_kv];
    for s in &cand.trace.manifest.steps {
        if s.step > step {
            continue;
        }
        let Some(k) = cand.get(&TapKey::new(s.step, Some(layer), Tap::KRope))? else {
            continue;
        };
        let w = nkv * hd;
        for (r, &pos) in s.positions.iter().enumerate() {
            if pos < n_kv && (r + 1) * w <= k.len() {
                keys[pos] = Some(k[r * w..(r + 1) * w].to_vec());
            }
        }
    }
    let a = Attn::for_layer(c, layer, pos0, t);
    let i = pos0 + row;
    let group = nh / nkv;
    let score = |h: usize, key: &[f32]| -> f64 {
        let qv = &q[(row * nh + h) * hd..][..hd];
        let kv = &key[(h / group) * hd..][..hd];
        let mut s = qv
            .iter()
            .zip(kv)
            .map(|(x, y)| *x as f64 * *y as f64)
            .sum::<f64>()
            * a.kq_scale as f64;
        if let Some(cap) = a.softcap {
            s = cap as f64 * (s / cap as f64).tanh();
        }
        s
    };
    let seen: Vec<bool> = (0..n_kv)
        .map(|j| j <= i && (a.window == 0 || i - j < a.window))
        .collect();
    // The fit numbers the kept heads 0..: `x` is `heads[x]`.
    let n = heads.len();
    let prob = |x: usize, j: usize| p[x][j] as f64;
    // (head, log p) of each column's attending heads.
    let logp: Vec<Vec<(usize, f64)>> = (0..n_kv)
        .map(|j| {
            (0..n)
                .filter(|&x| prob(x, j) > 1e-30)
                .map(|x| (x, prob(x, j).ln()))
                .collect()
        })
        .collect();
    let zero: Vec<bool> = (0..n_kv)
        .map(|j| (0..n).all(|x| prob(x, j) == 0.0))
        .collect();
    // A pass weighs every attended column against every key over the heads: past this the
    // row is not solved (a 2,048-token prompt's row is 2^27).
    let attended = zero.iter().filter(|z| !**z).count();
    if attended * (n_kv + 1) * n > MAX_WEIGHED {
        return Ok(None);
    }
    // Scores of the row against every cached key.
    let scores: Vec<Vec<Option<f64>>> = heads
        .iter()
        .map(|&h| {
            keys.iter()
                .map(|k| k.as_deref().map(|k| score(h, k)))
                .collect()
        })
        .collect();
    Ok(read(&Row {
        nh: n,
        seen,
        zero,
        logp,
        scores,
    }))
}

/// One row of the probabilities as the fit reads it.
struct Row {
    nh: usize,
    /// Whether the model attends to each column.
    seen: Vec<bool>,
    /// Whether every head gives each column 0.
    zero: Vec<bool>,
    /// Each column's (head, log p) where that head attends to it.
    logp: Vec<Vec<(usize, f64)>>,
    /// Per head, the row's score against each position's cached key (None: not cached).
    scores: Vec<Vec<Option<f64>>>,
}

/// The key each column of `r` held, fitted with each head's log-sum-exp; None where two
/// readings fit as well.
fn read(r: &Row) -> Option<Vec<Held>> {
    let (nh, n_kv) = (r.nh, r.seen.len());
    let live = |h: usize, j: usize| r.logp[j].iter().any(|&(x, _)| x == h);
    let lnp = |h: usize, j: usize| r.logp[j].iter().find(|&&(x, _)| x == h).map(|&(_, l)| l);
    // A column every head gives 0 is masked where the model attends; every column a head
    // attends to is fitted (on the heads that attend to it).
    let mut held: Vec<Held> = (0..n_kv).map(Held::Key).collect();
    let mut fit = Vec::new();
    for (j, x) in held.iter_mut().enumerate() {
        if r.seen[j] && r.zero[j] {
            *x = Held::Masked;
        }
        if !r.zero[j] {
            fit.push(j);
        }
    }
    // A zero key scores 0 (soft-capped too).
    let of = |h: usize, x: Held| -> Option<f64> {
        match x {
            Held::Key(m) => r.scores[h][m],
            Held::Empty => Some(0.0),
            _ => None,
        }
    };
    // Each head's log-sum-exp over what the columns held.
    let lse_of = |held: &[Held]| -> Option<Vec<f64>> {
        (0..nh)
            .map(|h| {
                let v: Vec<f64> = fit.iter().filter_map(|&j| of(h, held[j])).collect();
                let m = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                (m.is_finite()).then(|| m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln())
            })
            .collect()
    };
    // The mean square distance of column j's log-probabilities from what `x` scores, over
    // the heads that attend to it.
    let dist = |lse: &[f64], j: usize, x: Held| -> f64 {
        let (mut sum, mut n) = (0f64, 0usize);
        for &(h, lp) in &r.logp[j] {
            let Some(s) = of(h, x) else {
                return f64::INFINITY;
            };
            sum += (lp + lse[h] - s).powi(2);
            n += 1;
        }
        if n == 0 {
            f64::INFINITY
        } else {
            sum / n as f64
        }
    };
    // Each column the key that fits it best, its own unless another is `APART` times closer.
    // Also the plain nearest reading, which the next log-sum-exp is taken from: a start far
    // off (half the row on other keys, an attention sink counted twice) still lands most
    // columns on their key, where the own-key preference would keep it where it was.
    let assign = |lse: &[f64]| -> (Vec<Held>, f64, Vec<Held>) {
        let mut out = held.clone();
        let mut nearest = held.clone();
        let mut total = 0.0;
        for &j in &fit {
            let own = dist(lse, j, Held::Key(j));
            let mut best = (dist(lse, j, Held::Empty), Held::Empty);
            for m in 0..n_kv {
                let d = dist(lse, j, Held::Key(m));
                if d < best.0 {
                    best = (d, Held::Key(m));
                }
            }
            nearest[j] = best.1;
            let (d, x) = if own <= MATCH || own <= best.0 * APART {
                (own, Held::Key(j))
            } else if best.0 <= MATCH {
                best
            } else {
                (own.min(best.0), Held::Unknown)
            };
            out[j] = x;
            total += d;
        }
        (out, total, nearest)
    };
    // The log-sum-exp is not known until the keys are: start from every column at its own key
    // (exact where the engine read a permutation of them) and from the median of s − log p
    // (most columns at their own), reassign a few times, keep the closer fit.
    let median_start: Option<Vec<f64>> = (0..nh)
        .map(|h| {
            super::floor::median(
                fit.iter()
                    .filter(|&&j| live(h, j))
                    .filter_map(|&j| Some(r.scores[h][j]? - lnp(h, j)?))
                    .collect(),
            )
        })
        .collect();
    // A short row (a prompt's first rows) may hold another key in half its columns: anchored
    // starts too, each a column taken to hold one key (or a zero one), which fixes every
    // head's log-sum-exp exactly where it does.
    let mut starts: Vec<Vec<f64>> = [lse_of(&held), median_start]
        .into_iter()
        .flatten()
        .collect();
    if fit.len() <= ANCHORED_COLUMNS
        && let Some(base) = starts.first().cloned()
    {
        let anchors = [fit.first(), fit.get(fit.len() / 2), fit.last()];
        for &a in anchors.into_iter().flatten() {
            for x in (0..n_kv).map(Held::Key).chain([Held::Empty]) {
                let l: Option<Vec<f64>> = (0..nh)
                    .map(|h| match live(h, a) {
                        true => Some(of(h, x)? - lnp(h, a)?),
                        false => Some(base[h]),
                    })
                    .collect();
                starts.extend(l);
            }
        }
    }
    let mut fits: Vec<(Vec<Held>, f64)> = Vec::new();
    for start in starts {
        let mut lse = start;
        for _ in 0..PASSES {
            let (h, total, nearest) = assign(&lse);
            let next = lse_of(&nearest);
            fits.push((h, total));
            match next {
                Some(next) => lse = next,
                None => break,
            }
        }
    }
    let min = fits.iter().map(|f| f.1).reduce(f64::min)?;
    // Two different readings that fit as well: the row cannot tell (two columns holding one
    // key give equal probabilities whichever key it is).
    let tie = min * 2.0 + 1e-9;
    let mut alike = fits.into_iter().filter(|f| f.1 <= tie).map(|f| f.0);
    let mut held = alike.next()?;
    if alike.any(|other| other != held) {
        return None;
    }
    for j in fit {
        if !r.seen[j] {
            held[j] = Held::Unmasked;
        }
    }
    Some(held)
}

/// The most (column, key, head) distances one pass of a row's fit weighs.
const MAX_WEIGHED: usize = 1 << 28;
/// Reassignments from each start.
const PASSES: usize = 4;
/// Rows from the first one out of the floor tried for one whose reading is unambiguous.
const ROWS_TRIED: usize = 4;
/// Rows of at most this many attended columns are also fitted from anchored starts.
const ANCHORED_COLUMNS: usize = 32;
/// A column's mean squared distance (in log-probability) from a key's scores at most this
/// holds that key (an f16 cache moves a score by ~1e-3) …
const MATCH: f64 = 1e-3;
/// … and this many times closer than the other.
const APART: f64 = 100.0;

/// The finding's words for what row `row` of `key` (kq_soft_max) read, where a column did not
/// hold its own key: "at position 13, column 0 held position 13's key (…)". None where every
/// column held its own or the trace cannot say.
pub fn observed(
    model: &Model,
    cand: &Candidate,
    key: &TapKey,
    row: usize,
) -> Result<Option<String>, JudgeError> {
    let Some(layer) = key.layer else {
        return Ok(None);
    };
    if key.tap != Tap::KqSoftMax {
        return Ok(None);
    }
    // The first row out of the floor, or the next that says which keys it read unambiguously.
    let rows = cand.step_shape(key.step).map_or(1, |(t, _)| t);
    let mut solved = None;
    for r in row..rows.min(row + ROWS_TRIED) {
        if let Some(h) = solve_row(model, cand, key.step, layer, r)? {
            solved = Some((r, h));
            break;
        }
    }
    let Some((row, held)) = solved else {
        return Ok(None);
    };
    let pos = cand.step_shape(key.step).map_or(row, |(_, p0)| p0 + row);
    let off: Vec<String> = held
        .iter()
        .enumerate()
        .filter(|&(j, h)| *h != Held::Key(j))
        .map(|(j, h)| match h {
            Held::Key(m) => format!("{j}→position {m}'s key"),
            Held::Empty => format!("{j}→an empty slot (a zero key)"),
            Held::Masked => format!("{j}→masked"),
            Held::Unmasked => format!("{j}→attended (the model masks it)"),
            Held::Unknown => format!("{j}→no cached key"),
        })
        .collect();
    if off.is_empty() {
        return Ok(Some(format!(
            "the attention at position {pos} read every cached key at its own column (solved from the trace's q, k and probabilities): the keys are not what differs"
        )));
    }
    let n = off.len();
    let list: Vec<String> = off.into_iter().take(8).collect();
    let a = Attn::for_layer(&model.config, layer, pos - row, rows);
    let seen = if a.window == 0 {
        pos + 1
    } else {
        a.window.min(pos + 1)
    };
    Ok(Some(format!(
        "the attention at position {pos} read, column by column (solved from the trace's q, k and probabilities), {n} of the {seen} columns it attends to not at their own key: {}{}{}",
        list.join(", "),
        if n > 8 { ", …" } else { "" },
        pattern(&held, pos).map_or(String::new(), |p| format!(" — {p}"))
    )))
}

/// The shape the columns that did not hold their own key share, in words, where they share
/// one.
pub fn pattern(held: &[Held], pos: usize) -> Option<String> {
    let off: Vec<(usize, Held)> = held
        .iter()
        .copied()
        .enumerate()
        .filter(|&(j, h)| h != Held::Key(j))
        .collect();
    let (&(j0, _), _) = off.split_first()?;
    let all = |f: &dyn Fn(usize, Held) -> bool| off.iter().all(|&(j, h)| f(j, h));
    if all(&|j, h| h == Held::Empty && j == pos) {
        return Some(
            "its own slot held nothing: this step's K/V were read before they were written".into(),
        );
    }
    if all(&|_, h| h == Held::Empty) {
        return Some(
            "those slots held nothing (zero keys): the cache was cleared, or their K/V were written elsewhere"
                .into(),
        );
    }
    // (One column held position i − j's key says nothing of an order.)
    if off.len() > 1 && all(&|j, h| h == Held::Key(pos - j.min(pos)) && j <= pos) {
        return Some(
            "the cache was read in reverse order (column j held position i − j's key)".into(),
        );
    }
    // Later positions in earlier columns, all a multiple of one width apart: a ring (where
    // later writes landed in earlier slots; a key not yet written cannot be read).
    let gaps: Option<Vec<usize>> = off
        .iter()
        .map(|&(j, h)| match h {
            Held::Key(m) if m > j => Some(m - j),
            _ => None,
        })
        .collect();
    if let Some(w) = gaps.and_then(|g| g.into_iter().reduce(gcd))
        && w > 1
    {
        return Some(format!(
            "those columns held later positions' keys, a multiple of {w} on: a ring of {w} slots whose later writes overwrote them"
        ));
    }
    let shift = |j: usize, h: Held| match h {
        Held::Key(m) => Some(m as i64 - j as i64),
        _ => None,
    };
    let d = shift(j0, off[0].1)?;
    if all(&|j, h| shift(j, h) == Some(d)) {
        let n = d.unsigned_abs();
        return Some(format!(
            "each of those columns held the key {n} position{} {} (a slot index off by {n})",
            if n == 1 { "" } else { "s" },
            if d > 0 { "later" } else { "earlier" }
        ));
    }
    None
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_columns_shape_is_said_where_they_share_one() {
        let own = |n: usize| (0..n).map(Held::Key).collect::<Vec<_>>();
        assert_eq!(pattern(&own(5), 4), None);
        let mut h = own(21);
        h[20] = Held::Empty;
        assert!(
            pattern(&h, 20)
                .unwrap()
                .contains("read before they were written")
        );
        let rev: Vec<Held> = (0..4).map(|j| Held::Key(3 - j)).collect();
        assert!(pattern(&rev, 3).unwrap().contains("reverse order"));
        let late: Vec<Held> = (0..6usize)
            .map(|j| Held::Key(j.saturating_sub(1)))
            .collect();
        // Column 0 held its own (position 0), 1.. the one before: one earlier.
        assert!(pattern(&late, 5).unwrap().contains("1 position earlier"));
        let mut ring = own(20);
        ring[0] = Held::Key(13);
        ring[1] = Held::Key(14);
        assert!(pattern(&ring, 14).unwrap().contains("a ring of 13 slots"));
        let mut odd = own(6);
        odd[2] = Held::Key(5);
        odd[3] = Held::Empty;
        assert_eq!(pattern(&odd, 5), None);
    }
}
