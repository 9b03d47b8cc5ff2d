//! The zoom after a scan. A finding judged as a span (the trace has no taps inside it, as in a
//! scan that keeps `l_out`, `result_norm` and `logits`) is named op by op once its step is
//! recorded whole: this says which step, and the recording plan (`parity_trace::Record`) that
//! keeps the scan and adds that step, for `--record` or an engine's `PARITY_RECORD`. A step
//! after the first also keeps `k_rope` and `v` at every step: its attention reads the K/V the
//! earlier steps wrote, and without them `kq_soft_max` there is still a span. A step of more
//! than [`WHOLE_ROWS`] tokens keeps `kq_soft_max` for the rows from the first position out of
//! its floor on ([`PROBS_ROWS`] of them, `kq_rows`), and every tap of the layers that can hold
//! the fault alone (`layers`): a 2,048-token prompt whole is 18.6 GB on a 1.1B shape (11.8 GB
//! of it the probabilities), one layer with 16 rows of probabilities about 300 MB.

use super::Finding;
use super::replay::Candidate;
use crate::trace::{Record, Tap, Trace, Zoom};

/// A step of at most this many tokens keeps its whole probabilities in a zoom.
pub const WHOLE_ROWS: usize = 64;
/// The rows of the probabilities a longer step keeps: from the first position out on.
pub const PROBS_ROWS: usize = 16;

/// The zoom `f` needs, if it was judged as a span at a step the trace did not record whole.
pub fn plan(cand: &Candidate, f: &Finding) -> Option<Zoom> {
    if f.span_ops <= 1 {
        return None;
    }
    // Own inputs: the layer flagged is the layer at fault (each is replayed from the one
    // before), so a long step keeps that layer alone.
    step(
        cand.trace,
        f.key.step,
        f.position.map(|p| p.position),
        f.key.layer.map(|l| l..=l),
    )
}

/// The zoom that records `step` of `trace` whole, the scan kept; None where the trace already
/// has every tap its producer can give there (and the cache before it). `at`: the first
/// position out of its floor there, where known (a long step keeps the probabilities' rows
/// from it on); `layers`: the layers that can hold the fault (a long step keeps them alone).
pub fn step(
    trace: &Trace,
    step: usize,
    at: Option<usize>,
    layers: Option<std::ops::RangeInclusive<usize>>,
) -> Option<Zoom> {
    let earlier = step > 0;
    let keeps_cache = |r: &Record| {
        r.taps
            .as_ref()
            .is_none_or(|t| t.contains(&Tap::KRope) && t.contains(&Tap::V))
    };
    // A long step's probabilities: the rows from the first position out on.
    let rows = trace.manifest.steps.get(step).and_then(|s| {
        let last = s.positions[0] + s.tokens.len() - 1;
        at.filter(|_| s.tokens.len() > WHOLE_ROWS)
            .map(|p| p.min(last)..=(p + PROBS_ROWS - 1).min(last))
    });
    let keeps_rows = |r: &Record| match (&r.kq_rows, &rows) {
        (None, _) => true,
        (Some(kept), Some(want)) => kept.iter().any(|k| k.contains(want.start())),
        (Some(_), None) => false,
    };
    let long = trace
        .manifest
        .steps
        .get(step)
        .is_some_and(|s| s.tokens.len() > WHOLE_ROWS);
    let layers = layers.filter(|_| long);
    let keeps_layers = |r: &Record| {
        layers
            .as_ref()
            .is_none_or(|ls| ls.clone().all(|l| r.whole_at(step, Some(l))))
    };
    let recorded = trace.manifest.record.as_deref().map(Record::parse);
    let mut plan = match recorded {
        // The producer already kept every tap it has at that step (and the cache before it):
        // asking again adds nothing.
        Some(Ok(r))
            if (r.taps.is_none()
                || (r.full_step(step) && keeps_layers(&r) && (!earlier || keeps_cache(&r))))
                && keeps_rows(&r) =>
        {
            return None;
        }
        Some(Ok(r)) => r,
        // No plan (or one parity cannot read): the scan is the taps the step has.
        _ => Record {
            taps: Some(
                trace
                    .keys()
                    .filter(|k| k.step == step)
                    .map(|k| k.tap)
                    .collect(),
            ),
            ..Record::default()
        },
    };
    if earlier && let Some(t) = &mut plan.taps {
        t.extend([Tap::KRope, Tap::V]);
    }
    plan.add_full(step..=step);
    if let Some(r) = rows {
        plan.kq_rows = Some(vec![r]);
    }
    if let Some(l) = layers {
        plan.layers = Some(vec![l]);
    }
    Some(Zoom {
        steps: vec![step],
        record: plan.to_string(),
    })
}
