//! Renders comparisons: for people (a per-layer table coloured by closeness to the threshold, a
//! one-paragraph verdict, an HTML page), for machines (a versioned JSON schema) and for CI (a
//! bucketed snapshot and the gate against it); a judgement's own text (judgement.rs). Decides
//! nothing: what diverged and the exit code are the run's `judge::verdict::Outcome`.

pub mod html;
pub mod info;
pub mod json;
pub mod judgement;
pub mod progress;
pub mod shown;
pub mod snapshot;

pub use info::{RunInfo, TraceInfo};
pub use judgement::judgement;
pub use shown::shown;

use crate::compare::{Comparison, PairKind};
use crate::trace::Tap;
use anstyle::{AnsiColor, Style};
use std::collections::BTreeMap;
use std::fmt::Write;

/// Short column headers for the per-layer table, in graph order.
/// The newer architectures' taps (q/k norms, post-norms) only appear in tables of models that
/// record them.
pub(crate) const COLUMNS: [(Tap, &str); 20] = [
    (Tap::AttnNorm, "a_norm"),
    (Tap::Q, "q"),
    (Tap::K, "k"),
    (Tap::V, "v"),
    (Tap::QNormed, "q_norm"),
    (Tap::KNormed, "k_norm"),
    (Tap::QRope, "q_rope"),
    (Tap::KRope, "k_rope"),
    (Tap::KqSoftMax, "probs"),
    (Tap::KqvOut, "kqv"),
    (Tap::AttnOut, "a_out"),
    (Tap::AttnPostNorm, "a_post"),
    (Tap::FfnInp, "f_inp"),
    (Tap::FfnNorm, "f_norm"),
    (Tap::FfnGate, "gate"),
    (Tap::FfnUp, "up"),
    (Tap::FfnAct, "act"),
    (Tap::FfnOut, "f_out"),
    (Tap::FfnPostNorm, "f_post"),
    (Tap::LOut, "l_out"),
];

/// The taps outside the layers: before them, and after them.
pub(crate) const BEFORE_LAYERS: [Tap; 2] = [Tap::Embd, Tap::EmbdScaled];
pub(crate) const AFTER_LAYERS: [Tap; 3] = [Tap::ResultNorm, Tap::LogitsUncapped, Tap::Logits];

/// log10 of an NMSE for a table cell: `-13.2`, `exact`, `inf`, `NaN` or `Inf` where a side
/// holds one (the NMSE is then the finite rest's), with `!` when over threshold.
fn cell(nmse: f64, fail: bool, non_finite: Option<&str>) -> String {
    let s = if let Some(w) = non_finite {
        w.to_string()
    } else if nmse == 0.0 {
        "exact".to_string()
    } else if nmse.is_infinite() {
        "inf".to_string()
    } else {
        format!("{:.1}", nmse.log10())
    };
    if fail { format!("{s}!") } else { s }
}

/// Whether stdout takes colour: a terminal, and neither NO_COLOR nor CLICOLOR=0 set
/// (CLICOLOR_FORCE forces it), as anstream decides.
pub fn colour_stdout() -> bool {
    anstream::AutoStream::choice(&std::io::stdout()) != anstream::ColorChoice::Never
}

/// The style of a value by how close it sits to its threshold: red over it, yellow within a
/// factor 10, plain within 1000, green further below, dim green when bit-identical.
pub fn closeness_style(nmse: f64, threshold: f64, fail: bool) -> Style {
    let ratio = nmse / threshold;
    if fail || !ratio.is_finite() && nmse != 0.0 {
        Style::new().fg_color(Some(AnsiColor::Red.into())).bold()
    } else if nmse == 0.0 {
        Style::new()
            .fg_color(Some(AnsiColor::Green.into()))
            .dimmed()
    } else if ratio > 0.1 {
        Style::new().fg_color(Some(AnsiColor::Yellow.into()))
    } else if ratio > 1e-3 {
        Style::new()
    } else {
        Style::new().fg_color(Some(AnsiColor::Green.into()))
    }
}

/// `text` right-aligned in `width`, wrapped in `style`'s escape codes when `colour`.
fn paint(text: &str, width: usize, style: Style, colour: bool) -> String {
    if colour {
        format!("{style}{text:>width$}{style:#}")
    } else {
        format!("{text:>width$}")
    }
}

/// The per-layer table, coloured when stdout takes colour ([`colour_stdout`]).
pub fn table(c: &Comparison) -> String {
    table_styled(c, colour_stdout())
}

/// The per-layer table: worst NMSE over all steps for each (layer, tap), as log10; with
/// `colour`, each cell coloured by [`closeness_style`].
pub fn table_styled(c: &Comparison, colour: bool) -> String {
    // (layer, tap) -> (worst NMSE, its threshold, any step failed)
    // (layer, tap) -> (worst NMSE, its threshold, any step failed, a non-finite value's kind)
    type Worst = (f64, f64, bool, Option<&'static str>);
    let mut worst: BTreeMap<(Option<usize>, Tap), Worst> = BTreeMap::new();
    for r in &c.results {
        let e = worst
            .entry((r.key.layer, r.key.tap))
            .or_insert((0.0, r.threshold, false, None));
        if r.metrics.nmse > e.0 {
            e.0 = r.metrics.nmse;
            e.1 = r.threshold;
        }
        e.2 |= !r.pass;
        let m = &r.metrics;
        if m.nan_a + m.nan_b > 0 {
            e.3 = Some("NaN");
        } else if m.inf_a + m.inf_b > 0 {
            e.3 = e.3.or(Some("Inf"));
        }
    }
    let show = |&(e, t, f, nf): &Worst, width: usize| {
        paint(&cell(e, f, nf), width, closeness_style(e, t, f), colour)
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "log10 NMSE, worst over steps ('exact' = bit-identical, '!' = over threshold)"
    );
    // Only the columns this comparison has (a llama model records no q_norm).
    let columns: Vec<(Tap, &str)> = COLUMNS
        .into_iter()
        .filter(|(t, _)| worst.keys().any(|(l, x)| l.is_some() && x == t))
        .collect();
    let _ = write!(out, "{:>7}", "layer");
    for (_, h) in &columns {
        let _ = write!(out, " {h:>6}");
    }
    out.push('\n');
    let layers: Vec<usize> = {
        let mut v: Vec<usize> = worst.keys().filter_map(|(l, _)| *l).collect();
        v.dedup();
        v
    };
    let head: Vec<String> = BEFORE_LAYERS
        .iter()
        .filter_map(|&tap| {
            worst
                .get(&(None, tap))
                .map(|w| format!("{tap} {}", show(w, 0)))
        })
        .collect();
    if !head.is_empty() {
        let _ = writeln!(out, "{:>7} {}", "-", head.join("  "));
    }
    for l in layers {
        let _ = write!(out, "{l:>7}");
        for &(tap, _) in &columns {
            let s = match worst.get(&(Some(l), tap)) {
                Some(w) => show(w, 6),
                None => format!("{:>6}", "-"),
            };
            let _ = write!(out, " {s}");
        }
        out.push('\n');
    }
    let mut tail = Vec::new();
    for tap in AFTER_LAYERS {
        if let Some(w) = worst.get(&(None, tap)) {
            tail.push(format!("{tap} {}", show(w, 0)));
        }
    }
    if !tail.is_empty() {
        let _ = writeln!(out, "{:>7} {}", "out", tail.join("  "));
    }
    if !c.logits.is_empty() {
        let kld_mean = c.logits.iter().map(|l| l.kld_mean).fold(0.0, f64::max);
        let kld_max = c.logits.iter().map(|l| l.kld_max).fold(0.0, f64::max);
        let top1: usize = c.logits.iter().map(|l| l.top1_agree).sum();
        let rows: usize = c.logits.iter().map(|l| l.rows).sum();
        let top5 = c
            .logits
            .iter()
            .map(|l| l.top5_overlap_mean * l.rows as f64)
            .sum::<f64>()
            / rows.max(1) as f64;
        let kld = paint(
            &format!("{kld_mean:.2e}"),
            0,
            closeness_style(kld_mean, c.kld_threshold, kld_mean > c.kld_threshold),
            colour,
        );
        let _ = writeln!(
            out,
            "logits over {} steps: KLD mean ≤ {kld} (max {kld_max:.2e}, threshold {:.0e}), top-1 agree {top1}/{rows}, top-5 overlap {top5:.2}/5",
            c.logits.len(),
            c.kld_threshold
        );
        // A comparison that passed has no verdict paragraph of its own to carry its limits
        // (the logits' bounds raised to the measured rounding's drift).
        if !c.diverged() && !c.limits.is_empty() && c.pair == PairKind::DifferentRounding {
            let _ = writeln!(out, "limits: {}", c.limits.join("; "));
        }
    }
    out
}

/// One paragraph: parity, or where and why it first diverged, with what the comparison cannot
/// see (`Comparison::limits`) in the same words.
pub fn verdict(c: &Comparison) -> String {
    let mut v = verdict_only(c);
    if !c.limits.is_empty() {
        v.push_str(&format!(
            " Limits of this verdict: {}.",
            c.limits.join("; ")
        ));
    }
    v
}

fn verdict_only(c: &Comparison) -> String {
    // The labels are the manifests' producer names: escaped, so no value can start a line.
    let who = format!("{} vs {}", shown(&c.candidate), shown(&c.baseline));
    if let Some(t) = &c.token_mismatch {
        return token_verdict(c, t, &who);
    }
    let n = c.results.len();
    let steps = c
        .results
        .iter()
        .map(|r| r.key.step)
        .max()
        .map_or(0, |s| s + 1);
    match &c.first_divergence {
        Some(d) => {
            let m = &d.at.metrics;
            let before: Vec<String> = d
                .matched_before
                .iter()
                .map(|r| format!("{} (NMSE {:.1e})", r.key, r.metrics.nmse))
                .collect();
            if m.non_finite_failure() {
                // The finding is the value itself: no NMSE, no cause read into it.
                return format!(
                    "DIVERGED ({who}, {} weights, {}): {}.",
                    c.weight_type,
                    pair_name(c),
                    d.diagnosis
                );
            }
            let what = format!("NMSE {:.3e}", m.nmse);
            // The key first, then where in the step ("… l_out from position 13 (…)").
            let at = match &d.position {
                Some(p) if p.rows > 1 => format!("{} from {}", d.at.key, p.describe()),
                Some(p) => format!("{} at {}", d.at.key, p.describe()),
                None => d.at.key.to_string(),
            };
            format!(
                "DIVERGED ({who}, {} weights, {}): first divergence at {} — {what} over the threshold {:.0e} (cosine {:.6}, max |Δ| {:.3e}, SQNR {:.1} dB). Still matching just before: {}. Likely cause: {}.",
                c.weight_type,
                pair_name(c),
                at,
                d.at.threshold,
                m.cosine,
                m.max_abs,
                m.sqnr_db,
                if before.is_empty() {
                    "nothing".into()
                } else {
                    before.join(", ")
                },
                d.diagnosis
            )
        }
        None if c.diverged() => {
            let worst = c
                .logits
                .iter()
                .max_by(|a, b| a.kld_mean.total_cmp(&b.kld_mean))
                .expect("kld failure implies logits");
            format!(
                "DIVERGED ({who}): every tap is within tolerance but the logits' mean KLD {:.3e} at step {} exceeds {:.0e}.",
                worst.kld_mean, worst.step, c.kld_threshold
            )
        }
        None => {
            // Taps drawn as drift (different roundings, end to end) have no threshold to be
            // close to.
            let worst = c.results.iter().filter(|r| r.gating).max_by(|a, b| {
                (a.metrics.nmse / a.threshold).total_cmp(&(b.metrics.nmse / b.threshold))
            });
            let drift = c.results.iter().filter(|r| !r.gating).max_by(|a, b| {
                (a.metrics.nmse / a.threshold).total_cmp(&(b.metrics.nmse / b.threshold))
            });
            let top1: usize = c.logits.iter().map(|l| l.top1_agree).sum();
            let rows: usize = c.logits.iter().map(|l| l.rows).sum();
            // A judgement of own errors has no logits of its own to agree on.
            let agreement = if rows > 0 {
                format!("; top-1 agreement {top1}/{rows}")
            } else {
                String::new()
            };
            format!(
                "PARITY ({who}, {} weights, {}): all {n} taps over {steps} steps within tolerance{}{agreement}.{}{}",
                c.weight_type,
                pair_name(c),
                worst
                    .map(|w| format!(
                        "; closest to its threshold: {} (NMSE {:.1e} vs {:.0e})",
                        w.key, w.metrics.nmse, w.threshold
                    ))
                    .unwrap_or_default(),
                drift
                    .map(|w| format!(
                        " Between different roundings the intermediate taps are drift, not a verdict (each op is judged on its own inputs): the largest at {} (NMSE {:.1e}).",
                        w.key, w.metrics.nmse
                    ))
                    .unwrap_or_default(),
                if c.only_in_baseline + c.only_in_candidate > 0 {
                    format!(
                        " Not compared: {} taps only in the baseline, {} only in the candidate.",
                        c.only_in_baseline, c.only_in_candidate
                    )
                } else {
                    String::new()
                }
            )
        }
    }
}

/// Different ids are the finding: name the difference, show both sequences, and say what
/// was still compared.
fn token_verdict(c: &Comparison, t: &crate::compare::TokenMismatch, who: &str) -> String {
    use crate::compare::TokenDiff;
    let first = t.baseline_ids.first().copied().unwrap_or_default();
    let cause = match t.kind {
        TokenDiff::FirstMissing => format!(
            "the candidate lacks the first id {first} (BOS): the engine does not add BOS, or its chat template drops it"
        ),
        TokenDiff::FirstDoubled => format!(
            "the candidate starts with id {first} twice (BOS doubled): a template or prompt that already has BOS, tokenized with add_bos on"
        ),
        TokenDiff::FirstExtra => format!(
            "the candidate has an extra first id {} the baseline lacks (BOS added where the model's add_bos_token says not to)",
            t.candidate_ids.first().copied().unwrap_or_default()
        ),
        TokenDiff::Wrapped => format!(
            "the candidate wraps the baseline's ids in {} extra ones: a chat template (or system prompt) applied on one side only",
            t.candidate_ids.len().saturating_sub(t.baseline_ids.len())
        ),
        TokenDiff::Other if t.step > 0 => format!(
            "decode step {} fed another id: teacher-force the golden's decode ids (its manifest lists them) instead of sampling",
            t.step
        ),
        TokenDiff::Other => {
            "other ids: another tokenizer or pre-tokenizer, other text, or another BOS/EOS policy"
                .into()
        }
    };
    let ids = |v: &[u32]| {
        let s: Vec<String> = v.iter().take(24).map(|x| x.to_string()).collect();
        if v.len() > 24 {
            format!("[{} … ({} ids)]", s.join(" "), v.len())
        } else {
            format!("[{}]", s.join(" "))
        }
    };
    // Decoded token text: `{:?}` escapes it, the cap bounds it.
    let text = |x: &Option<String>| {
        x.as_ref()
            .map(|s| format!(" {:?}", shown::capped(s, shown::MAX_VALUE)))
            .unwrap_or_default()
    };
    let aligned = c
        .results
        .iter()
        .find(|r| r.key.step == t.step && r.key.tap == crate::trace::Tap::Embd)
        .map(|r| {
            if r.pass {
                format!(
                    " The embedding rows of the ids that line up match ({}).",
                    if r.metrics.nmse == 0.0 {
                        "bit-identical".to_string()
                    } else {
                        format!("NMSE {:.1e}", r.metrics.nmse)
                    }
                )
            } else {
                format!(
                    " Even the embedding rows of the ids that line up differ (NMSE {:.1e}).",
                    r.metrics.nmse
                )
            }
        })
        .unwrap_or_default();
    let earlier = if t.step > 0 {
        format!(
            " Steps before {} were compared: {} taps, {}.",
            t.step,
            c.results.iter().filter(|r| r.key.step < t.step).count(),
            if c.first_divergence.is_some() {
                "with a divergence (see the table)"
            } else {
                "all within tolerance"
            }
        )
    } else {
        String::new()
    };
    format!(
        "DIVERGED ({who}): token ids differ ({}) at step {} index {} — {cause}.\n  baseline  {}{}\n  candidate {}{}\nNothing computed from different ids is compared.{aligned}{earlier}",
        t.kind.name(),
        t.step,
        t.index,
        ids(&t.baseline_ids),
        text(&t.baseline_text),
        ids(&t.candidate_ids),
        text(&t.candidate_text),
    )
}

fn pair_name(c: &Comparison) -> &'static str {
    match c.pair {
        crate::compare::PairKind::SameRounding => "same activation rounding",
        crate::compare::PairKind::DifferentRounding => "different activation rounding",
        crate::compare::PairKind::OpByOp => "op by op on the baseline's inputs",
        crate::compare::PairKind::OwnInputs => "each op on its own inputs",
    }
}
