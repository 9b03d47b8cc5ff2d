//! The parity trace format: write and read what an inference engine computed, tap by tap, so
//! that `parity diff GOLDEN TRACE` can compare it with llama.cpp.
//!
//! A trace is `manifest.json` plus one little-endian float32 `.npy` per (step, tap, layer),
//! either as a folder or as one uncompressed `.npz` archive (a zip of the same files) — the
//! archive is what an engine without a file system (wasm32 in a browser) hands back.
//!
//! ```no_run
//! use parity_trace::TraceWriter;
//! # fn main() -> Result<(), parity_trace::Error> {
//! let mut w = TraceWriter::create("my-trace", "model.gguf", "my-engine", "cpu")?;
//! let (n_embd, n_vocab) = (64, 512);
//! w.step(&[1, 415, 2936], &[0, 1, 2])?; // the prefill: the golden's ids and their positions
//! let x = vec![0.0f32; 3 * n_embd];
//! w.tap(None, "embd", &[3, n_embd], &x)?; // graph-wide tap: no layer
//! w.tap(0, "attn_norm", &[3, n_embd], &x)?; // per-layer tap: its layer
//! w.step(&[9060], &[3])?; // each decode step
//! w.tap(None, "logits", &[1, n_vocab], &vec![0.0; n_vocab])?;
//! w.finish()?; // writes manifest.json
//! # Ok(()) }
//! ```
//!
//! In memory (wasm32): `TraceWriter::in_memory(model, engine, backend)`, the same calls, then
//! `finish_archive()` returns the `.npz` bytes to save or download.
//!
//! Only serde and serde_json are used, so the crate builds for `wasm32-unknown-unknown`.
//! The format itself is specified in parity's docs/trace-format.md.

pub mod archive;
mod cut;
pub mod manifest;
pub mod npy;
mod record;
pub mod sha256;
mod taps;
mod writer;

pub use cut::{Cut, Cutting, Side};
pub use manifest::{
    FORMAT, GoldenStep, MAX_POSITION, MAX_TAP_ELEMENTS, Manifest, ModelRef, Producer, StepInfo,
    TensorEntry, VERSION, golden_ids, golden_steps,
};
pub use record::{RECORD_ENV, Record};
pub use taps::{Tap, TapKey};
pub use writer::TraceWriter;

/// What went wrong, in one line naming the file or tap.
#[derive(Debug)]
pub enum Error {
    /// A file could not be read or written.
    Io {
        path: String,
        source: std::io::Error,
    },
    /// A manifest that is not one parity reads.
    BadManifest { path: String, what: String },
    /// A tap refused by the writer, or a tensor file that does not hold what the manifest says.
    BadTensor { path: String, what: String },
    /// An output folder that holds something other than a trace.
    NotEmpty(String),
    /// A recording plan (`PARITY_RECORD`) that does not parse.
    BadRecord(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Io { path, source } => write!(f, "{path}: {source}"),
            Error::BadManifest { path, what } => {
                write!(f, "{path}: not a parity trace manifest: {what}")
            }
            Error::BadTensor { path, what } => write!(f, "{path}: {what}"),
            Error::BadRecord(what) => write!(f, "{what}"),
            Error::NotEmpty(p) => write!(
                f,
                "{p}: output folder is not empty (pass --force to overwrite)"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}
