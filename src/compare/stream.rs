//! [`compare`](super::compare) done as the candidate records (a [`Sink`]), for a pass whose
//! trace is too large to hold: each tap is measured against the baseline's as it comes and
//! dropped. Kept: the tensor of the first tap (graph order) out of its threshold, the one the
//! diagnosis reads, and the embeddings, which the rows of ids that do not line up are read
//! from. The result is `compare`'s on the whole trace, field for field.

use super::{
    CompareError, CompareOptions, Comparison, Measured, RowsMeasured, assemble, depth_of,
    first_token_mismatch, judged, measure, same_model,
};
use crate::trace::{ModelRef, Producer, Sink, StepInfo, Tap, TapFilter, TapKey, Trace};
use ndarray::{ArrayD, ArrayViewD, IxDyn};
use std::collections::BTreeMap;

pub struct Streamed<'b> {
    base: &'b Trace,
    opt: CompareOptions,
    filter: TapFilter,
    /// The run's layers, as `compare` counts them: the baseline's deepest layer the candidate
    /// records (a pass of the same model records them all).
    depth: usize,
    measured: BTreeMap<TapKey, Measured>,
    shapes: BTreeMap<TapKey, Vec<usize>>,
    kept: BTreeMap<TapKey, ArrayD<f32>>,
    first_out: Option<TapKey>,
    error: Option<CompareError>,
    /// The tap coming in rows (`Sink::row_slice`).
    partial: Option<Partial>,
}

/// A tap handed over in slices of rows: measured a slice at a time against the baseline's
/// same rows. Its values are kept where the whole tensor fits [`KEEP_VALUES`] (the diagnosis
/// reads the first tap out of its threshold; past that it reads the metrics alone).
struct Partial {
    rows: RowsMeasured,
    kept: Option<Vec<f32>>,
}

/// The most values of a tap handed over in rows kept for a diagnosis (64 MB of f32).
const KEEP_VALUES: usize = 1 << 24;

impl<'b> Streamed<'b> {
    /// Compares what a pass recording `filter` records against `base`.
    pub fn new(base: &'b Trace, opt: CompareOptions, filter: TapFilter) -> Self {
        let depth = depth_of(base.keys().filter(|k| filter.matches(k)));
        Streamed {
            base,
            opt,
            filter,
            depth,
            measured: BTreeMap::new(),
            shapes: BTreeMap::new(),
            kept: BTreeMap::new(),
            first_out: None,
            error: None,
            partial: None,
        }
    }

    /// The candidate's trace (every tap it recorded listed; only the kept tensors held) and
    /// the comparison.
    pub fn finish(
        self,
        model: ModelRef,
        producer: Producer,
        steps: Vec<StepInfo>,
    ) -> (Trace, Result<Comparison, CompareError>) {
        let cand = Trace::from_listed(model, producer, steps, self.shapes, self.kept);
        let compared = match self.error {
            Some(e) => Err(e),
            None => same_model(self.base, &cand, &self.opt).and_then(|()| {
                let tm = first_token_mismatch(self.base, &cand);
                let cut = tm.as_ref().map_or(usize::MAX, |m| m.step);
                let measured = self.measured.into_values().filter(|m| m.key.step < cut);
                assemble(self.base, &cand, &self.opt, tm, measured.collect())
            }),
        };
        (cand, compared)
    }

    fn measure(&mut self, key: TapKey, b: ArrayViewD<f32>) -> Result<bool, CompareError> {
        let Some(a) = self.base.get_once(&key)? else {
            return Ok(false);
        };
        let m = match super::measure_cut(self.base, key, &a, None, b.view()) {
            super::CutMeasure::Whole => measure(key, &a, b)?,
            super::CutMeasure::Shared(m) => m,
            super::CutMeasure::Disjoint => return Ok(false),
        };
        Ok(self.enter(m))
    }

    /// Enter a measured tap; whether it is out of its threshold.
    fn enter(&mut self, m: Measured) -> bool {
        let key = m.key;
        let (_, _, pass) = judged(&self.opt, &key, &m.metrics, self.depth);
        self.measured.insert(key, m);
        !pass
    }

    /// Keep `key`'s tensor if it is the earliest out of its threshold so far (graph order:
    /// taps arrive step by step but not always in graph order within one); `None` where it
    /// was not kept whole.
    fn keep_if_first(&mut self, key: TapKey, tensor: Option<ArrayD<f32>>) {
        if self.first_out.is_none_or(|f| key < f) {
            if let Some(f) = self.first_out.replace(key)
                && f.tap != Tap::Embd
            {
                self.kept.remove(&f);
            }
            if let Some(t) = tensor {
                self.kept.insert(key, t);
            }
        }
    }
}

impl Sink for Streamed<'_> {
    fn wants(&self, key: &TapKey) -> bool {
        self.filter.matches(key)
    }

    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]) {
        self.shapes.insert(key, shape.to_vec());
        if self.error.is_some() {
            return;
        }
        let b = ArrayViewD::from_shape(IxDyn(shape), data).expect("shape matches data");
        let out = match self.measure(key, b.view()) {
            Ok(out) => out,
            Err(e) => {
                self.error = Some(e);
                return;
            }
        };
        if out {
            self.keep_if_first(key, Some(b.to_owned()));
        }
        if key.tap == Tap::Embd {
            self.kept.insert(key, b.to_owned());
        }
    }

    /// The logits: measured a slice of rows at a time.
    fn row_slice(&self, key: &TapKey) -> Option<usize> {
        (key.tap == Tap::Logits && self.filter.matches(key)).then(crate::trace::row_slice_values)
    }

    fn record_rows(&mut self, key: TapKey, shape: &[usize], row0: usize, data: &[f32]) {
        let t = shape.first().copied().unwrap_or(1);
        let width = shape.iter().skip(1).product::<usize>().max(1);
        let n = data.len() / width;
        // A baseline holding the tap in another shape (`[T·n]`) is compared whole, as
        // `compare` reads it: the slices put together first.
        let aligned = self
            .base
            .shape(&key)
            .is_some_and(|s| s.first() == Some(&t) && s.iter().product::<usize>() == t * width);
        if row0 == 0 {
            self.shapes.insert(key, shape.to_vec());
            self.partial = Some(Partial {
                rows: RowsMeasured::new(key, width),
                // Kept only where the whole fits (never part of one, to be dropped later).
                kept: (!aligned || t * width <= KEEP_VALUES).then(Vec::new),
            });
        }
        let Some(p) = self.partial.as_mut() else {
            return;
        };
        if self.error.is_none() && self.base.contains(&key) {
            if aligned {
                match self.base.get_rows(&key, row0..row0 + n) {
                    Ok(Some(a)) if a.len() == data.len() => p.rows.push(&a, data),
                    Ok(_) => {}
                    Err(e) => self.error = Some(e.into()),
                }
            }
            if let Some(k) = &mut p.kept {
                k.extend_from_slice(data);
            }
        }
        if row0 + n < t {
            return;
        }
        let Partial { rows, kept } = self.partial.take().expect("taken above");
        if self.error.is_some() || !self.base.contains(&key) {
            return;
        }
        let whole = kept.map(|k| ArrayD::from_shape_vec(IxDyn(shape), k).expect("whole rows"));
        if !aligned {
            return self.record(
                key,
                shape,
                whole.expect("kept whole").as_slice().expect("own"),
            );
        }
        if self.enter(rows.finish()) {
            self.keep_if_first(key, whole);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::{PairKind, compare};
    use crate::gguf::GgmlType;

    fn opt(pair: PairKind) -> CompareOptions {
        CompareOptions {
            pair,
            weight_type: GgmlType::Q8_0,
            require_same_model: true,
        }
    }

    /// A candidate made of the golden's tensors, `edit` applied to each.
    fn candidate(
        g: &Trace,
        edit: &dyn Fn(&TapKey, &mut ArrayD<f32>),
        steps: Vec<StepInfo>,
    ) -> Trace {
        let tensors = g
            .keys()
            .map(|k| {
                let mut a = g.get(k).unwrap().unwrap();
                edit(k, &mut a);
                (*k, a)
            })
            .collect();
        let producer = Producer {
            name: "parity".into(),
            backend: "fast".into(),
            version: String::new(),
            settings: serde_json::Value::Null,
        };
        Trace::from_memory(g.manifest.model.clone(), producer, steps, tensors)
    }

    /// Streamed tap by tap (each step's taps in reverse graph order, as no backend records
    /// them), the comparison is `compare`'s on the whole trace, field for field: on a clean
    /// candidate, one that leaves its floor at a middle layer of a decode step (the diagnosis
    /// reads the kept tensor), one that is NaN from a layer on, one whose ids differ at a
    /// step (the embedding rows that line up are compared), and between other roundings.
    #[test]
    fn a_streamed_comparison_is_compare_s() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let g = Trace::open(root.join("golden/TinyStories-656K-Q8_0")).unwrap();
        let steps = g.manifest.steps.clone();
        // A prompt id changed: its other rows still line up.
        let mut other_ids = steps.clone();
        other_ids[0].tokens[1] += 1;
        let scale = |at: TapKey, by: f32| {
            move |k: &TapKey, a: &mut ArrayD<f32>| {
                if *k >= at {
                    a.mapv_inplace(|v| v * by);
                }
            }
        };
        let cases: Vec<(&str, Trace, PairKind)> = vec![
            (
                "clean",
                candidate(&g, &|_, _| {}, steps.clone()),
                PairKind::SameRounding,
            ),
            (
                "off at step 2 layer 1",
                candidate(
                    &g,
                    &scale(TapKey::new(2, Some(1), Tap::AttnNorm), 1.5),
                    steps.clone(),
                ),
                PairKind::SameRounding,
            ),
            (
                "NaN from step 1 layer 0",
                candidate(
                    &g,
                    &scale(TapKey::new(1, Some(0), Tap::FfnOut), f32::NAN),
                    steps.clone(),
                ),
                PairKind::DifferentRounding,
            ),
            (
                "other ids",
                candidate(&g, &|_, _| {}, other_ids),
                PairKind::SameRounding,
            ),
        ];
        for (what, cand, pair) in cases {
            let whole = compare(&g, &cand, &opt(pair)).unwrap();
            let mut s = Streamed::new(&g, opt(pair), TapFilter::all());
            for step in 0..cand.manifest.steps.len() {
                let keys: Vec<TapKey> = cand.keys().filter(|k| k.step == step).copied().collect();
                for k in keys.iter().rev() {
                    let a = cand.get(k).unwrap().unwrap();
                    s.record(*k, a.shape(), a.as_slice().unwrap());
                }
            }
            assert!(
                s.kept.len() <= 1 + cand.manifest.steps.len(),
                "{what}: kept {:?}",
                s.kept.keys()
            );
            let (trace, streamed) = s.finish(
                cand.manifest.model.clone(),
                cand.manifest.producer.clone(),
                cand.manifest.steps.clone(),
            );
            let streamed = streamed.unwrap();
            assert_eq!(trace.keys().count(), cand.keys().count(), "{what}");
            assert_eq!(
                serde_json::to_value(&streamed).unwrap(),
                serde_json::to_value(&whole).unwrap(),
                "{what}"
            );
            assert_eq!(whole.diverged(), what != "clean", "{what}");
            if what == "other ids" {
                // The rows that line up, compared from the kept embeddings.
                assert_eq!(whole.results[0].key, TapKey::new(0, None, Tap::Embd));
                assert!(whole.token_mismatch.is_some());
            }
            if what.starts_with("off") {
                // The diagnosis read the kept tensor: a row-wise factor.
                let d = whole.first_divergence.as_ref().unwrap();
                assert_eq!(d.at.key, TapKey::new(2, Some(1), Tap::AttnNorm));
                assert!(
                    d.diagnosis.contains("off by one factor (up to 5.0e-1"),
                    "{}",
                    d.diagnosis
                );
            }
        }
    }
}
