//! Where a finding first shows, token-wise ([`Position`]): the own error at the finding's key
//! recomputed and read row by row.

use super::replay::{Candidate, Setup, Window, replay};
use super::{JudgeError, Judgement};
use crate::compare::position::{Position, first_row};
use crate::model::Model;
use crate::trace::{Tap, TapKey};
use std::collections::BTreeSet;

/// The first row of `key` out of `floor`, the reference's tensor `ours` against the
/// candidate's: (row within the step, position).
pub fn first_at(
    cand: &Candidate,
    key: &TapKey,
    ours: &[f32],
    floor: f64,
) -> Result<Option<(usize, usize)>, JudgeError> {
    let (Some((_, pos0)), Some(theirs), Some(dims)) = (
        cand.step_shape(key.step),
        cand.get_over(key, ours)?,
        cand.dims(key),
    ) else {
        return Ok(None);
    };
    Ok(first_row(ours, &theirs, dims, key.tap, floor).map(|r| (r, pos0 + r)))
}

/// Where an own error within its floor starts, at a key of the prompt stored a row per token
/// (`ours`: the reference's replay, maybe cut to the prompt's first rows): the first row, at
/// least the third, from which the error is carried by at least half the rows, itself among
/// them, while every row before it is clean by a factor of `ONSET_CLEAN` — the shape of a
/// position bug that starts there (a shift from position 40 leaves an 8-bit span's first 40
/// rows bit-identical). A correct engine's noise has no such edge: its flips sit in a few
/// rows, an f16 cache's error grows from the second row on. (row, position), or None.
pub fn onset(
    cand: &Candidate,
    key: &TapKey,
    ours: &[f32],
) -> Result<Option<(usize, usize)>, JudgeError> {
    let (Some((t, pos0)), Some([_, b, c])) = (cand.step_shape(key.step), cand.dims(key)) else {
        return Ok(None);
    };
    let width = b * c;
    if key.tap == Tap::KqSoftMax || width == 0 || !ours.len().is_multiple_of(width) {
        return Ok(None);
    }
    let rows = ours.len() / width;
    let theirs = match rows {
        r if r < 3 || r > t => None,
        r if r == t => cand.get(key)?,
        r if cand.in_rows(key) => cand.rows(key, 0..r)?,
        _ => None,
    };
    let Some(theirs) = theirs.filter(|v| v.len() == ours.len()) else {
        return Ok(None);
    };
    let err: Vec<f64> = ours
        .chunks(width)
        .zip(theirs.chunks(width))
        .map(|(a, b)| {
            a.iter()
                .zip(b)
                .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
                .sum::<f64>()
        })
        .collect();
    if err.iter().any(|e| !e.is_finite()) {
        return Ok(None);
    }
    // Running maximum before each row, and the error's sum from each row on.
    let mut after: Vec<f64> = vec![0.0; rows + 1];
    for r in (0..rows).rev() {
        after[r] = after[r + 1] + err[r];
    }
    let mut before = 0.0f64;
    for r in 0..rows {
        let mean = after[r] / (rows - r) as f64;
        if r >= 2 && mean > 0.0 && before <= ONSET_CLEAN * mean && err[r] >= ONSET_CARRY * mean {
            let carried = err[r..]
                .iter()
                .filter(|&&e| e >= ONSET_CARRY * mean)
                .count();
            if 2 * carried >= rows - r {
                return Ok(Some((r, pos0 + r)));
            }
        }
        before = before.max(err[r]);
    }
    Ok(None)
}

/// [`onset`]: the rows before it carry at most this fraction of the mean error from it on.
const ONSET_CLEAN: f64 = 1e-6;
/// [`onset`]: a row carries the error from a fraction of the mean error from the onset on.
const ONSET_CARRY: f64 = 1e-2;

/// Where `j`'s finding first shows, token-wise: at the key it is placed at (its floor), else at
/// the flagged key. A decode step has one row, its position.
pub fn locate(
    model: &Model,
    cand: &Candidate,
    j: &Judgement,
) -> Result<Option<Position>, JudgeError> {
    let Some(f) = &j.first else { return Ok(None) };
    let mut keys = vec![f.key];
    if f.flagged != f.key {
        keys.push(f.flagged);
    }
    let mut found: Vec<Position> = Vec::new();
    let mut i = 0;
    while let Some(&key) = keys.get(i) {
        i += 1;
        let Some((rows, pos0)) = cand.step_shape(key.step) else {
            continue;
        };
        let token = |row: usize| {
            cand.trace
                .manifest
                .steps
                .iter()
                .find(|s| s.step == key.step)
                .and_then(|s| s.tokens.get(row).copied())
                .unwrap_or(0)
        };
        if rows == 1 {
            return Ok(Some(Position {
                position: pos0,
                row: 0,
                rows,
                token: token(0),
                cut_from: false,
            }));
        }
        // Probabilities cut to some rows: the attention output after them (whole, fed by them
        // and `v`) shows the rows they left out.
        let after = TapKey::new(key.step, key.layer, Tap::KqvOut);
        let cut = cand.cut(&key).is_some();
        if cut && cand.contains(&after) {
            keys.push(after);
        }
        // The attention output after a cut key is read at its own floor, as the cut key's op.
        let Some(op) = j
            .ops
            .iter()
            .find(|o| o.key == key)
            .or_else(|| j.ops.iter().find(|o| o.key == f.key))
        else {
            continue;
        };
        let Some(dims) = cand.dims(&key) else {
            continue;
        };
        let rounding = j
            .ties
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(j.rounding, |(_, twin)| *twin);
        let setup = Setup {
            decode: j.decode_rounding,
            output: j.output_rounding,
            kv: j.kv,
            kv_decode: j.kv_decode,
            ..Setup::clean(rounding, Window::for_key(cand, &key))
        };
        let keep: BTreeSet<TapKey> = [key].into();
        let Some(ours) = replay(model, cand, &setup, &keep)?.kept.remove(&key) else {
            continue;
        };
        let Some(theirs) = cand.get_over(&key, &ours)? else {
            continue;
        };
        if let Some(row) = first_row(&ours, &theirs, dims, key.tap, op.floor) {
            let kept_from = cand
                .cut(&key)
                .and_then(|c| c.row_index(pos0, rows).first().copied())
                .filter(|&r| r > 0);
            found.push(Position {
                position: pos0 + row,
                row,
                rows,
                token: token(row),
                cut_from: kept_from == Some(row),
            });
            if !cut {
                break;
            }
        }
    }
    // The earliest row read (a cut key's, or the attention output's after it).
    Ok(found.into_iter().min_by_key(|p| (p.row, p.cut_from)))
}
