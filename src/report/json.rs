//! The JSON report (`--json FILE`, `--json -` for stdout): a versioned schema for other tools.
//!
//! These types are the contract, converted from the internal [`Comparison`] rather than derived on
//! it, so that refactoring the comparison core never silently changes what a CI script reads. The
//! schema file docs/report.schema.json is generated from them (schemars) and a test keeps the two
//! equal; docs/report-json.md documents each field. Change a field's meaning or remove one: bump
//! [`SCHEMA_VERSION`]. Adding an optional field keeps the version.
//!
//! JSON has no NaN or ±Infinity: a metric that is not finite is written as `null` (see each field).

use super::info::{RunInfo, TraceInfo};
use crate::compare::{Comparison, PairKind, TapResult};
use crate::judge::verdict as judged;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Bumped when a field is removed or changes meaning.
pub const SCHEMA_VERSION: u32 = 1;

/// One run of `parity check` or `parity diff`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "parity report")]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// Version of this schema (docs/report-json.md). Readers should refuse a version they do not know.
    pub schema_version: u32,
    /// The parity release that wrote the report.
    pub parity_version: String,
    /// `diverged` when any comparison diverged (the process then exits 1), else `parity`.
    pub verdict: Verdict,
    /// How many comparisons diverged.
    pub diverged: usize,
    /// The traces compared (golden, backends, an engine's dump), as their manifests describe them.
    pub traces: Vec<TraceReport>,
    /// Every comparison, in the order they were printed.
    pub comparisons: Vec<ComparisonReport>,
    /// `diff`'s verdict: what it rests on, where, and the cause named by experiment, as the
    /// terminal's verdict paragraph states them; absent for `check`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finding: Option<FindingReport>,
}

/// `diff`'s verdict, in the terms a script checks.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FindingReport {
    /// A divergence was found: `diff` exits 1.
    pub diverged: bool,
    pub basis: Basis,
    /// Where: the step whose token ids differ (at its `embd`), else the op whose own error
    /// diverged, else the first end-to-end divergence; absent when nothing diverged.
    pub place: Option<KeyReport>,
    /// The cause's name: the token difference's kind (`bos-missing`, …), else the hypothesis
    /// an experiment confirmed (a catalog bug's name such as `rope-neox`, or a fitted knob
    /// such as `rms-eps=1e-3`); absent when no experiment reproduced the divergence.
    pub named: Option<String>,
    /// Other hypotheses that reproduce the candidate as well as the named one.
    pub also: Vec<String>,
    /// Layouts the candidate did not declare, named by experiment and aligned before the
    /// judging went on (catalog names, else `layout:<name>` at their tap).
    pub layouts: Vec<String>,
}

/// What `diff`'s verdict rests on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Basis {
    /// The token ids differ.
    Tokens,
    /// An op's own error, recomputed from the candidate's own inputs (out of its floor, or
    /// under it and explained by experiment).
    OwnError,
    /// Only the end-to-end comparison against the baseline crossed its tolerance (the model
    /// was not at hand, or no op's own error explains the drift).
    EndToEnd,
    /// No divergence.
    Parity,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Every tap within tolerance, same token ids, logits' KLD within tolerance.
    Parity,
    /// A token id, a tap or the logits' KLD is out of tolerance.
    Diverged,
}

/// A trace's identity: who produced it, from which model, on which ids.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TraceReport {
    /// `producer.name/producer.backend`, the label comparisons use for `baseline` and `candidate`.
    pub label: String,
    pub producer: ProducerReport,
    pub model: ModelReport,
    /// The ids fed at each step (step 0 = prefill).
    pub steps: Vec<StepReport>,
    /// How many tap tensors the trace holds.
    pub tensors: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProducerReport {
    /// `parity`, `llama.cpp`, or an engine's own name.
    pub name: String,
    /// `reference`, `reference:ggml-cpu`, `fast`, `llama.cpp-cpu`, an engine's backend, …; a
    /// `/op-by-op` suffix marks a run fed the baseline's tensor at every tap.
    pub backend: String,
    pub version: String,
    /// Free-form, as the producer wrote it (llama.cpp goldens: `llama_cpp_commit`, `ggml_version`,
    /// `type_k`, `flash_attn`, `n_threads`, `prompt`, `command`, …).
    pub settings: serde_json::Value,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelReport {
    /// The GGUF path as the producer recorded it.
    pub path: String,
    /// Hex sha256 of the GGUF file; empty when the producer did not record one.
    pub sha256: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepReport {
    pub step: usize,
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    /// The ids decoded by the model's own tokenizer, when the model file was at hand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// One baseline/candidate comparison.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ComparisonReport {
    /// Label of the baseline trace (see `traces[].label`).
    pub baseline: String,
    /// Label of the candidate trace.
    pub candidate: String,
    /// Which tolerance table applies (docs/tolerances.md).
    pub pair: Pair,
    /// The model's main matmul weight type, as Rust names it (`F32`, `F16`, `Q8_0`, `Q4_K`, …).
    pub weight_type: String,
    pub verdict: Verdict,
    /// The verdict as parity prints it: one paragraph, cause included.
    pub explanation: String,
    /// The first token id that differs, if any (then no tensor can be judged).
    pub token_mismatch: Option<TokenMismatchReport>,
    /// The place the verdict names: the first tap over its threshold in graph order (for
    /// `own-inputs`, where the bug first shows, placed by experiment when it was); null when
    /// the token ids differ (the ids are then the verdict) or nothing diverged.
    pub first_divergence: Option<DivergenceReport>,
    /// Every tap both traces have, in graph order (step, then embd, layers, result_norm, logits).
    pub results: Vec<TapReport>,
    /// Logit statistics per step.
    pub logits: Vec<LogitReport>,
    /// Mean KL divergence per step above which the comparison diverges.
    pub kld_threshold: f64,
    /// Taps only one side recorded (not compared).
    pub only_in_baseline: usize,
    pub only_in_candidate: usize,
    /// For `own-inputs`: the activation rounding family the judge measured as the one that
    /// reproduces the candidate (`plain-f32`, `ggml-cpu`, `ggml-scalar`, `q8k`, `q8_1-gpu`, `f16`,
    /// `bf16`, `f16-acc`, `f16-acc-unfused`, `tf32`; docs/diagnosis.md), the prefill's where the
    /// decode steps round otherwise (then `baseline` ends `prefill: F, decode: G`); absent for
    /// the other pairs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounding_family: Option<String>,
    /// For `own-inputs`: the output projection's rounding family where it differs from
    /// `rounding_family` (an engine whose lm_head runs another kernel than its layers; then
    /// `baseline` ends `; output projection: O`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_rounding: Option<String>,
    /// For `own-inputs`: the K/V cache the candidate was judged under (declared by its
    /// manifest, else measured): `f32`, `f16`, `q8_0`, `K q8_0 / V f16`, then
    /// `, llama.cpp's arithmetic` and `, flash attention` where they apply; absent for the
    /// other pairs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<String>,
    /// For `own-inputs`: the cache the decode steps read where it differs from `kv_cache`
    /// (an engine whose prompt attends over its fresh f32 rows and whose decode steps read a
    /// quantized cache, measured per step kind); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_decode: Option<String>,
    /// What the comparison cannot see, in the verdict's words (`own-inputs`: a matmul floor
    /// widened because no known rounding reproduces the engine; keys judged as spans of ops
    /// the trace has no taps inside); absent when there is nothing to say.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub limits: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Pair {
    /// Both sides round matmul inputs as ggml's CPU does.
    SameRounding,
    /// One side keeps f32 activations where the other quantizes them, or unknown.
    DifferentRounding,
    /// Same rounding, every op fed the baseline's inputs.
    OpByOp,
    /// Every op of the candidate recomputed from its own inputs (the own-error judgement).
    OwnInputs,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenMismatchReport {
    pub step: usize,
    /// First index within the step's ids where they differ.
    pub index: usize,
    /// What kind of difference: `bos-missing`, `bos-doubled`, `template`, `bos-extra`, `other-ids`.
    pub kind: String,
    /// The step's ids on each side.
    pub baseline_ids: Vec<u32>,
    pub candidate_ids: Vec<u32>,
    /// Candidate row = baseline row + offset for the rows that still line up (null: none found).
    pub offset: Option<i64>,
    /// The ids decoded, when the tokenizer was at hand.
    pub baseline_text: Option<String>,
    pub candidate_text: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DivergenceReport {
    pub at: TapReport,
    /// Up to three taps just before it (graph order) that still matched.
    pub matched_before: Vec<TapReport>,
    /// The likely cause, in words, with its evidence.
    pub diagnosis: String,
    /// Where in the sequence it first shows (own-error verdicts): a bug inside a long prompt
    /// shows at step 0, and this says at which token. Absent where it was not located.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<PositionReport>,
    /// Judged as a span (the trace has no taps inside it, e.g. a scan): the steps to record
    /// whole to judge it op by op, and the recording plan that does it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zoom: Option<ZoomReport>,
}

/// The zoom after a scan (docs/trace-format.md, "Scan and zoom").
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ZoomReport {
    /// The steps to record whole.
    pub steps: Vec<usize>,
    /// The plan for `--record` or `PARITY_RECORD`: the scan's taps kept, those steps whole.
    pub record: String,
}

/// A token position: the first row of the step out of its floor.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PositionReport {
    /// Position in the sequence (0: the first prompt token).
    pub position: usize,
    /// Its row within the step, and the step's row count.
    pub row: usize,
    pub rows: usize,
    /// The token id at that position.
    pub token: u32,
}

/// Which tensor: (step, layer, tap).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KeyReport {
    pub step: usize,
    /// null for the graph-wide taps `embd`, `result_norm`, `logits`.
    pub layer: Option<usize>,
    /// Canonical tap name (docs/trace-format.md): `embd`, `attn_norm`, `q`, `k`, `v`, `q_rope`,
    /// `k_rope`, `kq_soft_max`, `kqv_out`, `attn_out`, `ffn_inp`, `ffn_norm`, `ffn_gate`, `ffn_up`,
    /// `ffn_act`, `ffn_out`, `l_out`, `result_norm`, `logits`.
    pub tap: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TapReport {
    pub key: KeyReport,
    pub metrics: MetricsReport,
    /// The NMSE above which this tap fails, when `gating`; otherwise the level its drift is
    /// drawn against.
    pub threshold: f64,
    pub pass: bool,
    /// Whether the NMSE is judged against `threshold`. False for the intermediate taps of an
    /// end-to-end comparison between different roundings: compounded rounding noise, drawn as
    /// drift and failing only on non-finite values (docs/tolerances.md, "Verdicts at depth").
    #[serde(default = "yes")]
    pub gating: bool,
}

fn yes() -> bool {
    true
}

/// How the candidate tensor `b` differs from the baseline `a` (over the values finite on both sides).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MetricsReport {
    /// Σ(a−b)² / Σa² (0: bit-identical; null: infinite, the baseline is all zero and the candidate not).
    pub nmse: Option<f64>,
    /// a·b / (|a| |b|); null when undefined (a zero vector).
    pub cosine: Option<f64>,
    /// max |a−b|.
    pub max_abs: Option<f64>,
    /// mean |a−b|.
    pub mean_abs: Option<f64>,
    /// 10·log10(Σa² / Σ(a−b)²) in dB; null when infinite (identical tensors).
    pub sqnr_db: Option<f64>,
    /// Elements compared.
    pub n: usize,
    /// NaNs in the baseline (any NaN fails).
    pub nan_a: usize,
    /// NaNs in the candidate.
    pub nan_b: usize,
    /// Positions where either side is ±Inf and they differ.
    pub inf_mismatch: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LogitReport {
    pub step: usize,
    /// Mean KL divergence over the step's rows (softmax of the baseline vs the candidate).
    pub kld_mean: Option<f64>,
    pub kld_max: Option<f64>,
    /// Rows whose argmax agrees.
    pub top1_agree: usize,
    pub rows: usize,
    /// Mean size of the overlap of the two top-5 sets (0–5).
    pub top5_overlap_mean: Option<f64>,
}

fn fin(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

fn tap(r: &TapResult) -> TapReport {
    let m = &r.metrics;
    TapReport {
        key: KeyReport {
            step: r.key.step,
            layer: r.key.layer,
            tap: r.key.tap.name().to_string(),
        },
        metrics: MetricsReport {
            nmse: fin(m.nmse),
            cosine: fin(m.cosine),
            max_abs: fin(m.max_abs),
            mean_abs: fin(m.mean_abs),
            sqnr_db: fin(m.sqnr_db),
            n: m.n,
            nan_a: m.nan_a,
            nan_b: m.nan_b,
            inf_mismatch: m.inf_mismatch,
        },
        threshold: r.threshold,
        pass: r.pass,
        gating: r.gating,
    }
}

fn verdict_of(diverged: bool) -> Verdict {
    if diverged {
        Verdict::Diverged
    } else {
        Verdict::Parity
    }
}

/// The stable form of one comparison.
pub fn comparison(c: &Comparison) -> ComparisonReport {
    ComparisonReport {
        baseline: c.baseline.clone(),
        candidate: c.candidate.clone(),
        pair: match c.pair {
            PairKind::SameRounding => Pair::SameRounding,
            PairKind::DifferentRounding => Pair::DifferentRounding,
            PairKind::OpByOp => Pair::OpByOp,
            PairKind::OwnInputs => Pair::OwnInputs,
        },
        weight_type: format!("{:?}", c.weight_type),
        verdict: verdict_of(c.diverged()),
        explanation: super::verdict(c),
        token_mismatch: c.token_mismatch.as_ref().map(|t| TokenMismatchReport {
            step: t.step,
            index: t.index,
            kind: t.kind.name().to_string(),
            baseline_ids: t.baseline_ids.clone(),
            candidate_ids: t.candidate_ids.clone(),
            offset: t.offset.map(|o| o as i64),
            baseline_text: t.baseline_text.clone(),
            candidate_text: t.candidate_text.clone(),
        }),
        first_divergence: c.first_divergence.as_ref().map(|d| DivergenceReport {
            at: tap(&d.at),
            matched_before: d.matched_before.iter().map(tap).collect(),
            diagnosis: d.diagnosis.clone(),
            position: d.position.map(|p| PositionReport {
                position: p.position,
                row: p.row,
                rows: p.rows,
                token: p.token,
            }),
            zoom: d.zoom.as_ref().map(|z| ZoomReport {
                steps: z.steps.clone(),
                record: z.record.clone(),
            }),
        }),
        results: c.results.iter().map(tap).collect(),
        logits: c
            .logits
            .iter()
            .map(|l| LogitReport {
                step: l.step,
                kld_mean: fin(l.kld_mean),
                kld_max: fin(l.kld_max),
                top1_agree: l.top1_agree,
                rows: l.rows,
                top5_overlap_mean: fin(l.top5_overlap_mean),
            })
            .collect(),
        kld_threshold: c.kld_threshold,
        only_in_baseline: c.only_in_baseline,
        only_in_candidate: c.only_in_candidate,
        rounding_family: c.rounding_family.map(str::to_string),
        output_rounding: c.output_rounding.map(str::to_string),
        kv_cache: c.kv_cache.clone(),
        kv_cache_decode: c.kv_cache_decode.clone(),
        limits: c.limits.clone(),
    }
}

fn trace(t: &TraceInfo) -> TraceReport {
    TraceReport {
        label: t.label(),
        producer: ProducerReport {
            name: t.producer.name.clone(),
            backend: t.producer.backend.clone(),
            version: t.producer.version.clone(),
            settings: t.producer.settings.clone(),
        },
        model: ModelReport {
            path: t.model.path.clone(),
            sha256: t.model.sha256.clone(),
        },
        steps: t
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| StepReport {
                step: s.step,
                tokens: s.tokens.clone(),
                positions: s.positions.clone(),
                text: t.text.as_ref().and_then(|v| v.get(i).cloned()),
            })
            .collect(),
        tensors: t.tensors,
    }
}

/// The whole report; `verdict` is `diff`'s (None for `check`).
pub fn report(
    comparisons: &[Comparison],
    info: &RunInfo,
    verdict: Option<&judged::Verdict>,
) -> Report {
    let diverged = comparisons.iter().filter(|c| c.diverged()).count();
    Report {
        schema_version: SCHEMA_VERSION,
        parity_version: env!("CARGO_PKG_VERSION").to_string(),
        verdict: verdict_of(diverged > 0),
        diverged,
        traces: info.traces.iter().map(trace).collect(),
        comparisons: comparisons.iter().map(comparison).collect(),
        finding: verdict.map(finding),
    }
}

fn finding(v: &judged::Verdict) -> FindingReport {
    FindingReport {
        diverged: v.diverged,
        basis: match v.basis {
            judged::Basis::Tokens => Basis::Tokens,
            judged::Basis::OwnError => Basis::OwnError,
            judged::Basis::EndToEnd => Basis::EndToEnd,
            judged::Basis::Parity => Basis::Parity,
        },
        place: v.place.map(|k| KeyReport {
            step: k.step,
            layer: k.layer,
            tap: k.tap.name().to_string(),
        }),
        named: v.named.clone(),
        also: v.also.clone(),
        layouts: v.layouts.clone(),
    }
}

/// The JSON Schema of [`Report`] as committed in docs/report.schema.json.
pub fn schema() -> String {
    let s = schemars::schema_for!(Report);
    serde_json::to_string_pretty(&s).expect("a schema serializes") + "\n"
}
