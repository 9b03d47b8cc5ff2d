//! Which `token_embd` row each of the candidate's embedding rows holds, solved from the trace.
//! An engine whose lookup is off (row `id + 1`, one row for every id) still stores real rows
//! of the table, only not its ids'; a wrong decoder stores rows of no id. Measured where the
//! embedding is the first op out of its floor and no hypothesis reproduces it.

use super::JudgeError;
use super::floor::F16_STORAGE;
use super::replay::Candidate;
use crate::compare::slice_nmse;
use crate::model::Model;
use crate::trace::{Tap, TapKey};

/// The rows of the step examined at most: the first that differ from their own id's row.
const ROWS: usize = 8;

/// What the candidate's embedding rows at `k` hold, in words: the table rows they are (within
/// f16 storage) and the rule they follow, or that no row of the table is any of them. None
/// where `k` is not an embedding, or every row is its own id's.
pub fn observed(model: &Model, cand: &Candidate, k: &TapKey) -> Result<Option<String>, JudgeError> {
    if k.tap != Tap::Embd {
        return Ok(None);
    }
    let Some(step) = cand.trace.manifest.steps.iter().find(|s| s.step == k.step) else {
        return Ok(None);
    };
    let Some(theirs) = cand.get(k)? else {
        return Ok(None);
    };
    let w = &model.token_embd;
    let (e, n_vocab) = w.rows();
    let ids = &step.tokens;
    if e == 0 || theirs.len() != ids.len() * e {
        return Ok(None);
    }
    let pos0 = step.positions.first().copied().unwrap_or(0);
    let mut row = vec![0.0f32; e];
    let mut bad: Vec<usize> = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= n_vocab {
            return Ok(None);
        }
        model.row(w, id, &mut row);
        if slice_nmse(&row, &theirs[i * e..][..e]) > F16_STORAGE {
            bad.push(i);
            if bad.len() == ROWS {
                break;
            }
        }
    }
    if bad.is_empty() {
        return Ok(None);
    }
    // One pass over the table: each examined row's closest table row.
    let mut best = vec![(f64::INFINITY, 0usize); bad.len()];
    for r in 0..n_vocab {
        model.row(w, r, &mut row);
        for (b, &i) in best.iter_mut().zip(&bad) {
            let d = slice_nmse(&row, &theirs[i * e..][..e]);
            if d < b.0 {
                *b = (d, r);
            }
        }
    }
    let held: Vec<Option<usize>> = best
        .iter()
        .map(|&(d, r)| (d <= F16_STORAGE).then_some(r))
        .collect();
    let id_of = |j: usize| ids[bad[j]] as i64;
    let at = |j: usize| format!("position {} (id {})", pos0 + bad[j], id_of(j));
    let n = bad.len();
    if held.iter().all(Option::is_none) {
        let closest = best.iter().map(|b| b.0).fold(f64::INFINITY, f64::min);
        return Ok(Some(format!(
            "no row of token_embd is any of the {n} embedding rows that differ (the closest at NMSE {closest:.1e}): the rows are not another id's, so the lookup's index is not the bug — the decoder of token_embd ({}) or how its rows are laid out",
            w.ty.name()
        )));
    }
    // An id offset most solved rows share (an index that wraps or runs off the table breaks
    // it at a row or two).
    let offsets: Vec<(usize, i64)> = (0..n)
        .filter_map(|j| held[j].map(|r| (j, r as i64 - id_of(j))))
        .collect();
    let mut common: Option<(i64, usize)> = None;
    for &(_, d) in &offsets {
        let c = offsets.iter().filter(|o| o.1 == d).count();
        if common.is_none_or(|(_, best)| c > best) {
            common = Some((d, c));
        }
    }
    if let Some((d, c)) = common
        && d != 0
        && c >= 2.max((3 * n).div_ceil(4))
    {
        let (j, _) = offsets.iter().find(|o| o.1 == d).copied().expect("counted");
        let sign = if d > 0 { "+" } else { "−" };
        let d = d.abs();
        return Ok(Some(format!(
            "the embedding rows that differ are token_embd's rows of their ids {sign} {d} ({c} of {n} rows solved so; {} holds row {}): the lookup reads row id {sign} {d}, an index off by {d}",
            at(j),
            held[j].expect("solved"),
        )));
    }
    if n > 1 && held.iter().all(|&r| r.is_some() && r == held[0]) {
        return Ok(Some(format!(
            "every embedding row that differs is token_embd's row {} ({n} rows solved, from {}): one row read for every id — the id is not passed to the lookup",
            held[0].expect("solved"),
            at(0)
        )));
    }
    let list: Vec<String> = (0..n)
        .map(|j| match held[j] {
            Some(r) => format!("{} → row {r}", at(j)),
            None => format!("{} → no row", at(j)),
        })
        .collect();
    Ok(Some(format!(
        "the embedding rows that differ are token_embd rows of other ids: {} — the ids the lookup reads are not the trace's",
        list.join(", ")
    )))
}
