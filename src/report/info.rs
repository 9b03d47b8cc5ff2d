//! What a report says about the run besides the comparisons: the traces' producers, models and
//! token ids (from their manifests), and the ids decoded when the caller had the tokenizer.

use crate::compare::Comparison;
use crate::trace::{ModelRef, Producer, StepInfo, Trace};

/// One trace as its manifest describes it.
#[derive(Clone, Debug)]
pub struct TraceInfo {
    pub model: ModelRef,
    pub producer: Producer,
    pub steps: Vec<StepInfo>,
    /// How many tap tensors it holds.
    pub tensors: usize,
    /// Each step's ids as text, when the caller decoded them (`cli` holds the tokenizer).
    pub text: Option<Vec<String>>,
}

impl TraceInfo {
    pub fn from_trace(t: &Trace) -> TraceInfo {
        TraceInfo {
            model: t.manifest.model.clone(),
            producer: t.manifest.producer.clone(),
            steps: t.manifest.steps.clone(),
            tensors: t.manifest.tensors.len(),
            text: None,
        }
    }

    /// `name/backend`, as [`Comparison::baseline`] and [`Comparison::candidate`] name traces.
    pub fn label(&self) -> String {
        format!("{}/{}", self.producer.name, self.producer.backend)
    }

    /// All ids fed, prefill then decode steps.
    pub fn all_tokens(&self) -> Vec<u32> {
        self.steps
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect()
    }
}

/// The traces behind a set of comparisons. Empty is allowed: reports then show what the
/// comparisons alone say.
#[derive(Clone, Debug, Default)]
pub struct RunInfo {
    pub traces: Vec<TraceInfo>,
}

impl RunInfo {
    pub fn from_traces<'a>(traces: impl IntoIterator<Item = &'a Trace>) -> RunInfo {
        RunInfo {
            traces: traces.into_iter().map(TraceInfo::from_trace).collect(),
        }
    }

    /// The two traces of a comparison, found by label. When both sides carry the same label (a
    /// trace against a copy of itself) the baseline is the first such trace, the candidate the last.
    pub fn sides(&self, c: &Comparison) -> (Option<&TraceInfo>, Option<&TraceInfo>) {
        let base = self.traces.iter().find(|t| t.label() == c.baseline);
        let cand = self.traces.iter().rev().find(|t| t.label() == c.candidate);
        (base, cand)
    }
}
