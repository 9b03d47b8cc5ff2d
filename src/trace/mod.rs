//! Tap names, the Sink a backend writes to, and the on-disk trace format (npy + manifest.json).
//! See docs/trace-format.md.

pub mod api;
mod format;
pub mod goldens;
pub mod open;
pub mod paths;
pub mod staging;
mod zoom;

pub use format::{Trace, TraceWriter, is_archive_path};
/// The format itself (manifest, tap names, `.npy`, archives) is the `parity-trace` crate's,
/// which engines depend on alone.
pub use parity_trace::{
    Cut, Cutting, Error as TraceError, Manifest, ModelRef, Producer, Record, Side, StepInfo, Tap,
    TapKey, TensorEntry, npy,
};
pub use zoom::Zoom;

use ndarray::{ArrayD, IxDyn};
use regex::Regex;
use std::collections::BTreeMap;

/// Where a backend hands its tap tensors. The sink decides what is kept; a backend asks
/// `wants` first so that a run without taps does no extra work (no copies, no reshapes).
pub trait Sink {
    fn wants(&self, key: &TapKey) -> bool;
    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]);
    /// Op-by-op mode: overwrite `data` with the tensor the backend must continue from (a
    /// baseline's value for the same tap). Returns whether it did. Default: never.
    fn substitute(&mut self, _key: &TapKey, _data: &mut [f32]) -> bool {
        false
    }
    /// Whether `substitute` may replace the tensor at `key` (so that a device backend reads a
    /// tap back only when the sink wants it or replays it). Default: never.
    fn replays(&self, _key: &TapKey) -> bool {
        false
    }
    /// Whether this sink takes `key` a slice of rows at a time through
    /// [`Sink::record_rows`], and at most how many values a slice: the forward then computes
    /// a prompt's logits a slice of rows at a time and never holds them whole. Such a tap is
    /// not substituted. Default: None (whole).
    fn row_slice(&self, _key: &TapKey) -> Option<usize> {
        None
    }
    /// Rows `row0..` of the tap `key` whose whole shape is `shape` (rows on its first axis):
    /// the slices come in order, the last one ending at `shape[0]`. Called only where
    /// [`Sink::row_slice`] says so.
    fn record_rows(&mut self, key: TapKey, _shape: &[usize], _row0: usize, _data: &[f32]) {
        unreachable!("{key} handed over in rows to a sink that does not take them")
    }
    /// Member `i`'s own sink, for a sink made of one per member of a lockstep run
    /// (`backend::lockstep::Fanout`). Default: none.
    fn member(&mut self, _i: usize) -> Option<&mut dyn Sink> {
        None
    }
}

/// Values per slice of a tap handed over in rows (16 MB of f32): a 2,048-row prompt's
/// 32,000-wide logits are made and compared 128 rows at a time. `PARITY_ROW_SLICE_VALUES`
/// sets another size (the tests' way to cut a fixture's logits into many slices).
pub fn row_slice_values() -> usize {
    static VALUES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *VALUES.get_or_init(|| {
        std::env::var("PARITY_ROW_SLICE_VALUES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1 << 22)
    })
}

/// Rows per slice of at most `values` values for rows `row_width` wide: a multiple of 4, so
/// that every slice but the last holds a multiple of 4 values (their metrics then sum as the
/// whole tensor's), at least 4.
pub fn rows_per_slice(values: usize, row_width: usize) -> usize {
    (values / row_width.max(1) / 4 * 4).max(4)
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

/// [`tap`] for a tensor the backend goes on computing from: after recording, a replaying
/// sink may replace it with the baseline's value, so each op is judged on identical inputs.
#[inline]
pub fn tap_mut(
    sink: &mut dyn Sink,
    step: usize,
    layer: Option<usize>,
    tap: Tap,
    shape: &[usize],
    data: &mut [f32],
) {
    let key = TapKey::new(step, layer, tap);
    if sink.wants(&key) {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len(), "{key}");
        sink.record(key, shape, data);
    }
    sink.substitute(&key, data);
}

/// Records like a [`MemorySink`] and feeds the backend the baseline's tensor at every tap the
/// baseline has: the backend's ops then run op by op on the baseline's inputs. A 1e-13
/// difference can no longer flip an activation across a quantization boundary and compound,
/// so each op is judged at the f32 floor.
pub struct ReplaySink<'a> {
    pub base: &'a Trace,
    pub inner: MemorySink,
    pub error: Option<TraceError>,
}

impl<'a> ReplaySink<'a> {
    pub fn new(base: &'a Trace) -> Self {
        ReplaySink {
            base,
            inner: MemorySink::new(TapFilter::all()),
            error: None,
        }
    }
}

impl Sink for ReplaySink<'_> {
    fn wants(&self, key: &TapKey) -> bool {
        self.base.contains(key)
    }
    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]) {
        // Kept as the baseline cut it (all that is compared; a long prompt's whole
        // probabilities would not fit).
        match (self.base.cut(&key), shape) {
            (Some(c), &[h, t, n]) => {
                let (sh, v) = c.select([h, t, n], n - t, data);
                self.inner.record(key, &sh, &v);
                self.inner.cuts.insert(key, c);
            }
            _ => self.inner.record(key, shape, data),
        }
    }
    fn replays(&self, key: &TapKey) -> bool {
        // A cut tensor cannot stand in for the whole one: the backend goes on from its own.
        self.base.contains(key) && self.base.cut(key).is_none()
    }
    fn substitute(&mut self, key: &TapKey, data: &mut [f32]) -> bool {
        match self.base.get(key) {
            Ok(Some(a)) if a.len() == data.len() => {
                for (d, s) in data.iter_mut().zip(a.iter()) {
                    *d = *s;
                }
                true
            }
            Ok(_) => false,
            Err(e) => {
                self.error.get_or_insert(e);
                false
            }
        }
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

/// Which taps to keep: all, those whose name (`attn_norm-3`, `logits`) matches a regex, and
/// a recording plan (`parity_trace::Record`: a scan's taps at every step, whole steps).
#[derive(Clone, Debug, Default)]
pub struct TapFilter {
    re: Option<Regex>,
    record: Option<Record>,
}

impl TapFilter {
    pub fn all() -> Self {
        TapFilter::default()
    }

    pub fn regex(re: &str) -> Result<Self, regex::Error> {
        Ok(TapFilter {
            re: Some(Regex::new(re)?),
            record: None,
        })
    }

    /// Also keep to `plan`: a step it records whole keeps every tap, whatever the regex says.
    pub fn with_record(self, plan: Option<Record>) -> Self {
        TapFilter {
            record: plan,
            ..self
        }
    }

    /// The plan, for the manifest.
    pub fn record(&self) -> Option<&Record> {
        self.record.as_ref()
    }

    /// What the plan keeps of `key`'s tensor (`kq_soft_max` `[n_head, T, n_kv]` of a step
    /// from position `n_kv - T` is the one tap a plan cuts).
    pub fn cut(&self, key: &TapKey, shape: &[usize], data: &[f32]) -> Cutting {
        match (&self.record, key.tap, shape) {
            (Some(r), Tap::KqSoftMax, &[h, t, n]) if n >= t => r.cut_probs([h, t, n], n - t, data),
            _ => Cutting::Whole,
        }
    }

    pub fn matches(&self, key: &TapKey) -> bool {
        if let Some(r) = &self.record {
            if r.whole_at(key.step, key.layer) {
                return true;
            }
            if !r.keeps(key.step, key.layer, key.tap) {
                return false;
            }
        }
        match &self.re {
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
    /// The tensors kept cut (the plan's `kq_heads`/`kq_rows`): what each kept
    /// ([`Trace::with_cuts`]).
    pub cuts: BTreeMap<TapKey, Cut>,
    /// Takes the logits in slices of at most this many values, put together here per tap
    /// (a soft-capped model's two logits taps come interleaved) (`in_rows`).
    rows: Option<(usize, BTreeMap<TapKey, Vec<f32>>)>,
}

impl MemorySink {
    pub fn new(filter: TapFilter) -> Self {
        MemorySink {
            filter,
            ..Default::default()
        }
    }

    /// This sink taking the logits in slices of at most `values` values (what a forward
    /// computing them a slice of rows at a time hands over), whole tensors kept as ever.
    pub fn in_rows(self, values: usize) -> Self {
        MemorySink {
            rows: Some((values, BTreeMap::new())),
            ..self
        }
    }
}

impl Sink for MemorySink {
    fn wants(&self, key: &TapKey) -> bool {
        self.filter.matches(key)
    }
    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]) {
        let (shape, data) = match self.filter.cut(&key, shape, data) {
            Cutting::Whole => (shape.to_vec(), data.to_vec()),
            Cutting::Nothing => return,
            Cutting::Kept(c, sh, v) => {
                self.cuts.insert(key, c);
                (sh.to_vec(), v)
            }
        };
        let a = ArrayD::from_shape_vec(IxDyn(&shape), data).expect("shape matches data");
        self.tensors.insert(key, a);
    }
    fn row_slice(&self, key: &TapKey) -> Option<usize> {
        let (values, _) = self.rows.as_ref()?;
        matches!(key.tap, Tap::Logits | Tap::LogitsUncapped).then_some(*values)
    }
    fn record_rows(&mut self, key: TapKey, shape: &[usize], row0: usize, data: &[f32]) {
        let (_, parts) = self.rows.as_mut().expect("takes rows");
        let whole = parts.entry(key).or_default();
        if row0 == 0 {
            whole.clear();
        }
        whole.extend_from_slice(data);
        if whole.len() == shape.iter().product::<usize>() {
            let data = parts.remove(&key).expect("entered above");
            let a = ArrayD::from_shape_vec(IxDyn(shape), data).expect("shape matches data");
            self.tensors.insert(key, a);
        }
    }
}

/// Each step of `t` as (step, first position, token count): the run's shape, which the
/// position bugs' places and the judge's fitted widths read.
pub fn step_shapes(t: &Trace) -> Vec<(usize, usize, usize)> {
    t.manifest
        .steps
        .iter()
        .map(|s| {
            (
                s.step,
                s.positions.first().copied().unwrap_or(0),
                s.tokens.len(),
            )
        })
        .collect()
}
