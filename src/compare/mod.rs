//! The comparison core: compares two traces tap by tap, whoever made them, and finds the first
//! (step, layer, tap) in graph order whose NMSE crosses its threshold. Knows `trace` only.

mod diagnose;
pub mod metrics;
pub mod tolerance;

pub use metrics::{LogitStats, Metrics, logit_stats, metrics};
pub use tolerance::{PairKind, kld_threshold, nmse_threshold};

use crate::gguf::GgmlType;
use crate::trace::{Tap, TapKey, Trace, TraceError};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(
        "the traces are for different models (baseline sha256 {a}…, candidate {b}…): a golden must be made from the same GGUF file"
    )]
    ModelMismatch { a: String, b: String },
    #[error(
        "{key}: shapes {a:?} (baseline) and {b:?} (candidate) hold different numbers of elements"
    )]
    ShapeMismatch {
        key: TapKey,
        a: Vec<usize>,
        b: Vec<usize>,
    },
    #[error("the traces have no tap in common: nothing to compare")]
    NothingInCommon,
}

#[derive(Clone, Debug, Serialize)]
pub struct TapResult {
    pub key: TapKey,
    pub metrics: Metrics,
    pub threshold: f64,
    pub pass: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct LogitStep {
    pub step: usize,
    /// Mean over the step's rows.
    pub kld_mean: f64,
    pub kld_max: f64,
    pub top1_agree: usize,
    pub rows: usize,
    pub top5_overlap_mean: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct TokenMismatch {
    pub step: usize,
    pub index: usize,
    pub baseline: Option<u32>,
    pub candidate: Option<u32>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Divergence {
    pub at: TapResult,
    /// Up to three taps just before it (graph order) that still matched.
    pub matched_before: Vec<TapResult>,
    pub diagnosis: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub baseline: String,
    pub candidate: String,
    pub pair: PairKind,
    pub weight_type: GgmlType,
    pub token_mismatch: Option<TokenMismatch>,
    pub results: Vec<TapResult>,
    pub logits: Vec<LogitStep>,
    pub kld_threshold: f64,
    pub first_divergence: Option<Divergence>,
    /// Taps present on only one side (not compared).
    pub only_in_baseline: usize,
    pub only_in_candidate: usize,
}

impl Comparison {
    pub fn diverged(&self) -> bool {
        self.token_mismatch.is_some()
            || self.first_divergence.is_some()
            || self.logits.iter().any(|l| l.kld_mean > self.kld_threshold)
    }
}

/// Options for [`compare`].
pub struct CompareOptions {
    pub pair: PairKind,
    pub weight_type: GgmlType,
    /// Refuse traces whose model sha256 differ (off for external engines that don't record one).
    pub require_same_model: bool,
}

fn label(t: &Trace) -> String {
    format!(
        "{}/{}",
        t.manifest.producer.name, t.manifest.producer.backend
    )
}

/// Compare `cand` against `base` tap by tap, in graph order.
pub fn compare(
    base: &Trace,
    cand: &Trace,
    opt: &CompareOptions,
) -> Result<Comparison, CompareError> {
    let (sa, sb) = (&base.manifest.model.sha256, &cand.manifest.model.sha256);
    if opt.require_same_model && !sa.is_empty() && !sb.is_empty() && sa != sb {
        return Err(CompareError::ModelMismatch {
            a: sa.chars().take(12).collect(),
            b: sb.chars().take(12).collect(),
        });
    }

    // Token ids first: if the inputs differ, nothing downstream can be judged.
    let token_mismatch = first_token_mismatch(base, cand);

    let common: Vec<TapKey> = base.keys().filter(|k| cand.contains(k)).copied().collect();
    if common.is_empty() {
        return Err(CompareError::NothingInCommon);
    }
    let mut results = Vec::with_capacity(common.len());
    let mut logits = Vec::new();
    let mut first: Option<usize> = None;
    for key in &common {
        let a = base.get(key)?.expect("listed");
        let b = cand.get(key)?.expect("listed");
        if a.len() != b.len() {
            return Err(CompareError::ShapeMismatch {
                key: *key,
                a: a.shape().to_vec(),
                b: b.shape().to_vec(),
            });
        }
        let m = metrics(
            &a.view(),
            &b.view()
                .into_shape_with_order(a.shape())
                .unwrap()
                .into_dyn(),
        );
        let threshold = nmse_threshold(opt.pair, opt.weight_type, key.tap);
        let pass = !m.non_finite_failure() && m.nmse <= threshold;
        if !pass && first.is_none() {
            first = Some(results.len());
        }
        if key.tap == Tap::Logits {
            logits.push(logit_step(key.step, &a, &b));
        }
        results.push(TapResult {
            key: *key,
            metrics: m,
            threshold,
            pass,
        });
    }

    let first_divergence = match first {
        Some(i) => {
            let mut matched_before: Vec<TapResult> = results[..i]
                .iter()
                .rev()
                .filter(|r| r.pass)
                .take(3)
                .cloned()
                .collect();
            matched_before.reverse();
            let diagnosis = diagnose::diagnose(base, cand, &results, i, opt.weight_type)?;
            Some(Divergence {
                at: results[i].clone(),
                matched_before,
                diagnosis,
            })
        }
        None => None,
    };

    Ok(Comparison {
        baseline: label(base),
        candidate: label(cand),
        pair: opt.pair,
        weight_type: opt.weight_type,
        token_mismatch,
        results,
        logits,
        kld_threshold: kld_threshold(opt.pair, opt.weight_type),
        first_divergence,
        only_in_baseline: base.keys().filter(|k| !cand.contains(k)).count(),
        only_in_candidate: cand.keys().filter(|k| !base.contains(k)).count(),
    })
}

fn first_token_mismatch(base: &Trace, cand: &Trace) -> Option<TokenMismatch> {
    let (a, b) = (&base.manifest.steps, &cand.manifest.steps);
    for s in 0..a.len().max(b.len()) {
        let ta = a.get(s).map(|x| x.tokens.as_slice()).unwrap_or(&[]);
        let tb = b.get(s).map(|x| x.tokens.as_slice()).unwrap_or(&[]);
        // A trace with fewer steps is fine; compare only steps both have.
        if a.get(s).is_none() || b.get(s).is_none() {
            break;
        }
        for i in 0..ta.len().max(tb.len()) {
            if ta.get(i) != tb.get(i) {
                return Some(TokenMismatch {
                    step: s,
                    index: i,
                    baseline: ta.get(i).copied(),
                    candidate: tb.get(i).copied(),
                });
            }
        }
    }
    None
}

fn logit_step(step: usize, a: &ndarray::ArrayD<f32>, b: &ndarray::ArrayD<f32>) -> LogitStep {
    let n_vocab = *a.shape().last().unwrap_or(&1);
    let (va, vb): (Vec<f32>, Vec<f32>) = (a.iter().copied().collect(), b.iter().copied().collect());
    let stats: Vec<LogitStats> = va
        .chunks(n_vocab)
        .zip(vb.chunks(n_vocab))
        .map(|(x, y)| logit_stats(x, y))
        .collect();
    let rows = stats.len();
    LogitStep {
        step,
        kld_mean: stats.iter().map(|s| s.kld).sum::<f64>() / rows as f64,
        kld_max: stats.iter().map(|s| s.kld).fold(0.0, f64::max),
        top1_agree: stats.iter().filter(|s| s.top1_base == s.top1_cand).count(),
        rows,
        top5_overlap_mean: stats.iter().map(|s| s.top5_overlap as f64).sum::<f64>() / rows as f64,
    }
}
