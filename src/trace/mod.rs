//! Tap names, the Sink a backend writes to, and the on-disk trace format (npy + manifest.json).
//! See docs/trace-format.md.

mod format;
mod taps;

pub use format::{
    Manifest, ModelRef, Producer, StepInfo, TensorEntry, Trace, TraceError, TraceWriter,
};
pub use taps::{Tap, TapKey};

use ndarray::{ArrayD, IxDyn};
use regex::Regex;
use std::collections::BTreeMap;

/// Where a backend hands its tap tensors. The sink decides what is kept; a backend asks
/// `wants` first so that a run without taps does no extra work (no copies, no reshapes).
pub trait Sink {
    fn wants(&self, key: &TapKey) -> bool;
    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]);
}

/// Record `data` under `(step, layer, tap)` if the sink wants it.
#[inline]
pub fn tap(
    sink: &mut dyn Sink,
    step: usize,
    layer: Option<usize>,
    tap: Tap,
    shape: &[usize],
    data: &[f32],
) {
    let key = TapKey::new(step, layer, tap);
    if sink.wants(&key) {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len(), "{key}");
        sink.record(key, shape, data);
    }
}

/// Keeps nothing.
pub struct NullSink;

impl Sink for NullSink {
    fn wants(&self, _: &TapKey) -> bool {
        false
    }
    fn record(&mut self, _: TapKey, _: &[usize], _: &[f32]) {}
}

/// Which taps to keep: all, or those whose name (`attn_norm-3`, `logits`) matches a regex.
#[derive(Clone, Debug, Default)]
pub struct TapFilter(Option<Regex>);

impl TapFilter {
    pub fn all() -> Self {
        TapFilter(None)
    }

    pub fn regex(re: &str) -> Result<Self, regex::Error> {
        Ok(TapFilter(Some(Regex::new(re)?)))
    }

    pub fn matches(&self, key: &TapKey) -> bool {
        match &self.0 {
            None => true,
            Some(re) => re.is_match(&key.name()),
        }
    }
}

/// Keeps the wanted taps in memory as ndarray tensors.
#[derive(Default)]
pub struct MemorySink {
    pub filter: TapFilter,
    pub tensors: BTreeMap<TapKey, ArrayD<f32>>,
}

impl MemorySink {
    pub fn new(filter: TapFilter) -> Self {
        MemorySink {
            filter,
            tensors: BTreeMap::new(),
        }
    }
}

impl Sink for MemorySink {
    fn wants(&self, key: &TapKey) -> bool {
        self.filter.matches(key)
    }
    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]) {
        let a = ArrayD::from_shape_vec(IxDyn(shape), data.to_vec()).expect("shape matches data");
        self.tensors.insert(key, a);
    }
}
