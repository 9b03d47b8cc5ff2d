//! One backend's run written as a trace: the library call behind `parity dump`, and the one
//! selftest makes for parity's own engine. The ids a golden fed, replayed as it fed them; the
//! ids an engine with a token bug feeds; the run; the manifest naming its producer.

use super::mutation::{self, Mutation};
use super::{Backend, BackendError, run, run_steps};
use crate::model::Model;
use crate::trace::{Manifest, ModelRef, Producer, Trace, TraceError, TraceWriter};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The ids cannot carry what was asked (a token bug on a prompt without BOS).
    #[error("{0}")]
    Ids(String),
}

/// What a run feeds after its prompt.
#[derive(Clone, Debug, PartialEq)]
pub enum Feed {
    /// `n` decode steps of one id each: the greedy one, or the forced one.
    Steps { n: usize, forced: Option<Vec<u32>> },
    /// Later chunks as a golden fed them (a prompt fed in parts, further turns).
    Chunks(Vec<Vec<u32>>),
}

impl Feed {
    /// The ids fed after the prompt (the context they take beyond it).
    pub fn n_ids(&self) -> usize {
        match self {
            Feed::Steps { n, .. } => *n,
            Feed::Chunks(c) => c.iter().map(Vec::len).sum(),
        }
    }
}

/// A golden's ids as it fed them: its prompt, then its decode ids forced one a step, or its
/// later chunks where a step fed more than one. `None` when it has no prompt ids.
pub fn replay(golden: &Trace) -> Option<(Vec<u32>, Feed)> {
    let steps = &golden.manifest.steps;
    let prompt = steps.first().map(|s| s.tokens.clone())?;
    if prompt.is_empty() {
        return None;
    }
    let later: Vec<Vec<u32>> = steps[1..].iter().map(|s| s.tokens.clone()).collect();
    let feed = if later.iter().any(|t| t.len() != 1) {
        Feed::Chunks(later)
    } else {
        let forced = golden.manifest.decode_tokens();
        Feed::Steps {
            n: forced.len(),
            forced: Some(forced),
        }
    };
    Some((prompt, feed))
}

/// The ids an engine with bug `m` feeds: BOS dropped or doubled for a token bug, the ids
/// unchanged otherwise. Refused when the prompt does not start with the model's BOS (the bug
/// cannot show then).
pub fn mutate_ids(ids: &[u32], m: Mutation, model: &Model) -> Result<Vec<u32>, DumpError> {
    let bos = mutation::bos_id(model);
    let starts = bos.is_some() && ids.first().copied() == bos;
    match m {
        Mutation::NoBos | Mutation::DoubleBos if !starts => Err(DumpError::Ids(format!(
            "--mutate {m}: the prompt ids do not start with the model's BOS ({})",
            bos.map_or("it has none".to_string(), |b| b.to_string())
        ))),
        Mutation::NoBos if ids.len() < 2 => Err(DumpError::Ids(
            "--mutate no-bos: the prompt is BOS alone".into(),
        )),
        Mutation::NoBos => Ok(ids[1..].to_vec()),
        Mutation::DoubleBos => Ok([&ids[..1], ids].concat()),
        _ => Ok(ids.to_vec()),
    }
}

/// The producer of a trace made by `backend`; its activation rounding is recorded in the
/// settings so that no reader has to guess it from the backend's name.
pub fn producer(backend: &dyn Backend, settings: serde_json::Value) -> Producer {
    let mut settings = match settings {
        serde_json::Value::Object(m) => m,
        _ => serde_json::Map::new(),
    };
    settings.insert("rounding".into(), backend.rounding().name().into());
    Producer {
        name: "parity".into(),
        backend: backend.name(),
        version: env!("CARGO_PKG_VERSION").into(),
        settings: settings.into(),
    }
}

/// The model a trace was made from, as its manifest names it.
pub fn model_ref(path: &Path, model: &Model) -> ModelRef {
    ModelRef {
        path: path.display().to_string(),
        sha256: model.sha256().to_string(),
        size: Some(model.file.bytes().len() as u64),
    }
}

/// Run `backend` over `prompt` and `feed`, recording into `sink`, and finish the trace: its
/// manifest names `model` and the backend (with `settings`, its rounding added).
pub fn write(
    backend: &mut dyn Backend,
    prompt: &[u32],
    feed: &Feed,
    mut sink: TraceWriter,
    model: ModelRef,
    settings: serde_json::Value,
) -> Result<Manifest, DumpError> {
    let info = match feed {
        Feed::Steps { n, forced } => run(backend, prompt, *n, forced.as_deref(), &mut sink)?,
        Feed::Chunks(later) => run_steps(backend, prompt, later, &mut sink)?,
    };
    Ok(sink.finish(model, producer(backend, settings), info)?)
}
