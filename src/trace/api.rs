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

//! The writer is the `parity-trace` crate's (one implementation of the format): an engine that
//! wants only the writer depends on that crate alone, which builds for wasm32 too.

pub use parity_trace::TraceWriter;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{ModelRef, Tap, TapKey, Trace, TraceError};

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

    /// A wasm engine's trace: one `.npz` archive, read as a folder is; a damaged or
    /// compressed one refused in one line.
    #[test]
    fn an_archive_reads_as_its_folder_does() {
        let model = ModelRef {
            path: "m.gguf".into(),
            sha256: String::new(),
            size: None,
        };
        let dir = tempfile::tempdir().unwrap();
        let mut w = TraceWriter::in_memory(model, "toy", "wasm");
        w.step(&[1, 2], &[0, 1]).unwrap();
        w.tap(None, "embd", &[2, 2], &[0.0, 1.0, 2.0, 3.0]).unwrap();
        w.tap(0, "kq_soft_max", &[1, 2, 2], &[1.0, 0.0, 0.5, 0.5])
            .unwrap();
        let bytes = w.finish_archive().unwrap();
        let path = dir.path().join("t.npz");
        std::fs::write(&path, &bytes).unwrap();
        let t = Trace::open(&path).unwrap();
        assert_eq!(t.manifest.producer.backend, "wasm");
        let got = t
            .get(&TapKey::new(0, Some(0), Tap::KqSoftMax))
            .unwrap()
            .unwrap();
        assert_eq!(got.shape(), &[1, 2, 2]);
        assert_eq!(
            got.iter().copied().collect::<Vec<_>>(),
            vec![1.0, 0.0, 0.5, 0.5]
        );
        // One byte of a tap changed: that tap is refused when read, naming the member.
        let mut bad = bytes.clone();
        let at = bad.len() / 3;
        bad[at] ^= 0x55;
        std::fs::write(&path, &bad).unwrap();
        let e: Result<(), TraceError> = Trace::open(&path).and_then(|t| {
            t.keys()
                .copied()
                .collect::<Vec<_>>()
                .iter()
                .try_for_each(|k| t.get(k).map(|_| ()))
        });
        let e = e.unwrap_err().to_string();
        assert!(e.contains("damaged") && !e.contains('\n'), "{e}");
        std::fs::write(&path, b"PK not really").unwrap();
        let e = Trace::open(&path).err().unwrap().to_string();
        assert!(e.contains("not a trace archive"), "{e}");
    }
}
