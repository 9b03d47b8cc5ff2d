//! The zoom after a scan. A finding judged as a span (the trace has no taps inside it, as in a
//! scan that keeps `l_out`, `result_norm` and `logits`) is named op by op once its step is
//! recorded whole: this says which step, and the recording plan (`parity_trace::Record`) that
//! keeps the scan and adds that step, for `--record` or an engine's `PARITY_RECORD`. A step
//! after the first also keeps `k_rope` and `v` at every step: its attention reads the K/V the
//! earlier steps wrote, and without them `kq_soft_max` there is still a span.

use super::Finding;
use super::replay::Candidate;
use crate::trace::{Record, Tap, Trace, Zoom};

/// The zoom `f` needs, if it was judged as a span at a step the trace did not record whole.
pub fn plan(cand: &Candidate, f: &Finding) -> Option<Zoom> {
    if f.span_ops <= 1 {
        return None;
    }
    step(cand.trace, f.key.step)
}

/// The zoom that records `step` of `trace` whole, the scan kept; None where the trace already
/// has every tap its producer can give there (and the cache before it).
pub fn step(trace: &Trace, step: usize) -> Option<Zoom> {
    let earlier = step > 0;
    let keeps_cache = |r: &Record| {
        r.taps
            .as_ref()
            .is_none_or(|t| t.contains(&Tap::KRope) && t.contains(&Tap::V))
    };
    let recorded = trace.manifest.record.as_deref().map(Record::parse);
    let mut plan = match recorded {
        // The producer already kept every tap it has at that step (and the cache before it):
        // asking again adds nothing.
        Some(Ok(r)) if r.keeps_all() || (r.full_step(step) && (!earlier || keeps_cache(&r))) => {
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
            full: Vec::new(),
        },
    };
    if earlier && let Some(t) = &mut plan.taps {
        t.extend([Tap::KRope, Tap::V]);
    }
    plan.add_full(step..=step);
    Some(Zoom {
        steps: vec![step],
        record: plan.to_string(),
    })
}
