//! Renders a Comparison for people (a per-layer table and a one-paragraph verdict) and for
//! machines (JSON via serde). Knows compare and trace only.

use crate::compare::Comparison;
use crate::trace::Tap;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Short column headers for the per-layer table, in graph order.
const COLUMNS: [(Tap, &str); 16] = [
    (Tap::AttnNorm, "a_norm"),
    (Tap::Q, "q"),
    (Tap::K, "k"),
    (Tap::V, "v"),
    (Tap::QRope, "q_rope"),
    (Tap::KRope, "k_rope"),
    (Tap::KqSoftMax, "probs"),
    (Tap::KqvOut, "kqv"),
    (Tap::AttnOut, "a_out"),
    (Tap::FfnInp, "f_inp"),
    (Tap::FfnNorm, "f_norm"),
    (Tap::FfnGate, "gate"),
    (Tap::FfnUp, "up"),
    (Tap::FfnAct, "act"),
    (Tap::FfnOut, "f_out"),
    (Tap::LOut, "l_out"),
];

/// log10 of an NMSE for a table cell: `-13.2`, `  0` for exact, `inf`.
fn cell(nmse: f64, fail: bool) -> String {
    let s = if nmse == 0.0 {
        "exact".to_string()
    } else if nmse.is_infinite() {
        "inf".to_string()
    } else {
        format!("{:.1}", nmse.log10())
    };
    if fail { format!("{s}!") } else { s }
}

/// The per-layer table: worst NMSE over all steps for each (layer, tap), as log10.
pub fn table(c: &Comparison) -> String {
    let mut worst: BTreeMap<(Option<usize>, Tap), (f64, bool)> = BTreeMap::new();
    for r in &c.results {
        let e = worst
            .entry((r.key.layer, r.key.tap))
            .or_insert((0.0, false));
        e.0 = e.0.max(r.metrics.nmse);
        e.1 |= !r.pass;
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "log10 NMSE, worst over steps ('exact' = bit-identical, '!' = over threshold)"
    );
    let _ = write!(out, "{:>7}", "layer");
    for (_, h) in COLUMNS {
        let _ = write!(out, " {h:>6}");
    }
    out.push('\n');
    let layers: Vec<usize> = {
        let mut v: Vec<usize> = worst.keys().filter_map(|(l, _)| *l).collect();
        v.dedup();
        v
    };
    if let Some(&(e, f)) = worst.get(&(None, Tap::Embd)) {
        let _ = writeln!(out, "{:>7} embd {}", "-", cell(e, f));
    }
    for l in layers {
        let _ = write!(out, "{l:>7}");
        for (tap, _) in COLUMNS {
            let s = match worst.get(&(Some(l), tap)) {
                Some(&(e, f)) => cell(e, f),
                None => "-".into(),
            };
            let _ = write!(out, " {s:>6}");
        }
        out.push('\n');
    }
    let mut tail = Vec::new();
    for tap in [Tap::ResultNorm, Tap::Logits] {
        if let Some(&(e, f)) = worst.get(&(None, tap)) {
            tail.push(format!("{tap} {}", cell(e, f)));
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
        let _ = writeln!(
            out,
            "logits over {} steps: KLD mean ≤ {kld_mean:.2e} (max {kld_max:.2e}, threshold {:.0e}), top-1 agree {top1}/{rows}, top-5 overlap {top5:.2}/5",
            c.logits.len(),
            c.kld_threshold
        );
    }
    out
}

/// One paragraph: parity, or where and why it first diverged.
pub fn verdict(c: &Comparison) -> String {
    let who = format!("{} vs {}", c.candidate, c.baseline);
    if let Some(t) = &c.token_mismatch {
        return format!(
            "DIVERGED ({who}): the token ids differ before any tensor is compared — step {} index {}: baseline {:?}, candidate {:?}. Both runs must see the same ids (BOS policy, chat template, tokenizer); compare the ids first.",
            t.step, t.index, t.baseline, t.candidate
        );
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
            let what = if m.non_finite_failure() {
                format!(
                    "non-finite values (NaN in baseline {}, in candidate {}, unmatched Inf {}); on the finite rest NMSE {:.3e}",
                    m.nan_a, m.nan_b, m.inf_mismatch, m.nmse
                )
            } else {
                format!("NMSE {:.3e}", m.nmse)
            };
            format!(
                "DIVERGED ({who}, {} weights, {}): first divergence at {} — {what} over the threshold {:.0e} (cosine {:.6}, max |Δ| {:.3e}, SQNR {:.1} dB). Still matching just before: {}. Likely cause: {}.",
                c.weight_type,
                pair_name(c),
                d.at.key,
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
            let worst = c.results.iter().max_by(|a, b| {
                (a.metrics.nmse / a.threshold).total_cmp(&(b.metrics.nmse / b.threshold))
            });
            let top1: usize = c.logits.iter().map(|l| l.top1_agree).sum();
            let rows: usize = c.logits.iter().map(|l| l.rows).sum();
            format!(
                "PARITY ({who}, {} weights, {}): all {n} taps over {steps} steps within tolerance{}; top-1 agreement {top1}/{rows}.{}",
                c.weight_type,
                pair_name(c),
                worst
                    .map(|w| format!(
                        "; closest to its threshold: {} (NMSE {:.1e} vs {:.0e})",
                        w.key, w.metrics.nmse, w.threshold
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

fn pair_name(c: &Comparison) -> &'static str {
    match c.pair {
        crate::compare::PairKind::SameRounding => "same activation rounding",
        crate::compare::PairKind::DifferentRounding => "different activation rounding",
        crate::compare::PairKind::OpByOp => "op by op on the baseline's inputs",
    }
}
