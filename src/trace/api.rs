//! Instrument an engine in a few lines: a trace writer with three calls.
//!
//! ```no_run
//! use parity::trace::api::TraceWriter;
//! # fn main() -> Result<(), parity::trace::TraceError> {
//! let mut w = TraceWriter::create("my-trace", "model.gguf", "my-engine", "cpu")?;
//! let (n_embd, n_vocab) = (64, 512);
//! // The prefill: the ids fed and their positions.
//! w.step(&[1, 415, 2936], &[0, 1, 2])?;
//! // Inside the forward, wherever the engine has the tensor (numpy shape, token axis first):
//! let x = vec![0.0f32; 3 * n_embd];
//! w.tap(None, "embd", &[3, n_embd], &x)?;
//! w.tap(0, "attn_norm", &[3, n_embd], &x)?;
//! // … every tap the engine has, then each decode step:
//! w.step(&[9060], &[3])?;
//! w.tap(None, "logits", &[1, n_vocab], &vec![0.0; n_vocab])?;
//! w.finish()?; // writes manifest.json
//! # Ok(()) }
//! ```
//!
//! Tap names and shapes are docs/trace-format.md's; an unknown name, a layer on a graph-wide tap
//! (or none on a per-layer one), a shape that does not hold the data, a first axis that is not
//! the step's token count, or a tap recorded twice is refused with a [`TraceError`] naming it.

use super::format::{self, TraceError};
use super::{Manifest, ModelRef, Producer, Sink, StepInfo, Tap, TapFilter, TapKey};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Writes a trace folder (`.npy` per tap + `manifest.json`) from an engine's own loop.
pub struct TraceWriter {
    dir: PathBuf,
    inner: format::TraceWriter,
    model: ModelRef,
    producer: Producer,
    steps: Vec<StepInfo>,
    seen: HashSet<TapKey>,
}

fn bad(dir: &Path, what: String) -> TraceError {
    TraceError::BadTensor {
        path: dir.display().to_string(),
        what,
    }
}

impl TraceWriter {
    /// Start a trace in `dir` (created; a previous trace there is replaced) for the GGUF file at
    /// `model` (its sha256 is recorded so that `parity diff` refuses a golden of another file),
    /// produced by `engine` on `backend`.
    pub fn create(
        dir: impl AsRef<Path>,
        model: impl AsRef<Path>,
        engine: &str,
        backend: &str,
    ) -> Result<TraceWriter, TraceError> {
        let m = model.as_ref();
        let (sha256, size) = super::open::sha256_file(m).map_err(|source| TraceError::Io {
            path: m.display().to_string(),
            source,
        })?;
        let model = ModelRef {
            path: m.display().to_string(),
            sha256,
            size: Some(size),
        };
        Self::with_model(dir, model, engine, backend)
    }

    /// As [`TraceWriter::create`] with the model given by path and hex sha256 (`""` to skip
    /// parity's same-model check).
    pub fn with_model(
        dir: impl AsRef<Path>,
        model: ModelRef,
        engine: &str,
        backend: &str,
    ) -> Result<TraceWriter, TraceError> {
        let dir = dir.as_ref().to_path_buf();
        Ok(TraceWriter {
            inner: format::TraceWriter::create(&dir, TapFilter::all(), true)?,
            dir,
            model,
            producer: Producer {
                name: engine.into(),
                backend: backend.into(),
                version: String::new(),
                settings: serde_json::Value::Null,
            },
            steps: Vec::new(),
            seen: HashSet::new(),
        })
    }

    /// Record the engine's version and free-form settings in the manifest.
    pub fn set_producer(&mut self, version: &str, settings: serde_json::Value) {
        self.producer.version = version.into();
        self.producer.settings = settings;
    }

    /// Begin a step: the prefill (step 0) with all prompt ids, then one call per decode step.
    pub fn step(&mut self, tokens: &[u32], positions: &[usize]) -> Result<usize, TraceError> {
        if tokens.is_empty() || tokens.len() != positions.len() {
            return Err(bad(
                &self.dir,
                format!(
                    "step {}: {} tokens and {} positions (need the same, at least one)",
                    self.steps.len(),
                    tokens.len(),
                    positions.len()
                ),
            ));
        }
        let step = self.steps.len();
        self.steps.push(StepInfo {
            step,
            tokens: tokens.to_vec(),
            positions: positions.to_vec(),
            forced: None,
        });
        Ok(step)
    }

    /// Record one tensor of the current step. `layer`: `None` (or leave out with `None`) for
    /// `embd`, `result_norm`, `logits`; the layer index for every other tap. `shape` is the numpy
    /// shape (token axis first; `kq_soft_max` is `[n_head, T, n_kv]`), `data` in C order.
    pub fn tap(
        &mut self,
        layer: impl Into<Option<usize>>,
        name: &str,
        shape: &[usize],
        data: &[f32],
    ) -> Result<(), TraceError> {
        let layer = layer.into();
        let Some(s) = self.steps.last() else {
            return Err(bad(
                &self.dir,
                format!("tap '{name}' before the first step() call"),
            ));
        };
        let tap = Tap::parse(name).ok_or_else(|| {
            bad(
                &self.dir,
                format!("unknown tap '{name}' (docs/trace-format.md lists them)"),
            )
        })?;
        if tap.per_layer() != layer.is_some() {
            return Err(bad(
                &self.dir,
                format!(
                    "tap '{name}' {} a layer",
                    if tap.per_layer() {
                        "needs"
                    } else {
                        "cannot have"
                    }
                ),
            ));
        }
        let key = TapKey::new(s.step, layer, tap);
        let n: Option<usize> = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if n != Some(data.len()) {
            return Err(bad(
                &self.dir,
                format!("{key}: shape {shape:?} does not hold {} values", data.len()),
            ));
        }
        let t_axis = if tap == Tap::KqSoftMax { 1 } else { 0 };
        if shape.get(t_axis) != Some(&s.tokens.len()) {
            return Err(bad(
                &self.dir,
                format!(
                    "{key}: shape {shape:?} should have the step's {} tokens on axis {t_axis} (numpy shape = ggml ne reversed)",
                    s.tokens.len()
                ),
            ));
        }
        if !self.seen.insert(key) {
            return Err(bad(&self.dir, format!("{key} recorded twice")));
        }
        self.inner.record(key, shape, data);
        Ok(())
    }

    /// Write manifest.json; reports the first file error met while recording.
    pub fn finish(self) -> Result<Manifest, TraceError> {
        self.inner.finish(self.model, self.producer, self.steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Trace;

    #[test]
    fn writes_a_trace_parity_reads_and_refuses_bad_taps() {
        let dir = tempfile::tempdir().unwrap();
        let model = ModelRef {
            path: "m.gguf".into(),
            sha256: String::new(),
            size: None,
        };
        let mut w = TraceWriter::with_model(dir.path(), model, "toy", "cpu").unwrap();
        assert!(
            w.tap(None, "embd", &[1, 2], &[0.0, 1.0]).is_err(),
            "no step yet"
        );
        w.step(&[1, 2], &[0, 1]).unwrap();
        w.tap(None, "embd", &[2, 2], &[0.0, 1.0, 2.0, 3.0]).unwrap();
        let e = |r: Result<(), TraceError>| r.unwrap_err().to_string();
        assert!(e(w.tap(0, "embd", &[2, 2], &[0.0; 4])).contains("cannot have a layer"));
        assert!(e(w.tap(None, "q", &[2, 2], &[0.0; 4])).contains("needs a layer"));
        assert!(e(w.tap(0, "qq", &[2, 2], &[0.0; 4])).contains("unknown tap"));
        assert!(e(w.tap(0, "l_out", &[2, 3], &[0.0; 4])).contains("does not hold"));
        assert!(e(w.tap(0, "l_out", &[4, 1], &[0.0; 4])).contains("2 tokens on axis 0"));
        assert!(e(w.tap(None, "embd", &[2, 2], &[0.0; 4])).contains("twice"));
        w.tap(0, "kq_soft_max", &[1, 2, 2], &[1.0, 0.0, 0.5, 0.5])
            .unwrap();
        w.step(&[3], &[2]).unwrap();
        w.tap(0, "l_out", &[1, 2], &[5.0, 6.0]).unwrap();
        let m = w.finish().unwrap();
        assert_eq!(m.tensors.len(), 3);
        let t = Trace::open(dir.path()).unwrap();
        assert_eq!(t.manifest.steps[1].tokens, vec![3]);
        let got = t.get(&TapKey::new(1, Some(0), Tap::LOut)).unwrap().unwrap();
        assert_eq!(got.iter().copied().collect::<Vec<_>>(), vec![5.0, 6.0]);
    }
}
