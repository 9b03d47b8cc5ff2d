//! Spans: which ops the reference must recompute to reproduce a key from the candidate's own
//! taps. A key whose inputs the candidate dumped is judged on its own (a span of one); one
//! whose inputs it did not dump is judged as the smallest chain of ops back to taps it has.
//! This decides the granularity of every verdict (op, layer, multi-layer).

use super::replay::Candidate;
use crate::trace::TapKey;
use std::collections::BTreeSet;

/// The ops recomputed to reproduce `k` from the candidate's own taps: `k`'s op and, for each
/// input the candidate did not dump, that input's span. `{k}` when `k` is judged on its own.
pub fn span(cand: &Candidate, k: &TapKey) -> BTreeSet<TapKey> {
    let steps = cand.steps();
    let mut out = BTreeSet::new();
    let mut todo = vec![*k];
    while let Some(x) = todo.pop() {
        if !out.insert(x) {
            continue;
        }
        for i in crate::arch::tap_inputs(&cand.config, &x, &steps) {
            if !cand.contains(&i) {
                todo.push(i);
            }
        }
    }
    out
}
