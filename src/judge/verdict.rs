//! The verdict of `parity diff` as one library call: `parity diff` renders it and
//! `parity selftest` checks it, so the two cannot disagree about a trace.
//!
//! Token ids first (`compare`: a dropped or doubled BOS, a template, is the finding); then,
//! when the model is at hand, each op of the candidate judged on its own inputs (`judge`), whose
//! first finding names the cause; the end-to-end comparison, with tolerances above llama.cpp's
//! own spread, is a divergence of its own when it crosses them.

use super::{JudgeError, JudgeOptions, Judgement, judge, replay::aligned_trace};
use crate::backend::{Backend, Reference};
use crate::compare::{
    CompareOptions, Comparison, Divergence, PairKind, TapResult, compare, widen_logit_bounds,
};
use crate::gguf::GgmlType;
use crate::model::Model;
use crate::trace::{MemorySink, Producer, Tap, TapFilter, TapKey, Trace};
use serde::Serialize;

/// What `diff` runs.
pub struct DiffOptions {
    /// The end-to-end comparison (tolerances by pair kind and weight type).
    pub compare: CompareOptions,
    /// The own-error judgement (roundings to try, experiments).
    pub judge: JudgeOptions,
}

impl DiffOptions {
    /// `parity diff` without flags: any candidate is an engine of unknown rounding end to end,
    /// the manifests must name the same model, every rounding is measured, experiments run.
    pub fn new(weight_type: GgmlType) -> DiffOptions {
        DiffOptions {
            compare: CompareOptions {
                pair: PairKind::DifferentRounding,
                weight_type,
                require_same_model: true,
            },
            judge: JudgeOptions::default(),
        }
    }
}

/// What the verdict rests on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Basis {
    /// The token ids differ.
    Tokens,
    /// An op's own error (out of its floor, or under it and explained by experiment).
    OwnError,
    /// Only the end-to-end comparison crossed its tolerance.
    EndToEnd,
    /// No divergence.
    Parity,
}

/// The verdict, in the terms a reader (and `selftest`) checks.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    /// A divergence was found: `diff` exits 1.
    pub diverged: bool,
    pub basis: Basis,
    /// Where: the step whose token ids differ (at its embd), else the judgement's finding,
    /// else the first end-to-end divergence.
    pub place: Option<TapKey>,
    /// The cause's name: the token difference's kind (`bos-missing`, …), else the confirmed
    /// hypothesis (its catalog name when it is a catalog bug).
    pub named: Option<String>,
    /// Other hypotheses that reproduce the candidate as well as the named one.
    pub also: Vec<String>,
    /// Undeclared layouts named by experiment before the finding (aligned, and the judging
    /// went on past them): their catalog names, else `layout:<name>` at their tap.
    pub layouts: Vec<String>,
    /// The largest cut a hypothesis made of an own error under the floors (below
    /// `hypothesis::EXPLAINS` on a clean trace); None when none was tested.
    pub below_floor_cut: Option<f64>,
}

/// The verdict from the end-to-end comparison and, when the model was at hand, the judgement.
pub fn verdict(e2e: &Comparison, j: Option<&Judgement>) -> Verdict {
    let below_floor_cut = j.and_then(|j| {
        j.below_floor
            .iter()
            .map(|b| b.cut())
            .max_by(|a, b| a.total_cmp(b))
    });
    if let Some(tm) = &e2e.token_mismatch {
        return Verdict {
            diverged: true,
            basis: Basis::Tokens,
            place: Some(TapKey::new(tm.step, None, Tap::Embd)),
            named: Some(tm.kind.name().to_string()),
            also: Vec::new(),
            layouts: Vec::new(),
            below_floor_cut,
        };
    }
    let first = j.and_then(|j| j.first.as_ref());
    let e2e_at = e2e.first_divergence.as_ref().map(|d| d.at.key);
    let (basis, place) = match (first, e2e.diverged()) {
        (Some(f), _) => (Basis::OwnError, Some(f.key)),
        (None, true) => (Basis::EndToEnd, e2e_at),
        (None, false) => (Basis::Parity, None),
    };
    Verdict {
        diverged: basis != Basis::Parity,
        basis,
        place,
        named: first.and_then(|f| f.catalog.clone().or(f.confirmed.clone())),
        also: first.map(|f| f.also.clone()).unwrap_or_default(),
        layouts: j
            .map(|j| {
                j.layouts
                    .iter()
                    .map(|l| {
                        l.catalog.clone().unwrap_or_else(|| {
                            format!("{} {}", l.key.tap, l.confirmed.clone().unwrap_or_default())
                        })
                    })
                    .collect()
            })
            .unwrap_or_default(),
        below_floor_cut,
    }
}

/// Everything `diff` concluded: the end-to-end comparison (the picture of drift), the
/// judgement (None without the model), the verdict drawn from both, and the judgement as a
/// comparison (`own_comparison`, labelled with the candidate's producer).
pub struct Diffed {
    pub e2e: Comparison,
    pub judgement: Option<Judgement>,
    pub verdict: Verdict,
    pub own: Option<Comparison>,
}

impl Diffed {
    /// What every report of this `diff` renders and its exit code follows: the judgement
    /// first (it names the cause), then the end-to-end comparison as the picture of drift
    /// (whose tolerances sit above llama.cpp's own spread, so drift past them is a finding
    /// of its own even when every op is within its floor).
    pub fn outcome(&self) -> Outcome {
        Outcome {
            comparisons: self.own.iter().chain([&self.e2e]).cloned().collect(),
            verdict: Some(self.verdict.clone()),
        }
    }
}

/// Every decision of a comparison run (`diff`, `check`), for `report` to render in each
/// format: the comparisons in the reports' order, `diff`'s verdict, and the exit code.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub comparisons: Vec<Comparison>,
    /// `diff`'s verdict; None for `check`, whose comparisons are the verdict.
    pub verdict: Option<Verdict>,
}

impl Outcome {
    /// A run whose comparisons are its verdict (`check`).
    pub fn of(comparisons: Vec<Comparison>) -> Outcome {
        Outcome {
            comparisons,
            verdict: None,
        }
    }

    /// How many comparisons diverged.
    pub fn diverged(&self) -> usize {
        self.comparisons.iter().filter(|c| c.diverged()).count()
    }

    /// A divergence was found: by the verdict, or by any comparison.
    pub fn failed(&self) -> bool {
        self.verdict.as_ref().is_some_and(|v| v.diverged) || self.diverged() > 0
    }

    /// 1 for a divergence, or for numerics that moved against the CI gate's snapshot
    /// (`gate_moved`), else 0.
    pub fn exit_code(&self, gate_moved: bool) -> u8 {
        u8::from(self.failed() || gate_moved)
    }
}

/// `parity diff BASELINE CANDIDATE` as a library call. A layout the candidate declares is
/// undone before the end-to-end comparison too (the judge does the same on load).
pub fn diff(
    baseline: &Trace,
    cand: &Trace,
    model: Option<&Model>,
    opt: &DiffOptions,
) -> Result<Diffed, JudgeError> {
    let aligned = match model {
        Some(m) => aligned_trace(cand, &m.config)?,
        None => None,
    };
    let shown = aligned.as_ref().unwrap_or(cand);
    let mut e2e = compare(baseline, shown, &opt.compare)?;
    let judgement = match model {
        Some(m) => Some(judge(m, cand, &opt.judge)?),
        None => None,
    };
    match (model, &judgement) {
        (Some(m), Some(j)) => follow_the_rounding(&mut e2e, baseline, shown, m, j)?,
        // Without the model the drift is all the evidence there is: every tap held to its
        // end-to-end threshold, the first over it the divergence.
        _ => crate::compare::judge_drift(&mut e2e, baseline, shown)?,
    }
    let verdict = verdict(&e2e, judgement.as_ref());
    let label = format!(
        "{}/{}",
        cand.manifest.producer.name, cand.manifest.producer.backend
    );
    let own = judgement
        .as_ref()
        .map(|j| own_comparison(j, &verdict, &e2e, &label));
    Ok(Diffed {
        e2e,
        judgement,
        verdict,
        own,
    })
}

/// How far past a correct engine of the measured rounding the logits may drift end to end.
pub const FAMILY_MARGIN: f64 = 10.0;

/// The end-to-end bounds on the logits follow the rounding the judgement measured. They were
/// set above llama.cpp's own spread with f32 accumulation; an engine that accumulates in f16
/// (llama.cpp's Vulkan prefill) moves the logits further while every op is within its floor
/// (mean KLD 1.25e-4 over a 1e-4 bound, an F16 model and a 114-token prompt). Where the
/// judgement passed and only the logits crossed their bounds, parity's reference is run end to
/// end under that rounding (each step kind's, the output projection's, the K/V cache), and the
/// bounds become `FAMILY_MARGIN` times what it drifts against the same baseline, never lower.
fn follow_the_rounding(
    e2e: &mut Comparison,
    baseline: &Trace,
    cand: &Trace,
    model: &Model,
    j: &Judgement,
) -> Result<(), JudgeError> {
    let logits_only = e2e
        .first_divergence
        .as_ref()
        .is_none_or(|d| d.at.key.tap == Tap::Logits);
    let has_logits = |t: &Trace| t.keys().any(|k| k.tap == Tap::Logits);
    if !(e2e.diverged()
        && e2e.token_mismatch.is_none()
        && e2e.pair == PairKind::DifferentRounding
        && logits_only
        && j.passed()
        && has_logits(baseline)
        && has_logits(cand))
    {
        return Ok(());
    }
    let steps = &cand.manifest.steps;
    let mut b = Reference::new(model, j.rounding, super::replay::n_ctx(steps))
        .with_kv(j.kv)
        .with_output_emulation(j.output_rounding);
    let mut sink = MemorySink::new(TapFilter::regex("^logits$").expect("a fixed pattern"));
    for (i, s) in steps.iter().enumerate() {
        if i == 1
            && let Some(d) = j.decode_rounding
        {
            b.set_emulation(d);
        }
        let pos0 = s.positions.first().copied().unwrap_or(0);
        b.forward(&s.tokens, pos0, s.step, &mut sink)?;
    }
    let clean = Trace::from_memory(
        baseline.manifest.model.clone(),
        Producer {
            name: "parity".into(),
            backend: format!("reference:{}", super::rounding_label(j)),
            version: String::new(),
            settings: serde_json::Value::Null,
        },
        steps.clone(),
        sink.tensors,
    );
    let opt = CompareOptions {
        pair: e2e.pair,
        weight_type: e2e.weight_type,
        require_same_model: false,
    };
    let drift = compare(baseline, &clean, &opt)?;
    if let Some((nmse, kld)) = widen_logit_bounds(e2e, &drift, FAMILY_MARGIN, baseline, cand)? {
        e2e.limits.push(format!(
            "the logits' end-to-end bounds follow the measured rounding ({}): NMSE {nmse:.1e}, mean KLD {kld:.1e}, {FAMILY_MARGIN}x what parity's reference so rounded drifts from this baseline",
            super::rounding_label(j)
        ));
    }
    Ok(())
}

/// The judgement as a comparison (own errors against the floors), so every report format and
/// the exit code render it; the token-id finding of the end-to-end comparison comes first.
pub fn own_comparison(
    j: &Judgement,
    v: &Verdict,
    e2e: &Comparison,
    cand_label: &str,
) -> Comparison {
    // An own error under its floor that a known bug explains is held to the f32 noise level:
    // the flagged key's when it is, and the key the bug was placed at by experiment (where the
    // confirmed hypothesis removes an own error under that key's floor).
    let first = j.first.as_ref().filter(|_| v.basis == Basis::OwnError);
    let explained = |k: TapKey| {
        first.is_some_and(|f| (f.explained && f.flagged == k) || (f.key != f.flagged && f.key == k))
    };
    let results: Vec<TapResult> = j
        .ops
        .iter()
        .map(|o| {
            let held = explained(o.key);
            TapResult {
                key: o.key,
                metrics: o.metrics,
                threshold: if held {
                    super::hypothesis::VISIBLE
                } else {
                    o.floor
                },
                pass: o.pass && !(held && o.metrics.nmse > super::hypothesis::VISIBLE),
                gating: true,
            }
        })
        .collect();
    // One place for the text, the JSON and selftest: the verdict's (where the bug first shows,
    // placed by experiment when it was), none when the ids differ (they are then the verdict).
    let first_divergence = first.zip(v.place).map(|(f, place)| {
        let i = results
            .iter()
            .position(|r| r.key == place)
            .expect("the verdict's place is a judged key");
        Divergence {
            at: results[i].clone(),
            matched_before: crate::compare::matched_before(&results, i),
            diagnosis: match &f.zoom {
                Some(z) => format!("{}; {}", f.text.replace("\n  ", "; "), z.describe()),
                None => f.text.replace("\n  ", "; "),
            },
            position: f.position,
            zoom: f.zoom.clone(),
        }
    });
    Comparison {
        baseline: format!("own inputs/{}", super::rounding_label(j)),
        candidate: cand_label.to_string(),
        pair: PairKind::OwnInputs,
        weight_type: e2e.weight_type,
        token_mismatch: e2e.token_mismatch.clone(),
        results,
        logits: Vec::new(),
        kld_threshold: 0.0,
        first_divergence,
        only_in_baseline: 0,
        only_in_candidate: 0,
        rounding_family: Some(j.rounding.name()),
        output_rounding: j.output_rounding.map(|o| o.name()),
        kv_cache: Some(j.kv.name()),
        kv_cache_decode: j.kv_decode.map(|c| c.name()),
        limits: j.limits(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::LogitStep;

    /// A comparison that diverged only where its logits' mean KLD (`kld`) crosses 1e-4.
    fn comparison(kld: f64) -> Comparison {
        Comparison {
            baseline: "golden".into(),
            candidate: "engine".into(),
            pair: PairKind::DifferentRounding,
            weight_type: GgmlType::Q8_0,
            token_mismatch: None,
            results: Vec::new(),
            logits: vec![LogitStep {
                step: 0,
                kld_mean: kld,
                kld_max: kld,
                top1_agree: 1,
                rows: 1,
                top5_overlap_mean: 1.0,
            }],
            kld_threshold: 1e-4,
            first_divergence: None,
            only_in_baseline: 0,
            only_in_candidate: 0,
            rounding_family: None,
            output_rounding: None,
            kv_cache: None,
            kv_cache_decode: None,
            limits: Vec::new(),
        }
    }

    fn verdict(diverged: bool) -> Verdict {
        Verdict {
            diverged,
            basis: if diverged {
                Basis::OwnError
            } else {
                Basis::Parity
            },
            place: None,
            named: None,
            also: Vec::new(),
            layouts: Vec::new(),
            below_floor_cut: None,
        }
    }

    #[test]
    fn the_exit_code_is_the_outcome_s() {
        let clean = Outcome::of(vec![comparison(1e-6), comparison(1e-6)]);
        assert_eq!((clean.diverged(), clean.failed()), (0, false));
        assert_eq!(clean.exit_code(false), 0);
        // Numerics that moved against the gate's snapshot fail a clean run.
        assert_eq!(clean.exit_code(true), 1);
        let one = Outcome::of(vec![comparison(1e-6), comparison(1e-3)]);
        assert_eq!((one.diverged(), one.exit_code(false)), (1, 1));
        // diff's verdict fails the run even where no comparison diverged (a bug under the
        // floors is confirmed on the verdict), and passes it only where none did.
        let judged = Outcome {
            comparisons: vec![comparison(1e-6)],
            verdict: Some(verdict(true)),
        };
        assert_eq!((judged.diverged(), judged.exit_code(false)), (0, 1));
        let passed = Outcome {
            comparisons: vec![comparison(1e-3)],
            verdict: Some(verdict(false)),
        };
        assert_eq!(passed.exit_code(false), 1);
    }
}
