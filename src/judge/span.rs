//! Spans: which ops the reference must recompute to reproduce a key from the candidate's own
//! taps. A key whose inputs the candidate dumped is judged on its own (a span of one); one
//! whose inputs it did not dump is judged as the smallest chain of ops back to taps it has.
//! This decides the granularity of every verdict (op, layer, multi-layer).

use super::replay::Candidate;
use crate::trace::{Tap, TapKey};
use std::collections::BTreeSet;

/// What the floors read of a span: how many ops it holds and which taps they are. A long
/// trace judges thousands of keys whose spans each hold a decode step's cache writes of every
/// earlier step (a 2,048-token scan's span sets took 180 MB kept whole).
#[derive(Clone, Debug, Default)]
pub struct SpanOps {
    pub len: usize,
    pub taps: BTreeSet<Tap>,
}

impl SpanOps {
    pub fn of(span: &BTreeSet<TapKey>) -> SpanOps {
        SpanOps {
            len: span.len(),
            taps: span.iter().map(|x| x.tap).collect(),
        }
    }
}

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
