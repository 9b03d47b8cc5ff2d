//! A judgement for people: the rounding measured (per step kind, output projection, K/V
//! cache), a summary per step, what was tested under the floors, and the finding.

use crate::judge::replay::KvCache;
use crate::judge::{EXACT_FIT, Judgement, RoundingFit, rounding_label, rounding_name};
use crate::judge::{ambiguity, hypothesis};
use std::collections::BTreeSet;
use std::fmt::Write;

/// Each fit as `NAME NMSE`, comma-separated.
fn fits_text(fits: &[RoundingFit]) -> String {
    let v: Vec<String> = fits
        .iter()
        .map(|f| format!("{} {:.1e}", f.rounding.name(), f.median_nmse))
        .collect();
    v.join(", ")
}

/// The judgement for people: the rounding, a per-step summary, the finding.
pub fn judgement(j: &Judgement) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "== own error: each op recomputed by the reference from the candidate's own inputs"
    );
    if !j.fits.is_empty() {
        let fits = fits_text(&j.fits);
        let _ = writeln!(
            s,
            "rounding that reproduces the engine: {} ({}median matmul own NMSE: {}{})",
            rounding_name(j.rounding),
            if j.remeasured {
                "measured again with the bug in view, see the finding; first measured: "
            } else {
                ""
            },
            fits,
            if j.fits.last().is_some_and(|f| f.median_nmse <= EXACT_FIT) {
                "; an exact fit ends the search"
            } else {
                ""
            }
        );
        if !j.remeasured && !j.fits.iter().any(|f| f.rounding == j.rounding) {
            let _ = writeln!(
                s,
                "  named by its twins: on the best fit's matmul grid it reproduces keys the best fit does not (a rounding tie, or the GELU), and none worse"
            );
        }
    } else {
        let _ = writeln!(s, "rounding (given): {}", rounding_name(j.rounding));
    }
    if let Some(d) = j.decode_rounding {
        let fits = fits_text(&j.decode_fits);
        let _ = writeln!(
            s,
            "per step kind: {} (the first decode step's median matmul own NMSE, the prefill under {}: {}); decode: {}",
            rounding_label(j),
            j.rounding.name(),
            fits,
            rounding_name(d)
        );
    }
    if let Some(o) = j.output_rounding {
        let fits = fits_text(&j.output_fits);
        let _ = writeln!(
            s,
            "output projection: {} (the first step's logits own NMSE under each: {}); the layers: {}",
            rounding_name(o),
            fits,
            j.rounding.name()
        );
    }
    if j.kv_fits.len() > 1 {
        let fits: Vec<String> = j
            .kv_fits
            .iter()
            .map(|f| format!("{}: {:.1e}", f.kv.name(), f.median_nmse))
            .collect();
        let _ = writeln!(
            s,
            "K/V cache that reproduces the engine: {} (median own NMSE through attention: {})",
            j.kv.name(),
            fits.join("; ")
        );
    } else if j.kv != KvCache::F32 {
        let _ = writeln!(s, "K/V cache (given): {}", j.kv.name());
    }
    if j.kv_decode_fits.len() > 1 {
        let d = j.kv_decode.unwrap_or(j.kv);
        let fits: Vec<String> = j
            .kv_decode_fits
            .iter()
            .map(|f| format!("{}: {:.1e}", f.kv.name(), f.median_nmse))
            .collect();
        // The first fit is the prompt's cache as first measured; another kept now was taken
        // from the decode steps (no cache reproduced the prompt's attention).
        let prompt = j.kv_decode_fits[0].kv;
        let _ = if prompt != j.kv {
            writeln!(
                s,
                "K/V cache per step kind: no cache reproduced the prompt's attention; the first decode step's says {} for both step kinds (its median own NMSE through attention, the prompt under {}: {})",
                j.kv.name(),
                prompt.name(),
                fits.join("; ")
            )
        } else {
            writeln!(
                s,
                "K/V cache per step kind: the decode steps read it as {}{} (the first decode step's median own NMSE through attention, the prompt under {}: {})",
                d.name(),
                if j.kv_decode.is_none() { " too" } else { "" },
                j.kv.name(),
                fits.join("; ")
            )
        };
    }
    if !j.aligned.is_empty() {
        let _ = writeln!(s, "declared layouts aligned: {}", j.aligned.join(", "));
    }
    if !j.ties.is_empty() {
        let twins: BTreeSet<&str> = j.ties.iter().map(|(_, t)| t.name()).collect();
        let _ = writeln!(
            s,
            "rounding twins: {} keys reproduced closer by {} (the same matmul grid with the other tie rule, or GELU in f32 instead of ggml-cpu's f16 table: an element on a tie may take either neighbour; judged under it, never a finding)",
            j.ties.len(),
            twins.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    let spans = j.ops.iter().filter(|o| o.span_ops > 1).count();
    let _ = writeln!(
        s,
        "{} keys judged ({} on their own, {} as spans of ops the trace has no taps inside); matmul floor {:.0e}",
        j.ops.len(),
        j.ops.len() - spans,
        spans,
        j.matmul_floor
    );
    let mut by_step: std::collections::BTreeMap<usize, (usize, usize, f64, f64)> =
        Default::default();
    for o in &j.ops {
        let e = by_step.entry(o.key.step).or_insert((0, 0, 0.0, 0.0));
        e.0 += 1;
        e.1 += !o.pass as usize;
        // Worst margin: own NMSE / floor.
        let ratio = if o.floor > 0.0 {
            o.own_nmse / o.floor
        } else {
            0.0
        };
        if ratio > e.2 {
            e.2 = ratio;
            e.3 = o.own_nmse;
        }
    }
    for (step, (n, bad, ratio, _)) in &by_step {
        let _ = writeln!(
            s,
            "  step {step}: {n} keys, {bad} out of their floor, worst own/floor {}",
            if *ratio > 0.0 {
                format!("{ratio:.1e}")
            } else {
                "0 (exact)".into()
            }
        );
    }
    if !j.below_floor.is_empty() {
        let checks: Vec<String> = j
            .below_floor
            .iter()
            .map(|b| match &b.best {
                Some(t) => format!(
                    "{} {:.1e} (best {} {:.1e}, cut {}{})",
                    b.key,
                    b.own_nmse,
                    t.hypothesis,
                    t.nmse,
                    match b.cut() {
                        c if c < 100.0 => format!("{c:.1}×"),
                        c => format!("{c:.1e}×"),
                    },
                    match (b.ambiguity, &b.not_held) {
                        (Some(d), _) if !b.explained() => format!(
                            "; within {f:.0}× of what the engine's own sums may flip there, {d:.1e}: a tie, not the bug", f = ambiguity::FACTOR
                        ),
                        (_, Some(why)) => format!("; not the engine's: {why}"),
                        _ => String::new(),
                    }
                ),
                None => format!("{} {:.1e} (no hypothesis applies)", b.key, b.own_nmse),
            })
            .collect();
        let _ = writeln!(
            s,
            "under the floors, tested by experiment (a known bug that cuts an own error {:.0}× is a finding): {}",
            hypothesis::EXPLAINS,
            checks.join("; ")
        );
    }
    match &j.first {
        None => {
            let _ = writeln!(s, "own error: every op within its noise floor");
        }
        Some(f) => {
            let _ = writeln!(s, "{}", f.text);
            if let Some(p) = f.position {
                let _ = writeln!(s, "  first at {}", p.describe());
            }
            if let Some(z) = &f.zoom {
                let _ = writeln!(s, "  {}", z.describe());
            }
        }
    }
    s
}
