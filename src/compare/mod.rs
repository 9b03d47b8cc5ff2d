//! The comparison core: compares two traces tap by tap, whoever made them, and finds the first
//! (step, layer, tap) in graph order whose NMSE crosses its threshold. Knows `trace` only.

mod diagnose;
pub(crate) use diagnose::op_inputs;
pub mod metrics;
pub mod position;
mod stream;
pub mod tolerance;

pub use metrics::{LogitStats, Metrics, MetricsAcc, logit_stats, metrics, slice_nmse};
pub use stream::Streamed;
pub use tolerance::{PairKind, gates, kld_threshold, nmse_threshold};

use crate::gguf::GgmlType;
use crate::trace::{Tap, TapKey, Trace, TraceError};
use ndarray::{ArrayD, ArrayViewD};
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
    /// Whether the NMSE is judged against `threshold` (false: an intermediate tap between
    /// different roundings end to end, drawn as drift against `threshold` but failing only on
    /// non-finite values; see [`tolerance::gates`]).
    pub gating: bool,
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

/// How two id sequences differ: the first thing to rule out, since nothing computed from
/// different ids can be compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TokenDiff {
    /// The candidate lacks the baseline's first id (typically BOS).
    FirstMissing,
    /// The candidate repeats the first id (BOS added twice: once by a template, once by the
    /// tokenizer).
    FirstDoubled,
    /// The candidate has the baseline's ids inside extra ones (a chat template around the
    /// prompt).
    Wrapped,
    /// The candidate has an extra first id the baseline lacks.
    FirstExtra,
    /// Another difference (another tokenizer, other text, another decode continuation).
    Other,
}

impl TokenDiff {
    pub fn name(self) -> &'static str {
        match self {
            TokenDiff::FirstMissing => "bos-missing",
            TokenDiff::FirstDoubled => "bos-doubled",
            TokenDiff::Wrapped => "template",
            TokenDiff::FirstExtra => "bos-extra",
            TokenDiff::Other => "other-ids",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TokenMismatch {
    pub step: usize,
    /// First index within the step where the ids differ.
    pub index: usize,
    pub kind: TokenDiff,
    /// The step's ids on each side.
    pub baseline_ids: Vec<u32>,
    pub candidate_ids: Vec<u32>,
    /// Candidate row = baseline row + offset for the rows that still line up (None: no
    /// alignment found).
    pub offset: Option<isize>,
    /// The ids decoded to text, when the caller has the tokenizer (see [`TokenMismatch::decode_with`]).
    pub baseline_text: Option<String>,
    pub candidate_text: Option<String>,
}

impl TokenMismatch {
    /// Fill the decoded texts with `decode` (the model's tokenizer).
    pub fn decode_with(&mut self, decode: impl Fn(&[u32]) -> String) {
        self.baseline_text = Some(decode(&self.baseline_ids));
        self.candidate_text = Some(decode(&self.candidate_ids));
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Divergence {
    pub at: TapResult,
    /// Up to three taps just before it (graph order) that still matched.
    pub matched_before: Vec<TapResult>,
    pub diagnosis: String,
    /// The first token position out of its floor (`own-inputs`: where the finding first
    /// shows, row by row); None where it was not located.
    pub position: Option<position::Position>,
    /// Judged as a span at a step the trace did not record whole: the zoom that names it.
    pub zoom: Option<crate::trace::Zoom>,
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
    /// The activation rounding family the own-error judgement measured (`own-inputs` only).
    pub rounding_family: Option<&'static str>,
    /// The output projection's rounding family where it differs (`own-inputs` only).
    pub output_rounding: Option<&'static str>,
    /// The K/V cache the own-error judgement held the candidate to (`own-inputs` only).
    pub kv_cache: Option<String>,
    /// The cache the decode steps read where it differs from `kv_cache` (`own-inputs` only).
    pub kv_cache_decode: Option<String>,
    /// What the comparison cannot see, said with its verdict (`own-inputs`: a widened matmul
    /// floor, keys judged as spans).
    pub limits: Vec<String>,
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
    same_model(base, cand, opt)?;
    // Token ids first: if the inputs differ, nothing computed from them can be judged. Steps
    // before the first differing one are compared as usual; in that step only the embedding
    // rows of ids that line up still mean something (each row depends on its id alone).
    let token_mismatch = first_token_mismatch(base, cand);
    let cut = token_mismatch.as_ref().map_or(usize::MAX, |m| m.step);
    let mut measured = Vec::new();
    for key in base.keys().filter(|k| k.step < cut && cand.contains(k)) {
        if let Some(m) = measure_in_rows(base, cand, *key)? {
            measured.push(m);
            continue;
        }
        let a = base.get(key)?.expect("listed");
        let b = cand.get(key)?.expect("listed");
        match measure_cut(base, *key, &a, cand.cut(key).as_ref(), b.view()) {
            CutMeasure::Whole => measured.push(measure(*key, &a, b.view())?),
            CutMeasure::Shared(m) => measured.push(m),
            CutMeasure::Disjoint => {}
        }
    }
    assemble(base, cand, opt, token_mismatch, measured)
}

/// A tensor larger than a slice (`trace::row_slice_values`: a long prompt's logits), of one
/// shape in both traces, measured a slice of rows at a time, read from each without the rest
/// (the same metrics as whole); None for the rest.
fn measure_in_rows(
    base: &Trace,
    cand: &Trace,
    key: TapKey,
) -> Result<Option<Measured>, CompareError> {
    let (Some(shape), Some(other)) = (base.shape(&key), cand.shape(&key)) else {
        return Ok(None);
    };
    if base.cut(&key).is_some() || cand.cut(&key).is_some() {
        return Ok(None);
    }
    let values = crate::trace::row_slice_values();
    let total: usize = shape.iter().product();
    // Rows lead a tensor of two axes or more (a 1-d one is compared whole).
    let (Some(&t), true) = (shape.first(), shape == other && shape.len() >= 2) else {
        return Ok(None);
    };
    let width = total / t.max(1);
    let slice = crate::trace::rows_per_slice(values, width);
    if total <= values || t <= slice {
        return Ok(None);
    }
    let mut m = RowsMeasured::new(key, width);
    for r0 in (0..t).step_by(slice) {
        let rows = r0..(r0 + slice).min(t);
        let a = base.get_rows(&key, rows.clone())?.expect("listed");
        let b = cand.get_rows(&key, rows)?.expect("listed");
        m.push(&a, &b);
    }
    Ok(Some(m.finish()))
}

/// How the two sides of a cut tap (`kq_soft_max` kept for some heads or rows) compare.
enum CutMeasure {
    /// Neither side is cut: measured whole.
    Whole,
    /// Measured on the values both hold.
    Shared(Measured),
    /// They hold no value in common: nothing to measure.
    Disjoint,
}

/// `key` measured on the heads and rows both `base`'s tensor `a` and the candidate's `b`
/// (cut as `cb`) hold, where either was cut.
fn measure_cut(
    base: &Trace,
    key: TapKey,
    a: &ArrayD<f32>,
    cb: Option<&crate::trace::Cut>,
    b: ArrayViewD<f32>,
) -> CutMeasure {
    let ca = base.cut(&key);
    let Some(s) = base.manifest.steps.get(key.step) else {
        return CutMeasure::Whole;
    };
    if (ca.is_none() && cb.is_none()) || a.ndim() != 3 || b.ndim() != 3 {
        return CutMeasure::Whole;
    }
    let (a, b) = (a.as_standard_layout(), b.as_standard_layout());
    let side = |v: &ArrayViewD<f32>| (v.shape()[0], v.shape()[1]);
    let ((ha, ta), (hb, tb)) = (side(&a.view()), side(&b.view()));
    let sa = crate::trace::Side {
        data: a.as_slice().expect("standard"),
        cut: ca.as_ref(),
        n_head: ha,
        t: ta,
    };
    let sb = crate::trace::Side {
        data: b.as_slice().expect("standard"),
        cut: cb,
        n_head: hb,
        t: tb,
    };
    let cols = a.shape()[2].min(b.shape()[2]);
    match crate::trace::Cut::common(sa, sb, s.positions[0], cols) {
        Some((x, y)) => {
            let x = ArrayViewD::from_shape(ndarray::IxDyn(&[x.len()]), &x).expect("1-d");
            let y = ArrayViewD::from_shape(ndarray::IxDyn(&[y.len()]), &y).expect("1-d");
            CutMeasure::Shared(Measured {
                key,
                metrics: metrics(&x, &y),
                logits: None,
            })
        }
        None => CutMeasure::Disjoint,
    }
}

fn same_model(base: &Trace, cand: &Trace, opt: &CompareOptions) -> Result<(), CompareError> {
    let (sa, sb) = (&base.manifest.model.sha256, &cand.manifest.model.sha256);
    if opt.require_same_model && !sa.is_empty() && !sb.is_empty() && sa != sb {
        return Err(CompareError::ModelMismatch {
            a: sa.chars().take(12).collect(),
            b: sb.chars().take(12).collect(),
        });
    }
    Ok(())
}

/// One tap of both traces measured: what [`compare`] reads of its tensors.
struct Measured {
    key: TapKey,
    metrics: Metrics,
    logits: Option<LogitStep>,
}

/// [`measure`] of a tap handed over a slice of rows at a time, in order, each beside the
/// baseline's same rows (a prompt's logits, never held whole): the same [`Measured`] as the
/// whole tensor's when each slice but the last holds a multiple of 4 values.
pub(crate) struct RowsMeasured {
    key: TapKey,
    acc: metrics::MetricsAcc,
    /// The logits' row width and each row's statistics so far.
    logits: Option<(usize, Vec<LogitStats>)>,
}

impl RowsMeasured {
    pub(crate) fn new(key: TapKey, row_width: usize) -> Self {
        RowsMeasured {
            key,
            acc: Default::default(),
            logits: (key.tap == Tap::Logits).then(|| (row_width.max(1), Vec::new())),
        }
    }

    /// The next rows: the baseline's `a`, the candidate's `b`, whole rows of equal lengths.
    pub(crate) fn push(&mut self, a: &[f32], b: &[f32]) {
        self.acc.push(a, b);
        if let Some((w, stats)) = &mut self.logits {
            stats.extend(
                a.chunks(*w)
                    .zip(b.chunks(*w))
                    .map(|(x, y)| logit_stats(x, y)),
            );
        }
    }

    fn finish(self) -> Measured {
        Measured {
            key: self.key,
            metrics: self.acc.finish(),
            logits: self.logits.map(|(_, s)| logit_step_of(self.key.step, &s)),
        }
    }
}

fn measure(key: TapKey, a: &ArrayD<f32>, b: ArrayViewD<f32>) -> Result<Measured, CompareError> {
    if a.len() != b.len() {
        return Err(CompareError::ShapeMismatch {
            key,
            a: a.shape().to_vec(),
            b: b.shape().to_vec(),
        });
    }
    // Same count, other shape (`[T, n]` against `[T*n]`): the candidate is read in logical
    // order in the baseline's shape, whatever its memory layout.
    let b = b.as_standard_layout();
    let b = b
        .view()
        .into_shape_with_order(a.shape())
        .map_err(|_| CompareError::ShapeMismatch {
            key,
            a: a.shape().to_vec(),
            b: b.shape().to_vec(),
        })?;
    Ok(Measured {
        key,
        metrics: metrics(&a.view(), &b),
        logits: (key.tap == Tap::Logits).then(|| logit_step(key.step, a, &b)),
    })
}

/// The comparison of the taps `measured` (every tap both traces have, in graph order, before
/// the step whose ids differ): thresholds, the first divergence and its diagnosis (which reads
/// that tap's tensors again).
fn assemble(
    base: &Trace,
    cand: &Trace,
    opt: &CompareOptions,
    token_mismatch: Option<TokenMismatch>,
    measured: Vec<Measured>,
) -> Result<Comparison, CompareError> {
    if measured.is_empty() && token_mismatch.is_none() {
        return Err(CompareError::NothingInCommon);
    }
    // Layers in the run: the end-to-end bounds on the logits grow with depth.
    let depth = depth_of(measured.iter().map(|m| &m.key));
    let mut results = Vec::with_capacity(measured.len() + 1);
    if let Some(tm) = &token_mismatch
        && let Some(r) = aligned_embd(base, cand, tm)?
    {
        results.push(r);
    }
    let mut logits = Vec::new();
    let mut first: Option<usize> = None;
    for Measured {
        key,
        metrics: m,
        logits: l,
    } in measured
    {
        let (threshold, gating, pass) = judged(opt, &key, &m, depth);
        if !pass && first.is_none() {
            first = Some(results.len());
        }
        logits.extend(l);
        results.push(TapResult {
            key,
            metrics: m,
            threshold,
            pass,
            gating,
        });
    }

    // Different ids: the verdict is the ids (the text names nothing else), so no tensor is
    // named as the first divergence either.
    let first = first.filter(|_| token_mismatch.is_none());
    let first_divergence = match first {
        Some(i) => Some(divergence(base, cand, &results, i, opt.weight_type)?),
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
        kld_threshold: kld_threshold(opt.pair, opt.weight_type, depth),
        first_divergence,
        // Taps outside parity's names are kept by `Trace::open` and counted here as not compared.
        only_in_baseline: base.keys().filter(|k| !cand.contains(k)).count() + base.extra.len(),
        only_in_candidate: cand.keys().filter(|k| !base.contains(k)).count() + cand.extra.len(),
        rounding_family: None,
        output_rounding: None,
        kv_cache: None,
        kv_cache_decode: None,
        limits: Vec::new(),
    })
}

/// The layers of a run of these keys (the deepest one's index + 1).
fn depth_of<'k>(keys: impl Iterator<Item = &'k TapKey>) -> usize {
    keys.filter_map(|k| k.layer).max().map_or(0, |l| l + 1)
}

/// A measured tap's threshold, whether it gates, and whether it passes.
fn judged(opt: &CompareOptions, key: &TapKey, m: &Metrics, depth: usize) -> (f64, bool, bool) {
    let threshold = nmse_threshold(opt.pair, opt.weight_type, key.tap, depth);
    let gating = gates(opt.pair, key.tap);
    let pass = !m.non_finite_failure() && (!gating || m.nmse <= threshold);
    (threshold, gating, pass)
}

/// The divergence at `results[i]`: what matched just before it and the diagnosis.
fn divergence(
    base: &Trace,
    cand: &Trace,
    results: &[TapResult],
    i: usize,
    wtype: GgmlType,
) -> Result<Divergence, CompareError> {
    Ok(Divergence {
        at: results[i].clone(),
        matched_before: matched_before(results, i),
        diagnosis: diagnose::diagnose(base, cand, results, i, wtype)?,
        position: None,
        zoom: None,
    })
}

/// The logits' end-to-end bounds of `c` raised to `factor` times what `clean` drifts against
/// the same baseline (a correct engine of the rounding the candidate was measured to use:
/// an f16-accumulating prefill moves the logits further than the bounds set for f32
/// accumulation), and the first divergence found again. A bound is only ever raised. Returns
/// the largest raised bounds (logits NMSE, mean KLD), None when nothing was raised.
pub fn widen_logit_bounds(
    c: &mut Comparison,
    clean: &Comparison,
    factor: f64,
    base: &Trace,
    cand: &Trace,
) -> Result<Option<(f64, f64)>, CompareError> {
    let mut raised = false;
    let mut nmse_bound = 0f64;
    for r in c.results.iter_mut().filter(|r| r.key.tap == Tap::Logits) {
        if let Some(x) = clean.results.iter().find(|x| x.key == r.key)
            && factor * x.metrics.nmse > r.threshold
        {
            r.threshold = factor * x.metrics.nmse;
            raised = true;
        }
        nmse_bound = nmse_bound.max(r.threshold);
        r.pass = !r.metrics.non_finite_failure() && (!r.gating || r.metrics.nmse <= r.threshold);
    }
    let kld = factor * clean.logits.iter().map(|l| l.kld_mean).fold(0.0, f64::max);
    if kld > c.kld_threshold {
        c.kld_threshold = kld;
        raised = true;
    }
    if !raised {
        return Ok(None);
    }
    if c.token_mismatch.is_none() {
        c.first_divergence = match c.results.iter().position(|r| !r.pass) {
            Some(i) => Some(divergence(base, cand, &c.results, i, c.weight_type)?),
            None => None,
        };
    }
    Ok(Some((nmse_bound, c.kld_threshold)))
}

/// Up to three results just before `results[i]` (graph order) that still matched.
/// Without any judgement of each op (`parity diff` without the model) the drift is all the
/// evidence there is: every tap is held to its threshold again, and the first over it in graph
/// order is the divergence (the ids, when they differ, stay the verdict).
pub fn judge_drift(c: &mut Comparison, base: &Trace, cand: &Trace) -> Result<(), CompareError> {
    for r in c.results.iter_mut().filter(|r| !r.gating) {
        r.gating = true;
        r.pass = r.pass && r.metrics.nmse <= r.threshold;
    }
    if c.token_mismatch.is_some() {
        return Ok(());
    }
    if let Some(i) = c.results.iter().position(|r| !r.pass)
        && c.first_divergence.as_ref().map(|d| d.at.key) != Some(c.results[i].key)
    {
        c.first_divergence = Some(Divergence {
            at: c.results[i].clone(),
            matched_before: matched_before(&c.results, i),
            diagnosis: diagnose::diagnose(base, cand, &c.results, i, c.weight_type)?,
            position: None,
            zoom: None,
        });
    }
    Ok(())
}

/// The diagnosis read at `key` of a compared pair (its signature, with its inputs' results as
/// context), whichever key diverges first in graph order: a judge that flagged `key` asks
/// about that key, not about an earlier one drifting under another rounding.
pub fn diagnose_at(
    c: &Comparison,
    base: &Trace,
    cand: &Trace,
    key: &TapKey,
) -> Result<Option<String>, CompareError> {
    match c.results.iter().position(|r| r.key == *key) {
        Some(i) => Ok(Some(diagnose::diagnose(
            base,
            cand,
            &c.results,
            i,
            c.weight_type,
        )?)),
        None => Ok(None),
    }
}

pub fn matched_before(results: &[TapResult], i: usize) -> Vec<TapResult> {
    let mut v: Vec<TapResult> = results[..i]
        .iter()
        .rev()
        .filter(|r| r.pass)
        .take(3)
        .cloned()
        .collect();
    v.reverse();
    v
}

fn first_token_mismatch(base: &Trace, cand: &Trace) -> Option<TokenMismatch> {
    let (a, b) = (&base.manifest.steps, &cand.manifest.steps);
    // A trace with fewer steps is fine; compare only the steps both have.
    for (sa, sb) in a.iter().zip(b) {
        let (ta, tb) = (&sa.tokens, &sb.tokens);
        if ta == tb {
            continue;
        }
        let index = ta.iter().zip(tb).take_while(|(x, y)| x == y).count();
        let (kind, offset) = classify(ta, tb);
        return Some(TokenMismatch {
            step: sa.step,
            index,
            kind,
            baseline_ids: ta.clone(),
            candidate_ids: tb.clone(),
            offset,
            baseline_text: None,
            candidate_text: None,
        });
    }
    None
}

/// Name the difference between two id sequences and the row offset that aligns them.
fn classify(a: &[u32], b: &[u32]) -> (TokenDiff, Option<isize>) {
    if !a.is_empty() && b == &a[1..] {
        return (TokenDiff::FirstMissing, Some(-1));
    }
    if !a.is_empty() && b.len() == a.len() + 1 && b[0] == a[0] && &b[1..] == a {
        return (TokenDiff::FirstDoubled, Some(1));
    }
    if !b.is_empty() && &b[1..] == a {
        return (TokenDiff::FirstExtra, Some(1));
    }
    // The baseline's ids (with or without its first, BOS) inside the candidate's.
    if b.len() > a.len() {
        for skip in [0, 1] {
            let core = &a[skip.min(a.len())..];
            if core.len() >= 2
                && let Some(p) = b.windows(core.len()).position(|w| w == core)
            {
                return (TokenDiff::Wrapped, Some(p as isize - skip as isize));
            }
        }
    }
    let offset = (a.len() == b.len()).then_some(0);
    (TokenDiff::Other, offset)
}

/// The step's embedding rows compared where the two id sequences line up (same id at
/// aligned rows), as a tap result of its own; None if there are no such rows.
fn aligned_embd(
    base: &Trace,
    cand: &Trace,
    tm: &TokenMismatch,
) -> Result<Option<TapResult>, CompareError> {
    let key = TapKey::new(tm.step, None, Tap::Embd);
    let (Some(off), Some(a), Some(b)) = (tm.offset, base.get(&key)?, cand.get(&key)?) else {
        return Ok(None);
    };
    let (na, nb) = (tm.baseline_ids.len(), tm.candidate_ids.len());
    if na == 0 || nb == 0 || a.len() % na != 0 || b.len() % nb != 0 || a.len() / na != b.len() / nb
    {
        return Ok(None);
    }
    let w = a.len() / na;
    let (va, vb): (Vec<f32>, Vec<f32>) = (a.iter().copied().collect(), b.iter().copied().collect());
    let (mut xa, mut xb) = (Vec::new(), Vec::new());
    for i in 0..na {
        let j = i as isize + off;
        if j < 0 || j as usize >= nb || tm.baseline_ids[i] != tm.candidate_ids[j as usize] {
            continue;
        }
        let j = j as usize;
        xa.extend_from_slice(&va[i * w..(i + 1) * w]);
        xb.extend_from_slice(&vb[j * w..(j + 1) * w]);
    }
    if xa.is_empty() {
        return Ok(None);
    }
    let rows = xa.len() / w;
    let a = ndarray::Array2::from_shape_vec((rows, w), xa).expect("whole rows");
    let b = ndarray::Array2::from_shape_vec((rows, w), xb).expect("whole rows");
    let m = metrics(&a.into_dyn().view(), &b.into_dyn().view());
    let threshold = nmse_threshold(PairKind::OpByOp, GgmlType::F32, Tap::Embd, 0);
    Ok(Some(TapResult {
        key,
        pass: !m.non_finite_failure() && m.nmse <= threshold,
        metrics: m,
        threshold,
        gating: true,
    }))
}

fn logit_step(step: usize, a: &ndarray::ArrayD<f32>, b: &ndarray::ArrayViewD<f32>) -> LogitStep {
    // Traces refuse empty axes on load; `max(1)` keeps an in-memory one from a zero chunk size.
    let n_vocab = a.shape().last().copied().unwrap_or(1).max(1);
    // Rows in logical order, without a copy when the tensors are in standard layout (as read).
    let (a, b) = (a.as_standard_layout(), b.as_standard_layout());
    let (va, vb) = (
        a.as_slice().expect("standard layout"),
        b.as_slice().expect("standard layout"),
    );
    let stats: Vec<LogitStats> = va
        .chunks(n_vocab)
        .zip(vb.chunks(n_vocab))
        .map(|(x, y)| logit_stats(x, y))
        .collect();
    logit_step_of(step, &stats)
}

/// The step's logit statistics from each row's.
fn logit_step_of(step: usize, stats: &[LogitStats]) -> LogitStep {
    let rows = stats.len();
    LogitStep {
        step,
        kld_mean: stats.iter().map(|s| s.kld).sum::<f64>() / rows.max(1) as f64,
        kld_max: stats.iter().map(|s| s.kld).fold(0.0, f64::max),
        top1_agree: stats.iter().filter(|s| s.top1_base == s.top1_cand).count(),
        rows,
        top5_overlap_mean: stats.iter().map(|s| s.top5_overlap as f64).sum::<f64>()
            / rows.max(1) as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{ModelRef, Producer, StepInfo};
    use std::collections::BTreeMap;

    /// A one-step, `layers`-layer trace: embd, l_out per layer, logits; `l_out` of the last
    /// layer scaled by `drift` (1 + drift) and the logits by `logit_err`.
    fn trace(layers: usize, drift: f32, logit_err: f32, ids: &[u32]) -> Trace {
        let row = |seed: usize| -> Vec<f32> {
            (0..64)
                .map(|i| ((i * 7 + seed * 13) % 17) as f32 - 8.0)
                .collect()
        };
        let arr = |v: Vec<f32>| ndarray::ArrayD::from_shape_vec(vec![1, 64], v).unwrap();
        let mut t = BTreeMap::new();
        t.insert(TapKey::new(0, None, Tap::Embd), arr(row(0)));
        for l in 0..layers {
            let mut v = row(l + 1);
            if l + 1 == layers {
                // An alternating error: NMSE ≈ drift² whatever the row.
                v.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x += drift * if i % 2 == 0 { 4.0 } else { -4.0 });
            }
            t.insert(TapKey::new(0, Some(l), Tap::LOut), arr(v));
        }
        let mut lg = row(99);
        lg[3] += logit_err;
        t.insert(TapKey::new(0, None, Tap::Logits), arr(lg));
        let step = StepInfo {
            step: 0,
            tokens: ids.to_vec(),
            positions: vec![0],
            forced: None,
        };
        in_memory(vec![step], t)
    }

    /// A trace of `steps` holding `t`, made by no model and no producer in particular.
    fn in_memory(steps: Vec<StepInfo>, t: BTreeMap<TapKey, ndarray::ArrayD<f32>>) -> Trace {
        let mref = ModelRef {
            path: String::new(),
            sha256: String::new(),
            size: None,
        };
        let prod = Producer {
            name: "test".into(),
            backend: "t".into(),
            version: String::new(),
            settings: serde_json::Value::Null,
        };
        Trace::from_memory(mref, prod, steps, t)
    }

    fn opt(pair: PairKind) -> CompareOptions {
        CompareOptions {
            pair,
            weight_type: GgmlType::Q4_0,
            require_same_model: false,
        }
    }

    #[test]
    fn between_different_roundings_intermediate_drift_is_drawn_not_judged() {
        let (a, b) = (trace(32, 0.0, 0.0, &[1]), trace(32, 0.5, 0.0, &[1]));
        // Same rounding: the drift at layer 31 crosses 2e-2 and is the divergence.
        let same = compare(&a, &b, &opt(PairKind::SameRounding)).unwrap();
        let d = same.first_divergence.as_ref().expect("diverges");
        assert_eq!(d.at.key, TapKey::new(0, Some(31), Tap::LOut));
        // Different roundings: the same drift is shown, not a verdict.
        let diff = compare(&a, &b, &opt(PairKind::DifferentRounding)).unwrap();
        assert!(!diff.diverged(), "{:?}", diff.first_divergence);
        let r = diff.results.iter().find(|r| r.key == d.at.key).unwrap();
        assert!(!r.gating && r.pass && r.metrics.nmse > r.threshold);
        // The logits still gate: an error there is what a user sees.
        let c = trace(32, 0.5, 1e3, &[1]);
        let diff = compare(&a, &c, &opt(PairKind::DifferentRounding)).unwrap();
        let d = diff.first_divergence.as_ref().expect("logits diverge");
        assert_eq!(d.at.key.tap, Tap::Logits);
        // NaN fails everywhere.
        let mut nan = trace(32, 0.0, 0.0, &[1]);
        let k = TapKey::new(0, Some(5), Tap::LOut);
        let mut v = nan.get(&k).unwrap().unwrap();
        v[[0, 1]] = f32::NAN;
        nan = {
            let mut t: BTreeMap<TapKey, ndarray::ArrayD<f32>> = BTreeMap::new();
            for key in nan.keys().copied().collect::<Vec<_>>() {
                t.insert(key, nan.get(&key).unwrap().unwrap());
            }
            t.insert(k, v);
            Trace::from_memory(
                nan.manifest.model.clone(),
                nan.manifest.producer.clone(),
                nan.manifest.steps.clone(),
                t,
            )
        };
        let diff = compare(&a, &nan, &opt(PairKind::DifferentRounding)).unwrap();
        assert_eq!(diff.first_divergence.unwrap().at.key, k);
    }

    #[test]
    fn the_logit_bounds_grow_past_22_layers_only_between_different_roundings() {
        let w = GgmlType::Q4_0;
        let d = PairKind::DifferentRounding;
        assert_eq!(nmse_threshold(d, w, Tap::Logits, 16), 2e-2);
        assert_eq!(nmse_threshold(d, w, Tap::Logits, 22), 2e-2);
        assert!(nmse_threshold(d, w, Tap::Logits, 44) > 3.9e-2);
        assert!(kld_threshold(d, w, 44) > kld_threshold(d, w, 22));
        let s = PairKind::SameRounding;
        assert_eq!(nmse_threshold(s, w, Tap::Logits, 80), 2e-2);
        assert_eq!(kld_threshold(s, w, 80), kld_threshold(s, w, 2));
    }

    #[test]
    fn different_ids_name_no_tensor() {
        // Step 0 diverges (same rounding, drift over 2e-2); step 1 was fed other ids.
        let with_step1 = |t: Trace, id: u32| {
            let mut steps = t.manifest.steps.clone();
            steps.push(StepInfo {
                step: 1,
                tokens: vec![id],
                positions: vec![1],
                forced: Some(true),
            });
            let tensors = t.keys().map(|k| (*k, t.get(k).unwrap().unwrap())).collect();
            Trace::from_memory(
                t.manifest.model.clone(),
                t.manifest.producer.clone(),
                steps,
                tensors,
            )
        };
        let a = with_step1(trace(4, 0.0, 0.0, &[1]), 5);
        let b = with_step1(trace(4, 0.5, 0.0, &[1]), 6);
        let c = compare(&a, &b, &opt(PairKind::SameRounding)).unwrap();
        assert_eq!(c.token_mismatch.as_ref().map(|m| m.step), Some(1));
        assert!(c.diverged());
        assert!(
            c.results.iter().any(|r| !r.pass),
            "step 0 is still compared"
        );
        assert!(c.first_divergence.is_none());
    }

    /// A later step of several tokens (a chunk of the prompt, a further turn) that diverges
    /// after a clean first step is named as one, not as a one-token decode step.
    #[test]
    fn a_diverging_later_chunk_is_not_called_a_decode_step() {
        let arr = |n: usize, err: f32| {
            let v: Vec<f32> = (0..n * 64)
                .map(|i| ((i * 7) % 17) as f32 - 8.0 + if i % 2 == 0 { err } else { -err })
                .collect();
            ndarray::ArrayD::from_shape_vec(vec![n, 64], v).unwrap()
        };
        let two_steps = |err: f32, n1: usize| {
            let mut t = BTreeMap::new();
            t.insert(TapKey::new(0, Some(0), Tap::LOut), arr(2, 0.0));
            t.insert(TapKey::new(1, Some(0), Tap::LOut), arr(n1, err));
            let steps = vec![
                StepInfo {
                    step: 0,
                    tokens: vec![1, 2],
                    positions: vec![0, 1],
                    forced: None,
                },
                StepInfo {
                    step: 1,
                    tokens: vec![3; n1],
                    positions: (2..2 + n1).collect(),
                    forced: Some(true),
                },
            ];
            in_memory(steps, t)
        };
        for (n1, says) in [
            (
                3,
                "step 1 (a later chunk or turn: 3 tokens at positions 2..4) diverges",
            ),
            (
                1,
                "the prefill (step 0) matched everywhere and step 1 diverges: look at what only decode steps use",
            ),
        ] {
            let c = compare(
                &two_steps(0.0, n1),
                &two_steps(3.0, n1),
                &opt(PairKind::SameRounding),
            )
            .unwrap();
            let d = c.first_divergence.expect("step 1 diverges");
            assert_eq!(d.at.key.step, 1);
            assert!(d.diagnosis.contains(says), "{n1}: {}", d.diagnosis);
        }
    }
}
